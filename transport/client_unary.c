/* client_unary.c - libtqkv: Lookup, Delete, Stats and Health, unary calls fanned out
 * over the targets. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"

/* ---- Lookup ---- */

static tqkv_status_t lookup_v(tqkv_client_t *c, const tqkv_lookup_req_t *q, uint32_t *prefix_blocks,
                              uint8_t *tiers);

tqkv_status_t
tqkv_client_lookup(tqkv_client_t *c, const tqkv_lookup_req_t *q, uint32_t *prefix_blocks,
                   uint8_t *tiers)
{
    if (c == NULL)
        return lookup_v(NULL, q, prefix_blocks, tiers);
    tqkv_client_t v;
    tqkv_status_t st = lookup_v(tqkv__view_enter(c, &v), q, prefix_blocks, tiers);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
lookup_v(tqkv_client_t *c, const tqkv_lookup_req_t *q, uint32_t *prefix_blocks, uint8_t *tiers)
{
    if (prefix_blocks)
        *prefix_blocks = 0;
    if (c == NULL || q == NULL || prefix_blocks == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "lookup: client, request and prefix_blocks required");
    size_t n = q->num_hashes, nc = tqkv__read_candidates(c);
    tqkv_status_t st = TQKV_OK;
    if (q->ns == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "lookup: namespace required");
    if (n > 0 && q->hashes == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "lookup: hashes is NULL with num_hashes %zu", n);
    for (size_t i = 0; i < n; i++)
        if (!tqkv__hash_ok(&q->hashes[i]))
            return tqkv__client_err(TQKV_EINVAL, 0, "lookup: hash %zu is not 8..64 bytes", i);
    if (tiers)
        memset(tiers, 0, n);
    if (n == 0)
        return TQKV_OK;

    uint8_t *present = calloc(n, 1);
    uint8_t *tier = calloc(n, 1);
    uint32_t *cand = malloc(n * nc * sizeof *cand);
    ProtobufCBinaryData *hb = malloc(n * sizeof *hb);
    size_t *gidx = malloc(n * sizeof *gidx);
    size_t *tis = malloc(c->nt * sizeof *tis);
    Tqkv__V1__LookupRequest *reqs = malloc(c->nt * sizeof *reqs);
    ProtobufCMessage **rq = malloc(c->nt * sizeof *rq);
    ProtobufCMessage **rs = malloc(c->nt * sizeof *rs);
    tqkv_status_t *sts = malloc(c->nt * sizeof *sts);
    size_t *start = malloc((c->nt + 1) * sizeof *start);
    size_t *fill = malloc((c->nt + 1) * sizeof *fill);
    unsigned char *ask = malloc(n ? n : 1); /* asked this round: decided once (client_get.c) */
    uint32_t server_prefix = 0;
    int single_ok = 0;
    if (!present || !tier || !cand || !hb || !gidx || !tis || !reqs || !rq || !rs || !sts ||
        !start || !fill || !ask) {
        st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t all[RANK_MAX];
        tqkv__candidates(c, q->ns, &q->hashes[i], all);
        memcpy(&cand[i * nc], all, nc * sizeof *cand);
    }
    for (size_t round = 0; round < nc; round++) {
        uint64_t now = tqkv_clock_ns();
        /* Group the unresolved hashes by this round's candidate (counting sort). */
        memset(start, 0, (c->nt + 1) * sizeof *start);
        for (size_t i = 0; i < n; i++)
            if ((ask[i] = !present[i] && tqkv__target_usable(c, cand[i * nc + round], now)))
                start[cand[i * nc + round] + 1]++;
        for (size_t t = 0; t < c->nt; t++)
            start[t + 1] += start[t];
        memcpy(fill, start, c->nt * sizeof *fill);
        for (size_t i = 0; i < n; i++) {
            if (ask[i]) {
                size_t t = cand[i * nc + round];
                gidx[fill[t]] = i;
                hb[fill[t]].data = (uint8_t *)q->hashes[i].bytes;
                hb[fill[t]].len = q->hashes[i].len;
                fill[t]++;
            }
        }
        size_t ncall = 0;
        for (size_t t = 0; t < c->nt; t++) {
            if (start[t + 1] == start[t])
                continue;
            tqkv__v1__lookup_request__init(&reqs[ncall]);
            reqs[ncall].namespace_ = (char *)q->ns;
            reqs[ncall].hashes = &hb[start[t]];
            reqs[ncall].n_hashes = start[t + 1] - start[t];
            reqs[ncall].num_layers = q->num_layers;
            reqs[ncall].lease_ms = q->lease_ms;
            rq[ncall] = &reqs[ncall].base;
            tis[ncall] = t;
            ncall++;
        }
        if (ncall == 0)
            break;
        tqkv__unary_fanout(c, ncall, tis, M_LOOKUP, rq, &tqkv__v1__lookup_response__descriptor,
                           q->deadline_ms, rs, sts);
        for (size_t k = 0; k < ncall; k++) {
            size_t t = tis[k];
            if (sts[k] != TQKV_OK) {
                if (!(c->nt > 1 && sts[k] == TQKV_EUNAVAILABLE) && st == TQKV_OK)
                    st = sts[k];
                continue;
            }
            Tqkv__V1__LookupResponse *lr = (Tqkv__V1__LookupResponse *)rs[k];
            size_t cnt = start[t + 1] - start[t];
            if (c->nt == 1) {
                server_prefix = lr->prefix_blocks;
                single_ok = 1;
            }
            for (size_t j = 0; j < cnt; j++) {
                size_t g = gidx[start[t] + j];
                int tr = j < lr->n_blocks ? (int)lr->blocks[j]->tier : 0;
                if (tr != 0 || j < lr->prefix_blocks) {
                    present[g] = 1;
                    tier[g] = (uint8_t)(tr ? tr : TQKV_CLIENT_TIER_DRAM);
                }
            }
            protobuf_c_message_free_unpacked(rs[k], NULL);
        }
        if (st != TQKV_OK)
            break;
    }
    if (st == TQKV_OK) {
        uint32_t pre = 0;
        while (pre < n && present[pre])
            pre++;
        *prefix_blocks = single_ok ? server_prefix : pre;
        if (tiers)
            memcpy(tiers, tier, n);
    }
out:
    free(present);
    free(ask);
    free(tier);
    free(cand);
    free(hb);
    free(gidx);
    free(tis);
    free(reqs);
    free(rq);
    free(rs);
    free(sts);
    free(start);
    free(fill);
    return st;
}

/* ---- Delete, Stats, Health ---- */

static tqkv_status_t delete_v(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes, size_t n,
                              int all, uint64_t *pages_deleted, uint64_t *bytes_freed);

/* Every usable target, each to be sent m (a fan-out to all): fills tis and rq, returns
 * how many. */
static size_t
all_live_targets(tqkv_client_t *c, ProtobufCMessage *m, size_t *tis, ProtobufCMessage **rq)
{
    size_t n = 0;
    uint64_t now = tqkv_clock_ns();
    for (size_t t = 0; t < c->nt; t++) {
        if (!tqkv__target_usable(c, t, now))
            continue;
        tis[n] = t;
        rq[n++] = m;
    }
    return n;
}

tqkv_status_t
tqkv_client_delete(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes, size_t n, int all,
                   uint64_t *pages_deleted, uint64_t *bytes_freed)
{
    if (c == NULL)
        return delete_v(NULL, ns, hashes, n, all, pages_deleted, bytes_freed);
    tqkv_client_t v;
    tqkv_status_t st =
        delete_v(tqkv__view_enter(c, &v), ns, hashes, n, all, pages_deleted, bytes_freed);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
delete_v(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes, size_t n, int all,
         uint64_t *pages_deleted, uint64_t *bytes_freed)
{
    tqkv_status_t st = TQKV_OK;
    uint64_t pd = 0, bf = 0;
    if (pages_deleted)
        *pages_deleted = 0;
    if (bytes_freed)
        *bytes_freed = 0;
    if (c == NULL || ns == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "delete: client and namespace required");
    if (n > 0 && hashes == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "delete: hashes is NULL with num_hashes %zu", n);
    for (size_t i = 0; i < n; i++)
        if (!tqkv__hash_ok(&hashes[i]))
            return tqkv__client_err(TQKV_EINVAL, 0, "delete: hash %zu is not 8..64 bytes", i);
    ProtobufCBinaryData *hb = malloc((n ? n : 1) * sizeof *hb);
    size_t *tis = malloc(c->nt * sizeof *tis);
    ProtobufCMessage **rq = malloc(c->nt * sizeof *rq);
    ProtobufCMessage **rs = malloc(c->nt * sizeof *rs);
    tqkv_status_t *sts = malloc(c->nt * sizeof *sts);
    Tqkv__V1__DeleteRequest m;
    if (!hb || !tis || !rq || !rs || !sts) {
        st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        hb[i].data = (uint8_t *)hashes[i].bytes;
        hb[i].len = hashes[i].len;
    }
    tqkv__v1__delete_request__init(&m);
    m.namespace_ = (char *)ns;
    m.hashes = hb;
    m.n_hashes = n;
    m.all = all != 0;
    size_t ncall = all_live_targets(c, &m.base, tis, rq);
    if (ncall == 0) {
        st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                              "delete: no live target");
        goto out;
    }
    tqkv__unary_fanout(c, ncall, tis, M_DELETE, rq, &tqkv__v1__delete_response__descriptor, 0, rs,
                       sts);
    size_t oks = 0, notfound = 0;
    tqkv_client_error_t saved = tqkv__client_last_err;
    for (size_t k = 0; k < ncall; k++) {
        if (sts[k] == TQKV_OK) {
            Tqkv__V1__DeleteResponse *r = (Tqkv__V1__DeleteResponse *)rs[k];
            pd += r->pages_deleted;
            bf += r->bytes_freed;
            protobuf_c_message_free_unpacked(rs[k], NULL);
            oks++;
        } else if (sts[k] == TQKV_ENOTFOUND) {
            notfound++;
            saved = tqkv__client_last_err;
        } else if (!(c->nt > 1 && sts[k] == TQKV_EUNAVAILABLE) && st == TQKV_OK) {
            st = sts[k];
            saved = tqkv__client_last_err;
        }
    }
    if (st == TQKV_OK && oks == 0)
        st = notfound ? TQKV_ENOTFOUND : TQKV_EUNAVAILABLE;
    tqkv__client_last_err = saved;
out:
    if (pages_deleted)
        *pages_deleted = pd;
    if (bytes_freed)
        *bytes_freed = bf;
    free(hb);
    free(tis);
    free(rq);
    free(rs);
    free(sts);
    return st;
}

static tqkv_status_t stats_v(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out);

tqkv_status_t
tqkv_client_stats(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out)
{
    if (c == NULL)
        return stats_v(NULL, ns, out);
    tqkv_client_t v;
    tqkv_status_t st = stats_v(tqkv__view_enter(c, &v), ns, out);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
stats_v(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out)
{
    tqkv_status_t st = TQKV_OK;
    if (c == NULL || out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "stats: client and out required");
    memset(out, 0, sizeof *out);
    size_t *tis = malloc(c->nt * sizeof *tis);
    ProtobufCMessage **rq = malloc(c->nt * sizeof *rq);
    ProtobufCMessage **rs = malloc(c->nt * sizeof *rs);
    tqkv_status_t *sts = malloc(c->nt * sizeof *sts);
    Tqkv__V1__StatsRequest m;
    if (!tis || !rq || !rs || !sts) {
        st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    tqkv__v1__stats_request__init(&m);
    m.namespace_ = (char *)(ns ? ns : "");
    size_t ncall = all_live_targets(c, &m.base, tis, rq);
    if (ncall == 0) {
        st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                              "stats: no live target");
        goto out;
    }
    tqkv__unary_fanout(c, ncall, tis, M_STATS, rq, &tqkv__v1__stats_response__descriptor, 0, rs,
                       sts);
    size_t oks = 0;
    tqkv_client_error_t saved = tqkv__client_last_err;
    for (size_t k = 0; k < ncall; k++) {
        if (sts[k] != TQKV_OK) {
            if (!(c->nt > 1 && sts[k] == TQKV_EUNAVAILABLE) && st == TQKV_OK) {
                st = sts[k];
                saved = tqkv__client_last_err;
            }
            continue;
        }
        Tqkv__V1__StatsResponse *r = (Tqkv__V1__StatsResponse *)rs[k];
        out->hits += r->hits;
        out->misses += r->misses;
        out->evictions += r->evictions;
        out->bytes_in += r->bytes_in;
        out->bytes_out += r->bytes_out;
        out->pages += r->pages;
        out->page_bytes += r->page_bytes;
        out->bf16_bytes += r->bf16_bytes;
        for (size_t i = 0; i < r->n_tiers; i++) {
            Tqkv__V1__TierStats *ts = r->tiers[i];
            size_t j = 0;
            while (j < out->num_tiers && out->tiers[j].tier != (int)ts->tier)
                j++;
            if (j == out->num_tiers) {
                if (j == TQKV_CLIENT_TIER_COUNT)
                    continue;
                out->num_tiers++;
                out->tiers[j].tier = (int)ts->tier;
            }
            tqkv_client_tier_stats_t *o = &out->tiers[j];
            o->capacity_bytes += ts->capacity_bytes;
            o->bytes_used += ts->bytes_used;
            o->pages += ts->pages;
            o->hits += ts->hits;
            o->misses += ts->misses;
            o->evictions += ts->evictions;
            o->demotions += ts->demotions;
            o->promotions += ts->promotions;
        }
        protobuf_c_message_free_unpacked(rs[k], NULL);
        oks++;
    }
    if (st == TQKV_OK && oks == 0)
        st = TQKV_EUNAVAILABLE;
    tqkv__client_last_err = saved;
    out->compression_ratio =
        out->page_bytes ? (double)out->bf16_bytes / (double)out->page_bytes : 0.0;
out:
    free(tis);
    free(rq);
    free(rs);
    free(sts);
    return st;
}

static tqkv_status_t health_v(tqkv_client_t *c, size_t target, const char *service,
                              int *serving_status);

tqkv_status_t
tqkv_client_health(tqkv_client_t *c, size_t target, const char *service, int *serving_status)
{
    if (c == NULL)
        return health_v(NULL, target, service, serving_status);
    tqkv_client_t v;
    tqkv_status_t st = health_v(tqkv__view_enter(c, &v), target, service, serving_status);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
health_v(tqkv_client_t *c, size_t target, const char *service, int *serving_status)
{
    Grpc__Health__V1__HealthCheckRequest m;
    ProtobufCMessage *rq, *rs;
    tqkv_status_t st;
    if (c == NULL || serving_status == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "health: client and serving_status required");
    *serving_status = 0;
    if (target >= c->nt)
        return tqkv__client_err(TQKV_EINVAL, 0, "health: no target %zu", target);
    grpc__health__v1__health_check_request__init(&m);
    m.service = (char *)(service ? service : "");
    rq = &m.base;
    tqkv__unary_fanout(c, 1, &target, M_HEALTH, &rq,
                       &grpc__health__v1__health_check_response__descriptor, 0, &rs, &st);
    if (st == TQKV_OK) {
        *serving_status = (int)((Grpc__Health__V1__HealthCheckResponse *)rs)->status;
        protobuf_c_message_free_unpacked(rs, NULL);
    }
    return st;
}
