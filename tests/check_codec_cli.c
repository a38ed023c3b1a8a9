/* check_codec_cli.c - tqkv-codec encode/decode/info/eval/bench as a user runs them:
 * round trips, exit codes and one-line errors on bad input (never a crash). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/rng.h"

#ifndef TQKV_CODEC_BIN
#error "TQKV_CODEC_BIN must name the tqkv-codec binary"
#endif

static char dir[256];

static const char *
path(const char *name)
{
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

/* Runs tqkv-codec with args; returns the exit code, stderr in err (first line). */
static int
run(char *err, size_t errlen, const char *args)
{
    char cmd[2048];
    FILE *f;
    int st;
    snprintf(cmd, sizeof cmd, "%s %s >%s 2>%s", TQKV_CODEC_BIN, args, path("stdout"),
             path("stderr"));
    st = system(cmd);
    if (err && errlen) {
        err[0] = 0;
        if ((f = fopen(path("stderr"), "r"))) {
            if (!fgets(err, (int)errlen, f))
                err[0] = 0;
            fclose(f);
        }
    }
    ck_assert_msg(WIFEXITED(st), "tqkv-codec did not exit normally: %s", cmd);
    return WEXITSTATUS(st);
}

static void
write_bf16(const char *name, const uint16_t *x, size_t n)
{
    FILE *f = fopen(path(name), "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(x, 2, n, f), n);
    fclose(f);
}

static uint8_t *
slurp(const char *name, size_t *len)
{
    FILE *f = fopen(path(name), "rb");
    uint8_t *b;
    long l;
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    l = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = malloc((size_t)l + 1);
    ck_assert_uint_eq(fread(b, 1, (size_t)l, f), (size_t)l);
    fclose(f);
    *len = (size_t)l;
    return b;
}

static void
setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/tqkv-codec-cli-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void
teardown(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

START_TEST(test_roundtrip)
{
    const uint32_t D = 96, n = 1000;
    uint16_t *x = malloc(2 * D * n);
    uint64_t rng = tqkv_test_seed();
    char err[512], args[1024];
    size_t len, olen;
    uint8_t *out;
    static const char *const bits[] = {"1", "2.5", "3", "3.5", "4"};
    for (size_t i = 0; i < (size_t)D * n; i++) {
        x[i] = tqkv_f32_to_bf16((float)tqkv_test_gauss(&rng));
    }
    write_bf16("x.bf16", x, (size_t)D * n);
    for (int b = 0; b < 5; b++)
        for (int m = 0; m < 2; m++) {
            double e = 0, s = 0;
            snprintf(args, sizeof args,
                     "encode --dim %u --bits %s --mode %s --rotation %s --tokens-per-page 77 "
                     "--seed 9 %s %s",
                     D, bits[b], m ? "prod" : "mse", b % 2 ? "dense" : "hadamard", path("x.bf16"),
                     path("x.tqp"));
            ck_assert_msg(run(err, sizeof err, args) == 0, "%s: %s", args, err);
            snprintf(args, sizeof args, "decode %s %s", path("x.tqp"), path("y.bf16"));
            ck_assert_msg(run(err, sizeof err, args) == 0, "%s", err);
            out = slurp("y.bf16", &olen);
            ck_assert_uint_eq(olen, 2ull * D * n);
            for (size_t i = 0; i < (size_t)D * n; i++) {
                uint16_t h;
                memcpy(&h, out + 2 * i, 2);
                e += pow(tqkv_bf16_to_f32(h) - tqkv_bf16_to_f32(x[i]), 2);
                s += pow(tqkv_bf16_to_f32(x[i]), 2);
            }
            /* loose: 1 bit prod (QJL only) is the worst at ~pi/2 */
            ck_assert_msg(e / s < (m ? 1.8 : 0.5), "bits %s mode %d rel err %g", bits[b], m, e / s);
            free(out);
        }
    snprintf(args, sizeof args, "info %s", path("x.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 0);
    out = slurp("stdout", &len);
    out[len] = 0;
    ck_assert_ptr_nonnull(strstr((char *)out, "pages         13"));
    ck_assert_ptr_nonnull(strstr((char *)out, "vectors       1000 x dim 96"));
    ck_assert_ptr_nonnull(strstr((char *)out, "ratio"));
    free(out);
    free(x);
}
END_TEST

START_TEST(test_bad_input)
{
    const uint32_t D = 64, n = 50;
    uint16_t x[64 * 50];
    char err[512], args[1024];
    uint8_t *page;
    size_t len;
    FILE *f;
    for (size_t i = 0; i < (size_t)D * n; i++)
        x[i] = tqkv_f32_to_bf16((float)((int)(i % 13) - 6));
    write_bf16("ok.bf16", x, (size_t)D * n);
    write_bf16("odd.bf16", x, (size_t)D * n - 1);
    x[17 * D + 5] = 0x7fc1; /* NaN */
    write_bf16("nan.bf16", x, (size_t)D * n);
    x[17 * D + 5] = 0xff80; /* -Inf */
    write_bf16("inf.bf16", x, (size_t)D * n);

    /* usage errors: exit 2 */
    ck_assert_int_eq(run(err, sizeof err, "encode"), 2);
    ck_assert_int_eq(run(err, sizeof err, "encode --dim 64 --bits 3 --mode fast a b"), 2);
    ck_assert_int_eq(run(err, sizeof err, "bogus-command"), 2);
    ck_assert_int_eq(run(err, sizeof err, "encode --help"), 0);
    ck_assert_int_eq(run(err, sizeof err, "eval --help"), 0);

    snprintf(args, sizeof args, "encode --dim 64 --bits 3 %s %s", path("odd.bf16"), path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "tqkv-codec: ") == err && strstr(err, "odd.bf16: ") &&
                      strstr(err, "multiple"),
                  "%s", err);
    ck_assert_int_eq(access(path("o.tqp"), F_OK), -1); /* no output on failure */
    snprintf(args, sizeof args, "encode --dim 64 --bits 3 %s %s", path("nan.bf16"), path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "NaN at vector 17, channel 5"), "%s", err);
    snprintf(args, sizeof args, "encode --dim 64 --bits 3 %s %s", path("inf.bf16"), path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "Inf at vector 17, channel 5"), "%s", err);
    snprintf(args, sizeof args, "encode --dim 8 --bits 3 %s %s", path("ok.bf16"), path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "ok.bf16: unsupported dimension"), "%s", err);
    snprintf(args, sizeof args, "encode --dim 64 --bits 5 %s %s", path("ok.bf16"), path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "ok.bf16: unsupported bit width"), "%s", err);
    snprintf(args, sizeof args, "encode --dim 64 --bits 3 %s %s", path("missing.bf16"),
             path("o.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);

    /* a good page file, then truncated / corrupted / foreign copies */
    snprintf(args, sizeof args, "encode --dim 64 --bits 2 --tokens-per-page 20 %s %s",
             path("ok.bf16"), path("p.tqp"));
    ck_assert_int_eq(run(err, sizeof err, args), 0);
    page = slurp("p.tqp", &len);
    f = fopen(path("trunc.tqp"), "wb");
    fwrite(page, 1, len - 70, f);
    fclose(f);
    page[len / 2] ^= 0x20;
    f = fopen(path("flip.tqp"), "wb");
    fwrite(page, 1, len, f);
    fclose(f);
    free(page);
    snprintf(args, sizeof args, "decode %s %s", path("trunc.tqp"), path("o.bf16"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "trunc.tqp: page 2") && strstr(err, "truncated"), "%s", err);
    ck_assert_int_eq(access(path("o.bf16"), F_OK), -1);
    snprintf(args, sizeof args, "decode %s %s", path("flip.tqp"), path("o.bf16"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "flip.tqp: page") && strstr(err, "CRC"), "%s", err);
    snprintf(args, sizeof args, "info %s", path("ok.bf16"));
    ck_assert_int_eq(run(err, sizeof err, args), 1);
    ck_assert_msg(strstr(err, "magic"), "%s", err);
    snprintf(args, sizeof args, "info %s", path("odd.bf16") /* not a page either */);
    ck_assert_int_eq(run(err, sizeof err, args), 1);
}
END_TEST

START_TEST(test_eval_and_bench_run)
{
    char err[512];
    size_t len;
    uint8_t *out;
    ck_assert_int_eq(run(err, sizeof err, "eval --dim 64 --n 512 --seeds 4 --json"), 0);
    out = slurp("stdout", &len);
    out[len] = 0;
    ck_assert_ptr_nonnull(strstr((char *)out, "\"d_mse\""));
    ck_assert_ptr_nonnull(strstr((char *)out, "\"prod_ip_t\""));
    free(out);
    ck_assert_int_eq(run(err, sizeof err, "bench --mb 1 --reps 1 --json"), 0);
    out = slurp("stdout", &len);
    out[len] = 0;
    ck_assert_ptr_nonnull(strstr((char *)out, "\"encode_gbps\""));
    ck_assert_ptr_nonnull(strstr((char *)out, "\"zstd1_ratio\""));
    free(out);
    ck_assert_int_eq(run(err, sizeof err, "bench --dim 100 --bits 2.5 --mb 1 --reps 1"), 0);
}
END_TEST

static Suite *
cli_suite(void)
{
    Suite *s = suite_create("codec_cli");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_roundtrip);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_eval_and_bench_run);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(cli_suite)
