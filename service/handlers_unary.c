/* handlers_unary.c - the tqkv.v1.KVCache unary methods: Lookup (store calls on the
 * encoder pool when it forwards), Delete and Stats (on the gRPC worker: store calls only).
 */
#include <grpc/slice.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/varint.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "transport/wire.h"

/* ---- unary methods ---- */

/* The request's bytes (a new buffer, *len), or NULL with msg saying it is missing. */
static uint8_t *
unary_buf(tqkv__call_t *c, size_t *len, char *msg)
{
    uint8_t *buf = c->recv_bb ? tqkv__bb_read(c->recv_bb, len) : NULL;
    if (buf == NULL)
        snprintf(msg, TQKV__KV_ERRLEN, "message: missing request");
    return buf;
}

/* Finishes c with the failure st, msg saying what failed: the one place the unary
 * handlers translate a status. input: the client's request was at fault
 * (tqkv_status_to_grpc_input), else the server's work (tqkv_status_to_grpc). */
static void
unary_fail(tqkv__call_t *c, tqkv_status_t st, int input, const char *msg)
{
    tqkv__call_finish(c, input ? tqkv_status_to_grpc_input(st) : tqkv_status_to_grpc(st), msg,
                      NULL);
}

static void
lookup_answer(tqkv__call_t *c, Tqkv__V1__LookupRequest *r, const uint8_t *tiers,
              Tqkv__V1__BlockInfo *infos, Tqkv__V1__BlockInfo **iptr, size_t n, uint32_t prefix)
{
    uint64_t hits = 0;
    for (size_t i = 0; i < n; i++) {
        tqkv__v1__block_info__init(&infos[i]);
        infos[i].hash = r->hashes[i];
        infos[i].tier = (Tqkv__V1__Tier)tiers[i];
        iptr[i] = &infos[i];
        hits += tiers[i] != TQKV_TIER_NONE;
    }
    tqkv_metrics_ns_access(c->srv->metrics, r->namespace_, strlen(r->namespace_), hits, n - hits);
    Tqkv__V1__LookupResponse resp = TQKV__V1__LOOKUP_RESPONSE__INIT;
    resp.prefix_blocks = prefix;
    resp.n_blocks = n;
    resp.blocks = iptr;
    tqkv__call_finish_msg(c, &resp.base);
}

/* A Lookup some of whose hashes a peer owns, or this server owns and lacks (forward.h):
 * answered on the encoder pool. */
typedef struct lookup_state {
    Tqkv__V1__LookupRequest *r;
    const uint8_t **hp;
    size_t *hl;
    uint8_t *tiers;
    Tqkv__V1__BlockInfo *infos, **iptr;
    tqkv__fwd_t *fw;
    int hop;    /* the call's TQKV__HOP_* (NONE or ROUTED) */
    int stored; /* tiers and prefix hold the store's answer already */
    uint32_t prefix;
    tqkv_status_t st; /* of the store or the owners */
    char err[TQKV__KV_ERRLEN];
} lookup_state_t;

static void
lookup_job(void *arg)
{
    tqkv__call_t *c = arg;
    lookup_state_t *ls = c->h;
    Tqkv__V1__LookupRequest *r = ls->r;
    size_t n = r->n_hashes;
    tqkv_status_t st =
        ls->stored
            ? TQKV_OK
            : tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), ls->hp, ls->hl,
                                n, r->num_layers, r->lease_ms, &ls->prefix, ls->tiers);
    tqkv__fwd_rank_t rk;
    uint8_t *want = calloc(n, 1);
    if (st != TQKV_OK) {
        ls->st = st;
        snprintf(ls->err, TQKV__KV_ERRLEN, "lookup: %s", tqkv_strerror(st));
    } else if (want && tqkv__fwd_rank(ls->fw, &rk) == TQKV_OK) {
        /* The hashes a peer owns: its answer, not ours (forwarding; not for a client that
         * routed the call here itself); the hashes we own but do not hold: the next-ranked
         * peers' answer (read-through). One ask for both. */
        size_t nw = 0, nowner = 0;
        for (size_t i = 0; i < n; i++) {
            if (!tqkv__fwd_owned(&rk, r->namespace_, ls->hp[i], ls->hl[i]))
                want[i] = ls->hop == TQKV__HOP_NONE ? TQKV__FWD_OWNER : TQKV__FWD_NO;
            else if (ls->tiers[i] == TQKV_TIER_NONE && rk.n > 0)
                want[i] = TQKV__FWD_READ;
            nw += want[i] != TQKV__FWD_NO;
            nowner += want[i] == TQKV__FWD_OWNER;
        }
        tqkv__fwd_rank_free(&rk);
        if (nw > 0) {
            st = tqkv__fwd_lookup(ls->fw, c->authz, r->namespace_, ls->hp, ls->hl, want, n,
                                  r->num_layers, r->lease_ms, ls->tiers, ls->err, TQKV__KV_ERRLEN);
            /* A failed read-through alone is no error: those hashes stay missing. */
            if (st != TQKV_OK && nowner > 0)
                ls->st = st;
            atomic_fetch_add(&c->srv->forwarded, 1);
        }
        ls->prefix = 0;
        while (ls->prefix < n && ls->tiers[ls->prefix] != TQKV_TIER_NONE)
            ls->prefix++;
    }
    free(want);
    tqkv__call_wake(c);
}

static void
lookup_wake(tqkv__call_t *c)
{
    lookup_state_t *ls = c->h;
    if (c->closed)
        tqkv__call_abort(c);
    else if (ls->st != TQKV_OK)
        unary_fail(c, ls->st, 0, ls->err);
    else
        lookup_answer(c, ls->r, ls->tiers, ls->infos, ls->iptr, ls->r->n_hashes, ls->prefix);
}

static void
lookup_free(tqkv__call_t *c)
{
    lookup_state_t *ls = c->h;
    if (ls == NULL)
        return;
    free(ls->hp);
    free(ls->hl);
    free(ls->tiers);
    free(ls->infos);
    free(ls->iptr);
    tqkv__v1__lookup_request__free_unpacked(ls->r, NULL);
    free(ls);
    c->h = NULL;
}

/* The bytes a LookupResponse to r can reach: it echoes every hash with its tier. */
static uint64_t
lookup_response_bound(const Tqkv__V1__LookupRequest *r)
{
    uint64_t bound = 6; /* prefix_blocks */
    for (size_t i = 0; i < r->n_hashes; i++) {
        uint64_t hl = r->hashes[i].len;
        uint64_t bi = 1 + tqkv_varint_len(hl) + hl + 2; /* hash, tier */
        bound += 1 + tqkv_varint_len(bi) + bi;
    }
    return bound;
}

/* Hands the Lookup to the encoder pool (the answer needs the owners, forward.h): ls takes
 * r and the arrays. TQKV_OK, or a status with msg (nothing taken). */
static tqkv_status_t
lookup_forward(tqkv__call_t *c, const lookup_state_t *init, char *msg)
{
    lookup_state_t *ls = calloc(1, sizeof *ls);
    if (ls == NULL) {
        snprintf(msg, TQKV__KV_ERRLEN, "out of memory");
        return TQKV_ENOMEM;
    }
    *ls = *init;
    c->h = ls;
    if (tqkv__call_work(c, lookup_job) != TQKV_OK) {
        c->h = NULL;
        free(ls);
        snprintf(msg, TQKV__KV_ERRLEN, "lookup: no encoder thread");
        return TQKV_EBUSY;
    }
    return TQKV_OK;
}

static void
lookup_start(tqkv__call_t *c)
{
    Tqkv__V1__LookupRequest *r = NULL;
    char msg[TQKV__KV_ERRLEN];
    size_t len = 0, n = 0;
    const uint8_t **hp = NULL;
    size_t *hl = NULL;
    uint8_t *tiers = NULL;
    Tqkv__V1__BlockInfo *infos = NULL, **iptr = NULL;
    uint8_t *buf = unary_buf(c, &len, msg);
    tqkv_status_t st =
        buf ? tqkv_validate_lookup(buf, len, &c->srv->limits, &r, msg, sizeof msg) : TQKV_EINVAL;
    int input = st != TQKV_OK;
    free(buf);
    if (st == TQKV_OK) {
        n = r->n_hashes;
        hp = malloc(n * sizeof *hp);
        hl = malloc(n * sizeof *hl);
        tiers = malloc(n);
        infos = malloc(n * sizeof *infos);
        iptr = malloc(n * sizeof *iptr);
        if (!hp || !hl || !tiers || !infos || !iptr) {
            snprintf(msg, sizeof msg, "out of memory");
            st = TQKV_ENOMEM;
        }
    }
    if (st == TQKV_OK)
        st = tqkv__call_auth(c, r->namespace_, TQKV_AUTH_READ, msg, sizeof msg);
    /* The response echoes every hash with its tier, so it is larger than the request:
     * one that could exceed the send limit is refused before any lease is taken (gRPC
     * would fail it with a message naming neither the cause nor a remedy). */
    uint64_t bound = st == TQKV_OK ? lookup_response_bound(r) : 0;
    if (st == TQKV_OK && bound > c->srv->limits.max_message_bytes) {
        snprintf(msg, sizeof msg,
                 "hashes: the response to %zu hashes can reach %llu bytes, over the server's "
                 "--max-message-bytes %llu (send fewer hashes per Lookup)",
                 n, (unsigned long long)bound,
                 (unsigned long long)c->srv->limits.max_message_bytes);
        st = TQKV_ENOSPC;
    }
    for (size_t i = 0; st == TQKV_OK && i < n; i++) {
        hp[i] = r->hashes[i].data;
        hl[i] = r->hashes[i].len;
    }
    tqkv__fwd_t *fw = st == TQKV_OK && c->hop != TQKV__HOP_PEER ? tqkv__fwd_get(c->srv) : NULL;
    uint32_t prefix = 0;
    int stored = 0;
    if (fw && n > 0 && c->hop == TQKV__HOP_ROUTED) {
        /* A client that routed it here (forward.h): the peers only where this store lacks
         * a hash (read-through of those it owns); a full answer costs no encoder job. */
        stored = 1;
        st = tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), hp, hl, n,
                               r->num_layers, r->lease_ms, &prefix, tiers);
        if (st != TQKV_OK)
            snprintf(msg, sizeof msg, "lookup: %s", tqkv_strerror(st));
        if (st != TQKV_OK || memchr(tiers, TQKV_TIER_NONE, n) == NULL)
            fw = NULL;
    }
    if (fw && n > 0) { /* the answer needs the peers: ask them on the encoder pool */
        lookup_state_t init = {.r = r,
                               .hp = hp,
                               .hl = hl,
                               .tiers = tiers,
                               .infos = infos,
                               .iptr = iptr,
                               .fw = fw,
                               .hop = c->hop,
                               .stored = stored,
                               .prefix = prefix,
                               .st = TQKV_OK};
        if ((st = lookup_forward(c, &init, msg)) == TQKV_OK)
            return; /* the state owns r and the arrays (lookup_free) */
    }
    if (st == TQKV_OK && !stored) {
        st = tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), hp, hl, n,
                               r->num_layers, r->lease_ms, &prefix, tiers);
        if (st != TQKV_OK)
            snprintf(msg, sizeof msg, "lookup: %s", tqkv_strerror(st));
    }
    if (st != TQKV_OK)
        unary_fail(c, st, input, msg);
    else
        lookup_answer(c, r, tiers, infos, iptr, n, prefix);
    free(hp);
    free(hl);
    free(tiers);
    free(infos);
    free(iptr);
    tqkv__v1__lookup_request__free_unpacked(r, NULL);
}

/* Deletes the blocks (or the whole namespace) r names: *pages and *bytes get what went.
 * A status with msg on failure (TQKV_ENOTFOUND: a namespace that holds nothing). */
static tqkv_status_t
delete_blocks(tqkv_store_t *store, const Tqkv__V1__DeleteRequest *r, uint64_t *pages,
              uint64_t *bytes, char *msg)
{
    size_t nsl = strlen(r->namespace_);
    if (r->all) {
        tqkv_status_t st = tqkv_store_delete_namespace(store, r->namespace_, nsl, pages, bytes);
        if (st == TQKV_ENOTFOUND)
            snprintf(msg, TQKV__KV_ERRLEN, "namespace: '%s' holds no blocks", r->namespace_);
        else if (st != TQKV_OK)
            snprintf(msg, TQKV__KV_ERRLEN, "delete: %s", tqkv_strerror(st));
        return st;
    }
    for (size_t i = 0; i < r->n_hashes; i++) {
        uint64_t p = 0, b = 0;
        tqkv_status_t st = tqkv_store_delete(store, r->namespace_, nsl, r->hashes[i].data,
                                             r->hashes[i].len, &p, &b);
        if (st != TQKV_OK && st != TQKV_ENOTFOUND) {
            snprintf(msg, TQKV__KV_ERRLEN, "hashes[%zu]: %s", i, tqkv_strerror(st));
            return st;
        }
        *pages += p;
        *bytes += b;
    }
    return TQKV_OK;
}

static void
delete_start(tqkv__call_t *c)
{
    Tqkv__V1__DeleteRequest *r = NULL;
    char msg[TQKV__KV_ERRLEN];
    size_t len = 0;
    uint64_t pages = 0, bytes = 0;
    uint8_t *buf = unary_buf(c, &len, msg);
    tqkv_status_t st =
        buf ? tqkv_validate_delete(buf, len, &c->srv->limits, &r, msg, sizeof msg) : TQKV_EINVAL;
    int input = st != TQKV_OK;
    free(buf);
    if (st == TQKV_OK)
        st = tqkv__call_auth(c, r->namespace_, TQKV_AUTH_WRITE, msg, sizeof msg);
    if (st == TQKV_OK)
        st = delete_blocks(c->srv->store, r, &pages, &bytes, msg);
    if (st != TQKV_OK) {
        unary_fail(c, st, input, msg);
    } else {
        Tqkv__V1__DeleteResponse resp = TQKV__V1__DELETE_RESPONSE__INIT;
        resp.pages_deleted = pages;
        resp.bytes_freed = bytes;
        tqkv__call_finish_msg(c, &resp.base);
    }
    tqkv__v1__delete_request__free_unpacked(r, NULL);
}

/* A peers' client's node-id question says "tqkv-peer-hello: <node id>" (a peer
 * (re)started or joined: forward.h); honoured from a token that may write everywhere
 * (the peer token), or with auth off. */
static void
peer_hello(tqkv__call_t *c)
{
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (grpc_slice_str_cmp(m->key, "tqkv-peer-hello") != 0)
            continue;
        if (c->auth == NULL || tqkv_auth_check(c->auth, c->authz, c->authz_len, NULL, 0,
                                               TQKV_AUTH_READ | TQKV_AUTH_WRITE) == TQKV_OK)
            tqkv__fwd_peer_hello(c->srv, (const char *)GRPC_SLICE_START_PTR(m->value),
                                 GRPC_SLICE_LENGTH(m->value));
        return;
    }
}

static void
stats_start(tqkv__call_t *c)
{
    Tqkv__V1__StatsRequest *r = NULL;
    char msg[TQKV__KV_ERRLEN];
    size_t len = 0;
    uint8_t *buf = unary_buf(c, &len, msg);
    tqkv_status_t rc =
        buf ? tqkv_validate_stats(buf, len, &c->srv->limits, &r, msg, sizeof msg) : TQKV_EINVAL;
    int input = rc != TQKV_OK;
    free(buf);
    /* identity_only: any valid token (checked before) may ask, every client ranks alike */
    if (rc == TQKV_OK && r->identity_only) {
        peer_hello(c);
        Tqkv__V1__StatsResponse id = TQKV__V1__STATS_RESPONSE__INIT;
        id.node_id = c->srv->cfg.node_id;
        tqkv__call_finish_msg(c, &id.base);
        goto out;
    }
    int scoped = rc == TQKV_OK && r->namespace_ && r->namespace_[0];
    if (rc == TQKV_OK)
        rc = tqkv__call_auth(c, scoped ? r->namespace_ : NULL, TQKV_AUTH_READ, msg, sizeof msg);
    tqkv_store_stats_t st;
    memset(&st, 0, sizeof st);
    if (rc == TQKV_OK) {
        rc = tqkv_store_stats(c->srv->store, scoped ? r->namespace_ : NULL,
                              scoped ? strlen(r->namespace_) : 0, &st);
        if (rc != TQKV_OK)
            snprintf(msg, sizeof msg, "stats: %s", tqkv_strerror(rc));
    }
    if (rc != TQKV_OK) {
        unary_fail(c, rc, input, msg);
        goto out;
    }
    Tqkv__V1__TierStats ts[3];
    Tqkv__V1__TierStats *tp[3];
    size_t nt = 0;
    for (int t = TQKV_TIER_HBM; t <= TQKV_TIER_DISK; t++) {
        const tqkv_tier_stats_t *x = &st.tier[t];
        if (t != TQKV_TIER_DRAM && x->capacity == 0 && x->pages == 0)
            continue;
        tqkv__v1__tier_stats__init(&ts[nt]);
        ts[nt].tier = (Tqkv__V1__Tier)t;
        ts[nt].capacity_bytes = x->capacity;
        ts[nt].bytes_used = x->bytes_used;
        ts[nt].pages = x->pages;
        ts[nt].hits = x->hits;
        ts[nt].misses = x->misses;
        ts[nt].evictions = x->evictions;
        ts[nt].demotions = x->demotions;
        ts[nt].promotions = x->promotions;
        tp[nt] = &ts[nt];
        nt++;
    }
    Tqkv__V1__StatsResponse resp = TQKV__V1__STATS_RESPONSE__INIT;
    resp.n_tiers = nt;
    resp.tiers = tp;
    resp.hits = st.hits;
    resp.misses = st.misses;
    resp.evictions = st.evictions;
    resp.bytes_in = st.bytes_in;
    resp.bytes_out = st.bytes_out;
    resp.pages = st.pages;
    resp.page_bytes = st.page_bytes;
    resp.bf16_bytes = st.bf16_bytes;
    resp.quota_bytes = st.quota_bytes;
    resp.node_id = c->srv->cfg.node_id;
    resp.pages_handed_off = atomic_load(&c->srv->handed_off);
    resp.forwarded = atomic_load(&c->srv->forwarded);
    resp.compression_ratio = st.page_bytes ? (double)st.bf16_bytes / (double)st.page_bytes : 0.0;
    tqkv__call_finish_msg(c, &resp.base);
out:
    tqkv__v1__stats_request__free_unpacked(r, NULL);
}

const tqkv__handler_t tqkv__lookup_handler = {
    .path = "/tqkv.v1.KVCache/Lookup",
    .metric = "Lookup",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = lookup_start,
    .on_wake = lookup_wake,
    .on_free = lookup_free,
};

const tqkv__handler_t tqkv__delete_handler = {
    .path = "/tqkv.v1.KVCache/Delete",
    .metric = "Delete",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = delete_start,
};

const tqkv__handler_t tqkv__stats_handler = {
    .path = "/tqkv.v1.KVCache/Stats",
    .metric = "Stats",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = stats_start,
};
