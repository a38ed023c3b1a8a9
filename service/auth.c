/* auth.c - bearer-token table: parser of the --auth-tokens file and the per-call check.
 *
 * The table holds, per token, only its SHA-256 digest (a self-contained FIPS 180-4
 * implementation below, so the service does not link libcrypto), its permissions and
 * its namespace grants. A check hashes the presented token once and compares it with
 * EVERY entry's digest in constant time, selecting the match with masks, so the time
 * taken does not depend on which entry (if any) matched or on how many leading bytes
 * agreed. The table is immutable after tqkv_auth_load, so concurrent checks need no lock;
 * its lifetime is a reference count (the server's current table, plus one per call that
 * started with it).
 */
#include "service/auth.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- SHA-256 (FIPS 180-4) ---- */

typedef struct sha256 {
    uint32_t h[8];
    uint64_t bits;
    uint8_t buf[64];
    size_t nbuf;
} sha256_t;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t
rotr32(uint32_t x, unsigned n)
{
    return (x >> n) | (x << (32 - n));
}

static void
sha256_block(sha256_t *s, const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3];
    uint32_t e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) +
                      K256[i] + w[i];
        uint32_t t2 =
            (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    s->h[0] += a;
    s->h[1] += b;
    s->h[2] += c;
    s->h[3] += d;
    s->h[4] += e;
    s->h[5] += f;
    s->h[6] += g;
    s->h[7] += h;
}

static void
sha256_init(sha256_t *s)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof(iv));
    s->bits = 0;
    s->nbuf = 0;
}

static void
sha256_update(sha256_t *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->bits += (uint64_t)len * 8;
    while (len > 0) {
        size_t take = 64 - s->nbuf;
        if (take > len)
            take = len;
        memcpy(s->buf + s->nbuf, p, take);
        s->nbuf += take;
        p += take;
        len -= take;
        if (s->nbuf == 64) {
            sha256_block(s, s->buf);
            s->nbuf = 0;
        }
    }
}

static void
sha256_final(sha256_t *s, uint8_t out[32])
{
    uint64_t bits = s->bits;
    uint8_t pad = 0x80;
    sha256_update(s, &pad, 1);
    pad = 0;
    while (s->nbuf != 56)
        sha256_update(s, &pad, 1);
    uint8_t len_be[8];
    for (int i = 0; i < 8; i++)
        len_be[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(s, len_be, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
    memset(s, 0, sizeof(*s));
}

/* Exposed for the unit test (known-answer vectors); not in auth.h. */
void tqkv__auth_sha256(const void *data, size_t len, uint8_t out[32]);

void
tqkv__auth_sha256(const void *data, size_t len, uint8_t out[32])
{
    sha256_t s;
    sha256_init(&s);
    sha256_update(&s, data, len);
    sha256_final(&s, out);
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
    tqkv__auth_sha256(tok, toklen, e->digest);
    return 0;
}

tqkv_status_t
tqkv_auth_load(const char *path, tqkv_auth_t **out, char *err, size_t errlen)
{
    tqkv_status_t st;
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fmt_err(err, errlen, "%s: cannot open token file: %s", path, strerror(errno));
        st = TQKV_EIO;
        goto fail_open;
    }
    tqkv_auth_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        fmt_err(err, errlen, "%s: out of memory", path);
        st = TQKV_ENOMEM;
        goto fail_alloc;
    }
    atomic_init(&a->refs, 1);
    sha256_t fd;
    sha256_init(&fd);
    size_t cap = 0;
    char *line = NULL;
    size_t linecap = 0;
    ssize_t got;
    unsigned long lineno = 0;
    while ((got = getline(&line, &linecap, f)) >= 0) {
        lineno++;
        sha256_update(&fd, line, (size_t)got);
        if (memchr(line, '\0', (size_t)got) != NULL) {
            fmt_err(err, errlen, "%s:%lu: NUL byte in line", path, lineno);
            st = TQKV_EINVAL;
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
                fmt_err(err, errlen,
                        "%s:%lu: too many fields (expected '<token> <r|w|rw> <ns>[,<ns>...]')",
                        path, lineno);
            else
                fmt_err(err, errlen,
                        "%s:%lu: %d field%s, expected '<token> <r|w|rw> <ns>[,<ns>...]'", path,
                        lineno, nf, nf == 1 ? "" : "s");
            st = TQKV_EINVAL;
            goto fail_parse;
        }
        if (a->n == cap) {
            size_t ncap = cap ? cap * 2 : 8;
            auth_entry_t *ne = realloc(a->e, ncap * sizeof(*ne));
            if (ne == NULL) {
                fmt_err(err, errlen, "%s:%lu: out of memory", path, lineno);
                st = TQKV_ENOMEM;
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
            fmt_err(err, errlen, "%s:%lu: %s", path, lineno, why);
            st = TQKV_EINVAL;
            goto fail_parse;
        }
        for (size_t i = 0; i + 1 < a->n; i++) {
            if (memcmp(a->e[i].digest, e->digest, 32) == 0) {
                fmt_err(err, errlen, "%s:%lu: duplicate token (first defined earlier)", path,
                        lineno);
                st = TQKV_EINVAL;
                goto fail_parse;
            }
        }
        /* Do not keep the plaintext token in freed heap memory. */
        memset(fld[0], 0, strlen(fld[0]));
    }
    if (ferror(f)) {
        fmt_err(err, errlen, "%s:%lu: read error: %s", path, lineno + 1, strerror(errno));
        st = TQKV_EIO;
        goto fail_parse;
    }
    if (a->n == 0) {
        fmt_err(err, errlen, "%s:%lu: no tokens defined", path, lineno);
        st = TQKV_EINVAL;
        goto fail_parse;
    }
    sha256_final(&fd, a->file_digest);
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

/* Constant-time equality of two 32-byte digests: 1 or 0, without data-dependent branches. */
static unsigned
digest_eq(const uint8_t *a, const uint8_t *b)
{
    unsigned diff = 0;
    for (int i = 0; i < 32; i++)
        diff |= (unsigned)(a[i] ^ b[i]);
    /* diff in 0..255: (diff - 1) >> 8 has its low bit set only when diff == 0. */
    return ((diff - 1u) >> 8) & 1u;
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
    tqkv__auth_sha256(tok, toklen, d);

    /* Scan every entry; remember the match with a mask instead of breaking out. */
    size_t match = 0;
    unsigned found = 0;
    for (size_t i = 0; i < a->n; i++) {
        unsigned eq = digest_eq(d, a->e[i].digest);
        size_t m = (size_t)0 - (size_t)eq; /* all ones when eq */
        match = (match & ~m) | (i & m);
        found |= eq;
    }
    if (!found)
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
