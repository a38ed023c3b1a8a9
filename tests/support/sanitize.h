/* sanitize.h - whether the tests run under a sanitizer, so the heavy ones shrink their
 * iteration counts (ASan/TSan run code 3-20x slower) instead of timing out.
 */
#ifndef TQKV_TESTS_SUPPORT_SANITIZE_H
#define TQKV_TESTS_SUPPORT_SANITIZE_H

#ifdef __cplusplus
extern "C" {
#endif

/* 1 under a sanitizer. TQKV_SANITIZED decides when set: anything but "" or "0" is 1
 * (tests/run.sh sets it for its ASan and TSan stages). Unset: 1 when this library was
 * built with -fsanitize=address or -fsanitize=thread (a TQKV_SANITIZE build run by
 * hand), else 0. */
int tqkv_test_sanitized(void);

#ifdef __cplusplus
}
#endif

#endif
