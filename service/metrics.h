/* metrics.h - Prometheus metrics of tqkv-server, served by libmicrohttpd at /metrics.
 *
 * Counters and histograms are updated lock-free (atomics) from the gRPC and codec
 * threads; store gauges are read from the store at scrape time.
 */
#ifndef TQKV_SERVICE_METRICS_H
#define TQKV_SERVICE_METRICS_H

#include <stdint.h>

#include "cache/store.h"
#include "kernels/status.h"

typedef struct tqkv_metrics tqkv_metrics_t;

/* Creates an empty registry; *out owned by the caller. */
tqkv_status_t tqkv_metrics_create(tqkv_metrics_t **out);
/* Stops serving (if started) and frees. NULL is a no-op. */
void tqkv_metrics_destroy(tqkv_metrics_t *m);

/* One finished RPC: method is "Put", "Lookup", "Get", "Delete", "Stats", "Health.Check",
 * ...; grpc_code the gRPC status code sent; seconds its duration. Thread-safe. */
void tqkv_metrics_rpc_done(tqkv_metrics_t *m, const char *method, int grpc_code, double seconds);
/* Payload bytes received and sent, and BF16-equivalent bytes delivered by Get. */
void tqkv_metrics_add_bytes(tqkv_metrics_t *m, uint64_t in, uint64_t out, uint64_t bf16_equiv_out);
/* Codec work: encode != 0 for encode, else decode; bf16_bytes processed in seconds. */
void tqkv_metrics_codec(tqkv_metrics_t *m, int encode, uint64_t bf16_bytes, double seconds);
/* Per-tenant (namespace) hit/miss accounting for Get/Lookup, exported with the label
 * tenant="ns" (ns need not be NUL-terminated). */
void tqkv_metrics_ns_access(tqkv_metrics_t *m, const char *ns, size_t ns_len, uint64_t hits,
                            uint64_t misses);
/* Active gRPC streams gauge (+1 when a call starts, -1 when it ends). */
void tqkv_metrics_streams(tqkv_metrics_t *m, int delta);
/* Open TCP data channels gauge (+1 when one is registered, -1 when it goes). */
void tqkv_metrics_data_channels(tqkv_metrics_t *m, int delta);
/* How data channels are protected: a static string ("plaintext", "openssl-tls1.3");
 * tqkv_data_channel_security_info{path} is exported once this is set. */
void tqkv_metrics_data_channel_path(tqkv_metrics_t *m, const char *path);
/* A data channel connection failed its TLS handshake. */
void tqkv_metrics_data_channel_handshake_failed(tqkv_metrics_t *m);

/* A credentials file was (re)loaded: tls non-zero for the TLS files, else the token file;
 * ok zero when the new file was rejected (the old one stays in force). Also called once for
 * the load at start-up. Thread-safe. */
void tqkv_metrics_reload(tqkv_metrics_t *m, int tls, int ok);

/* Serves the HTTP probes next to /metrics: GET /livez answers 200 while the process
 * serves HTTP at all; GET /readyz answers 200 when ready(arg) is non-zero, else 503 (also
 * before this is called). For Kubernetes probes, which cannot speak TLS to the gRPC port.
 * Call before tqkv_metrics_serve; ready runs on the HTTP thread. */
void tqkv_metrics_set_ready(tqkv_metrics_t *m, int (*ready)(void *arg), void *arg);

/* Why the last tqkv_metrics_serve failed (a line naming the address), or "no error". */
const char *tqkv_metrics_error(const tqkv_metrics_t *m);

/* Pages (and their bytes) handed off to peers on drain. */
void tqkv_metrics_handoff(tqkv_metrics_t *m, uint64_t pages, uint64_t bytes);
/* A finished re-replication pass (service/replicate.c): the pages (and their bytes) it
 * put to peers that lacked them; and a peer's hello (forward.h) counted. */
void tqkv_metrics_replicate(tqkv_metrics_t *m, uint64_t pages, uint64_t bytes);
void tqkv_metrics_peer_hello(tqkv_metrics_t *m);
/* Requests forwarded to the blocks' owners (one hop), by method ("Put", "Lookup", "Get"). */
void tqkv_metrics_forwarded(tqkv_metrics_t *m, int method, uint64_t blocks);
enum { TQKV_METRICS_FWD_PUT = 0, TQKV_METRICS_FWD_LOOKUP = 1, TQKV_METRICS_FWD_GET = 2 };
/* Read-through (forward.h): a request asked the peers for `asked` hashes this server owns
 * but did not hold; `found` of them were found (Lookup: hashes; Get: pages copied, `bytes`
 * their bytes). method: TQKV_METRICS_FWD_LOOKUP or TQKV_METRICS_FWD_GET. */
void tqkv_metrics_readthru(tqkv_metrics_t *m, int method, uint64_t asked, uint64_t found,
                           uint64_t bytes);

/* The server's --node-id, exported as tqkv_node_info{node_id="..."} 1 (copied). */
void tqkv_metrics_set_node_id(tqkv_metrics_t *m, const char *node_id);

/* Serves GET /metrics on listen ("HOST:PORT"; port 0 picks one, written to *bound_port
 * when non-NULL). store (borrowed, may be NULL) is read at each scrape. */
tqkv_status_t tqkv_metrics_serve(tqkv_metrics_t *m, const char *listen, tqkv_store_t *store,
                                 int *bound_port);

/* Renders the exposition text into a new malloc'd NUL-terminated string (*out, freed
 * by the caller); used by the HTTP handler and by tests. */
tqkv_status_t tqkv_metrics_render(tqkv_metrics_t *m, tqkv_store_t *store, char **out);

#endif
