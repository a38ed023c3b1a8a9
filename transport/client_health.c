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
 *     Health check every probe_interval_ms with a deadline of keepalive_ms +
 *     keepalive_timeout_ms (what a live server has to answer a ping; at least the
 *     interval: a loaded but live server is not kept down by a tight deadline), on the
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
#include "kernels/clock.h"
#include "transport/client_health.h"
#include "transport/client_internal.h"

struct tqkv__health {
    tqkv_client_t *c; /* the client (not a view) */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, started;
    uint32_t interval_ms, deadline_ms; /* probe period, and a probe's deadline */
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

uint32_t
tqkv__health_connect_ms(const tqkv_client_opts_t *o)
{
    if (o->connect_timeout_ms)
        return o->connect_timeout_ms > 0x7fffffffu ? 0x7fffffffu : o->connect_timeout_ms;
    return o->num_targets <= 1 && !o->resolve_targets ? 5000u
                                                      : TQKV_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS;
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

/* A probe round: the view, the targets probed and their calls. */
typedef struct probe {
    tqkv__health_t *h;
    tqkv_client_t *v;
    const size_t *tis;
    rpc_t *rs;
} probe_t;

/* Probe i ended: a down server that answered is usable again at once (not after the
 * round's slowest probe); one that did not gets fresh channels. */
static void
probe_ended(void *arg, size_t i)
{
    probe_t *p = arg;
    target_t *t = p->v->t[p->tis[i]];
    atomic_fetch_add(&p->h->probes, 1);
    if (p->rs[i].status_done && p->rs[i].status == GRPC_STATUS_OK) {
        tqkv_shard_health_ok(&t->health, p->v->backoff_min);
        atomic_fetch_add(&p->h->revived, 1);
    } else {
        tqkv__renew_channels(p->v, t, 1000000000ull); /* at most once a second */
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
    ProtobufCMessage **reqs = malloc(v.nt * sizeof *reqs);
    tqkv_status_t *sts = malloc(v.nt * sizeof *sts);
    Grpc__Health__V1__HealthCheckRequest m;
    grpc__health__v1__health_check_request__init(&m);
    m.service = "";
    if (tis == NULL || rs == NULL || reqs == NULL || sts == NULL)
        goto out;
    for (size_t i = 0; i < v.nt; i++)
        if (tqkv_shard_health_is_down(&v.t[i]->health))
            reqs[n] = &m.base, tis[n++] = i;
    if (n == 0)
        goto out;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    gpr_timespec dl = tqkv__deadline_after(h->deadline_ms);
    probe_t p = {h, &v, tis, rs};
    size_t live = tqkv__unary_start(&v, cq, rs, n, tis, M_HEALTH, reqs, dl, sts);
    for (size_t i = 0; i < n; i++)
        if (rs[i].inflight == 0)
            probe_ended(&p, i); /* could not start */
    tqkv__unary_wait(cq, rs, live, NULL, NULL, probe_ended, &p);
    for (size_t i = 0; i < n; i++)
        tqkv__rpc_fini(&rs[i]);
    tqkv__cq_destroy(cq);
out:
    free(tis);
    free(rs);
    free(reqs);
    free(sts);
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
        struct timespec ts = tqkv_clock_deadline(wait_ms);
        pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

tqkv_status_t
tqkv__health_start(tqkv_client_t *c, const tqkv_client_opts_t *o, tqkv__health_t **out)
{
    *out = NULL;
    c->call_base_ms = o->call_base_ms ? o->call_base_ms : TQKV_CLIENT_DEFAULT_CALL_BASE_MS;
    c->call_floor_mb_s =
        o->call_floor_mb_s ? o->call_floor_mb_s : TQKV_CLIENT_DEFAULT_CALL_FLOOR_MB_S;
    c->hedge_min_ms = o->hedge_min_ms ? o->hedge_min_ms : TQKV_CLIENT_DEFAULT_HEDGE_MIN_MS;
    c->hedge_max_ms = o->hedge_max_ms ? o->hedge_max_ms : TQKV_CLIENT_DEFAULT_HEDGE_MAX_MS;
    if (c->hedge_max_ms < c->hedge_min_ms)
        c->hedge_max_ms = c->hedge_min_ms;
    c->hedge = !o->no_hedge;
    if (o->probe_interval_ms == UINT32_MAX)
        return TQKV_OK; /* no prober: failed servers back off as before */
    tqkv__health_t *h = calloc(1, sizeof *h);
    if (h == NULL)
        return TQKV_ENOMEM;
    h->c = c;
    h->interval_ms =
        o->probe_interval_ms ? o->probe_interval_ms : TQKV_CLIENT_DEFAULT_PROBE_INTERVAL_MS;
    uint32_t ka = tqkv__health_keepalive_ms(o);
    uint64_t kt = o->keepalive_timeout_ms ? o->keepalive_timeout_ms
                                          : TQKV_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS;
    uint64_t dms = ka == UINT32_MAX ? h->interval_ms : (uint64_t)ka + kt;
    h->deadline_ms = dms < h->interval_ms ? h->interval_ms : dms > 60000 ? 60000 : (uint32_t)dms;
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

/* ---- per-call deadlines and hedging ---- */

gpr_timespec
tqkv__deadline_at_ns(uint64_t at_ns)
{
    uint64_t now = tqkv_clock_ns();
    int64_t left = at_ns > now ? (int64_t)(at_ns - now) : 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_nanos(left, GPR_TIMESPAN));
}

uint64_t
tqkv__call_deadline(const tqkv_client_t *c, uint64_t bytes, uint64_t op_dl_ns, gpr_timespec *dl,
                    int *is_short)
{
    uint64_t at = op_dl_ns;
    *is_short = 0;
    if (c->nt > 1 && c->call_base_ms != UINT32_MAX && c->call_floor_mb_s > 0) {
        /* MB/s * 1000 = bytes per ms */
        uint64_t ms = (uint64_t)c->call_base_ms + bytes / ((uint64_t)c->call_floor_mb_s * 1000u);
        uint64_t size_at = tqkv_clock_ns() + ms * 1000000ull;
        if (size_at < op_dl_ns) {
            at = size_at;
            *is_short = 1;
        }
    }
    *dl = tqkv__deadline_at_ns(at);
    return at;
}

uint64_t
tqkv__page_estimate(const tqkv_client_t *c)
{
    uint64_t m = c->sh ? atomic_load_explicit(&c->sh->page_max, memory_order_relaxed) : 0;
    return m ? m : 1u << 20;
}

void
tqkv__page_seen(tqkv_client_t *c, uint64_t bytes)
{
    if (c->sh == NULL)
        return;
    uint64_t m = atomic_load_explicit(&c->sh->page_max, memory_order_relaxed);
    while (bytes > m && !atomic_compare_exchange_weak(&c->sh->page_max, &m, bytes)) {
    }
}

void
tqkv__lat_record(tqkv_client_t *c, size_t ti, uint64_t ns)
{
    target_t *t = c->t[ti];
    uint64_t us = ns / 1000u;
    uint32_t i = atomic_fetch_add_explicit(&t->lat_n, 1, memory_order_relaxed);
    atomic_store_explicit(&t->lat_us[i % TQKV__LAT_N], us > UINT32_MAX ? UINT32_MAX : (uint32_t)us,
                          memory_order_relaxed);
}

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

uint64_t
tqkv__hedge_delay_ns(const tqkv_client_t *c, size_t ti)
{
    target_t *t = c->t[ti];
    uint32_t n = atomic_load_explicit(&t->lat_n, memory_order_relaxed);
    uint64_t ms = c->hedge_max_ms;
    if (n >= 8) {
        uint32_t v[TQKV__LAT_N];
        uint32_t k = n < TQKV__LAT_N ? n : TQKV__LAT_N;
        for (uint32_t i = 0; i < k; i++)
            v[i] = atomic_load_explicit(&t->lat_us[i], memory_order_relaxed);
        qsort(v, k, sizeof v[0], cmp_u32);
        uint64_t p95_us = v[(k * 95 + 99) / 100 - 1];
        uint64_t p95_ms = (p95_us + 999) / 1000;
        ms = p95_ms < c->hedge_min_ms   ? c->hedge_min_ms
             : p95_ms > c->hedge_max_ms ? c->hedge_max_ms
                                        : p95_ms;
    }
    return ms * 1000000ull;
}

void
tqkv__hedge_stats(const tqkv_client_t *c, tqkv__hedge_stats_t *out)
{
    memset(out, 0, sizeof *out);
    if (c == NULL || c->sh == NULL)
        return;
    out->hedges = atomic_load(&c->sh->hedges);
    out->hedge_pages = atomic_load(&c->sh->hedge_pages);
    out->call_timeouts = atomic_load(&c->sh->call_timeouts);
}
