/* shard.h - block placement over several servers: rendezvous hashing and back-off.
 *
 * Placement is highest-random-weight (rendezvous) hashing: every target gets a
 * score mix(id(target), h(namespace, hash)) and a block lives on the R best. Adding
 * or removing a target moves only the blocks that rank it first, and every client
 * computes the same ranking from the target names alone.
 *
 * A target's health is a lock-free back-off: after a transport failure it is
 * skipped until a deadline that doubles with each consecutive failure (between
 * min and max), and a success clears it. Thread-safe (C11 atomics).
 */
#ifndef TQKV_TRANSPORT_SHARD_H
#define TQKV_TRANSPORT_SHARD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/clock.h"

/* Stable 64-bit id of a target name (FNV-1a + a finaliser). */
uint64_t tqkv_shard_target_id(const char *name);

/* 64-bit key of a block: namespace and hash bytes. */
uint64_t tqkv_shard_block_key(const char *ns, const uint8_t *hash, size_t hash_len);

/* Score of target id for block key (higher wins). */
uint64_t tqkv_shard_score(uint64_t target_id, uint64_t block_key);

/* Up to this many targets, placement is flat rendezvous (every target scored: O(n) hashes
 * per block). Above it, two-level: the targets fall into TQKV_SHARD_GROUPS groups by
 * the top bits of their ids (fixed for life), a block ranks the groups by weighted
 * rendezvous (weight = targets in the group, so each target keeps a 1/n share) and the
 * winning group's targets by flat rendezvous: O(n) loads but O(G + n/G) hashes. A join or
 * leave then moves about 2/n of the blocks instead of 1/n (the group's weight changes
 * too); docs/cluster.md has the numbers. Clusters of up to TQKV_SHARD_FLAT_MAX servers
 * place exactly as before the two-level scheme existed. */
#define TQKV_SHARD_FLAT_MAX 256
#define TQKV_SHARD_GROUP_BITS 5
#define TQKV_SHARD_GROUPS (1u << TQKV_SHARD_GROUP_BITS)

/* Ranks n targets (ids[n]) for block_key, best first: writes a permutation of
 * 0..n-1 into order[n]. Ties (equal ids) break by index. Borrows everything. */
void tqkv_shard_rank(const uint64_t *ids, size_t n, uint64_t block_key, uint32_t *order);

/* The best k of n targets for block_key, best first, into order[k] (k <= n): ids are
 * read at ids_base + i * stride (bytes), so they may sit in an array of structs. One
 * score per target and a partial insertion: O(n * k), for hundreds of targets (above
 * TQKV_SHARD_FLAT_MAX, the two-level order). The order equals the first k of
 * tqkv_shard_rank. Returns k. Borrows everything. */
size_t tqkv_shard_top(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key,
                      size_t k, uint32_t *order);

/* The groups of one target table, for tqkv_shard_top_index: O(G + n/G) hashes per
 * block above TQKV_SHARD_FLAT_MAX instead of tqkv_shard_top's O(n) pass. */
typedef struct tqkv_shard_index tqkv_shard_index_t;

/* Returns new (tqkv_shard_index_destroy), or NULL when n <= TQKV_SHARD_FLAT_MAX (flat
 * placement needs none) or out of memory. Ids as for tqkv_shard_top; borrowed. */
tqkv_shard_index_t *tqkv_shard_index_create(const uint64_t *ids_base, size_t stride, size_t n);
void tqkv_shard_index_destroy(tqkv_shard_index_t *ix);

/* tqkv_shard_top, the same order, through ix (made from these ids); ix NULL: plain
 * tqkv_shard_top. */
size_t tqkv_shard_top_index(const tqkv_shard_index_t *ix, const uint64_t *ids_base, size_t stride,
                            size_t n, uint64_t block_key, size_t k, uint32_t *order);

/* tqkv_shard_top as flat rendezvous at any n (what it is up to TQKV_SHARD_FLAT_MAX): for
 * comparisons (tqkv-cluster-sim), not for placement. */
size_t tqkv_shard_top_flat(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key,
                           size_t k, uint32_t *order);

/* Back-off health of one target. Initialise with tqkv_shard_health_init. */
typedef struct tqkv_shard_health {
    _Atomic uint64_t down_until_ns; /* 0 = healthy; else skip until this monotonic time */
    _Atomic uint32_t backoff_ms;    /* next back-off length */
    _Atomic uint64_t failures;      /* transport failures seen (for stats and tests) */
} tqkv_shard_health_t;

void tqkv_shard_health_init(tqkv_shard_health_t *h);

/* 1 when the target may be used at now_ns (healthy, or its back-off has expired). */
int tqkv_shard_health_usable(tqkv_shard_health_t *h, uint64_t now_ns);

/* Records a transport failure at now_ns: skip for the current back-off, then double it
 * (clamped to [min_ms, max_ms]). */
void tqkv_shard_health_fail(tqkv_shard_health_t *h, uint64_t now_ns, uint32_t min_ms,
                            uint32_t max_ms);

/* Records a success: healthy again, back-off reset to min_ms. */
void tqkv_shard_health_ok(tqkv_shard_health_t *h, uint32_t min_ms);

/* Marks the target down with no deadline: it is skipped until tqkv_shard_health_ok (a
 * prober saw it answer). The back-off length is kept. */
void tqkv_shard_health_down(tqkv_shard_health_t *h);

/* 1 while the target is marked down by tqkv_shard_health_down. */
int tqkv_shard_health_is_down(tqkv_shard_health_t *h);

#endif
