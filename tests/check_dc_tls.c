/* check_dc_tls.c - the data channels' TLS record layer (transport/dc_tls.c) against
 * OpenSSL's own: a session whose context lacks tqkv__dctls_ctx_prepare keeps OpenSSL's
 * record layer, so every test pairs the userspace layer (or kTLS, where the kernel
 * has it) with the reference implementation on the other end of a real TCP loopback
 * connection, and with itself.
 *
 * Covered: large buffers crossing many records, frame-sized reads where records and
 * reads do not line up (a reader buffer smaller than a record, partial records left
 * at a read's end), key updates both ways (ours every few records, OpenSSL's with and
 * without update_requested), close_notify as EOF, a flipped ciphertext byte refused
 * (EPROTO, never wrong bytes), the three TLS 1.3 suites, and the path reported.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check_main.h"
#include "transport/dc_tls.h"

#define DEADLINE_NS (30ull * 1000000000ull)

static EVP_PKEY *g_key;
static X509 *g_cert;

static void
make_cert(void)
{
    if (g_cert)
        return;
    g_key = EVP_EC_gen("P-256");
    g_cert = X509_new();
    ck_assert_ptr_nonnull(g_key);
    ASN1_INTEGER_set(X509_get_serialNumber(g_cert), 1);
    X509_gmtime_adj(X509_getm_notBefore(g_cert), 0);
    X509_gmtime_adj(X509_getm_notAfter(g_cert), 3600);
    X509_set_pubkey(g_cert, g_key);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(g_cert), "CN", MBSTRING_ASC,
                               (const unsigned char *)"check", -1, -1, 0);
    X509_set_issuer_name(g_cert, X509_get_subject_name(g_cert));
    ck_assert_int_ne(X509_sign(g_cert, g_key, EVP_sha256()), 0);
}

/* A context: ours (the data channels' record layer) or OpenSSL's reference. */
static SSL_CTX *
ctx(int server, int ours, const char *suite)
{
    make_cert();
    SSL_CTX *c = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    ck_assert_ptr_nonnull(c);
    SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
    SSL_CTX_set_ciphersuites(c, suite ? suite : "TLS_AES_128_GCM_SHA256");
    SSL_CTX_set_num_tickets(c, 0);
    SSL_CTX_set_mode(c, SSL_MODE_AUTO_RETRY);
    if (server) {
        ck_assert_int_eq(SSL_CTX_use_certificate(c, g_cert), 1);
        ck_assert_int_eq(SSL_CTX_use_PrivateKey(c, g_key), 1);
    }
    if (ours)
        tqkv__dctls_ctx_prepare(c);
    return c;
}

typedef struct hs {
    SSL_CTX *ctx;
    int fd, server;
    SSL *ssl;
    char err[256];
} hs_t;

static void *
hs_main(void *arg)
{
    hs_t *h = arg;
    h->ssl = tqkv__dctls_handshake(h->ctx, h->fd, h->server ? NULL : "127.0.0.1",
                                   tqkv_clock_ns() + DEADLINE_NS, h->err, sizeof h->err);
    return NULL;
}

/* A TCP loopback connection (non-blocking ends, as the channels' are). */
static void
tcp_pair(int fds[2])
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(l, 0);
    ck_assert_int_eq(bind(l, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(listen(l, 1), 0);
    ck_assert_int_eq(getsockname(l, (struct sockaddr *)&a, &al), 0);
    fds[0] = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_eq(connect(fds[0], (struct sockaddr *)&a, sizeof a), 0);
    fds[1] = accept4(l, NULL, NULL, SOCK_NONBLOCK);
    ck_assert_int_ge(fds[1], 0);
    close(l);
    int one = 1;
    setsockopt(fds[0], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fds[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
}

typedef struct conn {
    tqkv__dcio_t c, s; /* client (reads, as libtqkv), server (writes, as tqkv-server) */
    SSL_CTX *cc, *sc;
} conn_t;

static void
conn_open(conn_t *k, int client_ours, int server_ours, const char *suite)
{
    int fds[2];
    tcp_pair(fds);
    k->cc = ctx(0, client_ours, suite);
    k->sc = ctx(1, server_ours, suite);
    SSL_CTX_set_verify(k->cc, SSL_VERIFY_NONE, NULL);
    hs_t hc = {.ctx = k->cc, .fd = fds[0]}, hsv = {.ctx = k->sc, .fd = fds[1], .server = 1};
    pthread_t th;
    pthread_create(&th, NULL, hs_main, &hsv);
    hs_main(&hc);
    pthread_join(th, NULL);
    ck_assert_msg(hc.ssl != NULL, "client handshake: %s", hc.err);
    ck_assert_msg(hsv.ssl != NULL, "server handshake: %s", hsv.err);
    k->c = (tqkv__dcio_t){fds[0], hc.ssl};
    k->s = (tqkv__dcio_t){fds[1], hsv.ssl};
}

static void
conn_close(conn_t *k)
{
    tqkv__dctls_free(k->c.ssl);
    tqkv__dctls_free(k->s.ssl);
    close(k->c.fd);
    close(k->s.fd);
    SSL_CTX_free(k->cc);
    SSL_CTX_free(k->sc);
}

static int
path_is(SSL *ssl, const char *want)
{
    char p[64];
    tqkv__dctls_path(ssl, p, sizeof p);
    return strcmp(p, want) == 0;
}

/* The path this kernel gives the userspace-capable side: kTLS when it has the tls
 * ULP, else userspace. Either way, never OpenSSL's. */
static int
path_fast(SSL *ssl)
{
    return path_is(ssl, "userspace") || path_is(ssl, "ktls") ||
           path_is(ssl, "tx ktls, rx userspace");
}

static uint8_t *
pattern(size_t n, uint32_t seed)
{
    uint8_t *b = malloc(n);
    uint64_t x = 0x9e3779b97f4a7c15ull ^ seed;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b[i] = (uint8_t)x;
    }
    return b;
}

/* Frames as the server writes them: a 16-byte header and a page per iov pair. */
typedef struct writer {
    tqkv__dcio_t *io;
    int frames;
    size_t page;
    const uint8_t *src;
    int rc;
    int key_update_at; /* OpenSSL writer: SSL_key_update before this frame (-1: never) */
    int key_update_type;
} writer_t;

static void *
writer_main(void *arg)
{
    writer_t *w = arg;
    w->rc = 0;
    for (int f = 0; f < w->frames && w->rc == 0; f++) {
        if (f == w->key_update_at)
            ck_assert_int_eq(SSL_key_update(w->io->ssl, w->key_update_type), 1);
        uint8_t hdr[16];
        memset(hdr, f, sizeof hdr);
        size_t len = w->page + (size_t)f * 37; /* page ends fall anywhere in a record */
        struct iovec iov[2] = {{hdr, sizeof hdr}, {(void *)(w->src + f), len}};
        w->rc = tqkv__dcio_write(w->io, iov, 2, tqkv_clock_ns() + DEADLINE_NS);
    }
    return NULL;
}

/* Reads the frames of writer w in reads of at most chunk bytes each (0: a header
 * then the whole page, as libtqkv does) and checks every byte. */
static void
read_frames(tqkv__dcio_t *io, const writer_t *w, size_t chunk)
{
    size_t maxp = w->page + (size_t)w->frames * 37;
    uint8_t *got = malloc(maxp);
    for (int f = 0; f < w->frames; f++) {
        uint8_t hdr[16], want[16];
        memset(want, f, sizeof want);
        ck_assert_int_eq(tqkv__dcio_read(io, hdr, sizeof hdr, tqkv_clock_ns() + DEADLINE_NS), 0);
        ck_assert_mem_eq(hdr, want, sizeof hdr);
        size_t len = w->page + (size_t)f * 37, off = 0;
        while (off < len) {
            size_t k = chunk && len - off > chunk ? chunk : len - off;
            ck_assert_msg(tqkv__dcio_read(io, got + off, k, tqkv_clock_ns() + DEADLINE_NS) == 0,
                          "frame %d at %zu: errno %d", f, off, errno);
            off += k;
        }
        ck_assert_msg(memcmp(got, w->src + f, len) == 0, "frame %d: wrong bytes", f);
    }
    free(got);
}

/* Server writes frames, client reads them: the bytes arrive whole and in order. */
static void
stream(int client_ours, int server_ours, const char *suite, int frames, size_t page, size_t chunk,
       int ku_at, int ku_type)
{
    conn_t k;
    conn_open(&k, client_ours, server_ours, suite);
    ck_assert(client_ours ? path_fast(k.c.ssl) : path_is(k.c.ssl, "openssl"));
    ck_assert(server_ours ? path_fast(k.s.ssl) : path_is(k.s.ssl, "openssl"));
    uint8_t *src = pattern(page + (size_t)frames * 38, (uint32_t)frames);
    writer_t w = {&k.s, frames, page, src, -1, ku_at, ku_type};
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    read_frames(&k.c, &w, chunk);
    pthread_join(th, NULL);
    ck_assert_int_eq(w.rc, 0);
    ck_assert_int_eq(tqkv__dcio_pending(&k.c), 0);
    free(src);
    conn_close(&k);
}

START_TEST(test_ours_to_ours_large)
{
    /* 1 MiB pages: 65 records each, a header record before them. */
    stream(1, 1, NULL, 12, (1u << 20) + 5, 0, -1, 0);
}
END_TEST

START_TEST(test_ours_to_openssl)
{
    stream(0, 1, NULL, 20, 100000, 0, -1, 0);
}
END_TEST

START_TEST(test_openssl_to_ours)
{
    stream(1, 0, NULL, 20, 100000, 0, -1, 0);
}
END_TEST

START_TEST(test_small_reads)
{
    /* Reads smaller than a record (7 and 1000 bytes) and a record straddling reads. */
    stream(1, 1, NULL, 6, 50000, 7, -1, 0);
    stream(1, 1, NULL, 10, 70000, 1000, -1, 0);
    stream(1, 0, NULL, 10, 70000, 1000, -1, 0);
}
END_TEST

START_TEST(test_small_pages)
{
    /* Pages far smaller than a record, many frames per recv(). */
    stream(1, 1, NULL, 400, 100, 0, -1, 0);
}
END_TEST

START_TEST(test_suites)
{
    stream(1, 1, "TLS_AES_256_GCM_SHA384", 5, 200000, 0, -1, 0);
    stream(1, 0, "TLS_AES_256_GCM_SHA384", 5, 200000, 0, -1, 0);
    stream(0, 1, "TLS_CHACHA20_POLY1305_SHA256", 5, 200000, 0, -1, 0);
    stream(1, 0, "TLS_CHACHA20_POLY1305_SHA256", 5, 200000, 0, -1, 0);
}
END_TEST

START_TEST(test_key_update_ours)
{
    /* Our writer rekeys every 5 records; OpenSSL and our reader follow. */
    tqkv__dctls_set_rekey_records(5);
    stream(0, 1, NULL, 8, 300000, 0, -1, 0);
    stream(1, 1, NULL, 8, 300000, 0, -1, 0);
    tqkv__dctls_set_rekey_records(0);
}
END_TEST

START_TEST(test_key_update_openssl)
{
    /* OpenSSL's writer sends KeyUpdate mid-stream; our reader follows it. */
    stream(1, 0, NULL, 6, 100000, 0, 3, SSL_KEY_UPDATE_NOT_REQUESTED);
    stream(1, 0, NULL, 6, 100000, 0, 2, SSL_KEY_UPDATE_REQUESTED);
}
END_TEST

START_TEST(test_key_update_requested)
{
    /* An OpenSSL reader asks our writer to update (its own KeyUpdate, requested):
     * our writer answers with one of its own, and OpenSSL reads on with the new key. */
    conn_t k;
    conn_open(&k, 0, 1, NULL); /* client: OpenSSL; server: ours */
    uint8_t *src = pattern(400000, 3);
    /* The client (OpenSSL) asks; the server reads the request with the next read. */
    ck_assert_int_eq(SSL_key_update(k.c.ssl, SSL_KEY_UPDATE_REQUESTED), 1);
    uint8_t x = 0x5a;
    struct iovec one = {&x, 1};
    ck_assert_int_eq(tqkv__dcio_write(&k.c, &one, 1, tqkv_clock_ns() + DEADLINE_NS), 0);
    uint8_t y = 0;
    ck_assert_int_eq(tqkv__dcio_read(&k.s, &y, 1, tqkv_clock_ns() + DEADLINE_NS), 0);
    ck_assert_int_eq(y, 0x5a);
    writer_t w = {&k.s, 4, 90000, src, -1, -1, 0};
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    read_frames(&k.c, &w, 0);
    pthread_join(th, NULL);
    ck_assert_int_eq(w.rc, 0);
    free(src);
    conn_close(&k);
}
END_TEST

START_TEST(test_close_notify_is_eof)
{
    conn_t k;
    conn_open(&k, 1, 0, NULL);
    uint8_t b[16] = {1};
    struct iovec iov = {b, sizeof b};
    ck_assert_int_eq(tqkv__dcio_write(&k.s, &iov, 1, tqkv_clock_ns() + DEADLINE_NS), 0);
    ck_assert_int_ge(SSL_shutdown(k.s.ssl), 0);
    uint8_t r[16];
    ck_assert_int_eq(tqkv__dcio_read(&k.c, r, sizeof r, tqkv_clock_ns() + DEADLINE_NS), 0);
    errno = 12345;
    ck_assert_int_eq(tqkv__dcio_read(&k.c, r, 1, tqkv_clock_ns() + DEADLINE_NS), -1);
    ck_assert_int_eq(errno, 0);
    conn_close(&k);
}
END_TEST

/* Relays a->b flipping one byte at offset flip_at (counted from the relay's start). */
typedef struct relay {
    int from, to;
    size_t flip_at, n;
} relay_t;

static void *
relay_main(void *arg)
{
    relay_t *r = arg;
    uint8_t buf[65536];
    for (;;) {
        struct pollfd pf = {r->from, POLLIN, 0};
        if (poll(&pf, 1, 10000) <= 0)
            break;
        ssize_t n = recv(r->from, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0)
            break;
        if (r->flip_at >= r->n && r->flip_at < r->n + (size_t)n)
            buf[r->flip_at - r->n] ^= 0x20;
        r->n += (size_t)n;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = send(r->to, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
            if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
                struct pollfd po = {r->to, POLLOUT, 0};
                poll(&po, 1, 1000);
                continue;
            }
            if (w < 0)
                return NULL;
            off += w;
        }
    }
    return NULL;
}

START_TEST(test_tampered_record)
{
    /* Handshake directly, then the server's records go through a relay that flips a
     * ciphertext byte: the reader fails with EPROTO, and never hands back bad bytes
     * as good (the read that hit the record fails). */
    conn_t k;
    conn_open(&k, 1, 1, NULL);
    int a[2], b[2];
    tcp_pair(a);
    tcp_pair(b);
    /* server writes into a[0] (its fd swapped in); relay a[1] -> b[0]; client reads b[1]. */
    tqkv__dcio_t s = {a[0], k.s.ssl}, c = {b[1], k.c.ssl};
    relay_t r = {a[1], b[0], 40000, 0};
    pthread_t th;
    pthread_create(&th, NULL, relay_main, &r);
    uint8_t *src = pattern(100000, 9), *got = malloc(100000);
    struct iovec iov = {src, 100000};
    ck_assert_int_eq(tqkv__dcio_write(&s, &iov, 1, tqkv_clock_ns() + DEADLINE_NS), 0);
    /* Records 0 and 1 (32 KiB) are intact; the flip is in record 2. */
    ck_assert_int_eq(tqkv__dcio_read(&c, got, 32768, tqkv_clock_ns() + DEADLINE_NS), 0);
    ck_assert_mem_eq(got, src, 32768);
    ck_assert_int_eq(tqkv__dcio_read(&c, got, 100000 - 32768, tqkv_clock_ns() + DEADLINE_NS), -1);
    ck_assert_int_eq(errno, EPROTO);
    /* And it stays refused. */
    ck_assert_int_eq(tqkv__dcio_read(&c, got, 1, tqkv_clock_ns() + DEADLINE_NS), -1);
    ck_assert_int_eq(errno, EPROTO);
    shutdown(a[0], SHUT_RDWR);
    pthread_join(th, NULL);
    for (int i = 0; i < 2; i++)
        close(a[i]), close(b[i]);
    free(src);
    free(got);
    conn_close(&k);
}
END_TEST

START_TEST(test_client_last)
{
    conn_t k;
    conn_open(&k, 1, 1, NULL);
    tqkv__dctls_note_client(k.c.ssl); /* as tqkv__dcc_connect does */
    char path[64], cipher[64];
    tqkv__dctls_client_last(path, sizeof path, cipher, sizeof cipher);
    ck_assert_msg(!strcmp(path, "userspace") || !strcmp(path, "ktls"), "path %s", path);
    ck_assert_str_eq(cipher, "TLSv1.3 TLS_AES_128_GCM_SHA256");
    conn_close(&k);
}
END_TEST

static Suite *
dc_tls_suite(void)
{
    Suite *s = suite_create("dc_tls");
    TCase *tc = tcase_create("records");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_ours_to_ours_large);
    tcase_add_test(tc, test_ours_to_openssl);
    tcase_add_test(tc, test_openssl_to_ours);
    tcase_add_test(tc, test_small_reads);
    tcase_add_test(tc, test_small_pages);
    tcase_add_test(tc, test_suites);
    tcase_add_test(tc, test_key_update_ours);
    tcase_add_test(tc, test_key_update_openssl);
    tcase_add_test(tc, test_key_update_requested);
    tcase_add_test(tc, test_close_notify_is_eof);
    tcase_add_test(tc, test_tampered_record);
    tcase_add_test(tc, test_client_last);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(dc_tls_suite)
