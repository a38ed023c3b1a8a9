/* disk_rebuild.c - the disk tier's warm start: segment scans with read-ahead, the index
 * rebuilt from every segment at open (REBUILD_THREADS at once, then applied in segment
 * order, tombstones last), and the superblock.
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

#include <jemalloc/jemalloc.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "cache/cache_internal.h"
#include "cache/disk.h"
#include "cache/disk_format.h"
#include "cache/disk_internal.h"
#include "cache/disk_io.h"
#include "kernels/page.h"

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
tqkv_status_t
tqkv__disk_scan_segment(tqkv_disk_t *d, seg_t *s, scan_fn fn, void *arg, int count)
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
        if (!tqkv__disk_rec_header_ok(p, (size_t)have, s->id)) {
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
        if (!tqkv__disk_rec_page_ok(p)) {
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

/* Gives the memory the scan freed (scan buffers: REBUILD_THREADS x SCAN_DEPTH x 3 MiB,
 * the per-segment entry lists, the index's rebuild sequences and its outgrown tables)
 * back to the kernel. The allocator would keep it dirty until its decay runs, and that
 * runs only on allocator activity: a server restarted without traffic kept ~17 MiB of
 * it resident for good (issue 23). jemalloc (the executables' malloc) purges every
 * arena; glibc's malloc trims (each a no-op when it is not the malloc in use). */
static void
release_freed_memory(void)
{
    char name[64];
    snprintf(name, sizeof(name), "arena.%u.purge", (unsigned)MALLCTL_ARENAS_ALL);
    (void)mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
    (void)mallctl(name, NULL, NULL, NULL, 0);
#ifdef __GLIBC__
    (void)malloc_trim(0);
#endif
}

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
    s = tqkv__disk_do_seg_ref(d, sl->seg);
    pthread_rwlock_unlock(&d->ilock);
    if (s == NULL)
        return 0;
    if (tqkv__disk_read_record(d, s, sl->blk, 1, 0, &b) == TQKV_OK) {
        const tqkv_disk_rec_t *o = (const void *)b;
        size_t kb = tqkv__disk_key_bytes(h);
        same = o->magic == TQKV_DISK_REC_MAGIC && kb + TQKV_DISK_REC_HEADER <= ALIGN &&
               tqkv__disk_rec_key_is(b, (const char *)k, h->ns_len, k + h->ns_len, h->hash_len,
                                     h->layer);
    }
    free(b);
    tqkv__disk_seg_unref(s);
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
    uint64_t dg = tqkv__disk_rec_digest(rec);
    slot_t sl = {
        .dg = dg, .seg = s->id, .blk = (uint32_t)(off / ALIGN), .nblk = h->record_bytes / ALIGN};
    slot_t cands[MAX_CANDS];
    pthread_rwlock_wrlock(&d->ilock);
    uint32_t ns = tqkv__disk_do_ns_get(d, (const char *)k, h->ns_len);
    int nc = tqkv__disk_do_idx_cands(d, dg, cands, MAX_CANDS);
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
        uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
        if (j != UINT64_MAX) {
            if (d->rseq[j] >= h->seq) {
                pthread_rwlock_unlock(&d->ilock);
                return 0;
            }
            tqkv__disk_do_idx_remove_at(d, j);
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    pthread_rwlock_wrlock(&d->ilock);
    uint64_t j = tqkv__disk_do_idx_insert(d, &sl);
    if (j != UINT64_MAX)
        d->rseq[j] = h->seq;
    tqkv__disk_do_mark_parent(d, (const char *)k, h->ns_len, k + h->ns_len + h->hash_len,
                              h->parent_len,
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
        uint32_t ns = tqkv__disk_do_ns_find(d, (const char *)tb->key, tb->ns_len,
                                            ns_hv((const char *)tb->key, tb->ns_len));
        if (ns == UINT32_MAX) {
            pthread_rwlock_unlock(&d->ilock);
            continue;
        }
        if (tb->hash_len == 0) {
            for (uint64_t i = 0; d->slots != NULL && i <= d->mask;) {
                if (d->slots[i].dg != 0 && d->slots[i].ns == ns && d->rseq[i] < tb->seq)
                    tqkv__disk_do_idx_remove_at(d, i); /* re-examine i: a slot may have moved in */
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
            int nc = tqkv__disk_do_idx_cands(d, dg, cands, MAX_CANDS);
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
                uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
                if (j != UINT64_MAX && d->rseq[j] < tb->seq)
                    tqkv__disk_do_idx_remove_at(d, j);
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
    size_t kb =
        tqkv__disk_key_bytes(h); /* namespace, hash and parent: rebuild_fn marks the parent */
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
    int fd = tqkv__disk_seg_open_file(d, r->id, 0);
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
    tqkv_status_t st = tqkv__disk_scan_segment(d, s, collect_fn, r, 1);
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
    int ok = tqkv__disk_do_seg_table_put(d, s);
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
        off += (8 + TQKV_DISK_REC_HEADER + (size_t)tqkv__disk_key_bytes(h) + 7) & ~(size_t)7;
    }
    free(r->ent);
    r->ent = NULL;
    r->len = r->cap = 0;
    return TQKV_OK;
}

/* Opens every segment file of the directory (sorted by id) and rebuilds the index. */
tqkv_status_t
tqkv__disk_rebuild(tqkv_disk_t *d, char *err, size_t errlen)
{
    DIR *dir = fdopendir(dup(d->dirfd));
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    rebuild_t rb = {0};
    double t0 = tqkv_clock_s();
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
    int ok = tqkv__disk_do_idx_grow(d);
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
            tqkv__disk_seg_unref(rp.segs[i].s); /* scanned, not applied (an error) */
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
    d->rebuild_seconds = tqkv_clock_s() - t0;
    d->rebuild_bytes = bytes;
    release_freed_memory();
    return TQKV_OK;
}

/* ---- superblock ---- */

tqkv_status_t
tqkv__disk_super_load(tqkv_disk_t *d, char *err, size_t errlen)
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
