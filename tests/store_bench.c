/* store_bench.c - tqkv-store-bench: the store's reuse-trace and throughput benchmark.
 *
 *   tqkv-store-bench [--requests N] [--seconds S] [--rss GiB] [--no-trace] [--no-ops]
 *
 * 1. Hit rate of LRU vs S3-FIFO on a prefix-reuse trace: D documents with Zipf
 *    popularity each have a chain of P shared prefix blocks, followed by one of C
 *    continuations (Zipf per document) of S blocks. Each request looks up its block
 *    chain, gets the cached prefix and puts the rest (with parent links). Prefix hit
 *    rate = cached prefix blocks / blocks requested, after a 10% warm-up, at several
 *    capacities (as a fraction of the unique blocks).
 * 2. put/get/lookup ops/s at 1 and 2 threads (4 KiB pages, DRAM tier).
 * 3. With --rss G: stores G GiB of 100 KiB pages and prints VmRSS against page bytes.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store.h"
#include "tests/store_test_util.h"

#define NS "bench/llama-3.1-8b"

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- Zipf sampling ---- */

typedef struct zipf {
    double *cdf;
    size_t n;
} zipf_t;

static void
zipf_init(zipf_t *z, size_t n, double s)
{
    double sum = 0;
    z->n = n;
    z->cdf = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        sum += 1.0 / pow((double)(i + 1), s);
        z->cdf[i] = sum;
    }
    for (size_t i = 0; i < n; i++)
        z->cdf[i] /= sum;
}

static size_t
zipf_draw(const zipf_t *z, uint64_t *x)
{
    double u = (double)(tqkv_test_rand(x) >> 11) * (1.0 / 9007199254740992.0);
    size_t lo = 0, hi = z->n - 1;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (z->cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* ---- 1. reuse trace ---- */

enum { DOCS = 2000, PREFIX = 8, CONT = 16, SUFFIX = 4, PAGE = 1024 };

/* Block hash of block b (0..PREFIX+SUFFIX) of (doc, continuation). Prefix blocks do
 * not depend on the continuation. Hashes are permuted per doc so popularity is not
 * visible in the key. */
static void
block_hash(uint8_t out[32], size_t doc, size_t cont, int b)
{
    if (b < PREFIX)
        st_hash(out, 1 + doc * 7919, (uint64_t)b);
    else
        st_hash(out, 1000003 + doc * 104729 + cont * 31, (uint64_t)b);
}

static double
run_trace(tqkv_evict_policy_t pol, double frac, size_t requests, uint64_t seed)
{
    tqkv_store_config_t c;
    tqkv_store_t *s;
    zipf_t zd, zc;
    uint64_t x = seed;
    uint64_t unique = (uint64_t)DOCS * PREFIX + (uint64_t)DOCS * CONT * SUFFIX;
    uint64_t hit = 0, total = 0;
    uint8_t page[PAGE];
    uint8_t hs[PREFIX + SUFFIX][32];
    const uint8_t *hp[PREFIX + SUFFIX];
    size_t hl[PREFIX + SUFFIX];

    tqkv_store_config_default(&c);
    c.policy = pol;
    c.dram_capacity = (uint64_t)((double)unique * frac) * PAGE;
    if (tqkv_store_create(&c, &s) != TQKV_OK) {
        fprintf(stderr, "store_create failed\n");
        exit(1);
    }
    zipf_init(&zd, DOCS, 0.9);
    zipf_init(&zc, CONT, 1.1);
    memset(page, 0x3c, sizeof(page));
    for (int i = 0; i < PREFIX + SUFFIX; i++) {
        hp[i] = hs[i];
        hl[i] = 32;
    }
    for (size_t r = 0; r < requests; r++) {
        size_t doc = zipf_draw(&zd, &x), cont = zipf_draw(&zc, &x);
        uint32_t prefix = 0;
        for (int b = 0; b < PREFIX + SUFFIX; b++)
            block_hash(hs[b], doc, cont, b);
        tqkv_store_lookup(s, NS, strlen(NS), hp, hl, PREFIX + SUFFIX, 1, 0, &prefix, NULL);
        for (uint32_t b = 0; b < prefix; b++) {
            tqkv_block_key_t k = {NS, strlen(NS), hs[b], 32, 0};
            tqkv_page_ref_t *ref;
            if (tqkv_store_get(s, &k, &ref) == TQKV_OK)
                tqkv_page_ref_release(ref);
        }
        for (int b = (int)prefix; b < PREFIX + SUFFIX; b++) {
            tqkv_block_key_t k = {NS, strlen(NS), hs[b], 32, 0};
            tqkv_store_put(s, &k, b > 0 ? hs[b - 1] : NULL, b > 0 ? 32 : 0, page, PAGE, 4 * PAGE,
                           NULL);
        }
        if (r >= requests / 10) {
            hit += prefix;
            total += PREFIX + SUFFIX;
        }
    }
    tqkv_store_destroy(s);
    free(zd.cdf);
    free(zc.cdf);
    return total ? (double)hit / (double)total : 0;
}

/* ---- 2. throughput ---- */

enum { OP_PUT, OP_GET, OP_LOOKUP };

typedef struct tp_arg {
    tqkv_store_t *s;
    int op;
    int tid;
    size_t nkeys;
    double seconds;
    uint64_t ops;
} tp_arg_t;

static void *
tp_worker(void *p)
{
    tp_arg_t *a = p;
    uint64_t x = 0x1234 + (uint64_t)a->tid * 7777, n = 0, put_next = 0;
    uint8_t page[4096];
    double end = now_s() + a->seconds;
    memset(page, 0x11, sizeof(page));
    while (now_s() < end) {
        for (int i = 0; i < 256; i++) {
            uint8_t h[8][32];
            if (a->op == OP_PUT) {
                st_hash(h[0], 100 + (uint64_t)a->tid, put_next++);
                tqkv_block_key_t k = {NS, strlen(NS), h[0], 32, 0};
                tqkv_store_put(a->s, &k, NULL, 0, page, sizeof(page), 0, NULL);
            } else if (a->op == OP_GET) {
                st_hash(h[0], 1, tqkv_test_rand(&x) % a->nkeys);
                tqkv_block_key_t k = {NS, strlen(NS), h[0], 32, 0};
                tqkv_page_ref_t *ref;
                if (tqkv_store_get(a->s, &k, &ref) == TQKV_OK)
                    tqkv_page_ref_release(ref);
            } else {
                const uint8_t *hp[8];
                size_t hl[8];
                uint32_t prefix;
                uint64_t base = tqkv_test_rand(&x) % (a->nkeys - 8);
                for (int j = 0; j < 8; j++) {
                    st_hash(h[j], 1, base + (uint64_t)j);
                    hp[j] = h[j];
                    hl[j] = 32;
                }
                tqkv_store_lookup(a->s, NS, strlen(NS), hp, hl, 8, 1, 0, &prefix, NULL);
            }
            n++;
        }
    }
    a->ops = n;
    return NULL;
}

static double
run_ops(tqkv_evict_policy_t pol, int op, int threads, double seconds)
{
    tqkv_store_config_t c;
    tqkv_store_t *s;
    const size_t nkeys = 50000;
    uint8_t page[4096], h[32];
    pthread_t th[8];
    tp_arg_t a[8];
    uint64_t total = 0;

    tqkv_store_config_default(&c);
    c.policy = pol;
    c.dram_capacity = 512ull << 20;
    if (tqkv_store_create(&c, &s) != TQKV_OK)
        exit(1);
    memset(page, 0x22, sizeof(page));
    for (size_t i = 0; i < nkeys; i++) {
        st_hash(h, 1, i);
        tqkv_block_key_t k = {NS, strlen(NS), h, 32, 0};
        tqkv_store_put(s, &k, NULL, 0, page, sizeof(page), 0, NULL);
    }
    double t0 = now_s();
    for (int i = 0; i < threads; i++) {
        a[i] = (tp_arg_t){s, op, i, nkeys, seconds, 0};
        pthread_create(&th[i], NULL, tp_worker, &a[i]);
    }
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        total += a[i].ops;
    }
    double dt = now_s() - t0;
    tqkv_store_destroy(s);
    return (double)total / dt;
}

/* ---- 3. RSS ---- */

static long
vm_rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            v = strtol(line + 6, NULL, 10);
    fclose(f);
    return v;
}

static void
run_rss(double gib)
{
    tqkv_store_config_t c;
    tqkv_store_t *s;
    const size_t psz = 100 * 1024;
    uint64_t n = (uint64_t)(gib * (double)(1ull << 30)) / psz + 1;
    uint8_t *page = malloc(psz), h[32];
    tqkv_store_stats_t st;

    tqkv_store_config_default(&c);
    c.dram_capacity = n * psz + (1u << 20);
    if (tqkv_store_create(&c, &s) != TQKV_OK)
        exit(1);
    long rss0 = vm_rss_kib();
    for (uint64_t i = 0; i < n; i++) {
        st_fill(page, psz, i);
        st_hash(h, 5, i / 32); /* 32 layers per block */
        tqkv_block_key_t k = {NS, strlen(NS), h, 32, (uint32_t)(i % 32)};
        if (tqkv_store_put(s, &k, NULL, 0, page, psz, 0, NULL) != TQKV_OK) {
            fprintf(stderr, "put %llu failed\n", (unsigned long long)i);
            exit(1);
        }
    }
    long rss1 = vm_rss_kib();
    tqkv_store_stats(s, NULL, 0, &st);
    double page_b = (double)st.page_bytes, grown = (double)(rss1 - rss0) * 1024.0;
    printf("\nRSS with %llu pages of 100 KiB (%.3f GiB of page data):\n",
           (unsigned long long)st.pages, page_b / (double)(1ull << 30));
    printf("  VmRSS before %ld KiB, after %ld KiB; growth / page bytes = %.4f; "
           "overhead per page = %.0f B\n",
           rss0, rss1, grown / page_b, (grown - page_b) / (double)st.pages);
    printf("  VmRSS / page bytes = %.4f (RSS before includes the binary and libraries)\n",
           (double)rss1 * 1024.0 / page_b);
    tqkv_store_destroy(s);
    free(page);
}

int
main(int argc, char **argv)
{
    size_t requests = 60000;
    double seconds = 1.0, rss = 0;
    int trace = 1, ops = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--requests") && i + 1 < argc)
            requests = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
            seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--rss") && i + 1 < argc)
            rss = atof(argv[++i]);
        else if (!strcmp(argv[i], "--no-trace"))
            trace = 0;
        else if (!strcmp(argv[i], "--no-ops"))
            ops = 0;
        else {
            fprintf(stderr,
                    "usage: %s [--requests N] [--seconds S] [--rss GiB] [--no-trace] "
                    "[--no-ops]\n",
                    argv[0]);
            return 2;
        }
    }
    if (trace) {
        const double fracs[] = {0.02, 0.05, 0.10, 0.20, 0.40};
        printf("Prefix hit rate, %zu requests (%d docs Zipf 0.9 x %d prefix blocks, %d "
               "continuations Zipf 1.1 x %d blocks)\n",
               requests, DOCS, PREFIX, CONT, SUFFIX);
        printf("%-10s %10s %10s %10s\n", "capacity", "LRU", "S3-FIFO", "delta");
        for (unsigned i = 0; i < sizeof(fracs) / sizeof(fracs[0]); i++) {
            double l = run_trace(TQKV_EVICT_LRU, fracs[i], requests, 42);
            double f = run_trace(TQKV_EVICT_S3FIFO, fracs[i], requests, 42);
            printf("%8.0f%% %9.2f%% %9.2f%% %+9.2f\n", fracs[i] * 100, l * 100, f * 100,
                   (f - l) * 100);
        }
    }
    if (ops) {
        const char *names[] = {"put", "get", "lookup(8)"};
        printf("\nops/s (4 KiB pages, 50k keys, DRAM tier, %.1f s per cell)\n", seconds);
        printf("%-10s %-8s %14s %14s\n", "op", "policy", "1 thread", "2 threads");
        for (int op = 0; op < 3; op++)
            for (int p = 0; p < 2; p++) {
                tqkv_evict_policy_t pol = p ? TQKV_EVICT_S3FIFO : TQKV_EVICT_LRU;
                printf("%-10s %-8s %14.0f %14.0f\n", names[op], p ? "s3fifo" : "lru",
                       run_ops(pol, op, 1, seconds), run_ops(pol, op, 2, seconds));
            }
    }
    if (rss > 0)
        run_rss(rss);
    return 0;
}
