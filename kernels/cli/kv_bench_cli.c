/* kv_bench_cli.c - tqkv-codec attn-bench: fused attention on packed pages next to BF16
 * attention, CPU time per token (kv_cli.c has the conventions). */
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
#include "kernels/clock.h"
#include "kernels/cli/io_cli.h"
#include "kernels/cli/kv_cli.h"
#include "kernels/cli/kv_synth.h"
#include "kernels/kivi.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

/* ---- attn-bench ---- */

static const char attn_bench_usage[] =
    "usage: tqkv-codec attn-bench [--tokens 32768] [--heads 8] [--query-heads 32] [--dim 128]\n"
    "         [--key-bits 3.5] [--value-bits 3.5] [--block 256] [--iters N] [--seed S]\n"
    "  One core: fused attention on packed pages vs BF16 attention on the same KV, same\n"
    "  harness; the scalar reference once for a sanity check.\n";

static int
cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double
rel_err_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}

/* Encodes k, v [T][H][D] into pages of block tokens: pages[p], lens[p] for every page,
 * *total bytes in all. Returns the buffer holding them (free()), or NULL after printing
 * why. */
static uint8_t *
bench_pages(const uint16_t *k, const uint16_t *v, uint32_t T, uint32_t H, uint32_t D,
            uint32_t block, const tqkv_block_codec_t *codec, const void **pages, size_t *lens,
            size_t *total)
{
    const uint32_t npages = (T + block - 1) / block;
    size_t cap = 0;
    uint8_t *buf;
    for (uint32_t p = 0; p < npages; p++) {
        tqkv_block_shape_t sh = {T - p * block < block ? T - p * block : block, H, D};
        size_t sz;
        if (tqkv_page_size(&sh, codec, &sz) != TQKV_OK) {
            tqkv__cli_fail("unsupported shape/codec");
            return NULL;
        }
        cap += sz;
    }
    buf = aligned_alloc(64, tqkv_align_up(cap, 64));
    if (!buf) {
        tqkv__cli_fail("out of memory");
        return NULL;
    }
    for (uint32_t p = 0; p < npages; p++) {
        tqkv_block_shape_t sh = {T - p * block < block ? T - p * block : block, H, D};
        size_t wr, off = (size_t)p * block * H * D;
        char why[200] = "";
        if (tqkv_page_encode(&sh, codec, k + off, v + off, buf + *total, cap - *total, &wr, why,
                             sizeof why) != TQKV_OK) {
            tqkv__cli_fail("encode: %s", why);
            free(buf);
            return NULL;
        }
        pages[p] = buf + *total;
        lens[p] = wr;
        *total += wr;
    }
    return buf;
}

/* attn-bench with parsed options. */
typedef struct bench_args {
    uint32_t T, H, HQ, D, block, iters;
    uint8_t kb, vb;
    uint64_t seed;
} bench_args_t;

/* Times fused attention on packed pages and BF16 attention at each kernel level, prints
 * the table and the sanity line. Returns the exit status. */
static int
attn_bench_run(const bench_args_t *a)
{
    const uint32_t T = a->T, H = a->H, HQ = a->HQ, D = a->D, block = a->block, iters = a->iters;
    const uint8_t kb = a->kb, vb = a->vb;
    const uint64_t seed = a->seed;
    int rc = 1;
    uint16_t *k = NULL, *v = NULL;
    float *q = NULL, *o_f = NULL, *o_b = NULL, *o_r = NULL, *o_br = NULL;
    uint8_t *buf = NULL;
    const void **pages = NULL;
    size_t *lens = NULL, total = 0;
    double *times = NULL;
    {
        size_t n = (size_t)T * H * D;
        uint32_t npages = (T + block - 1) / block;
        tqkv__cli_rng_t r = {seed};
        tqkv_block_codec_t codec = {
            {kb, TQKV_MODE_MSE, 1}, {vb, TQKV_MODE_MSE, 1}, TQKV_ROT_HADAMARD, 0, seed};
        tqkv_attn_opts_t opts;
        double bf16_bytes = 2.0 * (double)n * 2.0, tr, tbr;
        k = malloc(n * 2);
        v = malloc(n * 2);
        q = malloc(sizeof(float) * HQ * D);
        o_f = malloc(sizeof(float) * HQ * D);
        o_b = malloc(sizeof(float) * HQ * D);
        o_r = malloc(sizeof(float) * HQ * D);
        o_br = malloc(sizeof(float) * HQ * D);
        pages = malloc(sizeof(void *) * npages);
        lens = malloc(sizeof(size_t) * npages);
        times = malloc(sizeof(double) * iters);
        if (!k || !v || !q || !o_f || !o_b || !o_r || !o_br || !pages || !lens || !times) {
            tqkv__cli_fail("out of memory");
            goto done;
        }
        tqkv__cli_synth_kv(&r, T, H, D, k, v);
        tqkv__cli_synth_q(&r, HQ, H, D, T, k, 1.0f, q);
        if (!(buf = bench_pages(k, v, T, H, D, block, &codec, pages, lens, &total)))
            goto done;
        tqkv_attn_opts_default(&opts);
        /* Fused and BF16 calls alternate (one of each per iteration) so that noise from
         * other processes hits both alike; each kernel level the CPU has is measured. */
        {
            static const int caps[2] = {TQKV_ATTN_ISA_BEST, TQKV_ATTN_ISA_AVX2};
            const char *isa_name[2];
            double tfl[2] = {0, 0}, tbl[2] = {0, 0}, wf = 0, wb = 0, best_b = INFINITY;
            double *tb_times = malloc(sizeof(double) * iters);
            int nlev = 0;
            if (!tb_times) {
                tqkv__cli_fail("out of memory");
                goto done;
            }
            for (int lv = 0; lv < 2; lv++) {
                tqkv_attn_set_isa_cap(caps[lv]);
                isa_name[lv] = tqkv_attn_isa();
                if (lv == 1 && !strcmp(isa_name[1], isa_name[0]))
                    break;
                if (tqkv_attn_decode(q, HQ, pages, lens, npages, &opts, o_f) != TQKV_OK ||
                    tqkv_attn_bf16(q, HQ, k, v, T, H, D, o_b) != TQKV_OK) {
                    free(tb_times);
                    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
                    tqkv__cli_fail("attention failed");
                    goto done;
                }
                for (uint32_t it = 0; it < iters; it++) {
                    double t0 = tqkv__cli_cpu_s(), w0 = tqkv_clock_s();
                    (void)tqkv_attn_decode(q, HQ, pages, lens, npages, &opts, o_f);
                    times[it] = tqkv__cli_cpu_s() - t0;
                    wf += tqkv_clock_s() - w0;
                    t0 = tqkv__cli_cpu_s();
                    w0 = tqkv_clock_s();
                    (void)tqkv_attn_bf16(q, HQ, k, v, T, H, D, o_b);
                    tb_times[it] = tqkv__cli_cpu_s() - t0;
                    wb += tqkv_clock_s() - w0;
                }
                qsort(times, iters, sizeof(double), cmp_double);
                qsort(tb_times, iters, sizeof(double), cmp_double);
                tfl[lv] = times[iters / 2];
                tbl[lv] = tb_times[iters / 2];
                best_b = tbl[lv] < best_b ? tbl[lv] : best_b;
                nlev = lv + 1;
            }
            free(tb_times);
            tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
            /* outputs of the best level for the sanity line */
            (void)tqkv_attn_decode(q, HQ, pages, lens, npages, &opts, o_f);
            (void)tqkv_attn_bf16(q, HQ, k, v, T, H, D, o_b);
            {
                double t0 = tqkv__cli_cpu_s();
                if (tqkv_attn_decode_ref(q, HQ, pages, lens, npages, &opts, o_r) != TQKV_OK) {
                    tqkv__cli_fail("reference failed");
                    goto done;
                }
                tr = tqkv__cli_cpu_s() - t0;
                t0 = tqkv__cli_cpu_s();
                if (tqkv_attn_bf16_ref(q, HQ, k, v, T, H, D, o_br) != TQKV_OK) {
                    tqkv__cli_fail("bf16 reference failed");
                    goto done;
                }
                tbr = tqkv__cli_cpu_s() - t0;
            }
            printf("attn-bench: T=%u H=%u HQ=%u D=%u, K %.1f bits V %.1f bits (mse, "
                   "norm-corrected), block %u (%u pages), one core, median thread CPU time of "
                   "%u alternating calls\n",
                   T, H, HQ, D, kb / 2.0, vb / 2.0, block, npages, iters);
            printf("KV bytes: BF16 %.1f MiB, packed %.1f MiB (%.2fx); mean wall time per call "
                   "(all levels): fused %.3f ms, BF16 %.3f ms\n",
                   bf16_bytes / 1048576.0, total / 1048576.0, bf16_bytes / (double)total,
                   wf / (iters * nlev) * 1e3, wb / (iters * nlev) * 1e3);
            printf("%-30s %10s %14s %11s %18s\n", "path", "ms/call", "BF16-eq GB/s", "read GB/s",
                   "vs best BF16");
            for (int lv = 0; lv < nlev; lv++) {
                char name[64];
                snprintf(name, sizeof name, "fused packed (%s)", isa_name[lv]);
                printf("%-30s %10.3f %14.2f %11.2f %17.2fx\n", name, tfl[lv] * 1e3,
                       bf16_bytes / tfl[lv] / 1e9, total / tfl[lv] / 1e9, best_b / tfl[lv]);
            }
            for (int lv = 0; lv < nlev; lv++) {
                char name[64];
                snprintf(name, sizeof name, "BF16 (%s)", isa_name[lv]);
                printf("%-30s %10.3f %14.2f %11.2f %17.2fx\n", name, tbl[lv] * 1e3,
                       bf16_bytes / tbl[lv] / 1e9, bf16_bytes / tbl[lv] / 1e9, best_b / tbl[lv]);
            }
            printf("%-30s %10.3f %14.2f %11.2f %17.2fx\n", "fused reference (scalar, once)",
                   tr * 1e3, bf16_bytes / tr / 1e9, total / tr / 1e9, best_b / tr);
            printf("%-30s %10.3f %14.2f %11.2f %17.2fx\n", "BF16 reference (scalar, once)",
                   tbr * 1e3, bf16_bytes / tbr / 1e9, bf16_bytes / tbr / 1e9, best_b / tbr);
            printf("sanity: fused vs its reference rel err %.2e, BF16 vs its reference %.2e, "
                   "fused vs exact BF16 attention (quantization error) %.4f\n",
                   rel_err_f(o_f, o_r, (size_t)HQ * D), rel_err_f(o_b, o_br, (size_t)HQ * D),
                   rel_err_f(o_f, o_br, (size_t)HQ * D));
        }
    }
    rc = 0;
done:
    free(k);
    free(v);
    free(q);
    free(o_f);
    free(o_b);
    free(o_r);
    free(o_br);
    free(buf);
    free(pages);
    free(lens);
    free(times);
    return rc;
}

int
tqkv_cli_attn_bench(int argc, char **argv)
{
    const char *missing = NULL;
    uint32_t T = 32768, H = 8, HQ = 32, D = 128, block = 256, iters = 20;
    uint8_t kb = 7, vb = 7;
    uint64_t seed = 1;
    if (tqkv__cli_is_help(argc, argv)) {
        fputs(attn_bench_usage, stdout);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--tokens")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1u << 24, &T))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --tokens '%s'", argv[i]);
        } else if (OPT_VALUE("--heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --heads '%s'", argv[i]);
        } else if (OPT_VALUE("--query-heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1u << 16, &HQ))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --query-heads '%s'", argv[i]);
        } else if (OPT_VALUE("--dim")) {
            if (tqkv__cli_parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --dim '%s'", argv[i]);
        } else if (OPT_VALUE("--key-bits")) {
            if (tqkv_bits_parse(argv[++i], &kb) != TQKV_OK)
                return tqkv__cli_usage_err(attn_bench_usage, "bad --key-bits '%s'", argv[i]);
        } else if (OPT_VALUE("--value-bits")) {
            if (tqkv_bits_parse(argv[++i], &vb) != TQKV_OK)
                return tqkv__cli_usage_err(attn_bench_usage, "bad --value-bits '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --block '%s'", argv[i]);
        } else if (OPT_VALUE("--iters")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 100000, &iters))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --iters '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (tqkv__cli_parse_u64(argv[++i], 0, UINT64_MAX, &seed))
                return tqkv__cli_usage_err(attn_bench_usage, "bad --seed '%s'", argv[i]);
        } else if (missing) {
            break;
        } else {
            return tqkv__cli_usage_err(attn_bench_usage, "unexpected argument '%s'", argv[i]);
        }
    }
    if (missing)
        return tqkv__cli_usage_err(attn_bench_usage, "%s needs a value", missing);
    if (HQ % H != 0)
        return tqkv__cli_usage_err(attn_bench_usage,
                                   "--query-heads %u is not a multiple of --heads %u", HQ, H);
    {
        const bench_args_t a = {T, H, HQ, D, block, iters, kb, vb, seed};
        return attn_bench_run(&a);
    }
}
