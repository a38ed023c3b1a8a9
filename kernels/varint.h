/* varint.h - protobuf base-128 varints: the one reader and writer of tqkv.
 *
 * Header-only. Used where tqkv reads or writes protobuf bytes by hand instead of
 * through protobuf-c: the server's GetResponse prefixes, the request checks of
 * service/validate.c, reflection's descriptor walk and the client's in-place
 * GetResponse reader. Not installed.
 */
#ifndef TQKV_KERNELS_VARINT_H
#define TQKV_KERNELS_VARINT_H

#include <stddef.h>
#include <stdint.h>

/* Writes v at p (room for 10 bytes); returns the bytes written. */
static inline size_t
tqkv_varint_put(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* Bytes tqkv_varint_put writes for v (1 to 10). */
static inline size_t
tqkv_varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Reads a varint at *p (bytes up to end) into *v and advances *p past it. Returns 0, or
 * -1 when the bytes end first or the varint runs past 10 bytes (*v is then unchanged,
 * *p somewhere inside). Bits beyond 64 are dropped, as protobuf does. */
static inline int
tqkv_varint_get(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    uint64_t x = 0;
    for (unsigned s = 0; s < 64; s += 7) {
        if (*p >= end)
            return -1;
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << s;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

#endif
