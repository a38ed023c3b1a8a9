/* config.c - flags and TQKV_* environment variables of tqkv-server.
 *
 * One table drives parsing, the environment and --help, so they cannot drift:
 * each option has a flag name, an environment variable, a kind and a help line.
 */
#include "service/config.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef enum opt_kind { OPT_VALUE, OPT_BOOL } opt_kind_t;

/* Sets one option: codec policy settings go to *pol (&cfg->policy, or a namespace's
 * policy). v is the value (OPT_VALUE: non-empty), b the parsed value of an OPT_BOOL.
 * Returns NULL, or why v is not valid. */
typedef const char *(*opt_set_fn)(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v,
                                  int b);

typedef struct opt {
    const char *name; /* flag without "--" */
    const char *env;  /* environment variable */
    opt_kind_t kind;
    const char *arg; /* value placeholder for --help */
    const char *help;
    int ns;         /* 1: also a key of --namespace-policy specs (a codec policy setting) */
    opt_set_fn set; /* NULL: handled by the parser itself (--namespace-policy) */
} opt_t;

static unsigned
cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (unsigned)n : 1;
}

void
tqkv_config_default(tqkv_server_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->listen, sizeof cfg->listen, "127.0.0.1:50051");
    cfg->threads = cpu_count();
    cfg->encoder_threads = cpu_count();
    tqkv_store_config_default(&cfg->store);
    cfg->store.device = -1;
    tqkv_policy_default(&cfg->policy);
    cfg->max_message_bytes = 64ull << 20;
    cfg->max_streams = 256;
    cfg->drain_seconds = 20;
    cfg->handoff_seconds = TQKV_DEFAULT_HANDOFF_SECONDS;
    cfg->log_level = TQKV_LOG_INFO;
    cfg->log_format = TQKV_LOG_TEXT;
}

tqkv_status_t
tqkv_config_parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    if (s == NULL || !isdigit((unsigned char)*s))
        return TQKV_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return TQKV_EINVAL;
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    default:
        break;
    }
    if (shift)
        end++;
    if (*end == 'i' && shift)
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end != '\0')
        return TQKV_EINVAL;
    if (shift && v > (~0ull >> shift))
        return TQKV_EINVAL;
    *out = (uint64_t)v << shift;
    return TQKV_OK;
}

static tqkv_status_t
parse_uint(const char *s, unsigned long long max, unsigned long long *out)
{
    char *end;
    if (s == NULL || !isdigit((unsigned char)*s))
        return TQKV_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end != '\0' || v > max)
        return TQKV_EINVAL;
    *out = v;
    return TQKV_OK;
}

static tqkv_status_t
parse_bool(const char *s, int *out)
{
    if (s == NULL || !strcmp(s, "1") || !strcmp(s, "true") || !strcmp(s, "on") || !strcmp(s, "yes"))
        *out = 1;
    else if (!strcmp(s, "0") || !strcmp(s, "false") || !strcmp(s, "off") || !strcmp(s, "no"))
        *out = 0;
    else
        return TQKV_EINVAL;
    return TQKV_OK;
}

static tqkv_status_t
parse_mode(const char *s, uint8_t *out)
{
    if (!strcmp(s, "mse"))
        *out = TQKV_MODE_MSE;
    else if (!strcmp(s, "prod"))
        *out = TQKV_MODE_PROD;
    else if (!strcmp(s, "lossless"))
        *out = TQKV_MODE_RAW;
    else
        return TQKV_EINVAL;
    return TQKV_OK;
}

static int
copy_str(char *dst, size_t cap, const char *v)
{
    size_t n = strlen(v);
    if (n >= cap)
        return -1;
    memcpy(dst, v, n + 1);
    return 0;
}

/* Checks HOST:PORT: a port 0..65535 and a non-empty host: a name or IPv4 address
 * (letters, digits, '-', '.', '_') or [IPv6] (hex digits, ':', '.', then an optional
 * %zone). Anything else ("[::1", "::1:80", "a b:80") failed later as "cannot bind". */
static int
listen_ok(const char *v)
{
    const char *colon = strrchr(v, ':');
    unsigned long long port;
    if (colon == NULL || colon == v || parse_uint(colon + 1, 65535, &port) != TQKV_OK)
        return 0;
    size_t hl = (size_t)(colon - v), i = 0, end = hl;
    int zone = 0;
    if (v[0] == '[') {
        if (hl < 3 || v[hl - 1] != ']')
            return 0;
        i = 1;
        end = hl - 1;
    }
    for (; i < end; i++) {
        unsigned char ch = (unsigned char)v[i];
        if (v[0] == '[' && !zone && ch == '%' && i + 1 < end)
            zone = 1;
        else if (v[0] == '[' && !zone && !isxdigit(ch) && ch != ':' && ch != '.')
            return 0;
        else if ((v[0] != '[' || zone) && !isalnum(ch) && ch != '-' && ch != '.' && ch != '_')
            return 0;
    }
    return 1;
}

/* ---- setters, one per option (the table below names them) ---- */

#define WHY_LISTEN "expected HOST:PORT with a port in 0..65535"
#define WHY_BYTES "expected a byte count such as 512M or 8G"
#define WHY_BITS "expected 1, 1.5, 2, 2.5, 3, 3.5 or 4"
#define WHY_PATH "path too long"

static const char *
set_listen(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return !listen_ok(v) || copy_str(cfg->listen, sizeof cfg->listen, v) ? WHY_LISTEN : NULL;
}

static const char *
set_metrics_listen(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return !listen_ok(v) || copy_str(cfg->metrics_listen, sizeof cfg->metrics_listen, v)
               ? WHY_LISTEN
               : NULL;
}

static const char *
set_data_listen(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return !listen_ok(v) || copy_str(cfg->data_listen, sizeof cfg->data_listen, v) ? WHY_LISTEN
                                                                                   : NULL;
}

/* An integer in 1..1024 (thread counts). */
static const char *
threads_of(const char *v, unsigned *out)
{
    unsigned long long u;
    if (parse_uint(v, 1024, &u) != TQKV_OK || u == 0)
        return "expected an integer in 1..1024";
    *out = (unsigned)u;
    return NULL;
}

/* A node id: printable ASCII without blanks (it goes into log lines and metric labels). */
static int
node_id_ok(const char *v)
{
    for (const char *p = v; *p; p++)
        if (*p <= ' ' || *p > '~' || *p == '"' || *p == '\\')
            return 0;
    return 1;
}

static const char *
set_node_id(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return !node_id_ok(v) || copy_str(cfg->node_id, sizeof cfg->node_id, v)
               ? "expected 1..255 printable characters, no blanks"
               : NULL;
}

static const char *
set_peers(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->peers, sizeof cfg->peers, v) ? "too long" : NULL;
}

static const char *
set_peers_dns(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->peers_dns, sizeof cfg->peers_dns, v) ? "too long" : NULL;
}

static const char *
set_handoff_seconds(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 3600, &u) != TQKV_OK)
        return "expected seconds in 0..3600";
    cfg->handoff_seconds = (unsigned)u;
    return NULL;
}

static const char *
set_handoff_bytes(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
        return WHY_BYTES;
    cfg->handoff_bytes = bytes;
    return NULL;
}

static const char *
set_no_forward(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    cfg->no_forward = b;
    return NULL;
}

static const char *
set_peer_ca(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->peer_ca, sizeof cfg->peer_ca, v) ? WHY_PATH : NULL;
}

static const char *
set_peer_tls_name(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return !node_id_ok(v) || copy_str(cfg->peer_tls_name, sizeof cfg->peer_tls_name, v)
               ? "expected a DNS name (1..255 printable characters, no blanks)"
               : NULL;
}

static const char *
set_peer_token_file(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->peer_token_file, sizeof cfg->peer_token_file, v) ? WHY_PATH : NULL;
}

static const char *
set_threads(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return threads_of(v, &cfg->threads);
}

static const char *
set_encoder_threads(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return threads_of(v, &cfg->encoder_threads);
}

static const char *
set_dram_capacity(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
        return WHY_BYTES;
    if (bytes == 0)
        return "must be greater than 0";
    cfg->store.dram_capacity = bytes;
    return NULL;
}

static const char *
set_hbm_capacity(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
        return WHY_BYTES;
    cfg->store.hbm_capacity = bytes;
    return NULL;
}

static const char *
set_ns_quota(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
        return WHY_BYTES;
    cfg->store.default_ns_quota = bytes;
    return NULL;
}

static const char *
set_max_message_bytes(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
        return WHY_BYTES;
    if (bytes < 4096 || bytes > 0x7fffffffull)
        return "must be in 4K..2G-1";
    cfg->max_message_bytes = bytes;
    return NULL;
}

static const char *
set_device(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 1023, &u) != TQKV_OK)
        return "expected a CUDA device index";
    cfg->store.device = (int)u;
    return NULL;
}

static const char *
set_disk_path(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->store.disk_path, sizeof cfg->store.disk_path, v) ? WHY_PATH : NULL;
}

static const char *
set_disk_capacity(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint64_t bytes;
    if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK || bytes < (1u << 20))
        return "expected a byte count of at least 1M, such as 500G";
    cfg->store.disk_capacity = bytes;
    return NULL;
}

static const char *
set_disk_sync(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    int m = !strcmp(v, "none") ? 0 : !strcmp(v, "batch") ? 1 : !strcmp(v, "always") ? 2 : -1;
    if (m < 0)
        return "expected none, batch or always";
    cfg->store.disk_sync = m;
    return NULL;
}

static const char *
set_access_log(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->access_log, sizeof cfg->access_log, v) ? WHY_PATH : NULL;
}

static const char *
set_slow_request_ms(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 86400000, &u) != TQKV_OK)
        return "expected milliseconds in 0..86400000";
    cfg->slow_request_ms = (unsigned)u;
    return NULL;
}

static const char *
set_max_streams(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 1u << 20, &u) != TQKV_OK || u == 0)
        return "expected an integer in 1..1048576";
    cfg->max_streams = (unsigned)u;
    return NULL;
}

static const char *
set_drain_seconds(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 3600, &u) != TQKV_OK)
        return "expected seconds in 0..3600";
    cfg->drain_seconds = (unsigned)u;
    return NULL;
}

static const char *
set_key_bits(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t b2;
    if (tqkv_bits_parse(v, &b2) != TQKV_OK)
        return WHY_BITS;
    pol->k.bits_x2 = b2;
    return NULL;
}

static const char *
set_value_bits(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t b2;
    if (tqkv_bits_parse(v, &b2) != TQKV_OK)
        return WHY_BITS;
    pol->v.bits_x2 = b2;
    return NULL;
}

static const char *
set_boundary_key_bits(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t b2;
    if (tqkv_bits_parse(v, &b2) != TQKV_OK)
        return WHY_BITS;
    pol->k_boundary.bits_x2 = b2;
    return NULL;
}

static const char *
set_boundary_value_bits(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t b2;
    if (tqkv_bits_parse(v, &b2) != TQKV_OK)
        return WHY_BITS;
    pol->v_boundary.bits_x2 = b2;
    return NULL;
}

static const char *
set_key_mode(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t m;
    if (parse_mode(v, &m) != TQKV_OK)
        return "expected mse, prod or lossless";
    pol->k.mode = pol->k_boundary.mode = m;
    return NULL;
}

static const char *
set_value_mode(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    uint8_t m;
    if (parse_mode(v, &m) != TQKV_OK)
        return "expected mse, prod or lossless";
    pol->v.mode = pol->v_boundary.mode = m;
    return NULL;
}

/* --lossless: K and V of every layer stored as BF16 (raw pages); =false makes lossless
 * tensors mse again (their bits were kept). */
static const char *
set_lossless(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    tqkv_tensor_codec_t *t[4] = {&pol->k, &pol->v, &pol->k_boundary, &pol->v_boundary};
    for (int i = 0; i < 4; i++)
        if (b)
            t[i]->mode = TQKV_MODE_RAW;
        else if (t[i]->mode == TQKV_MODE_RAW)
            t[i]->mode = TQKV_MODE_MSE;
    return NULL;
}

/* Bits given for a tensor that ends up lossless (one spec, or the global flags): which one,
 * or NULL. kb / vb: a key / value bit width was given. */
static const char *
lossless_conflict(const tqkv_policy_t *p, int kb, int vb)
{
    if (kb && (p->k.mode == TQKV_MODE_RAW || p->k_boundary.mode == TQKV_MODE_RAW))
        return "key";
    if (vb && (p->v.mode == TQKV_MODE_RAW || p->v_boundary.mode == TQKV_MODE_RAW))
        return "value";
    return NULL;
}

#define WHY_LOSSLESS_BITS                                                                          \
    "a lossless %s (key-mode/value-mode lossless, or lossless) is stored as BF16 and takes no "    \
    "bit width: drop %s-bits or choose mse/prod"

/* Whether option o sets a key (1) or value (2) bit width. */
static int
bits_opt(const char *name)
{
    if (!strcmp(name, "key-bits") || !strcmp(name, "boundary-key-bits"))
        return 1;
    if (!strcmp(name, "value-bits") || !strcmp(name, "boundary-value-bits"))
        return 2;
    return 0;
}

static const char *
set_boundary_layers(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, 512, &u) != TQKV_OK)
        return "expected an integer in 0..512";
    pol->boundary_layers = (uint32_t)u;
    return NULL;
}

static const char *
set_rotation(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    if (!strcmp(v, "dense"))
        pol->rotation = TQKV_ROT_DENSE;
    else if (!strcmp(v, "hadamard"))
        pol->rotation = TQKV_ROT_HADAMARD;
    else
        return "expected dense or hadamard";
    return NULL;
}

static const char *
set_seed(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    unsigned long long u;
    if (parse_uint(v, ~0ull, &u) != TQKV_OK)
        return "expected an unsigned 64-bit integer";
    pol->seed = (uint64_t)u;
    return NULL;
}

static const char *
set_eviction(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    if (!strcmp(v, "lru"))
        cfg->store.policy = TQKV_EVICT_LRU;
    else if (!strcmp(v, "s3fifo"))
        cfg->store.policy = TQKV_EVICT_S3FIFO;
    else
        return "expected lru or s3fifo";
    return NULL;
}

static const char *
set_auth_tokens(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->auth_tokens, sizeof cfg->auth_tokens, v) ? WHY_PATH : NULL;
}

static const char *
set_tls_cert(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->tls_cert, sizeof cfg->tls_cert, v) ? WHY_PATH : NULL;
}

static const char *
set_tls_key(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->tls_key, sizeof cfg->tls_cert, v) ? WHY_PATH : NULL;
}

static const char *
set_tls_client_ca(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return copy_str(cfg->tls_client_ca, sizeof cfg->tls_cert, v) ? WHY_PATH : NULL;
}

static const char *
set_log_level(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return tqkv_log_level_parse(v, &cfg->log_level) != TQKV_OK
               ? "expected debug, info, warn or error"
               : NULL;
}

static const char *
set_log_format(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    return tqkv_log_format_parse(v, &cfg->log_format) != TQKV_OK ? "expected text or json" : NULL;
}

static const char *
set_hbm_standin(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    cfg->store.hbm_standin = b;
    return NULL;
}

static const char *
set_norm_correction(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    pol->k.norm_correction = pol->v.norm_correction = pol->k_boundary.norm_correction =
        pol->v_boundary.norm_correction = (uint8_t)b;
    return NULL;
}

static const char *
set_key_centering(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    pol->key_centering = (uint8_t)b;
    return NULL;
}

static const char *
set_verify_crc(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    cfg->store.verify_crc = b;
    return NULL;
}

static const char *
set_help(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    cfg->help = b;
    return NULL;
}

static const char *
set_version(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const char *v, int b)
{
    cfg->version = b;
    return NULL;
}

static const opt_t opts[] = {
    {"listen", "TQKV_LISTEN", OPT_VALUE, "HOST:PORT",
     "gRPC address (default 127.0.0.1:50051; port 0 picks a free port)", 0, set_listen},
    {"node-id", "TQKV_NODE_ID", OPT_VALUE, "NAME",
     "stable identity clients rank this server by (default: HOSTNAME:PORT, e.g. "
     "tqkv-0:50051 in a StatefulSet: stable across restarts, unique per host)",
     0, set_node_id},
    {"peers", "TQKV_PEERS", OPT_VALUE, "NAME[,NAME...]",
     "the other servers (a headless Service NAME:PORT, or addresses): on SIGTERM, hand "
     "pages off to them, hottest first, each to its block's next-ranked live peer; and "
     "forward blocks a peer owns to it (default: none)",
     0, set_peers},
    {"peers-dns", "TQKV_PEERS_DNS", OPT_VALUE, "IP:PORT[,...]",
     "DNS servers for --peers (default: the system's)", 0, set_peers_dns},
    {"handoff-seconds", "TQKV_HANDOFF_SECONDS", OPT_VALUE, "S",
     "time budget of the hand-off on SIGTERM (default 10; 0 = no hand-off); before the drain", 0,
     set_handoff_seconds},
    {"handoff-bytes", "TQKV_HANDOFF_BYTES", OPT_VALUE, "BYTES",
     "byte budget of the hand-off (default 0: no limit)", 0, set_handoff_bytes},
    {"no-forward", "TQKV_NO_FORWARD", OPT_BOOL, NULL,
     "with --peers: do not forward Put/Lookup/Get of blocks a peer owns to it (one hop; "
     "for clients that reach one pod, e.g. through the load-balanced Service)",
     0, set_no_forward},
    {"peer-ca", "TQKV_PEER_CA", OPT_VALUE, "FILE",
     "with --peers and --tls-cert: the CA (PEM) that signed the peers' certificates; peers "
     "are dialed with TLS and verified against it (default: --tls-client-ca; one of the two "
     "is needed)",
     0, set_peer_ca},
    {"peer-tls-name", "TQKV_PEER_TLS_NAME", OPT_VALUE, "NAME",
     "the name the peers' certificates must hold (default: the --peers name dialed, e.g. "
     "tqkv-headless)",
     0, set_peer_tls_name},
    {"peer-token-file", "TQKV_PEER_TOKEN_FILE", OPT_VALUE, "FILE",
     "with --peers and --auth-tokens: the bearer token the hand-off sends (one token; it "
     "must have rw on * in --auth-tokens); read at start and at each hand-off",
     0, set_peer_token_file},
    {"threads", "TQKV_THREADS", OPT_VALUE, "N", "gRPC worker threads (default: CPU count)", 0,
     set_threads},
    {"encoder-threads", "TQKV_ENCODER_THREADS", OPT_VALUE, "N",
     "encode/decode pool threads (default: CPU count)", 0, set_encoder_threads},
    {"dram-capacity", "TQKV_DRAM_CAPACITY", OPT_VALUE, "BYTES",
     "DRAM tier capacity, K/M/G/T suffixes (default 1G)", 0, set_dram_capacity},
    {"hbm-capacity", "TQKV_HBM_CAPACITY", OPT_VALUE, "BYTES", "HBM tier capacity (default 0: none)",
     0, set_hbm_capacity},
    {"hbm-standin", "TQKV_HBM_STANDIN", OPT_BOOL, NULL,
     "back the HBM tier with host memory (no GPU needed)", 0, set_hbm_standin},
    {"device", "TQKV_DEVICE", OPT_VALUE, "N", "CUDA device for the HBM tier (default: none)", 0,
     set_device},
    {"disk-path", "TQKV_DISK_PATH", OPT_VALUE, "DIR",
     "disk tier below DRAM in DIR (created if absent; a restart on it comes back warm; "
     "default: none)",
     0, set_disk_path},
    {"disk-capacity", "TQKV_DISK_CAPACITY", OPT_VALUE, "BYTES",
     "disk tier capacity in bytes of segment files (needed with --disk-path)", 0,
     set_disk_capacity},
    {"disk-sync", "TQKV_DISK_SYNC", OPT_VALUE, "none|batch|always",
     "what a crash may lose: batch (default) and none the last 10 ms of Puts; always: "
     "nothing acknowledged (proto/DISK_FORMAT.md)",
     0, set_disk_sync},
    {"max-message-bytes", "TQKV_MAX_MESSAGE_BYTES", OPT_VALUE, "BYTES",
     "largest gRPC message received or sent (default 64M)", 0, set_max_message_bytes},
    {"max-streams", "TQKV_MAX_STREAMS", OPT_VALUE, "N",
     "concurrent streams per connection (default 256)", 0, set_max_streams},
    {"key-bits", "TQKV_KEY_BITS", OPT_VALUE, "B", "key bits: 1, 1.5, 2, 2.5, 3, 3.5, 4", 1,
     set_key_bits},
    {"value-bits", "TQKV_VALUE_BITS", OPT_VALUE, "B", "value bits: 1, 1.5, 2, 2.5, 3, 3.5, 4", 1,
     set_value_bits},
    {"key-mode", "TQKV_KEY_MODE", OPT_VALUE, "mse|prod|lossless",
     "key quantizer (lossless: BF16 kept as is, no bits)", 1, set_key_mode},
    {"value-mode", "TQKV_VALUE_MODE", OPT_VALUE, "mse|prod|lossless",
     "value quantizer (lossless: BF16 kept as is, no bits)", 1, set_value_mode},
    {"lossless", "TQKV_LOSSLESS", OPT_BOOL, NULL,
     "store K and V as BF16, byte-exact (key-mode and value-mode lossless)", 1, set_lossless},
    {"boundary-layers", "TQKV_BOUNDARY_LAYERS", OPT_VALUE, "N",
     "first/last N layers at boundary precision", 1, set_boundary_layers},
    {"boundary-key-bits", "TQKV_BOUNDARY_KEY_BITS", OPT_VALUE, "B", "key bits of boundary layers",
     1, set_boundary_key_bits},
    {"boundary-value-bits", "TQKV_BOUNDARY_VALUE_BITS", OPT_VALUE, "B",
     "value bits of boundary layers", 1, set_boundary_value_bits},
    {"rotation", "TQKV_ROTATION", OPT_VALUE, "dense|hadamard", "random rotation kind", 1,
     set_rotation},
    {"norm-correction", "TQKV_NORM_CORRECTION", OPT_BOOL, NULL,
     "store ||x||/||c[idx]|| so decoded vectors keep their norm", 1, set_norm_correction},
    {"key-centering", "TQKV_KEY_CENTERING", OPT_BOOL, NULL,
     "subtract each block's per-channel key mean before encoding", 1, set_key_centering},
    {"seed", "TQKV_SEED", OPT_VALUE, "U64", "rotation/QJL seed", 1, set_seed},
    {"namespace-policy", "TQKV_NAMESPACE_POLICY", OPT_VALUE, "NS:KEY=V,...",
     "codec policy of namespace NS (NS* = every namespace with that prefix; repeatable, "
     "the variable separates specs with ';'; see below)",
     0, NULL},
    {"eviction", "TQKV_EVICTION", OPT_VALUE, "lru|s3fifo", "eviction order (default s3fifo)", 0,
     set_eviction},
    {"ns-quota", "TQKV_NS_QUOTA", OPT_VALUE, "BYTES", "per-namespace quota (default 0: none)", 0,
     set_ns_quota},
    {"verify-crc", "TQKV_VERIFY_CRC", OPT_BOOL, NULL, "check page CRCs on every read", 0,
     set_verify_crc},
    {"metrics-listen", "TQKV_METRICS_LISTEN", OPT_VALUE, "HOST:PORT",
     "serve Prometheus /metrics here (default: off)", 0, set_metrics_listen},
    {"data-listen", "TQKV_DATA_LISTEN", OPT_VALUE, "HOST:PORT",
     "accept TCP data channels here (Get with TRANSPORT_TCP; TLS 1.3 with the gRPC "
     "certificates when --tls-cert is set, else unencrypted; default: off)",
     0, set_data_listen},
    {"auth-tokens", "TQKV_AUTH_TOKENS", OPT_VALUE, "FILE",
     "bearer token file (lines: TOKEN r|w|rw NS[,NS...]); reloaded on SIGHUP and when it "
     "changes; default: no auth",
     0, set_auth_tokens},
    {"tls-cert", "TQKV_TLS_CERT", OPT_VALUE, "FILE",
     "TLS certificate chain (PEM); with the key and client CA, reloaded on SIGHUP and when "
     "the files change (new connections get the new certificate)",
     0, set_tls_cert},
    {"tls-key", "TQKV_TLS_KEY", OPT_VALUE, "FILE", "TLS private key (PEM)", 0, set_tls_key},
    {"tls-client-ca", "TQKV_TLS_CLIENT_CA", OPT_VALUE, "FILE",
     "require client certificates signed by this CA (mutual TLS)", 0, set_tls_client_ca},
    {"drain-seconds", "TQKV_DRAIN_SECONDS", OPT_VALUE, "S",
     "on SIGTERM, time in-flight streams get to finish (default 20)", 0, set_drain_seconds},
    {"access-log", "TQKV_ACCESS_LOG", OPT_VALUE, "FILE|-",
     "one line per finished RPC (method, code, peer, tenant, duration, request id) to FILE "
     "(reopened on SIGHUP) or, with -, to the log stream; default: off",
     0, set_access_log},
    {"slow-request-ms", "TQKV_SLOW_REQUEST_MS", OPT_VALUE, "MS",
     "log RPCs that took longer than MS milliseconds at warn (default 0: off)", 0,
     set_slow_request_ms},
    {"log-level", "TQKV_LOG_LEVEL", OPT_VALUE, "debug|info|warn|error", "default info", 0,
     set_log_level},
    {"log-format", "TQKV_LOG_FORMAT", OPT_VALUE, "text|json", "default text", 0, set_log_format},
    {"help", NULL, OPT_BOOL, NULL, "print this help and exit", 0, set_help},
    {"version", NULL, OPT_BOOL, NULL, "print the version and build (ISA, CUDA, NCCL) and exit", 0,
     set_version},
};
#define N_OPTS (sizeof opts / sizeof opts[0])

/* Applies one option through its row's setter; codec policy settings go to *pol
 * (&cfg->policy, or a namespace's policy); `src` names where it came from for the error
 * line. */
static tqkv_status_t
apply(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const opt_t *o, const char *v, const char *src,
      char *err, size_t errlen)
{
    int b = 0;
    const char *why = NULL;

    if (o->kind == OPT_BOOL) {
        if (parse_bool(v, &b) != TQKV_OK) {
            why = "expected true/false, on/off or 1/0";
            goto bad;
        }
    } else if (v == NULL || *v == '\0') {
        why = "missing value";
        goto bad;
    }
    if (o->set != NULL && (why = o->set(cfg, pol, v, b)) != NULL)
        goto bad;
    return TQKV_OK;
bad:
    snprintf(err, errlen, "%s: invalid value '%s': %s", src, v ? v : "", why);
    return TQKV_EINVAL;
}

static const opt_t *
find_opt(const char *name, size_t len)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (strlen(opts[i].name) == len && !strncmp(opts[i].name, name, len))
            return &opts[i];
    return NULL;
}

/* Non-zero when argv holds --name or --name=... */
static int
flag_given(int argc, char **argv, const char *name)
{
    size_t n = strlen(name);
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--", 2) && !strncmp(argv[i] + 2, name, n) &&
            (argv[i][2 + n] == '\0' || argv[i][2 + n] == '='))
            return 1;
    return 0;
}

/* The --namespace-policy specs of one parse, kept until the global flags are all applied
 * (a spec inherits them wherever it stands on the command line). Borrowed from argv or
 * the environment. */
typedef struct ns_specs {
    const char *src; /* "--namespace-policy" or "TQKV_NAMESPACE_POLICY" */
    size_t n;
    struct {
        const char *p;
        size_t len;
    } s[TQKV_MAX_NS_POLICIES];
} ns_specs_t;

static int
is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Trims blanks around [*p, *p + *len). */
static void
trim(const char **p, size_t *len)
{
    while (*len && is_space(**p)) {
        (*p)++;
        (*len)--;
    }
    while (*len && is_space((*p)[*len - 1]))
        (*len)--;
}

static tqkv_status_t
ns_spec_add(ns_specs_t *sp, const tqkv_server_config_t *cfg, const char *src, const char *p,
            size_t len, char *err, size_t errlen)
{
    if (cfg->num_ns_policies + sp->n >= TQKV_MAX_NS_POLICIES) {
        snprintf(err, errlen, "%s: more than %d namespace policies", src, TQKV_MAX_NS_POLICIES);
        return TQKV_EINVAL;
    }
    sp->src = src;
    sp->s[sp->n].p = p;
    sp->s[sp->n].len = len;
    sp->n++;
    return TQKV_OK;
}

/* TQKV_NAMESPACE_POLICY: specs separated by ';' (empty ones skipped, so "" is none). */
static tqkv_status_t
ns_spec_add_env(ns_specs_t *sp, const tqkv_server_config_t *cfg, const char *src, const char *v,
                char *err, size_t errlen)
{
    while (*v) {
        size_t n = strcspn(v, ";");
        const char *p = v;
        size_t len = n;
        trim(&p, &len);
        if (len) {
            tqkv_status_t st = ns_spec_add(sp, cfg, src, p, len, err, errlen);
            if (st != TQKV_OK)
                return st;
        }
        v += n;
        if (*v == ';')
            v++;
    }
    return TQKV_OK;
}

/* Lists the spec keys ("key-bits, value-bits, ...") into buf. */
static void
ns_keys(char *buf, size_t cap)
{
    size_t pos = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_OPTS && pos < cap; i++)
        if (opts[i].ns)
            pos += (size_t)snprintf(buf + pos, cap - pos, "%s%s", pos ? ", " : "", opts[i].name);
}

/* Parses one spec "NS:key=value,..." (or "NS*:...") into the next cfg->ns_policies entry,
 * starting from the global policy. The namespace ends at the last ':' (keys and values
 * hold none, namespaces may). Every error names the spec. */
static tqkv_status_t
ns_spec_parse(tqkv_server_config_t *cfg, const char *src, const char *spec, size_t len, char *err,
              size_t errlen)
{
    const char *colon = NULL;
    char why[200], keys[256];
    int sl; /* how much of the spec an error quotes */

    trim(&spec, &len);
    if (len == 0) {
        snprintf(err, errlen, "%s: empty spec (expected NAMESPACE:key=value,...)", src);
        return TQKV_EINVAL;
    }
    sl = len > 400 ? 400 : (int)len;
    for (size_t i = len; i-- > 0;)
        if (spec[i] == ':') {
            colon = spec + i;
            break;
        }
    if (colon == NULL) {
        snprintf(err, errlen, "%s '%.*s': expected NAMESPACE:key=value,... (no ':')", src, sl,
                 spec);
        return TQKV_EINVAL;
    }
    tqkv_ns_policy_t *e = &cfg->ns_policies[cfg->num_ns_policies];
    size_t nl = (size_t)(colon - spec);
    uint8_t prefix = 0;
    while (nl && is_space(spec[nl - 1]))
        nl--;
    if (nl && spec[nl - 1] == '*') {
        prefix = 1;
        nl--;
    }
    if (nl == 0) {
        snprintf(err, errlen, "%s '%.*s': empty namespace%s", src, sl, spec,
                 prefix ? " prefix (the global flags already cover every namespace)" : "");
        return TQKV_EINVAL;
    }
    if (nl > TQKV_NS_POLICY_MAX_NAME) {
        snprintf(err, errlen, "%s '%.*s': namespace longer than %d bytes", src, sl, spec,
                 TQKV_NS_POLICY_MAX_NAME);
        return TQKV_EINVAL;
    }
    for (size_t i = 0; i < nl; i++) {
        unsigned char c = (unsigned char)spec[i];
        if (c < 0x21 || c > 0x7e) {
            snprintf(err, errlen,
                     "%s '%.*s': namespace byte %zu (0x%02x) is not a printable ASCII character",
                     src, sl, spec, i, c);
            return TQKV_EINVAL;
        }
    }
    for (unsigned i = 0; i < cfg->num_ns_policies; i++) {
        const tqkv_ns_policy_t *o = &cfg->ns_policies[i];
        if (o->prefix == prefix && strlen(o->ns) == nl && !memcmp(o->ns, spec, nl)) {
            snprintf(err, errlen, "%s '%.*s': duplicate namespace%s '%.*s%s' (one spec each)", src,
                     sl, spec, prefix ? " prefix" : "", (int)nl, spec, prefix ? "*" : "");
            return TQKV_EINVAL;
        }
    }
    memset(e, 0, sizeof *e);
    memcpy(e->ns, spec, nl);
    e->ns[nl] = '\0';
    e->prefix = prefix;
    e->policy = cfg->policy;

    /* key=value items separated by ','; "NS:" alone is the global policy (useful to exempt
     * one namespace from a prefix spec). */
    int bits_given = 0; /* bits_opt() of the items */
    const char *p = colon + 1;
    size_t rest = (size_t)(spec + len - p);
    trim(&p, &rest);
    const char *end = p + rest;
    for (int more = rest > 0; more;) {
        const char *item = p, *comma = memchr(p, ',', (size_t)(end - p));
        size_t il = comma ? (size_t)(comma - p) : (size_t)(end - p);
        more = comma != NULL; /* an item follows every comma, even an empty one */
        p = comma ? comma + 1 : end;
        trim(&item, &il);
        if (il == 0) {
            snprintf(err, errlen, "%s '%.*s': empty setting (expected key=value between commas)",
                     src, sl, spec);
            return TQKV_EINVAL;
        }
        const char *eq = memchr(item, '=', il);
        size_t kl = eq ? (size_t)(eq - item) : il;
        const char *key = item;
        trim(&key, &kl);
        const opt_t *o = find_opt(key, kl);
        if (o == NULL || !o->ns) {
            ns_keys(keys, sizeof keys);
            snprintf(err, errlen, "%s '%.*s': unknown key '%.*s' (keys: %s)", src, sl, spec,
                     (int)(kl > 64 ? 64 : kl), key, keys);
            return TQKV_EINVAL;
        }
        char val[128], where[600];
        const char *v = NULL;
        if (eq) {
            const char *vp = eq + 1;
            size_t vl = (size_t)(item + il - vp);
            trim(&vp, &vl);
            if (vl >= sizeof val) {
                snprintf(err, errlen, "%s '%.*s': %s: value longer than %zu bytes", src, sl, spec,
                         o->name, sizeof val - 1);
                return TQKV_EINVAL;
            }
            memcpy(val, vp, vl);
            val[vl] = '\0';
            v = val;
        } else if (o->kind != OPT_BOOL) {
            snprintf(err, errlen, "%s '%.*s': %s: missing value (expected %s=%s)", src, sl, spec,
                     o->name, o->name, o->arg);
            return TQKV_EINVAL;
        }
        snprintf(where, sizeof where, "%s '%.*s': %s", src, sl, spec, o->name);
        tqkv_status_t st = apply(cfg, &e->policy, o, v, where, err, errlen);
        if (st != TQKV_OK)
            return st;
        bits_given |= bits_opt(o->name);
    }
    const char *lc = lossless_conflict(&e->policy, bits_given & 1, bits_given & 2);
    if (lc) {
        snprintf(err, errlen, "%s '%.*s': " WHY_LOSSLESS_BITS, src, sl, spec, lc, lc);
        return TQKV_EINVAL;
    }
    if (tqkv_policy_check(&e->policy, why, sizeof why) != TQKV_OK) {
        snprintf(err, errlen, "%s '%.*s': codec policy: %s", src, sl, spec, why);
        return TQKV_EINVAL;
    }
    cfg->num_ns_policies++;
    return TQKV_OK;
}

/* TQKV_* variables read elsewhere (kernel selection, GPU encode, NCCL, tests). */
static const char *const other_env[] = {
    "TQKV_ATTN_ISA",    "TQKV_BENCH_CLOCK",     "TQKV_GPU_ENCODE",   "TQKV_ISA",
    "TQKV_NCCL_DEVICE", "TQKV_NCCL_IDLE_MS",    "TQKV_TEST_SEED",    "TQKV_SANITIZED",
    "TQKV_SOURCE_DIR",  "TQKV_TEST_QUICK",      "TQKV_FUZZ_SECONDS", "TQKV_STRESS_SECONDS",
    "TQKV_SERVER",      "TQKV_TEST_SERVER_LOG", "TQKV_FUZZ_LAST",    "TQKV_FUZZ_MUTATIONS",
};

size_t
tqkv_config_unknown_env(char *const *envp, char *out, size_t outlen)
{
    size_t n = 0, used = 0;
    if (outlen)
        out[0] = '\0';
    for (; envp && *envp; envp++) {
        const char *e = *envp, *eq = strchr(e, '=');
        size_t nl = eq ? (size_t)(eq - e) : strlen(e);
        if (nl < 5 || strncmp(e, "TQKV_", 5) != 0)
            continue;
        int known = 0;
        for (size_t i = 0; i < N_OPTS && !known; i++)
            known = opts[i].env && strlen(opts[i].env) == nl && !strncmp(opts[i].env, e, nl);
        for (size_t i = 0; i < sizeof other_env / sizeof *other_env && !known; i++)
            known = strlen(other_env[i]) == nl && !strncmp(other_env[i], e, nl);
        if (known)
            continue;
        n++;
        if (outlen && used + nl + 2 < outlen) {
            used +=
                (size_t)snprintf(out + used, outlen - used, "%s%.*s", used ? " " : "", (int)nl, e);
        }
    }
    return n;
}

/* Environment, then argv, onto cfg; namespace specs are collected into specs. */
static tqkv_status_t
parse_flags(tqkv_server_config_t *cfg, ns_specs_t *specs, int argc, char **argv, char *err,
            size_t errlen)
{
    char src[96];
    tqkv_status_t st;
    int bits_given = 0; /* bits_opt() of the global flags and variables */

    for (size_t i = 0; i < N_OPTS; i++) {
        const char *v = opts[i].env ? getenv(opts[i].env) : NULL;
        if (v == NULL || *v == '\0')
            continue; /* empty = unset, for every kind (a ConfigMap key left blank) */
        if (flag_given(argc, argv, opts[i].name))
            continue; /* the flag wins, even over a malformed variable */
        snprintf(src, sizeof src, "%s", opts[i].env);
        if (!strcmp(opts[i].name, "namespace-policy"))
            st = ns_spec_add_env(specs, cfg, opts[i].env, v, err, errlen);
        else
            st = apply(cfg, &cfg->policy, &opts[i], v, src, err, errlen);
        if (st != TQKV_OK)
            return st;
        bits_given |= bits_opt(opts[i].name);
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s' (see --help)", a);
            return TQKV_EINVAL;
        }
        a += 2;
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        const opt_t *o = find_opt(a, nl);
        if (o == NULL) {
            snprintf(err, errlen, "unknown flag '--%.*s' (see --help)", (int)nl, a);
            return TQKV_EINVAL;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (o->kind == OPT_VALUE && v == NULL) {
            if (i + 1 >= argc) {
                snprintf(err, errlen, "--%s: missing value", o->name);
                return TQKV_EINVAL;
            }
            v = argv[++i];
        }
        snprintf(src, sizeof src, "--%s", o->name);
        if (!strcmp(o->name, "namespace-policy"))
            st = ns_spec_add(specs, cfg, "--namespace-policy", v, strlen(v), err, errlen);
        else
            st = apply(cfg, &cfg->policy, o, v, src, err, errlen);
        if (st != TQKV_OK)
            return st;
        bits_given |= bits_opt(o->name);
    }
    const char *lc = lossless_conflict(&cfg->policy, bits_given & 1, bits_given & 2);
    if (lc) {
        snprintf(err, errlen, "--%s-bits: " WHY_LOSSLESS_BITS, lc, lc, lc);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

/* Flags that only make sense together, and the global policy. */
static tqkv_status_t
check_combinations(tqkv_server_config_t *cfg, char *err, size_t errlen)
{
    if ((cfg->tls_cert[0] != 0) != (cfg->tls_key[0] != 0)) {
        snprintf(err, errlen, "--tls-cert and --tls-key must be given together");
        return TQKV_EINVAL;
    }
    if (cfg->tls_client_ca[0] && !cfg->tls_cert[0]) {
        snprintf(err, errlen, "--tls-client-ca needs --tls-cert and --tls-key");
        return TQKV_EINVAL;
    }
    if ((cfg->peer_ca[0] || cfg->peer_tls_name[0]) && !cfg->tls_cert[0]) {
        snprintf(err, errlen,
                 "--%s needs --tls-cert and --tls-key (peers are dialed with TLS only by a "
                 "server that serves TLS)",
                 cfg->peer_ca[0] ? "peer-ca" : "peer-tls-name");
        return TQKV_EINVAL;
    }
    if (cfg->peer_token_file[0] && !cfg->auth_tokens[0]) {
        snprintf(err, errlen, "--peer-token-file needs --auth-tokens");
        return TQKV_EINVAL;
    }
    /* --peers in use: hand-off on SIGTERM, or forwarding */
    int peers_used = cfg->peers[0] && (cfg->handoff_seconds > 0 || !cfg->no_forward);
    if (peers_used && cfg->tls_cert[0] && !cfg->peer_ca[0] && !cfg->tls_client_ca[0]) {
        snprintf(err, errlen,
                 "--peers with --tls-cert needs --peer-ca FILE (the CA that signed the peers' "
                 "certificates; --tls-client-ca serves when given), or --handoff-seconds 0 "
                 "with --no-forward");
        return TQKV_EINVAL;
    }
    if (peers_used && cfg->auth_tokens[0] && !cfg->peer_token_file[0]) {
        snprintf(err, errlen,
                 "--peers with --auth-tokens needs --peer-token-file FILE (a token with rw on "
                 "* in the peers' --auth-tokens), or --handoff-seconds 0 with --no-forward");
        return TQKV_EINVAL;
    }
    if (cfg->store.device >= 0) {
#ifndef TQKV_HAVE_CUDA
        snprintf(err, errlen,
                 "--device %d: this tqkv-server was built without CUDA (use --hbm-standin to "
                 "back the HBM tier with host memory)",
                 cfg->store.device);
        return TQKV_EINVAL;
#else
        if (cfg->store.hbm_standin) {
            snprintf(err, errlen, "--device and --hbm-standin are mutually exclusive");
            return TQKV_EINVAL;
        }
#endif
    }
    if (cfg->store.hbm_capacity > 0 && cfg->store.device < 0 && !cfg->store.hbm_standin) {
        snprintf(err, errlen, "--hbm-capacity needs --device N (a GPU) or --hbm-standin");
        return TQKV_EINVAL;
    }
    if (!cfg->store.disk_path[0] != !cfg->store.disk_capacity) {
        snprintf(err, errlen, "--disk-path and --disk-capacity must be given together");
        return TQKV_EINVAL;
    }
    char why[200];
    if (tqkv_policy_check(&cfg->policy, why, sizeof why) != TQKV_OK) {
        snprintf(err, errlen, "codec policy: %s", why);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

tqkv_status_t
tqkv_config_parse(tqkv_server_config_t *cfg, int argc, char **argv, char *err, size_t errlen)
{
    ns_specs_t specs = {0};
    tqkv_status_t st = parse_flags(cfg, &specs, argc, argv, err, errlen);

    if (st != TQKV_OK || cfg->help || cfg->version)
        return st;
    if ((st = check_combinations(cfg, err, errlen)) != TQKV_OK)
        return st;
    /* Namespace specs last: unspecified keys inherit the global flags, wherever given. */
    for (size_t i = 0; i < specs.n; i++)
        if ((st = ns_spec_parse(cfg, specs.src, specs.s[i].p, specs.s[i].len, err, errlen)) !=
            TQKV_OK)
            return st;
    return TQKV_OK;
}

const tqkv_policy_t *
tqkv_config_ns_policy(const tqkv_server_config_t *cfg, const char *ns, size_t len)
{
    const tqkv_policy_t *best = &cfg->policy;
    size_t best_len = 0;
    for (unsigned i = 0; i < cfg->num_ns_policies; i++) {
        const tqkv_ns_policy_t *e = &cfg->ns_policies[i];
        size_t el = strlen(e->ns);
        if (el > len || memcmp(e->ns, ns, el) != 0)
            continue;
        if (!e->prefix) {
            if (el == len)
                return &e->policy; /* exact beats any prefix */
        } else if (el > best_len) {
            best = &e->policy;
            best_len = el;
        }
    }
    return best;
}

static const char *
mode_name(uint8_t mode)
{
    return mode == TQKV_MODE_RAW ? "lossless" : mode == TQKV_MODE_PROD ? "prod" : "mse";
}

/* "3/mse/nc", or "lossless" for a raw tensor (its kept bits do not apply). */
static const char *
tensor_format(const tqkv_tensor_codec_t *t, char *buf, size_t len)
{
    if (t->mode == TQKV_MODE_RAW)
        snprintf(buf, len, "lossless");
    else
        snprintf(buf, len, "%g/%s%s", t->bits_x2 / 2.0, mode_name(t->mode),
                 t->norm_correction ? "/nc" : "");
    return buf;
}

void
tqkv_config_policy_format(const tqkv_policy_t *p, char *buf, size_t len)
{
    char k[32], v[32], kb[32], vb[32];
    snprintf(buf, len,
             "key=%s value=%s boundary_layers=%u boundary_key=%s boundary_value=%s rotation=%s "
             "key_centering=%s seed=%llu",
             tensor_format(&p->k, k, sizeof k), tensor_format(&p->v, v, sizeof v),
             p->boundary_layers, tensor_format(&p->k_boundary, kb, sizeof kb),
             tensor_format(&p->v_boundary, vb, sizeof vb),
             p->rotation == TQKV_ROT_DENSE ? "dense" : "hadamard", p->key_centering ? "on" : "off",
             (unsigned long long)p->seed);
}

void
tqkv_config_usage(FILE *out)
{
    fprintf(out, "usage: tqkv-server [FLAGS]\n\n"
                 "KV-cache offload service with TurboQuant compression (gRPC tqkv.v1.KVCache).\n"
                 "Every flag has an environment variable; a flag wins over its variable.\n\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", opts[i].name, opts[i].arg ? " " : "",
                 opts[i].arg ? opts[i].arg : "");
        fprintf(out, "  %-34s %s", left, opts[i].help);
        if (opts[i].env)
            fprintf(out, " [%s]", opts[i].env);
        fputc('\n', out);
    }
    tqkv_policy_t p;
    tqkv_policy_default(&p);
    fprintf(out,
            "\nCodec defaults: keys %g bits %s, values %g bits %s; the first and last %u layers "
            "at %g/%g bits; rotation %s; key centering %s; seed %llu.\n",
            p.k.bits_x2 / 2.0, p.k.mode == TQKV_MODE_PROD ? "prod" : "mse", p.v.bits_x2 / 2.0,
            p.v.mode == TQKV_MODE_PROD ? "prod" : "mse", p.boundary_layers,
            p.k_boundary.bits_x2 / 2.0, p.v_boundary.bits_x2 / 2.0,
            p.rotation == TQKV_ROT_HADAMARD ? "hadamard" : "dense", p.key_centering ? "on" : "off",
            (unsigned long long)p.seed);
    fprintf(out, "\nNamespace policies: --namespace-policy NS:KEY=VALUE,... gives namespace NS "
                 "its own codec\npolicy. KEY is a codec flag above without \"--\":");
    int col = 47; /* the width of the line so far */
    for (size_t i = 0; i < N_OPTS; i++) {
        if (!opts[i].ns)
            continue;
        if (col + strlen(opts[i].name) > 90) {
            fprintf(out, "\n   ");
            col = 3;
        }
        col += fprintf(out, " %s", opts[i].name);
    }
    fprintf(out,
            ".\nKeys a spec leaves out inherit the global flags, wherever these are given. NS "
            "ending in\n'*' is a prefix: an exact spec beats any prefix, a longer prefix a "
            "shorter one; \"NS:\" alone\ngives NS the global policy. Repeatable, at most %d "
            "specs; TQKV_NAMESPACE_POLICY separates\nspecs with ';'. The server logs each "
            "effective policy at start-up (\"codec policy\" lines).\nExample:\n"
            "  --namespace-policy 'team-*:key-bits=4,value-bits=4'\n"
            "  --namespace-policy 'scratch:key-bits=2,value-bits=2,boundary-layers=0'\n"
            "  --namespace-policy 'exact:lossless'  (BF16 kept as is; Gets return the bytes "
            "Put)\n",
            TQKV_MAX_NS_POLICIES);
    fprintf(out, "Boolean flags take an optional =true/false. Exit status 2 on bad flags.\n");
}

int
tqkv_config_listen_is_public(const char *listen)
{
    const char *colon = strrchr(listen, ':');
    size_t n = colon ? (size_t)(colon - listen) : strlen(listen);
    char host[256];
    if (n >= sizeof host)
        return 1;
    memcpy(host, listen, n);
    host[n] = '\0';
    if (!strncmp(host, "127.", 4) || !strcmp(host, "localhost") || !strcmp(host, "[::1]") ||
        !strcmp(host, "::1") || !strncmp(host, "unix", 4))
        return 0;
    return 1;
}
