/* attention.cu - decode attention on the device: fused over packed pages, plain BF16
 * baseline, and the split merge both use.
 *
 * Packed (attn_packed_kernel): one block per (split, KV head, chunk of <= QC query
 * heads). A split is a token range of one page (pages of more than SPLIT_TOKENS tokens
 * give several). The block gathers each query head's channels per K group (the page's
 * outlier mask), rotates them (block FWHT for Hadamard groups, matvec for dense), builds
 * the lookup tables T[j][m] = (Pi q)_j z_m * sm_scale in shared memory, then walks the
 * tokens in tiles of ATTN_TILE: one thread scores one token from its index row (plus the
 * QJL term for prod keys and q.mu for centered keys), the block runs the online softmax,
 * and one thread per (query head, channel) accumulates values in the rotated domain
 * (sum p_i scale_i z[idx_ij]; prod values also sum p_i coef_i sign_ij). At the end the
 * accumulators are rotated back (Pi^T, S^T), scattered to channels by the V mask and
 * written as the split's partial (m, l, o).
 *
 * BF16 (attn_bf16_kernel): one block of 4 warps per (split, KV head, chunk of query
 * heads); a warp takes one token at a time (lanes over channels, 8-byte loads when
 * D % 128 == 0), keeps its own online softmax state, and the warps are combined at the
 * end into the split's partial.
 *
 * A lossless (raw BF16) K is scored from its rows (q . k, the query times sm_scale in
 * qk); a lossless V is accumulated in channel order (sum p_i v_i) and needs no rotation.
 *
 * merge_kernel: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s over the splits.
 */
#include <math.h>
#include <string.h>

#include "kernels/cuda.h"
#include "kernels/tq_cuda_math.cuh"

#define ATTN_TILE 256     /* tokens per tile = threads per packed block */
#define SPLIT_TOKENS 1024 /* tokens per packed split */
#define QC 4              /* query heads per packed block */
#define BF16_WARPS 4
#define BF16_QC 8

/* ---- workspace and merge ---- */

extern "C" size_t
tqkv_cuda_attention_workspace(uint32_t n_splits, uint32_t num_q_heads, uint32_t head_dim)
{
    return (size_t)n_splits * num_q_heads * ((size_t)head_dim + 2) * sizeof(float);
}

/* Partial state of split s, query head hq: m, l at [s][hq], o at [s][hq][D]. */
typedef struct partials {
    float *m, *l, *o;
} partials_t;

static __host__ __device__ inline partials_t
partials_at(void *work, uint32_t n_splits, uint32_t hq, uint32_t D)
{
    partials_t P;
    P.m = (float *)work;
    P.l = P.m + (size_t)n_splits * hq;
    P.o = P.l + (size_t)n_splits * hq;
    return P;
}

/* grid: num_q_heads; block: >= D threads (one per channel). */
static __global__ void
merge_kernel(partials_t P, uint32_t n_splits, uint32_t HQ, uint32_t D, float *__restrict__ out)
{
    uint32_t hq = blockIdx.x, c = threadIdx.x;
    float M = -INFINITY, L = 0.0f, o = 0.0f;
    for (uint32_t s = 0; s < n_splits; s++)
        M = fmaxf(M, P.m[(size_t)s * HQ + hq]);
    for (uint32_t s = 0; s < n_splits; s++) {
        float l = P.l[(size_t)s * HQ + hq];
        if (l == 0.0f)
            continue;
        float w = __expf(P.m[(size_t)s * HQ + hq] - M);
        L += w * l;
        if (c < D)
            o += w * P.o[((size_t)s * HQ + hq) * D + c];
    }
    if (c < D)
        out[(size_t)hq * D + c] = L > 0.0f ? o / L : 0.0f;
}

static tqkv_status_t
launch_merge(void *work, uint32_t n_splits, uint32_t HQ, uint32_t D, float *out,
             cudaStream_t stream)
{
    partials_t P = partials_at(work, n_splits, HQ, D);
    TQKV_LAUNCH(merge_kernel, HQ, (D + 31) / 32 * 32, 0, stream, P, n_splits, HQ, D, out);
    TQKV__CUDA_LAUNCH_CHECK("merge_kernel");
    return TQKV_OK;
}

/* ---- block-wide transforms on shared memory ---- */

/* out = M in (transpose: M^T in) for a row-major g x g matrix; in != out. */
static __device__ void
block_matvec(const float *__restrict__ M, const float *in, float *out, uint32_t g, int transpose)
{
    for (uint32_t i = threadIdx.x; i < g; i += blockDim.x) {
        float s = 0.0f;
        if (transpose)
            for (uint32_t j = 0; j < g; j++)
                s += M[(size_t)j * g + i] * in[j];
        else
            for (uint32_t j = 0; j < g; j++)
                s += M[(size_t)i * g + j] * in[j];
        out[i] = s;
    }
    __syncthreads();
}

/* out = Pi in (transpose: Pi^T in) of a group; in != out; ends synchronized. */
static __device__ void
block_rotate(const tqkv_group_codec_t &G, const float *in, float *out, int transpose)
{
    uint32_t g = G.dim;
    if (G.rotation != TQKV_ROT_HADAMARD) {
        block_matvec(G.matrix, in, out, g, transpose);
        return;
    }
    float inv = 1.0f / (float)g;
    for (uint32_t j = threadIdx.x; j < g; j += blockDim.x)
        out[j] = transpose ? in[j] : in[j] * G.signs[j];
    tqkv__block_fwht(out, g);
    for (uint32_t j = threadIdx.x; j < g; j += blockDim.x)
        out[j] *= G.signs[g + j];
    tqkv__block_fwht(out, g);
    for (uint32_t j = threadIdx.x; j < g; j += blockDim.x)
        out[j] *= transpose ? G.signs[j] * inv : inv;
    __syncthreads();
}

/* ---- packed ---- */

typedef struct packed_params {
    tqkv_group_codec_t K[2], V[2]; /* device pointers; z is taken from each page */
    uint32_t nk, nv;               /* groups of K and V */
    uint32_t H, D, HQ, G;          /* kv heads, head_dim, query heads, query heads per kv head */
    uint32_t lut_n;                /* floats of one query head's tables */
    uint32_t qc;                   /* query heads per block (<= QC, fits shared memory) */
    uint32_t splits_per_page;
    float sm_scale;
    int k_prod, v_prod, centered;
    int k_raw, v_raw; /* lossless tensors (nk / nv = 0): BF16 rows, tqkv_page_raw */
} packed_params_t;

/* Shared memory layout of the packed kernel, in floats. */
typedef struct packed_smem {
    uint32_t qk, sq, lut, bias, score, vcoef, acc, accs, m, l, alpha, tmp, red, zv, part, total;
} packed_smem_t;

static __host__ __device__ inline packed_smem_t
packed_smem_layout(uint32_t D, uint32_t lut_n, uint32_t qc)
{
    packed_smem_t S;
    uint32_t o = 0;
    S.qk = o, o += qc * D;
    S.sq = o, o += qc * D;
    S.lut = o, o += qc * lut_n;
    S.bias = o, o += qc;
    S.score = o, o += qc * ATTN_TILE;
    S.vcoef = o, o += 4 * ATTN_TILE;
    S.acc = o, o += qc * D;
    S.accs = o, o += qc * D;
    S.m = o, o += qc;
    S.l = o, o += qc;
    S.alpha = o, o += qc;
    S.tmp = o, o += 2 * D;
    S.red = o, o += qc * (ATTN_TILE / 32);
    S.zv = o, o += 32;
    S.part = o, o += 4 * qc * D;
    S.total = o;
    return S;
}

/* Channels of group gi of a head in increasing order: the c-th channel of the group. */
static __device__ inline int
in_group(const uint8_t *mask, uint32_t c, uint32_t gi)
{
    uint32_t hi = mask ? (mask[c >> 3] >> (c & 7u)) & 1u : 1u;
    return hi == (gi == 0 ? 1u : 0u);
}

/* Per-thread view of one packed block's work: its split, query heads and the page's
 * sections for head h. The shared-memory arrays (packed_smem_t) are not in it: each stage
 * derives the ones it uses from the layout, since pointers kept here cost registers
 * (ptxas, sm_90: 107 per thread instead of 63). */
typedef struct packed_ctx {
    tqkv_group_view_t kv[2], vv[2];
    uint32_t goff_k[2], goff_v[2], lutoff[2]; /* group offsets in channels / table floats */
    const uint8_t *kmask, *vmask;
    const float *mu;             /* centered keys' mean or NULL */
    const uint16_t *kraw, *vraw; /* lossless tensors or NULL */
    uint32_t split, h, q0, nq;   /* nq: query heads of this block (<= A.qc) */
    uint32_t t_begin, t_end;     /* the split's token range */
} packed_ctx_t;

/* Resolves the block's page, split and groups into C. */
static __device__ void
packed_ctx_init(const packed_params_t &A, const void *const *__restrict__ pages, packed_ctx_t &C)
{
    const uint32_t page_i = blockIdx.x / A.splits_per_page, part = blockIdx.x % A.splits_per_page;
    const uint8_t *page = (const uint8_t *)pages[page_i];
    const tqkv_page_header_t *hdr = (const tqkv_page_header_t *)page;
    const uint32_t Tp = hdr->num_tokens;
    C.split = blockIdx.x, C.h = blockIdx.y, C.q0 = blockIdx.z * A.qc;
    C.nq = min(A.qc, A.G - C.q0);
    C.t_begin = part * SPLIT_TOKENS;
    C.t_end = part + 1 == A.splits_per_page ? Tp : min(Tp, C.t_begin + SPLIT_TOKENS);
    for (uint32_t i = 0; i < 2; i++)
        C.goff_k[i] = C.goff_v[i] = C.lutoff[i] = 0;
    for (uint32_t gi = 0; gi < A.nk; gi++)
        tqkv_page_group_view(page, TQKV_TENSOR_K, gi, &C.kv[gi]);
    for (uint32_t gi = 0; gi < A.nv; gi++)
        tqkv_page_group_view(page, TQKV_TENSOR_V, gi, &C.vv[gi]);
    if (A.nk == 2) {
        C.goff_k[1] = A.K[0].dim;
        C.lutoff[1] = A.K[0].dim * A.K[0].n_centroids;
    }
    if (A.nv == 2)
        C.goff_v[1] = A.V[0].dim;
    C.kmask = tqkv_page_mask(page, TQKV_TENSOR_K, C.h);
    C.vmask = tqkv_page_mask(page, TQKV_TENSOR_V, C.h);
    C.mu = tqkv_page_key_mean(page, C.h);
    C.kraw = A.k_raw ? tqkv_page_raw(page, TQKV_TENSOR_K) : 0;
    C.vraw = A.v_raw ? tqkv_page_raw(page, TQKV_TENSOR_V) : 0;
}

/* Stage 1, per query head: reset the softmax state and accumulators, gather and rotate
 * the query per K group, build the lookup tables and the centering bias; then load the
 * V codebooks. Ends synchronized. */
static __device__ void
packed_prepare_queries(const packed_params_t &A, packed_ctx_t &C, const float *__restrict__ q)
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *qk = sm + S.qk, *sq = sm + S.sq, *lut = sm + S.lut, *bias = sm + S.bias,
          *acc = sm + S.acc, *accs = sm + S.accs, *mrun = sm + S.m, *lrun = sm + S.l,
          *tmp = sm + S.tmp, *zv = sm + S.zv;
    const uint32_t D = A.D, tid = threadIdx.x;
    for (uint32_t qi = 0; qi < A.qc; qi++) {
        if (tid == 0) {
            mrun[qi] = -INFINITY;
            lrun[qi] = 0.0f;
            bias[qi] = 0.0f;
        }
        for (uint32_t c = tid; c < D; c += blockDim.x) {
            acc[qi * D + c] = 0.0f;
            accs[qi * D + c] = 0.0f;
        }
        if (qi >= C.nq)
            continue;
        const float *qv = q + (size_t)(C.h * A.G + C.q0 + qi) * D;
        if (C.kraw) {
            for (uint32_t c = tid; c < D; c += blockDim.x)
                qk[qi * D + c] = qv[c] * A.sm_scale;
            __syncthreads();
        }
        for (uint32_t gi = 0; gi < A.nk; gi++) {
            /* gather the group's channels into tmp[0..g) */
            if (tid == 0) {
                uint32_t j = 0;
                for (uint32_t c = 0; c < D; c++)
                    if (in_group(C.kmask, c, gi))
                        tmp[j++] = qv[c];
            }
            __syncthreads();
            float *dst = qk + qi * D + C.goff_k[gi];
            if (A.K[gi].mse_bits)
                block_rotate(A.K[gi], tmp, dst, 0);
            if (A.k_prod)
                block_matvec(A.K[gi].qjl, tmp, sq + qi * D + C.goff_k[gi], A.K[gi].dim, 0);
            uint32_t g = A.K[gi].dim, n = A.K[gi].n_centroids;
            for (uint32_t e = tid; e < g * n; e += blockDim.x)
                lut[qi * A.lut_n + C.lutoff[gi] + e] =
                    dst[e / n] * C.kv[gi].codebook[e % n] * A.sm_scale;
            if (A.k_prod)
                for (uint32_t j = tid; j < g; j += blockDim.x)
                    sq[qi * D + C.goff_k[gi] + j] *= A.sm_scale;
            __syncthreads();
        }
        if (tid == 0) {
            float b = 0.0f;
            if (C.mu)
                for (uint32_t c = 0; c < D; c++)
                    b += qv[c] * C.mu[c];
            bias[qi] = b * A.sm_scale;
        }
    }
    for (uint32_t gi = 0; gi < A.nv; gi++)
        for (uint32_t m = tid; m < C.vv[gi].L.n_centroids; m += blockDim.x)
            zv[gi * 16 + m] = C.vv[gi].codebook[m];
    __syncthreads();
}

/* Adds token row i's score for every query head to s: q . k for a lossless K, else per
 * K group the table lookups times the token's scale plus the QJL term of prod keys. */
static __device__ void
packed_score_keys(const packed_params_t &A, const packed_ctx_t &C, uint64_t i, float s[QC])
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *qk = sm + S.qk, *sq = sm + S.sq, *lut = sm + S.lut;
    const uint32_t D = A.D, nq = C.nq;
    if (C.kraw) {
        const uint16_t *kr = C.kraw + i * D;
        float a[QC] = {0.0f};
        for (uint32_t c = 0; c < D; c++) {
            float kc = tqkv_bf16_to_f32(kr[c]);
            for (uint32_t qi = 0; qi < QC; qi++)
                if (qi < nq)
                    a[qi] += qk[qi * D + c] * kc;
        }
        for (uint32_t qi = 0; qi < QC; qi++)
            s[qi] += a[qi];
    }
    for (uint32_t gi = 0; gi < A.nk; gi++) {
        const tqkv_group_view_t &gv = C.kv[gi];
        uint32_t g = gv.L.dim, b = gv.L.mse_bits, n = gv.L.n_centroids;
        float a[QC] = {0.0f};
        if (b) {
            const uint8_t *row = gv.idx + i * gv.L.idx_row_bytes;
            const float *L0 = lut + C.lutoff[gi];
            for (uint32_t j = 0; j < g; j++) {
                uint32_t k = tqkv_bits_get(row, j, b);
                for (uint32_t qi = 0; qi < QC; qi++)
                    if (qi < nq)
                        a[qi] += L0[qi * A.lut_n + j * n + k];
            }
        }
        float sc = tqkv_scale_get(gv.scale, i);
        for (uint32_t qi = 0; qi < QC; qi++)
            s[qi] += sc * a[qi];
        if (gv.signs) {
            const uint8_t *srow = gv.signs + i * gv.L.sign_row_bytes;
            float c2[QC] = {0.0f};
            for (uint32_t j = 0; j < g; j++) {
                int bit = (srow[j >> 3] >> (j & 7u)) & 1u;
                for (uint32_t qi = 0; qi < QC; qi++) {
                    float v = qi < nq ? sq[qi * D + C.goff_k[gi] + j] : 0.0f;
                    c2[qi] += bit ? v : -v;
                }
            }
            float coef = (float)TQKV_SQRT_HALF_PI / sqrtf((float)g) * tqkv_scale_get(gv.gamma, i);
            for (uint32_t qi = 0; qi < QC; qi++)
                s[qi] += coef * c2[qi];
        }
    }
}

/* Stage 2a: this thread's token of the tile at t0 (tn tokens): its score per query head
 * in s (-inf past the tile or past nq) and its V coefficients in vcoef. */
static __device__ void
packed_score_tile(const packed_params_t &A, packed_ctx_t &C, uint32_t t0, uint32_t tn, float s[QC])
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *bias = sm + S.bias, *vcoef = sm + S.vcoef;
    const uint32_t tid = threadIdx.x, t = t0 + tid;
    for (uint32_t qi = 0; qi < QC; qi++)
        s[qi] = -INFINITY;
    if (tid >= tn)
        return;
    uint64_t i = (uint64_t)t * A.H + C.h;
    for (uint32_t qi = 0; qi < QC; qi++)
        s[qi] = qi < C.nq ? bias[qi] : -INFINITY;
    packed_score_keys(A, C, i, s);
    for (uint32_t gi = 0; gi < A.nv; gi++) {
        vcoef[(2 * gi) * ATTN_TILE + tid] = tqkv_scale_get(C.vv[gi].scale, i);
        vcoef[(2 * gi + 1) * ATTN_TILE + tid] =
            C.vv[gi].gamma ? (float)TQKV_SQRT_HALF_PI / sqrtf((float)C.vv[gi].L.dim) *
                                 tqkv_scale_get(C.vv[gi].gamma, i)
                           : 0.0f;
    }
}

/* Stage 2b, the online softmax over a tile: new running max m and rescale alpha, the
 * tile's probabilities in score, the running sum l. Ends synchronized except for l. */
static __device__ void
packed_softmax_tile(const packed_params_t &A, packed_ctx_t &C, uint32_t tn, const float s[QC])
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *score = sm + S.score, *mrun = sm + S.m, *lrun = sm + S.l, *alpha = sm + S.alpha,
          *red = sm + S.red;
    const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    /* tile max per query head */
    for (uint32_t qi = 0; qi < QC; qi++) {
        if (qi >= A.qc) /* uniform: the whole block skips */
            break;
        float mx = tqkv__warp_max(s[qi]);
        if (lane == 0)
            red[qi * (ATTN_TILE / 32) + warp] = mx;
    }
    __syncthreads();
    if (tid < A.qc) {
        float mx = -INFINITY;
        for (uint32_t w = 0; w < ATTN_TILE / 32; w++)
            mx = fmaxf(mx, red[tid * (ATTN_TILE / 32) + w]);
        float mnew = fmaxf(mrun[tid], mx);
        alpha[tid] = mnew == -INFINITY ? 1.0f : __expf(mrun[tid] - mnew);
        mrun[tid] = mnew;
    }
    __syncthreads();
    for (uint32_t qi = 0; qi < QC; qi++) {
        if (qi >= A.qc)
            break;
        float p = (tid < tn && qi < C.nq) ? __expf(s[qi] - mrun[qi]) : 0.0f;
        score[qi * ATTN_TILE + tid] = p;
        float ps = tqkv__warp_sum(p);
        if (lane == 0)
            red[qi * (ATTN_TILE / 32) + warp] = ps;
    }
    __syncthreads();
    if (tid < A.qc) {
        float ps = 0.0f;
        for (uint32_t w = 0; w < ATTN_TILE / 32; w++)
            ps += red[tid * (ATTN_TILE / 32) + w];
        lrun[tid] = lrun[tid] * alpha[tid] + ps;
    }
}

/* Stage 2c, values of a lossless V: one thread per (channel, half of the tile) sums
 * p_i v_i for every query head into vpart (the QJL halves are 0). */
static __device__ void
packed_values_raw(const packed_params_t &A, packed_ctx_t &C, uint32_t t0, uint32_t tn)
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *score = sm + S.score, *vpart = sm + S.part;
    const uint32_t D = A.D, H = A.H, nq = C.nq, half_len = (tn + 1) / 2;
    for (uint32_t e = threadIdx.x; e < 2 * D; e += blockDim.x) {
        uint32_t j = e % D, half = e / D, tb = half * half_len, te = min(tn, tb + half_len);
        uint64_t i0 = (uint64_t)t0 * H + C.h;
        float a[QC] = {0.0f};
        for (uint32_t tt = tb; tt < te; tt++) {
            float vj = tqkv_bf16_to_f32(C.vraw[(i0 + (uint64_t)tt * H) * D + j]);
            for (uint32_t qi = 0; qi < QC; qi++)
                if (qi < nq)
                    a[qi] += score[qi * ATTN_TILE + tt] * vj;
        }
        for (uint32_t qi = 0; qi < QC; qi++)
            if (qi < nq) {
                vpart[(half * A.qc + qi) * D + j] = a[qi];
                vpart[((2 + half) * A.qc + qi) * D + j] = 0.0f;
            }
    }
}

/* Stage 2c, values of a coded V: one thread per (rotated channel, half of the tile)
 * covers every query head, so each code is unpacked once; the halves meet in vpart
 * (sum p_i scale_i z[idx_ij] and, for prod, sum p_i coef_i sign_ij). */
static __device__ void
packed_values_coded(const packed_params_t &A, packed_ctx_t &C, uint32_t t0, uint32_t tn)
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *score = sm + S.score, *vcoef = sm + S.vcoef, *zv = sm + S.zv, *vpart = sm + S.part;
    const uint32_t D = A.D, H = A.H, nq = C.nq, half_len = (tn + 1) / 2;
    for (uint32_t e = threadIdx.x; e < 2 * D; e += blockDim.x) {
        uint32_t j = e % D, half = e / D;
        uint32_t gi = (A.nv == 2 && j >= C.goff_v[1]) ? 1 : 0, jj = j - C.goff_v[gi];
        const tqkv_group_view_t &gv = C.vv[gi];
        uint32_t b = gv.L.mse_bits;
        const float *vs = vcoef + (2 * gi) * ATTN_TILE, *vg = vs + ATTN_TILE;
        const float *z = zv + gi * 16;
        float a[QC] = {0.0f}, as[QC] = {0.0f};
        uint32_t tb = half * half_len, te = min(tn, tb + half_len);
        uint64_t i0 = (uint64_t)t0 * H + C.h;
        if (b)
            for (uint32_t tt = tb; tt < te; tt++) {
                const uint8_t *row = gv.idx + (i0 + (uint64_t)tt * H) * gv.L.idx_row_bytes;
                float zk = vs[tt] * z[tqkv_bits_get(row, jj, b)];
                for (uint32_t qi = 0; qi < QC; qi++)
                    if (qi < nq)
                        a[qi] += score[qi * ATTN_TILE + tt] * zk;
            }
        if (gv.signs)
            for (uint32_t tt = tb; tt < te; tt++) {
                const uint8_t *row = gv.signs + (i0 + (uint64_t)tt * H) * gv.L.sign_row_bytes;
                float w = ((row[jj >> 3] >> (jj & 7u)) & 1u) ? vg[tt] : -vg[tt];
                for (uint32_t qi = 0; qi < QC; qi++)
                    if (qi < nq)
                        as[qi] += score[qi * ATTN_TILE + tt] * w;
            }
        for (uint32_t qi = 0; qi < QC; qi++)
            if (qi < nq) {
                vpart[(half * A.qc + qi) * D + j] = a[qi];
                vpart[((2 + half) * A.qc + qi) * D + j] = as[qi];
            }
    }
}

/* Stage 2d: the tile's values into the accumulators, rescaled by alpha. Ends
 * synchronized. */
static __device__ void
packed_accumulate_tile(const packed_params_t &A, packed_ctx_t &C, uint32_t t0, uint32_t tn)
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *acc = sm + S.acc, *accs = sm + S.accs, *alpha = sm + S.alpha, *vpart = sm + S.part;
    const uint32_t D = A.D;
    if (C.vraw)
        packed_values_raw(A, C, t0, tn);
    else
        packed_values_coded(A, C, t0, tn);
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < C.nq * D; e += blockDim.x) {
        uint32_t qi = e / D, j = e % D;
        acc[e] = acc[e] * alpha[qi] + (vpart[qi * D + j] + vpart[(A.qc + qi) * D + j]);
        accs[e] =
            accs[e] * alpha[qi] + (vpart[(2 * A.qc + qi) * D + j] + vpart[(3 * A.qc + qi) * D + j]);
    }
    __syncthreads();
}

/* Stage 3: rotate the accumulators back, scatter them to channels and write the
 * split's partial (m, l, o) per query head. */
static __device__ void
packed_write_partial(const packed_params_t &A, packed_ctx_t &C, partials_t P)
{
    TQKV_DYN_SMEM(float, sm);
    const packed_smem_t S = packed_smem_layout(A.D, A.lut_n, A.qc);
    float *acc = sm + S.acc, *accs = sm + S.accs, *mrun = sm + S.m, *lrun = sm + S.l,
          *tmp = sm + S.tmp;
    const uint32_t D = A.D, tid = threadIdx.x;
    for (uint32_t qi = 0; qi < C.nq; qi++) {
        uint32_t hq = C.h * A.G + C.q0 + qi;
        size_t slot = (size_t)C.split * A.HQ + hq;
        float *o = P.o + slot * D;
        if (C.vraw) { /* lossless values: accumulated in channel order */
            for (uint32_t c = tid; c < D; c += blockDim.x)
                o[c] = acc[qi * D + c];
            __syncthreads();
        }
        for (uint32_t gi = 0; gi < A.nv; gi++) {
            const tqkv_group_codec_t &G = A.V[gi];
            uint32_t g = G.dim;
            float *r = tmp, *r2 = tmp + D;
            /* r = Pi^T acc (or 0), r2 = S^T accs (prod) */
            if (G.mse_bits)
                block_rotate(G, acc + qi * D + C.goff_v[gi], r, 1);
            else {
                for (uint32_t j = tid; j < g; j += blockDim.x)
                    r[j] = 0.0f;
                __syncthreads();
            }
            if (A.v_prod) {
                block_matvec(G.qjl, accs + qi * D + C.goff_v[gi], r2, g, 1);
                for (uint32_t j = tid; j < g; j += blockDim.x)
                    r[j] += r2[j];
                __syncthreads();
            }
            if (tid == 0) {
                uint32_t j = 0;
                for (uint32_t c = 0; c < D; c++)
                    if (in_group(C.vmask, c, gi))
                        o[c] = r[j++];
            }
            __syncthreads();
        }
        if (tid == 0) {
            P.m[slot] = mrun[qi];
            P.l[slot] = lrun[qi];
        }
    }
}

static __global__ void
__launch_bounds__(ATTN_TILE)
    attn_packed_kernel(packed_params_t A, const void *const *__restrict__ pages,
                       const float *__restrict__ q, partials_t P, uint32_t n_splits)
{
    packed_ctx_t C;
    (void)n_splits;
    packed_ctx_init(A, pages, C);
    packed_prepare_queries(A, C, q); /* 1. queries: rotate, tables, bias */
    for (uint32_t t0 = C.t_begin; t0 < C.t_end; t0 += ATTN_TILE) { /* 2. tiles of tokens */
        uint32_t tn = min((uint32_t)ATTN_TILE, C.t_end - t0);
        float s[QC];
        packed_score_tile(A, C, t0, tn, s);
        packed_softmax_tile(A, C, tn, s);
        packed_accumulate_tile(A, C, t0, tn);
    }
    packed_write_partial(A, C, P); /* 3. rotate back, write the partial */
}

extern "C" uint32_t
tqkv_cuda_attention_packed_splits(const tqkv_page_header_t *hdr, uint32_t n_pages)
{
    if (!hdr || !hdr->num_tokens)
        return 0;
    return n_pages * ((hdr->num_tokens + SPLIT_TOKENS - 1) / SPLIT_TOKENS);
}

extern "C" tqkv_status_t
tqkv_cuda_attention_packed(const tqkv_page_header_t *hdr, const void *const *d_pages,
                           uint32_t n_pages, const float *d_q, uint32_t num_q_heads, float sm_scale,
                           float *d_out, void *d_work, size_t work_bytes, cudaStream_t stream)
{
    packed_params_t A;
    tqkv_status_t st;
    if (!hdr || !d_pages || !n_pages || !d_q || !d_out || !d_work)
        return TQKV_EINVAL;
    if ((st = tqkv_cuda_header_check(hdr)) != TQKV_OK)
        return st;
    if (!hdr->tensor[0].bits_x2 || !hdr->tensor[1].bits_x2)
        return TQKV_EINVAL;
    memset(&A, 0, sizeof A);
    A.H = hdr->num_kv_heads;
    A.D = hdr->head_dim;
    A.HQ = num_q_heads;
    if (num_q_heads == 0 || num_q_heads % A.H)
        return TQKV_EINVAL;
    A.G = num_q_heads / A.H;
    A.k_raw = hdr->tensor[0].mode == TQKV_MODE_RAW;
    A.v_raw = hdr->tensor[1].mode == TQKV_MODE_RAW;
    A.nk = A.k_raw ? 0 : hdr->tensor[0].lo_bits ? 2 : 1;
    A.nv = A.v_raw ? 0 : hdr->tensor[1].lo_bits ? 2 : 1;
    A.k_prod = hdr->tensor[0].mode == TQKV_MODE_PROD;
    A.v_prod = hdr->tensor[1].mode == TQKV_MODE_PROD;
    A.centered = (hdr->flags & TQKV_PAGE_KEY_CENTERED) != 0;
    A.sm_scale = sm_scale != 0.0f ? sm_scale : 1.0f / sqrtf((float)A.D);
    for (uint32_t gi = 0; gi < A.nk; gi++) {
        if ((st = tqkv__cuda_group_codec(hdr, 0, gi, &A.K[gi])) != TQKV_OK)
            return st;
        A.lut_n += A.K[gi].dim * A.K[gi].n_centroids;
    }
    for (uint32_t gi = 0; gi < A.nv; gi++)
        if ((st = tqkv__cuda_group_codec(hdr, 1, gi, &A.V[gi])) != TQKV_OK)
            return st;
    A.splits_per_page = (hdr->num_tokens + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
    uint32_t n_splits = n_pages * A.splits_per_page;
    if (work_bytes < tqkv_cuda_attention_workspace(n_splits, num_q_heads, A.D))
        return TQKV_EINVAL;
    size_t smem = 0;
    for (A.qc = QC; A.qc > 1; A.qc >>= 1) /* fewer query heads per block for big tables */
        if (packed_smem_layout(A.D, A.lut_n, A.qc).total * sizeof(float) <= 200 * 1024)
            break;
    smem = (size_t)packed_smem_layout(A.D, A.lut_n, A.qc).total * sizeof(float);
    if (smem > 48 * 1024) {
        st = tqkv__cuda_status(cudaFuncSetAttribute(attn_packed_kernel,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    (int)smem),
                               "cudaFuncSetAttribute(attn_packed)");
        if (st != TQKV_OK)
            return st;
    }
    partials_t P = partials_at(d_work, n_splits, num_q_heads, A.D);
    dim3 grid(n_splits, A.H, (A.G + A.qc - 1) / A.qc);
    TQKV_LAUNCH(attn_packed_kernel, grid, ATTN_TILE, smem, stream, A, d_pages, d_q, P, n_splits);
    TQKV__CUDA_LAUNCH_CHECK("attn_packed_kernel");
    return launch_merge(d_work, n_splits, num_q_heads, A.D, d_out, stream);
}

/* ---- BF16 baseline ---- */

template <bool VEC>
static __global__ void
__launch_bounds__(BF16_WARPS * 32)
    attn_bf16_kernel(const uint16_t *__restrict__ k, const uint16_t *__restrict__ v, uint32_t T,
                     uint32_t H, uint32_t D, const float *__restrict__ q, uint32_t G,
                     float sm_scale, partials_t P, uint32_t n_splits, uint32_t HQ)
{
    TQKV_DYN_SMEM(float, sm);
    const uint32_t split = blockIdx.x, h = blockIdx.y, q0 = blockIdx.z * BF16_QC;
    const uint32_t nq = min((uint32_t)BF16_QC, G - q0);
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const uint32_t per = (T + n_splits - 1) / n_splits;
    const uint32_t t_begin = split * per, t_end = min(T, t_begin + per);
    float *qs = sm;                             /* [nq][D], times sm_scale */
    float *acc = qs + BF16_QC * D;              /* [warps][nq][D] */
    float *wm = acc + BF16_WARPS * BF16_QC * D; /* [warps][nq] */
    float *wl = wm + BF16_WARPS * BF16_QC;      /* [warps][nq] */
    float m[BF16_QC], l[BF16_QC];

    for (uint32_t e = threadIdx.x; e < nq * D; e += blockDim.x)
        qs[e] = q[(size_t)(h * G + q0) * D + e] * sm_scale;
    for (uint32_t e = threadIdx.x; e < BF16_WARPS * BF16_QC * D; e += blockDim.x)
        acc[e] = 0.0f;
    for (uint32_t qi = 0; qi < BF16_QC; qi++) {
        m[qi] = -INFINITY;
        l[qi] = 0.0f;
    }
    __syncthreads();
    float *wacc = acc + warp * BF16_QC * D;
    for (uint32_t t = t_begin + warp; t < t_end; t += BF16_WARPS) {
        const uint16_t *kr = k + ((size_t)t * H + h) * D, *vr = v + ((size_t)t * H + h) * D;
        float dot[BF16_QC];
        for (uint32_t qi = 0; qi < BF16_QC; qi++)
            dot[qi] = 0.0f;
        if (VEC) {
            for (uint32_t c = lane * 4; c < D; c += 128) {
                uint2 w = *(const uint2 *)(kr + c);
                float k0 = __uint_as_float(w.x << 16), k1 = __uint_as_float(w.x & 0xffff0000u);
                float k2 = __uint_as_float(w.y << 16), k3 = __uint_as_float(w.y & 0xffff0000u);
                for (uint32_t qi = 0; qi < nq; qi++) {
                    const float *qq = qs + qi * D + c;
                    dot[qi] += qq[0] * k0 + qq[1] * k1 + qq[2] * k2 + qq[3] * k3;
                }
            }
        } else {
            for (uint32_t c = lane; c < D; c += 32) {
                float kc = tqkv_bf16_to_f32(kr[c]);
                for (uint32_t qi = 0; qi < nq; qi++)
                    dot[qi] += qs[qi * D + c] * kc;
            }
        }
        for (uint32_t qi = 0; qi < nq; qi++) {
            float s = tqkv__warp_sum(dot[qi]);
            float mn = fmaxf(m[qi], s);
            float al = __expf(m[qi] - mn), p = __expf(s - mn);
            l[qi] = l[qi] * al + p;
            m[qi] = mn;
            if (VEC) {
                for (uint32_t c = lane * 4; c < D; c += 128) {
                    uint2 w = *(const uint2 *)(vr + c);
                    float *a = wacc + qi * D + c;
                    a[0] = a[0] * al + p * __uint_as_float(w.x << 16);
                    a[1] = a[1] * al + p * __uint_as_float(w.x & 0xffff0000u);
                    a[2] = a[2] * al + p * __uint_as_float(w.y << 16);
                    a[3] = a[3] * al + p * __uint_as_float(w.y & 0xffff0000u);
                }
            } else {
                for (uint32_t c = lane; c < D; c += 32)
                    wacc[qi * D + c] = wacc[qi * D + c] * al + p * tqkv_bf16_to_f32(vr[c]);
            }
        }
    }
    if (lane == 0)
        for (uint32_t qi = 0; qi < BF16_QC; qi++) {
            wm[warp * BF16_QC + qi] = m[qi];
            wl[warp * BF16_QC + qi] = l[qi];
        }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < nq * D; e += blockDim.x) {
        uint32_t qi = e / D, c = e % D;
        float M = -INFINITY, L = 0.0f, o = 0.0f;
        for (uint32_t w = 0; w < BF16_WARPS; w++)
            M = fmaxf(M, wm[w * BF16_QC + qi]);
        for (uint32_t w = 0; w < BF16_WARPS; w++) {
            float lw = wl[w * BF16_QC + qi];
            if (lw == 0.0f)
                continue;
            float f = __expf(wm[w * BF16_QC + qi] - M);
            L += f * lw;
            o += f * acc[(w * BF16_QC + qi) * D + c];
        }
        size_t slot = (size_t)split * HQ + h * G + q0 + qi;
        P.o[slot * D + c] = o;
        if (c == 0) {
            P.m[slot] = M;
            P.l[slot] = L;
        }
    }
}

extern "C" uint32_t
tqkv_cuda_attention_bf16_splits(uint32_t n_tokens, uint32_t num_kv_heads)
{
    uint32_t want, max_by_tokens;
    if (!n_tokens || !num_kv_heads)
        return 0;
    want = (1024 + num_kv_heads - 1) / num_kv_heads;
    max_by_tokens = (n_tokens + 63) / 64;
    return want < max_by_tokens ? want : max_by_tokens;
}

extern "C" tqkv_status_t
tqkv_cuda_attention_bf16(const uint16_t *d_k, const uint16_t *d_v, uint32_t n_tokens,
                         uint32_t num_kv_heads, uint32_t head_dim, const float *d_q,
                         uint32_t num_q_heads, float sm_scale, float *d_out, void *d_work,
                         size_t work_bytes, cudaStream_t stream)
{
    tqkv_status_t st;
    if (!d_k || !d_v || !d_q || !d_out || !d_work || !n_tokens || !num_kv_heads || !head_dim ||
        head_dim > TQKV_PAGE_MAX_DIM || !num_q_heads || num_q_heads % num_kv_heads)
        return TQKV_EINVAL;
    uint32_t n_splits = tqkv_cuda_attention_bf16_splits(n_tokens, num_kv_heads);
    if (work_bytes < tqkv_cuda_attention_workspace(n_splits, num_q_heads, head_dim))
        return TQKV_EINVAL;
    uint32_t G = num_q_heads / num_kv_heads;
    float scale = sm_scale != 0.0f ? sm_scale : 1.0f / sqrtf((float)head_dim);
    size_t smem =
        ((size_t)BF16_QC * head_dim * (1 + BF16_WARPS) + 2 * BF16_WARPS * BF16_QC) * sizeof(float);
    bool vec = head_dim % 128 == 0 && (uintptr_t)d_k % 8 == 0 && (uintptr_t)d_v % 8 == 0;
    partials_t P = partials_at(d_work, n_splits, num_q_heads, head_dim);
    dim3 grid(n_splits, num_kv_heads, (G + BF16_QC - 1) / BF16_QC);
    if (vec) {
        if (smem > 48 * 1024 &&
            (st = tqkv__cuda_status(
                 cudaFuncSetAttribute(attn_bf16_kernel<true>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "cudaFuncSetAttribute(attn_bf16)")) != TQKV_OK)
            return st;
        TQKV_LAUNCH(attn_bf16_kernel<true>, grid, BF16_WARPS * 32, smem, stream, d_k, d_v, n_tokens,
                    num_kv_heads, head_dim, d_q, G, scale, P, n_splits, num_q_heads);
    } else {
        if (smem > 48 * 1024 &&
            (st = tqkv__cuda_status(
                 cudaFuncSetAttribute(attn_bf16_kernel<false>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "cudaFuncSetAttribute(attn_bf16)")) != TQKV_OK)
            return st;
        TQKV_LAUNCH(attn_bf16_kernel<false>, grid, BF16_WARPS * 32, smem, stream, d_k, d_v,
                    n_tokens, num_kv_heads, head_dim, d_q, G, scale, P, n_splits, num_q_heads);
    }
    TQKV__CUDA_LAUNCH_CHECK("attn_bf16_kernel");
    return launch_merge(d_work, n_splits, num_q_heads, head_dim, d_out, stream);
}
