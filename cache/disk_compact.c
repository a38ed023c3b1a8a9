/* disk_compact.c - the disk tier's space reclaim: the capacity reclaimer (dropping the
 * oldest segment, copying leased and prefix records forward), namespace eviction and
 * the compactor (tqkv_disk_compact).
 *
 * The reclaimer runs in the writer (wlock held) when a record does not fit; the
 * compactor takes compact_lock, then wlock for each copy (cache/disk_internal.h).
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

/* Room for a copy of rb bytes made while a segment is being dropped (wlock held): within
 * the whole capacity (the reserve is kept for these copies) plus slack, never evicting.
 * Tombstones get a segment of slack: the segment they leave is dropped right after, so
 * the tier is over its capacity only until then. */
static tqkv_status_t
do_room_reloc(tqkv_disk_t *d, uint64_t rb, uint64_t slack)
{
    tqkv_status_t st;
    if (d->active != NULL && d->active->size + rb > d->cfg.segment_bytes)
        if ((st = tqkv__disk_do_seal(d)) != TQKV_OK)
            return st;
    pthread_rwlock_rdlock(&d->ilock);
    int fits = d->used + rb + (d->active == NULL ? ALIGN : 0) <= d->cfg.capacity + slack;
    pthread_rwlock_unlock(&d->ilock);
    return fits ? tqkv__disk_do_prepare(d, rb) : TQKV_ENOSPC;
}

/* Appends a copy of the record rec (at off of s) at the head, keeping its seq, and moves
 * its index slot (digest dg; a tombstone has none) there, clearing its prefix mark: it
 * now follows its children in the log. Its parent, if kept, is marked again: always when
 * parent_always, else only when rec's slot was still there. wlock held, room reserved. */
static void
do_copy_forward(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, uint64_t dg,
                int parent_always)
{
    const tqkv_disk_rec_t *h = (const void *)rec;
    const uint8_t *k = rec + TQKV_DISK_REC_HEADER;
    uint32_t kb = tqkv__disk_key_bytes(h), crc = h->page_crc32c;
    tqkv__disk_rec_build(d->buf + d->fill, d->active->id, h->seq, h->flags, (const char *)k,
                         h->ns_len, k + h->ns_len, h->hash_len, k + h->ns_len + h->hash_len,
                         h->parent_len, h->layer, rec + tqkv_disk_page_offset(kb), h->page_len,
                         h->bf16_bytes, &crc);
    uint32_t nseg = d->active->id;
    uint32_t nblk = tqkv__disk_do_commit_append(d, h->record_bytes, h->seq);
    d->copies_unsynced = 1;
    pthread_rwlock_wrlock(&d->ilock);
    if (h->flags & TQKV_DISK_REC_TOMBSTONE) {
        d->active->ntomb++;
    } else {
        uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
        if (j != UINT64_MAX) {
            tqkv__disk_do_account(d, &d->slots[j], 0);
            d->slots[j].seg = nseg;
            d->slots[j].blk = nblk;
            d->slots[j].kids = 0;
            tqkv__disk_do_account(d, &d->slots[j], 1);
        }
        if (j != UINT64_MAX || parent_always)
            tqkv__disk_do_mark_parent(d, (const char *)k, h->ns_len, k + h->ns_len + h->hash_len,
                                      h->parent_len, h->layer);
    }
    pthread_rwlock_unlock(&d->ilock);
}

/* Copies the record rec (at off of s) to the head, keeping its seq, and moves its index
 * slot there, clearing its prefix mark (wlock held). dg: its digest (0 for a tombstone). */
static tqkv_status_t
do_relocate(tqkv_disk_t *d, seg_t *s, uint64_t off, const uint8_t *rec, uint64_t dg)
{
    const tqkv_disk_rec_t *h = (const void *)rec;
    uint64_t rb = h->record_bytes;
    tqkv_status_t st =
        do_room_reloc(d, rb, (h->flags & TQKV_DISK_REC_TOMBSTONE) ? d->cfg.segment_bytes : 0);
    if (st != TQKV_OK)
        return st;
    do_copy_forward(d, s, off, rec, dg, 1);
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
    uint64_t dg = tqkv__disk_rec_digest(rec);
    pthread_rwlock_rdlock(&d->ilock);
    uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
    int prefix = j != UINT64_MAX && d->slots[j].kids;
    if (prefix && h->parent_len > 0) {
        /* A prefix record is worth keeping only while its own parent is kept. */
        slot_t c[MAX_CANDS];
        uint64_t pdg = digest((const char *)k, h->ns_len, k + h->ns_len + h->hash_len,
                              h->parent_len, h->layer);
        int nc = tqkv__disk_do_idx_cands(d, pdg, c, MAX_CANDS);
        prefix = 0;
        for (int i = 0; i < nc; i++)
            prefix |= c[i].seg != s->id;
    }
    pthread_rwlock_unlock(&d->ilock);
    if (j == UINT64_MAX)
        return 0; /* dead */
    int must = tqkv__disk_leased(d, dg, ea->now);
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
    j = tqkv__disk_do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
    if (j != UINT64_MAX) {
        tqkv__disk_do_idx_remove_at(d, j);
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
    uint64_t now = tqkv__disk_now_ms(d);
    uint32_t from = 0;
    for (;;) {
        seg_t *victim = NULL;
        uint64_t live = 0, ntomb = 0, room = 0;
        int older = 0;
        pthread_rwlock_wrlock(&d->ilock);
        uint32_t lo = tqkv__disk_do_seg_lo(d);
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
        uint64_t lb = live > 0 ? tqkv__disk_leased_bytes_in(d, victim->id, now) : 0;
        uint64_t tb = older ? ntomb * (uint64_t)ALIGN : 0;
        evict_arg_t ea = {now, d->reserve, 0, older, 0};
        if ((lb > 0 && lb + ALIGN > room) ||
            (lb + tb > 0 && lb + tb + ALIGN > room + d->cfg.segment_bytes)) {
            ea.failed = 1; /* passed over: what must stay does not fit */
        } else if (live > 0 || (older && ntomb > 0)) {
            tqkv__disk_scan_segment(d, victim, evict_fn, &ea, 0);
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
            if (tqkv__disk_do_flush(d) == TQKV_OK && d->active != NULL &&
                d->cfg.sync == TQKV_DISK_SYNC_ALWAYS)
                tqkv__disk_do_fdatasync(d, d->active->fd);
        }
        cnt(&d->ev_segs, 1);
        tqkv__disk_seg_remove(d, victim);
        return 1;
    }
}

/* Makes room for a record of rb bytes at the end of the buffer. Puts and compaction copies
 * leave the reserve free (for the reclaimer's copies). */
tqkv_status_t
tqkv__disk_do_reserve(tqkv_disk_t *d, uint64_t rb)
{
    tqkv_status_t st;
    if (rb + ALIGN > d->cfg.segment_bytes)
        return TQKV_ENOSPC;
    if (d->active != NULL && d->active->size + rb > d->cfg.segment_bytes)
        if ((st = tqkv__disk_do_seal(d)) != TQKV_OK)
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
            if ((st = tqkv__disk_do_seal(d)) != TQKV_OK)
                return st;
        }
    }
    return tqkv__disk_do_prepare(d, rb);
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
    uint32_t id = tqkv__disk_do_ns_find(d, ns, ns_len, ns_hv(ns, ns_len));
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
    uint64_t now = tqkv__disk_now_ms(d);
    /* Leaves first, then prefix records; oldest first within each; leased ones stay. */
    for (unsigned pass = 0; pass < 2 && got < need && st == TQKV_OK; pass++) {
        for (uint64_t i = 0; i < k && got < need; i++) {
            const slot_t *c = &list[i];
            if (c->kids != pass || tqkv__disk_leased(d, c->dg, now))
                continue;
            /* The key, for the tombstone, from the record's first block. */
            uint8_t *b = NULL;
            pthread_rwlock_rdlock(&d->ilock);
            seg_t *s = tqkv__disk_do_seg_ref(d, c->seg);
            pthread_rwlock_unlock(&d->ilock);
            if (s == NULL)
                continue;
            tqkv_status_t rs = tqkv__disk_read_record(d, s, c->blk, 1, 1, &b);
            tqkv__disk_seg_unref(s);
            const tqkv_disk_rec_t *h = (const void *)b;
            if (rs != TQKV_OK || h->magic != TQKV_DISK_REC_MAGIC ||
                TQKV_DISK_REC_HEADER + tqkv__disk_key_bytes(h) > ALIGN ||
                (h->flags & TQKV_DISK_REC_TOMBSTONE) || tqkv__disk_rec_digest(b) != c->dg ||
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
            if ((st = tqkv__disk_do_tombstone(d, ns, ns_len, hash, hl, layer, &seq)) != TQKV_OK)
                break;
            uint64_t before = got;
            pthread_rwlock_wrlock(&d->ilock);
            uint64_t j = tqkv__disk_do_idx_find_loc(d, c->dg, c->seg, c->blk);
            if (j != UINT64_MAX) {
                got += (uint64_t)d->slots[j].nblk * ALIGN;
                tqkv__disk_do_idx_remove_at(d, j);
            }
            pthread_rwlock_unlock(&d->ilock);
            if (j == UINT64_MAX) {
                /* Moved (copied forward while the tombstone made room): by key. */
                tqkv_block_key_t key = {ns, ns_len, hash, hl, layer};
                tqkv__disk_do_drop_key(d, &key, c->dg, UINT32_MAX, UINT32_MAX, NULL, &got);
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
    uint64_t dg = 0;
    int tomb = (h->flags & TQKV_DISK_REC_TOMBSTONE) != 0;
    if (tomb) {
        if (h->seq < ca->other_min_seq)
            return 0; /* shadows nothing that is left */
    } else {
        dg = tqkv__disk_rec_digest(rec);
        pthread_rwlock_rdlock(&d->ilock);
        uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, s->id, (uint32_t)(off / ALIGN));
        pthread_rwlock_unlock(&d->ilock);
        if (j == UINT64_MAX)
            return 0; /* dead */
    }
    pthread_mutex_lock(&d->wlock);
    uint64_t rb = h->record_bytes;
    tqkv_status_t st = tqkv__disk_do_reserve(d, rb);
    if (st != TQKV_OK) {
        pthread_mutex_unlock(&d->wlock);
        ca->st = st;
        return 1;
    }
    do_copy_forward(d, s, off, rec, dg, 0);
    if (d->fill >= d->buf_cap)
        st = tqkv__disk_do_flush(d);
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
    for (uint32_t id = tqkv__disk_do_seg_lo(d); id <= d->seg_hi && id < d->seg_cap; id++) {
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
        for (uint32_t id = tqkv__disk_do_seg_lo(d); id <= d->seg_hi && id < d->seg_cap; id++)
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
        st = tqkv__disk_scan_segment(d, victim, compact_fn, &ca, 0);
    if (st == TQKV_OK)
        st = ca.st;
    if (st == TQKV_OK && ca.copied > 0) {
        /* The copies are durable before the original goes. */
        pthread_mutex_lock(&d->wlock);
        uint64_t seq = d->seq;
        pthread_mutex_unlock(&d->wlock);
        if (d->cfg.sync != TQKV_DISK_SYNC_NONE)
            st = tqkv__disk_sync_to(d, seq);
        else {
            pthread_mutex_lock(&d->wlock);
            st = tqkv__disk_do_flush(d);
            pthread_mutex_unlock(&d->wlock);
        }
    }
    if (st == TQKV_OK) {
        cnt(&d->compactions, 1);
        tqkv__disk_seg_remove(d, victim);
        if (done)
            *done = 1;
    } else {
        pthread_rwlock_wrlock(&d->ilock);
        victim->busy = 0;
        pthread_rwlock_unlock(&d->ilock);
    }
    tqkv__disk_seg_unref(victim);
    pthread_mutex_unlock(&d->compact_lock);
    return st;
}
