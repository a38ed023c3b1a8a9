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

/* After an UNAVAILABLE: replaces the target's channels that are not READY by fresh
 * ones (at most once per minimum back-off). A restarted server is then reached by a
 * new connection attempt at once, instead of after gRPC's reconnect back-off or an
 * old attempt's SYN retransmissions. */
static void
renew_channels(tqkv_client_t *c, size_t ti)
{
    target_t *t = c->t[ti];
    uint64_t now = tqkv_clock_ns(), last = atomic_load(&t->renewed_ns);
    if (now - last < (uint64_t)c->backoff_min * 1000000ull ||
        !atomic_compare_exchange_strong(&t->renewed_ns, &last, now))
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
        renew_channels(c, r->target);
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
    size_t live = 0;
    if (rs == NULL) {
        for (size_t i = 0; i < n; i++)
            sts[i] = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        tqkv__cq_destroy(cq);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        resps[i] = NULL;
        grpc_byte_buffer *bb = tqkv_wire_encode(reqs[i]);
        sts[i] = tqkv__rpc_start(c, &rs[i], cq, tis[i], method, dl, bb);
        if (rs[i].call == NULL)
            grpc_byte_buffer_destroy(bb), rs[i].init_bb = NULL;
        if (sts[i] == TQKV_OK)
            tqkv__rpc_recv(&rs[i]);
        live += rs[i].inflight > 0;
    }
    while (live > 0) {
        tag_kind_t k;
        int ok;
        rpc_t *r = tqkv__cq_step(cq, &k, &ok);
        if (r == NULL)
            break;
        size_t i = (size_t)(r - rs);
        if (k == TAG_RECV && r->recv_bb) {
            if (resps[i] == NULL)
                resps[i] = tqkv_wire_decode(rd, r->recv_bb);
            grpc_byte_buffer_destroy(r->recv_bb);
            r->recv_bb = NULL;
        }
        if (r->inflight == 0)
            live--;
    }
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
