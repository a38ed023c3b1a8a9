/* check_gpu_put.c - the server's Put encode on the GPU (service/gpu_encode.c): pages
 * equal those of the CUDA encoder called directly, are valid and decode close to the
 * input; per-thread device scratch grows and is used from several threads; NaN input and
 * a short buffer are errors, not crashes.
 *
 * Built twice: on the SIMT emulator (check_gpu_put_emu, label unit: runs in CI without a
 * GPU) and against the CUDA runtime (check_gpu_put, label gpu: exits 77 without one).
 */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda.h"
#include "kernels/page.h"
#include "kernels/tq_math.h"
#include "service/gpu_encode.h"
#include "tests/check_main.h"
#include "tests/support/rng.h"

#ifdef TQKV_SIMT_EMU
#define FULL(full, emu) (emu)
#else
#define FULL(full, emu) (full)
#endif

static uint16_t *
random_bf16(size_t n, uint64_t *rng)
{
    uint16_t *x = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        double g = tqkv_test_gauss(rng);
        x[i] = tqkv_f32_to_bf16((float)(g * (i % 7 == 0 ? 4.0 : 1.0) + (i % 5 == 0 ? 0.5 : 0.0)));
    }
    return x;
}

/* The CUDA encoder called directly (device buffers of exactly the input sizes). */
static uint8_t *
direct_encode(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const uint16_t *k,
              const uint16_t *v, size_t cap)
{
    size_t n = (size_t)s->num_tokens * s->num_kv_heads * s->head_dim * 2, len = 0;
    void *dk = NULL, *dv = NULL, *dp = NULL;
    ck_assert(cudaMalloc(&dk, n) == cudaSuccess && cudaMalloc(&dv, n) == cudaSuccess &&
              cudaMalloc(&dp, cap) == cudaSuccess);
    ck_assert(cudaMemcpy(dk, k, n, cudaMemcpyHostToDevice) == cudaSuccess);
    ck_assert(cudaMemcpy(dv, v, n, cudaMemcpyHostToDevice) == cudaSuccess);
    ck_assert_int_eq(tqkv_cuda_page_encode(s, c, c->k.bits_x2 ? dk : NULL, c->v.bits_x2 ? dv : NULL,
                                           dp, cap, &len, 0),
                     TQKV_OK);
    ck_assert_int_eq(tqkv_cuda_page_encode_status(dp, 0), TQKV_OK);
    uint8_t *page = malloc(cap);
    ck_assert(cudaMemcpy(page, dp, cap, cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dp);
    return page;
}

typedef struct kase {
    uint32_t t, h, d;
    uint8_t kb2, vb2, kmode, nc, ctr;
} kase_t;

static const kase_t cases[] = {
    {16, 2, 128, 6, 6, TQKV_MODE_MSE, 1, 1},  /* the default policy, small */
    {33, 3, 64, 7, 5, TQKV_MODE_MSE, 1, 0},   /* 3.5 / 2.5 bits: two groups */
    {8, 1, 128, 6, 0, TQKV_MODE_PROD, 0, 1},  /* K only, prod */
    {256, 8, 128, 6, 6, TQKV_MODE_MSE, 1, 1}, /* a real block (GPU only) */
};

static void
check_case(const kase_t *kc, uint64_t seed)
{
    tqkv_block_shape_t s = {kc->t, kc->h, kc->d};
    tqkv_block_codec_t c = {0};
    uint64_t rng = seed;
    size_t n = (size_t)kc->t * kc->h * kc->d, cap = 0, w = 0;
    char err[256] = "";
    c.k.bits_x2 = kc->kb2;
    c.v.bits_x2 = kc->vb2;
    c.k.mode = kc->kmode;
    c.k.norm_correction = c.v.norm_correction = kc->nc;
    c.key_centering = kc->ctr;
    c.rotation = TQKV_ROT_HADAMARD;
    c.seed = seed;
    uint16_t *k = random_bf16(n, &rng), *v = random_bf16(n, &rng);
    ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
    uint8_t *page = malloc(cap);
    ck_assert_int_eq(
        tqkv__gpu_encode(0, &s, &c, k, c.v.bits_x2 ? v : NULL, page, cap, &w, err, sizeof err),
        TQKV_OK);
    ck_assert_uint_eq(w, cap);
    uint8_t *want = direct_encode(&s, &c, k, v, cap);
    ck_assert_msg(memcmp(page, want, cap) == 0, "T%u H%u D%u: page differs from the direct encode",
                  kc->t, kc->h, kc->d);
    tqkv_page_info_t info;
    ck_assert_int_eq(tqkv_page_validate(page, cap, 1, &info, err, sizeof err), TQKV_OK);
    /* decodes close to the input (3+ bits: relative error well under 0.5) */
    float *ko = malloc(n * 4), *vo = malloc(n * 4);
    ck_assert_int_eq(tqkv_page_decode_f32(page, cap, ko, c.v.bits_x2 ? vo : NULL), TQKV_OK);
    double e = 0, x2 = 0;
    for (size_t i = 0; i < n; i++) {
        double x = tqkv_bf16_to_f32(k[i]);
        e += (ko[i] - x) * (ko[i] - x);
        x2 += x * x;
    }
    ck_assert_msg(e / x2 < 0.25, "relative squared error %g", e / x2);
    free(ko);
    free(vo);
    free(want);
    free(page);
    free(k);
    free(v);
}

START_TEST(test_gpu_put_equals_direct)
{
    uint64_t seed = tqkv_test_seed();
    for (size_t i = 0; i < FULL(4u, 3u); i++)
        check_case(&cases[i], seed + i);
    /* smaller after larger, then larger again: the scratch is reused and grown */
    check_case(&cases[0], seed + 10);
    check_case(&cases[1], seed + 11);
}
END_TEST

#ifndef TQKV_SIMT_EMU
static void *
thread_main(void *arg)
{
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    for (int r = 0; r < 2; r++)
        check_case(&cases[(seed + (uint64_t)r) % 2], seed * 31 + (uint64_t)r);
    return NULL;
}

START_TEST(test_gpu_put_threads)
{
    pthread_t th[3];
    for (uintptr_t i = 0; i < 3; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, thread_main, (void *)(i + 1)), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
}
END_TEST
#endif

START_TEST(test_gpu_put_errors)
{
    tqkv_block_shape_t s = {4, 1, 64};
    tqkv_block_codec_t c = {0};
    uint64_t rng = 7;
    size_t n = 4 * 64, cap = 0, w = 1;
    char err[256] = "";
    c.k.bits_x2 = c.v.bits_x2 = 6;
    c.rotation = TQKV_ROT_HADAMARD;
    uint16_t *k = random_bf16(n, &rng), *v = random_bf16(n, &rng);
    ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
    uint8_t *page = malloc(cap);
    k[17] = 0x7fc0; /* NaN */
    ck_assert_int_eq(tqkv__gpu_encode(0, &s, &c, k, v, page, cap, &w, err, sizeof err),
                     TQKV_ERANGE);
    ck_assert_uint_eq(w, 0);
    ck_assert_ptr_nonnull(strstr(err, "gpu encode"));
    k[17] = 0x3f80;
    ck_assert_int_ne(tqkv__gpu_encode(0, &s, &c, k, v, page, cap - 16, &w, err, sizeof err),
                     TQKV_OK);
    ck_assert_int_eq(tqkv__gpu_encode(0, &s, &c, k, NULL, page, cap, &w, err, sizeof err),
                     TQKV_EINVAL);
    ck_assert_int_eq(tqkv__gpu_encode(-1, &s, &c, k, v, page, cap, &w, err, sizeof err),
                     TQKV_EINVAL);
    /* and the scratch still works afterwards */
    ck_assert_int_eq(tqkv__gpu_encode(0, &s, &c, k, v, page, cap, &w, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_validate(page, cap, 1, NULL, err, sizeof err), TQKV_OK);
    free(page);
    free(k);
    free(v);
}
END_TEST

static Suite *
gpu_put_suite(void)
{
    Suite *s = suite_create("gpu_put");
    TCase *tc = tcase_create("gpu_put");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_gpu_put_equals_direct);
#ifndef TQKV_SIMT_EMU /* the emulator's launch state is global: one thread at a time */
    tcase_add_test(tc, test_gpu_put_threads);
#endif
    tcase_add_test(tc, test_gpu_put_errors);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    int n = 0;
    if (!tqkv__gpu_encode_available(0) || tqkv_cuda_device_count(&n) != TQKV_OK || n == 0) {
        fprintf(stderr, "check_gpu_put: no CUDA device: skipped\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(gpu_put_suite());
    srunner_set_fork_status(sr, CK_NOFORK); /* a CUDA context does not survive fork() */
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
