/* disk.c - the disk tier: segment files of page records, a compact index, warm restart.
 *
 * Index. An open-addressing table (linear probing, backward-shift deletion) of 24-byte
 * slots: a 64-bit digest of (namespace, hash, layer), the segment id, the record's
 * block offset and length in TQKV_DISK_ALIGN units, and the namespace id. Keys are not
 * kept in RAM: two keys with one digest both get slots, and a reader tells them apart by
 * the key stored in the record header. The table doubles at 3/4 load, so it spends 32 to
 * 64 bytes per record (tqkv_disk_stats: index_bytes / pages).
 *
 * Writing. Records are built in a write buffer (one batch) that starts at file offset
 * `buf_off` of the active segment; its records are indexed at once and served from the
 * buffer until it is written (one I/O per batch). Capacity counts every segment byte,
 * buffered ones included; when a record does not fit, the oldest sealed segment is
 * dropped. A restart never appends to an old segment: it starts a new one.
 *
 * Locks, in acquisition order: compact_lock (one compaction at a time) -> slock (the
 * group commit of SYNC_ALWAYS: durable_seq) -> wlock (the writer: active segment,
 * buffer, seq) -> ilock (rwlock: the index, the namespace table, the segment table and
 * every segment's `live`/`size`, `used`). No I/O under ilock. Record reads of sealed or
 * written data take a segment reference under ilock and read with no lock held.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/cache_internal.h"
#include "cache/disk.h"
#include "cache/disk_format.h"
#include "cache/disk_io.h"
#include "kernels/page.h"

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
    struct timespec buf_since;
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

static unsigned g_digest_bits = 64;

void
tqkv__disk_debug_digest_bits(unsigned bits)
{
    g_digest_bits = bits == 0 || bits > 64 ? 64 : bits;
}

/* ---- helpers ---- */

static void
cnt(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static uint64_t
ns_hv(const char *ns, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(0x6e73u ^ len, (const uint8_t *)ns, len));
}

static uint64_t
digest(const char *ns, size_t nl, const uint8_t *h, size_t hl, uint32_t layer)
{
    uint64_t x = tqkv__hash_bytes(ns_hv(ns, nl) ^ (hl * 0x100000001b3ULL), h, hl);
    x = tqkv__mix64(x ^ ((uint64_t)(layer + 1) * 0xD6E8FEB86659FD93ULL));
    if (g_digest_bits < 64)
        x &= (1ULL << g_digest_bits) - 1;
    return x ? x : 1;
}

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *
abuf(size_t len)
{
    void *p = NULL;
    if (posix_memalign(&p, ALIGN, len ? len : ALIGN) != 0)
        return NULL;
    return p;
}

static tqkv_status_t
errno_status(int e)
{
    return e == ENOSPC || e == EFBIG || e == EDQUOT ? TQKV_ENOSPC : TQKV_EIO;
}

/* ---- leases (lease_lock: a leaf, taken alone or innermost) ---- */

static uint64_t
now_ms(tqkv_disk_t *d)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u +
           (uint64_t)atomic_load_explicit(&d->clock_skew_ms, memory_order_relaxed);
}

/* Position of dg in the lease table, or of the empty slot where it would go (lease_cap >
 * 0, lease_lock held). */
static uint64_t
do_lease_pos(const tqkv_disk_t *d, uint64_t dg)
{
    uint64_t m = d->lease_cap - 1, i = tqkv__mix64(dg ^ 0x6c65617365ULL) & m;
    while (d->lease_dg[i] != 0 && d->lease_dg[i] != dg)
        i = (i + 1) & m;
    return i;
}

/* Rebuilds the lease table with cap slots, leaving out the leases expired by now. 0 when
 * out of memory (the table is then unchanged). */
static int
do_lease_rehash(tqkv_disk_t *d, uint64_t cap, uint64_t now)
{
    uint64_t *ndg = calloc(cap, sizeof(*ndg)), *nun = calloc(cap, sizeof(*nun));
    if (ndg == NULL || nun == NULL) {
        free(ndg);
        free(nun);
        return 0;
    }
    uint64_t *odg = d->lease_dg, *oun = d->lease_until, ocap = d->lease_cap;
    d->lease_dg = ndg;
    d->lease_until = nun;
    d->lease_cap = cap;
    d->lease_n = 0;
    for (uint64_t i = 0; i < ocap; i++) {
        if (odg[i] == 0 || oun[i] <= now)
            continue;
        uint64_t j = do_lease_pos(d, odg[i]);
        ndg[j] = odg[i];
        nun[j] = oun[i];
        d->lease_n++;
    }
    free(odg);
    free(oun);
    return 1;
}

/* 1 when records of digest dg are leased at now. */
static int
leased(tqkv_disk_t *d, uint64_t dg, uint64_t now)
{
    int held = 0;
    pthread_mutex_lock(&d->lease_lock);
    if (d->lease_n > 0) {
        uint64_t i = do_lease_pos(d, dg);
        held = d->lease_dg[i] == dg && d->lease_until[i] > now;
    }
    pthread_mutex_unlock(&d->lease_lock);
    return held;
}

/* ---- namespaces (ilock held) ---- */

static uint32_t
do_ns_find(tqkv_disk_t *d, const char *ns, size_t len, uint64_t hv)
{
    if (d->ns_map_cap == 0)
        return UINT32_MAX;
    for (uint32_t i = (uint32_t)hv & (d->ns_map_cap - 1);; i = (i + 1) & (d->ns_map_cap - 1)) {
        uint32_t id = d->ns_map[i];
        if (id == 0)
            return UINT32_MAX;
        nsrec_t *r = &d->ns[id - 1];
        if (r->hv == hv && r->len == len && (len == 0 || memcmp(r->name, ns, len) == 0))
            return id - 1;
    }
}

static void
do_ns_map_put(tqkv_disk_t *d, uint32_t id)
{
    uint32_t i = (uint32_t)d->ns[id].hv & (d->ns_map_cap - 1);
    while (d->ns_map[i] != 0)
        i = (i + 1) & (d->ns_map_cap - 1);
    d->ns_map[i] = id + 1;
}

/* Id of ns, created when absent; UINT32_MAX when out of memory. */
static uint32_t
do_ns_get(tqkv_disk_t *d, const char *ns, size_t len)
{
    uint64_t hv = ns_hv(ns, len);
    uint32_t id = do_ns_find(d, ns, len, hv);
    if (id != UINT32_MAX)
        return id;
    if (d->nns == d->ns_cap) {
        uint32_t nc = d->ns_cap ? d->ns_cap * 2 : 16;
        nsrec_t *n = realloc(d->ns, nc * sizeof(*n));
        if (n == NULL)
            return UINT32_MAX;
        d->ns = n;
        d->ns_cap = nc;
    }
    if ((d->nns + 1) * 2 > d->ns_map_cap) {
        uint32_t nc = d->ns_map_cap ? d->ns_map_cap * 2 : 32;
        uint32_t *m = calloc(nc, sizeof(*m));
        if (m == NULL)
            return UINT32_MAX;
        free(d->ns_map);
        d->ns_map = m;
        d->ns_map_cap = nc;
        for (uint32_t i = 0; i < d->nns; i++)
            do_ns_map_put(d, i);
    }
    nsrec_t *r = &d->ns[d->nns];
    memset(r, 0, sizeof(*r));
    r->name = malloc(len + 1);
    if (r->name == NULL)
        return UINT32_MAX;
    if (len)
        memcpy(r->name, ns, len);
    r->name[len] = '\0';
    r->len = (uint32_t)len;
    r->hv = hv;
    do_ns_map_put(d, d->nns);
    return d->nns++;
}

/* ---- segments ---- */

static void
seg_unref(seg_t *s)
{
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) {
        close(s->fd);
        free(s);
    }
}

/* The segment of id with a reference taken, or NULL (ilock held). */
static seg_t *
do_seg_ref(tqkv_disk_t *d, uint32_t id)
{
    if (id >= d->seg_cap || d->segs[id] == NULL)
        return NULL;
    atomic_fetch_add_explicit(&d->segs[id]->refs, 1, memory_order_relaxed);
    return d->segs[id];
}

/* The lowest id that may hold a segment (advanced past removed ones; ilock held for
 * writing, or by the only thread). */
static uint32_t
do_seg_lo(tqkv_disk_t *d)
{
    while (d->seg_lo < d->seg_hi && d->seg_lo < d->seg_cap && d->segs[d->seg_lo] == NULL)
        d->seg_lo++;
    return d->seg_lo;
}

static int
do_seg_table_put(tqkv_disk_t *d, seg_t *s)
{
    if (s->id >= d->seg_cap) {
        uint32_t nc = d->seg_cap ? d->seg_cap : 64;
        while (nc <= s->id)
            nc *= 2;
        seg_t **n = realloc(d->segs, nc * sizeof(*n));
        if (n == NULL)
            return 0;
        memset(n + d->seg_cap, 0, (nc - d->seg_cap) * sizeof(*n));
        d->segs = n;
        d->seg_cap = nc;
    }
    d->segs[s->id] = s;
    if (s->id > d->seg_hi)
        d->seg_hi = s->id;
    d->used += s->size;
    d->nsegs++;
    return 1;
}

static int
seg_open_file(tqkv_disk_t *d, uint32_t id, int create)
{
    char name[64];
    snprintf(name, sizeof(name), TQKV_DISK_SEG_FMT, id);
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
    if (d->direct)
        flags |= O_DIRECT;
    return openat(d->dirfd, name, flags, 0644);
}

/* Removes segment s from the table and the file system (ilock not held). */
static void
seg_remove(tqkv_disk_t *d, seg_t *s)
{
    char name[64];
    snprintf(name, sizeof(name), TQKV_DISK_SEG_FMT, s->id);
    pthread_rwlock_wrlock(&d->ilock);
    d->segs[s->id] = NULL;
    d->used -= s->size;
    d->nsegs--;
    pthread_rwlock_unlock(&d->ilock);
    if (unlinkat(d->dirfd, name, 0) != 0)
        fprintf(stderr, "tqkv disk: unlink %s/%s: %s\n", d->path, name, strerror(errno));
    seg_unref(s);
}

/* ---- index (ilock held for writing unless said) ---- */

static uint64_t
do_pos(const tqkv_disk_t *d, uint64_t dg)
{
    return tqkv__mix64(dg) & d->mask;
}

static int
do_idx_grow(tqkv_disk_t *d)
{
    uint64_t ncap = d->slots ? (d->mask + 1) * 2 : 1024;
    slot_t *ns = calloc(ncap, sizeof(*ns));
    uint64_t *nseq = NULL;
    if (ns == NULL)
        return 0;
    if (d->rseq != NULL && (nseq = calloc(ncap, sizeof(*nseq))) == NULL) {
        free(ns);
        return 0;
    }
    slot_t *old = d->slots;
    uint64_t *oseq = d->rseq;
    uint64_t ocap = d->slots ? d->mask + 1 : 0;
    d->slots = ns;
    d->rseq = nseq;
    d->mask = ncap - 1;
    for (uint64_t i = 0; i < ocap; i++) {
        if (old[i].dg == 0)
            continue;
        uint64_t j = do_pos(d, old[i].dg);
        while (ns[j].dg != 0)
            j = (j + 1) & d->mask;
        ns[j] = old[i];
        if (nseq)
            nseq[j] = oseq[i];
    }
    free(old);
    free(oseq);
    return 1;
}

static void
do_account(tqkv_disk_t *d, const slot_t *s, int add)
{
    uint64_t b = (uint64_t)s->nblk * ALIGN;
    seg_t *g = s->seg < d->seg_cap ? d->segs[s->seg] : NULL;
    nsrec_t *r = &d->ns[s->ns];
    if (add) {
        r->pages++;
        r->bytes += b;
        d->live += b;
        if (g)
            g->live += b;
    } else {
        r->pages--;
        r->bytes -= b;
        d->live -= b;
        if (g)
            g->live -= b;
    }
}

/* Inserts s; returns its position or UINT64_MAX when out of memory. */
static uint64_t
do_idx_insert(tqkv_disk_t *d, const slot_t *s)
{
    if (d->slots == NULL || (d->count + 1) * 4 > (d->mask + 1) * 3)
        if (!do_idx_grow(d) && d->slots == NULL)
            return UINT64_MAX;
    if (d->count + 1 > d->mask) /* a full table that could not grow */
        return UINT64_MAX;
    uint64_t j = do_pos(d, s->dg);
    while (d->slots[j].dg != 0)
        j = (j + 1) & d->mask;
    d->slots[j] = *s;
    d->count++;
    do_account(d, s, 1);
    return j;
}

/* Removes the slot at i (backward-shift deletion). */
static void
do_idx_remove_at(tqkv_disk_t *d, uint64_t i)
{
    do_account(d, &d->slots[i], 0);
    d->count--;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & d->mask;
        if (d->slots[j].dg == 0)
            break;
        uint64_t k = do_pos(d, d->slots[j].dg);
        /* Move j back to i when its home k is not in (i, j] (cyclically). */
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
            d->slots[i] = d->slots[j];
            if (d->rseq)
                d->rseq[i] = d->rseq[j];
            i = j;
        }
    }
    d->slots[i].dg = 0;
}

/* Position of the slot with digest dg at (seg, blk), or UINT64_MAX (ilock held, any). */
static uint64_t
do_idx_find_loc(const tqkv_disk_t *d, uint64_t dg, uint32_t seg, uint32_t blk)
{
    if (d->slots == NULL)
        return UINT64_MAX;
    for (uint64_t j = do_pos(d, dg); d->slots[j].dg != 0; j = (j + 1) & d->mask)
        if (d->slots[j].dg == dg && d->slots[j].seg == seg && d->slots[j].blk == blk)
            return j;
    return UINT64_MAX;
}

/* Copies up to max slots with digest dg (ilock held, any). */
static int
do_idx_cands(const tqkv_disk_t *d, uint64_t dg, slot_t *out, int max)
{
    int n = 0;
    if (d->slots == NULL)
        return 0;
    for (uint64_t j = do_pos(d, dg); d->slots[j].dg != 0 && n < max; j = (j + 1) & d->mask)
        if (d->slots[j].dg == dg)
            out[n++] = d->slots[j];
    return n;
}

/* Marks the records of (ns, parent, layer) as prefix records: a record naming them as
 * its parent was just written after them (ilock held for writing). Digest collisions
 * mark other records too: the mark only orders eviction. */
static void
do_mark_parent(tqkv_disk_t *d, const char *ns, size_t nl, const uint8_t *parent, size_t pl,
               uint32_t layer)
{
    if (pl == 0 || d->slots == NULL)
        return;
    uint64_t pdg = digest(ns, nl, parent, pl, layer);
    for (uint64_t j = do_pos(d, pdg); d->slots[j].dg != 0; j = (j + 1) & d->mask)
        if (d->slots[j].dg == pdg)
            d->slots[j].kids = 1;
}

/* Bytes of the records of segment id that are leased at now (ilock not held). */
static uint64_t
leased_bytes_in(tqkv_disk_t *d, uint32_t id, uint64_t now)
{
    uint64_t sum = 0;
    pthread_rwlock_rdlock(&d->ilock);
    pthread_mutex_lock(&d->lease_lock);
    for (uint64_t i = 0; i < d->lease_cap && d->lease_n > 0; i++) {
        if (d->lease_dg[i] == 0 || d->lease_until[i] <= now)
            continue;
        slot_t c[MAX_CANDS];
        int nc = do_idx_cands(d, d->lease_dg[i], c, MAX_CANDS);
        for (int k = 0; k < nc; k++)
            if (c[k].seg == id)
                sum += (uint64_t)c[k].nblk * ALIGN;
    }
    pthread_mutex_unlock(&d->lease_lock);
    pthread_rwlock_unlock(&d->ilock);
    return sum;
}

/* ---- records ---- */

static uint32_t
key_bytes(const tqkv_disk_rec_t *h)
{
    return (uint32_t)h->ns_len + h->hash_len + h->parent_len;
}

/* Checks the header at p (len bytes available from p) of a record found in segment
 * seg_id: 1 when the header and key are intact and the record fits in len. */
static int
rec_header_ok(const uint8_t *p, size_t len, uint32_t seg_id)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    if (len < TQKV_DISK_REC_HEADER || h->magic != TQKV_DISK_REC_MAGIC ||
        h->version != TQKV_DISK_VERSION || h->record_bytes % ALIGN != 0 ||
        h->record_bytes < ALIGN || h->record_bytes > len || h->ns_len > 1024 || h->hash_len > 64 ||
        h->parent_len > 64 || h->seg_id != seg_id)
        return 0;
    uint32_t kb = key_bytes(h);
    if (tqkv_disk_record_bytes(kb, h->page_len) != h->record_bytes)
        return 0;
    if ((h->flags & TQKV_DISK_REC_TOMBSTONE) == 0 && (h->hash_len == 0 || h->page_len == 0))
        return 0;
    tqkv_disk_rec_t c = *h;
    c.header_crc = 0;
    uint32_t crc = tqkv_crc32c(0, &c, sizeof(c));
    crc = tqkv_crc32c(crc, p + TQKV_DISK_REC_HEADER, kb);
    return crc == h->header_crc;
}

static int
rec_page_ok(const uint8_t *p)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    if (h->page_len == 0)
        return h->page_crc32c == 0;
    return tqkv_crc32c(0, p + tqkv_disk_page_offset(key_bytes(h)), h->page_len) == h->page_crc32c;
}

static int
rec_key_is(const uint8_t *p, const char *ns, size_t nl, const uint8_t *hash, size_t hl,
           uint32_t layer)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    const uint8_t *k = p + TQKV_DISK_REC_HEADER;
    return (h->flags & TQKV_DISK_REC_TOMBSTONE) == 0 && h->layer == layer && h->ns_len == nl &&
           h->hash_len == hl && (nl == 0 || memcmp(k, ns, nl) == 0) &&
           memcmp(k + nl, hash, hl) == 0;
}

static uint64_t
rec_digest(const uint8_t *p)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    const uint8_t *k = p + TQKV_DISK_REC_HEADER;
    return digest((const char *)k, h->ns_len, k + h->ns_len, h->hash_len, h->layer);
}

/* Writes a record at dst (record_bytes zeroed or overwritten). page may be NULL (a
 * tombstone); page_crc: the CRC when known (compaction), else computed while copying. */
static void
rec_build(uint8_t *dst, uint32_t seg_id, uint64_t seq, uint16_t flags, const char *ns, size_t nl,
          const uint8_t *hash, size_t hl, const uint8_t *parent, size_t pl, uint32_t layer,
          const void *page, size_t len, uint64_t bf16, const uint32_t *page_crc)
{
    uint32_t kb = (uint32_t)(nl + hl + pl);
    uint32_t po = tqkv_disk_page_offset(kb);
    uint64_t rb = tqkv_disk_record_bytes(kb, len);
    tqkv_disk_rec_t h;
    memset(&h, 0, sizeof(h));
    h.magic = TQKV_DISK_REC_MAGIC;
    h.version = TQKV_DISK_VERSION;
    h.flags = flags;
    h.seq = seq;
    h.layer = layer;
    h.page_len = (uint32_t)len;
    h.ns_len = (uint16_t)nl;
    h.hash_len = (uint8_t)hl;
    h.parent_len = (uint8_t)pl;
    h.bf16_bytes = bf16;
    h.record_bytes = (uint32_t)rb;
    h.seg_id = seg_id;
    uint8_t *k = dst + TQKV_DISK_REC_HEADER;
    if (nl)
        memcpy(k, ns, nl);
    if (hl)
        memcpy(k + nl, hash, hl);
    if (pl)
        memcpy(k + nl + hl, parent, pl);
    memset(k + kb, 0, po - TQKV_DISK_REC_HEADER - kb);
    if (len) {
        if (page_crc) {
            memcpy(dst + po, page, len);
            h.page_crc32c = *page_crc;
        } else {
            h.page_crc32c = tqkv_crc32c_copy(0, dst + po, page, len);
        }
    }
    memset(dst + po + len, 0, rb - po - len);
    uint32_t crc = tqkv_crc32c(0, &h, sizeof(h));
    h.header_crc = tqkv_crc32c(crc, k, kb);
    memcpy(dst, &h, sizeof(h));
}

/* ---- writer (wlock held) ---- */

/* Removes the index slots of the buffered records (a failed batch). */
static void
do_drop_buffer(tqkv_disk_t *d)
{
    pthread_rwlock_wrlock(&d->ilock);
    for (size_t off = 0; off < d->fill;) {
        const tqkv_disk_rec_t *h = (const void *)(d->buf + off);
        if ((h->flags & TQKV_DISK_REC_TOMBSTONE) == 0) {
            uint64_t i = do_idx_find_loc(d, rec_digest(d->buf + off), d->active->id,
                                         (uint32_t)((d->buf_off + off) / ALIGN));
            if (i != UINT64_MAX)
                do_idx_remove_at(d, i);
        }
        off += h->record_bytes;
    }
    pthread_rwlock_unlock(&d->ilock);
}

/* Writes the buffer. On failure its records are dropped, the segment is cut back to
 * what was written and sealed, and the batch's seq range is remembered as failed. */
static tqkv_status_t
do_flush(tqkv_disk_t *d)
{
    if (d->fill == 0)
        return TQKV_OK;
    ssize_t n = tqkv__io_rw(d->io, 1, d->active->fd, d->buf, d->fill, d->buf_off);
    cnt(&d->writes, 1);
    if (n == (ssize_t)d->fill) {
        cnt(&d->write_bytes, d->fill);
        d->buf_off += d->fill;
        d->fill = 0;
        d->buf_seq_lo = 0;
        return TQKV_OK;
    }
    tqkv_status_t st = errno_status(n < 0 ? (int)-n : ENOSPC);
    cnt(&d->io_errors, 1);
    fprintf(stderr, "tqkv disk: write of %zu bytes to segment %u failed: %s\n", d->fill,
            d->active->id, n < 0 ? strerror((int)-n) : "short write");
    do_drop_buffer(d);
    {
        unsigned k = (unsigned)(d->nfails++ % FAIL_RING);
        if (d->nfails > FAIL_RING && d->fails[k].hi > d->fail_lost)
            d->fail_lost = d->fails[k].hi;
        d->fails[k].lo = d->buf_seq_lo;
        d->fails[k].hi = d->buf_seq_hi;
        d->fails[k].st = st;
    }
    if (ftruncate(d->active->fd, (off_t)d->buf_off) != 0) {
        /* The tail is then garbage that the start-up scan skips. */
    }
    pthread_rwlock_wrlock(&d->ilock);
    d->used -= d->active->size - d->buf_off;
    d->active->size = d->buf_off;
    d->active->sealed = 1;
    pthread_rwlock_unlock(&d->ilock);
    d->active = NULL;
    d->fill = 0;
    d->buf_seq_lo = 0;
    return st;
}

static int
do_fdatasync(tqkv_disk_t *d, int fd)
{
    cnt(&d->syncs, 1);
    if (fdatasync(fd) != 0) {
        cnt(&d->io_errors, 1);
        return -errno;
    }
    return 0;
}

/* Seals the active segment (written, and synced unless SYNC_NONE). */
static tqkv_status_t
do_seal(tqkv_disk_t *d)
{
    tqkv_status_t st = do_flush(d);
    if (d->active == NULL)
        return st;
    if (d->cfg.sync != TQKV_DISK_SYNC_NONE && do_fdatasync(d, d->active->fd) != 0 && st == TQKV_OK)
        st = TQKV_EIO;
    d->active->sealed = 1;
    d->active = NULL;
    return st;
}

static tqkv_status_t
do_new_segment(tqkv_disk_t *d)
{
    uint32_t id = d->seg_hi + 1;
    int fd = seg_open_file(d, id, 1);
    if (fd < 0) {
        int e = errno;
        fprintf(stderr, "tqkv disk: create segment %u in %s: %s\n", id, d->path, strerror(e));
        cnt(&d->io_errors, 1);
        return errno_status(e);
    }
    uint8_t *b = abuf(ALIGN);
    tqkv_disk_seg_header_t h;
    if (b == NULL) {
        close(fd);
        return TQKV_ENOMEM;
    }
    memset(b, 0, ALIGN);
    memset(&h, 0, sizeof(h));
    h.magic = TQKV_DISK_SEG_MAGIC;
    h.version = TQKV_DISK_VERSION;
    h.header_bytes = sizeof(h);
    h.seg_id = id;
    h.align = ALIGN;
    h.store_id = d->store_id;
    {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        h.created_ns = (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
    }
    h.crc32c = tqkv_crc32c(0, &h, 60);
    memcpy(b, &h, sizeof(h));
    ssize_t n = tqkv__io_rw(d->io, 1, fd, b, ALIGN, 0);
    free(b);
    if (n != ALIGN) {
        char name[64];
        snprintf(name, sizeof(name), TQKV_DISK_SEG_FMT, id);
        unlinkat(d->dirfd, name, 0);
        close(fd);
        cnt(&d->io_errors, 1);
        return errno_status(n < 0 ? (int)-n : ENOSPC);
    }
    if (d->cfg.sync != TQKV_DISK_SYNC_NONE)
        fsync(d->dirfd); /* the new name survives a power loss */
    seg_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        close(fd);
        return TQKV_ENOMEM;
    }
    s->id = id;
    s->fd = fd;
    s->size = ALIGN;
    s->min_seq = UINT64_MAX;
    atomic_init(&s->refs, 1);
    pthread_rwlock_wrlock(&d->ilock);
    int ok = do_seg_table_put(d, s);
    pthread_rwlock_unlock(&d->ilock);
    if (!ok) {
        close(fd);
        free(s);
        return TQKV_ENOMEM;
    }
    d->active = s;
    d->buf_off = ALIGN;
    d->fill = 0;
    return TQKV_OK;
}

typedef int (*scan_fn)(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg);
static tqkv_status_t scan_segment(tqkv_disk_t *d, seg_t *s, scan_fn fn, void *arg, int count);

static uint32_t do_commit_append(tqkv_disk_t *d, uint64_t rb, uint64_t seq);

/* Opens a segment when none is active and makes room in the write buffer for rb bytes
 * (wlock held; the capacity check is the caller's). */
static tqkv_status_t
do_prepare(tqkv_disk_t *d, uint64_t rb)
{
    tqkv_status_t st;
    if (d->active == NULL && (st = do_new_segment(d)) != TQKV_OK)
        return st;
    if (d->fill + rb > d->buf_cap) {
        if ((st = do_flush(d)) != TQKV_OK)
            return st;
        if (rb > d->buf_cap) {
            uint8_t *nb = abuf(rb);
            if (nb == NULL)
                return TQKV_ENOMEM;
            free(d->buf);
            d->buf = nb;
            d->buf_cap = rb;
        }
    }
    return TQKV_OK;
}

/* Room for a copy of rb bytes made while a segment is being dropped (wlock held): within
 * the whole capacity (the reserve is kept for these copies) plus slack, never evicting.
 * Tombstones get a segment of slack: the segment they leave is dropped right after, so
 * the tier is over its capacity only until then. */
static tqkv_status_t
do_room_reloc(tqkv_disk_t *d, uint64_t rb, uint64_t slack)
{
    tqkv_status_t st;
    if (d->active != NULL && d->active->size + rb > d->cfg.segment_bytes)
        if ((st = do_seal(d)) != TQKV_OK)
            return st;
    pthread_rwlock_rdlock(&d->ilock);
    int fits = d->used + rb + (d->active == NULL ? ALIGN : 0) <= d->cfg.capacity + slack;
    pthread_rwlock_unlock(&d->ilock);
    return fits ? do_prepare(d, rb) : TQKV_ENOSPC;
}

/* Copies the record rec (at off of s) to the head, keeping its seq, and moves its index
 * slot there, clearing its prefix mark (wlock held). dg: its digest (0 for a tombstone). */
static tqkv_status_t
do_relocate(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, uint64_t dg)
{
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    uint64_t rb = h->record_bytes;
    tqkv_status_t st =
        do_room_reloc(d, rb, (h->flags & TQKV_DISK_REC_TOMBSTONE) ? d->cfg.segment_bytes : 0);
    if (st != TQKV_OK)
        return st;
    uint32_t kb = key_bytes(h), crc = h->page_crc32c;
    rec_build(d->buf + d->fill, d->active->id, h->seq, h->flags, (const char *)k, h->ns_len,
              k + h->ns_len, h->hash_len, k + h->ns_len + h->hash_len, h->parent_len, h->layer,
              rec + tqkv_disk_page_offset(kb), h->page_len, h->bf16_bytes, &crc);
    uint32_t nseg = d->active->id;
    uint32_t nblk = do_commit_append(d, rb, h->seq);
    pthread_rwlock_wrlock(&d->ilock);
    if (h->flags & TQKV_DISK_REC_TOMBSTONE) {
        d->active->ntomb++;
    } else {
        uint64_t j = do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
        if (j != UINT64_MAX) {
            do_account(d, &d->slots[j], 0);
            d->slots[j].seg = nseg;
            d->slots[j].blk = nblk;
            d->slots[j].kids = 0; /* now after its children in the log */
            do_account(d, &d->slots[j], 1);
        }
        /* and its parent, if kept, before it again */
        do_mark_parent(d, (const char *)k, h->ns_len, k + h->ns_len + h->hash_len, h->parent_len,
                       h->layer);
    }
    pthread_rwlock_unlock(&d->ilock);
    cnt(&d->reloc_recs, 1);
    cnt(&d->reloc_bytes, rb);
    return TQKV_OK;
}

typedef struct evict_arg {
    uint64_t now;
    uint64_t budget; /* bytes of prefix records that may still be copied forward */
    uint64_t copied; /* records copied forward */
    int older;       /* a segment older than the victim exists: its tombstones must stay */
    int failed;      /* a record that must stay (leased, tombstone) could not be copied */
} evict_arg_t;

static int
evict_fn(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg)
{
    evict_arg_t *ea = arg;
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    uint64_t rb = h->record_bytes;
    if (h->flags & TQKV_DISK_REC_TOMBSTONE) {
        /* What it deletes can only be in this segment or older ones (copies go forward
         * only while live): needed while an older segment exists. */
        if (!ea->older)
            return 0;
        if (do_relocate(d, s, off, rec, 0) != TQKV_OK) {
            ea->failed = 1;
            return 1;
        }
        ea->copied++;
        return 0;
    }
    uint64_t dg = rec_digest(rec);
    pthread_rwlock_rdlock(&d->ilock);
    uint64_t j = do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
    int prefix = j != UINT64_MAX && d->slots[j].kids;
    if (prefix && h->parent_len > 0) {
        /* A prefix record is worth keeping only while its own parent is kept. */
        slot_t c[MAX_CANDS];
        uint64_t pdg = digest((const char *)k, h->ns_len, k + h->ns_len + h->hash_len,
                              h->parent_len, h->layer);
        int nc = do_idx_cands(d, pdg, c, MAX_CANDS);
        prefix = 0;
        for (int i = 0; i < nc; i++)
            prefix |= c[i].seg != s->id;
    }
    pthread_rwlock_unlock(&d->ilock);
    if (j == UINT64_MAX)
        return 0; /* dead */
    int must = leased(d, dg, ea->now);
    if (must || (prefix && ea->budget >= rb)) {
        if (do_relocate(d, s, off, rec, dg) == TQKV_OK) {
            if (!must)
                ea->budget -= rb;
            ea->copied++;
            return 0;
        }
        if (must) {
            ea->failed = 1;
            return 1;
        }
        ea->budget = 0; /* no room: the other prefix records go too */
    }
    pthread_rwlock_wrlock(&d->ilock);
    j = do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
    if (j != UINT64_MAX) {
        do_idx_remove_at(d, j);
        cnt(&d->ev_recs, 1);
    }
    pthread_rwlock_unlock(&d->ilock);
    return 0;
}

/* Drops one sealed segment to make room (wlock held): the oldest whose leased records
 * (and tombstones, when older segments exist) fit in the free space; those are copied to
 * the head first, and so are its prefix records whose parent is kept, up to the reserve.
 * 1 when a segment went, 0 when none could. */
static int
do_evict_oldest(tqkv_disk_t *d)
{
    uint64_t now = now_ms(d);
    uint32_t from = 0;
    for (;;) {
        seg_t *victim = NULL;
        uint64_t live = 0, ntomb = 0, room = 0;
        int older = 0;
        pthread_rwlock_wrlock(&d->ilock);
        uint32_t lo = do_seg_lo(d);
        for (uint32_t id = from > lo ? from : lo; id <= d->seg_hi && id < d->seg_cap; id++) {
            seg_t *s = d->segs[id];
            if (s != NULL && s->sealed && !s->busy && s != d->active) {
                victim = s;
                s->busy = 1;
                break;
            }
        }
        if (victim != NULL) {
            older = victim->id > lo;
            live = victim->live;
            ntomb = victim->ntomb;
            room = d->cfg.capacity > d->used ? d->cfg.capacity - d->used : 0;
        }
        pthread_rwlock_unlock(&d->ilock);
        if (victim == NULL)
            return 0;
        /* Leased records must fit in the capacity; tombstones may use a segment's slack
         * (do_room_reloc): passing a segment over for its tombstones alone could refuse
         * every segment while the oldest is being compacted (the stress test did). */
        uint64_t lb = live > 0 ? leased_bytes_in(d, victim->id, now) : 0;
        uint64_t tb = older ? ntomb * (uint64_t)ALIGN : 0;
        evict_arg_t ea = {now, d->reserve, 0, older, 0};
        if ((lb > 0 && lb + ALIGN > room) ||
            (lb + tb > 0 && lb + tb + ALIGN > room + d->cfg.segment_bytes)) {
            ea.failed = 1; /* passed over: what must stay does not fit */
        } else if (live > 0 || (older && ntomb > 0)) {
            scan_segment(d, victim, evict_fn, &ea, 0);
        }
        if (ea.failed) {
            cnt(&d->lease_skips, 1);
            pthread_rwlock_wrlock(&d->ilock);
            victim->busy = 0;
            pthread_rwlock_unlock(&d->ilock);
            from = victim->id + 1;
            continue;
        }
        if (ea.copied > 0) {
            /* The copies are written before the originals go (a kill -9 loses neither),
             * and with SYNC_ALWAYS synced (they were acknowledged). With SYNC_BATCH the
             * flusher syncs them within batch_ms, the window a Put has. A failure is
             * counted and logged by do_flush; the copies are then lost. */
            if (do_flush(d) == TQKV_OK && d->active != NULL && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
                do_fdatasync(d, d->active->fd);
        }
        cnt(&d->ev_segs, 1);
        seg_remove(d, victim);
        return 1;
    }
}

/* Makes room for a record of rb bytes at the end of the buffer. Puts and compaction copies
 * leave the reserve free (for the reclaimer's copies). */
static tqkv_status_t
do_reserve(tqkv_disk_t *d, uint64_t rb)
{
    tqkv_status_t st;
    if (rb + ALIGN > d->cfg.segment_bytes)
        return TQKV_ENOSPC;
    if (d->active != NULL && d->active->size + rb > d->cfg.segment_bytes)
        if ((st = do_seal(d)) != TQKV_OK)
            return st;
    for (;;) {
        uint64_t need = rb + (d->active == NULL ? ALIGN : 0);
        pthread_rwlock_rdlock(&d->ilock);
        int fits = d->used + need + d->reserve <= d->cfg.capacity;
        pthread_rwlock_unlock(&d->ilock);
        if (fits)
            break;
        if (!do_evict_oldest(d)) {
            /* Only the active segment is left: seal it so that it can go next. */
            if (d->active == NULL)
                return TQKV_ENOSPC;
            if ((st = do_seal(d)) != TQKV_OK)
                return st;
        }
    }
    return do_prepare(d, rb);
}

/* Appends a built record (rec_build into the buffer by the caller through fill):
 * accounting of size, seq range. Returns the record's block. */
static uint32_t
do_commit_append(tqkv_disk_t *d, uint64_t rb, uint64_t seq)
{
    uint32_t blk = (uint32_t)((d->buf_off + d->fill) / ALIGN);
    if (d->fill == 0)
        clock_gettime(CLOCK_MONOTONIC, &d->buf_since);
    d->fill += rb;
    if (d->buf_seq_lo == 0)
        d->buf_seq_lo = seq;
    if (seq > d->buf_seq_hi)
        d->buf_seq_hi = seq;
    cnt(&d->records, 1);
    pthread_rwlock_wrlock(&d->ilock);
    d->active->size += rb;
    d->used += rb;
    if (seq < d->active->min_seq)
        d->active->min_seq = seq;
    pthread_rwlock_unlock(&d->ilock);
    return blk;
}

/* ---- reading ---- */

/* Reads the record at (seg, blk) of nblk blocks into a new aligned buffer. */
static tqkv_status_t
read_record(tqkv_disk_t *d, seg_t *s, uint32_t blk, uint32_t nblk, int wlocked, uint8_t **out)
{
    size_t len = (size_t)nblk * ALIGN;
    uint64_t off = (uint64_t)blk * ALIGN;
    uint8_t *b = abuf(len);
    if (b == NULL)
        return TQKV_ENOMEM;
    if (!s->sealed) {
        if (!wlocked)
            pthread_mutex_lock(&d->wlock);
        if (d->active == s && off >= d->buf_off && off + len <= d->buf_off + d->fill) {
            memcpy(b, d->buf + (off - d->buf_off), len);
            if (!wlocked)
                pthread_mutex_unlock(&d->wlock);
            *out = b;
            return TQKV_OK;
        }
        if (!wlocked)
            pthread_mutex_unlock(&d->wlock);
    }
    ssize_t n = tqkv__io_rw(d->io, 0, s->fd, b, len, off);
    cnt(&d->reads, 1);
    if (n < 0) {
        cnt(&d->io_errors, 1);
        free(b);
        return TQKV_EIO;
    }
    cnt(&d->read_bytes, (uint64_t)n);
    if ((size_t)n < len)
        memset(b + n, 0, len - (size_t)n); /* fails the checks below */
    *out = b;
    return TQKV_OK;
}

/* ---- scanning ---- */

/* A segment read front to back with SCAN_DEPTH reads of SCAN_CHUNK in flight, so that
 * the disk works while the records already read are checked. Each chunk buffer has
 * SCAN_SPARE bytes in front of its data: the unparsed end of the previous chunk (a record
 * that straddles the boundary) is copied there, so every record is contiguous. A record
 * too large for that is read on its own. */
typedef struct sbuf {
    uint8_t *mem; /* SCAN_SPARE + SCAN_CHUNK bytes */
    tqkv__io_op_t op;
    int inflight;
} sbuf_t;

typedef struct sstream {
    tqkv_disk_t *d;
    int fd;
    uint64_t size, next; /* file size; offset of the next chunk to read */
    sbuf_t b[SCAN_DEPTH];
    int cur, head;     /* buffer holding the window (-1: none); oldest read in flight */
    const uint8_t *wp; /* the window: file bytes [ws, we) at wp */
    uint64_t ws, we;
    int err; /* a read failed */
} sstream_t;

static void
ss_submit(sstream_t *ss, int i)
{
    sbuf_t *b = &ss->b[i];
    if (ss->next >= ss->size || ss->err)
        return;
    memset(&b->op, 0, sizeof(b->op));
    b->op.fd = ss->fd;
    b->op.buf = b->mem + SCAN_SPARE;
    b->op.off = ss->next;
    b->op.len = ss->size - ss->next < SCAN_CHUNK ? (size_t)(ss->size - ss->next) : SCAN_CHUNK;
    b->op.len = (b->op.len + ALIGN - 1) / ALIGN * ALIGN; /* O_DIRECT: whole blocks */
    if (tqkv__io_submit(ss->d->io, &b->op) != 0) {
        ss->err = 1;
        return;
    }
    b->inflight = 1;
    ss->next += SCAN_CHUNK;
}

/* Waits for every read in flight (results dropped). */
static void
ss_drain(sstream_t *ss)
{
    for (int i = 0; i < SCAN_DEPTH; i++)
        if (ss->b[i].inflight) {
            tqkv__io_wait(ss->d->io, &ss->b[i].op);
            ss->b[i].inflight = 0;
        }
}

/* Restarts the read-ahead at off (ALIGN-aligned) with an empty window. */
static void
ss_reset(sstream_t *ss, uint64_t off)
{
    ss_drain(ss);
    ss->next = off;
    ss->cur = -1;
    ss->head = 0;
    ss->ws = ss->we = off;
    for (int i = 0; i < SCAN_DEPTH; i++)
        ss_submit(ss, i);
}

/* The file bytes [pos, pos + need) contiguous in memory (pos >= the window's start, and
 * moving forward only), or NULL at the end of the file, on a read error (ss->err), or
 * when they cannot be contiguous here (need > SCAN_SPARE + SCAN_CHUNK: *big = 1). */
static const uint8_t *
ss_get(sstream_t *ss, uint64_t pos, uint64_t need, int *big)
{
    *big = 0;
    while (pos + need > ss->we) {
        uint64_t left = pos < ss->we ? ss->we - pos : 0;
        if (need > (uint64_t)SCAN_SPARE + SCAN_CHUNK || left > SCAN_SPARE) {
            *big = 1;
            return NULL;
        }
        sbuf_t *b = &ss->b[ss->head];
        if (!b->inflight || ss->err)
            return NULL; /* nothing more was read: end of file */
        ssize_t n = tqkv__io_wait(ss->d->io, &b->op);
        b->inflight = 0;
        cnt(&ss->d->reads, 1);
        if (n < 0 || b->op.off != ss->we) {
            cnt(&ss->d->io_errors, 1);
            ss->err = 1;
            return NULL;
        }
        cnt(&ss->d->read_bytes, (uint64_t)n);
        if (left)
            memcpy(b->mem + SCAN_SPARE - left, ss->wp + (pos - ss->ws), left);
        int prev = ss->cur;
        ss->cur = ss->head;
        ss->head = (ss->head + 1) % SCAN_DEPTH;
        ss->wp = b->mem + SCAN_SPARE - left;
        ss->ws = pos < ss->we ? pos : ss->we;
        ss->we = b->op.off + (uint64_t)n;
        if (ss->we > ss->size)
            ss->we = ss->size;
        if (prev >= 0)
            ss_submit(ss, prev); /* the buffer just left: the next chunk */
        if ((size_t)n < b->op.len && ss->we < ss->size) {
            ss->size = ss->we; /* shorter than fstat said: a truncation under us */
        }
    }
    if (pos < ss->ws)
        return NULL; /* cannot happen: the scan moves forward */
    return ss->wp + (pos - ss->ws);
}

/* Calls fn for every valid record of s in file order. With count, bad records are
 * counted (corrupt: followed by a valid record; torn: at the end of the file). */
static tqkv_status_t
scan_segment(tqkv_disk_t *d, seg_t *s, scan_fn fn, void *arg, int count)
{
    struct stat sb;
    if (fstat(s->fd, &sb) != 0)
        return TQKV_EIO;
    sstream_t ss;
    memset(&ss, 0, sizeof(ss));
    ss.d = d;
    ss.fd = s->fd;
    ss.size = (uint64_t)sb.st_size;
    for (int i = 0; i < SCAN_DEPTH; i++)
        if ((ss.b[i].mem = abuf(SCAN_SPARE + SCAN_CHUNK)) == NULL) {
            for (int k = 0; k < i; k++)
                free(ss.b[k].mem);
            return TQKV_ENOMEM;
        }
    uint64_t pos = ALIGN;
    uint8_t *own = NULL; /* a record read on its own (larger than a window) */
    int bad = 0;
    tqkv_status_t st = TQKV_OK;
    ss_reset(&ss, pos);
    while (pos + ALIGN <= ss.size) {
        int big = 0;
        const uint8_t *p = ss_get(&ss, pos, ALIGN, &big);
        if (p == NULL)
            break;
        const tqkv_disk_rec_t *h = (const void *)p;
        uint64_t rb = h->record_bytes, have = ALIGN;
        if (h->magic == TQKV_DISK_REC_MAGIC && rb % ALIGN == 0 && rb >= ALIGN &&
            pos + rb <= ss.size) {
            /* The whole record, as far as the file has it. */
            p = ss_get(&ss, pos, rb, &big);
            if (p == NULL && big) {
                ss_drain(&ss);
                free(own);
                own = abuf(rb);
                if (own == NULL) {
                    st = TQKV_ENOMEM;
                    break;
                }
                ssize_t n = tqkv__io_rw(d->io, 0, s->fd, own, rb, pos);
                cnt(&d->reads, 1);
                if (n < 0) {
                    cnt(&d->io_errors, 1);
                    st = TQKV_EIO;
                    break;
                }
                cnt(&d->read_bytes, (uint64_t)n);
                if ((uint64_t)n < rb)
                    memset(own + n, 0, rb - (uint64_t)n); /* fails the checks below */
                p = own;
                ss_reset(&ss, pos + rb);
            } else if (p == NULL) {
                break;
            }
            have = rb;
        }
        if (!rec_header_ok(p, (size_t)have, s->id)) {
            bad = 1;
            if (p == own)
                ss_reset(&ss, pos + ALIGN);
            pos += ALIGN;
            continue;
        }
        if (bad) {
            if (count)
                cnt(&d->corrupt, 1);
            bad = 0;
        }
        if (!rec_page_ok(p)) {
            if (count) {
                if (pos + rb >= ss.size)
                    cnt(&d->torn, 1);
                else
                    cnt(&d->corrupt, 1);
            }
            pos += rb;
            continue;
        }
        if (fn(d, s, pos, p, arg) != 0)
            break;
        pos += rb;
    }
    if (ss.err && st == TQKV_OK)
        st = TQKV_EIO;
    if (count && st == TQKV_OK && (bad || pos < ss.size))
        cnt(&d->torn, 1); /* bad blocks, or less than a block, at the end */
    ss_drain(&ss);
    for (int i = 0; i < SCAN_DEPTH; i++)
        free(ss.b[i].mem);
    free(own);
    return st;
}

/* ---- rebuild ---- */

typedef struct rebuild {
    tomb_t *tombs;
    size_t ntomb, cap;
    uint64_t verify_reads;
} rebuild_t;

/* Reads the key of the record a slot points at and compares. */
static int
slot_key_is(tqkv_disk_t *d, const slot_t *sl, const uint8_t *rec)
{
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    seg_t *s;
    uint8_t *b = NULL;
    int same = 0;
    pthread_rwlock_rdlock(&d->ilock);
    s = do_seg_ref(d, sl->seg);
    pthread_rwlock_unlock(&d->ilock);
    if (s == NULL)
        return 0;
    if (read_record(d, s, sl->blk, 1, 0, &b) == TQKV_OK) {
        const tqkv_disk_rec_t *o = (const void *)b;
        size_t kb = key_bytes(h);
        same = o->magic == TQKV_DISK_REC_MAGIC && kb + TQKV_DISK_REC_HEADER <= ALIGN &&
               rec_key_is(b, (const char *)k, h->ns_len, k + h->ns_len, h->hash_len, h->layer);
    }
    free(b);
    seg_unref(s);
    return same;
}

static int
rebuild_fn(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg)
{
    rebuild_t *rb = arg;
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    if (h->seq > d->seq)
        d->seq = h->seq;
    if (h->seq < s->min_seq)
        s->min_seq = h->seq;
    if (h->flags & TQKV_DISK_REC_TOMBSTONE) {
        s->ntomb++;
        if (rb->ntomb == rb->cap) {
            size_t nc = rb->cap ? rb->cap * 2 : 16;
            tomb_t *n = realloc(rb->tombs, nc * sizeof(*n));
            if (n == NULL)
                return 1;
            rb->tombs = n;
            rb->cap = nc;
        }
        tomb_t *t = &rb->tombs[rb->ntomb++];
        t->seq = h->seq;
        t->layer = h->layer;
        t->ns_len = h->ns_len;
        t->hash_len = h->hash_len;
        memcpy(t->key, k, (size_t)h->ns_len + h->hash_len);
        return 0;
    }
    uint64_t dg = rec_digest(rec);
    slot_t sl = {
        .dg = dg, .seg = s->id, .blk = (uint32_t)(off / ALIGN), .nblk = h->record_bytes / ALIGN};
    slot_t cands[MAX_CANDS];
    pthread_rwlock_wrlock(&d->ilock);
    uint32_t ns = do_ns_get(d, (const char *)k, h->ns_len);
    int nc = do_idx_cands(d, dg, cands, MAX_CANDS);
    pthread_rwlock_unlock(&d->ilock);
    if (ns == UINT32_MAX)
        return 1;
    sl.ns = ns;
    if (h->layer > d->max_layer)
        d->max_layer = h->layer;
    for (int i = 0; i < nc; i++) {
        if (!slot_key_is(d, &cands[i], rec))
            continue;
        rb->verify_reads++;
        /* The same key twice (a re-put, or a compaction copy): the higher seq wins. */
        pthread_rwlock_wrlock(&d->ilock);
        uint64_t j = do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
        if (j != UINT64_MAX) {
            if (d->rseq[j] >= h->seq) {
                pthread_rwlock_unlock(&d->ilock);
                return 0;
            }
            do_idx_remove_at(d, j);
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    pthread_rwlock_wrlock(&d->ilock);
    uint64_t j = do_idx_insert(d, &sl);
    if (j != UINT64_MAX)
        d->rseq[j] = h->seq;
    do_mark_parent(d, (const char *)k, h->ns_len, k + h->ns_len + h->hash_len, h->parent_len,
                   h->layer); /* leaf-first marks, in log order as at run time */
    pthread_rwlock_unlock(&d->ilock);
    return j == UINT64_MAX;
}

/* Applies tombstones to the rebuilt index: records of a lower seq go. */
static void
apply_tombstones(tqkv_disk_t *d, rebuild_t *rb)
{
    for (size_t t = 0; t < rb->ntomb; t++) {
        tomb_t *tb = &rb->tombs[t];
        pthread_rwlock_wrlock(&d->ilock);
        uint32_t ns = do_ns_find(d, (const char *)tb->key, tb->ns_len,
                                 ns_hv((const char *)tb->key, tb->ns_len));
        if (ns == UINT32_MAX) {
            pthread_rwlock_unlock(&d->ilock);
            continue;
        }
        if (tb->hash_len == 0) {
            for (uint64_t i = 0; d->slots != NULL && i <= d->mask;) {
                if (d->slots[i].dg != 0 && d->slots[i].ns == ns && d->rseq[i] < tb->seq)
                    do_idx_remove_at(d, i); /* re-examine i: a slot may have moved in */
                else
                    i++;
            }
            pthread_rwlock_unlock(&d->ilock);
            continue;
        }
        pthread_rwlock_unlock(&d->ilock);
        uint32_t lo = tb->layer == TQKV_DISK_ALL_LAYERS ? 0 : tb->layer;
        uint32_t hi = tb->layer == TQKV_DISK_ALL_LAYERS ? d->max_layer : tb->layer;
        for (uint32_t l = lo; l <= hi; l++) {
            uint64_t dg =
                digest((const char *)tb->key, tb->ns_len, tb->key + tb->ns_len, tb->hash_len, l);
            slot_t cands[MAX_CANDS];
            pthread_rwlock_rdlock(&d->ilock);
            int nc = do_idx_cands(d, dg, cands, MAX_CANDS);
            pthread_rwlock_unlock(&d->ilock);
            for (int i = 0; i < nc; i++) {
                /* A fake record header carrying the tombstone's key, to compare. */
                uint8_t fake[TQKV_DISK_REC_HEADER + TQKV_DISK_MAX_KEY];
                tqkv_disk_rec_t *fh = (void *)fake;
                memset(fh, 0, sizeof(*fh));
                fh->ns_len = (uint16_t)tb->ns_len;
                fh->hash_len = tb->hash_len;
                fh->layer = l;
                memcpy(fake + TQKV_DISK_REC_HEADER, tb->key, (size_t)tb->ns_len + tb->hash_len);
                if (!slot_key_is(d, &cands[i], fake))
                    continue;
                pthread_rwlock_wrlock(&d->ilock);
                uint64_t j = do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
                if (j != UINT64_MAX && d->rseq[j] < tb->seq)
                    do_idx_remove_at(d, j);
                pthread_rwlock_unlock(&d->ilock);
            }
        }
    }
}

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The parallel start-up scan. Up to REBUILD_THREADS workers each take the next segment,
 * check its header and scan it (read-ahead, CRC checks), collecting its valid records'
 * headers and keys; the opening thread applies the segments to the index in id order
 * (rebuild_fn, as a sequential scan would), overlapping with the workers' reads. A
 * worker stays at most REBUILD_AHEAD segments ahead of the one being applied, which
 * bounds the memory held by collected records. */
#define REBUILD_AHEAD (2 * REBUILD_THREADS)

typedef struct rseg {
    uint32_t id;
    int done;        /* mu */
    int state;       /* 1 scanned, 2 torn (no header), 3 bad header or unreadable */
    const char *why; /* states 2, 3 (static) */
    seg_t *s;        /* state 1: owned until put in the table */
    tqkv_status_t st;
    uint8_t *ent; /* entries: u64 offset, record header, ns and hash bytes, padded to 8 */
    size_t len, cap;
} rseg_t;

typedef struct rpar {
    tqkv_disk_t *d;
    rseg_t *segs;
    size_t n, next, applied;
    int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} rpar_t;

static int
collect_fn(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg)
{
    rseg_t *r = arg;
    const tqkv_disk_rec_t *h = (const void *)rec;
    size_t kb = key_bytes(h); /* namespace, hash and parent: rebuild_fn marks the parent */
    size_t need = (8 + TQKV_DISK_REC_HEADER + kb + 7) & ~(size_t)7;
    (void)d;
    (void)s;
    if (r->len + need > r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 64 * 1024;
        while (nc < r->len + need)
            nc *= 2;
        uint8_t *n = realloc(r->ent, nc);
        if (n == NULL) {
            r->st = TQKV_ENOMEM;
            return 1;
        }
        r->ent = n;
        r->cap = nc;
    }
    memcpy(r->ent + r->len, &off, 8);
    memcpy(r->ent + r->len + 8, rec, TQKV_DISK_REC_HEADER + kb);
    r->len += need;
    return 0;
}

/* Opens segment r->id, checks its header and scans it (a worker; no lock held). */
static void
rebuild_scan_one(tqkv_disk_t *d, rseg_t *r)
{
    int fd = seg_open_file(d, r->id, 0);
    uint8_t *hb = abuf(ALIGN);
    tqkv_disk_seg_header_t h;
    struct stat sb;
    ssize_t got = -1;
    r->why = "cannot open or read it";
    r->state = 3;
    if (fd >= 0 && hb != NULL && fstat(fd, &sb) == 0 &&
        (got = tqkv__io_rw(d->io, 0, fd, hb, ALIGN, 0)) == ALIGN) {
        memcpy(&h, hb, sizeof(h));
        if (h.magic != TQKV_DISK_SEG_MAGIC || h.version != TQKV_DISK_VERSION)
            r->why = "bad magic or version";
        else if (h.seg_id != r->id)
            r->why = "segment id differs from the file name";
        else if (h.store_id != d->store_id)
            r->why = "store id differs from the superblock's (a file of another tier)";
        else if (h.crc32c != tqkv_crc32c(0, &h, 60))
            r->why = "bad CRC";
        else
            r->state = 1;
    } else if (got >= 0 && got < ALIGN) {
        r->why = "shorter than its header (a crash while creating it)";
        r->state = 2;
    }
    free(hb);
    if (r->state != 1) {
        if (fd >= 0)
            close(fd);
        return;
    }
    seg_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        close(fd);
        r->st = TQKV_ENOMEM;
        return;
    }
    s->id = r->id;
    s->fd = fd;
    s->size = (uint64_t)sb.st_size;
    s->min_seq = UINT64_MAX;
    s->sealed = 1;
    atomic_init(&s->refs, 1);
    r->s = s;
    tqkv_status_t st = scan_segment(d, s, collect_fn, r, 1);
    if (r->st == TQKV_OK)
        r->st = st;
}

static void *
rebuild_worker(void *arg)
{
    rpar_t *rp = arg;
    pthread_mutex_lock(&rp->mu);
    while (!rp->stop && rp->next < rp->n) {
        if (rp->next >= rp->applied + REBUILD_AHEAD) {
            pthread_cond_wait(&rp->cv, &rp->mu);
            continue;
        }
        rseg_t *r = &rp->segs[rp->next++];
        pthread_mutex_unlock(&rp->mu);
        rebuild_scan_one(rp->d, r);
        pthread_mutex_lock(&rp->mu);
        r->done = 1; /* the opening thread reads r after seeing this under mu */
        pthread_cond_broadcast(&rp->cv);
    }
    pthread_mutex_unlock(&rp->mu);
    return NULL;
}

/* Applies scanned segment r: into the table and its records into the index (the
 * opening thread). */
static tqkv_status_t
rebuild_apply(tqkv_disk_t *d, rseg_t *r, rebuild_t *rb, uint64_t *bytes, char *err, size_t errlen)
{
    char name[64];
    int state = r->state;
    snprintf(name, sizeof(name), TQKV_DISK_SEG_FMT, r->id);
    if (r->st != TQKV_OK && r->s == NULL) {
        snprintf(err, errlen, "scan of %s/%s failed: %s", d->path, name, tqkv_strerror(r->st));
        return r->st;
    }
    if (state == 2) {
        /* Created, header not written yet when the process died: holds no record. */
        fprintf(stderr, "tqkv disk: %s/%s: %s: removed (a torn segment)\n", d->path, name, r->why);
        cnt(&d->torn, 1);
        unlinkat(d->dirfd, name, 0);
        return TQKV_OK;
    }
    if (state != 1) {
        char bad[80];
        snprintf(bad, sizeof(bad), "%s.bad", name);
        fprintf(stderr, "tqkv disk: %s/%s: bad segment header (%s), renamed to %s\n", d->path, name,
                r->why, bad);
        cnt(&d->corrupt, 1);
        renameat(d->dirfd, name, d->dirfd, bad);
        return TQKV_OK;
    }
    seg_t *s = r->s;
    pthread_rwlock_wrlock(&d->ilock);
    int ok = do_seg_table_put(d, s);
    pthread_rwlock_unlock(&d->ilock);
    if (!ok) {
        snprintf(err, errlen, "out of memory rebuilding the index of %s", d->path);
        return TQKV_ENOMEM; /* r->s is freed by the caller */
    }
    r->s = NULL; /* the table's */
    *bytes += s->size;
    if (r->st != TQKV_OK) {
        snprintf(err, errlen, "scan of %s/%s failed: %s", d->path, name, tqkv_strerror(r->st));
        return r->st;
    }
    for (size_t off = 0; off < r->len;) {
        uint64_t roff;
        const uint8_t *rec = r->ent + off + 8;
        const tqkv_disk_rec_t *h = (const void *)rec;
        memcpy(&roff, r->ent + off, 8);
        if (rebuild_fn(d, s, roff, rec, rb) != 0) {
            snprintf(err, errlen, "out of memory rebuilding the index of %s", d->path);
            return TQKV_ENOMEM;
        }
        off += (8 + TQKV_DISK_REC_HEADER + (size_t)key_bytes(h) + 7) & ~(size_t)7;
    }
    free(r->ent);
    r->ent = NULL;
    r->len = r->cap = 0;
    return TQKV_OK;
}

/* Opens every segment file of the directory (sorted by id) and rebuilds the index. */
static tqkv_status_t
rebuild(tqkv_disk_t *d, char *err, size_t errlen)
{
    DIR *dir = fdopendir(dup(d->dirfd));
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    rebuild_t rb = {0};
    double t0 = now_s();
    uint64_t bytes = 0;
    tqkv_status_t st = TQKV_OK;

    if (dir == NULL) {
        snprintf(err, errlen, "cannot list %s: %s", d->path, strerror(errno));
        return TQKV_EIO;
    }
    for (struct dirent *e; (e = readdir(dir)) != NULL;) {
        unsigned id;
        char tail[8];
        if (sscanf(e->d_name, "seg-%10u.tq%7s", &id, tail) != 2 || strcmp(tail, "d") != 0)
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            uint32_t *ni = realloc(ids, cap * sizeof(*ni));
            if (ni == NULL) {
                closedir(dir);
                free(ids);
                return TQKV_ENOMEM;
            }
            ids = ni;
        }
        ids[n++] = id;
    }
    closedir(dir);
    if (n > 1)
        qsort(ids, n, sizeof(*ids), cmp_u32);
    d->rseq = calloc(1, sizeof(uint64_t)); /* marks "rebuilding" for do_idx_grow */
    pthread_rwlock_wrlock(&d->ilock);
    int ok = do_idx_grow(d);
    pthread_rwlock_unlock(&d->ilock);
    rpar_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.d = d;
    rp.n = n;
    rp.segs = calloc(n ? n : 1, sizeof(*rp.segs));
    if (d->rseq == NULL || !ok || rp.segs == NULL) {
        free(ids);
        free(rp.segs);
        return TQKV_ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        rp.segs[i].id = ids[i];
    free(ids);
    pthread_mutex_init(&rp.mu, NULL);
    pthread_cond_init(&rp.cv, NULL);
    pthread_t th[REBUILD_THREADS];
    int nth = 0;
    while (nth < REBUILD_THREADS && (size_t)nth < n &&
           pthread_create(&th[nth], NULL, rebuild_worker, &rp) == 0)
        nth++;
    for (size_t i = 0; i < n && st == TQKV_OK; i++) {
        rseg_t *r = &rp.segs[i];
        pthread_mutex_lock(&rp.mu);
        if (nth == 0 && rp.next == i) { /* no worker could start: scan it here */
            rp.next++;
            pthread_mutex_unlock(&rp.mu);
            rebuild_scan_one(d, r);
            pthread_mutex_lock(&rp.mu);
            r->done = 1;
        }
        while (!r->done)
            pthread_cond_wait(&rp.cv, &rp.mu);
        pthread_mutex_unlock(&rp.mu);
        st = rebuild_apply(d, r, &rb, &bytes, err, errlen);
        pthread_mutex_lock(&rp.mu);
        rp.applied = i + 1;
        pthread_cond_broadcast(&rp.cv);
        pthread_mutex_unlock(&rp.mu);
    }
    pthread_mutex_lock(&rp.mu);
    rp.stop = 1;
    pthread_cond_broadcast(&rp.cv);
    pthread_mutex_unlock(&rp.mu);
    for (int i = 0; i < nth; i++)
        pthread_join(th[i], NULL);
    for (size_t i = 0; i < n; i++) {
        if (rp.segs[i].s != NULL)
            seg_unref(rp.segs[i].s); /* scanned, not applied (an error) */
        free(rp.segs[i].ent);
    }
    free(rp.segs);
    pthread_cond_destroy(&rp.cv);
    pthread_mutex_destroy(&rp.mu);
    if (st != TQKV_OK) {
        free(rb.tombs);
        return st;
    }
    apply_tombstones(d, &rb);
    free(rb.tombs);
    free(d->rseq);
    d->rseq = NULL;
    d->rebuild_seconds = now_s() - t0;
    d->rebuild_bytes = bytes;
    return TQKV_OK;
}

/* ---- superblock ---- */

static tqkv_status_t
super_load(tqkv_disk_t *d, char *err, size_t errlen)
{
    uint8_t b[ALIGN];
    tqkv_disk_super_t sb;
    tqkv_status_t st = TQKV_OK;
    struct stat stt;
    ssize_t n;
    memset(&sb, 0, sizeof(sb));
    int fd = openat(d->dirfd, TQKV_DISK_SUPER_NAME, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || fstat(fd, &stt) != 0) {
        snprintf(err, errlen, "cannot open %s/%s: %s", d->path, TQKV_DISK_SUPER_NAME,
                 strerror(errno));
        if (fd >= 0)
            close(fd);
        return TQKV_EIO;
    }
    if (d->direct) {
        int t = openat(d->dirfd, TQKV_DISK_SUPER_NAME, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (t >= 0) {
            close(t);
        } else {
            d->direct = 0;
            snprintf(d->direct_why, sizeof(d->direct_why),
                     "the file system refuses O_DIRECT (%s; tmpfs?): buffered I/O",
                     strerror(errno));
        }
    }
    if (stt.st_size == 0) {
        /* New (or empty: a crash while creating it, before any segment existed). */
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        memset(&sb, 0, sizeof(sb));
        sb.magic = TQKV_DISK_SUPER_MAGIC;
        sb.version = TQKV_DISK_VERSION;
        sb.header_bytes = sizeof(sb);
        sb.align = ALIGN;
        sb.segment_bytes = d->cfg.segment_bytes;
        if (getrandom(&sb.store_id, sizeof(sb.store_id), 0) != sizeof(sb.store_id))
            sb.store_id = tqkv__mix64((uint64_t)t.tv_nsec ^ ((uint64_t)getpid() << 32));
        sb.created_ns = (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
        sb.crc32c = tqkv_crc32c(0, &sb, 60);
        memset(b, 0, ALIGN);
        memcpy(b, &sb, sizeof(sb));
        if (pwrite(fd, b, ALIGN, 0) != ALIGN || fsync(fd) != 0) {
            snprintf(err, errlen, "cannot write %s/%s: %s", d->path, TQKV_DISK_SUPER_NAME,
                     strerror(errno));
            st = TQKV_EIO;
        }
        fsync(d->dirfd);
    } else if ((n = pread(fd, b, ALIGN, 0)) < 0) {
        snprintf(err, errlen, "cannot read %s/%s: %s", d->path, TQKV_DISK_SUPER_NAME,
                 strerror(errno));
        st = TQKV_EIO;
    } else if (n < (ssize_t)sizeof(sb)) {
        snprintf(err, errlen, "%s/%s is not a tqkv disk superblock (%zd bytes)", d->path,
                 TQKV_DISK_SUPER_NAME, n);
        st = TQKV_EFORMAT;
    } else {
        memcpy(&sb, b, sizeof(sb));
        if (sb.magic != TQKV_DISK_SUPER_MAGIC || sb.crc32c != tqkv_crc32c(0, &sb, 60)) {
            snprintf(err, errlen, "%s/%s is not a tqkv disk superblock (bad magic or CRC)", d->path,
                     TQKV_DISK_SUPER_NAME);
            st = TQKV_EFORMAT;
        } else if (sb.version != TQKV_DISK_VERSION || sb.align != ALIGN) {
            snprintf(err, errlen, "%s: disk format version %u (this build reads %u)", d->path,
                     sb.version, TQKV_DISK_VERSION);
            st = TQKV_EFORMAT;
        } else if (sb.segment_bytes >= 2 * ALIGN && sb.segment_bytes % ALIGN == 0) {
            if (sb.segment_bytes < d->cfg.segment_bytes)
                d->cfg.segment_bytes = sb.segment_bytes;
        }
    }
    d->store_id = sb.store_id;
    close(fd);
    return st;
}

/* ---- background: flusher and compactor ---- */

static tqkv_status_t sync_to(tqkv_disk_t *d, uint64_t seq);

static void *
bg_main(void *arg)
{
    tqkv_disk_t *d = arg;
    unsigned ticks = 0;
    pthread_mutex_lock(&d->bg_lock);
    while (!d->bg_stop) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        uint64_t ns = (uint64_t)d->cfg.batch_ms * 1000000ULL;
        t.tv_sec += (time_t)(ns / 1000000000ULL);
        t.tv_nsec += (long)(ns % 1000000000ULL);
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&d->bg_cond, &d->bg_lock, &t);
        if (d->bg_stop)
            break;
        pthread_mutex_unlock(&d->bg_lock);
        pthread_mutex_lock(&d->wlock);
        uint64_t hi = d->fill > 0 ? d->buf_seq_hi : 0;
        if (hi != 0 && d->cfg.sync == TQKV_DISK_SYNC_NONE)
            do_flush(d);
        pthread_mutex_unlock(&d->wlock);
        if (hi != 0 && d->cfg.sync == TQKV_DISK_SYNC_BATCH)
            sync_to(d, hi);
        if (d->cfg.compact_thread && ++ticks % 8 == 0) {
            int done = 1;
            for (int i = 0; i < 4 && done; i++)
                if (tqkv_disk_compact(d, d->cfg.compact_dead, &done) != TQKV_OK)
                    break;
        }
        pthread_mutex_lock(&d->bg_lock);
    }
    pthread_mutex_unlock(&d->bg_lock);
    return NULL;
}

/* Group commit: returns once every record up to hi is written and fdatasync'ed, or the
 * status of a failed batch that held a record of seq lo..hi (such a record was never
 * stored). A failure too old to be remembered fails [lo, hi] when it may have held one. */
static tqkv_status_t
sync_range(tqkv_disk_t *d, uint64_t lo, uint64_t hi)
{
    tqkv_status_t st = TQKV_OK;
    pthread_mutex_lock(&d->slock);
    if (d->durable_seq < hi) {
        seg_t *s = NULL;
        pthread_mutex_lock(&d->wlock);
        uint64_t top = d->seq;
        st = do_flush(d);
        if (d->active != NULL) {
            s = d->active;
            atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
        }
        pthread_mutex_unlock(&d->wlock);
        if (s != NULL) {
            if (do_fdatasync(d, s->fd) != 0 && st == TQKV_OK)
                st = TQKV_EIO;
            seg_unref(s);
        }
        if (st == TQKV_OK)
            d->durable_seq = top;
    }
    pthread_mutex_unlock(&d->slock);
    pthread_mutex_lock(&d->wlock);
    uint64_t n = d->nfails < FAIL_RING ? d->nfails : FAIL_RING;
    for (uint64_t i = 0; i < n; i++)
        if (d->fails[i].lo <= hi && d->fails[i].hi >= lo)
            st = d->fails[i].st;
    if (d->fail_lost != 0 && d->fail_lost >= lo && st == TQKV_OK)
        st = TQKV_EIO;
    pthread_mutex_unlock(&d->wlock);
    return st;
}

static tqkv_status_t
sync_to(tqkv_disk_t *d, uint64_t seq)
{
    return sync_range(d, seq, seq);
}

/* ---- public ---- */

void
tqkv_disk_config_default(tqkv_disk_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->capacity = 0;
    cfg->segment_bytes = 256ULL << 20;
    cfg->batch_bytes = 4u << 20;
    cfg->batch_ms = 10;
    cfg->sync = TQKV_DISK_SYNC_BATCH;
    cfg->io = TQKV_DISK_IO_AUTO;
    cfg->direct = 1;
    cfg->io_threads = 4;
    cfg->compact_dead = 0.5;
    cfg->compact_thread = 1;
    cfg->relocate = 0.25;
}

tqkv_status_t
tqkv_disk_open(const tqkv_disk_config_t *cfg, tqkv_disk_t **out, char *err, size_t errlen)
{
    char dummy[8];
    tqkv_status_t st;
    tqkv_disk_t *d;

    if (err == NULL) {
        err = dummy;
        errlen = sizeof(dummy);
    }
    err[0] = '\0';
    if (cfg == NULL || out == NULL || cfg->path == NULL || cfg->path[0] == '\0' ||
        cfg->capacity < 4 * (uint64_t)ALIGN) {
        snprintf(err, errlen, "disk tier: a path and a capacity of at least 16 KiB are needed");
        return TQKV_EINVAL;
    }
    *out = NULL;
    d = calloc(1, sizeof(*d));
    if (d == NULL)
        return TQKV_ENOMEM;
    d->cfg = *cfg;
    if (d->cfg.segment_bytes == 0)
        d->cfg.segment_bytes = 256ULL << 20;
    if (d->cfg.segment_bytes > d->cfg.capacity / 4)
        d->cfg.segment_bytes = d->cfg.capacity / 4;
    d->cfg.segment_bytes = d->cfg.segment_bytes / ALIGN * ALIGN;
    if (d->cfg.segment_bytes < 2 * ALIGN)
        d->cfg.segment_bytes = 2 * ALIGN;
    if (d->cfg.batch_bytes < ALIGN)
        d->cfg.batch_bytes = 4u << 20;
    d->cfg.batch_bytes = d->cfg.batch_bytes / ALIGN * ALIGN;
    if (d->cfg.batch_ms == 0)
        d->cfg.batch_ms = 10;
    if (d->cfg.compact_dead <= 0 || d->cfg.compact_dead > 1)
        d->cfg.compact_dead = 0.5;
    if (!(d->cfg.relocate >= 0)) /* NaN too */
        d->cfg.relocate = 0;
    if (d->cfg.relocate > 1)
        d->cfg.relocate = 1;
    d->reserve = (uint64_t)(d->cfg.relocate * (double)d->cfg.segment_bytes) / ALIGN * ALIGN;
    d->path = strdup(cfg->path);
    d->direct = cfg->direct;
    if (!d->direct)
        snprintf(d->direct_why, sizeof(d->direct_why), "O_DIRECT off by configuration");
    pthread_rwlock_init(&d->ilock, NULL);
    pthread_mutex_init(&d->wlock, NULL);
    pthread_mutex_init(&d->slock, NULL);
    pthread_mutex_init(&d->compact_lock, NULL);
    pthread_mutex_init(&d->lease_lock, NULL);
    pthread_mutex_init(&d->bg_lock, NULL);
    pthread_cond_init(&d->bg_cond, NULL);
    d->dirfd = -1;

    if (d->path == NULL) {
        st = TQKV_ENOMEM;
        goto fail;
    }
    if (mkdir(d->path, 0755) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "cannot create %s: %s", d->path, strerror(errno));
        st = TQKV_EIO;
        goto fail;
    }
    d->dirfd = open(d->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dirfd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", d->path, strerror(errno));
        st = TQKV_EIO;
        goto fail;
    }
    if ((st = tqkv__io_create(cfg->io, cfg->io_threads, &d->io, err, errlen)) != TQKV_OK)
        goto fail;
    if ((st = super_load(d, err, errlen)) != TQKV_OK)
        goto fail;
    if ((st = rebuild(d, err, errlen)) != TQKV_OK)
        goto fail;
    d->buf_cap = d->cfg.batch_bytes;
    d->buf = abuf(d->buf_cap);
    if (d->buf == NULL) {
        st = TQKV_ENOMEM;
        goto fail;
    }
    d->durable_seq = d->seq;
    if (pthread_create(&d->bg, NULL, bg_main, d) != 0) {
        st = TQKV_ENOMEM;
        goto fail;
    }
    d->bg_running = 1;
    if (!cfg->quiet) {
        tqkv_disk_stats_t s;
        tqkv_disk_stats(d, &s);
        fprintf(stderr,
                "tqkv disk: %s: %llu pages, %llu bytes in %llu segments, rebuilt in %.3f s "
                "(%.2f GB/s); %llu corrupt and %llu torn records skipped; index %.1f bytes/page\n",
                d->path, (unsigned long long)s.pages, (unsigned long long)s.bytes_used,
                (unsigned long long)s.segments, s.rebuild_seconds,
                s.rebuild_seconds > 0 ? (double)s.rebuild_bytes / s.rebuild_seconds / 1e9 : 0.0,
                (unsigned long long)s.corrupt, (unsigned long long)s.torn,
                s.pages ? (double)s.index_bytes / (double)s.pages : 0.0);
        const char *why = tqkv__io_fallback_reason(d->io);
        fprintf(stderr, "tqkv disk: I/O engine %s%s%s%s; O_DIRECT %s%s%s%s; sync %s\n",
                tqkv__io_name(d->io), *why ? " (" : "", why, *why ? ")" : "",
                d->direct ? "on" : "off", d->direct_why[0] ? " (" : "", d->direct_why,
                d->direct_why[0] ? ")" : "",
                cfg->sync == TQKV_DISK_SYNC_ALWAYS  ? "always"
                : cfg->sync == TQKV_DISK_SYNC_BATCH ? "batch"
                                                    : "none");
    }
    *out = d;
    return TQKV_OK;
fail:
    tqkv_disk_close(d);
    return st;
}

void
tqkv_disk_close(tqkv_disk_t *d)
{
    if (d == NULL)
        return;
    if (d->bg_running) {
        pthread_mutex_lock(&d->bg_lock);
        d->bg_stop = 1;
        pthread_cond_signal(&d->bg_cond);
        pthread_mutex_unlock(&d->bg_lock);
        pthread_join(d->bg, NULL);
    }
    if (d->io != NULL) {
        pthread_mutex_lock(&d->wlock);
        if (d->active != NULL)
            do_seal(d);
        pthread_mutex_unlock(&d->wlock);
    }
    for (uint32_t i = 0; i < d->seg_cap; i++)
        if (d->segs[i] != NULL)
            seg_unref(d->segs[i]);
    free(d->segs);
    for (uint32_t i = 0; i < d->nns; i++)
        free(d->ns[i].name);
    free(d->ns);
    free(d->ns_map);
    free(d->slots);
    free(d->rseq);
    free(d->buf);
    free(d->lease_dg);
    free(d->lease_until);
    tqkv__io_destroy(d->io);
    if (d->dirfd >= 0)
        close(d->dirfd);
    pthread_cond_destroy(&d->bg_cond);
    pthread_mutex_destroy(&d->bg_lock);
    pthread_mutex_destroy(&d->compact_lock);
    pthread_mutex_destroy(&d->lease_lock);
    pthread_mutex_destroy(&d->slock);
    pthread_mutex_destroy(&d->wlock);
    pthread_rwlock_destroy(&d->ilock);
    free(d->path);
    free(d);
}

static int
valid_key(const tqkv_block_key_t *k)
{
    return k != NULL && (k->ns != NULL || k->ns_len == 0) && k->ns_len <= 1024 && k->hash != NULL &&
           k->hash_len >= 1 && k->hash_len <= 64 && k->layer != TQKV_DISK_ALL_LAYERS;
}

/* Removes every slot holding key except the one at (seg, blk) (wlock held). Records in
 * the buffer are compared there, others are read. */
static void
do_drop_key(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t dg, uint32_t keep_seg,
            uint32_t keep_blk, uint64_t *pages, uint64_t *bytes)
{
    slot_t cands[MAX_CANDS];
    pthread_rwlock_rdlock(&d->ilock);
    int nc = do_idx_cands(d, dg, cands, MAX_CANDS);
    pthread_rwlock_unlock(&d->ilock);
    for (int i = 0; i < nc; i++) {
        if (cands[i].seg == keep_seg && cands[i].blk == keep_blk)
            continue;
        const uint8_t *p = NULL;
        uint8_t *b = NULL;
        uint64_t off = (uint64_t)cands[i].blk * ALIGN;
        if (d->active && cands[i].seg == d->active->id && off >= d->buf_off) {
            p = d->buf + (off - d->buf_off);
        } else {
            seg_t *s;
            pthread_rwlock_rdlock(&d->ilock);
            s = do_seg_ref(d, cands[i].seg);
            pthread_rwlock_unlock(&d->ilock);
            if (s != NULL && read_record(d, s, cands[i].blk, 1, 1, &b) == TQKV_OK)
                p = b;
            if (s != NULL)
                seg_unref(s);
        }
        if (p != NULL &&
            rec_key_is(p, key->ns, key->ns_len, key->hash, key->hash_len, key->layer)) {
            pthread_rwlock_wrlock(&d->ilock);
            uint64_t j = do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
            if (j != UINT64_MAX) {
                if (pages)
                    (*pages)++;
                if (bytes)
                    *bytes += (uint64_t)d->slots[j].nblk * ALIGN;
                do_idx_remove_at(d, j);
            }
            pthread_rwlock_unlock(&d->ilock);
        }
        free(b);
    }
}

tqkv_status_t
tqkv_disk_append(tqkv_disk_t *d, const tqkv_block_key_t *key, const uint8_t *parent,
                 size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes,
                 uint64_t *seq_out)
{
    tqkv_status_t st;
    if (seq_out)
        *seq_out = 0;
    if (d == NULL || !valid_key(key) || page == NULL || len == 0 || len > UINT32_MAX ||
        parent_len > 64 || (parent_len > 0 && parent == NULL))
        return TQKV_EINVAL;
    uint32_t kb = (uint32_t)(key->ns_len + key->hash_len + parent_len);
    uint64_t rb = tqkv_disk_record_bytes(kb, len);
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    uint64_t seq;

    pthread_mutex_lock(&d->wlock);
    if ((st = do_reserve(d, rb)) != TQKV_OK) {
        pthread_mutex_unlock(&d->wlock);
        if (st == TQKV_ENOSPC)
            cnt(&d->refused, 1);
        return st;
    }
    seq = ++d->seq;
    rec_build(d->buf + d->fill, d->active->id, seq, 0, key->ns, key->ns_len, key->hash,
              key->hash_len, parent, parent_len, key->layer, page, len, bf16_bytes, NULL);
    uint32_t seg = d->active->id;
    uint32_t blk = do_commit_append(d, rb, seq);
    slot_t sl = {.dg = dg, .seg = seg, .blk = blk, .nblk = (uint32_t)(rb / ALIGN)};
    pthread_rwlock_wrlock(&d->ilock);
    sl.ns = do_ns_get(d, key->ns, key->ns_len);
    uint64_t at = sl.ns == UINT32_MAX ? UINT64_MAX : do_idx_insert(d, &sl);
    if (at != UINT64_MAX)
        do_mark_parent(d, key->ns, key->ns_len, parent, parent_len, key->layer);
    if (key->layer > d->max_layer)
        d->max_layer = key->layer;
    pthread_rwlock_unlock(&d->ilock);
    if (at == UINT64_MAX) {
        st = TQKV_ENOMEM; /* the record is on disk but not indexed: dead space */
    } else {
        do_drop_key(d, key, dg, seg, blk, NULL, NULL); /* an earlier record of key */
    }
    if (st == TQKV_OK && d->fill >= d->buf_cap)
        st = do_flush(d);
    pthread_mutex_unlock(&d->wlock);
    if (st == TQKV_OK && seq_out)
        *seq_out = seq;
    return st;
}

tqkv_status_t
tqkv_disk_put(tqkv_disk_t *d, const tqkv_block_key_t *key, const uint8_t *parent, size_t parent_len,
              const void *page, size_t len, uint64_t bf16_bytes)
{
    uint64_t seq = 0;
    tqkv_status_t st = tqkv_disk_append(d, key, parent, parent_len, page, len, bf16_bytes, &seq);
    if (st == TQKV_OK && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
        st = sync_to(d, seq);
    return st;
}

tqkv_status_t
tqkv_disk_sync_range(tqkv_disk_t *d, uint64_t lo, uint64_t hi)
{
    if (d == NULL || lo > hi)
        return TQKV_EINVAL;
    return hi == 0 ? TQKV_OK : sync_range(d, lo ? lo : 1, hi);
}

uint64_t
tqkv_disk_last_seq(tqkv_disk_t *d)
{
    if (d == NULL)
        return 0;
    pthread_mutex_lock(&d->wlock);
    uint64_t seq = d->seq;
    pthread_mutex_unlock(&d->wlock);
    return seq;
}

int
tqkv_disk_contains(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t *rec_bytes)
{
    slot_t c[1] = {{0}};
    if (d == NULL || !valid_key(key))
        return 0;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int n = do_idx_cands(d, dg, c, 1);
    pthread_rwlock_unlock(&d->ilock);
    if (n && rec_bytes)
        *rec_bytes = (uint64_t)c[0].nblk * ALIGN;
    return n > 0;
}

tqkv_status_t
tqkv_disk_get(tqkv_disk_t *d, const tqkv_block_key_t *key, tqkv_disk_page_t *out)
{
    slot_t cands[MAX_CANDS];
    seg_t *segs[MAX_CANDS];
    tqkv_status_t result = TQKV_ENOTFOUND;
    if (out != NULL)
        memset(out, 0, sizeof(*out));
    if (d == NULL || out == NULL || !valid_key(key))
        return TQKV_EINVAL;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int nc = do_idx_cands(d, dg, cands, MAX_CANDS);
    for (int i = 0; i < nc; i++)
        segs[i] = do_seg_ref(d, cands[i].seg);
    pthread_rwlock_unlock(&d->ilock);
    int i;
    for (i = 0; i < nc; i++) {
        uint8_t *b = NULL;
        int bad = 0;
        if (segs[i] == NULL) {
            bad = 1; /* its segment went (dropped or compacted meanwhile) */
        } else {
            tqkv_status_t st = read_record(d, segs[i], cands[i].blk, cands[i].nblk, 0, &b);
            if (st != TQKV_OK) {
                result = st;
                continue;
            }
            if (!rec_header_ok(b, (size_t)cands[i].nblk * ALIGN, segs[i]->id)) {
                bad = 2;
            } else if (!rec_key_is(b, key->ns, key->ns_len, key->hash, key->hash_len, key->layer)) {
                free(b); /* another key with the same digest */
                continue;
            } else if (!rec_page_ok(b)) {
                bad = 2;
            }
        }
        if (bad) {
            if (bad == 2) {
                cnt(&d->corrupt, 1);
                fprintf(stderr,
                        "tqkv disk: record at segment %u offset %llu failed its CRC check: "
                        "dropped (a miss)\n",
                        cands[i].seg, (unsigned long long)cands[i].blk * ALIGN);
                result = TQKV_ECORRUPT;
            }
            pthread_rwlock_wrlock(&d->ilock);
            uint64_t j = do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
            if (j != UINT64_MAX &&
                (bad == 2 || cands[i].seg >= d->seg_cap || d->segs[cands[i].seg] == NULL))
                do_idx_remove_at(d, j);
            pthread_rwlock_unlock(&d->ilock);
            free(b);
            continue;
        }
        const tqkv_disk_rec_t *h = (const void *)b;
        out->buf = b;
        out->page = b + tqkv_disk_page_offset(key_bytes(h));
        out->len = h->page_len;
        out->bf16_bytes = h->bf16_bytes;
        out->parent_len = h->parent_len;
        memcpy(out->parent, b + TQKV_DISK_REC_HEADER + h->ns_len + h->hash_len, h->parent_len);
        result = TQKV_OK;
        break;
    }
    for (int k = 0; k < nc; k++)
        if (segs[k] != NULL)
            seg_unref(segs[k]);
    cnt(result == TQKV_OK ? &d->hits : &d->misses, 1);
    return result;
}

void
tqkv_disk_get_many(tqkv_disk_t *d, const tqkv_block_key_t *keys, size_t n, tqkv_disk_page_t *out,
                   tqkv_status_t *st)
{
    tqkv__io_op_t *ops = calloc(n ? n : 1, sizeof(*ops));
    seg_t **segs = calloc(n ? n : 1, sizeof(*segs));
    uint8_t *fast = calloc(n ? n : 1, 1);
    if (ops == NULL || segs == NULL || fast == NULL) {
        for (size_t i = 0; i < n; i++)
            st[i] = tqkv_disk_get(d, &keys[i], &out[i]);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        slot_t c[2];
        memset(&out[i], 0, sizeof(out[i]));
        st[i] = TQKV_ENOTFOUND;
        if (d == NULL || !valid_key(&keys[i])) {
            st[i] = TQKV_EINVAL;
            continue;
        }
        uint64_t dg =
            digest(keys[i].ns, keys[i].ns_len, keys[i].hash, keys[i].hash_len, keys[i].layer);
        pthread_rwlock_rdlock(&d->ilock);
        int nc = do_idx_cands(d, dg, c, 2);
        seg_t *s = nc == 1 ? do_seg_ref(d, c[0].seg) : NULL;
        pthread_rwlock_unlock(&d->ilock);
        if (nc == 0) {
            cnt(&d->misses, 1);
            continue;
        }
        /* Unique digest in a sealed segment: in this round; anything else one by one. */
        if (s != NULL && s->sealed) {
            ops[i].fd = s->fd;
            ops[i].len = (size_t)c[0].nblk * ALIGN;
            ops[i].off = (uint64_t)c[0].blk * ALIGN;
            ops[i].buf = abuf(ops[i].len);
            if (ops[i].buf != NULL && tqkv__io_submit(d->io, &ops[i]) == 0) {
                segs[i] = s;
                fast[i] = 1;
                continue;
            }
            free(ops[i].buf);
        }
        if (s != NULL)
            seg_unref(s);
        fast[i] = 2; /* one by one */
    }
    for (size_t i = 0; i < n; i++) {
        if (fast[i] == 1) {
            ssize_t r = tqkv__io_wait(d->io, &ops[i]);
            uint8_t *b = ops[i].buf;
            cnt(&d->reads, 1);
            if (r > 0)
                cnt(&d->read_bytes, (uint64_t)r);
            if (r == (ssize_t)ops[i].len && rec_header_ok(b, ops[i].len, segs[i]->id) &&
                rec_key_is(b, keys[i].ns, keys[i].ns_len, keys[i].hash, keys[i].hash_len,
                           keys[i].layer) &&
                rec_page_ok(b)) {
                const tqkv_disk_rec_t *h = (const void *)b;
                out[i].buf = b;
                out[i].page = b + tqkv_disk_page_offset(key_bytes(h));
                out[i].len = h->page_len;
                out[i].bf16_bytes = h->bf16_bytes;
                out[i].parent_len = h->parent_len;
                memcpy(out[i].parent, b + TQKV_DISK_REC_HEADER + h->ns_len + h->hash_len,
                       h->parent_len);
                st[i] = TQKV_OK;
                cnt(&d->hits, 1);
            } else {
                free(b);
                fast[i] = 2; /* a check failed or an error: the single path decides */
            }
            seg_unref(segs[i]);
        }
        if (fast[i] == 2)
            st[i] = tqkv_disk_get(d, &keys[i], &out[i]);
    }
done:
    free(ops);
    free(segs);
    free(fast);
}

void
tqkv_disk_page_free(tqkv_disk_page_t *p)
{
    if (p != NULL) {
        free(p->buf);
        p->buf = NULL;
    }
}

/* Appends a tombstone (wlock held); *seq gets its seq. */
static tqkv_status_t
do_tombstone(tqkv_disk_t *d, const char *ns, size_t nl, const uint8_t *hash, size_t hl,
             uint32_t layer, uint64_t *seq)
{
    uint64_t rb = tqkv_disk_record_bytes((uint32_t)(nl + hl), 0);
    tqkv_status_t st = do_reserve(d, rb);
    if (st != TQKV_OK)
        return st;
    *seq = ++d->seq;
    rec_build(d->buf + d->fill, d->active->id, *seq, TQKV_DISK_REC_TOMBSTONE, ns, nl, hash, hl,
              NULL, 0, layer, NULL, 0, 0, NULL);
    do_commit_append(d, rb, *seq);
    pthread_rwlock_wrlock(&d->ilock);
    d->active->ntomb++;
    pthread_rwlock_unlock(&d->ilock);
    return TQKV_OK;
}

tqkv_status_t
tqkv_disk_delete(tqkv_disk_t *d, const char *ns, size_t ns_len, const uint8_t *hash,
                 size_t hash_len, uint32_t layer, uint64_t *pages, uint64_t *bytes)
{
    uint64_t np = 0, nb = 0, seq = 0;
    tqkv_status_t st;
    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    if (d == NULL || (ns == NULL && ns_len > 0) || ns_len > 1024 || hash == NULL || hash_len == 0 ||
        hash_len > 64)
        return TQKV_EINVAL;
    pthread_mutex_lock(&d->wlock);
    uint32_t lo = layer == TQKV_DISK_ALL_LAYERS ? 0 : layer;
    uint32_t hi = layer == TQKV_DISK_ALL_LAYERS ? d->max_layer : layer;
    int any = 0;
    for (uint32_t l = lo; l <= hi && !any; l++) {
        tqkv_block_key_t k = {ns, ns_len, hash, hash_len, l};
        any = tqkv_disk_contains(d, &k, NULL);
    }
    if (!any) {
        pthread_mutex_unlock(&d->wlock);
        return TQKV_OK;
    }
    if ((st = do_tombstone(d, ns, ns_len, hash, hash_len, layer, &seq)) == TQKV_OK)
        for (uint32_t l = lo; l <= hi; l++) {
            tqkv_block_key_t k = {ns, ns_len, hash, hash_len, l};
            uint64_t dg = digest(ns, ns_len, hash, hash_len, l);
            do_drop_key(d, &k, dg, UINT32_MAX, UINT32_MAX, &np, &nb);
        }
    pthread_mutex_unlock(&d->wlock);
    if (st == TQKV_OK && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
        st = sync_to(d, seq);
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return st;
}

tqkv_status_t
tqkv_disk_delete_namespace(tqkv_disk_t *d, const char *ns, size_t ns_len, uint64_t *pages,
                           uint64_t *bytes)
{
    uint64_t np = 0, nb = 0, seq = 0;
    tqkv_status_t st = TQKV_OK;
    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    if (d == NULL || (ns == NULL && ns_len > 0) || ns_len > 1024)
        return TQKV_EINVAL;
    pthread_mutex_lock(&d->wlock);
    pthread_rwlock_rdlock(&d->ilock);
    uint32_t id = do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
    int any = id != UINT32_MAX && d->ns[id].pages > 0;
    pthread_rwlock_unlock(&d->ilock);
    if (any && (st = do_tombstone(d, ns, ns_len, NULL, 0, TQKV_DISK_ALL_LAYERS, &seq)) == TQKV_OK) {
        pthread_rwlock_wrlock(&d->ilock);
        for (uint64_t i = 0; d->slots != NULL && i <= d->mask;) {
            if (d->slots[i].dg != 0 && d->slots[i].ns == id) {
                np++;
                nb += (uint64_t)d->slots[i].nblk * ALIGN;
                do_idx_remove_at(d, i);
            } else {
                i++;
            }
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    pthread_mutex_unlock(&d->wlock);
    if (any && st == TQKV_OK && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
        st = sync_to(d, seq);
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return st;
}

static int
cmp_loc(const void *a, const void *b)
{
    const slot_t *x = a, *y = b;
    if (x->seg != y->seg)
        return x->seg < y->seg ? -1 : 1;
    return x->blk < y->blk ? -1 : x->blk > y->blk;
}

tqkv_status_t
tqkv_disk_evict_namespace(tqkv_disk_t *d, const char *ns, size_t ns_len, uint64_t need,
                          uint64_t *freed)
{
    uint64_t got = 0;
    tqkv_status_t st = TQKV_OK;
    if (freed)
        *freed = 0;
    if (d == NULL || (ns == NULL && ns_len > 0) || ns_len > 1024)
        return TQKV_EINVAL;
    pthread_mutex_lock(&d->wlock);
    pthread_rwlock_rdlock(&d->ilock);
    uint32_t id = do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
    if (id == UINT32_MAX || d->ns[id].pages == 0) {
        pthread_rwlock_unlock(&d->ilock);
        pthread_mutex_unlock(&d->wlock);
        return TQKV_OK;
    }
    uint64_t n = d->ns[id].pages, k = 0;
    slot_t *list = malloc(n * sizeof(*list));
    if (list == NULL) {
        pthread_rwlock_unlock(&d->ilock);
        pthread_mutex_unlock(&d->wlock);
        return TQKV_ENOMEM;
    }
    for (uint64_t i = 0; i <= d->mask && k < n; i++)
        if (d->slots[i].dg != 0 && d->slots[i].ns == id)
            list[k++] = d->slots[i];
    pthread_rwlock_unlock(&d->ilock);
    qsort(list, k, sizeof(*list), cmp_loc);
    uint64_t now = now_ms(d);
    /* Leaves first, then prefix records; oldest first within each; leased ones stay. */
    for (unsigned pass = 0; pass < 2 && got < need && st == TQKV_OK; pass++) {
        for (uint64_t i = 0; i < k && got < need; i++) {
            const slot_t *c = &list[i];
            if (c->kids != pass || leased(d, c->dg, now))
                continue;
            /* The key, for the tombstone, from the record's first block. */
            uint8_t *b = NULL;
            pthread_rwlock_rdlock(&d->ilock);
            seg_t *s = do_seg_ref(d, c->seg);
            pthread_rwlock_unlock(&d->ilock);
            if (s == NULL)
                continue;
            tqkv_status_t rs = read_record(d, s, c->blk, 1, 1, &b);
            seg_unref(s);
            const tqkv_disk_rec_t *h = (const void *)b;
            if (rs != TQKV_OK || h->magic != TQKV_DISK_REC_MAGIC ||
                TQKV_DISK_REC_HEADER + key_bytes(h) > ALIGN ||
                (h->flags & TQKV_DISK_REC_TOMBSTONE) || rec_digest(b) != c->dg ||
                h->ns_len != ns_len || memcmp(b + TQKV_DISK_REC_HEADER, ns, ns_len) != 0) {
                free(b);
                continue;
            }
            uint8_t hash[64];
            size_t hl = h->hash_len;
            uint32_t layer = h->layer;
            memcpy(hash, b + TQKV_DISK_REC_HEADER + ns_len, hl);
            free(b);
            uint64_t seq;
            if ((st = do_tombstone(d, ns, ns_len, hash, hl, layer, &seq)) != TQKV_OK)
                break;
            uint64_t before = got;
            pthread_rwlock_wrlock(&d->ilock);
            uint64_t j = do_idx_find_loc(d, c->dg, c->seg, c->blk);
            if (j != UINT64_MAX) {
                got += (uint64_t)d->slots[j].nblk * ALIGN;
                do_idx_remove_at(d, j);
            }
            pthread_rwlock_unlock(&d->ilock);
            if (j == UINT64_MAX) {
                /* Moved (copied forward while the tombstone made room): by key. */
                tqkv_block_key_t key = {ns, ns_len, hash, hl, layer};
                do_drop_key(d, &key, c->dg, UINT32_MAX, UINT32_MAX, NULL, &got);
            }
            if (got > before)
                cnt(&d->quota_drops, 1);
        }
    }
    pthread_mutex_unlock(&d->wlock);
    free(list);
    if (freed)
        *freed = got;
    return st;
}

tqkv_status_t
tqkv_disk_lease(tqkv_disk_t *d, const tqkv_block_key_t *key, uint32_t ms)
{
    if (d == NULL || !valid_key(key))
        return TQKV_EINVAL;
    if (!tqkv_disk_contains(d, key, NULL))
        return TQKV_ENOTFOUND;
    if (ms == 0)
        return TQKV_OK;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    uint64_t now = now_ms(d), until = now + ms;
    tqkv_status_t st = TQKV_OK;
    pthread_mutex_lock(&d->lease_lock);
    if ((d->lease_n + 1) * 2 > d->lease_cap) {
        /* Purge the expired ones; grow when still over half full. */
        uint64_t cap = d->lease_cap ? d->lease_cap : 64;
        if (!do_lease_rehash(d, cap, now) ||
            ((d->lease_n + 1) * 2 > d->lease_cap && !do_lease_rehash(d, cap * 2, now)))
            st = TQKV_ENOMEM;
    }
    if (st == TQKV_OK) {
        uint64_t i = do_lease_pos(d, dg);
        if (d->lease_dg[i] == 0) {
            d->lease_dg[i] = dg;
            d->lease_until[i] = until;
            d->lease_n++;
        } else if (until > d->lease_until[i]) {
            d->lease_until[i] = until;
        }
    }
    pthread_mutex_unlock(&d->lease_lock);
    return st;
}

void
tqkv__disk_debug_advance_clock(tqkv_disk_t *d, uint64_t ms)
{
    if (d != NULL)
        atomic_fetch_add_explicit(&d->clock_skew_ms, (int64_t)ms, memory_order_relaxed);
}

tqkv_status_t
tqkv_disk_sync(tqkv_disk_t *d)
{
    if (d == NULL)
        return TQKV_EINVAL;
    pthread_mutex_lock(&d->wlock);
    uint64_t seq = d->seq;
    pthread_mutex_unlock(&d->wlock);
    return seq == 0 ? TQKV_OK : sync_to(d, seq);
}

/* ---- compaction ---- */

typedef struct compact_arg {
    uint64_t other_min_seq; /* lowest record seq outside the victim */
    uint64_t copied;
    tqkv_status_t st;
} compact_arg_t;

static int
compact_fn(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, void *arg)
{
    compact_arg_t *ca = arg;
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    uint64_t dg = 0;
    int tomb = (h->flags & TQKV_DISK_REC_TOMBSTONE) != 0;
    if (tomb) {
        if (h->seq < ca->other_min_seq)
            return 0; /* shadows nothing that is left */
    } else {
        dg = rec_digest(rec);
        pthread_rwlock_rdlock(&d->ilock);
        uint64_t j = do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
        pthread_rwlock_unlock(&d->ilock);
        if (j == UINT64_MAX)
            return 0; /* dead */
    }
    pthread_mutex_lock(&d->wlock);
    uint64_t rb = h->record_bytes;
    tqkv_status_t st = do_reserve(d, rb);
    if (st != TQKV_OK) {
        pthread_mutex_unlock(&d->wlock);
        ca->st = st;
        return 1;
    }
    uint32_t kb = key_bytes(h);
    uint32_t crc = h->page_crc32c;
    rec_build(d->buf + d->fill, d->active->id, h->seq, h->flags, (const char *)k, h->ns_len,
              k + h->ns_len, h->hash_len, k + h->ns_len + h->hash_len, h->parent_len, h->layer,
              rec + tqkv_disk_page_offset(kb), h->page_len, h->bf16_bytes, &crc);
    uint32_t nseg = d->active->id;
    uint32_t nblk = do_commit_append(d, rb, h->seq);
    if (tomb) {
        pthread_rwlock_wrlock(&d->ilock);
        d->active->ntomb++;
        pthread_rwlock_unlock(&d->ilock);
    } else {
        pthread_rwlock_wrlock(&d->ilock);
        uint64_t j = do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
        if (j != UINT64_MAX) {
            do_account(d, &d->slots[j], 0);
            d->slots[j].seg = nseg;
            d->slots[j].blk = nblk;
            d->slots[j].kids = 0; /* now after its children in the log */
            do_account(d, &d->slots[j], 1);
            do_mark_parent(d, (const char *)k, h->ns_len, k + h->ns_len + h->hash_len,
                           h->parent_len, h->layer);
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    if (d->fill >= d->buf_cap)
        st = do_flush(d);
    pthread_mutex_unlock(&d->wlock);
    cnt(&d->compacted, 1);
    ca->copied++;
    if (st != TQKV_OK) {
        ca->st = st;
        return 1;
    }
    return 0;
}

tqkv_status_t
tqkv_disk_compact(tqkv_disk_t *d, double min_dead, int *done)
{
    seg_t *victim = NULL;
    double best = -1;
    compact_arg_t ca = {UINT64_MAX, 0, TQKV_OK};
    if (done)
        *done = 0;
    if (d == NULL)
        return TQKV_EINVAL;
    pthread_mutex_lock(&d->compact_lock);
    pthread_rwlock_wrlock(&d->ilock);
    for (uint32_t id = do_seg_lo(d); id <= d->seg_hi && id < d->seg_cap; id++) {
        seg_t *s = d->segs[id];
        if (s == NULL || !s->sealed || s->busy || s->size <= ALIGN) /* active: unsealed */
            continue;
        double dead = 1.0 - (double)s->live / (double)(s->size - ALIGN);
        if (dead >= min_dead && dead > best) {
            best = dead;
            victim = s;
        }
    }
    uint64_t vlive = 0, vtomb = 0;
    if (victim != NULL) {
        victim->busy = 1;
        vlive = victim->live;
        vtomb = victim->ntomb;
        atomic_fetch_add_explicit(&victim->refs, 1, memory_order_relaxed);
        for (uint32_t id = do_seg_lo(d); id <= d->seg_hi && id < d->seg_cap; id++)
            if (d->segs[id] != NULL && d->segs[id] != victim &&
                d->segs[id]->min_seq < ca.other_min_seq)
                ca.other_min_seq = d->segs[id]->min_seq;
    }
    pthread_rwlock_unlock(&d->ilock);
    if (victim == NULL) {
        pthread_mutex_unlock(&d->compact_lock);
        return TQKV_OK;
    }
    tqkv_status_t st = TQKV_OK;
    if (vlive > 0 || vtomb > 0)
        st = scan_segment(d, victim, compact_fn, &ca, 0);
    if (st == TQKV_OK)
        st = ca.st;
    if (st == TQKV_OK && ca.copied > 0) {
        /* The copies are durable before the original goes. */
        pthread_mutex_lock(&d->wlock);
        uint64_t seq = d->seq;
        pthread_mutex_unlock(&d->wlock);
        if (d->cfg.sync != TQKV_DISK_SYNC_NONE)
            st = sync_to(d, seq);
        else {
            pthread_mutex_lock(&d->wlock);
            st = do_flush(d);
            pthread_mutex_unlock(&d->wlock);
        }
    }
    if (st == TQKV_OK) {
        cnt(&d->compactions, 1);
        seg_remove(d, victim);
        if (done)
            *done = 1;
    } else {
        pthread_rwlock_wrlock(&d->ilock);
        victim->busy = 0;
        pthread_rwlock_unlock(&d->ilock);
    }
    seg_unref(victim);
    pthread_mutex_unlock(&d->compact_lock);
    return st;
}

/* ---- statistics ---- */

void
tqkv_disk_stats(tqkv_disk_t *d, tqkv_disk_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    if (d == NULL)
        return;
    pthread_rwlock_rdlock(&d->ilock);
    out->capacity = d->cfg.capacity;
    out->bytes_used = d->used;
    out->live_bytes = d->live;
    out->pages = d->count;
    out->segments = d->nsegs;
    out->index_slots = d->slots ? d->mask + 1 : 0;
    out->index_bytes = out->index_slots * sizeof(slot_t);
    pthread_rwlock_unlock(&d->ilock);
    out->page_bytes = out->live_bytes;
#define L(x) atomic_load_explicit(&d->x, memory_order_relaxed)
    out->hits = L(hits);
    out->misses = L(misses);
    out->reads = L(reads);
    out->read_bytes = L(read_bytes);
    out->writes = L(writes);
    out->write_bytes = L(write_bytes);
    out->records_written = L(records);
    out->syncs = L(syncs);
    out->io_errors = L(io_errors);
    out->corrupt = L(corrupt);
    out->torn = L(torn);
    out->compactions = L(compactions);
    out->compacted_records = L(compacted);
    out->evicted_segments = L(ev_segs);
    out->evicted_records = L(ev_recs);
    out->relocated_records = L(reloc_recs);
    out->relocated_bytes = L(reloc_bytes);
    out->lease_skips = L(lease_skips);
    out->refused_writes = L(refused);
    out->quota_drops = L(quota_drops);
#undef L
    pthread_mutex_lock(&d->lease_lock);
    out->leases = d->lease_n;
    pthread_mutex_unlock(&d->lease_lock);
    out->rebuild_bytes = d->rebuild_bytes;
    out->rebuild_seconds = d->rebuild_seconds;
    out->io_engine = d->io ? tqkv__io_name(d->io) : "none";
    out->direct = d->direct;
}

void
tqkv_disk_ns_usage(tqkv_disk_t *d, const char *ns, size_t ns_len, uint64_t *pages, uint64_t *bytes,
                   uint64_t *page_bytes, uint64_t *bf16)
{
    uint64_t p = 0, b = 0;
    if (d != NULL) {
        pthread_rwlock_rdlock(&d->ilock);
        uint32_t id = do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
        if (id != UINT32_MAX) {
            p = d->ns[id].pages;
            b = d->ns[id].bytes;
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    if (pages)
        *pages = p;
    if (bytes)
        *bytes = b;
    if (page_bytes)
        *page_bytes = b;
    if (bf16)
        *bf16 = 0;
}

void
tqkv_disk_foreach_namespace(tqkv_disk_t *d,
                            void (*fn)(void *arg, const char *ns, size_t ns_len, uint64_t pages,
                                       uint64_t bytes),
                            void *arg)
{
    if (d == NULL || fn == NULL)
        return;
    pthread_rwlock_rdlock(&d->ilock);
    uint32_t n = d->nns;
    nsrec_t *copy = malloc((n + 1) * sizeof(*copy));
    if (copy == NULL) {
        pthread_rwlock_unlock(&d->ilock);
        return;
    }
    if (n > 0)
        memcpy(copy, d->ns, n * sizeof(*copy));
    pthread_rwlock_unlock(&d->ilock);
    /* Names live until close (namespaces are never freed before). */
    for (uint32_t i = 0; i < n; i++)
        if (copy[i].pages > 0)
            fn(arg, copy[i].name, copy[i].len, copy[i].pages, copy[i].bytes);
    free(copy);
}

tqkv_status_t
tqkv__disk_debug_locate(tqkv_disk_t *d, const tqkv_block_key_t *key, char *path, size_t n,
                        uint64_t *offset, uint64_t *rec_bytes)
{
    slot_t c[1];
    if (d == NULL || !valid_key(key))
        return TQKV_EINVAL;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int nc = do_idx_cands(d, dg, c, 1);
    pthread_rwlock_unlock(&d->ilock);
    if (nc == 0)
        return TQKV_ENOTFOUND;
    snprintf(path, n, "%s/" TQKV_DISK_SEG_FMT, d->path, c[0].seg);
    *offset = (uint64_t)c[0].blk * ALIGN;
    *rec_bytes = (uint64_t)c[0].nblk * ALIGN;
    return TQKV_OK;
}
