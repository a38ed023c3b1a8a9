/* client_dc.c - libtqkv: the pool of TCP data channels of each target
 * (TQKV_CLIENT_TRANSPORT_TCP): opening one (OpenChannel + connect), reuse, and why a
 * target has none. Reading pages over a channel is in client_get.c. */
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/data_channel.h"

/* ---- TCP data channels (TQKV_CLIENT_TRANSPORT_TCP) ---- */

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
    atomic_store(&t->dc_retry_ns, tqkv_clock_ns() + DC_RETRY_NS);
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
        tqkv__dcio_t io = {d->fd, d->ssl};
        if (poll(&pf, 1, 0) == 0 && !tqkv__dcio_pending(&io))
            return d;
        SSL_free(d->ssl);
        close(d->fd); /* EOF, or bytes nobody asked for */
        free(d);
    }
}

/* A data channel for one Get to target ti, or NULL: ask over gRPC. A new one costs an
 * OpenChannel call and a connect, together within about setup_ms (> 0); channels are
 * kept for later Gets. */
dconn_t *
tqkv__dcc_acquire(tqkv_client_t *c, size_t ti, uint32_t setup_ms)
{
    target_t *t = c->t[ti];
    if (t->dc_off) {
        if (tqkv_clock_ns() < atomic_load(&t->dc_retry_ns))
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
    tqkv_client_error_t saved = tqkv__client_last_err;
    Tqkv__V1__OpenChannelRequest m;
    tqkv__v1__open_channel_request__init(&m);
    m.transport = TQKV__V1__TRANSPORT__TRANSPORT_TCP;
    ProtobufCMessage *rq = &m.base, *rs = NULL;
    tqkv_status_t st;
    uint64_t t0 = tqkv_clock_ns();
    tqkv__unary_fanout(c, 1, &ti, M_OPEN_CHANNEL, &rq, &tqkv__v1__open_channel_response__descriptor,
                       setup_ms, &rs, &st);
    if (st != TQKV_OK) {
        dc_disable(t, "OpenChannel: %s", tqkv__client_last_err.message);
        tqkv__client_last_err = saved;
        return NULL;
    }
    Tqkv__V1__OpenChannelResponse *r = (Tqkv__V1__OpenChannelResponse *)rs;
    int rc = -1;
    tqkv__dcio_t io = {-1, NULL};
    if (r->data_port == 0 || r->data_port > 65535 || r->channel_secret.len != TQKV_DC_SECRET_BYTES)
        snprintf(err, sizeof err, "OpenChannel: malformed answer (port %u, secret of %zu bytes)",
                 r->data_port, r->channel_secret.len);
    else if (c->dc_tls && !r->data_tls)
        /* Never send a TLS client's pages in the clear: gRPC it is. */
        snprintf(err, sizeof err,
                 "the server's data channels are unencrypted and this client uses TLS");
    else if (!c->dc_tls && r->data_tls)
        snprintf(err, sizeof err, "the server's data channels need TLS and this client has none");
    else {
        uint64_t spent_ms = (tqkv_clock_ns() - t0) / 1000000u;
        uint32_t left = spent_ms < setup_ms ? setup_ms - (uint32_t)spent_ms : 1;
        rc = tqkv__dcc_connect(host, r->data_port, r->channel_id, r->channel_secret.data,
                               left < DC_CONNECT_MS ? left : DC_CONNECT_MS, c->dc_tls, c->tls_name,
                               &io, err, sizeof err);
    }
    uint64_t id = r->channel_id;
    protobuf_c_message_free_unpacked(rs, NULL);
    tqkv__client_last_err = saved;
    if (rc != 0) {
        dc_disable(t, "%s", err);
        return NULL;
    }
    d = calloc(1, sizeof *d);
    if (d == NULL) {
        SSL_free(io.ssl);
        close(io.fd);
        return NULL;
    }
    d->fd = io.fd;
    d->ssl = io.ssl;
    d->id = id;
    return d;
}

/* Back to the pool when the Get ended in step with the server, else closed (the
 * server then drops the channel). */
void
tqkv__dcc_release(tqkv_client_t *c, size_t ti, dconn_t *d, int reuse)
{
    if (d == NULL)
        return;
    if (!reuse) {
        SSL_free(d->ssl);
        close(d->fd);
        free(d);
        return;
    }
    target_t *t = c->t[ti];
    pthread_mutex_lock(&t->dc_mu);
    d->next = t->dc_idle;
    t->dc_idle = d;
    pthread_mutex_unlock(&t->dc_mu);
}

static const char *data_channel_status_v(tqkv_client_t *c, size_t target);

const char *
tqkv_client_data_channel_status(tqkv_client_t *c, size_t target)
{
    if (c == NULL)
        return data_channel_status_v(NULL, target);
    tqkv_client_t v;
    const char *s = data_channel_status_v(tqkv__view_enter(c, &v), target);
    tqkv__view_leave(&v);
    return s;
}

static const char *
data_channel_status_v(tqkv_client_t *c, size_t target)
{
    static _Thread_local char buf[256];
    if (c == NULL || target >= c->nt)
        return "no such target";
    if (c->transport != TQKV_CLIENT_TRANSPORT_TCP)
        return "the client uses gRPC (transport TQKV_CLIENT_TRANSPORT_GRPC)";
    target_t *t = c->t[target];
    pthread_mutex_lock(&t->dc_mu);
    snprintf(buf, sizeof buf, "%s", t->dc_off ? t->dc_why : "");
    pthread_mutex_unlock(&t->dc_mu);
    return buf;
}
