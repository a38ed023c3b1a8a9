/* call.c - what a handler does with its call: the state transitions, the batches it starts
 * (receive, send, finish, abort), encoder-pool work and wakes, reading a message, the auth
 * check, and the call's request id, tenant and log line.
 *
 * Every function here runs on the call's worker thread except tqkv__call_wake; batches
 * on a call are started under its batch_mu (service_internal.h).
 */
#include "service/server.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/version.h"
#include "grpc/health/v1/health.pb-c.h"

#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif
#include "service/status_map.h"
#include "service/tls.h"
#include "transport/wire.h"

static const char *const state_names[] = {"REQUESTED", "RECV",   "WORK", "SEND",
                                          "IDLE",      "STATUS", "DONE"};

const char *
tqkv__call_state_name(tqkv__call_state_t st)
{
    return state_names[st];
}

void
tqkv__call_set_state(tqkv__call_t *c, tqkv__call_state_t st)
{
    /* DONE is final; nothing leaves it. */
    if (c->state == TQKV__CS_DONE && st != TQKV__CS_DONE) {
        tqkv_log(TQKV_LOG_ERROR, "call state machine: transition out of DONE", "method=%d to=%s",
                 (int)c->method, state_names[st]);
        abort();
    }
    if (tqkv_log_enabled(TQKV_LOG_DEBUG) && c->state != st)
        tqkv_log(TQKV_LOG_DEBUG, "call state", "call=%p method=%d from=%s to=%s", (void *)c,
                 (int)c->method, state_names[c->state], state_names[st]);
    c->state = st;
}

grpc_call_error
tqkv__call_start(tqkv__call_t *c, const grpc_op *ops, size_t n, tqkv__tag_kind_t k)
{
    c->inflight++;
    pthread_mutex_lock(&c->batch_mu);
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->tags[k], NULL);
    pthread_mutex_unlock(&c->batch_mu);
    if (e != GRPC_CALL_OK) {
        c->inflight--;
        tqkv_log(TQKV_LOG_ERROR, "grpc_call_start_batch failed", "error=%d tag=%d", (int)e, (int)k);
    }
    return e;
}

/* ---- request ids, tenants and the per-call log lines ---- */

static _Atomic uint64_t g_req_seq; /* request ids: splitmix64 of a random base + sequence */
static uint64_t g_req_base;

void
tqkv__call_req_id_init(void)
{
    uint64_t b = 0;
    FILE *f = fopen("/dev/urandom", "re");
    if (!f || fread(&b, sizeof b, 1, f) != 1) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        b = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 44);
    }
    if (f)
        fclose(f);
    g_req_base = b;
}

/* A client's x-request-id is kept when it is 1..64 characters of [A-Za-z0-9._:-] (it goes
 * into log lines and back to the client); anything else gets a generated id. */
static int
req_id_ok(const uint8_t *p, size_t n)
{
    if (n == 0 || n > 64)
        return 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t ch = p[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == ':' || ch == '-'))
            return 0;
    }
    return 1;
}

/* Sets c->req_id from the request metadata, or generates one (16 hex digits). */
void
tqkv__call_req_id_set(tqkv__call_t *c)
{
    for (size_t i = 0; i < c->md.count; i++) {
        if (grpc_slice_str_cmp(c->md.metadata[i].key, "x-request-id") == 0) {
            const uint8_t *p = GRPC_SLICE_START_PTR(c->md.metadata[i].value);
            size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
            if (req_id_ok(p, n)) {
                memcpy(c->req_id, p, n);
                c->req_id[n] = '\0';
                return;
            }
            break;
        }
    }
    uint64_t z = g_req_base + 0x9E3779B97F4A7C15ull * (atomic_fetch_add(&g_req_seq, 1) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    snprintf(c->req_id, sizeof c->req_id, "%016llx", (unsigned long long)z);
}

/* Adds x-request-id to a SEND_STATUS_FROM_SERVER op. The metadata lives in the call (its
 * slices are released in call_free), so it outlives the batch whatever the core keeps. */
void
tqkv__call_set_trailers(tqkv__call_t *c, grpc_op *op)
{
    if (!c->req_id[0])
        return;
    if (GRPC_SLICE_LENGTH(c->trail_md.key) == 0) {
        c->trail_md.key = grpc_slice_from_static_string("x-request-id");
        c->trail_md.value = grpc_slice_from_copied_string(c->req_id);
    }
    op->data.send_status_from_server.trailing_metadata_count = 1;
    op->data.send_status_from_server.trailing_metadata = &c->trail_md;
}

/* Records the first namespace a call names (any thread: Put's jobs run on the pool; the
 * worker reads it in call_free, after every job's wake came back). */
static void
tenant_set(tqkv__call_t *c, const char *ns)
{
    int expect = 0;
    if (!ns || atomic_load_explicit(&c->tenant_state, memory_order_relaxed) != 0 ||
        !atomic_compare_exchange_strong(&c->tenant_state, &expect, 1))
        return;
    snprintf(c->tenant, sizeof c->tenant, "%s", ns);
    atomic_store_explicit(&c->tenant_state, 2, memory_order_release);
}

/* Warn lines about calls (failed, slow) are capped at this many per second, so a client
 * hammering the server with bad requests cannot flood the log; the next line says how many
 * were left out. The access log is not capped (it is asked for). */
#define CALL_WARN_PER_SEC 100

static _Atomic int64_t g_warn_sec;
static _Atomic uint32_t g_warn_n;
static _Atomic uint64_t g_warn_dropped;

static int
warn_allowed(uint64_t *dropped)
{
    int64_t sec = (int64_t)(tqkv_clock_ns() / 1000000000u), w = atomic_load(&g_warn_sec);
    if (w != sec && atomic_compare_exchange_strong(&g_warn_sec, &w, sec))
        atomic_store(&g_warn_n, 0);
    if (atomic_fetch_add(&g_warn_n, 1) < CALL_WARN_PER_SEC) {
        *dropped = atomic_exchange(&g_warn_dropped, 0);
        return 1;
    }
    atomic_fetch_add(&g_warn_dropped, 1);
    return 0;
}

static const char *const k_code_names[] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

/* The lines a finished call may write: "rpc failed" (warn) for a non-OK status, "slow rpc"
 * (warn) past --slow-request-ms, and an access line (--access-log). Long-lived streams
 * (Health.Watch, reflection) end by cancellation and last as long as the client wants: they
 * are neither failures when cancelled nor slow. */
void
tqkv__call_log_end(tqkv__call_t *c, const char *method, double seconds)
{
    const tqkv_server_config_t *cfg = &c->srv->cfg;
    int open_ended = c->method == TQKV__M_HEALTH_WATCH || c->method == TQKV__M_REFLECT_V1 ||
                     c->method == TQKV__M_REFLECT_V1A;
    int failed = c->code != GRPC_STATUS_OK && !(open_ended && c->code == GRPC_STATUS_CANCELLED);
    int slow = !open_ended && cfg->slow_request_ms > 0 && seconds * 1e3 > cfg->slow_request_ms;
    int access = tqkv_log_access_enabled();
    uint64_t dropped = 0;
    if ((failed || slow) && !(tqkv_log_enabled(TQKV_LOG_WARN) && warn_allowed(&dropped)))
        failed = slow = 0;
    if (!failed && !slow && !access)
        return;
    char *peer = c->call ? grpc_call_get_peer(c->call) : NULL;
    char qpeer[160], qten[300], qdet[700], extra[40] = "";
    tqkv_log_quote(qpeer, sizeof qpeer, peer ? peer : "");
    gpr_free(peer);
    int has_tenant = atomic_load_explicit(&c->tenant_state, memory_order_acquire) == 2;
    tqkv_log_quote(qten, sizeof qten, has_tenant ? c->tenant : "");
    const char *det = c->detail                          ? c->detail
                      : c->code == GRPC_STATUS_CANCELLED ? "cancelled (client gone, "
                                                           "deadline passed or drain)"
                      : c->code != GRPC_STATUS_OK        ? "no detail"
                                                         : "";
    tqkv_log_quote(qdet, sizeof qdet, det);
    int code = (int)c->code >= 0 && (int)c->code <= 16 ? (int)c->code : 2;
    if (dropped)
        snprintf(extra, sizeof extra, " suppressed=%llu", (unsigned long long)dropped);
#define CALL_FIELDS "method=%s code=%s peer=\"%s\" tenant=\"%s\" duration_ms=%.3f request_id=%s"
#define CALL_ARGS method, k_code_names[code], qpeer, qten, seconds * 1e3, c->req_id
    if (failed)
        tqkv_log(TQKV_LOG_WARN, "rpc failed", CALL_FIELDS " detail=\"%s\"%s", CALL_ARGS, qdet,
                 extra);
    if (slow)
        tqkv_log(TQKV_LOG_WARN, "slow rpc", CALL_FIELDS " threshold_ms=%u%s", CALL_ARGS,
                 cfg->slow_request_ms, failed ? "" : extra);
    if (access)
        tqkv_log_access("rpc", CALL_FIELDS, CALL_ARGS);
#undef CALL_FIELDS
#undef CALL_ARGS
}

void
tqkv__call_abort(tqkv__call_t *c)
{
    if (c->call && !c->closed)
        grpc_call_cancel(c->call, NULL);
    if (c->code == GRPC_STATUS_OK)
        c->code = GRPC_STATUS_CANCELLED;
    tqkv__call_set_state(c, TQKV__CS_DONE);
}

void
tqkv__call_recv(tqkv__call_t *c)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    if (c->recv_bb) {
        grpc_byte_buffer_destroy(c->recv_bb);
        c->recv_bb = NULL;
    }
    if (c->closed) {
        tqkv__call_abort(c);
        return;
    }
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    tqkv__call_set_state(c, TQKV__CS_RECV);
    if (tqkv__call_start(c, &op, 1, TQKV__TAG_RECV) != GRPC_CALL_OK)
        tqkv__call_abort(c);
}

void
tqkv__call_send(tqkv__call_t *c, grpc_byte_buffer *bb)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    if (c->closed) {
        grpc_byte_buffer_destroy(bb);
        tqkv__call_abort(c);
        return;
    }
    c->send_bb = bb;
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    tqkv__call_set_state(c, TQKV__CS_SEND);
    if (tqkv__call_start(c, &op, 1, TQKV__TAG_SEND) != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(bb);
        c->send_bb = NULL;
        tqkv__call_abort(c);
    }
}

void
tqkv__call_finish(tqkv__call_t *c, grpc_status_code code, const char *msg, grpc_byte_buffer *last)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    c->code = code;
    if (c->closed) {
        if (last)
            grpc_byte_buffer_destroy(last);
        tqkv__call_abort(c);
        return;
    }
    if (last) {
        c->send_bb = last;
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = last;
        n++;
    }
    grpc_slice details = grpc_slice_from_copied_string(msg ? msg : "");
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = code;
    ops[n].data.send_status_from_server.status_details = &details;
    tqkv__call_set_trailers(c, &ops[n]);
    n++;
    if (code != GRPC_STATUS_OK && msg && !c->detail)
        c->detail = strdup(msg); /* for the "rpc failed" line (NULL when out of memory) */
    tqkv__call_set_state(c, TQKV__CS_STATUS);
    if (tqkv__call_start(c, ops, n, TQKV__TAG_STATUS) != GRPC_CALL_OK) {
        if (last) {
            grpc_byte_buffer_destroy(last);
            c->send_bb = NULL;
        }
        tqkv__call_abort(c);
    }
    grpc_slice_unref(details);
}

void
tqkv__call_finish_msg(tqkv__call_t *c, const ProtobufCMessage *m)
{
    grpc_byte_buffer *bb = tqkv_wire_encode(m);
    if (bb == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INTERNAL, "response encoding failed", NULL);
        return;
    }
    tqkv__call_finish(c, GRPC_STATUS_OK, NULL, bb);
}

void
tqkv__call_reserve_wake(tqkv__call_t *c)
{
    c->inflight++;
}

void
tqkv__call_wake(tqkv__call_t *c)
{
    /* The reservation already counted this tag in c->inflight. An empty batch puts
     * the tag on the call's completion queue at once. */
    pthread_mutex_lock(&c->batch_mu);
    grpc_call_error e = grpc_call_start_batch(c->call, NULL, 0, &c->tags[TQKV__TAG_WAKE], NULL);
    pthread_mutex_unlock(&c->batch_mu);
    if (e != GRPC_CALL_OK) {
        tqkv_log(TQKV_LOG_ERROR, "wake batch failed", "error=%d", (int)e);
        abort(); /* the call could never be freed: an invariant broke */
    }
}

tqkv_status_t
tqkv__call_submit(tqkv__call_t *c, tqkv_encoder_fn fn, void *arg)
{
    tqkv__call_reserve_wake(c);
    tqkv_status_t st = tqkv_encoder_submit(c->srv->enc, fn, arg);
    if (st != TQKV_OK)
        c->inflight--;
    return st;
}

tqkv_status_t
tqkv__call_work(tqkv__call_t *c, tqkv_encoder_fn fn)
{
    tqkv__call_set_state(c, TQKV__CS_WORK);
    return tqkv__call_submit(c, fn, c);
}

uint8_t *
tqkv__bb_read(grpc_byte_buffer *bb, size_t *len)
{
    grpc_byte_buffer_reader rd;
    size_t n = grpc_byte_buffer_length(bb);
    uint8_t *out = malloc(n ? n : 1);
    if (out == NULL)
        return NULL;
    if (!grpc_byte_buffer_reader_init(&rd, bb)) {
        free(out);
        return NULL;
    }
    grpc_slice s;
    size_t off = 0;
    while (grpc_byte_buffer_reader_next(&rd, &s)) {
        size_t sl = GRPC_SLICE_LENGTH(s);
        if (off + sl <= n)
            memcpy(out + off, GRPC_SLICE_START_PTR(s), sl);
        off += sl;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    if (off != n) {
        free(out);
        return NULL;
    }
    *len = n;
    return out;
}

tqkv_status_t
tqkv__call_auth(tqkv__call_t *c, const char *ns, unsigned perm, char *err, size_t errlen)
{
    tenant_set(c, ns);
    if (c->auth == NULL)
        return TQKV_OK;
    tqkv_status_t st =
        tqkv_auth_check(c->auth, c->authz, c->authz_len, ns, ns ? strlen(ns) : 0, perm);
    if (st == TQKV_EAUTH)
        snprintf(err, errlen, "authorization: missing, malformed or unknown bearer token");
    else if (st == TQKV_EPERM)
        snprintf(err, errlen, "authorization: token does not grant %s on namespace '%s'",
                 perm & TQKV_AUTH_WRITE ? "write" : "read", ns ? ns : "*");
    else if (st != TQKV_OK)
        snprintf(err, errlen, "authorization: %s", tqkv_strerror(st));
    return st;
}
