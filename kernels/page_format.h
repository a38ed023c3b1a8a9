/* page_format.h - the packed page, byte by byte: ONE header for C, SIMD and CUDA.
 *
 * A page is the self-describing, immutable encoding of one KV block (one layer):
 * K and V, each [num_tokens][num_kv_heads][head_dim] BF16 on the way in. All
 * integers little-endian. proto/PAGE_FORMAT.md is the prose version of this file;
 * where they disagree, this file and its _Static_asserts win.
 *
 *   [0, 128)            tqkv_page_header_t
 *   mean section        f32 [H][D] per-channel key mean (flags & TQKV_PAGE_KEY_CENTERED)
 *   for t in {K, V}:    (absent when tensor[t].bits_x2 == 0)
 *     mask section      u8 [H][ceil(D/8)] outlier-channel bitmask (only when lo_bits != 0)
 *     group 0 section   the outlier ("hi") channels of every vector, see tqkv_group_layout()
 *     group 1 section   the regular ("lo") channels (only when lo_bits != 0)
 *   or, for a tensor in TQKV_MODE_RAW (lossless):
 *     raw section       BF16 [T][H][D], the input bytes as they came (group_offset[0])
 *
 * Every section starts at a multiple of TQKV_PAGE_ALIGN from the page start and
 * its length is padded to that alignment. crc32c (Castagnoli) covers bytes
 * [0, page_bytes) with the crc32c field read as zero.
 *
 * Vectors are numbered i = t * H + h (token-major). Within a group of dimension g
 * (its channels taken in increasing channel order), vector i is stored as
 *   scale[i]  BF16: ||x_g|| / sqrt(g) (RMS; cannot overflow for finite BF16 input),
 *             or with TQKV_TENSOR_NORM_CORRECTED: ||x_g|| / ||z[idx]||, computed in
 *             f32 then rounded to BF16 (nearest even, saturating at max finite),
 *   gamma[i]  BF16 (prod only): ||r|| / sqrt(g), r = x_g - x_mse the residual taken
 *             with the stored (rounded) scale, rounded the same way,
 *   idx row   mse_bits * g bits, LSB-first bit stream (index j in bits [j*b, j*b+b)),
 *   sign row  g bits (prod only), bit j = 1 iff (S r)_j >= 0.
 * The group's codebook z (centroids * sqrt(g), ascending, 2^mse_bits f32) is stored
 * in the group so a reader needs no codebook computation to decode:
 *   x_mse = scale * sqrt(g) * Pi^T (z[idx] / sqrt(g)) = scale * Pi^T z[idx]
 *   x_hat = x_mse + sqrt(pi/2) / g * (gamma * sqrt(g)) * S^T sign     (prod)
 * with sign in {-1, +1}. Pi and S are rebuilt from (seed, tensor, group): see
 * tqkv_seed_derive() in kernels/tq_math.h and PAGE_FORMAT.md.
 */
#ifndef TQKV_KERNELS_PAGE_FORMAT_H
#define TQKV_KERNELS_PAGE_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDACC__)
#define TQKV_HD static inline __host__ __device__
#else
#define TQKV_HD static inline
#endif

#if defined(__cplusplus)
#define TQKV_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define TQKV_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

#define TQKV_PAGE_MAGIC 0x504B5154u /* bytes "TQKP" */
#define TQKV_PAGE_VERSION 2u        /* 2: scale and gamma are BF16 (1: f32) */
#define TQKV_PAGE_HEADER_BYTES 128u
#define TQKV_PAGE_ALIGN 64u
#define TQKV_PAGE_MIN_DIM 16u
#define TQKV_PAGE_MAX_DIM 1024u
#define TQKV_PAGE_MAX_HEADS 1024u
#define TQKV_PAGE_MAX_TOKENS 65536u
#define TQKV_PAGE_MAX_BYTES 0x7fffffffu
#define TQKV_PAGE_CODEBOOK_BYTES 64u /* room for 16 f32 centroids */

/* Tensor slots. */
enum { TQKV_TENSOR_K = 0, TQKV_TENSOR_V = 1 };

/* Quantizer mode of a tensor. */
typedef enum tqkv_mode {
    TQKV_MODE_MSE = 0,  /* TurboQuant_mse: b-bit codebook indices */
    TQKV_MODE_PROD = 1, /* TurboQuant_prod: (b-1)-bit mse + 1-bit QJL of the residual */
    TQKV_MODE_RAW = 2,  /* lossless: the BF16 values kept as they came (raw section) */
} tqkv_mode_t;

/* A TQKV_MODE_RAW tensor: bits_x2 = 32 (16 bits a coordinate), hi_bits = 16, lo_bits = 0,
 * n_hi = head_dim, flags 0, no mask, group_offset[0] / group_bytes[0] = the raw section
 * (BF16 [T][H][D], align64(2 T H D) bytes), group_offset[1] = group_bytes[1] = 0. */
#define TQKV_RAW_BITS_X2 32u
#define TQKV_RAW_BITS 16u

/* Rotation kind recorded in the page. */
typedef enum tqkv_rotation_kind {
    TQKV_ROT_DENSE = 0,    /* Haar-random orthogonal (QR of a seeded Gaussian matrix) */
    TQKV_ROT_HADAMARD = 1, /* H D2 H D1 / g for power-of-two g; groups of other g use DENSE */
} tqkv_rotation_kind_t;

/* Page flags. */
#define TQKV_PAGE_KEY_CENTERED 0x01u /* K stored as k - mu; mean section present */
/* Tensor flags. */
#define TQKV_TENSOR_NORM_CORRECTED 0x01u /* scale is ||x|| / ||z[idx]|| */

typedef struct tqkv_page_tensor_desc {
    uint8_t mode;    /* tqkv_mode_t */
    uint8_t bits_x2; /* nominal bits per coordinate times 2: 2..8, or 32 (raw); 0 = absent */
    uint8_t hi_bits; /* bits of group 0 (all channels when lo_bits == 0): 1..4 */
    uint8_t lo_bits; /* bits of group 1; 0 = one group only */
    uint16_t n_hi;   /* channels in group 0 (== head_dim when lo_bits == 0) */
    uint8_t flags;   /* TQKV_TENSOR_* */
    uint8_t reserved0;
    uint32_t mask_offset;     /* outlier mask section, 0 when lo_bits == 0 */
    uint32_t group_offset[2]; /* group sections; group_offset[1] == 0 when lo_bits == 0 */
    uint32_t group_bytes[2];  /* padded lengths */
    uint32_t reserved1[3];
} tqkv_page_tensor_desc_t;

typedef struct tqkv_page_header {
    uint32_t magic;        /* TQKV_PAGE_MAGIC */
    uint16_t version;      /* TQKV_PAGE_VERSION */
    uint16_t header_bytes; /* TQKV_PAGE_HEADER_BYTES */
    uint32_t page_bytes;   /* whole page, header included, multiple of TQKV_PAGE_ALIGN */
    uint32_t crc32c;       /* over [0, page_bytes) with this field as zero */
    uint64_t seed;         /* rotation / QJL seed */
    uint32_t num_tokens;
    uint16_t num_kv_heads;
    uint16_t head_dim;
    uint8_t rotation; /* tqkv_rotation_kind_t */
    uint8_t flags;    /* TQKV_PAGE_* */
    uint16_t reserved0;
    uint32_t mean_offset; /* key mean section, 0 when not centered */
    tqkv_page_tensor_desc_t tensor[2];
    uint32_t reserved1[2];
} tqkv_page_header_t;

TQKV_STATIC_ASSERT(sizeof(tqkv_page_tensor_desc_t) == 40, "tensor desc is 40 bytes");
TQKV_STATIC_ASSERT(sizeof(tqkv_page_header_t) == TQKV_PAGE_HEADER_BYTES, "header is 128 bytes");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, crc32c) == 12, "crc at 12");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, seed) == 16, "seed at 16");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, num_tokens) == 24, "tokens at 24");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, rotation) == 32, "rotation at 32");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, mean_offset) == 36, "mean at 36");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_header_t, tensor) == 40, "tensors at 40");
TQKV_STATIC_ASSERT(offsetof(tqkv_page_tensor_desc_t, mask_offset) == 8, "mask at 8");

TQKV_HD uint64_t
tqkv_align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

/* Padded bytes of the raw section of a TQKV_MODE_RAW tensor of n vectors of d channels. */
TQKV_HD uint64_t
tqkv_raw_section_bytes(uint64_t n, uint32_t d)
{
    return tqkv_align_up(2 * n * d, TQKV_PAGE_ALIGN);
}

/* Where the parts of one group section live, relative to the group's offset. */
typedef struct tqkv_group_layout {
    uint32_t dim;            /* g: channels in this group */
    uint32_t bits;           /* nominal bits of this group */
    uint32_t mode;           /* tqkv_mode_t */
    uint32_t mse_bits;       /* bits of the codebook index: bits (mse) or bits - 1 (prod) */
    uint32_t n_centroids;    /* 2^mse_bits, or 0 when mse_bits == 0 */
    uint32_t idx_row_bytes;  /* ceil(g * mse_bits / 8) */
    uint32_t sign_row_bytes; /* ceil(g / 8) for prod, else 0 */
    uint64_t off_codebook;   /* f32[n_centroids], always 0 */
    uint64_t off_scale;      /* BF16 (u16) [n] */
    uint64_t off_gamma;      /* BF16 (u16) [n] (prod), else 0 */
    uint64_t off_idx;        /* u8[n][idx_row_bytes] */
    uint64_t off_signs;      /* u8[n][sign_row_bytes] (prod), else 0 */
    uint64_t bytes;          /* padded length of the group section */
} tqkv_group_layout_t;

/* Fills *L for a group of `dim` channels at `bits` bits in `mode` over n vectors. */
TQKV_HD void
tqkv_group_layout(uint32_t dim, uint32_t bits, uint32_t mode, uint64_t n, tqkv_group_layout_t *L)
{
    uint64_t off;
    L->dim = dim;
    L->bits = bits;
    L->mode = mode;
    L->mse_bits = mode == TQKV_MODE_PROD ? bits - 1 : bits;
    L->n_centroids = L->mse_bits ? (1u << L->mse_bits) : 0u;
    L->idx_row_bytes = (dim * L->mse_bits + 7) / 8;
    L->sign_row_bytes = mode == TQKV_MODE_PROD ? (dim + 7) / 8 : 0;
    L->off_codebook = 0;
    L->off_scale = TQKV_PAGE_CODEBOOK_BYTES;
    off = L->off_scale + 2 * n;
    L->off_gamma = 0;
    if (mode == TQKV_MODE_PROD) {
        L->off_gamma = off;
        off += 2 * n;
    }
    L->off_idx = tqkv_align_up(off, TQKV_PAGE_ALIGN);
    off = L->off_idx + n * L->idx_row_bytes;
    L->off_signs = 0;
    if (mode == TQKV_MODE_PROD) {
        L->off_signs = tqkv_align_up(off, TQKV_PAGE_ALIGN);
        off = L->off_signs + n * L->sign_row_bytes;
    }
    L->bytes = tqkv_align_up(off, TQKV_PAGE_ALIGN);
}

/* The channel split for a nominal bit width (bits_x2) at head_dim d:
 * integer b: one group of d channels at b bits;
 * 2.5 (5): d/4 channels at 3 bits + 3d/4 at 2;  3.5 (7): d/2 at 4 + d/2 at 3;
 * 1.5 (3): d/2 at 2 + d/2 at 1. Returns 0 on success, -1 for an unsupported bits_x2. */
TQKV_HD int
tqkv_bits_split(uint32_t bits_x2, uint32_t d, uint32_t *hi_bits, uint32_t *lo_bits, uint32_t *n_hi)
{
    switch (bits_x2) {
    case 2:
    case 4:
    case 6:
    case 8:
        *hi_bits = bits_x2 / 2;
        *lo_bits = 0;
        *n_hi = d;
        return 0;
    case 3:
        *hi_bits = 2;
        *lo_bits = 1;
        *n_hi = d / 2;
        return 0;
    case 5:
        *hi_bits = 3;
        *lo_bits = 2;
        *n_hi = d / 4;
        return 0;
    case 7:
        *hi_bits = 4;
        *lo_bits = 3;
        *n_hi = d / 2;
        return 0;
    default:
        return -1;
    }
}

#ifdef __cplusplus
}
#endif

#endif
