/* tqkv_bench_main.c - tqkv-bench: simulated inference workers against tqkv-server(s).
 *
 * N worker threads share one libtqkv client (--phase mixed: odd workers decode, even
 * ones prefill; one worker alternates at random). A prefill op Puts a new sequence of
 * chained blocks (all layers); with probability --prefix-reuse the sequence starts
 * with a prefix of an earlier one, which is not Put again (as an engine that did a
 * Lookup would). A decode op Lookups a known sequence and Gets its cached prefix,
 * layer-major, verifying every page: packed pages must pass validation with CRC (the
 * client library checks the CRC as it receives the page; the bench re-checks any page
 * it did not), the first read of each (hash, layer, server) must decode to within a
 * relative error of 0.3 of what was Put, every later read must have the CRC and length
 * of the first, and 1 in --verify-every is decoded again (all pages in BF16 mode are
 * compared). Block contents are windows of one random BF16 pool chosen by (hash,
 * layer), so the source of any page can be rebuilt. --transport tcp (the default) asks
 * for PACKED pages over TCP data channels (proto/DATA_CHANNEL.md).
 *
 * The same run measures raw TCP loopback (one connection per worker, in parallel) in
 * messages of tqkv's mean Get message size
 * (and of the BF16 block size), and Redis GET of the BF16 blocks (a RESP client over a
 * socket, against a redis-server this process starts).
 *
 * This file: main, the set-up (block data, a spawned server, the client, the targets' health,
 * the workers), the run loop with its progress lines, and the results; bench.h lists the others.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "kernels/version.h"
#include "transport/bench/tls_pair.h"
#include "transport/bench/bench.h"
#include "transport/client.h"

/* jemalloc (linked into the executables) reads this at start-up: keep freed pages
 * instead of returning them to the kernel, so gRPC's per-read slices do not fault in
 * fresh zeroed pages on every message. lg_extent_max_active_fit lets a request reuse
 * a cached dirty extent however much larger than the request it is. Without it (the
 * default bound is 64x) and with decay off, freed read buffers coalesce into extents
 * too large to be reused, jemalloc maps new memory instead: RSS grew ~1 GB/s (8.5 GB
 * after 11 s of decode), every read faulted in zeroed pages (clear_page 22% of the
 * run's CPU) and Get wire GB/s fell from 2.6 to 0.7 after ~5 s. With it RSS stays
 * ~300 MB and the rate holds. */
const char *malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:20";

cfg_t C;
seq_pool_t pool = {.mu = PTHREAD_MUTEX_INITIALIZER};
uint16_t *data_pool;
size_t data_elems, block_elems;
counters_t K;
vent_t *vtab;

/* ---- the run ---- */

/* The random BF16 pool block contents are windows of, the verify table, and the
 * content-check self-test. 0, or -1 (said on stderr). */
static int
data_init(void)
{
    block_elems = (size_t)C.block_tokens * C.heads * C.dim;
    data_elems = block_elems * 2 + ((size_t)8 << 20);
    data_pool = malloc(data_elems * sizeof *data_pool);
    vtab = calloc((size_t)1 << VTAB_BITS, sizeof *vtab);
    if (data_pool == NULL || vtab == NULL) {
        fprintf(stderr, "tqkv-bench: out of memory\n");
        return -1;
    }
    uint64_t s = C.seed;
    for (size_t i = 0; i < data_elems; i += 2) {
        double u1 = bench_rndu(&s) + 1e-12, u2 = bench_rndu(&s);
        double r = sqrt(-2 * log(u1));
        data_pool[i] = bench_f2bf((float)(r * cos(6.283185307179586 * u2)));
        if (i + 1 < data_elems)
            data_pool[i + 1] = bench_f2bf((float)(r * sin(6.283185307179586 * u2)));
    }
    if (bench_rel_err_selftest() != 0) {
        fprintf(stderr, "tqkv-bench: content-check self-test failed (fast vs reference)\n");
        return -1;
    }
    return 0;
}

/* --spawn-server: starts it on a free port and makes it the target. 0 or -1. */
static int
spawn_server(child_t *server)
{
    static char spawned_addr[128];
    char *sargv[MAX_SERVER_ARGS + 8];
    int n = 0;
    sargv[n++] = (char *)C.spawn;
    sargv[n++] = "--listen";
    sargv[n++] = "127.0.0.1:0";
    if (C.transport == TQKV_CLIENT_TRANSPORT_TCP) {
        sargv[n++] = "--data-listen";
        sargv[n++] = "127.0.0.1:0";
    }
    for (int i = 0; i < C.nserver_args; i++)
        sargv[n++] = (char *)C.server_args[i];
    sargv[n] = NULL;
    if (bench_child_start(server, sargv, 1, spawned_addr, sizeof spawned_addr) != 0) {
        fprintf(stderr, "tqkv-bench: %s did not report 'listening on HOST:PORT'\n", C.spawn);
        return -1;
    }
    C.targets[C.ntargets++] = spawned_addr;
    fprintf(stderr, "tqkv-bench: spawned %s on %s (pid %d)\n", C.spawn, spawned_addr,
            (int)server->pid);
    return 0;
}

/* The workers' client options. */
static tqkv_client_opts_t
client_opts(void)
{
    tqkv_client_opts_t co = {
        .struct_size = sizeof(tqkv_client_opts_t),
        .targets = C.targets,
        .num_targets = C.ntargets,
        .resolve_targets = 1, /* a Service name: every server behind it, followed */
        .dns_servers = C.dns,
        .resolve_interval_ms = C.resolve_ms,
        .tls_ca_path = C.tls_ca,
        .tls_target_name = C.tls_name,
        .token = C.token,
        .replicas = C.replicas,
        .transport = C.transport,
        .channels_per_target =
            C.channels ? C.channels : (uint32_t)(C.concurrency < 4 ? C.concurrency : 4),
        /* The health probe below waits for the targets; once they
         * answered, a target that dies mid-run must show up as
         * errors, not stall every worker on a connection that will
         * not come back: no wait-for-ready, and no call outlives
         * the run by more than 15 s. */
        .wait_for_ready = 0,
        .deadline_ms = C.deadline_ms                       ? C.deadline_ms
                       : C.duration > 0 && C.duration < 45 ? (uint32_t)(C.duration * 1000) + 15000
                                                           : 60000,
        .connect_timeout_ms = C.connect_ms,
        .call_base_ms = C.call_base_ms,
        .call_floor_mb_s = C.call_floor_mb_s,
        .hedge_min_ms = C.hedge_min_ms,
        .hedge_max_ms = C.hedge_max_ms,
        .no_hedge = C.no_hedge};
    return co;
}

/* Every target answers health before the run: calls wait for a connection (one
 * target) up to their 60 s deadline, so an unreachable or mistyped target would
 * otherwise hang every worker for a minute per call and still exit with a table.
 * 0 when every target is SERVING, else -1 (said on stderr). */
static int
probe_targets(const tqkv_client_opts_t *co)
{
    tqkv_client_opts_t po = *co;
    tqkv_client_t *probe;
    po.replicas = 1;
    po.channels_per_target = 1;
    po.wait_for_ready = 1;
    po.deadline_ms = 15000;
    if (tqkv_client_create(&po, &probe) != TQKV_OK) {
        fprintf(stderr, "tqkv-bench: %s\n", tqkv_client_last_error()->message);
        return -1;
    }
    int unready = 0;
    for (size_t t = 0; t < C.ntargets; t++) {
        int serving = 0;
        if (tqkv_client_health(probe, t, "", &serving) != TQKV_OK) {
            const tqkv_client_error_t *e = tqkv_client_last_error();
            /* a TLS server seen in plaintext only times out: say what to try */
            fprintf(stderr, "tqkv-bench: %s: not reachable (%s: %s)%s\n", C.targets[t],
                    tqkv_status_name(e->status), e->message,
                    C.tls_ca ? "" : "; if the server uses TLS, give --tls-ca FILE");
            unready++;
        } else if (serving != 1) {
            fprintf(stderr, "tqkv-bench: %s: health status %d, not SERVING\n", C.targets[t],
                    serving);
            unready++;
        }
    }
    tqkv_client_destroy(probe);
    return unready ? -1 : 0;
}

/* Sets up the C.concurrency workers of ws (zeroed) on client cl. 0 or -1 (said). */
static int
workers_init(worker_t *ws, tqkv_client_t *cl)
{
    for (int i = 0; i < C.concurrency; i++) {
        ws[i].id = i;
        ws[i].cl = cl;
        ws[i].rng = bench_mix64(C.seed + (uint64_t)i * 7919);
        ws[i].kf = malloc(block_elems * sizeof(float));
        ws[i].vf = malloc(block_elems * sizeof(float));
        if (C.client_encode) {
            tqkv_block_shape_t sh = {C.block_tokens, C.heads, C.dim};
            tqkv_block_codec_t bc;
            memset(&bc, 0, sizeof bc);
            bc.k.bits_x2 = 8; /* the largest page of any bit width */
            bc.v.bits_x2 = 8;
            bc.k.mode = bc.v.mode = TQKV_MODE_PROD;
            if (tqkv_page_size(&sh, &bc, &ws[i].page_cap) != TQKV_OK)
                ws[i].page_cap = block_elems * 4;
            ws[i].page_cap += 65536;
            ws[i].page = aligned_alloc(64, (ws[i].page_cap + 63) & ~(size_t)63);
        }
        if (ws[i].kf == NULL || ws[i].vf == NULL || (C.client_encode && ws[i].page == NULL)) {
            fprintf(stderr, "tqkv-bench: out of memory\n");
            return -1;
        }
    }
    if (C.phase == PH_DECODE) {
        /* An untimed working set to read back. */
        uint32_t n = C.working_set ? C.working_set : (uint32_t)C.concurrency * 2;
        for (uint32_t i = 0; i < n; i++)
            bench_op_prefill(&ws[i % (uint32_t)C.concurrency], 0);
        if (pool.n == 0) {
            fprintf(stderr, "tqkv-bench: could not store the working set\n");
            return -1;
        }
    }
    return 0;
}

static void
workers_free(worker_t *ws)
{
    for (int i = 0; i < C.concurrency; i++) {
        free(ws[i].put.v);
        free(ws[i].lookup.v);
        free(ws[i].get.v);
        free(ws[i].first.v);
        free(ws[i].kf);
        free(ws[i].vf);
        free(ws[i].page);
    }
    free(ws);
}

/* The counters at the last line of a progress report. */
typedef struct mark {
    uint64_t put, get, wire, pages, asked, hit;
    double t;
} mark_t;

/* The once-a-second line: \r-rewritten on a terminal, and a row of the --csv series. */
static void
progress_second(FILE *csv, tqkv_client_t *cl, int tty, double t0, double t, mark_t *l)
{
    uint64_t p = atomic_load(&K.put_bf16), g = atomic_load(&K.get_bf16),
             w = atomic_load(&K.get_wire), pg = atomic_load(&K.get_found);
    double dt = t - l->t;
    uint64_t asked = atomic_load(&K.lookup_asked);
    uint64_t hit = atomic_load(&K.lookup_hit);
    double hr = asked ? (double)hit / (double)asked : 0;
    double hri = asked > l->asked ? (double)(hit - l->hit) / (double)(asked - l->asked) : 0;
    if (tty)
        fprintf(stderr,
                "\r[%5.1fs] put %6.2f GB/s  get %6.2f GB/s bf16-eq (%5.2f wire)  %8.0f "
                "pages/s  hit %5.1f%%  verify-fail %" PRIu64 "  err %" PRIu64 "   ",
                t - t0, (double)(p - l->put) / dt / 1e9, (double)(g - l->get) / dt / 1e9,
                (double)(w - l->wire) / dt / 1e9, (double)(pg - l->pages) / dt, hr * 100,
                atomic_load(&K.verify_failures), atomic_load(&K.errors));
    if (csv)
        fprintf(csv, "%.2f,%.4f,%.4f,%.4f,%.1f,%.4f,%" PRIu64 ",%" PRIu64 ",%.4f,%zu\n", t - t0,
                (double)(p - l->put) / dt / 1e9, (double)(g - l->get) / dt / 1e9,
                (double)(w - l->wire) / dt / 1e9, (double)(pg - l->pages) / dt, hr,
                atomic_load(&K.verify_failures), atomic_load(&K.errors), hri,
                tqkv_client_num_targets(cl));
    if (csv)
        fflush(csv); /* a live time series: plot it while the run goes on */
    *l = (mark_t){p, g, w, pg, asked, hit, t};
}

/* Not a terminal (a Kubernetes Job's log, a CI file): a whole progress line every
 * PROGRESS_S seconds instead of the \r-rewritten one, so the log shows the run is alive. */
static void
progress_line(double t0, double t, int running, mark_t *q)
{
    uint64_t p = atomic_load(&K.put_bf16), g = atomic_load(&K.get_bf16),
             w = atomic_load(&K.get_wire), pg = atomic_load(&K.get_found);
    double dt = t - q->t > 1e-9 ? t - q->t : 1e-9;
    uint64_t asked = atomic_load(&K.lookup_asked);
    fprintf(stderr,
            "tqkv-bench: progress %.1fs%s put %.2f GB/s get %.2f GB/s bf16-eq (%.2f "
            "wire) %.0f pages/s hit %.1f%% ops %" PRIu64 " verify-fail %" PRIu64 " err %" PRIu64
            "\n",
            t - t0, running ? "" : " (end)", (double)(p - q->put) / dt / 1e9,
            (double)(g - q->get) / dt / 1e9, (double)(w - q->wire) / dt / 1e9,
            (double)(pg - q->pages) / dt,
            asked ? 100.0 * (double)atomic_load(&K.lookup_hit) / (double)asked : 0.0,
            (uint64_t)atomic_load(&K.ops), atomic_load(&K.verify_failures), atomic_load(&K.errors));
    fflush(stderr);
    q->put = p, q->get = g, q->wire = w, q->pages = pg, q->t = t;
}

/* Runs the workers until --duration or --ops, reporting progress; returns the seconds
 * it took. */
static double
run_workers(worker_t *ws, tqkv_client_t *cl, FILE *csv)
{
    const double PROGRESS_S = 5.0;
    int tty = isatty(2);
    double t0 = tqkv_clock_s();
    atomic_store(&K.run_t0_ns, (uint64_t)(t0 * 1e9));
    for (int i = 0; i < C.concurrency; i++)
        pthread_create(&ws[i].th, NULL, bench_worker_main, &ws[i]);
    mark_t l = {.t = t0}, q = {.t = t0};
    int running = 1;
    while (running) {
        usleep(100000);
        double t = tqkv_clock_s();
        if (C.duration > 0 && t - t0 >= C.duration)
            atomic_store(&K.stop, 1);
        if (C.ops && atomic_load(&K.ops) >= C.ops)
            atomic_store(&K.stop, 1);
        if (atomic_load(&K.stop))
            running = 0;
        if (t - l.t >= 1.0 || !running)
            progress_second(csv, cl, tty, t0, t, &l);
        if (!tty && (t - q.t >= PROGRESS_S || !running))
            progress_line(t0, t, running, &q);
    }
    for (int i = 0; i < C.concurrency; i++)
        pthread_join(ws[i].th, NULL);
    double elapsed = tqkv_clock_s() - t0;
    if (tty)
        fputc('\n', stderr);
    return elapsed;
}

/* The run's results: rates, latency percentiles, the server's stats, the baselines. */
static void
results(result_t *r, worker_t *ws, tqkv_client_t *cl, double elapsed)
{
    memset(r, 0, sizeof *r);
    r->elapsed = elapsed;
    r->have_stats = tqkv_client_stats(cl, C.ns, &r->sst) == TQKV_OK;
    r->max_gap_s = (double)K.max_gap_ns / 1e9;
    r->max_gap_end_s = K.max_gap_ns ? ((double)K.max_gap_end_ns - (double)K.run_t0_ns) / 1e9 : 0;
    tqkv__hedge_stats(cl, &r->hs);
    tqkv_client_health_stats(cl, &r->health);
    r->put_gbps = (double)K.put_bf16 / elapsed / 1e9;
    r->put_wire_gbps = (double)K.put_wire / elapsed / 1e9;
    r->bf16_gbps = (double)K.get_bf16 / elapsed / 1e9;
    r->wire_gbps = (double)K.get_wire / elapsed / 1e9;
    r->pages_s = (double)K.get_found / elapsed;
    r->hit = K.lookup_asked ? (double)K.lookup_hit / (double)K.lookup_asked : 0;
    r->pp = bench_percentiles(ws, C.concurrency, offsetof(worker_t, put));
    r->pl = bench_percentiles(ws, C.concurrency, offsetof(worker_t, lookup));
    r->pgt = bench_percentiles(ws, C.concurrency, offsetof(worker_t, get));
    r->pf = bench_percentiles(ws, C.concurrency, offsetof(worker_t, first));
    r->tcp = r->tcp_block = r->redis = r->tls = -1;
    r->msg = r->wmsg = block_elems * 4;
    if (C.baselines)
        bench_run_baselines(r);
}

/* ---- main ---- */

int
main(int argc, char **argv)
{
    child_t server = {0};
    int rc = bench_parse_flags(argc, argv), report_failed = 0;
    if (rc >= 0)
        return rc;
    rc = 1;
    signal(SIGPIPE, SIG_IGN);
    if (data_init() != 0)
        return 1;
    if (C.spawn && spawn_server(&server) != 0)
        return 1;

    tqkv_client_opts_t co = client_opts();
    tqkv_client_t *cl;
    if (tqkv_client_create(&co, &cl) != TQKV_OK) {
        fprintf(stderr, "tqkv-bench: %s\n", tqkv_client_last_error()->message);
        goto out_server;
    }
    if (probe_targets(&co) != 0) {
        tqkv_client_destroy(cl);
        goto out_server;
    }
    worker_t *ws = calloc((size_t)C.concurrency, sizeof *ws);
    if (workers_init(ws, cl) != 0)
        goto out_client;
    atomic_store(&K.errors, 0);

    FILE *csv = C.csv ? fopen(C.csv, "w") : NULL;
    if (C.csv && csv == NULL) {
        fprintf(stderr, "tqkv-bench: --csv %s: %s\n", C.csv, strerror(errno));
        goto out_client;
    }
    if (csv)
        fprintf(csv, "t_s,put_gbps,get_bf16_gbps,get_wire_gbps,pages_per_s,hit_rate,"
                     "verify_failures,errors,hit_rate_interval,targets\n");
    double elapsed = run_workers(ws, cl, csv);
    if (csv && bench_report_close(csv) != 0) {
        fprintf(stderr, "tqkv-bench: --csv %s: write failed: %s\n", C.csv, strerror(errno));
        report_failed = 1;
    }
    result_t r;
    results(&r, ws, cl, elapsed);
    bench_print_report(stdout, cl, &r);
    if (C.json && bench_write_json(&r) != 0)
        report_failed = 1;
    rc = K.verify_failures != 0 ? 3 : K.errors != 0 ? 4 : report_failed ? 1 : 0;

out_client:
    workers_free(ws);
    tqkv_client_destroy(cl);
out_server:
    if (C.spawn)
        bench_child_stop(&server);
    for (size_t i = 0; i < SEQ_POOL; i++)
        free(pool.s[i].h);
    free(vtab);
    free(data_pool);
    return rc;
}
