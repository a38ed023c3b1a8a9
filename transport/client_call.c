/* client_call.c - libtqkv: one gRPC call on an operation's completion queue (rpc_t),
 * the unary fan-out over targets, and the thread's last error. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/support/alloc.h>

#include "transport/client_health.h"
#include "transport/client_internal.h"
#include "transport/status_grpc.h"
#include "transport/wire.h"

_Thread_local tqkv_client_error_t tqkv__client_last_err;

/* tqkv_client_thread_authz: the calling thread's `authorization` value, or NULL. */
static _Thread_local const char *thread_authz;

void
tqkv_client_thread_authz(const char *authz)
{
    thread_authz = authz;
}

const tqkv_client_error_t *
tqkv_client_last_error(void)
{
    return &tqkv__client_last_err;
}

tqkv_status_t
tqkv__client_err(tqkv_status_t st, int code, const char *fmt, ...)
{
    va_list ap;
    tqkv__client_last_err.status = st;
    tqkv__client_last_err.grpc_code = code;
    va_start(ap, fmt);
    vsnprintf(tqkv__client_last_err.message, sizeof tqkv__client_last_err.message, fmt, ap);
    va_end(ap);
    return st;
}

tqkv_status_t
tqkv__client_set_error(tqkv_status_t st, int grpc_code, const char *msg)
{
    return tqkv__client_err(st, grpc_code, "%s", msg);
}

gpr_timespec
tqkv__deadline_after(uint32_t ms)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

tqkv_status_t
tqkv__rpc_start(tqkv_client_t *c, rpc_t *r, grpc_completion_queue *cq, size_t ti,
                const char *method, gpr_timespec deadline, grpc_byte_buffer *req)
{
    target_t *t = c->t[ti];
    uint32_t k = atomic_fetch_add_explicit(&t->rr, 1, memory_order_relaxed) % t->nch;
    grpc_op ops[4];
    grpc_call_error e;

    r->target = ti;
    r->cancelled = 0;
    r->t_status = (rtag_t){r, TAG_STATUS};
    r->t_init = (rtag_t){r, TAG_INIT};
    r->t_send = (rtag_t){r, TAG_SEND};
    r->t_recv = (rtag_t){r, TAG_RECV};
    grpc_metadata_array_init(&r->init_md);
    grpc_metadata_array_init(&r->trail_md);
    r->details = grpc_empty_slice();
    r->init_bb = req;
    pthread_rwlock_rdlock(&t->lock);
    r->call = grpc_channel_create_call(t->ch[k], NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                       grpc_slice_from_static_string(method), NULL, deadline, NULL);
    pthread_rwlock_unlock(&t->lock);
    if (r->call == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "grpc_channel_create_call failed");

    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &r->trail_md;
    ops[0].data.recv_status_on_client.status = &r->status;
    ops[0].data.recv_status_on_client.status_details = &r->details;
    ops[0].data.recv_status_on_client.error_string = &r->error_string;
    e = grpc_call_start_batch(r->call, ops, 1, &r->t_status, NULL);
    if (e != GRPC_CALL_OK)
        return tqkv__client_err(TQKV_EINTERNAL, 0, "start_batch(status): %d", (int)e);
    r->inflight++;

    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    /* "tqkv-hop": the caller routed this itself (it shards over several servers, or is
     * a server forwarding): the server answers it, never forwards it (forward.h) */
    int hop = c->hop || c->nt > 1;
    ops[n].data.send_initial_metadata.count = (size_t)c->has_auth + (size_t)hop;
    ops[n].data.send_initial_metadata.metadata = c->has_auth ? c->md : hop ? &c->md[1] : NULL;
    /* A server forwarding a caller's request sends the caller's header, not its own token
     * (gRPC takes its own references to the slices in start_batch: ours go after it). */
    grpc_metadata own[2];
    int own_md = thread_authz != NULL;
    if (own_md) {
        own[0].key = grpc_slice_from_static_string("authorization");
        own[0].value = grpc_slice_from_copied_string(thread_authz);
        own[1] = c->md[1];
        ops[n].data.send_initial_metadata.count = 1 + (size_t)hop;
        ops[n].data.send_initial_metadata.metadata = own;
    }
    ops[n].flags = c->wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    n++;
    ops[n++].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[1].data.recv_initial_metadata.recv_initial_metadata = &r->init_md;
    if (req != NULL) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = req;
        ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        r->closed = 1;
    }
    e = grpc_call_start_batch(r->call, ops, n, &r->t_init, NULL);
    if (own_md)
        grpc_slice_unref(own[0].value);
    if (e != GRPC_CALL_OK) {
        tqkv__rpc_cancel(r);
        return tqkv__client_err(TQKV_EINTERNAL, 0, "start_batch(init): %d", (int)e);
    }
    r->inflight++;
    return TQKV_OK;
}

void
tqkv__rpc_recv(rpc_t *r)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &r->recv_bb;
    r->recv_bb = NULL;
    if (grpc_call_start_batch(r->call, &op, 1, &r->t_recv, NULL) == GRPC_CALL_OK) {
        r->inflight++;
        r->recv_busy = 1;
    } else {
        r->recv_eof = 1;
    }
}

/* Sends bb (takes it). Requires !send_busy. */
int
tqkv__rpc_send(rpc_t *r, grpc_byte_buffer *bb)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    r->send_bb = bb;
    if (grpc_call_start_batch(r->call, &op, 1, &r->t_send, NULL) != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(bb);
        r->send_bb = NULL;
        r->send_failed = 1;
        return -1;
    }
    r->inflight++;
    r->send_busy = 1;
    r->sent++;
    return 0;
}

/* Half-closes and asks for the single response (client streaming). */
void
tqkv__rpc_close_and_recv(rpc_t *r)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[1].op = GRPC_OP_RECV_MESSAGE;
    ops[1].data.recv_message.recv_message = &r->recv_bb;
    r->recv_bb = NULL;
    r->closed = 1;
    if (grpc_call_start_batch(r->call, ops, 2, &r->t_recv, NULL) == GRPC_CALL_OK) {
        r->inflight++;
        r->recv_busy = 1;
    } else {
        tqkv__rpc_cancel(r);
    }
}

/* Bookkeeping of one completed tag. The receive buffer is left for the caller. */
void
tqkv__rpc_event(rpc_t *r, tag_kind_t k, int ok)
{
    r->inflight--;
    switch (k) {
    case TAG_STATUS:
        r->status_done = 1;
        break;
    case TAG_INIT:
        if (r->init_bb) {
            grpc_byte_buffer_destroy(r->init_bb);
            r->init_bb = NULL;
        }
        break;
    case TAG_SEND:
        r->send_busy = 0;
        if (r->send_bb) {
            grpc_byte_buffer_destroy(r->send_bb);
            r->send_bb = NULL;
        }
        if (!ok)
            r->send_failed = 1;
        break;
    case TAG_RECV:
        r->recv_busy = 0;
        if (!ok || r->recv_bb == NULL)
            r->recv_eof = 1;
        break;
    }
}

/* Frees what the call holds. Requires inflight == 0. */
void
tqkv__rpc_fini(rpc_t *r)
{
    if (r->call)
        grpc_call_unref(r->call);
    r->call = NULL;
    if (r->recv_bb)
        grpc_byte_buffer_destroy(r->recv_bb);
    r->recv_bb = NULL;
    if (r->init_bb)
        grpc_byte_buffer_destroy(r->init_bb);
    r->init_bb = NULL;
    grpc_metadata_array_destroy(&r->init_md);
    grpc_metadata_array_destroy(&r->trail_md);
    grpc_slice_unref(r->details);
    if (r->error_string)
        gpr_free((void *)r->error_string);
    r->error_string = NULL;
}

/* Waits for the next event of cq and books it. Returns the rpc and kind. */
rpc_t *
tqkv__cq_step(grpc_completion_queue *cq, tag_kind_t *k, int *ok)
{
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE)
        return NULL;
    rtag_t *t = ev.tag;
    tqkv__rpc_event(t->r, t->k, ev.success);
    *k = t->k;
    *ok = ev.success;
    return t->r;
}

void
tqkv__cq_destroy(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

/* Replaces target t's channels that are not READY by fresh ones, at most once per
 * min_interval_ns (whoever wins the exchange on t->renewed_ns does it). A restarted server
 * is then reached by a new connection attempt at once, instead of after gRPC's reconnect
 * back-off or an old attempt's SYN retransmissions. */
void
tqkv__renew_channels(tqkv_client_t *c, target_t *t, uint64_t min_interval_ns)
{
    uint64_t now = tqkv_clock_ns(), last = atomic_load(&t->renewed_ns);
    if (now - last < min_interval_ns || !atomic_compare_exchange_strong(&t->renewed_ns, &last, now))
        return;
    for (uint32_t k = 0; k < t->nch; k++) {
        pthread_rwlock_rdlock(&t->lock);
        grpc_connectivity_state s = grpc_channel_check_connectivity_state(t->ch[k], 0);
        pthread_rwlock_unlock(&t->lock);
        if (s == GRPC_CHANNEL_READY)
            continue;
        grpc_channel *nc = grpc_channel_create(t->name, c->creds, t->cargs);
        if (nc == NULL)
            continue;
        pthread_rwlock_wrlock(&t->lock);
        grpc_channel *old = t->ch[k];
        t->ch[k] = nc;
        pthread_rwlock_unlock(&t->lock);
        grpc_channel_destroy(old);
    }
}

void
tqkv__rpc_cancel(rpc_t *r)
{
    r->cancelled = 1;
    grpc_call_cancel(r->call, NULL);
}

/* Status of a finished call as a tqkv status (sets the thread's error) and updates
 * the target's health: UNAVAILABLE backs the target off, OK clears it. A call that this
 * client did not cancel but that ended CANCELLED (a stopping server cancels the calls
 * still open when its drain ends) or "Channel Destroyed" (its channel went while it
 * waited for a connection: a server restarting in a rolling update) is a transport
 * failure: UNAVAILABLE, so reads ask the block's next-ranked server and a Put stream is
 * re-sent, as for a server that refused the connection. */
tqkv_status_t
tqkv__rpc_result(tqkv_client_t *c, rpc_t *r)
{
    target_t *t = c->t[r->target];
    if (r->status == GRPC_STATUS_OK) {
        tqkv_shard_health_ok(&t->health, c->backoff_min);
        return TQKV_OK;
    }
    if (!r->cancelled && r->status != GRPC_STATUS_UNAVAILABLE &&
        (r->status == GRPC_STATUS_CANCELLED ||
         grpc_slice_str_cmp(r->details, "Channel Destroyed") == 0)) {
        char *d0 = grpc_slice_to_c_string(r->details);
        char msg[200];
        snprintf(msg, sizeof msg, "%s (%s)", d0 && d0[0] ? d0 : "cancelled",
                 r->status == GRPC_STATUS_CANCELLED ? "the server ended the call"
                                                    : "the channel went away");
        gpr_free(d0);
        grpc_slice_unref(r->details);
        r->details = grpc_slice_from_copied_string(msg);
        r->status = GRPC_STATUS_UNAVAILABLE;
    }
    if (r->status == GRPC_STATUS_UNAVAILABLE) {
        tqkv_shard_health_fail(&t->health, tqkv_clock_ns(), c->backoff_min, c->backoff_max);
        /* after an UNAVAILABLE: at most once per minimum back-off */
        tqkv__renew_channels(c, t, (uint64_t)c->backoff_min * 1000000ull);
        if (c->tab) /* re-resolve soon: the server may have moved */
            tqkv_membership_kick(c->ms, c->tab->s[r->target].m);
        tqkv__health_failed(c, r->target); /* skipped until it answers a probe */
    } else
        tqkv_shard_health_ok(&t->health, c->backoff_min);
    char *d = grpc_slice_to_c_string(r->details);
    tqkv_status_t st = tqkv__status_from_grpc_code(r->status);
    tqkv__client_err(st, (int)r->status, "%s: %s", t->name, d && d[0] ? d : "(no details)");
    gpr_free(d);
    return st;
}

/* Whether target ti takes calls now (always, with a single target): not backed off,
 * and its channel not in TRANSIENT_FAILURE (gRPC's own reconnect back-off: a call
 * there would fail at once and, for a Put, lose its blocks). */
int
tqkv__target_usable(tqkv_client_t *c, size_t ti, uint64_t now)
{
    if (c->nt == 1)
        return 1;
    if (!tqkv_shard_health_usable(&c->t[ti]->health, now))
        return 0;
    pthread_rwlock_rdlock(&c->t[ti]->lock);
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(c->t[ti]->ch[0], 1);
    pthread_rwlock_unlock(&c->t[ti]->lock);
    return s != GRPC_CHANNEL_TRANSIENT_FAILURE && s != GRPC_CHANNEL_SHUTDOWN;
}

/* ---- unary fan-out ---- */

/* Starts n unary calls on cq: call i to target tis[i] with reqs[i] (borrowed), deadline
 * dl; writes sts[i] (the start's status). Returns how many are live. */
size_t
tqkv__unary_start(tqkv_client_t *c, grpc_completion_queue *cq, rpc_t *rs, size_t n,
                  const size_t *tis, const char *method, ProtobufCMessage *const *reqs,
                  gpr_timespec dl, tqkv_status_t *sts)
{
    size_t live = 0;
    for (size_t i = 0; i < n; i++) {
        grpc_byte_buffer *bb = tqkv_wire_encode(reqs[i]);
        sts[i] = tqkv__rpc_start(c, &rs[i], cq, tis[i], method, dl, bb);
        if (rs[i].call == NULL)
            grpc_byte_buffer_destroy(bb), rs[i].init_bb = NULL;
        if (sts[i] == TQKV_OK)
            tqkv__rpc_recv(&rs[i]);
        live += rs[i].inflight > 0;
    }
    return live;
}

/* Drives the live calls of rs (on cq) until each has ended; a response of call i is
 * decoded (descriptor rd) into resps[i] (the first one; resps NULL: discarded), and
 * ended(arg, i) (when given) is called as call i ends. */
void
tqkv__unary_wait(grpc_completion_queue *cq, rpc_t *rs, size_t live,
                 const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resps,
                 void (*ended)(void *arg, size_t i), void *arg)
{
    while (live > 0) {
        tag_kind_t k;
        int ok;
        rpc_t *r = tqkv__cq_step(cq, &k, &ok);
        if (r == NULL)
            break;
        size_t i = (size_t)(r - rs);
        if (k == TAG_RECV && r->recv_bb) {
            if (resps && resps[i] == NULL)
                resps[i] = tqkv_wire_decode(rd, r->recv_bb);
            grpc_byte_buffer_destroy(r->recv_bb);
            r->recv_bb = NULL;
        }
        if (r->inflight == 0) {
            live--;
            if (ended)
                ended(arg, i);
        }
    }
}

/* Runs n unary calls in parallel: call i to target tis[i] with reqs[i]; writes
 * resps[i] (new, or NULL) and sts[i]. Borrows reqs. */
void
tqkv__unary_fanout(tqkv_client_t *c, size_t n, const size_t *tis, const char *method,
                   ProtobufCMessage *const *reqs, const ProtobufCMessageDescriptor *rd,
                   uint32_t deadline_ms, ProtobufCMessage **resps, tqkv_status_t *sts)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    rpc_t *rs = calloc(n, sizeof *rs);
    gpr_timespec dl = tqkv__deadline_after(deadline_ms ? deadline_ms : c->deadline_ms);
    if (rs == NULL) {
        for (size_t i = 0; i < n; i++)
            sts[i] = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        tqkv__cq_destroy(cq);
        return;
    }
    for (size_t i = 0; i < n; i++)
        resps[i] = NULL;
    tqkv__unary_wait(cq, rs, tqkv__unary_start(c, cq, rs, n, tis, method, reqs, dl, sts), rd, resps,
                     NULL, NULL);
    for (size_t i = 0; i < n; i++) {
        if (sts[i] == TQKV_OK) {
            sts[i] = tqkv__rpc_result(c, &rs[i]);
            if (sts[i] == TQKV_OK && resps[i] == NULL)
                sts[i] = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: malformed response",
                                          c->t[tis[i]]->name);
        }
        if (sts[i] != TQKV_OK && resps[i]) {
            protobuf_c_message_free_unpacked(resps[i], NULL);
            resps[i] = NULL;
        }
        tqkv__rpc_fini(&rs[i]);
    }
    free(rs);
    tqkv__cq_destroy(cq);
}

/* ---- reads asked in rounds, hedged ---- */

tqkv_status_t
tqkv__rd_init(tqkv__rd_t *rd)
{
    tqkv_client_t *c = rd->c;
    size_t n = rd->n, n1 = n ? n : 1;
    rd->nc = tqkv__read_candidates(c);
    size_t waves = 1 + (c->hedge && rd->nc > 1 ? TQKV__HEDGE_WAVES : 0);
    rd->nslots = c->nt * waves;
    rd->cand = malloc(n1 * rd->nc * sizeof *rd->cand);
    rd->asked = calloc(n1, sizeof *rd->asked);
    rd->own = malloc(2 * n1 * sizeof *rd->own);
    rd->ask = malloc(n1);
    rd->hb = malloc(n1 * waves * sizeof *rd->hb);
    rd->gidx = malloc(n1 * waves * sizeof *rd->gidx);
    rd->start = malloc((c->nt + 1) * sizeof *rd->start);
    rd->hstart = malloc((c->nt + 1) * sizeof *rd->hstart);
    rd->fill = malloc((c->nt + 1) * sizeof *rd->fill);
    rd->rs = calloc(rd->nslots, sizeof *rd->rs);
    rd->started = calloc(rd->nslots, sizeof *rd->started);
    if (!rd->cand || !rd->asked || !rd->own || !rd->ask || !rd->hb || !rd->gidx || !rd->start ||
        !rd->hstart || !rd->fill || !rd->rs || !rd->started)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        uint32_t all[RANK_MAX];
        tqkv__candidates(c, rd->ns, &rd->hashes[i], all);
        memcpy(&rd->cand[i * rd->nc], all, rd->nc * sizeof *rd->cand);
    }
    return TQKV_OK;
}

void
tqkv__rd_free(tqkv__rd_t *rd)
{
    free(rd->cand);
    free(rd->asked);
    free(rd->own);
    free(rd->ask);
    free(rd->hb);
    free(rd->gidx);
    free(rd->start);
    free(rd->hstart);
    free(rd->fill);
    free(rd->rs);
    free(rd->started);
}

/* Groups the hashes of list[0..k) by their target to[] into hb/gidx from base: target t
 * asks [st[t], st[t + 1]). */
static void
rd_group(tqkv__rd_t *rd, const size_t *list, const uint32_t *to, size_t k, size_t base, size_t *st)
{
    size_t nt = rd->c->nt;
    memset(st, 0, (nt + 1) * sizeof *st);
    for (size_t j = 0; j < k; j++)
        st[to[j] + 1]++;
    st[0] = base;
    for (size_t t = 0; t < nt; t++)
        st[t + 1] += st[t];
    memcpy(rd->fill, st, nt * sizeof *rd->fill);
    for (size_t j = 0; j < k; j++) {
        size_t i = list[j], at = rd->fill[to[j]]++;
        rd->gidx[at] = i;
        rd->hb[at].data = (uint8_t *)rd->hashes[i].bytes;
        rd->hb[at].len = rd->hashes[i].len;
    }
}

void
tqkv__rd_plan(tqkv__rd_t *rd)
{
    size_t n = rd->n, nc = rd->nc, r = rd->round, nt = rd->c->nt;
    uint64_t now = tqkv_clock_ns();
    /* Asked again while unresolved and not asked at this rank (a hedge may have); the
     * decision is made once: a target's usability (its health, its channel's state) may
     * change between counting and filling, and a count the fill does not match would
     * send unfilled or overrun hash slots. */
    memset(rd->start, 0, (nt + 1) * sizeof *rd->start);
    for (size_t i = 0; i < n; i++) {
        rd->own[2 * i] = rd->own[2 * i + 1] = -1;
        rd->ask[i] = !(rd->asked[i] >> r & 1) && !rd->resolved(rd->op, i) &&
                     tqkv__target_usable(rd->c, rd->cand[i * nc + r], now);
        if (rd->ask[i])
            rd->start[rd->cand[i * nc + r] + 1]++;
    }
    for (size_t t = 0; t < nt; t++)
        rd->start[t + 1] += rd->start[t];
    memcpy(rd->fill, rd->start, nt * sizeof *rd->fill);
    for (size_t i = 0; i < n; i++) {
        if (!rd->ask[i])
            continue;
        size_t t = rd->cand[i * nc + r], at = rd->fill[t]++;
        rd->gidx[at] = i;
        rd->hb[at].data = (uint8_t *)rd->hashes[i].bytes;
        rd->hb[at].len = rd->hashes[i].len;
        rd->asked[i] |= 1ull << r;
        rd->own[2 * i] = (long)t;
    }
}

/* Sets slot sl up (target t, hb/gidx[from, to), rank) and has the operation start it. */
static void
rd_call(tqkv__rd_t *rd, size_t sl, size_t t, size_t from, size_t to, uint32_t rank, int is_hedge)
{
    rpc_t *r = &rd->rs[sl];
    memset(r, 0, sizeof *r);
    r->target = t;
    r->gidx = &rd->gidx[from];
    r->count = to - from;
    r->rank = rank;
    r->is_hedge = is_hedge;
    r->t0_ns = r->last_ns = tqkv_clock_ns();
    r->hedge_ns =
        is_hedge || rd->nslots == rd->c->nt ? UINT64_MAX / 2 : tqkv__hedge_delay_ns(rd->c, t);
    rd->started[sl] = 1;
    rd->start_call(rd->op, sl, t, from, to);
}

void
tqkv__rd_start(tqkv__rd_t *rd)
{
    size_t nt = rd->c->nt;
    rd->waves = 0;
    memset(rd->rs, 0, rd->nslots * sizeof *rd->rs);
    memset(rd->started, 0, rd->nslots * sizeof *rd->started);
    for (size_t t = 0; t < nt; t++)
        if (rd->start[t + 1] != rd->start[t])
            rd_call(rd, t, t, rd->start[t], rd->start[t + 1], (uint32_t)rd->round, 0);
}

/* Whether round call slot t may be hedged (at its due time). */
static int
rd_hedgeable(const tqkv__rd_t *rd, size_t t)
{
    const rpc_t *r = &rd->rs[t];
    return rd->started[t] && !r->hedged && !r->beaten && r->inflight > 0 && r->rem > 0;
}

uint64_t
tqkv__rd_hedge_due(const tqkv__rd_t *rd)
{
    uint64_t due = UINT64_MAX;
    if (rd->nslots == rd->c->nt || rd->waves >= TQKV__HEDGE_WAVES || rd->round + 1 >= rd->nc)
        return due;
    for (size_t t = 0; t < rd->c->nt; t++) {
        uint64_t at = rd->rs[t].last_ns + rd->rs[t].hedge_ns;
        if (rd_hedgeable(rd, t) && at < due)
            due = at;
    }
    return due;
}

/* The first rank position above this round's where hash i was not asked and whose
 * target takes calls, or nc. */
static size_t
rd_hedge_rank(const tqkv__rd_t *rd, size_t i, uint64_t now)
{
    for (size_t k = rd->round + 1; k < rd->nc; k++)
        if (!(rd->asked[i] >> k & 1) && tqkv__target_usable(rd->c, rd->cand[i * rd->nc + k], now))
            return k;
    return rd->nc;
}

void
tqkv__rd_hedge(tqkv__rd_t *rd)
{
    tqkv_client_t *c = rd->c;
    uint64_t now = tqkv_clock_ns();
    if (tqkv__rd_hedge_due(rd) > now)
        return;
    size_t w = ++rd->waves, base = rd->n * w, k = 0, n1 = rd->n ? rd->n : 1;
    uint32_t *to = malloc(n1 * sizeof *to), *rk = malloc(n1 * sizeof *rk);
    size_t *list = malloc(n1 * sizeof *list);
    if (to == NULL || rk == NULL || list == NULL)
        goto out; /* no hedge: the calls go on */
    for (size_t t = 0; t < c->nt; t++) {
        rpc_t *r = &rd->rs[t];
        if (!rd_hedgeable(rd, t) || r->last_ns + r->hedge_ns > now)
            continue;
        r->hedged = 1;
        for (size_t j = 0; j < r->count; j++) {
            size_t i = r->gidx[j], k2;
            if (rd->own[2 * i + 1] >= 0 || rd->resolved(rd->op, i) ||
                (k2 = rd_hedge_rank(rd, i, now)) >= rd->nc)
                continue;
            rd->asked[i] |= 1ull << k2;
            list[k] = i;
            rk[k] = (uint32_t)k2;
            to[k++] = rd->cand[i * rd->nc + k2];
        }
    }
    if (k == 0)
        goto out;
    rd_group(rd, list, to, k, base, rd->hstart);
    for (size_t t = 0; t < c->nt; t++) {
        if (rd->hstart[t + 1] == rd->hstart[t])
            continue;
        size_t sl = w * c->nt + t;
        uint32_t rank = UINT32_MAX;
        for (size_t j = rd->hstart[t]; j < rd->hstart[t + 1]; j++)
            rd->own[2 * rd->gidx[j] + 1] = (long)sl;
        for (size_t j = 0; j < k; j++) /* the lowest rank it is asked at */
            if (to[j] == t && rk[j] < rank)
                rank = rk[j];
        rd_call(rd, sl, t, rd->hstart[t], rd->hstart[t + 1], rank, 1);
        atomic_fetch_add_explicit(&c->sh->hedges, 1, memory_order_relaxed);
    }
out:
    free(to);
    free(rk);
    free(list);
}

void
tqkv__rd_done(tqkv__rd_t *rd, const rpc_t *r, size_t i)
{
    for (int k = 0; k < 2; k++) {
        long sl = rd->own[2 * i + (size_t)k];
        if (sl < 0)
            continue;
        rpc_t *o = &rd->rs[sl];
        if (o->rem > 0)
            o->rem--;
        if (o->rem == 0 && o != r && !o->beaten && o->call && o->inflight > 0) {
            o->beaten = 1;
            tqkv__rpc_cancel(o);
            if (o->dc && o->frames_left > 0)
                o->dc_bad = 1, o->frames_left = 0;
        }
    }
}
