/* store_test_util.h - helpers shared by the store suites and the store benchmark:
 * deterministic page contents derived from a key, so any thread can verify a read.
 */
#ifndef TQKV_TESTS_STORE_TEST_UTIL_H
#define TQKV_TESTS_STORE_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cache/store.h"
#include "tests/support/rng.h"

/* Seed for the content of key (ns, hash, layer). */
static inline uint64_t
st_key_seed(const tqkv_block_key_t *k)
{
    uint64_t h = 0x1234567ULL ^ k->layer;
    for (size_t i = 0; i < k->ns_len; i++)
        h = (h ^ (uint8_t)k->ns[i]) * 0x100000001b3ULL;
    for (size_t i = 0; i < k->hash_len; i++)
        h = (h ^ k->hash[i]) * 0x100000001b3ULL;
    return h;
}

/* Fills buf[0..len) with the content of the page with seed `seed`. */
static inline void
st_fill(uint8_t *buf, size_t len, uint64_t seed)
{
    uint64_t x = seed;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v = tqkv_test_rand(&x);
        memcpy(buf + i, &v, 8);
    }
    if (i < len) {
        uint64_t v = tqkv_test_rand(&x);
        memcpy(buf + i, &v, len - i);
    }
}

/* 1 when buf[0..len) is the content for seed. */
static inline int
st_check(const uint8_t *buf, size_t len, uint64_t seed)
{
    uint64_t x = seed;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v = tqkv_test_rand(&x);
        if (memcmp(buf + i, &v, 8) != 0)
            return 0;
    }
    if (i < len) {
        uint64_t v = tqkv_test_rand(&x);
        if (memcmp(buf + i, &v, len - i) != 0)
            return 0;
    }
    return 1;
}

/* A 32-byte hash for block number n of sequence `seq`. */
static inline void
st_hash(uint8_t out[32], uint64_t seq, uint64_t n)
{
    uint64_t x = seq * 0x9E3779B97F4A7C15ULL ^ (n + 1);
    for (int i = 0; i < 4; i++) {
        uint64_t v = tqkv_test_rand(&x);
        memcpy(out + 8 * i, &v, 8);
    }
}

#endif
