/* page_avx2.c - AVX2/FMA/BMI2 encode and decode of whole-head Hadamard mse groups
 * (and, at the end, of dense-rotation groups: rotation.h, blocks of 2 rows x 32 columns
 * through the matrix, scalar quantization and packing).
 *
 * Per row: BF16 -> f32 (shift), sum of squares (FMA), D1, FWHT, D2, FWHT, then the
 * coordinates are scaled straight into the z domain (y * sqrt(g) = w / (sqrt(g) s)),
 * located among the thresholds (a binary search over vpermps tables for 3 and 4 bits,
 * a count for 1 and 2; both the near-tie rule of tqkv_nearest_index) and packed 32
 * indices at a time (shifts and horizontal adds) into the LSB-first stream of the
 * format. Decode mirrors it: a dword broadcast and vpsrlvd per 8 indices, a register
 * permute for the codebook, the transforms, and the scaled, clamped output. No
 * PEXT/PDEP: they are microcoded and slow on AMD before Zen 3, common AVX2-only parts.
 *
 * The FWHT butterflies are the same a+c / a-c operations in the same order as
 * tqkv_fwht (in-vector stages as permute + FMA by +-1, which rounds identically), so
 * only the norm and scaling steps round differently from the reference (near-ties
 * only). Transforms run on blocks of 8 vectors in registers; g > 64 adds stages
 * through a stack buffer, fused with D2 and with the last step, so g = 128 does not
 * spill.
 */
#include <immintrin.h>
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/simd_x86.h"
#include "kernels/tq_math.h"

/* In-place FWHT of v[nv] (g = 8 nv floats). With nv a constant after inlining the
 * loops unroll and v stays in registers (g = 128: 16 ymm). The three in-register
 * stages are one permute and one FMA each: fma(x, +-1, partner) rounds once, to the
 * same a + c (even slot) or a - c (odd slot) as an add and a sub, so the result is
 * bit-identical to two ops and a blend at half the instructions. */
static inline __attribute__((always_inline)) void
fwht_avx2(__m256 *v, const uint32_t nv)
{
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    /* stage by stage over the vectors: independent work next to each other in the
     * instruction stream (about 5% faster at g=128 than vector by vector) */
#pragma GCC unroll 16
    for (uint32_t j = 0; j < nv; j++)
        v[j] = _mm256_fmadd_ps(v[j], s1, _mm256_permute_ps(v[j], 0xB1));
#pragma GCC unroll 16
    for (uint32_t j = 0; j < nv; j++)
        v[j] = _mm256_fmadd_ps(v[j], s2, _mm256_permute_ps(v[j], 0x4E));
#pragma GCC unroll 16
    for (uint32_t j = 0; j < nv; j++)
        v[j] = _mm256_fmadd_ps(v[j], s4, _mm256_permute2f128_ps(v[j], v[j], 1));
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

/* Index of y among the ascending thresholds thr[0..2^bits-2]: the count of thresholds
 * below y (y > t), found for 3 and 4 bits by a binary search whose later thresholds come
 * from vpermps tables indexed by the partial result kept negative (masks are -1): k bits
 * found so far, -k & 7 picks the threshold of the next level. ta/tb/tc: those tables. */
static inline __attribute__((always_inline)) __m256i
quantize8(__m256 y, const __m256 *tv, __m256 ta, __m256 tb, __m256 tc, uint32_t bits)
{
    __m256i i;
    if (bits <= 2) {
        i = _mm256_setzero_si256();
        for (uint32_t t = 0; t < (1u << bits) - 1; t++)
            i = _mm256_sub_epi32(i, _mm256_castps_si256(_mm256_cmp_ps(y, tv[t], _CMP_GT_OQ)));
        return i;
    }
    i = _mm256_castps_si256(_mm256_cmp_ps(y, tv[bits == 3 ? 3 : 7], _CMP_GT_OQ));
    i = _mm256_add_epi32(
        _mm256_add_epi32(i, i),
        _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_permutevar8x32_ps(ta, i), _CMP_GT_OQ)));
    if (bits == 4)
        i = _mm256_add_epi32(
            _mm256_add_epi32(i, i),
            _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_permutevar8x32_ps(tb, i), _CMP_GT_OQ)));
    i = _mm256_add_epi32(
        _mm256_add_epi32(i, i),
        _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_permutevar8x32_ps(tc, i), _CMP_GT_OQ)));
    return _mm256_sub_epi32(_mm256_setzero_si256(), i);
}

/* Threshold table of a binary-search level: entry (-k & 7) is the threshold that splits
 * the cell range of partial index k (levels bits found so far, 2^(bits-levels) cells
 * each), thr[(2k + 1) 2^(bits - levels - 1) - 1]. */
static __m256
thr_table(const float *thr, uint32_t bits, uint32_t levels)
{
    float t[8] = {0};
    for (uint32_t k = 0; k < (1u << levels); k++)
        t[(8 - k) & 7] = thr[((2 * k + 1) << (bits - levels - 1)) - 1];
    return _mm256_loadu_ps(t);
}

/* Bodies take `bits` as a compile-time constant after inlining (see the switches). */
/* Quantizes and packs coordinates 8q..8q+7 (y in the z domain) into out; keeps the
 * codebook values in zb[q] for the norm correction. */
static inline __attribute__((always_inline)) void
enc_emit8(__m256i *cn, uint32_t q, __m256 y, const __m256 *tv, __m256 ta, __m256 tb, __m256 tc,
          __m256 zlo, __m256 zhi, __m256 *zb, uint32_t bits, int norm_corrected)
{
    __m256i cnt = quantize8(y, tv, ta, tb, tc, bits);
    if (norm_corrected) {
        __m256 zv = _mm256_permutevar8x32_ps(zlo, cnt);
        if (bits == 4)
            zv = _mm256_blendv_ps(zv, _mm256_permutevar8x32_ps(zhi, cnt),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(cnt, 28)));
        zb[q] = zv;
    }
    cn[q] = cnt;
}

/* Packs the indices of ng = 2 or 4 groups (cn[0..ng), lanes < 2^bits) into the ng * bits
 * bytes at out, LSB first: each lane shifted to its place in the group's 8 bits-wide
 * fields, the lanes summed (disjoint bits: the sum is the OR) by two rounds of hadd and
 * the two halves, then the groups' bytes made contiguous. No PEXT (microcoded and slow
 * on AMD before Zen 3). */
static inline __attribute__((always_inline)) void
pack_groups(uint8_t *out, const __m256i *cn, uint32_t ng, uint32_t bits)
{
    const __m256i sh =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bits));
    __m256i h = _mm256_hadd_epi32(_mm256_sllv_epi32(cn[0], sh), _mm256_sllv_epi32(cn[1], sh));
    h = _mm256_hadd_epi32(
        h, ng == 4 ? _mm256_hadd_epi32(_mm256_sllv_epi32(cn[2], sh), _mm256_sllv_epi32(cn[3], sh))
                   : h);
    /* group k's 8 * bits bits in dword k */
    __m128i g = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    if (bits == 3)
        g = _mm_shuffle_epi8(g,
                             _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1));
    else if (bits == 2)
        g = _mm_packus_epi32(g, g);
    else if (bits == 1)
        g = _mm_packus_epi16(_mm_packus_epi32(g, g), g);
    if (ng * bits >= 8) {
        _mm_storel_epi64((__m128i *)out, g);
        if (ng * bits == 16)
            _mm_storel_epi64((__m128i *)(out + 8), _mm_unpackhi_epi64(g, g));
        else if (ng * bits == 12) {
            uint32_t t = (uint32_t)_mm_extract_epi32(g, 2);
            memcpy(out + 8, &t, 4);
        }
    } else {
        uint64_t t = (uint64_t)_mm_cvtsi128_si64(g);
        memcpy(out, &t, ng * bits);
    }
}

/* Encode, per row: BF16 -> f32 (minus mu), sum of squares, D1, FWHT, D2, FWHT, quantize.
 * The transforms run on blocks of 8 vectors as in dec_body (wider stages through w[],
 * fused with D2 and with the quantization); same operations in the same order as
 * before, so the same bytes. */
static inline __attribute__((always_inline)) size_t
enc_body(const tqkv__enc_rows_t *A, const uint32_t g, const uint32_t bits)
{
    const uint16_t *x = A->x;
    const float *signs = A->signs, *z = A->z, *thr = A->thr, *mu = A->mu;
    const size_t n = A->n;
    const int norm_corrected = A->norm_corrected;
    __m256 w[TQKV_PAGE_MAX_DIM / 8], zb[TQKV_PAGE_MAX_DIM / 8], r[8];
    __m256i cn[TQKV_PAGE_MAX_DIM / 8];
    const uint32_t nv = g / 8, nb = nv < 8 ? nv : 8;
    const uint32_t nthr = (1u << bits) - 1;
    const float sg = sqrtf((float)g);
    __m256 tv[15];
    __m256 zlo = _mm256_loadu_ps(z), zhi = bits == 4 ? _mm256_loadu_ps(z + 8) : zlo;

    for (uint32_t t = 0; t < nthr; t++)
        tv[t] = _mm256_set1_ps(thr[t]);
    const __m256 ta = bits >= 3 ? thr_table(thr, bits, 1) : tv[0];
    const __m256 tb = bits == 4 ? thr_table(thr, bits, 2) : ta;
    const __m256 tc = bits >= 3 ? thr_table(thr, bits, bits - 1) : ta;
    for (size_t i = 0; i < n; i++) {
        const uint16_t *xr = x + i * A->x_stride;
        uint8_t *out = A->idx + i * A->idx_stride;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), zacc = _mm256_setzero_ps();
        float ss, s, k;
        __m256 kv;
        _Pragma("GCC unroll 4") for (uint32_t b0 = 0; b0 < nv; b0 += nb)
        {
#pragma GCC unroll 4
            for (uint32_t k2 = 0; k2 < nb; k2 += 2) {
                const uint32_t j = 8 * (b0 + k2);
                __m256 a = tqkv__load_bf16x8(xr + j), b = tqkv__load_bf16x8(xr + j + 8);
                if (mu) {
                    a = _mm256_sub_ps(a, _mm256_loadu_ps(mu + j));
                    b = _mm256_sub_ps(b, _mm256_loadu_ps(mu + j + 8));
                }
                acc0 = _mm256_fmadd_ps(a, a, acc0);
                acc1 = _mm256_fmadd_ps(b, b, acc1);
                r[k2] = _mm256_mul_ps(a, _mm256_loadu_ps(signs + j));
                r[k2 + 1] = _mm256_mul_ps(b, _mm256_loadu_ps(signs + j + 8));
            }
            fwht_avx2(r, nb);
            if (nb == nv) {
#pragma GCC unroll 8
                for (uint32_t q = 0; q < nb; q++)
                    r[q] = _mm256_mul_ps(r[q], _mm256_loadu_ps(signs + g + 8 * q));
            } else {
#pragma GCC unroll 8
                for (uint32_t q = 0; q < nb; q++)
                    w[b0 + q] = r[q];
            }
        }
        ss = tqkv__hsum256(_mm256_add_ps(acc0, acc1));
        if (!(ss >= 1e-30f && ss <= 1e36f))
            return i;
        s = sqrtf(ss);
        k = 1.0f / (sg * s);
        kv = _mm256_set1_ps(k);
        for (uint32_t h = nb; h < nv; h <<= 1)
            for (uint32_t i0 = 0; i0 < nv; i0 += 2 * h)
#pragma GCC unroll 8
                for (uint32_t j = i0; j < i0 + h; j++) {
                    __m256 p = w[j], q = w[j + h], a = _mm256_add_ps(p, q), d = _mm256_sub_ps(p, q);
                    if (2 * h == nv) {
                        a = _mm256_mul_ps(a, _mm256_loadu_ps(signs + g + 8 * j));
                        d = _mm256_mul_ps(d, _mm256_loadu_ps(signs + g + 8 * (j + h)));
                    }
                    w[j] = a;
                    w[j + h] = d;
                }
        if (nb == nv) {
            fwht_avx2(r, nb);
#pragma GCC unroll 8
            for (uint32_t q = 0; q < nb; q++)
                enc_emit8(cn, q, _mm256_mul_ps(r[q], kv), tv, ta, tb, tc, zlo, zhi, zb, bits,
                          norm_corrected);
        } else {
            _Pragma("GCC unroll 4") for (uint32_t b0 = 0; b0 < nv; b0 += nb)
            {
#pragma GCC unroll 8
                for (uint32_t q = 0; q < nb; q++)
                    r[q] = w[b0 + q];
                fwht_avx2(r, nb);
#pragma GCC unroll 8
                for (uint32_t q = 0; q < nb; q++)
                    w[b0 + q] = r[q];
            }
            for (uint32_t h = nb; h < nv; h <<= 1)
                for (uint32_t i0 = 0; i0 < nv; i0 += 2 * h)
#pragma GCC unroll 8
                    for (uint32_t j = i0; j < i0 + h; j++) {
                        __m256 p = w[j], q = w[j + h], a = _mm256_add_ps(p, q),
                               d = _mm256_sub_ps(p, q);
                        if (2 * h == nv) {
                            enc_emit8(cn, j, _mm256_mul_ps(a, kv), tv, ta, tb, tc, zlo, zhi, zb,
                                      bits, norm_corrected);
                            enc_emit8(cn, j + h, _mm256_mul_ps(d, kv), tv, ta, tb, tc, zlo, zhi, zb,
                                      bits, norm_corrected);
                        } else {
                            w[j] = a;
                            w[j + h] = d;
                        }
                    }
        }
        _Pragma("GCC unroll 4") for (uint32_t q = 0; q < nv; q += 4)
            pack_groups(out + q * bits, cn + q, nv < 4 ? nv : 4, bits);
        float zn2 = 0.0f;
        if (norm_corrected) {
#pragma GCC unroll 16
            for (uint32_t q = 0; q < nv; q++) /* in coordinate order, as before */
                zacc = _mm256_fmadd_ps(zb[q], zb[q], zacc);
            zn2 = tqkv__hsum256(zacc);
        }
        A->scale[i * A->scale_stride] = tqkv__row_scale(s, sg, norm_corrected, zn2);
    }
    return n;
}

/* The 8 indices of group q (coordinates 8q..8q+7, bits 8q*bits.. of the row) as the low
 * `bits` of lanes 0..7, higher lanes' bits above them: one dword broadcast from the row
 * and a variable shift. The dword is taken at byte q*bits or, for the last groups of a
 * row, at the row's last 4 bytes (a 2-byte row, g = 16 at 1 bit: those 2 bytes), so
 * nothing past the row is read. */
static inline __attribute__((always_inline)) __m256i
unpack8(const uint8_t *row, uint32_t q, uint32_t bits, uint32_t row_bytes)
{
    uint32_t off = q * bits, w;
    if (row_bytes < 4) { /* g = 16 at 1 bit: 2 bytes */
        uint16_t h;
        memcpy(&h, row, 2);
        w = h;
        off = 0;
    } else {
        if (off + 4 > row_bytes)
            off = row_bytes - 4;
        memcpy(&w, row + off, 4);
    }
    const __m256i sh =
        _mm256_add_epi32(_mm256_set1_epi32((int)(8 * (q * bits - off))),
                         _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)bits)));
    return _mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh);
}

/* Codebook lookup of unpack8's lanes. zt: z repeated to 8 entries (bits <= 3), so the
 * higher lanes' bits above an index do not matter to vpermps (it reads 3 bits); 4
 * bits: z[0..7] and z[8..15] picked by bit 3 (moved to the sign for blendv). */
static inline __attribute__((always_inline)) __m256
lookup8(__m256i t, __m256 zt, __m256 zhi, uint32_t bits)
{
    __m256 zv = _mm256_permutevar8x32_ps(zt, t);
    if (bits == 4)
        zv = _mm256_blendv_ps(zv, _mm256_permutevar8x32_ps(zhi, t),
                              _mm256_castsi256_ps(_mm256_slli_epi32(t, 28)));
    return zv;
}

/* f32 (finite, |o| <= bf16_max below) -> BF16 bits in the low half of each lane, round
 * to nearest even. */
static inline __m256i
bf16_round(__m256 o)
{
    __m256i u = _mm256_castps_si256(o);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                             16);
}

/* Largest float that rounds (nearest even) to the largest finite BF16, 0x7f7f: clamping
 * to +-it before rounding is the saturating conversion of tqkv_f32_to_bf16_sat. */
#define BF16_SAT_MAX 0x7f7f7fffu

typedef struct dec_out {
    float *f;    /* row's f32 output or NULL */
    uint16_t *h; /* row's BF16 output or NULL */
    const float *signs, *mu;
    const uint16_t *sbits; /* D1 as BF16 sign bits (only_h) */
    __m256 c, omin, omax, hmin, hmax;
    int in_range; /* this row's values cannot reach the clamps */
} dec_out_t;

/* Output of coordinates j..j+15 from the FWHT: times scale / g and D1, plus mu, clamped,
 * stored as f32 and/or BF16. only_h: BF16 out and no mu (a compile-time constant). */
static inline __attribute__((always_inline)) void
emit16(const dec_out_t *O, uint32_t j, __m256 v0, __m256 v1, const int only_h)
{
    /* BF16 only: D1 as a sign flip of the rounded values (rounding and clamping are
     * symmetric, so the bits are those of flipping first) */
    __m256 o0 = _mm256_mul_ps(v0, O->c), o1 = _mm256_mul_ps(v1, O->c);
    if (!only_h && O->mu) { /* (the product by +-1 is exact: one rounding, as mul + add) */
        o0 = _mm256_fmadd_ps(o0, _mm256_loadu_ps(O->signs + j), _mm256_loadu_ps(O->mu + j));
        o1 = _mm256_fmadd_ps(o1, _mm256_loadu_ps(O->signs + j + 8), _mm256_loadu_ps(O->mu + j + 8));
    } else if (!only_h) {
        o0 = _mm256_mul_ps(o0, _mm256_loadu_ps(O->signs + j));
        o1 = _mm256_mul_ps(o1, _mm256_loadu_ps(O->signs + j + 8));
    }
    if (!O->in_range) {
        o0 = _mm256_min_ps(_mm256_max_ps(o0, O->omin), O->omax);
        o1 = _mm256_min_ps(_mm256_max_ps(o1, O->omin), O->omax);
    }
    if (!only_h && O->f) {
        _mm256_storeu_ps(O->f + j, o0);
        _mm256_storeu_ps(O->f + j + 8, o1);
        if (!O->in_range) {
            o0 = _mm256_min_ps(_mm256_max_ps(o0, O->hmin), O->hmax);
            o1 = _mm256_min_ps(_mm256_max_ps(o1, O->hmin), O->hmax);
        }
    }
    if (only_h || O->h) {
        __m256i p = _mm256_packus_epi32(bf16_round(o0), bf16_round(o1));
        p = _mm256_permute4x64_epi64(p, 0xD8);
        if (only_h)
            p = _mm256_xor_si256(p, _mm256_loadu_si256((const __m256i *)(O->sbits + j)));
        _mm256_storeu_si256((__m256i *)(O->h + j), p);
    }
}

/* Decode, per row: unpack and look up the codebook, FWHT, D2, FWHT, scale and D1. The
 * transforms run on blocks of 8 vectors (64 floats) in registers, stages h < 8 vectors;
 * the wider stages (g > 64) run through w[] in memory, the last one fused with D2 (first
 * transform) or with the output (second), so g = 128 does not spill. The operations and
 * their order are those of tqkv_fwht, hence the reference's values. */
static inline __attribute__((always_inline)) void
dec_body(const tqkv__dec_rows_t *A, const uint32_t g, const uint32_t bits, const int only_h)
{
    const float *signs = A->signs, *z = A->z;
    const size_t n = A->n, os = A->out_stride;
    __m256 w[TQKV_PAGE_MAX_DIM / 8], r[8];
    uint16_t sbits[TQKV_PAGE_MAX_DIM];
    const uint32_t nv = g / 8, nb = nv < 8 ? nv : 8, row_bytes = g * bits / 8;
    const __m256i zi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 zt = _mm256_permutevar8x32_ps(
        _mm256_loadu_ps(z),
        _mm256_and_si256(zi, _mm256_set1_epi32(bits < 3 ? (1 << bits) - 1 : 7)));
    const __m256 zhi = bits == 4 ? _mm256_loadu_ps(z + 8) : zt;
    const float inv = 1.0f / (float)g;
    uint32_t hbits = BF16_SAT_MAX;
    float bmax, zmax = 0, mumax = 0, safe_scale;
    dec_out_t O;

    memcpy(&bmax, &hbits, 4);
    if (only_h)
        for (uint32_t j = 0; j < g; j++)
            sbits[j] = signs[j] < 0 ? 0x8000 : 0;
    O.sbits = sbits;
    O.signs = signs;
    O.mu = A->mu;
    /* f32 out: clamp to +-FLT_MAX (then to the BF16 bound for BF16 out too); BF16 only:
     * straight to the BF16 bound */
    /* |H D2 H z| <= g^2 max|z| (rounding adds < 1e-6 over 14 stages), so a row with
     * |scale| <= safe_scale has |w| <= bmax / 2 before mu is added: with |mu| <= bmax / 2
     * its outputs cannot reach the clamps (most rows skip them) */
    for (uint32_t j = 0; j < (1u << bits); j++)
        zmax = fmaxf(zmax, fabsf(z[j]));
    for (uint32_t j = 0; A->mu && j < g; j++)
        mumax = fmaxf(mumax, fabsf(A->mu[j]));
    safe_scale = mumax <= 0.5f * bmax ? bmax / (4.0f * (float)g * zmax) : -1.0f;
    O.omax = _mm256_set1_ps(A->out_f ? FLT_MAX : bmax);
    O.omin = _mm256_set1_ps(A->out_f ? -FLT_MAX : -bmax);
    O.hmax = _mm256_set1_ps(bmax);
    O.hmin = _mm256_set1_ps(-bmax);
    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = A->idx + i * A->idx_stride;
        const float sc = tqkv_scale_get(A->scale, i * A->scale_stride);
        O.c = _mm256_set1_ps(sc * inv);
        O.in_range = fabsf(sc) <= safe_scale;
        O.f = A->out_f ? A->out_f + i * os : NULL;
        O.h = A->out_h ? A->out_h + i * os : NULL;
        _Pragma("GCC unroll 4") for (uint32_t b0 = 0; b0 < nv; b0 += nb)
        {
#pragma GCC unroll 8
            for (uint32_t k = 0; k < nb; k++) {
                r[k] = lookup8(unpack8(row, b0 + k, bits, row_bytes), zt, zhi, bits);
            }
            fwht_avx2(r, nb);
            if (nb == nv) {
#pragma GCC unroll 8
                for (uint32_t k = 0; k < nb; k++)
                    r[k] = _mm256_mul_ps(r[k], _mm256_loadu_ps(signs + g + 8 * k));
            } else {
#pragma GCC unroll 8
                for (uint32_t k = 0; k < nb; k++)
                    w[b0 + k] = r[k];
            }
        }
        /* first transform's wide stages, the last one times D2 */
        for (uint32_t h = nb; h < nv; h <<= 1)
            for (uint32_t i0 = 0; i0 < nv; i0 += 2 * h)
#pragma GCC unroll 8
                for (uint32_t j = i0; j < i0 + h; j++) {
                    __m256 x = w[j], y = w[j + h], a = _mm256_add_ps(x, y), d = _mm256_sub_ps(x, y);
                    if (2 * h == nv) {
                        a = _mm256_mul_ps(a, _mm256_loadu_ps(signs + g + 8 * j));
                        d = _mm256_mul_ps(d, _mm256_loadu_ps(signs + g + 8 * (j + h)));
                    }
                    w[j] = a;
                    w[j + h] = d;
                }
        if (nb == nv) { /* g <= 64: all in r */
            fwht_avx2(r, nb);
#pragma GCC unroll 8
            for (uint32_t k = 0; k < nb; k += 2)
                emit16(&O, 8 * k, r[k], r[k + 1], only_h);
            continue;
        }
        _Pragma("GCC unroll 4") for (uint32_t b0 = 0; b0 < nv; b0 += nb)
        {
#pragma GCC unroll 8
            for (uint32_t k = 0; k < nb; k++)
                r[k] = w[b0 + k];
            fwht_avx2(r, nb);
#pragma GCC unroll 8
            for (uint32_t k = 0; k < nb; k++)
                w[b0 + k] = r[k];
        }
        /* second transform's wide stages, the last one into the output */
        for (uint32_t h = nb; h < nv; h <<= 1)
            for (uint32_t i0 = 0; i0 < nv; i0 += 2 * h)
#pragma GCC unroll 8
                for (uint32_t j = i0; j < i0 + h; j += 2) {
                    __m256 x0 = w[j], y0 = w[j + h], x1 = w[j + 1], y1 = w[j + 1 + h];
                    __m256 a0 = _mm256_add_ps(x0, y0), d0 = _mm256_sub_ps(x0, y0);
                    __m256 a1 = _mm256_add_ps(x1, y1), d1 = _mm256_sub_ps(x1, y1);
                    if (2 * h == nv) {
                        emit16(&O, 8 * j, a0, a1, only_h);
                        emit16(&O, 8 * (j + h), d0, d1, only_h);
                    } else {
                        w[j] = a0;
                        w[j + 1] = a1;
                        w[j + h] = d0;
                        w[j + 1 + h] = d1;
                    }
                }
    }
}

/* Specialized for g = 128 (the common head dim), 64, 256 and 32 (the groups of
 * fractional bit widths) and each bit width, so the loops unroll around registers;
 * other power-of-two g take the generic bodies (TQKV__G_BITS_SWITCH of simd_x86.h). */
size_t
tqkv__page_enc_had_avx2(const tqkv__enc_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
#define ENC(G, B) return enc_body(a, G, B)
    TQKV__G_BITS_SWITCH(ENC)
#undef ENC
}

void
tqkv__page_dec_had_avx2(const tqkv__dec_rows_t *a)
{
    const uint32_t g = a->g, bits = a->bits;
    const int only_h = a->out_h && !a->out_f && !a->mu;
#define DEC(G, B)                                                                                  \
    if (only_h)                                                                                    \
        dec_body(a, G, B, 1);                                                                      \
    else                                                                                           \
        dec_body(a, G, B, 0);                                                                      \
    return
    TQKV__G_BITS_SWITCH(DEC)
#undef DEC
}

/* ---- dense-rotation groups (rotation.h) ---- */

/* Y[r][c0 + j] = sum_i X[r][i] A[i][c0 + j] (i in order, from 0.f) for r < R and
 * j < 8 NK. fma 0: separate multiply and add (the rounding of tqkv_matvec_t). */
static inline __attribute__((always_inline)) void
mm_block(const float *A, uint32_t g, uint32_t c0, const float *X, float *Y, const uint32_t R,
         const uint32_t NK, const int fma)
{
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (uint32_t r = 0; r < R; r++)
#pragma GCC unroll 4
        for (uint32_t k = 0; k < NK; k++)
            acc[r][k] = _mm256_setzero_ps();
    for (uint32_t i = 0; i < g; i++) {
        const float *a = A + (size_t)i * g + c0;
        __m256 av[4];
#pragma GCC unroll 4
        for (uint32_t k = 0; k < NK; k++)
            av[k] = _mm256_loadu_ps(a + 8 * k);
#pragma GCC unroll 2
        for (uint32_t r = 0; r < R; r++) {
            const __m256 b = _mm256_set1_ps(X[(size_t)r * g + i]);
#pragma GCC unroll 4
            for (uint32_t k = 0; k < NK; k++)
                acc[r][k] = fma ? _mm256_fmadd_ps(av[k], b, acc[r][k])
                                : _mm256_add_ps(acc[r][k], _mm256_mul_ps(av[k], b));
        }
    }
#pragma GCC unroll 2
    for (uint32_t r = 0; r < R; r++)
#pragma GCC unroll 4
        for (uint32_t k = 0; k < NK; k++)
            _mm256_storeu_ps(Y + (size_t)r * g + c0 + 8 * k, acc[r][k]);
}

/* Y[r] = X[r] A for R (<= 4) rows of g floats (g a multiple of 16). */
static void
mm_rows(const float *A, uint32_t g, const float *X, float *Y, uint32_t R, int fma)
{
    for (uint32_t c0 = 0; c0 < g; c0 += 32)
        for (uint32_t r = 0; r < R; r += 2) {
            const float *x = X + (size_t)r * g;
            float *y = Y + (size_t)r * g;
            const int two = r + 1 < R;
            if ((g - c0) >= 32) {
                if (fma)
                    two ? mm_block(A, g, c0, x, y, 2, 4, 1) : mm_block(A, g, c0, x, y, 1, 4, 1);
                else
                    two ? mm_block(A, g, c0, x, y, 2, 4, 0) : mm_block(A, g, c0, x, y, 1, 4, 0);
            } else {
                if (fma)
                    two ? mm_block(A, g, c0, x, y, 2, 2, 1) : mm_block(A, g, c0, x, y, 1, 2, 1);
                else
                    two ? mm_block(A, g, c0, x, y, 2, 2, 0) : mm_block(A, g, c0, x, y, 1, 2, 0);
            }
        }
}

static inline __attribute__((always_inline)) size_t
enc_dense_body(const tqkv__enc_rows_t *A, const float *mt, const uint32_t bits)
{
    const uint32_t g = A->g, nthr = (1u << bits) - 1;
    const float *z = A->z, *thr = A->thr, *mu = A->mu;
    const float sg = sqrtf((float)g);
    float xb[4 * TQKV_PAGE_MAX_DIM], yb[4 * TQKV_PAGE_MAX_DIM], s[4];

    for (size_t i = 0; i < A->n; i += 4) {
        uint32_t R = A->n - i < 4 ? (uint32_t)(A->n - i) : 4;
        int stop = 0;
        for (uint32_t r = 0; r < R; r++) {
            const uint16_t *xr = A->x + (i + r) * A->x_stride;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float ss;
            for (uint32_t j = 0; j < g; j += 8) {
                __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xr + j))), 16));
                if (mu)
                    a = _mm256_sub_ps(a, _mm256_loadu_ps(mu + j));
                if (j & 8)
                    acc1 = _mm256_fmadd_ps(a, a, acc1);
                else
                    acc0 = _mm256_fmadd_ps(a, a, acc0);
                _mm256_storeu_ps(xb + (size_t)r * g + j, a);
            }
            ss = tqkv__hsum256(_mm256_add_ps(acc0, acc1));
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
            const float kv = sg / s[r], *y = yb + (size_t)r * g;
            float zn2 = 0;
            for (uint32_t j = 0; j < g; j += 8) {
                uint64_t w = 0;
                for (uint32_t l = 0; l < 8; l++) {
                    const float v = y[j + l] * kv;
                    uint32_t k = 0;
                    for (uint32_t t = 0; t < nthr; t++)
                        k += v > thr[t];
                    zn2 += z[k] * z[k];
                    w |= (uint64_t)k << (l * bits);
                }
                memcpy(out + j / 8 * bits, &w, bits);
            }
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
    const uint32_t g = A->g;
    const float *mu = A->mu, *z = A->z;
    const size_t os = A->out_stride;
    const uint32_t km = (1u << bits) - 1;
    const __m256 fmax = _mm256_set1_ps(FLT_MAX), fmin = _mm256_set1_ps(-FLT_MAX);
    float zb[4 * TQKV_PAGE_MAX_DIM], yb[4 * TQKV_PAGE_MAX_DIM];

    for (size_t i = 0; i < A->n; i += 4) {
        const uint32_t R = A->n - i < 4 ? (uint32_t)(A->n - i) : 4;
        for (uint32_t r = 0; r < R; r++) {
            const uint8_t *row = A->idx + (i + r) * A->idx_stride;
            for (uint32_t j = 0; j < g; j += 8) {
                uint64_t w = 0;
                memcpy(&w, row + j / 8 * bits, bits);
                for (uint32_t l = 0; l < 8; l++)
                    zb[(size_t)r * g + j + l] = z[(w >> (l * bits)) & km];
            }
        }
        mm_rows(m, g, zb, yb, R, 0);
        for (uint32_t r = 0; r < R; r++) {
            const size_t ii = i + r;
            const __m256 c = _mm256_set1_ps(tqkv_scale_get(A->scale, ii * A->scale_stride));
            for (uint32_t j = 0; j < g; j += 8) {
                __m256 o = _mm256_mul_ps(_mm256_loadu_ps(yb + (size_t)r * g + j), c);
                o = _mm256_min_ps(_mm256_max_ps(o, fmin), fmax);
                if (mu) {
                    o = _mm256_add_ps(o, _mm256_loadu_ps(mu + j));
                    o = _mm256_min_ps(_mm256_max_ps(o, fmin), fmax);
                }
                if (A->out_f)
                    _mm256_storeu_ps(A->out_f + ii * os + j, o);
                if (A->out_h) {
                    float f[8];
                    _mm256_storeu_ps(f, o);
                    for (uint32_t l = 0; l < 8; l++) {
                        uint32_t u;
                        uint16_t h;
                        memcpy(&u, &f[l], 4);
                        u += 0x7fffu + ((u >> 16) & 1u);
                        h = (uint16_t)(u >> 16);
                        A->out_h[ii * os + j + l] =
                            (h & 0x7fffu) == 0x7f80u ? (uint16_t)((h & 0x8000u) | 0x7f7fu) : h;
                    }
                }
            }
        }
    }
}

size_t
tqkv__page_enc_dense_avx2(const tqkv__enc_rows_t *a, const float *mt)
{
    return TQKV__BITS_CALL(a->bits, enc_dense_body, a, mt);
}

void
tqkv__page_dec_dense_avx2(const tqkv__dec_rows_t *a, const float *m)
{
    TQKV__BITS_CALL(a->bits, dec_dense_body, a, m);
}

void
tqkv__rows_matmul_avx2(const float *a, uint32_t g, const float *x, float *y, size_t n)
{
    for (size_t r = 0; r < n; r += 4)
        mm_rows(a, g, x + r * g, y + r * g, n - r < 4 ? (uint32_t)(n - r) : 4, 0);
}
