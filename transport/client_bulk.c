/* client_bulk.c - tqkv_client_put_many and tqkv_client_get_into (client_bulk.h). */
#include "transport/client_bulk.h"

#include <stdio.h>
#include <string.h>

#include "transport/client_internal.h"

static size_t
tensor_bytes(const tqkv_block_shape_t *s)
{
    return (size_t)s->num_tokens * s->num_kv_heads * s->head_dim * 2;
}

static tqkv_status_t
bulk_err(tqkv_status_t st, const char *fmt, size_t i, uint32_t layer, const char *why)
{
    char msg[256];
    snprintf(msg, sizeof msg, fmt, i, layer, why);
    return tqkv__client_set_error(st, 0, msg);
}

tqkv_status_t
tqkv_client_put_many(tqkv_client_t *c, const tqkv_put_opts_t *opts, const tqkv_put_many_req_t *req,
                     tqkv_put_result_t *res)
{
    tqkv_put_t *p = NULL;
    tqkv_status_t st;
    if (c == NULL || req == NULL || req->ns == NULL || req->hashes == NULL || req->keys == NULL ||
        req->values == NULL)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "put_many: NULL client or request field");
    if (req->num_hashes == 0 || req->layer_end <= req->layer_begin)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "put_many: empty grid");
    if (tensor_bytes(&req->shape) == 0)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "put_many: zero shape");
    /* every block has this shape: checked once, before any key or value is read */
    if ((st = tqkv__client_check_shape(c, &req->shape, "put_many")) != TQKV_OK)
        return st;
    if ((st = tqkv_client_put_begin(c, opts, &p)) != TQKV_OK)
        return st;
    size_t n = req->num_hashes;
    for (uint32_t l = req->layer_begin; l < req->layer_end; l++) {
        for (size_t i = 0; i < n; i++) {
            size_t e = (size_t)(l - req->layer_begin) * n + i;
            tqkv_put_block_t b = {
                .ns = req->ns,
                .hash = &req->hashes[i],
                .parent = i ? &req->hashes[i - 1] : req->parent,
                .layer = l,
                .num_layers = req->num_layers,
                .shape = req->shape,
                .key = req->keys[e],
                .value = req->values[e],
            };
            if (b.key == NULL || b.value == NULL) {
                tqkv_client_put_abort(p);
                return bulk_err(TQKV_EINVAL, "put_many: hash %zu layer %u: %s", i, l,
                                "NULL key or value");
            }
            if ((st = tqkv_client_put_block(p, &b)) != TQKV_OK) {
                /* put_end collects the stream's error message; keep the first status. */
                tqkv_put_result_t r;
                (void)tqkv_client_put_end(p, &r);
                return st;
            }
        }
    }
    return tqkv_client_put_end(p, res);
}

typedef struct into_ctx {
    const tqkv_get_req_t *req;
    const tqkv_get_into_t *dst;
    size_t tensor;
    uint64_t found, bytes;
    tqkv_status_t st;
    char msg[256]; /* why the callback stopped the Get (set as the error after it) */
} into_ctx_t;

static int
into_fail(into_ctx_t *x, tqkv_status_t st, const tqkv_get_page_t *pg, const char *why)
{
    x->st = st;
    snprintf(x->msg, sizeof x->msg, "get_into: hash %zu layer %u: %s", pg->hash_index, pg->layer,
             why);
    return 1;
}

static int
into_cb(void *arg, const tqkv_get_page_t *pg)
{
    into_ctx_t *x = arg;
    const tqkv_get_into_t *d = x->dst;
    size_t n = x->req->num_hashes;
    x->bytes += pg->wire_bytes;
    if (!pg->found)
        return 0;
    if (pg->layer < x->req->layer_begin || pg->layer >= x->req->layer_end || pg->hash_index >= n) {
        return into_fail(x, TQKV_EINTERNAL, pg, "outside the request");
    }
    size_t e = (size_t)(pg->layer - x->req->layer_begin) * n + pg->hash_index;
    void *k = d->keys ? d->keys[e] : NULL;
    void *v = d->values ? d->values[e] : NULL;
    if (pg->shape.num_tokens != d->shape.num_tokens ||
        pg->shape.num_kv_heads != d->shape.num_kv_heads ||
        pg->shape.head_dim != d->shape.head_dim) {
        char why[96];
        snprintf(why, sizeof why, "shape %ux%ux%u, expected %ux%ux%u", pg->shape.num_tokens,
                 pg->shape.num_kv_heads, pg->shape.head_dim, d->shape.num_tokens,
                 d->shape.num_kv_heads, d->shape.head_dim);
        return into_fail(x, TQKV_EFORMAT, pg, why);
    }
    if (x->req->encoding == TQKV_CLIENT_BF16) {
        if ((k && pg->key_len != x->tensor) || (v && pg->value_len != x->tensor)) {
            return into_fail(x, TQKV_EFORMAT, pg, "BF16 tensor of the wrong size");
        }
        if (k)
            memcpy(k, pg->key, x->tensor);
        if (v)
            memcpy(v, pg->value, x->tensor);
    } else {
        tqkv_page_info_t info;
        char err[160];
        tqkv_status_t st =
            tqkv_page_validate(pg->page, pg->page_len, !pg->crc_checked, &info, err, sizeof err);
        if (st == TQKV_OK && ((k && !info.codec.k.bits_x2) || (v && !info.codec.v.bits_x2))) {
            st = TQKV_EFORMAT;
            snprintf(err, sizeof err, "the page lacks a wanted tensor");
        }
        if (st == TQKV_OK && (k || v) &&
            (st = tqkv_page_decode_bf16(pg->page, info.page_bytes, k, v)) != TQKV_OK)
            snprintf(err, sizeof err, "decode: %s", tqkv_strerror(st));
        if (st != TQKV_OK) {
            return into_fail(x, st, pg, err);
        }
    }
    if (d->found)
        d->found[e] = 1;
    x->found++;
    return 0;
}

tqkv_status_t
tqkv_client_get_into(tqkv_client_t *c, const tqkv_get_req_t *req, const tqkv_get_into_t *dst,
                     uint64_t *blocks_found, uint64_t *bytes_received)
{
    if (c == NULL || req == NULL || dst == NULL)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "get_into: NULL client, request or dst");
    if (req->num_hashes == 0 || req->layer_end <= req->layer_begin)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "get_into: empty grid");
    into_ctx_t x = {.req = req, .dst = dst, .tensor = tensor_bytes(&dst->shape), .st = TQKV_OK};
    if (x.tensor == 0)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "get_into: zero shape");
    if (dst->found)
        memset(dst->found, 0, req->num_hashes * (size_t)(req->layer_end - req->layer_begin));
    tqkv_status_t st = tqkv_client_get(c, req, into_cb, &x);
    if (blocks_found)
        *blocks_found = x.found;
    if (bytes_received)
        *bytes_received = x.bytes;
    if (x.st != TQKV_OK) /* the callback's failure (the Get itself read ECANCELED) */
        return tqkv__client_set_error(x.st, 0, x.msg);
    return st;
}
