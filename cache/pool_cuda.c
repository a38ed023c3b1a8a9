/* pool_cuda.c - the HBM tier's device pool: one cudaMalloc up front, sub-allocated.
 *
 * tqkv_pool_create_device makes the single device allocation and the host-side
 * sub-allocator (cache_internal.h) over it; pool.c does the capacity accounting and
 * calls the tqkv__pool_dev_* functions below for every device-pool operation.
 *
 * Copies run on the calling thread's per-thread default stream (cudaStreamPerThread)
 * and are waited for before returning, so concurrent copies from different threads
 * neither serialize on the legacy default stream nor wait for each other. Every call
 * makes the pool's device current first (threads may have another device current).
 * No lock is held across a CUDA call: the sub-allocator locks only its own metadata.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "cache/cache_internal.h"
#include "cache/pool.h"

static tqkv_status_t
cuda_status(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return TQKV_OK;
    fprintf(stderr, "tqkv: device pool: %s: %s\n", what, cudaGetErrorString(e));
    if (e == cudaErrorMemoryAllocation)
        return TQKV_ENOMEM;
    if (e == cudaErrorNoDevice || e == cudaErrorInvalidDevice || e == cudaErrorInsufficientDriver)
        return TQKV_ENODEV;
    return TQKV_ECUDA;
}

/* Device pool: cudaMalloc of `capacity` bytes on `device`. Returns new (*out). */
tqkv_status_t
tqkv_pool_create_device(int device, uint64_t capacity, tqkv_pool_t **out)
{
    tqkv_pool_t *p;
    tqkv_status_t st;
    int n = 0;
    void *base = NULL;

    if (!out || capacity == 0 || device < 0)
        return TQKV_EINVAL;
    *out = NULL;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        return TQKV_ENODEV;
    }
    if (device >= n)
        return TQKV_ENODEV;
    if ((st = cuda_status(cudaSetDevice(device), "cudaSetDevice")) != TQKV_OK)
        goto fail_dev;
    p = calloc(1, sizeof *p);
    if (!p) {
        st = TQKV_ENOMEM;
        goto fail_dev;
    }
    if ((st = cuda_status(cudaMalloc(&base, (size_t)capacity), "cudaMalloc")) != TQKV_OK)
        goto fail_malloc;
    if ((st = tqkv__suballoc_init(&p->sub, capacity)) != TQKV_OK)
        goto fail_sub;
    p->kind = TQKV__POOL_DEVICE;
    p->capacity = capacity;
    atomic_init(&p->used, 0);
    atomic_init(&p->allocs, 0);
    atomic_init(&p->alloc_failures, 0);
    p->device = device;
    p->dev_base = base;
    p->dev_priv = NULL;
    *out = p;
    return TQKV_OK;

fail_sub:
    cudaFree(base);
fail_malloc:
    free(p);
fail_dev:
    return st;
}

tqkv_status_t
tqkv__pool_dev_alloc(tqkv_pool_t *p, size_t len, void **ptr)
{
    uint64_t off = 0;
    tqkv_status_t st;
    if (!p || !ptr || len == 0)
        return TQKV_EINVAL;
    if ((st = tqkv__suballoc_alloc(&p->sub, len, &off)) != TQKV_OK)
        return st;
    *ptr = (uint8_t *)p->dev_base + off;
    return TQKV_OK;
}

void
tqkv__pool_dev_free(tqkv_pool_t *p, void *ptr, size_t len)
{
    uint64_t off;
    if (!p || !ptr)
        return;
    off = (uint64_t)((uint8_t *)ptr - (uint8_t *)p->dev_base);
    if (tqkv__suballoc_free(&p->sub, off, len) != TQKV_OK)
        fprintf(stderr, "tqkv: device pool: free of %zu bytes at %llu lost (no metadata)\n", len,
                (unsigned long long)off);
}

/* Returns 1 when [ptr, ptr + len) lies inside the pool's device allocation. */
static int
in_pool(const tqkv_pool_t *p, const void *ptr, size_t len)
{
    uintptr_t b = (uintptr_t)p->dev_base, q = (uintptr_t)ptr;
    return q >= b && len <= p->capacity && q - b <= p->capacity - len;
}

static tqkv_status_t
dev_copy(tqkv_pool_t *p, void *dst, const void *src, size_t len, enum cudaMemcpyKind kind)
{
    tqkv_status_t st;
    if ((st = cuda_status(cudaSetDevice(p->device), "cudaSetDevice")) != TQKV_OK)
        return st;
    st = cuda_status(cudaMemcpyAsync(dst, src, len, kind, cudaStreamPerThread), "cudaMemcpyAsync");
    if (st != TQKV_OK)
        return st;
    return cuda_status(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
}

tqkv_status_t
tqkv__pool_dev_copy_in(tqkv_pool_t *p, void *dst, const void *src_host, size_t len)
{
    if (!p || (!dst && len) || (!src_host && len) || !in_pool(p, dst, len))
        return TQKV_EINVAL;
    if (len == 0)
        return TQKV_OK;
    return dev_copy(p, dst, src_host, len, cudaMemcpyHostToDevice);
}

tqkv_status_t
tqkv__pool_dev_copy_out(tqkv_pool_t *p, void *dst_host, const void *src, size_t len)
{
    if (!p || (!dst_host && len) || (!src && len) || !in_pool(p, src, len))
        return TQKV_EINVAL;
    if (len == 0)
        return TQKV_OK;
    return dev_copy(p, dst_host, src, len, cudaMemcpyDeviceToHost);
}

void
tqkv__pool_dev_destroy(tqkv_pool_t *p)
{
    if (!p)
        return;
    if (p->dev_base) {
        if (cudaSetDevice(p->device) == cudaSuccess)
            (void)cudaFree(p->dev_base);
        p->dev_base = NULL;
    }
    tqkv__suballoc_fini(&p->sub);
}
