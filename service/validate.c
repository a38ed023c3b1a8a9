/* validate.c - decode-and-validate of every request (see validate.h). Pure
 * functions of the bytes and the limits: no server state, no allocation besides the
 * unpacked message, so the fuzz targets call them directly.
 */
#include "service/validate.h"

#include <stdio.h>
#include <string.h>

#include "kernels/errtext.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"
#include "kernels/varint.h"

#define HASH_MIN 8u
#define HASH_MAX 64u
#define LEASE_MAX_MS 3600000u

void
tqkv_limits_default(tqkv_limits_t *l)
{
    l->max_message_bytes = 64ull << 20;
    l->max_hashes = 65536;
    l->max_layers = 1024;
    l->max_tokens = 65536;
    l->max_namespace_bytes = 256;
}

static tqkv_status_t
check_size(size_t len, const tqkv_limits_t *lim, char *err, size_t errlen)
{
    if (len > lim->max_message_bytes)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "message: %zu bytes exceeds the limit of %llu", len,
                            (unsigned long long)lim->max_message_bytes);
    return TQKV_OK;
}

static tqkv_status_t
check_namespace(const char *ns, int may_be_empty, const tqkv_limits_t *lim, char *err,
                size_t errlen)
{
    size_t n = ns ? strlen(ns) : 0;
    if (n == 0) {
        if (may_be_empty)
            return TQKV_OK;
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "namespace: empty");
    }
    if (n > lim->max_namespace_bytes)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "namespace: %zu bytes exceeds the limit of %u", n,
                            lim->max_namespace_bytes);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)ns[i];
        if (c < 0x21 || c > 0x7e)
            return tqkv_errtext(TQKV_EINVAL, err, errlen,
                                "namespace: byte %zu (0x%02x) is not a printable ASCII character",
                                i, c);
    }
    return TQKV_OK;
}

/* protobuf-c unpacks a string into a NUL-terminated copy, so a namespace sent with an
 * embedded NUL ("a\0b") would silently become its prefix ("a"). The wire length of the
 * last top-level field 1 (every request's namespace; protobuf-c keeps the last) must
 * equal strlen. buf already unpacked, so it is well formed; any surprise skips the check. */
static tqkv_status_t
check_namespace_wire(const uint8_t *buf, size_t len, const char *ns, char *err, size_t errlen)
{
    size_t n = ns ? strlen(ns) : 0;
    uint64_t key, v, wire_len = n;
    const uint8_t *p = buf, *end = buf + len;
    while (p < end) {
        if (tqkv_varint_get(&p, end, &key) != 0)
            return TQKV_OK;
        switch (key & 7) {
        case 0:
            if (tqkv_varint_get(&p, end, &v) != 0)
                return TQKV_OK;
            break;
        case 1:
        case 5:
            v = (key & 7) == 1 ? 8 : 4;
            if (v > (uint64_t)(end - p))
                return TQKV_OK;
            p += v;
            break;
        case 2:
            if (tqkv_varint_get(&p, end, &v) != 0 || v > (uint64_t)(end - p))
                return TQKV_OK;
            if ((key >> 3) == 1)
                wire_len = v;
            p += (size_t)v;
            break;
        default:
            return TQKV_OK;
        }
    }
    if (wire_len != n)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "namespace: byte %zu (0x00) is not a printable ASCII character", n);
    return TQKV_OK;
}

static tqkv_status_t
check_hash(const ProtobufCBinaryData *h, const char *field, char *err, size_t errlen)
{
    if (h->len == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: empty (8..64 bytes required)", field);
    if (h->len < HASH_MIN || h->len > HASH_MAX)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "%s: %zu bytes (8..64 required)", field,
                            h->len);
    return TQKV_OK;
}

static tqkv_status_t
check_hash_list(size_t n, const ProtobufCBinaryData *hashes, const tqkv_limits_t *lim, char *err,
                size_t errlen)
{
    char field[32];
    if (n == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "hashes: empty");
    if (n > lim->max_hashes)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "hashes: %zu exceeds the limit of %u", n,
                            lim->max_hashes);
    for (size_t i = 0; i < n; i++) {
        snprintf(field, sizeof field, "hashes[%zu]", i);
        tqkv_status_t st = check_hash(&hashes[i], field, err, errlen);
        if (st != TQKV_OK)
            return st;
    }
    return TQKV_OK;
}

static tqkv_status_t
check_bits(float bits, const char *field, char *err, size_t errlen)
{
    uint8_t b2;
    if (bits == 0.0f)
        return TQKV_OK;
    if (!(bits == bits) || tqkv_bits_from_float(bits, &b2) != TQKV_OK)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen,
                            "%s: %.9g is not a supported bit width (1, 1.5, 2, 2.5, 3, 3.5, 4)",
                            field, (double)bits);
    return TQKV_OK;
}

static tqkv_status_t
check_mode(int mode, const char *field, char *err, size_t errlen)
{
    if (mode < TQKV__V1__MODE__MODE_DEFAULT || mode > TQKV__V1__MODE__MODE_LOSSLESS)
        return tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "%s: unknown mode %d", field, mode);
    return TQKV_OK;
}

/* A lossless tensor stores BF16 as it came: a bit width with it is a contradiction. */
static tqkv_status_t
check_lossless(float bits, int mode, const char *tensor, char *err, size_t errlen)
{
    if (mode == TQKV__V1__MODE__MODE_LOSSLESS && bits != 0.0f)
        return tqkv_errtext(
            TQKV_EINVAL, err, errlen,
            "codec.%s_bits: %.9g with codec.%s_mode MODE_LOSSLESS (a lossless tensor is "
            "stored as BF16 and takes no bit width: leave %s_bits 0)",
            tensor, (double)bits, tensor, tensor);
    return TQKV_OK;
}

/* One tensor of the override onto a policy's middle and boundary settings. */
static void
override_tensor(float bits, int mode, tqkv_tensor_codec_t *mid, tqkv_tensor_codec_t *bnd)
{
    tqkv_tensor_codec_t *t[2] = {mid, bnd};
    uint8_t b2 = 0;
    if (bits != 0.0f && tqkv_bits_from_float(bits, &b2) != TQKV_OK)
        b2 = 0;
    for (int i = 0; i < 2; i++) {
        if (mode == TQKV__V1__MODE__MODE_LOSSLESS)
            t[i]->mode = TQKV_MODE_RAW;
        else if (mode == TQKV__V1__MODE__MODE_MSE)
            t[i]->mode = TQKV_MODE_MSE;
        else if (mode == TQKV__V1__MODE__MODE_PROD)
            t[i]->mode = TQKV_MODE_PROD;
        else if (b2 && t[i]->mode == TQKV_MODE_RAW)
            t[i]->mode = TQKV_MODE_MSE; /* bits on a lossless tensor: lossy again */
        if (b2)
            t[i]->bits_x2 = b2;
    }
}

void
tqkv_codec_override(const Tqkv__V1__Codec *c, tqkv_policy_t *p)
{
    if (!c)
        return;
    override_tensor(c->key_bits, (int)c->key_mode, &p->k, &p->k_boundary);
    override_tensor(c->value_bits, (int)c->value_mode, &p->v, &p->v_boundary);
}

/* Index of the first NaN/Inf BF16 value, or n when all finite. */
static size_t
first_nonfinite(const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(b[2 * i] | (b[2 * i + 1] << 8));
        if (tqkv_bf16_is_nonfinite(h))
            return i;
    }
    return n;
}

static tqkv_status_t
validate_put(const Tqkv__V1__PutRequest *m, size_t len, const tqkv_limits_t *lim, char *err,
             size_t errlen)
{
    tqkv_status_t st;
    if ((st = check_namespace(m->namespace_, 0, lim, err, errlen)) != TQKV_OK)
        return st;
    if ((st = check_hash(&m->hash, "hash", err, errlen)) != TQKV_OK)
        return st;
    if (m->parent_hash.len != 0 &&
        (st = check_hash(&m->parent_hash, "parent_hash", err, errlen)) != TQKV_OK)
        return st;
    if (m->layer >= lim->max_layers)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "layer: %u exceeds the limit of %u", m->layer,
                            lim->max_layers - 1);
    if (m->num_layers != 0 && m->layer >= m->num_layers)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "layer: %u is not below num_layers %u",
                            m->layer, m->num_layers);
    if (m->num_layers > lim->max_layers)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "num_layers: %u exceeds the limit of %u",
                            m->num_layers, lim->max_layers);
    if (m->key.len == 0 && m->value.len == 0 && m->page.len == 0)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "key: missing (send key and value, or page)");
    if (m->num_tokens == 0 || m->num_tokens > lim->max_tokens ||
        m->num_tokens > TQKV_PAGE_MAX_TOKENS)
        return tqkv_errtext(
            TQKV_EINVAL, err, errlen, "num_tokens: %u out of range [1, %u]%s", m->num_tokens,
            lim->max_tokens < TQKV_PAGE_MAX_TOKENS ? lim->max_tokens : TQKV_PAGE_MAX_TOKENS,
            m->page.len != 0 ? " (a page Put also sets num_tokens, num_kv_heads and "
                               "head_dim to the page's shape)"
                             : "");
    if (m->num_kv_heads == 0 || m->num_kv_heads > TQKV_PAGE_MAX_HEADS)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "num_kv_heads: %u out of range [1, %u]",
                            m->num_kv_heads, TQKV_PAGE_MAX_HEADS);
    if (m->head_dim < TQKV_PAGE_MIN_DIM || m->head_dim > TQKV_PAGE_MAX_DIM)
        return tqkv_errtext(TQKV_EINVAL, err, errlen, "head_dim: %u out of range [%u, %u]",
                            m->head_dim, TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM);
    if (m->codec) {
        if ((st = check_bits(m->codec->key_bits, "codec.key_bits", err, errlen)) != TQKV_OK ||
            (st = check_bits(m->codec->value_bits, "codec.value_bits", err, errlen)) != TQKV_OK ||
            (st = check_mode((int)m->codec->key_mode, "codec.key_mode", err, errlen)) != TQKV_OK ||
            (st = check_mode((int)m->codec->value_mode, "codec.value_mode", err, errlen)) !=
                TQKV_OK ||
            (st = check_lossless(m->codec->key_bits, (int)m->codec->key_mode, "key", err,
                                 errlen)) != TQKV_OK ||
            (st = check_lossless(m->codec->value_bits, (int)m->codec->value_mode, "value", err,
                                 errlen)) != TQKV_OK)
            return st;
    }

    if (m->page.len != 0) {
        tqkv_page_info_t info;
        char why[200];
        if (m->key.len != 0 || m->value.len != 0)
            return tqkv_errtext(TQKV_EINVAL, err, errlen,
                                "page: set together with key/value (send one or the other)");
        st = tqkv_page_validate(m->page.data, m->page.len, 1, &info, why, sizeof why);
        if (st != TQKV_OK)
            return tqkv_errtext(st, err, errlen, "page: %s", why);
        if (info.page_bytes != m->page.len)
            return tqkv_errtext(TQKV_EFORMAT, err, errlen,
                                "page: %zu bytes but the header says %zu", m->page.len,
                                info.page_bytes);
        if (info.shape.num_tokens != m->num_tokens || info.shape.num_kv_heads != m->num_kv_heads ||
            info.shape.head_dim != m->head_dim)
            return tqkv_errtext(
                TQKV_EINVAL, err, errlen,
                "page: shape [%u][%u][%u] does not match num_tokens/num_kv_heads/head_dim "
                "[%u][%u][%u]",
                info.shape.num_tokens, info.shape.num_kv_heads, info.shape.head_dim, m->num_tokens,
                m->num_kv_heads, m->head_dim);
        /* A block is K and V: a page of one tensor (tqkv-codec encode) would be stored,
         * counted by Lookup, and then refused by decode-kv and attention. */
        if (info.codec.k.bits_x2 == 0 || info.codec.v.bits_x2 == 0)
            return tqkv_errtext(
                TQKV_EINVAL, err, errlen,
                "page: holds no %s (a block page needs K and V: tqkv-codec encode-kv)",
                info.codec.k.bits_x2 == 0 ? "keys" : "values");
        return TQKV_OK;
    }

    uint64_t elems = (uint64_t)m->num_tokens * m->num_kv_heads * m->head_dim;
    uint64_t want = elems * 2;
    if (m->key.len != want)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "key: %zu bytes, expected %llu for BF16 [%u][%u][%u]", m->key.len,
                            (unsigned long long)want, m->num_tokens, m->num_kv_heads, m->head_dim);
    if (m->value.len != want)
        return tqkv_errtext(TQKV_EINVAL, err, errlen,
                            "value: %zu bytes, expected %llu for BF16 [%u][%u][%u]", m->value.len,
                            (unsigned long long)want, m->num_tokens, m->num_kv_heads, m->head_dim);
    size_t bad = first_nonfinite(m->key.data, (size_t)elems);
    if (bad != elems)
        return tqkv_errtext(TQKV_ERANGE, err, errlen, "key: element %zu is NaN or Inf", bad);
    bad = first_nonfinite(m->value.data, (size_t)elems);
    if (bad != elems)
        return tqkv_errtext(TQKV_ERANGE, err, errlen, "value: element %zu is NaN or Inf", bad);
    (void)len;
    return TQKV_OK;
}

#define UNPACK_OR_FAIL(type, fn, what)                                                             \
    do {                                                                                           \
        tqkv_status_t st_ = check_size(len, lim, err, errlen);                                     \
        if (st_ != TQKV_OK)                                                                        \
            return st_;                                                                            \
        msg = fn(NULL, len, buf);                                                                  \
        if (msg == NULL)                                                                           \
            return tqkv_errtext(TQKV_EINVAL, err, errlen,                                          \
                                "message: %zu bytes are not a valid " what " protobuf", len);      \
    } while (0)

tqkv_status_t
tqkv_validate_put(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                  Tqkv__V1__PutRequest **out, char *err, size_t errlen)
{
    Tqkv__V1__PutRequest *msg;
    UNPACK_OR_FAIL(Tqkv__V1__PutRequest, tqkv__v1__put_request__unpack, "PutRequest");
    tqkv_status_t st = validate_put(msg, len, lim, err, errlen);
    if (st == TQKV_OK)
        st = check_namespace_wire(buf, len, msg->namespace_, err, errlen);
    if (st != TQKV_OK) {
        tqkv__v1__put_request__free_unpacked(msg, NULL);
        return st;
    }
    *out = msg;
    return TQKV_OK;
}

tqkv_status_t
tqkv_validate_lookup(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                     Tqkv__V1__LookupRequest **out, char *err, size_t errlen)
{
    Tqkv__V1__LookupRequest *msg;
    tqkv_status_t st;
    UNPACK_OR_FAIL(Tqkv__V1__LookupRequest, tqkv__v1__lookup_request__unpack, "LookupRequest");
    if ((st = check_namespace(msg->namespace_, 0, lim, err, errlen)) != TQKV_OK ||
        (st = check_namespace_wire(buf, len, msg->namespace_, err, errlen)) != TQKV_OK ||
        (st = check_hash_list(msg->n_hashes, msg->hashes, lim, err, errlen)) != TQKV_OK)
        goto bad;
    if (msg->num_layers == 0 || msg->num_layers > lim->max_layers) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "num_layers: %u out of range [1, %u]",
                          msg->num_layers, lim->max_layers);
        goto bad;
    }
    if (msg->lease_ms > LEASE_MAX_MS) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "lease_ms: %u exceeds the limit of %u",
                          msg->lease_ms, LEASE_MAX_MS);
        goto bad;
    }
    *out = msg;
    return TQKV_OK;
bad:
    tqkv__v1__lookup_request__free_unpacked(msg, NULL);
    return st;
}

tqkv_status_t
tqkv_validate_get(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                  Tqkv__V1__GetRequest **out, char *err, size_t errlen)
{
    Tqkv__V1__GetRequest *msg;
    tqkv_status_t st;
    UNPACK_OR_FAIL(Tqkv__V1__GetRequest, tqkv__v1__get_request__unpack, "GetRequest");
    if ((st = check_namespace(msg->namespace_, 0, lim, err, errlen)) != TQKV_OK ||
        (st = check_namespace_wire(buf, len, msg->namespace_, err, errlen)) != TQKV_OK ||
        (st = check_hash_list(msg->n_hashes, msg->hashes, lim, err, errlen)) != TQKV_OK)
        goto bad;
    if (msg->layer_end <= msg->layer_begin) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen,
                          "layer_end: %u must be greater than layer_begin %u", msg->layer_end,
                          msg->layer_begin);
        goto bad;
    }
    if (msg->layer_end > lim->max_layers) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen, "layer_end: %u exceeds the limit of %u",
                          msg->layer_end, lim->max_layers);
        goto bad;
    }
    if ((int)msg->encoding != TQKV__V1__ENCODING__ENCODING_PACKED &&
        (int)msg->encoding != TQKV__V1__ENCODING__ENCODING_BF16) {
        st = tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "encoding: unknown value %d",
                          (int)msg->encoding);
        goto bad;
    }
    if ((int)msg->transport != TQKV__V1__TRANSPORT__TRANSPORT_GRPC &&
        (int)msg->transport != TQKV__V1__TRANSPORT__TRANSPORT_NCCL &&
        (int)msg->transport != TQKV__V1__TRANSPORT__TRANSPORT_TCP) {
        st = tqkv_errtext(TQKV_EUNSUPPORTED, err, errlen, "transport: unknown value %d",
                          (int)msg->transport);
        goto bad;
    }
    *out = msg;
    return TQKV_OK;
bad:
    tqkv__v1__get_request__free_unpacked(msg, NULL);
    return st;
}

tqkv_status_t
tqkv_validate_delete(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                     Tqkv__V1__DeleteRequest **out, char *err, size_t errlen)
{
    Tqkv__V1__DeleteRequest *msg;
    tqkv_status_t st;
    UNPACK_OR_FAIL(Tqkv__V1__DeleteRequest, tqkv__v1__delete_request__unpack, "DeleteRequest");
    if ((st = check_namespace(msg->namespace_, 0, lim, err, errlen)) != TQKV_OK ||
        (st = check_namespace_wire(buf, len, msg->namespace_, err, errlen)) != TQKV_OK)
        goto bad;
    if (msg->all) {
        if (msg->n_hashes != 0) {
            st = tqkv_errtext(TQKV_EINVAL, err, errlen, "hashes: must be empty when all is set");
            goto bad;
        }
    } else if (msg->n_hashes == 0) {
        st = tqkv_errtext(TQKV_EINVAL, err, errlen,
                          "hashes: empty (list hashes, or set all to delete the namespace)");
        goto bad;
    } else if ((st = check_hash_list(msg->n_hashes, msg->hashes, lim, err, errlen)) != TQKV_OK) {
        goto bad;
    }
    *out = msg;
    return TQKV_OK;
bad:
    tqkv__v1__delete_request__free_unpacked(msg, NULL);
    return st;
}

tqkv_status_t
tqkv_validate_stats(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                    Tqkv__V1__StatsRequest **out, char *err, size_t errlen)
{
    Tqkv__V1__StatsRequest *msg;
    tqkv_status_t st;
    UNPACK_OR_FAIL(Tqkv__V1__StatsRequest, tqkv__v1__stats_request__unpack, "StatsRequest");
    if ((st = check_namespace(msg->namespace_, 1, lim, err, errlen)) != TQKV_OK ||
        (st = check_namespace_wire(buf, len, msg->namespace_, err, errlen)) != TQKV_OK) {
        tqkv__v1__stats_request__free_unpacked(msg, NULL);
        return st;
    }
    *out = msg;
    return TQKV_OK;
}
