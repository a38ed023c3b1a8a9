/* data_channel.c - libtqkv's side of TCP data channels: target host parsing, and
 * connect + TLS handshake (when the client has TLS) + hello + ack. Reads go through
 * tqkv__dcio_read (dc_tls.h). */
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

int
tqkv__dcc_connect(const char *host, uint32_t port, uint64_t id,
                  const uint8_t secret[TQKV_DC_SECRET_BYTES], uint32_t timeout_ms, SSL_CTX *tls,
                  const char *tls_name, tqkv__dcio_t *out, char *err, size_t errlen)
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
    uint64_t deadline = tqkv_clock_ns() + (uint64_t)timeout_ms * 1000000ull;
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
        if (tqkv__dcio_wait(fd, POLLOUT, deadline) != 0 ||
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
    tqkv__dcio_t io = {fd, NULL};
    if (tls) {
        char why[256];
        io.ssl =
            tqkv__dctls_handshake(tls, fd, tls_name ? tls_name : host, deadline, why, sizeof why);
        if (io.ssl == NULL) {
            snprintf(err, errlen, "data channel %s:%u: %s", host, port, why);
            close(fd);
            return -1;
        }
        tqkv__dctls_note_client(io.ssl);
    }
    uint8_t hello[TQKV_DC_HELLO_BYTES], ack[TQKV_DC_ACK_BYTES];
    tqkv_dc_hello_encode(hello, id, secret);
    struct iovec iov = {hello, sizeof hello};
    if (tqkv__dcio_write(&io, &iov, 1, deadline) != 0 ||
        tqkv__dcio_read(&io, ack, sizeof ack, deadline) != 0) {
        snprintf(err, errlen, "data channel %s:%u: hello: %s", host, port,
                 errno == EPROTO ? "TLS error"
                 : errno         ? strerror(errno)
                                 : "connection closed");
        SSL_free(io.ssl);
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
        SSL_free(io.ssl);
        close(fd);
        return -1;
    }
    *out = io;
    return 0;
}
