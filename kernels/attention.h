/* attention.h - fused decode attention of one query token over packed KV pages, and a
 * plain BF16 attention baseline.
 *
 * out[hq] = softmax(q[hq] . K^T * sm_scale) . V for every query head hq, where query head
 * hq reads KV head hq / (HQ / H) (GQA). The fused path never dequantizes keys: per page,
 * KV head and channel group it rotates the query's group channels once (Pi q_C), scores
 * each key as scale * sum_j (Pi q_C)_j z[idx_j] (+ the QJL term for prod keys, + q.mu for
 * centered keys), runs an online softmax over tiles of tokens, accumulates values in the
 * rotated domain (sum_i p_i scale_i z[idx_i]) and rotates back once per page, head and
 * group. Pages of a sequence are split into work items of at most split_tokens tokens
 * whose partial (max, sum, output) states are merged with a log-sum-exp merge. A lossless
 * page (K and V raw BF16, TQKV_MODE_RAW) runs the BF16 kernel over its rows; a page with
 * one raw tensor scores or accumulates that tensor in BF16 (scalar kernel).
 *
 * Thread safety: every function is reentrant; the only shared state is the rotation cache
 * of kernels/rotation.h. SIMD kernels (AVX-512 with VBMI, AVX2) are chosen once at run time.
 */
#ifndef TQKV_KERNELS_ATTENTION_H
#define TQKV_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/page.h"
#include "kernels/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Options of tqkv_attn_decode. A value; tqkv_attn_opts_default fills the defaults. */
typedef struct tqkv_attn_opts {
    uint32_t split_tokens; /* tokens per split-K work item (default 4096); 0 = no split;
                              raised when needed so a call has at most 256 splits */
    uint32_t num_threads;  /* worker threads over splits (default 1 = the calling thread) */
    uint8_t check_crc;     /* also verify each page's CRC32C (default 0) */
    float sm_scale;        /* softmax scale; 0 = 1/sqrt(head_dim) (default 0) */
} tqkv_attn_opts_t;

void tqkv_attn_opts_default(tqkv_attn_opts_t *o);

/* Fused decode attention over n_pages packed pages (borrowed; page_lens[i] >= the page's
 * own size), which hold consecutive blocks of one KV sequence: same num_kv_heads H and
 * head_dim D, both K and V present, any num_tokens each. q is float [HQ][D], out is float
 * [HQ][D] (written only on success). Returns TQKV_EINVAL (NULL arguments, n_pages == 0,
 * HQ not a positive multiple of H, pages of mismatched shape, a page without K or V),
 * TQKV_EFORMAT / TQKV_ECORRUPT (a page fails validation), TQKV_ENOMEM. opts may be NULL. */
tqkv_status_t tqkv_attn_decode(const float *q, uint32_t num_q_heads, const void *const *pages,
                               const size_t *page_lens, size_t n_pages,
                               const tqkv_attn_opts_t *opts, float *out);

/* Same, with a one-line reason written to err (may be NULL) on failure. */
tqkv_status_t tqkv_attn_decode_ex(const float *q, uint32_t num_q_heads, const void *const *pages,
                                  const size_t *page_lens, size_t n_pages,
                                  const tqkv_attn_opts_t *opts, float *out, char *err,
                                  size_t errlen);

/* Scalar reference of tqkv_attn_decode: scores from the rotated query and the codes (no
 * dequantization), exact two-pass softmax in double, values accumulated in the rotated
 * domain and rotated back per page, head and group. Ignores split_tokens/num_threads. */
tqkv_status_t tqkv_attn_decode_ref(const float *q, uint32_t num_q_heads, const void *const *pages,
                                   const size_t *page_lens, size_t n_pages,
                                   const tqkv_attn_opts_t *opts, float *out);

/* Validates pages and checks they form one sequence; writes H, D and the total token
 * count. Same statuses as tqkv_attn_decode, with a reason in err. */
tqkv_status_t tqkv_attn_check_pages(const void *const *pages, const size_t *page_lens,
                                    size_t n_pages, int check_crc, uint32_t *num_kv_heads,
                                    uint32_t *head_dim, uint64_t *num_tokens, char *err,
                                    size_t errlen);

/* BF16 attention baseline: K and V are BF16 [T][H][D] (borrowed), q float [HQ][D], out
 * float [HQ][D]; sm_scale 1/sqrt(D). TQKV_EINVAL for T == 0, bad heads or NULLs. */
tqkv_status_t tqkv_attn_bf16(const float *q, uint32_t num_q_heads, const uint16_t *k_bf16,
                             const uint16_t *v_bf16, uint32_t num_tokens, uint32_t num_kv_heads,
                             uint32_t head_dim, float *out);
tqkv_status_t tqkv_attn_bf16_ref(const float *q, uint32_t num_q_heads, const uint16_t *k_bf16,
                                 const uint16_t *v_bf16, uint32_t num_tokens, uint32_t num_kv_heads,
                                 uint32_t head_dim, float *out);

/* Name of the attention kernels in use ("avx512", "avx2" or "scalar"). */
const char *tqkv_attn_isa(void);

/* Caps the kernels used (for tests and benches; not thread-safe against concurrent attention
 * calls): TQKV_ATTN_ISA_BEST (default), _SCALAR, _AVX2, below what TQKV_ISA admits (cpu.h:
 * TQKV_ISA=scalar|avx2 caps every kernel, attention included). The environment variable
 * TQKV_ATTN_ISA=scalar|avx2 (deprecated: use TQKV_ISA) sets the initial cap. */
enum { TQKV_ATTN_ISA_BEST = 0, TQKV_ATTN_ISA_SCALAR = 1, TQKV_ATTN_ISA_AVX2 = 2 };
void tqkv_attn_set_isa_cap(int cap);
/* Same as tqkv_attn_set_isa_cap(on ? TQKV_ATTN_ISA_SCALAR : TQKV_ATTN_ISA_BEST). */
void tqkv_attn_force_scalar(int on);

/* ---- internal: the kernel table shared by attention.c and attention_avx2.c ---- */

/* One packed stream of a page, head and tensor: b-bit fields of gdim channels per token,
 * decoded through an 8-entry table (b <= 3, replicated with period 2^b) or a 16-entry
 * table (b == 4). QJL sign rows are 1-bit streams with table {-1, +1}. */
typedef struct tqkv__attn_stream {
    const uint8_t *rows;  /* row of token 0 of the work item */
    size_t stride;        /* bytes between the rows of consecutive tokens */
    uint32_t row_bytes;   /* bytes of one row */
    uint32_t bits;        /* 1..4 */
    uint32_t gdim;        /* fields per row */
    const uint8_t *limit; /* end of readable memory (page end): rows never read past it */
    float table[16];      /* entry m = value of field m (replicated for b < 4) */
    const float *coef;    /* [T] per-token coefficient (scale, or sqrt(pi/2) gamma / sqrt(g)) */
} tqkv__attn_stream_t;

/* A work item: token range of one page and KV head, G query heads, up to 4 streams each. */
typedef struct tqkv__attn_task {
    uint32_t num_tokens; /* tokens of the work item (streams and coef start at its first) */
    uint32_t G;          /* query heads sharing the KV head */
    uint32_t nk, nv;     /* streams of K and V */
    tqkv__attn_stream_t k[4], v[4];
    const float *qk[4]; /* per K stream: [G][gdim] query in the stream's domain, times sm_scale */
    const float *qbias; /* [G] score bias (q . mu * sm_scale), or NULL */
    float *acc[4];      /* per V stream: [G][gdim] rotated-domain accumulators (output) */
    float *m, *l;       /* [G] running max and sum (output) */
    float *scratch;     /* 2 * G * TQKV__ATTN_TILE floats */
    const uint8_t *pf;  /* memory to bring towards the cache while the item runs (this head's */
    size_t pf_bytes;    /* share of the next page), a slice per tile; pf_bytes may be 0 */
    /* A page with one lossless (TQKV_MODE_RAW) tensor and one quantized: only the scalar
     * kernel takes these (nk = 0 with k_raw, nv = 0 with v_raw); pages with both raw go
     * through the BF16 kernel. */
    const uint16_t *k_raw, *v_raw; /* BF16 row of the item's first token and this head */
    size_t raw_stride;             /* elements between the rows of consecutive tokens */
    uint32_t D;                    /* channels of a raw row */
    const float *q_raw;            /* [G][D] query times sm_scale (k_raw) */
    float *o_raw;                  /* [G][D] value accumulators (v_raw; output) */
} tqkv__attn_task_t;

#define TQKV__ATTN_TILE 64

/* Prefetches the slice of t->pf that belongs to tokens [t0, t1) of the item: spread over
 * the item instead of one burst, which would fill the miss queues and stall the kernel. */
static inline void
tqkv__attn_prefetch_slice(const tqkv__attn_task_t *t, uint32_t t0, uint32_t t1)
{
    size_t a, b;
    if (!t->pf_bytes || !t->num_tokens)
        return;
    a = (t->pf_bytes * t0 / t->num_tokens) & ~(size_t)63;
    b = t->pf_bytes * t1 / t->num_tokens;
    for (; a < b; a += 64)
        __builtin_prefetch(t->pf + a, 0, 2);
}

/* Prefetches bytes [a, b) of p (a rounded down to a cache line; never faults). The kernels
 * walk one KV head at a time through token-major data, a strided pattern the hardware
 * prefetchers follow poorly, so each kernel call is handed its head's share of the next
 * block (BF16) or page (packed) to bring in while it computes. */
static inline void
tqkv__attn_prefetch_bytes(const void *p, size_t a, size_t b)
{
    for (a &= ~(size_t)63; a < b; a += 64)
        __builtin_prefetch((const char *)p + a, 0, 2);
}

typedef void (*tqkv__attn_task_fn)(const tqkv__attn_task_t *t);
/* BF16 attention state update of G query heads over tokens [0, T) of one KV head: k, v point
 * at the first token of the head, stride is in elements between tokens. Updates the online
 * softmax state m[G], l[G] and the unnormalized output acc[G][D] (start: -inf, 0, 0).
 * pfk[0, pf_bytes) and pfv[0, pf_bytes) (may be 0 bytes): this head's share of the next
 * block, brought towards the cache while the call runs (as tqkv__attn_task_t.pf). */
typedef void (*tqkv__attn_bf16_fn)(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v,
                                   uint32_t T, size_t stride, uint32_t D, float sm_scale,
                                   float *acc, float *m, float *l, float *scratch, const void *pfk,
                                   const void *pfv, size_t pf_bytes);
/* The BF16 state update of the kernel level in use (attention.c's table). */
tqkv__attn_bf16_fn tqkv__attn_bf16_kernel(void);

/* Randomized Hadamard rotation of kernels/rotation.h for a power-of-two n >= 8, with the
 * signs D1 = signs[0..n), D2 = signs[n..2n): forward y = H D2 H D1 x / n, transposed
 * (transpose != 0) y = D1 H D2 H x / n. x and y may not alias. */
typedef void (*tqkv__attn_had_fn)(const float *signs, uint32_t n, const float *x, float *y,
                                  int transpose);
void tqkv__attn_hadamard_avx2(const float *signs, uint32_t n, const float *x, float *y,
                              int transpose);
/* Same, n a multiple of 16; the same butterflies in the same order (identical results). */
void tqkv__attn_hadamard_avx512(const float *signs, uint32_t n, const float *x, float *y,
                                int transpose);

void tqkv__attn_task_avx512(const tqkv__attn_task_t *t);
void tqkv__attn_bf16_avx512(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v,
                            uint32_t T, size_t stride, uint32_t D, float sm_scale, float *acc,
                            float *m, float *l, float *scratch, const void *pfk, const void *pfv,
                            size_t pf_bytes);
void tqkv__attn_task_scalar(const tqkv__attn_task_t *t);
void tqkv__attn_bf16_scalar(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v,
                            uint32_t T, size_t stride, uint32_t D, float sm_scale, float *acc,
                            float *m, float *l, float *scratch, const void *pfk, const void *pfv,
                            size_t pf_bytes);
void tqkv__attn_task_avx2(const tqkv__attn_task_t *t);
void tqkv__attn_bf16_avx2(const float *q, uint32_t G, const uint16_t *k, const uint16_t *v,
                          uint32_t T, size_t stride, uint32_t D, float sm_scale, float *acc,
                          float *m, float *l, float *scratch, const void *pfk, const void *pfv,
                          size_t pf_bytes);

#ifdef __cplusplus
}
#endif

#endif
