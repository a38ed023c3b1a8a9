/* check_validate.c - request validation (service/validate.c): every Put, Get, Lookup,
 * Delete and Stats request is parsed and checked before the server acts on it, and a
 * refused request names the field that is wrong and why.
 *
 * Put: shapes, payload sizes, hashes, namespaces, layers, NaN/Inf, codec overrides
 * (bit widths printed exactly as sent), pages (mismatched, truncated, corrupt, holding
 * only keys or only values), a Put with no payload or a page without its shape.
 * Get: layer range, hashes, message size, unknown transports. Delete: all xor hashes.
 * Every request kind: random bytes never crash the parser, and a namespace with an
 * embedded NUL ("a\0b", which protobuf-c would truncate to "a") is refused.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "service/validate.h"
#include "tests/support/rng.h"

static uint64_t rng_state;

/* A 16-byte block hash. */
static uint8_t hash_16[16] = "0123456789abcdef";

/* ---- Put ---- */

typedef struct block {
    uint32_t t, h, d;
    uint16_t *k, *v;
} block_t;

static void
block_make(block_t *b, uint32_t t, uint32_t h, uint32_t d)
{
    size_t n = (size_t)t * h * d;
    b->t = t;
    b->h = h;
    b->d = d;
    b->k = malloc(n * 2);
    b->v = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        b->k[i] = tqkv_f32_to_bf16((float)tqkv_test_gauss(&rng_state));
        b->v[i] = tqkv_f32_to_bf16((float)tqkv_test_gauss(&rng_state));
    }
}

static void
block_free(block_t *b)
{
    free(b->k);
    free(b->v);
}

static uint8_t *
pack_put(const Tqkv__V1__PutRequest *m, size_t *len)
{
    *len = tqkv__v1__put_request__get_packed_size(m);
    uint8_t *buf = malloc(*len + 1);
    tqkv__v1__put_request__pack(m, buf);
    return buf;
}

static uint8_t hash_a[32], hash_b[80];

static void
fill_put(Tqkv__V1__PutRequest *m, block_t *b)
{
    tqkv__v1__put_request__init(m);
    m->namespace_ = "unit-ns";
    m->hash.data = hash_a;
    m->hash.len = 32;
    m->layer = 3;
    m->num_tokens = b->t;
    m->num_kv_heads = b->h;
    m->head_dim = b->d;
    m->key.data = (uint8_t *)b->k;
    m->key.len = (size_t)b->t * b->h * b->d * 2;
    m->value.data = (uint8_t *)b->v;
    m->value.len = m->key.len;
}

/* Packs m, validates, and checks the status and that err names `field`. */
static void
expect_put(const Tqkv__V1__PutRequest *m, tqkv_status_t want, const char *field)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    size_t len;
    uint8_t *buf = pack_put(m, &len);
    char err[256] = "";
    Tqkv__V1__PutRequest *out = NULL;
    tqkv_status_t st = tqkv_validate_put(buf, len, &lim, &out, err, sizeof err);
    ck_assert_msg(st == want, "want %s got %s (%s) for %s", tqkv_status_name(want),
                  tqkv_status_name(st), err, field ? field : "ok");
    if (st == TQKV_OK) {
        ck_assert_ptr_nonnull(out);
        tqkv__v1__put_request__free_unpacked(out, NULL);
    } else {
        ck_assert_ptr_null(out);
        ck_assert_msg(strstr(err, field) != NULL, "error '%s' does not name %s", err, field);
    }
    free(buf);
}

START_TEST(test_validate_put)
{
    block_t b;
    Tqkv__V1__PutRequest m;
    uint32_t t = 1 + (uint32_t)(tqkv_test_rand(&rng_state) % 40),
             h = 1 + (uint32_t)(tqkv_test_rand(&rng_state) % 5);
    block_make(&b, t, h, 64);
    for (size_t i = 0; i < sizeof hash_b; i++)
        hash_b[i] = (uint8_t)tqkv_test_rand(&rng_state);
    memcpy(hash_a, hash_b, sizeof hash_a);

    fill_put(&m, &b);
    expect_put(&m, TQKV_OK, NULL);
    fill_put(&m, &b);
    m.key.len -= 2;
    expect_put(&m, TQKV_EINVAL, "key");
    fill_put(&m, &b);
    m.value.len -= 2;
    expect_put(&m, TQKV_EINVAL, "value");
    fill_put(&m, &b);
    m.num_tokens++;
    expect_put(&m, TQKV_EINVAL, "key");
    fill_put(&m, &b);
    m.head_dim = 8;
    expect_put(&m, TQKV_EINVAL, "head_dim");
    fill_put(&m, &b);
    m.num_kv_heads = 0;
    expect_put(&m, TQKV_EINVAL, "num_kv_heads");
    fill_put(&m, &b);
    m.hash.len = 0;
    expect_put(&m, TQKV_EINVAL, "hash");
    fill_put(&m, &b);
    m.hash.data = hash_b;
    m.hash.len = 65;
    expect_put(&m, TQKV_EINVAL, "hash");
    fill_put(&m, &b);
    m.parent_hash.data = hash_b;
    m.parent_hash.len = 5;
    expect_put(&m, TQKV_EINVAL, "parent_hash");
    fill_put(&m, &b);
    m.namespace_ = "";
    expect_put(&m, TQKV_EINVAL, "namespace");
    fill_put(&m, &b);
    m.namespace_ = "tab\there";
    expect_put(&m, TQKV_EINVAL, "namespace");
    fill_put(&m, &b);
    m.layer = 4096;
    expect_put(&m, TQKV_EINVAL, "layer");

    size_t at = (size_t)(tqkv_test_rand(&rng_state) % ((size_t)t * h * 64));
    uint16_t saved = b.k[at];
    b.k[at] = 0x7fc0; /* NaN */
    fill_put(&m, &b);
    expect_put(&m, TQKV_ERANGE, "key");
    b.k[at] = 0xff80; /* -Inf */
    expect_put(&m, TQKV_ERANGE, "key");
    b.k[at] = saved;

    Tqkv__V1__Codec codec = TQKV__V1__CODEC__INIT;
    fill_put(&m, &b);
    m.codec = &codec;
    codec.key_bits = 2.75f;
    expect_put(&m, TQKV_EUNSUPPORTED, "codec.key_bits");
    codec.key_bits = 3.5f;
    codec.value_bits = 0.5f;
    expect_put(&m, TQKV_EUNSUPPORTED, "codec.value_bits");
    codec.value_bits = 2.0f;
    codec.key_mode = (Tqkv__V1__Mode)9;
    expect_put(&m, TQKV_EUNSUPPORTED, "codec.key_mode");
    codec.key_mode = TQKV__V1__MODE__MODE_PROD;
    expect_put(&m, TQKV_OK, NULL);

    /* A real page: accepted as is; corrupt, truncated, mismatched or doubled: named. */
    tqkv_policy_t pol;
    tqkv_block_codec_t bc;
    tqkv_block_shape_t shape = {t, h, 64};
    tqkv_policy_default(&pol);
    tqkv_policy_block_codec(&pol, 5, 0, &bc);
    size_t cap, written;
    ck_assert_int_eq(tqkv_page_size(&shape, &bc, &cap), TQKV_OK);
    uint8_t *page = malloc(cap);
    char err[256];
    ck_assert_int_eq(tqkv_page_encode(&shape, &bc, b.k, b.v, page, cap, &written, err, sizeof err),
                     TQKV_OK);
    fill_put(&m, &b);
    m.key.len = m.value.len = 0;
    m.page.data = page;
    m.page.len = written;
    expect_put(&m, TQKV_OK, NULL);
    m.num_tokens = t + 1;
    expect_put(&m, TQKV_EINVAL, "page");
    m.num_tokens = t;
    m.page.len = written - 64;
    expect_put(&m, TQKV_EFORMAT, "page");
    m.page.len = written;
    page[written / 2] ^= 0x10;
    {
        tqkv_limits_t lim;
        tqkv_limits_default(&lim);
        size_t len;
        uint8_t *buf = pack_put(&m, &len);
        Tqkv__V1__PutRequest *out = NULL;
        ck_assert_int_ne(tqkv_validate_put(buf, len, &lim, &out, err, sizeof err), TQKV_OK);
        ck_assert_ptr_nonnull(strstr(err, "page"));
        free(buf);
    }
    page[written / 2] ^= 0x10;
    m.key.len = 2;
    expect_put(&m, TQKV_EINVAL, "page");
    free(page);
    block_free(&b);
}
END_TEST

START_TEST(test_put_missing_payload_or_shape)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    uint8_t buf[4096], page[64];
    char err[256];
    memset(page, 0x5a, sizeof page);
    Tqkv__V1__PutRequest pr = TQKV__V1__PUT_REQUEST__INIT;
    pr.namespace_ = "ns";
    pr.hash.len = 16;
    pr.hash.data = hash_16;
    Tqkv__V1__PutRequest *p = NULL;
    size_t len = tqkv__v1__put_request__pack(&pr, buf);
    ck_assert_int_eq(tqkv_validate_put(buf, len, &lim, &p, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "key: missing (send key and value, or page)") != NULL, "%s", err);
    pr.page.len = sizeof page;
    pr.page.data = page;
    len = tqkv__v1__put_request__pack(&pr, buf);
    ck_assert_int_eq(tqkv_validate_put(buf, len, &lim, &p, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "num_tokens: 0") != NULL && strstr(err, "page's shape") != NULL, "%s",
                  err);
    /* With a shape, the garbage page itself is what is named. */
    pr.num_tokens = 16;
    pr.num_kv_heads = 1;
    pr.head_dim = 16;
    len = tqkv__v1__put_request__pack(&pr, buf);
    ck_assert_int_ne(tqkv_validate_put(buf, len, &lim, &p, err, sizeof err), TQKV_OK);
    ck_assert_msg(strncmp(err, "page: ", 6) == 0, "%s", err);
}
END_TEST

/* Encodes a [T][H][D] block with K and/or V present (bits 0 = absent) and validates a
 * PutRequest carrying it as `page`. Returns the status; err gets the reason. */
static tqkv_status_t
validate_page_put(unsigned kbits_x2, unsigned vbits_x2, char *err, size_t errlen)
{
    const tqkv_block_shape_t shape = {16, 2, 64};
    const size_t n = (size_t)shape.num_tokens * shape.num_kv_heads * shape.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    ck_assert_ptr_nonnull(k);
    ck_assert_ptr_nonnull(v);
    unsigned seed = (unsigned)tqkv_test_seed() + kbits_x2 * 31u + vbits_x2;
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        float f = (float)((int)(seed >> 8) % 2001 - 1000) / 500.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        k[i] = (uint16_t)(u >> 16);
        seed = seed * 1103515245u + 12345u;
        f = (float)((int)(seed >> 8) % 2001 - 1000) / 700.0f;
        memcpy(&u, &f, 4);
        v[i] = (uint16_t)(u >> 16);
    }
    tqkv_block_codec_t codec;
    memset(&codec, 0, sizeof codec);
    codec.k.bits_x2 = (uint8_t)kbits_x2;
    codec.v.bits_x2 = (uint8_t)vbits_x2;
    codec.rotation = TQKV_ROT_HADAMARD;
    codec.seed = 7;
    size_t cap = 0, written = 0;
    ck_assert_int_eq(tqkv_page_size(&shape, &codec, &cap), TQKV_OK);
    uint8_t *page = malloc(cap);
    ck_assert_ptr_nonnull(page);
    char why[200] = "";
    ck_assert_msg(tqkv_page_encode(&shape, &codec, kbits_x2 ? k : NULL, vbits_x2 ? v : NULL, page,
                                   cap, &written, why, sizeof why) == TQKV_OK,
                  "encode: %s", why);

    Tqkv__V1__PutRequest pr = TQKV__V1__PUT_REQUEST__INIT;
    pr.namespace_ = "ns";
    pr.hash.len = sizeof hash_16;
    pr.hash.data = hash_16;
    pr.num_tokens = shape.num_tokens;
    pr.num_kv_heads = shape.num_kv_heads;
    pr.head_dim = shape.head_dim;
    pr.page.len = written;
    pr.page.data = page;
    size_t blen = tqkv__v1__put_request__get_packed_size(&pr);
    uint8_t *buf = malloc(blen);
    ck_assert_ptr_nonnull(buf);
    size_t len = tqkv__v1__put_request__pack(&pr, buf);
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    Tqkv__V1__PutRequest *out = NULL;
    err[0] = '\0';
    tqkv_status_t st = tqkv_validate_put(buf, len, &lim, &out, err, errlen);
    if (st == TQKV_OK)
        tqkv__v1__put_request__free_unpacked(out, NULL);
    else
        ck_assert_ptr_null(out);
    free(buf);
    free(page);
    free(k);
    free(v);
    return st;
}

START_TEST(test_page_put_needs_keys_and_values)
{
    char err[320];
    ck_assert_msg(validate_page_put(6, 6, err, sizeof err) == TQKV_OK, "%s", err);
    ck_assert_msg(validate_page_put(7, 4, err, sizeof err) == TQKV_OK, "%s", err);
    ck_assert_int_eq(validate_page_put(6, 0, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "page: holds no values") != NULL, "%s", err);
    ck_assert_int_eq(validate_page_put(0, 6, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "page: holds no keys") != NULL, "%s", err);
}
END_TEST

START_TEST(test_codec_bits_printed_exactly)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    const uint32_t T = 2, H = 1, D = 16;
    uint16_t kv[2 * 1 * 16];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = 0x3f80; /* 1.0 */
    Tqkv__V1__Codec codec = TQKV__V1__CODEC__INIT;
    Tqkv__V1__PutRequest pr = TQKV__V1__PUT_REQUEST__INIT;
    pr.namespace_ = "ns";
    pr.hash.len = sizeof hash_16;
    pr.hash.data = hash_16;
    pr.num_tokens = T;
    pr.num_kv_heads = H;
    pr.head_dim = D;
    pr.key.len = pr.value.len = sizeof kv;
    pr.key.data = pr.value.data = (uint8_t *)kv;
    pr.codec = &codec;
    const struct {
        float bits;
        const char *shown;
    } cases[] = {{4.0000005f, "4.00000048 is not"},
                 {3.4f, "3.4000001 is not"},
                 {2.75f, "2.75 is not"},
                 {1e-45f, "1.40129846e-45 is not"}};
    uint8_t buf[512];
    char err[320];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int field = 0; field < 2; field++) {
            codec.key_bits = field == 0 ? cases[i].bits : 0.0f;
            codec.value_bits = field == 1 ? cases[i].bits : 0.0f;
            size_t len = tqkv__v1__put_request__pack(&pr, buf);
            Tqkv__V1__PutRequest *out = NULL;
            tqkv_status_t st = tqkv_validate_put(buf, len, &lim, &out, err, sizeof err);
            ck_assert_int_ne(st, TQKV_OK);
            ck_assert_ptr_null(out);
            ck_assert_msg(strstr(err, field == 0 ? "codec.key_bits: " : "codec.value_bits: "), "%s",
                          err);
            ck_assert_msg(strstr(err, cases[i].shown) != NULL, "want '%s' in '%s'", cases[i].shown,
                          err);
        }
    }
    codec.key_bits = 3.5f;
    codec.value_bits = 0.0f;
    size_t len = tqkv__v1__put_request__pack(&pr, buf);
    Tqkv__V1__PutRequest *out = NULL;
    ck_assert_msg(tqkv_validate_put(buf, len, &lim, &out, err, sizeof err) == TQKV_OK, "%s", err);
    tqkv__v1__put_request__free_unpacked(out, NULL);
}
END_TEST

/* ---- Get ---- */

START_TEST(test_get_unknown_transport)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    Tqkv__V1__GetRequest gr = TQKV__V1__GET_REQUEST__INIT;
    ProtobufCBinaryData hs[1] = {{16, hash_16}};
    gr.namespace_ = "ns";
    gr.n_hashes = 1;
    gr.hashes = hs;
    gr.layer_end = 1;
    uint8_t buf[256];
    char err[256] = "";
    Tqkv__V1__GetRequest *g = NULL;
    for (int t = 0; t <= 2; t++) {
        gr.transport = (Tqkv__V1__Transport)t;
        size_t len = tqkv__v1__get_request__pack(&gr, buf);
        ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_OK);
        tqkv__v1__get_request__free_unpacked(g, NULL);
    }
    int bad[] = {3, 5, 1000, -1};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gr.transport = (Tqkv__V1__Transport)bad[i];
        size_t len = tqkv__v1__get_request__pack(&gr, buf);
        g = NULL;
        tqkv_status_t st = tqkv_validate_get(buf, len, &lim, &g, err, sizeof err);
        ck_assert_int_ne(st, TQKV_OK);
        ck_assert_ptr_null(g);
        ck_assert_msg(strstr(err, "transport: unknown value") != NULL, "%s", err);
    }
}
END_TEST

/* ---- every request ---- */

START_TEST(test_validate_garbage_and_limits)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    char err[256];
    uint8_t junk[97];
    for (int round = 0; round < 200; round++) {
        size_t n = (size_t)(tqkv_test_rand(&rng_state) % sizeof junk);
        for (size_t i = 0; i < n; i++)
            junk[i] = (uint8_t)tqkv_test_rand(&rng_state);
        Tqkv__V1__PutRequest *p = NULL;
        Tqkv__V1__GetRequest *g = NULL;
        Tqkv__V1__LookupRequest *l = NULL;
        /* Must never succeed with missing fields and never crash. */
        if (tqkv_validate_put(junk, n, &lim, &p, err, sizeof err) == TQKV_OK)
            tqkv__v1__put_request__free_unpacked(p, NULL);
        if (tqkv_validate_get(junk, n, &lim, &g, err, sizeof err) == TQKV_OK)
            tqkv__v1__get_request__free_unpacked(g, NULL);
        if (tqkv_validate_lookup(junk, n, &lim, &l, err, sizeof err) == TQKV_OK)
            tqkv__v1__lookup_request__free_unpacked(l, NULL);
    }
    static const uint8_t bad[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x12};
    Tqkv__V1__StatsRequest *s = NULL;
    ck_assert_int_eq(tqkv_validate_stats(bad, sizeof bad, &lim, &s, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "message"));

    /* Get: layer range, hashes, encoding. */
    Tqkv__V1__GetRequest gr = TQKV__V1__GET_REQUEST__INIT;
    ProtobufCBinaryData hs[2] = {{16, hash_b}, {0, hash_b}};
    gr.namespace_ = "ns";
    gr.n_hashes = 1;
    gr.hashes = hs;
    gr.layer_begin = 4;
    gr.layer_end = 4;
    uint8_t buf[256];
    size_t len = tqkv__v1__get_request__pack(&gr, buf);
    Tqkv__V1__GetRequest *g = NULL;
    ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "layer_end"));
    gr.layer_end = 6;
    gr.n_hashes = 2;
    len = tqkv__v1__get_request__pack(&gr, buf);
    ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "hashes[1]"));
    gr.n_hashes = 1;
    len = tqkv__v1__get_request__pack(&gr, buf);
    ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_OK);
    tqkv__v1__get_request__free_unpacked(g, NULL);
    lim.max_message_bytes = len - 1;
    ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "message"));

    /* Delete: all xor hashes. */
    tqkv_limits_default(&lim);
    Tqkv__V1__DeleteRequest dr = TQKV__V1__DELETE_REQUEST__INIT;
    Tqkv__V1__DeleteRequest *d = NULL;
    dr.namespace_ = "ns";
    len = tqkv__v1__delete_request__pack(&dr, buf);
    ck_assert_int_eq(tqkv_validate_delete(buf, len, &lim, &d, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "hashes"));
    dr.all = 1;
    len = tqkv__v1__delete_request__pack(&dr, buf);
    ck_assert_int_eq(tqkv_validate_delete(buf, len, &lim, &d, err, sizeof err), TQKV_OK);
    tqkv__v1__delete_request__free_unpacked(d, NULL);
}
END_TEST

/* Packs the request with namespace "a" and patches the wire string to "a\0b". */
static size_t
pack_with_nul_ns(const ProtobufCMessage *m, uint8_t *buf)
{
    size_t len = protobuf_c_message_pack(m, buf);
    /* field 1, wire type 2, length 1, 'a' leads the message (lowest field first). */
    ck_assert_uint_ge(len, 3);
    ck_assert_uint_eq(buf[0], 0x0a);
    ck_assert_uint_eq(buf[1], 1);
    ck_assert_uint_eq(buf[2], 'a');
    memmove(buf + 5, buf + 3, len - 3);
    buf[1] = 3;
    buf[3] = 0;
    buf[4] = 'b';
    return len + 2;
}

START_TEST(test_namespace_with_nul)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    uint8_t buf[4096];
    char err[256];
    ProtobufCBinaryData hs[1] = {{16, hash_16}};

    Tqkv__V1__LookupRequest lr = TQKV__V1__LOOKUP_REQUEST__INIT;
    lr.namespace_ = "a";
    lr.n_hashes = 1;
    lr.hashes = hs;
    lr.num_layers = 1;
    Tqkv__V1__LookupRequest *l = NULL;
    size_t len = tqkv__v1__lookup_request__pack(&lr, buf);
    ck_assert_int_eq(tqkv_validate_lookup(buf, len, &lim, &l, err, sizeof err), TQKV_OK);
    tqkv__v1__lookup_request__free_unpacked(l, NULL);
    l = NULL;
    len = pack_with_nul_ns(&lr.base, buf);
    ck_assert_int_eq(tqkv_validate_lookup(buf, len, &lim, &l, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_null(l);
    ck_assert_msg(strstr(err, "namespace: byte 1 (0x00)") != NULL, "%s", err);

    Tqkv__V1__GetRequest gr = TQKV__V1__GET_REQUEST__INIT;
    gr.namespace_ = "a";
    gr.n_hashes = 1;
    gr.hashes = hs;
    gr.layer_end = 1;
    Tqkv__V1__GetRequest *g = NULL;
    len = pack_with_nul_ns(&gr.base, buf);
    ck_assert_int_eq(tqkv_validate_get(buf, len, &lim, &g, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "namespace") != NULL, "%s", err);

    Tqkv__V1__DeleteRequest dr = TQKV__V1__DELETE_REQUEST__INIT;
    dr.namespace_ = "a";
    dr.all = 1;
    Tqkv__V1__DeleteRequest *d = NULL;
    len = pack_with_nul_ns(&dr.base, buf);
    ck_assert_int_eq(tqkv_validate_delete(buf, len, &lim, &d, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "namespace") != NULL, "%s", err);

    Tqkv__V1__StatsRequest sr = TQKV__V1__STATS_REQUEST__INIT;
    sr.namespace_ = "a";
    Tqkv__V1__StatsRequest *s = NULL;
    len = pack_with_nul_ns(&sr.base, buf);
    ck_assert_int_eq(tqkv_validate_stats(buf, len, &lim, &s, err, sizeof err), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "namespace") != NULL, "%s", err);
    /* A namespace of one NUL byte is not the whole-server Stats. */
    uint8_t one_nul[] = {0x0a, 0x01, 0x00};
    ck_assert_int_eq(tqkv_validate_stats(one_nul, sizeof one_nul, &lim, &s, err, sizeof err),
                     TQKV_EINVAL);

    uint16_t kv[16 * 16];
    memset(kv, 0, sizeof kv);
    Tqkv__V1__PutRequest pr = TQKV__V1__PUT_REQUEST__INIT;
    pr.namespace_ = "a";
    pr.hash.len = 16;
    pr.hash.data = hash_16;
    pr.num_tokens = 16;
    pr.num_kv_heads = 1;
    pr.head_dim = 16;
    pr.key.len = pr.value.len = sizeof kv;
    pr.key.data = pr.value.data = (uint8_t *)kv;
    Tqkv__V1__PutRequest *p = NULL;
    len = tqkv__v1__put_request__pack(&pr, buf);
    ck_assert_int_eq(tqkv_validate_put(buf, len, &lim, &p, err, sizeof err), TQKV_OK);
    tqkv__v1__put_request__free_unpacked(p, NULL);
    p = NULL;
    len = pack_with_nul_ns(&pr.base, buf);
    ck_assert_int_eq(tqkv_validate_put(buf, len, &lim, &p, err, sizeof err), TQKV_EINVAL);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(err, "namespace: byte 1 (0x00)") != NULL, "%s", err);
    /* The last namespace field wins in protobuf-c: "a\0b" then "a" is plain "a". */
    static const uint8_t tail[] = {0x0a, 0x01, 'a'};
    memcpy(buf + len, tail, sizeof tail);
    ck_assert_int_eq(tqkv_validate_put(buf, len + sizeof tail, &lim, &p, err, sizeof err), TQKV_OK);
    ck_assert_str_eq(p->namespace_, "a");
    tqkv__v1__put_request__free_unpacked(p, NULL);
}
END_TEST

static Suite *
validate_suite(void)
{
    Suite *s = suite_create("validate");
    TCase *put = tcase_create("put");
    TCase *get = tcase_create("get");
    TCase *any = tcase_create("any_request");
    rng_state = tqkv_test_seed();
    tcase_add_test(put, test_validate_put);
    tcase_add_test(put, test_put_missing_payload_or_shape);
    tcase_add_test(put, test_page_put_needs_keys_and_values);
    tcase_add_test(put, test_codec_bits_printed_exactly);
    tcase_add_test(get, test_get_unknown_transport);
    tcase_add_test(any, test_validate_garbage_and_limits);
    tcase_add_test(any, test_namespace_with_nul);
    suite_add_tcase(s, put);
    suite_add_tcase(s, get);
    suite_add_tcase(s, any);
    return s;
}

TQKV_CHECK_MAIN(validate_suite)
