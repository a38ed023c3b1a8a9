/* membership.h - the live set of servers behind a client's targets.
 *
 * A target is either an address used as given ("ipv4:10.0.0.5:50051", "[::1]:50051",
 * "unix:/path", anything with "://") or "HOST:PORT" / "HOST" with a DNS name that
 * stands for a set of servers (a Kubernetes headless Service): its A/AAAA records at
 * PORT, or, where present, its SRV records "_grpc._tcp.HOST" (each naming a host and
 * a port). Names are resolved with c-ares, so a test can point the module at its own
 * DNS server (opts.dns_servers).
 *
 * A background thread re-resolves every interval (default 10 s) and at once when
 * kicked (a server failed). Every resolution builds a new immutable table of members
 * and publishes it atomically; a caller takes a table with tqkv_membership_acquire and
 * keeps using it until tqkv_membership_release, so a call in flight finishes on the
 * table it started with while newer ones are published. A DNS error (timeout,
 * SERVFAIL, no records) keeps the previous addresses of that target: a resolver blip
 * never empties the cluster.
 *
 * Identity: each new address is identified once (opts.identify: the client asks the
 * server for its --node-id) and ranked by tqkv_shard_target_id(node id), so a server
 * restarted on a new address keeps its rank, and two spellings of one server (its IP,
 * a DNS name) are one member. Two addresses answering with one node id are one member:
 * the one that answers now is kept (a server restarted elsewhere replaces its old
 * address). An address that cannot be identified (down, or a server without node ids)
 * ranks by its target string as before, and is asked again at each resolution.
 *
 * Per-address state: opts.attach makes the caller's state for a new address (its
 * channels), opts.detach frees it once no published or acquired table holds it.
 * There is no cap on the number of members.
 */
#ifndef TQKV_TRANSPORT_MEMBERSHIP_H
#define TQKV_TRANSPORT_MEMBERSHIP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

#define TQKV_MEMBERSHIP_DEFAULT_INTERVAL_MS 10000u
#define TQKV_MEMBERSHIP_NODE_ID_MAX 256

/* One server address, shared by every table that lists it (refcounted). */
typedef struct tqkv_member {
    _Atomic uint32_t refs;
    char *addr; /* what to dial: the target as given, or "ipv4:IP:PORT" / "ipv6:[IP]:PORT" */
    char *host; /* the DNS name it was resolved from (TLS authority), NULL for a literal */
    void *user; /* opts.attach's result */
    struct tqkv_membership *owner;
    _Atomic int suspect; /* kicked: identify again at the next resolution */
} tqkv_member_t;

/* One member as one table ranks it. */
typedef struct tqkv_member_slot {
    tqkv_member_t *m;
    char *node_id;    /* identity the server reported; NULL: not known */
    uint64_t rank_id; /* tqkv_shard_target_id(node_id), or of m->addr when unknown */
} tqkv_member_slot_t;

/* An immutable snapshot: n slots in target order (the addresses of one DNS name sorted). */
typedef struct tqkv_member_table {
    _Atomic uint32_t refs;
    uint64_t version; /* 1 for the first table, +1 for each change published */
    size_t n;
    tqkv_member_slot_t *s;
    void **users; /* users[i] = s[i].m->user, for callers that index their state by slot */
    struct tqkv_shard_index *rank_index; /* groups of the rank ids (tqkv_shard_top_index);
                                            NULL up to TQKV_SHARD_FLAT_MAX members */
} tqkv_member_table_t;

typedef struct tqkv_membership_opts {
    const char *const *targets;
    size_t num_targets;
    int resolve;                 /* 0: every target is used as given (no DNS) */
    const char *dns_servers;     /* c-ares servers "IP:PORT,..." (tests); NULL: the system's */
    uint32_t interval_ms;        /* re-resolve period; 0 = default; UINT32_MAX = never */
    uint32_t dns_timeout_ms;     /* per DNS try; 0 = 1000 */
    uint32_t min_kick_ms;        /* least time between two kicked resolutions; 0 = 200 */
    uint32_t identify_threads;   /* parallel identifications; 0 = 16 */
    const char *exclude_node_id; /* a server answering with this node id is left out (a
                                    server's own id when it looks for its peers) */
    void *arg;
    /* Returns new per-address state for addr (borrowed), NULL when out of memory. May be
     * NULL (user stays NULL). Called on the resolving thread. */
    void *(*attach)(void *arg, const char *addr, const char *host);
    /* Frees what attach returned; called when the last table holding it is released. */
    void (*detach)(void *arg, void *user);
    /* Asks the server at m for its node id: 0 and the id in node_id (NUL-terminated;
     * "" when the server has none), -1 when it cannot be reached. May be NULL (no
     * identification: members rank by address). Called from several threads at once. */
    int (*identify)(void *arg, const tqkv_member_t *m, char *node_id, size_t cap);
} tqkv_membership_opts_t;

typedef struct tqkv_membership tqkv_membership_t;

typedef struct tqkv_membership_stats {
    uint64_t resolutions;    /* resolution passes run */
    uint64_t dns_errors;     /* targets whose resolution failed (previous addresses kept) */
    uint64_t tables;         /* tables published (version of the current one) */
    uint64_t identified;     /* successful identifications */
    uint64_t identify_fails; /* failed identifications */
    uint64_t kicks;          /* tqkv_membership_kick calls */
    uint64_t idle_checks;    /* times the thread looked at its schedule and found no pass due */
} tqkv_membership_stats_t;

/* The pollfds c-ares waits on for channel ch (an ares_channel): fills pf (room for
 * TQKV_ARES_MAX_FDS) and returns how many (0: nothing pending). Shared with
 * tqkv-cluster-sim's DNS loop. */
#define TQKV_ARES_MAX_FDS 16 /* ARES_GETSOCK_MAXNUM */
struct ares_channeldata;
struct pollfd;
int tqkv_membership_ares_fds(struct ares_channeldata *ch, struct pollfd *pf);

/* Resolves and identifies every target once (the first table), then starts the
 * re-resolving thread. Borrows o (targets and dns_servers are copied). A target that
 * no DNS answer resolves is used as given. TQKV_EINVAL with a message in err for an
 * empty target or a bad dns_servers list. */
tqkv_status_t tqkv_membership_create(const tqkv_membership_opts_t *o, tqkv_membership_t **out,
                                     char *err, size_t errlen);

/* Stops the thread and releases the current table. Every acquired table must have been
 * released. NULL is a no-op. */
void tqkv_membership_destroy(tqkv_membership_t *ms);

/* Returns the current table with a reference (never NULL, never empty). Thread-safe. */
tqkv_member_table_t *tqkv_membership_acquire(tqkv_membership_t *ms);

/* Drops a reference from acquire. NULL is a no-op. */
void tqkv_membership_release(tqkv_member_table_t *t);

/* A server failed: re-resolve (and re-identify m when given, may be NULL) soon, at most
 * once per min_kick_ms. Never blocks. */
void tqkv_membership_kick(tqkv_membership_t *ms, const tqkv_member_t *m);

/* Resolves, identifies and publishes now, on the calling thread (tests, tools).
 * Returns the version published (unchanged when nothing changed). */
uint64_t tqkv_membership_refresh(tqkv_membership_t *ms);

void tqkv_membership_stats(tqkv_membership_t *ms, tqkv_membership_stats_t *out);

#endif
