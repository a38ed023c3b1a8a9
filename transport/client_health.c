/* client_health.c - fast failure detection: keepalive pings, servers marked down until
 * they answer a probe.
 *
 * A silent server (packets dropped, no RST: a black-holed port, a partition, a dead
 * node) gives no error; without this a call on it waits for its deadline. Here:
 *
 *   - Every channel of a client with several servers (or a DNS name that stands for
 *     them) sends HTTP/2 keepalive pings while calls are in flight: after
 *     keepalive_ms without data from the server, a ping; unanswered for
 *     keepalive_timeout_ms, gRPC closes the connection and its calls end UNAVAILABLE,
 *     so a Get or Lookup asks the block's next-ranked server and a Put is re-sent
 *     (the paths that already serve a refused connection).
 *   - A call that ended UNAVAILABLE marks its server down (tqkv_shard_health_down):
 *     calls skip it, with no deadline, until the prober sees it answer.
 *   - The prober (one thread per client) asks every down server of the current table a
 *     Health check every probe_interval_ms with a deadline of the same length, on the
 *     target's own channels; an answer (any serving status) makes the server usable
 *     again. A channel that is not READY after a failed probe is replaced by a fresh
 *     one (at most once per second), so a server that comes back is reached by a new
 *     connection at once, not after an old attempt's SYN retransmissions.
 *
 * Servers must accept pings this often (service/server.c: minimum ping interval
 * 100 ms, no ping strikes); gRPC servers that keep the default 5-minute policy answer
 * frequent pings without data with GOAWAY, which this client survives (the calls are
 * retried) but should not meet.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "transport/client_health.h"
#include "transport/client_internal.h"
#include "transport/wire.h"

struct tqkv__health {
    tqkv_client_t *c; /* the client (not a view) */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, started;
    uint32_t interval_ms;
    _Atomic uint64_t probes, revived, marked_down;
};

uint32_t
tqkv__health_keepalive_ms(const tqkv_client_opts_t *o)
{
    return o->keepalive_ms ? o->keepalive_ms : TQKV_CLIENT_DEFAULT_KEEPALIVE_MS;
}

static void
arg_int(grpc_arg *a, const char *key, int v)
{
    a->type = GRPC_ARG_INTEGER;
    a->key = (char *)key;
    a->value.integer = v;
}

size_t
tqkv__health_channel_args(const tqkv_client_opts_t *o, grpc_arg *args, size_t cap)
{
    uint32_t ka = tqkv__health_keepalive_ms(o);
    /* One server and no DNS name: no other server to ask instead, so a ping answered
     * late (a loaded server) would turn a slow call into a failed one: as before. */
    if (ka == UINT32_MAX || cap < TQKV__HEALTH_NUM_ARGS ||
        (o->num_targets <= 1 && !o->resolve_targets))
        return 0;
    uint32_t kt = o->keepalive_timeout_ms ? o->keepalive_timeout_ms
                                          : TQKV_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS;
    int ka_i = ka > 0x7fffffff ? 0x7fffffff : (int)ka;
    int kt_i = kt > 0x7fffffff ? 0x7fffffff : (int)kt;
    arg_int(&args[0], GRPC_ARG_KEEPALIVE_TIME_MS, ka_i);
    arg_int(&args[1], GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kt_i);
    /* Only while calls are in flight: an idle client does not ping (a server's ping
     * policy may count idle pings against it). */
    arg_int(&args[2], GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    /* gRPC otherwise stops pinging after 2 pings without data sent, and spaces pings
     * without data 5 minutes apart: a call waiting for a silent server sends no data. */
    arg_int(&args[3], GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    arg_int(&args[4], GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, ka_i);
    return TQKV__HEALTH_NUM_ARGS;
}

/* Replaces target t's channels that are not READY by fresh ones (at most once a second). */
static void
renew(tqkv_client_t *c, target_t *t)
{
    uint64_t now = tqkv_clock_ns(), last = atomic_load(&t->renewed_ns);
    if (now - last < 1000000000ull || !atomic_compare_exchange_strong(&t->renewed_ns, &last, now))
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

/* One round: a Health check to every down target of the current table, in parallel. */
static void
probe_round(tqkv__health_t *h)
{
    tqkv_client_t v;
    tqkv__view_enter(h->c, &v);
    size_t n = 0;
    size_t *tis = malloc(v.nt * sizeof *tis);
    rpc_t *rs = calloc(v.nt, sizeof *rs);
    if (tis == NULL || rs == NULL)
        goto out;
    for (size_t i = 0; i < v.nt; i++)
        if (tqkv_shard_health_is_down(&v.t[i]->health))
            tis[n++] = i;
    if (n == 0)
        goto out;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    gpr_timespec dl = tqkv__deadline_after(h->interval_ms);
    Grpc__Health__V1__HealthCheckRequest m;
    grpc__health__v1__health_check_request__init(&m);
    m.service = "";
    size_t live = 0;
    for (size_t i = 0; i < n; i++) {
        grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
        if (tqkv__rpc_start(&v, &rs[i], cq, tis[i], M_HEALTH, dl, bb) == TQKV_OK)
            tqkv__rpc_recv(&rs[i]);
        else if (rs[i].call == NULL)
            grpc_byte_buffer_destroy(bb), rs[i].init_bb = NULL;
        live += rs[i].inflight > 0;
    }
    while (live > 0) {
        tag_kind_t k;
        int ok;
        rpc_t *r = tqkv__cq_step(cq, &k, &ok);
        if (r == NULL)
            break;
        if (r->inflight == 0)
            live--;
    }
    for (size_t i = 0; i < n; i++) {
        target_t *t = v.t[tis[i]];
        atomic_fetch_add(&h->probes, 1);
        if (rs[i].status_done && rs[i].status == GRPC_STATUS_OK) {
            tqkv_shard_health_ok(&t->health, v.backoff_min);
            atomic_fetch_add(&h->revived, 1);
        } else {
            renew(&v, t);
        }
        tqkv__rpc_fini(&rs[i]);
    }
    tqkv__cq_destroy(cq);
out:
    free(tis);
    free(rs);
    tqkv__view_leave(&v);
}

static void *
prober_main(void *arg)
{
    tqkv__health_t *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        pthread_mutex_unlock(&h->mu);
        uint64_t t0 = tqkv_clock_ns();
        probe_round(h);
        uint64_t spent_ms = (tqkv_clock_ns() - t0) / 1000000u;
        pthread_mutex_lock(&h->mu);
        if (h->stop)
            break;
        uint32_t wait_ms = spent_ms >= h->interval_ms ? 1 : h->interval_ms - (uint32_t)spent_ms;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += wait_ms / 1000;
        ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

tqkv_status_t
tqkv__health_start(tqkv_client_t *c, const tqkv_client_opts_t *o, tqkv__health_t **out)
{
    *out = NULL;
    if (o->probe_interval_ms == UINT32_MAX)
        return TQKV_OK; /* no prober: failed servers back off as before */
    tqkv__health_t *h = calloc(1, sizeof *h);
    if (h == NULL)
        return TQKV_ENOMEM;
    h->c = c;
    h->interval_ms =
        o->probe_interval_ms ? o->probe_interval_ms : TQKV_CLIENT_DEFAULT_PROBE_INTERVAL_MS;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (pthread_create(&h->th, NULL, prober_main, h) != 0) {
        pthread_mutex_destroy(&h->mu);
        pthread_cond_destroy(&h->cv);
        free(h);
        return TQKV_ENOMEM;
    }
    h->started = 1;
    *out = h;
    return TQKV_OK;
}

void
tqkv__health_stop(tqkv__health_t *h)
{
    if (h == NULL)
        return;
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->started)
        pthread_join(h->th, NULL);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

void
tqkv__health_failed(tqkv_client_t *c, size_t ti)
{
    tqkv__health_t *h = c->sh ? c->sh->health : NULL;
    if (h == NULL || c->nt <= 1)
        return;
    if (!tqkv_shard_health_is_down(&c->t[ti]->health))
        atomic_fetch_add(&h->marked_down, 1);
    tqkv_shard_health_down(&c->t[ti]->health);
    pthread_mutex_lock(&h->mu);
    pthread_cond_signal(&h->cv); /* probe soon */
    pthread_mutex_unlock(&h->mu);
}

tqkv_status_t
tqkv_client_health_stats(const tqkv_client_t *c, tqkv_client_health_stats_t *s)
{
    if (c == NULL || s == NULL)
        return TQKV_EINVAL;
    memset(s, 0, sizeof *s);
    tqkv__health_t *h = c->sh ? c->sh->health : NULL;
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    for (size_t i = 0; i < v.nt; i++)
        s->down_now += (uint64_t)tqkv_shard_health_is_down(&v.t[i]->health);
    tqkv__view_leave(&v);
    if (h) {
        s->marked_down = atomic_load(&h->marked_down);
        s->probes = atomic_load(&h->probes);
        s->revived = atomic_load(&h->revived);
    }
    return TQKV_OK;
}
