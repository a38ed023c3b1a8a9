/* handlers_put.c - the tqkv.v1.KVCache Put method: client streaming, codec work on the
 * encoder pool, a forward to the owner (forward.h) for blocks another node owns.
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

#include "cache/disk.h"
#include "cache/disk_format.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/validate.h"
#include "transport/wire.h"

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
    tqkv_status_t st;     /* its outcome; err says what failed */
    int input;            /* a failure that is the client's input */
    char err[TQKV__KV_ERRLEN];
    int duplicate;
    uint64_t bytes_in, bytes_stored;
    int sync_job;           /* the stream's closing disk sync, not a message */
    tqkv_store_sync_t sync; /* --disk-sync always: the disk records to wait for */
} put_job_t;

typedef struct put_state {
    pthread_mutex_t mu; /* protects done (pushed by encoder threads) */
    put_job_t *done;
    unsigned window;  /* jobs allowed in flight */
    unsigned jobs;    /* jobs in flight (worker thread only) */
    int recv_active;  /* a RECV_MESSAGE is in flight */
    int eof;          /* the client half-closed */
    tqkv_status_t st; /* first failure (TQKV_OK: none); err says what */
    int input;        /* that failure is the client's input */
    char err[TQKV__KV_ERRLEN];
    uint64_t stored, dups, total_in, total_stored;
    tqkv_store_sync_t sync; /* the stored blocks' disk records, synced once before the reply */
    int sync_started;
} put_state_t;

/* A message's block, as far as put_block got with it. */
typedef struct put_block {
    Tqkv__V1__PutRequest *m; /* the decoded message (owned) */
    tqkv_block_key_t key;
    uint8_t *page;    /* the page encoded here (owned), or NULL when the client sent one */
    const void *data; /* the page to store: page or the message's */
    size_t plen;      /* its bytes */
    uint64_t bf16;    /* BF16 bytes it represents */
} put_block_t;

/* The codec of a block: the namespace's policy (--namespace-policy), then the request's
 * overrides. */
static void
put_codec(tqkv_server_t *s, const Tqkv__V1__PutRequest *m, size_t ns_len, tqkv_block_codec_t *codec)
{
    tqkv_policy_t pol = *tqkv_config_ns_policy(&s->cfg, m->namespace_, ns_len);
    tqkv_codec_override(m->codec, &pol);
    tqkv_policy_block_codec(&pol, m->layer, m->num_layers, codec);
}

/* Encodes the message's BF16 tensors into a new page (b->page), on the GPU when one is
 * configured (any GPU failure falls back to the CPU encoder, which also words the error
 * for bad input: the device only flags NaN/Inf). A failure is the client's input. */
static tqkv_status_t
put_encode(put_job_t *j, put_block_t *b)
{
    tqkv_server_t *s = j->call->srv;
    const Tqkv__V1__PutRequest *m = b->m;
    tqkv_block_codec_t codec;
    tqkv_block_shape_t shape = {m->num_tokens, m->num_kv_heads, m->head_dim};
    put_codec(s, m, b->key.ns_len, &codec);
    size_t cap;
    j->err[0] = '\0';
    tqkv_status_t st = tqkv_page_check_params(&shape, &codec, j->err, TQKV__KV_ERRLEN);
    if (st == TQKV_OK)
        st = tqkv_page_size(&shape, &codec, &cap);
    if (st != TQKV_OK) {
        if (j->err[0] == '\0')
            snprintf(j->err, TQKV__KV_ERRLEN, "codec: %s", tqkv_strerror(st));
        return st;
    }
    b->page = malloc(cap);
    if (b->page == NULL) {
        snprintf(j->err, TQKV__KV_ERRLEN, "out of memory encoding a %zu-byte page", cap);
        return TQKV_ENOMEM;
    }
    double t0 = tqkv_clock_s();
    st = TQKV_EUNSUPPORTED;
    if (s->gpu_encode_device >= 0 && codec.k.mode != TQKV_MODE_RAW &&
        codec.v.mode != TQKV_MODE_RAW) { /* a lossless page is a copy: CPU */
        char gerr[TQKV__KV_ERRLEN];
        st = tqkv__gpu_encode(s->gpu_encode_device, &shape, &codec, (const uint16_t *)m->key.data,
                              (const uint16_t *)m->value.data, b->page, cap, &b->plen, gerr,
                              sizeof gerr);
        if (st != TQKV_OK && st != TQKV_ERANGE && !atomic_exchange(&s->gpu_encode_warned, 1))
            tqkv_log(TQKV_LOG_WARN, "GPU encode failed, encoding on the CPU", "why=\"%s\"", gerr);
    }
    if (st != TQKV_OK)
        st = tqkv_page_encode(&shape, &codec, (const uint16_t *)m->key.data,
                              (const uint16_t *)m->value.data, b->page, cap, &b->plen, j->err,
                              TQKV__KV_ERRLEN);
    if (st != TQKV_OK)
        return st;
    b->bf16 = m->key.len + m->value.len;
    tqkv_metrics_codec(s->metrics, 1, b->bf16, tqkv_clock_s() - t0);
    b->data = b->page;
    j->bytes_in = b->bf16;
    return TQKV_OK;
}

/* Sends the block to its owner when a peer owns it (one hop, as the page encoded here):
 * 1 with *st its status when it went there, 0 when it is this node's to store. */
static int
put_forward(put_job_t *j, const put_block_t *b, tqkv_status_t *st)
{
    tqkv__call_t *c = j->call;
    tqkv_server_t *s = c->srv;
    const Tqkv__V1__PutRequest *m = b->m;
    tqkv__fwd_t *fw = c->hop ? NULL : tqkv__fwd_get(s);
    tqkv__fwd_rank_t rk;
    if (fw == NULL || tqkv__fwd_rank(fw, &rk) != TQKV_OK)
        return 0;
    int owned = tqkv__fwd_owned(&rk, m->namespace_, m->hash.data, m->hash.len);
    tqkv__fwd_rank_free(&rk);
    if (owned)
        return 0;
    tqkv__fwd_block_t fb = {
        .ns = m->namespace_,
        .hash = m->hash.data,
        .hash_len = m->hash.len,
        .parent = m->parent_hash.len ? m->parent_hash.data : NULL,
        .parent_len = m->parent_hash.len,
        .layer = m->layer,
        .shape = {m->num_tokens, m->num_kv_heads, m->head_dim},
        .page = b->data,
        .len = b->plen,
    };
    *st = tqkv__fwd_put(fw, c->authz, &fb, &j->duplicate, j->err, TQKV__KV_ERRLEN);
    if (*st != TQKV_OK)
        return 1;
    atomic_fetch_add(&s->forwarded, 1);
    if (!j->duplicate)
        j->bytes_stored = b->plen;
    return 1;
}

/* Stores the block here (its disk record synced later, with the stream's). */
static tqkv_status_t
put_store(put_job_t *j, const put_block_t *b)
{
    tqkv_server_t *s = j->call->srv;
    const Tqkv__V1__PutRequest *m = b->m;
    size_t plen = b->plen;
    tqkv_status_t st =
        tqkv_store_put_nosync(s->store, &b->key, m->parent_hash.len ? m->parent_hash.data : NULL,
                              m->parent_hash.len, b->data, plen, b->bf16, &j->duplicate, &j->sync);
    if (st == TQKV_OK) {
        if (!j->duplicate)
            j->bytes_stored = plen;
        return TQKV_OK;
    }
    const tqkv_store_config_t *sc = &s->cfg.store;
    const tqkv_block_key_t *key = &b->key;
    tqkv_disk_stats_t ds;
    if (st == TQKV_ENOSPC && sc->default_ns_quota != 0 && plen > sc->default_ns_quota)
        snprintf(j->err, TQKV__KV_ERRLEN,
                 "store: a %zu-byte page cannot fit in namespace '%s': its quota is %llu "
                 "bytes (--ns-quota)",
                 plen, m->namespace_, (unsigned long long)sc->default_ns_quota);
    else if (st == TQKV_ENOSPC && plen > sc->dram_capacity && plen > sc->hbm_capacity)
        snprintf(j->err, TQKV__KV_ERRLEN,
                 "store: a %zu-byte page is larger than every tier (--dram-capacity %llu, "
                 "--hbm-capacity %llu)",
                 plen, (unsigned long long)sc->dram_capacity, (unsigned long long)sc->hbm_capacity);
    else if (st == TQKV_ENOSPC && tqkv_store_disk_stats(s->store, &ds) == TQKV_OK &&
             tqkv_disk_record_bytes((uint32_t)(key->ns_len + key->hash_len + m->parent_hash.len),
                                    plen) > ds.max_record)
        snprintf(j->err, TQKV__KV_ERRLEN,
                 "store: a %zu-byte page is larger than the disk tier's largest record "
                 "(%llu bytes: a segment file is a quarter of --disk-capacity %llu, at "
                 "most 256 MiB); raise --disk-capacity",
                 plen, (unsigned long long)ds.max_record, (unsigned long long)ds.capacity);
    else if (st == TQKV_ENOSPC)
        snprintf(j->err, TQKV__KV_ERRLEN,
                 "store full: no room for a %zu-byte page in namespace '%s' and nothing "
                 "may be evicted (every candidate is leased by a Lookup, read, or the "
                 "parent of a kept block; shorter lease_ms or more capacity helps)",
                 plen, m->namespace_);
    else
        snprintf(j->err, TQKV__KV_ERRLEN, "store: %s", tqkv_strerror(st));
    return st;
}

/* Decodes, validates, authorizes, encodes and stores (or forwards) the job's message
 * into b. Returns its status, with j->err saying what went wrong; *input is set when
 * the failure is the client's input (a bad message, page or codec). */
static tqkv_status_t
put_block(put_job_t *j, put_block_t *b, int *input)
{
    tqkv__call_t *c = j->call;
    tqkv_server_t *s = c->srv;
    size_t len = 0;
    *input = 0;
    uint8_t *buf = tqkv__bb_read(j->bb, &len);
    grpc_byte_buffer_destroy(j->bb);
    j->bb = NULL;
    if (buf == NULL) {
        snprintf(j->err, TQKV__KV_ERRLEN, "out of memory reading the message");
        return TQKV_ENOMEM;
    }
    tqkv_status_t st = tqkv_validate_put(buf, len, &s->limits, &b->m, j->err, TQKV__KV_ERRLEN);
    free(buf);
    if (st != TQKV_OK) {
        *input = 1;
        return st;
    }
    const Tqkv__V1__PutRequest *m = b->m;
    st = tqkv__call_auth(c, m->namespace_, TQKV_AUTH_WRITE, j->err, TQKV__KV_ERRLEN);
    if (st != TQKV_OK)
        return st;
    b->key = (tqkv_block_key_t){m->namespace_, strlen(m->namespace_), m->hash.data, m->hash.len,
                                m->layer};
    if (m->page.len) {
        tqkv_page_info_t info;
        st = tqkv_page_validate(m->page.data, m->page.len, 0, &info, NULL, 0);
        if (st != TQKV_OK) {
            /* whatever the page's fault, the client's argument is invalid */
            snprintf(j->err, TQKV__KV_ERRLEN, "page: %s", tqkv_strerror(st));
            *input = 1;
            return TQKV_EINVAL;
        }
        b->data = m->page.data;
        b->plen = m->page.len;
        b->bf16 = info.bf16_bytes;
        j->bytes_in = m->page.len;
    } else if ((st = put_encode(j, b)) != TQKV_OK) {
        *input = 1;
        return st;
    }
    if (put_forward(j, b, &st))
        return st;
    return put_store(j, b);
}

/* Hands the finished job j to its call's done list and wakes the call (the encoder
 * thread's last touch of j). */
static void
job_done(put_job_t *j)
{
    tqkv__call_t *c = j->call;
    put_state_t *h = c->h;
    pthread_mutex_lock(&h->mu);
    j->next = h->done;
    h->done = j;
    pthread_mutex_unlock(&h->mu);
    tqkv__call_wake(c);
}

/* Encoder-pool job: one message's block (put_block); its status goes back to the worker
 * with the job (put_wake), which keeps the stream's first failure for put_finish. */
static void
put_job(void *arg)
{
    put_job_t *j = arg;
    put_block_t b = {0};
    j->st = put_block(j, &b, &j->input);
    free(b.page);
    if (b.m)
        tqkv__v1__put_request__free_unpacked(b.m, NULL);
    job_done(j);
}

/* Encoder-pool job: with --disk-sync always, makes the stream's disk records durable
 * (one group-committed fdatasync for all its blocks) before the PutResponse goes out. */
static void
put_sync_job(void *arg)
{
    put_job_t *j = arg;
    tqkv_status_t st = tqkv_store_sync(j->call->srv->store, &j->sync);
    j->st = st;
    if (st != TQKV_OK) {
        snprintf(j->err, TQKV__KV_ERRLEN,
                 "disk tier (--disk-sync always): the stream's pages could not be made durable: %s",
                 tqkv_strerror(st));
    }
    job_done(j);
}

/* Finishes c with the failure st, msg saying what failed: the one place Put translates a
 * status. input: the client's message was at fault (tqkv_status_to_grpc_input), else the
 * server's work (tqkv_status_to_grpc). */
static void
put_finish_failed(tqkv__call_t *c, tqkv_status_t st, int input, const char *msg)
{
    tqkv__call_finish(c, input ? tqkv_status_to_grpc_input(st) : tqkv_status_to_grpc(st), msg,
                      NULL);
}

/* Records a failure of the stream (the first one counts). */
static void
put_failed(put_state_t *h, tqkv_status_t st, int input, const char *msg)
{
    if (h->st != TQKV_OK)
        return;
    h->st = st;
    h->input = input;
    snprintf(h->err, TQKV__KV_ERRLEN, "%s", msg);
}

static void
put_finish(tqkv__call_t *c)
{
    put_state_t *h = c->h;
    if (c->closed) {
        tqkv__call_abort(c);
        return;
    }
    if (h->st != TQKV_OK) {
        put_finish_failed(c, h->st, h->input, h->err);
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
    int stop = h->eof || h->st != TQKV_OK || c->closed;
    if (stop && h->jobs == 0 && h->st == TQKV_OK && !c->closed && h->sync.hi != 0 &&
        !h->sync_started) {
        /* Every block is in; one disk sync for all of them, then the reply. */
        put_job_t *j = calloc(1, sizeof *j);
        h->sync_started = 1;
        if (j == NULL) {
            put_failed(h, TQKV_ENOMEM, 0, "out of memory");
        } else {
            j->call = c;
            j->sync_job = 1;
            j->sync = h->sync;
            if (tqkv__call_submit(c, put_sync_job, j) != TQKV_OK) {
                free(j);
                put_failed(h, TQKV_EUNAVAILABLE, 0, "server is stopping");
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
        put_finish_failed(c, TQKV_ENOMEM, 0, "out of memory");
        return;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->window = c->srv->cfg.encoder_threads < 8 ? c->srv->cfg.encoder_threads : 8;
    if (h->window == 0)
        h->window = 1;
    h->st = TQKV_OK;
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
    if (h->st != TQKV_OK) { /* failing already: drop */
        put_step(c);
        return;
    }
    put_job_t *j = calloc(1, sizeof *j);
    if (j == NULL) {
        put_failed(h, TQKV_ENOMEM, 0, "out of memory");
        put_step(c);
        return;
    }
    j->call = c;
    j->bb = c->recv_bb;
    c->recv_bb = NULL;
    if (tqkv__call_submit(c, put_job, j) != TQKV_OK) {
        grpc_byte_buffer_destroy(j->bb);
        free(j);
        put_failed(h, TQKV_EUNAVAILABLE, 0, "server is stopping");
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
    if (j->st != TQKV_OK) {
        put_failed(h, j->st, j->input, j->err);
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
