/* client_health.h - libtqkv's fast failure detection (client_health.c): keepalive
 * channel arguments, and the prober that keeps servers marked down until they answer.
 * Internal (tqkv__); the options and tqkv_client_health_stats are in client.h. */
#ifndef TQKV_TRANSPORT_CLIENT_HEALTH_H
#define TQKV_TRANSPORT_CLIENT_HEALTH_H

#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#include "transport/client.h"

#define TQKV__HEALTH_NUM_ARGS 5 /* channel arguments tqkv__health_channel_args adds */

typedef struct tqkv__health tqkv__health_t;

/* Writes the keepalive channel arguments of opts o into args[0..cap): returns how many
 * (0 with keepalive_ms = UINT32_MAX, or cap < TQKV__HEALTH_NUM_ARGS). Keys are static. */
size_t tqkv__health_channel_args(const tqkv_client_opts_t *o, grpc_arg *args, size_t cap);

/* The connection timeout of opts o in ms (connect_timeout_ms, its default; 5000 for one
 * server and no resolve_targets, as before). */
uint32_t tqkv__health_connect_ms(const tqkv_client_opts_t *o);

/* Hedging and per-call deadline counters of client c (tqkv-bench reports them; not
 * exported). hedges: hedge calls started; hedge_pages: pages a hedge delivered (its
 * primary had not); call_timeouts: calls that passed their size deadline. */
typedef struct tqkv__hedge_stats {
    uint64_t hedges, hedge_pages, call_timeouts;
} tqkv__hedge_stats_t;
void tqkv__hedge_stats(const tqkv_client_t *c, tqkv__hedge_stats_t *out);

/* keepalive_ms as used (the default for 0). */
uint32_t tqkv__health_keepalive_ms(const tqkv_client_opts_t *o);

/* Starts client c's prober (after its membership exists); *out NULL with
 * probe_interval_ms = UINT32_MAX. TQKV_ENOMEM when no thread can be made. */
tqkv_status_t tqkv__health_start(tqkv_client_t *c, const tqkv_client_opts_t *o,
                                 tqkv__health_t **out);

/* Stops and frees the prober (before the membership goes). NULL is a no-op. */
void tqkv__health_stop(tqkv__health_t *h);

/* A call on target ti of view c ended UNAVAILABLE: mark it down until a probe is
 * answered (no-op without a prober, or with a single target). */
void tqkv__health_failed(tqkv_client_t *c, size_t ti);

#endif
