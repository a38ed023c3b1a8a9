/* check_peer_security.c - hand-off and forwarding between real tqkv-servers on loopback
 * with TLS and bearer tokens on (label shard). Certificates are made with the openssl
 * tool at test time (a CA, a server certificate for localhost and 127.0.0.1, and a
 * second CA with its own "rogue" server certificate).
 *
 *   handoff   two servers with mutual TLS and tokens (the peers' CA from --tls-client-ca):
 *             a client with a tenant token puts pages on A; SIGTERM to A hands them to
 *             B, where the same tenant's Get finds every page byte-identical.
 *   forward   A forwards blocks B owns, with the caller's own token: the tenant's Puts
 *             through A land on B, its Gets through A and B find them; a token without
 *             a grant on the namespace is PERMISSION_DENIED through A; a token that A
 *             grants but the owner B does not is refused by B, through A (the owner
 *             checks the caller, not A's peer token).
 *   wrong CA  a peer whose certificate another CA signed is refused: nothing is stored
 *             there, the hand-off logs the failure.
 * No test logs a token. Waits are bounded by events (a process exit, a log line, a
 * block found), each with a deadline.
 */
#include <arpa/inet.h>
#include <check.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/ports.h"
#include "tests/support/server_proc.h"
#include "transport/client.h"
#include "transport/shard.h"

enum { L = 2, NB = 40, NMAX = 64 };
static const tqkv_block_shape_t SH = {16, 2, 64};
static char DIR_[64];
static uint64_t SEED;

#define PEER_TOK "peer-7f3c9d2e61aa"
#define TOK_A "tenant-a-5b81c0e94f"
#define TOK_B "tenant-b-0d6e2a7c13"
#define TOK_C "tenant-c-93e4f1b8a2"

static const char *
path(const char *name)
{
    static char p[32][160];
    static int k;
    char *s = p[k++ & 31];
    snprintf(s, 160, "%s/%s", DIR_, name);
    return s;
}

static void
sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    ck_assert_msg(system(cmd) == 0, "failed: %s", cmd);
}

static void
write_text(const char *name, const char *text)
{
    FILE *f = fopen(path(name), "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* A CA and a server certificate (localhost, 127.0.0.1; server and client use) signed by
 * it, as PREFIX-ca.pem, PREFIX.pem, PREFIX.key. */
static void
make_pki(const char *prefix)
{
    sh("cd '%s' && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
       "-keyout %s-ca.key -out %s-ca.pem -days 1 -subj '/CN=%s test CA' "
       "-addext basicConstraints=critical,CA:TRUE "
       "-addext keyUsage=critical,keyCertSign,cRLSign >/dev/null 2>&1 && "
       "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout %s.key "
       "-out %s.csr -subj /CN=localhost >/dev/null 2>&1 && "
       "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n"
       "extendedKeyUsage=serverAuth,clientAuth\\nbasicConstraints=CA:FALSE\\n' > %s.ext && "
       "openssl x509 -req -in %s.csr -CA %s-ca.pem -CAkey %s-ca.key -CAcreateserial "
       "-out %s.pem -days 1 -extfile %s.ext >/dev/null 2>&1",
       DIR_, prefix, prefix, prefix, prefix, prefix, prefix, prefix, prefix, prefix, prefix,
       prefix);
}

static void
setup(void)
{
    snprintf(DIR_, sizeof DIR_, "/tmp/tqkv-peer-sec-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(DIR_));
    SEED = tqkv_test_seed();
    make_pki("good");
    make_pki("rogue");
    /* one token file for every server; tokens-owner: tenant C loses "m" there */
    write_text("tokens", PEER_TOK " rw *\n" TOK_A " rw m\n" TOK_B " rw other\n" TOK_C " rw m\n");
    write_text("tokens-owner",
               PEER_TOK " rw *\n" TOK_A " rw m\n" TOK_B " rw other\n" TOK_C " rw other\n");
    write_text("peer-token", PEER_TOK "\n");
}

static void
teardown(void)
{
    if (getenv("TQKV_TEST_KEEP") == NULL)
        sh("rm -rf '%s'", DIR_);
}

/* A port for a server restarted at the same address (tests/support/ports.h). */
static int
free_port(void)
{
    int p = tqkv_test_free_port(0);
    ck_assert_int_gt(p, 0);
    return p;
}

/* The whole text of a file ("" when absent), malloc'd. */
static char *
slurp(const char *p)
{
    FILE *f = fopen(p, "r");
    char *buf = calloc(1, 1 << 20);
    ck_assert_ptr_nonnull(buf);
    if (f) {
        size_t n = fread(buf, 1, (1 << 20) - 1, f);
        buf[n] = '\0';
        fclose(f);
    }
    return buf;
}

/* Waits (at most timeout s) until file p holds needle. */
static int
wait_log(const char *p, const char *needle, double timeout)
{
    double t0 = proc_now();
    do {
        char *t = slurp(p);
        int ok = strstr(t, needle) != NULL;
        free(t);
        if (ok)
            return 1;
        usleep(20000);
    } while (proc_now() - t0 < timeout);
    return 0;
}

/* No token appears in a server's log. */
static void
assert_no_tokens(const char *log)
{
    char *t = slurp(log);
    ck_assert_msg(strstr(t, PEER_TOK) == NULL && strstr(t, TOK_A) == NULL &&
                      strstr(t, TOK_B) == NULL && strstr(t, TOK_C) == NULL,
                  "%s holds a token", log);
    free(t);
}

/* A client of the server at port alone, with TLS verified against ca (and the good
 * certificate as its own with mtls), sending token. */
static tqkv_client_t *
client_to(int port, const char *ca, const char *token, int mtls)
{
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    const char *tg[] = {addr};
    tqkv_client_opts_t o = {.targets = tg,
                            .num_targets = 1,
                            .tls = 1,
                            .tls_ca_path = path(ca),
                            .tls_cert_path = mtls ? path("good.pem") : NULL,
                            .tls_key_path = mtls ? path("good.key") : NULL,
                            .token = token,
                            .deadline_ms = 15000,
                            .no_read_repair = 1};
    tqkv_client_t *c = NULL;
    ck_assert_msg(tqkv_client_create(&o, &c) == TQKV_OK, "client: %s",
                  tqkv_client_last_error()->message);
    return c;
}

static void
block_data(const tqkv_hash_t *h, uint32_t layer, uint16_t *k, uint16_t *v)
{
    tqkv_test_block_data(h, layer, SH.num_tokens, SH.num_kv_heads, SH.head_dim, k, v);
}

/* Puts blocks hs[n] of ns (every layer). Returns the status; *grpc_code its code. */
static tqkv_status_t
put_blocks(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t n, int *grpc_code,
           tqkv_put_result_t *res)
{
    size_t e = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    uint16_t *k = malloc(e * 2), *v = malloc(e * 2);
    tqkv_put_t *p = NULL;
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
    tqkv_put_result_t r;
    memset(&r, 0, sizeof r);
    tqkv_status_t st = tqkv_client_put_begin(c, &po, &p);
    for (size_t i = 0; st == TQKV_OK && i < n; i++)
        for (uint32_t l = 0; st == TQKV_OK && l < L; l++) {
            block_data(&hs[i], l, k, v);
            tqkv_put_block_t b = {.ns = ns,
                                  .hash = &hs[i],
                                  .layer = l,
                                  .num_layers = L,
                                  .shape = SH,
                                  .key = k,
                                  .value = v};
            st = tqkv_client_put_block(p, &b);
        }
    *grpc_code = tqkv_client_last_error()->grpc_code;
    if (p) {
        tqkv_status_t st2 = tqkv_client_put_end(p, &r);
        if (st == TQKV_OK && st2 != TQKV_OK)
            *grpc_code = tqkv_client_last_error()->grpc_code;
        if (st == TQKV_OK)
            st = st2;
    }
    if (res)
        *res = r;
    free(k);
    free(v);
    return st;
}

/* Pages read by a Get: copies, per (block, layer). */
typedef struct pages {
    uint8_t *p[NMAX][L];
    size_t len[NMAX][L];
    size_t found, wrong;
    uint16_t *k, *v, *dk, *dv;
    const tqkv_hash_t *hs;
} pages_t;

static int
keep_page(void *arg, const tqkv_get_page_t *pg)
{
    pages_t *x = arg;
    if (!pg->found)
        return 0;
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    block_data(&x->hs[pg->hash_index], pg->layer, x->k, x->v);
    tqkv_block_shape_t got;
    if (tqkv_client_decode_page(pg->page, pg->page_len, x->dk, x->dv, &got) != TQKV_OK ||
        got.num_tokens != SH.num_tokens || !(tqkv_test_bf16_rel_err(x->k, x->dk, n) < 0.3) ||
        !(tqkv_test_bf16_rel_err(x->v, x->dv, n) < 0.3)) {
        x->wrong++;
        return 0;
    }
    x->found++;
    x->p[pg->hash_index][pg->layer] = malloc(pg->page_len);
    memcpy(x->p[pg->hash_index][pg->layer], pg->page, pg->page_len);
    x->len[pg->hash_index][pg->layer] = pg->page_len;
    return 0;
}

static tqkv_status_t
get_pages(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t n, pages_t *x,
          int *grpc_code)
{
    size_t e = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    memset(x, 0, sizeof *x);
    x->hs = hs;
    x->k = malloc(e * 2), x->v = malloc(e * 2), x->dk = malloc(e * 2), x->dv = malloc(e * 2);
    tqkv_get_req_t q = {
        .ns = ns, .hashes = hs, .num_hashes = n, .layer_end = L, .encoding = TQKV_CLIENT_PACKED};
    tqkv_status_t st = tqkv_client_get(c, &q, keep_page, x);
    *grpc_code = st == TQKV_OK ? 0 : tqkv_client_last_error()->grpc_code;
    free(x->k), free(x->v), free(x->dk), free(x->dv);
    return st;
}

static void
pages_free(pages_t *x)
{
    for (size_t i = 0; i < NMAX; i++)
        for (int l = 0; l < L; l++)
            free(x->p[i][l]);
}

/* Every page of a is in b, byte for byte. */
static void
assert_same_pages(const pages_t *a, const pages_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        for (int l = 0; l < L; l++) {
            ck_assert_msg(a->p[i][l] && b->p[i][l], "block %zu layer %d missing", i, l);
            ck_assert_msg(a->len[i][l] == b->len[i][l] &&
                              !memcmp(a->p[i][l], b->p[i][l], a->len[i][l]),
                          "block %zu layer %d: different bytes", i, l);
        }
}

/* n hashes whose owner (rank 0 among node ids a and b) is want (a or b). */
static void
hashes_owned(tqkv_hash_t *hs, size_t n, const char *ns, const char *a, const char *b,
             const char *want, uint64_t salt)
{
    uint64_t ia = tqkv_shard_target_id(a), ib = tqkv_shard_target_id(b);
    size_t k = 0;
    for (uint64_t i = 0; k < n; i++) {
        tqkv_test_hash(&hs[k], SEED ^ salt, i, 16);
        uint64_t key = tqkv_shard_block_key(ns, hs[k].bytes, hs[k].len);
        const char *top = tqkv_shard_score(ib, key) > tqkv_shard_score(ia, key) ? b : a;
        if (!strcmp(top, want))
            k++;
    }
}

static uint64_t
pages_on(int port, const char *ca, int mtls)
{
    tqkv_client_t *adm = client_to(port, ca, PEER_TOK, mtls);
    tqkv_client_stats_t s;
    ck_assert_msg(tqkv_client_stats(adm, "", &s) == TQKV_OK, "stats: %s",
                  tqkv_client_last_error()->message);
    tqkv_client_destroy(adm);
    return s.pages;
}

/* (a) hand-off with mutual TLS and tokens: every page reaches the peer, byte-identical. */
START_TEST(t_handoff_tls_tokens)
{
    int pa = free_port(), pb = free_port();
    char peers[64];
    snprintf(peers, sizeof peers, "127.0.0.1:%d,127.0.0.1:%d", pa, pb);
    srv_t A, B;
    const char *ids[2] = {"tqkv-a", "tqkv-b"};
    srv_t *S[2] = {&A, &B};
    const char *logs[2] = {path("a.log"), path("b.log")};
    for (int i = 0; i < 2; i++) {
        const char *extra[] = {"--node-id",         ids[i],
                               "--dram-capacity",   "64M",
                               "--peers",           peers,
                               "--handoff-seconds", "20",
                               "--no-forward",      "--tls-cert",
                               path("good.pem"),    "--tls-key",
                               path("good.key"),    "--tls-client-ca",
                               path("good-ca.pem"), "--auth-tokens",
                               path("tokens"),      "--peer-token-file",
                               path("peer-token"),  NULL};
        ck_assert_msg(srv_start_log(S[i], i ? pb : pa, extra, logs[i]) == 0, "start %s", ids[i]);
    }
    tqkv_hash_t hs[NB];
    for (size_t i = 0; i < NB; i++)
        tqkv_test_hash(&hs[i], SEED, i, 16);
    tqkv_client_t *ca = client_to(pa, "good-ca.pem", TOK_A, 1);
    int code = 0;
    tqkv_put_result_t r;
    ck_assert_msg(put_blocks(ca, "m", hs, NB, &code, &r) == TQKV_OK, "put: %s",
                  tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_stored, NB * L);
    pages_t before, after;
    ck_assert_int_eq(get_pages(ca, "m", hs, NB, &before, &code), TQKV_OK);
    ck_assert_uint_eq(before.found, NB * L);
    tqkv_client_destroy(ca);
    ck_assert_uint_eq(pages_on(pb, "good-ca.pem", 1), 0);

    double t0 = proc_now();
    srv_kill(&A, SIGTERM);
    ck_assert_msg(srv_wait(&A, 60) == 0, "A did not exit within 60 s");
    tqkv_client_t *cb = client_to(pb, "good-ca.pem", TOK_A, 1);
    ck_assert_int_eq(get_pages(cb, "m", hs, NB, &after, &code), TQKV_OK);
    fprintf(stderr, "peer security: hand-off over mutual TLS: %zu of %d pages on B (%.2f s)\n",
            after.found, NB * L, proc_now() - t0);
    ck_assert_uint_eq(after.wrong, 0);
    ck_assert_uint_eq(after.found, NB * L);
    assert_same_pages(&before, &after, NB);
    char *log = slurp(logs[0]);
    char want[64];
    snprintf(want, sizeof want, "stored=%d ", NB * L);
    ck_assert_msg(strstr(log, "hand-off") && strstr(log, want) && strstr(log, "tls=on"),
                  "A's log has no hand-off line with %s and tls=on", want);
    free(log);
    pages_free(&before);
    pages_free(&after);
    tqkv_client_destroy(cb);
    srv_stop(&B);
    assert_no_tokens(logs[0]);
    assert_no_tokens(logs[1]);
}
END_TEST

/* Puts probe blocks B owns through A until B has one (A forwards to B), at most timeout s.
 * Returns 1 when it did. */
static int
wait_forwarding(int pa, int pb, double timeout)
{
    static uint64_t probe;
    tqkv_client_t *ca = client_to(pa, "good-ca.pem", TOK_A, 0);
    double t0 = proc_now();
    int ready = 0;
    do {
        tqkv_hash_t h;
        hashes_owned(&h, 1, "m", "tqkv-a", "tqkv-b", "tqkv-b", 0xBEEF0000ull + ++probe);
        /* B's own pages (not a Lookup through B: B, the owner, would read the probe
         * through from A, which kept it while not forwarding yet) */
        uint64_t before = pages_on(pb, "good-ca.pem", 0);
        int code;
        ck_assert_msg(put_blocks(ca, "m", &h, 1, &code, NULL) == TQKV_OK, "probe put: %s",
                      tqkv_client_last_error()->message);
        ready = pages_on(pb, "good-ca.pem", 0) > before;
        if (!ready)
            usleep(100000);
    } while (!ready && proc_now() - t0 < timeout);
    tqkv_client_destroy(ca);
    return ready;
}

/* Starts A (forwarding, token file "tokens", the peers' CA peer_ca_a) and B (the owner,
 * "tokens-owner") with TLS, and waits until A has made its peers' client. */
static void
forward_pair(srv_t *A, srv_t *B, int *pa, int *pb, const char *peer_ca_a)
{
    *pa = free_port(), *pb = free_port();
    char peers[64];
    snprintf(peers, sizeof peers, "127.0.0.1:%d,127.0.0.1:%d", *pa, *pb);
    const char *ids[2] = {"tqkv-a", "tqkv-b"};
    const char *tok[2] = {path("tokens"), path("tokens-owner")};
    const char *pca[2] = {path(peer_ca_a), path("good-ca.pem")};
    srv_t *S[2] = {A, B};
    for (int i = 0; i < 2; i++) {
        const char *extra[] = {"--node-id",
                               ids[i],
                               "--dram-capacity",
                               "64M",
                               "--peers",
                               peers,
                               "--handoff-seconds",
                               "0",
                               "--tls-cert",
                               path("good.pem"),
                               "--tls-key",
                               path("good.key"),
                               "--peer-ca",
                               pca[i],
                               "--auth-tokens",
                               tok[i],
                               "--peer-token-file",
                               path("peer-token"),
                               NULL};
        ck_assert_msg(srv_start_log(S[i], i ? *pb : *pa, extra, path(i ? "b.log" : "a.log")) == 0,
                      "start %s", ids[i]);
    }
    ck_assert_msg(wait_log(path("a.log"), "forwarding to peers", 30),
                  "A did not start forwarding within 30 s");
}

/* (b) forwarding with auth on: the caller's token travels, the owner checks it. */
START_TEST(t_forward_caller_token)
{
    srv_t A, B;
    int pa, pb, code;
    forward_pair(&A, &B, &pa, &pb, "good-ca.pem");
    ck_assert_msg(wait_forwarding(pa, pb, 30), "A did not forward to B within 30 s");
    tqkv_hash_t hs[NB], hs2[NB], own_a;
    hashes_owned(hs, NB, "m", "tqkv-a", "tqkv-b", "tqkv-b", 1);
    hashes_owned(hs2, NB, "m", "tqkv-a", "tqkv-b", "tqkv-b", 2);
    hashes_owned(&own_a, 1, "m", "tqkv-a", "tqkv-b", "tqkv-a", 3);
    uint64_t on_a = pages_on(pa, "good-ca.pem", 0), on_b = pages_on(pb, "good-ca.pem", 0);

    /* tenant A: Put through A lands on B; Gets through B and through A find it */
    tqkv_client_t *a_a = client_to(pa, "good-ca.pem", TOK_A, 0);
    tqkv_client_t *a_b = client_to(pb, "good-ca.pem", TOK_A, 0);
    ck_assert_msg(put_blocks(a_a, "m", hs, NB, &code, NULL) == TQKV_OK, "put: %s",
                  tqkv_client_last_error()->message);
    ck_assert_uint_eq(pages_on(pb, "good-ca.pem", 0), on_b + NB * L);
    ck_assert_uint_eq(pages_on(pa, "good-ca.pem", 0), on_a);
    pages_t via_b, via_a;
    ck_assert_int_eq(get_pages(a_b, "m", hs, NB, &via_b, &code), TQKV_OK);
    ck_assert_int_eq(get_pages(a_a, "m", hs, NB, &via_a, &code), TQKV_OK);
    ck_assert_uint_eq(via_b.wrong + via_a.wrong, 0);
    ck_assert_uint_eq(via_b.found, NB * L);
    ck_assert_uint_eq(via_a.found, NB * L);
    assert_same_pages(&via_b, &via_a, NB);
    pages_free(&via_a);
    pages_free(&via_b);

    /* tenant B (no grant on "m"): denied through the forwarder, Get and Put */
    tqkv_client_t *b_a = client_to(pa, "good-ca.pem", TOK_B, 0);
    pages_t x;
    ck_assert_int_ne(get_pages(b_a, "m", hs, NB, &x, &code), TQKV_OK);
    ck_assert_int_eq(code, 7); /* PERMISSION_DENIED */
    ck_assert_uint_eq(x.found, 0);
    pages_free(&x);
    ck_assert_int_ne(put_blocks(b_a, "m", hs2, 1, &code, NULL), TQKV_OK);
    ck_assert_int_eq(code, 7);

    /* tenant C: A grants "m", the owner B does not. B's verdict holds through A. */
    ck_assert_int_eq(put_blocks(a_a, "m", hs2, NB, &code, NULL), TQKV_OK);
    tqkv_client_t *c_a = client_to(pa, "good-ca.pem", TOK_C, 0);
    ck_assert_int_eq(get_pages(c_a, "m", hs2, NB, &x, &code), TQKV_OK);
    fprintf(stderr,
            "peer security: forwarding with the caller's token: tenant C (granted on A, not "
            "on the owner B) found %zu of %d pages through A\n",
            x.found, NB * L);
    ck_assert_uint_eq(x.found, 0);
    pages_free(&x);
    uint8_t tiers[NB];
    uint32_t prefix = 0;
    tqkv_lookup_req_t q = {.ns = "m", .hashes = hs2, .num_hashes = NB, .num_layers = L};
    ck_assert_int_ne(tqkv_client_lookup(c_a, &q, &prefix, tiers), TQKV_OK);
    ck_assert_int_eq(tqkv_client_last_error()->grpc_code, 7);
    tqkv_hash_t fresh;
    hashes_owned(&fresh, 1, "m", "tqkv-a", "tqkv-b", "tqkv-b", 4);
    ck_assert_int_ne(put_blocks(c_a, "m", &fresh, 1, &code, NULL), TQKV_OK);
    ck_assert_int_eq(code, 7);
    /* the control: a block A owns is A's to grant */
    ck_assert_msg(put_blocks(c_a, "m", &own_a, 1, &code, NULL) == TQKV_OK, "put on A: %s",
                  tqkv_client_last_error()->message);
    /* the same tenant C, through B directly: denied too (B's file) */
    tqkv_client_t *c_b = client_to(pb, "good-ca.pem", TOK_C, 0);
    ck_assert_int_ne(get_pages(c_b, "m", hs2, NB, &x, &code), TQKV_OK);
    ck_assert_int_eq(code, 7);
    pages_free(&x);

    tqkv_client_destroy(a_a);
    tqkv_client_destroy(a_b);
    tqkv_client_destroy(b_a);
    tqkv_client_destroy(c_a);
    tqkv_client_destroy(c_b);
    srv_stop(&A);
    srv_stop(&B);
    assert_no_tokens(path("a.log"));
    assert_no_tokens(path("b.log"));
}
END_TEST

/* Reload: A starts trusting the wrong CA for its peers (nothing is forwarded: B cannot
 * be verified); the right CA written over the file and SIGHUP make A's forwarding client
 * again, and A forwards. */
START_TEST(t_forward_reload)
{
    sh("cp '%s' '%s'", path("rogue-ca.pem"), path("peer-ca.pem"));
    srv_t A, B;
    int pa, pb;
    forward_pair(&A, &B, &pa, &pb, "peer-ca.pem");
    ck_assert_msg(!wait_forwarding(pa, pb, 2), "A forwarded to a peer it cannot verify");
    sh("cp '%s' '%s.tmp' && mv '%s.tmp' '%s'", path("good-ca.pem"), path("peer-ca.pem"),
       path("peer-ca.pem"), path("peer-ca.pem"));
    double t0 = proc_now();
    srv_kill(&A, SIGHUP);
    ck_assert_msg(wait_log(path("a.log"), "peers' client made again", 30),
                  "A did not make its peers' client again within 30 s of SIGHUP");
    ck_assert_msg(wait_forwarding(pa, pb, 30), "A did not forward to B within 30 s after reload");
    fprintf(stderr, "peer security: forwarding after the peer CA was fixed and SIGHUP: %.2f s\n",
            proc_now() - t0);
    srv_stop(&A);
    srv_stop(&B);
    assert_no_tokens(path("a.log"));
}
END_TEST

/* (c) a peer whose certificate another CA signed is refused. */
START_TEST(t_handoff_wrong_ca)
{
    int pa = free_port(), pr = free_port();
    char peers[64];
    snprintf(peers, sizeof peers, "127.0.0.1:%d,127.0.0.1:%d", pa, pr);
    srv_t A, R;
    const char *rx[] = {"--node-id",
                        "tqkv-r",
                        "--dram-capacity",
                        "64M",
                        "--tls-cert",
                        path("rogue.pem"),
                        "--tls-key",
                        path("rogue.key"),
                        "--auth-tokens",
                        path("tokens"),
                        NULL};
    ck_assert(srv_start_log(&R, pr, rx, path("r.log")) == 0);
    const char *ax[] = {"--node-id",         "tqkv-a",
                        "--dram-capacity",   "64M",
                        "--peers",           peers,
                        "--handoff-seconds", "5",
                        "--no-forward",      "--tls-cert",
                        path("good.pem"),    "--tls-key",
                        path("good.key"),    "--peer-ca",
                        path("good-ca.pem"), "--auth-tokens",
                        path("tokens"),      "--peer-token-file",
                        path("peer-token"),  NULL};
    ck_assert(srv_start_log(&A, pa, ax, path("a.log")) == 0);
    tqkv_hash_t hs[NB];
    for (size_t i = 0; i < NB; i++)
        tqkv_test_hash(&hs[i], SEED, 500 + i, 16);
    tqkv_client_t *ca = client_to(pa, "good-ca.pem", TOK_A, 0);
    int code;
    ck_assert_int_eq(put_blocks(ca, "m", hs, NB, &code, NULL), TQKV_OK);
    tqkv_client_destroy(ca);
    srv_kill(&A, SIGTERM);
    ck_assert_msg(srv_wait(&A, 60) == 0, "A did not exit within 60 s");
    ck_assert_uint_eq(pages_on(pr, "rogue-ca.pem", 0), 0);
    char *log = slurp(path("a.log"));
    char *line = strstr(log, "msg=\"hand-off\"");
    ck_assert_msg(line != NULL, "A's log has no hand-off line");
    while (line > log && line[-1] != '\n')
        line--;
    char *eol = strchr(line, '\n');
    if (eol)
        *eol = '\0';
    fprintf(stderr, "peer security: hand-off to a peer of another CA: %s\n", line);
    ck_assert_msg(strstr(line, "stored=0 ") && strstr(line, "level=warn"), "hand-off line: %s",
                  line);
    ck_assert_msg(strstr(line, "failed=0 ") == NULL, "no failure counted: %s", line);
    ck_assert_msg(strstr(line, "certificate verify failed"), "no reason: %s", line);
    free(log);
    srv_stop(&R);
    assert_no_tokens(path("a.log"));
}
END_TEST

/* Fails to start, with a log line holding want. */
static void
start_fails(const char *const *extra, const char *log, const char *want)
{
    srv_t s;
    ck_assert_msg(srv_start_log(&s, 0, extra, path(log)) != 0, "started: %s", log);
    char *t = slurp(path(log));
    ck_assert_msg(strstr(t, want) != NULL, "%s: no '%s' in: %s", log, want, t);
    free(t);
}

/* Start-up checks: a peer token without rw on *, --peers with TLS but no CA, with auth
 * but no peer token; auth on without TLS leaves forwarding off, saying why, once. */
START_TEST(t_startup_checks)
{
    write_text("tokens-weak", PEER_TOK " rw m\n" TOK_A " rw m\n");
    const char *weak[] = {"--peers",
                          "127.0.0.1:1",
                          "--auth-tokens",
                          path("tokens-weak"),
                          "--peer-token-file",
                          path("peer-token"),
                          NULL};
    start_fails(weak, "weak.log", "must have rw on * in --auth-tokens");
    write_text("peer-token-x", "not-a-known-token\n");
    const char *unknown[] = {"--peers",
                             "127.0.0.1:1",
                             "--auth-tokens",
                             path("tokens"),
                             "--peer-token-file",
                             path("peer-token-x"),
                             NULL};
    start_fails(unknown, "unknown.log", "the token is not in --auth-tokens");
    const char *multi[] = {
        "--peers",      "127.0.0.1:1", "--auth-tokens", path("tokens-owner"), "--peer-token-file",
        path("tokens"), NULL};
    start_fails(multi, "multi.log", "expected one token");
    const char *noca[] = {"--peers",   "127.0.0.1:1",    "--tls-cert", path("good.pem"),
                          "--tls-key", path("good.key"), NULL};
    start_fails(noca, "noca.log", "--peer-ca FILE");
    const char *notok[] = {"--peers", "127.0.0.1:1", "--auth-tokens", path("tokens"), NULL};
    start_fails(notok, "notok.log", "--peer-token-file FILE");
    const char *plain[] = {
        "--peers",      "127.0.0.1:1",       "--handoff-seconds", "0", "--auth-tokens",
        path("tokens"), "--peer-token-file", path("peer-token"),  NULL};
    srv_t s;
    ck_assert(srv_start_log(&s, 0, plain, path("plain.log")) == 0);
    ck_assert(wait_log(path("plain.log"), "forwarding off: auth is on without TLS", 10));
    srv_stop(&s);
    char *t = slurp(path("plain.log"));
    char *first = strstr(t, "forwarding off");
    ck_assert(first && strstr(first + 1, "forwarding off") == NULL);
    ck_assert(strstr(t, "forwarding to peers") == NULL);
    free(t);
    assert_no_tokens(path("plain.log"));
    assert_no_tokens(path("weak.log"));
}
END_TEST

static Suite *
peer_security_suite(void)
{
    Suite *s = suite_create("peer_security");
    TCase *tc = tcase_create("tls_tokens");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, t_handoff_tls_tokens);
    tcase_add_test(tc, t_forward_caller_token);
    tcase_add_test(tc, t_handoff_wrong_ca);
    tcase_add_test(tc, t_forward_reload);
    tcase_add_test(tc, t_startup_checks);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    if (srv_path() == NULL || system("openssl version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "SKIP: needs TQKV_SERVER and the openssl tool\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(peer_security_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
