/* handlers_kv.c - the tqkv.v1.KVCache methods: Put (client streaming, codec work on
 * the encoder pool), Get (server streaming, zero-copy page sends, BF16 decode on the
 * encoder pool), Lookup, Delete, Stats (unary, on the gRPC worker: store calls only).
 *
 * Put semantics on a bad message: the call fails with that message's status and the
 * PutResponse is not sent; the blocks of earlier messages of the same stream stay
 * stored (each message is an independent, idempotent block write), and so may blocks
 * of later messages that were already being encoded in parallel. Nothing already
 * stored is touched by a bad request. A client that needs to know exactly what went
 * in re-sends the stream (duplicates are no-ops) or asks Lookup.
 */
#include <grpc/slice.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "kernels/policy.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "transport/wire.h"

#define ERRLEN 320

/* ---- protobuf hand-encoding of GetResponse prefixes ---- */

static size_t
put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* Fields 1 (hash), 2 (layer), 3 (found), 7-9 (shape), 10 (tier) of a GetResponse
 * (tags from transport/wire.h). */
static size_t
get_prefix(uint8_t *p, const ProtobufCBinaryData *hash, uint32_t layer, int found,
           const tqkv_page_header_t *hdr, int tier)
{
    size_t n = 0;
    p[n++] = TQKV_GET_TAG_HASH;
    n += put_varint(p + n, hash->len);
    memcpy(p + n, hash->data, hash->len);
    n += hash->len;
    p[n++] = TQKV_GET_TAG_LAYER;
    n += put_varint(p + n, layer);
    if (found) {
        p[n++] = TQKV_GET_TAG_FOUND;
        p[n++] = 1;
        p[n++] = TQKV_GET_TAG_NUM_TOKENS;
        n += put_varint(p + n, hdr->num_tokens);
        p[n++] = TQKV_GET_TAG_NUM_KV_HEADS;
        n += put_varint(p + n, hdr->num_kv_heads);
        p[n++] = TQKV_GET_TAG_HEAD_DIM;
        n += put_varint(p + n, hdr->head_dim);
        p[n++] = TQKV_GET_TAG_TIER;
        n += put_varint(p + n, (uint64_t)tier);
    }
    return n;
}

static size_t
varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
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
        return n + 1 + varint_len(plen) + plen;
    uint64_t tb = (uint64_t)hdr->num_tokens * hdr->num_kv_heads * hdr->head_dim * 2;
    for (int t = 0; t < 2; t++)
        if (hdr->tensor[t].bits_x2)
            n += 1 + varint_len(tb) + tb;
    return n;
}

/* ---- Put ----
 *
 * Messages of one stream are encoded in parallel: up to `window` jobs run on the
 * encoder pool while the next RECV_MESSAGE is in flight. Each job reserved one
 * TAG_WAKE and, when done, pushes itself on the call's done list and fires it. The
 * first failing message (in completion order) fails the call: no more messages are
 * read, the jobs in flight finish, then the status goes out. Blocks of messages
 * that succeeded stay stored, including ones sent after the bad message that were
 * already being encoded.
 */

typedef struct put_job {
    struct put_job *next;
    tqkv__call_t *call;
    grpc_byte_buffer *bb; /* the message (owned by the job) */
    grpc_status_code code;
    char err[ERRLEN];
    int duplicate;
    uint64_t bytes_in, bytes_stored;
    int sync_job;           /* the stream's closing disk sync, not a message */
    tqkv_store_sync_t sync; /* --disk-sync always: the disk records to wait for */
} put_job_t;

typedef struct put_state {
    pthread_mutex_t mu; /* protects done (pushed by encoder threads) */
    put_job_t *done;
    unsigned window;       /* jobs allowed in flight */
    unsigned jobs;         /* jobs in flight (worker thread only) */
    int recv_active;       /* a RECV_MESSAGE is in flight */
    int eof;               /* the client half-closed */
    grpc_status_code code; /* first failure */
    char err[ERRLEN];
    uint64_t stored, dups, total_in, total_stored;
    tqkv_store_sync_t sync; /* the stored blocks' disk records, synced once before the reply */
    int sync_started;
} put_state_t;

/* Encoder-pool job: decode, validate, authorize, encode and store one message. */
static void
put_job(void *arg)
{
    put_job_t *j = arg;
    tqkv__call_t *c = j->call;
    tqkv_server_t *s = c->srv;
    put_state_t *h = c->h;
    Tqkv__V1__PutRequest *m = NULL;
    uint8_t *page = NULL;
    size_t len = 0;
    tqkv_status_t st;

    j->code = GRPC_STATUS_OK;
    uint8_t *buf = tqkv__bb_read(j->bb, &len);
    grpc_byte_buffer_destroy(j->bb);
    j->bb = NULL;
    if (buf == NULL) {
        j->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(j->err, ERRLEN, "out of memory reading the message");
        goto done;
    }
    st = tqkv_validate_put(buf, len, &s->limits, &m, j->err, ERRLEN);
    free(buf);
    if (st != TQKV_OK) {
        j->code = tqkv_status_to_grpc_input(st);
        goto done;
    }
    st = tqkv__call_auth(c, m->namespace_, TQKV_AUTH_WRITE, j->err, ERRLEN);
    if (st != TQKV_OK) {
        j->code = tqkv_status_to_grpc(st);
        goto done;
    }
    tqkv_block_key_t key = {m->namespace_, strlen(m->namespace_), m->hash.data, m->hash.len,
                            m->layer};
    const void *data;
    size_t plen;
    uint64_t bf16_bytes;
    if (m->page.len) {
        tqkv_page_info_t info;
        st = tqkv_page_validate(m->page.data, m->page.len, 0, &info, NULL, 0);
        if (st != TQKV_OK) {
            j->code = GRPC_STATUS_INVALID_ARGUMENT;
            snprintf(j->err, ERRLEN, "page: %s", tqkv_strerror(st));
            goto done;
        }
        data = m->page.data;
        plen = m->page.len;
        bf16_bytes = info.bf16_bytes;
        j->bytes_in = m->page.len;
    } else {
        tqkv_block_codec_t codec;
        tqkv_block_shape_t shape = {m->num_tokens, m->num_kv_heads, m->head_dim};
        /* The namespace's policy (--namespace-policy), then the request's overrides. */
        tqkv_policy_t pol = *tqkv_config_ns_policy(&s->cfg, m->namespace_, key.ns_len);
        tqkv_codec_override(m->codec, &pol);
        tqkv_policy_block_codec(&pol, m->layer, m->num_layers, &codec);
        size_t cap;
        j->err[0] = '\0';
        st = tqkv_page_check_params(&shape, &codec, j->err, ERRLEN);
        if (st == TQKV_OK)
            st = tqkv_page_size(&shape, &codec, &cap);
        if (st != TQKV_OK) {
            j->code = tqkv_status_to_grpc_input(st);
            if (j->err[0] == '\0')
                snprintf(j->err, ERRLEN, "codec: %s", tqkv_strerror(st));
            goto done;
        }
        page = malloc(cap);
        if (page == NULL) {
            j->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(j->err, ERRLEN, "out of memory encoding a %zu-byte page", cap);
            goto done;
        }
        double t0 = tqkv__now();
        st = TQKV_EUNSUPPORTED;
        if (s->gpu_encode_device >= 0 && codec.k.mode != TQKV_MODE_RAW &&
            codec.v.mode != TQKV_MODE_RAW) { /* a lossless page is a copy: CPU */
            /* Any GPU failure falls back to the CPU encoder, which also words the
             * error for bad input (the device only flags NaN/Inf). */
            char gerr[ERRLEN];
            st = tqkv__gpu_encode(s->gpu_encode_device, &shape, &codec,
                                  (const uint16_t *)m->key.data, (const uint16_t *)m->value.data,
                                  page, cap, &plen, gerr, sizeof gerr);
            if (st != TQKV_OK && st != TQKV_ERANGE && !atomic_exchange(&s->gpu_encode_warned, 1))
                tqkv_log(TQKV_LOG_WARN, "GPU encode failed, encoding on the CPU", "why=\"%s\"",
                         gerr);
        }
        if (st != TQKV_OK)
            st =
                tqkv_page_encode(&shape, &codec, (const uint16_t *)m->key.data,
                                 (const uint16_t *)m->value.data, page, cap, &plen, j->err, ERRLEN);
        if (st != TQKV_OK) {
            j->code = tqkv_status_to_grpc_input(st);
            goto done;
        }
        bf16_bytes = m->key.len + m->value.len;
        tqkv_metrics_codec(s->metrics, 1, bf16_bytes, tqkv__now() - t0);
        data = page;
        j->bytes_in = bf16_bytes;
    }
    tqkv__fwd_t *fw = c->hop ? NULL : tqkv__fwd_get(s);
    tqkv__fwd_rank_t rk;
    if (fw && tqkv__fwd_rank(fw, &rk) == TQKV_OK) {
        int owned = tqkv__fwd_owned(&rk, m->namespace_, m->hash.data, m->hash.len);
        tqkv__fwd_rank_free(&rk);
        if (!owned) { /* one hop to the owner, as the page encoded here */
            tqkv_block_shape_t shape = {m->num_tokens, m->num_kv_heads, m->head_dim};
            st = tqkv__fwd_put(fw, c->authz, m->namespace_, m->hash.data, m->hash.len,
                               m->parent_hash.len ? m->parent_hash.data : NULL, m->parent_hash.len,
                               m->layer, &shape, data, plen, &j->duplicate, j->err, ERRLEN);
            if (st != TQKV_OK) {
                j->code = tqkv_status_to_grpc(st);
                goto done;
            }
            atomic_fetch_add(&s->forwarded, 1);
            if (!j->duplicate)
                j->bytes_stored = plen;
            goto done;
        }
    }
    st = tqkv_store_put_nosync(s->store, &key, m->parent_hash.len ? m->parent_hash.data : NULL,
                               m->parent_hash.len, data, plen, bf16_bytes, &j->duplicate, &j->sync);
    if (st != TQKV_OK) {
        const tqkv_store_config_t *sc = &s->cfg.store;
        j->code = tqkv_status_to_grpc(st);
        if (st == TQKV_ENOSPC && sc->default_ns_quota != 0 && plen > sc->default_ns_quota)
            snprintf(j->err, ERRLEN,
                     "store: a %zu-byte page cannot fit in namespace '%s': its quota is %llu "
                     "bytes (--ns-quota)",
                     plen, m->namespace_, (unsigned long long)sc->default_ns_quota);
        else if (st == TQKV_ENOSPC && plen > sc->dram_capacity && plen > sc->hbm_capacity)
            snprintf(j->err, ERRLEN,
                     "store: a %zu-byte page is larger than every tier (--dram-capacity %llu, "
                     "--hbm-capacity %llu)",
                     plen, (unsigned long long)sc->dram_capacity,
                     (unsigned long long)sc->hbm_capacity);
        else if (st == TQKV_ENOSPC)
            snprintf(j->err, ERRLEN,
                     "store full: no room for a %zu-byte page in namespace '%s' and nothing "
                     "may be evicted (every candidate is leased by a Lookup, read, or the "
                     "parent of a kept block; shorter lease_ms or more capacity helps)",
                     plen, m->namespace_);
        else
            snprintf(j->err, ERRLEN, "store: %s", tqkv_strerror(st));
        goto done;
    }
    if (!j->duplicate)
        j->bytes_stored = plen;
done:
    free(page);
    if (m)
        tqkv__v1__put_request__free_unpacked(m, NULL);
    pthread_mutex_lock(&h->mu);
    j->next = h->done;
    h->done = j;
    pthread_mutex_unlock(&h->mu);
    tqkv__call_wake(c);
}

/* Encoder-pool job: with --disk-sync always, makes the stream's disk records durable
 * (one group-committed fdatasync for all its blocks) before the PutResponse goes out. */
static void
put_sync_job(void *arg)
{
    put_job_t *j = arg;
    tqkv__call_t *c = j->call;
    put_state_t *h = c->h;
    tqkv_status_t st = tqkv_store_sync(c->srv->store, &j->sync);
    j->code = GRPC_STATUS_OK;
    if (st != TQKV_OK) {
        j->code = tqkv_status_to_grpc(st);
        snprintf(j->err, ERRLEN,
                 "disk tier (--disk-sync always): the stream's pages could not be made durable: %s",
                 tqkv_strerror(st));
    }
    pthread_mutex_lock(&h->mu);
    j->next = h->done;
    h->done = j;
    pthread_mutex_unlock(&h->mu);
    tqkv__call_wake(c);
}

static void
put_finish(tqkv__call_t *c)
{
    put_state_t *h = c->h;
    if (c->closed) {
        tqkv__call_abort(c);
        return;
    }
    if (h->code != GRPC_STATUS_OK) {
        tqkv__call_finish(c, h->code, h->err, NULL);
        return;
    }
    Tqkv__V1__PutResponse r = TQKV__V1__PUT_RESPONSE__INIT;
    r.blocks_stored = h->stored;
    r.blocks_duplicate = h->dups;
    r.bytes_in = h->total_in;
    r.bytes_stored = h->total_stored;
    tqkv__call_finish_msg(c, &r.base);
}

/* Decides what a Put does next once an event has been absorbed. */
static void
put_step(tqkv__call_t *c)
{
    put_state_t *h = c->h;
    if (c->state == TQKV__CS_DONE || h->recv_active)
        return;
    int stop = h->eof || h->code != GRPC_STATUS_OK || c->closed;
    if (stop && h->jobs == 0 && h->code == GRPC_STATUS_OK && !c->closed && h->sync.hi != 0 &&
        !h->sync_started) {
        /* Every block is in; one disk sync for all of them, then the reply. */
        put_job_t *j = calloc(1, sizeof *j);
        h->sync_started = 1;
        if (j == NULL) {
            h->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(h->err, ERRLEN, "out of memory");
        } else {
            j->call = c;
            j->sync_job = 1;
            j->sync = h->sync;
            if (tqkv__call_submit(c, put_sync_job, j) != TQKV_OK) {
                free(j);
                h->code = GRPC_STATUS_UNAVAILABLE;
                snprintf(h->err, ERRLEN, "server is stopping");
            } else {
                h->jobs++;
            }
        }
    }
    if (stop) {
        if (h->jobs == 0)
            put_finish(c);
        else
            tqkv__call_set_state(c, TQKV__CS_WORK);
        return;
    }
    if (h->jobs < h->window) {
        h->recv_active = 1;
        tqkv__call_recv(c);
        if (c->state == TQKV__CS_DONE)
            h->recv_active = 0;
        return;
    }
    tqkv__call_set_state(c, TQKV__CS_WORK);
}

static void
put_start(tqkv__call_t *c)
{
    put_state_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->window = c->srv->cfg.encoder_threads < 8 ? c->srv->cfg.encoder_threads : 8;
    if (h->window == 0)
        h->window = 1;
    h->code = GRPC_STATUS_OK;
    c->h = h;
    put_step(c);
}

static void
put_recv(tqkv__call_t *c, int ok)
{
    put_state_t *h = c->h;
    h->recv_active = 0;
    if (c->recv_bb == NULL) { /* client half-closed */
        h->eof = 1;
        put_step(c);
        return;
    }
    if (h->code != GRPC_STATUS_OK) { /* failing already: drop */
        put_step(c);
        return;
    }
    put_job_t *j = calloc(1, sizeof *j);
    if (j == NULL) {
        h->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(h->err, ERRLEN, "out of memory");
        put_step(c);
        return;
    }
    j->call = c;
    j->bb = c->recv_bb;
    c->recv_bb = NULL;
    if (tqkv__call_submit(c, put_job, j) != TQKV_OK) {
        grpc_byte_buffer_destroy(j->bb);
        free(j);
        h->code = GRPC_STATUS_UNAVAILABLE;
        snprintf(h->err, ERRLEN, "server is stopping");
    } else {
        h->jobs++;
    }
    put_step(c);
}

static void
put_wake(tqkv__call_t *c)
{
    put_state_t *h = c->h;
    pthread_mutex_lock(&h->mu);
    put_job_t *j = h->done;
    if (j)
        h->done = j->next;
    pthread_mutex_unlock(&h->mu);
    if (j == NULL) {
        tqkv_log(TQKV_LOG_ERROR, "put: wake without a finished job", NULL);
        abort();
    }
    h->jobs--;
    if (j->code != GRPC_STATUS_OK) {
        if (h->code == GRPC_STATUS_OK) {
            h->code = j->code;
            memcpy(h->err, j->err, ERRLEN);
        }
    } else if (!j->sync_job) {
        if (j->sync.hi != 0) {
            if (h->sync.hi == 0 || j->sync.lo < h->sync.lo)
                h->sync.lo = j->sync.lo;
            if (j->sync.hi > h->sync.hi)
                h->sync.hi = j->sync.hi;
        }
        if (j->duplicate)
            h->dups++;
        else
            h->stored++;
        h->total_in += j->bytes_in;
        h->total_stored += j->bytes_stored;
        tqkv_metrics_add_bytes(c->srv->metrics, j->bytes_in, 0, 0);
    }
    free(j);
    put_step(c);
}

static void
put_free(tqkv__call_t *c)
{
    put_state_t *h = c->h;
    if (h == NULL)
        return;
    while (h->done) { /* cannot happen: every job's wake came back first */
        put_job_t *j = h->done;
        h->done = j->next;
        free(j);
    }
    pthread_mutex_destroy(&h->mu);
    free(h);
    c->h = NULL;
}

const tqkv__handler_t tqkv__put_handler = {
    .path = "/tqkv.v1.KVCache/Put",
    .metric = "Put",
    .payload_on_new = 0,
    .drain = 1,
    .on_start = put_start,
    .on_recv = put_recv,
    .on_wake = put_wake,
    .on_free = put_free,
};

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
    grpc_status_code fail;
    char err[ERRLEN];
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

static tqkv_status_t
lookup_block(tqkv__call_t *c, size_t idx, tqkv_page_ref_t **ref)
{
    get_state_t *h = c->h;
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(h, idx, &layer, &hash);
    tqkv_block_key_t key = {h->req->namespace_, strlen(h->req->namespace_), hash->data, hash->len,
                            layer};
    tqkv_status_t st = tqkv_store_get(c->srv->store, &key, ref);
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
    n += put_varint(pre + n, plen);
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
        n += put_varint(pre + n, sl->tensor_bytes);
        s[ns++] = grpc_slice_from_copied_buffer((const char *)pre, n);
        s[ns++] = grpc_slice_new(sl->k, sl->tensor_bytes, free);
    } else {
        s[ns++] = grpc_slice_from_copied_buffer((const char *)pre, n);
        free(sl->k);
    }
    if (sl->hdr.tensor[1].bits_x2) {
        size_t m = 0;
        mid[m++] = TQKV_GET_TAG_VALUE;
        m += put_varint(mid + m, sl->tensor_bytes);
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

static void
get_fail(tqkv__call_t *c, size_t idx, tqkv_status_t st)
{
    char msg[ERRLEN];
    uint32_t layer;
    const ProtobufCBinaryData *hash;
    block_of(c->h, idx, &layer, &hash);
    snprintf(msg, sizeof msg, "layer %u, hashes[%zu]: %s", layer,
             idx % ((get_state_t *)c->h)->req->n_hashes, tqkv_strerror(st));
    tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
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
            char msg[ERRLEN];
            tqkv_page_ref_release(ref);
            too_big_msg(h, h->i, bytes, limit, msg, sizeof msg);
            tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
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
        double t0 = tqkv__now();
        st = tqkv_page_decode_bf16(page, plen, sl->hdr.tensor[0].bits_x2 ? sl->k : NULL,
                                   sl->hdr.tensor[1].bits_x2 ? sl->v : NULL);
        if (st == TQKV_OK)
            tqkv_metrics_codec(c->srv->metrics, 0, page_bf16_bytes(&sl->hdr), tqkv__now() - t0);
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

/* BF16: looks up block idx into its slot and starts its decode. */
static void
bf16_issue(tqkv__call_t *c, size_t idx)
{
    get_state_t *h = c->h;
    get_slot_t *sl = &h->slots[idx % h->window];
    tqkv_page_ref_t *ref = NULL;
    memset(sl, 0, sizeof *sl);
    sl->call = c;
    tqkv_status_t st = lookup_block(c, idx, &ref);
    if (st != TQKV_OK) {
        sl->st = st == TQKV_ENOTFOUND ? TQKV_OK : st;
        sl->found = 0;
        sl->state = SLOT_READY;
        return;
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
        return;
    }
    sl->ref = ref;
    sl->state = SLOT_BUSY;
    if (tqkv__call_submit(c, get_decode_job, sl) != TQKV_OK) {
        tqkv_page_ref_release(ref);
        sl->ref = NULL;
        sl->st = TQKV_EUNAVAILABLE;
        sl->state = SLOT_READY;
        return;
    }
    h->jobs++;
}

/* BF16: keeps the read-ahead window full and sends the next block when ready. */
static void
bf16_pump(tqkv__call_t *c)
{
    get_state_t *h = c->h;
    if (c->state == TQKV__CS_DONE || h->sending)
        return;
    if (c->closed || h->fail != GRPC_STATUS_OK) {
        if (h->jobs > 0) {
            tqkv__call_set_state(c, TQKV__CS_WORK); /* wait for the decodes */
        } else if (c->closed) {
            tqkv__call_abort(c);
        } else {
            tqkv__call_finish(c, h->fail, h->err, NULL);
        }
        return;
    }
    while (h->j < h->total && h->j - h->i < h->window)
        bf16_issue(c, h->j++);
    if (h->i >= h->total) {
        get_done(c);
        return;
    }
    get_slot_t *sl = &h->slots[h->i % h->window];
    pthread_mutex_lock(&h->mu);
    slot_state_t state = sl->state;
    pthread_mutex_unlock(&h->mu);
    if (state != SLOT_READY) {
        tqkv__call_set_state(c, TQKV__CS_WORK);
        return;
    }
    if (sl->too_big) {
        h->fail = GRPC_STATUS_RESOURCE_EXHAUSTED;
        too_big_msg(h, h->i, sl->too_big, c->srv->limits.max_message_bytes, h->err, ERRLEN);
        bf16_pump(c);
        return;
    }
    if (sl->st != TQKV_OK) {
        uint32_t layer;
        const ProtobufCBinaryData *hash;
        block_of(h, h->i, &layer, &hash);
        h->fail = tqkv_status_to_grpc(sl->st);
        snprintf(h->err, ERRLEN, "layer %u, hashes[%zu]: %s", layer, h->i % h->req->n_hashes,
                 tqkv_strerror(sl->st));
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
tqkv__get_request(tqkv__call_t *c, Tqkv__V1__GetRequest **req)
{
    char err[ERRLEN];
    size_t len = 0;
    uint8_t *buf = c->recv_bb ? tqkv__bb_read(c->recv_bb, &len) : NULL;
    if (buf == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT, "message: missing request", NULL);
        return -1;
    }
    tqkv_status_t st = tqkv_validate_get(buf, len, &c->srv->limits, req, err, sizeof err);
    free(buf);
    if (st != TQKV_OK) {
        tqkv__call_finish(c, tqkv_status_to_grpc_input(st), err, NULL);
        return -1;
    }
    st = tqkv__call_auth(c, (*req)->namespace_, TQKV_AUTH_READ, err, sizeof err);
    if (st != TQKV_OK) {
        tqkv__call_finish(c, tqkv_status_to_grpc(st), err, NULL);
        return -1;
    }
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

/* The hashes a peer owns: its pages copied into our store first (one hop), then the Get
 * streams as usual. A failure leaves them missing (reported as such), never wrong. */
static void get_begin(tqkv__call_t *c);

static void
get_forward(void *arg)
{
    tqkv__call_t *c = arg;
    get_state_t *gs = c->h;
    const Tqkv__V1__GetRequest *q = gs->req;
    tqkv__fwd_t *fw = tqkv__fwd_get(c->srv);
    tqkv__fwd_rank_t rk;
    size_t n = q->n_hashes;
    if (fw == NULL || n == 0 || tqkv__fwd_rank(fw, &rk) != TQKV_OK) {
        tqkv__call_wake(c);
        return;
    }
    uint8_t *want = calloc(n, 1);
    const uint8_t **hp = malloc(n * sizeof *hp);
    size_t *hl = malloc(n * sizeof *hl), nw = 0;
    for (size_t i = 0; want && hp && hl && i < n; i++) {
        hp[i] = q->hashes[i].data;
        hl[i] = q->hashes[i].len;
        nw += want[i] = !tqkv__fwd_owned(&rk, q->namespace_, hp[i], hl[i]);
    }
    tqkv__fwd_rank_free(&rk);
    if (want && hp && hl && nw > 0) {
        uint64_t copied = 0;
        char err[ERRLEN];
        if (tqkv__fwd_fill(fw, c->authz, q->namespace_, hp, hl, want, n, q->layer_begin,
                           q->layer_end, &copied, err, sizeof err) != TQKV_OK) {
            char qe[ERRLEN];
            tqkv_log_quote(qe, sizeof qe, err);
            tqkv_log(TQKV_LOG_WARN, "get: forward failed", "error=\"%s\"", qe);
        }
        atomic_fetch_add(&c->srv->forwarded, 1);
    }
    free(want);
    free(hp);
    free(hl);
    tqkv__call_wake(c);
}

static void
get_start(tqkv__call_t *c)
{
    get_state_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->fail = GRPC_STATUS_OK;
    c->h = h;
    if (tqkv__get_request(c, &h->req) != 0)
        return;
    if (!c->hop && tqkv__fwd_get(c->srv) && h->req->n_hashes > 0) {
        /* blocks a peer owns: copied from it first, on the encoder pool (get_forward) */
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
    bf16_pump(c);
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

/* ---- unary methods ---- */

/* Reads and validates the unary request; on failure finishes the call and returns
 * NULL. */
#define UNARY_DECODE(c, type, fn, out)                                                             \
    do {                                                                                           \
        char err_[ERRLEN];                                                                         \
        size_t len_ = 0;                                                                           \
        uint8_t *buf_ = (c)->recv_bb ? tqkv__bb_read((c)->recv_bb, &len_) : NULL;                  \
        if (buf_ == NULL) {                                                                        \
            tqkv__call_finish((c), GRPC_STATUS_INVALID_ARGUMENT, "message: missing request",       \
                              NULL);                                                               \
            return;                                                                                \
        }                                                                                          \
        tqkv_status_t st_ = fn(buf_, len_, &(c)->srv->limits, &(out), err_, sizeof err_);          \
        free(buf_);                                                                                \
        if (st_ != TQKV_OK) {                                                                      \
            tqkv__call_finish((c), tqkv_status_to_grpc_input(st_), err_, NULL);                    \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static int
auth_or_finish(tqkv__call_t *c, const char *ns, unsigned perm)
{
    char err[ERRLEN];
    tqkv_status_t st = tqkv__call_auth(c, ns, perm, err, sizeof err);
    if (st != TQKV_OK) {
        tqkv__call_finish(c, tqkv_status_to_grpc(st), err, NULL);
        return 0;
    }
    return 1;
}

static void
lookup_answer(tqkv__call_t *c, Tqkv__V1__LookupRequest *r, const uint8_t *tiers,
              Tqkv__V1__BlockInfo *infos, Tqkv__V1__BlockInfo **iptr, size_t n, uint32_t prefix)
{
    uint64_t hits = 0;
    for (size_t i = 0; i < n; i++) {
        tqkv__v1__block_info__init(&infos[i]);
        infos[i].hash = r->hashes[i];
        infos[i].tier = (Tqkv__V1__Tier)tiers[i];
        iptr[i] = &infos[i];
        hits += tiers[i] != TQKV_TIER_NONE;
    }
    tqkv_metrics_ns_access(c->srv->metrics, r->namespace_, strlen(r->namespace_), hits, n - hits);
    Tqkv__V1__LookupResponse resp = TQKV__V1__LOOKUP_RESPONSE__INIT;
    resp.prefix_blocks = prefix;
    resp.n_blocks = n;
    resp.blocks = iptr;
    tqkv__call_finish_msg(c, &resp.base);
}

/* A Lookup some of whose hashes a peer owns (forward.h): answered on the encoder pool. */
typedef struct lookup_state {
    Tqkv__V1__LookupRequest *r;
    const uint8_t **hp;
    size_t *hl;
    uint8_t *tiers;
    Tqkv__V1__BlockInfo *infos, **iptr;
    tqkv__fwd_t *fw;
    uint32_t prefix;
    grpc_status_code code;
    char err[ERRLEN];
} lookup_state_t;

static void
lookup_job(void *arg)
{
    tqkv__call_t *c = arg;
    lookup_state_t *ls = c->h;
    Tqkv__V1__LookupRequest *r = ls->r;
    size_t n = r->n_hashes;
    tqkv_status_t st =
        tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), ls->hp, ls->hl, n,
                          r->num_layers, r->lease_ms, &ls->prefix, ls->tiers);
    tqkv__fwd_rank_t rk;
    uint8_t *want = calloc(n, 1);
    if (st != TQKV_OK) {
        ls->code = tqkv_status_to_grpc(st);
        snprintf(ls->err, ERRLEN, "lookup: %s", tqkv_strerror(st));
    } else if (want && tqkv__fwd_rank(ls->fw, &rk) == TQKV_OK) {
        /* the hashes a peer owns: its answer, not ours */
        size_t nw = 0;
        for (size_t i = 0; i < n; i++)
            nw += want[i] = !tqkv__fwd_owned(&rk, r->namespace_, ls->hp[i], ls->hl[i]);
        tqkv__fwd_rank_free(&rk);
        if (nw > 0) {
            st = tqkv__fwd_lookup(ls->fw, c->authz, r->namespace_, ls->hp, ls->hl, want, n,
                                  r->num_layers, r->lease_ms, ls->tiers, ls->err, ERRLEN);
            if (st != TQKV_OK)
                ls->code = tqkv_status_to_grpc(st);
            atomic_fetch_add(&c->srv->forwarded, 1);
        }
        ls->prefix = 0;
        while (ls->prefix < n && ls->tiers[ls->prefix] != TQKV_TIER_NONE)
            ls->prefix++;
    }
    free(want);
    tqkv__call_wake(c);
}

static void
lookup_wake(tqkv__call_t *c)
{
    lookup_state_t *ls = c->h;
    if (c->closed)
        tqkv__call_abort(c);
    else if (ls->code != GRPC_STATUS_OK)
        tqkv__call_finish(c, ls->code, ls->err, NULL);
    else
        lookup_answer(c, ls->r, ls->tiers, ls->infos, ls->iptr, ls->r->n_hashes, ls->prefix);
}

static void
lookup_free(tqkv__call_t *c)
{
    lookup_state_t *ls = c->h;
    if (ls == NULL)
        return;
    free(ls->hp);
    free(ls->hl);
    free(ls->tiers);
    free(ls->infos);
    free(ls->iptr);
    tqkv__v1__lookup_request__free_unpacked(ls->r, NULL);
    free(ls);
    c->h = NULL;
}

static void
lookup_start(tqkv__call_t *c)
{
    Tqkv__V1__LookupRequest *r = NULL;
    UNARY_DECODE(c, Tqkv__V1__LookupRequest, tqkv_validate_lookup, r);
    size_t n = r->n_hashes;
    const uint8_t **hp = malloc(n * sizeof *hp);
    size_t *hl = malloc(n * sizeof *hl);
    uint8_t *tiers = malloc(n);
    Tqkv__V1__BlockInfo *infos = malloc(n * sizeof *infos);
    Tqkv__V1__BlockInfo **iptr = malloc(n * sizeof *iptr);
    if (!hp || !hl || !tiers || !infos || !iptr) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        goto out;
    }
    if (!auth_or_finish(c, r->namespace_, TQKV_AUTH_READ))
        goto out;
    /* The response echoes every hash with its tier, so it is larger than the request:
     * one that could exceed the send limit is refused before any lease is taken (gRPC
     * would fail it with a message naming neither the cause nor a remedy). */
    uint64_t bound = 6; /* prefix_blocks */
    for (size_t i = 0; i < n; i++) {
        hp[i] = r->hashes[i].data;
        hl[i] = r->hashes[i].len;
        uint64_t bi = 1 + varint_len(hl[i]) + hl[i] + 2; /* hash, tier */
        bound += 1 + varint_len(bi) + bi;
    }
    if (bound > c->srv->limits.max_message_bytes) {
        char msg[ERRLEN];
        snprintf(msg, sizeof msg,
                 "hashes: the response to %zu hashes can reach %llu bytes, over the server's "
                 "--max-message-bytes %llu (send fewer hashes per Lookup)",
                 n, (unsigned long long)bound,
                 (unsigned long long)c->srv->limits.max_message_bytes);
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
        goto out;
    }
    tqkv__fwd_t *fw = c->hop ? NULL : tqkv__fwd_get(c->srv);
    if (fw && n > 0) { /* the answer needs the owners: ask them on the encoder pool */
        lookup_state_t *ls = calloc(1, sizeof *ls);
        if (ls == NULL) {
            tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
            goto out;
        }
        *ls = (lookup_state_t){.r = r,
                               .hp = hp,
                               .hl = hl,
                               .tiers = tiers,
                               .infos = infos,
                               .iptr = iptr,
                               .fw = fw,
                               .code = GRPC_STATUS_OK};
        c->h = ls;
        if (tqkv__call_work(c, lookup_job) != TQKV_OK) {
            c->h = NULL;
            free(ls);
            tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "lookup: no encoder thread", NULL);
            goto out;
        }
        return; /* ls owns r and the arrays (lookup_free) */
    }
    uint32_t prefix = 0;
    tqkv_status_t st = tqkv_store_lookup(c->srv->store, r->namespace_, strlen(r->namespace_), hp,
                                         hl, n, r->num_layers, r->lease_ms, &prefix, tiers);
    if (st != TQKV_OK) {
        char msg[ERRLEN];
        snprintf(msg, sizeof msg, "lookup: %s", tqkv_strerror(st));
        tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
        goto out;
    }
    lookup_answer(c, r, tiers, infos, iptr, n, prefix);
out:
    free(hp);
    free(hl);
    free(tiers);
    free(infos);
    free(iptr);
    tqkv__v1__lookup_request__free_unpacked(r, NULL);
}

static void
delete_start(tqkv__call_t *c)
{
    Tqkv__V1__DeleteRequest *r = NULL;
    char msg[ERRLEN];
    UNARY_DECODE(c, Tqkv__V1__DeleteRequest, tqkv_validate_delete, r);
    if (!auth_or_finish(c, r->namespace_, TQKV_AUTH_WRITE))
        goto out;
    uint64_t pages = 0, bytes = 0;
    size_t nsl = strlen(r->namespace_);
    if (r->all) {
        tqkv_status_t st =
            tqkv_store_delete_namespace(c->srv->store, r->namespace_, nsl, &pages, &bytes);
        if (st == TQKV_ENOTFOUND) {
            snprintf(msg, sizeof msg, "namespace: '%s' holds no blocks", r->namespace_);
            tqkv__call_finish(c, GRPC_STATUS_NOT_FOUND, msg, NULL);
            goto out;
        }
        if (st != TQKV_OK) {
            snprintf(msg, sizeof msg, "delete: %s", tqkv_strerror(st));
            tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
            goto out;
        }
    } else {
        for (size_t i = 0; i < r->n_hashes; i++) {
            uint64_t p = 0, b = 0;
            tqkv_status_t st = tqkv_store_delete(c->srv->store, r->namespace_, nsl,
                                                 r->hashes[i].data, r->hashes[i].len, &p, &b);
            if (st != TQKV_OK && st != TQKV_ENOTFOUND) {
                snprintf(msg, sizeof msg, "hashes[%zu]: %s", i, tqkv_strerror(st));
                tqkv__call_finish(c, tqkv_status_to_grpc(st), msg, NULL);
                goto out;
            }
            pages += p;
            bytes += b;
        }
    }
    Tqkv__V1__DeleteResponse resp = TQKV__V1__DELETE_RESPONSE__INIT;
    resp.pages_deleted = pages;
    resp.bytes_freed = bytes;
    tqkv__call_finish_msg(c, &resp.base);
out:
    tqkv__v1__delete_request__free_unpacked(r, NULL);
}

static void
stats_start(tqkv__call_t *c)
{
    Tqkv__V1__StatsRequest *r = NULL;
    UNARY_DECODE(c, Tqkv__V1__StatsRequest, tqkv_validate_stats, r);
    if (r->identity_only) { /* any valid token (checked before): every client ranks alike */
        Tqkv__V1__StatsResponse id = TQKV__V1__STATS_RESPONSE__INIT;
        id.node_id = c->srv->cfg.node_id;
        tqkv__call_finish_msg(c, &id.base);
        goto out;
    }
    int scoped = r->namespace_ && r->namespace_[0];
    if (!auth_or_finish(c, scoped ? r->namespace_ : NULL, TQKV_AUTH_READ))
        goto out;
    tqkv_store_stats_t st;
    memset(&st, 0, sizeof st);
    tqkv_status_t rc = tqkv_store_stats(c->srv->store, scoped ? r->namespace_ : NULL,
                                        scoped ? strlen(r->namespace_) : 0, &st);
    if (rc != TQKV_OK) {
        char msg[ERRLEN];
        snprintf(msg, sizeof msg, "stats: %s", tqkv_strerror(rc));
        tqkv__call_finish(c, tqkv_status_to_grpc(rc), msg, NULL);
        goto out;
    }
    Tqkv__V1__TierStats ts[3];
    Tqkv__V1__TierStats *tp[3];
    size_t nt = 0;
    for (int t = TQKV_TIER_HBM; t <= TQKV_TIER_DISK; t++) {
        const tqkv_tier_stats_t *x = &st.tier[t];
        if (t != TQKV_TIER_DRAM && x->capacity == 0 && x->pages == 0)
            continue;
        tqkv__v1__tier_stats__init(&ts[nt]);
        ts[nt].tier = (Tqkv__V1__Tier)t;
        ts[nt].capacity_bytes = x->capacity;
        ts[nt].bytes_used = x->bytes_used;
        ts[nt].pages = x->pages;
        ts[nt].hits = x->hits;
        ts[nt].misses = x->misses;
        ts[nt].evictions = x->evictions;
        ts[nt].demotions = x->demotions;
        ts[nt].promotions = x->promotions;
        tp[nt] = &ts[nt];
        nt++;
    }
    Tqkv__V1__StatsResponse resp = TQKV__V1__STATS_RESPONSE__INIT;
    resp.n_tiers = nt;
    resp.tiers = tp;
    resp.hits = st.hits;
    resp.misses = st.misses;
    resp.evictions = st.evictions;
    resp.bytes_in = st.bytes_in;
    resp.bytes_out = st.bytes_out;
    resp.pages = st.pages;
    resp.page_bytes = st.page_bytes;
    resp.bf16_bytes = st.bf16_bytes;
    resp.quota_bytes = st.quota_bytes;
    resp.node_id = c->srv->cfg.node_id;
    resp.pages_handed_off = atomic_load(&c->srv->handed_off);
    resp.forwarded = atomic_load(&c->srv->forwarded);
    resp.compression_ratio = st.page_bytes ? (double)st.bf16_bytes / (double)st.page_bytes : 0.0;
    tqkv__call_finish_msg(c, &resp.base);
out:
    tqkv__v1__stats_request__free_unpacked(r, NULL);
}

const tqkv__handler_t tqkv__lookup_handler = {
    .path = "/tqkv.v1.KVCache/Lookup",
    .metric = "Lookup",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = lookup_start,
    .on_wake = lookup_wake,
    .on_free = lookup_free,
};

const tqkv__handler_t tqkv__delete_handler = {
    .path = "/tqkv.v1.KVCache/Delete",
    .metric = "Delete",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = delete_start,
};

const tqkv__handler_t tqkv__stats_handler = {
    .path = "/tqkv.v1.KVCache/Stats",
    .metric = "Stats",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = stats_start,
};
