/* attention_avx2.c - AVX2+FMA kernels of fused decode attention and of the BF16 baseline.
 *
 * Both kernels share one structure, so the comparison is fair: tiles of 64 tokens; scores
 * token by token with the query heads of a KV head sharing each decoded chunk of 8 channels
 * (one FMA per head per chunk), a vectorized exp for the online softmax, and values
 * accumulated chunk-outer / token-inner so the accumulators stay in registers. The packed
 * kernel decodes 8 b-bit codes at once: one 32-bit broadcast load, a variable shift and a
 * vpermps on the codebook held in a register (two and a blend for 16 centroids).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/simd_x86.h"
#include "kernels/tq_math.h"

#define TILE TQKV__ATTN_TILE
#define MAXNB 8
#define PF_DIST 8 /* tokens of key-row prefetch distance */ /* query heads per register batch */

/* Horizontal sums of NB accumulators plus tail[h], stored to out[h * TILE]: four at a time
 * with two rounds of hadd (5 shuffles/adds for 4 sums instead of 4 x 5). */
static inline __attribute__((always_inline)) void
hsum_nb(const __m256 *tot, const float *tail, const int NB, float *out)
{
    for (int h = 0; h < NB; h += 4) {
        __m256 a = tot[h], b = h + 1 < NB ? tot[h + 1] : _mm256_setzero_ps();
        __m256 c = h + 2 < NB ? tot[h + 2] : _mm256_setzero_ps();
        __m256 d = h + 3 < NB ? tot[h + 3] : _mm256_setzero_ps();
        __m128 r = tqkv__hsum4x256(a, b, c, d);
        float f[4];
        _mm_storeu_ps(f, r);
        for (int j = 0; j < 4 && h + j < NB; j++)
            out[(h + j) * TILE] = f[j] + tail[h + j];
    }
}

/* ---- packed streams ---- */

typedef struct sreg {
    __m256i shifts;
    __m256 tlo, thi;
    uint32_t bits, nc, safe; /* full chunks, bytes read by the full chunks */
} sreg_t;

static inline void
sreg_init(sreg_t *r, const tqkv__attn_stream_t *s)
{
    uint32_t b = s->bits;
    r->bits = b;
    r->shifts = _mm256_setr_epi32(0, (int)b, (int)(2 * b), (int)(3 * b), (int)(4 * b), (int)(5 * b),
                                  (int)(6 * b), (int)(7 * b));
    r->tlo = _mm256_loadu_ps(s->table);
    r->thi = _mm256_loadu_ps(s->table + 8);
    r->nc = s->gdim / 8;
    r->safe = r->nc ? (r->nc - 1) * b + 4 : 0;
}

/* The 8 table values of chunk c of a row. */
static inline __m256
dec8(const uint8_t *row, uint32_t c, const sreg_t *r, uint32_t b)
{
    uint32_t w;
    __m256i v;
    memcpy(&w, row + c * b, 4);
    v = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), r->shifts);
    if (b == 4) {
        __m256 lo = _mm256_permutevar8x32_ps(r->tlo, v);
        __m256 hi = _mm256_permutevar8x32_ps(r->thi, v);
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
    }
    return _mm256_permutevar8x32_ps(r->tlo, v);
}

/* Row pointers of tokens [t0, t0+n) of a stream; rows whose wide loads would cross the
 * readable limit are copied into pad (at most 4 such rows exist: see sreg_t.safe). */
static inline void
tile_rows(const tqkv__attn_stream_t *s, const sreg_t *r, uint32_t t0, uint32_t n,
          const uint8_t **rp, uint8_t (*pad)[520])
{
    uint32_t npad = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *row = s->rows + (size_t)(t0 + i) * s->stride;
        if (row + r->safe > s->limit && npad < 4) {
            memset(pad[npad], 0, sizeof pad[npad]);
            memcpy(pad[npad], row, s->row_bytes);
            row = pad[npad++];
        }
        rp[i] = row;
    }
}

/* Scores of tile tokens for query heads [h0, h0+NB). */
static inline __attribute__((always_inline)) void
score_tile(const tqkv__attn_task_t *tk, const uint8_t *const (*rp)[TILE], uint32_t t0, uint32_t n,
           uint32_t h0, const int NB, float *sc)
{
    sreg_t rs[4];
    for (uint32_t s = 0; s < tk->nk; s++)
        sreg_init(&rs[s], &tk->k[s]);
    for (uint32_t i = 0; i < n; i++) {
        __m256 tot[MAXNB];
        float tail[MAXNB];
        /* Key rows PF_DIST tokens ahead, and this token's value rows for the value pass:
         * rows of one head are H rows apart, a stride the hardware prefetchers miss. */
        for (uint32_t s = 0; s < tk->nk; s++)
            _mm_prefetch(
                (const char *)(tk->k[s].rows + (size_t)(t0 + i + PF_DIST) * tk->k[s].stride),
                _MM_HINT_T0);
        if (h0 == 0)
            for (uint32_t s = 0; s < tk->nv; s++)
                _mm_prefetch((const char *)(tk->v[s].rows + (size_t)(t0 + i) * tk->v[s].stride),
                             _MM_HINT_T0);
        for (int h = 0; h < NB; h++) {
            tot[h] = _mm256_setzero_ps();
            tail[h] = tk->qbias ? tk->qbias[h0 + h] : 0.0f;
        }
        for (uint32_t s = 0; s < tk->nk; s++) {
            const tqkv__attn_stream_t *st = &tk->k[s];
            const uint8_t *row = rp[s][i];
            const uint32_t gd = st->gdim, b = st->bits;
            const float *qv = tk->qk[s] + (size_t)h0 * gd;
            const float coef = st->coef[t0 + i];
            __m256 acc[MAXNB], vc = _mm256_set1_ps(coef);
            const sreg_t r = rs[s];
            for (int h = 0; h < NB; h++)
                acc[h] = _mm256_setzero_ps();
            if (b == 4) {
                for (uint32_t c = 0; c < r.nc; c++) {
                    __m256 z = dec8(row, c, &r, 4);
                    for (int h = 0; h < NB; h++)
                        acc[h] = _mm256_fmadd_ps(z, _mm256_loadu_ps(qv + (size_t)h * gd + 8 * c),
                                                 acc[h]);
                }
            } else {
                for (uint32_t c = 0; c < r.nc; c++) {
                    __m256 z = dec8(row, c, &r, b);
                    for (int h = 0; h < NB; h++)
                        acc[h] = _mm256_fmadd_ps(z, _mm256_loadu_ps(qv + (size_t)h * gd + 8 * c),
                                                 acc[h]);
                }
            }
            for (uint32_t j = r.nc * 8; j < gd; j++) {
                float z = st->table[tqkv_bits_get(row, j, b)];
                for (int h = 0; h < NB; h++)
                    tail[h] += coef * z * qv[(size_t)h * gd + j];
            }
            for (int h = 0; h < NB; h++)
                tot[h] = _mm256_fmadd_ps(acc[h], vc, tot[h]);
        }
        hsum_nb(tot, tail, NB, sc + h0 * TILE + i);
    }
}

/* acc_s[h0..h0+NB) += w[h][i] * decoded row i, for one V stream. */
static inline __attribute__((always_inline)) void
value_tile(const tqkv__attn_stream_t *st, const uint8_t *const *rp, uint32_t n, float *accs,
           const float *w, uint32_t h0, const int NB)
{
    const uint32_t gd = st->gdim, b = st->bits;
    sreg_t r;
    sreg_init(&r, st);
    for (uint32_t c = 0; c < r.nc; c++) {
        __m256 a[MAXNB];
        for (int h = 0; h < NB; h++)
            a[h] = _mm256_loadu_ps(accs + (size_t)(h0 + h) * gd + 8 * c);
        if (b == 4) {
            for (uint32_t i = 0; i < n; i++) {
                __m256 z = dec8(rp[i], c, &r, 4);
                for (int h = 0; h < NB; h++)
                    a[h] = _mm256_fmadd_ps(z, _mm256_broadcast_ss(w + (h0 + h) * TILE + i), a[h]);
            }
        } else {
            for (uint32_t i = 0; i < n; i++) {
                __m256 z = dec8(rp[i], c, &r, b);
                for (int h = 0; h < NB; h++)
                    a[h] = _mm256_fmadd_ps(z, _mm256_broadcast_ss(w + (h0 + h) * TILE + i), a[h]);
            }
        }
        for (int h = 0; h < NB; h++)
            _mm256_storeu_ps(accs + (size_t)(h0 + h) * gd + 8 * c, a[h]);
    }
    for (uint32_t j = r.nc * 8; j < gd; j++)
        for (uint32_t i = 0; i < n; i++) {
            float z = st->table[tqkv_bits_get(rp[i], j, b)];
            for (int h = 0; h < NB; h++)
                accs[(size_t)(h0 + h) * gd + j] += w[(h0 + h) * TILE + i] * z;
        }
}

void
tqkv__attn_task_avx2(const tqkv__attn_task_t *tk)
{
    const uint32_t G = tk->G, T = tk->num_tokens;
    float *sc = tk->scratch, *wb = tk->scratch + (size_t)G * TILE;
    const uint8_t *rk[4][TILE], *rv[4][TILE];
    uint8_t pad[8][4][520];

    for (uint32_t h = 0; h < G; h++) {
        tk->m[h] = -INFINITY;
        tk->l[h] = 0.0f;
    }
    for (uint32_t s = 0; s < tk->nv; s++)
        memset(tk->acc[s], 0, sizeof(float) * G * tk->v[s].gdim);

    for (uint32_t t0 = 0; t0 < T; t0 += TILE) {
        uint32_t n = T - t0 < TILE ? T - t0 : TILE;
        tqkv__attn_prefetch_slice(tk, t0, t0 + n);
        for (uint32_t s = 0; s < tk->nk; s++) {
            sreg_t r;
            sreg_init(&r, &tk->k[s]);
            tile_rows(&tk->k[s], &r, t0, n, rk[s], pad[s]);
        }
        for (uint32_t s = 0; s < tk->nv; s++) {
            sreg_t r;
            sreg_init(&r, &tk->v[s]);
            tile_rows(&tk->v[s], &r, t0, n, rv[s], pad[4 + s]);
        }
        for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
            uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define SCORE(K) score_tile(tk, (const uint8_t *const(*)[TILE])rk, t0, n, h0, K, sc)
            TQKV__NB_DISPATCH(nb, SCORE)
#undef SCORE
        }
        for (uint32_t h = 0; h < G; h++) {
            float alpha = tqkv__softmax_tile(sc + h * TILE, n, &tk->m[h], &tk->l[h]);
            if (alpha != 1.0f) {
                __m256 va = _mm256_set1_ps(alpha);
                for (uint32_t s = 0; s < tk->nv; s++) {
                    float *a = tk->acc[s] + (size_t)h * tk->v[s].gdim;
                    uint32_t j = 0, gd = tk->v[s].gdim;
                    for (; j + 8 <= gd; j += 8)
                        _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_loadu_ps(a + j), va));
                    for (; j < gd; j++)
                        a[j] *= alpha;
                }
            }
        }
        for (uint32_t s = 0; s < tk->nv; s++) {
            const float *coef = tk->v[s].coef + t0;
            for (uint32_t h = 0; h < G; h++)
                for (uint32_t i = 0; i < n; i++)
                    wb[h * TILE + i] = sc[h * TILE + i] * coef[i];
            for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
                uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define VALUE(K) value_tile(&tk->v[s], rv[s], n, tk->acc[s], wb, h0, K)
                TQKV__NB_DISPATCH(nb, VALUE)
#undef VALUE
            }
        }
    }
}

/* ---- randomized Hadamard ---- */

/* In-place unnormalized FWHT of n = 8k floats, same butterflies as tqkv_fwht: stages 1, 2, 4
 * inside each register, then pairs of registers. */
static void
fwht_avx2(float *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i), t;
        t = _mm256_permute_ps(v, 0xB1);
        v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xAA);
        t = _mm256_permute_ps(v, 0x4E);
        v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xCC);
        t = _mm256_permute2f128_ps(v, v, 0x01);
        v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xF0);
        _mm256_storeu_ps(x + i, v);
    }
    for (uint32_t h = 8; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            for (uint32_t j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(x + j), c = _mm256_loadu_ps(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, c));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, c));
            }
}

void
tqkv__attn_hadamard_avx2(const float *signs, uint32_t n, const float *x, float *y, int transpose)
{
    const __m256 inv = _mm256_set1_ps(1.0f / (float)n);
    const float *first = transpose ? signs + n : signs, *second = transpose ? signs : signs + n;
    uint32_t i;
    if (transpose) {
        memcpy(y, x, sizeof(float) * n);
    } else {
        for (i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i,
                             _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(first + i)));
    }
    fwht_avx2(y, n);
    for (i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i),
                                              _mm256_loadu_ps((transpose ? first : second) + i)));
    fwht_avx2(y, n);
    for (i = 0; i < n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(y + i), inv);
        if (transpose)
            v = _mm256_mul_ps(v, _mm256_loadu_ps(second + i));
        _mm256_storeu_ps(y + i, v);
    }
}

/* ---- BF16 baseline ---- */

static inline __attribute__((always_inline)) void
bf16_score_tile(const float *q, const uint16_t *k, const uint16_t *v, size_t stride, uint32_t D,
                uint32_t t0, uint32_t n, uint32_t h0, const int NB, float sm_scale, float *sc)
{
    const uint32_t nc = D / 8;
    for (uint32_t i = 0; i < n; i++) {
        const uint16_t *row = k + (size_t)(t0 + i) * stride;
        __m256 acc[MAXNB];
        float tail[MAXNB];
        /* same prefetching as the packed kernel: key rows PF_DIST ahead, this value row */
        for (uint32_t b = 0; b < 2 * D; b += 64) {
            _mm_prefetch((const char *)(row + (size_t)PF_DIST * stride) + b, _MM_HINT_T0);
            if (h0 == 0)
                _mm_prefetch((const char *)(v + (size_t)(t0 + i) * stride) + b, _MM_HINT_T0);
        }
        for (int h = 0; h < NB; h++) {
            acc[h] = _mm256_setzero_ps();
            tail[h] = 0.0f;
        }
        for (uint32_t c = 0; c < nc; c++) {
            __m256 z = tqkv__load_bf16x8(row + 8 * c);
            for (int h = 0; h < NB; h++)
                acc[h] =
                    _mm256_fmadd_ps(z, _mm256_loadu_ps(q + (size_t)(h0 + h) * D + 8 * c), acc[h]);
        }
        for (uint32_t j = nc * 8; j < D; j++)
            for (int h = 0; h < NB; h++)
                tail[h] += q[(size_t)(h0 + h) * D + j] * tqkv_bf16_to_f32(row[j]);
        for (int h = 0; h < NB; h++)
            acc[h] = _mm256_mul_ps(acc[h], _mm256_set1_ps(sm_scale));
        for (int h = 0; h < NB; h++)
            tail[h] *= sm_scale;
        hsum_nb(acc, tail, NB, sc + h0 * TILE + i);
    }
}

static inline __attribute__((always_inline)) void
bf16_value_tile(const uint16_t *v, size_t stride, uint32_t D, uint32_t t0, uint32_t n, float *out,
                const float *w, uint32_t h0, const int NB)
{
    const uint32_t nc = D / 8;
    for (uint32_t c = 0; c < nc; c++) {
        __m256 a[MAXNB];
        for (int h = 0; h < NB; h++)
            a[h] = _mm256_loadu_ps(out + (size_t)(h0 + h) * D + 8 * c);
        for (uint32_t i = 0; i < n; i++) {
            __m256 z = tqkv__load_bf16x8(v + (size_t)(t0 + i) * stride + 8 * c);
            for (int h = 0; h < NB; h++)
                a[h] = _mm256_fmadd_ps(z, _mm256_broadcast_ss(w + (h0 + h) * TILE + i), a[h]);
        }
        for (int h = 0; h < NB; h++)
            _mm256_storeu_ps(out + (size_t)(h0 + h) * D + 8 * c, a[h]);
    }
    for (uint32_t j = nc * 8; j < D; j++)
        for (uint32_t i = 0; i < n; i++) {
            float z = tqkv_bf16_to_f32(v[(size_t)(t0 + i) * stride + j]);
            for (int h = 0; h < NB; h++)
                out[(size_t)(h0 + h) * D + j] += w[(h0 + h) * TILE + i] * z;
        }
}

void
tqkv__attn_bf16_avx2(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v, uint32_t T,
                     size_t stride, uint32_t D, float sm_scale, float *out, float *m, float *l,
                     float *scratch, const void *pfk, const void *pfv, size_t pf_bytes)
{
    tqkv__attn_prefetch_bytes(pfk, 0, pf_bytes);
    tqkv__attn_prefetch_bytes(pfv, 0, pf_bytes);
    float *sc = scratch;
    for (uint32_t t0 = 0; t0 < T; t0 += TILE) {
        uint32_t n = T - t0 < TILE ? T - t0 : TILE;
        for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
            uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define SCORE(K) bf16_score_tile(q, k, v, stride, D, t0, n, h0, K, sm_scale, sc)
            TQKV__NB_DISPATCH(nb, SCORE)
#undef SCORE
        }
        for (uint32_t h = 0; h < G; h++) {
            float alpha = tqkv__softmax_tile(sc + h * TILE, n, &m[h], &l[h]);
            if (alpha != 1.0f) {
                __m256 va = _mm256_set1_ps(alpha);
                float *a = out + (size_t)h * D;
                uint32_t j = 0;
                for (; j + 8 <= D; j += 8)
                    _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_loadu_ps(a + j), va));
                for (; j < D; j++)
                    a[j] *= alpha;
            }
        }
        for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
            uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define VALUE(K) bf16_value_tile(v, stride, D, t0, n, out, sc, h0, K)
            TQKV__NB_DISPATCH(nb, VALUE)
#undef VALUE
        }
    }
}
