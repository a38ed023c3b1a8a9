/* page_internal.h - the SIMD kernels behind tqkv_page_encode/decode (tqkv__, not API):
 * shared by kernels/page.c, page_avx2.c, page_avx512.c and crc32c_sse42.c only. The
 * public page API is kernels/page.h.
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

#endif
