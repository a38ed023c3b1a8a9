/* check_server_policy.c - per-namespace codec policies (--namespace-policy).
 *
 * Case "config" (label unit): the spec parser - good specs, inheritance from the global
 * flags wherever these stand, the environment form, exact/prefix lookup, and every kind of
 * bad spec with an error that names it. Case "server" (label server): a real tqkv-server
 * on loopback with several namespace policies; the same BF16 block is Put into each
 * namespace, fetched back PACKED, and each page header's codec must be its namespace's
 * policy (boundary layers included), with per-request overrides still winning.
 */
#include <check.h>
#include <ctype.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/policy.h"
#include "service/config.h"
#include "tests/check_main.h"
#include "transport/client.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

/* ---- config ---- */

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
    err[0] = '\0';
    return tqkv_config_parse(cfg, n + 1, argv, err, errlen);
}

static const tqkv_ns_policy_t *
find_entry(const tqkv_server_config_t *cfg, const char *ns, int prefix)
{
    for (unsigned i = 0; i < cfg->num_ns_policies; i++)
        if (!strcmp(cfg->ns_policies[i].ns, ns) && cfg->ns_policies[i].prefix == prefix)
            return &cfg->ns_policies[i];
    return NULL;
}

static const tqkv_policy_t *
lookup(const tqkv_server_config_t *cfg, const char *ns)
{
    return tqkv_config_ns_policy(cfg, ns, strlen(ns));
}

START_TEST(test_spec_good)
{
    static tqkv_server_config_t cfg;
    char err[512];
    /* Global flags given after the specs still reach the keys the specs leave out. */
    tqkv_status_t st =
        parse(&cfg, err, sizeof err, 7, "--namespace-policy",
              "a:key-bits=2,value-bits=2.5,boundary-layers=1,key-mode=prod,seed=0x11",
              "--namespace-policy",
              " team-* : key-bits = 4 , rotation=dense,key-centering,norm-correction=off",
              "--namespace-policy=plain:", "--value-bits", "3.5");
    ck_assert_msg(st == TQKV_OK && err[0] == '\0', "st %d: %s", st, err);
    ck_assert_uint_eq(cfg.num_ns_policies, 3);
    ck_assert_uint_eq(cfg.policy.v.bits_x2, 7);

    const tqkv_ns_policy_t *a = find_entry(&cfg, "a", 0);
    ck_assert_ptr_nonnull(a);
    ck_assert_uint_eq(a->policy.k.bits_x2, 4);
    ck_assert_uint_eq(a->policy.v.bits_x2, 5);
    ck_assert_uint_eq(a->policy.boundary_layers, 1);
    ck_assert_uint_eq(a->policy.k.mode, TQKV_MODE_PROD);
    ck_assert_uint_eq(a->policy.k_boundary.mode, TQKV_MODE_PROD); /* as --key-mode does */
    ck_assert_uint_eq(a->policy.v.mode, TQKV_MODE_MSE);
    ck_assert_uint_eq(a->policy.seed, 0x11);
    ck_assert_uint_eq(a->policy.k_boundary.bits_x2, cfg.policy.k_boundary.bits_x2);
    ck_assert_uint_eq(a->policy.rotation, cfg.policy.rotation);

    const tqkv_ns_policy_t *t = find_entry(&cfg, "team-", 1);
    ck_assert_ptr_nonnull(t);
    ck_assert_uint_eq(t->policy.k.bits_x2, 8);
    ck_assert_uint_eq(t->policy.v.bits_x2, 7); /* --value-bits 3.5, given after the spec */
    ck_assert_uint_eq(t->policy.rotation, TQKV_ROT_DENSE);
    ck_assert_uint_eq(t->policy.key_centering, 1);
    ck_assert_uint_eq(t->policy.k.norm_correction, 0);
    ck_assert_uint_eq(t->policy.v_boundary.norm_correction, 0);

    /* "NS:" alone is exactly the global policy. */
    const tqkv_ns_policy_t *p = find_entry(&cfg, "plain", 0);
    ck_assert_ptr_nonnull(p);
    ck_assert_mem_eq(&p->policy, &cfg.policy, sizeof cfg.policy);

    char line[400];
    tqkv_config_policy_format(&a->policy, line, sizeof line);
    ck_assert_msg(strstr(line, "key=2/prod/nc value=2.5/mse/nc boundary_layers=1") != NULL, "%s",
                  line);
    ck_assert_ptr_nonnull(strstr(line, "seed=17"));
    tqkv_config_policy_format(&t->policy, line, sizeof line);
    ck_assert_msg(strstr(line, "key=4/mse value=3.5/mse ") != NULL, "%s", line);
    ck_assert_ptr_nonnull(strstr(line, "rotation=dense"));

    /* Without specs nothing changes. */
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, 0);
    ck_assert_ptr_eq(lookup(&cfg, "a"), &cfg.policy);
}
END_TEST

START_TEST(test_spec_lookup)
{
    static tqkv_server_config_t cfg;
    char err[512];
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 10, "--namespace-policy", "team-*:key-bits=4",
                           "--namespace-policy", "team-x*:key-bits=2", "--namespace-policy",
                           "team-xy:key-bits=1", "--namespace-policy", "team-x:key-bits=1.5",
                           "--namespace-policy", "ns:with:colons:value-bits=1"),
                     TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, 5);
    ck_assert_uint_eq(lookup(&cfg, "team-1")->k.bits_x2, 8);
    ck_assert_uint_eq(lookup(&cfg, "team-")->k.bits_x2, 8);    /* an empty rest matches */
    ck_assert_uint_eq(lookup(&cfg, "team-xz")->k.bits_x2, 4);  /* longest prefix */
    ck_assert_uint_eq(lookup(&cfg, "team-x")->k.bits_x2, 3);   /* exact beats prefix */
    ck_assert_uint_eq(lookup(&cfg, "team-xy")->k.bits_x2, 2);  /* exact */
    ck_assert_uint_eq(lookup(&cfg, "team-xyz")->k.bits_x2, 4); /* an exact spec is no prefix */
    ck_assert_ptr_eq(lookup(&cfg, "team"), &cfg.policy);
    ck_assert_ptr_eq(lookup(&cfg, "other"), &cfg.policy);
    ck_assert_ptr_eq(lookup(&cfg, "Team-1"), &cfg.policy);
    /* The namespace ends at the last ':'. */
    ck_assert_uint_eq(lookup(&cfg, "ns:with:colons")->v.bits_x2, 2);
    /* The length counts, not a NUL. */
    ck_assert_uint_eq(tqkv_config_ns_policy(&cfg, "team-xyz", 7)->k.bits_x2, 2);
    ck_assert_uint_eq(tqkv_config_ns_policy(&cfg, "team-xyz", 6)->k.bits_x2, 3);
}
END_TEST

START_TEST(test_spec_env)
{
    static tqkv_server_config_t cfg;
    char err[512];
    setenv("TQKV_NAMESPACE_POLICY", " a:key-bits=2 ;; b*:value-bits=4;", 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, 2);
    ck_assert_uint_eq(lookup(&cfg, "a")->k.bits_x2, 4);
    ck_assert_uint_eq(lookup(&cfg, "bee")->v.bits_x2, 8);
    /* Flags win over the variable, even a malformed one. */
    setenv("TQKV_NAMESPACE_POLICY", "a:bogus=1", 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "TQKV_NAMESPACE_POLICY 'a:bogus=1': unknown key 'bogus'"), "%s", err);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 2, "--namespace-policy", "c:key-bits=1"),
                     TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, 1);
    ck_assert_ptr_eq(lookup(&cfg, "a"), &cfg.policy);
    ck_assert_uint_eq(lookup(&cfg, "c")->k.bits_x2, 2);
    /* An empty variable (a ConfigMap key left blank) is no spec. */
    setenv("TQKV_NAMESPACE_POLICY", "", 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, 0);
    unsetenv("TQKV_NAMESPACE_POLICY");
}
END_TEST

START_TEST(test_spec_bad)
{
    static tqkv_server_config_t cfg;
    char err[1024];
    char longns[400];
    memset(longns, 'n', 300);
    memcpy(longns + 300, ":key-bits=2", 12);
    const char *const bad[][2] = {
        {"a:foo=1", "unknown key 'foo'"},
        {"a:threads=2", "unknown key 'threads'"}, /* a flag, but not a codec setting */
        {"a:key-bits=5", "key-bits: invalid value '5'"},
        {"a:value-bits=three", "value-bits: invalid value 'three'"},
        {"a:key-mode=fast", "key-mode: invalid value 'fast'"},
        {"a:boundary-layers=-1", "boundary-layers: invalid value '-1'"},
        {"a:rotation=none", "rotation: invalid value 'none'"},
        {"a:seed=x", "seed: invalid value 'x'"},
        {"a:key-centering=maybe", "key-centering: invalid value 'maybe'"},
        {"a:key-bits", "key-bits: missing value"},
        {"a:key-bits=", "key-bits: invalid value ''"},
        {"a:key-bits=2,,value-bits=2", "empty setting"},
        {"a:key-bits=2,", "empty setting"},
        {":key-bits=2", "empty namespace"},
        {"*:key-bits=2", "empty namespace prefix"},
        {"", "empty spec"},
        {"a", "no ':'"},
        {"a b:key-bits=2", "namespace byte 1 (0x20)"},
        {"a:key-mode=prod,key-bits=1", "codec policy: key: prod mode"},
        {longns, "namespace longer than 256 bytes"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(parse(&cfg, err, sizeof err, 2, "--namespace-policy", bad[i][0]) ==
                          TQKV_EINVAL,
                      "spec '%s' accepted", bad[i][0]);
        ck_assert_msg(strstr(err, bad[i][1]) != NULL, "spec '%s': error '%s' lacks '%s'", bad[i][0],
                      err, bad[i][1]);
        ck_assert_msg(strstr(err, "--namespace-policy") != NULL, "error '%s' names no flag", err);
        if (bad[i][0][0] && strlen(bad[i][0]) < 100) {
            char quoted[128];
            snprintf(quoted, sizeof quoted, "'%s'", bad[i][0]);
            ck_assert_msg(strstr(err, quoted) != NULL, "error '%s' does not quote the spec", err);
        }
        ck_assert_ptr_null(strchr(err, '\n'));
    }
    /* Duplicates: the same namespace twice, the same prefix twice (exact + prefix is fine). */
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 4, "--namespace-policy", "a:key-bits=2",
                           "--namespace-policy", "a:value-bits=2"),
                     TQKV_EINVAL);
    ck_assert_msg(strstr(err, "'a:value-bits=2': duplicate namespace 'a'"), "%s", err);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 4, "--namespace-policy", "t*:key-bits=2",
                           "--namespace-policy", "t*:"),
                     TQKV_EINVAL);
    ck_assert_msg(strstr(err, "duplicate namespace prefix 't*'"), "%s", err);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 4, "--namespace-policy", "t*:key-bits=2",
                           "--namespace-policy", "t:"),
                     TQKV_OK);
    /* The flag without a value. */
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 1, "--namespace-policy"), TQKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "--namespace-policy: missing value"));
}
END_TEST

START_TEST(test_spec_limit)
{
    static tqkv_server_config_t cfg;
    char err[512];
    size_t cap = (TQKV_MAX_NS_POLICIES + 1) * 32;
    char *env = malloc(cap);
    size_t pos = 0;
    ck_assert_ptr_nonnull(env);
    for (int i = 0; i < TQKV_MAX_NS_POLICIES; i++)
        pos += (size_t)snprintf(env + pos, cap - pos, "n%d:key-bits=%s;", i, i % 2 ? "2" : "4");
    setenv("TQKV_NAMESPACE_POLICY", env, 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_OK);
    ck_assert_uint_eq(cfg.num_ns_policies, TQKV_MAX_NS_POLICIES);
    ck_assert_uint_eq(lookup(&cfg, "n255")->k.bits_x2, 4);
    ck_assert_uint_eq(lookup(&cfg, "n254")->k.bits_x2, 8);
    snprintf(env + pos, cap - pos, "one-too-many:key-bits=2");
    setenv("TQKV_NAMESPACE_POLICY", env, 1);
    ck_assert_int_eq(parse(&cfg, err, sizeof err, 0), TQKV_EINVAL);
    ck_assert_msg(strstr(err, "TQKV_NAMESPACE_POLICY: more than 256 namespace policies"), "%s",
                  err);
    unsetenv("TQKV_NAMESPACE_POLICY");
    free(env);
}
END_TEST

START_TEST(test_usage)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ck_assert_ptr_nonnull(f);
    tqkv_config_usage(f);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(text, "--namespace-policy NS:KEY=V,..."));
    ck_assert_ptr_nonnull(strstr(text, "[TQKV_NAMESPACE_POLICY]"));
    ck_assert_ptr_nonnull(strstr(text, "boundary-value-bits"));
    ck_assert_ptr_nonnull(strstr(text, "at most 256 specs"));
    free(text);
}
END_TEST

/* Every option of the table is applied: each flag, alone, changes the configuration
 * (the flags are read from --help, which lists the whole table, so a new option needs a
 * value here). A combination check may then reject the flag alone (--device without
 * CUDA, --tls-cert without --tls-key): the value was still applied. */
static const struct {
    const char *flag, *value;
} every_flag[] = {
    {"peers", "tqkv-headless:50051"},
    {"peers-dns", "127.0.0.1:53"},
    {"handoff-seconds", "5"},
    {"handoff-bytes", "1M"},
    {"replicate-bytes-per-s", "8M"},
    {"no-forward", "1"},
    {"peer-ca", "/nonexistent/peer-ca.pem"},
    {"peer-tls-name", "tqkv-headless"},
    {"peer-token-file", "/nonexistent/peer-token"},
    {"node-id", "tqkv-test-9"},
    {"listen", "127.0.0.1:1"},
    {"threads", "777"},
    {"encoder-threads", "777"},
    {"dram-capacity", "3M"},
    {"hbm-capacity", "1M"},
    {"hbm-standin", "1"},
    {"device", "0"},
    {"disk-path", "/tmp/tqkv-every-flag"},
    {"disk-capacity", "2M"},
    {"disk-sync", "always"},
    {"access-log", "/tmp/tqkv-every-flag.log"},
    {"slow-request-ms", "777"},
    {"max-message-bytes", "5M"},
    {"max-streams", "7"},
    {"key-bits", "1"},
    {"value-bits", "1"},
    {"key-mode", "prod"},
    {"value-mode", "prod"},
    {"lossless", "1"},
    {"boundary-layers", "77"},
    {"boundary-key-bits", "1"},
    {"boundary-value-bits", "1"},
    {"rotation", "dense"},
    {"norm-correction", "0"},
    {"key-centering", "0"},
    {"seed", "123456789"},
    {"namespace-policy", "team:key-bits=2"},
    {"eviction", "lru"},
    {"ns-quota", "1M"},
    {"verify-crc", "1"},
    {"metrics-listen", "127.0.0.1:0"},
    {"data-listen", "127.0.0.1:0"},
    {"auth-tokens", "/nonexistent/tokens"},
    {"tls-cert", "/nonexistent/cert.pem"},
    {"tls-key", "/nonexistent/key.pem"},
    {"tls-client-ca", "/nonexistent/ca.pem"},
    {"drain-seconds", "7"},
    {"log-level", "debug"},
    {"log-format", "json"},
    {"help", "1"},
    {"version", "1"},
};

START_TEST(test_every_option_applies)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ck_assert_ptr_nonnull(f);
    tqkv_config_usage(f);
    fclose(f);

    static tqkv_server_config_t base, cfg, alt;
    char err[256], prog[] = "tqkv-server";
    char *argv0[] = {prog, NULL};
    tqkv_config_default(&base);
    ck_assert_int_eq(tqkv_config_parse(&base, 1, argv0, err, sizeof err), TQKV_OK);

    size_t nflags = 0;
    for (const char *line = text; line && *line;
         line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (!strncmp(line, "Codec defaults", 14))
            break; /* the flag list ends here (examples follow) */
        if (strncmp(line, "  --", 4) != 0)
            continue;
        char name[64];
        size_t n = strcspn(line + 4, " \n");
        ck_assert_uint_lt(n, sizeof name);
        memcpy(name, line + 4, n);
        name[n] = '\0';
        const char *value = NULL;
        for (size_t i = 0; i < sizeof every_flag / sizeof every_flag[0]; i++)
            if (!strcmp(every_flag[i].flag, name))
                value = every_flag[i].value;
        ck_assert_msg(value != NULL, "--%s: no value in every_flag[] (a new option?)", name);
        nflags++;

        char arg[160];
        snprintf(arg, sizeof arg, "--%s=%s", name, value);
        char *argv[] = {prog, arg, NULL};
        tqkv_config_default(&cfg);
        err[0] = '\0';
        tqkv_status_t st = tqkv_config_parse(&cfg, 2, argv, err, sizeof err);
        /* Rejected only by a combination check, never as a bad value or unknown flag. */
        ck_assert_msg(st == TQKV_OK || !strstr(err, "invalid value"), "--%s=%s: %s", name, value,
                      err);
        ck_assert_msg(st == TQKV_OK || !strstr(err, "unknown flag"), "--%s=%s: %s", name, value,
                      err);
        ck_assert_msg(memcmp(&cfg, &base, sizeof cfg) != 0, "--%s=%s changed nothing", name, value);

        /* The variable, where the option has one, applies the same way. */
        char env[64] = "TQKV_";
        for (size_t i = 0; name[i] && i + 6 < sizeof env; i++)
            env[5 + i] = name[i] == '-' ? '_' : (char)toupper((unsigned char)name[i]);
        if (strstr(line, env) == NULL)
            continue; /* --help, --version: no variable */
        setenv(env, value, 1);
        tqkv_config_default(&alt);
        tqkv_config_parse(&alt, 1, argv0, err, sizeof err);
        unsetenv(env);
        ck_assert_msg(memcmp(&alt, &cfg, sizeof cfg) == 0, "%s=%s differs from --%s=%s", env, value,
                      name, value);
    }
    ck_assert_uint_eq(nflags, sizeof every_flag / sizeof every_flag[0]);
    free(text);
}
END_TEST

/* ---- server ---- */

#define NS_LAYERS 8
static const uint32_t LAYERS[] = {0, 2, 3, 7}; /* boundary or not under 1 and 3 layers */
#define N_LAYERS (sizeof LAYERS / sizeof LAYERS[0])

static tqkv_client_t *
client_for(const char *addr)
{
    const char *t[1] = {addr};
    tqkv_client_opts_t o = {
        .targets = t, .num_targets = 1, .deadline_ms = 30000, .wait_for_ready = 1};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

static void
put_layers(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, const tqkv_put_opts_t *o,
           tqkv_block_shape_t sh, const uint16_t *k, const uint16_t *v)
{
    tqkv_put_t *p;
    tqkv_put_result_t r;
    ck_assert_int_eq(tqkv_client_put_begin(c, o, &p), TQKV_OK);
    for (size_t i = 0; i < N_LAYERS; i++) {
        tqkv_put_block_t pb = {.ns = ns,
                               .hash = h,
                               .layer = LAYERS[i],
                               .num_layers = NS_LAYERS,
                               .shape = sh,
                               .key = k,
                               .value = v};
        tqkv_status_t st = tqkv_client_put_block(p, &pb);
        ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
    }
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end %s: %s", ns, tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_stored, N_LAYERS);
}

typedef struct got {
    tqkv_block_codec_t codec[NS_LAYERS];
    int found[NS_LAYERS];
    int bad;
    char why[256];
} got_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    got_t *g = arg;
    tqkv_page_info_t info;
    if (!pg->found || pg->layer >= NS_LAYERS)
        return 0;
    if (tqkv_page_validate(pg->page, pg->page_len, 1, &info, g->why, sizeof g->why) != TQKV_OK) {
        g->bad++;
        return 0;
    }
    g->found[pg->layer] = 1;
    g->codec[pg->layer] = info.codec;
    return 0;
}

static void
check_ns(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, const tqkv_policy_t *want,
         const tqkv_put_opts_t *override)
{
    got_t g;
    memset(&g, 0, sizeof g);
    tqkv_get_req_t req = {.ns = ns,
                          .hashes = h,
                          .num_hashes = 1,
                          .layer_begin = 0,
                          .layer_end = NS_LAYERS,
                          .encoding = TQKV_CLIENT_PACKED};
    tqkv_status_t st = tqkv_client_get(c, &req, on_page, &g);
    ck_assert_msg(st == TQKV_OK, "get %s: %s", ns, tqkv_client_last_error()->message);
    ck_assert_msg(g.bad == 0, "%s: invalid page: %s", ns, g.why);
    for (size_t i = 0; i < N_LAYERS; i++) {
        uint32_t l = LAYERS[i];
        tqkv_block_codec_t e;
        tqkv_policy_block_codec(want, l, NS_LAYERS, &e);
        if (override && override->key_bits != 0.0f)
            e.k.bits_x2 = (uint8_t)(override->key_bits * 2.0f);
        if (override && override->value_bits != 0.0f)
            e.v.bits_x2 = (uint8_t)(override->value_bits * 2.0f);
        const tqkv_block_codec_t *p = &g.codec[l];
        ck_assert_msg(g.found[l], "%s layer %u: no page", ns, l);
        ck_assert_msg(p->k.bits_x2 == e.k.bits_x2 && p->v.bits_x2 == e.v.bits_x2 &&
                          p->k.mode == e.k.mode && p->v.mode == e.v.mode &&
                          p->k.norm_correction == e.k.norm_correction &&
                          p->v.norm_correction == e.v.norm_correction,
                      "%s layer %u: page K %u/%u/%u V %u/%u/%u, policy K %u/%u/%u V %u/%u/%u", ns,
                      l, p->k.bits_x2, p->k.mode, p->k.norm_correction, p->v.bits_x2, p->v.mode,
                      p->v.norm_correction, e.k.bits_x2, e.k.mode, e.k.norm_correction, e.v.bits_x2,
                      e.v.mode, e.v.norm_correction);
        ck_assert_msg(p->rotation == e.rotation, "%s layer %u: rotation %u, policy %u", ns, l,
                      p->rotation, e.rotation);
        ck_assert_msg(p->key_centering == e.key_centering, "%s layer %u: key_centering %u", ns, l,
                      p->key_centering);
        ck_assert_msg(p->seed == e.seed, "%s layer %u: seed %llu, policy %llu", ns, l,
                      (unsigned long long)p->seed, (unsigned long long)e.seed);
    }
}

START_TEST(test_server_ns_policy)
{
    static const char *const extra[] = {
        "--namespace-policy",
        "a:key-bits=2,value-bits=2,boundary-layers=1,boundary-key-bits=2.5,"
        "boundary-value-bits=3,key-centering=off,seed=7",
        "--namespace-policy", "team-*:key-bits=4,value-bits=4,rotation=dense,value-mode=prod",
        "--namespace-policy", "team-x*:value-bits=1.5,norm-correction=off", "--namespace-policy",
        "team-exact:",
        /* Global flags after the specs: inherited by the keys the specs leave out. */
        "--key-bits", "3.5", "--boundary-layers", "3", NULL};
    srv_t S;
    ck_assert_msg(srv_start(&S, 0, extra) == 0, "cannot start tqkv-server");
    tqkv_client_t *c = client_for(S.addr);

    uint64_t seed = tqkv_test_seed() ^ 0x5eedull;
    tqkv_block_shape_t sh = {16, 2, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    ck_assert_ptr_nonnull(k);
    ck_assert_ptr_nonnull(v);
    tqkv_test_bf16_fill(&seed, k, n, sh.head_dim);
    tqkv_test_bf16_fill(&seed, v, n, sh.head_dim);
    tqkv_hash_t h, h2;
    tqkv_test_hash(&h, seed, 1, 32);
    tqkv_test_hash(&h2, seed, 2, 32);

    /* The expected policies, written out from the flags above. */
    tqkv_policy_t global, pa, pteam, pteamx;
    tqkv_policy_default(&global);
    global.k.bits_x2 = 7;
    global.boundary_layers = 3;
    pa = global;
    pa.k.bits_x2 = 4;
    pa.v.bits_x2 = 4;
    pa.boundary_layers = 1;
    pa.k_boundary.bits_x2 = 5;
    pa.v_boundary.bits_x2 = 6;
    pa.key_centering = 0;
    pa.seed = 7;
    pteam = global;
    pteam.k.bits_x2 = 8;
    pteam.v.bits_x2 = 8;
    pteam.rotation = TQKV_ROT_DENSE;
    pteam.v.mode = pteam.v_boundary.mode = TQKV_MODE_PROD;
    pteamx = global; /* prefixes do not stack: team-x* starts from the global policy */
    pteamx.v.bits_x2 = 3;
    pteamx.k.norm_correction = pteamx.v.norm_correction = 0;
    pteamx.k_boundary.norm_correction = pteamx.v_boundary.norm_correction = 0;

    static const struct {
        const char *ns;
        int which; /* 0 global, 1 a, 2 team-*, 3 team-x* */
    } cases[] = {
        {"a", 1},     {"team-1", 2}, {"team-xy", 3}, {"team-exact", 0}, {"team-exactly", 2},
        {"other", 0}, {"ab", 0},     {"team", 0},
    };
    const tqkv_put_opts_t none = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tqkv_policy_t *want = cases[i].which == 1   ? &pa
                                    : cases[i].which == 2 ? &pteam
                                    : cases[i].which == 3 ? &pteamx
                                                          : &global;
        put_layers(c, cases[i].ns, &h, &none, sh, k, v);
        check_ns(c, cases[i].ns, &h, want, NULL);
    }
    /* The namespaces really got different pages: a's middle layer is 2-bit, team-1's 4. */
    {
        got_t ga, gt;
        memset(&ga, 0, sizeof ga);
        memset(&gt, 0, sizeof gt);
        tqkv_get_req_t ra = {.ns = "a",
                             .hashes = &h,
                             .num_hashes = 1,
                             .layer_begin = 3,
                             .layer_end = 4,
                             .encoding = TQKV_CLIENT_PACKED};
        tqkv_get_req_t rt = ra;
        rt.ns = "team-1";
        ck_assert_int_eq(tqkv_client_get(c, &ra, on_page, &ga), TQKV_OK);
        ck_assert_int_eq(tqkv_client_get(c, &rt, on_page, &gt), TQKV_OK);
        ck_assert_uint_eq(ga.codec[3].k.bits_x2, 4);
        ck_assert_uint_eq(gt.codec[3].k.bits_x2, 8);
    }
    /* A per-request override still wins over the namespace's policy, for that tensor. */
    const tqkv_put_opts_t o4 = {.key_bits = 4.0f};
    put_layers(c, "a", &h2, &o4, sh, k, v);
    check_ns(c, "a", &h2, &pa, &o4);
    const tqkv_put_opts_t o1 = {.value_bits = 1.0f};
    put_layers(c, "team-1", &h2, &o1, sh, k, v);
    check_ns(c, "team-1", &h2, &pteam, &o1);

    free(k);
    free(v);
    tqkv_client_destroy(c);
    srv_stop(&S);
}
END_TEST

/* A bad spec stops the real binary before it listens: exit status 2, the spec named. */
START_TEST(test_server_bad_spec_exits)
{
    const char *path = srv_path();
    ck_assert_msg(path != NULL, "TQKV_SERVER is not set to the tqkv-server binary");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' --listen 127.0.0.1:0 --namespace-policy 'team-*:key-bits=9' 2>&1; echo rc=$?",
             path);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    char out[4096];
    size_t len = fread(out, 1, sizeof out - 1, f);
    out[len] = '\0';
    pclose(f);
    ck_assert_msg(strstr(out, "--namespace-policy 'team-*:key-bits=9': key-bits: invalid value "
                              "'9'") != NULL,
                  "%s", out);
    ck_assert_msg(strstr(out, "rc=2") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "listening on") == NULL, "%s", out);
}
END_TEST

/* Empty variables are unset for every kind of option; TQKV_* names nobody reads are
 * reported (a misspelled variable would otherwise be silently ignored). */
START_TEST(test_env_empty_and_unknown)
{
    static tqkv_server_config_t cfg;
    char err[512], names[64];
    setenv("TQKV_KEY_BITS", "", 1);
    setenv("TQKV_DRAM_CAPACITY", "", 1);
    ck_assert_msg(parse(&cfg, err, sizeof err, 0) == TQKV_OK, "%s", err);
    ck_assert_uint_eq(cfg.policy.k.bits_x2, 6); /* the default, 3 bits */
    setenv("TQKV_KEY_BITS", "4", 1);
    ck_assert_msg(parse(&cfg, err, sizeof err, 0) == TQKV_OK, "%s", err);
    ck_assert_uint_eq(cfg.policy.k.bits_x2, 8);
    unsetenv("TQKV_KEY_BITS");
    unsetenv("TQKV_DRAM_CAPACITY");

    char *envp[] = {"PATH=/bin",       "TQKV_KEY_BITZ=3", "TQKV_KEY_BITS=3",
                    "TQKV_ISA=avx2",   "TQKV_=1",         "TQKV_NAMESPACE_POLICY",
                    "TQKV_LISTENER=x", "tqkv_key_bits=3", NULL};
    ck_assert_uint_eq(tqkv_config_unknown_env(envp, names, sizeof names), 3);
    ck_assert_str_eq(names, "TQKV_KEY_BITZ TQKV_ TQKV_LISTENER");
    /* a short buffer still counts them all and stays terminated */
    ck_assert_uint_eq(tqkv_config_unknown_env(envp, names, 16), 3);
    ck_assert_str_eq(names, "TQKV_KEY_BITZ");
    char *none[] = {"TQKV_KEY_BITS=3", "HOME=/", NULL};
    ck_assert_uint_eq(tqkv_config_unknown_env(none, names, sizeof names), 0);
    ck_assert_str_eq(names, "");
}
END_TEST

static Suite *
server_policy_suite(void)
{
    Suite *s = suite_create("server_policy");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_spec_good);
    tcase_add_test(tc, test_spec_lookup);
    tcase_add_test(tc, test_spec_env);
    tcase_add_test(tc, test_spec_bad);
    tcase_add_test(tc, test_spec_limit);
    tcase_add_test(tc, test_usage);
    tcase_add_test(tc, test_every_option_applies);
    tcase_add_test(tc, test_env_empty_and_unknown);
    suite_add_tcase(s, tc);
    tc = tcase_create("server");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_server_ns_policy);
    tcase_add_test(tc, test_server_bad_spec_exits);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(server_policy_suite)
