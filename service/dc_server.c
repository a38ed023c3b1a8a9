/* dc_server.c - the server side of TCP data channels: Get page bytes over a plain TCP connection
 * instead of HTTP/2 frames (docs/design.md, "TCP data channel"; formats in
 * transport/data_frame.h).
 *
 * OpenChannel(transport = TCP) registers a channel {id, 16-byte secret, owner = the
 * caller's bearer token}. The client connects to --data-listen and sends a
 * hello; a connection thread checks it (5 s to arrive, secret compared in constant
 * time, one connection per channel; unattached channels expire after 30 s) and then
 * serves that channel's Gets: a Get with transport TCP (TQKV__M_GET_TCP, switched to
 * by the Get dispatch in handlers_channel.c) is validated and authorized on its worker
 * like any Get, then handed to the channel's thread as a job (the call waits in
 * CS_WORK with a reserved TAG_WAKE). The thread pins each page, writes its frame
 * header and the page itself with one sendmsg (no copy in user space), unpins it, and
 * fires the wake after the last frame; the worker then sends the status. A job that
 * fails, is cancelled, or whose write fails closes the channel (the client can no
 * longer tell where frames end); so do CloseChannel and a client that closes its end.
 *
 * Lifetime: a channel is freed when its last reference goes (registry, connection
 * thread, each Get holding it); only then is its socket closed, so shutdown() from
 * another thread never hits a reused descriptor. dc->mu guards the registry and every
 * channel's busy/job/attached fields.
 */
#define _GNU_SOURCE
#include "service/dc_server.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/data_frame.h"
#include "transport/dc_tls.h"

#define NERR 320
#define MAX_CHANNELS 256u     /* registered channels, server-wide */
#define MAX_CONN_THREADS 320u /* connection threads (attached + saying hello) */
#define HELLO_TIMEOUT_MS 5000 /* a connection has this long to send its hello */
#define ATTACH_TIMEOUT_S 30.0 /* an unattached channel expires after this */
#define NO_DC "TCP data channels not enabled on this server (start it with --data-listen HOST:PORT)"

typedef struct dc_job {
    tqkv__call_t *c;
    const Tqkv__V1__GetRequest *req;
    atomic_int cancel;
    grpc_status_code code;
    char msg[NERR];
    uint64_t hits, misses;
} dc_job_t;

typedef struct dchan {
    uint64_t id;
    uint8_t secret[TQKV_DC_SECRET_BYTES];
    char *owner; /* bearer token of the opener (NULL: none) */
    size_t owner_len;
    double created;
    int fd;   /* attached connection, -1 before; closed when freed */
    SSL *ssl; /* its TLS session (server with --tls-cert), NULL for plain TCP */
    int efd;  /* eventfd: a job or a stop for the connection thread */
    int attached, busy, registered;
    atomic_int dead;
    int refs;
    dc_job_t *job;
    struct dchan *next;
} dchan_t;

struct tqkv__dc {
    tqkv_server_t *srv;
    int lfd, port;
    pthread_t acceptor;
    int accepting;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dchan_t *chans;
    unsigned nchans, threads;
    int closing;
    SSL_CTX *tls; /* data channels are TLS when the server has --tls-cert; else NULL */
};

/* ---- channel references (dc->mu held) ---- */

static void
chan_free(dchan_t *ch)
{
    tqkv__dctls_free(ch->ssl);
    if (ch->fd >= 0)
        close(ch->fd);
    if (ch->efd >= 0)
        close(ch->efd);
    free(ch->owner);
    free(ch);
}

static void
chan_unref_locked(tqkv__dc_t *dc, dchan_t *ch)
{
    if (--ch->refs == 0)
        chan_free(ch);
    pthread_cond_broadcast(&dc->cv);
}

static void
chan_unregister_locked(tqkv__dc_t *dc, dchan_t *ch)
{
    if (!ch->registered)
        return;
    for (dchan_t **p = &dc->chans; *p; p = &(*p)->next) {
        if (*p == ch) {
            *p = ch->next;
            break;
        }
    }
    ch->registered = 0;
    dc->nchans--;
    tqkv_metrics_data_channels(dc->srv->metrics, -1);
    chan_unref_locked(dc, ch);
}

/* Marks ch dead and wakes whatever blocks on it (its thread in poll or sendmsg). */
static void
chan_kill_locked(dchan_t *ch)
{
    atomic_store(&ch->dead, 1);
    if (ch->fd >= 0)
        shutdown(ch->fd, SHUT_RDWR);
    uint64_t one = 1;
    if (ch->efd >= 0 && write(ch->efd, &one, sizeof one) < 0) {
        /* the counter is only a wake-up: a full counter already wakes */
    }
}

static dchan_t *
chan_find_locked(tqkv__dc_t *dc, uint64_t id)
{
    for (dchan_t *ch = dc->chans; ch; ch = ch->next)
        if (ch->id == id)
            return ch;
    return NULL;
}

/* The caller's bearer token (what owns a channel), or NULL. */
static const char *
call_token(const tqkv__call_t *c, size_t *len)
{
    const char *tok;
    if (tqkv_auth_bearer_token(c->authz, c->authz_len, &tok, len) != 0)
        return NULL;
    return tok;
}

static int
owner_matches(const dchan_t *ch, const tqkv__call_t *c)
{
    if (c->srv->auth == NULL)
        return 1;
    size_t n;
    const char *tok = call_token(c, &n);
    if (ch->owner == NULL || tok == NULL || ch->owner_len != n)
        return 0;
    unsigned char diff = 0; /* constant time: a token is a secret */
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(ch->owner[i] ^ tok[i]);
    return diff == 0;
}

/* ---- the job: frames of one Get ---- */

/* Writes iov whole on ch's connection (TLS or plain); blocks until done or the
 * connection is shut down. */
static int
chan_write(dchan_t *ch, struct iovec *iov, int n)
{
    tqkv__dcio_t io = {ch->fd, ch->ssl};
    return tqkv__dcio_write(&io, iov, n, 0);
}

static void job_fail(dc_job_t *j, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void
job_fail(dc_job_t *j, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->msg, sizeof j->msg, fmt, ap);
    va_end(ap);
    j->code = code;
}

static void
run_job(tqkv_server_t *s, dchan_t *ch, dc_job_t *j)
{
    const Tqkv__V1__GetRequest *q = j->req;
    size_t nh = q->n_hashes, total = (size_t)(q->layer_end - q->layer_begin) * nh;
    size_t nsl = strlen(q->namespace_);
    /* Disk-only pages: read on this connection thread (never on an RPC thread), pinned
     * from the first one on (tqkv_store_pin_disk_start), so each is read once; each is
     * sent as soon as its own read is done, while the later ones are still read; a new
     * round at the next disk-only block past the previous round's byte budget. */
    tqkv_store_pins_t *pins = NULL;
    const uint8_t **hp = malloc((nh + 1) * sizeof(*hp));
    size_t *hl = malloc((nh + 1) * sizeof(*hl));
    for (size_t i = 0; hp && hl && i < nh; i++) {
        hp[i] = q->hashes[i].data;
        hl[i] = q->hashes[i].len;
    }
    j->code = GRPC_STATUS_OK;
    /* Not a peer's ask: the blocks this server owns but lacks (and, for a client that did
     * not shard itself, those a peer owns) are copied from the peers first, on this
     * thread, as a gRPC Get does (forward.h, tqkv__fwd_get_copy); a failure leaves them
     * missing. */
    tqkv__fwd_t *fw = tqkv__fwd_get(s);
    if (fw && hp && hl && !atomic_load(&j->cancel) &&
        tqkv__fwd_get_copy(fw, j->c->hop, j->c->authz, q->namespace_, hp, hl, nh, q->layer_begin,
                           q->layer_end))
        atomic_fetch_add(&s->forwarded, 1);
    for (size_t i = 0; i < total; i++) {
        if (atomic_load(&j->cancel)) {
            job_fail(j, GRPC_STATUS_CANCELLED, "Get cancelled");
            break;
        }
        uint32_t layer = q->layer_begin + (uint32_t)(i / nh);
        const ProtobufCBinaryData *hash = &q->hashes[i % nh];
        tqkv_block_key_t key = {q->namespace_, nsl, hash->data, hash->len, layer};
        tqkv_page_ref_t *ref = NULL;
        int miss = 0;
        tqkv_status_t st = TQKV_OK;
        if ((ref = tqkv_store_pins_take(pins, i, &miss)) == NULL)
            st = miss ? TQKV_ENOTFOUND : tqkv_store_get_cached(s->store, &key, &ref);
        if (st == TQKV_EBUSY && hp && hl) {
            tqkv_store_pins_free(pins);
            pins = NULL;
            (void)tqkv_store_pin_disk_start(s->store, q->namespace_, nsl, hp, hl, nh,
                                            q->layer_begin, q->layer_end, i, &pins);
            if ((ref = tqkv_store_pins_take(pins, i, &miss)) != NULL)
                st = TQKV_OK;
            else if (miss)
                st = TQKV_ENOTFOUND;
        }
        if (st == TQKV_EBUSY) /* evicted from DRAM meanwhile, or no memory: read it here */
            st = tqkv_store_get(s->store, &key, &ref);
        uint8_t hdr[TQKV_DC_FRAME_BYTES];
        tqkv_dc_frame_t f = {(uint32_t)i, layer, 0, 0, 0};
        struct iovec iov[2];
        int n = 1;
        if (st == TQKV_ENOTFOUND) {
            j->misses++;
        } else if (st != TQKV_OK) {
            job_fail(j, tqkv_status_to_grpc(st), "layer %u, hashes[%zu]: %s", layer, i % nh,
                     tqkv_strerror(st));
            break;
        } else {
            j->hits++;
            size_t len = tqkv_page_ref_len(ref);
            if (len > UINT32_MAX) {
                tqkv_page_ref_release(ref);
                job_fail(j, GRPC_STATUS_INTERNAL, "layer %u, hashes[%zu]: page of %zu bytes", layer,
                         i % nh, len);
                break;
            }
            f.flags = TQKV_DC_FLAG_FOUND;
            f.tier = (uint32_t)tqkv_page_ref_tier(ref);
            f.page_len = (uint32_t)len;
            iov[1].iov_base = (void *)tqkv_page_ref_data(ref);
            iov[1].iov_len = len;
            n = 2;
            tqkv_page_header_t ph;
            memcpy(&ph, iov[1].iov_base, sizeof ph);
            uint64_t bf = (uint64_t)ph.num_tokens * ph.num_kv_heads * ph.head_dim * 2 *
                          ((ph.tensor[0].bits_x2 != 0) + (ph.tensor[1].bits_x2 != 0));
            tqkv_metrics_add_bytes(s->metrics, 0, len, bf);
        }
        tqkv_dc_frame_encode(hdr, &f);
        iov[0].iov_base = hdr;
        iov[0].iov_len = sizeof hdr;
        int rc = chan_write(ch, iov, n);
        int e = errno;
        if (ref)
            tqkv_page_ref_release(ref);
        if (rc != 0) {
            if (atomic_load(&j->cancel))
                job_fail(j, GRPC_STATUS_CANCELLED, "Get cancelled");
            else if (atomic_load(&ch->dead))
                job_fail(j, GRPC_STATUS_UNAVAILABLE,
                         "data channel %llu closed during the Get (CloseChannel, server stop, or "
                         "the client closed its connection)",
                         (unsigned long long)ch->id);
            else
                job_fail(j, GRPC_STATUS_UNAVAILABLE, "data channel %llu: write failed: %s",
                         (unsigned long long)ch->id, strerror(e));
            break;
        }
    }
    tqkv_store_pins_free(pins);
    free(hp);
    free(hl);
}

/* ---- connection threads ---- */

typedef struct conn_arg {
    tqkv__dc_t *dc;
    int fd;
} conn_arg_t;

/* Checks the hello (read by deadline_ns) and attaches io to its channel. Returns the
 * channel (a reference for this thread; it owns io's session from then on) or NULL;
 * *status is the ack to send. */
static dchan_t *
attach(tqkv__dc_t *dc, tqkv__dcio_t *io, uint64_t deadline_ns, uint32_t *status)
{
    uint8_t in[TQKV_DC_HELLO_BYTES], secret[TQKV_DC_SECRET_BYTES];
    uint64_t id;
    *status = TQKV_DC_ACK_BAD;
    if (tqkv__dcio_read(io, in, sizeof in, deadline_ns) != 0 ||
        tqkv_dc_hello_decode(in, &id, secret) != 0)
        return NULL;
    *status = TQKV_DC_ACK_UNKNOWN;
    pthread_mutex_lock(&dc->mu);
    dchan_t *ch = chan_find_locked(dc, id);
    if (ch != NULL) {
        uint8_t diff = 0;
        for (int i = 0; i < TQKV_DC_SECRET_BYTES; i++)
            diff |= (uint8_t)(ch->secret[i] ^ secret[i]);
        if (diff != 0 || atomic_load(&ch->dead)) {
            ch = NULL;
        } else if (ch->attached) {
            *status = TQKV_DC_ACK_ATTACHED;
            ch = NULL;
        } else if (tqkv_clock_s() - ch->created > ATTACH_TIMEOUT_S) {
            /* expired: OpenChannel reaps such channels only when it runs */
            chan_kill_locked(ch);
            chan_unregister_locked(dc, ch);
            ch = NULL;
        } else {
            ch->attached = 1;
            ch->fd = io->fd;
            ch->ssl = io->ssl;
            ch->refs++;
            *status = TQKV_DC_ACK_OK;
        }
    }
    pthread_mutex_unlock(&dc->mu);
    return ch;
}

static void *
conn_main(void *arg)
{
    conn_arg_t a = *(conn_arg_t *)arg;
    free(arg);
    tqkv__dc_t *dc = a.dc;
    uint32_t status = TQKV_DC_ACK_BAD;
    uint64_t deadline = tqkv_clock_ns() + HELLO_TIMEOUT_MS * 1000000ull;
    tqkv__dcio_t io = {a.fd, NULL};
    dchan_t *ch = NULL;
    int handshake_ok = 1;
    pthread_mutex_lock(&dc->mu); /* the context a reload may swap: this connection's own ref */
    SSL_CTX *tls = dc->tls;
    if (tls)
        SSL_CTX_up_ref(tls);
    pthread_mutex_unlock(&dc->mu);
    if (tls) {
        /* The handshake and the hello share the hello's time limit. A client without a
         * certificate the client CA accepts (mutual TLS) ends here: no ack at all. */
        char err[256];
        int fl = fcntl(a.fd, F_GETFL);
        fcntl(a.fd, F_SETFL, fl | O_NONBLOCK);
        io.ssl = tqkv__dctls_handshake(tls, a.fd, NULL, deadline, err, sizeof err);
        SSL_CTX_free(tls); /* the session holds its own reference */
        if (io.ssl == NULL) {
            handshake_ok = 0;
            tqkv_log(TQKV_LOG_DEBUG, "data channel TLS handshake failed", "reason=\"%s\"", err);
            tqkv_metrics_data_channel_handshake_failed(dc->srv->metrics);
        }
    }
    if (handshake_ok)
        ch = attach(dc, &io, deadline, &status);
    uint8_t ack[TQKV_DC_ACK_BYTES];
    tqkv_dc_ack_encode(ack, status);
    struct iovec iov = {ack, sizeof ack};
    if (ch == NULL) {
        if (handshake_ok)
            (void)tqkv__dcio_write(&io, &iov, 1, deadline);
        tqkv__dctls_free(io.ssl);
        close(a.fd);
        pthread_mutex_lock(&dc->mu);
        dc->threads--;
        pthread_cond_broadcast(&dc->cv);
        pthread_mutex_unlock(&dc->mu);
        return NULL;
    }
    if (chan_write(ch, &iov, 1) != 0)
        atomic_store(&ch->dead, 1);
    if (io.ssl) {
        /* Which record layer the channel's bytes go through: the first one at info. */
        static atomic_int told;
        char path[48];
        const char *ver, *cipher;
        tqkv__dctls_path(io.ssl, path, sizeof path);
        tqkv__dctls_describe(io.ssl, &ver, &cipher);
        tqkv_log(atomic_exchange(&told, 1) ? TQKV_LOG_DEBUG : TQKV_LOG_INFO, "data channel TLS",
                 "channel=%llu path=\"%s\" version=%s cipher=%s", (unsigned long long)ch->id, path,
                 ver, cipher);
    }
    int one = 1;
    setsockopt(a.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (!atomic_load(&ch->dead)) {
        struct pollfd pf[2] = {{a.fd, POLLIN | POLLRDHUP, 0}, {ch->efd, POLLIN, 0}};
        int pr = poll(pf, 2, -1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0)
            break;
        if (pf[0].revents)
            break; /* the client sends nothing after its hello: it closed, or broke the rules */
        if (pf[1].revents & POLLIN) {
            uint64_t v;
            if (read(ch->efd, &v, sizeof v) < 0) {
                /* EAGAIN: raced with another wake */
            }
            pthread_mutex_lock(&dc->mu);
            dc_job_t *j = ch->job;
            pthread_mutex_unlock(&dc->mu);
            if (j == NULL)
                continue;
            run_job(dc->srv, ch, j);
            pthread_mutex_lock(&dc->mu);
            ch->job = NULL;
            ch->busy = 0;
            if (j->code != GRPC_STATUS_OK)
                chan_kill_locked(ch); /* the client cannot tell where the frames stopped */
            pthread_mutex_unlock(&dc->mu);
            tqkv__call_wake(j->c);
        }
    }
    pthread_mutex_lock(&dc->mu);
    chan_kill_locked(ch);
    dc_job_t *j = ch->job; /* handed over after the loop saw the channel dead */
    ch->job = NULL;
    ch->busy = 0;
    chan_unregister_locked(dc, ch);
    pthread_mutex_unlock(&dc->mu);
    if (j != NULL) {
        job_fail(j, GRPC_STATUS_UNAVAILABLE, "data channel %llu closed",
                 (unsigned long long)ch->id);
        tqkv__call_wake(j->c);
    }
    pthread_mutex_lock(&dc->mu);
    chan_unref_locked(dc, ch);
    dc->threads--;
    pthread_cond_broadcast(&dc->cv);
    pthread_mutex_unlock(&dc->mu);
    return NULL;
}

static void *
acceptor_main(void *arg)
{
    tqkv__dc_t *dc = arg;
    for (;;) {
        int fd = accept4(dc->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE ||
                errno == ENOBUFS || errno == ENOMEM) {
                if (errno != EINTR && errno != ECONNABORTED)
                    usleep(10000);
                pthread_mutex_lock(&dc->mu);
                int stop = !dc->accepting;
                pthread_mutex_unlock(&dc->mu);
                if (stop)
                    break;
                continue;
            }
            break; /* shut down */
        }
        pthread_mutex_lock(&dc->mu);
        int ok = dc->accepting && dc->threads < MAX_CONN_THREADS;
        if (ok)
            dc->threads++;
        pthread_mutex_unlock(&dc->mu);
        conn_arg_t *a = ok ? malloc(sizeof *a) : NULL;
        pthread_t th;
        pthread_attr_t at;
        if (a != NULL) {
            a->dc = dc;
            a->fd = fd;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&th, &at, conn_main, a) != 0) {
                free(a);
                a = NULL;
            }
            pthread_attr_destroy(&at);
        }
        if (a == NULL) {
            close(fd);
            if (ok) {
                pthread_mutex_lock(&dc->mu);
                dc->threads--;
                pthread_cond_broadcast(&dc->cv);
                pthread_mutex_unlock(&dc->mu);
            }
        }
    }
    return NULL;
}

/* ---- server life ---- */

tqkv_status_t
tqkv__dc_tls_reload(tqkv_server_t *s, char *err, size_t errlen)
{
    tqkv__dc_t *dc = s->dc;
    if (dc == NULL || !s->cfg.tls_cert[0])
        return TQKV_OK;
    SSL_CTX *fresh =
        tqkv__dctls_server_ctx(s->cfg.tls_cert, s->cfg.tls_key,
                               s->cfg.tls_client_ca[0] ? s->cfg.tls_client_ca : NULL, err, errlen);
    if (fresh == NULL)
        return TQKV_EINVAL;
    pthread_mutex_lock(&dc->mu);
    SSL_CTX *old = dc->tls;
    dc->tls = fresh;
    pthread_mutex_unlock(&dc->mu);
    SSL_CTX_free(old); /* connections already up keep theirs */
    return TQKV_OK;
}

tqkv_status_t
tqkv__dc_start(tqkv_server_t *s, const char *addr, char *err, size_t errlen)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || (size_t)(colon - addr) >= sizeof host) {
        snprintf(err, errlen, "--data-listen %s: expected HOST:PORT", addr);
        return TQKV_EINVAL;
    }
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    char *h = host;
    size_t hl = strlen(h);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h[hl - 1] = '\0';
        h++;
    }
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gr = getaddrinfo(h[0] ? h : NULL, colon + 1, &hints, &ai);
    if (gr != 0) {
        snprintf(err, errlen, "--data-listen %s: %s", addr, gai_strerror(gr));
        return TQKV_EINVAL;
    }
    int fd = -1, e = 0;
    for (struct addrinfo *p = ai; p; p = p->ai_next) {
        fd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, p->ai_addr, p->ai_addrlen) == 0 && listen(fd, 128) == 0)
            break;
        e = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        snprintf(err, errlen, "--data-listen %s: cannot bind: %s", addr, strerror(e));
        return TQKV_EIO;
    }
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    int port = 0;
    if (getsockname(fd, (struct sockaddr *)&sa, &sl) == 0)
        port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
                                        : ntohs(((struct sockaddr_in *)&sa)->sin_port);
    tqkv__dc_t *dc = calloc(1, sizeof *dc);
    if (dc == NULL) {
        close(fd);
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    dc->srv = s;
    dc->lfd = fd;
    dc->port = port;
    if (s->cfg.tls_cert[0]) {
        dc->tls = tqkv__dctls_server_ctx(s->cfg.tls_cert, s->cfg.tls_key,
                                         s->cfg.tls_client_ca[0] ? s->cfg.tls_client_ca : NULL, err,
                                         errlen);
        if (dc->tls == NULL) {
            close(fd);
            free(dc);
            return TQKV_EINVAL;
        }
    }
    tqkv_metrics_data_channel_path(s->metrics, dc->tls ? "openssl-tls1.3" : "plaintext");
    dc->accepting = 1;
    pthread_mutex_init(&dc->mu, NULL);
    pthread_cond_init(&dc->cv, NULL);
    if (pthread_create(&dc->acceptor, NULL, acceptor_main, dc) != 0) {
        close(fd);
        pthread_mutex_destroy(&dc->mu);
        pthread_cond_destroy(&dc->cv);
        SSL_CTX_free(dc->tls);
        free(dc);
        snprintf(err, errlen, "--data-listen: cannot start the acceptor thread");
        return TQKV_ENOMEM;
    }
    s->dc = dc;
    return TQKV_OK;
}

int
tqkv__dc_port(const tqkv_server_t *s)
{
    return s->dc ? s->dc->port : 0;
}

const char *
tqkv__dc_tls_summary(const tqkv_server_t *s)
{
    if (s->dc == NULL || s->dc->tls == NULL)
        return "off";
    /* kTLS needs the kernel's "tls" TCP ULP; each channel's path is logged as it attaches. */
    char ulp[256] = "";
    FILE *f = fopen("/proc/sys/net/ipv4/tcp_available_ulp", "r");
    if (f) {
        if (fgets(ulp, sizeof ulp, f) == NULL)
            ulp[0] = '\0';
        fclose(f);
    }
    char *save = NULL;
    for (char *t = strtok_r(ulp, " \n", &save); t; t = strtok_r(NULL, " \n", &save))
        if (!strcmp(t, "tls"))
            return "TLSv1.3, AES-128-GCM preferred, records: ktls (userspace where the kernel "
                   "declines a suite)";
    return "TLSv1.3, AES-128-GCM preferred, records: userspace (the kernel has no tls ULP)";
}

void
tqkv__dc_stop_accepting(tqkv_server_t *s)
{
    tqkv__dc_t *dc = s->dc;
    if (dc == NULL)
        return;
    pthread_mutex_lock(&dc->mu);
    int was = dc->accepting;
    dc->accepting = 0;
    pthread_mutex_unlock(&dc->mu);
    if (!was)
        return;
    shutdown(dc->lfd, SHUT_RDWR); /* accept() returns EINVAL */
    pthread_join(dc->acceptor, NULL);
    close(dc->lfd);
    dc->lfd = -1;
}

unsigned
tqkv__dc_destroy(tqkv_server_t *s, unsigned wait_ms)
{
    tqkv__dc_t *dc = s->dc;
    if (dc == NULL)
        return 0;
    tqkv__dc_stop_accepting(s);
    pthread_mutex_lock(&dc->mu);
    dc->closing = 1;
    while (dc->chans) {
        dchan_t *ch = dc->chans;
        chan_kill_locked(ch);
        chan_unregister_locked(dc, ch);
    }
    struct timespec ts = tqkv_clock_deadline(wait_ms);
    while (dc->threads > 0)
        if (pthread_cond_timedwait(&dc->cv, &dc->mu, &ts) == ETIMEDOUT)
            break;
    unsigned left = dc->threads;
    pthread_mutex_unlock(&dc->mu);
    if (left)
        return left; /* threads still use dc: leak it */
    pthread_mutex_destroy(&dc->mu);
    pthread_cond_destroy(&dc->cv);
    SSL_CTX_free(dc->tls);
    free(dc);
    s->dc = NULL;
    return 0;
}

/* ---- OpenChannel / CloseChannel (TCP) ---- */

void
tqkv__dc_open(tqkv__call_t *c)
{
    tqkv__dc_t *dc = c->srv->dc;
    if (dc == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, NO_DC, NULL);
        return;
    }
    dchan_t *ch = calloc(1, sizeof *ch);
    if (ch == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    ch->fd = -1;
    ch->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    ch->created = tqkv_clock_s();
    size_t tl = 0;
    const char *tok = call_token(c, &tl);
    if (tok != NULL) {
        ch->owner = malloc(tl);
        if (ch->owner)
            memcpy(ch->owner, tok, tl), ch->owner_len = tl;
    }
    uint8_t rnd[8 + TQKV_DC_SECRET_BYTES];
    if (ch->efd < 0 || (tok != NULL && ch->owner == NULL) ||
        getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
        chan_free(ch);
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED,
                          "cannot create a data channel (eventfd, memory or getrandom)", NULL);
        return;
    }
    memcpy(&ch->id, rnd, 8);
    memcpy(ch->secret, rnd + 8, TQKV_DC_SECRET_BYTES);
    pthread_mutex_lock(&dc->mu);
    /* expire channels nobody attached to */
    double now = ch->created;
    for (dchan_t *p = dc->chans, *nx; p; p = nx) {
        nx = p->next;
        if (!p->attached && now - p->created > ATTACH_TIMEOUT_S) {
            chan_kill_locked(p);
            chan_unregister_locked(dc, p);
        }
    }
    while (ch->id == 0 || chan_find_locked(dc, ch->id) != NULL)
        ch->id = ch->id * 6364136223846793005ull + 1442695040888963407ull;
    if (dc->closing || dc->nchans >= MAX_CHANNELS) {
        unsigned n = dc->nchans;
        pthread_mutex_unlock(&dc->mu);
        chan_free(ch);
        char msg[NERR];
        snprintf(msg, sizeof msg, "too many data channels open (%u; the limit is %u)", n,
                 MAX_CHANNELS);
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
        return;
    }
    ch->registered = 1;
    ch->refs = 1;
    tqkv_metrics_data_channels(dc->srv->metrics, 1);
    ch->next = dc->chans;
    dc->chans = ch;
    dc->nchans++;
    Tqkv__V1__OpenChannelResponse m = TQKV__V1__OPEN_CHANNEL_RESPONSE__INIT;
    m.channel_id = ch->id;
    m.data_port = (uint32_t)dc->port;
    m.data_tls = c->srv->cfg.tls_cert[0] != 0;
    uint8_t secret[TQKV_DC_SECRET_BYTES];
    memcpy(secret, ch->secret, sizeof secret);
    pthread_mutex_unlock(&dc->mu);
    m.channel_secret.data = secret;
    m.channel_secret.len = sizeof secret;
    tqkv__call_finish_msg(c, &m.base);
}

int
tqkv__dc_close(tqkv__call_t *c, uint64_t id)
{
    tqkv__dc_t *dc = c->srv->dc;
    if (dc == NULL)
        return 0;
    pthread_mutex_lock(&dc->mu);
    dchan_t *ch = chan_find_locked(dc, id);
    if (ch == NULL || !owner_matches(ch, c)) {
        pthread_mutex_unlock(&dc->mu);
        return 0;
    }
    chan_kill_locked(ch);
    chan_unregister_locked(dc, ch);
    pthread_mutex_unlock(&dc->mu);
    Tqkv__V1__CloseChannelResponse m = TQKV__V1__CLOSE_CHANNEL_RESPONSE__INIT;
    tqkv__call_finish_msg(c, &m.base);
    return 1;
}

/* ---- Get over a TCP data channel ---- */

typedef struct tget {
    Tqkv__V1__GetRequest *req;
    dchan_t *ch; /* a reference */
    int running; /* the job is the channel thread's (a wake is reserved) */
    dc_job_t job;
} tget_t;

static void
tget_start(tqkv__call_t *c)
{
    char err[NERR];
    tqkv__dc_t *dc = c->srv->dc;
    tget_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    c->h = h;
    if (tqkv__get_request_parse(c, &h->req) != 0) /* disk reads: in run_job */
        return;
    if (h->req->encoding != TQKV__V1__ENCODING__ENCODING_PACKED) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "encoding: the TCP data channel sends PACKED pages only", NULL);
        return;
    }
    if (dc == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, NO_DC, NULL);
        return;
    }
    pthread_mutex_lock(&dc->mu);
    dchan_t *ch = chan_find_locked(dc, h->req->channel_id);
    const char *why = NULL;
    if (ch == NULL || !owner_matches(ch, c))
        why = "no such open TCP data channel";
    else if (!ch->attached || atomic_load(&ch->dead))
        why = "TCP data channel not connected (send the hello first) or closed";
    else if (ch->busy)
        why = "TCP data channel busy: one Get at a time per channel";
    if (why) {
        pthread_mutex_unlock(&dc->mu);
        snprintf(err, sizeof err, "channel_id %llu: %s", (unsigned long long)h->req->channel_id,
                 why);
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, err, NULL);
        return;
    }
    ch->refs++;
    h->ch = ch;
    ch->busy = 1;
    h->job.c = c;
    h->job.req = h->req;
    ch->job = &h->job;
    h->running = 1;
    tqkv__call_reserve_wake(c);
    tqkv__call_set_state(c, TQKV__CS_WORK);
    uint64_t one = 1;
    if (write(ch->efd, &one, sizeof one) < 0) {
        /* a full counter wakes the thread as well */
    }
    pthread_mutex_unlock(&dc->mu);
}

static void
tget_wake(tqkv__call_t *c)
{
    tget_t *h = c->h;
    h->running = 0;
    if (c->state == TQKV__CS_DONE || c->state == TQKV__CS_STATUS)
        return;
    if (c->closed) {
        tqkv__call_abort(c);
        return;
    }
    const char *ns = h->req->namespace_;
    tqkv_metrics_ns_access(c->srv->metrics, ns, strlen(ns), h->job.hits, h->job.misses);
    tqkv__call_finish(c, h->job.code, h->job.code == GRPC_STATUS_OK ? NULL : h->job.msg, NULL);
}

static void
tget_close(tqkv__call_t *c)
{
    tget_t *h = c->h;
    if (h == NULL || !h->running || !c->cancelled)
        return;
    /* Cancelled or past its deadline while the thread writes: stop it (the write it may
     * block in fails once the socket is shut down). */
    atomic_store(&h->job.cancel, 1);
    tqkv__dc_t *dc = c->srv->dc;
    pthread_mutex_lock(&dc->mu);
    chan_kill_locked(h->ch);
    pthread_mutex_unlock(&dc->mu);
}

static void
tget_free(tqkv__call_t *c)
{
    tget_t *h = c->h;
    if (h == NULL)
        return;
    if (h->ch) {
        tqkv__dc_t *dc = c->srv->dc;
        pthread_mutex_lock(&dc->mu);
        chan_unref_locked(dc, h->ch);
        pthread_mutex_unlock(&dc->mu);
    }
    if (h->req)
        tqkv__v1__get_request__free_unpacked(h->req, NULL);
    free(h);
    c->h = NULL;
}

const tqkv__handler_t tqkv__get_tcp_handler = {
    .path = "/tqkv.v1.KVCache/Get",
    .metric = "Get",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = tget_start,
    .on_wake = tget_wake,
    .on_close = tget_close,
    .on_free = tget_free,
};
