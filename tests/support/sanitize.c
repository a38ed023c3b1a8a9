/* sanitize.c - sanitizer detection for the test suites (see sanitize.h). */
#include "tests/support/sanitize.h"

#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define BUILT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define BUILT_SANITIZED 1
#endif
#endif
#ifndef BUILT_SANITIZED
#define BUILT_SANITIZED 0
#endif

int
tqkv_test_sanitized(void)
{
    const char *e = getenv("TQKV_SANITIZED");
    if (e != NULL)
        return e[0] != '\0' && !(e[0] == '0' && e[1] == '\0');
    return BUILT_SANITIZED;
}
