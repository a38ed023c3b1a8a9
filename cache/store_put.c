/* store_put.c - the store's puts: a page into HBM or DRAM (quota, room, link, adopt
 * orphans), then written through to the disk tier; the disk tier's group commit.
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

/* ---- put ---- */

/* Finds (ns, hash, layer) and takes an sref on it; NULL when absent. */
static entry_t *
entry_lookup_hold(tqkv_store_t *s, ns_rec_t *ns, const uint8_t *hash, size_t hlen, uint32_t layer)
{
    uint64_t hv = key_hash(ns->hv, hash, hlen);
    stripe_t *st = stripe_of(s, hv);
    pthread_mutex_lock(&st->lock);
    entry_t *e = tqkv__store_do_entry_find(st, hv, ns, hash, hlen, layer);
    if (e != NULL)
        entry_hold(e);
    pthread_mutex_unlock(&st->lock);
    return e;
}

/* Reserves len bytes of ns's quota, evicting the namespace's own pages (coldest tier
 * first) to make room. TQKV_ENOSPC (counted as an allocation failure) when it cannot. */
static tqkv_status_t
quota_make_room(tqkv_store_t *s, ns_rec_t *ns, size_t len)
{
    uint64_t q = atomic_load(&ns->quota);
    if (q != 0 && len > q)
        goto full;
    for (int tries = 0; !tqkv__store_quota_reserve(ns, len); tries++)
        if (tries > MAX_EVICT_TRIES || !tqkv__store_evict_one(s, TQKV_TIER_DRAM, ns))
            goto full;
    return TQKV_OK;
full:
    cnt_add(&s->g.alloc_failures, 1);
    cnt_add(&ns->c.alloc_failures, 1);
    return TQKV_ENOSPC;
}

/* A new entry (*ep) for the len-byte page copied to mem in tier, with its copy (*cp) and
 * CRC. TQKV_ENOMEM when either could not be allocated (the caller frees both). */
static tqkv_status_t
new_entry(tqkv_store_t *s, const tqkv_block_key_t *key, const void *page, size_t len,
          uint64_t bf16_bytes, int tier, void *mem, copy_t **cp, entry_t **ep)
{
    copy_t *c = *cp = malloc(sizeof(*c));
    entry_t *e = *ep = calloc(1, sizeof(*e));
    if (c == NULL || e == NULL)
        return TQKV_ENOMEM;
    c->data = mem;
    c->len = (uint32_t)len;
    c->tier = (uint8_t)tier;
    atomic_init(&c->refs, 1);
    e->node.len = (uint32_t)len;
    e->cur = c;
    e->bf16 = bf16_bytes;
    e->layer = key->layer;
    e->tier = (uint8_t)tier;
    atomic_init(&e->sref, 1);
    const tqkv_page_header_t *h = page;
    if (len >= sizeof(*h) && h->magic == TQKV_PAGE_MAGIC && h->page_bytes == len) {
        e->crc = h->crc32c;
        e->crc_kind = CRC_PAGE;
    } else if (s->cfg.verify_crc) {
        e->crc = tqkv_crc32c(0, page, len);
        e->crc_kind = CRC_WHOLE;
    }
    return TQKV_OK;
}

/* Makes *bp (the block of key found in the stripe, or NULL) a block with a slot for
 * key->layer: created and linked into the stripe when NULL, its layer array grown when
 * short (stripe lock held). TQKV_ENOMEM, or the stripe's growth status; a block created
 * here that cannot grow is unlinked again. */
static tqkv_status_t
do_block_make(stripe_t *sp, uint64_t hv, ns_rec_t *ns, const tqkv_block_key_t *key, block_t **bp)
{
    tqkv_status_t st;
    block_t *b = *bp;
    if (b == NULL) {
        if (sp->count >= sp->nb && (st = tqkv__store_do_stripe_grow(sp)) != TQKV_OK)
            return st;
        b = calloc(1, sizeof(*b) + key->hash_len);
        if (b == NULL)
            return TQKV_ENOMEM;
        b->ns = ns;
        b->hv = hv;
        b->hash_len = (uint8_t)key->hash_len;
        memcpy(b->hash, key->hash, key->hash_len);
        b->hnext = sp->buckets[hv & (sp->nb - 1)];
        sp->buckets[hv & (sp->nb - 1)] = b;
        sp->count++;
        *bp = b;
    }
    if (key->layer >= b->nlayers) {
        uint32_t n = b->nlayers ? b->nlayers : 1;
        while (n <= key->layer)
            n *= 2;
        if (n > TQKV_STORE_MAX_LAYERS)
            n = TQKV_STORE_MAX_LAYERS;
        entry_t **nl = realloc(b->layers, n * sizeof(*nl));
        if (nl == NULL) {
            if (b->nlive == 0)
                tqkv__store_do_block_unlink_free(sp, b);
            return TQKV_ENOMEM;
        }
        memset(nl + b->nlayers, 0, (n - b->nlayers) * sizeof(*nl));
        b->layers = nl;
        b->nlayers = n;
    }
    return TQKV_OK;
}

/* Links e (in its block already) into its namespace's list, its tier's queue and the
 * prefix tree: counted by *parent when that one is linked (the sref on it then belongs to
 * e and *parent becomes NULL), else an orphan waiting for it; and adopts the pages put
 * before it that name it as their parent (stripe lock and evict_lock held). Returns 1 when
 * e became an orphan: it holds an extra sref, and the caller looks for its parent again
 * (it may have been linked since). */
static int
do_link(tqkv_store_t *s, entry_t *e, uint64_t hv, const tqkv_block_key_t *key,
        const uint8_t *parent_hash, size_t parent_len, entry_t **parent)
{
    ns_rec_t *ns = e->blk->ns;
    int recheck = 0;
    e->linked = 1;
    e->ns_next = ns->head;
    if (ns->head)
        ns->head->ns_prev = e;
    else
        ns->tail = e;
    ns->head = e;
    tqkv__store_do_account(s, e, e->tier, 1);
    tqkv__evq_insert(&s->q[e->tier], &e->node, hv);
    if (*parent != NULL && (*parent)->linked) {
        if ((*parent)->children++ == 0)
            tqkv__evq_park(&s->q[(*parent)->tier], &(*parent)->node);
        e->parent = *parent; /* keeps our sref */
        *parent = NULL;
    } else if (parent_len > 0 &&
               tqkv__store_do_orphan_add(s, e, ns, parent_hash, parent_len, key->layer)) {
        recheck = 1; /* the parent may have been linked since we looked */
        entry_hold(e);
    }
    /* Pages put before us that name us as their parent. */
    orphan_t *o = tqkv__store_do_orphan_find(s, ns, hv, key->hash, key->hash_len, key->layer);
    for (entry_t *k = o ? o->kids : NULL, *next; k != NULL; k = next) {
        next = k->sib_next;
        tqkv__store_do_adopt(s, e, k);
    }
    return recheck;
}

/* Puts into HBM/DRAM (the whole of tqkv_store_put without a disk tier). */
tqkv_status_t
tqkv__store_put_ram(tqkv_store_t *s, const tqkv_block_key_t *key, const uint8_t *parent_hash,
                    size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes,
                    int *duplicate)
{
    tqkv_status_t st;
    ns_rec_t *ns;
    uint64_t hv;
    stripe_t *sp;
    entry_t *e = NULL, *parent = NULL;
    copy_t *c = NULL;
    block_t *b;
    void *mem = NULL;
    int tier, recheck;

    if (duplicate)
        *duplicate = 0;
    if (s == NULL || !valid_key(key) || page == NULL || len == 0 || len > UINT32_MAX ||
        (parent_len > 0 && parent_hash == NULL) || parent_len > 64)
        return TQKV_EINVAL;
    if ((st = tqkv__store_ns_get(s, key->ns, key->ns_len, &ns)) != TQKV_OK)
        return st;
    hv = key_hash(ns->hv, key->hash, key->hash_len);
    sp = stripe_of(s, hv);

    pthread_mutex_lock(&sp->lock);
    e = tqkv__store_do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
    pthread_mutex_unlock(&sp->lock);
    if (e != NULL) {
        if (duplicate)
            *duplicate = 1;
        return TQKV_OK;
    }
    if ((st = quota_make_room(s, ns, len)) != TQKV_OK)
        return st;

    if (parent_len > 0)
        parent = entry_lookup_hold(s, ns, parent_hash, parent_len, key->layer);

    tier = s->pool[TQKV_TIER_HBM] ? TQKV_TIER_HBM : TQKV_TIER_DRAM;
    st = tqkv__store_make_room(s, tier, len, &mem, 1);
    if (st != TQKV_OK && tier == TQKV_TIER_HBM) {
        tier = TQKV_TIER_DRAM;
        st = tqkv__store_make_room(s, tier, len, &mem, 1);
    }
    if (st != TQKV_OK)
        goto fail_alloc;
    if ((st = tqkv_pool_copy_in(s->pool[tier], mem, page, len)) != TQKV_OK)
        goto fail_copy;
    if ((st = new_entry(s, key, page, len, bf16_bytes, tier, mem, &c, &e)) != TQKV_OK)
        goto fail_copy;

    pthread_mutex_lock(&sp->lock);
    b = tqkv__store_do_block_find(sp, hv, ns, key->hash, key->hash_len);
    if (b != NULL && key->layer < b->nlayers && b->layers[key->layer] != NULL) {
        pthread_mutex_unlock(&sp->lock);
        if (duplicate)
            *duplicate = 1;
        st = TQKV_OK;
        goto fail_copy;
    }
    if ((st = do_block_make(sp, hv, ns, key, &b)) != TQKV_OK)
        goto fail_locked;
    e->blk = b;
    b->layers[key->layer] = e;
    b->nlive++;
    pthread_mutex_lock(&s->evict_lock);
    recheck = do_link(s, e, hv, key, parent_hash, parent_len, &parent);
    pthread_mutex_unlock(&s->evict_lock);
    pthread_mutex_unlock(&sp->lock);

    if (recheck) {
        entry_t *p = entry_lookup_hold(s, ns, parent_hash, parent_len, key->layer);
        if (p != NULL) {
            pthread_mutex_lock(&s->evict_lock);
            tqkv__store_do_adopt(s, p, e);
            pthread_mutex_unlock(&s->evict_lock);
            entry_put(p);
        }
        entry_put(e);
    }

    cnt_add(&s->g.bytes_in, len);
    cnt_add(&ns->c.bytes_in, len);
    cnt_add(&s->g.bf16, bf16_bytes);
    cnt_add(&ns->c.bf16, bf16_bytes);
    if (parent != NULL)
        entry_put(parent);
    if (tier == TQKV_TIER_HBM)
        tqkv__store_bg_kick(s);
    return TQKV_OK;

fail_locked:
    pthread_mutex_unlock(&sp->lock);
fail_copy:
    free(c);
    free(e);
    tqkv_pool_free(s->pool[tier], mem, len);
fail_alloc:
    cnt_sub(&ns->reserved, len);
    if (parent != NULL)
        entry_put(parent);
    if (st != TQKV_OK) {
        cnt_add(&s->g.alloc_failures, 1);
        cnt_add(&ns->c.alloc_failures, 1);
    }
    return st;
}

static void
sync_widen(tqkv_store_sync_t *sy, uint64_t lo, uint64_t hi)
{
    if (hi == 0)
        return;
    if (sy->hi == 0 || lo < sy->lo)
        sy->lo = lo;
    if (hi > sy->hi)
        sy->hi = hi;
}

tqkv_status_t
tqkv_store_put_nosync(tqkv_store_t *s, const tqkv_block_key_t *key, const uint8_t *parent_hash,
                      size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes,
                      int *duplicate, tqkv_store_sync_t *sync)
{
    tqkv_status_t st, dst;
    int dup = 0;
    uint64_t seq = 0;
    int defer =
        sync != NULL && s != NULL && s->disk != NULL && s->cfg.disk_sync == TQKV_DISK_SYNC_ALWAYS;

    if (duplicate)
        *duplicate = 0;
    if (s == NULL || s->disk == NULL || !valid_key(key) || page == NULL || len == 0 ||
        len > UINT32_MAX || (parent_len > 0 && parent_hash == NULL) || parent_len > 64)
        return tqkv__store_put_ram(s, key, parent_hash, parent_len, page, len, bf16_bytes,
                                   duplicate);
    if (tqkv_disk_contains(s->disk, key, NULL)) {
        if (duplicate)
            *duplicate = 1;
        if (defer) { /* the record found may be a concurrent Put's, not yet durable */
            uint64_t last = tqkv_disk_last_seq(s->disk);
            sync_widen(sync, last, last);
        }
        return TQKV_OK;
    }
    /* Quota over the namespace's disk bytes (everything is written through): drop its
     * oldest disk records first. */
    {
        ns_rec_t *ns;
        if ((st = tqkv__store_ns_get(s, key->ns, key->ns_len, &ns)) != TQKV_OK)
            return st;
        uint64_t q = atomic_load(&ns->quota), used = 0, freed = 0;
        uint64_t rb =
            tqkv_disk_record_bytes((uint32_t)(key->ns_len + key->hash_len + parent_len), len);
        if (q != 0) {
            if (rb > q) {
                cnt_add(&s->g.alloc_failures, 1);
                cnt_add(&ns->c.alloc_failures, 1);
                return TQKV_ENOSPC;
            }
            tqkv_disk_ns_usage(s->disk, key->ns, key->ns_len, NULL, &used, NULL, NULL);
            if (used + rb > q) {
                /* Leaves first, leased records stay; each dropped record is tombstoned. */
                st =
                    tqkv_disk_evict_namespace(s->disk, key->ns, key->ns_len, used + rb - q, &freed);
                if (st == TQKV_OK && freed < used + rb - q)
                    st = TQKV_ENOSPC; /* what is left is leased */
                if (st != TQKV_OK) {
                    cnt_add(&s->g.alloc_failures, 1);
                    cnt_add(&ns->c.alloc_failures, 1);
                    return st;
                }
            }
        }
    }
    st = tqkv__store_put_ram(s, key, parent_hash, parent_len, page, len, bf16_bytes, &dup);
    if (duplicate)
        *duplicate = dup;
    if (st != TQKV_OK && st != TQKV_ENOSPC)
        return st;
    if (dup)
        return TQKV_OK;
    /* Written through; with a full DRAM (ENOSPC: everything pinned or leased) the disk
     * copy alone holds the page. */
    if (defer)
        dst = tqkv_disk_append(s->disk, key, parent_hash, parent_len, page, len, bf16_bytes, &seq);
    else
        dst = tqkv_disk_put(s->disk, key, parent_hash, parent_len, page, len, bf16_bytes);
    if (dst == TQKV_OK) {
        sync_widen(sync, seq, seq);
        /* Concurrent Puts of the namespace may all have passed the check above: trim
         * what they put over the quota (oldest first, so not this record). */
        ns_rec_t *ns = tqkv__store_ns_find(s, key->ns, key->ns_len);
        uint64_t q = ns ? atomic_load(&ns->quota) : 0, used = 0, freed = 0;
        if (q != 0) {
            tqkv_disk_ns_usage(s->disk, key->ns, key->ns_len, NULL, &used, NULL, NULL);
            if (used > q)
                tqkv_disk_evict_namespace(s->disk, key->ns, key->ns_len, used - q, &freed);
        }
        return TQKV_OK;
    }
    if (st == TQKV_ENOSPC || s->cfg.disk_sync == TQKV_DISK_SYNC_ALWAYS)
        return dst; /* not stored (or not durable, as --disk-sync always promises) */
    return TQKV_OK; /* in DRAM; the disk error is counted (io_errors) and logged */
}

tqkv_status_t
tqkv_store_put(tqkv_store_t *s, const tqkv_block_key_t *key, const uint8_t *parent_hash,
               size_t parent_len, const void *page, size_t len, uint64_t bf16_bytes, int *duplicate)
{
    tqkv_store_sync_t sy = {0, 0};
    tqkv_status_t st = tqkv_store_put_nosync(s, key, parent_hash, parent_len, page, len, bf16_bytes,
                                             duplicate, &sy);
    if (st == TQKV_OK)
        st = tqkv_store_sync(s, &sy);
    return st;
}

tqkv_status_t
tqkv_store_sync(tqkv_store_t *s, const tqkv_store_sync_t *sync)
{
    if (s == NULL || sync == NULL || s->disk == NULL || sync->hi == 0)
        return TQKV_OK;
    return tqkv_disk_sync_range(s->disk, sync->lo, sync->hi);
}
