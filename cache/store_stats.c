/* store_stats.c - the store's statistics (whole store and per namespace), the namespace
 * listing, the export of every page for a hand-off, and the test hooks (invariant
 * check, corruption, clock).
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

/* ---- stats ---- */

static void
fill_stats(tqkv_store_t *s, counters_t *c, int whole, const ns_rec_t *ns, tqkv_store_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    for (int t = 1; t < TQKV_TIER_COUNT; t++) {
        tqkv_tier_stats_t *ts = &out->tier[t];
        if (s->pool[t] == NULL)
            continue;
        ts->capacity = tqkv_pool_capacity(s->pool[t]);
        ts->bytes_used = whole ? tqkv_pool_used(s->pool[t]) : cnt_get(&c->bytes[t]);
        ts->pages = cnt_get(&c->pages[t]);
        ts->hits = cnt_get(&c->hits[t]);
        out->hits += ts->hits;
        out->pages += ts->pages;
        out->page_bytes += cnt_get(&c->bytes[t]);
    }
    out->misses = cnt_get(&c->misses);
    out->evictions = cnt_get(&c->evictions);
    out->tier[TQKV_TIER_DRAM].misses = out->misses;
    out->tier[TQKV_TIER_DRAM].evictions = out->evictions;
    out->tier[TQKV_TIER_DRAM].promotions = cnt_get(&c->promotions);
    if (s->pool[TQKV_TIER_HBM] != NULL) {
        out->tier[TQKV_TIER_HBM].misses = out->misses + out->tier[TQKV_TIER_DRAM].hits;
        out->tier[TQKV_TIER_HBM].demotions = cnt_get(&c->demotions);
    }
    if (s->disk != NULL) {
        tqkv_tier_stats_t *ts = &out->tier[TQKV_TIER_DISK];
        tqkv_disk_stats_t ds;
        tqkv_disk_stats(s->disk, &ds);
        ts->capacity = ds.capacity;
        if (whole) {
            ts->bytes_used = ds.bytes_used;
            ts->pages = ds.pages;
            ts->evictions = ds.evicted_records;
        } else if (ns != NULL) {
            tqkv_disk_ns_usage(s->disk, ns->name, ns->len, &ts->pages, &ts->bytes_used, NULL, NULL);
        }
        ts->hits = cnt_get(&c->hits[TQKV_TIER_DISK]);
        ts->misses = out->misses;
        ts->promotions = cnt_get(&c->disk_promotions); /* copied up into DRAM */
        out->tier[TQKV_TIER_DRAM].demotions = cnt_get(&c->disk_demotions);
        out->hits += ts->hits;
        /* Every page is on disk (written through) and maybe in RAM too: the disk tier's
         * count is the store's, unless RAM holds pages whose disk write failed. */
        if (ts->pages > out->pages) {
            out->pages = ts->pages;
            out->page_bytes = ts->bytes_used;
        }
    }
    out->bytes_in = cnt_get(&c->bytes_in);
    out->bytes_out = cnt_get(&c->bytes_out);
    out->bf16_bytes = cnt_get(&c->bf16);
    out->alloc_failures = cnt_get(&c->alloc_failures);
}

tqkv_status_t
tqkv_store_stats(tqkv_store_t *s, const char *ns_name, size_t ns_len, tqkv_store_stats_t *out)
{
    if (s == NULL || out == NULL)
        return TQKV_EINVAL;
    if (ns_name == NULL && ns_len == 0) {
        fill_stats(s, &s->g, 1, NULL, out);
        return TQKV_OK;
    }
    ns_rec_t *ns = tqkv__store_ns_find(s, ns_name, ns_len);
    if (ns == NULL) {
        static counters_t zero;
        fill_stats(s, &zero, 0, NULL, out);
        out->quota_bytes = s->cfg.default_ns_quota; /* what it will get */
        return TQKV_OK;
    }
    fill_stats(s, &ns->c, 0, ns, out);
    out->quota_bytes = atomic_load(&ns->quota);
    return TQKV_OK;
}

tqkv_status_t
tqkv_store_foreach_namespace(tqkv_store_t *s,
                             void (*fn)(void *arg, const char *ns, size_t ns_len,
                                        const tqkv_store_stats_t *st),
                             void *arg)
{
    ns_rec_t **list;
    size_t n = 0;

    if (s == NULL || fn == NULL)
        return TQKV_EINVAL;
    pthread_rwlock_rdlock(&s->ns_lock);
    list = malloc((s->ns_count + 1) * sizeof(*list));
    if (list == NULL) {
        pthread_rwlock_unlock(&s->ns_lock);
        return TQKV_ENOMEM;
    }
    for (size_t i = 0; i < s->ns_cap; i++)
        if (s->ns_tab[i])
            list[n++] = s->ns_tab[i];
    pthread_rwlock_unlock(&s->ns_lock);
    for (size_t i = 0; i < n; i++) {
        tqkv_store_stats_t st;
        fill_stats(s, &list[i]->c, 0, list[i], &st);
        fn(arg, list[i]->name, list[i]->len, &st);
    }
    free(list);
    return TQKV_OK;
}

tqkv_status_t
tqkv_store_disk_stats(tqkv_store_t *s, struct tqkv_disk_stats *out)
{
    if (s == NULL || out == NULL)
        return TQKV_EINVAL;
    if (s->disk == NULL)
        return TQKV_ENOTFOUND;
    tqkv_disk_stats(s->disk, out);
    return TQKV_OK;
}

/* ---- export (hand-off on drain) ---- */

static int
export_visit(const tqkv__evq_list_t *l, entry_t **v, size_t *n, size_t max)
{
    for (tqkv__evq_node_t *x = l->head; x && *n < max; x = x->next)
        v[(*n)++] = (entry_t *)(void *)x;
    return 0;
}

tqkv_status_t
tqkv_store_export(tqkv_store_t *s, size_t max_pages, tqkv_store_key_out_t **out, size_t *n_out)
{
    if (s == NULL || out == NULL || n_out == NULL)
        return TQKV_EINVAL;
    *out = NULL;
    *n_out = 0;
    pthread_mutex_lock(&s->evict_lock);
    size_t total = 0;
    for (int t = TQKV_TIER_HBM; t < TQKV_TIER_COUNT; t++)
        total += s->q[t].parked.count + s->q[t].main.count + s->q[t].small.count;
    size_t max = max_pages && max_pages < total ? max_pages : total;
    entry_t **v = malloc((max + 1) * sizeof *v);
    size_t n = 0, bytes = 0;
    if (v == NULL) {
        pthread_mutex_unlock(&s->evict_lock);
        return TQKV_ENOMEM;
    }
    for (int t = TQKV_TIER_HBM; t < TQKV_TIER_COUNT; t++) {
        export_visit(&s->q[t].parked, v, &n, max); /* prefixes: every extension needs them */
        export_visit(&s->q[t].main, v, &n, max);
        export_visit(&s->q[t].small, v, &n, max);
    }
    for (size_t i = 0; i < n; i++) {
        const block_t *b = v[i]->blk;
        const block_t *pb = v[i]->parent ? v[i]->parent->blk : NULL;
        bytes += b->ns->len + 1 + b->hash_len + (pb ? pb->hash_len : 0);
    }
    tqkv_store_key_out_t *k = malloc(n * sizeof *k + bytes + 1);
    if (k == NULL) {
        pthread_mutex_unlock(&s->evict_lock);
        free(v);
        return TQKV_ENOMEM;
    }
    char *p = (char *)(k + n);
    for (size_t i = 0; i < n; i++) {
        const entry_t *e = v[i];
        const block_t *b = e->blk;
        const block_t *pb = e->parent ? e->parent->blk : NULL;
        memcpy(p, b->ns->name, b->ns->len);
        p[b->ns->len] = '\0';
        k[i].ns = p;
        k[i].ns_len = b->ns->len;
        p += b->ns->len + 1;
        memcpy(p, b->hash, b->hash_len);
        k[i].hash = (const uint8_t *)p;
        k[i].hash_len = b->hash_len;
        p += b->hash_len;
        k[i].parent = NULL;
        k[i].parent_len = 0;
        if (pb) {
            memcpy(p, pb->hash, pb->hash_len);
            k[i].parent = (const uint8_t *)p;
            k[i].parent_len = pb->hash_len;
            p += pb->hash_len;
        }
        k[i].layer = e->layer;
        k[i].len = e->node.len;
    }
    pthread_mutex_unlock(&s->evict_lock);
    free(v);
    *out = k;
    *n_out = n;
    return TQKV_OK;
}

/* ---- test hooks ---- */

tqkv_pool_t *
tqkv__store_pool(tqkv_store_t *s, tqkv_tier_t tier)
{
    if (s == NULL || tier <= TQKV_TIER_NONE || tier >= TQKV_TIER_COUNT)
        return NULL;
    return s->pool[tier];
}

void
tqkv__store_debug_advance_clock(tqkv_store_t *s, uint64_t ms)
{
    atomic_fetch_add_explicit(&s->clock_skew_ms, (int64_t)ms, memory_order_relaxed);
    tqkv__disk_debug_advance_clock(s->disk, ms);
}

tqkv_status_t
tqkv__store_debug_corrupt(tqkv_store_t *s, const tqkv_block_key_t *key, size_t offset)
{
    tqkv_status_t st = TQKV_OK;
    if (s == NULL || !valid_key(key))
        return TQKV_EINVAL;
    ns_rec_t *ns = tqkv__store_ns_find(s, key->ns, key->ns_len);
    if (ns == NULL)
        return TQKV_ENOTFOUND;
    uint64_t hv = key_hash(ns->hv, key->hash, key->hash_len);
    stripe_t *sp = stripe_of(s, hv);
    pthread_mutex_lock(&sp->lock);
    entry_t *e = tqkv__store_do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
    if (e == NULL) {
        st = TQKV_ENOTFOUND;
    } else if (offset >= e->cur->len) {
        st = TQKV_EINVAL;
    } else {
        tqkv_pool_t *p = s->pool[e->cur->tier];
        uint8_t *at = (uint8_t *)e->cur->data + offset, v;
        if ((st = tqkv_pool_copy_out(p, &v, at, 1)) == TQKV_OK) {
            v ^= 0xff;
            st = tqkv_pool_copy_in(p, at, &v, 1);
        }
    }
    pthread_mutex_unlock(&sp->lock);
    return st;
}

tqkv_status_t
tqkv__store_check(tqkv_store_t *s)
{
    uint64_t pages[TQKV_TIER_COUNT] = {0}, bytes[TQKV_TIER_COUNT] = {0};
    tqkv_status_t st = TQKV_OK;

    pthread_mutex_lock(&s->maint_lock); /* no demotion by the background thread meanwhile */
    for (unsigned i = 0; i < NSTRIPES; i++) {
        stripe_t *sp = &s->stripes[i];
        pthread_mutex_lock(&sp->lock);
        pthread_mutex_lock(&s->evict_lock);
        for (size_t k = 0; k < sp->nb; k++)
            for (block_t *b = sp->buckets[k]; b; b = b->hnext) {
                uint32_t live = 0;
                for (uint32_t l = 0; l < b->nlayers; l++) {
                    entry_t *e = b->layers[l];
                    if (e == NULL)
                        continue;
                    live++;
                    if (!e->linked || e->tier != e->cur->tier || e->blk != b ||
                        (e->orphan != NULL && e->parent != NULL) ||
                        e->node.where == TQKV__EVQ_NONE ||
                        (e->children > 0) != (e->node.where == TQKV__EVQ_PARKED)) {
                        fprintf(stderr,
                                "store check: bad entry (linked %d tier %d/%d where %d "
                                "children %u)\n",
                                e->linked, e->tier, e->cur->tier, e->node.where, e->children);
                        st = TQKV_EINTERNAL;
                    }
                    pages[e->tier]++;
                    bytes[e->tier] += e->node.len;
                }
                if (live != b->nlive || live == 0) {
                    fprintf(stderr, "store check: block nlive %u, counted %u\n", b->nlive, live);
                    st = TQKV_EINTERNAL;
                }
            }
        pthread_mutex_unlock(&s->evict_lock);
        pthread_mutex_unlock(&sp->lock);
    }
    pthread_rwlock_rdlock(&s->ns_lock);
    pthread_mutex_lock(&s->evict_lock);
    {
        uint64_t listed = 0, all = 0;
        for (size_t i = 0; i < s->ns_cap; i++) {
            ns_rec_t *r = s->ns_tab[i];
            uint64_t n = 0;
            if (r == NULL)
                continue;
            for (entry_t *e = r->tail; e != NULL; e = e->ns_prev, n++)
                if (!e->linked || e->blk->ns != r)
                    st = TQKV_EINTERNAL;
            if (n != cnt_get(&r->c.pages[TQKV_TIER_HBM]) + cnt_get(&r->c.pages[TQKV_TIER_DRAM])) {
                fprintf(stderr, "store check: namespace list %llu pages, counters differ\n",
                        (unsigned long long)n);
                st = TQKV_EINTERNAL;
            }
            listed += n;
        }
        for (int t = 1; t < TQKV_TIER_COUNT; t++)
            all += pages[t];
        uint64_t records = 0;
        for (size_t i = 0; i < s->orph_nb; i++)
            for (orphan_t *o = s->orph_tab[i]; o != NULL; o = o->hnext, records++) {
                if (o->kids == NULL)
                    st = TQKV_EINTERNAL;
                for (entry_t *k = o->kids; k != NULL; k = k->sib_next)
                    if (k->orphan != o || !k->linked)
                        st = TQKV_EINTERNAL;
            }
        if (records != s->orph_count || st != TQKV_OK) {
            fprintf(stderr, "store check: orphan records %llu (count %llu) or a bad kid\n",
                    (unsigned long long)records, (unsigned long long)s->orph_count);
            st = TQKV_EINTERNAL;
        }
        if (listed != all) {
            fprintf(stderr, "store check: %llu pages in namespace lists, %llu indexed\n",
                    (unsigned long long)listed, (unsigned long long)all);
            st = TQKV_EINTERNAL;
        }
    }
    for (int t = 1; t < TQKV_TIER_COUNT; t++) {
        tqkv__evq_t *q = &s->q[t];
        uint64_t qn = q->small.count + q->main.count + q->parked.count;
        uint64_t qb = q->small.bytes + q->main.bytes + q->parked.bytes;
        if (pages[t] != cnt_get(&s->g.pages[t]) || bytes[t] != cnt_get(&s->g.bytes[t]) ||
            qn != pages[t] || qb != bytes[t] ||
            (s->pool[t] && tqkv_pool_used(s->pool[t]) < bytes[t])) {
            fprintf(stderr,
                    "store check: tier %d index %llu pages/%llu B, counters %llu/%llu, "
                    "queues %llu/%llu\n",
                    t, (unsigned long long)pages[t], (unsigned long long)bytes[t],
                    (unsigned long long)cnt_get(&s->g.pages[t]),
                    (unsigned long long)cnt_get(&s->g.bytes[t]), (unsigned long long)qn,
                    (unsigned long long)qb);
            st = TQKV_EINTERNAL;
        }
    }
    pthread_mutex_unlock(&s->evict_lock);
    pthread_rwlock_unlock(&s->ns_lock);
    pthread_mutex_unlock(&s->maint_lock);
    return st;
}
