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

typedef struct opt {
    const char *name; /* flag without "--" */
    const char *env;  /* environment variable */
    opt_kind_t kind;
    const char *arg; /* value placeholder for --help */
    const char *help;
} opt_t;

static const opt_t opts[] = {
    {"listen", "TQKV_LISTEN", OPT_VALUE, "HOST:PORT",
     "gRPC address (default 127.0.0.1:50051; port 0 picks a free port)"},
    {"threads", "TQKV_THREADS", OPT_VALUE, "N", "gRPC worker threads (default: CPU count)"},
    {"encoder-threads", "TQKV_ENCODER_THREADS", OPT_VALUE, "N",
     "encode/decode pool threads (default: CPU count)"},
    {"dram-capacity", "TQKV_DRAM_CAPACITY", OPT_VALUE, "BYTES",
     "DRAM tier capacity, K/M/G/T suffixes (default 1G)"},
    {"hbm-capacity", "TQKV_HBM_CAPACITY", OPT_VALUE, "BYTES",
     "HBM tier capacity (default 0: none)"},
    {"hbm-standin", "TQKV_HBM_STANDIN", OPT_BOOL, NULL,
     "back the HBM tier with host memory (no GPU needed)"},
    {"device", "TQKV_DEVICE", OPT_VALUE, "N", "CUDA device for the HBM tier (default: none)"},
    {"max-message-bytes", "TQKV_MAX_MESSAGE_BYTES", OPT_VALUE, "BYTES",
     "largest gRPC message received or sent (default 64M)"},
    {"max-streams", "TQKV_MAX_STREAMS", OPT_VALUE, "N",
     "concurrent streams per connection (default 256)"},
    {"key-bits", "TQKV_KEY_BITS", OPT_VALUE, "B", "key bits: 1, 1.5, 2, 2.5, 3, 3.5, 4"},
    {"value-bits", "TQKV_VALUE_BITS", OPT_VALUE, "B", "value bits: 1, 1.5, 2, 2.5, 3, 3.5, 4"},
    {"key-mode", "TQKV_KEY_MODE", OPT_VALUE, "mse|prod", "key quantizer"},
    {"value-mode", "TQKV_VALUE_MODE", OPT_VALUE, "mse|prod", "value quantizer"},
    {"boundary-layers", "TQKV_BOUNDARY_LAYERS", OPT_VALUE, "N",
     "first/last N layers at boundary precision"},
    {"boundary-key-bits", "TQKV_BOUNDARY_KEY_BITS", OPT_VALUE, "B", "key bits of boundary layers"},
    {"boundary-value-bits", "TQKV_BOUNDARY_VALUE_BITS", OPT_VALUE, "B",
     "value bits of boundary layers"},
    {"rotation", "TQKV_ROTATION", OPT_VALUE, "dense|hadamard", "random rotation kind"},
    {"norm-correction", "TQKV_NORM_CORRECTION", OPT_BOOL, NULL,
     "store ||x||/||c[idx]|| so decoded vectors keep their norm"},
    {"key-centering", "TQKV_KEY_CENTERING", OPT_BOOL, NULL,
     "subtract each block's per-channel key mean before encoding"},
    {"seed", "TQKV_SEED", OPT_VALUE, "U64", "rotation/QJL seed"},
    {"eviction", "TQKV_EVICTION", OPT_VALUE, "lru|s3fifo", "eviction order (default s3fifo)"},
    {"ns-quota", "TQKV_NS_QUOTA", OPT_VALUE, "BYTES", "per-namespace quota (default 0: none)"},
    {"verify-crc", "TQKV_VERIFY_CRC", OPT_BOOL, NULL, "check page CRCs on every read"},
    {"metrics-listen", "TQKV_METRICS_LISTEN", OPT_VALUE, "HOST:PORT",
     "serve Prometheus /metrics here (default: off)"},
    {"auth-tokens", "TQKV_AUTH_TOKENS", OPT_VALUE, "FILE",
     "bearer token file (lines: TOKEN r|w|rw NS[,NS...]); default: no auth"},
    {"tls-cert", "TQKV_TLS_CERT", OPT_VALUE, "FILE", "TLS certificate chain (PEM)"},
    {"tls-key", "TQKV_TLS_KEY", OPT_VALUE, "FILE", "TLS private key (PEM)"},
    {"tls-client-ca", "TQKV_TLS_CLIENT_CA", OPT_VALUE, "FILE",
     "require client certificates signed by this CA (mutual TLS)"},
    {"drain-seconds", "TQKV_DRAIN_SECONDS", OPT_VALUE, "S",
     "on SIGTERM, time in-flight streams get to finish (default 20)"},
    {"log-level", "TQKV_LOG_LEVEL", OPT_VALUE, "debug|info|warn|error", "default info"},
    {"log-format", "TQKV_LOG_FORMAT", OPT_VALUE, "text|json", "default text"},
    {"help", NULL, OPT_BOOL, NULL, "print this help and exit"},
};
#define N_OPTS (sizeof opts / sizeof opts[0])

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

/* Checks HOST:PORT: a non-empty host (or [v6]) and a port 0..65535. */
static int
listen_ok(const char *v)
{
    const char *colon = strrchr(v, ':');
    unsigned long long port;
    if (colon == NULL || colon == v)
        return 0;
    return parse_uint(colon + 1, 65535, &port) == TQKV_OK;
}

/* Applies one option; `src` names where it came from for the error line. */
static tqkv_status_t
apply(tqkv_server_config_t *cfg, const opt_t *o, const char *v, const char *src, char *err,
      size_t errlen)
{
    const char *n = o->name;
    unsigned long long u;
    uint64_t bytes;
    int b;
    tqkv_status_t st = TQKV_OK;
    const char *why = NULL;

    if (o->kind == OPT_BOOL) {
        if (parse_bool(v, &b) != TQKV_OK) {
            why = "expected true/false, on/off or 1/0";
            goto bad;
        }
        if (!strcmp(n, "hbm-standin"))
            cfg->store.hbm_standin = b;
        else if (!strcmp(n, "norm-correction"))
            cfg->policy.k.norm_correction = cfg->policy.v.norm_correction =
                cfg->policy.k_boundary.norm_correction = cfg->policy.v_boundary.norm_correction =
                    (uint8_t)b;
        else if (!strcmp(n, "key-centering"))
            cfg->policy.key_centering = (uint8_t)b;
        else if (!strcmp(n, "verify-crc"))
            cfg->store.verify_crc = b;
        else if (!strcmp(n, "help"))
            cfg->help = b;
        return TQKV_OK;
    }
    if (v == NULL || *v == '\0') {
        why = "missing value";
        goto bad;
    }
    if (!strcmp(n, "listen")) {
        if (!listen_ok(v) || copy_str(cfg->listen, sizeof cfg->listen, v)) {
            why = "expected HOST:PORT with a port in 0..65535";
            goto bad;
        }
    } else if (!strcmp(n, "metrics-listen")) {
        if (!listen_ok(v) || copy_str(cfg->metrics_listen, sizeof cfg->metrics_listen, v)) {
            why = "expected HOST:PORT with a port in 0..65535";
            goto bad;
        }
    } else if (!strcmp(n, "threads") || !strcmp(n, "encoder-threads")) {
        if (parse_uint(v, 1024, &u) != TQKV_OK || u == 0) {
            why = "expected an integer in 1..1024";
            goto bad;
        }
        if (n[0] == 't')
            cfg->threads = (unsigned)u;
        else
            cfg->encoder_threads = (unsigned)u;
    } else if (!strcmp(n, "dram-capacity") || !strcmp(n, "hbm-capacity") ||
               !strcmp(n, "ns-quota") || !strcmp(n, "max-message-bytes")) {
        if (tqkv_config_parse_bytes(v, &bytes) != TQKV_OK) {
            why = "expected a byte count such as 512M or 8G";
            goto bad;
        }
        if (n[0] == 'd') {
            if (bytes == 0) {
                why = "must be greater than 0";
                goto bad;
            }
            cfg->store.dram_capacity = bytes;
        } else if (n[0] == 'h') {
            cfg->store.hbm_capacity = bytes;
        } else if (n[0] == 'n') {
            cfg->store.default_ns_quota = bytes;
        } else {
            if (bytes < 4096 || bytes > 0x7fffffffull) {
                why = "must be in 4K..2G-1";
                goto bad;
            }
            cfg->max_message_bytes = bytes;
        }
    } else if (!strcmp(n, "device")) {
        if (parse_uint(v, 1023, &u) != TQKV_OK) {
            why = "expected a CUDA device index";
            goto bad;
        }
        cfg->store.device = (int)u;
    } else if (!strcmp(n, "max-streams")) {
        if (parse_uint(v, 1u << 20, &u) != TQKV_OK || u == 0) {
            why = "expected an integer in 1..1048576";
            goto bad;
        }
        cfg->max_streams = (unsigned)u;
    } else if (!strcmp(n, "drain-seconds")) {
        if (parse_uint(v, 3600, &u) != TQKV_OK) {
            why = "expected seconds in 0..3600";
            goto bad;
        }
        cfg->drain_seconds = (unsigned)u;
    } else if (!strcmp(n, "key-bits") || !strcmp(n, "value-bits") ||
               !strcmp(n, "boundary-key-bits") || !strcmp(n, "boundary-value-bits")) {
        uint8_t b2;
        if (tqkv_bits_parse(v, &b2) != TQKV_OK) {
            why = "expected 1, 1.5, 2, 2.5, 3, 3.5 or 4";
            goto bad;
        }
        if (!strcmp(n, "key-bits"))
            cfg->policy.k.bits_x2 = b2;
        else if (!strcmp(n, "value-bits"))
            cfg->policy.v.bits_x2 = b2;
        else if (!strcmp(n, "boundary-key-bits"))
            cfg->policy.k_boundary.bits_x2 = b2;
        else
            cfg->policy.v_boundary.bits_x2 = b2;
    } else if (!strcmp(n, "key-mode") || !strcmp(n, "value-mode")) {
        uint8_t m;
        if (parse_mode(v, &m) != TQKV_OK) {
            why = "expected mse or prod";
            goto bad;
        }
        if (n[0] == 'k')
            cfg->policy.k.mode = cfg->policy.k_boundary.mode = m;
        else
            cfg->policy.v.mode = cfg->policy.v_boundary.mode = m;
    } else if (!strcmp(n, "boundary-layers")) {
        if (parse_uint(v, 512, &u) != TQKV_OK) {
            why = "expected an integer in 0..512";
            goto bad;
        }
        cfg->policy.boundary_layers = (uint32_t)u;
    } else if (!strcmp(n, "rotation")) {
        if (!strcmp(v, "dense"))
            cfg->policy.rotation = TQKV_ROT_DENSE;
        else if (!strcmp(v, "hadamard"))
            cfg->policy.rotation = TQKV_ROT_HADAMARD;
        else {
            why = "expected dense or hadamard";
            goto bad;
        }
    } else if (!strcmp(n, "seed")) {
        if (parse_uint(v, ~0ull, &u) != TQKV_OK) {
            why = "expected an unsigned 64-bit integer";
            goto bad;
        }
        cfg->policy.seed = (uint64_t)u;
    } else if (!strcmp(n, "eviction")) {
        if (!strcmp(v, "lru"))
            cfg->store.policy = TQKV_EVICT_LRU;
        else if (!strcmp(v, "s3fifo"))
            cfg->store.policy = TQKV_EVICT_S3FIFO;
        else {
            why = "expected lru or s3fifo";
            goto bad;
        }
    } else if (!strcmp(n, "auth-tokens")) {
        if (copy_str(cfg->auth_tokens, sizeof cfg->auth_tokens, v)) {
            why = "path too long";
            goto bad;
        }
    } else if (!strcmp(n, "tls-cert") || !strcmp(n, "tls-key") || !strcmp(n, "tls-client-ca")) {
        char *dst = !strcmp(n, "tls-cert")  ? cfg->tls_cert
                    : !strcmp(n, "tls-key") ? cfg->tls_key
                                            : cfg->tls_client_ca;
        if (copy_str(dst, sizeof cfg->tls_cert, v)) {
            why = "path too long";
            goto bad;
        }
    } else if (!strcmp(n, "log-level")) {
        if (tqkv_log_level_parse(v, &cfg->log_level) != TQKV_OK) {
            why = "expected debug, info, warn or error";
            goto bad;
        }
    } else if (!strcmp(n, "log-format")) {
        if (tqkv_log_format_parse(v, &cfg->log_format) != TQKV_OK) {
            why = "expected text or json";
            goto bad;
        }
    }
    return st;
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

tqkv_status_t
tqkv_config_parse(tqkv_server_config_t *cfg, int argc, char **argv, char *err, size_t errlen)
{
    char src[96];
    tqkv_status_t st;

    for (size_t i = 0; i < N_OPTS; i++) {
        const char *v = opts[i].env ? getenv(opts[i].env) : NULL;
        if (v == NULL || (*v == '\0' && opts[i].kind == OPT_BOOL))
            continue;
        if (flag_given(argc, argv, opts[i].name))
            continue; /* the flag wins, even over a malformed variable */
        snprintf(src, sizeof src, "%s", opts[i].env);
        if ((st = apply(cfg, &opts[i], v, src, err, errlen)) != TQKV_OK)
            return st;
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
        if ((st = apply(cfg, o, v, src, err, errlen)) != TQKV_OK)
            return st;
    }
    if (cfg->help)
        return TQKV_OK;

    if ((cfg->tls_cert[0] != 0) != (cfg->tls_key[0] != 0)) {
        snprintf(err, errlen, "--tls-cert and --tls-key must be given together");
        return TQKV_EINVAL;
    }
    if (cfg->tls_client_ca[0] && !cfg->tls_cert[0]) {
        snprintf(err, errlen, "--tls-client-ca needs --tls-cert and --tls-key");
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
    char why[200];
    if (tqkv_policy_check(&cfg->policy, why, sizeof why) != TQKV_OK) {
        snprintf(err, errlen, "codec policy: %s", why);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
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
