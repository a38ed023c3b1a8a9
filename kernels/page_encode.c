/* page_encode.c - TurboQuant page encode (tqkv_page_encode, tqkv_page_encode_ref).
 *
 * Key means, channel energies and outlier selection in f64, then per group and head the
 * SIMD kernels of the page kernel table where they apply and the reference
 * (tqkv__encode_vec_ref, tq_math.h) for the rest (page.c's header comment has the rules).
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
#include "kernels/errtext.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* ---- encode ---- */

/* Finds the first NaN/Inf of a [T][H][D] BF16 tensor; 0 when all finite. */
int
tqkv__find_nonfinite(const uint16_t *x, uint64_t count, uint64_t *where)
{
    uint32_t bad = 0;
    uint64_t i = 0;
    /* branch-free scan in chunks (vectorizes), then locate */
    for (; i < count; i += 4096) {
        uint64_t e = i + 4096 < count ? i + 4096 : count;
        for (uint64_t k = i; k < e; k++)
            bad |= (x[k] & 0x7f80u) == 0x7f80u;
        if (bad) {
            for (uint64_t k = i; k < e; k++)
                if (tqkv_bf16_is_nonfinite(x[k])) {
                    *where = k;
                    return 1;
                }
        }
    }
    return 0;
}

/* Picks the n_hi highest-energy channels (ties to the lower index) into mask (ceil(D/8)
 * bytes, zeroed): channel c is in when its rank (tqkv_energy_rank: energy descending,
 * ties to the lower index) is below n_hi. Linear time: the n_hi-th largest energy by
 * quickselect on a copy (tmp[d]), then every channel above it and the lowest-indexed
 * ones equal to it. Energies are finite. Reentrant. */
static void
select_outliers(const double *energy, uint32_t d, uint32_t n_hi, uint8_t *mask, double *tmp)
{
    int lo = 0, hi = (int)d - 1, k = (int)n_hi - 1;
    uint32_t gt = 0, need;
    double thr;
    memcpy(tmp, energy, sizeof(double) * d);
    while (lo < hi) { /* k-th largest (0-based) of tmp[lo..hi] */
        const double p = tmp[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (tmp[i] > p)
                i++;
            while (tmp[j] < p)
                j--;
            if (i <= j) {
                double w = tmp[i];
                tmp[i++] = tmp[j];
                tmp[j--] = w;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    thr = tmp[k];
    for (uint32_t c = 0; c < d; c++)
        gt += energy[c] > thr;
    need = n_hi - gt;
    for (uint32_t c = 0; c < d; c++) {
        int in = energy[c] > thr;
        if (!in && energy[c] == thr && need) {
            in = 1;
            need--;
        }
        if (in)
            mask[c >> 3] |= (uint8_t)(1u << (c & 7u));
    }
}

/* tqkv__encode_vec_ref of a prod vector up to its QJL product (tq_math.h
 * tqkv_group_encode_vec_pre), leaving u = r / ||r|| in u_out (g floats) for S u, taken for
 * a block of vectors by the kernel table's rows_mm (bit for bit tqkv_matvec). Returns 0
 * for a zero vector (finished: scale and gamma 0, every sign set). work: 3g floats. */
static int
encode_vec_prod_pre(const tqkv__group_ctx_t *G, const double *x, float *work, uint16_t *scale,
                    uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row, float *u_out)
{
    tqkv_group_codec_t C;
    tqkv__group_codec(G, &C);
    return tqkv_group_encode_vec_pre(&C, x, work, scale, gamma, idx_row, sign_row, u_out);
}

/* Prod rows [0, T) of head hh (see encode_group_head) with the QJL products of
 * TQKV__PROD_BLOCK vectors at a time. Returns 0 when out of memory (nothing written). */
static int
encode_group_head_prod(const tqkv__group_ctx_t *G, uint8_t *base, const uint16_t *xg, size_t xs,
                       const float *mug, uint32_t T, uint64_t hh, uint64_t H, double *gx,
                       float *work)
{
    const uint32_t g = G->L.dim;
    uint16_t *scale = (uint16_t *)(base + G->L.off_scale);
    uint16_t *gamma = (uint16_t *)(base + G->L.off_gamma);
    uint8_t *idx = base + G->L.off_idx, *signs = base + G->L.off_signs;
    float *ub = malloc(sizeof(float) * 2 * TQKV__PROD_BLOCK * g),
          *yb = ub ? ub + TQKV__PROD_BLOCK * g : NULL;
    uint8_t live[TQKV__PROD_BLOCK];
    if (!ub)
        return 0;
    for (uint32_t t0 = 0; t0 < T; t0 += TQKV__PROD_BLOCK) {
        const uint32_t nb = T - t0 < TQKV__PROD_BLOCK ? T - t0 : TQKV__PROD_BLOCK;
        for (uint32_t r = 0; r < nb; r++) {
            const uint64_t i = (uint64_t)(t0 + r) * H + hh;
            const uint16_t *xr = xg + (size_t)(t0 + r) * xs;
            for (uint32_t j = 0; j < g; j++)
                gx[j] = (double)tqkv_bf16_to_f32(xr[j]) - (mug ? (double)mug[j] : 0.0);
            live[r] = (uint8_t)encode_vec_prod_pre(
                G, gx, work, scale + i, gamma + i, idx + i * G->L.idx_row_bytes,
                signs + i * G->L.sign_row_bytes, ub + (size_t)r * g);
            if (!live[r])
                memset(ub + (size_t)r * g, 0, sizeof(float) * g);
        }
        tqkv__page_kernels()->rows_mm(G->qjl->matrix_t, g, ub, yb, nb);
        for (uint32_t r = 0; r < nb; r++) {
            uint8_t *sr = signs + ((uint64_t)(t0 + r) * H + hh) * G->L.sign_row_bytes;
            if (!live[r])
                continue;
            for (uint32_t j = 0; j < g; j++)
                if (yb[(size_t)r * g + j] >= 0.0f)
                    sr[j >> 3] |= (uint8_t)(1u << (j & 7u));
        }
    }
    free(ub);
    return 1;
}

/* Encodes rows [0, T) of head hh of one group: the SIMD kernel when it applies, the
 * reference for the rows it hands back (and for everything else). xg: the group's BF16
 * rows (stride xs elements); mug: the group's f32 key mean or NULL. */
static void
encode_group_head(const tqkv__group_ctx_t *G, uint8_t *base, const uint16_t *xg, size_t xs,
                  const float *mug, uint32_t T, uint64_t hh, uint64_t H, int fast, double *gx,
                  float *work)
{
    const uint32_t g = G->L.dim;
    const int prod = G->L.mode == TQKV_MODE_PROD;
    const int dense = G->rot && G->rot->kind == TQKV_ROT_DENSE;
    const int simd =
        fast && !prod && G->rot && g % 16 == 0 && /* (kernels: g a multiple of 16) */
        (dense ? tqkv__page_kernels()->enc_dense != NULL : tqkv__page_kernels()->enc_had != NULL);
    uint16_t *scale = (uint16_t *)(base + G->L.off_scale);
    uint16_t *gamma = prod ? (uint16_t *)(base + G->L.off_gamma) : NULL;
    uint8_t *idx = base + G->L.off_idx;
    uint8_t *signs = prod ? base + G->L.off_signs : NULL;
    tqkv__enc_rows_t A;
    uint32_t t = 0;
    if (fast && prod && G->qjl && G->qjl->matrix_t && g % 16 == 0 &&
        tqkv__page_kernels()->rows_mm &&
        encode_group_head_prod(G, base, xg, xs, mug, T, hh, H, gx, work))
        return;
    memset(&A, 0, sizeof A);
    if (simd) {
        A.x_stride = xs;
        A.mu = mug;
        A.g = g;
        A.bits = G->L.mse_bits;
        A.norm_corrected = G->norm_corrected;
        A.signs = G->rot->signs;
        A.z = G->cb->z;
        A.thr = G->cb->thr;
        A.scale_stride = H;
        A.idx_stride = H * G->L.idx_row_bytes;
    }
    while (t < T) {
        uint64_t i;
        const uint16_t *xr;
        if (simd) {
            i = (uint64_t)t * H + hh;
            A.x = xg + (size_t)t * xs;
            A.n = T - t;
            A.scale = scale + i;
            A.idx = idx + i * G->L.idx_row_bytes;
            t += (uint32_t)(dense ? tqkv__page_kernels()->enc_dense(&A, G->rot->matrix_t)
                                  : tqkv__page_kernels()->enc_had(&A));
            if (t >= T)
                break;
        }
        /* row t by the reference (all rows, or one the kernel handed back) */
        i = (uint64_t)t * H + hh;
        xr = xg + (size_t)t * xs;
        for (uint32_t j = 0; j < g; j++)
            gx[j] = (double)tqkv_bf16_to_f32(xr[j]) - (mug ? (double)mug[j] : 0.0);
        tqkv__encode_vec_ref(G, gx, work, scale + i, gamma ? gamma + i : NULL,
                             idx + i * G->L.idx_row_bytes,
                             signs ? signs + i * G->L.sign_row_bytes : NULL);
        t++;
    }
}

/* The centering decision of one head (rows x + t * xs): zeroes its mean row mh unless
 * centering lowers the tokens' mean relative energy (tq_math.h tqkv_center_keep). */
static void
center_decide(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, float *mh, int fast)
{
    uint64_t votes, nonzero;
    (fast ? tqkv__center_votes : tqkv__center_votes_ref)(x, xs, T, D, mh, &votes, &nonzero);
    if (!tqkv_center_keep(votes, nonzero))
        memset(mh, 0, sizeof(float) * D);
}

static tqkv_status_t
encode_tensor(const tqkv_page_header_t *h, uint32_t t, const uint16_t *x, uint8_t *page, int fast,
              char *err, size_t errlen)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t T = h->num_tokens, H = h->num_kv_heads, D = h->head_dim;
    const uint64_t n = (uint64_t)T * H, HD = (uint64_t)H * D;
    const uint32_t ngroups = td->lo_bits ? 2 : 1, mrow = (D + 7) / 8;
    const int centered = t == TQKV_TENSOR_K && (h->flags & TQKV_PAGE_KEY_CENTERED);
    tqkv__group_ctx_t G[2];
    float *mean = centered ? (float *)(page + h->mean_offset) : NULL;
    double *acc = NULL, *gx = NULL;
    float *work = NULL, *mug = NULL;
    uint16_t *xg = NULL;
    uint32_t *chan[2] = {NULL, NULL}, gdim[2];
    tqkv_status_t st = TQKV_OK;
    uint64_t where;
    int ng_init = 0;

    if (tqkv__find_nonfinite(x, n * D, &where))
        return tqkv_errtext(
            TQKV_ERANGE, err, errlen,
            "%s: non-finite value (NaN or Inf) at token %llu, head %llu, channel %llu",
            tqkv__tensor_name[t], (unsigned long long)(where / HD),
            (unsigned long long)(where / D % H), (unsigned long long)(where % D));
    if (td->mode == TQKV_MODE_RAW) { /* lossless: the input as it came */
        memcpy(page + td->group_offset[0], x, 2 * n * D);
        return TQKV_OK;
    }
    gdim[0] = td->n_hi;
    gdim[1] = D - td->n_hi;
    for (uint32_t gi = 0; gi < ngroups; gi++) {
        uint32_t bits = gi == 0 ? td->hi_bits : td->lo_bits;
        if ((st = tqkv__group_ctx_init(&G[gi], gdim[gi], bits, td->mode, n, h->rotation, h->seed, t,
                                       gi, 1)) != TQKV_OK)
            goto out;
        ng_init++;
        G[gi].norm_corrected = (td->flags & TQKV_TENSOR_NORM_CORRECTED) != 0;
        /* the stored codebook: z, unused slots zero */
        if (G[gi].cb)
            memcpy(page + td->group_offset[gi], G[gi].cb->z, 4 * G[gi].L.n_centroids);
    }
    acc = malloc(sizeof(double) * HD);
    gx = malloc(sizeof(double) * D);
    work = malloc(sizeof(float) * 3 * D);
    chan[0] = malloc(sizeof(uint32_t) * D);
    chan[1] = malloc(sizeof(uint32_t) * D);
    xg = malloc(sizeof(uint16_t) * (size_t)T * D);
    mug = malloc(sizeof(float) * D);
    if (!acc || !gx || !work || !chan[0] || !chan[1] || !xg || !mug) {
        st = TQKV_ENOMEM;
        goto out;
    }
    if (centered) {
        /* mu = (float)(sum_t x / T), f64 sums in token order; a head with some
         * |x - mu| > 2^126 keeps mu = 0 (centered values stay within f32). Then the head
         * keeps mu only where centering lowers its tokens' mean relative energy
         * (tq_math.h tqkv_center_keep), else its mean row is zeros: stored uncentered.
         * Head by head, so the decision reads the head's rows while they are in cache. */
        uint16_t maxmag = 0; /* |x| <= 2^125 everywhere => |x - mu| <= 2^126 */
        uint8_t *late = calloc(H, 1);
        if (!late) {
            st = TQKV_ENOMEM;
            goto out;
        }
        memset(acc, 0, sizeof(double) * HD);
        for (uint32_t hh = 0; hh < H; hh++) {
            uint16_t mh = 0;
            for (uint32_t tt = 0; tt < T; tt++)
                mh = tqkv__sum_accum(acc + (uint64_t)hh * D, x + tt * HD + (uint64_t)hh * D, D, mh);
            for (uint64_t k = (uint64_t)hh * D; k < (uint64_t)(hh + 1) * D; k++)
                mean[k] = (float)(acc[k] / T);
            if (mh > 0x7e00u) /* 2^125: decided after the deviation check below */
                late[hh] = 1;
            else
                center_decide(x + (uint64_t)hh * D, HD, T, D, mean + (uint64_t)hh * D, fast);
            maxmag = mh > maxmag ? mh : maxmag;
        }
        if (maxmag > 0x7e00u) {
            memset(acc, 0, sizeof(double) * HD);
            for (uint32_t tt = 0; tt < T; tt++)
                for (uint64_t k = 0; k < HD; k++) {
                    double dv = fabs((double)tqkv_bf16_to_f32(x[tt * HD + k]) - mean[k]);
                    acc[k] = dv > acc[k] ? dv : acc[k];
                }
            for (uint32_t hh = 0; hh < H; hh++) {
                int big = 0;
                if (!late[hh])
                    continue;
                for (uint32_t c = 0; c < D; c++)
                    big |= acc[(uint64_t)hh * D + c] > 0x1p126;
                if (big)
                    memset(mean + (uint64_t)hh * D, 0, sizeof(float) * D);
                center_decide(x + (uint64_t)hh * D, HD, T, D, mean + (uint64_t)hh * D, fast);
            }
        }
        free(late);
    }
    if (ngroups == 2) {
        /* energy sum_t (x - mu)^2 per (head, channel), f64 in token order */
        memset(acc, 0, sizeof(double) * HD);
        for (uint32_t tt = 0; tt < T; tt++)
            tqkv__energy_accum(acc, x + tt * HD, mean, HD);
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const float *mu = mean ? mean + (uint64_t)hh * D : NULL;
        if (ngroups == 1) {
            /* the head's rows in place: stride H*D */
            encode_group_head(&G[0], page + td->group_offset[0], x + (uint64_t)hh * D, HD, mu, T,
                              hh, H, fast, gx, work);
            continue;
        }
        {
            /* two groups: the head's rows permuted into [T][D] rows of group 0's channels
             * then group 1's (perm[c]: position of channel c), one pass per token */
            uint8_t *mask = page + td->mask_offset + (uint64_t)hh * mrow;
            uint32_t *perm = chan[0], n0 = 0, n1 = gdim[0];
            select_outliers(acc + (uint64_t)hh * D, D, td->n_hi, mask, gx);
            for (uint32_t c = 0; c < D; c++)
                perm[c] = ((mask[c >> 3] >> (c & 7u)) & 1u) ? n0++ : n1++;
            if (fast && tqkv__page_vbmi2() && D % 32 == 0)
                tqkv__split_rows_vbmi2(x + (uint64_t)hh * D, HD, xg, T, D, mask, gdim[0]);
            else
                for (uint32_t tt = 0; tt < T; tt++) {
                    const uint16_t *xr = x + tt * HD + (uint64_t)hh * D;
                    uint16_t *o = xg + (size_t)tt * D;
                    for (uint32_t c = 0; c < D; c++)
                        o[perm[c]] = xr[c];
                }
            if (mu)
                for (uint32_t c = 0; c < D; c++)
                    mug[perm[c]] = mu[c];
            for (uint32_t gi = 0; gi < 2; gi++) {
                const uint32_t off = gi ? gdim[0] : 0;
                encode_group_head(&G[gi], page + td->group_offset[gi], xg + off, D,
                                  mu ? mug + off : NULL, T, hh, H, fast, gx, work);
            }
        }
    }
out:
    for (int gi = 0; gi < ng_init; gi++)
        tqkv__group_ctx_fini(&G[gi]);
    free(acc);
    free(gx);
    free(work);
    free(chan[0]);
    free(chan[1]);
    free(xg);
    free(mug);
    return st;
}

static tqkv_status_t
encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, const uint16_t *k_bf16,
       const uint16_t *v_bf16, void *page, size_t cap, size_t *written, char *err, size_t errlen,
       int fast)
{
    tqkv_page_header_t h;
    tqkv_status_t st;
    const uint16_t *src[2] = {k_bf16, v_bf16};
    uint8_t *p = page;

    if ((st = tqkv__page_plan(shape, codec, &h, err, errlen)) != TQKV_OK)
        return st;
    if (cap < h.page_bytes || !page)
        return tqkv_errtext(TQKV_ENOSPC, err, errlen, "page needs %u bytes, buffer has %zu",
                            h.page_bytes, cap);
    for (uint32_t t = 0; t < 2; t++)
        if (h.tensor[t].bits_x2 && !src[t])
            return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: input missing",
                                tqkv__tensor_name[t]);
    memset(p, 0, h.page_bytes);
    memcpy(p, &h, sizeof h);
    for (uint32_t t = 0; t < 2; t++)
        if (h.tensor[t].bits_x2 &&
            (st = encode_tensor(&h, t, src[t], p, fast, err, errlen)) != TQKV_OK)
            return st;
    h.crc32c = tqkv_page_crc(p, h.page_bytes);
    memcpy(p + 12, &h.crc32c, 4);
    if (written)
        *written = h.page_bytes;
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_encode_ref(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                     const uint16_t *k_bf16, const uint16_t *v_bf16, void *page, size_t cap,
                     size_t *written, char *err, size_t errlen)
{
    return encode(shape, codec, k_bf16, v_bf16, page, cap, written, err, errlen, 0);
}

tqkv_status_t
tqkv_page_encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                 const uint16_t *k_bf16, const uint16_t *v_bf16, void *page, size_t cap,
                 size_t *written, char *err, size_t errlen)
{
    return encode(shape, codec, k_bf16, v_bf16, page, cap, written, err, errlen, 1);
}
