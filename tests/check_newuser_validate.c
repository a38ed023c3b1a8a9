/* check_newuser_validate.c - request validation gaps found by trying the server as a
 * new user from Python grpcio: an unknown Get transport was accepted (and served over
 * gRPC), a namespace with an embedded NUL was silently truncated to its prefix (so
 * "a\0b" wrote to "a"), and a page Put without its shape, or a Put with no payload at
 * all, was answered "num_tokens: 0" instead of naming what is missing.
 */
#include <check.h>
#include <string.h>

#include "service/validate.h"
#include "check_main.h"

static uint8_t hash_a[16] = "0123456789abcdef";

START_TEST(get_unknown_transport)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    Tqkv__V1__GetRequest gr = TQKV__V1__GET_REQUEST__INIT;
    ProtobufCBinaryData hs[1] = {{16, hash_a}};
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

START_TEST(namespace_with_nul)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    uint8_t buf[4096];
    char err[256];
    ProtobufCBinaryData hs[1] = {{16, hash_a}};

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
    pr.hash.data = hash_a;
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

START_TEST(put_missing_payload_or_shape)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    uint8_t buf[4096], page[64];
    char err[256];
    memset(page, 0x5a, sizeof page);
    Tqkv__V1__PutRequest pr = TQKV__V1__PUT_REQUEST__INIT;
    pr.namespace_ = "ns";
    pr.hash.len = 16;
    pr.hash.data = hash_a;
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

static Suite *
newuser_validate_suite(void)
{
    Suite *s = suite_create("newuser_validate");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, get_unknown_transport);
    tcase_add_test(tc, namespace_with_nul);
    tcase_add_test(tc, put_missing_payload_or_shape);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(newuser_validate_suite)
