/* cuda.h - CUDA launchers: page encode/decode on the device, fused decode attention
 * over packed pages, and a plain BF16 decode-attention baseline. C-includable.
 *
 * Every launcher enqueues its work on the caller's stream, checks the launches and
 * returns a status; none synchronizes the stream except where stated. Device buffers
 * are borrowed. Rotation matrices, Hadamard signs, QJL matrices and codebooks are
 * built on the host (kernels/rotation.h, kernels/codebook.h) and uploaded once per
 * (kind, dim, seed) and device into a process-wide device cache (thread-safe; the
 * first use of a new (kind, dim, seed) does a synchronous upload).
 *
 * Encode and decode run one warp per vector and group, performing the operations of
 * tqkv_group_encode_vec / tqkv_group_decode_vec (kernels/tq_math.h, which mirror the
 * scalar reference codec of page.c) in the same order and rounding with no FMA
 * contraction, so GPU pages equal tqkv_page_encode_ref pages byte for byte and GPU
 * decodes equal tqkv_page_decode_f32_ref. Page CRCs are computed on the device
 * (parallel CRC32C with register shifts, tqkv_crc32c_shift).
 */
#ifndef TQKV_KERNELS_CUDA_H
#define TQKV_KERNELS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

/* The kernels' C headers carry no extern "C" of their own. */
#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/page.h"
#include "kernels/page_format.h"
#include "kernels/status.h"

/* Number of CUDA devices in *n; TQKV_ENODEV (with *n = 0) when there is none or no
 * driver. */
tqkv_status_t tqkv_cuda_device_count(int *n);

/* Encodes K and V (device BF16 [T][H][D]; d_v may be NULL when codec->v.bits_x2 == 0)
 * into d_page[0..cap) (device memory) on `stream`. *written gets the page size at
 * once (host-computed). Returns TQKV_EINVAL/EUNSUPPORTED for bad parameters,
 * TQKV_ENOSPC when cap is too small, TQKV_ECUDA when a launch fails.
 * NaN/Inf input cannot be reported without a synchronization: such a page is written
 * with magic 0 (every reader rejects it); tqkv_cuda_page_encode_status tells. */
tqkv_status_t tqkv_cuda_page_encode(const tqkv_block_shape_t *shape,
                                    const tqkv_block_codec_t *codec, const uint16_t *d_k,
                                    const uint16_t *d_v, void *d_page, size_t cap, size_t *written,
                                    cudaStream_t stream);

/* Encodes n_blocks blocks of the same shape and codec in one set of launches: block b
 * reads d_k + b * in_stride and d_v + b * in_stride (elements; >= T*H*D when
 * n_blocks > 1) and is written at d_pages + b * page_stride (bytes; a multiple of 16,
 * >= the page size when n_blocks > 1; the gaps are zeroed). d_pages 16-byte aligned,
 * n_blocks <= 65535. *page_bytes gets the size of each page. Statuses as above. */
tqkv_status_t tqkv_cuda_page_encode_batch(const tqkv_block_shape_t *shape,
                                          const tqkv_block_codec_t *codec, uint32_t n_blocks,
                                          const uint16_t *d_k, const uint16_t *d_v,
                                          size_t in_stride, void *d_pages, size_t page_stride,
                                          size_t *page_bytes, cudaStream_t stream);

/* Synchronizes `stream` and checks the page header encoded into d_page: TQKV_OK, or
 * TQKV_ERANGE when the input held NaN/Inf, TQKV_ECUDA on a device error. */
tqkv_status_t tqkv_cuda_page_encode_status(const void *d_page, cudaStream_t stream);

/* Decodes a page in device memory into device f32 (or BF16) [T][H][D] for K and V
 * (either output may be NULL). hdr is a host copy of the page's header: it is checked
 * (magic, version, shape, codec, every offset equal to the layout the parameters
 * imply) and TQKV_EFORMAT is returned when it is not consistent. The CRC is not
 * checked on the device. Key centering is undone; prod decodes the unbiased estimate. */
tqkv_status_t tqkv_cuda_page_decode_f32(const tqkv_page_header_t *hdr, const void *d_page,
                                        float *d_k, float *d_v, cudaStream_t stream);
tqkv_status_t tqkv_cuda_page_decode_bf16(const tqkv_page_header_t *hdr, const void *d_page,
                                         uint16_t *d_k, uint16_t *d_v, cudaStream_t stream);

/* Decodes n_blocks pages that share the header fields of hdr (a host copy of the
 * first page's header: same shape, codec and layout), page b at d_pages + b *
 * page_stride, into d_k/d_v + b * out_stride (elements; either may be NULL). */
tqkv_status_t tqkv_cuda_page_decode_bf16_batch(const tqkv_page_header_t *hdr, uint32_t n_blocks,
                                               const void *d_pages, size_t page_stride,
                                               uint16_t *d_k, uint16_t *d_v, size_t out_stride,
                                               cudaStream_t stream);
tqkv_status_t tqkv_cuda_page_decode_f32_batch(const tqkv_page_header_t *hdr, uint32_t n_blocks,
                                              const void *d_pages, size_t page_stride, float *d_k,
                                              float *d_v, size_t out_stride, cudaStream_t stream);

/* Checks a host copy of a page header for the device kernels (see decode). */
tqkv_status_t tqkv_cuda_header_check(const tqkv_page_header_t *hdr);

/* Decode attention of one query token over the packed pages of a sequence:
 * out[hq] = softmax(q[hq] . K^T * sm_scale) . V, query head hq reading KV head
 * hq / (num_q_heads / H) (GQA). Keys are scored from their codes with a per-query
 * lookup table T[j][m] = (Pi q)_j z_m in shared memory; values are accumulated in the
 * rotated domain and rotated back once per split; an online softmax runs over tiles
 * and a merge kernel combines the splits (log-sum-exp).
 * d_pages: device array of n_pages device pointers to pages of one sequence, in token
 * order, all with the K and V codec, rotation, seed, flags, num_kv_heads and head_dim
 * of `hdr` (a host copy of the first page's header, checked here); each page's own
 * num_tokens is read on the device. q: device f32 [num_q_heads][D]; out: device f32
 * [num_q_heads][D]. sm_scale 0 means 1/sqrt(D). work: device scratch of
 * tqkv_cuda_attention_workspace(tqkv_cuda_attention_packed_splits(hdr, n_pages), ...)
 * bytes. TQKV_EINVAL for bad arguments (K or V absent, heads not a multiple, small work),
 * TQKV_EFORMAT for an inconsistent header, TQKV_ECUDA for a failed launch. */
size_t tqkv_cuda_attention_workspace(uint32_t n_splits, uint32_t num_q_heads, uint32_t head_dim);
uint32_t tqkv_cuda_attention_packed_splits(const tqkv_page_header_t *hdr, uint32_t n_pages);
tqkv_status_t tqkv_cuda_attention_packed(const tqkv_page_header_t *hdr, const void *const *d_pages,
                                         uint32_t n_pages, const float *d_q, uint32_t num_q_heads,
                                         float sm_scale, float *d_out, void *d_work,
                                         size_t work_bytes, cudaStream_t stream);

/* Baseline: the same attention over plain BF16 K, V [n_tokens][H][D] (device), split
 * into tqkv_cuda_attention_bf16_splits() token ranges (flash-decoding: one block per
 * split and KV head, a warp per token, online softmax) merged at the end; work sized
 * by tqkv_cuda_attention_workspace for that many splits. */
uint32_t tqkv_cuda_attention_bf16_splits(uint32_t n_tokens, uint32_t num_kv_heads);
tqkv_status_t tqkv_cuda_attention_bf16(const uint16_t *d_k, const uint16_t *d_v, uint32_t n_tokens,
                                       uint32_t num_kv_heads, uint32_t head_dim, const float *d_q,
                                       uint32_t num_q_heads, float sm_scale, float *d_out,
                                       void *d_work, size_t work_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
