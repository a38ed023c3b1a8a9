/* evict.c - LRU and S3-FIFO eviction queues with a parked list for non-leaf pages.
 *
 * Intrusive doubly linked lists; the caller holds the queue's lock for every call
 * except S3-FIFO touches (an atomic counter). See evict.h for the policies.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/evict.h"

static void
list_push_head(tqkv__evq_list_t *l, tqkv__evq_node_t *n)
{
    n->prev = NULL;
    n->next = l->head;
    if (l->head)
        l->head->prev = n;
    else
        l->tail = n;
    l->head = n;
    l->count++;
    l->bytes += n->len;
}

static void
list_push_tail(tqkv__evq_list_t *l, tqkv__evq_node_t *n)
{
    n->next = NULL;
    n->prev = l->tail;
    if (l->tail)
        l->tail->next = n;
    else
        l->head = n;
    l->tail = n;
    l->count++;
    l->bytes += n->len;
}

static void
list_unlink(tqkv__evq_list_t *l, tqkv__evq_node_t *n)
{
    if (n->prev)
        n->prev->next = n->next;
    else
        l->head = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        l->tail = n->prev;
    n->prev = n->next = NULL;
    l->count--;
    l->bytes -= n->len;
}

static tqkv__evq_list_t *
list_of(tqkv__evq_t *q, int where)
{
    switch (where) {
    case TQKV__EVQ_SMALL:
        return &q->small;
    case TQKV__EVQ_MAIN:
        return &q->main;
    case TQKV__EVQ_PARKED:
        return &q->parked;
    default:
        return NULL;
    }
}

tqkv_status_t
tqkv__evq_init(tqkv__evq_t *q, tqkv_evict_policy_t policy, size_t ghost_slots)
{
    memset(q, 0, sizeof(*q));
    q->policy = policy;
    if (policy == TQKV_EVICT_S3FIFO) {
        size_t slots = 1;
        while (slots < ghost_slots)
            slots <<= 1;
        q->ghost_hv = calloc(slots, sizeof(uint64_t));
        q->ghost_seq = calloc(slots, sizeof(uint64_t));
        if (q->ghost_hv == NULL || q->ghost_seq == NULL) {
            free(q->ghost_hv);
            free(q->ghost_seq);
            return TQKV_ENOMEM;
        }
        q->ghost_mask = slots - 1;
    }
    return TQKV_OK;
}

void
tqkv__evq_fini(tqkv__evq_t *q)
{
    free(q->ghost_hv);
    free(q->ghost_seq);
    memset(q, 0, sizeof(*q));
}

/* 1 when hv was evicted from small recently (within roughly main's page count). */
static int
ghost_take(tqkv__evq_t *q, uint64_t hv)
{
    uint64_t slot, window;
    if (q->ghost_hv == NULL)
        return 0;
    slot = hv & q->ghost_mask;
    window = q->main.count + q->small.count + 1;
    if (q->ghost_hv[slot] == hv && q->ghost_clock - q->ghost_seq[slot] <= window) {
        q->ghost_hv[slot] = 0;
        return 1;
    }
    return 0;
}

static void
ghost_put(tqkv__evq_t *q, uint64_t hv)
{
    uint64_t slot;
    if (q->ghost_hv == NULL)
        return;
    slot = hv & q->ghost_mask;
    q->ghost_hv[slot] = hv;
    q->ghost_seq[slot] = ++q->ghost_clock;
}

void
tqkv__evq_insert(tqkv__evq_t *q, tqkv__evq_node_t *n, uint64_t hv)
{
    atomic_store_explicit(&n->freq, 0, memory_order_relaxed);
    if (q->policy == TQKV_EVICT_S3FIFO && !ghost_take(q, hv)) {
        n->where = TQKV__EVQ_SMALL;
        list_push_head(&q->small, n);
        return;
    }
    n->where = TQKV__EVQ_MAIN;
    list_push_head(&q->main, n);
}

void
tqkv__evq_insert_cold(tqkv__evq_t *q, tqkv__evq_node_t *n)
{
    n->where = TQKV__EVQ_MAIN;
    list_push_tail(&q->main, n);
}

void
tqkv__evq_park(tqkv__evq_t *q, tqkv__evq_node_t *n)
{
    tqkv__evq_list_t *l = list_of(q, n->where);
    if (n->where == TQKV__EVQ_PARKED)
        return;
    if (l)
        list_unlink(l, n);
    n->where = TQKV__EVQ_PARKED;
    list_push_head(&q->parked, n);
}

void
tqkv__evq_remove(tqkv__evq_t *q, tqkv__evq_node_t *n, int evicted, uint64_t hv)
{
    tqkv__evq_list_t *l = list_of(q, n->where);
    if (l == NULL)
        return;
    if (evicted && n->where == TQKV__EVQ_SMALL)
        ghost_put(q, hv);
    list_unlink(l, n);
    n->where = TQKV__EVQ_NONE;
}

void
tqkv__evq_touch(tqkv__evq_t *q, tqkv__evq_node_t *n)
{
    if (q->policy == TQKV_EVICT_S3FIFO) {
        uint8_t f = atomic_load_explicit(&n->freq, memory_order_relaxed);
        if (f < 3)
            atomic_store_explicit(&n->freq, (uint8_t)(f + 1), memory_order_relaxed);
        return;
    }
    if (n->where == TQKV__EVQ_MAIN && q->main.head != n) {
        list_unlink(&q->main, n);
        list_push_head(&q->main, n);
    }
}

static tqkv__evq_node_t *
victim_lru(tqkv__evq_t *q, int (*ok)(tqkv__evq_node_t *, void *), void *arg)
{
    uint64_t limit = q->main.count;
    for (uint64_t i = 0; i < limit; i++) {
        tqkv__evq_node_t *n = q->main.tail;
        if (n == NULL)
            return NULL;
        if (ok == NULL || ok(n, arg))
            return n;
        list_unlink(&q->main, n);
        list_push_head(&q->main, n);
    }
    return NULL;
}

static tqkv__evq_node_t *
victim_s3fifo(tqkv__evq_t *q, int (*ok)(tqkv__evq_node_t *, void *), void *arg)
{
    /* Each node can be rotated at most 4 times (counter 3..0, plus small -> main). */
    uint64_t limit = 5 * (q->small.count + q->main.count) + 2;
    for (uint64_t i = 0; i < limit; i++) {
        uint64_t total = q->small.bytes + q->main.bytes;
        tqkv__evq_node_t *n;
        if (q->small.tail != NULL && (q->main.tail == NULL || q->small.bytes * 10 >= total)) {
            n = q->small.tail;
            if (ok != NULL && !ok(n, arg)) {
                list_unlink(&q->small, n);
                list_push_head(&q->small, n);
                continue;
            }
            if (atomic_load_explicit(&n->freq, memory_order_relaxed) > 0) {
                list_unlink(&q->small, n);
                atomic_store_explicit(&n->freq, 0, memory_order_relaxed);
                n->where = TQKV__EVQ_MAIN;
                list_push_head(&q->main, n);
                continue;
            }
            return n;
        }
        n = q->main.tail;
        if (n == NULL)
            return NULL;
        uint8_t f = atomic_load_explicit(&n->freq, memory_order_relaxed);
        if (ok != NULL && !ok(n, arg)) {
            list_unlink(&q->main, n);
            list_push_head(&q->main, n);
            continue;
        }
        if (f > 0) {
            atomic_store_explicit(&n->freq, (uint8_t)(f - 1), memory_order_relaxed);
            list_unlink(&q->main, n);
            list_push_head(&q->main, n);
            continue;
        }
        return n;
    }
    return NULL;
}

tqkv__evq_node_t *
tqkv__evq_victim(tqkv__evq_t *q, int (*ok)(tqkv__evq_node_t *n, void *arg), void *arg)
{
    if (q->policy == TQKV_EVICT_S3FIFO)
        return victim_s3fifo(q, ok, arg);
    return victim_lru(q, ok, arg);
}

tqkv__evq_node_t *
tqkv__evq_coldest_parked(tqkv__evq_t *q)
{
    return q->parked.tail;
}
