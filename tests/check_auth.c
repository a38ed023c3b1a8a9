/* check_auth.c - unit tests of service/auth.c: SHA-256 vectors, the token-file parser
 * (grants, permissions, malformed files with FILE:LINE errors), Bearer parsing and the
 * constant-time lookup over all entries (its comparisons counted, not timed).
 */
#include <check.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/status.h"
#include "kernels/tq_math.h"
#include "service/auth.h"
#include "tests/check_main.h"

#include <openssl/crypto.h>

int tqkv__auth_sha256(const void *data, size_t len, uint8_t out[32]);

static char g_dir[256];

static void
setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tqkv-check-auth-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
}

static void
teardown(void)
{
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", g_dir);
}

/* Writes text to a fresh file in g_dir; returns its path (static buffer rotation). */
static const char *
write_file(const char *name, const char *text)
{
    static char paths[4][512];
    static int k;
    char *p = paths[k++ & 3];
    snprintf(p, 512, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
    return p;
}

static tqkv_status_t
check(const tqkv_auth_t *a, const char *authz, const char *ns, unsigned perm)
{
    return tqkv_auth_check(a, authz, authz ? strlen(authz) : 0, ns, ns ? strlen(ns) : 0, perm);
}

static void
hex(const uint8_t *d, char *out)
{
    for (int i = 0; i < 32; i++)
        sprintf(out + 2 * i, "%02x", d[i]);
}

START_TEST(test_sha256_vectors)
{
    uint8_t d[32];
    char h[65];
    tqkv__auth_sha256("", 0, d);
    hex(d, h);
    ck_assert_str_eq(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    tqkv__auth_sha256("abc", 3, d);
    hex(d, h);
    ck_assert_str_eq(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"; /* 56 bytes */
    tqkv__auth_sha256(m, strlen(m), d);
    hex(d, h);
    ck_assert_str_eq(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* One million 'a': crosses many blocks. */
    char *big = malloc(1000000);
    memset(big, 'a', 1000000);
    tqkv__auth_sha256(big, 1000000, d);
    free(big);
    hex(d, h);
    ck_assert_str_eq(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}
END_TEST

START_TEST(test_sha256_awkward_lengths)
{
    /* Lengths around the 55/56/64-byte padding boundaries must differ pairwise and be
     * deterministic. */
    char buf[130];
    memset(buf, 'x', sizeof(buf));
    uint8_t prev[32] = {0}, d[32], d2[32];
    for (size_t n = 50; n <= 130; n++) {
        tqkv__auth_sha256(buf, n, d);
        tqkv__auth_sha256(buf, n, d2);
        ck_assert_mem_eq(d, d2, 32);
        ck_assert_int_ne(memcmp(d, prev, 32), 0);
        memcpy(prev, d, 32);
    }
}
END_TEST

static const char *GOOD = "# tokens for the test\n"
                          "\n"
                          "   # indented comment\n"
                          "admin-token-0001 rw *\n"
                          "reader-token-0002 r team-a,team-b\n"
                          "writer-token-0003\tw\tteam-a\r\n"
                          "tenant-c-token-04 rw team-c   \n";

START_TEST(test_grants_and_permissions)
{
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    ck_assert_int_eq(tqkv_auth_load(write_file("good", GOOD), &a, err, sizeof(err)), TQKV_OK);
    const unsigned R = TQKV_AUTH_READ, W = TQKV_AUTH_WRITE;

    /* '*' grants every namespace, and ns == NULL (all namespaces). */
    ck_assert_int_eq(check(a, "Bearer admin-token-0001", "anything", R | W), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer admin-token-0001", NULL, R), TQKV_OK);

    /* Read-only token. */
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", "team-a", R), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", "team-b", R), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", "team-a", W), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", "team-a", R | W), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", "team-c", R), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer reader-token-0002", NULL, R), TQKV_EPERM);

    /* Write-only token, tab separated, CRLF line. */
    ck_assert_int_eq(check(a, "Bearer writer-token-0003", "team-a", W), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer writer-token-0003", "team-a", R), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer writer-token-0003", "team-b", W), TQKV_EPERM);

    /* Namespace comparison is exact: no prefix, suffix or case folding. */
    ck_assert_int_eq(check(a, "Bearer tenant-c-token-04", "team-c", R), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer tenant-c-token-04", "team-", R), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer tenant-c-token-04", "team-cc", R), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer tenant-c-token-04", "TEAM-C", R), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer tenant-c-token-04", "", R), TQKV_EPERM);
    /* A namespace that is not NUL-terminated at ns_len. */
    ck_assert_int_eq(tqkv_auth_check(a, "Bearer tenant-c-token-04", 24, "team-cX", 6, R), TQKV_OK);
    tqkv_auth_destroy(a);
}
END_TEST

START_TEST(test_bearer_parsing)
{
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    ck_assert_int_eq(tqkv_auth_load(write_file("good", GOOD), &a, err, sizeof(err)), TQKV_OK);
    const unsigned R = TQKV_AUTH_READ;
    ck_assert_int_eq(check(a, "bearer admin-token-0001", "x", R), TQKV_OK);
    ck_assert_int_eq(check(a, "BEARER admin-token-0001", "x", R), TQKV_OK);
    ck_assert_int_eq(check(a, "BeArEr \t admin-token-0001  ", "x", R), TQKV_OK);
    ck_assert_int_eq(check(a, "  Bearer admin-token-0001", "x", R), TQKV_OK);

    ck_assert_int_eq(check(a, NULL, "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer ", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer    ", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "admin-token-0001", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Basic admin-token-0001", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Beareradmin-token-0001", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer admin-token-000", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer admin-token-00011", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer admin-token-0001 extra", "x", R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer ADMIN-TOKEN-0001", "x", R), TQKV_EAUTH);
    /* authz_len shorter than the string: the token is cut, so unknown. */
    ck_assert_int_eq(tqkv_auth_check(a, "Bearer admin-token-0001", 20, "x", 1, R), TQKV_EAUTH);
    /* Embedded NUL and control bytes. */
    ck_assert_int_eq(tqkv_auth_check(a, "Bearer admin\0token-0001", 23, "x", 1, R), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer admin-token-0001\x01", "x", R), TQKV_EAUTH);
    /* A NULL table authenticates nobody. */
    ck_assert_int_eq(check(NULL, "Bearer admin-token-0001", "x", R), TQKV_EAUTH);
    tqkv_auth_destroy(a);
}
END_TEST

/* Random tokens: every entry of a large table is found (the masked selection picks the
 * right entry, first, middle and last), and random near-misses are rejected. */
START_TEST(test_many_random_tokens)
{
    uint64_t rng = tqkv_test_seed() ^ 0xa17c;
    enum { N = 300 };
    static char toks[N][48];
    size_t cap = (size_t)N * 80 + 64, off = 0;
    char *text = malloc(cap);
    for (int i = 0; i < N; i++) {
        int len = 8 + (int)(tqkv_splitmix64(&rng) % 38);
        for (int k = 0; k < len; k++)
            toks[i][k] = (char)(0x21 + tqkv_splitmix64(&rng) % 94);
        toks[i][len] = '\0';
        /* '#' at the start would make a comment line. */
        if (toks[i][0] == '#')
            toks[i][0] = 'h';
    }
    /* Random tokens may collide only with negligible probability; make it impossible. */
    for (int i = 0; i < N; i++)
        for (int j = 0; j < i; j++)
            if (strcmp(toks[i], toks[j]) == 0)
                toks[i][0] = (char)('A' + i % 26);
    off = 0;
    for (int i = 0; i < N; i++)
        off += (size_t)snprintf(text + off, cap - off, "%s %s ns-%d\n", toks[i],
                                i % 3 == 0 ? "r" : "rw", i);
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    tqkv_status_t st = tqkv_auth_load(write_file("many", text), &a, err, sizeof(err));
    ck_assert_msg(st == TQKV_OK, "load: %s", err);
    free(text);
    char h[96], ns[32], other[32];
    for (int i = 0; i < N; i++) {
        snprintf(h, sizeof(h), "Bearer %.47s", toks[i]);
        snprintf(ns, sizeof(ns), "ns-%d", i);
        snprintf(other, sizeof(other), "ns-%d", (i + 1) % N);
        ck_assert_int_eq(check(a, h, ns, TQKV_AUTH_READ), TQKV_OK);
        ck_assert_int_eq(check(a, h, ns, TQKV_AUTH_WRITE), i % 3 == 0 ? TQKV_EPERM : TQKV_OK);
        ck_assert_int_eq(check(a, h, other, TQKV_AUTH_READ), TQKV_EPERM);
        /* Flip one random printable byte of the token: unknown. */
        size_t tl = strlen(toks[i]);
        size_t pos = 7 + tqkv_splitmix64(&rng) % tl;
        char c = h[pos];
        h[pos] = (char)(c == '~' ? '!' : c + 1);
        ck_assert_int_eq(check(a, h, ns, TQKV_AUTH_READ), TQKV_EAUTH);
    }
    tqkv_auth_destroy(a);
}
END_TEST

static void
expect_bad(const char *name, const char *text, const char *want_line, const char *want_why)
{
    tqkv_auth_t *a = (tqkv_auth_t *)0x1;
    char err[512] = "";
    const char *path = write_file(name, text);
    tqkv_status_t st = tqkv_auth_load(path, &a, err, sizeof(err));
    ck_assert_msg(st == TQKV_EINVAL, "%s: status %s", name, tqkv_status_name(st));
    ck_assert_ptr_null(a);
    char want[600];
    snprintf(want, sizeof(want), "%s:%s: ", path, want_line);
    ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "%s: err '%s' wants prefix '%s'", name,
                  err, want);
    ck_assert_msg(strstr(err, want_why) != NULL, "%s: err '%s' lacks '%s'", name, err, want_why);
}

START_TEST(test_malformed_files)
{
    expect_bad("fields1", "# c\nonly-a-token-here\n", "2", "1 field");
    expect_bad("fields2", "tok-aaaaaaaa rw\n", "1", "2 fields");
    expect_bad("fields4", "ok-token-1111 r a\ntok-bbbbbbbb rw ns extra\n", "2", "too many");
    expect_bad("perm", "tok-aaaaaaaa rx ns\n", "1", "r, w or rw");
    expect_bad("perm-empty-ish", "tok-aaaaaaaa R ns\n", "1", "r, w or rw");
    expect_bad("short", "\n\nshort r ns\n", "3", "shorter than 8");
    expect_bad("emptyns", "tok-aaaaaaaa r a,,b\n", "1", "empty namespace");
    expect_bad("trailcomma", "tok-aaaaaaaa r a,\n", "1", "empty namespace");
    expect_bad("dup", "tok-aaaaaaaa r a\ntok-bbbbbbbb r b\ntok-aaaaaaaa rw c\n", "3", "duplicate");
    expect_bad("ctrl",
               "tok-\x01"
               "aaaaaaa r a\n",
               "1", "non-printable");
    char longns[400];
    memset(longns, 'n', 300);
    longns[300] = '\0';
    char text[512];
    snprintf(text, sizeof(text), "tok-aaaaaaaa r %s\n", longns);
    expect_bad("longns", text, "1", "namespace must be");
    expect_bad("empty", "", "0", "no tokens");
    expect_bad("comments", "# a\n  # b\n\n", "3", "no tokens");
}
END_TEST

START_TEST(test_missing_file_and_nul)
{
    tqkv_auth_t *a = (tqkv_auth_t *)0x1;
    char err[512] = "";
    char path[300];
    snprintf(path, sizeof(path), "%s/does-not-exist", g_dir);
    ck_assert_int_eq(tqkv_auth_load(path, &a, err, sizeof(err)), TQKV_EIO);
    ck_assert_ptr_null(a);
    ck_assert_ptr_nonnull(strstr(err, path));

    /* A NUL byte inside a line. */
    snprintf(path, sizeof(path), "%s/nul", g_dir);
    FILE *f = fopen(path, "w");
    fwrite("tok-aaaaaaaa r a\ntok-b\0bbbbbbb r a\n", 1, 35, f);
    fclose(f);
    ck_assert_int_eq(tqkv_auth_load(path, &a, err, sizeof(err)), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, ":2: NUL"));

    /* A tiny error buffer is not overrun and stays terminated. */
    char tiny[8];
    memset(tiny, 'Z', sizeof(tiny));
    ck_assert_int_eq(tqkv_auth_load(path, &a, tiny, 5), TQKV_EINVAL);
    ck_assert_int_eq(tiny[4], '\0');
    ck_assert_int_eq(tiny[5], 'Z');
    /* NULL err is allowed. */
    ck_assert_int_eq(tqkv_auth_load(path, &a, NULL, 0), TQKV_EINVAL);
    tqkv_auth_destroy(NULL);
}
END_TEST

/* The last line need not end with a newline; very long lines (a long namespace list)
 * are read whole. */
START_TEST(test_no_final_newline_and_long_line)
{
    size_t n = 200;
    size_t cap = n * 16 + 64;
    char *text = malloc(cap);
    size_t off = (size_t)snprintf(text, cap, "long-list-token r ");
    for (size_t i = 0; i < n; i++)
        off += (size_t)snprintf(text + off, cap - off, "%sns%zu", i ? "," : "", i);
    off += (size_t)snprintf(text + off, cap - off, "\nlast-line-token rw z");
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    ck_assert_int_eq(tqkv_auth_load(write_file("long", text), &a, err, sizeof(err)), TQKV_OK);
    free(text);
    ck_assert_int_eq(check(a, "Bearer long-list-token", "ns0", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer long-list-token", "ns199", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer long-list-token", "ns200", TQKV_AUTH_READ), TQKV_EPERM);
    ck_assert_int_eq(check(a, "Bearer last-line-token", "z", TQKV_AUTH_WRITE), TQKV_OK);
    tqkv_auth_destroy(a);
}
END_TEST

START_TEST(test_refcount_and_same_file)
{
    char err[256];
    tqkv_auth_t *a = NULL, *b = NULL, *c = NULL;
    const char *p = write_file("r1", "# one\ntoken-aaaaaaaa rw ns\ntoken-bbbbbbbb r ns\n");
    ck_assert_int_eq(tqkv_auth_load(p, &a, err, sizeof(err)), TQKV_OK);
    ck_assert_int_eq(tqkv_auth_load(p, &b, err, sizeof(err)), TQKV_OK);
    ck_assert_uint_eq(tqkv_auth_count(a), 2);
    ck_assert(tqkv_auth_same_file(a, b));
    /* A comment changed: another file (a reload is not skipped). */
    p = write_file("r1", "# two\ntoken-aaaaaaaa rw ns\ntoken-bbbbbbbb r ns\n");
    ck_assert_int_eq(tqkv_auth_load(p, &c, err, sizeof(err)), TQKV_OK);
    ck_assert(!tqkv_auth_same_file(a, c));
    ck_assert(!tqkv_auth_same_file(a, NULL));
    /* References: the table stays usable until the last one goes. */
    ck_assert_ptr_eq(tqkv_auth_ref(a), a);
    tqkv_auth_destroy(a);
    ck_assert_int_eq(check(a, "Bearer token-aaaaaaaa", "ns", TQKV_AUTH_WRITE), TQKV_OK);
    tqkv_auth_destroy(a);
    ck_assert_ptr_null(tqkv_auth_ref(NULL));
    tqkv_auth_destroy(b);
    tqkv_auth_destroy(c);
}
END_TEST

/* ---- the constant-time scan, checked by counting instead of timing ----
 *
 * tqkv_auth_check finds the presented token's digest with tqkv__auth_scan(a, d,
 * CRYPTO_memcmp). Its timing property is a property of the comparisons it makes: every
 * entry compared in full, in the same order, whichever entry (if any) matches. A
 * counting comparator records them, so the property is asserted exactly, with no clock
 * (the timing itself is a benchmark: tests/bench/auth_scan_bench.c). */

size_t tqkv__auth_scan(const tqkv_auth_t *a, const uint8_t d[32],
                       int (*cmp)(const void *, const void *, size_t));

enum { SCAN_N = 64, SCAN_MAX_CALLS = 4 * SCAN_N };

static struct {
    size_t calls;
    const void *presented; /* the first argument of every call */
    const void *entry[SCAN_MAX_CALLS];
    size_t len[SCAN_MAX_CALLS];
    int unequal; /* what a mismatch returns (any non-zero int is "unequal") */
} g_scan;

static int
counting_cmp(const void *a, const void *b, size_t n)
{
    if (g_scan.calls < SCAN_MAX_CALLS) {
        g_scan.entry[g_scan.calls] = b;
        g_scan.len[g_scan.calls] = n;
    }
    g_scan.calls++;
    g_scan.presented = a;
    return memcmp(a, b, n) == 0 ? 0 : g_scan.unequal;
}

/* A table of SCAN_N tokens "scan-token-<i>", r on namespace ns, in file order. */
static tqkv_auth_t *
scan_table(void)
{
    char text[SCAN_N * 40];
    size_t off = 0;
    for (int i = 0; i < SCAN_N; i++)
        off += (size_t)snprintf(text + off, sizeof(text) - off, "scan-token-%d r ns\n", i);
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    ck_assert_msg(tqkv_auth_load(write_file("scan", text), &a, err, sizeof(err)) == TQKV_OK, "%s",
                  err);
    ck_assert_uint_eq(tqkv_auth_count(a), SCAN_N);
    return a;
}

static void
token_digest(int i, uint8_t d[32])
{
    char tok[32];
    int n = snprintf(tok, sizeof(tok), "scan-token-%d", i);
    ck_assert_int_eq(tqkv__auth_sha256(tok, (size_t)n, d), 0);
}

START_TEST(test_scan_compares_every_entry)
{
    tqkv_auth_t *a = scan_table();
    /* Presented: the first, a middle and the last entry, and a token in none. */
    const int who[4] = {0, SCAN_N / 2 + 1, SCAN_N - 1, SCAN_N + 7};
    /* Mismatch results a memcmp-like comparator may give: any non-zero int. */
    const int unequal[4] = {1, -1, 255, INT_MIN};
    const void *order[SCAN_N];
    for (int u = 0; u < 4; u++) {
        for (int k = 0; k < 4; k++) {
            uint8_t d[32];
            token_digest(who[k], d);
            memset(&g_scan, 0, sizeof(g_scan));
            g_scan.unequal = unequal[u];
            size_t got = tqkv__auth_scan(a, d, counting_cmp);
            ck_assert_uint_eq(got, who[k] < SCAN_N ? (size_t)who[k] : (size_t)SCAN_N);
            /* One full-length comparison per entry, no more, no fewer, no early exit. */
            ck_assert_uint_eq(g_scan.calls, SCAN_N);
            ck_assert_ptr_eq(g_scan.presented, d);
            for (int i = 0; i < SCAN_N; i++) {
                ck_assert_uint_eq(g_scan.len[i], 32);
                if (u == 0 && k == 0)
                    order[i] = g_scan.entry[i];
                /* The same entries in the same order whichever token was presented. */
                ck_assert_ptr_eq(g_scan.entry[i], order[i]);
                for (int j = 0; j < i; j++)
                    ck_assert_ptr_ne(g_scan.entry[j], g_scan.entry[i]);
            }
        }
    }
    tqkv_auth_destroy(a);
}
END_TEST

/* The server's comparator, CRYPTO_memcmp, through the scan: a digest one bit away from an
 * entry's (at every bit of the first, a middle and the last byte, and every byte's low
 * bit) matches nothing; the exact digest matches its entry. Tokens that are prefixes or
 * extensions of a granted one, or differ in their last character, are refused. */
START_TEST(test_scan_contract_with_crypto_memcmp)
{
    tqkv_auth_t *a = scan_table();
    for (int who = 0; who < SCAN_N; who += SCAN_N - 1) {
        uint8_t d[32];
        token_digest(who, d);
        ck_assert_uint_eq(tqkv__auth_scan(a, d, CRYPTO_memcmp), (size_t)who);
        for (int byte = 0; byte < 32; byte++) {
            for (int bit = 0; bit < 8; bit++) {
                if (bit != 0 && byte != 0 && byte != 16 && byte != 31)
                    continue;
                d[byte] ^= (uint8_t)(1u << bit);
                ck_assert_msg(tqkv__auth_scan(a, d, CRYPTO_memcmp) == SCAN_N,
                              "entry %d matched with byte %d bit %d flipped", who, byte, bit);
                d[byte] ^= (uint8_t)(1u << bit);
            }
        }
        ck_assert_uint_eq(tqkv__auth_scan(a, d, CRYPTO_memcmp), (size_t)who);
    }
    ck_assert_int_eq(check(a, "Bearer scan-token-1", "ns", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer scan-token-", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer scan-token", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer s", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    /* "scan-token-1" is granted, "scan-token-10" too: the prefix does not stand in. */
    ck_assert_int_eq(check(a, "Bearer scan-token-10", "ns", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer scan-token-100", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer scan-token-1x", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer scan-token-63", "ns", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer scan-token-64", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    ck_assert_int_eq(check(a, "Bearer scan-token-6", "ns", TQKV_AUTH_READ), TQKV_OK);
    ck_assert_int_eq(check(a, "Bearer scan-token-65", "ns", TQKV_AUTH_READ), TQKV_EAUTH);
    tqkv_auth_destroy(a);
}
END_TEST

static Suite *
auth_suite(void)
{
    Suite *s = suite_create("auth");
    TCase *tc = tcase_create("auth");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_sha256_vectors);
    tcase_add_test(tc, test_sha256_awkward_lengths);
    tcase_add_test(tc, test_grants_and_permissions);
    tcase_add_test(tc, test_bearer_parsing);
    tcase_add_test(tc, test_many_random_tokens);
    tcase_add_test(tc, test_malformed_files);
    tcase_add_test(tc, test_missing_file_and_nul);
    tcase_add_test(tc, test_no_final_newline_and_long_line);
    tcase_add_test(tc, test_scan_compares_every_entry);
    tcase_add_test(tc, test_scan_contract_with_crypto_memcmp);
    tcase_add_test(tc, test_refcount_and_same_file);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(auth_suite)
