/* forward.h - one-hop forwarding of blocks this server does not own (thin clients).
 *
 * A client that reaches the cluster through one address (the load-balanced Service,
 * grpcio) sends every block to whichever pod it is connected to. With --peers (and
 * without --no-forward), a server ranks each block over itself and its peers by node
 * id, as libtqkv does, and sends what another server owns (ranks first) to that owner:
 * Put messages are stored there (the page, encoded here), Lookup asks the owner for its
 * hashes, and a Get first copies the owner's pages of its hashes into this server's
 * store, then streams as usual. The "tqkv-hop" header tells who routed a call
 * (TQKV__HOP_*, below; docs/cluster.md): a peer's ask ("2") is answered from the store
 * alone, never forwarded again (one hop, no loops); a client that shards itself
 * (libtqkv with several targets, "1") gets no forwarding, but its owner reads through
 * the blocks it owns and lacks. Where auth is on, a forwarded call
 * carries the caller's own `authorization` header (the owner checks it again, so a token
 * reaches only what it may reach anywhere); this needs TLS to the peers (--tls-cert):
 * auth on without TLS leaves forwarding off. Blocking: called from encoder-pool jobs.
 *
 * Peers' connections (here and in the hand-off): TLS when this server serves TLS,
 * verified against --peer-ca (or --tls-client-ca), with this server's certificate as the
 * client certificate (mutual TLS), the name of --peer-tls-name or the one dialed; where
 * auth is on, the hand-off and the node-id questions send --peer-token-file's token.
 */
#ifndef TQKV_SERVICE_FORWARD_H
#define TQKV_SERVICE_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "cache/store.h"
#include "kernels/page.h"
#include "kernels/status.h"
#include "service/auth.h"
#include "service/config.h"
#include "transport/client.h"

struct tqkv_server;

/* What the "tqkv-hop" header of a call says (tqkv__call_t.hop); service/server.c parses it:
 * "1" is TQKV__HOP_ROUTED, any other value TQKV__HOP_PEER (the safest: no loop). */
enum {
    TQKV__HOP_NONE = 0,   /* no header: a client that did not shard itself (grpcio, libtqkv
                             with one target): forward what a peer owns, read through what
                             this server owns and lacks */
    TQKV__HOP_ROUTED = 1, /* "1": the client routed it here (it shards itself): no
                             forwarding, but read through what this server owns and lacks */
    TQKV__HOP_PEER = 2,   /* "2": a peer's ask (forwarding, read-through): the store alone */
};
typedef struct tqkv__fwd tqkv__fwd_t;

#define TQKV__PEER_TOKEN_MAX 4096

/* Reads the peer token (one token, blanks around it allowed) from path into tok.
 * TQKV_EINVAL / TQKV_EIO with a reason naming the file (never the token) in err. */
tqkv_status_t tqkv__peer_token(const char *path, char *tok, size_t cap, char *err, size_t errlen);
/* At start, where --peers is in use with auth: the peer token must be readable and hold
 * rw on every namespace in auth (the peers load the same file). Error in err. */
tqkv_status_t tqkv__peer_check(const tqkv_server_config_t *cfg, const tqkv_auth_t *auth, char *err,
                               size_t errlen);
/* The peers' client options (TLS as above, the peer token tok or NULL, the peers'
 * targets parsed into targets[cap] from list, a copy of --peers); every string
 * borrowed from cfg, list and tok. The caller sets deadlines and the rest. */
void tqkv__peer_opts(const tqkv_server_config_t *cfg, char *list, const char **targets, size_t cap,
                     const char *tok, tqkv_client_opts_t *o);

/* Starts the thread that makes the peers' client (with --peers, unless --no-forward, or
 * auth is on without TLS); tqkv__fwd_stop joins it and frees the client (no call may run). */
void tqkv__fwd_start(struct tqkv_server *s);
void tqkv__fwd_stop(struct tqkv_server *s);

/* Credentials rotated (SIGHUP, a changed certificate or token file): the forwarding
 * thread makes the peers' client again, reading the peer CA, the certificate and the peer
 * token anew, and swaps it in once no forwarded call uses the old one; on failure the old
 * one stays (logged). No-op where forwarding is off. */
void tqkv__fwd_reload(struct tqkv_server *s);

/* The peers, or NULL when forwarding is off or no peer is known yet. Borrowed until
 * tqkv__fwd_stop. */
tqkv__fwd_t *tqkv__fwd_get(struct tqkv_server *s);

/* A snapshot of the ranking for one request (the peers' rank ids and ours). */
typedef struct tqkv__fwd_rank {
    uint64_t self;
    uint64_t *ids;  /* peers */
    uint8_t *known; /* the peer's node id is known */
    size_t n;
} tqkv__fwd_rank_t;
tqkv_status_t tqkv__fwd_rank(tqkv__fwd_t *f, tqkv__fwd_rank_t *r);
void tqkv__fwd_rank_free(tqkv__fwd_rank_t *r);
/* 1 when this server ranks first for block (ns, hash) among itself and the peers, or
 * the peer that does has no known node id. */
int tqkv__fwd_owned(const tqkv__fwd_rank_t *r, const char *ns, const uint8_t *hash, size_t len);

/* authz (every call below): the caller's `authorization` header value (borrowed, NULL
 * when it sent none), sent to the owner in place of the peer token. */

/* One block a Put forwards to its owner (every field borrowed for the call). */
typedef struct tqkv__fwd_block {
    const char *ns;
    const uint8_t *hash;
    size_t hash_len;
    const uint8_t *parent; /* NULL: no parent */
    size_t parent_len;
    uint32_t layer;
    tqkv_block_shape_t shape;
    const void *page; /* the encoded page */
    size_t len;       /* its bytes */
} tqkv__fwd_block_t;

/* Puts one page to its owner (a peer). *duplicate set as the owner reports. */
tqkv_status_t tqkv__fwd_put(tqkv__fwd_t *f, const char *authz, const tqkv__fwd_block_t *b,
                            int *duplicate, char *err, size_t errlen);

/* What a request asks the peers for, per hash (want[i]): */
enum {
    TQKV__FWD_NO = 0,    /* nothing: answered from this server's store */
    TQKV__FWD_OWNER = 1, /* a peer owns it (ranks first): forwarding */
    TQKV__FWD_READ = 2,  /* this server owns it but does not hold it: read-through */
};

/* Per hash of hashes[n], the tier the peers report (0 = absent), for the hashes with
 * want[i] set (TQKV__FWD_OWNER or TQKV__FWD_READ; counted apart in the metrics);
 * lease_ms as in Lookup. One tqkv_client_lookup over the peers' client: one batched
 * Lookup per peer and rank round, never one per block. */
tqkv_status_t tqkv__fwd_lookup(tqkv__fwd_t *f, const char *authz, const char *ns,
                               const uint8_t *const *hashes, const size_t *lens,
                               const uint8_t *want, size_t n, uint32_t num_layers,
                               uint32_t lease_ms, uint8_t *tiers, char *err, size_t errlen);

/* Copies the peers' pages of the hashes with want[i] set, layers [begin, end), into
 * the store; each page's CRC is checked before it is stored (a bad copy is dropped:
 * missing, never wrong). Read-through copies (TQKV__FWD_READ) of one call stop at
 * --handoff-bytes (0: no limit), stored like any Put, as a hand-off's pages are at the
 * peer that takes them. Returns the pages copied in *copied. */
tqkv_status_t tqkv__fwd_fill(tqkv__fwd_t *f, const char *authz, const char *ns,
                             const uint8_t *const *hashes, const size_t *lens, const uint8_t *want,
                             size_t n, uint32_t begin, uint32_t end, uint64_t *copied, char *err,
                             size_t errlen);

/* Read-through before a Get that a client sent (hop TQKV__HOP_NONE or TQKV__HOP_ROUTED;
 * gRPC and TCP data channel alike): ranks the hashes, marks those a peer owns
 * (TQKV__FWD_OWNER; only for TQKV__HOP_NONE: a client that routed the call itself asked
 * the server it chose, which answers those from its store) and those
 * this server owns but lacks a layer of in [begin, end) (TQKV__FWD_READ: the peers'
 * client, which leaves this server out, asks the block's next-ranked peers, R + 1 rank
 * positions), and copies them into the store with tqkv__fwd_fill. A failure is logged
 * (at most once a second); the Get then reports those blocks missing. Returns 1 when
 * the peers were asked. Blocking: an encoder-pool job or a data channel's thread. */
int tqkv__fwd_get_copy(tqkv__fwd_t *f, int hop, const char *authz, const char *ns,
                       const uint8_t *const *hashes, const size_t *lens, size_t n, uint32_t begin,
                       uint32_t end);

void tqkv__fwd_destroy(tqkv__fwd_t *f);

/* Background re-replication (replicate.c; --replicate-bytes-per-s, 0 = off): a thread
 * that forward.c starts with the peers' client runs a pass 2 s after the peers' table
 * changed, a down peer came back or a peer said hello, and every 60 s: every block
 * this server holds and ranks first or second for is asked of the other of the two, and
 * put there when that one lacks it, within the byte rate. */
void tqkv__repl_pass(tqkv__fwd_t *f, uint64_t bytes_per_s);
/* A peer's node-id question carried "tqkv-peer-hello: <its node id>" (id, len bytes; the
 * caller checked that its token may write everywhere): that peer (re)started or joined.
 * A restart at the same address and node id changes nothing in DNS or in the peers'
 * table, so this is what makes the next pass (2 s later) push its share to it. A hello
 * of this server's own node id, or before the peers' client exists, is dropped. */
void tqkv__fwd_peer_hello(struct tqkv_server *s, const char *id, size_t len);
/* Puts the stored page k (tqkv_store_export's) to put, as the page, checked whole first
 * (hand-off and re-replication): TQKV_OK with its bytes in *len; TQKV_ENOTFOUND when it
 * is gone or not one to send (a bad hash or page: skipped); else the put's failure. */
tqkv_status_t tqkv__put_stored_page(tqkv_store_t *store, tqkv_put_t *put,
                                    const tqkv_store_key_out_t *k, size_t *len);
/* For replicate.c: the server; the peers' client, read-locked until the release (a
 * reload waits); a sleep of up to seconds that ends early, -1, when the server stops. */
struct tqkv_server *tqkv__fwd_server(tqkv__fwd_t *f);
tqkv_client_t *tqkv__fwd_client_acquire(tqkv__fwd_t *f);
void tqkv__fwd_client_release(tqkv__fwd_t *f);
int tqkv__repl_sleep(tqkv__fwd_t *f, double seconds);

#endif
