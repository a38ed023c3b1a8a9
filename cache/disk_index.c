/* disk_index.c - the disk tier's in-memory state: leases, the namespace table, the segment
 * table, the index and the record headers.
 *
 * The index is an open-addressing table (linear probing, backward-shift deletion) of
 * slot_t (cache/disk_internal.h), doubled at 3/4 load. Leases are a digest -> until
 * table under lease_lock (a leaf). Everything else here is under ilock, as each
 * comment says; nothing here does I/O but seg_open_file and seg_remove.
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

/* ---- leases (lease_lock: a leaf, taken alone or innermost) ---- */

uint64_t
tqkv__disk_now_ms(tqkv_disk_t *d)
{
    return tqkv_clock_ns() / 1000000u +
           (uint64_t)atomic_load_explicit(&d->clock_skew_ms, memory_order_relaxed);
}

/* Position of dg in the lease table, or of the empty slot where it would go (lease_cap >
 * 0, lease_lock held). */
uint64_t
tqkv__disk_do_lease_pos(const tqkv_disk_t *d, uint64_t dg)
{
    uint64_t m = d->lease_cap - 1, i = tqkv__mix64(dg ^ 0x6c65617365ULL) & m;
    while (d->lease_dg[i] != 0 && d->lease_dg[i] != dg)
        i = (i + 1) & m;
    return i;
}

/* Rebuilds the lease table with cap slots, leaving out the leases expired by now. 0 when
 * out of memory (the table is then unchanged). */
int
tqkv__disk_do_lease_rehash(tqkv_disk_t *d, uint64_t cap, uint64_t now)
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
        uint64_t j = tqkv__disk_do_lease_pos(d, odg[i]);
        ndg[j] = odg[i];
        nun[j] = oun[i];
        d->lease_n++;
    }
    free(odg);
    free(oun);
    return 1;
}

/* 1 when records of digest dg are leased at now. */
int
tqkv__disk_leased(tqkv_disk_t *d, uint64_t dg, uint64_t now)
{
    int held = 0;
    pthread_mutex_lock(&d->lease_lock);
    if (d->lease_n > 0) {
        uint64_t i = tqkv__disk_do_lease_pos(d, dg);
        held = d->lease_dg[i] == dg && d->lease_until[i] > now;
    }
    pthread_mutex_unlock(&d->lease_lock);
    return held;
}

/* ---- namespaces (ilock held) ---- */

uint32_t
tqkv__disk_do_ns_find(tqkv_disk_t *d, const char *ns, size_t len, uint64_t hv)
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
uint32_t
tqkv__disk_do_ns_get(tqkv_disk_t *d, const char *ns, size_t len)
{
    uint64_t hv = ns_hv(ns, len);
    uint32_t id = tqkv__disk_do_ns_find(d, ns, len, hv);
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

void
tqkv__disk_seg_unref(seg_t *s)
{
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) {
        close(s->fd);
        free(s);
    }
}

/* The segment of id with a reference taken, or NULL (ilock held). */
seg_t *
tqkv__disk_do_seg_ref(tqkv_disk_t *d, uint32_t id)
{
    if (id >= d->seg_cap || d->segs[id] == NULL)
        return NULL;
    atomic_fetch_add_explicit(&d->segs[id]->refs, 1, memory_order_relaxed);
    return d->segs[id];
}

/* The lowest id that may hold a segment (advanced past removed ones; ilock held for
 * writing, or by the only thread). */
uint32_t
tqkv__disk_do_seg_lo(tqkv_disk_t *d)
{
    while (d->seg_lo < d->seg_hi && d->seg_lo < d->seg_cap && d->segs[d->seg_lo] == NULL)
        d->seg_lo++;
    return d->seg_lo;
}

int
tqkv__disk_do_seg_table_put(tqkv_disk_t *d, seg_t *s)
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

int
tqkv__disk_seg_open_file(tqkv_disk_t *d, uint32_t id, int create)
{
    char name[64];
    snprintf(name, sizeof(name), TQKV_DISK_SEG_FMT, id);
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
    if (d->direct)
        flags |= O_DIRECT;
    return openat(d->dirfd, name, flags, 0644);
}

/* Removes segment s from the table and the file system (ilock not held). */
void
tqkv__disk_seg_remove(tqkv_disk_t *d, seg_t *s)
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
    tqkv__disk_seg_unref(s);
}

/* ---- index (ilock held for writing unless said) ---- */

static uint64_t
do_pos(const tqkv_disk_t *d, uint64_t dg)
{
    return tqkv__mix64(dg) & d->mask;
}

int
tqkv__disk_do_idx_grow(tqkv_disk_t *d)
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

void
tqkv__disk_do_account(tqkv_disk_t *d, const slot_t *s, int add)
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
uint64_t
tqkv__disk_do_idx_insert(tqkv_disk_t *d, const slot_t *s)
{
    if (d->slots == NULL || (d->count + 1) * 4 > (d->mask + 1) * 3)
        if (!tqkv__disk_do_idx_grow(d) && d->slots == NULL)
            return UINT64_MAX;
    if (d->count + 1 > d->mask) /* a full table that could not grow */
        return UINT64_MAX;
    uint64_t j = do_pos(d, s->dg);
    while (d->slots[j].dg != 0)
        j = (j + 1) & d->mask;
    d->slots[j] = *s;
    d->count++;
    tqkv__disk_do_account(d, s, 1);
    return j;
}

/* Removes the slot at i (backward-shift deletion). */
void
tqkv__disk_do_idx_remove_at(tqkv_disk_t *d, uint64_t i)
{
    tqkv__disk_do_account(d, &d->slots[i], 0);
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
uint64_t
tqkv__disk_do_idx_find_loc(const tqkv_disk_t *d, uint64_t dg, uint32_t seg, uint32_t blk)
{
    if (d->slots == NULL)
        return UINT64_MAX;
    for (uint64_t j = do_pos(d, dg); d->slots[j].dg != 0; j = (j + 1) & d->mask)
        if (d->slots[j].dg == dg && d->slots[j].seg == seg && d->slots[j].blk == blk)
            return j;
    return UINT64_MAX;
}

/* Copies up to max slots with digest dg (ilock held, any). */
int
tqkv__disk_do_idx_cands(const tqkv_disk_t *d, uint64_t dg, slot_t *out, int max)
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
void
tqkv__disk_do_mark_parent(tqkv_disk_t *d, const char *ns, size_t nl, const uint8_t *parent,
                          size_t pl, uint32_t layer)
{
    if (pl == 0 || d->slots == NULL)
        return;
    uint64_t pdg = digest(ns, nl, parent, pl, layer);
    for (uint64_t j = do_pos(d, pdg); d->slots[j].dg != 0; j = (j + 1) & d->mask)
        if (d->slots[j].dg == pdg)
            d->slots[j].kids = 1;
}

/* Bytes of the records of segment id that are leased at now (ilock not held). */
uint64_t
tqkv__disk_leased_bytes_in(tqkv_disk_t *d, uint32_t id, uint64_t now)
{
    uint64_t sum = 0;
    pthread_rwlock_rdlock(&d->ilock);
    pthread_mutex_lock(&d->lease_lock);
    for (uint64_t i = 0; i < d->lease_cap && d->lease_n > 0; i++) {
        if (d->lease_dg[i] == 0 || d->lease_until[i] <= now)
            continue;
        slot_t c[MAX_CANDS];
        int nc = tqkv__disk_do_idx_cands(d, d->lease_dg[i], c, MAX_CANDS);
        for (int k = 0; k < nc; k++)
            if (c[k].seg == id)
                sum += (uint64_t)c[k].nblk * ALIGN;
    }
    pthread_mutex_unlock(&d->lease_lock);
    pthread_rwlock_unlock(&d->ilock);
    return sum;
}

/* ---- records ---- */

uint32_t
tqkv__disk_key_bytes(const tqkv_disk_rec_t *h)
{
    return (uint32_t)h->ns_len + h->hash_len + h->parent_len;
}

/* Checks the header at p (len bytes available from p) of a record found in segment
 * seg_id: 1 when the header and key are intact and the record fits in len. */
int
tqkv__disk_rec_header_ok(const uint8_t *p, size_t len, uint32_t seg_id)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    if (len < TQKV_DISK_REC_HEADER || h->magic != TQKV_DISK_REC_MAGIC ||
        h->version != TQKV_DISK_VERSION || h->record_bytes % ALIGN != 0 ||
        h->record_bytes < ALIGN || h->record_bytes > len || h->ns_len > 1024 || h->hash_len > 64 ||
        h->parent_len > 64 || h->seg_id != seg_id)
        return 0;
    uint32_t kb = tqkv__disk_key_bytes(h);
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

int
tqkv__disk_rec_page_ok(const uint8_t *p)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    if (h->page_len == 0)
        return h->page_crc32c == 0;
    return tqkv_crc32c(0, p + tqkv_disk_page_offset(tqkv__disk_key_bytes(h)), h->page_len) ==
           h->page_crc32c;
}

int
tqkv__disk_rec_key_is(const uint8_t *p, const char *ns, size_t nl, const uint8_t *hash, size_t hl,
                      uint32_t layer)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    const uint8_t *k = p + TQKV_DISK_REC_HEADER;
    return (h->flags & TQKV_DISK_REC_TOMBSTONE) == 0 && h->layer == layer && h->ns_len == nl &&
           h->hash_len == hl && (nl == 0 || memcmp(k, ns, nl) == 0) &&
           memcmp(k + nl, hash, hl) == 0;
}

uint64_t
tqkv__disk_rec_digest(const uint8_t *p)
{
    const tqkv_disk_rec_t *h = (const void *)p;
    const uint8_t *k = p + TQKV_DISK_REC_HEADER;
    return digest((const char *)k, h->ns_len, k + h->ns_len, h->hash_len, h->layer);
}

/* Writes a record at dst (record_bytes zeroed or overwritten). page may be NULL (a
 * tombstone); page_crc: the CRC when known (compaction), else computed while copying. */
void
tqkv__disk_rec_build(uint8_t *dst, uint32_t seg_id, uint64_t seq, uint16_t flags, const char *ns,
                     size_t nl, const uint8_t *hash, size_t hl, const uint8_t *parent, size_t pl,
                     uint32_t layer, const void *page, size_t len, uint64_t bf16,
                     const uint32_t *page_crc)
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
