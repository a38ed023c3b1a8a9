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
} cfg_t;

static cfg_t C;

/* ---- shared state ---- */

typedef struct seq {
    tqkv_hash_t *h; /* seq_blocks hashes */
} seq_t;

static struct {
    pthread_mutex_t mu;
    seq_t s[SEQ_POOL];
    uint64_t n; /* sequences ever added */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER};

static _Atomic uint64_t pool_n; /* pool.n, readable without the lock */
static uint16_t *data_pool;     /* random BF16 */
static size_t data_elems, block_elems;

static struct {
    _Atomic uint64_t put_blocks, put_bf16, put_wire, get_found, get_missing, get_bf16, get_wire;
    _Atomic uint64_t client_crc; /* packed pages whose CRC libtqkv checked while copying */
    _Atomic uint64_t dc_pages;   /* pages that came over a TCP data channel */
    _Atomic uint64_t lookup_asked, lookup_hit, verify_failures, errors, ops, content_checks;
    _Atomic int stop;
} K;

/* (hash, layer) -> CRC and length of the first page read. Open addressing. */
typedef struct vent {
    uint64_t key;
    uint32_t crc, len;
} vent_t;
static vent_t *vtab;
static size_t vtab_used;
static pthread_mutex_t vtab_mu = PTHREAD_MUTEX_INITIALIZER;

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

static uint64_t
mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t
rnd(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return mix64(*s);
}

static double
rndu(uint64_t *s)
{
    return (double)(rnd(s) >> 11) * (1.0 / 9007199254740992.0);
}

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void
lat_add(lat_t *l, double sec)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 1024;
        uint32_t *nv = realloc(l->v, nc * sizeof *nv);
        if (nv == NULL)
            return;
        l->v = nv;
        l->cap = nc;
    }
    double us = sec * 1e6;
    l->v[l->n++] = us > 4e9 ? 4000000000u : (uint32_t)us;
}

static uint16_t
f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float
bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint64_t
hash64(const tqkv_hash_t *h)
{
    uint64_t x;
    memcpy(&x, h->bytes, 8);
    return x;
}

/* Source K and V of (hash, layer): windows of the data pool. */
static const uint16_t *
src_tensor(const tqkv_hash_t *h, uint32_t layer, int v)
{
    uint64_t r = mix64(hash64(h) ^ ((uint64_t)layer * 2 + (uint64_t)v + 1) * 0x2545F4914F6CDD1Dull);
    return data_pool + (r % (data_elems - block_elems));
}

static void
make_hash(tqkv_hash_t *out, const tqkv_hash_t *parent, uint64_t uniq)
{
    uint64_t p = parent ? hash64(parent) : 0;
    uint64_t a = mix64(C.seed ^ mix64(p) ^ mix64(uniq + 0x51ed));
    uint64_t b = mix64(a ^ 0xabcdef);
    out->len = 16;
    memcpy(out->bytes, &a, 8);
    memcpy(out->bytes + 8, &b, 8);
}

static _Atomic uint64_t uniq_ctr;

static void
verify_fail(const char *fmt, ...)
{
    uint64_t n = atomic_fetch_add(&K.verify_failures, 1);
    if (n < 10) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "tqkv-bench: verify failure: ");
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
        va_end(ap);
    }
}

/* First read of (hash, layer) records crc/len; later reads must match. Returns 0 for
 * a later read that matches, 1 for a first read (recorded), 2 when the table is full
 * (not recorded), -1 for a mismatch (counted as a verify failure). */
static int
vtab_check(uint64_t key, uint32_t crc, uint32_t len)
{
    size_t mask = ((size_t)1 << VTAB_BITS) - 1;
    int rc = 2;
    key |= 1;
    pthread_mutex_lock(&vtab_mu);
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (vtab[i].key == key) {
            if (vtab[i].crc != crc || vtab[i].len != len) {
                pthread_mutex_unlock(&vtab_mu);
                verify_fail("page changed between reads (crc %08x/%u vs %08x/%u)", vtab[i].crc,
                            vtab[i].len, crc, len);
                return -1;
            }
            rc = 0;
            break;
        }
        if (vtab[i].key == 0) {
            if (vtab_used < mask / 10 * 7) {
                vtab[i] = (vent_t){key, crc, len};
                vtab_used++;
                rc = 1;
            }
            break;
        }
    }
    pthread_mutex_unlock(&vtab_mu);
    return rc;
}

/* Relative L2 error of a decoded tensor against its source: the scalar reference
 * (double sums, the definition) and the one the workers run, in float lanes the
 * compiler keeps in vector registers (GCC/Clang vector extension, lowered to SSE2
 * without -mavx). The fast one was 4x quicker per 256K-element tensor (49 vs 189 us);
 * at 1 page in 32 the check was ~8% of the run's CPU. main() compares the
 * two before the run. */
static double
rel_err_f32_ref(const float *x, const uint16_t *src, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double a = bf2f(src[i]), d = (double)x[i] - a;
        e += d * d;
        s += a * a;
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

static double
rel_err_bf16_ref(const uint8_t *x, const uint16_t *src, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, x + 2 * i, 2);
        double a = bf2f(src[i]), d = (double)bf2f(b) - a;
        e += d * d;
        s += a * a;
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

typedef float v8f_t __attribute__((vector_size(32)));
typedef uint32_t v8u_t __attribute__((vector_size(32)));

/* x: n floats (x_f32) or n BF16 values at any alignment (x_bf16); one is NULL. */
static double
rel_err_fast(const float *x_f32, const uint8_t *x_bf16, const uint16_t *src, size_t n)
{
    v8f_t e0 = {0}, e1 = {0}, s0 = {0}, s1 = {0};
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8u_t ua, ub, xa, xb;
        v8f_t a0, a1, y0, y1;
        for (int j = 0; j < 8; j++) {
            ua[j] = (uint32_t)src[i + j] << 16;
            ub[j] = (uint32_t)src[i + 8 + j] << 16;
        }
        if (x_f32) {
            memcpy(&y0, x_f32 + i, sizeof y0);
            memcpy(&y1, x_f32 + i + 8, sizeof y1);
        } else {
            uint16_t h[16];
            memcpy(h, x_bf16 + 2 * i, sizeof h);
            for (int j = 0; j < 8; j++) {
                xa[j] = (uint32_t)h[j] << 16;
                xb[j] = (uint32_t)h[8 + j] << 16;
            }
            memcpy(&y0, &xa, sizeof y0);
            memcpy(&y1, &xb, sizeof y1);
        }
        memcpy(&a0, &ua, sizeof a0);
        memcpy(&a1, &ub, sizeof a1);
        v8f_t d0 = y0 - a0, d1 = y1 - a1;
        e0 += d0 * d0;
        e1 += d1 * d1;
        s0 += a0 * a0;
        s1 += a1 * a1;
    }
    double e = 0, s = 0;
    for (int j = 0; j < 8; j++) {
        e += (double)e0[j] + (double)e1[j];
        s += (double)s0[j] + (double)s1[j];
    }
    for (; i < n; i++) {
        double a = bf2f(src[i]), y;
        if (x_f32) {
            y = x_f32[i];
        } else {
            uint16_t b;
            memcpy(&b, x_bf16 + 2 * i, 2);
            y = bf2f(b);
        }
        e += (y - a) * (y - a);
        s += a * a;
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

static double
rel_err_f32(const float *x, const uint16_t *src, size_t n)
{
    return rel_err_fast(x, NULL, src, n);
}

static double
rel_err_bf16(const uint8_t *x, const uint16_t *src, size_t n)
{
    return rel_err_fast(NULL, x, src, n);
}

/* The fast relative errors against the references on pool data (a perturbed copy of
 * one window, odd lengths, an unaligned BF16 source). Returns 0 when they agree. */
static int
rel_err_selftest(void)
{
    size_t n = block_elems < 4099 ? block_elems : 4099;
    float *x = malloc(n * sizeof *x);
    uint8_t *b = malloc(2 * n + 1);
    int bad = 0;
    if (x == NULL || b == NULL) {
        free(x);
        free(b);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        x[i] = bf2f(data_pool[i + 7]) * 1.1f + 0.01f * (float)(i % 7);
        uint16_t h = f2bf(x[i] * 0.9f);
        memcpy(b + 1 + 2 * i, &h, 2);
    }
    for (size_t k = 0; k < 4 && 5 * k < n; k++) {
        size_t len = n - 5 * k; /* odd tails */
        const uint16_t *src = data_pool + 7;
        double r1 = rel_err_f32_ref(x, src, len), f1 = rel_err_f32(x, src, len);
        double r2 = rel_err_bf16_ref(b + 1, src, len), f2 = rel_err_bf16(b + 1, src, len);
        if (!(fabs(r1 - f1) <= 1e-4 * (r1 + 1e-6)) || !(fabs(r2 - f2) <= 1e-4 * (r2 + 1e-6)))
            bad = 1;
    }
    free(x);
    free(b);
    return bad;
}

/* ---- worker ops ---- */

typedef struct getctx {
    worker_t *w;
    const tqkv_hash_t *hashes;
    double t0;
    int first;
    uint64_t npages;
} getctx_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    getctx_t *g = arg;
    worker_t *w = g->w;
    const tqkv_hash_t *h = &g->hashes[pg->hash_index];
    if (!g->first) {
        g->first = 1;
        lat_add(&w->first, now_s() - g->t0);
    }
    atomic_fetch_add(&K.get_wire, pg->wire_bytes);
    if (!pg->found) {
        atomic_fetch_add(&K.get_missing, 1);
        return 0;
    }
    atomic_fetch_add(&K.get_found, 1);
    atomic_fetch_add(&K.get_bf16, (uint64_t)block_elems * 4);
    g->npages++;
    /* Replicas on different servers may encode with different seeds: the identity
     * rule holds per (hash, layer, server). */
    uint64_t key = hash64(h) ^ ((uint64_t)(pg->layer + 1) * 0x9E3779B97F4A7C15ull) ^
                   ((uint64_t)(pg->target + 1) * 0xD6E8FEB86659FD93ull);
    if (C.encoding == TQKV_CLIENT_PACKED) {
        tqkv_page_info_t info;
        char err[160];
        /* the client library checks the CRC in the pass that copies the page out of the
         * gRPC buffers (crc_checked); otherwise it is checked here */
        if (pg->crc_checked == 1)
            atomic_fetch_add(&K.client_crc, 1);
        if (pg->data_channel)
            atomic_fetch_add(&K.dc_pages, 1);
        if (tqkv_page_validate(pg->page, pg->page_len, pg->crc_checked != 1, &info, err,
                               sizeof err) != TQKV_OK) {
            verify_fail("layer %u: invalid page: %s", pg->layer, err);
            return 0;
        }
        if (info.shape.num_tokens != C.block_tokens || info.shape.num_kv_heads != C.heads ||
            info.shape.head_dim != C.dim) {
            verify_fail("layer %u: page shape %ux%ux%u", pg->layer, info.shape.num_tokens,
                        info.shape.num_kv_heads, info.shape.head_dim);
            return 0;
        }
        /* Every page is content-checked or byte-identical (same CRC32C and length) to a
         * content-checked read of the same (hash, layer, server): the first read of each
         * is decoded and compared with its source, later ones must match it; a random
         * 1 in --verify-every is decoded again. */
        int first = vtab_check(key, info.hdr->crc32c, (uint32_t)pg->page_len);
        if (first < 0)
            return 0;
        if (first > 0 || (C.verify_every > 0 && (rnd(&w->rng) % (uint64_t)C.verify_every) == 0)) {
            atomic_fetch_add(&K.content_checks, 1);
            if (tqkv_page_decode_f32(pg->page, pg->page_len, w->kf, w->vf) != TQKV_OK) {
                verify_fail("layer %u: decode failed", pg->layer);
                return 0;
            }
            double ek = rel_err_f32(w->kf, src_tensor(h, pg->layer, 0), block_elems);
            double ev = rel_err_f32(w->vf, src_tensor(h, pg->layer, 1), block_elems);
            if (!(ek < 0.3 && ev < 0.3))
                verify_fail("layer %u: decoded content off (rel err K %.3f V %.3f)", pg->layer, ek,
                            ev);
        }
    } else {
        if (pg->key_len != block_elems * 2 || pg->value_len != block_elems * 2) {
            verify_fail("layer %u: BF16 sizes %zu/%zu", pg->layer, pg->key_len, pg->value_len);
            return 0;
        }
        atomic_fetch_add(&K.content_checks, 1);
        double ek = rel_err_bf16(pg->key, src_tensor(h, pg->layer, 0), block_elems);
        double ev = rel_err_bf16(pg->value, src_tensor(h, pg->layer, 1), block_elems);
        if (!(ek < 0.3 && ev < 0.3))
            verify_fail("layer %u: BF16 content off (rel err K %.3f V %.3f)", pg->layer, ek, ev);
    }
    return 0;
}

static void
count_error(const char *what)
{
    uint64_t n = atomic_fetch_add(&K.errors, 1);
    if (n < 10) {
        const tqkv_client_error_t *e = tqkv_client_last_error();
        fprintf(stderr, "tqkv-bench: %s: %s (%s)\n", what, tqkv_status_name(e->status), e->message);
    }
}

static void
op_prefill(worker_t *w, int record)
{
    tqkv_hash_t *hs = calloc(C.seq_blocks, sizeof *hs);
    uint32_t reuse = 0;
    if (hs == NULL)
        return;
    pthread_mutex_lock(&pool.mu);
    if (pool.n > 0 && C.seq_blocks > 1 && rndu(&w->rng) < C.prefix_reuse) {
        uint64_t avail = pool.n < SEQ_POOL ? pool.n : SEQ_POOL;
        seq_t *s = &pool.s[rnd(&w->rng) % avail];
        reuse = 1 + (uint32_t)(rnd(&w->rng) % (C.seq_blocks - 1));
        memcpy(hs, s->h, reuse * sizeof *hs);
    }
    pthread_mutex_unlock(&pool.mu);
    for (uint32_t b = reuse; b < C.seq_blocks; b++)
        make_hash(&hs[b], b ? &hs[b - 1] : NULL, atomic_fetch_add(&uniq_ctr, 1));

    tqkv_put_opts_t po = {.key_bits = C.key_bits, .value_bits = C.value_bits};
    tqkv_put_t *p;
    int ok = 1;
    if (tqkv_client_put_begin(w->cl, &po, &p) != TQKV_OK) {
        count_error("put_begin");
        free(hs);
        return;
    }
    for (uint32_t b = reuse; b < C.seq_blocks && ok; b++) {
        for (uint32_t l = 0; l < C.layers && ok; l++) {
            tqkv_put_block_t pb = {.ns = C.ns,
                                   .hash = &hs[b],
                                   .parent = b ? &hs[b - 1] : NULL,
                                   .layer = l,
                                   .num_layers = C.layers,
                                   .shape = {C.block_tokens, C.heads, C.dim},
                                   .key = src_tensor(&hs[b], l, 0),
                                   .value = src_tensor(&hs[b], l, 1)};
            if (C.client_encode) {
                /* Encode here (as a GPU worker would) and Put the page. */
                tqkv_block_codec_t bc;
                memset(&bc, 0, sizeof bc);
                bc.k.bits_x2 = (uint8_t)(C.key_bits > 0 ? C.key_bits * 2 : 7);
                bc.v.bits_x2 = (uint8_t)(C.value_bits > 0 ? C.value_bits * 2 : 6);
                bc.rotation = TQKV_ROT_HADAMARD;
                bc.seed = mix64(hash64(&hs[b]) + l) | 1;
                size_t len = 0;
                char err[160];
                if (tqkv_page_encode(&pb.shape, &bc, pb.key, pb.value, w->page, w->page_cap, &len,
                                     err, sizeof err) != TQKV_OK) {
                    fprintf(stderr, "tqkv-bench: local encode: %s\n", err);
                    atomic_fetch_add(&K.errors, 1);
                    ok = 0;
                    break;
                }
                pb.page = w->page;
                pb.page_len = len;
            }
            double t0 = now_s(); /* the message only, not a local encode */
            if (tqkv_client_put_block(p, &pb) != TQKV_OK) {
                count_error("put_block");
                ok = 0;
                break;
            }
            if (record) {
                lat_add(&w->put, now_s() - t0);
                atomic_fetch_add(&K.put_blocks, 1);
                atomic_fetch_add(&K.put_bf16, (uint64_t)block_elems * 4);
            }
        }
    }
    tqkv_put_result_t res;
    if (tqkv_client_put_end(p, &res) != TQKV_OK) {
        count_error("put_end");
        ok = 0;
    } else if (record) {
        atomic_fetch_add(&K.put_wire, res.bytes_in);
    }
    if (!ok) {
        free(hs);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    seq_t *s = &pool.s[pool.n % SEQ_POOL];
    free(s->h);
    s->h = hs;
    pool.n++;
    atomic_store(&pool_n, pool.n);
    pthread_mutex_unlock(&pool.mu);
}

static void
op_decode(worker_t *w)
{
    tqkv_hash_t *hs = malloc(C.seq_blocks * sizeof *hs);
    if (hs == NULL)
        return;
    pthread_mutex_lock(&pool.mu);
    if (pool.n == 0) {
        pthread_mutex_unlock(&pool.mu);
        free(hs);
        return;
    }
    uint64_t avail = pool.n < SEQ_POOL ? pool.n : SEQ_POOL;
    memcpy(hs, pool.s[rnd(&w->rng) % avail].h, C.seq_blocks * sizeof *hs);
    pthread_mutex_unlock(&pool.mu);

    tqkv_lookup_req_t lq = {.ns = C.ns,
                            .hashes = hs,
                            .num_hashes = C.seq_blocks,
                            .num_layers = C.layers,
                            .lease_ms = C.lease_ms};
    uint32_t prefix = 0;
    double t0 = now_s();
    if (tqkv_client_lookup(w->cl, &lq, &prefix, NULL) != TQKV_OK) {
        count_error("lookup");
        free(hs);
        return;
    }
    lat_add(&w->lookup, now_s() - t0);
    atomic_fetch_add(&K.lookup_asked, C.seq_blocks);
    atomic_fetch_add(&K.lookup_hit, prefix);
    if (prefix > 0) {
        tqkv_get_req_t gq = {.ns = C.ns,
                             .hashes = hs,
                             .num_hashes = prefix,
                             .layer_begin = 0,
                             .layer_end = C.layers,
                             .encoding = C.encoding};
        getctx_t g = {.w = w, .hashes = hs, .t0 = now_s()};
        if (tqkv_client_get(w->cl, &gq, on_page, &g) != TQKV_OK)
            count_error("get");
        else
            lat_add(&w->get, now_s() - g.t0);
    }
    free(hs);
}

static _Atomic uint64_t ops_started;

static void *
worker_main(void *arg)
{
    worker_t *w = arg;
    while (!atomic_load(&K.stop)) {
        if (C.ops && atomic_fetch_add(&ops_started, 1) >= C.ops)
            break;
        int decode;
        if (C.phase == PH_PREFILL)
            decode = 0;
        else if (C.phase == PH_DECODE)
            decode = 1;
        else /* mixed: odd workers decode (once something is stored), even ones prefill */
            decode = (w->id % 2 == 1 || (C.concurrency == 1 && rndu(&w->rng) < 0.5)) &&
                     atomic_load(&pool_n) > 0;
        if (decode)
            op_decode(w);
        else
            op_prefill(w, 1);
        atomic_fetch_add(&K.ops, 1);
    }
    return NULL;
}

/* ---- percentiles ---- */

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct pct {
    double p50, p95, p99, p999;
    size_t n;
} pct_t;

static pct_t
percentiles(worker_t *ws, int n, size_t off)
{
    lat_t all = {0};
    pct_t r = {0};
    for (int i = 0; i < n; i++) {
        lat_t *l = (lat_t *)((char *)&ws[i] + off);
        for (size_t j = 0; j < l->n; j++)
            lat_add(&all, l->v[j] * 1e-6);
    }
    if (all.n == 0)
        return r;
    qsort(all.v, all.n, sizeof *all.v, cmp_u32);
#define PCT(q) (double)all.v[(size_t)((double)(all.n - 1) * (q))]
    r.p50 = PCT(0.50);
    r.p95 = PCT(0.95);
    r.p99 = PCT(0.99);
    r.p999 = PCT(0.999);
#undef PCT
    r.n = all.n;
    free(all.v);
    return r;
}

/* ---- spawned processes ---- */

typedef struct child {
    pid_t pid;
    int fd;
    pthread_t drain;
    int draining;
} child_t;

static void *
drain_main(void *arg)
{
    child_t *c = arg;
    char buf[4096];
    while (read(c->fd, buf, sizeof buf) > 0) {
    }
    return NULL;
}

/* Starts argv with stdout+stderr on a pipe; waits (up to 30 s) for a line containing
 * "listening on HOST:PORT" when want_port, writing "HOST:PORT" into addr. */
static int
child_start(child_t *c, char *const argv[], int want_port, char *addr, size_t addrlen)
{
    int pfd[2];
    memset(c, 0, sizeof *c);
    if (pipe(pfd) != 0)
        return -1;
    c->pid = fork();
    if (c->pid < 0)
        return -1;
    if (c->pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        close(pfd[1]);
        execv(argv[0], argv);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(pfd[1]);
    c->fd = pfd[0];
    if (want_port) {
        char line[4096];
        size_t n = 0;
        double t0 = now_s();
        int found = 0;
        fcntl(c->fd, F_SETFL, O_NONBLOCK);
        while (!found && now_s() - t0 < 30) {
            ssize_t r = read(c->fd, line + n, sizeof line - 1 - n);
            if (r == 0)
                break;
            if (r < 0) {
                if (errno != EAGAIN)
                    break;
                usleep(10000);
                continue;
            }
            n += (size_t)r;
            line[n] = '\0';
            char *p = strstr(line, "listening on ");
            if (p && strchr(p, '\n')) {
                p += strlen("listening on ");
                size_t k = strcspn(p, " \t\r\n");
                if (k < addrlen) {
                    memcpy(addr, p, k);
                    addr[k] = '\0';
                    found = 1;
                }
            }
            char *nl = strrchr(line, '\n');
            if (!found && nl && n > sizeof line / 2) {
                size_t rest = n - (size_t)(nl + 1 - line);
                memmove(line, nl + 1, rest);
                n = rest;
            }
        }
        fcntl(c->fd, F_SETFL, 0);
        if (!found) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, NULL, 0);
            close(c->fd);
            return -1;
        }
    }
    c->draining = pthread_create(&c->drain, NULL, drain_main, c) == 0;
    return 0;
}

static void
child_stop(child_t *c)
{
    if (c->pid <= 0)
        return;
    kill(c->pid, SIGTERM);
    for (int i = 0; i < 100; i++) {
        if (waitpid(c->pid, NULL, WNOHANG) == c->pid) {
            c->pid = 0;
            break;
        }
        usleep(50000);
    }
    if (c->pid > 0) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, NULL, 0);
        c->pid = 0;
    }
    if (c->draining)
        pthread_join(c->drain, NULL);
    close(c->fd);
}

static int
free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(s, (struct sockaddr *)&a, &al) != 0) {
        if (s >= 0)
            close(s);
        return -1;
    }
    close(s);
    return ntohs(a.sin_port);
}

static int
connect_port(int port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        close(s);
        return -1;
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return s;
}

static int
send_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int
recv_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* ---- baseline: raw TCP loopback ---- */

/* One connection of the baseline: a receiver thread reading `total` bytes in msg-byte
 * reads into one reused buffer, and a sender thread writing them from src (walked
 * cyclically). */
typedef struct tcpctx {
    int lfd, port;
    size_t total, msg;
    const uint8_t *src;
    size_t src_len;
    int ok;
} tcpctx_t;

static void *
tcp_recv_main(void *arg)
{
    tcpctx_t *t = arg;
    int fd = accept(t->lfd, NULL, NULL);
    char *buf = malloc(t->msg);
    size_t got = 0;
    if (fd >= 0 && buf) {
        while (got < t->total) {
            size_t want = t->total - got < t->msg ? t->total - got : t->msg;
            if (recv_all(fd, buf, want) != 0)
                break;
            got += want;
        }
    }
    t->ok = got == t->total;
    free(buf);
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void *
tcp_send_main(void *arg)
{
    tcpctx_t *t = arg;
    int fd = connect_port(t->port);
    size_t sent = 0, off = 0;
    while (fd >= 0 && sent < t->total) {
        size_t n = t->total - sent < t->msg ? t->total - sent : t->msg;
        if (off + n > t->src_len)
            off = 0;
        if (send_all(fd, t->src + off, n) != 0)
            break;
        sent += n;
        off += n;
    }
    if (fd >= 0) {
        shutdown(fd, SHUT_WR);
        char c;
        while (recv(fd, &c, 1, 0) > 0) /* until the receiver has read all and closed */
            ;
        close(fd);
    }
    return NULL;
}

/* Streams total bytes in msg-byte sends over conns connections at once (as many as the run
 * has workers, so the ceiling is measured with the same parallelism), each with its own
 * sender and receiver thread; returns the aggregate GB/s, or 0 when a connection failed. */
static double
baseline_tcp(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (conns < 1)
        conns = 1;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, conns) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &al) != 0) {
        if (lfd >= 0)
            close(lfd);
        return 0;
    }
    tcpctx_t *t = calloc((size_t)conns, sizeof *t);
    pthread_t *th = calloc((size_t)conns * 2, sizeof *th);
    if (!t || !th) {
        free(t);
        free(th);
        close(lfd);
        return 0;
    }
    size_t per = total / (size_t)conns / msg * msg, sum = 0;
    if (per == 0)
        per = msg;
    for (int i = 0; i < conns; i++)
        t[i] = (tcpctx_t){.lfd = lfd,
                          .port = ntohs(a.sin_port),
                          .total = per,
                          .msg = msg,
                          .src = src,
                          .src_len = src_len};
    double t0 = now_s();
    for (int i = 0; i < conns; i++) {
        pthread_create(&th[2 * i], NULL, tcp_recv_main, &t[i]);
        pthread_create(&th[2 * i + 1], NULL, tcp_send_main, &t[i]);
    }
    for (int i = 0; i < 2 * conns; i++)
        pthread_join(th[i], NULL);
    double dt = now_s() - t0;
    int ok = 1;
    for (int i = 0; i < conns; i++) {
        ok &= t[i].ok;
        sum += t[i].total;
    }
    close(lfd);
    free(t);
    free(th);
    return ok && dt > 0 ? (double)sum / dt / 1e9 : 0;
}

/* ---- baseline: Redis GET over RESP ---- */

typedef struct rconn {
    int fd;
    char buf[65536];
    size_t pos, len;
} rconn_t;

static int
r_getc(rconn_t *r)
{
    if (r->pos == r->len) {
        ssize_t n = recv(r->fd, r->buf, sizeof r->buf, 0);
        if (n <= 0)
            return -1;
        r->pos = 0;
        r->len = (size_t)n;
    }
    return (unsigned char)r->buf[r->pos++];
}

/* Reads one reply line ("+OK", "$123", "-ERR ..."). */
static int
r_line(rconn_t *r, char *line, size_t cap)
{
    size_t n = 0;
    for (;;) {
        int ch = r_getc(r);
        if (ch < 0)
            return -1;
        if (ch == '\n')
            break;
        if (ch != '\r' && n + 1 < cap)
            line[n++] = (char)ch;
    }
    line[n] = '\0';
    return 0;
}

static int
r_read(rconn_t *r, void *dst, size_t n)
{
    char *p = dst;
    size_t have = r->len - r->pos;
    size_t k = have < n ? have : n;
    memcpy(p, r->buf + r->pos, k);
    r->pos += k;
    return recv_all(r->fd, p + k, n - k);
}

static int
r_cmd(rconn_t *r, const char *cmd, const char *key, const void *val, size_t vlen)
{
    char hdr[256];
    int n;
    if (val)
        n = snprintf(hdr, sizeof hdr, "*3\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n$%zu\r\n", strlen(cmd),
                     cmd, strlen(key), key, vlen);
    else
        n = snprintf(hdr, sizeof hdr, "*2\r\n$%zu\r\n%s\r\n$%zu\r\n%s\r\n", strlen(cmd), cmd,
                     strlen(key), key);
    if (send_all(r->fd, hdr, (size_t)n) != 0)
        return -1;
    if (val && (send_all(r->fd, val, vlen) != 0 || send_all(r->fd, "\r\n", 2) != 0))
        return -1;
    return 0;
}

typedef struct redisctx {
    int port;
    size_t nkeys, msg;
    double until;
    _Atomic uint64_t bytes;
    int fail;
} redisctx_t;

static void *
redis_get_main(void *arg)
{
    redisctx_t *x = arg;
    rconn_t *r = calloc(1, sizeof *r);
    char *buf = malloc(x->msg);
    uint64_t s = (uint64_t)(uintptr_t)r;
    if (r == NULL || buf == NULL || (r->fd = connect_port(x->port)) < 0) {
        x->fail = 1;
        goto out;
    }
    while (now_s() < x->until) {
        char key[32], line[64];
        snprintf(key, sizeof key, "tqkv:%zu", (size_t)(rnd(&s) % x->nkeys));
        if (r_cmd(r, "GET", key, NULL, 0) != 0 || r_line(r, line, sizeof line) != 0 ||
            line[0] != '$' || (size_t)atoll(line + 1) != x->msg || r_read(r, buf, x->msg) != 0 ||
            r_line(r, line, sizeof line) != 0) {
            x->fail = 1;
            break;
        }
        atomic_fetch_add(&x->bytes, x->msg);
    }
    close(r->fd);
out:
    free(r);
    free(buf);
    return NULL;
}

static double
baseline_redis(size_t msg, int conc, double seconds)
{
    int port = free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    char *argv[] = {"redis-server", "--port",           ps,   "--bind",
                    "127.0.0.1",    "--save",           "",   "--appendonly",
                    "no",           "--protected-mode", "no", NULL};
    child_t ch;
    if (port <= 0 || child_start(&ch, argv, 0, NULL, 0) != 0)
        return -1;
    double rate = -1;
    rconn_t *r = calloc(1, sizeof *r);
    r->fd = -1;
    for (int i = 0; i < 300 && r->fd < 0; i++) {
        r->fd = connect_port(port);
        if (r->fd < 0)
            usleep(10000);
    }
    char line[256];
    /* PING x answers the bulk string "x": two lines. */
    if (r->fd < 0 || r_cmd(r, "PING", "x", NULL, 0) != 0 || r_line(r, line, sizeof line) != 0 ||
        r_line(r, line, sizeof line) != 0 || strcmp(line, "x") != 0) {
        fprintf(stderr, "tqkv-bench: redis baseline: no PING answer on port %d\n", port);
        goto out;
    }
    size_t nkeys = (256u << 20) / msg;
    if (nkeys < 4)
        nkeys = 4;
    if (nkeys > 1024)
        nkeys = 1024;
    for (size_t i = 0; i < nkeys; i++) {
        char key[32];
        snprintf(key, sizeof key, "tqkv:%zu", i);
        const uint8_t *v = (const uint8_t *)data_pool + (i * 4099 * 2) % (data_elems * 2 - msg);
        if (r_cmd(r, "SET", key, v, msg) != 0 || r_line(r, line, sizeof line) != 0 ||
            line[0] != '+') {
            fprintf(stderr, "tqkv-bench: redis baseline: SET failed: %s\n", line);
            goto out;
        }
    }
    redisctx_t x = {.port = port, .nkeys = nkeys, .msg = msg};
    pthread_t th[256];
    int n = conc < 256 ? conc : 256;
    double t0 = now_s();
    x.until = t0 + seconds;
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, redis_get_main, &x);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    double dt = now_s() - t0;
    if (x.fail)
        fprintf(stderr, "tqkv-bench: redis baseline: GET failed\n");
    else if (dt > 0)
        rate = (double)atomic_load(&x.bytes) / dt / 1e9;
out:
    if (r->fd >= 0)
        close(r->fd);
    free(r);
    child_stop(&ch);
    return rate;
}

static int
have_redis(void)
{
    const char *path = getenv("PATH");
    char buf[4096];
    if (path == NULL)
        return 0;
    snprintf(buf, sizeof buf, "%s", path);
    for (char *d = strtok(buf, ":"); d; d = strtok(NULL, ":")) {
        char f[4200];
        snprintf(f, sizeof f, "%s/redis-server", d);
        if (access(f, X_OK) == 0)
            return 1;
    }
    return access("/usr/bin/redis-server", X_OK) == 0;
}

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

static void
print_pct(FILE *f, const char *name, pct_t p)
{
    fprintf(f, "  %-16s %10zu %10.0f %10.0f %10.0f %10.0f\n", name, p.n, p.p50, p.p95, p.p99,
            p.p999);
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

/* Closes (stdout: flushes) a report file. Returns -1 when any write to it failed. */
static int
report_close(FILE *f)
{
    int err = ferror(f);
    if (f == stdout)
        return fflush(f) != 0 || err ? -1 : 0;
    return fclose(f) != 0 || err ? -1 : 0;
}

int
main(int argc, char **argv)
{
    static char spawned_addr[128];
    child_t server = {0};
    int rc = 1, report_failed = 0;

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
#define ARG(name) (!strcmp(a, name) && v && (i++, 1))
        uint32_t u32;
        if (ARG("--target")) {
            if (C.ntargets == MAX_TARGETS) {
                fprintf(stderr, "tqkv-bench: --target: more than %d targets\n", MAX_TARGETS);
                return 2;
            }
            C.targets[C.ntargets++] = v;
        } else if (ARG("--duration")) {
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
#undef ARG
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
    signal(SIGPIPE, SIG_IGN);

    block_elems = (size_t)C.block_tokens * C.heads * C.dim;
    data_elems = block_elems * 2 + ((size_t)8 << 20);
    data_pool = malloc(data_elems * sizeof *data_pool);
    vtab = calloc((size_t)1 << VTAB_BITS, sizeof *vtab);
    if (data_pool == NULL || vtab == NULL) {
        fprintf(stderr, "tqkv-bench: out of memory\n");
        return 1;
    }
    {
        uint64_t s = C.seed;
        for (size_t i = 0; i < data_elems; i += 2) {
            double u1 = rndu(&s) + 1e-12, u2 = rndu(&s);
            double r = sqrt(-2 * log(u1));
            data_pool[i] = f2bf((float)(r * cos(6.283185307179586 * u2)));
            if (i + 1 < data_elems)
                data_pool[i + 1] = f2bf((float)(r * sin(6.283185307179586 * u2)));
        }
    }

    if (rel_err_selftest() != 0) {
        fprintf(stderr, "tqkv-bench: content-check self-test failed (fast vs reference)\n");
        return 1;
    }

    if (C.spawn) {
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
        if (child_start(&server, sargv, 1, spawned_addr, sizeof spawned_addr) != 0) {
            fprintf(stderr, "tqkv-bench: %s did not report 'listening on HOST:PORT'\n", C.spawn);
            return 1;
        }
        C.targets[C.ntargets++] = spawned_addr;
        fprintf(stderr, "tqkv-bench: spawned %s on %s (pid %d)\n", C.spawn, spawned_addr,
                (int)server.pid);
    }

    tqkv_client_opts_t co = {
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
        .deadline_ms =
            C.duration > 0 && C.duration < 45 ? (uint32_t)(C.duration * 1000) + 15000 : 60000};
    tqkv_client_t *cl;
    if (tqkv_client_create(&co, &cl) != TQKV_OK) {
        fprintf(stderr, "tqkv-bench: %s\n", tqkv_client_last_error()->message);
        goto out_server;
    }
    /* Every target answers health before the run: calls wait for a connection (one
     * target) up to their 60 s deadline, so an unreachable or mistyped target would
     * otherwise hang every worker for a minute per call and still exit with a table. */
    {
        tqkv_client_opts_t po = co;
        tqkv_client_t *probe;
        po.replicas = 1;
        po.channels_per_target = 1;
        po.wait_for_ready = 1;
        po.deadline_ms = 15000;
        if (tqkv_client_create(&po, &probe) != TQKV_OK) {
            fprintf(stderr, "tqkv-bench: %s\n", tqkv_client_last_error()->message);
            tqkv_client_destroy(cl);
            goto out_server;
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
        if (unready) {
            tqkv_client_destroy(cl);
            goto out_server;
        }
    }

    worker_t *ws = calloc((size_t)C.concurrency, sizeof *ws);
    for (int i = 0; i < C.concurrency; i++) {
        ws[i].id = i;
        ws[i].cl = cl;
        ws[i].rng = mix64(C.seed + (uint64_t)i * 7919);
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
            goto out_client;
        }
    }
    if (C.phase == PH_DECODE) {
        /* An untimed working set to read back. */
        uint32_t n = C.working_set ? C.working_set : (uint32_t)C.concurrency * 2;
        for (uint32_t i = 0; i < n; i++)
            op_prefill(&ws[i % (uint32_t)C.concurrency], 0);
        if (pool.n == 0) {
            fprintf(stderr, "tqkv-bench: could not store the working set\n");
            goto out_client;
        }
    }
    atomic_store(&K.errors, 0);

    FILE *csv = C.csv ? fopen(C.csv, "w") : NULL;
    if (C.csv && csv == NULL) {
        fprintf(stderr, "tqkv-bench: --csv %s: %s\n", C.csv, strerror(errno));
        goto out_client;
    }
    if (csv)
        fprintf(csv, "t_s,put_gbps,get_bf16_gbps,get_wire_gbps,pages_per_s,hit_rate,"
                     "verify_failures,errors,hit_rate_interval,targets\n");
    int tty = isatty(2);
    double t0 = now_s();
    for (int i = 0; i < C.concurrency; i++)
        pthread_create(&ws[i].th, NULL, worker_main, &ws[i]);
    uint64_t lp = 0, lg = 0, lw = 0, lpg = 0, la = 0, lh = 0;
    double lt = t0;
    /* Not a terminal (a Kubernetes Job's log, a CI file): a whole progress line every
     * PROGRESS_S seconds instead of the \r-rewritten one, so the log shows the run is alive. */
    const double PROGRESS_S = 5.0;
    uint64_t qp = 0, qg = 0, qw = 0, qpg = 0;
    double qt = t0;
    int running = 1;
    while (running) {
        usleep(100000);
        double t = now_s();
        if (C.duration > 0 && t - t0 >= C.duration)
            atomic_store(&K.stop, 1);
        if (C.ops && atomic_load(&K.ops) >= C.ops)
            atomic_store(&K.stop, 1);
        if (atomic_load(&K.stop))
            running = 0;
        if (t - lt >= 1.0 || !running) {
            uint64_t p = atomic_load(&K.put_bf16), g = atomic_load(&K.get_bf16),
                     w = atomic_load(&K.get_wire), pg = atomic_load(&K.get_found);
            double dt = t - lt;
            uint64_t asked = atomic_load(&K.lookup_asked);
            uint64_t hit = atomic_load(&K.lookup_hit);
            double hr = asked ? (double)hit / (double)asked : 0;
            double hri = asked > la ? (double)(hit - lh) / (double)(asked - la) : 0;
            if (tty)
                fprintf(stderr,
                        "\r[%5.1fs] put %6.2f GB/s  get %6.2f GB/s bf16-eq (%5.2f wire)  %8.0f "
                        "pages/s  hit %5.1f%%  verify-fail %" PRIu64 "  err %" PRIu64 "   ",
                        t - t0, (double)(p - lp) / dt / 1e9, (double)(g - lg) / dt / 1e9,
                        (double)(w - lw) / dt / 1e9, (double)(pg - lpg) / dt, hr * 100,
                        atomic_load(&K.verify_failures), atomic_load(&K.errors));
            if (csv)
                fprintf(csv, "%.2f,%.4f,%.4f,%.4f,%.1f,%.4f,%" PRIu64 ",%" PRIu64 ",%.4f,%zu\n",
                        t - t0, (double)(p - lp) / dt / 1e9, (double)(g - lg) / dt / 1e9,
                        (double)(w - lw) / dt / 1e9, (double)(pg - lpg) / dt, hr,
                        atomic_load(&K.verify_failures), atomic_load(&K.errors), hri,
                        tqkv_client_num_targets(cl));
            if (csv)
                fflush(csv); /* a live time series: plot it while the run goes on */
            lp = p, lg = g, lw = w, lpg = pg, lt = t, la = asked, lh = hit;
        }
        if (!tty && (t - qt >= PROGRESS_S || !running)) {
            uint64_t p = atomic_load(&K.put_bf16), g = atomic_load(&K.get_bf16),
                     w = atomic_load(&K.get_wire), pg = atomic_load(&K.get_found);
            double dt = t - qt > 1e-9 ? t - qt : 1e-9;
            uint64_t asked = atomic_load(&K.lookup_asked);
            fprintf(stderr,
                    "tqkv-bench: progress %.1fs%s put %.2f GB/s get %.2f GB/s bf16-eq (%.2f "
                    "wire) %.0f pages/s hit %.1f%% ops %" PRIu64 " verify-fail %" PRIu64
                    " err %" PRIu64 "\n",
                    t - t0, running ? "" : " (end)", (double)(p - qp) / dt / 1e9,
                    (double)(g - qg) / dt / 1e9, (double)(w - qw) / dt / 1e9,
                    (double)(pg - qpg) / dt,
                    asked ? 100.0 * (double)atomic_load(&K.lookup_hit) / (double)asked : 0.0,
                    (uint64_t)atomic_load(&K.ops), atomic_load(&K.verify_failures),
                    atomic_load(&K.errors));
            fflush(stderr);
            qp = p, qg = g, qw = w, qpg = pg, qt = t;
        }
    }
    for (int i = 0; i < C.concurrency; i++)
        pthread_join(ws[i].th, NULL);
    double elapsed = now_s() - t0;
    if (tty)
        fputc('\n', stderr);
    if (csv && report_close(csv) != 0) {
        fprintf(stderr, "tqkv-bench: --csv %s: write failed: %s\n", C.csv, strerror(errno));
        report_failed = 1;
    }

    tqkv_client_stats_t sst;
    int have_stats = tqkv_client_stats(cl, C.ns, &sst) == TQKV_OK;

    double put_gbps = (double)K.put_bf16 / elapsed / 1e9;
    double put_wire_gbps = (double)K.put_wire / elapsed / 1e9;
    double bf16_gbps = (double)K.get_bf16 / elapsed / 1e9;
    double wire_gbps = (double)K.get_wire / elapsed / 1e9;
    double pages_s = (double)K.get_found / elapsed;
    double hit = K.lookup_asked ? (double)K.lookup_hit / (double)K.lookup_asked : 0;
    pct_t pp = percentiles(ws, C.concurrency, offsetof(worker_t, put));
    pct_t pl = percentiles(ws, C.concurrency, offsetof(worker_t, lookup));
    pct_t pgt = percentiles(ws, C.concurrency, offsetof(worker_t, get));
    pct_t pf = percentiles(ws, C.concurrency, offsetof(worker_t, first));

    double tcp = -1, tcp_block = -1, redis = -1, tls = -1, cipher_gbps = 0;
    char tls_suite[64] = "";
    size_t msg = block_elems * 4, wmsg = msg;
    if (C.baselines) {
        size_t total = K.get_wire > K.put_wire ? K.get_wire : K.put_wire;
        if (total < ((size_t)256 << 20))
            total = (size_t)256 << 20;
        if (total > ((size_t)2 << 30))
            total = (size_t)2 << 30;
        /* The raw pair sends what tqkv sent, in messages of the same size: the mean Get
         * message when Gets ran (packed pages), else the BF16 block of a Put. It also runs at
         * the BF16 block size, which a reader may compare with the Redis row. */
        uint64_t nget = K.get_found + K.get_missing;
        wmsg = nget && K.get_wire ? (size_t)(K.get_wire / nget) : msg;
        if (wmsg < 4096)
            wmsg = 4096;
        size_t tw = total - total % wmsg, tb = total - total % msg;
        /* Best of three: the loopback ceiling on a machine that may be busy. */
        for (int rep = 0; rep < 3; rep++) {
            double r =
                baseline_tcp(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2, C.concurrency);
            if (r > tcp)
                tcp = r;
            if (wmsg != msg) {
                r = baseline_tcp(tb, msg, (const uint8_t *)data_pool, data_elems * 2,
                                 C.concurrency);
                if (r > tcp_block)
                    tcp_block = r;
            }
        }
        if (wmsg == msg)
            tcp_block = tcp;
        if (have_redis())
            redis = baseline_redis(msg, C.concurrency, C.duration < 3 ? C.duration : 3);
        if (C.tls_ca) {
            /* A TLS run: the ceiling is a raw TLS pair with the data channels' settings
             * (same suite, same record batching), and the cipher's own speed. */
            for (int rep = 0; rep < 3; rep++) {
                char suite[64];
                double r = tqkv_bench_tls_pair(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2,
                                               C.concurrency, suite, sizeof suite);
                if (r > tls) {
                    tls = r;
                    snprintf(tls_suite, sizeof tls_suite, "%s", suite);
                }
            }
            cipher_gbps = tqkv_bench_cipher_speed("aes-128-gcm", 1);
            tqkv_bench_tls_measure(tw, wmsg, (const uint8_t *)data_pool, data_elems * 2,
                                   C.concurrency);
        }
    }

    FILE *o = stdout;
    fprintf(o, "\ntqkv-bench: %zu target(s), %d workers, %.1f s, phase %s, encoding %s\n",
            C.ntargets, C.concurrency, elapsed,
            C.phase == PH_PREFILL  ? "prefill"
            : C.phase == PH_DECODE ? "decode"
                                   : "mixed",
            C.encoding == TQKV_CLIENT_PACKED ? "packed" : "bf16");
    fprintf(o,
            "  model: %u layers, %u kv heads, head_dim %u, %u-token blocks (%.2f MiB BF16 "
            "K+V per block-layer), %u blocks/sequence, prefix reuse %.2f\n",
            C.layers, C.heads, C.dim, C.block_tokens, (double)msg / 1048576.0, C.seq_blocks,
            C.prefix_reuse);
    fprintf(o, "  %-34s %12s\n", "metric", "value");
    fprintf(o, "  %-34s %12.3f\n", "Get BF16-equivalent GB/s", bf16_gbps);
    fprintf(o, "  %-34s %12.3f\n", "Get wire GB/s", wire_gbps);
    fprintf(o, "  %-34s %12.0f\n", "Get pages/s", pages_s);
    fprintf(o, "  %-34s %12.3f\n", "Put BF16 ingest GB/s", put_gbps);
    fprintf(o, "  %-34s %12.3f\n", "Put wire GB/s", put_wire_gbps);
    fprintf(o, "  %-34s %12.1f%%\n", "Lookup hit rate", hit * 100);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages found", K.get_found);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages missing", K.get_missing);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "CRC checked in libtqkv", K.client_crc);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages over TCP data channels", K.dc_pages);
    for (size_t t = 0; C.transport == TQKV_CLIENT_TRANSPORT_TCP && t < C.ntargets; t++) {
        const char *why = tqkv_client_data_channel_status(cl, t);
        if (why[0])
            fprintf(stderr, "tqkv-bench: %s: Gets used gRPC, no TCP data channel: %s\n",
                    C.targets[t], why);
    }
    fprintf(o, "  %-34s %12" PRIu64 "\n", "content checks", K.content_checks);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "verify failures", K.verify_failures);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "errors", K.errors);
    if (have_stats)
        fprintf(o, "  %-34s %12.2f\n", "server compression ratio", sst.compression_ratio);
    fprintf(o, "  latency (us)     %10s %10s %10s %10s %10s\n", "n", "p50", "p95", "p99", "p99.9");
    print_pct(o, "Put (per block)", pp);
    print_pct(o, "Lookup", pl);
    print_pct(o, "Get (per call)", pgt);
    print_pct(o, "Get first page", pf);
    if (C.baselines) {
        fprintf(o, "  baselines (same run; raw TCP in %.1f KiB messages, the mean Get message)\n",
                (double)wmsg / 1024.0);
        char lbl[64];
        snprintf(lbl, sizeof lbl, "raw TCP loopback GB/s, %d conn%s", C.concurrency,
                 C.concurrency == 1 ? "" : "s");
        fprintf(o, "  %-34s %12.3f  (best of 3; one per worker)\n", lbl, tcp);
        if (wmsg != msg)
            fprintf(o, "  %-34s %12.3f\n", "raw TCP, BF16-block messages", tcp_block);
        if (redis >= 0)
            fprintf(o, "  %-34s %12.3f\n", "Redis GET GB/s", redis);
        else
            fprintf(o, "  %-34s %12s\n", "Redis GET GB/s", "n/a");
        if (tcp > 0)
            fprintf(o, "  %-34s %12.2f\n", "Get wire / raw TCP", wire_gbps / tcp);
        if (tcp > 0)
            fprintf(o, "  %-34s %12.2f\n", "Get BF16-eq / raw TCP", bf16_gbps / tcp);
        if (redis > 0)
            fprintf(o, "  %-34s %12.2f\n", "Get BF16-eq / Redis", bf16_gbps / redis);
        if (C.tls_ca) {
            snprintf(lbl, sizeof lbl, "raw TLS loopback GB/s, %d conn%s", C.concurrency,
                     C.concurrency == 1 ? "" : "s");
            fprintf(o, "  %-34s %12.3f  (%s; best of 3)\n", lbl, tls,
                    tls_suite[0] ? tls_suite : "TLS pair failed");
            fprintf(o, "  %-34s %12.3f  (openssl speed -evp, 16 KiB, one core)\n",
                    "AES-128-GCM cipher GB/s", cipher_gbps);
            if (tls > 0)
                fprintf(o, "  %-34s %12.2f\n", "Get wire / raw TLS", wire_gbps / tls);
            if (tcp > 0 && tls > 0)
                fprintf(o, "  %-34s %12.2f\n", "raw TLS / raw TCP", tls / tcp);
            tqkv_bench_tls_print(o, wire_gbps, tls);
        }
    }
    fflush(o);

    if (C.json) {
        FILE *j = strcmp(C.json, "-") ? fopen(C.json, "w") : stdout;
        if (j == NULL) {
            fprintf(stderr, "tqkv-bench: --json %s: %s\n", C.json, strerror(errno));
            report_failed = 1;
        } else {
            fprintf(j,
                    "{\"bf16_equiv_gbps\": %.6f, \"wire_gbps\": %.6f, \"pages_per_s\": %.3f, "
                    "\"put_bf16_gbps\": %.6f, \"put_wire_gbps\": %.6f, "
                    "\"hit_rate\": %.6f, \"verify_failures\": %" PRIu64 ", \"errors\": %" PRIu64
                    ", \"pages_found\": %" PRIu64 ", \"pages_missing\": %" PRIu64
                    ", \"content_checks\": %" PRIu64 ", \"client_crc_checked\": %" PRIu64
                    ", \"data_channel_pages\": %" PRIu64 ", \"transport\": \"%s\""
                    ", \"elapsed_s\": %.3f, ",
                    bf16_gbps, wire_gbps, pages_s, put_gbps, put_wire_gbps, hit, K.verify_failures,
                    K.errors, K.get_found, K.get_missing, K.content_checks, K.client_crc,
                    K.dc_pages, C.transport == TQKV_CLIENT_TRANSPORT_TCP ? "tcp" : "grpc", elapsed);
            fprintf(j, "\"latency_us\": {");
            const char *names[] = {"Put", "Lookup", "Get", "GetFirstPage"};
            pct_t ps[] = {pp, pl, pgt, pf};
            for (int i = 0; i < 4; i++)
                fprintf(j,
                        "%s\"%s\": {\"p50\": %.0f, \"p95\": %.0f, \"p99\": %.0f, \"p999\": %.0f, "
                        "\"n\": %zu}",
                        i ? ", " : "", names[i], ps[i].p50, ps[i].p95, ps[i].p99, ps[i].p999,
                        ps[i].n);
            fprintf(j, "}, \"baselines\": {");
            if (C.baselines) {
                fprintf(j,
                        "\"raw_tcp_gbps\": %.6f, \"raw_tcp_msg_bytes\": %zu, "
                        "\"raw_tcp_bf16_block_gbps\": %.6f, \"raw_tcp_connections\": %d",
                        tcp, wmsg, tcp_block, C.concurrency);
                if (redis >= 0)
                    fprintf(j, ", \"redis_get_gbps\": %.6f", redis);
                fprintf(j,
                        ", \"ratios\": {\"wire_vs_raw_tcp\": %.4f, \"bf16_equiv_vs_raw_tcp\": %.4f",
                        tcp > 0 ? wire_gbps / tcp : 0, tcp > 0 ? bf16_gbps / tcp : 0);
                if (redis > 0)
                    fprintf(j, ", \"bf16_equiv_vs_redis\": %.4f", bf16_gbps / redis);
                if (C.tls_ca && tls > 0)
                    fprintf(j, ", \"wire_vs_raw_tls\": %.4f", wire_gbps / tls);
                fprintf(j, "}");
                if (C.tls_ca)
                    fprintf(j,
                            ", \"raw_tls_gbps\": %.6f, \"raw_tls_suite\": \"%s\", "
                            "\"aes_128_gcm_gbps\": %.6f",
                            tls, tls_suite, cipher_gbps);
                tqkv_bench_tls_json(j, wire_gbps, tls);
            }
            fprintf(j, "}}\n");
            if (report_close(j) != 0) {
                fprintf(stderr, "tqkv-bench: --json %s: write failed: %s\n", C.json,
                        strerror(errno));
                report_failed = 1;
            }
        }
    }
    rc = K.verify_failures != 0 ? 3 : K.errors != 0 ? 4 : report_failed ? 1 : 0;

out_client:
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
    tqkv_client_destroy(cl);
out_server:
    if (C.spawn)
        child_stop(&server);
    for (size_t i = 0; i < SEQ_POOL; i++)
        free(pool.s[i].h);
    free(vtab);
    free(data_pool);
    return rc;
}
