/* gpu_encode.c - Put's encode on the server's GPU (issue 7): with --device N, a BF16
 * block goes host -> device, is encoded by tqkv_cuda_page_encode (the same page bytes
 * as the CPU reference encoder) and the page comes back to the host for the store.
 *
 * Each encoder thread keeps its own device scratch (K, V, page), grown on demand and
 * freed when the thread exits, and issues everything on cudaStreamPerThread, so the
 * encoder threads neither serialize on the legacy stream nor wait for each other.
 *
 * Without CUDA in the build every call answers TQKV_EUNSUPPORTED, and the caller
 * encodes on the CPU. Any failure here is a reason to encode on the CPU instead,
 * never to fail the Put: the CPU encoder also writes the precise error message for
 * bad input (NaN/Inf), which the device can only flag.
 *
 * Left (issue 7): the page still travels device -> host -> HBM pool; encoding straight
 * into a slot of the device pool needs a store API that reserves the slot first.
 */
#include "service/gpu_encode.h"

#include <stdio.h>
#include <stdlib.h>

#ifdef TQKV_HAVE_CUDA
#include <pthread.h>

#include "kernels/cuda.h"

typedef struct scratch {
    int device;
    void *k, *v, *page;
    size_t k_cap, v_cap, page_cap;
} scratch_t;

static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void
scratch_free(void *p)
{
    scratch_t *s = p;
    if (s == NULL)
        return;
    if (cudaSetDevice(s->device) == cudaSuccess) {
        cudaFree(s->k);
        cudaFree(s->v);
        cudaFree(s->page);
    }
    free(s);
}

static void
key_init(void)
{
    (void)pthread_key_create(&g_key, scratch_free);
}

/* Makes *buf at least len bytes of device memory. */
static int
grow(void **buf, size_t *cap, size_t len)
{
    if (*cap >= len)
        return 0;
    cudaFree(*buf);
    *buf = NULL;
    *cap = 0;
    if (cudaMalloc(buf, len) != cudaSuccess) {
        *buf = NULL;
        return -1;
    }
    *cap = len;
    return 0;
}

static scratch_t *
thread_scratch(int device)
{
    pthread_once(&g_once, key_init);
    scratch_t *s = pthread_getspecific(g_key);
    if (s != NULL && s->device != device) {
        scratch_free(s); /* makes the old device current */
        s = NULL;
        (void)pthread_setspecific(g_key, NULL);
        if (cudaSetDevice(device) != cudaSuccess)
            return NULL;
    }
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL)
            return NULL;
        s->device = device;
        if (pthread_setspecific(g_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    return s;
}

tqkv_status_t
tqkv__gpu_encode(int device, const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                 const uint16_t *k, const uint16_t *v, void *page, size_t cap, size_t *written,
                 char *err, size_t errlen)
{
    cudaStream_t st = cudaStreamPerThread;
    size_t n = (size_t)shape->num_tokens * shape->num_kv_heads * shape->head_dim * 2;
    int has_k = codec->k.bits_x2 != 0, has_v = codec->v.bits_x2 != 0;
    tqkv_status_t rc;

    *written = 0;
    if (device < 0 || (has_k && k == NULL) || (has_v && v == NULL)) {
        snprintf(err, errlen, "gpu encode: bad arguments");
        return TQKV_EINVAL;
    }
    if (cudaSetDevice(device) != cudaSuccess) {
        snprintf(err, errlen, "gpu encode: device %d: %s", device,
                 cudaGetErrorString(cudaGetLastError()));
        return TQKV_ENODEV;
    }
    scratch_t *s = thread_scratch(device);
    if (s == NULL) {
        snprintf(err, errlen, "gpu encode: out of host memory");
        return TQKV_ENOMEM;
    }
    if ((has_k && grow(&s->k, &s->k_cap, n)) || (has_v && grow(&s->v, &s->v_cap, n)) ||
        grow(&s->page, &s->page_cap, cap)) {
        snprintf(err, errlen, "gpu encode: cudaMalloc: %s", cudaGetErrorString(cudaGetLastError()));
        return TQKV_ENOMEM;
    }
    if ((has_k && cudaMemcpyAsync(s->k, k, n, cudaMemcpyHostToDevice, st) != cudaSuccess) ||
        (has_v && cudaMemcpyAsync(s->v, v, n, cudaMemcpyHostToDevice, st) != cudaSuccess)) {
        snprintf(err, errlen, "gpu encode: copy in: %s", cudaGetErrorString(cudaGetLastError()));
        cudaStreamSynchronize(st);
        return TQKV_ECUDA;
    }
    size_t len = 0;
    rc = tqkv_cuda_page_encode(shape, codec, has_k ? s->k : NULL, has_v ? s->v : NULL, s->page, cap,
                               &len, st);
    if (rc != TQKV_OK) {
        snprintf(err, errlen, "gpu encode: %s", tqkv_strerror(rc));
        cudaStreamSynchronize(st);
        return rc;
    }
    if (cudaMemcpyAsync(page, s->page, len, cudaMemcpyDeviceToHost, st) != cudaSuccess) {
        snprintf(err, errlen, "gpu encode: copy out: %s", cudaGetErrorString(cudaGetLastError()));
        cudaStreamSynchronize(st);
        return TQKV_ECUDA;
    }
    /* Synchronizes the stream (so the copy out is complete) and reads the header the
     * device wrote: TQKV_ERANGE for NaN/Inf input. */
    rc = tqkv_cuda_page_encode_status(s->page, st);
    if (rc != TQKV_OK) {
        snprintf(err, errlen, "gpu encode: %s", tqkv_strerror(rc));
        return rc;
    }
    *written = len;
    return TQKV_OK;
}

int
tqkv__gpu_encode_available(int device)
{
    int n = 0;
    return device >= 0 && tqkv_cuda_device_count(&n) == TQKV_OK && device < n;
}

#else

tqkv_status_t
tqkv__gpu_encode(int device, const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                 const uint16_t *k, const uint16_t *v, void *page, size_t cap, size_t *written,
                 char *err, size_t errlen)
{
    (void)device, (void)shape, (void)codec, (void)k, (void)v, (void)page, (void)cap;
    *written = 0;
    snprintf(err, errlen, "gpu encode: this build has no CUDA");
    return TQKV_EUNSUPPORTED;
}

int
tqkv__gpu_encode_available(int device)
{
    (void)device;
    return 0;
}

#endif
