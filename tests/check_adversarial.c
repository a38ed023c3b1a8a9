/* check_adversarial.c - request validation gaps found by the adversarial new-user trial
 * (tests/interop/test_adversarial.py): a page Put whose page holds only keys (what
 * `tqkv-codec encode` writes) or only values was stored as a block, counted by Lookup,
 * and then refused by decode-kv and attention; a codec override of 4.0000005 bits was
 * reported as "4 is not a supported bit width (..., 4)"; a '"' in a call's error detail
 * (which echoes namespaces and reflection symbols) ended the logged value, so a client
 * could forge fields ("level":"error") in the debug log.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "service/log.h"
#include "service/validate.h"
#include "check_main.h"

static uint8_t hash_a[16] = "0123456789abcdef";

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
    pr.hash.len = sizeof hash_a;
    pr.hash.data = hash_a;
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

START_TEST(page_put_needs_keys_and_values)
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

START_TEST(codec_bits_printed_exactly)
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
    pr.hash.len = sizeof hash_a;
    pr.hash.data = hash_a;
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

/* Counts the occurrences of needle in s. */
static int
count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

START_TEST(log_fields_cannot_be_forged)
{
    const char *detail = "namespace: 'x\"level=\"error\"msg=\"forged' holds no blocks\\";
    char q[256], fields[400], line[1024];
    tqkv_log_quote(q, sizeof q, detail);
    snprintf(fields, sizeof fields, "method=Delete code=5 detail=\"%s\" after=1", q);
    size_t n = tqkv_log_format_line(line, sizeof line, TQKV_LOG_JSON, TQKV_LOG_DEBUG, "call failed",
                                    fields);
    ck_assert_uint_eq(n, strlen(line));
    ck_assert_msg(count(line, "\"level\":") == 1, "%s", line);
    ck_assert_msg(count(line, "\"msg\":") == 1, "%s", line);
    ck_assert_msg(strstr(line, "\"detail\":\"namespace: 'x\\\"level=\\\"error\\\"msg=\\\"forged' "
                               "holds no blocks\\\\\",\"after\":\"1\"}") != NULL,
                  "%s", line);
    n = tqkv_log_format_line(line, sizeof line, TQKV_LOG_TEXT, TQKV_LOG_DEBUG, "call failed",
                             fields);
    ck_assert_msg(count(line, " level=") == 1, "%s", line);
    ck_assert_msg(strstr(line, " after=1\n") != NULL, "%s", line);
    /* Quoting truncates to the buffer and never splits an escape. */
    char tiny[8];
    ck_assert_uint_le(tqkv_log_quote(tiny, sizeof tiny, "\"\"\"\"\"\""), 6);
    ck_assert_uint_eq(strlen(tiny) % 2, 0);
    ck_assert_uint_eq(tqkv_log_quote(tiny, sizeof tiny, NULL), 0);
}
END_TEST

static Suite *
adversarial_suite(void)
{
    Suite *s = suite_create("adversarial");
    TCase *tc = tcase_create("validate");
    tcase_add_test(tc, page_put_needs_keys_and_values);
    tcase_add_test(tc, codec_bits_printed_exactly);
    tcase_add_test(tc, log_fields_cannot_be_forged);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(adversarial_suite)
