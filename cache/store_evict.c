/* store_evict.c - the store's eviction and demotion: victims from a tier's eviction order
 * (cache/evict.h), moving a page between tiers, making room for a put, and the
 * background thread that demotes from the high to the low watermark and reaps leases.
 *
 * Locks as in cache/store.c: a victim is found under evict_lock, held by an sref,
 * then re-validated under its stripe lock and evict_lock.
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

/* ---- eviction and demotion ---- */

typedef struct victim_filter {
    tqkv_store_t *s;
    ns_rec_t *ns; /* only this namespace, or NULL */
    uint64_t now;
} victim_filter_t;

static int
evictable(tqkv__evq_node_t *n, void *arg)
{
    victim_filter_t *f = arg;
    entry_t *e = (entry_t *)n;
    if (f->ns != NULL && e->blk->ns != f->ns)
        return 0;
    uint64_t lease = atomic_load_explicit(&e->lease_until, memory_order_relaxed);
    return lease <= f->now;
}

/* Called with evict_lock held, releases it: takes a reference on victim n (NULL: none)
 * and finds its stripe (*st), whose lock must be taken before evict_lock again. */
static entry_t *
hold_victim_unlock(tqkv_store_t *s, tqkv__evq_node_t *n, stripe_t **st)
{
    if (n == NULL) {
        pthread_mutex_unlock(&s->evict_lock);
        return NULL;
    }
    entry_t *e = (entry_t *)n;
    entry_hold(e);
    *st = stripe_of(s, e->blk->hv);
    pthread_mutex_unlock(&s->evict_lock);
    return e;
}

/* Evicts one page of `tier` by the policy, or with ns non-NULL the oldest evictable leaf
 * of that namespace in any tier (tier is then ignored). Returns 1 when a page went, 0
 * when there is no candidate. */
int
tqkv__store_evict_one(tqkv_store_t *s, int tier, ns_rec_t *ns)
{
    for (int attempt = 0; attempt < 64; attempt++) {
        victim_filter_t f = {s, ns, now_ms(s)};
        tqkv__evq_node_t *n;
        entry_t *e;
        stripe_t *st;
        int done = 0;

        pthread_mutex_lock(&s->evict_lock);
        if (ns != NULL) {
            /* Oldest leaf of the namespace, in any tier: the scan is bounded by the
             * namespace's own pages, not the whole store. */
            entry_t *c = ns->tail;
            while (c != NULL && (c->children > 0 || !evictable(&c->node, &f)))
                c = c->ns_prev;
            n = c ? &c->node : NULL;
            if (c != NULL)
                tier = c->tier;
        } else {
            n = tqkv__evq_victim(&s->q[tier], evictable, &f);
        }
        if ((e = hold_victim_unlock(s, n, &st)) == NULL)
            return 0;

        pthread_mutex_lock(&st->lock);
        pthread_mutex_lock(&s->evict_lock);
        f.now = now_ms(s);
        if (e->linked && e->tier == tier && e->children == 0 &&
            (e->node.where == TQKV__EVQ_SMALL || e->node.where == TQKV__EVQ_MAIN) &&
            evictable(&e->node, &f)) {
            block_t *b = e->blk;
            tqkv__store_do_unlink(s, e, 1);
            if (b->nlive == 0)
                tqkv__store_do_block_unlink_free(st, b);
            done = 1;
        }
        pthread_mutex_unlock(&s->evict_lock);
        pthread_mutex_unlock(&st->lock);
        entry_put(e);
        if (done)
            return 1;
    }
    return 0;
}

/* Switches e from its copy `old` to `nc` in tier `to` (demotion to DRAM or promotion to
 * HBM): queues, accounting and counters. Expects the stripe lock and evict_lock held.
 * Returns 1 when it switched, 0 when e changed meanwhile (unlinked or re-copied). */
int
tqkv__store_do_move_tier(tqkv_store_t *s, entry_t *e, copy_t *old, copy_t *nc, int to)
{
    int from = to == TQKV_TIER_DRAM ? TQKV_TIER_HBM : TQKV_TIER_DRAM;
    if (!e->linked || e->cur != old)
        return 0;
    tqkv__evq_remove(&s->q[from], &e->node, 0, 0);
    tqkv__store_do_account(s, e, from, 0);
    e->cur = nc;
    e->tier = to;
    tqkv__store_do_account(s, e, to, 1);
    if (e->children > 0) {
        e->node.where = TQKV__EVQ_NONE;
        tqkv__evq_park(&s->q[to], &e->node);
    } else {
        tqkv__evq_insert(&s->q[to], &e->node, e->blk->hv);
    }
    if (to == TQKV_TIER_DRAM) {
        cnt_add(&s->g.demotions, 1);
        cnt_add(&e->blk->ns->c.demotions, 1);
    } else {
        cnt_add(&s->g.promotions, 1);
        cnt_add(&e->blk->ns->c.promotions, 1);
    }
    atomic_fetch_sub_explicit(&old->refs, 1, memory_order_relaxed); /* index's ref */
    return 1;
}

/* Moves one HBM page to DRAM. Returns 1 when it moved one, 0 when nothing could. */
static int
demote_one(tqkv_store_t *s)
{
    for (int attempt = 0; attempt < 16; attempt++) {
        tqkv__evq_node_t *n;
        entry_t *e;
        stripe_t *st;
        copy_t *old, *nc;
        void *mem;
        int swapped = 0;

        pthread_mutex_lock(&s->evict_lock);
        n = tqkv__evq_victim(&s->q[TQKV_TIER_HBM], NULL, NULL);
        if (n == NULL)
            n = tqkv__evq_coldest_parked(&s->q[TQKV_TIER_HBM]);
        if ((e = hold_victim_unlock(s, n, &st)) == NULL)
            return 0;

        pthread_mutex_lock(&st->lock);
        if (!e->linked || e->tier != TQKV_TIER_HBM) {
            pthread_mutex_unlock(&st->lock);
            entry_put(e);
            continue;
        }
        old = e->cur;
        atomic_fetch_add_explicit(&old->refs, 1, memory_order_relaxed);
        pthread_mutex_unlock(&st->lock);

        nc = malloc(sizeof(*nc));
        /* Room in DRAM from DRAM pages only: dropping HBM pages to demote one would
         * empty the tier it is meant to relieve (make_room of HBM evicts there itself
         * when the demotion fails). */
        if (nc == NULL || tqkv__store_make_room(s, TQKV_TIER_DRAM, old->len, &mem, 0) != TQKV_OK) {
            free(nc);
            copy_release(s, old);
            entry_put(e);
            return 0;
        }
        if (tqkv_pool_copy_out(s->pool[TQKV_TIER_HBM], mem, old->data, old->len) != TQKV_OK) {
            tqkv_pool_free(s->pool[TQKV_TIER_DRAM], mem, old->len);
            free(nc);
            copy_release(s, old);
            entry_put(e);
            return 0;
        }
        nc->data = mem;
        nc->len = old->len;
        nc->tier = TQKV_TIER_DRAM;
        atomic_init(&nc->refs, 1);

        pthread_mutex_lock(&st->lock);
        pthread_mutex_lock(&s->evict_lock);
        swapped = tqkv__store_do_move_tier(s, e, old, nc, TQKV_TIER_DRAM);
        pthread_mutex_unlock(&s->evict_lock);
        pthread_mutex_unlock(&st->lock);
        if (!swapped)
            copy_release(s, nc);
        copy_release(s, old);
        entry_put(e);
        if (swapped)
            return 1;
    }
    return 0;
}

/* Allocates len bytes in tier, evicting (DRAM) or demoting (HBM) as needed. */
tqkv_status_t
tqkv__store_make_room(tqkv_store_t *s, int tier, size_t len, void **ptr, int hbm_leaves)
{
    for (int tries = 0; tries < MAX_EVICT_TRIES; tries++) {
        tqkv_status_t st = tqkv_pool_alloc(s->pool[tier], len, ptr);
        if (st != TQKV_ENOSPC)
            return st;
        if (len > tqkv_pool_capacity(s->pool[tier]))
            return TQKV_ENOSPC;
        if (tier == TQKV_TIER_DRAM) {
            /* Leaf-first across tiers: when every DRAM page is the parent of a kept
             * block, the leaves are in HBM; dropping the coldest HBM leaf makes its
             * parent evictable. */
            if (!tqkv__store_evict_one(s, TQKV_TIER_DRAM, NULL) &&
                (!hbm_leaves || s->pool[TQKV_TIER_HBM] == NULL ||
                 !tqkv__store_evict_one(s, TQKV_TIER_HBM, NULL)))
                return TQKV_ENOSPC;
        } else {
            /* Demote the coldest page; when DRAM cannot take it (smaller than the page,
             * or everything there leased, pinned or a parent), drop the coldest
             * evictable HBM page instead of refusing the Put. */
            if (!demote_one(s) && !tqkv__store_evict_one(s, TQKV_TIER_HBM, NULL))
                return TQKV_ENOSPC;
        }
    }
    return TQKV_ENOSPC;
}

uint64_t
tqkv__store_hbm_mark(tqkv_store_t *s, double frac)
{
    return (uint64_t)((double)tqkv_pool_capacity(s->pool[TQKV_TIER_HBM]) * frac);
}

void
tqkv__store_maintain(tqkv_store_t *s)
{
    tqkv_pool_t *h = s->pool[TQKV_TIER_HBM];
    if (h == NULL)
        return;
    /* Checked under the lock: a caller that finds the tier under its high watermark
     * must not return while another thread is still demoting (and evicting) below it. */
    pthread_mutex_lock(&s->maint_lock);
    if (tqkv_pool_used(h) <= tqkv__store_hbm_mark(s, s->cfg.high_watermark)) {
        pthread_mutex_unlock(&s->maint_lock);
        return;
    }
    uint64_t low = tqkv__store_hbm_mark(s, s->cfg.low_watermark);
    while (tqkv_pool_used(h) > low)
        if (!demote_one(s))
            break;
    pthread_mutex_unlock(&s->maint_lock);
}

void *
tqkv__store_bg_main(void *arg)
{
    tqkv_store_t *s = arg;
    pthread_mutex_lock(&s->bg_lock);
    while (!s->bg_stop) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 10 * 1000000;
        if (t.tv_nsec >= 1000000000) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&s->bg_cond, &s->bg_lock, &t);
        if (s->bg_stop)
            break;
        pthread_mutex_unlock(&s->bg_lock);
        tqkv__store_maintain(s);
        pthread_mutex_lock(&s->bg_lock);
    }
    pthread_mutex_unlock(&s->bg_lock);
    return NULL;
}

void
tqkv__store_bg_kick(tqkv_store_t *s)
{
    if (!s->bg_running)
        return;
    if (tqkv_pool_used(s->pool[TQKV_TIER_HBM]) <= tqkv__store_hbm_mark(s, s->cfg.high_watermark))
        return;
    pthread_mutex_lock(&s->bg_lock);
    pthread_cond_signal(&s->bg_cond);
    pthread_mutex_unlock(&s->bg_lock);
}
