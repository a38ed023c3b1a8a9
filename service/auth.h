/* auth.h - bearer tokens mapped to namespaces (--auth-tokens FILE).
 *
 * File format, one token per line (blank lines and lines starting with '#' ignored):
 *     <token> <r|w|rw> <namespace>[,<namespace>...]      ('*' grants every namespace)
 * Tokens are held only as SHA-256 digests and compared in constant time.
 *
 * A table is immutable and reference-counted: the server swaps in a new table when the
 * file is reloaded (SIGHUP, file change) while each call keeps the table it started with,
 * so a reload never fails a call in flight.
 */
#ifndef TQKV_SERVICE_AUTH_H
#define TQKV_SERVICE_AUTH_H

#include <stddef.h>

#include "kernels/status.h"

typedef struct tqkv_auth tqkv_auth_t;

enum { TQKV_AUTH_READ = 1, TQKV_AUTH_WRITE = 2 };

/* Loads a token file. On a malformed file returns TQKV_EINVAL with "FILE:LINE: why"
 * in err. *out owned by the caller. */
tqkv_status_t tqkv_auth_load(const char *path, tqkv_auth_t **out, char *err, size_t errlen);
/* Drops one reference (the loader holds the first); the last one frees. NULL is a no-op. */
void tqkv_auth_destroy(tqkv_auth_t *a);
/* Takes one more reference; returns a. Thread-safe. */
tqkv_auth_t *tqkv_auth_ref(tqkv_auth_t *a);
/* Number of tokens in the table. */
size_t tqkv_auth_count(const tqkv_auth_t *a);
/* Non-zero when a and b were loaded from files with the same bytes. */
int tqkv_auth_same_file(const tqkv_auth_t *a, const tqkv_auth_t *b);

/* Checks the value of an `authorization` header (e.g. "Bearer abc"; NULL when absent)
 * for permission `perm` (TQKV_AUTH_READ and/or TQKV_AUTH_WRITE) on namespace ns.
 * ns == NULL means every namespace (only a '*' grant passes).
 * Returns TQKV_OK, TQKV_EAUTH (missing, malformed or unknown token) or TQKV_EPERM
 * (token valid, namespace or permission not granted). */
tqkv_status_t tqkv_auth_check(const tqkv_auth_t *a, const char *authz, size_t authz_len,
                              const char *ns, size_t ns_len, unsigned perm);

/* The token of an `authorization` header ("Bearer <token>", scheme case-insensitive,
 * blanks around it allowed): 0 with tok and toklen pointing into authz, or -1. */
int tqkv_auth_bearer_token(const char *authz, size_t authz_len, const char **tok, size_t *toklen);

#endif
