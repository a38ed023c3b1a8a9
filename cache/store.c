/* store.c - the tiered page store: index, tiers, eviction, demotion, pins, quotas.
 *
 * Data structures. A block (namespace, hash) lives in one of NSTRIPES index stripes
 * (chained hash table per stripe) and holds an array of per-layer entries. An entry
 * is one page's metadata; its bytes are a refcounted `copy` in one tier's pool. The
 * index holds one reference on the current copy, every reader (tqkv_page_ref_t) one
 * more, so an evicted, deleted or demoted copy is freed by its last reader.
 * Entries have their own count (`sref`): one for being linked in the index, one per
 * linked child that counted this entry as its parent, one per short-lived hold by
 * the evictor/demoter; the struct is freed when it drops to zero.
 *
 * Prefixes. A page counts as a child of the page (ns, parent_hash, same layer) when
 * that one is present at put time; a page put before its parent waits in an `orphan`
 * record and is adopted when the parent arrives. Pages with children are parked out of
 * the eviction order (evict.h) and return at its cold end when their last child goes,
 * so eviction is leaf-first across tiers. Each namespace also lists its pages by
 * insertion, which bounds quota eviction to the namespace's own pages.
 *
 * Tiers. Puts go to HBM when there is one (demoting the coldest pages synchronously
 * when it is full), else DRAM. A background thread demotes from the high to the low
 * watermark. Demotion and promotion copy the page, then swap `cur` under the stripe
 * lock and evict_lock; readers of the old copy keep it pinned. DRAM full -> evict.
 *
 * Locks, in acquisition order (never the reverse; never two stripe locks at once):
 *   0. maint_lock: one background maintenance pass (demotion) at a time.
 *   1. ns_lock (rwlock): the namespace table. Taken alone; namespace records live
 *      until the store is destroyed, so pointers to them need no lock.
 *   2. stripe[i].lock: the stripe's buckets and blocks, each entry's `cur` copy
 *      pointer and lease of the blocks in it.
 *   3. evict_lock: every tier queue, entry `tier`, `children`, `parent`, `linked`
 *      (written with both 2 and 3 held, so either one makes it stable), namespace
 *      page lists, orphan records, tier accounting.
 * The evictor finds a victim under evict_lock, takes an `sref`, drops evict_lock,
 * then takes the victim's stripe lock and evict_lock again and re-validates. Pool
 * calls take no store lock (and may be made with locks held: they are leaves).
 *
 * Accounting: each tier's pool caps bytes of page data (pinned-but-evicted copies and
 * copies in flight included), so capacities are hard. Namespace quotas reserve bytes
 * with a compare-and-swap before allocating (`ns->reserved` = linked + in flight).
 *
 * Disk tier (`disk`, cache/disk.h). Pages are written through to it after the HBM/DRAM
 * put; disk-only pages have no entry here (the disk index holds them in <= 64 bytes
 * each). A Get that misses the index reads the disk record and promotes a copy with the
 * ordinary put path. The disk tier's own locks are leaves for the store: its functions
 * are called with stripe/evict locks held (tqkv_disk_contains in do_unlink and lookup,
 * tqkv_disk_lease in lookup) and never call back into the store. Disk reads and writes
 * happen with no store lock. A Lookup lease on a disk-only layer is held by the disk tier
 * (its reclaimer copies leased records forward instead of dropping them); a pin of a page
 * served from disk holds its own read buffer. Quota enforcement drops disk records leaves
 * first, skips leased ones and tombstones what it drops.
 *
 * Files: this one (namespaces, the index, orphans, create/destroy, deletes),
 * cache/store_evict.c, cache/store_put.c, cache/store_get.c, cache/store_stats.c; the
 * types they share are in cache/store_internal.h.
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

/* ---- namespaces ---- */

/* Returns the record of ns or NULL (ns_lock must be held). */
static ns_rec_t *
do_ns_find(tqkv_store_t *s, const char *ns, size_t len, uint64_t h)
{
    if (s->ns_cap == 0)
        return NULL;
    for (size_t i = h & (s->ns_cap - 1);; i = (i + 1) & (s->ns_cap - 1)) {
        ns_rec_t *r = s->ns_tab[i];
        if (r == NULL)
            return NULL;
        if (r->hv == h && r->len == len && (len == 0 || memcmp(r->name, ns, len) == 0))
            return r;
    }
}

ns_rec_t *
tqkv__store_ns_find(tqkv_store_t *s, const char *ns, size_t len)
{
    uint64_t h = ns_hash(ns, len);
    pthread_rwlock_rdlock(&s->ns_lock);
    ns_rec_t *r = do_ns_find(s, ns, len, h);
    pthread_rwlock_unlock(&s->ns_lock);
    return r;
}

static void
do_ns_insert(tqkv_store_t *s, ns_rec_t *r)
{
    size_t i = r->hv & (s->ns_cap - 1);
    while (s->ns_tab[i] != NULL)
        i = (i + 1) & (s->ns_cap - 1);
    s->ns_tab[i] = r;
}

tqkv_status_t
tqkv__store_ns_get(tqkv_store_t *s, const char *ns, size_t len, ns_rec_t **out)
{
    uint64_t h = ns_hash(ns, len);
    ns_rec_t *r = tqkv__store_ns_find(s, ns, len);
    if (r != NULL) {
        *out = r;
        return TQKV_OK;
    }
    pthread_rwlock_wrlock(&s->ns_lock);
    r = do_ns_find(s, ns, len, h);
    if (r != NULL)
        goto done;
    if ((s->ns_count + 1) * 2 > s->ns_cap) {
        size_t ncap = s->ns_cap ? s->ns_cap * 2 : 16;
        ns_rec_t **old = s->ns_tab, **tab = calloc(ncap, sizeof(*tab));
        size_t ocap = s->ns_cap;
        if (tab == NULL)
            goto nomem;
        s->ns_tab = tab;
        s->ns_cap = ncap;
        for (size_t i = 0; i < ocap; i++)
            if (old[i])
                do_ns_insert(s, old[i]);
        free(old);
    }
    r = calloc(1, sizeof(*r));
    if (r == NULL)
        goto nomem;
    r->name = malloc(len + 1);
    if (r->name == NULL) {
        free(r);
        goto nomem;
    }
    if (len)
        memcpy(r->name, ns, len);
    r->name[len] = '\0';
    r->len = len;
    r->hv = h;
    atomic_init(&r->quota, s->cfg.default_ns_quota);
    do_ns_insert(s, r);
    s->ns_count++;
done:
    pthread_rwlock_unlock(&s->ns_lock);
    *out = r;
    return TQKV_OK;
nomem:
    pthread_rwlock_unlock(&s->ns_lock);
    return TQKV_ENOMEM;
}

int
tqkv__store_quota_reserve(ns_rec_t *r, uint64_t len)
{
    uint64_t q = atomic_load_explicit(&r->quota, memory_order_relaxed);
    uint64_t cur = atomic_load_explicit(&r->reserved, memory_order_relaxed);
    for (;;) {
        if (q != 0 && (len > q || cur > q - len))
            return 0;
        if (atomic_compare_exchange_weak_explicit(&r->reserved, &cur, cur + len,
                                                  memory_order_acq_rel, memory_order_relaxed))
            return 1;
    }
}

/* ---- index (stripe lock held) ---- */

block_t *
tqkv__store_do_block_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash, size_t hlen)
{
    if (st->nb == 0)
        return NULL;
    for (block_t *b = st->buckets[hv & (st->nb - 1)]; b != NULL; b = b->hnext)
        if (b->hv == hv && b->ns == ns && b->hash_len == hlen && memcmp(b->hash, hash, hlen) == 0)
            return b;
    return NULL;
}

entry_t *
tqkv__store_do_entry_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash, size_t hlen,
                          uint32_t layer)
{
    block_t *b = tqkv__store_do_block_find(st, hv, ns, hash, hlen);
    if (b == NULL || layer >= b->nlayers)
        return NULL;
    return b->layers[layer];
}

tqkv_status_t
tqkv__store_do_stripe_grow(stripe_t *st)
{
    size_t nnb = st->nb ? st->nb * 2 : 16;
    block_t **nb = calloc(nnb, sizeof(*nb));
    if (nb == NULL)
        return st->nb ? TQKV_OK : TQKV_ENOMEM; /* a full table still works */
    for (size_t i = 0; i < st->nb; i++) {
        block_t *b = st->buckets[i], *n;
        for (; b != NULL; b = n) {
            n = b->hnext;
            b->hnext = nb[b->hv & (nnb - 1)];
            nb[b->hv & (nnb - 1)] = b;
        }
    }
    free(st->buckets);
    st->buckets = nb;
    st->nb = nnb;
    return TQKV_OK;
}

void
tqkv__store_do_block_unlink_free(stripe_t *st, block_t *b)
{
    block_t **pp = &st->buckets[b->hv & (st->nb - 1)];
    while (*pp != b)
        pp = &(*pp)->hnext;
    *pp = b->hnext;
    st->count--;
    free(b->layers);
    free(b);
}

/* Moves tier accounting of e (linked) by sign. */
void
tqkv__store_do_account(tqkv_store_t *s, entry_t *e, int tier, int add)
{
    counters_t *n = &e->blk->ns->c;
    uint64_t len = e->node.len;
    if (add) {
        cnt_add(&s->g.pages[tier], 1);
        cnt_add(&s->g.bytes[tier], len);
        cnt_add(&n->pages[tier], 1);
        cnt_add(&n->bytes[tier], len);
    } else {
        cnt_sub(&s->g.pages[tier], 1);
        cnt_sub(&s->g.bytes[tier], len);
        cnt_sub(&n->pages[tier], 1);
        cnt_sub(&n->bytes[tier], len);
    }
}

/* ---- orphans (evict_lock held) ---- */

static size_t
orph_slot(const tqkv_store_t *s, uint64_t hv, uint32_t layer)
{
    return (size_t)(tqkv__mix64(hv ^ ((uint64_t)layer * 0x9E3779B97F4A7C15ULL)) & (s->orph_nb - 1));
}

orphan_t *
tqkv__store_do_orphan_find(tqkv_store_t *s, ns_rec_t *ns, uint64_t hv, const uint8_t *hash,
                           size_t hlen, uint32_t layer)
{
    if (s->orph_nb == 0)
        return NULL;
    for (orphan_t *o = s->orph_tab[orph_slot(s, hv, layer)]; o != NULL; o = o->hnext)
        if (o->hv == hv && o->ns == ns && o->layer == layer && o->hash_len == hlen &&
            memcmp(o->hash, hash, hlen) == 0)
            return o;
    return NULL;
}

/* Records e as waiting for parent (ns, hash, layer). Best effort: 0 when out of memory. */
int
tqkv__store_do_orphan_add(tqkv_store_t *s, entry_t *e, ns_rec_t *ns, const uint8_t *hash,
                          size_t hlen, uint32_t layer)
{
    uint64_t hv = key_hash(ns->hv, hash, hlen);
    orphan_t *o = tqkv__store_do_orphan_find(s, ns, hv, hash, hlen, layer);
    if (o == NULL) {
        if (s->orph_count >= s->orph_nb) {
            size_t nnb = s->orph_nb ? s->orph_nb * 2 : 64, onb = s->orph_nb;
            orphan_t **nt = calloc(nnb, sizeof(*nt)), **ot = s->orph_tab;
            if (nt != NULL) {
                s->orph_tab = nt;
                s->orph_nb = nnb;
                for (size_t i = 0; i < onb; i++)
                    for (orphan_t *x = ot[i], *nx; x != NULL; x = nx) {
                        nx = x->hnext;
                        size_t k = orph_slot(s, x->hv, x->layer);
                        x->hnext = nt[k];
                        nt[k] = x;
                    }
                free(ot);
            } else if (onb == 0) {
                return 0;
            }
        }
        o = calloc(1, sizeof(*o) + hlen);
        if (o == NULL)
            return 0;
        o->ns = ns;
        o->hv = hv;
        o->layer = layer;
        o->hash_len = (uint8_t)hlen;
        memcpy(o->hash, hash, hlen);
        size_t k = orph_slot(s, hv, layer);
        o->hnext = s->orph_tab[k];
        s->orph_tab[k] = o;
        s->orph_count++;
    }
    e->sib_prev = NULL;
    e->sib_next = o->kids;
    if (o->kids)
        o->kids->sib_prev = e;
    o->kids = e;
    e->orphan = o;
    return 1;
}

/* Takes e off its orphan record, freeing the record when it was the last kid. */
static void
do_orphan_remove(tqkv_store_t *s, entry_t *e)
{
    orphan_t *o = e->orphan;
    if (e->sib_prev)
        e->sib_prev->sib_next = e->sib_next;
    else
        o->kids = e->sib_next;
    if (e->sib_next)
        e->sib_next->sib_prev = e->sib_prev;
    e->sib_prev = e->sib_next = NULL;
    e->orphan = NULL;
    if (o->kids == NULL) {
        orphan_t **pp = &s->orph_tab[orph_slot(s, o->hv, o->layer)];
        while (*pp != o)
            pp = &(*pp)->hnext;
        *pp = o->hnext;
        s->orph_count--;
        free(o);
    }
}

/* Makes p the counted parent of the orphan kid, unless that would close a cycle (p
 * descends from kid: possible only with colliding or forged hashes) or the ancestry is
 * too deep to check. */
void
tqkv__store_do_adopt(tqkv_store_t *s, entry_t *p, entry_t *kid)
{
    int depth = 0;
    if (!p->linked || !kid->linked || kid->orphan == NULL)
        return;
    for (entry_t *a = p; a != NULL; a = a->parent)
        if (a == kid || ++depth > 4096)
            return;
    do_orphan_remove(s, kid);
    entry_hold(p);
    kid->parent = p;
    if (p->children++ == 0)
        tqkv__evq_park(&s->q[p->tier], &p->node);
}

/* Removes e from the index and its queue (stripe lock and evict_lock held). The block is
 * left in place (the caller frees it when nlive reaches 0). Drops the index's copy
 * reference and the link sref: e may be freed on return unless the caller holds one. */
void
tqkv__store_do_unlink(tqkv_store_t *s, entry_t *e, int evicted)
{
    block_t *b = e->blk;
    ns_rec_t *ns = b->ns;
    entry_t *p = e->parent;

    tqkv__evq_remove(&s->q[e->tier], &e->node, evicted, b->hv);
    if (e->ns_prev)
        e->ns_prev->ns_next = e->ns_next;
    else
        ns->head = e->ns_next;
    if (e->ns_next)
        e->ns_next->ns_prev = e->ns_prev;
    else
        ns->tail = e->ns_prev;
    e->ns_prev = e->ns_next = NULL;
    if (e->orphan != NULL)
        do_orphan_remove(s, e);
    b->layers[e->layer] = NULL;
    b->nlive--;
    e->linked = 0;
    tqkv__store_do_account(s, e, e->tier, 0);
    cnt_sub(&s->g.bf16, e->bf16);
    cnt_sub(&ns->c.bf16, e->bf16);
    cnt_sub(&ns->reserved, e->node.len);
    if (evicted) {
        tqkv_block_key_t k = {ns->name, ns->len, b->hash, b->hash_len, e->layer};
        if (s->disk != NULL && tqkv_disk_contains(s->disk, &k, NULL)) {
            /* The disk copy stays: a demotion to disk, from DRAM or (when DRAM could not
             * take the page) from HBM. */
            if (e->tier == TQKV_TIER_DRAM) {
                cnt_add(&s->g.disk_demotions, 1);
                cnt_add(&ns->c.disk_demotions, 1);
            } else {
                cnt_add(&s->g.demotions, 1);
                cnt_add(&ns->c.demotions, 1);
            }
        } else {
            cnt_add(&s->g.evictions, 1);
            cnt_add(&ns->c.evictions, 1);
        }
    }
    if (p != NULL) {
        e->parent = NULL;
        if (--p->children == 0 && p->linked && p->node.where == TQKV__EVQ_PARKED) {
            tqkv__evq_remove(&s->q[p->tier], &p->node, 0, 0);
            tqkv__evq_insert_cold(&s->q[p->tier], &p->node);
        }
        entry_put(p);
    }
    copy_release(s, e->cur);
    e->cur = NULL;
    entry_put(e);
}

/* ---- create / destroy ---- */

static void
disk_ns_cb(void *arg, const char *ns, size_t len, uint64_t pages, uint64_t bytes)
{
    ns_rec_t *r;
    (void)pages;
    (void)bytes;
    tqkv__store_ns_get(arg, ns, len, &r);
}

void
tqkv_store_config_default(tqkv_store_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->dram_capacity = 1ULL << 30;
    cfg->hbm_capacity = 0;
    cfg->hbm_standin = 0;
    cfg->device = -1;
    cfg->high_watermark = 0.9;
    cfg->low_watermark = 0.8;
    cfg->promote_on_access = 0;
    cfg->verify_crc = 0;
    cfg->policy = TQKV_EVICT_S3FIFO;
    cfg->default_ns_quota = 0;
    cfg->disk_sync = TQKV_DISK_SYNC_BATCH;
}

tqkv_status_t
tqkv_store_create(const tqkv_store_config_t *cfg, tqkv_store_t **out)
{
    tqkv_store_t *s;
    tqkv_status_t st;
    unsigned i = 0;
    int t;

    if (cfg == NULL || out == NULL)
        return TQKV_EINVAL;
    *out = NULL;
    if (cfg->dram_capacity == 0 ||
        (cfg->policy != TQKV_EVICT_LRU && cfg->policy != TQKV_EVICT_S3FIFO))
        return TQKV_EINVAL;
    if (cfg->hbm_capacity > 0 &&
        !(cfg->low_watermark > 0 && cfg->low_watermark <= cfg->high_watermark &&
          cfg->high_watermark <= 1.0))
        return TQKV_EINVAL;
    s = calloc(1, sizeof(*s));
    if (s == NULL)
        return TQKV_ENOMEM;
    s->cfg = *cfg;
    /* Lease timestamps of 0 mean "none": start the clock at 1 s. */
    s->epoch_ns = tqkv_clock_ns() - 1000000000u;

    if ((st = tqkv_pool_create_host(cfg->dram_capacity, &s->pool[TQKV_TIER_DRAM])) != TQKV_OK)
        goto fail_dram;
    if (cfg->hbm_capacity > 0) {
        if (cfg->device >= 0 && !cfg->hbm_standin)
            st = tqkv_pool_create_device(cfg->device, cfg->hbm_capacity, &s->pool[TQKV_TIER_HBM]);
        else
            st = tqkv_pool_create_host(cfg->hbm_capacity, &s->pool[TQKV_TIER_HBM]);
        if (st != TQKV_OK)
            goto fail_hbm;
    }
    for (t = 1; t <= TQKV_TIER_DRAM; t++)
        if ((st = tqkv__evq_init(&s->q[t], cfg->policy, GHOST_SLOTS)) != TQKV_OK)
            goto fail_q;
    for (i = 0; i < NSTRIPES; i++)
        if (pthread_mutex_init(&s->stripes[i].lock, NULL) != 0) {
            st = TQKV_ENOMEM;
            goto fail_stripes;
        }
    if (pthread_mutex_init(&s->evict_lock, NULL) != 0) {
        st = TQKV_ENOMEM;
        goto fail_stripes;
    }
    if (pthread_rwlock_init(&s->ns_lock, NULL) != 0) {
        st = TQKV_ENOMEM;
        goto fail_nslock;
    }
    if (pthread_mutex_init(&s->maint_lock, NULL) != 0) {
        st = TQKV_ENOMEM;
        goto fail_maint;
    }
    if (pthread_mutex_init(&s->bg_lock, NULL) != 0) {
        st = TQKV_ENOMEM;
        goto fail_bglock;
    }
    if (pthread_cond_init(&s->bg_cond, NULL) != 0) {
        st = TQKV_ENOMEM;
        goto fail_bgcond;
    }
    if (cfg->disk_path[0] != '\0') {
        tqkv_disk_config_t dc;
        char err[512];
        tqkv_disk_config_default(&dc);
        dc.path = cfg->disk_path;
        dc.capacity = cfg->disk_capacity;
        dc.sync = (tqkv_disk_sync_t)cfg->disk_sync;
        if ((st = tqkv_disk_open(&dc, &s->disk, err, sizeof(err))) != TQKV_OK) {
            fprintf(stderr, "tqkv store: disk tier %s: %s (%s)\n", cfg->disk_path, err,
                    tqkv_strerror(st));
            goto fail_disk;
        }
        /* Namespaces found on disk are listed (stats, metrics) from the start. */
        tqkv_disk_foreach_namespace(s->disk, disk_ns_cb, s);
    }
    if (s->pool[TQKV_TIER_HBM] != NULL) {
        if (pthread_create(&s->bg, NULL, tqkv__store_bg_main, s) != 0) {
            st = TQKV_ENOMEM;
            goto fail_thread;
        }
        s->bg_running = 1;
    }
    *out = s;
    return TQKV_OK;

fail_thread:
    tqkv_disk_close(s->disk);
fail_disk:
    pthread_cond_destroy(&s->bg_cond);
fail_bgcond:
    pthread_mutex_destroy(&s->bg_lock);
fail_bglock:
    pthread_mutex_destroy(&s->maint_lock);
fail_maint:
    pthread_rwlock_destroy(&s->ns_lock);
fail_nslock:
    pthread_mutex_destroy(&s->evict_lock);
fail_stripes:
    while (i-- > 0)
        pthread_mutex_destroy(&s->stripes[i].lock);
fail_q:
    for (t = 1; t <= TQKV_TIER_DRAM; t++)
        tqkv__evq_fini(&s->q[t]);
    tqkv_pool_destroy(s->pool[TQKV_TIER_HBM]);
fail_hbm:
    tqkv_pool_destroy(s->pool[TQKV_TIER_DRAM]);
fail_dram:
    free(s);
    return st;
}

void
tqkv_store_destroy(tqkv_store_t *s)
{
    if (s == NULL)
        return;
    if (s->bg_running) {
        pthread_mutex_lock(&s->bg_lock);
        s->bg_stop = 1;
        pthread_cond_signal(&s->bg_cond);
        pthread_mutex_unlock(&s->bg_lock);
        pthread_join(s->bg, NULL);
    }
    for (unsigned i = 0; i < NSTRIPES; i++) {
        stripe_t *st = &s->stripes[i];
        pthread_mutex_lock(&st->lock);
        pthread_mutex_lock(&s->evict_lock);
        for (size_t k = 0; k < st->nb; k++) {
            while (st->buckets[k] != NULL) {
                block_t *b = st->buckets[k];
                for (uint32_t l = 0; l < b->nlayers; l++)
                    if (b->layers[l] != NULL)
                        tqkv__store_do_unlink(s, b->layers[l], 0);
                tqkv__store_do_block_unlink_free(st, b);
            }
        }
        pthread_mutex_unlock(&s->evict_lock);
        pthread_mutex_unlock(&st->lock);
        free(st->buckets);
        pthread_mutex_destroy(&st->lock);
    }
    for (size_t i = 0; i < s->ns_cap; i++)
        if (s->ns_tab[i]) {
            free(s->ns_tab[i]->name);
            free(s->ns_tab[i]);
        }
    free(s->ns_tab);
    free(s->orph_tab); /* records went with their last kid */
    for (int t = 1; t <= TQKV_TIER_DRAM; t++)
        tqkv__evq_fini(&s->q[t]);
    tqkv_disk_close(s->disk);
    pthread_cond_destroy(&s->bg_cond);
    pthread_mutex_destroy(&s->bg_lock);
    pthread_mutex_destroy(&s->maint_lock);
    pthread_rwlock_destroy(&s->ns_lock);
    pthread_mutex_destroy(&s->evict_lock);
    tqkv_pool_destroy(s->pool[TQKV_TIER_HBM]);
    tqkv_pool_destroy(s->pool[TQKV_TIER_DRAM]);
    free(s);
}

/* ---- delete ---- */

tqkv_status_t
tqkv_store_delete(tqkv_store_t *s, const char *ns_name, size_t ns_len, const uint8_t *hash,
                  size_t hash_len, uint64_t *pages, uint64_t *bytes)
{
    ns_rec_t *ns;
    uint64_t np = 0, nb = 0;

    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    if (s == NULL || (ns_name == NULL && ns_len > 0) || hash == NULL || hash_len == 0 ||
        hash_len > 64)
        return TQKV_EINVAL;
    if (s->disk != NULL) {
        uint64_t dp = 0, db = 0;
        tqkv_status_t dst =
            tqkv_disk_delete(s->disk, ns_name, ns_len, hash, hash_len, 0xFFFFFFFFu, &dp, &db);
        if (dst != TQKV_OK)
            return dst; /* the tombstone could not be written: a restart would revive it */
        np = dp;
        nb = db;
    }
    ns = tqkv__store_ns_find(s, ns_name, ns_len);
    if (ns == NULL)
        goto out;
    uint64_t hv = key_hash(ns->hv, hash, hash_len);
    stripe_t *sp = stripe_of(s, hv);
    pthread_mutex_lock(&sp->lock);
    block_t *b = tqkv__store_do_block_find(sp, hv, ns, hash, hash_len);
    if (b != NULL) {
        uint64_t rp = 0, rbytes = 0;
        pthread_mutex_lock(&s->evict_lock);
        for (uint32_t l = 0; l < b->nlayers; l++) {
            entry_t *e = b->layers[l];
            if (e != NULL) {
                rp++;
                rbytes += e->node.len;
                tqkv__store_do_unlink(s, e, 0);
            }
        }
        pthread_mutex_unlock(&s->evict_lock);
        tqkv__store_do_block_unlink_free(sp, b);
        if (rp > np) { /* pages in RAM only (their disk write failed), or no disk tier */
            np = rp;
            nb = rbytes;
        }
    }
    pthread_mutex_unlock(&sp->lock);
out:
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return TQKV_OK;
}

tqkv_status_t
tqkv_store_delete_namespace(tqkv_store_t *s, const char *ns_name, size_t ns_len, uint64_t *pages,
                            uint64_t *bytes)
{
    ns_rec_t *ns;
    uint64_t np = 0, nb = 0;

    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    if (s == NULL || (ns_name == NULL && ns_len > 0))
        return TQKV_EINVAL;
    ns = tqkv__store_ns_find(s, ns_name, ns_len);
    if (ns == NULL)
        return TQKV_ENOTFOUND;
    uint64_t dp = 0, db = 0;
    if (s->disk != NULL) {
        tqkv_status_t dst = tqkv_disk_delete_namespace(s->disk, ns_name, ns_len, &dp, &db);
        if (dst != TQKV_OK)
            return dst;
    }
    for (unsigned i = 0; i < NSTRIPES; i++) {
        stripe_t *sp = &s->stripes[i];
        pthread_mutex_lock(&sp->lock);
        pthread_mutex_lock(&s->evict_lock);
        for (size_t k = 0; k < sp->nb; k++) {
            block_t **pp = &sp->buckets[k];
            while (*pp != NULL) {
                block_t *b = *pp;
                if (b->ns != ns) {
                    pp = &b->hnext;
                    continue;
                }
                for (uint32_t l = 0; l < b->nlayers; l++) {
                    entry_t *e = b->layers[l];
                    if (e != NULL) {
                        np++;
                        nb += e->node.len;
                        tqkv__store_do_unlink(s, e, 0);
                    }
                }
                *pp = b->hnext;
                sp->count--;
                free(b->layers);
                free(b);
            }
        }
        pthread_mutex_unlock(&s->evict_lock);
        pthread_mutex_unlock(&sp->lock);
    }
    if (dp > np) {
        np = dp;
        nb = db;
    }
    if (pages)
        *pages = np;
    if (bytes)
        *bytes = nb;
    return np > 0 ? TQKV_OK : TQKV_ENOTFOUND;
}

tqkv_status_t
tqkv_store_set_quota(tqkv_store_t *s, const char *ns_name, size_t ns_len, uint64_t bytes)
{
    ns_rec_t *ns;
    tqkv_status_t st;

    if (s == NULL || (ns_name == NULL && ns_len > 0) || ns_len > TQKV_STORE_MAX_NS)
        return TQKV_EINVAL;
    if ((st = tqkv__store_ns_get(s, ns_name, ns_len, &ns)) != TQKV_OK)
        return st;
    atomic_store(&ns->quota, bytes);
    /* Bring the namespace under its new quota, coldest pages first. */
    while (bytes != 0 && atomic_load(&ns->reserved) > bytes)
        if (!tqkv__store_evict_one(s, TQKV_TIER_DRAM, ns))
            break;
    return TQKV_OK;
}
