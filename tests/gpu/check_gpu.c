/* check_gpu.c - GPU tests (label gpu): CUDA pages vs the CPU reference codec, device
 * decode, fused and BF16 attention vs the CPU references, the HBM device pool and the
 * store with a real HBM tier. Exits 77 (skipped) when no CUDA device is present.
 *
 * Equality rules: the CUDA encoder runs the reference's f32/f64 operations per vector
 * (tq_math.h, no FMA contraction), so pages must be byte-identical to
 * tqkv_page_encode_ref; decode must equal tqkv_page_decode_f32_ref exactly. Attention
 * (different summation orders, __expf) is compared with a relative bound of 2e-3 of the
 * output's max magnitude.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cache/cache_internal.h"
#include "cache/pool.h"
#include "cache/store.h"
#include "kernels/attention.h"
#include "kernels/cuda.h"
#include "kernels/page.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/rng.h"

static uint64_t rng_state;

/* Under the SIMT emulator (check_gpu_emu) the same tests run on the CPU with fewer and
 * smaller inputs; on a GPU they run at full size. */
#ifdef TQKV_SIMT_EMU
#define FULL(full, emu) (emu)
#else
#define FULL(full, emu) (full)
#endif

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

/* Encodes on the GPU and returns the page bytes (host, malloc). */
static uint8_t *
gpu_encode(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const uint16_t *k,
           const uint16_t *v, size_t *len, tqkv_status_t *status)
{
    size_t cap = 0, n = (size_t)s->num_tokens * s->num_kv_heads * s->head_dim * 2;
    ck_assert_int_eq(tqkv_page_size(s, c, &cap), TQKV_OK);
    void *dk = dev_copy_of(k, n), *dv = dev_copy_of(v, n), *dp = NULL;
    CU(cudaMalloc(&dp, cap));
    ck_assert_int_eq(tqkv_cuda_page_encode(s, c, c->k.bits_x2 ? dk : NULL, c->v.bits_x2 ? dv : NULL,
                                           dp, cap, len, 0),
                     TQKV_OK);
    ck_assert_uint_eq(*len, cap);
    *status = tqkv_cuda_page_encode_status(dp, 0);
    uint8_t *page = malloc(cap);
    CU(cudaMemcpy(page, dp, cap, cudaMemcpyDeviceToHost));
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dp);
    return page;
}

/* Names the section of a page that byte `off` belongs to (for failure messages). */
static const char *
section_of(const uint8_t *page, size_t off, char *buf, size_t len)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    if (off < TQKV_PAGE_HEADER_BYTES)
        return snprintf(buf, len, "header"), buf;
    if (h->mean_offset && off >= h->mean_offset &&
        off < h->mean_offset + 4ull * h->num_kv_heads * h->head_dim)
        return snprintf(buf, len, "key mean"), buf;
    for (uint32_t t = 0; t < 2; t++) {
        const tqkv_page_tensor_desc_t *td = &h->tensor[t];
        if (td->mask_offset && off >= td->mask_offset && off < td->group_offset[0])
            return snprintf(buf, len, "%c mask", "KV"[t]), buf;
        for (uint32_t g = 0; g < 2; g++) {
            tqkv_group_view_t gv;
            if (tqkv_page_group_view(page, t, g, &gv) != 0)
                continue;
            uint64_t r = off - td->group_offset[g];
            if (off < td->group_offset[g] || r >= gv.L.bytes)
                continue;
            const char *what = r < gv.L.off_scale                             ? "codebook"
                               : r < gv.L.off_scale + 2 * n                   ? "scale"
                               : gv.L.off_gamma && r < gv.L.off_gamma + 2 * n ? "gamma"
                               : r < gv.L.off_idx                             ? "padding"
                               : r < gv.L.off_idx + n * gv.L.idx_row_bytes    ? "index"
                                                                              : "signs/padding";
            uint64_t vec = r >= gv.L.off_idx && r < gv.L.off_idx + n * gv.L.idx_row_bytes
                               ? (r - gv.L.off_idx) / gv.L.idx_row_bytes
                               : (r - gv.L.off_scale) / 2 % (n ? n : 1);
            return snprintf(buf, len, "%c group %u %s (vector ~%llu)", "KV"[t], g, what,
                            (unsigned long long)vec),
                   buf;
        }
    }
    return snprintf(buf, len, "unknown section"), buf;
}

/* Compares a GPU page with the reference page. Bytes outside the per-vector records
 * (header but its CRC, key mean, masks, codebooks, padding) must be identical; per-vector
 * records (scale, gamma, index row, sign row) that differ are counted in *vec_diff (near
 * ties: the same f32/f64 operations run on both sides, so the expected count is 0) out of
 * *vec_total. Returns the offset of the first differing byte outside the records, or
 * SIZE_MAX. */
static size_t
page_compare(const uint8_t *ref, const uint8_t *gp, size_t len, uint64_t *vec_diff,
             uint64_t *vec_total)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)ref;
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    uint8_t *rec = calloc(len, 1); /* 1 = byte of a per-vector record */
    size_t first = SIZE_MAX;
    *vec_diff = *vec_total = 0;
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t g = 0; g < 2; g++) {
            tqkv_group_view_t a, b;
            if (tqkv_page_group_view(ref, t, g, &a) != 0 || tqkv_page_group_view(gp, t, g, &b) != 0)
                continue;
            for (uint64_t i = 0; i < n; i++) {
                size_t off[4] = {
                    (size_t)(a.base - ref + a.L.off_scale + 2 * i),
                    a.gamma ? (size_t)(a.base - ref + a.L.off_gamma + 2 * i) : 0,
                    (size_t)(a.base - ref + a.L.off_idx + i * a.L.idx_row_bytes),
                    a.signs ? (size_t)(a.base - ref + a.L.off_signs + i * a.L.sign_row_bytes) : 0};
                size_t n_b[4] = {2, a.gamma ? 2u : 0u, a.L.idx_row_bytes, a.L.sign_row_bytes};
                int differs = 0;
                for (int r = 0; r < 4; r++) {
                    if (!n_b[r])
                        continue;
                    differs |= memcmp(ref + off[r], gp + off[r], n_b[r]) != 0;
                    memset(rec + off[r], 1, n_b[r]);
                }
                *vec_diff += (uint64_t)differs;
                ++*vec_total;
            }
        }
    for (size_t i = 0; i < len && first == SIZE_MAX; i++)
        if (!rec[i] && (i < 12 || i >= 16) && ref[i] != gp[i])
            first = i;
    free(rec);
    return first;
}

/* First differing byte outside the CRC field (len when none). */
static size_t
first_record_diff(const uint8_t *a, const uint8_t *b, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if ((i < 12 || i >= 16) && a[i] != b[i])
            return i;
    return len;
}

static void
random_codec(tqkv_block_codec_t *c, int tr)
{
    static const uint8_t bits[] = {2, 3, 4, 5, 6, 7, 8};
    memset(c, 0, sizeof *c);
    c->k.bits_x2 = bits[tqkv_test_rand(&rng_state) % 7];
    c->v.bits_x2 = tr % 7 == 3 ? 0 : bits[tqkv_test_rand(&rng_state) % 7];
    c->k.mode = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
    c->v.mode = (uint8_t)(tqkv_test_rand(&rng_state) % 4 == 0);
    c->k.norm_correction = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
    c->v.norm_correction = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
    c->rotation = (uint8_t)(tr % 3 ? TQKV_ROT_HADAMARD : TQKV_ROT_DENSE);
    c->key_centering = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
    c->seed = tqkv_test_rand(&rng_state);
}

START_TEST(test_gpu_page_equals_cpu_reference)
{
    static const uint32_t dims[] = {128, 64, 16, 96, 129, 256};
    uint64_t near_ties = 0, vectors = 0;
    rng_state = tqkv_test_seed() ^ 0x101;
    for (int tr = 0; tr < FULL(30, 12); tr++) {
        tqkv_block_shape_t s = {
            (uint32_t[]){1, 7, 16, 33, 256}[tqkv_test_rand(&rng_state) % FULL(5, 4)],
            1 + (uint32_t)(tqkv_test_rand(&rng_state) % 8), dims[tr % 6]};
        tqkv_block_codec_t c;
        size_t n = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim, cap = 0, w = 0, wg = 0;
        random_codec(&c, tr);
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
        tqkv_test_kv_loud(&rng_state, k, s.num_tokens, s.num_kv_heads, s.head_dim, 0.75);
        tqkv_test_kv_loud(&rng_state, v, s.num_tokens, s.num_kv_heads, s.head_dim, 0.0);
        ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
        uint8_t *ref = malloc(cap);
        ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, k, v, ref, cap, &w, NULL, 0), TQKV_OK);
        tqkv_status_t est;
        uint8_t *gp = gpu_encode(&s, &c, k, v, &wg, &est);
        ck_assert_int_eq(est, TQKV_OK);
        ck_assert_uint_eq(w, wg);
        uint64_t vd, vt;
        size_t first = page_compare(ref, gp, w, &vd, &vt);
        char where[96];
        ck_assert_msg(first == SIZE_MAX,
                      "trial %d T=%u H=%u D=%u k=%u/%u/nc%u v=%u/%u/nc%u rot=%u ctr=%u: byte %zu "
                      "of %zu differs (%s)",
                      tr, s.num_tokens, s.num_kv_heads, s.head_dim, c.k.bits_x2, c.k.mode,
                      c.k.norm_correction, c.v.bits_x2, c.v.mode, c.v.norm_correction, c.rotation,
                      c.key_centering, first, w,
                      first != SIZE_MAX ? section_of(ref, first, where, sizeof where) : "");
        /* near ties: a vector record may differ only where a value sits on a decision
         * boundary; bounded at 1 in 10^4 vectors (and the CRC then differs too) */
        near_ties += vd;
        vectors += vt;
        ck_assert_msg(
            vd <= vt / 10000, "trial %d: %llu of %llu vector records differ (first at %s)", tr,
            (unsigned long long)vd, (unsigned long long)vt,
            vd ? section_of(ref, first_record_diff(ref, gp, w), where, sizeof where) : "");
        if (vd == 0)
            ck_assert_mem_eq(ref, gp, w); /* CRC included */
        ck_assert_int_eq(tqkv_page_validate(gp, wg, 1, NULL, NULL, 0), TQKV_OK);
        free(k);
        free(v);
        free(ref);
        free(gp);
    }
    fprintf(stderr, "check_gpu: near ties: %llu of %llu vector records differ from the CPU\n",
            (unsigned long long)near_ties, (unsigned long long)vectors);
}
END_TEST

/* The batch encoder/decoder: every page equals the reference page of its block. */
START_TEST(test_gpu_batch_equals_cpu_reference)
{
    rng_state = tqkv_test_seed() ^ 0x111;
    for (int tr = 0; tr < 6; tr++) {
        tqkv_block_shape_t s = {1 + (uint32_t)(tqkv_test_rand(&rng_state) % 40),
                                1 + (uint32_t)(tqkv_test_rand(&rng_state) % 4), tr % 2 ? 128 : 96};
        tqkv_block_codec_t c;
        uint32_t nb = 2 + (uint32_t)(tqkv_test_rand(&rng_state) % 5);
        size_t blk = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim, cap, w, pb;
        random_codec(&c, tr);
        ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
        size_t stride = cap + 64; /* a gap between pages */
        uint16_t *k = malloc(blk * nb * 2), *v = malloc(blk * nb * 2);
        tqkv_test_kv_loud(&rng_state, k, (uint64_t)s.num_tokens * nb, s.num_kv_heads, s.head_dim,
                          0.25);
        tqkv_test_kv_loud(&rng_state, v, (uint64_t)s.num_tokens * nb, s.num_kv_heads, s.head_dim,
                          0.0);
        void *dk = dev_copy_of(k, blk * nb * 2), *dv = dev_copy_of(v, blk * nb * 2), *dp, *dout;
        CU(cudaMalloc(&dp, stride * nb));
        CU(cudaMalloc(&dout, blk * nb * 4));
        ck_assert_int_eq(tqkv_cuda_page_encode_batch(&s, &c, nb, dk, dv, blk, dp, stride, &pb, 0),
                         TQKV_OK);
        ck_assert_uint_eq(pb, cap);
        ck_assert_int_eq(tqkv_cuda_page_encode_status(dp, 0), TQKV_OK);
        uint8_t *gp = malloc(stride * nb), *ref = malloc(cap);
        float *dec = malloc(blk * nb * 4), *rdec = malloc(blk * 4);
        CU(cudaMemcpy(gp, dp, stride * nb, cudaMemcpyDeviceToHost));
        int has_v = c.v.bits_x2 != 0;
        ck_assert_int_eq(tqkv_cuda_page_decode_f32_batch((const tqkv_page_header_t *)gp, nb, dp,
                                                         stride, has_v ? NULL : dout,
                                                         has_v ? dout : NULL, blk, 0),
                         TQKV_OK);
        CU(cudaMemcpy(dec, dout, blk * nb * 4, cudaMemcpyDeviceToHost));
        for (uint32_t bi = 0; bi < nb; bi++) {
            ck_assert_int_eq(
                tqkv_page_encode_ref(&s, &c, k + bi * blk, v + bi * blk, ref, cap, &w, NULL, 0),
                TQKV_OK);
            ck_assert_msg(memcmp(ref, gp + bi * stride, cap) == 0, "trial %d block %u differs", tr,
                          bi);
            ck_assert_int_eq(
                tqkv_page_decode_f32_ref(ref, cap, has_v ? NULL : rdec, has_v ? rdec : NULL),
                TQKV_OK);
            ck_assert_msg(memcmp(rdec, dec + bi * blk, blk * 4) == 0,
                          "trial %d block %u decode differs", tr, bi);
        }
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(dp);
        cudaFree(dout);
        free(k);
        free(v);
        free(gp);
        free(ref);
        free(dec);
        free(rdec);
    }
}
END_TEST

START_TEST(test_gpu_decode_equals_cpu)
{
    static const uint32_t dims[] = {128, 96, 64, 129};
    rng_state = tqkv_test_seed() ^ 0x202;
    for (int tr = 0; tr < FULL(16, 8); tr++) {
        tqkv_block_shape_t s = {1 + (uint32_t)(tqkv_test_rand(&rng_state) % 70),
                                1 + (uint32_t)(tqkv_test_rand(&rng_state) % 4), dims[tr % 4]};
        tqkv_block_codec_t c;
        size_t n = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim, cap, w;
        random_codec(&c, tr);
        if (!c.v.bits_x2)
            c.v.bits_x2 = 5;
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
        tqkv_test_kv_loud(&rng_state, k, s.num_tokens, s.num_kv_heads, s.head_dim, -0.3);
        tqkv_test_kv_loud(&rng_state, v, s.num_tokens, s.num_kv_heads, s.head_dim, 0.0);
        ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
        uint8_t *page = malloc(cap);
        ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, k, v, page, cap, &w, NULL, 0), TQKV_OK);
        float *rk = malloc(n * 4), *rv = malloc(n * 4), *gk = malloc(n * 4), *gv = malloc(n * 4);
        uint16_t *gkh = malloc(n * 2);
        ck_assert_int_eq(tqkv_page_decode_f32_ref(page, w, rk, rv), TQKV_OK);
        void *dp = dev_copy_of(page, w), *dk, *dv, *dkh;
        CU(cudaMalloc(&dk, n * 4));
        CU(cudaMalloc(&dv, n * 4));
        CU(cudaMalloc(&dkh, n * 2));
        ck_assert_int_eq(tqkv_cuda_page_decode_f32((const tqkv_page_header_t *)page, dp, dk, dv, 0),
                         TQKV_OK);
        ck_assert_int_eq(
            tqkv_cuda_page_decode_bf16((const tqkv_page_header_t *)page, dp, dkh, NULL, 0),
            TQKV_OK);
        CU(cudaMemcpy(gk, dk, n * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(gv, dv, n * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(gkh, dkh, n * 2, cudaMemcpyDeviceToHost));
        ck_assert_msg(memcmp(rk, gk, n * 4) == 0, "trial %d: K decode differs", tr);
        ck_assert_msg(memcmp(rv, gv, n * 4) == 0, "trial %d: V decode differs", tr);
        for (size_t i = 0; i < n; i++)
            ck_assert_uint_eq(gkh[i], tqkv_f32_to_bf16_sat(rk[i]));
        /* an inconsistent header is refused */
        tqkv_page_header_t bad = *(const tqkv_page_header_t *)page;
        bad.tensor[0].group_offset[0] += 64;
        ck_assert_int_eq(tqkv_cuda_page_decode_f32(&bad, dp, dk, dv, 0), TQKV_EFORMAT);
        cudaFree(dp);
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(dkh);
        free(k);
        free(v);
        free(page);
        free(rk);
        free(rv);
        free(gk);
        free(gv);
        free(gkh);
    }
}
END_TEST

START_TEST(test_gpu_encode_nonfinite_is_refused)
{
    tqkv_block_shape_t s = {9, 2, 64};
    tqkv_block_codec_t c;
    uint16_t k[9 * 2 * 64], v[9 * 2 * 64];
    size_t len;
    tqkv_status_t st;
    rng_state = tqkv_test_seed() ^ 0x303;
    random_codec(&c, 1);
    c.v.bits_x2 = 6;
    tqkv_test_kv_loud(&rng_state, k, 9, 2, 64, 0);
    tqkv_test_kv_loud(&rng_state, v, 9, 2, 64, 0);
    v[tqkv_test_rand(&rng_state) % (9 * 2 * 64)] = 0x7fc0; /* NaN */
    uint8_t *p = gpu_encode(&s, &c, k, v, &len, &st);
    ck_assert_int_eq(st, TQKV_ERANGE);
    ck_assert_int_ne(tqkv_page_validate(p, len, 1, NULL, NULL, 0), TQKV_OK);
    free(p);
    /* too small a buffer */
    void *dp;
    CU(cudaMalloc(&dp, 64));
    ck_assert_int_eq(tqkv_cuda_page_encode(&s, &c, (uint16_t *)dp, (uint16_t *)dp, dp, 64, &len, 0),
                     TQKV_ENOSPC);
    cudaFree(dp);
}
END_TEST

static double
max_abs(const float *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

/* Fused attention over packed pages (GPU) vs tqkv_attn_decode_ref (CPU). */
START_TEST(test_gpu_attention_packed_vs_cpu)
{
    static const struct {
        uint8_t kb, km, vb, vm, rot, ctr;
        uint32_t D, H, HQ, T, npages;
    } cases[] = {
        {7, 0, 6, 0, TQKV_ROT_HADAMARD, 1, 128, 2, 8, 64, 5},
        {5, 0, 4, 0, TQKV_ROT_HADAMARD, 0, 128, 1, 1, 256, 3},
        {8, 1, 6, 1, TQKV_ROT_DENSE, 1, 96, 3, 6, 17, 4},
        {6, 0, 7, 0, TQKV_ROT_HADAMARD, 0, 64, 2, 10, 1500, 2}, /* > SPLIT_TOKENS */
        {8, 0, 6, 1, TQKV_ROT_HADAMARD, 1, 1024, 1, 4, 40, 2},  /* big tables: 2 q heads/block */
    };
    rng_state = tqkv_test_seed() ^ 0x404;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        tqkv_block_codec_t c;
        memset(&c, 0, sizeof c);
        c.k.bits_x2 = cases[ci].kb;
        c.k.mode = cases[ci].km;
        c.v.bits_x2 = cases[ci].vb;
        c.v.mode = cases[ci].vm;
        c.rotation = cases[ci].rot;
        c.key_centering = cases[ci].ctr;
        c.seed = tqkv_test_rand(&rng_state);
        uint32_t D = cases[ci].D, H = cases[ci].H, HQ = cases[ci].HQ, np = cases[ci].npages;
        void **pages = calloc(np, sizeof *pages), **dpages = calloc(np, sizeof *dpages);
        size_t *lens = calloc(np, sizeof *lens);
        for (uint32_t p = 0; p < np; p++) {
            tqkv_block_shape_t s = {p + 1 == np ? 1 + cases[ci].T / 3 : cases[ci].T, H, D};
            size_t n = (size_t)s.num_tokens * H * D, cap;
            uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
            tqkv_test_kv_loud(&rng_state, k, s.num_tokens, H, D, 0.5);
            tqkv_test_kv_loud(&rng_state, v, s.num_tokens, H, D, 0.0);
            ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
            pages[p] = malloc(cap);
            ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, k, v, pages[p], cap, &lens[p], NULL, 0),
                             TQKV_OK);
            dpages[p] = dev_copy_of(pages[p], lens[p]);
            free(k);
            free(v);
        }
        float *q = malloc(sizeof(float) * HQ * D), *ref = malloc(sizeof(float) * HQ * D);
        float *out = malloc(sizeof(float) * HQ * D);
        for (uint32_t i = 0; i < HQ * D; i++)
            q[i] = (float)tqkv_test_gauss(&rng_state);
        ck_assert_int_eq(
            tqkv_attn_decode_ref(q, HQ, (const void *const *)pages, lens, np, NULL, ref), TQKV_OK);
        const tqkv_page_header_t *h0 = (const tqkv_page_header_t *)pages[0];
        uint32_t splits = tqkv_cuda_attention_packed_splits(h0, np);
        size_t wb = tqkv_cuda_attention_workspace(splits, HQ, D);
        void *dq = dev_copy_of(q, sizeof(float) * HQ * D), *dout, *dwork;
        void *dptrs = dev_copy_of(dpages, np * sizeof(void *));
        CU(cudaMalloc(&dout, sizeof(float) * HQ * D));
        CU(cudaMalloc(&dwork, wb));
        ck_assert_int_eq(tqkv_cuda_attention_packed(h0, (const void *const *)dptrs, np, dq, HQ,
                                                    0.0f, dout, dwork, wb, 0),
                         TQKV_OK);
        CU(cudaMemcpy(out, dout, sizeof(float) * HQ * D, cudaMemcpyDeviceToHost));
        double scale = max_abs(ref, (size_t)HQ * D), worst = 0;
        for (uint32_t i = 0; i < HQ * D; i++)
            worst = fmax(worst, fabs(out[i] - ref[i]));
        ck_assert_msg(worst <= 2e-3 * scale, "case %zu: max |gpu - cpu| = %g (scale %g)", ci, worst,
                      scale);
        for (uint32_t p = 0; p < np; p++) {
            free(pages[p]);
            cudaFree(dpages[p]);
        }
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dwork);
        cudaFree(dptrs);
        free(pages);
        free(dpages);
        free(lens);
        free(q);
        free(ref);
        free(out);
    }
}
END_TEST

/* BF16 baseline (GPU) vs tqkv_attn_bf16_ref (CPU), vector and scalar paths. */
START_TEST(test_gpu_attention_bf16_vs_cpu)
{
    static const uint32_t shapes[][4] = {{1, 1, 1, 128},
                                         {7, 2, 8, 128},
                                         {FULL(1000, 200), FULL(8, 2), FULL(32, 8), 128},
                                         {333, 3, 3, 96},
                                         {70, 1, 12, 16}};
    rng_state = tqkv_test_seed() ^ 0x505;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        uint32_t T = shapes[si][0], H = shapes[si][1], HQ = shapes[si][2], D = shapes[si][3];
        size_t n = (size_t)T * H * D;
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
        float *q = malloc(sizeof(float) * HQ * D), *ref = malloc(sizeof(float) * HQ * D);
        float *out = malloc(sizeof(float) * HQ * D);
        tqkv_test_kv_loud(&rng_state, k, T, H, D, 0.3);
        tqkv_test_kv_loud(&rng_state, v, T, H, D, 0.0);
        for (uint32_t i = 0; i < HQ * D; i++)
            q[i] = (float)tqkv_test_gauss(&rng_state);
        ck_assert_int_eq(tqkv_attn_bf16_ref(q, HQ, k, v, T, H, D, ref), TQKV_OK);
        uint32_t splits = tqkv_cuda_attention_bf16_splits(T, H);
        size_t wb = tqkv_cuda_attention_workspace(splits, HQ, D);
        void *dk = dev_copy_of(k, n * 2), *dv = dev_copy_of(v, n * 2);
        void *dq = dev_copy_of(q, sizeof(float) * HQ * D), *dout, *dwork;
        CU(cudaMalloc(&dout, sizeof(float) * HQ * D));
        CU(cudaMalloc(&dwork, wb));
        ck_assert_int_eq(
            tqkv_cuda_attention_bf16(dk, dv, T, H, D, dq, HQ, 0.0f, dout, dwork, wb, 0), TQKV_OK);
        CU(cudaMemcpy(out, dout, sizeof(float) * HQ * D, cudaMemcpyDeviceToHost));
        double scale = max_abs(ref, (size_t)HQ * D), worst = 0;
        for (uint32_t i = 0; i < HQ * D; i++)
            worst = fmax(worst, fabs(out[i] - ref[i]));
        ck_assert_msg(worst <= 2e-3 * scale, "shape %zu: max |gpu - cpu| = %g (scale %g)", si,
                      worst, scale);
        ck_assert_int_eq(
            tqkv_cuda_attention_bf16(dk, dv, T, H, D, dq, HQ, 0.0f, dout, dwork, wb - 1, 0),
            TQKV_EINVAL); /* workspace too small */
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dwork);
        free(k);
        free(v);
        free(q);
        free(ref);
        free(out);
    }
}
END_TEST

START_TEST(test_gpu_device_pool)
{
    tqkv_pool_t *p;
    void *a[64];
    size_t la[64];
    uint8_t buf[5000], back[5000];
    rng_state = tqkv_test_seed() ^ 0x606;
    ck_assert_int_eq(tqkv_pool_create_device(0, 1 << 20, &p), TQKV_OK);
    ck_assert(tqkv_pool_is_device(p));
    ck_assert_uint_eq(tqkv_pool_capacity(p), 1 << 20);
    int n = 0;
    for (; n < 64; n++) {
        la[n] = 1 + tqkv_test_rand(&rng_state) % sizeof buf;
        tqkv_status_t st = tqkv_pool_alloc(p, la[n], &a[n]);
        if (st == TQKV_ENOSPC)
            break;
        ck_assert_int_eq(st, TQKV_OK);
        ck_assert_uint_eq((uintptr_t)a[n] % TQKV__SUBALLOC_ALIGN, 0);
        for (size_t i = 0; i < la[n]; i++)
            buf[i] = (uint8_t)(tqkv_test_rand(&rng_state) ^ (uint64_t)n);
        ck_assert_int_eq(tqkv_pool_copy_in(p, a[n], buf, la[n]), TQKV_OK);
        memset(back, 0, sizeof back);
        ck_assert_int_eq(tqkv_pool_copy_out(p, back, a[n], la[n]), TQKV_OK);
        ck_assert_mem_eq(back, buf, la[n]);
    }
    ck_assert_uint_eq(tqkv__pool_live_allocs(p), (uint64_t)n);
    /* a copy outside the pool is refused */
    ck_assert_int_eq(tqkv_pool_copy_in(p, (uint8_t *)a[0] + (1 << 21), buf, 16), TQKV_EINVAL);
    /* fill to ENOSPC, free everything, allocate the whole capacity in one piece */
    void *big;
    ck_assert_int_eq(tqkv_pool_alloc(p, (1 << 20) + 1, &big), TQKV_ENOSPC);
    for (int i = 0; i < n; i++)
        tqkv_pool_free(p, a[i], la[i]);
    ck_assert_uint_eq(tqkv__pool_live_allocs(p), 0);
    ck_assert_uint_eq(tqkv_pool_used(p), 0);
    ck_assert_int_eq(tqkv_pool_alloc(p, 1 << 20, &big), TQKV_OK);
    tqkv_pool_free(p, big, 1 << 20);
    tqkv_pool_destroy(p);
    ck_assert_int_eq(tqkv_pool_create_device(1 << 20, 4096, &p), TQKV_ENODEV);
}
END_TEST

/* A store with a real HBM tier: pages go to the device pool, demote to DRAM when it
 * fills, and come back byte for byte (promotion on access moves them up again). */
START_TEST(test_gpu_store_hbm_tier)
{
    tqkv_store_config_t cfg;
    tqkv_store_t *s;
    enum { NP = 48, LEN = 8192 };
    static uint8_t pages[NP][LEN];
    uint8_t hash[NP][8];
    rng_state = tqkv_test_seed() ^ 0x707;
    tqkv_store_config_default(&cfg);
    cfg.dram_capacity = 4u << 20;
    cfg.hbm_capacity = 16 * LEN;
    cfg.device = 0;
    cfg.hbm_standin = 0;
    cfg.promote_on_access = 1;
    cfg.verify_crc = 0;
    ck_assert_int_eq(tqkv_store_create(&cfg, &s), TQKV_OK);
    ck_assert(tqkv_pool_is_device(tqkv__store_pool(s, TQKV_TIER_HBM)));
    for (int i = 0; i < NP; i++) {
        for (int j = 0; j < LEN; j++)
            pages[i][j] = (uint8_t)tqkv_test_rand(&rng_state);
        for (int j = 0; j < 8; j++)
            hash[i][j] = (uint8_t)(j == 0 ? i : 0xa0 + j); /* unique per page */
        tqkv_block_key_t key = {"gpu", 3, hash[i], 8, 0};
        int dup = 0;
        ck_assert_int_eq(tqkv_store_put(s, &key, i ? hash[i - 1] : NULL, i ? 8 : 0, pages[i], LEN,
                                        4 * LEN, &dup),
                         TQKV_OK);
        ck_assert_int_eq(dup, 0);
        tqkv__store_maintain(s);
    }
    tqkv_store_stats_t st;
    ck_assert_int_eq(tqkv_store_stats(s, NULL, 0, &st), TQKV_OK);
    ck_assert_uint_gt(st.tier[TQKV_TIER_HBM].pages, 0);
    ck_assert_uint_gt(st.tier[TQKV_TIER_DRAM].pages, 0);
    ck_assert_uint_le(st.tier[TQKV_TIER_HBM].bytes_used, cfg.hbm_capacity);
    ck_assert_uint_gt(st.tier[TQKV_TIER_HBM].demotions, 0);
    int seen_hbm = 0;
    for (int i = 0; i < NP; i++) {
        tqkv_block_key_t key = {"gpu", 3, hash[i], 8, 0};
        tqkv_page_ref_t *r;
        ck_assert_int_eq(tqkv_store_get(s, &key, &r), TQKV_OK);
        ck_assert_uint_eq(tqkv_page_ref_len(r), LEN);
        ck_assert_mem_eq(tqkv_page_ref_data(r), pages[i], LEN);
        seen_hbm |= tqkv_page_ref_tier(r) == TQKV_TIER_HBM;
        tqkv_page_ref_release(r);
        tqkv__store_maintain(s);
    }
    ck_assert(seen_hbm);
    ck_assert_int_eq(tqkv_store_stats(s, NULL, 0, &st), TQKV_OK);
    ck_assert_uint_gt(st.tier[TQKV_TIER_DRAM].promotions, 0); /* promote_on_access */
    ck_assert_int_eq(tqkv__store_check(s), TQKV_OK);
    tqkv_store_destroy(s);
}
END_TEST

static Suite *
gpu_suite(void)
{
    Suite *s = suite_create("gpu");
    TCase *tc = tcase_create("cuda");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_gpu_page_equals_cpu_reference);
    tcase_add_test(tc, test_gpu_batch_equals_cpu_reference);
    tcase_add_test(tc, test_gpu_decode_equals_cpu);
    tcase_add_test(tc, test_gpu_encode_nonfinite_is_refused);
    tcase_add_test(tc, test_gpu_attention_packed_vs_cpu);
    tcase_add_test(tc, test_gpu_attention_bf16_vs_cpu);
    tcase_add_test(tc, test_gpu_device_pool);
    tcase_add_test(tc, test_gpu_store_hbm_tier);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    int n = 0;
    if (tqkv_cuda_device_count(&n) != TQKV_OK || n == 0) {
        fprintf(stderr, "check_gpu: no CUDA device: skipped\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(gpu_suite());
    /* no fork: a CUDA context does not survive fork() */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
