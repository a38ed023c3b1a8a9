/* check_client_proc.c - start and stop real tqkv-server processes for the client,
 * shard and bench tests (included by those suites, not compiled alone).
 *
 * The server binary comes from env TQKV_SERVER (CTest passes the built target).
 * A server is started with --listen 127.0.0.1:PORT (0 = any free port) and its
 * "listening on HOST:PORT" line is read from its output; the rest of the output
 * is drained by a thread so the server never blocks on a full pipe.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct srv {
    pid_t pid;
    int fd;
    int port;
    char addr[64];
    pthread_t drain;
    int draining;
} srv_t;

static double
proc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *
proc_drain(void *arg)
{
    srv_t *s = arg;
    char buf[4096];
    ssize_t n;
    int echo = getenv("TQKV_TEST_SERVER_LOG") != NULL; /* debugging: show server output */
    while ((n = read(s->fd, buf, sizeof buf)) > 0) {
        if (echo)
            fwrite(buf, 1, (size_t)n, stderr);
    }
    return NULL;
}

/* Path of the server under test, or NULL. */
static const char *
srv_path(void)
{
    const char *p = getenv("TQKV_SERVER");
    return p && access(p, X_OK) == 0 ? p : NULL;
}

/* Starts a server on 127.0.0.1:port (0 = a free one) with extra args (NULL-ended,
 * may be NULL). Returns 0 once it reported "listening on". */
static int
srv_start(srv_t *s, int port, const char *const *extra)
{
    const char *path = srv_path();
    char listen[64];
    const char *argv[40];
    int n = 0, pfd[2];
    memset(s, 0, sizeof *s);
    if (path == NULL || pipe(pfd) != 0)
        return -1;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    argv[n++] = path;
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--drain-seconds";
    argv[n++] = "1";
    for (int i = 0; extra && extra[i] && n < 38; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    s->pid = fork();
    if (s->pid < 0)
        return -1;
    if (s->pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        close(pfd[1]);
        execv(path, (char *const *)argv);
        _exit(127);
    }
    close(pfd[1]);
    s->fd = pfd[0];
    fcntl(s->fd, F_SETFL, O_NONBLOCK);
    char line[8192];
    size_t len = 0;
    double t0 = proc_now();
    while (proc_now() - t0 < 30) {
        ssize_t r = read(s->fd, line + len, sizeof line - 1 - len);
        if (r == 0)
            break;
        if (r < 0) {
            if (errno != EAGAIN)
                break;
            usleep(5000);
            continue;
        }
        len += (size_t)r;
        line[len] = '\0';
        char *p = strstr(line, "listening on ");
        if (p && strchr(p, '\n')) {
            p += strlen("listening on ");
            size_t k = strcspn(p, " \t\r\n");
            if (k < sizeof s->addr) {
                memcpy(s->addr, p, k);
                s->addr[k] = '\0';
                char *c = strrchr(s->addr, ':');
                s->port = c ? atoi(c + 1) : 0;
                fcntl(s->fd, F_SETFL, 0);
                s->draining = pthread_create(&s->drain, NULL, proc_drain, s) == 0;
                return 0;
            }
        }
        if (len > sizeof line / 2) {
            char *nl = strrchr(line, '\n');
            size_t keep = nl ? len - (size_t)(nl + 1 - line) : 0;
            memmove(line, line + len - keep, keep);
            len = keep;
        }
    }
    fprintf(stderr, "srv_start: %s did not report listening (port %d)\n", path, port);
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    close(s->fd);
    s->pid = 0;
    return -1;
}

/* Waits up to timeout seconds for the server to exit. Returns 0 when it did. */
static int
srv_wait(srv_t *s, double timeout)
{
    double t0 = proc_now();
    while (s->pid > 0) {
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
            s->pid = 0;
            break;
        }
        if (proc_now() - t0 > timeout)
            return -1;
        usleep(10000);
    }
    if (s->draining) {
        pthread_join(s->drain, NULL);
        s->draining = 0;
        close(s->fd);
    }
    return 0;
}

static void
srv_kill(srv_t *s, int sig)
{
    if (s->pid > 0)
        kill(s->pid, sig);
}

/* SIGTERM, then SIGKILL after 10 s. */
static void
srv_stop(srv_t *s)
{
    if (s->pid <= 0)
        return;
    srv_kill(s, SIGTERM);
    if (srv_wait(s, 10) != 0) {
        srv_kill(s, SIGKILL);
        srv_wait(s, 10);
    }
}

/* Fresh random BF16 data: roughly N(0, 1) with a per-channel scale (structured). */
static inline uint16_t
proc_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float
proc_bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint64_t
proc_rnd(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline void
proc_fill(uint16_t *x, size_t n, size_t dim, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++) {
        double u = 0;
        for (int k = 0; k < 4; k++)
            u += (double)(proc_rnd(seed) >> 11) * (1.0 / 9007199254740992.0);
        double scale = 1.0 + (double)((i % dim) % 7);
        x[i] = proc_f2bf((float)((u - 2.0) * 1.7 * scale));
    }
}

/* Relative L2 error of BF16 y against BF16 x (both n elements, y may be unaligned). */
static inline double
proc_rel_err(const uint16_t *x, const void *y, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, (const uint8_t *)y + 2 * i, 2);
        double a = proc_bf2f(x[i]), d = proc_bf2f(b) - a;
        e += d * d;
        s += a * a;
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

static inline void
proc_hash(tqkv_hash_t *h, uint64_t a, uint64_t b, uint8_t len)
{
    uint64_t s = a * 1000003u + b;
    h->len = len;
    for (uint8_t i = 0; i < len; i++)
        h->bytes[i] = (uint8_t)proc_rnd(&s);
}
