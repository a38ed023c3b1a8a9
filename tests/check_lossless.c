/* check_lossless.c - the lossless page mode (TQKV_MODE_RAW, proto/PAGE_FORMAT.md): BF16 kept
 * as is in the page. Encode -> decode returns the input bytes exactly (every SIMD level,
 * shapes with odd heads, non-power-of-two dims, one token), the layout and the header are
 * what the format says, K lossy + V lossless (and the reverse) decode each tensor as its
 * mode says, bad combinations are refused with a reason, damaged raw sections and headers
 * are refused by validation, and fused attention over lossless pages equals BF16 attention
 * (tqkv_attn_bf16_ref) within float rounding, fast path and reference alike, also in a
 * sequence that mixes lossless, lossy and half-lossless pages.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/rng.h"

static tqkv_block_codec_t
lossless_codec(int k_raw, int v_raw)
{
    tqkv_block_codec_t c;
    tqkv_policy_default_codec(&c);
    if (k_raw)
        tqkv_tensor_codec_lossless(&c.k);
    if (v_raw)
        tqkv_tensor_codec_lossless(&c.v);
    return c;
}

/* Encodes k, v with codec into a new page (fast or reference encoder); *len its size. */
static uint8_t *
encode(const tqkv_block_shape_t *s, const tqkv_block_codec_t *c, const uint16_t *k,
       const uint16_t *v, size_t *len, int ref)
{
    size_t cap, w = 0;
    char err[200] = "";
    ck_assert_int_eq(tqkv_page_size(s, c, &cap), TQKV_OK);
    uint8_t *p = malloc(cap);
    ck_assert_ptr_nonnull(p);
    tqkv_status_t st = ref ? tqkv_page_encode_ref(s, c, k, v, p, cap, &w, err, sizeof err)
                           : tqkv_page_encode(s, c, k, v, p, cap, &w, err, sizeof err);
    ck_assert_msg(st == TQKV_OK, "encode: %s", err);
    ck_assert_uint_eq(w, cap);
    *len = w;
    return p;
}

static uint16_t *
bf16_block(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D)
{
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)T * H * D);
    ck_assert_ptr_nonnull(x);
    tqkv_test_bf16_fill(rng, x, (size_t)T * H * D, D);
    return x;
}

START_TEST(test_round_trip)
{
    static const tqkv_block_shape_t shapes[] = {
        {256, 8, 128}, {1, 1, 16}, {257, 3, 100}, {16, 2, 1024}, {33, 5, 64}};
    uint64_t rng = tqkv_test_seed() ^ 0x1055;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const tqkv_block_shape_t *s = &shapes[si];
        const size_t cnt = (size_t)s->num_tokens * s->num_kv_heads * s->head_dim;
        uint16_t *k = bf16_block(&rng, s->num_tokens, s->num_kv_heads, s->head_dim);
        uint16_t *v = bf16_block(&rng, s->num_tokens, s->num_kv_heads, s->head_dim);
        /* signed zeros, subnormals, the largest finite values: kept bit for bit */
        k[0] = 0x8000u;
        v[0] = 0x0001u;
        k[cnt - 1] = 0x7f7fu;
        v[cnt - 1] = 0xff7fu;
        tqkv_block_codec_t c = lossless_codec(1, 1);
        c.key_centering = 1; /* requested, but a lossless K has no mean to subtract */
        for (int ref = 0; ref < 2; ref++) {
            size_t len;
            uint8_t *p = encode(s, &c, k, v, &len, ref);
            const uint64_t sec = tqkv_align_up(2 * cnt, TQKV_PAGE_ALIGN);
            ck_assert_uint_eq(len, TQKV_PAGE_HEADER_BYTES + 2 * sec);
            const tqkv_page_header_t *h = (const tqkv_page_header_t *)p;
            ck_assert_uint_eq(h->flags, 0);
            ck_assert_uint_eq(h->mean_offset, 0);
            for (int t = 0; t < 2; t++) {
                const tqkv_page_tensor_desc_t *d = &h->tensor[t];
                ck_assert_uint_eq(d->mode, TQKV_MODE_RAW);
                ck_assert_uint_eq(d->bits_x2, TQKV_RAW_BITS_X2);
                ck_assert_uint_eq(d->hi_bits, 16);
                ck_assert_uint_eq(d->lo_bits, 0);
                ck_assert_uint_eq(d->n_hi, s->head_dim);
                ck_assert_uint_eq(d->flags, 0);
                ck_assert_uint_eq(d->mask_offset, 0);
                ck_assert_uint_eq(d->group_offset[0], TQKV_PAGE_HEADER_BYTES + t * sec);
                ck_assert_uint_eq(d->group_bytes[0], sec);
                ck_assert_uint_eq(d->group_offset[1], 0);
                ck_assert_uint_eq(d->group_bytes[1], 0);
            }
            /* the raw sections are the input bytes */
            ck_assert_mem_eq(p + h->tensor[0].group_offset[0], k, 2 * cnt);
            ck_assert_mem_eq(p + h->tensor[1].group_offset[0], v, 2 * cnt);

            tqkv_page_info_t info;
            char why[200] = "";
            ck_assert_msg(tqkv_page_validate(p, len, 1, &info, why, sizeof why) == TQKV_OK, "%s",
                          why);
            ck_assert_uint_eq(info.codec.k.mode, TQKV_MODE_RAW);
            ck_assert_uint_eq(info.codec.v.bits_x2, TQKV_RAW_BITS_X2);
            ck_assert_uint_eq(info.codec.key_centering, 0);
            ck_assert_uint_eq(info.bf16_bytes, 4 * cnt);
            ck_assert_uint_eq(info.page_bytes, len);

            uint16_t *kh = malloc(2 * cnt), *vh = malloc(2 * cnt);
            float *kf = malloc(4 * cnt), *vf = malloc(4 * cnt);
            float *kr = malloc(4 * cnt), *vr = malloc(4 * cnt);
            ck_assert_int_eq(tqkv_page_decode_bf16(p, len, kh, vh), TQKV_OK);
            ck_assert_mem_eq(kh, k, 2 * cnt);
            ck_assert_mem_eq(vh, v, 2 * cnt);
            ck_assert_int_eq(tqkv_page_decode_f32(p, len, kf, vf), TQKV_OK);
            ck_assert_int_eq(tqkv_page_decode_f32_ref(p, len, kr, vr), TQKV_OK);
            for (size_t i = 0; i < cnt; i++) {
                float ek = tqkv_bf16_to_f32(k[i]), ev = tqkv_bf16_to_f32(v[i]);
                ck_assert_mem_eq(&kf[i], &ek, 4);
                ck_assert_mem_eq(&vf[i], &ev, 4);
                ck_assert_mem_eq(&kr[i], &ek, 4);
                ck_assert_mem_eq(&vr[i], &ev, 4);
            }
            free(kh);
            free(vh);
            free(kf);
            free(vf);
            free(kr);
            free(vr);
            free(p);
        }
        free(k);
        free(v);
    }
}
END_TEST

/* K lossy + V lossless and the reverse: the lossless tensor decodes to its input, the lossy
 * one to exactly what the all-lossy page decodes it to (its encoding does not depend on the
 * other tensor). */
START_TEST(test_mixed)
{
    const tqkv_block_shape_t s = {130, 4, 128};
    const size_t cnt = (size_t)s.num_tokens * s.num_kv_heads * s.head_dim;
    uint64_t rng = tqkv_test_seed() ^ 0x3131;
    uint16_t *k = malloc(2 * cnt), *v = malloc(2 * cnt);
    tqkv_test_kv_harness(&rng, s.num_tokens, s.num_kv_heads, s.head_dim, k, v);
    size_t lossy_len;
    tqkv_block_codec_t lossy = lossless_codec(0, 0);
    uint8_t *pl = encode(&s, &lossy, k, v, &lossy_len, 0);
    float *ref_k = malloc(4 * cnt), *ref_v = malloc(4 * cnt);
    ck_assert_int_eq(tqkv_page_decode_f32(pl, lossy_len, ref_k, ref_v), TQKV_OK);
    for (int raw_t = 0; raw_t < 2; raw_t++) {
        tqkv_block_codec_t c = lossless_codec(raw_t == 0, raw_t == 1);
        size_t len;
        uint8_t *p = encode(&s, &c, k, v, &len, 0);
        const tqkv_page_header_t *h = (const tqkv_page_header_t *)p;
        /* centering applies to a lossy K only */
        ck_assert_uint_eq(h->flags & TQKV_PAGE_KEY_CENTERED, raw_t == 1 ? 1 : 0);
        ck_assert_int_eq(tqkv_page_validate(p, len, 1, NULL, NULL, 0), TQKV_OK);
        uint16_t *oh = malloc(2 * cnt);
        float *of = malloc(4 * cnt);
        ck_assert_int_eq(
            tqkv_page_decode_bf16(p, len, raw_t == 0 ? oh : NULL, raw_t == 1 ? oh : NULL), TQKV_OK);
        ck_assert_mem_eq(oh, raw_t == 0 ? k : v, 2 * cnt);
        ck_assert_int_eq(
            tqkv_page_decode_f32(p, len, raw_t == 1 ? of : NULL, raw_t == 0 ? of : NULL), TQKV_OK);
        ck_assert_mem_eq(of, raw_t == 0 ? ref_v : ref_k, 4 * cnt);
        free(oh);
        free(of);
        free(p);
    }
    free(pl);
    free(ref_k);
    free(ref_v);
    free(k);
    free(v);
}
END_TEST

START_TEST(test_bad_params)
{
    const tqkv_block_shape_t s = {16, 2, 64};
    uint64_t rng = tqkv_test_seed() ^ 0xbad;
    uint16_t *k = bf16_block(&rng, 16, 2, 64), *v = bf16_block(&rng, 16, 2, 64);
    char err[200];
    size_t sz;
    tqkv_block_codec_t c = lossless_codec(1, 1);

    c.k.bits_x2 = 6; /* lossless with a bit width */
    err[0] = '\0';
    ck_assert_int_eq(tqkv_page_check_params(&s, &c, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "K:") && strstr(err, "no bit width"), "%s", err);
    ck_assert_int_ne(tqkv_page_size(&s, &c, &sz), TQKV_OK);

    c = lossless_codec(1, 1);
    c.v.norm_correction = 1;
    err[0] = '\0';
    ck_assert_int_eq(tqkv_page_check_params(&s, &c, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "V:") && strstr(err, "norm correction"), "%s", err);

    c = lossless_codec(0, 0);
    c.k.bits_x2 = TQKV_RAW_BITS_X2; /* 16 bits is the lossless mode, not an mse width */
    err[0] = '\0';
    ck_assert_int_eq(tqkv_page_check_params(&s, &c, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "lossless"), "%s", err);

    c = lossless_codec(1, 1);
    c.k.mode = 3; /* no such mode */
    ck_assert_int_ne(tqkv_page_check_params(&s, &c, NULL, 0), TQKV_OK);

    /* NaN / Inf input is refused as for lossy pages, with its position */
    c = lossless_codec(1, 1);
    v[2 * 64 + 5] = 0x7fc0u; /* token 1, head 0, channel 5 */
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    uint8_t *p = malloc(sz);
    err[0] = '\0';
    ck_assert_int_eq(tqkv_page_encode(&s, &c, k, v, p, sz, NULL, err, sizeof err), TQKV_ERANGE);
    ck_assert_msg(strstr(err, "V:") && strstr(err, "token 1"), "%s", err);

    /* the policy: a lossless tensor keeps its bits, hands out the raw codec */
    tqkv_policy_t pol;
    tqkv_block_codec_t bc;
    tqkv_policy_default(&pol);
    pol.v.mode = pol.v_boundary.mode = TQKV_MODE_RAW;
    ck_assert_int_eq(tqkv_policy_check(&pol, err, sizeof err), TQKV_OK);
    tqkv_policy_block_codec(&pol, 5, 32, &bc);
    ck_assert_uint_eq(bc.v.mode, TQKV_MODE_RAW);
    ck_assert_uint_eq(bc.v.bits_x2, TQKV_RAW_BITS_X2);
    ck_assert_uint_eq(bc.v.norm_correction, 0);
    ck_assert_uint_eq(bc.k.mode, TQKV_MODE_MSE);
    ck_assert_uint_eq(pol.v.bits_x2, 6);
    ck_assert_int_eq(tqkv_page_check_params(&s, &bc, NULL, 0), TQKV_OK);
    free(p);
    free(k);
    free(v);
}
END_TEST

/* Re-seals a damaged page with a correct CRC, so validation must find the damage itself. */
static void
reseal(uint8_t *p, size_t len)
{
    uint32_t crc = tqkv_page_crc(p, len);
    memcpy(p + 12, &crc, 4);
}

START_TEST(test_validate_damage)
{
    const tqkv_block_shape_t s = {20, 2, 32};
    uint64_t rng = tqkv_test_seed() ^ 0xda;
    uint16_t *k = bf16_block(&rng, 20, 2, 32), *v = bf16_block(&rng, 20, 2, 32);
    tqkv_block_codec_t c = lossless_codec(1, 1);
    size_t len;
    uint8_t *p = encode(&s, &c, k, v, &len, 0), *q = malloc(len);
    tqkv_page_header_t *h = (tqkv_page_header_t *)q;
    char why[200];

    /* a NaN in the V section */
    memcpy(q, p, len);
    memcpy(q + h->tensor[1].group_offset[0] + 2 * 77, &(uint16_t){0x7fc1u}, 2);
    reseal(q, len);
    why[0] = '\0';
    ck_assert_int_eq(tqkv_page_validate(q, len, 1, NULL, why, sizeof why), TQKV_ECORRUPT);
    ck_assert_msg(strstr(why, "V:") && strstr(why, "NaN or Inf"), "%s", why);
    {
        uint16_t *out = malloc(2 * (size_t)20 * 2 * 32);
        ck_assert_int_eq(tqkv_page_decode_bf16(q, len, NULL, out), TQKV_ECORRUPT);
        free(out);
    }

    /* an Inf in the K section */
    memcpy(q, p, len);
    memcpy(q + h->tensor[0].group_offset[0], &(uint16_t){0xff80u}, 2);
    reseal(q, len);
    ck_assert_int_eq(tqkv_page_validate(q, len, 1, NULL, NULL, 0), TQKV_ECORRUPT);

    /* the key-centered flag with a lossless K */
    memcpy(q, p, len);
    h->flags = TQKV_PAGE_KEY_CENTERED;
    reseal(q, len);
    why[0] = '\0';
    ck_assert_int_eq(tqkv_page_validate(q, len, 1, NULL, why, sizeof why), TQKV_EFORMAT);
    ck_assert_msg(strstr(why, "lossless"), "%s", why);

    /* raw mode with a lossy bit width, a lossy mode with 16 bits, norm correction, mode 3 */
    const struct {
        uint8_t mode, bits_x2, flags;
    } bad[] = {{TQKV_MODE_RAW, 6, 0},
               {TQKV_MODE_MSE, TQKV_RAW_BITS_X2, 0},
               {TQKV_MODE_RAW, TQKV_RAW_BITS_X2, TQKV_TENSOR_NORM_CORRECTED},
               {3, TQKV_RAW_BITS_X2, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memcpy(q, p, len);
        h->tensor[1].mode = bad[i].mode;
        h->tensor[1].bits_x2 = bad[i].bits_x2;
        h->tensor[1].flags = bad[i].flags;
        reseal(q, len);
        ck_assert_msg(tqkv_page_validate(q, len, 1, NULL, NULL, 0) == TQKV_EFORMAT, "case %zu", i);
    }
    /* a section size or offset that is not the layout */
    memcpy(q, p, len);
    h->tensor[0].group_bytes[0] += 64;
    reseal(q, len);
    ck_assert_int_eq(tqkv_page_validate(q, len, 1, NULL, NULL, 0), TQKV_EFORMAT);
    memcpy(q, p, len);
    h->tensor[0].n_hi = 16;
    reseal(q, len);
    ck_assert_int_eq(tqkv_page_validate(q, len, 1, NULL, NULL, 0), TQKV_EFORMAT);
    /* truncated */
    ck_assert_int_eq(tqkv_page_validate(p, len - 64, 1, NULL, NULL, 0), TQKV_EFORMAT);
    free(p);
    free(q);
    free(k);
    free(v);
}
END_TEST

static double
rel_err(const float *o, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)o[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0.0 ? den : 1e-300));
}

/* Fused attention over lossless pages (several pages, split-K, threads, every ISA cap) and its
 * reference equal BF16 attention over the same keys and values. */
START_TEST(test_attention_lossless)
{
    const uint32_t T = 700, H = 4, D = 128, HQ = 16, blk[] = {256, 256, 188};
    const size_t cnt = (size_t)T * H * D;
    uint64_t rng = tqkv_test_seed() ^ 0xa77;
    uint16_t *k = malloc(2 * cnt), *v = malloc(2 * cnt);
    float *q = malloc(sizeof(float) * HQ * D), *want = malloc(sizeof(float) * HQ * D);
    float *got = malloc(sizeof(float) * HQ * D);
    tqkv_test_kv_harness(&rng, T, H, D, k, v);
    tqkv_test_q_harness(&rng, HQ, H, D, T, k, 1.0f, q);
    ck_assert_int_eq(tqkv_attn_bf16_ref(q, HQ, k, v, T, H, D, want), TQKV_OK);

    tqkv_block_codec_t c = lossless_codec(1, 1);
    const void *pages[3];
    size_t lens[3];
    uint32_t t0 = 0;
    for (int i = 0; i < 3; i++) {
        tqkv_block_shape_t s = {blk[i], H, D};
        pages[i] = encode(&s, &c, k + (size_t)t0 * H * D, v + (size_t)t0 * H * D, &lens[i], 0);
        t0 += blk[i];
    }
    ck_assert_int_eq(tqkv_attn_decode_ref(q, HQ, pages, lens, 3, NULL, got), TQKV_OK);
    ck_assert_msg(rel_err(got, want, HQ * D) <= 1e-6, "ref rel err %.3g",
                  rel_err(got, want, HQ * D));
    const int caps[] = {TQKV_ATTN_ISA_BEST, TQKV_ATTN_ISA_AVX2, TQKV_ATTN_ISA_SCALAR};
    for (size_t ci = 0; ci < 3; ci++) {
        tqkv_attn_set_isa_cap(caps[ci]);
        for (uint32_t split = 0; split <= 300; split += 300)
            for (uint32_t th = 1; th <= 3; th += 2) {
                tqkv_attn_opts_t o;
                char err[200] = "";
                tqkv_attn_opts_default(&o);
                o.split_tokens = split;
                o.num_threads = th;
                o.check_crc = 1;
                ck_assert_msg(
                    tqkv_attn_decode_ex(q, HQ, pages, lens, 3, &o, got, err, sizeof err) == TQKV_OK,
                    "%s", err);
                double e = rel_err(got, want, HQ * D);
                ck_assert_msg(e <= 1e-5, "%s split %u threads %u: rel err %.3g", tqkv_attn_isa(),
                              split, th, e);
            }
    }
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
    for (int i = 0; i < 3; i++)
        free((void *)pages[i]);
    free(k);
    free(v);
    free(q);
    free(want);
    free(got);
}
END_TEST

/* Attention over f32 K and V ([T][H][D], query head hq reads KV head hq / (HQ / H)), in
 * double as tqkv_attn_bf16_ref does for BF16. */
static void
attn_f32(const float *q, uint32_t HQ, const float *k, const float *v, uint32_t T, uint32_t H,
         uint32_t D, float *out)
{
    double *s = malloc(sizeof(double) * T), *o = malloc(sizeof(double) * D);
    ck_assert(s && o);
    for (uint32_t hq = 0; hq < HQ; hq++) {
        uint32_t h = hq / (HQ / H);
        double mx = -INFINITY, L = 0.0;
        for (uint32_t t = 0; t < T; t++) {
            double dot = 0.0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)q[(size_t)hq * D + d] * k[((size_t)t * H + h) * D + d];
            s[t] = dot / sqrt((double)D);
            mx = s[t] > mx ? s[t] : mx;
        }
        memset(o, 0, sizeof(double) * D);
        for (uint32_t t = 0; t < T; t++) {
            double p = exp(s[t] - mx);
            L += p;
            for (uint32_t d = 0; d < D; d++)
                o[d] += p * v[((size_t)t * H + h) * D + d];
        }
        for (uint32_t d = 0; d < D; d++)
            out[(size_t)hq * D + d] = (float)(o[d] / L);
    }
    free(s);
    free(o);
}

/* A sequence of a lossless page, a K-lossless page, a V-lossless page and a lossy page: the
 * fused path (every ISA cap) equals its reference as for lossy pages (1e-5), and the
 * reference's lossless parts are exact: with every page lossless in K or V, swapping the
 * lossy tensor for its own decode gives the same attention. */
START_TEST(test_attention_mixed)
{
    const uint32_t H = 2, D = 64, HQ = 8, B = 96, NP = 4, T = B * NP;
    const size_t cnt = (size_t)T * H * D, bc = (size_t)B * H * D;
    uint64_t rng = tqkv_test_seed() ^ 0x313;
    uint16_t *k = malloc(2 * cnt), *v = malloc(2 * cnt);
    float *kd = malloc(sizeof(float) * cnt), *vd = malloc(sizeof(float) * cnt);
    float *q = malloc(sizeof(float) * HQ * D), *ref = malloc(sizeof(float) * HQ * D);
    float *got = malloc(sizeof(float) * HQ * D), *want = malloc(sizeof(float) * HQ * D);
    tqkv_test_kv_harness(&rng, T, H, D, k, v);
    tqkv_test_q_harness(&rng, HQ, H, D, T, k, 1.0f, q);
    const void *pages[4];
    size_t lens[4];
    for (uint32_t i = 0; i < NP; i++) {
        tqkv_block_shape_t s = {B, H, D};
        tqkv_block_codec_t c = lossless_codec(i == 0 || i == 1, i == 0 || i == 2);
        pages[i] = encode(&s, &c, k + i * bc, v + i * bc, &lens[i], 0);
        /* the f32 each page gives back (lossy parts decoded, lossless parts exact) */
        ck_assert_int_eq(tqkv_page_decode_f32(pages[i], lens[i], kd + i * bc, vd + i * bc),
                         TQKV_OK);
    }
    ck_assert_int_eq(tqkv_attn_decode_ref(q, HQ, pages, lens, NP, NULL, ref), TQKV_OK);
    /* decode-then-attend in f32 gives the reference's attention (f32 rounding only; a
     * BF16 decode is not the reference: its rounding moves softmax by up to ~1.5e-2) */
    attn_f32(q, HQ, kd, vd, T, H, D, want);
    ck_assert_msg(rel_err(ref, want, HQ * D) <= 1e-5, "ref vs decoded: %.3g",
                  rel_err(ref, want, HQ * D));
    const int caps[] = {TQKV_ATTN_ISA_BEST, TQKV_ATTN_ISA_AVX2, TQKV_ATTN_ISA_SCALAR};
    for (size_t ci = 0; ci < 3; ci++) {
        tqkv_attn_set_isa_cap(caps[ci]);
        for (uint32_t split = 0; split <= 50; split += 50) {
            tqkv_attn_opts_t o;
            tqkv_attn_opts_default(&o);
            o.split_tokens = split;
            ck_assert_int_eq(tqkv_attn_decode(q, HQ, pages, lens, NP, &o, got), TQKV_OK);
            double e = rel_err(got, ref, HQ * D);
            ck_assert_msg(e <= 1e-5, "%s split %u: fused vs ref rel err %.3g", tqkv_attn_isa(),
                          split, e);
        }
    }
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
    /* the lossless page alone: exactly BF16 attention */
    ck_assert_int_eq(tqkv_attn_decode_ref(q, HQ, pages, lens, 1, NULL, got), TQKV_OK);
    ck_assert_int_eq(tqkv_attn_bf16_ref(q, HQ, k, v, B, H, D, want), TQKV_OK);
    ck_assert_msg(rel_err(got, want, HQ * D) <= 1e-6, "page 0: %.3g", rel_err(got, want, HQ * D));
    for (uint32_t i = 0; i < NP; i++)
        free((void *)pages[i]);
    free(k);
    free(v);
    free(kd);
    free(vd);
    free(q);
    free(ref);
    free(got);
    free(want);
}
END_TEST

static Suite *
lossless_suite(void)
{
    Suite *s = suite_create("lossless");
    TCase *tc = tcase_create("page");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_mixed);
    tcase_add_test(tc, test_bad_params);
    tcase_add_test(tc, test_validate_damage);
    suite_add_tcase(s, tc);
    tc = tcase_create("attention");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_attention_lossless);
    tcase_add_test(tc, test_attention_mixed);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(lossless_suite)
