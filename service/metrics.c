/* metrics.c - Prometheus registry of tqkv-server and its /metrics endpoint (libmicrohttpd).
 *
 * The exposition text (escaping, number formats) and the families read from the store and
 * /proc at scrape time are in metrics_text.c; this file holds the registry, the families of
 * its own counters and the HTTP endpoint.
 *
 * Conventions: the tenant label is `tenant` (a tqkv namespace; `namespace` would collide with
 * the Kubernetes label Prometheus attaches to every target), the process is described by the
 * standard process_* families (read from /proc at scrape time, as the official client
 * libraries do), and each concept has one family: per-tier series are not repeated as store
 * totals (sum them), and ratios are left to the query (sum(rate(a)) / sum(rate(b))), so that
 * they add up across pods.
 *
 * Design: fixed counters (bytes, codec work, active streams) are plain C11 atomics. Per-method
 * RPC counters and latency histograms, and per-tenant hit/miss counters, live in entries
 * that are created once under a mutex and never freed before tqkv_metrics_destroy(); the
 * mutex only guards the lookup tables (finding or inserting an entry), the counters inside
 * an entry are atomics updated without it. Rendering takes the same mutexes to walk the
 * tables, so a scrape never sees a half-inserted entry. Store gauges are read from the store
 * (tqkv_store_stats / tqkv_store_foreach_namespace) at scrape time.
 *
 * Cardinality: at most TQKV_METRICS_MAX_METHODS methods and TQKV_METRICS_MAX_NAMESPACES
 * tenants get their own series; later ones are counted under method="other" /
 * tenant="__other__", so a client inventing namespaces cannot grow the registry forever.
 *
 * Exposition: text format 0.0.4. Label values are escaped (\\, \", \n) and bytes that are
 * not valid UTF-8 (and NUL) are replaced by U+FFFD, because Prometheus requires UTF-8 label values.
 *
 * Locking order: methods_mu and ns_mu are leaves (never held together, never held while
 * calling into the store).
 */
#include "service/metrics.h"
#include "service/metrics_text.h"
#include "cache/disk.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#ifndef TQKV_VERSION
#define TQKV_VERSION "0.1.0"
#endif

#define TQKV_METRICS_MAX_METHODS 64
#define TQKV_METRICS_MAX_NAMESPACES 4096
#define NS_BUCKETS 1024
#define GRPC_CODES 17

/* Upper bounds (seconds) of tqkv_request_duration_seconds, 100us .. 10s; +Inf implied. */
static const double k_buckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                   0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
#define NBUCKETS (sizeof(k_buckets) / sizeof(k_buckets[0]))

static const char *const k_code_names[GRPC_CODES] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

typedef struct method_entry {
    char name[48];
    _Atomic uint64_t codes[GRPC_CODES];
    _Atomic uint64_t buckets[NBUCKETS + 1]; /* non-cumulative; last is (10s, +Inf) */
    _Atomic uint64_t sum_ns;
} method_entry_t;

typedef struct ns_entry {
    struct ns_entry *next; /* bucket chain, guarded by ns_mu */
    char *name;            /* owned, ns_len bytes (+ NUL) */
    size_t len;
    _Atomic uint64_t hits, misses;
} ns_entry_t;

struct tqkv_metrics {
    char node_id[256]; /* set once before serving */
    _Atomic uint64_t bytes_in, bytes_out, bf16_out;
    _Atomic uint64_t handoff_pages, handoff_bytes;
    _Atomic uint64_t repl_passes, repl_pages, repl_bytes, peer_hellos;
    _Atomic uint64_t fwd_calls[3], fwd_blocks[3];                     /* TQKV_METRICS_FWD_* */
    _Atomic uint64_t rt_calls[3], rt_asked[3], rt_found[3], rt_bytes; /* read-through */
    _Atomic uint64_t codec_bytes[2];                                  /* [0] decode, [1] encode */
    _Atomic uint64_t codec_ns[2];
    _Atomic int64_t streams;
    _Atomic int64_t data_channels;
    _Atomic uint64_t dc_handshake_failures;
    _Atomic(const char *) dc_path; /* data channel security (static string), NULL: none */
    double start_time;             /* unix seconds */

    pthread_mutex_t methods_mu; /* guards methods[]/nmethods (not the counters inside) */
    method_entry_t *methods[TQKV_METRICS_MAX_METHODS + 1]; /* +1: "other" */
    size_t nmethods;

    pthread_mutex_t ns_mu; /* guards ns_buckets chains, ns_count */
    ns_entry_t *ns_buckets[NS_BUCKETS];
    size_t ns_count;
    ns_entry_t *ns_other; /* created on first overflow */

    _Atomic uint64_t reloads[2][2];   /* [file: 0 tokens, 1 tls][0 ok, 1 rejected] */
    _Atomic uint64_t reload_ok_ns[2]; /* unix time of the last successful (re)load, ns */
    char err[320];                    /* why tqkv_metrics_serve failed */

    int (*ready)(void *); /* /readyz (NULL: not ready) */
    void *ready_arg;
    struct MHD_Daemon *daemon; /* NULL until tqkv_metrics_serve */
    tqkv_store_t *store;       /* borrowed, read by the HTTP thread */
};

/* ---- registry ---- */

void
tqkv_metrics_set_node_id(tqkv_metrics_t *m, const char *node_id)
{
    if (m && node_id)
        snprintf(m->node_id, sizeof m->node_id, "%s", node_id);
}

tqkv_status_t
tqkv_metrics_create(tqkv_metrics_t **out)
{
    if (!out)
        return TQKV_EINVAL;
    tqkv_metrics_t *m = calloc(1, sizeof(*m));
    if (!m)
        return TQKV_ENOMEM;
    if (pthread_mutex_init(&m->methods_mu, NULL) != 0)
        goto fail_methods;
    if (pthread_mutex_init(&m->ns_mu, NULL) != 0)
        goto fail_ns;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    m->start_time = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    *out = m;
    return TQKV_OK;
fail_ns:
    pthread_mutex_destroy(&m->methods_mu);
fail_methods:
    free(m);
    return TQKV_ENOMEM;
}

void
tqkv_metrics_destroy(tqkv_metrics_t *m)
{
    if (!m)
        return;
    if (m->daemon)
        MHD_stop_daemon(m->daemon);
    for (size_t i = 0; i < m->nmethods; i++)
        free(m->methods[i]);
    for (size_t b = 0; b < NS_BUCKETS; b++) {
        ns_entry_t *e = m->ns_buckets[b];
        while (e) {
            ns_entry_t *next = e->next;
            free(e->name);
            free(e);
            e = next;
        }
    }
    if (m->ns_other) {
        free(m->ns_other->name);
        free(m->ns_other);
    }
    pthread_mutex_destroy(&m->ns_mu);
    pthread_mutex_destroy(&m->methods_mu);
    free(m);
}

/* Finds or creates the entry of method; returns borrowed (valid until destroy), or NULL
 * when out of memory. */
static method_entry_t *
method_get(tqkv_metrics_t *m, const char *method)
{
    if (!method || !*method)
        method = "unknown";
    method_entry_t *found = NULL;
    pthread_mutex_lock(&m->methods_mu);
    for (int pass = 0; pass < 2 && !found; pass++) {
        for (size_t i = 0; i < m->nmethods; i++) {
            if (strcmp(m->methods[i]->name, method) == 0) {
                found = m->methods[i];
                break;
            }
        }
        if (found)
            break;
        if (pass == 0 && strlen(method) < sizeof(found->name) &&
            m->nmethods < TQKV_METRICS_MAX_METHODS) {
            found = calloc(1, sizeof(*found));
            if (found) {
                memcpy(found->name, method, strlen(method) + 1);
                m->methods[m->nmethods++] = found;
            }
            break;
        }
        if (pass == 0) {
            method = "other"; /* too long or too many: search for, else create, "other" */
        } else if (m->nmethods < TQKV_METRICS_MAX_METHODS + 1) {
            found = calloc(1, sizeof(*found));
            if (found) {
                memcpy(found->name, "other", 6);
                m->methods[m->nmethods++] = found;
            }
        }
    }
    pthread_mutex_unlock(&m->methods_mu);
    return found;
}

void
tqkv_metrics_rpc_done(tqkv_metrics_t *m, const char *method, int grpc_code, double seconds)
{
    if (!m)
        return;
    method_entry_t *e = method_get(m, method);
    if (!e)
        return;
    if (grpc_code < 0 || grpc_code >= GRPC_CODES)
        grpc_code = 2;     /* UNKNOWN */
    if (!(seconds >= 0.0)) /* negative or NaN */
        seconds = 0.0;
    size_t b = 0;
    while (b < NBUCKETS && seconds > k_buckets[b])
        b++;
    atomic_fetch_add_explicit(&e->codes[grpc_code], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->buckets[b], 1, memory_order_relaxed);
    double ns = seconds * 1e9;
    uint64_t ins = ns >= 1.8e19 ? UINT64_C(18000000000000000000) : (uint64_t)ns;
    atomic_fetch_add_explicit(&e->sum_ns, ins, memory_order_relaxed);
}

void
tqkv_metrics_add_bytes(tqkv_metrics_t *m, uint64_t in, uint64_t out, uint64_t bf16_equiv_out)
{
    if (!m)
        return;
    atomic_fetch_add_explicit(&m->bytes_in, in, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->bytes_out, out, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->bf16_out, bf16_equiv_out, memory_order_relaxed);
}

void
tqkv_metrics_codec(tqkv_metrics_t *m, int encode, uint64_t bf16_bytes, double seconds)
{
    if (!m)
        return;
    int i = encode ? 1 : 0;
    if (!(seconds >= 0.0))
        seconds = 0.0;
    atomic_fetch_add_explicit(&m->codec_bytes[i], bf16_bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->codec_ns[i], (uint64_t)(seconds * 1e9), memory_order_relaxed);
}

const char *
tqkv_metrics_error(const tqkv_metrics_t *m)
{
    return m && m->err[0] ? m->err : "no error";
}

void
tqkv_metrics_set_ready(tqkv_metrics_t *m, int (*ready)(void *arg), void *arg)
{
    if (!m)
        return;
    m->ready = ready;
    m->ready_arg = arg;
}

void
tqkv_metrics_reload(tqkv_metrics_t *m, int tls, int ok)
{
    if (!m)
        return;
    int f = tls ? 1 : 0;
    atomic_fetch_add_explicit(&m->reloads[f][ok ? 0 : 1], 1, memory_order_relaxed);
    if (ok) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        atomic_store_explicit(&m->reload_ok_ns[f],
                              (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec,
                              memory_order_relaxed);
    }
}

void
tqkv_metrics_streams(tqkv_metrics_t *m, int delta)
{
    if (!m)
        return;
    atomic_fetch_add_explicit(&m->streams, (int64_t)delta, memory_order_relaxed);
}

void
tqkv_metrics_data_channel_path(tqkv_metrics_t *m, const char *path)
{
    if (m)
        atomic_store(&m->dc_path, path);
}

void
tqkv_metrics_data_channel_handshake_failed(tqkv_metrics_t *m)
{
    if (m)
        atomic_fetch_add_explicit(&m->dc_handshake_failures, 1, memory_order_relaxed);
}

void
tqkv_metrics_data_channels(tqkv_metrics_t *m, int delta)
{
    if (!m)
        return;
    atomic_fetch_add_explicit(&m->data_channels, (int64_t)delta, memory_order_relaxed);
}

void
tqkv_metrics_handoff(tqkv_metrics_t *m, uint64_t pages, uint64_t bytes)
{
    if (!m)
        return;
    atomic_fetch_add_explicit(&m->handoff_pages, pages, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->handoff_bytes, bytes, memory_order_relaxed);
}

void
tqkv_metrics_replicate(tqkv_metrics_t *m, uint64_t pages, uint64_t bytes)
{
    if (!m)
        return;
    atomic_fetch_add_explicit(&m->repl_passes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->repl_pages, pages, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->repl_bytes, bytes, memory_order_relaxed);
}

void
tqkv_metrics_peer_hello(tqkv_metrics_t *m)
{
    if (m)
        atomic_fetch_add_explicit(&m->peer_hellos, 1, memory_order_relaxed);
}

void
tqkv_metrics_forwarded(tqkv_metrics_t *m, int method, uint64_t blocks)
{
    if (!m || method < 0 || method > 2)
        return;
    atomic_fetch_add_explicit(&m->fwd_calls[method], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->fwd_blocks[method], blocks, memory_order_relaxed);
}

void
tqkv_metrics_readthru(tqkv_metrics_t *m, int method, uint64_t asked, uint64_t found, uint64_t bytes)
{
    if (!m || method < 1 || method > 2)
        return;
    atomic_fetch_add_explicit(&m->rt_calls[method], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->rt_asked[method], asked, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->rt_found[method], found, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->rt_bytes, bytes, memory_order_relaxed);
}

static uint64_t
ns_hash(const char *ns, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)ns[i];
        h *= 1099511628211ull;
    }
    return h;
}

static ns_entry_t *
ns_entry_new(const char *ns, size_t len)
{
    ns_entry_t *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    e->name = malloc(len + 1);
    if (!e->name) {
        free(e);
        return NULL;
    }
    memcpy(e->name, ns, len);
    e->name[len] = '\0';
    e->len = len;
    return e;
}

void
tqkv_metrics_ns_access(tqkv_metrics_t *m, const char *ns, size_t ns_len, uint64_t hits,
                       uint64_t misses)
{
    if (!m || (!ns && ns_len))
        return;
    if (!ns)
        ns = "";
    size_t b = (size_t)(ns_hash(ns, ns_len) % NS_BUCKETS);
    ns_entry_t *e;
    pthread_mutex_lock(&m->ns_mu);
    for (e = m->ns_buckets[b]; e; e = e->next)
        if (e->len == ns_len && memcmp(e->name, ns, ns_len) == 0)
            break;
    if (!e) {
        if (m->ns_count < TQKV_METRICS_MAX_NAMESPACES) {
            e = ns_entry_new(ns, ns_len);
            if (e) {
                e->next = m->ns_buckets[b];
                m->ns_buckets[b] = e;
                m->ns_count++;
            }
        } else {
            if (!m->ns_other)
                m->ns_other = ns_entry_new("__other__", 9);
            e = m->ns_other;
        }
    }
    pthread_mutex_unlock(&m->ns_mu);
    if (!e)
        return;
    atomic_fetch_add_explicit(&e->hits, hits, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->misses, misses, memory_order_relaxed);
}

static int
cmp_ns_entry(const void *a, const void *b)
{
    const ns_entry_t *x = *(const ns_entry_t *const *)a, *y = *(const ns_entry_t *const *)b;
    return tqkv__ns_name_cmp(x->name, x->len, y->name, y->len);
}

static void
render_ns_access(tqkv__sbuf_t *b, tqkv_metrics_t *m)
{
    pthread_mutex_lock(&m->ns_mu);
    size_t n = m->ns_count + (m->ns_other ? 1 : 0);
    ns_entry_t **v = n ? malloc(n * sizeof(*v)) : NULL;
    size_t k = 0;
    if (v) {
        for (size_t i = 0; i < NS_BUCKETS; i++)
            for (ns_entry_t *e = m->ns_buckets[i]; e; e = e->next)
                v[k++] = e;
        if (m->ns_other)
            v[k++] = m->ns_other;
    } else if (n) {
        b->oom = 1;
    }
    pthread_mutex_unlock(&m->ns_mu);
    /* Entries are never freed before destroy, so reading them unlocked is safe. */
    if (k > 1)
        qsort(v, k, sizeof(*v), cmp_ns_entry);
    tqkv__sb_family(b, "tqkv_tenant_hits_total", "counter",
                    "Blocks of the tenant (namespace) found by Get and Lookup requests.");
    for (size_t i = 0; i < k; i++) {
        SB_LIT(b, "tqkv_tenant_hits_total{tenant=\"");
        tqkv__sb_label_value(b, v[i]->name, v[i]->len);
        tqkv__sb_printf(b, "\"} %" PRIu64 "\n",
                        atomic_load_explicit(&v[i]->hits, memory_order_relaxed));
    }
    tqkv__sb_family(b, "tqkv_tenant_misses_total", "counter",
                    "Blocks of the tenant (namespace) missing for Get and Lookup requests.");
    for (size_t i = 0; i < k; i++) {
        SB_LIT(b, "tqkv_tenant_misses_total{tenant=\"");
        tqkv__sb_label_value(b, v[i]->name, v[i]->len);
        tqkv__sb_printf(b, "\"} %" PRIu64 "\n",
                        atomic_load_explicit(&v[i]->misses, memory_order_relaxed));
    }
    free(v);
}

static void
render_rpcs(tqkv__sbuf_t *b, tqkv_metrics_t *m)
{
    method_entry_t *v[TQKV_METRICS_MAX_METHODS + 1];
    pthread_mutex_lock(&m->methods_mu);
    size_t n = m->nmethods;
    memcpy(v, m->methods, n * sizeof(v[0]));
    pthread_mutex_unlock(&m->methods_mu);

    tqkv__sb_family(b, "tqkv_requests_total", "counter",
                    "Finished RPCs by method and gRPC status code.");
    for (size_t i = 0; i < n; i++) {
        for (int c = 0; c < GRPC_CODES; c++) {
            uint64_t x = atomic_load_explicit(&v[i]->codes[c], memory_order_relaxed);
            if (x == 0 && c != 0)
                continue;
            SB_LIT(b, "tqkv_requests_total{method=\"");
            tqkv__sb_label_value(b, v[i]->name, strlen(v[i]->name));
            tqkv__sb_printf(b, "\",code=\"%s\"} %" PRIu64 "\n", k_code_names[c], x);
        }
    }
    tqkv__sb_family(b, "tqkv_request_duration_seconds", "histogram",
                    "RPC duration from the call's start to its status, by method.");
    for (size_t i = 0; i < n; i++) {
        uint64_t cum = 0;
        for (size_t k = 0; k <= NBUCKETS; k++) {
            cum += atomic_load_explicit(&v[i]->buckets[k], memory_order_relaxed);
            SB_LIT(b, "tqkv_request_duration_seconds_bucket{method=\"");
            tqkv__sb_label_value(b, v[i]->name, strlen(v[i]->name));
            SB_LIT(b, "\",le=\"");
            if (k < NBUCKETS)
                tqkv__sb_le(b, k_buckets[k]);
            else
                SB_LIT(b, "+Inf");
            tqkv__sb_printf(b, "\"} %" PRIu64 "\n", cum);
        }
        uint64_t sum_ns = atomic_load_explicit(&v[i]->sum_ns, memory_order_relaxed);
        SB_LIT(b, "tqkv_request_duration_seconds_sum{method=\"");
        tqkv__sb_label_value(b, v[i]->name, strlen(v[i]->name));
        SB_LIT(b, "\"} ");
        tqkv__sb_double(b, (double)sum_ns * 1e-9);
        SB_LIT(b, "\ntqkv_request_duration_seconds_count{method=\"");
        tqkv__sb_label_value(b, v[i]->name, strlen(v[i]->name));
        tqkv__sb_printf(b, "\"} %" PRIu64 "\n", cum);
    }
}

/* A counter family of one unlabelled sample. */
static void
counter(tqkv__sbuf_t *b, const char *name, const char *help, _Atomic uint64_t *v)
{
    tqkv__sb_family(b, name, "counter", help);
    tqkv__sb_printf(b, "%s %" PRIu64 "\n", name, atomic_load_explicit(v, memory_order_relaxed));
}

/* A counter family by method (TQKV_METRICS_FWD_*, from `from` on: read-through has no
 * Put). */
static void
by_method(tqkv__sbuf_t *b, const char *name, const char *help, int from, _Atomic uint64_t *v)
{
    static const char *const names[3] = {"Put", "Lookup", "Get"};
    tqkv__sb_family(b, name, "counter", help);
    for (int i = from; i < 3; i++)
        tqkv__sb_printf(b, "%s{method=\"%s\"} %" PRIu64 "\n", name, names[i],
                        atomic_load_explicit(&v[i], memory_order_relaxed));
}

/* Hand-off, re-replication, forwarding and read-through (service/forward.h). */
static void
render_peers(tqkv__sbuf_t *b, tqkv_metrics_t *m)
{
    counter(b, "tqkv_handoff_pages_total",
            "Pages handed off to peers on drain (--peers; stored or already there).",
            &m->handoff_pages);
    counter(b, "tqkv_handoff_bytes_total", "Page bytes handed off to peers on drain.",
            &m->handoff_bytes);
    counter(b, "tqkv_replicate_passes_total",
            "Re-replication passes finished (--replicate-bytes-per-s).", &m->repl_passes);
    counter(b, "tqkv_replicate_pages_total", "Pages re-replication put to peers that lacked them.",
            &m->repl_pages);
    counter(b, "tqkv_replicate_bytes_total", "Page bytes re-replication put to peers.",
            &m->repl_bytes);
    counter(b, "tqkv_peer_hellos_total",
            "Peers that said they (re)started or joined (with --replicate-bytes-per-s, "
            "each starts a re-replication pass 2 s later).",
            &m->peer_hellos);
    by_method(b, "tqkv_forwarded_requests_total",
              "Requests forwarded to the owners of blocks this server does not own (one hop).", 0,
              m->fwd_calls);
    by_method(b, "tqkv_forwarded_blocks_total",
              "Blocks (hashes, or Put messages) in forwarded requests.", 0, m->fwd_blocks);
    by_method(b, "tqkv_readthru_requests_total",
              "Requests that asked the next-ranked peers for blocks this server owns but "
              "did not hold (read-through; one batched ask per peer and rank round).",
              1, m->rt_calls);
    by_method(b, "tqkv_readthru_blocks_total",
              "Hashes this server owns but did not hold, asked of the peers (read-through).", 1,
              m->rt_asked);
    by_method(b, "tqkv_readthru_hits_total",
              "Read-through answers found at a peer: Lookup hashes, Get pages copied "
              "into this server's store.",
              1, m->rt_found);
    counter(b, "tqkv_readthru_bytes_total",
            "Page bytes copied from peers by read-through (server-side read repair).",
            &m->rt_bytes);
}

tqkv_status_t
tqkv_metrics_render(tqkv_metrics_t *m, tqkv_store_t *store, char **out)
{
    if (!m || !out)
        return TQKV_EINVAL;
    tqkv__sbuf_t b = {0};
    tqkv__sb_reserve(&b, 16384);

    tqkv__sb_family(&b, "tqkv_build_info", "gauge", "Build information; the value is always 1.");
    SB_LIT(&b, "tqkv_build_info{version=\"");
    tqkv__sb_label_value(&b, TQKV_VERSION, strlen(TQKV_VERSION));
    SB_LIT(&b, "\"} 1\n");
    if (m->node_id[0]) {
        tqkv__sb_family(&b, "tqkv_node_info", "gauge",
                        "The server's stable identity (--node-id); the value is always 1.");
        SB_LIT(&b, "tqkv_node_info{node_id=\"");
        tqkv__sb_label_value(&b, m->node_id, strlen(m->node_id));
        SB_LIT(&b, "\"} 1\n");
    }
    tqkv__render_process(&b, m->start_time);

    render_rpcs(&b, m);

    tqkv__sb_family(&b, "tqkv_bytes_received_total", "counter", "Request payload bytes received.");
    tqkv__sb_printf(&b, "tqkv_bytes_received_total %" PRIu64 "\n",
                    atomic_load_explicit(&m->bytes_in, memory_order_relaxed));
    tqkv__sb_family(&b, "tqkv_bytes_sent_total", "counter", "Response payload bytes sent.");
    tqkv__sb_printf(&b, "tqkv_bytes_sent_total %" PRIu64 "\n",
                    atomic_load_explicit(&m->bytes_out, memory_order_relaxed));
    tqkv__sb_family(&b, "tqkv_bf16_equivalent_bytes_delivered_total", "counter",
                    "BF16 bytes the pages delivered by Get stand for (uncompressed equivalent).");
    tqkv__sb_printf(&b, "tqkv_bf16_equivalent_bytes_delivered_total %" PRIu64 "\n",
                    atomic_load_explicit(&m->bf16_out, memory_order_relaxed));

    static const char *const ops[2] = {"decode", "encode"};
    tqkv__sb_family(&b, "tqkv_codec_bytes_total", "counter",
                    "BF16 bytes processed by the TurboQuant codec, by operation.");
    for (int i = 1; i >= 0; i--)
        tqkv__sb_printf(&b, "tqkv_codec_bytes_total{op=\"%s\"} %" PRIu64 "\n", ops[i],
                        atomic_load_explicit(&m->codec_bytes[i], memory_order_relaxed));
    tqkv__sb_family(&b, "tqkv_codec_seconds_total", "counter",
                    "Seconds spent in the TurboQuant codec, by operation.");
    for (int i = 1; i >= 0; i--) {
        tqkv__sb_printf(&b, "tqkv_codec_seconds_total{op=\"%s\"} ", ops[i]);
        tqkv__sb_double(&b,
                        (double)atomic_load_explicit(&m->codec_ns[i], memory_order_relaxed) * 1e-9);
        SB_LIT(&b, "\n");
    }
    tqkv__sb_family(&b, "tqkv_active_streams", "gauge", "gRPC calls in progress.");
    tqkv__sb_printf(&b, "tqkv_active_streams %" PRId64 "\n",
                    atomic_load_explicit(&m->streams, memory_order_relaxed));
    tqkv__sb_family(&b, "tqkv_data_channels", "gauge",
                    "TCP data channels open (--data-listen; connected or awaiting their hello).");
    tqkv__sb_printf(&b, "tqkv_data_channels %" PRId64 "\n",
                    atomic_load_explicit(&m->data_channels, memory_order_relaxed));
    const char *dc_path = atomic_load(&m->dc_path);
    if (dc_path) {
        tqkv__sb_family(&b, "tqkv_data_channel_security_info", "gauge",
                        "How TCP data channels are protected (path: plaintext, or the TLS "
                        "implementation that runs); the value is always 1.");
        tqkv__sb_printf(&b, "tqkv_data_channel_security_info{path=\"%s\"} 1\n", dc_path);
        tqkv__sb_family(&b, "tqkv_data_channel_handshake_failures_total", "counter",
                        "Data channel connections refused at the TLS handshake (no or untrusted "
                        "client certificate, plaintext on a TLS port, timeout).");
        tqkv__sb_printf(&b, "tqkv_data_channel_handshake_failures_total %" PRIu64 "\n",
                        atomic_load_explicit(&m->dc_handshake_failures, memory_order_relaxed));
    }

    static const char *const files[2] = {"tokens", "tls"};
    tqkv__sb_family(&b, "tqkv_credential_reloads_total", "counter",
                    "Reloads of the token file / TLS files (SIGHUP or file change) by result; a "
                    "rejected file leaves the previous one in force.");
    for (int f = 0; f < 2; f++)
        for (int r = 0; r < 2; r++)
            tqkv__sb_printf(
                &b, "tqkv_credential_reloads_total{file=\"%s\",result=\"%s\"} %" PRIu64 "\n",
                files[f], r ? "rejected" : "ok",
                atomic_load_explicit(&m->reloads[f][r], memory_order_relaxed));
    tqkv__sb_family(&b, "tqkv_credential_load_timestamp_seconds", "gauge",
                    "When the token file / TLS files in force were loaded (0: not configured).");
    for (int f = 0; f < 2; f++) {
        tqkv__sb_printf(&b, "tqkv_credential_load_timestamp_seconds{file=\"%s\"} ", files[f]);
        tqkv__sb_double(
            &b, (double)atomic_load_explicit(&m->reload_ok_ns[f], memory_order_relaxed) * 1e-9);
        SB_LIT(&b, "\n");
    }

    render_peers(&b, m);

    render_ns_access(&b, m);
    if (store)
        tqkv__render_store(&b, store);

    if (b.oom) {
        free(b.p);
        return TQKV_ENOMEM;
    }
    *out = b.p;
    return TQKV_OK;
}

/* ---- HTTP ---- */

static enum MHD_Result
send_text(struct MHD_Connection *conn, unsigned int code, const char *text, int allow)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
    if (allow)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result
on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
           const char *version, const char *upload_data, size_t *upload_data_size, void **con_cls)
{
    tqkv_metrics_t *m = cls;
    int probe = strcmp(url, "/livez") == 0 || strcmp(url, "/readyz") == 0;
    if (strcmp(url, "/metrics") != 0 && !probe)
        return send_text(conn, MHD_HTTP_NOT_FOUND,
                         "not found: /metrics, /livez and /readyz are served\n", 0);
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return send_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n", 1);
    if (strcmp(url, "/livez") == 0)
        return send_text(conn, MHD_HTTP_OK, "ok\n", 0);
    if (probe) {
        int ok = m->ready && m->ready(m->ready_arg);
        return send_text(conn, ok ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE,
                         ok ? "ready\n" : "not serving\n", 0);
    }
    char *text = NULL;
    if (tqkv_metrics_render(m, m->store, &text) != TQKV_OK)
        return send_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n", 0);
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

/* Splits "HOST:PORT" / "[V6]:PORT" / ":PORT" (loopback) into host and port. */
static int
split_listen(const char *listen, char *host, size_t hostlen, char *port, size_t portlen)
{
    const char *colon;
    const char *h = listen;
    size_t hl;
    if (listen[0] == '[') {
        const char *close = strchr(listen, ']');
        if (!close || close[1] != ':')
            return -1;
        h = listen + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(listen, ':');
        if (!colon)
            return -1;
        hl = (size_t)(colon - listen);
        if (memchr(listen, ':', hl)) /* bare IPv6 without brackets */
            return -1;
    }
    if (hl == 0) {
        h = "127.0.0.1";
        hl = strlen(h);
    }
    if (hl >= hostlen || strlen(colon + 1) == 0 || strlen(colon + 1) >= portlen)
        return -1;
    for (const char *p = colon + 1; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    if (strtol(colon + 1, NULL, 10) > 65535)
        return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    snprintf(port, portlen, "%s", colon + 1);
    return 0;
}

tqkv_status_t
tqkv_metrics_serve(tqkv_metrics_t *m, const char *listen_addr, tqkv_store_t *store, int *bound_port)
{
    if (!m || !listen_addr)
        return TQKV_EINVAL;
    if (m->daemon) {
        snprintf(m->err, sizeof m->err, "already serving");
        return TQKV_EBUSY;
    }
    char host[256], port[8];
    if (split_listen(listen_addr, host, sizeof(host), port, sizeof(port)) != 0) {
        snprintf(m->err, sizeof m->err, "bad listen address '%s' (want HOST:PORT)", listen_addr);
        return TQKV_EINVAL;
    }
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai != 0) {
        snprintf(m->err, sizeof m->err, "cannot resolve '%s': %s", host, gai_strerror(gai));
        return TQKV_EINVAL;
    }
    tqkv_status_t st = TQKV_EIO;
    int fd = -1, err = 0, family = AF_INET;
    for (struct addrinfo *p = ai; p; p = p->ai_next) {
        fd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, p->ai_addr, p->ai_addrlen) == 0 && listen(fd, 64) == 0) {
            family = p->ai_family;
            break;
        }
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        snprintf(m->err, sizeof m->err, "cannot listen on %s: %s", listen_addr, strerror(err));
        return TQKV_EIO;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    int port_no = 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET)
            port_no = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6)
            port_no = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    m->store = store;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (family == AF_INET6)
        flags |= MHD_USE_IPv6;
    m->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, m, MHD_OPTION_LISTEN_SOCKET,
                                 (MHD_socket)fd, MHD_OPTION_CONNECTION_LIMIT, (unsigned int)64,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)10, MHD_OPTION_END);
    if (!m->daemon) {
        snprintf(m->err, sizeof m->err, "cannot start the HTTP server on %s", listen_addr);
        close(fd);
        m->store = NULL;
        return st;
    }
    if (bound_port)
        *bound_port = port_no;
    return TQKV_OK;
}
