/* check_store_export.c - tqkv_store_export, the page list of hand-off on drain.
 *
 * Every stored page is listed once with its namespace, hash, layer, length and parent;
 * prefix pages (parked: a kept block extends them) come before leaves; max_pages
 * bounds the list; deleted and evicted pages are not listed; an empty store lists none.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store.h"
#include "tests/check_main.h"

static void
hash_of(uint8_t h[16], uint64_t seed, uint64_t i)
{
    for (int k = 0; k < 16; k++)
        h[k] = (uint8_t)((seed + i * 0x9E3779B97F4A7C15ull) >> (8 * (k % 8))) ^ (uint8_t)k;
}

START_TEST(t_export_lists_every_page)
{
    uint64_t seed = tqkv_test_seed();
    tqkv_store_config_t cfg;
    tqkv_store_config_default(&cfg);
    cfg.dram_capacity = 64u << 20;
    tqkv_store_t *s = NULL;
    ck_assert_int_eq(tqkv_store_create(&cfg, &s), TQKV_OK);

    tqkv_store_key_out_t *k = NULL;
    size_t n = 7;
    ck_assert_int_eq(tqkv_store_export(s, 0, &k, &n), TQKV_OK);
    ck_assert_uint_eq(n, 0);
    free(k);

    /* Two sequences of 5 blocks x 2 layers in two namespaces: blocks 0..3 are parents. */
    enum { B = 5, L = 2 };
    const char *nss[2] = {"ns-a", "namespace-b"};
    uint8_t h[2][B][16];
    uint8_t page[300];
    for (int q = 0; q < 2; q++)
        for (int b = 0; b < B; b++) {
            hash_of(h[q][b], seed + (uint64_t)q, (uint64_t)b);
            for (uint32_t l = 0; l < L; l++) {
                memset(page, (int)(q * 16 + b * 2 + (int)l), sizeof page);
                tqkv_block_key_t key = {nss[q], strlen(nss[q]), h[q][b], 16, l};
                int dup = 0;
                ck_assert_int_eq(tqkv_store_put(s, &key, b ? h[q][b - 1] : NULL, b ? 16 : 0, page,
                                                100 + (size_t)(b * 10 + (int)l), 1000, &dup),
                                 TQKV_OK);
            }
        }
    ck_assert_int_eq(tqkv_store_export(s, 0, &k, &n), TQKV_OK);
    ck_assert_uint_eq(n, 2 * B * L);
    int seen[2][B][L];
    memset(seen, 0, sizeof seen);
    size_t first_leaf = n, last_parent = 0;
    for (size_t i = 0; i < n; i++) {
        int q = !strcmp(k[i].ns, nss[0]) ? 0 : !strcmp(k[i].ns, nss[1]) ? 1 : -1;
        ck_assert_int_ge(q, 0);
        ck_assert_uint_eq(k[i].ns_len, strlen(nss[q]));
        ck_assert_uint_eq(k[i].hash_len, 16);
        int b = -1;
        for (int x = 0; x < B; x++)
            if (!memcmp(h[q][x], k[i].hash, 16))
                b = x;
        ck_assert_int_ge(b, 0);
        ck_assert_uint_lt(k[i].layer, L);
        ck_assert_uint_eq(k[i].len, 100 + (uint32_t)(b * 10) + k[i].layer);
        if (b == 0) {
            ck_assert_ptr_null(k[i].parent);
        } else {
            ck_assert_ptr_nonnull(k[i].parent);
            ck_assert_uint_eq(k[i].parent_len, 16);
            ck_assert(!memcmp(k[i].parent, h[q][b - 1], 16));
        }
        seen[q][b][k[i].layer]++;
        if (b == B - 1 && first_leaf == n)
            first_leaf = i;
        if (b < B - 1)
            last_parent = i;
    }
    for (int q = 0; q < 2; q++)
        for (int b = 0; b < B; b++)
            for (int l = 0; l < L; l++)
                ck_assert_int_eq(seen[q][b][l], 1);
    /* prefix pages first: every page a kept block extends comes before the leaves */
    ck_assert_msg(last_parent < first_leaf, "parent at %zu after a leaf at %zu", last_parent,
                  first_leaf);
    free(k);

    /* max_pages bounds the list; a deleted block is not listed */
    ck_assert_int_eq(tqkv_store_export(s, 3, &k, &n), TQKV_OK);
    ck_assert_uint_eq(n, 3);
    free(k);
    uint64_t pages = 0, bytes = 0;
    ck_assert_int_eq(tqkv_store_delete(s, nss[1], strlen(nss[1]), h[1][B - 1], 16, &pages, &bytes),
                     TQKV_OK);
    ck_assert_uint_eq(pages, L);
    ck_assert_int_eq(tqkv_store_export(s, 0, &k, &n), TQKV_OK);
    ck_assert_uint_eq(n, 2 * B * L - L);
    for (size_t i = 0; i < n; i++)
        ck_assert(strcmp(k[i].ns, nss[1]) || memcmp(k[i].hash, h[1][B - 1], 16));
    free(k);
    tqkv_store_destroy(s);
}
END_TEST

static Suite *
export_suite(void)
{
    Suite *s = suite_create("store_export");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, t_export_lists_every_page);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(export_suite)
