/* check_nccl_gpu.c - the NCCL data path end to end (label gpu; NCCL builds only).
 *
 * Starts a real tqkv-server (its channels on TQKV_NCCL_DEVICE: device 1 when there are
 * two or more, else 0, shared with the client), stores blocks over gRPC, opens a
 * channel and gets the pages with ncclRecv into device buffers: every page must equal
 * the bytes of an ordinary gRPC PACKED Get, in layer-major order, with misses
 * reported. Then a Get cancelled by its callback breaks the channel, and a fresh
 * channel works again (the server aborted the old one). More pages than the channel
 * window, so the staging ring wraps and back-pressure runs.
 *
 * Exit 77 (skip) without a CUDA device, and with a single device when NCCL refuses
 * two ranks on one GPU (the channel falls back; see tests/nccl.cmake).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check_main.h"
#include "transport/client.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            failed = 1;                                                                            \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

enum { NH = 6, L = 4, MISSING = 2 };

typedef struct pages {
    uint8_t *data[NH * L];
    size_t len[NH * L];
    int found[NH * L]; /* 0 unseen, 1 found, 2 missing */
    int bad, on_device, ordered;
    uint32_t last_layer;
    size_t calls, cancel_after;
} pages_t;

static void
pages_clear(pages_t *p)
{
    for (size_t i = 0; i < NH * L; i++)
        free(p->data[i]);
    memset(p, 0, sizeof *p);
    p->ordered = 1;
}

static void
put_page(pages_t *p, size_t hi, uint32_t layer, int found, const void *host, size_t n)
{
    size_t k = hi * L + layer;
    if (hi >= NH || layer >= L || p->found[k]) {
        p->bad++;
        return;
    }
    if (p->calls > 1 && layer < p->last_layer)
        p->ordered = 0;
    p->last_layer = layer;
    p->found[k] = found ? 1 : 2;
    if (found) {
        p->data[k] = malloc(n);
        memcpy(p->data[k], host, n);
        p->len[k] = n;
    }
}

static int
on_grpc(void *arg, const tqkv_get_page_t *pg)
{
    pages_t *p = arg;
    p->calls++;
    put_page(p, pg->hash_index, pg->layer, pg->found, pg->page, pg->page_len);
    return 0;
}

static int
on_nccl(void *arg, const tqkv_nccl_page_t *pg)
{
    pages_t *p = arg;
    p->calls++;
    if (pg->found && pg->on_device) {
        uint8_t *h = malloc(pg->len);
        p->on_device = 1;
        if (h == NULL || cudaMemcpy(h, pg->data, pg->len, cudaMemcpyDeviceToHost) != cudaSuccess) {
            p->bad++;
            free(h);
            return 1;
        }
        put_page(p, pg->hash_index, pg->layer, 1, h, pg->len);
        free(h);
    } else {
        put_page(p, pg->hash_index, pg->layer, pg->found, pg->data, pg->len);
    }
    return p->cancel_after && p->calls >= p->cancel_after;
}

int
main(void)
{
    int ndev = 0, failed = 0, skip = 0;
    uint64_t seed = tqkv_test_seed();
    srv_t S;
    tqkv_client_t *CL = NULL;
    tqkv_channel_t *ch = NULL;
    void *bufs[3] = {NULL, NULL, NULL};
    static pages_t want, got;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    setenv("TQKV_NCCL_DEVICE", ndev > 1 ? "1" : "0", 1);
    if (srv_start(&S, 0, NULL) != 0) {
        fprintf(stderr, "cannot start tqkv-server\n");
        return 1;
    }
    const char *t[1] = {S.addr};
    tqkv_client_opts_t o = {
        .targets = t, .num_targets = 1, .deadline_ms = 60000, .wait_for_ready = 1};
    CHECK(tqkv_client_create(&o, &CL) == TQKV_OK, "client");

    tqkv_block_shape_t sh = {64, 4, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    tqkv_hash_t hs[NH];
    for (size_t i = 0; i < NH; i++)
        tqkv_test_hash(&hs[i], seed, i, 32);
    {
        tqkv_put_opts_t po = {.key_bits = 3, .value_bits = 2};
        tqkv_put_t *p = NULL;
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
        CHECK(k && v && tqkv_client_put_begin(CL, &po, &p) == TQKV_OK, "put begin");
        for (size_t b = 0; b < NH; b++) {
            if (b == MISSING)
                continue;
            for (uint32_t l = 0; l < L; l++) {
                tqkv_test_bf16_fill(&seed, k, n, sh.head_dim);
                tqkv_test_bf16_fill(&seed, v, n, sh.head_dim);
                tqkv_put_block_t pb = {.ns = "gpu",
                                       .hash = &hs[b],
                                       .layer = l,
                                       .num_layers = L,
                                       .shape = sh,
                                       .key = k,
                                       .value = v};
                CHECK(tqkv_client_put_block(p, &pb) == TQKV_OK, "put: %s",
                      tqkv_client_last_error()->message);
            }
        }
        CHECK(tqkv_client_put_end(p, NULL) == TQKV_OK, "put end: %s",
              tqkv_client_last_error()->message);
        free(k);
        free(v);
    }
    tqkv_get_req_t q = {.ns = "gpu",
                        .hashes = hs,
                        .num_hashes = NH,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = TQKV_CLIENT_PACKED};
    pages_clear(&want);
    CHECK(tqkv_client_get(CL, &q, on_grpc, &want) == TQKV_OK, "grpc get: %s",
          tqkv_client_last_error()->message);
    size_t maxlen = 0;
    for (size_t i = 0; i < NH * L; i++)
        maxlen = want.len[i] > maxlen ? want.len[i] : maxlen;
    CHECK(maxlen > 0, "no page stored");
    for (int i = 0; i < 3; i++)
        CHECK(cudaMalloc(&bufs[i], maxlen) == cudaSuccess, "cudaMalloc");

    for (int round = 0; round < 2; round++) {
        CHECK(tqkv_client_open_channel(CL, 0, 0, 20000, &ch) == TQKV_OK, "open: %s",
              tqkv_client_last_error()->message);
        if (!tqkv_channel_is_nccl(ch)) {
            fprintf(stderr, "channel fell back: %s\n", tqkv_channel_fallback_reason(ch));
            CHECK(ndev == 1, "NCCL channel with %d devices failed", ndev);
            /* One GPU: both ranks on one device (NCCL refuses it). The fallback must
             * still deliver the gRPC bytes; the NCCL path needs two GPUs. */
            pages_clear(&got);
            CHECK(tqkv_client_get_nccl(CL, ch, &q, bufs, 3, maxlen, on_nccl, &got) == TQKV_OK,
                  "fallback get: %s", tqkv_client_last_error()->message);
            for (size_t i = 0; i < NH * L; i++)
                CHECK(got.found[i] == want.found[i] && got.len[i] == want.len[i] &&
                          (got.found[i] != 1 || memcmp(got.data[i], want.data[i], got.len[i]) == 0),
                      "fallback page %zu differs", i);
            skip = 1;
            goto out;
        }
        /* Twice over one channel: the ring wraps (24 pages, window 4). */
        for (int rep = 0; rep < 2; rep++) {
            pages_clear(&got);
            tqkv_status_t st = tqkv_client_get_nccl(CL, ch, &q, bufs, 3, maxlen, on_nccl, &got);
            CHECK(st == TQKV_OK, "nccl get: %s", tqkv_client_last_error()->message);
            CHECK(got.bad == 0 && got.on_device && got.ordered && got.calls == NH * L,
                  "bad %d on_device %d ordered %d calls %zu", got.bad, got.on_device, got.ordered,
                  got.calls);
            for (size_t i = 0; i < NH * L; i++) {
                CHECK(got.found[i] == want.found[i], "page %zu found %d want %d", i, got.found[i],
                      want.found[i]);
                CHECK(got.len[i] == want.len[i], "page %zu len", i);
                CHECK(got.found[i] != 1 || memcmp(got.data[i], want.data[i], got.len[i]) == 0,
                      "page %zu bytes differ", i);
            }
        }
        if (round == 0) {
            /* Cancelled by the callback: the channel is broken (server aborts its side). */
            pages_clear(&got);
            got.cancel_after = 3;
            CHECK(tqkv_client_get_nccl(CL, ch, &q, bufs, 3, maxlen, on_nccl, &got) ==
                      TQKV_ECANCELED,
                  "cancel: %s", tqkv_client_last_error()->message);
            CHECK(tqkv_client_get_nccl(CL, ch, &q, bufs, 3, maxlen, on_nccl, &got) != TQKV_OK,
                  "a broken channel must refuse Gets");
        }
        tqkv_client_close_channel(CL, ch);
        ch = NULL;
    }
    fprintf(stderr, "NCCL channel moved %d pages x 4 gets OK (%d device(s))\n", NH * L, ndev);
out:
    tqkv_client_close_channel(CL, ch);
    for (int i = 0; i < 3; i++)
        if (bufs[i])
            cudaFree(bufs[i]);
    pages_clear(&want);
    pages_clear(&got);
    tqkv_client_destroy(CL);
    srv_stop(&S);
    if (failed)
        return 1;
    return skip ? 77 : 0;
}
