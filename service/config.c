/* config.c - flags and TQKV_* environment variables of tqkv-server.
 *
 * One table drives parsing, the environment and --help, so they cannot drift:
 * each option has a flag name, an environment variable, a kind, the fields it sets (by
 * offset) with their bounds, and a help line. No option has code of its own.
 */
#include "service/config.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* What an option's value is and how it is stored. */
typedef enum opt_kind {
    OPT_BOOL,      /* =true/false (optional) into int or uint8_t fields */
    OPT_LOSSLESS,  /* a boolean: every tensor mode of the policy lossless (set_lossless) */
    OPT_STR,       /* a path or list into char[size] (why: too long) */
    OPT_LISTEN,    /* HOST:PORT (listen_ok) into char[size] */
    OPT_NAME,      /* printable ASCII without blanks (node_id_ok) into char[size] */
    OPT_UINT,      /* an integer in min..max into an unsigned field of size bytes */
    OPT_BYTES,     /* a byte count (K/M/G/T suffixes) in min..max into a uint64_t */
    OPT_BITS,      /* a bit width (tqkv_bits_parse) into uint8_t bits_x2 fields */
    OPT_CHOICE,    /* one of `choices` into an integer field of size bytes */
    OPT_LOG_LEVEL, /* tqkv_log_level_parse */
    OPT_LOG_FORMAT,
    OPT_NS_POLICY, /* --namespace-policy: collected by the parser, applied last */
} opt_kind_t;

/* A named value of an OPT_CHOICE option. */
typedef struct opt_choice {
    const char *name;
    int value;
} opt_choice_t;

#define OPT_MAX_FIELDS 4

/* One option: flag, variable, help, and where and how its value is stored. Options
 * with `ns` set are codec policy settings: they set fields of a tqkv_policy_t (the
 * global policy or a namespace's); the others set fields of tqkv_server_config_t. */
typedef struct opt {
    const char *name; /* flag without "--" */
    const char *env;  /* environment variable */
    opt_kind_t kind;
    const char *arg; /* value placeholder for --help */
    const char *help;
    int ns; /* 1: a codec policy setting, also a key of --namespace-policy specs */
    size_t off[OPT_MAX_FIELDS]; /* the fields set (one value, several places) */
    int noff;
    size_t size;                 /* bytes of each field */
    uint64_t min, max;           /* OPT_UINT, OPT_BYTES */
    const char *why;             /* the error for a value that does not parse (NULL: the kind's) */
    const char *why_range;       /* the error for one outside min..max (NULL: why) */
    const opt_choice_t *choices; /* OPT_CHOICE, ended by a NULL name */
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

/* A node id: printable ASCII without blanks (it goes into log lines and metric labels). */
static int
node_id_ok(const char *v)
{
    for (const char *p = v; *p; p++)
        if (*p <= ' ' || *p > '~' || *p == '"' || *p == '\\')
            return 0;
    return 1;
}

/* ---- the option table: parsing, the environment and --help ---- */

#define WHY_LISTEN "expected HOST:PORT with a port in 0..65535"
#define WHY_BYTES "expected a byte count such as 512M or 8G"
#define WHY_BITS "expected 1, 1.5, 2, 2.5, 3, 3.5 or 4"
#define WHY_PATH "path too long"
#define WHY_THREADS "expected an integer in 1..1024"
#define WHY_SECONDS "expected seconds in 0..3600"

/* Field f of the server config / of a codec policy (which makes the option a policy
 * setting). */
#define FIELD_SIZE(type, f) sizeof(((type *)0)->f)
#define CFG(f)                                                                                     \
    .off = {offsetof(tqkv_server_config_t, f)}, .noff = 1,                                         \
    .size = FIELD_SIZE(tqkv_server_config_t, f)
#define POL(f)                                                                                     \
    .ns = 1, .off = {offsetof(tqkv_policy_t, f)}, .noff = 1, .size = FIELD_SIZE(tqkv_policy_t, f)
/* A mode of keys or values: the middle and boundary layers' alike. */
#define POL_MODE(t)                                                                                \
    .ns = 1, .off = {offsetof(tqkv_policy_t, t.mode), offsetof(tqkv_policy_t, t##_boundary.mode)}, \
    .noff = 2, .size = FIELD_SIZE(tqkv_policy_t, t.mode)

static const opt_choice_t modes[] = {
    {"mse", TQKV_MODE_MSE}, {"prod", TQKV_MODE_PROD}, {"lossless", TQKV_MODE_RAW}, {NULL, 0}};
static const opt_choice_t rotations[] = {
    {"dense", TQKV_ROT_DENSE}, {"hadamard", TQKV_ROT_HADAMARD}, {NULL, 0}};
static const opt_choice_t evictions[] = {
    {"lru", TQKV_EVICT_LRU}, {"s3fifo", TQKV_EVICT_S3FIFO}, {NULL, 0}};
static const opt_choice_t disk_syncs[] = {{"none", 0}, {"batch", 1}, {"always", 2}, {NULL, 0}};

static const opt_t opts[] = {
    {"listen", "TQKV_LISTEN", OPT_LISTEN, "HOST:PORT",
     "gRPC address (default 127.0.0.1:50051; port 0 picks a free port)", CFG(listen)},
    {"node-id", "TQKV_NODE_ID", OPT_NAME, "NAME",
     "stable identity clients rank this server by (default: HOSTNAME:PORT, e.g. "
     "tqkv-0:50051 in a StatefulSet: stable across restarts, unique per host)",
     CFG(node_id), .why = "expected 1..255 printable characters, no blanks"},
    {"peers", "TQKV_PEERS", OPT_STR, "NAME[,NAME...]",
     "the other servers (a headless Service NAME:PORT, or addresses): on SIGTERM, hand "
     "pages off to them, hottest first, each to its block's next-ranked live peer; and "
     "forward blocks a peer owns to it (default: none)",
     CFG(peers), .why = "too long"},
    {"peers-dns", "TQKV_PEERS_DNS", OPT_STR, "IP:PORT[,...]",
     "DNS servers for --peers (default: the system's)", CFG(peers_dns), .why = "too long"},
    {"handoff-seconds", "TQKV_HANDOFF_SECONDS", OPT_UINT, "S",
     "time budget of the hand-off on SIGTERM (default 10; 0 = no hand-off); before the drain",
     CFG(handoff_seconds), .max = 3600, .why = WHY_SECONDS},
    {"handoff-bytes", "TQKV_HANDOFF_BYTES", OPT_BYTES, "BYTES",
     "byte budget of the hand-off (default 0: no limit)", CFG(handoff_bytes), .max = UINT64_MAX},
    {"replicate-bytes-per-s", "TQKV_REPLICATE_BYTES_PER_S", OPT_BYTES, "BYTES",
     "with --peers: keep each block this server holds on the two servers that rank first "
     "for it, putting it to the other one when it lacks it (after a peer restarted, "
     "joined or left), at most BYTES per second (default 0: off)",
     CFG(replicate_bytes_per_s), .max = UINT64_MAX},
    {"no-forward", "TQKV_NO_FORWARD", OPT_BOOL, NULL,
     "with --peers: do not forward Put/Lookup/Get of blocks a peer owns to it (one hop; "
     "for clients that reach one pod, e.g. through the load-balanced Service)",
     CFG(no_forward)},
    {"peer-ca", "TQKV_PEER_CA", OPT_STR, "FILE",
     "with --peers and --tls-cert: the CA (PEM) that signed the peers' certificates; peers "
     "are dialed with TLS and verified against it (default: --tls-client-ca; one of the two "
     "is needed)",
     CFG(peer_ca)},
    {"peer-tls-name", "TQKV_PEER_TLS_NAME", OPT_NAME, "NAME",
     "the name the peers' certificates must hold (default: the --peers name dialed, e.g. "
     "tqkv-headless)",
     CFG(peer_tls_name), .why = "expected a DNS name (1..255 printable characters, no blanks)"},
    {"peer-token-file", "TQKV_PEER_TOKEN_FILE", OPT_STR, "FILE",
     "with --peers and --auth-tokens: the bearer token the hand-off sends (one token; it "
     "must have rw on * in --auth-tokens); read at start and at each hand-off",
     CFG(peer_token_file)},
    {"threads", "TQKV_THREADS", OPT_UINT, "N", "gRPC worker threads (default: CPU count)",
     CFG(threads), .min = 1, .max = 1024, .why = WHY_THREADS},
    {"encoder-threads", "TQKV_ENCODER_THREADS", OPT_UINT, "N",
     "encode/decode pool threads (default: CPU count)", CFG(encoder_threads), .min = 1, .max = 1024,
     .why = WHY_THREADS},
    {"dram-capacity", "TQKV_DRAM_CAPACITY", OPT_BYTES, "BYTES",
     "DRAM tier capacity, K/M/G/T suffixes (default 1G)", CFG(store.dram_capacity), .min = 1,
     .max = UINT64_MAX, .why_range = "must be greater than 0"},
    {"hbm-capacity", "TQKV_HBM_CAPACITY", OPT_BYTES, "BYTES", "HBM tier capacity (default 0: none)",
     CFG(store.hbm_capacity), .max = UINT64_MAX},
    {"hbm-standin", "TQKV_HBM_STANDIN", OPT_BOOL, NULL,
     "back the HBM tier with host memory (no GPU needed)", CFG(store.hbm_standin)},
    {"device", "TQKV_DEVICE", OPT_UINT, "N", "CUDA device for the HBM tier (default: none)",
     CFG(store.device), .max = 1023, .why = "expected a CUDA device index"},
    {"disk-path", "TQKV_DISK_PATH", OPT_STR, "DIR",
     "disk tier below DRAM in DIR (created if absent; a restart on it comes back warm; "
     "default: none)",
     CFG(store.disk_path)},
    {"disk-capacity", "TQKV_DISK_CAPACITY", OPT_BYTES, "BYTES",
     "disk tier capacity in bytes of segment files (needed with --disk-path)",
     CFG(store.disk_capacity), .min = 1u << 20, .max = UINT64_MAX,
     .why = "expected a byte count of at least 1M, such as 500G"},
    {"disk-sync", "TQKV_DISK_SYNC", OPT_CHOICE, "none|batch|always",
     "what a crash may lose: batch (default) and none the last 10 ms of Puts; always: "
     "nothing acknowledged (proto/DISK_FORMAT.md)",
     CFG(store.disk_sync), .choices = disk_syncs, .why = "expected none, batch or always"},
    {"max-message-bytes", "TQKV_MAX_MESSAGE_BYTES", OPT_BYTES, "BYTES",
     "largest gRPC message received or sent (default 64M)", CFG(max_message_bytes), .min = 4096,
     .max = 0x7fffffffull, .why_range = "must be in 4K..2G-1"},
    {"max-streams", "TQKV_MAX_STREAMS", OPT_UINT, "N",
     "concurrent streams per connection (default 256)", CFG(max_streams), .min = 1, .max = 1u << 20,
     .why = "expected an integer in 1..1048576"},
    {"key-bits", "TQKV_KEY_BITS", OPT_BITS, "B", "key bits: 1, 1.5, 2, 2.5, 3, 3.5, 4",
     POL(k.bits_x2)},
    {"value-bits", "TQKV_VALUE_BITS", OPT_BITS, "B", "value bits: 1, 1.5, 2, 2.5, 3, 3.5, 4",
     POL(v.bits_x2)},
    {"key-mode", "TQKV_KEY_MODE", OPT_CHOICE, "mse|prod|lossless",
     "key quantizer (lossless: BF16 kept as is, no bits)", POL_MODE(k), .choices = modes,
     .why = "expected mse, prod or lossless"},
    {"value-mode", "TQKV_VALUE_MODE", OPT_CHOICE, "mse|prod|lossless",
     "value quantizer (lossless: BF16 kept as is, no bits)", POL_MODE(v), .choices = modes,
     .why = "expected mse, prod or lossless"},
    {"lossless", "TQKV_LOSSLESS", OPT_LOSSLESS, NULL,
     "store K and V as BF16, byte-exact (key-mode and value-mode lossless)", .ns = 1},
    {"boundary-layers", "TQKV_BOUNDARY_LAYERS", OPT_UINT, "N",
     "first/last N layers at boundary precision", POL(boundary_layers), .max = 512,
     .why = "expected an integer in 0..512"},
    {"boundary-key-bits", "TQKV_BOUNDARY_KEY_BITS", OPT_BITS, "B", "key bits of boundary layers",
     POL(k_boundary.bits_x2)},
    {"boundary-value-bits", "TQKV_BOUNDARY_VALUE_BITS", OPT_BITS, "B",
     "value bits of boundary layers", POL(v_boundary.bits_x2)},
    {"rotation", "TQKV_ROTATION", OPT_CHOICE, "dense|hadamard", "random rotation kind",
     POL(rotation), .choices = rotations, .why = "expected dense or hadamard"},
    {"norm-correction", "TQKV_NORM_CORRECTION", OPT_BOOL, NULL,
     "store ||x||/||c[idx]|| so decoded vectors keep their norm", .ns = 1,
     .off = {offsetof(tqkv_policy_t, k.norm_correction), offsetof(tqkv_policy_t, v.norm_correction),
             offsetof(tqkv_policy_t, k_boundary.norm_correction),
             offsetof(tqkv_policy_t, v_boundary.norm_correction)},
     .noff = 4, .size = FIELD_SIZE(tqkv_policy_t, k.norm_correction)},
    {"key-centering", "TQKV_KEY_CENTERING", OPT_BOOL, NULL,
     "subtract each block's per-channel key mean before encoding", POL(key_centering)},
    {"seed", "TQKV_SEED", OPT_UINT, "U64", "rotation/QJL seed", POL(seed), .max = UINT64_MAX,
     .why = "expected an unsigned 64-bit integer"},
    {"namespace-policy", "TQKV_NAMESPACE_POLICY", OPT_NS_POLICY, "NS:KEY=V,...",
     "codec policy of namespace NS (NS* = every namespace with that prefix; repeatable, "
     "the variable separates specs with ';'; see below)",
     .noff = 0},
    {"eviction", "TQKV_EVICTION", OPT_CHOICE, "lru|s3fifo", "eviction order (default s3fifo)",
     CFG(store.policy), .choices = evictions, .why = "expected lru or s3fifo"},
    {"ns-quota", "TQKV_NS_QUOTA", OPT_BYTES, "BYTES", "per-namespace quota (default 0: none)",
     CFG(store.default_ns_quota), .max = UINT64_MAX},
    {"verify-crc", "TQKV_VERIFY_CRC", OPT_BOOL, NULL, "check page CRCs on every read",
     CFG(store.verify_crc)},
    {"metrics-listen", "TQKV_METRICS_LISTEN", OPT_LISTEN, "HOST:PORT",
     "serve Prometheus /metrics here (default: off)", CFG(metrics_listen)},
    {"data-listen", "TQKV_DATA_LISTEN", OPT_LISTEN, "HOST:PORT",
     "accept TCP data channels here (Get with TRANSPORT_TCP; TLS 1.3 with the gRPC "
     "certificates when --tls-cert is set, else unencrypted; default: off)",
     CFG(data_listen)},
    {"auth-tokens", "TQKV_AUTH_TOKENS", OPT_STR, "FILE",
     "bearer token file (lines: TOKEN r|w|rw NS[,NS...]); reloaded on SIGHUP and when it "
     "changes; default: no auth",
     CFG(auth_tokens)},
    {"tls-cert", "TQKV_TLS_CERT", OPT_STR, "FILE",
     "TLS certificate chain (PEM); with the key and client CA, reloaded on SIGHUP and when "
     "the files change (new connections get the new certificate)",
     CFG(tls_cert)},
    {"tls-key", "TQKV_TLS_KEY", OPT_STR, "FILE", "TLS private key (PEM)", CFG(tls_key)},
    {"tls-client-ca", "TQKV_TLS_CLIENT_CA", OPT_STR, "FILE",
     "require client certificates signed by this CA (mutual TLS)", CFG(tls_client_ca)},
    {"drain-seconds", "TQKV_DRAIN_SECONDS", OPT_UINT, "S",
     "on SIGTERM, time in-flight streams get to finish (default 20)", CFG(drain_seconds),
     .max = 3600, .why = WHY_SECONDS},
    {"access-log", "TQKV_ACCESS_LOG", OPT_STR, "FILE|-",
     "one line per finished RPC (method, code, peer, tenant, duration, request id) to FILE "
     "(reopened on SIGHUP) or, with -, to the log stream; default: off",
     CFG(access_log)},
    {"slow-request-ms", "TQKV_SLOW_REQUEST_MS", OPT_UINT, "MS",
     "log RPCs that took longer than MS milliseconds at warn (default 0: off)",
     CFG(slow_request_ms), .max = 86400000, .why = "expected milliseconds in 0..86400000"},
    {"log-level", "TQKV_LOG_LEVEL", OPT_LOG_LEVEL, "debug|info|warn|error", "default info",
     CFG(log_level), .why = "expected debug, info, warn or error"},
    {"log-format", "TQKV_LOG_FORMAT", OPT_LOG_FORMAT, "text|json", "default text", CFG(log_format),
     .why = "expected text or json"},
    {"help", NULL, OPT_BOOL, NULL, "print this help and exit", CFG(help)},
    {"version", NULL, OPT_BOOL, NULL, "print the version and build (ISA, CUDA, NCCL) and exit",
     CFG(version)},
};
#define N_OPTS (sizeof opts / sizeof opts[0])

/* Whether option o takes an optional =true/false. */
#define OPT_IS_BOOL(o) ((o)->kind == OPT_BOOL || (o)->kind == OPT_LOSSLESS)

/* --lossless: K and V of every layer stored as BF16 (raw pages); =false makes lossless
 * tensors mse again (their bits were kept). */
static void
set_lossless(tqkv_policy_t *pol, int b)
{
    tqkv_tensor_codec_t *t[4] = {&pol->k, &pol->v, &pol->k_boundary, &pol->v_boundary};
    for (int i = 0; i < 4; i++)
        if (b)
            t[i]->mode = TQKV_MODE_RAW;
        else if (t[i]->mode == TQKV_MODE_RAW)
            t[i]->mode = TQKV_MODE_MSE;
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

/* Stores v into the fields of base (the server config, or a codec policy for a policy
 * setting) that row o names; b is the parsed value of an OPT_BOOL. Returns NULL, or why v
 * is not valid (nothing stored then). */
static const char *
set_fields(void *base, const opt_t *o, const char *v, int b)
{
    unsigned long long u = 0;
    uint64_t bytes;
    uint8_t b2;
    char *f = (char *)base + o->off[0];
    switch (o->kind) {
    case OPT_BOOL:
        u = (unsigned long long)b;
        break;
    case OPT_LOSSLESS:
        set_lossless((tqkv_policy_t *)base, b);
        return NULL;
    case OPT_STR:
        return copy_str(f, o->size, v) ? (o->why ? o->why : WHY_PATH) : NULL;
    case OPT_LISTEN:
        return !listen_ok(v) || copy_str(f, o->size, v) ? WHY_LISTEN : NULL;
    case OPT_NAME:
        return !node_id_ok(v) || copy_str(f, o->size, v) ? o->why : NULL;
    case OPT_UINT:
        if (parse_uint(v, o->max, &u) != TQKV_OK || u < o->min)
            return o->why;
        break;
    case OPT_BYTES:
        if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK)
            return o->why ? o->why : WHY_BYTES;
        if (bytes < o->min || bytes > o->max)
            return o->why_range ? o->why_range : o->why ? o->why : WHY_BYTES;
        u = bytes;
        break;
    case OPT_BITS:
        if (tqkv_bits_parse(v, &b2) != TQKV_OK)
            return WHY_BITS;
        u = b2;
        break;
    case OPT_CHOICE: {
        const opt_choice_t *c = o->choices;
        while (c->name != NULL && strcmp(c->name, v) != 0)
            c++;
        if (c->name == NULL)
            return o->why;
        u = (unsigned long long)c->value;
        break;
    }
    case OPT_LOG_LEVEL:
        return tqkv_log_level_parse(v, (tqkv_log_level_t *)f) != TQKV_OK ? o->why : NULL;
    case OPT_LOG_FORMAT:
        return tqkv_log_format_parse(v, (tqkv_log_format_t *)f) != TQKV_OK ? o->why : NULL;
    case OPT_NS_POLICY:
        return NULL; /* the parser collects the specs */
    }
    for (int i = 0; i < o->noff; i++) {
        f = (char *)base + o->off[i];
        if (o->size == 1) {
            uint8_t x = (uint8_t)u;
            memcpy(f, &x, 1);
        } else if (o->size == 4) {
            uint32_t x = (uint32_t)u; /* unsigned, int and enum fields alike */
            memcpy(f, &x, 4);
        } else {
            uint64_t x = (uint64_t)u;
            memcpy(f, &x, 8);
        }
    }
    return NULL;
}

/* Applies one option through its row; codec policy settings go to *pol
 * (&cfg->policy, or a namespace's policy); `src` names where it came from for the error
 * line. */
static tqkv_status_t
apply(tqkv_server_config_t *cfg, tqkv_policy_t *pol, const opt_t *o, const char *v, const char *src,
      char *err, size_t errlen)
{
    int b = 0;
    const char *why = NULL;

    if (OPT_IS_BOOL(o)) {
        if (parse_bool(v, &b) != TQKV_OK) {
            why = "expected true/false, on/off or 1/0";
            goto bad;
        }
    } else if (v == NULL || *v == '\0') {
        why = "missing value";
        goto bad;
    }
    if ((why = set_fields(o->ns ? (void *)pol : (void *)cfg, o, v, b)) != NULL)
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
        } else if (!OPT_IS_BOOL(o)) {
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
        if (!OPT_IS_BOOL(o) && v == NULL) {
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
