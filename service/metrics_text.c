/* metrics_text.c - the Prometheus text exposition of tqkv-server's metrics: the output
 * buffer (escaping label values to valid UTF-8, number formats, family headers) and the
 * families read at scrape time from the store (tqkv_store_stats, per tier and per
 * namespace) and from /proc/self (the standard process_* families).
 */
#include "service/metrics_text.h"
#include "service/metrics.h"
#include "cache/disk.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

void
tqkv__sb_reserve(tqkv__sbuf_t *b, size_t extra)
{
    if (b->oom || b->len + extra + 1 <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return;
    }
    b->p = p;
    b->cap = cap;
}

void
tqkv__sb_append(tqkv__sbuf_t *b, const char *s, size_t n)
{
    tqkv__sb_reserve(b, n);
    if (b->oom)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

/* Appends a string literal. */

void
tqkv__sb_printf(tqkv__sbuf_t *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    va_list ap;
    va_start(ap, fmt);
    char tmp[256];
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    if ((size_t)n < sizeof(tmp)) {
        tqkv__sb_append(b, tmp, (size_t)n);
        return;
    }
    tqkv__sb_reserve(b, (size_t)n);
    if (b->oom)
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Length of the valid UTF-8 sequence at s[0..n) (1..4), or 0 when invalid. */
static size_t
utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c == 0)
        return 0; /* NUL would end the C string the text is returned in */
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    unsigned cp = c & (0x7Fu >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

/* Appends a label value escaped per the text format: \ -> \\, " -> \", LF -> \n, and
 * invalid UTF-8 bytes -> U+FFFD. */
void
tqkv__sb_label_value(tqkv__sbuf_t *b, const char *v, size_t n)
{
    const unsigned char *s = (const unsigned char *)v;
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c == '\\') {
            SB_LIT(b, "\\\\");
            i++;
        } else if (c == '"') {
            SB_LIT(b, "\\\"");
            i++;
        } else if (c == '\n') {
            SB_LIT(b, "\\n");
            i++;
        } else {
            size_t k = utf8_seq(s + i, n - i);
            if (k == 0) {
                SB_LIT(b, "\xEF\xBF\xBD");
                i++;
            } else {
                tqkv__sb_append(b, v + i, k);
                i += k;
            }
        }
    }
}

void
tqkv__sb_family(tqkv__sbuf_t *b, const char *name, const char *type, const char *help)
{
    tqkv__sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A double sample value: integers exactly, others with full precision; NaN/Inf spelled
 * as the format wants. */
void
tqkv__sb_double(tqkv__sbuf_t *b, double v)
{
    if (isnan(v))
        SB_LIT(b, "NaN");
    else if (isinf(v))
        tqkv__sb_printf(b, "%s", v > 0 ? "+Inf" : "-Inf");
    else
        tqkv__sb_printf(b, "%.17g", v);
}

void
tqkv__sb_le(tqkv__sbuf_t *b, double le)
{
    /* %g gives the canonical short forms Prometheus clients use ("0.0001", "2.5", "10"). */
    tqkv__sb_printf(b, "%g", le);
}

static const char *const k_tier_names[TQKV_TIER_COUNT] = {"none", "hbm", "dram", "disk"};

typedef struct ns_snap {
    char *name;
    size_t len;
    tqkv_store_stats_t st;
} ns_snap_t;

typedef struct ns_collect {
    ns_snap_t *v;
    size_t n, cap;
    int oom;
} ns_collect_t;

static void
collect_ns(void *arg, const char *ns, size_t ns_len, const tqkv_store_stats_t *st)
{
    ns_collect_t *c = arg;
    if (c->oom)
        return;
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 16;
        ns_snap_t *v = realloc(c->v, cap * sizeof(*v));
        if (!v) {
            c->oom = 1;
            return;
        }
        c->v = v;
        c->cap = cap;
    }
    char *name = malloc(ns_len + 1);
    if (!name) {
        c->oom = 1;
        return;
    }
    if (ns_len)
        memcpy(name, ns, ns_len);
    name[ns_len] = '\0';
    c->v[c->n].name = name;
    c->v[c->n].len = ns_len;
    c->v[c->n].st = *st;
    c->n++;
}

int
tqkv__ns_name_cmp(const char *a, size_t alen, const char *b, size_t blen)
{
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

static int
cmp_snap(const void *a, const void *b)
{
    const ns_snap_t *x = a, *y = b;
    return tqkv__ns_name_cmp(x->name, x->len, y->name, y->len);
}

static void
render_tier_family(tqkv__sbuf_t *b, const tqkv_store_stats_t *st, const char *name,
                   const char *type, const char *help, size_t field_off)
{
    tqkv__sb_family(b, name, type, help);
    for (int t = TQKV_TIER_HBM; t < TQKV_TIER_COUNT; t++) {
        const uint64_t *v = (const uint64_t *)((const char *)&st->tier[t] + field_off);
        tqkv__sb_printf(b, "%s{tier=\"%s\"} %" PRIu64 "\n", name, k_tier_names[t], *v);
    }
}

void
tqkv__render_store(tqkv__sbuf_t *b, tqkv_store_t *store)
{
    tqkv_store_stats_t st;
    if (tqkv_store_stats(store, NULL, 0, &st) != TQKV_OK)
        return;
    render_tier_family(b, &st, "tqkv_tier_capacity_bytes", "gauge",
                       "Capacity of the tier in bytes of page data.",
                       offsetof(tqkv_tier_stats_t, capacity));
    render_tier_family(b, &st, "tqkv_tier_bytes", "gauge", "Bytes of page data held in the tier.",
                       offsetof(tqkv_tier_stats_t, bytes_used));
    render_tier_family(b, &st, "tqkv_tier_pages", "gauge", "Pages held in the tier.",
                       offsetof(tqkv_tier_stats_t, pages));
    render_tier_family(b, &st, "tqkv_tier_hits_total", "counter",
                       "Page gets served by the tier (sum over tiers: all page hits).",
                       offsetof(tqkv_tier_stats_t, hits));
    render_tier_family(b, &st, "tqkv_tier_evictions_total", "counter",
                       "Pages evicted from the tier.", offsetof(tqkv_tier_stats_t, evictions));
    render_tier_family(b, &st, "tqkv_tier_demotions_total", "counter",
                       "Pages demoted from the tier to the next one down.",
                       offsetof(tqkv_tier_stats_t, demotions));
    render_tier_family(b, &st, "tqkv_tier_promotions_total", "counter",
                       "Pages promoted into the tier.", offsetof(tqkv_tier_stats_t, promotions));

    /* Store-wide families only for what the tiers do not already say: a miss is in no tier;
     * page bytes (logical) differ from tier bytes (allocated); BF16 bytes are the numerator
     * of the compression ratio sum(tqkv_store_bf16_bytes) / sum(tqkv_store_page_bytes). */
    tqkv__sb_family(b, "tqkv_store_misses_total", "counter",
                    "Page gets that found the page in no tier.");
    tqkv__sb_printf(b, "tqkv_store_misses_total %" PRIu64 "\n", st.misses);
    tqkv__sb_family(b, "tqkv_store_page_bytes", "gauge", "Bytes of page data held, all tiers.");
    tqkv__sb_printf(b, "tqkv_store_page_bytes %" PRIu64 "\n", st.page_bytes);
    tqkv__sb_family(b, "tqkv_store_bf16_bytes", "gauge",
                    "BF16 bytes represented by the pages held now.");
    tqkv__sb_printf(b, "tqkv_store_bf16_bytes %" PRIu64 "\n", st.bf16_bytes);
    tqkv__sb_family(b, "tqkv_store_page_bytes_in_total", "counter", "Page bytes stored by puts.");
    tqkv__sb_printf(b, "tqkv_store_page_bytes_in_total %" PRIu64 "\n", st.bytes_in);
    tqkv__sb_family(b, "tqkv_store_page_bytes_out_total", "counter",
                    "Page bytes handed out by gets.");
    tqkv__sb_printf(b, "tqkv_store_page_bytes_out_total %" PRIu64 "\n", st.bytes_out);
    tqkv__sb_family(b, "tqkv_alloc_failures_total", "counter",
                    "Page allocations that failed (tier memory exhausted or fragmented).");
    tqkv__sb_printf(b, "tqkv_alloc_failures_total %" PRIu64 "\n", st.alloc_failures);

    tqkv_disk_stats_t ds;
    if (tqkv_store_disk_stats(store, &ds) == TQKV_OK) {
        static const struct {
            const char *name, *type, *help;
            size_t off;
        } dfams[] = {
            {"tqkv_tier_reads_total", "counter", "Read I/Os of the tier (records and scans).",
             offsetof(tqkv_disk_stats_t, reads)},
            {"tqkv_tier_read_bytes_total", "counter", "Bytes read from the tier.",
             offsetof(tqkv_disk_stats_t, read_bytes)},
            {"tqkv_tier_writes_total", "counter", "Write I/Os (batches) of the tier.",
             offsetof(tqkv_disk_stats_t, writes)},
            {"tqkv_tier_write_bytes_total", "counter", "Bytes written to the tier.",
             offsetof(tqkv_disk_stats_t, write_bytes)},
            {"tqkv_tier_syncs_total", "counter", "fdatasync calls of the tier.",
             offsetof(tqkv_disk_stats_t, syncs)},
            {"tqkv_tier_io_errors_total", "counter", "Failed reads and writes of the tier.",
             offsetof(tqkv_disk_stats_t, io_errors)},
            {"tqkv_tier_corrupt_records_total", "counter",
             "Records that failed a check (skipped, never served).",
             offsetof(tqkv_disk_stats_t, corrupt)},
            {"tqkv_tier_torn_records_total", "counter",
             "Torn records found at the end of segments at start-up.",
             offsetof(tqkv_disk_stats_t, torn)},
            {"tqkv_tier_compactions_total", "counter", "Segments compacted.",
             offsetof(tqkv_disk_stats_t, compactions)},
            {"tqkv_tier_index_bytes", "gauge", "RAM of the tier's index.",
             offsetof(tqkv_disk_stats_t, index_bytes)},
            {"tqkv_tier_relocations_total", "counter",
             "Records copied forward by the capacity reclaimer (leased and prefix records) "
             "instead of being dropped.",
             offsetof(tqkv_disk_stats_t, relocated_records)},
            {"tqkv_tier_relocated_bytes_total", "counter",
             "Bytes copied forward by the capacity reclaimer (leaf-first write amplification).",
             offsetof(tqkv_disk_stats_t, relocated_bytes)},
            {"tqkv_tier_lease_skips_total", "counter",
             "Times the capacity reclaimer passed a segment over: its leased records did not fit.",
             offsetof(tqkv_disk_stats_t, lease_skips)},
            {"tqkv_tier_refused_writes_total", "counter",
             "Records refused: the tier was full and everything droppable was leased.",
             offsetof(tqkv_disk_stats_t, refused_writes)},
            {"tqkv_tier_quota_drops_total", "counter",
             "Records dropped (and tombstoned) to keep namespaces within their quotas.",
             offsetof(tqkv_disk_stats_t, quota_drops)},
            {"tqkv_tier_leases", "gauge", "Lease entries held by the tier (Lookup lease_ms).",
             offsetof(tqkv_disk_stats_t, leases)},
        };
        for (size_t i = 0; i < sizeof(dfams) / sizeof(dfams[0]); i++) {
            tqkv__sb_family(b, dfams[i].name, dfams[i].type, dfams[i].help);
            tqkv__sb_printf(b, "%s{tier=\"disk\"} %" PRIu64 "\n", dfams[i].name,
                            *(const uint64_t *)((const char *)&ds + dfams[i].off));
        }
    }

    ns_collect_t c = {0};
    if (tqkv_store_foreach_namespace(store, collect_ns, &c) == TQKV_OK && !c.oom) {
        if (c.n > 1)
            qsort(c.v, c.n, sizeof(*c.v), cmp_snap);
        static const struct {
            const char *name, *type, *help;
            size_t off;
        } fams[] = {
            {"tqkv_tenant_page_bytes", "gauge", "Bytes of page data held for the tenant.",
             offsetof(tqkv_store_stats_t, page_bytes)},
            {"tqkv_tenant_pages", "gauge", "Pages held for the tenant.",
             offsetof(tqkv_store_stats_t, pages)},
        };
        for (size_t f = 0; f < sizeof(fams) / sizeof(fams[0]); f++) {
            tqkv__sb_family(b, fams[f].name, fams[f].type, fams[f].help);
            for (size_t i = 0; i < c.n; i++) {
                const uint64_t *v = (const uint64_t *)((const char *)&c.v[i].st + fams[f].off);
                tqkv__sb_printf(b, "%s{tenant=\"", fams[f].name);
                tqkv__sb_label_value(b, c.v[i].name, c.v[i].len);
                tqkv__sb_printf(b, "\"} %" PRIu64 "\n", *v);
            }
        }
    }
    for (size_t i = 0; i < c.n; i++)
        free(c.v[i].name);
    free(c.v);
}

/* Reads a whole small /proc file into buf (NUL-terminated); returns its length or -1. */
static ssize_t
read_proc(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = '\0';
    return (ssize_t)n;
}

/* The standard process_* families (names, units and meaning as in the official Prometheus
 * client libraries), from /proc/self at scrape time. A family whose source cannot be read
 * is left out rather than reported as 0; the start time falls back to the registry's. */
void
tqkv__render_process(tqkv__sbuf_t *b, double registry_start)
{
    char buf[4096];
    double cpu = -1, start = registry_start, vsize = -1, rss = -1;
    long tck = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    if (read_proc("/proc/self/stat", buf, sizeof buf) > 0 && tck > 0 && page > 0) {
        /* Fields after "pid (comm)": the comm may hold spaces and ')', so start after the
         * last ')'. Field 3 is state; utime 14, stime 15, starttime 22, vsize 23, rss 24. */
        const char *p = strrchr(buf, ')');
        unsigned long long f[25] = {0};
        int field = 3, ok = p != NULL;
        if (ok)
            p += 2; /* ") " */
        while (ok && field <= 24 && *p) {
            const char *sp = strchr(p, ' ');
            if (field >= 14)
                f[field] = strtoull(p, NULL, 10);
            field++;
            if (!sp)
                break;
            p = sp + 1;
        }
        if (ok && field > 24) {
            cpu = (double)(f[14] + f[15]) / (double)tck;
            vsize = (double)f[23];
            rss = (double)f[24] * (double)page;
            char st[8192];
            const char *bt;
            if (read_proc("/proc/stat", st, sizeof st) > 0 && (bt = strstr(st, "\nbtime ")))
                start = (double)strtoull(bt + 7, NULL, 10) + (double)f[22] / (double)tck;
        }
    }
    tqkv__sb_family(b, "process_start_time_seconds", "gauge",
                    "Start time of the process since unix epoch in seconds.");
    SB_LIT(b, "process_start_time_seconds ");
    tqkv__sb_double(b, start);
    SB_LIT(b, "\n");
    if (cpu >= 0) {
        tqkv__sb_family(b, "process_cpu_seconds_total", "counter",
                        "Total user and system CPU time spent in seconds.");
        SB_LIT(b, "process_cpu_seconds_total ");
        tqkv__sb_double(b, cpu);
        SB_LIT(b, "\n");
        tqkv__sb_family(b, "process_virtual_memory_bytes", "gauge",
                        "Virtual memory size in bytes.");
        SB_LIT(b, "process_virtual_memory_bytes ");
        tqkv__sb_double(b, vsize);
        SB_LIT(b, "\n");
        tqkv__sb_family(b, "process_resident_memory_bytes", "gauge",
                        "Resident memory size in bytes.");
        SB_LIT(b, "process_resident_memory_bytes ");
        tqkv__sb_double(b, rss);
        SB_LIT(b, "\n");
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        long n = 0;
        struct dirent *e;
        while ((e = readdir(d)) != NULL)
            if (e->d_name[0] != '.')
                n++;
        closedir(d);
        tqkv__sb_family(b, "process_open_fds", "gauge", "Number of open file descriptors.");
        tqkv__sb_printf(b, "process_open_fds %ld\n", n - 1); /* less the directory's own */
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        tqkv__sb_family(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
        SB_LIT(b, "process_max_fds ");
        tqkv__sb_double(b, rl.rlim_cur == RLIM_INFINITY ? INFINITY : (double)rl.rlim_cur);
        SB_LIT(b, "\n");
    }
}
