/* status_map.c - tqkv_status_t -> grpc_status_code (see status_map.h); the table is
 * transport/status_grpc.h, shared with libtqkv. */
#include "service/status_map.h"

#include "transport/status_grpc.h"

grpc_status_code
tqkv_status_to_grpc(tqkv_status_t st)
{
    return tqkv__status_to_grpc_code(st);
}

grpc_status_code
tqkv_status_to_grpc_input(tqkv_status_t st)
{
    if (st == TQKV_ECORRUPT)
        return GRPC_STATUS_INVALID_ARGUMENT;
    return tqkv_status_to_grpc(st);
}
