/* cpu.c - CPU feature detection (CPUID + XGETBV) and the TQKV_ISA cap (cpu.h).
 *
 * CPUID reports what the core implements; the OS must also save the wider register
 * state on context switches, or using it faults: OSXSAVE (leaf 1 ECX bit 27) and XCR0
 * bits 1-2 (SSE, AVX/YMM) for AVX*, bits 5-7 (opmask, ZMM0-15 upper, ZMM16-31) for
 * AVX-512. Done by hand rather than by __builtin_cpu_supports, which not every
 * compiler knows every feature name of (clang 14 lacks "f16c").
 */
#include "kernels/cpu.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

static tqkv_cpu_t features, usable;
static tqkv_isa_t cap = TQKV_ISA_AVX512;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__) || defined(__i386__)
static uint64_t
xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

#define BIT(r, n) (((r) >> (n)) & 1u)

static void
detect(tqkv_cpu_t *f)
{
    unsigned a, b, c, d, b7 = 0, c7 = 0, max;
    uint64_t xcr0 = 0;
    int ymm, zmm, avx2, avx512f;
    if (!__get_cpuid(0, &max, &b, &c, &d) || max < 1 || !__get_cpuid(1, &a, &b, &c, &d))
        return;
    if (max >= 7) {
        unsigned a7, d7;
        __cpuid_count(7, 0, a7, b7, c7, d7);
        (void)a7;
        (void)d7;
    }
    if (BIT(c, 27)) /* OSXSAVE: XGETBV is available */
        xcr0 = xgetbv0();
    ymm = BIT(c, 28) && (xcr0 & 0x6) == 0x6;   /* AVX, XMM and YMM state */
    zmm = ymm && (xcr0 & 0xe0) == 0xe0;        /* opmask, ZMM_Hi256, Hi16_ZMM state */
    f->sse42_pclmul = BIT(c, 20) && BIT(c, 1); /* SSE4.2, PCLMULQDQ */
    avx2 = ymm && BIT(b7, 5) && BIT(c, 12) &&  /* AVX2, FMA */
           BIT(c, 29) && BIT(b7, 8) &&         /* F16C, BMI2 */
           BIT(c, 23) && BIT(c, 20);           /* POPCNT, SSE4.2 */
    avx512f = zmm && BIT(b7, 16);              /* AVX512F */
    f->avx2 = (unsigned char)avx2;
    f->avx512f = (unsigned char)avx512f;
    f->avx512 = avx2 && avx512f && BIT(b7, 30) &&           /* BW */
                BIT(b7, 31) && BIT(b7, 17) &&               /* VL, DQ */
                BIT(c7, 1);                                 /* VBMI */
    f->avx512_vbmi2 = avx512f && BIT(b7, 30) && BIT(c7, 6); /* BW, VBMI2 */
    f->vpclmul = avx512f && BIT(b7, 30) && BIT(c7, 10) &&   /* BW, VPCLMULQDQ */
                 f->sse42_pclmul;
}
#else
static void
detect(tqkv_cpu_t *f)
{
    (void)f;
}
#endif

static void
cpu_init(void)
{
    const char *e = getenv("TQKV_ISA");
    detect(&features);
    if (e && !strcmp(e, "scalar"))
        cap = TQKV_ISA_SCALAR;
    else if (e && !strcmp(e, "avx2"))
        cap = TQKV_ISA_AVX2;
    usable = features;
    if (cap < TQKV_ISA_AVX512)
        usable.avx512f = usable.avx512 = usable.avx512_vbmi2 = usable.vpclmul = 0;
    if (cap < TQKV_ISA_AVX2)
        usable.avx2 = usable.sse42_pclmul = 0;
}

const tqkv_cpu_t *
tqkv_cpu_features(void)
{
    pthread_once(&cpu_once, cpu_init);
    return &features;
}

tqkv_isa_t
tqkv_isa_cap(void)
{
    pthread_once(&cpu_once, cpu_init);
    return cap;
}

const tqkv_cpu_t *
tqkv_cpu_usable(void)
{
    pthread_once(&cpu_once, cpu_init);
    return &usable;
}

tqkv_isa_t
tqkv_isa_level(void)
{
    const tqkv_cpu_t *u = tqkv_cpu_usable();
    return u->avx512 ? TQKV_ISA_AVX512 : u->avx2 ? TQKV_ISA_AVX2 : TQKV_ISA_SCALAR;
}

const char *
tqkv_isa_name(tqkv_isa_t isa)
{
    return isa == TQKV_ISA_AVX512 ? "avx512" : isa == TQKV_ISA_AVX2 ? "avx2" : "scalar";
}
