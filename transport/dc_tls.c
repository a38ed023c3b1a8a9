/* dc_tls.c - TLS on TCP data channels: OpenSSL contexts, a handshake bounded by a
 * deadline, and whole writes/reads for plain and TLS connections alike (dc_tls.h).
 *
 * Sockets may be blocking or not: every OpenSSL call that wants I/O waits in poll()
 * for the direction it asked for, bounded by the deadline, so one code path serves
 * the server's connection threads and the client's bounded reads. */
#define _GNU_SOURCE
#include "transport/dc_tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define SUITES "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
#define READ_BUFFER (256u << 10) /* read-ahead buffer: many records per recv */
#define WRITE_RING (1u << 20)    /* batch_writes: records gathered before a send */

uint64_t
tqkv__dcio_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The oldest OpenSSL error as text (and clears the queue), or fallback. */
static const char *
ssl_reason(char *buf, size_t cap, const char *fallback)
{
    unsigned long e = ERR_get_error();
    ERR_clear_error();
    if (e == 0)
        return fallback;
    ERR_error_string_n(e, buf, cap);
    return buf;
}

int
tqkv__dcio_wait(int fd, short ev, uint64_t deadline_ns)
{
    for (;;) {
        int ms = -1;
        if (deadline_ns) {
            uint64_t now = tqkv__dcio_now_ns();
            if (now >= deadline_ns) {
                errno = ETIMEDOUT;
                return -1;
            }
            uint64_t left = (deadline_ns - now + 999999) / 1000000;
            ms = left > 60000 ? 60000 : (int)left;
        }
        struct pollfd pf = {fd, ev, 0};
        int r = poll(&pf, 1, ms);
        if (r > 0)
            return 0; /* readable, writable, or an error/hangup the next call reports */
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

static SSL_CTX *
ctx_new(const SSL_METHOD *m, char *err, size_t errlen)
{
    SSL_CTX *ctx = SSL_CTX_new(m);
    if (ctx == NULL) {
        char b[200];
        snprintf(err, errlen, "TLS: cannot create a context: %s", ssl_reason(b, sizeof b, "?"));
        return NULL;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
    SSL_CTX_set_ciphersuites(ctx, SUITES);
    SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
    SSL_CTX_set_num_tickets(ctx, 0);
    /* Read whole socket buffers at once and decrypt the records from memory: two
     * syscalls per 16 KiB record otherwise (its header, then its body). */
    SSL_CTX_set_read_ahead(ctx, 1);
    SSL_CTX_set_default_read_buffer_len(ctx, READ_BUFFER);
    return ctx;
}

static int
load_pair(SSL_CTX *ctx, const char *cert_path, const char *key_path, char *err, size_t errlen)
{
    char b[200];
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_path) != 1) {
        snprintf(err, errlen, "TLS certificate %s: %s", cert_path,
                 ssl_reason(b, sizeof b, "unreadable"));
        return -1;
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, key_path, SSL_FILETYPE_PEM) != 1) {
        snprintf(err, errlen, "TLS key %s: %s", key_path, ssl_reason(b, sizeof b, "unreadable"));
        return -1;
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
        snprintf(err, errlen, "TLS key %s does not match certificate %s", key_path, cert_path);
        ERR_clear_error();
        return -1;
    }
    return 0;
}

SSL_CTX *
tqkv__dctls_server_ctx(const char *cert_path, const char *key_path, const char *client_ca_path,
                       char *err, size_t errlen)
{
    SSL_CTX *ctx = ctx_new(TLS_server_method(), err, errlen);
    if (ctx == NULL)
        return NULL;
    SSL_CTX_set_options(ctx, SSL_OP_CIPHER_SERVER_PREFERENCE);
    if (load_pair(ctx, cert_path, key_path, err, errlen) != 0)
        goto fail;
    if (client_ca_path && client_ca_path[0]) {
        char b[200];
        if (SSL_CTX_load_verify_locations(ctx, client_ca_path, NULL) != 1) {
            snprintf(err, errlen, "TLS client CA %s: %s", client_ca_path,
                     ssl_reason(b, sizeof b, "unreadable"));
            goto fail;
        }
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(client_ca_path);
        if (names)
            SSL_CTX_set_client_CA_list(ctx, names);
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    return ctx;
fail:
    SSL_CTX_free(ctx);
    return NULL;
}

SSL_CTX *
tqkv__dctls_client_ctx(const char *ca_path, const char *cert_path, const char *key_path, char *err,
                       size_t errlen)
{
    SSL_CTX *ctx = ctx_new(TLS_client_method(), err, errlen);
    if (ctx == NULL)
        return NULL;
    char b[200];
    if (ca_path ? SSL_CTX_load_verify_locations(ctx, ca_path, NULL) != 1
                : SSL_CTX_set_default_verify_paths(ctx) != 1) {
        snprintf(err, errlen, "TLS CA %s: %s", ca_path ? ca_path : "(system roots)",
                 ssl_reason(b, sizeof b, "unreadable"));
        goto fail;
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    if ((cert_path == NULL) != (key_path == NULL)) {
        snprintf(err, errlen,
                 "TLS: a client certificate needs its key and the key its certificate");
        goto fail;
    }
    if (cert_path && load_pair(ctx, cert_path, key_path, err, errlen) != 0)
        goto fail;
    return ctx;
fail:
    SSL_CTX_free(ctx);
    return NULL;
}

/* Waits for what SSL_get_error asks. 0 to retry; -1 (errno set) to give up. */
static int
ssl_wait(SSL *ssl, int fd, int rc, uint64_t deadline_ns)
{
    int e = SSL_get_error(ssl, rc);
    if (e == SSL_ERROR_WANT_READ)
        return tqkv__dcio_wait(fd, POLLIN, deadline_ns);
    if (e == SSL_ERROR_WANT_WRITE)
        return tqkv__dcio_wait(fd, POLLOUT, deadline_ns);
    if (e == SSL_ERROR_ZERO_RETURN) {
        errno = 0; /* the peer closed the TLS session: EOF */
        return -1;
    }
    if (e == SSL_ERROR_SYSCALL) {
        int saved = errno; /* 0: EOF without close_notify; else the socket's error */
        ERR_clear_error();
        errno = saved;
        return -1;
    }
    ERR_clear_error();
    errno = EPROTO;
    return -1;
}

SSL *
tqkv__dctls_handshake(SSL_CTX *ctx, int fd, const char *name, uint64_t deadline_ns, char *err,
                      size_t errlen)
{
    SSL *ssl = SSL_new(ctx);
    char b[200];
    if (ssl == NULL || SSL_set_fd(ssl, fd) != 1) {
        snprintf(err, errlen, "TLS: %s", ssl_reason(b, sizeof b, "cannot create a session"));
        SSL_free(ssl);
        return NULL;
    }
    if (name) {
        unsigned char ip[16];
        int is_ip = inet_pton(AF_INET, name, ip) == 1 || inet_pton(AF_INET6, name, ip) == 1;
        X509_VERIFY_PARAM *vp = SSL_get0_param(ssl);
        if (is_ip) {
            X509_VERIFY_PARAM_set1_ip_asc(vp, name);
        } else {
            SSL_set_tlsext_host_name(ssl, name);
            SSL_set1_host(ssl, name);
        }
        SSL_set_connect_state(ssl);
    } else {
        SSL_set_accept_state(ssl);
    }
    for (;;) {
        ERR_clear_error();
        int rc = SSL_do_handshake(ssl);
        if (rc == 1)
            return ssl;
        int e = SSL_get_error(ssl, rc);
        if ((e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) &&
            tqkv__dcio_wait(fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline_ns) == 0)
            continue;
        long v = SSL_get_verify_result(ssl);
        if (v != X509_V_OK)
            snprintf(err, errlen, "TLS handshake: certificate verify failed: %s",
                     X509_verify_cert_error_string(v));
        else if (errno == ETIMEDOUT && (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE))
            snprintf(err, errlen, "TLS handshake: timed out");
        else
            snprintf(err, errlen, "TLS handshake: %s",
                     ssl_reason(b, sizeof b,
                                e == SSL_ERROR_SYSCALL ? "connection closed" : "protocol error"));
        ERR_clear_error();
        SSL_free(ssl);
        return NULL;
    }
}

int
tqkv__dctls_batch_writes(SSL *ssl)
{
    BIO *in = NULL, *net = NULL;
    if (BIO_new_bio_pair(&in, WRITE_RING, &net, 0) != 1)
        return -1;
    SSL_set0_wbio(ssl, in); /* ssl owns in; the socket BIO stays its rbio */
    SSL_set_app_data(ssl, net);
    return 0;
}

void
tqkv__dctls_free(SSL *ssl)
{
    if (ssl == NULL)
        return;
    BIO *net = SSL_get_app_data(ssl);
    SSL_free(ssl);
    BIO_free(net);
}

/* Sends what the write ring of ssl holds. 0, or -1 with errno. */
static int
ring_flush(SSL *ssl, int fd, uint64_t deadline_ns)
{
    BIO *net = SSL_get_app_data(ssl);
    while (net && BIO_ctrl_pending(net) > 0) {
        char *p;
        int n = BIO_nread0(net, &p);
        if (n <= 0)
            break;
        ssize_t w = send(fd, p, (size_t)n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) &&
                tqkv__dcio_wait(fd, POLLOUT, deadline_ns) == 0)
                continue;
            return -1;
        }
        BIO_nread(net, &p, (int)w);
    }
    return 0;
}

int
tqkv__dcio_pending(const tqkv__dcio_t *io)
{
    return io->ssl != NULL && SSL_has_pending(io->ssl);
}

void
tqkv__dctls_describe(SSL *ssl, const char **version, const char **cipher)
{
    *version = SSL_get_version(ssl);
    *cipher = SSL_get_cipher_name(ssl);
}

int
tqkv__dcio_write(tqkv__dcio_t *io, struct iovec *iov, int n, uint64_t deadline_ns)
{
    while (n > 0) {
        size_t w = 0;
        if (io->ssl) {
            if (iov->iov_len == 0) {
                iov++, n--;
                continue;
            }
            ERR_clear_error();
            int rc = SSL_write_ex(io->ssl, iov->iov_base, iov->iov_len, &w);
            if (rc != 1) {
                int e = SSL_get_error(io->ssl, rc);
                if (e == SSL_ERROR_WANT_WRITE && SSL_get_app_data(io->ssl) != NULL) {
                    if (ring_flush(io->ssl, io->fd, deadline_ns) == 0)
                        continue; /* the ring was full */
                    return -1;
                }
                if (ssl_wait(io->ssl, io->fd, rc, deadline_ns) == 0)
                    continue;
                if (errno == 0)
                    errno = EPIPE;
                return -1;
            }
        } else {
            struct msghdr mh;
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)n;
            ssize_t r = sendmsg(io->fd, &mh, MSG_NOSIGNAL);
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                if ((errno == EAGAIN || errno == EWOULDBLOCK) &&
                    tqkv__dcio_wait(io->fd, POLLOUT, deadline_ns) == 0)
                    continue;
                return -1;
            }
            w = (size_t)r;
        }
        while (n > 0 && w >= iov->iov_len) {
            w -= iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + w;
            iov->iov_len -= w;
        }
    }
    return io->ssl ? ring_flush(io->ssl, io->fd, deadline_ns) : 0;
}

int
tqkv__dcio_read(tqkv__dcio_t *io, void *buf, size_t n, uint64_t deadline_ns)
{
    uint8_t *p = buf;
    while (n > 0) {
        if (io->ssl) {
            size_t r = 0;
            ERR_clear_error();
            int rc = SSL_read_ex(io->ssl, p, n, &r);
            if (rc == 1) {
                p += r;
                n -= r;
                continue;
            }
            if (ssl_wait(io->ssl, io->fd, rc, deadline_ns) == 0)
                continue;
            return -1;
        }
        ssize_t r = recv(io->fd, p, n, MSG_DONTWAIT);
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
        if (tqkv__dcio_wait(io->fd, POLLIN, deadline_ns) != 0)
            return -1;
    }
    return 0;
}
