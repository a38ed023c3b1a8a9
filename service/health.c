/* health.c - grpc.health.v1.Health: Check (unary) and Watch (server streaming).
 *
 * Services: "" (the whole server) and "tqkv.v1.KVCache". Check of another name is
 * NOT_FOUND; Watch of another name sends SERVICE_UNKNOWN and stays open.
 *
 * Locking: srv->health_mu protects health_status[], the watcher list and each
 * watcher's watch_idle. An idle watcher holds a reserved TAG_WAKE; whoever clears
 * watch_idle (the notifier, or the watcher's own worker when the call closes) fires
 * it, exactly once, under the lock, so no two threads start batches on one call.
 */
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "service/log.h"
#include "service/service_internal.h"
#include "transport/wire.h"

#define SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define SERVICE_UNKNOWN GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN

static const char *const services[TQKV__HEALTH_SERVICES] = {"", "tqkv.v1.KVCache"};

typedef struct watch_state {
    int service;   /* index into services, -1 unknown */
    int last_sent; /* last status sent, -1 none */
} watch_state_t;

void
tqkv__health_init(tqkv_server_t *s)
{
    pthread_mutex_init(&s->health_mu, NULL);
    for (int i = 0; i < TQKV__HEALTH_SERVICES; i++)
        s->health_status[i] = SERVING;
    s->watchers = NULL;
}

static int
service_index(const char *name)
{
    for (int i = 0; i < TQKV__HEALTH_SERVICES; i++)
        if (strcmp(name ? name : "", services[i]) == 0)
            return i;
    return -1;
}

void
tqkv__health_set_all(tqkv_server_t *s, int status)
{
    pthread_mutex_lock(&s->health_mu);
    for (int i = 0; i < TQKV__HEALTH_SERVICES; i++)
        s->health_status[i] = status;
    for (tqkv__call_t *c = s->watchers; c; c = c->watch_next) {
        if (c->watch_idle) {
            c->watch_idle = 0;
            tqkv__call_wake(c);
        }
    }
    pthread_mutex_unlock(&s->health_mu);
}

static Grpc__Health__V1__HealthCheckRequest *
decode_request(tqkv__call_t *c)
{
    if (c->recv_bb == NULL)
        return NULL;
    return (Grpc__Health__V1__HealthCheckRequest *)tqkv_wire_decode(
        &grpc__health__v1__health_check_request__descriptor, c->recv_bb);
}

static grpc_byte_buffer *
encode_status(int status)
{
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    return tqkv_wire_encode(&r.base);
}

static void
check_start(tqkv__call_t *c)
{
    Grpc__Health__V1__HealthCheckRequest *req = decode_request(c);
    if (req == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "message: not a valid HealthCheckRequest", NULL);
        return;
    }
    int i = service_index(req->service);
    if (i < 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "service: unknown service '%.200s'", req->service);
        tqkv__call_finish(c, GRPC_STATUS_NOT_FOUND, msg, NULL);
    } else {
        pthread_mutex_lock(&c->srv->health_mu);
        int status = c->srv->health_status[i];
        pthread_mutex_unlock(&c->srv->health_mu);
        tqkv__call_finish(c, GRPC_STATUS_OK, NULL, encode_status(status));
    }
    grpc__health__v1__health_check_request__free_unpacked(req, NULL);
}

const tqkv__handler_t tqkv__health_check_handler = {
    .path = "/grpc.health.v1.Health/Check",
    .metric = "Health.Check",
    .payload_on_new = 1,
    .drain = 0,
    .on_start = check_start,
};

/* Current status of the watched service (lock held). */
static int
do_current(tqkv__call_t *c)
{
    watch_state_t *h = c->h;
    return h->service < 0 ? SERVICE_UNKNOWN : c->srv->health_status[h->service];
}

/* Sends the current status if it changed, else goes idle. */
static void
watch_step(tqkv__call_t *c)
{
    watch_state_t *h = c->h;
    tqkv_server_t *s = c->srv;
    pthread_mutex_lock(&s->health_mu);
    int cur = do_current(c);
    if (cur != h->last_sent) {
        pthread_mutex_unlock(&s->health_mu);
        h->last_sent = cur;
        grpc_byte_buffer *bb = encode_status(cur);
        if (bb == NULL) {
            tqkv__call_finish(c, GRPC_STATUS_INTERNAL, "response encoding failed", NULL);
            return;
        }
        tqkv__call_send(c, bb);
        return;
    }
    tqkv__call_set_state(c, TQKV__CS_IDLE);
    tqkv__call_reserve_wake(c);
    c->watch_idle = 1;
    pthread_mutex_unlock(&s->health_mu);
}

static void
watch_unlink(tqkv__call_t *c)
{
    tqkv_server_t *s = c->srv;
    pthread_mutex_lock(&s->health_mu);
    if (c->watch_prev)
        c->watch_prev->watch_next = c->watch_next;
    else if (s->watchers == c)
        s->watchers = c->watch_next;
    if (c->watch_next)
        c->watch_next->watch_prev = c->watch_prev;
    c->watch_next = c->watch_prev = NULL;
    pthread_mutex_unlock(&s->health_mu);
}

static void
watch_start(tqkv__call_t *c)
{
    Grpc__Health__V1__HealthCheckRequest *req = decode_request(c);
    if (req == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "message: not a valid HealthCheckRequest", NULL);
        return;
    }
    watch_state_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        grpc__health__v1__health_check_request__free_unpacked(req, NULL);
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    h->service = service_index(req->service);
    h->last_sent = -1;
    grpc__health__v1__health_check_request__free_unpacked(req, NULL);
    c->h = h;
    tqkv_server_t *s = c->srv;
    pthread_mutex_lock(&s->health_mu);
    c->watch_next = s->watchers;
    c->watch_prev = NULL;
    if (s->watchers)
        s->watchers->watch_prev = c;
    s->watchers = c;
    pthread_mutex_unlock(&s->health_mu);
    watch_step(c);
}

static void
watch_sent(tqkv__call_t *c, int ok)
{
    watch_step(c);
}

static void
watch_wake(tqkv__call_t *c)
{
    if (c->closed) {
        tqkv__call_abort(c);
        return;
    }
    watch_step(c);
}

static void
watch_close(tqkv__call_t *c)
{
    tqkv_server_t *s = c->srv;
    pthread_mutex_lock(&s->health_mu);
    if (c->watch_idle) {
        c->watch_idle = 0;
        tqkv__call_wake(c);
    }
    pthread_mutex_unlock(&s->health_mu);
}

static void
watch_free(tqkv__call_t *c)
{
    watch_unlink(c);
    free(c->h);
    c->h = NULL;
}

const tqkv__handler_t tqkv__health_watch_handler = {
    .path = "/grpc.health.v1.Health/Watch",
    .metric = "Health.Watch",
    .payload_on_new = 1,
    .drain = 0,
    .on_start = watch_start,
    .on_send = watch_sent,
    .on_wake = watch_wake,
    .on_close = watch_close,
    .on_free = watch_free,
};
