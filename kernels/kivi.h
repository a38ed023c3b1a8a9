/* kivi.h - KIVI-style baseline quantizer for KV blocks (uniform asymmetric, fp16 scale/zero).
 *
 * Keys are quantized per channel over groups of `group` consecutive tokens, values per token
 * over groups of `group` consecutive channels (KIVI, arXiv:2402.02750). Each group stores a
 * fp16 scale and a fp16 zero point; codes are b-bit integers q in [0, 2^b - 1] and
 * x_hat = q * scale + zero. Everything is counted in bits per coordinate: b plus 32 bits
 * per group (a partial group at the end still costs its 32 bits).
 */
#ifndef TQKV_KERNELS_KIVI_H
#define TQKV_KERNELS_KIVI_H

#include <stdint.h>

#include "kernels/status.h"

/* Quantizes and dequantizes K and V (BF16 [T][H][D], borrowed) at `bits` (1..8) bits with
 * groups of `group` (>= 1) tokens (keys) / channels (values); writes f32 [T][H][D]
 * reconstructions (k_out or v_out may be NULL to skip) and, when non-NULL, the storage
 * cost in bits per coordinate of K and of V. TQKV_EINVAL for bad sizes or bits. */
tqkv_status_t tqkv_kivi_roundtrip(const uint16_t *k_bf16, const uint16_t *v_bf16, uint32_t T,
                                  uint32_t H, uint32_t D, uint32_t bits, uint32_t group,
                                  float *k_out, float *v_out, double *k_bits_per_coord,
                                  double *v_bits_per_coord);

/* IEEE half precision, round to nearest even (saturating to +-65504), and back. */
uint16_t tqkv_kivi_f32_to_f16(float f);
float tqkv_kivi_f16_to_f32(uint16_t h);

#endif
