/* kivi.c - KIVI-style baseline quantizer: keys per channel, values per token, fp16 scale and
 * zero per group of 32. Used by `tqkv-codec attn-eval` as the comparison at equal bits. */
#include "kernels/kivi.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "kernels/tq_math.h"

uint16_t
tqkv_kivi_f32_to_f16(float f)
{
    uint32_t u, sign, mant;
    int32_t exp;
    memcpy(&u, &f, sizeof u);
    sign = (u >> 16) & 0x8000u;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (!(fabsf(f) < 65520.0f)) /* rounds to Inf in IEEE: saturate instead */
        return (uint16_t)(sign | 0x7bffu);
    exp = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    mant = u & 0x7fffffu;
    if (exp <= 0) { /* subnormal half (or zero) */
        uint32_t m, shift, r, half;
        if (exp < -10)
            return (uint16_t)sign;
        m = mant | 0x800000u;
        shift = (uint32_t)(14 - exp);
        r = m >> shift;
        half = 1u << (shift - 1);
        if ((m & ((half << 1) - 1)) > half || ((m & ((half << 1) - 1)) == half && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    {
        uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
        uint32_t rem = mant & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
            h++; /* may carry into the exponent: still correct */
        if (h >= 0x7c00u)
            h = 0x7bffu;
        return (uint16_t)(sign | h);
    }
}

float
tqkv_kivi_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    if (exp == 31) {
        uint32_t u = sign | 0x7f800000u | (mant << 13);
        memcpy(&f, &u, sizeof f);
        return f;
    }
    {
        uint32_t u = sign | ((exp + 112u) << 23) | (mant << 13);
        memcpy(&f, &u, sizeof f);
        return f;
    }
}

/* Quantizes n values x[i * stride] (i < n) of one group in place into out[i * stride]. */
static void
quant_group(const uint16_t *x, size_t stride, uint32_t n, uint32_t bits, float *out)
{
    float lo = INFINITY, hi = -INFINITY, scale, zero;
    float qmax = (float)((1u << bits) - 1u);
    for (uint32_t i = 0; i < n; i++) {
        float v = tqkv_bf16_to_f32(x[(size_t)i * stride]);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    zero = tqkv_kivi_f16_to_f32(tqkv_kivi_f32_to_f16(lo));
    scale = tqkv_kivi_f16_to_f32(tqkv_kivi_f32_to_f16((hi - lo) / qmax));
    for (uint32_t i = 0; i < n; i++) {
        float v = tqkv_bf16_to_f32(x[(size_t)i * stride]), q = 0.0f;
        if (scale > 0.0f) {
            q = nearbyintf((v - zero) / scale);
            q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
        }
        out[(size_t)i * stride] = q * scale + zero;
    }
}

tqkv_status_t
tqkv_kivi_roundtrip(const uint16_t *k_bf16, const uint16_t *v_bf16, uint32_t T, uint32_t H,
                    uint32_t D, uint32_t bits, uint32_t group, float *k_out, float *v_out,
                    double *k_bits_per_coord, double *v_bits_per_coord)
{
    size_t row = (size_t)H * D;
    uint64_t kgroups, vgroups, coords = (uint64_t)T * H * D;
    if (T == 0 || H == 0 || D == 0 || bits < 1 || bits > 8 || group == 0)
        return TQKV_EINVAL;
    if ((k_out && !k_bf16) || (v_out && !v_bf16))
        return TQKV_EINVAL;
    kgroups = (uint64_t)((T + group - 1) / group) * H * D;
    vgroups = (uint64_t)T * H * ((D + group - 1) / group);
    if (k_out)
        for (uint32_t t0 = 0; t0 < T; t0 += group) {
            uint32_t n = T - t0 < group ? T - t0 : group;
            for (size_t c = 0; c < row; c++)
                quant_group(k_bf16 + (size_t)t0 * row + c, row, n, bits,
                            k_out + (size_t)t0 * row + c);
        }
    if (v_out)
        for (size_t tv = 0; tv < (size_t)T * H; tv++)
            for (uint32_t c0 = 0; c0 < D; c0 += group) {
                uint32_t n = D - c0 < group ? D - c0 : group;
                quant_group(v_bf16 + tv * D + c0, 1, n, bits, v_out + tv * D + c0);
            }
    if (k_bits_per_coord)
        *k_bits_per_coord = bits + 32.0 * (double)kgroups / (double)coords;
    if (v_bits_per_coord)
        *v_bits_per_coord = bits + 32.0 * (double)vgroups / (double)coords;
    return TQKV_OK;
}
