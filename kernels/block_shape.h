/* block_shape.h - the shape of a KV block, shared by the page codec (page.h) and the
 * public client API (installed as <tqkv/kernels/block_shape.h>). */
#ifndef TQKV_KERNELS_BLOCK_SHAPE_H
#define TQKV_KERNELS_BLOCK_SHAPE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Shape of a block: K and V are each [num_tokens][num_kv_heads][head_dim]. */
typedef struct tqkv_block_shape {
    uint32_t num_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
} tqkv_block_shape_t;

#ifdef __cplusplus
}
#endif

#endif
