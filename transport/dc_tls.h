/* dc_tls.h - TLS on TCP data channels, shared by tqkv-server and libtqkv: the contexts
 * (same certificate, key and client-CA rules as gRPC), the handshake within a deadline
 * (OpenSSL), and whole writes/reads over a connection that is either plain TCP or TLS.
 *
 * TLS 1.3 only, AES-128-GCM preferred (AES-NI + PCLMUL make it the fastest suite on
 * x86; AES-256-GCM and ChaCha20-Poly1305 stay allowed), no session tickets (a channel
 * lives for many Gets). After the handshake the records are no longer OpenSSL's:
 *  - kernel TLS (kTLS) where OpenSSL could turn it on (SSL_OP_ENABLE_KTLS; the kernel
 *    needs the "tls" TCP ULP): writes are plain sendmsg() of the caller's buffers,
 *    sealed by the kernel;
 *  - else a userspace TLS 1.3 record layer on the handshake's traffic secrets (the same
 *    records on the wire; any TLS 1.3 peer reads them): each buffer is sealed by the
 *    AEAD straight from the pinned page into maximal (16 KiB) records gathered in a
 *    256 KiB buffer sent with one send(), and received ciphertext (large recv()s) is
 *    opened straight into the caller's buffer. Key updates both ways (sent every 2^24
 *    records, below AES-GCM's limit);
 *  - OpenSSL's own record layer only for a session neither could take.
 * tqkv__dctls_path names the path of each direction.
 */
#ifndef TQKV_TRANSPORT_DC_TLS_H
#define TQKV_TRANSPORT_DC_TLS_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kernels/clock.h"

/* A data-channel connection: ssl is NULL for plain TCP. */
typedef struct tqkv__dcio {
    int fd;
    SSL *ssl;
} tqkv__dcio_t;

/* Server context from PEM files (cert chain, key; client_ca: require and verify client
 * certificates signed by it, or NULL). Returns new (SSL_CTX_free) or NULL with err
 * naming the file. */
SSL_CTX *tqkv__dctls_server_ctx(const char *cert_path, const char *key_path,
                                const char *client_ca_path, char *err, size_t errlen);

/* Client context: server certificates verified against ca_path (PEM; NULL: the system
 * roots), client certificate cert_path/key_path for mutual TLS (both or neither).
 * Returns new or NULL with err. */
SSL_CTX *tqkv__dctls_client_ctx(const char *ca_path, const char *cert_path, const char *key_path,
                                char *err, size_t errlen);

/* Runs the TLS handshake on fd (non-blocking) within deadline_ns (CLOCK_MONOTONIC).
 * name: the client's expected server name (a DNS name or an IP address, checked
 * against the certificate; also sent as SNI when a DNS name); NULL on the server.
 * Returns a new SSL (SSL_free; fd stays the caller's) or NULL with err. */
SSL *tqkv__dctls_handshake(SSL_CTX *ctx, int fd, const char *name, uint64_t deadline_ns, char *err,
                           size_t errlen);

/* Sets what the record layer needs on a context built elsewhere (tqkv-bench's raw TLS
 * pair): the keylog callback that keeps the traffic secrets for the userspace record
 * layer, SSL_OP_ENABLE_KTLS, no read-ahead during the handshake. The contexts above
 * have it. */
void tqkv__dctls_ctx_prepare(SSL_CTX *ctx);

/* The record path of an established ssl into buf: "userspace", "ktls", "openssl", or
 * "tx ktls, rx userspace" when the directions differ. */
void tqkv__dctls_path(SSL *ssl, char *buf, size_t cap);

/* Notes ssl as this process's latest client data channel (tqkv__dcc_connect). */
void tqkv__dctls_note_client(SSL *ssl);

/* The path and "TLSv1.3 TLS_AES_128_GCM_SHA256" of the latest data channel this
 * process connected as a client ("" before any): what tqkv-bench reports. */
void tqkv__dctls_client_last(char *path, size_t pcap, char *cipher, size_t ccap);

/* Tests: the userspace layer sends a KeyUpdate after n records of one key (0: the
 * default, 2^24). Process-wide. */
void tqkv__dctls_set_rekey_records(uint64_t n);

/* Frees ssl and its record layer (NULL: no-op; SSL_free does the same). */
void tqkv__dctls_free(SSL *ssl);

/* "TLSv1.3 TLS_AES_128_GCM_SHA256" for an established ssl (static storage of OpenSSL). */
void tqkv__dctls_describe(SSL *ssl, const char **version, const char **cipher);

/* Writes all of iov[0..n) (iov is modified). deadline_ns 0: no deadline (the fd's
 * own blocking; a shutdown() from another thread ends it). Returns 0, or -1 with errno
 * (ETIMEDOUT, EPIPE for a TLS error or closed peer, or the socket's error). */
int tqkv__dcio_write(tqkv__dcio_t *io, struct iovec *iov, int n, uint64_t deadline_ns);

/* Reads exactly n bytes by deadline_ns (0: none). Returns 0, or -1: EOF (errno 0),
 * ETIMEDOUT, EPROTO for a TLS failure (bad record MAC: tampered bytes), or the
 * socket's error. */
int tqkv__dcio_read(tqkv__dcio_t *io, void *buf, size_t n, uint64_t deadline_ns);

/* Waits for ev (POLLIN, POLLOUT) on fd until deadline_ns (0: forever). Returns 0 when
 * ready (or in error: the next call says which), -1 with errno (ETIMEDOUT). */
int tqkv__dcio_wait(int fd, short ev, uint64_t deadline_ns);

/* 1 when io has bytes read from the socket but not yet returned (TLS records already
 * received): poll() on the socket would not see them. */
int tqkv__dcio_pending(const tqkv__dcio_t *io);

#endif
