/* rotation.h - seeded random rotations (and the QJL Gaussian matrix) of a group.
 *
 * Built from (kind, dim, seed) only, with the portable generators of tq_math.h, so
 * every implementation (CPU, CUDA, a remote consumer) rebuilds the same matrices.
 * The seed passed here is the derived group seed: tqkv_seed_derive(page seed,
 * tensor, group, TQKV_SEED_ROTATION or TQKV_SEED_QJL).
 *
 * Objects are cached and reference counted: acquire returns a shared, immutable
 * object; release drops the reference (the cache frees least recently used objects
 * beyond its byte budget once unreferenced). Thread-safe.
 */
#ifndef TQKV_KERNELS_ROTATION_H
#define TQKV_KERNELS_ROTATION_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

enum {
    /* TQKV_ROT_DENSE = 0 and TQKV_ROT_HADAMARD = 1 come from page_format.h */
    TQKV_ROT_QJL_GAUSS = 2, /* S: i.i.d. N(0,1) entries, not orthogonal */
};

typedef struct tqkv_rotation {
    uint32_t kind; /* TQKV_ROT_DENSE, TQKV_ROT_HADAMARD or TQKV_ROT_QJL_GAUSS */
    uint32_t dim;
    uint64_t seed;
    const float *matrix;   /* dense and QJL: [dim][dim] row-major, y = M x; NULL for Hadamard */
    const float *signs;    /* Hadamard: D1[dim] then D2[dim], +-1.f; NULL otherwise */
    const float *matrix_t; /* dense and QJL: the transpose of matrix; NULL for Hadamard */
} tqkv_rotation_t;

/* Acquires the transform (kind, dim, seed); *out valid until tqkv_rotation_release.
 * Hadamard requires a power-of-two dim. TQKV_EUNSUPPORTED / TQKV_ENOMEM on failure. */
tqkv_status_t tqkv_rotation_acquire(uint32_t kind, uint32_t dim, uint64_t seed,
                                    const tqkv_rotation_t **out);
void tqkv_rotation_release(const tqkv_rotation_t *r);

/* y = M x (x, y of length dim; may not alias). Hadamard: y = H D2 H D1 x / dim. */
void tqkv_rotation_apply(const tqkv_rotation_t *r, const float *x, float *y);
/* x = M^T y. */
void tqkv_rotation_apply_t(const tqkv_rotation_t *r, const float *y, float *x);

/* ---- internal: SIMD encode / decode of dense-rotation mse groups (tqkv__, not API) ----
 * The contract of tqkv__page_enc_had_* / tqkv__page_dec_had_* (kernels/page.h; signs
 * unused) for a group under a dense rotation with g a multiple of 16: y = Pi x is taken
 * for blocks of rows at once as rows times mt = Pi^T (matrix_t), so the matrix streams
 * from L1 once per block. Decode sums x = Pi^T z in the order of tqkv_matvec_t with
 * separate multiplies and adds, so it rounds exactly as the reference; encode uses FMA
 * and scales after the rotation (near-ties only, as the Hadamard kernels). */
struct tqkv__enc_rows;
struct tqkv__dec_rows;
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
