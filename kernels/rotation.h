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

#endif
