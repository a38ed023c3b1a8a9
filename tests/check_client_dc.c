/* check_client_dc.c - libtqkv's TCP data channels (TQKV_CLIENT_TRANSPORT_TCP) against
 * real tqkv-server processes on loopback (label server).
 *
 * Pages that come over a data channel must be byte-identical to those of an ordinary
 * gRPC Get, in the same order, misses included; the library falls back to gRPC (and
 * says why) when a server has no --data-listen; a Get cancelled by its callback
 * mid-stream leaves the client and server usable; concurrent Gets each take their own
 * channel; a server restart does not fail the next Get (the stale channel is
 * dropped). The wire protocol as a grpcio user sees it is tests/interop/
 * test_data_channel.py.
 */
#include <check.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check_main.h"
#include "transport/client.h"
#include "transport/data_channel.h"

#include "tests/support/kv_data.h"
#include "tests/support/ports.h"
#include "tests/support/server_proc.h"

enum { NH = 6, L = 4, MISSING = 2 };

static const char *const DL[] = {"--data-listen", "127.0.0.1:0", NULL};
static uint64_t SEED;
static tqkv_hash_t HS[NH];
static const tqkv_block_shape_t SH = {64, 2, 128};

/* Pages as delivered, [hash * L + layer]. */
typedef struct pages {
    uint8_t *data[NH * L];
    size_t len[NH * L];
    int found[NH * L]; /* 0 unseen, 1 found, 2 missing */
    int bad, via_dc, via_grpc, crc_unchecked;
    size_t calls, stop_after;
} pages_t;

static void
pages_free(pages_t *p)
{
    for (size_t i = 0; i < NH * L; i++)
        free(p->data[i]);
}

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    pages_t *p = arg;
    size_t k = pg->hash_index * L + pg->layer;
    p->calls++;
    if (pg->hash_index >= NH || pg->layer >= L || p->found[k]) {
        p->bad++;
        return 0;
    }
    p->found[k] = pg->found ? 1 : 2;
    if (pg->found && pg->page) { /* PACKED (BF16 pages come as key/value) */
        p->data[k] = malloc(pg->page_len);
        memcpy(p->data[k], pg->page, pg->page_len);
        p->len[k] = pg->page_len;
        p->crc_unchecked += pg->crc_checked != 1;
        p->bad += ((uintptr_t)pg->page & 63) != 0; /* the 64-byte alignment contract */
    }
    if (pg->target >= 0) {
        p->via_dc += pg->data_channel;
        p->via_grpc += !pg->data_channel;
    }
    return p->stop_after && p->calls >= p->stop_after;
}

static tqkv_client_t *
client(const srv_t *s, int transport)
{
    const char *t[1] = {s->addr};
    tqkv_client_opts_t o = {.targets = t,
                            .num_targets = 1,
                            .deadline_ms = 30000,
                            .wait_for_ready = 1,
                            .transport = transport};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

/* Stores every block but hash MISSING. */
static void
put_all(tqkv_client_t *c)
{
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 3};
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(c, &po, &p), TQKV_OK);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    uint64_t seed = SEED;
    for (size_t b = 0; b < NH; b++) {
        if (b == MISSING)
            continue;
        for (uint32_t l = 0; l < L; l++) {
            tqkv_test_bf16_fill(&seed, k, n, SH.head_dim);
            tqkv_test_bf16_fill(&seed, v, n, SH.head_dim);
            tqkv_put_block_t pb = {.ns = "dc",
                                   .hash = &HS[b],
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = SH,
                                   .key = k,
                                   .value = v};
            ck_assert_msg(tqkv_client_put_block(p, &pb) == TQKV_OK, "put: %s",
                          tqkv_client_last_error()->message);
        }
    }
    ck_assert_int_eq(tqkv_client_put_end(p, NULL), TQKV_OK);
    free(k);
    free(v);
}

static tqkv_get_req_t
req(void)
{
    tqkv_get_req_t q = {.ns = "dc",
                        .hashes = HS,
                        .num_hashes = NH,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = TQKV_CLIENT_PACKED};
    return q;
}

static void
get_ok(tqkv_client_t *c, pages_t *p)
{
    tqkv_get_req_t q = req();
    memset(p, 0, sizeof *p);
    tqkv_status_t st = tqkv_client_get(c, &q, on_page, p);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_int_eq(p->bad, 0);
    ck_assert_uint_eq(p->calls, NH * L);
}

static void
same_pages(const pages_t *a, const pages_t *b)
{
    for (size_t i = 0; i < NH * L; i++) {
        ck_assert_int_eq(a->found[i], (i / L) == MISSING ? 2 : 1);
        ck_assert_int_eq(a->found[i], b->found[i]);
        ck_assert_uint_eq(a->len[i], b->len[i]);
        if (a->found[i] == 1)
            ck_assert_msg(memcmp(a->data[i], b->data[i], a->len[i]) == 0, "page %zu differs", i);
    }
}

static void
setup(void)
{
    SEED = tqkv_test_seed();
    for (size_t i = 0; i < NH; i++)
        tqkv_test_hash(&HS[i], SEED, i, 16);
}

START_TEST(dc_pages_equal_grpc_pages)
{
    srv_t s;
    ck_assert_msg(srv_start(&s, 0, DL) == 0, "cannot start tqkv-server");
    tqkv_client_t *g = client(&s, TQKV_CLIENT_TRANSPORT_GRPC);
    tqkv_client_t *t = client(&s, TQKV_CLIENT_TRANSPORT_TCP);
    put_all(g);
    pages_t want, got, again;
    get_ok(g, &want);
    ck_assert_int_eq(want.via_dc, 0);
    get_ok(t, &got);
    ck_assert_int_eq(got.via_grpc, 0);
    ck_assert_int_eq(got.via_dc, (NH - 1) * L + L); /* misses come over the channel too */
    ck_assert_int_eq(got.crc_unchecked, 0);
    ck_assert_str_eq(tqkv_client_data_channel_status(t, 0), "");
    same_pages(&got, &want);
    /* the channel is reused: a second Get over it */
    get_ok(t, &again);
    ck_assert_int_eq(again.via_grpc, 0);
    same_pages(&again, &want);
    /* BF16 Gets use gRPC on a TCP client */
    tqkv_get_req_t q = req();
    q.encoding = TQKV_CLIENT_BF16;
    q.num_hashes = 1;
    pages_t bf;
    memset(&bf, 0, sizeof bf);
    ck_assert_int_eq(tqkv_client_get(t, &q, on_page, &bf), TQKV_OK);
    ck_assert_int_eq(bf.via_dc, 0);
    ck_assert_int_eq(bf.via_grpc, L);
    pages_free(&want);
    pages_free(&got);
    pages_free(&again);
    tqkv_client_destroy(g);
    tqkv_client_destroy(t);
    srv_stop(&s);
}
END_TEST

START_TEST(dc_falls_back_without_data_listen)
{
    srv_t s;
    ck_assert_msg(srv_start(&s, 0, NULL) == 0, "cannot start tqkv-server");
    tqkv_client_t *t = client(&s, TQKV_CLIENT_TRANSPORT_TCP);
    put_all(t);
    pages_t got;
    get_ok(t, &got);
    ck_assert_int_eq(got.via_dc, 0);
    ck_assert_int_eq(got.via_grpc, NH * L);
    const char *why = tqkv_client_data_channel_status(t, 0);
    ck_assert_msg(strstr(why, "--data-listen") != NULL, "status: %s", why);
    pages_free(&got);
    tqkv_client_destroy(t);
    srv_stop(&s);
}
END_TEST

START_TEST(dc_cancel_mid_stream_then_get_again)
{
    srv_t s;
    ck_assert_msg(srv_start(&s, 0, DL) == 0, "cannot start tqkv-server");
    tqkv_client_t *t = client(&s, TQKV_CLIENT_TRANSPORT_TCP);
    put_all(t);
    pages_t want;
    get_ok(t, &want);
    for (size_t stop = 1; stop < NH * L; stop += 7) {
        pages_t part;
        memset(&part, 0, sizeof part);
        part.stop_after = stop;
        tqkv_get_req_t q = req();
        ck_assert_int_eq(tqkv_client_get(t, &q, on_page, &part), TQKV_ECANCELED);
        ck_assert_uint_eq(part.calls, stop);
        pages_free(&part);
        pages_t got;
        get_ok(t, &got);
        ck_assert_int_eq(got.via_grpc, 0);
        same_pages(&got, &want);
        pages_free(&got);
    }
    pages_free(&want);
    tqkv_client_destroy(t);
    srv_stop(&s);
}
END_TEST

typedef struct thr {
    tqkv_client_t *c;
    const pages_t *want;
    int fails, via_grpc;
} thr_t;

static void *
thr_main(void *arg)
{
    thr_t *a = arg;
    for (int i = 0; i < 12; i++) {
        pages_t p;
        memset(&p, 0, sizeof p);
        tqkv_get_req_t q = req();
        if (tqkv_client_get(a->c, &q, on_page, &p) != TQKV_OK || p.bad || p.calls != NH * L)
            a->fails++;
        for (size_t k = 0; k < NH * L && !a->fails; k++)
            if (p.found[k] != a->want->found[k] || p.len[k] != a->want->len[k] ||
                (p.found[k] == 1 && memcmp(p.data[k], a->want->data[k], p.len[k]) != 0))
                a->fails++;
        a->via_grpc += p.via_grpc;
        pages_free(&p);
    }
    return NULL;
}

START_TEST(dc_concurrent_gets)
{
    srv_t s;
    ck_assert_msg(srv_start(&s, 0, DL) == 0, "cannot start tqkv-server");
    tqkv_client_t *g = client(&s, TQKV_CLIENT_TRANSPORT_GRPC);
    tqkv_client_t *t = client(&s, TQKV_CLIENT_TRANSPORT_TCP);
    put_all(g);
    pages_t want;
    get_ok(g, &want);
    pthread_t th[4];
    thr_t a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (thr_t){t, &want, 0, 0};
        ck_assert_int_eq(pthread_create(&th[i], NULL, thr_main, &a[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(a[i].fails, 0);
        ck_assert_int_eq(a[i].via_grpc, 0);
    }
    pages_free(&want);
    tqkv_client_destroy(g);
    tqkv_client_destroy(t);
    srv_stop(&s);
}
END_TEST

START_TEST(dc_server_restart_drops_stale_channel)
{
    srv_t s;
    /* restarted on this port below: one no connection can take in between (ports.h) */
    int port = tqkv_test_free_port(0);
    ck_assert_int_gt(port, 0);
    ck_assert_msg(srv_start(&s, port, DL) == 0, "cannot start tqkv-server");
    tqkv_client_t *t = client(&s, TQKV_CLIENT_TRANSPORT_TCP);
    put_all(t);
    pages_t first;
    get_ok(t, &first); /* leaves an idle channel in the pool */
    ck_assert_int_eq(first.via_grpc, 0);
    srv_stop(&s);
    ck_assert_msg(srv_start(&s, port, DL) == 0, "cannot restart tqkv-server on %d", port);
    /* The first call after the restart may see the old connection break (gRPC's
     * reconnect, not the data channel): wait until a health check answers. */
    int serving = 0;
    for (int i = 0; i < 100 && !serving; i++)
        if (tqkv_client_health(t, 0, "", &serving) != TQKV_OK)
            usleep(50000);
    ck_assert_int_eq(serving, 1);
    put_all(t); /* same contents (same seed): the new server encodes the same pages */
    pages_t got;
    get_ok(t, &got);
    ck_assert_int_eq(got.via_grpc, 0);
    ck_assert_int_eq(got.via_dc, NH * L);
    pages_free(&first);
    pages_free(&got);
    tqkv_client_destroy(t);
    srv_stop(&s);
}
END_TEST

START_TEST(dc_target_host_parsing)
{
    char h[64];
    ck_assert_int_eq(tqkv__dcc_target_host("127.0.0.1:50051", h, sizeof h), 0);
    ck_assert_str_eq(h, "127.0.0.1");
    ck_assert_int_eq(tqkv__dcc_target_host("dns:///kv.svc:50051", h, sizeof h), 0);
    ck_assert_str_eq(h, "kv.svc");
    ck_assert_int_eq(tqkv__dcc_target_host("[::1]:50051", h, sizeof h), 0);
    ck_assert_str_eq(h, "::1");
    ck_assert_int_eq(tqkv__dcc_target_host("ipv6:[fe80::1]:7", h, sizeof h), 0);
    ck_assert_str_eq(h, "fe80::1");
    ck_assert_int_eq(tqkv__dcc_target_host("ipv4:10.0.0.1:1,10.0.0.2:1", h, sizeof h), 0);
    ck_assert_str_eq(h, "10.0.0.1");
    ck_assert_int_eq(tqkv__dcc_target_host("unix:/tmp/s", h, sizeof h), -1);
    ck_assert_int_eq(tqkv__dcc_target_host("[::1", h, sizeof h), -1);
    ck_assert_int_eq(tqkv__dcc_target_host("averyveryverylonghostname:1", h, 8), -1);
}
END_TEST

static Suite *
dc_suite(void)
{
    Suite *s = suite_create("client_dc");
    TCase *tc = tcase_create("dc");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, dc_pages_equal_grpc_pages);
    tcase_add_test(tc, dc_falls_back_without_data_listen);
    tcase_add_test(tc, dc_cancel_mid_stream_then_get_again);
    tcase_add_test(tc, dc_concurrent_gets);
    tcase_add_test(tc, dc_server_restart_drops_stale_channel);
    tcase_add_test(tc, dc_target_host_parsing);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(dc_suite)
