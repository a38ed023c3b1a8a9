/* clock.h - the one monotonic clock of tqkv (CLOCK_MONOTONIC), for every folder.
 *
 * Header-only and dependency-free so that service/, cache/, transport/ and the tools
 * read time the same way; components that need an injectable or shifted clock (the
 * store's and the disk tier's lease clocks) build it on tqkv_clock_ns(). Not installed.
 */
#ifndef TQKV_KERNELS_CLOCK_H
#define TQKV_KERNELS_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on CLOCK_MONOTONIC (an arbitrary origin; only differences mean anything). */
static inline uint64_t
tqkv_clock_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Seconds on CLOCK_MONOTONIC, for durations and rates. */
static inline double
tqkv_clock_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
