/* check_client_crc.c - libtqkv's Get page CRC check against real tqkv-servers, with the
 * page bytes corrupted on the wire by an in-process TCP proxy (labels "server;fault").
 *
 * The proxy (one thread, poll over non-blocking sockets) passes client->server bytes
 * through untouched (the HTTP/2 preface included) and parses the server->client
 * direction: HTTP/2 frames (9-byte header; no TLS), and inside the DATA frames of each
 * stream the gRPC messages (5-byte prefix: compressed flag, 32-bit length). While armed it
 * flips one bit of every gRPC message longer than 1000 bytes at a message offset >= 400
 * and at least 64 bytes before its end: inside a GetResponse's page, past the protobuf
 * fields before it (hash <= 64 bytes, layer, found, the page's tag and length) and past
 * the 128-byte page header, and before the trailing shape fields. Tracking messages
 * rather than frames matters: a DATA frame often starts with the tail of one message,
 * so "offset 400 of the frame" can land in the next message's hash or page header.
 * Frame lengths are never changed, so HTTP/2 flow control is unaffected.
 *
 * The servers' stored pages are never touched: a disarmed Get through the same proxy
 * returns every page intact.
 */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "tests/check_main.h"
#include "transport/client_server.h"
#include "transport/shard.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

static uint64_t SEED;

/* Servers of the running test, stopped at exit too: a failed ck_assert exits the
 * forked test process without running the rest of the test. */
static srv_t *LIVE[4];

static void
stop_live(void)
{
    for (int i = 0; i < 4; i++)
        if (LIVE[i]) {
            srv_stop(LIVE[i]);
            LIVE[i] = NULL;
        }
}

static void
start_srv(srv_t *s)
{
    ck_assert_msg(srv_start(s, 0, NULL) == 0, "cannot start tqkv-server");
    for (int i = 0; i < 4; i++)
        if (LIVE[i] == NULL) {
            LIVE[i] = s;
            return;
        }
    ck_abort_msg("too many servers");
}

/* ---- the corrupting proxy ---- */

#define PX_BUF (256u << 10)
#define PX_STREAMS 32
#define PX_CONNS 32

/* gRPC message framing of one HTTP/2 stream (server->client). */
typedef struct px_stream {
    uint32_t id;     /* 0 = free */
    uint8_t pre[5];  /* the message prefix being read */
    uint32_t have;   /* prefix bytes read (5 = in the body) */
    uint64_t mlen;   /* body length */
    uint64_t pos;    /* body bytes seen */
    uint64_t target; /* body offset to flip, or UINT64_MAX */
    unsigned gen;    /* the proxy's arming generation when the stream was first seen */
    unsigned big;    /* messages > 1000 bytes seen on the stream */
} px_stream_t;

/* One direction of a proxied connection. */
typedef struct px_dir {
    int from, to;
    uint8_t *buf;
    size_t head, len; /* pending bytes [head, len) */
    int eof, shut, parse;
    /* HTTP/2 frame parser (parse = 1) */
    uint8_t fh[9];
    size_t fh_have;
    uint32_t f_rem, f_data_rem, f_sid;
    uint8_t f_type;
    int f_pad_pending;
    px_stream_t st[PX_STREAMS];
    size_t st_next;
} px_dir_t;

typedef struct px_conn {
    px_dir_t c2s, s2c;
} px_conn_t;

typedef struct proxy {
    int lfd, up_port, port;
    char addr[64];
    pthread_t th;
    atomic_int stop;
    pthread_mutex_t mu;  /* a flip, and arming or disarming, happen under it */
    atomic_int armed;    /* 1: flip big messages of the streams that began while armed */
    atomic_uint gen;     /* incremented by each px_arm */
    atomic_uint skip;    /* while armed: big messages of each stream to pass untouched */
    atomic_uint flips;   /* messages corrupted */
    atomic_uint big;     /* messages > 1000 bytes seen (armed or not) */
    atomic_uint accepts; /* connections accepted */
    px_conn_t *conns[PX_CONNS];
} proxy_t;

static px_stream_t *
px_stream(proxy_t *px, px_dir_t *d, uint32_t sid)
{
    for (size_t i = 0; i < PX_STREAMS; i++)
        if (d->st[i].id == sid)
            return &d->st[i];
    px_stream_t *s = &d->st[d->st_next++ % PX_STREAMS]; /* the oldest stream's slot */
    memset(s, 0, sizeof *s);
    s->id = sid;
    s->gen = atomic_load(&px->gen);
    return s;
}

/* DATA bytes p[0..n) of stream sid: follows the gRPC messages, flips when armed. */
static void
px_grpc(proxy_t *px, px_dir_t *d, uint32_t sid, uint8_t *p, size_t n)
{
    px_stream_t *s = px_stream(px, d, sid);
    while (n > 0) {
        if (s->have < 5) {
            s->pre[s->have++] = *p++;
            n--;
            if (s->have == 5) {
                s->mlen = (uint64_t)s->pre[1] << 24 | (uint64_t)s->pre[2] << 16 |
                          (uint64_t)s->pre[3] << 8 | s->pre[4];
                s->pos = 0;
                s->target = UINT64_MAX;
                if (s->mlen > 1000) {
                    unsigned k = atomic_fetch_add(&px->big, 1);
                    /* a stream of an earlier arming (a cancelled Get's tail) is left alone */
                    if (atomic_load(&px->armed) && s->gen == atomic_load(&px->gen) &&
                        s->big++ >= atomic_load(&px->skip))
                        s->target = 400 + (uint64_t)k * 7919u % (s->mlen - 464); /* spread */
                }
                if (s->mlen == 0)
                    s->have = 0;
            }
            continue;
        }
        size_t take = (uint64_t)n < s->mlen - s->pos ? n : (size_t)(s->mlen - s->pos);
        if (s->target >= s->pos && s->target < s->pos + take) {
            /* Flipped only if still armed in the same generation: the tail of a Get the
             * client cancelled, arriving after px_disarm or a new px_arm, passes intact,
             * so the count cannot move once px_disarm has returned. */
            pthread_mutex_lock(&px->mu);
            if (atomic_load(&px->armed) && s->gen == atomic_load(&px->gen)) {
                p[s->target - s->pos] ^= (uint8_t)(1u << (atomic_load(&px->flips) % 8));
                atomic_fetch_add(&px->flips, 1);
            }
            pthread_mutex_unlock(&px->mu);
        }
        s->pos += take;
        p += take;
        n -= take;
        if (s->pos == s->mlen)
            s->have = 0;
    }
}

/* Bytes p[0..n) just read from the server: HTTP/2 frames. */
static void
px_h2(proxy_t *px, px_dir_t *d, uint8_t *p, size_t n)
{
    while (n > 0) {
        if (d->fh_have < 9) {
            d->fh[d->fh_have++] = *p++;
            n--;
            if (d->fh_have == 9) {
                d->f_rem = (uint32_t)d->fh[0] << 16 | (uint32_t)d->fh[1] << 8 | d->fh[2];
                d->f_type = d->fh[3];
                d->f_sid = ((uint32_t)d->fh[5] << 24 | (uint32_t)d->fh[6] << 16 |
                            (uint32_t)d->fh[7] << 8 | d->fh[8]) &
                           0x7fffffffu;
                d->f_pad_pending = d->f_type == 0 && (d->fh[4] & 0x8);
                d->f_data_rem = d->f_type == 0 && !d->f_pad_pending ? d->f_rem : 0;
                if (d->f_rem == 0)
                    d->fh_have = 0;
            }
            continue;
        }
        size_t take;
        if (d->f_pad_pending) { /* padded DATA: pad length, data, padding */
            d->f_data_rem = d->f_rem - 1 > *p ? d->f_rem - 1 - *p : 0;
            d->f_pad_pending = 0;
            take = 1;
        } else if (d->f_data_rem > 0) {
            take = n < d->f_data_rem ? n : d->f_data_rem;
            px_grpc(px, d, d->f_sid, p, take);
            d->f_data_rem -= (uint32_t)take;
        } else { /* other frame types, padding */
            take = n < d->f_rem ? n : d->f_rem;
        }
        d->f_rem -= (uint32_t)take;
        p += take;
        n -= take;
        if (d->f_rem == 0)
            d->fh_have = 0;
    }
}

/* Moves what it can of one direction. Returns -1 on a socket error. */
static int
px_pump(proxy_t *px, px_dir_t *d)
{
    if (!d->eof && d->len < PX_BUF) {
        if (d->head > 0) {
            memmove(d->buf, d->buf + d->head, d->len - d->head);
            d->len -= d->head;
            d->head = 0;
        }
        ssize_t r = recv(d->from, d->buf + d->len, PX_BUF - d->len, 0);
        if (r > 0) {
            if (d->parse)
                px_h2(px, d, d->buf + d->len, (size_t)r);
            d->len += (size_t)r;
        } else if (r == 0) {
            d->eof = 1;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return -1;
        }
    }
    while (d->head < d->len) {
        ssize_t w = send(d->to, d->buf + d->head, d->len - d->head, MSG_NOSIGNAL);
        if (w > 0) {
            d->head += (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            break;
        } else {
            return -1;
        }
    }
    if (d->head == d->len)
        d->head = d->len = 0;
    if (d->eof && d->len == 0 && !d->shut) {
        shutdown(d->to, SHUT_WR);
        d->shut = 1;
    }
    return 0;
}

static void
px_close(px_conn_t *c)
{
    close(c->c2s.from);
    close(c->c2s.to);
    free(c->c2s.buf);
    free(c->s2c.buf);
    free(c);
}

static void
px_accept(proxy_t *px)
{
    int cfd = accept(px->lfd, NULL, NULL);
    if (cfd < 0)
        return;
    int sfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)px->up_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    size_t slot = PX_CONNS;
    for (size_t i = 0; i < PX_CONNS && slot == PX_CONNS; i++)
        if (px->conns[i] == NULL)
            slot = i;
    px_conn_t *c = calloc(1, sizeof *c);
    if (sfd < 0 || slot == PX_CONNS || c == NULL ||
        connect(sfd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(cfd);
        if (sfd >= 0)
            close(sfd);
        free(c);
        return;
    }
    int one = 1;
    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(cfd, F_SETFL, O_NONBLOCK);
    fcntl(sfd, F_SETFL, O_NONBLOCK);
    c->c2s.from = cfd, c->c2s.to = sfd;
    c->s2c.from = sfd, c->s2c.to = cfd, c->s2c.parse = 1;
    c->c2s.buf = malloc(PX_BUF);
    c->s2c.buf = malloc(PX_BUF);
    if (c->c2s.buf == NULL || c->s2c.buf == NULL) {
        px_close(c);
        return;
    }
    px->conns[slot] = c;
    atomic_fetch_add(&px->accepts, 1);
}

static void *
px_main(void *arg)
{
    proxy_t *px = arg;
    struct pollfd fds[1 + 2 * PX_CONNS];
    while (!atomic_load(&px->stop)) {
        size_t nf = 0;
        fds[nf++] = (struct pollfd){.fd = px->lfd, .events = POLLIN};
        for (size_t i = 0; i < PX_CONNS; i++) {
            px_conn_t *c = px->conns[i];
            if (c == NULL)
                continue;
            short ce = 0, se = 0;
            if (!c->c2s.eof && c->c2s.len < PX_BUF)
                ce |= POLLIN;
            if (!c->s2c.eof && c->s2c.len < PX_BUF)
                se |= POLLIN;
            if (c->c2s.len > c->c2s.head)
                se |= POLLOUT;
            if (c->s2c.len > c->s2c.head)
                ce |= POLLOUT;
            fds[nf++] = (struct pollfd){.fd = c->c2s.from, .events = ce};
            fds[nf++] = (struct pollfd){.fd = c->s2c.from, .events = se};
        }
        if (poll(fds, nf, 20) < 0 && errno != EINTR)
            break;
        if (fds[0].revents & POLLIN)
            px_accept(px);
        for (size_t i = 0; i < PX_CONNS; i++) {
            px_conn_t *c = px->conns[i];
            if (c == NULL)
                continue;
            if (px_pump(px, &c->c2s) != 0 || px_pump(px, &c->s2c) != 0 ||
                (c->c2s.shut && c->s2c.shut)) {
                px_close(c);
                px->conns[i] = NULL;
            }
        }
    }
    return NULL;
}

/* Starts a proxy on 127.0.0.1:0 to 127.0.0.1:up_port (disarmed). */
static void
px_start(proxy_t *px, int up_port)
{
    memset(px, 0, sizeof *px);
    ck_assert_int_eq(pthread_mutex_init(&px->mu, NULL), 0);
    px->up_port = up_port;
    px->lfd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(px->lfd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    ck_assert_int_eq(bind(px->lfd, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(listen(px->lfd, 16), 0);
    ck_assert_int_eq(getsockname(px->lfd, (struct sockaddr *)&a, &al), 0);
    px->port = ntohs(a.sin_port);
    snprintf(px->addr, sizeof px->addr, "127.0.0.1:%d", px->port);
    ck_assert_int_eq(pthread_create(&px->th, NULL, px_main, px), 0);
}

static void
px_stop(proxy_t *px)
{
    atomic_store(&px->stop, 1);
    pthread_join(px->th, NULL);
    for (size_t i = 0; i < PX_CONNS; i++)
        if (px->conns[i])
            px_close(px->conns[i]);
    close(px->lfd);
    pthread_mutex_destroy(&px->mu);
}

static void
px_arm(proxy_t *px, unsigned skip)
{
    pthread_mutex_lock(&px->mu);
    atomic_store(&px->skip, skip);
    atomic_fetch_add(&px->gen, 1);
    atomic_store(&px->armed, 1);
    pthread_mutex_unlock(&px->mu);
}

/* Disarms: once it returns no message is flipped (a flip in progress has finished; the
 * proxy checks armed under the same lock before each flip), so counts read right after it
 * stay put without waiting for the tail of a cancelled Get to drain. */
static void
px_disarm(proxy_t *px)
{
    pthread_mutex_lock(&px->mu);
    atomic_store(&px->armed, 0);
    pthread_mutex_unlock(&px->mu);
}

/* ---- clients, data, collection ---- */

static tqkv_client_t *
client_of(const char *const *targets, size_t nt, uint32_t replicas)
{
    /* no hedging: these tests assert which replica answers (the rank order); a hedge
     * makes that a race by design (docs/cluster.md, member_blackhole tests it) */
    tqkv_client_opts_t o = {.struct_size = sizeof(tqkv_client_opts_t),
                            .targets = targets,
                            .num_targets = nt,
                            .replicas = replicas,
                            .deadline_ms = 30000,
                            .wait_for_ready = 1,
                            .no_hedge = 1};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

typedef struct data {
    size_t nh;
    uint32_t L;
    tqkv_block_shape_t sh;
    tqkv_hash_t *hs;
    uint16_t **k, **v; /* [hash * L + layer] */
} data_t;

static void
data_make(data_t *d, size_t nh, uint32_t L, tqkv_block_shape_t sh, const tqkv_hash_t *hs)
{
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    d->nh = nh, d->L = L, d->sh = sh;
    d->hs = malloc(nh * sizeof *d->hs);
    d->k = calloc(nh * L, sizeof *d->k);
    d->v = calloc(nh * L, sizeof *d->v);
    ck_assert(d->hs && d->k && d->v);
    memcpy(d->hs, hs, nh * sizeof *hs);
    for (size_t i = 0; i < nh * L; i++) {
        d->k[i] = malloc(n * 2);
        d->v[i] = malloc(n * 2);
        ck_assert(d->k[i] && d->v[i]);
        tqkv_test_bf16_fill(&SEED, d->k[i], n, sh.head_dim);
        tqkv_test_bf16_fill(&SEED, d->v[i], n, sh.head_dim);
    }
}

static void
data_free(data_t *d)
{
    for (size_t i = 0; i < d->nh * d->L; i++) {
        free(d->k[i]);
        free(d->v[i]);
    }
    free(d->k);
    free(d->v);
    free(d->hs);
}

/* Puts every block of d (4-bit K and V) through c; returns the result. */
static tqkv_put_result_t
data_put(tqkv_client_t *c, const char *ns, const data_t *d)
{
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
    tqkv_put_t *p;
    tqkv_put_result_t r;
    ck_assert_int_eq(tqkv_client_put_begin(c, &po, &p), TQKV_OK);
    for (size_t b = 0; b < d->nh; b++)
        for (uint32_t l = 0; l < d->L; l++) {
            tqkv_put_block_t pb = {.ns = ns,
                                   .hash = &d->hs[b],
                                   .parent = b ? &d->hs[b - 1] : NULL,
                                   .layer = l,
                                   .num_layers = d->L,
                                   .shape = d->sh,
                                   .key = d->k[b * d->L + l],
                                   .value = d->v[b * d->L + l]};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
        }
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    return r;
}

/* What a Get delivered. */
typedef struct got {
    const data_t *d;
    int encoding;
    size_t pages, found, checked, unchecked;
    size_t invalid; /* found packed pages failing tqkv_page_validate with CRC */
    size_t bad;     /* out of range, repeated, wrong size or undecodable */
    double max_err; /* decoded against what was put */
    int *target;    /* [hash * L + layer]: the answering target, -2 = not delivered */
    uint32_t last_hash, last_layer; /* of the last page delivered */
} got_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    got_t *g = arg;
    const data_t *d = g->d;
    size_t slot = pg->hash_index * d->L + pg->layer;
    g->pages++;
    if (pg->hash_index >= d->nh || pg->layer >= d->L || g->target[slot] != -2) {
        g->bad++;
        return 0;
    }
    g->target[slot] = pg->target;
    g->last_hash = (uint32_t)pg->hash_index, g->last_layer = pg->layer;
    if (!pg->found)
        return 0;
    g->found++;
    if (pg->crc_checked)
        g->checked++;
    else
        g->unchecked++;
    size_t n = (size_t)d->sh.num_tokens * d->sh.num_kv_heads * d->sh.head_dim;
    if (g->encoding == TQKV_CLIENT_BF16) {
        if (pg->key_len != n * 2 || pg->value_len != n * 2) {
            g->bad++;
        } else {
            double ek = tqkv_test_bf16_rel_err(d->k[slot], pg->key, n),
                   ev = tqkv_test_bf16_rel_err(d->v[slot], pg->value, n);
            g->max_err = fmax(g->max_err, fmax(ek, ev));
        }
        return 0;
    }
    char err[128];
    tqkv_page_info_t info;
    if (tqkv_page_validate(pg->page, pg->page_len, 1, &info, err, sizeof err) != TQKV_OK) {
        g->invalid++;
        return 0;
    }
    uint16_t *dk = malloc(n * 2), *dv = malloc(n * 2);
    tqkv_block_shape_t sh;
    if (dk == NULL || dv == NULL ||
        tqkv_client_decode_page(pg->page, pg->page_len, dk, dv, &sh) != TQKV_OK ||
        sh.num_tokens != d->sh.num_tokens || sh.num_kv_heads != d->sh.num_kv_heads ||
        sh.head_dim != d->sh.head_dim) {
        g->bad++;
    } else {
        double ek = tqkv_test_bf16_rel_err(d->k[slot], dk, n),
               ev = tqkv_test_bf16_rel_err(d->v[slot], dv, n);
        g->max_err = fmax(g->max_err, fmax(ek, ev));
    }
    free(dk);
    free(dv);
    return 0;
}

/* Gets every (hash, layer) of d through c. The caller frees g.target. */
static got_t
get_all(tqkv_client_t *c, const char *ns, const data_t *d, int enc, tqkv_status_t *st)
{
    got_t g = {.d = d, .encoding = enc};
    g.target = malloc(d->nh * d->L * sizeof *g.target);
    ck_assert_ptr_nonnull(g.target);
    for (size_t i = 0; i < d->nh * d->L; i++)
        g.target[i] = -2;
    tqkv_get_req_t q = {.ns = ns,
                        .hashes = d->hs,
                        .num_hashes = d->nh,
                        .layer_begin = 0,
                        .layer_end = d->L,
                        .encoding = enc};
    *st = tqkv_client_get(c, &q, on_page, &g);
    return g;
}

static const tqkv_block_shape_t SHAPE = {256, 2, 128}; /* ~66 KB pages at 4 bits */

/* ---- tests ---- */

/* One target behind the proxy: a corrupted page is never delivered and the Get fails
 * with TQKV_ECORRUPT naming the page; disarmed, every page arrives intact. */
START_TEST(test_corrupt_single_target)
{
    const size_t nh = 4;
    const uint32_t L = 2;
    srv_t S;
    proxy_t px;
    data_t d;
    tqkv_hash_t hs[4];
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, i, 32);
    data_make(&d, nh, L, SHAPE, hs);
    start_srv(&S);
    const char *direct[1] = {S.addr};
    tqkv_client_t *cd = client_of(direct, 1, 1);
    tqkv_put_result_t r = data_put(cd, "crc", &d);
    ck_assert_uint_eq(r.blocks_stored, nh * L);

    px_start(&px, S.port);
    const char *via[1] = {px.addr};
    tqkv_client_t *cp = client_of(via, 1, 1);

    /* Every page corrupted: the first one (hash 0, layer 0: layer-major) fails. */
    px_arm(&px, 0);
    tqkv_status_t st;
    got_t g = get_all(cp, "crc", &d, TQKV_CLIENT_PACKED, &st);
    const tqkv_client_error_t *e = tqkv_client_last_error();
    ck_assert_msg(st == TQKV_ECORRUPT, "armed Get: %s (%s)", tqkv_strerror(st), e->message);
    ck_assert_int_eq(e->status, TQKV_ECORRUPT);
    ck_assert_msg(strstr(e->message, "CRC32C") && strstr(e->message, "hash 0 layer 0") &&
                      strstr(e->message, px.addr),
                  "error names the CRC, the page and the target: %s", e->message);
    ck_assert_uint_ge(atomic_load(&px.flips), 1);
    ck_assert_uint_eq(g.found, 0); /* nothing before the first page */
    ck_assert_uint_eq(g.invalid, 0);
    free(g.target);

    /* Pages 0..4 intact, page 5 (layer 1, hash 1) corrupted: the five before it are
     * delivered checked and valid, the error names the sixth, nothing after it arrives. */
    px_disarm(&px);
    unsigned f0 = atomic_load(&px.flips);
    px_arm(&px, 5);
    g = get_all(cp, "crc", &d, TQKV_CLIENT_PACKED, &st);
    e = tqkv_client_last_error();
    ck_assert_msg(st == TQKV_ECORRUPT, "armed Get (skip 5): %s (%s)", tqkv_strerror(st),
                  e->message);
    ck_assert_msg(strstr(e->message, "hash 1 layer 1"), "error names the page: %s", e->message);
    ck_assert_uint_gt(atomic_load(&px.flips), f0);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_uint_eq(g.bad, 0);
    ck_assert_uint_eq(g.found, 5);
    ck_assert_uint_eq(g.checked, 5);
    ck_assert_uint_eq(g.last_layer, 1);
    ck_assert_uint_eq(g.last_hash, 0);
    ck_assert_int_eq(g.target[1 * L + 1], -2);
    free(g.target);

    /* Disarmed, through the same proxy: every page intact and checked (the server's
     * copies were never altered), and the pages did pass through the proxy's parser. */
    px_disarm(&px);
    unsigned f1 = atomic_load(&px.flips), b1 = atomic_load(&px.big);
    g = get_all(cp, "crc", &d, TQKV_CLIENT_PACKED, &st);
    ck_assert_msg(st == TQKV_OK, "disarmed Get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(g.found, nh * L);
    ck_assert_uint_eq(g.checked, nh * L);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_uint_eq(g.bad, 0);
    ck_assert_msg(g.max_err > 0 && g.max_err < 0.2, "max rel err %g", g.max_err);
    ck_assert_uint_eq(atomic_load(&px.flips), f1);
    ck_assert_uint_ge(atomic_load(&px.big) - b1, nh * L);
    free(g.target);

    tqkv_client_destroy(cp);
    tqkv_client_destroy(cd);
    px_stop(&px);
    stop_live();
    data_free(&d);
}
END_TEST

/* Servers A and B started, a proxy in front of A, and a client with targets {proxy, B}. */
static tqkv_client_t *
pair_via_proxy(srv_t *A, srv_t *B, proxy_t *px, uint32_t replicas)
{
    start_srv(A);
    start_srv(B);
    px_start(px, A->port);
    const char *t[2] = {px->addr, B->addr};
    return client_of(t, 2, replicas);
}

/* The client's target ranked first for hash h of namespace "crc" (the ring of
 * transport/shard.h is deterministic): 0 = the proxied one. */
static uint32_t
primary_of(tqkv_client_t *c, const tqkv_hash_t *h)
{
    uint64_t ids[2] = {tqkv_client_target_rank_id(c, 0), tqkv_client_target_rank_id(c, 1)};
    uint32_t order[2];
    tqkv_shard_rank(ids, 2, tqkv_shard_block_key("crc", h->bytes, h->len), order);
    return order[0];
}

/* Two servers, R = 2, the first behind the proxy: pages corrupted on the way from it are
 * replaced by the second server's copies; the Get succeeds with every page checked. */
START_TEST(test_corrupt_replica_fallback)
{
    const size_t nh = 16;
    const uint32_t L = 2;
    srv_t A, B;
    proxy_t px;
    tqkv_client_t *c = pair_via_proxy(&A, &B, &px, 2);

    /* Draw hashes until at least 4 of the 16 have the proxied target first, and at least
     * 4 the direct one. */
    tqkv_hash_t hs[16];
    int primary[16];
    size_t via_px = 0;
    for (uint64_t salt = 0; salt < 100; salt++) {
        via_px = 0;
        for (size_t i = 0; i < nh; i++) {
            tqkv_test_hash(&hs[i], SEED + salt * 7777, i, 40);
            primary[i] = (int)primary_of(c, &hs[i]);
            via_px += primary[i] == 0;
        }
        if (via_px >= 4 && via_px <= nh - 4)
            break;
    }
    ck_assert_msg(via_px >= 4 && via_px <= nh - 4, "no hash set splits over the targets");
    data_t d;
    data_make(&d, nh, L, SHAPE, hs);
    tqkv_put_result_t r = data_put(c, "crc", &d);
    ck_assert_uint_eq(r.blocks_sent, 2 * nh * L); /* each block on both */
    ck_assert_uint_eq(r.blocks_stored, 2 * nh * L);

    /* Armed: every page from A is corrupted; each is replaced by B's copy. */
    px_arm(&px, 0);
    unsigned f0 = atomic_load(&px.flips);
    tqkv_status_t st;
    got_t g = get_all(c, "crc", &d, TQKV_CLIENT_PACKED, &st);
    ck_assert_msg(st == TQKV_OK, "armed Get: %s (%s)", tqkv_strerror(st),
                  tqkv_client_last_error()->message);
    ck_assert_uint_eq(g.pages, nh * L);
    ck_assert_uint_eq(g.found, nh * L);
    ck_assert_uint_eq(g.checked, nh * L);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_uint_eq(g.bad, 0);
    ck_assert_msg(g.max_err > 0 && g.max_err < 0.2, "max rel err %g", g.max_err);
    /* exactly the pages of the hashes ranked on A first went through the proxy */
    ck_assert_uint_eq(atomic_load(&px.flips) - f0, via_px * L);
    for (size_t i = 0; i < nh * L; i++)
        ck_assert_msg(g.target[i] == 1, "page %zu (primary %d) from target %d", i, primary[i / L],
                      g.target[i]);
    free(g.target);

    /* Disarmed: A's pages are intact again and come from A where A ranks first. */
    px_disarm(&px);
    unsigned f1 = atomic_load(&px.flips);
    g = get_all(c, "crc", &d, TQKV_CLIENT_PACKED, &st);
    ck_assert_msg(st == TQKV_OK, "disarmed Get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(g.checked, nh * L);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_uint_eq(g.bad, 0);
    for (size_t i = 0; i < nh * L; i++)
        ck_assert_int_eq(g.target[i], primary[i / L]);
    ck_assert_uint_eq(atomic_load(&px.flips), f1);
    free(g.target);

    tqkv_client_destroy(c);
    px_stop(&px);
    stop_live();
    data_free(&d);
}
END_TEST

/* Two servers, R = 1 (each block on one server; Get also asks the next in rank, where a
 * Put lands while the first is down), the first behind the proxy: the only copy of a page
 * ranked on it fails its CRC and the next candidate does not hold the block. That is
 * corruption, not a miss: the Get fails with TQKV_ECORRUPT as it does with one target,
 * and never reports the block as missing (found = 0) or delivers the bad bytes. */
START_TEST(test_corrupt_only_copy_is_not_a_miss)
{
    const size_t nh = 8;
    const uint32_t L = 2;
    srv_t A, B;
    proxy_t px;
    tqkv_client_t *c = pair_via_proxy(&A, &B, &px, 1);
    /* hash 0 ranks B first, hash 1 the proxied A; the rest at random */
    tqkv_hash_t hs[8];
    size_t i = 0;
    for (uint64_t k = 0; i < nh && k < 10000; k++) {
        tqkv_test_hash(&hs[i], SEED, 1000 + k, 24);
        if (i >= 2 || primary_of(c, &hs[i]) == (i == 0 ? 1u : 0u))
            i++;
    }
    ck_assert_uint_eq(i, nh);
    data_t d;
    data_make(&d, nh, L, SHAPE, hs);
    tqkv_put_result_t r = data_put(c, "crc", &d);
    ck_assert_uint_eq(r.blocks_stored, nh * L);

    px_arm(&px, 0);
    tqkv_status_t st;
    got_t g = get_all(c, "crc", &d, TQKV_CLIENT_PACKED, &st);
    const tqkv_client_error_t *e = tqkv_client_last_error();
    ck_assert_msg(st == TQKV_ECORRUPT, "armed Get: %s (%s)", tqkv_strerror(st), e->message);
    ck_assert_msg(e->status == TQKV_ECORRUPT && strstr(e->message, "CRC32C") &&
                      strstr(e->message, px.addr),
                  "error names the CRC and the target whose copy failed: %s", e->message);
    ck_assert_uint_ge(atomic_load(&px.flips), L);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_uint_eq(g.bad, 0);
    ck_assert_uint_eq(g.pages, g.found); /* no block reported missing */
    ck_assert_int_eq(g.target[1 * L + 0], -2);
    free(g.target);

    px_disarm(&px);
    g = get_all(c, "crc", &d, TQKV_CLIENT_PACKED, &st);
    ck_assert_msg(st == TQKV_OK, "disarmed Get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(g.found, nh * L);
    ck_assert_uint_eq(g.checked, nh * L);
    ck_assert_uint_eq(g.invalid, 0);
    ck_assert_int_eq(g.target[0], 1);
    ck_assert_int_eq(g.target[1 * L], 0);
    free(g.target);

    tqkv_client_destroy(c);
    px_stop(&px);
    stop_live();
    data_free(&d);
}
END_TEST

/* BF16 responses carry no page and so no CRC: crc_checked is 0 on every page, and the
 * content is the BF16 round trip of the packed page. */
START_TEST(test_bf16_unchecked)
{
    const size_t nh = 3;
    const uint32_t L = 2;
    srv_t S;
    proxy_t px;
    data_t d;
    tqkv_hash_t hs[3];
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, 100 + i, 16);
    data_make(&d, nh, L, SHAPE, hs);
    start_srv(&S);
    px_start(&px, S.port);
    const char *via[1] = {px.addr};
    tqkv_client_t *c = client_of(via, 1, 1);
    tqkv_put_result_t r = data_put(c, "crc", &d);
    ck_assert_uint_eq(r.blocks_stored, nh * L);
    tqkv_status_t st;
    got_t g = get_all(c, "crc", &d, TQKV_CLIENT_BF16, &st);
    ck_assert_msg(st == TQKV_OK, "BF16 Get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(g.found, nh * L);
    ck_assert_uint_eq(g.unchecked, nh * L);
    ck_assert_uint_eq(g.checked, 0);
    ck_assert_uint_eq(g.bad, 0);
    ck_assert_msg(g.max_err > 0 && g.max_err < 0.2, "max rel err %g", g.max_err);
    ck_assert_uint_eq(atomic_load(&px.big), nh * L); /* through the proxy */
    ck_assert_uint_eq(atomic_load(&px.flips), 0);
    free(g.target);
    tqkv_client_destroy(c);
    px_stop(&px);
    stop_live();
    data_free(&d);
}
END_TEST

static void
setup(void)
{
    SEED = tqkv_test_seed();
    atexit(stop_live);
}

static Suite *
client_crc_suite(void)
{
    Suite *s = suite_create("client_crc");
    TCase *tc = tcase_create("proxy");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_corrupt_single_target);
    tcase_add_test(tc, test_corrupt_replica_fallback);
    tcase_add_test(tc, test_corrupt_only_copy_is_not_a_miss);
    tcase_add_test(tc, test_bf16_unchecked);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(client_crc_suite)
