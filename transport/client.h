/* client.h - libtqkv: the C client of tqkv-server (Put, Lookup, Get, Delete, Stats, Health).
 *
 * One tqkv_client_t talks to one or several servers ("targets"). With several,
 * blocks are placed by rendezvous hashing of (namespace, hash) with a replication
 * factor R (transport/shard.h): Put goes to the first R live targets of a block's
 * ranking, Lookup and Get ask the candidates in rank order and fan out in parallel
 * across targets. A target that fails at the transport level (UNAVAILABLE) is
 * skipped for a back-off period (doubling, min..max), gets fresh channels, and is
 * tried again; with several targets its blocks read as misses, not errors, and a
 * Put stream it broke is re-sent to the next target in rank.
 *
 * Threading: a client is shared by any number of threads (each target has its own
 * gRPC channels, shared; each operation drives its calls on its own completion
 * queue, so calls of different threads share no other state). A put session
 * (tqkv_put_t) and the callbacks of one Get belong to the thread that runs them.
 *
 * Errors: every function returns a tqkv_status_t; the gRPC status code and message
 * of the last failure of the calling thread are in tqkv_client_last_error().
 *
 * Installed as <tqkv/client.h> (with <tqkv/client_bulk.h> and the three kernels/
 * headers it includes); docs/api.md says what of it is stable.
 */
#ifndef TQKV_TRANSPORT_CLIENT_H
#define TQKV_TRANSPORT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/block_shape.h"
#include "kernels/status.h"
#include "kernels/version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tqkv_client tqkv_client_t;
typedef struct tqkv_put tqkv_put_t;

#define TQKV_CLIENT_DEFAULT_MAX_MESSAGE (64u << 20)
#define TQKV_CLIENT_DEFAULT_DEADLINE_MS 30000u
#define TQKV_HASH_MAX 64u

/* PACKED Gets' page transport (tqkv_client_opts_t.transport); the numbers are the
 * proto's Transport. NCCL is chosen per channel (tqkv_client_open_channel), not here. */
#define TQKV_CLIENT_TRANSPORT_GRPC 0
#define TQKV_CLIENT_TRANSPORT_NCCL 1
#define TQKV_CLIENT_TRANSPORT_TCP 2

/* Client options. Start from TQKV_CLIENT_OPTS_INIT (everything zero = the defaults,
 * struct_size set), then set what you need. Strings are borrowed for the duration of
 * tqkv_client_create only.
 *
 * Growth rule: fields are only ever added at the end. struct_size tells the library
 * which fields the caller knows: a newer library reads the ones beyond it as zero (the
 * default); an older library refuses (TQKV_EUNSUPPORTED) a struct whose fields it does
 * not know unless they are all zero. struct_size 0 means the 1.0 layout. */
typedef struct tqkv_client_opts {
    size_t struct_size;         /* sizeof(tqkv_client_opts_t) as the caller compiled it */
    const char *const *targets; /* "host:port" (or any gRPC target URI), num_targets of them */
    size_t num_targets;
    int resolve_targets;       /* 1: a DNS name stands for the set of servers it resolves to
                                  (a headless Service: A/AAAA records, or SRV records
                                  _grpc._tcp.NAME where present), one target per address,
                                  re-resolved every resolve_interval_ms and at once when a
                                  server fails (membership.h); 0: each name one channel */
    int tls;                   /* 1: TLS (implied by tls_ca_path) */
    const char *tls_ca_path;   /* PEM roots; NULL with tls = the system roots */
    const char *tls_cert_path; /* client certificate (mutual TLS), with tls_key_path */
    const char *tls_key_path;
    const char *tls_target_name;  /* override the name checked against the server cert */
    const char *token;            /* bearer token sent as "authorization: Bearer <token>" */
    uint32_t deadline_ms;         /* per call; 0 = TQKV_CLIENT_DEFAULT_DEADLINE_MS */
    size_t max_message_bytes;     /* receive and send limit; 0 = 64 MiB */
    uint32_t replicas;            /* R: copies of each block over the targets; 0 = 1 */
    uint32_t channels_per_target; /* TCP connections per target (calls round-robin); 0 = 1 */
    int wait_for_ready;           /* 1: calls wait for a connection until their deadline */
    uint32_t backoff_min_ms;      /* a failed target is skipped this long first; 0 = 200 */
    uint32_t backoff_max_ms;      /* doubling up to this; 0 = 5000 */
    /* How PACKED Gets move page bytes. TQKV_CLIENT_TRANSPORT_TCP: over TCP data channels
     * (docs/design.md, "TCP data channel") to servers started with --data-listen, one channel
     * per Get in flight, kept open and reused; a server without them (or unreachable on
     * its data port) is asked over gRPC instead, and the reason is kept
     * (tqkv_client_data_channel_status). BF16 Gets always use gRPC. */
    int transport;
    const char *dns_servers;      /* resolve_targets: DNS servers "IP:PORT,..." (tests, a
                                     private resolver); NULL = the system's */
    uint32_t resolve_interval_ms; /* resolve_targets: re-resolve period; 0 = 10000 */
    /* Read repair: a packed page a Get found below its block's primaries (after a
     * scale-out or a restart) is put again, as the page, to the primaries by a
     * background thread; its queue holds at most read_repair_bytes (0 = 64 MiB; more is
     * dropped and counted). no_read_repair = 1 turns it off. */
    size_t read_repair_bytes;
    int no_read_repair;
    /* Fast failure detection (client_health.c), for a client with several targets or
     * resolve_targets (one server has no other to ask). While calls are in flight, a
     * server that sends nothing for keepalive_ms gets an HTTP/2 ping; unanswered for
     * keepalive_timeout_ms, its connection closes and its calls end UNAVAILABLE (reads
     * ask the next-ranked server, Puts are re-sent). A server whose call ended
     * UNAVAILABLE is marked down and skipped until a Health check (one every
     * probe_interval_ms, with a deadline of keepalive_ms + keepalive_timeout_ms) is
     * answered. 0 = defaults; keepalive_ms
     * UINT32_MAX: no pings; probe_interval_ms UINT32_MAX: no prober (a failed server
     * backs off for backoff_min_ms..backoff_max_ms instead). */
    uint32_t keepalive_ms;         /* 0 = TQKV_CLIENT_DEFAULT_KEEPALIVE_MS */
    uint32_t keepalive_timeout_ms; /* 0 = TQKV_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS */
    uint32_t probe_interval_ms;    /* 0 = TQKV_CLIENT_DEFAULT_PROBE_INTERVAL_MS */
    /* Deadlines and hedged reads (client_hedge.c), for a client with several targets or
     * resolve_targets. connect_timeout_ms bounds a connection attempt (TCP and TLS).
     * Each call of a Get or Lookup on one server gets, within the operation's deadline,
     * what a call of its size should take: call_base_ms + its bytes at call_floor_mb_s
     * (a Get's bytes: its pages times the largest page this client has received, 1 MiB
     * before any); a call that passes it is that server's failure: its blocks are asked
     * of the next-ranked server. A Get or Lookup call that has made no progress for the
     * hedge delay (the 95th percentile of that server's recent answer times, within
     * hedge_min_ms..hedge_max_ms) is hedged: its unanswered blocks are also asked of
     * their next-ranked server (R >= 2, or the R + 1 rank positions reads ask); the
     * first valid (CRC-checked) page of each is delivered, once, and a call whose blocks
     * all came from the other is cancelled. 0 = defaults; no_hedge = 1: no hedging;
     * call_base_ms UINT32_MAX: no size deadline (the operation's alone). */
    uint32_t connect_timeout_ms; /* 0 = TQKV_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS (one server
                                    and no resolve_targets: 5000, as 1.0) */
    uint32_t call_base_ms;       /* 0 = TQKV_CLIENT_DEFAULT_CALL_BASE_MS */
    uint32_t call_floor_mb_s;    /* 10^6 bytes/s; 0 = TQKV_CLIENT_DEFAULT_CALL_FLOOR_MB_S */
    uint32_t hedge_min_ms;       /* 0 = TQKV_CLIENT_DEFAULT_HEDGE_MIN_MS */
    uint32_t hedge_max_ms;       /* 0 = TQKV_CLIENT_DEFAULT_HEDGE_MAX_MS */
    int no_hedge;
} tqkv_client_opts_t;

#define TQKV_CLIENT_DEFAULT_KEEPALIVE_MS 300u
#define TQKV_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS 700u
#define TQKV_CLIENT_DEFAULT_PROBE_INTERVAL_MS 200u
#define TQKV_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS 1000u
#define TQKV_CLIENT_DEFAULT_CALL_BASE_MS 5000u
#define TQKV_CLIENT_DEFAULT_CALL_FLOOR_MB_S 20u
#define TQKV_CLIENT_DEFAULT_HEDGE_MIN_MS 20u
#define TQKV_CLIENT_DEFAULT_HEDGE_MAX_MS 500u

/* The initializer of tqkv_client_opts_t: all defaults, struct_size set. */
#ifdef __cplusplus
#define TQKV_CLIENT_OPTS_INIT                                                                      \
    ([]() {                                                                                        \
        tqkv_client_opts_t tqkv_o_ = tqkv_client_opts_t();                                         \
        tqkv_o_.struct_size = sizeof tqkv_o_;                                                      \
        return tqkv_o_;                                                                            \
    }())
#else
#define TQKV_CLIENT_OPTS_INIT                                                                      \
    {                                                                                              \
        .struct_size = sizeof(tqkv_client_opts_t)                                                  \
    }
#endif

#define TQKV_CLIENT_DEFAULT_REPAIR_BYTES (64u << 20)

/* A block hash (8..64 bytes), a value. */
typedef struct tqkv_hash {
    uint8_t len;
    uint8_t bytes[TQKV_HASH_MAX];
} tqkv_hash_t;

/* Tier of a block, as in the proto (Tier); TQKV_CLIENT_TIER_COUNT sizes per-tier arrays. */
enum {
    TQKV_CLIENT_TIER_NONE = 0,
    TQKV_CLIENT_TIER_HBM = 1,
    TQKV_CLIENT_TIER_DRAM = 2,
    TQKV_CLIENT_TIER_DISK = 3,
    TQKV_CLIENT_TIER_COUNT = 4
};
/* Get encodings, as in the proto (Encoding). */
enum { TQKV_CLIENT_PACKED = 0, TQKV_CLIENT_BF16 = 1 };
/* Quantizer modes of a put session, as in the proto (Mode). */
enum {
    TQKV_CLIENT_MODE_DEFAULT = 0,
    TQKV_CLIENT_MODE_MSE = 1,
    TQKV_CLIENT_MODE_PROD = 2,
    /* LOSSLESS stores the tensor as BF16 as it came (a Get returns the bytes Put); its
     * bits must stay 0 (the server answers INVALID_ARGUMENT otherwise). */
    TQKV_CLIENT_MODE_LOSSLESS = 3,
};

/* The calling thread's last error. status TQKV_OK after a success is not promised:
 * read it only after a call failed. */
typedef struct tqkv_client_error {
    tqkv_status_t status;
    int grpc_code;     /* grpc_status_code; 0 when the failure was local */
    char message[256]; /* the server's details or a local reason */
} tqkv_client_error_t;

/* Returns borrowed, thread-local, valid until the thread's next client call. */
const tqkv_client_error_t *tqkv_client_last_error(void);

/* Creates a client: resolves the targets and asks each server for its node id (it
 * ranks servers by it: a server keeps its rank on a new address, and two spellings of
 * one server are one target). Returns TQKV_EINVAL (no target, a target named twice,
 * unreadable TLS file, bad dns_servers, out NULL), TQKV_ENOMEM. Every function
 * below returns TQKV_EINVAL for a NULL client, request or result pointer.
 * Connections are made lazily. Returns new in *out (tqkv_client_destroy). */
tqkv_status_t tqkv_client_create(const tqkv_client_opts_t *opts, tqkv_client_t **out);

/* Destroys c (NULL is a no-op). No call of c may be running. */
void tqkv_client_destroy(tqkv_client_t *c);

/* Number of targets now (after DNS expansion; the membership may change it between two
 * calls) and the address of one (borrowed, valid until the client is destroyed). */
size_t tqkv_client_num_targets(const tqkv_client_t *c);
const char *tqkv_client_target_name(const tqkv_client_t *c, size_t i);
/* The node id target i reported into buf: 0, or 1 when it has none known (it then ranks
 * by its address), -1 for no such target. */
int tqkv_client_target_node_id(const tqkv_client_t *c, size_t i, char *buf, size_t cap);
/* Resolves and identifies the targets now, on the calling thread (normally a background
 * thread does it every resolve_interval_ms and when a server fails). Returns the version
 * of the target table (1 for the first, +1 per change). */
uint64_t tqkv_client_refresh(tqkv_client_t *c);

/* Read repair counters (pages, since the client was created). */
typedef struct tqkv_client_repair_stats {
    uint64_t queued;        /* pages found below their primaries and queued */
    uint64_t repaired;      /* put again (sent to the primaries) */
    uint64_t stored;        /* of those, stored by a primary that lacked them */
    uint64_t dropped;       /* queue full */
    uint64_t failed;        /* the put failed */
    uint64_t pending_bytes; /* queued now */
} tqkv_client_repair_stats_t;
void tqkv_client_repair_stats(tqkv_client_t *c, tqkv_client_repair_stats_t *out);

/* Failure detection counters (client_health.c), since the client was created. */
typedef struct tqkv_client_health_stats {
    uint64_t marked_down; /* times a server was marked down (a call ended UNAVAILABLE) */
    uint64_t probes;      /* Health checks sent to down servers */
    uint64_t revived;     /* down servers that answered and were used again */
    uint64_t down_now;    /* servers of the current table marked down now */
} tqkv_client_health_stats_t;
tqkv_status_t tqkv_client_health_stats(const tqkv_client_t *c, tqkv_client_health_stats_t *out);

/* ---- Put ---- */

/* Options of a put session (NULL = defaults). Bit widths are bits per coordinate as the
 * proto has them (1, 1.5, 2, 2.5, 3, 3.5, 4); 0 = the namespace policy. */
typedef struct tqkv_put_opts {
    float key_bits, value_bits; /* 1, 1.5, 2, 2.5, 3, 3.5, 4; 0 = policy */
    int key_mode, value_mode;   /* TQKV_CLIENT_MODE_* (DEFAULT = the policy; LOSSLESS) */
    uint32_t deadline_ms;       /* the whole session; 0 = the client default */
} tqkv_put_opts_t;

/* One block (one layer): either key+value (BF16 [T][H][D], shape required) or page. */
typedef struct tqkv_put_block {
    const char *ns;
    const tqkv_hash_t *hash;
    const tqkv_hash_t *parent; /* NULL for the first block of a sequence */
    uint32_t layer;
    uint32_t num_layers; /* the model's layers (boundary policy); 0 = unknown */
    tqkv_block_shape_t shape;
    const void *key, *value; /* BF16 bytes, each T*H*D*2 */
    const void *page;        /* instead of key/value: an encoded page */
    size_t page_len;
} tqkv_put_block_t;

/* What a put session stored (summed over targets and replicas). */
typedef struct tqkv_put_result {
    uint64_t blocks_sent;   /* messages sent (a block counts once per replica) */
    uint64_t blocks_stored; /* as reported by the servers */
    uint64_t blocks_duplicate;
    uint64_t bytes_in;
    uint64_t bytes_stored;
    uint64_t blocks_lost; /* sent to a target that then failed (several targets only) */
} tqkv_put_result_t;

/* Opens a put session. Borrows opts. Returns new in *out (end with put_end or abort). */
tqkv_status_t tqkv_client_put_begin(tqkv_client_t *c, const tqkv_put_opts_t *opts,
                                    tqkv_put_t **out);

/* Sends one block. Borrows b (copied into the message before returning). At most one
 * message is in flight per target stream: this waits for the previous one (the
 * back-pressure). The shape is checked against the limits the server enforces
 * (head_dim 16..1024, heads 1..1024, tokens 1..65536; K and V within the message size)
 * before key and value are read. Returns TQKV_EINVAL / TQKV_EUNSUPPORTED for a
 * malformed block, or the stream's error when a server ended it (then end the session
 * with put_end or abort). */
tqkv_status_t tqkv_client_put_block(tqkv_put_t *p, const tqkv_put_block_t *b);

/* Half-closes the streams and collects the responses into *res (may be NULL).
 * Always frees p. Returns the first error of any stream. With several targets, a
 * stream that fails with UNAVAILABLE is not an error: its blocks are re-sent to the
 * next live targets in their ranking (each message is kept until its stream's
 * response, sharing the encoded buffer: the session holds its messages in memory),
 * and what still found no target counts in blocks_lost. */
tqkv_status_t tqkv_client_put_end(tqkv_put_t *p, tqkv_put_result_t *res);

/* Cancels the streams and frees p (NULL is a no-op). */
void tqkv_client_put_abort(tqkv_put_t *p);

/* ---- Lookup ---- */

typedef struct tqkv_lookup_req {
    const char *ns;
    const tqkv_hash_t *hashes; /* sequence order */
    size_t num_hashes;
    uint32_t num_layers;  /* a block counts when layers [0, num_layers) are present */
    uint32_t lease_ms;    /* > 0: pin the found blocks this long */
    uint32_t deadline_ms; /* 0 = the client default */
} tqkv_lookup_req_t;

/* Writes *prefix_blocks (leading hashes present) and, when tiers is non-NULL, the
 * tier of every hash (tiers[num_hashes]). With several targets, a down target's
 * hashes read as absent. */
tqkv_status_t tqkv_client_lookup(tqkv_client_t *c, const tqkv_lookup_req_t *req,
                                 uint32_t *prefix_blocks, uint8_t *tiers);

/* ---- Get ---- */

typedef struct tqkv_get_req {
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t num_hashes;
    uint32_t layer_begin, layer_end; /* [begin, end), end > begin */
    int encoding;                    /* TQKV_CLIENT_PACKED or TQKV_CLIENT_BF16 */
    uint32_t deadline_ms;            /* the whole stream; 0 = the client default */
} tqkv_get_req_t;

/* One page of a Get, passed to the callback. All pointers are borrowed for the
 * callback only. page is 64-byte aligned, key 2-byte aligned and value 2-byte
 * aligned. */
typedef struct tqkv_get_page {
    size_t hash_index; /* index into req->hashes */
    uint32_t layer;
    int found;
    int tier;                 /* TQKV_CLIENT_TIER_* */
    tqkv_block_shape_t shape; /* as sent by the server (zero when !found) */
    const void *page;         /* PACKED */
    size_t page_len;
    const void *key, *value; /* BF16 */
    size_t key_len, value_len;
    size_t wire_bytes; /* size of the message on the wire */
    int target;        /* index of the target that answered (-1 for a final miss) */
    /* 1: the library checked the packed page's CRC32C (in the pass that copies it out of
     * the gRPC buffers). A page failing it is never delivered: the next replica is asked,
     * and with none left the Get fails with TQKV_ECORRUPT (so does a page shorter than a
     * header or whose header gives another length). 0: not checked (BF16: no page). */
    int crc_checked;
    int data_channel; /* 1: the page came over a TCP data channel (not in a gRPC message) */
} tqkv_get_page_t;

/* Called once per (hash, layer). Return 0 to continue, non-zero to cancel the Get
 * (tqkv_client_get then returns TQKV_ECANCELED). */
typedef int (*tqkv_get_cb_t)(void *arg, const tqkv_get_page_t *pg);

/* Streams the pages of req. With one target the callback sees the server's
 * layer-major order; with several, each target's pages arrive layer-major and
 * targets interleave, and misses (after asking every candidate) come last. The
 * callback is never called concurrently for one Get. Missing blocks are reported
 * with found = 0; the call still succeeds. */
tqkv_status_t tqkv_client_get(tqkv_client_t *c, const tqkv_get_req_t *req, tqkv_get_cb_t cb,
                              void *arg);

/* ---- Delete, Stats, Health ---- */

/* Deletes every layer of the hashes (or the whole namespace when all != 0) on every
 * live target; writes the totals (either pointer may be NULL). */
tqkv_status_t tqkv_client_delete(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes,
                                 size_t num_hashes, int all, uint64_t *pages_deleted,
                                 uint64_t *bytes_freed);

typedef struct tqkv_client_tier_stats {
    int tier;
    uint64_t capacity_bytes, bytes_used, pages, hits, misses, evictions, demotions, promotions;
} tqkv_client_tier_stats_t;

typedef struct tqkv_client_stats {
    uint64_t hits, misses, evictions, bytes_in, bytes_out, pages, page_bytes, bf16_bytes;
    double compression_ratio; /* bf16_bytes / page_bytes over all targets */
    size_t num_tiers;
    tqkv_client_tier_stats_t tiers[TQKV_CLIENT_TIER_COUNT]; /* summed per tier over the
                                                               targets, num_tiers of them */
} tqkv_client_stats_t;

/* Stats of a namespace (ns "" = the whole server) summed over the live targets. */
tqkv_status_t tqkv_client_stats(tqkv_client_t *c, const char *ns, tqkv_client_stats_t *out);

/* grpc.health.v1 Check of service (NULL or "" = the server) on target i. Writes the
 * ServingStatus (1 = SERVING). */
tqkv_status_t tqkv_client_health(tqkv_client_t *c, size_t target, const char *service,
                                 int *serving_status);

/* ---- Consumer helpers ---- */

/* Validates (with CRC) a received page and decodes it into BF16 K and V ([T][H][D],
 * either may be NULL). Writes the shape when shape is non-NULL. Returns
 * TQKV_EFORMAT / TQKV_ECORRUPT for a bad page. Borrows everything. */
tqkv_status_t tqkv_client_decode_page(const void *page, size_t len, uint16_t *k, uint16_t *v,
                                      tqkv_block_shape_t *shape);

/* Fused decode attention of one query token over packed pages
 * the caller received (borrowed; consecutive blocks of one sequence, one layer). q and
 * out are float [num_q_heads][head_dim]. Page CRCs are checked. Returns the statuses
 * of tqkv_attn_decode. */
tqkv_status_t tqkv_client_attend(const float *q, uint32_t num_q_heads, const void *const *pages,
                                 const size_t *page_lens, size_t n_pages, float *out);

/* Gets the packed pages of hashes[0..num_hashes) at one layer and runs fused decode
 * attention of q over them (the whole prefix as one sequence). Returns TQKV_ENOTFOUND
 * (with the index in the error message) when a block is missing, the Get's status, or
 * tqkv_client_attend's. deadline_ms 0 = the client default. */
tqkv_status_t tqkv_client_get_attend(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hashes,
                                     size_t num_hashes, uint32_t layer, uint32_t deadline_ms,
                                     const float *q, uint32_t num_q_heads, float *out);

/* ---- NCCL transport (GPU consumers) ----
 *
 * A channel is a 2-rank NCCL communicator with one server (the server is rank 0, the
 * client rank 1), opened over gRPC (OpenChannel hands out the ncclUniqueId). A Get on
 * it receives each page's metadata on the gRPC stream and the page bytes with
 * ncclRecv straight into one of the caller's device buffers.
 *
 * Fallback: when the library was built without NCCL, the client has no CUDA device,
 * the server answers OpenChannel with FAILED_PRECONDITION or UNIMPLEMENTED (no NCCL or
 * no GPU there, or an older server), or the communicator cannot be joined,
 * tqkv_client_open_channel still succeeds with a fallback channel
 * (tqkv_channel_is_nccl() == 0): tqkv_client_get_nccl then runs an ordinary gRPC Get
 * (over every target) and delivers host bytes (on_device = 0). */

typedef struct tqkv_channel tqkv_channel_t;

/* Opens a channel to target (index) for CUDA device `device`; timeout_ms bounds the
 * communicator set-up on both sides (0 = 10 s). Returns new in *out (close with
 * tqkv_client_close_channel), possibly a fallback channel; errors are transport
 * failures of OpenChannel other than the fallback codes (e.g. UNAVAILABLE). */
tqkv_status_t tqkv_client_open_channel(tqkv_client_t *c, size_t target, int device,
                                       uint32_t timeout_ms, tqkv_channel_t **out);

/* 1 when pages travel over NCCL, 0 for a fallback channel. */
int tqkv_channel_is_nccl(const tqkv_channel_t *ch);

/* Why a channel is a fallback one ("" for an NCCL channel). Borrowed. */
const char *tqkv_channel_fallback_reason(const tqkv_channel_t *ch);

/* Tells the server (CloseChannel, best effort), aborts the communicator, frees ch
 * (NULL is a no-op). */
void tqkv_client_close_channel(tqkv_client_t *c, tqkv_channel_t *ch);

/* One page of tqkv_client_get_nccl (borrowed for the callback only). */
typedef struct tqkv_nccl_page {
    size_t hash_index; /* index into req->hashes */
    uint32_t layer;
    int found;
    int tier;
    tqkv_block_shape_t shape;
    const void *data; /* the packed page: device memory when on_device, else host */
    size_t len;
    int on_device;     /* 1: data is in one of the caller's device buffers (NCCL) */
    void *cuda_stream; /* on_device: the cudaStream_t the bytes arrived on (complete) */
} tqkv_nccl_page_t;

/* Return 0 to continue, non-zero to cancel (tqkv_client_get_nccl then returns
 * TQKV_ECANCELED; an NCCL channel is then broken: close it). */
typedef int (*tqkv_nccl_cb_t)(void *arg, const tqkv_nccl_page_t *pg);

/* Gets the PACKED pages of req (req->encoding must be TQKV_CLIENT_PACKED) over ch
 * (NULL = fallback). On an NCCL channel, page k that is found is received into
 * dev_bufs[k % n_bufs] (each buf_len bytes, device memory) and the callback sees the
 * device pointer; the buffer is reused after n_bufs more pages. A page larger than
 * buf_len fails the call with TQKV_ENOSPC and breaks the channel. On a fallback
 * channel dev_bufs are unused and pages are delivered as host bytes. The callback sees
 * the server's layer-major order (one target) and is never called concurrently. */
tqkv_status_t tqkv_client_get_nccl(tqkv_client_t *c, tqkv_channel_t *ch, const tqkv_get_req_t *req,
                                   void *const *dev_bufs, size_t n_bufs, size_t buf_len,
                                   tqkv_nccl_cb_t cb, void *arg);

/* With TQKV_CLIENT_TRANSPORT_TCP: "" while target's data channels work (or before the
 * first Get), else why its Gets fall back to gRPC. Borrowed until the next call. */
const char *tqkv_client_data_channel_status(tqkv_client_t *c, size_t target);

#ifdef __cplusplus
}
#endif

#endif
