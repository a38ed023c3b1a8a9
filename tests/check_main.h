/* check_main.h - main() for a Check suite binary: TQKV_CHECK_MAIN(codec_suite).
 *
 * Tests draw their inputs from one 64-bit seed, printed once per binary as
 * TQKV_TEST_SEED=<n>. The default is a fixed seed, so CI and a developer's run see the
 * same inputs; TQKV_TEST_SEED=<n> replays a run, TQKV_TEST_SEED=random draws a fresh
 * seed (time and pid; printed, so a failure can be replayed) for exploratory runs. Every
 * statistical bound is set from a sweep over many seeds (docs/testing.md), so a fresh
 * seed failing is a finding, not noise. Exits non-zero on any failure.
 */
#ifndef TQKV_TESTS_CHECK_MAIN_H
#define TQKV_TESTS_CHECK_MAIN_H

#include <check.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The seed CI runs with (any fixed value; changed only on purpose). */
#define TQKV_TEST_DEFAULT_SEED 20261201u

/* The seed of this run: TQKV_TEST_SEED (a number, or "random"), else the default.
 * Printed once; a malformed value aborts the binary rather than running on 0. */
static inline uint64_t
tqkv_test_seed(void)
{
    static uint64_t seed;
    static int done;
    if (!done) {
        const char *e = getenv("TQKV_TEST_SEED");
        if (!e || !*e) {
            seed = TQKV_TEST_DEFAULT_SEED;
        } else if (!strcmp(e, "random")) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            seed = ((uint64_t)ts.tv_sec * 1000000007u) ^ ((uint64_t)ts.tv_nsec << 20) ^
                   ((uint64_t)getpid() * 2654435761u);
        } else {
            char *end = NULL;
            seed = strtoull(e, &end, 0);
            if (end == e || *end) {
                fprintf(stderr, "TQKV_TEST_SEED=%s: not a number or \"random\"\n", e);
                exit(2);
            }
        }
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
