/* tls.h - server TLS / mutual TLS credentials from PEM files, reloadable. */
#ifndef TQKV_SERVICE_TLS_H
#define TQKV_SERVICE_TLS_H

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <stddef.h>

#include "kernels/status.h"

/* Builds server credentials from a certificate chain and key (PEM files), requiring
 * and verifying client certificates signed by client_ca when it is non-NULL.
 * *out is owned by the caller (grpc_server_credentials_release). TQKV_EIO / TQKV_EINVAL
 * with a reason naming the file in err. */
tqkv_status_t tqkv_tls_server_creds(const char *cert_path, const char *key_path,
                                    const char *client_ca_path, grpc_server_credentials **out,
                                    char *err, size_t errlen);

typedef struct tqkv_tls tqkv_tls_t;

/* Loads the certificate chain, key and (optional) client CA, checks them with OpenSSL (the
 * chain parses, the key matches the first certificate, which is valid now) and builds
 * server credentials whose certificates tqkv_tls_reload can swap later: gRPC asks for the
 * configuration at each new handshake, so new connections get the new certificate and
 * connections already up keep theirs. *out and *creds are owned by the caller; *out must
 * outlive the credentials' server (destroy it after grpc_server_destroy). Errors name the
 * file in err (TQKV_EIO / TQKV_EINVAL). */
tqkv_status_t tqkv_tls_create(const char *cert_path, const char *key_path,
                              const char *client_ca_path, tqkv_tls_t **out,
                              grpc_server_credentials **creds, char *err, size_t errlen);

/* Reads the files again. When they are valid and differ from what is in force, the next
 * handshakes use them (*changed = 1); when they are the same, *changed = 0. On any problem
 * returns non-OK with why in err and the certificates in force stay. Thread-safe. */
tqkv_status_t tqkv_tls_reload(tqkv_tls_t *t, int *changed, char *err, size_t errlen);

/* The files' paths (borrowed, valid until destroy); ca is "" without mutual TLS. */
void tqkv_tls_paths(const tqkv_tls_t *t, const char **cert, const char **key, const char **ca);

/* Unix time at which the certificate in force expires. */
double tqkv_tls_not_after(tqkv_tls_t *t);

/* NULL is a no-op. */
void tqkv_tls_destroy(tqkv_tls_t *t);

/* For a process that owns its exit (tqkv-server's main): initialises OpenSSL without its
 * atexit cleanup. Call before anything uses OpenSSL. That cleanup deletes OpenSSL's
 * per-thread keys while gRPC's threads may still be ending (its executor threads are
 * joined by a detached clean-up thread when gRPC's last reference drops on one of its own
 * threads); a thread that ends after it skips its destructor and its error state is
 * lost, which LeakSanitizer reports. Without the cleanup every thread frees its
 * state as it ends and the OS takes the rest at exit. TQKV_EINTERNAL if OpenSSL refuses. */
tqkv_status_t tqkv_tls_process_init(void);

/* Reads a whole file into a new NUL-terminated malloc'd string. */
tqkv_status_t tqkv_read_file(const char *path, char **out, size_t *len);

#endif
