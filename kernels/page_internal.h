/* page_internal.h - the SIMD kernels behind tqkv_page_encode/decode (tqkv__, not API):
 * shared by kernels/page*.c and crc32c_sse42.c only. The public page API is
 * kernels/page.h.
 */
#ifndef TQKV_KERNELS_PAGE_INTERNAL_H
#define TQKV_KERNELS_PAGE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/page.h"

/* ---- internal: the SIMD kernels behind tqkv_page_encode/decode (tqkv__, not API) ----
 * One group of g = head_dim channels (power of two >= 16) in mse mode, Hadamard
 * rotation with signs D1[g], D2[g], codebook z[2^bits] and thresholds thr[2^bits - 1].
 *
 * enc: encodes rows x + i * x_stride (BF16, finite; minus mu[g] when mu != NULL, in f32)
 * into scale[i * scale_stride] (BF16, tqkv_scale_to_bf16) and the packed index rows idx + i *
 * idx_stride (g * bits / 8 bytes). Returns the number of rows done; a row whose sum of squares
 * leaves the safe f32 range (zero, tiny or huge vectors) stops the kernel so the caller
 * encodes it with the reference and resumes after it.
 * dec: decodes n rows into out_f[i][g] (f32) and/or out_h[i][g] (BF16, saturating). */
typedef struct tqkv__enc_rows {
    const uint16_t *x;
    size_t x_stride; /* elements */
    const float *mu; /* [g] or NULL */
    size_t n;
    uint32_t g, bits;
    int norm_corrected;
    const float *signs, *z, *thr;
    uint16_t *scale;     /* BF16 */
    size_t scale_stride; /* elements */
    uint8_t *idx;
    size_t idx_stride; /* bytes */
} tqkv__enc_rows_t;
typedef size_t (*tqkv__enc_had_fn)(const tqkv__enc_rows_t *a);
typedef struct tqkv__dec_rows {
    const uint8_t *idx;
    size_t idx_stride;     /* bytes between index rows */
    const uint16_t *scale; /* BF16 */
    size_t scale_stride;   /* elements */
    size_t n;
    uint32_t g, bits;
    const float *signs, *z;
    const float *mu;   /* [g] added to every row (key mean), or NULL */
    float *out_f;      /* row i at out_f + i * out_stride, or NULL */
    uint16_t *out_h;   /* row i at out_h + i * out_stride, or NULL */
    size_t out_stride; /* elements */
} tqkv__dec_rows_t;
typedef void (*tqkv__dec_had_fn)(const tqkv__dec_rows_t *a);
size_t tqkv__page_enc_had_avx2(const tqkv__enc_rows_t *a);
void tqkv__page_dec_had_avx2(const tqkv__dec_rows_t *a);
size_t tqkv__page_enc_had_avx512(const tqkv__enc_rows_t *a);
void tqkv__page_dec_had_avx512(const tqkv__dec_rows_t *a);
/* CRC32C with the SSE4.2 crc32 instruction (same contract as tqkv_crc32c_ref). */
uint32_t tqkv__crc32c_sse42(uint32_t crc, const void *buf, size_t len);
uint32_t tqkv__crc32c_copy_sse42(uint32_t crc, void *dst, const void *src, size_t len);
/* The same with AVX-512 VPCLMULQDQ folding (256 bytes a step); short buffers take the
 * SSE4.2 path. */
uint32_t tqkv__crc32c_vpclmul(uint32_t crc, const void *buf, size_t len);
uint32_t tqkv__crc32c_copy_vpclmul(uint32_t crc, void *dst, const void *src, size_t len);

/* ---- internal: SIMD encode / decode of dense-rotation mse groups (tqkv__, not API) ----
 * The contract of tqkv__page_enc_had_* / tqkv__page_dec_had_* (above; signs
 * unused) for a group under a dense rotation with g a multiple of 16: y = Pi x is taken
 * for blocks of rows at once as rows times mt = Pi^T (matrix_t), so the matrix streams
 * from L1 once per block. Decode sums x = Pi^T z in the order of tqkv_matvec_t with
 * separate multiplies and adds, so it rounds exactly as the reference; encode uses FMA
 * and scales after the rotation (near-ties only, as the Hadamard kernels). */
size_t tqkv__page_enc_dense_avx512(const struct tqkv__enc_rows *a, const float *mt);
void tqkv__page_dec_dense_avx512(const struct tqkv__dec_rows *a, const float *m);
size_t tqkv__page_enc_dense_avx2(const struct tqkv__enc_rows *a, const float *mt);
void tqkv__page_dec_dense_avx2(const struct tqkv__dec_rows *a, const float *m);
/* y[r] = x[r] a for n rows of g floats (g a multiple of 16), a [g][g] row-major: per
 * output the sum over i in order from 0.f with separate multiplies and adds, so x a = the
 * tqkv_matvec_t(a, x) of tq_math.h bit for bit (the QJL term of prod decode). */
void tqkv__rows_matmul_avx512(const float *a, uint32_t g, const float *x, float *y, size_t n);
void tqkv__rows_matmul_avx2(const float *a, uint32_t g, const float *x, float *y, size_t n);

/* ---- internal: the parts of the page codec shared by page.c, page_encode.c,
 * page_validate.c, page_decode.c and page_stats.c (tqkv__, not API) ---- */
#include "kernels/codebook.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* The BF16 scale of an encoded row of norm s, sg = sqrtf(g): s / sg, or with norm
 * correction s / |z| for the row's centroid vector z of squared norm zn2 (s / sg when zn2
 * is 0). The one formula of the SIMD encoders. */
static inline uint16_t
tqkv__row_scale(float s, float sg, int norm_corrected, float zn2)
{
    return tqkv_scale_to_bf16(norm_corrected && zn2 > 0 ? s / sqrtf(zn2) : s / sg);
}

/* The run-time kernel table of the page codec (page.c), chosen once. */
typedef struct tqkv__page_kernels {
    const char *isa;
    tqkv__enc_had_fn enc_had; /* NULL: reference only */
    tqkv__dec_had_fn dec_had;
    size_t (*enc_dense)(const tqkv__enc_rows_t *, const float *mt); /* NULL: reference */
    void (*dec_dense)(const tqkv__dec_rows_t *, const float *m);
    void (*rows_mm)(const float *a, uint32_t g, const float *x, float *y, size_t n);
    uint32_t (*crc)(uint32_t, const void *, size_t);
    uint32_t (*crc_copy)(uint32_t, void *, const void *, size_t);
} tqkv__page_kernels_t;

/* The matrices and codebook of one group (page.c). */
typedef struct tqkv__group_ctx {
    tqkv_group_layout_t L;
    const tqkv_rotation_t *rot; /* Pi */
    const tqkv_rotation_t *qjl; /* S (prod) */
    const tqkv_codebook_t *cb;  /* NULL when mse_bits == 0 */
    const float *z;             /* codebook to decode with (page's own) */
    float sqrt_g;               /* sqrtf(g) */
    int norm_corrected;
} tqkv__group_ctx_t;

/* The kernel table: set up once (pthread_once), returns borrowed static storage. */
const tqkv__page_kernels_t *tqkv__page_kernels(void);
/* "K", "V": tensor names in error messages. */
extern const char *const tqkv__tensor_name[2];
/* Builds the header (layout, parameters, crc 0) for shape and codec, after checking. */
tqkv_status_t tqkv__page_plan(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c,
                              tqkv_page_header_t *h, char *err, size_t errlen);

/* A group's layout, codebook and rotations (acquired: release with _fini). */
tqkv_status_t tqkv__group_ctx_init(tqkv__group_ctx_t *G, uint32_t g, uint32_t bits, uint32_t mode,
                                   uint64_t n, uint32_t page_rot, uint64_t seed, uint32_t tensor,
                                   uint32_t group, int need_cb);
void tqkv__group_ctx_fini(tqkv__group_ctx_t *G);
void tqkv__group_codec(const tqkv__group_ctx_t *G, tqkv_group_codec_t *C);
void tqkv__encode_vec_ref(const tqkv__group_ctx_t *G, const double *x, float *work, uint16_t *scale,
                          uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row);
void tqkv__decode_vec_ref(const tqkv__group_ctx_t *G, float scale, float gamma,
                          const uint8_t *idx_row, const uint8_t *sign_row, float *work,
                          double *out);
void tqkv__decode_vec_prod(const tqkv__group_ctx_t *G, float scale, float gamma,
                           const uint8_t *idx_row, const float *am, const float *aq, float *work,
                           double *out);

#define TQKV__PROD_BLOCK 64 /* prod vectors per QJL block product */

/* page_encode.c: the first NaN/Inf of count BF16 values at *where; 0 when all finite. */
int tqkv__find_nonfinite(const uint16_t *x, uint64_t count, uint64_t *where);

/* page_stats.c: the key-statistics loops (one copy per ISA, chosen at run time) and the
 * AVX-512 VBMI2 channel split/merge of two-group tensors. */
#include "kernels/cpu.h"
/* The key-statistics kernels of one ISA level: one table indexed by tqkv_isa_t (ggml
 * style), the scalar row the references (energy_accum_ref, sum_accum_ref,
 * tqkv__center_votes_ref) the others are tested against. Their level is chosen from
 * tqkv_cpu_usable(): AVX-512 F alone is enough for these auto-vectorized loops.
 * energy: acc[k] += (x[k] - mean[k])^2 (mean NULL: 0); sum: acc[k] += x[k], returns the
 * largest |x| bits (at least maxmag); votes: tq_math.h's centering votes of T rows
 * x + t * xs of D channels against mu, and the number of non-zero rows. */
typedef struct tqkv__stats_kernels {
    void (*energy)(double *acc, const uint16_t *x, const float *mean, uint64_t n);
    uint16_t (*sum)(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag);
    void (*votes)(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                  uint64_t *votes, uint64_t *nonzero);
} tqkv__stats_kernels_t;
const tqkv__stats_kernels_t *tqkv__stats_kernels(tqkv_isa_t isa);
/* The level the tqkv__energy_accum, _sum_accum and _center_votes below dispatch to. */
tqkv_isa_t tqkv__stats_isa(void);
void tqkv__energy_accum(double *acc, const uint16_t *x, const float *mean, uint64_t n);
uint16_t tqkv__sum_accum(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag);
void tqkv__center_votes(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                        uint64_t *votes, uint64_t *nonzero);
void tqkv__center_votes_ref(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                            uint64_t *votes, uint64_t *nonzero);
/* 1 when tqkv__split_rows_vbmi2 / tqkv__merge_rows_vbmi2 may run (cpu.h). */
int tqkv__page_vbmi2(void);
void tqkv__split_rows_vbmi2(const uint16_t *x, size_t xs, uint16_t *o, uint32_t T, uint32_t D,
                            const uint8_t *mask, uint32_t g0);
void tqkv__merge_rows_vbmi2(const float *bf, const uint16_t *bh, float *out_f, uint16_t *out_h,
                            size_t os, uint32_t T, uint32_t D, const uint8_t *mask, uint32_t g0);

#endif
