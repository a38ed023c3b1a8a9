/* config.h - tqkv-server configuration: command-line flags with matching TQKV_*
 * environment variables (a flag wins over its variable), defaults, --help.
 */
#ifndef TQKV_SERVICE_CONFIG_H
#define TQKV_SERVICE_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cache/store.h"
#include "kernels/policy.h"
#include "kernels/status.h"
#include "service/log.h"

typedef struct tqkv_server_config {
    char listen[256];          /* HOST:PORT; port 0 picks a free port */
    unsigned threads;          /* gRPC worker threads (one completion queue each) */
    unsigned encoder_threads;  /* encode/decode pool */
    tqkv_store_config_t store; /* capacities, tiers, eviction, quota, verify_crc */
    tqkv_policy_t policy;      /* default codec policy of every namespace */
    uint64_t max_message_bytes;
    unsigned max_streams;     /* concurrent streams per connection */
    unsigned drain_seconds;   /* SIGTERM: time in-flight streams get to finish */
    char metrics_listen[256]; /* "" = no metrics endpoint */
    char auth_tokens[1024];   /* "" = no auth */
    char tls_cert[1024], tls_key[1024], tls_client_ca[1024];
    tqkv_log_level_t log_level;
    tqkv_log_format_t log_format;
    int help; /* --help was given: print usage, exit 0 */
} tqkv_server_config_t;

/* Fills the defaults. */
void tqkv_config_default(tqkv_server_config_t *cfg);

/* Applies TQKV_* environment variables, then argv[1..argc) on top of cfg. Returns
 * TQKV_EINVAL with one line naming the flag (or variable) in err for a bad value,
 * an unknown flag or an inconsistent combination. Borrows everything. */
tqkv_status_t tqkv_config_parse(tqkv_server_config_t *cfg, int argc, char **argv, char *err,
                                size_t errlen);

/* Parses a byte count with an optional K/M/G/T suffix (powers of 1024, optional
 * trailing "B"/"iB"). TQKV_EINVAL on anything else or overflow. */
tqkv_status_t tqkv_config_parse_bytes(const char *s, uint64_t *out);

/* Writes the --help text. */
void tqkv_config_usage(FILE *out);

/* Non-zero when the HOST part of listen is not a loopback address. */
int tqkv_config_listen_is_public(const char *listen);

#endif
