/* check_metrics.c - unit tests of service/metrics.c: exposition format, label escaping,
 * histogram buckets, store gauges, concurrency of the counters, and the HTTP endpoint.
 *
 * The store is a fake defined here (tqkv_store_stats / tqkv_store_foreach_namespace with
 * fixed numbers), so the rendering of every store family is checked exactly; the real
 * store is exercised by the server metrics test (tests/metrics_scrape.py).
 */
#include <arpa/inet.h>
#include <check.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "service/metrics.h"
#include "tests/check_main.h"
#include "tests/support/rng.h"
#include "tests/support/sanitize.h"

/* ---- fake store ---- */

struct tqkv_store {
    tqkv_store_stats_t all;
    int nns;
    const char *ns[3];
    size_t ns_len[3];
    tqkv_store_stats_t ns_st[3];
};

tqkv_status_t
tqkv_store_stats(tqkv_store_t *s, const char *ns, size_t ns_len, tqkv_store_stats_t *out)
{
    if (!s || !out)
        return TQKV_EINVAL;
    if (!ns) {
        *out = s->all;
        return TQKV_OK;
    }
    for (int i = 0; i < s->nns; i++)
        if (s->ns_len[i] == ns_len && memcmp(s->ns[i], ns, ns_len) == 0) {
            *out = s->ns_st[i];
            return TQKV_OK;
        }
    return TQKV_ENOTFOUND;
}

tqkv_status_t
tqkv_store_foreach_namespace(tqkv_store_t *s,
                             void (*fn)(void *arg, const char *ns, size_t ns_len,
                                        const tqkv_store_stats_t *st),
                             void *arg)
{
    for (int i = 0; i < s->nns; i++)
        fn(arg, s->ns[i], s->ns_len[i], &s->ns_st[i]);
    return TQKV_OK;
}

/* No disk tier in the fake (its families are checked against a real server in
 * tests/interop/disk_tier.py). */
tqkv_status_t
tqkv_store_disk_stats(tqkv_store_t *s, struct tqkv_disk_stats *out)
{
    (void)s;
    (void)out;
    return TQKV_ENOTFOUND;
}

/* ---- helpers ---- */

static uint64_t rng_state;

/* Value of the sample whose "name{labels}" is exactly series, or NAN when absent. */
static double
sample(const char *text, const char *series)
{
    size_t n = strlen(series);
    const char *p = text;
    while ((p = strstr(p, series)) != NULL) {
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
        p += n;
    }
    return NAN;
}

static int
count_lines_with(const char *text, const char *needle)
{
    int c = 0;
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p++)
        c++;
    return c;
}

/* Checks the exposition structure: every sample belongs to the family of the closest
 * preceding "# TYPE" (histograms: _bucket/_sum/_count), a family is declared once with
 * HELP then TYPE, and every line ends with '\n'. Returns NULL or a message. */
static const char *
check_structure(const char *text)
{
    static char why[256];
    char fam[128] = "", type[32] = "";
    char seen[512][128];
    int nseen = 0;
    const char *p = text;
    if (!*text || text[strlen(text) - 1] != '\n')
        return "does not end with a newline";
    while (*p) {
        const char *eol = strchr(p, '\n');
        size_t len = (size_t)(eol - p);
        char line[1024];
        if (len >= sizeof(line))
            return "line too long";
        memcpy(line, p, len);
        line[len] = '\0';
        p = eol + 1;
        if (strncmp(line, "# HELP ", 7) == 0) {
            char name[128];
            if (sscanf(line + 7, "%127s", name) != 1)
                return "bad HELP";
            for (int i = 0; i < nseen; i++)
                if (strcmp(seen[i], name) == 0) {
                    snprintf(why, sizeof(why), "family %s declared twice", name);
                    return why;
                }
            if (nseen < 512)
                snprintf(seen[nseen++], sizeof(seen[0]), "%s", name);
            snprintf(fam, sizeof(fam), "%s", name);
            type[0] = '\0';
            continue;
        }
        if (strncmp(line, "# TYPE ", 7) == 0) {
            char name[128];
            if (sscanf(line + 7, "%127s %31s", name, type) != 2 || strcmp(name, fam) != 0)
                return "TYPE does not follow its HELP";
            if (strcmp(type, "counter") && strcmp(type, "gauge") && strcmp(type, "histogram"))
                return "unknown TYPE";
            continue;
        }
        if (line[0] == '#')
            return "unexpected comment";
        if (!type[0])
            return "sample before TYPE";
        size_t nl = strcspn(line, "{ ");
        char name[128];
        snprintf(name, sizeof(name), "%.*s", (int)nl, line);
        int ok = strcmp(name, fam) == 0;
        if (!ok && strcmp(type, "histogram") == 0) {
            size_t fl = strlen(fam);
            ok = strncmp(name, fam, fl) == 0 &&
                 (!strcmp(name + fl, "_bucket") || !strcmp(name + fl, "_sum") ||
                  !strcmp(name + fl, "_count"));
        }
        if (!ok) {
            snprintf(why, sizeof(why), "sample %s outside its family %s", name, fam);
            return why;
        }
        const char *val = strrchr(line, ' ');
        char *end;
        if (!val)
            return "sample without value";
        if (strcmp(val + 1, "NaN") && strcmp(val + 1, "+Inf")) {
            strtod(val + 1, &end);
            if (*end) {
                snprintf(why, sizeof(why), "bad value in '%.200s'", line);
                return why;
            }
        }
    }
    return NULL;
}

/* ---- tests ---- */

static const char *const k_families[] = {"tqkv_build_info",
                                         "tqkv_requests_total",
                                         "tqkv_request_duration_seconds",
                                         "tqkv_bytes_received_total",
                                         "tqkv_bytes_sent_total",
                                         "tqkv_bf16_equivalent_bytes_delivered_total",
                                         "tqkv_codec_bytes_total",
                                         "tqkv_codec_seconds_total",
                                         "tqkv_active_streams",
                                         "tqkv_data_channels",
                                         "tqkv_tenant_hits_total",
                                         "tqkv_tenant_misses_total",
                                         "process_start_time_seconds",
                                         "process_cpu_seconds_total",
                                         "process_resident_memory_bytes",
                                         "process_virtual_memory_bytes",
                                         "process_open_fds",
                                         "process_max_fds"};

static const char *const k_store_families[] = {
    "tqkv_tier_capacity_bytes",   "tqkv_tier_bytes",           "tqkv_tier_pages",
    "tqkv_tier_hits_total",       "tqkv_tier_evictions_total", "tqkv_tier_demotions_total",
    "tqkv_tier_promotions_total", "tqkv_store_misses_total",   "tqkv_store_page_bytes",
    "tqkv_store_bf16_bytes",      "tqkv_tenant_page_bytes",    "tqkv_tenant_pages",
    "tqkv_alloc_failures_total"};

/* Families dropped because another family says the same (one family per concept), the
 * old tenant label name, and a ratio that cannot be summed across pods. */
static const char *const k_gone[] = {
    "tqkv_store_hits_total", "tqkv_tier_misses_total", "tqkv_store_evictions_total",
    "tqkv_store_pages ",     "tqkv_compression_ratio", "tqkv_namespace_",
    "namespace=\"",          "tqkv_process_"};

START_TEST(test_empty_registry_families)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    char *t = NULL;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    const char *why = check_structure(t);
    ck_assert_msg(why == NULL, "structure: %s\n%s", why, t);
    for (size_t i = 0; i < sizeof(k_families) / sizeof(k_families[0]); i++) {
        char h[160];
        snprintf(h, sizeof(h), "# TYPE %s ", k_families[i]);
        ck_assert_msg(strstr(t, h), "missing family %s", k_families[i]);
    }
    /* Without a store there are no store families. */
    ck_assert_ptr_null(strstr(t, "tqkv_tier_bytes"));
    ck_assert(strstr(t, "\ntqkv_build_info{version=\""));
    ck_assert(sample(t, "tqkv_active_streams") == 0.0);
    free(t);
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_metrics_render(NULL, NULL, &t), TQKV_EINVAL);
    tqkv_metrics_destroy(m);
    tqkv_metrics_destroy(NULL);
}
END_TEST

static const double k_le[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                              0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
static const char *const k_le_str[] = {"0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005",
                                       "0.01",   "0.025",   "0.05",   "0.1",   "0.25",   "0.5",
                                       "1",      "2.5",     "5",      "10"};

START_TEST(test_histogram_buckets_random)
{
    rng_state = tqkv_test_seed() ^ 0x1111;
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    uint64_t expect[17] = {0};
    double sum = 0;
    int n = 1000 + (int)(tqkv_test_rand(&rng_state) % 777);
    for (int i = 0; i < n; i++) {
        double s;
        switch (tqkv_test_rand(&rng_state) % 4) {
        case 0: /* exactly on a bound: le is inclusive */
            s = k_le[tqkv_test_rand(&rng_state) % 16];
            break;
        case 1: /* above the last bound */
            s = 10.0 + (double)(tqkv_test_rand(&rng_state) % 1000) / 10.0;
            break;
        default: /* log-uniform 10us .. 20s */
            s = 1e-5 * pow(2e6, (double)(tqkv_test_rand(&rng_state) >> 11) / 9007199254740992.0);
        }
        for (int b = 0; b < 16; b++)
            if (s <= k_le[b])
                expect[b]++;
        expect[16]++;
        sum += s;
        tqkv_metrics_rpc_done(m, "Get", 0, s);
    }
    tqkv_metrics_rpc_done(m, "Get", 99, -1.0); /* out-of-range code, negative time */
    tqkv_metrics_rpc_done(m, "Get", 3, NAN);   /* NaN time counts as 0 */
    for (int b = 0; b < 17; b++)
        expect[b] += 2;
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    const char *why = check_structure(t);
    ck_assert_msg(why == NULL, "structure: %s", why);
    char series[160];
    for (int b = 0; b < 17; b++) {
        snprintf(series, sizeof(series),
                 "tqkv_request_duration_seconds_bucket{method=\"Get\",le=\"%s\"}",
                 b < 16 ? k_le_str[b] : "+Inf");
        double v = sample(t, series);
        ck_assert_msg(v == (double)expect[b], "%s = %g, want %llu", series, v,
                      (unsigned long long)expect[b]);
    }
    ck_assert(sample(t, "tqkv_request_duration_seconds_count{method=\"Get\"}") == (double)(n + 2));
    double got_sum = sample(t, "tqkv_request_duration_seconds_sum{method=\"Get\"}");
    ck_assert_msg(fabs(got_sum - sum) <= 1e-9 * n + 1e-9 * sum, "sum %g want %g", got_sum, sum);
    ck_assert(sample(t, "tqkv_requests_total{method=\"Get\",code=\"OK\"}") == (double)n);
    ck_assert(sample(t, "tqkv_requests_total{method=\"Get\",code=\"UNKNOWN\"}") == 1.0);
    ck_assert(sample(t, "tqkv_requests_total{method=\"Get\",code=\"INVALID_ARGUMENT\"}") == 1.0);
    /* Codes never seen are not rendered (except OK). */
    ck_assert(isnan(sample(t, "tqkv_requests_total{method=\"Get\",code=\"DATA_LOSS\"}")));
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

START_TEST(test_label_escaping)
{
    tqkv_metrics_t *m;
    char *t, series[256];
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    /* quote, backslash, newline, valid 2- and 4-byte UTF-8, invalid bytes (lone
     * continuation, overlong, truncated sequence at the end) and an embedded NUL. */
    static const char ns2[] = "te\"n\\a\nnt-\xC3\xA9-\xF0\x9F\x98\x80-\x80-\xC0\xAF-\0z-\xE2\x82";
    tqkv_metrics_ns_access(m, ns2, sizeof(ns2) - 1, 5, 2);
    tqkv_metrics_ns_access(m, ns2, sizeof(ns2) - 1, 1, 1);
    tqkv_metrics_ns_access(m, "plain", 5, 3, 0);
    tqkv_metrics_ns_access(m, "plainX", 5, 4, 0);
    tqkv_metrics_rpc_done(m, "we\"ird\\", 0, 0.001);
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    const char *why = check_structure(t);
    ck_assert_msg(why == NULL, "structure: %s", why);
    snprintf(series, sizeof(series), "tqkv_tenant_hits_total{tenant=\"%s\"}",
             "te\\\"n\\\\a\\nnt-\xC3\xA9-\xF0\x9F\x98\x80-\xEF\xBF\xBD-\xEF\xBF\xBD\xEF\xBF\xBD-"
             "\xEF\xBF\xBDz-"
             "\xEF\xBF\xBD\xEF\xBF\xBD");
    ck_assert_msg(sample(t, series) == 6.0, "missing %s in\n%s", series, t);
    ck_assert(sample(t, "tqkv_tenant_misses_total{tenant=\"plain\"}") == 0.0);
    ck_assert(sample(t, "tqkv_tenant_hits_total{tenant=\"plain\"}") == 7.0);
    ck_assert(sample(t, "tqkv_requests_total{method=\"we\\\"ird\\\\\",code=\"OK\"}") == 1.0);
    /* No raw newline inside a label value: every line starts with '#', "tqkv_" or
     * "process_". */
    for (const char *p = t; *p; p = strchr(p, '\n') + 1)
        ck_assert_msg(*p == '#' || strncmp(p, "tqkv_", 5) == 0 || strncmp(p, "process_", 8) == 0,
                      "stray line: %.40s", p);
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

START_TEST(test_store_families)
{
    rng_state = tqkv_test_seed() ^ 0x2222;
    struct tqkv_store s;
    memset(&s, 0, sizeof(s));
    uint64_t vals[TQKV_TIER_COUNT][8];
    for (int t = 1; t < TQKV_TIER_COUNT; t++) {
        for (int k = 0; k < 8; k++)
            vals[t][k] = tqkv_test_rand(&rng_state) >> (tqkv_test_rand(&rng_state) % 64);
        tqkv_tier_stats_t *ts = &s.all.tier[t];
        ts->capacity = vals[t][0];
        ts->bytes_used = vals[t][1];
        ts->pages = vals[t][2];
        ts->hits = vals[t][3];
        ts->misses = vals[t][4];
        ts->evictions = vals[t][5];
        ts->demotions = vals[t][6];
        ts->promotions = vals[t][7];
    }
    s.all.page_bytes = 1000 + tqkv_test_rand(&rng_state) % 100000;
    s.all.bf16_bytes = s.all.page_bytes * 5 + tqkv_test_rand(&rng_state) % 1000;
    s.all.alloc_failures = 7;
    s.nns = 3;
    s.ns[0] = "zeta";
    s.ns[1] = "alpha\"q";
    s.ns[2] = "mid";
    for (int i = 0; i < 3; i++) {
        s.ns_len[i] = strlen(s.ns[i]);
        s.ns_st[i].page_bytes = 100u * (unsigned)(i + 1);
        s.ns_st[i].pages = (uint64_t)i + 1;
        s.ns_st[i].hits = 11u * (unsigned)(i + 1);
        s.ns_st[i].misses = 3u * (unsigned)i;
    }
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, &s, &t), TQKV_OK);
    const char *why = check_structure(t);
    ck_assert_msg(why == NULL, "structure: %s", why);
    for (size_t i = 0; i < sizeof(k_store_families) / sizeof(k_store_families[0]); i++) {
        char h[160];
        snprintf(h, sizeof(h), "# TYPE %s ", k_store_families[i]);
        ck_assert_msg(strstr(t, h), "missing family %s", k_store_families[i]);
    }
    static const char *const names[] = {"tqkv_tier_capacity_bytes",
                                        "tqkv_tier_bytes",
                                        "tqkv_tier_pages",
                                        "tqkv_tier_hits_total",
                                        NULL,
                                        "tqkv_tier_evictions_total",
                                        "tqkv_tier_demotions_total",
                                        "tqkv_tier_promotions_total"};
    static const char *const tiers[] = {"", "hbm", "dram", "disk"};
    char series[160], line[200];
    for (int tier = 1; tier < TQKV_TIER_COUNT; tier++)
        for (int k = 0; k < 8; k++) {
            if (!names[k])
                continue; /* tier misses: not exported (tqkv_store_misses_total is) */
            /* Compare as text: doubles cannot hold every uint64. */
            snprintf(line, sizeof(line), "\n%s{tier=\"%s\"} %llu\n", names[k], tiers[tier],
                     (unsigned long long)vals[tier][k]);
            ck_assert_msg(strstr(t, line), "missing %s", line + 1);
        }
    /* The compression ratio is left to the query: its two operands are exported. */
    snprintf(line, sizeof(line), "\ntqkv_store_bf16_bytes %llu\n",
             (unsigned long long)s.all.bf16_bytes);
    ck_assert_msg(strstr(t, line), "missing %s", line + 1);
    snprintf(line, sizeof(line), "\ntqkv_store_page_bytes %llu\n",
             (unsigned long long)s.all.page_bytes);
    ck_assert_msg(strstr(t, line), "missing %s", line + 1);
    ck_assert(sample(t, "tqkv_alloc_failures_total") == 7.0);
    snprintf(series, sizeof(series), "tqkv_tenant_page_bytes{tenant=\"alpha\\\"q\"}");
    ck_assert(sample(t, series) == 200.0);
    ck_assert(sample(t, "tqkv_tenant_pages{tenant=\"zeta\"}") == 1.0);
    for (size_t i = 0; i < sizeof(k_gone) / sizeof(k_gone[0]); i++)
        ck_assert_msg(strstr(t, k_gone[i]) == NULL, "%s is still exported", k_gone[i]);
    /* Tenants are sorted: alpha < mid < zeta within a family. */
    const char *a = strstr(t, "tqkv_tenant_pages{tenant=\"alpha");
    const char *b = strstr(t, "tqkv_tenant_pages{tenant=\"mid");
    const char *z = strstr(t, "tqkv_tenant_pages{tenant=\"zeta");
    ck_assert(a && b && z && a < b && b < z);
    free(t);

    /* Empty store: the families are still declared. */
    memset(&s, 0, sizeof(s));
    ck_assert_int_eq(tqkv_metrics_render(m, &s, &t), TQKV_OK);
    ck_assert(sample(t, "tqkv_store_page_bytes") == 0.0);
    ck_assert(strstr(t, "# TYPE tqkv_tenant_page_bytes gauge\n# HELP"));
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

START_TEST(test_process_families)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    /* The process (this test runner) started within the last hour, not in the future; the
     * clock-tick rounding of /proc allows 1 s. */
    double start = sample(t, "process_start_time_seconds");
    ck_assert_msg(start > (double)now.tv_sec - 3600 && start <= (double)now.tv_sec + 1,
                  "process_start_time_seconds %f, now %ld", start, (long)now.tv_sec);
    ck_assert(sample(t, "process_cpu_seconds_total") >= 0.0);
    double rss = sample(t, "process_resident_memory_bytes");
    double vm = sample(t, "process_virtual_memory_bytes");
    ck_assert_msg(rss > 1e5 && vm >= rss, "rss %g vm %g", rss, vm);
    struct rlimit rl;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    ck_assert(sample(t, "process_max_fds") == (double)rl.rlim_cur);
    double fds0 = sample(t, "process_open_fds");
    ck_assert(fds0 >= 3.0 && fds0 <= (double)rl.rlim_cur);
    free(t);
    /* Three more descriptors are counted as three more. */
    int fd[3];
    for (int i = 0; i < 3; i++)
        ck_assert_int_ge(fd[i] = dup(2), 0);
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    ck_assert_msg(sample(t, "process_open_fds") == fds0 + 3, "%g -> %g", fds0,
                  sample(t, "process_open_fds"));
    for (int i = 0; i < 3; i++)
        close(fd[i]);
    /* CPU time is a counter: burning some makes it grow, never shrink. */
    double cpu0 = sample(t, "process_cpu_seconds_total");
    free(t);
    volatile double x = 0;
    for (long i = 0; i < 40000000; i++)
        x += (double)i * 1e-9;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    ck_assert(sample(t, "process_cpu_seconds_total") > cpu0);
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

START_TEST(test_counters_and_gauges)
{
    rng_state = tqkv_test_seed() ^ 0x3333;
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    uint64_t in = 0, out = 0, bf = 0, eb = 0, db = 0;
    double es = 0, ds = 0;
    int streams = 0;
    for (int i = 0; i < 200; i++) {
        uint64_t a = tqkv_test_rand(&rng_state) % 100000, b = tqkv_test_rand(&rng_state) % 100000,
                 c = tqkv_test_rand(&rng_state) % 1000000;
        tqkv_metrics_add_bytes(m, a, b, c);
        in += a;
        out += b;
        bf += c;
        uint64_t x = tqkv_test_rand(&rng_state) % 1000000;
        double sec = (double)(tqkv_test_rand(&rng_state) % 1000) * 1e-6;
        int enc = (int)(tqkv_test_rand(&rng_state) & 1);
        tqkv_metrics_codec(m, enc ? 7 : 0, x, sec);
        if (enc) {
            eb += x;
            es += sec;
        } else {
            db += x;
            ds += sec;
        }
        int d = (tqkv_test_rand(&rng_state) % 3 == 0) ? -1 : 1;
        tqkv_metrics_streams(m, d);
        tqkv_metrics_data_channels(m, -d);
        streams += d;
    }
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    ck_assert(sample(t, "tqkv_bytes_received_total") == (double)in);
    ck_assert(sample(t, "tqkv_bytes_sent_total") == (double)out);
    ck_assert(sample(t, "tqkv_bf16_equivalent_bytes_delivered_total") == (double)bf);
    ck_assert(sample(t, "tqkv_codec_bytes_total{op=\"encode\"}") == (double)eb);
    ck_assert(sample(t, "tqkv_codec_bytes_total{op=\"decode\"}") == (double)db);
    ck_assert(fabs(sample(t, "tqkv_codec_seconds_total{op=\"encode\"}") - es) < 1e-6);
    ck_assert(fabs(sample(t, "tqkv_codec_seconds_total{op=\"decode\"}") - ds) < 1e-6);
    ck_assert(sample(t, "tqkv_active_streams") == (double)streams);
    ck_assert(sample(t, "tqkv_data_channels") == -(double)streams);
    ck_assert(sample(t, "tqkv_credential_load_timestamp_seconds{file=\"tokens\"}") == 0.0);
    free(t);
    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0);
    tqkv_metrics_reload(m, 0, 1);
    tqkv_metrics_reload(m, 0, 0);
    tqkv_metrics_reload(m, 0, 0);
    tqkv_metrics_reload(m, 1, 1);
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    ck_assert(sample(t, "tqkv_credential_reloads_total{file=\"tokens\",result=\"ok\"}") == 1.0);
    ck_assert(sample(t, "tqkv_credential_reloads_total{file=\"tokens\",result=\"rejected\"}") ==
              2.0);
    ck_assert(sample(t, "tqkv_credential_reloads_total{file=\"tls\",result=\"ok\"}") == 1.0);
    ck_assert(sample(t, "tqkv_credential_reloads_total{file=\"tls\",result=\"rejected\"}") == 0.0);
    double lt = sample(t, "tqkv_credential_load_timestamp_seconds{file=\"tokens\"}");
    ck_assert_msg(lt >= (double)t0.tv_sec && lt < (double)t0.tv_sec + 60, "%f", lt);
    free(t);
    /* NULL registry is tolerated by the hot-path calls. */
    tqkv_metrics_add_bytes(NULL, 1, 1, 1);
    tqkv_metrics_rpc_done(NULL, "Put", 0, 1);
    tqkv_metrics_codec(NULL, 1, 1, 1);
    tqkv_metrics_streams(NULL, 1);
    tqkv_metrics_data_channels(NULL, 1);
    tqkv_metrics_ns_access(NULL, "a", 1, 1, 1);
    tqkv_metrics_destroy(m);
}
END_TEST

START_TEST(test_cardinality_caps)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    char ns[32];
    for (int i = 0; i < 4096 + 25; i++) {
        int n = snprintf(ns, sizeof(ns), "ns-%05d", i);
        tqkv_metrics_ns_access(m, ns, (size_t)n, 1, 0);
    }
    for (int i = 0; i < 80; i++) {
        char meth[32];
        snprintf(meth, sizeof(meth), "M%d", i);
        tqkv_metrics_rpc_done(m, meth, 0, 0.01);
    }
    char longname[100];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[99] = '\0';
    tqkv_metrics_rpc_done(m, longname, 0, 0.01);
    tqkv_metrics_rpc_done(m, NULL, 0, 0.01);
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    ck_assert_int_eq(count_lines_with(t, "\ntqkv_tenant_hits_total{"), 4097);
    ck_assert(sample(t, "tqkv_tenant_hits_total{tenant=\"__other__\"}") == 25.0);
    ck_assert(sample(t, "tqkv_tenant_hits_total{tenant=\"ns-04095\"}") == 1.0);
    ck_assert(isnan(sample(t, "tqkv_tenant_hits_total{tenant=\"ns-04096\"}")));
    /* 64 methods ("M0".."M63") plus "other" for M64..M79 and the long name; the NULL name
     * became "unknown" but the table was full, so it is "other" as well. */
    ck_assert_int_eq(count_lines_with(t, "\ntqkv_requests_total{"), 65);
    ck_assert(sample(t, "tqkv_requests_total{method=\"other\",code=\"OK\"}") == 18.0);
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

typedef struct worker_arg {
    tqkv_metrics_t *m;
    int id, iters;
} worker_arg_t;

static void *
worker(void *p)
{
    worker_arg_t *a = p;
    static const char *const methods[] = {"Put", "Get", "Lookup"};
    char ns[16];
    for (int i = 0; i < a->iters; i++) {
        tqkv_metrics_rpc_done(a->m, methods[i % 3], i % 5 == 0 ? 8 : 0, 0.0003);
        tqkv_metrics_add_bytes(a->m, 1, 2, 3);
        int n = snprintf(ns, sizeof(ns), "ns%d", (i + a->id) % 7);
        tqkv_metrics_ns_access(a->m, ns, (size_t)n, 1, 2);
        tqkv_metrics_streams(a->m, 1);
        tqkv_metrics_streams(a->m, -1);
        if (i % 256 == 0 && a->id == 0) {
            char *t;
            if (tqkv_metrics_render(a->m, NULL, &t) == TQKV_OK)
                free(t);
        }
    }
    return NULL;
}

START_TEST(test_concurrent_updates)
{
    int iters = tqkv_test_sanitized() ? 3000 : 30000;
    enum { NT = 4 };
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    pthread_t th[NT];
    worker_arg_t args[NT];
    for (int i = 0; i < NT; i++) {
        args[i] = (worker_arg_t){m, i, iters};
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < NT; i++)
        pthread_join(th[i], NULL);
    char *t;
    ck_assert_int_eq(tqkv_metrics_render(m, NULL, &t), TQKV_OK);
    double total = 0, hits = 0;
    static const char *const methods[] = {"Put", "Get", "Lookup"};
    char series[128];
    for (int k = 0; k < 3; k++) {
        snprintf(series, sizeof(series), "tqkv_requests_total{method=\"%s\",code=\"OK\"}",
                 methods[k]);
        total += sample(t, series);
        snprintf(series, sizeof(series),
                 "tqkv_requests_total{method=\"%s\",code=\"RESOURCE_EXHAUSTED\"}", methods[k]);
        total += sample(t, series);
        snprintf(series, sizeof(series),
                 "tqkv_request_duration_seconds_bucket{method=\"%s\",le=\"0.00025\"}", methods[k]);
        ck_assert(sample(t, series) == 0.0);
    }
    for (int k = 0; k < 7; k++) {
        snprintf(series, sizeof(series), "tqkv_tenant_hits_total{tenant=\"ns%d\"}", k);
        hits += sample(t, series);
    }
    ck_assert(total == (double)(NT * iters));
    ck_assert(hits == (double)(NT * iters));
    ck_assert(sample(t, "tqkv_bytes_sent_total") == 2.0 * NT * iters);
    ck_assert(sample(t, "tqkv_active_streams") == 0.0);
    free(t);
    tqkv_metrics_destroy(m);
}
END_TEST

/* Sends req to 127.0.0.1:port and returns the whole response (malloc'd) or NULL. */
static char *
http(int port, const char *req)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return NULL;
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return NULL;
    }
    size_t rl = strlen(req);
    if (write(fd, req, rl) != (ssize_t)rl) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

START_TEST(test_http_endpoint)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    tqkv_metrics_rpc_done(m, "Lookup", 0, 0.002);
    tqkv_metrics_ns_access(m, "tenant", 6, 9, 1);
    struct tqkv_store s;
    memset(&s, 0, sizeof(s));
    s.all.tier[TQKV_TIER_DRAM].capacity = 12345;
    int port = -1;
    ck_assert_int_eq(tqkv_metrics_serve(m, "127.0.0.1:0", &s, &port), TQKV_OK);
    ck_assert_int_gt(port, 0);
    ck_assert_int_eq(tqkv_metrics_serve(m, "127.0.0.1:0", &s, NULL), TQKV_EBUSY);
    ck_assert_str_eq(tqkv_metrics_error(m), "already serving");

    char *r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    ck_assert_ptr_nonnull(r);
    ck_assert_msg(strncmp(r, "HTTP/1.0 200", 12) == 0 || strncmp(r, "HTTP/1.1 200", 12) == 0,
                  "%.60s", r);
    ck_assert(strstr(r, "text/plain; version=0.0.4"));
    char *body = strstr(r, "\r\n\r\n");
    ck_assert_ptr_nonnull(body);
    body += 4;
    const char *why = check_structure(body);
    ck_assert_msg(why == NULL, "structure: %s", why);
    ck_assert(sample(body, "tqkv_requests_total{method=\"Lookup\",code=\"OK\"}") == 1.0);
    ck_assert(sample(body, "tqkv_tenant_misses_total{tenant=\"tenant\"}") == 1.0);
    ck_assert(sample(body, "tqkv_tier_capacity_bytes{tier=\"dram\"}") == 12345.0);
    free(r);

    r = http(port, "GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    ck_assert_ptr_nonnull(r);
    ck_assert(strncmp(r, "HTTP/1.1 200", 12) == 0);
    free(r);
    /* Probes: alive; not ready without a ready callback. */
    r = http(port, "GET /livez HTTP/1.0\r\n\r\n");
    ck_assert_msg(r && strstr(r, " 200 ") && strstr(r, "\r\n\r\nok\n"), "%s", r ? r : "");
    free(r);
    r = http(port, "GET /readyz HTTP/1.0\r\n\r\n");
    ck_assert_msg(r && strstr(r, " 503 "), "%s", r ? r : "");
    free(r);
    r = http(port, "GET / HTTP/1.0\r\n\r\n");
    ck_assert_ptr_nonnull(r);
    ck_assert_msg(strstr(r, " 404 ") != NULL, "%.60s", r);
    free(r);
    r = http(port, "GET /metricsx HTTP/1.0\r\n\r\n");
    ck_assert(r && strstr(r, " 404 "));
    free(r);
    r = http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc");
    ck_assert_ptr_nonnull(r);
    ck_assert_msg(strstr(r, " 405 ") != NULL, "%.60s", r);
    ck_assert(strstr(r, "Allow: GET"));
    free(r);
    r = http(port, "DELETE /metrics HTTP/1.0\r\n\r\n");
    ck_assert(r && strstr(r, " 405 "));
    free(r);

    /* A second registry cannot take the same port. */
    tqkv_metrics_t *m2;
    ck_assert_int_eq(tqkv_metrics_create(&m2), TQKV_OK);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ck_assert_int_eq(tqkv_metrics_serve(m2, addr, NULL, NULL), TQKV_EIO);
    tqkv_metrics_destroy(m2);
    tqkv_metrics_destroy(m); /* stops the daemon */
    r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    ck_assert_ptr_null(r);
}
END_TEST

START_TEST(test_listen_address_parsing)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    static const char *const bad[] = {
        "",         "9090",      "127.0.0.1", "127.0.0.1:", "127.0.0.1:x1", "127.0.0.1:70000",
        "::1:9090", "[::1]9090",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(tqkv_metrics_serve(m, bad[i], NULL, NULL) == TQKV_EINVAL, "accepted '%s'",
                      bad[i]);
    ck_assert_int_eq(tqkv_metrics_serve(m, NULL, NULL, NULL), TQKV_EINVAL);
    int port = 0;
    /* ":0" means loopback. */
    ck_assert_int_eq(tqkv_metrics_serve(m, ":0", NULL, &port), TQKV_OK);
    ck_assert_int_gt(port, 0);
    char *r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    ck_assert(r && strstr(r, " 200 "));
    free(r);
    tqkv_metrics_destroy(m);
    /* IPv6 loopback, when the host has it. */
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    tqkv_status_t st = tqkv_metrics_serve(m, "[::1]:0", NULL, &port);
    ck_assert(st == TQKV_OK || st == TQKV_EIO);
    tqkv_metrics_destroy(m);
}
END_TEST

static atomic_int g_ready;

static int
ready_fn(void *arg)
{
    ck_assert_ptr_eq(arg, &g_ready);
    return atomic_load(&g_ready);
}

START_TEST(test_http_readyz)
{
    tqkv_metrics_t *m;
    ck_assert_int_eq(tqkv_metrics_create(&m), TQKV_OK);
    tqkv_metrics_set_ready(m, ready_fn, &g_ready);
    int port = -1;
    ck_assert_int_eq(tqkv_metrics_serve(m, "127.0.0.1:0", NULL, &port), TQKV_OK);
    for (int round = 0; round < 3; round++) {
        int ready = round == 1;
        atomic_store(&g_ready, ready);
        char *r = http(port, "GET /readyz HTTP/1.0\r\n\r\n");
        ck_assert_msg(r && strstr(r, ready ? " 200 " : " 503 "), "%s", r ? r : "");
        ck_assert(strstr(r, ready ? "\r\n\r\nready\n" : "\r\n\r\nnot serving\n"));
        free(r);
    }
    char *r = http(port, "POST /readyz HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
    ck_assert(r && strstr(r, " 405 "));
    free(r);
    tqkv_metrics_destroy(m);
}
END_TEST

static Suite *
metrics_suite(void)
{
    Suite *s = suite_create("metrics");
    TCase *tc = tcase_create("render");
    tcase_add_test(tc, test_empty_registry_families);
    tcase_add_test(tc, test_histogram_buckets_random);
    tcase_add_test(tc, test_label_escaping);
    tcase_add_test(tc, test_store_families);
    tcase_add_test(tc, test_process_families);
    tcase_add_test(tc, test_counters_and_gauges);
    tcase_add_test(tc, test_cardinality_caps);
    tcase_add_test(tc, test_concurrent_updates);
    suite_add_tcase(s, tc);
    TCase *th = tcase_create("http");
    tcase_add_test(th, test_http_endpoint);
    tcase_add_test(th, test_http_readyz);
    tcase_add_test(th, test_listen_address_parsing);
    suite_add_tcase(s, th);
    return s;
}

TQKV_CHECK_MAIN(metrics_suite)
