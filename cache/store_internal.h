/* store_internal.h - what the files of the page store share: the store's body, its page
 * entries, blocks, orphans and namespace records, and the helpers one file uses from
 * another.
 *
 * The store is cache/store.c (namespaces, the index, orphans, create/destroy, deletes;
 * its header comment has the data structures and the lock order), cache/store_evict.c
 * (eviction, demotion, the maintenance thread), cache/store_put.c, cache/store_get.c
 * (Gets, prefetch, page references, Lookup) and cache/store_stats.c (statistics, the
 * hand-off export, test hooks). Functions named do_... expect the lock their comment
 * names held.
 */
#ifndef TQKV_CACHE_STORE_INTERNAL_H
#define TQKV_CACHE_STORE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "cache/cache_internal.h"
#include "cache/disk.h"
#include "cache/evict.h"
#include "cache/pool.h"
#include "cache/store.h"
#include "kernels/clock.h"

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

    uint64_t epoch_ns;             /* tqkv_clock_ns() at which now_ms() reads 0 */
    _Atomic int64_t clock_skew_ms; /* added to the clock (tqkv__store_debug_advance_clock) */

    pthread_mutex_t maint_lock; /* one maintenance pass at a time (outermost lock) */
    pthread_mutex_t bg_lock;    /* bg_stop and bg_cond */
    pthread_cond_t bg_cond;
    int bg_stop, bg_running;
    pthread_t bg;
};

/* ---- small helpers ---- */

static inline uint64_t
ns_hash(const char *ns, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(0x7171u ^ len, (const uint8_t *)ns, len));
}

static inline uint64_t
key_hash(uint64_t nsh, const uint8_t *hash, size_t len)
{
    return tqkv__mix64(tqkv__hash_bytes(nsh ^ (len * 0x100000001b3ULL), hash, len));
}

static inline stripe_t *
stripe_of(tqkv_store_t *s, uint64_t hv)
{
    return &s->stripes[hv >> 56];
}

static inline uint64_t
now_ms(tqkv_store_t *s)
{
    int64_t ms = (int64_t)((tqkv_clock_ns() - s->epoch_ns) / 1000000u);
    ms += atomic_load_explicit(&s->clock_skew_ms, memory_order_relaxed);
    return ms < 0 ? 0 : (uint64_t)ms;
}

static inline void
cnt_add(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static inline void
cnt_sub(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_sub_explicit(c, v, memory_order_relaxed);
}

static inline uint64_t
cnt_get(_Atomic uint64_t *c)
{
    return atomic_load_explicit(c, memory_order_relaxed);
}

static inline void
copy_release(tqkv_store_t *s, copy_t *c)
{
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) {
        tqkv_pool_free(s->pool[c->tier], c->data, c->len);
        free(c);
    }
}

static inline void
entry_hold(entry_t *e)
{
    atomic_fetch_add_explicit(&e->sref, 1, memory_order_relaxed);
}

static inline void
entry_put(entry_t *e)
{
    if (atomic_fetch_sub_explicit(&e->sref, 1, memory_order_acq_rel) == 1)
        free(e);
}

static inline int
valid_key(const tqkv_block_key_t *k)
{
    return k != NULL && (k->ns != NULL || k->ns_len == 0) && k->ns_len <= TQKV_STORE_MAX_NS &&
           k->hash != NULL && k->hash_len >= 1 && k->hash_len <= 64 &&
           k->layer < TQKV_STORE_MAX_LAYERS;
}

/* store.c: namespaces, the index (stripe lock held), orphans (evict_lock held), unlinking */
ns_rec_t *tqkv__store_ns_find(tqkv_store_t *s, const char *ns, size_t len);
tqkv_status_t tqkv__store_ns_get(tqkv_store_t *s, const char *ns, size_t len, ns_rec_t **out);
int tqkv__store_quota_reserve(ns_rec_t *r, uint64_t len);
block_t *tqkv__store_do_block_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash,
                                   size_t hlen);
entry_t *tqkv__store_do_entry_find(stripe_t *st, uint64_t hv, ns_rec_t *ns, const uint8_t *hash,
                                   size_t hlen, uint32_t layer);
tqkv_status_t tqkv__store_do_stripe_grow(stripe_t *st);
void tqkv__store_do_block_unlink_free(stripe_t *st, block_t *b);
void tqkv__store_do_account(tqkv_store_t *s, entry_t *e, int tier, int add);
orphan_t *tqkv__store_do_orphan_find(tqkv_store_t *s, ns_rec_t *ns, uint64_t hv,
                                     const uint8_t *hash, size_t hlen, uint32_t layer);
int tqkv__store_do_orphan_add(tqkv_store_t *s, entry_t *e, ns_rec_t *ns, const uint8_t *hash,
                              size_t hlen, uint32_t layer);
void tqkv__store_do_adopt(tqkv_store_t *s, entry_t *p, entry_t *kid);
void tqkv__store_do_unlink(tqkv_store_t *s, entry_t *e, int evicted);

/* store_evict.c: eviction, demotion and the maintenance thread */
int tqkv__store_evict_one(tqkv_store_t *s, int tier, ns_rec_t *ns);
int tqkv__store_do_move_tier(tqkv_store_t *s, entry_t *e, copy_t *old, copy_t *nc, int to);
tqkv_status_t tqkv__store_make_room(tqkv_store_t *s, int tier, size_t len, void **ptr,
                                    int hbm_leaves);
uint64_t tqkv__store_hbm_mark(tqkv_store_t *s, double frac);
void *tqkv__store_bg_main(void *arg);
void tqkv__store_bg_kick(tqkv_store_t *s);

/* store_put.c: puts into HBM/DRAM */
tqkv_status_t tqkv__store_put_ram(tqkv_store_t *s, const tqkv_block_key_t *key,
                                  const uint8_t *parent_hash, size_t parent_len, const void *page,
                                  size_t len, uint64_t bf16_bytes, int *duplicate);

#endif /* TQKV_CACHE_STORE_INTERNAL_H */
