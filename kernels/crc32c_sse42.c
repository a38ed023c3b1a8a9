/* crc32c_sse42.c - CRC32C with the SSE4.2 crc32 instruction (chosen at run time). */
#include <nmmintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/page.h"

uint32_t
tqkv__crc32c_sse42(uint32_t crc, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    uint64_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
