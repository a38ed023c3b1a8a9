/* fuzz_client_get.c - libFuzzer target: the C client's in-place GetResponse parser
 * (tqkv__client_parse_get in transport/client_get.c), the first code that touches bytes
 * from a server, differentially against protobuf-c's generated unpacker.
 *
 * Properties: every field the parser returns lies inside the message; whenever
 * protobuf-c accepts a well-typed message, the parser accepts it too and reads the same
 * values (last occurrence wins for every field, as protobuf specifies).
 */
#include "tests/fuzz/fuzz_common.h"

#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"

static int
inside(const uint8_t *buf, size_t n, const uint8_t *p, size_t len)
{
    if (p == NULL)
        return len == 0;
    return p >= buf && len <= n && (size_t)(p - buf) <= n - len;
}

/* 1 when every field of p[0..n) that GetResponse defines carries its own wire type
 * (bytes: length-delimited; integers: varint). protobuf-c also accepts some mismatched
 * wire types (e.g. a bool sent as fixed64) where the client parser skips the field;
 * neither occurs in messages a protobuf encoder writes, so the comparison is limited to
 * well-typed messages. */
static int
well_typed(const uint8_t *p, size_t n)
{
    const uint8_t *end = p + n;
    while (p < end) {
        uint64_t key = 0;
        int shift = 0;
        do {
            if (p == end || shift > 63)
                return 0;
            key |= (uint64_t)(*p & 0x7f) << shift;
            shift += 7;
        } while (*p++ & 0x80);
        uint64_t field = key >> 3, wt = key & 7;
        if (field == 0 || field > 0x1fffffffu)
            return 0; /* not a legal protobuf field number (protobuf-c is lenient here) */
        int is_bytes = field == 1 || (field >= 4 && field <= 6);
        int is_int = field == 2 || field == 3 || (field >= 7 && field <= 10);
        if ((is_bytes && wt != 2) || (is_int && wt != 0))
            return 0;
        uint64_t v = 0;
        switch (wt) {
        case 0:
        case 2:
            shift = 0;
            do {
                if (p == end || shift > 63)
                    return 0;
                v |= (uint64_t)(*p & 0x7f) << shift;
                shift += 7;
            } while (*p++ & 0x80);
            if (wt == 2) {
                if (v > (uint64_t)(end - p))
                    return 0;
                p += v;
            }
            break;
        case 1:
            if (end - p < 8)
                return 0;
            p += 8;
            break;
        case 5:
            if (end - p < 4)
                return 0;
            p += 4;
            break;
        default:
            return 0;
        }
    }
    return 1;
}

static int
same_bytes(const uint8_t *p, size_t len, const ProtobufCBinaryData *b)
{
    return len == b->len && (len == 0 || memcmp(p, b->data, len) == 0);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *buf = malloc(size ? size : 1);
    if (buf == NULL)
        return 0;
    memcpy(buf, data, size);
    tqkv__get_msg_t m;
    int rc = tqkv__client_parse_get(buf, size, &m);
    if (rc == 0) {
        FUZZ_REQUIRE(inside(buf, size, m.hash, m.hash_len));
        FUZZ_REQUIRE(inside(buf, size, m.page, m.page_len));
        FUZZ_REQUIRE(inside(buf, size, m.key, m.key_len));
        FUZZ_REQUIRE(inside(buf, size, m.value, m.value_len));
    }
    Tqkv__V1__GetResponse *r = tqkv__v1__get_response__unpack(NULL, size, buf);
    if (r != NULL && well_typed(buf, size)) {
        FUZZ_REQUIRE(rc == 0);
        FUZZ_REQUIRE(same_bytes(m.hash, m.hash_len, &r->hash));
        FUZZ_REQUIRE(same_bytes(m.page, m.page_len, &r->page));
        FUZZ_REQUIRE(same_bytes(m.key, m.key_len, &r->key));
        FUZZ_REQUIRE(same_bytes(m.value, m.value_len, &r->value));
        FUZZ_REQUIRE(m.layer == r->layer);
        FUZZ_REQUIRE(m.found == (r->found != 0));
        FUZZ_REQUIRE(m.num_tokens == r->num_tokens);
        FUZZ_REQUIRE(m.num_kv_heads == r->num_kv_heads);
        FUZZ_REQUIRE(m.head_dim == r->head_dim);
        FUZZ_REQUIRE(m.tier == (int)r->tier);
    }
    if (r != NULL)
        tqkv__v1__get_response__free_unpacked(r, NULL);
    free(buf);
    return 0;
}
