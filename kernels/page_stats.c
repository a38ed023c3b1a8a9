/* page_stats.c - the key-statistics loops of page encode (channel energies, sums,
 * centering votes), one copy per ISA chosen at run time, and the AVX-512 VBMI2 channel
 * split/merge of two-group tensors. Reentrant; the choice is made under pthread_once.
 */
#include "kernels/page.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/cpu.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* acc[k] += (x[k] - mean[k])^2 (f64; mean NULL: 0) for k < n: the energy pass, the same
 * operations in every ISA version (no contraction in this library). */
static inline __attribute__((always_inline)) void
energy_accum_body(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    if (mean)
        for (uint64_t k = 0; k < n; k++) {
            double v = (double)tqkv_bf16_to_f32(x[k]) - (double)mean[k];
            acc[k] += v * v;
        }
    else
        for (uint64_t k = 0; k < n; k++) {
            double v = (double)tqkv_bf16_to_f32(x[k]);
            acc[k] += v * v;
        }
}

/* acc[k] += x[k] (f64) for k < n; returns the largest |x| bits seen (max of *maxmag). */
static inline __attribute__((always_inline)) uint16_t
sum_accum_body(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    for (uint64_t k = 0; k < n; k++) {
        uint16_t m = x[k] & 0x7fffu;
        acc[k] += (double)tqkv_bf16_to_f32(x[k]);
        maxmag = m > maxmag ? m : maxmag;
    }
    return maxmag;
}

/* The centering votes of one head over T tokens (row t at x + t * xs, D channels) against
 * its mean mu (tq_math.h tqkv_token_center_energy / tqkv_center_vote): their sum and the
 * number of non-zero tokens. Integer sums: any token order gives the same result. */
static inline __attribute__((always_inline)) void
center_votes_body(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                  uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        double ep, ec;
        tqkv_token_center_energy(x + t * xs, mu, D, &ep, &ec);
        v += tqkv_center_vote(ep, ec);
        n += ep > 0;
    }
    *votes = v;
    *nonzero = n;
}

/* One copy per ISA, picked at run time. Not target_clones: its IFUNC resolvers run before
 * the sanitizer runtimes are up (every TSan binary crashed at start-up). */
__attribute__((target("avx512f"))) static void
energy_accum_avx512(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
__attribute__((target("avx2"))) static void
energy_accum_avx2(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
static void
energy_accum_ref(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
__attribute__((target("avx512f"))) static uint16_t
sum_accum_avx512(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}
__attribute__((target("avx2"))) static uint16_t
sum_accum_avx2(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}
static uint16_t
sum_accum_ref(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}

/* The SIMD copies hold the 8 lanes of tqkv_token_center_energy in registers (lane j:
 * channels c = j mod 8; f64, no contraction) and join them in its order. */
static inline __attribute__((always_inline)) void
center_vote_join(const double *p, const double *q, uint64_t *v, uint64_t *n)
{
    double ep = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    double ec = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
    *v += tqkv_center_vote(ep, ec);
    *n += ep > 0;
}

__attribute__((target("avx512f"))) static void
center_votes_avx512(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                    uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * xs;
        __m512d p = _mm512_setzero_pd(), q = _mm512_setzero_pd();
        double pl[8], ql[8];
        uint32_t c = 0;
        for (; c + 8 <= D; c += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(xr + c));
            __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            __m512d a = _mm512_cvtps_pd(f), m = _mm512_cvtps_pd(_mm256_loadu_ps(mu + c));
            __m512d d = _mm512_sub_pd(a, m);
            p = _mm512_add_pd(p, _mm512_mul_pd(a, a));
            q = _mm512_add_pd(q, _mm512_mul_pd(d, d));
        }
        _mm512_storeu_pd(pl, p);
        _mm512_storeu_pd(ql, q);
        for (uint32_t j = 0; c + j < D; j++) {
            double a = (double)tqkv_bf16_to_f32(xr[c + j]), d = a - (double)mu[c + j];
            pl[j] += a * a;
            ql[j] += d * d;
        }
        center_vote_join(pl, ql, &v, &n);
    }
    *votes = v;
    *nonzero = n;
}

__attribute__((target("avx2"))) static void
center_votes_avx2(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                  uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * xs;
        __m256d p0 = _mm256_setzero_pd(), p1 = _mm256_setzero_pd();
        __m256d q0 = _mm256_setzero_pd(), q1 = _mm256_setzero_pd();
        double pl[8], ql[8];
        uint32_t c = 0;
        for (; c + 8 <= D; c += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(xr + c));
            __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            __m256 mf = _mm256_loadu_ps(mu + c);
            __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
            __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
            __m256d d0 = _mm256_sub_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(mf)));
            __m256d d1 = _mm256_sub_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(mf, 1)));
            p0 = _mm256_add_pd(p0, _mm256_mul_pd(a0, a0));
            p1 = _mm256_add_pd(p1, _mm256_mul_pd(a1, a1));
            q0 = _mm256_add_pd(q0, _mm256_mul_pd(d0, d0));
            q1 = _mm256_add_pd(q1, _mm256_mul_pd(d1, d1));
        }
        _mm256_storeu_pd(pl, p0);
        _mm256_storeu_pd(pl + 4, p1);
        _mm256_storeu_pd(ql, q0);
        _mm256_storeu_pd(ql + 4, q1);
        for (uint32_t j = 0; c + j < D; j++) {
            double a = (double)tqkv_bf16_to_f32(xr[c + j]), d = a - (double)mu[c + j];
            pl[j] += a * a;
            ql[j] += d * d;
        }
        center_vote_join(pl, ql, &v, &n);
    }
    *votes = v;
    *nonzero = n;
}
void
tqkv__center_votes_ref(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                       uint64_t *votes, uint64_t *nonzero)
{
    center_votes_body(x, xs, T, D, mu, votes, nonzero);
}

/* The key-statistics table (page_internal.h), one row per ISA level. */
static const tqkv__stats_kernels_t stats_table[] = {
    [TQKV_ISA_SCALAR] = {energy_accum_ref, sum_accum_ref, tqkv__center_votes_ref},
    [TQKV_ISA_AVX2] = {energy_accum_avx2, sum_accum_avx2, center_votes_avx2},
    [TQKV_ISA_AVX512] = {energy_accum_avx512, sum_accum_avx512, center_votes_avx512},
};

static tqkv_isa_t stats_isa;
static pthread_once_t stats_once = PTHREAD_ONCE_INIT;

static void
stats_init(void)
{
    const tqkv_cpu_t *c = tqkv_cpu_usable();
    stats_isa = c->avx512f ? TQKV_ISA_AVX512 : c->avx2 ? TQKV_ISA_AVX2 : TQKV_ISA_SCALAR;
}

const tqkv__stats_kernels_t *
tqkv__stats_kernels(tqkv_isa_t isa)
{
    return &stats_table[isa];
}

tqkv_isa_t
tqkv__stats_isa(void)
{
    pthread_once(&stats_once, stats_init);
    return stats_isa;
}

void
tqkv__energy_accum(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    stats_table[tqkv__stats_isa()].energy(acc, x, mean, n);
}

uint16_t
tqkv__sum_accum(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return stats_table[tqkv__stats_isa()].sum(acc, x, n, maxmag);
}

void
tqkv__center_votes(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                   uint64_t *votes, uint64_t *nonzero)
{
    stats_table[tqkv__stats_isa()].votes(x, xs, T, D, mu, votes, nonzero);
}

static int have_vbmi2;
static pthread_once_t vbmi2_once = PTHREAD_ONCE_INIT;

static void
vbmi2_init(void)
{
    have_vbmi2 = tqkv_cpu_usable()->avx512_vbmi2;
}

int
tqkv__page_vbmi2(void)
{
    pthread_once(&vbmi2_once, vbmi2_init);
    return have_vbmi2;
}

/* Rows x + t * xs (D BF16 channels, D a multiple of 32) into o + t * D as the channels
 * with mask bit set, in order, then the others: AVX-512 VBMI2 compress per 32 channels. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) void
tqkv__split_rows_vbmi2(const uint16_t *x, size_t xs, uint16_t *o, uint32_t T, uint32_t D,
                       const uint8_t *mask, uint32_t g0)
{
    uint32_t m[TQKV_PAGE_MAX_DIM / 32];
    for (uint32_t b = 0; b < D / 32; b++)
        memcpy(&m[b], mask + 4 * b, 4);
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * xs;
        uint16_t *o0 = o + (size_t)t * D, *o1 = o0 + g0;
        for (uint32_t b = 0; b < D / 32; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(xr + 32 * b));
            const uint32_t n0 = (uint32_t)__builtin_popcount(m[b]);
            _mm512_mask_storeu_epi16(o0, (__mmask32)((1ull << n0) - 1),
                                     _mm512_maskz_compress_epi16((__mmask32)m[b], v));
            _mm512_mask_storeu_epi16(o1, (__mmask32)((1ull << (32 - n0)) - 1),
                                     _mm512_maskz_compress_epi16((__mmask32)~m[b], v));
            o0 += n0;
            o1 += 32 - n0;
        }
    }
}

/* The inverse of tqkv__split_rows_vbmi2 for decoded rows: b + t * D (group 0's channels, then
 * group 1's) back into channel order at out_f / out_h + t * os (either may be NULL). */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) void
tqkv__merge_rows_vbmi2(const float *bf, const uint16_t *bh, float *out_f, uint16_t *out_h,
                       size_t os, uint32_t T, uint32_t D, const uint8_t *mask, uint32_t g0)
{
    uint32_t m[TQKV_PAGE_MAX_DIM / 32];
    for (uint32_t b = 0; b < D / 32; b++)
        memcpy(&m[b], mask + 4 * b, 4);
    for (uint32_t t = 0; t < T; t++) {
        if (bf) {
            const float *p0 = bf + (size_t)t * D, *p1 = p0 + g0;
            float *w = out_f + (size_t)t * os;
            for (uint32_t b = 0; b < D / 16; b++) {
                const uint32_t mb = (m[b / 2] >> (16 * (b & 1))) & 0xffffu;
                const uint32_t n0 = (uint32_t)__builtin_popcount(mb);
                __m512 v0 = _mm512_maskz_loadu_ps((__mmask16)((1u << n0) - 1), p0);
                __m512 v1 = _mm512_maskz_loadu_ps((__mmask16)((1u << (16 - n0)) - 1), p1);
                _mm512_storeu_ps(w + 16 * b,
                                 _mm512_mask_expand_ps(_mm512_maskz_expand_ps((__mmask16)mb, v0),
                                                       (__mmask16)~mb, v1));
                p0 += n0;
                p1 += 16 - n0;
            }
        }
        if (bh) {
            const uint16_t *p0 = bh + (size_t)t * D, *p1 = p0 + g0;
            uint16_t *w = out_h + (size_t)t * os;
            for (uint32_t b = 0; b < D / 32; b++) {
                const uint32_t n0 = (uint32_t)__builtin_popcount(m[b]);
                __m512i v0 = _mm512_maskz_loadu_epi16((__mmask32)((1ull << n0) - 1), p0);
                __m512i v1 = _mm512_maskz_loadu_epi16((__mmask32)((1ull << (32 - n0)) - 1), p1);
                _mm512_storeu_si512(
                    (void *)(w + 32 * b),
                    _mm512_mask_expand_epi16(_mm512_maskz_expand_epi16((__mmask32)m[b], v0),
                                             (__mmask32)~m[b], v1));
                p0 += n0;
                p1 += 32 - n0;
            }
        }
    }
}
