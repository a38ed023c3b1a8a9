/* handoff.c - hand-off on drain: a stopping server gives its pages to its peers.
 *
 * On SIGTERM (a pod's preStop, a rolling restart) a server started with --peers finds
 * the other servers as a client does (libtqkv's membership: DNS, node ids), leaving
 * itself out by its own node id. With itself out of the ranking, a block's rank-0 peer
 * is its next-ranked live server: the one every client asks first once this server is
 * gone. So the pages are simply put, as packed pages (no re-encode), through a
 * client with R = 1 over the peers: hottest first (tqkv_store_export), until the time
 * (--handoff-seconds) or byte (--handoff-bytes) budget runs out. Health reads
 * NOT_SERVING meanwhile, reads are still served; the drain follows. The peers are dialed
 * as forward.h says (TLS verified against --peer-ca, the peer token where auth is on); the
 * token and certificates are read here, at SIGTERM, so a rotation since start applies.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store.h"
#include "grpc/health/v1/health.pb-c.h"
#include "kernels/page.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/metrics.h"
#include "service/service_internal.h"
#include "transport/client_server.h"

#define MAX_PEER_TARGETS 64

uint64_t
tqkv_server_handoff(tqkv_server_t *s)
{
    const tqkv_server_config_t *cfg = &s->cfg;
    if (cfg->peers[0] == '\0' || cfg->handoff_seconds == 0 || !s->started)
        return 0;
    double t0 = tqkv_clock_s(), deadline = t0 + cfg->handoff_seconds;
    tqkv__health_set_all(s, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING);

    char list[sizeof cfg->peers], tok[TQKV__PEER_TOKEN_MAX] = "", err[512];
    const char *targets[MAX_PEER_TARGETS];
    snprintf(list, sizeof list, "%s", cfg->peers);
    if (cfg->peer_token_file[0] && /* read again: it may have been rotated */
        tqkv__peer_token(cfg->peer_token_file, tok, sizeof tok, err, sizeof err) != TQKV_OK) {
        tqkv_log(TQKV_LOG_WARN, "hand-off: no peer token", "error=\"%s\"", err);
        return 0;
    }
    tqkv_client_opts_t o;
    tqkv__peer_opts(cfg, list, targets, MAX_PEER_TARGETS, tok, &o);
    size_t nt = o.num_targets;
    o.resolve_interval_ms = UINT32_MAX;
    o.replicas = 1;
    o.deadline_ms = cfg->handoff_seconds * 1000u;
    o.backoff_min_ms = 100;
    o.backoff_max_ms = 1000;
    /* o.hop: the next-ranked peer keeps it, even while it still ranks us first */
    tqkv_client_t *c = NULL;
    tqkv_client_peer_opts_t peer = {.exclude_node_id = cfg->node_id, .hop = 1};
    tqkv_status_t cst = nt ? tqkv_client_create_peer(&o, &peer, &c) : TQKV_EINVAL;
    memset(tok, 0, sizeof tok); /* the client keeps its own copy */
    if (cst != TQKV_OK) {
        char q[512];
        tqkv_log_quote(q, sizeof q, nt ? tqkv_client_last_error()->message : "empty --peers");
        tqkv_log(TQKV_LOG_WARN, "hand-off: no peer", "peers=\"%s\" error=\"%s\"", cfg->peers, q);
        return 0;
    }
    tqkv_store_key_out_t *keys = NULL;
    size_t n = 0;
    if (tqkv_store_export(s->store, 0, &keys, &n) != TQKV_OK) {
        tqkv_log(TQKV_LOG_WARN, "hand-off: cannot list the pages (out of memory)", "pages=0");
        tqkv_client_destroy(c);
        return 0;
    }
    tqkv_put_t *p = NULL;
    tqkv_put_opts_t po = {.deadline_ms = cfg->handoff_seconds * 1000u};
    const char *stop = "done";
    uint64_t sent = 0, bytes = 0, refused = 0;
    if (tqkv_client_put_begin(c, &po, &p) != TQKV_OK) {
        stop = "put failed";
        n = 0;
    }
    for (size_t i = 0; i < n; i++) {
        const tqkv_store_key_out_t *k = &keys[i];
        if (tqkv_clock_s() >= deadline) {
            stop = "time budget";
            break;
        }
        if (cfg->handoff_bytes && bytes + k->len > cfg->handoff_bytes) {
            stop = "byte budget";
            break;
        }
        size_t len = 0;
        tqkv_status_t st = tqkv__put_stored_page(s->store, p, k, &len);
        if (st == TQKV_ENOTFOUND)
            continue; /* evicted or deleted meanwhile, or not a page to send */
        if (st != TQKV_OK) {
            stop = "no live peer";
            refused = 1; /* this page too: counted as failed below */
            break;
        }
        sent++;
        bytes += len;
    }
    tqkv_put_result_t res;
    memset(&res, 0, sizeof res);
    if (p && tqkv_client_put_end(p, &res) != TQKV_OK && !strcmp(stop, "done"))
        stop = "put failed";
    uint64_t handed = res.blocks_stored + res.blocks_duplicate;
    atomic_fetch_add(&s->handed_off, handed);
    tqkv_metrics_handoff(s->metrics, handed, res.bytes_in);
    /* failed: pages tried that no peer took (a refused TLS handshake or token, a peer
     * gone) */
    uint64_t failed = sent + refused > handed ? sent + refused - handed : 0;
    int bad = failed > 0 || !strcmp(stop, "no live peer") || !strcmp(stop, "put failed");
    char q[300] = ""; /* the budgets are no failure: no reason then */
    if (bad)
        tqkv_log_quote(q, sizeof q, tqkv_client_last_error()->message);
    tqkv_log(bad ? TQKV_LOG_WARN : TQKV_LOG_INFO, "hand-off",
             "pages=%zu sent=%llu stored=%llu duplicate=%llu lost=%llu failed=%llu bytes=%llu "
             "seconds=%.2f peers=%zu tls=%s stopped_by=\"%s\" error=\"%s\"",
             n, (unsigned long long)sent, (unsigned long long)res.blocks_stored,
             (unsigned long long)res.blocks_duplicate, (unsigned long long)res.blocks_lost,
             (unsigned long long)failed, (unsigned long long)bytes, tqkv_clock_s() - t0,
             tqkv_client_num_targets(c), o.tls ? "on" : "off", stop, q);
    free(keys);
    tqkv_client_destroy(c);
    return handed;
}
