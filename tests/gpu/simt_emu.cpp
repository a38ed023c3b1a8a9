// simt_emu.cpp - a small SIMT emulator and CUDA runtime stand-in, so the GPU test suite
// (check_gpu.c) runs the real kernels of kernels/*.cu on the CPU (check_gpu_emu).
//
// A launch runs its blocks one after the other on the calling thread. The threads of a
// block are ucontext coroutines: each runs until it reaches a barrier (__syncthreads,
// __syncwarp or a warp collective) or returns; the scheduler then releases a warp whose
// live lanes all wait at a warp barrier, or the block when all live threads wait at
// __syncthreads, and reports a deadlock otherwise (mismatched barriers are bugs on a GPU
// too). Dynamic shared memory is filled with a NaN pattern before each block so that
// reads of unwritten shared memory show up in results, and threads run in a random
// order in every pass so that a missing barrier shows up too. "Device" memory is host memory;
// copies are memmove and streams are synchronous.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucontext.h>

#include <functional>
#include <map>
#include <vector>

#include <cuda_runtime.h>

#include "tests/gpu/simt_emu.h"

struct CUevent_st {
    double ms; /* wall clock at cudaEventRecord */
};

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace
{

enum emu_state { EMU_READY, EMU_AT_BLOCK, EMU_AT_WARP, EMU_DONE };

struct emu_thread {
    ucontext_t ctx;
    emu_state state;
    uint3 idx;
};

const size_t STACK_BYTES = 64 * 1024;

ucontext_t sched_ctx;
std::vector<emu_thread> threads;
char *stacks; // n * STACK_BYTES, malloc'd: pages are touched only as stacks grow
size_t stacks_threads;
std::vector<uint64_t> xbuf; // [warps][32] values of warp exchanges
std::vector<unsigned char> dyn_smem;
size_t cur;
const std::function<void()> *cur_body;
std::vector<size_t> order;
std::map<const void *, int> max_dyn_smem; // cudaFuncAttributeMaxDynamicSharedMemorySize
uint64_t order_rng = 0x5eed5eed12345678ull;

void
yield_as(emu_state st)
{
    threads[cur].state = st;
    swapcontext(&threads[cur].ctx, &sched_ctx);
}

void
trampoline()
{
    (*cur_body)();
    threads[cur].state = EMU_DONE; // uc_link returns to the scheduler
}

// Releases waiting threads; returns 1 when some became ready.
int
release(size_t n)
{
    int any = 0;
    size_t live = 0, at_block = 0;
    for (size_t w = 0; w * 32 < n; w++) {
        size_t lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, waiting = 0, alive = 0;
        for (size_t t = lo; t < hi; t++) {
            if (threads[t].state == EMU_DONE)
                continue;
            alive++;
            waiting += threads[t].state == EMU_AT_WARP;
        }
        if (alive && waiting == alive) {
            for (size_t t = lo; t < hi; t++)
                if (threads[t].state == EMU_AT_WARP)
                    threads[t].state = EMU_READY;
            any = 1;
        }
    }
    if (any)
        return 1;
    for (size_t t = 0; t < n; t++) {
        if (threads[t].state == EMU_DONE)
            continue;
        live++;
        at_block += threads[t].state == EMU_AT_BLOCK;
    }
    if (live && at_block == live) {
        for (size_t t = 0; t < n; t++)
            if (threads[t].state == EMU_AT_BLOCK)
                threads[t].state = EMU_READY;
        return 1;
    }
    return 0;
}

void
run_block(size_t n, const std::function<void()> &body, size_t smem)
{
    cur_body = &body;
    memset(dyn_smem.data(), 0xff, smem); // NaN pattern for floats and doubles
    for (size_t t = 0; t < n; t++) {
        emu_thread &th = threads[t];
        getcontext(&th.ctx);
        th.ctx.uc_stack.ss_sp = stacks + t * STACK_BYTES;
        th.ctx.uc_stack.ss_size = STACK_BYTES;
        th.ctx.uc_link = &sched_ctx;
        makecontext(&th.ctx, trampoline, 0);
        th.state = EMU_READY;
        th.idx.x = (unsigned)(t % blockDim.x);
        th.idx.y = (unsigned)(t / blockDim.x % blockDim.y);
        th.idx.z = (unsigned)(t / ((size_t)blockDim.x * blockDim.y));
    }
    order.resize(n);
    for (size_t t = 0; t < n; t++)
        order[t] = t;
    for (;;) {
        int ran = 0;
        /* a fresh random order each pass: a read of another thread's write that lacks a
         * barrier sees stale data (or the NaN pattern) in about half of the passes */
        for (size_t t = n; t > 1; t--) {
            order_rng = order_rng * 6364136223846793005ull + 1442695040888963407ull;
            size_t k = (size_t)(order_rng >> 33) % t, tmp = order[t - 1];
            order[t - 1] = order[k];
            order[k] = tmp;
        }
        for (size_t oi = 0; oi < n; oi++) {
            size_t t = order[oi];
            if (threads[t].state != EMU_READY)
                continue;
            cur = t;
            threadIdx = threads[t].idx;
            swapcontext(&sched_ctx, &threads[t].ctx);
            ran = 1;
        }
        size_t done = 0;
        for (size_t t = 0; t < n; t++)
            done += threads[t].state == EMU_DONE;
        if (done == n)
            return;
        if (!release(n) && !ran) {
            fprintf(stderr, "simt_emu: deadlock in block (%u,%u,%u)\n", blockIdx.x, blockIdx.y,
                    blockIdx.z);
            abort();
        }
    }
}

} // namespace

void
tqkv_emu_syncthreads(void)
{
    yield_as(EMU_AT_BLOCK);
}

void
tqkv_emu_syncwarp(void)
{
    yield_as(EMU_AT_WARP);
}

void
tqkv_emu_warp_exchange(uint64_t v, uint64_t out[32])
{
    size_t w = cur / 32;
    xbuf[w * 32 + cur % 32] = v;
    yield_as(EMU_AT_WARP);
    memcpy(out, &xbuf[w * 32], 32 * sizeof(uint64_t));
    yield_as(EMU_AT_WARP); // nobody overwrites xbuf before every lane has read it
}

void *
tqkv_emu_dyn_smem(void)
{
    return dyn_smem.data();
}

void
tqkv_emu_launch(const void *kernel, dim3 grid, dim3 block, size_t smem, std::function<void()> body)
{
    size_t n = (size_t)block.x * block.y * block.z;
    size_t allowed = 48 * 1024;
    auto it = max_dyn_smem.find(kernel);
    if (it != max_dyn_smem.end() && (size_t)it->second > allowed)
        allowed = (size_t)it->second;
    if (n == 0 || n > 1024 || smem > allowed || !grid.x || !grid.y || !grid.z || grid.y > 65535 ||
        grid.z > 65535) {
        fprintf(stderr,
                "simt_emu: launch would fail: %zu threads, grid %u x %u x %u, %zu bytes of "
                "dynamic shared memory (%zu allowed)\n",
                n, grid.x, grid.y, grid.z, smem, allowed);
        abort();
    }
    threads.assign(n, emu_thread());
    if (stacks_threads < n) {
        free(stacks);
        stacks = (char *)malloc(n * STACK_BYTES);
        if (!stacks) {
            fprintf(stderr, "simt_emu: no memory for %zu thread stacks\n", n);
            abort();
        }
        stacks_threads = n;
    }
    xbuf.assign((n + 31) / 32 * 32, 0);
    if (dyn_smem.size() < smem + 16)
        dyn_smem.resize(smem + 16);
    blockDim = block;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx.x = x;
                blockIdx.y = y;
                blockIdx.z = z;
                run_block(n, body, smem);
            }
}

// ---- the CUDA runtime calls the kernels, the pool and the tests make ----

extern "C" {

cudaError_t
cudaGetDeviceCount(int *count)
{
    *count = 1;
    return cudaSuccess;
}

cudaError_t
cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t
cudaGetDevice(int *device)
{
    *device = 0;
    return cudaSuccess;
}

cudaError_t
cudaMalloc(void **p, size_t size)
{
    *p = aligned_alloc(256, (size + 255) / 256 * 256 + 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t
cudaFree(void *p)
{
    free(p);
    return cudaSuccess;
}

cudaError_t
cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    (void)kind;
    if (count)
        memmove(dst, src, count);
    return cudaSuccess;
}

cudaError_t
cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                cudaStream_t stream)
{
    (void)stream;
    return cudaMemcpy(dst, src, count, kind);
}

cudaError_t
cudaMemset(void *p, int value, size_t count)
{
    memset(p, value, count);
    return cudaSuccess;
}

cudaError_t
cudaMemsetAsync(void *p, int value, size_t count, cudaStream_t stream)
{
    (void)stream;
    return cudaMemset(p, value, count);
}

cudaError_t
cudaStreamSynchronize(cudaStream_t stream)
{
    (void)stream;
    return cudaSuccess;
}

cudaError_t
cudaDeviceSynchronize(void)
{
    return cudaSuccess;
}

cudaError_t
cudaGetLastError(void)
{
    return cudaSuccess;
}

const char *
cudaGetErrorString(cudaError_t error)
{
    return error == cudaSuccess ? "no error" : "emulated CUDA error";
}

cudaError_t
cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value)
{
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || value > 227 * 1024)
            return cudaErrorInvalidValue;
        max_dyn_smem[func] = value;
    }
    return cudaSuccess;
}

cudaError_t
cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device != 0)
        return cudaErrorInvalidDevice;
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "SIMT emulator (CPU)");
    prop->multiProcessorCount = 1;
    prop->totalGlobalMem = (size_t)1 << 30;
    prop->warpSize = 32;
    return cudaSuccess;
}

cudaError_t
cudaEventCreate(cudaEvent_t *event)
{
    *event = (cudaEvent_t)calloc(1, sizeof(struct CUevent_st));
    return *event ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t
cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    struct timespec ts;
    (void)stream;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    event->ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    return cudaSuccess;
}

cudaError_t
cudaEventSynchronize(cudaEvent_t event)
{
    (void)event;
    return cudaSuccess;
}

cudaError_t
cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    *ms = (float)(end->ms - start->ms);
    return cudaSuccess;
}

cudaError_t
cudaEventDestroy(cudaEvent_t event)
{
    free(event);
    return cudaSuccess;
}

} // extern "C"
