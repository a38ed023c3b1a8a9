/* disk_read.c - the disk tier's reads: tqkv_disk_contains, tqkv_disk_get, tqkv_disk_get_many.
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
        const tqkv_disk_rec_t *h = (const void *)b;
        out->buf = b;
        out->page = b + tqkv_disk_page_offset(tqkv__disk_key_bytes(h));
        out->len = h->page_len;
        out->bf16_bytes = h->bf16_bytes;
        out->parent_len = h->parent_len;
        memcpy(out->parent, b + TQKV_DISK_REC_HEADER + h->ns_len + h->hash_len, h->parent_len);
        result = TQKV_OK;
        break;
    }
    for (int k = 0; k < nc; k++)
        if (segs[k] != NULL)
            tqkv__disk_seg_unref(segs[k]);
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
    if (n > 0)
        test_read_gate();
    for (size_t i = 0; i < n; i++) {
        slot_t c[2];
        memset(&out[i], 0, sizeof(out[i]));
        st[i] = TQKV_ENOTFOUND;
        if (d == NULL || !tqkv__disk_valid_key(&keys[i])) {
            st[i] = TQKV_EINVAL;
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
            tqkv__disk_seg_unref(s);
        fast[i] = 2; /* one by one */
    }
    /* One sleep for the whole round (not one per read, in index order): on a loaded
     * machine every wake-up of this thread waits for a CPU. */
    size_t nfast = 0;
    for (size_t i = 0; i < n; i++)
        nfast += fast[i] == 1;
    if (nfast > 1)
        tqkv__io_wait_many(d->io, nfast);
    for (size_t i = 0; i < n; i++) {
        if (fast[i] == 1) {
            ssize_t r = tqkv__io_wait(d->io, &ops[i]);
            uint8_t *b = ops[i].buf;
            cnt(&d->reads, 1);
            if (r > 0)
                cnt(&d->read_bytes, (uint64_t)r);
            if (r == (ssize_t)ops[i].len && tqkv__disk_rec_header_ok(b, ops[i].len, segs[i]->id) &&
                tqkv__disk_rec_key_is(b, keys[i].ns, keys[i].ns_len, keys[i].hash, keys[i].hash_len,
                                      keys[i].layer) &&
                tqkv__disk_rec_page_ok(b)) {
                const tqkv_disk_rec_t *h = (const void *)b;
                out[i].buf = b;
                out[i].page = b + tqkv_disk_page_offset(tqkv__disk_key_bytes(h));
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
            tqkv__disk_seg_unref(segs[i]);
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
