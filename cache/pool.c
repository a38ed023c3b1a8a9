/* pool.c - tier page memory: host pools over a dedicated jemalloc arena, capacity
 * accounting for every pool, and the device sub-allocator (offset arithmetic only).
 *
 * Accounting: `used` is reserved with a compare-and-swap loop before memory is taken,
 * so it never exceeds `capacity`, even transiently; a failed allocation gives the
 * reservation back. Host allocations use MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE so
 * that freed page memory returns to the tier's arena and not to a thread cache.
 * Device pools forward to tqkv__pool_dev_* (pool_cuda.c) after the same accounting.
 *
 * Under AddressSanitizer or ThreadSanitizer host pools use the system allocator
 * instead (TQKV__POOL_SYSTEM_MALLOC): the sanitizers then see every page allocation,
 * and TSan does not misreport jemalloc's internal locks.
 *
 * The sub-allocator is first-fit over a free list sorted by offset, coalescing
 * neighbours on free; its lock is the innermost lock of cache/.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jemalloc/jemalloc.h>

#include "cache/cache_internal.h"
#include "cache/pool.h"

/* Allocations this large are page-aligned (see tqkv_pool_alloc). */
#define LARGE_PAGE_ALIGN_MIN (16u << 10)

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TQKV__POOL_SYSTEM_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TQKV__POOL_SYSTEM_MALLOC 1
#endif
#endif

/* ---- capacity accounting ---- */

static int
reserve(tqkv_pool_t *p, size_t len)
{
    uint64_t cur = atomic_load_explicit(&p->used, memory_order_relaxed);
    for (;;) {
        if ((uint64_t)len > p->capacity || cur > p->capacity - (uint64_t)len)
            return 0;
        if (atomic_compare_exchange_weak_explicit(&p->used, &cur, cur + (uint64_t)len,
                                                  memory_order_acq_rel, memory_order_relaxed))
            return 1;
    }
}

static void
unreserve(tqkv_pool_t *p, size_t len)
{
    atomic_fetch_sub_explicit(&p->used, (uint64_t)len, memory_order_acq_rel);
}

/* ---- host pools ---- */

tqkv_status_t
tqkv_pool_create_host(uint64_t capacity, tqkv_pool_t **out)
{
    tqkv_pool_t *p;
    unsigned arena = 0;
    size_t sz = sizeof(arena);

    if (out == NULL)
        return TQKV_EINVAL;
    *out = NULL;
    p = calloc(1, sizeof(*p));
    if (p == NULL)
        return TQKV_ENOMEM;
#ifndef TQKV__POOL_SYSTEM_MALLOC
    if (mallctl("arenas.create", &arena, &sz, NULL, 0) != 0) {
        free(p);
        return TQKV_ENOMEM;
    }
#else
    (void)sz;
#endif
    p->kind = TQKV__POOL_HOST;
    p->capacity = capacity;
    p->arena = arena;
    p->device = -1;
    atomic_init(&p->used, 0);
    atomic_init(&p->allocs, 0);
    atomic_init(&p->alloc_failures, 0);
    *out = p;
    return TQKV_OK;
}

#ifndef TQKV_HAVE_CUDA
tqkv_status_t
tqkv_pool_create_device(int device, uint64_t capacity, tqkv_pool_t **out)
{
    (void)device;
    (void)capacity;
    if (out != NULL)
        *out = NULL;
    return TQKV_ENODEV; /* built without CUDA */
}
#endif

void
tqkv_pool_destroy(tqkv_pool_t *p)
{
    if (p == NULL)
        return;
    if (p->kind == TQKV__POOL_DEVICE) {
#ifdef TQKV_HAVE_CUDA
        tqkv__pool_dev_destroy(p);
#endif
        free(p);
        return;
    }
#ifndef TQKV__POOL_SYSTEM_MALLOC
    if (atomic_load(&p->allocs) == 0) {
        /* Give the arena's memory back to the OS. Only safe with nothing left in it. */
        char name[64];
        snprintf(name, sizeof(name), "arena.%u.destroy", p->arena);
        (void)mallctl(name, NULL, NULL, NULL, 0);
    }
#endif
    free(p);
}

int
tqkv_pool_is_device(const tqkv_pool_t *p)
{
    return p != NULL && p->kind == TQKV__POOL_DEVICE;
}

tqkv_status_t
tqkv_pool_alloc(tqkv_pool_t *p, size_t len, void **ptr)
{
    tqkv_status_t st = TQKV_OK;
    void *m;

    if (p == NULL || ptr == NULL || len == 0)
        return TQKV_EINVAL;
    *ptr = NULL;
    if (!reserve(p, len)) {
        atomic_fetch_add_explicit(&p->alloc_failures, 1, memory_order_relaxed);
        return TQKV_ENOSPC;
    }
    if (p->kind == TQKV__POOL_DEVICE) {
#ifdef TQKV_HAVE_CUDA
        st = tqkv__pool_dev_alloc(p, len, &m);
#else
        st = TQKV_ENODEV;
        m = NULL;
#endif
    } else {
#ifdef TQKV__POOL_SYSTEM_MALLOC
        m = malloc(len);
#else
        int flags = MALLOCX_ARENA(p->arena) | MALLOCX_TCACHE_NONE;
        /* Page-align large pages: jemalloc then skips its random cache-line offset,
         * which would make every page straddle one more OS page (+4 KiB RSS each). */
        if (len >= LARGE_PAGE_ALIGN_MIN)
            flags |= MALLOCX_ALIGN(4096);
        m = mallocx(len, flags);
#endif
        if (m == NULL)
            st = TQKV_ENOMEM;
    }
    if (st != TQKV_OK) {
        unreserve(p, len);
        atomic_fetch_add_explicit(&p->alloc_failures, 1, memory_order_relaxed);
        return st;
    }
    atomic_fetch_add_explicit(&p->allocs, 1, memory_order_relaxed);
    *ptr = m;
    return TQKV_OK;
}

void
tqkv_pool_free(tqkv_pool_t *p, void *ptr, size_t len)
{
    if (p == NULL || ptr == NULL)
        return;
    if (p->kind == TQKV__POOL_DEVICE) {
#ifdef TQKV_HAVE_CUDA
        tqkv__pool_dev_free(p, ptr, len);
#endif
    } else {
#ifdef TQKV__POOL_SYSTEM_MALLOC
        free(ptr);
#else
        dallocx(ptr, MALLOCX_ARENA(p->arena) | MALLOCX_TCACHE_NONE);
#endif
    }
    atomic_fetch_sub_explicit(&p->allocs, 1, memory_order_relaxed);
    unreserve(p, len);
}

tqkv_status_t
tqkv_pool_copy_in(tqkv_pool_t *p, void *dst, const void *src_host, size_t len)
{
    if (p == NULL || (len > 0 && (dst == NULL || src_host == NULL)))
        return TQKV_EINVAL;
    if (p->kind == TQKV__POOL_DEVICE) {
#ifdef TQKV_HAVE_CUDA
        return tqkv__pool_dev_copy_in(p, dst, src_host, len);
#else
        return TQKV_ENODEV;
#endif
    }
    if (len > 0)
        memcpy(dst, src_host, len);
    return TQKV_OK;
}

tqkv_status_t
tqkv_pool_copy_out(tqkv_pool_t *p, void *dst_host, const void *src, size_t len)
{
    if (p == NULL || (len > 0 && (dst_host == NULL || src == NULL)))
        return TQKV_EINVAL;
    if (p->kind == TQKV__POOL_DEVICE) {
#ifdef TQKV_HAVE_CUDA
        return tqkv__pool_dev_copy_out(p, dst_host, src, len);
#else
        return TQKV_ENODEV;
#endif
    }
    if (len > 0)
        memcpy(dst_host, src, len);
    return TQKV_OK;
}

uint64_t
tqkv_pool_capacity(const tqkv_pool_t *p)
{
    return p ? p->capacity : 0;
}

uint64_t
tqkv_pool_used(const tqkv_pool_t *p)
{
    return p ? atomic_load_explicit(&((tqkv_pool_t *)p)->used, memory_order_acquire) : 0;
}

uint64_t
tqkv__pool_live_allocs(const tqkv_pool_t *p)
{
    return p ? atomic_load(&((tqkv_pool_t *)p)->allocs) : 0;
}

uint64_t
tqkv__pool_alloc_failures(const tqkv_pool_t *p)
{
    return p ? atomic_load(&((tqkv_pool_t *)p)->alloc_failures) : 0;
}

/* ---- device sub-allocator ---- */

static uint64_t
round_len(uint64_t len)
{
    return (len + TQKV__SUBALLOC_ALIGN - 1) / TQKV__SUBALLOC_ALIGN * TQKV__SUBALLOC_ALIGN;
}

tqkv_status_t
tqkv__suballoc_init(tqkv__suballoc_t *sa, uint64_t size)
{
    tqkv__extent_t *x;

    memset(sa, 0, sizeof(*sa));
    size = size / TQKV__SUBALLOC_ALIGN * TQKV__SUBALLOC_ALIGN;
    if (pthread_mutex_init(&sa->lock, NULL) != 0)
        return TQKV_ENOMEM;
    sa->size = size;
    if (size == 0)
        return TQKV_OK;
    x = calloc(1, sizeof(*x));
    if (x == NULL) {
        pthread_mutex_destroy(&sa->lock);
        return TQKV_ENOMEM;
    }
    x->off = 0;
    x->len = size;
    sa->head = x;
    sa->n_free = 1;
    sa->bytes_free = size;
    return TQKV_OK;
}

void
tqkv__suballoc_fini(tqkv__suballoc_t *sa)
{
    tqkv__extent_t *x = sa->head, *n;
    while (x != NULL) {
        n = x->next;
        free(x);
        x = n;
    }
    sa->head = NULL;
    sa->n_free = 0;
    sa->bytes_free = 0;
    pthread_mutex_destroy(&sa->lock);
}

tqkv_status_t
tqkv__suballoc_alloc(tqkv__suballoc_t *sa, uint64_t len, uint64_t *off)
{
    tqkv__extent_t *x;
    uint64_t need = round_len(len);

    if (len == 0 || need < len)
        return TQKV_EINVAL;
    pthread_mutex_lock(&sa->lock);
    for (x = sa->head; x != NULL; x = x->next)
        if (x->len >= need)
            break;
    if (x == NULL) {
        pthread_mutex_unlock(&sa->lock);
        return TQKV_ENOSPC;
    }
    *off = x->off;
    x->off += need;
    x->len -= need;
    sa->bytes_free -= need;
    if (x->len == 0) {
        if (x->prev)
            x->prev->next = x->next;
        else
            sa->head = x->next;
        if (x->next)
            x->next->prev = x->prev;
        sa->n_free--;
        free(x);
    }
    pthread_mutex_unlock(&sa->lock);
    return TQKV_OK;
}

tqkv_status_t
tqkv__suballoc_free(tqkv__suballoc_t *sa, uint64_t off, uint64_t len)
{
    tqkv__extent_t *prev = NULL, *next, *x;
    uint64_t n = round_len(len);

    pthread_mutex_lock(&sa->lock);
    next = sa->head;
    while (next != NULL && next->off < off) {
        prev = next;
        next = next->next;
    }
    if (prev != NULL && prev->off + prev->len == off) {
        prev->len += n;
        if (next != NULL && prev->off + prev->len == next->off) {
            prev->len += next->len;
            prev->next = next->next;
            if (next->next)
                next->next->prev = prev;
            sa->n_free--;
            free(next);
        }
    } else if (next != NULL && off + n == next->off) {
        next->off = off;
        next->len += n;
    } else {
        x = malloc(sizeof(*x));
        if (x == NULL) {
            pthread_mutex_unlock(&sa->lock);
            return TQKV_ENOMEM;
        }
        x->off = off;
        x->len = n;
        x->prev = prev;
        x->next = next;
        if (prev)
            prev->next = x;
        else
            sa->head = x;
        if (next)
            next->prev = x;
        sa->n_free++;
    }
    sa->bytes_free += n;
    pthread_mutex_unlock(&sa->lock);
    return TQKV_OK;
}
