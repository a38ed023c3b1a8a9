/* bench.h - what the files of tqkv-bench share: the run's configuration (C) and counters
 * (K), the sequence pool and the block data, a worker, and each file's entry points.
 *
 * Files: tqkv_bench_main.c (main, set-up, the run loop), bench_options.c (flags),
 * bench_workers.c (the workers' Put/Lookup/Get ops and their checks), bench_baselines.c
 * (spawned servers, raw TCP, Redis and TLS baselines), bench_report.c (text and --json
 * reports). A tool over libtqkv, not part of the library.
 */
#ifndef TQKV_TRANSPORT_BENCH_BENCH_H
#define TQKV_TRANSPORT_BENCH_BENCH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "kernels/clock.h"
#include "transport/client.h"
#include "transport/client_health.h"

#define MAX_TARGETS 32
#define MAX_SERVER_ARGS 32
#define SEQ_POOL 4096
#define VTAB_BITS 20

typedef enum { PH_PREFILL, PH_DECODE, PH_MIXED } phase_t;

typedef struct cfg {
    const char *targets[MAX_TARGETS];
    size_t ntargets;
    double duration;
    uint64_t ops;
    int concurrency;
    uint32_t layers, heads, dim, block_tokens, seq_blocks;
    double prefix_reuse;
    phase_t phase;
    int encoding;
    float key_bits, value_bits;
    const char *ns;
    const char *json, *csv;
    const char *tls_ca, *tls_name, *token;
    const char *dns;     /* --dns-server: resolver for the targets (tests) */
    uint32_t resolve_ms; /* --resolve-interval-ms: membership re-resolve period */
    int baselines;
    const char *spawn;
    const char *server_args[MAX_SERVER_ARGS];
    int nserver_args;
    uint32_t replicas, channels;
    uint64_t seed;
    int verify_every;
    int transport; /* TQKV_CLIENT_TRANSPORT_* */
    uint32_t working_set;
    uint32_t lease_ms;
    int client_encode;
    /* libtqkv's deadlines and hedging (tqkv_client_opts_t; 0 = its defaults) */
    uint32_t deadline_ms, connect_ms, call_base_ms, call_floor_mb_s, hedge_min_ms, hedge_max_ms;
    int no_hedge;
} cfg_t;

/* The run's configuration: defaults, then the flags (bench_options.c). */
extern cfg_t C;

typedef struct seq {
    tqkv_hash_t *h; /* seq_blocks hashes */
} seq_t;

/* Sequences Put so far, for decode ops and prefix reuse (the last SEQ_POOL). */
typedef struct seq_pool {
    pthread_mutex_t mu;
    seq_t s[SEQ_POOL];
    uint64_t n; /* sequences ever added */
} seq_pool_t;
extern seq_pool_t pool;

extern uint16_t *data_pool; /* random BF16 */
extern size_t data_elems, block_elems;

/* The run's counters. */
typedef struct counters {
    _Atomic uint64_t put_blocks, put_bf16, put_wire, get_found, get_missing, get_bf16, get_wire;
    _Atomic uint64_t client_crc; /* packed pages whose CRC libtqkv checked while copying */
    _Atomic uint64_t dc_pages;   /* pages that came over a TCP data channel */
    _Atomic uint64_t lookup_asked, lookup_hit, verify_failures, errors, ops, content_checks;
    _Atomic int stop;
    /* the longest time without an operation completing (any worker), from the first
     * completion on, and when it ended (monotonic ns) */
    _Atomic uint64_t last_op_ns, max_gap_ns, max_gap_end_ns, run_t0_ns;
} counters_t;
extern counters_t K;

/* (hash, layer) -> CRC and length of the first page read. Open addressing. */
typedef struct vent {
    uint64_t key;
    uint32_t crc, len;
} vent_t;
extern vent_t *vtab;

typedef struct lat {
    uint32_t *v;
    size_t n, cap;
} lat_t;

typedef struct worker {
    pthread_t th;
    int id;
    tqkv_client_t *cl;
    uint64_t rng;
    lat_t put, lookup, get, first;
    uint16_t *kbuf, *vbuf;
    float *kf, *vf;
    uint8_t *page; /* --client-encode: this worker's page buffer */
    size_t page_cap;
} worker_t;

typedef struct pct {
    double p50, p95, p99, p999;
    size_t n;
} pct_t;

typedef struct child {
    pid_t pid;
    int fd;
    pthread_t drain;
    int draining;
} child_t;

/* What a run measured, for the report. */
typedef struct result {
    double elapsed, put_gbps, put_wire_gbps, bf16_gbps, wire_gbps, pages_s, hit;
    pct_t pp, pl, pgt, pf; /* latency: Put, Lookup, Get, Get's first page */
    int have_stats;
    tqkv_client_stats_t sst;
    /* baselines (-1: not run) */
    double tcp, tcp_block, redis, tls, cipher_gbps;
    char tls_suite[64];
    size_t msg, wmsg; /* the BF16 block's bytes; the raw TCP message's */
    /* the longest time without an operation completing and when it ended (s from the
     * start); libtqkv's hedges and calls past their size deadline */
    double max_gap_s, max_gap_end_s;
    tqkv__hedge_stats_t hs;
    tqkv_client_health_stats_t health;
} result_t;

/* bench_options.c: flags */
int bench_parse_flags(int argc, char **argv);

/* bench_workers.c: the workers and their checks */
uint64_t bench_mix64(uint64_t z);
uint64_t bench_rnd(uint64_t *s);
double bench_rndu(uint64_t *s);
uint16_t bench_f2bf(float f);
int bench_rel_err_selftest(void);
void bench_op_prefill(worker_t *w, int record);
void *bench_worker_main(void *arg);
/* An operation completed now: the longest gap between completions (K.max_gap_ns). */
void bench_op_done(void);
pct_t bench_percentiles(worker_t *ws, int n, size_t off);

/* bench_baselines.c: spawned processes and the baselines */
int bench_child_start(child_t *c, char *const argv[], int want_port, char *addr, size_t addrlen);
void bench_child_stop(child_t *c);
void bench_run_baselines(result_t *r);

/* bench_report.c: the reports */
int bench_report_close(FILE *f);
void bench_print_report(FILE *o, tqkv_client_t *cl, const result_t *r);
int bench_write_json(const result_t *r);

#endif /* TQKV_TRANSPORT_BENCH_BENCH_H */
