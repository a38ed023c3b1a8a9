/* page.c - TurboQuant page encode, validate and decode (scalar reference + dispatch).
 *
 * The *_ref functions are the specification (proto/PAGE_FORMAT.md): key means, channel
 * energies and norms in f64, rotation and quantization in f32, per vector through the
 * shared tqkv_group_encode_vec / tqkv_group_decode_vec of tq_math.h (the CUDA kernels
 * run the same code). tqkv_page_encode / tqkv_page_decode_* take the same route except
 * for mse groups with g a multiple of 16, which go through the SIMD kernels chosen once
 * at run time (page_avx512.c, page_avx2.c; cpu.h: TQKV_ISA=avx2 or scalar caps the choice):
 * Hadamard groups (every power-of-two head dim, both groups of 3.5 bits) and dense ones
 * (the 3d/4 group of 2.5 bits, non-power-of-two head dims; rotation.h). Those produce
 * the same bytes except for coordinates within float rounding of a decision threshold
 * (near-ties) and the scales of such vectors. Two-group tensors are permuted per head
 * into [T][D] rows of group 0's channels then group 1's, so each group is a strided
 * row set for the kernels. Prod-mode groups always use the reference.
 *
 * Thread safety: every function is reentrant; codebooks and rotations come from
 * their thread-safe caches; the kernel table is set up under pthread_once.
 */
#include "kernels/page.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/cpu.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* ---- run-time kernel selection ---- */

typedef struct page_kernels {
    const char *isa;
    tqkv__enc_had_fn enc_had; /* NULL: reference only */
    tqkv__dec_had_fn dec_had;
    size_t (*enc_dense)(const tqkv__enc_rows_t *, const float *mt); /* NULL: reference */
    void (*dec_dense)(const tqkv__dec_rows_t *, const float *m);
    void (*rows_mm)(const float *a, uint32_t g, const float *x, float *y, size_t n);
    uint32_t (*crc)(uint32_t, const void *, size_t);
    uint32_t (*crc_copy)(uint32_t, void *, const void *, size_t);
} page_kernels_t;

static page_kernels_t kern = {
    "scalar", NULL, NULL, NULL, NULL, NULL, tqkv_crc32c_ref, tqkv_crc32c_copy_ref};
static pthread_once_t kern_once = PTHREAD_ONCE_INIT;

/* The best kernels tqkv_cpu_usable() admits (cpu.h; TQKV_ISA=scalar|avx2 caps them). */
static void
kern_init(void)
{
    const tqkv_cpu_t *c = tqkv_cpu_usable();
    if (c->sse42_pclmul)
        kern.crc = tqkv__crc32c_sse42, kern.crc_copy = tqkv__crc32c_copy_sse42;
    if (c->vpclmul)
        kern.crc = tqkv__crc32c_vpclmul, kern.crc_copy = tqkv__crc32c_copy_vpclmul;
    if (c->avx2) {
        kern.isa = "avx2";
        kern.enc_had = tqkv__page_enc_had_avx2;
        kern.dec_had = tqkv__page_dec_had_avx2;
        kern.enc_dense = tqkv__page_enc_dense_avx2;
        kern.dec_dense = tqkv__page_dec_dense_avx2;
        kern.rows_mm = tqkv__rows_matmul_avx2;
    }
    if (c->avx512) {
        kern.isa = "avx512";
        kern.enc_had = tqkv__page_enc_had_avx512;
        kern.dec_had = tqkv__page_dec_had_avx512;
        kern.enc_dense = tqkv__page_enc_dense_avx512;
        kern.dec_dense = tqkv__page_dec_dense_avx512;
        kern.rows_mm = tqkv__rows_matmul_avx512;
    }
}

static const page_kernels_t *
kernels(void)
{
    pthread_once(&kern_once, kern_init);
    return &kern;
}

const char *
tqkv_kernels_isa(void)
{
    return kernels()->isa;
}

/* ---- CRC32C ---- */

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void
crc_table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[i] = c;
    }
}

uint32_t
tqkv_crc32c_ref(uint32_t crc, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    pthread_once(&crc_once, crc_table_init);
    crc = ~crc;
    for (size_t i = 0; i < len; i++)
        crc = (crc >> 8) ^ crc_table[(crc ^ p[i]) & 0xffu];
    return ~crc;
}

uint32_t
tqkv_crc32c(uint32_t crc, const void *buf, size_t len)
{
    return kernels()->crc(crc, buf, len);
}

uint32_t
tqkv_crc32c_copy_ref(uint32_t crc, void *dst, const void *src, size_t len)
{
    if (len)
        memcpy(dst, src, len);
    return tqkv_crc32c_ref(crc, src, len);
}

uint32_t
tqkv_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
{
    return kernels()->crc_copy(crc, dst, src, len);
}

uint32_t
tqkv_page_crc(const void *page, size_t page_bytes)
{
    static const uint8_t zero[4];
    const uint8_t *p = page;
    uint32_t crc = tqkv_crc32c(0, p, 12);
    crc = tqkv_crc32c(crc, zero, 4);
    return tqkv_crc32c(crc, p + 16, page_bytes - 16);
}

/* ---- parameters and layout ---- */

static void
seterr(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (!err || !errlen)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static const char *const tname[2] = {"K", "V"};

static tqkv_status_t
check_tensor(const char *name, const tqkv_tensor_codec_t *tc, uint32_t d, char *err, size_t errlen)
{
    uint32_t hi, lo, nhi;
    if (tc->bits_x2 == 0)
        return TQKV_OK;
    if (tc->mode == TQKV_MODE_RAW) {
        if (tc->bits_x2 != TQKV_RAW_BITS_X2) {
            seterr(err, errlen,
                   "%s: lossless (raw BF16) mode takes no bit width: bits_x2 must be %u, not %u",
                   name, TQKV_RAW_BITS_X2, tc->bits_x2);
            return TQKV_EINVAL;
        }
        if (tc->norm_correction) {
            seterr(err, errlen, "%s: norm correction does not apply to lossless (raw BF16) mode",
                   name);
            return TQKV_EINVAL;
        }
        return TQKV_OK;
    }
    if (tc->bits_x2 == TQKV_RAW_BITS_X2) {
        seterr(err, errlen, "%s: bits_x2 %u (16 bits) is the lossless mode: set mode raw (%u)",
               name, TQKV_RAW_BITS_X2, TQKV_MODE_RAW);
        return TQKV_EINVAL;
    }
    if (tqkv_bits_split(tc->bits_x2, d, &hi, &lo, &nhi) != 0) {
        seterr(err, errlen, "%s: unsupported bit width %u/2 (1, 1.5, 2, 2.5, 3, 3.5, 4)", name,
               tc->bits_x2);
        return TQKV_EUNSUPPORTED;
    }
    if (tc->mode != TQKV_MODE_MSE && tc->mode != TQKV_MODE_PROD) {
        seterr(err, errlen, "%s: unknown mode %u", name, tc->mode);
        return TQKV_EUNSUPPORTED;
    }
    if (tc->norm_correction > 1) {
        seterr(err, errlen, "%s: norm_correction must be 0 or 1", name);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

/* Builds the header (layout, parameters, crc 0) for shape and codec, after checking. */
static tqkv_status_t
plan(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, tqkv_page_header_t *h, char *err,
     size_t errlen)
{
    uint64_t off = TQKV_PAGE_HEADER_BYTES, n;
    tqkv_status_t st;
    const tqkv_tensor_codec_t *tc[2] = {&c->k, &c->v};

    if (!s || !c) {
        seterr(err, errlen, "missing shape or codec");
        return TQKV_EINVAL;
    }
    if (s->head_dim < TQKV_PAGE_MIN_DIM || s->head_dim > TQKV_PAGE_MAX_DIM) {
        seterr(err, errlen, "head_dim %u outside [%u, %u]", s->head_dim, TQKV_PAGE_MIN_DIM,
               TQKV_PAGE_MAX_DIM);
        return TQKV_EUNSUPPORTED;
    }
    if (s->num_kv_heads < 1 || s->num_kv_heads > TQKV_PAGE_MAX_HEADS) {
        seterr(err, errlen, "num_kv_heads %u outside [1, %u]", s->num_kv_heads,
               TQKV_PAGE_MAX_HEADS);
        return TQKV_EINVAL;
    }
    if (s->num_tokens < 1 || s->num_tokens > TQKV_PAGE_MAX_TOKENS) {
        seterr(err, errlen, "num_tokens %u outside [1, %u]", s->num_tokens, TQKV_PAGE_MAX_TOKENS);
        return TQKV_EINVAL;
    }
    if (c->rotation != TQKV_ROT_DENSE && c->rotation != TQKV_ROT_HADAMARD) {
        seterr(err, errlen, "unknown rotation kind %u", c->rotation);
        return TQKV_EUNSUPPORTED;
    }
    if (c->key_centering > 1) {
        seterr(err, errlen, "key_centering must be 0 or 1");
        return TQKV_EINVAL;
    }
    if (c->k.bits_x2 == 0 && c->v.bits_x2 == 0) {
        seterr(err, errlen, "both K and V absent (bits 0)");
        return TQKV_EINVAL;
    }
    for (int t = 0; t < 2; t++)
        if ((st = check_tensor(tname[t], tc[t], s->head_dim, err, errlen)) != TQKV_OK)
            return st;

    n = (uint64_t)s->num_tokens * s->num_kv_heads;
    memset(h, 0, sizeof *h);
    h->magic = TQKV_PAGE_MAGIC;
    h->version = TQKV_PAGE_VERSION;
    h->header_bytes = TQKV_PAGE_HEADER_BYTES;
    h->seed = c->seed;
    h->num_tokens = s->num_tokens;
    h->num_kv_heads = (uint16_t)s->num_kv_heads;
    h->head_dim = (uint16_t)s->head_dim;
    h->rotation = c->rotation;
    if (c->key_centering && c->k.bits_x2 && c->k.mode != TQKV_MODE_RAW) {
        h->flags |= TQKV_PAGE_KEY_CENTERED;
        h->mean_offset = (uint32_t)off;
        off += tqkv_align_up(4ull * s->num_kv_heads * s->head_dim, TQKV_PAGE_ALIGN);
    }
    for (int t = 0; t < 2; t++) {
        tqkv_page_tensor_desc_t *td = &h->tensor[t];
        tqkv_group_layout_t L;
        uint32_t hi = 0, lo = 0, nhi = 0, d = s->head_dim;
        if (!tc[t]->bits_x2)
            continue;
        if (tc[t]->mode == TQKV_MODE_RAW) { /* lossless: one raw section */
            uint64_t rb = tqkv_raw_section_bytes((uint64_t)s->num_tokens * s->num_kv_heads, d);
            td->mode = TQKV_MODE_RAW;
            td->bits_x2 = TQKV_RAW_BITS_X2;
            td->hi_bits = TQKV_RAW_BITS;
            td->n_hi = (uint16_t)d;
            td->group_offset[0] = (uint32_t)off;
            td->group_bytes[0] = (uint32_t)rb;
            off += rb;
            if (off > TQKV_PAGE_MAX_BYTES)
                break;
            continue;
        }
        (void)tqkv_bits_split(tc[t]->bits_x2, d, &hi, &lo, &nhi);
        td->mode = tc[t]->mode;
        td->bits_x2 = tc[t]->bits_x2;
        td->hi_bits = (uint8_t)hi;
        td->lo_bits = (uint8_t)lo;
        td->n_hi = (uint16_t)nhi;
        td->flags = tc[t]->norm_correction ? TQKV_TENSOR_NORM_CORRECTED : 0;
        if (lo) {
            td->mask_offset = (uint32_t)off;
            off += tqkv_align_up((uint64_t)s->num_kv_heads * ((d + 7) / 8), TQKV_PAGE_ALIGN);
        }
        tqkv_group_layout(nhi, hi, tc[t]->mode, n, &L);
        td->group_offset[0] = (uint32_t)off;
        td->group_bytes[0] = (uint32_t)L.bytes;
        off += L.bytes;
        if (lo) {
            tqkv_group_layout(d - nhi, lo, tc[t]->mode, n, &L);
            td->group_offset[1] = (uint32_t)off;
            td->group_bytes[1] = (uint32_t)L.bytes;
            off += L.bytes;
        }
        if (off > TQKV_PAGE_MAX_BYTES)
            break;
    }
    if (off > TQKV_PAGE_MAX_BYTES) {
        seterr(err, errlen, "page would be %llu bytes (> %u)", (unsigned long long)off,
               TQKV_PAGE_MAX_BYTES);
        return TQKV_EINVAL;
    }
    h->page_bytes = (uint32_t)off;
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_check_params(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, char *err,
                       size_t errlen)
{
    tqkv_page_header_t h;
    return plan(shape, codec, &h, err, errlen);
}

tqkv_status_t
tqkv_page_size(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, size_t *out)
{
    tqkv_page_header_t h;
    tqkv_status_t st = plan(shape, codec, &h, NULL, 0);
    if (st == TQKV_OK)
        *out = h.page_bytes;
    return st;
}

/* ---- per-group transforms ---- */

/* The matrices and codebook of one group. */
typedef struct group_ctx {
    tqkv_group_layout_t L;
    const tqkv_rotation_t *rot; /* Pi */
    const tqkv_rotation_t *qjl; /* S (prod) */
    const tqkv_codebook_t *cb;  /* NULL when mse_bits == 0 */
    const float *z;             /* codebook to decode with (page's own) */
    float sqrt_g;               /* sqrtf(g) */
    int norm_corrected;
} group_ctx_t;

static void
group_ctx_fini(group_ctx_t *G)
{
    tqkv_rotation_release(G->rot);
    tqkv_rotation_release(G->qjl);
    G->rot = G->qjl = NULL;
}

static tqkv_status_t
group_ctx_init(group_ctx_t *G, uint32_t g, uint32_t bits, uint32_t mode, uint64_t n,
               uint32_t page_rot, uint64_t seed, uint32_t tensor, uint32_t group, int need_cb)
{
    tqkv_status_t st;
    memset(G, 0, sizeof *G);
    tqkv_group_layout(g, bits, mode, n, &G->L);
    G->sqrt_g = sqrtf((float)g);
    if (need_cb && G->L.mse_bits && (st = tqkv_codebook_get(g, G->L.mse_bits, &G->cb)) != TQKV_OK)
        return st;
    if (G->L.mse_bits &&
        (st = tqkv_rotation_acquire(tqkv_group_rotation(page_rot, g), g,
                                    tqkv_seed_derive(seed, tensor, group, TQKV_SEED_ROTATION),
                                    &G->rot)) != TQKV_OK)
        return st;
    if (mode == TQKV_MODE_PROD &&
        (st = tqkv_rotation_acquire(TQKV_ROT_QJL_GAUSS, g,
                                    tqkv_seed_derive(seed, tensor, group, TQKV_SEED_QJL),
                                    &G->qjl)) != TQKV_OK) {
        group_ctx_fini(G);
        return st;
    }
    if (G->cb)
        G->z = G->cb->z;
    return TQKV_OK;
}

/* The tq_math.h view of a group (the per-vector code shared with the CUDA kernels). */
static void
group_codec(const group_ctx_t *G, tqkv_group_codec_t *C)
{
    memset(C, 0, sizeof *C);
    C->dim = G->L.dim;
    C->mode = G->L.mode;
    C->mse_bits = G->L.mse_bits;
    C->n_centroids = G->L.n_centroids;
    C->rotation = G->rot ? G->rot->kind : TQKV_ROT_DENSE;
    C->norm_corrected = (uint32_t)G->norm_corrected;
    C->z = G->z;
    C->thr = G->cb ? G->cb->thr : NULL;
    C->matrix = G->rot ? G->rot->matrix : NULL;
    C->signs = G->rot ? G->rot->signs : NULL;
    C->qjl = G->qjl ? G->qjl->matrix : NULL;
}

/* Reference encode of one group vector x[g] (double: centered BF16 values): exactly
 * tqkv_group_encode_vec of tq_math.h, so the CPU reference and the CUDA encoder
 * produce the same bytes. work: 3g floats; idx_row and sign_row zeroed. */
static void
encode_vec_ref(const group_ctx_t *G, const double *x, float *work, uint16_t *scale, uint16_t *gamma,
               uint8_t *idx_row, uint8_t *sign_row)
{
    tqkv_group_codec_t C;
    group_codec(G, &C);
    tqkv_group_encode_vec(&C, x, work, scale, gamma, idx_row, sign_row);
}

/* Reference decode of one group vector into out[g] (double, before un-centering):
 * tqkv_group_decode_vec. work: 2g floats. */
static void
decode_vec_ref(const group_ctx_t *G, float scale, float gamma, const uint8_t *idx_row,
               const uint8_t *sign_row, float *work, double *out)
{
    tqkv_group_codec_t C;
    group_codec(G, &C);
    tqkv_group_decode_vec(&C, scale, gamma, idx_row, sign_row, work, out);
}

/* decode_vec_ref of a prod vector whose QJL product aq = S^T sign was taken already (by
 * kernels()->rows_mm for a block of vectors, bit for bit tqkv_matvec_t): the rest of
 * tqkv_group_decode_vec, operation for operation. am: Pi^T z[idx] taken the same way
 * (dense rotation), or NULL. work: 2g floats. */
static void
decode_vec_prod(const group_ctx_t *G, float scale, float gamma, const uint8_t *idx_row,
                const float *am, const float *aq, float *work, double *out)
{
    tqkv_group_codec_t C;
    const uint32_t g = G->L.dim, b = G->L.mse_bits;
    float *y = work, *a = work + g;
    double c;
    group_codec(G, &C);
    for (uint32_t j = 0; j < g; j++)
        out[j] = 0;
    if (b) {
        if (!am) {
            for (uint32_t j = 0; j < g; j++)
                y[j] = C.z[tqkv_bits_get(idx_row, j, b)];
            tqkv_group_rotate_t(&C, y, a);
            am = a;
        }
        for (uint32_t j = 0; j < g; j++)
            out[j] = TQKV_DMUL(scale, am[j]);
    }
    c = TQKV_DMUL(TQKV_SQRT_HALF_PI / sqrt((double)g), gamma);
    for (uint32_t j = 0; j < g; j++)
        out[j] = TQKV_DADD(out[j], TQKV_DMUL(c, aq[j]));
}

/* ---- encode ---- */

/* Finds the first NaN/Inf of a [T][H][D] BF16 tensor; 0 when all finite. */
static int
find_nonfinite(const uint16_t *x, uint64_t count, uint64_t *where)
{
    uint32_t bad = 0;
    uint64_t i = 0;
    /* branch-free scan in chunks (vectorizes), then locate */
    for (; i < count; i += 4096) {
        uint64_t e = i + 4096 < count ? i + 4096 : count;
        for (uint64_t k = i; k < e; k++)
            bad |= (x[k] & 0x7f80u) == 0x7f80u;
        if (bad) {
            for (uint64_t k = i; k < e; k++)
                if (tqkv_bf16_is_nonfinite(x[k])) {
                    *where = k;
                    return 1;
                }
        }
    }
    return 0;
}

/* Picks the n_hi highest-energy channels (ties to the lower index) into mask (ceil(D/8)
 * bytes, zeroed): channel c is in when its rank (tqkv_energy_rank: energy descending,
 * ties to the lower index) is below n_hi. Linear time: the n_hi-th largest energy by
 * quickselect on a copy (tmp[d]), then every channel above it and the lowest-indexed
 * ones equal to it. Energies are finite. Reentrant. */
static void
select_outliers(const double *energy, uint32_t d, uint32_t n_hi, uint8_t *mask, double *tmp)
{
    int lo = 0, hi = (int)d - 1, k = (int)n_hi - 1;
    uint32_t gt = 0, need;
    double thr;
    memcpy(tmp, energy, sizeof(double) * d);
    while (lo < hi) { /* k-th largest (0-based) of tmp[lo..hi] */
        const double p = tmp[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (tmp[i] > p)
                i++;
            while (tmp[j] < p)
                j--;
            if (i <= j) {
                double w = tmp[i];
                tmp[i++] = tmp[j];
                tmp[j--] = w;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    thr = tmp[k];
    for (uint32_t c = 0; c < d; c++)
        gt += energy[c] > thr;
    need = n_hi - gt;
    for (uint32_t c = 0; c < d; c++) {
        int in = energy[c] > thr;
        if (!in && energy[c] == thr && need) {
            in = 1;
            need--;
        }
        if (in)
            mask[c >> 3] |= (uint8_t)(1u << (c & 7u));
    }
}

/* encode_vec_ref of a prod vector up to its QJL product: tqkv_group_encode_vec operation
 * for operation, leaving u = r / ||r|| in u_out (g floats) for S u, taken for a block of
 * vectors by kernels()->rows_mm (bit for bit tqkv_matvec). Returns 0 for a zero vector
 * (finished: scale and gamma 0, every sign set). work: 3g floats. */
static int
encode_vec_prod_pre(const group_ctx_t *G, const double *x, float *work, uint16_t *scale,
                    uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row, float *u_out)
{
    tqkv_group_codec_t C;
    const uint32_t g = G->L.dim, b = G->L.mse_bits;
    float *u = work, *y = work + g, *a = work + 2 * g;
    const float sqrt_g = sqrtf((float)g);
    double s = 0, zn2 = 0, sc, rn = 0, sf;
    group_codec(G, &C);
    for (uint32_t j = 0; j < g; j++)
        s = TQKV_DADD(s, TQKV_DMUL(x[j], x[j]));
    s = sqrt(s);
    if (s == 0) {
        *scale = 0;
        *gamma = 0;
        for (uint32_t j = 0; j < g; j++)
            sign_row[j >> 3] |= (uint8_t)(1u << (j & 7u));
        return 0;
    }
    for (uint32_t j = 0; j < g; j++)
        u[j] = (float)(x[j] / s);
    if (b) {
        tqkv_group_rotate(&C, u, y);
        for (uint32_t j = 0; j < g; j++) {
            uint32_t k = tqkv_nearest_index(TQKV_FMUL(y[j], sqrt_g), C.thr, C.n_centroids);
            tqkv_bits_put(idx_row, j, b, k);
            y[j] = C.z[k];
            zn2 = TQKV_DADD(zn2, TQKV_DMUL(y[j], y[j]));
        }
    }
    if (C.norm_corrected && b && zn2 > 0)
        sc = s / sqrt(zn2);
    else
        sc = s / sqrt((double)g);
    *scale = tqkv_scale_to_bf16(tqkv_clamp_flt(sc));
    if (b)
        tqkv_group_rotate_t(&C, y, a);
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

#define PROD_BLOCK 64 /* prod vectors per QJL block product */

/* Prod rows [0, T) of head hh (see encode_group_head) with the QJL products of
 * PROD_BLOCK vectors at a time. Returns 0 when out of memory (nothing written). */
static int
encode_group_head_prod(const group_ctx_t *G, uint8_t *base, const uint16_t *xg, size_t xs,
                       const float *mug, uint32_t T, uint64_t hh, uint64_t H, double *gx,
                       float *work)
{
    const uint32_t g = G->L.dim;
    uint16_t *scale = (uint16_t *)(base + G->L.off_scale);
    uint16_t *gamma = (uint16_t *)(base + G->L.off_gamma);
    uint8_t *idx = base + G->L.off_idx, *signs = base + G->L.off_signs;
    float *ub = malloc(sizeof(float) * 2 * PROD_BLOCK * g), *yb = ub ? ub + PROD_BLOCK * g : NULL;
    uint8_t live[PROD_BLOCK];
    if (!ub)
        return 0;
    for (uint32_t t0 = 0; t0 < T; t0 += PROD_BLOCK) {
        const uint32_t nb = T - t0 < PROD_BLOCK ? T - t0 : PROD_BLOCK;
        for (uint32_t r = 0; r < nb; r++) {
            const uint64_t i = (uint64_t)(t0 + r) * H + hh;
            const uint16_t *xr = xg + (size_t)(t0 + r) * xs;
            for (uint32_t j = 0; j < g; j++)
                gx[j] = (double)tqkv_bf16_to_f32(xr[j]) - (mug ? (double)mug[j] : 0.0);
            live[r] = (uint8_t)encode_vec_prod_pre(
                G, gx, work, scale + i, gamma + i, idx + i * G->L.idx_row_bytes,
                signs + i * G->L.sign_row_bytes, ub + (size_t)r * g);
            if (!live[r])
                memset(ub + (size_t)r * g, 0, sizeof(float) * g);
        }
        kernels()->rows_mm(G->qjl->matrix_t, g, ub, yb, nb);
        for (uint32_t r = 0; r < nb; r++) {
            uint8_t *sr = signs + ((uint64_t)(t0 + r) * H + hh) * G->L.sign_row_bytes;
            if (!live[r])
                continue;
            for (uint32_t j = 0; j < g; j++)
                if (yb[(size_t)r * g + j] >= 0.0f)
                    sr[j >> 3] |= (uint8_t)(1u << (j & 7u));
        }
    }
    free(ub);
    return 1;
}

/* Encodes rows [0, T) of head hh of one group: the SIMD kernel when it applies, the
 * reference for the rows it hands back (and for everything else). xg: the group's BF16
 * rows (stride xs elements); mug: the group's f32 key mean or NULL. */
static void
encode_group_head(const group_ctx_t *G, uint8_t *base, const uint16_t *xg, size_t xs,
                  const float *mug, uint32_t T, uint64_t hh, uint64_t H, int fast, double *gx,
                  float *work)
{
    const uint32_t g = G->L.dim;
    const int prod = G->L.mode == TQKV_MODE_PROD;
    const int dense = G->rot && G->rot->kind == TQKV_ROT_DENSE;
    const int simd = fast && !prod && G->rot && g % 16 == 0 && /* (kernels: g a multiple of 16) */
                     (dense ? kernels()->enc_dense != NULL : kernels()->enc_had != NULL);
    uint16_t *scale = (uint16_t *)(base + G->L.off_scale);
    uint16_t *gamma = prod ? (uint16_t *)(base + G->L.off_gamma) : NULL;
    uint8_t *idx = base + G->L.off_idx;
    uint8_t *signs = prod ? base + G->L.off_signs : NULL;
    tqkv__enc_rows_t A;
    uint32_t t = 0;
    if (fast && prod && G->qjl && G->qjl->matrix_t && g % 16 == 0 && kernels()->rows_mm &&
        encode_group_head_prod(G, base, xg, xs, mug, T, hh, H, gx, work))
        return;
    memset(&A, 0, sizeof A);
    if (simd) {
        A.x_stride = xs;
        A.mu = mug;
        A.g = g;
        A.bits = G->L.mse_bits;
        A.norm_corrected = G->norm_corrected;
        A.signs = G->rot->signs;
        A.z = G->cb->z;
        A.thr = G->cb->thr;
        A.scale_stride = H;
        A.idx_stride = H * G->L.idx_row_bytes;
    }
    while (t < T) {
        uint64_t i;
        const uint16_t *xr;
        if (simd) {
            i = (uint64_t)t * H + hh;
            A.x = xg + (size_t)t * xs;
            A.n = T - t;
            A.scale = scale + i;
            A.idx = idx + i * G->L.idx_row_bytes;
            t += (uint32_t)(dense ? kernels()->enc_dense(&A, G->rot->matrix_t)
                                  : kernels()->enc_had(&A));
            if (t >= T)
                break;
        }
        /* row t by the reference (all rows, or one the kernel handed back) */
        i = (uint64_t)t * H + hh;
        xr = xg + (size_t)t * xs;
        for (uint32_t j = 0; j < g; j++)
            gx[j] = (double)tqkv_bf16_to_f32(xr[j]) - (mug ? (double)mug[j] : 0.0);
        encode_vec_ref(G, gx, work, scale + i, gamma ? gamma + i : NULL,
                       idx + i * G->L.idx_row_bytes,
                       signs ? signs + i * G->L.sign_row_bytes : NULL);
        t++;
    }
}

/* acc[k] += (x[k] - mean[k])^2 (f64; mean NULL: 0) for k < n: the energy pass, the same
 * operations in every ISA version (no contraction in this library). */
static inline __attribute__((always_inline)) void
energy_accum_body(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    if (mean)
        for (uint64_t k = 0; k < n; k++) {
            double v = (double)tqkv_bf16_to_f32(x[k]) - (double)mean[k];
            acc[k] += v * v;
        }
    else
        for (uint64_t k = 0; k < n; k++) {
            double v = (double)tqkv_bf16_to_f32(x[k]);
            acc[k] += v * v;
        }
}

/* acc[k] += x[k] (f64) for k < n; returns the largest |x| bits seen (max of *maxmag). */
static inline __attribute__((always_inline)) uint16_t
sum_accum_body(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    for (uint64_t k = 0; k < n; k++) {
        uint16_t m = x[k] & 0x7fffu;
        acc[k] += (double)tqkv_bf16_to_f32(x[k]);
        maxmag = m > maxmag ? m : maxmag;
    }
    return maxmag;
}

/* The centering votes of one head over T tokens (row t at x + t * xs, D channels) against
 * its mean mu (tq_math.h tqkv_token_center_energy / tqkv_center_vote): their sum and the
 * number of non-zero tokens. Integer sums: any token order gives the same result. */
static inline __attribute__((always_inline)) void
center_votes_body(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                  uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        double ep, ec;
        tqkv_token_center_energy(x + t * xs, mu, D, &ep, &ec);
        v += tqkv_center_vote(ep, ec);
        n += ep > 0;
    }
    *votes = v;
    *nonzero = n;
}

/* One copy per ISA, picked at run time. Not target_clones: its IFUNC resolvers run before
 * the sanitizer runtimes are up (every TSan binary crashed at start-up). */
__attribute__((target("avx512f"))) static void
energy_accum_avx512(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
__attribute__((target("avx2"))) static void
energy_accum_avx2(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
static void
energy_accum_plain(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    energy_accum_body(acc, x, mean, n);
}
__attribute__((target("avx512f"))) static uint16_t
sum_accum_avx512(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}
__attribute__((target("avx2"))) static uint16_t
sum_accum_avx2(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}
static uint16_t
sum_accum_plain(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    return sum_accum_body(acc, x, n, maxmag);
}

/* The SIMD copies hold the 8 lanes of tqkv_token_center_energy in registers (lane j:
 * channels c = j mod 8; f64, no contraction) and join them in its order. */
static inline __attribute__((always_inline)) void
center_vote_join(const double *p, const double *q, uint64_t *v, uint64_t *n)
{
    double ep = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    double ec = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
    *v += tqkv_center_vote(ep, ec);
    *n += ep > 0;
}

__attribute__((target("avx512f"))) static void
center_votes_avx512(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                    uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * xs;
        __m512d p = _mm512_setzero_pd(), q = _mm512_setzero_pd();
        double pl[8], ql[8];
        uint32_t c = 0;
        for (; c + 8 <= D; c += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(xr + c));
            __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            __m512d a = _mm512_cvtps_pd(f), m = _mm512_cvtps_pd(_mm256_loadu_ps(mu + c));
            __m512d d = _mm512_sub_pd(a, m);
            p = _mm512_add_pd(p, _mm512_mul_pd(a, a));
            q = _mm512_add_pd(q, _mm512_mul_pd(d, d));
        }
        _mm512_storeu_pd(pl, p);
        _mm512_storeu_pd(ql, q);
        for (uint32_t j = 0; c + j < D; j++) {
            double a = (double)tqkv_bf16_to_f32(xr[c + j]), d = a - (double)mu[c + j];
            pl[j] += a * a;
            ql[j] += d * d;
        }
        center_vote_join(pl, ql, &v, &n);
    }
    *votes = v;
    *nonzero = n;
}

__attribute__((target("avx2"))) static void
center_votes_avx2(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                  uint64_t *votes, uint64_t *nonzero)
{
    uint64_t v = 0, n = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * xs;
        __m256d p0 = _mm256_setzero_pd(), p1 = _mm256_setzero_pd();
        __m256d q0 = _mm256_setzero_pd(), q1 = _mm256_setzero_pd();
        double pl[8], ql[8];
        uint32_t c = 0;
        for (; c + 8 <= D; c += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(xr + c));
            __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            __m256 mf = _mm256_loadu_ps(mu + c);
            __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
            __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
            __m256d d0 = _mm256_sub_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(mf)));
            __m256d d1 = _mm256_sub_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(mf, 1)));
            p0 = _mm256_add_pd(p0, _mm256_mul_pd(a0, a0));
            p1 = _mm256_add_pd(p1, _mm256_mul_pd(a1, a1));
            q0 = _mm256_add_pd(q0, _mm256_mul_pd(d0, d0));
            q1 = _mm256_add_pd(q1, _mm256_mul_pd(d1, d1));
        }
        _mm256_storeu_pd(pl, p0);
        _mm256_storeu_pd(pl + 4, p1);
        _mm256_storeu_pd(ql, q0);
        _mm256_storeu_pd(ql + 4, q1);
        for (uint32_t j = 0; c + j < D; j++) {
            double a = (double)tqkv_bf16_to_f32(xr[c + j]), d = a - (double)mu[c + j];
            pl[j] += a * a;
            ql[j] += d * d;
        }
        center_vote_join(pl, ql, &v, &n);
    }
    *votes = v;
    *nonzero = n;
}
static void
center_votes_plain(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
                   uint64_t *votes, uint64_t *nonzero)
{
    center_votes_body(x, xs, T, D, mu, votes, nonzero);
}

static int accum_isa; /* 2 avx512f, 1 avx2, 0 plain */
static pthread_once_t accum_once = PTHREAD_ONCE_INIT;

static void
accum_init(void)
{
    const tqkv_cpu_t *c = tqkv_cpu_usable();
    accum_isa = c->avx512f ? 2 : c->avx2 ? 1 : 0;
}

static void
energy_accum(double *acc, const uint16_t *x, const float *mean, uint64_t n)
{
    pthread_once(&accum_once, accum_init);
    if (accum_isa == 2)
        energy_accum_avx512(acc, x, mean, n);
    else if (accum_isa == 1)
        energy_accum_avx2(acc, x, mean, n);
    else
        energy_accum_plain(acc, x, mean, n);
}

static uint16_t
sum_accum(double *acc, const uint16_t *x, uint64_t n, uint16_t maxmag)
{
    pthread_once(&accum_once, accum_init);
    if (accum_isa == 2)
        return sum_accum_avx512(acc, x, n, maxmag);
    if (accum_isa == 1)
        return sum_accum_avx2(acc, x, n, maxmag);
    return sum_accum_plain(acc, x, n, maxmag);
}

static void
center_votes(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, const float *mu,
             uint64_t *votes, uint64_t *nonzero)
{
    pthread_once(&accum_once, accum_init);
    if (accum_isa == 2)
        center_votes_avx512(x, xs, T, D, mu, votes, nonzero);
    else if (accum_isa == 1)
        center_votes_avx2(x, xs, T, D, mu, votes, nonzero);
    else
        center_votes_plain(x, xs, T, D, mu, votes, nonzero);
}

static int have_vbmi2;
static pthread_once_t vbmi2_once = PTHREAD_ONCE_INIT;

static void
vbmi2_init(void)
{
    have_vbmi2 = tqkv_cpu_usable()->avx512_vbmi2;
}

/* Rows x + t * xs (D BF16 channels, D a multiple of 32) into o + t * D as the channels
 * with mask bit set, in order, then the others: AVX-512 VBMI2 compress per 32 channels. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) static void
split_rows_vbmi2(const uint16_t *x, size_t xs, uint16_t *o, uint32_t T, uint32_t D,
                 const uint8_t *mask, uint32_t g0)
{
    uint32_t m[TQKV_PAGE_MAX_DIM / 32];
    for (uint32_t b = 0; b < D / 32; b++)
        memcpy(&m[b], mask + 4 * b, 4);
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * xs;
        uint16_t *o0 = o + (size_t)t * D, *o1 = o0 + g0;
        for (uint32_t b = 0; b < D / 32; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(xr + 32 * b));
            const uint32_t n0 = (uint32_t)__builtin_popcount(m[b]);
            _mm512_mask_storeu_epi16(o0, (__mmask32)((1ull << n0) - 1),
                                     _mm512_maskz_compress_epi16((__mmask32)m[b], v));
            _mm512_mask_storeu_epi16(o1, (__mmask32)((1ull << (32 - n0)) - 1),
                                     _mm512_maskz_compress_epi16((__mmask32)~m[b], v));
            o0 += n0;
            o1 += 32 - n0;
        }
    }
}

/* The inverse of split_rows_vbmi2 for decoded rows: b + t * D (group 0's channels, then
 * group 1's) back into channel order at out_f / out_h + t * os (either may be NULL). */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) static void
merge_rows_vbmi2(const float *bf, const uint16_t *bh, float *out_f, uint16_t *out_h, size_t os,
                 uint32_t T, uint32_t D, const uint8_t *mask, uint32_t g0)
{
    uint32_t m[TQKV_PAGE_MAX_DIM / 32];
    for (uint32_t b = 0; b < D / 32; b++)
        memcpy(&m[b], mask + 4 * b, 4);
    for (uint32_t t = 0; t < T; t++) {
        if (bf) {
            const float *p0 = bf + (size_t)t * D, *p1 = p0 + g0;
            float *w = out_f + (size_t)t * os;
            for (uint32_t b = 0; b < D / 16; b++) {
                const uint32_t mb = (m[b / 2] >> (16 * (b & 1))) & 0xffffu;
                const uint32_t n0 = (uint32_t)__builtin_popcount(mb);
                __m512 v0 = _mm512_maskz_loadu_ps((__mmask16)((1u << n0) - 1), p0);
                __m512 v1 = _mm512_maskz_loadu_ps((__mmask16)((1u << (16 - n0)) - 1), p1);
                _mm512_storeu_ps(w + 16 * b,
                                 _mm512_mask_expand_ps(_mm512_maskz_expand_ps((__mmask16)mb, v0),
                                                       (__mmask16)~mb, v1));
                p0 += n0;
                p1 += 16 - n0;
            }
        }
        if (bh) {
            const uint16_t *p0 = bh + (size_t)t * D, *p1 = p0 + g0;
            uint16_t *w = out_h + (size_t)t * os;
            for (uint32_t b = 0; b < D / 32; b++) {
                const uint32_t n0 = (uint32_t)__builtin_popcount(m[b]);
                __m512i v0 = _mm512_maskz_loadu_epi16((__mmask32)((1ull << n0) - 1), p0);
                __m512i v1 = _mm512_maskz_loadu_epi16((__mmask32)((1ull << (32 - n0)) - 1), p1);
                _mm512_storeu_si512(
                    (void *)(w + 32 * b),
                    _mm512_mask_expand_epi16(_mm512_maskz_expand_epi16((__mmask32)m[b], v0),
                                             (__mmask32)~m[b], v1));
                p0 += n0;
                p1 += 32 - n0;
            }
        }
    }
}

/* The centering decision of one head (rows x + t * xs): zeroes its mean row mh unless
 * centering lowers the tokens' mean relative energy (tq_math.h tqkv_center_keep). */
static void
center_decide(const uint16_t *x, uint64_t xs, uint32_t T, uint32_t D, float *mh, int fast)
{
    uint64_t votes, nonzero;
    (fast ? center_votes : center_votes_plain)(x, xs, T, D, mh, &votes, &nonzero);
    if (!tqkv_center_keep(votes, nonzero))
        memset(mh, 0, sizeof(float) * D);
}

static tqkv_status_t
encode_tensor(const tqkv_page_header_t *h, uint32_t t, const uint16_t *x, uint8_t *page, int fast,
              char *err, size_t errlen)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t T = h->num_tokens, H = h->num_kv_heads, D = h->head_dim;
    const uint64_t n = (uint64_t)T * H, HD = (uint64_t)H * D;
    const uint32_t ngroups = td->lo_bits ? 2 : 1, mrow = (D + 7) / 8;
    const int centered = t == TQKV_TENSOR_K && (h->flags & TQKV_PAGE_KEY_CENTERED);
    group_ctx_t G[2];
    float *mean = centered ? (float *)(page + h->mean_offset) : NULL;
    double *acc = NULL, *gx = NULL;
    float *work = NULL, *mug = NULL;
    uint16_t *xg = NULL;
    uint32_t *chan[2] = {NULL, NULL}, gdim[2];
    tqkv_status_t st = TQKV_OK;
    uint64_t where;
    int ng_init = 0;

    if (find_nonfinite(x, n * D, &where)) {
        seterr(err, errlen,
               "%s: non-finite value (NaN or Inf) at token %llu, head %llu, channel %llu", tname[t],
               (unsigned long long)(where / HD), (unsigned long long)(where / D % H),
               (unsigned long long)(where % D));
        return TQKV_ERANGE;
    }
    if (td->mode == TQKV_MODE_RAW) { /* lossless: the input as it came */
        memcpy(page + td->group_offset[0], x, 2 * n * D);
        return TQKV_OK;
    }
    gdim[0] = td->n_hi;
    gdim[1] = D - td->n_hi;
    pthread_once(&vbmi2_once, vbmi2_init);
    for (uint32_t gi = 0; gi < ngroups; gi++) {
        uint32_t bits = gi == 0 ? td->hi_bits : td->lo_bits;
        if ((st = group_ctx_init(&G[gi], gdim[gi], bits, td->mode, n, h->rotation, h->seed, t, gi,
                                 1)) != TQKV_OK)
            goto out;
        ng_init++;
        G[gi].norm_corrected = (td->flags & TQKV_TENSOR_NORM_CORRECTED) != 0;
        /* the stored codebook: z, unused slots zero */
        if (G[gi].cb)
            memcpy(page + td->group_offset[gi], G[gi].cb->z, 4 * G[gi].L.n_centroids);
    }
    acc = malloc(sizeof(double) * HD);
    gx = malloc(sizeof(double) * D);
    work = malloc(sizeof(float) * 3 * D);
    chan[0] = malloc(sizeof(uint32_t) * D);
    chan[1] = malloc(sizeof(uint32_t) * D);
    xg = malloc(sizeof(uint16_t) * (size_t)T * D);
    mug = malloc(sizeof(float) * D);
    if (!acc || !gx || !work || !chan[0] || !chan[1] || !xg || !mug) {
        st = TQKV_ENOMEM;
        goto out;
    }
    if (centered) {
        /* mu = (float)(sum_t x / T), f64 sums in token order; a head with some
         * |x - mu| > 2^126 keeps mu = 0 (centered values stay within f32). Then the head
         * keeps mu only where centering lowers its tokens' mean relative energy
         * (tq_math.h tqkv_center_keep), else its mean row is zeros: stored uncentered.
         * Head by head, so the decision reads the head's rows while they are in cache. */
        uint16_t maxmag = 0; /* |x| <= 2^125 everywhere => |x - mu| <= 2^126 */
        uint8_t *late = calloc(H, 1);
        if (!late) {
            st = TQKV_ENOMEM;
            goto out;
        }
        memset(acc, 0, sizeof(double) * HD);
        for (uint32_t hh = 0; hh < H; hh++) {
            uint16_t mh = 0;
            for (uint32_t tt = 0; tt < T; tt++)
                mh = sum_accum(acc + (uint64_t)hh * D, x + tt * HD + (uint64_t)hh * D, D, mh);
            for (uint64_t k = (uint64_t)hh * D; k < (uint64_t)(hh + 1) * D; k++)
                mean[k] = (float)(acc[k] / T);
            if (mh > 0x7e00u) /* 2^125: decided after the deviation check below */
                late[hh] = 1;
            else
                center_decide(x + (uint64_t)hh * D, HD, T, D, mean + (uint64_t)hh * D, fast);
            maxmag = mh > maxmag ? mh : maxmag;
        }
        if (maxmag > 0x7e00u) {
            memset(acc, 0, sizeof(double) * HD);
            for (uint32_t tt = 0; tt < T; tt++)
                for (uint64_t k = 0; k < HD; k++) {
                    double dv = fabs((double)tqkv_bf16_to_f32(x[tt * HD + k]) - mean[k]);
                    acc[k] = dv > acc[k] ? dv : acc[k];
                }
            for (uint32_t hh = 0; hh < H; hh++) {
                int big = 0;
                if (!late[hh])
                    continue;
                for (uint32_t c = 0; c < D; c++)
                    big |= acc[(uint64_t)hh * D + c] > 0x1p126;
                if (big)
                    memset(mean + (uint64_t)hh * D, 0, sizeof(float) * D);
                center_decide(x + (uint64_t)hh * D, HD, T, D, mean + (uint64_t)hh * D, fast);
            }
        }
        free(late);
    }
    if (ngroups == 2) {
        /* energy sum_t (x - mu)^2 per (head, channel), f64 in token order */
        memset(acc, 0, sizeof(double) * HD);
        for (uint32_t tt = 0; tt < T; tt++)
            energy_accum(acc, x + tt * HD, mean, HD);
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const float *mu = mean ? mean + (uint64_t)hh * D : NULL;
        if (ngroups == 1) {
            /* the head's rows in place: stride H*D */
            encode_group_head(&G[0], page + td->group_offset[0], x + (uint64_t)hh * D, HD, mu, T,
                              hh, H, fast, gx, work);
            continue;
        }
        {
            /* two groups: the head's rows permuted into [T][D] rows of group 0's channels
             * then group 1's (perm[c]: position of channel c), one pass per token */
            uint8_t *mask = page + td->mask_offset + (uint64_t)hh * mrow;
            uint32_t *perm = chan[0], n0 = 0, n1 = gdim[0];
            select_outliers(acc + (uint64_t)hh * D, D, td->n_hi, mask, gx);
            for (uint32_t c = 0; c < D; c++)
                perm[c] = ((mask[c >> 3] >> (c & 7u)) & 1u) ? n0++ : n1++;
            if (fast && have_vbmi2 && D % 32 == 0)
                split_rows_vbmi2(x + (uint64_t)hh * D, HD, xg, T, D, mask, gdim[0]);
            else
                for (uint32_t tt = 0; tt < T; tt++) {
                    const uint16_t *xr = x + tt * HD + (uint64_t)hh * D;
                    uint16_t *o = xg + (size_t)tt * D;
                    for (uint32_t c = 0; c < D; c++)
                        o[perm[c]] = xr[c];
                }
            if (mu)
                for (uint32_t c = 0; c < D; c++)
                    mug[perm[c]] = mu[c];
            for (uint32_t gi = 0; gi < 2; gi++) {
                const uint32_t off = gi ? gdim[0] : 0;
                encode_group_head(&G[gi], page + td->group_offset[gi], xg + off, D,
                                  mu ? mug + off : NULL, T, hh, H, fast, gx, work);
            }
        }
    }
out:
    for (int gi = 0; gi < ng_init; gi++)
        group_ctx_fini(&G[gi]);
    free(acc);
    free(gx);
    free(work);
    free(chan[0]);
    free(chan[1]);
    free(xg);
    free(mug);
    return st;
}

static tqkv_status_t
encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, const uint16_t *k_bf16,
       const uint16_t *v_bf16, void *page, size_t cap, size_t *written, char *err, size_t errlen,
       int fast)
{
    tqkv_page_header_t h;
    tqkv_status_t st;
    const uint16_t *src[2] = {k_bf16, v_bf16};
    uint8_t *p = page;

    if ((st = plan(shape, codec, &h, err, errlen)) != TQKV_OK)
        return st;
    if (cap < h.page_bytes || !page) {
        seterr(err, errlen, "page needs %u bytes, buffer has %zu", h.page_bytes, cap);
        return TQKV_ENOSPC;
    }
    for (uint32_t t = 0; t < 2; t++)
        if (h.tensor[t].bits_x2 && !src[t]) {
            seterr(err, errlen, "%s: input missing", tname[t]);
            return TQKV_EINVAL;
        }
    memset(p, 0, h.page_bytes);
    memcpy(p, &h, sizeof h);
    for (uint32_t t = 0; t < 2; t++)
        if (h.tensor[t].bits_x2 &&
            (st = encode_tensor(&h, t, src[t], p, fast, err, errlen)) != TQKV_OK)
            return st;
    h.crc32c = tqkv_page_crc(p, h.page_bytes);
    memcpy(p + 12, &h.crc32c, 4);
    if (written)
        *written = h.page_bytes;
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_encode_ref(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                     const uint16_t *k_bf16, const uint16_t *v_bf16, void *page, size_t cap,
                     size_t *written, char *err, size_t errlen)
{
    return encode(shape, codec, k_bf16, v_bf16, page, cap, written, err, errlen, 0);
}

tqkv_status_t
tqkv_page_encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                 const uint16_t *k_bf16, const uint16_t *v_bf16, void *page, size_t cap,
                 size_t *written, char *err, size_t errlen)
{
    return encode(shape, codec, k_bf16, v_bf16, page, cap, written, err, errlen, 1);
}

/* ---- validate ---- */

static tqkv_status_t
validate_group(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, uint32_t gi, char *err,
               size_t errlen)
{
    tqkv_group_view_t gv;
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    float z[16];
    if (tqkv_page_group_view(page, t, gi, &gv) != 0)
        return TQKV_EINTERNAL;
    memcpy(z, gv.codebook, sizeof z);
    for (uint32_t k = 0; k < 16; k++) {
        if (k >= gv.L.n_centroids) {
            if (z[k] != 0.0f || signbit(z[k])) {
                seterr(err, errlen, "%s group %u: unused codebook slot %u not zero", tname[t], gi,
                       k);
                return TQKV_ECORRUPT;
            }
        } else if (!isfinite(z[k]) || (k > 0 && !(z[k] > z[k - 1]))) {
            seterr(err, errlen, "%s group %u: codebook not finite and ascending at %u", tname[t],
                   gi, k);
            return TQKV_ECORRUPT;
        }
    }
    /* A scale or gamma (BF16) is good when its widened value is finite and not below
     * zero: as bits, under 0x7f80 (+0 .. +max finite) or exactly 0x8000 (-0). One
     * branch-free pass (it vectorizes; attention validates every page it reads), then a
     * second pass only to name the first bad vector. */
    uint32_t bad = 0;
    for (int arr = 0; arr < (gv.gamma ? 2 : 1); arr++) {
        const uint16_t *a = arr ? gv.gamma : gv.scale;
        for (uint64_t i = 0; i < n; i++) {
            uint32_t u = a[i];
            bad |= (uint32_t)(u >= 0x7f80u) & (uint32_t)(u != 0x8000u);
        }
    }
    if (!bad)
        return TQKV_OK;
    for (uint64_t i = 0; i < n; i++) {
        /* the same bit test as above (a float test could disagree under DAZ) */
        uint32_t us = gv.scale[i], ug = gv.gamma ? gv.gamma[i] : 0;
        if ((us >= 0x7f80u && us != 0x8000u) || (ug >= 0x7f80u && ug != 0x8000u)) {
            seterr(err, errlen, "%s group %u: vector %llu has a bad scale or gamma", tname[t], gi,
                   (unsigned long long)i);
            return TQKV_ECORRUPT;
        }
    }
    return TQKV_EINTERNAL; /* the two passes disagree */
}

/* A raw (lossless) tensor holds finite BF16 values only, as the encoder admits: NaN and Inf
 * (exponent bits all set) are refused, so every decode of a valid page is finite. */
static tqkv_status_t
validate_raw(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, char *err, size_t errlen)
{
    const uint16_t *x = tqkv_page_raw(page, t);
    const uint64_t count = (uint64_t)h->num_tokens * h->num_kv_heads * h->head_dim;
    uint64_t where;
    if (!x)
        return TQKV_EINTERNAL;
    if (!find_nonfinite(x, count, &where))
        return TQKV_OK;
    seterr(err, errlen, "%s: lossless value %llu (token %llu) is NaN or Inf", tname[t],
           (unsigned long long)where,
           (unsigned long long)(where / ((uint64_t)h->num_kv_heads * h->head_dim)));
    return TQKV_ECORRUPT;
}

tqkv_status_t
tqkv_page_validate(const void *page, size_t len, int check_crc, tqkv_page_info_t *info, char *err,
                   size_t errlen)
{
    tqkv_page_header_t h, want;
    tqkv_block_shape_t shape;
    tqkv_block_codec_t codec;
    tqkv_status_t st;
    const uint8_t *p = page;
    tqkv_page_tensor_desc_t *d;

    if (!page || len < TQKV_PAGE_HEADER_BYTES) {
        seterr(err, errlen, "short buffer: %zu bytes, a page header is %u", len,
               TQKV_PAGE_HEADER_BYTES);
        return TQKV_EFORMAT;
    }
    memcpy(&h, page, sizeof h);
    if (h.magic != TQKV_PAGE_MAGIC) {
        seterr(err, errlen, "bad magic 0x%08x (not a tqkv page)", h.magic);
        return TQKV_EFORMAT;
    }
    if (h.version != TQKV_PAGE_VERSION) {
        seterr(err, errlen, "unknown page format version %u (this build reads %u)", h.version,
               TQKV_PAGE_VERSION);
        return TQKV_EFORMAT;
    }
    if (h.header_bytes != TQKV_PAGE_HEADER_BYTES) {
        seterr(err, errlen, "header_bytes %u != %u", h.header_bytes, TQKV_PAGE_HEADER_BYTES);
        return TQKV_EFORMAT;
    }
    if (h.page_bytes % TQKV_PAGE_ALIGN || h.page_bytes < TQKV_PAGE_HEADER_BYTES) {
        seterr(err, errlen, "page_bytes %u is not a multiple of %u", h.page_bytes, TQKV_PAGE_ALIGN);
        return TQKV_EFORMAT;
    }
    if (h.page_bytes > len) {
        seterr(err, errlen, "truncated page: page_bytes %u > %zu bytes available", h.page_bytes,
               len);
        return TQKV_EFORMAT;
    }
    if (h.flags & ~TQKV_PAGE_KEY_CENTERED || h.reserved0 || h.reserved1[0] || h.reserved1[1]) {
        seterr(err, errlen, "unknown page flags 0x%02x or reserved bytes set", h.flags);
        return TQKV_EFORMAT;
    }
    shape.num_tokens = h.num_tokens;
    shape.num_kv_heads = h.num_kv_heads;
    shape.head_dim = h.head_dim;
    memset(&codec, 0, sizeof codec);
    codec.rotation = h.rotation;
    codec.key_centering = (h.flags & TQKV_PAGE_KEY_CENTERED) != 0;
    codec.seed = h.seed;
    for (int t = 0; t < 2; t++) {
        tqkv_tensor_codec_t *tc = t == 0 ? &codec.k : &codec.v;
        d = &h.tensor[t];
        tc->bits_x2 = d->bits_x2;
        tc->mode = d->mode;
        tc->norm_correction = (d->flags & TQKV_TENSOR_NORM_CORRECTED) != 0;
        if (d->flags & ~TQKV_TENSOR_NORM_CORRECTED) {
            seterr(err, errlen, "%s: unknown tensor flags 0x%02x", tname[t], d->flags);
            return TQKV_EFORMAT;
        }
    }
    if (codec.key_centering && !codec.k.bits_x2) {
        seterr(err, errlen, "key-centered flag without K");
        return TQKV_EFORMAT;
    }
    if (codec.key_centering && codec.k.mode == TQKV_MODE_RAW) {
        seterr(err, errlen, "key-centered flag with a lossless (raw BF16) K");
        return TQKV_EFORMAT;
    }
    if ((st = plan(&shape, &codec, &want, err, errlen)) != TQKV_OK)
        return TQKV_EFORMAT;
    want.crc32c = h.crc32c;
    if (memcmp(&want, &h, sizeof h) != 0) {
        if (want.page_bytes != h.page_bytes)
            seterr(err, errlen, "page_bytes %u does not match the layout of its parameters (%u)",
                   h.page_bytes, want.page_bytes);
        else
            seterr(err, errlen,
                   "section offsets, sizes or bit split do not match the layout "
                   "of the page's parameters");
        return TQKV_EFORMAT;
    }
    if (check_crc) {
        uint32_t crc = tqkv_page_crc(page, h.page_bytes);
        if (crc != h.crc32c) {
            seterr(err, errlen, "CRC32C mismatch: stored 0x%08x, computed 0x%08x", h.crc32c, crc);
            return TQKV_ECORRUPT;
        }
    }
    /* contents a decoder relies on */
    if (h.flags & TQKV_PAGE_KEY_CENTERED) {
        const uint8_t *m = p + h.mean_offset;
        for (uint64_t i = 0; i < (uint64_t)h.num_kv_heads * h.head_dim; i++) {
            float f;
            memcpy(&f, m + 4 * i, 4);
            if (!isfinite(f)) {
                seterr(err, errlen, "key mean %llu is not finite", (unsigned long long)i);
                return TQKV_ECORRUPT;
            }
        }
    }
    for (uint32_t t = 0; t < 2; t++) {
        d = &h.tensor[t];
        if (!d->bits_x2)
            continue;
        if (d->mode == TQKV_MODE_RAW) {
            if ((st = validate_raw(p, &h, t, err, errlen)) != TQKV_OK)
                return st;
            continue;
        }
        if (d->lo_bits) {
            const uint32_t mrow = (h.head_dim + 7) / 8;
            for (uint32_t hh = 0; hh < h.num_kv_heads; hh++) {
                const uint8_t *m = p + d->mask_offset + (uint64_t)hh * mrow;
                uint32_t pc = 0;
                for (uint32_t b = 0; b < mrow; b++)
                    pc += (uint32_t)__builtin_popcount(m[b]);
                if (pc != d->n_hi || (h.head_dim % 8 && (m[mrow - 1] >> (h.head_dim % 8)))) {
                    seterr(err, errlen, "%s: outlier mask of head %u has %u channels, want %u",
                           tname[t], hh, pc, d->n_hi);
                    return TQKV_ECORRUPT;
                }
            }
        }
        for (uint32_t gi = 0; gi < (d->lo_bits ? 2u : 1u); gi++)
            if ((st = validate_group(p, &h, t, gi, err, errlen)) != TQKV_OK)
                return st;
    }
    if (info) {
        const tqkv_page_header_t *hp = page;
        uint64_t per = 2ull * h.num_tokens * h.num_kv_heads * h.head_dim;
        info->hdr = hp;
        info->shape = shape;
        info->codec = codec;
        info->page_bytes = h.page_bytes;
        info->bf16_bytes = per * ((codec.k.bits_x2 != 0) + (codec.v.bits_x2 != 0));
    }
    return TQKV_OK;
}

/* ---- decode ---- */

/* A group the SIMD decoder handles: mse, Hadamard or dense, g a multiple of 16. */
static int
simd_group(const group_ctx_t *G)
{
    return G->L.mode == TQKV_MODE_MSE && G->rot && G->L.dim % 16 == 0 &&
           (G->rot->kind == TQKV_ROT_DENSE ? kernels()->dec_dense != NULL
                                           : kernels()->dec_had != NULL);
}

/* Decodes rows of a simd_group. */
static void
dec_rows(const group_ctx_t *G, const tqkv__dec_rows_t *A)
{
    if (G->rot->kind == TQKV_ROT_DENSE)
        kernels()->dec_dense(A, G->rot->matrix);
    else
        kernels()->dec_had(A);
}

/* f32 -> BF16, nearest even, saturating at +-max finite; f finite. */
static inline uint16_t
bf16_sat_finite(float f)
{
    uint32_t u;
    uint16_t h;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    h = (uint16_t)(u >> 16);
    return (h & 0x7fffu) == 0x7f80u ? (uint16_t)((h & 0x8000u) | 0x7f7fu) : h;
}

/* Fast decode of centered and/or two-group tensors, per head: each group decoded (SIMD,
 * adding its channels' key means, clamping and rounding; or the reference for
 * prod/dense groups) into [T][D] rows holding group 0's channels then group 1's
 * (perm[c]: position of channel c), then the rows gathered back into channel order. */
static tqkv_status_t
decode_tensor_fast(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t,
                   const group_ctx_t *G, const tqkv_group_view_t *gv, float *out_f, uint16_t *out_h)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t T = h->num_tokens, H = h->num_kv_heads, D = h->head_dim;
    const uint32_t ngroups = td->lo_bits ? 2 : 1;
    const int centered = t == TQKV_TENSOR_K && (h->flags & TQKV_PAGE_KEY_CENTERED);
    float *bf = out_f ? malloc(sizeof(float) * PROD_BLOCK * D) : NULL;
    uint16_t *bh = out_h ? malloc(sizeof(uint16_t) * PROD_BLOCK * D) : NULL;
    float *work = malloc(sizeof(float) * 2 * D), *mug = malloc(sizeof(float) * D);
    double *o = malloc(sizeof(double) * D);
    uint32_t *perm = malloc(sizeof(uint32_t) * D);
    float *qs = malloc(sizeof(float) * 4 * PROD_BLOCK * D), *qa = qs ? qs + PROD_BLOCK * D : NULL;
    float *zr = qs ? qs + 2 * PROD_BLOCK * D : NULL, *za = qs ? qs + 3 * PROD_BLOCK * D : NULL;
    tqkv_status_t st = TQKV_OK;
    pthread_once(&vbmi2_once, vbmi2_init);
    if ((out_f && !bf) || (out_h && !bh) || !work || !mug || !o || !perm || !qs) {
        st = TQKV_ENOMEM;
        goto out;
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const uint8_t *mask = tqkv_page_mask(page, t, hh);
        const float *mu = centered ? tqkv_page_key_mean(page, hh) : NULL;
        uint32_t m0 = 0, m1 = gv[0].L.dim;
        for (uint32_t c = 0; c < D; c++)
            perm[c] = (!mask || ((mask[c >> 3] >> (c & 7u)) & 1u)) ? m0++ : m1++;
        if (mu)
            for (uint32_t c = 0; c < D; c++)
                mug[perm[c]] = mu[c];
        /* blocks of PROD_BLOCK tokens: the permuted rows stay in L1 */
        for (uint32_t t0 = 0; t0 < T; t0 += PROD_BLOCK) {
            const uint32_t nb = T - t0 < PROD_BLOCK ? T - t0 : PROD_BLOCK;
            const size_t ob =
                ((size_t)t0 * H + hh) * D; /* output offset of the block's first row */
            for (uint32_t gi = 0; gi < ngroups; gi++) {
                const tqkv_group_view_t *v = &gv[gi];
                const uint32_t g = v->L.dim, off = gi ? gv[0].L.dim : 0;
                if (simd_group(&G[gi])) {
                    tqkv__dec_rows_t A = {.idx =
                                              v->idx + ((size_t)t0 * H + hh) * v->L.idx_row_bytes,
                                          .idx_stride = (size_t)H * v->L.idx_row_bytes,
                                          .scale = v->scale + (size_t)t0 * H + hh,
                                          .scale_stride = H,
                                          .n = nb,
                                          .g = g,
                                          .bits = v->L.mse_bits,
                                          .signs = G[gi].rot->signs,
                                          .z = v->codebook,
                                          .mu = mu ? mug + off : NULL,
                                          .out_f = bf ? bf + off : NULL,
                                          .out_h = bh ? bh + off : NULL,
                                          .out_stride = D};
                    dec_rows(&G[gi], &A);
                    continue;
                }
                const int qb = v->signs && G[gi].qjl && g % 16 == 0 && kernels()->rows_mm;
                const int mb =
                    qb && v->L.mse_bits && G[gi].rot && G[gi].rot->kind == TQKV_ROT_DENSE;
                for (uint32_t tt = t0; tt < t0 + nb; tt++) {
                    uint64_t i = (uint64_t)tt * H + hh;
                    float sc = tqkv_scale_get(v->scale, i);
                    float gm = v->gamma ? tqkv_scale_get(v->gamma, i) : 0.0f;
                    if (qb && tt % PROD_BLOCK == 0) {
                        /* the QJL products S^T sign of the next block of vectors at once */
                        for (uint32_t r = 0; r < nb; r++) {
                            const uint8_t *sr =
                                v->signs + ((uint64_t)(tt + r) * H + hh) * v->L.sign_row_bytes;
                            for (uint32_t j = 0; j < g; j++)
                                qs[(size_t)r * g + j] =
                                    ((sr[j >> 3] >> (j & 7u)) & 1u) ? 1.0f : -1.0f;
                        }
                        kernels()->rows_mm(G[gi].qjl->matrix, g, qs, qa, nb);
                        if (mb) { /* and the dense Pi^T z[idx] */
                            for (uint32_t r = 0; r < nb; r++) {
                                const uint8_t *ir =
                                    v->idx + ((uint64_t)(tt + r) * H + hh) * v->L.idx_row_bytes;
                                for (uint32_t j = 0; j < g; j++)
                                    zr[(size_t)r * g + j] =
                                        v->codebook[tqkv_bits_get(ir, j, v->L.mse_bits)];
                            }
                            kernels()->rows_mm(G[gi].rot->matrix, g, zr, za, nb);
                        }
                    }
                    if (qb)
                        decode_vec_prod(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                                        mb ? za + (size_t)(tt % PROD_BLOCK) * g : NULL,
                                        qa + (size_t)(tt % PROD_BLOCK) * g, work, o);
                    else
                        decode_vec_ref(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                                       v->signs ? v->signs + i * v->L.sign_row_bytes : NULL, work,
                                       o);
                    for (uint32_t j = 0; j < g; j++) {
                        float f = tqkv_clamp_flt(o[j]);
                        if (mu) {
                            f += mug[off + j];
                            f = f > FLT_MAX ? FLT_MAX : (f < -FLT_MAX ? -FLT_MAX : f);
                        }
                        if (bf)
                            bf[(size_t)(tt - t0) * D + off + j] = f;
                        if (bh)
                            bh[(size_t)(tt - t0) * D + off + j] = bf16_sat_finite(f);
                    }
                }
            }
            if (mask && have_vbmi2 && D % 32 == 0) {
                merge_rows_vbmi2(bf, bh, out_f ? out_f + ob : NULL, out_h ? out_h + ob : NULL,
                                 (size_t)H * D, nb, D, mask, gv[0].L.dim);
                continue;
            }
            for (uint32_t tt = t0; tt < t0 + nb; tt++) {
                uint64_t i = (uint64_t)tt * H + hh;
                if (bf) {
                    const float *r = bf + (size_t)(tt - t0) * D;
                    float *w = out_f + i * D;
                    for (uint32_t c = 0; c < D; c++)
                        w[c] = r[perm[c]];
                }
                if (bh) {
                    const uint16_t *r = bh + (size_t)(tt - t0) * D;
                    uint16_t *w = out_h + i * D;
                    for (uint32_t c = 0; c < D; c++)
                        w[c] = r[perm[c]];
                }
            }
        }
    }
out:
    free(bf);
    free(bh);
    free(work);
    free(mug);
    free(o);
    free(perm);
    free(qs);
    return st;
}

static tqkv_status_t
decode_tensor(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, float *out_f,
              uint16_t *out_h, int fast)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t H = h->num_kv_heads, D = h->head_dim;
    const uint64_t n = (uint64_t)h->num_tokens * H;
    const uint32_t ngroups = td->lo_bits ? 2 : 1;
    const float *mean = t == TQKV_TENSOR_K ? tqkv_page_key_mean(page, 0) : NULL;
    group_ctx_t G[2];
    tqkv_group_view_t gv[2];
    uint32_t *chan[2] = {NULL, NULL};
    float *work = NULL;
    double *o = NULL, *row = NULL;
    tqkv_status_t st = TQKV_OK;
    int ng_init = 0;

    for (uint32_t gi = 0; gi < ngroups; gi++) {
        if (tqkv_page_group_view(page, t, gi, &gv[gi]) != 0) {
            st = TQKV_EINTERNAL;
            goto out;
        }
        if ((st = group_ctx_init(&G[gi], gv[gi].L.dim, gv[gi].L.bits, gv[gi].L.mode, n, h->rotation,
                                 h->seed, t, gi, 0)) != TQKV_OK)
            goto out;
        ng_init++;
        G[gi].z = gv[gi].codebook;
    }
    if (fast && ngroups == 1 && !mean && simd_group(&G[0])) {
        /* the common case: rows straight into the output */
        tqkv__dec_rows_t A = {.idx = gv[0].idx,
                              .idx_stride = gv[0].L.idx_row_bytes,
                              .scale = gv[0].scale,
                              .scale_stride = 1,
                              .n = n,
                              .g = D,
                              .bits = gv[0].L.mse_bits,
                              .signs = G[0].rot->signs,
                              .z = gv[0].codebook,
                              .out_f = out_f,
                              .out_h = out_h,
                              .out_stride = D};
        dec_rows(&G[0], &A);
        goto out;
    }
    if (fast && ngroups == 1 && simd_group(&G[0])) {
        /* centered keys, one group: per head (adding its mean), rows strided by H */
        for (uint32_t hh = 0; hh < H; hh++) {
            tqkv__dec_rows_t A = {.idx = gv[0].idx + (size_t)hh * gv[0].L.idx_row_bytes,
                                  .idx_stride = (size_t)H * gv[0].L.idx_row_bytes,
                                  .scale = gv[0].scale + hh,
                                  .scale_stride = H,
                                  .n = h->num_tokens,
                                  .g = D,
                                  .bits = gv[0].L.mse_bits,
                                  .signs = G[0].rot->signs,
                                  .z = gv[0].codebook,
                                  .mu = tqkv_page_key_mean(page, hh),
                                  .out_f = out_f ? out_f + (size_t)hh * D : NULL,
                                  .out_h = out_h ? out_h + (size_t)hh * D : NULL,
                                  .out_stride = (size_t)H * D};
            dec_rows(&G[0], &A);
        }
        goto out;
    }
    if (fast) {
        st = decode_tensor_fast(page, h, t, G, gv, out_f, out_h);
        goto out;
    }
    chan[0] = malloc(sizeof(uint32_t) * D);
    chan[1] = malloc(sizeof(uint32_t) * D);
    work = malloc(sizeof(float) * 2 * D);
    o = malloc(sizeof(double) * D);
    row = malloc(sizeof(double) * D);
    if (!chan[0] || !chan[1] || !work || !o || !row) {
        st = TQKV_ENOMEM;
        goto out;
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        const uint8_t *mask = tqkv_page_mask(page, t, hh);
        const float *mu = mean ? tqkv_page_key_mean(page, hh) : NULL;
        uint32_t n0 = 0, n1 = 0;
        for (uint32_t c = 0; c < D; c++) {
            if (!mask || ((mask[c >> 3] >> (c & 7u)) & 1u))
                chan[0][n0++] = c;
            else
                chan[1][n1++] = c;
        }
        for (uint64_t i = hh; i < n; i += H) {
            for (uint32_t gi = 0; gi < ngroups; gi++) {
                const tqkv_group_view_t *v = &gv[gi];
                float sc = tqkv_scale_get(v->scale, i);
                float gm = v->gamma ? tqkv_scale_get(v->gamma, i) : 0.0f;
                decode_vec_ref(&G[gi], sc, gm, v->idx + i * v->L.idx_row_bytes,
                               v->signs ? v->signs + i * v->L.sign_row_bytes : NULL, work, o);
                for (uint32_t j = 0; j < v->L.dim; j++)
                    row[chan[gi][j]] = o[j];
            }
            for (uint32_t c = 0; c < D; c++) {
                float f = tqkv_clamp_flt(mu ? row[c] + mu[c] : row[c]);
                if (out_f)
                    out_f[i * D + c] = f;
                if (out_h)
                    out_h[i * D + c] = tqkv_f32_to_bf16_sat(f);
            }
        }
    }
out:
    for (int gi = 0; gi < ng_init; gi++)
        group_ctx_fini(&G[gi]);
    free(chan[0]);
    free(chan[1]);
    free(work);
    free(o);
    free(row);
    return st;
}

/* A raw (lossless) tensor: BF16 out byte for byte, f32 out widened (exact). */
static void
decode_raw(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, float *out_f,
           uint16_t *out_h)
{
    const uint16_t *x = tqkv_page_raw(page, t);
    const uint64_t count = (uint64_t)h->num_tokens * h->num_kv_heads * h->head_dim;
    if (out_h)
        memcpy(out_h, x, 2 * count);
    if (out_f)
        for (uint64_t i = 0; i < count; i++)
            out_f[i] = tqkv_bf16_to_f32(x[i]);
}

static tqkv_status_t
decode(const void *page, size_t len, float *kf, float *vf, uint16_t *kh, uint16_t *vh, int fast)
{
    tqkv_page_info_t info;
    tqkv_status_t st;
    float *of[2] = {kf, vf};
    uint16_t *oh[2] = {kh, vh};
    if ((st = tqkv_page_validate(page, len, 0, &info, NULL, 0)) != TQKV_OK)
        return st;
    for (uint32_t t = 0; t < 2; t++) {
        if (!info.hdr->tensor[t].bits_x2 || (!of[t] && !oh[t]))
            continue;
        if (info.hdr->tensor[t].mode == TQKV_MODE_RAW) {
            decode_raw(page, info.hdr, t, of[t], oh[t]);
            continue;
        }
        if ((st = decode_tensor(page, info.hdr, t, of[t], oh[t], fast)) != TQKV_OK)
            return st;
    }
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_decode_f32_ref(const void *page, size_t len, float *k, float *v)
{
    return decode(page, len, k, v, NULL, NULL, 0);
}

tqkv_status_t
tqkv_page_decode_f32(const void *page, size_t len, float *k, float *v)
{
    return decode(page, len, k, v, NULL, NULL, 1);
}

tqkv_status_t
tqkv_page_decode_bf16(const void *page, size_t len, uint16_t *k, uint16_t *v)
{
    return decode(page, len, NULL, NULL, k, v, 1);
}
