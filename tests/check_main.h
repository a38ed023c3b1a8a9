/* check_main.h - main() for a Check suite binary: TQKV_CHECK_MAIN(codec_suite).
 *
 * Prints the random seed used (tests draw fresh inputs; set TQKV_TEST_SEED to
 * replay one) and exits non-zero on any failure.
 */
#ifndef TQKV_TESTS_CHECK_MAIN_H
#define TQKV_TESTS_CHECK_MAIN_H

#include <check.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* The seed of this run: TQKV_TEST_SEED if set, else time-based. Printed once. */
static inline uint64_t
tqkv_test_seed(void)
{
    static uint64_t seed;
    static int done;
    if (!done) {
        const char *e = getenv("TQKV_TEST_SEED");
        seed = e ? strtoull(e, NULL, 0) : ((uint64_t)time(NULL) * 2654435761u) ^ (uint64_t)clock();
        fprintf(stderr, "TQKV_TEST_SEED=%" PRIu64 "\n", seed);
        done = 1;
    }
    return seed;
}

#define TQKV_CHECK_MAIN(suite_fn)                                                                  \
    int main(void)                                                                                 \
    {                                                                                              \
        (void)tqkv_test_seed();                                                                    \
        SRunner *sr = srunner_create(suite_fn());                                                  \
        srunner_run_all(sr, CK_NORMAL);                                                            \
        int nf = srunner_ntests_failed(sr);                                                        \
        srunner_free(sr);                                                                          \
        return nf == 0 ? 0 : 1;                                                                    \
    }

#endif
