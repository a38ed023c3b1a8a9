/* disk_read.c - the disk tier's reads: tqkv_disk_contains, tqkv_disk_get, tqkv_disk_get_many
 * and its batches (tqkv_disk_batch_*).
 *
 * A read finds the candidate slots of the key's digest under ilock (read), takes a
 * reference on the segment and reads with no lock held; a record still in the write
 * buffer is copied out under wlock. The key in the record header tells two keys with
 * one digest apart.
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

/* ---- reading ---- */

/* Test-only hook (tests/interop/test_disk_tier.py, the slow-disk test; never set it in
 * production): with TQKV_TEST_DISK_READ_GATE=PATH in the environment, every record read
 * (Gets, prefetch; not the start-up scan) first creates PATH.waiting and then waits until
 * PATH exists: a disk as slow as the test wants, without device-mapper. */
static const char *g_gate;
static pthread_once_t g_gate_once = PTHREAD_ONCE_INIT;

static void
gate_init(void)
{
    const char *g = getenv("TQKV_TEST_DISK_READ_GATE");
    g_gate = g != NULL && g[0] != '\0' ? g : NULL;
}

static void
test_read_gate(void)
{
    pthread_once(&g_gate_once, gate_init);
    if (g_gate == NULL)
        return;
    char w[4096];
    snprintf(w, sizeof(w), "%s.waiting", g_gate);
    int fd = open(w, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    while (access(g_gate, F_OK) != 0)
        usleep(2000);
}

/* Reads the record at (seg, blk) of nblk blocks into a new aligned buffer. */
tqkv_status_t
tqkv__disk_read_record(tqkv_disk_t *d, seg_t *s, uint32_t blk, uint32_t nblk, int wlocked,
                       uint8_t **out)
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
    test_read_gate();
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

/* out: the page inside the checked record b (out owns b from now on). */
static void
rec_to_page(uint8_t *b, tqkv_disk_page_t *out)
{
    const tqkv_disk_rec_t *h = (const void *)b;
    out->buf = b;
    out->page = b + tqkv_disk_page_offset(tqkv__disk_key_bytes(h));
    out->len = h->page_len;
    out->bf16_bytes = h->bf16_bytes;
    out->parent_len = h->parent_len;
    memcpy(out->parent, b + TQKV_DISK_REC_HEADER + h->ns_len + h->hash_len, h->parent_len);
}

int
tqkv_disk_contains(tqkv_disk_t *d, const tqkv_block_key_t *key, uint64_t *rec_bytes)
{
    slot_t c[1] = {{0}};
    if (d == NULL || !tqkv__disk_valid_key(key))
        return 0;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int n = tqkv__disk_do_idx_cands(d, dg, c, 1);
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
    if (d == NULL || out == NULL || !tqkv__disk_valid_key(key))
        return TQKV_EINVAL;
    uint64_t dg = digest(key->ns, key->ns_len, key->hash, key->hash_len, key->layer);
    pthread_rwlock_rdlock(&d->ilock);
    int nc = tqkv__disk_do_idx_cands(d, dg, cands, MAX_CANDS);
    for (int i = 0; i < nc; i++)
        segs[i] = tqkv__disk_do_seg_ref(d, cands[i].seg);
    pthread_rwlock_unlock(&d->ilock);
    int i;
    for (i = 0; i < nc; i++) {
        uint8_t *b = NULL;
        int bad = 0;
        if (segs[i] == NULL) {
            bad = 1; /* its segment went (dropped or compacted meanwhile) */
        } else {
            tqkv_status_t st =
                tqkv__disk_read_record(d, segs[i], cands[i].blk, cands[i].nblk, 0, &b);
            if (st != TQKV_OK) {
                result = st;
                continue;
            }
            if (!tqkv__disk_rec_header_ok(b, (size_t)cands[i].nblk * ALIGN, segs[i]->id)) {
                bad = 2;
            } else if (!tqkv__disk_rec_key_is(b, key->ns, key->ns_len, key->hash, key->hash_len,
                                              key->layer)) {
                free(b); /* another key with the same digest */
                continue;
            } else if (!tqkv__disk_rec_page_ok(b)) {
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
            uint64_t j = tqkv__disk_do_idx_find_loc(d, dg, cands[i].seg, cands[i].blk);
            if (j != UINT64_MAX &&
                (bad == 2 || cands[i].seg >= d->seg_cap || d->segs[cands[i].seg] == NULL))
                tqkv__disk_do_idx_remove_at(d, j);
            pthread_rwlock_unlock(&d->ilock);
            free(b);
            continue;
        }
        rec_to_page(b, out);
        result = TQKV_OK;
        break;
    }
    for (int k = 0; k < nc; k++)
        if (segs[k] != NULL)
            tqkv__disk_seg_unref(segs[k]);
    cnt(result == TQKV_OK ? &d->hits : &d->misses, 1);
    return result;
}

/* ---- batches: a round of reads in flight at once, finished one by one ---- */

enum { BR_NONE = 0, BR_FAST, BR_SLOW, BR_DONE };

struct tqkv_disk_batch {
    tqkv_disk_t *d;
    const tqkv_block_key_t *keys;
    size_t n;
    tqkv__io_op_t *ops;
    seg_t **segs;
    uint8_t *state;     /* BR_* per key */
    tqkv_status_t *st0; /* BR_NONE: the answer (ENOTFOUND, EINVAL) */
};

tqkv_disk_batch_t *
tqkv_disk_batch_start(tqkv_disk_t *d, const tqkv_block_key_t *keys, size_t n)
{
    tqkv_disk_batch_t *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return NULL;
    size_t m = n ? n : 1;
    b->d = d;
    b->keys = keys;
    b->n = n;
    b->ops = calloc(m, sizeof(*b->ops));
    b->segs = calloc(m, sizeof(*b->segs));
    b->state = calloc(m, 1);
    b->st0 = calloc(m, sizeof(*b->st0));
    if (b->ops == NULL || b->segs == NULL || b->state == NULL || b->st0 == NULL) {
        free(b->ops);
        free(b->segs);
        free(b->state);
        free(b->st0);
        free(b);
        return NULL;
    }
    if (n > 0)
        test_read_gate();
    for (size_t i = 0; i < n; i++) {
        slot_t c[2];
        b->st0[i] = TQKV_ENOTFOUND;
        if (d == NULL || !tqkv__disk_valid_key(&keys[i])) {
            b->st0[i] = TQKV_EINVAL;
            continue;
        }
        uint64_t dg =
            digest(keys[i].ns, keys[i].ns_len, keys[i].hash, keys[i].hash_len, keys[i].layer);
        pthread_rwlock_rdlock(&d->ilock);
        int nc = tqkv__disk_do_idx_cands(d, dg, c, 2);
        seg_t *s = nc == 1 ? tqkv__disk_do_seg_ref(d, c[0].seg) : NULL;
        pthread_rwlock_unlock(&d->ilock);
        if (nc == 0) {
            cnt(&d->misses, 1);
            continue;
        }
        /* Unique digest in a sealed segment: in this round; anything else one by one. */
        if (s != NULL && s->sealed) {
            tqkv__io_op_t *op = &b->ops[i];
            op->fd = s->fd;
            op->len = (size_t)c[0].nblk * ALIGN;
            op->off = (uint64_t)c[0].blk * ALIGN;
            op->buf = abuf(op->len);
            if (op->buf != NULL && tqkv__io_submit(d->io, op) == 0) {
                b->segs[i] = s;
                b->state[i] = BR_FAST;
                continue;
            }
            free(op->buf);
            op->buf = NULL;
        }
        if (s != NULL)
            tqkv__disk_seg_unref(s);
        b->state[i] = BR_SLOW;
    }
    return b;
}

/* Waits for read i of b (BR_FAST) and checks it: TQKV_OK with out set, or -1 when a
 * check failed or the read did (then the single path decides). */
static int
batch_reap(tqkv_disk_batch_t *b, size_t i, tqkv_disk_page_t *out)
{
    tqkv_disk_t *d = b->d;
    const tqkv_block_key_t *k = &b->keys[i];
    tqkv__io_op_t *op = &b->ops[i];
    ssize_t r = tqkv__io_wait(d->io, op);
    uint8_t *buf = op->buf;
    int ok = 0;
    cnt(&d->reads, 1);
    if (r > 0)
        cnt(&d->read_bytes, (uint64_t)r);
    if (r == (ssize_t)op->len && tqkv__disk_rec_header_ok(buf, op->len, b->segs[i]->id) &&
        tqkv__disk_rec_key_is(buf, k->ns, k->ns_len, k->hash, k->hash_len, k->layer) &&
        tqkv__disk_rec_page_ok(buf)) {
        rec_to_page(buf, out);
        cnt(&d->hits, 1);
        ok = 1;
    } else {
        free(buf);
    }
    op->buf = NULL;
    tqkv__disk_seg_unref(b->segs[i]);
    b->segs[i] = NULL;
    return ok ? 0 : -1;
}

tqkv_status_t
tqkv_disk_batch_finish(tqkv_disk_batch_t *b, size_t i, tqkv_disk_page_t *out)
{
    if (out != NULL)
        memset(out, 0, sizeof(*out));
    if (b == NULL || out == NULL || i >= b->n || b->state[i] == BR_DONE)
        return TQKV_EINVAL;
    int st = b->state[i];
    b->state[i] = BR_DONE;
    if (st == BR_NONE)
        return b->st0[i];
    if (st == BR_FAST && batch_reap(b, i, out) == 0)
        return TQKV_OK;
    return tqkv_disk_get(b->d, &b->keys[i], out);
}

void
tqkv_disk_batch_end(tqkv_disk_batch_t *b)
{
    if (b == NULL)
        return;
    for (size_t i = 0; i < b->n; i++)
        if (b->state[i] == BR_FAST) {
            /* The kernel may still write it; the bytes were read all the same. */
            ssize_t r = tqkv__io_wait(b->d->io, &b->ops[i]);
            cnt(&b->d->reads, 1);
            if (r > 0)
                cnt(&b->d->read_bytes, (uint64_t)r);
            free(b->ops[i].buf);
            tqkv__disk_seg_unref(b->segs[i]);
        }
    free(b->ops);
    free(b->segs);
    free(b->state);
    free(b->st0);
    free(b);
}

void
tqkv_disk_batch_wait(tqkv_disk_batch_t *b)
{
    /* One sleep for the whole round (not one per read, in index order): on a loaded
     * machine every wake-up of this thread waits for a CPU. */
    size_t nfast = 0;
    for (size_t i = 0; b != NULL && i < b->n; i++)
        nfast += b->state[i] == BR_FAST;
    if (nfast > 1)
        tqkv__io_wait_many(b->d->io, nfast);
}

void
tqkv_disk_get_many(tqkv_disk_t *d, const tqkv_block_key_t *keys, size_t n, tqkv_disk_page_t *out,
                   tqkv_status_t *st)
{
    tqkv_disk_batch_t *b = tqkv_disk_batch_start(d, keys, n);
    if (b == NULL) {
        for (size_t i = 0; i < n; i++)
            st[i] = tqkv_disk_get(d, &keys[i], &out[i]);
        return;
    }
    tqkv_disk_batch_wait(b);
    for (size_t i = 0; i < n; i++)
        st[i] = tqkv_disk_batch_finish(b, i, &out[i]);
    tqkv_disk_batch_end(b);
}

void
tqkv_disk_page_free(tqkv_disk_page_t *p)
{
    if (p != NULL) {
        free(p->buf);
        p->buf = NULL;
    }
}
