/* cpu.h - the one CPU feature detection of the kernels, and the one TQKV_ISA override.
 *
 * Every run-time dispatch in kernels/ (page codec, CRC32C, the key-statistics loops,
 * attention) reads tqkv_cpu_usable(): the CPU's features, detected once from CPUID with
 * the OS checks (XGETBV: YMM state for AVX, opmask/ZMM state for AVX-512), capped by
 * the environment variable TQKV_ISA:
 *   TQKV_ISA=scalar   no SIMD kernel (the _ref paths; CRC32C by table)
 *   TQKV_ISA=avx2     nothing above AVX2 (tests run every path on one machine)
 *   TQKV_ISA=avx512   or unset, or any other value: the best the CPU has
 * The variable is read once, at the first call. TQKV_ATTN_ISA (deprecated) caps the
 * attention kernels only (attention.h).
 */
#ifndef TQKV_KERNELS_CPU_H
#define TQKV_KERNELS_CPU_H

#ifdef __cplusplus
extern "C" {
#endif

/* Levels of kernels, in order; a cap admits its level and those below. */
typedef enum tqkv_isa {
    TQKV_ISA_SCALAR = 0,
    TQKV_ISA_AVX2 = 1,
    TQKV_ISA_AVX512 = 2,
} tqkv_isa_t;

/* Feature sets the kernels are compiled for (kernels/CMakeLists.txt), 1 = usable. */
typedef struct tqkv_cpu {
    unsigned char sse42_pclmul; /* SSE4.2 + PCLMULQDQ: crc32c_sse42.c */
    unsigned char avx2;         /* AVX2 + FMA + F16C + BMI2 + POPCNT + SSE4.2: *_avx2.c */
    unsigned char avx512f;      /* AVX-512 F: auto-vectorized loops of page.c */
    unsigned char avx512;       /* AVX-512 F/BW/VL/DQ/VBMI and avx2: *_avx512.c */
    unsigned char avx512_vbmi2; /* AVX-512 F/BW/VBMI2: channel split of page.c */
    unsigned char vpclmul;      /* AVX-512 F/BW + VPCLMULQDQ and sse42_pclmul: CRC32C */
} tqkv_cpu_t;

/* What the CPU and OS support (TQKV_ISA not applied). Detected once, thread-safe;
 * returns borrowed static storage. All zero off x86. */
const tqkv_cpu_t *tqkv_cpu_features(void);

/* The cap TQKV_ISA sets (TQKV_ISA_AVX512 when unset): read once, thread-safe. */
tqkv_isa_t tqkv_isa_cap(void);

/* What the kernels may use: tqkv_cpu_features() with the sets above the cap cleared
 * (SSE4.2 CRC counts as avx2, VPCLMULQDQ CRC and all AVX-512 as avx512). */
const tqkv_cpu_t *tqkv_cpu_usable(void);

/* The best kernel level usable: TQKV_ISA_AVX512 if usable->avx512, else _AVX2 if
 * usable->avx2, else _SCALAR. */
tqkv_isa_t tqkv_isa_level(void);

/* "scalar", "avx2" or "avx512". */
const char *tqkv_isa_name(tqkv_isa_t isa);

#ifdef __cplusplus
}
#endif

#endif
