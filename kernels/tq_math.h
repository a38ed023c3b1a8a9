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
    const uint8_t *base;    /* start of the group section */
    const float *codebook;  /* z[L.n_centroids] (centroids * sqrt(g)), ascending */
    const float *scale;     /* [n] */
    const float *gamma;     /* [n] (prod) or NULL */
    const uint8_t *idx;     /* [n][L.idx_row_bytes] */
    const uint8_t *signs;   /* [n][L.sign_row_bytes] (prod) or NULL */
    uint32_t rotation;      /* rotation actually used by this group (tqkv_group_rotation) */
    uint64_t rot_seed;      /* tqkv_seed_derive(seed, tensor, group, TQKV_SEED_ROTATION) */
    uint64_t qjl_seed;      /* tqkv_seed_derive(seed, tensor, group, TQKV_SEED_QJL) */
} tqkv_group_view_t;

/* Resolves group `group` (0 or 1) of tensor `tensor` (TQKV_TENSOR_K/V) of a page that
 * has passed validation. Returns 0, or -1 when that tensor or group is absent. */
TQKV_HD int
tqkv_page_group_view(const void *page, uint32_t tensor, uint32_t group, tqkv_group_view_t *gv)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    const tqkv_page_tensor_desc_t *t = &h->tensor[tensor];
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    uint32_t dim, bits;
    if (t->bits_x2 == 0 || (group == 1 && t->lo_bits == 0) || group > 1)
        return -1;
    dim = group == 0 ? t->n_hi : (uint32_t)h->head_dim - t->n_hi;
    bits = group == 0 ? t->hi_bits : t->lo_bits;
    tqkv_group_layout(dim, bits, t->mode, n, &gv->L);
    gv->base = (const uint8_t *)page + t->group_offset[group];
    gv->codebook = (const float *)(gv->base + gv->L.off_codebook);
    gv->scale = (const float *)(gv->base + gv->L.off_scale);
    gv->gamma = t->mode == TQKV_MODE_PROD ? (const float *)(gv->base + gv->L.off_gamma) : 0;
    gv->idx = gv->base + gv->L.off_idx;
    gv->signs = t->mode == TQKV_MODE_PROD ? gv->base + gv->L.off_signs : 0;
    gv->rotation = tqkv_group_rotation(h->rotation, dim);
    gv->rot_seed = tqkv_seed_derive(h->seed, tensor, group, TQKV_SEED_ROTATION);
    gv->qjl_seed = tqkv_seed_derive(h->seed, tensor, group, TQKV_SEED_QJL);
    return 0;
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

#endif
