/* codebook.h - Lloyd-Max codebooks for the coordinate density of a uniform point on
 * the sphere S^{dim-1}, f(x) ~ (1 - x^2)^((dim-3)/2), fully converged.
 *
 * Centroids and thresholds are kept in the "z" domain (times sqrt(dim)), the form
 * stored in pages: a unit vector's rotated coordinate y_j is quantized as
 * nearest(y_j * sqrt(dim)).
 */
#ifndef TQKV_KERNELS_CODEBOOK_H
#define TQKV_KERNELS_CODEBOOK_H

#include <stdint.h>

#include "kernels/status.h"

typedef struct tqkv_codebook {
    uint32_t dim;  /* the sphere dimension (a group's g) */
    uint32_t bits; /* 1..4 */
    uint32_t n;    /* 2^bits */
    float z[16];   /* centroids * sqrt(dim), ascending */
    float thr[15]; /* decision thresholds (midpoints), ascending, z domain */
    double d_mse;  /* theory: E||u - u_hat||^2 for a unit u = dim * per-coordinate MSE */
} tqkv_codebook_t;

/* Returns the codebook for (dim, bits), dim in 2..TQKV_PAGE_MAX_DIM and bits in 1..4:
 * computed on first use (thread-safe) and cached; *out is borrowed for the life of
 * the process. TQKV_EUNSUPPORTED for other (dim, bits). */
tqkv_status_t tqkv_codebook_get(uint32_t dim, uint32_t bits, const tqkv_codebook_t **out);

#endif
