/* page_avx512.c - AVX-512 encode and decode of whole-head Hadamard mse groups.
 *
 * The AVX2 kernels (page_avx2.c) on 16-lane registers: a head of 128 channels is 8 zmm
 * registers, the FWHT never leaves them (32 registers), the 16-entry codebook lookup is
 * one vpermps, and comparisons count into mask registers. Same contract, same rounding
 * structure (FWHT butterflies in the order of tqkv_fwht), hence the same near-tie-only
 * differences from the reference. 3- and 4-bit indices come from a binary search over
 * a threshold register (same counts).
 *
 * Dense-rotation groups (rotation.h: tqkv__page_enc/dec_dense_avx512) multiply blocks of
 * 4 rows by the matrix, 96 columns (24 accumulators) at a time, each matrix row loaded
 * once per block; tqkv__rows_matmul_avx512 is the same product for prod's QJL term.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/simd_x86.h"
#include "kernels/tq_math.h"

/* In-place FWHT of v[nv] (g = 16 nv floats). */
static inline __attribute__((always_inline)) void
fwht512(__m512 *v, const uint32_t nv)
{
#pragma GCC unroll 16
    for (uint32_t j = 0; j < nv; j++) {
        __m512 x = v[j], b;
        b = _mm512_permute_ps(x, 0xB1);
        x = _mm512_mask_blend_ps(0xAAAA, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
        b = _mm512_permute_ps(x, 0x4E);
        x = _mm512_mask_blend_ps(0xCCCC, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
        b = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1));
        x = _mm512_mask_blend_ps(0xF0F0, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
        b = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2));
        v[j] = _mm512_mask_blend_ps(0xFF00, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
    }
#pragma GCC unroll 8
    for (uint32_t h = 1; h < nv; h <<= 1)
#pragma GCC unroll 16
        for (uint32_t i = 0; i < nv; i += 2 * h)
#pragma GCC unroll 16
            for (uint32_t j = i; j < i + h; j++) {
                __m512 x = v[j], c = v[j + h];
                v[j] = _mm512_add_ps(x, c);
                v[j + h] = _mm512_sub_ps(x, c);
            }
}

static const uint64_t lane_mask[5] = {0, 0x0101010101010101ull, 0x0303030303030303ull,
                                      0x0707070707070707ull, 0x0f0f0f0f0f0f0f0full};

/* The 2 * bits bytes holding 16 packed indices. */
static inline uint64_t
load_bits16(const uint8_t *p, uint32_t bits)
{
    uint16_t h;
    uint32_t w;
    uint64_t q;
    switch (bits) {
    case 1:
        memcpy(&h, p, 2);
        return h;
    case 2:
        memcpy(&w, p, 4);
        return w;
    case 3:
        memcpy(&w, p, 4);
        memcpy(&h, p + 4, 2);
        return w | (uint64_t)h << 32;
    default:
        memcpy(&q, p, 8);
        return q;
    }
}

static inline void
store_bits16(uint8_t *p, uint64_t v, uint32_t bits)
{
    uint16_t h;
    uint32_t w;
    switch (bits) {
    case 1:
        h = (uint16_t)v;
        memcpy(p, &h, 2);
        break;
    case 2:
        w = (uint32_t)v;
        memcpy(p, &w, 4);
        break;
    case 3:
        w = (uint32_t)v;
        h = (uint16_t)(v >> 32);
        memcpy(p, &w, 4);
        memcpy(p + 4, &h, 2);
        break;
    default:
        memcpy(p, &v, 8);
    }
}

/* The index of each coordinate y among the ascending thresholds: the count of thresholds
 * below it (tqkv_nearest_index: y > thr). 3 and 4 bits as a binary search over the
 * threshold register thrv (unused lanes +inf), which gives the same count in bits steps
 * instead of 2^bits - 1 comparisons; 1 and 2 bits count against the broadcasts tv. */
static inline __attribute__((always_inline)) __m512i
quant_idx(__m512 y, const __m512 *tv, __m512 thrv, const uint32_t bits)
{
    __m512i idx = _mm512_setzero_si512();
    if (bits >= 3) {
        for (uint32_t step = 1u << (bits - 1); step; step >>= 1) {
            const __m512 t = _mm512_permutexvar_ps(
                _mm512_add_epi32(idx, _mm512_set1_epi32((int)step - 1)), thrv);
            idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(y, t, _CMP_GT_OQ), idx,
                                        _mm512_set1_epi32((int)step));
        }
        return idx;
    }
    for (uint32_t t = 0; t < (1u << bits) - 1; t++)
        idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(y, tv[t], _CMP_GT_OQ), idx,
                                    _mm512_set1_epi32(1));
    return idx;
}

static inline __attribute__((always_inline)) size_t
enc_body(const tqkv__enc_rows_t *A, const uint32_t g, const uint32_t bits)
{
    const uint16_t *x = A->x;
    const float *signs = A->signs, *z = A->z, *thr = A->thr, *mu = A->mu;
    const size_t n = A->n;
    const int norm_corrected = A->norm_corrected;
    __m512 v[TQKV_PAGE_MAX_DIM / 16];
    const uint32_t nv = g / 16, nthr = (1u << bits) - 1;
    const uint64_t pmask = lane_mask[bits];
    const float sg = sqrtf((float)g);
    const __m512 zv16 = _mm512_loadu_ps(z);
    __m512 tv[15];

    float thr16[16];
    for (uint32_t t = 0; t < 16; t++)
        thr16[t] = t < nthr ? thr[t] : INFINITY;
    const __m512 thrv = _mm512_loadu_ps(thr16);
    for (uint32_t t = 0; t < nthr; t++)
        tv[t] = _mm512_set1_ps(thr[t]);
    for (size_t i = 0; i < n; i++) {
        const uint16_t *xr = x + i * A->x_stride;
        uint8_t *out = A->idx + i * A->idx_stride;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
        float ss, s;
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++) {
            __m512 a = tqkv__load_bf16x16(xr + 16 * j);
            if (mu)
                a = _mm512_sub_ps(a, _mm512_loadu_ps(mu + 16 * j));
            if (j & 1)
                acc1 = _mm512_fmadd_ps(a, a, acc1);
            else
                acc0 = _mm512_fmadd_ps(a, a, acc0);
            v[j] = _mm512_mul_ps(a, _mm512_loadu_ps(signs + 16 * j));
        }
        ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        if (!(ss >= 1e-30f && ss <= 1e36f))
            return i;
        fwht512(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++)
            v[j] = _mm512_mul_ps(v[j], _mm512_loadu_ps(signs + g + 16 * j));
        fwht512(v, nv);
        s = sqrtf(ss);
        const __m512 kv = _mm512_set1_ps(1.0f / (sg * s));
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++) {
            __m512 y = _mm512_mul_ps(v[j], kv);
            __m512i cnt = quant_idx(y, tv, thrv, bits);
            if (norm_corrected) {
                __m512 zq = _mm512_permutexvar_ps(cnt, zv16);
                zacc = _mm512_fmadd_ps(zq, zq, zacc);
            }
            /* 16 x int32 -> 16 bytes -> PEXT the low `bits` of each byte, 2 x 8 */
            __m128i b8 = _mm512_cvtepi32_epi8(cnt);
            uint64_t lo = _pext_u64((uint64_t)_mm_cvtsi128_si64(b8), pmask);
            uint64_t hi = _pext_u64((uint64_t)_mm_extract_epi64(b8, 1), pmask);
            store_bits16(out + j * 2 * bits, lo | hi << (8 * bits), bits);
        }
        float zn2 = norm_corrected ? _mm512_reduce_add_ps(zacc) : 0.0f;
        A->scale[i * A->scale_stride] = tqkv__row_scale(s, sg, norm_corrected, zn2);
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
    __m512 v[TQKV_PAGE_MAX_DIM / 16];
    const uint32_t nv = g / 16;
    const uint64_t pmask = lane_mask[bits];
    const uint64_t lowmask = bits == 4 ? ~0ull : ((1ull << (8 * bits)) - 1);
    const __m512 zv16 = _mm512_loadu_ps(z);
    const __m512 fmax = _mm512_set1_ps(FLT_MAX), fmin = _mm512_set1_ps(-FLT_MAX);
    const float inv = 1.0f / (float)g;

    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = A->idx + i * A->idx_stride;
        const __m512 c = _mm512_set1_ps(tqkv_scale_get(A->scale, i * A->scale_stride) * inv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++) {
            uint64_t w = load_bits16(row + j * 2 * bits, bits);
            uint64_t lo = _pdep_u64(w & lowmask, pmask), hi = _pdep_u64(w >> (8 * bits), pmask);
            __m512i iv = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)hi, (long long)lo));
            v[j] = _mm512_permutexvar_ps(iv, zv16);
        }
        fwht512(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++)
            v[j] = _mm512_mul_ps(v[j], _mm512_loadu_ps(signs + g + 16 * j));
        fwht512(v, nv);
#pragma GCC unroll 16
        for (uint32_t j = 0; j < nv; j++) {
            __m512 o = _mm512_mul_ps(_mm512_mul_ps(v[j], c), _mm512_loadu_ps(signs + 16 * j));
            if (mu)
                o = _mm512_add_ps(o, _mm512_loadu_ps(mu + 16 * j));
            o = _mm512_min_ps(_mm512_max_ps(o, fmin), fmax);
            if (out_f)
                _mm512_storeu_ps(out_f + i * os + 16 * j, o);
            if (out_h) {
                /* f32 -> bf16, round to nearest even, saturating at +-max finite */
                __m512i u = _mm512_castps_si512(o);
                __m512i r =
                    _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                          _mm512_set1_epi32(1))));
                r = _mm512_srli_epi32(r, 16);
                __m512i mag = _mm512_min_epu32(_mm512_and_si512(r, _mm512_set1_epi32(0x7fff)),
                                               _mm512_set1_epi32(0x7f7f));
                r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0x8000)), mag);
                _mm256_storeu_si256((__m256i *)(out_h + i * os + 16 * j), _mm512_cvtepi32_epi16(r));
            }
        }
    }
}

size_t
tqkv__page_enc_had_avx512(const tqkv__enc_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
#define ENC(G, B) return enc_body(a, G, B)
    TQKV__G_BITS_SWITCH(ENC)
#undef ENC
}

void
tqkv__page_dec_had_avx512(const tqkv__dec_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
#define DEC(G, B)                                                                                  \
    dec_body(a, G, B);                                                                             \
    return
    TQKV__G_BITS_SWITCH(DEC)
#undef DEC
}

/* ---- dense-rotation groups (rotation.h) ---- */

/* Y[r][c0 + j] = sum_i X[r][i] A[i][c0 + j] (i in order, from 0.f) for r < R and
 * j < 16 NK: each row of A loaded once per block of R rows. fma 0: separate multiply
 * and add (the rounding of tqkv_matvec / tqkv_matvec_t). */
static inline __attribute__((always_inline)) void
mm_block(const float *A, uint32_t g, uint32_t c0, const float *X, float *Y, const uint32_t R,
         const uint32_t NK, const int fma)
{
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; r++)
#pragma GCC unroll 6
        for (uint32_t k = 0; k < NK; k++)
            acc[r][k] = _mm512_setzero_ps();
    for (uint32_t i = 0; i < g; i++) {
        const float *a = A + (size_t)i * g + c0;
        __m512 av[6];
#pragma GCC unroll 6
        for (uint32_t k = 0; k < NK; k++)
            av[k] = _mm512_loadu_ps(a + 16 * k);
#pragma GCC unroll 4
        for (uint32_t r = 0; r < R; r++) {
            const __m512 b = _mm512_set1_ps(X[(size_t)r * g + i]);
#pragma GCC unroll 6
            for (uint32_t k = 0; k < NK; k++)
                acc[r][k] = fma ? _mm512_fmadd_ps(av[k], b, acc[r][k])
                                : _mm512_add_ps(acc[r][k], _mm512_mul_ps(av[k], b));
        }
    }
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; r++)
#pragma GCC unroll 6
        for (uint32_t k = 0; k < NK; k++)
            _mm512_storeu_ps(Y + (size_t)r * g + c0 + 16 * k, acc[r][k]);
}

/* Y[r] = X[r] A for r < R (<= 4) rows of g floats (g a multiple of 16). */
static void
mm_rows(const float *A, uint32_t g, const float *X, float *Y, uint32_t R, int fma)
{
    for (uint32_t c0 = 0; c0 < g; c0 += 96) {
        const uint32_t nk = (g - c0) / 16 < 6 ? (g - c0) / 16 : 6;
#define MM_NK(NK)                                                                                  \
    if (fma) {                                                                                     \
        if (R == 4)                                                                                \
            mm_block(A, g, c0, X, Y, 4, NK, 1);                                                    \
        else                                                                                       \
            for (uint32_t r = 0; r < R; r++)                                                       \
                mm_block(A, g, c0, X + (size_t)r * g, Y + (size_t)r * g, 1, NK, 1);                \
    } else {                                                                                       \
        if (R == 4)                                                                                \
            mm_block(A, g, c0, X, Y, 4, NK, 0);                                                    \
        else                                                                                       \
            for (uint32_t r = 0; r < R; r++)                                                       \
                mm_block(A, g, c0, X + (size_t)r * g, Y + (size_t)r * g, 1, NK, 0);                \
    }                                                                                              \
    break
        switch (nk) {
        case 1:
            MM_NK(1);
        case 2:
            MM_NK(2);
        case 3:
            MM_NK(3);
        case 4:
            MM_NK(4);
        case 5:
            MM_NK(5);
        default:
            MM_NK(6);
        }
#undef MM_NK
    }
}

static inline __attribute__((always_inline)) size_t
enc_dense_body(const tqkv__enc_rows_t *A, const float *mt, const uint32_t bits)
{
    const uint32_t g = A->g, nv = g / 16, nthr = (1u << bits) - 1;
    const float *z = A->z, *thr = A->thr, *mu = A->mu;
    const uint64_t pmask = lane_mask[bits];
    const float sg = sqrtf((float)g);
    const __m512 zv16 = _mm512_loadu_ps(z);
    float xb[4 * TQKV_PAGE_MAX_DIM], yb[4 * TQKV_PAGE_MAX_DIM], s[4];
    __m512 tv[15];

    float thr16[16];
    for (uint32_t t = 0; t < 16; t++)
        thr16[t] = t < nthr ? thr[t] : INFINITY;
    const __m512 thrv = _mm512_loadu_ps(thr16);
    for (uint32_t t = 0; t < nthr; t++)
        tv[t] = _mm512_set1_ps(thr[t]);
    for (size_t i = 0; i < A->n; i += 4) {
        uint32_t R = A->n - i < 4 ? (uint32_t)(A->n - i) : 4;
        int stop = 0;
        for (uint32_t r = 0; r < R; r++) {
            const uint16_t *xr = A->x + (i + r) * A->x_stride;
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            float ss;
            for (uint32_t j = 0; j < nv; j++) {
                __m512 a = tqkv__load_bf16x16(xr + 16 * j);
                if (mu)
                    a = _mm512_sub_ps(a, _mm512_loadu_ps(mu + 16 * j));
                if (j & 1)
                    acc1 = _mm512_fmadd_ps(a, a, acc1);
                else
                    acc0 = _mm512_fmadd_ps(a, a, acc0);
                _mm512_storeu_ps(xb + (size_t)r * g + 16 * j, a);
            }
            ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            if (!(ss >= 1e-30f && ss <= 1e36f)) { /* the caller encodes row i + r */
                R = r;
                stop = 1;
                break;
            }
            s[r] = sqrtf(ss);
        }
        mm_rows(mt, g, xb, yb, R, 1);
        for (uint32_t r = 0; r < R; r++) {
            uint8_t *out = A->idx + (i + r) * A->idx_stride;
            const __m512 kv = _mm512_set1_ps(sg / s[r]);
            __m512 zacc = _mm512_setzero_ps();
            for (uint32_t j = 0; j < nv; j++) {
                __m512 y = _mm512_mul_ps(_mm512_loadu_ps(yb + (size_t)r * g + 16 * j), kv);
                __m512i cnt = quant_idx(y, tv, thrv, bits);
                if (A->norm_corrected) {
                    __m512 zq = _mm512_permutexvar_ps(cnt, zv16);
                    zacc = _mm512_fmadd_ps(zq, zq, zacc);
                }
                __m128i b8 = _mm512_cvtepi32_epi8(cnt);
                uint64_t lo = _pext_u64((uint64_t)_mm_cvtsi128_si64(b8), pmask);
                uint64_t hi = _pext_u64((uint64_t)_mm_extract_epi64(b8, 1), pmask);
                store_bits16(out + j * 2 * bits, lo | hi << (8 * bits), bits);
            }
            float zn2 = A->norm_corrected ? _mm512_reduce_add_ps(zacc) : 0.0f;
            A->scale[(i + r) * A->scale_stride] = tqkv__row_scale(s[r], sg, A->norm_corrected, zn2);
        }
        if (stop)
            return i + R;
    }
    return A->n;
}

static inline __attribute__((always_inline)) void
dec_dense_body(const tqkv__dec_rows_t *A, const float *m, const uint32_t bits)
{
    const uint32_t g = A->g, nv = g / 16;
    const float *mu = A->mu;
    const size_t os = A->out_stride;
    const uint64_t pmask = lane_mask[bits];
    const uint64_t lowmask = bits == 4 ? ~0ull : ((1ull << (8 * bits)) - 1);
    const __m512 zv16 = _mm512_loadu_ps(A->z);
    const __m512 fmax = _mm512_set1_ps(FLT_MAX), fmin = _mm512_set1_ps(-FLT_MAX);
    float zb[4 * TQKV_PAGE_MAX_DIM], yb[4 * TQKV_PAGE_MAX_DIM];

    for (size_t i = 0; i < A->n; i += 4) {
        const uint32_t R = A->n - i < 4 ? (uint32_t)(A->n - i) : 4;
        for (uint32_t r = 0; r < R; r++) {
            const uint8_t *row = A->idx + (i + r) * A->idx_stride;
            for (uint32_t j = 0; j < nv; j++) {
                uint64_t w = load_bits16(row + j * 2 * bits, bits);
                uint64_t lo = _pdep_u64(w & lowmask, pmask), hi = _pdep_u64(w >> (8 * bits), pmask);
                __m512i iv = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)hi, (long long)lo));
                _mm512_storeu_ps(zb + (size_t)r * g + 16 * j, _mm512_permutexvar_ps(iv, zv16));
            }
        }
        mm_rows(m, g, zb, yb, R, 0);
        for (uint32_t r = 0; r < R; r++) {
            const size_t ii = i + r;
            const __m512 c = _mm512_set1_ps(tqkv_scale_get(A->scale, ii * A->scale_stride));
            for (uint32_t j = 0; j < nv; j++) {
                __m512 o = _mm512_mul_ps(_mm512_loadu_ps(yb + (size_t)r * g + 16 * j), c);
                o = _mm512_min_ps(_mm512_max_ps(o, fmin), fmax);
                if (mu) {
                    o = _mm512_add_ps(o, _mm512_loadu_ps(mu + 16 * j));
                    o = _mm512_min_ps(_mm512_max_ps(o, fmin), fmax);
                }
                if (A->out_f)
                    _mm512_storeu_ps(A->out_f + ii * os + 16 * j, o);
                if (A->out_h) {
                    __m512i u = _mm512_castps_si512(o);
                    __m512i rr = _mm512_add_epi32(
                        u, _mm512_add_epi32(
                               _mm512_set1_epi32(0x7fff),
                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
                    rr = _mm512_srli_epi32(rr, 16);
                    __m512i mag = _mm512_min_epu32(_mm512_and_si512(rr, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_set1_epi32(0x7f7f));
                    rr = _mm512_or_si512(_mm512_and_si512(rr, _mm512_set1_epi32(0x8000)), mag);
                    _mm256_storeu_si256((__m256i *)(A->out_h + ii * os + 16 * j),
                                        _mm512_cvtepi32_epi16(rr));
                }
            }
        }
    }
}

size_t
tqkv__page_enc_dense_avx512(const tqkv__enc_rows_t *a, const float *mt)
{
    return TQKV__BITS_CALL(a->bits, enc_dense_body, a, mt);
}

void
tqkv__page_dec_dense_avx512(const tqkv__dec_rows_t *a, const float *m)
{
    TQKV__BITS_CALL(a->bits, dec_dense_body, a, m);
}

void
tqkv__rows_matmul_avx512(const float *a, uint32_t g, const float *x, float *y, size_t n)
{
    for (size_t r = 0; r < n; r += 4)
        mm_rows(a, g, x + r * g, y + r * g, n - r < 4 ? (uint32_t)(n - r) : 4, 0);
}
