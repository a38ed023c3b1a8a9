/* client_put.c - libtqkv: put sessions (client-streaming Put to the R targets of each
 * block, re-sent to the next in rank when a stream fails). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/wire.h"

/* ---- Put ---- */

/* The public numberings are the proto's: a value passes the boundary unchanged. */
#define SAME(a, b) ((int)(a) == (int)(b))
_Static_assert(SAME(TQKV_CLIENT_MODE_DEFAULT, TQKV__V1__MODE__MODE_DEFAULT) &&
                   SAME(TQKV_CLIENT_MODE_MSE, TQKV__V1__MODE__MODE_MSE) &&
                   SAME(TQKV_CLIENT_MODE_PROD, TQKV__V1__MODE__MODE_PROD) &&
                   SAME(TQKV_CLIENT_MODE_LOSSLESS, TQKV__V1__MODE__MODE_LOSSLESS),
               "client.h modes are the proto's Mode");
_Static_assert(SAME(TQKV_CLIENT_TIER_NONE, TQKV__V1__TIER__TIER_NONE) &&
                   SAME(TQKV_CLIENT_TIER_HBM, TQKV__V1__TIER__TIER_HBM) &&
                   SAME(TQKV_CLIENT_TIER_DRAM, TQKV__V1__TIER__TIER_DRAM) &&
                   SAME(TQKV_CLIENT_TIER_DISK, TQKV__V1__TIER__TIER_DISK) &&
                   SAME(TQKV_CLIENT_TIER_COUNT, TQKV__V1__TIER__TIER_DISK + 1),
               "client.h tiers are the proto's Tier");
_Static_assert(SAME(TQKV_CLIENT_TRANSPORT_GRPC, TQKV__V1__TRANSPORT__TRANSPORT_GRPC) &&
                   SAME(TQKV_CLIENT_TRANSPORT_NCCL, TQKV__V1__TRANSPORT__TRANSPORT_NCCL) &&
                   SAME(TQKV_CLIENT_TRANSPORT_TCP, TQKV__V1__TRANSPORT__TRANSPORT_TCP),
               "client.h transports are the proto's Transport");
_Static_assert(SAME(TQKV_CLIENT_PACKED, TQKV__V1__ENCODING__ENCODING_PACKED) &&
                   SAME(TQKV_CLIENT_BF16, TQKV__V1__ENCODING__ENCODING_BF16),
               "client.h encodings are the proto's Encoding");

tqkv_status_t
tqkv__client_check_shape(const tqkv_client_t *c, const tqkv_block_shape_t *s, const char *what)
{
    /* The server's own check (tqkv_page_check_params, handlers_kv.c) with the smallest
     * codec: whatever it refuses here, the server refuses under every policy. */
    tqkv_block_codec_t least = {.k = {.bits_x2 = 2, .mode = TQKV_MODE_MSE},
                                .v = {.bits_x2 = 2, .mode = TQKV_MODE_MSE},
                                .rotation = TQKV_ROT_DENSE};
    char err[160];
    tqkv_status_t st = tqkv_page_check_params(s, &least, err, sizeof err);
    if (st != TQKV_OK)
        return tqkv__client_err(st, 0, "%s: shape %ux%ux%u: %s", what, s->num_tokens,
                                s->num_kv_heads, s->head_dim, err);
    uint64_t kv = 2ull * s->num_tokens * s->num_kv_heads * s->head_dim * 2;
    if (c && kv > c->max_msg)
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "%s: shape %ux%ux%u: K and V are %llu bytes, above the message "
                                "limit %zu (max_message_bytes)",
                                what, s->num_tokens, s->num_kv_heads, s->head_dim,
                                (unsigned long long)kv, c->max_msg);
    return TQKV_OK;
}

/* A Put message kept (sharing its slices) until its stream's response, so that with
 * several targets the blocks of a stream that fails can go to the next in rank. */
typedef struct kept {
    grpc_byte_buffer *bb;
    uint64_t holders; /* rank positions this block was sent to */
    uint8_t nrank;
    uint32_t rank[RANK_MAX];
} kept_t;

typedef struct keptvec {
    kept_t *v;
    size_t n, cap;
} keptvec_t;

static int
kept_push(keptvec_t *kv, const kept_t *k)
{
    if (kv->n == kv->cap) {
        size_t nc = kv->cap ? kv->cap * 2 : 16;
        kept_t *nv = realloc(kv->v, nc * sizeof *nv);
        if (nv == NULL)
            return -1;
        kv->v = nv;
        kv->cap = nc;
    }
    kv->v[kv->n++] = *k;
    return 0;
}

static void
kept_clear(keptvec_t *kv)
{
    for (size_t i = 0; i < kv->n; i++)
        grpc_byte_buffer_destroy(kv->v[i].bb);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

struct tqkv_put {
    tqkv_client_t *c; /* &cv */
    tqkv_client_t cv; /* the view (target table) of the whole session */
    grpc_completion_queue *cq;
    rpc_t **rpc;      /* per target, started lazily */
    keptvec_t *kept;  /* per target: messages sent on its current stream (several targets) */
    keptvec_t resend; /* messages of failed streams, for the next target in rank */
    gpr_timespec deadline;
    Tqkv__V1__Codec codec;
    int has_codec;
    tqkv_put_result_t res;
    tqkv_status_t err;
};

tqkv_status_t
tqkv_client_put_begin(tqkv_client_t *c, const tqkv_put_opts_t *o, tqkv_put_t **out)
{
    if (out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "put_begin: out is NULL");
    *out = NULL;
    if (c == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "put_begin: client is NULL");
    tqkv_put_t *p = calloc(1, sizeof *p);
    if (p == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    c = tqkv__view_enter(c, &p->cv);
    if ((p->rpc = calloc(c->nt, sizeof *p->rpc)) == NULL ||
        (p->kept = calloc(c->nt, sizeof *p->kept)) == NULL) {
        free(p->rpc);
        tqkv__view_leave(&p->cv);
        free(p);
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    }
    p->c = c;
    p->cq = grpc_completion_queue_create_for_next(NULL);
    p->deadline = tqkv__deadline_after(o && o->deadline_ms ? o->deadline_ms : c->deadline_ms);
    tqkv__v1__codec__init(&p->codec);
    if (o && (o->key_bits > 0 || o->value_bits > 0 || o->key_mode || o->value_mode)) {
        /* the one mapping of the public modes: the proto's numbers (asserted above) */
        p->has_codec = 1;
        p->codec.key_bits = o->key_bits;
        p->codec.value_bits = o->value_bits;
        p->codec.key_mode = (Tqkv__V1__Mode)o->key_mode;
        p->codec.value_mode = (Tqkv__V1__Mode)o->value_mode;
    }
    *out = p;
    return TQKV_OK;
}

static void
put_step(tqkv_put_t *p)
{
    tag_kind_t k;
    int ok;
    (void)tqkv__cq_step(p->cq, &k, &ok);
}

/* Frees the stream of target ti (all its tags back). Its kept messages go to the
 * resend list when failed says the stream lost them and the client has several
 * targets; otherwise they are released. */
static void
put_release(tqkv_put_t *p, size_t ti, int failed)
{
    rpc_t *r = p->rpc[ti];
    keptvec_t *kv = &p->kept[ti];
    if (failed && p->c->nt > 1) {
        for (size_t i = 0; i < kv->n; i++) {
            if (kept_push(&p->resend, &kv->v[i]) != 0) {
                grpc_byte_buffer_destroy(kv->v[i].bb);
                p->res.blocks_lost++;
            }
        }
        free(kv->v);
        memset(kv, 0, sizeof *kv);
    } else {
        if (failed)
            p->res.blocks_lost += r->sent;
        kept_clear(kv);
    }
    tqkv__rpc_fini(r);
    free(r);
    p->rpc[ti] = NULL;
}

/* Ends a stream that failed: waits for its tags, frees it. Returns its status. */
static tqkv_status_t
put_drop(tqkv_put_t *p, size_t ti)
{
    rpc_t *r = p->rpc[ti];
    if (!r->status_done)
        tqkv__rpc_cancel(r);
    while (r->inflight > 0)
        put_step(p);
    tqkv_status_t st = tqkv__rpc_result(p->c, r);
    if (st == TQKV_OK)
        st = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: Put stream ended early", p->c->t[ti]->name);
    put_release(p, ti, st == TQKV_EUNAVAILABLE);
    return st;
}

static tqkv_status_t
put_stream(tqkv_put_t *p, size_t ti, rpc_t **out)
{
    rpc_t *r = p->rpc[ti];
    if (r == NULL) {
        r = calloc(1, sizeof *r);
        if (r == NULL)
            return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        p->rpc[ti] = r;
        tqkv_status_t st = tqkv__rpc_start(p->c, r, p->cq, ti, M_PUT, p->deadline, NULL);
        if (st != TQKV_OK) {
            while (r->inflight > 0)
                put_step(p);
            put_release(p, ti, 0);
            return st;
        }
    }
    while (r->send_busy)
        put_step(p);
    if (r->send_failed || r->status_done)
        return put_drop(p, ti);
    *out = r;
    return TQKV_OK;
}

/* Sends bb (borrowed; a copy goes out) to up to `want` usable targets of rank[],
 * skipping the holders. Writes the targets used into *holders. Returns how many
 * took it; *st is the first error that is not a down target. */
static size_t
put_route(tqkv_put_t *p, grpc_byte_buffer *bb, const uint32_t *rank, size_t nrank, size_t want,
          uint64_t *holders, tqkv_status_t *st)
{
    tqkv_client_t *c = p->c;
    uint64_t now = tqkv_clock_ns();
    size_t sent = 0;
    uint64_t used = 0;
    *st = TQKV_OK;
    for (size_t i = 0; i < nrank && sent < want; i++) {
        size_t ti = rank[i];
        rpc_t *r = NULL;
        if ((*holders >> i) & 1 || !tqkv__target_usable(c, ti, now))
            continue;
        tqkv_status_t s = put_stream(p, ti, &r);
        if (s == TQKV_OK && tqkv__rpc_send(r, grpc_byte_buffer_copy(bb)) != 0)
            s = put_drop(p, ti);
        if (s != TQKV_OK) {
            if (c->nt > 1 && s == TQKV_EUNAVAILABLE)
                continue; /* that server is down: the next in rank takes the block */
            *st = s;
            break;
        }
        used |= 1ull << i;
        p->res.blocks_sent++;
        sent++;
    }
    *holders |= used;
    if (c->nt > 1) {
        /* Keep the message on each stream it went to, with the ranking. */
        for (size_t i = 0; i < nrank; i++) {
            if (!((used >> i) & 1))
                continue;
            kept_t k = {
                .bb = grpc_byte_buffer_copy(bb), .holders = *holders, .nrank = (uint8_t)nrank};
            memcpy(k.rank, rank, nrank * sizeof *rank);
            if (kept_push(&p->kept[rank[i]], &k) != 0)
                grpc_byte_buffer_destroy(k.bb);
        }
    }
    return sent;
}

tqkv_status_t
tqkv_client_put_block(tqkv_put_t *p, const tqkv_put_block_t *b)
{
    if (p == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "put_block: session is NULL");
    tqkv_client_t *c = p->c;
    Tqkv__V1__PutRequest m;
    size_t tensor = 0;

    if (p->err != TQKV_OK)
        return p->err;
    if (b == NULL || b->ns == NULL || !tqkv__hash_ok(b->hash) ||
        (b->parent && !tqkv__hash_ok(b->parent)))
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "put: namespace and a hash of 8..64 bytes required");
    if (b->page == NULL) {
        tqkv_status_t sst;
        if (b->key == NULL || b->value == NULL)
            return tqkv__client_err(TQKV_EINVAL, 0,
                                    "put: key, value and a non-zero shape required");
        if ((sst = tqkv__client_check_shape(c, &b->shape, "put")) != TQKV_OK)
            return sst; /* before key and value are read */
        tensor = (size_t)b->shape.num_tokens * b->shape.num_kv_heads * b->shape.head_dim * 2;
    } else if (b->page_len == 0) {
        return tqkv__client_err(TQKV_EINVAL, 0, "put: empty page");
    }
    tqkv__v1__put_request__init(&m);
    m.namespace_ = (char *)b->ns;
    m.hash.data = (uint8_t *)b->hash->bytes;
    m.hash.len = b->hash->len;
    if (b->parent) {
        m.parent_hash.data = (uint8_t *)b->parent->bytes;
        m.parent_hash.len = b->parent->len;
    }
    m.layer = b->layer;
    m.num_layers = b->num_layers;
    m.num_tokens = b->shape.num_tokens;
    m.num_kv_heads = b->shape.num_kv_heads;
    m.head_dim = b->shape.head_dim;
    if (b->page) {
        m.page.data = (uint8_t *)b->page;
        m.page.len = b->page_len;
    } else {
        m.key.data = (uint8_t *)b->key;
        m.key.len = tensor;
        m.value.data = (uint8_t *)b->value;
        m.value.len = tensor;
    }
    if (p->has_codec)
        m.codec = &p->codec;
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    if (bb == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");

    uint32_t cand[RANK_MAX];
    size_t nc = tqkv__candidates(c, b->ns, b->hash, cand);
    uint64_t holders = 0;
    tqkv_status_t st;
    size_t sent = put_route(p, bb, cand, nc, c->replicas, &holders, &st);
    grpc_byte_buffer_destroy(bb);
    if (sent == 0 && st == TQKV_OK)
        st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                              "put: no live target");
    if (sent == 0 || st != TQKV_OK)
        p->err = st;
    return sent > 0 ? TQKV_OK : st;
}

static void
put_free(tqkv_put_t *p)
{
    for (size_t i = 0; i < p->c->nt; i++)
        if (p->rpc[i])
            put_release(p, i, 0);
    kept_clear(&p->resend);
    free(p->kept);
    free(p->rpc);
    tqkv__cq_destroy(p->cq);
    tqkv__view_leave(&p->cv);
    free(p);
}

/* Half-closes every stream, collects the responses, and frees the streams. Failed
 * streams' messages move to the resend list (several targets). Returns the first
 * error that is not a down target of a sharded client (*saved: its message). */
static tqkv_status_t
put_collect(tqkv_put_t *p, tqkv_client_error_t *saved)
{
    tqkv_client_t *c = p->c;
    tqkv_status_t first = TQKV_OK;
    for (size_t i = 0; i < c->nt; i++) {
        rpc_t *r = p->rpc[i];
        if (r == NULL)
            continue;
        while (r->send_busy)
            put_step(p);
        if (!r->status_done && !r->send_failed)
            tqkv__rpc_close_and_recv(r);
        else
            tqkv__rpc_cancel(r);
    }
    for (;;) {
        int busy = 0;
        for (size_t i = 0; i < c->nt; i++)
            busy |= p->rpc[i] && p->rpc[i]->inflight > 0;
        if (!busy)
            break;
        put_step(p);
    }
    for (size_t i = 0; i < c->nt; i++) {
        rpc_t *r = p->rpc[i];
        if (r == NULL)
            continue;
        tqkv_status_t st = tqkv__rpc_result(c, r);
        Tqkv__V1__PutResponse *resp = NULL;
        if (st == TQKV_OK && r->recv_bb)
            resp = (Tqkv__V1__PutResponse *)tqkv_wire_decode(&tqkv__v1__put_response__descriptor,
                                                             r->recv_bb);
        if (st == TQKV_OK && resp == NULL)
            st = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: malformed PutResponse", c->t[i]->name);
        if (resp) {
            p->res.blocks_stored += resp->blocks_stored;
            p->res.blocks_duplicate += resp->blocks_duplicate;
            p->res.bytes_in += resp->bytes_in;
            p->res.bytes_stored += resp->bytes_stored;
            protobuf_c_message_free_unpacked(&resp->base, NULL);
        }
        int down = c->nt > 1 && st == TQKV_EUNAVAILABLE;
        put_release(p, i, st != TQKV_OK && (down || c->nt == 1));
        if (down)
            st = TQKV_OK;
        if (first == TQKV_OK && st != TQKV_OK) {
            first = st;
            *saved = tqkv__client_last_err;
        }
    }
    return first;
}

tqkv_status_t
tqkv_client_put_end(tqkv_put_t *p, tqkv_put_result_t *res)
{
    if (res)
        memset(res, 0, sizeof *res);
    if (p == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "put_end: session is NULL");
    tqkv_status_t first = p->err;
    tqkv_client_error_t saved = tqkv__client_last_err;
    tqkv_status_t st = put_collect(p, &saved);
    if (first == TQKV_OK)
        first = st;
    /* Blocks of streams that died (several targets): up to two more rounds on the next
     * live targets in their ranking that do not hold them yet. */
    for (int round = 0; round < 2 && p->resend.n > 0 && first == TQKV_OK; round++) {
        keptvec_t todo = p->resend;
        memset(&p->resend, 0, sizeof p->resend);
        for (size_t i = 0; i < todo.n; i++) {
            kept_t *k = &todo.v[i];
            tqkv_status_t s2;
            if (put_route(p, k->bb, k->rank, k->nrank, 1, &k->holders, &s2) == 0)
                p->res.blocks_lost++;
        }
        kept_clear(&todo);
        st = put_collect(p, &saved);
        if (first == TQKV_OK)
            first = st;
    }
    p->res.blocks_lost += p->resend.n;
    if (res)
        *res = p->res;
    put_free(p);
    tqkv__client_last_err = saved;
    return first;
}

void
tqkv_client_put_abort(tqkv_put_t *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < p->c->nt; i++)
        if (p->rpc[i])
            tqkv__rpc_cancel(p->rpc[i]);
    for (;;) {
        int busy = 0;
        for (size_t i = 0; i < p->c->nt; i++)
            busy |= p->rpc[i] && p->rpc[i]->inflight > 0;
        if (!busy)
            break;
        put_step(p);
    }
    put_free(p);
}
