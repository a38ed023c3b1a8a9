/* tls.c - server TLS / mutual TLS credentials from PEM files, reloadable.
 *
 * The files are checked for the PEM blocks they must hold, and (tqkv_tls_create,
 * tqkv_tls_reload) with OpenSSL: the chain parses, the key matches the certificate, the
 * certificate is valid now. A wrong path, a swapped cert/key or a half-rotated pair is
 * reported naming the file instead of surfacing later as an opaque handshake failure, and
 * on a reload the pair in force stays. gRPC copies the PEM strings into its credentials,
 * so our copies are wiped and freed before returning.
 *
 * Reload: the credentials are built with gRPC's certificate config fetcher, which the
 * core calls at every new handshake. A reload parks the new configuration in `pending`
 * (under mu); the next fetch hands it to gRPC (which takes ownership) and answers NEW,
 * otherwise UNCHANGED. Connections already up are not touched.
 */
#include "service/tls.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kernels/errtext.h"

/* PEM files larger than this are certainly not a certificate chain or a key. */
#define TLS_MAX_PEM_BYTES (16u << 20)

/* What read_pem accepts as a certificate and as a private key. */
static const char *const cert_markers[] = {"-----BEGIN CERTIFICATE-----", NULL};
static const char *const key_markers[] = {
    "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA PRIVATE KEY-----",
    "-----BEGIN EC PRIVATE KEY-----", "-----BEGIN ENCRYPTED PRIVATE KEY-----", NULL};

tqkv_status_t
tqkv_tls_process_init(void)
{
    return OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, NULL) == 1 ? TQKV_OK : TQKV_EINTERNAL;
}

tqkv_status_t
tqkv_read_file(const char *path, char **out, size_t *len)
{
    tqkv_status_t st;
    *out = NULL;
    if (len != NULL)
        *len = 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        st = TQKV_EIO;
        goto fail_open;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (buf == NULL) {
        st = TQKV_ENOMEM;
        goto fail_alloc;
    }
    for (;;) {
        if (n + 1 >= cap) {
            if (cap >= TLS_MAX_PEM_BYTES * 4) {
                st = TQKV_EINVAL;
                goto fail_read;
            }
            char *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                st = TQKV_ENOMEM;
                goto fail_read;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) {
            if (ferror(f)) {
                st = TQKV_EIO;
                goto fail_read;
            }
            break;
        }
    }
    buf[n] = '\0';
    fclose(f);
    *out = buf;
    if (len != NULL)
        *len = n;
    return TQKV_OK;

fail_read:
    free(buf);
fail_alloc:
    fclose(f);
fail_open:
    return st;
}

/* Reads a PEM file that must contain `marker` (e.g. "-----BEGIN CERTIFICATE-----").
 * `what` names the role in messages ("certificate", "private key", ...). */
static tqkv_status_t
read_pem(const char *path, const char *what, const char *const *markers, char **out, char *err,
         size_t errlen)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        return tqkv_errtext(TQKV_EIO, err, errlen, "%s: cannot read TLS %s: %s", path, what,
                            strerror(errno));
    }
    if (!S_ISREG(sb.st_mode)) {
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS %s is not a regular file", path,
                            what);
    }
    if ((unsigned long long)sb.st_size > TLS_MAX_PEM_BYTES) {
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS %s is larger than %u bytes", path,
                            what, TLS_MAX_PEM_BYTES);
    }
    size_t len = 0;
    tqkv_status_t st = tqkv_read_file(path, out, &len);
    if (st != TQKV_OK) {
        return tqkv_errtext(st, err, errlen, "%s: cannot read TLS %s: %s", path, what,
                            st == TQKV_EIO ? strerror(errno) : tqkv_strerror(st));
    }
    if (strlen(*out) != len) {
        tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS %s is not PEM text (NUL byte)", path, what);
        goto fail;
    }
    for (const char *const *m = markers; *m != NULL; m++)
        if (strstr(*out, *m) != NULL)
            return TQKV_OK;
    tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS %s is not PEM (no '%s' block)", path, what,
                 markers[0]);
fail:
    memset(*out, 0, len);
    free(*out);
    *out = NULL;
    return TQKV_EINVAL;
}

static void
wipe_free(char *s)
{
    if (s == NULL)
        return;
    memset(s, 0, strlen(s));
    free(s);
}

/* Reads the certificate, the (unencrypted) key and, with ca_path, the client CA into new
 * NUL-terminated strings; on failure frees what it read (all three NULL). */
static tqkv_status_t
read_pems(const char *cert_path, const char *key_path, const char *ca_path, char **cert, char **key,
          char **ca, char *err, size_t errlen)
{
    tqkv_status_t st;
    *cert = *key = *ca = NULL;
    if ((st = read_pem(cert_path, "certificate", cert_markers, cert, err, errlen)) != TQKV_OK)
        return st;
    if ((st = read_pem(key_path, "private key", key_markers, key, err, errlen)) != TQKV_OK)
        goto fail_key;
    if (strstr(*key, "-----BEGIN ENCRYPTED PRIVATE KEY-----") != NULL) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen,
                          "%s: TLS private key is encrypted (a passphrase-less key is needed)",
                          key_path);
        goto fail_ca;
    }
    if (ca_path != NULL &&
        (st = read_pem(ca_path, "client CA", cert_markers, ca, err, errlen)) != TQKV_OK)
        goto fail_ca;
    return TQKV_OK;

fail_ca:
    wipe_free(*key);
    *key = NULL;
fail_key:
    wipe_free(*cert);
    *cert = NULL;
    return st;
}

tqkv_status_t
tqkv_tls_server_creds(const char *cert_path, const char *key_path, const char *client_ca_path,
                      grpc_server_credentials **out, char *err, size_t errlen)
{
    tqkv_status_t st;
    char *cert = NULL, *key = NULL, *ca = NULL;
    *out = NULL;
    if (cert_path == NULL || key_path == NULL) {
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "TLS needs both a certificate (--tls-cert) and a key (--tls-key)");
    }
    if ((st = read_pems(cert_path, key_path, client_ca_path, &cert, &key, &ca, err, errlen)) !=
        TQKV_OK)
        return st;

    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    grpc_server_credentials *c = grpc_ssl_server_credentials_create_ex(
        ca, &pair, 1,
        ca != NULL ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
    if (c == NULL) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s, %s: gRPC rejected the TLS certificate/key",
                          cert_path, key_path);
        goto fail_creds;
    }
    wipe_free(ca);
    wipe_free(key);
    wipe_free(cert);
    *out = c;
    return TQKV_OK;

fail_creds:
    wipe_free(ca);
    wipe_free(key);
    wipe_free(cert);
    return st;
}

/* ---- reloadable credentials ---- */

struct tqkv_tls {
    char cert_path[1024], key_path[1024], ca_path[1024]; /* ca_path "" without mTLS */
    pthread_mutex_t mu;                                  /* guards pending, digest, not_after */
    grpc_ssl_server_certificate_config *pending;         /* handed to gRPC at the next fetch */
    unsigned char digest[32];                            /* SHA-256 of cert, key and CA in force */
    double not_after;
};

static int
no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return 0; /* never prompt: an encrypted key is an error */
}

/* OpenSSL's first queued error as text (and clears the queue). */
static const char *
ssl_reason(char *buf, size_t n)
{
    unsigned long e = ERR_get_error();
    if (e == 0)
        snprintf(buf, n, "no PEM data");
    else
        ERR_error_string_n(e, buf, n);
    ERR_clear_error();
    return buf;
}

static double
asn1_time_unix(const ASN1_TIME *t)
{
    struct tm tm;
    memset(&tm, 0, sizeof tm);
    if (ASN1_TIME_to_tm(t, &tm) != 1)
        return 0;
    return (double)timegm(&tm);
}

/* Checks with OpenSSL what gRPC would only find out at a handshake. *not_after gets the
 * certificate's expiry. */
static tqkv_status_t
check_pem(const char *cert_path, const char *cert, const char *key_path, const char *key,
          const char *ca_path, const char *ca, double *not_after, char *err, size_t errlen)
{
    char why[256];
    tqkv_status_t st = TQKV_EINVAL;
    X509 *x = NULL;
    EVP_PKEY *k = NULL;
    BIO *b = BIO_new_mem_buf(cert, -1);
    if (b == NULL || (x = PEM_read_bio_X509(b, NULL, no_passphrase, NULL)) == NULL) {
        tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS certificate does not parse: %s", cert_path,
                     ssl_reason(why, sizeof why));
        goto out;
    }
    BIO_free(b);
    b = BIO_new_mem_buf(key, -1);
    if (b == NULL || (k = PEM_read_bio_PrivateKey(b, NULL, no_passphrase, NULL)) == NULL) {
        tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS private key does not parse: %s", key_path,
                     ssl_reason(why, sizeof why));
        goto out;
    }
    if (X509_check_private_key(x, k) != 1) {
        ERR_clear_error();
        tqkv_errtext(TQKV_EINVAL, err, errlen,
                     "%s, %s: the private key does not match the certificate", key_path, cert_path);
        goto out;
    }
    if (X509_cmp_current_time(X509_get0_notAfter(x)) <= 0) {
        tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS certificate has expired", cert_path);
        goto out;
    }
    if (X509_cmp_current_time(X509_get0_notBefore(x)) > 0) {
        tqkv_errtext(TQKV_EINVAL, err, errlen,
                     "%s: TLS certificate is not valid yet (notBefore in the future)", cert_path);
        goto out;
    }
    *not_after = asn1_time_unix(X509_get0_notAfter(x));
    if (ca != NULL) {
        BIO_free(b);
        X509 *c = NULL;
        b = BIO_new_mem_buf(ca, -1);
        if (b == NULL || (c = PEM_read_bio_X509(b, NULL, no_passphrase, NULL)) == NULL) {
            tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: TLS client CA does not parse: %s", ca_path,
                         ssl_reason(why, sizeof why));
            goto out;
        }
        X509_free(c);
    }
    st = TQKV_OK;
out:
    BIO_free(b);
    X509_free(x);
    EVP_PKEY_free(k);
    return st;
}

/* Reads and checks the three files into a new gRPC certificate config (*cfg) and the
 * SHA-256 of their contents. */
static tqkv_status_t
load_config(tqkv_tls_t *t, grpc_ssl_server_certificate_config **cfg, unsigned char digest[32],
            double *not_after, char *err, size_t errlen)
{
    tqkv_status_t st;
    char *cert = NULL, *key = NULL, *ca = NULL;
    const char *ca_path = t->ca_path[0] ? t->ca_path : NULL;
    *cfg = NULL;
    if ((st = read_pems(t->cert_path, t->key_path, ca_path, &cert, &key, &ca, err, errlen)) !=
        TQKV_OK)
        return st;
    if ((st = check_pem(t->cert_path, cert, t->key_path, key, ca_path, ca, not_after, err,
                        errlen)) != TQKV_OK)
        goto out;
    EVP_MD_CTX *h = EVP_MD_CTX_new();
    if (h == NULL || EVP_DigestInit_ex(h, EVP_sha256(), NULL) != 1 ||
        EVP_DigestUpdate(h, cert, strlen(cert) + 1) != 1 ||
        EVP_DigestUpdate(h, key, strlen(key) + 1) != 1 ||
        (ca && EVP_DigestUpdate(h, ca, strlen(ca) + 1) != 1) ||
        EVP_DigestFinal_ex(h, digest, NULL) != 1) {
        EVP_MD_CTX_free(h);
        st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s: cannot hash the TLS files (OpenSSL)",
                          t->cert_path);
        goto out;
    }
    EVP_MD_CTX_free(h);
    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    /* gRPC (1.51) asserts that a fetched configuration has root certificates even when no
     * client certificate is requested; without mutual TLS they are never used (no
     * CertificateRequest is sent), so the server's own chain stands in. */
    *cfg = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &pair, 1);
    if (*cfg == NULL) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s, %s: gRPC rejected the TLS certificate/key",
                          t->cert_path, t->key_path);
    }
out:
    wipe_free(ca);
    wipe_free(key);
    wipe_free(cert);
    return st;
}

static grpc_ssl_certificate_config_reload_status
fetch_config(void *user_data, grpc_ssl_server_certificate_config **config)
{
    tqkv_tls_t *t = user_data;
    grpc_ssl_certificate_config_reload_status r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    pthread_mutex_lock(&t->mu);
    if (t->pending != NULL) {
        *config = t->pending; /* gRPC takes it */
        t->pending = NULL;
        r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
    }
    pthread_mutex_unlock(&t->mu);
    return r;
}

static int
copy_path(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strlen(src) : 0;
    if (n >= cap)
        return -1;
    memcpy(dst, src ? src : "", n + 1);
    return 0;
}

tqkv_status_t
tqkv_tls_create(const char *cert_path, const char *key_path, const char *client_ca_path,
                tqkv_tls_t **out, grpc_server_credentials **creds, char *err, size_t errlen)
{
    tqkv_status_t st;
    *out = NULL;
    *creds = NULL;
    if (cert_path == NULL || key_path == NULL) {
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "TLS needs both a certificate (--tls-cert) and a key (--tls-key)");
    }
    tqkv_tls_t *t = calloc(1, sizeof *t);
    if (t == NULL) {
        return tqkv_errtext(TQKV_ENOMEM, err, errlen, "out of memory");
    }
    if (copy_path(t->cert_path, sizeof t->cert_path, cert_path) ||
        copy_path(t->key_path, sizeof t->key_path, key_path) ||
        copy_path(t->ca_path, sizeof t->ca_path, client_ca_path)) {
        free(t);
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "TLS file path too long");
    }
    pthread_mutex_init(&t->mu, NULL);
    if ((st = load_config(t, &t->pending, t->digest, &t->not_after, err, errlen)) != TQKV_OK)
        goto fail;
    grpc_ssl_server_credentials_options *o =
        grpc_ssl_server_credentials_create_options_using_config_fetcher(
            client_ca_path != NULL ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            fetch_config, t);
    grpc_server_credentials *c = o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
    if (c == NULL) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s, %s: gRPC rejected the TLS certificate/key",
                          cert_path, key_path);
        goto fail;
    }
    *out = t;
    *creds = c;
    return TQKV_OK;
fail:
    tqkv_tls_destroy(t);
    return st;
}

tqkv_status_t
tqkv_tls_reload(tqkv_tls_t *t, int *changed, char *err, size_t errlen)
{
    grpc_ssl_server_certificate_config *cfg = NULL;
    unsigned char digest[32];
    double not_after = 0;
    *changed = 0;
    tqkv_status_t st = load_config(t, &cfg, digest, &not_after, err, errlen);
    if (st != TQKV_OK)
        return st;
    grpc_ssl_server_certificate_config *old = NULL;
    pthread_mutex_lock(&t->mu);
    if (memcmp(digest, t->digest, sizeof digest) != 0) {
        old = t->pending; /* a reload no handshake picked up yet: replaced */
        t->pending = cfg;
        cfg = NULL;
        memcpy(t->digest, digest, sizeof digest);
        t->not_after = not_after;
        *changed = 1;
    }
    pthread_mutex_unlock(&t->mu);
    if (old)
        grpc_ssl_server_certificate_config_destroy(old);
    if (cfg)
        grpc_ssl_server_certificate_config_destroy(cfg);
    return TQKV_OK;
}

void
tqkv_tls_paths(const tqkv_tls_t *t, const char **cert, const char **key, const char **ca)
{
    *cert = t->cert_path;
    *key = t->key_path;
    *ca = t->ca_path;
}

double
tqkv_tls_not_after(tqkv_tls_t *t)
{
    pthread_mutex_lock(&t->mu);
    double v = t->not_after;
    pthread_mutex_unlock(&t->mu);
    return v;
}

void
tqkv_tls_destroy(tqkv_tls_t *t)
{
    if (t == NULL)
        return;
    if (t->pending)
        grpc_ssl_server_certificate_config_destroy(t->pending);
    pthread_mutex_destroy(&t->mu);
    free(t);
}
