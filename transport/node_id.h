/* node_id.h - asks a server for its stable identity (--node-id) over gRPC.
 *
 * Clients rank servers by node id, not by the address they dialed (membership.h); this
 * is the question they ask at connect time: a Stats call with identity_only set, which
 * needs a valid token where auth is on, but no namespace grant.
 */
#ifndef TQKV_TRANSPORT_NODE_ID_H
#define TQKV_TRANSPORT_NODE_ID_H

#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

/* Asks the server behind ch (borrowed) within timeout_ms, sending md[nmd] (borrowed; the
 * authorization header, may be empty) as initial metadata. Returns 0 with the id in
 * out (NUL-terminated; "" when the server reports none: a server older than node ids),
 * or -1 when the call failed, with the reason in why. Thread-safe. */
int tqkv__node_id_query(grpc_channel *ch, const grpc_metadata *md, size_t nmd, uint32_t timeout_ms,
                        char *out, size_t cap, char *why, size_t whylen);

#endif
