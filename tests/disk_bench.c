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
#include "cache/store.h"

static const char *g_dir = "/tmp/tqkv-disk-bench";
static unsigned g_pages = 4000, g_threads = 8;
static size_t g_page_bytes = 32768;
static double g_seconds = 3.0;

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
    tqkv_status_t st = tqkv_disk_open(&c, &d, err, sizeof(err));
    if (st != TQKV_OK) {
        fprintf(stderr, "tqkv-disk-bench: %s: %s\n", g_dir, err);
        exit(1);
    }
    return d;
}

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
        c.disk_sync = 1;
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
        else {
            fprintf(stderr, "usage: tqkv-disk-bench [--dir DIR] [--pages N] [--page-bytes B] "
                            "[--threads Q] [--seconds S]\n");
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
    printf("Put through the store (one thread, written through to the disk tier)\n");
    printf("| case | GB/s of pages | Puts/s | vs room |\n|---|---|---|---|\n");
    printf("| room in DRAM | %.2f | %.0f | 1.00 |\n", put_room, put_room_ops);
    printf("| DRAM full, demotion active (%llu pages demoted) | %.2f | %.0f | %.2f |\n",
           (unsigned long long)demoted, put_full, put_full_ops, put_full / put_room);
    printf("| no disk tier, room in DRAM (reference) | %.2f | %.0f | - |\n\n", put_nodisk,
           put_nodisk_ops);

    /* Warm restart. */
    /* Alternated, best of 3 each. */
    int dropped = 0;
    uint64_t scanned = 0;
    double raw_seq = 0, rb = 0;
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
    }
    ds = best;
    printf("Warm restart (page cache %s; best of 3, alternated)\n",
           dropped ? "dropped before each" : "NOT dropped: no permission");
    printf("| path | bytes | seconds | GB/s | vs raw |\n|---|---|---|---|---|\n");
    printf("| raw sequential O_DIRECT read of the segments | %llu | %.3f | %.2f | 1.00 |\n",
           (unsigned long long)scanned, raw_seq > 0 ? (double)scanned / raw_seq / 1e9 : 0, raw_seq);
    printf("| index rebuild (scan, CRC checks, %llu pages) | %llu | %.3f | %.2f | %.2f |\n\n",
           (unsigned long long)ds.pages, (unsigned long long)ds.rebuild_bytes, ds.rebuild_seconds,
           rb, raw_seq > 0 ? rb / raw_seq : 0);

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
