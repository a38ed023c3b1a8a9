/* fuzz_page.c - libFuzzer target: the page parser (tqkv_page_validate) and decoders on
 * arbitrary bytes.
 *
 * Input: one control byte, then the page bytes. Control bit 0 rewrites the header's
 * CRC to match the bytes (so mutations get past the CRC and reach the layout checks
 * and the decoders); bit 1 validates without the CRC. Properties checked besides
 * memory safety: a rejected page gets a one-line reason; an accepted page lies inside
 * the buffer, is aligned and sized as the format says; with a correct CRC, validation
 * with the CRC agrees with validation without it; and a page accepted with its CRC
 * decodes (f32, f32 reference and BF16) from a buffer of exactly page_bytes, a lossless
 * tensor to exactly the bytes of its raw section.
 */
#include "tests/fuzz/fuzz_common.h"

#include "kernels/page.h"
#include "kernels/page_format.h"

/* Decoding allocates T*H*D floats per tensor; skip shapes beyond this many elements so
 * a header claiming 64K tokens x 1K heads cannot exhaust memory. */
#define FUZZ_MAX_ELEMS (64u << 10)

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    unsigned ctl = data[0];
    data++;
    size--;
    uint8_t *p = malloc(size ? size : 1); /* exact size: ASan sees any overread */
    if (p == NULL)
        return 0;
    memcpy(p, data, size);

    int crc_fixed = 0;
    if ((ctl & 1) && size >= TQKV_PAGE_HEADER_BYTES) {
        uint32_t pb;
        memcpy(&pb, p + offsetof(tqkv_page_header_t, page_bytes), 4);
        if (pb >= TQKV_PAGE_HEADER_BYTES && pb <= size) {
            uint32_t crc = tqkv_page_crc(p, pb);
            memcpy(p + offsetof(tqkv_page_header_t, crc32c), &crc, 4);
            crc_fixed = 1;
        }
    }
    int check_crc = !(ctl & 2);

    tqkv_page_info_t info;
    char err[256];
    memset(err, 'x', sizeof err);
    tqkv_status_t st = tqkv_page_validate(p, size, check_crc, &info, err, sizeof err);
    if (st != TQKV_OK) {
        FUZZ_REQUIRE(st == TQKV_EFORMAT || st == TQKV_ECORRUPT || st == TQKV_EINVAL ||
                     st == TQKV_EUNSUPPORTED);
        FUZZ_REQUIRE(fuzz_err_ok(err, sizeof err));
        free(p);
        return 0;
    }
    FUZZ_REQUIRE(info.hdr == (const tqkv_page_header_t *)p);
    FUZZ_REQUIRE(info.page_bytes >= TQKV_PAGE_HEADER_BYTES && info.page_bytes <= size);
    FUZZ_REQUIRE(info.page_bytes % TQKV_PAGE_ALIGN == 0);
    FUZZ_REQUIRE(info.shape.head_dim >= TQKV_PAGE_MIN_DIM &&
                 info.shape.head_dim <= TQKV_PAGE_MAX_DIM);
    FUZZ_REQUIRE(info.shape.num_kv_heads >= 1 && info.shape.num_kv_heads <= TQKV_PAGE_MAX_HEADS);
    FUZZ_REQUIRE(info.shape.num_tokens >= 1 && info.shape.num_tokens <= TQKV_PAGE_MAX_TOKENS);
    size_t expect = 0;
    FUZZ_REQUIRE(tqkv_page_size(&info.shape, &info.codec, &expect) == TQKV_OK);
    FUZZ_REQUIRE(expect == info.page_bytes);

    if (!check_crc && crc_fixed) {
        tqkv_page_info_t info2;
        FUZZ_REQUIRE(tqkv_page_validate(p, size, 1, &info2, err, sizeof err) == TQKV_OK);
        FUZZ_REQUIRE(info2.page_bytes == info.page_bytes);
        check_crc = 1;
    }

    uint64_t elems =
        (uint64_t)info.shape.num_tokens * info.shape.num_kv_heads * info.shape.head_dim;
    if (check_crc && elems <= FUZZ_MAX_ELEMS) {
        uint8_t *q = malloc(info.page_bytes);
        float *k = malloc(elems * sizeof(float));
        float *v = malloc(elems * sizeof(float));
        uint16_t *kb = malloc(elems * sizeof(uint16_t));
        uint16_t *vb = malloc(elems * sizeof(uint16_t));
        if (q && k && v && kb && vb) {
            memcpy(q, p, info.page_bytes);
            int has_k = info.codec.k.bits_x2 != 0, has_v = info.codec.v.bits_x2 != 0;
            FUZZ_REQUIRE(tqkv_page_decode_f32(q, info.page_bytes, has_k ? k : NULL,
                                              has_v ? v : NULL) == TQKV_OK);
            FUZZ_REQUIRE(tqkv_page_decode_f32_ref(q, info.page_bytes, has_k ? k : NULL,
                                                  has_v ? v : NULL) == TQKV_OK);
            FUZZ_REQUIRE(tqkv_page_decode_bf16(q, info.page_bytes, has_k ? kb : NULL,
                                               has_v ? vb : NULL) == TQKV_OK);
            /* A lossless (raw) tensor decodes to its section's bytes. */
            for (uint32_t t = 0; t < 2; t++)
                if (info.hdr->tensor[t].bits_x2 && info.hdr->tensor[t].mode == TQKV_MODE_RAW)
                    FUZZ_REQUIRE(memcmp(t ? vb : kb, q + info.hdr->tensor[t].group_offset[0],
                                        elems * 2) == 0);
            /* Either output may be skipped. */
            FUZZ_REQUIRE(tqkv_page_decode_f32(q, info.page_bytes, NULL, NULL) == TQKV_OK);
        }
        free(vb);
        free(kb);
        free(v);
        free(k);
        free(q);
    }
    free(p);
    return 0;
}
