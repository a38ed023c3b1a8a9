/* check_codec_threads.c - page encode/decode from many threads at once: the codebook
 * and rotation caches (first use, sharing, LRU eviction under the byte budget) and the
 * kernel table must give every thread the bytes a lone thread gets. */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/sanitize.h"

#define NTHREADS 4

typedef struct job {
    int id, iters;
    uint64_t seed0;
    int failures;
    int *cases;    /* [iters] case index encoded at step i */
    uint32_t *crc; /* [iters] its page CRC */
} job_t;

/* A deterministic block and codec for (seed, i): dims and seeds vary so threads both
 * share and evict cache entries. */
static void
make_case(uint64_t seed, int i, tqkv_block_shape_t *s, tqkv_block_codec_t *c, uint16_t **k)
{
    static const uint32_t dims[] = {64, 96, 128, 256};
    uint64_t r = seed ^ (uint64_t)i * 0x9e3779b97f4a7c15ull;
    size_t n;
    s->num_tokens = 16 + (uint32_t)(tqkv_splitmix64(&r) % 48);
    s->num_kv_heads = 1 + (uint32_t)(tqkv_splitmix64(&r) % 3);
    s->head_dim = dims[tqkv_splitmix64(&r) % 4];
    memset(c, 0, sizeof *c);
    c->k.bits_x2 = (uint8_t)(2 + tqkv_splitmix64(&r) % 7);
    c->k.mode = (uint8_t)(tqkv_splitmix64(&r) % 3 == 0);
    c->v.bits_x2 = (uint8_t)(2 + tqkv_splitmix64(&r) % 7);
    c->key_centering = (uint8_t)(tqkv_splitmix64(&r) & 1);
    c->rotation = (uint8_t)(tqkv_splitmix64(&r) % 4 != 0);
    c->seed = tqkv_splitmix64(&r) % 6; /* few seeds: threads meet on the same matrices */
    n = (size_t)s->num_tokens * s->num_kv_heads * s->head_dim;
    *k = malloc(n * 2);
    for (size_t j = 0; j < n; j++)
        (*k)[j] = tqkv_f32_to_bf16((float)((int64_t)(tqkv_splitmix64(&r) % 2001) - 1000) / 300.f);
}

static void *
worker(void *arg)
{
    job_t *j = arg;
    for (int i = 0; i < j->iters; i++) {
        tqkv_block_shape_t s;
        tqkv_block_codec_t c;
        uint16_t *k;
        size_t sz, n;
        uint8_t *p;
        float *out;
        j->cases[i] = (i * NTHREADS + j->id) % (j->iters * NTHREADS / 2 + 1);
        make_case(j->seed0, j->cases[i], &s, &c, &k);
        n = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim;
        if (tqkv_page_size(&s, &c, &sz) != TQKV_OK) {
            j->failures++;
            free(k);
            continue;
        }
        p = malloc(sz);
        out = malloc(n * 4 * 2);
        if (tqkv_page_encode(&s, &c, k, k, p, sz, NULL, NULL, 0) != TQKV_OK ||
            tqkv_page_validate(p, sz, 1, NULL, NULL, 0) != TQKV_OK ||
            tqkv_page_decode_f32(p, sz, out, out + n) != TQKV_OK)
            j->failures++;
        j->crc[i] = ((const tqkv_page_header_t *)p)->crc32c;
        free(p);
        free(out);
        free(k);
    }
    return NULL;
}

START_TEST(test_concurrent_encode_matches_serial)
{
    pthread_t th[NTHREADS];
    job_t jobs[NTHREADS];
    int iters = tqkv_test_sanitized() ? 12 : 60;
    uint64_t seed = tqkv_test_seed();
    for (int t = 0; t < NTHREADS; t++) {
        jobs[t] =
            (job_t){t, iters, seed, 0, calloc(iters, sizeof(int)), calloc(iters, sizeof(uint32_t))};
        ck_assert_int_eq(pthread_create(&th[t], NULL, worker, &jobs[t]), 0);
    }
    for (int t = 0; t < NTHREADS; t++) {
        pthread_join(th[t], NULL);
        ck_assert_int_eq(jobs[t].failures, 0);
    }
    /* every page again, alone: the same bytes (same CRC) as under contention */
    for (int t = 0; t < NTHREADS; t++) {
        for (int i = 0; i < iters; i++) {
            tqkv_block_shape_t s;
            tqkv_block_codec_t c;
            uint16_t *k;
            size_t sz;
            uint8_t *a;
            make_case(seed, jobs[t].cases[i], &s, &c, &k);
            ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
            a = malloc(sz);
            ck_assert_int_eq(tqkv_page_encode(&s, &c, k, k, a, sz, NULL, NULL, 0), TQKV_OK);
            ck_assert_uint_eq(((const tqkv_page_header_t *)a)->crc32c, jobs[t].crc[i]);
            free(a);
            free(k);
        }
        free(jobs[t].cases);
        free(jobs[t].crc);
    }
}
END_TEST

/* The same page encoded concurrently by every thread: all copies identical. */
typedef struct same_job {
    const tqkv_block_shape_t *s;
    const tqkv_block_codec_t *c;
    const uint16_t *k;
    uint8_t *out;
    size_t sz;
} same_job_t;

static void *
same_worker(void *arg)
{
    same_job_t *j = arg;
    if (tqkv_page_encode(j->s, j->c, j->k, j->k, j->out, j->sz, NULL, NULL, 0) != TQKV_OK)
        memset(j->out, 0, j->sz);
    return NULL;
}

START_TEST(test_same_page_everywhere)
{
    tqkv_block_shape_t s;
    tqkv_block_codec_t c;
    uint16_t *k;
    size_t sz;
    pthread_t th[NTHREADS];
    same_job_t jobs[NTHREADS];
    make_case(tqkv_test_seed() + 1, 7, &s, &c, &k);
    c.rotation = TQKV_ROT_DENSE;
    c.seed = tqkv_test_seed(); /* a fresh matrix: threads race to build it */
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    for (int t = 0; t < NTHREADS; t++) {
        jobs[t] = (same_job_t){&s, &c, k, malloc(sz), sz};
        ck_assert_int_eq(pthread_create(&th[t], NULL, same_worker, &jobs[t]), 0);
    }
    for (int t = 0; t < NTHREADS; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < NTHREADS; t++) {
        ck_assert_int_eq(tqkv_page_validate(jobs[t].out, sz, 1, NULL, NULL, 0), TQKV_OK);
        ck_assert(memcmp(jobs[t].out, jobs[0].out, sz) == 0);
    }
    for (int t = 0; t < NTHREADS; t++)
        free(jobs[t].out);
    free(k);
}
END_TEST

static Suite *
threads_suite(void)
{
    Suite *s = suite_create("codec_threads");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_concurrent_encode_matches_serial);
    tcase_add_test(tc, test_same_page_everywhere);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(threads_suite)
