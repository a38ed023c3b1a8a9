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
#include "transport/dc_tls.h"

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

/* ---- TLS data channels (TQKV_CLIENT_TRANSPORT_TCP against --tls-cert --data-listen) ---- */

enum { DC_NH = 5, DC_L = 3 };

typedef struct dc_pages {
    uint8_t *data[DC_NH * DC_L];
    size_t len[DC_NH * DC_L];
    int found[DC_NH * DC_L];
    int via_dc, via_grpc, bad;
} dc_pages_t;

static int
dc_on_page(void *arg, const tqkv_get_page_t *pg)
{
    dc_pages_t *p = arg;
    size_t k = pg->hash_index * DC_L + pg->layer;
    if (pg->hash_index >= DC_NH || pg->layer >= DC_L || p->found[k]) {
        p->bad++;
        return 0;
    }
    p->found[k] = pg->found ? 1 : 2;
    if (pg->found && pg->page) {
        p->data[k] = malloc(pg->page_len);
        memcpy(p->data[k], pg->page, pg->page_len);
        p->len[k] = pg->page_len;
        p->bad += pg->crc_checked != 1;
    }
    p->via_dc += pg->data_channel;
    p->via_grpc += !pg->data_channel;
    return 0;
}

static void
dc_pages_free(dc_pages_t *p)
{
    for (size_t i = 0; i < DC_NH * DC_L; i++)
        free(p->data[i]);
}

/* Pages over a TLS data channel are byte-identical to those of a gRPC Get over TLS, in
 * order, misses included; the channel is reused; a client that does not trust the
 * server's certificate gets no channel and falls back to gRPC, which fails the same
 * way (no page in the clear, no wrong page). */
START_TEST(test_tls_data_channel)
{
    char dir[] = "/tmp/tqkv-client-dctls-XXXXXX";
    char cmd[1024], cert[128], key[128], other[128], okey[128];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(cert, sizeof cert, "%s/cert.pem", dir);
    snprintf(key, sizeof key, "%s/key.pem", dir);
    snprintf(other, sizeof other, "%s/other.pem", dir);
    snprintf(okey, sizeof okey, "%s/other.key", dir);
    const char *fmt = "openssl req -x509 -newkey rsa:2048 -nodes -keyout %s -out %s -days 1 "
                      "-subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 "
                      ">/dev/null 2>&1";
    snprintf(cmd, sizeof cmd, fmt, key, cert);
    ck_assert_msg(system(cmd) == 0, "openssl req failed");
    snprintf(cmd, sizeof cmd, fmt, okey, other);
    ck_assert_msg(system(cmd) == 0, "openssl req failed");
    srv_t t;
    const char *extra[] = {"--tls-cert",    cert,          "--tls-key", key,
                           "--data-listen", "127.0.0.1:0", NULL};
    ck_assert_int_eq(srv_start(&t, 0, extra), 0);
    char addr[80];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", t.port);
    const char *tg[1] = {addr};
    tqkv_client_opts_t o = {.targets = tg,
                            .num_targets = 1,
                            .tls_ca_path = cert,
                            .deadline_ms = 20000,
                            .wait_for_ready = 1,
                            .transport = TQKV_CLIENT_TRANSPORT_GRPC};
    tqkv_client_t *g = NULL, *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &g), TQKV_OK);
    o.transport = TQKV_CLIENT_TRANSPORT_TCP;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);

    tqkv_hash_t hs[DC_NH];
    for (size_t i = 0; i < DC_NH; i++)
        tqkv_test_hash(&hs[i], SEED, 100 + i, 16);
    tqkv_block_shape_t sh = {32, 2, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    uint64_t seed = SEED;
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 3};
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(g, &po, &p), TQKV_OK);
    for (size_t b = 0; b + 1 < DC_NH; b++) /* the last hash stays missing */
        for (uint32_t l = 0; l < DC_L; l++) {
            tqkv_test_bf16_fill(&seed, k, n, sh.head_dim);
            tqkv_test_bf16_fill(&seed, v, n, sh.head_dim);
            tqkv_put_block_t pb = {.ns = "dctls",
                                   .hash = &hs[b],
                                   .layer = l,
                                   .num_layers = DC_L,
                                   .shape = sh,
                                   .key = k,
                                   .value = v};
            ck_assert_int_eq(tqkv_client_put_block(p, &pb), TQKV_OK);
        }
    ck_assert_int_eq(tqkv_client_put_end(p, NULL), TQKV_OK);
    free(k);
    free(v);

    tqkv_get_req_t q = {.ns = "dctls",
                        .hashes = hs,
                        .num_hashes = DC_NH,
                        .layer_begin = 0,
                        .layer_end = DC_L,
                        .encoding = TQKV_CLIENT_PACKED};
    dc_pages_t want = {0}, got = {0}, again = {0};
    ck_assert_int_eq(tqkv_client_get(g, &q, dc_on_page, &want), TQKV_OK);
    ck_assert_int_eq(want.via_dc, 0);
    for (int round = 0; round < 2; round++) {
        dc_pages_t *x = round ? &again : &got;
        tqkv_status_t st = tqkv_client_get(c, &q, dc_on_page, x);
        ck_assert_msg(st == TQKV_OK, "TLS data channel Get: %s", tqkv_client_last_error()->message);
        ck_assert_msg(x->via_grpc == 0 && x->via_dc == DC_NH * DC_L,
                      "pages over gRPC %d, over the channel %d (status '%s')", x->via_grpc,
                      x->via_dc, tqkv_client_data_channel_status(c, 0));
        ck_assert_int_eq(x->bad, 0);
        for (size_t i = 0; i < DC_NH * DC_L; i++) {
            ck_assert_int_eq(x->found[i], i / DC_L == DC_NH - 1 ? 2 : 1);
            ck_assert_int_eq(x->found[i], want.found[i]);
            ck_assert_uint_eq(x->len[i], want.len[i]);
            if (x->found[i] == 1)
                ck_assert_msg(memcmp(x->data[i], want.data[i], x->len[i]) == 0, "page %zu differs",
                              i);
        }
    }
    ck_assert_str_eq(tqkv_client_data_channel_status(c, 0), "");
    /* The channel's records took the fast path: the kernel's, or the userspace TLS 1.3
     * layer (never OpenSSL's own copy-in/copy-out records). */
    char path[48], cipher[64];
    tqkv__dctls_client_last(path, sizeof path, cipher, sizeof cipher);
    ck_assert_msg(!strcmp(path, "userspace") || !strcmp(path, "ktls"), "record path '%s'", path);
    ck_assert_str_eq(cipher, "TLSv1.3 TLS_AES_128_GCM_SHA256");
    tqkv_client_destroy(c);

    /* A client that trusts another certificate: gRPC fails its handshake too, so the Get
     * fails cleanly; no channel is ever attached with a certificate it cannot verify. */
    o.tls_ca_path = other;
    o.wait_for_ready = 0;
    o.deadline_ms = 3000;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    dc_pages_t none = {0};
    tqkv_status_t st = tqkv_client_get(c, &q, dc_on_page, &none);
    ck_assert_msg(st != TQKV_OK, "a Get with an untrusted server certificate succeeded");
    ck_assert_int_eq(none.via_dc, 0);
    tqkv_client_destroy(c);

    dc_pages_free(&want);
    dc_pages_free(&got);
    dc_pages_free(&again);
    dc_pages_free(&none);
    tqkv_client_destroy(g);
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
    tcase_add_test(tc, test_tls_data_channel);
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
