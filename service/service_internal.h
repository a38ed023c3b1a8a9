/* service_internal.h - the server's call objects, workers and handler table, shared
 * by server.c (event loop, call state machine), the handlers (handlers_put.c,
 * handlers_get.c, handlers_unary.c, handlers_channel.c, handlers_nccl.c, health.c,
 * reflection.c, dc_server.c) and reload.c.
 *
 * Threading: W workers, each with its own completion queue. Every event of a call
 * lands on the worker that requested it, so per-call state needs no lock; the only
 * cross-thread touches are (a) encoder jobs, which own their job object and end with
 * tqkv__call_wake(), and (b) the health notifier, which wakes idle watchers under
 * the health mutex. grpc_call_start_batch needs external synchronisation, so every
 * batch on a call is started under the call's batch_mu.
 */
#ifndef TQKV_SERVICE_SERVICE_INTERNAL_H
#define TQKV_SERVICE_SERVICE_INTERNAL_H

#include <grpc/grpc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cache/store.h"
#include "kernels/clock.h"
#include "kernels/policy.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/dc_server.h"
#include "service/encoder.h"
#include "service/metrics.h"
#include "service/server.h"
#include "service/validate.h"

typedef struct tqkv__call tqkv__call_t;
typedef struct tqkv__worker tqkv__worker_t;

/* Methods served (index into the handler table). */
typedef enum tqkv__method {
    TQKV__M_PUT,           /* client streaming */
    TQKV__M_LOOKUP,        /* unary */
    TQKV__M_GET,           /* server streaming */
    TQKV__M_DELETE,        /* unary */
    TQKV__M_STATS,         /* unary */
    TQKV__M_HEALTH_CHECK,  /* unary */
    TQKV__M_HEALTH_WATCH,  /* server streaming, open until cancelled */
    TQKV__M_REFLECT_V1,    /* bidi */
    TQKV__M_REFLECT_V1A,   /* bidi, same handler */
    TQKV__M_OPEN_CHANNEL,  /* unary (handlers_channel.c) */
    TQKV__M_CLOSE_CHANNEL, /* unary (handlers_channel.c) */
    TQKV__M_COUNT,
    TQKV__M_GENERIC = TQKV__M_COUNT, /* any unregistered method: UNIMPLEMENTED */
    TQKV__M_GET_NCCL,                /* not registered: a Get with transport NCCL switches to it */
    TQKV__M_GET_TCP,                 /* not registered: a Get with transport TCP switches to it */
} tqkv__method_t;

/* What a completion-queue tag stands for. */
typedef enum tqkv__tag_kind {
    TQKV__TAG_NEW,    /* a requested call arrived (or the request failed at shutdown) */
    TQKV__TAG_RECV,   /* RECV_MESSAGE done */
    TQKV__TAG_SEND,   /* SEND_MESSAGE done */
    TQKV__TAG_STATUS, /* SEND_STATUS_FROM_SERVER (+ optional final message) done */
    TQKV__TAG_CLOSE,  /* SEND_INITIAL_METADATA + RECV_CLOSE_ON_SERVER done: call over */
    TQKV__TAG_WAKE,   /* empty batch: an encoder job finished or a watcher has news */
    TQKV__TAG_COUNT,
} tqkv__tag_kind_t;

/* States of a call; transitions go through tqkv__call_set_state(). */
typedef enum tqkv__call_state {
    TQKV__CS_REQUESTED, /* armed, waiting for the core to match a client call */
    TQKV__CS_RECV,      /* one RECV_MESSAGE in flight (Put: encoder jobs may run too) */
    TQKV__CS_WORK,      /* only encoder jobs in flight; a TAG_WAKE reserved per job */
    TQKV__CS_SEND,      /* one SEND_MESSAGE in flight (the back-pressure; Get: decodes too) */
    TQKV__CS_IDLE,      /* health watch waiting for a change; TAG_WAKE reserved */
    TQKV__CS_STATUS,    /* final status in flight */
    TQKV__CS_DONE,      /* nothing more to send; waiting for the last tags */
} tqkv__call_state_t;

typedef struct tqkv__tag {
    tqkv__call_t *call; /* NULL: the server-shutdown tag */
    tqkv__tag_kind_t kind;
} tqkv__tag_t;

/* Per-method behaviour. Every callback runs on the call's worker thread. */
typedef struct tqkv__handler {
    const char *path;   /* "/pkg.Service/Method" */
    const char *metric; /* method label for metrics */
    int payload_on_new; /* unary request / server-streaming: request with the new call */
    int drain;          /* counts as in-flight work during a graceful stop */
    void (*on_start)(tqkv__call_t *c);        /* call matched; close batch started */
    void (*on_recv)(tqkv__call_t *c, int ok); /* c->recv_bb NULL on half-close */
    void (*on_send)(tqkv__call_t *c, int ok); /* the one SEND_MESSAGE completed */
    void (*on_wake)(tqkv__call_t *c);         /* job done / watcher news */
    void (*on_close)(tqkv__call_t *c);        /* RECV_CLOSE completed (optional) */
    void (*on_free)(tqkv__call_t *c);         /* release method state (optional) */
} tqkv__handler_t;

struct tqkv__call {
    tqkv_server_t *srv;
    tqkv__worker_t *w;
    tqkv__method_t method;
    tqkv__call_state_t state;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details; /* generic calls only */
    grpc_byte_buffer *recv_bb; /* last received message (owned) */
    grpc_byte_buffer *send_bb; /* message in flight (owned until TAG_SEND/STATUS) */
    int cancelled;             /* written by the core when TAG_CLOSE completes */
    int closed;                /* TAG_CLOSE came back */
    int started;               /* TAG_NEW came back ok */
    int inflight;              /* tags started and not yet back (plus a reserved wake) */
    grpc_status_code code;     /* final status (metrics) */
    double t_start;
    tqkv_auth_t *auth; /* the token table in force when the call started (a reference; NULL:
                          no auth): a reload never changes the verdict on a call in flight */
    char *authz;       /* copy of the `authorization` header or NULL */
    int hop;           /* "tqkv-hop" header: routed by the caller, answered here (forward.h) */
    size_t authz_len;
    char req_id[68];         /* x-request-id: the client's (when well-formed) or generated */
    grpc_metadata trail_md;  /* x-request-id in the trailing metadata (slices owned) */
    atomic_int tenant_state; /* 0 unset, 1 being written, 2 set (first namespace seen) */
    char tenant[128];        /* namespace the call named (truncated), for logs */
    char *detail;            /* status message of a failed call (owned), for logs */
    tqkv__tag_t tags[TQKV__TAG_COUNT];
    pthread_mutex_t batch_mu; /* serializes grpc_call_start_batch (worker vs. wakers) */
    void *h;                  /* method state, freed by on_free */
    /* health watch: list links and idle flag, under srv->health_mu */
    tqkv__call_t *watch_next, *watch_prev;
    int watch_idle;
};

struct tqkv__worker {
    tqkv_server_t *srv;
    unsigned index;
    grpc_completion_queue *cq;
    pthread_t thread;
};

#define TQKV__HEALTH_SERVICES 2 /* "" and "tqkv.v1.KVCache" */

typedef struct tqkv__reflection tqkv__reflection_t;

struct tqkv_server {
    tqkv_server_config_t cfg;
    tqkv_limits_t limits;
    tqkv_store_t *store;
    tqkv_encoder_t *enc;
    tqkv_metrics_t *metrics;
    tqkv_auth_t *_Atomic auth; /* NULL: no auth; swapped by a reload under auth_lk */
    pthread_rwlock_t auth_lk;  /* readers take a reference to auth; a reload swaps it */
    struct tqkv_tls *tls;      /* reloadable TLS credentials; NULL without --tls-cert */
    pthread_mutex_t reload_mu; /* one reload at a time (SIGHUP vs. the file watcher) */
    int watch_fd;              /* inotify descriptor, -1 when no file is watched */
    int watch_wake[2];         /* pipe that stops the watcher thread */
    pthread_t watch_thread;
    int watching;          /* watch_thread runs */
    int gpu_encode_device; /* Put encodes on this CUDA device (gpu_encode.c), -1 = CPU */
    atomic_int gpu_encode_warned;
    tqkv__reflection_t *refl;
    tqkv__dc_t *dc; /* TCP data channels (dc_server.c); NULL without --data-listen */
    grpc_server *server;
    void *method_handles[TQKV__M_COUNT];
    tqkv__worker_t *workers;
    unsigned nworkers;
    int port;
    int metrics_port;
    int started;
    atomic_int ready;              /* started and not draining: /readyz answers 200 */
    atomic_int shutting_down;      /* no re-arming after this */
    _Atomic uint64_t handed_off;   /* pages handed off on drain (handoff.c) */
    _Atomic uint64_t forwarded;    /* requests forwarded to owners (forward.c) */
    struct tqkv__fwd *_Atomic fwd; /* the peers for forwarding (forward.c), or NULL */
    pthread_mutex_t fwd_mu;        /* fwd_stop */
    pthread_cond_t fwd_cv;
    pthread_t fwd_thread;
    int fwd_stop, fwd_thread_started, fwd_inited;
    int fwd_rebuild;        /* under fwd_mu: make the peers' client again (tqkv__fwd_reload) */
    atomic_long live_calls; /* call objects allocated (incl. requested ones) */
    atomic_long work_calls; /* matched calls with handler->drain */
    tqkv__tag_t shutdown_tag;
    pthread_mutex_t mu; /* shutdown handshake: shutdown_done, stopped */
    pthread_cond_t cv;
    int shutdown_done;
    int stopped;
    /* health: status per service and the watcher list, under health_mu */
    pthread_mutex_t health_mu;
    int health_status[TQKV__HEALTH_SERVICES];
    tqkv__call_t *watchers;
};

/* Handlers, by file. */
extern const tqkv__handler_t tqkv__put_handler, tqkv__lookup_handler, tqkv__get_handler,
    tqkv__delete_handler, tqkv__stats_handler; /* handlers_put.c, handlers_get.c,
                                                  handlers_unary.c */
extern const tqkv__handler_t tqkv__health_check_handler, tqkv__health_watch_handler; /* health.c */
extern const tqkv__handler_t tqkv__reflection_handler; /* reflection.c */
extern const tqkv__handler_t tqkv__get_dispatch_handler, tqkv__open_channel_handler,
    tqkv__close_channel_handler;                     /* handlers_channel.c */
extern const tqkv__handler_t tqkv__get_nccl_handler; /* handlers_nccl.c */
extern const tqkv__handler_t tqkv__get_tcp_handler;  /* dc_server.c */

/* The answer to OpenChannel and Get with transport NCCL on a server without NCCL. */
#define TQKV__NO_NCCL "NCCL transport not available on this server"
#ifdef TQKV_HAVE_NCCL
/* The server's CUDA device for channels: env TQKV_NCCL_DEVICE, default 0. -1: none
 * (handlers_nccl.c). */
int tqkv__nccl_device(void);
#endif

/* The method table (methods.c): the handler of m (NULL for TQKV__M_GENERIC and unknown
 * methods) and the path each registered method is served under. */
const tqkv__handler_t *tqkv__method_handler(tqkv__method_t m);
extern const char *const tqkv__method_paths[TQKV__M_COUNT];

/* Call helpers (call.c). All run on the call's worker except tqkv__call_wake. */
void tqkv__call_set_state(tqkv__call_t *c, tqkv__call_state_t st);
/* Starts RECV_MESSAGE into c->recv_bb; state CS_RECV. On failure finishes the call. */
void tqkv__call_recv(tqkv__call_t *c);
/* Starts SEND_MESSAGE of bb (takes it); state CS_SEND. */
void tqkv__call_send(tqkv__call_t *c, grpc_byte_buffer *bb);
/* Sends an optional last message (takes it) and the status; state CS_STATUS. */
void tqkv__call_finish(tqkv__call_t *c, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *last);
/* Packs a protobuf-c message and finishes with it and OK. */
void tqkv__call_finish_msg(tqkv__call_t *c, const ProtobufCMessage *m);
/* Abandons a failed or cancelled call (no status sent); state CS_DONE. */
void tqkv__call_abort(tqkv__call_t *c);
/* Reserves TAG_WAKE (worker thread) and queues fn(c) on the encoder pool; state
 * CS_WORK. fn must end with tqkv__call_wake(c). Returns non-OK (nothing queued). */
tqkv_status_t tqkv__call_work(tqkv__call_t *c, tqkv_encoder_fn fn);
/* Reserves TAG_WAKE (worker thread) and queues fn(arg) without changing the state;
 * fn must end with tqkv__call_wake(c). Several may be in flight (Put). */
tqkv_status_t tqkv__call_submit(tqkv__call_t *c, tqkv_encoder_fn fn, void *arg);
/* Reserves TAG_WAKE without a job (health watch going idle). */
void tqkv__call_reserve_wake(tqkv__call_t *c);
/* Fires a reserved TAG_WAKE: any thread, exactly once per reservation. */
void tqkv__call_wake(tqkv__call_t *c);
/* Copies the whole message into a new contiguous buffer (*len); NULL on failure. */
uint8_t *tqkv__bb_read(grpc_byte_buffer *bb, size_t *len);
/* Reads, validates and authorizes (read) the GetRequest of a Get call into *req (free
 * with tqkv__v1__get_request__free_unpacked). Returns 0, or -1 after finishing the call
 * with the status that says what is wrong (handlers_get.c; every Get transport).
 * tqkv__get_request also reads the request's disk-only pages into DRAM on this thread
 * (NCCL); Get and the data channel use _parse and read them off the RPC threads
 * (tqkv_store_pin_disk). */
int tqkv__get_request_parse(tqkv__call_t *c, Tqkv__V1__GetRequest **req);
int tqkv__get_request(tqkv__call_t *c, Tqkv__V1__GetRequest **req);
/* Auth check for namespace ns (NULL = every namespace) when auth is on. */
tqkv_status_t tqkv__call_auth(tqkv__call_t *c, const char *ns, unsigned perm, char *err,
                              size_t errlen);
/* Name of a call state, for log lines. */
const char *tqkv__call_state_name(tqkv__call_state_t st);
/* Starts batch ops on c with the tag of kind k (counted in c->inflight); logs a failure. */
grpc_call_error tqkv__call_start(tqkv__call_t *c, const grpc_op *ops, size_t n, tqkv__tag_kind_t k);
/* Request ids (x-request-id): seeds the generator once; sets c->req_id and the trailer. */
void tqkv__call_req_id_init(void);
void tqkv__call_req_id_set(tqkv__call_t *c);
/* Adds the x-request-id trailing metadata to a SEND_STATUS op. */
void tqkv__call_set_trailers(tqkv__call_t *c, grpc_op *op);
/* Logs the end of a call (access log, slow and failed calls) that took seconds. */
void tqkv__call_log_end(tqkv__call_t *c, const char *method, double seconds);

/* Room for the status message of a KV handler (handlers_put.c, handlers_get.c,
 * handlers_unary.c). */
#define TQKV__KV_ERRLEN 320

/* reload.c: token / TLS reload on SIGHUP (tqkv_server_reload) and on file change. */
/* Takes a reference to the token table in force (NULL without auth). */
tqkv_auth_t *tqkv__auth_acquire(tqkv_server_t *s);
/* Starts the inotify watcher of the token and TLS files' directories (when any is set);
 * a directory that cannot be watched is logged and left to SIGHUP. */
void tqkv__reload_watch_start(tqkv_server_t *s);
/* Stops the watcher thread (idempotent). */
void tqkv__reload_watch_stop(tqkv_server_t *s);

/* health.c */
void tqkv__health_init(tqkv_server_t *s);
/* Sets every service to status (a grpc.health.v1 ServingStatus) and notifies watchers. */
void tqkv__health_set_all(tqkv_server_t *s, int status);

/* reflection.c */
tqkv_status_t tqkv__reflection_create(tqkv__reflection_t **out, char *err, size_t errlen);
void tqkv__reflection_destroy(tqkv__reflection_t *r);

#endif
