/* kv_data.h - synthetic KV data for the test suites: BF16 key/value blocks with the
 * structure real KV caches have (loud channels, per-channel offsets, outliers, drift),
 * queries aimed at them, block hashes, and the error measure the suites compare with.
 *
 * Every generator draws from a caller-held splitmix64 state (tests/support/rng.h), so a
 * run replays from its TQKV_TEST_SEED. Layout: x[t][h][d], t < T tokens, h < H heads,
 * d < D dimensions.
 */
#ifndef TQKV_TESTS_SUPPORT_KV_DATA_H
#define TQKV_TESTS_SUPPORT_KV_DATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct tqkv_hash;

/* Gaussian channels, one in 8 of them loud (std 2..10, else 0.5..1.5), all shifted by
 * offset. The GPU suites' data. Fills x[T][H][D]. */
void tqkv_test_kv_loud(uint64_t *rng, uint16_t *x, uint64_t T, uint32_t H, uint32_t D,
                       double offset);

/* The harness data of `tqkv-codec attn-eval` (kernels/cli/kv_synth.h, one definition), so the
 * suites measure on the data the tool reports on. Keys: per-channel offsets
 * N(0, 0.5^2), 4 outlier channels per head with 5x amplitude and an N(0, 4^2) offset,
 * and a slow per-channel drift along tokens (like RoPE'd keys); values N(0, 1).
 * Fills k[T][H][D] and v[T][H][D]. */
void tqkv_test_kv_harness(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D, uint16_t *k,
                          uint16_t *v);

/* The structured mix of issue 24, on the heads h with mix_heads[h] != 0: each token is,
 * at random, one-hot (a e_j), constant (every channel a, one sign per head) or
 * outlier-channel (N(0, 1), channels j % 37 == 5 at 30x), a = exp(N(0, 1)): a block
 * whose per-channel mean dominates its small vectors. Other heads of k are left as
 * they are (fill them first, e.g. with tqkv_test_kv_harness). v (may be NULL): N(0, 1)
 * on the mix heads. Layout x[T][H][D]. */
void tqkv_test_kv_mix(uint64_t *rng, uint32_t T, uint32_t H, uint32_t D, const uint8_t *mix_heads,
                      uint16_t *k, uint16_t *v);

/* The attn-eval harness queries: each of the HQ query heads (HQ a multiple of H) aims at
 * 4 random keys of its KV head (centered by the head's key mean) with weights peak,
 * 0.85 peak, ... that make attention peaked but not one-hot, plus N(0, 0.3^2) noise.
 * Reads k[T][H][D]; fills q[HQ][D]. */
void tqkv_test_q_harness(uint64_t *rng, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                         const uint16_t *k, float peak, float *q);

/* n BF16 values, roughly N(0, 1) (a sum of 4 uniforms) times a per-channel scale of
 * 1..7 (channel = i % dim): the client and server suites' Put payloads. */
void tqkv_test_bf16_fill(uint64_t *rng, uint16_t *x, size_t n, size_t dim);

/* Relative L2 error of BF16 y against BF16 x, n elements each (y may be unaligned, as
 * a Get callback's bytes are). */
double tqkv_test_bf16_rel_err(const uint16_t *x, const void *y, size_t n);

/* The BF16 K and V of a test block as a function of its hash and layer (seeded by the
 * hash's first 8 bytes and the layer; tqkv_test_bf16_fill), so a page read back from
 * any server can be checked: k and v get T*H*D values each. */
void tqkv_test_block_data(const struct tqkv_hash *h, uint32_t layer, uint32_t T, uint32_t H,
                          uint32_t D, uint16_t *k, uint16_t *v);

/* A block hash of len bytes (8..64) that is a function of (a, b): h->len = len and
 * h->bytes[0..len) pseudo-random. */
void tqkv_test_hash(struct tqkv_hash *h, uint64_t a, uint64_t b, uint8_t len);

#ifdef __cplusplus
}
#endif

#endif
