/* page_decode.c - TurboQuant page decode (tqkv_page_decode_f32/_bf16 and _ref): the SIMD
 * kernels for mse groups, the reference for the rest, lossless tensors copied out.
 * Reentrant.
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

/* ---- decode ---- */

/* A group the SIMD decoder handles: mse, Hadamard or dense, g a multiple of 16. */
static int
simd_group(const tqkv__group_ctx_t *G)
{
    return G->L.mode == TQKV_MODE_MSE && G->rot && G->L.dim % 16 == 0 &&
           (G->rot->kind == TQKV_ROT_DENSE ? tqkv__page_kernels()->dec_dense != NULL
                                           : tqkv__page_kernels()->dec_had != NULL);
}

/* Decodes rows of a simd_group. */
static void
dec_rows(const tqkv__group_ctx_t *G, const tqkv__dec_rows_t *A)
{
    if (G->rot->kind == TQKV_ROT_DENSE)
        tqkv__page_kernels()->dec_dense(A, G->rot->matrix);
    else
        tqkv__page_kernels()->dec_had(A);
}

/* f32 -> BF16, nearest even, saturating at +-max finite; f finite. */
static inline uint16_t
bf16_sat_finite(float f)
{
    uint32_t u;
    uint16_t h;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    h = (uint16_t)(u >> 16);
    return (h & 0x7fffu) == 0x7f80u ? (uint16_t)((h & 0x8000u) | 0x7f7fu) : h;
}

/* Fast decode of centered and/or two-group tensors, per head: each group decoded (SIMD,
 * adding its channels' key means, clamping and rounding; or the reference for
 * prod/dense groups) into [T][D] rows holding group 0's channels then group 1's
 * (perm[c]: position of channel c), then the rows gathered back into channel order. */
static tqkv_status_t
decode_tensor_fast(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t,
                   const tqkv__group_ctx_t *G, const tqkv_group_view_t *gv, float *out_f,
                   uint16_t *out_h)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t T = h->num_tokens, H = h->num_kv_heads, D = h->head_dim;
    const uint32_t ngroups = td->lo_bits ? 2 : 1;
    const int centered = t == TQKV_TENSOR_K && (h->flags & TQKV_PAGE_KEY_CENTERED);
    float *bf = out_f ? malloc(sizeof(float) * TQKV__PROD_BLOCK * D) : NULL;
    uint16_t *bh = out_h ? malloc(sizeof(uint16_t) * TQKV__PROD_BLOCK * D) : NULL;
    float *work = malloc(sizeof(float) * 2 * D), *mug = malloc(sizeof(float) * D);
    double *o = malloc(sizeof(double) * D);
    uint32_t *perm = malloc(sizeof(uint32_t) * D);
    float *qs = malloc(sizeof(float) * 4 * TQKV__PROD_BLOCK * D),
          *qa = qs ? qs + TQKV__PROD_BLOCK * D : NULL;
    float *zr = qs ? qs + 2 * TQKV__PROD_BLOCK * D : NULL,
          *za = qs ? qs + 3 * TQKV__PROD_BLOCK * D : NULL;
    tqkv_status_t st = TQKV_OK;
    if ((out_f && !bf) || (out_h && !bh) || !work || !mug || !o || !perm || !qs) {
        st = TQKV_ENOMEM;
        goto out;
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const uint8_t *mask = tqkv_page_mask(page, t, hh);
        const float *mu = centered ? tqkv_page_key_mean(page, hh) : NULL;
        uint32_t m0 = 0, m1 = gv[0].L.dim;
        for (uint32_t c = 0; c < D; c++)
            perm[c] = (!mask || ((mask[c >> 3] >> (c & 7u)) & 1u)) ? m0++ : m1++;
        if (mu)
            for (uint32_t c = 0; c < D; c++)
                mug[perm[c]] = mu[c];
        /* blocks of TQKV__PROD_BLOCK tokens: the permuted rows stay in L1 */
        for (uint32_t t0 = 0; t0 < T; t0 += TQKV__PROD_BLOCK) {
            const uint32_t nb = T - t0 < TQKV__PROD_BLOCK ? T - t0 : TQKV__PROD_BLOCK;
            const size_t ob =
                ((size_t)t0 * H + hh) * D; /* output offset of the block's first row */
            for (uint32_t gi = 0; gi < ngroups; gi++) {
                const tqkv_group_view_t *v = &gv[gi];
                const uint32_t g = v->L.dim, off = gi ? gv[0].L.dim : 0;
                if (simd_group(&G[gi])) {
                    tqkv__dec_rows_t A = {.idx =
                                              v->idx + ((size_t)t0 * H + hh) * v->L.idx_row_bytes,
                                          .idx_stride = (size_t)H * v->L.idx_row_bytes,
                                          .scale = v->scale + (size_t)t0 * H + hh,
                                          .scale_stride = H,
                                          .n = nb,
                                          .g = g,
                                          .bits = v->L.mse_bits,
                                          .signs = G[gi].rot->signs,
                                          .z = v->codebook,
                                          .mu = mu ? mug + off : NULL,
                                          .out_f = bf ? bf + off : NULL,
                                          .out_h = bh ? bh + off : NULL,
                                          .out_stride = D};
                    dec_rows(&G[gi], &A);
                    continue;
                }
                const int qb =
                    v->signs && G[gi].qjl && g % 16 == 0 && tqkv__page_kernels()->rows_mm;
                const int mb =
                    qb && v->L.mse_bits && G[gi].rot && G[gi].rot->kind == TQKV_ROT_DENSE;
                for (uint32_t tt = t0; tt < t0 + nb; tt++) {
                    uint64_t i = (uint64_t)tt * H + hh;
                    float sc = tqkv_scale_get(v->scale, i);
                    float gm = v->gamma ? tqkv_scale_get(v->gamma, i) : 0.0f;
                    if (qb && tt % TQKV__PROD_BLOCK == 0) {
                        /* the QJL products S^T sign of the next block of vectors at once */
                        for (uint32_t r = 0; r < nb; r++) {
                            const uint8_t *sr =
                                v->signs + ((uint64_t)(tt + r) * H + hh) * v->L.sign_row_bytes;
                            for (uint32_t j = 0; j < g; j++)
                                qs[(size_t)r * g + j] =
                                    ((sr[j >> 3] >> (j & 7u)) & 1u) ? 1.0f : -1.0f;
                        }
                        tqkv__page_kernels()->rows_mm(G[gi].qjl->matrix, g, qs, qa, nb);
                        if (mb) { /* and the dense Pi^T z[idx] */
                            for (uint32_t r = 0; r < nb; r++) {
                                const uint8_t *ir =
                                    v->idx + ((uint64_t)(tt + r) * H + hh) * v->L.idx_row_bytes;
                                for (uint32_t j = 0; j < g; j++)
                                    zr[(size_t)r * g + j] =
                                        v->codebook[tqkv_bits_get(ir, j, v->L.mse_bits)];
                            }
                            tqkv__page_kernels()->rows_mm(G[gi].rot->matrix, g, zr, za, nb);
                        }
                    }
                    if (qb)
                        tqkv__decode_vec_prod(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                                              mb ? za + (size_t)(tt % TQKV__PROD_BLOCK) * g : NULL,
                                              qa + (size_t)(tt % TQKV__PROD_BLOCK) * g, work, o);
                    else
                        tqkv__decode_vec_ref(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                                             v->signs ? v->signs + i * v->L.sign_row_bytes : NULL,
                                             work, o);
                    for (uint32_t j = 0; j < g; j++) {
                        float f = tqkv_clamp_flt(o[j]);
                        if (mu) {
                            f += mug[off + j];
                            f = f > FLT_MAX ? FLT_MAX : (f < -FLT_MAX ? -FLT_MAX : f);
                        }
                        if (bf)
                            bf[(size_t)(tt - t0) * D + off + j] = f;
                        if (bh)
                            bh[(size_t)(tt - t0) * D + off + j] = bf16_sat_finite(f);
                    }
                }
            }
            if (mask && tqkv__page_vbmi2() && D % 32 == 0) {
                tqkv__merge_rows_vbmi2(bf, bh, out_f ? out_f + ob : NULL, out_h ? out_h + ob : NULL,
                                       (size_t)H * D, nb, D, mask, gv[0].L.dim);
                continue;
            }
            for (uint32_t tt = t0; tt < t0 + nb; tt++) {
                uint64_t i = (uint64_t)tt * H + hh;
                if (bf) {
                    const float *r = bf + (size_t)(tt - t0) * D;
                    float *w = out_f + i * D;
                    for (uint32_t c = 0; c < D; c++)
                        w[c] = r[perm[c]];
                }
                if (bh) {
                    const uint16_t *r = bh + (size_t)(tt - t0) * D;
                    uint16_t *w = out_h + i * D;
                    for (uint32_t c = 0; c < D; c++)
                        w[c] = r[perm[c]];
                }
            }
        }
    }
out:
    free(bf);
    free(bh);
    free(work);
    free(mug);
    free(o);
    free(perm);
    free(qs);
    return st;
}

static tqkv_status_t
decode_tensor(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, float *out_f,
              uint16_t *out_h, int fast)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t H = h->num_kv_heads, D = h->head_dim;
    const uint64_t n = (uint64_t)h->num_tokens * H;
    const uint32_t ngroups = td->lo_bits ? 2 : 1;
    const float *mean = t == TQKV_TENSOR_K ? tqkv_page_key_mean(page, 0) : NULL;
    tqkv__group_ctx_t G[2];
    tqkv_group_view_t gv[2];
    uint32_t *chan[2] = {NULL, NULL};
    float *work = NULL;
    double *o = NULL, *row = NULL;
    tqkv_status_t st = TQKV_OK;
    int ng_init = 0;

    for (uint32_t gi = 0; gi < ngroups; gi++) {
        if (tqkv_page_group_view(page, t, gi, &gv[gi]) != 0) {
            st = TQKV_EINTERNAL;
            goto out;
        }
        if ((st = tqkv__group_ctx_init(&G[gi], gv[gi].L.dim, gv[gi].L.bits, gv[gi].L.mode, n,
                                       h->rotation, h->seed, t, gi, 0)) != TQKV_OK)
            goto out;
        ng_init++;
        G[gi].z = gv[gi].codebook;
    }
    if (fast && ngroups == 1 && !mean && simd_group(&G[0])) {
        /* the common case: rows straight into the output */
        tqkv__dec_rows_t A = {.idx = gv[0].idx,
                              .idx_stride = gv[0].L.idx_row_bytes,
                              .scale = gv[0].scale,
                              .scale_stride = 1,
                              .n = n,
                              .g = D,
                              .bits = gv[0].L.mse_bits,
                              .signs = G[0].rot->signs,
                              .z = gv[0].codebook,
                              .out_f = out_f,
                              .out_h = out_h,
                              .out_stride = D};
        dec_rows(&G[0], &A);
        goto out;
    }
    if (fast && ngroups == 1 && simd_group(&G[0])) {
        /* centered keys, one group: per head (adding its mean), rows strided by H */
        for (uint32_t hh = 0; hh < H; hh++) {
            tqkv__dec_rows_t A = {.idx = gv[0].idx + (size_t)hh * gv[0].L.idx_row_bytes,
                                  .idx_stride = (size_t)H * gv[0].L.idx_row_bytes,
                                  .scale = gv[0].scale + hh,
                                  .scale_stride = H,
                                  .n = h->num_tokens,
                                  .g = D,
                                  .bits = gv[0].L.mse_bits,
                                  .signs = G[0].rot->signs,
                                  .z = gv[0].codebook,
                                  .mu = tqkv_page_key_mean(page, hh),
                                  .out_f = out_f ? out_f + (size_t)hh * D : NULL,
                                  .out_h = out_h ? out_h + (size_t)hh * D : NULL,
                                  .out_stride = (size_t)H * D};
            dec_rows(&G[0], &A);
        }
        goto out;
    }
    if (fast) {
        st = decode_tensor_fast(page, h, t, G, gv, out_f, out_h);
        goto out;
    }
    chan[0] = malloc(sizeof(uint32_t) * D);
    chan[1] = malloc(sizeof(uint32_t) * D);
    work = malloc(sizeof(float) * 2 * D);
    o = malloc(sizeof(double) * D);
    row = malloc(sizeof(double) * D);
    if (!chan[0] || !chan[1] || !work || !o || !row) {
        st = TQKV_ENOMEM;
        goto out;
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const uint8_t *mask = tqkv_page_mask(page, t, hh);
        const float *mu = mean ? tqkv_page_key_mean(page, hh) : NULL;
        uint32_t n0 = 0, n1 = 0;
        for (uint32_t c = 0; c < D; c++) {
            if (!mask || ((mask[c >> 3] >> (c & 7u)) & 1u))
                chan[0][n0++] = c;
            else
                chan[1][n1++] = c;
        }
        for (uint64_t i = hh; i < n; i += H) {
            for (uint32_t gi = 0; gi < ngroups; gi++) {
                const tqkv_group_view_t *v = &gv[gi];
                float sc = tqkv_scale_get(v->scale, i);
                float gm = v->gamma ? tqkv_scale_get(v->gamma, i) : 0.0f;
                tqkv__decode_vec_ref(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                                     v->signs ? v->signs + i * v->L.sign_row_bytes : NULL, work, o);
                for (uint32_t j = 0; j < v->L.dim; j++)
                    row[chan[gi][j]] = o[j];
            }
            for (uint32_t c = 0; c < D; c++) {
                float f = tqkv_clamp_flt(mu ? row[c] + mu[c] : row[c]);
                if (out_f)
                    out_f[i * D + c] = f;
                if (out_h)
                    out_h[i * D + c] = tqkv_f32_to_bf16_sat(f);
            }
        }
    }
out:
    for (int gi = 0; gi < ng_init; gi++)
        tqkv__group_ctx_fini(&G[gi]);
    free(chan[0]);
    free(chan[1]);
    free(work);
    free(o);
    free(row);
    return st;
}

/* A raw (lossless) tensor: BF16 out byte for byte, f32 out widened (exact). */
static void
decode_raw(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, float *out_f,
           uint16_t *out_h)
{
    const uint16_t *x = tqkv_page_raw(page, t);
    const uint64_t count = (uint64_t)h->num_tokens * h->num_kv_heads * h->head_dim;
    if (out_h)
        memcpy(out_h, x, 2 * count);
    if (out_f)
        for (uint64_t i = 0; i < count; i++)
            out_f[i] = tqkv_bf16_to_f32(x[i]);
}

static tqkv_status_t
decode(const void *page, size_t len, float *kf, float *vf, uint16_t *kh, uint16_t *vh, int fast)
{
    tqkv_page_info_t info;
    tqkv_status_t st;
    float *of[2] = {kf, vf};
    uint16_t *oh[2] = {kh, vh};
    if ((st = tqkv_page_validate(page, len, 0, &info, NULL, 0)) != TQKV_OK)
        return st;
    for (uint32_t t = 0; t < 2; t++) {
        if (!info.hdr->tensor[t].bits_x2 || (!of[t] && !oh[t]))
            continue;
        if (info.hdr->tensor[t].mode == TQKV_MODE_RAW) {
            decode_raw(page, info.hdr, t, of[t], oh[t]);
            continue;
        }
        if ((st = decode_tensor(page, info.hdr, t, of[t], oh[t], fast)) != TQKV_OK)
            return st;
    }
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_decode_f32_ref(const void *page, size_t len, float *k, float *v)
{
    return decode(page, len, k, v, NULL, NULL, 0);
}

tqkv_status_t
tqkv_page_decode_f32(const void *page, size_t len, float *k, float *v)
{
    return decode(page, len, k, v, NULL, NULL, 1);
}

tqkv_status_t
tqkv_page_decode_bf16(const void *page, size_t len, uint16_t *k, uint16_t *v)
{
    return decode(page, len, NULL, NULL, k, v, 1);
}
