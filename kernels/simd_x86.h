/* simd_x86.h - x86 SIMD helpers shared by the AVX2 and AVX-512 kernels (page_avx2.c,
 * page_avx512.c, attention_avx2.c, attention_avx512.c), as ggml's simd-mappings.h:
 * BF16 loads, horizontal sums, the vectorized exp and the online-softmax tile update.
 *
 * Static inline, included only by files compiled with -mavx2 -mfma (and -mavx512* for
 * the AVX-512 part, under __AVX512F__). Each helper is one fixed sequence of operations,
 * so every kernel that uses it rounds the same way.
 */
#ifndef TQKV_KERNELS_SIMD_X86_H
#define TQKV_KERNELS_SIMD_X86_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* 8 BF16 values at p (unaligned) as floats. */
static inline __m256
tqkv__load_bf16x8(const uint16_t *p)
{
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Sum of the 8 lanes: (lo + hi) halves, then pairs, then the last two. */
static inline float
tqkv__hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Largest of the 8 lanes. */
static inline float
tqkv__hmax256(__m256 v)
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* The sums of the 8 lanes of a, b, c and d, in lanes 0..3: two rounds of hadd (5
 * shuffles/adds for 4 sums instead of 4 x 5). */
static inline __m128
tqkv__hsum4x256(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* exp(x) for x in [-88, 88] (Cephes expf polynomial, ~1 ulp); smaller x gives ~1e-38. */
static inline __m256
tqkv__exp256(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    __m256 fx, y, z;
    __m256i e;
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, c1, x);
    x = _mm256_fnmadd_ps(fx, c2, x);
    z = _mm256_mul_ps(x, x);
    y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^fx in two halves so that fx = -127 stays representable (denormal-free scale). */
    e = _mm256_cvtps_epi32(fx);
    {
        __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
        __m256 p1 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
        __m256 p2 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_add_epi32(e2, _mm256_set1_epi32(127)), 23));
        return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
    }
}

/* Online-softmax update of one tile of n scores: row becomes the probabilities relative
 * to the new running max *m (exp256 on 8 lanes, expf on the tail), *l the running sum
 * rescaled. Returns alpha = exp(old max - new max), the factor for the old state. */
static inline float
tqkv__softmax_tile(float *row, uint32_t n, float *m, float *l)
{
    float mx = *m, alpha, sum;
    uint32_t i = 0;
    __m256 vmx = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(row + i));
    mx = tqkv__hmax256(vmx);
    for (; i < n; i++)
        mx = row[i] > mx ? row[i] : mx;
    alpha = expf(*m - mx);
    vmx = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 p = tqkv__exp256(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx));
        _mm256_storeu_ps(row + i, p);
        vs = _mm256_add_ps(vs, p);
    }
    sum = tqkv__hsum256(vs);
    for (; i < n; i++) {
        row[i] = expf(row[i] - mx);
        sum += row[i];
    }
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

/* ---- run-time values as compile-time constants ----
 * Each ISA kernel body is written once and instantiated per constant so its loops unroll
 * around registers; these switches pick the instance. */

/* CALL(G, B) for the bit width B = 1, 2, 3 or 4 of the variable `bits` in scope (above 3:
 * 4). CALL must leave the function (return): the cases fall through. */
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

/* CALL(G, B) with the group dimension `g` in scope as the constant G = 128 (the common
 * head dim), 64, 256 or 32 (the groups of fractional bit widths), any other g as itself,
 * and B as in TQKV__BITS_SWITCH. */
#define TQKV__G_BITS_SWITCH(CALL)                                                                  \
    if (g == 128)                                                                                  \
        TQKV__BITS_SWITCH(CALL, 128)                                                               \
    if (g == 64)                                                                                   \
        TQKV__BITS_SWITCH(CALL, 64)                                                                \
    if (g == 256)                                                                                  \
        TQKV__BITS_SWITCH(CALL, 256)                                                               \
    if (g == 32)                                                                                   \
        TQKV__BITS_SWITCH(CALL, 32)                                                                \
    TQKV__BITS_SWITCH(CALL, g)

/* FN(args..., B) with B the constant equal to `bits` (1, 2, 3; above 3: 4), as one
 * expression (of FN's type, void included). */
#define TQKV__BITS_CALL(bits, FN, ...)                                                             \
    ((bits) == 1   ? FN(__VA_ARGS__, 1)                                                            \
     : (bits) == 2 ? FN(__VA_ARGS__, 2)                                                            \
     : (bits) == 3 ? FN(__VA_ARGS__, 3)                                                            \
                   : FN(__VA_ARGS__, 4))

/* CALL(K) for K = NBV query heads of a batch, 1..8 (above 7: 8). */
#define TQKV__NB_DISPATCH(NBV, CALL)                                                               \
    switch (NBV) {                                                                                 \
    case 1:                                                                                        \
        CALL(1);                                                                                   \
        break;                                                                                     \
    case 2:                                                                                        \
        CALL(2);                                                                                   \
        break;                                                                                     \
    case 3:                                                                                        \
        CALL(3);                                                                                   \
        break;                                                                                     \
    case 4:                                                                                        \
        CALL(4);                                                                                   \
        break;                                                                                     \
    case 5:                                                                                        \
        CALL(5);                                                                                   \
        break;                                                                                     \
    case 6:                                                                                        \
        CALL(6);                                                                                   \
        break;                                                                                     \
    case 7:                                                                                        \
        CALL(7);                                                                                   \
        break;                                                                                     \
    default:                                                                                       \
        CALL(8);                                                                                   \
        break;                                                                                     \
    }

#ifdef __AVX512F__
/* 16 BF16 values at p (unaligned) as floats. */
static inline __m512
tqkv__load_bf16x16(const uint16_t *p)
{
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The 16 lanes folded to 8: low half + high half. */
static inline __m256
tqkv__fold512(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

#endif
