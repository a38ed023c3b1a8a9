/* codebook.c - Lloyd-Max codebooks for the sphere coordinate density, fully converged.
 *
 * The density of one coordinate of a uniform point on S^{g-1} is
 * f(x) ~ (1 - x^2)^((g-3)/2) on [-1, 1]. With x = sin(t) the measure becomes
 * f(x) dx ~ cos(t)^(g-2) dt, which has no endpoint singularity for any g >= 2, and
 * every integral a Lloyd step needs has a closed form over a cell [asin a, asin b]:
 *   mass   M_n(a,b) = int cos^n t dt, by the stable forward recursion
 *          M_n = [cos^(n-1) t sin t]/n + (n-1)/n M_(n-2), M_0 = dt, M_1 = [sin t];
 *   first  int sin t cos^n t dt = [-cos^(n+1) t / (n+1)];
 *   second int sin^2 t cos^n t dt = M_n - M_(n+2).
 * So the iteration is exact up to double rounding and is run until no centroid moves
 * by more than 1e-12 (about 30x above the rounding noise of these integrals at g = 1024).
 *
 * Locking: one mutex serializes construction; a table of atomic pointers publishes a
 * finished codebook, after which it is read without locks.
 */
#include "kernels/codebook.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels/page_format.h"

#define CB_MAX_BITS 4

static pthread_mutex_t cb_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(tqkv_codebook_t *) cb_table[TQKV_PAGE_MAX_DIM + 1][CB_MAX_BITS + 1];

/* Classical Lloyd-Max points for N(0,1), positive halves (Max 1960), used as the
 * initial guess (divided by sqrt(g)). */
static const double gauss_init[CB_MAX_BITS + 1][8] = {
    {0},
    {0.7979},
    {0.4528, 1.5104},
    {0.2451, 0.7560, 1.3439, 2.1520},
    {0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326},
};

/* int_{ta}^{tb} cos^n t dt for n >= 0, by forward recursion in n (stable: errors are
 * multiplied by (n-1)/n < 1 at each step). */
static double
cos_pow_integral(int n, double ta, double tb)
{
    double ca = cos(ta), cb = cos(tb), sa = sin(ta), sb = sin(tb);
    double m0 = tb - ta, m1 = sb - sa;
    double pa, pb; /* cos^(k-1) at a and b */
    if (n == 0)
        return m0;
    if (n == 1)
        return m1;
    /* pa, pb hold cos^(k-1) for the k being computed; start at k = 2. */
    pa = ca;
    pb = cb;
    double mk2 = m0, mk1 = m1, mk = 0;
    for (int k = 2; k <= n; k++) {
        mk = (pb * sb - pa * sa) / k + (double)(k - 1) / k * mk2;
        mk2 = mk1;
        mk1 = mk;
        pa *= ca;
        pb *= cb;
    }
    return mk;
}

/* Integrals of the (unnormalized) measure cos^n t dt over x in [a, b]:
 * m = mass, m1 = int x, m2 = int x^2. */
static void
cell_moments(int n, double a, double b, double *m, double *m1, double *m2)
{
    double ta = asin(a), tb = asin(b);
    double mn = cos_pow_integral(n, ta, tb);
    double mn2 = cos_pow_integral(n + 2, ta, tb);
    *m = mn;
    *m1 = (pow(cos(ta), n + 1) - pow(cos(tb), n + 1)) / (n + 1);
    *m2 = mn - mn2;
}

static tqkv_status_t
build(uint32_t g, uint32_t bits, tqkv_codebook_t *cb)
{
    const int n_exp = (int)g - 2;
    const uint32_t n = 1u << bits;
    const double sg = sqrt((double)g);
    double c[16] = {0}, t[17], total, d = 0;
    int iter;

    /* Initial guess: Gaussian Lloyd-Max points / sqrt(g), or a uniform grid when
     * those fall outside (-1, 1) (tiny g). */
    for (uint32_t k = 0; k < n / 2; k++) {
        double z = gauss_init[bits][k] / sg;
        c[n / 2 + k] = z;
        c[n / 2 - 1 - k] = -z;
    }
    if (c[n - 1] >= 0.98)
        for (uint32_t k = 0; k < n; k++)
            c[k] = -1.0 + (2.0 * k + 1.0) / n;

    total = cos_pow_integral(n_exp, -M_PI / 2, M_PI / 2);
    for (iter = 0; iter < 1000000; iter++) {
        double maxmove = 0;
        t[0] = -1.0;
        t[n] = 1.0;
        for (uint32_t k = 1; k < n; k++)
            t[k] = 0.5 * (c[k - 1] + c[k]);
        for (uint32_t k = 0; k < n; k++) {
            double m, m1, m2, nc;
            cell_moments(n_exp, t[k], t[k + 1], &m, &m1, &m2);
            nc = m > 0 ? m1 / m : 0.5 * (t[k] + t[k + 1]);
            if (fabs(nc - c[k]) > maxmove)
                maxmove = fabs(nc - c[k]);
            c[k] = nc;
        }
        /* Keep exact symmetry (the density is even). */
        for (uint32_t k = 0; k < n / 2; k++) {
            double z = 0.5 * (c[n - 1 - k] - c[k]);
            c[k] = -z;
            c[n - 1 - k] = z;
        }
        if (maxmove < 1e-12)
            break;
    }
    if (iter == 1000000)
        return TQKV_EINTERNAL;

    t[0] = -1.0;
    t[n] = 1.0;
    for (uint32_t k = 1; k < n; k++)
        t[k] = 0.5 * (c[k - 1] + c[k]);
    for (uint32_t k = 0; k < n; k++) {
        double m, m1, m2;
        cell_moments(n_exp, t[k], t[k + 1], &m, &m1, &m2);
        d += m2 - 2 * c[k] * m1 + c[k] * c[k] * m;
    }
    cb->dim = g;
    cb->bits = bits;
    cb->n = n;
    for (uint32_t k = 0; k < 16; k++)
        cb->z[k] = k < n ? (float)(c[k] * sg) : 0.0f;
    for (uint32_t k = 0; k < 15; k++)
        cb->thr[k] = k + 1 < n ? (float)(t[k + 1] * sg) : 0.0f;
    cb->d_mse = g * d / total;
    return TQKV_OK;
}

tqkv_status_t
tqkv_codebook_get(uint32_t dim, uint32_t bits, const tqkv_codebook_t **out)
{
    tqkv_codebook_t *cb;
    tqkv_status_t st = TQKV_OK;
    if (dim < 2 || dim > TQKV_PAGE_MAX_DIM || bits < 1 || bits > CB_MAX_BITS)
        return TQKV_EUNSUPPORTED;
    cb = atomic_load_explicit(&cb_table[dim][bits], memory_order_acquire);
    if (cb) {
        *out = cb;
        return TQKV_OK;
    }
    pthread_mutex_lock(&cb_lock);
    cb = atomic_load_explicit(&cb_table[dim][bits], memory_order_relaxed);
    if (!cb) {
        cb = calloc(1, sizeof *cb);
        if (!cb) {
            st = TQKV_ENOMEM;
        } else if ((st = build(dim, bits, cb)) != TQKV_OK) {
            free(cb);
            cb = NULL;
        } else {
            atomic_store_explicit(&cb_table[dim][bits], cb, memory_order_release);
        }
    }
    pthread_mutex_unlock(&cb_lock);
    if (cb)
        *out = cb;
    return st;
}
