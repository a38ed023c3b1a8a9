/* pool.h - the page memory of one tier: a hard byte capacity over host memory (its
 * own jemalloc arena; pinned when CUDA is present) or one device allocation made up
 * front and sub-allocated (HBM).
 *
 * Host pools are implemented in cache/pool.c; the device pool in cache/pool_cuda.c
 * (built only with CUDA). Without CUDA, tqkv_pool_create_device returns TQKV_ENODEV.
 * All functions are thread-safe.
 */
#ifndef TQKV_CACHE_POOL_H
#define TQKV_CACHE_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

typedef struct tqkv_pool tqkv_pool_t;

/* Host pool of `capacity` bytes (a dedicated jemalloc arena). */
tqkv_status_t tqkv_pool_create_host(uint64_t capacity, tqkv_pool_t **out);
/* Device pool: cudaMalloc of `capacity` bytes on `device` at creation, then a
 * sub-allocator (metadata on the host). TQKV_ENODEV without CUDA or device. */
tqkv_status_t tqkv_pool_create_device(int device, uint64_t capacity, tqkv_pool_t **out);
/* Frees the pool; every allocation must have been freed (else they leak to the OS). */
void tqkv_pool_destroy(tqkv_pool_t *p);

/* 1 when pool memory is device memory (not host-addressable). */
int tqkv_pool_is_device(const tqkv_pool_t *p);

/* Allocates len bytes: TQKV_ENOSPC when the capacity would be exceeded, TQKV_ENOMEM
 * when the allocator fails. *ptr is pool memory (a device pointer for device pools). */
tqkv_status_t tqkv_pool_alloc(tqkv_pool_t *p, size_t len, void **ptr);
void tqkv_pool_free(tqkv_pool_t *p, void *ptr, size_t len);

/* Copies host -> pool and pool -> host (memcpy, or cudaMemcpy for device pools). */
tqkv_status_t tqkv_pool_copy_in(tqkv_pool_t *p, void *dst, const void *src_host, size_t len);
tqkv_status_t tqkv_pool_copy_out(tqkv_pool_t *p, void *dst_host, const void *src, size_t len);

uint64_t tqkv_pool_capacity(const tqkv_pool_t *p);
uint64_t tqkv_pool_used(const tqkv_pool_t *p);

#endif
