/* check_server.c - unit checks of tqkv-server's pure parts: config flags and env,
 * byte sizes, status mapping, log line formats (fields a client cannot forge) and the
 * encoder pool. Request validation is in check_validate.c.
 */
#include <check.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "service/config.h"
#include "service/encoder.h"
#include "service/log.h"
#include "service/server.h"
#include "service/status_map.h"
#include "tests/support/sanitize.h"

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

/* Counts the occurrences of needle in s. */
static int
count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

START_TEST(test_log_fields_cannot_be_forged)
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
    long n = tqkv_test_sanitized() ? 2000 : 20000, want = 0;
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
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_parse_bytes);
    tcase_add_test(tc, test_config_flags);
    tcase_add_test(tc, test_config_env);
    tcase_add_test(tc, test_status_map);
    tcase_add_test(tc, test_log_lines);
    tcase_add_test(tc, test_log_fields_cannot_be_forged);
    tcase_add_test(tc, test_encoder_runs_every_job);
    tcase_add_test(tc, test_server_lifecycle_and_bind_error);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(server_suite)
