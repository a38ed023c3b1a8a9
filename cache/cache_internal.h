/* cache_internal.h - what the files of cache/ share but do not publish: the pool body,
 * the device sub-allocator, the device-side pool operations and test hooks.
 *
 * Pools. struct tqkv_pool is the same for host and device pools. Capacity accounting
 * (`used`, `allocs`) is done by pool.c for both kinds, in bytes requested (page bytes),
 * with atomics and a compare-and-swap so `used` never exceeds `capacity`. Host pools
 * allocate from their own jemalloc arena. Device pools hold one device allocation
 * (`dev_base`, made by tqkv_pool_create_device in pool_cuda.c) carved up by the
 * sub-allocator below (offsets only, metadata on the host, protected by `sub.lock`);
 * pool.c calls the tqkv__pool_dev_* functions for every device-pool operation.
 *
 * Locking: pool functions take no lock for host pools (jemalloc is thread-safe,
 * accounting is atomic); device pools lock `sub.lock` only inside the sub-allocator.
 */
#ifndef TQKV_CACHE_CACHE_INTERNAL_H
#define TQKV_CACHE_CACHE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cache/pool.h"
#include "cache/store.h"
#include "kernels/status.h"

/* Kind of a pool. */
typedef enum tqkv__pool_kind {
    TQKV__POOL_HOST = 0,   /* host memory from a dedicated jemalloc arena */
    TQKV__POOL_DEVICE = 1, /* one device allocation, sub-allocated */
} tqkv__pool_kind_t;

/* Alignment of device sub-allocations (and granularity of the free list). */
#define TQKV__SUBALLOC_ALIGN 256u

/* A free extent of the device sub-allocator: [off, off + len), sorted by off. */
typedef struct tqkv__extent {
    uint64_t off, len;
    struct tqkv__extent *prev, *next;
} tqkv__extent_t;

/* First-fit sub-allocator over [0, size) with coalescing on free. Thread-safe (lock).
 * Lock rule: `lock` protects `head`, `n_free` and `bytes_free`; nothing else is
 * called while it is held except the host allocator. */
typedef struct tqkv__suballoc {
    pthread_mutex_t lock;
    uint64_t size;        /* bytes managed */
    uint64_t bytes_free;  /* sum of free extents */
    uint64_t n_free;      /* number of free extents */
    tqkv__extent_t *head; /* free extents in increasing offset order */
} tqkv__suballoc_t;

/* Initialises sa over `size` bytes (one free extent). TQKV_ENOMEM on failure. */
tqkv_status_t tqkv__suballoc_init(tqkv__suballoc_t *sa, uint64_t size);
/* Frees the free-list metadata (allocations still out are forgotten). */
void tqkv__suballoc_fini(tqkv__suballoc_t *sa);
/* Allocates len bytes (rounded up to TQKV__SUBALLOC_ALIGN): *off gets the offset.
 * TQKV_ENOSPC when no free extent is large enough, TQKV_ENOMEM for metadata. */
tqkv_status_t tqkv__suballoc_alloc(tqkv__suballoc_t *sa, uint64_t len, uint64_t *off);
/* Returns [off, off + len) (len as passed to alloc). TQKV_ENOMEM only when a
 * split extent's metadata cannot be allocated (the bytes are then lost). */
tqkv_status_t tqkv__suballoc_free(tqkv__suballoc_t *sa, uint64_t off, uint64_t len);

/* The pool body (host and device). */
struct tqkv_pool {
    tqkv__pool_kind_t kind;
    uint64_t capacity;               /* hard limit on `used` */
    _Atomic uint64_t used;           /* bytes handed out (as requested, before rounding) */
    _Atomic uint64_t allocs;         /* allocations handed out and not yet freed */
    _Atomic uint64_t alloc_failures; /* ENOSPC/ENOMEM returned by tqkv_pool_alloc */
    unsigned arena;                  /* host: jemalloc arena index */
    int device;                      /* device: CUDA ordinal, else -1 */
    void *dev_base;                  /* device: base of the single device allocation */
    void *dev_priv;                  /* device: private state of pool_cuda.c (streams, ...) */
    tqkv__suballoc_t sub;            /* device: sub-allocator over [dev_base, +capacity) */
};

/* Device-side operations, implemented in pool_cuda.c (only with CUDA). pool.c does
 * the capacity accounting before/after calling them (alloc is called only once `used`
 * has been reserved; on failure pool.c gives the reservation back).
 * tqkv_pool_create_device (pool_cuda.c) allocates the struct with calloc, sets
 * kind = TQKV__POOL_DEVICE, capacity, device, dev_base (cudaMalloc of capacity bytes)
 * and initialises `sub` over capacity bytes; tqkv_pool_destroy (pool.c) calls
 * tqkv__pool_dev_destroy and then free(p). */
#ifdef TQKV_HAVE_CUDA
tqkv_status_t tqkv__pool_dev_alloc(tqkv_pool_t *p, size_t len, void **ptr);
void tqkv__pool_dev_free(tqkv_pool_t *p, void *ptr, size_t len);
tqkv_status_t tqkv__pool_dev_copy_in(tqkv_pool_t *p, void *dst, const void *src_host, size_t len);
tqkv_status_t tqkv__pool_dev_copy_out(tqkv_pool_t *p, void *dst_host, const void *src, size_t len);
/* Releases the device allocation, dev_priv and the sub-allocator; pool.c frees p. */
void tqkv__pool_dev_destroy(tqkv_pool_t *p);
#endif

/* Allocations handed out and not freed yet (tests check this returns to 0). */
uint64_t tqkv__pool_live_allocs(const tqkv_pool_t *p);
/* Allocation failures so far. */
uint64_t tqkv__pool_alloc_failures(const tqkv_pool_t *p);

/* Test hooks (store.c). */
/* The pool of a tier, or NULL when the tier is absent. Borrowed. */
tqkv_pool_t *tqkv__store_pool(tqkv_store_t *s, tqkv_tier_t tier);
/* Flips the bits of byte `offset` of the stored copy of key (in whatever tier it is).
 * TQKV_ENOTFOUND when absent, TQKV_EINVAL when offset is out of range. */
tqkv_status_t tqkv__store_debug_corrupt(tqkv_store_t *s, const tqkv_block_key_t *key,
                                        size_t offset);
/* Moves the store's clock (leases) forward by ms. */
void tqkv__store_debug_advance_clock(tqkv_store_t *s, uint64_t ms);
/* Runs one demotion/lease-reaping pass synchronously (what the background thread does). */
void tqkv__store_maintain(tqkv_store_t *s);
/* Checks internal invariants (accounting vs. index contents); TQKV_EINTERNAL on a
 * mismatch, with a reason on stderr. For tests, with no other thread using the store. */
tqkv_status_t tqkv__store_check(tqkv_store_t *s);

/* The store's and the disk index's hashes (one definition: disk digests depend on it).
 * A 64-bit finalizer (murmur3's fmix64) and a word-at-a-time hash of n bytes from h. */
static inline uint64_t
tqkv__mix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint64_t
tqkv__hash_bytes(uint64_t h, const uint8_t *p, size_t n)
{
    uint64_t v;
    while (n >= 8) {
        memcpy(&v, p, 8);
        h = (h ^ v) * 0x9E3779B97F4A7C15ULL;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    v = 0;
    if (n)
        memcpy(&v, p, n);
    h = (h ^ v ^ ((uint64_t)n << 56)) * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 31);
}

#endif
