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
 * The codec is in parts: this file holds the run-time kernel table, CRC32C, the page
 * parameters and layout and the per-group transforms; page_encode.c, page_validate.c,
 * page_decode.c and page_stats.c (the key-statistics loops) the rest, sharing the
 * tqkv__ declarations of page_internal.h.
 *
 * Thread safety: every function is reentrant; codebooks and rotations come from
 * their thread-safe caches; the kernel table is set up under pthread_once.
 */
#include "kernels/page.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/cpu.h"
#include "kernels/errtext.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* ---- run-time kernel selection ---- */

static tqkv__page_kernels_t kern = {
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

const tqkv__page_kernels_t *
tqkv__page_kernels(void)
{
    pthread_once(&kern_once, kern_init);
    return &kern;
}

const char *
tqkv_kernels_isa(void)
{
    return tqkv__page_kernels()->isa;
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
    return tqkv__page_kernels()->crc(crc, buf, len);
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
    return tqkv__page_kernels()->crc_copy(crc, dst, src, len);
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

const char *const tqkv__tensor_name[2] = {"K", "V"};

static tqkv_status_t
check_tensor(const char *name, const tqkv_tensor_codec_t *tc, uint32_t d, char *err, size_t errlen)
{
    uint32_t hi, lo, nhi;
    if (tc->bits_x2 == 0)
        return TQKV_OK;
    if (tc->mode == TQKV_MODE_RAW) {
        if (tc->bits_x2 != TQKV_RAW_BITS_X2)
            return tqkv_errtext(
                TQKV_EINVAL, err, errlen,
                "%s: lossless (raw BF16) mode takes no bit width: bits_x2 must be %u, not %u", name,
                TQKV_RAW_BITS_X2, tc->bits_x2);
        if (tc->norm_correction)
            return tqkv_errtext(TQKV_EINVAL, err, errlen,
                                "%s: norm correction does not apply to lossless (raw BF16) mode",
                                name);
        return TQKV_OK;
    }
    if (tc->bits_x2 == TQKV_RAW_BITS_X2)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "%s: bits_x2 %u (16 bits) is the lossless mode: set mode raw (%u)",
                            name, TQKV_RAW_BITS_X2, TQKV_MODE_RAW);
    if (tqkv_bits_split(tc->bits_x2, d, &hi, &lo, &nhi) != 0)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen,
                            "%s: unsupported bit width %u/2 (1, 1.5, 2, 2.5, 3, 3.5, 4)", name,
                            tc->bits_x2);
    if (tc->mode != TQKV_MODE_MSE && tc->mode != TQKV_MODE_PROD)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "%s: unknown mode %u", name, tc->mode);
    if (tc->norm_correction > 1)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: norm_correction must be 0 or 1", name);
    return TQKV_OK;
}

/* Builds the header (layout, parameters, crc 0) for shape and codec, after checking. */
tqkv_status_t
tqkv__page_plan(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, tqkv_page_header_t *h,
                char *err, size_t errlen)
{
    uint64_t off = TQKV_PAGE_HEADER_BYTES, n;
    tqkv_status_t st;
    const tqkv_tensor_codec_t *tc[2] = {&c->k, &c->v};

    if (!s || !c)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "missing shape or codec");
    if (s->head_dim < TQKV_PAGE_MIN_DIM || s->head_dim > TQKV_PAGE_MAX_DIM)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "head_dim %u outside [%u, %u]",
                            s->head_dim, TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM);
    if (s->num_kv_heads < 1 || s->num_kv_heads > TQKV_PAGE_MAX_HEADS)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "num_kv_heads %u outside [1, %u]",
                            s->num_kv_heads, TQKV_PAGE_MAX_HEADS);
    if (s->num_tokens < 1 || s->num_tokens > TQKV_PAGE_MAX_TOKENS)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "num_tokens %u outside [1, %u]",
                            s->num_tokens, TQKV_PAGE_MAX_TOKENS);
    if (c->rotation != TQKV_ROT_DENSE && c->rotation != TQKV_ROT_HADAMARD)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "unknown rotation kind %u",
                            c->rotation);
    if (c->key_centering > 1)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "key_centering must be 0 or 1");
    if (c->k.bits_x2 == 0 && c->v.bits_x2 == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "both K and V absent (bits 0)");
    for (int t = 0; t < 2; t++)
        if ((st = check_tensor(tqkv__tensor_name[t], tc[t], s->head_dim, err, errlen)) != TQKV_OK)
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
    if (off > TQKV_PAGE_MAX_BYTES)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "page would be %llu bytes (> %u)",
                            (unsigned long long)off, TQKV_PAGE_MAX_BYTES);
    h->page_bytes = (uint32_t)off;
    return TQKV_OK;
}

tqkv_status_t
tqkv_page_check_params(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, char *err,
                       size_t errlen)
{
    tqkv_page_header_t h;
    return tqkv__page_plan(shape, codec, &h, err, errlen);
}

tqkv_status_t
tqkv_page_size(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, size_t *out)
{
    tqkv_page_header_t h;
    tqkv_status_t st = tqkv__page_plan(shape, codec, &h, NULL, 0);
    if (st == TQKV_OK)
        *out = h.page_bytes;
    return st;
}

/* ---- per-group transforms ---- */

void
tqkv__group_ctx_fini(tqkv__group_ctx_t *G)
{
    tqkv_rotation_release(G->rot);
    tqkv_rotation_release(G->qjl);
    G->rot = G->qjl = NULL;
}

tqkv_status_t
tqkv__group_ctx_init(tqkv__group_ctx_t *G, uint32_t g, uint32_t bits, uint32_t mode, uint64_t n,
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
        tqkv__group_ctx_fini(G);
        return st;
    }
    if (G->cb)
        G->z = G->cb->z;
    return TQKV_OK;
}

/* The tq_math.h view of a group (the per-vector code shared with the CUDA kernels). */
void
tqkv__group_codec(const tqkv__group_ctx_t *G, tqkv_group_codec_t *C)
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
void
tqkv__encode_vec_ref(const tqkv__group_ctx_t *G, const double *x, float *work, uint16_t *scale,
                     uint16_t *gamma, uint8_t *idx_row, uint8_t *sign_row)
{
    tqkv_group_codec_t C;
    tqkv__group_codec(G, &C);
    tqkv_group_encode_vec(&C, x, work, scale, gamma, idx_row, sign_row);
}

/* Reference decode of one group vector into out[g] (double, before un-centering):
 * tqkv_group_decode_vec. work: 2g floats. */
void
tqkv__decode_vec_ref(const tqkv__group_ctx_t *G, float scale, float gamma, const uint8_t *idx_row,
                     const uint8_t *sign_row, float *work, double *out)
{
    tqkv_group_codec_t C;
    tqkv__group_codec(G, &C);
    tqkv_group_decode_vec(&C, scale, gamma, idx_row, sign_row, work, out);
}

/* tqkv__decode_vec_ref of a prod vector whose QJL product aq = S^T sign was taken already (by
 * tqkv__page_kernels()->rows_mm for a block of vectors, bit for bit tqkv_matvec_t): the rest of
 * tqkv_group_decode_vec, operation for operation. am: Pi^T z[idx] taken the same way
 * (dense rotation), or NULL. work: 2g floats. */
void
tqkv__decode_vec_prod(const tqkv__group_ctx_t *G, float scale, float gamma, const uint8_t *idx_row,
                      const float *am, const float *aq, float *work, double *out)
{
    tqkv_group_codec_t C;
    const uint32_t g = G->L.dim, b = G->L.mse_bits;
    float *y = work, *a = work + g;
    double c;
    tqkv__group_codec(G, &C);
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
