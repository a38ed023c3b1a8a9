/* bench_get_decode.c - the C side of tests/python/bench_get.py: Get a grid of PACKED
 * pages (hashes x layers) and decode every page to BF16 into a [L][N][T][H][D] K and V
 * array, as a C engine would, ITERS times; prints "seconds decoded_bytes" per
 * iteration. MODE cb: tqkv_client_get with a callback that decodes each page
 * (tqkv_page_decode_bf16; the library already checked the CRC as it received the page);
 * MODE into: tqkv_client_get_into (what the Python package calls).
 * Usage: bench_get_decode TARGET NS HASHFILE(n x 32 bytes) LAYERS T H D ITERS tcp|grpc cb|into */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/page.h"
#include "transport/client.h"
#include "transport/client_bulk.h"

typedef struct ctx {
    uint16_t *k, *v;
    size_t n, tensor_elems;
    uint32_t layer_begin;
    size_t found;
    int bad;
} ctx_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    ctx_t *x = arg;
    if (!pg->found)
        return 0;
    size_t e = ((size_t)(pg->layer - x->layer_begin) * x->n + pg->hash_index) * x->tensor_elems;
    tqkv_page_info_t info;
    if (!pg->crc_checked &&
        tqkv_page_validate(pg->page, pg->page_len, 1, &info, NULL, 0) != TQKV_OK) {
        x->bad = 1;
        return 1;
    }
    if (tqkv_page_decode_bf16(pg->page, pg->page_len, x->k + e, x->v + e) != TQKV_OK) {
        x->bad = 1;
        return 1;
    }
    x->found++;
    return 0;
}

static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int
main(int argc, char **argv)
{
    if (argc != 11) {
        fprintf(stderr, "usage: bench_get_decode TARGET NS HASHFILE LAYERS T H D ITERS tcp|grpc "
                        "cb|into\n");
        return 2;
    }
    const char *target = argv[1], *ns = argv[2];
    uint32_t layers = (uint32_t)atoi(argv[4]);
    tqkv_block_shape_t shape = {(uint32_t)atoi(argv[5]), (uint32_t)atoi(argv[6]),
                                (uint32_t)atoi(argv[7])};
    int iters = atoi(argv[8]);
    int tcp = !strcmp(argv[9], "tcp"), into = !strcmp(argv[10], "into");
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        perror(argv[3]);
        return 1;
    }
    static uint8_t raw[32 * 65536];
    size_t nraw = fread(raw, 1, sizeof raw, f);
    fclose(f);
    size_t n = nraw / 32;
    tqkv_hash_t *h = calloc(n, sizeof *h);
    for (size_t i = 0; i < n; i++) {
        h[i].len = 32;
        memcpy(h[i].bytes, raw + 32 * i, 32);
    }
    size_t te = (size_t)shape.num_tokens * shape.num_kv_heads * shape.head_dim;
    size_t cells = n * layers;
    ctx_t x = {.n = n, .tensor_elems = te};
    x.k = malloc(cells * te * 2);
    x.v = malloc(cells * te * 2);
    void **kp = malloc(cells * sizeof *kp), **vp = malloc(cells * sizeof *vp);
    for (size_t e = 0; e < cells; e++) {
        kp[e] = x.k + e * te;
        vp[e] = x.v + e * te;
    }
    memset(x.k, 0, cells * te * 2); /* fault the pages in before timing */
    memset(x.v, 0, cells * te * 2);
    const char *targets[] = {target};
    tqkv_client_opts_t o = {.targets = targets, .num_targets = 1, .wait_for_ready = 1};
    o.transport = tcp ? TQKV_CLIENT_TRANSPORT_TCP : TQKV_CLIENT_TRANSPORT_GRPC;
    tqkv_client_t *c;
    if (tqkv_client_create(&o, &c) != TQKV_OK)
        return 1;
    tqkv_get_req_t rq = {.ns = ns,
                         .hashes = h,
                         .num_hashes = n,
                         .layer_end = layers,
                         .encoding = TQKV_CLIENT_PACKED};
    tqkv_get_into_t dst = {.shape = shape, .keys = kp, .values = vp};
    for (int it = 0; it < iters; it++) {
        x.found = 0;
        double t0 = now();
        tqkv_status_t st;
        uint64_t found = 0;
        if (into) {
            st = tqkv_client_get_into(c, &rq, &dst, &found, NULL);
        } else {
            st = tqkv_client_get(c, &rq, on_page, &x);
            found = x.found;
        }
        double t = now() - t0;
        if (st != TQKV_OK || x.bad || found != cells) {
            fprintf(stderr, "bench_get_decode: %s (%s), %llu of %zu found\n", tqkv_strerror(st),
                    tqkv_client_last_error()->message, (unsigned long long)found, cells);
            return 1;
        }
        printf("%.6f %zu\n", t, cells * te * 2 * 2);
        fflush(stdout);
    }
    tqkv_client_destroy(c);
    return 0;
}
