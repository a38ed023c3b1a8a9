/* kv_synth.c - synthetic KV and queries (see kv_synth.h). */
#include "kernels/cli/kv_synth.h"

#include <math.h>
#include <stdlib.h>

#include "kernels/tq_math.h"

#define UNIF(r) ((r)->unif((r)->state))
#define GAUSS(r) ((r)->gauss((r)->state))

void
tqkv_synth_kv(const tqkv_synth_rng_t *r, uint32_t T, uint32_t H, uint32_t D, uint16_t *k,
              uint16_t *v)
{
    size_t HD = (size_t)H * D;
    float *off = malloc(sizeof(float) * HD), *amp = malloc(sizeof(float) * HD);
    float *freq = malloc(sizeof(float) * HD);
    if (off == NULL || amp == NULL || freq == NULL)
        abort();
    for (size_t i = 0; i < HD; i++) {
        off[i] = (float)(0.5 * GAUSS(r));
        amp[i] = 1.0f;
        freq[i] = (float)(UNIF(r) * 0.05);
    }
    for (uint32_t h = 0; h < H; h++)
        for (int o = 0; o < 4; o++) {
            uint32_t c = (uint32_t)(UNIF(r) * D) % D;
            amp[(size_t)h * D + c] = 5.0f;
            off[(size_t)h * D + c] = (float)(4.0 * GAUSS(r));
        }
    for (uint64_t t = 0; t < T; t++)
        for (size_t i = 0; i < HD; i++) {
            float drift = 0.5f * sinf(freq[i] * (float)t);
            k[t * HD + i] = tqkv_f32_to_bf16(off[i] + drift + amp[i] * (float)GAUSS(r));
            v[t * HD + i] = tqkv_f32_to_bf16((float)GAUSS(r));
        }
    free(off);
    free(amp);
    free(freq);
}

void
tqkv_synth_q(const tqkv_synth_rng_t *r, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
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
            qh[d] = (float)(0.3 * GAUSS(r));
        for (int j = 0; j < 4; j++) {
            uint32_t t = (uint32_t)(UNIF(r) * T) % T;
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
