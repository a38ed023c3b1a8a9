/* kv_synth.h - the synthetic keys, values and queries of `tqkv-codec attn-eval` and
 * `attn-bench`, also the test suites' "harness" data (tests/support/kv_data.h), so the
 * suites measure on the data the tool reports on. One definition; each caller brings
 * its own random numbers (the tool's and the suites' generators differ in their
 * uniforms, and each keeps its own sequences).
 *
 * Layout: x[t][h][d], t < T tokens, h < H KV heads, d < D dimensions.
 */
#ifndef TQKV_KERNELS_CLI_KV_SYNTH_H
#define TQKV_KERNELS_CLI_KV_SYNTH_H

#include <stdint.h>

typedef struct tqkv_synth_rng {
    double (*unif)(void *state);  /* uniform in [0, 1) */
    double (*gauss)(void *state); /* N(0, 1) */
    void *state;
} tqkv_synth_rng_t;

/* Keys: per-channel offsets N(0, 0.5^2), 4 outlier channels per head with 5x amplitude
 * and an N(0, 4^2) offset, and a slow per-channel drift along tokens (like RoPE'd
 * keys); values N(0, 1) with no structure. Fills k[T][H][D] and v[T][H][D]. Aborts if
 * it cannot allocate its O(H*D) scratch. */
void tqkv_synth_kv(const tqkv_synth_rng_t *r, uint32_t T, uint32_t H, uint32_t D, uint16_t *k,
                   uint16_t *v);

/* Queries: each of the HQ query heads (HQ a multiple of H) aims at 4 random keys of its
 * KV head (centered by the head's key mean) with weights peak, 0.85 peak, ... that make
 * attention peaked but not one-hot, plus N(0, 0.3^2) noise. Reads k[T][H][D]; fills
 * q[HQ][D]. */
void tqkv_synth_q(const tqkv_synth_rng_t *r, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                  const uint16_t *k, float peak, float *q);

#endif
