/* auth_scan_bench.c - times tqkv_auth_check over a large token table for a token that
 * matches the FIRST entry, the LAST entry, or none, and prints the three costs and their
 * ratios. The constant-time property itself is asserted by counting comparisons in
 * tests/check_auth.c (deterministic); this is the timing view of it, a benchmark (label
 * bench, registered only with -DTQKV_BENCH_TESTS=ON: a loaded machine makes timings lie).
 *
 * Usage: auth_scan_bench [--entries N] [--reps N] [--rounds N] [--max-ratio R]
 * An early-exit scan over 4096 entries makes "first" ~25x faster than "none" (SHA-256
 * dominates then); --max-ratio (default 0: report only) fails the run (exit 1) when the
 * slower of two cases is more than R times the faster. The best of --rounds interleaved
 * rounds is compared, the least noisy estimate under load.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "service/auth.h"

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double
ratio(double a, double b)
{
    return a > b ? a / b : b / a;
}

int
main(int argc, char **argv)
{
    long n = 4096, reps = 200, rounds = 15;
    double max_ratio = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--entries"))
            n = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps"))
            reps = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--rounds"))
            rounds = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--max-ratio"))
            max_ratio = strtod(argv[++i], NULL);
        else {
            fprintf(stderr, "usage: %s [--entries N] [--reps N] [--rounds N] [--max-ratio R]\n",
                    argv[0]);
            return 2;
        }
    }
    if (n < 2 || reps < 1 || rounds < 1) {
        fprintf(stderr, "auth_scan_bench: --entries >= 2, --reps and --rounds >= 1\n");
        return 2;
    }
    char path[] = "/tmp/tqkv-auth-bench-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
    if (f == NULL) {
        perror("auth_scan_bench: temporary token file");
        return 1;
    }
    for (long i = 0; i < n; i++)
        fprintf(f, "token-%08ld r ns\n", i);
    fclose(f);
    tqkv_auth_t *a = NULL;
    char err[256] = "";
    tqkv_status_t st = tqkv_auth_load(path, &a, err, sizeof(err));
    unlink(path);
    if (st != TQKV_OK) {
        fprintf(stderr, "auth_scan_bench: %s\n", err);
        return 1;
    }
    char hs[3][64];
    snprintf(hs[0], sizeof(hs[0]), "Bearer token-%08d", 0);
    snprintf(hs[1], sizeof(hs[1]), "Bearer token-%08ld", n - 1);
    snprintf(hs[2], sizeof(hs[2]), "Bearer token-%08ld", n + 7);
    const tqkv_status_t want[3] = {TQKV_OK, TQKV_OK, TQKV_EAUTH};
    double best[3] = {1e9, 1e9, 1e9};
    unsigned wrong = 0;
    for (long r = 0; r < rounds; r++) {
        for (int k = 0; k < 3; k++) { /* interleaved: load hits the three alike */
            double t0 = now_s();
            for (long i = 0; i < reps; i++)
                wrong +=
                    tqkv_auth_check(a, hs[k], strlen(hs[k]), "ns", 2, TQKV_AUTH_READ) != want[k];
            double dt = now_s() - t0;
            if (dt < best[k])
                best[k] = dt;
        }
    }
    tqkv_auth_destroy(a);
    if (wrong) {
        fprintf(stderr, "auth_scan_bench: %u wrong answers\n", wrong);
        return 1;
    }
    double r0 = ratio(best[0], best[2]), r1 = ratio(best[1], best[2]);
    printf("auth check over %ld entries (best of %ld rounds of %ld): first %.2f us, last %.2f "
           "us, none %.2f us; ratio first/none %.3f, last/none %.3f\n",
           n, rounds, reps, best[0] / (double)reps * 1e6, best[1] / (double)reps * 1e6,
           best[2] / (double)reps * 1e6, r0, r1);
    if (max_ratio > 0 && (r0 > max_ratio || r1 > max_ratio)) {
        fprintf(stderr, "auth_scan_bench: ratio over %.2f: not constant time\n", max_ratio);
        return 1;
    }
    return 0;
}
