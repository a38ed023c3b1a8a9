/* tls_pair.h - tqkv-bench's TLS baselines: a raw TLS 1.3 pair over loopback with the
 * cipher the data channels use, and the cipher's own speed (openssl speed -evp). */
#ifndef TQKV_BENCH_TLS_PAIR_H
#define TQKV_BENCH_TLS_PAIR_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* Streams total bytes in msg-byte writes over conns TLS connections at once (an
 * ephemeral self-signed P-256 certificate, the data channels' TLS settings of
 * transport/dc_tls.c, so the same suite: TLS_AES_128_GCM_SHA256 on AES-NI), src walked
 * cyclically, with OpenSSL's own record layer (SSL_write, SSL_read with read-ahead):
 * what TLS costs an application using OpenSSL as it comes. Returns the aggregate GB/s
 * of plaintext moved, or 0 on a failure; the negotiated suite goes to cipher (cap
 * bytes). */
double tqkv_bench_tls_pair(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns,
                           char *cipher, size_t cap);

/* The same pair with the data channels' own record layer (kTLS or userspace records,
 * dc_tls.h): raw TCP plus the cipher, the ceiling of the channel. */
double tqkv_bench_tls_pair_channel_layer(size_t total, size_t msg, const uint8_t *src,
                                         size_t src_len, int conns, char *cipher, size_t cap);

/* Runs recv_fn and send_fn on each of the n contexts at ctx, ctx + size, ... (2n
 * threads, their ids in th) and joins them all; returns the seconds that took. The raw
 * TCP and both TLS pairs time their transfers with it. */
double tqkv_bench_run_pairs(int n, void *(*recv_fn)(void *), void *(*send_fn)(void *), void *ctx,
                            size_t size, pthread_t *th);

/* The cipher's speed on this machine: `openssl speed -evp aes-128-gcm` at 16 KiB
 * blocks (the TLS record size) for about `seconds`, in GB/s; 0 when openssl is missing. */
double tqkv_bench_cipher_speed(const char *evp_name, int seconds);

#endif
