/* data_channel.h - libtqkv's side of TCP data channels (transport/data_frame.h):
 * connecting a channel and reading its bytes. The channel pool and Get over a channel
 * are in client_dc.c and client_get.c.
 */
#ifndef TQKV_TRANSPORT_DATA_CHANNEL_H
#define TQKV_TRANSPORT_DATA_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "transport/data_frame.h"
#include "transport/dc_tls.h"

/* The host part of a gRPC target ("host:port", "[v6]:port", "dns:///host:port",
 * "ipv4:a.b.c.d:port", "ipv6:[::1]:port") into host (brackets removed). Returns 0, or
 * -1 for targets without a TCP host (unix: sockets) or too long. */
int tqkv__dcc_target_host(const char *target, char *host, size_t cap);

/* Connects to host:port, runs the TLS handshake when tls is set (the server's
 * certificate checked for tls_name, or host when NULL), sends the hello of channel id
 * and reads the ack, all within timeout_ms. Returns 0 with *out connected (out->ssl
 * NULL for plain TCP), or -1 with err set. Frames are then read with tqkv__dcio_read. */
int tqkv__dcc_connect(const char *host, uint32_t port, uint64_t id,
                      const uint8_t secret[TQKV_DC_SECRET_BYTES], uint32_t timeout_ms, SSL_CTX *tls,
                      const char *tls_name, tqkv__dcio_t *out, char *err, size_t errlen);

#endif
