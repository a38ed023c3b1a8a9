/* client_internal.h - what the files of libtqkv's client share (tqkv__, not API).
 *
 * client.c: create/destroy, the targets the membership attaches
 * client_view.c: views of the target table, block placement over them
 * client_repair.c: read repair (re-puts pages found below their primaries)
 * client_call.c: one gRPC call (rpc_t) on an operation's completion queue, the unary
 *   fan-out, the thread's last error
 * client_put.c: put sessions
 * client_unary.c: Lookup, Delete, Stats, Health
 * client_get.c: Get (the in-place GetResponse reader, pages over gRPC or TCP)
 * client_dc.c: the pool of TCP data channels per target
 * client_nccl.c: NCCL channels and Get over them
 * client_attn.c: fused decode attention over received pages
 */
#ifndef TQKV_TRANSPORT_CLIENT_INTERNAL_H
#define TQKV_TRANSPORT_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <protobuf-c/protobuf-c.h>

#include "transport/client.h"
#include "transport/client_server.h"
#include "transport/membership.h"
#include "transport/node_id.h"
#include "transport/shard.h"

#define M_PUT "/tqkv.v1.KVCache/Put"
#define M_LOOKUP "/tqkv.v1.KVCache/Lookup"
#define M_GET "/tqkv.v1.KVCache/Get"
#define M_DELETE "/tqkv.v1.KVCache/Delete"
#define M_STATS "/tqkv.v1.KVCache/Stats"
#define M_HEALTH "/grpc.health.v1.Health/Check"
#define RANK_MAX 64 /* rank positions a block is offered to (of any number of targets) */
#define M_OPEN_CHANNEL "/tqkv.v1.KVCache/OpenChannel"
#define M_CLOSE_CHANNEL "/tqkv.v1.KVCache/CloseChannel"
#define TQKV__LAT_N 64      /* answer times kept per target (hedge delay) */
#define TQKV__HEDGE_WAVES 2 /* hedge waves per round of a Get or Lookup */

/* Lock rule: ch[] is read under lock (shared) to start a call or read the connectivity
 * state; a reconnect swaps a channel under lock (exclusive) and destroys the old one
 * after unlocking (calls started on it hold their own references). */
typedef struct target {
    char *name;                     /* the address dialed (membership.h: tqkv_member_t.addr) */
    char *host;                     /* the DNS name it came from (TLS authority), or NULL */
    grpc_channel **ch;              /* nch channels, each its own connection */
    const grpc_channel_args *cargs; /* the client's, or own_cargs (TLS name of host) */
    grpc_channel_args own_cargs;
    grpc_arg own_args[18];
    struct target *retired_next; /* on the client's retired list once no table lists it */
    uint32_t nch;
    pthread_rwlock_t lock;
    _Atomic uint64_t renewed_ns; /* last reconnect (monotonic ns) */
    _Atomic uint32_t rr;
    tqkv_shard_health_t health;
    /* TCP data channels (TQKV_CLIENT_TRANSPORT_TCP), under dc_mu: idle connected
     * channels, and why the target has none (then its Gets use gRPC) */
    pthread_mutex_t dc_mu;
    struct dconn *dc_idle;
    _Atomic int dc_off;
    char dc_why[256];
    _Atomic uint64_t dc_retry_ns; /* dc_off: try again after this */
    /* recent answer times of Gets and Lookups (microseconds, a ring of TQKV__LAT_N;
     * lat_n counts every sample): the hedge delay is their 95th percentile */
    _Atomic uint32_t lat_us[TQKV__LAT_N];
    _Atomic uint32_t lat_n;
} target_t;

/* A connected TCP data channel, owned by one Get at a time. */
typedef struct dconn {
    int fd;
    struct ssl_st *ssl; /* TLS session (the client has TLS), else NULL */
    uint64_t id;
    struct dconn *next;
} dconn_t;

/* What every view of one client shares (the client owns it). */
/* A page found below its primaries, to be put again (read repair). */
typedef struct repair {
    struct repair *next;
    char *ns;
    tqkv_hash_t hash;
    uint32_t layer;
    tqkv_block_shape_t shape;
    size_t len;
    uint8_t page[];
} repair_t;

typedef struct client_shared {
    pthread_mutex_t mu;
    target_t *retired; /* targets no table lists any more: channels closed, name kept (it was
                          handed out by tqkv_client_target_name) until the client goes */
    /* read repair: a bounded queue (bytes) and the thread that re-puts it, under mu */
    struct tqkv_client *root;
    pthread_cond_t rcv;
    repair_t *rq_head, *rq_tail;
    size_t rq_bytes, rq_max; /* rq_max 0: read repair off */
    int rq_stop, rq_busy, rq_started;
    pthread_t rq_thread;
    tqkv_client_repair_stats_t rs;
    struct tqkv__health *health; /* the prober (client_health.c), or NULL */
    /* per-call deadlines and hedging (client_health.c) */
    _Atomic uint64_t page_max;                           /* largest Get message received */
    _Atomic uint64_t hedges, hedge_pages, call_timeouts; /* tqkv__hedge_stats */
} client_shared_t;

/* The client, and the view one call works on (tqkv__view_enter): a copy of the client whose
 * t/nt/tab are the membership table the call started with, referenced until
 * tqkv__view_leave, so that a call in flight finishes on its table while a newer one is
 * published. The client itself has no table (t NULL, nt 0). */
struct tqkv_client {
    target_t **t; /* tab->users: target i is slot i of tab */
    size_t nt;
    tqkv_member_table_t *tab; /* view: referenced; client: NULL */
    tqkv_membership_t *ms;
    client_shared_t *sh;
    uint32_t replicas;     /* view: min(replicas_opt, nt) */
    uint32_t replicas_opt; /* as asked (opts.replicas) */
    uint32_t nch;          /* channels per target */
    uint32_t identify_ms;  /* node id question at connect time */
    int tls;
    uint32_t deadline_ms;
    uint32_t backoff_min, backoff_max;
    int wait_for_ready;
    int has_auth;
    grpc_metadata auth_md;  /* "authorization: Bearer <token>" (slices owned) */
    grpc_metadata md[2];    /* sent with calls: auth_md, and "tqkv-hop" */
    grpc_metadata id_md[2]; /* sent with node-id questions: auth_md, "tqkv-peer-hello" */
    size_t n_id_md;
    int hop;                         /* opts.hop */
    grpc_channel_credentials *creds; /* kept to rebuild channels */
    grpc_arg args[16];
    grpc_channel_args cargs;
    char *tls_name;            /* owned copy for the target-name override arg */
    int transport;             /* TQKV_CLIENT_TRANSPORT_* */
    struct ssl_ctx_st *dc_tls; /* TLS for data channels (the client has TLS), else NULL */
    size_t max_msg;            /* receive limit, also for data channel pages */
    /* per-call deadlines and hedged reads (tqkv_client_opts_t; client_health.c) */
    uint32_t call_base_ms, call_floor_mb_s, hedge_min_ms, hedge_max_ms;
    int hedge;
};

typedef enum { TAG_STATUS, TAG_INIT, TAG_SEND, TAG_RECV } tag_kind_t;
typedef struct rpc rpc_t;
typedef struct rtag {
    rpc_t *r;
    tag_kind_t k;
} rtag_t;

struct rpc {
    grpc_call *call;
    size_t target;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    grpc_byte_buffer *init_bb; /* request of a unary/server-streaming call */
    grpc_byte_buffer *send_bb; /* the SEND_MESSAGE in flight */
    grpc_byte_buffer *recv_bb;
    int inflight; /* tags not yet back */
    int send_busy, recv_busy;
    int status_done, recv_eof, send_failed, closed;
    int cancelled; /* this client cancelled the call (tqkv__rpc_cancel) */
    uint64_t sent; /* messages sent (put) */
    rtag_t t_status, t_init, t_send, t_recv;
    /* operation state */
    size_t *gidx; /* Get/Lookup: global hash index of each hash sent */
    size_t count;
    size_t pos; /* messages received */
    /* Get over a TCP data channel: the channel, frames still due, the next index */
    dconn_t *dc;
    size_t frames_left, next_frame;
    /* hedging (Get, Lookup): the rank position the call asks, whether it is a hedge,
     * whether the other call answered all it asked first (cancelled: neither success nor
     * failure), whether it was hedged; start and last progress (monotonic ns); slots it
     * still waits for; its own deadline was the size deadline, shorter than the
     * operation's (passing it fails the server, not the operation) */
    uint32_t rank;
    int is_hedge, beaten, hedged, short_dl;
    tqkv_status_t start_err;                  /* the call could not be started */
    uint64_t t0_ns, last_ns, dl_ns, hedge_ns; /* dl_ns: its deadline; hedge_ns: its delay */
    size_t rem;
    int dc_bad;       /* out of step with the server: closed, not reused */
    char dc_eof[240]; /* the server closed the channel mid-Get: why, if its status is OK */
};

/* ---- the GetResponse reader, the OpenChannel call, the last error (also for the tests) ---- */

/* A GetResponse read in place (pointers borrow the message bytes). */
typedef struct tqkv__get_msg {
    const uint8_t *hash, *page, *key, *value;
    size_t hash_len, page_len, key_len, value_len;
    uint32_t layer, num_tokens, num_kv_heads, head_dim;
    int found, tier;
} tqkv__get_msg_t;

/* Parses a serialized tqkv.v1.GetResponse without copying. Returns 0, or -1 when
 * p[0..n) is not a well-formed message. */
int tqkv__client_parse_get(const uint8_t *p, size_t n, tqkv__get_msg_t *m);

/* The OpenChannel RPC alone on target: writes the channel id and the unique id
 * (uid[128], *uid_len) on success; on failure the thread's last error holds the gRPC
 * code (FAILED_PRECONDITION: no NCCL on the server). */
tqkv_status_t tqkv__client_open_channel_rpc(tqkv_client_t *c, size_t target, int device,
                                            uint32_t timeout_ms, uint64_t *id, uint8_t uid[128],
                                            size_t *uid_len);

/* Sets the calling thread's last error (for transport/client_*.c). Returns st. */
tqkv_status_t tqkv__client_set_error(tqkv_status_t st, int grpc_code, const char *msg);

/* ---- errors (client_call.c) ---- */

/* The calling thread's last error (tqkv_client_last_error). */
extern _Thread_local tqkv_client_error_t tqkv__client_last_err;

/* Sets the thread's last error from a format. Returns st. */
tqkv_status_t tqkv__client_err(tqkv_status_t st, int code, const char *fmt, ...);

gpr_timespec tqkv__deadline_after(uint32_t ms);

/* ---- one call (client_call.c) ---- */

tqkv_status_t tqkv__rpc_start(tqkv_client_t *c, rpc_t *r, grpc_completion_queue *cq, size_t ti,
                              const char *method, gpr_timespec deadline, grpc_byte_buffer *req);
void tqkv__rpc_recv(rpc_t *r);
/* Sends bb (takes it). Requires !send_busy. */
int tqkv__rpc_send(rpc_t *r, grpc_byte_buffer *bb);
/* Half-closes and asks for the single response (client streaming). */
void tqkv__rpc_close_and_recv(rpc_t *r);
/* Bookkeeping of one completed tag. The receive buffer is left for the caller. */
void tqkv__rpc_event(rpc_t *r, tag_kind_t k, int ok);
/* Frees what the call holds. Requires inflight == 0. */
void tqkv__rpc_fini(rpc_t *r);
/* Waits for the next event of cq and books it. Returns the rpc and kind. */
rpc_t *tqkv__cq_step(grpc_completion_queue *cq, tag_kind_t *k, int *ok);
void tqkv__cq_destroy(grpc_completion_queue *cq);
/* Status of a finished call as a tqkv status (sets the thread's error) and updates
 * the target's health: UNAVAILABLE backs the target off, OK clears it. */
tqkv_status_t tqkv__rpc_result(tqkv_client_t *c, rpc_t *r);
/* Cancels r's call and remembers that this client did (rpc_result tells it apart from a
 * call that the server or the channel ended). */
void tqkv__rpc_cancel(rpc_t *r);
/* Replaces target t's channels that are not READY by fresh ones, at most once per
 * min_interval_ns (after an UNAVAILABLE, and by the prober after a failed probe). */
void tqkv__renew_channels(tqkv_client_t *c, target_t *t, uint64_t min_interval_ns);
/* Whether target ti takes calls now (always, with a single target). */
int tqkv__target_usable(tqkv_client_t *c, size_t ti, uint64_t now);
/* Starts n unary calls on cq: call i to target tis[i] with reqs[i] (borrowed), deadline
 * dl; writes sts[i]. Returns how many are live. */
size_t tqkv__unary_start(tqkv_client_t *c, grpc_completion_queue *cq, rpc_t *rs, size_t n,
                         const size_t *tis, const char *method, ProtobufCMessage *const *reqs,
                         gpr_timespec dl, tqkv_status_t *sts);
/* Drives the live calls of rs until each has ended; call i's first response decoded (rd)
 * into resps[i] (resps NULL: discarded); ended(arg, i), when given, as call i ends. */
void tqkv__unary_wait(grpc_completion_queue *cq, rpc_t *rs, size_t live,
                      const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resps,
                      void (*ended)(void *arg, size_t i), void *arg);
/* Runs n unary calls in parallel: call i to target tis[i] with reqs[i]; writes
 * resps[i] (new, or NULL) and sts[i]. Borrows reqs. */
void tqkv__unary_fanout(tqkv_client_t *c, size_t n, const size_t *tis, const char *method,
                        ProtobufCMessage *const *reqs, const ProtobufCMessageDescriptor *rd,
                        uint32_t deadline_ms, ProtobufCMessage **resps, tqkv_status_t *sts);

/* ---- per-call deadlines and hedging (client_health.c) ---- */

/* The deadline of one call of an operation with op_dl_ns left (monotonic ns) that moves
 * `bytes`: now + call_base_ms + bytes at call_floor_mb_s, or op_dl_ns when that is
 * sooner or the client has one target. *is_short: 1 when the size deadline is the
 * sooner. Writes the gRPC deadline into *dl. Returns the deadline in monotonic ns. */
uint64_t tqkv__call_deadline(const tqkv_client_t *c, uint64_t bytes, uint64_t op_dl_ns,
                             gpr_timespec *dl, int *is_short);
/* A Get's estimated bytes per page (the largest message received, 1 MiB before any). */
uint64_t tqkv__page_estimate(const tqkv_client_t *c);
void tqkv__page_seen(tqkv_client_t *c, uint64_t bytes);
/* Records an answer time of target ti (ns), and the hedge delay of target ti (ns): the
 * 95th percentile of its recent ones within hedge_min_ms..hedge_max_ms (hedge_max_ms
 * while fewer than 8 are known). */
void tqkv__lat_record(tqkv_client_t *c, size_t ti, uint64_t ns);
uint64_t tqkv__hedge_delay_ns(const tqkv_client_t *c, size_t ti);
/* A monotonic instant (ns) as a gRPC deadline. */
gpr_timespec tqkv__deadline_at_ns(uint64_t at_ns);

/* ---- reads asked in rounds, hedged (client_call.c) ----
 *
 * Get and Lookup ask each hash's candidates in rank order, one rank position per round;
 * a round groups the hashes it asks by target, one call per target. A round's call that
 * made no progress for its server's hedge delay is hedged: the hashes it has not
 * answered are asked of their next-ranked server not asked yet, in a new wave of calls
 * (at most TQKV__HEDGE_WAVES per round). The operation decides what an answer resolves
 * and calls tqkv__rd_done for each; a call waiting for nothing more that did not answer
 * it lost the race: cancelled (beaten), neither a success nor a failure of its server. */
typedef struct tqkv__rd {
    tqkv_client_t *c;
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t n, nc, round;
    size_t nslots, waves; /* wave w's call to target t is rs[w * nt + t]; waves used */
    uint32_t *cand;       /* n * nc: each hash's candidates, rank order */
    uint64_t *asked;      /* n: rank positions asked (bit k) */
    long *own;            /* 2n: this round's call slot asking hash i, and its hedge's; -1 */
    unsigned char *ask;   /* n: asked this round (decided once) */
    ProtobufCBinaryData *hb;
    size_t *gidx;                  /* n * (1 + waves): the hashes of each call, grouped */
    size_t *start, *hstart, *fill; /* nt + 1 */
    rpc_t *rs;
    int *started;
    void *op;
    int (*resolved)(void *op, size_t i); /* hash i needs no more answers */
    /* starts slot sl's call (r = &rs[sl], target, rank, gidx, count, t0 set) to target t
     * asking hb[from, to); sets r->rem */
    void (*start_call)(void *op, size_t sl, size_t t, size_t from, size_t to);
} tqkv__rd_t;

/* Allocates and ranks (rd->c, ns, hashes, n, op and the two functions set by the
 * caller). TQKV_ENOMEM. */
tqkv_status_t tqkv__rd_init(tqkv__rd_t *rd);
void tqkv__rd_free(tqkv__rd_t *rd);
/* The round's hashes grouped by target (start[]); then its calls started. */
void tqkv__rd_plan(tqkv__rd_t *rd);
void tqkv__rd_start(tqkv__rd_t *rd);
/* When a round call is next due for a hedge (monotonic ns), or UINT64_MAX; the hedges
 * due at now started. */
uint64_t tqkv__rd_hedge_due(const tqkv__rd_t *rd);
void tqkv__rd_hedge(tqkv__rd_t *rd);
/* One unit (a page, a hash) that hash i's calls waited for was answered by r. */
void tqkv__rd_done(tqkv__rd_t *rd, const rpc_t *r, size_t i);

/* ---- targets (client_view.c) ---- */

/* Candidate targets of a block, best first: cand[0..nc). */
size_t tqkv__candidates(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t *cand);
/* How many rank positions Get and Lookup ask. */
size_t tqkv__read_candidates(tqkv_client_t *c);

/* Views (client_view.c): a copy of client c whose t/nt/tab are the current membership table,
 * referenced until tqkv__view_leave; every entry point runs on one. */
tqkv_client_t *tqkv__view_enter(const tqkv_client_t *c, tqkv_client_t *v);
void tqkv__view_leave(tqkv_client_t *v);
/* Index of target t in view c, or c->nt when its table no longer lists it. */
size_t tqkv__view_find(const tqkv_client_t *c, const target_t *t);
int tqkv__hash_ok(const tqkv_hash_t *h);
/* Checks a BF16 block's shape against the limits the server enforces (the page codec's,
 * shared: tqkv_page_check_params) and K + V against the client's message limit (c may
 * be NULL: not checked). Sets the error, prefixed by what. */
tqkv_status_t tqkv__client_check_shape(const tqkv_client_t *c, const tqkv_block_shape_t *s,
                                       const char *what);
/* R as the client uses it: opts->replicas (0 = 1) clamped to the number of targets. */
uint32_t tqkv__client_replicas(const tqkv_client_t *c);

/* ---- read repair (client_repair.c) ---- */

/* Queues a page found below its block's primaries. */
void tqkv__repair_offer(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t layer,
                        const tqkv_block_shape_t *shape, const void *page, size_t len);
/* Starts the repair thread when read repair is on; stops it and frees the queue. */
tqkv_status_t tqkv__repair_start(tqkv_client_t *c);
void tqkv__repair_stop(client_shared_t *sh);

/* ---- TCP data channels (client_dc.c) ---- */

/* A data channel for one Get to target ti, or NULL: ask over gRPC. */
dconn_t *tqkv__dcc_acquire(tqkv_client_t *c, size_t ti, uint32_t setup_ms);
void tqkv__dcc_release(tqkv_client_t *c, size_t ti, dconn_t *d, int reuse);

#endif
