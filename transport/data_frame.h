/* data_frame.h - the TCP data channel's byte formats, shared by tqkv-server
 * (service/dc_server.c) and libtqkv (transport/data_channel.c). All integers
 * little-endian. docs/design.md, "TCP data channel", is the contract.
 *
 * A client opens a channel with OpenChannel(transport = TRANSPORT_TCP) over gRPC and
 * gets channel_id, a 16-byte channel_secret and data_port. It connects to data_port on
 * the host it reaches gRPC on and sends a hello; the server answers with an ack:
 *
 *   hello (32 bytes, client -> server): "TQKH" | u32 version (1) | u64 channel_id |
 *                                       secret[16]
 *   ack   (8 bytes, server -> client):  "TQKA" | u32 status (TQKV_DC_ACK_*)
 *
 * A Get with transport = TRANSPORT_TCP and that channel_id then carries no messages on
 * its gRPC stream: for each (layer, hash) in layer-major order the server writes one
 * frame on the channel, and sends the call's status after the last frame. A failure
 * after the first frame closes the channel (the status says why).
 *
 *   frame (24-byte header, server -> client): "TQKF" | u32 index (position in
 *          layer-major order: layer = layer_begin + index / n_hashes, hash = index %
 *          n_hashes) | u32 layer | u32 flags (bit 0: found) | u32 tier | u32 page_len,
 *          then page_len bytes: the packed page (proto/PAGE_FORMAT.md), 0 when missing.
 */
#ifndef TQKV_TRANSPORT_DATA_FRAME_H
#define TQKV_TRANSPORT_DATA_FRAME_H

#include <stdint.h>
#include <string.h>

#define TQKV_DC_VERSION 1u
#define TQKV_DC_SECRET_BYTES 16
#define TQKV_DC_HELLO_BYTES 32
#define TQKV_DC_ACK_BYTES 8
#define TQKV_DC_FRAME_BYTES 24
#define TQKV_DC_FLAG_FOUND 1u

/* ack status */
#define TQKV_DC_ACK_OK 0u
#define TQKV_DC_ACK_UNKNOWN 1u  /* no such channel, or the secret does not match */
#define TQKV_DC_ACK_ATTACHED 2u /* the channel already has a connection */
#define TQKV_DC_ACK_BAD 3u      /* malformed hello or unsupported version */

typedef struct tqkv_dc_frame {
    uint32_t index, layer, flags, tier, page_len;
} tqkv_dc_frame_t;

static inline void
tqkv_dc_put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16),
    p[3] = (uint8_t)(v >> 24);
}

static inline uint32_t
tqkv_dc_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void
tqkv_dc_hello_encode(uint8_t out[TQKV_DC_HELLO_BYTES], uint64_t id,
                     const uint8_t secret[TQKV_DC_SECRET_BYTES])
{
    memcpy(out, "TQKH", 4);
    tqkv_dc_put32(out + 4, TQKV_DC_VERSION);
    tqkv_dc_put32(out + 8, (uint32_t)id);
    tqkv_dc_put32(out + 12, (uint32_t)(id >> 32));
    memcpy(out + 16, secret, TQKV_DC_SECRET_BYTES);
}

/* Returns 0 and the id/secret of a version-1 hello, -1 for anything else. */
static inline int
tqkv_dc_hello_decode(const uint8_t in[TQKV_DC_HELLO_BYTES], uint64_t *id,
                     uint8_t secret[TQKV_DC_SECRET_BYTES])
{
    if (memcmp(in, "TQKH", 4) != 0 || tqkv_dc_get32(in + 4) != TQKV_DC_VERSION)
        return -1;
    *id = (uint64_t)tqkv_dc_get32(in + 8) | (uint64_t)tqkv_dc_get32(in + 12) << 32;
    memcpy(secret, in + 16, TQKV_DC_SECRET_BYTES);
    return 0;
}

static inline void
tqkv_dc_ack_encode(uint8_t out[TQKV_DC_ACK_BYTES], uint32_t status)
{
    memcpy(out, "TQKA", 4);
    tqkv_dc_put32(out + 4, status);
}

/* Returns the ack's status, or -1 when the bytes are not an ack. */
static inline int64_t
tqkv_dc_ack_decode(const uint8_t in[TQKV_DC_ACK_BYTES])
{
    return memcmp(in, "TQKA", 4) == 0 ? (int64_t)tqkv_dc_get32(in + 4) : -1;
}

static inline void
tqkv_dc_frame_encode(uint8_t out[TQKV_DC_FRAME_BYTES], const tqkv_dc_frame_t *f)
{
    memcpy(out, "TQKF", 4);
    tqkv_dc_put32(out + 4, f->index);
    tqkv_dc_put32(out + 8, f->layer);
    tqkv_dc_put32(out + 12, f->flags);
    tqkv_dc_put32(out + 16, f->tier);
    tqkv_dc_put32(out + 20, f->page_len);
}

/* Returns 0, or -1 when the bytes are not a frame header. */
static inline int
tqkv_dc_frame_decode(const uint8_t in[TQKV_DC_FRAME_BYTES], tqkv_dc_frame_t *f)
{
    if (memcmp(in, "TQKF", 4) != 0)
        return -1;
    f->index = tqkv_dc_get32(in + 4);
    f->layer = tqkv_dc_get32(in + 8);
    f->flags = tqkv_dc_get32(in + 12);
    f->tier = tqkv_dc_get32(in + 16);
    f->page_len = tqkv_dc_get32(in + 20);
    return 0;
}

#endif
