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
 * The rest of the tier: cache/disk_index.c (the index, namespaces, segments, leases,
 * records), cache/disk_read.c (Gets), cache/disk_compact.c (the capacity reclaimer and
 * the compactor), cache/disk_rebuild.c (start-up scan); the locks and their order are
 * in cache/disk_internal.h.
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
#include "cache/disk_internal.h"
#include "cache/disk_io.h"
#include "kernels/page.h"

unsigned tqkv__disk_digest_bits = 64;

void
tqkv__disk_debug_digest_bits(unsigned bits)
{
    tqkv__disk_digest_bits = bits == 0 || bits > 64 ? 64 : bits;
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
            uint64_t i =
                tqkv__disk_do_idx_find_loc(d, tqkv__disk_rec_digest(d->buf + off), d->active->id,
                                           (uint32_t)((d->buf_off + off) / ALIGN));
            if (i != UINT64_MAX)
                tqkv__disk_do_idx_remove_at(d, i);
        }
        off += h->record_bytes;
    }
    pthread_rwlock_unlock(&d->ilock);
}

/* Writes the buffer. On failure its records are dropped, the segment is cut back to
 * what was written and sealed, and the batch's seq range is remembered as failed. */
tqkv_status_t
tqkv__disk_do_flush(tqkv_disk_t *d)
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
    /* A segment that holds no record (its first batch failed: a full file system) goes,
     * so that refused Puts do not leave a header-only file each. */
    if (d->buf_off <= ALIGN)
        tqkv__disk_seg_remove(d, d->active);
    d->active = NULL;
    d->fill = 0;
    d->buf_seq_lo = 0;
    return st;
}

int
tqkv__disk_do_fdatasync(tqkv_disk_t *d, int fd)
{
    cnt(&d->syncs, 1);
    if (fdatasync(fd) != 0) {
        cnt(&d->io_errors, 1);
        return -errno;
    }
    return 0;
}

/* Seals the active segment (written, and synced unless SYNC_NONE). */
tqkv_status_t
tqkv__disk_do_seal(tqkv_disk_t *d)
{
    tqkv_status_t st = tqkv__disk_do_flush(d);
    if (d->active == NULL)
        return st;
    if (d->cfg.sync != TQKV_DISK_SYNC_NONE && tqkv__disk_do_fdatasync(d, d->active->fd) != 0 &&
        st == TQKV_OK)
        st = TQKV_EIO;
    d->active->sealed = 1;
    d->active = NULL;
    return st;
}

static tqkv_status_t
do_new_segment(tqkv_disk_t *d)
{
    uint32_t id = d->seg_hi + 1;
    int fd = tqkv__disk_seg_open_file(d, id, 1);
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
    int ok = tqkv__disk_do_seg_table_put(d, s);
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

/* Opens a segment when none is active and makes room in the write buffer for rb bytes
 * (wlock held; the capacity check is the caller's). */
tqkv_status_t
tqkv__disk_do_prepare(tqkv_disk_t *d, uint64_t rb)
{
    tqkv_status_t st;
    if (d->active == NULL && (st = do_new_segment(d)) != TQKV_OK)
        return st;
    if (d->fill + rb > d->buf_cap) {
        if ((st = tqkv__disk_do_flush(d)) != TQKV_OK)
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

/* Appends a built record (rec_build into the buffer by the caller through fill):
 * accounting of size, seq range. Returns the record's block. */
uint32_t
tqkv__disk_do_commit_append(tqkv_disk_t *d, uint64_t rb, uint64_t seq)
{
    uint32_t blk = (uint32_t)((d->buf_off + d->fill) / ALIGN);
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

/* ---- background: flusher and compactor ---- */

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
        int copies = d->copies_unsynced;
        if (hi != 0 && d->cfg.sync == TQKV_DISK_SYNC_NONE)
            tqkv__disk_do_flush(d);
        pthread_mutex_unlock(&d->wlock);
        if ((hi != 0 || copies) && d->cfg.sync == TQKV_DISK_SYNC_BATCH)
            tqkv__disk_sync_to(d, hi);
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

/* Group commit: returns once every record up to hi, and every compaction or reclaimer
 * copy appended so far (copies_unsynced), is written and fdatasync'ed, or the status of a
 * failed batch that held a record of seq lo..hi (such a record was never stored). A
 * failure too old to be remembered fails [lo, hi] when it may have held one. */
static tqkv_status_t
sync_range(tqkv_disk_t *d, uint64_t lo, uint64_t hi)
{
    tqkv_status_t st = TQKV_OK;
    pthread_mutex_lock(&d->slock);
    pthread_mutex_lock(&d->wlock);
    if (d->durable_seq < hi || d->copies_unsynced) {
        seg_t *s = NULL;
        uint64_t top = d->seq;
        d->copies_unsynced = 0; /* set again below on failure, or by a copy made meanwhile */
        st = tqkv__disk_do_flush(d);
        if (d->active != NULL) {
            s = d->active;
            atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
        }
        pthread_mutex_unlock(&d->wlock);
        if (s != NULL) {
            if (tqkv__disk_do_fdatasync(d, s->fd) != 0 && st == TQKV_OK)
                st = TQKV_EIO;
            tqkv__disk_seg_unref(s);
        }
        if (st == TQKV_OK)
            d->durable_seq = top;
        pthread_mutex_lock(&d->wlock);
        if (st != TQKV_OK)
            d->copies_unsynced = 1;
    }
    pthread_mutex_unlock(&d->slock);
    uint64_t n = d->nfails < FAIL_RING ? d->nfails : FAIL_RING;
    for (uint64_t i = 0; i < n; i++)
        if (d->fails[i].lo <= hi && d->fails[i].hi >= lo)
            st = d->fails[i].st;
    if (d->fail_lost != 0 && d->fail_lost >= lo && st == TQKV_OK)
        st = TQKV_EIO;
    pthread_mutex_unlock(&d->wlock);
    return st;
}

tqkv_status_t
tqkv__disk_sync_to(tqkv_disk_t *d, uint64_t seq)
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
    if ((st = tqkv__disk_super_load(d, err, errlen)) != TQKV_OK)
        goto fail;
    if ((st = tqkv__disk_rebuild(d, err, errlen)) != TQKV_OK)
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
            tqkv__disk_do_seal(d);
        pthread_mutex_unlock(&d->wlock);
    }
    for (uint32_t i = 0; i < d->seg_cap; i++)
        if (d->segs[i] != NULL)
            tqkv__disk_seg_unref(d->segs[i]);
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

int
tqkv__disk_valid_key(const tqkv_block_key_t *k)
{
    return k != NULL && (k->ns != NULL || k->ns_len == 0) && k->ns_len <= 1024 && k->hash != NULL &&
           k->hash_len >= 1 && k->hash_len <= 64 && k->layer != TQKV_DISK_ALL_LAYERS;
}

/* Removes every slot holding key except the one at (seg, blk) (wlock held). Records in
 * the buffer are compared there, others are read. */
void
tqkv__disk_do_drop_key(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t dg, uint32_t keep_seg,
                       uint32_t keep_blk, uint64_t *pages, uint64_t *bytes)
{
    slot_t cands[MAX_CANDS];
    pthread_rwlock_rdlock(&d->ilock);
    int nc = tqkv__disk_do_idx_cands(d, dg, cands, MAX_CANDS);
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
            s = tqkv__disk_do_seg_ref(d, cands[i].seg);
            pthread_rwlock_unlock(&d->ilock);
            if (s != NULL && tqkv__disk_read_record(d, s, cands[i].blk, 1, 1, &b) == TQKV_OK)
                p = b;
            if (s != NULL)
                tqkv__disk_seg_unref(s);
        }
        if (p != NULL &&
            tqkv__disk_rec_key_is(p, key->ns, key->ns_len, key->hash, key->hash_len, key->layer)) {
            pthread_rwlock_wrlock(&d->ilock);
            uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
            if (j != UINT64_MAX) {
                if (pages)
                    (*pages)++;
                if (bytes)
                    *bytes += (uint64_t)d->slots[j].nblk * ALIGN;
                tqkv__disk_do_idx_remove_at(d, j);
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
    if (d == NULL || !tqkv__disk_valid_key(key) || page == NULL || len == 0 || len > UINT32_MAX ||
        parent_len > 64 || (parent_len > 0 && parent == NULL))
        return TQKV_EINVAL;
    uint32_t kb = (uint32_t)(key->ns_len + key->hash_len + parent_len);
    uint64_t rb = tqkv_disk_record_bytes(kb, len);
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    uint64_t seq;

    pthread_mutex_lock(&d->wlock);
    if ((st = tqkv__disk_do_reserve(d, rb)) != TQKV_OK) {
        pthread_mutex_unlock(&d->wlock);
        if (st == TQKV_ENOSPC)
            cnt(&d->refused, 1);
        return st;
    }
    seq = ++d->seq;
    tqkv__disk_rec_build(d->buf + d->fill, d->active->id, seq, 0, key->ns, key->ns_len, key->hash,
                         key->hash_len, parent, parent_len, key->layer, page, len, bf16_bytes,
                         NULL);
    uint32_t seg = d->active->id;
    uint32_t blk = tqkv__disk_do_commit_append(d, rb, seq);
    slot_t sl = {.dg = dg, .seg = seg, .blk = blk, .nblk = (uint32_t)(rb / ALIGN)};
    pthread_rwlock_wrlock(&d->ilock);
    sl.ns = tqkv__disk_do_ns_get(d, key->ns, key->ns_len);
    uint64_t at = sl.ns == UINT32_MAX ? UINT64_MAX : tqkv__disk_do_idx_insert(d, &sl);
    if (at != UINT64_MAX)
        tqkv__disk_do_mark_parent(d, key->ns, key->ns_len, parent, parent_len, key->layer);
    if (key->layer > d->max_layer)
        d->max_layer = key->layer;
    pthread_rwlock_unlock(&d->ilock);
    if (at == UINT64_MAX) {
        st = TQKV_ENOMEM; /* the record is on disk but not indexed: dead space */
    } else {
        tqkv__disk_do_drop_key(d, key, dg, seg, blk, NULL, NULL); /* an earlier record of key */
    }
    if (st == TQKV_OK && d->fill >= d->buf_cap)
        st = tqkv__disk_do_flush(d);
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
        st = tqkv__disk_sync_to(d, seq);
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

/* Appends a tombstone (wlock held); *seq gets its seq. */
tqkv_status_t
tqkv__disk_do_tombstone(tqkv_disk_t *d, const char *ns, size_t nl, const uint8_t *hash, size_t hl,
                        uint32_t layer, uint64_t *seq)
{
    uint64_t rb = tqkv_disk_record_bytes((uint32_t)(nl + hl), 0);
    tqkv_status_t st = tqkv__disk_do_reserve(d, rb);
    if (st != TQKV_OK)
        return st;
    *seq = ++d->seq;
    tqkv__disk_rec_build(d->buf + d->fill, d->active->id, *seq, TQKV_DISK_REC_TOMBSTONE, ns, nl,
                         hash, hl, NULL, 0, layer, NULL, 0, 0, NULL);
    tqkv__disk_do_commit_append(d, rb, *seq);
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
    if ((st = tqkv__disk_do_tombstone(d, ns, ns_len, hash, hash_len, layer, &seq)) == TQKV_OK)
        for (uint32_t l = lo; l <= hi; l++) {
            tqkv_block_key_t k = {ns, ns_len, hash, hash_len, l};
            uint64_t dg = digest(ns, ns_len, hash, hash_len, l);
            tqkv__disk_do_drop_key(d, &k, dg, UINT32_MAX, UINT32_MAX, &np, &nb);
        }
    pthread_mutex_unlock(&d->wlock);
    if (st == TQKV_OK && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
        st = tqkv__disk_sync_to(d, seq);
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
    uint32_t id = tqkv__disk_do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
    int any = id != UINT32_MAX && d->ns[id].pages > 0;
    pthread_rwlock_unlock(&d->ilock);
    if (any && (st = tqkv__disk_do_tombstone(d, ns, ns_len, NULL, 0, TQKV_DISK_ALL_LAYERS, &seq)) ==
                   TQKV_OK) {
        pthread_rwlock_wrlock(&d->ilock);
        for (uint64_t i = 0; d->slots != NULL && i <= d->mask;) {
            if (d->slots[i].dg != 0 && d->slots[i].ns == id) {
                np++;
                nb += (uint64_t)d->slots[i].nblk * ALIGN;
                tqkv__disk_do_idx_remove_at(d, i);
            } else {
                i++;
            }
        }
        pthread_rwlock_unlock(&d->ilock);
    }
    pthread_mutex_unlock(&d->wlock);
    if (any && st == TQKV_OK && d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
        st = tqkv__disk_sync_to(d, seq);
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return st;
}

tqkv_status_t
tqkv_disk_lease(tqkv_disk_t *d, const tqkv_block_key_t *key, uint32_t ms)
{
    if (d == NULL || !tqkv__disk_valid_key(key))
        return TQKV_EINVAL;
    if (!tqkv_disk_contains(d, key, NULL))
        return TQKV_ENOTFOUND;
    if (ms == 0)
        return TQKV_OK;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    uint64_t now = tqkv__disk_now_ms(d), until = now + ms;
    tqkv_status_t st = TQKV_OK;
    pthread_mutex_lock(&d->lease_lock);
    if ((d->lease_n + 1) * 2 > d->lease_cap) {
        /* Purge the expired ones; grow when still over half full. */
        uint64_t cap = d->lease_cap ? d->lease_cap : 64;
        if (!tqkv__disk_do_lease_rehash(d, cap, now) ||
            ((d->lease_n + 1) * 2 > d->lease_cap && !tqkv__disk_do_lease_rehash(d, cap * 2, now)))
            st = TQKV_ENOMEM;
    }
    if (st == TQKV_OK) {
        uint64_t i = tqkv__disk_do_lease_pos(d, dg);
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
    return seq == 0 ? TQKV_OK : tqkv__disk_sync_to(d, seq);
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
    out->segment_bytes = d->cfg.segment_bytes;
    out->max_record = d->cfg.segment_bytes - ALIGN; /* tqkv__disk_do_reserve's bound */
}

void
tqkv_disk_ns_usage(tqkv_disk_t *d, const char *ns, size_t ns_len, uint64_t *pages, uint64_t *bytes,
                   uint64_t *page_bytes, uint64_t *bf16)
{
    uint64_t p = 0, b = 0;
    if (d != NULL) {
        pthread_rwlock_rdlock(&d->ilock);
        uint32_t id = tqkv__disk_do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
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
    if (d == NULL || !tqkv__disk_valid_key(key))
        return TQKV_EINVAL;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int nc = tqkv__disk_do_idx_cands(d, dg, c, 1);
    pthread_rwlock_unlock(&d->ilock);
    if (nc == 0)
        return TQKV_ENOTFOUND;
    snprintf(path, n, "%s/" TQKV_DISK_SEG_FMT, d->path, c[0].seg);
    *offset = (uint64_t)c[0].blk * ALIGN;
    *rec_bytes = (uint64_t)c[0].nblk * ALIGN;
    return TQKV_OK;
}
