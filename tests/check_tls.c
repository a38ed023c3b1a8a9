/* check_tls.c - unit tests of service/tls.c: tqkv_read_file, PEM checks with errors
 * naming the file, and server credentials (TLS and mutual TLS) from certificates made
 * with the openssl tool at test time.
 */
#include <check.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/status.h"
#include "kernels/tq_math.h"
#include "service/tls.h"
#include "tests/check_main.h"

static char g_dir[256];

static void
setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tqkv-check-tls-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
    grpc_init();
}

static void
teardown(void)
{
    grpc_shutdown();
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", g_dir);
}

static const char *
path_of(const char *name)
{
    static char paths[16][512];
    static int k;
    char *p = paths[k++ & 15];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

static const char *
write_bytes(const char *name, const void *data, size_t n)
{
    const char *p = path_of(name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    fclose(f);
    return p;
}

/* Makes a CA, and a server certificate signed by it, with openssl. */
static void
make_certs(void)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
             "-days 1 -subj /CN=tqkv-test-ca >/dev/null 2>&1 && "
             "openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr "
             "-subj /CN=localhost >/dev/null 2>&1 && "
             "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && "
             "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out srv.pem -days 1 -extfile san.ext >/dev/null 2>&1 && "
             "openssl pkey -in srv.key -aes256 -passout pass:secret -out enc.key "
             ">/dev/null 2>&1",
             g_dir);
    ck_assert_msg(system(cmd) == 0, "openssl failed: %s", cmd);
}

START_TEST(test_read_file)
{
    uint64_t rng = tqkv_test_seed() ^ 0x715;
    size_t sizes[] = {0, 1, 4095, 4096, 4097, 100003};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        size_t n = sizes[k];
        unsigned char *data = malloc(n + 1);
        for (size_t i = 0; i < n; i++)
            data[i] = (unsigned char)tqkv_splitmix64(&rng);
        const char *p = write_bytes("blob", data, n);
        char *out = NULL;
        size_t len = 12345;
        ck_assert_int_eq(tqkv_read_file(p, &out, &len), TQKV_OK);
        ck_assert_uint_eq(len, n);
        ck_assert_int_eq(memcmp(out, data, n), 0);
        ck_assert_int_eq(out[n], '\0');
        free(out);
        free(data);
    }
    char *out = (char *)0x1;
    size_t len = 7;
    ck_assert_int_eq(tqkv_read_file(path_of("missing"), &out, &len), TQKV_EIO);
    ck_assert_ptr_null(out);
    ck_assert_uint_eq(len, 0);
}
END_TEST

static void
expect_fail(const char *cert, const char *key, const char *ca, tqkv_status_t want,
            const char *want_path, const char *want_text)
{
    grpc_server_credentials *c = (grpc_server_credentials *)0x1;
    char err[512] = "";
    tqkv_status_t st = tqkv_tls_server_creds(cert, key, ca, &c, err, sizeof(err));
    ck_assert_msg(st == want, "status %s (err '%s'), want %s", tqkv_status_name(st), err,
                  tqkv_status_name(want));
    ck_assert_ptr_null(c);
    if (want_path != NULL)
        ck_assert_msg(strstr(err, want_path) != NULL, "err '%s' does not name %s", err, want_path);
    if (want_text != NULL)
        ck_assert_msg(strstr(err, want_text) != NULL, "err '%s' lacks '%s'", err, want_text);
}

START_TEST(test_creds_ok)
{
    make_certs();
    grpc_server_credentials *c = NULL;
    char err[512] = "";
    ck_assert_int_eq(
        tqkv_tls_server_creds(path_of("srv.pem"), path_of("srv.key"), NULL, &c, err, sizeof(err)),
        TQKV_OK);
    ck_assert_ptr_nonnull(c);
    grpc_server_credentials_release(c);
    c = NULL;
    ck_assert_int_eq(tqkv_tls_server_creds(path_of("srv.pem"), path_of("srv.key"),
                                           path_of("ca.pem"), &c, err, sizeof(err)),
                     TQKV_OK);
    ck_assert_ptr_nonnull(c);
    /* The credentials are usable by a server. */
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_server *srv = grpc_server_create(NULL, NULL);
    grpc_server_register_completion_queue(srv, cq, NULL);
    ck_assert_int_gt(grpc_server_add_http2_port(srv, "127.0.0.1:0", c), 0);
    grpc_server_start(srv);
    static int tag;
    grpc_server_shutdown_and_notify(srv, cq, &tag);
    grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    ck_assert_int_eq(ev.type, GRPC_OP_COMPLETE);
    grpc_server_destroy(srv);
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
    grpc_server_credentials_release(c);
}
END_TEST

START_TEST(test_creds_errors_name_the_file)
{
    make_certs();
    const char *cert = path_of("srv.pem"), *key = path_of("srv.key");
    const char *missing = path_of("nope.pem");
    expect_fail(missing, key, NULL, TQKV_EIO, missing, "certificate");
    expect_fail(cert, missing, NULL, TQKV_EIO, missing, "private key");
    expect_fail(cert, key, missing, TQKV_EIO, missing, "client CA");
    /* cert and key swapped */
    expect_fail(key, cert, NULL, TQKV_EINVAL, key, "not PEM");
    /* garbage */
    const char *junk = write_bytes("junk.pem", "hello world\n", 12);
    expect_fail(junk, key, NULL, TQKV_EINVAL, junk, "BEGIN CERTIFICATE");
    expect_fail(cert, key, junk, TQKV_EINVAL, junk, "client CA");
    /* a key given as CA */
    expect_fail(cert, key, key, TQKV_EINVAL, key, "client CA");
    /* NUL byte inside a PEM file */
    const char nul[] = "-----BEGIN CERTIFICATE-----\n\0\n-----END CERTIFICATE-----\n";
    const char *nulp = write_bytes("nul.pem", nul, sizeof(nul) - 1);
    expect_fail(nulp, key, NULL, TQKV_EINVAL, nulp, "NUL");
    /* encrypted key */
    const char *enc = path_of("enc.key");
    expect_fail(cert, enc, NULL, TQKV_EINVAL, enc, "encrypted");
    /* a directory */
    expect_fail(g_dir, key, NULL, TQKV_EINVAL, g_dir, "regular file");
    /* missing arguments */
    expect_fail(NULL, key, NULL, TQKV_EINVAL, NULL, "--tls-cert");
    expect_fail(cert, NULL, NULL, TQKV_EINVAL, NULL, "--tls-key");
}
END_TEST

/* Writes src's bytes to dst (both under g_dir), replacing it. */
static void
copy_file(const char *src, const char *dst)
{
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "cp '%s' '%s'", path_of(src), path_of(dst));
    ck_assert_int_eq(system(cmd), 0);
}

START_TEST(test_reloadable_creds)
{
    make_certs();
    char cmd[1024], err[512];
    /* A second pair from the same CA: a rotation. */
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && openssl req -newkey rsa:2048 -nodes -keyout srv2.key -out srv2.csr "
             "-subj /CN=localhost >/dev/null 2>&1 && openssl x509 -req -in srv2.csr -CA ca.pem "
             "-CAkey ca.key -CAcreateserial -out srv2.pem -days 1 -extfile san.ext "
             ">/dev/null 2>&1",
             g_dir);
    ck_assert_msg(system(cmd) == 0, "openssl failed: %s", cmd);
    copy_file("srv.pem", "live.pem");
    copy_file("srv.key", "live.key");
    tqkv_tls_t *t = NULL;
    grpc_server_credentials *c = NULL;

    /* A key that does not belong to the certificate is refused at start-up, naming both. */
    copy_file("srv2.key", "live.key");
    ck_assert_int_eq(
        tqkv_tls_create(path_of("live.pem"), path_of("live.key"), NULL, &t, &c, err, sizeof(err)),
        TQKV_EINVAL);
    ck_assert_msg(strstr(err, "does not match") && strstr(err, "live.key"), "%s", err);
    ck_assert_ptr_null(t);
    ck_assert_ptr_null(c);

    copy_file("srv.key", "live.key");
    ck_assert_int_eq(
        tqkv_tls_create(path_of("live.pem"), path_of("live.key"), NULL, &t, &c, err, sizeof(err)),
        TQKV_OK);
    ck_assert_ptr_nonnull(t);
    ck_assert_ptr_nonnull(c);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    double na = tqkv_tls_not_after(t);
    ck_assert_msg(na > (double)now.tv_sec && na < (double)now.tv_sec + 2 * 86400, "%f", na);
    int changed = -1;
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_OK);
    ck_assert_int_eq(changed, 0); /* same files */
    copy_file("srv2.pem", "live.pem");
    copy_file("srv2.key", "live.key");
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_OK);
    ck_assert_int_eq(changed, 1);
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_OK);
    ck_assert_int_eq(changed, 0);
    /* Half-rotated (new key, old certificate), garbage, a missing file: refused, naming
     * the file; nothing changes. */
    copy_file("srv.pem", "live.pem");
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "does not match"), "%s", err);
    ck_assert_int_eq(changed, 0);
    write_bytes("live.pem", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", 59);
    ck_assert_int_ne(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_OK);
    ck_assert_msg(strstr(err, "live.pem") && strstr(err, "does not parse"), "%s", err);
    unlink(path_of("live.pem"));
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_EIO);
    ck_assert_msg(strstr(err, "live.pem"), "%s", err);
    ck_assert_int_eq(changed, 0);
    copy_file("srv2.pem", "live.pem"); /* back to the pair in force: unchanged */
    ck_assert_int_eq(tqkv_tls_reload(t, &changed, err, sizeof(err)), TQKV_OK);
    ck_assert_int_eq(changed, 0);
    const char *pc, *pk, *pca;
    tqkv_tls_paths(t, &pc, &pk, &pca);
    ck_assert_str_eq(pc, path_of("live.pem"));
    ck_assert_str_eq(pca, "");
    grpc_server_credentials_release(c);
    tqkv_tls_destroy(t);
    tqkv_tls_destroy(NULL);
}
END_TEST

static Suite *
tls_suite(void)
{
    Suite *s = suite_create("tls");
    TCase *tc = tcase_create("tls");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_read_file);
    tcase_add_test(tc, test_creds_ok);
    tcase_add_test(tc, test_creds_errors_name_the_file);
    tcase_add_test(tc, test_reloadable_creds);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(tls_suite)
