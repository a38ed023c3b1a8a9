/* rng.c - the random numbers of the test suites (see rng.h). */
#include "tests/support/rng.h"

#include <math.h>

#include "kernels/tq_math.h"

uint64_t
tqkv_test_rand(uint64_t *state)
{
    return tqkv_splitmix64(state);
}

double
tqkv_test_unif(uint64_t *state)
{
    return ((double)(tqkv_splitmix64(state) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

double
tqkv_test_gauss(uint64_t *state)
{
    double u = tqkv_test_unif(state);
    double v = tqkv_test_unif(state);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
