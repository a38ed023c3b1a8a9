/* check_codec_pack.c - bit packing, and the SIMD kernels against the scalar reference:
 * index rows bit-exact except at documented near-ties, scales to float rounding,
 * decode equal. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/cpu.h"
#include "kernels/page.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/rng.h"
#include "tests/support/sanitize.h"

static uint64_t rng;

/* The LSB-first stream: bit k of the row is bit (k - j b) of field j. */
START_TEST(test_bits_stream)
{
    uint8_t row[200];
    uint32_t vals[400];
    rng = tqkv_test_seed();
    for (uint32_t b = 1; b <= 8; b++)
        for (uint32_t n = 1; n < 400 && n * b <= 8 * sizeof row; n += 1 + n / 3) {
            size_t bad = 0;
            memset(row, 0, sizeof row);
            for (uint32_t j = 0; j < n; j++) {
                vals[j] = (uint32_t)tqkv_splitmix64(&rng) & ((1u << b) - 1);
                tqkv_bits_put(row, j, b, vals[j]);
            }
            for (uint32_t k = 0; k < n * b; k++)
                bad += ((row[k / 8] >> (k % 8)) & 1u) != ((vals[k / b] >> (k % b)) & 1u);
            for (uint32_t k = n * b; k < 8 * sizeof row; k++)
                bad += (row[k / 8] >> (k % 8)) & 1u;
            for (uint32_t j = 0; j < n; j++)
                bad += tqkv_bits_get(row, j, b) != vals[j];
            ck_assert_msg(bad == 0, "b=%u n=%u: %zu bad bits", b, n, bad);
        }
}
END_TEST

/* Encodes the same data with tqkv_page_encode (SIMD where available) and
 * tqkv_page_encode_ref and compares field by field. */
/* Two stored (BF16) scales of the same vector from encoders whose f32 scales agree to
 * float rounding (2e-6 relative): equal, or (when the f32 values straddle a BF16 rounding
 * boundary, about one vector in 2^8 / 2e-6 ~ 2000) adjacent codes. Returns 0 equal,
 * 1 adjacent, 2 farther apart. */
static int
bf16_scale_diff(uint16_t a, uint16_t b)
{
    if (a == b)
        return 0;
    if ((a & 0x8000u) || (b & 0x8000u))
        return 2;
    return (a > b ? a - b : b - a) == 1 ? 1 : 2;
}

static void
compare_paths(uint32_t T, uint32_t H, uint32_t D, uint32_t bits, int nc, double scale_mag,
              size_t *n_coords, size_t *n_ties)
{
    tqkv_block_shape_t s = {T, H, D};
    tqkv_block_codec_t c = {0};
    size_t n = (size_t)T * H * D, sz, sz2;
    uint16_t *x = malloc(n * 2), *of = malloc(n * 2), *orf = malloc(n * 2);
    float *ff = malloc(n * 4), *fr = malloc(n * 4);
    uint8_t *pf, *pr;
    char err[200];
    tqkv_group_view_t gf, gr;
    const tqkv_codebook_t *cb;
    const tqkv_rotation_t *rot;
    float *u = malloc(D * 4), *y = malloc(D * 4);
    size_t bad_scale = 0, adj_scale = 0, far_mismatch = 0, bad_dec = 0;

    c.k.bits_x2 = (uint8_t)(2 * bits);
    c.k.norm_correction = (uint8_t)nc;
    c.rotation = TQKV_ROT_HADAMARD;
    c.seed = tqkv_splitmix64(&rng);
    for (size_t i = 0; i < n; i++)
        x[i] =
            tqkv_f32_to_bf16((float)(tqkv_test_gauss(&rng) * scale_mag * (1 + (i % D == 3) * 20)));
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    pf = malloc(sz);
    pr = malloc(sz);
    ck_assert_int_eq(tqkv_page_encode(&s, &c, x, NULL, pf, sz, &sz2, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, NULL, pr, sz, &sz2, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_validate(pf, sz, 1, NULL, err, sizeof err), TQKV_OK);
    /* header and codebook identical (crc differs with the payload) */
    ck_assert(memcmp(pf, pr, 12) == 0 &&
              memcmp(pf + 16, pr + 16, TQKV_PAGE_HEADER_BYTES - 16) == 0);
    ck_assert_int_eq(tqkv_page_group_view(pf, 0, 0, &gf), 0);
    ck_assert_int_eq(tqkv_page_group_view(pr, 0, 0, &gr), 0);
    ck_assert(memcmp(gf.codebook, gr.codebook, 64) == 0);
    ck_assert_int_eq(tqkv_codebook_get(D, bits, &cb), TQKV_OK);
    ck_assert_int_eq(tqkv_rotation_acquire(TQKV_ROT_HADAMARD, D, gf.rot_seed, &rot), TQKV_OK);
    for (size_t i = 0; i < (size_t)T * H; i++) {
        const uint16_t *xv = x + i * D;
        const uint8_t *rf = gf.idx + i * gf.L.idx_row_bytes, *rr = gr.idx + i * gr.L.idx_row_bytes;
        double ss = 0, sd;
        int same = !memcmp(rf, rr, gf.L.idx_row_bytes);
        /* (with norm correction a near-tie also moves ||z[idx]||, hence the scale) */
        if (same || !nc) {
            int dsc = bf16_scale_diff(gf.scale[i], gr.scale[i]);
            bad_scale += dsc == 2;
            adj_scale += dsc == 1;
        }
        if (same) {
            *n_coords += D;
            continue;
        }
        /* the reference's rotated coordinates, to locate the mismatches */
        for (uint32_t j = 0; j < D; j++)
            ss += (double)tqkv_bf16_to_f32(xv[j]) * tqkv_bf16_to_f32(xv[j]);
        sd = sqrt(ss);
        for (uint32_t j = 0; j < D; j++)
            u[j] = (float)(tqkv_bf16_to_f32(xv[j]) / sd);
        tqkv_rotation_apply(rot, u, y);
        for (uint32_t j = 0; j < D; j++) {
            uint32_t a = tqkv_bits_get(rf, j, bits), b = tqkv_bits_get(rr, j, bits);
            (*n_coords)++;
            if (a == b)
                continue;
            (*n_ties)++;
            {
                float v = y[j] * sqrtf((float)D);
                uint32_t lo = a < b ? a : b;
                /* near-tie: adjacent indices, and the coordinate within 1e-5 (z domain,
                 * relative to max(1, |v|)) of the threshold between them */
                if ((a > b ? a - b : b - a) != 1 ||
                    !(fabsf(v - cb->thr[lo]) <= 1e-5f * fmaxf(1.0f, fabsf(v))))
                    far_mismatch++;
            }
        }
    }
    ck_assert_msg(bad_scale == 0, "%zu scales differ beyond rounding", bad_scale);
    ck_assert_msg(adj_scale * 100 <= (size_t)T * H, "%zu of %zu scales one BF16 step apart",
                  adj_scale, (size_t)T * H);
    ck_assert_msg(far_mismatch == 0, "D=%u b=%u: %zu index mismatches are not near-ties", D, bits,
                  far_mismatch);
    /* decoding: SIMD and reference agree to float rounding, BF16 outputs exactly or by one
     * unit in the last place */
    ck_assert_int_eq(tqkv_page_decode_f32(pr, sz, ff, NULL), TQKV_OK);
    ck_assert_int_eq(tqkv_page_decode_f32_ref(pr, sz, fr, NULL), TQKV_OK);
    ck_assert_int_eq(tqkv_page_decode_bf16(pr, sz, of, NULL), TQKV_OK);
    for (size_t i = 0; i < n; i++) {
        int d = (int)of[i] - (int)tqkv_f32_to_bf16_sat(fr[i]);
        bad_dec += !(fabsf(ff[i] - fr[i]) <= 1e-6f * fabsf(fr[i]) + 1e-30f) || d > 1 || d < -1;
    }
    ck_assert_msg(bad_dec == 0, "%zu decoded values differ", bad_dec);
    tqkv_rotation_release(rot);
    free(x);
    free(of);
    free(orf);
    free(ff);
    free(fr);
    free(pf);
    free(pr);
    free(u);
    free(y);
}

START_TEST(test_simd_vs_ref)
{
    size_t coords = 0, ties = 0;
    int san = tqkv_test_sanitized();
    rng = tqkv_test_seed();
    fprintf(stderr, "kernels: %s\n", tqkv_kernels_isa());
    for (uint32_t D = 16; D <= 1024; D *= 2)
        for (uint32_t b = 1; b <= 4; b++)
            for (int nc = 0; nc < 2; nc++) {
                uint32_t T = (san ? 4096 : 32768) / D + 1;
                /* magnitudes across the range the kernel takes itself, plus tiny and huge
                 * rows it hands back to the reference */
                double mag = (b + nc) % 3 == 0 ? 1e-25 : ((b + nc) % 3 == 1 ? 1.0 : 1e17);
                compare_paths(T, 3, D, b, nc, mag, &coords, &ties);
            }
    fprintf(stderr, "simd vs ref: %zu near-ties in %zu coordinates (%.2g)\n", ties, coords,
            (double)ties / coords);
    /* near-ties are rare: about (rounding error / cell width) of the coordinates */
    ck_assert_msg(ties <= coords / 2000, "%zu near-ties in %zu coordinates", ties, coords);
}
END_TEST

/* All-zero, constant and single-spike rows through the fast path and the reference. */
START_TEST(test_simd_special_rows)
{
    const uint32_t D = 128, T = 6;
    uint16_t x[6 * 128];
    tqkv_block_shape_t s = {T, 1, D};
    tqkv_block_codec_t c = {0};
    size_t sz;
    uint8_t *a, *b;
    c.k.bits_x2 = 6;
    c.rotation = TQKV_ROT_HADAMARD;
    c.seed = 3;
    for (uint32_t j = 0; j < D; j++) {
        x[0 * D + j] = 0;
        x[1 * D + j] = tqkv_f32_to_bf16(1.5f);
        x[2 * D + j] = j == 7 ? tqkv_f32_to_bf16(-3.0f) : 0;
        x[3 * D + j] = 0x0001;                            /* smallest subnormal */
        x[4 * D + j] = (j & 1) ? 0x7f7f : 0xff7f;         /* +-max finite */
        x[5 * D + j] = tqkv_f32_to_bf16((float)j - 64.f); /* a ramp */
    }
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    a = malloc(sz);
    b = malloc(sz);
    ck_assert_int_eq(tqkv_page_encode(&s, &c, x, NULL, a, sz, NULL, NULL, 0), TQKV_OK);
    ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, NULL, b, sz, NULL, NULL, 0), TQKV_OK);
    /* rows 0, 3, 4 go to the reference inside the fast encoder: identical bytes */
    {
        tqkv_group_view_t ga, gb;
        ck_assert_int_eq(tqkv_page_group_view(a, 0, 0, &ga), 0);
        ck_assert_int_eq(tqkv_page_group_view(b, 0, 0, &gb), 0);
        for (int r = 0; r < 6; r++)
            if (r == 0 || r == 3 || r == 4) {
                ck_assert(ga.scale[r] == gb.scale[r]); /* same BF16 bits */
                ck_assert(!memcmp(ga.idx + r * 48, gb.idx + r * 48, 48));
            }
        ck_assert(tqkv_scale_get(ga.scale, 0) == 0.0f);
        ck_assert(tqkv_scale_get(ga.scale, 3) > 0.0f);
    }
    free(a);
    free(b);
}
END_TEST

/* Centered keys and two-group (fractional) tensors through the SIMD encoder: the same
 * means, masks, codebooks and layout as the reference; indices equal but for near-ties. */
START_TEST(test_simd_vs_ref_centered_fractional)
{
    static const uint8_t bits[] = {3, 5, 6, 7, 8};
    rng = tqkv_test_seed() + 7;
    for (size_t bi = 0; bi < sizeof bits; bi++)
        for (int nc = 0; nc < 2; nc++) {
            const uint32_t T = 64, H = 4, D = 128;
            tqkv_block_shape_t s = {T, H, D};
            tqkv_block_codec_t c = {0};
            size_t n = (size_t)T * H * D, sz, fields = 0, diff = 0, bad_scale = 0, adj_scale = 0,
                   vecs = 0;
            uint16_t *x = malloc(n * 2);
            uint8_t *pf, *pr;
            const tqkv_page_header_t *h;
            double off[4 * 128];
            for (uint32_t k = 0; k < H * D; k++)
                off[k] = tqkv_test_unif(&rng) < 0.3 ? 3 * tqkv_test_gauss(&rng) : 0;
            for (size_t i = 0; i < n; i++)
                x[i] = tqkv_f32_to_bf16(
                    (float)(off[i % (H * D)] +
                            tqkv_test_gauss(&rng) * (i % D == 9 || i % D == 77 ? 10 : 1)));
            c.k.bits_x2 = bits[bi];
            c.k.norm_correction = (uint8_t)nc;
            c.v.bits_x2 = bits[(bi + 2) % 5];
            c.key_centering = 1;
            c.rotation = TQKV_ROT_HADAMARD;
            c.seed = tqkv_splitmix64(&rng);
            ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
            pf = malloc(sz);
            pr = malloc(sz);
            ck_assert_int_eq(tqkv_page_encode(&s, &c, x, x, pf, sz, NULL, NULL, 0), TQKV_OK);
            ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, x, pr, sz, NULL, NULL, 0), TQKV_OK);
            h = (const tqkv_page_header_t *)pr;
            ck_assert(memcmp(pf + 16, pr + 16, TQKV_PAGE_HEADER_BYTES - 16) == 0);
            ck_assert(memcmp(pf + h->mean_offset, pr + h->mean_offset, 4 * H * D) == 0);
            for (uint32_t t = 0; t < 2; t++) {
                const tqkv_page_tensor_desc_t *td = &h->tensor[t];
                if (td->lo_bits)
                    ck_assert(
                        memcmp(pf + td->mask_offset, pr + td->mask_offset, H * ((D + 7) / 8)) == 0);
                for (uint32_t gi = 0; gi < (td->lo_bits ? 2u : 1u); gi++) {
                    tqkv_group_view_t a, b;
                    ck_assert_int_eq(tqkv_page_group_view(pf, t, gi, &a), 0);
                    ck_assert_int_eq(tqkv_page_group_view(pr, t, gi, &b), 0);
                    ck_assert(memcmp(a.codebook, b.codebook, 64) == 0);
                    for (size_t i = 0; i < (size_t)T * H; i++) {
                        size_t d0 = diff;
                        for (uint32_t j = 0; j < a.L.dim; j++) {
                            fields++;
                            diff += tqkv_bits_get(a.idx + i * a.L.idx_row_bytes, j, a.L.mse_bits) !=
                                    tqkv_bits_get(b.idx + i * b.L.idx_row_bytes, j, b.L.mse_bits);
                        }
                        if (diff == d0 || !nc) {
                            int dsc = bf16_scale_diff(a.scale[i], b.scale[i]);
                            bad_scale += dsc == 2;
                            adj_scale += dsc == 1;
                        }
                        vecs++;
                    }
                }
            }
            ck_assert_msg(diff * 10000 <= fields, "bits %u/2: %zu of %zu indices differ", bits[bi],
                          diff, fields);
            ck_assert_msg(bad_scale == 0, "%zu scales differ", bad_scale);
            ck_assert_msg(adj_scale * 100 <= vecs, "%zu of %zu scales one BF16 step apart",
                          adj_scale, vecs);
            free(x);
            free(pf);
            free(pr);
        }
}
END_TEST

/* Decoding near the ends of the BF16 range through the SIMD kernels (whole-head,
 * centered and two-group tensors): f32 as the reference to rounding, BF16 equal to the
 * saturating rounding of the f32 result (and within one unit of the reference's). */
START_TEST(test_simd_decode_saturation)
{
    static const uint32_t Ds[] = {16, 32, 64, 128, 256, 512};
    static const uint8_t bits[] = {2, 4, 6, 7, 8};
    const uint32_t T = 6, H = 2;
    size_t saturated = 0;
    rng = tqkv_test_seed() + 11;
    for (size_t di = 0; di < sizeof Ds / sizeof Ds[0]; di++)
        for (size_t bi = 0; bi < sizeof bits; bi++)
            for (int cen = 0; cen < 2; cen++) {
                const uint32_t D = Ds[di];
                const size_t n = (size_t)T * H * D;
                tqkv_block_shape_t s = {T, H, D};
                tqkv_block_codec_t c = {0};
                uint16_t *x = malloc(n * 2), *h = malloc(n * 2);
                float *f = malloc(n * 4), *fr = malloc(n * 4);
                size_t sz, bad = 0;
                uint8_t *p;
                c.k.bits_x2 = bits[bi];
                c.k.norm_correction = (uint8_t)(bi & 1);
                c.key_centering = (uint8_t)cen;
                c.rotation = TQKV_ROT_HADAMARD;
                c.seed = tqkv_splitmix64(&rng);
                /* rows: +-max finite, all +max, huge, max spikes among tiny, ordinary, zero */
                for (uint32_t t = 0; t < T; t++)
                    for (uint32_t i = 0; i < H * D; i++) {
                        uint16_t v;
                        switch (t) {
                        case 0:
                            v = (i & 1) ? 0x7f7f : 0xff7f;
                            break;
                        case 1:
                            v = 0x7f7f;
                            break;
                        case 2:
                            v = tqkv_f32_to_bf16(
                                (float)fmax(-3e38, fmin(3e38, tqkv_test_gauss(&rng) * 1e38)));
                            break;
                        case 3:
                            v = (i % 5 == 2) ? ((i & 8) ? 0xff7f : 0x7f7f) : 0x0001;
                            break;
                        case 4:
                            v = tqkv_f32_to_bf16((float)tqkv_test_gauss(&rng));
                            break;
                        default:
                            v = 0;
                        }
                        x[(size_t)t * H * D + i] = v;
                    }
                ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
                p = malloc(sz);
                ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, NULL, p, sz, NULL, NULL, 0),
                                 TQKV_OK);
                ck_assert_int_eq(tqkv_page_decode_f32(p, sz, f, NULL), TQKV_OK);
                ck_assert_int_eq(tqkv_page_decode_f32_ref(p, sz, fr, NULL), TQKV_OK);
                ck_assert_int_eq(tqkv_page_decode_bf16(p, sz, h, NULL), TQKV_OK);
                for (size_t i = 0; i < n; i++) {
                    int d = (int)h[i] - (int)tqkv_f32_to_bf16_sat(fr[i]);
                    bad += !isfinite(f[i]) ||
                           !(fabsf(f[i] - fr[i]) <= 1e-5f * fabsf(fr[i]) + 1e-30f) ||
                           h[i] != tqkv_f32_to_bf16_sat(f[i]) || d > 1 || d < -1;
                    saturated += (h[i] & 0x7fffu) == 0x7f7fu;
                }
                ck_assert_msg(bad == 0, "D=%u bits %u/2 cen %d: %zu decoded values differ", D,
                              bits[bi], cen, bad);
                free(x);
                free(h);
                free(f);
                free(fr);
                free(p);
            }
    /* the rows at the top of the range reach the saturation */
    ck_assert_uint_gt(saturated, 100);
}
END_TEST

/* One fractional / dense page through both encoders and both decoders: equal header,
 * means, masks (and the masks are the energy ranks of tq_math.h), indices equal but for
 * adjacent near-ties, scales to rounding; every page decodes the same through the fast
 * and the reference decoder (f32 to float rounding, BF16 within one unit), and a dense
 * single group without centering decodes bit-exactly. */
static void
frac_case(uint32_t T, uint32_t H, uint32_t D, uint8_t bits_x2, uint8_t rotation, int cen, int nc,
          uint8_t mode, size_t *fields, size_t *ties)
{
    tqkv_block_shape_t s = {T, H, D};
    tqkv_block_codec_t c = {0};
    const size_t n = (size_t)T * H * D;
    uint16_t *x = malloc(n * 2), *oh = malloc(n * 2);
    float *ff = malloc(n * 4), *fr = malloc(n * 4);
    double *off = malloc(sizeof(double) * H * D), *en = malloc(sizeof(double) * D);
    uint8_t *pg[2];
    size_t sz;
    const tqkv_page_header_t *h;
    char err[200];
    for (uint32_t k = 0; k < H * D; k++)
        off[k] = cen && tqkv_test_unif(&rng) < 0.3 ? 3 * tqkv_test_gauss(&rng) : 0;
    for (size_t i = 0; i < n; i++)
        x[i] = tqkv_f32_to_bf16((
            float)(off[i % (H * D)] + tqkv_test_gauss(&rng) * (i % D == 5 || i % D == 40 ? 8 : 1)));
    c.k.bits_x2 = bits_x2;
    c.k.norm_correction = (uint8_t)nc;
    c.k.mode = mode;
    c.v.mode = mode;
    c.v.bits_x2 = bits_x2;
    c.v.norm_correction = (uint8_t)nc;
    c.key_centering = (uint8_t)cen;
    c.rotation = rotation;
    c.seed = tqkv_splitmix64(&rng);
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    pg[0] = malloc(sz);
    pg[1] = malloc(sz);
    ck_assert_int_eq(tqkv_page_encode(&s, &c, x, x, pg[0], sz, NULL, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, x, pg[1], sz, NULL, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_validate(pg[0], sz, 1, NULL, err, sizeof err), TQKV_OK);
    h = (const tqkv_page_header_t *)pg[1];
    ck_assert(memcmp(pg[0] + 16, pg[1] + 16, TQKV_PAGE_HEADER_BYTES - 16) == 0);
    /* prod: the fast encoder (block QJL products) writes the reference's bytes */
    if (mode == TQKV_MODE_PROD)
        ck_assert_msg(memcmp(pg[0], pg[1], sz) == 0, "D=%u bits %u/2: prod pages differ", D,
                      bits_x2);
    if (cen)
        ck_assert(memcmp(pg[0] + h->mean_offset, pg[1] + h->mean_offset, 4 * H * D) == 0);
    for (uint32_t t = 0; t < 2; t++) {
        const tqkv_page_tensor_desc_t *td = &h->tensor[t];
        const float *mean = t == 0 && cen ? (const float *)(pg[1] + h->mean_offset) : NULL;
        size_t bad_scale = 0, adj_scale = 0, far = 0;
        if (td->lo_bits) {
            ck_assert(memcmp(pg[0] + td->mask_offset, pg[1] + td->mask_offset, H * ((D + 7) / 8)) ==
                      0);
            /* the mask holds the n_hi channels of lowest energy rank */
            for (uint32_t hh = 0; hh < H; hh++) {
                const uint8_t *m = pg[0] + td->mask_offset + hh * ((D + 7) / 8);
                for (uint32_t ch = 0; ch < D; ch++) {
                    en[ch] = 0;
                    for (uint32_t tt = 0; tt < T; tt++) {
                        double v = (double)tqkv_bf16_to_f32(x[((size_t)tt * H + hh) * D + ch]) -
                                   (mean ? mean[hh * D + ch] : 0.0f);
                        en[ch] += v * v;
                    }
                }
                for (uint32_t ch = 0; ch < D; ch++)
                    ck_assert_int_eq((m[ch >> 3] >> (ch & 7)) & 1,
                                     tqkv_energy_rank(en, D, ch) < td->n_hi);
            }
        }
        for (uint32_t gi = 0; gi < (td->lo_bits ? 2u : 1u); gi++) {
            tqkv_group_view_t a, b;
            ck_assert_int_eq(tqkv_page_group_view(pg[0], t, gi, &a), 0);
            ck_assert_int_eq(tqkv_page_group_view(pg[1], t, gi, &b), 0);
            ck_assert(memcmp(a.codebook, b.codebook, 64) == 0);
            for (size_t i = 0; i < (size_t)T * H; i++) {
                size_t d0 = *ties;
                for (uint32_t j = 0; j < a.L.dim; j++) {
                    uint32_t u = tqkv_bits_get(a.idx + i * a.L.idx_row_bytes, j, a.L.mse_bits);
                    uint32_t v = tqkv_bits_get(b.idx + i * b.L.idx_row_bytes, j, b.L.mse_bits);
                    (*fields)++;
                    *ties += u != v;
                    far += u != v && u + 1 != v && v + 1 != u;
                }
                if (*ties == d0 || !nc) {
                    int dsc = bf16_scale_diff(a.scale[i], b.scale[i]);
                    bad_scale += dsc == 2;
                    adj_scale += dsc == 1;
                }
            }
        }
        ck_assert_msg(far == 0, "D=%u bits %u/2 rot %u: %zu indices differ by more than one", D,
                      bits_x2, rotation, far);
        ck_assert_msg(bad_scale == 0, "%zu scales differ", bad_scale);
        ck_assert_msg(adj_scale * 50 <= (size_t)T * H, "%zu scales one BF16 step apart", adj_scale);
    }
    /* each page (fast- and reference-encoded) decodes the same through both decoders */
    for (int pi = 0; pi < 2; pi++)
        for (uint32_t t = 0; t < 2; t++) {
            const float *mean = t == 0 && cen ? (const float *)(pg[1] + h->mean_offset) : NULL;
            size_t bad = 0, inexact = 0;
            float *kf = t ? NULL : ff, *vf = t ? ff : NULL, *kr = t ? NULL : fr,
                  *vr = t ? fr : NULL;
            uint16_t *kh = t ? NULL : oh, *vh = t ? oh : NULL;
            ck_assert_int_eq(tqkv_page_decode_f32(pg[pi], sz, kf, vf), TQKV_OK);
            ck_assert_int_eq(tqkv_page_decode_f32_ref(pg[pi], sz, kr, vr), TQKV_OK);
            ck_assert_int_eq(tqkv_page_decode_bf16(pg[pi], sz, kh, vh), TQKV_OK);
            for (size_t i = 0; i < n; i++) {
                float mu = mean ? fabsf(mean[i % (H * D)]) : 0.0f;
                int d = (int)oh[i] - (int)tqkv_f32_to_bf16_sat(fr[i]);
                /* (centered: the fast decoder adds the mean in f32, the reference in f64,
                 * so a value that cancels against its mean is off by a rounding of the
                 * mean's magnitude, and its BF16 by more than one unit) */
                bad += !(fabsf(ff[i] - fr[i]) <= 1e-6f * (fabsf(fr[i]) + mu) + 1e-30f) ||
                       (!mean && (d > 1 || d < -1)) || oh[i] != tqkv_f32_to_bf16_sat(ff[i]);
                inexact += ff[i] != fr[i];
            }
            ck_assert_msg(bad == 0,
                          "D=%u bits %u/2 rot %u mode %u cen %d page %d tensor %u: %zu differ", D,
                          bits_x2, rotation, mode, cen, pi, t, bad);
            if (!mean && (mode == TQKV_MODE_PROD || (rotation == TQKV_ROT_DENSE && !(bits_x2 & 1))))
                ck_assert_msg(inexact == 0, "dense decode not exact: %zu values", inexact);
        }
    free(x);
    free(oh);
    free(ff);
    free(fr);
    free(off);
    free(en);
    free(pg[0]);
    free(pg[1]);
}

/* 2.5 and 3.5 bits (the 2.5-bit low group takes the dense rotation: 96 or 48 channels),
 * and dense-rotation pages, centered or not, with and without norm correction. */
START_TEST(test_simd_vs_ref_frac_dense)
{
    static const uint8_t bits[] = {5, 7, 6, 3};
    static const uint32_t Ds[] = {64, 128, 96};
    size_t fields = 0, ties = 0;
    rng = tqkv_test_seed() + 13;
    for (size_t di = 0; di < 3; di++)
        for (size_t bi = 0; bi < sizeof bits; bi++)
            for (uint8_t rot = TQKV_ROT_DENSE; rot <= TQKV_ROT_HADAMARD; rot++)
                for (int cen = 0; cen < 2; cen++)
                    for (int nc = 0; nc < 2; nc++) {
                        if (Ds[di] == 96 && rot == TQKV_ROT_HADAMARD && bits[bi] != 5)
                            continue; /* (no 3.5-bit split of 96 is a power of two either) */
                        frac_case(67, 3, Ds[di], bits[bi], rot, cen, nc, TQKV_MODE_MSE, &fields,
                                  &ties);
                    }
    /* prod: the fast encoder's and decoder's block QJL products are exact */
    for (size_t di = 0; di < 3; di++)
        for (size_t bi = 0; bi < sizeof bits; bi++)
            for (int cen = 0; cen < 2; cen++)
                frac_case(70, 2, Ds[di], bits[bi], TQKV_ROT_HADAMARD, cen, bi & 1, TQKV_MODE_PROD,
                          &fields, &ties);
    fprintf(stderr, "frac/dense simd vs ref: %zu near-ties in %zu indices\n", ties, fields);
    ck_assert_msg(ties * 1000 <= fields, "%zu near-ties in %zu indices", ties, fields);
}
END_TEST

/* Outlier selection with exact energy ties across the n_hi boundary: the lowest-indexed
 * of the tied channels are taken (tqkv_energy_rank), fast and reference alike. */
START_TEST(test_outlier_ties)
{
    static const uint8_t bits[] = {3, 5, 7};
    for (size_t bi = 0; bi < sizeof bits; bi++)
        for (uint32_t D = 16; D <= 256; D *= 2) {
            const uint32_t T = 8;
            tqkv_block_shape_t s = {T, 1, D};
            tqkv_block_codec_t c = {0};
            uint16_t *x = malloc((size_t)T * D * 2);
            uint8_t *pg[2];
            size_t sz;
            double *en = malloc(sizeof(double) * D);
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t ch = 0; ch < D; ch++) {
                    /* three energy levels, many channels per level; level by a hash */
                    uint32_t lv = (ch * 2654435761u >> 7) % 3;
                    x[t * D + ch] = tqkv_f32_to_bf16((float)((lv + 1) * (t + 1)) *
                                                     ((t + ch) & 1 ? 1.0f : -1.0f));
                }
            c.k.bits_x2 = bits[bi];
            c.rotation = TQKV_ROT_HADAMARD;
            c.seed = 5;
            ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
            pg[0] = malloc(sz);
            pg[1] = malloc(sz);
            ck_assert_int_eq(tqkv_page_encode(&s, &c, x, NULL, pg[0], sz, NULL, NULL, 0), TQKV_OK);
            ck_assert_int_eq(tqkv_page_encode_ref(&s, &c, x, NULL, pg[1], sz, NULL, NULL, 0),
                             TQKV_OK);
            for (uint32_t ch = 0; ch < D; ch++) {
                en[ch] = 0;
                for (uint32_t t = 0; t < T; t++)
                    en[ch] +=
                        (double)tqkv_bf16_to_f32(x[t * D + ch]) * tqkv_bf16_to_f32(x[t * D + ch]);
            }
            for (int pi = 0; pi < 2; pi++) {
                const tqkv_page_header_t *h = (const tqkv_page_header_t *)pg[pi];
                const uint8_t *m = pg[pi] + h->tensor[0].mask_offset;
                uint32_t pc = 0;
                for (uint32_t ch = 0; ch < D; ch++) {
                    int in = (m[ch >> 3] >> (ch & 7)) & 1;
                    pc += (uint32_t)in;
                    ck_assert_int_eq(in, tqkv_energy_rank(en, D, ch) < h->tensor[0].n_hi);
                }
                ck_assert_uint_eq(pc, h->tensor[0].n_hi);
            }
            free(x);
            free(en);
            free(pg[0]);
            free(pg[1]);
        }
}
END_TEST

/* The key-statistics table (page_internal.h): every row the CPU can run equals the scalar
 * row, bit for bit (f64 sums in the same order; integer votes), on BF16 rows with outlier
 * channels, zero rows and awkward widths, with and without a mean. */
START_TEST(test_stats_kernels_vs_ref)
{
    static const uint32_t dims[] = {1, 7, 8, 16, 33, 127, 128, 129, 256};
    const tqkv__stats_kernels_t *ref = tqkv__stats_kernels(TQKV_ISA_SCALAR);
    const tqkv_cpu_t *c = tqkv_cpu_usable();
    const int top = c->avx512f ? TQKV_ISA_AVX512 : c->avx2 ? TQKV_ISA_AVX2 : TQKV_ISA_SCALAR;
    rng = tqkv_test_seed() + 17;
    ck_assert_int_eq(tqkv__stats_isa(), top);
    for (int isa = TQKV_ISA_AVX2; isa <= top; isa++) {
        const tqkv__stats_kernels_t *k = tqkv__stats_kernels((tqkv_isa_t)isa);
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const uint32_t D = dims[di], T = 37;
            uint16_t *x = malloc(sizeof(uint16_t) * T * D);
            float *mu = malloc(sizeof(float) * D);
            double *a0 = calloc(D, sizeof(double)), *a1 = calloc(D, sizeof(double));
            uint64_t v0, n0, v1, n1;
            uint16_t m0 = 0, m1 = 0;
            ck_assert_ptr_nonnull(x);
            ck_assert_ptr_nonnull(mu);
            ck_assert_ptr_nonnull(a0);
            ck_assert_ptr_nonnull(a1);
            for (uint32_t j = 0; j < D; j++)
                mu[j] = (float)tqkv_test_gauss(&rng) * (j % 5 == 2 ? 4.0f : 0.5f);
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t j = 0; j < D; j++)
                    x[t * D + j] = t % 11 == 4
                                       ? 0
                                       : tqkv_f32_to_bf16(
                                             (float)(tqkv_test_gauss(&rng) * (j % 7 == 3 ? 30 : 1) +
                                                     (t % 3 ? mu[j] : 0)));
            for (uint32_t t = 0; t < T; t++) {
                ref->energy(a0, x + t * D, t % 2 ? mu : NULL, D);
                k->energy(a1, x + t * D, t % 2 ? mu : NULL, D);
                m0 = ref->sum(a0, x + t * D, D, m0);
                m1 = k->sum(a1, x + t * D, D, m1);
            }
            ck_assert_int_eq(m0, m1);
            ck_assert_mem_eq(a0, a1, sizeof(double) * D);
            ref->votes(x, D, T, D, mu, &v0, &n0);
            k->votes(x, D, T, D, mu, &v1, &n1);
            ck_assert_uint_eq(v0, v1);
            ck_assert_uint_eq(n0, n1);
            ck_assert_uint_gt(n0, 0);
            free(x);
            free(mu);
            free(a0);
            free(a1);
        }
    }
}
END_TEST

static Suite *
pack_suite(void)
{
    Suite *s = suite_create("pack");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_bits_stream);
    tcase_add_test(tc, test_simd_vs_ref);
    tcase_add_test(tc, test_simd_special_rows);
    tcase_add_test(tc, test_simd_vs_ref_centered_fractional);
    tcase_add_test(tc, test_simd_decode_saturation);
    tcase_add_test(tc, test_simd_vs_ref_frac_dense);
    tcase_add_test(tc, test_outlier_ties);
    tcase_add_test(tc, test_stats_kernels_vs_ref);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(pack_suite)
