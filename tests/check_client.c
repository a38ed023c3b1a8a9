/* check_client.c - libtqkv against a real tqkv-server on loopback (label "server").
 *
 * Each test starts its own server (fork/exec, free port) in a checked fixture, so a
 * test that kills or wedges its server cannot affect the next one.
 */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/attention.h"
#include "kernels/page.h"
#include "tests/check_main.h"
#include "transport/client.h"

#include "tests/support/kv_data.h"
#include "tests/support/rng.h"
#include "tests/support/sanitize.h"
#include "tests/support/server_proc.h"

static srv_t S;
static tqkv_client_t *CL;
static uint64_t SEED;
static int SANITIZED;

static tqkv_client_t *
client_for(const char *addr, uint32_t deadline_ms)
{
    const char *t[1] = {addr};
    tqkv_client_opts_t o = {
        .targets = t, .num_targets = 1, .deadline_ms = deadline_ms, .wait_for_ready = 1};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

static void
setup(void)
{
    SANITIZED = tqkv_test_sanitized();
    SEED = tqkv_test_seed();
    ck_assert_msg(srv_start(&S, 0, NULL) == 0, "cannot start tqkv-server");
    CL = client_for(S.addr, 30000);
}

static void
teardown(void)
{
    tqkv_client_destroy(CL);
    CL = NULL;
    srv_stop(&S);
}

/* A block of the tests: K and V BF16 of one (hash, layer). */
typedef struct blk {
    tqkv_hash_t h;
    uint32_t layer;
    uint16_t *k, *v;
} blk_t;

static tqkv_put_opts_t PUT4 = {.key_bits = 4, .value_bits = 4};

static void
put_blocks(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nh, uint32_t layers,
           tqkv_block_shape_t sh, uint16_t **k, uint16_t **v, uint64_t *stored)
{
    tqkv_put_t *p;
    tqkv_put_result_t r;
    ck_assert_int_eq(tqkv_client_put_begin(c, &PUT4, &p), TQKV_OK);
    for (size_t b = 0; b < nh; b++) {
        for (uint32_t l = 0; l < layers; l++) {
            tqkv_put_block_t pb = {.ns = ns,
                                   .hash = &hs[b],
                                   .parent = b ? &hs[b - 1] : NULL,
                                   .layer = l,
                                   .num_layers = layers,
                                   .shape = sh,
                                   .key = k[b * layers + l],
                                   .value = v[b * layers + l]};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
        }
    }
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_sent, nh * layers);
    if (stored)
        *stored = r.blocks_stored;
}

typedef struct collect {
    size_t nh, L;
    int encoding;
    tqkv_block_shape_t sh;
    uint16_t **k, **v; /* sources [hash * L + layer] */
    int *seen;         /* [hash * L + layer]: 1 found, 2 missing */
    size_t pages, cancel_after;
    double max_err;
    int bad;
    int ordered; /* layer-major order held */
    uint32_t last_layer;
    int first;
} collect_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    collect_t *c = arg;
    size_t slot = pg->hash_index * c->L + pg->layer;
    c->pages++;
    if (pg->hash_index >= c->nh || pg->layer >= c->L || c->seen[slot]) {
        c->bad++;
        return 0;
    }
    if (c->first && pg->layer < c->last_layer)
        c->ordered = 0;
    c->first = 1;
    c->last_layer = pg->layer;
    c->seen[slot] = pg->found ? 1 : 2;
    if (pg->found) {
        size_t n = (size_t)c->sh.num_tokens * c->sh.num_kv_heads * c->sh.head_dim;
        if (c->encoding == TQKV_CLIENT_PACKED) {
            uint16_t *dk = malloc(n * 2), *dv = malloc(n * 2);
            tqkv_block_shape_t got;
            ck_assert_ptr_nonnull(dk);
            ck_assert_ptr_nonnull(dv);
            ck_assert_int_eq((uintptr_t)pg->page & 63, 0);
            if (tqkv_client_decode_page(pg->page, pg->page_len, dk, dv, &got) != TQKV_OK ||
                got.num_tokens != c->sh.num_tokens || got.head_dim != c->sh.head_dim) {
                c->bad++;
            } else {
                double ek = tqkv_test_bf16_rel_err(c->k[slot], dk, n),
                       ev = tqkv_test_bf16_rel_err(c->v[slot], dv, n);
                c->max_err = fmax(c->max_err, fmax(ek, ev));
            }
            free(dk);
            free(dv);
        } else {
            if (pg->key_len != n * 2 || pg->value_len != n * 2) {
                c->bad++;
            } else {
                double ek = tqkv_test_bf16_rel_err(c->k[slot], pg->key, n),
                       ev = tqkv_test_bf16_rel_err(c->v[slot], pg->value, n);
                c->max_err = fmax(c->max_err, fmax(ek, ev));
            }
        }
    }
    return c->cancel_after && c->pages >= c->cancel_after;
}

static void
make_data(size_t nh, uint32_t L, tqkv_block_shape_t sh, uint16_t ***k, uint16_t ***v)
{
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    *k = calloc(nh * L, sizeof **k);
    *v = calloc(nh * L, sizeof **v);
    for (size_t i = 0; i < nh * L; i++) {
        (*k)[i] = malloc(n * 2);
        (*v)[i] = malloc(n * 2);
        tqkv_test_bf16_fill(&SEED, (*k)[i], n, sh.head_dim);
        tqkv_test_bf16_fill(&SEED, (*v)[i], n, sh.head_dim);
    }
}

static void
free_data(size_t nh, uint32_t L, uint16_t **k, uint16_t **v)
{
    for (size_t i = 0; i < nh * L; i++) {
        free(k[i]);
        free(v[i]);
    }
    free(k);
    free(v);
}

static collect_t
get_all(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nh, uint32_t L,
        tqkv_block_shape_t sh, int enc, uint16_t **k, uint16_t **v, tqkv_status_t *st)
{
    collect_t col = {.nh = nh, .L = L, .encoding = enc, .sh = sh, .k = k, .v = v, .ordered = 1};
    col.seen = calloc(nh * L, sizeof *col.seen);
    tqkv_get_req_t q = {.ns = ns,
                        .hashes = hs,
                        .num_hashes = nh,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = enc};
    *st = tqkv_client_get(c, &q, on_page, &col);
    return col;
}

START_TEST(test_roundtrip_both_encodings)
{
    const size_t nh = 3;
    const uint32_t L = 3;
    tqkv_block_shape_t sh = {37, 3, 64}; /* awkward token and head counts */
    tqkv_hash_t hs[3];
    uint16_t **k, **v;
    uint64_t stored;
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, i, (uint8_t)(8 + i * 28)); /* 8, 36, 64 bytes */
    make_data(nh, L, sh, &k, &v);
    put_blocks(CL, "rt", hs, nh, L, sh, k, v, &stored);
    ck_assert_uint_eq(stored, nh * L);
    /* A second Put of the same keys is an idempotent no-op. */
    put_blocks(CL, "rt", hs, nh, L, sh, k, v, &stored);
    ck_assert_uint_eq(stored, 0);

    uint32_t prefix = 99;
    uint8_t tiers[3];
    tqkv_lookup_req_t lq = {.ns = "rt", .hashes = hs, .num_hashes = nh, .num_layers = L};
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, tiers), TQKV_OK);
    ck_assert_uint_eq(prefix, nh);
    for (size_t i = 0; i < nh; i++)
        ck_assert_int_ne(tiers[i], TQKV_CLIENT_TIER_NONE);
    /* Another namespace sees nothing. */
    lq.ns = "other";
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, NULL), TQKV_OK);
    ck_assert_uint_eq(prefix, 0);

    for (int enc = 0; enc < 2; enc++) {
        tqkv_status_t st;
        collect_t c = get_all(CL, "rt", hs, nh, L, sh, enc, k, v, &st);
        ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
        ck_assert_int_eq(c.bad, 0);
        ck_assert_uint_eq(c.pages, nh * L);
        ck_assert(c.ordered);
        for (size_t i = 0; i < nh * L; i++)
            ck_assert_int_eq(c.seen[i], 1);
        /* 4-bit TurboQuant: D_mse ~ 0.0093, so ~0.1 relative error; 0.3 is the bound. */
        ck_assert_msg(c.max_err > 0 && c.max_err < 0.3, "max rel err %g", c.max_err);
        free(c.seen);
    }

    tqkv_client_stats_t stats;
    ck_assert_int_eq(tqkv_client_stats(CL, "rt", &stats), TQKV_OK);
    ck_assert_uint_ge(stats.pages, nh * L);
    ck_assert(stats.compression_ratio > 1.0);
    int serving = 0;
    ck_assert_int_eq(tqkv_client_health(CL, 0, "", &serving), TQKV_OK);
    ck_assert_int_eq(serving, 1);

    uint64_t pd = 0;
    ck_assert_int_eq(tqkv_client_delete(CL, "rt", hs, 1, 0, &pd, NULL), TQKV_OK);
    ck_assert_uint_eq(pd, L);
    lq.ns = "rt";
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, tiers), TQKV_OK);
    ck_assert_uint_eq(prefix, 0);
    ck_assert_int_eq(tiers[0], TQKV_CLIENT_TIER_NONE);
    free_data(nh, L, k, v);
}
END_TEST

START_TEST(test_prefix_missing_middle)
{
    const size_t nh = 4;
    const uint32_t L = 2;
    tqkv_block_shape_t sh = {16, 2, 128};
    tqkv_hash_t hs[4], put3[3];
    uint16_t **k, **v, *pk[6], *pv[6];
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, 100 + i, 16);
    make_data(nh, L, sh, &k, &v);
    /* Blocks 0, 1 and 3: block 2 is missing. */
    size_t src[3] = {0, 1, 3};
    for (size_t i = 0; i < 3; i++) {
        put3[i] = hs[src[i]];
        for (uint32_t l = 0; l < L; l++) {
            pk[i * L + l] = k[src[i] * L + l];
            pv[i * L + l] = v[src[i] * L + l];
        }
    }
    put_blocks(CL, "pm", put3, 3, L, sh, pk, pv, NULL);
    uint32_t prefix = 99;
    uint8_t tiers[4];
    tqkv_lookup_req_t lq = {.ns = "pm", .hashes = hs, .num_hashes = nh, .num_layers = L};
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, tiers), TQKV_OK);
    ck_assert_uint_eq(prefix, 2);
    ck_assert_int_eq(tiers[2], TQKV_CLIENT_TIER_NONE);
    /* Asking for more layers than were put: no block is complete. */
    lq.num_layers = L + 1;
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, NULL), TQKV_OK);
    ck_assert_uint_eq(prefix, 0);

    tqkv_status_t st;
    collect_t c = get_all(CL, "pm", hs, nh, L, sh, TQKV_CLIENT_BF16, k, v, &st);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_int_eq(c.bad, 0);
    ck_assert_uint_eq(c.pages, nh * L);
    for (size_t i = 0; i < nh; i++)
        for (uint32_t l = 0; l < L; l++)
            ck_assert_int_eq(c.seen[i * L + l], i == 2 ? 2 : 1);
    free(c.seen);
    free_data(nh, L, k, v);
}
END_TEST

typedef struct thr {
    int id, failures;
    uint64_t seed;
} thr_t;

static void *
conc_main(void *arg)
{
    thr_t *t = arg;
    const uint32_t L = 2;
    const size_t nh = 3;
    tqkv_block_shape_t sh = {32, 2, 64};
    int rounds = SANITIZED ? 2 : 6;
    char ns[32];
    snprintf(ns, sizeof ns, "conc%d", t->id % 2); /* two threads share a namespace */
    for (int r = 0; r < rounds; r++) {
        tqkv_hash_t hs[3];
        uint16_t **k, **v;
        uint64_t s = t->seed;
        for (size_t i = 0; i < nh; i++)
            tqkv_test_hash(&hs[i], t->seed + (uint64_t)t->id * 7777, (uint64_t)r * 10 + i, 24);
        size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
        k = calloc(nh * L, sizeof *k);
        v = calloc(nh * L, sizeof *v);
        for (size_t i = 0; i < nh * L; i++) {
            k[i] = malloc(n * 2);
            v[i] = malloc(n * 2);
            tqkv_test_bf16_fill(&s, k[i], n, sh.head_dim);
            tqkv_test_bf16_fill(&s, v[i], n, sh.head_dim);
        }
        t->seed = s;
        put_blocks(CL, ns, hs, nh, L, sh, k, v, NULL);
        tqkv_status_t st;
        collect_t c = get_all(CL, ns, hs, nh, L, sh, r % 2, k, v, &st);
        if (st != TQKV_OK || c.bad || c.pages != nh * L || !(c.max_err < 0.3))
            t->failures++;
        for (size_t i = 0; i < nh * L; i++)
            if (c.seen[i] != 1)
                t->failures++;
        free(c.seen);
        for (size_t i = 0; i < nh * L; i++) {
            free(k[i]);
            free(v[i]);
        }
        free(k);
        free(v);
    }
    return NULL;
}

START_TEST(test_concurrent_clients)
{
    enum { NT = 4 };
    pthread_t th[NT];
    thr_t t[NT];
    for (int i = 0; i < NT; i++) {
        t[i] = (thr_t){.id = i, .seed = SEED + (uint64_t)i * 31};
        ck_assert_int_eq(pthread_create(&th[i], NULL, conc_main, &t[i]), 0);
    }
    int fails = 0;
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        fails += t[i].failures;
    }
    ck_assert_int_eq(fails, 0);
}
END_TEST

START_TEST(test_large_block)
{
    /* 8192 tokens x 8 heads x 128 dims BF16 = 16 MiB per tensor, 32 MiB per Put. */
    tqkv_block_shape_t sh = {8192, 8, 128};
    tqkv_hash_t h;
    uint16_t **k, **v;
    tqkv_test_hash(&h, SEED, 4242, 32);
    make_data(1, 1, sh, &k, &v);
    put_blocks(CL, "big", &h, 1, 1, sh, k, v, NULL);
    for (int enc = 0; enc < 2; enc++) {
        tqkv_status_t st;
        collect_t c = get_all(CL, "big", &h, 1, 1, sh, enc, k, v, &st);
        ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
        ck_assert_int_eq(c.bad, 0);
        ck_assert_int_eq(c.seen[0], 1);
        ck_assert(c.max_err < 0.3);
        free(c.seen);
    }
    /* A tiny deadline on the 32 MiB BF16 Get: DEADLINE_EXCEEDED, not a hang. */
    tqkv_client_t *fast = client_for(S.addr, 1);
    tqkv_status_t st;
    collect_t c = get_all(fast, "big", &h, 1, 1, sh, TQKV_CLIENT_BF16, k, v, &st);
    ck_assert_int_eq(st, TQKV_ETIMEDOUT);
    ck_assert_int_eq(tqkv_client_last_error()->grpc_code, 4 /* DEADLINE_EXCEEDED */);
    free(c.seen);
    tqkv_client_destroy(fast);
    /* The server is fine afterwards. */
    c = get_all(CL, "big", &h, 1, 1, sh, TQKV_CLIENT_PACKED, k, v, &st);
    ck_assert_int_eq(st, TQKV_OK);
    ck_assert_int_eq(c.seen[0], 1);
    free(c.seen);
    free_data(1, 1, k, v);
}
END_TEST

START_TEST(test_cancel_midstream)
{
    const size_t nh = 8;
    const uint32_t L = 4;
    tqkv_block_shape_t sh = {64, 4, 128};
    tqkv_hash_t hs[8];
    uint16_t **k, **v;
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, 300 + i, 16);
    make_data(nh, L, sh, &k, &v);
    put_blocks(CL, "cx", hs, nh, L, sh, k, v, NULL);
    for (int rep = 0; rep < 3; rep++) {
        collect_t col = {.nh = nh, .L = L, .encoding = TQKV_CLIENT_BF16, .sh = sh, .k = k, .v = v};
        col.seen = calloc(nh * L, sizeof *col.seen);
        col.cancel_after = 3;
        tqkv_get_req_t q = {.ns = "cx",
                            .hashes = hs,
                            .num_hashes = nh,
                            .layer_end = L,
                            .encoding = TQKV_CLIENT_BF16};
        ck_assert_int_eq(tqkv_client_get(CL, &q, on_page, &col), TQKV_ECANCELED);
        ck_assert_uint_eq(col.pages, 3); /* no callback after the one that cancelled */
        free(col.seen);
    }
    tqkv_status_t st;
    collect_t c = get_all(CL, "cx", hs, nh, L, sh, TQKV_CLIENT_PACKED, k, v, &st);
    ck_assert_int_eq(st, TQKV_OK);
    ck_assert_uint_eq(c.pages, nh * L);
    ck_assert_int_eq(c.bad, 0);
    free(c.seen);
    free_data(nh, L, k, v);
}
END_TEST

typedef struct slowget {
    tqkv_client_t *c;
    const tqkv_hash_t *hs;
    size_t nh;
    uint32_t L;
    tqkv_status_t st;
    char msg[256]; /* the failure's message (tqkv_client_last_error of the Get's thread) */
    _Atomic int pages;
    _Atomic int done;
} slowget_t;

static int
slow_page(void *arg, const tqkv_get_page_t *pg)
{
    slowget_t *s = arg;
    atomic_fetch_add(&s->pages, 1);
    usleep(20000);
    return 0;
}

static void *
slow_main(void *arg)
{
    slowget_t *s = arg;
    tqkv_get_req_t q = {.ns = "term",
                        .hashes = s->hs,
                        .num_hashes = s->nh,
                        .layer_end = s->L,
                        .encoding = TQKV_CLIENT_BF16};
    s->st = tqkv_client_get(s->c, &q, slow_page, s);
    if (s->st != TQKV_OK)
        snprintf(s->msg, sizeof s->msg, "%s", tqkv_client_last_error()->message);
    atomic_store(&s->done, 1);
    return NULL;
}

START_TEST(test_sigterm_midstream)
{
    const size_t nh = 16;
    const uint32_t L = 8;
    tqkv_block_shape_t sh = {256, 8, 128}; /* 1 MiB of BF16 K+V per page */
    tqkv_hash_t hs[16];
    uint16_t **k, **v;
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, 500 + i, 16);
    make_data(nh, L, sh, &k, &v);
    put_blocks(CL, "term", hs, nh, L, sh, k, v, NULL);
    slowget_t s = {.c = CL, .hs = hs, .nh = nh, .L = L};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, slow_main, &s), 0);
    double t0 = proc_now();
    while (atomic_load(&s.pages) < 2 && !atomic_load(&s.done) && proc_now() - t0 < 20)
        usleep(1000);
    srv_kill(&S, SIGTERM);
    /* 128 pages at 20 ms each take 2.6 s; the server drains for 1 s, then cancels the
     * call with UNAVAILABLE ("Cancelling all calls", grpc_server_cancel_all_calls): the Get
     * must come back, interrupted, with exactly that (retryable elsewhere), never an
     * internal error. */
    t0 = proc_now();
    while (!atomic_load(&s.done) && proc_now() - t0 < 20)
        usleep(10000);
    ck_assert_msg(atomic_load(&s.done), "Get hung after SIGTERM");
    pthread_join(th, NULL);
    fprintf(stderr, "sigterm midstream: %d pages, %s (%s)\n", atomic_load(&s.pages),
            tqkv_status_name(s.st), s.msg);
    ck_assert_msg(s.st == TQKV_EUNAVAILABLE, "status %s (%s)", tqkv_status_name(s.st), s.msg);
    ck_assert_msg(s.msg[0] != '\0', "no message");
    ck_assert_int_lt(atomic_load(&s.pages), (int)(nh * L));
    ck_assert_int_eq(srv_wait(&S, 15), 0);
    /* The server is gone: a single-target client reports UNAVAILABLE. */
    tqkv_client_destroy(CL);
    CL = client_for(S.addr, 2000);
    uint32_t prefix;
    tqkv_lookup_req_t lq = {.ns = "term", .hashes = hs, .num_hashes = 1, .num_layers = 1};
    tqkv_status_t st = tqkv_client_lookup(CL, &lq, &prefix, NULL);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ETIMEDOUT, "status %s",
                  tqkv_status_name(st));
    free_data(nh, L, k, v);
}
END_TEST

START_TEST(test_errors)
{
    tqkv_hash_t shorth = {.len = 4};
    tqkv_put_t *p;
    uint32_t prefix;
    tqkv_lookup_req_t lq = {.ns = "e", .hashes = &shorth, .num_hashes = 1, .num_layers = 1};
    ck_assert_int_eq(tqkv_client_lookup(CL, &lq, &prefix, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_put_begin(CL, NULL, &p), TQKV_OK);
    tqkv_put_block_t bad = {.ns = "e", .hash = &shorth};
    ck_assert_int_eq(tqkv_client_put_block(p, &bad), TQKV_EINVAL);
    tqkv_client_put_abort(p);

    /* A garbage page: the server rejects the stream with INVALID_ARGUMENT. */
    tqkv_hash_t h;
    tqkv_test_hash(&h, SEED, 9, 16);
    uint8_t junk[512];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t)tqkv_test_rand(&SEED);
    ck_assert_int_eq(tqkv_client_put_begin(CL, NULL, &p), TQKV_OK);
    tqkv_put_block_t pb = {.ns = "e", .hash = &h, .page = junk, .page_len = sizeof junk};
    tqkv_status_t st = tqkv_client_put_block(p, &pb);
    tqkv_status_t st2 = tqkv_client_put_end(p, NULL);
    ck_assert(st != TQKV_OK || st2 != TQKV_OK);
    ck_assert_int_eq(tqkv_client_last_error()->grpc_code, 3 /* INVALID_ARGUMENT */);

    /* A NaN in K: INVALID_ARGUMENT as well. */
    tqkv_block_shape_t sh = {4, 1, 64};
    uint16_t kv[4 * 64];
    tqkv_test_bf16_fill(&SEED, kv, 4 * 64, 64);
    kv[17] = 0x7fc0;
    ck_assert_int_eq(tqkv_client_put_begin(CL, NULL, &p), TQKV_OK);
    tqkv_put_block_t pn = {.ns = "e", .hash = &h, .shape = sh, .key = kv, .value = kv};
    st = tqkv_client_put_block(p, &pn);
    st2 = tqkv_client_put_end(p, NULL);
    ck_assert(st != TQKV_OK || st2 == TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_last_error()->grpc_code, 3);

    /* Whole-namespace delete of an empty namespace: NOT_FOUND. */
    ck_assert_int_eq(tqkv_client_delete(CL, "nothing-here", NULL, 0, 1, NULL, NULL),
                     TQKV_ENOTFOUND);
    /* Get with an empty layer range is refused locally. */
    tqkv_get_req_t q = {.ns = "e", .hashes = &h, .num_hashes = 1, .layer_begin = 2, .layer_end = 2};
    ck_assert_int_eq(tqkv_client_get(CL, &q, on_page, NULL), TQKV_EINVAL);
    /* A client with no target. */
    tqkv_client_opts_t o = {0};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    ck_assert_ptr_null(c);
    tqkv_client_destroy(NULL);
}
END_TEST

START_TEST(test_get_attend)
{
    const size_t nh = 3;
    const uint32_t L = 2, HQ = 4;
    tqkv_block_shape_t sh = {64, 2, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    tqkv_hash_t hs[3];
    uint16_t **k, **v;
    for (size_t i = 0; i < nh; i++)
        tqkv_test_hash(&hs[i], SEED, 800 + i, 16);
    make_data(nh, L, sh, &k, &v);
    put_blocks(CL, "attn", hs, nh, L, sh, k, v, NULL);
    float q[4 * 128], out[4 * 128], ref[4 * 128];
    for (size_t i = 0; i < HQ * sh.head_dim; i++)
        q[i] = (float)((double)(tqkv_test_rand(&SEED) >> 11) / 9007199254740992.0 - 0.5) * 0.5f;
    uint16_t *kc = malloc(nh * n * 2), *vc = malloc(nh * n * 2);
    for (uint32_t l = 0; l < L; l++) {
        for (size_t b = 0; b < nh; b++) {
            memcpy(kc + b * n, k[b * L + l], n * 2);
            memcpy(vc + b * n, v[b * L + l], n * 2);
        }
        tqkv_status_t st = tqkv_client_get_attend(CL, "attn", hs, nh, l, 0, q, HQ, out);
        ck_assert_msg(st == TQKV_OK, "get_attend: %s", tqkv_client_last_error()->message);
        ck_assert_int_eq(tqkv_attn_bf16_ref(q, HQ, kc, vc, (uint32_t)(nh * sh.num_tokens),
                                            sh.num_kv_heads, sh.head_dim, ref),
                         TQKV_OK);
        double e = 0, s2 = 0;
        for (size_t i = 0; i < HQ * sh.head_dim; i++) {
            e += (out[i] - ref[i]) * (double)(out[i] - ref[i]);
            s2 += (double)ref[i] * ref[i];
        }
        ck_assert_msg(sqrt(e / s2) < 0.25, "layer %u: attention rel err %g", l, sqrt(e / s2));
    }
    /* A missing block: ENOTFOUND, and the message names it. */
    tqkv_hash_t with_gap[3] = {hs[0], hs[1], hs[2]};
    tqkv_test_hash(&with_gap[1], SEED, 99999, 16);
    ck_assert_int_eq(tqkv_client_get_attend(CL, "attn", with_gap, nh, 0, 0, q, HQ, out),
                     TQKV_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(tqkv_client_last_error()->message, "block 1"));
    free(kc);
    free(vc);
    free_data(nh, L, k, v);
}
END_TEST

typedef struct pagecmp {
    const uint8_t *want;
    size_t want_len;
    int same, seen;
} pagecmp_t;

static int
cmp_page(void *arg, const tqkv_get_page_t *pg)
{
    pagecmp_t *c = arg;
    c->seen++;
    c->same =
        pg->found && pg->page_len == c->want_len && memcmp(pg->page, c->want, c->want_len) == 0;
    return 0;
}

/* A page encoded by the client (as a GPU worker would) is stored as is and comes
 * back byte for byte. */
START_TEST(test_put_encoded_page)
{
    tqkv_block_shape_t sh = {48, 2, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    tqkv_test_bf16_fill(&SEED, k, n, sh.head_dim);
    tqkv_test_bf16_fill(&SEED, v, n, sh.head_dim);
    tqkv_block_codec_t codec;
    memset(&codec, 0, sizeof codec);
    codec.k.bits_x2 = 7; /* 3.5 bits */
    codec.v.bits_x2 = 6; /* 3 bits */
    codec.rotation = TQKV_ROT_HADAMARD;
    codec.seed = SEED | 1;
    size_t cap = 0, len = 0;
    char err[160];
    ck_assert_int_eq(tqkv_page_size(&sh, &codec, &cap), TQKV_OK);
    uint8_t *page = aligned_alloc(64, (cap + 63) & ~(size_t)63);
    ck_assert_int_eq(tqkv_page_encode(&sh, &codec, k, v, page, cap, &len, err, sizeof err),
                     TQKV_OK);

    tqkv_hash_t h;
    tqkv_test_hash(&h, SEED, 777, 20);
    tqkv_put_t *p;
    tqkv_put_result_t r;
    ck_assert_int_eq(tqkv_client_put_begin(CL, NULL, &p), TQKV_OK);
    tqkv_put_block_t pb = {.ns = "pg",
                           .hash = &h,
                           .layer = 0,
                           .num_layers = 1,
                           .shape = sh,
                           .page = page,
                           .page_len = len};
    ck_assert_int_eq(tqkv_client_put_block(p, &pb), TQKV_OK);
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_stored, 1);

    pagecmp_t c = {.want = page, .want_len = len};
    tqkv_get_req_t q = {.ns = "pg", .hashes = &h, .num_hashes = 1, .layer_end = 1};
    ck_assert_int_eq(tqkv_client_get(CL, &q, cmp_page, &c), TQKV_OK);
    ck_assert_int_eq(c.seen, 1);
    ck_assert_msg(c.same, "the page came back different");
    free(page);
    free(k);
    free(v);
}
END_TEST

static Suite *
client_suite(void)
{
    Suite *s = suite_create("client");
    TCase *tc = tcase_create("server");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_roundtrip_both_encodings);
    tcase_add_test(tc, test_prefix_missing_middle);
    tcase_add_test(tc, test_concurrent_clients);
    tcase_add_test(tc, test_large_block);
    tcase_add_test(tc, test_cancel_midstream);
    tcase_add_test(tc, test_sigterm_midstream);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_get_attend);
    tcase_add_test(tc, test_put_encoded_page);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    if (srv_path() == NULL) {
        fprintf(stderr, "check_client: TQKV_SERVER is not set to a tqkv-server binary: skipped\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(client_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
