/* bench_baselines.c - what tqkv-bench measures tqkv against, in the same run: raw TCP
 * loopback (one connection per worker), Redis GET over RESP against a redis-server it
 * starts, and a raw TLS pair (tls_pair.c); and the spawned processes (servers) it runs.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "kernels/version.h"
#include "transport/bench/tls_pair.h"
#include "transport/bench/tls_report.h"
#include "transport/bench/bench.h"
#include "transport/client.h"

/* ---- spawned processes ---- */

static void *
drain_main(void *arg)
{
    child_t *c = arg;
    char buf[4096];
    while (read(c->fd, buf, sizeof buf) > 0) {
    }
    return NULL;
}

/* Starts argv with stdout+stderr on a pipe; waits (up to 30 s) for a line containing
 * "listening on HOST:PORT" when want_port, writing "HOST:PORT" into addr. */
int
bench_child_start(child_t *c, char *const argv[], int want_port, char *addr, size_t addrlen)
{
    int pfd[2];
    memset(c, 0, sizeof *c);
    if (pipe(pfd) != 0)
        return -1;
    c->pid = fork();
    if (c->pid < 0)
        return -1;
    if (c->pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        close(pfd[1]);
        execv(argv[0], argv);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(pfd[1]);
    c->fd = pfd[0];
    if (want_port) {
        char line[4096];
        size_t n = 0;
        double t0 = tqkv_clock_s();
        int found = 0;
        fcntl(c->fd, F_SETFL, O_NONBLOCK);
        while (!found && tqkv_clock_s() - t0 < 30) {
            ssize_t r = read(c->fd, line + n, sizeof line - 1 - n);
            if (r == 0)
                break;
            if (r < 0) {
                if (errno != EAGAIN)
                    break;
                usleep(10000);
                continue;
            }
            n += (size_t)r;
            line[n] = '\0';
            char *p = strstr(line, "listening on ");
            if (p && strchr(p, '\n')) {
                p += strlen("listening on ");
                size_t k = strcspn(p, " \t\r\n");
                if (k < addrlen) {
                    memcpy(addr, p, k);
                    addr[k] = '\0';
                    found = 1;
                }
            }
            char *nl = strrchr(line, '\n');
            if (!found && nl && n > sizeof line / 2) {
                size_t rest = n - (size_t)(nl + 1 - line);
                memmove(line, nl + 1, rest);
                n = rest;
            }
        }
        fcntl(c->fd, F_SETFL, 0);
        if (!found) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, NULL, 0);
            close(c->fd);
            return -1;
        }
    }
    c->draining = pthread_create(&c->drain, NULL, drain_main, c) == 0;
    return 0;
}

void
bench_child_stop(child_t *c)
{
    if (c->pid <= 0)
        return;
    kill(c->pid, SIGTERM);
    for (int i = 0; i < 100; i++) {
        if (waitpid(c->pid, NULL, WNOHANG) == c->pid) {
            c->pid = 0;
            break;
        }
        usleep(50000);
    }
    if (c->pid > 0) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, NULL, 0);
        c->pid = 0;
    }
    if (c->draining)
        pthread_join(c->drain, NULL);
    close(c->fd);
}

static int
free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(s, (struct sockaddr *)&a, &al) != 0) {
        if (s >= 0)
            close(s);
        return -1;
    }
    close(s);
    return ntohs(a.sin_port);
}

static int
connect_port(int port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        close(s);
        return -1;
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return s;
}

/* Sends (wr) or receives all n bytes of buf on a blocking socket; 0, or -1 on an error or
 * a closed peer. */
static int
xfer_all(int fd, void *buf, size_t n, int wr)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int
send_all(int fd, const void *buf, size_t n)
{
    return xfer_all(fd, (void *)buf, n, 1);
}

static int
recv_all(int fd, void *buf, size_t n)
{
    return xfer_all(fd, buf, n, 0);
}

/* ---- baseline: raw TCP loopback ---- */

/* One connection of the baseline: a receiver thread reading `total` bytes in msg-byte
 * reads into one reused buffer, and a sender thread writing them from src (walked
 * cyclically). */
typedef struct tcpctx {
    int lfd, port;
    size_t total, msg;
    const uint8_t *src;
    size_t src_len;
    int ok;
} tcpctx_t;

static void *
tcp_recv_main(void *arg)
{
    tcpctx_t *t = arg;
    int fd = accept(t->lfd, NULL, NULL);
    char *buf = malloc(t->msg);
    size_t got = 0;
    if (fd >= 0 && buf) {
        while (got < t->total) {
            size_t want = t->total - got < t->msg ? t->total - got : t->msg;
            if (recv_all(fd, buf, want) != 0)
                break;
            got += want;
        }
    }
    t->ok = got == t->total;
    free(buf);
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void *
tcp_send_main(void *arg)
{
    tcpctx_t *t = arg;
    int fd = connect_port(t->port);
    size_t sent = 0, off = 0;
    while (fd >= 0 && sent < t->total) {
        size_t n = t->total - sent < t->msg ? t->total - sent : t->msg;
        if (off + n > t->src_len)
            off = 0;
        if (send_all(fd, t->src + off, n) != 0)
            break;
        sent += n;
        off += n;
    }
    if (fd >= 0) {
        shutdown(fd, SHUT_WR);
        char c;
        while (recv(fd, &c, 1, 0) > 0) /* until the receiver has read all and closed */
            ;
        close(fd);
    }
    return NULL;
}

/* Streams total bytes in msg-byte sends over conns connections at once (as many as the run
 * has workers, so the ceiling is measured with the same parallelism), each with its own
 * sender and receiver thread; returns the aggregate GB/s, or 0 when a connection failed. */
static double
baseline_tcp(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (conns < 1)
        conns = 1;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, conns) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &al) != 0) {
        if (lfd >= 0)
            close(lfd);
        return 0;
    }
    tcpctx_t *t = calloc((size_t)conns, sizeof *t);
    pthread_t *th = calloc((size_t)conns * 2, sizeof *th);
    if (!t || !th) {
        free(t);
        free(th);
        close(lfd);
        return 0;
    }
    size_t per = total / (size_t)conns / msg * msg, sum = 0;
    if (per == 0)
        per = msg;
    for (int i = 0; i < conns; i++)
        t[i] = (tcpctx_t){.lfd = lfd,
                          .port = ntohs(a.sin_port),
                          .total = per,
                          .msg = msg,
                          .src = src,
                          .src_len = src_len};
    double dt = tqkv_bench_run_pairs(conns, tcp_recv_main, tcp_send_main, t, sizeof *t, th);
    int ok = 1;
    for (int i = 0; i < conns; i++) {
        ok &= t[i].ok;
        sum += t[i].total;
    }
    close(lfd);
    free(t);
    free(th);
    return ok && dt > 0 ? (double)sum / dt / 1e9 : 0;
}

/* ---- baseline: Redis GET over RESP ---- */

typedef struct rconn {
    int fd;
    char buf[65536];
    size_t pos, len;
} rconn_t;

static int
r_getc(rconn_t *r)
{
    if (r->pos == r->len) {
        ssize_t n = recv(r->fd, r->buf, sizeof r->buf, 0);
        if (n <= 0)
            return -1;
        r->pos = 0;
        r->len = (size_t)n;
    }
    return (unsigned char)r->buf[r->pos++];
}

/* Reads one reply line ("+OK", "$123", "-ERR ..."). */
static int
r_line(rconn_t *r, char *line, size_t cap)
{
    size_t n = 0;
    for (;;) {
        int ch = r_getc(r);
        if (ch < 0)
            return -1;
        if (ch == '\n')
            break;
        if (ch != '\r' && n + 1 < cap)
            line[n++] = (char)ch;
    }
    line[n] = '\0';
    return 0;
}

static int
r_read(rconn_t *r, void *dst, size_t n)
{
    char *p = dst;
    size_t have = r->len - r->pos;
    size_t k = have < n ? have : n;
    memcpy(p, r->buf + r->pos, k);
    r->pos += k;
    return recv_all(r->fd, p + k, n - k);
}

static int
r_cmd(rconn_t *r, const char *cmd, const char *key, const void *val, size_t vlen)
{
    char hdr[256];
    int n;
    if (val)
        n = snprintf(hdr, sizeof hdr, "*3\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n$%zu\r\n", strlen(cmd),
                     cmd, strlen(key), key, vlen);
    else
        n = snprintf(hdr, sizeof hdr, "*2\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n", strlen(cmd), cmd,
                     strlen(key), key);
    if (send_all(r->fd, hdr, (size_t)n) != 0)
        return -1;
    if (val && (send_all(r->fd, val, vlen) != 0 || send_all(r->fd, "\r\n", 2) != 0))
        return -1;
    return 0;
}

typedef struct redisctx {
    int port;
    size_t nkeys, msg;
    double until;
    _Atomic uint64_t bytes;
    int fail;
} redisctx_t;

static void *
redis_get_main(void *arg)
{
    redisctx_t *x = arg;
    rconn_t *r = calloc(1, sizeof *r);
    char *buf = malloc(x->msg);
    uint64_t s = (uint64_t)(uintptr_t)r;
    if (r == NULL || buf == NULL || (r->fd = connect_port(x->port)) < 0) {
        x->fail = 1;
        goto out;
    }
    while (tqkv_clock_s() < x->until) {
        char key[32], line[64];
        snprintf(key, sizeof key, "tqkv:%zu", (size_t)(bench_rnd(&s) % x->nkeys));
        if (r_cmd(r, "GET", key, NULL, 0) != 0 || r_line(r, line, sizeof line) != 0 ||
            line[0] != '$' || (size_t)atoll(line + 1) != x->msg || r_read(r, buf, x->msg) != 0 ||
            r_line(r, line, sizeof line) != 0) {
            x->fail = 1;
            break;
        }
        atomic_fetch_add(&x->bytes, x->msg);
    }
    close(r->fd);
out:
    free(r);
    free(buf);
    return NULL;
}

static double
baseline_redis(size_t msg, int conc, double seconds)
{
    int port = free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    char *argv[] = {"redis-server", "--port",           ps,   "--bind",
                    "127.0.0.1",    "--save",           "",   "--appendonly",
                    "no",           "--protected-mode", "no", NULL};
    child_t ch;
    if (port <= 0 || bench_child_start(&ch, argv, 0, NULL, 0) != 0)
        return -1;
    double rate = -1;
    rconn_t *r = calloc(1, sizeof *r);
    r->fd = -1;
    for (int i = 0; i < 300 && r->fd < 0; i++) {
        r->fd = connect_port(port);
        if (r->fd < 0)
            usleep(10000);
    }
    char line[256];
    /* PING x answers the bulk string "x": two lines. */
    if (r->fd < 0 || r_cmd(r, "PING", "x", NULL, 0) != 0 || r_line(r, line, sizeof line) != 0 ||
        r_line(r, line, sizeof line) != 0 || strcmp(line, "x") != 0) {
        fprintf(stderr, "tqkv-bench: redis baseline: no PING answer on port %d\n", port);
        goto out;
    }
    size_t nkeys = (256u << 20) / msg;
    if (nkeys < 4)
        nkeys = 4;
    if (nkeys > 1024)
        nkeys = 1024;
    for (size_t i = 0; i < nkeys; i++) {
        char key[32];
        snprintf(key, sizeof key, "tqkv:%zu", i);
        const uint8_t *v = (const uint8_t *)data_pool + (i * 4099 * 2) % (data_elems * 2 - msg);
        if (r_cmd(r, "SET", key, v, msg) != 0 || r_line(r, line, sizeof line) != 0 ||
            line[0] != '+') {
            fprintf(stderr, "tqkv-bench: redis baseline: SET failed: %s\n", line);
            goto out;
        }
    }
    redisctx_t x = {.port = port, .nkeys = nkeys, .msg = msg};
    pthread_t th[256];
    int n = conc < 256 ? conc : 256;
    double t0 = tqkv_clock_s();
    x.until = t0 + seconds;
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, redis_get_main, &x);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    double dt = tqkv_clock_s() - t0;
    if (x.fail)
        fprintf(stderr, "tqkv-bench: redis baseline: GET failed\n");
    else if (dt > 0)
        rate = (double)atomic_load(&x.bytes) / dt / 1e9;
out:
    if (r->fd >= 0)
        close(r->fd);
    free(r);
    bench_child_stop(&ch);
    return rate;
}

static int
have_redis(void)
{
    const char *path = getenv("PATH");
    char buf[4096];
    if (path == NULL)
        return 0;
    snprintf(buf, sizeof buf, "%s", path);
    for (char *d = strtok(buf, ":"); d; d = strtok(NULL, ":")) {
        char f[4200];
        snprintf(f, sizeof f, "%s/redis-server", d);
        if (access(f, X_OK) == 0)
            return 1;
    }
    return access("/usr/bin/redis-server", X_OK) == 0;
}

/* The baselines of the same run: raw TCP loopback, Redis GET, raw TLS and the cipher. */
void
bench_run_baselines(result_t *r)
{
    size_t total = K.get_wire > K.put_wire ? K.get_wire : K.put_wire;
    if (total < ((size_t)256 << 20))
        total = (size_t)256 << 20;
    if (total > ((size_t)2 << 30))
        total = (size_t)2 << 30;
    /* The raw pair sends what tqkv sent, in messages of the same size: the mean Get
     * message when Gets ran (packed pages), else the BF16 block of a Put. It also runs at
     * the BF16 block size, which a reader may compare with the Redis row. */
    size_t msg = r->msg;
    uint64_t nget = K.get_found + K.get_missing;
    r->wmsg = nget && K.get_wire ? (size_t)(K.get_wire / nget) : msg;
    if (r->wmsg < 4096)
        r->wmsg = 4096;
    size_t wmsg = r->wmsg;
    size_t tw = total - total % wmsg, tb = total - total % msg;
    /* Best of three: the loopback ceiling on a machine that may be busy. */
    for (int rep = 0; rep < 3; rep++) {
        double x =
            baseline_tcp(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2, C.concurrency);
        if (x > r->tcp)
            r->tcp = x;
        if (wmsg != msg) {
            x = baseline_tcp(tb, msg, (const uint8_t *)data_pool, data_elems * 2, C.concurrency);
            if (x > r->tcp_block)
                r->tcp_block = x;
        }
    }
    if (wmsg == msg)
        r->tcp_block = r->tcp;
    if (have_redis())
        r->redis = baseline_redis(msg, C.concurrency, C.duration < 3 ? C.duration : 3);
    if (C.tls_ca) {
        /* A TLS run: the ceiling is a raw TLS pair with the data channels' settings
         * (same suite, same record batching), and the cipher's own speed. */
        for (int rep = 0; rep < 3; rep++) {
            char suite[64];
            double x = tqkv_bench_tls_pair(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2,
                                           C.concurrency, suite, sizeof suite);
            if (x > r->tls) {
                r->tls = x;
                snprintf(r->tls_suite, sizeof r->tls_suite, "%s", suite);
            }
        }
        r->cipher_gbps = tqkv_bench_cipher_speed("aes-128-gcm", 1);
        tqkv_bench_tls_measure(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2, C.concurrency);
    }
}
