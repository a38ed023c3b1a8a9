/* client.c - libtqkv: gRPC C-core client of tqkv.v1.KVCache, with sharding.
 *
 * Every operation owns a completion queue (grpc_completion_queue_create_for_next)
 * on which it starts all its calls (one per target it fans out to) and drives them
 * to completion on the calling thread. Threads share only the channels (thread-safe;
 * read under a per-target rwlock because a reconnect may swap them) and the atomic
 * per-target health (transport/shard.h); per-call state (rpc_t) belongs to one
 * operation. Each rpc_t counts its tags in flight and is
 * freed only when the count is zero (a started batch always comes back).
 *
 * Per call: RECV_STATUS_ON_CLIENT first in its own batch, then SEND_INITIAL_METADATA
 * (+ the request for unary and server-streaming calls), at most one SEND_MESSAGE and
 * one RECV_MESSAGE in flight.
 *
 * Get responses are parsed in place (a hand-written GetResponse reader over one
 * copy of the message into a scratch buffer shifted so that the page lands 64-byte
 * aligned), so a packed page costs one copy between the socket and the callback.
 */
#include "transport/client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kernels/page.h"
#include "kernels/page_format.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/data_channel.h"
#include "transport/shard.h"
#include "transport/wire.h"

#define M_PUT "/tqkv.v1.KVCache/Put"
#define M_LOOKUP "/tqkv.v1.KVCache/Lookup"
#define M_GET "/tqkv.v1.KVCache/Get"
#define M_DELETE "/tqkv.v1.KVCache/Delete"
#define M_STATS "/tqkv.v1.KVCache/Stats"
#define M_HEALTH "/grpc.health.v1.Health/Check"

/* Lock rule: ch[] is read under lock (shared) to start a call or read the connectivity
 * state; a reconnect swaps a channel under lock (exclusive) and destroys the old one
 * after unlocking (calls started on it hold their own references). */
typedef struct target {
    char *name;
    grpc_channel **ch; /* nch channels, each its own connection */
    uint32_t nch;
    pthread_rwlock_t lock;
    _Atomic uint64_t renewed_ns; /* last reconnect (monotonic ns) */
    _Atomic uint32_t rr;
    uint64_t id; /* rendezvous id of name */
    tqkv_shard_health_t health;
    /* TCP data channels (TQKV_CLIENT_TRANSPORT_TCP), under dc_mu: idle connected
     * channels, and why the target has none (then its Gets use gRPC) */
    pthread_mutex_t dc_mu;
    struct dconn *dc_idle;
    _Atomic int dc_off;
    char dc_why[256];
    _Atomic uint64_t dc_retry_ns; /* dc_off: try again after this */
} target_t;

/* A connected TCP data channel, owned by one Get at a time. */
typedef struct dconn {
    int fd;
    uint64_t id;
    struct dconn *next;
} dconn_t;

struct tqkv_client {
    target_t *t;
    size_t nt;
    uint32_t replicas;
    uint32_t deadline_ms;
    uint32_t backoff_min, backoff_max;
    int wait_for_ready;
    int has_auth;
    grpc_metadata auth_md;           /* "authorization: Bearer <token>" (slices owned) */
    grpc_channel_credentials *creds; /* kept to rebuild channels */
    grpc_arg args[10];
    grpc_channel_args cargs;
    char *tls_name; /* owned copy for the target-name override arg */
    int transport;  /* TQKV_CLIENT_TRANSPORT_* */
    size_t max_msg; /* receive limit, also for data channel pages */
};

static _Thread_local tqkv_client_error_t last_err;

const tqkv_client_error_t *
tqkv_client_last_error(void)
{
    return &last_err;
}

static tqkv_status_t
set_err(tqkv_status_t st, int code, const char *fmt, ...)
{
    va_list ap;
    last_err.status = st;
    last_err.grpc_code = code;
    va_start(ap, fmt);
    vsnprintf(last_err.message, sizeof last_err.message, fmt, ap);
    va_end(ap);
    return st;
}

tqkv_status_t
tqkv__client_set_error(tqkv_status_t st, int grpc_code, const char *msg)
{
    return set_err(st, grpc_code, "%s", msg);
}

static tqkv_status_t
status_from_grpc(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return TQKV_OK;
    case GRPC_STATUS_CANCELLED:
        return TQKV_ECANCELED;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_OUT_OF_RANGE:
    case GRPC_STATUS_FAILED_PRECONDITION:
        return TQKV_EINVAL;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return TQKV_ETIMEDOUT;
    case GRPC_STATUS_NOT_FOUND:
        return TQKV_ENOTFOUND;
    case GRPC_STATUS_PERMISSION_DENIED:
        return TQKV_EPERM;
    case GRPC_STATUS_UNAUTHENTICATED:
        return TQKV_EAUTH;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return TQKV_ENOSPC;
    case GRPC_STATUS_UNIMPLEMENTED:
        return TQKV_EUNSUPPORTED;
    case GRPC_STATUS_UNAVAILABLE:
        return TQKV_EUNAVAILABLE;
    case GRPC_STATUS_DATA_LOSS:
        return TQKV_ECORRUPT;
    default:
        return TQKV_EINTERNAL;
    }
}

static gpr_timespec
deadline_after(uint32_t ms)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* ---- one call ---- */

typedef enum { TAG_STATUS, TAG_INIT, TAG_SEND, TAG_RECV } tag_kind_t;
typedef struct rpc rpc_t;
typedef struct rtag {
    rpc_t *r;
    tag_kind_t k;
} rtag_t;

struct rpc {
    grpc_call *call;
    size_t target;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    grpc_byte_buffer *init_bb; /* request of a unary/server-streaming call */
    grpc_byte_buffer *send_bb; /* the SEND_MESSAGE in flight */
    grpc_byte_buffer *recv_bb;
    int inflight; /* tags not yet back */
    int send_busy, recv_busy;
    int status_done, recv_eof, send_failed, closed;
    uint64_t sent; /* messages sent (put) */
    rtag_t t_status, t_init, t_send, t_recv;
    /* operation state */
    size_t *gidx; /* Get/Lookup: global hash index of each hash sent */
    size_t count;
    size_t pos; /* messages received */
    /* Get over a TCP data channel: the channel, frames still due, the next index */
    dconn_t *dc;
    size_t frames_left, next_frame;
    int dc_bad;       /* out of step with the server: closed, not reused */
    char dc_eof[240]; /* the server closed the channel mid-Get: why, if its status is OK */
};

static tqkv_status_t
rpc_start(tqkv_client_t *c, rpc_t *r, grpc_completion_queue *cq, size_t ti, const char *method,
          gpr_timespec deadline, grpc_byte_buffer *req)
{
    target_t *t = &c->t[ti];
    uint32_t k = atomic_fetch_add_explicit(&t->rr, 1, memory_order_relaxed) % t->nch;
    grpc_op ops[4];
    grpc_call_error e;

    r->target = ti;
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
        return set_err(TQKV_ENOMEM, 0, "grpc_channel_create_call failed");

    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &r->trail_md;
    ops[0].data.recv_status_on_client.status = &r->status;
    ops[0].data.recv_status_on_client.status_details = &r->details;
    ops[0].data.recv_status_on_client.error_string = &r->error_string;
    e = grpc_call_start_batch(r->call, ops, 1, &r->t_status, NULL);
    if (e != GRPC_CALL_OK)
        return set_err(TQKV_EINTERNAL, 0, "start_batch(status): %d", (int)e);
    r->inflight++;

    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].data.send_initial_metadata.count = c->has_auth ? 1 : 0;
    ops[n].data.send_initial_metadata.metadata = c->has_auth ? &c->auth_md : NULL;
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
    if (e != GRPC_CALL_OK) {
        grpc_call_cancel(r->call, NULL);
        return set_err(TQKV_EINTERNAL, 0, "start_batch(init): %d", (int)e);
    }
    r->inflight++;
    return TQKV_OK;
}

static void
rpc_recv(rpc_t *r)
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
static int
rpc_send(rpc_t *r, grpc_byte_buffer *bb)
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
static void
rpc_close_and_recv(rpc_t *r)
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
        grpc_call_cancel(r->call, NULL);
    }
}

/* Bookkeeping of one completed tag. The receive buffer is left for the caller. */
static void
rpc_event(rpc_t *r, tag_kind_t k, int ok)
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
static void
rpc_fini(rpc_t *r)
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
static rpc_t *
cq_step(grpc_completion_queue *cq, tag_kind_t *k, int *ok)
{
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE)
        return NULL;
    rtag_t *t = ev.tag;
    rpc_event(t->r, t->k, ev.success);
    *k = t->k;
    *ok = ev.success;
    return t->r;
}

static void
cq_destroy(grpc_completion_queue *cq)
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
    target_t *t = &c->t[ti];
    uint64_t now = tqkv_shard_now_ns(), last = atomic_load(&t->renewed_ns);
    if (now - last < (uint64_t)c->backoff_min * 1000000ull ||
        !atomic_compare_exchange_strong(&t->renewed_ns, &last, now))
        return;
    for (uint32_t k = 0; k < t->nch; k++) {
        pthread_rwlock_rdlock(&t->lock);
        grpc_connectivity_state s = grpc_channel_check_connectivity_state(t->ch[k], 0);
        pthread_rwlock_unlock(&t->lock);
        if (s == GRPC_CHANNEL_READY)
            continue;
        grpc_channel *nc = grpc_channel_create(t->name, c->creds, &c->cargs);
        if (nc == NULL)
            continue;
        pthread_rwlock_wrlock(&t->lock);
        grpc_channel *old = t->ch[k];
        t->ch[k] = nc;
        pthread_rwlock_unlock(&t->lock);
        grpc_channel_destroy(old);
    }
}

/* Status of a finished call as a tqkv status (sets the thread's error) and updates
 * the target's health: UNAVAILABLE backs the target off, OK clears it. */
static tqkv_status_t
rpc_result(tqkv_client_t *c, rpc_t *r)
{
    target_t *t = &c->t[r->target];
    if (r->status == GRPC_STATUS_OK) {
        tqkv_shard_health_ok(&t->health, c->backoff_min);
        return TQKV_OK;
    }
    if (r->status == GRPC_STATUS_UNAVAILABLE) {
        tqkv_shard_health_fail(&t->health, tqkv_shard_now_ns(), c->backoff_min, c->backoff_max);
        renew_channels(c, r->target);
    } else
        tqkv_shard_health_ok(&t->health, c->backoff_min);
    char *d = grpc_slice_to_c_string(r->details);
    tqkv_status_t st = status_from_grpc(r->status);
    set_err(st, (int)r->status, "%s: %s", t->name, d && d[0] ? d : "(no details)");
    gpr_free(d);
    return st;
}

/* Whether target ti takes calls now (always, with a single target): not backed off,
 * and its channel not in TRANSIENT_FAILURE (gRPC's own reconnect back-off: a call
 * there would fail at once and, for a Put, lose its blocks). */
static int
usable(tqkv_client_t *c, size_t ti, uint64_t now)
{
    if (c->nt == 1)
        return 1;
    if (!tqkv_shard_health_usable(&c->t[ti].health, now))
        return 0;
    pthread_rwlock_rdlock(&c->t[ti].lock);
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(c->t[ti].ch[0], 1);
    pthread_rwlock_unlock(&c->t[ti].lock);
    return s != GRPC_CHANNEL_TRANSIENT_FAILURE && s != GRPC_CHANNEL_SHUTDOWN;
}

/* ---- unary fan-out ---- */

/* Runs n unary calls in parallel: call i to target tis[i] with reqs[i]; writes
 * resps[i] (new, or NULL) and sts[i]. Borrows reqs. */
static void
unary_fanout(tqkv_client_t *c, size_t n, const size_t *tis, const char *method,
             ProtobufCMessage *const *reqs, const ProtobufCMessageDescriptor *rd,
             uint32_t deadline_ms, ProtobufCMessage **resps, tqkv_status_t *sts)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    rpc_t *rs = calloc(n, sizeof *rs);
    gpr_timespec dl = deadline_after(deadline_ms ? deadline_ms : c->deadline_ms);
    size_t live = 0;
    if (rs == NULL) {
        for (size_t i = 0; i < n; i++)
            sts[i] = set_err(TQKV_ENOMEM, 0, "out of memory");
        cq_destroy(cq);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        resps[i] = NULL;
        grpc_byte_buffer *bb = tqkv_wire_encode(reqs[i]);
        sts[i] = rpc_start(c, &rs[i], cq, tis[i], method, dl, bb);
        if (rs[i].call == NULL)
            grpc_byte_buffer_destroy(bb), rs[i].init_bb = NULL;
        if (sts[i] == TQKV_OK)
            rpc_recv(&rs[i]);
        live += rs[i].inflight > 0;
    }
    while (live > 0) {
        tag_kind_t k;
        int ok;
        rpc_t *r = cq_step(cq, &k, &ok);
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
            sts[i] = rpc_result(c, &rs[i]);
            if (sts[i] == TQKV_OK && resps[i] == NULL)
                sts[i] = set_err(TQKV_EINTERNAL, 0, "%s: malformed response", c->t[tis[i]].name);
        }
        if (sts[i] != TQKV_OK && resps[i]) {
            protobuf_c_message_free_unpacked(resps[i], NULL);
            resps[i] = NULL;
        }
        rpc_fini(&rs[i]);
    }
    free(rs);
    cq_destroy(cq);
}

/* ---- create / destroy ---- */

static char *
read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        if (n + 1024 >= cap) {
            char *nb = realloc(b, cap * 2);
            if (nb == NULL) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t got = fread(b + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    if (b)
        b[n] = '\0';
    return b;
}

static int
add_target(tqkv_client_t *c, size_t *cap, const char *name)
{
    if (c->nt == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        target_t *nt = realloc(c->t, nc * sizeof *nt);
        if (nt == NULL)
            return -1;
        c->t = nt;
        *cap = nc;
    }
    target_t *t = &c->t[c->nt];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (t->name == NULL)
        return -1;
    t->id = tqkv_shard_target_id(name);
    tqkv_shard_health_init(&t->health);
    pthread_rwlock_init(&t->lock, NULL);
    pthread_mutex_init(&t->dc_mu, NULL);
    atomic_init(&t->renewed_ns, 0);
    c->nt++;
    return 0;
}

/* Adds name, expanded to one target per address when it is "host:port" with a DNS
 * host that resolves to several addresses. */
static int
add_resolved(tqkv_client_t *c, size_t *cap, const char *name)
{
    const char *colon = strrchr(name, ':');
    if (strstr(name, "://") || strchr(name, '[') || colon == NULL || colon == name)
        return add_target(c, cap, name);
    char host[256];
    size_t hl = (size_t)(colon - name);
    if (hl >= sizeof host)
        return add_target(c, cap, name);
    memcpy(host, name, hl);
    host[hl] = '\0';
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0 || res == NULL)
        return add_target(c, cap, name);
    size_t before = c->nt;
    char seen[64][96];
    size_t nseen = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        char ip[64], t[96];
        if (a->ai_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
            snprintf(t, sizeof t, "ipv4:%s:%s", ip, colon + 1);
        } else if (a->ai_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
            snprintf(t, sizeof t, "ipv6:[%s]:%s", ip, colon + 1);
        } else {
            continue;
        }
        int dup = 0;
        for (size_t i = 0; i < nseen; i++)
            dup |= strcmp(seen[i], t) == 0;
        if (dup || nseen == 64)
            continue;
        snprintf(seen[nseen++], sizeof seen[0], "%s", t);
    }
    freeaddrinfo(res);
    if (nseen <= 1)
        return add_target(c, cap, name);
    for (size_t i = 0; i < nseen; i++)
        if (add_target(c, cap, seen[i]) != 0)
            return -1;
    return c->nt > before ? 0 : -1;
}

tqkv_status_t
tqkv_client_create(const tqkv_client_opts_t *o, tqkv_client_t **out)
{
    tqkv_status_t st = TQKV_OK;
    grpc_channel_credentials *creds = NULL;
    char *ca = NULL, *cert = NULL, *key = NULL;
    size_t cap = 0;

    if (out == NULL)
        return set_err(TQKV_EINVAL, 0, "client_create: out is NULL");
    *out = NULL;
    if (o == NULL || o->num_targets == 0 || o->targets == NULL)
        return set_err(TQKV_EINVAL, 0, "no target");
    tqkv_client_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return set_err(TQKV_ENOMEM, 0, "out of memory");
    grpc_init();
    c->replicas = o->replicas ? o->replicas : 1;
    c->deadline_ms = o->deadline_ms ? o->deadline_ms : TQKV_CLIENT_DEFAULT_DEADLINE_MS;
    c->backoff_min = o->backoff_min_ms ? o->backoff_min_ms : 200;
    c->backoff_max = o->backoff_max_ms ? o->backoff_max_ms : 5000;
    if (c->backoff_max < c->backoff_min)
        c->backoff_max = c->backoff_min;
    c->wait_for_ready = o->wait_for_ready;

    for (size_t i = 0; i < o->num_targets; i++) {
        if (o->targets[i] == NULL || o->targets[i][0] == '\0') {
            st = set_err(TQKV_EINVAL, 0, "empty target");
            goto fail;
        }
        if ((o->resolve_targets ? add_resolved(c, &cap, o->targets[i])
                                : add_target(c, &cap, o->targets[i])) != 0) {
            st = set_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
    }
    if (c->nt > TQKV_CLIENT_MAX_TARGETS) {
        st = set_err(TQKV_EINVAL, 0, "%zu targets: at most %u", c->nt, TQKV_CLIENT_MAX_TARGETS);
        goto fail;
    }
    /* A target named twice would rank twice: R replicas of a block could land on one
     * server, and losing it would lose every copy. */
    for (size_t i = 0; i < c->nt; i++)
        for (size_t j = 0; j < i; j++)
            if (strcmp(c->t[i].name, c->t[j].name) == 0) {
                st = set_err(TQKV_EINVAL, 0,
                             "duplicate target %s (each server once: replicas must land on "
                             "different servers)",
                             c->t[i].name);
                goto fail;
            }
    if (c->replicas > c->nt)
        c->replicas = (uint32_t)c->nt;

    if (o->tls || o->tls_ca_path || o->tls_cert_path) {
        if (o->tls_ca_path && (ca = read_file(o->tls_ca_path)) == NULL) {
            st = set_err(TQKV_EINVAL, 0, "cannot read TLS CA %s: %s", o->tls_ca_path,
                         strerror(errno));
            goto fail;
        }
        if ((o->tls_cert_path == NULL) != (o->tls_key_path == NULL)) {
            st = set_err(TQKV_EINVAL, 0, "TLS client cert and key go together");
            goto fail;
        }
        if (o->tls_cert_path) {
            cert = read_file(o->tls_cert_path);
            key = read_file(o->tls_key_path);
            if (cert == NULL || key == NULL) {
                st = set_err(TQKV_EINVAL, 0, "cannot read TLS client cert/key");
                goto fail;
            }
        }
        grpc_ssl_pem_key_cert_pair kp = {key, cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &kp : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (creds == NULL) {
        st = set_err(TQKV_EINVAL, 0, "cannot create channel credentials");
        goto fail;
    }

    size_t maxmsg = o->max_message_bytes ? o->max_message_bytes : TQKV_CLIENT_DEFAULT_MAX_MESSAGE;
    c->max_msg = maxmsg;
    if (o->transport != TQKV_CLIENT_TRANSPORT_GRPC && o->transport != TQKV_CLIENT_TRANSPORT_TCP) {
        st = set_err(TQKV_EINVAL, 0, "transport %d: expected TQKV_CLIENT_TRANSPORT_GRPC or _TCP",
                     o->transport);
        goto fail;
    }
    c->transport = o->transport;
    int maxmsg_i = maxmsg > 0x7fffffff ? 0x7fffffff : (int)maxmsg;
    grpc_arg *args = c->args;
    size_t na = 0;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[na++].value.integer = maxmsg_i;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[na++].value.integer = maxmsg_i;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[na++].value.integer = 1;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_HTTP2_MAX_FRAME_SIZE;
    args[na++].value.integer = (1 << 24) - 1;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_TCP_READ_CHUNK_SIZE;
    args[na++].value.integer = 1 << 20;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
    args[na++].value.integer = 100;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS; /* gRPC uses it as the connect timeout */
    args[na++].value.integer = 5000;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
    args[na++].value.integer = 1000;
    if (o->tls_target_name) {
        args[na].type = GRPC_ARG_STRING;
        args[na].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        c->tls_name = strdup(o->tls_target_name);
        if (c->tls_name == NULL) {
            st = set_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        args[na++].value.string = c->tls_name;
    }
    c->cargs.num_args = na;
    c->cargs.args = args;
    uint32_t nch = o->channels_per_target ? o->channels_per_target : 1;
    for (size_t i = 0; i < c->nt; i++) {
        target_t *t = &c->t[i];
        t->ch = calloc(nch, sizeof *t->ch);
        if (t->ch == NULL) {
            st = set_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        for (uint32_t k = 0; k < nch; k++) {
            t->ch[k] = grpc_channel_create(t->name, creds, &c->cargs);
            if (t->ch[k] == NULL) {
                st = set_err(TQKV_EINVAL, 0, "cannot create a channel to %s", t->name);
                goto fail;
            }
            t->nch++;
        }
    }
    c->creds = creds;
    creds = NULL;

    if (o->token && o->token[0]) {
        size_t tl = strlen(o->token);
        char *v = malloc(tl + 8);
        if (v == NULL) {
            st = set_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        memcpy(v, "Bearer ", 7);
        memcpy(v + 7, o->token, tl + 1);
        c->auth_md.key = grpc_slice_from_static_string("authorization");
        c->auth_md.value = grpc_slice_from_copied_string(v);
        c->has_auth = 1;
        free(v);
    }
    free(ca);
    free(cert);
    free(key);
    *out = c;
    return TQKV_OK;

fail:
    if (creds)
        grpc_channel_credentials_release(creds);
    free(ca);
    free(cert);
    free(key);
    tqkv_client_destroy(c);
    return st;
}

void
tqkv_client_destroy(tqkv_client_t *c)
{
    if (c == NULL)
        return;
    for (size_t i = 0; i < c->nt; i++) {
        for (uint32_t k = 0; k < c->t[i].nch; k++)
            grpc_channel_destroy(c->t[i].ch[k]);
        free(c->t[i].ch);
        free(c->t[i].name);
        pthread_rwlock_destroy(&c->t[i].lock);
        for (dconn_t *d = c->t[i].dc_idle, *nx; d; d = nx) {
            nx = d->next;
            close(d->fd); /* the server drops a channel whose connection closes */
            free(d);
        }
        pthread_mutex_destroy(&c->t[i].dc_mu);
    }
    free(c->t);
    if (c->has_auth)
        grpc_slice_unref(c->auth_md.value);
    if (c->creds)
        grpc_channel_credentials_release(c->creds);
    free(c->tls_name);
    free(c);
    grpc_shutdown();
}

size_t
tqkv_client_num_targets(const tqkv_client_t *c)
{
    return c ? c->nt : 0;
}

const char *
tqkv_client_target_name(const tqkv_client_t *c, size_t i)
{
    return c && i < c->nt ? c->t[i].name : NULL;
}

uint32_t
tqkv__client_replicas(const tqkv_client_t *c)
{
    return c ? c->replicas : 0;
}

/* Candidate targets of a block, best first: cand[0..nc). */
static size_t
candidates(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t *cand)
{
    if (c->nt == 1) {
        cand[0] = 0;
        return 1;
    }
    uint64_t ids[64];
    size_t n = c->nt < 64 ? c->nt : 64;
    for (size_t i = 0; i < n; i++)
        ids[i] = c->t[i].id;
    tqkv_shard_rank(ids, n, tqkv_shard_block_key(ns, h->bytes, h->len), cand);
    return n;
}

/* How many rank positions Get and Lookup ask: the R replicas plus one more, where a
 * Put lands while one of the R was down. */
static size_t
read_candidates(tqkv_client_t *c)
{
    size_t n = (size_t)c->replicas + 1;
    return n < c->nt ? n : c->nt;
}

static int
hash_ok(const tqkv_hash_t *h)
{
    return h && h->len >= 8 && h->len <= TQKV_HASH_MAX;
}

/* ---- Put ---- */

/* A Put message kept (sharing its slices) until its stream's response, so that with
 * several targets the blocks of a stream that fails can go to the next in rank. */
typedef struct kept {
    grpc_byte_buffer *bb;
    uint64_t holders; /* targets this block was sent to */
    uint8_t nrank;
    uint8_t rank[TQKV_CLIENT_MAX_TARGETS];
} kept_t;

typedef struct keptvec {
    kept_t *v;
    size_t n, cap;
} keptvec_t;

static int
kept_push(keptvec_t *kv, const kept_t *k)
{
    if (kv->n == kv->cap) {
        size_t nc = kv->cap ? kv->cap * 2 : 16;
        kept_t *nv = realloc(kv->v, nc * sizeof *nv);
        if (nv == NULL)
            return -1;
        kv->v = nv;
        kv->cap = nc;
    }
    kv->v[kv->n++] = *k;
    return 0;
}

static void
kept_clear(keptvec_t *kv)
{
    for (size_t i = 0; i < kv->n; i++)
        grpc_byte_buffer_destroy(kv->v[i].bb);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

struct tqkv_put {
    tqkv_client_t *c;
    grpc_completion_queue *cq;
    rpc_t **rpc;      /* per target, started lazily */
    keptvec_t *kept;  /* per target: messages sent on its current stream (several targets) */
    keptvec_t resend; /* messages of failed streams, for the next target in rank */
    gpr_timespec deadline;
    Tqkv__V1__Codec codec;
    int has_codec;
    tqkv_put_result_t res;
    tqkv_status_t err;
};

tqkv_status_t
tqkv_client_put_begin(tqkv_client_t *c, const tqkv_put_opts_t *o, tqkv_put_t **out)
{
    if (out == NULL)
        return set_err(TQKV_EINVAL, 0, "put_begin: out is NULL");
    *out = NULL;
    if (c == NULL)
        return set_err(TQKV_EINVAL, 0, "put_begin: client is NULL");
    tqkv_put_t *p = calloc(1, sizeof *p);
    if (p == NULL || (p->rpc = calloc(c->nt, sizeof *p->rpc)) == NULL ||
        (p->kept = calloc(c->nt, sizeof *p->kept)) == NULL) {
        if (p)
            free(p->rpc);
        free(p);
        return set_err(TQKV_ENOMEM, 0, "out of memory");
    }
    p->c = c;
    p->cq = grpc_completion_queue_create_for_next(NULL);
    p->deadline = deadline_after(o && o->deadline_ms ? o->deadline_ms : c->deadline_ms);
    tqkv__v1__codec__init(&p->codec);
    if (o && (o->key_bits > 0 || o->value_bits > 0 || o->key_mode || o->value_mode)) {
        p->has_codec = 1;
        p->codec.key_bits = o->key_bits;
        p->codec.value_bits = o->value_bits;
        p->codec.key_mode = (Tqkv__V1__Mode)o->key_mode;
        p->codec.value_mode = (Tqkv__V1__Mode)o->value_mode;
    }
    *out = p;
    return TQKV_OK;
}

static void
put_step(tqkv_put_t *p)
{
    tag_kind_t k;
    int ok;
    (void)cq_step(p->cq, &k, &ok);
}

/* Frees the stream of target ti (all its tags back). Its kept messages go to the
 * resend list when failed says the stream lost them and the client has several
 * targets; otherwise they are released. */
static void
put_release(tqkv_put_t *p, size_t ti, int failed)
{
    rpc_t *r = p->rpc[ti];
    keptvec_t *kv = &p->kept[ti];
    if (failed && p->c->nt > 1) {
        for (size_t i = 0; i < kv->n; i++) {
            if (kept_push(&p->resend, &kv->v[i]) != 0) {
                grpc_byte_buffer_destroy(kv->v[i].bb);
                p->res.blocks_lost++;
            }
        }
        free(kv->v);
        memset(kv, 0, sizeof *kv);
    } else {
        if (failed)
            p->res.blocks_lost += r->sent;
        kept_clear(kv);
    }
    rpc_fini(r);
    free(r);
    p->rpc[ti] = NULL;
}

/* Ends a stream that failed: waits for its tags, frees it. Returns its status. */
static tqkv_status_t
put_drop(tqkv_put_t *p, size_t ti)
{
    rpc_t *r = p->rpc[ti];
    if (!r->status_done)
        grpc_call_cancel(r->call, NULL);
    while (r->inflight > 0)
        put_step(p);
    tqkv_status_t st = rpc_result(p->c, r);
    if (st == TQKV_OK)
        st = set_err(TQKV_EINTERNAL, 0, "%s: Put stream ended early", p->c->t[ti].name);
    put_release(p, ti, st == TQKV_EUNAVAILABLE);
    return st;
}

static tqkv_status_t
put_stream(tqkv_put_t *p, size_t ti, rpc_t **out)
{
    rpc_t *r = p->rpc[ti];
    if (r == NULL) {
        r = calloc(1, sizeof *r);
        if (r == NULL)
            return set_err(TQKV_ENOMEM, 0, "out of memory");
        p->rpc[ti] = r;
        tqkv_status_t st = rpc_start(p->c, r, p->cq, ti, M_PUT, p->deadline, NULL);
        if (st != TQKV_OK) {
            while (r->inflight > 0)
                put_step(p);
            put_release(p, ti, 0);
            return st;
        }
    }
    while (r->send_busy)
        put_step(p);
    if (r->send_failed || r->status_done)
        return put_drop(p, ti);
    *out = r;
    return TQKV_OK;
}

/* Sends bb (borrowed; a copy goes out) to up to `want` usable targets of rank[],
 * skipping the holders. Writes the targets used into *holders. Returns how many
 * took it; *st is the first error that is not a down target. */
static size_t
put_route(tqkv_put_t *p, grpc_byte_buffer *bb, const uint8_t *rank, size_t nrank, size_t want,
          uint64_t *holders, tqkv_status_t *st)
{
    tqkv_client_t *c = p->c;
    uint64_t now = tqkv_shard_now_ns();
    size_t sent = 0;
    uint64_t used = 0;
    *st = TQKV_OK;
    for (size_t i = 0; i < nrank && sent < want; i++) {
        size_t ti = rank[i];
        rpc_t *r = NULL;
        if ((*holders >> ti) & 1 || !usable(c, ti, now))
            continue;
        tqkv_status_t s = put_stream(p, ti, &r);
        if (s == TQKV_OK && rpc_send(r, grpc_byte_buffer_copy(bb)) != 0)
            s = put_drop(p, ti);
        if (s != TQKV_OK) {
            if (c->nt > 1 && s == TQKV_EUNAVAILABLE)
                continue; /* that server is down: the next in rank takes the block */
            *st = s;
            break;
        }
        used |= 1ull << ti;
        p->res.blocks_sent++;
        sent++;
    }
    *holders |= used;
    if (c->nt > 1) {
        /* Keep the message on each stream it went to, with the ranking. */
        for (size_t ti = 0; ti < c->nt; ti++) {
            if (!((used >> ti) & 1))
                continue;
            kept_t k = {
                .bb = grpc_byte_buffer_copy(bb), .holders = *holders, .nrank = (uint8_t)nrank};
            memcpy(k.rank, rank, nrank);
            if (kept_push(&p->kept[ti], &k) != 0)
                grpc_byte_buffer_destroy(k.bb);
        }
    }
    return sent;
}

tqkv_status_t
tqkv_client_put_block(tqkv_put_t *p, const tqkv_put_block_t *b)
{
    if (p == NULL)
        return set_err(TQKV_EINVAL, 0, "put_block: session is NULL");
    tqkv_client_t *c = p->c;
    Tqkv__V1__PutRequest m;
    size_t tensor = 0;

    if (p->err != TQKV_OK)
        return p->err;
    if (b == NULL || b->ns == NULL || !hash_ok(b->hash) || (b->parent && !hash_ok(b->parent)))
        return set_err(TQKV_EINVAL, 0, "put: namespace and a hash of 8..64 bytes required");
    if (b->page == NULL) {
        tensor = (size_t)b->shape.num_tokens * b->shape.num_kv_heads * b->shape.head_dim * 2;
        if (tensor == 0 || b->key == NULL || b->value == NULL)
            return set_err(TQKV_EINVAL, 0, "put: key, value and a non-zero shape required");
    } else if (b->page_len == 0) {
        return set_err(TQKV_EINVAL, 0, "put: empty page");
    }
    tqkv__v1__put_request__init(&m);
    m.namespace_ = (char *)b->ns;
    m.hash.data = (uint8_t *)b->hash->bytes;
    m.hash.len = b->hash->len;
    if (b->parent) {
        m.parent_hash.data = (uint8_t *)b->parent->bytes;
        m.parent_hash.len = b->parent->len;
    }
    m.layer = b->layer;
    m.num_layers = b->num_layers;
    m.num_tokens = b->shape.num_tokens;
    m.num_kv_heads = b->shape.num_kv_heads;
    m.head_dim = b->shape.head_dim;
    if (b->page) {
        m.page.data = (uint8_t *)b->page;
        m.page.len = b->page_len;
    } else {
        m.key.data = (uint8_t *)b->key;
        m.key.len = tensor;
        m.value.data = (uint8_t *)b->value;
        m.value.len = tensor;
    }
    if (p->has_codec)
        m.codec = &p->codec;
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    if (bb == NULL)
        return set_err(TQKV_ENOMEM, 0, "out of memory");

    uint32_t cand[TQKV_CLIENT_MAX_TARGETS];
    uint8_t rank[TQKV_CLIENT_MAX_TARGETS];
    size_t nc = candidates(c, b->ns, b->hash, cand);
    for (size_t i = 0; i < nc; i++)
        rank[i] = (uint8_t)cand[i];
    uint64_t holders = 0;
    tqkv_status_t st;
    size_t sent = put_route(p, bb, rank, nc, c->replicas, &holders, &st);
    grpc_byte_buffer_destroy(bb);
    if (sent == 0 && st == TQKV_OK)
        st = set_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE, "put: no live target");
    if (sent == 0 || st != TQKV_OK)
        p->err = st;
    return sent > 0 ? TQKV_OK : st;
}

static void
put_free(tqkv_put_t *p)
{
    for (size_t i = 0; i < p->c->nt; i++)
        if (p->rpc[i])
            put_release(p, i, 0);
    kept_clear(&p->resend);
    free(p->kept);
    free(p->rpc);
    cq_destroy(p->cq);
    free(p);
}

/* Half-closes every stream, collects the responses, and frees the streams. Failed
 * streams' messages move to the resend list (several targets). Returns the first
 * error that is not a down target of a sharded client (*saved: its message). */
static tqkv_status_t
put_collect(tqkv_put_t *p, tqkv_client_error_t *saved)
{
    tqkv_client_t *c = p->c;
    tqkv_status_t first = TQKV_OK;
    for (size_t i = 0; i < c->nt; i++) {
        rpc_t *r = p->rpc[i];
        if (r == NULL)
            continue;
        while (r->send_busy)
            put_step(p);
        if (!r->status_done && !r->send_failed)
            rpc_close_and_recv(r);
        else
            grpc_call_cancel(r->call, NULL);
    }
    for (;;) {
        int busy = 0;
        for (size_t i = 0; i < c->nt; i++)
            busy |= p->rpc[i] && p->rpc[i]->inflight > 0;
        if (!busy)
            break;
        put_step(p);
    }
    for (size_t i = 0; i < c->nt; i++) {
        rpc_t *r = p->rpc[i];
        if (r == NULL)
            continue;
        tqkv_status_t st = rpc_result(c, r);
        Tqkv__V1__PutResponse *resp = NULL;
        if (st == TQKV_OK && r->recv_bb)
            resp = (Tqkv__V1__PutResponse *)tqkv_wire_decode(&tqkv__v1__put_response__descriptor,
                                                             r->recv_bb);
        if (st == TQKV_OK && resp == NULL)
            st = set_err(TQKV_EINTERNAL, 0, "%s: malformed PutResponse", c->t[i].name);
        if (resp) {
            p->res.blocks_stored += resp->blocks_stored;
            p->res.blocks_duplicate += resp->blocks_duplicate;
            p->res.bytes_in += resp->bytes_in;
            p->res.bytes_stored += resp->bytes_stored;
            protobuf_c_message_free_unpacked(&resp->base, NULL);
        }
        int down = c->nt > 1 && st == TQKV_EUNAVAILABLE;
        put_release(p, i, st != TQKV_OK && (down || c->nt == 1));
        if (down)
            st = TQKV_OK;
        if (first == TQKV_OK && st != TQKV_OK) {
            first = st;
            *saved = last_err;
        }
    }
    return first;
}

tqkv_status_t
tqkv_client_put_end(tqkv_put_t *p, tqkv_put_result_t *res)
{
    if (res)
        memset(res, 0, sizeof *res);
    if (p == NULL)
        return set_err(TQKV_EINVAL, 0, "put_end: session is NULL");
    tqkv_status_t first = p->err;
    tqkv_client_error_t saved = last_err;
    tqkv_status_t st = put_collect(p, &saved);
    if (first == TQKV_OK)
        first = st;
    /* Blocks of streams that died (several targets): up to two more rounds on the next
     * live targets in their ranking that do not hold them yet. */
    for (int round = 0; round < 2 && p->resend.n > 0 && first == TQKV_OK; round++) {
        keptvec_t todo = p->resend;
        memset(&p->resend, 0, sizeof p->resend);
        for (size_t i = 0; i < todo.n; i++) {
            kept_t *k = &todo.v[i];
            tqkv_status_t s2;
            if (put_route(p, k->bb, k->rank, k->nrank, 1, &k->holders, &s2) == 0)
                p->res.blocks_lost++;
        }
        kept_clear(&todo);
        st = put_collect(p, &saved);
        if (first == TQKV_OK)
            first = st;
    }
    p->res.blocks_lost += p->resend.n;
    if (res)
        *res = p->res;
    put_free(p);
    last_err = saved;
    return first;
}

void
tqkv_client_put_abort(tqkv_put_t *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < p->c->nt; i++)
        if (p->rpc[i])
            grpc_call_cancel(p->rpc[i]->call, NULL);
    for (;;) {
        int busy = 0;
        for (size_t i = 0; i < p->c->nt; i++)
            busy |= p->rpc[i] && p->rpc[i]->inflight > 0;
        if (!busy)
            break;
        put_step(p);
    }
    put_free(p);
}

/* ---- Lookup ---- */

tqkv_status_t
tqkv_client_lookup(tqkv_client_t *c, const tqkv_lookup_req_t *q, uint32_t *prefix_blocks,
                   uint8_t *tiers)
{
    if (prefix_blocks)
        *prefix_blocks = 0;
    if (c == NULL || q == NULL || prefix_blocks == NULL)
        return set_err(TQKV_EINVAL, 0, "lookup: client, request and prefix_blocks required");
    size_t n = q->num_hashes, nc = read_candidates(c);
    tqkv_status_t st = TQKV_OK;
    if (q->ns == NULL)
        return set_err(TQKV_EINVAL, 0, "lookup: namespace required");
    if (n > 0 && q->hashes == NULL)
        return set_err(TQKV_EINVAL, 0, "lookup: hashes is NULL with num_hashes %zu", n);
    for (size_t i = 0; i < n; i++)
        if (!hash_ok(&q->hashes[i]))
            return set_err(TQKV_EINVAL, 0, "lookup: hash %zu is not 8..64 bytes", i);
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
    uint32_t server_prefix = 0;
    int single_ok = 0;
    if (!present || !tier || !cand || !hb || !gidx || !tis || !reqs || !rq || !rs || !sts ||
        !start) {
        st = set_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t all[64];
        candidates(c, q->ns, &q->hashes[i], all);
        memcpy(&cand[i * nc], all, nc * sizeof *cand);
    }
    for (size_t round = 0; round < nc; round++) {
        uint64_t now = tqkv_shard_now_ns();
        /* Group the unresolved hashes by this round's candidate (counting sort). */
        memset(start, 0, (c->nt + 1) * sizeof *start);
        for (size_t i = 0; i < n; i++)
            if (!present[i] && usable(c, cand[i * nc + round], now))
                start[cand[i * nc + round] + 1]++;
        for (size_t t = 0; t < c->nt; t++)
            start[t + 1] += start[t];
        size_t fill[64];
        memcpy(fill, start, (c->nt < 64 ? c->nt : 64) * sizeof *fill);
        for (size_t i = 0; i < n; i++) {
            if (!present[i] && usable(c, cand[i * nc + round], now)) {
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
        unary_fanout(c, ncall, tis, M_LOOKUP, rq, &tqkv__v1__lookup_response__descriptor,
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
    return st;
}

/* ---- Get ---- */

/* In-place reader of a GetResponse (fields of kvcache.proto). Returns 0, or -1 for
 * bytes that are not a valid message. Pointers borrow p. */
static int
rd_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    uint64_t x = 0;
    for (int s = 0; s < 64; s += 7) {
        if (*p >= end)
            return -1;
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << s;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

int
tqkv__client_parse_get(const uint8_t *p, size_t n, tqkv__get_msg_t *m)
{
    const uint8_t *end = p + n;
    memset(m, 0, sizeof *m);
    while (p < end) {
        uint64_t key, v;
        if (rd_varint(&p, end, &key) != 0)
            return -1;
        if ((key >> 3) == 0 || (key >> 3) > 0x1fffffffu)
            return -1; /* field numbers are 1 .. 2^29-1 */
        uint32_t field = (uint32_t)(key >> 3), wt = (uint32_t)(key & 7);
        switch (wt) {
        case 0:
            if (rd_varint(&p, end, &v) != 0)
                return -1;
            switch (field) {
            case 2:
                m->layer = (uint32_t)v;
                break;
            case 3:
                m->found = v != 0;
                break;
            case 7:
                m->num_tokens = (uint32_t)v;
                break;
            case 8:
                m->num_kv_heads = (uint32_t)v;
                break;
            case 9:
                m->head_dim = (uint32_t)v;
                break;
            case 10:
                m->tier = (int)v;
                break;
            default:
                break;
            }
            break;
        case 2:
            if (rd_varint(&p, end, &v) != 0 || v > (uint64_t)(end - p))
                return -1;
            switch (field) {
            case 1:
                m->hash = p, m->hash_len = (size_t)v;
                break;
            case 4:
                m->page = p, m->page_len = (size_t)v;
                break;
            case 5:
                m->key = p, m->key_len = (size_t)v;
                break;
            case 6:
                m->value = p, m->value_len = (size_t)v;
                break;
            default:
                break;
            }
            p += v;
            break;
        case 1:
            if (end - p < 8)
                return -1;
            p += 8;
            break;
        case 5:
            if (end - p < 4)
                return -1;
            p += 4;
            break;
        default:
            return -1;
        }
    }
    return 0;
}

typedef struct scratch {
    uint8_t *mem; /* malloc'ed; base = mem rounded up to 64 */
    size_t cap;   /* usable bytes from base */
} scratch_t;

static uint8_t *
scratch_get(scratch_t *s, size_t n)
{
    if (n + 64 > s->cap) {
        size_t nc = s->cap ? s->cap : 1 << 16;
        while (nc < n + 64)
            nc *= 2;
        free(s->mem);
        s->mem = malloc(nc + 64);
        s->cap = s->mem ? nc : 0;
        if (s->mem == NULL)
            return NULL;
    }
    return (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
}

typedef struct getop {
    tqkv_client_t *c;
    const tqkv_get_req_t *q;
    tqkv_get_cb_t cb;
    void *arg;
    size_t n, L, nc, round;
    uint8_t *done;    /* n * L: reported */
    uint8_t *corrupt; /* n * L: 1 + the target whose copy failed its CRC (0: none); a later
                         miss is then no miss */
    int canceled;
    scratch_t sc, sv;
    size_t shift;    /* offset from the scratch base that aligned the last page */
    size_t bad_hash; /* the page that failed its CRC (get_message returned 1), and where */
    size_t bad_target;
    uint32_t bad_layer;
} getop_t;

static int
deliver(getop_t *g, const tqkv_get_page_t *pg)
{
    if (g->canceled)
        return 1;
    if (g->cb(g->arg, pg) != 0)
        g->canceled = 1;
    return g->canceled;
}

/* Offset and length of the first page field (4) of a GetResponse whose first avail
 * bytes are at p, when the fields before it and its length prefix lie within them.
 * Returns 0, or -1 (no page field found there: the caller copies and parses as usual). */
static int
page_field_at(const uint8_t *p, size_t avail, size_t *off, size_t *plen)
{
    const uint8_t *q = p, *end = p + avail;
    while (q < end) {
        uint64_t key, v;
        if (rd_varint(&q, end, &key) != 0)
            return -1;
        switch (key & 7) {
        case 0:
            if (rd_varint(&q, end, &v) != 0)
                return -1;
            break;
        case 2:
            if (rd_varint(&q, end, &v) != 0)
                return -1;
            if ((key >> 3) == 4) {
                *off = (size_t)(q - p);
                *plen = (size_t)v;
                return 0;
            }
            if (v > (uint64_t)(end - q))
                return -1;
            q += v;
            break;
        case 1:
            q += 8;
            break;
        case 5:
            q += 4;
            break;
        default:
            return -1;
        }
    }
    return -1;
}

/* Copies bytes [a, a + n) of a page from src to dst, continuing *crc over them with
 * the header's CRC field (bytes 12..15) read as zero. */
static void
page_crc_copy(uint32_t *crc, uint8_t *dst, const uint8_t *src, size_t a, size_t n)
{
    static const uint8_t zero[4];
    size_t b = a + n;
    if (a < 12) {
        size_t e = b < 12 ? b : 12;
        *crc = tqkv_crc32c_copy(*crc, dst, src, e - a);
        dst += e - a, src += e - a, a = e;
    }
    if (a < b && a < 16) {
        size_t e = b < 16 ? b : 16;
        memcpy(dst, src, e - a);
        *crc = tqkv_crc32c(*crc, zero, e - a);
        dst += e - a, src += e - a, a = e;
    }
    if (a < b)
        *crc = tqkv_crc32c_copy(*crc, dst, src, b - a);
}

static int get_deliver(getop_t *g, rpc_t *r, size_t gi, const tqkv__get_msg_t *mp, int crc_checked,
                       size_t wire_len, int via_dc);

/* One received message of rpc r. Returns -1 for a malformed message, 1 for a packed
 * page that fails its CRC32C. The slices are copied into the scratch buffer (the page
 * 64-byte aligned) and, for a packed page, the CRC is computed in the same pass. */
static int
get_message(getop_t *g, rpc_t *r)
{
    size_t len = grpc_byte_buffer_length(r->recv_bb);
    uint8_t *base = scratch_get(&g->sc, len);
    if (base == NULL)
        return -1;
    grpc_byte_buffer_reader rd;
    grpc_slice s;
    if (!grpc_byte_buffer_reader_init(&rd, r->recv_bb))
        return -1;
    size_t off = 0, ps = 0, pl = 0;
    int fused = 0; /* the page range [ps, ps + pl) is known before copying */
    uint32_t crc = 0;
    uint8_t *dst = base + g->shift;
    while (grpc_byte_buffer_reader_next(&rd, &s)) {
        size_t sl = GRPC_SLICE_LENGTH(s);
        const uint8_t *sp = GRPC_SLICE_START_PTR(s);
        if (off == 0 && page_field_at(sp, sl, &ps, &pl) == 0 && pl >= TQKV_PAGE_HEADER_BYTES &&
            ps + pl <= len) {
            fused = 1;
            g->shift = (64 - (ps & 63)) & 63;
            dst = base + g->shift;
        }
        if (off + sl <= len) {
            if (fused && off < ps + pl && off + sl > ps) {
                size_t a = off > ps ? off : ps, b = off + sl < ps + pl ? off + sl : ps + pl;
                memcpy(dst + off, sp, a - off);
                page_crc_copy(&crc, dst + a, sp + (a - off), a - ps, b - a);
                memcpy(dst + b, sp + (b - off), off + sl - b);
            } else {
                memcpy(dst + off, sp, sl);
            }
        }
        off += sl;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    if (off != len)
        return -1;
    tqkv__get_msg_t m;
    if (tqkv__client_parse_get(dst, len, &m) != 0)
        return -1;
    const uint8_t *al = m.page ? m.page : m.key;
    if (al && ((uintptr_t)al & 63)) {
        size_t ns = (g->shift + 64 - ((uintptr_t)al & 63)) & 63;
        memmove(base + ns, dst, len);
        dst = base + ns;
        g->shift = ns;
        if (tqkv__client_parse_get(dst, len, &m) != 0)
            return -1;
    }
    int crc_checked = 0;
    if (m.page && m.found) {
        tqkv_page_header_t h;
        /* The server sends whole pages: one shorter than a header, or whose header gives
         * another length, was damaged (in the length field itself, say) and fails too. */
        crc_checked = -1;
        if (m.page_len >= TQKV_PAGE_HEADER_BYTES) {
            memcpy(&h, m.page, sizeof h);
            if (h.page_bytes == m.page_len) {
                /* a page field other than the one copied with its CRC (a repeated field:
                 * the last one wins) is checked on its own */
                if (!fused || m.page != dst + ps)
                    crc = tqkv_page_crc(m.page, m.page_len);
                crc_checked = crc == h.crc32c ? 1 : -1;
            }
        }
    }
    if (m.value && ((uintptr_t)m.value & 1)) {
        uint8_t *v = scratch_get(&g->sv, m.value_len);
        if (v == NULL)
            return -1;
        memcpy(v, m.value, m.value_len);
        m.value = v;
    }
    /* Which of the hashes sent: the server answers layer-major in request order. */
    size_t j = r->pos % r->count, gi = SIZE_MAX;
    r->pos++;
    for (size_t k = 0; k < r->count; k++) {
        size_t jj = (j + k) % r->count;
        const tqkv_hash_t *h = &g->q->hashes[r->gidx[jj]];
        if (h->len == m.hash_len && memcmp(h->bytes, m.hash, m.hash_len) == 0) {
            gi = r->gidx[jj];
            break;
        }
    }
    return get_deliver(g, r, gi, &m, crc_checked, len, 0);
}

/* The rest of one page's handling, shared by gRPC messages and data channel frames:
 * hash index gi (SIZE_MAX: not one asked for), bad CRC -> next replica or error,
 * a miss -> next candidate, else the callback. Same returns as get_message. */
static int
get_deliver(getop_t *g, rpc_t *r, size_t gi, const tqkv__get_msg_t *mp, int crc_checked,
            size_t wire_len, int via_dc)
{
    tqkv__get_msg_t m = *mp;
    int bad_crc = crc_checked < 0;
    if (gi == SIZE_MAX || m.layer < g->q->layer_begin || m.layer >= g->q->layer_end)
        return -1;
    size_t slot = gi * g->L + (m.layer - g->q->layer_begin);
    if (g->done[slot])
        return 0;
    if (bad_crc) {
        /* never handed out: another replica may hold a good copy */
        g->corrupt[slot] = (uint8_t)(r->target + 1);
        if (g->round + 1 < g->nc)
            return 0;
        g->bad_hash = gi, g->bad_layer = m.layer, g->bad_target = r->target;
        return 1;
    }
    if (!m.found && g->round + 1 < g->nc)
        return 0; /* ask the next candidate */
    if (!m.found && g->corrupt[slot]) {
        /* the only copies found were corrupt: an error, not a miss to recompute */
        g->bad_hash = gi, g->bad_layer = m.layer, g->bad_target = g->corrupt[slot] - 1u;
        return 1;
    }
    g->done[slot] = 1;
    tqkv_get_page_t pg;
    memset(&pg, 0, sizeof pg);
    pg.hash_index = gi;
    pg.layer = m.layer;
    pg.found = m.found;
    pg.tier = m.tier;
    pg.shape.num_tokens = m.num_tokens;
    pg.shape.num_kv_heads = m.num_kv_heads;
    pg.shape.head_dim = m.head_dim;
    pg.page = m.page;
    pg.page_len = m.page_len;
    pg.key = m.key;
    pg.key_len = m.key_len;
    pg.value = m.value;
    pg.value_len = m.value_len;
    pg.wire_bytes = wire_len;
    pg.target = (int)r->target;
    pg.crc_checked = crc_checked;
    pg.data_channel = via_dc;
    deliver(g, &pg);
    return 0;
}

/* One frame of r's TCP data channel (transport/data_frame.h), read into the scratch
 * buffer (the page 64-byte aligned) and CRC-checked while cache-hot. Returns as
 * get_message; -1 also for a read that fails or passes deadline_ns (why says which):
 * the channel is then out of step; -2 when the server closed the connection (a failed
 * Get: its status, on the way, names the reason); -3 when deadline_ns passed. */
static int
get_frame(getop_t *g, rpc_t *r, uint64_t deadline_ns, char *why, size_t whylen)
{
    uint8_t hb[TQKV_DC_FRAME_BYTES];
    tqkv_dc_frame_t f;
    if (tqkv__dcc_read(r->dc->fd, hb, sizeof hb, deadline_ns) != 0) {
        int e = errno;
        snprintf(why, whylen, "reading frame %zu: %s", r->next_frame,
                 e ? strerror(e) : "connection closed by the server");
        return e == 0 || e == ECONNRESET ? -2 : e == ETIMEDOUT ? -3 : -1;
    }
    if (tqkv_dc_frame_decode(hb, &f) != 0) {
        snprintf(why, whylen, "frame %zu: not a frame header", r->next_frame);
        return -1;
    }
    int found = (f.flags & TQKV_DC_FLAG_FOUND) != 0;
    if (f.index != r->next_frame || f.layer != g->q->layer_begin + f.index / r->count ||
        (f.flags & ~TQKV_DC_FLAG_FOUND) != 0) {
        snprintf(why, whylen,
                 "frame %u (layer %u, flags %#x) where frame %zu (layer %zu, flags 0 or 0x1) "
                 "was due",
                 f.index, f.layer, f.flags, r->next_frame,
                 (size_t)g->q->layer_begin + r->next_frame / r->count);
        return -1;
    }
    if (found ? f.page_len < TQKV_PAGE_HEADER_BYTES || f.page_len > g->c->max_msg
              : f.page_len != 0) {
        if (found)
            snprintf(why, whylen,
                     "frame %u: page of %u bytes (a found page is %u, its header, to %zu, the "
                     "client's max_message_bytes)",
                     f.index, f.page_len, (unsigned)TQKV_PAGE_HEADER_BYTES, g->c->max_msg);
        else
            snprintf(why, whylen, "frame %u: page of %u bytes for a missing block", f.index,
                     f.page_len);
        return -1;
    }
    uint8_t *page = NULL;
    if (found) {
        page = scratch_get(&g->sc, f.page_len);
        if (page == NULL) {
            snprintf(why, whylen, "out of memory");
            return -1;
        }
        if (tqkv__dcc_read(r->dc->fd, page, f.page_len, deadline_ns) != 0) {
            int e = errno;
            snprintf(why, whylen, "reading page %u: %s", f.index,
                     e ? strerror(e) : "connection closed by the server");
            return e == 0 || e == ECONNRESET ? -2 : e == ETIMEDOUT ? -3 : -1;
        }
    }
    r->next_frame++;
    r->frames_left--;
    tqkv__get_msg_t m;
    memset(&m, 0, sizeof m);
    m.layer = f.layer;
    m.found = found;
    m.tier = (int)f.tier;
    int crc_checked = 0;
    if (found) {
        tqkv_page_header_t h;
        memcpy(&h, page, sizeof h);
        m.page = page;
        m.page_len = f.page_len;
        m.num_tokens = h.num_tokens;
        m.num_kv_heads = h.num_kv_heads;
        m.head_dim = h.head_dim;
        crc_checked =
            h.page_bytes == f.page_len && tqkv_page_crc(page, f.page_len) == h.crc32c ? 1 : -1;
    }
    return get_deliver(g, r, r->gidx[f.index % r->count], &m, crc_checked,
                       TQKV_DC_FRAME_BYTES + (size_t)f.page_len, 1);
}

/* Cancels every call of a Get round (the callback asked to stop); data channels with
 * frames due are then out of step. */
static void
get_cancel_all(tqkv_client_t *c, rpc_t *rs, const int *started)
{
    for (size_t t = 0; t < c->nt; t++) {
        if (!started[t])
            continue;
        if (rs[t].call && rs[t].inflight > 0)
            grpc_call_cancel(rs[t].call, NULL);
        if (rs[t].dc && rs[t].frames_left > 0)
            rs[t].dc_bad = 1, rs[t].frames_left = 0;
    }
}

/* One completion of a Get round's calls (already booked by rpc_event). */
static void
get_event(tqkv_client_t *c, getop_t *g, rpc_t *rs, const int *started, rpc_t *r, tag_kind_t k,
          tqkv_status_t *st)
{
    if (k == TAG_RECV && r->recv_bb) {
        int bad = r->dc ? -1 : get_message(g, r); /* nothing comes on a data channel's stream */
        grpc_byte_buffer_destroy(r->recv_bb);
        r->recv_bb = NULL;
        if (bad) {
            if (*st == TQKV_OK && bad > 0)
                *st = set_err(TQKV_ECORRUPT, 0,
                              "%s: page of hash %zu layer %u failed its CRC32C check "
                              "(not delivered; no replica left with a good copy)",
                              c->t[g->bad_target].name, g->bad_hash, g->bad_layer);
            else if (*st == TQKV_OK)
                *st = set_err(TQKV_EINTERNAL, 0, "%s: malformed GetResponse", c->t[r->target].name);
            grpc_call_cancel(r->call, NULL);
            if (r->dc)
                r->dc_bad = 1, r->frames_left = 0;
        } else if (g->canceled) {
            get_cancel_all(c, rs, started);
        } else if (!r->recv_eof) {
            rpc_recv(r);
        }
    }
    /* A data channel Get that failed sends no more frames (the server closed it). */
    if (r->dc && r->status_done && r->status != GRPC_STATUS_OK && r->frames_left > 0)
        r->dc_bad = 1, r->frames_left = 0;
}

/* ---- TCP data channels (TQKV_CLIENT_TRANSPORT_TCP) ---- */

#define M_OPEN_CHANNEL "/tqkv.v1.KVCache/OpenChannel"
#define M_CLOSE_CHANNEL "/tqkv.v1.KVCache/CloseChannel"
#define DC_RETRY_NS (30ull * 1000000000ull) /* a target without channels is asked again after */
#define DC_CONNECT_MS 5000u

static void dc_disable(target_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
dc_disable(target_t *t, const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&t->dc_mu);
    t->dc_off = 1;
    va_start(ap, fmt);
    vsnprintf(t->dc_why, sizeof t->dc_why, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&t->dc_mu);
    atomic_store(&t->dc_retry_ns, tqkv_shard_now_ns() + DC_RETRY_NS);
}

/* An idle channel the server has not closed (a restarted server closed the old ones). */
static dconn_t *
dc_pop_live(target_t *t)
{
    for (;;) {
        pthread_mutex_lock(&t->dc_mu);
        dconn_t *d = t->dc_idle;
        if (d)
            t->dc_idle = d->next;
        pthread_mutex_unlock(&t->dc_mu);
        if (d == NULL)
            return NULL;
        struct pollfd pf = {d->fd, POLLIN, 0}; /* EOF reads as POLLIN */
        if (poll(&pf, 1, 0) == 0)
            return d;
        close(d->fd); /* EOF, or bytes nobody asked for */
        free(d);
    }
}

/* A data channel for one Get to target ti, or NULL: ask over gRPC. A new one costs an
 * OpenChannel call and a connect, together within about setup_ms (> 0); channels are
 * kept for later Gets. */
static dconn_t *
dc_acquire(tqkv_client_t *c, size_t ti, uint32_t setup_ms)
{
    target_t *t = &c->t[ti];
    if (t->dc_off) {
        if (tqkv_shard_now_ns() < atomic_load(&t->dc_retry_ns))
            return NULL;
        pthread_mutex_lock(&t->dc_mu);
        t->dc_off = 0;
        pthread_mutex_unlock(&t->dc_mu);
    }
    dconn_t *d = dc_pop_live(t);
    if (d)
        return d;
    char host[256], err[320];
    if (tqkv__dcc_target_host(t->name, host, sizeof host) != 0) {
        dc_disable(t, "target %s has no TCP host", t->name);
        return NULL;
    }
    tqkv_client_error_t saved = last_err;
    Tqkv__V1__OpenChannelRequest m;
    tqkv__v1__open_channel_request__init(&m);
    m.transport = TQKV__V1__TRANSPORT__TRANSPORT_TCP;
    ProtobufCMessage *rq = &m.base, *rs = NULL;
    tqkv_status_t st;
    uint64_t t0 = tqkv_shard_now_ns();
    unary_fanout(c, 1, &ti, M_OPEN_CHANNEL, &rq, &tqkv__v1__open_channel_response__descriptor,
                 setup_ms, &rs, &st);
    if (st != TQKV_OK) {
        dc_disable(t, "OpenChannel: %s", last_err.message);
        last_err = saved;
        return NULL;
    }
    Tqkv__V1__OpenChannelResponse *r = (Tqkv__V1__OpenChannelResponse *)rs;
    int fd = -1;
    if (r->data_port == 0 || r->data_port > 65535 || r->channel_secret.len != TQKV_DC_SECRET_BYTES)
        snprintf(err, sizeof err, "OpenChannel: malformed answer (port %u, secret of %zu bytes)",
                 r->data_port, r->channel_secret.len);
    else {
        uint64_t spent_ms = (tqkv_shard_now_ns() - t0) / 1000000u;
        uint32_t left = spent_ms < setup_ms ? setup_ms - (uint32_t)spent_ms : 1;
        fd = tqkv__dcc_connect(host, r->data_port, r->channel_id, r->channel_secret.data,
                               left < DC_CONNECT_MS ? left : DC_CONNECT_MS, err, sizeof err);
    }
    uint64_t id = r->channel_id;
    protobuf_c_message_free_unpacked(rs, NULL);
    last_err = saved;
    if (fd < 0) {
        dc_disable(t, "%s", err);
        return NULL;
    }
    d = calloc(1, sizeof *d);
    if (d == NULL) {
        close(fd);
        return NULL;
    }
    d->fd = fd;
    d->id = id;
    return d;
}

/* Back to the pool when the Get ended in step with the server, else closed (the
 * server then drops the channel). */
static void
dc_release(tqkv_client_t *c, size_t ti, dconn_t *d, int reuse)
{
    if (d == NULL)
        return;
    if (!reuse) {
        close(d->fd);
        free(d);
        return;
    }
    target_t *t = &c->t[ti];
    pthread_mutex_lock(&t->dc_mu);
    d->next = t->dc_idle;
    t->dc_idle = d;
    pthread_mutex_unlock(&t->dc_mu);
}

const char *
tqkv_client_data_channel_status(tqkv_client_t *c, size_t target)
{
    static _Thread_local char buf[256];
    if (c == NULL || target >= c->nt)
        return "no such target";
    if (c->transport != TQKV_CLIENT_TRANSPORT_TCP)
        return "the client uses gRPC (transport TQKV_CLIENT_TRANSPORT_GRPC)";
    target_t *t = &c->t[target];
    pthread_mutex_lock(&t->dc_mu);
    snprintf(buf, sizeof buf, "%s", t->dc_off ? t->dc_why : "");
    pthread_mutex_unlock(&t->dc_mu);
    return buf;
}

tqkv_status_t
tqkv_client_get(tqkv_client_t *c, const tqkv_get_req_t *q, tqkv_get_cb_t cb, void *arg)
{
    getop_t g;
    tqkv_status_t st = TQKV_OK;
    memset(&g, 0, sizeof g);
    if (c == NULL || q == NULL)
        return set_err(TQKV_EINVAL, 0, "get: client and request required");
    if (q->ns == NULL || cb == NULL || q->layer_end <= q->layer_begin)
        return set_err(TQKV_EINVAL, 0, "get: namespace, callback and layer_end > layer_begin");
    if (q->num_hashes > 0 && q->hashes == NULL)
        return set_err(TQKV_EINVAL, 0, "get: hashes is NULL with num_hashes %zu", q->num_hashes);
    for (size_t i = 0; i < q->num_hashes; i++)
        if (!hash_ok(&q->hashes[i]))
            return set_err(TQKV_EINVAL, 0, "get: hash %zu is not 8..64 bytes", i);
    if (q->num_hashes == 0)
        return TQKV_OK;
    g.c = c;
    g.q = q;
    g.cb = cb;
    g.arg = arg;
    g.n = q->num_hashes;
    g.L = q->layer_end - q->layer_begin;
    g.nc = read_candidates(c);
    size_t n = g.n, nc = g.nc;

    uint32_t *cand = malloc(n * nc * sizeof *cand);
    ProtobufCBinaryData *hb = malloc(n * sizeof *hb);
    size_t *gidx = malloc(n * sizeof *gidx);
    size_t *start = malloc((c->nt + 1) * sizeof *start);
    rpc_t *rs = calloc(c->nt, sizeof *rs);
    g.done = calloc(n * g.L, 1);
    g.corrupt = calloc(n * g.L, 1);
    uint32_t op_ms = q->deadline_ms ? q->deadline_ms : c->deadline_ms;
    gpr_timespec dl = deadline_after(op_ms);
    uint64_t dl_ns = tqkv_shard_now_ns() + (uint64_t)op_ms * 1000000ull; /* the same instant */
    if (!cand || !hb || !gidx || !start || !rs || !g.done || !g.corrupt) {
        st = set_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t all[64];
        candidates(c, q->ns, &q->hashes[i], all);
        memcpy(&cand[i * nc], all, nc * sizeof *cand);
    }
    for (g.round = 0; g.round < nc && st == TQKV_OK && !g.canceled; g.round++) {
        size_t round = g.round;
        uint64_t now = tqkv_shard_now_ns();
        /* A hash is asked again while any of its layers is unreported. */
        memset(start, 0, (c->nt + 1) * sizeof *start);
        for (size_t i = 0; i < n; i++) {
            int need = 0;
            for (size_t l = 0; l < g.L && !need; l++)
                need = !g.done[i * g.L + l];
            if (need && usable(c, cand[i * nc + round], now))
                start[cand[i * nc + round] + 1]++;
        }
        for (size_t t = 0; t < c->nt; t++)
            start[t + 1] += start[t];
        size_t fill[64];
        memcpy(fill, start, (c->nt < 64 ? c->nt : 64) * sizeof *fill);
        for (size_t i = 0; i < n; i++) {
            int need = 0;
            for (size_t l = 0; l < g.L && !need; l++)
                need = !g.done[i * g.L + l];
            if (need && usable(c, cand[i * nc + round], now)) {
                size_t t = cand[i * nc + round];
                gidx[fill[t]] = i;
                hb[fill[t]].data = (uint8_t *)q->hashes[i].bytes;
                hb[fill[t]].len = q->hashes[i].len;
                fill[t]++;
            }
        }
        grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
        size_t live = 0;
        memset(rs, 0, c->nt * sizeof *rs);
        int started[64] = {0};
        for (size_t t = 0; t < c->nt; t++) {
            if (start[t + 1] == start[t])
                continue;
            Tqkv__V1__GetRequest m;
            tqkv__v1__get_request__init(&m);
            m.namespace_ = (char *)q->ns;
            m.hashes = &hb[start[t]];
            m.n_hashes = start[t + 1] - start[t];
            m.layer_begin = q->layer_begin;
            m.layer_end = q->layer_end;
            m.encoding = q->encoding == TQKV_CLIENT_BF16 ? TQKV__V1__ENCODING__ENCODING_BF16
                                                         : TQKV__V1__ENCODING__ENCODING_PACKED;
            rpc_t *r = &rs[t];
            r->gidx = &gidx[start[t]];
            r->count = m.n_hashes;
            /* Setting a channel up may take half the time left: a server that never
             * answers leaves the other half to the gRPC fallback. */
            uint64_t now_ns = tqkv_shard_now_ns();
            uint32_t setup_ms = now_ns < dl_ns ? (uint32_t)((dl_ns - now_ns) / 2000000u) : 0;
            if (c->transport == TQKV_CLIENT_TRANSPORT_TCP && q->encoding != TQKV_CLIENT_BF16 &&
                setup_ms > 0 && (r->dc = dc_acquire(c, t, setup_ms)) != NULL) {
                m.transport = TQKV__V1__TRANSPORT__TRANSPORT_TCP;
                m.channel_id = r->dc->id;
                r->frames_left = m.n_hashes * g.L;
            }
            grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
            tqkv_status_t s2 = rpc_start(c, r, cq, t, M_GET, dl, bb);
            if (r->call == NULL)
                grpc_byte_buffer_destroy(bb), r->init_bb = NULL;
            started[t] = 1;
            if (s2 == TQKV_OK)
                rpc_recv(r); /* a data channel Get's stream ends without messages */
            else if (s2 != TQKV_OK && st == TQKV_OK)
                st = s2;
            if (s2 != TQKV_OK)
                r->frames_left = 0, r->dc_bad = 1;
            live += r->inflight > 0;
        }
        for (;;) {
            /* Data channels with frames due are read as they become readable; between
             * reads the completion queue is polled without waiting (statuses). */
            struct pollfd pf[64];
            size_t who[64], nfd = 0;
            for (size_t t = 0; t < c->nt && t < 64; t++)
                if (started[t] && rs[t].dc && rs[t].frames_left > 0 && !rs[t].dc_bad) {
                    pf[nfd].fd = rs[t].dc->fd;
                    pf[nfd].events = POLLIN;
                    pf[nfd].revents = 0;
                    who[nfd++] = t;
                }
            if (nfd == 0) {
                if (live == 0)
                    break;
                tag_kind_t k;
                int ok;
                rpc_t *r = cq_step(cq, &k, &ok);
                if (r == NULL)
                    break;
                get_event(c, &g, rs, started, r, k, &st);
                if (r->inflight == 0)
                    live--;
                continue;
            }
            int pr = poll(pf, nfd, live > 0 ? 1 : 50);
            for (size_t i = 0; i < nfd && pr > 0; i++) {
                if (pf[i].revents == 0 || g.canceled)
                    continue;
                rpc_t *r = &rs[who[i]];
                char why[240];
                int bad = get_frame(&g, r, dl_ns, why, sizeof why);
                if (bad == -2 && !r->status_done) {
                    /* the server closed the channel: its status, still to come, says why
                     * (the gRPC deadline bounds the wait); OK would not explain it */
                    r->dc_bad = 1, r->frames_left = 0;
                    snprintf(r->dc_eof, sizeof r->dc_eof, "%s", why);
                } else if (bad != 0) {
                    r->dc_bad = 1;
                    r->frames_left = 0;
                    if (r->inflight > 0)
                        grpc_call_cancel(r->call, NULL);
                    if (st == TQKV_OK && bad > 0)
                        st = set_err(TQKV_ECORRUPT, 0,
                                     "%s: page of hash %zu layer %u failed its CRC32C check "
                                     "(not delivered; no replica left with a good copy)",
                                     c->t[g.bad_target].name, g.bad_hash, g.bad_layer);
                    else if (st == TQKV_OK && bad == -3)
                        st = set_err(TQKV_ETIMEDOUT, (int)GRPC_STATUS_DEADLINE_EXCEEDED,
                                     "%s: data channel: %s", c->t[r->target].name, why);
                    else if (st == TQKV_OK)
                        st = set_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                                     "%s: data channel: %s", c->t[r->target].name, why);
                } else if (g.canceled) {
                    get_cancel_all(c, rs, started);
                }
            }
            if (pr == 0 && live == 0 && tqkv_shard_now_ns() >= dl_ns) {
                for (size_t i = 0; i < nfd; i++)
                    rs[who[i]].dc_bad = 1, rs[who[i]].frames_left = 0;
                if (st == TQKV_OK)
                    st = set_err(TQKV_ETIMEDOUT, (int)GRPC_STATUS_DEADLINE_EXCEEDED,
                                 "%s: data channel: deadline passed with frames still due",
                                 c->t[rs[who[0]].target].name);
            }
            while (live > 0) {
                grpc_event ev =
                    grpc_completion_queue_next(cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
                if (ev.type != GRPC_OP_COMPLETE)
                    break;
                rtag_t *tg = ev.tag;
                rpc_event(tg->r, tg->k, ev.success);
                get_event(c, &g, rs, started, tg->r, tg->k, &st);
                if (tg->r->inflight == 0)
                    live--;
            }
        }
        for (size_t t = 0; t < c->nt; t++) {
            if (!started[t])
                continue;
            if (rs[t].call && !g.canceled) {
                /* rpc_result records the call's status in the thread's error (a call
                 * cancelled above for a bad page reads CANCELLED): the caller reads the
                 * error of the status returned, the first failure */
                tqkv_client_error_t first = last_err;
                tqkv_status_t s2 = rpc_result(c, &rs[t]);
                if (s2 != TQKV_OK && st == TQKV_OK && !(c->nt > 1 && s2 == TQKV_EUNAVAILABLE)) {
                    st = s2;
                    if (s2 == TQKV_ETIMEDOUT && rs[t].dc_eof[0]) {
                        /* no status came to say why the server closed the channel */
                        size_t ml = strlen(last_err.message);
                        snprintf(last_err.message + ml, sizeof last_err.message - ml,
                                 " (data channel closed first: %s)", rs[t].dc_eof);
                    }
                } else if (st != TQKV_OK) {
                    last_err = first;
                }
                if (s2 != TQKV_OK)
                    rs[t].dc_bad = 1;
                if (s2 == TQKV_OK && rs[t].dc_eof[0] && st == TQKV_OK)
                    st = set_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                                 "%s: data channel: %s", c->t[t].name, rs[t].dc_eof);
            }
            if (rs[t].dc && rs[t].frames_left > 0 && st == TQKV_OK && !g.canceled)
                st = set_err(TQKV_EINTERNAL, 0, "%s: data channel: %zu frames missing",
                             c->t[t].name, rs[t].frames_left);
            dc_release(c, t, rs[t].dc,
                       !rs[t].dc_bad && rs[t].frames_left == 0 && !g.canceled &&
                           rs[t].status_done && rs[t].status == GRPC_STATUS_OK);
            rs[t].dc = NULL;
            rpc_fini(&rs[t]);
        }
        cq_destroy(cq);
    }
    if (g.canceled) {
        st = set_err(TQKV_ECANCELED, (int)GRPC_STATUS_CANCELLED, "get: canceled by callback");
    } else if (st == TQKV_OK) {
        /* A page whose copies failed their CRC and whose later candidates were down. */
        for (size_t i = 0; i < n * g.L && st == TQKV_OK; i++)
            if (!g.done[i] && g.corrupt[i])
                st = set_err(TQKV_ECORRUPT, 0,
                             "%s: page of hash %zu layer %u failed its CRC32C check (not "
                             "delivered; no replica left with a good copy)",
                             c->t[g.corrupt[i] - 1u].name, i / g.L,
                             q->layer_begin + (uint32_t)(i % g.L));
    }
    if (st == TQKV_OK && !g.canceled) {
        /* What no candidate had, in layer-major order. */
        for (size_t l = 0; l < g.L && !g.canceled; l++) {
            for (size_t i = 0; i < n && !g.canceled; i++) {
                if (g.done[i * g.L + l])
                    continue;
                tqkv_get_page_t pg;
                memset(&pg, 0, sizeof pg);
                pg.hash_index = i;
                pg.layer = q->layer_begin + (uint32_t)l;
                pg.target = -1;
                g.done[i * g.L + l] = 1;
                deliver(&g, &pg);
            }
        }
        if (g.canceled)
            st = set_err(TQKV_ECANCELED, (int)GRPC_STATUS_CANCELLED, "get: canceled by callback");
    }
out:
    free(cand);
    free(hb);
    free(gidx);
    free(start);
    free(rs);
    free(g.done);
    free(g.corrupt);
    free(g.sc.mem);
    free(g.sv.mem);
    return st;
}

/* ---- Delete, Stats, Health ---- */

tqkv_status_t
tqkv_client_delete(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes, size_t n, int all,
                   uint64_t *pages_deleted, uint64_t *bytes_freed)
{
    tqkv_status_t st = TQKV_OK;
    uint64_t pd = 0, bf = 0;
    if (pages_deleted)
        *pages_deleted = 0;
    if (bytes_freed)
        *bytes_freed = 0;
    if (c == NULL || ns == NULL)
        return set_err(TQKV_EINVAL, 0, "delete: client and namespace required");
    if (n > 0 && hashes == NULL)
        return set_err(TQKV_EINVAL, 0, "delete: hashes is NULL with num_hashes %zu", n);
    for (size_t i = 0; i < n; i++)
        if (!hash_ok(&hashes[i]))
            return set_err(TQKV_EINVAL, 0, "delete: hash %zu is not 8..64 bytes", i);
    ProtobufCBinaryData *hb = malloc((n ? n : 1) * sizeof *hb);
    size_t *tis = malloc(c->nt * sizeof *tis);
    ProtobufCMessage **rq = malloc(c->nt * sizeof *rq);
    ProtobufCMessage **rs = malloc(c->nt * sizeof *rs);
    tqkv_status_t *sts = malloc(c->nt * sizeof *sts);
    Tqkv__V1__DeleteRequest m;
    if (!hb || !tis || !rq || !rs || !sts) {
        st = set_err(TQKV_ENOMEM, 0, "out of memory");
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
    size_t ncall = 0;
    uint64_t now = tqkv_shard_now_ns();
    for (size_t t = 0; t < c->nt; t++) {
        if (!usable(c, t, now))
            continue;
        tis[ncall] = t;
        rq[ncall++] = &m.base;
    }
    if (ncall == 0) {
        st = set_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE, "delete: no live target");
        goto out;
    }
    unary_fanout(c, ncall, tis, M_DELETE, rq, &tqkv__v1__delete_response__descriptor, 0, rs, sts);
    size_t oks = 0, notfound = 0;
    tqkv_client_error_t saved = last_err;
    for (size_t k = 0; k < ncall; k++) {
        if (sts[k] == TQKV_OK) {
            Tqkv__V1__DeleteResponse *r = (Tqkv__V1__DeleteResponse *)rs[k];
            pd += r->pages_deleted;
            bf += r->bytes_freed;
            protobuf_c_message_free_unpacked(rs[k], NULL);
            oks++;
        } else if (sts[k] == TQKV_ENOTFOUND) {
            notfound++;
            saved = last_err;
        } else if (!(c->nt > 1 && sts[k] == TQKV_EUNAVAILABLE) && st == TQKV_OK) {
            st = sts[k];
            saved = last_err;
        }
    }
    if (st == TQKV_OK && oks == 0)
        st = notfound ? TQKV_ENOTFOUND : TQKV_EUNAVAILABLE;
    last_err = saved;
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

tqkv_status_t
tqkv_client_stats(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out)
{
    tqkv_status_t st = TQKV_OK;
    if (c == NULL || out == NULL)
        return set_err(TQKV_EINVAL, 0, "stats: client and out required");
    memset(out, 0, sizeof *out);
    size_t *tis = malloc(c->nt * sizeof *tis);
    ProtobufCMessage **rq = malloc(c->nt * sizeof *rq);
    ProtobufCMessage **rs = malloc(c->nt * sizeof *rs);
    tqkv_status_t *sts = malloc(c->nt * sizeof *sts);
    Tqkv__V1__StatsRequest m;
    if (!tis || !rq || !rs || !sts) {
        st = set_err(TQKV_ENOMEM, 0, "out of memory");
        goto out;
    }
    tqkv__v1__stats_request__init(&m);
    m.namespace_ = (char *)(ns ? ns : "");
    size_t ncall = 0;
    uint64_t now = tqkv_shard_now_ns();
    for (size_t t = 0; t < c->nt; t++) {
        if (!usable(c, t, now))
            continue;
        tis[ncall] = t;
        rq[ncall++] = &m.base;
    }
    if (ncall == 0) {
        st = set_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE, "stats: no live target");
        goto out;
    }
    unary_fanout(c, ncall, tis, M_STATS, rq, &tqkv__v1__stats_response__descriptor, 0, rs, sts);
    size_t oks = 0;
    tqkv_client_error_t saved = last_err;
    for (size_t k = 0; k < ncall; k++) {
        if (sts[k] != TQKV_OK) {
            if (!(c->nt > 1 && sts[k] == TQKV_EUNAVAILABLE) && st == TQKV_OK) {
                st = sts[k];
                saved = last_err;
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
                if (j == 4)
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
    last_err = saved;
    out->compression_ratio =
        out->page_bytes ? (double)out->bf16_bytes / (double)out->page_bytes : 0.0;
out:
    free(tis);
    free(rq);
    free(rs);
    free(sts);
    return st;
}

tqkv_status_t
tqkv_client_health(tqkv_client_t *c, size_t target, const char *service, int *serving_status)
{
    Grpc__Health__V1__HealthCheckRequest m;
    ProtobufCMessage *rq, *rs;
    tqkv_status_t st;
    if (c == NULL || serving_status == NULL)
        return set_err(TQKV_EINVAL, 0, "health: client and serving_status required");
    *serving_status = 0;
    if (target >= c->nt)
        return set_err(TQKV_EINVAL, 0, "health: no target %zu", target);
    grpc__health__v1__health_check_request__init(&m);
    m.service = (char *)(service ? service : "");
    rq = &m.base;
    unary_fanout(c, 1, &target, M_HEALTH, &rq, &grpc__health__v1__health_check_response__descriptor,
                 0, &rs, &st);
    if (st == TQKV_OK) {
        *serving_status = (int)((Grpc__Health__V1__HealthCheckResponse *)rs)->status;
        protobuf_c_message_free_unpacked(rs, NULL);
    }
    return st;
}

tqkv_status_t
tqkv_client_decode_page(const void *page, size_t len, uint16_t *k, uint16_t *v,
                        tqkv_block_shape_t *shape)
{
    tqkv_page_info_t info;
    char err[160];
    tqkv_status_t st = tqkv_page_validate(page, len, 1, &info, err, sizeof err);
    if (st != TQKV_OK)
        return set_err(st, 0, "decode: %s", err);
    if (shape)
        *shape = info.shape;
    if (k == NULL && v == NULL)
        return TQKV_OK;
    st = tqkv_page_decode_bf16(page, info.page_bytes, k, v);
    if (st != TQKV_OK)
        return set_err(st, 0, "decode: %s", tqkv_strerror(st));
    return TQKV_OK;
}

/* ---- NCCL transport (issue 8) ---- */

#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif

struct tqkv_channel {
    size_t target;
    int nccl;    /* 0: fallback */
    uint64_t id; /* server channel id (nccl) */
    int device;
    void *comm; /* tqkv_nccl_comm_t * (nccl) */
    int broken; /* pages no longer in step with the server: unusable */
    char reason[320];
};

tqkv_status_t
tqkv__client_open_channel_rpc(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms,
                              uint64_t *id, uint8_t uid[128], size_t *uid_len)
{
    Tqkv__V1__OpenChannelRequest m;
    ProtobufCMessage *rq, *rs = NULL;
    tqkv_status_t st;
    if (target >= c->nt)
        return set_err(TQKV_EINVAL, 0, "open channel: no target %zu", target);
    tqkv__v1__open_channel_request__init(&m);
    m.device = device;
    m.timeout_ms = timeout_ms;
    rq = &m.base;
    unary_fanout(c, 1, &target, M_OPEN_CHANNEL, &rq, &tqkv__v1__open_channel_response__descriptor,
                 0, &rs, &st);
    if (st != TQKV_OK)
        return st;
    Tqkv__V1__OpenChannelResponse *r = (Tqkv__V1__OpenChannelResponse *)rs;
    if (r->nccl_unique_id.len != 128 || r->rank != 1) {
        protobuf_c_message_free_unpacked(rs, NULL);
        return set_err(TQKV_EINTERNAL, 0,
                       "open channel: malformed response (uid %zu bytes, rank %d)",
                       r->nccl_unique_id.len, (int)r->rank);
    }
    *id = r->channel_id;
    memcpy(uid, r->nccl_unique_id.data, 128);
    *uid_len = 128;
    protobuf_c_message_free_unpacked(rs, NULL);
    return TQKV_OK;
}

#ifdef TQKV_HAVE_NCCL
static void
close_channel_rpc(tqkv_client_t *c, const tqkv_channel_t *ch)
{
    Tqkv__V1__CloseChannelRequest m;
    ProtobufCMessage *rq, *rs = NULL;
    tqkv_status_t st;
    size_t target = ch->target;
    tqkv__v1__close_channel_request__init(&m);
    m.channel_id = ch->id;
    rq = &m.base;
    unary_fanout(c, 1, &target, M_CLOSE_CHANNEL, &rq, &tqkv__v1__close_channel_response__descriptor,
                 0, &rs, &st);
    if (rs)
        protobuf_c_message_free_unpacked(rs, NULL);
}
#endif

tqkv_status_t
tqkv_client_open_channel(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms,
                         tqkv_channel_t **out)
{
    if (out == NULL)
        return set_err(TQKV_EINVAL, 0, "open channel: out is NULL");
    *out = NULL;
    if (c == NULL || target >= c->nt)
        return set_err(TQKV_EINVAL, 0, "open channel: no target %zu", target);
    tqkv_channel_t *ch = calloc(1, sizeof *ch);
    if (ch == NULL)
        return set_err(TQKV_ENOMEM, 0, "out of memory");
    ch->target = target;
    ch->device = device;
#ifdef TQKV_HAVE_NCCL
    int ndev = tqkv_nccl_device_count();
    if (device < 0 || device >= ndev) {
        snprintf(ch->reason, sizeof ch->reason, "no CUDA device %d on the client (%d visible)",
                 device, ndev);
        *out = ch;
        return TQKV_OK;
    }
    uint8_t uid[128];
    size_t uid_len = 0;
    tqkv_status_t st =
        tqkv__client_open_channel_rpc(c, target, device, timeout_ms, &ch->id, uid, &uid_len);
    if (st != TQKV_OK) {
        const tqkv_client_error_t *e = tqkv_client_last_error();
        if (e->grpc_code != GRPC_STATUS_FAILED_PRECONDITION &&
            e->grpc_code != GRPC_STATUS_UNIMPLEMENTED) {
            free(ch);
            return st;
        }
        snprintf(ch->reason, sizeof ch->reason, "server: %s", e->message);
        *out = ch;
        return TQKV_OK;
    }
    char err[256];
    tqkv_nccl_comm_t *m = NULL;
    st = tqkv_nccl_comm_join(uid, 1, device, timeout_ms, &m, err, sizeof err);
    if (st != TQKV_OK) {
        close_channel_rpc(c, ch);
        ch->id = 0;
        snprintf(ch->reason, sizeof ch->reason, "NCCL communicator: %s", err);
        *out = ch;
        return TQKV_OK;
    }
    ch->comm = m;
    ch->nccl = 1;
#else
    (void)timeout_ms;
    snprintf(ch->reason, sizeof ch->reason, "libtqkv was built without NCCL");
#endif
    *out = ch;
    return TQKV_OK;
}

int
tqkv_channel_is_nccl(const tqkv_channel_t *ch)
{
    return ch != NULL && ch->nccl;
}

const char *
tqkv_channel_fallback_reason(const tqkv_channel_t *ch)
{
    return ch == NULL ? "no channel" : ch->reason;
}

void
tqkv_client_close_channel(tqkv_client_t *c, tqkv_channel_t *ch)
{
    if (ch == NULL)
        return;
#ifdef TQKV_HAVE_NCCL
    if (ch->nccl) {
        tqkv_client_error_t saved = last_err;
        close_channel_rpc(c, ch);
        last_err = saved;
        tqkv_nccl_comm_free(ch->comm);
    }
#endif
    free(ch);
}

/* Fallback: an ordinary Get, pages delivered as host bytes. */
typedef struct nccl_fb {
    tqkv_nccl_cb_t cb;
    void *arg;
} nccl_fb_t;

static int
nccl_fb_cb(void *arg, const tqkv_get_page_t *pg)
{
    nccl_fb_t *f = arg;
    tqkv_nccl_page_t p;
    memset(&p, 0, sizeof p);
    p.hash_index = pg->hash_index;
    p.layer = pg->layer;
    p.found = pg->found;
    p.tier = pg->tier;
    p.shape = pg->shape;
    p.data = pg->page;
    p.len = pg->page_len;
    return f->cb(f->arg, &p);
}

#ifdef TQKV_HAVE_NCCL
static tqkv_status_t
get_over_nccl(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *q, void *const *dev_bufs,
              size_t n_bufs, size_t buf_len, tqkv_nccl_cb_t cb, void *arg)
{
    tqkv_status_t st = TQKV_OK;
    size_t n = q->num_hashes, total = n * (size_t)(q->layer_end - q->layer_begin), k = 0;
    int canceled = 0;
    char err[256];
    ProtobufCBinaryData *hb = malloc(n * sizeof *hb);
    if (hb == NULL)
        return set_err(TQKV_ENOMEM, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        hb[i].data = (uint8_t *)q->hashes[i].bytes;
        hb[i].len = q->hashes[i].len;
    }
    Tqkv__V1__GetRequest m;
    tqkv__v1__get_request__init(&m);
    m.namespace_ = (char *)q->ns;
    m.hashes = hb;
    m.n_hashes = n;
    m.layer_begin = q->layer_begin;
    m.layer_end = q->layer_end;
    m.encoding = TQKV__V1__ENCODING__ENCODING_PACKED;
    m.transport = TQKV__V1__TRANSPORT__TRANSPORT_NCCL;
    m.channel_id = ch->id;
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    free(hb);
    if (bb == NULL)
        return set_err(TQKV_ENOMEM, 0, "out of memory");
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    rpc_t r;
    memset(&r, 0, sizeof r);
    gpr_timespec dl = deadline_after(q->deadline_ms ? q->deadline_ms : c->deadline_ms);
    uint32_t op_ms = q->deadline_ms ? q->deadline_ms : c->deadline_ms;
    st = rpc_start(c, &r, cq, ch->target, M_GET, dl, bb);
    if (r.call == NULL) {
        grpc_byte_buffer_destroy(bb);
        r.init_bb = NULL;
    }
    if (st == TQKV_OK)
        rpc_recv(&r);
    while (r.inflight > 0) {
        tag_kind_t kind;
        int ok;
        if (cq_step(cq, &kind, &ok) == NULL)
            break;
        if (kind != TAG_RECV || r.recv_bb == NULL)
            continue;
        grpc_byte_buffer_reader rd;
        grpc_slice s = grpc_empty_slice();
        if (grpc_byte_buffer_reader_init(&rd, r.recv_bb)) {
            s = grpc_byte_buffer_reader_readall(&rd);
            grpc_byte_buffer_reader_destroy(&rd);
        }
        grpc_byte_buffer_destroy(r.recv_bb);
        r.recv_bb = NULL;
        Tqkv__V1__GetResponse *g =
            tqkv__v1__get_response__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
        grpc_slice_unref(s);
        if (st == TQKV_OK && (g == NULL || k >= total)) {
            st = set_err(TQKV_EINTERNAL, 0, "get (nccl): malformed or extra response");
            ch->broken = 1;
            grpc_call_cancel(r.call, NULL);
        }
        if (st == TQKV_OK && !canceled) {
            tqkv_nccl_page_t p;
            memset(&p, 0, sizeof p);
            p.hash_index = k % n;
            p.layer = q->layer_begin + (uint32_t)(k / n);
            p.found = g->found;
            p.tier = (int)g->tier;
            p.shape.num_tokens = g->num_tokens;
            p.shape.num_kv_heads = g->num_kv_heads;
            p.shape.head_dim = g->head_dim;
            if (g->found && g->nccl_bytes > 0) {
                void *dst = dev_bufs[k % n_bufs];
                if (g->nccl_bytes > buf_len) {
                    st = set_err(TQKV_ENOSPC, 0,
                                 "get (nccl): page of %llu bytes exceeds the %zu-byte buffers",
                                 (unsigned long long)g->nccl_bytes, buf_len);
                } else {
                    tqkv_status_t rs = tqkv_nccl_comm_recv(ch->comm, dst, (size_t)g->nccl_bytes,
                                                           op_ms, err, sizeof err);
                    if (rs != TQKV_OK)
                        st = set_err(rs, 0, "get (nccl): %s", err);
                }
                if (st != TQKV_OK) {
                    ch->broken = 1;
                    grpc_call_cancel(r.call, NULL);
                } else {
                    p.data = dst;
                    p.len = (size_t)g->nccl_bytes;
                    p.on_device = 1;
                    p.cuda_stream = tqkv_nccl_comm_stream(ch->comm);
                }
            } else if (g->found) {
                p.data = g->page.data; /* the server sent the bytes inline */
                p.len = g->page.len;
            }
            if (st == TQKV_OK && cb(arg, &p) != 0) {
                canceled = 1;
                ch->broken = 1;
                grpc_call_cancel(r.call, NULL);
            }
        }
        if (g)
            tqkv__v1__get_response__free_unpacked(g, NULL);
        k++;
        if (!r.recv_eof && st == TQKV_OK && !canceled)
            rpc_recv(&r);
    }
    if (st == TQKV_OK && r.call) {
        if (canceled)
            st = set_err(TQKV_ECANCELED, 0, "get (nccl): cancelled by the callback");
        else
            st = rpc_result(c, &r);
        if (st != TQKV_OK && !canceled)
            ch->broken = 1;
        if (st == TQKV_OK && k != total) {
            ch->broken = 1;
            st = set_err(TQKV_EINTERNAL, 0, "get (nccl): %zu of %zu pages received", k, total);
        }
    }
    rpc_fini(&r);
    cq_destroy(cq);
    return st;
}
#endif

tqkv_status_t
tqkv_client_get_nccl(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *req,
                     void *const *dev_bufs, size_t n_bufs, size_t buf_len, tqkv_nccl_cb_t cb,
                     void *arg)
{
    if (c == NULL || req == NULL)
        return set_err(TQKV_EINVAL, 0, "get (nccl): client and request required");
    if (req->encoding != TQKV_CLIENT_PACKED)
        return set_err(TQKV_EINVAL, 0, "get (nccl): PACKED encoding only");
    if (ch == NULL || !ch->nccl) {
        nccl_fb_t f = {cb, arg};
        return tqkv_client_get(c, req, nccl_fb_cb, &f);
    }
#ifdef TQKV_HAVE_NCCL
    if (req->ns == NULL || cb == NULL || req->layer_end <= req->layer_begin)
        return set_err(TQKV_EINVAL, 0, "get: namespace, callback and layer_end > layer_begin");
    if (dev_bufs == NULL || n_bufs == 0 || buf_len == 0)
        return set_err(TQKV_EINVAL, 0, "get (nccl): device buffers required");
    for (size_t i = 0; i < req->num_hashes; i++)
        if (!hash_ok(&req->hashes[i]))
            return set_err(TQKV_EINVAL, 0, "get: hash %zu is not 8..64 bytes", i);
    if (ch->broken)
        return set_err(TQKV_ECANCELED, 0, "get (nccl): the channel is broken; close it");
    if (req->num_hashes == 0)
        return TQKV_OK;
    return get_over_nccl(c, ch, req, dev_bufs, n_bufs, buf_len, cb, arg);
#else
    return set_err(TQKV_EINTERNAL, 0, "unreachable");
#endif
}
