/* kv_cli.h - what the KV subcommands of tqkv-codec share (kv_cli.c; tqkv__cli_, not API):
 * messages, option parsing, whole files, the pages of a page file, the tool's random
 * numbers and synthetic KV. Used by kv_cli.c, kv_codec_cli.c, kv_eval_cli.c and
 * kv_bench_cli.c only.
 */
#ifndef TQKV_KERNELS_CLI_KV_CLI_H
#define TQKV_KERNELS_CLI_KV_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The subcommands (tqkv_codec_main.c dispatches): exit status 0, 1 bad input, 2 usage. */
int tqkv_cli_encode_kv(int argc, char **argv);
int tqkv_cli_decode_kv(int argc, char **argv);
int tqkv_cli_attend(int argc, char **argv);
int tqkv_cli_attn_eval(int argc, char **argv);
int tqkv_cli_attn_bench(int argc, char **argv);

/* "tqkv-codec: <message>" on stderr; returns 1 (bad input). */
int tqkv__cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "tqkv-codec: <message>" and the usage text on stderr; returns 2 (usage error). */
int tqkv__cli_usage_err(const char *usage, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* 1 when an argument is --help or -h. */
int tqkv__cli_is_help(int argc, char **argv);
/* Reads a whole file; returns new memory (64-byte aligned, free()), or NULL with errno.
 * (Writing: tqkv__cli_write_file of io_cli.h.) */
void *tqkv__cli_read_file(const char *path, size_t *len);
/* Decimal in [lo, hi]: 0, or -1 when s is not one. */
int tqkv__cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
int tqkv__cli_parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out);
/* "mse", "prod" or "lossless" into a TQKV_MODE_*: 0, or -1. */
int tqkv__cli_parse_mode(const char *s, uint8_t *mode);
/* Seconds of this thread's CPU time (wall time: tqkv_clock_s of kernels/clock.h). */
double tqkv__cli_cpu_s(void);

/* The validated pages of page files (borrowed from the caller's buffers). */
typedef struct page_list {
    size_t n, cap;
    const void **pages;
    size_t *lens;
    uint64_t tokens;
} tqkv__page_list_t;
void tqkv__page_list_free(tqkv__page_list_t *pl);
/* Splits buf[0..len) into validated pages; appends to pl. Returns 0 or prints and -1. */
int tqkv__page_list_add(tqkv__page_list_t *pl, const char *path, const uint8_t *buf, size_t len,
                        int check_crc);

/* The tool's random numbers (splitmix64) and the synthetic KV and queries of kv_synth.h
 * drawn from them. */
typedef struct rng {
    uint64_t s;
} tqkv__cli_rng_t;
double tqkv__cli_rng_u01(tqkv__cli_rng_t *r);
double tqkv__cli_rng_normal(tqkv__cli_rng_t *r);
void tqkv__cli_synth_kv(tqkv__cli_rng_t *r, uint32_t T, uint32_t H, uint32_t D, uint16_t *k,
                        uint16_t *v);
void tqkv__cli_synth_q(tqkv__cli_rng_t *r, uint32_t HQ, uint32_t H, uint32_t D, uint32_t T,
                       const uint16_t *k, float peak, float *q);

/* Option lookup: argv[i] is "--name"; takes the next argument as its value. */
#define OPT_VALUE(name) (!strcmp(argv[i], name) && (i + 1 < argc ? 1 : (missing = name, 0)))

#endif
