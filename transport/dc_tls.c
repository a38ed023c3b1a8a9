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
#include <openssl/core_names.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define SUITES "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
#define READ_BUFFER (256u << 10) /* read-ahead buffer: many records per recv */

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
            uint64_t now = tqkv_clock_ns();
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
    /* Where the userspace record layer cannot take over (take_over()), OpenSSL reads
     * ahead into a buffer this large: many records per recv(). */
    SSL_CTX_set_default_read_buffer_len(ctx, READ_BUFFER);
    tqkv__dctls_ctx_prepare(ctx);
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

/* ---- the record layer after the handshake ----
 *
 * A TLS 1.3 record: a 5-byte header (23, 0x0303, length), then the AEAD sealing of
 * (data || content type || zero padding) with the header as additional data, nonce =
 * the traffic IV XOR the record's sequence number (RFC 8446 5.2-5.3). Keys and IVs come
 * from the handshake's application traffic secrets (OpenSSL hands them to the keylog
 * callback) by HKDF-Expand-Label (RFC 8446 7.1-7.3); KeyUpdate (4.6.3) moves a
 * direction to the next secret. This is what the kernel does with kTLS, done here
 * where the kernel has none: the AEAD of OpenSSL's EVP encrypts straight from the
 * caller's buffers into a batch of records sent with one send(), and decrypts records
 * from a large receive buffer straight into the caller's buffer. */

#define REC_MAX 16384u                    /* plaintext per record (the TLS maximum) */
#define REC_CT_MAX (REC_MAX + 256u)       /* ciphertext length a record may declare */
#define REC_OVERHEAD (5u + 1u + 16u)      /* header, content type, tag */
#define WBUF_SMALL 4096u                  /* first write buffer (a hello) */
#define WBUF_BIG (256u << 10)             /* records gathered per send() */
#define RBUF_SMALL (5u + REC_CT_MAX + 2u) /* room for one whole record */
#define RBUF_BIG (256u << 10)             /* ciphertext per recv() for large reads */
#define CT_APP 23
#define CT_ALERT 21
#define CT_HANDSHAKE 22
#define HS_NEW_SESSION_TICKET 4
#define HS_KEY_UPDATE 24

enum { PATH_OPENSSL = 0, PATH_USER = 1, PATH_KTLS = 2 };
static const char *const path_names[] = {"openssl", "userspace", "ktls"};

typedef struct rl_dir {
    EVP_CIPHER_CTX *ctx;
    uint8_t secret[EVP_MAX_MD_SIZE];
    uint8_t iv[12];
    uint64_t seq;
    int have_secret;
} rl_dir_t;

typedef struct dctls {
    int tx, rx; /* PATH_* of each direction */
    const EVP_MD *md;
    const EVP_CIPHER *cipher;
    size_t keylen, hashlen;
    rl_dir_t w, r;
    int update_due; /* the peer asked for a KeyUpdate: send ours before the next record */
    uint8_t *wbuf;
    size_t wcap, wlen;
    uint8_t *rbuf; /* ciphertext received, [rhead, rtail) not yet decrypted */
    size_t rcap, rhead, rtail;
    uint8_t *pbuf; /* one record's plaintext the caller's buffer could not take */
    size_t poff, plen;
    int eof, broken;
} dctls_t;

static int ex_index = -1;
static pthread_once_t ex_once = PTHREAD_ONCE_INIT;
static _Atomic uint64_t rekey_records = 1ull << 24; /* AES-GCM: < 2^24.5 records a key */

static pthread_mutex_t last_mu = PTHREAD_MUTEX_INITIALIZER;
static char last_path[48], last_cipher[64];

void
tqkv__dctls_set_rekey_records(uint64_t n)
{
    atomic_store(&rekey_records, n ? n : 1ull << 24);
}

static void
dctls_free_cb(void *parent, void *ptr, CRYPTO_EX_DATA *ad, int idx, long argl, void *argp)
{
    (void)parent, (void)ad, (void)idx, (void)argl, (void)argp;
    dctls_t *t = ptr;
    if (t == NULL)
        return;
    EVP_CIPHER_CTX_free(t->w.ctx);
    EVP_CIPHER_CTX_free(t->r.ctx);
    OPENSSL_cleanse(&t->w, sizeof t->w);
    OPENSSL_cleanse(&t->r, sizeof t->r);
    free(t->wbuf);
    free(t->rbuf);
    free(t->pbuf);
    free(t);
}

static void
ex_init(void)
{
    ex_index = SSL_get_ex_new_index(0, NULL, NULL, NULL, dctls_free_cb);
}

static dctls_t *
state(const SSL *ssl)
{
    return ssl && ex_index >= 0 ? SSL_get_ex_data(ssl, ex_index) : NULL;
}

static int
hexval(int c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* OpenSSL's keylog line "CLIENT_TRAFFIC_SECRET_0 <client random> <secret>": the first
 * application traffic secrets, kept for the record layer (never written anywhere). */
static void
keylog_cb(const SSL *ssl, const char *line)
{
    dctls_t *t = state(ssl);
    if (t == NULL)
        return;
    int server = SSL_is_server(ssl);
    rl_dir_t *d;
    if (!strncmp(line, "CLIENT_TRAFFIC_SECRET_0 ", 24))
        d = server ? &t->r : &t->w;
    else if (!strncmp(line, "SERVER_TRAFFIC_SECRET_0 ", 24))
        d = server ? &t->w : &t->r;
    else
        return;
    const char *p = strchr(line + 24, ' ');
    if (p == NULL)
        return;
    p++;
    size_t n = 0;
    while (p[0] && p[1] && n < sizeof d->secret) {
        int hi = hexval(p[0]), lo = hexval(p[1]);
        if (hi < 0 || lo < 0)
            return;
        d->secret[n++] = (uint8_t)(hi << 4 | lo);
        p += 2;
    }
    d->have_secret = n > 0 && *p == '\0' ? (int)n : 0;
}

void
tqkv__dctls_ctx_prepare(SSL_CTX *ctx)
{
    pthread_once(&ex_once, ex_init);
    SSL_CTX_set_keylog_callback(ctx, keylog_cb);
    /* kTLS where the kernel has it (OpenSSL tries at the key change, falls back
     * quietly); the state of each direction is read after the handshake. */
    SSL_CTX_set_options(ctx, SSL_OP_ENABLE_KTLS);
    /* No read-ahead during the handshake: the socket must hold every byte after the
     * last handshake record when the record layer takes over. */
    SSL_CTX_set_read_ahead(ctx, 0);
}

/* HKDF-Expand-Label(secret, label, "", n) of RFC 8446 7.1. 0 or -1. */
static int
expand_label(const EVP_MD *md, const uint8_t *secret, size_t slen, const char *label, uint8_t *out,
             size_t n)
{
    uint8_t info[2 + 1 + 255 + 1];
    size_t ll = 6 + strlen(label);
    info[0] = (uint8_t)(n >> 8);
    info[1] = (uint8_t)n;
    info[2] = (uint8_t)ll;
    memcpy(info + 3, "tls13 ", 6);
    memcpy(info + 9, label, ll - 6);
    info[3 + ll] = 0; /* empty context */
    EVP_KDF *kdf = EVP_KDF_fetch(NULL, "HKDF", NULL);
    EVP_KDF_CTX *k = kdf ? EVP_KDF_CTX_new(kdf) : NULL;
    EVP_KDF_free(kdf);
    if (k == NULL)
        return -1;
    int mode = EVP_KDF_HKDF_MODE_EXPAND_ONLY;
    OSSL_PARAM ps[] = {
        OSSL_PARAM_construct_int(OSSL_KDF_PARAM_MODE, &mode),
        OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, (char *)EVP_MD_get0_name(md), 0),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, (void *)secret, slen),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info, 4 + ll),
        OSSL_PARAM_construct_end(),
    };
    int rc = EVP_KDF_derive(k, out, n, ps) == 1 ? 0 : -1;
    EVP_KDF_CTX_free(k);
    return rc;
}

/* Keys direction d from its secret (sequence number 0). 0 or -1. */
static int
dir_keys(dctls_t *t, rl_dir_t *d, int enc)
{
    uint8_t key[32];
    if (expand_label(t->md, d->secret, t->hashlen, "key", key, t->keylen) != 0 ||
        expand_label(t->md, d->secret, t->hashlen, "iv", d->iv, sizeof d->iv) != 0)
        return -1;
    if (d->ctx == NULL && (d->ctx = EVP_CIPHER_CTX_new()) == NULL)
        return -1;
    int rc = EVP_CipherInit_ex(d->ctx, t->cipher, NULL, key, NULL, enc) == 1 ? 0 : -1;
    OPENSSL_cleanse(key, sizeof key);
    d->seq = 0;
    return rc;
}

/* The next traffic secret of d (KeyUpdate) and its keys. 0 or -1. */
static int
dir_update(dctls_t *t, rl_dir_t *d, int enc)
{
    uint8_t next[EVP_MAX_MD_SIZE];
    if (expand_label(t->md, d->secret, t->hashlen, "traffic upd", next, t->hashlen) != 0)
        return -1;
    memcpy(d->secret, next, t->hashlen);
    OPENSSL_cleanse(next, sizeof next);
    return dir_keys(t, d, enc);
}

static void
nonce(const rl_dir_t *d, uint8_t out[12])
{
    memcpy(out, d->iv, 12);
    for (int i = 0; i < 8; i++)
        out[11 - i] ^= (uint8_t)(d->seq >> (8 * i));
}

/* Takes the record layer over from OpenSSL after the handshake: kTLS where OpenSSL
 * turned it on, else the userspace layer for the suites it knows, else OpenSSL's own
 * records (read-ahead then on). Never fails: the worst case is OpenSSL's path. */
static void
take_over(SSL *ssl)
{
    dctls_t *t = state(ssl);
    if (t == NULL)
        return;
    t->tx = BIO_get_ktls_send(SSL_get_wbio(ssl)) ? PATH_KTLS : PATH_OPENSSL;
    t->rx = BIO_get_ktls_recv(SSL_get_rbio(ssl)) ? PATH_KTLS : PATH_OPENSSL;
    const SSL_CIPHER *c = SSL_get_current_cipher(ssl);
    uint32_t id = c ? SSL_CIPHER_get_id(c) : 0;
    t->cipher = id == TLS1_3_CK_AES_128_GCM_SHA256         ? EVP_aes_128_gcm()
                : id == TLS1_3_CK_AES_256_GCM_SHA384       ? EVP_aes_256_gcm()
                : id == TLS1_3_CK_CHACHA20_POLY1305_SHA256 ? EVP_chacha20_poly1305()
                                                           : NULL;
    t->keylen = id == TLS1_3_CK_AES_128_GCM_SHA256 ? 16 : 32;
    t->md = c ? SSL_CIPHER_get_handshake_digest(c) : NULL;
    t->hashlen = t->md ? (size_t)EVP_MD_get_size(t->md) : 0;
    /* Only a session that has not moved any application record yet (nothing pending
     * inside OpenSSL) may be taken over at sequence number 0. */
    int fresh = SSL_version(ssl) == TLS1_3_VERSION && t->cipher && t->md && !SSL_has_pending(ssl);
    if (t->tx == PATH_OPENSSL && fresh && (size_t)t->w.have_secret == t->hashlen &&
        dir_keys(t, &t->w, 1) == 0)
        t->tx = PATH_USER;
    if (t->rx == PATH_OPENSSL && fresh && (size_t)t->r.have_secret == t->hashlen &&
        dir_keys(t, &t->r, 0) == 0)
        t->rx = PATH_USER;
    if (t->rx == PATH_OPENSSL)
        SSL_set_read_ahead(ssl, 1); /* many records per recv() inside OpenSSL */
    if (t->tx != PATH_USER)
        OPENSSL_cleanse(t->w.secret, sizeof t->w.secret);
    if (t->rx != PATH_USER)
        OPENSSL_cleanse(t->r.secret, sizeof t->r.secret);
}

void
tqkv__dctls_path(SSL *ssl, char *buf, size_t cap)
{
    dctls_t *t = state(ssl);
    int tx = t ? t->tx : PATH_OPENSSL, rx = t ? t->rx : PATH_OPENSSL;
    if (tx == rx)
        snprintf(buf, cap, "%s", path_names[tx]);
    else
        snprintf(buf, cap, "tx %s, rx %s", path_names[tx], path_names[rx]);
}

void
tqkv__dctls_note_client(SSL *ssl)
{
    pthread_mutex_lock(&last_mu);
    tqkv__dctls_path(ssl, last_path, sizeof last_path);
    snprintf(last_cipher, sizeof last_cipher, "%s %s", SSL_get_version(ssl),
             SSL_get_cipher_name(ssl));
    pthread_mutex_unlock(&last_mu);
}

void
tqkv__dctls_client_last(char *path, size_t pcap, char *cipher, size_t ccap)
{
    pthread_mutex_lock(&last_mu);
    snprintf(path, pcap, "%s", last_path);
    snprintf(cipher, ccap, "%s", last_cipher);
    pthread_mutex_unlock(&last_mu);
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
    pthread_once(&ex_once, ex_init);
    SSL *ssl = SSL_new(ctx);
    char b[200];
    dctls_t *t = calloc(1, sizeof *t);
    if (ssl == NULL || t == NULL || ex_index < 0 || SSL_set_ex_data(ssl, ex_index, t) != 1 ||
        SSL_set_fd(ssl, fd) != 1) {
        snprintf(err, errlen, "TLS: %s", ssl_reason(b, sizeof b, "cannot create a session"));
        if (ssl && t && ex_index >= 0 && SSL_get_ex_data(ssl, ex_index) == t)
            t = NULL; /* SSL_free frees it */
        free(t);
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
        if (rc == 1) {
            take_over(ssl);
            return ssl;
        }
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

void
tqkv__dctls_free(SSL *ssl)
{
    SSL_free(ssl); /* the record layer's state goes with it (ex_data) */
}

int
tqkv__dcio_pending(const tqkv__dcio_t *io)
{
    if (io->ssl == NULL)
        return 0;
    dctls_t *t = state(io->ssl);
    if (t && t->rx == PATH_USER)
        return t->plen > t->poff || t->rtail > t->rhead;
    return SSL_has_pending(io->ssl);
}

void
tqkv__dctls_describe(SSL *ssl, const char **version, const char **cipher)
{
    *version = SSL_get_version(ssl);
    *cipher = SSL_get_cipher_name(ssl);
}

/* ---- userspace records: writing ---- */

static int sock_write(int fd, struct iovec *iov, int n, uint64_t deadline_ns);

/* Sends t's write buffer whole. 0, or -1 with errno. */
static int
wflush(dctls_t *t, int fd, uint64_t deadline_ns)
{
    struct iovec v = {t->wbuf, t->wlen};
    if (t->wlen > 0 && sock_write(fd, &v, 1, deadline_ns) != 0)
        return -1;
    t->wlen = 0;
    return 0;
}

/* Seals one record of type ct holding src[0..n) (n <= REC_MAX) at the end of the write
 * buffer (room checked by the caller). 0, or -1 (errno EPROTO). */
static int
seal(dctls_t *t, int ct, const uint8_t *src, size_t n)
{
    rl_dir_t *d = &t->w;
    uint8_t *h = t->wbuf + t->wlen, *out = h + 5, nv[12], type = (uint8_t)ct;
    size_t len = n + 1 + 16;
    int l;
    h[0] = CT_APP; /* the outer type of every TLS 1.3 record */
    h[1] = 3;
    h[2] = 3;
    h[3] = (uint8_t)(len >> 8);
    h[4] = (uint8_t)len;
    nonce(d, nv);
    if (EVP_EncryptInit_ex(d->ctx, NULL, NULL, NULL, nv) != 1 ||
        EVP_EncryptUpdate(d->ctx, NULL, &l, h, 5) != 1 ||
        (n && EVP_EncryptUpdate(d->ctx, out, &l, src, (int)n) != 1) ||
        EVP_EncryptUpdate(d->ctx, out + n, &l, &type, 1) != 1 ||
        EVP_EncryptFinal_ex(d->ctx, out + n + 1, &l) != 1 ||
        EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_AEAD_GET_TAG, 16, out + n + 1) != 1) {
        ERR_clear_error();
        errno = EPROTO;
        return -1;
    }
    d->seq++;
    t->wlen += 5 + len;
    return 0;
}

/* Room for a record of n bytes in the write buffer: grown (up to WBUF_BIG) towards the
 * total bytes of this write, else flushed. 0, or -1 with errno. */
static int
wroom(dctls_t *t, int fd, size_t n, size_t total, uint64_t deadline_ns)
{
    size_t need = n + REC_OVERHEAD;
    if (t->wcap - t->wlen >= need)
        return 0;
    if (t->wcap < WBUF_BIG) {
        size_t want = t->wlen + total + REC_OVERHEAD * (total / REC_MAX + 2);
        want = want < WBUF_SMALL ? WBUF_SMALL : want > WBUF_BIG ? WBUF_BIG : want;
        uint8_t *nb = want > t->wcap ? realloc(t->wbuf, want) : NULL;
        if (nb) {
            t->wbuf = nb;
            t->wcap = want;
        }
        if (t->wcap - t->wlen >= need)
            return 0;
    }
    if (wflush(t, fd, deadline_ns) != 0)
        return -1;
    if (t->wcap < need) {
        uint8_t *nb = realloc(t->wbuf, need);
        if (nb == NULL) {
            errno = ENOMEM;
            return -1;
        }
        t->wbuf = nb;
        t->wcap = need;
    }
    return 0;
}

/* A KeyUpdate of our own (update_requested 0) when the key has sealed its share of
 * records or the peer asked for one; the following records use the next key. */
static int
maybe_rekey(dctls_t *t, int fd, uint64_t deadline_ns)
{
    if (!t->update_due && t->w.seq < atomic_load(&rekey_records))
        return 0;
    static const uint8_t ku[5] = {HS_KEY_UPDATE, 0, 0, 1, 0};
    if (wroom(t, fd, sizeof ku, sizeof ku, deadline_ns) != 0 ||
        seal(t, CT_HANDSHAKE, ku, sizeof ku) != 0)
        return -1;
    if (dir_update(t, &t->w, 1) != 0) {
        errno = EPROTO;
        return -1;
    }
    t->update_due = 0;
    return 0;
}

/* Each iov element starts a record: a frame header and a page never share one, so
 * the reader decrypts a page's records straight into its page buffer. */
static int
user_write(dctls_t *t, int fd, const struct iovec *iov, int n, uint64_t deadline_ns)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += iov[i].iov_len;
    for (int i = 0; i < n; i++) {
        const uint8_t *p = iov[i].iov_base;
        size_t left = iov[i].iov_len;
        while (left > 0) {
            size_t k = left < REC_MAX ? left : REC_MAX;
            if (maybe_rekey(t, fd, deadline_ns) != 0 || wroom(t, fd, k, total, deadline_ns) != 0 ||
                seal(t, CT_APP, p, k) != 0)
                return -1;
            p += k;
            left -= k;
            total -= k;
        }
    }
    return wflush(t, fd, deadline_ns);
}

/* ---- userspace records: reading ---- */

/* Opens the record at rbuf[rhead] (5 + len bytes, whole) into dst when its plaintext
 * fits in cap bytes, else into pbuf. Sets *type and *got (plaintext bytes, at dst or
 * pbuf). 0, or -1 (errno EPROTO: bad tag, a record without a content type). */
static int
open_record(dctls_t *t, size_t len, uint8_t *dst, size_t cap, int *type, size_t *got, int *in_pbuf)
{
    rl_dir_t *d = &t->r;
    const uint8_t *h = t->rbuf + t->rhead, *ct = h + 5;
    size_t inner = len - 16;
    uint8_t nv[12], last = 0, *out = dst;
    *in_pbuf = inner - 1 > cap;
    if (*in_pbuf) {
        if (t->pbuf == NULL && (t->pbuf = malloc(REC_CT_MAX)) == NULL) {
            errno = ENOMEM;
            return -1;
        }
        out = t->pbuf;
    }
    int l;
    nonce(d, nv);
    if (EVP_DecryptInit_ex(d->ctx, NULL, NULL, NULL, nv) != 1 ||
        EVP_DecryptUpdate(d->ctx, NULL, &l, h, 5) != 1 ||
        (inner > 1 && EVP_DecryptUpdate(d->ctx, out, &l, ct, (int)(inner - 1)) != 1) ||
        EVP_DecryptUpdate(d->ctx, &last, &l, ct + inner - 1, 1) != 1 ||
        EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_AEAD_SET_TAG, 16, (void *)(ct + inner)) != 1 ||
        EVP_DecryptFinal_ex(d->ctx, nv, &l) != 1) {
        ERR_clear_error();
        errno = EPROTO; /* bad record MAC: tampered or out of step */
        return -1;
    }
    d->seq++;
    size_t n = inner - 1;
    while (last == 0 && n > 0) /* zero padding: the type is the last non-zero byte */
        last = out[--n];
    if (last == 0) {
        errno = EPROTO;
        return -1;
    }
    *type = last;
    *got = n;
    return 0;
}

/* A control record's plaintext p[0..n): close_notify (EOF), KeyUpdate, a session
 * ticket (ignored). 0 to go on, -1 with errno (0: EOF). */
static int
control(dctls_t *t, int type, const uint8_t *p, size_t n)
{
    if (type == CT_ALERT) {
        errno = n == 2 && p[1] == 0 ? 0 : EPROTO; /* close_notify, or a fatal alert */
        if (errno == 0)
            t->eof = 1;
        return -1;
    }
    if (type != CT_HANDSHAKE) {
        errno = EPROTO;
        return -1;
    }
    while (n > 0) {
        if (n < 4) {
            errno = EPROTO;
            return -1;
        }
        size_t ml = (size_t)p[1] << 16 | (size_t)p[2] << 8 | p[3];
        if (ml > n - 4) {
            errno = EPROTO; /* a message split across records: not sent by OpenSSL */
            return -1;
        }
        if (p[0] == HS_KEY_UPDATE) {
            if (ml != 1 || p[4] > 1 || n != 5 || dir_update(t, &t->r, 0) != 0) {
                errno = EPROTO;
                return -1;
            }
            t->update_due |= p[4] == 1;
        } else if (p[0] != HS_NEW_SESSION_TICKET) {
            errno = EPROTO;
            return -1;
        }
        p += 4 + ml;
        n -= 4 + ml;
    }
    return 0;
}

static int
user_read(dctls_t *t, int fd, uint8_t *p, size_t n, uint64_t deadline_ns)
{
    if (t->broken) {
        errno = EPROTO;
        return -1;
    }
    if (n > REC_MAX && t->rcap < RBUF_BIG) { /* a large read: large recv()s */
        uint8_t *nb = realloc(t->rbuf, RBUF_BIG);
        if (nb) {
            t->rbuf = nb;
            t->rcap = RBUF_BIG;
        }
    }
    if (t->rbuf == NULL) {
        if ((t->rbuf = malloc(RBUF_SMALL)) == NULL) {
            errno = ENOMEM;
            return -1;
        }
        t->rcap = RBUF_SMALL;
    }
    while (n > 0) {
        if (t->plen > t->poff) {
            size_t k = t->plen - t->poff < n ? t->plen - t->poff : n;
            memcpy(p, t->pbuf + t->poff, k);
            t->poff += k;
            p += k;
            n -= k;
            continue;
        }
        if (t->eof) {
            errno = 0;
            return -1;
        }
        size_t have = t->rtail - t->rhead, need = 5;
        if (have >= 5) {
            const uint8_t *h = t->rbuf + t->rhead;
            size_t len = (size_t)h[3] << 8 | h[4];
            if (h[0] != CT_APP || h[1] != 3 || h[2] != 3 || len < 17 || len > REC_CT_MAX) {
                t->broken = 1;
                errno = EPROTO;
                return -1;
            }
            need = 5 + len;
            if (have >= need) {
                int type, in_pbuf;
                size_t got;
                if (open_record(t, len, p, n, &type, &got, &in_pbuf) != 0) {
                    t->broken = errno == EPROTO;
                    return -1;
                }
                t->rhead += need;
                if (t->rhead == t->rtail)
                    t->rhead = t->rtail = 0;
                if (type == CT_APP) {
                    if (in_pbuf) {
                        t->poff = 0;
                        t->plen = got;
                    } else {
                        p += got;
                        n -= got;
                    }
                    continue;
                }
                /* A control record opened into the caller's buffer is overwritten later. */
                if (control(t, type, in_pbuf ? t->pbuf : p, got) != 0) {
                    t->broken = errno == EPROTO;
                    return -1;
                }
                continue;
            }
        }
        /* More ciphertext: as much as fits, the partial record moved to the front. */
        if (t->rhead > 0 && (t->rcap - t->rhead < need || t->rcap - t->rtail < t->rcap / 4)) {
            memmove(t->rbuf, t->rbuf + t->rhead, have);
            t->rhead = 0;
            t->rtail = have;
        }
        if (t->rtail == t->rcap) { /* cannot be: the buffer holds a whole record */
            t->broken = 1;
            errno = EPROTO;
            return -1;
        }
        ssize_t r = recv(fd, t->rbuf + t->rtail, t->rcap - t->rtail, MSG_DONTWAIT);
        if (r > 0) {
            t->rtail += (size_t)r;
            continue;
        }
        if (r == 0) {
            errno = 0; /* EOF without close_notify */
            return -1;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (tqkv__dcio_wait(fd, POLLIN, deadline_ns) != 0)
            return -1;
    }
    return 0;
}

/* ---- whole writes and reads, any path ---- */

static int
sock_write(int fd, struct iovec *iov, int n, uint64_t deadline_ns)
{
    while (n > 0) {
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)n;
        ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) &&
                tqkv__dcio_wait(fd, POLLOUT, deadline_ns) == 0)
                continue;
            return -1;
        }
        size_t w = (size_t)r;
        while (n > 0 && w >= iov->iov_len) {
            w -= iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + w;
            iov->iov_len -= w;
        }
    }
    return 0;
}

/* OpenSSL's own record layer: writes (wr) or reads all n bytes at p through ssl,
 * waiting on fd as it asks, until deadline_ns. 0, or -1 with errno. */
static int
ssl_xfer(SSL *ssl, int fd, int wr, void *buf, size_t n, uint64_t deadline_ns)
{
    uint8_t *p = buf;
    while (n > 0) {
        size_t done = 0;
        ERR_clear_error();
        int rc = wr ? SSL_write_ex(ssl, p, n, &done) : SSL_read_ex(ssl, p, n, &done);
        if (rc == 1) {
            p += done;
            n -= done;
            continue;
        }
        if (ssl_wait(ssl, fd, rc, deadline_ns) != 0)
            return -1;
    }
    return 0;
}

int
tqkv__dcio_write(tqkv__dcio_t *io, struct iovec *iov, int n, uint64_t deadline_ns)
{
    dctls_t *t = state(io->ssl);
    /* Plain TCP, and kTLS: the kernel seals what sendmsg() gives it. */
    if (io->ssl == NULL || (t && t->tx == PATH_KTLS))
        return sock_write(io->fd, iov, n, deadline_ns);
    if (t && t->tx == PATH_USER)
        return user_write(t, io->fd, iov, n, deadline_ns);
    for (; n > 0; iov++, n--) {
        if (ssl_xfer(io->ssl, io->fd, 1, iov->iov_base, iov->iov_len, deadline_ns) != 0) {
            if (errno == 0)
                errno = EPIPE;
            return -1;
        }
    }
    return 0;
}

int
tqkv__dcio_read(tqkv__dcio_t *io, void *buf, size_t n, uint64_t deadline_ns)
{
    uint8_t *p = buf;
    dctls_t *t = state(io->ssl);
    if (t && t->rx == PATH_USER)
        return user_read(t, io->fd, p, n, deadline_ns);
    if (io->ssl)
        return ssl_xfer(io->ssl, io->fd, 0, p, n, deadline_ns);
    while (n > 0) {
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
