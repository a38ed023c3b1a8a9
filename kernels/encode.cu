/* encode.cu - BF16 blocks -> packed pages on the device, and the page CRC32C.
 *
 * Work per batch of blocks (same shape and codec), all on the caller's stream:
 *   1. memset the pages to 0 (padding and the bit rows start at zero);
 *   2. stats_kernel, one thread block per (head, tensor, page): per-channel key mean
 *      (centering; kept only where it lowers the head's relative energy, tq_math.h
 *      tqkv_center_keep) and energy over the tokens (tq_math.h tqkv_channel_*), the outlier
 *      mask = channels of energy rank < n_hi (ties to the lower channel); the header;
 *   3. encode_kernel, one launch per (tensor, group), one warp per vector: the warp
 *      runs the operations of tqkv_group_encode_vec (tq_math.h) in the same order and
 *      rounding: element-wise steps, FWHT butterflies and matrix rows spread over the
 *      lanes, the three f64 sums (||x||^2, ||z[idx]||^2, ||r||^2) on lane 0 in index
 *      order. Index and sign bytes are assembled per byte by one lane each from the
 *      fields in shared memory (no atomics);
 *   4. crc_kernel, one thread block per page: per-thread raw CRC32C of a chunk (table
 *      in shared memory), then a tree of register shifts (tqkv_crc32c_shift).
 * NaN/Inf input sets a flag in the page's crc32c field during step 3; step 4 then
 * writes magic 0 instead of a CRC (tqkv_cuda_page_encode_status reports TQKV_ERANGE).
 */
#include <string.h>

#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

#define ENC_WARPS 4 /* vectors (warps) per thread block */

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
    if (codec->k.mode == TQKV_MODE_RAW || codec->v.mode == TQKV_MODE_RAW)
        return TQKV_EUNSUPPORTED; /* lossless pages are a copy: the CPU encoder writes them */
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

/* Step 2: grid (H, 2 tensors, pages), blockDim = D rounded up to a warp. */
static __global__ void
stats_kernel(tqkv_page_header_t hdr, const uint16_t *__restrict__ k, const uint16_t *__restrict__ v,
             size_t in_stride, uint8_t *__restrict__ pages, size_t page_stride)
{
    /* energy[D], the block's max deviation, the centering votes and non-zero tokens (two
     * u64), then the head's mean f32[D] */
    TQKV_DYN_SMEM(double, shd);
    uint32_t h = blockIdx.x, t = blockIdx.y, D = hdr.head_dim, H = hdr.num_kv_heads;
    uint32_t T = hdr.num_tokens, c = threadIdx.x;
    const tqkv_page_tensor_desc_t *td = &hdr.tensor[t];
    const uint16_t *x = (t == 0 ? k : v) + blockIdx.z * in_stride;
    uint8_t *page = pages + blockIdx.z * page_stride;
    int centered = t == 0 && (hdr.flags & TQKV_PAGE_KEY_CENTERED);
    double *energy = shd, *maxdev = shd + D;
    float mu = 0.0f;

    if (h == 0 && t == 0 && c < TQKV_PAGE_HEADER_BYTES / 4)
        ((uint32_t *)page)[c] = ((const uint32_t *)&hdr)[c];
    if (!td->bits_x2 || (!td->lo_bits && !centered))
        return;
    if (centered) {
        unsigned long long *votes = (unsigned long long *)(shd + D + 1), *nonzero = votes + 1;
        float *mus = (float *)(shd + D + 3);
        if (c == 0) {
            *maxdev = 0;
            *votes = 0;
            *nonzero = 0;
        }
        __syncthreads();
        double md = 0;
        if (c < D) {
            mu = tqkv_channel_mean(x, T, H, D, h, c);
            md = tqkv_channel_maxdev(x, T, H, D, h, c, mu);
        }
        /* max of non-negative doubles: order-free, through their bit patterns */
        atomicMax((unsigned long long *)maxdev, (unsigned long long)__double_as_longlong(md));
        __syncthreads();
        if (*maxdev > 0x1p126)
            mu = 0.0f;
        if (c < D)
            mus[c] = mu;
        __syncthreads();
        /* the centering decision (tq_math.h tqkv_center_keep): tokens spread over the
         * threads; the votes are integers, so their sum does not depend on the order */
        unsigned long long v = 0, nz = 0;
        for (uint32_t tok = c; tok < T; tok += blockDim.x) {
            double ep, ec;
            tqkv_token_center_energy(x + (uint64_t)tok * H * D + (uint64_t)h * D, mus, D, &ep, &ec);
            v += tqkv_center_vote(ep, ec);
            nz += ep > 0;
        }
        atomicAdd(votes, v);
        atomicAdd(nonzero, nz);
        __syncthreads();
        if (!tqkv_center_keep(*votes, *nonzero))
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
        page[td->mask_offset + (uint64_t)h * mrow + c / 8] = (uint8_t)(ballot >> (c & 31u));
}

/* Shared memory of one encode warp, in floats: x (g doubles), u, y, a (g floats each),
 * then g bytes of indices (as floats). Even, so the next warp's doubles stay aligned. */
static __host__ __device__ inline size_t
enc_warp_floats(uint32_t g)
{
    return ((5 * (size_t)g + (g + 3) / 4) + 1) & ~(size_t)1;
}

/* out = Pi in, as tqkv_group_rotate (rows of a dense Pi over the lanes). */
static __device__ inline void
warp_rotate(const tqkv_group_codec_t &G, const float *in, float *out, uint32_t lane)
{
    uint32_t g = G.dim;
    if (G.rotation == TQKV_ROT_HADAMARD) {
        float inv = 1.0f / (float)g;
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = __fmul_rn(in[j], G.signs[j]);
        tqkv__warp_fwht(out, g, lane);
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = __fmul_rn(out[j], G.signs[g + j]);
        tqkv__warp_fwht(out, g, lane);
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = __fmul_rn(out[j], inv);
    } else {
        for (uint32_t i = lane; i < g; i += 32) {
            const float *row = G.matrix + (size_t)i * g;
            float s = 0.0f;
            for (uint32_t j = 0; j < g; j++)
                s = __fadd_rn(s, __fmul_rn(row[j], in[j]));
            out[i] = s;
        }
    }
    __syncwarp();
}

/* out = Pi^T in, as tqkv_group_rotate_t (columns of a dense Pi over the lanes). */
static __device__ inline void
warp_rotate_t(const tqkv_group_codec_t &G, const float *in, float *out, uint32_t lane)
{
    uint32_t g = G.dim;
    if (G.rotation == TQKV_ROT_HADAMARD) {
        float inv = 1.0f / (float)g;
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = in[j];
        tqkv__warp_fwht(out, g, lane);
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = __fmul_rn(out[j], G.signs[g + j]);
        tqkv__warp_fwht(out, g, lane);
        for (uint32_t j = lane; j < g; j += 32)
            out[j] = __fmul_rn(out[j], __fmul_rn(G.signs[j], inv));
    } else {
        for (uint32_t j = lane; j < g; j += 32) {
            float s = 0.0f;
            for (uint32_t i = 0; i < g; i++)
                s = __fadd_rn(s, __fmul_rn(G.matrix[(size_t)i * g + j], in[i]));
            out[j] = s;
        }
    }
    __syncwarp();
}

/* y = M x for a row-major g x g matrix, rows over the lanes (as tqkv_matvec). */
static __device__ inline void
warp_matvec(const float *__restrict__ M, const float *x, float *y, uint32_t g, uint32_t lane)
{
    for (uint32_t i = lane; i < g; i += 32) {
        const float *row = M + (size_t)i * g;
        float s = 0.0f;
        for (uint32_t j = 0; j < g; j++)
            s = __fadd_rn(s, __fmul_rn(row[j], x[j]));
        y[i] = s;
    }
    __syncwarp();
}

/* Step 3: grid (ceil(n / ENC_WARPS), pages), ENC_WARPS warps; warp w encodes vector
 * blockIdx.x * ENC_WARPS + w of group `grp` of tensor `ten`. */
static __global__ void
__launch_bounds__(ENC_WARPS * 32)
    encode_kernel(tqkv_page_header_t hdr, tqkv_group_codec_t G, tqkv_group_layout_t L, uint32_t ten,
                  uint32_t grp, const uint16_t *__restrict__ src_all, size_t in_stride,
                  uint8_t *__restrict__ pages, size_t page_stride)
{
    TQKV_DYN_SMEM(double, shd);
    const uint32_t D = hdr.head_dim, H = hdr.num_kv_heads, g = G.dim, b = G.mse_bits;
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const uint64_t n = (uint64_t)hdr.num_tokens * H;
    const uint64_t i = (uint64_t)blockIdx.x * ENC_WARPS + warp;
    const tqkv_page_tensor_desc_t *td = &hdr.tensor[ten];
    uint8_t *page = pages + blockIdx.y * page_stride;
    const uint16_t *src = src_all + blockIdx.y * in_stride;
    double *x = (double *)((float *)shd + warp * enc_warp_floats(g));
    float *u = (float *)(x + g), *y = u + g, *a = y + g;
    uint8_t *kidx = (uint8_t *)(a + g);
    uint8_t *base = page + td->group_offset[grp];
    const float sqrt_g = sqrtf((float)g);

    if (i >= n)
        return;
    const uint32_t h = (uint32_t)(i % H);
    const uint16_t *row = src + i * D;
    const uint8_t *mask = td->lo_bits ? page + td->mask_offset + (uint64_t)h * ((D + 7) / 8) : 0;
    const float *mu = (ten == TQKV_TENSOR_K && (hdr.flags & TQKV_PAGE_KEY_CENTERED))
                          ? (const float *)(page + hdr.mean_offset) + (uint64_t)h * D
                          : 0;
    /* gather: channel c of the group goes to x[j], j = group channels below c */
    uint32_t jbase = 0, bad = 0;
    for (uint32_t c0 = 0; c0 < D; c0 += 32) {
        uint32_t c = c0 + lane, mine = 0;
        uint16_t bv = 0;
        if (c < D) {
            uint32_t hi = mask ? (mask[c >> 3] >> (c & 7u)) & 1u : 1u;
            mine = hi == (grp == 0 ? 1u : 0u);
            bv = row[c];
            bad |= tqkv_bf16_is_nonfinite(bv);
        }
        uint32_t bal = __ballot_sync(0xffffffffu, mine);
        if (mine) {
            uint32_t j = jbase + __popc(bal & ((1u << lane) - 1u));
            double f = (double)tqkv_bf16_to_f32(bv);
            x[j] = mu ? __dsub_rn(f, (double)mu[c]) : f;
        }
        jbase += __popc(bal);
    }
    if (__any_sync(0xffffffffu, bad)) {
        if (lane == 0)
            atomicOr((unsigned int *)(page + 12), 1u);
        return;
    }
    __syncwarp();
    if (i == 0 && lane < G.n_centroids) /* the group's codebook copy */
        ((float *)(base + L.off_codebook))[lane] = G.z[lane];

    /* s = ||x|| (f64, index order) */
    double s = 0;
    if (lane == 0) {
        for (uint32_t j = 0; j < g; j++)
            s = __dadd_rn(s, __dmul_rn(x[j], x[j]));
        s = sqrt(s);
    }
    s = __shfl_sync(0xffffffffu, s, 0);
    uint16_t *scale_out = (uint16_t *)(base + L.off_scale) + i;
    uint8_t *sign_row = L.sign_row_bytes ? base + L.off_signs + i * L.sign_row_bytes : 0;
    uint8_t *idx_row = base + L.off_idx + i * L.idx_row_bytes;
    if (s == 0) {
        /* zero vector: scale 0, indices 0, gamma 0, signs all set */
        if (lane == 0) {
            *scale_out = 0;
            if (G.mode == TQKV_MODE_PROD)
                ((uint16_t *)(base + L.off_gamma))[i] = 0;
        }
        if (sign_row)
            for (uint32_t B = lane; B < L.sign_row_bytes; B += 32)
                sign_row[B] = (uint8_t)(g - 8 * B >= 8 ? 0xffu : (1u << (g - 8 * B)) - 1u);
        return;
    }
    double zn2 = 0;
    if (b) {
        for (uint32_t j = lane; j < g; j += 32)
            u[j] = (float)(x[j] / s);
        __syncwarp();
        warp_rotate(G, u, y, lane);
        for (uint32_t j = lane; j < g; j += 32) {
            uint32_t kk = tqkv_nearest_index(__fmul_rn(y[j], sqrt_g), G.thr, G.n_centroids);
            kidx[j] = (uint8_t)kk;
            y[j] = G.z[kk];
        }
        __syncwarp();
        /* index row: byte B holds bits 8B..8B+7 of the LSB-first stream */
        for (uint32_t B = lane; B < L.idx_row_bytes; B += 32) {
            uint32_t byte = 0;
            for (uint32_t t = 0; t < 8; t++) {
                uint32_t bit = 8 * B + t, j = bit / b;
                if (j < g)
                    byte |= ((kidx[j] >> (bit % b)) & 1u) << t;
            }
            idx_row[B] = (uint8_t)byte;
        }
        if (lane == 0 && G.norm_corrected)
            for (uint32_t j = 0; j < g; j++)
                zn2 = __dadd_rn(zn2, __dmul_rn(y[j], y[j]));
    }
    double sc;
    if (G.norm_corrected && b && zn2 > 0)
        sc = s / sqrt(zn2);
    else
        sc = s / sqrt((double)g);
    /* stored as BF16; everything after uses the stored (rounded) value */
    float scale = tqkv_bf16_to_f32(tqkv_scale_to_bf16(tqkv_clamp_flt(sc)));
    scale = __shfl_sync(0xffffffffu, scale, 0); /* lane 0 holds zn2 */
    if (lane == 0)
        *scale_out = tqkv_scale_to_bf16(scale);
    if (G.mode != TQKV_MODE_PROD)
        return;

    /* prod: r = x - scale Pi^T z[idx]; signs of S (r / ||r||); gamma = ||r|| / sqrt(g) */
    if (b)
        warp_rotate_t(G, y, a, lane);
    double sf = (double)scale, rn = 0;
    if (lane == 0) {
        for (uint32_t j = 0; j < g; j++) {
            double r = b ? __dsub_rn(x[j], __dmul_rn(sf, (double)a[j])) : x[j];
            rn = __dadd_rn(rn, __dmul_rn(r, r));
        }
        rn = sqrt(rn);
    }
    rn = __shfl_sync(0xffffffffu, rn, 0);
    for (uint32_t j = lane; j < g; j += 32) {
        double r = b ? __dsub_rn(x[j], __dmul_rn(sf, (double)a[j])) : x[j];
        u[j] = rn > 0 ? (float)(r / rn) : 0.0f;
    }
    __syncwarp();
    if (lane == 0)
        ((uint16_t *)(base + L.off_gamma))[i] =
            tqkv_scale_to_bf16(tqkv_clamp_flt(rn / sqrt((double)g)));
    warp_matvec(G.qjl, u, y, g, lane);
    for (uint32_t B = lane; B < L.sign_row_bytes; B += 32) {
        uint32_t byte = 0;
        for (uint32_t t = 0; t < 8 && 8 * B + t < g; t++)
            byte |= (y[8 * B + t] >= 0.0f ? 1u : 0u) << t;
        sign_row[B] = (uint8_t)byte;
    }
}

#define CRC_THREADS 1024

/* Step 4: one thread block of CRC_THREADS threads per page. */
static __global__ void
crc_kernel(uint8_t *pages, size_t page_stride, uint32_t bytes)
{
    __shared__ uint32_t table[256];
    __shared__ uint32_t crc[CRC_THREADS];
    __shared__ uint32_t len[CRC_THREADS];
    uint8_t *page = pages + blockIdx.x * page_stride;
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
launch_encode(const enc_plan_t *P, uint32_t n_blocks, const uint16_t *d_k, const uint16_t *d_v,
              size_t in_stride, uint8_t *pages, size_t page_stride, cudaStream_t stream)
{
    const tqkv_page_header_t *h = &P->hdr;
    uint32_t D = h->head_dim, H = h->num_kv_heads;
    uint64_t n = (uint64_t)h->num_tokens * H;
    tqkv_status_t st;

    if ((st = tqkv__cuda_status(
             cudaMemsetAsync(pages, 0, page_stride * (n_blocks - 1) + h->page_bytes, stream),
             "cudaMemsetAsync(pages)")) != TQKV_OK)
        return st;
    uint32_t sthreads = (D + 31) / 32 * 32;
    TQKV_LAUNCH(stats_kernel, dim3(H, 2, n_blocks), sthreads,
                (D + 3) * sizeof(double) + D * sizeof(float), stream, *h, d_k, d_v, in_stride,
                pages, page_stride);
    TQKV__CUDA_LAUNCH_CHECK("stats_kernel");
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t g = 0; g < 2; g++) {
            if (!P->present[t][g])
                continue;
            size_t smem = enc_warp_floats(P->G[t][g].dim) * sizeof(float) * ENC_WARPS;
            if (smem > 48 * 1024) {
                st = tqkv__cuda_status(
                    cudaFuncSetAttribute(encode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem),
                    "cudaFuncSetAttribute(encode)");
                if (st != TQKV_OK)
                    return st;
            }
            dim3 grid((unsigned)((n + ENC_WARPS - 1) / ENC_WARPS), n_blocks);
            TQKV_LAUNCH(encode_kernel, grid, ENC_WARPS * 32, smem, stream, *h, P->G[t][g],
                        P->L[t][g], t, g, t == 0 ? d_k : d_v, in_stride, pages, page_stride);
            TQKV__CUDA_LAUNCH_CHECK("encode_kernel");
        }
    TQKV_LAUNCH(crc_kernel, n_blocks, CRC_THREADS, 0, stream, pages, page_stride, h->page_bytes);
    TQKV__CUDA_LAUNCH_CHECK("crc_kernel");
    return TQKV_OK;
}

extern "C" tqkv_status_t
tqkv_cuda_page_encode_batch(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                            uint32_t n_blocks, const uint16_t *d_k, const uint16_t *d_v,
                            size_t in_stride, void *d_pages, size_t page_stride, size_t *page_bytes,
                            cudaStream_t stream)
{
    enc_plan_t P;
    tqkv_status_t st;
    if (!shape || !codec || !d_pages || !page_bytes || n_blocks == 0 || n_blocks > 65535)
        return TQKV_EINVAL;
    if ((codec->k.bits_x2 && !d_k) || (codec->v.bits_x2 && !d_v))
        return TQKV_EINVAL;
    if ((st = plan_page(shape, codec, &P)) != TQKV_OK)
        return st;
    *page_bytes = P.hdr.page_bytes;
    if ((uintptr_t)d_pages % 16 || page_stride % 16)
        return TQKV_EINVAL;
    if (n_blocks > 1 &&
        (page_stride < P.hdr.page_bytes ||
         in_stride < (size_t)shape->num_tokens * shape->num_kv_heads * shape->head_dim))
        return TQKV_EINVAL;
    return launch_encode(&P, n_blocks, d_k, d_v, in_stride, (uint8_t *)d_pages, page_stride,
                         stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                      const uint16_t *d_k, const uint16_t *d_v, void *d_page, size_t cap,
                      size_t *written, cudaStream_t stream)
{
    size_t need = 0;
    tqkv_status_t st;
    if (!shape || !codec || !d_page || !written)
        return TQKV_EINVAL;
    if ((st = tqkv_page_size(shape, codec, &need)) != TQKV_OK)
        return st;
    *written = need;
    if (cap < need)
        return TQKV_ENOSPC;
    return tqkv_cuda_page_encode_batch(shape, codec, 1, d_k, d_v, 0, d_page, (need + 15) / 16 * 16,
                                       written, stream);
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
