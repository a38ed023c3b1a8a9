/* replicate.c - background re-replication (--replicate-bytes-per-s; forward.h).
 *
 * Clients put a block on the R servers that rank first for it (R = 2 as deployed) and
 * read R + 1 rank positions. A restart, a drain or a join leaves some blocks with one
 * copy: the server that lost its copy gets it back only when a Get asks it for a block
 * it ranks first for (read-through, read repair); a lost second copy is never noticed,
 * so the next fault of the remaining copy's server loses the block. This thread keeps
 * the pair: for every block this server holds and ranks first or second for (over
 * itself and its peers), it asks the other of the two (batched Lookups through a client
 * with that one target: only that server answers, not the third-ranked one as a read of
 * R + 1 rank positions would) and puts the pages it lacks there, as the pages (no
 * re-encode); every call marked "tqkv-hop: 2" (answered from the store).
 * A restarted or joined server thus receives its share from its peers, in the
 * background, before any client asks.
 *
 * When: 2 s after the peers' table last changed (a peer left, came back, joined: DNS
 * and node ids, as libtqkv follows them), a peer marked down answered again, or a peer
 * said hello (tqkv__fwd_peer_hello: a restart at the same address and node id shows in
 * none of the others), and every 60 s. Bounded: at most --replicate-bytes-per-s of
 * page bytes and Lookup hashes (80 bytes each) per second, on average over a pass; a
 * pass stops at the server's stop.
 * A failed ask or put is logged (once per pass) and retried at the next pass.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store.h"
#include "kernels/clock.h"
#include "kernels/page.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/service_internal.h"
#include "transport/client_server.h"
#include "transport/shard.h"

#define REPL_BATCH 512       /* hashes per Lookup, pages per Put stream */
#define REPL_LOOKUP_BYTES 80 /* what one Lookup hash costs on the wire, both ways */
#define REPL_NAME_MAX 300

typedef struct repl_pass {
    tqkv__fwd_t *f;
    tqkv_client_t *cl; /* the partner's, one target */
    uint64_t rate;     /* bytes per second */
    double t0;
    uint64_t spent; /* bytes counted against rate */
    uint64_t asked, missing, pages, bytes, failed;
    char err[300];
} repl_pass_t;

/* Waits until the pass is within its rate; 0, or -1 once the server stops. */
static int
pace(repl_pass_t *p)
{
    double due = p->t0 + (double)p->spent / (double)p->rate;
    return tqkv__repl_sleep(p->f, due - tqkv_clock_s());
}

/* A candidate page: the other server of its block's pair (a peer's index), the key. */
typedef struct cand {
    uint32_t peer;
    const tqkv_store_key_out_t *k;
} cand_t;

static int
bytes_cmp(const void *a, size_t na, const void *b, size_t nb)
{
    int c = memcmp(a, b, na < nb ? na : nb);
    return c ? c : (na > nb) - (na < nb);
}

static int
cand_cmp(const void *a, const void *b)
{
    const cand_t *ca = a, *cb = b;
    if (ca->peer != cb->peer)
        return ca->peer < cb->peer ? -1 : 1;
    const tqkv_store_key_out_t *x = ca->k, *y = cb->k;
    int c = bytes_cmp(x->ns, x->ns_len, y->ns, y->ns_len);
    if (c == 0)
        c = bytes_cmp(x->hash, x->hash_len, y->hash, y->hash_len);
    return c ? c : (x->layer > y->layer) - (x->layer < y->layer);
}

static int
same_ns(const tqkv_store_key_out_t *x, const tqkv_store_key_out_t *y)
{
    return bytes_cmp(x->ns, x->ns_len, y->ns, y->ns_len) == 0;
}

static int
same_block(const tqkv_store_key_out_t *x, const tqkv_store_key_out_t *y)
{
    return same_ns(x, y) && bytes_cmp(x->hash, x->hash_len, y->hash, y->hash_len) == 0;
}

static void
fail(repl_pass_t *p, const char *what)
{
    p->failed++;
    if (!p->err[0])
        snprintf(p->err, sizeof p->err, "%s: %s", what, tqkv_client_last_error()->message);
}

tqkv_status_t
tqkv__put_stored_page(tqkv_store_t *store, tqkv_put_t *put, const tqkv_store_key_out_t *k,
                      size_t *len)
{
    *len = 0;
    if (k->hash_len < 8 || k->hash_len > TQKV_HASH_MAX ||
        (k->parent && (k->parent_len < 8 || k->parent_len > TQKV_HASH_MAX)))
        return TQKV_ENOTFOUND;
    tqkv_block_key_t key = {k->ns, k->ns_len, k->hash, k->hash_len, k->layer};
    tqkv_page_ref_t *ref = NULL;
    if (tqkv_store_get(store, &key, &ref) != TQKV_OK)
        return TQKV_ENOTFOUND; /* evicted or deleted meanwhile */
    const void *page = tqkv_page_ref_data(ref);
    size_t n = tqkv_page_ref_len(ref);
    tqkv_page_info_t info;
    if (tqkv_page_validate(page, n, 0, &info, NULL, 0) != TQKV_OK) {
        tqkv_page_ref_release(ref);
        return TQKV_ENOTFOUND;
    }
    tqkv_hash_t h = {.len = (uint8_t)k->hash_len}, ph = {.len = (uint8_t)k->parent_len};
    memcpy(h.bytes, k->hash, k->hash_len);
    if (k->parent)
        memcpy(ph.bytes, k->parent, k->parent_len);
    tqkv_put_block_t b = {.ns = k->ns, /* export's namespaces end in a NUL */
                          .hash = &h,
                          .parent = k->parent ? &ph : NULL,
                          .layer = k->layer,
                          .shape = info.shape,
                          .page = page,
                          .page_len = n};
    tqkv_status_t st = tqkv_client_put_block(put, &b);
    tqkv_page_ref_release(ref);
    if (st == TQKV_OK)
        *len = n;
    return st;
}

/* Puts the pages c[0..n) (blocks the partner lacks) to the partner. */
static int
put_pages(repl_pass_t *p, const cand_t *c, size_t n)
{
    tqkv_store_t *store = tqkv__fwd_server(p->f)->store;
    tqkv_put_t *put = NULL;
    int rc = 0;
    if (tqkv_client_put_begin(p->cl, NULL, &put) != TQKV_OK) {
        fail(p, "put");
        return 0;
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        size_t len = 0;
        tqkv_status_t st = tqkv__put_stored_page(store, put, c[i].k, &len);
        if (st == TQKV_ENOTFOUND)
            continue;
        if (st != TQKV_OK) {
            fail(p, "put");
            break;
        }
        p->pages++;
        p->bytes += len;
        p->spent += len;
        rc = pace(p); /* the stream stays open while it waits: a page's time at the rate */
    }
    tqkv_put_result_t res;
    if (tqkv_client_put_end(put, &res) != TQKV_OK)
        fail(p, "put");
    return rc;
}

/* One partner's candidates of one namespace, c[0..n) (sorted): Lookups of their blocks
 * at the partner, REPL_BATCH blocks each, then the pages of the blocks it lacks put. */
static int
do_ns(repl_pass_t *p, const cand_t *c, size_t n)
{
    tqkv_hash_t *hs = malloc(REPL_BATCH * sizeof *hs);
    size_t *first = malloc((REPL_BATCH + 1) * sizeof *first);
    uint8_t *tiers = malloc(REPL_BATCH);
    cand_t *lack = malloc(n * sizeof *lack);
    const char *ns = c[0].k->ns; /* export's namespaces end in a NUL */
    int rc = 0;
    if (!hs || !first || !tiers || !lack)
        goto out;
    for (size_t i = 0; i < n && rc == 0;) {
        size_t nb = 0, j = i, nl = 0;
        while (j < n && nb < REPL_BATCH) { /* the next REPL_BATCH blocks */
            first[nb] = j;
            hs[nb].len = (uint8_t)c[j].k->hash_len;
            memcpy(hs[nb].bytes, c[j].k->hash, c[j].k->hash_len);
            nb++;
            for (j++; j < n && same_block(c[j].k, c[j - 1].k); j++)
                ;
        }
        first[nb] = j;
        tqkv_lookup_req_t q = {.ns = ns, .hashes = hs, .num_hashes = nb, .num_layers = 1};
        uint32_t prefix = 0;
        p->asked += nb;
        p->spent += nb * REPL_LOOKUP_BYTES;
        if (tqkv_client_lookup(p->cl, &q, &prefix, tiers) != TQKV_OK) {
            fail(p, "lookup");
            break; /* the partner is not answering: the next pass */
        }
        for (size_t b = 0; b < nb; b++)
            if (tiers[b] == 0) {
                p->missing++;
                for (size_t e = first[b]; e < first[b + 1]; e++)
                    lack[nl++] = c[e];
            }
        for (size_t e = 0; e < nl && rc == 0; e += REPL_BATCH)
            rc = put_pages(p, lack + e, nl - e < REPL_BATCH ? nl - e : REPL_BATCH);
        if (rc == 0)
            rc = pace(p);
        i = j;
    }
out:
    free(hs);
    free(first);
    free(tiers);
    free(lack);
    return rc;
}

/* A client of the one peer named name (the peers' options: TLS, token), marked hop 2. */
static tqkv_client_t *
partner_client(tqkv__fwd_t *f, const char *name)
{
    const tqkv_server_config_t *cfg = &tqkv__fwd_server(f)->cfg;
    char list[sizeof cfg->peers], tok[TQKV__PEER_TOKEN_MAX] = "", err[256];
    const char *targets[4];
    snprintf(list, sizeof list, "%s", cfg->peers);
    if (cfg->peer_token_file[0])
        (void)tqkv__peer_token(cfg->peer_token_file, tok, sizeof tok, err, sizeof err);
    tqkv_client_opts_t o;
    tqkv__peer_opts(cfg, list, targets, 4, tok, &o);
    const char *one[1] = {name};
    o.targets = one;
    o.num_targets = 1;
    o.resolve_targets = 0;
    o.deadline_ms = 10000;
    tqkv_client_peer_opts_t po = {.exclude_node_id = NULL, .hop = TQKV__HOP_PEER};
    tqkv_client_t *cl = NULL;
    if (tqkv_client_create_peer(&o, &po, &cl) != TQKV_OK) {
        tqkv_client_destroy(cl);
        cl = NULL;
    }
    memset(tok, 0, sizeof tok);
    return cl;
}

void
tqkv__repl_pass(tqkv__fwd_t *f, uint64_t rate)
{
    repl_pass_t p = {.f = f, .rate = rate ? rate : 1, .t0 = tqkv_clock_s()};
    tqkv_store_key_out_t *keys = NULL;
    size_t n = 0, nc = 0;
    tqkv__fwd_rank_t rk;
    if (tqkv__fwd_rank(f, &rk) != TQKV_OK)
        return;
    /* the peers' addresses, of the table the ranking is of (a change meanwhile: next pass) */
    char(*names)[REPL_NAME_MAX] = calloc(rk.n ? rk.n : 1, sizeof *names);
    tqkv_client_t *pc = tqkv__fwd_client_acquire(f);
    int same = names && tqkv_client_num_targets(pc) == rk.n;
    for (size_t i = 0; same && i < rk.n; i++) {
        const char *nm = tqkv_client_target_name(pc, i);
        same = tqkv_client_target_rank_id(pc, i) == rk.ids[i] && nm && strlen(nm) < REPL_NAME_MAX;
        if (same)
            strcpy(names[i], nm);
    }
    tqkv__fwd_client_release(f);
    cand_t *c = NULL;
    if (same && rk.n > 0 && tqkv_store_export(tqkv__fwd_server(f)->store, 0, &keys, &n) == TQKV_OK)
        c = malloc((n ? n : 1) * sizeof *c);
    /* The pages of the blocks this server ranks first or second for, whose other one of
     * the two is a peer with a known node id. */
    for (size_t i = 0; c && i < n; i++) {
        const tqkv_store_key_out_t *k = &keys[i];
        if (k->hash_len < 8 || k->hash_len > TQKV_HASH_MAX)
            continue;
        uint32_t top[2];
        tqkv_shard_top(rk.ids, sizeof *rk.ids, rk.n + 1,
                       tqkv_shard_block_key(k->ns, k->hash, k->hash_len), 2, top);
        uint32_t other = top[0] == rk.n ? top[1] : top[1] == rk.n ? top[0] : UINT32_MAX;
        if (other != UINT32_MAX && rk.known[other])
            c[nc++] = (cand_t){.peer = other, .k = k};
    }
    tqkv__fwd_rank_free(&rk);
    if (nc > 0)
        qsort(c, nc, sizeof *c, cand_cmp);
    int rc = 0;
    for (size_t i = 0; i < nc && rc == 0;) { /* per partner, then per namespace */
        size_t j = i + 1;
        while (j < nc && c[j].peer == c[i].peer)
            j++;
        if ((p.cl = partner_client(f, names[c[i].peer])) == NULL) {
            fail(&p, names[c[i].peer]);
        } else {
            for (size_t a = i; a < j && rc == 0;) {
                size_t b = a + 1;
                while (b < j && same_ns(c[b].k, c[a].k))
                    b++;
                rc = do_ns(&p, c + a, b - a);
                a = b;
            }
            tqkv_client_destroy(p.cl);
        }
        i = j;
    }
    if (p.missing || p.failed)
        tqkv_log(p.failed ? TQKV_LOG_WARN : TQKV_LOG_INFO, "replicate: pass",
                 "pages=%zu blocks_asked=%llu blocks_missing=%llu pages_sent=%llu bytes=%llu "
                 "failed=%llu seconds=%.2f stopped=%s error=\"%s\"",
                 nc, (unsigned long long)p.asked, (unsigned long long)p.missing,
                 (unsigned long long)p.pages, (unsigned long long)p.bytes,
                 (unsigned long long)p.failed, tqkv_clock_s() - p.t0, rc ? "yes" : "no", p.err);
    tqkv_metrics_replicate(tqkv__fwd_server(f)->metrics, p.pages, p.bytes);
    free(c);
    free(keys);
    free(names);
}
