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

/* Most --namespace-policy specs; the longest namespace a spec may name (as Put's). */
#define TQKV_MAX_NS_POLICIES 256
#define TQKV_DEFAULT_HANDOFF_SECONDS 10
#define TQKV_NS_POLICY_MAX_NAME 256

/* One --namespace-policy: the codec policy of a namespace, or of every namespace that
 * starts with a prefix (spec "team-*"). Fields a spec leaves out hold the global policy. */
typedef struct tqkv_ns_policy {
    char ns[TQKV_NS_POLICY_MAX_NAME + 1]; /* the namespace, or the prefix without its '*' */
    uint8_t prefix;                       /* 1: ns is a prefix */
    tqkv_policy_t policy;
} tqkv_ns_policy_t;

typedef struct tqkv_server_config {
    char listen[256];           /* HOST:PORT; port 0 picks a free port */
    char peers[1024];           /* --peers: targets of the other servers ("" = none) */
    char peers_dns[256];        /* DNS servers for peers ("" = the system's) */
    unsigned handoff_seconds;   /* SIGTERM: time budget of the hand-off to peers (0 = none) */
    uint64_t handoff_bytes;     /* and its byte budget (0 = no limit) */
    int no_forward;             /* --no-forward: serve every block here (forward.h) */
    char peer_ca[1024];         /* CA of the peers' certificates ("" = --tls-client-ca) */
    char peer_tls_name[256];    /* name checked in the peers' certificates ("" = as dialed) */
    char peer_token_file[1024]; /* with --auth-tokens: the token peers accept ("" = none) */
    char node_id[256];          /* stable identity for placement; "" = HOSTNAME:PORT (bound port) */
    unsigned threads;           /* gRPC worker threads (one completion queue each) */
    unsigned encoder_threads;   /* encode/decode pool */
    tqkv_store_config_t store;  /* capacities, tiers, eviction, quota, verify_crc */
    tqkv_policy_t policy;       /* codec policy of a namespace no ns_policies entry matches */
    unsigned num_ns_policies;   /* --namespace-policy specs, in the order given */
    tqkv_ns_policy_t ns_policies[TQKV_MAX_NS_POLICIES];
    uint64_t max_message_bytes;
    unsigned max_streams;     /* concurrent streams per connection */
    unsigned drain_seconds;   /* SIGTERM: time in-flight streams get to finish */
    char metrics_listen[256]; /* "" = no metrics endpoint */
    char data_listen[256];    /* "" = no TCP data channels */
    char auth_tokens[1024];   /* "" = no auth */
    char tls_cert[1024], tls_key[1024], tls_client_ca[1024];
    tqkv_log_level_t log_level;
    tqkv_log_format_t log_format;
    char access_log[1024];    /* "" = none, "-" = the log stream, else a file */
    unsigned slow_request_ms; /* log calls slower than this at warn; 0 = off */
    int help;                 /* --help was given: print usage, exit 0 */
    int version;              /* --version was given: print the build, exit 0 */

    /* background re-replication to the peers, bytes per second (0 = off; replicate.c) */
    uint64_t replicate_bytes_per_s;
} tqkv_server_config_t;

/* Fills the defaults. */
void tqkv_config_default(tqkv_server_config_t *cfg);

/* Applies TQKV_* environment variables, then argv[1..argc) on top of cfg. Returns
 * TQKV_EINVAL with one line naming the flag (or variable) in err for a bad value,
 * an unknown flag or an inconsistent combination. Borrows everything. */
tqkv_status_t tqkv_config_parse(tqkv_server_config_t *cfg, int argc, char **argv, char *err,
                                size_t errlen);

/* Counts the TQKV_* variables of envp (NULL-terminated, as `environ`) that neither
 * tqkv-server nor its libraries read (likely misspelled; they are ignored) and lists
 * their names, space-separated, in out. */
size_t tqkv_config_unknown_env(char *const *envp, char *out, size_t outlen);

/* Parses a byte count with an optional K/M/G/T suffix (powers of 1024, optional
 * trailing "B"/"iB"). TQKV_EINVAL on anything else or overflow. */
tqkv_status_t tqkv_config_parse_bytes(const char *s, uint64_t *out);

/* The policy Put uses for namespace ns (len bytes): the spec naming ns exactly, else the
 * spec with the longest prefix of ns, else cfg->policy. Returns borrowed (valid while cfg
 * is). A linear scan: at most TQKV_MAX_NS_POLICIES short compares per Put. */
const tqkv_policy_t *tqkv_config_ns_policy(const tqkv_server_config_t *cfg, const char *ns,
                                           size_t len);

/* One line describing a policy as space-separated key=value fields (for the start-up log):
 * "key=3/mse/nc value=3/mse/nc boundary_layers=2 boundary_key=4/mse/nc ...". */
void tqkv_config_policy_format(const tqkv_policy_t *p, char *buf, size_t len);

/* Writes the --help text. */
void tqkv_config_usage(FILE *out);

/* Non-zero when the HOST part of listen is not a loopback address. */
int tqkv_config_listen_is_public(const char *listen);

#endif
