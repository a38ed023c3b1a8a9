/* wire.h - protobuf-c messages <-> grpc byte buffers, shared by server and client.
 *
 * Messages arrive in many slices (a 1 MiB message in 17-129), so decoding reads the
 * buffer whole; a single-slice buffer is parsed in place without a copy.
 */
#ifndef TQKV_TRANSPORT_WIRE_H
#define TQKV_TRANSPORT_WIRE_H

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

/* Packs m into a new byte buffer (one copy). Returns new (caller destroys), or NULL. */
grpc_byte_buffer *tqkv_wire_encode(const ProtobufCMessage *m);

/* Unpacks bb as descriptor d. Returns new (free with protobuf_c_message_free_unpacked
 * and NULL allocator), or NULL when the bytes are not a valid message. Borrows bb. */
ProtobufCMessage *tqkv_wire_decode(const ProtobufCMessageDescriptor *d, grpc_byte_buffer *bb);

/* ---- GetResponse on the wire, written and read by hand ----
 * The server writes the fields of a GetResponse before the page bytes itself
 * (service/handlers_get.c) and libtqkv reads them in place (transport/client_get.c):
 * both take the field numbers and tags from this one table of tqkv.v1.GetResponse
 * (proto/tqkv/v1/kvcache.proto), which check_wire tests against protobuf-c's
 * descriptor. X(NAME, proto field name, number, wire type). */
#define TQKV_WIRE_VARINT 0u
#define TQKV_WIRE_I64 1u
#define TQKV_WIRE_LEN 2u
#define TQKV_WIRE_I32 5u

#define TQKV_GET_RESPONSE_FIELDS(X)                                                                \
    X(HASH, hash, 1, LEN)                                                                          \
    X(LAYER, layer, 2, VARINT)                                                                     \
    X(FOUND, found, 3, VARINT)                                                                     \
    X(PAGE, page, 4, LEN)                                                                          \
    X(KEY, key, 5, LEN)                                                                            \
    X(VALUE, value, 6, LEN)                                                                        \
    X(NUM_TOKENS, num_tokens, 7, VARINT)                                                           \
    X(NUM_KV_HEADS, num_kv_heads, 8, VARINT)                                                       \
    X(HEAD_DIM, head_dim, 9, VARINT)                                                               \
    X(TIER, tier, 10, VARINT)                                                                      \
    X(NCCL_BYTES, nccl_bytes, 11, VARINT)

/* TQKV_GET_F_<NAME>: the field number; TQKV_GET_TAG_<NAME>: its key byte (numbers
 * 1..15 take one byte). */
enum {
#define TQKV__GET_FIELD_ENUM(N, name, num, wt)                                                     \
    TQKV_GET_F_##N = (num), TQKV_GET_TAG_##N = ((num) << 3) | TQKV_WIRE_##wt,
    TQKV_GET_RESPONSE_FIELDS(TQKV__GET_FIELD_ENUM)
#undef TQKV__GET_FIELD_ENUM
};

#endif
