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
#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "transport/wire.h"

/* ---- unary methods ---- */

/* Reads and validates the unary request; on failure finishes the call and returns
 * NULL. */
#define UNARY_DECODE(c, type, fn, out)                                                             \
    do {                                                                                           \
        char err_[TQKV__KV_ERRLEN];                                                                \
        size_t len_ = 0;                                                                           \
        uint8_t *buf_ = (c)->recv_bb ? tqkv__bb_read((c)->recv_bb, &len_) : NULL;                  \
        if (buf_ == NULL) {                                                                        \
            tqkv__call_finish((c), GRPC_STATUS_INVALID_ARGUMENT, "message: missing request",       \
                              NULL);                                                               \
            return;                                                                                \
        }                                                                                          \
        tqkv_status_t st_ = fn(buf_, len_, &(c)->srv->limits, &(out), err_, sizeof err_);          \
        free(buf_);                                                                                \
        if (st_ != TQKV_OK) {                                                                      \
            tqkv__call_finish((c), tqkv_status_to_grpc_input(st_), err_, NULL);                    \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static int
auth_or_finish(tqkv__call_t *c, const char *ns, unsigned perm)
{
    char err[TQKV__KV_ERRLEN];
    tqkv_status_t st = tqkv__call_auth(c, ns, perm, err, sizeof err);
    if (st != TQKV_OK) {
        tqkv__call_finish(c, tqkv_status_to_grpc(st), err, NULL);
        return 0;
    }
    return 1;
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

/* A Lookup some of whose hashes a peer owns (forward.h): answered on the encoder pool. */
typedef struct lookup_state {
    Tqkv__V1__LookupRequest *r;
    const uint8_t **hp;
    size_t *hl;
    uint8_t *tiers;
    Tqkv__V1__BlockInfo *infos, **iptr;
    tqkv__fwd_t *fw;
    uint32_t prefix;
    grpc_status_code code;
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
        tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), ls->hp, ls->hl, n,
                          r->num_layers, r->lease_ms, &ls->prefix, ls->tiers);
    tqkv__fwd_rank_t rk;
    uint8_t *want = calloc(n, 1);
    if (st != TQKV_OK) {
        ls->code = tqkv_status_to_grpc(st);
        snprintf(ls->err, TQKV__KV_ERRLEN, "lookup: %s", tqkv_strerror(st));
    } else if (want && tqkv__fwd_rank(ls->fw, &rk) == TQKV_OK) {
        /* the hashes a peer owns: its answer, not ours */
        size_t nw = 0;
        for (size_t i = 0; i < n; i++)
            nw += want[i] = !tqkv__fwd_owned(&rk, r->namespace_, ls->hp[i], ls->hl[i]);
        tqkv__fwd_rank_free(&rk);
        if (nw > 0) {
            st = tqkv__fwd_lookup(ls->fw, c->authz, r->namespace_, ls->hp, ls->hl, want, n,
                                  r->num_layers, r->lease_ms, ls->tiers, ls->err, TQKV__KV_ERRLEN);
            if (st != TQKV_OK)
                ls->code = tqkv_status_to_grpc(st);
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
    else if (ls->code != GRPC_STATUS_OK)
        tqkv__call_finish(c, ls->code, ls->err, NULL);
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

static void
lookup_start(tqkv__call_t *c)
{
    Tqkv__V1__LookupRequest *r = NULL;
    UNARY_DECODE(c, Tqkv__V1__LookupRequest, tqkv_validate_lookup, r);
    size_t n = r->n_hashes;
    const uint8_t **hp = malloc(n * sizeof *hp);
    size_t *hl = malloc(n * sizeof *hl);
    uint8_t *tiers = malloc(n);
    Tqkv__V1__BlockInfo *infos = malloc(n * sizeof *infos);
    Tqkv__V1__BlockInfo **iptr = malloc(n * sizeof *iptr);
    if (!hp || !hl || !tiers || !infos || !iptr) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        goto out;
    }
    if (!auth_or_finish(c, r->namespace_, TQKV_AUTH_READ))
        goto out;
    /* The response echoes every hash with its tier, so it is larger than the request:
     * one that could exceed the send limit is refused before any lease is taken (gRPC
     * would fail it with a message naming neither the cause nor a remedy). */
    uint64_t bound = 6; /* prefix_blocks */
    for (size_t i = 0; i < n; i++) {
        hp[i] = r->hashes[i].data;
        hl[i] = r->hashes[i].len;
        uint64_t bi = 1 + tqkv__kv_varint_len(hl[i]) + hl[i] + 2; /* hash, tier */
        bound += 1 + tqkv__kv_varint_len(bi) + bi;
    }
    if (bound > c->srv->limits.max_message_bytes) {
        char msg[TQKV__KV_ERRLEN];
        snprintf(msg, sizeof msg,
                 "hashes: the response to %zu hashes can reach %llu bytes, over the server's "
                 "--max-message-bytes %llu (send fewer hashes per Lookup)",
                 n, (unsigned long long)bound,
                 (unsigned long long)c->srv->limits.max_message_bytes);
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
        goto out;
    }
    tqkv__fwd_t *fw = c->hop ? NULL : tqkv__fwd_get(c->srv);
    if (fw && n > 0) { /* the answer needs the owners: ask them on the encoder pool */
        lookup_state_t *ls = calloc(1, sizeof *ls);
        if (ls == NULL) {
            tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
            goto out;
        }
        *ls = (lookup_state_t){.r = r,
                               .hp = hp,
                               .hl = hl,
                               .tiers = tiers,
                               .infos = infos,
                               .iptr = iptr,
                               .fw = fw,
                               .code = GRPC_STATUS_OK};
        c->h = ls;
        if (tqkv__call_work(c, lookup_job) != TQKV_OK) {
            c->h = NULL;
            free(ls);
            tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "lookup: no encoder thread", NULL);
            goto out;
        }
        return; /* ls owns r and the arrays (lookup_free) */
    }
    uint32_t prefix = 0;
    tqkv_status_t st = tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), hp,
                                         hl, n, r->num_layers, r->lease_ms, &prefix, tiers);
    if (st != TQKV_OK) {
        char msg[TQKV__KV_ERRLEN];
        snprintf(msg, sizeof msg, "lookup: %s", tqkv_strerror(st));
        tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
        goto out;
    }
    lookup_answer(c, r, tiers, infos, iptr, n, prefix);
out:
    free(hp);
    free(hl);
    free(tiers);
    free(infos);
    free(iptr);
    tqkv__v1__lookup_request__free_unpacked(r, NULL);
}

static void
delete_start(tqkv__call_t *c)
{
    Tqkv__V1__DeleteRequest *r = NULL;
    char msg[TQKV__KV_ERRLEN];
    UNARY_DECODE(c, Tqkv__V1__DeleteRequest, tqkv_validate_delete, r);
    if (!auth_or_finish(c, r->namespace_, TQKV_AUTH_WRITE))
        goto out;
    uint64_t pages = 0, bytes = 0;
    size_t nsl = strlen(r->namespace_);
    if (r->all) {
        tqkv_status_t st =
            tqkv_store_delete_namespace(c->srv->store, r->namespace_, nsl, &pages, &bytes);
        if (st == TQKV_ENOTFOUND) {
            snprintf(msg, sizeof msg, "namespace: '%s' holds no blocks", r->namespace_);
            tqkv__call_finish(c, GRPC_STATUS_NOT_FOUND, msg, NULL);
            goto out;
        }
        if (st != TQKV_OK) {
            snprintf(msg, sizeof msg, "delete: %s", tqkv_strerror(st));
            tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
            goto out;
        }
    } else {
        for (size_t i = 0; i < r->n_hashes; i++) {
            uint64_t p = 0, b = 0;
            tqkv_status_t st = tqkv_store_delete(c->srv->store, r->namespace_, nsl,
                                                 r->hashes[i].data, r->hashes[i].len, &p, &b);
            if (st != TQKV_OK && st != TQKV_ENOTFOUND) {
                snprintf(msg, sizeof msg, "hashes[%zu]: %s", i, tqkv_strerror(st));
                tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
                goto out;
            }
            pages += p;
            bytes += b;
        }
    }
    Tqkv__V1__DeleteResponse resp = TQKV__V1__DELETE_RESPONSE__INIT;
    resp.pages_deleted = pages;
    resp.bytes_freed = bytes;
    tqkv__call_finish_msg(c, &resp.base);
out:
    tqkv__v1__delete_request__free_unpacked(r, NULL);
}

static void
stats_start(tqkv__call_t *c)
{
    Tqkv__V1__StatsRequest *r = NULL;
    UNARY_DECODE(c, Tqkv__V1__StatsRequest, tqkv_validate_stats, r);
    if (r->identity_only) { /* any valid token (checked before): every client ranks alike */
        Tqkv__V1__StatsResponse id = TQKV__V1__STATS_RESPONSE__INIT;
        id.node_id = c->srv->cfg.node_id;
        tqkv__call_finish_msg(c, &id.base);
        goto out;
    }
    int scoped = r->namespace_ && r->namespace_[0];
    if (!auth_or_finish(c, scoped ? r->namespace_ : NULL, TQKV_AUTH_READ))
        goto out;
    tqkv_store_stats_t st;
    memset(&st, 0, sizeof st);
    tqkv_status_t rc = tqkv_store_stats(c->srv->store, scoped ? r->namespace_ : NULL,
                                        scoped ? strlen(r->namespace_) : 0, &st);
    if (rc != TQKV_OK) {
        char msg[TQKV__KV_ERRLEN];
        snprintf(msg, sizeof msg, "stats: %s", tqkv_strerror(rc));
        tqkv__call_finish(c, tqkv_status_to_grpc(rc), msg, NULL);
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
