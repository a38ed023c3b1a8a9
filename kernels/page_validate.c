/* page_validate.c - tqkv_page_validate: every header field, group and (optionally) the
 * CRC32C of a page checked before anything reads it; lossless tensors must hold finite
 * BF16. Reentrant.
 */
#include "kernels/page.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/codebook.h"
#include "kernels/cpu.h"
#include "kernels/errtext.h"
#include "kernels/page_internal.h"
#include "kernels/rotation.h"
#include "kernels/tq_math.h"

/* ---- validate ---- */

static tqkv_status_t
validate_group(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, uint32_t gi, char *err,
               size_t errlen)
{
    tqkv_group_view_t gv;
    uint64_t n = (uint64_t)h->num_tokens * h->num_kv_heads;
    float z[16];
    if (tqkv_page_group_view(page, t, gi, &gv) != 0)
        return TQKV_EINTERNAL;
    memcpy(z, gv.codebook, sizeof z);
    for (uint32_t k = 0; k < 16; k++) {
        if (k >= gv.L.n_centroids) {
            if (z[k] != 0.0f || signbit(z[k]))
                return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                                    "%s group %u: unused codebook slot %u not zero",
                                    tqkv__tensor_name[t], gi, k);
        } else if (!isfinite(z[k]) || (k > 0 && !(z[k] > z[k - 1]))) {
            return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                                "%s group %u: codebook not finite and ascending at %u",
                                tqkv__tensor_name[t], gi, k);
        }
    }
    /* A scale or gamma (BF16) is good when its widened value is finite and not below
     * zero: as bits, under 0x7f80 (+0 .. +max finite) or exactly 0x8000 (-0). One
     * branch-free pass (it vectorizes; attention validates every page it reads), then a
     * second pass only to name the first bad vector. */
    uint32_t bad = 0;
    for (int arr = 0; arr < (gv.gamma ? 2 : 1); arr++) {
        const uint16_t *a = arr ? gv.gamma : gv.scale;
        for (uint64_t i = 0; i < n; i++) {
            uint32_t u = a[i];
            bad |= (uint32_t)(u >= 0x7f80u) & (uint32_t)(u != 0x8000u);
        }
    }
    if (!bad)
        return TQKV_OK;
    for (uint64_t i = 0; i < n; i++) {
        /* the same bit test as above (a float test could disagree under DAZ) */
        uint32_t us = gv.scale[i], ug = gv.gamma ? gv.gamma[i] : 0;
        if ((us >= 0x7f80u && us != 0x8000u) || (ug >= 0x7f80u && ug != 0x8000u))
            return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                                "%s group %u: vector %llu has a bad scale or gamma",
                                tqkv__tensor_name[t], gi, (unsigned long long)i);
    }
    return TQKV_EINTERNAL; /* the two passes disagree */
}

/* A raw (lossless) tensor holds finite BF16 values only, as the encoder admits: NaN and Inf
 * (exponent bits all set) are refused, so every decode of a valid page is finite. */
static tqkv_status_t
validate_raw(const uint8_t *page, const tqkv_page_header_t *h, uint32_t t, char *err, size_t errlen)
{
    const uint16_t *x = tqkv_page_raw(page, t);
    const uint64_t count = (uint64_t)h->num_tokens * h->num_kv_heads * h->head_dim;
    uint64_t where;
    if (!x)
        return TQKV_EINTERNAL;
    if (!tqkv__find_nonfinite(x, count, &where))
        return TQKV_OK;
    return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                        "%s: lossless value %llu (token %llu) is NaN or Inf", tqkv__tensor_name[t],
                        (unsigned long long)where,
                        (unsigned long long)(where / ((uint64_t)h->num_kv_heads * h->head_dim)));
}

tqkv_status_t
tqkv_page_validate(const void *page, size_t len, int check_crc, tqkv_page_info_t *info, char *err,
                   size_t errlen)
{
    tqkv_page_header_t h, want;
    tqkv_block_shape_t shape;
    tqkv_block_codec_t codec;
    tqkv_status_t st;
    const uint8_t *p = page;
    tqkv_page_tensor_desc_t *d;

    if (!page || len < TQKV_PAGE_HEADER_BYTES)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "short buffer: %zu bytes, a page header is %u", len,
                            TQKV_PAGE_HEADER_BYTES);
    memcpy(&h, page, sizeof h);
    if (h.magic != TQKV_PAGE_MAGIC)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen, "bad magic 0x%08x (not a tqkv page)",
                            h.magic);
    if (h.version != TQKV_PAGE_VERSION)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "unknown page format version %u (this build reads %u)", h.version,
                            TQKV_PAGE_VERSION);
    if (h.header_bytes != TQKV_PAGE_HEADER_BYTES)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen, "header_bytes %u != %u", h.header_bytes,
                            TQKV_PAGE_HEADER_BYTES);
    if (h.page_bytes % TQKV_PAGE_ALIGN || h.page_bytes < TQKV_PAGE_HEADER_BYTES)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen, "page_bytes %u is not a multiple of %u",
                            h.page_bytes, TQKV_PAGE_ALIGN);
    if (h.page_bytes > len)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "truncated page: page_bytes %u > %zu bytes available", h.page_bytes,
                            len);
    if (h.flags & ~TQKV_PAGE_KEY_CENTERED || h.reserved0 || h.reserved1[0] || h.reserved1[1])
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "unknown page flags 0x%02x or reserved bytes set", h.flags);
    shape.num_tokens = h.num_tokens;
    shape.num_kv_heads = h.num_kv_heads;
    shape.head_dim = h.head_dim;
    memset(&codec, 0, sizeof codec);
    codec.rotation = h.rotation;
    codec.key_centering = (h.flags & TQKV_PAGE_KEY_CENTERED) != 0;
    codec.seed = h.seed;
    for (int t = 0; t < 2; t++) {
        tqkv_tensor_codec_t *tc = t == 0 ? &codec.k : &codec.v;
        d = &h.tensor[t];
        tc->bits_x2 = d->bits_x2;
        tc->mode = d->mode;
        tc->norm_correction = (d->flags & TQKV_TENSOR_NORM_CORRECTED) != 0;
        if (d->flags & ~TQKV_TENSOR_NORM_CORRECTED)
            return tqkv_errtext(TQKV_EFORMAT, err, errlen, "%s: unknown tensor flags 0x%02x",
                                tqkv__tensor_name[t], d->flags);
    }
    if (codec.key_centering && !codec.k.bits_x2)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen, "key-centered flag without K");
    if (codec.key_centering && codec.k.mode == TQKV_MODE_RAW)
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "key-centered flag with a lossless (raw BF16) K");
    if ((st = tqkv__page_plan(&shape, &codec, &want, err, errlen)) != TQKV_OK)
        return TQKV_EFORMAT;
    want.crc32c = h.crc32c;
    if (memcmp(&want, &h, sizeof h) != 0) {
        if (want.page_bytes != h.page_bytes)
            return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                                "page_bytes %u does not match the layout of its parameters (%u)",
                                h.page_bytes, want.page_bytes);
        return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                            "section offsets, sizes or bit split do not match the layout "
                            "of the page's parameters");
    }
    if (check_crc) {
        uint32_t crc = tqkv_page_crc(page, h.page_bytes);
        if (crc != h.crc32c)
            return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                                "CRC32C mismatch: stored 0x%08x, computed 0x%08x", h.crc32c, crc);
    }
    /* contents a decoder relies on */
    if (h.flags & TQKV_PAGE_KEY_CENTERED) {
        const uint8_t *m = p + h.mean_offset;
        for (uint64_t i = 0; i < (uint64_t)h.num_kv_heads * h.head_dim; i++) {
            float f;
            memcpy(&f, m + 4 * i, 4);
            if (!isfinite(f))
                return tqkv_errtext(TQKV_ECORRUPT, err, errlen, "key mean %llu is not finite",
                                    (unsigned long long)i);
        }
    }
    for (uint32_t t = 0; t < 2; t++) {
        d = &h.tensor[t];
        if (!d->bits_x2)
            continue;
        if (d->mode == TQKV_MODE_RAW) {
            if ((st = validate_raw(p, &h, t, err, errlen)) != TQKV_OK)
                return st;
            continue;
        }
        if (d->lo_bits) {
            const uint32_t mrow = (h.head_dim + 7) / 8;
            for (uint32_t hh = 0; hh < h.num_kv_heads; hh++) {
                const uint8_t *m = p + d->mask_offset + (uint64_t)hh * mrow;
                uint32_t pc = 0;
                for (uint32_t b = 0; b < mrow; b++)
                    pc += (uint32_t)__builtin_popcount(m[b]);
                if (pc != d->n_hi || (h.head_dim % 8 && (m[mrow - 1] >> (h.head_dim % 8))))
                    return tqkv_errtext(TQKV_ECORRUPT, err, errlen,
                                        "%s: outlier mask of head %u has %u channels, want %u",
                                        tqkv__tensor_name[t], hh, pc, d->n_hi);
            }
        }
        for (uint32_t gi = 0; gi < (d->lo_bits ? 2u : 1u); gi++)
            if ((st = validate_group(p, &h, t, gi, err, errlen)) != TQKV_OK)
                return st;
    }
    if (info) {
        const tqkv_page_header_t *hp = page;
        uint64_t per = 2ull * h.num_tokens * h.num_kv_heads * h.head_dim;
        info->hdr = hp;
        info->shape = shape;
        info->codec = codec;
        info->page_bytes = h.page_bytes;
        info->bf16_bytes = per * ((codec.k.bits_x2 != 0) + (codec.v.bits_x2 != 0));
    }
    return TQKV_OK;
}
