/* errtext.c - the error-message helper of kernels/errtext.h. */
#include "kernels/errtext.h"

#include <stdarg.h>
#include <stdio.h>

tqkv_status_t
tqkv_errtext(tqkv_status_t st, char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return st;
}
