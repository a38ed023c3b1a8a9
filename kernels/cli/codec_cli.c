/* codec_cli.c - tqkv-codec encode/decode/info/eval/bench: the vector codec as a tool.
 *
 * Files: raw little-endian BF16 vectors [n][D] in, a concatenation of pages out (each
 * page num_kv_heads = 1, num_tokens = vectors in the page, V absent). Every error is
 * one line "tqkv-codec: <file>: <problem>" and exit 1; usage errors exit 2.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <zstd.h>

#include "kernels/codebook.h"
#include "kernels/cli/io_cli.h"
#include "kernels/cli/kv_cli.h"
#include "kernels/clock.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

int tqkv_cli_encode(int argc, char **argv);
int tqkv_cli_decode(int argc, char **argv);
int tqkv_cli_info(int argc, char **argv);
int tqkv_cli_eval(int argc, char **argv);
int tqkv_cli_bench(int argc, char **argv);

/* ---- helpers ---- */

static int
fail(const char *file, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "tqkv-codec: %s: ", file);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

static int
usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "tqkv-codec %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see tqkv-codec %s --help)\n", cmd);
    return 2;
}

static int
is_help(const char *a)
{
    return !strcmp(a, "--help") || !strcmp(a, "-h");
}

/* Whole file into memory (returns new; *len set). NULL with errno on failure. */
static uint8_t *
read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    size_t cap = 0, n = 0;
    if (!f)
        return NULL;
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        errno = EISDIR;
        return NULL;
    }
    for (;;) {
        size_t r;
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 1 << 20;
            uint8_t *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                fclose(f);
                errno = ENOMEM;
                return NULL;
            }
            buf = nb;
            cap = ncap;
        }
        r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) {
                free(buf);
                fclose(f);
                errno = EIO;
                return NULL;
            }
            break;
        }
    }
    fclose(f);
    *len = n;
    if (!buf)
        buf = malloc(1);
    return buf;
}

/* Whole or nothing: a temporary file renamed over path; a device is written in place
 * and never removed (this removed the output on failure: /dev/full itself, as root). */
static int
write_file(const char *path, const void *buf, size_t len)
{
    return tqkv__cli_write_file(path, buf, len);
}

static int
parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    unsigned long v;
    errno = 0;
    v = strtoul(s, &end, 0);
    if (errno || !*s || *end || v < lo || v > hi)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* "1", "1.5", ..., "4" (or "2.0" etc.) -> bits_x2 */
static int
parse_bits(const char *s, uint8_t *bits_x2)
{
    static const char *const names[] = {"1", "1.5", "2", "2.5", "3", "3.5", "4"};
    for (int i = 0; i < 7; i++) {
        size_t l = strlen(names[i]);
        if (!strcmp(s, names[i]) ||
            (!strncmp(s, names[i], l) && !strcmp(s + l, ".0") && !strchr(names[i], '.'))) {
            *bits_x2 = (uint8_t)(i + 2);
            return 0;
        }
    }
    return -1;
}

static int
parse_rotation(const char *s, uint8_t *rot)
{
    if (!strcmp(s, "dense"))
        *rot = TQKV_ROT_DENSE;
    else if (!strcmp(s, "hadamard"))
        *rot = TQKV_ROT_HADAMARD;
    else
        return -1;
    return 0;
}

static int
parse_mode(const char *s, uint8_t *mode)
{
    if (!strcmp(s, "mse"))
        *mode = TQKV_MODE_MSE;
    else if (!strcmp(s, "prod"))
        *mode = TQKV_MODE_PROD;
    else if (!strcmp(s, "lossless"))
        *mode = TQKV_MODE_RAW;
    else
        return -1;
    return 0;
}

static const char *
bits_name(uint32_t bits_x2)
{
    static const char *const names[] = {"?", "?", "1", "1.5", "2", "2.5", "3", "3.5", "4"};
    return bits_x2 == TQKV_RAW_BITS_X2 ? "16" : bits_x2 <= 8 ? names[bits_x2] : "?";
}

static const char *
mode_name(uint32_t mode)
{
    return mode == TQKV_MODE_RAW ? "lossless" : mode == TQKV_MODE_PROD ? "prod" : "mse";
}

/* Wall-clock seconds, or with TQKV_BENCH_CLOCK=cpu this thread's CPU seconds (one
 * core's throughput on a machine shared with other work). */
static double
now_s(void)
{
    static int cpu = -1;
    if (cpu < 0) {
        const char *e = getenv("TQKV_BENCH_CLOCK");
        cpu = e && !strcmp(e, "cpu");
    }
    return cpu ? tqkv__cli_cpu_s() : tqkv_clock_s();
}

/* ---- encode ---- */

static void
encode_help(FILE *f)
{
    tqkv_block_codec_t c;
    tqkv_policy_default_codec(&c);
    fprintf(
        f,
        "usage: tqkv-codec encode --dim D [--bits B] [options] IN.bf16 OUT.tqp\n"
        "  IN is raw little-endian BF16 vectors [n][D] (encoded as keys); OUT a file of pages.\n"
        "  Defaults: the keys of the server's default policy for a middle layer\n"
        "  (kernels/policy.c), as a default tqkv-server stores them.\n"
        "  --dim D               vector dimension, %u..%u\n"
        "  --bits B              1, 1.5, 2, 2.5, 3, 3.5 or 4 bits per coordinate (default %g)\n"
        "  --mode mse|prod|lossless  default %s; prod: unbiased inner products; lossless:\n"
        "                        BF16 kept as is (no --bits)\n"
        "  --rotation dense|hadamard   default %s (non-power-of-two groups use dense)\n"
        "  --seed S              rotation seed (default %llu)\n"
        "  --tokens-per-page N   vectors per page (default 256)\n"
        "  --no-norm-correction  store ||x|| / sqrt(g) instead of ||x|| / ||z[idx]|| (default:\n"
        "                        %s; --norm-correction is accepted)\n"
        "  --no-key-centering    keep each page's per-channel mean in the vectors (default: %s;\n"
        "                        --key-centering is accepted)\n",
        TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, c.k.bits_x2 / 2.0,
        c.k.mode == TQKV_MODE_PROD ? "prod" : "mse",
        c.rotation == TQKV_ROT_DENSE ? "dense" : "hadamard", (unsigned long long)c.seed,
        c.k.norm_correction ? "corrected" : "off", c.key_centering ? "centered" : "off");
}

int
tqkv_cli_encode(int argc, char **argv)
{
    uint32_t D = 0, tpp = 256;
    tqkv_block_codec_t def;
    uint8_t bits_x2, mode, rot, nc, center;
    uint64_t seed;
    const char *in = NULL, *out = NULL, *bits_arg = NULL;
    uint8_t *data, *pages = NULL;
    size_t len, n, cap = 0, total = 0;
    int rc = 1;

    tqkv_policy_default_codec(&def);
    bits_x2 = def.k.bits_x2;
    mode = def.k.mode;
    rot = def.rotation;
    nc = def.k.norm_correction;
    center = def.key_centering;
    seed = def.seed;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (is_help(a)) {
            encode_help(stdout);
            return 0;
        } else if (!strcmp(a, "--dim") && v) {
            if (parse_u32(v, 1, 1u << 30, &D))
                return usage_error("encode", "bad --dim '%s'", v);
            i++;
        } else if (!strcmp(a, "--bits") && v) {
            bits_arg = v;
            i++;
        } else if (!strcmp(a, "--mode") && v) {
            if (parse_mode(v, &mode))
                return usage_error("encode", "bad --mode '%s'", v);
            i++;
        } else if (!strcmp(a, "--rotation") && v) {
            if (parse_rotation(v, &rot))
                return usage_error("encode", "bad --rotation '%s'", v);
            i++;
        } else if (!strcmp(a, "--seed") && v) {
            char *end;
            seed = strtoull(v, &end, 0);
            if (!*v || *end)
                return usage_error("encode", "bad --seed '%s'", v);
            i++;
        } else if (!strcmp(a, "--tokens-per-page") && v) {
            if (parse_u32(v, 1, TQKV_PAGE_MAX_TOKENS, &tpp))
                return usage_error("encode", "bad --tokens-per-page '%s'", v);
            i++;
        } else if (!strcmp(a, "--norm-correction")) {
            nc = 1;
        } else if (!strcmp(a, "--no-norm-correction")) {
            nc = 0;
        } else if (!strcmp(a, "--key-centering")) {
            center = 1;
        } else if (!strcmp(a, "--no-key-centering")) {
            center = 0;
        } else if (a[0] == '-' && a[1]) {
            return usage_error("encode", "unknown or incomplete option '%s'", a);
        } else if (!in) {
            in = a;
        } else if (!out) {
            out = a;
        } else {
            return usage_error("encode", "extra argument '%s'", a);
        }
    }
    if (!in || !out || !D)
        return usage_error("encode", "need --dim, IN and OUT");
    if (bits_arg && parse_bits(bits_arg, &bits_x2))
        return fail(in, "unsupported bit width '%s' (1, 1.5, 2, 2.5, 3, 3.5, 4)", bits_arg);
    if (mode == TQKV_MODE_RAW && bits_arg)
        return usage_error("encode", "--bits with --mode lossless: lossless vectors are stored as "
                                     "BF16 and take no bit width");
    if (mode == TQKV_MODE_RAW)
        bits_x2 = TQKV_RAW_BITS_X2, nc = 0;
    if (D < TQKV_PAGE_MIN_DIM || D > TQKV_PAGE_MAX_DIM)
        return fail(in, "unsupported dimension %u (supported %u..%u)", D, TQKV_PAGE_MIN_DIM,
                    TQKV_PAGE_MAX_DIM);
    if (!(data = read_file(in, &len)))
        return fail(in, "%s", strerror(errno));
    if (len == 0 || len % ((size_t)D * 2)) {
        fail(in, "size %zu bytes is not a positive multiple of %u (dim %u x 2 bytes)", len, D * 2,
             D);
        goto out;
    }
    n = len / ((size_t)D * 2);
    for (size_t first = 0; first < n; first += tpp) {
        uint32_t T = (uint32_t)(n - first < tpp ? n - first : tpp);
        tqkv_block_shape_t s = {T, 1, D};
        tqkv_block_codec_t c = {0};
        size_t sz, w;
        char err[256];
        tqkv_status_t st;
        c.k.bits_x2 = bits_x2;
        c.k.mode = mode;
        c.k.norm_correction = nc;
        c.rotation = rot;
        c.key_centering = center;
        c.seed = seed;
        if ((st = tqkv_page_size(&s, &c, &sz)) != TQKV_OK) {
            tqkv_page_check_params(&s, &c, err, sizeof err);
            fail(in, "%s", err);
            goto out;
        }
        if (total + sz > cap) {
            size_t ncap = cap ? 2 * cap : sz * ((n + tpp - 1) / tpp);
            uint8_t *np;
            while (ncap < total + sz)
                ncap *= 2;
            if (!(np = realloc(pages, ncap))) {
                fail(in, "out of memory");
                goto out;
            }
            pages = np;
            cap = ncap;
        }
        st = tqkv_page_encode(&s, &c, (const uint16_t *)(data + first * D * 2), NULL, pages + total,
                              cap - total, &w, err, sizeof err);
        if (st == TQKV_ERANGE) {
            /* err names token/channel within the page: report file coordinates */
            const uint16_t *x = (const uint16_t *)(data + first * D * 2);
            for (size_t i = 0; i < (size_t)T * D; i++)
                if (tqkv_bf16_is_nonfinite(x[i])) {
                    fail(in, "%s at vector %zu, channel %zu", (x[i] & 0x7f) ? "NaN" : "Inf",
                         first + i / D, i % D);
                    break;
                }
            goto out;
        }
        if (st != TQKV_OK) {
            fail(in, "%s", err);
            goto out;
        }
        total += w;
    }
    if (write_file(out, pages, total) != 0) {
        fail(out, "%s", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    free(data);
    free(pages);
    return rc;
}

/* ---- decode / info ---- */

/* Walks the pages of a file: validates each (with CRC). On error prints and returns 1. */
typedef int (*page_fn)(const uint8_t *page, const tqkv_page_info_t *info, size_t index, void *ctx);

static int
walk_pages(const char *file, const uint8_t *buf, size_t len, page_fn fn, void *ctx)
{
    size_t off = 0, idx = 0;
    if (len == 0)
        return fail(file, "empty file (no pages)");
    while (off < len) {
        tqkv_page_info_t info;
        char err[256];
        tqkv_status_t st = tqkv_page_validate(buf + off, len - off, 1, &info, err, sizeof err);
        if (st != TQKV_OK)
            return fail(file, "page %zu at byte %zu: %s", idx, off, err);
        if (fn(buf + off, &info, idx, ctx))
            return 1;
        off += info.page_bytes;
        idx++;
    }
    return 0;
}

typedef struct decode_ctx {
    const char *file;
    uint16_t *out;
    size_t n, cap; /* BF16 values */
} decode_ctx_t;

static int
decode_page(const uint8_t *page, const tqkv_page_info_t *info, size_t index, void *arg)
{
    decode_ctx_t *d = arg;
    size_t cnt = (size_t)info->shape.num_tokens * info->shape.num_kv_heads * info->shape.head_dim;
    tqkv_status_t st;
    if (info->codec.k.bits_x2 == 0 || info->codec.v.bits_x2 != 0)
        return fail(d->file, "page %zu holds a K/V block, not vectors (use decode-kv)", index);
    if (d->n + cnt > d->cap) {
        size_t ncap = d->cap ? 2 * d->cap : cnt * 8;
        uint16_t *np;
        while (ncap < d->n + cnt)
            ncap *= 2;
        if (!(np = realloc(d->out, ncap * 2)))
            return fail(d->file, "out of memory");
        d->out = np;
        d->cap = ncap;
    }
    st = tqkv_page_decode_bf16(page, info->page_bytes, d->out + d->n, NULL);
    if (st != TQKV_OK)
        return fail(d->file, "page %zu: %s", index, tqkv_strerror(st));
    d->n += cnt;
    return 0;
}

int
tqkv_cli_decode(int argc, char **argv)
{
    const char *in = NULL, *out = NULL;
    decode_ctx_t d = {0};
    uint8_t *buf;
    size_t len;
    int rc;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            printf("usage: tqkv-codec decode IN.tqp OUT.bf16\n"
                   "  decodes every page of IN (validated, CRC checked) to raw BF16 [n][D];\n"
                   "  prod pages decode to the full unbiased reconstruction.\n");
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return usage_error("decode", "unknown option '%s'", argv[i]);
        } else if (!in) {
            in = argv[i];
        } else if (!out) {
            out = argv[i];
        } else {
            return usage_error("decode", "extra argument '%s'", argv[i]);
        }
    }
    if (!in || !out)
        return usage_error("decode", "need IN and OUT");
    if (!(buf = read_file(in, &len)))
        return fail(in, "%s", strerror(errno));
    d.file = in;
    rc = walk_pages(in, buf, len, decode_page, &d);
    if (rc == 0 && write_file(out, d.out, d.n * 2) != 0)
        rc = fail(out, "%s", strerror(errno));
    free(buf);
    free(d.out);
    return rc;
}

typedef struct info_ctx {
    size_t pages, vectors, bytes, bf16;
    uint32_t dim, heads_max;
    tqkv_block_codec_t first;
    int mixed;
    int verbose;
} info_ctx_t;

static int
info_page(const uint8_t *page, const tqkv_page_info_t *info, size_t index, void *arg)
{
    info_ctx_t *c = arg;
    const tqkv_page_header_t *h = info->hdr;
    if (c->verbose)
        printf("page %-5zu %8zu bytes  tokens %-5u heads %-3u dim %-4u  K %s %s%s  V %s %s  crc "
               "%08x\n",
               index, info->page_bytes, h->num_tokens, h->num_kv_heads, h->head_dim,
               bits_name(h->tensor[0].bits_x2), mode_name(h->tensor[0].mode),
               (h->tensor[0].flags & TQKV_TENSOR_NORM_CORRECTED) ? "+nc" : "",
               h->tensor[1].bits_x2 ? bits_name(h->tensor[1].bits_x2) : "-",
               h->tensor[1].bits_x2 ? mode_name(h->tensor[1].mode) : "", h->crc32c);
    if (index == 0) {
        c->first = info->codec;
        c->dim = info->shape.head_dim;
    } else if (memcmp(&c->first.k, &info->codec.k, sizeof c->first.k) ||
               c->dim != info->shape.head_dim || c->first.rotation != info->codec.rotation) {
        c->mixed = 1;
    }
    c->pages++;
    c->vectors += (size_t)info->shape.num_tokens * info->shape.num_kv_heads;
    c->bytes += info->page_bytes;
    c->bf16 += info->bf16_bytes;
    (void)page;
    return 0;
}

int
tqkv_cli_info(int argc, char **argv)
{
    const char *in = NULL;
    info_ctx_t c = {0};
    uint8_t *buf;
    size_t len;
    int rc;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            printf("usage: tqkv-codec info [--pages] IN.tqp\n"
                   "  validates every page and prints shape, codec, size, bits per coordinate\n"
                   "  (all overhead included) and the ratio against BF16; --pages lists pages.\n");
            return 0;
        } else if (!strcmp(argv[i], "--pages")) {
            c.verbose = 1;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return usage_error("info", "unknown option '%s'", argv[i]);
        } else if (!in) {
            in = argv[i];
        } else {
            return usage_error("info", "extra argument '%s'", argv[i]);
        }
    }
    if (!in)
        return usage_error("info", "need IN");
    if (!(buf = read_file(in, &len)))
        return fail(in, "%s", strerror(errno));
    rc = walk_pages(in, buf, len, info_page, &c);
    if (rc == 0) {
        double coords = (double)c.bf16 / 2;
        printf("file          %s\n", in);
        printf("pages         %zu (%zu bytes)\n", c.pages, c.bytes);
        printf("vectors       %zu x dim %u%s\n", c.vectors, c.dim,
               c.mixed ? " (mixed codecs)" : "");
        printf("codec         K %s bits %s%s, V %s%s%s, rotation %s, seed %llu%s\n",
               bits_name(c.first.k.bits_x2), mode_name(c.first.k.mode),
               c.first.k.norm_correction ? " norm-corrected" : "",
               c.first.v.bits_x2 ? bits_name(c.first.v.bits_x2) : "absent",
               c.first.v.bits_x2 ? " bits " : "",
               c.first.v.bits_x2 ? mode_name(c.first.v.mode) : "",
               c.first.rotation ? "hadamard" : "dense", (unsigned long long)c.first.seed,
               c.first.key_centering ? ", keys centered" : "");
        printf("bits/coord    %.3f (all overhead included)\n", 8.0 * c.bytes / coords);
        printf("BF16 bytes    %zu\n", c.bf16);
        printf("ratio         %.2fx vs BF16\n", (double)c.bf16 / c.bytes);
    }
    free(buf);
    return rc;
}

/* ---- synthetic data ---- */

enum { DATA_RANDOM, DATA_SPARSE, DATA_CONSTANT, DATA_ONEHOT, DATA_LOWRANK, DATA_OUTLIER };
static const char *const data_names[] = {"random", "sparse",  "constant",
                                         "onehot", "lowrank", "outlier"};

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static double
unif(void)
{
    return ((tqkv_splitmix64(&rng_state) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double
gauss(void)
{
    return sqrt(-2 * log(unif())) * cos(2 * M_PI * unif());
}

static void
fill(int kind, uint32_t T, uint32_t D, float *x)
{
    double b0[TQKV_PAGE_MAX_DIM], b1[TQKV_PAGE_MAX_DIM], sgn = unif() < 0.5 ? -1 : 1;
    for (uint32_t j = 0; j < D; j++) {
        b0[j] = gauss();
        b1[j] = gauss();
    }
    for (uint32_t t = 0; t < T; t++) {
        float *v = x + (size_t)t * D;
        double a = exp(gauss()), c0 = gauss(), c1 = gauss();
        for (uint32_t j = 0; j < D; j++) {
            switch (kind) {
            case DATA_RANDOM:
                v[j] = (float)gauss();
                break;
            case DATA_CONSTANT:
                v[j] = (float)(a * sgn);
                break;
            case DATA_LOWRANK:
                v[j] = (float)(c0 * b0[j] + c1 * b1[j]);
                break;
            case DATA_OUTLIER:
                v[j] = (float)(gauss() * (j % 37 == 5 ? 30 : 1));
                break;
            default:
                v[j] = 0;
            }
        }
        if (kind == DATA_SPARSE)
            for (int k = 0; k < 4; k++)
                v[tqkv_splitmix64(&rng_state) % D] = (float)gauss();
        if (kind == DATA_ONEHOT)
            v[tqkv_splitmix64(&rng_state) % D] = (float)(a * sgn);
    }
}

/* ---- eval ---- */

typedef struct eval_row {
    double dmse, theory;
    double bias_mse, t_mse, var_mse; /* <y, x_hat> - <y, x>, y = x/|x| + noise */
    double bias_prod, t_prod, var_prod, dprod;
    double slope_mse, slope_prod;
} eval_row_t;

/* Runs `seeds` pages of n/seeds vectors through (bits, mode). Inner-product stats are
 * over y = x/||x|| + N(0, 1/(4D)) per coordinate; the t-statistic over page means. */
static int
eval_run(uint32_t D, uint32_t bits, uint8_t mode, uint8_t rot, int kind, uint32_t n, uint32_t seeds,
         double *dmse, double *bias, double *tstat, double *var, double *slope)
{
    uint32_t T = (n + seeds - 1) / seeds;
    tqkv_block_shape_t s = {T, 1, D};
    tqkv_block_codec_t c = {0};
    size_t sz, cnt = (size_t)T * D;
    float *x = malloc(cnt * 4), *xh = malloc(cnt * 4);
    uint16_t *xb = malloc(cnt * 2);
    uint8_t *page = NULL;
    double sum_d = 0, pm = 0, pm2 = 0, sdev = 0, sdev2 = 0, sxy = 0, sxx = 0;
    char err[256];
    int rc = 0;
    c.k.bits_x2 = (uint8_t)(2 * bits);
    c.k.mode = mode;
    c.rotation = rot;
    if (!x || !xh || !xb || tqkv_page_size(&s, &c, &sz) != TQKV_OK || !(page = malloc(sz))) {
        rc = -1;
        goto out;
    }
    for (uint32_t p = 0; p < seeds; p++) {
        double page_d = 0;
        c.seed = tqkv_splitmix64(&rng_state);
        fill(kind, T, D, x);
        for (size_t i = 0; i < cnt; i++)
            xb[i] = tqkv_f32_to_bf16(x[i]);
        if (tqkv_page_encode(&s, &c, xb, NULL, page, sz, NULL, err, sizeof err) != TQKV_OK ||
            tqkv_page_decode_f32(page, sz, xh, NULL) != TQKV_OK) {
            rc = -1;
            goto out;
        }
        for (uint32_t t = 0; t < T; t++) {
            const uint16_t *xv = xb + (size_t)t * D;
            const float *hv = xh + (size_t)t * D;
            double e = 0, nn = 0, yx = 0, yxh = 0, nx, dlt;
            for (uint32_t j = 0; j < D; j++) {
                double a = tqkv_bf16_to_f32(xv[j]);
                e += (a - hv[j]) * (a - hv[j]);
                nn += a * a;
            }
            if (nn == 0)
                continue;
            sum_d += e / nn;
            nx = sqrt(nn);
            for (uint32_t j = 0; j < D; j++) {
                double a = tqkv_bf16_to_f32(xv[j]) / nx, y = a + 0.5 * gauss() / sqrt((double)D);
                yx += y * a;
                yxh += y * hv[j] / nx;
            }
            dlt = yxh - yx;
            page_d += dlt;
            sdev += dlt;
            sdev2 += dlt * dlt;
            sxy += yxh * yx;
            sxx += yx * yx;
        }
        page_d /= T;
        pm += page_d;
        pm2 += page_d * page_d;
    }
    {
        double N = (double)T * seeds, mean_p = pm / seeds;
        double var_p = seeds > 1 ? (pm2 - seeds * mean_p * mean_p) / (seeds - 1) : 0;
        *dmse = sum_d / N;
        *bias = sdev / N;
        *var = sdev2 / N - (*bias) * (*bias);
        *tstat = var_p > 0 ? mean_p / sqrt(var_p / seeds) : 0;
        *slope = sxx > 0 ? sxy / sxx : 0;
    }
out:
    free(x);
    free(xh);
    free(xb);
    free(page);
    return rc;
}

int
tqkv_cli_eval(int argc, char **argv)
{
    uint32_t D = 128, n = 20000, seeds = 8;
    uint8_t rot = TQKV_ROT_HADAMARD;
    int kind = DATA_RANDOM, json = 0;
    static const double paper[5] = {0, 0.36, 0.117, 0.03, 0.009};
    eval_row_t rows[5];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (is_help(a)) {
            printf("usage: tqkv-codec eval [--dim D] [--n N] [--seeds K] [--rotation R]\n"
                   "                       [--data random|sparse|constant|onehot|lowrank|"
                   "outlier] [--json]\n"
                   "  encodes N synthetic vectors in K pages (each its own rotation seed) at\n"
                   "  b = 1..4 and prints measured D_mse = E||x - x_hat||^2/||x||^2 next to the\n"
                   "  codebook theory and the paper's bounds, and inner-product bias (t over\n"
                   "  pages) and variance for mse and prod, with y = x/|x| + noise.\n");
            return 0;
        } else if (!strcmp(a, "--dim") && v) {
            if (parse_u32(v, TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return usage_error("eval", "unsupported --dim '%s'", v);
            i++;
        } else if (!strcmp(a, "--n") && v) {
            if (parse_u32(v, 16, 100000000, &n))
                return usage_error("eval", "bad --n '%s'", v);
            i++;
        } else if (!strcmp(a, "--seeds") && v) {
            if (parse_u32(v, 1, 100000, &seeds))
                return usage_error("eval", "bad --seeds '%s'", v);
            i++;
        } else if (!strcmp(a, "--rotation") && v) {
            if (parse_rotation(v, &rot))
                return usage_error("eval", "bad --rotation '%s'", v);
            i++;
        } else if (!strcmp(a, "--data") && v) {
            kind = -1;
            for (int k = 0; k < 6; k++)
                if (!strcmp(v, data_names[k]))
                    kind = k;
            if (kind < 0)
                return usage_error("eval", "unknown --data '%s'", v);
            i++;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else {
            return usage_error("eval", "unknown or incomplete option '%s'", a);
        }
    }
    if (n / seeds > TQKV_PAGE_MAX_TOKENS || n / seeds < 1)
        return usage_error("eval", "--n / --seeds must be 1..%u vectors per page",
                           TQKV_PAGE_MAX_TOKENS);
    for (uint32_t b = 1; b <= 4; b++) {
        const tqkv_codebook_t *cb;
        eval_row_t *r = &rows[b];
        if (tqkv_codebook_get(D, b, &cb) != TQKV_OK)
            return fail("eval", "no codebook for d=%u b=%u", D, b);
        r->theory = cb->d_mse;
        if (eval_run(D, b, TQKV_MODE_MSE, rot, kind, n, seeds, &r->dmse, &r->bias_mse, &r->t_mse,
                     &r->var_mse, &r->slope_mse) ||
            eval_run(D, b, TQKV_MODE_PROD, rot, kind, n, seeds, &r->dprod, &r->bias_prod,
                     &r->t_prod, &r->var_prod, &r->slope_prod))
            return fail("eval", "encode failed");
    }
    if (json) {
        printf("{\"dim\": %u, \"n\": %u, \"seeds\": %u, \"rotation\": \"%s\", \"data\": \"%s\", "
               "\"isa\": \"%s\", \"rows\": [",
               D, n, seeds, rot ? "hadamard" : "dense", data_names[kind], tqkv_kernels_isa());
        for (uint32_t b = 1; b <= 4; b++) {
            eval_row_t *r = &rows[b];
            printf("%s{\"bits\": %u, \"d_mse\": %.6g, \"theory\": %.6g, \"paper\": %g, "
                   "\"upper_bound\": %.6g, \"lower_bound\": %.6g, \"mse_ip_bias\": %.6g, "
                   "\"mse_ip_t\": %.3f, \"mse_ip_var\": %.6g, \"mse_slope\": %.5f, "
                   "\"prod_d\": %.6g, \"prod_ip_bias\": %.6g, \"prod_ip_t\": %.3f, "
                   "\"prod_ip_var\": %.6g, \"prod_slope\": %.5f}",
                   b > 1 ? ", " : "", b, r->dmse, r->theory, paper[b],
                   sqrt(3) * M_PI / 2 * pow(4, -(double)b), pow(4, -(double)b), r->bias_mse,
                   r->t_mse, r->var_mse, r->slope_mse, r->dprod, r->bias_prod, r->t_prod,
                   r->var_prod, r->slope_prod);
        }
        printf("], \"two_over_pi\": %.5f}\n", 2 / M_PI);
        return 0;
    }
    printf("tqkv-codec eval: d=%u, %u %s vectors in %u pages (seeds), rotation %s, kernels %s\n\n",
           D, (n + seeds - 1) / seeds * seeds, data_names[kind], seeds, rot ? "hadamard" : "dense",
           tqkv_kernels_isa());
    printf(" b | D_mse measured | theory   | diff    | paper  | upper sqrt3*pi/2*4^-b | lower "
           "4^-b\n");
    printf("---+----------------+----------+---------+--------+-----------------------+-------"
           "---\n");
    for (uint32_t b = 1; b <= 4; b++) {
        eval_row_t *r = &rows[b];
        printf(" %u | %14.5f | %8.5f | %+6.2f%% | %6.3f | %21.4f | %8.4f\n", b, r->dmse, r->theory,
               100 * (r->dmse / r->theory - 1), paper[b], sqrt(3) * M_PI / 2 * pow(4, -(double)b),
               pow(4, -(double)b));
    }
    printf("\ninner products <y, x_hat> - <y, x> (unit x, y = x + noise; t over pages; slope of\n"
           "<y, x_hat> on <y, x>: mse shrinks by 2/pi = %.4f at b = 1, prod is unbiased)\n\n",
           2 / M_PI);
    printf(" b | mse bias   t       var       slope  | prod bias  t       var       slope  | "
           "prod D\n");
    printf("---+-------------------------------------+-------------------------------------+--"
           "-----\n");
    for (uint32_t b = 1; b <= 4; b++) {
        eval_row_t *r = &rows[b];
        printf(" %u | %+9.5f %+7.2f %9.2e %6.4f | %+9.5f %+7.2f %9.2e %6.4f | %.4f\n", b,
               r->bias_mse, r->t_mse, r->var_mse, r->slope_mse, r->bias_prod, r->t_prod,
               r->var_prod, r->slope_prod, r->dprod);
    }
    return 0;
}

/* ---- bench ---- */

/* KV-like BF16: Gaussian per channel with log-normal channel scales, a per-channel
 * offset, and a few outlier channels. */
static void
kv_like(uint16_t *x, size_t n, uint32_t D)
{
    double sc[TQKV_PAGE_MAX_DIM], off[TQKV_PAGE_MAX_DIM];
    for (uint32_t j = 0; j < D; j++) {
        sc[j] = exp(0.6 * gauss()) * (j % 61 == 7 ? 12 : 1);
        off[j] = unif() < 0.2 ? gauss() : 0;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t j = (uint32_t)(i % D);
        x[i] = tqkv_f32_to_bf16((float)(off[j] + sc[j] * gauss()));
    }
}

typedef struct bench_res {
    double enc, dec, memcpy_, zc, zd, zratio, ratio, enc_ref, dec_ref;
} bench_res_t;

/* bench with parsed options. */
typedef struct codec_bench_args {
    uint32_t D, mb, tpp, reps, heads;
    uint8_t bits_x2, mode, rot, nc, center;
    int json, with_ref;
} codec_bench_args_t;

/* Prints the results r of a bench run a over bytes of BF16: a table, or one JSON object. */
static void
bench_print(const codec_bench_args_t *a, const bench_res_t *r, size_t bytes)
{
    const uint32_t D = a->D, tpp = a->tpp, reps = a->reps;
    const uint8_t bits_x2 = a->bits_x2, mode = a->mode, rot = a->rot;
    const int with_ref = a->with_ref;
    if (a->json) {
        printf("{\"dim\": %u, \"bits\": \"%s\", \"mode\": \"%s\", \"rotation\": \"%s\", "
               "\"isa\": \"%s\", \"clock\": \"%s\", \"bytes\": %zu, \"tokens_per_page\": %u, "
               "\"encode_gbps\": %.3f, \"decode_gbps\": %.3f, \"ratio\": %.3f, "
               "\"memcpy_gbps\": %.3f, \"zstd1_compress_gbps\": %.3f, "
               "\"zstd1_decompress_gbps\": %.3f, \"zstd1_ratio\": %.3f",
               D, bits_name(bits_x2), mode ? "prod" : "mse", rot ? "hadamard" : "dense",
               tqkv_kernels_isa(),
               getenv("TQKV_BENCH_CLOCK") && !strcmp(getenv("TQKV_BENCH_CLOCK"), "cpu") ? "cpu"
                                                                                        : "wall",
               bytes, tpp, r->enc, r->dec, r->ratio, r->memcpy_, r->zc, r->zd, r->zratio);
        if (with_ref)
            printf(", \"encode_ref_gbps\": %.3f, \"decode_ref_f32_gbps\": %.3f", r->enc_ref,
                   r->dec_ref);
        printf("}\n");
    } else {
        const char *ck = getenv("TQKV_BENCH_CLOCK");
        printf("tqkv-codec bench: d=%u, %s bits %s, rotation %s, %u tokens/page, %.0f MiB of "
               "KV-like BF16, one core, kernels %s, best of %u, %s clock\n\n",
               D, bits_name(bits_x2), mode ? "prod" : "mse", rot ? "hadamard" : "dense", tpp,
               bytes / 1048576.0, tqkv_kernels_isa(), reps,
               ck && !strcmp(ck, "cpu") ? "thread CPU" : "wall");
        printf(" %-26s %10s %10s %8s\n", "", "in GB/s", "out GB/s", "ratio");
        printf(" %-26s %10.2f %10.2f %8.2fx\n", "tqkv encode / decode", r->enc, r->dec, r->ratio);
        if (with_ref)
            printf(" %-26s %10.2f %10.2f %8s\n", "tqkv scalar reference", r->enc_ref, r->dec_ref,
                   "(f32 out)");
        printf(" %-26s %10.2f %10.2f %8.2fx\n", "zstd -1 compress / decomp.", r->zc, r->zd,
               r->zratio);
        printf(" %-26s %10.2f %10s %8s\n", "memcpy", r->memcpy_, "", "");
        printf("\n vs zstd -1: encode %.1fx faster, decode %.1fx %s, ratio %.1fx higher\n",
               r->enc / r->zc, r->dec >= r->zd ? r->dec / r->zd : r->zd / r->dec,
               r->dec >= r->zd ? "faster" : "slower", r->ratio / r->zratio);
    }
}

/* zstd -1 compress and decompress of x[bytes] (y: bytes of scratch), best of reps, into
 * r->zc, r->zd, r->zratio. Returns 0, or -1 after printing why. */
static int
bench_zstd(const uint16_t *x, uint16_t *y, size_t bytes, uint32_t reps, bench_res_t *r)
{
    size_t zcap = ZSTD_compressBound(bytes), zlen = 0;
    double best_c = 1e30, best_d = 1e30;
    ZSTD_CCtx *cc = ZSTD_createCCtx();
    ZSTD_DCtx *dc = ZSTD_createDCtx();
    uint8_t *zbuf = malloc(zcap);
    if (!zbuf || !cc || !dc) {
        ZSTD_freeCCtx(cc);
        ZSTD_freeDCtx(dc);
        free(zbuf);
        fail("bench", "zstd setup failed");
        return -1;
    }
    for (uint32_t rep = 0; rep < reps; rep++) {
        double t0 = now_s(), t1;
        zlen = ZSTD_compressCCtx(cc, zbuf, zcap, x, bytes, 1);
        t1 = now_s();
        if (ZSTD_isError(zlen) || ZSTD_isError(ZSTD_decompressDCtx(dc, y, bytes, zbuf, zlen))) {
            ZSTD_freeCCtx(cc);
            ZSTD_freeDCtx(dc);
            free(zbuf);
            fail("bench", "zstd failed");
            return -1;
        }
        best_c = fmin(best_c, t1 - t0);
        best_d = fmin(best_d, now_s() - t1);
    }
    ZSTD_freeCCtx(cc);
    ZSTD_freeDCtx(dc);
    r->zc = bytes / best_c / 1e9;
    r->zd = bytes / best_d / 1e9;
    r->zratio = (double)bytes / zlen;
    free(zbuf);
    return 0;
}

/* Encode/decode GB/s next to memcpy and zstd -1 on KV-like data. Returns the exit
 * status. */
static int
codec_bench_run(const codec_bench_args_t *a)
{
    const uint32_t D = a->D, mb = a->mb, tpp = a->tpp, reps = a->reps, heads = a->heads;
    const uint8_t bits_x2 = a->bits_x2, mode = a->mode, rot = a->rot, nc = a->nc,
                  center = a->center;
    const int with_ref = a->with_ref;
    size_t n, nvec, npages, bytes, cap = 0, total = 0;
    uint16_t *x = NULL, *y = NULL;
    float *yf = NULL; /* one page of f32 for the reference decode */
    uint8_t *pages = NULL;
    size_t *offs = NULL;
    bench_res_t r = {0};
    int rc = 1;

    nvec = ((size_t)mb << 20) / (2 * D);
    nvec = nvec / ((size_t)tpp * heads) * ((size_t)tpp * heads);
    if (nvec == 0)
        nvec = (size_t)tpp * heads;
    n = nvec * D;
    bytes = n * 2;
    npages = nvec / ((size_t)tpp * heads);
    x = malloc(bytes);
    y = malloc(bytes);
    offs = malloc(sizeof(size_t) * (npages + 1));
    yf = malloc(sizeof(float) * tpp * heads * D);
    if (!x || !y || !offs || !yf) {
        fail("bench", "out of memory");
        goto out;
    }
    kv_like(x, n, D);
    {
        tqkv_block_shape_t s = {tpp, heads, D};
        tqkv_block_codec_t c = {0};
        size_t sz, per = (size_t)tpp * heads * D;
        char err[256];
        c.k.bits_x2 = bits_x2;
        c.k.mode = mode;
        c.k.norm_correction = nc;
        c.key_centering = center;
        c.rotation = rot;
        c.seed = 42;
        if (tqkv_page_size(&s, &c, &sz) != TQKV_OK) {
            tqkv_page_check_params(&s, &c, err, sizeof err);
            fail("bench", "%s", err);
            goto out;
        }
        cap = sz * npages;
        if (!(pages = malloc(cap))) {
            fail("bench", "out of memory");
            goto out;
        }
        for (int ref = 0; ref <= with_ref; ref++) {
            double best_e = 1e30, best_d = 1e30;
            for (uint32_t rep = 0; rep < (ref ? 1 : reps); rep++) {
                double t0 = now_s(), t1, t2;
                total = 0;
                for (size_t p = 0; p < npages; p++) {
                    size_t w;
                    tqkv_status_t st =
                        ref ? tqkv_page_encode_ref(&s, &c, x + p * per, NULL, pages + total,
                                                   cap - total, &w, err, sizeof err)
                            : tqkv_page_encode(&s, &c, x + p * per, NULL, pages + total,
                                               cap - total, &w, err, sizeof err);
                    if (st != TQKV_OK) {
                        fail("bench", "%s", err);
                        goto out;
                    }
                    offs[p] = total;
                    total += w;
                }
                t1 = now_s();
                for (size_t p = 0; p < npages; p++) {
                    tqkv_status_t st =
                        ref ? tqkv_page_decode_f32_ref(pages + offs[p], sz, yf, NULL)
                            : tqkv_page_decode_bf16(pages + offs[p], sz, y + p * per, NULL);
                    if (st != TQKV_OK) {
                        fail("bench", "decode: %s", tqkv_strerror(st));
                        goto out;
                    }
                }
                t2 = now_s();
                best_e = fmin(best_e, t1 - t0);
                best_d = fmin(best_d, t2 - t1);
            }
            if (ref) {
                r.enc_ref = bytes / best_e / 1e9;
                r.dec_ref = bytes / best_d / 1e9;
            } else {
                r.enc = bytes / best_e / 1e9;
                r.dec = bytes / best_d / 1e9;
            }
        }
        r.ratio = (double)bytes / total;
    }
    {
        double best = 1e30;
        for (uint32_t rep = 0; rep < reps; rep++) {
            double t0 = now_s();
            memcpy(y, x, bytes);
            best = fmin(best, now_s() - t0);
        }
        r.memcpy_ = bytes / best / 1e9;
    }
    if (bench_zstd(x, y, bytes, reps, &r) != 0)
        goto out;
    bench_print(a, &r, bytes);
    rc = 0;
out:
    free(x);
    free(y);
    free(yf);
    free(offs);
    free(pages);
    return rc;
}

int
tqkv_cli_bench(int argc, char **argv)
{
    uint32_t D = 128, mb = 64, tpp = 256, reps = 3;
    uint8_t bits_x2 = 6, mode = TQKV_MODE_MSE, rot = TQKV_ROT_HADAMARD, nc = 0, center = 0;
    uint32_t heads = 1;
    int json = 0, with_ref = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (is_help(a)) {
            printf("usage: tqkv-codec bench [--dim 128] [--bits 3] [--mode mse] [--rotation "
                   "hadamard]\n"
                   "                        [--mb 64] [--tokens-per-page 256] [--heads 1] "
                   "[--reps 3]\n"
                   "                        [--norm-correction] [--centering] [--ref] [--json]\n"
                   "  one core, KV-like synthetic BF16: encode GB/s (BF16 in), decode GB/s\n"
                   "  (BF16 out), memcpy, zstd -1 on the same data; best of --reps runs.\n"
                   "  --heads H, --norm-correction, --centering: pages of H heads with those\n"
                   "  settings (the default KV policy is 3 bits, norm correction, centered keys).\n"
                   "  --ref also times the scalar reference. TQKV_BENCH_CLOCK=cpu times with\n"
                   "  the thread's CPU clock instead of wall clock (busy shared machines).\n");
            return 0;
        } else if (!strcmp(a, "--dim") && v) {
            if (parse_u32(v, TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return usage_error("bench", "unsupported --dim '%s'", v);
            i++;
        } else if (!strcmp(a, "--bits") && v) {
            if (parse_bits(v, &bits_x2))
                return usage_error("bench", "unsupported --bits '%s'", v);
            i++;
        } else if (!strcmp(a, "--mode") && v) {
            if (parse_mode(v, &mode))
                return usage_error("bench", "bad --mode '%s'", v);
            i++;
        } else if (!strcmp(a, "--rotation") && v) {
            if (parse_rotation(v, &rot))
                return usage_error("bench", "bad --rotation '%s'", v);
            i++;
        } else if (!strcmp(a, "--mb") && v) {
            if (parse_u32(v, 1, 4096, &mb))
                return usage_error("bench", "bad --mb '%s'", v);
            i++;
        } else if (!strcmp(a, "--tokens-per-page") && v) {
            if (parse_u32(v, 1, TQKV_PAGE_MAX_TOKENS, &tpp))
                return usage_error("bench", "bad --tokens-per-page '%s'", v);
            i++;
        } else if (!strcmp(a, "--reps") && v) {
            if (parse_u32(v, 1, 100, &reps))
                return usage_error("bench", "bad --reps '%s'", v);
            i++;
        } else if (!strcmp(a, "--ref")) {
            with_ref = 1;
        } else if (!strcmp(a, "--norm-correction")) {
            nc = 1;
        } else if (!strcmp(a, "--centering")) {
            center = 1;
        } else if (!strcmp(a, "--heads") && v) {
            if (parse_u32(v, 1, TQKV_PAGE_MAX_HEADS, &heads))
                return usage_error("bench", "bad --heads '%s'", v);
            i++;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else {
            return usage_error("bench", "unknown or incomplete option '%s'", a);
        }
    }
    {
        const codec_bench_args_t a = {D,    mb,  tpp, reps,   heads, bits_x2,
                                      mode, rot, nc,  center, json,  with_ref};
        return codec_bench_run(&a);
    }
}
