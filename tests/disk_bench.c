/* disk_bench.c - tqkv-disk-bench: the disk tier next to raw reads of the same bytes, in
 * one run. A command that prints tables, not a test (docs/disk.md).
 *
 *   tqkv-disk-bench [--dir DIR] [--pages N] [--page-bytes B] [--threads Q] [--seconds S]
 *
 * 1. Get of pages from the disk tier (tqkv_disk_get, Q threads = queue depth Q, random
 *    keys), with io_uring and with the thread pool, next to the bench's own O_DIRECT
 *    pread of the same records (same offsets, sizes and Q) from the same files; and
 *    through the store (tqkv_store_get with a DRAM far smaller than the data: read,
 *    check, promote into DRAM).
 * 2. Put through the store with room in DRAM vs with DRAM full (every Put evicts,
 *    demoting to disk), both writing through to the disk tier.
 * 3. Warm restart: index rebuild of the segments (page cache dropped when allowed), next
 *    to a raw sequential O_DIRECT read of the same files.
 * 4. Index RAM per disk-resident page.
 * 5. Leaf-first reclaim: sequences of 8 linked blocks through a tier a third of their
 *    size, plain FIFO vs copying prefix records forward (relocate 0.25, 0.5): write
 *    amplification, Put rate, and how many sequences keep their first block.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/disk.h"
#include "cache/disk_format.h"
#include "cache/disk_io.h"
#include "cache/store.h"

static const char *g_dir = "/tmp/tqkv-disk-bench";
static unsigned g_pages = 4000, g_threads = 8;
static size_t g_page_bytes = 32768;
static double g_seconds = 3.0;
static uint64_t g_segment_bytes = 0; /* 0: the tier's default (256 MiB) */

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int
rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb;
    (void)flag;
    (void)f;
    return remove(p);
}

static void
rm_dir(const char *d)
{
    nftw(d, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static uint64_t
sm64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

typedef struct key {
    uint8_t hash[32];
    tqkv_block_key_t k;
} key_t_;

static key_t_ *g_keys;

static void
make_keys(unsigned n)
{
    g_keys = calloc(n, sizeof(*g_keys));
    for (unsigned i = 0; i < n; i++) {
        uint64_t s = i * 7919u + 1;
        for (int j = 0; j < 4; j++) {
            uint64_t v = sm64(&s);
            memcpy(g_keys[i].hash + 8 * j, &v, 8);
        }
        g_keys[i].k = (tqkv_block_key_t){"bench", 5, g_keys[i].hash, 32, 0};
    }
}

static void
fill(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = sm64(&seed);
        memcpy(p + i, &v, 8);
    }
}

static void
drop_caches(int *dropped)
{
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    *dropped = fd >= 0 && write(fd, "1", 1) == 1;
    if (fd >= 0)
        close(fd);
}

/* ---- timed parallel loops ---- */

typedef struct job {
    int kind; /* 0 disk get, 1 raw pread, 2 store get, 3 store prefetch of 16 + gets */
    tqkv_disk_t *d;
    tqkv_store_t *s;
    unsigned id;
    double until;
    uint64_t ops, bytes, errors;
} job_t;

/* Raw targets: the file and offset of each key's record. */
static int *g_fd;
static uint64_t *g_off, *g_len;

static void *
job_main(void *arg)
{
    job_t *j = arg;
    uint64_t seed = 0x1234u + j->id;
    size_t cap = tqkv_disk_record_bytes(64, g_page_bytes) + 4096;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, cap) != 0)
        return NULL;
    while (now_s() < j->until) {
        if (j->kind == 3) {
            const uint8_t *hp[16];
            size_t hl[16];
            unsigned idx[16];
            for (int k = 0; k < 16; k++) {
                idx[k] = (unsigned)(sm64(&seed) % g_pages);
                hp[k] = g_keys[idx[k]].hash;
                hl[k] = 32;
            }
            tqkv_store_prefetch(j->s, "bench", 5, hp, hl, 16, 0, 1);
            for (int k = 0; k < 16; k++) {
                tqkv_page_ref_t *r;
                if (tqkv_store_get(j->s, &g_keys[idx[k]].k, &r) == TQKV_OK) {
                    j->bytes += tqkv_page_ref_len(r);
                    tqkv_page_ref_release(r);
                } else {
                    j->errors++;
                }
                j->ops++;
            }
            continue;
        }
        for (int k = 0; k < 16; k++) {
            unsigned i = (unsigned)(sm64(&seed) % g_pages);
            if (j->kind == 0) {
                tqkv_disk_page_t p;
                if (tqkv_disk_get(j->d, &g_keys[i].k, &p) == TQKV_OK) {
                    j->bytes += p.len;
                    tqkv_disk_page_free(&p);
                } else {
                    j->errors++;
                }
            } else if (j->kind == 1) {
                ssize_t n = pread(g_fd[i], buf, g_len[i], (off_t)g_off[i]);
                if (n == (ssize_t)g_len[i])
                    j->bytes += g_page_bytes; /* the same page bytes a Get hands out */
                else
                    j->errors++;
            } else {
                tqkv_page_ref_t *r;
                if (tqkv_store_get(j->s, &g_keys[i].k, &r) == TQKV_OK) {
                    j->bytes += tqkv_page_ref_len(r);
                    tqkv_page_ref_release(r);
                } else {
                    j->errors++;
                }
            }
            j->ops++;
        }
    }
    free(buf);
    return NULL;
}

static double
run_jobs(int kind, tqkv_disk_t *d, tqkv_store_t *s, double *ops_s, uint64_t *errors)
{
    pthread_t th[256];
    job_t jobs[256];
    unsigned q = g_threads > 256 ? 256 : g_threads;
    double t0 = now_s(), until = t0 + g_seconds;
    for (unsigned i = 0; i < q; i++) {
        jobs[i] = (job_t){kind, d, s, i, until, 0, 0, 0};
        pthread_create(&th[i], NULL, job_main, &jobs[i]);
    }
    uint64_t ops = 0, bytes = 0, err = 0;
    for (unsigned i = 0; i < q; i++) {
        pthread_join(th[i], NULL);
        ops += jobs[i].ops;
        bytes += jobs[i].bytes;
        err += jobs[i].errors;
    }
    double dt = now_s() - t0;
    *ops_s = (double)ops / dt;
    *errors = err;
    return (double)bytes / dt / 1e9;
}

static tqkv_disk_t *
open_disk(tqkv_disk_io_t io)
{
    tqkv_disk_config_t c;
    tqkv_disk_t *d;
    char err[256];
    tqkv_disk_config_default(&c);
    c.path = g_dir;
    c.capacity = 64ULL << 30;
    c.io = io;
    c.quiet = 1;
    c.compact_thread = 0;
    if (g_segment_bytes)
        c.segment_bytes = g_segment_bytes;
    tqkv_status_t st = tqkv_disk_open(&c, &d, err, sizeof(err));
    if (st != TQKV_OK) {
        fprintf(stderr, "tqkv-disk-bench: %s: %s\n", g_dir, err);
        exit(1);
    }
    return d;
}

static int g_store_sync = 1; /* tqkv_disk_sync_t of the stores open_store makes */

static tqkv_store_t *
open_store(uint64_t dram, const char *path)
{
    tqkv_store_config_t c;
    tqkv_store_t *s;
    tqkv_store_config_default(&c);
    c.dram_capacity = dram;
    if (path) {
        snprintf(c.disk_path, sizeof(c.disk_path), "%s", path);
        c.disk_capacity = 64ULL << 30;
        c.disk_sync = g_store_sync;
    }
    if (tqkv_store_create(&c, &s) != TQKV_OK) {
        fprintf(stderr, "tqkv-disk-bench: store create failed\n");
        exit(1);
    }
    return s;
}

/* Puts pages [0, n) through the store; returns GB/s of page bytes. */
static double
store_puts(tqkv_store_t *s, unsigned n, double *ops_s)
{
    uint8_t *page = malloc(g_page_bytes);
    fill(page, g_page_bytes, 99);
    double t0 = now_s();
    for (unsigned i = 0; i < n; i++) {
        page[0] = (uint8_t)i;
        if (tqkv_store_put(s, &g_keys[i].k, NULL, 0, page, g_page_bytes, 0, NULL) != TQKV_OK) {
            fprintf(stderr, "tqkv-disk-bench: put %u failed\n", i);
            exit(1);
        }
    }
    double dt = now_s() - t0;
    free(page);
    *ops_s = n / dt;
    return (double)n * (double)g_page_bytes / dt / 1e9;
}

/* --disk-sync always: pages [0, n) in Put RPCs of `rpc` blocks each, the way the server
 * does one: with rpc 1, tqkv_store_put (an fdatasync per block, as before); else
 * tqkv_store_put_nosync for each block and one tqkv_store_sync per RPC. */
static double
store_puts_always(tqkv_store_t *s, unsigned n, unsigned rpc, double *ops_s, uint64_t *syncs)
{
    uint8_t *page = malloc(g_page_bytes);
    tqkv_disk_stats_t a, b;
    fill(page, g_page_bytes, 99);
    tqkv_store_disk_stats(s, &a);
    double t0 = now_s();
    for (unsigned i = 0; i < n; i += rpc) {
        tqkv_store_sync_t sy = {0, 0};
        for (unsigned k = i; k < i + rpc && k < n; k++) {
            page[0] = (uint8_t)k;
            tqkv_status_t st =
                rpc == 1 ? tqkv_store_put(s, &g_keys[k].k, NULL, 0, page, g_page_bytes, 0, NULL)
                         : tqkv_store_put_nosync(s, &g_keys[k].k, NULL, 0, page, g_page_bytes, 0,
                                                 NULL, &sy);
            if (st != TQKV_OK) {
                fprintf(stderr, "tqkv-disk-bench: put %u failed\n", k);
                exit(1);
            }
        }
        if (tqkv_store_sync(s, &sy) != TQKV_OK) {
            fprintf(stderr, "tqkv-disk-bench: sync failed\n");
            exit(1);
        }
    }
    double dt = now_s() - t0;
    tqkv_store_disk_stats(s, &b);
    free(page);
    *ops_s = n / dt;
    *syncs = b.syncs - a.syncs;
    return (double)n * (double)g_page_bytes / dt / 1e9;
}

/* Sequential O_DIRECT read of every segment file: GB/s. */
static double
raw_scan(uint64_t *bytes_out)
{
    DIR *dir = opendir(g_dir);
    struct dirent *e;
    size_t cap = 8u << 20;
    void *buf;
    uint64_t bytes = 0;
    if (dir == NULL || posix_memalign(&buf, 4096, cap) != 0)
        return 0;
    double t0 = now_s();
    while ((e = readdir(dir)) != NULL) {
        if (strncmp(e->d_name, "seg-", 4) != 0)
            continue;
        char p[1024];
        snprintf(p, sizeof(p), "%s/%s", g_dir, e->d_name);
        int fd = open(p, O_RDONLY | O_DIRECT);
        if (fd < 0)
            fd = open(p, O_RDONLY);
        for (off_t off = 0;;) {
            ssize_t n = pread(fd, buf, cap, off);
            if (n <= 0)
                break;
            bytes += (uint64_t)n;
            off += n;
        }
        close(fd);
    }
    double dt = now_s() - t0;
    closedir(dir);
    free(buf);
    *bytes_out = bytes;
    return (double)bytes / dt / 1e9;
}

/* Section 5: g_pages pages as sequences of 8 blocks (block b names block b - 1 as its
 * parent) put into a tier of a third of their bytes, with the given relocate fraction. */
typedef struct lf_result {
    double gbs, wa;
    uint64_t seqs, roots, prefix_blocks, pages, relocated, segments, reputs;
} lf_result_t;

/* With shared, blocks 0 and 1 of every sequence are one shared prefix (a system
 * prompt), put like a client would: only when the tier lacks them (reputs counts the
 * times it had lost them). */
static lf_result_t
leaf_first_run(double relocate, int shared)
{
    lf_result_t r = {0};
    tqkv_disk_config_t c;
    tqkv_disk_t *d;
    char err[256], dir[1024];
    snprintf(dir, sizeof(dir), "%s/leaf-first", g_dir);
    rm_dir(dir);
    uint64_t seqs = g_pages / 8 ? g_pages / 8 : 1, n = seqs * 8;
    uint64_t rec = tqkv_disk_record_bytes(5 + 16 + 16, g_page_bytes);
    tqkv_disk_config_default(&c);
    c.path = dir;
    c.capacity = n * rec / 3;
    c.segment_bytes = c.capacity / 8;
    c.relocate = relocate;
    c.quiet = 1;
    c.compact_thread = 0;
    if (tqkv_disk_open(&c, &d, err, sizeof(err)) != TQKV_OK) {
        fprintf(stderr, "tqkv-disk-bench: %s: %s\n", dir, err);
        exit(1);
    }
    uint8_t *page = malloc(g_page_bytes);
    fill(page, g_page_bytes, 5);
    double t0 = now_s();
    uint64_t n_put = 0;
    for (uint64_t q = 0; q < seqs; q++)
        for (uint64_t b = 0; b < 8; b++) {
            uint8_t h[16], ph[16];
            uint64_t hq = shared && b < 2 ? UINT64_MAX : q, pb = b - 1;
            uint64_t pq = shared && b < 3 ? UINT64_MAX : q;
            memcpy(h, &hq, 8);
            memcpy(h + 8, &b, 8);
            memcpy(ph, &pq, 8);
            memcpy(ph + 8, &pb, 8);
            tqkv_block_key_t k = {"bench", 5, h, 16, 0};
            if (hq == UINT64_MAX && tqkv_disk_contains(d, &k, NULL))
                continue;
            r.reputs += hq == UINT64_MAX && q > 0 && b == 0;
            n_put++;
            page[0] = (uint8_t)b;
            if (tqkv_disk_put(d, &k, b ? ph : NULL, b ? 16 : 0, page, g_page_bytes, 0) != TQKV_OK) {
                fprintf(stderr, "tqkv-disk-bench: leaf-first put failed\n");
                exit(1);
            }
        }
    tqkv_disk_sync(d);
    r.gbs = (double)(n_put * g_page_bytes) / (now_s() - t0) / 1e9;
    n = n_put;
    r.seqs = seqs;
    for (uint64_t q = 0; q < seqs; q++)
        for (uint64_t b = 0; b < 8; b++) {
            uint8_t h[16];
            memcpy(h, &q, 8);
            memcpy(h + 8, &b, 8);
            tqkv_block_key_t k = {"bench", 5, h, 16, 0};
            if (!tqkv_disk_contains(d, &k, NULL))
                break;
            r.roots += b == 0;
            r.prefix_blocks++;
        }
    tqkv_disk_stats_t ds;
    tqkv_disk_stats(d, &ds);
    r.pages = ds.pages;
    r.relocated = ds.relocated_bytes;
    r.segments = ds.evicted_segments;
    r.wa = (double)(n * rec + ds.relocated_bytes) / (double)(n * rec);
    tqkv_disk_close(d);
    free(page);
    rm_dir(dir);
    return r;
}

/* The read pattern of the start-up scan without the scan: up to RAW_FILES segment files
 * at once (one thread each), RAW_DEPTH O_DIRECT reads of RAW_CHUNK in flight per file
 * through the tier's own I/O engine; nothing parsed or checked. (disk.c: REBUILD_THREADS,
 * SCAN_DEPTH, SCAN_CHUNK.) */
#define RAW_FILES 4
#define RAW_DEPTH 4
#define RAW_CHUNK (2u << 20)

typedef struct rawq {
    tqkv__io_t *io;
    char (*names)[1024];
    size_t n;
    _Atomic size_t next;
    _Atomic uint64_t bytes;
} rawq_t;

static void *
rawq_main(void *arg)
{
    rawq_t *q = arg;
    void *buf[RAW_DEPTH];
    for (int i = 0; i < RAW_DEPTH; i++)
        if (posix_memalign(&buf[i], 4096, RAW_CHUNK) != 0)
            return NULL;
    for (size_t f; (f = atomic_fetch_add(&q->next, 1)) < q->n;) {
        int fd = open(q->names[f], O_RDONLY | O_DIRECT);
        if (fd < 0)
            fd = open(q->names[f], O_RDONLY);
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb) != 0)
            continue;
        uint64_t size = (uint64_t)sb.st_size, off = 0;
        tqkv__io_op_t ops[RAW_DEPTH];
        int live[RAW_DEPTH] = {0};
        for (int k = 0; k < RAW_DEPTH && off < size; k++, off += RAW_CHUNK) {
            ops[k] = (tqkv__io_op_t){.fd = fd, .buf = buf[k], .len = RAW_CHUNK, .off = off};
            live[k] = tqkv__io_submit(q->io, &ops[k]) == 0;
        }
        for (int k = 0;; k = (k + 1) % RAW_DEPTH) {
            if (!live[k])
                break;
            ssize_t n = tqkv__io_wait(q->io, &ops[k]);
            live[k] = 0;
            if (n > 0)
                atomic_fetch_add(&q->bytes, (uint64_t)n);
            if (off < size) {
                ops[k] = (tqkv__io_op_t){.fd = fd, .buf = buf[k], .len = RAW_CHUNK, .off = off};
                live[k] = tqkv__io_submit(q->io, &ops[k]) == 0;
                off += RAW_CHUNK;
            }
        }
        close(fd);
    }
    for (int i = 0; i < RAW_DEPTH; i++)
        free(buf[i]);
    return NULL;
}

static double
raw_scan_parallel(uint64_t *bytes_out, unsigned *files)
{
    rawq_t q;
    char err[128];
    memset(&q, 0, sizeof(q));
    if (tqkv__io_create(TQKV_DISK_IO_AUTO, 4, &q.io, err, sizeof(err)) != TQKV_OK)
        return 0;
    DIR *dir = opendir(g_dir);
    struct dirent *e;
    q.names = calloc(4096, sizeof(*q.names));
    while (dir != NULL && (e = readdir(dir)) != NULL && q.n < 4096)
        if (strncmp(e->d_name, "seg-", 4) == 0)
            snprintf(q.names[q.n++], 1024, "%s/%s", g_dir, e->d_name);
    if (dir)
        closedir(dir);
    pthread_t th[RAW_FILES];
    int nth = 0;
    double t0 = now_s();
    for (; nth < RAW_FILES && (size_t)nth < q.n; nth++)
        pthread_create(&th[nth], NULL, rawq_main, &q);
    for (int i = 0; i < nth; i++)
        pthread_join(th[i], NULL);
    double dt = now_s() - t0;
    tqkv__io_destroy(q.io);
    free(q.names);
    *bytes_out = atomic_load(&q.bytes);
    *files = (unsigned)q.n;
    return (double)*bytes_out / dt / 1e9;
}

int
main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dir"))
            g_dir = argv[i + 1];
        else if (!strcmp(argv[i], "--pages"))
            g_pages = (unsigned)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--page-bytes"))
            g_page_bytes = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            g_threads = (unsigned)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seconds"))
            g_seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--segment-mib"))
            g_segment_bytes = (uint64_t)atol(argv[i + 1]) << 20;
        else {
            fprintf(stderr, "usage: tqkv-disk-bench [--dir DIR] [--pages N] [--page-bytes B] "
                            "[--threads Q] [--seconds S] [--segment-mib M]\n");
            return 2;
        }
    }
    if (g_pages == 0 || g_page_bytes < 64 || g_threads == 0)
        return 2;
    rm_dir(g_dir);
    make_keys(g_pages);
    double total_gb = (double)g_pages * (double)g_page_bytes / 1e9;
    printf("tqkv-disk-bench: %s, %u pages of %zu bytes (%.2f GB), queue depth %u, %.1f s "
           "per measurement (best of 3, interleaved)\n\n",
           g_dir, g_pages, g_page_bytes, total_gb, g_threads, g_seconds);

    /* --segment-mib: the superblock keeps the segment size; the store's tier follows it. */
    if (g_segment_bytes)
        tqkv_disk_close(open_disk(TQKV_DISK_IO_AUTO));
    /* Fill the tier through the store (written through), DRAM small. */
    tqkv_store_t *s = open_store(g_page_bytes * 64, g_dir);
    double put_full_ops, put_full = store_puts(s, g_pages, &put_full_ops);
    tqkv_store_stats_t sst;
    tqkv_store_stats(s, NULL, 0, &sst);
    uint64_t demoted = sst.tier[TQKV_TIER_DRAM].demotions;
    tqkv_store_destroy(s);

    /* Raw targets. */
    tqkv_disk_t *d = open_disk(TQKV_DISK_IO_AUTO);
    tqkv_disk_stats_t ds;
    tqkv_disk_stats(d, &ds);
    g_fd = calloc(g_pages, sizeof(*g_fd));
    g_off = calloc(g_pages, sizeof(*g_off));
    g_len = calloc(g_pages, sizeof(*g_len));
    for (unsigned i = 0; i < g_pages; i++) {
        char p[1024];
        if (tqkv__disk_debug_locate(d, &g_keys[i].k, p, sizeof(p), &g_off[i], &g_len[i]) !=
            TQKV_OK) {
            fprintf(stderr, "tqkv-disk-bench: page %u not on disk\n", i);
            return 1;
        }
        g_fd[i] = open(p, O_RDONLY | (ds.direct ? O_DIRECT : 0));
    }
    /* The five measurements interleaved, 3 rounds, best of each: on a shared machine a
     * load spike then hits every path alike. */
    double ops_get = 0, ops_raw = 0, ops_thr = 0, ops_store = 0, ops_pf = 0;
    double get_uring = 0, raw = 0, get_thr = 0, get_store = 0, get_pf = 0;
    uint64_t e1 = 0, e2 = 0, e3 = 0, e4 = 0, e5 = 0;
    const char *engine = ds.io_engine;
    tqkv_disk_close(d);
    for (int rep = 0; rep < 3; rep++) {
        double g, o;
        uint64_t e;
#define BEST(var, ops, err)                                                                        \
    do {                                                                                           \
        if (g > var) {                                                                             \
            var = g;                                                                               \
            ops = o;                                                                               \
        }                                                                                          \
        err += e;                                                                                  \
    } while (0)
        g = run_jobs(1, NULL, NULL, &o, &e);
        BEST(raw, ops_raw, e2);
        d = open_disk(TQKV_DISK_IO_AUTO);
        g = run_jobs(0, d, NULL, &o, &e);
        BEST(get_uring, ops_get, e1);
        tqkv_disk_close(d);
        d = open_disk(TQKV_DISK_IO_THREADS);
        g = run_jobs(0, d, NULL, &o, &e);
        BEST(get_thr, ops_thr, e3);
        tqkv_disk_close(d);
        s = open_store(g_page_bytes * 64, g_dir);
        g = run_jobs(2, NULL, s, &o, &e);
        BEST(get_store, ops_store, e4);
        tqkv_store_destroy(s);
        s = open_store(g_page_bytes * 64 * g_threads, g_dir);
        g = run_jobs(3, NULL, s, &o, &e);
        BEST(get_pf, ops_pf, e5);
        tqkv_store_destroy(s);
#undef BEST
    }

    printf("Get of %zu-byte pages from the disk tier vs a raw O_DIRECT read of the same "
           "records (%s, O_DIRECT %s)\n",
           g_page_bytes, g_dir, ds.direct ? "on" : "off (file system refuses it)");
    printf("| path | GB/s of pages | Gets/s | vs raw | errors |\n|---|---|---|---|---|\n");
    printf("| raw pread O_DIRECT, same offsets and sizes, QD %u | %.2f | %.0f | 1.00 | %llu |\n",
           g_threads, raw, ops_raw, (unsigned long long)e2);
    printf("| tqkv_disk_get, %s | %.2f | %.0f | %.2f | %llu |\n", engine, get_uring, ops_get,
           get_uring / raw, (unsigned long long)e1);
    printf("| tqkv_disk_get, thread pool | %.2f | %.0f | %.2f | %llu |\n", get_thr, ops_thr,
           get_thr / raw, (unsigned long long)e3);
    printf("| tqkv_store_get (disk hit, check, promote into DRAM) | %.2f | %.0f | %.2f | %llu "
           "|\n",
           get_store, ops_store, get_store / raw, (unsigned long long)e4);
    printf("| tqkv_store_prefetch of 16 pages + 16 gets (what a Get RPC does) | %.2f | %.0f | "
           "%.2f | %llu |\n\n",
           get_pf, ops_pf, get_pf / raw, (unsigned long long)e5);

    /* Put with room vs with DRAM full: fresh directories, alternated, best of 3 each
     * (the machine may be shared). */
    char dir2[1100];
    double put_room = 0, put_room_ops = 0, put_full2, put_full2_ops;
    put_full = put_full_ops = 0;
    snprintf(dir2, sizeof(dir2), "%s-put", g_dir);
    for (int rep = 0; rep < 3; rep++) {
        double g, o;
        rm_dir(dir2);
        s = open_store((uint64_t)g_pages * g_page_bytes * 2, dir2);
        g = store_puts(s, g_pages, &o);
        tqkv_store_destroy(s);
        if (g > put_room) {
            put_room = g;
            put_room_ops = o;
        }
        rm_dir(dir2);
        s = open_store(g_page_bytes * 64, dir2);
        put_full2 = store_puts(s, g_pages, &put_full2_ops);
        tqkv_store_stats(s, NULL, 0, &sst);
        demoted = sst.tier[TQKV_TIER_DRAM].demotions;
        tqkv_store_destroy(s);
        if (put_full2 > put_full) {
            put_full = put_full2;
            put_full_ops = put_full2_ops;
        }
    }
    rm_dir(dir2);
    double put_nodisk_ops = 0, put_nodisk = 0;
    for (int rep = 0; rep < 3; rep++) {
        double g, o;
        s = open_store((uint64_t)g_pages * g_page_bytes * 2, NULL);
        g = store_puts(s, g_pages, &o);
        tqkv_store_destroy(s);
        if (g > put_nodisk) {
            put_nodisk = g;
            put_nodisk_ops = o;
        }
    }
    /* --disk-sync always: a sync per block vs one per Put RPC of 128 blocks. */
    double pa[2] = {0, 0}, pa_ops[2] = {0, 0};
    uint64_t pa_syncs[2] = {0, 0};
    unsigned pa_rpc[2] = {1, 128};
    g_store_sync = 2;
    for (int rep = 0; rep < 3; rep++)
        for (int k = 0; k < 2; k++) {
            double g, o;
            uint64_t sy;
            rm_dir(dir2);
            s = open_store((uint64_t)g_pages * g_page_bytes * 2, dir2);
            g = store_puts_always(s, g_pages, pa_rpc[k], &o, &sy);
            tqkv_store_destroy(s);
            if (g > pa[k]) {
                pa[k] = g;
                pa_ops[k] = o;
                pa_syncs[k] = sy;
            }
        }
    g_store_sync = 1;
    rm_dir(dir2);
    printf("Put through the store (one thread, written through to the disk tier)\n");
    printf("| case | GB/s of pages | Puts/s | vs room |\n|---|---|---|---|\n");
    printf("| room in DRAM | %.2f | %.0f | 1.00 |\n", put_room, put_room_ops);
    printf("| DRAM full, demotion active (%llu pages demoted) | %.2f | %.0f | %.2f |\n",
           (unsigned long long)demoted, put_full, put_full_ops, put_full / put_room);
    printf("| no disk tier, room in DRAM (reference) | %.2f | %.0f | - |\n\n", put_nodisk,
           put_nodisk_ops);
    printf("Put with --disk-sync always (room in DRAM; one thread)\n");
    printf("| case | GB/s of pages | Puts/s | fdatasyncs | vs a sync per block |\n"
           "|---|---|---|---|---|\n");
    printf("| an fdatasync per block (tqkv_store_put) | %.2f | %.0f | %llu | 1.00 |\n", pa[0],
           pa_ops[0], (unsigned long long)pa_syncs[0]);
    printf("| one per Put RPC of %u blocks (tqkv_store_put_nosync + tqkv_store_sync) | %.2f | %.0f "
           "| %llu | %.2f |\n\n",
           pa_rpc[1], pa[1], pa_ops[1], (unsigned long long)pa_syncs[1],
           pa[0] > 0 ? pa[1] / pa[0] : 0);

    /* Warm restart: the rebuild and two raw reads of the same files, alternated, best of
     * 3 each, page cache dropped before each (when allowed). */
    int dropped = 0;
    uint64_t scanned = 0, scanned_q = 0;
    unsigned nfiles = 0;
    double raw_seq = 0, raw_q = 0, rb = 0;
    tqkv_disk_stats_t best;
    memset(&best, 0, sizeof(best));
    for (int rep = 0; rep < 3; rep++) {
        uint64_t sc = 0;
        drop_caches(&dropped);
        d = open_disk(TQKV_DISK_IO_AUTO);
        tqkv_disk_stats(d, &ds);
        tqkv_disk_close(d);
        double r = ds.rebuild_seconds > 0 ? (double)ds.rebuild_bytes / ds.rebuild_seconds / 1e9 : 0;
        if (r > rb) {
            rb = r;
            best = ds;
        }
        drop_caches(&dropped);
        double g = raw_scan(&sc);
        if (g > raw_seq) {
            raw_seq = g;
            scanned = sc;
        }
        drop_caches(&dropped);
        g = raw_scan_parallel(&sc, &nfiles);
        if (g > raw_q) {
            raw_q = g;
            scanned_q = sc;
        }
    }
    ds = best;
    printf("Warm restart, segment files: %u (page cache %s; best of 3, alternated)\n", nfiles,
           dropped ? "dropped before each" : "NOT dropped: no permission");
    printf("| path | bytes | seconds | GB/s | vs raw sequential | vs raw as the scan reads |\n"
           "|---|---|---|---|---|---|\n");
    printf("| raw sequential O_DIRECT read of the segments, 8 MiB at a time, one file after "
           "another | %llu | %.3f | %.2f | 1.00 | %.2f |\n",
           (unsigned long long)scanned, raw_seq > 0 ? (double)scanned / raw_seq / 1e9 : 0, raw_seq,
           raw_q > 0 ? raw_seq / raw_q : 0);
    printf("| raw O_DIRECT read as the scan reads: %d files at once, %d reads of %u MiB in "
           "flight each (%s) | %llu | %.3f | %.2f | %.2f | 1.00 |\n",
           RAW_FILES, RAW_DEPTH, RAW_CHUNK >> 20, ds.io_engine, (unsigned long long)scanned_q,
           raw_q > 0 ? (double)scanned_q / raw_q / 1e9 : 0, raw_q,
           raw_seq > 0 ? raw_q / raw_seq : 0);
    printf("| index rebuild (parallel scan, read-ahead, every CRC checked, %llu pages) | %llu | "
           "%.3f | %.2f | %.2f | %.2f |\n\n",
           (unsigned long long)ds.pages, (unsigned long long)ds.rebuild_bytes, ds.rebuild_seconds,
           rb, raw_seq > 0 ? rb / raw_seq : 0, raw_q > 0 ? rb / raw_q : 0);

    printf("Index RAM: %llu bytes for %llu disk-resident pages = %.1f bytes/page "
           "(%llu slots of 24 bytes)\n",
           (unsigned long long)ds.index_bytes, (unsigned long long)ds.pages,
           ds.pages ? (double)ds.index_bytes / (double)ds.pages : 0.0,
           (unsigned long long)ds.index_slots);
    for (unsigned i = 0; i < g_pages; i++)
        close(g_fd[i]);

    printf("\nLeaf-first reclaim: %u sequences of 8 linked %zu-byte blocks through a tier of a "
           "third of their bytes (segments of 1/8 of it; one thread, tqkv_disk_put; best of 3, "
           "alternated)\n",
           g_pages / 8, g_page_bytes);
    printf("| relocate | GB/s of pages put | write amplification | segments dropped | pages "
           "kept | sequences with block 0 | blocks in leading runs | shared prefix: lost and "
           "put again |\n|---|---|---|---|---|---|---|---|\n");
    static const double fr[] = {0, 0.25, 0.5};
    lf_result_t res[3], sh[3];
    for (int rep = 0; rep < 3; rep++) /* alternated, best Put rate of 3 */
        for (int i = 0; i < 3; i++) {
            lf_result_t r = leaf_first_run(fr[i], 0);
            if (rep == 0 || r.gbs > res[i].gbs)
                res[i] = r;
        }
    for (int i = 0; i < 3; i++)
        sh[i] = leaf_first_run(fr[i], 1); /* every sequence starts with the same 2 blocks */
    for (int i = 0; i < 3; i++) {
        lf_result_t r = res[i];
        printf("| %.2f%s | %.2f | %.3f | %llu | %llu | %llu of %llu | %llu | %llu times |\n", fr[i],
               fr[i] == 0      ? " (FIFO)"
               : fr[i] == 0.25 ? " (default)"
                               : "",
               r.gbs, r.wa, (unsigned long long)r.segments, (unsigned long long)r.pages,
               (unsigned long long)r.roots, (unsigned long long)r.seqs,
               (unsigned long long)r.prefix_blocks, (unsigned long long)sh[i].reputs);
    }
    rm_dir(g_dir);
    return 0;
}
