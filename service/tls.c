/* tls.c - server TLS / mutual TLS credentials from PEM files.
 *
 * The files are read once at start-up and checked for the PEM blocks they must hold,
 * so a wrong path or a swapped cert/key is reported naming the file instead of
 * surfacing later as an opaque handshake failure. gRPC copies the PEM strings into
 * its credentials, so our copies are wiped and freed before returning.
 */
#include "service/tls.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* PEM files larger than this are certainly not a certificate chain or a key. */
#define TLS_MAX_PEM_BYTES (16u << 20)

static void
fmt_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
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
        fmt_err(err, errlen, "%s: cannot read TLS %s: %s", path, what, strerror(errno));
        return TQKV_EIO;
    }
    if (!S_ISREG(sb.st_mode)) {
        fmt_err(err, errlen, "%s: TLS %s is not a regular file", path, what);
        return TQKV_EINVAL;
    }
    if ((unsigned long long)sb.st_size > TLS_MAX_PEM_BYTES) {
        fmt_err(err, errlen, "%s: TLS %s is larger than %u bytes", path, what, TLS_MAX_PEM_BYTES);
        return TQKV_EINVAL;
    }
    size_t len = 0;
    tqkv_status_t st = tqkv_read_file(path, out, &len);
    if (st != TQKV_OK) {
        fmt_err(err, errlen, "%s: cannot read TLS %s: %s", path, what,
                st == TQKV_EIO ? strerror(errno) : tqkv_strerror(st));
        return st;
    }
    if (strlen(*out) != len) {
        fmt_err(err, errlen, "%s: TLS %s is not PEM text (NUL byte)", path, what);
        goto fail;
    }
    for (const char *const *m = markers; *m != NULL; m++)
        if (strstr(*out, *m) != NULL)
            return TQKV_OK;
    fmt_err(err, errlen, "%s: TLS %s is not PEM (no '%s' block)", path, what, markers[0]);
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

tqkv_status_t
tqkv_tls_server_creds(const char *cert_path, const char *key_path, const char *client_ca_path,
                      grpc_server_credentials **out, char *err, size_t errlen)
{
    static const char *const cert_markers[] = {"-----BEGIN CERTIFICATE-----", NULL};
    static const char *const key_markers[] = {
        "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA PRIVATE KEY-----",
        "-----BEGIN EC PRIVATE KEY-----", "-----BEGIN ENCRYPTED PRIVATE KEY-----", NULL};
    tqkv_status_t st;
    char *cert = NULL, *key = NULL, *ca = NULL;
    *out = NULL;
    if (cert_path == NULL || key_path == NULL) {
        fmt_err(err, errlen, "TLS needs both a certificate (--tls-cert) and a key (--tls-key)");
        return TQKV_EINVAL;
    }
    if ((st = read_pem(cert_path, "certificate", cert_markers, &cert, err, errlen)) != TQKV_OK)
        goto fail_cert;
    if ((st = read_pem(key_path, "private key", key_markers, &key, err, errlen)) != TQKV_OK)
        goto fail_key;
    if (strstr(key, "-----BEGIN ENCRYPTED PRIVATE KEY-----") != NULL) {
        fmt_err(err, errlen, "%s: TLS private key is encrypted (a passphrase-less key is needed)",
                key_path);
        st = TQKV_EINVAL;
        goto fail_ca;
    }
    if (client_ca_path != NULL &&
        (st = read_pem(client_ca_path, "client CA", cert_markers, &ca, err, errlen)) != TQKV_OK)
        goto fail_ca;

    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    grpc_server_credentials *c = grpc_ssl_server_credentials_create_ex(
        ca, &pair, 1,
        ca != NULL ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
    if (c == NULL) {
        fmt_err(err, errlen, "%s, %s: gRPC rejected the TLS certificate/key", cert_path, key_path);
        st = TQKV_EINVAL;
        goto fail_creds;
    }
    wipe_free(ca);
    wipe_free(key);
    wipe_free(cert);
    *out = c;
    return TQKV_OK;

fail_creds:
    wipe_free(ca);
fail_ca:
    wipe_free(key);
fail_key:
    wipe_free(cert);
fail_cert:
    return st;
}
