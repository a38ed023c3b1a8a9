/* client_get.c - libtqkv: Get (server streaming), with the in-place GetResponse reader
 * and the pages of a TCP data channel. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>

#include "kernels/page.h"
#include "kernels/varint.h"
#include "kernels/page_format.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/client_internal.h"
#include "transport/data_channel.h"
#include "transport/wire.h"

/* ---- Get ---- */

/* In-place reader of a GetResponse (fields of kvcache.proto). Returns 0, or -1 for
 * bytes that are not a valid message. Pointers borrow p. */
int
tqkv__client_parse_get(const uint8_t *p, size_t n, tqkv__get_msg_t *m)
{
    const uint8_t *end = p + n;
    memset(m, 0, sizeof *m);
    while (p < end) {
        uint64_t key, v;
        if (tqkv_varint_get(&p, end, &key) != 0)
            return -1;
        if ((key >> 3) == 0 || (key >> 3) > 0x1fffffffu)
            return -1; /* field numbers are 1 .. 2^29-1 */
        uint32_t field = (uint32_t)(key >> 3), wt = (uint32_t)(key & 7);
        switch (wt) {
        case TQKV_WIRE_VARINT:
            if (tqkv_varint_get(&p, end, &v) != 0)
                return -1;
            switch (field) {
            case TQKV_GET_F_LAYER:
                m->layer = (uint32_t)v;
                break;
            case TQKV_GET_F_FOUND:
                m->found = v != 0;
                break;
            case TQKV_GET_F_NUM_TOKENS:
                m->num_tokens = (uint32_t)v;
                break;
            case TQKV_GET_F_NUM_KV_HEADS:
                m->num_kv_heads = (uint32_t)v;
                break;
            case TQKV_GET_F_HEAD_DIM:
                m->head_dim = (uint32_t)v;
                break;
            case TQKV_GET_F_TIER:
                m->tier = (int)v;
                break;
            default:
                break;
            }
            break;
        case TQKV_WIRE_LEN:
            if (tqkv_varint_get(&p, end, &v) != 0 || v > (uint64_t)(end - p))
                return -1;
            switch (field) {
            case TQKV_GET_F_HASH:
                m->hash = p, m->hash_len = (size_t)v;
                break;
            case TQKV_GET_F_PAGE:
                m->page = p, m->page_len = (size_t)v;
                break;
            case TQKV_GET_F_KEY:
                m->key = p, m->key_len = (size_t)v;
                break;
            case TQKV_GET_F_VALUE:
                m->value = p, m->value_len = (size_t)v;
                break;
            default:
                break;
            }
            p += v;
            break;
        case TQKV_WIRE_I64:
            if (end - p < 8)
                return -1;
            p += 8;
            break;
        case TQKV_WIRE_I32:
            if (end - p < 4)
                return -1;
            p += 4;
            break;
        default:
            return -1;
        }
    }
    return 0;
}

typedef struct scratch {
    uint8_t *mem; /* malloc'ed; base = mem rounded up to 64 */
    size_t cap;   /* usable bytes from base */
} scratch_t;

static uint8_t *
scratch_get(scratch_t *s, size_t n)
{
    if (n + 64 > s->cap) {
        size_t nc = s->cap ? s->cap : 1 << 16;
        while (nc < n + 64)
            nc *= 2;
        free(s->mem);
        s->mem = malloc(nc + 64);
        s->cap = s->mem ? nc : 0;
        if (s->mem == NULL)
            return NULL;
    }
    return (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
}

typedef struct getop {
    tqkv_client_t *c;
    const tqkv_get_req_t *q;
    tqkv_get_cb_t cb;
    void *arg;
    size_t n, L;
    uint8_t *done;     /* n * L: reported */
    size_t *left;      /* n: layers of each hash not reported yet */
    uint32_t *corrupt; /* n * L (at the first): 1 + the target whose copy failed its CRC; a later
                         miss is then no miss */
    int canceled;
    scratch_t sc, sv;
    size_t shift;    /* offset from the scratch base that aligned the last page */
    size_t bad_hash; /* the page that failed its CRC (get_message returned 1), and where */
    size_t bad_target;
    uint32_t bad_layer;
    /* the rounds, their calls and hedges (tqkv__rd_t); the data channels polled (pf, who,
     * buffered: one per call slot), the completion queue and the calls still live */
    tqkv__rd_t rd;
    size_t *who;
    int *buffered;
    struct pollfd *pf;
    uint64_t dl_ns; /* the Get's deadline (monotonic ns) */
    grpc_completion_queue *cq;
    size_t live;
} getop_t;

static int
deliver(getop_t *g, const tqkv_get_page_t *pg)
{
    if (g->canceled)
        return 1;
    if (g->cb(g->arg, pg) != 0)
        g->canceled = 1;
    return g->canceled;
}

/* Offset and length of the first page field (4) of a GetResponse whose first avail
 * bytes are at p, when the fields before it and its length prefix lie within them.
 * Returns 0, or -1 (no page field found there: the caller copies and parses as usual). */
static int
page_field_at(const uint8_t *p, size_t avail, size_t *off, size_t *plen)
{
    const uint8_t *q = p, *end = p + avail;
    while (q < end) {
        uint64_t key, v;
        if (tqkv_varint_get(&q, end, &key) != 0)
            return -1;
        switch (key & 7) {
        case TQKV_WIRE_VARINT:
            if (tqkv_varint_get(&q, end, &v) != 0)
                return -1;
            break;
        case TQKV_WIRE_LEN:
            if (tqkv_varint_get(&q, end, &v) != 0)
                return -1;
            if ((key >> 3) == TQKV_GET_F_PAGE) {
                *off = (size_t)(q - p);
                *plen = (size_t)v;
                return 0;
            }
            if (v > (uint64_t)(end - q))
                return -1;
            q += v;
            break;
        case TQKV_WIRE_I64:
            q += 8;
            break;
        case TQKV_WIRE_I32:
            q += 4;
            break;
        default:
            return -1;
        }
    }
    return -1;
}

/* Copies bytes [a, a + n) of a page from src to dst, continuing *crc over them with
 * the header's CRC field (bytes 12..15) read as zero. */
static void
page_crc_copy(uint32_t *crc, uint8_t *dst, const uint8_t *src, size_t a, size_t n)
{
    static const uint8_t zero[4];
    size_t b = a + n;
    if (a < 12) {
        size_t e = b < 12 ? b : 12;
        *crc = tqkv_crc32c_copy(*crc, dst, src, e - a);
        dst += e - a, src += e - a, a = e;
    }
    if (a < b && a < 16) {
        size_t e = b < 16 ? b : 16;
        memcpy(dst, src, e - a);
        *crc = tqkv_crc32c(*crc, zero, e - a);
        dst += e - a, src += e - a, a = e;
    }
    if (a < b)
        *crc = tqkv_crc32c_copy(*crc, dst, src, b - a);
}

static int get_deliver(getop_t *g, rpc_t *r, size_t gi, const tqkv__get_msg_t *mp, int crc_checked,
                       size_t wire_len, int via_dc);

/* Call r received a message of len bytes: its progress (the hedge clock), its server's
 * answer time (the first message), the page size estimate (size deadlines). */
static void
get_progress(getop_t *g, rpc_t *r, size_t len)
{
    uint64_t now = tqkv_clock_ns();
    if (r->last_ns == r->t0_ns)
        tqkv__lat_record(g->c, r->target, now - r->t0_ns);
    r->last_ns = now;
    tqkv__page_seen(g->c, len);
}

/* One received message of rpc r. Returns -1 for a malformed message, 1 for a packed
 * page that fails its CRC32C. The slices are copied into the scratch buffer (the page
 * 64-byte aligned) and, for a packed page, the CRC is computed in the same pass. */
static int
get_message(getop_t *g, rpc_t *r)
{
    size_t len = grpc_byte_buffer_length(r->recv_bb);
    uint8_t *base = scratch_get(&g->sc, len);
    if (base == NULL)
        return -1;
    grpc_byte_buffer_reader rd;
    grpc_slice s;
    if (!grpc_byte_buffer_reader_init(&rd, r->recv_bb))
        return -1;
    size_t off = 0, ps = 0, pl = 0;
    int fused = 0; /* the page range [ps, ps + pl) is known before copying */
    uint32_t crc = 0;
    uint8_t *dst = base + g->shift;
    while (grpc_byte_buffer_reader_next(&rd, &s)) {
        size_t sl = GRPC_SLICE_LENGTH(s);
        const uint8_t *sp = GRPC_SLICE_START_PTR(s);
        if (off == 0 && page_field_at(sp, sl, &ps, &pl) == 0 && pl >= TQKV_PAGE_HEADER_BYTES &&
            ps + pl <= len) {
            fused = 1;
            g->shift = (64 - (ps & 63)) & 63;
            dst = base + g->shift;
        }
        if (off + sl <= len) {
            if (fused && off < ps + pl && off + sl > ps) {
                size_t a = off > ps ? off : ps, b = off + sl < ps + pl ? off + sl : ps + pl;
                memcpy(dst + off, sp, a - off);
                page_crc_copy(&crc, dst + a, sp + (a - off), a - ps, b - a);
                memcpy(dst + b, sp + (b - off), off + sl - b);
            } else {
                memcpy(dst + off, sp, sl);
            }
        }
        off += sl;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    if (off != len)
        return -1;
    get_progress(g, r, len);
    tqkv__get_msg_t m;
    if (tqkv__client_parse_get(dst, len, &m) != 0)
        return -1;
    const uint8_t *al = m.page ? m.page : m.key;
    if (al && ((uintptr_t)al & 63)) {
        size_t ns = (g->shift + 64 - ((uintptr_t)al & 63)) & 63;
        memmove(base + ns, dst, len);
        dst = base + ns;
        g->shift = ns;
        if (tqkv__client_parse_get(dst, len, &m) != 0)
            return -1;
    }
    int crc_checked = 0;
    if (m.page && m.found) {
        tqkv_page_header_t h;
        /* The server sends whole pages: one shorter than a header, or whose header gives
         * another length, was damaged (in the length field itself, say) and fails too. */
        crc_checked = -1;
        if (m.page_len >= TQKV_PAGE_HEADER_BYTES) {
            memcpy(&h, m.page, sizeof h);
            if (h.page_bytes == m.page_len) {
                /* a page field other than the one copied with its CRC (a repeated field:
                 * the last one wins) is checked on its own */
                if (!fused || m.page != dst + ps)
                    crc = tqkv_page_crc(m.page, m.page_len);
                crc_checked = crc == h.crc32c ? 1 : -1;
            }
        }
    }
    if (m.value && ((uintptr_t)m.value & 1)) {
        uint8_t *v = scratch_get(&g->sv, m.value_len);
        if (v == NULL)
            return -1;
        memcpy(v, m.value, m.value_len);
        m.value = v;
    }
    /* Which of the hashes sent: the server answers layer-major in request order. */
    size_t j = r->pos % r->count, gi = SIZE_MAX;
    r->pos++;
    for (size_t k = 0; k < r->count; k++) {
        size_t jj = (j + k) % r->count;
        const tqkv_hash_t *h = &g->q->hashes[r->gidx[jj]];
        if (h->len == m.hash_len && memcmp(h->bytes, m.hash, m.hash_len) == 0) {
            gi = r->gidx[jj];
            break;
        }
    }
    return get_deliver(g, r, gi, &m, crc_checked, len, 0);
}

/* The rest of one page's handling, shared by gRPC messages and data channel frames:
 * hash index gi (SIZE_MAX: not one asked for), bad CRC -> next replica or error,
 * a miss -> next candidate, else the callback. Same returns as get_message. */
static int
get_deliver(getop_t *g, rpc_t *r, size_t gi, const tqkv__get_msg_t *mp, int crc_checked,
            size_t wire_len, int via_dc)
{
    tqkv__get_msg_t m = *mp;
    int bad_crc = crc_checked < 0;
    if (gi == SIZE_MAX || m.layer < g->q->layer_begin || m.layer >= g->q->layer_end)
        return -1;
    size_t slot = gi * g->L + (m.layer - g->q->layer_begin);
    if (g->done[slot])
        return 0;
    if (bad_crc) {
        /* never handed out: another replica may hold a good copy (with several
         * candidates get_finish decides, once every call has ended) */
        if (g->corrupt == NULL && (g->corrupt = calloc(g->n * g->L, sizeof *g->corrupt)) == NULL)
            return -1; /* out of memory: treated as a malformed answer */
        g->corrupt[slot] = (uint32_t)(r->target + 1);
        if (g->rd.nc > 1)
            return 0;
        g->bad_hash = gi, g->bad_layer = m.layer, g->bad_target = r->target;
        return 1;
    }
    /* A miss is final only once every candidate was asked (get_finish reports it): another
     * call (a later round, a hedge, or the call a hedge raced) may still find the page. */
    if (!m.found && g->rd.nc > 1)
        return 0;
    if (!m.found && g->corrupt && g->corrupt[slot]) {
        /* the only copies found were corrupt: an error, not a miss to recompute */
        g->bad_hash = gi, g->bad_layer = m.layer, g->bad_target = g->corrupt[slot] - 1u;
        return 1;
    }
    g->done[slot] = 1;
    g->left[gi]--;
    tqkv__rd_done(&g->rd, r, gi);
    if (r->is_hedge && m.found)
        atomic_fetch_add_explicit(&g->c->sh->hedge_pages, 1, memory_order_relaxed);
    tqkv_get_page_t pg;
    memset(&pg, 0, sizeof pg);
    pg.hash_index = gi;
    pg.layer = m.layer;
    pg.found = m.found;
    pg.tier = m.tier;
    pg.shape.num_tokens = m.num_tokens;
    pg.shape.num_kv_heads = m.num_kv_heads;
    pg.shape.head_dim = m.head_dim;
    pg.page = m.page;
    pg.page_len = m.page_len;
    pg.key = m.key;
    pg.key_len = m.key_len;
    pg.value = m.value;
    pg.value_len = m.value_len;
    pg.wire_bytes = wire_len;
    pg.target = (int)r->target;
    pg.crc_checked = crc_checked;
    pg.data_channel = via_dc;
    /* found below its primaries (not by a hedge, which races a primary that may hold it) */
    if (m.found && m.page && r->rank > 0 && !r->is_hedge && g->c->nt > 1 && crc_checked >= 0)
        tqkv__repair_offer(g->c, g->q->ns, &g->q->hashes[gi], m.layer, &pg.shape, m.page,
                           m.page_len);
    deliver(g, &pg);
    return 0;
}

/* One frame of r's TCP data channel (transport/data_frame.h), read into the scratch
 * buffer (the page 64-byte aligned) and CRC-checked while cache-hot. Returns as
 * get_message; -1 also for a read that fails or passes deadline_ns (why says which):
 * the channel is then out of step; -2 when the server closed the connection (a failed
 * Get: its status, on the way, names the reason); -3 when deadline_ns passed. */
static int
get_frame(getop_t *g, rpc_t *r, uint64_t deadline_ns, char *why, size_t whylen)
{
    uint8_t hb[TQKV_DC_FRAME_BYTES];
    tqkv_dc_frame_t f;
    tqkv__dcio_t io = {r->dc->fd, r->dc->ssl};
    if (tqkv__dcio_read(&io, hb, sizeof hb, deadline_ns) != 0) {
        int e = errno;
        snprintf(why, whylen, "reading frame %zu: %s", r->next_frame,
                 e ? strerror(e) : "connection closed by the server");
        return e == 0 || e == ECONNRESET ? -2 : e == ETIMEDOUT ? -3 : -1;
    }
    if (tqkv_dc_frame_decode(hb, &f) != 0) {
        snprintf(why, whylen, "frame %zu: not a frame header", r->next_frame);
        return -1;
    }
    int found = (f.flags & TQKV_DC_FLAG_FOUND) != 0;
    if (f.index != r->next_frame || f.layer != g->q->layer_begin + f.index / r->count ||
        (f.flags & ~TQKV_DC_FLAG_FOUND) != 0) {
        snprintf(why, whylen,
                 "frame %u (layer %u, flags %#x) where frame %zu (layer %zu, flags 0 or 0x1) "
                 "was due",
                 f.index, f.layer, f.flags, r->next_frame,
                 (size_t)g->q->layer_begin + r->next_frame / r->count);
        return -1;
    }
    if (found ? f.page_len < TQKV_PAGE_HEADER_BYTES || f.page_len > g->c->max_msg
              : f.page_len != 0) {
        if (found)
            snprintf(why, whylen,
                     "frame %u: page of %u bytes (a found page is %u, its header, to %zu, the "
                     "client's max_message_bytes)",
                     f.index, f.page_len, (unsigned)TQKV_PAGE_HEADER_BYTES, g->c->max_msg);
        else
            snprintf(why, whylen, "frame %u: page of %u bytes for a missing block", f.index,
                     f.page_len);
        return -1;
    }
    uint8_t *page = NULL;
    if (found) {
        page = scratch_get(&g->sc, f.page_len);
        if (page == NULL) {
            snprintf(why, whylen, "out of memory");
            return -1;
        }
        if (tqkv__dcio_read(&io, page, f.page_len, deadline_ns) != 0) {
            int e = errno;
            snprintf(why, whylen, "reading page %u: %s", f.index,
                     e ? strerror(e) : "connection closed by the server");
            return e == 0 || e == ECONNRESET ? -2 : e == ETIMEDOUT ? -3 : -1;
        }
    }
    r->next_frame++;
    r->frames_left--;
    get_progress(g, r, TQKV_DC_FRAME_BYTES + (size_t)f.page_len);
    tqkv__get_msg_t m;
    memset(&m, 0, sizeof m);
    m.layer = f.layer;
    m.found = found;
    m.tier = (int)f.tier;
    int crc_checked = 0;
    if (found) {
        tqkv_page_header_t h;
        memcpy(&h, page, sizeof h);
        m.page = page;
        m.page_len = f.page_len;
        m.num_tokens = h.num_tokens;
        m.num_kv_heads = h.num_kv_heads;
        m.head_dim = h.head_dim;
        crc_checked =
            h.page_bytes == f.page_len && tqkv_page_crc(page, f.page_len) == h.crc32c ? 1 : -1;
    }
    return get_deliver(g, r, r->gidx[f.index % r->count], &m, crc_checked,
                       TQKV_DC_FRAME_BYTES + (size_t)f.page_len, 1);
}

/* Cancels every call of a Get round (the callback asked to stop); data channels with
 * frames due are then out of step. */
static void
get_cancel_all(getop_t *g)
{
    for (size_t t = 0; t < g->rd.nslots; t++) {
        rpc_t *r = &g->rd.rs[t];
        if (!g->rd.started[t])
            continue;
        if (r->call && r->inflight > 0)
            tqkv__rpc_cancel(r);
        if (r->dc && r->frames_left > 0)
            r->dc_bad = 1, r->frames_left = 0;
    }
}

/* One completion of a Get round's calls (already booked by rpc_event). */
static void
get_event(getop_t *g, rpc_t *r, tag_kind_t k, tqkv_status_t *st)
{
    tqkv_client_t *c = g->c;
    if (k == TAG_RECV && r->recv_bb) {
        int bad = r->dc ? -1 : get_message(g, r); /* nothing comes on a data channel's stream */
        grpc_byte_buffer_destroy(r->recv_bb);
        r->recv_bb = NULL;
        if (r->beaten) {
            /* cancelled: what it still had in flight is not needed */
        } else if (bad) {
            if (*st == TQKV_OK && bad > 0)
                *st = tqkv__client_err(TQKV_ECORRUPT, 0,
                                       "%s: page of hash %zu layer %u failed its CRC32C check "
                                       "(not delivered; no replica left with a good copy)",
                                       c->t[g->bad_target]->name, g->bad_hash, g->bad_layer);
            else if (*st == TQKV_OK)
                *st = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: malformed GetResponse",
                                       c->t[r->target]->name);
            tqkv__rpc_cancel(r);
            if (r->dc)
                r->dc_bad = 1, r->frames_left = 0;
        } else if (g->canceled) {
            get_cancel_all(g);
        } else if (!r->recv_eof) {
            tqkv__rpc_recv(r);
        }
    }
    /* A data channel Get that failed sends no more frames (the server closed it). */
    if (r->dc && r->status_done && r->status != GRPC_STATUS_OK && r->frames_left > 0)
        r->dc_bad = 1, r->frames_left = 0;
}

static tqkv_status_t get_v(tqkv_client_t *c, const tqkv_get_req_t *q, tqkv_get_cb_t cb, void *arg);

tqkv_status_t
tqkv_client_get(tqkv_client_t *c, const tqkv_get_req_t *q, tqkv_get_cb_t cb, void *arg)
{
    if (c == NULL)
        return get_v(NULL, q, cb, arg);
    tqkv_client_t v;
    tqkv_status_t st = get_v(tqkv__view_enter(c, &v), q, cb, arg);
    tqkv__view_leave(&v);
    return st;
}

/* The request's checks before anything is sent. */
static tqkv_status_t
get_check(const tqkv_get_req_t *q, tqkv_get_cb_t cb)
{
    if (q->ns == NULL || cb == NULL || q->layer_end <= q->layer_begin)
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "get: namespace, callback and layer_end > layer_begin");
    if (q->num_hashes > 0 && q->hashes == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "get: hashes is NULL with num_hashes %zu",
                                q->num_hashes);
    for (size_t i = 0; i < q->num_hashes; i++)
        if (!tqkv__hash_ok(&q->hashes[i]))
            return tqkv__client_err(TQKV_EINVAL, 0, "get: hash %zu is not 8..64 bytes", i);
    return TQKV_OK;
}

static void
get_free(getop_t *g)
{
    tqkv__rd_free(&g->rd);
    free(g->who);
    free(g->pf);
    free(g->buffered);
    free(g->done);
    free(g->left);
    free(g->corrupt);
    free(g->sc.mem);
    free(g->sv.mem);
}

/* Unreported layers of hash i. */
static size_t
get_undone(const getop_t *g, size_t i)
{
    return g->left[i];
}

static int
get_resolved(void *op, size_t i)
{
    return get_undone(op, i) == 0;
}

/* Starts call slot sl (tqkv__rd_t) to target t for hb[from, to), over a data channel
 * where the client and the server have them (never for a hedge). */
static void
get_call_start(void *op, size_t sl, size_t t, size_t from, size_t to)
{
    getop_t *g = op;
    tqkv_client_t *c = g->c;
    const tqkv_get_req_t *q = g->q;
    Tqkv__V1__GetRequest m;
    tqkv__v1__get_request__init(&m);
    m.namespace_ = (char *)q->ns;
    m.hashes = &g->rd.hb[from];
    m.n_hashes = to - from;
    m.layer_begin = q->layer_begin;
    m.layer_end = q->layer_end;
    m.encoding = q->encoding == TQKV_CLIENT_BF16 ? TQKV__V1__ENCODING__ENCODING_BF16
                                                 : TQKV__V1__ENCODING__ENCODING_PACKED;
    rpc_t *r = &g->rd.rs[sl];
    for (size_t j = 0; j < r->count; j++)
        r->rem += get_undone(g, r->gidx[j]);
    /* its own deadline: what a call of this size should take, within the Get's */
    gpr_timespec dl;
    r->dl_ns = tqkv__call_deadline(c, (uint64_t)m.n_hashes * g->L * tqkv__page_estimate(c),
                                   g->dl_ns, &dl, &r->short_dl);
    /* Setting a channel up may take half the time left: a server that never
     * answers leaves the other half to the gRPC fallback. */
    uint64_t now_ns = tqkv_clock_ns();
    uint32_t setup_ms = now_ns < r->dl_ns ? (uint32_t)((r->dl_ns - now_ns) / 2000000u) : 0;
    if (!r->is_hedge && c->transport == TQKV_CLIENT_TRANSPORT_TCP &&
        q->encoding != TQKV_CLIENT_BF16 && setup_ms > 0 &&
        (r->dc = tqkv__dcc_acquire(c, t, setup_ms)) != NULL) {
        m.transport = TQKV__V1__TRANSPORT__TRANSPORT_TCP;
        m.channel_id = r->dc->id;
        r->frames_left = m.n_hashes * g->L;
    }
    grpc_byte_buffer *bb = tqkv_wire_encode(&m.base);
    tqkv_status_t s2 = tqkv__rpc_start(c, r, g->cq, t, M_GET, dl, bb);
    if (r->call == NULL)
        grpc_byte_buffer_destroy(bb), r->init_bb = NULL;
    if (s2 == TQKV_OK)
        tqkv__rpc_recv(r); /* a data channel Get's stream ends without messages */
    else
        r->frames_left = 0, r->dc_bad = 1, r->start_err = s2;
    g->live += r->inflight > 0;
}

/* Allocates the Get's arrays and ranks the candidates of every hash. */
static tqkv_status_t
get_alloc(getop_t *g)
{
    tqkv_status_t st = tqkv__rd_init(&g->rd);
    if (st != TQKV_OK)
        return st;
    size_t ns = g->rd.nslots;
    g->who = malloc(ns * sizeof *g->who);
    g->pf = malloc(ns * sizeof *g->pf);
    g->buffered = malloc(ns * sizeof *g->buffered);
    g->done = calloc(g->n * g->L, 1);
    g->left = malloc(g->n * sizeof *g->left);
    if (!g->who || !g->pf || !g->buffered || !g->done || !g->left)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    for (size_t i = 0; i < g->n; i++)
        g->left[i] = g->L;
    return TQKV_OK;
}

/* Starts this round's calls; the first failure to start one is the Get's. */
static void
get_round_start(getop_t *g, tqkv_status_t *st)
{
    g->cq = grpc_completion_queue_create_for_next(NULL);
    g->live = 0;
    tqkv__rd_start(&g->rd);
    for (size_t sl = 0; sl < g->rd.nslots; sl++)
        if (g->rd.started[sl] && g->rd.rs[sl].start_err != TQKV_OK && *st == TQKV_OK)
            *st = g->rd.rs[sl].start_err;
}

/* Hedges what is due (a hedge that cannot start is no failure of the Get). */
static void
get_hedge(getop_t *g)
{
    tqkv__rd_hedge(&g->rd);
}

/* Reads the frames of the data channels poll found readable (pf[0..nfd), pr of them). */
static void
get_round_frames(getop_t *g, size_t nfd, int pr, tqkv_status_t *st)
{
    tqkv_client_t *c = g->c;
    for (size_t i = 0; i < nfd && pr > 0; i++) {
        if (g->pf[i].revents == 0 || g->canceled)
            continue;
        rpc_t *r = &g->rd.rs[g->who[i]];
        if (r->dc_bad || r->frames_left == 0)
            continue; /* lost a hedge race meanwhile */
        char why[240];
        int bad = get_frame(g, r, r->dl_ns, why, sizeof why);
        if (bad == -2 && !r->status_done) {
            /* the server closed the channel: its status, still to come, says why
             * (the gRPC deadline bounds the wait); OK would not explain it */
            r->dc_bad = 1, r->frames_left = 0;
            snprintf(r->dc_eof, sizeof r->dc_eof, "%s", why);
        } else if (bad == -3 && r->short_dl) {
            /* its size deadline passed: the server's failure, not the Get's (its gRPC
             * call, with the same deadline, ends DEADLINE_EXCEEDED: get_round_finish) */
            r->dc_bad = 1, r->frames_left = 0;
        } else if (bad != 0) {
            r->dc_bad = 1;
            r->frames_left = 0;
            if (r->inflight > 0)
                tqkv__rpc_cancel(r);
            if (*st == TQKV_OK && bad > 0)
                *st = tqkv__client_err(TQKV_ECORRUPT, 0,
                                       "%s: page of hash %zu layer %u failed its CRC32C check "
                                       "(not delivered; no replica left with a good copy)",
                                       c->t[g->bad_target]->name, g->bad_hash, g->bad_layer);
            else if (*st == TQKV_OK && bad == -3)
                *st = tqkv__client_err(TQKV_ETIMEDOUT, (int)GRPC_STATUS_DEADLINE_EXCEEDED,
                                       "%s: data channel: %s", c->t[r->target]->name, why);
            else if (*st == TQKV_OK)
                *st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                                       "%s: data channel: %s", c->t[r->target]->name, why);
        } else if (g->canceled) {
            get_cancel_all(g);
        }
    }
}

/* Books one completion of the round's queue. */
static void
get_book(getop_t *g, grpc_event ev, tqkv_status_t *st)
{
    rtag_t *tg = ev.tag;
    tqkv__rpc_event(tg->r, tg->k, ev.success);
    get_event(g, tg->r, tg->k, st);
    if (tg->r->inflight == 0)
        g->live--;
}

/* Drives this round's calls until every one has ended: data channels with frames due
 * are read as they become readable; between reads the completion queue is polled
 * without waiting (statuses); calls without progress are hedged when due. */
static void
get_round_drive(getop_t *g, tqkv_status_t *st)
{
    tqkv_client_t *c = g->c;
    rpc_t *rs = g->rd.rs;
    for (;;) {
        size_t nfd = 0;
        int nbuf = 0; /* TLS records already read: poll cannot see them (buffered[]) */
        for (size_t t = 0; t < g->rd.nslots; t++)
            if (g->rd.started[t] && rs[t].dc && rs[t].frames_left > 0 && !rs[t].dc_bad) {
                tqkv__dcio_t io = {rs[t].dc->fd, rs[t].dc->ssl};
                g->pf[nfd].fd = rs[t].dc->fd;
                g->pf[nfd].events = POLLIN;
                g->pf[nfd].revents = 0;
                g->buffered[nfd] = tqkv__dcio_pending(&io);
                nbuf += g->buffered[nfd];
                g->who[nfd++] = t;
            }
        if (nfd == 0) {
            if (g->live == 0)
                break;
            uint64_t due = g->canceled ? UINT64_MAX : tqkv__rd_hedge_due(&g->rd);
            gpr_timespec until =
                due == UINT64_MAX ? gpr_inf_future(GPR_CLOCK_MONOTONIC) : tqkv__deadline_at_ns(due);
            grpc_event ev = grpc_completion_queue_next(g->cq, until, NULL);
            if (ev.type == GRPC_QUEUE_TIMEOUT)
                get_hedge(g);
            else if (ev.type == GRPC_OP_COMPLETE)
                get_book(g, ev, st);
            else
                break;
            continue;
        }
        int pr = poll(g->pf, (nfds_t)nfd, nbuf ? 0 : g->live > 0 ? 1 : 50);
        for (size_t i = 0; i < nfd && nbuf; i++)
            if (g->buffered[i]) {
                pr += g->pf[i].revents == 0;
                g->pf[i].revents |= POLLIN;
            }
        get_round_frames(g, nfd, pr, st);
        if (pr == 0 && g->live == 0 && tqkv_clock_ns() >= g->dl_ns) {
            for (size_t i = 0; i < nfd; i++)
                rs[g->who[i]].dc_bad = 1, rs[g->who[i]].frames_left = 0;
            if (*st == TQKV_OK)
                *st = tqkv__client_err(TQKV_ETIMEDOUT, (int)GRPC_STATUS_DEADLINE_EXCEEDED,
                                       "%s: data channel: deadline passed with frames still due",
                                       c->t[rs[g->who[0]].target]->name);
        }
        while (g->live > 0) {
            grpc_event ev =
                grpc_completion_queue_next(g->cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
            if (ev.type != GRPC_OP_COMPLETE)
                break;
            get_book(g, ev, st);
        }
        if (!g->canceled)
            get_hedge(g);
    }
}

/* The statuses of this round's calls (the first failure wins), data channels back to
 * the pool (reused when in step), the calls freed. A call that lost a hedge race is
 * neither; one that passed its size deadline is its server's failure (its blocks are
 * asked of the next candidate), not the Get's. */
static void
get_round_finish(getop_t *g, tqkv_status_t *st)
{
    tqkv_client_t *c = g->c;
    rpc_t *rs = g->rd.rs;
    for (size_t sl = 0; sl < g->rd.nslots; sl++) {
        if (!g->rd.started[sl])
            continue;
        size_t t = rs[sl].target;
        if (rs[sl].call && !g->canceled && !rs[sl].beaten) {
            /* rpc_result records the call's status in the thread's error (a call
             * cancelled above for a bad page reads CANCELLED): the caller reads the
             * error of the status returned, the first failure */
            tqkv_client_error_t first = tqkv__client_last_err;
            tqkv_status_t s2 = tqkv__rpc_result(c, &rs[sl]);
            int slow = s2 == TQKV_ETIMEDOUT && rs[sl].short_dl;
            if (slow)
                atomic_fetch_add_explicit(&c->sh->call_timeouts, 1, memory_order_relaxed);
            if (s2 != TQKV_OK && *st == TQKV_OK && !(c->nt > 1 && s2 == TQKV_EUNAVAILABLE) &&
                !slow && !rs[sl].is_hedge) {
                *st = s2;
                if (s2 == TQKV_ETIMEDOUT && rs[sl].dc_eof[0]) {
                    /* no status came to say why the server closed the channel */
                    size_t ml = strlen(tqkv__client_last_err.message);
                    snprintf(tqkv__client_last_err.message + ml,
                             sizeof tqkv__client_last_err.message - ml,
                             " (data channel closed first: %s)", rs[sl].dc_eof);
                }
            } else if (*st != TQKV_OK || slow || rs[sl].is_hedge) {
                tqkv__client_last_err = first;
            }
            if (s2 != TQKV_OK)
                rs[sl].dc_bad = 1;
            if (s2 == TQKV_OK && rs[sl].dc_eof[0] && *st == TQKV_OK)
                *st = tqkv__client_err(TQKV_EUNAVAILABLE, (int)GRPC_STATUS_UNAVAILABLE,
                                       "%s: data channel: %s", c->t[t]->name, rs[sl].dc_eof);
        }
        if (rs[sl].dc && rs[sl].frames_left > 0 && *st == TQKV_OK && !g->canceled && !rs[sl].beaten)
            *st = tqkv__client_err(TQKV_EINTERNAL, 0, "%s: data channel: %zu frames missing",
                                   c->t[t]->name, rs[sl].frames_left);
        tqkv__dcc_release(c, t, rs[sl].dc,
                          !rs[sl].dc_bad && rs[sl].frames_left == 0 && !g->canceled &&
                              !rs[sl].beaten && rs[sl].status_done &&
                              rs[sl].status == GRPC_STATUS_OK);
        rs[sl].dc = NULL;
        tqkv__rpc_fini(&rs[sl]);
    }
    tqkv__cq_destroy(g->cq);
    g->cq = NULL;
}

/* After the last round: pages whose copies all failed their CRC fail the Get; what no
 * candidate had is reported missing, in layer-major order. */
static tqkv_status_t
get_finish(getop_t *g, tqkv_status_t st)
{
    tqkv_client_t *c = g->c;
    const tqkv_get_req_t *q = g->q;
    size_t n = g->n;
    if (g->canceled) {
        st = tqkv__client_err(TQKV_ECANCELED, (int)GRPC_STATUS_CANCELLED,
                              "get: canceled by callback");
    } else if (st == TQKV_OK) {
        /* A page whose copies failed their CRC and whose later candidates were down. */
        for (size_t i = 0; i < n * g->L && st == TQKV_OK; i++)
            if (!g->done[i] && g->corrupt && g->corrupt[i])
                st = tqkv__client_err(TQKV_ECORRUPT, 0,
                                      "%s: page of hash %zu layer %u failed its CRC32C check (not "
                                      "delivered; no replica left with a good copy)",
                                      c->t[g->corrupt[i] - 1u]->name, i / g->L,
                                      q->layer_begin + (uint32_t)(i % g->L));
    }
    if (st == TQKV_OK && !g->canceled) {
        /* What no candidate had, in layer-major order. */
        for (size_t l = 0; l < g->L && !g->canceled; l++) {
            for (size_t i = 0; i < n && !g->canceled; i++) {
                if (g->done[i * g->L + l])
                    continue;
                tqkv_get_page_t pg;
                memset(&pg, 0, sizeof pg);
                pg.hash_index = i;
                pg.layer = q->layer_begin + (uint32_t)l;
                pg.target = -1;
                g->done[i * g->L + l] = 1;
                deliver(g, &pg);
            }
        }
        if (g->canceled)
            st = tqkv__client_err(TQKV_ECANCELED, (int)GRPC_STATUS_CANCELLED,
                                  "get: canceled by callback");
    }
    return st;
}

static tqkv_status_t
get_v(tqkv_client_t *c, const tqkv_get_req_t *q, tqkv_get_cb_t cb, void *arg)
{
    getop_t g;
    tqkv_status_t st = TQKV_OK;
    memset(&g, 0, sizeof g);
    if (c == NULL || q == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "get: client and request required");
    if ((st = get_check(q, cb)) != TQKV_OK)
        return st;
    if (q->num_hashes == 0)
        return TQKV_OK;
    g.c = c;
    g.q = q;
    g.cb = cb;
    g.arg = arg;
    g.n = q->num_hashes;
    g.L = q->layer_end - q->layer_begin;
    uint32_t op_ms = q->deadline_ms ? q->deadline_ms : c->deadline_ms;
    g.dl_ns = tqkv_clock_ns() + (uint64_t)op_ms * 1000000ull;
    g.rd = (tqkv__rd_t){.c = c,
                        .ns = q->ns,
                        .hashes = q->hashes,
                        .n = g.n,
                        .op = &g,
                        .resolved = get_resolved,
                        .start_call = get_call_start};
    if ((st = get_alloc(&g)) == TQKV_OK) {
        for (g.rd.round = 0; g.rd.round < g.rd.nc && st == TQKV_OK && !g.canceled; g.rd.round++) {
            tqkv__rd_plan(&g.rd);
            get_round_start(&g, &st);
            get_round_drive(&g, &st);
            get_round_finish(&g, &st);
        }
        st = get_finish(&g, st);
    }
    get_free(&g);
    return st;
}
