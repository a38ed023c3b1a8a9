/* attention_bf16.c - the BF16 attention baseline (tqkv_attn_bf16, tqkv_attn_bf16_ref) and
 * its scalar state update: exact attention over BF16 K and V, blocks of tokens with all KV
 * heads of a block before the next, the kernel of attention.c's table (TQKV_ISA). Reentrant.
 */
#include "kernels/attention.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu.h"
#include "kernels/tq_math.h"

/* BF16 attention state update (see tqkv__attn_bf16_fn). */
void
tqkv__attn_bf16_scalar(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v, uint32_t T,
                       size_t stride, uint32_t D, float sm_scale, float *out, float *m, float *l,
                       float *scratch, const void *pfk, const void *pfv, size_t pf_bytes)
{
    float *sc = scratch;
    tqkv__attn_prefetch_bytes(pfk, 0, pf_bytes);
    tqkv__attn_prefetch_bytes(pfv, 0, pf_bytes);
    for (uint32_t t0 = 0; t0 < T; t0 += TQKV__ATTN_TILE) {
        uint32_t n = T - t0 < TQKV__ATTN_TILE ? T - t0 : TQKV__ATTN_TILE;
        for (uint32_t i = 0; i < n; i++) {
            const uint16_t *kr = k + (size_t)(t0 + i) * stride;
            for (uint32_t h = 0; h < G; h++) {
                float dot = 0.0f;
                for (uint32_t j = 0; j < D; j++)
                    dot += q[(size_t)h * D + j] * tqkv_bf16_to_f32(kr[j]);
                sc[h * TQKV__ATTN_TILE + i] = dot * sm_scale;
            }
        }
        for (uint32_t h = 0; h < G; h++) {
            float *row = sc + h * TQKV__ATTN_TILE, mx = m[h], alpha, sum = 0.0f;
            for (uint32_t i = 0; i < n; i++)
                mx = row[i] > mx ? row[i] : mx;
            alpha = expf(m[h] - mx);
            for (uint32_t i = 0; i < n; i++) {
                row[i] = expf(row[i] - mx);
                sum += row[i];
            }
            l[h] = l[h] * alpha + sum;
            m[h] = mx;
            for (uint32_t j = 0; j < D; j++)
                out[(size_t)h * D + j] *= alpha;
        }
        for (uint32_t i = 0; i < n; i++) {
            const uint16_t *vr = v + (size_t)(t0 + i) * stride;
            for (uint32_t h = 0; h < G; h++) {
                float w = sc[h * TQKV__ATTN_TILE + i];
                for (uint32_t j = 0; j < D; j++)
                    out[(size_t)h * D + j] += w * tqkv_bf16_to_f32(vr[j]);
            }
        }
    }
}

/* ---- BF16 baseline ---- */

/* Tokens per block of the BF16 baseline: like the fused path's pages, all KV heads of a
 * block are processed before the next block, so memory is read as one forward stream. */
#define BF16_BLOCK 64

static tqkv_status_t
bf16_common(const float *q, uint32_t HQ, const uint16_t *k, const uint16_t *v, uint32_t T,
            uint32_t H, uint32_t D, float *out, tqkv__attn_bf16_fn fn)
{
    float *scratch, *m, *l, sm_scale;
    uint32_t G;
    if (!q || !k || !v || !out || T == 0 || H == 0 || D == 0 || HQ == 0 || HQ % H != 0)
        return TQKV_EINVAL;
    G = HQ / H;
    scratch =
        aligned_alloc(64, tqkv_align_up(sizeof(float) * (2 * G * TQKV__ATTN_TILE + 2 * HQ), 64));
    if (!scratch)
        return TQKV_ENOMEM;
    m = scratch + 2 * G * TQKV__ATTN_TILE;
    l = m + HQ;
    sm_scale = (float)(1.0 / sqrt((double)D));
    for (uint32_t i = 0; i < HQ; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(out, 0, sizeof(float) * HQ * D);
    for (uint32_t t0 = 0; t0 < T; t0 += BF16_BLOCK) {
        uint32_t n = T - t0 < BF16_BLOCK ? T - t0 : BF16_BLOCK;
        uint32_t n2 = T - t0 - n < BF16_BLOCK ? T - t0 - n : BF16_BLOCK;
        size_t part = (size_t)n2 * D; /* elements of the next block per head-sized part */
        for (uint32_t h = 0; h < H; h++) {
            size_t off = ((size_t)t0 * H + h) * D, nxt = ((size_t)(t0 + n) * H + h) * D;
            fn(q + (size_t)h * G * D, G, k + off, v + off, n, (size_t)H * D, D, sm_scale,
               out + (size_t)h * G * D, m + h * G, l + h * G, scratch,
               k + nxt - (size_t)h * D + (size_t)h * part,
               v + nxt - (size_t)h * D + (size_t)h * part, n2 ? part * 2 : 0);
        }
    }
    for (uint32_t i = 0; i < HQ; i++)
        for (uint32_t d = 0; d < D; d++)
            out[(size_t)i * D + d] /= l[i];
    free(scratch);
    return TQKV_OK;
}

tqkv_status_t
tqkv_attn_bf16(const float *q, uint32_t num_q_heads, const uint16_t *k_bf16, const uint16_t *v_bf16,
               uint32_t num_tokens, uint32_t num_kv_heads, uint32_t head_dim, float *out)
{
    return bf16_common(q, num_q_heads, k_bf16, v_bf16, num_tokens, num_kv_heads, head_dim, out,
                       tqkv__attn_bf16_kernel());
}

/* Reads like the math: two-pass softmax in double. */
tqkv_status_t
tqkv_attn_bf16_ref(const float *q, uint32_t num_q_heads, const uint16_t *k_bf16,
                   const uint16_t *v_bf16, uint32_t num_tokens, uint32_t num_kv_heads,
                   uint32_t head_dim, float *out)
{
    uint32_t H = num_kv_heads, D = head_dim, T = num_tokens, G;
    double *s, *o;
    if (!q || !k_bf16 || !v_bf16 || !out || T == 0 || H == 0 || D == 0 || num_q_heads == 0 ||
        num_q_heads % H != 0)
        return TQKV_EINVAL;
    G = num_q_heads / H;
    s = malloc(sizeof(double) * T);
    o = malloc(sizeof(double) * D);
    if (!s || !o) {
        free(s);
        free(o);
        return TQKV_ENOMEM;
    }
    for (uint32_t hq = 0; hq < num_q_heads; hq++) {
        uint32_t h = hq / G;
        double mx = -INFINITY, L = 0.0;
        for (uint32_t t = 0; t < T; t++) {
            const uint16_t *kr = k_bf16 + ((size_t)t * H + h) * D;
            double dot = 0.0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)q[(size_t)hq * D + d] * tqkv_bf16_to_f32(kr[d]);
            s[t] = dot / sqrt((double)D);
            mx = s[t] > mx ? s[t] : mx;
        }
        memset(o, 0, sizeof(double) * D);
        for (uint32_t t = 0; t < T; t++) {
            const uint16_t *vr = v_bf16 + ((size_t)t * H + h) * D;
            double p = exp(s[t] - mx);
            L += p;
            for (uint32_t d = 0; d < D; d++)
                o[d] += p * tqkv_bf16_to_f32(vr[d]);
        }
        for (uint32_t d = 0; d < D; d++)
            out[(size_t)hq * D + d] = (float)(o[d] / L);
    }
    free(s);
    free(o);
    return TQKV_OK;
}
