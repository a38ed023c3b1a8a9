/* client_server.h - what of libtqkv only tqkv-server (service/forward.c, handoff.c) and
 * the tests use: not installed, not exported from libtqkv.so (docs/api.md, "Internal").
 *
 * The server links the static library (transport/CMakeLists.txt: tqkv), where these
 * are defined next to the public functions.
 */
#ifndef TQKV_TRANSPORT_CLIENT_SERVER_H
#define TQKV_TRANSPORT_CLIENT_SERVER_H

#include <stdint.h>

#include "kernels/page.h"
#include "transport/client.h"
#include "transport/client_bulk.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How a server talks to its peers (forwarding, hand-off). */
typedef struct tqkv_client_peer_opts {
    const char *exclude_node_id; /* leave out the server with this node id (a server that
                                    talks to its peers: itself) */
    int hop; /* every call carries "tqkv-hop" (docs/cluster.md, service/forward.h):
                2: "2", a server's ask of its peers (forwarding, read-through): the peer
                answers from its store alone, never asks further (no loops);
                1: "1", the caller routed it itself: no forwarding, but an owner reads
                through what it lacks. A client with several targets always sends "1" (it
                shards itself); with one target none, so a server with --peers forwards
                for it */
    const char *hello_node_id; /* NULL, or this server's node id: the node-id questions
                                  carry "tqkv-peer-hello: <it>", so a peer learns that this
                                  server (re)started or joined (service/replicate.c: the
                                  peers' client alone, not a pass's or the hand-off's) */
} tqkv_client_peer_opts_t;

/* tqkv_client_create with the peer options p (NULL = none: tqkv_client_create). */
tqkv_status_t tqkv_client_create_peer(const tqkv_client_opts_t *o, const tqkv_client_peer_opts_t *p,
                                      tqkv_client_t **out);

/* For a server that forwards a caller's request with the caller's credentials: until the
 * next call with NULL, the calls the calling thread starts (through any client) send
 * "authorization: <authz>" (the caller's header value, borrowed until then) instead of
 * the client's token. Background threads (membership, read repair) keep the client's. */
void tqkv_client_thread_authz(const char *authz);

/* The rendezvous id target i ranks by (tqkv_shard_target_id of its node id, or of its
 * address); 0 for no such target. (forward.c ranks blocks over the peers with it.) */
uint64_t tqkv_client_target_rank_id(const tqkv_client_t *c, size_t i);

/* Waits up to timeout_ms until the read repair queue is empty and idle: 0, or -1
 * (tests; the Python package polls tqkv_client_repair_stats instead). */
int tqkv_client_repair_wait(tqkv_client_t *c, uint32_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif
