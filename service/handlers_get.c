/* handlers_get.c - the tqkv.v1.KVCache Get method: server streaming, zero-copy page sends,
 * BF16 decode on the encoder pool, the read and check of a GetRequest that every Get
 * transport shares (tqkv__get_request), and the hand-encoded GetResponse prefixes.
 */
#include <grpc/slice.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/varint.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "transport/wire.h"

/* ---- protobuf hand-encoding of GetResponse prefixes ---- */

/* Fields 1 (hash), 2 (layer), 3 (found), 7-9 (shape), 10 (tier) of a GetResponse
 * (tags from transport/wire.h). */
static size_t
get_prefix(uint8_t *p, const ProtobufCBinaryData *hash, uint32_t layer, int found,
           const tqkv_page_header_t *hdr, int tier)
{
    size_t n = 0;
    p[n++] = TQKV_GET_TAG_HASH;
    n += tqkv_varint_put(p + n, hash->len);
    memcpy(p + n, hash->data, hash->len);
    n += hash->len;
    p[n++] = TQKV_GET_TAG_LAYER;
    n += tqkv_varint_put(p + n, layer);
    if (found) {
        p[n++] = TQKV_GET_TAG_FOUND;
        p[n++] = 1;
        p[n++] = TQKV_GET_TAG_NUM_TOKENS;
        n += tqkv_varint_put(p + n, hdr->num_tokens);
        p[n++] = TQKV_GET_TAG_NUM_KV_HEADS;
        n += tqkv_varint_put(p + n, hdr->num_kv_heads);
        p[n++] = TQKV_GET_TAG_HEAD_DIM;
        n += tqkv_varint_put(p + n, hdr->head_dim);
        p[n++] = TQKV_GET_TAG_TIER;
        n += tqkv_varint_put(p + n, (uint64_t)tier);
    }
    return n;
}

/* Bytes of the GetResponse of a found block: the prefix, then the page (PACKED, plen
 * bytes) or each tensor the page holds, decoded to BF16. */
static uint64_t
get_response_bytes(const ProtobufCBinaryData *hash, uint32_t layer, const tqkv_page_header_t *hdr,
                   int tier, int bf16, size_t plen)
{
    uint8_t pre[128];
    uint64_t n = get_prefix(pre, hash, layer, 1, hdr, tier);
    if (!bf16)
        return n + 1 + tqkv_varint_len(plen) + plen;
    uint64_t tb = (uint64_t)hdr->num_tokens * hdr->num_kv_heads * hdr->head_dim * 2;
    for (int t = 0; t < 2; t++)
        if (hdr->tensor[t].bits_x2)
            n += 1 + tqkv_varint_len(tb) + tb;
    return n;
}

/* ---- Get ----
 *
 * Layer-major order, one SEND_MESSAGE in flight (the back-pressure). PACKED sends
 * each pinned page without a copy (a slice whose destroy callback drops the pin).
 * BF16 decodes on the encoder pool with a read-ahead window: up to `window` blocks
 * after the one being sent are looked up and decoding, and they are sent strictly in
 * order. A store error on a block fails the call once the jobs in flight are back.
 */

#define GET_WINDOW_MAX 8

typedef enum slot_state {
    SLOT_FREE = 0, /* unused */
    SLOT_BUSY,     /* decode job running */
    SLOT_READY,    /* result ready to send (found or missing or failed) */
} slot_state_t;

typedef struct get_slot {
    tqkv__call_t *call;
    slot_state_t state; /* BUSY -> READY written by the job under the state's mu */
    int found;
    tqkv_status_t st;     /* store or decode status */
    uint64_t too_big;     /* > 0: the response would be this many bytes, over the limit */
    tqkv_page_ref_t *ref; /* pinned while decoding (released by the job) */
    tqkv_page_header_t hdr;
    int tier;
    uint16_t *k, *v; /* decoded tensors, handed to the slices when sent */
    size_t tensor_bytes;
} get_slot_t;

typedef struct get_state {
    Tqkv__V1__GetRequest *req;
    size_t i;     /* next block to send */
    size_t j;     /* next block to look up (BF16 read-ahead) */
    size_t total; /* (layer_end - layer_begin) * n_hashes */
    uint64_t hits, misses;
    /* BF16 */
    pthread_mutex_t mu; /* slot state transitions made by jobs */
    unsigned window;
    unsigned jobs; /* decode jobs in flight (worker thread only) */
    int sending;   /* a SEND_MESSAGE is in flight */
    int prefetch;  /* copying blocks a peer owns (forward.h) before streaming */
    /* Disk reads, off this thread: at the first disk-only block (tqkv_store_get_cached
     * says TQKV_EBUSY) a job on the encoder pool pins it and the disk-only blocks after
     * it (tqkv_store_pin_disk); the call goes on when it wakes. disk_wait and pins are
     * written by the job under mu. */
    int disk_wait;           /* a disk job is in flight */
    size_t disk_from;        /* first block of the last disk job (SIZE_MAX: none) */
    tqkv_store_pins_t *pins; /* its pages, taken as they are sent */
    tqkv_status_t fail;      /* the first failure (err says what), TQKV_OK while none */
    char err[TQKV__KV_ERRLEN];
    get_slot_t slots[GET_WINDOW_MAX];
} get_state_t;

static void
release_ref(void *p)
{
    tqkv_page_ref_release(p);
}

static uint64_t
page_bf16_bytes(const tqkv_page_header_t *hdr)
{
    uint64_t n = (uint64_t)hdr->num_tokens * hdr->num_kv_heads * hdr->head_dim * 2;
    return n * ((hdr->tensor[0].bits_x2 != 0) + (hdr->tensor[1].bits_x2 != 0));
}

static void
block_of(const get_state_t *h, size_t idx, uint32_t *layer, const ProtobufCBinaryData **hash)
{
    size_t nh = h->req->n_hashes;
    *layer = h->req->layer_begin + (uint32_t)(idx / nh);
    *hash = &h->req->hashes[idx % nh];
}

/* Block idx from the pins or HBM/DRAM. TQKV_EBUSY: it is on disk only; start a disk job
 * (get_disk_start). A block still on disk only right after a job that began at it (it
 * was in DRAM then, and evicted since) is read here: that cannot repeat. */
static tqkv_status_t
lookup_block(tqkv__call_t *c, size_t idx, tqkv_page_ref_t **ref)
{
    get_state_t *h = c->h;
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    int miss = 0;
    tqkv_status_t st;
    block_of(h, idx, &layer, &hash);
    tqkv_block_key_t key = {h->req->namespace_, strlen(h->req->namespace_), hash->data, hash->len,
                            layer};
    if ((*ref = tqkv_store_pins_take(h->pins, idx, &miss)) != NULL)
        st = TQKV_OK;
    else if (miss)
        st = TQKV_ENOTFOUND;
    else if ((st = tqkv_store_get_cached(c->srv->store, &key, ref)) == TQKV_EBUSY &&
             idx == h->disk_from)
        st = tqkv_store_get(c->srv->store, &key, ref);
    if (st == TQKV_OK)
        h->hits++;
    else if (st == TQKV_ENOTFOUND)
        h->misses++;
    return st;
}

static void
get_send_missing(tqkv__call_t *c, size_t idx)
{
    uint8_t pre[96];
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(c->h, idx, &layer, &hash);
    size_t n = get_prefix(pre, hash, layer, 0, NULL, 0);
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)pre, n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    tqkv__call_send(c, bb);
}

static void
get_send_packed(tqkv__call_t *c, size_t idx, tqkv_page_ref_t *ref)
{
    uint8_t pre[128];
    tqkv_page_header_t hdr;
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(c->h, idx, &layer, &hash);
    const void *page = tqkv_page_ref_data(ref);
    size_t plen = tqkv_page_ref_len(ref);
    memcpy(&hdr, page, sizeof hdr);
    size_t n = get_prefix(pre, hash, layer, 1, &hdr, (int)tqkv_page_ref_tier(ref));
    pre[n++] = TQKV_GET_TAG_PAGE;
    n += tqkv_varint_put(pre + n, plen);
    grpc_slice sl[2];
    sl[0] = grpc_slice_from_copied_buffer((const char *)pre, n);
    /* Zero copy: the slice wraps the pinned page; its last unref releases the pin. */
    sl[1] = grpc_slice_new_with_user_data((void *)page, plen, release_ref, ref);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, 2);
    grpc_slice_unref(sl[0]);
    grpc_slice_unref(sl[1]);
    tqkv_metrics_add_bytes(c->srv->metrics, 0, plen, page_bf16_bytes(&hdr));
    tqkv__call_send(c, bb);
}

/* Sends a decoded block; the slices take the slot's tensors. */
static void
get_send_bf16(tqkv__call_t *c, size_t idx, get_slot_t *sl)
{
    uint8_t pre[128], mid[16];
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(c->h, idx, &layer, &hash);
    size_t n = get_prefix(pre, hash, layer, 1, &sl->hdr, sl->tier);
    grpc_slice s[4];
    size_t ns = 0;
    if (sl->hdr.tensor[0].bits_x2) {
        pre[n++] = TQKV_GET_TAG_KEY;
        n += tqkv_varint_put(pre + n, sl->tensor_bytes);
        s[ns++] = grpc_slice_from_copied_buffer((const char *)pre, n);
        s[ns++] = grpc_slice_new(sl->k, sl->tensor_bytes, free);
    } else {
        s[ns++] = grpc_slice_from_copied_buffer((const char *)pre, n);
        free(sl->k);
    }
    if (sl->hdr.tensor[1].bits_x2) {
        size_t m = 0;
        mid[m++] = TQKV_GET_TAG_VALUE;
        m += tqkv_varint_put(mid + m, sl->tensor_bytes);
        s[ns++] = grpc_slice_from_copied_buffer((const char *)mid, m);
        s[ns++] = grpc_slice_new(sl->v, sl->tensor_bytes, free);
    } else {
        free(sl->v);
    }
    sl->k = sl->v = NULL;
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, ns);
    for (size_t q = 0; q < ns; q++)
        grpc_slice_unref(s[q]);
    uint64_t out = page_bf16_bytes(&sl->hdr);
    tqkv_metrics_add_bytes(c->srv->metrics, 0, out, out);
    tqkv__call_send(c, bb);
}

static void
get_done(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    const char *ns = h->req->namespace_;
    tqkv_metrics_ns_access(c->srv->metrics, ns, strlen(ns), h->hits, h->misses);
    tqkv__call_finish(c, GRPC_STATUS_OK, NULL, NULL);
}

/* The message of a block whose response would exceed --max-message-bytes (gRPC would
 * fail the call anyway, with a message naming neither the block nor a remedy). */
static void
too_big_msg(const get_state_t *h, size_t idx, uint64_t bytes, uint64_t limit, char *msg, size_t len)
{
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(h, idx, &layer, &hash);
    int bf16 = h->req->encoding == TQKV__V1__ENCODING__ENCODING_BF16;
    snprintf(msg, len,
             "layer %u, hashes[%zu]: the %s response is %llu bytes, over the server's "
             "--max-message-bytes %llu%s",
             layer, idx % h->req->n_hashes, bf16 ? "BF16" : "PACKED", (unsigned long long)bytes,
             (unsigned long long)limit,
             bf16 ? " (BF16 is larger than the stored page: ask for ENCODING_PACKED)" : "");
}

/* Finishes c with the failure st, msg saying what failed: the one place Get translates a
 * status. input: the client's request was at fault (tqkv_status_to_grpc_input), else the
 * server's work (tqkv_status_to_grpc). */
static void
get_finish_failed(tqkv__call_t *c, tqkv_status_t st, int input, const char *msg)
{
    tqkv__call_finish(c, input ? tqkv_status_to_grpc_input(st) : tqkv_status_to_grpc(st), msg,
                      NULL);
}

static void
get_fail(tqkv__call_t *c, size_t idx, tqkv_status_t st)
{
    char msg[TQKV__KV_ERRLEN];
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(c->h, idx, &layer, &hash);
    snprintf(msg, sizeof msg, "layer %u, hashes[%zu]: %s", layer,
             idx % ((get_state_t *)c->h)->req->n_hashes, tqkv_strerror(st));
    get_finish_failed(c, st, 0, msg);
}

/* Encoder-pool job: pins the disk-only blocks from h->disk_from on (the thread may wait
 * for the disk; the call's own thread does not). */
static void
get_disk_job(void *arg)
{
    tqkv__call_t *c = arg;
    get_state_t *h = c->h;
    const Tqkv__V1__GetRequest *q = h->req;
    tqkv_store_pins_t *pins = NULL;
    const uint8_t **hp = malloc(q->n_hashes * sizeof(*hp));
    size_t *hl = malloc(q->n_hashes * sizeof(*hl));
    if (hp != NULL && hl != NULL) {
        for (size_t i = 0; i < q->n_hashes; i++) {
            hp[i] = q->hashes[i].data;
            hl[i] = q->hashes[i].len;
        }
        (void)tqkv_store_pin_disk(c->srv->store, q->namespace_, strlen(q->namespace_), hp, hl,
                                  q->n_hashes, q->layer_begin, q->layer_end, h->disk_from,
                                  &pins); /* failed: block disk_from is read in place */
    }
    free(hp);
    free(hl);
    pthread_mutex_lock(&h->mu);
    tqkv_store_pins_free(h->pins);
    h->pins = pins;
    h->disk_wait = 0;
    pthread_mutex_unlock(&h->mu);
    tqkv__call_wake(c);
}

/* Starts the disk job for blocks idx.. (counted in jobs). 0 when it runs; -1 when it
 * could not start (the block is then read in place). */
static int
get_disk_start(tqkv__call_t *c, size_t idx, int packed)
{
    get_state_t *h = c->h;
    h->disk_from = idx;
    h->disk_wait = 1;
    tqkv_status_t st =
        packed ? tqkv__call_work(c, get_disk_job) : tqkv__call_submit(c, get_disk_job, c);
    if (st != TQKV_OK) {
        h->disk_wait = 0;
        return -1;
    }
    h->jobs++;
    return 0;
}

/* PACKED: look up and send block h->i (no read-ahead needed: no codec work). */
static void
packed_next(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    tqkv_page_ref_t *ref = NULL;
    if (c->closed) { /* cancelled or deadline passed */
        tqkv__call_abort(c);
        return;
    }
    if (h->i >= h->total) {
        get_done(c);
        return;
    }
    tqkv_status_t st = lookup_block(c, h->i, &ref);
    if (st == TQKV_EBUSY && get_disk_start(c, h->i, 1) == 0)
        return; /* get_wake goes on */
    if (st == TQKV_EBUSY)
        st = lookup_block(c, h->i, &ref); /* disk_from is h->i now: read in place */
    if (st == TQKV_ENOTFOUND) {
        get_send_missing(c, h->i);
    } else if (st != TQKV_OK) {
        get_fail(c, h->i, st);
    } else {
        tqkv_page_header_t hdr;
        uint32_t layer;
        const ProtobufCBinaryData *hash;
        uint64_t limit = c->srv->limits.max_message_bytes;
        memcpy(&hdr, tqkv_page_ref_data(ref), sizeof hdr);
        block_of(h, h->i, &layer, &hash);
        uint64_t bytes = get_response_bytes(hash, layer, &hdr, (int)tqkv_page_ref_tier(ref), 0,
                                            tqkv_page_ref_len(ref));
        if (bytes > limit) {
            char msg[TQKV__KV_ERRLEN];
            tqkv_page_ref_release(ref);
            too_big_msg(h, h->i, bytes, limit, msg, sizeof msg);
            get_finish_failed(c, TQKV_ENOSPC, 0, msg); /* RESOURCE_EXHAUSTED */
            return;
        }
        get_send_packed(c, h->i, ref);
    }
}

/* Encoder-pool job: decode one pinned page into BF16 K and V. */
static void
get_decode_job(void *arg)
{
    get_slot_t *sl = arg;
    tqkv__call_t *c = sl->call;
    get_state_t *h = c->h;
    const void *page = tqkv_page_ref_data(sl->ref);
    size_t plen = tqkv_page_ref_len(sl->ref);
    tqkv_status_t st;
    memcpy(&sl->hdr, page, sizeof sl->hdr);
    sl->tier = (int)tqkv_page_ref_tier(sl->ref);
    size_t n = (size_t)sl->hdr.num_tokens * sl->hdr.num_kv_heads * sl->hdr.head_dim;
    sl->tensor_bytes = n * 2;
    sl->k = malloc(n * 2 + 1);
    sl->v = malloc(n * 2 + 1);
    if (sl->k == NULL || sl->v == NULL) {
        st = TQKV_ENOMEM;
    } else {
        double t0 = tqkv_clock_s();
        st = tqkv_page_decode_bf16(page, plen, sl->hdr.tensor[0].bits_x2 ? sl->k : NULL,
                                   sl->hdr.tensor[1].bits_x2 ? sl->v : NULL);
        if (st == TQKV_OK)
            tqkv_metrics_codec(c->srv->metrics, 0, page_bf16_bytes(&sl->hdr), tqkv_clock_s() - t0);
    }
    tqkv_page_ref_release(sl->ref);
    pthread_mutex_lock(&h->mu);
    sl->ref = NULL;
    sl->st = st;
    sl->found = 1;
    sl->state = SLOT_READY;
    pthread_mutex_unlock(&h->mu);
    tqkv__call_wake(c);
}

/* BF16: looks up block idx into its slot and starts its decode. 0 when block idx is on
 * disk only and a disk job started for it (the slot is left free). */
static int
bf16_issue(tqkv__call_t *c, size_t idx)
{
    get_state_t *h = c->h;
    get_slot_t *sl = &h->slots[idx % h->window];
    tqkv_page_ref_t *ref = NULL;
    tqkv_status_t st = lookup_block(c, idx, &ref);
    if (st == TQKV_EBUSY && get_disk_start(c, idx, 0) == 0)
        return 0;
    if (st == TQKV_EBUSY)
        st = lookup_block(c, idx, &ref); /* disk_from is idx now: read in place */
    memset(sl, 0, sizeof *sl);
    sl->call = c;
    if (st != TQKV_OK) {
        sl->st = st == TQKV_ENOTFOUND ? TQKV_OK : st;
        sl->found = 0;
        sl->state = SLOT_READY;
        return 1;
    }
    tqkv_page_header_t hdr;
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    memcpy(&hdr, tqkv_page_ref_data(ref), sizeof hdr);
    block_of(h, idx, &layer, &hash);
    uint64_t bytes = get_response_bytes(hash, layer, &hdr, (int)tqkv_page_ref_tier(ref), 1, 0);
    if (bytes > c->srv->limits.max_message_bytes) { /* not worth decoding */
        tqkv_page_ref_release(ref);
        sl->st = TQKV_ERANGE;
        sl->too_big = bytes;
        sl->found = 0;
        sl->state = SLOT_READY;
        return 1;
    }
    sl->ref = ref;
    sl->state = SLOT_BUSY;
    if (tqkv__call_submit(c, get_decode_job, sl) != TQKV_OK) {
        tqkv_page_ref_release(ref);
        sl->ref = NULL;
        sl->st = TQKV_EUNAVAILABLE;
        sl->state = SLOT_READY;
        return 1;
    }
    h->jobs++;
    return 1;
}

/* BF16: keeps the read-ahead window full and sends the next block when ready. */
static void
bf16_pump(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    if (c->state == TQKV__CS_DONE || h->sending)
        return;
    if (c->closed || h->fail != TQKV_OK) {
        if (h->jobs > 0) {
            tqkv__call_set_state(c, TQKV__CS_WORK); /* wait for the decodes */
        } else if (c->closed) {
            tqkv__call_abort(c);
        } else {
            get_finish_failed(c, h->fail, 0, h->err);
        }
        return;
    }
    pthread_mutex_lock(&h->mu);
    int disk_wait = h->disk_wait;
    pthread_mutex_unlock(&h->mu);
    while (!disk_wait && h->j < h->total && h->j - h->i < h->window) {
        if (!bf16_issue(c, h->j))
            break; /* block j is being read from disk: issued again when the job wakes */
        h->j++;
    }
    if (h->i >= h->total) {
        get_done(c);
        return;
    }
    get_slot_t *sl = &h->slots[h->i % h->window];
    pthread_mutex_lock(&h->mu);
    slot_state_t state = h->i < h->j ? sl->state : SLOT_FREE; /* not issued: disk job */
    pthread_mutex_unlock(&h->mu);
    if (state != SLOT_READY) {
        tqkv__call_set_state(c, TQKV__CS_WORK);
        return;
    }
    if (sl->too_big) {
        h->fail = TQKV_ENOSPC; /* RESOURCE_EXHAUSTED */
        too_big_msg(h, h->i, sl->too_big, c->srv->limits.max_message_bytes, h->err,
                    TQKV__KV_ERRLEN);
        bf16_pump(c);
        return;
    }
    if (sl->st != TQKV_OK) {
        uint32_t layer;
        const ProtobufCBinaryData *hash;
        block_of(h, h->i, &layer, &hash);
        h->fail = sl->st;
        snprintf(h->err, TQKV__KV_ERRLEN, "layer %u, hashes[%zu]: %s", layer,
                 h->i % h->req->n_hashes, tqkv_strerror(sl->st));
        bf16_pump(c);
        return;
    }
    h->sending = 1;
    if (sl->found)
        get_send_bf16(c, h->i, sl);
    else
        get_send_missing(c, h->i);
    sl->state = SLOT_FREE;
    if (c->state == TQKV__CS_DONE)
        h->sending = 0;
}

int
tqkv__get_request_parse(tqkv__call_t *c, Tqkv__V1__GetRequest **req)
{
    char err[TQKV__KV_ERRLEN];
    size_t len = 0;
    uint8_t *buf = c->recv_bb ? tqkv__bb_read(c->recv_bb, &len) : NULL;
    if (buf == NULL) {
        get_finish_failed(c, TQKV_EINVAL, 1, "message: missing request");
        return -1;
    }
    tqkv_status_t st = tqkv_validate_get(buf, len, &c->srv->limits, req, err, sizeof err);
    free(buf);
    if (st != TQKV_OK) {
        get_finish_failed(c, st, 1, err);
        return -1;
    }
    st = tqkv__call_auth(c, (*req)->namespace_, TQKV_AUTH_READ, err, sizeof err);
    if (st != TQKV_OK) {
        get_finish_failed(c, st, 0, err);
        return -1;
    }
    return 0;
}

int
tqkv__get_request(tqkv__call_t *c, Tqkv__V1__GetRequest **req)
{
    if (tqkv__get_request_parse(c, req) != 0)
        return -1;
    /* Disk tier: the request's disk-only pages are read in one parallel round and promoted
     * into DRAM here, so this thread waits for about one disk read, not one per page. */
    const Tqkv__V1__GetRequest *q = *req;
    const uint8_t **hp = malloc((q->n_hashes + 1) * sizeof(*hp));
    size_t *hl = malloc((q->n_hashes + 1) * sizeof(*hl));
    if (hp != NULL && hl != NULL) {
        for (size_t i = 0; i < q->n_hashes; i++) {
            hp[i] = q->hashes[i].data;
            hl[i] = q->hashes[i].len;
        }
        tqkv_store_prefetch(c->srv->store, q->namespace_, strlen(q->namespace_), hp, hl,
                            q->n_hashes, q->layer_begin, q->layer_end);
    }
    free(hp);
    free(hl);
    return 0;
}

/* Before streaming (a Get a client sent, not a peer's ask): the pages of the hashes a peer
 * owns (forwarding, when the client did not shard itself) and of those this server owns but does
 * not hold (read-through: asked of the next-ranked peers) are copied into our store first
 * (tqkv__fwd_get_copy), then the Get streams as usual. A failure leaves them missing (reported as
 * such), never wrong. */
static void get_begin(tqkv__call_t *c);

static void
get_forward(void *arg)
{
    tqkv__call_t *c = arg;
    get_state_t *gs = c->h;
    const Tqkv__V1__GetRequest *q = gs->req;
    size_t n = q->n_hashes;
    const uint8_t **hp = malloc(n * sizeof *hp);
    size_t *hl = malloc(n * sizeof *hl);
    if (hp && hl) {
        for (size_t i = 0; i < n; i++) {
            hp[i] = q->hashes[i].data;
            hl[i] = q->hashes[i].len;
        }
        if (tqkv__fwd_get_copy(tqkv__fwd_get(c->srv), c->hop, c->authz, q->namespace_, hp, hl, n,
                               q->layer_begin, q->layer_end))
            atomic_fetch_add(&c->srv->forwarded, 1);
    }
    free(hp);
    free(hl);
    tqkv__call_wake(c);
}

/* 1 when this store lacks a layer in [0, layer_end) of one of q's hashes (or cannot
 * tell): checked on the call's thread for a client that routed the Get here itself
 * (tqkv-hop: 1), so a Get of what is here costs it no encoder job. */
static int
get_lacks(tqkv__call_t *c, const Tqkv__V1__GetRequest *q)
{
    size_t n = q->n_hashes;
    const uint8_t **hp = malloc(n * sizeof *hp);
    size_t *hl = malloc(n * sizeof *hl);
    uint8_t *tiers = malloc(n);
    uint32_t prefix = 0;
    int lacks = 1;
    if (hp && hl && tiers) {
        for (size_t i = 0; i < n; i++) {
            hp[i] = q->hashes[i].data;
            hl[i] = q->hashes[i].len;
        }
        if (tqkv_store_lookup(c->srv->store, q->namespace_, strlen(q->namespace_), hp, hl, n,
                              q->layer_end, 0, &prefix, tiers) == TQKV_OK)
            lacks = memchr(tiers, TQKV_TIER_NONE, n) != NULL;
    }
    free(hp);
    free(hl);
    free(tiers);
    return lacks;
}

static void
get_start(tqkv__call_t *c)
{
    get_state_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        get_finish_failed(c, TQKV_ENOMEM, 0, "out of memory");
        return;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->fail = TQKV_OK;
    h->disk_from = SIZE_MAX;
    c->h = h;
    if (tqkv__get_request_parse(c, &h->req) != 0)
        return;
    if (c->hop != TQKV__HOP_PEER && tqkv__fwd_get(c->srv) && h->req->n_hashes > 0 &&
        (c->hop == TQKV__HOP_NONE || get_lacks(c, h->req))) {
        /* blocks a peer owns (no tqkv-hop), and ours we lack: copied first, on the encoder
         * pool */
        h->prefetch = 1;
        if (tqkv__call_work(c, get_forward) == TQKV_OK)
            return;
        h->prefetch = 0;
    }
    get_begin(c);
}

/* Streams the request's pages, from the store. */
static void
get_begin(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    h->total = (size_t)(h->req->layer_end - h->req->layer_begin) * h->req->n_hashes;
    unsigned w = c->srv->cfg.encoder_threads + 1;
    h->window = w > GET_WINDOW_MAX ? GET_WINDOW_MAX : w;
    if (h->req->encoding == TQKV__V1__ENCODING__ENCODING_BF16)
        bf16_pump(c);
    else
        packed_next(c);
}

static void
get_sent(tqkv__call_t *c, int ok)
{
    get_state_t *h = c->h;
    h->i++;
    if (h->req->encoding == TQKV__V1__ENCODING__ENCODING_BF16) {
        h->sending = 0;
        bf16_pump(c);
    } else {
        packed_next(c);
    }
}

static void
get_wake(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    if (h->prefetch) { /* the owners' pages are in the store now */
        h->prefetch = 0;
        if (c->closed)
            tqkv__call_abort(c);
        else
            get_begin(c);
        return;
    }
    h->jobs--;
    if (c->state == TQKV__CS_STATUS)
        return; /* every block was sent already: nothing left to pump */
    if (h->req->encoding == TQKV__V1__ENCODING__ENCODING_BF16)
        bf16_pump(c);
    else if (c->state == TQKV__CS_WORK) /* the disk job of packed_next */
        packed_next(c);
}

static void
get_free(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    if (h == NULL)
        return;
    for (unsigned q = 0; q < GET_WINDOW_MAX; q++) {
        if (h->slots[q].ref)
            tqkv_page_ref_release(h->slots[q].ref);
        free(h->slots[q].k);
        free(h->slots[q].v);
    }
    tqkv_store_pins_free(h->pins);
    if (h->req)
        tqkv__v1__get_request__free_unpacked(h->req, NULL);
    pthread_mutex_destroy(&h->mu);
    free(h);
    c->h = NULL;
}

const tqkv__handler_t tqkv__get_handler = {
    .path = "/tqkv.v1.KVCache/Get",
    .metric = "Get",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = get_start,
    .on_send = get_sent,
    .on_wake = get_wake,
    .on_free = get_free,
};
