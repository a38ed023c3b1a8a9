/* bench_options.c - tqkv-bench's flags: the defaults, strict value parsing (a message
 * naming the flag), usage, and the checks made before a run.
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
#include "transport/bench/tls_report.h"
#include "transport/bench/bench.h"
#include "transport/client.h"

/* ---- main ---- */

static void
usage(void)
{
    fprintf(
        stderr,
        "usage: tqkv-bench [--target HOST:PORT]... | --spawn-server PATH [--server-arg ARG]...\n"
        "  --duration S (10)  --ops N (0: no limit)  --concurrency N (4)\n"
        "  --model llama3-8b|llama3-70b|tiny  or --layers N --kv-heads N --head-dim N\n"
        "  --block-tokens N (256)  --seq-blocks N (4)  --prefix-reuse R (0.5)\n"
        "  --phase prefill|decode|mixed (mixed)  --encoding packed|bf16 (packed)\n"
        "  --transport tcp|grpc (tcp: PACKED Gets over TCP data channels where the server\n"
        "               offers them, else gRPC; a spawned server gets --data-listen)\n"
        "  --key-bits B --value-bits B  --namespace NS (bench)  --replicas R (1)\n"
        "  --channels N (connections per target)  --working-set N (decode: sequences)\n"
        "  --dram-capacity BYTES (passed to a spawned server)  --verify-every N (256)\n"
        "  --lease-ms N (Lookup pins the prefix this long for the Get, 100)\n"
        "  --client-encode (encode pages in the bench and Put pages; bits from\n"
        "                   --key-bits/--value-bits, default 3.5/3)\n"
        "  --json FILE|-  --csv FILE (a time series, one row a second: throughput, hit rate\n"
        "               cumulative and of the second, servers followed)\n"
        "  --tls-ca FILE [--tls-target-name N]  --token T  --no-baselines  --seed N\n"
        "  a --target DNS name stands for every server it resolves to (a headless Service;\n"
        "  SRV _grpc._tcp.NAME where present), followed as servers come and go:\n"
        "  --resolve-interval-ms N (10000)  --dns-server IP:PORT (default: the system's)\n"
        "  libtqkv's failure handling (0 = its defaults; docs/cluster.md):\n"
        "  --deadline-ms N (per operation; 60000, or the duration + 15 s when shorter)\n"
        "  --connect-timeout-ms N  --call-base-ms N  --call-floor-mb-s N (a call's own\n"
        "               deadline: base + its bytes at the floor)  --no-hedge\n"
        "  --hedge-min-ms N --hedge-max-ms N (bounds of the hedge delay, p95 of a server)\n"
        "  --version (print the version and build, exit)\n"
        "exit status: 0 ok, 1 cannot run or write a report, 2 bad flags, 3 verify failures,\n"
        "             4 RPC errors (see \"errors\")\n");
    fputs(tqkv_bench_tls_usage, stderr);
}

static int
set_model(const char *m)
{
    if (!strcmp(m, "llama3-8b")) {
        C.layers = 32, C.heads = 8, C.dim = 128;
    } else if (!strcmp(m, "llama3-70b")) {
        C.layers = 80, C.heads = 8, C.dim = 128;
    } else if (!strcmp(m, "tiny")) {
        C.layers = 4, C.heads = 2, C.dim = 64;
    } else {
        return -1;
    }
    return 0;
}

/* Strict flag values: the whole string, in range, or a message naming the flag. */
static int
arg_u64(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end = NULL;
    unsigned long long x = 0;
    errno = 0;
    if (v[0] >= '0' && v[0] <= '9') /* decimal, or hex with 0x (seeds) */
        x = strtoull(v, &end, (v[0] == '0' && (v[1] == 'x' || v[1] == 'X')) ? 16 : 10);
    if (!end || *end || errno || x < lo || x > hi) {
        fprintf(stderr,
                "tqkv-bench: %s: invalid value '%s': expected an integer in %" PRIu64 "..%" PRIu64
                "\n",
                flag, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int
arg_u32(const char *flag, const char *v, uint32_t lo, uint32_t hi, uint32_t *out)
{
    uint64_t x;
    if (arg_u64(flag, v, lo, hi, &x) != 0)
        return -1;
    *out = (uint32_t)x;
    return 0;
}

static int
arg_double(const char *flag, const char *v, double lo, double hi, const char *what, double *out)
{
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "tqkv-bench: %s: invalid value '%s': expected %s\n", flag, v, what);
        return -1;
    }
    *out = x;
    return 0;
}

static int
arg_bits(const char *flag, const char *v, float *out)
{
    double x;
    const char *what = "0 (the server's policy) or 1, 1.5, 2, 2.5, 3, 3.5, 4";
    if (arg_double(flag, v, 0, 4, what, &x) != 0)
        return -1;
    if (x != 0 && (x < 1 || x * 2 != floor(x * 2))) {
        fprintf(stderr, "tqkv-bench: %s: invalid value '%s': expected %s\n", flag, v, what);
        return -1;
    }
    *out = (float)x;
    return 0;
}

/* Whether path can be opened for writing, without truncating an existing file (a file
 * this creates is removed again). Prints 'FLAG PATH: reason' and returns -1 if not. */
static int
probe_writable(const char *flag, const char *path)
{
    int existed = access(path, F_OK) == 0;
    FILE *f = fopen(path, "a");
    if (f == NULL) {
        fprintf(stderr, "tqkv-bench: %s %s: %s\n", flag, path, strerror(errno));
        return -1;
    }
    fclose(f);
    if (!existed)
        unlink(path);
    return 0;
}

/* ---- flags ---- */

#define FLAG_NOT_MINE 1 /* a flag parser's answer: not one of its flags */
/* a flag that takes a value, when the value is there (consumed: *i moves past it) */
#define ARG(name) (!strcmp(a, name) && v && ((*i)++, 1))

/* The flags of the workload (what the workers do). 0 when a was one and is good, 2 when
 * its value is bad (said on stderr), FLAG_NOT_MINE when it is not one. */
static int
flag_workload(const char *a, const char *v, int *i)
{
    uint32_t u32;
    if (ARG("--duration")) {
        if (arg_double("--duration", v, 0, 1e7, "seconds in 0..1e7", &C.duration) != 0)
            return 2;
    } else if (ARG("--ops")) {
        if (arg_u64("--ops", v, 0, UINT64_MAX, &C.ops) != 0)
            return 2;
    } else if (ARG("--concurrency")) {
        if (arg_u32("--concurrency", v, 1, 1024, &u32) != 0)
            return 2;
        C.concurrency = (int)u32;
    } else if (ARG("--model")) {
        if (set_model(v) != 0) {
            fprintf(stderr,
                    "tqkv-bench: --model: unknown model '%s' (llama3-8b, llama3-70b or tiny; "
                    "or --layers/--kv-heads/--head-dim)\n",
                    v);
            return 2;
        }
    } else if (ARG("--layers")) {
        if (arg_u32("--layers", v, 1, 1024, &C.layers) != 0)
            return 2;
    } else if (ARG("--kv-heads")) {
        if (arg_u32("--kv-heads", v, 1, 1024, &C.heads) != 0)
            return 2;
    } else if (ARG("--head-dim")) {
        if (arg_u32("--head-dim", v, 16, 1024, &C.dim) != 0)
            return 2;
    } else if (ARG("--block-tokens")) {
        if (arg_u32("--block-tokens", v, 1, 65536, &C.block_tokens) != 0)
            return 2;
    } else if (ARG("--seq-blocks")) {
        if (arg_u32("--seq-blocks", v, 1, 4096, &C.seq_blocks) != 0)
            return 2;
    } else if (ARG("--prefix-reuse")) {
        if (arg_double("--prefix-reuse", v, 0, 1, "a fraction in 0..1", &C.prefix_reuse) != 0)
            return 2;
    } else if (ARG("--phase")) {
        if (!strcmp(v, "prefill"))
            C.phase = PH_PREFILL;
        else if (!strcmp(v, "decode"))
            C.phase = PH_DECODE;
        else if (!strcmp(v, "mixed"))
            C.phase = PH_MIXED;
        else {
            fprintf(stderr, "tqkv-bench: --phase prefill|decode|mixed\n");
            return 2;
        }
    } else if (ARG("--transport")) {
        if (!strcmp(v, "tcp"))
            C.transport = TQKV_CLIENT_TRANSPORT_TCP;
        else if (!strcmp(v, "grpc"))
            C.transport = TQKV_CLIENT_TRANSPORT_GRPC;
        else {
            fprintf(stderr, "tqkv-bench: --transport tcp|grpc\n");
            return 2;
        }
    } else if (ARG("--encoding")) {
        if (!strcmp(v, "packed"))
            C.encoding = TQKV_CLIENT_PACKED;
        else if (!strcmp(v, "bf16"))
            C.encoding = TQKV_CLIENT_BF16;
        else {
            fprintf(stderr, "tqkv-bench: --encoding packed|bf16\n");
            return 2;
        }
    } else if (ARG("--key-bits")) {
        if (arg_bits("--key-bits", v, &C.key_bits) != 0)
            return 2;
    } else if (ARG("--value-bits")) {
        if (arg_bits("--value-bits", v, &C.value_bits) != 0)
            return 2;
    } else if (ARG("--namespace")) {
        C.ns = v;
    } else if (ARG("--working-set")) {
        if (arg_u32("--working-set", v, 0, 1u << 24, &C.working_set) != 0)
            return 2;
    } else if (ARG("--lease-ms")) {
        if (arg_u32("--lease-ms", v, 0, 3600000, &C.lease_ms) != 0)
            return 2;
    } else if (!strcmp(a, "--client-encode")) {
        C.client_encode = 1;
    } else if (ARG("--verify-every")) {
        if (arg_u32("--verify-every", v, 0, 1u << 30, &u32) != 0)
            return 2;
        C.verify_every = (int)u32;
    } else if (ARG("--seed")) {
        if (arg_u64("--seed", v, 0, UINT64_MAX, &C.seed) != 0)
            return 2;
    } else {
        return FLAG_NOT_MINE;
    }
    return 0;
}

/* The flags of the set-up (targets, servers, reports, security), answered as by
 * flag_workload. */
static int
flag_setup(const char *a, const char *v, int *i)
{
    if (ARG("--target")) {
        if (C.ntargets == MAX_TARGETS) {
            fprintf(stderr, "tqkv-bench: --target: more than %d targets\n", MAX_TARGETS);
            return 2;
        }
        C.targets[C.ntargets++] = v;
    } else if (ARG("--json")) {
        C.json = v;
    } else if (ARG("--csv")) {
        C.csv = v;
    } else if (ARG("--dns-server")) {
        C.dns = v;
    } else if (ARG("--resolve-interval-ms")) {
        if (arg_u32("--resolve-interval-ms", v, 1, 3600000, &C.resolve_ms) != 0)
            return 2;
    } else if (ARG("--plain-wire-gbps")) {
        if (tqkv_bench_tls_flag(a, v) < 0)
            return 2;
    } else if (ARG("--tls-ca")) {
        C.tls_ca = v;
    } else if (ARG("--tls-target-name")) {
        C.tls_name = v;
    } else if (ARG("--token")) {
        C.token = v;
    } else if (!strcmp(a, "--no-baselines")) {
        C.baselines = 0;
    } else if (!strcmp(a, "--no-hedge")) {
        C.no_hedge = 1;
    } else if (ARG("--spawn-server")) {
        C.spawn = v;
    } else if (ARG("--server-arg")) {
        if (C.nserver_args >= MAX_SERVER_ARGS) {
            fprintf(stderr, "tqkv-bench: --server-arg: more than %d server arguments\n",
                    MAX_SERVER_ARGS);
            return 2;
        }
        C.server_args[C.nserver_args++] = v;
    } else if (ARG("--dram-capacity")) {
        if (C.nserver_args + 2 > MAX_SERVER_ARGS) {
            fprintf(stderr, "tqkv-bench: --dram-capacity: more than %d server arguments\n",
                    MAX_SERVER_ARGS);
            return 2;
        }
        C.server_args[C.nserver_args++] = "--dram-capacity";
        C.server_args[C.nserver_args++] = v;
    } else if (ARG("--replicas")) {
        if (arg_u32("--replicas", v, 1, MAX_TARGETS, &C.replicas) != 0)
            return 2;
    } else if (ARG("--channels")) {
        if (arg_u32("--channels", v, 0, 1024, &C.channels) != 0)
            return 2;
    } else if (ARG("--deadline-ms")) {
        if (arg_u32("--deadline-ms", v, 1, 3600000, &C.deadline_ms) != 0)
            return 2;
    } else if (ARG("--connect-timeout-ms")) {
        if (arg_u32("--connect-timeout-ms", v, 1, 600000, &C.connect_ms) != 0)
            return 2;
    } else if (ARG("--call-base-ms")) {
        if (arg_u32("--call-base-ms", v, 1, 3600000, &C.call_base_ms) != 0)
            return 2;
    } else if (ARG("--call-floor-mb-s")) {
        if (arg_u32("--call-floor-mb-s", v, 1, 1000000, &C.call_floor_mb_s) != 0)
            return 2;
    } else if (ARG("--hedge-min-ms")) {
        if (arg_u32("--hedge-min-ms", v, 1, 600000, &C.hedge_min_ms) != 0)
            return 2;
    } else if (ARG("--hedge-max-ms")) {
        if (arg_u32("--hedge-max-ms", v, 1, 600000, &C.hedge_max_ms) != 0)
            return 2;
    } else {
        return FLAG_NOT_MINE;
    }
    return 0;
}
#undef ARG

/* The defaults, then the flags, into C. Returns -1 to run, else the exit status (0 after
 * --help or --version, 2 on bad flags, said on stderr). */
int
bench_parse_flags(int argc, char **argv)
{
    C.duration = 10;
    C.concurrency = 4;
    C.block_tokens = 256;
    C.seq_blocks = 4;
    C.prefix_reuse = 0.5;
    C.phase = PH_MIXED;
    C.encoding = TQKV_CLIENT_PACKED;
    C.ns = "bench";
    C.baselines = 1;
    C.replicas = 1;
    C.verify_every = 256;
    C.transport = TQKV_CLIENT_TRANSPORT_TCP;
    C.lease_ms = 100; /* Lookup-to-Get is milliseconds; longer leases pin more of the store */
    C.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    set_model("llama3-8b");

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r = flag_workload(a, v, &i);
        if (r == FLAG_NOT_MINE)
            r = flag_setup(a, v, &i);
        if (r != FLAG_NOT_MINE) {
            if (r != 0)
                return r;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--version")) {
            tqkv_version_fprint(stdout, "tqkv-bench");
            return 0;
        } else {
            fprintf(stderr, "tqkv-bench: unknown or incomplete option %s\n", a);
            usage();
            return 2;
        }
    }
    if (C.ntargets == 0 && C.spawn == NULL) {
        fprintf(stderr, "tqkv-bench: give --target HOST:PORT or --spawn-server PATH\n");
        usage();
        return 2;
    }
    if (C.duration <= 0 && C.ops == 0) {
        fprintf(stderr, "tqkv-bench: --duration 0 needs --ops N (a run must end)\n");
        return 2;
    }
    /* The report files must be writable before the run: they were opened only after it,
     * and a bad path was skipped in silence (exit 0, no report). */
    if (C.json && C.csv && strcmp(C.json, "-") && !strcmp(C.json, C.csv)) {
        fprintf(stderr, "tqkv-bench: --json and --csv name the same file %s\n", C.csv);
        return 2;
    }
    if ((C.json && strcmp(C.json, "-") && probe_writable("--json", C.json) != 0) ||
        (C.csv && probe_writable("--csv", C.csv) != 0))
        return 2;
    return -1;
}
