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

/* Total payload length of a byte buffer. */
size_t tqkv_wire_length(grpc_byte_buffer *bb);

#endif
