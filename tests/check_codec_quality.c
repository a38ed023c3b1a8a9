/* check_codec_quality.c - distortion and inner-product bias against theory.
 *
 * D_mse = E ||x - x_hat||^2 / ||x||^2 measured over many vectors and rotation seeds must
 * match the codebook's theoretical value (reference/turboquant.md section 2): within
 * 2% on random inputs, 10% on structured ones. TurboQuant_prod must be unbiased for
 * inner products (a t-test that is shown to reject mse), and mse at 1 bit must shrink
 * inner products by 2/pi. Under TQKV_SANITIZED=1 there are 8x fewer vectors and the
 * bounds widen by sqrt(8).
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "tests/check_main.h"
#include "tests/support/kv_data.h"
#include "tests/support/rng.h"
#include "tests/support/sanitize.h"

static uint64_t rng;

static int
scale_n(int n)
{
    return tqkv_test_sanitized() ? n / 8 : n;
}

static double
tol(double t)
{
    return tqkv_test_sanitized() ? t * sqrt(8.0) : t;
}

enum {
    DATA_RANDOM,
    DATA_SPARSE,
    DATA_CONSTANT,
    DATA_SPIKE, /* one-hot-like: one channel plus 5% noise */
    DATA_LOWRANK,
    DATA_OUTLIER,
    DATA_ONEHOT, /* exactly one-hot */
};
static const char *const data_name[] = {"random",  "sparse",  "constant", "spike",
                                        "lowrank", "outlier", "onehot"};

/* Fills T vectors of dim D of one kind (a page's worth). */
static void
fill(int kind, uint32_t T, uint32_t D, float *x)
{
    double basis[2][1024], cst = tqkv_test_gauss(&rng) > 0 ? 1 : -1;
    for (uint32_t j = 0; j < D; j++) {
        basis[0][j] = tqkv_test_gauss(&rng);
        basis[1][j] = tqkv_test_gauss(&rng);
    }
    for (uint32_t t = 0; t < T; t++) {
        float *v = x + (size_t)t * D;
        double a = exp(tqkv_test_gauss(&rng)), c0 = tqkv_test_gauss(&rng),
               c1 = tqkv_test_gauss(&rng);
        for (uint32_t j = 0; j < D; j++) {
            switch (kind) {
            case DATA_RANDOM:
                v[j] = (float)tqkv_test_gauss(&rng);
                break;
            case DATA_SPARSE:
                v[j] = 0;
                break;
            case DATA_CONSTANT:
                v[j] = (float)(a * cst);
                break;
            case DATA_ONEHOT:
                v[j] = 0;
                break;
            case DATA_SPIKE:
                v[j] = (float)(0.05 * a * tqkv_test_gauss(&rng));
                break;
            case DATA_LOWRANK:
                v[j] = (float)(c0 * basis[0][j] + c1 * basis[1][j]);
                break;
            default: /* outlier channels: 4 channels 30x the rest */
                v[j] = (float)(tqkv_test_gauss(&rng) * (j % 37 == 5 ? 30 : 1));
            }
        }
        if (kind == DATA_SPARSE)
            for (int k = 0; k < 4; k++)
                v[tqkv_splitmix64(&rng) % D] = (float)tqkv_test_gauss(&rng);
        if (kind == DATA_ONEHOT || kind == DATA_SPIKE)
            v[tqkv_splitmix64(&rng) % D] = (float)(a * cst);
    }
}

/* Encodes `pages` pages of T vectors (H = 1) and returns the mean relative squared
 * error; optionally the inner-product statistics against y = x/||x|| + g/2. */
typedef struct ip_stats {
    double n, mean, m2;     /* page means of <y, x_hat> - <y, x>: count, mean, sum of sq. dev. */
    double sxy_hat, sxy_sq; /* slope of <y, x_hat> on <y, x> through 0 */
} ip_stats_t;

static double
measure(int kind, uint32_t D, uint32_t bits, int mode, int rot, uint32_t T, uint32_t pages,
        ip_stats_t *ip)
{
    tqkv_block_shape_t s = {T, 1, D};
    tqkv_block_codec_t c = {0};
    size_t n = (size_t)T * D, sz;
    float *x = malloc(n * 4), *xh = malloc(n * 4), *y = malloc(D * 4);
    uint16_t *xb = malloc(n * 2);
    void *page;
    double sum = 0;
    char err[200];
    c.k.bits_x2 = (uint8_t)(2 * bits);
    c.k.mode = (uint8_t)mode;
    c.rotation = (uint8_t)rot;
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    page = malloc(sz);
    for (uint32_t p = 0; p < pages; p++) {
        c.seed = tqkv_splitmix64(&rng);
        fill(kind, T, D, x);
        for (size_t i = 0; i < n; i++)
            xb[i] = tqkv_f32_to_bf16(x[i]);
        ck_assert_msg(tqkv_page_encode(&s, &c, xb, NULL, page, sz, NULL, err, sizeof err) ==
                          TQKV_OK,
                      "%s", err);
        ck_assert_int_eq(tqkv_page_decode_f32(page, sz, xh, NULL), TQKV_OK);
        double page_d = 0;
        for (uint32_t t = 0; t < T; t++) {
            double e = 0, nn = 0, yx = 0, yxh = 0, nx;
            const uint16_t *xv = xb + (size_t)t * D;
            const float *hv = xh + (size_t)t * D;
            for (uint32_t j = 0; j < D; j++) {
                double a = tqkv_bf16_to_f32(xv[j]);
                e += (a - hv[j]) * (a - hv[j]);
                nn += a * a;
            }
            sum += e / nn;
            if (!ip)
                continue;
            nx = sqrt(nn);
            for (uint32_t j = 0; j < D; j++) {
                double a = tqkv_bf16_to_f32(xv[j]) / nx;
                y[j] = (float)(a + 0.5 * tqkv_test_gauss(&rng) / sqrt((double)D));
                yx += y[j] * a;
                yxh += y[j] * hv[j] / nx;
            }
            page_d += yxh - yx;
            ip->sxy_hat += yxh * yx;
            ip->sxy_sq += yx * yx;
        }
        if (ip) {
            /* vectors of one page share Pi and S, so their errors are correlated: the
             * t-test runs over independent page means */
            double d = page_d / T, delta = d - ip->mean;
            ip->n += 1;
            ip->mean += delta / ip->n;
            ip->m2 += delta * (d - ip->mean);
        }
    }
    free(x);
    free(xh);
    free(y);
    free(xb);
    free(page);
    return sum / ((double)T * pages);
}

static void
check_dmse(int kind, uint32_t D, int rot, uint32_t T, uint32_t pages, double bound)
{
    for (uint32_t b = 1; b <= 4; b++) {
        const tqkv_codebook_t *cb;
        double m, r;
        ck_assert_int_eq(tqkv_codebook_get(D, b, &cb), TQKV_OK);
        m = measure(kind, D, b, TQKV_MODE_MSE, rot, T, pages, NULL);
        r = m / cb->d_mse - 1;
        fprintf(stderr, "  d=%-4u %-8s %-8s b=%u  D_mse %.5f theory %.5f  (%+.2f%%)\n", D,
                data_name[kind], rot ? "hadamard" : "dense", b, m, cb->d_mse, 100 * r);
        ck_assert_msg(fabs(r) < bound, "d=%u %s rot=%d b=%u: D_mse %.5f vs %.5f (%+.2f%%)", D,
                      data_name[kind], rot, b, m, cb->d_mse, 100 * r);
    }
}

START_TEST(test_dmse_random_d128)
{
    rng = tqkv_test_seed();
    check_dmse(DATA_RANDOM, 128, TQKV_ROT_HADAMARD, 1000, (uint32_t)scale_n(20), tol(0.02));
    check_dmse(DATA_RANDOM, 128, TQKV_ROT_DENSE, 1000, (uint32_t)scale_n(16), tol(0.02));
}
END_TEST

START_TEST(test_dmse_random_d64_d256)
{
    rng = tqkv_test_seed() + 1;
    check_dmse(DATA_RANDOM, 64, TQKV_ROT_HADAMARD, 1000, (uint32_t)scale_n(16), tol(0.02));
    check_dmse(DATA_RANDOM, 64, TQKV_ROT_DENSE, 1000, (uint32_t)scale_n(16), tol(0.02));
    check_dmse(DATA_RANDOM, 256, TQKV_ROT_HADAMARD, 500, (uint32_t)scale_n(16), tol(0.02));
    check_dmse(DATA_RANDOM, 256, TQKV_ROT_DENSE, 500, (uint32_t)scale_n(12), tol(0.02));
}
END_TEST

START_TEST(test_dmse_structured)
{
    rng = tqkv_test_seed() + 2;
    for (int kind = DATA_SPARSE; kind <= DATA_OUTLIER; kind++) {
        check_dmse(kind, 128, TQKV_ROT_HADAMARD, 32, (uint32_t)scale_n(128), tol(0.10));
        /* 128 independent rotations: the per-vector D_mse of one fixed input varies by
         * ~25% across rotations at 4 bits, so fewer pages leave 10% at ~3 sigma */
        check_dmse(kind, 128, TQKV_ROT_DENSE, 32, (uint32_t)scale_n(128), tol(0.10));
    }
    /* and at the other head dims, hadamard (the default). d = 64 spikes are near one-hot
     * (see test_dmse_onehot): over 128 pages the 4-bit excess had a mean of +1.3%, a spread
     * of ~2.5% and a tail (+7.2%, and +10.02% once in CI), so 512 pages halve the spread */
    check_dmse(DATA_SPIKE, 64, TQKV_ROT_HADAMARD, 32, (uint32_t)scale_n(512), tol(0.10));
    check_dmse(DATA_CONSTANT, 256, TQKV_ROT_HADAMARD, 32, (uint32_t)scale_n(128), tol(0.10));
}
END_TEST

/* Exactly one-hot inputs: the dense (Haar) rotation meets the 10% bound. The
 * H D2 H D1 rotation maps e_k to H r / g with r a random sign vector, whose z-domain
 * coordinates lie on a lattice of step 2/sqrt(g); at d = 64 the lattice is coarse
 * enough to move D_mse by ~40% at 4 bits (d = 128: ~7%; PAGE_FORMAT.md). Measured here
 * so a change to the rotation shows up. The excess is a bias plus a wide spread between
 * rotations (every page has its own): over 58 seeds at 64 pages, d = 64 b = 4 measured
 * mean +41.2%, sd 6.1%, max +57.7% (and +65.0% once in CI, seed 4767804040607313073),
 * d = 128 b = 4 mean +6.9%, sd 4.3%, max +17.6% against the 25% bound. 256 pages halve
 * the spread: over 60 seeds (docs/testing.md, "Statistical bounds") d = 64 b = 4
 * measured mean +41.4%, sd 2.7%, max +48.4% (b = 3: +22.9%, sd 5.1%, max +34.6%), d = 128
 * b = 4 mean +7.6%, sd 2.0%, max +11.4%: the bounds sit 7 sd or more above the means. */
START_TEST(test_dmse_onehot)
{
    rng = tqkv_test_seed() + 5;
    check_dmse(DATA_ONEHOT, 128, TQKV_ROT_DENSE, 32, (uint32_t)scale_n(48), tol(0.10));
    check_dmse(DATA_ONEHOT, 64, TQKV_ROT_DENSE, 32, (uint32_t)scale_n(48), tol(0.10));
    check_dmse(DATA_ONEHOT, 128, TQKV_ROT_HADAMARD, 32, (uint32_t)scale_n(256), tol(0.25));
    check_dmse(DATA_ONEHOT, 64, TQKV_ROT_HADAMARD, 32, (uint32_t)scale_n(256), tol(0.60));
}
END_TEST

START_TEST(test_prod_unbiased)
{
    rng = tqkv_test_seed() + 3;
    for (int rot = 0; rot < 2; rot++)
        for (uint32_t b = 1; b <= 3; b++) {
            ip_stats_t ip = {0}, im = {0};
            double t, tm, slope;
            (void)measure(DATA_RANDOM, 128, b, TQKV_MODE_PROD, rot, 32, (uint32_t)scale_n(384),
                          &ip);
            t = ip.mean / sqrt(ip.m2 / (ip.n - 1) / ip.n);
            slope = ip.sxy_hat / ip.sxy_sq;
            fprintf(stderr,
                    "  prod b=%u %-8s: bias %+.5f (t = %+.2f over %.0f pages), slope %.4f\n", b,
                    rot ? "hadamard" : "dense", ip.mean, t, ip.n, slope);
            /* t over 383 degrees of freedom is ~N(0, 1) when unbiased: |t| < 5 fails one
             * seed in ~3e5 over these 6 checks (|t| < 4 was one in ~2600) */
            ck_assert_msg(fabs(t) < 5, "prod b=%u rot=%d: bias t-statistic %.2f", b, rot, t);
            ck_assert_msg(fabs(slope - 1) < tol(0.02), "prod b=%u: slope %.4f", b, slope);
            /* the same test run on mse at the same bits rejects: it has power */
            (void)measure(DATA_RANDOM, 128, b, TQKV_MODE_MSE, rot, 32, (uint32_t)scale_n(128), &im);
            tm = im.mean / sqrt(im.m2 / (im.n - 1) / im.n);
            ck_assert_msg(tm < -8, "mse b=%u: bias t-statistic %.2f, expected strongly negative", b,
                          tm);
        }
}
END_TEST

START_TEST(test_mse_shrinks_by_2_over_pi)
{
    rng = tqkv_test_seed() + 4;
    for (int rot = 0; rot < 2; rot++) {
        ip_stats_t im = {0};
        double slope;
        (void)measure(DATA_RANDOM, 128, 1, TQKV_MODE_MSE, rot, 512, (uint32_t)scale_n(16), &im);
        slope = im.sxy_hat / im.sxy_sq;
        fprintf(stderr, "  mse b=1 %-8s: slope %.4f (2/pi = %.4f)\n", rot ? "hadamard" : "dense",
                slope, 2 / M_PI);
        ck_assert_msg(fabs(slope / (2 / M_PI) - 1) < tol(0.03), "slope %.4f", slope);
    }
}
END_TEST

/* ---- the key-centering rule (proto/PAGE_FORMAT.md section 5, step 2) ---- */

/* Per head: mean over its tokens of ||k - k_hat||^2 / ||k||^2 for K-only pages of
 * `pages` blocks of T tokens x H heads (data: harness keys on every head, then the
 * structured mix on heads with mix[h]). centered[h] counts pages whose head h kept its
 * mean (a non-zero mean row). */
static void
center_errors(const tqkv_block_codec_t *codec0, uint32_t T, uint32_t H, uint32_t D,
              const uint8_t *mix, uint32_t pages, uint64_t seed, double *err, uint32_t *centered)
{
    tqkv_block_shape_t s = {T, H, D};
    tqkv_block_codec_t c = *codec0;
    size_t n = (size_t)T * H * D, sz;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    float *kh = malloc(n * 4);
    uint64_t r = seed;
    void *page;
    char e[200];
    c.v.bits_x2 = 0;
    ck_assert_int_eq(tqkv_page_size(&s, &c, &sz), TQKV_OK);
    page = malloc(sz);
    for (uint32_t h = 0; h < H; h++)
        err[h] = 0, centered[h] = 0;
    for (uint32_t p = 0; p < pages; p++) {
        c.seed = tqkv_splitmix64(&r);
        tqkv_test_kv_harness(&r, T, H, D, k, v);
        tqkv_test_kv_mix(&r, T, H, D, mix, k, NULL);
        ck_assert_msg(tqkv_page_encode(&s, &c, k, NULL, page, sz, NULL, e, sizeof e) == TQKV_OK,
                      "%s", e);
        ck_assert_int_eq(tqkv_page_decode_f32(page, sz, kh, NULL), TQKV_OK);
        for (uint32_t h = 0; h < H; h++) {
            const float *mu = tqkv_page_key_mean(page, h);
            int kept = 0;
            for (uint32_t j = 0; mu && j < D; j++)
                kept |= mu[j] != 0.0f;
            centered[h] += (uint32_t)kept;
            for (uint32_t t = 0; t < T; t++) {
                const uint16_t *x = k + ((size_t)t * H + h) * D;
                const float *y = kh + ((size_t)t * H + h) * D;
                double num = 0, den = 0;
                for (uint32_t j = 0; j < D; j++) {
                    double a = tqkv_bf16_to_f32(x[j]);
                    num += (a - y[j]) * (a - y[j]);
                    den += a * a;
                }
                err[h] += num / den / ((double)T * pages);
            }
        }
    }
    free(k);
    free(v);
    free(kh);
    free(page);
}

/* Issue 24: with centering unconditional, a block of one-hot, constant and
 * outlier-channel keys had 41x-185x the uncentered mean relative error (this test
 * against the library before the rule, d = 64 and 128, 2-4 bits: the mean dominates the
 * small vectors). Now each head keeps its mean only where that lowers its tokens' mean
 * relative energy: on the mix the default policy is never worse than the uncentered
 * codec (the heads store zero means, so the pages decode to the same values), on the
 * harness keys (per-channel offsets and outlier channels, like real projections) every
 * head stays centered and beats the uncentered codec as before. One page mixes both
 * kinds of heads, so the decision is per head. */
START_TEST(test_centering_rule)
{
    static const uint8_t mix[4] = {1, 0, 1, 0};
    static const uint32_t Ds[2] = {64, 128};
    /* not scaled under sanitizers: one page's ratio spreads to x1.01 (seeds 1..1000, 204
     * failed the bound), twelve keep it at x0.72-x0.82; 5 s under ASan */
    uint32_t pages = 12;
    for (uint32_t di = 0; di < 2; di++)
        for (uint8_t bx2 = 4; bx2 <= 8; bx2++) {
            tqkv_block_codec_t c;
            double on[4], off[4];
            uint32_t kept_on[4], kept_off[4];
            uint64_t seed = tqkv_test_seed() + 6 + 100 * di + bx2;
            tqkv_policy_default_codec(&c);
            ck_assert_uint_eq(c.key_centering, 1);
            c.k.bits_x2 = bx2;
            center_errors(&c, 256, 4, Ds[di], mix, pages, seed, on, kept_on);
            c.key_centering = 0;
            center_errors(&c, 256, 4, Ds[di], mix, pages, seed, off, kept_off);
            for (uint32_t h = 0; h < 4; h++) {
                fprintf(stderr,
                        "  centering d=%-3u K%.1f head %u %-8s: default %.5f uncentered %.5f "
                        "(x%.3f), centered in %u of %u pages\n",
                        Ds[di], bx2 / 2.0, h, mix[h] ? "mix" : "harness", on[h], off[h],
                        on[h] / off[h], kept_on[h], pages);
                ck_assert_uint_eq(kept_off[h], 0);
                if (mix[h]) {
                    ck_assert_uint_eq(kept_on[h], 0);
                    ck_assert_msg(on[h] <= off[h], "d=%u K%u/2 mix head %u: %.6f > %.6f", Ds[di],
                                  bx2, h, on[h], off[h]);
                } else {
                    ck_assert_uint_eq(kept_on[h], pages);
                    /* measured x0.72-x0.82 (d = 64 and 128, 2-4 bits), the same
                     * pages as before the rule */
                    ck_assert_msg(on[h] < 0.9 * off[h], "d=%u K%u/2 harness head %u: %.6f vs %.6f",
                                  Ds[di], bx2, h, on[h], off[h]);
                }
            }
        }
}
END_TEST

/* One test case per test, so a seed sweep can run one alone (CK_RUN_CASE=onehot). */
static void
add_case(Suite *s, const char *name, const TTest *fn)
{
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, fn);
    suite_add_tcase(s, tc);
}

static Suite *
quality_suite(void)
{
    Suite *s = suite_create("codec_quality");
    add_case(s, "random_d128", test_dmse_random_d128);
    add_case(s, "random_d64_d256", test_dmse_random_d64_d256);
    add_case(s, "structured", test_dmse_structured);
    add_case(s, "onehot", test_dmse_onehot);
    add_case(s, "prod_unbiased", test_prod_unbiased);
    add_case(s, "mse_2_over_pi", test_mse_shrinks_by_2_over_pi);
    add_case(s, "centering_rule", test_centering_rule);
    return s;
}

TQKV_CHECK_MAIN(quality_suite)
