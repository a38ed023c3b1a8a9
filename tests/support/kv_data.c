/* kv_data.c - synthetic KV data for the test suites (see kv_data.h). */
#include "tests/support/kv_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

void
tqkv_test_kv_harness(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D, uint16_t *k, uint16_t *v)
{
    size_t HD = (size_t)H * D;
    float *off = malloc(sizeof(float) * HD), *amp = malloc(sizeof(float) * HD);
    float *freq = malloc(sizeof(float) * HD);
    if (off == NULL || amp == NULL || freq == NULL)
        abort();
    for (size_t i = 0; i < HD; i++) {
        off[i] = (float)(0.5 * tqkv_test_gauss(rng));
        amp[i] = 1.0f;
        freq[i] = (float)(tqkv_test_unif(rng) * 0.05);
    }
    for (uint32_t h = 0; h < H; h++)
        for (int o = 0; o < 4; o++) {
            uint32_t c = (uint32_t)(tqkv_test_unif(rng) * D) % D;
            amp[(size_t)h * D + c] = 5.0f;
            off[(size_t)h * D + c] = (float)(4.0 * tqkv_test_gauss(rng));
        }
    for (uint64_t t = 0; t < T; t++)
        for (size_t i = 0; i < HD; i++) {
            float drift = 0.5f * sinf(freq[i] * (float)t);
            k[t * HD + i] = tqkv_f32_to_bf16(off[i] + drift + amp[i] * (float)tqkv_test_gauss(rng));
            v[t * HD + i] = tqkv_f32_to_bf16((float)tqkv_test_gauss(rng));
        }
    free(off);
    free(amp);
    free(freq);
}

void
tqkv_test_q_harness(uint64_t *rng, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                    const uint16_t *k, float peak, float *q)
{
    uint32_t G = HQ / H;
    double *mean = calloc((size_t)H * D, sizeof(double));
    if (mean == NULL)
        abort();
    for (uint64_t t = 0; t < T; t++)
        for (size_t i = 0; i < (size_t)H * D; i++)
            mean[i] += tqkv_bf16_to_f32(k[t * H * D + i]);
    for (size_t i = 0; i < (size_t)H * D; i++)
        mean[i] /= T;
    for (uint32_t hq = 0; hq < HQ; hq++) {
        uint32_t h = hq / G;
        float *qh = q + (size_t)hq * D;
        for (uint32_t d = 0; d < D; d++)
            qh[d] = (float)(0.3 * tqkv_test_gauss(rng));
        for (int j = 0; j < 4; j++) {
            uint32_t t = (uint32_t)(tqkv_test_unif(rng) * T) % T;
            double nrm = 0.0, w = peak * (1.0 - 0.15 * j);
            for (uint32_t d = 0; d < D; d++) {
                double x =
                    tqkv_bf16_to_f32(k[((size_t)t * H + h) * D + d]) - mean[(size_t)h * D + d];
                nrm += x * x;
            }
            nrm = sqrt(nrm) + 1e-12;
            for (uint32_t d = 0; d < D; d++) {
                double x =
                    tqkv_bf16_to_f32(k[((size_t)t * H + h) * D + d]) - mean[(size_t)h * D + d];
                qh[d] += (float)(w * sqrt((double)D) * x / nrm);
            }
        }
    }
    free(mean);
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
tqkv_test_hash(struct tqkv_hash *h, uint64_t a, uint64_t b, uint8_t len)
{
    uint64_t s = a * 1000003u + b;
    h->len = len;
    for (uint8_t i = 0; i < len; i++)
        h->bytes[i] = (uint8_t)tqkv_test_rand(&s);
}
