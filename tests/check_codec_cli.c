/* check_codec_cli.c - tqkv-codec encode/decode/info/eval/bench as a user runs them:
 * round trips, exit codes and one-line errors on bad input (never a crash), and defaults
 * that are the server's default policy (kernels/policy.c), flags turning them off. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/page.h"
#include "kernels/policy.h"
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

/* Pages of K, V [T][H][D] under codec c, blocks of `block` tokens concatenated (as
 * encode-kv writes them; V NULL: keys only, as encode writes them with H = 1). */
static uint8_t *
encode_pages(const tqkv_block_codec_t *c, const uint16_t *k, const uint16_t *v, uint32_t T,
             uint32_t H, uint32_t D, uint32_t block, size_t *len)
{
    size_t total = 0, cap = 0;
    uint8_t *out = NULL;
    for (uint32_t t = 0; t < T; t += block) {
        tqkv_block_shape_t sh = {T - t < block ? T - t : block, H, D};
        size_t sz, wr;
        char why[200] = "";
        ck_assert_int_eq(tqkv_page_size(&sh, c, &sz), TQKV_OK);
        if (total + sz > cap) {
            cap = 2 * (total + sz);
            out = realloc(out, cap);
            ck_assert_ptr_nonnull(out);
        }
        ck_assert_msg(tqkv_page_encode(&sh, c, k + (size_t)t * H * D,
                                       v ? v + (size_t)t * H * D : NULL, out + total, cap - total,
                                       &wr, why, sizeof why) == TQKV_OK,
                      "%s", why);
        total += wr;
    }
    *len = total;
    return out;
}

static void
assert_file_is(const char *name, const uint8_t *want, size_t want_len, const char *what)
{
    size_t len;
    uint8_t *got = slurp(name, &len);
    ck_assert_msg(len == want_len && !memcmp(got, want, len), "%s: %zu bytes, expected %zu%s", what,
                  len, want_len, len == want_len ? " (bytes differ)" : "");
    free(got);
}

/* encode-kv and encode without codec flags write the pages of the server's default policy
 * for a middle layer (norm correction and key centering on); --no-norm-correction and
 * --no-key-centering turn those off. */
START_TEST(test_defaults_are_the_server_policy)
{
    const uint32_t T = 300, H = 2, D = 64;
    const size_t n = (size_t)T * H * D;
    uint16_t *k = malloc(2 * n), *v = malloc(2 * n);
    uint64_t rng = tqkv_test_seed();
    tqkv_policy_t pol;
    tqkv_block_codec_t c, mid;
    char err[512], args[1024];
    uint8_t *want, *plain;
    size_t want_len, plain_len;
    for (size_t i = 0; i < n; i++) {
        /* keys with per-channel offsets and a few outlier channels: centering matters */
        double u = ((tqkv_splitmix64(&rng) >> 11) + 0.5) / 9007199254740992.0;
        double w = ((tqkv_splitmix64(&rng) >> 11) + 0.5) / 9007199254740992.0;
        double g = sqrt(-2 * log(u)) * cos(2 * M_PI * w);
        uint32_t ch = (uint32_t)(i % D);
        k[i] = tqkv_f32_to_bf16((float)(g * (ch % 16 == 3 ? 8.0 : 1.0) + 0.25 * (ch % 7)));
        v[i] = tqkv_f32_to_bf16((float)(g * 0.5 + 0.1));
    }
    write_bf16("k.bf16", k, n);
    write_bf16("v.bf16", v, n);

    /* the default codec is the policy's middle layer, which has both on */
    tqkv_policy_default(&pol);
    tqkv_policy_default_codec(&c);
    tqkv_policy_block_codec(&pol, 10, 32, &mid);
    ck_assert_int_eq(memcmp(&c, &mid, sizeof c), 0);
    ck_assert_uint_eq(c.k.norm_correction, 1);
    ck_assert_uint_eq(c.v.norm_correction, 1);
    ck_assert_uint_eq(c.key_centering, 1);

    want = encode_pages(&c, k, v, T, H, D, 128, &want_len);
    snprintf(args, sizeof args, "encode-kv --tokens %u --heads %u --dim %u --block 128 %s %s %s", T,
             H, D, path("k.bf16"), path("v.bf16"), path("d.tqp"));
    ck_assert_msg(run(err, sizeof err, args) == 0, "%s: %s", args, err);
    assert_file_is("d.tqp", want, want_len, "encode-kv defaults");
    c.k.norm_correction = c.v.norm_correction = 0;
    c.key_centering = 0;
    plain = encode_pages(&c, k, v, T, H, D, 128, &plain_len);
    ck_assert_msg(plain_len != want_len || memcmp(plain, want, want_len), "flags change nothing");
    snprintf(args, sizeof args,
             "encode-kv --tokens %u --heads %u --dim %u --block 128 --no-norm-correction "
             "--no-key-centering %s %s %s",
             T, H, D, path("k.bf16"), path("v.bf16"), path("p.tqp"));
    ck_assert_msg(run(err, sizeof err, args) == 0, "%s: %s", args, err);
    assert_file_is("p.tqp", plain, plain_len, "encode-kv --no-norm-correction --no-key-centering");
    free(want);
    free(plain);

    /* encode: the keys as [T*H][D] vectors, pages of 256, keys only */
    tqkv_policy_default_codec(&c);
    memset(&c.v, 0, sizeof c.v);
    want = encode_pages(&c, k, NULL, T * H, 1, D, 256, &want_len);
    snprintf(args, sizeof args, "encode --dim %u %s %s", D, path("k.bf16"), path("e.tqp"));
    ck_assert_msg(run(err, sizeof err, args) == 0, "%s: %s", args, err);
    assert_file_is("e.tqp", want, want_len, "encode defaults");
    free(want);
    c.k.norm_correction = 0;
    c.key_centering = 0;
    want = encode_pages(&c, k, NULL, T * H, 1, D, 256, &want_len);
    snprintf(args, sizeof args, "encode --dim %u --no-norm-correction --no-key-centering %s %s", D,
             path("k.bf16"), path("e.tqp"));
    ck_assert_msg(run(err, sizeof err, args) == 0, "%s: %s", args, err);
    assert_file_is("e.tqp", want, want_len, "encode --no-norm-correction --no-key-centering");
    free(want);
    free(k);
    free(v);
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
    tcase_add_test(tc, test_defaults_are_the_server_policy);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(cli_suite)
