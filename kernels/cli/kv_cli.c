/* kv_cli.c - tqkv-codec subcommands for KV blocks: encode-kv, decode-kv, attend, attn-eval,
 * attn-bench.
 *
 * Files are raw little-endian arrays: K and V BF16 [T][H][D], queries and outputs float32
 * [HQ][D]; a page file (.tqp) is one or more pages back to back. Usage errors exit 2, bad
 * input exits 1 with "tqkv-codec: <problem>" on stderr.
 *
 * This file holds what the subcommands share (kv_cli.h): messages, option parsing, whole
 * files, the pages of a page file and the tool's random numbers. The subcommands are in
 * kv_codec_cli.c (encode-kv, decode-kv, attend), kv_eval_cli.c (attn-eval) and
 * kv_bench_cli.c (attn-bench).
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
#include "kernels/cli/io_cli.h"
#include "kernels/cli/kv_cli.h"
#include "kernels/cli/kv_synth.h"
#include "kernels/kivi.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

/* ---- small helpers ---- */

int
tqkv__cli_fail(const char *fmt, ...)
{
    va_list ap;
    fputs("tqkv-codec: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

int
tqkv__cli_usage_err(const char *usage, const char *fmt, ...)
{
    va_list ap;
    fputs("tqkv-codec: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n%s", usage);
    return 2;
}

int
tqkv__cli_is_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}

/* Reads f to its end and closes it (they read as 'Input/output error': ftell fails on a
 * pipe). Returns new memory (64-byte aligned, free()), or NULL with errno. */
static void *
tqkv__cli_read_stream(FILE *f, size_t *len)
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
void *
tqkv__cli_read_file(const char *path, size_t *len)
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
        return tqkv__cli_read_stream(f, len); /* a pipe, FIFO or /dev/stdin: no size up front */
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

int
tqkv__cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
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

int
tqkv__cli_parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    uint64_t v;
    if (tqkv__cli_parse_u64(s, lo, hi, &v) != 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int
tqkv__cli_parse_mode(const char *s, uint8_t *mode)
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
double
tqkv__cli_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- pages in a file ---- */

void
tqkv__page_list_free(tqkv__page_list_t *pl)
{
    free(pl->pages);
    free(pl->lens);
    memset(pl, 0, sizeof *pl);
}

/* Splits buf[0..len) into validated pages; appends to pl. Returns 0 or prints and -1. */
int
tqkv__page_list_add(tqkv__page_list_t *pl, const char *path, const uint8_t *buf, size_t len,
                    int check_crc)
{
    size_t off = 0;
    if (len == 0) {
        tqkv__cli_fail("%s: empty page file", path);
        return -1;
    }
    while (off < len) {
        tqkv_page_info_t info;
        char why[160] = "";
        tqkv_status_t st =
            tqkv_page_validate(buf + off, len - off, check_crc, &info, why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("%s: page at byte %zu: %s", path, off, why[0] ? why : tqkv_strerror(st));
            return -1;
        }
        if (pl->n == pl->cap) {
            size_t cap = pl->cap ? 2 * pl->cap : 16;
            const void **p = realloc(pl->pages, sizeof(void *) * cap);
            size_t *l = p ? realloc(pl->lens, sizeof(size_t) * cap) : NULL;
            if (!p || !l) {
                if (p)
                    pl->pages = p;
                tqkv__cli_fail("out of memory");
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

/* ---- synthetic KV and queries (attn-eval, attn-bench) ---- */

double
tqkv__cli_rng_u01(tqkv__cli_rng_t *r)
{
    return (double)(tqkv_splitmix64(&r->s) >> 11) * (1.0 / 9007199254740992.0);
}

double
tqkv__cli_rng_normal(tqkv__cli_rng_t *r)
{
    double u = tqkv__cli_rng_u01(r), v = tqkv__cli_rng_u01(r);
    if (u < 1e-300)
        u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static double
rng_unif_cb(void *r)
{
    return tqkv__cli_rng_u01(r);
}

static double
rng_normal_cb(void *r)
{
    return tqkv__cli_rng_normal(r);
}

/* The synthetic data of kv_synth.h, drawn from the tool's generator. */
void
tqkv__cli_synth_kv(tqkv__cli_rng_t *r, uint32_t T, uint32_t H, uint32_t D, uint16_t *k, uint16_t *v)
{
    tqkv_synth_rng_t sr = {rng_unif_cb, rng_normal_cb, r};
    tqkv_synth_kv(&sr, T, H, D, k, v);
}

void
tqkv__cli_synth_q(tqkv__cli_rng_t *r, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                  const uint16_t *k, float peak, float *q)
{
    tqkv_synth_rng_t sr = {rng_unif_cb, rng_normal_cb, r};
    tqkv_synth_q(&sr, HQ, H, D, T, k, peak, q);
}
