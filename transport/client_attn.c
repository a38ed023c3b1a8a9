/* client_attn.c - libtqkv consumer side: fused decode attention over received pages,
 * a thin layer over kernels/attention.h (the pages are never dequantized). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "transport/client_internal.h"

tqkv_status_t
tqkv_client_attend(const float *q, uint32_t num_q_heads, const void *const *pages,
                   const size_t *page_lens, size_t n_pages, float *out)
{
    tqkv_attn_opts_t o;
    char err[200] = "";
    tqkv_attn_opts_default(&o);
    o.check_crc = 1;
    tqkv_status_t st =
        tqkv_attn_decode_ex(q, num_q_heads, pages, page_lens, n_pages, &o, out, err, sizeof err);
    if (st != TQKV_OK) {
        char msg[224];
        snprintf(msg, sizeof msg, "attend: %s", err);
        tqkv__client_set_error(st, 0, msg);
    }
    return st;
}

/* Pages of one layer, copied out of the Get stream (64-byte aligned). */
typedef struct collect {
    void **pages;
    size_t *lens;
    size_t n;
    size_t missing; /* first missing index + 1, or 0 */
    int oom;
} collect_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    collect_t *c = arg;
    if (!pg->found) {
        if (c->missing == 0 || pg->hash_index + 1 < c->missing)
            c->missing = pg->hash_index + 1;
        return 0;
    }
    size_t cap = (pg->page_len + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, cap ? cap : 64);
    if (p == NULL) {
        c->oom = 1;
        return 1;
    }
    memcpy(p, pg->page, pg->page_len);
    free(c->pages[pg->hash_index]);
    c->pages[pg->hash_index] = p;
    c->lens[pg->hash_index] = pg->page_len;
    return 0;
}

tqkv_status_t
tqkv_client_get_attend(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes,
                       size_t num_hashes, uint32_t layer, uint32_t deadline_ms, const float *q,
                       uint32_t num_q_heads, float *out)
{
    collect_t col = {0};
    tqkv_status_t st;
    if (num_hashes == 0)
        return tqkv__client_set_error(TQKV_EINVAL, 0, "get_attend: no hashes");
    if (layer == UINT32_MAX)
        return tqkv__client_set_error(TQKV_EINVAL, 0,
                                      "get_attend: layer 4294967295 is out of range");
    col.n = num_hashes;
    col.pages = calloc(num_hashes, sizeof *col.pages);
    col.lens = calloc(num_hashes, sizeof *col.lens);
    if (col.pages == NULL || col.lens == NULL) {
        st = TQKV_ENOMEM;
        goto out;
    }
    tqkv_get_req_t r = {.ns = ns,
                        .hashes = hashes,
                        .num_hashes = num_hashes,
                        .layer_begin = layer,
                        .layer_end = layer + 1,
                        .encoding = TQKV_CLIENT_PACKED,
                        .deadline_ms = deadline_ms};
    st = tqkv_client_get(c, &r, on_page, &col);
    if (col.oom) {
        st = tqkv__client_set_error(TQKV_ENOMEM, 0, "get_attend: out of memory copying pages");
        goto out;
    }
    if (st != TQKV_OK)
        goto out;
    if (col.missing) {
        char msg[96];
        snprintf(msg, sizeof msg, "get_attend: block %zu of layer %u is missing", col.missing - 1,
                 layer);
        tqkv__client_set_error(TQKV_ENOTFOUND, 0, msg);
        st = TQKV_ENOTFOUND;
        goto out;
    }
    st = tqkv_client_attend(q, num_q_heads, (const void *const *)col.pages, col.lens, num_hashes,
                            out);
out:
    for (size_t i = 0; col.pages && i < col.n; i++)
        free(col.pages[i]);
    free(col.pages);
    free(col.lens);
    return st;
}
