/* disk_get_bench.c - tqkv-disk-get-bench: disk Gets of a real tqkv-server against a raw
 * O_DIRECT read of the same records (tests/bench/disk_get_vs_fio.sh drives it with fio).
 *
 *   tqkv-disk-get-bench put --target H:P --count N [--tokens 256 --heads 8 --dim 128]
 *   tqkv-disk-get-bench get --target H:P --count N [--transport tcp|grpc] [--clients 4]
 *                           [--per-get 4] [--passes 5] [--warmup 1]
 *
 * put stores N blocks of one layer (layer 0, namespace "diskbench"), one after another
 * from one thread, BF16 from a fixed seed (the server encodes them). Block i has the
 * 16-byte hash "tqkv-dgb" + i (64-bit little-endian), so a segment reader can tell the
 * order of the Gets below (tests/bench/disk_records.py).
 * get: client c of C (one tqkv_client and one thread each) reads blocks
 * [c*N/C, (c+1)*N/C) in order, per-get consecutive blocks per Get (PACKED), passes times
 * after warmup untimed passes. Prints one line of key=value pairs: pages, the tiers they
 * came from (disk/dram), pages that came over a data channel, misses, errors, seconds
 * (wall, first Get of the timed passes to the last answer).
 * Exit status: 0 ok, 1 an error or a miss, 2 bad flags. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transport/client.h"

#define NS "diskbench"

static const char *g_target = "127.0.0.1:50051";
static int g_transport = TQKV_CLIENT_TRANSPORT_TCP;
static uint64_t g_count = 2000;
static uint32_t g_clients = 4, g_per_get = 4, g_passes = 5, g_warmup = 1;
static uint32_t g_tokens = 256, g_heads = 8, g_dim = 128;

static _Atomic uint64_t k_pages, k_disk, k_dram, k_dc, k_miss, k_err, k_bytes;

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void
make_hash(tqkv_hash_t *h, uint64_t i)
{
    memset(h, 0, sizeof(*h));
    h->len = 16;
    memcpy(h->bytes, "tqkv-dgb", 8);
    for (int b = 0; b < 8; b++)
        h->bytes[8 + b] = (uint8_t)(i >> (8 * b));
}

static tqkv_client_t *
client_new(void)
{
    tqkv_client_opts_t o = TQKV_CLIENT_OPTS_INIT;
    const char *t[1] = {g_target};
    o.targets = t;
    o.num_targets = 1;
    o.transport = g_transport;
    o.no_read_repair = 1;
    o.deadline_ms = 120000;
    tqkv_client_t *c = NULL;
    if (tqkv_client_create(&o, &c) != TQKV_OK) {
        fprintf(stderr, "tqkv-disk-get-bench: cannot create a client for %s: %s\n", g_target,
                tqkv_client_last_error()->message);
        return NULL;
    }
    return c;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint16_t
rnd_bf16(void)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    float f = (float)((double)(g_rng >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static int
do_put(void)
{
    tqkv_client_t *c = client_new();
    if (c == NULL)
        return 1;
    size_t elems = (size_t)g_tokens * g_heads * g_dim;
    uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
    if (k == NULL || v == NULL)
        return 1;
    double t0 = now_s();
    uint64_t stored = 0;
    for (uint64_t i = 0; i < g_count;) {
        tqkv_put_t *p = NULL;
        if (tqkv_client_put_begin(c, NULL, &p) != TQKV_OK) {
            fprintf(stderr, "tqkv-disk-get-bench: put_begin: %s\n",
                    tqkv_client_last_error()->message);
            return 1;
        }
        for (uint64_t n = 0; n < 64 && i < g_count; n++, i++) {
            for (size_t e = 0; e < elems; e++)
                k[e] = rnd_bf16(), v[e] = rnd_bf16();
            tqkv_hash_t h;
            make_hash(&h, i);
            tqkv_put_block_t b = {.ns = NS,
                                  .hash = &h,
                                  .layer = 0,
                                  .num_layers = 1,
                                  .shape = {g_tokens, g_heads, g_dim},
                                  .key = k,
                                  .value = v};
            if (tqkv_client_put_block(p, &b) != TQKV_OK) {
                fprintf(stderr, "tqkv-disk-get-bench: put_block %llu: %s\n", (unsigned long long)i,
                        tqkv_client_last_error()->message);
                tqkv_client_put_abort(p);
                return 1;
            }
        }
        tqkv_put_result_t r;
        if (tqkv_client_put_end(p, &r) != TQKV_OK) {
            fprintf(stderr, "tqkv-disk-get-bench: put_end: %s\n",
                    tqkv_client_last_error()->message);
            return 1;
        }
        stored += r.blocks_stored + r.blocks_duplicate;
    }
    printf("put blocks=%llu stored=%llu seconds=%.3f\n", (unsigned long long)g_count,
           (unsigned long long)stored, now_s() - t0);
    free(k);
    free(v);
    tqkv_client_destroy(c);
    return stored == g_count ? 0 : 1;
}

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    (void)arg;
    if (!pg->found) {
        atomic_fetch_add(&k_miss, 1);
        return 0;
    }
    atomic_fetch_add(&k_pages, 1);
    atomic_fetch_add(&k_bytes, pg->page_len);
    if (pg->tier == TQKV_CLIENT_TIER_DISK)
        atomic_fetch_add(&k_disk, 1);
    else if (pg->tier == TQKV_CLIENT_TIER_DRAM)
        atomic_fetch_add(&k_dram, 1);
    if (pg->data_channel)
        atomic_fetch_add(&k_dc, 1);
    return 0;
}

typedef struct {
    uint32_t id;
    tqkv_client_t *cl;
    pthread_barrier_t *bar;
    int ok;
} worker_t;

static void
read_slice(worker_t *w)
{
    uint64_t lo = g_count * w->id / g_clients, hi = g_count * (w->id + 1) / g_clients;
    tqkv_hash_t hs[64];
    for (uint64_t i = lo; i < hi; i += g_per_get) {
        uint64_t n = hi - i < g_per_get ? hi - i : g_per_get;
        for (uint64_t j = 0; j < n; j++)
            make_hash(&hs[j], i + j);
        tqkv_get_req_t q = {.ns = NS,
                            .hashes = hs,
                            .num_hashes = n,
                            .layer_begin = 0,
                            .layer_end = 1,
                            .encoding = TQKV_CLIENT_PACKED};
        if (tqkv_client_get(w->cl, &q, on_page, NULL) != TQKV_OK) {
            atomic_fetch_add(&k_err, 1);
            if (atomic_load(&k_err) < 5)
                fprintf(stderr, "tqkv-disk-get-bench: get: %s\n",
                        tqkv_client_last_error()->message);
        }
    }
}

static void *
worker_main(void *arg)
{
    worker_t *w = arg;
    for (uint32_t p = 0; p < g_warmup; p++)
        read_slice(w);
    pthread_barrier_wait(w->bar); /* warm-up done */
    pthread_barrier_wait(w->bar); /* counters reset, clock started */
    for (uint32_t p = 0; p < g_passes; p++)
        read_slice(w);
    return NULL;
}

static int
do_get(void)
{
    worker_t w[64];
    pthread_t th[64];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, g_clients + 1);
    for (uint32_t i = 0; i < g_clients; i++) {
        w[i] = (worker_t){.id = i, .cl = client_new(), .bar = &bar};
        if (w[i].cl == NULL)
            return 1;
    }
    for (uint32_t i = 0; i < g_clients; i++)
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    pthread_barrier_wait(&bar);
    uint64_t warm_err = atomic_load(&k_err) + atomic_load(&k_miss);
    atomic_store(&k_pages, 0), atomic_store(&k_disk, 0), atomic_store(&k_dram, 0);
    atomic_store(&k_dc, 0), atomic_store(&k_miss, 0), atomic_store(&k_bytes, 0);
    double t0 = now_s();
    pthread_barrier_wait(&bar);
    for (uint32_t i = 0; i < g_clients; i++)
        pthread_join(th[i], NULL);
    double dt = now_s() - t0;
    const char *dcs = tqkv_client_data_channel_status(w[0].cl, 0);
    printf("get transport=%s pages=%llu disk=%llu dram=%llu data_channel=%llu misses=%llu "
           "errors=%llu warmup_errors=%llu page_bytes=%llu seconds=%.4f pages_per_s=%.1f "
           "dc_status=\"%s\"\n",
           g_transport == TQKV_CLIENT_TRANSPORT_TCP ? "tcp" : "grpc", (unsigned long long)k_pages,
           (unsigned long long)k_disk, (unsigned long long)k_dram, (unsigned long long)k_dc,
           (unsigned long long)k_miss, (unsigned long long)k_err, (unsigned long long)warm_err,
           (unsigned long long)k_bytes, dt, (double)k_pages / dt, dcs != NULL ? dcs : "");
    for (uint32_t i = 0; i < g_clients; i++)
        tqkv_client_destroy(w[i].cl);
    pthread_barrier_destroy(&bar);
    return k_err || k_miss || warm_err ? 1 : 0;
}

static int
arg_u(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end = NULL;
    unsigned long long x = v != NULL ? strtoull(v, &end, 10) : 0;
    if (v == NULL || end == v || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "tqkv-disk-get-bench: %s wants an integer in [%llu, %llu]\n", flag,
                (unsigned long long)lo, (unsigned long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

int
main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "put") && strcmp(argv[1], "get"))) {
        fprintf(stderr,
                "usage: tqkv-disk-get-bench put|get --target H:P --count N [--transport "
                "tcp|grpc] [--clients 4] [--per-get 4] [--passes 5] [--warmup 1] [--tokens 256] "
                "[--heads 8] [--dim 128]\n");
        return 2;
    }
    for (int i = 2; i < argc; i += 2) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
        int rc = 0;
        if (!strcmp(f, "--target") && v != NULL) {
            g_target = v;
        } else if (!strcmp(f, "--transport") && v != NULL &&
                   (!strcmp(v, "tcp") || !strcmp(v, "grpc"))) {
            g_transport =
                !strcmp(v, "tcp") ? TQKV_CLIENT_TRANSPORT_TCP : TQKV_CLIENT_TRANSPORT_GRPC;
        } else if (!strcmp(f, "--count")) {
            rc = arg_u(f, v, 1, 1ull << 32, &g_count);
        } else if (!strcmp(f, "--clients")) {
            rc = arg_u(f, v, 1, 64, &x), g_clients = (uint32_t)x;
        } else if (!strcmp(f, "--per-get")) {
            rc = arg_u(f, v, 1, 64, &x), g_per_get = (uint32_t)x;
        } else if (!strcmp(f, "--passes")) {
            rc = arg_u(f, v, 1, 100000, &x), g_passes = (uint32_t)x;
        } else if (!strcmp(f, "--warmup")) {
            rc = arg_u(f, v, 0, 100, &x), g_warmup = (uint32_t)x;
        } else if (!strcmp(f, "--tokens")) {
            rc = arg_u(f, v, 1, 65536, &x), g_tokens = (uint32_t)x;
        } else if (!strcmp(f, "--heads")) {
            rc = arg_u(f, v, 1, 1024, &x), g_heads = (uint32_t)x;
        } else if (!strcmp(f, "--dim")) {
            rc = arg_u(f, v, 16, 1024, &x), g_dim = (uint32_t)x;
        } else {
            fprintf(stderr, "tqkv-disk-get-bench: unknown flag or bad value: %s\n", f);
            return 2;
        }
        if (rc != 0)
            return 2;
    }
    return !strcmp(argv[1], "put") ? do_put() : do_get();
}
