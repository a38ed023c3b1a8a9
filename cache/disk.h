/* disk.h - the disk tier: append-only segment files of page records (cache/disk_format.h,
 * proto/DISK_FORMAT.md) with a compact in-memory index, rebuilt by scanning the segments
 * at open (warm restart), a compactor, and io_uring or thread-pool I/O.
 *
 * Records are appended into a write buffer (a batch) that is written with one I/O when
 * full, every batch_ms by a flusher thread, or at once for TQKV_DISK_SYNC_ALWAYS. A put
 * of a key replaces its earlier record (which becomes dead space for the compactor).
 * When the capacity is reached, the oldest segment is dropped (its pages become misses):
 * the tier is a FIFO-ordered log, like a flash cache, with two exceptions. Records under
 * a lease (tqkv_disk_lease) are copied forward to the head before their segment goes (or,
 * when they do not fit, the segment is passed over and a Put that finds no droppable
 * segment gets TQKV_ENOSPC); and prefix records (a record that a later record names as
 * its parent) whose own parent is still on disk are copied forward, up to `relocate` of
 * a segment per dropped segment, so that leaves go first. Keys are the store's
 * (namespace, hash, layer). All functions are thread-safe.
 */
#ifndef TQKV_CACHE_DISK_H
#define TQKV_CACHE_DISK_H

#include <stddef.h>
#include <stdint.h>

#include "cache/store.h"
#include "kernels/status.h"

typedef struct tqkv_disk tqkv_disk_t;

/* What a crash may lose (proto/DISK_FORMAT.md, section "Durability"). */
typedef enum tqkv_disk_sync {
    TQKV_DISK_SYNC_NONE = 0,   /* written every batch_ms, never fdatasync'ed: kill -9 loses
                                  the last batch_ms; power loss whatever the kernel held */
    TQKV_DISK_SYNC_BATCH = 1,  /* written and fdatasync'ed every batch_ms (or full batch) */
    TQKV_DISK_SYNC_ALWAYS = 2, /* tqkv_disk_put returns once the record is fdatasync'ed
                                  (group commit): nothing acknowledged is lost */
} tqkv_disk_sync_t;

/* I/O engine. */
typedef enum tqkv_disk_io {
    TQKV_DISK_IO_AUTO = 0,    /* io_uring when built with liburing and the kernel allows */
    TQKV_DISK_IO_URING = 1,   /* io_uring or fail */
    TQKV_DISK_IO_THREADS = 2, /* a thread pool on preadv2/pwritev2 */
} tqkv_disk_io_t;

typedef struct tqkv_disk_config {
    const char *path;       /* directory (created if absent); borrowed during open */
    uint64_t capacity;      /* bytes of segment files, hard limit */
    uint64_t segment_bytes; /* largest segment (default 256 MiB, at most capacity / 4) */
    uint32_t batch_bytes;   /* write buffer (default 4 MiB) */
    uint32_t batch_ms;      /* flush interval for NONE/BATCH (default 10) */
    tqkv_disk_sync_t sync;
    tqkv_disk_io_t io;
    int direct;          /* 1 (default): O_DIRECT where the file system allows it */
    int io_threads;      /* thread-pool engine workers (default 4) */
    double compact_dead; /* compact a sealed segment once this fraction is dead (0.5) */
    int compact_thread;  /* 1 (default): background compactor; 0: only tqkv_disk_compact */
    double relocate;     /* leaf-first: the bytes of prefix records the capacity reclaimer may
                            copy forward per dropped segment, as a fraction of segment_bytes
                            (0.25). The same amount is kept free for those copies and for
                            leased records (Puts see capacity minus it). 0: plain FIFO (leased
                            records then only make their segment be passed over) */
    int quiet;           /* 1: no start-up log lines on stderr */
} tqkv_disk_config_t;

void tqkv_disk_config_default(tqkv_disk_config_t *cfg);

/* Opens (or creates) the tier in cfg->path and rebuilds the index from its segments.
 * err (may be NULL) gets a one-line reason on failure. TQKV_EINVAL for a bad config,
 * TQKV_EFORMAT for a foreign or newer superblock, TQKV_EIO for file errors,
 * TQKV_EUNSUPPORTED when io_uring was required and is unavailable. *out: caller owns. */
tqkv_status_t tqkv_disk_open(const tqkv_disk_config_t *cfg, tqkv_disk_t **out, char *err,
                             size_t errlen);

/* Writes what is buffered, syncs (unless SYNC_NONE) and frees. NULL is a no-op. */
void tqkv_disk_close(tqkv_disk_t *d);

/* Appends a record for key (replacing any earlier one). parent may be NULL/0. With
 * SYNC_ALWAYS, returns once the record is durable. TQKV_ENOSPC: record larger than a
 * segment or the file system is full; TQKV_EIO: the write failed (the record is then not
 * indexed). Borrows everything. */
tqkv_status_t tqkv_disk_put(tqkv_disk_t *d, const tqkv_block_key_t *key, const uint8_t *parent,
                            size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes);

/* tqkv_disk_put that does not wait for the fdatasync of SYNC_ALWAYS: the record is
 * appended (and indexed) and *seq (may be NULL) gets its write sequence, which the
 * caller passes to tqkv_disk_sync_range before it tells anyone the page is stored (one
 * sync for the many records of a Put RPC). Errors as tqkv_disk_put's. */
tqkv_status_t tqkv_disk_append(tqkv_disk_t *d, const tqkv_block_key_t *key, const uint8_t *parent,
                               size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes,
                               uint64_t *seq);
/* Returns once every record up to seq hi is written and fdatasync'ed (any sync mode;
 * concurrent callers share one fdatasync), or with the write error of a batch that held
 * a record of seq lo..hi (that record is not stored). hi 0: nothing to do. */
tqkv_status_t tqkv_disk_sync_range(tqkv_disk_t *d, uint64_t lo, uint64_t hi);
/* The latest write sequence handed out (0: none yet). */
uint64_t tqkv_disk_last_seq(tqkv_disk_t *d);

/* 1 when the index has a record for key (not verified on disk), else 0. *rec_bytes (may
 * be NULL) gets its disk bytes. No I/O. */
int tqkv_disk_contains(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t *rec_bytes);

/* A page read from disk: page[0..len) inside a buffer owned by the struct. */
typedef struct tqkv_disk_page {
    void *buf; /* owned, free with tqkv_disk_page_free */
    const uint8_t *page;
    size_t len;
    uint64_t bf16_bytes;
    uint8_t parent[64];
    size_t parent_len;
} tqkv_disk_page_t;

/* Reads key's record and checks it (header CRC, key, page CRC). TQKV_ENOTFOUND when
 * absent; TQKV_ECORRUPT when the record fails a check (it is then dropped from the index
 * and counted: the next get is a miss); TQKV_EIO on a read error. */
tqkv_status_t tqkv_disk_get(tqkv_disk_t *d, const tqkv_block_key_t *key, tqkv_disk_page_t *out);
void tqkv_disk_page_free(tqkv_disk_page_t *p);

/* tqkv_disk_get of n keys with all their reads in flight at once (one I/O round instead
 * of n); st[i] and out[i] as tqkv_disk_get would set them. */
void tqkv_disk_get_many(tqkv_disk_t *d, const tqkv_block_key_t *keys, size_t n,
                        tqkv_disk_page_t *out, tqkv_status_t *st);

/* The same round, finished one read at a time, so that a caller can send a page while
 * the others are still being read: tqkv_disk_batch_start submits the reads of keys[0..n)
 * (keys and what they point to must stay valid until tqkv_disk_batch_end);
 * tqkv_disk_batch_finish(b, i, out) waits for read i alone and returns what
 * tqkv_disk_get would (once per i); tqkv_disk_batch_end waits for the reads not finished,
 * drops their pages and frees b. All three on the thread that started the batch (the
 * io_uring engine has a ring per thread). NULL only when out of memory. */
typedef struct tqkv_disk_batch tqkv_disk_batch_t;
tqkv_disk_batch_t *tqkv_disk_batch_start(tqkv_disk_t *d, const tqkv_block_key_t *keys, size_t n);
tqkv_status_t tqkv_disk_batch_finish(tqkv_disk_batch_t *b, size_t i, tqkv_disk_page_t *out);
/* Waits for all of b's reads in flight with one sleep (each finish then returns at once). */
void tqkv_disk_batch_wait(tqkv_disk_batch_t *b);
void tqkv_disk_batch_end(tqkv_disk_batch_t *b);

/* Deletes key's record (layer TQKV_DISK_ALL_LAYERS: every layer of the hash) with a
 * durable-by-policy tombstone. pages and bytes (may be NULL) get what went. */
tqkv_status_t tqkv_disk_delete(tqkv_disk_t *d, const char *ns, size_t ns_len, const uint8_t *hash,
                               size_t hash_len, uint32_t layer, uint64_t *pages, uint64_t *bytes);
/* Deletes a whole namespace (a tombstone, then an index scan). */
tqkv_status_t tqkv_disk_delete_namespace(tqkv_disk_t *d, const char *ns, size_t ns_len,
                                         uint64_t *pages, uint64_t *bytes);
/* Drops records of ns until `need` bytes went or no candidate is left (quota
 * enforcement): leaves before prefix records (records a later record names as its
 * parent), oldest first within each; leased records stay. Each dropped record gets a
 * tombstone (as tqkv_disk_delete writes), so a restart does not bring it back; the
 * tombstones are durable with the next sync. freed gets the bytes. */
tqkv_status_t tqkv_disk_evict_namespace(tqkv_disk_t *d, const char *ns, size_t ns_len,
                                        uint64_t need, uint64_t *freed);

/* Leases key's record for ms milliseconds (a longer lease already held stays): until
 * then neither capacity eviction nor quota enforcement drops it (delete still does).
 * TQKV_ENOTFOUND when the tier holds no record of key. Leases live in RAM only. */
tqkv_status_t tqkv_disk_lease(tqkv_disk_t *d, const tqkv_block_key_t *key, uint32_t ms);

/* Writes the buffer and fdatasyncs the open segments (whatever the sync mode). */
tqkv_status_t tqkv_disk_sync(tqkv_disk_t *d);

/* One compaction pass: rewrites the live records of the most-dead sealed segment whose
 * dead fraction is at least min_dead (0..1) and removes it. *done = 1 when one was. */
tqkv_status_t tqkv_disk_compact(tqkv_disk_t *d, double min_dead, int *done);

typedef struct tqkv_disk_stats {
    uint64_t capacity;            /* configured bytes */
    uint64_t bytes_used;          /* bytes of segment files (buffered included) */
    uint64_t live_bytes;          /* bytes of indexed records */
    uint64_t pages;               /* indexed records */
    uint64_t page_bytes;          /* = live_bytes (page lengths are not kept in RAM) */
    uint64_t segments;            /* segment files */
    uint64_t hits, misses;        /* tqkv_disk_get outcomes */
    uint64_t reads, read_bytes;   /* read I/Os (record reads and scans) */
    uint64_t writes, write_bytes; /* write I/Os (batches) */
    uint64_t records_written;     /* records appended (puts, tombstones, compaction copies) */
    uint64_t syncs;               /* fdatasync calls */
    uint64_t io_errors;           /* failed reads and writes */
    uint64_t corrupt;             /* records that failed a check (scan or get), skipped */
    uint64_t torn;                /* torn tails found by the start-up scan */
    uint64_t compactions, compacted_records;
    uint64_t evicted_segments, evicted_records;  /* dropped for capacity */
    uint64_t relocated_records, relocated_bytes; /* copied forward by the capacity reclaimer
                                                    (leased records, prefix records) */
    uint64_t lease_skips;    /* times a segment was passed over (its leased records did not fit) */
    uint64_t refused_writes; /* records refused (TQKV_ENOSPC): nothing could be dropped */
    uint64_t quota_drops;    /* records dropped (and tombstoned) for namespace quotas */
    uint64_t leases;         /* lease entries held now (expired ones until purged) */
    uint64_t index_bytes, index_slots; /* the index's RAM */
    uint64_t rebuild_bytes;            /* bytes scanned at open */
    double rebuild_seconds;
    const char *io_engine;  /* "io_uring" or "threads" (static) */
    int direct;             /* O_DIRECT in use */
    uint64_t segment_bytes; /* largest segment file (min(segment size, capacity / 4)) */
    uint64_t max_record;    /* largest record a segment holds (segment_bytes - 4096): a
                               record (tqkv_disk_record_bytes) over it is refused ENOSPC */
} tqkv_disk_stats_t;

void tqkv_disk_stats(tqkv_disk_t *d, tqkv_disk_stats_t *out);

/* Per-namespace records and disk bytes (ns need not exist: zeros). page_bytes gets the
 * disk bytes too and bf16 0 (neither is kept in RAM); any pointer may be NULL. */
void tqkv_disk_ns_usage(tqkv_disk_t *d, const char *ns, size_t ns_len, uint64_t *pages,
                        uint64_t *bytes, uint64_t *page_bytes, uint64_t *bf16);
/* Calls fn for each namespace holding records. */
void tqkv_disk_foreach_namespace(tqkv_disk_t *d,
                                 void (*fn)(void *arg, const char *ns, size_t ns_len,
                                            uint64_t pages, uint64_t bytes),
                                 void *arg);

/* Test hooks. Keeps only the low `bits` bits of index digests (forces collisions);
 * 64 = normal. Process-wide; set before tqkv_disk_open. */
void tqkv__disk_debug_digest_bits(unsigned bits);
/* Moves the tier's lease clock forward by ms. */
void tqkv__disk_debug_advance_clock(tqkv_disk_t *d, uint64_t ms);
/* Location of key's record: segment file path (into path[0..n)) and byte offset. */
tqkv_status_t tqkv__disk_debug_locate(tqkv_disk_t *d, const tqkv_block_key_t *key, char *path,
                                      size_t n, uint64_t *offset, uint64_t *rec_bytes);

#endif
