/* handlers_nccl.c - Get with transport = TRANSPORT_NCCL (issue 8), switched to by the
 * Get dispatch in handlers_channel.c, which also answers OpenChannel/CloseChannel.
 *
 * Without NCCL in the build (or without a CUDA device at run time) OpenChannel and a
 * NCCL Get answer FAILED_PRECONDITION "NCCL transport not available on this server":
 * the client's signal to fall back to gRPC.
 *
 * With NCCL, a Get on a channel sends, per (layer, hash) in layer-major order, a
 * GetResponse with the metadata and nccl_bytes = page length (no page bytes) on the
 * gRPC stream, and queues the page on the channel (transport/nccl_channel.c), whose
 * thread stages it into a ring of device buffers and ncclSends it in order. When the
 * ring is full the call waits (state WORK, a reserved TAG_WAKE fired by the channel
 * thread). One Get at a time per channel. A cancelled or failed NCCL Get aborts its
 * channel (the peer's receives no longer match the sends); so do CloseChannel and a
 * communicator error or timeout.
 */
#include <grpc/slice.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/wire.h"

#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif

#define NERR 320

#ifdef TQKV_HAVE_NCCL
/* The server's CUDA device for channels: env TQKV_NCCL_DEVICE, default 0. -1: none. */
int
tqkv__nccl_device(void)
{
    int n = tqkv_nccl_device_count();
    const char *e = getenv("TQKV_NCCL_DEVICE");
    int d = e ? atoi(e) : 0;
    return n > 0 && d >= 0 && d < n ? d : -1;
}
#endif

/* ---- Get over NCCL ---- */

typedef struct nget {
    Tqkv__V1__GetRequest *req;
    size_t i, total;
    uint64_t hits, misses;
#ifdef TQKV_HAVE_NCCL
    tqkv_nccl_chan_t *ch;
    int claimed;
    tqkv_page_ref_t *held; /* block i, waiting for room in the channel's window */
#endif
} nget_t;

#ifdef TQKV_HAVE_NCCL
static void
release_ref(void *p)
{
    tqkv_page_ref_release(p);
}

static void
nccl_wake(void *arg)
{
    tqkv__call_wake(arg);
}

/* Metadata of one block, read from the pinned page before the page is queued. */
typedef struct nmeta {
    int found;
    tqkv_page_header_t hdr;
    int tier;
    size_t len;
} nmeta_t;

static void
nmeta_of(nmeta_t *mt, const tqkv_page_ref_t *ref)
{
    mt->found = 1;
    memcpy(&mt->hdr, tqkv_page_ref_data(ref), sizeof mt->hdr);
    mt->tier = (int)tqkv_page_ref_tier(ref);
    mt->len = tqkv_page_ref_len(ref);
}

static void
nget_meta(tqkv__call_t *c, const nmeta_t *mt)
{
    nget_t *h = c->h;
    size_t nh = h->req->n_hashes;
    Tqkv__V1__GetResponse m = TQKV__V1__GET_RESPONSE__INIT;
    m.hash = h->req->hashes[h->i % nh];
    m.layer = h->req->layer_begin + (uint32_t)(h->i / nh);
    if (mt->found) {
        m.found = 1;
        m.num_tokens = mt->hdr.num_tokens;
        m.num_kv_heads = mt->hdr.num_kv_heads;
        m.head_dim = mt->hdr.head_dim;
        m.tier = (Tqkv__V1__Tier)mt->tier;
        m.nccl_bytes = mt->len;
    }
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    if (bb == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INTERNAL, "response encoding failed", NULL);
        return;
    }
    tqkv__call_send(c, bb);
}

static void
nget_fail(tqkv__call_t *c, grpc_status_code code, const char *msg)
{
    nget_t *h = c->h;
    if (h->ch)
        tqkv_nccl_chan_abort(h->ch); /* the peer's receives no longer match */
    tqkv__call_finish(c, code, msg, NULL);
}

/* Sends block h->i: queue the page on the channel (or wait for room), then the
 * metadata on the stream. */
static void
nget_next(tqkv__call_t *c)
{
    nget_t *h = c->h;
    char msg[NERR];
    if (c->closed) { /* cancelled or deadline passed */
        if (h->ch)
            tqkv_nccl_chan_abort(h->ch);
        tqkv__call_abort(c);
        return;
    }
    if (h->i >= h->total) {
        const char *ns = h->req->namespace_;
        /* Free for the client's next Get before it sees the status (sends still in
         * the channel's queue go out first: one queue, in order). */
        tqkv_nccl_chan_unclaim(h->ch);
        h->claimed = 0;
        tqkv_metrics_ns_access(c->srv->metrics, ns, strlen(ns), h->hits, h->misses);
        tqkv__call_finish(c, GRPC_STATUS_OK, NULL, NULL);
        return;
    }
    tqkv_page_ref_t *ref = h->held;
    h->held = NULL;
    if (ref == NULL) {
        size_t nh = h->req->n_hashes;
        const ProtobufCBinaryData *hash = &h->req->hashes[h->i % nh];
        uint32_t layer = h->req->layer_begin + (uint32_t)(h->i / nh);
        tqkv_block_key_t key = {h->req->namespace_, strlen(h->req->namespace_), hash->data,
                                hash->len, layer};
        tqkv_status_t st = tqkv_store_get(c->srv->store, &key, &ref);
        if (st == TQKV_ENOTFOUND) {
            nmeta_t miss = {0};
            h->misses++;
            nget_meta(c, &miss);
            return;
        }
        if (st != TQKV_OK) {
            snprintf(msg, sizeof msg, "layer %u, hashes[%zu]: %s", layer, h->i % nh,
                     tqkv_strerror(st));
            nget_fail(c, tqkv_status_to_grpc(st), msg);
            return;
        }
        h->hits++;
    }
    nmeta_t mt;
    nmeta_of(&mt, ref);
    for (;;) {
        tqkv_status_t st = tqkv_nccl_chan_send(h->ch, tqkv_page_ref_data(ref),
                                               tqkv_page_ref_len(ref), release_ref, ref);
        if (st == TQKV_OK) {
            /* The channel thread owns (and releases) the ref from now on. */
            nget_meta(c, &mt);
            return;
        }
        if (st != TQKV_EBUSY) {
            tqkv_page_ref_release(ref);
            nget_fail(c, GRPC_STATUS_ABORTED, "NCCL channel failed or was closed");
            return;
        }
        tqkv__call_reserve_wake(c);
        if (tqkv_nccl_chan_wait_room(h->ch, nccl_wake, c)) {
            h->held = ref;
            tqkv__call_set_state(c, TQKV__CS_WORK);
            return;
        }
        c->inflight--; /* room freed meanwhile: no wake registered */
        if (!tqkv_nccl_chan_alive(h->ch)) {
            tqkv_page_ref_release(ref);
            nget_fail(c, GRPC_STATUS_ABORTED, "NCCL channel failed or was closed");
            return;
        }
    }
}
#endif

static void
nget_start(tqkv__call_t *c)
{
    nget_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    c->h = h;
    if (tqkv__get_request(c, &h->req) != 0)
        return;
#ifdef TQKV_HAVE_NCCL
    char err[NERR];
    if (tqkv__nccl_device() < 0) {
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, TQKV__NO_NCCL, NULL);
        return;
    }
    if (h->req->encoding != TQKV__V1__ENCODING__ENCODING_PACKED) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "encoding: the NCCL transport sends PACKED pages only", NULL);
        return;
    }
    h->ch = tqkv_nccl_chan_get(h->req->channel_id);
    if (h->ch == NULL) {
        snprintf(err, sizeof err, "channel_id %llu: no such open NCCL channel",
                 (unsigned long long)h->req->channel_id);
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, err, NULL);
        return;
    }
    if (!tqkv_nccl_chan_claim(h->ch)) {
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION,
                          "NCCL channel busy: one Get at a time per channel", NULL);
        return;
    }
    h->claimed = 1;
    h->total = (size_t)(h->req->layer_end - h->req->layer_begin) * h->req->n_hashes;
    nget_next(c);
#else
    tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, TQKV__NO_NCCL, NULL);
#endif
}

static void
nget_sent(tqkv__call_t *c, int ok)
{
#ifdef TQKV_HAVE_NCCL
    nget_t *h = c->h;
    h->i++;
    nget_next(c);
#endif
}

static void
nget_wake(tqkv__call_t *c)
{
#ifdef TQKV_HAVE_NCCL
    if (c->state == TQKV__CS_DONE || c->state == TQKV__CS_STATUS)
        return; /* abandoned meanwhile; on_free releases what is held */
    nget_next(c);
#endif
}

static void
nget_close(tqkv__call_t *c)
{
#ifdef TQKV_HAVE_NCCL
    nget_t *h = c->h;
    /* Cancelled, deadline or peer gone before the status: the sends are orphaned. */
    if (h && h->ch && c->cancelled)
        tqkv_nccl_chan_abort(h->ch);
#endif
}

static void
nget_free(tqkv__call_t *c)
{
    nget_t *h = c->h;
    if (h == NULL)
        return;
#ifdef TQKV_HAVE_NCCL
    if (h->held)
        tqkv_page_ref_release(h->held);
    if (h->ch) {
        if (h->claimed)
            tqkv_nccl_chan_unclaim(h->ch);
        tqkv_nccl_chan_put(h->ch);
    }
#endif
    if (h->req)
        tqkv__v1__get_request__free_unpacked(h->req, NULL);
    free(h);
    c->h = NULL;
}

const tqkv__handler_t tqkv__get_nccl_handler = {
    .path = "/tqkv.v1.KVCache/Get",
    .metric = "Get",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = nget_start,
    .on_send = nget_sent,
    .on_wake = nget_wake,
    .on_close = nget_close,
    .on_free = nget_free,
};
