/* check_nccl.c - the NCCL transport's fallback against a real tqkv-server on loopback
 * (label "server"; CTest hides every CUDA device: CUDA_VISIBLE_DEVICES="").
 *
 * Without a GPU (or without NCCL in the build) OpenChannel and a Get with transport
 * NCCL answer FAILED_PRECONDITION, and the client's NCCL get falls back to gRPC and
 * delivers the very bytes an ordinary PACKED Get returns. The NCCL data path itself
 * is tests/check_nccl_gpu.c (label gpu).
 */
#include <check.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check_main.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

#define NO_NCCL "NCCL transport not available on this server"

static srv_t S;
static tqkv_client_t *CL;
static uint64_t SEED;

static void
setup(void)
{
    SEED = tqkv_test_seed();
    ck_assert_msg(srv_start(&S, 0, NULL) == 0, "cannot start tqkv-server");
    const char *t[1] = {S.addr};
    tqkv_client_opts_t o = {
        .targets = t, .num_targets = 1, .deadline_ms = 30000, .wait_for_ready = 1};
    ck_assert_int_eq(tqkv_client_create(&o, &CL), TQKV_OK);
}

static void
teardown(void)
{
    tqkv_client_destroy(CL);
    CL = NULL;
    srv_stop(&S);
}

/* One call of method with the packed request msg on a fresh channel: writes the
 * final status code, details, and the number of response messages read (at most
 * one). The library's client created grpc_init's reference already. */
static void
raw_call(const char *method, const ProtobufCMessage *msg, grpc_status_code *code, char *details,
         size_t dlen, int *nmsg)
{
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(S.addr, cr, NULL);
    grpc_channel_credentials_release(cr);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec dl =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(20, GPR_TIMESPAN));
    grpc_call *call =
        grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                 grpc_slice_from_static_string(method), NULL, dl, NULL);
    ck_assert_ptr_nonnull(call);
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *req = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_byte_buffer *resp = NULL;
    grpc_metadata_array im, tm;
    grpc_metadata_array_init(&im);
    grpc_metadata_array_init(&tm);
    grpc_slice det = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &im;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &resp;
    ck_assert_int_eq(grpc_call_start_batch(call, ops, 5, (void *)1, NULL), GRPC_CALL_OK);
    ck_assert_int_eq(grpc_completion_queue_pluck(cq, (void *)1, dl, NULL).type, GRPC_OP_COMPLETE);
    *nmsg = resp != NULL;
    if (resp)
        grpc_byte_buffer_destroy(resp);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &tm;
    ops[0].data.recv_status_on_client.status = code;
    ops[0].data.recv_status_on_client.status_details = &det;
    ck_assert_int_eq(grpc_call_start_batch(call, ops, 1, (void *)2, NULL), GRPC_CALL_OK);
    ck_assert_int_eq(grpc_completion_queue_pluck(cq, (void *)2, dl, NULL).type, GRPC_OP_COMPLETE);
    size_t l = GRPC_SLICE_LENGTH(det) < dlen - 1 ? GRPC_SLICE_LENGTH(det) : dlen - 1;
    memcpy(details, GRPC_SLICE_START_PTR(det), l);
    details[l] = '\0';
    grpc_slice_unref(det);
    grpc_byte_buffer_destroy(req);
    grpc_metadata_array_destroy(&im);
    grpc_metadata_array_destroy(&tm);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
}

START_TEST(open_channel_without_gpu_is_failed_precondition)
{
    uint64_t id = 0;
    uint8_t uid[128];
    size_t uid_len = 0;
    tqkv_status_t st = tqkv__client_open_channel_rpc(CL, 0, 0, 2000, &id, uid, &uid_len);
    ck_assert_int_ne(st, TQKV_OK);
    const tqkv_client_error_t *e = tqkv_client_last_error();
    ck_assert_int_eq(e->grpc_code, GRPC_STATUS_FAILED_PRECONDITION);
    ck_assert_msg(strstr(e->message, NO_NCCL) != NULL, "message: %s", e->message);

    /* The raw RPCs: OpenChannel, CloseChannel and a Get asking for NCCL. */
    grpc_status_code code;
    char det[256];
    int nmsg;
    Tqkv__V1__OpenChannelRequest oc = TQKV__V1__OPEN_CHANNEL_REQUEST__INIT;
    oc.timeout_ms = 1000;
    raw_call("/tqkv.v1.KVCache/OpenChannel", &oc.base, &code, det, sizeof det, &nmsg);
    ck_assert_int_eq(code, GRPC_STATUS_FAILED_PRECONDITION);
    ck_assert_str_eq(det, NO_NCCL);
    ck_assert_int_eq(nmsg, 0);

    Tqkv__V1__CloseChannelRequest cc = TQKV__V1__CLOSE_CHANNEL_REQUEST__INIT;
    cc.channel_id = 42;
    raw_call("/tqkv.v1.KVCache/CloseChannel", &cc.base, &code, det, sizeof det, &nmsg);
    ck_assert_msg(code == GRPC_STATUS_FAILED_PRECONDITION || code == GRPC_STATUS_NOT_FOUND,
                  "CloseChannel of an unknown id: %d %s", (int)code, det);

    uint8_t hb[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    ProtobufCBinaryData h = {sizeof hb, hb};
    Tqkv__V1__GetRequest g = TQKV__V1__GET_REQUEST__INIT;
    g.namespace_ = "nccl";
    g.hashes = &h;
    g.n_hashes = 1;
    g.layer_begin = 0;
    g.layer_end = 1;
    g.transport = TQKV__V1__TRANSPORT__TRANSPORT_NCCL;
    g.channel_id = 42;
    raw_call("/tqkv.v1.KVCache/Get", &g.base, &code, det, sizeof det, &nmsg);
    ck_assert_int_eq(code, GRPC_STATUS_FAILED_PRECONDITION);
    ck_assert_str_eq(det, NO_NCCL);
    ck_assert_int_eq(nmsg, 0);

    /* An ordinary Get (transport GRPC, explicit) still streams: the block is missing. */
    g.transport = TQKV__V1__TRANSPORT__TRANSPORT_GRPC;
    g.channel_id = 0;
    raw_call("/tqkv.v1.KVCache/Get", &g.base, &code, det, sizeof det, &nmsg);
    ck_assert_int_eq(code, GRPC_STATUS_OK);
    ck_assert_int_eq(nmsg, 1);
}
END_TEST

/* Pages as delivered, [hash * L + layer]. */
typedef struct pages {
    size_t nh, L;
    uint8_t **data;
    size_t *len;
    int *found; /* 0 unseen, 1 found, 2 missing */
    int bad;
    int on_device;
    size_t calls;
} pages_t;

static void
pages_init(pages_t *p, size_t nh, size_t L)
{
    memset(p, 0, sizeof *p);
    p->nh = nh;
    p->L = L;
    p->data = calloc(nh * L, sizeof *p->data);
    p->len = calloc(nh * L, sizeof *p->len);
    p->found = calloc(nh * L, sizeof *p->found);
    ck_assert(p->data && p->len && p->found);
}

static void
pages_free(pages_t *p)
{
    for (size_t i = 0; i < p->nh * p->L; i++)
        free(p->data[i]);
    free(p->data);
    free(p->len);
    free(p->found);
}

static void
pages_put(pages_t *p, size_t hi, uint32_t layer, int found, const void *d, size_t n)
{
    size_t k = hi * p->L + layer;
    if (hi >= p->nh || layer >= p->L || p->found[k]) {
        p->bad++;
        return;
    }
    p->found[k] = found ? 1 : 2;
    if (found) {
        p->data[k] = malloc(n ? n : 1);
        memcpy(p->data[k], d, n);
        p->len[k] = n;
    }
}

static int
on_grpc(void *arg, const tqkv_get_page_t *pg)
{
    pages_put(arg, pg->hash_index, pg->layer, pg->found, pg->page, pg->page_len);
    return 0;
}

static int
on_nccl(void *arg, const tqkv_nccl_page_t *pg)
{
    pages_t *p = arg;
    p->calls++;
    p->on_device |= pg->on_device;
    pages_put(p, pg->hash_index, pg->layer, pg->found, pg->data, pg->len);
    return 0;
}

START_TEST(nccl_get_falls_back_to_grpc_byte_identical)
{
    enum { NH = 5, L = 3, MISSING = 3 };
    tqkv_block_shape_t sh = {32, 2, 128};
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    tqkv_hash_t hs[NH];
    for (size_t i = 0; i < NH; i++)
        tqkv_test_hash(&hs[i], SEED, i, 16);
    /* Store every block but hash MISSING. */
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 2};
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(CL, &po, &p), TQKV_OK);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    uint64_t seed = SEED;
    for (size_t b = 0; b < NH; b++) {
        if (b == MISSING)
            continue;
        for (uint32_t l = 0; l < L; l++) {
            tqkv_test_bf16_fill(&seed, k, n, sh.head_dim);
            tqkv_test_bf16_fill(&seed, v, n, sh.head_dim);
            tqkv_put_block_t pb = {.ns = "nccl",
                                   .hash = &hs[b],
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = sh,
                                   .key = k,
                                   .value = v};
            ck_assert_msg(tqkv_client_put_block(p, &pb) == TQKV_OK, "put: %s",
                          tqkv_client_last_error()->message);
        }
    }
    ck_assert_int_eq(tqkv_client_put_end(p, NULL), TQKV_OK);
    free(k);
    free(v);

    tqkv_channel_t *ch = NULL;
    ck_assert_msg(tqkv_client_open_channel(CL, 0, 0, 2000, &ch) == TQKV_OK, "open: %s",
                  tqkv_client_last_error()->message);
    ck_assert_ptr_nonnull(ch);
    ck_assert_int_eq(tqkv_channel_is_nccl(ch), 0);
    ck_assert_str_ne(tqkv_channel_fallback_reason(ch), "");

    tqkv_get_req_t q = {.ns = "nccl",
                        .hashes = hs,
                        .num_hashes = NH,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = TQKV_CLIENT_PACKED};
    pages_t want, got;
    pages_init(&want, NH, L);
    pages_init(&got, NH, L);
    ck_assert_int_eq(tqkv_client_get(CL, &q, on_grpc, &want), TQKV_OK);
    tqkv_status_t st = tqkv_client_get_nccl(CL, ch, &q, NULL, 0, 0, on_nccl, &got);
    ck_assert_msg(st == TQKV_OK, "get_nccl: %s", tqkv_client_last_error()->message);
    ck_assert_int_eq(got.bad, 0);
    ck_assert_int_eq(got.on_device, 0);
    ck_assert_uint_eq(got.calls, NH * L);
    for (size_t b = 0; b < NH; b++) {
        for (uint32_t l = 0; l < L; l++) {
            size_t s = b * L + l;
            ck_assert_int_eq(got.found[s], b == MISSING ? 2 : 1);
            ck_assert_int_eq(got.found[s], want.found[s]);
            ck_assert_uint_eq(got.len[s], want.len[s]);
            if (got.found[s] == 1)
                ck_assert(memcmp(got.data[s], want.data[s], got.len[s]) == 0);
        }
    }
    /* A NULL channel falls back too; BF16 is refused (the NCCL path is PACKED only). */
    pages_free(&got);
    pages_init(&got, NH, L);
    ck_assert_int_eq(tqkv_client_get_nccl(CL, NULL, &q, NULL, 0, 0, on_nccl, &got), TQKV_OK);
    ck_assert_uint_eq(got.calls, NH * L);
    q.encoding = TQKV_CLIENT_BF16;
    ck_assert_int_eq(tqkv_client_get_nccl(CL, ch, &q, NULL, 0, 0, on_nccl, &got), TQKV_EINVAL);
    tqkv_client_close_channel(CL, ch);
    pages_free(&want);
    pages_free(&got);
}
END_TEST

/* With auth on, OpenChannel needs a known token (any namespace). */
START_TEST(open_channel_needs_a_token)
{
    char path[] = "/tmp/tqkv_nccl_tokens_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const char line[] = "s3cret-token-1 r ns1\n";
    ck_assert_int_eq(write(fd, line, sizeof line - 1), (ssize_t)(sizeof line - 1));
    close(fd);
    srv_t a;
    const char *extra[] = {"--auth-tokens", path, NULL};
    ck_assert_msg(srv_start(&a, 0, extra) == 0, "cannot start tqkv-server with auth");
    for (int with = 0; with < 2; with++) {
        const char *t[1] = {a.addr};
        tqkv_client_opts_t o = {.targets = t,
                                .num_targets = 1,
                                .deadline_ms = 20000,
                                .wait_for_ready = 1,
                                .token = with ? "s3cret-token-1" : NULL};
        tqkv_client_t *c = NULL;
        ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
        uint64_t id;
        uint8_t uid[128];
        size_t ul;
        ck_assert_int_ne(tqkv__client_open_channel_rpc(c, 0, 0, 1000, &id, uid, &ul), TQKV_OK);
        ck_assert_int_eq(tqkv_client_last_error()->grpc_code,
                         with ? GRPC_STATUS_FAILED_PRECONDITION : GRPC_STATUS_UNAUTHENTICATED);
        tqkv_client_destroy(c);
    }
    srv_stop(&a);
    unlink(path);
}
END_TEST

static Suite *
nccl_suite(void)
{
    Suite *s = suite_create("nccl");
    TCase *tc = tcase_create("fallback");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, open_channel_without_gpu_is_failed_precondition);
    tcase_add_test(tc, nccl_get_falls_back_to_grpc_byte_identical);
    suite_add_tcase(s, tc);
    TCase *ta = tcase_create("auth");
    tcase_set_timeout(ta, 120);
    tcase_add_test(ta, open_channel_needs_a_token);
    suite_add_tcase(s, ta);
    return s;
}

TQKV_CHECK_MAIN(nccl_suite)
