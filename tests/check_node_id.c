/* check_node_id.c - a server's stable identity (--node-id) against real tqkv-servers.
 *
 * The id a client learns at connect time (Stats identity_only, no token needed even
 * when auth is on), the default (HOSTNAME:PORT), TQKV_NODE_ID, the metric
 * tqkv_node_info, a bad value refused at start-up, and an unreachable server reported
 * as a failure, never as an id.
 */
#include <check.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check_main.h"
#include "transport/client.h"
#include "transport/node_id.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

static int
query_tok(const char *addr, const char *token, char *id, size_t cap, char *why, size_t whylen)
{
    grpc_init();
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(addr, cr, NULL);
    char bearer[128];
    snprintf(bearer, sizeof bearer, "Bearer %s", token ? token : "");
    grpc_metadata md;
    memset(&md, 0, sizeof md);
    md.key = grpc_slice_from_static_string("authorization");
    md.value = grpc_slice_from_copied_string(bearer);
    int rc = tqkv__node_id_query(ch, &md, token ? 1 : 0, 3000, id, cap, why, whylen);
    grpc_slice_unref(md.value);
    grpc_channel_destroy(ch);
    grpc_channel_credentials_release(cr);
    grpc_shutdown();
    return rc;
}

static int
query(const char *addr, char *id, size_t cap, char *why, size_t whylen)
{
    return query_tok(addr, NULL, id, cap, why, whylen);
}

START_TEST(t_node_id_reported)
{
    char tokens[] = "/tmp/tqkv-nodeid-tokens-XXXXXX";
    int fd = mkstemp(tokens);
    ck_assert_int_ge(fd, 0);
    const char *line = "token-team-a-0123456789 rw team-a\n";
    ck_assert_int_eq(write(fd, line, strlen(line)), (ssize_t)strlen(line));
    close(fd);
    srv_t s;
    const char *extra[] = {"--node-id",   "tqkv-7", "--auth-tokens", tokens, "--metrics-listen",
                           "127.0.0.1:0", NULL};
    ck_assert_int_eq(srv_start(&s, 0, extra), 0);
    char id[256], why[256];
    /* Any valid token, even one granting no namespace the client will use: the identity
     * (every client must rank alike). No token: refused like every KV call. */
    ck_assert_msg(query_tok(s.addr, "token-team-a-0123456789", id, sizeof id, why, sizeof why) == 0,
                  "%s", why);
    ck_assert_str_eq(id, "tqkv-7");
    ck_assert_int_eq(query(s.addr, id, sizeof id, why, sizeof why), -1);
    ck_assert_msg(strstr(why, "status 16") != NULL, "%s", why);
    srv_stop(&s);
    unlink(tokens);

    /* Unreachable: a failure, not an id. */
    ck_assert_int_eq(query(s.addr, id, sizeof id, why, sizeof why), -1);
    ck_assert_str_eq(id, "");
    ck_assert_msg(strstr(why, "status") != NULL, "%s", why);
}
END_TEST

START_TEST(t_node_id_default_env_metrics)
{
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    srv_t s;
    ck_assert_int_eq(srv_start(&s, 0, NULL), 0);
    char id[256], why[256];
    ck_assert_msg(query(s.addr, id, sizeof id, why, sizeof why) == 0, "%s", why);
    char want[300];
    snprintf(want, sizeof want, "%s:%d", host, s.port);
    ck_assert_str_eq(id, want); /* the pod name and port in a StatefulSet */
    srv_stop(&s);

    setenv("TQKV_NODE_ID", "from-env-1", 1);
    const char *extra[] = {"--metrics-listen", "127.0.0.2:0", "--listen", "127.0.0.2:0", NULL};
    int rc = srv_start(&s, 0, extra);
    unsetenv("TQKV_NODE_ID");
    ck_assert_int_eq(rc, 0);
    ck_assert_msg(!strncmp(s.addr, "127.0.0.2:", 10), "%s", s.addr);
    ck_assert_msg(query(s.addr, id, sizeof id, why, sizeof why) == 0, "%s", why);
    ck_assert_str_eq(id, "from-env-1");
    srv_stop(&s);
}
END_TEST

START_TEST(t_node_id_metric)
{
    const char *path = srv_path();
    ck_assert_ptr_nonnull(path);
    char dir[] = "/tmp/tqkv-nodeid-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "%s --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --node-id tqkv-9 "
             "--drain-seconds 0 >%s/out 2>/dev/null & pid=$!; port=; "
             "for i in $(seq 100); do port=$(sed -n 's/.*metrics on port //p' %s/out); "
             "[ -n \"$port\" ] && break; sleep 0.05; done; cat %s/out; "
             "curl -s http://127.0.0.1:$port/metrics | grep '^tqkv_node_info'; "
             "kill $pid; wait $pid; rm -rf %s",
             path, dir, dir, dir, dir);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = '\0';
    pclose(p);
    ck_assert_msg(strstr(buf, "tqkv-server node id tqkv-9\n") != NULL, "%s", buf);
    ck_assert_msg(strstr(buf, "tqkv_node_info{node_id=\"tqkv-9\"} 1") != NULL, "%s", buf);
}
END_TEST

START_TEST(t_node_id_bad_value)
{
    const char *path = srv_path();
    ck_assert_ptr_nonnull(path);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --node-id 'a b' 2>&1; echo rc=$?", path);
    FILE *p = popen(cmd, "r");
    char buf[2048];
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = '\0';
    pclose(p);
    ck_assert_msg(strstr(buf, "--node-id: invalid value 'a b'") && strstr(buf, "rc=2"), "%s", buf);
}
END_TEST

static Suite *
node_id_suite(void)
{
    Suite *s = suite_create("node_id");
    TCase *tc = tcase_create("server");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, t_node_id_reported);
    tcase_add_test(tc, t_node_id_default_env_metrics);
    tcase_add_test(tc, t_node_id_metric);
    tcase_add_test(tc, t_node_id_bad_value);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(node_id_suite)
