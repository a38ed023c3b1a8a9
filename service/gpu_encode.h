/* gpu_encode.h - Put's encode on the server's GPU (see gpu_encode.c). */
#ifndef TQKV_SERVICE_GPU_ENCODE_H
#define TQKV_SERVICE_GPU_ENCODE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/page.h"
#include "kernels/status.h"

/* Encodes host BF16 K and V [T][H][D] (either NULL when its codec bits are 0) into
 * page[0..cap) (host) on CUDA device `device`; the bytes equal tqkv_page_encode_ref's.
 * cap must be tqkv_page_size(shape, codec). Returns TQKV_OK with *written set, or an
 * error with a message in err: TQKV_EUNSUPPORTED without CUDA in the build,
 * TQKV_ENODEV/ENOMEM/ECUDA for device trouble, TQKV_ERANGE for NaN/Inf input, the
 * codec's statuses for bad parameters. Thread-safe; device scratch is per thread. */
tqkv_status_t tqkv__gpu_encode(int device, const tqkv_block_shape_t *shape,
                               const tqkv_block_codec_t *codec, const uint16_t *k,
                               const uint16_t *v, void *page, size_t cap, size_t *written,
                               char *err, size_t errlen);

/* 1 when this build has CUDA and `device` exists. */
int tqkv__gpu_encode_available(int device);

#endif
