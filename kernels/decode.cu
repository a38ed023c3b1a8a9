/* decode.cu - packed pages (device memory) -> f32 or BF16 [T][H][D] on the device.
 *
 * A raw (lossless) tensor is a copy: BF16 out as stored, f32 out widened (exact).
 *
 * One launch per (tensor, group), one warp per vector: the warp runs the operations of
 * tqkv_group_decode_vec (tq_math.h) in the same order and rounding (element-wise steps
 * and FWHT butterflies over the lanes, columns of dense matrices over the lanes with
 * each sum in row order), then scatters the group's values to their channels (outlier
 * mask, prefix counts by ballot) with the key mean added back, as the reference decoder
 * does. The two groups of a tensor write disjoint channels.
 */
#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

#define DEC_WARPS 4

template <typename OutT> static __device__ inline OutT to_out(float f);
template <>
__device__ inline float
to_out<float>(float f)
{
    return f;
}
template <>
__device__ inline uint16_t
to_out<uint16_t>(float f)
{
    return tqkv_f32_to_bf16_sat(f);
}

/* Shared memory of one decode warp, in floats: out (g doubles), y, a (g floats). */
static __host__ __device__ inline size_t
dec_warp_floats(uint32_t g)
{
    return 4 * (size_t)g;
}

/* x = M^T y for a row-major g x g matrix, columns over the lanes (as tqkv_matvec_t). */
static __device__ inline void
warp_matvec_t(const float *__restrict__ M, const float *y, float *x, uint32_t g, uint32_t lane)
{
    for (uint32_t j = lane; j < g; j += 32) {
        float s = 0.0f;
        for (uint32_t i = 0; i < g; i++)
            s = __fadd_rn(s, __fmul_rn(M[(size_t)i * g + j], y[i]));
        x[j] = s;
    }
    __syncwarp();
}

/* grid (ceil(n / DEC_WARPS), pages); warp w decodes vector blockIdx.x * DEC_WARPS + w. */
template <typename OutT>
static __global__ void
__launch_bounds__(DEC_WARPS * 32)
    decode_kernel(tqkv_page_header_t hdr, tqkv_group_codec_t G, uint32_t ten, uint32_t grp,
                  const uint8_t *__restrict__ pages, size_t page_stride, OutT *__restrict__ out_all,
                  size_t out_stride)
{
    TQKV_DYN_SMEM(double, shd);
    const uint32_t D = hdr.head_dim, H = hdr.num_kv_heads, g = G.dim, b = G.mse_bits;
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const uint64_t n = (uint64_t)hdr.num_tokens * H;
    const uint64_t i = (uint64_t)blockIdx.x * DEC_WARPS + warp;
    const uint8_t *page = pages + blockIdx.y * page_stride;
    double *val = (double *)((float *)shd + warp * dec_warp_floats(g));
    float *y = (float *)(val + g), *a = y + g;
    tqkv_group_view_t gv;

    if (i >= n || tqkv_page_group_view(page, ten, grp, &gv) != 0)
        return;
    const float scale = tqkv_scale_get(gv.scale, i);
    if (b) {
        const uint8_t *row = gv.idx + i * gv.L.idx_row_bytes;
        for (uint32_t j = lane; j < g; j += 32)
            y[j] = gv.codebook[tqkv_bits_get(row, j, b)]; /* the page's own codebook */
        __syncwarp();
        if (G.rotation == TQKV_ROT_HADAMARD) { /* a = Pi^T y, as tqkv_group_rotate_t */
            float inv = 1.0f / (float)g;
            for (uint32_t j = lane; j < g; j += 32)
                a[j] = y[j];
            tqkv__warp_fwht(a, g, lane);
            for (uint32_t j = lane; j < g; j += 32)
                a[j] = __fmul_rn(a[j], G.signs[g + j]);
            tqkv__warp_fwht(a, g, lane);
            for (uint32_t j = lane; j < g; j += 32)
                a[j] = __fmul_rn(a[j], __fmul_rn(G.signs[j], inv));
            __syncwarp();
        } else {
            warp_matvec_t(G.matrix, y, a, g, lane);
        }
        for (uint32_t j = lane; j < g; j += 32)
            val[j] = __dmul_rn((double)scale, (double)a[j]);
    } else {
        for (uint32_t j = lane; j < g; j += 32)
            val[j] = 0;
    }
    if (gv.signs) {
        const uint8_t *srow = gv.signs + i * gv.L.sign_row_bytes;
        double c =
            __dmul_rn(TQKV_SQRT_HALF_PI / sqrt((double)g), (double)tqkv_scale_get(gv.gamma, i));
        __syncwarp();
        for (uint32_t j = lane; j < g; j += 32)
            y[j] = ((srow[j >> 3] >> (j & 7u)) & 1u) ? 1.0f : -1.0f;
        __syncwarp();
        warp_matvec_t(G.qjl, y, a, g, lane);
        for (uint32_t j = lane; j < g; j += 32)
            val[j] = __dadd_rn(val[j], __dmul_rn(c, (double)a[j]));
    }
    __syncwarp();
    const uint32_t h = (uint32_t)(i % H);
    const uint8_t *mask = tqkv_page_mask(page, ten, h);
    const float *mu = ten == TQKV_TENSOR_K ? tqkv_page_key_mean(page, h) : 0;
    OutT *orow = out_all + blockIdx.y * out_stride + i * D;
    uint32_t jbase = 0;
    for (uint32_t c0 = 0; c0 < D; c0 += 32) {
        uint32_t c = c0 + lane, mine = 0;
        if (c < D) {
            uint32_t hi = mask ? (mask[c >> 3] >> (c & 7u)) & 1u : 1u;
            mine = hi == (grp == 0 ? 1u : 0u);
        }
        uint32_t bal = __ballot_sync(0xffffffffu, mine);
        if (mine) {
            uint32_t j = jbase + __popc(bal & ((1u << lane) - 1u));
            double f = val[j];
            orow[c] = to_out<OutT>(tqkv_clamp_flt(mu ? __dadd_rn(f, (double)mu[c]) : f));
        }
        jbase += __popc(bal);
    }
}

template <typename OutT> static __device__ inline OutT raw_out(uint16_t x);
template <>
__device__ inline float
raw_out<float>(uint16_t x)
{
    return tqkv_bf16_to_f32(x);
}
template <>
__device__ inline uint16_t
raw_out<uint16_t>(uint16_t x)
{
    return x; /* lossless: the stored BF16 bits */
}

/* A raw (lossless) tensor: grid (x, pages), a thread per element, grid-stride. */
template <typename OutT>
static __global__ void
decode_raw_kernel(uint32_t ten, const uint8_t *__restrict__ pages, size_t page_stride,
                  OutT *__restrict__ out_all, size_t out_stride, uint64_t count)
{
    const uint8_t *page = pages + blockIdx.y * page_stride;
    const uint16_t *x = tqkv_page_raw(page, ten);
    OutT *o = out_all + blockIdx.y * out_stride;
    if (!x)
        return;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (uint64_t)gridDim.x * blockDim.x)
        o[i] = raw_out<OutT>(x[i]);
}

template <typename OutT>
static tqkv_status_t
decode_pages(const tqkv_page_header_t *hdr, uint32_t n_blocks, const void *d_pages,
             size_t page_stride, OutT *d_k, OutT *d_v, size_t out_stride, cudaStream_t stream)
{
    tqkv_status_t st;
    if (!hdr || !d_pages || n_blocks == 0 || n_blocks > 65535)
        return TQKV_EINVAL;
    if ((st = tqkv_cuda_header_check(hdr)) != TQKV_OK)
        return st;
    uint64_t n = (uint64_t)hdr->num_tokens * hdr->num_kv_heads;
    if (n_blocks > 1 && (page_stride < hdr->page_bytes || out_stride < n * hdr->head_dim))
        return TQKV_EINVAL;
    for (uint32_t t = 0; t < 2; t++) {
        OutT *out = t == 0 ? d_k : d_v;
        if (!out || !hdr->tensor[t].bits_x2)
            continue;
        if (hdr->tensor[t].mode == TQKV_MODE_RAW) {
            uint64_t count = n * hdr->head_dim, nb = (count + 255) / 256;
            dim3 grid((unsigned)(nb < 4096 ? nb : 4096), n_blocks);
            TQKV_LAUNCH(decode_raw_kernel<OutT>, grid, 256, 0, stream, t, (const uint8_t *)d_pages,
                        page_stride, out, out_stride, count);
            TQKV__CUDA_LAUNCH_CHECK("decode_raw_kernel");
            continue;
        }
        for (uint32_t g = 0; g < 2; g++) {
            tqkv_group_codec_t G;
            if (g == 1 && !hdr->tensor[t].lo_bits)
                continue;
            if ((st = tqkv__cuda_group_codec(hdr, t, g, &G)) != TQKV_OK)
                return st;
            size_t smem = dec_warp_floats(G.dim) * sizeof(float) * DEC_WARPS;
            if (smem > 48 * 1024) {
                st = tqkv__cuda_status(
                    cudaFuncSetAttribute(decode_kernel<OutT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                    "cudaFuncSetAttribute(decode)");
                if (st != TQKV_OK)
                    return st;
            }
            dim3 grid((unsigned)((n + DEC_WARPS - 1) / DEC_WARPS), n_blocks);
            TQKV_LAUNCH(decode_kernel<OutT>, grid, DEC_WARPS * 32, smem, stream, *hdr, G, t, g,
                        (const uint8_t *)d_pages, page_stride, out, out_stride);
            TQKV__CUDA_LAUNCH_CHECK("decode_kernel");
        }
    }
    return TQKV_OK;
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_f32(const tqkv_page_header_t *hdr, const void *d_page, float *d_k, float *d_v,
                          cudaStream_t stream)
{
    return decode_pages<float>(hdr, 1, d_page, 0, d_k, d_v, 0, stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_bf16(const tqkv_page_header_t *hdr, const void *d_page, uint16_t *d_k,
                           uint16_t *d_v, cudaStream_t stream)
{
    return decode_pages<uint16_t>(hdr, 1, d_page, 0, d_k, d_v, 0, stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_f32_batch(const tqkv_page_header_t *hdr, uint32_t n_blocks,
                                const void *d_pages, size_t page_stride, float *d_k, float *d_v,
                                size_t out_stride, cudaStream_t stream)
{
    return decode_pages<float>(hdr, n_blocks, d_pages, page_stride, d_k, d_v, out_stride, stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_bf16_batch(const tqkv_page_header_t *hdr, uint32_t n_blocks,
                                 const void *d_pages, size_t page_stride, uint16_t *d_k,
                                 uint16_t *d_v, size_t out_stride, cudaStream_t stream)
{
    return decode_pages<uint16_t>(hdr, n_blocks, d_pages, page_stride, d_k, d_v, out_stride,
                                  stream);
}
