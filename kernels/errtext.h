/* errtext.h - the one helper that writes an error message into a caller's buffer.
 *
 * tqkv functions that can explain a failure take (char *err, size_t errlen): err may be
 * NULL or errlen 0 when the caller does not want the text. Not installed.
 */
#ifndef TQKV_KERNELS_ERRTEXT_H
#define TQKV_KERNELS_ERRTEXT_H

#include <stddef.h>

#include "kernels/status.h"

/* Formats fmt into err (at most errlen bytes, always NUL-terminated; nothing when err is
 * NULL or errlen 0) and returns st, so that a failure site reads
 * `return tqkv_errtext(TQKV_EINVAL, err, errlen, "layer %u > %u", l, max);`. */
tqkv_status_t tqkv_errtext(tqkv_status_t st, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
