/* bench_workers.c - tqkv-bench's workers: prefill ops (Put a sequence of chained blocks,
 * all layers; part of it an earlier sequence's prefix) and decode ops (Lookup, then Get
 * layer-major, verifying every page: CRC, a first decode within 0.3 relative error of
 * what was Put, later reads alike), the block data they are made of, and latency
 * percentiles.
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

static _Atomic uint64_t pool_n; /* pool.n, readable without the lock */
static size_t vtab_used;
static pthread_mutex_t vtab_mu = PTHREAD_MUTEX_INITIALIZER;

uint64_t
bench_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t
bench_rnd(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return bench_mix64(*s);
}

double
bench_rndu(uint64_t *s)
{
    return (double)(bench_rnd(s) >> 11) * (1.0 / 9007199254740992.0);
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

uint16_t
bench_f2bf(float f)
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
    uint64_t r =
        bench_mix64(hash64(h) ^ ((uint64_t)layer * 2 + (uint64_t)v + 1) * 0x2545F4914F6CDD1Dull);
    return data_pool + (r % (data_elems - block_elems));
}

static void
make_hash(tqkv_hash_t *out, const tqkv_hash_t *parent, uint64_t uniq)
{
    uint64_t p = parent ? hash64(parent) : 0;
    uint64_t a = bench_mix64(C.seed ^ bench_mix64(p) ^ bench_mix64(uniq + 0x51ed));
    uint64_t b = bench_mix64(a ^ 0xabcdef);
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
    for (size_t i = bench_mix64(key) & mask;; i = (i + 1) & mask) {
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
int
bench_rel_err_selftest(void)
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
        uint16_t h = bench_f2bf(x[i] * 0.9f);
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
        lat_add(&w->first, tqkv_clock_s() - g->t0);
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
        if (first > 0 ||
            (C.verify_every > 0 && (bench_rnd(&w->rng) % (uint64_t)C.verify_every) == 0)) {
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

void
bench_op_prefill(worker_t *w, int record)
{
    tqkv_hash_t *hs = calloc(C.seq_blocks, sizeof *hs);
    uint32_t reuse = 0;
    if (hs == NULL)
        return;
    pthread_mutex_lock(&pool.mu);
    if (pool.n > 0 && C.seq_blocks > 1 && bench_rndu(&w->rng) < C.prefix_reuse) {
        uint64_t avail = pool.n < SEQ_POOL ? pool.n : SEQ_POOL;
        seq_t *s = &pool.s[bench_rnd(&w->rng) % avail];
        reuse = 1 + (uint32_t)(bench_rnd(&w->rng) % (C.seq_blocks - 1));
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
                bc.seed = bench_mix64(hash64(&hs[b]) + l) | 1;
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
            double t0 = tqkv_clock_s(); /* the message only, not a local encode */
            if (tqkv_client_put_block(p, &pb) != TQKV_OK) {
                count_error("put_block");
                ok = 0;
                break;
            }
            if (record) {
                lat_add(&w->put, tqkv_clock_s() - t0);
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
    memcpy(hs, pool.s[bench_rnd(&w->rng) % avail].h, C.seq_blocks * sizeof *hs);
    pthread_mutex_unlock(&pool.mu);

    tqkv_lookup_req_t lq = {.ns = C.ns,
                            .hashes = hs,
                            .num_hashes = C.seq_blocks,
                            .num_layers = C.layers,
                            .lease_ms = C.lease_ms};
    uint32_t prefix = 0;
    double t0 = tqkv_clock_s();
    if (tqkv_client_lookup(w->cl, &lq, &prefix, NULL) != TQKV_OK) {
        count_error("lookup");
        free(hs);
        return;
    }
    lat_add(&w->lookup, tqkv_clock_s() - t0);
    atomic_fetch_add(&K.lookup_asked, C.seq_blocks);
    atomic_fetch_add(&K.lookup_hit, prefix);
    if (prefix > 0) {
        tqkv_get_req_t gq = {.ns = C.ns,
                             .hashes = hs,
                             .num_hashes = prefix,
                             .layer_begin = 0,
                             .layer_end = C.layers,
                             .encoding = C.encoding};
        getctx_t g = {.w = w, .hashes = hs, .t0 = tqkv_clock_s()};
        if (tqkv_client_get(w->cl, &gq, on_page, &g) != TQKV_OK)
            count_error("get");
        else
            lat_add(&w->get, tqkv_clock_s() - g.t0);
    }
    free(hs);
}

static _Atomic uint64_t ops_started;

void
bench_op_done(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint64_t last = atomic_exchange(&K.last_op_ns, now);
    if (last == 0 || now <= last)
        return;
    uint64_t gap = now - last, m = atomic_load(&K.max_gap_ns);
    while (gap > m) {
        if (atomic_compare_exchange_weak(&K.max_gap_ns, &m, gap)) {
            atomic_store(&K.max_gap_end_ns, now);
            break;
        }
    }
}

void *
bench_worker_main(void *arg)
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
            decode = (w->id % 2 == 1 || (C.concurrency == 1 && bench_rndu(&w->rng) < 0.5)) &&
                     atomic_load(&pool_n) > 0;
        if (decode)
            op_decode(w);
        else
            bench_op_prefill(w, 1);
        atomic_fetch_add(&K.ops, 1);
        bench_op_done();
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

pct_t
bench_percentiles(worker_t *ws, int n, size_t off)
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
