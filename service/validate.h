/* validate.h - decode-and-validate of every request: pure functions of the request
 * bytes and the limits, no server state, so they are fuzzed directly
 * (tests/fuzz/). The handlers call only these to turn wire bytes into requests.
 */
#ifndef TQKV_SERVICE_VALIDATE_H
#define TQKV_SERVICE_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/policy.h"
#include "kernels/status.h"
#include "tqkv/v1/kvcache.pb-c.h"

typedef struct tqkv_limits {
    uint64_t max_message_bytes;   /* whole message */
    uint32_t max_hashes;          /* hashes per Lookup/Get/Delete */
    uint32_t max_layers;          /* layer index bound (layer < max_layers) */
    uint32_t max_tokens;          /* tokens per block */
    uint32_t max_namespace_bytes; /* namespace length */
} tqkv_limits_t;

/* Defaults: 64 MiB messages, 65536 hashes, 1024 layers, 65536 tokens, 256-byte names. */
void tqkv_limits_default(tqkv_limits_t *l);

/* Each function unpacks buf[0..len) and checks every field. On success *out is a new
 * message (free with protobuf_c_message_free_unpacked(&(*out)->base, NULL)). On failure
 * returns TQKV_EINVAL (or TQKV_ERANGE for NaN/Inf, TQKV_EUNSUPPORTED for an unknown
 * codec) and writes a one-line reason naming the field to err. Borrows buf.
 * Put checks: namespace (non-empty, <= limit, printable), hash 8..64 bytes, parent_hash
 * empty or 8..64, shape in range, exactly one of {key+value, page}, key/value sizes ==
 * tokens*heads*dim*2, BF16 finite (ERANGE), codec override bits/modes; a page is fully
 * validated with tqkv_page_validate (CRC included) and must match the stated shape.
 * A codec mode MODE_LOSSLESS with non-zero bits for the same tensor is TQKV_EINVAL. */
tqkv_status_t tqkv_validate_put(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                                Tqkv__V1__PutRequest **out, char *err, size_t errlen);
/* Applies a validated Put's codec override (c may be NULL) to a copy of the namespace policy,
 * middle and boundary layers alike: bits replace the bit width, MODE_MSE / MODE_PROD /
 * MODE_LOSSLESS the mode; bits without a mode on a lossless tensor make it mse again (with the
 * policy's norm correction). tqkv_policy_block_codec then gives the block's codec. */
void tqkv_codec_override(const Tqkv__V1__Codec *c, tqkv_policy_t *p);

tqkv_status_t tqkv_validate_lookup(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                                   Tqkv__V1__LookupRequest **out, char *err, size_t errlen);
tqkv_status_t tqkv_validate_get(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                                Tqkv__V1__GetRequest **out, char *err, size_t errlen);
tqkv_status_t tqkv_validate_delete(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                                   Tqkv__V1__DeleteRequest **out, char *err, size_t errlen);
tqkv_status_t tqkv_validate_stats(const uint8_t *buf, size_t len, const tqkv_limits_t *lim,
                                  Tqkv__V1__StatsRequest **out, char *err, size_t errlen);

#endif
