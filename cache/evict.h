/* evict.h - eviction order of one tier: LRU or S3-FIFO queues, plus a "parked" list.
 *
 * A queue holds nodes embedded in the store's page entries. Only leaves (pages no
 * kept block extends) are in the LRU/S3-FIFO lists; pages with children are parked
 * and come back at the cold end when their last child goes (leaf-first eviction).
 * The owner serialises every call on one queue with its own lock (the store's evict
 * lock), except tqkv__evq_touch for S3-FIFO, which only bumps an atomic counter.
 *
 * S3-FIFO (Yang et al., SOSP'23): new pages enter a small FIFO (10% of bytes); those
 * accessed again while there move to the main FIFO, the others leave and their key
 * hash is remembered in a ghost table; a page whose hash is in the ghost table enters
 * main directly. Main is a FIFO with a 2-bit access counter giving second chances.
 */
#ifndef TQKV_CACHE_EVICT_H
#define TQKV_CACHE_EVICT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/store.h"

/* Where a node is. */
enum {
    TQKV__EVQ_NONE = 0,   /* in no list */
    TQKV__EVQ_SMALL = 1,  /* S3-FIFO small queue */
    TQKV__EVQ_MAIN = 2,   /* LRU list, or S3-FIFO main queue */
    TQKV__EVQ_PARKED = 3, /* has children: not an eviction candidate */
};

typedef struct tqkv__evq_node {
    struct tqkv__evq_node *prev, *next; /* prev: towards the hot end (head) */
    uint32_t len;                       /* page bytes */
    _Atomic uint8_t freq;               /* S3-FIFO access counter, 0..3 */
    uint8_t where;                      /* TQKV__EVQ_* */
} tqkv__evq_node_t;

typedef struct tqkv__evq_list {
    tqkv__evq_node_t *head, *tail; /* head = hot end, tail = cold end */
    uint64_t count, bytes;
} tqkv__evq_list_t;

typedef struct tqkv__evq {
    tqkv_evict_policy_t policy;
    tqkv__evq_list_t small, main, parked;
    uint64_t *ghost_hv;  /* direct-mapped ghost table: key hash */
    uint64_t *ghost_seq; /* and when it was inserted */
    uint64_t ghost_mask; /* slots - 1 */
    uint64_t ghost_clock;
} tqkv__evq_t;

/* Initialises q; ghost_slots (power of two, S3-FIFO only). TQKV_ENOMEM on failure. */
tqkv_status_t tqkv__evq_init(tqkv__evq_t *q, tqkv_evict_policy_t policy, size_t ghost_slots);
void tqkv__evq_fini(tqkv__evq_t *q);

/* A new (or newly arrived) leaf: LRU head; S3-FIFO small head, or main head when hv is
 * in the ghost table. */
void tqkv__evq_insert(tqkv__evq_t *q, tqkv__evq_node_t *n, uint64_t hv);
/* A page that became a leaf again: the cold end of main (its children were colder). */
void tqkv__evq_insert_cold(tqkv__evq_t *q, tqkv__evq_node_t *n);
/* Moves a listed node to the parked list. */
void tqkv__evq_park(tqkv__evq_t *q, tqkv__evq_node_t *n);
/* Unlinks n from whatever list holds it. With evicted and S3-FIFO, hv enters the ghost
 * table when n leaves from the small queue. */
void tqkv__evq_remove(tqkv__evq_t *q, tqkv__evq_node_t *n, int evicted, uint64_t hv);
/* An access: LRU moves n to the head (caller holds the queue's lock); S3-FIFO bumps
 * freq (no lock needed). Parked nodes only get their counter bumped. */
void tqkv__evq_touch(tqkv__evq_t *q, tqkv__evq_node_t *n);

/* Chooses the next victim by the policy among leaves for which ok(n, arg) is true
 * (nodes failing ok get moved to the hot end), advancing S3-FIFO's state (promotions
 * small -> main, second chances). NULL when no candidate. Does not unlink it. */
tqkv__evq_node_t *tqkv__evq_victim(tqkv__evq_t *q, int (*ok)(tqkv__evq_node_t *n, void *arg),
                                   void *arg);
/* The cold end of the parked list, or NULL. */
tqkv__evq_node_t *tqkv__evq_coldest_parked(tqkv__evq_t *q);

#endif
