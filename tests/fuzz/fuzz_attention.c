/* fuzz_attention.c - libFuzzer target: fused decode attention (kernels/attention.h) on
 * pages built from arbitrary bytes, the consumer-side path a corrupt or hostile page
 * reaches after tqkv_page_validate.
 *
 * Input: a control byte, then the page bytes (as fuzz_page: bit 0 rewrites the CRC).
 * When the page validates with its CRC and holds K and V, attention runs over it (one
 * page, and the page twice as a two-page sequence) with the dispatched kernels, the
 * scalar kernels with a small split size, and the reference. Properties: such a page
 * is accepted by every variant; a page that fails validation is rejected by attention
 * too; outputs are written only on success.
 */
#include "tests/fuzz/fuzz_common.h"

#include <math.h>

#include "kernels/attention.h"
#include "kernels/page.h"
#include "kernels/page_format.h"

#define FUZZ_MAX_ELEMS (64u << 10)

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    unsigned ctl = data[0];
    data++;
    size--;
    uint8_t *p = malloc(size ? size : 1);
    if (p == NULL)
        return 0;
    memcpy(p, data, size);
    if ((ctl & 1) && size >= TQKV_PAGE_HEADER_BYTES) {
        uint32_t pb;
        memcpy(&pb, p + offsetof(tqkv_page_header_t, page_bytes), 4);
        if (pb >= TQKV_PAGE_HEADER_BYTES && pb <= size) {
            uint32_t crc = tqkv_page_crc(p, pb);
            memcpy(p + offsetof(tqkv_page_header_t, crc32c), &crc, 4);
        }
    }
    tqkv_page_info_t info;
    char err[256];
    tqkv_status_t vst = tqkv_page_validate(p, size, 1, &info, err, sizeof err);
    const void *pages[2] = {p, p};
    size_t lens[2] = {size, size};
    tqkv_attn_opts_t o;
    tqkv_attn_opts_default(&o);
    o.check_crc = 1;
    if (vst != TQKV_OK) {
        /* Attention must refuse what the page parser refuses. */
        float q[TQKV_PAGE_MAX_DIM], out[TQKV_PAGE_MAX_DIM];
        for (size_t i = 0; i < TQKV_PAGE_MAX_DIM; i++)
            q[i] = 1.0f;
        out[0] = 12345.0f;
        if (size >= TQKV_PAGE_HEADER_BYTES) {
            tqkv_status_t st = tqkv_attn_decode_ex(q, 1, pages, lens, 1, &o, out, err, sizeof err);
            FUZZ_REQUIRE(st != TQKV_OK);
            FUZZ_REQUIRE(out[0] == 12345.0f);
        }
        free(p);
        return 0;
    }
    uint32_t H = info.shape.num_kv_heads, D = info.shape.head_dim;
    uint64_t elems = (uint64_t)info.shape.num_tokens * H * D;
    if (info.codec.k.bits_x2 == 0 || info.codec.v.bits_x2 == 0 || elems > FUZZ_MAX_ELEMS ||
        H > 64) {
        free(p);
        return 0;
    }
    uint32_t HQ = H * (1 + ((ctl >> 1) & 3));
    float *q = malloc((size_t)HQ * D * sizeof(float));
    float *out = malloc((size_t)HQ * D * sizeof(float));
    FUZZ_REQUIRE(q != NULL && out != NULL);
    uint64_t s = 0x9e3779b97f4a7c15ull ^ ctl;
    for (size_t i = 0; i < (size_t)HQ * D; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        q[i] = (float)((int64_t)(s % 2001) - 1000) / 1000.0f;
    }
    FUZZ_REQUIRE(tqkv_attn_decode_ex(q, HQ, pages, lens, 1, &o, out, err, sizeof err) == TQKV_OK);
    FUZZ_REQUIRE(tqkv_attn_decode(q, HQ, pages, lens, 2, &o, out) == TQKV_OK);
    FUZZ_REQUIRE(tqkv_attn_decode_ref(q, HQ, pages, lens, 2, &o, out) == TQKV_OK);
    tqkv_attn_opts_t o2 = o;
    o2.split_tokens = 1 + (ctl >> 3);
    tqkv_attn_force_scalar(1);
    FUZZ_REQUIRE(tqkv_attn_decode(q, HQ, pages, lens, 2, &o2, out) == TQKV_OK);
    tqkv_attn_force_scalar(0);
    /* A query-head count that is not a multiple of H is refused. */
    if (H > 1)
        FUZZ_REQUIRE(tqkv_attn_decode(q, H + 1, pages, lens, 1, &o, out) == TQKV_EINVAL);
    free(out);
    free(q);
    free(p);
    return 0;
}
