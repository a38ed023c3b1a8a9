/* auth.c - bearer-token table: parser of the --auth-tokens file and the per-call check.
 *
 * The table holds, per token, only its SHA-256 digest (OpenSSL's EVP), its permissions
 * and its namespace grants. A check hashes the presented token once and compares it with
 * EVERY entry's digest with OpenSSL's CRYPTO_memcmp (whose time depends on the length
 * alone), selecting the match with masks, so the time taken does not depend on which
 * entry (if any) matched or on how many leading bytes agreed (tqkv__auth_scan; the unit
 * test counts its comparisons, tests/bench/auth_scan_bench.c times it). The table is immutable
 * after tqkv_auth_load, so concurrent checks need no lock; its lifetime is a reference count (the
 * server's current table, plus one per call that started with it).
 */
#include "service/auth.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "kernels/errtext.h"

/* SHA-256 through OpenSSL's EVP (the library links libcrypto for TLS anyway). Returns 0,
 * or -1 when OpenSSL cannot allocate its context. Exposed for the unit test
 * (known-answer vectors); not in auth.h. */
int tqkv__auth_sha256(const void *data, size_t len, uint8_t out[32]);

int
tqkv__auth_sha256(const void *data, size_t len, uint8_t out[32])
{
    return EVP_Digest(data, len, out, NULL, EVP_sha256(), NULL) == 1 ? 0 : -1;
}

/* ---- the token table ---- */

typedef struct auth_entry {
    uint8_t digest[32];
    unsigned perm;  /* TQKV_AUTH_READ | TQKV_AUTH_WRITE */
    int all_ns;     /* '*' granted */
    char **ns;      /* owned, NUL-terminated names */
    size_t *ns_len; /* owned */
    size_t nns;
} auth_entry_t;

struct tqkv_auth {
    auth_entry_t *e; /* owned array of n entries */
    size_t n;
    _Atomic unsigned refs;
    uint8_t file_digest[32]; /* SHA-256 of the file's bytes (reload: unchanged or not) */
};

static void
entry_fini(auth_entry_t *e)
{
    for (size_t i = 0; i < e->nns; i++)
        free(e->ns[i]);
    free(e->ns);
    free(e->ns_len);
    memset(e, 0, sizeof(*e));
}

tqkv_auth_t *
tqkv_auth_ref(tqkv_auth_t *a)
{
    if (a)
        atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    return a;
}

size_t
tqkv_auth_count(const tqkv_auth_t *a)
{
    return a ? a->n : 0;
}

int
tqkv_auth_same_file(const tqkv_auth_t *a, const tqkv_auth_t *b)
{
    return a && b && memcmp(a->file_digest, b->file_digest, 32) == 0;
}

void
tqkv_auth_destroy(tqkv_auth_t *a)
{
    if (a == NULL)
        return;
    if (atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (size_t i = 0; i < a->n; i++)
        entry_fini(&a->e[i]);
    free(a->e);
    free(a);
}

static int
is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

/* Splits s in place into at most max whitespace-separated fields; returns the count
 * (max + 1 when there are more fields than max). */
static int
split_fields(char *s, char **f, int max)
{
    int n = 0;
    for (;;) {
        while (*s && is_space(*s))
            s++;
        if (!*s)
            return n;
        if (n == max)
            return max + 1;
        f[n++] = s;
        while (*s && !is_space(*s))
            s++;
        if (*s)
            *s++ = '\0';
    }
}

/* Namespaces: printable ASCII without whitespace or ','; at most 256 bytes (the
 * default request limit; the server rejects longer names anyway). */
static int
valid_ns(const char *s, size_t n)
{
    if (n == 0 || n > 256)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c <= 0x20 || c >= 0x7f || c == ',')
            return 0;
    }
    return 1;
}

/* Parses one non-comment line's fields into e. Returns 0 or -1 with why set. */
static int
parse_entry(char *tok, char *perm, char *nslist, auth_entry_t *e, const char **why)
{
    size_t toklen = strlen(tok);
    for (size_t i = 0; i < toklen; i++) {
        unsigned char c = (unsigned char)tok[i];
        if (c < 0x21 || c > 0x7e) {
            *why = "token has a non-printable byte";
            return -1;
        }
    }
    if (toklen < 8) {
        *why = "token shorter than 8 characters";
        return -1;
    }
    if (strcmp(perm, "r") == 0)
        e->perm = TQKV_AUTH_READ;
    else if (strcmp(perm, "w") == 0)
        e->perm = TQKV_AUTH_WRITE;
    else if (strcmp(perm, "rw") == 0 || strcmp(perm, "wr") == 0)
        e->perm = TQKV_AUTH_READ | TQKV_AUTH_WRITE;
    else {
        *why = "permission must be r, w or rw";
        return -1;
    }
    size_t cap = 1;
    for (const char *p = nslist; *p; p++)
        cap += *p == ',';
    e->ns = calloc(cap, sizeof(*e->ns));
    e->ns_len = calloc(cap, sizeof(*e->ns_len));
    if (e->ns == NULL || e->ns_len == NULL) {
        *why = "out of memory";
        return -1;
    }
    const char *p = nslist;
    for (;;) {
        const char *c = strchr(p, ',');
        size_t n = c ? (size_t)(c - p) : strlen(p);
        if (n == 1 && p[0] == '*') {
            e->all_ns = 1;
        } else if (!valid_ns(p, n)) {
            *why = n == 0 ? "empty namespace in list"
                          : "namespace must be 1..256 printable characters";
            return -1;
        } else {
            char *dup = malloc(n + 1);
            if (dup == NULL) {
                *why = "out of memory";
                return -1;
            }
            memcpy(dup, p, n);
            dup[n] = '\0';
            e->ns[e->nns] = dup;
            e->ns_len[e->nns] = n;
            e->nns++;
        }
        if (c == NULL)
            break;
        p = c + 1;
    }
    if (tqkv__auth_sha256(tok, toklen, e->digest) != 0) {
        *why = "out of memory (SHA-256)";
        return -1;
    }
    return 0;
}

tqkv_status_t
tqkv_auth_load(const char *path, tqkv_auth_t **out, char *err, size_t errlen)
{
    tqkv_status_t st;
    EVP_MD_CTX *fd = NULL; /* the SHA-256 of the whole file */
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        st = tqkv_errtext(TQKV_EIO, err, errlen, "%s: cannot open token file: %s", path,
                          strerror(errno));
        goto fail_open;
    }
    tqkv_auth_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s: out of memory", path);
        goto fail_alloc;
    }
    atomic_init(&a->refs, 1);
    if ((fd = EVP_MD_CTX_new()) == NULL || EVP_DigestInit_ex(fd, EVP_sha256(), NULL) != 1) {
        st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s: out of memory (SHA-256)", path);
        tqkv_auth_destroy(a);
        goto fail_alloc;
    }
    size_t cap = 0;
    char *line = NULL;
    size_t linecap = 0;
    ssize_t got;
    unsigned long lineno = 0;
    while ((got = getline(&line, &linecap, f)) >= 0) {
        lineno++;
        if (EVP_DigestUpdate(fd, line, (size_t)got) != 1) {
            st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s:%lu: SHA-256 failed", path, lineno);
            goto fail_parse;
        }
        if (memchr(line, '\0', (size_t)got) != NULL) {
            st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s:%lu: NUL byte in line", path, lineno);
            goto fail_parse;
        }
        char *s = line;
        while (*s && is_space(*s))
            s++;
        if (*s == '\0' || *s == '#')
            continue;
        char *fld[3];
        int nf = split_fields(s, fld, 3);
        if (nf != 3) {
            if (nf > 3)
                st = tqkv_errtext(
                    TQKV_EINVAL, err, errlen,
                    "%s:%lu: too many fields (expected '<token> <r|w|rw> <ns>[,<ns>...]')", path,
                    lineno);
            else
                st = tqkv_errtext(TQKV_EINVAL, err, errlen,
                                  "%s:%lu: %d field%s, expected '<token> <r|w|rw> <ns>[,<ns>...]'",
                                  path, lineno, nf, nf == 1 ? "" : "s");
            goto fail_parse;
        }
        if (a->n == cap) {
            size_t ncap = cap ? cap * 2 : 8;
            auth_entry_t *ne = realloc(a->e, ncap * sizeof(*ne));
            if (ne == NULL) {
                st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s:%lu: out of memory", path, lineno);
                goto fail_parse;
            }
            a->e = ne;
            cap = ncap;
        }
        auth_entry_t *e = &a->e[a->n];
        memset(e, 0, sizeof(*e));
        a->n++; /* counted now so that a failed entry is freed with the table */
        const char *why = NULL;
        if (parse_entry(fld[0], fld[1], fld[2], e, &why) != 0) {
            st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s:%lu: %s", path, lineno, why);
            goto fail_parse;
        }
        for (size_t i = 0; i + 1 < a->n; i++) {
            if (memcmp(a->e[i].digest, e->digest, 32) == 0) {
                st = tqkv_errtext(TQKV_EINVAL, err, errlen,
                                  "%s:%lu: duplicate token (first defined earlier)", path, lineno);
                goto fail_parse;
            }
        }
        /* Do not keep the plaintext token in freed heap memory. */
        memset(fld[0], 0, strlen(fld[0]));
    }
    if (ferror(f)) {
        st = tqkv_errtext(TQKV_EIO, err, errlen, "%s:%lu: read error: %s", path, lineno + 1,
                          strerror(errno));
        goto fail_parse;
    }
    if (a->n == 0) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "%s:%lu: no tokens defined", path, lineno);
        goto fail_parse;
    }
    if (EVP_DigestFinal_ex(fd, a->file_digest, NULL) != 1) {
        st = tqkv_errtext(TQKV_ENOMEM, err, errlen, "%s: SHA-256 failed", path);
        goto fail_parse;
    }
    EVP_MD_CTX_free(fd);
    if (line != NULL)
        memset(line, 0, linecap);
    free(line);
    fclose(f);
    *out = a;
    return TQKV_OK;

fail_parse:
    if (line != NULL)
        memset(line, 0, linecap);
    free(line);
    tqkv_auth_destroy(a);
fail_alloc:
    EVP_MD_CTX_free(fd);
    fclose(f);
fail_open:
    return st;
}

/* Extracts the token from "Bearer <token>" (scheme case-insensitive, surrounding blanks
 * allowed). Returns 0 and sets *tok and *toklen, or -1. */
static int
parse_bearer(const char *h, size_t n, const char **tok, size_t *toklen)
{
    size_t i = 0;
    while (i < n && (h[i] == ' ' || h[i] == '\t'))
        i++;
    static const char scheme[] = "bearer";
    if (n - i < sizeof(scheme))
        return -1;
    for (size_t k = 0; k < sizeof(scheme) - 1; k++) {
        char c = h[i + k];
        if (c >= 'A' && c <= 'Z')
            c = (char)(c - 'A' + 'a');
        if (c != scheme[k])
            return -1;
    }
    i += sizeof(scheme) - 1;
    if (h[i] != ' ' && h[i] != '\t')
        return -1;
    while (i < n && (h[i] == ' ' || h[i] == '\t'))
        i++;
    size_t end = n;
    while (end > i && (h[end - 1] == ' ' || h[end - 1] == '\t'))
        end--;
    if (end == i)
        return -1;
    for (size_t k = i; k < end; k++) {
        unsigned char c = (unsigned char)h[k];
        if (c < 0x21 || c > 0x7e)
            return -1;
    }
    *tok = h + i;
    *toklen = end - i;
    return 0;
}

/* The index of the entry whose digest is d, or a->n when none is. Every entry's digest
 * is compared in full through cmp (CRYPTO_memcmp in the server), in table order, and the
 * match is kept with masks instead of a break, so the sequence of comparisons is the same
 * whichever entry matches. cmp's result is read as 0 (equal) or any other int (unequal),
 * without a branch. A parameter so that the unit test can count the comparisons; not in
 * auth.h. */
size_t tqkv__auth_scan(const tqkv_auth_t *a, const uint8_t d[32],
                       int (*cmp)(const void *, const void *, size_t));

size_t
tqkv__auth_scan(const tqkv_auth_t *a, const uint8_t d[32],
                int (*cmp)(const void *, const void *, size_t))
{
    size_t match = a->n;
    for (size_t i = 0; i < a->n; i++) {
        unsigned r = (unsigned)cmp(d, a->e[i].digest, 32);
        /* r | -r has its top bit set exactly when r != 0. */
        size_t eq = 1u ^ ((r | (0u - r)) >> (sizeof(unsigned) * CHAR_BIT - 1));
        size_t m = (size_t)0 - eq; /* all ones when equal */
        match = (match & ~m) | (i & m);
    }
    return match;
}

tqkv_status_t
tqkv_auth_check(const tqkv_auth_t *a, const char *authz, size_t authz_len, const char *ns,
                size_t ns_len, unsigned perm)
{
    if (a == NULL || a->n == 0)
        return TQKV_EAUTH;
    const char *tok = NULL;
    size_t toklen = 0;
    if (authz == NULL || parse_bearer(authz, authz_len, &tok, &toklen) != 0)
        return TQKV_EAUTH;
    uint8_t d[32];
    if (tqkv__auth_sha256(tok, toklen, d) != 0)
        return TQKV_EAUTH;

    size_t match = tqkv__auth_scan(a, d, CRYPTO_memcmp);
    if (match == a->n)
        return TQKV_EAUTH;
    const auth_entry_t *e = &a->e[match];
    if ((perm & ~e->perm) != 0) /* perm 0: the namespace grant alone */
        return TQKV_EPERM;
    if (e->all_ns)
        return TQKV_OK;
    if (ns == NULL)
        return TQKV_EPERM;
    for (size_t i = 0; i < e->nns; i++)
        if (e->ns_len[i] == ns_len && memcmp(e->ns[i], ns, ns_len) == 0)
            return TQKV_OK;
    return TQKV_EPERM;
}

int
tqkv_auth_bearer_token(const char *authz, size_t authz_len, const char **tok, size_t *toklen)
{
    return authz == NULL ? -1 : parse_bearer(authz, authz_len, tok, toklen);
}
