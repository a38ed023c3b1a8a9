/* data_channel.c - libtqkv's side of TCP data channels: target host parsing,
 * connect + hello + ack, and bounded reads. */
#define _GNU_SOURCE
#include "transport/data_channel.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static uint64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int
tqkv__dcc_target_host(const char *target, char *host, size_t cap)
{
    const char *p = target;
    if (!strncmp(p, "unix:", 5) || !strncmp(p, "unix-abstract:", 14) || !strncmp(p, "vsock:", 6))
        return -1;
    if (!strncmp(p, "dns:///", 7))
        p += 7;
    else if (!strncmp(p, "dns:", 4))
        p += 4;
    else if (!strncmp(p, "ipv4:", 5))
        p += 5;
    else if (!strncmp(p, "ipv6:", 5))
        p += 5;
    const char *end;
    if (*p == '[') {
        p++;
        end = strchr(p, ']');
        if (end == NULL)
            return -1;
    } else {
        const char *comma = strchr(p, ','); /* ipv4:a:1,b:1: the first address */
        const char *stop = comma ? comma : p + strlen(p);
        end = stop;
        for (const char *q = p; q < stop; q++)
            if (*q == ':')
                end = q;
    }
    size_t n = (size_t)(end - p);
    if (n == 0 || n >= cap)
        return -1;
    memcpy(host, p, n);
    host[n] = '\0';
    return 0;
}

static int
wait_fd(int fd, short ev, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = mono_ns();
        if (now >= deadline_ns) {
            errno = ETIMEDOUT;
            return -1;
        }
        uint64_t left = (deadline_ns - now + 999999) / 1000000;
        struct pollfd pf = {fd, ev, 0};
        int r = poll(&pf, 1, left > 60000 ? 60000 : (int)left);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

int
tqkv__dcc_read(int fd, void *buf, size_t n, uint64_t deadline_ns)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0) {
            errno = 0;
            return -1;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (wait_fd(fd, POLLIN, deadline_ns) != 0)
            return -1;
    }
    return 0;
}

int
tqkv__dcc_connect(const char *host, uint32_t port, uint64_t id,
                  const uint8_t secret[TQKV_DC_SECRET_BYTES], uint32_t timeout_ms, char *err,
                  size_t errlen)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int gr = getaddrinfo(host, ps, &hints, &ai);
    if (gr != 0) {
        snprintf(err, errlen, "data channel %s:%u: %s", host, port, gai_strerror(gr));
        return -1;
    }
    uint64_t deadline = mono_ns() + (uint64_t)timeout_ms * 1000000ull;
    int fd = -1, e = 0;
    for (struct addrinfo *p = ai; p && fd < 0; p = p->ai_next) {
        fd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, p->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        if (connect(fd, p->ai_addr, p->ai_addrlen) != 0 && errno != EINPROGRESS) {
            e = errno;
            close(fd);
            fd = -1;
            continue;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (wait_fd(fd, POLLOUT, deadline) != 0 ||
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0) {
            e = soerr ? soerr : errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        snprintf(err, errlen, "data channel %s:%u: connect: %s", host, port, strerror(e));
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t hello[TQKV_DC_HELLO_BYTES], ack[TQKV_DC_ACK_BYTES];
    tqkv_dc_hello_encode(hello, id, secret);
    size_t off = 0;
    while (off < sizeof hello) {
        ssize_t w = send(fd, hello + off, sizeof hello - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
            break;
        } else if (w < 0 && errno != EINTR && wait_fd(fd, POLLOUT, deadline) != 0) {
            break;
        }
    }
    if (off < sizeof hello || tqkv__dcc_read(fd, ack, sizeof ack, deadline) != 0) {
        snprintf(err, errlen, "data channel %s:%u: hello: %s", host, port,
                 errno ? strerror(errno) : "connection closed");
        close(fd);
        return -1;
    }
    int64_t st = tqkv_dc_ack_decode(ack);
    if (st != (int64_t)TQKV_DC_ACK_OK) {
        snprintf(err, errlen, "data channel %s:%u: refused (%s)", host, port,
                 st == TQKV_DC_ACK_UNKNOWN    ? "unknown channel or wrong secret"
                 : st == TQKV_DC_ACK_ATTACHED ? "channel already connected"
                 : st < 0                     ? "not a tqkv data channel"
                                              : "malformed hello");
        close(fd);
        return -1;
    }
    return fd;
}
