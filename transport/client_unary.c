/* client_unary.c - libtqkv: Lookup, Delete, Stats and Health, unary calls fanned out
 * over the targets. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/wire.h"

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

/* A Lookup: its rounds and hedges (tqkv__rd_t), what was found, the round's queue. */
typedef struct lkop {
    tqkv_client_t *c;
    const tqkv_lookup_req_t *q;
    tqkv__rd_t rd;
    uint8_t *present, *tier;
    int *answered; /* per call slot: a response was read */
    uint64_t dl_ns;
    grpc_completion_queue *cq;
    size_t live;
    uint32_t server_prefix;
    int single_ok;
} lkop_t;

static int
lookup_resolved(void *op, size_t i)
{
    return ((lkop_t *)op)->present[i];
}

/* Starts call slot sl (tqkv__rd_t) to target t for hb[from, to). */
static void
lookup_call_start(void *op, size_t sl, size_t t, size_t from, size_t to)
{
    lkop_t *l = op;
    rpc_t *r = &l->rd.rs[sl];
    Tqkv__V1__LookupRequest m;
    tqkv__v1__lookup_request__init(&m);
    m.namespace_ = (char *)l->q->ns;
    m.hashes = &l->rd.hb[from];
    m.n_hashes = to - from;
    m.num_layers = l->q->num_layers;
    m.lease_ms = l->q->lease_ms;
    r->rem = r->count; /* unresolved, each */
    l->answered[sl] = 0;
    gpr_timespec dl; /* a Lookup's size is its hashes (~80 bytes each, both ways) */
    r->dl_ns = tqkv__call_deadline(l->c, (uint64_t)r->count * 80u, l->dl_ns, &dl, &r->short_dl);
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    tqkv_status_t s2 = tqkv__rpc_start(l->c, r, l->cq, t, M_LOOKUP, dl, bb);
    if (r->call == NULL)
        grpc_byte_buffer_destroy(bb), r->init_bb = NULL;
    if (s2 == TQKV_OK)
        tqkv__rpc_recv(r);
    else
        r->start_err = s2;
    l->live += r->inflight > 0;
}

/* The response of call r (slot sl): the hashes it found, once each. */
static void
lookup_answer(lkop_t *l, rpc_t *r, size_t sl)
{
    Tqkv__V1__LookupResponse *lr = (Tqkv__V1__LookupResponse *)tqkv_wire_decode(
        &tqkv__v1__lookup_response__descriptor, r->recv_bb);
    if (lr == NULL || l->answered[sl])
        goto out;
    l->answered[sl] = 1;
    tqkv__lat_record(l->c, r->target, tqkv_clock_ns() - r->t0_ns);
    r->last_ns = tqkv_clock_ns();
    if (l->c->nt == 1) {
        l->server_prefix = lr->prefix_blocks;
        l->single_ok = 1;
    }
    for (size_t j = 0; j < r->count; j++) {
        size_t g = r->gidx[j];
        int tr = j < lr->n_blocks ? (int)lr->blocks[j]->tier : 0;
        if ((tr != 0 || j < lr->prefix_blocks) && !l->present[g]) {
            l->present[g] = 1;
            l->tier[g] = (uint8_t)(tr ? tr : TQKV_CLIENT_TIER_DRAM);
            if (r->is_hedge)
                atomic_fetch_add_explicit(&l->c->sh->hedge_pages, 1, memory_order_relaxed);
            tqkv__rd_done(&l->rd, r, g);
        }
    }
out:
    if (lr)
        protobuf_c_message_free_unpacked(&lr->base, NULL);
    grpc_byte_buffer_destroy(r->recv_bb);
    r->recv_bb = NULL;
}

/* One round: its calls started, driven (hedged when due) until each has ended, their
 * statuses (a call that lost a hedge race, a hedge, or one that passed its size
 * deadline fails no Lookup; nor, with several targets, UNAVAILABLE: its hashes read as
 * absent). Returns the first failure. */
static tqkv_status_t
lookup_round(lkop_t *l)
{
    tqkv_client_t *c = l->c;
    tqkv_status_t st = TQKV_OK;
    l->cq = grpc_completion_queue_create_for_next(NULL);
    l->live = 0;
    tqkv__rd_start(&l->rd);
    while (l->live > 0) {
        uint64_t due = tqkv__rd_hedge_due(&l->rd);
        gpr_timespec until =
            due == UINT64_MAX ? gpr_inf_future(GPR_CLOCK_MONOTONIC) : tqkv__deadline_at_ns(due);
        grpc_event ev = grpc_completion_queue_next(l->cq, until, NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            tqkv__rd_hedge(&l->rd);
            continue;
        }
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        rtag_t *tg = ev.tag;
        rpc_t *r = tg->r;
        tqkv__rpc_event(r, tg->k, ev.success);
        if (tg->k == TAG_RECV && r->recv_bb)
            lookup_answer(l, r, (size_t)(r - l->rd.rs));
        if (r->inflight == 0)
            l->live--;
    }
    for (size_t sl = 0; sl < l->rd.nslots; sl++) {
        rpc_t *r = &l->rd.rs[sl];
        if (!l->rd.started[sl])
            continue;
        if (r->start_err != TQKV_OK && st == TQKV_OK)
            st = r->start_err;
        if (r->call && !r->beaten) {
            tqkv_client_error_t first = tqkv__client_last_err;
            tqkv_status_t s2 = tqkv__rpc_result(c, r);
            int slow = s2 == TQKV_ETIMEDOUT && r->short_dl;
            if (slow)
                atomic_fetch_add_explicit(&c->sh->call_timeouts, 1, memory_order_relaxed);
            if (s2 == TQKV_OK && !l->answered[sl])
                s2 = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: malformed response",
                                      c->t[r->target]->name);
            if (s2 != TQKV_OK && st == TQKV_OK && !(c->nt > 1 && s2 == TQKV_EUNAVAILABLE) &&
                !slow && !r->is_hedge)
                st = s2;
            else if (st != TQKV_OK || s2 == TQKV_OK || slow || r->is_hedge)
                tqkv__client_last_err = first;
        }
        tqkv__rpc_fini(r);
    }
    tqkv__cq_destroy(l->cq);
    l->cq = NULL;
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
    size_t n = q->num_hashes;
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

    uint32_t op_ms = q->deadline_ms ? q->deadline_ms : c->deadline_ms;
    lkop_t l = {.c = c, .q = q, .dl_ns = tqkv_clock_ns() + (uint64_t)op_ms * 1000000ull};
    l.rd = (tqkv__rd_t){.c = c,
                        .ns = q->ns,
                        .hashes = q->hashes,
                        .n = n,
                        .op = &l,
                        .resolved = lookup_resolved,
                        .start_call = lookup_call_start};
    l.present = calloc(n, 1);
    l.tier = calloc(n, 1);
    if ((st = tqkv__rd_init(&l.rd)) == TQKV_OK &&
        (l.answered = calloc(l.rd.nslots, sizeof *l.answered)) == NULL)
        st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    if (st == TQKV_OK && (!l.present || !l.tier))
        st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    for (l.rd.round = 0; st == TQKV_OK && l.rd.round < l.rd.nc; l.rd.round++) {
        tqkv__rd_plan(&l.rd);
        if (l.rd.start[c->nt] != 0)
            st = lookup_round(&l);
    }
    if (st == TQKV_OK) {
        uint32_t pre = 0;
        while (pre < n && l.present[pre])
            pre++;
        *prefix_blocks = l.single_ok ? l.server_prefix : pre;
        if (tiers)
            memcpy(tiers, l.tier, n);
    }
    tqkv__rd_free(&l.rd);
    free(l.answered);
    free(l.present);
    free(l.tier);
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
