/* check_client_tls.c - libtqkv's TLS and bearer-token options against a tqkv-server
 * that requires them (label "server").
 *
 * A separate binary because gRPC 1.51's TLS endpoint leaves its read-buffer slice
 * array behind at exit (grpc_slice_buffer_add_indexed under ExecCtx::Flush); its
 * LeakSanitizer suppression (tests/client.cmake) then covers this binary only, and
 * check_client stays fully leak-checked.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check_main.h"
#include "transport/client.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

static uint64_t SEED;

/* TLS with a self-signed certificate and a bearer token: both options of the client
 * against a server that requires them. */
START_TEST(test_tls_and_token)
{
    char dir[] = "/tmp/tqkv-client-tls-XXXXXX";
    char cmd[1024], cert[128], key[128], tokens[128];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(cert, sizeof cert, "%s/cert.pem", dir);
    snprintf(key, sizeof key, "%s/key.pem", dir);
    snprintf(tokens, sizeof tokens, "%s/tokens", dir);
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey rsa:2048 -nodes -keyout %s -out %s -days 1 "
             "-subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 "
             ">/dev/null 2>&1",
             key, cert);
    if (system(cmd) != 0) {
        fprintf(stderr, "test_tls_and_token: openssl unavailable, TLS part not run\n");
        return;
    }
    FILE *f = fopen(tokens, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "s3cret-token-1234 rw tls\n");
    fclose(f);
    srv_t t;
    const char *extra[] = {"--tls-cert", cert, "--tls-key", key, "--auth-tokens", tokens, NULL};
    ck_assert_int_eq(srv_start(&t, 0, extra), 0);
    char addr[80];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", t.port);
    const char *tg[1] = {addr};

    tqkv_hash_t h;
    tqkv_test_hash(&h, SEED, 1, 16);
    tqkv_lookup_req_t lq = {.ns = "tls", .hashes = &h, .num_hashes = 1, .num_layers = 1};
    uint32_t prefix = 7;
    tqkv_client_t *c = NULL;

    /* TLS + token: served. */
    tqkv_client_opts_t o = {.targets = tg,
                            .num_targets = 1,
                            .tls_ca_path = cert,
                            .tls_target_name = "localhost",
                            .token = "s3cret-token-1234",
                            .deadline_ms = 5000,
                            .wait_for_ready = 1};
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    tqkv_status_t st = tqkv_client_lookup(c, &lq, &prefix, NULL);
    ck_assert_msg(st == TQKV_OK, "TLS+token lookup: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(prefix, 0);
    /* The token grants "tls" only. */
    lq.ns = "other";
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, NULL), TQKV_EPERM);
    lq.ns = "tls";
    tqkv_client_destroy(c);

    /* TLS without the token: UNAUTHENTICATED. */
    o.token = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, NULL), TQKV_EAUTH);
    ck_assert_int_eq(tqkv_client_last_error()->grpc_code, 16);
    tqkv_client_destroy(c);

    /* Plaintext to a TLS server: a clean failure, not a hang. */
    o.tls_ca_path = NULL;
    o.token = "s3cret-token-1234";
    o.wait_for_ready = 0;
    o.deadline_ms = 3000;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    st = tqkv_client_lookup(c, &lq, &prefix, NULL);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ETIMEDOUT || st == TQKV_EINTERNAL,
                  "plaintext to TLS: %s", tqkv_status_name(st));
    tqkv_client_destroy(c);
    srv_stop(&t);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

static Suite *
client_tls_suite(void)
{
    Suite *s = suite_create("client_tls");
    TCase *tc = tcase_create("tls");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_tls_and_token);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    if (srv_path() == NULL) {
        fprintf(stderr,
                "check_client_tls: TQKV_SERVER is not set to a tqkv-server binary: skipped\n");
        return 77;
    }
    SEED = tqkv_test_seed();
    SRunner *sr = srunner_create(client_tls_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
