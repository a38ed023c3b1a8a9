/* check_cpu.c - the one CPU feature detection and the TQKV_ISA cap (kernels/cpu.h):
 * detection against the compiler's own CPUID reading, the cap of every dispatch (page,
 * CRC, attention) for the TQKV_ISA of this run, and the deprecated TQKV_ATTN_ISA alias.
 * Registered once per cap (tests/codec.cmake: check_cpu, _avx2, _scalar, _attn_alias).
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/cpu.h"
#include "kernels/page.h"
#include "tests/check_main.h"

static tqkv_isa_t
env_cap(void)
{
    const char *e = getenv("TQKV_ISA");
    if (e && !strcmp(e, "scalar"))
        return TQKV_ISA_SCALAR;
    if (e && !strcmp(e, "avx2"))
        return TQKV_ISA_AVX2;
    return TQKV_ISA_AVX512;
}

START_TEST(test_detection_matches_compiler)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
    const tqkv_cpu_t *f = tqkv_cpu_features();
    __builtin_cpu_init();
    /* libgcc's reading includes the same XGETBV checks */
    ck_assert_int_eq(f->avx2,
                     __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt") &&
                         __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("f16c"));
    ck_assert_int_eq(f->avx512f, __builtin_cpu_supports("avx512f") != 0);
    ck_assert_int_eq(
        f->avx512, f->avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi"));
    ck_assert_int_eq(f->avx512_vbmi2, __builtin_cpu_supports("avx512f") &&
                                          __builtin_cpu_supports("avx512bw") &&
                                          __builtin_cpu_supports("avx512vbmi2"));
    ck_assert_int_eq(f->sse42_pclmul,
                     __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul"));
    ck_assert_int_eq(f->vpclmul, f->sse42_pclmul && __builtin_cpu_supports("avx512f") &&
                                     __builtin_cpu_supports("avx512bw") &&
                                     __builtin_cpu_supports("vpclmulqdq"));
#endif
}
END_TEST

START_TEST(test_cap_applies_everywhere)
{
    const tqkv_cpu_t *f = tqkv_cpu_features(), *u = tqkv_cpu_usable();
    tqkv_isa_t cap = env_cap(), best, lvl;
    const char *attn_alias = getenv("TQKV_ATTN_ISA");
    ck_assert_int_eq(tqkv_isa_cap(), cap);
    /* usable: the detected sets, those above the cap cleared */
    ck_assert_int_eq(u->sse42_pclmul, f->sse42_pclmul && cap >= TQKV_ISA_AVX2);
    ck_assert_int_eq(u->avx2, f->avx2 && cap >= TQKV_ISA_AVX2);
    ck_assert_int_eq(u->avx512f, f->avx512f && cap >= TQKV_ISA_AVX512);
    ck_assert_int_eq(u->avx512, f->avx512 && cap >= TQKV_ISA_AVX512);
    ck_assert_int_eq(u->avx512_vbmi2, f->avx512_vbmi2 && cap >= TQKV_ISA_AVX512);
    ck_assert_int_eq(u->vpclmul, f->vpclmul && cap >= TQKV_ISA_AVX512);
    best = f->avx512 ? TQKV_ISA_AVX512 : f->avx2 ? TQKV_ISA_AVX2 : TQKV_ISA_SCALAR;
    lvl = best < cap ? best : cap;
    ck_assert_int_eq(tqkv_isa_level(), lvl);
    /* what runs: the page kernels, and attention (also under the deprecated alias) */
    ck_assert_str_eq(tqkv_kernels_isa(), tqkv_isa_name(lvl));
    if (attn_alias && !strcmp(attn_alias, "scalar"))
        ck_assert_str_eq(tqkv_attn_isa(), "scalar");
    else if (attn_alias && !strcmp(attn_alias, "avx2"))
        ck_assert_str_eq(tqkv_attn_isa(), tqkv_isa_name(lvl < TQKV_ISA_AVX2 ? lvl : TQKV_ISA_AVX2));
    else
        ck_assert_str_eq(tqkv_attn_isa(), tqkv_isa_name(lvl));
    /* the runtime cap of attention stays below TQKV_ISA */
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
    ck_assert_str_eq(tqkv_attn_isa(), tqkv_isa_name(lvl));
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_AVX2);
    ck_assert_str_eq(tqkv_attn_isa(), tqkv_isa_name(lvl < TQKV_ISA_AVX2 ? lvl : TQKV_ISA_AVX2));
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_SCALAR);
    ck_assert_str_eq(tqkv_attn_isa(), "scalar");
    tqkv_attn_set_isa_cap(TQKV_ATTN_ISA_BEST);
}
END_TEST

START_TEST(test_crc_any_isa)
{
    /* the dispatched CRC (table, SSE4.2 or VPCLMULQDQ by the cap) equals the reference */
    static unsigned char buf[4099];
    uint32_t seed = (uint32_t)tqkv_test_seed();
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (unsigned char)((seed >> (i % 24)) * 2654435761u + i);
    for (size_t n = 0; n <= sizeof buf; n += 97)
        ck_assert_uint_eq(tqkv_crc32c(0, buf, n), tqkv_crc32c_ref(0, buf, n));
}
END_TEST

static Suite *
cpu_suite(void)
{
    Suite *s = suite_create("cpu");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_detection_matches_compiler);
    tcase_add_test(tc, test_cap_applies_everywhere);
    tcase_add_test(tc, test_crc_any_isa);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(cpu_suite)
