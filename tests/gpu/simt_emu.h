/* simt_emu.h - what the CUDA kernels of kernels/ need to build as host C++ for the SIMT
 * emulator (simt_emu.cpp): thread/block indices, barriers, warp collectives, rounding
 * intrinsics, atomics and the launch macro. Force-included (tests/gpu.cmake: -include)
 * into the host builds of kernels/*.cu (gpu/emu_*.cpp), after <cuda_runtime.h>, which it
 * includes first (its host build already turns __global__, __device__ and __host__ into
 * nothing).
 *
 * Every thread of a block is a coroutine; blocks run one after the other on the calling
 * OS thread, so block-shared memory is plain static storage and atomics are plain
 * read-modify-writes. Barriers and warp collectives switch coroutines; a collective
 * waits for all 32 lanes of its warp (the kernels use full masks only).
 */
#ifndef TQKV_TESTS_GPU_SIMT_EMU_H
#define TQKV_TESTS_GPU_SIMT_EMU_H

#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>

#undef __shared__
#define __shared__ static /* one block at a time: statics are the block's shared memory */
#undef __launch_bounds__
#define __launch_bounds__(...)

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

/* Scheduler entry points (simt_emu.cpp). */
void tqkv_emu_syncthreads(void);
void tqkv_emu_syncwarp(void);
/* Deposits v for this lane, waits for the warp, returns the 32 lanes' values in out. */
void tqkv_emu_warp_exchange(uint64_t v, uint64_t out[32]);
void *tqkv_emu_dyn_smem(void);
/* Runs body for every thread of the grid. Aborts, as the launch would fail on the
 * device, for more than 48 KiB of dynamic shared memory without a matching
 * cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize) or beyond
 * the sm_90 limits (1024 threads, 227 KiB, grid y/z 65535). */
void tqkv_emu_launch(const void *kernel, dim3 grid, dim3 block, size_t smem,
                     std::function<void()> body);

#define TQKV_LAUNCH(kernel, grid, block, smem, stream, ...)                                        \
    tqkv_emu_launch((const void *)(kernel), dim3(grid), dim3(block), (smem),                       \
                    [=]() { kernel(__VA_ARGS__); })
#define TQKV_DYN_SMEM(type, name) type *name = (type *)tqkv_emu_dyn_smem()

/* cuda_runtime.h declares this overload for nvcc only. */
template <class T>
static inline cudaError_t
cudaFuncSetAttribute(T *entry, enum cudaFuncAttribute attr, int value)
{
    return ::cudaFuncSetAttribute((const void *)entry, attr, value);
}

static inline void
__syncthreads(void)
{
    tqkv_emu_syncthreads();
}

static inline void
__syncwarp(unsigned mask = 0xffffffffu)
{
    (void)mask;
    tqkv_emu_syncwarp();
}

static inline uint64_t
emu_bits_of_f(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline uint64_t
emu_bits_of_d(double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

static inline unsigned
__ballot_sync(unsigned mask, int pred)
{
    uint64_t all[32];
    unsigned r = 0;
    (void)mask;
    tqkv_emu_warp_exchange(pred != 0, all);
    for (int l = 0; l < 32; l++)
        r |= (all[l] ? 1u : 0u) << l;
    return r;
}

static inline int
__any_sync(unsigned mask, int pred)
{
    return __ballot_sync(mask, pred) != 0;
}

static inline float
__shfl_sync(unsigned mask, float v, int src)
{
    uint64_t all[32];
    (void)mask;
    tqkv_emu_warp_exchange(emu_bits_of_f(v), all);
    uint32_t u = (uint32_t)all[src & 31];
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double
__shfl_sync(unsigned mask, double v, int src)
{
    uint64_t all[32];
    (void)mask;
    tqkv_emu_warp_exchange(emu_bits_of_d(v), all);
    double d;
    memcpy(&d, &all[src & 31], 8);
    return d;
}

static inline float
__shfl_xor_sync(unsigned mask, float v, int x)
{
    uint64_t all[32];
    (void)mask;
    tqkv_emu_warp_exchange(emu_bits_of_f(v), all);
    uint32_t u = (uint32_t)all[(threadIdx.x & 31u) ^ (unsigned)x];
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int
__popc(unsigned x)
{
    return __builtin_popcount(x);
}

static inline unsigned
min(unsigned a, unsigned b)
{
    return a < b ? a : b;
}

static inline float
__fadd_rn(float a, float b)
{
    return a + b;
}
static inline float
__fsub_rn(float a, float b)
{
    return a - b;
}
static inline float
__fmul_rn(float a, float b)
{
    return a * b;
}
static inline double
__dadd_rn(double a, double b)
{
    return a + b;
}
static inline double
__dsub_rn(double a, double b)
{
    return a - b;
}
static inline double
__dmul_rn(double a, double b)
{
    return a * b;
}
static inline float
tqkv_emu_expf(float x)
{
    return expf(x);
}
#define __expf tqkv_emu_expf /* glibc declares its own __expf */
static inline float
__uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline long long
__double_as_longlong(double d)
{
    long long v;
    memcpy(&v, &d, 8);
    return v;
}
static inline unsigned
atomicOr(unsigned *p, unsigned v)
{
    unsigned old = *p;
    *p = old | v;
    return old;
}
static inline unsigned long long
atomicAdd(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = *p;
    *p = old + v;
    return old;
}
static inline unsigned long long
atomicMax(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = *p;
    *p = old > v ? old : v;
    return old;
}

#endif
