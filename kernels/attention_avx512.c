/* attention_avx512.c - AVX-512 (F/BW/VL/DQ/VBMI) kernels of fused decode attention and of
 * the BF16 baseline.
 *
 * Same structure as attention_avx2.c (tiles of 64 tokens, GQA heads sharing each decoded
 * chunk, online softmax, chunk-outer value accumulation), on 16 channels per register. The
 * packed kernel decodes 16 b-bit codes with three instructions: a 64-bit broadcast load,
 * vpmultishiftqb (each dword lane picks the 8 bits at its field's bit offset) and vpermps on
 * the 16-entry table held in a register (tables of b < 4 bits are replicated with period
 * 2^b, so the bits above the field do not matter). The BF16 kernel gets the same ISA.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/simd_x86.h"
#include "kernels/tq_math.h"

#define TILE TQKV__ATTN_TILE
#define MAXNB 8
#define PF_DIST 8 /* tokens of key-row prefetch distance */

/* Horizontal sums of NB accumulators plus tail[h], stored to out[h * TILE]. */
static inline __attribute__((always_inline)) void
hsum_nb(const __m512 *tot, const float *tail, const int NB, float *out)
{
    for (int h = 0; h < NB; h += 4) {
        __m256 a = tqkv__fold512(tot[h]);
        __m256 b = h + 1 < NB ? tqkv__fold512(tot[h + 1]) : _mm256_setzero_ps();
        __m256 c = h + 2 < NB ? tqkv__fold512(tot[h + 2]) : _mm256_setzero_ps();
        __m256 d = h + 3 < NB ? tqkv__fold512(tot[h + 3]) : _mm256_setzero_ps();
        __m128 r = tqkv__hsum4x256(a, b, c, d);
        float f[4];
        _mm_storeu_ps(f, r);
        for (int j = 0; j < 4 && h + j < NB; j++)
            out[(h + j) * TILE] = f[j] + tail[h + j];
    }
}

/* ---- packed streams ---- */

typedef struct sreg {
    __m512i ctrl; /* vpmultishiftqb control: byte 0 and 4 of qword k -> fields 2k, 2k+1 */
    __m512 table;
    uint32_t bits, nc, safe;
} sreg_t;

static inline void
sreg_init(sreg_t *r, const tqkv__attn_stream_t *s)
{
    uint32_t b = s->bits;
    uint8_t ctrl[64];
    memset(ctrl, 0, sizeof ctrl);
    for (int k = 0; k < 8; k++) {
        ctrl[8 * k] = (uint8_t)(b * (2 * k));
        ctrl[8 * k + 4] = (uint8_t)(b * (2 * k + 1));
    }
    r->bits = b;
    r->ctrl = _mm512_loadu_si512(ctrl);
    r->table = _mm512_loadu_ps(s->table);
    r->nc = s->gdim / 16;
    /* chunk c reads 8 bytes at byte 2bc */
    r->safe = r->nc ? (r->nc - 1) * 2 * b + 8 : 0;
}

static inline __m512
dec16(const uint8_t *row, uint32_t c, const sreg_t *r, uint32_t b)
{
    uint64_t w;
    memcpy(&w, row + 2 * c * b, 8);
    return _mm512_permutexvar_ps(
        _mm512_multishift_epi64_epi8(r->ctrl, _mm512_set1_epi64((long long)w)), r->table);
}

static inline void
tile_rows(const tqkv__attn_stream_t *s, const sreg_t *r, uint32_t t0, uint32_t n,
          const uint8_t **rp, uint8_t (*pad)[528])
{
    uint32_t npad = 0;
    if (n && s->rows + (size_t)(t0 + n - 1) * s->stride + r->safe <= s->limit) {
        for (uint32_t i = 0; i < n; i++)
            rp[i] = s->rows + (size_t)(t0 + i) * s->stride;
        return;
    }
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *row = s->rows + (size_t)(t0 + i) * s->stride;
        if (row + r->safe > s->limit && npad < 8) {
            memset(pad[npad], 0, sizeof pad[npad]);
            memcpy(pad[npad], row, s->row_bytes);
            row = pad[npad++];
        }
        rp[i] = row;
    }
}

/* Row sums of 16 rows of 16 floats (p, 64-byte aligned): lane i of the result is the sum
 * of row i. A transpose-and-add tree: 30 shuffles and 15 adds for 16 rows, instead of a
 * horizontal sum per row. */
static inline __m512
reduce16(const float *p)
{
    __m512 a[8], b[4], e0, e1;
    for (int i = 0; i < 8; i++) {
        __m512 x = _mm512_load_ps(p + 32 * i), y = _mm512_load_ps(p + 32 * i + 16);
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    e0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    e1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One key stream's contribution to the 16-lane partial scores of tokens [i0, i0 + m) of the
 * tile (ii = token - i0): part[h][ii] (=, or += when !first) coef_i * sum_c z_c * q_{h,c}.
 * NC is the chunk count when known at compile time (the loop unrolls), 0 for r->nc. */
static inline __attribute__((always_inline)) void
score_stream(const tqkv__attn_stream_t *st, const sreg_t *r, const uint8_t *const *rp,
             const float *qv, uint32_t t0, uint32_t i0, uint32_t m, int first, const int NB,
             const int NC, float (*part)[16][16])
{
    const uint32_t gd = st->gdim, b = st->bits, nc = NC ? (uint32_t)NC : r->nc;
    const int tails = nc * 16 != gd;
    uint32_t ii = 0;
    /* two tokens at a time: each query chunk is loaded once for both, and the two
     * tokens' FMA chains are independent */
    if (!tails)
        for (; ii + 2 <= m; ii += 2) {
            const uint32_t i = i0 + ii;
            const uint8_t *row0 = rp[i], *row1 = rp[i + 1];
            const __m512 coef0 = _mm512_set1_ps(st->coef[t0 + i]);
            const __m512 coef1 = _mm512_set1_ps(st->coef[t0 + i + 1]);
            __m512 acc0[MAXNB], acc1[MAXNB];
            _mm_prefetch((const char *)(st->rows + (size_t)(t0 + i + PF_DIST) * st->stride),
                         _MM_HINT_T0);
            _mm_prefetch((const char *)(st->rows + (size_t)(t0 + i + 1 + PF_DIST) * st->stride),
                         _MM_HINT_T0);
            for (int h = 0; h < NB; h++) {
                acc0[h] = _mm512_setzero_ps();
                acc1[h] = _mm512_setzero_ps();
            }
            for (uint32_t c = 0; c < nc; c++) {
                __m512 z0 = dec16(row0, c, r, b), z1 = dec16(row1, c, r, b);
                for (int h = 0; h < NB; h++) {
                    __m512 qc = _mm512_loadu_ps(qv + (size_t)h * gd + 16 * c);
                    acc0[h] = _mm512_fmadd_ps(z0, qc, acc0[h]);
                    acc1[h] = _mm512_fmadd_ps(z1, qc, acc1[h]);
                }
            }
            for (int h = 0; h < NB; h++) {
                _mm512_store_ps(part[h][ii], first ? _mm512_mul_ps(acc0[h], coef0)
                                                   : _mm512_fmadd_ps(acc0[h], coef0,
                                                                     _mm512_load_ps(part[h][ii])));
                _mm512_store_ps(
                    part[h][ii + 1],
                    first ? _mm512_mul_ps(acc1[h], coef1)
                          : _mm512_fmadd_ps(acc1[h], coef1, _mm512_load_ps(part[h][ii + 1])));
            }
        }
    for (; ii < m; ii++) {
        const uint32_t i = i0 + ii;
        const uint8_t *row = rp[i];
        const __m512 coef = _mm512_set1_ps(st->coef[t0 + i]);
        __m512 acc[MAXNB];
        /* key rows PF_DIST tokens ahead: rows of one head are H rows apart, a stride the
         * hardware prefetchers miss */
        _mm_prefetch((const char *)(st->rows + (size_t)(t0 + i + PF_DIST) * st->stride),
                     _MM_HINT_T0);
        for (int h = 0; h < NB; h++)
            acc[h] = _mm512_setzero_ps();
        for (uint32_t c = 0; c < nc; c++) {
            __m512 z = dec16(row, c, r, b);
            for (int h = 0; h < NB; h++)
                acc[h] = _mm512_fmadd_ps(z, _mm512_loadu_ps(qv + (size_t)h * gd + 16 * c), acc[h]);
        }
        if (tails)
            for (uint32_t j = nc * 16; j < gd; j++) {
                float z = st->table[tqkv_bits_get(row, j, b)];
                for (int h = 0; h < NB; h++)
                    acc[h] = _mm512_mask_add_ps(acc[h], 1, acc[h],
                                                _mm512_set1_ps(z * qv[(size_t)h * gd + j]));
            }
        for (int h = 0; h < NB; h++)
            _mm512_store_ps(part[h][ii],
                            first ? _mm512_mul_ps(acc[h], coef)
                                  : _mm512_fmadd_ps(acc[h], coef, _mm512_load_ps(part[h][ii])));
    }
}

/* Scores of tokens [0, n) of the tile for query heads h0..h0+NB: per 16 tokens, each key
 * stream adds its 16-lane partial dot products to part[][16][16], then one reduce16 per
 * head turns them into 16 scores. */
static inline __attribute__((always_inline)) void
score_tile(const tqkv__attn_task_t *tk, const uint8_t *const (*rp)[TILE], uint32_t t0, uint32_t n,
           uint32_t h0, const int NB, float *sc)
{
    sreg_t r[4];
    float part[MAXNB][16][16] __attribute__((aligned(64)));
    for (uint32_t s = 0; s < tk->nk; s++)
        sreg_init(&r[s], &tk->k[s]);
    for (uint32_t i0 = 0; i0 < n; i0 += 16) {
        uint32_t m = n - i0 < 16 ? n - i0 : 16;
        if (h0 == 0) /* the next page's share, a slice per 16 tokens */
            tqkv__attn_prefetch_slice(tk, t0 + i0, t0 + i0 + m);
        if (h0 == 0) /* this tile's value rows, for the value pass */
            for (uint32_t s = 0; s < tk->nv; s++)
                for (uint32_t ii = 0; ii < m; ii++)
                    _mm_prefetch(
                        (const char *)(tk->v[s].rows + (size_t)(t0 + i0 + ii) * tk->v[s].stride),
                        _MM_HINT_T0);
        for (uint32_t s = 0; s < tk->nk; s++) {
            const tqkv__attn_stream_t *st = &tk->k[s];
            const float *qv = tk->qk[s] + (size_t)h0 * st->gdim;
            switch (r[s].nc) {
            case 4:
                score_stream(st, &r[s], rp[s], qv, t0, i0, m, s == 0, NB, 4, part);
                break;
            case 8:
                score_stream(st, &r[s], rp[s], qv, t0, i0, m, s == 0, NB, 8, part);
                break;
            default:
                score_stream(st, &r[s], rp[s], qv, t0, i0, m, s == 0, NB, 0, part);
                break;
            }
        }
        if (tk->nk == 0)
            memset(part, 0, sizeof part);
        for (uint32_t ii = m; ii < 16; ii++)
            for (int h = 0; h < NB; h++)
                _mm512_store_ps(part[h][ii], _mm512_setzero_ps());
        for (int h = 0; h < NB; h++) {
            __m512 v = reduce16(&part[h][0][0]);
            if (tk->qbias)
                v = _mm512_add_ps(v, _mm512_set1_ps(tk->qbias[h0 + h]));
            _mm512_mask_storeu_ps(sc + (h0 + h) * TILE + i0, (__mmask16)((1u << m) - 1), v);
        }
    }
}

/* Value accumulation of chunks [c, c + CB) for NB heads over the tile's n tokens: the CB x NB
 * accumulators stay in registers (independent FMA chains) and each token's weights are
 * loaded once for the CB chunks. */
static inline __attribute__((always_inline)) void
value_pass(const uint8_t *const *rp, uint32_t n, const sreg_t *r, uint32_t b, uint32_t gd,
           float *accs, const float *w, uint32_t h0, uint32_t c, const int NB, const int CB)
{
    __m512 a[4][MAXNB];
    for (int k = 0; k < CB; k++)
        for (int h = 0; h < NB; h++)
            a[k][h] = _mm512_loadu_ps(accs + (size_t)(h0 + h) * gd + 16 * (c + k));
    for (uint32_t i = 0; i < n; i++) {
        __m512 z[4];
        for (int k = 0; k < CB; k++)
            z[k] = dec16(rp[i], c + k, r, b);
        for (int h = 0; h < NB; h++) {
            __m512 wv = _mm512_set1_ps(w[(h0 + h) * TILE + i]);
            for (int k = 0; k < CB; k++)
                a[k][h] = _mm512_fmadd_ps(z[k], wv, a[k][h]);
        }
    }
    for (int k = 0; k < CB; k++)
        for (int h = 0; h < NB; h++)
            _mm512_storeu_ps(accs + (size_t)(h0 + h) * gd + 16 * (c + k), a[k][h]);
}

static inline __attribute__((always_inline)) void
value_tile(const tqkv__attn_stream_t *st, const uint8_t *const *rp, uint32_t n, float *accs,
           const float *w, uint32_t h0, const int NB)
{
    const uint32_t gd = st->gdim, b = st->bits;
    uint32_t c = 0;
    sreg_t r;
    sreg_init(&r, st);
    if (NB <= 4)
        for (; c + 4 <= r.nc; c += 4)
            value_pass(rp, n, &r, b, gd, accs, w, h0, c, NB, 4);
    for (; c + 2 <= r.nc; c += 2)
        value_pass(rp, n, &r, b, gd, accs, w, h0, c, NB, 2);
    for (; c < r.nc; c++)
        value_pass(rp, n, &r, b, gd, accs, w, h0, c, NB, 1);
    for (uint32_t j = r.nc * 16; j < gd; j++)
        for (uint32_t i = 0; i < n; i++) {
            float z = st->table[tqkv_bits_get(rp[i], j, b)];
            for (int h = 0; h < NB; h++)
                accs[(size_t)(h0 + h) * gd + j] += w[(h0 + h) * TILE + i] * z;
        }
}

static inline void
rescale(float *a, uint32_t n, float alpha)
{
    __m512 va = _mm512_set1_ps(alpha);
    uint32_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(a + j, _mm512_mul_ps(_mm512_loadu_ps(a + j), va));
    for (; j < n; j++)
        a[j] *= alpha;
}

void
tqkv__attn_task_avx512(const tqkv__attn_task_t *tk)
{
    const uint32_t G = tk->G, T = tk->num_tokens;
    float *sc = tk->scratch, *wb = tk->scratch + (size_t)G * TILE;
    const uint8_t *rk[4][TILE], *rv[4][TILE];
    uint8_t pad[8][8][528];

    for (uint32_t h = 0; h < G; h++) {
        tk->m[h] = -INFINITY;
        tk->l[h] = 0.0f;
    }
    for (uint32_t s = 0; s < tk->nv; s++)
        memset(tk->acc[s], 0, sizeof(float) * G * tk->v[s].gdim);

    for (uint32_t t0 = 0; t0 < T; t0 += TILE) {
        uint32_t n = T - t0 < TILE ? T - t0 : TILE;
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
            if (alpha != 1.0f)
                for (uint32_t s = 0; s < tk->nv; s++)
                    rescale(tk->acc[s] + (size_t)h * tk->v[s].gdim, tk->v[s].gdim, alpha);
        }
        for (uint32_t s = 0; s < tk->nv; s++) {
            const float *coef = tk->v[s].coef + t0;
            for (uint32_t i = 0; i < n; i += 16) {
                __mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
                __m512 cv = _mm512_maskz_loadu_ps(mk, coef + i);
                for (uint32_t h = 0; h < G; h++)
                    _mm512_mask_storeu_ps(
                        wb + h * TILE + i, mk,
                        _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sc + h * TILE + i), cv));
            }
            for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
                uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define VALUE(K) value_tile(&tk->v[s], rv[s], n, tk->acc[s], wb, h0, K)
                TQKV__NB_DISPATCH(nb, VALUE)
#undef VALUE
            }
        }
    }
}

/* ---- BF16 baseline ---- */

/* Same structure as the packed kernel: per 16 tokens, 16-lane partial dot products to
 * part[][16][16] and one reduce16 per head. */
static inline __attribute__((always_inline)) void
bf16_score_tile(const float *q, const uint16_t *k, const uint16_t *v, size_t stride, uint32_t D,
                uint32_t t0, uint32_t n, uint32_t h0, const int NB, float sm_scale, float *sc,
                const void *pfk, const void *pfv, size_t pf_bytes, uint32_t T)
{
    const uint32_t nc = D / 16;
    float part[MAXNB][16][16] __attribute__((aligned(64)));
    const __m512 scale = _mm512_set1_ps(sm_scale);
    for (uint32_t i0 = 0; i0 < n; i0 += 16) {
        uint32_t m = n - i0 < 16 ? n - i0 : 16;
        if (h0 == 0 && t0 + i0 == 0) { /* the next block's share (a burst measured faster
                                          here than slices spread over the tokens) */
            tqkv__attn_prefetch_bytes(pfk, 0, pf_bytes);
            tqkv__attn_prefetch_bytes(pfv, 0, pf_bytes);
        }
        for (uint32_t ii = 0; ii < m; ii++) {
            const uint16_t *row = k + (size_t)(t0 + i0 + ii) * stride;
            __m512 acc[MAXNB];
            /* same prefetching as the packed kernel: key rows PF_DIST ahead, this value row */
            for (uint32_t b = 0; b < 2 * D; b += 64) {
                _mm_prefetch((const char *)(row + (size_t)PF_DIST * stride) + b, _MM_HINT_T0);
                if (h0 == 0)
                    _mm_prefetch((const char *)(v + (size_t)(t0 + i0 + ii) * stride) + b,
                                 _MM_HINT_T0);
            }
            for (int h = 0; h < NB; h++)
                acc[h] = _mm512_setzero_ps();
            for (uint32_t c = 0; c < nc; c++) {
                __m512 z = tqkv__load_bf16x16(row + 16 * c);
                for (int h = 0; h < NB; h++)
                    acc[h] = _mm512_fmadd_ps(z, _mm512_loadu_ps(q + (size_t)(h0 + h) * D + 16 * c),
                                             acc[h]);
            }
            for (uint32_t j = nc * 16; j < D; j++) {
                float z = tqkv_bf16_to_f32(row[j]);
                for (int h = 0; h < NB; h++)
                    acc[h] = _mm512_mask_add_ps(acc[h], 1, acc[h],
                                                _mm512_set1_ps(q[(size_t)(h0 + h) * D + j] * z));
            }
            for (int h = 0; h < NB; h++)
                _mm512_store_ps(part[h][ii], _mm512_mul_ps(acc[h], scale));
        }
        for (uint32_t ii = m; ii < 16; ii++)
            for (int h = 0; h < NB; h++)
                _mm512_store_ps(part[h][ii], _mm512_setzero_ps());
        for (int h = 0; h < NB; h++)
            _mm512_mask_storeu_ps(sc + (h0 + h) * TILE + i0, (__mmask16)((1u << m) - 1),
                                  reduce16(&part[h][0][0]));
    }
}

/* Chunks [c, c + CB) of the value rows, CB x NB accumulators in registers (as value_pass;
 * CB = 2 at most: at 32K tokens from DRAM, 4 chunks per pass measured 1.2x slower). */
static inline __attribute__((always_inline)) void
bf16_value_pass(const uint16_t *v, size_t stride, uint32_t D, uint32_t t0, uint32_t n, float *out,
                const float *w, uint32_t h0, uint32_t c, const int NB, const int CB)
{
    __m512 a[4][MAXNB];
    for (int k = 0; k < CB; k++)
        for (int h = 0; h < NB; h++)
            a[k][h] = _mm512_loadu_ps(out + (size_t)(h0 + h) * D + 16 * (c + k));
    for (uint32_t i = 0; i < n; i++) {
        const uint16_t *row = v + (size_t)(t0 + i) * stride + 16 * c;
        __m512 z[4];
        for (int k = 0; k < CB; k++)
            z[k] = tqkv__load_bf16x16(row + 16 * k);
        for (int h = 0; h < NB; h++) {
            __m512 wv = _mm512_set1_ps(w[(h0 + h) * TILE + i]);
            for (int k = 0; k < CB; k++)
                a[k][h] = _mm512_fmadd_ps(z[k], wv, a[k][h]);
        }
    }
    for (int k = 0; k < CB; k++)
        for (int h = 0; h < NB; h++)
            _mm512_storeu_ps(out + (size_t)(h0 + h) * D + 16 * (c + k), a[k][h]);
}

static inline __attribute__((always_inline)) void
bf16_value_tile(const uint16_t *v, size_t stride, uint32_t D, uint32_t t0, uint32_t n, float *out,
                const float *w, uint32_t h0, const int NB)
{
    const uint32_t nc = D / 16;
    uint32_t c = 0;
    for (; c + 2 <= nc; c += 2)
        bf16_value_pass(v, stride, D, t0, n, out, w, h0, c, NB, 2);
    for (; c < nc; c++)
        bf16_value_pass(v, stride, D, t0, n, out, w, h0, c, NB, 1);
    for (uint32_t j = nc * 16; j < D; j++)
        for (uint32_t i = 0; i < n; i++) {
            float z = tqkv_bf16_to_f32(v[(size_t)(t0 + i) * stride + j]);
            for (int h = 0; h < NB; h++)
                out[(size_t)(h0 + h) * D + j] += w[(h0 + h) * TILE + i] * z;
        }
}

void
tqkv__attn_bf16_avx512(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v, uint32_t T,
                       size_t stride, uint32_t D, float sm_scale, float *out, float *m, float *l,
                       float *scratch, const void *pfk, const void *pfv, size_t pf_bytes)
{
    float *sc = scratch;
    for (uint32_t t0 = 0; t0 < T; t0 += TILE) {
        uint32_t n = T - t0 < TILE ? T - t0 : TILE;
        for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
            uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define SCORE(K)                                                                                   \
    bf16_score_tile(q, k, v, stride, D, t0, n, h0, K, sm_scale, sc, pfk, pfv, pf_bytes, T)
            TQKV__NB_DISPATCH(nb, SCORE)
#undef SCORE
        }
        for (uint32_t h = 0; h < G; h++) {
            float alpha = tqkv__softmax_tile(sc + h * TILE, n, &m[h], &l[h]);
            if (alpha != 1.0f)
                rescale(out + (size_t)h * D, D, alpha);
        }
        for (uint32_t h0 = 0; h0 < G; h0 += MAXNB) {
            uint32_t nb = G - h0 < MAXNB ? G - h0 : MAXNB;
#define VALUE(K) bf16_value_tile(v, stride, D, t0, n, out, sc, h0, K)
            TQKV__NB_DISPATCH(nb, VALUE)
#undef VALUE
        }
    }
}

/* ---- randomized Hadamard (n a multiple of 16) ---- */

/* In-place unnormalized FWHT of n = 16k floats, the butterflies of fwht_avx2 in the same
 * order (so the same bits): stages 1, 2, 4, 8 inside each register, then pairs. */
static void
fwht_avx512(float *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i), t;
        t = _mm512_permute_ps(v, 0xB1);
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xAAAA, t, v);
        t = _mm512_permute_ps(v, 0x4E);
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xCCCC, t, v);
        t = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1));
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xF0F0, t, v);
        t = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2));
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xFF00, t, v);
        _mm512_storeu_ps(x + i, v);
    }
    for (uint32_t h = 16; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            for (uint32_t j = i; j < i + h; j += 16) {
                __m512 a = _mm512_loadu_ps(x + j), c = _mm512_loadu_ps(x + j + h);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, c));
                _mm512_storeu_ps(x + j + h, _mm512_sub_ps(a, c));
            }
}

/* The butterflies of fwht_avx512 on NR = n / 16 registers (n <= 128), same order. */
static inline __attribute__((always_inline)) void
fwht_regs(__m512 *v, const int NR)
{
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        __m512 t = _mm512_permute_ps(v[r], 0xB1);
        v[r] = _mm512_mask_sub_ps(_mm512_add_ps(v[r], t), 0xAAAA, t, v[r]);
        t = _mm512_permute_ps(v[r], 0x4E);
        v[r] = _mm512_mask_sub_ps(_mm512_add_ps(v[r], t), 0xCCCC, t, v[r]);
        t = _mm512_shuffle_f32x4(v[r], v[r], _MM_SHUFFLE(2, 3, 0, 1));
        v[r] = _mm512_mask_sub_ps(_mm512_add_ps(v[r], t), 0xF0F0, t, v[r]);
        t = _mm512_shuffle_f32x4(v[r], v[r], _MM_SHUFFLE(1, 0, 3, 2));
        v[r] = _mm512_mask_sub_ps(_mm512_add_ps(v[r], t), 0xFF00, t, v[r]);
    }
#pragma GCC unroll 8
    for (int h = 1; h < NR; h <<= 1)
#pragma GCC unroll 8
        for (int i = 0; i < NR; i += h << 1)
#pragma GCC unroll 8
            for (int j = i; j < i + h; j++) {
                __m512 a = v[j], c = v[j + h];
                v[j] = _mm512_add_ps(a, c);
                v[j + h] = _mm512_sub_ps(a, c);
            }
}

/* tqkv__attn_hadamard_avx512 for n = 16 NR, all in registers. */
static inline __attribute__((always_inline)) void
hadamard_regs(const float *signs, const float *x, float *y, int transpose, const int NR)
{
    const uint32_t n = 16 * (uint32_t)NR;
    const __m512 inv = _mm512_set1_ps(1.0f / (float)n);
    const float *first = transpose ? signs + n : signs, *second = transpose ? signs : signs + n;
    __m512 v[8];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        v[r] = _mm512_loadu_ps(x + 16 * r);
        if (!transpose)
            v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps(first + 16 * r));
    }
    fwht_regs(v, NR);
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
        v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps((transpose ? first : second) + 16 * r));
    fwht_regs(v, NR);
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        v[r] = _mm512_mul_ps(v[r], inv);
        if (transpose)
            v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps(second + 16 * r));
        _mm512_storeu_ps(y + 16 * r, v[r]);
    }
}

void
tqkv__attn_hadamard_avx512(const float *signs, uint32_t n, const float *x, float *y, int transpose)
{
    const __m512 inv = _mm512_set1_ps(1.0f / (float)n);
    const float *first = transpose ? signs + n : signs, *second = transpose ? signs : signs + n;
    uint32_t i;
    switch (n) {
    case 16:
        hadamard_regs(signs, x, y, transpose, 1);
        return;
    case 32:
        hadamard_regs(signs, x, y, transpose, 2);
        return;
    case 64:
        hadamard_regs(signs, x, y, transpose, 4);
        return;
    case 128:
        hadamard_regs(signs, x, y, transpose, 8);
        return;
    }
    if (transpose) {
        memcpy(y, x, sizeof(float) * n);
    } else {
        for (i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i,
                             _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(first + i)));
    }
    fwht_avx512(y, n);
    for (i = 0; i < n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i),
                                              _mm512_loadu_ps((transpose ? first : second) + i)));
    fwht_avx512(y, n);
    for (i = 0; i < n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(y + i), inv);
        if (transpose)
            v = _mm512_mul_ps(v, _mm512_loadu_ps(second + i));
        _mm512_storeu_ps(y + i, v);
    }
}
