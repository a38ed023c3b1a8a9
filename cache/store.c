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
#include "kernels/page.h"
#include "kernels/page_format.h"

#define NSTRIPES 256u
#define GHOST_SLOTS (1u << 16)
#define MAX_EVICT_TRIES 100000

/* ---- types ---- */

enum { CRC_NONE = 0, CRC_WHOLE = 1, CRC_PAGE = 2 };

/* One stored copy of a page's bytes in one tier. */
typedef struct copy {
    void *data;            /* pool memory of `tier` */
    _Atomic uint32_t refs; /* index (while current) + readers + movers */
    uint32_t len;
    uint8_t tier;
} copy_t;

typedef struct ns_rec ns_rec_t;
typedef struct block block_t;

/* Page metadata. `node` first (the queues hand back node pointers). */
typedef struct entry {
    tqkv__evq_node_t node;
    block_t *blk;                      /* owning block, valid while linked */
    struct entry *parent;              /* counted parent (holds an sref on it), or NULL */
    struct entry *ns_prev, *ns_next;   /* namespace list, oldest at the tail: evict_lock */
    struct orphan *orphan;             /* waiting for its absent parent, or NULL: evict_lock */
    struct entry *sib_prev, *sib_next; /* the orphan's kids list: evict_lock */
    copy_t *cur;                       /* current copy: stripe lock (+ evict lock to swap) */
    uint64_t bf16;                     /* BF16 bytes represented */
    _Atomic uint64_t lease_until;      /* ms since the store epoch; evictor skips until then
                                          (64-bit: a 32-bit one wrapped after 24.9 days and
                                          revived every expired lease for as long again) */
    _Atomic uint32_t sref;             /* struct lifetime */
    uint32_t children;                 /* linked children counting us: evict_lock */
    uint32_t layer;
    uint32_t crc;
    uint8_t tier;     /* tqkv_tier_t of cur: stripe + evict lock */
    uint8_t linked;   /* in the index: stripe + evict lock */
    uint8_t crc_kind; /* CRC_* */
} entry_t;

/* All layers of one (namespace, hash). */
struct block {
    block_t *hnext;
    ns_rec_t *ns;
    uint64_t hv;
    entry_t **layers; /* [nlayers] */
    uint32_t nlayers;
    uint32_t nlive;
    uint8_t hash_len;
    uint8_t hash[];
};

/* Pages whose parent (ns, hash, layer) was absent when they were put: when the parent
 * arrives it counts them as children (puts of one sequence may complete out of order). */
typedef struct orphan {
    struct orphan *hnext;
    ns_rec_t *ns;
    uint64_t hv; /* key_hash of the parent's (ns, hash) */
    uint32_t layer;
    entry_t *kids; /* via sib_prev/sib_next */
    uint8_t hash_len;
    uint8_t hash[];
} orphan_t;

typedef struct counters {
    _Atomic uint64_t pages[TQKV_TIER_COUNT], bytes[TQKV_TIER_COUNT], hits[TQKV_TIER_COUNT];
    _Atomic uint64_t misses, evictions, demotions, promotions;
    _Atomic uint64_t bytes_in, bytes_out, bf16, alloc_failures;
    _Atomic uint64_t disk_demotions;  /* DRAM evictions of pages that stay on disk */
    _Atomic uint64_t disk_promotions; /* disk hits copied into DRAM */
} counters_t;

struct ns_rec {
    char *name;
    size_t len;
    uint64_t hv;
    _Atomic uint64_t quota;    /* 0 = unlimited */
    _Atomic uint64_t reserved; /* bytes linked + puts in flight */
    struct entry *head, *tail; /* linked pages by insertion, newest first: evict_lock */
    counters_t c;
};

typedef struct stripe {
    pthread_mutex_t lock; /* protects everything below and the blocks in it */
    block_t **buckets;
    size_t nb, count;
} __attribute__((aligned(64))) stripe_t;

struct tqkv_page_ref {
    tqkv_store_t *s;
    copy_t *c;
    const void *host; /* c->data, or buf for device copies */
    void *buf;
    uint32_t len;
    uint8_t tier;
};

struct tqkv_store {
    tqkv_store_config_t cfg;
    tqkv_pool_t *pool[TQKV_TIER_COUNT];
    tqkv_disk_t *disk; /* the disk tier or NULL; thread-safe, its locks are leaves here */
    stripe_t stripes[NSTRIPES];

    pthread_mutex_t evict_lock; /* queues, entry tier/children/linked: see the top */
    tqkv__evq_t q[TQKV_TIER_COUNT];
    orphan_t **orph_tab; /* evict_lock: orphan records, chained, orph_nb buckets */
    size_t orph_nb, orph_count;

    counters_t g;

    pthread_rwlock_t ns_lock; /* the namespace table */
    ns_rec_t **ns_tab;        /* open addressing, ns_cap slots */
    size_t ns_cap, ns_count;

    struct timespec epoch;
    _Atomic int64_t clock_skew_ms; /* added to the clock (tqkv__store_debug_advance_clock) */

    pthread_mutex_t maint_lock; /* one maintenance pass at a time (outermost lock) */
    pthread_mutex_t bg_lock;    /* bg_stop and bg_cond */
    pthread_cond_t bg_cond;
    int bg_stop, bg_running;
    pthread_t bg;
};

/* ---- small helpers ---- */

static uint64_t
ns_hash(const char *ns, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(0x7171u ^ len, (const uint8_t *)ns, len));
}

static uint64_t
key_hash(uint64_t nsh, const uint8_t *hash, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(nsh ^ (len * 0x100000001b3ULL), hash, len));
}

static stripe_t *
stripe_of(tqkv_store_t *s, uint64_t hv)
{
    return &s->stripes[hv >> 56];
}

static uint64_t
now_ms(tqkv_store_t *s)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t ms =
        (int64_t)(t.tv_sec - s->epoch.tv_sec) * 1000 + (t.tv_nsec - s->epoch.tv_nsec) / 1000000;
    ms += atomic_load_explicit(&s->clock_skew_ms, memory_order_relaxed);
    return ms < 0 ? 0 : (uint64_t)ms;
}

static void
cnt_add(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static void
cnt_sub(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_sub_explicit(c, v, memory_order_relaxed);
}

static uint64_t
cnt_get(_Atomic uint64_t *c)
{
    return atomic_load_explicit(c, memory_order_relaxed);
}

static void
copy_release(tqkv_store_t *s, copy_t *c)
{
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) {
        tqkv_pool_free(s->pool[c->tier], c->data, c->len);
        free(c);
    }
}

static void
entry_hold(entry_t *e)
{
    atomic_fetch_add_explicit(&e->sref, 1, memory_order_relaxed);
}

static void
entry_put(entry_t *e)
{
    if (atomic_fetch_sub_explicit(&e->sref, 1, memory_order_acq_rel) == 1)
        free(e);
}

static int
valid_key(const tqkv_block_key_t *k)
{
    return k != NULL && (k->ns != NULL || k->ns_len == 0) && k->ns_len <= TQKV_STORE_MAX_NS &&
           k->hash != NULL && k->hash_len >= 1 && k->hash_len <= 64 &&
           k->layer < TQKV_STORE_MAX_LAYERS;
}

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

static ns_rec_t *
ns_find(tqkv_store_t *s, const char *ns, size_t len)
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

static tqkv_status_t
ns_get(tqkv_store_t *s, const char *ns, size_t len, ns_rec_t **out)
{
    uint64_t h = ns_hash(ns, len);
    ns_rec_t *r = ns_find(s, ns, len);
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

static int
quota_reserve(ns_rec_t *r, uint64_t len)
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

static block_t *
do_block_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash, size_t hlen)
{
    if (st->nb == 0)
        return NULL;
    for (block_t *b = st->buckets[hv & (st->nb - 1)]; b != NULL; b = b->hnext)
        if (b->hv == hv && b->ns == ns && b->hash_len == hlen && memcmp(b->hash, hash, hlen) == 0)
            return b;
    return NULL;
}

static entry_t *
do_entry_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash, size_t hlen,
              uint32_t layer)
{
    block_t *b = do_block_find(st, hv, ns, hash, hlen);
    if (b == NULL || layer >= b->nlayers)
        return NULL;
    return b->layers[layer];
}

static tqkv_status_t
do_stripe_grow(stripe_t *st)
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

static void
do_block_unlink_free(stripe_t *st, block_t *b)
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
static void
do_account(tqkv_store_t *s, entry_t *e, int tier, int add)
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

static orphan_t *
do_orphan_find(tqkv_store_t *s, ns_rec_t *ns, uint64_t hv, const uint8_t *hash, size_t hlen,
               uint32_t layer)
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
static int
do_orphan_add(tqkv_store_t *s, entry_t *e, ns_rec_t *ns, const uint8_t *hash, size_t hlen,
              uint32_t layer)
{
    uint64_t hv = key_hash(ns->hv, hash, hlen);
    orphan_t *o = do_orphan_find(s, ns, hv, hash, hlen, layer);
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
static void
do_adopt(tqkv_store_t *s, entry_t *p, entry_t *kid)
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
static void
do_unlink(tqkv_store_t *s, entry_t *e, int evicted)
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
    do_account(s, e, e->tier, 0);
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

/* Evicts one page of `tier` by the policy, or with ns non-NULL the oldest evictable leaf
 * of that namespace in any tier (tier is then ignored). Returns 1 when a page went, 0
 * when there is no candidate. */
static int
evict_one(tqkv_store_t *s, int tier, ns_rec_t *ns)
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
        if (n == NULL) {
            pthread_mutex_unlock(&s->evict_lock);
            return 0;
        }
        e = (entry_t *)n;
        entry_hold(e);
        st = stripe_of(s, e->blk->hv);
        pthread_mutex_unlock(&s->evict_lock);

        pthread_mutex_lock(&st->lock);
        pthread_mutex_lock(&s->evict_lock);
        f.now = now_ms(s);
        if (e->linked && e->tier == tier && e->children == 0 &&
            (e->node.where == TQKV__EVQ_SMALL || e->node.where == TQKV__EVQ_MAIN) &&
            evictable(&e->node, &f)) {
            block_t *b = e->blk;
            do_unlink(s, e, 1);
            if (b->nlive == 0)
                do_block_unlink_free(st, b);
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

static tqkv_status_t make_room(tqkv_store_t *s, int tier, size_t len, void **ptr, int hbm_leaves);

/* Switches e from its copy `old` to `nc` in tier `to` (demotion to DRAM or promotion to
 * HBM): queues, accounting and counters. Expects the stripe lock and evict_lock held.
 * Returns 1 when it switched, 0 when e changed meanwhile (unlinked or re-copied). */
static int
do_move_tier(tqkv_store_t *s, entry_t *e, copy_t *old, copy_t *nc, int to)
{
    int from = to == TQKV_TIER_DRAM ? TQKV_TIER_HBM : TQKV_TIER_DRAM;
    if (!e->linked || e->cur != old)
        return 0;
    tqkv__evq_remove(&s->q[from], &e->node, 0, 0);
    do_account(s, e, from, 0);
    e->cur = nc;
    e->tier = to;
    do_account(s, e, to, 1);
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
        if (n == NULL) {
            pthread_mutex_unlock(&s->evict_lock);
            return 0;
        }
        e = (entry_t *)n;
        entry_hold(e);
        st = stripe_of(s, e->blk->hv);
        pthread_mutex_unlock(&s->evict_lock);

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
        if (nc == NULL || make_room(s, TQKV_TIER_DRAM, old->len, &mem, 0) != TQKV_OK) {
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
        swapped = do_move_tier(s, e, old, nc, TQKV_TIER_DRAM);
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
static tqkv_status_t
make_room(tqkv_store_t *s, int tier, size_t len, void **ptr, int hbm_leaves)
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
            if (!evict_one(s, TQKV_TIER_DRAM, NULL) &&
                (!hbm_leaves || s->pool[TQKV_TIER_HBM] == NULL ||
                 !evict_one(s, TQKV_TIER_HBM, NULL)))
                return TQKV_ENOSPC;
        } else {
            /* Demote the coldest page; when DRAM cannot take it (smaller than the page,
             * or everything there leased, pinned or a parent), drop the coldest
             * evictable HBM page instead of refusing the Put. */
            if (!demote_one(s) && !evict_one(s, TQKV_TIER_HBM, NULL))
                return TQKV_ENOSPC;
        }
    }
    return TQKV_ENOSPC;
}

static uint64_t
hbm_mark(tqkv_store_t *s, double frac)
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
    if (tqkv_pool_used(h) <= hbm_mark(s, s->cfg.high_watermark)) {
        pthread_mutex_unlock(&s->maint_lock);
        return;
    }
    uint64_t low = hbm_mark(s, s->cfg.low_watermark);
    while (tqkv_pool_used(h) > low)
        if (!demote_one(s))
            break;
    pthread_mutex_unlock(&s->maint_lock);
}

static void *
bg_main(void *arg)
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

static void
bg_kick(tqkv_store_t *s)
{
    if (!s->bg_running)
        return;
    if (tqkv_pool_used(s->pool[TQKV_TIER_HBM]) <= hbm_mark(s, s->cfg.high_watermark))
        return;
    pthread_mutex_lock(&s->bg_lock);
    pthread_cond_signal(&s->bg_cond);
    pthread_mutex_unlock(&s->bg_lock);
}

/* ---- create / destroy ---- */

static tqkv_status_t ns_get(tqkv_store_t *s, const char *ns, size_t len, ns_rec_t **out);

static void
disk_ns_cb(void *arg, const char *ns, size_t len, uint64_t pages, uint64_t bytes)
{
    ns_rec_t *r;
    (void)pages;
    (void)bytes;
    ns_get(arg, ns, len, &r);
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
    clock_gettime(CLOCK_MONOTONIC, &s->epoch);
    /* Lease timestamps of 0 mean "none": start the clock at 1 s. */
    s->epoch.tv_sec -= 1;

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
        if (pthread_create(&s->bg, NULL, bg_main, s) != 0) {
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
                        do_unlink(s, b->layers[l], 0);
                do_block_unlink_free(st, b);
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

/* ---- put ---- */

/* Finds (ns, hash, layer) and takes an sref on it; NULL when absent. */
static entry_t *
entry_lookup_hold(tqkv_store_t *s, ns_rec_t *ns, const uint8_t *hash, size_t hlen, uint32_t layer)
{
    uint64_t hv = key_hash(ns->hv, hash, hlen);
    stripe_t *st = stripe_of(s, hv);
    pthread_mutex_lock(&st->lock);
    entry_t *e = do_entry_find(st, hv, ns, hash, hlen, layer);
    if (e != NULL)
        entry_hold(e);
    pthread_mutex_unlock(&st->lock);
    return e;
}

/* Puts into HBM/DRAM (the whole of tqkv_store_put without a disk tier). */
static tqkv_status_t
put_ram(tqkv_store_t *s, const tqkv_block_key_t *key, const uint8_t *parent_hash, size_t parent_len,
        const void *page, size_t len, uint64_t bf16_bytes, int *duplicate)
{
    tqkv_status_t st;
    ns_rec_t *ns;
    uint64_t hv;
    stripe_t *sp;
    entry_t *e = NULL, *parent = NULL;
    copy_t *c = NULL;
    block_t *b;
    void *mem = NULL;
    int tier, recheck = 0;

    if (duplicate)
        *duplicate = 0;
    if (s == NULL || !valid_key(key) || page == NULL || len == 0 || len > UINT32_MAX ||
        (parent_len > 0 && parent_hash == NULL) || parent_len > 64)
        return TQKV_EINVAL;
    if ((st = ns_get(s, key->ns, key->ns_len, &ns)) != TQKV_OK)
        return st;
    hv = key_hash(ns->hv, key->hash, key->hash_len);
    sp = stripe_of(s, hv);

    pthread_mutex_lock(&sp->lock);
    e = do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
    pthread_mutex_unlock(&sp->lock);
    if (e != NULL) {
        if (duplicate)
            *duplicate = 1;
        return TQKV_OK;
    }

    /* Quota: evict within the namespace first (coldest tier first). */
    {
        uint64_t q = atomic_load(&ns->quota);
        if (q != 0 && len > q) {
            cnt_add(&s->g.alloc_failures, 1);
            cnt_add(&ns->c.alloc_failures, 1);
            return TQKV_ENOSPC;
        }
    }
    for (int tries = 0; !quota_reserve(ns, len); tries++) {
        if (tries > MAX_EVICT_TRIES || !evict_one(s, TQKV_TIER_DRAM, ns)) {
            cnt_add(&s->g.alloc_failures, 1);
            cnt_add(&ns->c.alloc_failures, 1);
            return TQKV_ENOSPC;
        }
    }

    if (parent_len > 0)
        parent = entry_lookup_hold(s, ns, parent_hash, parent_len, key->layer);

    tier = s->pool[TQKV_TIER_HBM] ? TQKV_TIER_HBM : TQKV_TIER_DRAM;
    st = make_room(s, tier, len, &mem, 1);
    if (st != TQKV_OK && tier == TQKV_TIER_HBM) {
        tier = TQKV_TIER_DRAM;
        st = make_room(s, tier, len, &mem, 1);
    }
    if (st != TQKV_OK)
        goto fail_alloc;
    if ((st = tqkv_pool_copy_in(s->pool[tier], mem, page, len)) != TQKV_OK)
        goto fail_copy;
    st = TQKV_ENOMEM;
    c = malloc(sizeof(*c));
    e = calloc(1, sizeof(*e));
    if (c == NULL || e == NULL)
        goto fail_copy;
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
    {
        const tqkv_page_header_t *h = page;
        if (len >= sizeof(*h) && h->magic == TQKV_PAGE_MAGIC && h->page_bytes == len) {
            e->crc = h->crc32c;
            e->crc_kind = CRC_PAGE;
        } else if (s->cfg.verify_crc) {
            e->crc = tqkv_crc32c(0, page, len);
            e->crc_kind = CRC_WHOLE;
        }
    }

    pthread_mutex_lock(&sp->lock);
    b = do_block_find(sp, hv, ns, key->hash, key->hash_len);
    if (b != NULL && key->layer < b->nlayers && b->layers[key->layer] != NULL) {
        pthread_mutex_unlock(&sp->lock);
        if (duplicate)
            *duplicate = 1;
        st = TQKV_OK;
        goto fail_copy;
    }
    if (b == NULL) {
        if (sp->count >= sp->nb && (st = do_stripe_grow(sp)) != TQKV_OK)
            goto fail_locked;
        b = calloc(1, sizeof(*b) + key->hash_len);
        if (b == NULL)
            goto fail_locked_nomem;
        b->ns = ns;
        b->hv = hv;
        b->hash_len = (uint8_t)key->hash_len;
        memcpy(b->hash, key->hash, key->hash_len);
        b->hnext = sp->buckets[hv & (sp->nb - 1)];
        sp->buckets[hv & (sp->nb - 1)] = b;
        sp->count++;
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
                do_block_unlink_free(sp, b);
            goto fail_locked_nomem;
        }
        memset(nl + b->nlayers, 0, (n - b->nlayers) * sizeof(*nl));
        b->layers = nl;
        b->nlayers = n;
    }
    e->blk = b;
    b->layers[key->layer] = e;
    b->nlive++;

    pthread_mutex_lock(&s->evict_lock);
    e->linked = 1;
    e->ns_next = ns->head;
    if (ns->head)
        ns->head->ns_prev = e;
    else
        ns->tail = e;
    ns->head = e;
    do_account(s, e, tier, 1);
    tqkv__evq_insert(&s->q[tier], &e->node, hv);
    if (parent != NULL && parent->linked) {
        if (parent->children++ == 0)
            tqkv__evq_park(&s->q[parent->tier], &parent->node);
        e->parent = parent; /* keeps our sref */
        parent = NULL;
    } else if (parent_len > 0 && do_orphan_add(s, e, ns, parent_hash, parent_len, key->layer)) {
        recheck = 1; /* the parent may have been linked since we looked */
        entry_hold(e);
    }
    {
        /* Pages put before us that name us as their parent. */
        orphan_t *o = do_orphan_find(s, ns, hv, key->hash, key->hash_len, key->layer);
        for (entry_t *k = o ? o->kids : NULL, *next; k != NULL; k = next) {
            next = k->sib_next;
            do_adopt(s, e, k);
        }
    }
    pthread_mutex_unlock(&s->evict_lock);
    pthread_mutex_unlock(&sp->lock);

    if (recheck) {
        entry_t *p = entry_lookup_hold(s, ns, parent_hash, parent_len, key->layer);
        if (p != NULL) {
            pthread_mutex_lock(&s->evict_lock);
            do_adopt(s, p, e);
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
        bg_kick(s);
    return TQKV_OK;

fail_locked_nomem:
    st = TQKV_ENOMEM;
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
        return put_ram(s, key, parent_hash, parent_len, page, len, bf16_bytes, duplicate);
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
        if ((st = ns_get(s, key->ns, key->ns_len, &ns)) != TQKV_OK)
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
    st = put_ram(s, key, parent_hash, parent_len, page, len, bf16_bytes, &dup);
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
        ns_rec_t *ns = ns_find(s, key->ns, key->ns_len);
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

    if (tqkv_pool_used(h) + old->len > hbm_mark(s, s->cfg.high_watermark))
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
    swapped = do_move_tier(s, e, old, nc, TQKV_TIER_HBM);
    pthread_mutex_unlock(&s->evict_lock);
    pthread_mutex_unlock(&st->lock);
    if (!swapped)
        copy_release(s, nc);
    else
        bg_kick(s);
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
        do_unlink(s, e, 0);
        if (b->nlive == 0)
            do_block_unlink_free(sp, b);
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
    r->s = s;
    r->c = NULL;
    r->buf = p.buf; /* the record buffer; the page is inside it */
    r->host = p.page;
    r->len = (uint32_t)p.len;
    r->tier = TQKV_TIER_DISK;
    cnt_add(&s->g.hits[TQKV_TIER_DISK], 1);
    cnt_add(&ns->c.hits[TQKV_TIER_DISK], 1);
    cnt_add(&s->g.bytes_out, r->len);
    cnt_add(&ns->c.bytes_out, r->len);
    /* Promotion: the next Get is served from DRAM (best effort: a full DRAM of pinned
     * pages keeps it on disk only). */
    int dup = 0;
    if (put_ram(s, key, p.parent_len ? p.parent : NULL, p.parent_len, p.page, p.len, p.bf16_bytes,
                &dup) == TQKV_OK &&
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
    if ((ns = ns_find(s, ns_name, ns_len)) == NULL)
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
                entry_t *e = do_entry_find(sp, hv, ns, hashes[i], hash_lens[i], l);
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
                    if (put_ram(s, &keys[j], pages[j].parent_len ? pages[j].parent : NULL,
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

tqkv_status_t
tqkv_store_get(tqkv_store_t *s, const tqkv_block_key_t *key, tqkv_page_ref_t **out)
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
    ns = ns_find(s, key->ns, key->ns_len);
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
    e = do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
    if (e == NULL) {
        pthread_mutex_unlock(&sp->lock);
        if (s->disk != NULL)
            return get_disk(s, ns, key, r, out);
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
    ns = ns_find(s, ns_name, ns_len);
    if (lease_ms > 0) {
        until = now_ms(s) + lease_ms;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t tier = TQKV_TIER_NONE;
        if (ns != NULL) {
            uint64_t hv = key_hash(ns->hv, hashes[i], hash_lens[i]);
            stripe_t *sp = stripe_of(s, hv);
            pthread_mutex_lock(&sp->lock);
            block_t *b = do_block_find(sp, hv, ns, hashes[i], hash_lens[i]);
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
    ns = ns_find(s, ns_name, ns_len);
    if (ns == NULL)
        goto out;
    uint64_t hv = key_hash(ns->hv, hash, hash_len);
    stripe_t *sp = stripe_of(s, hv);
    pthread_mutex_lock(&sp->lock);
    block_t *b = do_block_find(sp, hv, ns, hash, hash_len);
    if (b != NULL) {
        uint64_t rp = 0, rbytes = 0;
        pthread_mutex_lock(&s->evict_lock);
        for (uint32_t l = 0; l < b->nlayers; l++) {
            entry_t *e = b->layers[l];
            if (e != NULL) {
                rp++;
                rbytes += e->node.len;
                do_unlink(s, e, 0);
            }
        }
        pthread_mutex_unlock(&s->evict_lock);
        do_block_unlink_free(sp, b);
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
    ns = ns_find(s, ns_name, ns_len);
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
                        do_unlink(s, e, 0);
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
    if ((st = ns_get(s, ns_name, ns_len, &ns)) != TQKV_OK)
        return st;
    atomic_store(&ns->quota, bytes);
    /* Bring the namespace under its new quota, coldest pages first. */
    while (bytes != 0 && atomic_load(&ns->reserved) > bytes)
        if (!evict_one(s, TQKV_TIER_DRAM, ns))
            break;
    return TQKV_OK;
}

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
    ns_rec_t *ns = ns_find(s, ns_name, ns_len);
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
    ns_rec_t *ns = ns_find(s, key->ns, key->ns_len);
    if (ns == NULL)
        return TQKV_ENOTFOUND;
    uint64_t hv = key_hash(ns->hv, key->hash, key->hash_len);
    stripe_t *sp = stripe_of(s, hv);
    pthread_mutex_lock(&sp->lock);
    entry_t *e = do_entry_find(sp, hv, ns, key->hash, key->hash_len, key->layer);
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
