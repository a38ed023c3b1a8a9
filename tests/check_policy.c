/* check_policy.c - KV codec policy: defaults, checks, boundary layers, bit-width parsing. */
#include <check.h>
#include <math.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/policy.h"
#include "tests/check_main.h"

START_TEST(test_defaults_valid)
{
    tqkv_policy_t p;
    char err[160];
    size_t sz;
    tqkv_block_shape_t sh = {256, 8, 128};
    tqkv_block_codec_t bc;
    tqkv_policy_default(&p);
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_OK);
    ck_assert_str_eq(err, "");
    /* keys get at least as many bits as values; boundary layers at least the middle */
    ck_assert_uint_ge(p.k.bits_x2, p.v.bits_x2);
    ck_assert_uint_ge(p.k_boundary.bits_x2, p.k.bits_x2);
    ck_assert_uint_ge(p.v_boundary.bits_x2, p.v.bits_x2);
    ck_assert_uint_eq(p.boundary_layers, 2);
    ck_assert_uint_eq(p.rotation, TQKV_ROT_HADAMARD);
    ck_assert_uint_eq(p.k.mode, TQKV_MODE_MSE);
    /* the middle-layer page of a Llama-style block compresses ~4.8x vs BF16 */
    tqkv_policy_block_codec(&p, 10, 32, &bc);
    ck_assert_int_eq(tqkv_page_check_params(&sh, &bc, err, sizeof err), TQKV_OK);
    ck_assert_int_eq(tqkv_page_size(&sh, &bc, &sz), TQKV_OK);
    ck_assert_msg((double)(2 * 2 * 256 * 8 * 128) / (double)sz >= 4.6, "ratio %.2f",
                  (double)(2 * 2 * 256 * 8 * 128) / (double)sz);
}
END_TEST

START_TEST(test_boundary_layers)
{
    tqkv_policy_t p;
    tqkv_block_codec_t c;
    uint32_t seed = (uint32_t)tqkv_test_seed();
    tqkv_policy_default(&p);
    p.k = (tqkv_tensor_codec_t){5, TQKV_MODE_MSE, 0};
    p.v = (tqkv_tensor_codec_t){4, TQKV_MODE_PROD, 1};
    p.k_boundary = (tqkv_tensor_codec_t){8, TQKV_MODE_MSE, 1};
    p.v_boundary = (tqkv_tensor_codec_t){7, TQKV_MODE_MSE, 0};
    p.boundary_layers = 2 + seed % 3;
    p.seed = seed;
    for (uint32_t L = 0; L < 40; L++) {
        int want = L < p.boundary_layers || L + p.boundary_layers >= 40;
        tqkv_policy_block_codec(&p, L, 40, &c);
        ck_assert_uint_eq(c.k.bits_x2, want ? 8 : 5);
        ck_assert_uint_eq(c.v.bits_x2, want ? 7 : 4);
        ck_assert_uint_eq(c.v.mode, want ? TQKV_MODE_MSE : TQKV_MODE_PROD);
        ck_assert_uint_eq(c.k.norm_correction, want ? 1 : 0);
        ck_assert_uint_eq(c.seed, seed);
        ck_assert_uint_eq(c.rotation, p.rotation);
        /* unknown depth: only the first N layers are boundary layers */
        tqkv_policy_block_codec(&p, L, 0, &c);
        ck_assert_uint_eq(c.k.bits_x2, L < p.boundary_layers ? 8 : 5);
    }
    p.boundary_layers = 0;
    tqkv_policy_block_codec(&p, 0, 40, &c);
    ck_assert_uint_eq(c.k.bits_x2, 5);
    tqkv_policy_block_codec(&p, 39, 40, &c);
    ck_assert_uint_eq(c.k.bits_x2, 5);
    /* more boundary layers than the model has: every layer is a boundary layer */
    p.boundary_layers = 50;
    tqkv_policy_block_codec(&p, 20, 40, &c);
    ck_assert_uint_eq(c.k.bits_x2, 8);
}
END_TEST

START_TEST(test_check_rejects)
{
    tqkv_policy_t p;
    char err[160];
    tqkv_policy_default(&p);
    p.k.bits_x2 = 9;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "key"));
    tqkv_policy_default(&p);
    p.v.bits_x2 = 0;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "value"));
    tqkv_policy_default(&p);
    p.k.mode = 3; /* 2 is lossless (TQKV_MODE_RAW) */
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    tqkv_policy_default(&p);
    p.v_boundary.mode = TQKV_MODE_PROD;
    p.v_boundary.bits_x2 = 3; /* 1.5 bits: a 1-bit group cannot hold prod */
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "boundary value"));
    p.v_boundary.bits_x2 = 5; /* 2.5 bits prod: 3 + 2 bit groups, fine */
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_OK);
    tqkv_policy_default(&p);
    p.rotation = 7;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    tqkv_policy_default(&p);
    p.key_centering = 2;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    tqkv_policy_default(&p);
    p.k.norm_correction = 3;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    tqkv_policy_default(&p);
    p.boundary_layers = 100000;
    ck_assert_int_eq(tqkv_policy_check(&p, err, sizeof err), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_policy_check(NULL, NULL, 0), TQKV_EINVAL);
}
END_TEST

START_TEST(test_bits_parse)
{
    static const char *ok[] = {"1", "1.5", "2", "2.5", "3", "3.5", "4"};
    static const char *bad[] = {"0", "0.5", "4.5", "5", "", "3.25", "abc", "3.5x", " 3", "-2"};
    uint8_t b = 0;
    for (unsigned i = 0; i < 7; i++) {
        ck_assert_int_eq(tqkv_bits_parse(ok[i], &b), TQKV_OK);
        ck_assert_uint_eq(b, i + 2);
        ck_assert_int_eq(tqkv_bits_from_float(1.0f + 0.5f * (float)i, &b), TQKV_OK);
        ck_assert_uint_eq(b, i + 2);
    }
    for (unsigned i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg(tqkv_bits_parse(bad[i], &b) == TQKV_EINVAL, "'%s' accepted", bad[i]);
    ck_assert_int_eq(tqkv_bits_parse(NULL, &b), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_bits_from_float(3.25f, &b), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_bits_from_float(0.5f, &b), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_bits_from_float(4.5f, &b), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_bits_from_float(NAN, &b), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_bits_from_float(INFINITY, &b), TQKV_EINVAL);
}
END_TEST

static Suite *
policy_suite(void)
{
    Suite *s = suite_create("policy");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_defaults_valid);
    tcase_add_test(tc, test_boundary_layers);
    tcase_add_test(tc, test_check_rejects);
    tcase_add_test(tc, test_bits_parse);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(policy_suite)
