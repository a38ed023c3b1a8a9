/* dc_server.h - the server side of TCP data channels (--data-listen): OpenChannel/CloseChannel with
 * transport TRANSPORT_TCP, the listener that attaches connections to channels, and
 * Get with transport TRANSPORT_TCP (frames in transport/data_frame.h).
 */
#ifndef TQKV_SERVICE_DC_SERVER_H
#define TQKV_SERVICE_DC_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

typedef struct tqkv__dc tqkv__dc_t;
typedef struct tqkv__call tqkv__call_t;
typedef struct tqkv_server tqkv_server_t;

/* Binds listen (HOST:PORT) and starts accepting; s->dc. */
tqkv_status_t tqkv__dc_start(tqkv_server_t *s, const char *listen, char *err, size_t errlen);
/* The bound port, 0 without data channels. */
int tqkv__dc_port(const tqkv_server_t *s);
/* What the start-up log says of the channels' TLS: "off", or the protocol, the
 * preferred suite and the record path the kernel allows (kTLS or userspace). Static. */
const char *tqkv__dc_tls_summary(const tqkv_server_t *s);
/* Stops accepting new connections (graceful stop begins). */
void tqkv__dc_stop_accepting(tqkv_server_t *s);
/* Closes every channel, waits (up to wait_ms) for their threads; returns how many are
 * left running (then the registry is leaked, not freed under them). */
unsigned tqkv__dc_destroy(tqkv_server_t *s, unsigned wait_ms);

/* Rebuilds the data channels' TLS context from the (reloaded) certificate files: new
 * connections get it, attached ones keep theirs. TQKV_EINVAL with err when the files do
 * not make a context (the old one stays). */
tqkv_status_t tqkv__dc_tls_reload(tqkv_server_t *s, char *err, size_t errlen);

/* OpenChannel with transport TCP: answers the call. */
void tqkv__dc_open(tqkv__call_t *c);
/* CloseChannel of id: answers the call and returns 1 when id is a TCP channel the
 * caller owns; 0 (nothing sent) otherwise. */
int tqkv__dc_close(tqkv__call_t *c, uint64_t id);

#endif
