/* page.h - encode a KV block (or plain vectors) into a packed page, and back.
 *
 * The layout is kernels/page_format.h. Encoding picks the fastest kernels the CPU
 * has (AVX-512 / AVX2 / scalar, chosen once at run time); the *_ref functions are
 * the scalar specification the fast ones are tested against.
 *
 * Thread safety: all functions are reentrant; codebooks and rotations are built on
 * first use behind a lock and then shared read-only.
 */
#ifndef TQKV_KERNELS_PAGE_H
#define TQKV_KERNELS_PAGE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/block_shape.h"
#include "kernels/page_format.h"
#include "kernels/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How one tensor (K or V) of a block is encoded. A value, copy freely. */
typedef struct tqkv_tensor_codec {
    uint8_t bits_x2;         /* 2,3,4,5,6,7,8 = 1,1.5,2,2.5,3,3.5,4 bits; 0 = tensor absent */
    uint8_t mode;            /* tqkv_mode_t */
    uint8_t norm_correction; /* store ||x|| / ||z[idx]|| instead of ||x|| / sqrt(g) */
} tqkv_tensor_codec_t;

/* How a whole block is encoded. */
typedef struct tqkv_block_codec {
    tqkv_tensor_codec_t k, v;
    uint8_t rotation;      /* tqkv_rotation_kind_t */
    uint8_t key_centering; /* subtract the block's per-channel key mean (stored) */
    uint64_t seed;
} tqkv_block_codec_t;

/* What a validated page holds (pointers borrowed from the page). */
typedef struct tqkv_page_info {
    const tqkv_page_header_t *hdr;
    tqkv_block_shape_t shape;
    tqkv_block_codec_t codec;
    size_t page_bytes;
    uint64_t bf16_bytes; /* BF16 bytes of the tensors present: what the page replaces */
} tqkv_page_info_t;

/* Checks shape and codec: head_dim in [TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM], heads and
 * tokens in range, supported bits and modes. On failure writes a one-line reason to
 * err (if non-NULL) and returns TQKV_EINVAL or TQKV_EUNSUPPORTED. */
tqkv_status_t tqkv_page_check_params(const tqkv_block_shape_t *shape,
                                     const tqkv_block_codec_t *codec, char *err, size_t errlen);

/* Exact size in bytes of the page for (shape, codec). */
tqkv_status_t tqkv_page_size(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                             size_t *out);

/* Encodes K and V (BF16, [T][H][D]; v may be NULL when codec->v.bits_x2 == 0) into
 * page[0..cap). Borrows everything; writes *written. Returns TQKV_ERANGE (with the
 * offending tensor/index in err) when the input holds NaN or Inf, TQKV_ENOSPC when
 * cap is too small, TQKV_EINVAL/EUNSUPPORTED for bad parameters. */
tqkv_status_t tqkv_page_encode(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                               const uint16_t *k_bf16, const uint16_t *v_bf16, void *page,
                               size_t cap, size_t *written, char *err, size_t errlen);
tqkv_status_t tqkv_page_encode_ref(const tqkv_block_shape_t *shape, const tqkv_block_codec_t *codec,
                                   const uint16_t *k_bf16, const uint16_t *v_bf16, void *page,
                                   size_t cap, size_t *written, char *err, size_t errlen);

/* Validates magic, version, sizes, offsets, parameters and (when check_crc) the CRC
 * of page[0..len). len may exceed the page (a file of pages): info->page_bytes is the
 * page's own size. Returns TQKV_EFORMAT (bad magic/version/size/layout) or
 * TQKV_ECORRUPT (bad CRC) with a reason in err. */
tqkv_status_t tqkv_page_validate(const void *page, size_t len, int check_crc,
                                 tqkv_page_info_t *info, char *err, size_t errlen);

/* Decodes a validated page into f32 or BF16 [T][H][D] for K and V (either output may
 * be NULL to skip that tensor). For prod mode the output is the full unbiased
 * reconstruction x_mse + QJL correction. Key centering is undone. */
tqkv_status_t tqkv_page_decode_f32(const void *page, size_t len, float *k, float *v);
tqkv_status_t tqkv_page_decode_f32_ref(const void *page, size_t len, float *k, float *v);
tqkv_status_t tqkv_page_decode_bf16(const void *page, size_t len, uint16_t *k, uint16_t *v);

/* CRC32C (Castagnoli) of buf, continuing from crc (start with 0). */
uint32_t tqkv_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t tqkv_crc32c_ref(uint32_t crc, const void *buf, size_t len);
/* Copies len bytes from src to dst (not overlapping) and returns the CRC32C of them,
 * continuing from crc: one pass over the data instead of memcpy + tqkv_crc32c. */
uint32_t tqkv_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len);
uint32_t tqkv_crc32c_copy_ref(uint32_t crc, void *dst, const void *src, size_t len);

/* CRC of a page as stored in its header (crc field taken as zero). */
uint32_t tqkv_page_crc(const void *page, size_t page_bytes);

/* Name of the SIMD level in use ("avx512", "avx2", "scalar"). */
const char *tqkv_kernels_isa(void);

#ifdef __cplusplus
}
#endif

#endif
