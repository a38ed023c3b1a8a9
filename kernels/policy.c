/* policy.c - the KV codec policy of a namespace: measured defaults, checks, boundary layers.
 *
 * A policy is a plain value. The defaults were chosen with `tqkv-codec attn-eval` on the
 * synthetic harness (keys with outlier channels and per-channel offsets, T=4096, H=8,
 * D=128, HQ=32): the numbers that decided each default are in tqkv_policy_default.
 */
#include "kernels/policy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest boundary_layers accepted: far above any real model's depth. */
#define POLICY_MAX_BOUNDARY 4096u

void
tqkv_policy_default(tqkv_policy_t *p)
{
    memset(p, 0, sizeof *p);
    /* Middle layers: keys and values at 3 bits, mse, norm correction, key centering.
     * Measured with `tqkv-codec attn-eval` (synthetic, T=4096 H=8 D=128 HQ=32, blocks of
     * 256; seeds 1 and 2, peaks 1.0 and 0.6), output relative error / top-8 overlap:
     *   K3 V3 nc ctr    3.19 bits/coord (5.01x)  0.25-0.28 / 0.87-0.88   <- default
     *   K3 V3 (plain)   3.13 bits/coord (5.11x)  0.42-0.43 / 0.84-0.86
     *   K3.5 V2.5 nc ctr 3.20 bits/coord (5.00x) 0.32-0.33 / 0.89-0.93
     *   K3.5 V3 nc ctr  3.51 bits/coord (4.56x)  0.21-0.22 / 0.89-0.93
     *   K3p V3 nc ctr (QJL keys) 3.25 (4.92x)    0.50 / 0.66-0.70
     *   KIVI-2 3.00 (5.33x) 0.62-0.79;  KIVI-3 4.00 (4.00x) 0.27-0.35
     * Norm correction lowered the error in every mse row (e.g. K3 V3 0.43 -> 0.31), key
     * centering (0.125 bit/coord for the stored mean at 256-token blocks) lowered it further
     * with norm correction at every width (K3 V3 nc 0.31 -> 0.28, K4 V4 nc 0.158 -> 0.137),
     * prod keys doubled it at every width (QJL's variance is amplified by the softmax).
     * (bits/coord: page format v2, BF16 scales; errors measured on v1 f32 scales, which
     * moved them by -0.07% +- 0.07% on average.) A fractional width costs 0.25 bit/coord
     * of scales (two BF16 scales per vector), so 3.5 bits is 3.76 bits/coord against 4.13
     * for 4 bits; K3 V3 is the best point near 5x. */
    p->k.bits_x2 = 6;
    p->k.mode = TQKV_MODE_MSE;
    p->k.norm_correction = 1;
    p->v.bits_x2 = 6;
    p->v.mode = TQKV_MODE_MSE;
    p->v.norm_correction = 1;
    /* First and last 2 layers: 4 bits for both (K4 V4 nc ctr: 0.13-0.14, 3.82x). */
    p->k_boundary.bits_x2 = 8;
    p->k_boundary.mode = TQKV_MODE_MSE;
    p->k_boundary.norm_correction = 1;
    p->v_boundary.bits_x2 = 8;
    p->v_boundary.mode = TQKV_MODE_MSE;
    p->v_boundary.norm_correction = 1;
    p->boundary_layers = 2;
    p->rotation = TQKV_ROT_HADAMARD;
    p->key_centering = 1;
    p->seed = 0x7451564b43414348ull; /* "TQKVCACH" */
}

void
tqkv_policy_default_codec(tqkv_block_codec_t *out)
{
    tqkv_policy_t p;
    tqkv_policy_default(&p);
    /* layer boundary_layers of a model of unknown depth: the first middle layer */
    tqkv_policy_block_codec(&p, p.boundary_layers, 0, out);
}

static tqkv_status_t
check_tensor(const tqkv_tensor_codec_t *t, const char *name, char *err, size_t errlen)
{
    uint32_t hi, lo, nhi;
    if (tqkv_bits_split(t->bits_x2, 128, &hi, &lo, &nhi) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: bits_x2 %u is not one of 2,3,4,5,6,7,8 (1..4 bits)", name,
                     (unsigned)t->bits_x2);
        return TQKV_EINVAL;
    }
    if (t->mode != TQKV_MODE_MSE && t->mode != TQKV_MODE_PROD && t->mode != TQKV_MODE_RAW) {
        if (err && errlen)
            snprintf(err, errlen, "%s: mode %u is not mse (0), prod (1) or lossless (2)", name,
                     (unsigned)t->mode);
        return TQKV_EINVAL;
    }
    if (t->mode == TQKV_MODE_PROD && (hi < 2 || (lo != 0 && lo < 2))) {
        if (err && errlen)
            snprintf(err, errlen,
                     "%s: prod mode needs at least 2 bits in every channel group "
                     "(%.1f bits has a 1-bit group)",
                     name, t->bits_x2 / 2.0);
        return TQKV_EINVAL;
    }
    if (t->norm_correction > 1) {
        if (err && errlen)
            snprintf(err, errlen, "%s: norm_correction must be 0 or 1", name);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

tqkv_status_t
tqkv_policy_check(const tqkv_policy_t *p, char *err, size_t errlen)
{
    tqkv_status_t st;
    if (err && errlen)
        err[0] = '\0';
    if (!p) {
        if (err && errlen)
            snprintf(err, errlen, "policy is NULL");
        return TQKV_EINVAL;
    }
    if ((st = check_tensor(&p->k, "key", err, errlen)) != TQKV_OK)
        return st;
    if ((st = check_tensor(&p->v, "value", err, errlen)) != TQKV_OK)
        return st;
    if ((st = check_tensor(&p->k_boundary, "boundary key", err, errlen)) != TQKV_OK)
        return st;
    if ((st = check_tensor(&p->v_boundary, "boundary value", err, errlen)) != TQKV_OK)
        return st;
    if (p->boundary_layers > POLICY_MAX_BOUNDARY) {
        if (err && errlen)
            snprintf(err, errlen, "boundary_layers %u exceeds %u", p->boundary_layers,
                     POLICY_MAX_BOUNDARY);
        return TQKV_EINVAL;
    }
    if (p->rotation != TQKV_ROT_DENSE && p->rotation != TQKV_ROT_HADAMARD) {
        if (err && errlen)
            snprintf(err, errlen, "rotation %u is neither dense (0) nor hadamard (1)",
                     (unsigned)p->rotation);
        return TQKV_EINVAL;
    }
    if (p->key_centering > 1) {
        if (err && errlen)
            snprintf(err, errlen, "key_centering must be 0 or 1");
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

void
tqkv_tensor_codec_lossless(tqkv_tensor_codec_t *t)
{
    t->bits_x2 = TQKV_RAW_BITS_X2;
    t->mode = TQKV_MODE_RAW;
    t->norm_correction = 0;
}

void
tqkv_policy_block_codec(const tqkv_policy_t *p, uint32_t layer, uint32_t num_layers,
                        tqkv_block_codec_t *out)
{
    uint32_t n = p->boundary_layers;
    int boundary = layer < n;
    if (num_layers > 0 && n > 0 && (uint64_t)layer + n >= num_layers)
        boundary = 1;
    memset(out, 0, sizeof *out);
    out->k = boundary ? p->k_boundary : p->k;
    out->v = boundary ? p->v_boundary : p->v;
    /* a lossless tensor of the policy keeps its lossy bits (for when the mode changes back)
     * but is stored raw */
    if (out->k.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&out->k);
    if (out->v.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&out->v);
    out->rotation = p->rotation;
    out->key_centering = p->key_centering;
    out->seed = p->seed;
}

tqkv_status_t
tqkv_bits_from_float(float bits, uint8_t *bits_x2)
{
    float twice;
    if (!isfinite(bits))
        return TQKV_EINVAL;
    twice = bits * 2.0f;
    if (twice != floorf(twice) || twice < 2.0f || twice > 8.0f)
        return TQKV_EINVAL;
    *bits_x2 = (uint8_t)twice;
    return TQKV_OK;
}

tqkv_status_t
tqkv_bits_parse(const char *s, uint8_t *bits_x2)
{
    static const struct {
        const char *text;
        uint8_t x2;
    } names[] = {{"1", 2}, {"1.5", 3}, {"2", 4}, {"2.5", 5}, {"3", 6}, {"3.5", 7}, {"4", 8}};
    if (!s)
        return TQKV_EINVAL;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].text)) {
            *bits_x2 = names[i].x2;
            return TQKV_OK;
        }
    return TQKV_EINVAL;
}
