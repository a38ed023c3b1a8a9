/* store.h - the tiered page store: pools per tier, a concurrent index, prefix-aware
 * eviction, demotion/promotion, pins and leases, per-namespace quotas.
 *
 * Pages are opaque immutable byte strings here (the store never parses them beyond
 * an optional CRC check). Keys are (namespace, hash, layer). All functions are
 * thread-safe. Locking rules are documented in store.c next to the locks.
 */
#ifndef TQKV_CACHE_STORE_H
#define TQKV_CACHE_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

/* Largest layer index + 1 a key may carry (TQKV_EINVAL beyond). */
#define TQKV_STORE_MAX_LAYERS 1024u
/* Largest namespace name, in bytes (TQKV_EINVAL beyond). */
#define TQKV_STORE_MAX_NS 1024u

typedef struct tqkv_store tqkv_store_t;
typedef struct tqkv_page_ref tqkv_page_ref_t; /* a pinned page */

/* Tiers. */
typedef enum tqkv_tier {
    TQKV_TIER_NONE = 0, /* not present */
    TQKV_TIER_HBM = 1,  /* device pool (or its DRAM stand-in without a GPU) */
    TQKV_TIER_DRAM = 2, /* host memory, own jemalloc arena */
    TQKV_TIER_DISK = 3, /* segment files below DRAM (cache/disk.h), written through */
    TQKV_TIER_COUNT = 4
} tqkv_tier_t;

typedef enum tqkv_evict_policy {
    TQKV_EVICT_LRU = 0,    /* leaf-first, then least recently used */
    TQKV_EVICT_S3FIFO = 1, /* leaf-first, then S3-FIFO order */
} tqkv_evict_policy_t;

/* A block key; borrowed by every call. ns need not be NUL-terminated. */
typedef struct tqkv_block_key {
    const char *ns;
    size_t ns_len;
    const uint8_t *hash;
    size_t hash_len; /* 1..64 */
    uint32_t layer;
} tqkv_block_key_t;

typedef struct tqkv_store_config {
    uint64_t dram_capacity; /* bytes of page data, hard limit */
    uint64_t hbm_capacity;  /* 0 = no HBM tier */
    int hbm_standin;        /* HBM tier backed by host memory (no GPU needed) */
    int device;             /* CUDA device for a real HBM tier, -1 = none */
    double high_watermark;  /* fraction of HBM capacity that starts demotion (0.9) */
    double low_watermark;   /* demotion stops here (0.8) */
    int promote_on_access;  /* move DRAM pages back to HBM on get */
    int verify_crc;         /* check the page CRC on every get (TQKV_ECORRUPT on failure) */
    tqkv_evict_policy_t policy;
    uint64_t default_ns_quota; /* bytes per namespace, 0 = unlimited */
    char disk_path[1024];      /* disk tier directory; "" = no disk tier */
    uint64_t disk_capacity;    /* bytes of segment files */
    int disk_sync;             /* tqkv_disk_sync_t (cache/disk.h): 0 none, 1 batch, 2 always */
} tqkv_store_config_t;

/* Fills cfg with defaults: 1 GiB DRAM, no HBM, watermarks 0.9/0.8, S3-FIFO. */
void tqkv_store_config_default(tqkv_store_config_t *cfg);

/* Creates a store; *out owned by the caller (tqkv_store_destroy). With a disk tier
 * (cfg->disk_path), opens it and rebuilds its index (warm restart); a failure is logged
 * on stderr with its reason and returned (TQKV_EIO, TQKV_EFORMAT, ...). */
tqkv_status_t tqkv_store_create(const tqkv_store_config_t *cfg, tqkv_store_t **out);

/* Frees everything. Pages still pinned by readers must have been released first. */
void tqkv_store_destroy(tqkv_store_t *s);

/* Disk tier. Every Put is written through to the disk tier as well as to HBM/DRAM, so
 * DRAM eviction demotes (the disk copy stays; counted as DRAM demotions), a restart finds
 * everything, and --disk-sync always makes a Put durable before it returns (a disk
 * error then fails the Put). A Get that misses HBM/DRAM reads the disk record (the
 * calling thread waits for that one read, no store lock held), serves it from the read
 * buffer (tier TQKV_TIER_DISK) and promotes a copy into DRAM. Disk records that fail
 * their checks are misses (counted). Quotas count the namespace's disk bytes too: a Put
 * over the quota drops the namespace's disk records (leaves first, leased ones never)
 * with tombstones, so they stay gone after a restart, or fails with TQKV_ENOSPC when
 * what is left is leased. */

/* Stores a copy of page[0..len) under key. parent_hash (may be NULL/0) links the block
 * to the previous block of its sequence. bf16_bytes is the size of the BF16 data the
 * page replaces (for compression statistics). A key already present is a no-op that
 * sets *duplicate = 1. Returns TQKV_ENOSPC when the tier and quota are full and
 * nothing can be evicted, TQKV_EINVAL for a bad key. */
tqkv_status_t tqkv_store_put(tqkv_store_t *s, const tqkv_block_key_t *key,
                             const uint8_t *parent_hash, size_t parent_len, const void *page,
                             size_t len, uint64_t bf16_bytes, int *duplicate);

/* What a Put must wait for before it is acknowledged, with --disk-sync always: the disk
 * records of write sequence lo..hi (hi 0: nothing). Start from {0, 0}. */
typedef struct tqkv_store_sync {
    uint64_t lo, hi;
} tqkv_store_sync_t;

/* tqkv_store_put that, with --disk-sync always, appends the disk record without waiting
 * for its fdatasync and widens *sync to cover it (a duplicate covers the latest record,
 * which may be a concurrent Put's of the same key, still unsynced). The caller passes
 * *sync to tqkv_store_sync before acknowledging: one fdatasync for the blocks of a whole
 * Put RPC instead of one per block. Other modes, or sync NULL: as tqkv_store_put. */
tqkv_status_t tqkv_store_put_nosync(tqkv_store_t *s, const tqkv_block_key_t *key,
                                    const uint8_t *parent_hash, size_t parent_len, const void *page,
                                    size_t len, uint64_t bf16_bytes, int *duplicate,
                                    tqkv_store_sync_t *sync);
/* Returns once the disk records of *sync are durable, or the disk error that lost one of
 * them (then those Puts must not be acknowledged). TQKV_OK at once without a disk tier
 * or when sync->hi is 0. */
tqkv_status_t tqkv_store_sync(tqkv_store_t *s, const tqkv_store_sync_t *sync);

/* Looks up and pins a page: *out is valid until tqkv_page_ref_release(). Returns
 * TQKV_ENOTFOUND on a miss (counted), TQKV_ECORRUPT when verify_crc fails (the corrupt
 * page is then dropped from the store, so the block reads as missing and can be put
 * again). */
tqkv_status_t tqkv_store_get(tqkv_store_t *s, const tqkv_block_key_t *key, tqkv_page_ref_t **out);

/* Disk tier: reads the disk-only pages among hashes[0..n) x layers [layer_begin,
 * layer_end) of ns with all reads in flight at once and promotes them into DRAM (up to
 * half of the DRAM capacity), so that the Gets that follow hit DRAM: a Get of many
 * pages waits for about one disk read instead of one per page. No-op without a disk
 * tier. Borrows everything. */
void tqkv_store_prefetch(tqkv_store_t *s, const char *ns, size_t ns_len,
                         const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                         uint32_t layer_begin, uint32_t layer_end);

/* Host-readable bytes of a pinned page, borrowed until release. */
const void *tqkv_page_ref_data(const tqkv_page_ref_t *r);
size_t tqkv_page_ref_len(const tqkv_page_ref_t *r);
tqkv_tier_t tqkv_page_ref_tier(const tqkv_page_ref_t *r);
/* Releases a pin; the last release of an evicted page frees it. */
void tqkv_page_ref_release(tqkv_page_ref_t *r);

/* Prefix lookup: for hashes[0..n) in sequence order, *prefix_blocks = the number of
 * leading hashes whose layers [0, num_layers) are all present. tiers_out (may be NULL)
 * gets, per hash, the slowest tier holding any of its layers, or TQKV_TIER_NONE when
 * some layer is missing. With lease_ms > 0, the pages of the prefix are pinned for
 * that long (a following get cannot lose them to eviction), disk-only ones included (the
 * disk tier copies them forward rather than drop them; cache/disk.h). */
tqkv_status_t tqkv_store_lookup(tqkv_store_t *s, const char *ns, size_t ns_len,
                                const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                                uint32_t num_layers, uint32_t lease_ms, uint32_t *prefix_blocks,
                                uint8_t *tiers_out);

/* Deletes every layer of (ns, hash). *pages and *bytes (may be NULL) get what went. */
tqkv_status_t tqkv_store_delete(tqkv_store_t *s, const char *ns, size_t ns_len, const uint8_t *hash,
                                size_t hash_len, uint64_t *pages, uint64_t *bytes);

/* Deletes a whole namespace; TQKV_ENOTFOUND when it holds nothing. */
tqkv_status_t tqkv_store_delete_namespace(tqkv_store_t *s, const char *ns, size_t ns_len,
                                          uint64_t *pages, uint64_t *bytes);

/* Per-namespace byte quota (0 = unlimited). */
tqkv_status_t tqkv_store_set_quota(tqkv_store_t *s, const char *ns, size_t ns_len, uint64_t bytes);

typedef struct tqkv_tier_stats {
    uint64_t capacity, bytes_used, pages;
    uint64_t hits, misses, evictions, demotions, promotions;
} tqkv_tier_stats_t;

typedef struct tqkv_store_stats {
    tqkv_tier_stats_t tier[TQKV_TIER_COUNT]; /* index by tqkv_tier_t; [0] unused */
    uint64_t hits, misses, evictions;
    uint64_t bytes_in;   /* page bytes stored by puts */
    uint64_t bytes_out;  /* page bytes handed out by gets */
    uint64_t bf16_bytes; /* BF16 bytes represented by the pages stored now */
    uint64_t pages, page_bytes;
    uint64_t alloc_failures;
    uint64_t quota_bytes; /* namespace stats: its byte quota (0 = none); whole store: 0 */
} tqkv_store_stats_t;

/* Whole-store statistics (ns == NULL) or one namespace's. */
tqkv_status_t tqkv_store_stats(tqkv_store_t *s, const char *ns, size_t ns_len,
                               tqkv_store_stats_t *out);

/* Disk reads off the caller's thread (issue 23): a Get serves its pages with
 * tqkv_store_get_cached, which never reads the disk; at the first page that is on the
 * disk tier only (TQKV_EBUSY) it has tqkv_store_pin_disk read that page and the disk-only
 * pages after it, on a thread that may wait for the disk, and then serves them from the
 * pins. A pinned page is held (its read buffer) until the Get takes it, so neither
 * eviction nor the Get's own promotions can make it be read twice.
 *
 * Blocks are numbered in Get order: block i is hashes[i % n] at layer layer_begin + i / n. */
typedef struct tqkv_store_pins tqkv_store_pins_t;

/* tqkv_store_get that never reads the disk tier: a page held by the disk tier only is
 * TQKV_EBUSY (nothing counted); everything else as tqkv_store_get. */
tqkv_status_t tqkv_store_get_cached(tqkv_store_t *s, const tqkv_block_key_t *key,
                                    tqkv_page_ref_t **out);

/* Reads the disk-only pages among blocks [first, n x (layer_end - layer_begin)) with all
 * reads of a batch in flight at once, up to half the DRAM capacity in bytes, promoting
 * each into DRAM, and pins them in *out (NULL with an error; freed with
 * tqkv_store_pins_free). The blocks in HBM/DRAM up to there are pinned too (a reference
 * on their copy, counted as a hit now), so the promotions cannot evict them before the
 * Get sends them. Absent blocks and blocks past the byte budget are not pinned
 * (tqkv_store_pins_take gives NULL for them). Block `first` is always read when it is on
 * disk. The arrays are read during the call only; the pins may be taken on any thread. */
tqkv_status_t tqkv_store_pin_disk(tqkv_store_t *s, const char *ns, size_t ns_len,
                                  const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                                  uint32_t layer_begin, uint32_t layer_end, size_t first,
                                  tqkv_store_pins_t **out);
/* tqkv_store_pin_disk that only starts the reads: each is finished (waited for, checked,
 * promoted) when tqkv_store_pins_take asks for its block, so a Get sends its first pages
 * while the later ones are still on their way from the disk (the TCP data channel). Take
 * and free on the calling thread (the disk engine's io_uring rings are per thread), and
 * keep ns and the hashes' bytes valid until tqkv_store_pins_free. */
tqkv_status_t tqkv_store_pin_disk_start(tqkv_store_t *s, const char *ns, size_t ns_len,
                                        const uint8_t *const *hashes, const size_t *hash_lens,
                                        size_t n, uint32_t layer_begin, uint32_t layer_end,
                                        size_t first, tqkv_store_pins_t **out);

/* Block idx's pinned page, handed over (release it with tqkv_page_ref_release; a disk
 * page is counted as a disk hit now), or NULL. *miss (may be NULL) is set when block idx was on
 * disk but its read failed its checks or the disk (a miss, counted). */
tqkv_page_ref_t *tqkv_store_pins_take(tqkv_store_pins_t *p, size_t idx, int *miss);
/* Frees the pins and every page not taken. NULL is a no-op. */
void tqkv_store_pins_free(tqkv_store_pins_t *p);

struct tqkv_disk_stats;
/* The disk tier's own counters (cache/disk.h); TQKV_ENOTFOUND without a disk tier. */
tqkv_status_t tqkv_store_disk_stats(tqkv_store_t *s, struct tqkv_disk_stats *out);

/* Calls fn for each namespace with its stats (for metrics). */
tqkv_status_t tqkv_store_foreach_namespace(tqkv_store_t *s,
                                           void (*fn)(void *arg, const char *ns, size_t ns_len,
                                                      const tqkv_store_stats_t *st),
                                           void *arg);

/* One page key of tqkv_store_export: ns/hash/parent point into the export's memory. */
typedef struct tqkv_store_key_out {
    const char *ns;
    size_t ns_len;
    const uint8_t *hash;
    size_t hash_len;
    const uint8_t *parent; /* the previous block's hash, or NULL */
    size_t parent_len;
    uint32_t layer;
    uint32_t len; /* page bytes */
} tqkv_store_key_out_t;

/* The keys of the pages stored now, hottest first (per tier, HBM then DRAM: prefix
 * pages other pages extend, then the eviction queues from their hot end), at most
 * max_pages (0 = all), as a snapshot: *out (n_out keys) is one malloc'ed block, freed
 * with free(). Read the pages with tqkv_store_get (they may have gone meanwhile). For
 * hand-off on drain. */
tqkv_status_t tqkv_store_export(tqkv_store_t *s, size_t max_pages, tqkv_store_key_out_t **out,
                                size_t *n_out);

#endif
