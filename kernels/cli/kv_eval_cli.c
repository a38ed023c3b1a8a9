/* kv_eval_cli.c - tqkv-codec attn-eval: attention quality of KV policies on synthetic
 * KV next to a KIVI-style baseline (kv_cli.c has the conventions). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kernels/attention.h"
#include "kernels/cli/io_cli.h"
#include "kernels/cli/kv_cli.h"
#include "kernels/cli/kv_synth.h"
#include "kernels/kivi.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

/* ---- attn-eval ---- */

static const char attn_eval_usage[] =
    "usage: tqkv-codec attn-eval [--k K.bf16 --v V.bf16 --tokens T --heads H --dim D]\n"
    "         [--query-heads HQ] [--block N] [--seed S] [--peak P (1.0)] [--json]\n"
    "  Attention quality of TurboQuant KV policies and a KIVI-style baseline against BF16\n"
    "  attention: bits per coordinate (everything counted), output relative error, cosine\n"
    "  similarity, top-8 attention-weight overlap. Synthetic data by default (T=4096, H=8,\n"
    "  D=128, HQ=32: keys with outlier channels and offsets, queries aimed at a few keys).\n";

typedef struct eval_data {
    uint32_t T, H, D, HQ;
    const uint16_t *k, *v;
    const float *q;
    double *ref;    /* [HQ][D] exact output (double attention on BF16) */
    uint32_t *top;  /* [HQ][8] reference top-8 token indices */
    double topmass; /* mean attention mass on the reference top-8 */
} eval_data_t;

/* Double-precision attention over f32 K, V; writes the output and optionally the top-8. */
static void
attn_f64(const eval_data_t *e, const float *k, const float *v, double *out, uint32_t *top,
         double *topmass)
{
    uint32_t G = e->HQ / e->H, T = e->T, D = e->D;
    double *s = malloc(sizeof(double) * T), mass = 0.0;
    for (uint32_t hq = 0; hq < e->HQ; hq++) {
        uint32_t h = hq / G;
        double mx = -INFINITY, L = 0.0;
        for (uint32_t t = 0; t < T; t++) {
            const float *kr = k + ((size_t)t * e->H + h) * D;
            double d = 0.0;
            for (uint32_t c = 0; c < D; c++)
                d += (double)e->q[(size_t)hq * D + c] * kr[c];
            s[t] = d / sqrt((double)D);
            mx = s[t] > mx ? s[t] : mx;
        }
        for (uint32_t c = 0; c < D; c++)
            out[(size_t)hq * D + c] = 0.0;
        for (uint32_t t = 0; t < T; t++) {
            const float *vr = v + ((size_t)t * e->H + h) * D;
            s[t] = exp(s[t] - mx);
            L += s[t];
            for (uint32_t c = 0; c < D; c++)
                out[(size_t)hq * D + c] += s[t] * vr[c];
        }
        for (uint32_t c = 0; c < D; c++)
            out[(size_t)hq * D + c] /= L;
        if (top) {
            uint32_t *tp = top + (size_t)hq * 8, n = T < 8 ? T : 8;
            for (uint32_t j = 0; j < n; j++) {
                uint32_t best = UINT32_MAX;
                for (uint32_t t = 0; t < T; t++) {
                    int taken = 0;
                    for (uint32_t i = 0; i < j; i++)
                        taken |= tp[i] == t;
                    if (!taken && (best == UINT32_MAX || s[t] > s[best]))
                        best = t;
                }
                tp[j] = best;
                mass += s[best] / L;
            }
            for (uint32_t j = n; j < 8; j++)
                tp[j] = UINT32_MAX;
        }
    }
    if (topmass)
        *topmass = mass / e->HQ;
    free(s);
}

typedef struct eval_row {
    char name[48];
    double k_bits, v_bits, bits, ratio, rel_err, cosine, top8;
} eval_row_t;

/* Scores a reconstruction (f32 K, V) against the reference. */
static void
eval_score(const eval_data_t *e, const float *k, const float *v, const float *fused,
           eval_row_t *row)
{
    size_t n = (size_t)e->HQ * e->D;
    double *o = malloc(sizeof(double) * n), num = 0, den = 0, cos_sum = 0, hits = 0, cnt = 0;
    uint32_t *top = malloc(sizeof(uint32_t) * e->HQ * 8);
    attn_f64(e, k, v, o, top, NULL);
    if (fused) /* the fused kernel's output is what a consumer gets: score that */
        for (size_t i = 0; i < n; i++)
            o[i] = fused[i];
    for (uint32_t hq = 0; hq < e->HQ; hq++) {
        double dot = 0, a = 0, b = 0;
        for (uint32_t c = 0; c < e->D; c++) {
            double x = o[(size_t)hq * e->D + c], y = e->ref[(size_t)hq * e->D + c];
            num += (x - y) * (x - y);
            den += y * y;
            dot += x * y;
            a += x * x;
            b += y * y;
        }
        cos_sum += dot / (sqrt(a * b) + 1e-300);
        for (int i = 0; i < 8; i++) {
            if (e->top[hq * 8 + i] == UINT32_MAX)
                continue;
            cnt++;
            for (int j = 0; j < 8; j++)
                if (top[hq * 8 + j] == e->top[hq * 8 + i]) {
                    hits++;
                    break;
                }
        }
    }
    row->rel_err = sqrt(num / den);
    row->cosine = cos_sum / e->HQ;
    row->top8 = cnt > 0 ? hits / cnt : 1.0;
    free(o);
    free(top);
}

static int
eval_turboquant(const eval_data_t *e, const tqkv_block_codec_t *codec, uint32_t block,
                eval_row_t *row)
{
    size_t n = (size_t)e->T * e->H * e->D, total = 0, kbytes = 0;
    uint32_t npages = (e->T + block - 1) / block;
    const void **pages = malloc(sizeof(void *) * npages);
    size_t *lens = malloc(sizeof(size_t) * npages);
    uint8_t *buf = NULL;
    float *k = malloc(n * 4), *v = malloc(n * 4), *out = malloc(sizeof(float) * e->HQ * e->D);
    size_t cap = 0;
    int rc = -1;
    tqkv_status_t st;
    char why[200] = "";
    tqkv_block_codec_t konly = *codec;
    konly.v.bits_x2 = 0;
    for (uint32_t p = 0; p < npages; p++) {
        tqkv_block_shape_t sh = {e->T - p * block < block ? e->T - p * block : block, e->H, e->D};
        size_t sz, ksz;
        if (tqkv_page_size(&sh, codec, &sz) != TQKV_OK ||
            tqkv_page_size(&sh, &konly, &ksz) != TQKV_OK) {
            tqkv__cli_fail("bad codec");
            goto done;
        }
        cap += sz;
        kbytes += ksz - TQKV_PAGE_HEADER_BYTES / 2; /* header shared by K and V */
    }
    buf = aligned_alloc(64, tqkv_align_up(cap, 64));
    for (uint32_t p = 0; p < npages; p++) {
        tqkv_block_shape_t sh = {e->T - p * block < block ? e->T - p * block : block, e->H, e->D};
        size_t wr, off = (size_t)p * block * e->H * e->D;
        st = tqkv_page_encode(&sh, codec, e->k + off, e->v + off, buf + total, cap - total, &wr,
                              why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("encode: %s", why);
            goto done;
        }
        pages[p] = buf + total;
        lens[p] = wr;
        if (tqkv_page_decode_f32(buf + total, wr, k + off, v + off) != TQKV_OK) {
            tqkv__cli_fail("decode failed");
            goto done;
        }
        total += wr;
    }
    st = tqkv_attn_decode(e->q, e->HQ, pages, lens, npages, NULL, out);
    if (st != TQKV_OK) {
        tqkv__cli_fail("attention: %s", tqkv_strerror(st));
        goto done;
    }
    eval_score(e, k, v, out, row);
    row->bits = 8.0 * (double)total / (2.0 * (double)n);
    row->k_bits = 8.0 * (double)kbytes / (double)n;
    row->v_bits = 2.0 * row->bits - row->k_bits;
    row->ratio = 16.0 / row->bits;
    rc = 0;
done:
    free(pages);
    free(lens);
    free(buf);
    free(k);
    free(v);
    free(out);
    return rc;
}

static int
eval_kivi(const eval_data_t *e, uint32_t bits, eval_row_t *row)
{
    size_t n = (size_t)e->T * e->H * e->D;
    float *k = malloc(n * 4), *v = malloc(n * 4);
    if (!k || !v ||
        tqkv_kivi_roundtrip(e->k, e->v, e->T, e->H, e->D, bits, 32, k, v, &row->k_bits,
                            &row->v_bits) != TQKV_OK) {
        free(k);
        free(v);
        return tqkv__cli_fail("KIVI quantization failed");
    }
    eval_score(e, k, v, NULL, row);
    row->bits = 0.5 * (row->k_bits + row->v_bits);
    row->ratio = 16.0 / row->bits;
    snprintf(row->name, sizeof row->name, "KIVI-%u (g32, fp16 s/z)", bits);
    free(k);
    free(v);
    return 0;
}

/* The rows of attn-eval: TurboQuant codecs (symmetric, asymmetric, prod values) and KIVI
 * at 2..4 bits, appended to rows (room for 64) and counted in *nrows. Returns 0, or -1
 * after printing why. */
static int
eval_rows(const eval_data_t *e, uint64_t seed, uint32_t block, eval_row_t *rows, size_t *nrows)
{
    static const uint8_t sym[] = {5, 6, 7, 8};
    static const uint8_t asym[][2] = {{7, 5}, {7, 6}, {8, 6}, {8, 5}, {6, 5}, {8, 7}};
    for (size_t b = 0; b < sizeof sym; b++)
        for (int kmode = 0; kmode < 2; kmode++)
            for (int nc = 0; nc < 2; nc++)
                for (int ctr = 0; ctr < 2; ctr++) {
                    tqkv_block_codec_t c = {{sym[b], (uint8_t)kmode, (uint8_t)nc},
                                            {sym[b], TQKV_MODE_MSE, (uint8_t)nc},
                                            TQKV_ROT_HADAMARD,
                                            (uint8_t)ctr,
                                            seed * 7919u + 17u};
                    eval_row_t *rw = &rows[(*nrows)++];
                    snprintf(rw->name, sizeof rw->name, "TQ K%.1f%s V%.1f%s%s", sym[b] / 2.0,
                             kmode ? "p" : "", sym[b] / 2.0, nc ? " nc" : "", ctr ? " ctr" : "");
                    if (eval_turboquant(e, &c, block, rw) != 0)
                        return -1;
                }
    for (size_t a = 0; a < sizeof asym / sizeof asym[0]; a++)
        for (int ctr = 0; ctr < 2; ctr++) {
            tqkv_block_codec_t c = {{asym[a][0], TQKV_MODE_MSE, 1},
                                    {asym[a][1], TQKV_MODE_MSE, 1},
                                    TQKV_ROT_HADAMARD,
                                    (uint8_t)ctr,
                                    seed * 7919u + 17u};
            eval_row_t *rw = &rows[(*nrows)++];
            snprintf(rw->name, sizeof rw->name, "TQ K%.1f V%.1f nc%s", asym[a][0] / 2.0,
                     asym[a][1] / 2.0, ctr ? " ctr" : "");
            if (eval_turboquant(e, &c, block, rw) != 0)
                return -1;
        }
    {
        /* prod values, for the record */
        tqkv_block_codec_t c = {{7, TQKV_MODE_MSE, 1},
                                {7, TQKV_MODE_PROD, 1},
                                TQKV_ROT_HADAMARD,
                                1,
                                seed * 7919u + 17u};
        eval_row_t *rw = &rows[(*nrows)++];
        snprintf(rw->name, sizeof rw->name, "TQ K3.5 V3.5p nc ctr");
        if (eval_turboquant(e, &c, block, rw) != 0)
            return -1;
    }
    for (uint32_t b = 2; b <= 4; b++)
        if (eval_kivi(e, b, &rows[(*nrows)++]) != 0)
            return -1;
    return 0;
}

/* Prints the rows as a table, or as one JSON object (json). */
static void
eval_print(const eval_data_t *e, const eval_row_t *rows, size_t nrows, uint32_t block,
           int synthetic, int json)
{
    const uint32_t T = e->T, H = e->H, D = e->D, HQ = e->HQ;
    if (json) {
        printf("{\"tokens\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"query_heads\":%u,\"block\":%u,"
               "\"synthetic\":%s,\"ref_top8_mass\":%.4f,\"rows\":[",
               T, H, D, HQ, block, synthetic ? "true" : "false", e->topmass);
        for (size_t i = 0; i < nrows; i++)
            printf("%s{\"method\":\"%s\",\"k_bits\":%.4f,\"v_bits\":%.4f,\"bits\":%.4f,"
                   "\"ratio_vs_bf16\":%.3f,\"rel_err\":%.6f,\"cosine\":%.6f,\"top8_overlap\":%.4f}",
                   i ? "," : "", rows[i].name, rows[i].k_bits, rows[i].v_bits, rows[i].bits,
                   rows[i].ratio, rows[i].rel_err, rows[i].cosine, rows[i].top8);
        printf("]}\n");
    } else {
        printf("attn-eval: T=%u H=%u D=%u HQ=%u block=%u, %s data; reference top-8 attention "
               "mass %.3f\n",
               T, H, D, HQ, block, synthetic ? "synthetic" : "file", e->topmass);
        printf("(p = prod mode, nc = norm correction, ctr = key centering; bits/coord count "
               "every byte of the page or every scale/zero)\n");
        printf("%-26s %7s %7s %7s %7s %10s %9s %7s\n", "method", "K bits", "V bits", "bits",
               "ratio", "rel err", "cosine", "top-8");
        for (size_t i = 0; i < nrows; i++)
            printf("%-26s %7.3f %7.3f %7.3f %6.2fx %10.5f %9.6f %7.3f\n", rows[i].name,
                   rows[i].k_bits, rows[i].v_bits, rows[i].bits, rows[i].ratio, rows[i].rel_err,
                   rows[i].cosine, rows[i].top8);
    }
}

int
tqkv_cli_attn_eval(int argc, char **argv)
{
    const char *kp = NULL, *vp = NULL, *missing = NULL;
    uint32_t T = 4096, H = 8, D = 128, HQ = 32, block = 256;
    uint64_t seed = 1;
    float peak = 1.0f;
    int json = 0, rc = 1, have_shape = 0;
    uint16_t *k = NULL, *v = NULL;
    float *q = NULL, *kf = NULL, *vf = NULL;
    eval_data_t e;
    eval_row_t *rows = NULL;
    size_t nrows = 0;
    memset(&e, 0, sizeof e);
    if (tqkv__cli_is_help(argc, argv)) {
        fputs(attn_eval_usage, stdout);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--k")) {
            kp = argv[++i];
        } else if (OPT_VALUE("--v")) {
            vp = argv[++i];
        } else if (OPT_VALUE("--tokens")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1u << 24, &T))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --tokens '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --heads '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--dim")) {
            if (tqkv__cli_parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --dim '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--query-heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1u << 16, &HQ))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --query-heads '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --block '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (tqkv__cli_parse_u64(argv[++i], 0, UINT64_MAX, &seed))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --seed '%s'", argv[i]);
        } else if (OPT_VALUE("--peak")) {
            char *end;
            peak = strtof(argv[++i], &end);
            if (*end || !(peak > 0.0f && peak < 100.0f))
                return tqkv__cli_usage_err(attn_eval_usage, "bad --peak '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (missing) {
            break;
        } else {
            return tqkv__cli_usage_err(attn_eval_usage, "unexpected argument '%s'", argv[i]);
        }
    }
    if (missing)
        return tqkv__cli_usage_err(attn_eval_usage, "%s needs a value", missing);
    if ((kp == NULL) != (vp == NULL) || (kp && !have_shape))
        return tqkv__cli_usage_err(attn_eval_usage,
                                   "--k and --v go together, with --tokens --heads --dim");
    if (HQ % H != 0)
        return tqkv__cli_usage_err(attn_eval_usage,
                                   "--query-heads %u is not a multiple of --heads %u", HQ, H);
    {
        size_t n = (size_t)T * H * D;
        tqkv__cli_rng_t r = {seed};
        if (kp) {
            size_t kl, vl;
            if (!(k = tqkv__cli_read_file(kp, &kl)))
                return tqkv__cli_fail("%s: %s", kp, strerror(errno));
            if (!(v = tqkv__cli_read_file(vp, &vl))) {
                tqkv__cli_fail("%s: %s", vp, strerror(errno));
                goto done;
            }
            if (kl != n * 2 || vl != n * 2) {
                tqkv__cli_fail("%s is %zu bytes and %s is %zu; %u x %u x %u BF16 needs %zu", kp, kl,
                               vp, vl, T, H, D, n * 2);
                goto done;
            }
            for (size_t i = 0; i < n; i++)
                if (tqkv_bf16_is_nonfinite(k[i]) || tqkv_bf16_is_nonfinite(v[i])) {
                    tqkv__cli_fail("element %zu of K or V is not finite", i);
                    goto done;
                }
        } else {
            k = malloc(n * 2);
            v = malloc(n * 2);
            if (!k || !v) {
                tqkv__cli_fail("out of memory");
                goto done;
            }
            tqkv__cli_synth_kv(&r, T, H, D, k, v);
        }
        q = malloc(sizeof(float) * HQ * D);
        kf = malloc(n * 4);
        vf = malloc(n * 4);
        e.ref = malloc(sizeof(double) * HQ * D);
        e.top = malloc(sizeof(uint32_t) * HQ * 8);
        if (!q || !kf || !vf || !e.ref || !e.top) {
            tqkv__cli_fail("out of memory");
            goto done;
        }
        tqkv__cli_synth_q(&r, HQ, H, D, T, k, peak, q);
        for (size_t i = 0; i < n; i++) {
            kf[i] = tqkv_bf16_to_f32(k[i]);
            vf[i] = tqkv_bf16_to_f32(v[i]);
        }
        e.T = T;
        e.H = H;
        e.D = D;
        e.HQ = HQ;
        e.k = k;
        e.v = v;
        e.q = q;
        attn_f64(&e, kf, vf, e.ref, e.top, &e.topmass);
    }

    rows = calloc(64, sizeof(eval_row_t));
    if (!rows) {
        tqkv__cli_fail("out of memory");
        goto done;
    }
    if (eval_rows(&e, seed, block, rows, &nrows) != 0)
        goto done;
    eval_print(&e, rows, nrows, block, kp == NULL, json);
    rc = 0;
done:
    free(rows);
    free(k);
    free(v);
    free(q);
    free(kf);
    free(vf);
    free(e.ref);
    free(e.top);
    return rc;
}
