/* check_codec_codebook.c - Lloyd-Max codebooks against the published tables. */
#include <check.h>
#include <math.h>
#include <pthread.h>

#include "kernels/codebook.h"
#include "tests/check_main.h"

/* reference/turboquant.md section 2: exact Beta marginal, positive halves, z domain */
static const struct {
    uint32_t d, b;
    double z[8];
    double d_mse;
} table[] = {
    {64, 1, {.8010}, .3584},
    {64, 2, {.4521, 1.5000}, .1145},
    {64, 3, {.2438, .7507, 1.3293, 2.1113}, .03339},
    {64, 4, {.1274, .3847, .6505, .9319, 1.2394, 1.5908, 2.0233, 2.6464}, .00913},
    {128, 1, {.7994}, .3609},
    {128, 2, {.4525, 1.5052}, .1160},
    {128, 3, {.2444, .7533, 1.3366, 2.1315}, .03397},
    {128, 4, {.1279, .3864, .6536, .9371, 1.2478, 1.6043, 2.0459, 2.6889}, .00932},
    {256, 1, {.7987}, .3621},
    {256, 2, {.4526, 1.5078}, .1167},
    {256, 3, {.2448, .7547, 1.3402, 2.1417}, .03426},
    {256, 4, {.1281, .3872, .6552, .9397, 1.2520, 1.6112, 2.0574, 2.7106}, .00941},
};

START_TEST(test_tables)
{
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        const tqkv_codebook_t *cb;
        uint32_t n = 1u << table[i].b;
        ck_assert_int_eq(tqkv_codebook_get(table[i].d, table[i].b, &cb), TQKV_OK);
        ck_assert_uint_eq(cb->n, n);
        ck_assert_uint_eq(cb->dim, table[i].d);
        for (uint32_t k = 0; k < n / 2; k++) {
            ck_assert_msg(fabs(cb->z[n / 2 + k] - table[i].z[k]) < 1e-3,
                          "d=%u b=%u z[%u]=%.5f want %.4f", table[i].d, table[i].b, k,
                          cb->z[n / 2 + k], table[i].z[k]);
            ck_assert_float_eq(cb->z[n / 2 - 1 - k], -cb->z[n / 2 + k]);
        }
        /* the table's D_mse is rounded to 3-4 significant digits */
        ck_assert_msg(fabs(cb->d_mse - table[i].d_mse) / table[i].d_mse < 1.5e-3,
                      "d=%u b=%u d_mse %.6f want %.5f", table[i].d, table[i].b, cb->d_mse,
                      table[i].d_mse);
    }
}
END_TEST

START_TEST(test_thresholds_and_bounds)
{
    static const uint32_t dims[] = {2, 3, 4, 5, 16, 31, 96, 100, 127, 129, 512, 1000, 1024};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        for (uint32_t b = 1; b <= 4; b++) {
            const tqkv_codebook_t *cb;
            double lower = pow(4.0, -(double)b), upper = sqrt(3.0) * M_PI / 2 * lower;
            ck_assert_int_eq(tqkv_codebook_get(dims[i], b, &cb), TQKV_OK);
            for (uint32_t k = 0; k + 1 < cb->n; k++) {
                ck_assert(cb->z[k] < cb->z[k + 1]);
                ck_assert(fabsf(cb->thr[k] - 0.5f * (cb->z[k] + cb->z[k + 1])) <
                          1e-6f * (1 + fabsf(cb->thr[k])));
            }
            for (uint32_t k = cb->n; k < 16; k++)
                ck_assert(cb->z[k] == 0.0f);
            /* centroids inside the support [-sqrt(g), sqrt(g)] */
            ck_assert(cb->z[cb->n - 1] < sqrtf((float)dims[i]));
            /* Panter-Dite upper bound (large d) and Shannon lower bound; small d has a
             * more concentrated-at-the-edges density, so only the upper bound applies */
            ck_assert_msg(cb->d_mse < upper, "d=%u b=%u d_mse %g", dims[i], b, cb->d_mse);
            if (dims[i] >= 16)
                ck_assert_msg(cb->d_mse > lower, "d=%u b=%u d_mse %g", dims[i], b, cb->d_mse);
        }
    /* d = 3: the coordinate is uniform on [-1, 1]; Lloyd-Max = uniform quantizer,
     * D_mse = 3 * (2/n)^2 / 12 = 4^-b */
    for (uint32_t b = 1; b <= 4; b++) {
        const tqkv_codebook_t *cb;
        ck_assert_int_eq(tqkv_codebook_get(3, b, &cb), TQKV_OK);
        ck_assert(fabs(cb->d_mse - pow(4.0, -(double)b)) < 1e-9);
        ck_assert(fabsf(cb->z[cb->n - 1] - sqrtf(3.0f) * (1.0f - 1.0f / cb->n)) < 1e-5f);
    }
}
END_TEST

START_TEST(test_unsupported)
{
    const tqkv_codebook_t *cb = NULL;
    ck_assert_int_eq(tqkv_codebook_get(1, 2, &cb), TQKV_EUNSUPPORTED);
    ck_assert_int_eq(tqkv_codebook_get(1025, 2, &cb), TQKV_EUNSUPPORTED);
    ck_assert_int_eq(tqkv_codebook_get(128, 0, &cb), TQKV_EUNSUPPORTED);
    ck_assert_int_eq(tqkv_codebook_get(128, 5, &cb), TQKV_EUNSUPPORTED);
    ck_assert_ptr_null(cb);
}
END_TEST

static void *
getter(void *arg)
{
    const tqkv_codebook_t **out = arg;
    for (uint32_t d = 200; d < 232; d++)
        if (tqkv_codebook_get(d, 3, &out[d - 200]) != TQKV_OK)
            out[d - 200] = NULL;
    return NULL;
}

START_TEST(test_threads_share_one_copy)
{
    const tqkv_codebook_t *res[4][32];
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, getter, res[i]), 0);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int k = 0; k < 32; k++) {
        ck_assert_ptr_nonnull(res[0][k]);
        for (int i = 1; i < 4; i++)
            ck_assert_ptr_eq(res[i][k], res[0][k]);
    }
}
END_TEST

static Suite *
codebook_suite(void)
{
    Suite *s = suite_create("codebook");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_tables);
    tcase_add_test(tc, test_thresholds_and_bounds);
    tcase_add_test(tc, test_unsupported);
    tcase_add_test(tc, test_threads_share_one_copy);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(codebook_suite)
