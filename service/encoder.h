/* encoder.h - the encode worker pool of tqkv-server: codec work (validate + encode
 * a Put message, decode a page for a BF16 Get) runs here, never on the gRPC
 * threads. A job is a function and an argument; the job itself wakes its call's
 * gRPC worker when done (an empty batch on the call, see server.c).
 */
#ifndef TQKV_SERVICE_ENCODER_H
#define TQKV_SERVICE_ENCODER_H

#include <stddef.h>

#include "kernels/status.h"

typedef struct tqkv_encoder tqkv_encoder_t;
typedef void (*tqkv_encoder_fn)(void *arg);

/* Starts nthreads (>= 1) threads. *out owned by the caller (tqkv_encoder_destroy). */
tqkv_status_t tqkv_encoder_create(unsigned nthreads, tqkv_encoder_t **out);

/* Queues fn(arg) (FIFO). Borrows arg until fn runs. TQKV_EUNAVAILABLE after
 * tqkv_encoder_destroy has begun. Thread-safe. */
tqkv_status_t tqkv_encoder_submit(tqkv_encoder_t *e, tqkv_encoder_fn fn, void *arg);

/* Runs every queued job, then joins the threads and frees. NULL is a no-op. */
void tqkv_encoder_destroy(tqkv_encoder_t *e);

#endif
