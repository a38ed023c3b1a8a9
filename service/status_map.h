/* status_map.h - tqkv_status_t -> grpc_status_code: the only place in tqkv where
 * the translation happens.
 */
#ifndef TQKV_SERVICE_STATUS_MAP_H
#define TQKV_SERVICE_STATUS_MAP_H

#include <grpc/status.h>

#include "kernels/status.h"

/* Status of a server-side operation (store, codec, auth). ECORRUPT here means
 * stored data went bad: DATA_LOSS. */
grpc_status_code tqkv_status_to_grpc(tqkv_status_t st);

/* Status of validating client input: every format or range problem is the
 * client's (INVALID_ARGUMENT); auth and resource statuses map as above. */
grpc_status_code tqkv_status_to_grpc_input(tqkv_status_t st);

#endif
