/* kv_cli.c - tqkv-codec subcommands for KV blocks: encode-kv, decode-kv, attend, attn-eval,
 * attn-bench.
 *
 * Files are raw little-endian arrays: K and V BF16 [T][H][D], queries and outputs float32
 * [HQ][D]; a page file (.tqp) is one or more pages back to back. Usage errors exit 2, bad
 * input exits 1 with "tqkv-codec: <problem>" on stderr.
 */
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
#include "kernels/cli/kv_synth.h"
#include "kernels/cli/io_cli.h"
#include "kernels/kivi.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

int tqkv_cli_encode_kv(int argc, char **argv);
int tqkv_cli_decode_kv(int argc, char **argv);
int tqkv_cli_attend(int argc, char **argv);
int tqkv_cli_attn_eval(int argc, char **argv);
int tqkv_cli_attn_bench(int argc, char **argv);

/* ---- small helpers ---- */

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int
fail(const char *fmt, ...)
{
    va_list ap;
    fputs("tqkv-codec: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

static int usage_err(const char *usage, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int
usage_err(const char *usage, const char *fmt, ...)
{
    va_list ap;
    fputs("tqkv-codec: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n%s", usage);
    return 2;
}

static int
is_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}

/* Reads f to its end and closes it (they read as 'Input/output error': ftell fails on a
 * pipe). Returns new memory (64-byte aligned, free()), or NULL with errno. */
static void *
read_stream(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = aligned_alloc(64, cap);
    while (buf) {
        if (n == cap) {
            uint8_t *nb = aligned_alloc(64, cap * 2);
            if (nb)
                memcpy(nb, buf, n);
            free(buf);
            buf = nb;
            cap *= 2;
            if (!buf)
                break;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            int bad = ferror(f);
            fclose(f);
            if (bad) {
                free(buf);
                errno = EIO;
                return NULL;
            }
            *len = n;
            return buf;
        }
    }
    fclose(f);
    errno = ENOMEM;
    return NULL;
}

/* Reads a whole file; returns new memory (64-byte aligned, free()), or NULL with errno. */
static void *
read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    long n;
    void *buf;
    if (!f)
        return NULL;
    struct stat sb;
    int have_st = fstat(fileno(f), &sb) == 0;
    if (have_st && S_ISDIR(sb.st_mode)) {
        fclose(f);
        errno = EISDIR;
        return NULL;
    }
    if (!have_st || !S_ISREG(sb.st_mode))
        return read_stream(f, len); /* a pipe, FIFO or /dev/stdin: no size up front */
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        errno = EIO;
        return NULL;
    }
    buf = aligned_alloc(64, tqkv_align_up((uint64_t)n + 1, 64));
    if (!buf) {
        fclose(f);
        errno = ENOMEM;
        return NULL;
    }
    if (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        errno = EIO;
        return NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* Whole or nothing (kernels/cli/io_cli.h): a failed write left a truncated file. */
static int
write_file(const char *path, const void *buf, size_t len)
{
    return tqkv__cli_write_file(path, buf, len);
}

static int
parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    unsigned long long v;
    if (!s || !*s || *s == '-')
        return -1;
    errno = 0;
    v = strtoull(s, &end, 0);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int
parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    uint64_t v;
    if (parse_u64(s, lo, hi, &v) != 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int
parse_mode(const char *s, uint8_t *mode)
{
    if (s && !strcmp(s, "mse"))
        *mode = TQKV_MODE_MSE;
    else if (s && !strcmp(s, "prod"))
        *mode = TQKV_MODE_PROD;
    else if (s && !strcmp(s, "lossless"))
        *mode = TQKV_MODE_RAW;
    else
        return -1;
    return 0;
}

/* Seconds of CPU time of the calling thread: the benchmarks run on one core, and CPU time
 * keeps other processes sharing the machine out of the numbers (wall time is also shown). */
static double
cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Option lookup: argv[i] is "--name"; takes the next argument as its value. */
#define OPT_VALUE(name) (!strcmp(argv[i], name) && (i + 1 < argc ? 1 : (missing = name, 0)))

/* ---- pages in a file ---- */

typedef struct page_list {
    size_t n, cap;
    const void **pages;
    size_t *lens;
    uint64_t tokens;
} page_list_t;

static void
page_list_free(page_list_t *pl)
{
    free(pl->pages);
    free(pl->lens);
    memset(pl, 0, sizeof *pl);
}

/* Splits buf[0..len) into validated pages; appends to pl. Returns 0 or prints and -1. */
static int
page_list_add(page_list_t *pl, const char *path, const uint8_t *buf, size_t len, int check_crc)
{
    size_t off = 0;
    if (len == 0) {
        fail("%s: empty page file", path);
        return -1;
    }
    while (off < len) {
        tqkv_page_info_t info;
        char why[160] = "";
        tqkv_status_t st =
            tqkv_page_validate(buf + off, len - off, check_crc, &info, why, sizeof why);
        if (st != TQKV_OK) {
            fail("%s: page at byte %zu: %s", path, off, why[0] ? why : tqkv_strerror(st));
            return -1;
        }
        if (pl->n == pl->cap) {
            size_t cap = pl->cap ? 2 * pl->cap : 16;
            const void **p = realloc(pl->pages, sizeof(void *) * cap);
            size_t *l = p ? realloc(pl->lens, sizeof(size_t) * cap) : NULL;
            if (!p || !l) {
                if (p)
                    pl->pages = p;
                fail("out of memory");
                return -1;
            }
            pl->pages = p;
            pl->lens = l;
            pl->cap = cap;
        }
        pl->pages[pl->n] = buf + off;
        pl->lens[pl->n] = info.page_bytes;
        pl->n++;
        pl->tokens += info.shape.num_tokens;
        off += info.page_bytes;
    }
    return 0;
}

/* ---- encode-kv ---- */

static const char encode_kv_usage[] =
    "usage: tqkv-codec encode-kv --tokens T --heads H --dim D [--key-bits KB] [--value-bits VB]\n"
    "         [--key-mode mse|prod|lossless] [--value-mode mse|prod|lossless] [--lossless]\n"
    "         [--seed S] [--no-norm-correction] [--no-key-centering] [--rotation dense|hadamard]\n"
    "         [--block N] K.bf16 V.bf16 OUT.tqp\n"
    "  K, V: raw little-endian BF16 [T][H][D]. Bits: 1, 1.5, 2, 2.5, 3, 3.5, 4.\n"
    "  lossless (--lossless: K and V): BF16 kept as is, decode-kv returns the input bytes;\n"
    "  takes no bits.\n"
    "  Defaults: the server's default policy for a middle layer (pages a default tqkv-server\n"
    "  stores); --no-norm-correction and --no-key-centering turn those off (--help lists them).\n"
    "  --block N splits the tokens into pages of N tokens (default: one page, T <= 65536).\n";

/* The usage, then the default policy's values (kernels/policy.c: tqkv_policy_default). */
static void
encode_kv_help(FILE *f)
{
    tqkv_block_codec_t c;
    tqkv_policy_default_codec(&c);
    fputs(encode_kv_usage, f);
    fprintf(f,
            "  Default codec: keys %g bits %s%s, values %g bits %s%s, key centering %s, %s "
            "rotation, seed %llu.\n",
            c.k.bits_x2 / 2.0, c.k.mode == TQKV_MODE_PROD ? "prod" : "mse",
            c.k.norm_correction ? " norm-corrected" : "", c.v.bits_x2 / 2.0,
            c.v.mode == TQKV_MODE_PROD ? "prod" : "mse",
            c.v.norm_correction ? " norm-corrected" : "", c.key_centering ? "on" : "off",
            c.rotation == TQKV_ROT_DENSE ? "dense" : "hadamard", (unsigned long long)c.seed);
}

int
tqkv_cli_encode_kv(int argc, char **argv)
{
    const char *pos[3], *missing = NULL;
    int npos = 0, rc = 1;
    uint32_t T = 0, H = 0, D = 0, block = 0;
    tqkv_block_codec_t codec;
    uint16_t *k = NULL, *v = NULL;
    uint8_t *out = NULL;
    size_t klen, vlen, total = 0, cap = 0;
    int kb_given = 0, vb_given = 0;

    if (is_help(argc, argv)) {
        encode_kv_help(stdout);
        return 0;
    }
    tqkv_policy_default_codec(&codec);
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--tokens")) {
            if (parse_u32(argv[++i], 1, UINT32_MAX, &T))
                return usage_err(encode_kv_usage, "bad --tokens '%s'", argv[i]);
        } else if (OPT_VALUE("--heads")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return usage_err(encode_kv_usage, "bad --heads '%s'", argv[i]);
        } else if (OPT_VALUE("--dim")) {
            if (parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return usage_err(encode_kv_usage, "bad --dim '%s' (%u..%u)", argv[i],
                                 TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM);
        } else if (OPT_VALUE("--key-bits")) {
            if (tqkv_bits_parse(argv[++i], &codec.k.bits_x2) != TQKV_OK)
                return usage_err(encode_kv_usage, "bad --key-bits '%s'", argv[i]);
            kb_given = 1;
        } else if (OPT_VALUE("--value-bits")) {
            if (tqkv_bits_parse(argv[++i], &codec.v.bits_x2) != TQKV_OK)
                return usage_err(encode_kv_usage, "bad --value-bits '%s'", argv[i]);
            vb_given = 1;
        } else if (OPT_VALUE("--key-mode")) {
            if (parse_mode(argv[++i], &codec.k.mode))
                return usage_err(encode_kv_usage, "bad --key-mode '%s'", argv[i]);
        } else if (OPT_VALUE("--value-mode")) {
            if (parse_mode(argv[++i], &codec.v.mode))
                return usage_err(encode_kv_usage, "bad --value-mode '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (parse_u64(argv[++i], 0, UINT64_MAX, &codec.seed))
                return usage_err(encode_kv_usage, "bad --seed '%s'", argv[i]);
        } else if (OPT_VALUE("--rotation")) {
            i++;
            if (!strcmp(argv[i], "dense"))
                codec.rotation = TQKV_ROT_DENSE;
            else if (!strcmp(argv[i], "hadamard"))
                codec.rotation = TQKV_ROT_HADAMARD;
            else
                return usage_err(encode_kv_usage, "bad --rotation '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return usage_err(encode_kv_usage, "bad --block '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--lossless")) {
            codec.k.mode = codec.v.mode = TQKV_MODE_RAW;
        } else if (!strcmp(argv[i], "--norm-correction")) {
            codec.k.norm_correction = codec.v.norm_correction = 1;
        } else if (!strcmp(argv[i], "--no-norm-correction")) {
            codec.k.norm_correction = codec.v.norm_correction = 0;
        } else if (!strcmp(argv[i], "--key-centering")) {
            codec.key_centering = 1;
        } else if (!strcmp(argv[i], "--no-key-centering")) {
            codec.key_centering = 0;
        } else if (missing) {
            return usage_err(encode_kv_usage, "%s needs a value", missing);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return usage_err(encode_kv_usage, "unknown option '%s'", argv[i]);
        } else if (npos < 3) {
            pos[npos++] = argv[i];
        } else {
            return usage_err(encode_kv_usage, "too many arguments");
        }
    }
    if (missing)
        return usage_err(encode_kv_usage, "%s needs a value", missing);
    if (!T || !H || !D || npos != 3)
        return usage_err(encode_kv_usage, "--tokens, --heads, --dim and 3 files are required");
    if ((codec.k.mode == TQKV_MODE_RAW && kb_given) || (codec.v.mode == TQKV_MODE_RAW && vb_given))
        return usage_err(encode_kv_usage,
                         "--%s-bits with a lossless %s: lossless tensors are stored as BF16 and "
                         "take no bit width",
                         codec.k.mode == TQKV_MODE_RAW && kb_given ? "key" : "value",
                         codec.k.mode == TQKV_MODE_RAW && kb_given ? "key" : "value");
    if (codec.k.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&codec.k);
    if (codec.v.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&codec.v);
    if (!block)
        block = T;
    if (block > TQKV_PAGE_MAX_TOKENS)
        return usage_err(encode_kv_usage, "%u tokens exceed one page (%u): use --block", T,
                         TQKV_PAGE_MAX_TOKENS);

    if (!(k = read_file(pos[0], &klen)))
        return fail("%s: %s", pos[0], strerror(errno));
    if (!(v = read_file(pos[1], &vlen))) {
        fail("%s: %s", pos[1], strerror(errno));
        goto done;
    }
    {
        uint64_t want = (uint64_t)T * H * D * 2;
        if (klen != want || vlen != want) {
            fail("%s is %zu bytes and %s is %zu bytes; the shape %u x %u x %u BF16 needs %" PRIu64,
                 pos[0], klen, pos[1], vlen, T, H, D, want);
            goto done;
        }
    }
    for (uint32_t t = 0; t < T; t += block) {
        tqkv_block_shape_t sh = {T - t < block ? T - t : block, H, D};
        size_t sz, wr;
        char why[200] = "";
        tqkv_status_t st = tqkv_page_size(&sh, &codec, &sz);
        if (st == TQKV_OK && total + sz > cap) {
            size_t ncap = cap ? cap * 2 : sz * ((T + block - 1) / block);
            uint8_t *n2;
            while (ncap < total + sz)
                ncap *= 2;
            if (!(n2 = realloc(out, ncap))) {
                fail("out of memory");
                goto done;
            }
            out = n2;
            cap = ncap;
        }
        if (st == TQKV_OK)
            st = tqkv_page_encode(&sh, &codec, k + (size_t)t * H * D, v + (size_t)t * H * D,
                                  out + total, cap - total, &wr, why, sizeof why);
        if (st != TQKV_OK) {
            fail("encode: %s", why[0] ? why : tqkv_strerror(st));
            goto done;
        }
        total += wr;
    }
    if (write_file(pos[2], out, total) != 0) {
        fail("%s: %s", pos[2], strerror(errno));
        goto done;
    }
    fprintf(stderr, "%u tokens x %u heads x %u dims -> %zu bytes (%.2fx vs BF16 K+V)\n", T, H, D,
            total, (double)T * H * D * 4 / (double)total);
    rc = 0;
done:
    free(k);
    free(v);
    free(out);
    return rc;
}

/* ---- decode-kv ---- */

static const char decode_kv_usage[] =
    "usage: tqkv-codec decode-kv [--format bf16|f32] [--no-check-crc] IN.tqp K.out V.out\n"
    "  Decodes every page of IN.tqp (K and V [T][H][D], pages concatenated along tokens).\n"
    "  Every page's CRC32C is checked unless --no-check-crc (--check-crc: the default).\n";

int
tqkv_cli_decode_kv(int argc, char **argv)
{
    const char *pos[3], *missing = NULL;
    int npos = 0, f32 = 0, check_crc = 1, rc = 1;
    uint8_t *buf = NULL;
    size_t len;
    page_list_t pl;
    void *k = NULL, *v = NULL;
    if (is_help(argc, argv)) {
        fputs(decode_kv_usage, stdout);
        return 0;
    }
    memset(&pl, 0, sizeof pl);
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--format")) {
            i++;
            if (!strcmp(argv[i], "f32"))
                f32 = 1;
            else if (!strcmp(argv[i], "bf16"))
                f32 = 0;
            else
                return usage_err(decode_kv_usage, "bad --format '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--check-crc")) {
            check_crc = 1;
        } else if (!strcmp(argv[i], "--no-check-crc")) {
            check_crc = 0;
        } else if (missing) {
            return usage_err(decode_kv_usage, "%s needs a value", missing);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return usage_err(decode_kv_usage, "unknown option '%s'", argv[i]);
        } else if (npos < 3) {
            pos[npos++] = argv[i];
        } else {
            return usage_err(decode_kv_usage, "too many arguments");
        }
    }
    if (missing)
        return usage_err(decode_kv_usage, "%s needs a value", missing);
    if (npos != 3)
        return usage_err(decode_kv_usage, "IN.tqp, K.out and V.out are required");
    {
        /* one path for both would silently keep only V (a device such as /dev/null is fine) */
        struct stat sb;
        if (tqkv__cli_same_file(pos[1], pos[2]) &&
            !(stat(pos[1], &sb) == 0 && !S_ISREG(sb.st_mode)))
            return usage_err(decode_kv_usage, "K.out and V.out are the same file '%s'", pos[2]);
    }
    if (!(buf = read_file(pos[0], &len)))
        return fail("%s: %s", pos[0], strerror(errno));
    if (page_list_add(&pl, pos[0], buf, len, check_crc) != 0)
        goto done;
    {
        uint32_t H, D;
        uint64_t T, off = 0;
        size_t esz = f32 ? 4 : 2, total;
        char why[200] = "";
        tqkv_status_t st =
            tqkv_attn_check_pages(pl.pages, pl.lens, pl.n, 0, &H, &D, &T, why, sizeof why);
        if (st != TQKV_OK) {
            fail("%s: %s", pos[0], why);
            goto done;
        }
        total = (size_t)T * H * D * esz;
        k = malloc(total);
        v = malloc(total);
        if (!k || !v) {
            fail("out of memory");
            goto done;
        }
        for (size_t p = 0; p < pl.n; p++) {
            uint32_t pt = ((const tqkv_page_header_t *)pl.pages[p])->num_tokens;
            size_t o = (size_t)off * H * D * esz;
            st = f32 ? tqkv_page_decode_f32(pl.pages[p], pl.lens[p], (float *)((char *)k + o),
                                            (float *)((char *)v + o))
                     : tqkv_page_decode_bf16(pl.pages[p], pl.lens[p], (uint16_t *)((char *)k + o),
                                             (uint16_t *)((char *)v + o));
            if (st != TQKV_OK) {
                fail("%s: page %zu: %s", pos[0], p, tqkv_strerror(st));
                goto done;
            }
            off += pt;
        }
        /* both files or neither: K is renamed into place only once V is written too */
        tqkv__cli_out_t ko, vo;
        if (tqkv__cli_out_write(&ko, pos[1], k, total) != 0) {
            fail("%s: %s", pos[1], strerror(errno));
            goto done;
        }
        if (tqkv__cli_out_write(&vo, pos[2], v, total) != 0) {
            fail("%s: %s", pos[2], strerror(errno));
            tqkv__cli_out_abort(&ko);
            goto done;
        }
        if (tqkv__cli_out_commit(&ko) != 0) {
            fail("%s: %s", pos[1], strerror(errno));
            tqkv__cli_out_abort(&vo);
            goto done;
        }
        if (tqkv__cli_out_commit(&vo) != 0) {
            fail("%s: %s", pos[2], strerror(errno));
            goto done;
        }
        fprintf(stderr, "%zu page%s: %" PRIu64 " tokens x %u heads x %u dims\n", pl.n,
                pl.n == 1 ? "" : "s", T, H, D);
    }
    rc = 0;
done:
    page_list_free(&pl);
    free(buf);
    free(k);
    free(v);
    return rc;
}

/* ---- attend ---- */

static const char attend_usage[] =
    "usage: tqkv-codec attend --query Q.f32 --query-heads HQ [--split-tokens N] [--threads N]\n"
    "         [--check-crc | --no-check-crc] OUT.f32 IN.tqp [IN2.tqp ...]\n"
    "  Fused decode attention of one query token (float32 [HQ][D]) over the pages of the\n"
    "  files, in order; writes float32 [HQ][D]. The files' page CRC32Cs are checked on\n"
    "  load unless --no-check-crc; --check-crc also has the kernel check them.\n";

int
tqkv_cli_attend(int argc, char **argv)
{
    const char *qpath = NULL, *missing = NULL, *outp = NULL;
    const char **inputs = calloc((size_t)argc, sizeof(char *));
    uint8_t **bufs = calloc((size_t)argc, sizeof(uint8_t *));
    int nin = 0, rc = 1, file_crc = 1;
    uint32_t HQ = 0;
    tqkv_attn_opts_t opts;
    page_list_t pl;
    float *q = NULL, *out = NULL;
    size_t qlen;
    memset(&pl, 0, sizeof pl);
    tqkv_attn_opts_default(&opts);
    if (!inputs || !bufs) {
        rc = fail("out of memory");
        goto done;
    }
    if (is_help(argc, argv)) {
        fputs(attend_usage, stdout);
        rc = 0;
        goto done;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--query")) {
            qpath = argv[++i];
        } else if (OPT_VALUE("--query-heads")) {
            if (parse_u32(argv[++i], 1, 1u << 20, &HQ)) {
                rc = usage_err(attend_usage, "bad --query-heads '%s'", argv[i]);
                goto done;
            }
        } else if (OPT_VALUE("--split-tokens")) {
            if (parse_u32(argv[++i], 0, UINT32_MAX, &opts.split_tokens)) {
                rc = usage_err(attend_usage, "bad --split-tokens '%s'", argv[i]);
                goto done;
            }
        } else if (OPT_VALUE("--threads")) {
            if (parse_u32(argv[++i], 1, 1024, &opts.num_threads)) {
                rc = usage_err(attend_usage, "bad --threads '%s'", argv[i]);
                goto done;
            }
        } else if (!strcmp(argv[i], "--check-crc")) {
            opts.check_crc = 1;
        } else if (!strcmp(argv[i], "--no-check-crc")) {
            opts.check_crc = 0;
            file_crc = 0;
        } else if (missing) {
            break;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            rc = usage_err(attend_usage, "unknown option '%s'", argv[i]);
            goto done;
        } else if (!outp) {
            outp = argv[i];
        } else {
            inputs[nin++] = argv[i];
        }
    }
    if (missing) {
        rc = usage_err(attend_usage, "%s needs a value", missing);
        goto done;
    }
    if (!qpath || !HQ || !outp || nin == 0) {
        rc = usage_err(attend_usage, "--query, --query-heads, OUT.f32 and at least one IN.tqp "
                                     "are required");
        goto done;
    }
    for (int i = 0; i < nin; i++) {
        size_t len;
        if (!(bufs[i] = read_file(inputs[i], &len))) {
            fail("%s: %s", inputs[i], strerror(errno));
            goto done;
        }
        if (page_list_add(&pl, inputs[i], bufs[i], len, file_crc) != 0)
            goto done;
    }
    {
        uint32_t H, D;
        uint64_t T;
        char why[240] = "";
        tqkv_status_t st;
        st = tqkv_attn_check_pages(pl.pages, pl.lens, pl.n, 0, &H, &D, &T, why, sizeof why);
        if (st != TQKV_OK) {
            fail("%s", why);
            goto done;
        }
        if (HQ % H != 0) {
            fail("--query-heads %u is not a multiple of the pages' %u KV heads", HQ, H);
            goto done;
        }
        if (!(q = read_file(qpath, &qlen))) {
            fail("%s: %s", qpath, strerror(errno));
            goto done;
        }
        if (qlen != (size_t)HQ * D * 4) {
            fail("%s is %zu bytes; %u query heads x head_dim %u float32 need %zu", qpath, qlen, HQ,
                 D, (size_t)HQ * D * 4);
            goto done;
        }
        for (size_t i = 0; i < (size_t)HQ * D; i++)
            if (!isfinite(q[i])) {
                fail("%s: element %zu is not finite", qpath, i);
                goto done;
            }
        out = malloc(sizeof(float) * HQ * D);
        if (!out) {
            fail("out of memory");
            goto done;
        }
        st = tqkv_attn_decode_ex(q, HQ, pl.pages, pl.lens, pl.n, &opts, out, why, sizeof why);
        if (st != TQKV_OK) {
            fail("attention: %s", why[0] ? why : tqkv_strerror(st));
            goto done;
        }
        if (write_file(outp, out, sizeof(float) * HQ * D) != 0) {
            fail("%s: %s", outp, strerror(errno));
            goto done;
        }
        fprintf(stderr, "%zu pages, %" PRIu64 " tokens, %u KV heads, %u query heads, d=%u (%s)\n",
                pl.n, T, H, HQ, D, tqkv_attn_isa());
    }
    rc = 0;
done:
    if (bufs)
        for (int i = 0; i < nin; i++)
            free(bufs[i]);
    free(bufs);
    free(inputs);
    page_list_free(&pl);
    free(q);
    free(out);
    return rc;
}

/* ---- synthetic KV and queries (attn-eval, attn-bench) ---- */

typedef struct rng {
    uint64_t s;
} rng_t;

static double
rng_u01(rng_t *r)
{
    return (double)(tqkv_splitmix64(&r->s) >> 11) * (1.0 / 9007199254740992.0);
}

static double
rng_normal(rng_t *r)
{
    double u = rng_u01(r), v = rng_u01(r);
    if (u < 1e-300)
        u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static double
rng_unif_cb(void *r)
{
    return rng_u01(r);
}

static double
rng_normal_cb(void *r)
{
    return rng_normal(r);
}

/* The synthetic data of kv_synth.h, drawn from the tool's generator. */
static void
synth_kv(rng_t *r, uint32_t T, uint32_t H, uint32_t D, uint16_t *k, uint16_t *v)
{
    tqkv_synth_rng_t sr = {rng_unif_cb, rng_normal_cb, r};
    tqkv_synth_kv(&sr, T, H, D, k, v);
}

static void
synth_q(rng_t *r, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T, const uint16_t *k, float peak,
        float *q)
{
    tqkv_synth_rng_t sr = {rng_unif_cb, rng_normal_cb, r};
    tqkv_synth_q(&sr, HQ, H, D, T, k, peak, q);
}

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
            fail("bad codec");
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
            fail("encode: %s", why);
            goto done;
        }
        pages[p] = buf + total;
        lens[p] = wr;
        if (tqkv_page_decode_f32(buf + total, wr, k + off, v + off) != TQKV_OK) {
            fail("decode failed");
            goto done;
        }
        total += wr;
    }
    st = tqkv_attn_decode(e->q, e->HQ, pages, lens, npages, NULL, out);
    if (st != TQKV_OK) {
        fail("attention: %s", tqkv_strerror(st));
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
        return fail("KIVI quantization failed");
    }
    eval_score(e, k, v, NULL, row);
    row->bits = 0.5 * (row->k_bits + row->v_bits);
    row->ratio = 16.0 / row->bits;
    snprintf(row->name, sizeof row->name, "KIVI-%u (g32, fp16 s/z)", bits);
    free(k);
    free(v);
    return 0;
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
    if (is_help(argc, argv)) {
        fputs(attn_eval_usage, stdout);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--k")) {
            kp = argv[++i];
        } else if (OPT_VALUE("--v")) {
            vp = argv[++i];
        } else if (OPT_VALUE("--tokens")) {
            if (parse_u32(argv[++i], 1, 1u << 24, &T))
                return usage_err(attn_eval_usage, "bad --tokens '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--heads")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return usage_err(attn_eval_usage, "bad --heads '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--dim")) {
            if (parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return usage_err(attn_eval_usage, "bad --dim '%s'", argv[i]);
            have_shape = 1;
        } else if (OPT_VALUE("--query-heads")) {
            if (parse_u32(argv[++i], 1, 1u << 16, &HQ))
                return usage_err(attn_eval_usage, "bad --query-heads '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return usage_err(attn_eval_usage, "bad --block '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (parse_u64(argv[++i], 0, UINT64_MAX, &seed))
                return usage_err(attn_eval_usage, "bad --seed '%s'", argv[i]);
        } else if (OPT_VALUE("--peak")) {
            char *end;
            peak = strtof(argv[++i], &end);
            if (*end || !(peak > 0.0f && peak < 100.0f))
                return usage_err(attn_eval_usage, "bad --peak '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (missing) {
            break;
        } else {
            return usage_err(attn_eval_usage, "unexpected argument '%s'", argv[i]);
        }
    }
    if (missing)
        return usage_err(attn_eval_usage, "%s needs a value", missing);
    if ((kp == NULL) != (vp == NULL) || (kp && !have_shape))
        return usage_err(attn_eval_usage, "--k and --v go together, with --tokens --heads --dim");
    if (HQ % H != 0)
        return usage_err(attn_eval_usage, "--query-heads %u is not a multiple of --heads %u", HQ,
                         H);
    {
        size_t n = (size_t)T * H * D;
        rng_t r = {seed};
        if (kp) {
            size_t kl, vl;
            if (!(k = read_file(kp, &kl)))
                return fail("%s: %s", kp, strerror(errno));
            if (!(v = read_file(vp, &vl))) {
                fail("%s: %s", vp, strerror(errno));
                goto done;
            }
            if (kl != n * 2 || vl != n * 2) {
                fail("%s is %zu bytes and %s is %zu; %u x %u x %u BF16 needs %zu", kp, kl, vp, vl,
                     T, H, D, n * 2);
                goto done;
            }
            for (size_t i = 0; i < n; i++)
                if (tqkv_bf16_is_nonfinite(k[i]) || tqkv_bf16_is_nonfinite(v[i])) {
                    fail("element %zu of K or V is not finite", i);
                    goto done;
                }
        } else {
            k = malloc(n * 2);
            v = malloc(n * 2);
            if (!k || !v) {
                fail("out of memory");
                goto done;
            }
            synth_kv(&r, T, H, D, k, v);
        }
        q = malloc(sizeof(float) * HQ * D);
        kf = malloc(n * 4);
        vf = malloc(n * 4);
        e.ref = malloc(sizeof(double) * HQ * D);
        e.top = malloc(sizeof(uint32_t) * HQ * 8);
        if (!q || !kf || !vf || !e.ref || !e.top) {
            fail("out of memory");
            goto done;
        }
        synth_q(&r, HQ, H, D, T, k, peak, q);
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

    {
        static const uint8_t sym[] = {5, 6, 7, 8};
        static const uint8_t asym[][2] = {{7, 5}, {7, 6}, {8, 6}, {8, 5}, {6, 5}, {8, 7}};
        size_t cap = 64;
        rows = calloc(cap, sizeof(eval_row_t));
        if (!rows) {
            fail("out of memory");
            goto done;
        }
        for (size_t b = 0; b < sizeof sym; b++)
            for (int kmode = 0; kmode < 2; kmode++)
                for (int nc = 0; nc < 2; nc++)
                    for (int ctr = 0; ctr < 2; ctr++) {
                        tqkv_block_codec_t c = {{sym[b], (uint8_t)kmode, (uint8_t)nc},
                                                {sym[b], TQKV_MODE_MSE, (uint8_t)nc},
                                                TQKV_ROT_HADAMARD,
                                                (uint8_t)ctr,
                                                seed * 7919u + 17u};
                        eval_row_t *rw = &rows[nrows++];
                        snprintf(rw->name, sizeof rw->name, "TQ K%.1f%s V%.1f%s%s", sym[b] / 2.0,
                                 kmode ? "p" : "", sym[b] / 2.0, nc ? " nc" : "",
                                 ctr ? " ctr" : "");
                        if (eval_turboquant(&e, &c, block, rw) != 0)
                            goto done;
                    }
        for (size_t a = 0; a < sizeof asym / sizeof asym[0]; a++)
            for (int ctr = 0; ctr < 2; ctr++) {
                tqkv_block_codec_t c = {{asym[a][0], TQKV_MODE_MSE, 1},
                                        {asym[a][1], TQKV_MODE_MSE, 1},
                                        TQKV_ROT_HADAMARD,
                                        (uint8_t)ctr,
                                        seed * 7919u + 17u};
                eval_row_t *rw = &rows[nrows++];
                snprintf(rw->name, sizeof rw->name, "TQ K%.1f V%.1f nc%s", asym[a][0] / 2.0,
                         asym[a][1] / 2.0, ctr ? " ctr" : "");
                if (eval_turboquant(&e, &c, block, rw) != 0)
                    goto done;
            }
        {
            /* prod values, for the record */
            tqkv_block_codec_t c = {{7, TQKV_MODE_MSE, 1},
                                    {7, TQKV_MODE_PROD, 1},
                                    TQKV_ROT_HADAMARD,
                                    1,
                                    seed * 7919u + 17u};
            eval_row_t *rw = &rows[nrows++];
            snprintf(rw->name, sizeof rw->name, "TQ K3.5 V3.5p nc ctr");
            if (eval_turboquant(&e, &c, block, rw) != 0)
                goto done;
        }
        for (uint32_t b = 2; b <= 4; b++)
            if (eval_kivi(&e, b, &rows[nrows++]) != 0)
                goto done;
    }

    if (json) {
        printf("{\"tokens\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"query_heads\":%u,\"block\":%u,"
               "\"synthetic\":%s,\"ref_top8_mass\":%.4f,\"rows\":[",
               T, H, D, HQ, block, kp ? "false" : "true", e.topmass);
        for (size_t i = 0; i < nrows; i++)
            printf("%s{\"method\":\"%s\",\"k_bits\":%.4f,\"v_bits\":%.4f,\"bits\":%.4f,"
                   "\"ratio_vs_bf16\":%.3f,\"rel_err\":%.6f,\"cosine\":%.6f,\"top8_overlap\":%.4f}",
                   i ? "," : "", rows[i].name, rows[i].k_bits, rows[i].v_bits, rows[i].bits,
                   rows[i].ratio, rows[i].rel_err, rows[i].cosine, rows[i].top8);
        printf("]}\n");
    } else {
        printf("attn-eval: T=%u H=%u D=%u HQ=%u block=%u, %s data; reference top-8 attention "
               "mass %.3f\n",
               T, H, D, HQ, block, kp ? "file" : "synthetic", e.topmass);
        printf("(p = prod mode, nc = norm correction, ctr = key centering; bits/coord count "
               "every byte of the page or every scale/zero)\n");
        printf("%-26s %7s %7s %7s %7s %10s %9s %7s\n", "method", "K bits", "V bits", "bits",
               "ratio", "rel err", "cosine", "top-8");
        for (size_t i = 0; i < nrows; i++)
            printf("%-26s %7.3f %7.3f %7.3f %6.2fx %10.5f %9.6f %7.3f\n", rows[i].name,
                   rows[i].k_bits, rows[i].v_bits, rows[i].bits, rows[i].ratio, rows[i].rel_err,
                   rows[i].cosine, rows[i].top8);
    }
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

int
tqkv_cli_attn_bench(int argc, char **argv)
{
    const char *missing = NULL;
    uint32_t T = 32768, H = 8, HQ = 32, D = 128, block = 256, iters = 20;
    uint8_t kb = 7, vb = 7;
    uint64_t seed = 1;
    int rc = 1;
    uint16_t *k = NULL, *v = NULL;
    float *q = NULL, *o_f = NULL, *o_b = NULL, *o_r = NULL, *o_br = NULL;
    uint8_t *buf = NULL;
    const void **pages = NULL;
    size_t *lens = NULL, total = 0;
    double *times = NULL;
    if (is_help(argc, argv)) {
        fputs(attn_bench_usage, stdout);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--tokens")) {
            if (parse_u32(argv[++i], 1, 1u << 24, &T))
                return usage_err(attn_bench_usage, "bad --tokens '%s'", argv[i]);
        } else if (OPT_VALUE("--heads")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return usage_err(attn_bench_usage, "bad --heads '%s'", argv[i]);
        } else if (OPT_VALUE("--query-heads")) {
            if (parse_u32(argv[++i], 1, 1u << 16, &HQ))
                return usage_err(attn_bench_usage, "bad --query-heads '%s'", argv[i]);
        } else if (OPT_VALUE("--dim")) {
            if (parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return usage_err(attn_bench_usage, "bad --dim '%s'", argv[i]);
        } else if (OPT_VALUE("--key-bits")) {
            if (tqkv_bits_parse(argv[++i], &kb) != TQKV_OK)
                return usage_err(attn_bench_usage, "bad --key-bits '%s'", argv[i]);
        } else if (OPT_VALUE("--value-bits")) {
            if (tqkv_bits_parse(argv[++i], &vb) != TQKV_OK)
                return usage_err(attn_bench_usage, "bad --value-bits '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return usage_err(attn_bench_usage, "bad --block '%s'", argv[i]);
        } else if (OPT_VALUE("--iters")) {
            if (parse_u32(argv[++i], 1, 100000, &iters))
                return usage_err(attn_bench_usage, "bad --iters '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (parse_u64(argv[++i], 0, UINT64_MAX, &seed))
                return usage_err(attn_bench_usage, "bad --seed '%s'", argv[i]);
        } else if (missing) {
            break;
        } else {
            return usage_err(attn_bench_usage, "unexpected argument '%s'", argv[i]);
        }
    }
    if (missing)
        return usage_err(attn_bench_usage, "%s needs a value", missing);
    if (HQ % H != 0)
        return usage_err(attn_bench_usage, "--query-heads %u is not a multiple of --heads %u", HQ,
                         H);
    {
        size_t n = (size_t)T * H * D, cap = 0;
        uint32_t npages = (T + block - 1) / block;
        rng_t r = {seed};
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
            fail("out of memory");
            goto done;
        }
        synth_kv(&r, T, H, D, k, v);
        synth_q(&r, HQ, H, D, T, k, 1.0f, q);
        for (uint32_t p = 0; p < npages; p++) {
            tqkv_block_shape_t sh = {T - p * block < block ? T - p * block : block, H, D};
            size_t sz;
            if (tqkv_page_size(&sh, &codec, &sz) != TQKV_OK) {
                fail("unsupported shape/codec");
                goto done;
            }
            cap += sz;
        }
        buf = aligned_alloc(64, tqkv_align_up(cap, 64));
        if (!buf) {
            fail("out of memory");
            goto done;
        }
        for (uint32_t p = 0; p < npages; p++) {
            tqkv_block_shape_t sh = {T - p * block < block ? T - p * block : block, H, D};
            size_t wr, off = (size_t)p * block * H * D;
            char why[200] = "";
            if (tqkv_page_encode(&sh, &codec, k + off, v + off, buf + total, cap - total, &wr, why,
                                 sizeof why) != TQKV_OK) {
                fail("encode: %s", why);
                goto done;
            }
            pages[p] = buf + total;
            lens[p] = wr;
            total += wr;
        }
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
                fail("out of memory");
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
                    fail("attention failed");
                    goto done;
                }
                for (uint32_t it = 0; it < iters; it++) {
                    double t0 = cpu_s(), w0 = now_s();
                    (void)tqkv_attn_decode(q, HQ, pages, lens, npages, &opts, o_f);
                    times[it] = cpu_s() - t0;
                    wf += now_s() - w0;
                    t0 = cpu_s();
                    w0 = now_s();
                    (void)tqkv_attn_bf16(q, HQ, k, v, T, H, D, o_b);
                    tb_times[it] = cpu_s() - t0;
                    wb += now_s() - w0;
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
                double t0 = cpu_s();
                if (tqkv_attn_decode_ref(q, HQ, pages, lens, npages, &opts, o_r) != TQKV_OK) {
                    fail("reference failed");
                    goto done;
                }
                tr = cpu_s() - t0;
                t0 = cpu_s();
                if (tqkv_attn_bf16_ref(q, HQ, k, v, T, H, D, o_br) != TQKV_OK) {
                    fail("bf16 reference failed");
                    goto done;
                }
                tbr = cpu_s() - t0;
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
