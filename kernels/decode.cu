/* decode.cu - packed page (device memory) -> f32 or BF16 [T][H][D] on the device.
 *
 * One launch per (tensor, group), one thread per vector: tqkv_group_decode_vec with
 * its rows in shared memory, then the group's values are scattered to their channels
 * (outlier mask) with the key mean added back. The two groups of a tensor write
 * disjoint channels, so the launches need no ordering beyond the stream's.
 */
#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

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

/* Shared-memory row of one decode thread: out (g doubles) then 2g floats of work. */
static __host__ __device__ inline size_t
dec_row_floats(uint32_t g)
{
    return 4 * (size_t)g + 2;
}

template <typename OutT>
static __global__ void
decode_kernel(tqkv_page_header_t hdr, tqkv_group_codec_t G, uint32_t ten, uint32_t grp,
              const uint8_t *__restrict__ page, OutT *__restrict__ out)
{
    extern __shared__ double shd[];
    uint32_t D = hdr.head_dim, H = hdr.num_kv_heads, g = G.dim;
    uint64_t n = (uint64_t)hdr.num_tokens * H;
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    double *val = (double *)((float *)shd + (uint64_t)threadIdx.x * dec_row_floats(g));
    float *work = (float *)(val + g);
    tqkv_group_view_t gv;

    if (i >= n || tqkv_page_group_view(page, ten, grp, &gv) != 0)
        return;
    G.z = gv.codebook; /* the page's own codebook copy */
    uint32_t h = (uint32_t)(i % H);
    tqkv_group_decode_vec(&G, gv.scale[i], gv.gamma ? gv.gamma[i] : 0.0f,
                          gv.idx + i * gv.L.idx_row_bytes,
                          gv.signs ? gv.signs + i * gv.L.sign_row_bytes : 0, work, val);
    const uint8_t *mask = tqkv_page_mask(page, ten, h);
    const float *mu = ten == TQKV_TENSOR_K ? tqkv_page_key_mean(page, h) : 0;
    OutT *row = out + i * D;
    uint32_t j = 0;
    for (uint32_t c = 0; c < D && j < g; c++) {
        uint32_t hi = mask ? (mask[c >> 3] >> (c & 7u)) & 1u : 1u;
        if (hi != (grp == 0 ? 1u : 0u))
            continue;
        double f = val[j++];
        row[c] = to_out<OutT>(tqkv_clamp_flt(mu ? __dadd_rn(f, (double)mu[c]) : f));
    }
}

template <typename OutT>
static tqkv_status_t
decode_page(const tqkv_page_header_t *hdr, const void *d_page, OutT *d_k, OutT *d_v,
            cudaStream_t stream)
{
    tqkv_status_t st;
    if (!hdr || !d_page)
        return TQKV_EINVAL;
    if ((st = tqkv_cuda_header_check(hdr)) != TQKV_OK)
        return st;
    uint64_t n = (uint64_t)hdr->num_tokens * hdr->num_kv_heads;
    for (uint32_t t = 0; t < 2; t++) {
        OutT *out = t == 0 ? d_k : d_v;
        if (!out || !hdr->tensor[t].bits_x2)
            continue;
        for (uint32_t g = 0; g < 2; g++) {
            tqkv_group_codec_t G;
            if (g == 1 && !hdr->tensor[t].lo_bits)
                continue;
            if ((st = tqkv__cuda_group_codec(hdr, t, g, &G)) != TQKV_OK)
                return st;
            size_t row = dec_row_floats(G.dim) * sizeof(float);
            uint32_t threads = 64;
            while (threads > 1 && row * threads > 96 * 1024)
                threads >>= 1;
            size_t smem = row * threads;
            if (smem > 48 * 1024) {
                st = tqkv__cuda_status(
                    cudaFuncSetAttribute(decode_kernel<OutT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                    "cudaFuncSetAttribute(decode)");
                if (st != TQKV_OK)
                    return st;
            }
            uint64_t blocks = (n + threads - 1) / threads;
            decode_kernel<OutT><<<(unsigned)blocks, threads, smem, stream>>>(
                *hdr, G, t, g, (const uint8_t *)d_page, out);
            TQKV__CUDA_LAUNCH_CHECK("decode_kernel");
        }
    }
    return TQKV_OK;
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_f32(const tqkv_page_header_t *hdr, const void *d_page, float *d_k, float *d_v,
                          cudaStream_t stream)
{
    return decode_page<float>(hdr, d_page, d_k, d_v, stream);
}

extern "C" tqkv_status_t
tqkv_cuda_page_decode_bf16(const tqkv_page_header_t *hdr, const void *d_page, uint16_t *d_k,
                           uint16_t *d_v, cudaStream_t stream)
{
    return decode_page<uint16_t>(hdr, d_page, d_k, d_v, stream);
}
