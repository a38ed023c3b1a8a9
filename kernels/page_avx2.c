/* page_avx2.c - AVX2/FMA/BMI2 encode and decode of whole-head Hadamard mse groups.
 *
 * Per row: BF16 -> f32 (shift), sum of squares (FMA), D1, FWHT, D2, FWHT, then the
 * coordinates are scaled straight into the z domain (y * sqrt(g) = w / (sqrt(g) s)),
 * compared against the thresholds (count of thresholds below, the near-tie rule of
 * tqkv_nearest_index) and packed 8 indices at a time with PEXT into `bits` bytes,
 * the LSB-first stream of the format. The FWHT butterflies are the same a+c / a-c
 * operations in the same order as tqkv_fwht, so only the norm and scaling steps round
 * differently from the reference (near-ties only). Decode mirrors it with PDEP and a
 * register permute for the codebook lookup.
 */
#include <immintrin.h>
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "kernels/page.h"

/* In-place FWHT of v[nv] (g = 8 nv floats). With nv a constant after inlining the
 * loops unroll and v stays in registers (g = 128: 16 ymm). */
static inline __attribute__((always_inline)) void
fwht_avx2(__m256 *v, const uint32_t nv)
{
#pragma GCC unroll 16
    for (uint32_t j = 0; j < nv; j++) {
        __m256 x = v[j], b;
        b = _mm256_permute_ps(x, 0xB1);
        x = _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xAA);
        b = _mm256_permute_ps(x, 0x4E);
        x = _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xCC);
        b = _mm256_permute2f128_ps(x, x, 1);
        v[j] = _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xF0);
    }
#pragma GCC unroll 8
    for (uint32_t h = 1; h < nv; h <<= 1)
#pragma GCC unroll 16
        for (uint32_t i = 0; i < nv; i += 2 * h)
#pragma GCC unroll 16
            for (uint32_t j = i; j < i + h; j++) {
                __m256 x = v[j], c = v[j + h];
                v[j] = _mm256_add_ps(x, c);
                v[j + h] = _mm256_sub_ps(x, c);
            }
}

static inline float
hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline __m256
load_bf16(const uint16_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The `bits` bytes holding 8 packed indices, without a store-forwarding stall. */
static inline uint64_t
load_bits(const uint8_t *p, uint32_t bits)
{
    uint16_t h;
    uint32_t w;
    switch (bits) {
    case 1:
        return p[0];
    case 2:
        memcpy(&h, p, 2);
        return h;
    case 3:
        memcpy(&h, p, 2);
        return h | (uint64_t)p[2] << 16;
    default:
        memcpy(&w, p, 4);
        return w;
    }
}

static const uint64_t lane_mask[5] = {0, 0x0101010101010101ull, 0x0303030303030303ull,
                                      0x0707070707070707ull, 0x0f0f0f0f0f0f0f0full};

/* Bodies take `bits` as a compile-time constant after inlining (see the switches). */
static inline __attribute__((always_inline)) size_t
enc_body(const tqkv__enc_rows_t *A, const uint32_t g, const uint32_t bits)
{
    const uint16_t *x = A->x;
    const float *signs = A->signs, *z = A->z, *thr = A->thr, *mu = A->mu;
    const size_t n = A->n;
    const int norm_corrected = A->norm_corrected;
    __m256 v[TQKV_PAGE_MAX_DIM / 8];
    const uint32_t nv = g / 8;
    const uint32_t nthr = (1u << bits) - 1;
    const uint64_t pmask = lane_mask[bits];
    const float sg = sqrtf((float)g);
    __m256 tv[15];
    __m256 zlo = _mm256_loadu_ps(z), zhi = bits == 4 ? _mm256_loadu_ps(z + 8) : zlo;

    for (uint32_t t = 0; t < nthr; t++)
        tv[t] = _mm256_set1_ps(thr[t]);
    for (size_t i = 0; i < n; i++) {
        const uint16_t *xr = x + i * A->x_stride;
        uint8_t *out = A->idx + i * A->idx_stride;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), zacc = _mm256_setzero_ps();
        float ss, s, k;
#pragma GCC unroll 8
        for (uint32_t j = 0; j < g; j += 16) {
            __m256 a = load_bf16(xr + j), b = load_bf16(xr + j + 8);
            if (mu) {
                a = _mm256_sub_ps(a, _mm256_loadu_ps(mu + j));
                b = _mm256_sub_ps(b, _mm256_loadu_ps(mu + j + 8));
            }
            acc0 = _mm256_fmadd_ps(a, a, acc0);
            acc1 = _mm256_fmadd_ps(b, b, acc1);
            v[j / 8] = _mm256_mul_ps(a, _mm256_loadu_ps(signs + j));
            v[j / 8 + 1] = _mm256_mul_ps(b, _mm256_loadu_ps(signs + j + 8));
        }
        ss = hsum(_mm256_add_ps(acc0, acc1));
        if (!(ss >= 1e-30f && ss <= 1e36f))
            return i;
        fwht_avx2(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++)
            v[j] = _mm256_mul_ps(v[j], _mm256_loadu_ps(signs + g + 8 * j));
        fwht_avx2(v, nv);
        s = sqrtf(ss);
        k = 1.0f / (sg * s);
        const __m256 kv = _mm256_set1_ps(k);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < g; j += 8) {
            __m256 y = _mm256_mul_ps(v[j / 8], kv);
            __m256i cnt = _mm256_setzero_si256();
            for (uint32_t t = 0; t < nthr; t++)
                cnt =
                    _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(y, tv[t], _CMP_GT_OQ)));
            if (norm_corrected) {
                __m256 zv = _mm256_permutevar8x32_ps(zlo, cnt);
                if (bits == 4)
                    zv = _mm256_blendv_ps(
                        zv, _mm256_permutevar8x32_ps(zhi, cnt),
                        _mm256_castsi256_ps(_mm256_cmpgt_epi32(cnt, _mm256_set1_epi32(7))));
                zacc = _mm256_fmadd_ps(zv, zv, zacc);
            }
            /* 8 x int32 -> 8 bytes -> PEXT the low `bits` of each byte */
            __m128i lo = _mm256_castsi256_si128(cnt), hi = _mm256_extracti128_si256(cnt, 1);
            __m128i b16 = _mm_packus_epi32(lo, hi);
            __m128i b8 = _mm_packus_epi16(b16, b16);
            uint64_t packed = _pext_u64((uint64_t)_mm_cvtsi128_si64(b8), pmask);
            memcpy(out + (j / 8) * bits, &packed, bits);
        }
        if (norm_corrected) {
            float zn2 = hsum(zacc);
            A->scale[i * A->scale_stride] = zn2 > 0 ? s / sqrtf(zn2) : s / sg;
        } else {
            A->scale[i * A->scale_stride] = s / sg;
        }
    }
    return n;
}

static inline __attribute__((always_inline)) void
dec_body(const tqkv__dec_rows_t *A, const uint32_t g, const uint32_t bits)
{
    const float *signs = A->signs, *z = A->z, *mu = A->mu;
    float *out_f = A->out_f;
    uint16_t *out_h = A->out_h;
    const size_t n = A->n, os = A->out_stride;
    __m256 v[TQKV_PAGE_MAX_DIM / 8];
    const uint32_t nv = g / 8;
    const uint64_t pmask = lane_mask[bits];
    const __m256 zlo = _mm256_loadu_ps(z), zhi = bits == 4 ? _mm256_loadu_ps(z + 8) : zlo;
    const __m256 fmax = _mm256_set1_ps(FLT_MAX), fmin = _mm256_set1_ps(-FLT_MAX);
    const float inv = 1.0f / (float)g;

    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = A->idx + i * A->idx_stride;
        const __m256 c = _mm256_set1_ps(A->scale[i * A->scale_stride] * inv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < g; j += 8) {
            uint64_t w = load_bits(row + (j / 8) * bits, bits);
            __m256i iv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)_pdep_u64(w, pmask)));
            __m256 zv = _mm256_permutevar8x32_ps(zlo, iv);
            if (bits == 4)
                zv = _mm256_blendv_ps(
                    zv, _mm256_permutevar8x32_ps(zhi, iv),
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(iv, _mm256_set1_epi32(7))));
            v[j / 8] = zv;
        }
        fwht_avx2(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++)
            v[j] = _mm256_mul_ps(v[j], _mm256_loadu_ps(signs + g + 8 * j));
        fwht_avx2(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < g; j += 8) {
            __m256 o = _mm256_mul_ps(_mm256_mul_ps(v[j / 8], c), _mm256_loadu_ps(signs + j));
            if (mu)
                o = _mm256_add_ps(o, _mm256_loadu_ps(mu + j));
            o = _mm256_min_ps(_mm256_max_ps(o, fmin), fmax);
            if (out_f)
                _mm256_storeu_ps(out_f + i * os + j, o);
            if (out_h) {
                /* f32 -> bf16, round to nearest even, saturating at +-max finite */
                __m256i u = _mm256_castps_si256(o);
                __m256i r =
                    _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                          _mm256_set1_epi32(1))));
                r = _mm256_srli_epi32(r, 16);
                __m256i mag = _mm256_min_epu32(_mm256_and_si256(r, _mm256_set1_epi32(0x7fff)),
                                               _mm256_set1_epi32(0x7f7f));
                r = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0x8000)), mag);
                __m128i p16 =
                    _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
                _mm_storeu_si128((__m128i *)(out_h + i * os + j), p16);
            }
        }
    }
}

/* Specialized for head_dim 128 (the common case: the FWHT stays in 16 registers) and
 * each bit width; other power-of-two dims take the generic-g bodies. */
#define TQKV__BITS_SWITCH(CALL, G)                                                                 \
    switch (bits) {                                                                                \
    case 1:                                                                                        \
        CALL(G, 1);                                                                                \
    case 2:                                                                                        \
        CALL(G, 2);                                                                                \
    case 3:                                                                                        \
        CALL(G, 3);                                                                                \
    default:                                                                                       \
        CALL(G, 4);                                                                                \
    }

size_t
tqkv__page_enc_had_avx2(const tqkv__enc_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
#define ENC(G, B) return enc_body(a, G, B)
    if (g == 128)
        TQKV__BITS_SWITCH(ENC, 128)
    TQKV__BITS_SWITCH(ENC, g)
#undef ENC
}

void
tqkv__page_dec_had_avx2(const tqkv__dec_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
#define DEC(G, B)                                                                                  \
    dec_body(a, G, B);                                                                             \
    return
    if (g == 128)
        TQKV__BITS_SWITCH(DEC, 128)
    TQKV__BITS_SWITCH(DEC, g)
#undef DEC
}
