/* server.c - tqkv-server's event loop on the gRPC C core: worker threads, one
 * completion queue each, and the call state machine (tqkv__drive).
 *
 * Every call is a tqkv__call_t with one embedded tag per op kind and a count of tags
 * in flight; it is freed only when that count drops to zero (a started batch always
 * returns its tag, even after a cancel). Each worker keeps one requested call per
 * registered method plus one generic request (unregistered methods get
 * UNIMPLEMENTED at once instead of hanging until their deadline).
 *
 * Shutdown (tqkv_server_shutdown) follows the core's required order: health
 * NOT_SERVING, grpc_server_shutdown_and_notify, wait for KV calls up to
 * drain_seconds, grpc_server_cancel_all_calls, wait for the shutdown tag and for
 * every call object to be freed, shut down and drain each completion queue, join,
 * grpc_server_destroy, destroy the queues.
 *
 * The handlers are reached only through the method table (methods.c); the calls' batch
 * operations and log lines are in call.c.
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

/* ---- call objects and arming ---- */

static tqkv__call_t *
call_new(tqkv__worker_t *w, tqkv__method_t m)
{
    tqkv__call_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->srv = w->srv;
    c->w = w;
    c->method = m;
    c->state = TQKV__CS_REQUESTED;
    c->code = GRPC_STATUS_OK;
    for (int k = 0; k < TQKV__TAG_COUNT; k++) {
        c->tags[k].call = c;
        c->tags[k].kind = (tqkv__tag_kind_t)k;
    }
    grpc_metadata_array_init(&c->md);
    pthread_mutex_init(&c->batch_mu, NULL);
    if (m == TQKV__M_GENERIC)
        grpc_call_details_init(&c->details);
    atomic_fetch_add(&w->srv->live_calls, 1);
    return c;
}

static void
call_free(tqkv__call_t *c)
{
    tqkv_server_t *s = c->srv;
    if (c->started && c->method != TQKV__M_GENERIC) {
        const tqkv__handler_t *h = tqkv__method_handler(c->method);
        if (h->on_free)
            h->on_free(c);
        double secs = tqkv_clock_s() - c->t_start;
        tqkv_metrics_rpc_done(s->metrics, h->metric, (int)c->code, secs);
        tqkv__call_log_end(c, h->metric, secs);
        tqkv_metrics_streams(s->metrics, -1);
        if (h->drain)
            atomic_fetch_sub(&s->work_calls, 1);
    }
    if (c->recv_bb)
        grpc_byte_buffer_destroy(c->recv_bb);
    if (c->send_bb)
        grpc_byte_buffer_destroy(c->send_bb);
    grpc_metadata_array_destroy(&c->md);
    if (c->method == TQKV__M_GENERIC)
        grpc_call_details_destroy(&c->details);
    if (c->call)
        grpc_call_unref(c->call);
    free(c->authz);
    tqkv_auth_destroy(c->auth); /* the call's reference */
    free(c->detail);
    grpc_slice_unref(c->trail_md.key);
    grpc_slice_unref(c->trail_md.value);
    /* A thread that posted the last wake (tqkv__call_wake) may still be between its
     * start_batch and its unlock: wait for it to let go before destroying the mutex. */
    pthread_mutex_lock(&c->batch_mu);
    pthread_mutex_unlock(&c->batch_mu);
    pthread_mutex_destroy(&c->batch_mu);
    free(c);
    atomic_fetch_sub(&s->live_calls, 1);
}

/* Requests the next call of method m on worker w. */
static void
arm(tqkv__worker_t *w, tqkv__method_t m)
{
    tqkv_server_t *s = w->srv;
    grpc_call_error e;
    if (atomic_load(&s->shutting_down))
        return;
    tqkv__call_t *c = call_new(w, m);
    if (c == NULL) {
        tqkv_log(TQKV_LOG_ERROR, "out of memory arming a call", NULL);
        return;
    }
    c->inflight = 1;
    if (m == TQKV__M_GENERIC) {
        e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, w->cq, w->cq,
                                     &c->tags[TQKV__TAG_NEW]);
    } else {
        const tqkv__handler_t *h = tqkv__method_handler(m);
        e = grpc_server_request_registered_call(
            s->server, s->method_handles[m], &c->call, &c->deadline, &c->md,
            h->payload_on_new ? &c->recv_bb : NULL, w->cq, w->cq, &c->tags[TQKV__TAG_NEW]);
    }
    if (e != GRPC_CALL_OK) {
        tqkv_log(TQKV_LOG_ERROR, "request call failed", "method=%d error=%d", (int)m, (int)e);
        c->inflight = 0;
        call_free(c);
    }
}

/* The generic handler: unregistered method -> UNIMPLEMENTED at once. */
static void
generic_start(tqkv__call_t *c)
{
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    char path[256];
    size_t pl = GRPC_SLICE_LENGTH(c->details.method);
    if (pl >= sizeof path - 1)
        pl = sizeof path - 1;
    memcpy(path, GRPC_SLICE_START_PTR(c->details.method), pl);
    path[pl] = '\0';
    char msg[320];
    snprintf(msg, sizeof msg, "method %s is not implemented by tqkv-server", path);
    grpc_slice details = grpc_slice_from_copied_string(msg);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &details;
    tqkv__call_req_id_set(c);
    tqkv__call_set_trailers(c, &ops[1]);
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &c->cancelled;
    tqkv__call_set_state(c, TQKV__CS_STATUS);
    if (tqkv__call_start(c, ops, 3, TQKV__TAG_STATUS) != GRPC_CALL_OK)
        tqkv__call_set_state(c, TQKV__CS_DONE);
    grpc_slice_unref(details);
}

static void
on_new(tqkv__call_t *c, int ok)
{
    tqkv_server_t *s = c->srv;
    if (!ok) {
        /* Server shutting down: the request is returned unmatched. */
        tqkv__call_set_state(c, TQKV__CS_DONE);
        return;
    }
    arm(c->w, c->method); /* keep one request outstanding, first */
    if (c->method == TQKV__M_GENERIC) {
        generic_start(c);
        return;
    }
    const tqkv__handler_t *h = tqkv__method_handler(c->method);
    c->started = 1;
    c->t_start = tqkv_clock_s();
    tqkv_metrics_streams(s->metrics, 1);
    if (h->drain)
        atomic_fetch_add(&s->work_calls, 1);
    for (size_t i = 0; i < c->md.count; i++)
        if (grpc_slice_str_cmp(c->md.metadata[i].key, "tqkv-hop") == 0) /* forward.h */
            c->hop = grpc_slice_str_cmp(c->md.metadata[i].value, "1") ? TQKV__HOP_PEER
                                                                      : TQKV__HOP_ROUTED;
    tqkv__call_req_id_set(c);
    c->auth = tqkv__auth_acquire(s);
    for (size_t i = 0; i < c->md.count; i++) {
        if (grpc_slice_str_cmp(c->md.metadata[i].key, "authorization") == 0) {
            size_t n = GRPC_SLICE_LENGTH(c->md.metadata[i].value);
            c->authz = malloc(n + 1);
            if (c->authz) {
                memcpy(c->authz, GRPC_SLICE_START_PTR(c->md.metadata[i].value), n);
                c->authz[n] = '\0';
                c->authz_len = n;
            }
            break;
        }
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[1].data.recv_close_on_server.cancelled = &c->cancelled;
    if (tqkv__call_start(c, ops, 2, TQKV__TAG_CLOSE) != GRPC_CALL_OK) {
        tqkv__call_abort(c);
        return;
    }
    /* A KV call without a valid token is refused before its request is decoded, so
     * an unauthenticated client learns nothing from validation messages. */
    if (c->auth && strncmp(h->path, "/tqkv.v1.KVCache/", 17) == 0 &&
        tqkv_auth_check(c->auth, c->authz, c->authz_len, NULL, 0, 0) == TQKV_EAUTH) {
        tqkv__call_finish(c, GRPC_STATUS_UNAUTHENTICATED,
                          "authorization: missing, malformed or unknown bearer token", NULL);
        return;
    }
    h->on_start(c);
}

/* Frees the message whose send completed. */
static void
drop_send_bb(tqkv__call_t *c)
{
    if (c->send_bb) {
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
    }
}

/* The state machine: one event of call c. */
static void
tqkv__drive(tqkv__call_t *c, tqkv__tag_kind_t kind, int ok)
{
    const tqkv__handler_t *h = tqkv__method_handler(c->method);

    if (kind == TQKV__TAG_CLOSE) {
        /* The call is over (status sent, or cancelled / deadline / peer gone). */
        c->closed = 1;
        if (c->cancelled && c->code == GRPC_STATUS_OK && c->state != TQKV__CS_DONE)
            c->code = GRPC_STATUS_CANCELLED;
        if (h && h->on_close)
            h->on_close(c);
        return;
    }
    if (kind == TQKV__TAG_WAKE && c->state != TQKV__CS_REQUESTED && h && h->on_wake) {
        /* A job finished (Put; Get's read-ahead decode; the work of a unary call), or
         * finished late: the call was abandoned while working, or Get's decode finished
         * after its slot was sent. */
        h->on_wake(c);
        return;
    }
    switch (c->state) {
    case TQKV__CS_REQUESTED:
        if (kind == TQKV__TAG_NEW) {
            on_new(c, ok);
            return;
        }
        break;
    case TQKV__CS_RECV:
        if (kind == TQKV__TAG_RECV) {
            if (ok)
                h->on_recv(c, ok);
            else
                tqkv__call_abort(c);
            return;
        }
        break;
    case TQKV__CS_SEND:
        if (kind == TQKV__TAG_SEND) {
            drop_send_bb(c);
            if (!ok || c->closed) {
                tqkv__call_abort(c);
                return;
            }
            h->on_send(c, ok);
            return;
        }
        break;
    case TQKV__CS_WORK:
    case TQKV__CS_IDLE:
        break; /* only wakes, above */
    case TQKV__CS_STATUS:
        if (kind == TQKV__TAG_STATUS) {
            drop_send_bb(c);
            tqkv__call_set_state(c, TQKV__CS_DONE);
            return;
        }
        break;
    case TQKV__CS_DONE:
        if (kind == TQKV__TAG_SEND || kind == TQKV__TAG_STATUS || kind == TQKV__TAG_RECV)
            return; /* ops that were in flight when the call was abandoned */
        break;
    }
    tqkv_log(TQKV_LOG_ERROR, "unexpected event", "state=%s tag=%d method=%d",
             tqkv__call_state_name(c->state), (int)kind, (int)c->method);
    abort();
}

/* ---- workers ---- */

static void *
worker_main(void *p)
{
    tqkv__worker_t *w = p;
    tqkv_server_t *s = w->srv;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        tqkv__tag_t *t = ev.tag;
        if (t->call == NULL) {
            pthread_mutex_lock(&s->mu);
            s->shutdown_done = 1;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        tqkv__call_t *c = t->call;
        c->inflight--;
        tqkv__drive(c, t->kind, ev.success);
        if (c->inflight == 0) {
            if (c->state != TQKV__CS_DONE)
                tqkv__call_set_state(c, TQKV__CS_DONE);
            call_free(c);
            if (atomic_load(&s->shutting_down)) {
                pthread_mutex_lock(&s->mu);
                pthread_cond_broadcast(&s->cv);
                pthread_mutex_unlock(&s->mu);
            }
        }
    }
    return NULL;
}

/* ---- lifecycle ---- */

static void
set_arg_int(grpc_arg *a, const char *key, int v)
{
    a->type = GRPC_ARG_INTEGER;
    a->key = (char *)key;
    a->value.integer = v;
}

/* /readyz: started, not draining, and the KV service reported SERVING. */
static int
http_ready(void *arg)
{
    tqkv_server_t *s = arg;
    if (!atomic_load(&s->ready))
        return 0;
    pthread_mutex_lock(&s->health_mu);
    int st = s->health_status[1];
    pthread_mutex_unlock(&s->health_mu);
    return st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
}

/* Server created (maybe bound) but never started, no worker threads: shut it down
 * on the first queue (no calls exist), destroy it, then shut down and drain every
 * queue before destroying it (P7 without the calls). */
static void
destroy_unstarted(tqkv_server_t *s)
{
    (void)tqkv__dc_destroy(s, 1000);
    if (s->workers && s->nworkers > 0) {
        s->shutdown_tag.call = NULL;
        grpc_server_shutdown_and_notify(s->server, s->workers[0].cq, &s->shutdown_tag);
        for (;;) {
            grpc_event ev = grpc_completion_queue_next(s->workers[0].cq,
                                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type == GRPC_QUEUE_SHUTDOWN || ev.tag == &s->shutdown_tag)
                break;
        }
    }
    grpc_server_destroy(s->server);
    for (unsigned i = 0; s->workers && i < s->nworkers; i++) {
        grpc_completion_queue_shutdown(s->workers[i].cq);
        while (
            grpc_completion_queue_next(s->workers[i].cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
                .type != GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(s->workers[i].cq);
    }
}

/* --auth-tokens: the token table (*auth stays NULL without the flag). An error says
 * "--auth-tokens PATH[:LINE]: reason". */
static tqkv_status_t
auth_load(const tqkv_server_config_t *cfg, tqkv_auth_t **auth, char *err, size_t errlen)
{
    tqkv_status_t st;
    if (cfg->auth_tokens[0] &&
        (st = tqkv_auth_load(cfg->auth_tokens, auth, err, errlen)) != TQKV_OK) {
        /* "PATH[:LINE]: reason" -> "--auth-tokens PATH[:LINE]: reason" (the path may have
         * come from TQKV_AUTH_TOKENS: name the setting too) */
        size_t el = strnlen(err, errlen), pl = strlen("--auth-tokens ");
        if (el + pl < errlen) {
            memmove(err + pl, err, el + 1);
            memcpy(err, "--auth-tokens ", pl);
        }
        return st;
    }
    return TQKV_OK;
}

/* A gRPC server with cfg's channel arguments and every method of the method table
 * registered (grpc_init done). */
static grpc_server *
grpc_server_new(tqkv_server_t *s, const tqkv_server_config_t *cfg)
{
    grpc_arg args[11];
    int mb = (int)cfg->max_message_bytes;
    set_arg_int(&args[0], GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, mb);
    set_arg_int(&args[1], GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, mb);
    set_arg_int(&args[2], GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 * 1024 * 1024 - 1);
    set_arg_int(&args[3], GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
    set_arg_int(&args[4], GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
    set_arg_int(&args[5], GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
    set_arg_int(&args[6], GRPC_ARG_MAX_CONCURRENT_STREAMS, (int)cfg->max_streams);
    set_arg_int(&args[7], GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 1 << 20);
    /* A second server on a busy port must fail, not share it silently. */
    set_arg_int(&args[8], GRPC_ARG_ALLOW_REUSEPORT, 0);
    /* libtqkv pings every 300 ms while its calls wait (fast failure detection,
     * transport/client_health.c): accept pings that often, never answer them with
     * GOAWAY (gRPC's default: 5 minutes between pings without data, 2 strikes). */
    set_arg_int(&args[9], GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 100);
    set_arg_int(&args[10], GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    grpc_channel_args chargs = {11, args};
    grpc_server *server = grpc_server_create(&chargs, NULL);

    for (int m = 0; m < TQKV__M_COUNT; m++) {
        const tqkv__handler_t *h = tqkv__method_handler((tqkv__method_t)m);
        s->method_handles[m] = grpc_server_register_method(
            server, tqkv__method_paths[m], NULL,
            h->payload_on_new ? GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER : GRPC_SRM_PAYLOAD_NONE,
            0);
    }
    return server;
}

/* The workers and their completion queues, the listening port (creds taken once it is
 * bound), the node id, the data channels and the metrics endpoint. On failure err says
 * why and the caller unwinds. */
static tqkv_status_t
server_bind(tqkv_server_t *s, const tqkv_server_config_t *cfg, grpc_server_credentials *creds,
            char *err, size_t errlen)
{
    tqkv_status_t st;
    s->nworkers = cfg->threads ? cfg->threads : 1;
    s->workers = calloc(s->nworkers, sizeof *s->workers);
    if (s->workers == NULL) {
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    for (unsigned i = 0; i < s->nworkers; i++) {
        s->workers[i].srv = s;
        s->workers[i].index = i;
        s->workers[i].cq = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(s->server, s->workers[i].cq, NULL);
    }
    s->port = grpc_server_add_http2_port(s->server, cfg->listen, creds);
    grpc_server_credentials_release(creds);
    if (s->port <= 0) {
        snprintf(err, errlen, "--listen %s: cannot bind (address in use or invalid)", cfg->listen);
        return TQKV_EIO;
    }
    if (s->cfg.node_id[0] == '\0') { /* HOSTNAME:PORT: the pod name, unique on one host */
        char host[200] = "";
        if (gethostname(host, sizeof host - 1) != 0 || host[0] == '\0')
            snprintf(host, sizeof host, "localhost");
        snprintf(s->cfg.node_id, sizeof s->cfg.node_id, "%s:%d", host, s->port);
    }
    tqkv_metrics_set_node_id(s->metrics, s->cfg.node_id);
    if (cfg->data_listen[0] && (st = tqkv__dc_start(s, cfg->data_listen, err, errlen)) != TQKV_OK)
        return st;
    if (cfg->metrics_listen[0]) {
        tqkv_metrics_set_ready(s->metrics, http_ready, s);
        st = tqkv_metrics_serve(s->metrics, cfg->metrics_listen, s->store, &s->metrics_port);
        if (st != TQKV_OK) {
            snprintf(err, errlen, "--metrics-listen %s: %s", cfg->metrics_listen,
                     tqkv_metrics_error(s->metrics));
            return st;
        }
    }
    return TQKV_OK;
}

/* Destroys the locks tqkv_server_create initialized first and frees s: the last step of
 * a failed create and of destroy. */
static void
server_free(tqkv_server_t *s)
{
    pthread_rwlock_destroy(&s->auth_lk);
    pthread_mutex_destroy(&s->reload_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->health_mu);
    free(s);
}

tqkv_status_t
tqkv_server_create(const tqkv_server_config_t *cfg, tqkv_server_t **out, char *err, size_t errlen)
{
    tqkv_status_t st;
    grpc_server_credentials *creds = NULL;
    tqkv_server_t *s = calloc(1, sizeof *s);
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    s->cfg = *cfg;
    tqkv__call_req_id_init();
    tqkv_limits_default(&s->limits);
    s->limits.max_message_bytes = cfg->max_message_bytes;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_rwlock_init(&s->auth_lk, NULL);
    pthread_mutex_init(&s->reload_mu, NULL);
    s->watch_fd = s->watch_wake[0] = s->watch_wake[1] = -1;
    tqkv__health_init(s);

    if ((st = tqkv_store_create(&cfg->store, &s->store)) != TQKV_OK) {
        if (st == TQKV_ENODEV && cfg->store.device >= 0)
            snprintf(err, errlen,
                     "store: --device %d: no such CUDA device (or no driver) for the HBM tier",
                     cfg->store.device);
        else
            snprintf(err, errlen, "store: %s", tqkv_strerror(st));
        goto fail_store;
    }
    /* With a GPU for the HBM tier, Put encodes there too (TQKV_GPU_ENCODE=0: on the CPU). */
    const char *ge = getenv("TQKV_GPU_ENCODE");
    s->gpu_encode_device = cfg->store.device >= 0 && !(ge && !strcmp(ge, "0")) &&
                                   tqkv__gpu_encode_available(cfg->store.device)
                               ? cfg->store.device
                               : -1;
    if ((st = tqkv_encoder_create(cfg->encoder_threads, &s->enc)) != TQKV_OK) {
        snprintf(err, errlen, "encoder pool: %s", tqkv_strerror(st));
        goto fail_enc;
    }
    if ((st = tqkv_metrics_create(&s->metrics)) != TQKV_OK) {
        snprintf(err, errlen, "metrics: %s", tqkv_strerror(st));
        goto fail_metrics;
    }
    tqkv_auth_t *auth = NULL;
    if ((st = auth_load(cfg, &auth, err, errlen)) != TQKV_OK)
        goto fail_auth;
    s->auth = auth;
    if (auth)
        tqkv_metrics_reload(s->metrics, 0, 1);
    if ((cfg->handoff_seconds > 0 || !cfg->no_forward) && cfg->peers[0] &&
        (st = tqkv__peer_check(cfg, auth, err, errlen)) != TQKV_OK)
        goto fail_refl;
    if ((st = tqkv__reflection_create(&s->refl, err, errlen)) != TQKV_OK)
        goto fail_refl;
    if (cfg->tls_cert[0]) {
        st = tqkv_tls_create(cfg->tls_cert, cfg->tls_key,
                             cfg->tls_client_ca[0] ? cfg->tls_client_ca : NULL, &s->tls, &creds,
                             err, errlen);
        if (st != TQKV_OK)
            goto fail_creds;
        tqkv_metrics_reload(s->metrics, 1, 1);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }

    grpc_init();
    s->server = grpc_server_new(s, cfg);
    if ((st = server_bind(s, cfg, creds, err, errlen)) != TQKV_OK)
        goto fail_bind;
    *out = s;
    return TQKV_OK;

fail_bind:
    destroy_unstarted(s);
    free(s->workers);
    grpc_shutdown();
fail_creds:
    tqkv_tls_destroy(s->tls);
    tqkv__reflection_destroy(s->refl);
fail_refl:
    tqkv_auth_destroy(s->auth);
fail_auth:
    tqkv_metrics_destroy(s->metrics);
fail_metrics:
    tqkv_encoder_destroy(s->enc);
fail_enc:
    tqkv_store_destroy(s->store);
fail_store:
    server_free(s);
    return st;
}

/* One "codec policy" line for the global policy and one per --namespace-policy. */
static void
log_policies(const tqkv_server_config_t *cfg)
{
    char desc[400];
    tqkv_config_policy_format(&cfg->policy, desc, sizeof desc);
    tqkv_log(TQKV_LOG_INFO, "codec policy", "scope=default %s", desc);
    for (unsigned i = 0; i < cfg->num_ns_policies; i++) {
        const tqkv_ns_policy_t *e = &cfg->ns_policies[i];
        tqkv_config_policy_format(&e->policy, desc, sizeof desc);
        tqkv_log(TQKV_LOG_INFO, "codec policy", "scope=%s ns=%s%s %s",
                 e->prefix ? "prefix" : "exact", e->ns, e->prefix ? "*" : "", desc);
    }
}

tqkv_status_t
tqkv_server_start(tqkv_server_t *s)
{
    grpc_server_start(s->server);
    for (unsigned i = 0; i < s->nworkers; i++) {
        tqkv__worker_t *w = &s->workers[i];
        for (int m = 0; m < TQKV__M_COUNT; m++)
            arm(w, (tqkv__method_t)m);
        arm(w, TQKV__M_GENERIC);
    }
    for (unsigned i = 0; i < s->nworkers; i++) {
        if (pthread_create(&s->workers[i].thread, NULL, worker_main, &s->workers[i]) != 0) {
            tqkv_log(TQKV_LOG_ERROR, "cannot start worker thread", "index=%u", i);
            abort();
        }
    }
    s->started = 1;
    tqkv__fwd_start(s); /* --peers: forwarding to blocks' owners, once they are known */
    atomic_store(&s->ready, 1);
    tqkv_log(TQKV_LOG_INFO, "serving",
             "version=%s git=%s node_id=%s port=%d threads=%u encoder_threads=%u auth=%s tls=%s "
             "max_message_bytes=%llu",
             tqkv_version(), tqkv_version_git(), s->cfg.node_id, s->port, s->nworkers,
             s->cfg.encoder_threads, s->auth ? "on" : "off", s->cfg.tls_cert[0] ? "on" : "off",
             (unsigned long long)s->cfg.max_message_bytes);
    log_policies(&s->cfg);
    if (s->tls) {
        time_t na = (time_t)tqkv_tls_not_after(s->tls);
        struct tm tm;
        char when[32] = "?";
        if (gmtime_r(&na, &tm))
            strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
        tqkv_log(TQKV_LOG_INFO, "TLS certificate", "not_after=%s client_ca=%s", when,
                 s->cfg.tls_client_ca[0] ? "on" : "off");
    }
    tqkv__reload_watch_start(s);
    if (s->dc) {
        char listen[300], tls[160]; /* quoted: the values have spaces */
        tqkv_log_quote(listen, sizeof listen, s->cfg.data_listen);
        tqkv_log_quote(tls, sizeof tls, tqkv__dc_tls_summary(s));
        tqkv_log(TQKV_LOG_INFO, "TCP data channels", "listen=\"%s\" port=%d tls=\"%s\"", listen,
                 tqkv__dc_port(s), tls);
    }
    if (s->gpu_encode_device >= 0)
        tqkv_log(TQKV_LOG_INFO, "put encoding", "device=%d", s->gpu_encode_device);
    else if (s->cfg.store.device >= 0 && !tqkv__gpu_encode_available(s->cfg.store.device))
        tqkv_log(TQKV_LOG_WARN, "no such CUDA device: Put encodes on the CPU", "device=%d",
                 s->cfg.store.device);
    else
        tqkv_log(TQKV_LOG_INFO, "put encoding", "device=cpu");
    return TQKV_OK;
}

int
tqkv_server_port(const tqkv_server_t *s)
{
    return s->port;
}

const char *
tqkv_server_node_id(const tqkv_server_t *s)
{
    return s->cfg.node_id;
}

int
tqkv_server_metrics_port(const tqkv_server_t *s)
{
    return s->metrics_port;
}

static void
wait_until(tqkv_server_t *s, double deadline, int (*cond)(tqkv_server_t *))
{
    pthread_mutex_lock(&s->mu);
    while (!cond(s)) {
        if (deadline > 0 && tqkv_clock_s() >= deadline)
            break;
        struct timespec ts = tqkv_clock_deadline(20);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
}

#define LINGER_S 2.0       /* after a drain: the longest wait for clients to take the bytes */
#define LINGER_QUIET_S 0.3 /* ... ended once the sockets stayed flushed this long */

/* Bytes this process's TCP sockets hold that their peers have not acknowledged. */
static long
unacked_bytes(void)
{
    DIR *d = opendir("/proc/self/fd");
    long total = 0;
    struct dirent *e;
    if (d == NULL)
        return 0;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        struct stat st;
        int type = 0, q = 0;
        socklen_t len = sizeof type;
        if (e->d_name[0] == '.' || fd == dirfd(d) || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
            continue;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM &&
            ioctl(fd, SIOCOUTQ, &q) == 0 && q > 0)
            total += q;
    }
    closedir(d);
    return total;
}

/* Waits (10 ms steps) until deadline, or until no TCP socket has held unacknowledged
 * bytes for LINGER_QUIET_S in a row: gRPC completes a call once its last messages are
 * queued in its own transport, which writes them to the socket afterwards. */
static void
wait_sockets_flushed(double deadline)
{
    double quiet_since = tqkv_clock_s();
    while (tqkv_clock_s() < deadline) {
        if (unacked_bytes() > 0)
            quiet_since = tqkv_clock_s();
        else if (tqkv_clock_s() - quiet_since >= LINGER_QUIET_S)
            return;
        usleep(10000);
    }
}

static int
no_work(tqkv_server_t *s)
{
    return atomic_load(&s->work_calls) == 0;
}

static int
all_gone(tqkv_server_t *s)
{
    return s->shutdown_done && atomic_load(&s->live_calls) == 0;
}

void
tqkv_server_shutdown(tqkv_server_t *s)
{
    if (s->stopped)
        return;
    s->stopped = 1;
    atomic_store(&s->ready, 0);
    tqkv__reload_watch_stop(s);
    if (!s->started)
        return;
    long inflight = atomic_load(&s->work_calls);
    tqkv__health_set_all(s, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING);
    atomic_store(&s->shutting_down, 1); /* no call is armed any more */
    tqkv__dc_stop_accepting(s);         /* channels already attached serve out the drain */
    /* Logged once new calls and channels are refused (tests wait for this line). */
    tqkv_log(TQKV_LOG_INFO, "draining", "in_flight=%ld drain_seconds=%u", inflight,
             s->cfg.drain_seconds);
    /* The drain runs before gRPC's own shutdown: with grpc_server_shutdown_and_notify
     * first, gRPC 1.51 closed a connection as soon as its last call completed, while the
     * call's last messages could still be on their way, and the client, whose window
     * updates were unread, got a reset instead of them (interop_server's SIGTERM test,
     * ~3% of runs). */
    double drain_end = tqkv_clock_s() + s->cfg.drain_seconds;
    wait_until(s, drain_end, no_work);
    long left = atomic_load(&s->work_calls);
    if (left)
        tqkv_log(TQKV_LOG_WARN, "drain time over, cancelling calls", "in_flight=%ld", left);
    else if (inflight > 0) {
        /* A drained call is complete once its last bytes are queued, not once the client
         * has them: wait until every TCP socket of the process has nothing left
         * unacknowledged (bounded by LINGER_S and the drain). */
        double linger = tqkv_clock_s() + LINGER_S;
        wait_sockets_flushed(linger < drain_end ? linger : drain_end);
    }
    s->shutdown_tag.call = NULL;
    grpc_server_shutdown_and_notify(s->server, s->workers[0].cq, &s->shutdown_tag);
    grpc_server_cancel_all_calls(s->server);
    wait_until(s, 0, all_gone);
    unsigned dc_left = tqkv__dc_destroy(s, 5000);
    if (dc_left)
        tqkv_log(TQKV_LOG_WARN, "data channel threads did not stop", "threads=%u", dc_left);
    for (unsigned i = 0; i < s->nworkers; i++)
        grpc_completion_queue_shutdown(s->workers[i].cq);
    for (unsigned i = 0; i < s->nworkers; i++)
        pthread_join(s->workers[i].thread, NULL);
    tqkv_log(TQKV_LOG_INFO, "stopped", NULL);
}

void
tqkv_server_destroy(tqkv_server_t *s)
{
    if (s == NULL)
        return;
    tqkv_server_shutdown(s);
    tqkv__fwd_stop(s); /* no call runs any more */
    if (s->started) {
        grpc_server_destroy(s->server);
        for (unsigned i = 0; i < s->nworkers; i++)
            grpc_completion_queue_destroy(s->workers[i].cq);
    } else {
        destroy_unstarted(s);
    }
    free(s->workers);
    grpc_shutdown();
    tqkv_tls_destroy(s->tls); /* after the server: its credentials fetch from it */
    tqkv_encoder_destroy(s->enc);
    tqkv_metrics_destroy(s->metrics);
    tqkv__reflection_destroy(s->refl);
    tqkv_auth_destroy(s->auth);
#ifdef TQKV_HAVE_NCCL
    /* Channel threads pin the pages they still have to send: stop them before the
     * store goes. One that does not stop in time keeps the store (the process is
     * exiting; a leak beats a use after free). */
    unsigned nccl_left = tqkv_nccl_chan_close_all(5000);
    if (nccl_left) {
        tqkv_log(TQKV_LOG_WARN, "NCCL channel threads did not stop; store kept", "threads=%u",
                 nccl_left);
        s->store = NULL;
    }
#endif
    tqkv_store_destroy(s->store);
    server_free(s);
}
