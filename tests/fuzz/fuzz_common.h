/* fuzz_common.h - helpers shared by the libFuzzer targets in tests/fuzz/.
 *
 * FUZZ_REQUIRE(cond) aborts (a crash libFuzzer records) when a property of the code
 * under test does not hold; it is how the targets check more than memory safety.
 */
#ifndef TQKV_TESTS_FUZZ_COMMON_H
#define TQKV_TESTS_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_REQUIRE(cond)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: property violated: %s\n", __FILE__, __LINE__, #cond);          \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* An error message must be a non-empty, NUL-terminated line inside its buffer. */
static inline int
fuzz_err_ok(const char *err, size_t cap)
{
    const char *nul = memchr(err, '\0', cap);
    return nul != NULL && nul != err && memchr(err, '\n', (size_t)(nul - err)) == NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
