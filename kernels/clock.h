/* clock.h - the one monotonic clock of tqkv (CLOCK_MONOTONIC), for every folder, and the
 * one way to turn a wait in milliseconds into a pthread_cond_timedwait deadline.
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

/* The CLOCK_REALTIME instant ms milliseconds from now: the absolute deadline
 * pthread_cond_timedwait takes for a condition variable with the default clock. */
static inline struct timespec
tqkv_clock_deadline(uint32_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

#endif
