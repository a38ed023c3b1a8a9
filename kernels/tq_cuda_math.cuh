/* tq_cuda_math.cuh - what the CUDA files of kernels/ share: status mapping, the
 * device cache of rotations and codebooks, group codec resolution, and small device
 * helpers (parallel FWHT, warp reductions). Included only by kernels/*.cu.
 *
 * The tests also build the .cu files as host C++ on a SIMT emulator (tests/gpu.cmake
 * force-includes tests/gpu/simt_emu.h there); nothing here refers to the tests.
 *
 * The device cache (cuda_common.cu) maps (device, kind, dim, bits, seed) to device
 * memory uploaded once and kept for the life of the process; a mutex protects the
 * table, and the upload of a new entry happens under it (rare, synchronous).
 */
#ifndef TQKV_KERNELS_TQ_CUDA_MATH_CUH
#define TQKV_KERNELS_TQ_CUDA_MATH_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda.h"
#include "kernels/page_format.h"
#include "kernels/tq_math.h"

/* Kinds of device cache entries (rotation kinds 0..2 are those of rotation.h). */
enum {
    TQKV__DC_DENSE = 0,    /* Pi [g][g] */
    TQKV__DC_HADAMARD = 1, /* D1[g] then D2[g] */
    TQKV__DC_QJL = 2,      /* S [g][g] */
    TQKV__DC_CODEBOOK = 3, /* z[16] then thr[16] for (g, bits) */
};

/* Maps a CUDA error to a status, printing what failed (nothing on success). */
tqkv_status_t tqkv__cuda_status(cudaError_t e, const char *what);

/* Device pointer to the cached entry (kind, dim, bits, seed) on the current device;
 * uploads it on first use. Borrowed for the life of the process. */
tqkv_status_t tqkv__cuda_cache_get(uint32_t kind, uint32_t dim, uint32_t bits, uint64_t seed,
                                   const float **d_out);

/* Fills *G (device pointers) for group `group` of tensor `tensor` of a page whose
 * header is hdr (host). Returns TQKV_EINVAL when the group is absent. */
tqkv_status_t tqkv__cuda_group_codec(const tqkv_page_header_t *hdr, uint32_t tensor, uint32_t group,
                                     tqkv_group_codec_t *G);

/* kernel<<<grid, block, smem, stream>>>(args...), and the block's dynamic shared
 * memory as `type name[]`; the emulator of tests/gpu redefines both. */
#ifndef TQKV_SIMT_EMU
#define TQKV_LAUNCH(kernel, grid, block, smem, stream, ...)                                        \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define TQKV_DYN_SMEM(type, name) extern __shared__ type name[]
#endif

#define TQKV__CUDA_LAUNCH_CHECK(what)                                                              \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess)                                                                     \
            return tqkv__cuda_status(e_, what);                                                    \
    } while (0)

/* In-place FWHT of x[0..n) in shared memory by the whole block (same butterflies,
 * hence the same results, as tqkv_fwht). Ends with __syncthreads(). */
static __device__ inline void
tqkv__block_fwht(float *x, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1) {
        __syncthreads();
        for (uint32_t k = threadIdx.x; k < n / 2; k += blockDim.x) {
            uint32_t i = (k / h) * 2 * h + (k % h);
            float a = x[i], c = x[i + h];
            x[i] = __fadd_rn(a, c);
            x[i + h] = __fsub_rn(a, c);
        }
    }
    __syncthreads();
}

/* In-place FWHT of x[0..n) in shared memory by the 32 lanes of one warp (lane: this
 * thread's lane; same butterflies as tqkv_fwht). Ends with __syncwarp(). */
static __device__ inline void
tqkv__warp_fwht(float *x, uint32_t n, uint32_t lane)
{
    for (uint32_t h = 1; h < n; h <<= 1) {
        __syncwarp();
        for (uint32_t k = lane; k < n / 2; k += 32) {
            uint32_t i = (k / h) * 2 * h + (k % h);
            float a = x[i], c = x[i + h];
            x[i] = __fadd_rn(a, c);
            x[i + h] = __fsub_rn(a, c);
        }
    }
    __syncwarp();
}

static __device__ inline float
tqkv__warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ inline float
tqkv__warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#endif
