/* check_shard.c - sharding over three real tqkv-servers (label "shard").
 *
 * Blocks are placed by rendezvous hashing with R = 1 and R = 2. One server is
 * SIGKILLed mid-run: reads keep succeeding (its blocks read as misses with R = 1,
 * are served by the replica with R = 2), no page is ever wrong, Puts keep landing
 * on the live servers; the server is restarted on the same port and, after the
 * back-off, newly put blocks are stored on it and read back as hits again.
 */
#include <check.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check_main.h"
#include "transport/client_server.h"
#include "transport/shard.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

#define NS_ 3
static srv_t S[NS_];
static uint64_t SEED;

static const tqkv_block_shape_t SH = {32, 2, 64};
enum { L = 2 };

/* Block contents are a function of (hash, layer), so any page can be checked. */
static void
block_data(const tqkv_hash_t *h, uint32_t layer, uint16_t *k, uint16_t *v)
{
    tqkv_test_block_data(h, layer, SH.num_tokens, SH.num_kv_heads, SH.head_dim, k, v);
}

static void
put_seq(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nh)
{
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(c, &po, &p), TQKV_OK);
    for (size_t b = 0; b < nh; b++) {
        for (uint32_t l = 0; l < L; l++) {
            block_data(&hs[b], l, k, v);
            tqkv_put_block_t pb = {.ns = ns,
                                   .hash = &hs[b],
                                   .parent = b ? &hs[b - 1] : NULL,
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = SH,
                                   .key = k,
                                   .value = v};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
        }
    }
    tqkv_put_result_t r;
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    /* Every message sent was stored (or was already there) by its server. */
    ck_assert_msg(r.blocks_stored + r.blocks_duplicate == r.blocks_sent,
                  "sent %llu, stored %llu, duplicate %llu", (unsigned long long)r.blocks_sent,
                  (unsigned long long)r.blocks_stored, (unsigned long long)r.blocks_duplicate);
    free(k);
    free(v);
}

typedef struct tally {
    const tqkv_hash_t *hs;
    size_t found, missing, wrong;
    int from[NS_ + 1];
    uint16_t *k, *v, *dk, *dv;
} tally_t;

static int
check_page(void *arg, const tqkv_get_page_t *pg)
{
    tally_t *t = arg;
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    if (!pg->found) {
        t->missing++;
        return 0;
    }
    t->found++;
    if (pg->target >= 0 && pg->target < NS_)
        t->from[pg->target]++;
    /* Packed pages, decoded here and compared with what was put for this hash. */
    block_data(&t->hs[pg->hash_index], pg->layer, t->k, t->v);
    tqkv_block_shape_t got;
    if (tqkv_client_decode_page(pg->page, pg->page_len, t->dk, t->dv, &got) != TQKV_OK ||
        got.num_tokens != SH.num_tokens || got.num_kv_heads != SH.num_kv_heads ||
        got.head_dim != SH.head_dim || !(tqkv_test_bf16_rel_err(t->k, t->dk, n) < 0.3) ||
        !(tqkv_test_bf16_rel_err(t->v, t->dv, n) < 0.3))
        t->wrong++;
    return 0;
}

static tally_t
get_seq(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nh)
{
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    tally_t t = {
        .hs = hs, .k = malloc(n * 2), .v = malloc(n * 2), .dk = malloc(n * 2), .dv = malloc(n * 2)};
    tqkv_get_req_t q = {.ns = ns,
                        .hashes = hs,
                        .num_hashes = nh,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = TQKV_CLIENT_PACKED};
    tqkv_status_t st = tqkv_client_get(c, &q, check_page, &t);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(t.found + t.missing, nh * L);
    free(t.k);
    free(t.v);
    free(t.dk);
    free(t.dv);
    return t;
}

static tqkv_client_t *
shard_client(uint32_t replicas)
{
    const char *t[NS_];
    for (int i = 0; i < NS_; i++)
        t[i] = S[i].addr;
    /* Servers here fail by SIGKILL (refused at once); a live one stalled for a second
     * on a loaded machine must not be judged down: 30 s to connect, no keepalive pings
     * (as check_client_adversarial's client_of; member_blackhole tests detection). */
    tqkv_client_opts_t o = {.struct_size = sizeof(tqkv_client_opts_t),
                            .targets = t,
                            .num_targets = NS_,
                            .replicas = replicas,
                            .deadline_ms = 5000,
                            .backoff_min_ms = 100,
                            .backoff_max_ms = 400,
                            .connect_timeout_ms = 30000,
                            .keepalive_ms = UINT32_MAX};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv_client_num_targets(c), NS_);
    return c;
}

static void
setup(void)
{
    SEED = tqkv_test_seed();
    for (int i = 0; i < NS_; i++)
        ck_assert_msg(srv_start(&S[i], 0, NULL) == 0, "cannot start server %d", i);
}

static void
teardown(void)
{
    for (int i = 0; i < NS_; i++)
        srv_stop(&S[i]);
}

static void
run_kill_restart(uint32_t R)
{
    enum { NSEQ = 12, NB = 4 };
    const char *ns = R == 1 ? "r1" : "r2";
    tqkv_client_t *c = shard_client(R);
    tqkv_hash_t hs[NSEQ][NB];
    for (int s = 0; s < NSEQ; s++)
        for (int b = 0; b < NB; b++)
            tqkv_test_hash(&hs[s][b], SEED + R, (uint64_t)s * 100 + (uint64_t)b, 16);
    for (int s = 0; s < NSEQ; s++)
        put_seq(c, ns, hs[s], NB);

    /* All up: every block found, spread over all three servers. */
    int from[NS_] = {0};
    for (int s = 0; s < NSEQ; s++) {
        tally_t t = get_seq(c, ns, hs[s], NB);
        ck_assert_uint_eq(t.missing, 0);
        ck_assert_uint_eq(t.wrong, 0);
        for (int i = 0; i < NS_; i++)
            from[i] += t.from[i];
        uint32_t prefix;
        uint8_t tiers[NB];
        tqkv_lookup_req_t lq = {.ns = ns, .hashes = hs[s], .num_hashes = NB, .num_layers = L};
        ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, tiers), TQKV_OK);
        ck_assert_msg(prefix == NB, "seq %d: prefix %u, tiers %d %d %d %d (%s)", s, prefix,
                      tiers[0], tiers[1], tiers[2], tiers[3], tqkv_client_last_error()->message);
    }
    for (int i = 0; i < NS_; i++)
        ck_assert_msg(from[i] > 0, "server %d served nothing", i);

    /* Kill one server. */
    int victim = 1, port = S[victim].port;
    srv_kill(&S[victim], SIGKILL);
    ck_assert_int_eq(srv_wait(&S[victim], 10), 0);
    size_t found = 0, missing = 0;
    for (int s = 0; s < NSEQ; s++) {
        tally_t t = get_seq(c, ns, hs[s], NB);
        ck_assert_uint_eq(t.wrong, 0);
        ck_assert_int_eq(t.from[victim], 0);
        found += t.found;
        missing += t.missing;
        uint32_t prefix;
        tqkv_lookup_req_t lq = {.ns = ns, .hashes = hs[s], .num_hashes = NB, .num_layers = L};
        ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, NULL), TQKV_OK);
        ck_assert_uint_le(prefix, NB);
    }
    if (R == 1)
        ck_assert_msg(missing > 0 && found > 0, "R=1 with a server down: found %zu missing %zu",
                      found, missing);
    else
        ck_assert_msg(missing == 0, "R=2 with one server down: %zu missing", missing);

    /* Puts while it is down land on live servers and read back. */
    tqkv_hash_t down[NB];
    for (int b = 0; b < NB; b++)
        tqkv_test_hash(&down[b], SEED + R, 5000 + (uint64_t)b, 16);
    put_seq(c, ns, down, NB);
    tally_t td = get_seq(c, ns, down, NB);
    ck_assert_uint_eq(td.wrong, 0);
    ck_assert_uint_eq(td.missing, 0);

    /* Restart on the same port; after the back-off (max 400 ms) it is used again. */
    const char *same[] = {NULL};
    ck_assert_int_eq(srv_start(&S[victim], port, same), 0);
    /* The client notices by itself (its back-off and gRPC's reconnect back-off both
     * end within ~1 s): wait until the target answers a health check. */
    int serving = 0;
    double t0 = proc_now();
    while (proc_now() - t0 < 10) {
        if (tqkv_client_health(c, (size_t)victim, "", &serving) == TQKV_OK && serving == 1)
            break;
        usleep(50000);
    }
    fprintf(stderr, "check_shard: restarted server answered after %.2f s\n", proc_now() - t0);
    ck_assert_msg(serving == 1, "restarted server on port %d: %s", port,
                  tqkv_client_last_error()->message);
    enum { NNEW = 6 };
    tqkv_hash_t fresh[NNEW][NB];
    int fresh_from_victim = 0;
    for (int s = 0; s < NNEW; s++) {
        for (int b = 0; b < NB; b++)
            tqkv_test_hash(&fresh[s][b], SEED + R, 9000 + (uint64_t)s * 100 + (uint64_t)b, 16);
        put_seq(c, ns, fresh[s], NB);
    }
    for (int s = 0; s < NNEW; s++) {
        tally_t t = get_seq(c, ns, fresh[s], NB);
        ck_assert_uint_eq(t.wrong, 0);
        ck_assert_uint_eq(t.missing, 0);
        fresh_from_victim += t.from[victim];
    }
    ck_assert_msg(fresh_from_victim > 0, "the restarted server got none of the new blocks");
    /* Old blocks of the victim are gone (R = 1) but never wrong. */
    for (int s = 0; s < NSEQ; s++) {
        tally_t t = get_seq(c, ns, hs[s], NB);
        ck_assert_uint_eq(t.wrong, 0);
    }
    tqkv_client_stats_t st;
    ck_assert_int_eq(tqkv_client_stats(c, ns, &st), TQKV_OK);
    ck_assert_uint_gt(st.pages, 0);
    tqkv_client_destroy(c);
}

START_TEST(test_r1_kill_restart)
{
    run_kill_restart(1);
}
END_TEST

START_TEST(test_r2_kill_restart)
{
    run_kill_restart(2);
}
END_TEST

START_TEST(test_delete_fans_out)
{
    tqkv_client_t *c = shard_client(2);
    enum { NB = 6 };
    tqkv_hash_t hs[NB];
    for (int b = 0; b < NB; b++)
        tqkv_test_hash(&hs[b], SEED, 7000 + (uint64_t)b, 32);
    put_seq(c, "del", hs, NB);
    uint64_t pages = 0;
    ck_assert_int_eq(tqkv_client_delete(c, "del", hs, NB, 0, &pages, NULL), TQKV_OK);
    ck_assert_uint_eq(pages, (uint64_t)NB * L * 2); /* two replicas of every layer */
    tally_t t = get_seq(c, "del", hs, NB);
    ck_assert_uint_eq(t.found, 0);
    tqkv_client_destroy(c);
}
END_TEST

/* A server dies in the middle of a Put session (R = 1): the blocks already streamed
 * to it are re-sent to the next server in their ranking at put_end, so none is lost. */
START_TEST(test_put_resend_on_kill)
{
    tqkv_client_t *c = shard_client(1);
    enum { NB = 24 };
    tqkv_hash_t hs[NB];
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    for (int b = 0; b < NB; b++)
        tqkv_test_hash(&hs[b], SEED, 20000 + (uint64_t)b, 16);
    /* Block 0 must rank server 0 first, so that the dying stream holds something. */
    uint64_t ids[NS_];
    for (int i = 0; i < NS_; i++)
        ids[i] = tqkv_client_target_rank_id(c, (size_t)i); /* target i is S[i] */
    for (uint64_t salt = 1;; salt++) {
        uint32_t order[NS_];
        tqkv_shard_rank(ids, NS_, tqkv_shard_block_key("rs", hs[0].bytes, hs[0].len), order);
        if (order[0] == 0)
            break;
        tqkv_test_hash(&hs[0], SEED, 30000 + salt, 16);
    }
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(c, NULL, &p), TQKV_OK);
    for (int b = 0; b < NB; b++) {
        if (b == NB / 2) {
            srv_kill(&S[0], SIGKILL);
            ck_assert_int_eq(srv_wait(&S[0], 10), 0);
        }
        for (uint32_t l = 0; l < L; l++) {
            block_data(&hs[b], l, k, v);
            tqkv_put_block_t pb = {.ns = "rs",
                                   .hash = &hs[b],
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = SH,
                                   .key = k,
                                   .value = v};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
        }
    }
    tqkv_put_result_t r;
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_lost, 0);
    ck_assert_uint_gt(r.blocks_sent, (uint64_t)NB * L); /* some went twice */
    tally_t t = get_seq(c, "rs", hs, NB);
    ck_assert_uint_eq(t.wrong, 0);
    ck_assert_uint_eq(t.missing, 0);
    ck_assert_int_eq(t.from[0], 0);
    free(k);
    free(v);
    tqkv_client_destroy(c);
}
END_TEST

static Suite *
shard_suite(void)
{
    Suite *s = suite_create("shard");
    TCase *tc = tcase_create("shard");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_r1_kill_restart);
    tcase_add_test(tc, test_r2_kill_restart);
    tcase_add_test(tc, test_delete_fans_out);
    tcase_add_test(tc, test_put_resend_on_kill);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    if (srv_path() == NULL) {
        fprintf(stderr, "check_shard: TQKV_SERVER is not set to a tqkv-server binary: skipped\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(shard_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
