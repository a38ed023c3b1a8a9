/* check_server.c - unit checks of tqkv-server's pure parts: config flags and env,
 * byte sizes, request validation (every field named in its error), status mapping,
 * log line formats and the encoder pool.
 */
#include <check.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "service/config.h"
#include "service/encoder.h"
#include "service/log.h"
#include "service/server.h"
#include "service/status_map.h"
#include "service/validate.h"

static uint64_t rng_state;

static uint64_t
rnd(void)
{
    return tqkv_splitmix64(&rng_state);
}

static float
rnd_normal(void)
{
    double u1 = ((double)(rnd() >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(rnd() >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---- config ---- */

START_TEST(test_parse_bytes)
{
    uint64_t v;
    ck_assert_int_eq(tqkv_config_parse_bytes("0", &v), TQKV_OK);
    ck_assert_uint_eq(v, 0);
    ck_assert_int_eq(tqkv_config_parse_bytes("1K", &v), TQKV_OK);
    ck_assert_uint_eq(v, 1024);
    ck_assert_int_eq(tqkv_config_parse_bytes("512M", &v), TQKV_OK);
    ck_assert_uint_eq(v, 512ull << 20);
    ck_assert_int_eq(tqkv_config_parse_bytes("3GiB", &v), TQKV_OK);
    ck_assert_uint_eq(v, 3ull << 30);
    ck_assert_int_eq(tqkv_config_parse_bytes("2t", &v), TQKV_OK);
    ck_assert_uint_eq(v, 2ull << 40);
    ck_assert_int_eq(tqkv_config_parse_bytes("77B", &v), TQKV_OK);
    ck_assert_uint_eq(v, 77);
    ck_assert_int_eq(tqkv_config_parse_bytes("12Q", &v), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_config_parse_bytes("-1", &v), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_config_parse_bytes("", &v), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_config_parse_bytes("99999999999T", &v), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_config_parse_bytes("1M1", &v), TQKV_EINVAL);
}
END_TEST

static tqkv_status_t
parse(tqkv_server_config_t *cfg, char *err, size_t errlen, int n, ...)
{
    char *argv[32];
    va_list ap;
    va_start(ap, n);
    argv[0] = "tqkv-server";
    for (int i = 0; i < n; i++)
        argv[i + 1] = va_arg(ap, char *);
    va_end(ap);
    tqkv_config_default(cfg);
    return tqkv_config_parse(cfg, n + 1, argv, err, errlen);
}

START_TEST(test_config_flags)
{
    tqkv_server_config_t cfg;
    char err[256];
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_OK);
    ck_assert_str_eq(cfg.listen, "127.0.0.1:50051");
    ck_assert_uint_eq(cfg.max_message_bytes, 64ull << 20);
    ck_assert_uint_eq(cfg.drain_seconds, 20);

    ck_assert_int_eq(parse(&cfg, err, sizeof err, 11, "--listen", "0.0.0.0:0", "--threads=3",
                           "--dram-capacity", "2G", "--key-bits", "2.5", "--eviction=lru",
                           "--verify-crc", "--log-format", "json"),
                     TQKV_OK);
    ck_assert_str_eq(cfg.listen, "0.0.0.0:0");
    ck_assert_uint_eq(cfg.threads, 3);
    ck_assert_uint_eq(cfg.store.dram_capacity, 2ull << 30);
    ck_assert_uint_eq(cfg.policy.k.bits_x2, 5);
    ck_assert_int_eq(cfg.store.policy, TQKV_EVICT_LRU);
    ck_assert_int_eq(cfg.store.verify_crc, 1);
    ck_assert_int_eq(cfg.log_format, TQKV_LOG_JSON);
    ck_assert(tqkv_config_listen_is_public(cfg.listen));
    ck_assert(!tqkv_config_listen_is_public("127.0.0.1:1"));
    ck_assert(!tqkv_config_listen_is_public("localhost:1"));

    static const char *const bad[][2] = {
        {"--threads", "0"},      {"--key-bits", "5"},      {"--listen", "nohost"},
        {"--listen", "h:70000"}, {"--eviction", "fifo"},   {"--rotation", "none"},
        {"--log-level", "loud"}, {"--dram-capacity", "0"}, {"--max-message-bytes", "1"},
        {"--key-mode", "fast"},  {"--drain-seconds", "x"}, {"--seed", "-3"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, bad[i][0], bad[i][1]), TQKV_EINVAL);
        ck_assert_msg(strstr(err, bad[i][0]) != NULL, "error '%s' does not name %s", err,
                      bad[i][0]);
        ck_assert_ptr_null(strchr(err, '\n'));
    }
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 1, "--nope"), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "--nope"));
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 1, "--threads"), TQKV_EINVAL);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, "--tls-cert", "/x.pem"), TQKV_EINVAL);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, "--hbm-capacity", "1G"), TQKV_EINVAL);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 3, "--hbm-capacity", "1G", "--hbm-standin"),
                     TQKV_OK);
#ifndef TQKV_HAVE_CUDA
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, "--device", "0"), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "CUDA"));
#endif
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 1, "--help"), TQKV_OK);
    ck_assert_int_eq(cfg.help, 1);
}
END_TEST

START_TEST(test_config_env)
{
    tqkv_server_config_t cfg;
    char err[256];
    setenv("TQKV_THREADS", "5", 1);
    setenv("TQKV_DRAIN_SECONDS", "bogus", 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "TQKV_DRAIN_SECONDS"));
    /* The flag wins, even over a malformed variable. */
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, "--drain-seconds", "7"), TQKV_OK);
    ck_assert_uint_eq(cfg.threads, 5);
    ck_assert_uint_eq(cfg.drain_seconds, 7);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 3, "--drain-seconds", "7", "--threads=2"),
                     TQKV_OK);
    ck_assert_uint_eq(cfg.threads, 2);
    unsetenv("TQKV_THREADS");
    unsetenv("TQKV_DRAIN_SECONDS");
}
END_TEST

/* ---- status map ---- */

START_TEST(test_status_map)
{
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_OK), GRPC_STATUS_OK);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_EINVAL), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_ERANGE), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_EUNSUPPORTED), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_ENOSPC), GRPC_STATUS_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_ENOTFOUND), GRPC_STATUS_NOT_FOUND);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_EAUTH), GRPC_STATUS_UNAUTHENTICATED);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_EPERM), GRPC_STATUS_PERMISSION_DENIED);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_ECORRUPT), GRPC_STATUS_DATA_LOSS);
    ck_assert_int_eq(tqkv_status_to_grpc_input(TQKV_ECORRUPT), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_int_eq(tqkv_status_to_grpc(TQKV_ETIMEDOUT), GRPC_STATUS_DEADLINE_EXCEEDED);
    for (int s = 1; s < TQKV_STATUS_COUNT; s++) {
        grpc_status_code c = tqkv_status_to_grpc((tqkv_status_t)s);
        ck_assert_int_ne(c, GRPC_STATUS_OK);
        ck_assert_int_le(c, GRPC_STATUS_UNAUTHENTICATED);
    }
}
END_TEST

/* ---- validate ---- */

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
        b->k[i] = tqkv_f32_to_bf16(rnd_normal());
        b->v[i] = tqkv_f32_to_bf16(rnd_normal());
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
    uint32_t t = 1 + (uint32_t)(rnd() % 40), h = 1 + (uint32_t)(rnd() % 5);
    block_make(&b, t, h, 64);
    for (size_t i = 0; i < sizeof hash_b; i++)
        hash_b[i] = (uint8_t)rnd();
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

    size_t at = (size_t)(rnd() % ((size_t)t * h * 64));
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

START_TEST(test_validate_garbage_and_limits)
{
    tqkv_limits_t lim;
    tqkv_limits_default(&lim);
    char err[256];
    uint8_t junk[97];
    for (int round = 0; round < 200; round++) {
        size_t n = (size_t)(rnd() % sizeof junk);
        for (size_t i = 0; i < n; i++)
            junk[i] = (uint8_t)rnd();
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

/* ---- log ---- */

START_TEST(test_log_lines)
{
    char line[512];
    size_t n = tqkv_log_format_line(line, sizeof line, TQKV_LOG_JSON, TQKV_LOG_WARN, "a \"b\"",
                                    "port=5 path=\"x y\" empty=");
    ck_assert_uint_eq(n, strlen(line));
    ck_assert_ptr_nonnull(strstr(line, "\"level\":\"warn\""));
    ck_assert_ptr_nonnull(strstr(line, "\"msg\":\"a \\\"b\\\"\""));
    ck_assert_ptr_nonnull(strstr(line, "\"port\":\"5\""));
    ck_assert_ptr_nonnull(strstr(line, "\"path\":\"x y\""));
    ck_assert_int_eq(line[0], '{');
    ck_assert_int_eq(line[n - 2], '}');
    ck_assert_int_eq(line[n - 1], '\n');
    n = tqkv_log_format_line(line, sizeof line, TQKV_LOG_TEXT, TQKV_LOG_INFO, "hello",
                             "k=v path=\"x y\"");
    ck_assert_ptr_nonnull(strstr(line, " level=info msg=\"hello\" k=v path=\"x y\"\n"));
    ck_assert_int_eq(strncmp(line, "ts=", 3), 0);
    /* A tiny buffer is never overrun. */
    char small[70];
    memset(small, 'Z', sizeof small);
    n = tqkv_log_format_line(small, 64, TQKV_LOG_JSON, TQKV_LOG_INFO,
                             "a long message that does not fit at all in sixty-four bytes", "k=v");
    ck_assert_uint_lt(n, 64);
    ck_assert_int_eq(small[64], 'Z');
    tqkv_log_level_t lv;
    ck_assert_int_eq(tqkv_log_level_parse("debug", &lv), TQKV_OK);
    ck_assert_int_eq(lv, TQKV_LOG_DEBUG);
    ck_assert_int_eq(tqkv_log_level_parse("verbose", &lv), TQKV_EINVAL);
}
END_TEST

/* ---- encoder pool ---- */

static atomic_long job_sum;

static void
add_job(void *arg)
{
    atomic_fetch_add(&job_sum, (long)(intptr_t)arg);
}

START_TEST(test_encoder_runs_every_job)
{
    tqkv_encoder_t *e;
    long n = getenv("TQKV_SANITIZED") ? 2000 : 20000, want = 0;
    atomic_store(&job_sum, 0);
    ck_assert_int_eq(tqkv_encoder_create(3, &e), TQKV_OK);
    for (long i = 1; i <= n; i++) {
        ck_assert_int_eq(tqkv_encoder_submit(e, add_job, (void *)(intptr_t)i), TQKV_OK);
        want += i;
    }
    tqkv_encoder_destroy(e); /* runs what is queued, then joins */
    ck_assert_int_eq(atomic_load(&job_sum), want);
    tqkv_encoder_destroy(NULL);
}
END_TEST

/* ---- server lifecycle ---- */

START_TEST(test_server_lifecycle_and_bind_error)
{
    tqkv_server_config_t cfg;
    char err[256];
    tqkv_server_t *a = NULL, *b = NULL;
    tqkv_config_default(&cfg);
    snprintf(cfg.listen, sizeof cfg.listen, "127.0.0.1:0");
    cfg.threads = 2;
    cfg.encoder_threads = 1;
    cfg.store.dram_capacity = 16u << 20;
    tqkv_log_setup(TQKV_LOG_WARN, TQKV_LOG_TEXT, NULL);
    ck_assert_int_eq(tqkv_server_create(&cfg, &a, err, sizeof err), TQKV_OK);
    int port = tqkv_server_port(a);
    ck_assert_int_gt(port, 0);
    ck_assert_int_eq(tqkv_server_start(a), TQKV_OK);
    /* The same port again: a start-up error naming --listen, nothing leaked. */
    snprintf(cfg.listen, sizeof cfg.listen, "127.0.0.1:%d", port);
    ck_assert_int_ne(tqkv_server_create(&cfg, &b, err, sizeof err), TQKV_OK);
    ck_assert_ptr_null(b);
    ck_assert_ptr_nonnull(strstr(err, "--listen"));
    /* A token file that does not exist. */
    snprintf(cfg.listen, sizeof cfg.listen, "127.0.0.1:0");
    snprintf(cfg.auth_tokens, sizeof cfg.auth_tokens, "/nonexistent/tqkv-tokens");
    ck_assert_int_ne(tqkv_server_create(&cfg, &b, err, sizeof err), TQKV_OK);
    ck_assert_ptr_null(b);
    tqkv_server_shutdown(a);
    tqkv_server_shutdown(a); /* idempotent */
    tqkv_server_destroy(a);
    tqkv_server_destroy(NULL);
    /* Created but never started. */
    cfg.auth_tokens[0] = '\0';
    ck_assert_int_eq(tqkv_server_create(&cfg, &b, err, sizeof err), TQKV_OK);
    tqkv_server_destroy(b);
}
END_TEST

static Suite *
server_suite(void)
{
    Suite *s = suite_create("server");
    TCase *tc = tcase_create("core");
    rng_state = tqkv_test_seed();
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_parse_bytes);
    tcase_add_test(tc, test_config_flags);
    tcase_add_test(tc, test_config_env);
    tcase_add_test(tc, test_status_map);
    tcase_add_test(tc, test_validate_put);
    tcase_add_test(tc, test_validate_garbage_and_limits);
    tcase_add_test(tc, test_log_lines);
    tcase_add_test(tc, test_encoder_runs_every_job);
    tcase_add_test(tc, test_server_lifecycle_and_bind_error);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(server_suite)
