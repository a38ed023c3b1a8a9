/* encode.cu - BF16 block -> packed page on the device, and the page CRC32C.
 *
 * Work per page, all on the caller's stream:
 *   1. memset the page to 0 (padding and the OR-ed bit rows start at zero);
 *   2. stats_kernel, one block per (tensor, head): per-channel key mean (centering)
 *      and energy over the tokens (tqkv_channel_stats), outlier mask = channels of
 *      energy rank < n_hi (ties to the lower channel), header written by block 0;
 *   3. encode_kernel, one launch per (tensor, group), one thread per vector: gathers
 *      the group's channels (minus the key mean), runs tqkv_group_encode_vec with its
 *      work rows in shared memory and writes scale, gamma, index and sign rows (each
 *      row belongs to one thread: no atomics);
 *   4. crc_kernel, one block: per-thread raw CRC32C of a chunk (table in shared
 *      memory), then a tree of register shifts (tqkv_crc32c_shift); writes the CRC.
 * NaN/Inf input sets a flag in the header's crc32c field during step 3; step 4 then
 * writes magic 0 instead of a CRC.
 */
#include <string.h>

#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

/* Host-side plan of a page: header plus the group codecs. */
typedef struct enc_plan {
    tqkv_page_header_t hdr;
    tqkv_group_codec_t G[2][2];
    tqkv_group_layout_t L[2][2];
    int present[2][2];
} enc_plan_t;

static tqkv_status_t
plan_page(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec, enc_plan_t *P)
{
    uint8_t bx2[2] = {codec->k.bits_x2, codec->v.bits_x2};
    uint8_t mode[2] = {codec->k.mode, codec->v.mode};
    uint8_t nc[2] = {codec->k.norm_correction ? (uint8_t)1 : (uint8_t)0,
                     codec->v.norm_correction ? (uint8_t)1 : (uint8_t)0};
    tqkv_status_t st;

    if ((st = tqkv_page_check_params(shape, codec, NULL, 0)) != TQKV_OK)
        return st;
    memset(P, 0, sizeof *P);
    if (tqkv_page_plan(shape->num_tokens, shape->num_kv_heads, shape->head_dim, bx2, mode, nc,
                       codec->rotation, codec->key_centering ? 1u : 0u, codec->seed, &P->hdr) != 0)
        return TQKV_EUNSUPPORTED;
    uint64_t n = (uint64_t)shape->num_tokens * shape->num_kv_heads;
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t g = 0; g < 2; g++) {
            const tqkv_page_tensor_desc_t *td = &P->hdr.tensor[t];
            if (!td->bits_x2 || (g == 1 && !td->lo_bits))
                continue;
            if ((st = tqkv__cuda_group_codec(&P->hdr, t, g, &P->G[t][g])) != TQKV_OK)
                return st;
            tqkv_group_layout(P->G[t][g].dim, g == 0 ? td->hi_bits : td->lo_bits, td->mode, n,
                              &P->L[t][g]);
            P->present[t][g] = 1;
        }
    return TQKV_OK;
}

/* Step 2: grid (H, 2 tensors), blockDim >= D. */
static __global__ void
stats_kernel(tqkv_page_header_t hdr, const uint16_t *__restrict__ k, const uint16_t *__restrict__ v,
             uint8_t *__restrict__ page)
{
    extern __shared__ double shd[]; /* energy[D], then the block's max deviation */
    uint32_t h = blockIdx.x, t = blockIdx.y, D = hdr.head_dim, H = hdr.num_kv_heads;
    uint32_t T = hdr.num_tokens, c = threadIdx.x;
    const tqkv_page_tensor_desc_t *td = &hdr.tensor[t];
    const uint16_t *x = t == 0 ? k : v;
    int centered = t == 0 && (hdr.flags & TQKV_PAGE_KEY_CENTERED);
    double *energy = shd, *maxdev = shd + D;
    float mu = 0.0f;

    if (h == 0 && t == 0 && c < TQKV_PAGE_HEADER_BYTES / 4)
        ((uint32_t *)page)[c] = ((const uint32_t *)&hdr)[c];
    if (!td->bits_x2 || (!td->lo_bits && !centered))
        return;
    if (centered) {
        if (c == 0)
            *maxdev = 0;
        __syncthreads();
        double md = 0;
        if (c < D) {
            mu = tqkv_channel_mean(x, T, H, D, h, c);
            md = tqkv_channel_maxdev(x, T, H, D, h, c, mu);
        }
        /* max of non-negative doubles: order-free, via their bit patterns */
        atomicMax((unsigned long long *)maxdev, (unsigned long long)__double_as_longlong(md));
        __syncthreads();
        if (*maxdev > 0x1p126)
            mu = 0.0f;
        if (c < D)
            ((float *)(page + hdr.mean_offset))[(uint64_t)h * D + c] = mu;
    }
    if (!td->lo_bits)
        return;
    if (c < D)
        energy[c] = tqkv_channel_energy(x, T, H, D, h, c, mu);
    __syncthreads();
    uint32_t in_hi = c < D && tqkv_energy_rank(energy, D, c) < td->n_hi;
    /* each warp covers 32 channels = 4 mask bytes */
    uint32_t ballot = __ballot_sync(0xffffffffu, in_hi);
    uint32_t mrow = (D + 7) / 8;
    if ((c & 7u) == 0 && c < D)
        page[td->mask_offset + (uint64_t)h * mrow + c / 8] =
            (uint8_t)(ballot >> (c & 31u)) & (uint8_t)(D - c >= 8 ? 0xffu : (1u << (D - c)) - 1u);
}

/* Shared-memory row of one encode thread: x (g doubles) then 3g floats of work. */
static __host__ __device__ inline size_t
enc_row_floats(uint32_t g)
{
    return (5 * (size_t)g + 2) & ~(size_t)1;
}

/* Step 3: one thread per vector of group `grp` of tensor `ten`. */
static __global__ void
encode_kernel(tqkv_page_header_t hdr, tqkv_group_codec_t G, tqkv_group_layout_t L, uint32_t ten,
              uint32_t grp, const uint16_t *__restrict__ src, uint8_t *__restrict__ page)
{
    extern __shared__ double shd[];
    uint32_t D = hdr.head_dim, H = hdr.num_kv_heads, g = G.dim;
    uint64_t n = (uint64_t)hdr.num_tokens * H;
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const tqkv_page_tensor_desc_t *td = &hdr.tensor[ten];
    double *x = (double *)((float *)shd + (uint64_t)threadIdx.x * enc_row_floats(g));
    float *work = (float *)(x + g);
    uint8_t *base = page + td->group_offset[grp];
    int bad = 0;

    if (i >= n)
        return;
    uint32_t h = (uint32_t)(i % H);
    const uint16_t *row = src + i * D;
    const uint8_t *mask = td->lo_bits ? page + td->mask_offset + (uint64_t)h * ((D + 7) / 8) : 0;
    const float *mu = (ten == TQKV_TENSOR_K && (hdr.flags & TQKV_PAGE_KEY_CENTERED))
                          ? (const float *)(page + hdr.mean_offset) + (uint64_t)h * D
                          : 0;
    uint32_t j = 0;
    for (uint32_t c = 0; c < D && j < g; c++) {
        uint32_t hi = mask ? (mask[c >> 3] >> (c & 7u)) & 1u : 1u;
        if (hi != (grp == 0 ? 1u : 0u))
            continue;
        uint16_t b = row[c];
        bad |= tqkv_bf16_is_nonfinite(b);
        double f = (double)tqkv_bf16_to_f32(b);
        x[j++] = mu ? __dsub_rn(f, (double)mu[c]) : f;
    }
    for (uint32_t c = 0; c < D; c++) /* the flag covers channels of the other group too */
        bad |= tqkv_bf16_is_nonfinite(row[c]);
    if (bad) {
        atomicOr((unsigned int *)(page + 12), 1u);
        return;
    }
    float scale = 0.0f, gamma = 0.0f;
    uint8_t *idx_row = base + L.off_idx + i * L.idx_row_bytes;
    uint8_t *sign_row = L.sign_row_bytes ? base + L.off_signs + i * L.sign_row_bytes : 0;
    tqkv_group_encode_vec(&G, x, work, &scale, &gamma, idx_row, sign_row);
    ((float *)(base + L.off_scale))[i] = scale;
    if (G.mode == TQKV_MODE_PROD)
        ((float *)(base + L.off_gamma))[i] = gamma;
    if (i == 0 && G.n_centroids) /* the group's codebook copy */
        for (uint32_t m = 0; m < G.n_centroids; m++)
            ((float *)(base + L.off_codebook))[m] = G.z[m];
}

#define CRC_THREADS 1024

/* Step 4: one block of CRC_THREADS threads over page[0..bytes). */
static __global__ void
crc_kernel(uint8_t *page, uint32_t bytes)
{
    __shared__ uint32_t table[256];
    __shared__ uint32_t crc[CRC_THREADS];
    __shared__ uint32_t len[CRC_THREADS];
    uint32_t tid = threadIdx.x;
    uint32_t *hdr_crc = (uint32_t *)(page + 12);
    uint32_t flag = *hdr_crc; /* the NaN/Inf flag of encode_kernel */

    for (uint32_t b = tid; b < 256; b += blockDim.x)
        table[b] = tqkv_crc32c_raw_byte(0, (uint8_t)b);
    __syncthreads();
    if (flag) {
        if (tid == 0) {
            ((uint32_t *)page)[0] = 0; /* magic 0: rejected by every reader */
            *hdr_crc = 0;
        }
        return;
    }
    uint32_t chunk = (bytes + CRC_THREADS - 1) / CRC_THREADS;
    chunk = (chunk + 15u) & ~15u;
    uint32_t lo = tid * chunk < bytes ? tid * chunk : bytes;
    uint32_t hi = lo + chunk < bytes ? lo + chunk : bytes;
    uint32_t r = 0;
    for (uint32_t p = lo; p < hi; p += 16) { /* 16-byte aligned chunks of an aligned page */
        uint4 w = *(const uint4 *)(page + p);
        uint32_t ws[4] = {w.x, w.y, w.z, w.w};
        for (int q = 0; q < 4; q++)
            for (int s = 0; s < 4; s++)
                r = (r >> 8) ^ table[(r ^ (ws[q] >> (8 * s))) & 0xffu];
    }
    crc[tid] = r;
    len[tid] = hi - lo;
    for (uint32_t s = 1; s < CRC_THREADS; s <<= 1) {
        __syncthreads();
        if ((tid % (2 * s)) == 0 && tid + s < CRC_THREADS && len[tid + s]) {
            crc[tid] = tqkv_crc32c_shift(crc[tid], len[tid + s]) ^ crc[tid + s];
            len[tid] += len[tid + s];
        }
    }
    __syncthreads();
    if (tid == 0)
        *hdr_crc = ~(tqkv_crc32c_shift(0xffffffffu, bytes) ^ crc[0]);
}

static tqkv_status_t
launch_encode(const enc_plan_t *P, const uint16_t *d_k, const uint16_t *d_v, uint8_t *page,
              cudaStream_t stream)
{
    const tqkv_page_header_t *h = &P->hdr;
    uint32_t D = h->head_dim, H = h->num_kv_heads;
    uint64_t n = (uint64_t)h->num_tokens * H;
    tqkv_status_t st;

    if ((st = tqkv__cuda_status(cudaMemsetAsync(page, 0, h->page_bytes, stream),
                                "cudaMemsetAsync(page)")) != TQKV_OK)
        return st;
    uint32_t sthreads = (D + 31) / 32 * 32;
    stats_kernel<<<dim3(H, 2), sthreads, (D + 1) * sizeof(double), stream>>>(*h, d_k, d_v, page);
    TQKV__CUDA_LAUNCH_CHECK("stats_kernel");
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t g = 0; g < 2; g++) {
            if (!P->present[t][g])
                continue;
            uint32_t gd = P->G[t][g].dim;
            size_t row = enc_row_floats(gd) * sizeof(float);
            uint32_t threads = 64;
            while (threads > 1 && row * threads > 96 * 1024)
                threads >>= 1;
            size_t smem = row * threads;
            if (smem > 48 * 1024) {
                st = tqkv__cuda_status(
                    cudaFuncSetAttribute(encode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem),
                    "cudaFuncSetAttribute(encode)");
                if (st != TQKV_OK)
                    return st;
            }
            uint64_t blocks = (n + threads - 1) / threads;
            encode_kernel<<<(unsigned)blocks, threads, smem, stream>>>(
                *h, P->G[t][g], P->L[t][g], t, g, t == 0 ? d_k : d_v, page);
            TQKV__CUDA_LAUNCH_CHECK("encode_kernel");
        }
    crc_kernel<<<1, CRC_THREADS, 0, stream>>>(page, h->page_bytes);
    TQKV__CUDA_LAUNCH_CHECK("crc_kernel");
    return TQKV_OK;
}

extern "C" tqkv_status_t
tqkv_cuda_page_encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                      const uint16_t *d_k, const uint16_t *d_v, void *d_page, size_t cap,
                      size_t *written, cudaStream_t stream)
{
    enc_plan_t P;
    tqkv_status_t st;
    if (!shape || !codec || !d_page || !written)
        return TQKV_EINVAL;
    if ((codec->k.bits_x2 && !d_k) || (codec->v.bits_x2 && !d_v))
        return TQKV_EINVAL;
    if ((uintptr_t)d_page % 16)
        return TQKV_EINVAL;
    if ((st = plan_page(shape, codec, &P)) != TQKV_OK)
        return st;
    *written = P.hdr.page_bytes;
    if (cap < P.hdr.page_bytes)
        return TQKV_ENOSPC;
    return launch_encode(&P, d_k, d_v, (uint8_t *)d_page, stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_encode_status(const void *d_page, cudaStream_t stream)
{
    uint32_t magic = 0;
    tqkv_status_t st;
    if (!d_page)
        return TQKV_EINVAL;
    if ((st = tqkv__cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize")) != TQKV_OK)
        return st;
    if ((st = tqkv__cuda_status(cudaMemcpy(&magic, d_page, 4, cudaMemcpyDeviceToHost),
                                "cudaMemcpy(magic)")) != TQKV_OK)
        return st;
    return magic == TQKV_PAGE_MAGIC ? TQKV_OK : TQKV_ERANGE;
}
