/* check_store_stress.c - concurrent put/get/lookup/delete on random keys and sizes
 * against small tiers (HBM stand-in + DRAM) with eviction, demotion, promotion, leases
 * and a quota active. Every read is checked byte for byte against the content derived
 * from its key; capacities are sampled; at the end every byte must be returned.
 *
 * TQKV_STRESS_SECONDS sets the duration (default 20 s, 8 s with TQKV_SANITIZED=1).
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache_internal.h"
#include "cache/pool.h"
#include "cache/store.h"
#include "tests/check_main.h"
#include "tests/store_test_util.h"
#include "tests/support/sanitize.h"

#define NTHREADS 4
#define NKEYS 120
#define NLAYERS 3
#define HBM_CAP (3u << 20)
#define DRAM_CAP (6u << 20)

static const char *const namespaces[2] = {"stress/a", "stress/quota"};

typedef struct shared {
    tqkv_store_t *s;
    double seconds;
    uint64_t seed;
    _Atomic uint64_t ops, hits, misses, puts, dups, enospc, bad, over_cap, leases;
} shared_t;

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Size of the page of a key: log-uniform 64 B .. 256 KiB, fixed per key. */
static size_t
key_size(uint64_t kseed)
{
    uint64_t x = kseed ^ 0x5151;
    uint64_t r = tqkv_test_rand(&x);
    unsigned shift = 6 + (unsigned)(r % 12); /* 64 B .. 128 KiB */
    size_t base = (size_t)1 << shift;
    size_t len = base + (size_t)((r >> 8) % base) + (r >> 40) % 7;
    return len > (256u << 10) ? (256u << 10) : len;
}

static void *
worker(void *arg)
{
    shared_t *sh = arg;
    uint64_t x = sh->seed ^ (uint64_t)pthread_self();
    uint8_t *buf = malloc(256 << 10 | 4096);
    double end = now_s() + sh->seconds;
    tqkv_pool_t *hp = tqkv__store_pool(sh->s, TQKV_TIER_HBM);
    tqkv_pool_t *dp = tqkv__store_pool(sh->s, TQKV_TIER_DRAM);

    while (now_s() < end) {
        for (int burst = 0; burst < 64; burst++) {
            uint64_t r = tqkv_test_rand(&x);
            const char *ns = namespaces[(r >> 60) & 1 ? 1 : 0];
            uint64_t kn = (r >> 8) % NKEYS;
            uint32_t layer = (uint32_t)((r >> 20) % NLAYERS);
            uint8_t h[32], ph[32];
            st_hash(h, 1, kn);
            st_hash(ph, 1, kn - 1);
            tqkv_block_key_t k = {ns, strlen(ns), h, 32, layer};
            uint64_t kseed = st_key_seed(&k);
            size_t len = key_size(kseed);
            unsigned op = (unsigned)(r % 100);

            if (op < 40) {
                tqkv_page_ref_t *ref;
                tqkv_status_t st = tqkv_store_get(sh->s, &k, &ref);
                if (st == TQKV_OK) {
                    if (tqkv_page_ref_len(ref) != len ||
                        !st_check(tqkv_page_ref_data(ref), len, kseed))
                        atomic_fetch_add(&sh->bad, 1);
                    tqkv_page_ref_release(ref);
                    atomic_fetch_add(&sh->hits, 1);
                } else if (st == TQKV_ENOTFOUND) {
                    atomic_fetch_add(&sh->misses, 1);
                } else {
                    fprintf(stderr, "get: %s\n", tqkv_strerror(st));
                    atomic_fetch_add(&sh->bad, 1);
                }
            } else if (op < 75) {
                int dup = 0;
                st_fill(buf, len, kseed);
                tqkv_status_t st = tqkv_store_put(sh->s, &k, kn > 0 ? ph : NULL, kn > 0 ? 32 : 0,
                                                  buf, len, 4 * len, &dup);
                if (st == TQKV_OK) {
                    atomic_fetch_add(dup ? &sh->dups : &sh->puts, 1);
                } else if (st == TQKV_ENOSPC) {
                    atomic_fetch_add(&sh->enospc, 1);
                } else {
                    fprintf(stderr, "put: %s\n", tqkv_strerror(st));
                    atomic_fetch_add(&sh->bad, 1);
                }
            } else if (op < 92) {
                uint8_t hs[8][32];
                const uint8_t *hptr[8];
                size_t hl[8];
                uint8_t tiers[8];
                uint32_t prefix = 0;
                for (int i = 0; i < 8; i++) {
                    st_hash(hs[i], 1, (kn + (uint64_t)i) % NKEYS);
                    hptr[i] = hs[i];
                    hl[i] = 32;
                }
                uint32_t lease = (r >> 40) % 4 == 0 ? 5 : 0;
                tqkv_status_t st =
                    tqkv_store_lookup(sh->s, ns, strlen(ns), hptr, hl, 8,
                                      1 + (uint32_t)((r >> 44) % NLAYERS), lease, &prefix, tiers);
                if (st != TQKV_OK || prefix > 8)
                    atomic_fetch_add(&sh->bad, 1);
                for (uint32_t i = 0; i < prefix; i++)
                    if (tiers[i] != TQKV_TIER_HBM && tiers[i] != TQKV_TIER_DRAM)
                        atomic_fetch_add(&sh->bad, 1);
                if (lease)
                    atomic_fetch_add(&sh->leases, 1);
            } else {
                uint64_t pages = 0, bytes = 0;
                if (tqkv_store_delete(sh->s, ns, strlen(ns), h, 32, &pages, &bytes) != TQKV_OK ||
                    pages > NLAYERS)
                    atomic_fetch_add(&sh->bad, 1);
            }
            if (tqkv_pool_used(hp) > HBM_CAP || tqkv_pool_used(dp) > DRAM_CAP)
                atomic_fetch_add(&sh->over_cap, 1);
            atomic_fetch_add(&sh->ops, 1);
        }
    }
    free(buf);
    return NULL;
}

START_TEST(test_store_stress)
{
    tqkv_store_config_t c;
    shared_t sh;
    pthread_t th[NTHREADS];
    const char *e = getenv("TQKV_STRESS_SECONDS");
    int sanitized = tqkv_test_sanitized();

    memset(&sh, 0, sizeof(sh));
    sh.seconds = e ? atof(e) : (sanitized ? 8.0 : 20.0);
    sh.seed = tqkv_test_seed();
    tqkv_store_config_default(&c);
    c.dram_capacity = DRAM_CAP;
    c.hbm_capacity = HBM_CAP;
    c.hbm_standin = 1;
    c.high_watermark = 0.7;
    c.low_watermark = 0.5;
    c.promote_on_access = 1;
    c.verify_crc = 1;
    c.policy = (sh.seed & 1) ? TQKV_EVICT_LRU : TQKV_EVICT_S3FIFO;
    ck_assert_int_eq(tqkv_store_create(&c, &sh.s), TQKV_OK);
    ck_assert_int_eq(tqkv_store_set_quota(sh.s, namespaces[1], strlen(namespaces[1]), 2u << 20),
                     TQKV_OK);
    for (int i = 0; i < NTHREADS; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker, &sh), 0);
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);

    tqkv_store_stats_t st, sq;
    /* Finish any demotion the workers left pending (it may evict from a full DRAM tier)
     * so the page count below cannot change under the background thread. */
    tqkv__store_maintain(sh.s);
    ck_assert_int_eq(tqkv_store_stats(sh.s, NULL, 0, &st), TQKV_OK);
    ck_assert_int_eq(tqkv_store_stats(sh.s, namespaces[1], strlen(namespaces[1]), &sq), TQKV_OK);
    fprintf(stderr,
            "stress (%s, %.0f s, %d threads): %llu ops, %llu hits, %llu misses, %llu puts, "
            "%llu dups, %llu enospc, %llu leases; evictions %llu, demotions %llu, promotions "
            "%llu; quota ns %llu B\n",
            c.policy == TQKV_EVICT_LRU ? "lru" : "s3fifo", sh.seconds, NTHREADS,
            (unsigned long long)sh.ops, (unsigned long long)sh.hits, (unsigned long long)sh.misses,
            (unsigned long long)sh.puts, (unsigned long long)sh.dups, (unsigned long long)sh.enospc,
            (unsigned long long)sh.leases, (unsigned long long)st.evictions,
            (unsigned long long)st.tier[TQKV_TIER_HBM].demotions,
            (unsigned long long)st.tier[TQKV_TIER_DRAM].promotions,
            (unsigned long long)sq.page_bytes);
    ck_assert_uint_eq(atomic_load(&sh.bad), 0);
    ck_assert_uint_eq(atomic_load(&sh.over_cap), 0);
    ck_assert_uint_gt(atomic_load(&sh.hits), 0);
    ck_assert_uint_gt(st.evictions, 0);
    ck_assert_uint_gt(st.tier[TQKV_TIER_HBM].demotions, 0);
    ck_assert(sq.page_bytes <= (2u << 20));
    ck_assert_int_eq(tqkv__store_check(sh.s), TQKV_OK);

    /* every byte comes back */
    tqkv_pool_t *hp = tqkv__store_pool(sh.s, TQKV_TIER_HBM);
    tqkv_pool_t *dp = tqkv__store_pool(sh.s, TQKV_TIER_DRAM);
    uint64_t pa = 0, pb = 0;
    (void)tqkv_store_delete_namespace(sh.s, namespaces[0], strlen(namespaces[0]), &pa, NULL);
    (void)tqkv_store_delete_namespace(sh.s, namespaces[1], strlen(namespaces[1]), &pb, NULL);
    ck_assert_uint_eq(pa + pb, st.pages);
    ck_assert_uint_eq(tqkv_pool_used(hp), 0);
    ck_assert_uint_eq(tqkv_pool_used(dp), 0);
    ck_assert_uint_eq(tqkv__pool_live_allocs(hp), 0);
    ck_assert_uint_eq(tqkv__pool_live_allocs(dp), 0);
    ck_assert_int_eq(tqkv_store_stats(sh.s, NULL, 0, &st), TQKV_OK);
    ck_assert_uint_eq(st.pages, 0);
    ck_assert_uint_eq(st.page_bytes, 0);
    ck_assert_uint_eq(st.bf16_bytes, 0);
    tqkv_store_destroy(sh.s);
}
END_TEST

static Suite *
store_stress_suite(void)
{
    Suite *s = suite_create("store_stress");
    TCase *tc = tcase_create("stress");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_store_stress);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(store_stress_suite)
