/* rotation.c - seeded rotations (dense Haar, randomized Hadamard) and the QJL matrix.
 *
 * Generators (PAGE_FORMAT.md states them for other implementations):
 *   Gaussian stream: splitmix64 seeded with the group seed; each pair of words
 *     (w1, w2) gives u_i = ((w_i >> 11) + 0.5) * 2^-53 and, in double,
 *     r = sqrt(-2 ln u1), n0 = r cos(2 pi u2), n1 = r sin(2 pi u2) (Box-Muller);
 *     the normals fill a [dim][dim] matrix row-major in stream order.
 *   DENSE:    G from the stream; Householder QR of G in double; Pi = Q diag(sign(R_ii))
 *             (sign(0) = +1), rounded to float. y = Pi x.
 *   HADAMARD: words w_0.. of splitmix64 seeded with the seed; tqkv_hadamard_sign().
 *             y = H D2 H D1 x / dim.
 *   QJL:      S = the Gaussian stream matrix itself, rounded to float.
 *
 * The cache is a list of objects keyed by (kind, dim, seed) with reference counts
 * and a last-use tick. Unreferenced objects stay cached until the total size exceeds
 * CACHE_BUDGET, then the least recently used unreferenced ones are freed. One mutex
 * guards the list and the counts; objects are immutable once published.
 */
#include "kernels/rotation.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page_format.h"
#include "kernels/tq_math.h"

#define CACHE_BUDGET ((size_t)64 << 20)

typedef struct rot_entry {
    tqkv_rotation_t pub; /* first member: release() casts back */
    struct rot_entry *next;
    size_t bytes;
    uint64_t tick;
    int refs;
    float *storage;
} rot_entry_t;

static pthread_mutex_t rot_lock = PTHREAD_MUTEX_INITIALIZER;
static rot_entry_t *rot_head; /* guarded by rot_lock */
static size_t rot_bytes;      /* guarded by rot_lock */
static uint64_t rot_tick;     /* guarded by rot_lock */

/* Fills m[n] with N(0,1) from the seeded Box-Muller stream (n even or odd: the last
 * pair's second normal is dropped). */
static void
gauss_stream(uint64_t seed, double *m, size_t n)
{
    uint64_t st = seed;
    const double two53 = 1.0 / 9007199254740992.0;
    for (size_t i = 0; i < n; i += 2) {
        uint64_t w1 = tqkv_splitmix64(&st), w2 = tqkv_splitmix64(&st);
        double u1 = ((double)(w1 >> 11) + 0.5) * two53;
        double u2 = ((double)(w2 >> 11) + 0.5) * two53;
        double r = sqrt(-2.0 * log(u1));
        m[i] = r * cos(2.0 * M_PI * u2);
        if (i + 1 < n)
            m[i + 1] = r * sin(2.0 * M_PI * u2);
    }
}

/* col -= 2 (v . col) / (v . v) v: the Householder reflection of step k, v[k] = vhk,
 * v[i] = ak[i] for i > k (zero above k), vvk = v . v; col a column of n doubles. */
static void
reflect(const double *ak, double vhk, double vvk, uint32_t k, uint32_t n, double *col)
{
    double dot = vhk * col[k];
    for (uint32_t i = k + 1; i < n; i++)
        dot += ak[i] * col[i];
    dot = 2.0 * dot / vvk;
    col[k] -= dot * vhk;
    for (uint32_t i = k + 1; i < n; i++)
        col[i] -= dot * ak[i];
}

/* Pi = Q diag(sign(diag R)) of the Householder QR of the n x n row-major matrix g
 * (destroyed), written row-major as float to out. Works on column-major copies so
 * that every inner loop is contiguous. */
static tqkv_status_t
haar_from_gauss(double *g, uint32_t n, float *out)
{
    double *a = malloc(sizeof(double) * n * n);  /* a[k*n + i] = G[i][k]: columns */
    double *qt = malloc(sizeof(double) * n * n); /* qt[j*n + i] = Q[i][j]: columns */
    double *vh = malloc(sizeof(double) * n);     /* v's head element per reflection */
    double *vv = malloc(sizeof(double) * n);     /* v^T v per reflection */
    double *rs = malloc(sizeof(double) * n);     /* sign(R_kk) */
    if (!a || !qt || !vh || !vv || !rs) {
        free(a);
        free(qt);
        free(vh);
        free(vv);
        free(rs);
        return TQKV_ENOMEM;
    }
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t k = 0; k < n; k++)
            a[(size_t)k * n + i] = g[(size_t)i * n + k];
    /* Reflection k: H_k = I - 2 v v^T / (v^T v), v = (0.., vh[k], a_k[k+1..n)). */
    for (uint32_t k = 0; k < n; k++) {
        double *ak = a + (size_t)k * n;
        double sub = 0, norm, alpha;
        for (uint32_t i = k + 1; i < n; i++)
            sub += ak[i] * ak[i];
        norm = sqrt(ak[k] * ak[k] + sub);
        alpha = ak[k] >= 0 ? -norm : norm; /* R_kk */
        vh[k] = ak[k] - alpha;
        vv[k] = vh[k] * vh[k] + sub;
        rs[k] = alpha >= 0 ? 1.0 : -1.0;
        ak[k] = alpha;
        if (vv[k] == 0)
            continue;
        for (uint32_t j = k + 1; j < n; j++)
            reflect(ak, vh[k], vv[k], k, n, a + (size_t)j * n);
    }
    /* Q = H_0 H_1 ... H_{n-1} I, applied right to left to the columns of I. */
    memset(qt, 0, sizeof(double) * n * n);
    for (uint32_t i = 0; i < n; i++)
        qt[(size_t)i * n + i] = 1;
    for (uint32_t k = n; k-- > 0;) {
        const double *ak = a + (size_t)k * n;
        if (vv[k] == 0)
            continue;
        for (uint32_t j = k; j < n; j++)
            reflect(ak, vh[k], vv[k], k, n, qt + (size_t)j * n);
    }
    /* Pi[i][j] = Q[i][j] * sign(R_jj). */
    for (uint32_t j = 0; j < n; j++)
        for (uint32_t i = 0; i < n; i++)
            out[(size_t)i * n + j] = (float)(qt[(size_t)j * n + i] * rs[j]);
    free(a);
    free(qt);
    free(vh);
    free(vv);
    free(rs);
    return TQKV_OK;
}

static tqkv_status_t
build(rot_entry_t *e, uint32_t kind, uint32_t dim, uint64_t seed)
{
    size_t nn = (size_t)dim * dim;
    e->pub.kind = kind;
    e->pub.dim = dim;
    e->pub.seed = seed;
    if (kind == TQKV_ROT_HADAMARD) {
        uint32_t nw = (2 * dim + 63) / 64;
        uint64_t words[2 * TQKV_PAGE_MAX_DIM / 64 + 1], st = seed;
        e->storage = malloc(sizeof(float) * 2 * dim);
        if (!e->storage)
            return TQKV_ENOMEM;
        for (uint32_t i = 0; i < nw; i++)
            words[i] = tqkv_splitmix64(&st);
        for (uint32_t i = 0; i < dim; i++) {
            e->storage[i] = tqkv_hadamard_sign(words, 0, dim, i);
            e->storage[dim + i] = tqkv_hadamard_sign(words, 1, dim, i);
        }
        e->pub.signs = e->storage;
        e->bytes = sizeof(float) * 2 * dim + sizeof *e;
        return TQKV_OK;
    }
    double *g = malloc(sizeof(double) * nn);
    /* the matrix, then its transpose (the SIMD kernels' row-block form) */
    e->storage = malloc(sizeof(float) * nn * 2);
    if (!g || !e->storage) {
        free(g);
        free(e->storage);
        e->storage = NULL;
        return TQKV_ENOMEM;
    }
    gauss_stream(seed, g, nn);
    if (kind == TQKV_ROT_QJL_GAUSS) {
        for (size_t i = 0; i < nn; i++)
            e->storage[i] = (float)g[i];
    } else {
        tqkv_status_t st = haar_from_gauss(g, dim, e->storage);
        if (st != TQKV_OK) {
            free(g);
            free(e->storage);
            e->storage = NULL;
            return st;
        }
    }
    free(g);
    e->pub.matrix = e->storage;
    e->bytes = sizeof(float) * nn + sizeof *e;
    {
        float *t = e->storage + nn;
        for (uint32_t i = 0; i < dim; i++)
            for (uint32_t j = 0; j < dim; j++)
                t[(size_t)j * dim + i] = e->storage[(size_t)i * dim + j];
        e->pub.matrix_t = t;
        e->bytes += sizeof(float) * nn;
    }
    return TQKV_OK;
}

/* Frees unreferenced least-recently-used entries while over budget. rot_lock held. */
static void
do_trim(void)
{
    while (rot_bytes > CACHE_BUDGET) {
        rot_entry_t **victim = NULL;
        for (rot_entry_t **pp = &rot_head; *pp; pp = &(*pp)->next)
            if ((*pp)->refs == 0 && (!victim || (*pp)->tick < (*victim)->tick))
                victim = pp;
        if (!victim)
            return;
        rot_entry_t *e = *victim;
        *victim = e->next;
        rot_bytes -= e->bytes;
        free(e->storage);
        free(e);
    }
}

tqkv_status_t
tqkv_rotation_acquire(uint32_t kind, uint32_t dim, uint64_t seed, const tqkv_rotation_t **out)
{
    rot_entry_t *e;
    tqkv_status_t st;
    if (kind > TQKV_ROT_QJL_GAUSS || dim < 1 || dim > TQKV_PAGE_MAX_DIM)
        return TQKV_EUNSUPPORTED;
    if (kind == TQKV_ROT_HADAMARD && !tqkv_is_pow2(dim))
        return TQKV_EUNSUPPORTED;
    pthread_mutex_lock(&rot_lock);
    for (e = rot_head; e; e = e->next)
        if (e->pub.kind == kind && e->pub.dim == dim && e->pub.seed == seed)
            break;
    if (e) {
        e->refs++;
        e->tick = ++rot_tick;
        pthread_mutex_unlock(&rot_lock);
        *out = &e->pub;
        return TQKV_OK;
    }
    /* Built under the lock: a second thread asking for the same matrix waits instead
     * of building it twice. */
    e = calloc(1, sizeof *e);
    if (!e) {
        pthread_mutex_unlock(&rot_lock);
        return TQKV_ENOMEM;
    }
    if ((st = build(e, kind, dim, seed)) != TQKV_OK) {
        pthread_mutex_unlock(&rot_lock);
        free(e);
        return st;
    }
    e->refs = 1;
    e->tick = ++rot_tick;
    e->next = rot_head;
    rot_head = e;
    rot_bytes += e->bytes;
    do_trim();
    pthread_mutex_unlock(&rot_lock);
    *out = &e->pub;
    return TQKV_OK;
}

void
tqkv_rotation_release(const tqkv_rotation_t *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&rot_lock);
    ((rot_entry_t *)(void *)r)->refs--;
    do_trim();
    pthread_mutex_unlock(&rot_lock);
}

void
tqkv_rotation_apply(const tqkv_rotation_t *r, const float *x, float *y)
{
    const uint32_t n = r->dim;
    if (r->kind == TQKV_ROT_HADAMARD) {
        const float inv = 1.0f / (float)n;
        for (uint32_t i = 0; i < n; i++)
            y[i] = x[i] * r->signs[i];
        tqkv_fwht(y, n);
        for (uint32_t i = 0; i < n; i++)
            y[i] *= r->signs[n + i];
        tqkv_fwht(y, n);
        for (uint32_t i = 0; i < n; i++)
            y[i] *= inv;
        return;
    }
    for (uint32_t i = 0; i < n; i++) {
        const float *row = r->matrix + (size_t)i * n;
        float acc = 0;
        for (uint32_t j = 0; j < n; j++)
            acc += row[j] * x[j];
        y[i] = acc;
    }
}

void
tqkv_rotation_apply_t(const tqkv_rotation_t *r, const float *y, float *x)
{
    const uint32_t n = r->dim;
    if (r->kind == TQKV_ROT_HADAMARD) {
        const float inv = 1.0f / (float)n;
        memcpy(x, y, sizeof(float) * n);
        tqkv_fwht(x, n);
        for (uint32_t i = 0; i < n; i++)
            x[i] *= r->signs[n + i];
        tqkv_fwht(x, n);
        for (uint32_t i = 0; i < n; i++)
            x[i] *= r->signs[i] * inv;
        return;
    }
    for (uint32_t j = 0; j < n; j++)
        x[j] = 0;
    for (uint32_t i = 0; i < n; i++) {
        const float *row = r->matrix + (size_t)i * n;
        const float yi = y[i];
        for (uint32_t j = 0; j < n; j++)
            x[j] += row[j] * yi;
    }
}
