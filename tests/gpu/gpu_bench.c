/* gpu_bench.c - tqkv-gpu-bench: GPU codec and attention throughput, side by side with
 * device-to-device cudaMemcpy measured in the same run.
 *
 *   tqkv-gpu-bench [--quick] [--blocks N] [--block-tokens N] [--max-context N] [--reps N]
 *
 * --quick: 16 blocks, contexts up to 32K. The other options shrink the run (the SIMT
 * emulator of tests/gpu runs it as a smoke test with tiny sizes).
 *
 * Tables: (1) encode/decode GB/s of BF16 (in for encode, out for decode) per codec, and
 * the HBM traffic of each as a fraction of the measured cudaMemcpy D2D traffic;
 * (2) decode attention of one query token (Llama-3.1-8B shape: 32 query heads, 8 KV
 * heads, d=128, pages of 256 tokens) over packed pages vs our BF16 flash-decoding
 * kernel at 4K..128K tokens. Times are medians of repeated runs timed with CUDA events.
 * Exit status 77 without a device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda.h"
#include "kernels/page.h"
#include "kernels/tq_math.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define ST(call)                                                                                   \
    do {                                                                                           \
        tqkv_status_t s_ = (call);                                                                 \
        if (s_ != TQKV_OK) {                                                                       \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, tqkv_strerror(s_));      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static int reps_override;

/* Median milliseconds of reps timed runs of fn(arg) (after one warm-up). */
static float
time_ms(void (*fn)(void *), void *arg, int reps)
{
    if (reps_override > 0)
        reps = reps_override;
    cudaEvent_t a, b;
    float t[64];
    if (reps > 64)
        reps = 64;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    fn(arg);
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < reps; r++) {
        CK(cudaEventRecord(a, 0));
        fn(arg);
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t[r], a, b));
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_float);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[reps / 2];
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void
fill_bf16(uint16_t *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double u1 = ((double)(tqkv_splitmix64(&rng) >> 11) + 0.5) / 9007199254740992.0;
        double u2 = ((double)(tqkv_splitmix64(&rng) >> 11) + 0.5) / 9007199254740992.0;
        x[i] = tqkv_f32_to_bf16((float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2)));
    }
}

/* ---- memcpy ---- */

typedef struct {
    void *dst, *src;
    size_t len;
} copy_arg_t;

static void
run_copy(void *p)
{
    copy_arg_t *a = p;
    CK(cudaMemcpyAsync(a->dst, a->src, a->len, cudaMemcpyDeviceToDevice, 0));
}

/* ---- codec ---- */

typedef struct {
    tqkv_block_shape_t shape;
    tqkv_block_codec_t codec;
    uint32_t nblocks;
    uint16_t *dk, *dv; /* [nblocks][T][H][D] */
    uint8_t *dpages;
    size_t page_bytes;
    tqkv_page_header_t hdr;
} codec_arg_t;

static void
run_encode(void *p)
{
    codec_arg_t *a = p;
    size_t blk = (size_t)a->shape.num_tokens * a->shape.num_kv_heads * a->shape.head_dim, w;
    ST(tqkv_cuda_page_encode_batch(&a->shape, &a->codec, a->nblocks, a->dk, a->dv, blk, a->dpages,
                                   a->page_bytes, &w, 0));
}

static void
run_decode(void *p)
{
    codec_arg_t *a = p;
    size_t blk = (size_t)a->shape.num_tokens * a->shape.num_kv_heads * a->shape.head_dim;
    ST(tqkv_cuda_page_decode_bf16_batch(&a->hdr, a->nblocks, a->dpages, a->page_bytes, a->dk, a->dv,
                                        blk, 0));
}

/* ---- attention ---- */

typedef struct {
    const tqkv_page_header_t *hdr;
    void **dptrs;
    uint32_t npages, HQ, H, D, T;
    float *dq, *dout;
    void *dwork;
    size_t work_bytes;
    uint16_t *dk, *dv;
} attn_arg_t;

static void
run_packed(void *p)
{
    attn_arg_t *a = p;
    ST(tqkv_cuda_attention_packed(a->hdr, (const void *const *)a->dptrs, a->npages, a->dq, a->HQ,
                                  0.0f, a->dout, a->dwork, a->work_bytes, 0));
}

static void
run_bf16(void *p)
{
    attn_arg_t *a = p;
    ST(tqkv_cuda_attention_bf16(a->dk, a->dv, a->T, a->H, a->D, a->dq, a->HQ, 0.0f, a->dout,
                                a->dwork, a->work_bytes, 0));
}

int
main(int argc, char **argv)
{
    int quick = 0, n = 0;
    uint32_t nblocks = 64, btok = 256, max_ctx = 131072;
    size_t copy_len = (size_t)1 << 30;
    struct cudaDeviceProp prop;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : "0";
        if (!strcmp(argv[i], "--quick")) {
            quick = 1;
            nblocks = 16;
            max_ctx = 32768;
        } else if (!strcmp(argv[i], "--blocks")) {
            nblocks = (uint32_t)strtoul(v, NULL, 0), i++;
        } else if (!strcmp(argv[i], "--block-tokens")) {
            btok = (uint32_t)strtoul(v, NULL, 0), i++;
        } else if (!strcmp(argv[i], "--max-context")) {
            max_ctx = (uint32_t)strtoul(v, NULL, 0), i++;
        } else if (!strcmp(argv[i], "--reps")) {
            reps_override = atoi(v), i++;
        } else {
            fprintf(stderr, "usage: tqkv-gpu-bench [--quick] [--blocks N] [--block-tokens N] "
                            "[--max-context N] [--reps N]\n");
            return 2;
        }
    }
    if (nblocks == 0 || nblocks > 65535 || btok == 0 || btok > 65536) {
        fprintf(stderr, "tqkv-gpu-bench: bad --blocks or --block-tokens\n");
        return 2;
    }
    if (max_ctx < 4096) /* tiny runs copy less too */
        copy_len = (size_t)1 << 20;
    if (tqkv_cuda_device_count(&n) != TQKV_OK || n == 0) {
        fprintf(stderr, "tqkv-gpu-bench: no CUDA device\n");
        return 77;
    }
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1 << 30));

    /* D2D memcpy: bytes read + written per second */
    copy_arg_t ca;
    ca.len = copy_len;
    CK(cudaMalloc(&ca.dst, ca.len));
    CK(cudaMalloc(&ca.src, ca.len));
    CK(cudaMemset(ca.src, 1, ca.len));
    float cms = time_ms(run_copy, &ca, 10);
    double memcpy_gbs = 2.0 * (double)ca.len / (cms * 1e-3) / 1e9;
    CK(cudaFree(ca.dst));
    CK(cudaFree(ca.src));
    printf("cudaMemcpy D2D: %.1f GB/s (read + write)\n\n", memcpy_gbs);

    /* codec table */
    static const struct {
        const char *name;
        uint8_t kb, vb, rot, ctr, km;
    } codecs[] = {
        {"3-bit mse hadamard", 6, 6, TQKV_ROT_HADAMARD, 0, 0},
        {"K3.5/V3 hadamard centered", 7, 6, TQKV_ROT_HADAMARD, 1, 0},
        {"K2.5/V2.5 hadamard", 5, 5, TQKV_ROT_HADAMARD, 0, 0},
        {"K4 prod/V3 hadamard", 8, 6, TQKV_ROT_HADAMARD, 0, 1},
        {"3-bit mse dense", 6, 6, TQKV_ROT_DENSE, 0, 0},
    };
    codec_arg_t a;
    memset(&a, 0, sizeof a);
    a.shape.num_tokens = btok;
    a.shape.num_kv_heads = 8;
    a.shape.head_dim = 128;
    a.nblocks = nblocks;
    size_t blk = (size_t)btok * 8 * 128;
    uint16_t *hk = malloc(blk * a.nblocks * 2);
    fill_bf16(hk, blk * a.nblocks);
    CK(cudaMalloc((void **)&a.dk, blk * a.nblocks * 2));
    CK(cudaMalloc((void **)&a.dv, blk * a.nblocks * 2));
    CK(cudaMemcpy(a.dk, hk, blk * a.nblocks * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(a.dv, hk, blk * a.nblocks * 2, cudaMemcpyHostToDevice));
    printf("codec (blocks of %u tok x 8 heads x d128, K+V, %u blocks per run)\n", btok, a.nblocks);
    printf("%-28s %7s %12s %12s %10s %10s\n", "codec", "ratio", "enc GB/s", "dec GB/s", "enc %cpy",
           "dec %cpy");
    for (size_t ci = 0; ci < sizeof codecs / sizeof codecs[0]; ci++) {
        memset(&a.codec, 0, sizeof a.codec);
        a.codec.k.bits_x2 = codecs[ci].kb;
        a.codec.v.bits_x2 = codecs[ci].vb;
        a.codec.k.mode = codecs[ci].km;
        a.codec.rotation = codecs[ci].rot;
        a.codec.key_centering = codecs[ci].ctr;
        a.codec.seed = 42;
        ST(tqkv_page_size(&a.shape, &a.codec, &a.page_bytes));
        CK(cudaMalloc((void **)&a.dpages, a.page_bytes * a.nblocks));
        run_encode(&a);
        CK(cudaMemcpy(&a.hdr, a.dpages, sizeof a.hdr, cudaMemcpyDeviceToHost));
        ST(tqkv_cuda_page_encode_status(a.dpages, 0));
        double bf16 = 2.0 * blk * 2 * a.nblocks, packed = (double)a.page_bytes * a.nblocks;
        float ems = time_ms(run_encode, &a, quick ? 3 : 5);
        float dms = time_ms(run_decode, &a, quick ? 3 : 5);
        double egbs = bf16 / (ems * 1e-3) / 1e9, dgbs = bf16 / (dms * 1e-3) / 1e9;
        double etraffic = (bf16 + packed) / (ems * 1e-3) / 1e9;
        double dtraffic = (bf16 + packed) / (dms * 1e-3) / 1e9;
        printf("%-28s %6.2fx %12.1f %12.1f %9.1f%% %9.1f%%\n", codecs[ci].name, bf16 / packed, egbs,
               dgbs, 100 * etraffic / memcpy_gbs, 100 * dtraffic / memcpy_gbs);
        CK(cudaFree(a.dpages));
        /* restore the inputs overwritten by decode */
        CK(cudaMemcpy(a.dk, hk, blk * a.nblocks * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(a.dv, hk, blk * a.nblocks * 2, cudaMemcpyHostToDevice));
    }
    CK(cudaFree(a.dk));
    CK(cudaFree(a.dv));
    free(hk);

    /* attention table */
    static const uint32_t ctx_all[] = {32, 4096, 16384, 32768, 65536, 131072};
    uint32_t ctx[6], nctx = 0;
    for (uint32_t i = 0; i < 6; i++) /* 32 only for tiny runs */
        if (ctx_all[i] <= max_ctx && (ctx_all[i] >= 4096 || max_ctx < 4096) &&
            ctx_all[i] % btok == 0)
            ctx[nctx++] = ctx_all[i];
    printf("\ndecode attention, 1 query token, 32 q heads / 8 kv heads, d128, pages of %u\n", btok);
    printf("%-8s %14s %14s %14s %12s\n", "tokens", "K3.5/V3.5 us", "bf16 us", "K3/V2.5 us",
           "bf16/K3.5");
    for (uint32_t xi = 0; xi < nctx; xi++) {
        attn_arg_t t;
        memset(&t, 0, sizeof t);
        t.T = ctx[xi];
        t.H = 8;
        t.HQ = 32;
        t.D = 128;
        t.npages = t.T / btok;
        size_t nt = (size_t)t.T * t.H * t.D;
        uint16_t *h = malloc(nt * 2);
        fill_bf16(h, nt);
        CK(cudaMalloc((void **)&t.dk, nt * 2));
        CK(cudaMalloc((void **)&t.dv, nt * 2));
        CK(cudaMemcpy(t.dk, h, nt * 2, cudaMemcpyHostToDevice));
        fill_bf16(h, nt);
        CK(cudaMemcpy(t.dv, h, nt * 2, cudaMemcpyHostToDevice));
        free(h);
        float *hq = malloc(sizeof(float) * t.HQ * t.D);
        for (uint32_t i = 0; i < t.HQ * t.D; i++)
            hq[i] = (float)((tqkv_splitmix64(&rng) >> 40) / 16777216.0 - 0.5);
        CK(cudaMalloc((void **)&t.dq, sizeof(float) * t.HQ * t.D));
        CK(cudaMalloc((void **)&t.dout, sizeof(float) * t.HQ * t.D));
        CK(cudaMemcpy(t.dq, hq, sizeof(float) * t.HQ * t.D, cudaMemcpyHostToDevice));
        free(hq);
        float us[3];
        for (int variant = 0; variant < 3; variant++) {
            tqkv_block_shape_t s = {btok, t.H, t.D};
            tqkv_block_codec_t c;
            memset(&c, 0, sizeof c);
            c.rotation = TQKV_ROT_HADAMARD;
            c.seed = 7;
            c.k.bits_x2 = variant == 2 ? 6 : 7;
            c.v.bits_x2 = variant == 2 ? 5 : 7;
            c.key_centering = 1;
            if (variant == 1) {
                uint32_t splits = tqkv_cuda_attention_bf16_splits(t.T, t.H);
                t.work_bytes = tqkv_cuda_attention_workspace(splits, t.HQ, t.D);
                CK(cudaMalloc(&t.dwork, t.work_bytes));
                us[1] = 1e3f * time_ms(run_bf16, &t, 20);
                CK(cudaFree(t.dwork));
                continue;
            }
            size_t pb, w;
            ST(tqkv_page_size(&s, &c, &pb));
            uint8_t *dp;
            CK(cudaMalloc((void **)&dp, pb * t.npages));
            void **ptrs = malloc(sizeof(void *) * t.npages);
            ST(tqkv_cuda_page_encode_batch(&s, &c, t.npages, t.dk, t.dv, (size_t)btok * t.H * t.D,
                                           dp, pb, &w, 0));
            for (uint32_t p = 0; p < t.npages; p++)
                ptrs[p] = dp + p * pb;
            ST(tqkv_cuda_page_encode_status(dp, 0));
            tqkv_page_header_t hdr;
            CK(cudaMemcpy(&hdr, dp, sizeof hdr, cudaMemcpyDeviceToHost));
            t.hdr = &hdr;
            CK(cudaMalloc((void **)&t.dptrs, sizeof(void *) * t.npages));
            CK(cudaMemcpy(t.dptrs, ptrs, sizeof(void *) * t.npages, cudaMemcpyHostToDevice));
            uint32_t splits = tqkv_cuda_attention_packed_splits(&hdr, t.npages);
            t.work_bytes = tqkv_cuda_attention_workspace(splits, t.HQ, t.D);
            CK(cudaMalloc(&t.dwork, t.work_bytes));
            us[variant] = 1e3f * time_ms(run_packed, &t, 20);
            CK(cudaFree(t.dwork));
            CK(cudaFree(t.dptrs));
            CK(cudaFree(dp));
            free(ptrs);
        }
        printf("%-8u %14.1f %14.1f %14.1f %11.2fx\n", t.T, us[0], us[1], us[2], us[1] / us[0]);
        CK(cudaFree(t.dk));
        CK(cudaFree(t.dv));
        CK(cudaFree(t.dq));
        CK(cudaFree(t.dout));
    }
    return 0;
}
