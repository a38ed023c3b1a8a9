/* tq_math.h - per-element math shared by the scalar, SIMD and CUDA code.
 *
 * Everything here is a TQKV_HD (static inline, __host__ __device__ under nvcc)
 * function with no dependency beyond <stdint.h>, so the CPU tests exercise the
 * exact code the GPU kernels run.
 */
#ifndef TQKV_KERNELS_TQ_MATH_H
#define TQKV_KERNELS_TQ_MATH_H

#include <stdint.h>
#include <string.h>

#include "kernels/page_format.h"

/* ---- BF16 <-> f32 ---- */

TQKV_HD float
tqkv_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays a (quiet) NaN; overflow rounds to +-Inf as IEEE does. */
TQKV_HD uint16_t
tqkv_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Saturating variant for reconstructions: finite in, finite out (+-max BF16). */
TQKV_HD uint16_t
tqkv_f32_to_bf16_sat(float f)
{
    uint16_t h = tqkv_f32_to_bf16(f);
    if ((h & 0x7fffu) == 0x7f80u)
        h = (uint16_t)((h & 0x8000u) | 0x7f7fu);
    return h;
}

/* True when a BF16 value is NaN or +-Inf. */
TQKV_HD int
tqkv_bf16_is_nonfinite(uint16_t h)
{
    return (h & 0x7f80u) == 0x7f80u;
}

/* Element i of a BF16 scale or gamma array of a page, widened to f32 (exact). */
TQKV_HD float
tqkv_scale_get(const uint16_t *a, uint64_t i)
{
    return tqkv_bf16_to_f32(a[i]);
}

/* A non-negative f32 scale or gamma as stored (format v2): BF16, round to nearest even,
 * saturating at the largest finite BF16 (f32 inputs near FLT_MAX would round to Inf). */
TQKV_HD uint16_t
tqkv_scale_to_bf16(float f)
{
    return tqkv_f32_to_bf16_sat(f);
}

/* ---- portable PRNG: splitmix64 ---- */

TQKV_HD uint64_t
tqkv_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Purposes for derived seeds. */
enum {
    TQKV_SEED_ROTATION = 1, /* Pi of a group */
    TQKV_SEED_QJL = 2,      /* S of a group */
};

/* The seed of (page seed, tensor, group, purpose): every implementation derives
 * the matrices of a group from this value only. */
TQKV_HD uint64_t
tqkv_seed_derive(uint64_t seed, uint32_t tensor, uint32_t group, uint32_t purpose)
{
    uint64_t s = seed ^ (((uint64_t)purpose << 16) | ((uint64_t)tensor << 8) | (uint64_t)group) *
                            0xd1b54a32d192ed03ull;
    (void)tqkv_splitmix64(&s);
    return tqkv_splitmix64(&s);
}

/* ---- bit streams (LSB-first) ---- */

/* Reads the b-bit field j of a row (b in 1..8). */
TQKV_HD uint32_t
tqkv_bits_get(const uint8_t *row, uint32_t j, uint32_t b)
{
    uint32_t bit = j * b, byte = bit >> 3, sh = bit & 7u;
    uint32_t w = row[byte];
    if (sh + b > 8)
        w |= (uint32_t)row[byte + 1] << 8;
    return (w >> sh) & ((1u << b) - 1u);
}

/* Writes the b-bit field j of a row; the row must start zeroed (fields are OR-ed in). */
TQKV_HD void
tqkv_bits_put(uint8_t *row, uint32_t j, uint32_t b, uint32_t v)
{
    uint32_t bit = j * b, byte = bit >> 3, sh = bit & 7u;
    uint32_t w = (v & ((1u << b) - 1u)) << sh;
    row[byte] |= (uint8_t)w;
    if (sh + b > 8)
        row[byte + 1] |= (uint8_t)(w >> 8);
}

/* ---- codebook search ---- */

/* Index of the nearest centroid given the n-1 ascending decision thresholds
 * (midpoints between neighbouring centroids): the number of thresholds strictly
 * below y. A value exactly on a threshold takes the lower index (the documented
 * near-tie rule every implementation follows). */
TQKV_HD uint32_t
tqkv_nearest_index(float y, const float *thresholds, uint32_t n_centroids)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i + 1 < n_centroids; i++)
        k += y > thresholds[i];
    return k;
}

TQKV_HD int
tqkv_is_pow2(uint32_t x)
{
    return x && !(x & (x - 1));
}

/* Rotation actually used by a group of dimension g under a page's rotation kind. */
TQKV_HD uint32_t
tqkv_group_rotation(uint32_t page_rotation, uint32_t g)
{
    return (page_rotation == TQKV_ROT_HADAMARD && tqkv_is_pow2(g)) ? TQKV_ROT_HADAMARD
                                                                   : TQKV_ROT_DENSE;
}

/* In-place unnormalized fast Walsh-Hadamard transform of length n (power of two). */
TQKV_HD void
tqkv_fwht(float *x, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            for (uint32_t j = i; j < i + h; j++) {
                float a = x[j], c = x[j + h];
                x[j] = a + c;
                x[j + h] = a - c;
            }
}

/* Sign i (0-based) of the random diagonal D1 (which = 0) or D2 (which = 1) of a
 * Hadamard rotation of length g: words w_0, w_1, ... of splitmix64 seeded with the
 * group's rotation seed; D1 uses bits 0..g-1, D2 bits g..2g-1 of the concatenated
 * stream (bit k = bit k%64 of word k/64). Returns +1.f or -1.f (bit set = -1). */
TQKV_HD float
tqkv_hadamard_sign(const uint64_t *words, uint32_t which, uint32_t g, uint32_t i)
{
    uint32_t k = which * g + i;
    return ((words[k >> 6] >> (k & 63u)) & 1u) ? -1.0f : 1.0f;
}

/* ---- navigating a validated page ---- */

/* One group of one tensor of a page, resolved. */
typedef struct tqkv_group_view {
    tqkv_group_layout_t L;
    const uint8_t *base;   /* start of the group section */
    const float *codebook; /* z[L.n_centroids] (centroids * sqrt(g)), ascending */
    const uint16_t *scale; /* [n] BF16 (read with tqkv_scale_get) */
    const uint16_t *gamma; /* [n] BF16 (prod) or NULL */
    const uint8_t *idx;    /* [n][L.idx_row_bytes] */
    const uint8_t *signs;  /* [n][L.sign_row_bytes] (prod) or NULL */
    uint32_t rotation;     /* rotation actually used by this group (tqkv_group_rotation) */
    uint64_t rot_seed;     /* tqkv_seed_derive(seed, tensor, group, TQKV_SEED_ROTATION) */
    uint64_t qjl_seed;     /* tqkv_seed_derive(seed, tensor, group, TQKV_SEED_QJL) */
} tqkv_group_view_t;

/* Resolves group `group` (0 or 1) of tensor `tensor` (TQKV_TENSOR_K/V) of a page that
 * has passed validation. Returns 0, or -1 when that tensor or group is absent or the
 * tensor is raw (TQKV_MODE_RAW has no groups: see tqkv_page_raw). */
TQKV_HD int
tqkv_page_group_view(const void *page, uint32_t tensor, uint32_t group, tqkv_group_view_t *gv)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    const tqkv_page_tensor_desc_t *t = &h->tensor[tensor];
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    uint32_t dim, bits;
    if (t->bits_x2 == 0 || t->mode == TQKV_MODE_RAW || (group == 1 && t->lo_bits == 0) || group > 1)
        return -1;
    dim = group == 0 ? t->n_hi : (uint32_t)h->head_dim - t->n_hi;
    bits = group == 0 ? t->hi_bits : t->lo_bits;
    tqkv_group_layout(dim, bits, t->mode, n, &gv->L);
    gv->base = (const uint8_t *)page + t->group_offset[group];
    gv->codebook = (const float *)(gv->base + gv->L.off_codebook);
    gv->scale = (const uint16_t *)(gv->base + gv->L.off_scale);
    gv->gamma = t->mode == TQKV_MODE_PROD ? (const uint16_t *)(gv->base + gv->L.off_gamma) : 0;
    gv->idx = gv->base + gv->L.off_idx;
    gv->signs = t->mode == TQKV_MODE_PROD ? gv->base + gv->L.off_signs : 0;
    gv->rotation = tqkv_group_rotation(h->rotation, dim);
    gv->rot_seed = tqkv_seed_derive(h->seed, tensor, group, TQKV_SEED_ROTATION);
    gv->qjl_seed = tqkv_seed_derive(h->seed, tensor, group, TQKV_SEED_QJL);
    return 0;
}

/* The raw section (BF16 [T][H][D]) of a TQKV_MODE_RAW tensor of a validated page, or NULL
 * when the tensor is absent or quantized. */
TQKV_HD const uint16_t *
tqkv_page_raw(const void *page, uint32_t tensor)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    const tqkv_page_tensor_desc_t *t = &h->tensor[tensor];
    if (tensor > 1 || t->bits_x2 == 0 || t->mode != TQKV_MODE_RAW)
        return 0;
    return (const uint16_t *)((const uint8_t *)page + t->group_offset[0]);
}

/* The outlier mask row of head h (ceil(D/8) bytes, bit c set = channel c is in group 0),
 * or NULL when the tensor has one group (group 0 = every channel). */
TQKV_HD const uint8_t *
tqkv_page_mask(const void *page, uint32_t tensor, uint32_t head)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    const tqkv_page_tensor_desc_t *t = &h->tensor[tensor];
    if (t->lo_bits == 0 || t->mask_offset == 0)
        return 0;
    return (const uint8_t *)page + t->mask_offset + (uint64_t)head * ((h->head_dim + 7u) / 8u);
}

/* Key mean row of head h (f32[D]) or NULL when keys are not centered. */
TQKV_HD const float *
tqkv_page_key_mean(const void *page, uint32_t head)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    if (!(h->flags & TQKV_PAGE_KEY_CENTERED) || h->mean_offset == 0)
        return 0;
    return (const float *)((const uint8_t *)page + h->mean_offset) + (uint64_t)head * h->head_dim;
}

#include <float.h>
#include <math.h>

/* ---- per-vector encode/decode of one group (the CUDA kernels run these per thread) ----
 *
 * These follow the scalar reference encoder of kernels/page.c operation for operation
 * (f32 rotations, f64 norms and residuals), so a GPU page equals the CPU reference page
 * byte for byte. Arithmetic goes through TQKV_F* / TQKV_D* so that nvcc does not
 * contract it into FMAs (the CPU reference is compiled without FMA contraction). */

#if defined(__CUDA_ARCH__)
#define TQKV_FMUL(a, b) __fmul_rn((a), (b))
#define TQKV_FADD(a, b) __fadd_rn((a), (b))
#define TQKV_DMUL(a, b) __dmul_rn((a), (b))
#define TQKV_DADD(a, b) __dadd_rn((a), (b))
#define TQKV_DSUB(a, b) __dsub_rn((a), (b))
#else
#define TQKV_FMUL(a, b) ((float)(a) * (float)(b))
#define TQKV_FADD(a, b) ((float)(a) + (float)(b))
#define TQKV_DMUL(a, b) ((double)(a) * (double)(b))
#define TQKV_DADD(a, b) ((double)(a) + (double)(b))
#define TQKV_DSUB(a, b) ((double)(a) - (double)(b))
#endif

/* sqrt(pi/2) */
#define TQKV_SQRT_HALF_PI sqrt(3.14159265358979323846 / 2)

/* Everything a kernel needs to encode or decode vectors of one group (borrowed
 * pointers: host memory on the CPU, device memory in kernels). */
typedef struct tqkv_group_codec {
    uint32_t dim;            /* g */
    uint32_t mode;           /* tqkv_mode_t */
    uint32_t mse_bits;       /* index bits (0 for 1-bit prod: QJL only) */
    uint32_t n_centroids;    /* 2^mse_bits or 0 */
    uint32_t rotation;       /* TQKV_ROT_DENSE or TQKV_ROT_HADAMARD (tqkv_group_rotation) */
    uint32_t norm_corrected; /* scale = ||x|| / ||z[idx]|| */
    const float *z;          /* [n_centroids] centroids * sqrt(g), ascending */
    const float *thr;        /* [n_centroids - 1] thresholds, z domain */
    const float *matrix;     /* dense Pi [g][g] row-major (y = Pi x), else NULL */
    const float *signs;      /* Hadamard D1[g] then D2[g] (+-1), else NULL */
    const float *qjl;        /* S [g][g] row-major (prod), else NULL */
} tqkv_group_codec_t;

/* A double rounded to f32, saturating at +-FLT_MAX. */
TQKV_HD float
tqkv_clamp_flt(double v)
{
    if (v > FLT_MAX)
        return FLT_MAX;
    if (v < -FLT_MAX)
        return -FLT_MAX;
    return (float)v;
}

/* y = M x for a row-major n x n matrix (f32, sums in column order); no aliasing. */
TQKV_HD void
tqkv_matvec(const float *M, const float *x, float *y, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (uint32_t j = 0; j < n; j++)
            s = TQKV_FADD(s, TQKV_FMUL(M[(uint64_t)i * n + j], x[j]));
        y[i] = s;
    }
}

/* x = M^T y (f32, sums in row order); no aliasing. */
TQKV_HD void
tqkv_matvec_t(const float *M, const float *y, float *x, uint32_t n)
{
    for (uint32_t j = 0; j < n; j++) {
        float s = 0.0f;
        for (uint32_t i = 0; i < n; i++)
            s = TQKV_FADD(s, TQKV_FMUL(M[(uint64_t)i * n + j], y[i]));
        x[j] = s;
    }
}

/* out = Pi in (Hadamard: H D2 H D1 in / g, scaled last), as tqkv_rotation_apply. */
TQKV_HD void
tqkv_group_rotate(const tqkv_group_codec_t *G, const float *in, float *out)
{
    uint32_t g = G->dim;
    if (G->rotation == TQKV_ROT_HADAMARD) {
        float inv = 1.0f / (float)g;
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_FMUL(in[j], G->signs[j]);
        tqkv_fwht(out, g);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_FMUL(out[j], G->signs[g + j]);
        tqkv_fwht(out, g);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_FMUL(out[j], inv);
    } else {
        tqkv_matvec(G->matrix, in, out, g);
    }
}

/* out = Pi^T in (Hadamard: D1 H D2 H in / g), as tqkv_rotation_apply_t. */
TQKV_HD void
tqkv_group_rotate_t(const tqkv_group_codec_t *G, const float *in, float *out)
{
    uint32_t g = G->dim;
    if (G->rotation == TQKV_ROT_HADAMARD) {
        float inv = 1.0f / (float)g;
        for (uint32_t j = 0; j < g; j++)
            out[j] = in[j];
        tqkv_fwht(out, g);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_FMUL(out[j], G->signs[g + j]);
        tqkv_fwht(out, g);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_FMUL(out[j], TQKV_FMUL(G->signs[j], inv));
    } else {
        tqkv_matvec_t(G->matrix, in, out, g);
    }
}

/* tqkv_group_encode_vec up to the QJL product, operation for operation: returns 1 for a
 * prod vector with u = r / ||r|| in u_out[g] (S u gives its signs; u_out may be work),
 * 0 when the vector is finished (mse, or a zero vector). work: 3g floats. */
TQKV_HD int
tqkv_group_encode_vec_pre(const tqkv_group_codec_t *G, const double *x, float *work,
                          uint16_t *scale, uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row,
                          float *u_out)
{
    const uint32_t g = G->dim, b = G->mse_bits;
    float *u = work, *y = work + g, *a = work + 2 * g;
    const float sqrt_g = sqrtf((float)g);
    double s = 0, zn2 = 0, sc, rn = 0, sf;

    for (uint32_t j = 0; j < g; j++)
        s = TQKV_DADD(s, TQKV_DMUL(x[j], x[j]));
    s = sqrt(s);
    if (s == 0) {
        *scale = 0;
        if (G->mode == TQKV_MODE_PROD) {
            *gamma = 0;
            for (uint32_t j = 0; j < g; j++)
                sign_row[j >> 3] |= (uint8_t)(1u << (j & 7u));
        }
        return 0;
    }
    for (uint32_t j = 0; j < g; j++)
        u[j] = (float)(x[j] / s);
    if (b) {
        tqkv_group_rotate(G, u, y);
        for (uint32_t j = 0; j < g; j++) {
            uint32_t k = tqkv_nearest_index(TQKV_FMUL(y[j], sqrt_g), G->thr, G->n_centroids);
            tqkv_bits_put(idx_row, j, b, k);
            y[j] = G->z[k];
            zn2 = TQKV_DADD(zn2, TQKV_DMUL(y[j], y[j]));
        }
    }
    if (G->norm_corrected && b && zn2 > 0)
        sc = s / sqrt(zn2);
    else
        sc = s / sqrt((double)g);
    *scale = tqkv_scale_to_bf16(tqkv_clamp_flt(sc));
    if (G->mode != TQKV_MODE_PROD)
        return 0;
    /* r = x - scale * Pi^T z[idx] (what the decoder rebuilds, with the stored BF16
     * scale); QJL of r / ||r|| */
    if (b)
        tqkv_group_rotate_t(G, y, a);
    sf = (double)tqkv_bf16_to_f32(*scale);
    for (uint32_t j = 0; j < g; j++) {
        double r = b ? TQKV_DSUB(x[j], TQKV_DMUL(sf, a[j])) : x[j];
        rn = TQKV_DADD(rn, TQKV_DMUL(r, r));
    }
    rn = sqrt(rn);
    for (uint32_t j = 0; j < g; j++) {
        double r = b ? TQKV_DSUB(x[j], TQKV_DMUL(sf, a[j])) : x[j];
        u_out[j] = rn > 0 ? (float)(r / rn) : 0.0f;
    }
    *gamma = tqkv_scale_to_bf16(tqkv_clamp_flt(rn / sqrt((double)g)));
    return 1;
}

/* Encodes the group vector x[g] (f64: BF16 values minus the f32 key mean). work: 3g
 * floats. idx_row (idx_row_bytes) and sign_row (prod, sign_row_bytes) must be zeroed.
 * Writes *scale and (prod) *gamma as stored (BF16, tqkv_scale_to_bf16); the residual
 * of prod is taken against the stored (rounded) scale, as the decoder rebuilds it.
 * Zero vector: scale 0, indices 0, gamma 0, all signs set. */
TQKV_HD void
tqkv_group_encode_vec(const tqkv_group_codec_t *G, const double *x, float *work, uint16_t *scale,
                      uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row)
{
    const uint32_t g = G->dim;
    float *u = work, *y = work + g;
    if (!tqkv_group_encode_vec_pre(G, x, work, scale, gamma, idx_row, sign_row, u))
        return;
    tqkv_matvec(G->qjl, u, y, g);
    for (uint32_t j = 0; j < g; j++)
        if (y[j] >= 0.0f)
            sign_row[j >> 3] |= (uint8_t)(1u << (j & 7u));
}

/* Decodes one group vector into out[g] (f64, before adding the key mean), as the
 * reference decoder: x_mse = scale * Pi^T z[idx], plus for prod
 * sqrt(pi/2) / sqrt(g) * gamma * S^T sign. work: 2g floats. */
TQKV_HD void
tqkv_group_decode_vec(const tqkv_group_codec_t *G, float scale, float gamma, const uint8_t *idx_row,
                      const uint8_t *sign_row, float *work, double *out)
{
    const uint32_t g = G->dim, b = G->mse_bits;
    float *y = work, *a = work + g;
    for (uint32_t j = 0; j < g; j++)
        out[j] = 0;
    if (b) {
        for (uint32_t j = 0; j < g; j++)
            y[j] = G->z[tqkv_bits_get(idx_row, j, b)];
        tqkv_group_rotate_t(G, y, a);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_DMUL(scale, a[j]);
    }
    if (G->mode == TQKV_MODE_PROD) {
        double c = TQKV_DMUL(TQKV_SQRT_HALF_PI / sqrt((double)g), gamma);
        for (uint32_t j = 0; j < g; j++)
            y[j] = ((sign_row[j >> 3] >> (j & 7u)) & 1u) ? 1.0f : -1.0f;
        tqkv_matvec_t(G->qjl, y, a, g);
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_DADD(out[j], TQKV_DMUL(c, a[j]));
    }
}

/* Channel c of a head is in group 0 (outliers) when rank(c) < n_hi, where the rank
 * orders channels by energy, descending, ties to the lower channel index. */
TQKV_HD uint32_t
tqkv_energy_rank(const double *energy, uint32_t d, uint32_t c)
{
    uint32_t r = 0;
    double e = energy[c];
    for (uint32_t k = 0; k < d; k++)
        r += (energy[k] > e) || (energy[k] == e && k < c);
    return r;
}

/* ---- page planning and per-(head, channel) statistics of an encoder ---- */

/* Fills *h (zeroed first) with the header of the page for a block of T tokens, H heads,
 * head_dim D and the given per-tensor codec (index 0 = K, 1 = V; bits_x2 0 = absent):
 * layout in order header, key mean (centering with a quantized K), then per tensor mask,
 * group 0, group 1 (a raw tensor: its raw section). crc32c is left 0. Returns 0, or -1
 * for an unsupported bits_x2 (a raw tensor needs TQKV_RAW_BITS_X2, no norm correction). */
TQKV_HD int
tqkv_page_plan(uint32_t T, uint32_t H, uint32_t D, const uint8_t bits_x2[2], const uint8_t mode[2],
               const uint8_t norm_corrected[2], uint32_t rotation, uint32_t centering,
               uint64_t seed, tqkv_page_header_t *h)
{
    uint64_t off = TQKV_PAGE_HEADER_BYTES, n = (uint64_t)T * H;
    uint8_t *raw = (uint8_t *)h;
    for (uint32_t i = 0; i < sizeof *h; i++)
        raw[i] = 0;
    h->magic = TQKV_PAGE_MAGIC;
    h->version = TQKV_PAGE_VERSION;
    h->header_bytes = TQKV_PAGE_HEADER_BYTES;
    h->seed = seed;
    h->num_tokens = T;
    h->num_kv_heads = (uint16_t)H;
    h->head_dim = (uint16_t)D;
    h->rotation = (uint8_t)rotation;
    if (centering && bits_x2[TQKV_TENSOR_K] && mode[TQKV_TENSOR_K] != TQKV_MODE_RAW) {
        h->flags |= TQKV_PAGE_KEY_CENTERED;
        h->mean_offset = (uint32_t)off;
        off += tqkv_align_up(4ull * H * D, TQKV_PAGE_ALIGN);
    }
    for (uint32_t t = 0; t < 2; t++) {
        tqkv_page_tensor_desc_t *td = &h->tensor[t];
        tqkv_group_layout_t L;
        uint32_t hi, lo, nhi;
        if (!bits_x2[t])
            continue;
        if (mode[t] == TQKV_MODE_RAW) { /* lossless: one raw section, no key mean */
            if (bits_x2[t] != TQKV_RAW_BITS_X2 || norm_corrected[t])
                return -1;
            td->mode = TQKV_MODE_RAW;
            td->bits_x2 = TQKV_RAW_BITS_X2;
            td->hi_bits = TQKV_RAW_BITS;
            td->n_hi = (uint16_t)D;
            td->group_offset[0] = (uint32_t)off;
            td->group_bytes[0] = (uint32_t)tqkv_raw_section_bytes(n, D);
            off += tqkv_raw_section_bytes(n, D);
            continue;
        }
        if (tqkv_bits_split(bits_x2[t], D, &hi, &lo, &nhi) != 0)
            return -1;
        td->mode = mode[t];
        td->bits_x2 = bits_x2[t];
        td->hi_bits = (uint8_t)hi;
        td->lo_bits = (uint8_t)lo;
        td->n_hi = (uint16_t)nhi;
        td->flags = norm_corrected[t] ? TQKV_TENSOR_NORM_CORRECTED : 0;
        if (lo) {
            td->mask_offset = (uint32_t)off;
            off += tqkv_align_up((uint64_t)H * ((D + 7) / 8), TQKV_PAGE_ALIGN);
        }
        tqkv_group_layout(nhi, hi, mode[t], n, &L);
        td->group_offset[0] = (uint32_t)off;
        td->group_bytes[0] = (uint32_t)L.bytes;
        off += L.bytes;
        if (lo) {
            tqkv_group_layout(D - nhi, lo, mode[t], n, &L);
            td->group_offset[1] = (uint32_t)off;
            td->group_bytes[1] = (uint32_t)L.bytes;
            off += L.bytes;
        }
    }
    if (off > TQKV_PAGE_MAX_BYTES)
        return -1;
    h->page_bytes = (uint32_t)off;
    return 0;
}

/* Statistics over the T tokens of channel c of head h of a BF16 [T][H][D] tensor, as
 * the reference encoder computes them (f64 sums in token order). The key mean: */
TQKV_HD float
tqkv_channel_mean(const uint16_t *x, uint32_t T, uint32_t H, uint32_t D, uint32_t h, uint32_t c)
{
    uint64_t stride = (uint64_t)H * D, base = (uint64_t)h * D + c;
    double s = 0;
    for (uint32_t t = 0; t < T; t++)
        s = TQKV_DADD(s, (double)tqkv_bf16_to_f32(x[t * stride + base]));
    return (float)(s / T);
}

/* max_t |x - mu| (a head whose maximum over channels exceeds 2^126 keeps mu = 0). */
TQKV_HD double
tqkv_channel_maxdev(const uint16_t *x, uint32_t T, uint32_t H, uint32_t D, uint32_t h, uint32_t c,
                    float mu)
{
    uint64_t stride = (uint64_t)H * D, base = (uint64_t)h * D + c;
    double m = 0;
    for (uint32_t t = 0; t < T; t++) {
        double dv = fabs(TQKV_DSUB((double)tqkv_bf16_to_f32(x[t * stride + base]), mu));
        m = dv > m ? dv : m;
    }
    return m;
}

/* sum_t (x - mu)^2 (mu = 0 when not centering): the energy outliers are chosen by. */
TQKV_HD double
tqkv_channel_energy(const uint16_t *x, uint32_t T, uint32_t H, uint32_t D, uint32_t h, uint32_t c,
                    float mu)
{
    uint64_t stride = (uint64_t)H * D, base = (uint64_t)h * D + c;
    double e = 0;
    for (uint32_t t = 0; t < T; t++) {
        double v = TQKV_DSUB((double)tqkv_bf16_to_f32(x[t * stride + base]), mu);
        e = TQKV_DADD(e, TQKV_DMUL(v, v));
    }
    return e;
}

/* ---- the key-centering decision (proto/PAGE_FORMAT.md section 7, step 2) ----
 * Centering helps a head only when it shrinks its vectors relative to themselves: the
 * quantization error of a token scales with the norm of what is encoded, so the relative
 * error of token t grows by |x_t - mu|^2 / |x_t|^2. (The page's total energy always drops,
 * sum |x - mu|^2 <= sum |x|^2, so that is no test.) A head keeps mu when the mean of that
 * ratio over its non-zero tokens is below 1, else its mean row is stored as zeros. */

/* Squared norms of one token's D channels of a head (row xr, BF16) before and after
 * subtracting mu (f32[D]): f64, 8 lanes (lane j sums channels c = j mod 8 in order),
 * joined as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), so SIMD copies give the
 * same bits. */
TQKV_HD void
tqkv_token_center_energy(const uint16_t *xr, const float *mu, uint32_t D, double *e_plain,
                         double *e_centered)
{
    double p[8] = {0, 0, 0, 0, 0, 0, 0, 0}, q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t c = 0;
    for (; c + 8 <= D; c += 8)
        for (uint32_t j = 0; j < 8; j++) {
            double a = (double)tqkv_bf16_to_f32(xr[c + j]), v = TQKV_DSUB(a, (double)mu[c + j]);
            p[j] = TQKV_DADD(p[j], TQKV_DMUL(a, a));
            q[j] = TQKV_DADD(q[j], TQKV_DMUL(v, v));
        }
    for (uint32_t j = 0; c + j < D; j++) {
        double a = (double)tqkv_bf16_to_f32(xr[c + j]), v = TQKV_DSUB(a, (double)mu[c + j]);
        p[j] = TQKV_DADD(p[j], TQKV_DMUL(a, a));
        q[j] = TQKV_DADD(q[j], TQKV_DMUL(v, v));
    }
    *e_plain = TQKV_DADD(TQKV_DADD(TQKV_DADD(p[0], p[1]), TQKV_DADD(p[2], p[3])),
                         TQKV_DADD(TQKV_DADD(p[4], p[5]), TQKV_DADD(p[6], p[7])));
    *e_centered = TQKV_DADD(TQKV_DADD(TQKV_DADD(q[0], q[1]), TQKV_DADD(q[2], q[3])),
                            TQKV_DADD(TQKV_DADD(q[4], q[5]), TQKV_DADD(q[6], q[7])));
}

#define TQKV_CENTER_ONE (1ull << 20) /* a ratio of 1 in the votes' fixed point */

/* A token's vote: min(e_centered / e_plain, 2^20) in units of 2^-20, truncated (integer,
 * so the head's sum is the same in any order); 0 for a zero token, which does not count. */
TQKV_HD uint64_t
tqkv_center_vote(double e_plain, double e_centered)
{
    double r;
    if (!(e_plain > 0))
        return 0;
#ifdef __CUDA_ARCH__
    r = __ddiv_rn(e_centered, e_plain);
#else
    r = e_centered / e_plain;
#endif
    if (!(r < (double)TQKV_CENTER_ONE)) /* also NaN: x - mu overflowed (not centered) */
        r = (double)TQKV_CENTER_ONE;
    return (uint64_t)TQKV_DMUL(r, (double)TQKV_CENTER_ONE);
}

/* The head centers when sum(votes) < (non-zero tokens) * TQKV_CENTER_ONE. */
TQKV_HD int
tqkv_center_keep(uint64_t votes, uint64_t nonzero)
{
    return votes < nonzero * TQKV_CENTER_ONE;
}

/* ---- CRC32C pieces for parallel CRCs (the CUDA encoder computes page CRCs) ----
 * The CRC register is reflected (poly 0x82F63B78). tqkv_crc32c_raw runs the register
 * over bytes with no pre/post inversion; tqkv_crc32c_shift advances a register over
 * n zero bytes. The standard CRC of A||B is then
 *   ~(shift(shift(~0, |A|) ^ raw(0, A), |B|) ^ raw(0, B)). */

TQKV_HD uint32_t
tqkv_crc32c_raw_byte(uint32_t crc, uint8_t byte)
{
    crc ^= byte;
    for (int k = 0; k < 8; k++)
        crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    return crc;
}

/* (a * b) mod P in the reflected representation (x^0 is bit 31). */
TQKV_HD uint32_t
tqkv_crc32c_gf_mul(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int k = 0; k < 32; k++) {
        p ^= (0u - ((b >> 31) & 1u)) & a;
        b <<= 1;
        a = (a >> 1) ^ (0x82F63B78u & (0u - (a & 1u)));
    }
    return p;
}

/* x^(8n) mod P (reflected): the operator "advance over n zero bytes". */
TQKV_HD uint32_t
tqkv_crc32c_x8n(uint64_t n)
{
    uint32_t r = 0x80000000u;  /* x^0 */
    uint32_t sq = 0x00800000u; /* x^8 */
    while (n) {
        if (n & 1u)
            r = tqkv_crc32c_gf_mul(r, sq);
        sq = tqkv_crc32c_gf_mul(sq, sq);
        n >>= 1;
    }
    return r;
}

/* The register crc advanced over n zero bytes. */
TQKV_HD uint32_t
tqkv_crc32c_shift(uint32_t crc, uint64_t n)
{
    return tqkv_crc32c_gf_mul(crc, tqkv_crc32c_x8n(n));
}

#endif
