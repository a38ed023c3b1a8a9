"""The C side of the tqkv package: libtqkv.so loaded with cffi in ABI mode.

The declarations below are copied from the installed headers (tqkv/client.h,
tqkv/client_bulk.h, tqkv/kernels/block_shape.h, tqkv/kernels/status.h,
tqkv/kernels/version.h); only what the package calls is declared, but every struct
is declared whole, field for field, since cffi lays them out from this text
(tests/python/test_cdef_layout.py checks both against the C compiler).

The library is found in this order: $TQKV_LIBRARY (a path), the libtqkv.so.1 of the
install the package came from (<libdir>/python3/dist-packages/tqkv/../../..), then
the dynamic linker's search path.
"""
import os

import cffi

CDEF = r"""
typedef int tqkv_status_t;
const char *tqkv_strerror(tqkv_status_t st);
const char *tqkv_status_name(tqkv_status_t st);
const char *tqkv_version(void);
int tqkv_version_number(void);
const char *tqkv_version_git(void);

typedef struct tqkv_block_shape {
    uint32_t num_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
} tqkv_block_shape_t;

typedef struct tqkv_client tqkv_client_t;
typedef struct tqkv_put tqkv_put_t;

#define TQKV_CLIENT_TRANSPORT_GRPC 0
#define TQKV_CLIENT_TRANSPORT_NCCL 1
#define TQKV_CLIENT_TRANSPORT_TCP 2
enum {
    TQKV_CLIENT_TIER_NONE = 0,
    TQKV_CLIENT_TIER_HBM = 1,
    TQKV_CLIENT_TIER_DRAM = 2,
    TQKV_CLIENT_TIER_DISK = 3,
    TQKV_CLIENT_TIER_COUNT = 4
};
enum { TQKV_CLIENT_PACKED = 0, TQKV_CLIENT_BF16 = 1 };
enum {
    TQKV_CLIENT_MODE_DEFAULT = 0,
    TQKV_CLIENT_MODE_MSE = 1,
    TQKV_CLIENT_MODE_PROD = 2,
    TQKV_CLIENT_MODE_LOSSLESS = 3,
};

typedef struct tqkv_client_opts {
    size_t struct_size;
    const char *const *targets;
    size_t num_targets;
    int resolve_targets;
    int tls;
    const char *tls_ca_path;
    const char *tls_cert_path;
    const char *tls_key_path;
    const char *tls_target_name;
    const char *token;
    uint32_t deadline_ms;
    size_t max_message_bytes;
    uint32_t replicas;
    uint32_t channels_per_target;
    int wait_for_ready;
    uint32_t backoff_min_ms;
    uint32_t backoff_max_ms;
    int transport;
    const char *dns_servers;
    uint32_t resolve_interval_ms;
    size_t read_repair_bytes;
    int no_read_repair;
    uint32_t keepalive_ms;
    uint32_t keepalive_timeout_ms;
    uint32_t probe_interval_ms;
    uint32_t connect_timeout_ms;
    uint32_t call_base_ms;
    uint32_t call_floor_mb_s;
    uint32_t hedge_min_ms;
    uint32_t hedge_max_ms;
    int no_hedge;
} tqkv_client_opts_t;

typedef struct tqkv_hash {
    uint8_t len;
    uint8_t bytes[64];
} tqkv_hash_t;

typedef struct tqkv_client_error {
    tqkv_status_t status;
    int grpc_code;
    char message[256];
} tqkv_client_error_t;

const tqkv_client_error_t *tqkv_client_last_error(void);
tqkv_status_t tqkv_client_create(const tqkv_client_opts_t *opts, tqkv_client_t **out);
void tqkv_client_destroy(tqkv_client_t *c);
size_t tqkv_client_num_targets(const tqkv_client_t *c);
const char *tqkv_client_target_name(const tqkv_client_t *c, size_t i);
int tqkv_client_target_node_id(const tqkv_client_t *c, size_t i, char *buf, size_t cap);
uint64_t tqkv_client_refresh(tqkv_client_t *c);

typedef struct tqkv_client_repair_stats {
    uint64_t queued;
    uint64_t repaired;
    uint64_t stored;
    uint64_t dropped;
    uint64_t failed;
    uint64_t pending_bytes;
} tqkv_client_repair_stats_t;
void tqkv_client_repair_stats(tqkv_client_t *c, tqkv_client_repair_stats_t *out);
typedef struct tqkv_client_health_stats {
    uint64_t marked_down;
    uint64_t probes;
    uint64_t revived;
    uint64_t down_now;
} tqkv_client_health_stats_t;
tqkv_status_t tqkv_client_health_stats(const tqkv_client_t *c, tqkv_client_health_stats_t *out);

typedef struct tqkv_put_opts {
    float key_bits, value_bits;
    int key_mode, value_mode;
    uint32_t deadline_ms;
} tqkv_put_opts_t;

typedef struct tqkv_put_block {
    const char *ns;
    const tqkv_hash_t *hash;
    const tqkv_hash_t *parent;
    uint32_t layer;
    uint32_t num_layers;
    tqkv_block_shape_t shape;
    const void *key, *value;
    const void *page;
    size_t page_len;
} tqkv_put_block_t;

typedef struct tqkv_put_result {
    uint64_t blocks_sent;
    uint64_t blocks_stored;
    uint64_t blocks_duplicate;
    uint64_t bytes_in;
    uint64_t bytes_stored;
    uint64_t blocks_lost;
} tqkv_put_result_t;

tqkv_status_t tqkv_client_put_begin(tqkv_client_t *c, const tqkv_put_opts_t *opts,
                                    tqkv_put_t **out);
tqkv_status_t tqkv_client_put_block(tqkv_put_t *p, const tqkv_put_block_t *b);
tqkv_status_t tqkv_client_put_end(tqkv_put_t *p, tqkv_put_result_t *res);
void tqkv_client_put_abort(tqkv_put_t *p);

typedef struct tqkv_lookup_req {
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t num_hashes;
    uint32_t num_layers;
    uint32_t lease_ms;
    uint32_t deadline_ms;
} tqkv_lookup_req_t;

tqkv_status_t tqkv_client_lookup(tqkv_client_t *c, const tqkv_lookup_req_t *req,
                                 uint32_t *prefix_blocks, uint8_t *tiers);

typedef struct tqkv_get_req {
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t num_hashes;
    uint32_t layer_begin, layer_end;
    int encoding;
    uint32_t deadline_ms;
} tqkv_get_req_t;

typedef struct tqkv_get_page {
    size_t hash_index;
    uint32_t layer;
    int found;
    int tier;
    tqkv_block_shape_t shape;
    const void *page;
    size_t page_len;
    const void *key, *value;
    size_t key_len, value_len;
    size_t wire_bytes;
    int target;
    int crc_checked;
    int data_channel;
} tqkv_get_page_t;

typedef int (*tqkv_get_cb_t)(void *arg, const tqkv_get_page_t *pg);
tqkv_status_t tqkv_client_get(tqkv_client_t *c, const tqkv_get_req_t *req, tqkv_get_cb_t cb,
                              void *arg);

tqkv_status_t tqkv_client_delete(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes,
                                 size_t num_hashes, int all, uint64_t *pages_deleted,
                                 uint64_t *bytes_freed);

typedef struct tqkv_client_tier_stats {
    int tier;
    uint64_t capacity_bytes, bytes_used, pages, hits, misses, evictions, demotions, promotions;
} tqkv_client_tier_stats_t;

typedef struct tqkv_client_stats {
    uint64_t hits, misses, evictions, bytes_in, bytes_out, pages, page_bytes, bf16_bytes;
    double compression_ratio;
    size_t num_tiers;
    tqkv_client_tier_stats_t tiers[TQKV_CLIENT_TIER_COUNT];
} tqkv_client_stats_t;

tqkv_status_t tqkv_client_stats(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out);
tqkv_status_t tqkv_client_health(tqkv_client_t *c, size_t target, const char *service,
                                 int *serving_status);
tqkv_status_t tqkv_client_decode_page(const void *page, size_t len, uint16_t *k, uint16_t *v,
                                      tqkv_block_shape_t *shape);
const char *tqkv_client_data_channel_status(tqkv_client_t *c, size_t target);

typedef struct tqkv_put_many_req {
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t num_hashes;
    const tqkv_hash_t *parent;
    uint32_t layer_begin, layer_end;
    uint32_t num_layers;
    tqkv_block_shape_t shape;
    const void *const *keys;
    const void *const *values;
} tqkv_put_many_req_t;

tqkv_status_t tqkv_client_put_many(tqkv_client_t *c, const tqkv_put_opts_t *opts,
                                   const tqkv_put_many_req_t *req, tqkv_put_result_t *res);

typedef struct tqkv_get_into {
    tqkv_block_shape_t shape;
    void *const *keys;
    void *const *values;
    uint8_t *found;
} tqkv_get_into_t;

tqkv_status_t tqkv_client_get_into(tqkv_client_t *c, const tqkv_get_req_t *req,
                                   const tqkv_get_into_t *dst, uint64_t *blocks_found,
                                   uint64_t *bytes_received);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)

SONAME = "libtqkv.so.1"


def _candidates():
    env = os.environ.get("TQKV_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.normpath(os.path.join(here, "..", "..", "..", SONAME))
    out = [installed] if os.path.exists(installed) else []
    return out + [SONAME, "libtqkv.so"]


def _load():
    errors = []
    for name in _candidates():
        try:
            return ffi.dlopen(name), name
        except OSError as e:
            errors.append("%s: %s" % (name, e))
    raise ImportError("tqkv: cannot load libtqkv (set TQKV_LIBRARY to its path): " +
                      "; ".join(errors))


lib, library_path = _load()
