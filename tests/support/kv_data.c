/* kv_data.c - synthetic KV data for the test suites (see kv_data.h). */
#include "tests/support/kv_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cli/kv_synth.h"
#include "kernels/tq_math.h"
#include "tests/support/rng.h"
#include "transport/client.h"

void
tqkv_test_kv_loud(uint64_t *rng, uint16_t *x, uint64_t T, uint32_t H, uint32_t D, double offset)
{
    double *chs = malloc(sizeof(double) * H * D);
    if (chs == NULL)
        abort();
    for (uint32_t i = 0; i < H * D; i++)
        chs[i] = (tqkv_test_rand(rng) % 8 == 0) ? 8.0 * tqkv_test_unif(rng) + 2.0
                                                : 0.5 + tqkv_test_unif(rng);
    for (uint64_t t = 0; t < T; t++)
        for (uint32_t i = 0; i < H * D; i++)
            x[t * H * D + i] = tqkv_f32_to_bf16((float)(tqkv_test_gauss(rng) * chs[i] + offset));
    free(chs);
}

static double
unif_cb(void *state)
{
    return tqkv_test_unif(state);
}

static double
gauss_cb(void *state)
{
    return tqkv_test_gauss(state);
}

void
tqkv_test_kv_harness(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D, uint16_t *k, uint16_t *v)
{
    tqkv_synth_rng_t r = {unif_cb, gauss_cb, rng};
    tqkv_synth_kv(&r, T, H, D, k, v);
}

void
tqkv_test_kv_mix(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D, const uint8_t *mix_heads,
                 uint16_t *k, uint16_t *v)
{
    for (uint32_t h = 0; h < H; h++) {
        double sign = tqkv_test_unif(rng) < 0.5 ? -1.0 : 1.0;
        if (!mix_heads[h])
            continue;
        for (uint32_t t = 0; t < T; t++) {
            uint16_t *x = k + ((uint64_t)t * H + h) * D;
            double a = exp(tqkv_test_gauss(rng));
            uint32_t kind = (uint32_t)(tqkv_test_rand(rng) % 3);
            for (uint32_t j = 0; j < D; j++) {
                double y;
                if (kind == 0)
                    y = 0.0;
                else if (kind == 1)
                    y = a * sign;
                else
                    y = tqkv_test_gauss(rng) * (j % 37 == 5 ? 30.0 : 1.0);
                x[j] = tqkv_f32_to_bf16((float)y);
            }
            if (kind == 0)
                x[tqkv_test_rand(rng) % D] = tqkv_f32_to_bf16((float)(a * sign));
            for (uint32_t j = 0; v && j < D; j++)
                v[((uint64_t)t * H + h) * D + j] = tqkv_f32_to_bf16((float)tqkv_test_gauss(rng));
        }
    }
}

void
tqkv_test_q_harness(uint64_t *rng, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                    const uint16_t *k, float peak, float *q)
{
    tqkv_synth_rng_t r = {unif_cb, gauss_cb, rng};
    tqkv_synth_q(&r, HQ, H, D, T, k, peak, q);
}

void
tqkv_test_bf16_fill(uint64_t *rng, uint16_t *x, size_t n, size_t dim)
{
    for (size_t i = 0; i < n; i++) {
        double u = 0;
        for (int k = 0; k < 4; k++)
            u += tqkv_test_unif(rng);
        double scale = 1.0 + (double)((i % dim) % 7);
        x[i] = tqkv_f32_to_bf16((float)((u - 2.0) * 1.7 * scale));
    }
}

double
tqkv_test_bf16_rel_err(const uint16_t *x, const void *y, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, (const uint8_t *)y + 2 * i, 2);
        double a = tqkv_bf16_to_f32(x[i]), d = tqkv_bf16_to_f32(b) - a;
        e += d * d;
        s += a * a;
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

void
tqkv_test_block_data(const struct tqkv_hash *h, uint32_t layer, uint32_t T, uint32_t H, uint32_t D,
                     uint16_t *k, uint16_t *v)
{
    uint64_t s;
    memcpy(&s, h->bytes, 8);
    s ^= (uint64_t)(layer + 1) * 0x9E3779B97F4A7C15ull;
    size_t n = (size_t)T * H * D;
    tqkv_test_bf16_fill(&s, k, n, D);
    tqkv_test_bf16_fill(&s, v, n, D);
}

void
tqkv_test_hash(struct tqkv_hash *h, uint64_t a, uint64_t b, uint8_t len)
{
    uint64_t s = a * 1000003u + b;
    h->len = len;
    for (uint8_t i = 0; i < len; i++)
        h->bytes[i] = (uint8_t)tqkv_test_rand(&s);
}
