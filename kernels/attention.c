/* attention.c - fused decode attention on packed pages (driver, scalar kernels, reference)
 * (the BF16 attention baseline is attention_bf16.c).
 *
 * Driver: the sequence (pages in order) is cut into splits of split_tokens tokens. Each
 * split is processed independently (by the calling thread or by one of num_threads
 * workers): for every page overlapping it and every KV head, a work item (a task) scores
 * the page's keys from their codes with the rotated query, runs an online softmax over
 * tiles of tokens and accumulates values in the rotated domain; the driver rotates the
 * accumulators back (Pi^T, and S^T for prod values), scatters them to channels and merges
 * the partial state into the split's state (double, log-sum-exp merge). Split states are
 * merged at the end. The task kernel (scalar or AVX2) is chosen once at run time.
 */
#include "kernels/attention.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu.h"
#include "kernels/errtext.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

#define SQRT_HALF_PI 1.2533141373155003 /* sqrt(pi/2) */

/* ---- dispatch ---- */

/* The attention kernels of one ISA level (ggml style: one table, indexed by cpu.h's
 * tqkv_isa_t; the scalar row is what the SIMD rows are tested against). hadamard: the
 * driver's rotation (NULL: the rotation module's own); had_mult: the dimensions it takes
 * are multiples of had_mult. */
typedef struct attn_kernels {
    tqkv__attn_task_fn task;
    tqkv__attn_bf16_fn bf16;
    tqkv__attn_had_fn hadamard;
    uint32_t had_mult;
} attn_kernels_t;

static const attn_kernels_t attn_table[] = {
    [TQKV_ISA_SCALAR] = {tqkv__attn_task_scalar, tqkv__attn_bf16_scalar, NULL, 0},
    [TQKV_ISA_AVX2] = {tqkv__attn_task_avx2, tqkv__attn_bf16_avx2, tqkv__attn_hadamard_avx2, 8},
    [TQKV_ISA_AVX512] = {tqkv__attn_task_avx512, tqkv__attn_bf16_avx512, tqkv__attn_hadamard_avx512,
                         16},
};

static int isa_cap; /* TQKV_ATTN_ISA_*: tqkv_attn_set_isa_cap, or TQKV_ATTN_ISA at first use */
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static void
isa_init(void)
{
    /* TQKV_ATTN_ISA: deprecated alias of TQKV_ISA that caps the attention kernels only */
    const char *e = getenv("TQKV_ATTN_ISA");
    isa_cap = e && !strcmp(e, "scalar") ? TQKV_ATTN_ISA_SCALAR
              : e && !strcmp(e, "avx2") ? TQKV_ATTN_ISA_AVX2
                                        : TQKV_ATTN_ISA_BEST;
}

/* The level in use: the best usable (cpu.h: the CPU, capped by TQKV_ISA) under isa_cap. */
static tqkv_isa_t
level(void)
{
    tqkv_isa_t lvl = tqkv_isa_level();
    pthread_once(&isa_once, isa_init);
    if (isa_cap == TQKV_ATTN_ISA_SCALAR)
        return TQKV_ISA_SCALAR;
    if (isa_cap == TQKV_ATTN_ISA_AVX2 && lvl > TQKV_ISA_AVX2)
        return TQKV_ISA_AVX2;
    return lvl;
}

static const attn_kernels_t *
kernels(void)
{
    return &attn_table[level()];
}

tqkv__attn_bf16_fn
tqkv__attn_bf16_kernel(void)
{
    return kernels()->bf16;
}

const char *
tqkv_attn_isa(void)
{
    return tqkv_isa_name(level());
}

void
tqkv_attn_set_isa_cap(int cap)
{
    pthread_once(&isa_once, isa_init);
    isa_cap = cap;
}

void
tqkv_attn_force_scalar(int on)
{
    tqkv_attn_set_isa_cap(on ? TQKV_ATTN_ISA_SCALAR : TQKV_ATTN_ISA_BEST);
}

void
tqkv_attn_opts_default(tqkv_attn_opts_t *o)
{
    memset(o, 0, sizeof *o);
    o->split_tokens = 4096;
    o->num_threads = 1;
    o->check_crc = 0;
    o->sm_scale = 0.0f;
}

/* ---- scalar task kernel ---- */

static inline float
stream_field(const tqkv__attn_stream_t *s, uint32_t t, uint32_t j)
{
    return s->table[tqkv_bits_get(s->rows + (size_t)t * s->stride, j, s->bits)];
}

void
tqkv__attn_task_scalar(const tqkv__attn_task_t *tk)
{
    const uint32_t G = tk->G, T = tk->num_tokens;
    float *sc = tk->scratch; /* [G][TILE] scores, then probabilities */

    for (uint32_t h = 0; h < G; h++) {
        tk->m[h] = -INFINITY;
        tk->l[h] = 0.0f;
    }
    for (uint32_t s = 0; s < tk->nv; s++)
        memset(tk->acc[s], 0, sizeof(float) * G * tk->v[s].gdim);

    if (tk->v_raw)
        memset(tk->o_raw, 0, sizeof(float) * G * tk->D);

    for (uint32_t t0 = 0; t0 < T; t0 += TQKV__ATTN_TILE) {
        uint32_t n = T - t0 < TQKV__ATTN_TILE ? T - t0 : TQKV__ATTN_TILE;
        tqkv__attn_prefetch_slice(tk, t0, t0 + n);
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t h = 0; h < G; h++) {
                float score = tk->qbias ? tk->qbias[h] : 0.0f;
                if (tk->k_raw) { /* lossless keys: q . k in f32 */
                    const uint16_t *kr = tk->k_raw + (size_t)(t0 + i) * tk->raw_stride;
                    const float *qv = tk->q_raw + (size_t)h * tk->D;
                    float dot = 0.0f;
                    for (uint32_t j = 0; j < tk->D; j++)
                        dot += qv[j] * tqkv_bf16_to_f32(kr[j]);
                    score += dot;
                }
                for (uint32_t s = 0; s < tk->nk; s++) {
                    const tqkv__attn_stream_t *st = &tk->k[s];
                    const float *qv = tk->qk[s] + (size_t)h * st->gdim;
                    /* 8 partial sums, as the AVX2 kernel's lanes: one running f32 sum
                     * over 128 products drifted to 1.5e-5 of the oracle on outlier keys
                     * (check_attention center_decision, 9 of 88 seeds over the 1e-5
                     * contract; 8 sums: at most 6.7e-6, as AVX2) */
                    float d8[8] = {0};
                    for (uint32_t j = 0; j < st->gdim; j++)
                        d8[j & 7] += qv[j] * stream_field(st, t0 + i, j);
                    float dot =
                        ((d8[0] + d8[4]) + (d8[1] + d8[5])) + ((d8[2] + d8[6]) + (d8[3] + d8[7]));
                    score += st->coef[t0 + i] * dot;
                }
                sc[h * TQKV__ATTN_TILE + i] = score;
            }
        for (uint32_t h = 0; h < G; h++) {
            float *row = sc + h * TQKV__ATTN_TILE;
            float mx = tk->m[h], alpha, sum = 0.0f;
            for (uint32_t i = 0; i < n; i++)
                mx = row[i] > mx ? row[i] : mx;
            alpha = expf(tk->m[h] - mx);
            for (uint32_t i = 0; i < n; i++) {
                row[i] = expf(row[i] - mx);
                sum += row[i];
            }
            tk->l[h] = tk->l[h] * alpha + sum;
            tk->m[h] = mx;
            if (alpha != 1.0f)
                for (uint32_t s = 0; s < tk->nv; s++) {
                    float *a = tk->acc[s] + (size_t)h * tk->v[s].gdim;
                    for (uint32_t j = 0; j < tk->v[s].gdim; j++)
                        a[j] *= alpha;
                }
            if (alpha != 1.0f && tk->v_raw)
                for (uint32_t j = 0; j < tk->D; j++)
                    tk->o_raw[(size_t)h * tk->D + j] *= alpha;
        }
        if (tk->v_raw) /* lossless values: sum p_i v_i */
            for (uint32_t i = 0; i < n; i++) {
                const uint16_t *vr = tk->v_raw + (size_t)(t0 + i) * tk->raw_stride;
                for (uint32_t h = 0; h < G; h++) {
                    float w = sc[h * TQKV__ATTN_TILE + i], *a = tk->o_raw + (size_t)h * tk->D;
                    for (uint32_t j = 0; j < tk->D; j++)
                        a[j] += w * tqkv_bf16_to_f32(vr[j]);
                }
            }
        for (uint32_t s = 0; s < tk->nv; s++) {
            const tqkv__attn_stream_t *st = &tk->v[s];
            for (uint32_t i = 0; i < n; i++)
                for (uint32_t h = 0; h < G; h++) {
                    float w = sc[h * TQKV__ATTN_TILE + i] * st->coef[t0 + i];
                    float *a = tk->acc[s] + (size_t)h * st->gdim;
                    for (uint32_t j = 0; j < st->gdim; j++)
                        a[j] += w * stream_field(st, t0 + i, j);
                }
        }
    }
}

/* Rotation of the fused driver: the SIMD Hadamard when available (it runs once per page,
 * head, group and query head, so the scalar FWHT would cost as much as the scoring),
 * else the rotation module's own. */
static void
rot_apply(const tqkv_rotation_t *r, const float *x, float *y, int transpose)
{
    /* the level's Hadamard, or the next level down's for dimensions it does not take */
    for (int l = (int)level(); r->kind == TQKV_ROT_HADAMARD && l > TQKV_ISA_SCALAR; l--) {
        const attn_kernels_t *K = &attn_table[l];
        if (r->dim >= K->had_mult && r->dim % K->had_mult == 0) {
            K->hadamard(r->signs, r->dim, x, y, transpose);
            return;
        }
    }
    if (transpose)
        tqkv_rotation_apply_t(r, x, y);
    else
        tqkv_rotation_apply(r, x, y);
}

/* ---- page checks ---- */

tqkv_status_t
tqkv_attn_check_pages(const void *const *pages, const size_t *page_lens, size_t n_pages,
                      int check_crc, uint32_t *num_kv_heads, uint32_t *head_dim,
                      uint64_t *num_tokens, char *err, size_t errlen)
{
    uint32_t H = 0, D = 0;
    uint64_t total = 0;
    char why[160];
    if (!pages || !page_lens || n_pages == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "no pages");
    for (size_t p = 0; p < n_pages; p++) {
        tqkv_page_info_t info;
        tqkv_status_t st;
        if (!pages[p])
            return tqkv_errtext(TQKV_EINVAL, err, errlen, "page %zu is NULL", p);
        why[0] = '\0';
        st = tqkv_page_validate(pages[p], page_lens[p], check_crc, &info, why, sizeof why);
        if (st != TQKV_OK)
            return tqkv_errtext(st, err, errlen, "page %zu: %s", p,
                                why[0] ? why : tqkv_strerror(st));
        if (info.codec.k.bits_x2 == 0 || info.codec.v.bits_x2 == 0)
            return tqkv_errtext(TQKV_EINVAL, err, errlen, "page %zu holds no %s", p,
                                info.codec.k.bits_x2 == 0 ? "keys" : "values");
        if (p == 0) {
            H = info.shape.num_kv_heads;
            D = info.shape.head_dim;
        } else if (info.shape.num_kv_heads != H || info.shape.head_dim != D) {
            return tqkv_errtext(
                TQKV_EINVAL, err, errlen,
                "page %zu has %u KV heads x head_dim %u, page 0 has %u x %u: pages of one "
                "sequence must match",
                p, info.shape.num_kv_heads, info.shape.head_dim, H, D);
        }
        total += info.shape.num_tokens;
    }
    if (num_kv_heads)
        *num_kv_heads = H;
    if (head_dim)
        *head_dim = D;
    if (num_tokens)
        *num_tokens = total;
    return TQKV_OK;
}

/* ---- the page-level plumbing shared by the driver and the reference ---- */

/* One channel group of one tensor of a page, with its transforms acquired. */
typedef struct group_ctx {
    int present;
    tqkv_group_view_t gv;
    const tqkv_rotation_t *rot; /* Pi (mse_bits > 0) */
    const tqkv_rotation_t *qjl; /* S (prod) */
} group_ctx_t;

typedef struct page_ctx {
    const void *page;
    const tqkv_page_header_t *hdr;
    uint32_t T, H, D;
    const uint8_t *end;
    group_ctx_t g[2][2];    /* [tensor][group] */
    const uint16_t *raw[2]; /* [tensor]: the raw section of a lossless tensor, or NULL */
} page_ctx_t;

static void
page_ctx_release(page_ctx_t *pc)
{
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < 2; g++) {
            if (pc->g[t][g].rot)
                tqkv_rotation_release(pc->g[t][g].rot);
            if (pc->g[t][g].qjl)
                tqkv_rotation_release(pc->g[t][g].qjl);
            pc->g[t][g].rot = pc->g[t][g].qjl = NULL;
        }
}

/* Resolves the groups of a validated page and acquires their transforms. */
static tqkv_status_t
page_ctx_init(page_ctx_t *pc, const void *page)
{
    tqkv_status_t st;
    memset(pc, 0, sizeof *pc);
    pc->page = page;
    pc->hdr = (const tqkv_page_header_t *)page;
    pc->T = pc->hdr->num_tokens;
    pc->H = pc->hdr->num_kv_heads;
    pc->D = pc->hdr->head_dim;
    pc->end = (const uint8_t *)page + pc->hdr->page_bytes;
    for (uint32_t t = 0; t < 2; t++)
        pc->raw[t] = tqkv_page_raw(page, t);
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t g = 0; g < 2; g++) {
            group_ctx_t *gc = &pc->g[t][g];
            if (tqkv_page_group_view(page, t, g, &gc->gv) != 0)
                continue;
            gc->present = 1;
            if (gc->gv.L.mse_bits > 0) {
                st =
                    tqkv_rotation_acquire(gc->gv.rotation, gc->gv.L.dim, gc->gv.rot_seed, &gc->rot);
                if (st != TQKV_OK)
                    goto fail;
            }
            if (gc->gv.L.mode == TQKV_MODE_PROD) {
                st = tqkv_rotation_acquire(TQKV_ROT_QJL_GAUSS, gc->gv.L.dim, gc->gv.qjl_seed,
                                           &gc->qjl);
                if (st != TQKV_OK)
                    goto fail;
            }
        }
    return TQKV_OK;
fail:
    page_ctx_release(pc);
    return st;
}

/* Channels of both groups of tensor t for head h, in increasing order, in one branchless
 * pass: hi[] gets the outlier (group 0) channels, lo[] the others; returns the count of hi.
 * Without a mask every channel is in group 0. */
static uint32_t
split_channels(const page_ctx_t *pc, uint32_t t, uint32_t h, uint32_t *hi, uint32_t *lo)
{
    const uint8_t *mask = tqkv_page_mask(pc->page, t, h);
    uint32_t nh = 0, nl = 0;
    for (uint32_t c = 0; c < pc->D; c++) {
        uint32_t bit = mask ? (mask[c >> 3] >> (c & 7)) & 1u : 1u;
        hi[nh] = c;
        lo[nl] = c;
        nh += bit;
        nl += bit ^ 1u;
    }
    return nh;
}

/* Channels of group g of tensor t for head h, in increasing order; returns the count,
 * which must equal the group's dimension (checked by the caller). */
static uint32_t
group_channels(const page_ctx_t *pc, uint32_t t, uint32_t g, uint32_t h, uint32_t *ch)
{
    const uint8_t *mask = tqkv_page_mask(pc->page, t, h);
    uint32_t n = 0;
    for (uint32_t c = 0; c < pc->D; c++) {
        int in_hi = mask ? (mask[c >> 3] >> (c & 7)) & 1 : 1;
        if ((g == 0) == (in_hi != 0))
            ch[n++] = c;
    }
    return n;
}

/* The table of a stream: codebook (replicated to 8 entries when b < 4) or {-1, +1}. */
static void
stream_table(float *table, const float *z, uint32_t bits)
{
    uint32_t n = 1u << bits;
    for (uint32_t m = 0; m < 16; m++)
        table[m] = z[m & (n - 1)];
}

/* ---- driver ---- */

/* Most splits of one call: each holds HQ x (D + 2) doubles until the final merge. */
#define MAX_SPLITS 256

typedef struct split_state {
    double *m, *l, *o; /* [HQ], [HQ], [HQ][D] */
} split_state_t;

typedef struct attn_ctx {
    const float *q;
    uint32_t HQ, H, D, G;
    float sm_scale;
    const void *const *pages;
    size_t n_pages;
    const uint64_t *page_start; /* [n_pages + 1] global token offsets */
    uint64_t split_tokens;      /* > 0 */
    size_t n_splits;
    uint32_t max_item_tokens;
    tqkv__attn_task_fn task_fn;
    split_state_t *splits;
    /* worker pool */
    pthread_mutex_t lock;
    size_t next_split;
    tqkv_status_t status;
} attn_ctx_t;

/* Workspace of one thread. */
typedef struct attn_ws {
    float *qk;      /* [4][G][D] */
    float *acc;     /* [4][G][D] */
    float *coef;    /* [8][max_item_tokens] */
    float *scratch; /* [2][G][TILE] */
    float *qbias;   /* [G] */
    float *m, *l;   /* [G] */
    float *tmp;     /* [2][D] */
    float *o;       /* [G][D] */
    uint32_t *ch;   /* [2][2][D] channel lists */
} attn_ws_t;

static void
ws_free(attn_ws_t *w)
{
    free(w->qk);
    free(w->acc);
    free(w->coef);
    free(w->scratch);
    free(w->qbias);
    free(w->m);
    free(w->l);
    free(w->tmp);
    free(w->o);
    free(w->ch);
    memset(w, 0, sizeof *w);
}

static tqkv_status_t
ws_alloc(attn_ws_t *w, uint32_t G, uint32_t D, uint32_t max_tokens)
{
    memset(w, 0, sizeof *w);
    w->qk = aligned_alloc(64, tqkv_align_up(sizeof(float) * 4 * G * D, 64));
    w->acc = aligned_alloc(64, tqkv_align_up(sizeof(float) * 4 * G * D, 64));
    w->coef = aligned_alloc(64, tqkv_align_up(sizeof(float) * 8 * (size_t)max_tokens, 64));
    w->scratch = aligned_alloc(64, sizeof(float) * 2 * G * TQKV__ATTN_TILE);
    w->qbias = malloc(sizeof(float) * G);
    w->m = malloc(sizeof(float) * G);
    w->l = malloc(sizeof(float) * G);
    w->tmp = malloc(sizeof(float) * 2 * D);
    w->o = malloc(sizeof(float) * G * D);
    w->ch = malloc(sizeof(uint32_t) * 4 * D);
    if (!w->qk || !w->acc || !w->coef || !w->scratch || !w->qbias || !w->m || !w->l || !w->tmp ||
        !w->o || !w->ch) {
        ws_free(w);
        return TQKV_ENOMEM;
    }
    return TQKV_OK;
}

/* Merges a partial state (m, l, o unnormalized) of G heads starting at hq0 into s. */
static void
merge_partial(const attn_ctx_t *c, split_state_t *s, uint32_t hq0, const float *m, const float *l,
              const float *o)
{
    for (uint32_t j = 0; j < c->G; j++) {
        uint32_t hq = hq0 + j;
        double M, a, b;
        if (!(l[j] > 0.0f))
            continue;
        M = s->m[hq] > m[j] ? s->m[hq] : m[j];
        a = s->l[hq] > 0.0 ? exp(s->m[hq] - M) : 0.0;
        b = exp((double)m[j] - M);
        s->l[hq] = s->l[hq] * a + (double)l[j] * b;
        s->m[hq] = M;
        for (uint32_t d = 0; d < c->D; d++)
            s->o[(size_t)hq * c->D + d] =
                s->o[(size_t)hq * c->D + d] * a + (double)o[(size_t)j * c->D + d] * b;
    }
}

/* Fills the streams of tensor t for head h and tokens [t0, t0 + n) of a page. For K also
 * builds the query in each stream's domain (times sm_scale). Returns the stream count or
 * -1 when a mask does not match the group sizes (a corrupt page). */
static int
build_streams(const attn_ctx_t *c, const page_ctx_t *pc, attn_ws_t *w, uint32_t tensor, uint32_t h,
              uint32_t t0, uint32_t n, tqkv__attn_task_t *tk)
{
    tqkv__attn_stream_t *ss = tensor == TQKV_TENSOR_K ? tk->k : tk->v;
    int ns = 0;
    uint32_t nhi =
        split_channels(pc, tensor, h, w->ch + (tensor * 2) * c->D, w->ch + (tensor * 2 + 1) * c->D);
    for (uint32_t g = 0; g < 2; g++) {
        const group_ctx_t *gc = &pc->g[tensor][g];
        const tqkv_group_view_t *gv = &gc->gv;
        uint32_t gd, *ch = w->ch + (tensor * 2 + g) * c->D;
        if (!gc->present)
            continue;
        gd = gv->L.dim;
        if ((g == 0 ? nhi : c->D - nhi) != gd)
            return -1;
        for (int kind = 0; kind < 2; kind++) {
            tqkv__attn_stream_t *st = &ss[ns];
            float *coef = w->coef + (size_t)(tensor * 4 + ns) * c->max_item_tokens;
            uint64_t v0 = (uint64_t)t0 * pc->H + h;
            if (kind == 0 && gv->L.mse_bits == 0)
                continue;
            if (kind == 1 && gv->L.mode != TQKV_MODE_PROD)
                continue;
            st->bits = kind == 0 ? gv->L.mse_bits : 1;
            st->row_bytes = kind == 0 ? gv->L.idx_row_bytes : gv->L.sign_row_bytes;
            st->rows = (kind == 0 ? gv->idx : gv->signs) + v0 * st->row_bytes;
            st->stride = (size_t)pc->H * st->row_bytes;
            st->gdim = gd;
            st->limit = pc->end;
            if (kind == 0) {
                stream_table(st->table, gv->codebook, st->bits);
                for (uint32_t i = 0; i < n; i++)
                    coef[i] = tqkv_scale_get(gv->scale, v0 + (uint64_t)i * pc->H);
            } else {
                static const float pm1[2] = {-1.0f, 1.0f};
                float k = (float)(SQRT_HALF_PI / sqrt((double)gd));
                stream_table(st->table, pm1, 1);
                for (uint32_t i = 0; i < n; i++)
                    coef[i] = k * tqkv_scale_get(gv->gamma, v0 + (uint64_t)i * pc->H);
            }
            st->coef = coef;
            if (tensor == TQKV_TENSOR_K) {
                float *qk = w->qk + (size_t)ns * c->G * c->D;
                const tqkv_rotation_t *r = kind == 0 ? gc->rot : gc->qjl;
                for (uint32_t j = 0; j < c->G; j++) {
                    const float *qh = c->q + (size_t)(h * c->G + j) * c->D;
                    for (uint32_t i = 0; i < gd; i++)
                        w->tmp[i] = qh[ch[i]] * c->sm_scale;
                    rot_apply(r, w->tmp, qk + (size_t)j * gd, 0);
                }
                tk->qk[ns] = qk;
            } else {
                tk->acc[ns] = w->acc + (size_t)ns * c->G * c->D;
            }
            ns++;
        }
    }
    return ns;
}

/* A lossless page (K and V raw BF16): the BF16 kernel over the item's rows, per KV head. */
static tqkv_status_t
run_item_raw(const attn_ctx_t *c, const page_ctx_t *pc, attn_ws_t *w, uint32_t t0, uint32_t n,
             split_state_t *s, const uint8_t *next, size_t next_bytes)
{
    tqkv__attn_bf16_fn fn = kernels()->bf16;
    size_t part = (next_bytes + c->H - 1) / c->H;
    for (uint32_t h = 0; h < c->H; h++) {
        size_t off = ((size_t)t0 * c->H + h) * c->D, pf = 0;
        const uint8_t *pfp = NULL;
        if (next && (size_t)h * part < next_bytes) {
            pfp = next + (size_t)h * part;
            pf = next_bytes - (size_t)h * part < part ? next_bytes - (size_t)h * part : part;
        }
        for (uint32_t j = 0; j < c->G; j++) {
            w->m[j] = -INFINITY;
            w->l[j] = 0.0f;
        }
        memset(w->o, 0, sizeof(float) * c->G * c->D);
        fn(c->q + (size_t)h * c->G * c->D, c->G, pc->raw[TQKV_TENSOR_K] + off,
           pc->raw[TQKV_TENSOR_V] + off, n, (size_t)c->H * c->D, c->D, c->sm_scale, w->o, w->m,
           w->l, w->scratch, pfp, pfp, pf);
        merge_partial(c, s, h * c->G, w->m, w->l, w->o);
    }
    return TQKV_OK;
}

/* Runs the work item (page pc, tokens [t0, t0+n)) for every KV head and merges it into s. */
static tqkv_status_t
run_item(const attn_ctx_t *c, const page_ctx_t *pc, attn_ws_t *w, uint32_t t0, uint32_t n,
         split_state_t *s, const uint8_t *next, size_t next_bytes)
{
    size_t part = (next_bytes + c->H - 1) / c->H;
    if (pc->raw[TQKV_TENSOR_K] && pc->raw[TQKV_TENSOR_V])
        return run_item_raw(c, pc, w, t0, n, s, next, next_bytes);
    for (uint32_t h = 0; h < c->H; h++) {
        tqkv__attn_task_t tk;
        const float *mu = tqkv_page_key_mean(pc->page, h);
        int nk, nv;
        memset(&tk, 0, sizeof tk);
        nk = build_streams(c, pc, w, TQKV_TENSOR_K, h, t0, n, &tk);
        nv = build_streams(c, pc, w, TQKV_TENSOR_V, h, t0, n, &tk);
        if (nk < 0 || nv < 0)
            return TQKV_ECORRUPT;
        if (next && (size_t)h * part < next_bytes) {
            tk.pf = next + (size_t)h * part;
            tk.pf_bytes =
                next_bytes - (size_t)h * part < part ? next_bytes - (size_t)h * part : part;
        }
        tk.num_tokens = n;
        tk.G = c->G;
        tk.nk = (uint32_t)nk;
        tk.nv = (uint32_t)nv;
        tk.qbias = NULL;
        if (mu) {
            for (uint32_t j = 0; j < c->G; j++) {
                const float *qh = c->q + (size_t)(h * c->G + j) * c->D;
                float dot = 0.0f;
                for (uint32_t d = 0; d < c->D; d++)
                    dot += qh[d] * mu[d];
                w->qbias[j] = dot * c->sm_scale;
            }
            tk.qbias = w->qbias;
        }
        tk.m = w->m;
        tk.l = w->l;
        tk.scratch = w->scratch;
        if (pc->raw[TQKV_TENSOR_K] || pc->raw[TQKV_TENSOR_V]) {
            /* one lossless tensor: the scalar kernel reads its BF16 rows */
            size_t off = ((size_t)t0 * c->H + h) * c->D;
            tk.raw_stride = (size_t)c->H * c->D;
            tk.D = c->D;
            if (pc->raw[TQKV_TENSOR_K]) {
                tk.k_raw = pc->raw[TQKV_TENSOR_K] + off;
                for (uint32_t e = 0; e < c->G * c->D; e++)
                    w->qk[e] = c->q[(size_t)h * c->G * c->D + e] * c->sm_scale;
                tk.q_raw = w->qk;
            }
            if (pc->raw[TQKV_TENSOR_V]) {
                tk.v_raw = pc->raw[TQKV_TENSOR_V] + off;
                tk.o_raw = w->o;
            }
            tqkv__attn_task_scalar(&tk);
        } else {
            c->task_fn(&tk);
        }

        /* Rotate the value accumulators back and scatter them to channels (a lossless V
         * has accumulated into w->o already). */
        if (!pc->raw[TQKV_TENSOR_V])
            memset(w->o, 0, sizeof(float) * c->G * c->D);
        {
            int si = 0;
            for (uint32_t g = 0; g < 2; g++) {
                const group_ctx_t *gc = &pc->g[TQKV_TENSOR_V][g];
                const uint32_t *ch = w->ch + (TQKV_TENSOR_V * 2 + g) * c->D;
                uint32_t gd;
                if (!gc->present)
                    continue;
                gd = gc->gv.L.dim;
                for (int kind = 0; kind < 2; kind++) {
                    const tqkv_rotation_t *r = kind == 0 ? gc->rot : gc->qjl;
                    if (!r)
                        continue;
                    for (uint32_t j = 0; j < c->G; j++) {
                        rot_apply(r, tk.acc[si] + (size_t)j * gd, w->tmp, 1);
                        for (uint32_t i = 0; i < gd; i++)
                            w->o[(size_t)j * c->D + ch[i]] += w->tmp[i];
                    }
                    si++;
                }
            }
        }
        merge_partial(c, s, h * c->G, w->m, w->l, w->o);
    }
    return TQKV_OK;
}

/* Computes the state of split si. */
static tqkv_status_t
run_split(attn_ctx_t *c, attn_ws_t *w, size_t si)
{
    uint64_t lo = (uint64_t)si * c->split_tokens, hi = lo + c->split_tokens;
    split_state_t *s = &c->splits[si];
    for (uint32_t hq = 0; hq < c->HQ; hq++) {
        s->m[hq] = -INFINITY;
        s->l[hq] = 0.0;
    }
    memset(s->o, 0, sizeof(double) * c->HQ * c->D);
    for (size_t p = 0; p < c->n_pages; p++) {
        uint64_t ps = c->page_start[p], pe = c->page_start[p + 1], a, b;
        page_ctx_t pc;
        tqkv_status_t st;
        if (pe <= lo || ps >= hi)
            continue;
        a = ps > lo ? ps : lo;
        b = pe < hi ? pe : hi;
        if ((st = page_ctx_init(&pc, c->pages[p])) != TQKV_OK)
            return st;
        for (uint64_t t = a; t < b; t += c->max_item_tokens) {
            uint64_t e = t + c->max_item_tokens < b ? t + c->max_item_tokens : b;
            const uint8_t *next = NULL;
            size_t next_bytes = 0;
            if (e == pe && e < hi && p + 1 < c->n_pages) {
                next = c->pages[p + 1];
                next_bytes = ((const tqkv_page_header_t *)next)->page_bytes;
            }
            st = run_item(c, &pc, w, (uint32_t)(t - ps), (uint32_t)(e - t), s, next, next_bytes);
            if (st != TQKV_OK) {
                page_ctx_release(&pc);
                return st;
            }
        }
        page_ctx_release(&pc);
    }
    return TQKV_OK;
}

static void *
worker(void *arg)
{
    attn_ctx_t *c = arg;
    attn_ws_t w;
    tqkv_status_t st = ws_alloc(&w, c->G, c->D, c->max_item_tokens);
    for (;;) {
        size_t si;
        pthread_mutex_lock(&c->lock);
        if (st != TQKV_OK && c->status == TQKV_OK)
            c->status = st;
        si = c->next_split++;
        if (c->status != TQKV_OK)
            si = c->n_splits;
        pthread_mutex_unlock(&c->lock);
        if (si >= c->n_splits)
            break;
        st = run_split(c, &w, si);
    }
    ws_free(&w);
    return NULL;
}

tqkv_status_t
tqkv_attn_decode_ex(const float *q, uint32_t num_q_heads, const void *const *pages,
                    const size_t *page_lens, size_t n_pages, const tqkv_attn_opts_t *opts,
                    float *out, char *err, size_t errlen)
{
    tqkv_attn_opts_t dflt;
    attn_ctx_t c;
    uint64_t total, *starts = NULL;
    uint32_t max_page = 0, nthreads;
    double *mem = NULL;
    tqkv_status_t st;

    if (!opts) {
        tqkv_attn_opts_default(&dflt);
        opts = &dflt;
    }
    if (!q || !out || num_q_heads == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "NULL query/output or zero query heads");
    memset(&c, 0, sizeof c);
    st = tqkv_attn_check_pages(pages, page_lens, n_pages, opts->check_crc, &c.H, &c.D, &total, err,
                               errlen);
    if (st != TQKV_OK)
        return st;
    if (num_q_heads % c.H != 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "%u query heads is not a multiple of the pages' %u KV heads",
                            num_q_heads, c.H);
    if (total == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "the pages hold no tokens");
    c.q = q;
    c.HQ = num_q_heads;
    c.G = num_q_heads / c.H;
    c.sm_scale = opts->sm_scale > 0.0f ? opts->sm_scale : (float)(1.0 / sqrt((double)c.D));
    c.pages = pages;
    c.n_pages = n_pages;
    c.split_tokens = opts->split_tokens ? opts->split_tokens : total;
    if ((total + c.split_tokens - 1) / c.split_tokens > MAX_SPLITS)
        c.split_tokens = (total + MAX_SPLITS - 1) / MAX_SPLITS; /* bounds the split states */
    c.n_splits = (size_t)((total + c.split_tokens - 1) / c.split_tokens);
    c.task_fn = kernels()->task;

    starts = malloc(sizeof(uint64_t) * (n_pages + 1));
    c.splits = calloc(c.n_splits, sizeof(split_state_t));
    mem = malloc(sizeof(double) * c.n_splits * (size_t)c.HQ * (2 + c.D));
    if (!starts || !c.splits || !mem) {
        st = TQKV_ENOMEM;
        st = tqkv_errtext(st, err, errlen, "out of memory");
        goto done;
    }
    starts[0] = 0;
    for (size_t p = 0; p < n_pages; p++) {
        uint32_t T = ((const tqkv_page_header_t *)pages[p])->num_tokens;
        starts[p + 1] = starts[p] + T;
        max_page = T > max_page ? T : max_page;
    }
    c.page_start = starts;
    c.max_item_tokens = c.split_tokens < max_page ? (uint32_t)c.split_tokens : max_page;
    for (size_t s = 0; s < c.n_splits; s++) {
        double *b = mem + s * (size_t)c.HQ * (2 + c.D);
        c.splits[s].m = b;
        c.splits[s].l = b + c.HQ;
        c.splits[s].o = b + 2 * c.HQ;
    }

    nthreads = opts->num_threads ? opts->num_threads : 1;
    if (nthreads > c.n_splits)
        nthreads = (uint32_t)c.n_splits;
    if (nthreads <= 1) {
        attn_ws_t w;
        if ((st = ws_alloc(&w, c.G, c.D, c.max_item_tokens)) != TQKV_OK) {
            st = tqkv_errtext(st, err, errlen, "out of memory");
            goto done;
        }
        for (size_t s = 0; s < c.n_splits && st == TQKV_OK; s++)
            st = run_split(&c, &w, s);
        ws_free(&w);
    } else {
        pthread_t *th = malloc(sizeof(pthread_t) * nthreads);
        uint32_t started = 0;
        if (!th) {
            st = TQKV_ENOMEM;
            st = tqkv_errtext(st, err, errlen, "out of memory");
            goto done;
        }
        pthread_mutex_init(&c.lock, NULL);
        c.status = TQKV_OK;
        for (uint32_t i = 1; i < nthreads; i++)
            if (pthread_create(&th[started], NULL, worker, &c) == 0)
                started++;
        worker(&c);
        for (uint32_t i = 0; i < started; i++)
            pthread_join(th[i], NULL);
        pthread_mutex_destroy(&c.lock);
        free(th);
        st = c.status;
    }
    if (st != TQKV_OK) {
        st = tqkv_errtext(st, err, errlen, "%s",
                          st == TQKV_ECORRUPT ? "page outlier mask is corrupt" : tqkv_strerror(st));
        goto done;
    }

    /* Merge the splits (log-sum-exp) and normalize. */
    for (uint32_t hq = 0; hq < c.HQ; hq++) {
        double M = -INFINITY, L = 0.0;
        for (size_t s = 0; s < c.n_splits; s++)
            if (c.splits[s].l[hq] > 0.0 && c.splits[s].m[hq] > M)
                M = c.splits[s].m[hq];
        for (uint32_t d = 0; d < c.D; d++)
            out[(size_t)hq * c.D + d] = 0.0f;
        {
            double *acc = c.splits[0].o + (size_t)hq * c.D; /* reuse split 0's row */
            double w0 = c.splits[0].l[hq] > 0.0 ? exp(c.splits[0].m[hq] - M) : 0.0;
            L = c.splits[0].l[hq] * w0;
            for (uint32_t d = 0; d < c.D; d++)
                acc[d] *= w0;
            for (size_t s = 1; s < c.n_splits; s++) {
                double ws;
                if (!(c.splits[s].l[hq] > 0.0))
                    continue;
                ws = exp(c.splits[s].m[hq] - M);
                L += c.splits[s].l[hq] * ws;
                for (uint32_t d = 0; d < c.D; d++)
                    acc[d] += c.splits[s].o[(size_t)hq * c.D + d] * ws;
            }
            for (uint32_t d = 0; d < c.D; d++)
                out[(size_t)hq * c.D + d] = (float)(acc[d] / L);
        }
    }
    st = TQKV_OK;
done:
    free(mem);
    free(c.splits);
    free(starts);
    return st;
}

tqkv_status_t
tqkv_attn_decode(const float *q, uint32_t num_q_heads, const void *const *pages,
                 const size_t *page_lens, size_t n_pages, const tqkv_attn_opts_t *opts, float *out)
{
    return tqkv_attn_decode_ex(q, num_q_heads, pages, page_lens, n_pages, opts, out, NULL, 0);
}

/* ---- reference ---- */

/* Scratch of the reference, D entries each. */
typedef struct ref_scratch {
    double *acc;
    float *qc, *qr, *tmp;
    uint32_t *ch;
} ref_scratch_t;

/* Pass 1 of the reference on one page: the score of each of its pc->T keys of KV head h
 * for query head qh into s, unscaled, from the codes: <q, k> = sum over groups of
 * scale * <Pi q_C, z[idx]> (+ sqrt(pi/2)/g * gamma sqrt(g) * <S q_C, sign>) + q.mu. */
static tqkv_status_t
ref_scores(const page_ctx_t *pc, const void *page, uint32_t h, uint32_t H, uint32_t D,
           const float *qh, double *s, ref_scratch_t *x)
{
    const float *mu = tqkv_page_key_mean(page, h);
    for (uint32_t t = 0; t < pc->T; t++) {
        double sum = 0.0;
        if (mu)
            for (uint32_t d = 0; d < D; d++)
                sum += (double)qh[d] * mu[d];
        s[t] = sum;
    }
    if (pc->raw[TQKV_TENSOR_K]) /* lossless keys: <q, k> from the BF16 rows */
        for (uint32_t t = 0; t < pc->T; t++) {
            const uint16_t *kr = pc->raw[TQKV_TENSOR_K] + ((size_t)t * H + h) * D;
            double dot = 0.0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)qh[d] * tqkv_bf16_to_f32(kr[d]);
            s[t] += dot;
        }
    for (uint32_t g = 0; g < 2; g++) {
        const group_ctx_t *gc = &pc->g[TQKV_TENSOR_K][g];
        const tqkv_group_view_t *gv = &gc->gv;
        uint32_t gd;
        if (!gc->present)
            continue;
        gd = gv->L.dim;
        if (group_channels(pc, TQKV_TENSOR_K, g, h, x->ch) != gd)
            return TQKV_ECORRUPT;
        for (uint32_t i = 0; i < gd; i++)
            x->qc[i] = qh[x->ch[i]];
        if (gc->rot) {
            tqkv_rotation_apply(gc->rot, x->qc, x->qr);
            for (uint32_t t = 0; t < pc->T; t++) {
                uint64_t v = (uint64_t)t * H + h;
                const uint8_t *row = gv->idx + v * gv->L.idx_row_bytes;
                double dot = 0.0;
                for (uint32_t j = 0; j < gd; j++)
                    dot += (double)x->qr[j] * gv->codebook[tqkv_bits_get(row, j, gv->L.mse_bits)];
                s[t] += tqkv_scale_get(gv->scale, v) * dot;
            }
        }
        if (gc->qjl) {
            tqkv_rotation_apply(gc->qjl, x->qc, x->qr);
            for (uint32_t t = 0; t < pc->T; t++) {
                uint64_t v = (uint64_t)t * H + h;
                const uint8_t *row = gv->signs + v * gv->L.sign_row_bytes;
                double dot = 0.0;
                for (uint32_t j = 0; j < gd; j++)
                    dot += tqkv_bits_get(row, j, 1) ? x->qr[j] : -x->qr[j];
                s[t] += SQRT_HALF_PI / gd *
                        ((double)tqkv_scale_get(gv->gamma, v) * sqrt((double)gd)) * dot;
            }
        }
    }
    return TQKV_OK;
}

/* Pass 2 of the reference on one page: its values of KV head h weighted by p[t] / L,
 * accumulated in the rotated domain per group and added to o: Pi^T sum_i p_i scale_i
 * z[idx_i] (+ S^T sum_i p_i sqrt(pi/2)/g gamma_i sqrt(g) sign_i). */
static tqkv_status_t
ref_values(const page_ctx_t *pc, uint32_t h, uint32_t H, const double *p, double L, double *o,
           ref_scratch_t *x)
{
    if (pc->raw[TQKV_TENSOR_V]) { /* lossless values: sum_i p_i v_i */
        uint32_t D = pc->D;
        for (uint32_t t = 0; t < pc->T; t++) {
            const uint16_t *vr = pc->raw[TQKV_TENSOR_V] + ((size_t)t * H + h) * D;
            double w = p[t] / L;
            for (uint32_t d = 0; d < D; d++)
                o[d] += w * tqkv_bf16_to_f32(vr[d]);
        }
    }
    for (uint32_t g = 0; g < 2; g++) {
        const group_ctx_t *gc = &pc->g[TQKV_TENSOR_V][g];
        const tqkv_group_view_t *gv = &gc->gv;
        uint32_t gd;
        if (!gc->present)
            continue;
        gd = gv->L.dim;
        if (group_channels(pc, TQKV_TENSOR_V, g, h, x->ch) != gd)
            return TQKV_ECORRUPT;
        for (int kind = 0; kind < 2; kind++) {
            const tqkv_rotation_t *r = kind == 0 ? gc->rot : gc->qjl;
            if (!r)
                continue;
            memset(x->acc, 0, sizeof(double) * gd);
            for (uint32_t t = 0; t < pc->T; t++) {
                uint64_t v = (uint64_t)t * H + h;
                double w = p[t] / L;
                if (kind == 0) {
                    const uint8_t *row = gv->idx + v * gv->L.idx_row_bytes;
                    w *= tqkv_scale_get(gv->scale, v);
                    for (uint32_t j = 0; j < gd; j++)
                        x->acc[j] += w * gv->codebook[tqkv_bits_get(row, j, gv->L.mse_bits)];
                } else {
                    const uint8_t *row = gv->signs + v * gv->L.sign_row_bytes;
                    w *= SQRT_HALF_PI / gd *
                         ((double)tqkv_scale_get(gv->gamma, v) * sqrt((double)gd));
                    for (uint32_t j = 0; j < gd; j++)
                        x->acc[j] += tqkv_bits_get(row, j, 1) ? w : -w;
                }
            }
            for (uint32_t j = 0; j < gd; j++)
                x->qr[j] = (float)x->acc[j];
            tqkv_rotation_apply_t(r, x->qr, x->tmp);
            for (uint32_t j = 0; j < gd; j++)
                o[x->ch[j]] += x->tmp[j];
        }
    }
    return TQKV_OK;
}

tqkv_status_t
tqkv_attn_decode_ref(const float *q, uint32_t num_q_heads, const void *const *pages,
                     const size_t *page_lens, size_t n_pages, const tqkv_attn_opts_t *opts,
                     float *out)
{
    uint32_t H, D, G;
    uint64_t total;
    float sm_scale;
    double *score = NULL, *o = NULL;
    ref_scratch_t x = {0};
    tqkv_status_t st;
    int check_crc = opts ? opts->check_crc : 0;

    if (!q || !out || num_q_heads == 0)
        return TQKV_EINVAL;
    st = tqkv_attn_check_pages(pages, page_lens, n_pages, check_crc, &H, &D, &total, NULL, 0);
    if (st != TQKV_OK)
        return st;
    if (num_q_heads % H != 0 || total == 0)
        return TQKV_EINVAL;
    G = num_q_heads / H;
    sm_scale = opts && opts->sm_scale > 0.0f ? opts->sm_scale : (float)(1.0 / sqrt((double)D));
    score = malloc(sizeof(double) * total);
    x.acc = malloc(sizeof(double) * D);
    o = malloc(sizeof(double) * D);
    x.qc = malloc(sizeof(float) * D);
    x.qr = malloc(sizeof(float) * D);
    x.tmp = malloc(sizeof(float) * D);
    x.ch = malloc(sizeof(uint32_t) * D);
    if (!score || !x.acc || !o || !x.qc || !x.qr || !x.tmp || !x.ch) {
        st = TQKV_ENOMEM;
        goto done;
    }

    for (uint32_t hq = 0; hq < num_q_heads && st == TQKV_OK; hq++) {
        uint32_t h = hq / G;
        const float *qh = q + (size_t)hq * D;
        double mx = -INFINITY, L = 0.0;
        uint64_t base = 0;

        /* Pass 1: score every key from its codes. */
        for (size_t p = 0; p < n_pages && st == TQKV_OK; p++) {
            page_ctx_t pc;
            if ((st = page_ctx_init(&pc, pages[p])) != TQKV_OK)
                break;
            st = ref_scores(&pc, pages[p], h, H, D, qh, score + base, &x);
            for (uint32_t t = 0; t < pc.T; t++) {
                score[base + t] *= sm_scale;
                mx = score[base + t] > mx ? score[base + t] : mx;
            }
            base += pc.T;
            page_ctx_release(&pc);
        }
        if (st != TQKV_OK)
            break;

        /* Softmax weights. */
        for (uint64_t i = 0; i < total; i++) {
            score[i] = exp(score[i] - mx);
            L += score[i];
        }

        /* Pass 2: values, accumulated in the rotated domain per page and group. */
        memset(o, 0, sizeof(double) * D);
        base = 0;
        for (size_t p = 0; p < n_pages && st == TQKV_OK; p++) {
            page_ctx_t pc;
            if ((st = page_ctx_init(&pc, pages[p])) != TQKV_OK)
                break;
            st = ref_values(&pc, h, H, score + base, L, o, &x);
            base += pc.T;
            page_ctx_release(&pc);
        }
        for (uint32_t d = 0; d < D; d++)
            out[(size_t)hq * D + d] = (float)o[d];
    }
done:
    free(score);
    free(x.acc);
    free(o);
    free(x.qc);
    free(x.qr);
    free(x.tmp);
    free(x.ch);
    return st;
}
