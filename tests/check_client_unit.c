/* check_client_unit.c - libtqkv pieces that need no server: the in-place
 * GetResponse reader (against protobuf-c's packer), rendezvous placement and the
 * per-target back-off (label unit). */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check_main.h"
#include "tests/support/rng.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/shard.h"

START_TEST(test_parse_get_matches_protobuf_c)
{
    uint64_t s = tqkv_test_seed();
    for (int it = 0; it < 300; it++) {
        Tqkv__V1__GetResponse m;
        tqkv__v1__get_response__init(&m);
        uint8_t hash[64], a[3000], b[3000];
        size_t hl = 8 + tqkv_test_rand(&s) % 57, al = tqkv_test_rand(&s) % 3000,
               bl = tqkv_test_rand(&s) % 3000;
        for (size_t i = 0; i < sizeof a; i++)
            a[i] = (uint8_t)tqkv_test_rand(&s), b[i] = (uint8_t)tqkv_test_rand(&s);
        memcpy(hash, a, 64);
        m.hash.data = hash;
        m.hash.len = hl;
        m.layer = (uint32_t)(tqkv_test_rand(&s) % 200);
        m.found = tqkv_test_rand(&s) % 4 != 0;
        int bf16 = it % 2;
        if (bf16) {
            m.key.data = a, m.key.len = al;
            m.value.data = b, m.value.len = bl;
        } else {
            m.page.data = a, m.page.len = al;
        }
        m.num_tokens = (uint32_t)tqkv_test_rand(&s);
        m.num_kv_heads = (uint32_t)(tqkv_test_rand(&s) % 1025);
        m.head_dim = (uint32_t)(tqkv_test_rand(&s) % 1025);
        m.tier = (Tqkv__V1__Tier)(tqkv_test_rand(&s) % 3);
        size_t n = tqkv__v1__get_response__get_packed_size(&m);
        uint8_t *buf = malloc(n + 16);
        tqkv__v1__get_response__pack(&m, buf);
        /* An unknown varint field (number 99) and an unknown bytes field (100) after
         * the known ones, as a newer server might send: both skipped. */
        size_t extra = 0;
        if (it % 3 == 0) {
            buf[n + extra++] = (uint8_t)(((99 << 3) & 0x7f) | 0x80);
            buf[n + extra++] = (99 << 3) >> 7;
            buf[n + extra++] = 0x05;
            buf[n + extra++] = (uint8_t)((((100 << 3) | 2) & 0x7f) | 0x80);
            buf[n + extra++] = (100 << 3) >> 7;
            buf[n + extra++] = 0x02;
            buf[n + extra++] = 0xaa;
            buf[n + extra++] = 0xbb;
        }
        tqkv__get_msg_t g;
        ck_assert_int_eq(tqkv__client_parse_get(buf, n + extra, &g), 0);
        ck_assert_uint_eq(g.hash_len, hl);
        ck_assert_mem_eq(g.hash, hash, hl);
        ck_assert_uint_eq(g.layer, m.layer);
        ck_assert_int_eq(g.found, m.found);
        ck_assert_uint_eq(g.num_tokens, m.num_tokens);
        ck_assert_uint_eq(g.num_kv_heads, m.num_kv_heads);
        ck_assert_uint_eq(g.head_dim, m.head_dim);
        ck_assert_int_eq(g.tier, (int)m.tier);
        if (bf16) {
            ck_assert_uint_eq(g.key_len, al);
            ck_assert_uint_eq(g.value_len, bl);
            if (al)
                ck_assert_mem_eq(g.key, a, al);
            if (bl)
                ck_assert_mem_eq(g.value, b, bl);
        } else {
            ck_assert_uint_eq(g.page_len, al);
            if (al)
                ck_assert_mem_eq(g.page, a, al);
        }
        /* Every strict prefix that cuts a field is rejected, never over-read. */
        size_t cut = 1 + tqkv_test_rand(&s) % (n - 1);
        tqkv__get_msg_t t;
        int r = tqkv__client_parse_get(buf, cut, &t);
        if (r == 0) {
            /* A cut on a field boundary parses; its fields must lie inside the cut. */
            ck_assert(t.page == NULL || t.page + t.page_len <= buf + cut);
            ck_assert(t.key == NULL || t.key + t.key_len <= buf + cut);
            ck_assert(t.value == NULL || t.value + t.value_len <= buf + cut);
        }
        free(buf);
    }
    /* Field number 0 and wire types 3/4/6/7 are malformed. */
    uint8_t bad1[] = {0x00, 0x01};
    uint8_t bad2[] = {(2 << 3) | 3};
    uint8_t bad3[] = {(4 << 3) | 2, 0x80, 0x80, 0x80, 0x80, 0x80,
                      0x80,         0x80, 0x80, 0x80, 0x80, 0x01};
    uint8_t bad4[] = {(4 << 3) | 2, 0x05, 1, 2};
    tqkv__get_msg_t g;
    ck_assert_int_eq(tqkv__client_parse_get(bad1, sizeof bad1, &g), -1);
    ck_assert_int_eq(tqkv__client_parse_get(bad2, sizeof bad2, &g), -1);
    ck_assert_int_eq(tqkv__client_parse_get(bad3, sizeof bad3, &g), -1);
    ck_assert_int_eq(tqkv__client_parse_get(bad4, sizeof bad4, &g), -1);
}
END_TEST

START_TEST(test_rank_is_a_stable_permutation)
{
    uint64_t s = tqkv_test_seed();
    const char *names[] = {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.4:7000",
                           "10.0.0.5:7000", "10.0.0.6:7000", "10.0.0.7:7000"};
    uint64_t ids[7];
    for (int i = 0; i < 7; i++)
        ids[i] = tqkv_shard_target_id(names[i]);
    ck_assert(ids[0] != ids[1]);
    for (int it = 0; it < 1000; it++) {
        uint8_t h[32];
        for (int i = 0; i < 32; i++)
            h[i] = (uint8_t)tqkv_test_rand(&s);
        uint64_t key = tqkv_shard_block_key("ns", h, 1 + tqkv_test_rand(&s) % 32);
        uint32_t o1[7], o2[7];
        size_t n = 1 + tqkv_test_rand(&s) % 7;
        tqkv_shard_rank(ids, n, key, o1);
        tqkv_shard_rank(ids, n, key, o2);
        ck_assert_mem_eq(o1, o2, n * sizeof *o1);
        int seen[7] = {0};
        for (size_t i = 0; i < n; i++) {
            ck_assert_uint_lt(o1[i], n);
            ck_assert_int_eq(seen[o1[i]]++, 0);
            if (i)
                ck_assert_uint_ge(tqkv_shard_score(ids[o1[i - 1]], key),
                                  tqkv_shard_score(ids[o1[i]], key));
        }
    }
    /* The namespace is part of the key. */
    uint8_t h[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    ck_assert(tqkv_shard_block_key("a", h, 8) != tqkv_shard_block_key("b", h, 8));
}
END_TEST

START_TEST(test_rank_balance_and_minimal_movement)
{
    uint64_t s = tqkv_test_seed();
    const char *names[] = {"srv-a:1", "srv-b:1", "srv-c:1", "srv-d:1"};
    uint64_t ids[4];
    for (int i = 0; i < 4; i++)
        ids[i] = tqkv_shard_target_id(names[i]);
    const int N = 30000;
    int count[3] = {0}, moved = 0, moved_elsewhere = 0;
    for (int it = 0; it < N; it++) {
        uint8_t h[16];
        for (int i = 0; i < 16; i++)
            h[i] = (uint8_t)tqkv_test_rand(&s);
        uint64_t key = tqkv_shard_block_key("ns", h, 16);
        uint32_t o3[3], o4[4];
        tqkv_shard_rank(ids, 3, key, o3);
        tqkv_shard_rank(ids, 4, key, o4);
        count[o3[0]]++;
        if (o4[0] != o3[0]) {
            moved++;
            moved_elsewhere += o4[0] != 3; /* only to the new target */
        }
    }
    for (int i = 0; i < 3; i++)
        ck_assert_msg(count[i] > N / 3 * 0.93 && count[i] < N / 3 * 1.07, "target %d: %d", i,
                      count[i]);
    ck_assert_int_eq(moved_elsewhere, 0);
    ck_assert_msg(moved > N / 4 * 0.9 && moved < N / 4 * 1.1, "moved %d", moved);
}
END_TEST

START_TEST(test_health_backoff)
{
    tqkv_shard_health_t h;
    tqkv_shard_health_init(&h);
    uint64_t t = 1000000000ull;
    ck_assert(tqkv_shard_health_usable(&h, t));
    tqkv_shard_health_fail(&h, t, 100, 800);
    ck_assert(!tqkv_shard_health_usable(&h, t + 99000000ull));
    ck_assert(tqkv_shard_health_usable(&h, t + 100000000ull));
    /* Consecutive failures double the back-off up to the maximum. */
    uint64_t expect[] = {200, 400, 800, 800};
    for (int i = 0; i < 4; i++) {
        tqkv_shard_health_fail(&h, t, 100, 800);
        ck_assert(!tqkv_shard_health_usable(&h, t + (expect[i] - 1) * 1000000ull));
        ck_assert(tqkv_shard_health_usable(&h, t + expect[i] * 1000000ull));
    }
    ck_assert_uint_eq(atomic_load(&h.failures), 5);
    tqkv_shard_health_ok(&h, 100);
    ck_assert(tqkv_shard_health_usable(&h, t));
    tqkv_shard_health_fail(&h, t, 100, 800);
    ck_assert(tqkv_shard_health_usable(&h, t + 100000000ull));
}
END_TEST

START_TEST(test_create_validates)
{
    tqkv_client_t *c = NULL;
    const char *t[] = {"127.0.0.1:1", ""};
    tqkv_client_opts_t o = {.targets = t, .num_targets = 2};
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    ck_assert_ptr_null(c);
    o.num_targets = 1;
    o.tls_ca_path = "/nonexistent/ca.pem";
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(tqkv_client_last_error()->message, "/nonexistent/ca.pem"));
    o.tls_ca_path = NULL;
    o.replicas = 5; /* clamped to the number of targets */
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv_client_num_targets(c), 1);
    ck_assert_uint_eq(tqkv__client_replicas(c), 1);
    ck_assert_str_eq(tqkv_client_target_name(c, 0), "127.0.0.1:1");
    /* Nothing listens on port 1: a call fails fast and cleanly. */
    uint32_t prefix;
    tqkv_hash_t h = {.len = 8};
    tqkv_lookup_req_t q = {.ns = "x", .hashes = &h, .num_hashes = 1, .deadline_ms = 3000};
    tqkv_status_t st = tqkv_client_lookup(c, &q, &prefix, NULL);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ETIMEDOUT, "%s", tqkv_status_name(st));
    ck_assert_int_ne(tqkv_client_last_error()->grpc_code, 0);
    tqkv_client_destroy(c);
    /* localhost resolves; with resolve_targets each distinct address is a target. */
    const char *three[] = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    tqkv_client_opts_t o3 = {.targets = three, .num_targets = 3};
    ck_assert_int_eq(tqkv_client_create(&o3, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv__client_replicas(c), 1); /* 0 = 1 */
    tqkv_client_destroy(c);
    o3.replicas = 2;
    ck_assert_int_eq(tqkv_client_create(&o3, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv__client_replicas(c), 2);
    tqkv_client_destroy(c);
    o3.replicas = 4;
    ck_assert_int_eq(tqkv_client_create(&o3, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv__client_replicas(c), 3);
    tqkv_client_destroy(c);
    const char *lh[] = {"localhost:1"};
    tqkv_client_opts_t o2 = {.targets = lh, .num_targets = 1, .resolve_targets = 1};
    ck_assert_int_eq(tqkv_client_create(&o2, &c), TQKV_OK);
    ck_assert_uint_ge(tqkv_client_num_targets(c), 1);
    tqkv_client_destroy(c);
}
END_TEST

static Suite *
client_unit_suite(void)
{
    Suite *s = suite_create("client_unit");
    TCase *tc = tcase_create("unit");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_parse_get_matches_protobuf_c);
    tcase_add_test(tc, test_rank_is_a_stable_permutation);
    tcase_add_test(tc, test_rank_balance_and_minimal_movement);
    tcase_add_test(tc, test_health_backoff);
    tcase_add_test(tc, test_create_validates);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(client_unit_suite)
