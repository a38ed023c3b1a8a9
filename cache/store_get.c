/* store_get.c - the store's reads: Get (with promotion to HBM and disk reads on a
 * miss), prefetch from disk, page references, and Lookup with leases.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache_internal.h"
#include "cache/disk.h"
#include "cache/disk_format.h"
#include "cache/evict.h"
#include "cache/pool.h"
#include "cache/store.h"
#include "cache/store_internal.h"
#include "kernels/page.h"
#include "kernels/page_format.h"

/* ---- get ---- */

/* Copies the DRAM copy `old` of e into HBM when there is room below the high mark. */
static void
promote(tqkv_store_t *s, entry_t *e, copy_t *old)
{
    tqkv_pool_t *h = s->pool[TQKV_TIER_HBM];
    stripe_t *st;
    copy_t *nc;
    void *mem;
    int swapped = 0;

    if (tqkv_pool_used(h) + old->len > tqkv__store_hbm_mark(s, s->cfg.high_watermark))
        return;
    if (tqkv_pool_alloc(h, old->len, &mem) != TQKV_OK)
        return;
    nc = malloc(sizeof(*nc));
    if (nc == NULL || tqkv_pool_copy_in(h, mem, old->data, old->len) != TQKV_OK) {
        free(nc);
        tqkv_pool_free(h, mem, old->len);
        return;
    }
    nc->data = mem;
    nc->len = old->len;
    nc->tier = TQKV_TIER_HBM;
    atomic_init(&nc->refs, 1);
    pthread_mutex_lock(&s->evict_lock);
    st = e->linked ? stripe_of(s, e->blk->hv) : NULL;
    pthread_mutex_unlock(&s->evict_lock);
    if (st == NULL) {
        copy_release(s, nc);
        return;
    }
    pthread_mutex_lock(&st->lock);
    pthread_mutex_lock(&s->evict_lock);
    swapped = tqkv__store_do_move_tier(s, e, old, nc, TQKV_TIER_HBM);
    pthread_mutex_unlock(&s->evict_lock);
    pthread_mutex_unlock(&st->lock);
    if (!swapped)
        copy_release(s, nc);
    else
        tqkv__store_bg_kick(s);
}

/* Unlinks e when its current copy is still c (which failed its CRC check), so that the
 * block reads as missing and can be put again. */
static void
drop_corrupt(tqkv_store_t *s, stripe_t *sp, entry_t *e, copy_t *c)
{
    pthread_mutex_lock(&sp->lock);
    pthread_mutex_lock(&s->evict_lock);
    if (e->linked && e->cur == c) {
        block_t *b = e->blk;
        tqkv__store_do_unlink(s, e, 0);
        if (b->nlive == 0)
            tqkv__store_do_block_unlink_free(sp, b);
    }
    pthread_mutex_unlock(&s->evict_lock);
    pthread_mutex_unlock(&sp->lock);
}

static int
crc_ok(const void *data, size_t len, int kind, uint32_t crc)
{
    if (kind == CRC_PAGE)
        return tqkv_page_crc(data, len) == crc;
    if (kind == CRC_WHOLE)
        return tqkv_crc32c(0, data, len) == crc;
    return 1;
}

/* r: a reference over a page read from the disk tier (the read buffer, the page inside
 * it; r owns the buffer from now on). */
static void
disk_ref_init(tqkv_page_ref_t *r, tqkv_store_t *s, const tqkv_disk_page_t *p)
{
    r->s = s;
    r->c = NULL;
    r->buf = p->buf;
    r->host = p->page;
    r->len = (uint32_t)p->len;
    r->tier = TQKV_TIER_DISK;
}

/* A miss in HBM/DRAM with a disk tier: reads the record (no store lock held; the thread
 * waits for this one read), serves it from the read buffer and promotes a copy into
 * DRAM. Takes r (freed on a miss). */
static tqkv_status_t
get_disk(tqkv_store_t *s, ns_rec_t *ns, const tqkv_block_key_t *key, tqkv_page_ref_t *r,
         tqkv_page_ref_t **out)
{
    tqkv_disk_page_t p;
    tqkv_status_t st = tqkv_disk_get(s->disk, key, &p);
    if (st != TQKV_OK) {
        /* Absent, failed its checks (dropped, counted) or unreadable (counted): a miss. */
        free(r);
        cnt_add(&s->g.misses, 1);
        cnt_add(&ns->c.misses, 1);
        return st == TQKV_ENOMEM ? st : TQKV_ENOTFOUND;
    }
    disk_ref_init(r, s, &p);
    cnt_add(&s->g.hits[TQKV_TIER_DISK], 1);
    cnt_add(&ns->c.hits[TQKV_TIER_DISK], 1);
    cnt_add(&s->g.bytes_out, r->len);
    cnt_add(&ns->c.bytes_out, r->len);
    /* Promotion: the next Get is served from DRAM (best effort: a full DRAM of pinned
     * pages keeps it on disk only). */
    int dup = 0;
    if (tqkv__store_put_ram(s, key, p.parent_len ? p.parent : NULL, p.parent_len, p.page, p.len,
                            p.bf16_bytes, &dup) == TQKV_OK &&
        !dup) {
        cnt_add(&s->g.disk_promotions, 1);
        cnt_add(&ns->c.disk_promotions, 1);
    }
    *out = r;
    return TQKV_OK;
}

#define PREFETCH_BATCH 64

void
tqkv_store_prefetch(tqkv_store_t *s, const char *ns_name, size_t ns_len,
                    const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                    uint32_t layer_begin, uint32_t layer_end)
{
    tqkv_block_key_t keys[PREFETCH_BATCH];
    tqkv_disk_page_t pages[PREFETCH_BATCH];
    tqkv_status_t sts[PREFETCH_BATCH];
    uint64_t budget, fetched = 0;
    size_t nk = 0;
    ns_rec_t *ns;

    if (s == NULL || s->disk == NULL || (ns_name == NULL && ns_len > 0) || hashes == NULL ||
        hash_lens == NULL || layer_end <= layer_begin || layer_end > TQKV_STORE_MAX_LAYERS)
        return;
    if ((ns = tqkv__store_ns_find(s, ns_name, ns_len)) == NULL)
        return;
    budget = tqkv_pool_capacity(s->pool[TQKV_TIER_DRAM]) / 2;
    for (uint32_t l = layer_begin; l < layer_end && fetched < budget; l++) {
        for (size_t i = 0; i <= n && fetched < budget; i++) {
            if (i < n) {
                if (hashes[i] == NULL || hash_lens[i] == 0 || hash_lens[i] > 64)
                    continue;
                tqkv_block_key_t k = {ns_name, ns_len, hashes[i], hash_lens[i], l};
                uint64_t hv = key_hash(ns->hv, hashes[i], hash_lens[i]), rb = 0;
                stripe_t *sp = stripe_of(s, hv);
                pthread_mutex_lock(&sp->lock);
                entry_t *e = tqkv__store_do_entry_find(sp, hv, ns, hashes[i], hash_lens[i], l);
                pthread_mutex_unlock(&sp->lock);
                if (e != NULL || !tqkv_disk_contains(s->disk, &k, &rb))
                    continue;
                keys[nk++] = k;
                fetched += rb;
            }
            if (nk == PREFETCH_BATCH || (nk > 0 && (i == n || fetched >= budget))) {
                tqkv_disk_get_many(s->disk, keys, nk, pages, sts);
                for (size_t j = 0; j < nk; j++) {
                    int dup = 0;
                    if (sts[j] != TQKV_OK)
                        continue;
                    if (tqkv__store_put_ram(s, &keys[j],
                                            pages[j].parent_len ? pages[j].parent : NULL,
                                            pages[j].parent_len, pages[j].page, pages[j].len,
                                            pages[j].bf16_bytes, &dup) == TQKV_OK &&
                        !dup) {
                        cnt_add(&s->g.disk_promotions, 1);
                        cnt_add(&ns->c.disk_promotions, 1);
                    }
                    tqkv_disk_page_free(&pages[j]);
                }
                nk = 0;
            }
        }
    }
}

/* tqkv_store_get; without read_disk a disk-only page is TQKV_EBUSY, not read. */
static tqkv_status_t
get_impl(tqkv_store_t *s, const tqkv_block_key_t *key, tqkv_page_ref_t **out, int read_disk)
{
    ns_rec_t *ns;
    uint64_t hv;
    stripe_t *sp;
    entry_t *e;
    copy_t *c;
    tqkv_page_ref_t *r;
    int crc_kind, want_promote, held;
    uint32_t crc;

    if (out != NULL)
        *out = NULL;
    if (s == NULL || out == NULL || !valid_key(key))
        return TQKV_EINVAL;
    ns = tqkv__store_ns_find(s, key->ns, key->ns_len);
    if (ns == NULL) {
        cnt_add(&s->g.misses, 1);
        return TQKV_ENOTFOUND;
    }
    hv = key_hash(ns->hv, key->hash, key->hash_len);
    sp = stripe_of(s, hv);
    r = malloc(sizeof(*r));
    if (r == NULL)
        return TQKV_ENOMEM;

    pthread_mutex_lock(&sp->lock);
    e = tqkv__store_do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
    if (e == NULL) {
        pthread_mutex_unlock(&sp->lock);
        if (s->disk != NULL && read_disk)
            return get_disk(s, ns, key, r, out);
        if (s->disk != NULL && tqkv_disk_contains(s->disk, key, NULL)) {
            free(r);
            return TQKV_EBUSY; /* on disk only: the caller reads it (tqkv_store_pin_disk) */
        }
        free(r);
        cnt_add(&s->g.misses, 1);
        cnt_add(&ns->c.misses, 1);
        return TQKV_ENOTFOUND;
    }
    c = e->cur;
    atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    crc_kind = s->cfg.verify_crc ? e->crc_kind : CRC_NONE;
    crc = e->crc;
    if (s->cfg.policy == TQKV_EVICT_LRU) {
        pthread_mutex_lock(&s->evict_lock);
        tqkv__evq_touch(&s->q[e->tier], &e->node);
        pthread_mutex_unlock(&s->evict_lock);
    } else {
        tqkv__evq_touch(&s->q[c->tier], &e->node);
    }
    want_promote =
        s->cfg.promote_on_access && c->tier == TQKV_TIER_DRAM && s->pool[TQKV_TIER_HBM] != NULL;
    held = want_promote || crc_kind != CRC_NONE;
    if (held)
        entry_hold(e);
    pthread_mutex_unlock(&sp->lock);

    r->s = s;
    r->c = c;
    r->len = c->len;
    r->tier = c->tier;
    r->buf = NULL;
    r->host = c->data;
    if (tqkv_pool_is_device(s->pool[c->tier])) {
        tqkv_status_t st;
        r->buf = malloc(c->len);
        if (r->buf == NULL)
            st = TQKV_ENOMEM;
        else
            st = tqkv_pool_copy_out(s->pool[c->tier], r->buf, c->data, c->len);
        if (st != TQKV_OK) {
            if (held)
                entry_put(e);
            tqkv_page_ref_release(r);
            return st;
        }
        r->host = r->buf;
    }
    if (crc_kind != CRC_NONE && !crc_ok(r->host, r->len, crc_kind, crc)) {
        drop_corrupt(s, sp, e, c);
        entry_put(e);
        tqkv_page_ref_release(r);
        return TQKV_ECORRUPT;
    }
    cnt_add(&s->g.hits[r->tier], 1);
    cnt_add(&ns->c.hits[r->tier], 1);
    cnt_add(&s->g.bytes_out, r->len);
    cnt_add(&ns->c.bytes_out, r->len);
    if (want_promote)
        promote(s, e, c);
    if (held)
        entry_put(e);
    *out = r;
    return TQKV_OK;
}

tqkv_status_t
tqkv_store_get(tqkv_store_t *s, const tqkv_block_key_t *key, tqkv_page_ref_t **out)
{
    return get_impl(s, key, out, 1);
}

tqkv_status_t
tqkv_store_get_cached(tqkv_store_t *s, const tqkv_block_key_t *key, tqkv_page_ref_t **out)
{
    return get_impl(s, key, out, 0);
}

/* ---- pinned disk reads (a Get's disk-only pages, read once) ---- */

enum { PIN_NONE = 0, PIN_REF, PIN_RAM, PIN_MISS, PIN_PENDING };

/* One round of disk reads in flight (tqkv_disk_batch_*), finished block by block as the
 * Get takes them: the Get sends its first pages while the others are still read. */
typedef struct pin_round {
    struct pin_round *next;
    tqkv_disk_batch_t *b;
    size_t nk;
    tqkv_block_key_t keys[PREFETCH_BATCH]; /* the batch reads them until it ends */
} pin_round_t;

struct tqkv_store_pins {
    tqkv_store_t *s;
    ns_rec_t *ns;
    size_t first, n;        /* blocks [first, first + n) were considered */
    uint8_t *state;         /* PIN_* per block */
    tqkv_page_ref_t **refs; /* per block (PIN_REF, PIN_RAM) */
    pin_round_t **round;    /* per block (PIN_PENDING): its round, and its index there */
    uint8_t *round_idx;
    pin_round_t *rounds;
};

/* Starts one round of reads for blocks idx[0..nk): PIN_PENDING until taken. */
static void
pin_round_start(tqkv_store_pins_t *p, const tqkv_block_key_t *keys, const size_t *idx, size_t nk)
{
    pin_round_t *r = malloc(sizeof(*r));
    if (r != NULL) {
        memcpy(r->keys, keys, nk * sizeof(*keys));
        r->nk = nk;
        r->b = tqkv_disk_batch_start(p->s->disk, r->keys, nk);
    }
    if (r == NULL || r->b == NULL) {
        free(r);
        return; /* out of memory: not pinned, so the Get reads them one by one */
    }
    r->next = p->rounds;
    p->rounds = r;
    for (size_t j = 0; j < nk; j++) {
        size_t b = idx[j] - p->first;
        p->state[b] = PIN_PENDING;
        p->round[b] = r;
        p->round_idx[b] = (uint8_t)j;
    }
}

/* Finishes block b's read (PIN_PENDING): a reference over the read buffer, promoted into
 * DRAM as a plain read would (PIN_REF), or PIN_MISS. */
static void
pin_finish(tqkv_store_pins_t *p, size_t b)
{
    tqkv_store_t *s = p->s;
    pin_round_t *rd = p->round[b];
    const tqkv_block_key_t *key = &rd->keys[p->round_idx[b]];
    tqkv_disk_page_t page;
    tqkv_status_t st = tqkv_disk_batch_finish(rd->b, p->round_idx[b], &page);
    tqkv_page_ref_t *r = st == TQKV_OK ? malloc(sizeof(*r)) : NULL;
    p->round[b] = NULL;
    if (r == NULL) {
        if (st == TQKV_OK)
            tqkv_disk_page_free(&page);
        /* Gone meanwhile (ENOTFOUND) or failed its checks / the disk: a miss. */
        p->state[b] = PIN_MISS;
        return;
    }
    int dup = 0;
    if (tqkv__store_put_ram(s, key, page.parent_len ? page.parent : NULL, page.parent_len,
                            page.page, page.len, page.bf16_bytes, &dup) == TQKV_OK &&
        !dup) {
        cnt_add(&s->g.disk_promotions, 1);
        cnt_add(&p->ns->c.disk_promotions, 1);
    }
    disk_ref_init(r, s, &page);
    p->refs[b] = r;
    p->state[b] = PIN_REF;
}

static tqkv_status_t
pin_disk(tqkv_store_t *s, const char *ns_name, size_t ns_len, const uint8_t *const *hashes,
         const size_t *hash_lens, size_t n, uint32_t layer_begin, uint32_t layer_end, size_t first,
         tqkv_store_pins_t **out)
{
    tqkv_block_key_t keys[PREFETCH_BATCH];
    size_t idx[PREFETCH_BATCH], nk = 0;
    uint64_t budget, fetched = 0;

    if (out != NULL)
        *out = NULL;
    if (s == NULL || out == NULL || (ns_name == NULL && ns_len > 0) || hashes == NULL ||
        hash_lens == NULL || n == 0 || layer_end <= layer_begin ||
        layer_end > TQKV_STORE_MAX_LAYERS)
        return TQKV_EINVAL;
    size_t total = (size_t)(layer_end - layer_begin) * n;
    if (first >= total)
        return TQKV_EINVAL;
    tqkv_store_pins_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return TQKV_ENOMEM;
    p->s = s;
    p->first = first;
    p->n = total - first;
    p->state = calloc(p->n, 1);
    p->refs = calloc(p->n, sizeof(*p->refs));
    p->round = calloc(p->n, sizeof(*p->round));
    p->round_idx = calloc(p->n, 1);
    if (p->state == NULL || p->refs == NULL || p->round == NULL || p->round_idx == NULL) {
        tqkv_store_pins_free(p);
        return TQKV_ENOMEM;
    }
    p->ns = tqkv__store_ns_find(s, ns_name, ns_len);
    if (p->ns == NULL || s->disk == NULL) {
        *out = p;
        return TQKV_OK;
    }
    budget = tqkv_pool_capacity(s->pool[TQKV_TIER_DRAM]) / 2;
    for (size_t i = first; i <= total; i++) {
        if (i < total && (i == first || fetched < budget)) {
            size_t h = i % n;
            uint32_t l = layer_begin + (uint32_t)(i / n);
            if (hashes[h] == NULL || hash_lens[h] == 0 || hash_lens[h] > 64)
                continue;
            tqkv_block_key_t k = {ns_name, ns_len, hashes[h], hash_lens[h], l};
            uint64_t hv = key_hash(p->ns->hv, hashes[h], hash_lens[h]), rb = 0;
            stripe_t *sp = stripe_of(s, hv);
            pthread_mutex_lock(&sp->lock);
            entry_t *e = tqkv__store_do_entry_find(sp, hv, p->ns, hashes[h], hash_lens[h], l);
            pthread_mutex_unlock(&sp->lock);
            if (e != NULL) {
                /* In HBM/DRAM: pinned too (a reference on its copy), so that the promotions
                 * of this Get's disk pages cannot evict it and make it a disk read. */
                tqkv_page_ref_t *r = NULL;
                if (get_impl(s, &k, &r, 0) == TQKV_OK) {
                    p->refs[i - first] = r;
                    p->state[i - first] = PIN_RAM;
                }
                continue;
            }
            if (!tqkv_disk_contains(s->disk, &k, &rb))
                continue;
            keys[nk] = k;
            idx[nk++] = i;
            fetched += rb;
        }
        if (nk == PREFETCH_BATCH || (nk > 0 && (i == total || fetched >= budget))) {
            pin_round_start(p, keys, idx, nk);
            nk = 0;
        }
        if (i < total && fetched >= budget)
            break;
    }
    if (nk > 0)
        pin_round_start(p, keys, idx, nk);
    *out = p;
    return TQKV_OK;
}

tqkv_status_t
tqkv_store_pin_disk_start(tqkv_store_t *s, const char *ns_name, size_t ns_len,
                          const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                          uint32_t layer_begin, uint32_t layer_end, size_t first,
                          tqkv_store_pins_t **out)
{
    return pin_disk(s, ns_name, ns_len, hashes, hash_lens, n, layer_begin, layer_end, first, out);
}

tqkv_status_t
tqkv_store_pin_disk(tqkv_store_t *s, const char *ns_name, size_t ns_len,
                    const uint8_t *const *hashes, const size_t *hash_lens, size_t n,
                    uint32_t layer_begin, uint32_t layer_end, size_t first, tqkv_store_pins_t **out)
{
    tqkv_status_t st =
        pin_disk(s, ns_name, ns_len, hashes, hash_lens, n, layer_begin, layer_end, first, out);
    if (st != TQKV_OK)
        return st;
    tqkv_store_pins_t *p = *out;
    for (pin_round_t *r = p->rounds; r != NULL; r = r->next)
        tqkv_disk_batch_wait(r->b);
    for (size_t b = 0; b < p->n; b++)
        if (p->state[b] == PIN_PENDING)
            pin_finish(p, b);
    return TQKV_OK;
}

tqkv_page_ref_t *
tqkv_store_pins_take(tqkv_store_pins_t *p, size_t idx, int *miss)
{
    if (miss)
        *miss = 0;
    if (p == NULL || idx < p->first || idx - p->first >= p->n)
        return NULL;
    size_t b = idx - p->first;
    if (p->state[b] == PIN_PENDING)
        pin_finish(p, b);
    if (p->state[b] == PIN_MISS) {
        p->state[b] = PIN_NONE;
        if (miss)
            *miss = 1;
        cnt_add(&p->s->g.misses, 1);
        if (p->ns)
            cnt_add(&p->ns->c.misses, 1);
        return NULL;
    }
    if (p->state[b] != PIN_REF && p->state[b] != PIN_RAM)
        return NULL;
    tqkv_page_ref_t *r = p->refs[b];
    int ram = p->state[b] == PIN_RAM; /* counted when it was pinned */
    p->refs[b] = NULL;
    p->state[b] = PIN_NONE;
    if (ram)
        return r;
    cnt_add(&p->s->g.hits[TQKV_TIER_DISK], 1);
    cnt_add(&p->ns->c.hits[TQKV_TIER_DISK], 1);
    cnt_add(&p->s->g.bytes_out, r->len);
    cnt_add(&p->ns->c.bytes_out, r->len);
    return r;
}

void
tqkv_store_pins_free(tqkv_store_pins_t *p)
{
    if (p == NULL)
        return;
    for (size_t b = 0; p->refs && b < p->n; b++)
        tqkv_page_ref_release(p->refs[b]);
    while (p->rounds != NULL) { /* reads not taken: waited for and dropped */
        pin_round_t *r = p->rounds;
        p->rounds = r->next;
        tqkv_disk_batch_end(r->b);
        free(r);
    }
    free(p->refs);
    free(p->state);
    free(p->round);
    free(p->round_idx);
    free(p);
}

const void *
tqkv_page_ref_data(const tqkv_page_ref_t *r)
{
    return r ? r->host : NULL;
}

size_t
tqkv_page_ref_len(const tqkv_page_ref_t *r)
{
    return r ? r->len : 0;
}

tqkv_tier_t
tqkv_page_ref_tier(const tqkv_page_ref_t *r)
{
    return r ? (tqkv_tier_t)r->tier : TQKV_TIER_NONE;
}

void
tqkv_page_ref_release(tqkv_page_ref_t *r)
{
    if (r == NULL)
        return;
    free(r->buf);
    if (r->c != NULL)
        copy_release(r->s, r->c);
    free(r);
}

/* ---- lookup ---- */

tqkv_status_t
tqkv_store_lookup(tqkv_store_t *s, const char *ns_name, size_t ns_len, const uint8_t *const *hashes,
                  const size_t *hash_lens, size_t n, uint32_t num_layers, uint32_t lease_ms,
                  uint32_t *prefix_blocks, uint8_t *tiers_out)
{
    ns_rec_t *ns;
    uint32_t prefix = 0;
    uint64_t until = 0;
    int running = 1;

    if (s == NULL || prefix_blocks == NULL || (n > 0 && (hashes == NULL || hash_lens == NULL)) ||
        (ns_name == NULL && ns_len > 0) || num_layers == 0 || num_layers > TQKV_STORE_MAX_LAYERS)
        return TQKV_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (hashes[i] == NULL || hash_lens[i] == 0 || hash_lens[i] > 64)
            return TQKV_EINVAL;
    *prefix_blocks = 0;
    ns = tqkv__store_ns_find(s, ns_name, ns_len);
    if (lease_ms > 0) {
        until = now_ms(s) + lease_ms;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t tier = TQKV_TIER_NONE;
        if (ns != NULL) {
            uint64_t hv = key_hash(ns->hv, hashes[i], hash_lens[i]);
            stripe_t *sp = stripe_of(s, hv);
            pthread_mutex_lock(&sp->lock);
            block_t *b = tqkv__store_do_block_find(sp, hv, ns, hashes[i], hash_lens[i]);
            if (b != NULL && (b->nlayers >= num_layers || s->disk != NULL)) {
                uint32_t l;
                uint8_t slow = TQKV_TIER_HBM;
                int ondisk = 0;
                for (l = 0; l < num_layers; l++) {
                    entry_t *e = l < b->nlayers ? b->layers[l] : NULL;
                    if (e == NULL) {
                        tqkv_block_key_t k = {ns_name, ns_len, hashes[i], hash_lens[i], l};
                        if (s->disk == NULL || !tqkv_disk_contains(s->disk, &k, NULL))
                            break;
                        slow = TQKV_TIER_DISK; /* leased below, by the disk tier */
                        ondisk = 1;
                        continue;
                    }
                    if (e->cur->tier > slow)
                        slow = e->cur->tier;
                }
                if (l == num_layers) {
                    tier = slow;
                    if (running && until != 0)
                        for (l = 0; l < num_layers; l++) {
                            if (ondisk && (l >= b->nlayers || b->layers[l] == NULL)) {
                                /* Disk-only: the disk tier holds the lease. */
                                tqkv_block_key_t k = {ns_name, ns_len, hashes[i], hash_lens[i], l};
                                tqkv_disk_lease(s->disk, &k, lease_ms);
                                continue;
                            }
                            _Atomic uint64_t *lu = &b->layers[l]->lease_until;
                            uint64_t cur = atomic_load_explicit(lu, memory_order_relaxed);
                            if (until > cur)
                                atomic_store_explicit(lu, until, memory_order_relaxed);
                        }
                }
            }
            if (b == NULL && s->disk != NULL) {
                uint32_t l;
                for (l = 0; l < num_layers; l++) {
                    tqkv_block_key_t k = {ns_name, ns_len, hashes[i], hash_lens[i], l};
                    if (!tqkv_disk_contains(s->disk, &k, NULL))
                        break;
                }
                if (l == num_layers) {
                    tier = TQKV_TIER_DISK;
                    for (l = 0; running && until != 0 && l < num_layers; l++) {
                        tqkv_block_key_t k = {ns_name, ns_len, hashes[i], hash_lens[i], l};
                        tqkv_disk_lease(s->disk, &k, lease_ms);
                    }
                }
            }
            pthread_mutex_unlock(&sp->lock);
        }
        if (running && tier != TQKV_TIER_NONE)
            prefix++;
        else
            running = 0;
        if (tiers_out)
            tiers_out[i] = tier;
        if (!running && tiers_out == NULL)
            break;
    }
    *prefix_blocks = prefix;
    return TQKV_OK;
}
