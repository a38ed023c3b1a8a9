/* client_nccl.c - libtqkv: NCCL channels (OpenChannel/CloseChannel) and Get over them,
 * with the gRPC fallback. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>

#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/wire.h"

/* ---- NCCL transport (issue 8) ---- */

#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif

struct tqkv_channel {
    size_t target;      /* index in the table of the call that opened it */
    target_t *target_t; /* the target itself (kept until the client goes) */
    int nccl;           /* 0: fallback */
    uint64_t id;        /* server channel id (nccl) */
    int device;
    void *comm; /* tqkv_nccl_comm_t * (nccl) */
    int broken; /* pages no longer in step with the server: unusable */
    char reason[320];
};

static tqkv_status_t open_channel_rpc_v(tqkv_client_t *c, size_t target, int device,
                                        uint32_t timeout_ms, uint64_t *id, uint8_t uid[128],
                                        size_t *uid_len);

tqkv_status_t
tqkv__client_open_channel_rpc(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms,
                              uint64_t *id, uint8_t uid[128], size_t *uid_len)
{
    if (c == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "open channel: client is NULL");
    tqkv_client_t v;
    tqkv_status_t st =
        open_channel_rpc_v(tqkv__view_enter(c, &v), target, device, timeout_ms, id, uid, uid_len);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
open_channel_rpc_v(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms, uint64_t *id,
                   uint8_t uid[128], size_t *uid_len)
{
    Tqkv__V1__OpenChannelRequest m;
    ProtobufCMessage *rq, *rs = NULL;
    tqkv_status_t st;
    if (target >= c->nt)
        return tqkv__client_err(TQKV_EINVAL, 0, "open channel: no target %zu", target);
    tqkv__v1__open_channel_request__init(&m);
    m.device = device;
    m.timeout_ms = timeout_ms;
    rq = &m.base;
    tqkv__unary_fanout(c, 1, &target, M_OPEN_CHANNEL, &rq,
                       &tqkv__v1__open_channel_response__descriptor, 0, &rs, &st);
    if (st != TQKV_OK)
        return st;
    Tqkv__V1__OpenChannelResponse *r = (Tqkv__V1__OpenChannelResponse *)rs;
    if (r->nccl_unique_id.len != 128 || r->rank != 1) {
        protobuf_c_message_free_unpacked(rs, NULL);
        return tqkv__client_err(TQKV_EINTERNAL, 0,
                                "open channel: malformed response (uid %zu bytes, rank %d)",
                                r->nccl_unique_id.len, (int)r->rank);
    }
    *id = r->channel_id;
    memcpy(uid, r->nccl_unique_id.data, 128);
    *uid_len = 128;
    protobuf_c_message_free_unpacked(rs, NULL);
    return TQKV_OK;
}

#ifdef TQKV_HAVE_NCCL
static void
close_channel_rpc(tqkv_client_t *c, const tqkv_channel_t *ch)
{
    Tqkv__V1__CloseChannelRequest m;
    ProtobufCMessage *rq, *rs = NULL;
    tqkv_status_t st;
    size_t target = ch->target;
    if (c == NULL || target >= c->nt)
        return; /* the server left the membership: nothing to tell */
    tqkv__v1__close_channel_request__init(&m);
    m.channel_id = ch->id;
    rq = &m.base;
    tqkv__unary_fanout(c, 1, &target, M_CLOSE_CHANNEL, &rq,
                       &tqkv__v1__close_channel_response__descriptor, 0, &rs, &st);
    if (rs)
        protobuf_c_message_free_unpacked(rs, NULL);
}
#endif

static tqkv_status_t open_channel_v(tqkv_client_t *c, size_t target, int device,
                                    uint32_t timeout_ms, tqkv_channel_t **out);

tqkv_status_t
tqkv_client_open_channel(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms,
                         tqkv_channel_t **out)
{
    if (c == NULL)
        return open_channel_v(NULL, target, device, timeout_ms, out);
    tqkv_client_t v;
    tqkv_status_t st = open_channel_v(tqkv__view_enter(c, &v), target, device, timeout_ms, out);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
open_channel_v(tqkv_client_t *c, size_t target, int device, uint32_t timeout_ms,
               tqkv_channel_t **out)
{
    if (out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "open channel: out is NULL");
    *out = NULL;
    if (c == NULL || target >= c->nt)
        return tqkv__client_err(TQKV_EINVAL, 0, "open channel: no target %zu", target);
    tqkv_channel_t *ch = calloc(1, sizeof *ch);
    if (ch == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    ch->target = target;
    ch->target_t = c->t[target];
    ch->device = device;
#ifdef TQKV_HAVE_NCCL
    int ndev = tqkv_nccl_device_count();
    if (device < 0 || device >= ndev) {
        snprintf(ch->reason, sizeof ch->reason, "no CUDA device %d on the client (%d visible)",
                 device, ndev);
        *out = ch;
        return TQKV_OK;
    }
    uint8_t uid[128];
    size_t uid_len = 0;
    tqkv_status_t st = open_channel_rpc_v(c, target, device, timeout_ms, &ch->id, uid, &uid_len);
    if (st != TQKV_OK) {
        const tqkv_client_error_t *e = tqkv_client_last_error();
        if (e->grpc_code != GRPC_STATUS_FAILED_PRECONDITION &&
            e->grpc_code != GRPC_STATUS_UNIMPLEMENTED) {
            free(ch);
            return st;
        }
        snprintf(ch->reason, sizeof ch->reason, "server: %s", e->message);
        *out = ch;
        return TQKV_OK;
    }
    char err[256];
    tqkv_nccl_comm_t *m = NULL;
    st = tqkv_nccl_comm_join(uid, 1, device, timeout_ms, &m, err, sizeof err);
    if (st != TQKV_OK) {
        close_channel_rpc(c, ch);
        ch->id = 0;
        snprintf(ch->reason, sizeof ch->reason, "NCCL communicator: %s", err);
        *out = ch;
        return TQKV_OK;
    }
    ch->comm = m;
    ch->nccl = 1;
#else
    (void)timeout_ms;
    snprintf(ch->reason, sizeof ch->reason, "libtqkv was built without NCCL");
#endif
    *out = ch;
    return TQKV_OK;
}

int
tqkv_channel_is_nccl(const tqkv_channel_t *ch)
{
    return ch != NULL && ch->nccl;
}

const char *
tqkv_channel_fallback_reason(const tqkv_channel_t *ch)
{
    return ch == NULL ? "no channel" : ch->reason;
}

static void close_channel_v(tqkv_client_t *c, tqkv_channel_t *ch);

void
tqkv_client_close_channel(tqkv_client_t *c, tqkv_channel_t *ch)
{
    if (c == NULL || ch == NULL) {
        close_channel_v(NULL, ch);
        return;
    }
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    ch->target = tqkv__view_find(&v, ch->target_t);
    close_channel_v(&v, ch);
    tqkv__view_leave(&v);
}

static void
close_channel_v(tqkv_client_t *c, tqkv_channel_t *ch)
{
    if (ch == NULL)
        return;
#ifdef TQKV_HAVE_NCCL
    if (ch->nccl) {
        tqkv_client_error_t saved = tqkv__client_last_err;
        close_channel_rpc(c, ch);
        tqkv__client_last_err = saved;
        tqkv_nccl_comm_free(ch->comm);
    }
#endif
    free(ch);
}

/* Fallback: an ordinary Get, pages delivered as host bytes. */
typedef struct nccl_fb {
    tqkv_nccl_cb_t cb;
    void *arg;
} nccl_fb_t;

static int
nccl_fb_cb(void *arg, const tqkv_get_page_t *pg)
{
    nccl_fb_t *f = arg;
    tqkv_nccl_page_t p;
    memset(&p, 0, sizeof p);
    p.hash_index = pg->hash_index;
    p.layer = pg->layer;
    p.found = pg->found;
    p.tier = pg->tier;
    p.shape = pg->shape;
    p.data = pg->page;
    p.len = pg->page_len;
    return f->cb(f->arg, &p);
}

#ifdef TQKV_HAVE_NCCL
static tqkv_status_t
get_over_nccl(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *q, void *const *dev_bufs,
              size_t n_bufs, size_t buf_len, tqkv_nccl_cb_t cb, void *arg)
{
    tqkv_status_t st = TQKV_OK;
    size_t n = q->num_hashes, total = n * (size_t)(q->layer_end - q->layer_begin), k = 0;
    int canceled = 0;
    char err[256];
    ProtobufCBinaryData *hb = malloc(n * sizeof *hb);
    if (hb == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        hb[i].data = (uint8_t *)q->hashes[i].bytes;
        hb[i].len = q->hashes[i].len;
    }
    Tqkv__V1__GetRequest m;
    tqkv__v1__get_request__init(&m);
    m.namespace_ = (char *)q->ns;
    m.hashes = hb;
    m.n_hashes = n;
    m.layer_begin = q->layer_begin;
    m.layer_end = q->layer_end;
    m.encoding = TQKV__V1__ENCODING__ENCODING_PACKED;
    m.transport = TQKV__V1__TRANSPORT__TRANSPORT_NCCL;
    m.channel_id = ch->id;
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    free(hb);
    if (bb == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    rpc_t r;
    memset(&r, 0, sizeof r);
    gpr_timespec dl = tqkv__deadline_after(q->deadline_ms ? q->deadline_ms : c->deadline_ms);
    uint32_t op_ms = q->deadline_ms ? q->deadline_ms : c->deadline_ms;
    st = tqkv__rpc_start(c, &r, cq, ch->target, M_GET, dl, bb);
    if (r.call == NULL) {
        grpc_byte_buffer_destroy(bb);
        r.init_bb = NULL;
    }
    if (st == TQKV_OK)
        tqkv__rpc_recv(&r);
    while (r.inflight > 0) {
        tag_kind_t kind;
        int ok;
        if (tqkv__cq_step(cq, &kind, &ok) == NULL)
            break;
        if (kind != TAG_RECV || r.recv_bb == NULL)
            continue;
        grpc_byte_buffer_reader rd;
        grpc_slice s = grpc_empty_slice();
        if (grpc_byte_buffer_reader_init(&rd, r.recv_bb)) {
            s = grpc_byte_buffer_reader_readall(&rd);
            grpc_byte_buffer_reader_destroy(&rd);
        }
        grpc_byte_buffer_destroy(r.recv_bb);
        r.recv_bb = NULL;
        Tqkv__V1__GetResponse *g =
            tqkv__v1__get_response__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
        grpc_slice_unref(s);
        if (st == TQKV_OK && (g == NULL || k >= total)) {
            st = tqkv__client_err(TQKV_EINTERNAL, 0, "get (nccl): malformed or extra response");
            ch->broken = 1;
            tqkv__rpc_cancel(&r);
        }
        if (st == TQKV_OK && !canceled) {
            tqkv_nccl_page_t p;
            memset(&p, 0, sizeof p);
            p.hash_index = k % n;
            p.layer = q->layer_begin + (uint32_t)(k / n);
            p.found = g->found;
            p.tier = (int)g->tier;
            p.shape.num_tokens = g->num_tokens;
            p.shape.num_kv_heads = g->num_kv_heads;
            p.shape.head_dim = g->head_dim;
            if (g->found && g->nccl_bytes > 0) {
                void *dst = dev_bufs[k % n_bufs];
                if (g->nccl_bytes > buf_len) {
                    st = tqkv__client_err(
                        TQKV_ENOSPC, 0,
                        "get (nccl): page of %llu bytes exceeds the %zu-byte buffers",
                        (unsigned long long)g->nccl_bytes, buf_len);
                } else {
                    tqkv_status_t rs = tqkv_nccl_comm_recv(ch->comm, dst, (size_t)g->nccl_bytes,
                                                           op_ms, err, sizeof err);
                    if (rs != TQKV_OK)
                        st = tqkv__client_err(rs, 0, "get (nccl): %s", err);
                }
                if (st != TQKV_OK) {
                    ch->broken = 1;
                    tqkv__rpc_cancel(&r);
                } else {
                    p.data = dst;
                    p.len = (size_t)g->nccl_bytes;
                    p.on_device = 1;
                    p.cuda_stream = tqkv_nccl_comm_stream(ch->comm);
                }
            } else if (g->found) {
                p.data = g->page.data; /* the server sent the bytes inline */
                p.len = g->page.len;
            }
            if (st == TQKV_OK && cb(arg, &p) != 0) {
                canceled = 1;
                ch->broken = 1;
                tqkv__rpc_cancel(&r);
            }
        }
        if (g)
            tqkv__v1__get_response__free_unpacked(g, NULL);
        k++;
        if (!r.recv_eof && st == TQKV_OK && !canceled)
            tqkv__rpc_recv(&r);
    }
    if (st == TQKV_OK && r.call) {
        if (canceled)
            st = tqkv__client_err(TQKV_ECANCELED, 0, "get (nccl): cancelled by the callback");
        else
            st = tqkv__rpc_result(c, &r);
        if (st != TQKV_OK && !canceled)
            ch->broken = 1;
        if (st == TQKV_OK && k != total) {
            ch->broken = 1;
            st = tqkv__client_err(TQKV_EINTERNAL, 0, "get (nccl): %zu of %zu pages received", k,
                                  total);
        }
    }
    tqkv__rpc_fini(&r);
    tqkv__cq_destroy(cq);
    return st;
}
#endif

static tqkv_status_t get_nccl_v(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *req,
                                void *const *dev_bufs, size_t n_bufs, size_t buf_len,
                                tqkv_nccl_cb_t cb, void *arg);

tqkv_status_t
tqkv_client_get_nccl(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *req,
                     void *const *dev_bufs, size_t n_bufs, size_t buf_len, tqkv_nccl_cb_t cb,
                     void *arg)
{
    if (c == NULL)
        return get_nccl_v(NULL, ch, req, dev_bufs, n_bufs, buf_len, cb, arg);
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    tqkv_status_t st;
    if (ch && ch->nccl && (ch->target = tqkv__view_find(&v, ch->target_t)) == v.nt)
        st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                              "get (nccl): the channel's server left the membership; close it");
    else
        st = get_nccl_v(&v, ch, req, dev_bufs, n_bufs, buf_len, cb, arg);
    tqkv__view_leave(&v);
    return st;
}

static tqkv_status_t
get_nccl_v(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *req, void *const *dev_bufs,
           size_t n_bufs, size_t buf_len, tqkv_nccl_cb_t cb, void *arg)
{
    if (c == NULL || req == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "get (nccl): client and request required");
    if (req->encoding != TQKV_CLIENT_PACKED)
        return tqkv__client_err(TQKV_EINVAL, 0, "get (nccl): PACKED encoding only");
    if (ch == NULL || !ch->nccl) {
        nccl_fb_t f = {cb, arg};
        return tqkv_client_get(c, req, nccl_fb_cb, &f); /* a view of its own */
    }
#ifdef TQKV_HAVE_NCCL
    if (req->ns == NULL || cb == NULL || req->layer_end <= req->layer_begin)
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "get: namespace, callback and layer_end > layer_begin");
    if (dev_bufs == NULL || n_bufs == 0 || buf_len == 0)
        return tqkv__client_err(TQKV_EINVAL, 0, "get (nccl): device buffers required");
    for (size_t i = 0; i < req->num_hashes; i++)
        if (!tqkv__hash_ok(&req->hashes[i]))
            return tqkv__client_err(TQKV_EINVAL, 0, "get: hash %zu is not 8..64 bytes", i);
    if (ch->broken)
        return tqkv__client_err(TQKV_ECANCELED, 0, "get (nccl): the channel is broken; close it");
    if (req->num_hashes == 0)
        return TQKV_OK;
    return get_over_nccl(c, ch, req, dev_bufs, n_bufs, buf_len, cb, arg);
#else
    return tqkv__client_err(TQKV_EINTERNAL, 0, "unreachable");
#endif
}
