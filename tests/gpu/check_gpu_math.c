/* check_gpu_math.c - CPU checks of the TQKV_HD code the CUDA kernels run (label unit).
 *
 * The CUDA encoder is a parallel arrangement of tq_math.h functions (page plan,
 * per-channel stats, outlier ranks, per-vector encode/decode, CRC register shifts).
 * Here the same functions are run on the host in the same arrangement (emu_encode,
 * emu_decode) and compared with the scalar reference codec of kernels/page.c byte for
 * byte, so the GPU math is verified without a GPU; only the launch plumbing is left to
 * the gpu-labelled tests.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/page.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/rng.h"
#include "tests/support/sanitize.h"

static uint64_t rng_state;

/* Host copy of a group codec (what tqkv__cuda_group_codec builds with device pointers). */
typedef struct host_group {
    tqkv_group_codec_t G;
    const tqkv_rotation_t *rot, *qjl;
} host_group_t;

static tqkv_status_t
host_group_init(host_group_t *hg, const tqkv_page_header_t *h, uint32_t t, uint32_t gi)
{
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    tqkv_group_codec_t *G = &hg->G;
    tqkv_status_t st;
    uint32_t bits = gi == 0 ? td->hi_bits : td->lo_bits;
    memset(hg, 0, sizeof *hg);
    G->dim = gi == 0 ? td->n_hi : h->head_dim - td->n_hi;
    G->mode = td->mode;
    G->mse_bits = td->mode == TQKV_MODE_PROD ? bits - 1 : bits;
    G->n_centroids = G->mse_bits ? 1u << G->mse_bits : 0;
    G->rotation = tqkv_group_rotation(h->rotation, G->dim);
    G->norm_corrected = (td->flags & TQKV_TENSOR_NORM_CORRECTED) != 0;
    if (G->mse_bits) {
        const tqkv_codebook_t *cb;
        if ((st = tqkv_codebook_get(G->dim, G->mse_bits, &cb)) != TQKV_OK)
            return st;
        G->z = cb->z;
        G->thr = cb->thr;
        if ((st = tqkv_rotation_acquire(G->rotation, G->dim,
                                        tqkv_seed_derive(h->seed, t, gi, TQKV_SEED_ROTATION),
                                        &hg->rot)) != TQKV_OK)
            return st;
        G->matrix = hg->rot->matrix;
        G->signs = hg->rot->signs;
    }
    if (G->mode == TQKV_MODE_PROD) {
        if ((st = tqkv_rotation_acquire(TQKV_ROT_QJL_GAUSS, G->dim,
                                        tqkv_seed_derive(h->seed, t, gi, TQKV_SEED_QJL),
                                        &hg->qjl)) != TQKV_OK)
            return st;
        G->qjl = hg->qjl->matrix;
    }
    return TQKV_OK;
}

static void
host_group_fini(host_group_t *hg)
{
    if (hg->rot)
        tqkv_rotation_release(hg->rot);
    if (hg->qjl)
        tqkv_rotation_release(hg->qjl);
}

/* CRC of a page as crc_kernel computes it: 1024 chunks (16-byte multiples), raw CRCs,
 * pairwise tree of register shifts. */
static uint32_t
emu_crc(const uint8_t *page, uint32_t bytes)
{
    enum { NT = 1024 };
    static uint32_t crc[NT], len[NT];
    uint32_t chunk = ((bytes + NT - 1) / NT + 15u) & ~15u;
    for (uint32_t tid = 0; tid < NT; tid++) {
        uint32_t lo = tid * chunk < bytes ? tid * chunk : bytes;
        uint32_t hi = lo + chunk < bytes ? lo + chunk : bytes;
        uint32_t r = 0;
        for (uint32_t p = lo; p < hi; p++)
            r = tqkv_crc32c_raw_byte(r, (p >= 12 && p < 16) ? 0 : page[p]);
        crc[tid] = r;
        len[tid] = hi - lo;
    }
    for (uint32_t s = 1; s < NT; s <<= 1)
        for (uint32_t tid = 0; tid + s < NT; tid += 2 * s)
            if (len[tid + s]) {
                crc[tid] = tqkv_crc32c_shift(crc[tid], len[tid + s]) ^ crc[tid + s];
                len[tid] += len[tid + s];
            }
    return ~(tqkv_crc32c_shift(0xffffffffu, bytes) ^ crc[0]);
}

/* The CUDA encoder's steps on the host. */
static tqkv_status_t
emu_encode(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const uint16_t *k,
           const uint16_t *v, uint8_t *page, size_t cap, size_t *written)
{
    tqkv_page_header_t h;
    uint8_t bx2[2] = {c->k.bits_x2, c->v.bits_x2}, mode[2] = {c->k.mode, c->v.mode};
    uint8_t nc[2] = {c->k.norm_correction, c->v.norm_correction};
    const uint32_t T = s->num_tokens, H = s->num_kv_heads, D = s->head_dim;
    const uint64_t n = (uint64_t)T * H;
    tqkv_status_t st = TQKV_OK;
    double *energy = malloc(sizeof(double) * D), *x = malloc(sizeof(double) * D);
    float *work = malloc(sizeof(float) * 3 * D);

    if (tqkv_page_plan(T, H, D, bx2, mode, nc, c->rotation, c->key_centering, c->seed, &h) != 0) {
        st = TQKV_EUNSUPPORTED;
        goto out;
    }
    if (cap < h.page_bytes) {
        st = TQKV_ENOSPC;
        goto out;
    }
    memset(page, 0, h.page_bytes);
    memcpy(page, &h, sizeof h);
    for (uint32_t t = 0; t < 2; t++) {
        const tqkv_page_tensor_desc_t *td = &h.tensor[t];
        const uint16_t *src = t == 0 ? k : v;
        int centered = t == 0 && (h.flags & TQKV_PAGE_KEY_CENTERED);
        float *mean = centered ? (float *)(page + h.mean_offset) : NULL;
        if (!td->bits_x2)
            continue;
        for (uint32_t hh = 0; hh < H; hh++) { /* stats_kernel */
            double md = 0;
            for (uint32_t ch = 0; ch < D && centered; ch++) {
                float mu = tqkv_channel_mean(src, T, H, D, hh, ch);
                double d = tqkv_channel_maxdev(src, T, H, D, hh, ch, mu);
                mean[hh * D + ch] = mu;
                md = d > md ? d : md;
            }
            if (md > 0x1p126)
                for (uint32_t ch = 0; ch < D; ch++)
                    mean[hh * D + ch] = 0.0f;
            if (centered) { /* the centering decision: votes of the head's tokens */
                uint64_t votes = 0, nonzero = 0;
                for (uint32_t tok = 0; tok < T; tok++) {
                    double ep, ec;
                    tqkv_token_center_energy(src + (uint64_t)tok * H * D + (uint64_t)hh * D,
                                             mean + hh * D, D, &ep, &ec);
                    votes += tqkv_center_vote(ep, ec);
                    nonzero += ep > 0;
                }
                if (!tqkv_center_keep(votes, nonzero))
                    for (uint32_t ch = 0; ch < D; ch++)
                        mean[hh * D + ch] = 0.0f;
            }
            if (!td->lo_bits)
                continue;
            for (uint32_t ch = 0; ch < D; ch++)
                energy[ch] =
                    tqkv_channel_energy(src, T, H, D, hh, ch, mean ? mean[hh * D + ch] : 0.0f);
            uint8_t *mask = page + td->mask_offset + (uint64_t)hh * ((D + 7) / 8);
            for (uint32_t ch = 0; ch < D; ch++)
                if (tqkv_energy_rank(energy, D, ch) < td->n_hi)
                    mask[ch >> 3] |= (uint8_t)(1u << (ch & 7u));
        }
        for (uint32_t gi = 0; gi < (td->lo_bits ? 2u : 1u); gi++) { /* encode_kernel */
            host_group_t hg;
            tqkv_group_layout_t L;
            uint8_t *base = page + td->group_offset[gi];
            if ((st = host_group_init(&hg, &h, t, gi)) != TQKV_OK) {
                host_group_fini(&hg);
                goto out;
            }
            tqkv_group_layout(hg.G.dim, gi == 0 ? td->hi_bits : td->lo_bits, td->mode, n, &L);
            for (uint32_t m = 0; m < hg.G.n_centroids; m++)
                ((float *)base)[m] = hg.G.z[m];
            for (uint64_t i = 0; i < n; i++) {
                uint32_t hh = (uint32_t)(i % H), j = 0;
                const uint8_t *mask =
                    td->lo_bits ? page + td->mask_offset + (uint64_t)hh * ((D + 7) / 8) : NULL;
                for (uint32_t ch = 0; ch < D; ch++) {
                    uint32_t hi = mask ? (mask[ch >> 3] >> (ch & 7u)) & 1u : 1u;
                    if (hi != (gi == 0 ? 1u : 0u))
                        continue;
                    double f = (double)tqkv_bf16_to_f32(src[i * D + ch]);
                    x[j++] = mean ? f - (double)mean[hh * D + ch] : f;
                }
                tqkv_group_encode_vec(&hg.G, x, work, (uint16_t *)(base + L.off_scale) + i,
                                      L.off_gamma ? (uint16_t *)(base + L.off_gamma) + i : NULL,
                                      base + L.off_idx + i * L.idx_row_bytes,
                                      L.off_signs ? base + L.off_signs + i * L.sign_row_bytes
                                                  : NULL);
            }
            host_group_fini(&hg);
        }
    }
    h.crc32c = emu_crc(page, h.page_bytes);
    memcpy(page + 12, &h.crc32c, 4);
    *written = h.page_bytes;
out:
    free(energy);
    free(x);
    free(work);
    return st;
}

/* decode_kernel on the host: f32 [T][H][D] of one tensor. */
static tqkv_status_t
emu_decode(const uint8_t *page, uint32_t t, float *out)
{
    const tqkv_page_header_t *h = (const tqkv_page_header_t *)page;
    const tqkv_page_tensor_desc_t *td = &h->tensor[t];
    const uint32_t H = h->num_kv_heads, D = h->head_dim;
    const uint64_t n = (uint64_t)h->num_tokens * H;
    double *val = malloc(sizeof(double) * D);
    float *work = malloc(sizeof(float) * 2 * D);
    tqkv_status_t st = TQKV_OK;
    for (uint32_t gi = 0; gi < (td->lo_bits ? 2u : 1u); gi++) {
        host_group_t hg;
        tqkv_group_view_t gv;
        if (tqkv_page_group_view(page, t, gi, &gv) != 0 ||
            (st = host_group_init(&hg, h, t, gi)) != TQKV_OK) {
            st = st ? st : TQKV_EINTERNAL;
            break;
        }
        hg.G.z = gv.codebook;
        for (uint64_t i = 0; i < n; i++) {
            uint32_t hh = (uint32_t)(i % H), j = 0;
            tqkv_group_decode_vec(&hg.G, tqkv_scale_get(gv.scale, i),
                                  gv.gamma ? tqkv_scale_get(gv.gamma, i) : 0.0f,
                                  gv.idx + i * gv.L.idx_row_bytes,
                                  gv.signs ? gv.signs + i * gv.L.sign_row_bytes : NULL, work, val);
            const uint8_t *mask = tqkv_page_mask(page, t, hh);
            const float *mu = t == 0 ? tqkv_page_key_mean(page, hh) : NULL;
            for (uint32_t ch = 0; ch < D && j < gv.L.dim; ch++) {
                uint32_t hi = mask ? (mask[ch >> 3] >> (ch & 7u)) & 1u : 1u;
                if (hi != (gi == 0 ? 1u : 0u))
                    continue;
                double f = val[j++];
                out[i * D + ch] = tqkv_clamp_flt(mu ? f + (double)mu[ch] : f);
            }
        }
        host_group_fini(&hg);
    }
    free(val);
    free(work);
    return st;
}

/* ---- tests ---- */

START_TEST(test_crc_pieces)
{
    static const char *nine = "123456789";
    uint8_t buf[3001];
    rng_state = tqkv_test_seed() ^ 0x11;
    /* bytewise raw register with inversion = the standard CRC32C check value */
    uint32_t r = 0xffffffffu;
    for (int i = 0; i < 9; i++)
        r = tqkv_crc32c_raw_byte(r, (uint8_t)nine[i]);
    ck_assert_uint_eq(~r, 0xE3069283u);
    ck_assert_uint_eq(tqkv_crc32c_ref(0, nine, 9), 0xE3069283u);
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)tqkv_test_rand(&rng_state);
    for (int trial = 0; trial < 50; trial++) {
        size_t len = 1 + tqkv_test_rand(&rng_state) % sizeof buf,
               cut = tqkv_test_rand(&rng_state) % (len + 1);
        uint32_t a = 0, b = 0;
        for (size_t i = 0; i < cut; i++)
            a = tqkv_crc32c_raw_byte(a, buf[i]);
        for (size_t i = cut; i < len; i++)
            b = tqkv_crc32c_raw_byte(b, buf[i]);
        uint32_t whole =
            ~(tqkv_crc32c_shift(tqkv_crc32c_shift(0xffffffffu, cut) ^ a, len - cut) ^ b);
        ck_assert_uint_eq(whole, tqkv_crc32c_ref(0, buf, len));
    }
    /* shift by 0 is the identity; x8n composes */
    ck_assert_uint_eq(tqkv_crc32c_shift(0xdeadbeefu, 0), 0xdeadbeefu);
    ck_assert_uint_eq(tqkv_crc32c_shift(tqkv_crc32c_shift(0x12345678u, 77), 1000),
                      tqkv_crc32c_shift(0x12345678u, 1077));
}
END_TEST

START_TEST(test_energy_rank_ties)
{
    double e[37];
    rng_state = tqkv_test_seed() ^ 0x22;
    for (int trial = 0; trial < 20; trial++) {
        uint32_t d = 1 + (uint32_t)(tqkv_test_rand(&rng_state) % 37), seen[37] = {0};
        for (uint32_t c = 0; c < d; c++)
            e[c] = (double)(tqkv_test_rand(&rng_state) % 5); /* many ties */
        for (uint32_t c = 0; c < d; c++) {
            uint32_t r = tqkv_energy_rank(e, d, c);
            ck_assert_uint_lt(r, d);
            ck_assert_uint_eq(seen[r], 0);
            seen[r] = 1;
            for (uint32_t k = 0; k < c; k++) /* equal energies: the lower channel ranks first */
                if (e[k] == e[c])
                    ck_assert_uint_lt(tqkv_energy_rank(e, d, k), r);
        }
    }
}
END_TEST

START_TEST(test_rotate_roundtrip)
{
    static const uint32_t dims[] = {16, 64, 128, 96, 33};
    float in[128], y[128], back[128];
    rng_state = tqkv_test_seed() ^ 0x33;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        uint32_t g = dims[di];
        for (uint32_t kind = 0; kind < 2; kind++) {
            const tqkv_rotation_t *r;
            tqkv_group_codec_t G;
            if (kind == TQKV_ROT_HADAMARD && !tqkv_is_pow2(g))
                continue;
            ck_assert_int_eq(tqkv_rotation_acquire(kind, g, tqkv_test_rand(&rng_state), &r),
                             TQKV_OK);
            memset(&G, 0, sizeof G);
            G.dim = g;
            G.rotation = kind;
            G.matrix = r->matrix;
            G.signs = r->signs;
            for (uint32_t j = 0; j < g; j++)
                in[j] = (float)tqkv_test_gauss(&rng_state);
            tqkv_group_rotate(&G, in, y);
            float ref[128];
            tqkv_rotation_apply(r, in, ref);
            ck_assert_mem_eq(y, ref, g * sizeof(float)); /* same f32 operations */
            tqkv_group_rotate_t(&G, y, back);
            tqkv_rotation_apply_t(r, y, ref);
            ck_assert_mem_eq(back, ref, g * sizeof(float));
            for (uint32_t j = 0; j < g; j++)
                ck_assert_float_eq_tol(back[j], in[j], 1e-4f * (1.0f + fabsf(in[j])));
            tqkv_rotation_release(r);
        }
    }
}
END_TEST

static void
check_one(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const char *what)
{
    size_t cap = 0, w1 = 0, w2 = 0;
    uint64_t n = (uint64_t)s->num_tokens * s->num_kv_heads * s->head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    char err[128] = "";
    ck_assert_int_eq(tqkv_page_size(s, c, &cap), TQKV_OK);
    uint8_t *p_ref = malloc(cap), *p_emu = malloc(cap);
    float *d_ref = malloc(n * 4), *d_emu = malloc(n * 4);
    tqkv_test_kv_loud(&rng_state, k, s->num_tokens, s->num_kv_heads, s->head_dim, 0.75);
    tqkv_test_kv_loud(&rng_state, v, s->num_tokens, s->num_kv_heads, s->head_dim, 0.0);
    ck_assert_int_eq(tqkv_page_encode_ref(s, c, k, v, p_ref, cap, &w1, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(emu_encode(s, c, k, v, p_emu, cap, &w2), TQKV_OK);
    ck_assert_uint_eq(w1, w2);
    if (memcmp(p_ref, p_emu, w1) != 0) {
        size_t first = 16; /* past the CRC, which differs whenever anything else does */
        while (first < w1 && p_ref[first] == p_emu[first])
            first++;
        if (first == w1) /* only the header's first 16 bytes differ */
            for (first = 0; p_ref[first] == p_emu[first]; first++)
                ;
        ck_abort_msg("%s: T=%u H=%u D=%u: page differs from the reference at byte %zu of %zu", what,
                     s->num_tokens, s->num_kv_heads, s->head_dim, first, w1);
    }
    ck_assert_uint_eq(tqkv_page_crc(p_emu, w2), ((tqkv_page_header_t *)p_emu)->crc32c);
    for (uint32_t t = 0; t < 2; t++) {
        if (!((tqkv_page_header_t *)p_ref)->tensor[t].bits_x2)
            continue;
        ck_assert_int_eq(
            tqkv_page_decode_f32_ref(p_ref, w1, t == 0 ? d_ref : NULL, t == 1 ? d_ref : NULL),
            TQKV_OK);
        ck_assert_int_eq(emu_decode(p_emu, t, d_emu), TQKV_OK);
        ck_assert_msg(memcmp(d_ref, d_emu, n * 4) == 0, "%s: decode of tensor %u differs", what, t);
    }
    free(k);
    free(v);
    free(p_ref);
    free(p_emu);
    free(d_ref);
    free(d_emu);
}

/* The GPU encoder's math, run on the host, gives the reference page byte for byte. */
START_TEST(test_emulated_gpu_page_equals_reference)
{
    static const uint8_t bits[] = {2, 3, 4, 5, 6, 7, 8};
    static const uint32_t dims[] = {128, 64, 16, 96, 129};
    rng_state = tqkv_test_seed() ^ 0x44;
    int trials = tqkv_test_sanitized() ? 6 : 24;
    for (int tr = 0; tr < trials; tr++) {
        tqkv_block_shape_t s;
        tqkv_block_codec_t c;
        memset(&c, 0, sizeof c);
        s.head_dim = dims[tr % 5];
        s.num_tokens = (uint32_t[]){1, 7, 16, 33}[tqkv_test_rand(&rng_state) % 4];
        s.num_kv_heads = 1 + (uint32_t)(tqkv_test_rand(&rng_state) % 3);
        c.k.bits_x2 = bits[tqkv_test_rand(&rng_state) % 7];
        c.v.bits_x2 = tr % 7 == 3 ? 0 : bits[tqkv_test_rand(&rng_state) % 7];
        c.k.mode = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
        c.v.mode = (uint8_t)(tqkv_test_rand(&rng_state) % 4 == 0);
        c.k.norm_correction = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
        c.v.norm_correction = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
        c.rotation = (uint8_t)(tr % 3 ? TQKV_ROT_HADAMARD : TQKV_ROT_DENSE);
        c.key_centering = (uint8_t)(tqkv_test_rand(&rng_state) % 2);
        c.seed = tqkv_test_rand(&rng_state);
        char what[96];
        snprintf(what, sizeof what, "trial %d k=%u/%u v=%u/%u rot=%u ctr=%u", tr, c.k.bits_x2,
                 c.k.mode, c.v.bits_x2, c.v.mode, c.rotation, c.key_centering);
        check_one(&s, &c, what);
    }
}
END_TEST

/* Largest finite BF16 inputs: scale stays finite, the page still matches. */
START_TEST(test_emulated_gpu_page_huge_values)
{
    tqkv_block_shape_t s = {5, 2, 64};
    tqkv_block_codec_t c;
    size_t cap, w1, w2;
    uint16_t k[5 * 2 * 64], v[5 * 2 * 64];
    rng_state = tqkv_test_seed() ^ 0x55;
    memset(&c, 0, sizeof c);
    c.k.bits_x2 = 7;
    c.v.bits_x2 = 6;
    c.v.mode = TQKV_MODE_PROD;
    c.rotation = TQKV_ROT_HADAMARD;
    c.key_centering = 1;
    c.seed = tqkv_test_rand(&rng_state);
    for (size_t i = 0; i < sizeof k / 2; i++) {
        k[i] =
            (uint16_t)(0x7f7fu | (tqkv_test_rand(&rng_state) % 2 ? 0x8000u : 0u)); /* +-max BF16 */
        v[i] =
            (uint16_t)(tqkv_test_rand(&rng_state) % 3 ? 0x7f7fu : 0x0001u); /* max and subnormal */
    }
    ck_assert_int_eq(tqkv_page_size(&s, &c, &cap), TQKV_OK);
    uint8_t *a = malloc(cap), *b = malloc(cap);
    ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, k, v, a, cap, &w1, NULL, 0), TQKV_OK);
    ck_assert_int_eq(emu_encode(&s, &c, k, v, b, cap, &w2), TQKV_OK);
    ck_assert_mem_eq(a, b, w1);
    tqkv_group_view_t gv;
    ck_assert_int_eq(tqkv_page_group_view(b, TQKV_TENSOR_V, 0, &gv), 0);
    for (uint32_t i = 0; i < 10; i++)
        ck_assert(isfinite(tqkv_scale_get(gv.scale, i)) && tqkv_scale_get(gv.scale, i) > 0);
    free(a);
    free(b);
}
END_TEST

/* Per-vector encode/decode distortion at 3 bits on Gaussian vectors is the Lloyd-Max theory
 * value (d = 128, Beta marginal codebook). */
START_TEST(test_vec_distortion)
{
    host_group_t hg;
    tqkv_page_header_t h;
    uint8_t bx2[2] = {6, 0}, mode[2] = {0, 0}, nc[2] = {0, 0};
    double x[128], out[128], err = 0, tot = 0;
    float work[3 * 128];
    uint16_t scale, gamma;
    uint8_t idx[48];
    rng_state = tqkv_test_seed() ^ 0x66;
    ck_assert_int_eq(tqkv_page_plan(1, 1, 128, bx2, mode, nc, TQKV_ROT_HADAMARD, 0,
                                    tqkv_test_rand(&rng_state), &h),
                     0);
    ck_assert_int_eq(host_group_init(&hg, &h, 0, 0), TQKV_OK);
    int reps = tqkv_test_sanitized() ? 200 : 2000;
    for (int r = 0; r < reps; r++) {
        double nn = 0;
        for (int j = 0; j < 128; j++) {
            x[j] = tqkv_test_gauss(&rng_state);
            nn += x[j] * x[j];
        }
        memset(idx, 0, sizeof idx);
        tqkv_group_encode_vec(&hg.G, x, work, &scale, &gamma, idx, NULL);
        tqkv_group_decode_vec(&hg.G, tqkv_bf16_to_f32(scale), 0, idx, NULL, work, out);
        for (int j = 0; j < 128; j++)
            err += (out[j] - x[j]) * (out[j] - x[j]);
        tot += nn;
    }
    /* D_mse(3 bits, d = 128) = 0.03397 */
    ck_assert_msg(fabs(err / tot - 0.03397) < 0.03397 * 0.05, "D = %g", err / tot);
    host_group_fini(&hg);
}
END_TEST

static Suite *
gpu_math_suite(void)
{
    Suite *s = suite_create("gpu_math");
    TCase *tc = tcase_create("hd");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_crc_pieces);
    tcase_add_test(tc, test_energy_rank_ties);
    tcase_add_test(tc, test_rotate_roundtrip);
    tcase_add_test(tc, test_emulated_gpu_page_equals_reference);
    tcase_add_test(tc, test_emulated_gpu_page_huge_values);
    tcase_add_test(tc, test_vec_distortion);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(gpu_math_suite)
