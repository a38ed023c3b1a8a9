/* policy.h - the KV codec policy of a namespace: key and value settings, boundary
 * layers at higher precision, rotation, key centering, seed.
 */
#ifndef TQKV_KERNELS_POLICY_H
#define TQKV_KERNELS_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/page.h"
#include "kernels/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor whose mode is TQKV_MODE_RAW is stored lossless (BF16 as it came); its bits_x2
 * and norm_correction are then the lossy settings it returns to when its mode changes back
 * (both are still checked), and tqkv_policy_block_codec hands out the raw codec. */
typedef struct tqkv_policy {
    tqkv_tensor_codec_t k, v;                   /* middle layers */
    tqkv_tensor_codec_t k_boundary, v_boundary; /* first/last boundary_layers layers */
    uint32_t boundary_layers;                   /* default 2 */
    uint8_t rotation;                           /* tqkv_rotation_kind_t */
    uint8_t key_centering;
    uint64_t seed;
} tqkv_policy_t;

/* The measured defaults (see docs/design.md, "KV policy"): the one definition of the
 * default policy, used by the server (service/config.c) and by tqkv-codec (kernels/cli/). */
void tqkv_policy_default(tqkv_policy_t *p);

/* The block codec of a middle (non-boundary) layer under tqkv_policy_default(): what a
 * default server stores for such a block, and what tqkv-codec encode-kv and encode use
 * unless their flags say otherwise. */
void tqkv_policy_default_codec(tqkv_block_codec_t *out);

/* Checks every field; a one-line reason in err on failure (TQKV_EINVAL). */
tqkv_status_t tqkv_policy_check(const tqkv_policy_t *p, char *err, size_t errlen);

/* The block codec for `layer` of a model with num_layers layers (0 = unknown: only
 * the first boundary_layers layers get the boundary setting). */
void tqkv_policy_block_codec(const tqkv_policy_t *p, uint32_t layer, uint32_t num_layers,
                             tqkv_block_codec_t *out);

/* Sets *t to the lossless codec: {TQKV_RAW_BITS_X2, TQKV_MODE_RAW, no norm correction}. */
void tqkv_tensor_codec_lossless(tqkv_tensor_codec_t *t);

/* "1", "1.5", "2", "2.5", "3", "3.5", "4" -> bits_x2; TQKV_EINVAL otherwise. */
tqkv_status_t tqkv_bits_parse(const char *s, uint8_t *bits_x2);
/* Same from a float (exact halves only). */
tqkv_status_t tqkv_bits_from_float(float bits, uint8_t *bits_x2);

#ifdef __cplusplus
}
#endif

#endif
