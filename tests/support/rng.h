/* rng.h - the random numbers of the test suites: splitmix64 draws, uniforms and
 * Gaussians from one caller-held 64-bit state (seed it with tqkv_test_seed() from
 * tests/check_main.h, so a failure replays with TQKV_TEST_SEED).
 */
#ifndef TQKV_TESTS_SUPPORT_RNG_H
#define TQKV_TESTS_SUPPORT_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The next 64 random bits (splitmix64, the generator of kernels/tq_math.h). */
uint64_t tqkv_test_rand(uint64_t *state);

/* Uniform in the open interval (0, 1): 53 random bits plus one half, never 0 or 1. */
double tqkv_test_unif(uint64_t *state);

/* Standard normal N(0, 1) by Box-Muller: draws u, then v, returns
 * sqrt(-2 ln u) cos(2 pi v). */
double tqkv_test_gauss(uint64_t *state);

#ifdef __cplusplus
}
#endif

#endif
