/* check_gpu_lossless.c - lossless (raw BF16) pages on the device (label gpu; exits 77
 * without a device), and the same on the CPU through the SIMT emulator
 * (check_gpu_lossless_emu, label unit): device decode of a raw tensor returns its bytes
 * (BF16) or their exact widening (f32), the quantized tensor of a half-lossless page decodes
 * as tqkv_page_decode_f32_ref; packed attention over lossless pages matches BF16 attention
 * and over half-lossless pages the CPU reference (the rule of check_gpu.c: 2e-3 of the
 * output's largest magnitude); the device encoder leaves lossless pages to the CPU
 * (TQKV_EUNSUPPORTED).
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/attention.h"
#include "kernels/cuda.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/rng.h"

#define CU(call) ck_assert_msg((call) == cudaSuccess, "%s failed", #call)

static void *
dev_copy_of(const void *host, size_t len)
{
    void *d = NULL;
    CU(cudaMalloc(&d, len ? len : 1));
    if (len)
        CU(cudaMemcpy(d, host, len, cudaMemcpyHostToDevice));
    return d;
}

static tqkv_block_codec_t
codec_of(int k_raw, int v_raw)
{
    tqkv_block_codec_t c;
    tqkv_policy_default_codec(&c);
    if (k_raw)
        tqkv_tensor_codec_lossless(&c.k);
    if (v_raw)
        tqkv_tensor_codec_lossless(&c.v);
    return c;
}

static uint8_t *
cpu_page(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const uint16_t *k,
         const uint16_t *v, size_t *len)
{
    size_t cap;
    ck_assert_int_eq(tqkv_page_size(s, c, &cap), TQKV_OK);
    uint8_t *p = malloc(cap);
    ck_assert_int_eq(tqkv_page_encode_ref(s, c, k, v, p, cap, len, NULL, 0), TQKV_OK);
    return p;
}

START_TEST(test_decode)
{
    uint64_t rng = tqkv_test_seed() ^ 0x1055d;
    for (int mix = 0; mix < 3; mix++) { /* 0: K and V raw, 1: K raw, 2: V raw */
        tqkv_block_shape_t s = {37, 3, mix == 1 ? 96 : 128};
        size_t n = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim, len;
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
        tqkv_test_kv_loud(&rng, k, s.num_tokens, s.num_kv_heads, s.head_dim, -0.3);
        tqkv_test_kv_loud(&rng, v, s.num_tokens, s.num_kv_heads, s.head_dim, 0.0);
        tqkv_block_codec_t c = codec_of(mix != 2, mix != 1);
        uint8_t *page = cpu_page(&s, &c, k, v, &len);
        const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
        float *rk = malloc(n * 4), *rv = malloc(n * 4), *gk = malloc(n * 4), *gv = malloc(n * 4);
        uint16_t *gkh = malloc(n * 2), *gvh = malloc(n * 2);
        ck_assert_int_eq(tqkv_page_decode_f32_ref(page, len, rk, rv), TQKV_OK);
        void *dp = dev_copy_of(page, len), *dk, *dv, *dkh, *dvh;
        CU(cudaMalloc(&dk, n * 4));
        CU(cudaMalloc(&dv, n * 4));
        CU(cudaMalloc(&dkh, n * 2));
        CU(cudaMalloc(&dvh, n * 2));
        ck_assert_int_eq(tqkv_cuda_page_decode_f32(h, dp, dk, dv, 0), TQKV_OK);
        ck_assert_int_eq(tqkv_cuda_page_decode_bf16(h, dp, dkh, dvh, 0), TQKV_OK);
        CU(cudaMemcpy(gk, dk, n * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(gv, dv, n * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(gkh, dkh, n * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(gvh, dvh, n * 2, cudaMemcpyDeviceToHost));
        ck_assert_msg(memcmp(rk, gk, n * 4) == 0, "mix %d: K f32 decode differs", mix);
        ck_assert_msg(memcmp(rv, gv, n * 4) == 0, "mix %d: V f32 decode differs", mix);
        if (mix != 2)
            ck_assert_msg(memcmp(gkh, k, n * 2) == 0, "mix %d: lossless K differs", mix);
        if (mix != 1)
            ck_assert_msg(memcmp(gvh, v, n * 2) == 0, "mix %d: lossless V differs", mix);
        /* a raw descriptor that is not the layout is refused */
        tqkv_page_header_t bad = *h;
        bad.tensor[mix == 2 ? 1 : 0].bits_x2 = 6;
        ck_assert_int_eq(tqkv_cuda_page_decode_f32(&bad, dp, dk, dv, 0), TQKV_EFORMAT);
        cudaFree(dp);
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(dkh);
        cudaFree(dvh);
        free(k);
        free(v);
        free(page);
        free(rk);
        free(rv);
        free(gk);
        free(gv);
        free(gkh);
        free(gvh);
    }
}
END_TEST

static double
max_abs(const float *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

START_TEST(test_attention)
{
    const uint32_t H = 2, D = 128, HQ = 8, B = 80, NP = 3, T = B * NP;
    const size_t bc = (size_t)B * H * D;
    uint64_t rng = tqkv_test_seed() ^ 0xa77d;
    uint16_t *k = malloc(bc * NP * 2), *v = malloc(bc * NP * 2);
    tqkv_test_kv_loud(&rng, k, T, H, D, 0.5);
    tqkv_test_kv_loud(&rng, v, T, H, D, 0.0);
    float *q = malloc(sizeof(float) * HQ * D), *ref = malloc(sizeof(float) * HQ * D);
    float *out = malloc(sizeof(float) * HQ * D);
    for (uint32_t i = 0; i < HQ * D; i++)
        q[i] = (float)tqkv_test_gauss(&rng) * 0.1f;
    for (int mix = 0; mix < 3; mix++) {
        tqkv_block_codec_t c = codec_of(mix != 2, mix != 1);
        void *pages[3], *dpages[3];
        size_t lens[3];
        for (uint32_t p = 0; p < NP; p++) {
            tqkv_block_shape_t s = {B, H, D};
            pages[p] = cpu_page(&s, &c, k + p * bc, v + p * bc, &lens[p]);
            dpages[p] = dev_copy_of(pages[p], lens[p]);
        }
        if (mix == 0)
            ck_assert_int_eq(tqkv_attn_bf16_ref(q, HQ, k, v, T, H, D, ref), TQKV_OK);
        else
            ck_assert_int_eq(
                tqkv_attn_decode_ref(q, HQ, (const void *const *)pages, lens, NP, NULL, ref),
                TQKV_OK);
        const tqkv_page_header_t *h0 = (const tqkv_page_header_t *)pages[0];
        uint32_t splits = tqkv_cuda_attention_packed_splits(h0, NP);
        size_t wb = tqkv_cuda_attention_workspace(splits, HQ, D);
        void *dq = dev_copy_of(q, sizeof(float) * HQ * D), *dout, *dwork;
        void *dptrs = dev_copy_of(dpages, NP * sizeof(void *));
        CU(cudaMalloc(&dout, sizeof(float) * HQ * D));
        CU(cudaMalloc(&dwork, wb));
        ck_assert_int_eq(tqkv_cuda_attention_packed(h0, (const void *const *)dptrs, NP, dq, HQ,
                                                    0.0f, dout, dwork, wb, 0),
                         TQKV_OK);
        CU(cudaMemcpy(out, dout, sizeof(float) * HQ * D, cudaMemcpyDeviceToHost));
        double scale = max_abs(ref, (size_t)HQ * D), worst = 0;
        for (uint32_t i = 0; i < HQ * D; i++)
            worst = fmax(worst, fabs(out[i] - ref[i]));
        ck_assert_msg(worst <= 2e-3 * scale, "mix %d: max |gpu - cpu| = %g (scale %g)", mix, worst,
                      scale);
        for (uint32_t p = 0; p < NP; p++) {
            free(pages[p]);
            cudaFree(dpages[p]);
        }
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dwork);
        cudaFree(dptrs);
    }
    free(k);
    free(v);
    free(q);
    free(ref);
    free(out);
}
END_TEST

START_TEST(test_encode_leaves_lossless_to_cpu)
{
    tqkv_block_shape_t s = {4, 1, 64};
    tqkv_block_codec_t c = codec_of(0, 1);
    size_t cap, w = 0;
    ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
    void *dk, *dv, *dp;
    CU(cudaMalloc(&dk, 4 * 64 * 2));
    CU(cudaMalloc(&dv, 4 * 64 * 2));
    CU(cudaMalloc(&dp, cap));
    ck_assert_int_eq(tqkv_cuda_page_encode(&s, &c, dk, dv, dp, cap, &w, 0), TQKV_EUNSUPPORTED);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dp);
}
END_TEST

static Suite *
gpu_lossless_suite(void)
{
    Suite *s = suite_create("gpu_lossless");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_decode);
    tcase_add_test(tc, test_attention);
    tcase_add_test(tc, test_encode_leaves_lossless_to_cpu);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    int n = 0;
    if (tqkv_cuda_device_count(&n) != TQKV_OK || n == 0) {
        fprintf(stderr, "check_gpu_lossless: no CUDA device: skipped\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(gpu_lossless_suite());
    /* no fork: a CUDA context does not survive fork() */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
