/* disk_internal.h - what the files of the disk tier share: the tier's body, its index
 * slot, segment and namespace records, and the helpers one file uses from another.
 *
 * The tier is cache/disk.c (open, close, the writer, deletes, the flusher, statistics),
 * cache/disk_index.c (leases, namespaces, the segment table, the index, record headers),
 * cache/disk_read.c (Gets), cache/disk_compact.c (the capacity reclaimer and the
 * compactor) and cache/disk_rebuild.c (segment scans, the start-up rebuild, the
 * superblock). Functions named do_... expect the lock their comment names held.
 *
 * Locks, in acquisition order: compact_lock (one compaction at a time) -> slock (the
 * group commit of SYNC_ALWAYS: durable_seq) -> wlock (the writer: active segment,
 * buffer, seq) -> ilock (rwlock: the index, the namespace table, the segment table and
 * every segment's `live`/`size`, `used`). No I/O under ilock. Record reads of sealed or
 * written data take a segment reference under ilock and read with no lock held.
 * lease_lock is a leaf (taken alone or innermost).
 */
#ifndef TQKV_CACHE_DISK_INTERNAL_H
#define TQKV_CACHE_DISK_INTERNAL_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "cache/cache_internal.h"
#include "cache/disk.h"
#include "cache/disk_format.h"
#include "cache/disk_io.h"
#include "kernels/clock.h"

#define ALIGN TQKV_DISK_ALIGN
#define SCAN_CHUNK (2u << 20) /* one read of a segment scan */
#define SCAN_SPARE (1u << 20) /* room before a chunk for the record that straddles into it */
#define SCAN_DEPTH 4          /* reads in flight per segment scan (read-ahead) */
#define REBUILD_THREADS 4     /* segments scanned at once at start-up */
#define MAX_CANDS 16
#define FAIL_RING 16

/* ---- types ---- */

typedef struct slot {
    uint64_t dg;        /* digest, 0 = empty */
    uint32_t seg;       /* segment id */
    uint32_t blk;       /* record offset / ALIGN */
    uint32_t nblk : 31; /* record bytes / ALIGN */
    uint32_t kids : 1;  /* a record naming this one as its parent was written after this
                           copy of it (leaf-first: a prefix record); cleared when it moves */
    uint32_t ns;        /* namespace id */
} slot_t;
_Static_assert(sizeof(slot_t) == 24, "index slot is 24 bytes");

typedef struct seg {
    uint32_t id;
    int fd;
    uint64_t size;         /* bytes of the file, buffered ones included: ilock */
    uint64_t live;         /* bytes of indexed records: ilock */
    uint64_t min_seq;      /* lowest record seq in the segment (UINT64_MAX when none) */
    uint64_t ntomb;        /* tombstones in it */
    _Atomic uint32_t refs; /* the table's + readers' */
    _Atomic int sealed;    /* no more appends (set under wlock; read anywhere) */
    int busy;              /* being compacted or dropped: not a victim (ilock) */
} seg_t;

typedef struct nsrec {
    char *name;
    uint32_t len;
    uint64_t hv;
    uint64_t pages, bytes; /* ilock */
} nsrec_t;

typedef struct tomb {
    uint64_t seq;
    uint32_t layer, ns_len;
    uint8_t hash_len;
    uint8_t key[TQKV_DISK_MAX_KEY];
} tomb_t;

struct tqkv_disk {
    tqkv_disk_config_t cfg;
    char *path;
    int dirfd;
    int direct;
    char direct_why[128];
    tqkv__io_t *io;
    uint64_t store_id;

    pthread_rwlock_t ilock; /* see the top */
    slot_t *slots;
    uint64_t mask, count;
    uint64_t *rseq; /* seq per slot, only while rebuilding */
    nsrec_t *ns;
    uint32_t nns, ns_cap;
    uint32_t *ns_map; /* id + 1, open addressing by hv */
    uint32_t ns_map_cap;
    uint32_t max_layer;
    seg_t **segs; /* by id */
    uint32_t seg_cap, seg_hi;
    uint32_t seg_lo; /* no segment below this id (scans start here) */
    uint64_t used, live, nsegs;

    pthread_mutex_t wlock; /* the writer, see the top */
    seg_t *active;
    uint8_t *buf;
    size_t buf_cap, fill;
    uint64_t buf_off;
    uint64_t seq, buf_seq_lo, buf_seq_hi;
    /* Copies made by the compactor or the reclaimer (they keep their records' old seqs,
     * which durable_seq may already cover) are in the buffer or in the active segment,
     * not yet synced: the next group commit flushes and syncs even with no newer seq. */
    int copies_unsynced;
    struct {
        uint64_t lo, hi; /* seq range of a batch whose write failed (its records are lost) */
        tqkv_status_t st;
    } fails[FAIL_RING]; /* the last FAIL_RING failed batches */
    uint64_t nfails;    /* failed batches ever */
    uint64_t fail_lost; /* highest seq of the failed batches pushed out of fails */

    pthread_mutex_t slock; /* group commit: durable_seq */
    uint64_t durable_seq;

    pthread_mutex_t compact_lock;
    pthread_mutex_t bg_lock; /* bg_stop, bg_cond */
    pthread_cond_t bg_cond;
    int bg_stop, bg_running;
    pthread_t bg;

    /* Leases (tqkv_disk_lease): digest -> until (ms of now_ms), open addressing; a leaf
     * lock (nothing else is taken while it is held). */
    pthread_mutex_t lease_lock;
    uint64_t *lease_dg, *lease_until;
    uint64_t lease_cap, lease_n;
    _Atomic int64_t clock_skew_ms;
    uint64_t reserve; /* bytes kept free for the reclaimer's copies (wlock) */

    _Atomic uint64_t hits, misses, reads, read_bytes, writes, write_bytes, records, syncs,
        io_errors, corrupt, torn, compactions, compacted, ev_segs, ev_recs, reloc_recs, reloc_bytes,
        lease_skips, refused, quota_drops;
    uint64_t rebuild_bytes;
    double rebuild_seconds;
};

/* A visitor of the records of a segment scan (tqkv__disk_scan_segment): off is the
 * record's offset in s; nonzero stops the scan. */
typedef int (*scan_fn)(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg);

/* ---- helpers ---- */

/* Digest width (64; fewer bits only in tests, tqkv__disk_debug_digest_bits). */
extern unsigned tqkv__disk_digest_bits;

static inline void
cnt(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static inline uint64_t
ns_hv(const char *ns, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(0x6e73u ^ len, (const uint8_t *)ns, len));
}

static inline uint64_t
digest(const char *ns, size_t nl, const uint8_t *h, size_t hl, uint32_t layer)
{
    uint64_t x = tqkv__hash_bytes(ns_hv(ns, nl) ^ (hl * 0x100000001b3ULL), h, hl);
    x = tqkv__mix64(x ^ ((uint64_t)(layer + 1) * 0xD6E8FEB86659FD93ULL));
    if (tqkv__disk_digest_bits < 64)
        x &= (1ULL << tqkv__disk_digest_bits) - 1;
    return x ? x : 1;
}

static inline void *
abuf(size_t len)
{
    void *p = NULL;
    if (posix_memalign(&p, ALIGN, len ? len : ALIGN) != 0)
        return NULL;
    return p;
}

static inline tqkv_status_t
errno_status(int e)
{
    return e == ENOSPC || e == EFBIG || e == EDQUOT ? TQKV_ENOSPC : TQKV_EIO;
}

/* disk_index.c: leases (lease_lock), namespaces, segments and the index (ilock held unless said),
 * records */
uint64_t tqkv__disk_now_ms(tqkv_disk_t *d);
uint64_t tqkv__disk_do_lease_pos(const tqkv_disk_t *d, uint64_t dg);
int tqkv__disk_do_lease_rehash(tqkv_disk_t *d, uint64_t cap, uint64_t now);
int tqkv__disk_leased(tqkv_disk_t *d, uint64_t dg, uint64_t now);
uint32_t tqkv__disk_do_ns_find(tqkv_disk_t *d, const char *ns, size_t len, uint64_t hv);
uint32_t tqkv__disk_do_ns_get(tqkv_disk_t *d, const char *ns, size_t len);
void tqkv__disk_seg_unref(seg_t *s);
seg_t *tqkv__disk_do_seg_ref(tqkv_disk_t *d, uint32_t id);
uint32_t tqkv__disk_do_seg_lo(tqkv_disk_t *d);
int tqkv__disk_do_seg_table_put(tqkv_disk_t *d, seg_t *s);
int tqkv__disk_seg_open_file(tqkv_disk_t *d, uint32_t id, int create);
void tqkv__disk_seg_remove(tqkv_disk_t *d, seg_t *s);
int tqkv__disk_do_idx_grow(tqkv_disk_t *d);
void tqkv__disk_do_account(tqkv_disk_t *d, const slot_t *s, int add);
uint64_t tqkv__disk_do_idx_insert(tqkv_disk_t *d, const slot_t *s);
void tqkv__disk_do_idx_remove_at(tqkv_disk_t *d, uint64_t i);
uint64_t tqkv__disk_do_idx_find_loc(const tqkv_disk_t *d, uint64_t dg, uint32_t seg, uint32_t blk);
int tqkv__disk_do_idx_cands(const tqkv_disk_t *d, uint64_t dg, slot_t *out, int max);
void tqkv__disk_do_mark_parent(tqkv_disk_t *d, const char *ns, size_t nl, const uint8_t *parent,
                               size_t pl, uint32_t layer);
uint64_t tqkv__disk_leased_bytes_in(tqkv_disk_t *d, uint32_t id, uint64_t now);
uint32_t tqkv__disk_key_bytes(const tqkv_disk_rec_t *h);
int tqkv__disk_rec_header_ok(const uint8_t *p, size_t len, uint32_t seg_id);
int tqkv__disk_rec_page_ok(const uint8_t *p);
int tqkv__disk_rec_key_is(const uint8_t *p, const char *ns, size_t nl, const uint8_t *hash,
                          size_t hl, uint32_t layer);
uint64_t tqkv__disk_rec_digest(const uint8_t *p);
void tqkv__disk_rec_build(uint8_t *dst, uint32_t seg_id, uint64_t seq, uint16_t flags,
                          const char *ns, size_t nl, const uint8_t *hash, size_t hl,
                          const uint8_t *parent, size_t pl, uint32_t layer, const void *page,
                          size_t len, uint64_t bf16, const uint32_t *page_crc);

/* disk.c: the writer (wlock held unless said), group commit, deletes */
tqkv_status_t tqkv__disk_do_flush(tqkv_disk_t *d);
int tqkv__disk_do_fdatasync(tqkv_disk_t *d, int fd);
tqkv_status_t tqkv__disk_do_seal(tqkv_disk_t *d);
tqkv_status_t tqkv__disk_do_prepare(tqkv_disk_t *d, uint64_t rb);
uint32_t tqkv__disk_do_commit_append(tqkv_disk_t *d, uint64_t rb, uint64_t seq);
tqkv_status_t tqkv__disk_sync_to(tqkv_disk_t *d, uint64_t seq);
int tqkv__disk_valid_key(const tqkv_block_key_t *k);
void tqkv__disk_do_drop_key(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t dg,
                            uint32_t keep_seg, uint32_t keep_blk, uint64_t *pages, uint64_t *bytes);
tqkv_status_t tqkv__disk_do_tombstone(tqkv_disk_t *d, const char *ns, size_t nl,
                                      const uint8_t *hash, size_t hl, uint32_t layer,
                                      uint64_t *seq);

/* disk_read.c: reading records */
tqkv_status_t tqkv__disk_read_record(tqkv_disk_t *d, seg_t *s, uint32_t blk, uint32_t nblk,
                                     int wlocked, uint8_t **out);

/* disk_compact.c: making room: the capacity reclaimer (wlock held) */
tqkv_status_t tqkv__disk_do_reserve(tqkv_disk_t *d, uint64_t rb);

/* disk_rebuild.c: segment scans, the start-up rebuild and the superblock */
tqkv_status_t tqkv__disk_scan_segment(tqkv_disk_t *d, seg_t *s, scan_fn fn, void *arg, int count);
tqkv_status_t tqkv__disk_rebuild(tqkv_disk_t *d, char *err, size_t errlen);
tqkv_status_t tqkv__disk_super_load(tqkv_disk_t *d, char *err, size_t errlen);

#endif /* TQKV_CACHE_DISK_INTERNAL_H */
