/* tls_pair.c - tqkv-bench's TLS baselines (tls_pair.h): the ceiling a TLS data channel
 * is compared with, measured in the same run as the channel. */
#define _GNU_SOURCE
#include "transport/bench/tls_pair.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "transport/dc_tls.h"

/* A server context with an ephemeral self-signed P-256 certificate, the data channels'
 * protocol settings; NULL on failure. */
static SSL_CTX *
server_ctx(int channel_layer)
{
    EVP_PKEY *pk = EVP_EC_gen("P-256");
    X509 *x = X509_new();
    SSL_CTX *ctx = NULL;
    if (pk == NULL || x == NULL)
        goto out;
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), 0);
    X509_gmtime_adj(X509_getm_notAfter(x), 3600);
    X509_set_pubkey(x, pk);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                               (const unsigned char *)"tqkv-bench", -1, -1, 0);
    X509_set_issuer_name(x, X509_get_subject_name(x));
    if (X509_sign(x, pk, EVP_sha256()) == 0)
        goto out;
    ctx = SSL_CTX_new(TLS_server_method());
    if (ctx == NULL)
        goto out;
    SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
    SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256");
    SSL_CTX_set_num_tickets(ctx, 0);
    if (channel_layer)
        tqkv__dctls_ctx_prepare(ctx); /* the data channels' record layer */
    if (SSL_CTX_use_certificate(ctx, x) != 1 || SSL_CTX_use_PrivateKey(ctx, pk) != 1) {
        SSL_CTX_free(ctx);
        ctx = NULL;
    }
out:
    X509_free(x);
    EVP_PKEY_free(pk);
    return ctx;
}

typedef struct pair {
    SSL_CTX *sctx, *cctx;
    int lfd, port;
    size_t total, msg;
    const uint8_t *src;
    size_t src_len;
    int ok;
    char cipher[64];
} pair_t;

/* The receiving end: the client side of TLS (as libtqkv is), reading total bytes. */
static void *
recv_main(void *arg)
{
    pair_t *p = arg;
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                            .sin_port = htons((uint16_t)p->port)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    char err[256];
    uint64_t dl = tqkv_clock_ns() + 10000000000ull;
    if (fd < 0 || (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) ||
        tqkv__dcio_wait(fd, POLLOUT, dl) != 0) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    SSL *ssl = tqkv__dctls_handshake(p->cctx, fd, "127.0.0.1", dl, err, sizeof err);
    uint8_t *buf = malloc(p->msg);
    size_t got = 0;
    if (ssl && buf) {
        const char *v, *c;
        tqkv__dctls_describe(ssl, &v, &c);
        snprintf(p->cipher, sizeof p->cipher, "%s %s", v, c);
        tqkv__dcio_t io = {fd, ssl};
        while (got < p->total) {
            size_t want = p->total - got < p->msg ? p->total - got : p->msg;
            if (tqkv__dcio_read(&io, buf, want, 0) != 0)
                break;
            got += want;
        }
    }
    p->ok = ssl != NULL && got == p->total;
    free(buf);
    tqkv__dctls_free(ssl);
    close(fd);
    return NULL;
}

/* The sending end: the server side, records gathered as tqkv-server's channels do. */
static void *
send_main(void *arg)
{
    pair_t *p = arg;
    int fd = accept4(p->lfd, NULL, NULL, SOCK_NONBLOCK);
    char err[256];
    if (fd < 0)
        return NULL;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    SSL *ssl =
        tqkv__dctls_handshake(p->sctx, fd, NULL, tqkv_clock_ns() + 10000000000ull, err, sizeof err);
    if (ssl) {
        tqkv__dcio_t io = {fd, ssl};
        size_t sent = 0, off = 0;
        while (sent < p->total) {
            size_t n = p->total - sent < p->msg ? p->total - sent : p->msg;
            if (off + n > p->src_len)
                off = 0;
            struct iovec iov = {(void *)(p->src + off), n};
            if (tqkv__dcio_write(&io, &iov, 1, 0) != 0)
                break;
            sent += n;
            off += n;
        }
    }
    tqkv__dctls_free(ssl);
    close(fd);
    return NULL;
}

static double
pair_run(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns, char *cipher,
         size_t cap, int channel_layer)
{
    if (conns < 1)
        conns = 1;
    if (cap)
        cipher[0] = '\0';
    char err[256];
    SSL_CTX *sctx = server_ctx(channel_layer);
    SSL_CTX *cctx = tqkv__dctls_client_ctx(NULL, NULL, NULL, err, sizeof err);
    if (cctx && !channel_layer) { /* OpenSSL's own records: no secrets kept, no kTLS */
        SSL_CTX_set_keylog_callback(cctx, NULL);
        SSL_CTX_clear_options(cctx, SSL_OP_ENABLE_KTLS);
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    pair_t *p = calloc((size_t)conns, sizeof *p);
    pthread_t *th = calloc((size_t)conns * 2, sizeof *th);
    double gbps = 0;
    if (!sctx || !cctx || lfd < 0 || !p || !th || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 ||
        listen(lfd, conns) != 0 || getsockname(lfd, (struct sockaddr *)&a, &al) != 0)
        goto out;
    SSL_CTX_set_verify(cctx, SSL_VERIFY_NONE, NULL); /* a baseline: the cipher's cost only */
    size_t per = total / (size_t)conns / msg * msg, sum = 0;
    if (per == 0)
        per = msg;
    for (int i = 0; i < conns; i++)
        p[i] = (pair_t){.sctx = sctx,
                        .cctx = cctx,
                        .lfd = lfd,
                        .port = ntohs(a.sin_port),
                        .total = per,
                        .msg = msg,
                        .src = src,
                        .src_len = src_len};
    double dt = tqkv_bench_run_pairs(conns, recv_main, send_main, p, sizeof *p, th);
    int ok = 1;
    for (int i = 0; i < conns; i++) {
        ok &= p[i].ok;
        sum += p[i].total;
    }
    if (ok && dt > 0)
        gbps = (double)sum / dt / 1e9;
    if (cap)
        snprintf(cipher, cap, "%s", p[0].cipher);
out:
    if (lfd >= 0)
        close(lfd);
    free(p);
    free(th);
    SSL_CTX_free(sctx);
    SSL_CTX_free(cctx);
    return gbps;
}

double
tqkv_bench_cipher_speed(const char *evp_name, int seconds)
{
    char cmd[256], line[512];
    snprintf(cmd, sizeof cmd, "openssl speed -evp %s -seconds %d -bytes 16384 2>/dev/null",
             evp_name, seconds);
    FILE *f = popen(cmd, "r");
    if (f == NULL)
        return 0;
    double kbs = 0;
    while (fgets(line, sizeof line, f)) {
        /* "AES-128-GCM    5347269.49k" (the last line: 1000s of bytes/s) */
        char name[64];
        double v;
        if (sscanf(line, "%63s %lfk", name, &v) == 2 && strcasecmp(name, evp_name) == 0)
            kbs = v;
    }
    pclose(f);
    return kbs * 1000.0 / 1e9;
}

double
tqkv_bench_run_pairs(int n, void *(*recv_fn)(void *), void *(*send_fn)(void *), void *ctx,
                     size_t size, pthread_t *th)
{
    double t0 = tqkv_clock_s();
    for (int i = 0; i < n; i++) {
        void *c = (char *)ctx + (size_t)i * size;
        pthread_create(&th[2 * i], NULL, recv_fn, c);
        pthread_create(&th[2 * i + 1], NULL, send_fn, c);
    }
    for (int i = 0; i < 2 * n; i++)
        pthread_join(th[i], NULL);
    return tqkv_clock_s() - t0;
}

double
tqkv_bench_tls_pair(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns,
                    char *cipher, size_t cap)
{
    return pair_run(total, msg, src, src_len, conns, cipher, cap, 0);
}

double
tqkv_bench_tls_pair_channel_layer(size_t total, size_t msg, const uint8_t *src, size_t src_len,
                                  int conns, char *cipher, size_t cap)
{
    return pair_run(total, msg, src, src_len, conns, cipher, cap, 1);
}
