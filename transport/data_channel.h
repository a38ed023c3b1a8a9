/* data_channel.h - libtqkv's side of TCP data channels (transport/data_frame.h):
 * connecting a channel and reading its bytes. The channel pool and Get over a channel
 * are in client_dc.c and client_get.c.
 */
#ifndef TQKV_TRANSPORT_DATA_CHANNEL_H
#define TQKV_TRANSPORT_DATA_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "transport/data_frame.h"

/* The host part of a gRPC target ("host:port", "[v6]:port", "dns:///host:port",
 * "ipv4:a.b.c.d:port", "ipv6:[::1]:port") into host (brackets removed). Returns 0, or
 * -1 for targets without a TCP host (unix: sockets) or too long. */
int tqkv__dcc_target_host(const char *target, char *host, size_t cap);

/* Connects to host:port, sends the hello of channel id and reads the ack, each step
 * within timeout_ms. Returns the connected socket, or -1 with err set. */
int tqkv__dcc_connect(const char *host, uint32_t port, uint64_t id,
                      const uint8_t secret[TQKV_DC_SECRET_BYTES], uint32_t timeout_ms, char *err,
                      size_t errlen);

/* Reads exactly n bytes, waiting at most until deadline_ns (CLOCK_MONOTONIC). Returns
 * 0, or -1: EOF (errno 0), timeout (ETIMEDOUT) or a socket error. */
int tqkv__dcc_read(int fd, void *buf, size_t n, uint64_t deadline_ns);

#endif
