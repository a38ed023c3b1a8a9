/* cuda_common.cu - shared host side of the CUDA kernels: error mapping, the device
 * cache of rotations/codebooks, group codec resolution and header checks.
 *
 * Locking: `cache_lock` protects the cache list; entries are never freed, so a
 * pointer handed out stays valid. The upload of a missing entry happens with the
 * lock held (first use only).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

extern "C" {
#include "kernels/codebook.h"
#include "kernels/rotation.h"
}

tqkv_status_t
tqkv__cuda_status(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return TQKV_OK;
    fprintf(stderr, "tqkv: cuda: %s: %s\n", what, cudaGetErrorString(e));
    if (e == cudaErrorMemoryAllocation)
        return TQKV_ENOMEM;
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
        return TQKV_ENODEV;
    return TQKV_ECUDA;
}

extern "C" tqkv_status_t
tqkv_cuda_device_count(int *n)
{
    int c = 0;
    if (!n)
        return TQKV_EINVAL;
    *n = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess || c <= 0) {
        (void)cudaGetLastError();
        return TQKV_ENODEV;
    }
    *n = c;
    return TQKV_OK;
}

typedef struct cache_entry {
    int device;
    uint32_t kind, dim, bits;
    uint64_t seed;
    float *d_data;
    struct cache_entry *next;
} cache_entry_t;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static cache_entry_t *cache_head;

/* Builds the host image of an entry: returns new (free()) floats in *out, count in *n. */
static tqkv_status_t
cache_build(uint32_t kind, uint32_t dim, uint32_t bits, uint64_t seed, float **out, size_t *n)
{
    tqkv_status_t st;
    float *buf;
    if (kind == TQKV__DC_CODEBOOK) {
        const tqkv_codebook_t *cb;
        if ((st = tqkv_codebook_get(dim, bits, &cb)) != TQKV_OK)
            return st;
        buf = (float *)calloc(32, sizeof *buf);
        if (!buf)
            return TQKV_ENOMEM;
        memcpy(buf, cb->z, sizeof cb->z);
        memcpy(buf + 16, cb->thr, sizeof cb->thr);
        *out = buf;
        *n = 32;
        return TQKV_OK;
    }
    const tqkv_rotation_t *r;
    uint32_t rk = kind == TQKV__DC_QJL ? (uint32_t)TQKV_ROT_QJL_GAUSS : kind;
    if ((st = tqkv_rotation_acquire(rk, dim, seed, &r)) != TQKV_OK)
        return st;
    size_t cnt = kind == TQKV__DC_HADAMARD ? 2 * (size_t)dim : (size_t)dim * dim;
    const float *src = kind == TQKV__DC_HADAMARD ? r->signs : r->matrix;
    buf = src ? (float *)malloc(cnt * sizeof *buf) : NULL;
    if (!buf) {
        tqkv_rotation_release(r);
        return src ? TQKV_ENOMEM : TQKV_EINTERNAL;
    }
    memcpy(buf, src, cnt * sizeof *buf);
    tqkv_rotation_release(r);
    *out = buf;
    *n = cnt;
    return TQKV_OK;
}

tqkv_status_t
tqkv__cuda_cache_get(uint32_t kind, uint32_t dim, uint32_t bits, uint64_t seed, const float **d_out)
{
    int dev = 0;
    tqkv_status_t st;
    cache_entry_t *e;
    float *host = NULL;
    size_t n = 0;

    if ((st = tqkv__cuda_status(cudaGetDevice(&dev), "cudaGetDevice")) != TQKV_OK)
        return st;
    if (kind != TQKV__DC_CODEBOOK)
        bits = 0;
    else
        seed = 0;
    pthread_mutex_lock(&cache_lock);
    for (e = cache_head; e; e = e->next)
        if (e->device == dev && e->kind == kind && e->dim == dim && e->bits == bits &&
            e->seed == seed) {
            *d_out = e->d_data;
            pthread_mutex_unlock(&cache_lock);
            return TQKV_OK;
        }
    if ((st = cache_build(kind, dim, bits, seed, &host, &n)) != TQKV_OK)
        goto fail_build;
    e = (cache_entry_t *)calloc(1, sizeof *e);
    if (!e) {
        st = TQKV_ENOMEM;
        goto fail_entry;
    }
    if ((st = tqkv__cuda_status(cudaMalloc((void **)&e->d_data, n * sizeof(float)),
                                "cudaMalloc(cache)")) != TQKV_OK)
        goto fail_malloc;
    if ((st = tqkv__cuda_status(
             cudaMemcpy(e->d_data, host, n * sizeof(float), cudaMemcpyHostToDevice),
             "cudaMemcpy(cache)")) != TQKV_OK)
        goto fail_copy;
    free(host);
    e->device = dev;
    e->kind = kind;
    e->dim = dim;
    e->bits = bits;
    e->seed = seed;
    e->next = cache_head;
    cache_head = e;
    *d_out = e->d_data;
    pthread_mutex_unlock(&cache_lock);
    return TQKV_OK;

fail_copy:
    cudaFree(e->d_data);
fail_malloc:
    free(e);
fail_entry:
    free(host);
fail_build:
    pthread_mutex_unlock(&cache_lock);
    return st;
}

tqkv_status_t
tqkv__cuda_group_codec(const tqkv_page_header_t *hdr, uint32_t tensor, uint32_t group,
                       tqkv_group_codec_t *G)
{
    const tqkv_page_tensor_desc_t *t = &hdr->tensor[tensor];
    tqkv_status_t st;
    uint32_t dim, bits;
    const float *p;

    if (tensor > 1 || group > 1 || t->bits_x2 == 0 || t->mode == TQKV_MODE_RAW ||
        (group == 1 && t->lo_bits == 0))
        return TQKV_EINVAL; /* a raw (lossless) tensor has no groups */
    dim = group == 0 ? t->n_hi : (uint32_t)hdr->head_dim - t->n_hi;
    bits = group == 0 ? t->hi_bits : t->lo_bits;
    memset(G, 0, sizeof *G);
    G->dim = dim;
    G->mode = t->mode;
    G->mse_bits = t->mode == TQKV_MODE_PROD ? bits - 1 : bits;
    G->n_centroids = G->mse_bits ? 1u << G->mse_bits : 0;
    G->rotation = tqkv_group_rotation(hdr->rotation, dim);
    G->norm_corrected = (t->flags & TQKV_TENSOR_NORM_CORRECTED) ? 1u : 0u;
    if (G->mse_bits) {
        if ((st = tqkv__cuda_cache_get(TQKV__DC_CODEBOOK, dim, G->mse_bits, 0, &p)) != TQKV_OK)
            return st;
        G->z = p;
        G->thr = p + 16;
        uint64_t rs = tqkv_seed_derive(hdr->seed, tensor, group, TQKV_SEED_ROTATION);
        if ((st = tqkv__cuda_cache_get(G->rotation, dim, 0, rs, &p)) != TQKV_OK)
            return st;
        if (G->rotation == TQKV_ROT_HADAMARD)
            G->signs = p;
        else
            G->matrix = p;
    }
    if (G->mode == TQKV_MODE_PROD) {
        uint64_t qs = tqkv_seed_derive(hdr->seed, tensor, group, TQKV_SEED_QJL);
        if ((st = tqkv__cuda_cache_get(TQKV__DC_QJL, dim, 0, qs, &p)) != TQKV_OK)
            return st;
        G->qjl = p;
    }
    return TQKV_OK;
}

extern "C" tqkv_status_t
tqkv_cuda_header_check(const tqkv_page_header_t *hdr)
{
    tqkv_page_header_t want;
    uint8_t bx2[2], mode[2], nc[2];
    if (!hdr)
        return TQKV_EINVAL;
    if (hdr->magic != TQKV_PAGE_MAGIC || hdr->version != TQKV_PAGE_VERSION ||
        hdr->header_bytes != TQKV_PAGE_HEADER_BYTES)
        return TQKV_EFORMAT;
    if (hdr->head_dim < TQKV_PAGE_MIN_DIM || hdr->head_dim > TQKV_PAGE_MAX_DIM ||
        hdr->num_kv_heads == 0 || hdr->num_kv_heads > TQKV_PAGE_MAX_HEADS || hdr->num_tokens == 0 ||
        hdr->num_tokens > TQKV_PAGE_MAX_TOKENS || hdr->rotation > TQKV_ROT_HADAMARD)
        return TQKV_EFORMAT;
    for (int t = 0; t < 2; t++) {
        const tqkv_page_tensor_desc_t *td = &hdr->tensor[t];
        bx2[t] = td->bits_x2;
        mode[t] = td->mode;
        nc[t] = (td->flags & TQKV_TENSOR_NORM_CORRECTED) ? 1 : 0;
        if (td->mode > TQKV_MODE_RAW || td->flags & ~TQKV_TENSOR_NORM_CORRECTED)
            return TQKV_EFORMAT;
    }
    if (!bx2[0] && !bx2[1])
        return TQKV_EFORMAT;
    if (tqkv_page_plan(hdr->num_tokens, hdr->num_kv_heads, hdr->head_dim, bx2, mode, nc,
                       hdr->rotation, (hdr->flags & TQKV_PAGE_KEY_CENTERED) != 0, hdr->seed,
                       &want) != 0)
        return TQKV_EFORMAT;
    want.crc32c = hdr->crc32c;
    if (memcmp(&want, hdr, sizeof want) != 0)
        return TQKV_EFORMAT;
    return TQKV_OK;
}
