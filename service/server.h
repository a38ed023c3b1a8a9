/* server.h - tqkv-server: the gRPC service (tqkv.v1.KVCache, grpc.health.v1.Health,
 * server reflection v1 and v1alpha) on the gRPC C core.
 *
 * Lifecycle: create (store, pools, credentials, bind) -> start (workers serve) ->
 * shutdown (NOT_SERVING, stop accepting, drain, cancel, P7 order) -> destroy.
 */
#ifndef TQKV_SERVICE_SERVER_H
#define TQKV_SERVICE_SERVER_H

#include <stddef.h>

#include "kernels/status.h"
#include "service/config.h"

typedef struct tqkv_server tqkv_server_t;

/* Creates the store, encoder pool, metrics, auth and credentials, and binds
 * cfg->listen. Borrows cfg (copied). On failure returns a status with one line in
 * err. *out owned by the caller (tqkv_server_destroy). */
tqkv_status_t tqkv_server_create(const tqkv_server_config_t *cfg, tqkv_server_t **out, char *err,
                                 size_t errlen);

/* Starts the worker threads; the service answers calls from here on. */
tqkv_status_t tqkv_server_start(tqkv_server_t *s);

/* The bound gRPC port (the real one when the config asked for port 0). */
int tqkv_server_port(const tqkv_server_t *s);
/* The server's identity (--node-id, or HOSTNAME:PORT); valid while s is. */
const char *tqkv_server_node_id(const tqkv_server_t *s);
/* The bound metrics port, 0 when metrics are off. */
int tqkv_server_metrics_port(const tqkv_server_t *s);

/* Hand-off on drain (handoff.c): with --peers and --handoff-seconds > 0, sets health
 * NOT_SERVING and puts the stored pages, hottest first, to each block's next-ranked
 * live peer within the time and byte budgets (reads are still served meanwhile).
 * Blocking; call before tqkv_server_shutdown. Returns the pages handed off. */
uint64_t tqkv_server_handoff(tqkv_server_t *s);

/* Reloads the token file and the TLS certificate/key/CA (SIGHUP; the server also does it
 * by itself when the files change). A file that is unchanged is skipped; one that does not
 * load keeps what is in force, and the reason is logged (and counted in
 * tqkv_credential_reloads_total). Calls in flight keep the tokens they started with;
 * connections already up keep their TLS session. trigger names the cause in the log. */
void tqkv_server_reload(tqkv_server_t *s, const char *trigger);

/* Graceful stop, blocking: health NOT_SERVING (watchers notified), stop accepting,
 * wait up to drain_seconds for in-flight KV calls, cancel the rest, then the P7
 * shutdown order. Idempotent. */
void tqkv_server_shutdown(tqkv_server_t *s);

/* Shuts down if needed and frees everything. NULL is a no-op. */
void tqkv_server_destroy(tqkv_server_t *s);

#endif
