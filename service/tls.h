/* tls.h - server TLS / mutual TLS credentials from PEM files. */
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

/* Reads a whole file into a new NUL-terminated malloc'd string. */
tqkv_status_t tqkv_read_file(const char *path, char **out, size_t *len);

#endif
