/* forward.c - one-hop forwarding to the owners of blocks (see forward.h).
 *
 * The peers' client (libtqkv, R = 1, this server left out by its node id) is created
 * by a thread of its own once the server serves (never on a call's thread: asking
 * ourselves for our node id there could wait on ourselves) and kept until the server
 * goes; until then every block is served here; libtqkv is thread-safe, so
 * every encoder job shares it. Ranking: this server's rank id against the peers'
 * (tqkv_client_target_rank_id), per block: the highest score owns it. A block not
 * owned here ranks a peer first among all, which is also the first of the peers alone:
 * libtqkv's own routing (R = 1) sends it there.
 */
#define _GNU_SOURCE /* pthread_rwlockattr_setkind_np */
#include "service/forward.h"

#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store.h"
#include "service/log.h"
#include "service/metrics.h"
#include "service/service_internal.h"
#include "service/tls.h"
#include "transport/client_server.h"
#include "transport/shard.h"

#define MAX_PEER_TARGETS 64

struct tqkv__fwd {
    tqkv_server_t *srv;
    pthread_rwlock_t lk; /* read: a forwarded call uses cl; write: a reload replaces it */
    tqkv_client_t *cl;
    uint64_t self;
    /* re-replication (replicate.c): its thread, and what stops it */
    pthread_mutex_t rmu;
    pthread_cond_t rcv;
    int rstop, rstarted;
    pthread_t rth;
    _Atomic uint64_t hellos; /* peers' hellos (tqkv__fwd_peer_hello) */
};

#define REPL_SETTLE_S 2.0  /* a pass this long after the peers' table last changed */
#define REPL_PERIOD_S 60.0 /* and at least this often */

tqkv_server_t *
tqkv__fwd_server(tqkv__fwd_t *f)
{
    return f->srv;
}

tqkv_client_t *
tqkv__fwd_client_acquire(tqkv__fwd_t *f)
{
    pthread_rwlock_rdlock(&f->lk);
    return f->cl;
}

void
tqkv__fwd_client_release(tqkv__fwd_t *f)
{
    pthread_rwlock_unlock(&f->lk);
}

int
tqkv__repl_sleep(tqkv__fwd_t *f, double seconds)
{
    pthread_mutex_lock(&f->rmu);
    if (!f->rstop && seconds > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)(seconds * 1e9);
        ts.tv_sec += (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        pthread_cond_timedwait(&f->rcv, &f->rmu, &ts);
    }
    int stop = f->rstop;
    pthread_mutex_unlock(&f->rmu);
    return stop ? -1 : 0;
}

/* What a change of the peers shows in: their rank ids, which are known, and how many
 * down peers answered again (a restart at the same address and node id). */
static uint64_t
peers_fingerprint(tqkv__fwd_t *f)
{
    tqkv__fwd_rank_t rk;
    if (tqkv__fwd_rank(f, &rk) != TQKV_OK)
        return 0;
    uint64_t fp = rk.n;
    for (size_t i = 0; i < rk.n; i++) { /* a sum: the table's order does not matter */
        uint64_t x = rk.ids[i] ^ (rk.known[i] ? 0x9e3779b97f4a7c15ull : 0);
        x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
        fp += x ^ (x >> 29);
    }
    tqkv__fwd_rank_free(&rk);
    tqkv_client_health_stats_t hs;
    memset(&hs, 0, sizeof hs);
    tqkv_client_health_stats(tqkv__fwd_client_acquire(f), &hs);
    tqkv__fwd_client_release(f);
    return fp + hs.revived * 0x94d049bb133111ebull +
           atomic_load(&f->hellos) * 0xd6e8feb86659fd93ull;
}

void
tqkv__fwd_peer_hello(tqkv_server_t *s, const char *id, size_t len)
{
    tqkv__fwd_t *f = atomic_load(&s->fwd);
    if (f == NULL || (len == strlen(s->cfg.node_id) && memcmp(id, s->cfg.node_id, len) == 0))
        return;
    atomic_fetch_add(&f->hellos, 1);
    tqkv_metrics_peer_hello(s->metrics);
    char raw[128], q[300];
    snprintf(raw, sizeof raw, "%.*s", (int)(len < sizeof raw ? len : sizeof raw - 1), id);
    tqkv_log_quote(q, sizeof q, raw);
    tqkv_log(TQKV_LOG_DEBUG, "peer hello: a peer (re)started or joined", "node_id=\"%s\"", q);
}

static void *
repl_main(void *arg)
{
    tqkv__fwd_t *f = arg;
    uint64_t rate = f->srv->cfg.replicate_bytes_per_s, fp = peers_fingerprint(f);
    double changed = tqkv_clock_s(), last = changed;
    while (tqkv__repl_sleep(f, 0.5) == 0) {
        uint64_t now_fp = peers_fingerprint(f);
        double now = tqkv_clock_s();
        if (now_fp != fp) {
            fp = now_fp;
            changed = now;
        }
        if ((changed > 0 && now - changed >= REPL_SETTLE_S) || now - last >= REPL_PERIOD_S) {
            changed = 0;
            tqkv__repl_pass(f, rate);
            last = tqkv_clock_s();
        }
    }
    return NULL;
}

tqkv_status_t
tqkv__peer_token(const char *path, char *tok, size_t cap, char *err, size_t errlen)
{
    char *text = NULL;
    size_t len = 0;
    tok[0] = '\0';
    if (tqkv_read_file(path, &text, &len) != TQKV_OK) {
        snprintf(err, errlen, "--peer-token-file %s: cannot read the file", path);
        return TQKV_EIO;
    }
    const char *b = text, *e = text + len;
    while (b < e && isspace((unsigned char)*b))
        b++;
    while (e > b && isspace((unsigned char)e[-1]))
        e--;
    tqkv_status_t st = TQKV_OK;
    if (b == e) {
        snprintf(err, errlen, "--peer-token-file %s: the file holds no token", path);
        st = TQKV_EINVAL;
    } else if ((size_t)(e - b) >= cap) {
        snprintf(err, errlen, "--peer-token-file %s: the token is over %zu bytes", path, cap - 1);
        st = TQKV_EINVAL;
    } else {
        for (const char *q = b; q < e && st == TQKV_OK; q++)
            if (!isgraph((unsigned char)*q)) {
                snprintf(err, errlen,
                         "--peer-token-file %s: expected one token (no blanks or control "
                         "characters inside it)",
                         path);
                st = TQKV_EINVAL;
            }
        if (st == TQKV_OK) {
            memcpy(tok, b, (size_t)(e - b));
            tok[e - b] = '\0';
        }
    }
    memset(text, 0, len); /* a secret */
    free(text);
    return st;
}

tqkv_status_t
tqkv__peer_check(const tqkv_server_config_t *cfg, const tqkv_auth_t *auth, char *err, size_t errlen)
{
    if (!cfg->peer_token_file[0] || auth == NULL)
        return TQKV_OK;
    char tok[TQKV__PEER_TOKEN_MAX], hdr[TQKV__PEER_TOKEN_MAX + 8];
    tqkv_status_t st = tqkv__peer_token(cfg->peer_token_file, tok, sizeof tok, err, errlen);
    if (st != TQKV_OK)
        return st;
    int n = snprintf(hdr, sizeof hdr, "Bearer %s", tok);
    st = tqkv_auth_check(auth, hdr, (size_t)n, NULL, 0, TQKV_AUTH_READ | TQKV_AUTH_WRITE);
    memset(tok, 0, sizeof tok);
    memset(hdr, 0, sizeof hdr);
    if (st == TQKV_EAUTH) {
        snprintf(err, errlen,
                 "--peer-token-file %s: the token is not in --auth-tokens (the peers load the "
                 "same file: add a line 'TOKEN rw *')",
                 cfg->peer_token_file);
        return TQKV_EINVAL;
    }
    if (st != TQKV_OK) {
        snprintf(err, errlen,
                 "--peer-token-file %s: the token must have rw on * in --auth-tokens (the "
                 "hand-off puts pages of every namespace)",
                 cfg->peer_token_file);
        return TQKV_EINVAL;
    }
    return TQKV_OK;
}

void
tqkv__peer_opts(const tqkv_server_config_t *cfg, char *list, const char **targets, size_t cap,
                const char *tok, tqkv_client_opts_t *o)
{
    char *save = NULL;
    size_t nt = 0;
    for (char *t = strtok_r(list, ",", &save); t && nt < cap; t = strtok_r(NULL, ",", &save))
        if (*t)
            targets[nt++] = t;
    memset(o, 0, sizeof *o);
    o->targets = targets;
    o->num_targets = nt;
    o->resolve_targets = 1;
    o->dns_servers = cfg->peers_dns[0] ? cfg->peers_dns : NULL;
    o->max_message_bytes = (size_t)cfg->max_message_bytes;
    o->no_read_repair = 1; /* exclude_node_id and hop: tqkv_client_create_peer */
    o->token = tok && tok[0] ? tok : NULL;
    if (cfg->tls_cert[0]) { /* verified, never skipped: config.c demands a CA */
        o->tls = 1;
        o->tls_ca_path = cfg->peer_ca[0] ? cfg->peer_ca : cfg->tls_client_ca;
        o->tls_cert_path = cfg->tls_cert; /* our own certificate: peers with mutual TLS */
        o->tls_key_path = cfg->tls_key;
        o->tls_target_name = cfg->peer_tls_name[0] ? cfg->peer_tls_name : NULL;
    }
}

tqkv__fwd_t *
tqkv__fwd_get(tqkv_server_t *s)
{
    return atomic_load(&s->fwd);
}

/* A new peers' client with the credentials read now (peer token, CA, certificate), or
 * NULL, the reason logged once per *warned. Asks every peer, and itself, for a node id:
 * only ever on the forwarding thread. */
static tqkv_client_t *
peers_client(tqkv_server_t *s, int *warned)
{
    char list[sizeof s->cfg.peers], tok[TQKV__PEER_TOKEN_MAX] = "", err[512];
    const char *targets[MAX_PEER_TARGETS];
    snprintf(list, sizeof list, "%s", s->cfg.peers);
    if (s->cfg.peer_token_file[0] &&
        tqkv__peer_token(s->cfg.peer_token_file, tok, sizeof tok, err, sizeof err) != TQKV_OK &&
        !*warned)
        tqkv_log(TQKV_LOG_WARN, "forwarding: no peer token", "error=\"%s\"", err);
    tqkv_client_opts_t o;
    tqkv__peer_opts(&s->cfg, list, targets, MAX_PEER_TARGETS, tok, &o);
    o.deadline_ms = 10000;
    o.resolve_interval_ms = 1000; /* pods come and go */
    o.backoff_min_ms = 100;
    o.backoff_max_ms = 2000;
    tqkv_client_t *cl = NULL;
    /* hop 2: a peer's ask, answered from the peer's store alone (no forwarding, no
     * read-through: no loops) */
    tqkv_client_peer_opts_t po = {
        .exclude_node_id = s->cfg.node_id, .hop = TQKV__HOP_PEER, .hello_node_id = s->cfg.node_id};
    tqkv_status_t st = o.num_targets ? tqkv_client_create_peer(&o, &po, &cl) : TQKV_EINVAL;
    memset(tok, 0, sizeof tok); /* the client keeps its own copy */
    if (st != TQKV_OK) {
        if (!(*warned)++) {
            char q[300];
            tqkv_log_quote(q, sizeof q,
                           o.num_targets ? tqkv_client_last_error()->message : "empty --peers");
            tqkv_log(TQKV_LOG_WARN, "forwarding: cannot make the peers' client (again every 2 s)",
                     "error=\"%s\"", q);
        }
        tqkv_client_destroy(cl);
        return NULL;
    }
    *warned = 0;
    return cl;
}

/* The forwarding thread: makes the peers' client once the server serves, again every 2 s
 * until it has one, and again at each tqkv__fwd_reload (credentials rotated): the new
 * client replaces the old under f->lk, once no forwarded call uses the old one. */
static void *
fwd_main(void *arg)
{
    tqkv_server_t *s = arg;
    tqkv__fwd_t *f = NULL;
    int warned = 0;
    pthread_mutex_lock(&s->fwd_mu);
    while (!s->fwd_stop) {
        if (f != NULL && !s->fwd_rebuild) {
            pthread_cond_wait(&s->fwd_cv, &s->fwd_mu);
            continue;
        }
        int rebuild = s->fwd_rebuild;
        s->fwd_rebuild = 0;
        pthread_mutex_unlock(&s->fwd_mu);
        tqkv_client_t *cl = peers_client(s, &warned);
        if (cl && f == NULL) {
            if ((f = calloc(1, sizeof *f)) == NULL) {
                tqkv_client_destroy(cl);
            } else {
                pthread_rwlockattr_t ra;
                pthread_rwlockattr_init(&ra);
                /* a reload must not wait behind an endless stream of forwarded calls */
                pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
                pthread_rwlock_init(&f->lk, &ra);
                pthread_rwlockattr_destroy(&ra);
                f->srv = s;
                f->cl = cl;
                f->self = tqkv_shard_target_id(s->cfg.node_id);
                pthread_mutex_init(&f->rmu, NULL);
                pthread_condattr_t ca;
                pthread_condattr_init(&ca);
                pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
                pthread_cond_init(&f->rcv, &ca);
                pthread_condattr_destroy(&ca);
                if (s->cfg.replicate_bytes_per_s)
                    f->rstarted = pthread_create(&f->rth, NULL, repl_main, f) == 0;
                atomic_store(&s->fwd, f);
                tqkv_log(TQKV_LOG_INFO, "forwarding to peers", "peers=%zu tls=%s",
                         tqkv_client_num_targets(cl), s->cfg.tls_cert[0] ? "on" : "off");
            }
        } else if (cl) {
            pthread_rwlock_wrlock(&f->lk);
            tqkv_client_t *old = f->cl;
            f->cl = cl;
            pthread_rwlock_unlock(&f->lk);
            tqkv_client_destroy(old);
            tqkv_log(TQKV_LOG_INFO, "forwarding: peers' client made again (credentials read now)",
                     "peers=%zu", tqkv_client_num_targets(cl));
        } else if (rebuild && f != NULL) {
            tqkv_log(TQKV_LOG_WARN, "forwarding: reload failed, the previous peers' client stays",
                     "peers=\"%s\"", s->cfg.peers);
        }
        pthread_mutex_lock(&s->fwd_mu);
        if (f == NULL && !s->fwd_stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 2;
            pthread_cond_timedwait(&s->fwd_cv, &s->fwd_mu, &ts);
        }
    }
    pthread_mutex_unlock(&s->fwd_mu);
    return NULL;
}

void
tqkv__fwd_reload(tqkv_server_t *s)
{
    if (!s->fwd_inited || !s->fwd_thread_started)
        return;
    pthread_mutex_lock(&s->fwd_mu);
    s->fwd_rebuild = 1;
    pthread_cond_broadcast(&s->fwd_cv);
    pthread_mutex_unlock(&s->fwd_mu);
}

void
tqkv__fwd_start(tqkv_server_t *s)
{
    pthread_mutex_init(&s->fwd_mu, NULL);
    pthread_cond_init(&s->fwd_cv, NULL);
    s->fwd_inited = 1;
    if (s->cfg.no_forward || s->cfg.peers[0] == '\0')
        return;
    if (s->auth != NULL && !s->cfg.tls_cert[0]) {
        tqkv_log(TQKV_LOG_WARN,
                 "forwarding off: auth is on without TLS (the callers' tokens would travel "
                 "to the peers in clear; set --tls-cert and --peer-ca)",
                 "peers=\"%s\"", s->cfg.peers);
        return;
    }
    s->fwd_thread_started = pthread_create(&s->fwd_thread, NULL, fwd_main, s) == 0;
}

void
tqkv__fwd_stop(tqkv_server_t *s)
{
    if (!s->fwd_inited)
        return;
    if (s->fwd_thread_started) {
        pthread_mutex_lock(&s->fwd_mu);
        s->fwd_stop = 1;
        pthread_cond_broadcast(&s->fwd_cv);
        pthread_mutex_unlock(&s->fwd_mu);
        pthread_join(s->fwd_thread, NULL);
        s->fwd_thread_started = 0;
    }
    tqkv__fwd_destroy(atomic_exchange(&s->fwd, NULL));
    pthread_mutex_destroy(&s->fwd_mu);
    pthread_cond_destroy(&s->fwd_cv);
    s->fwd_inited = 0;
}

void
tqkv__fwd_destroy(tqkv__fwd_t *f)
{
    if (f == NULL)
        return;
    if (f->rstarted) {
        pthread_mutex_lock(&f->rmu);
        f->rstop = 1;
        pthread_cond_broadcast(&f->rcv);
        pthread_mutex_unlock(&f->rmu);
        pthread_join(f->rth, NULL);
    }
    pthread_mutex_destroy(&f->rmu);
    pthread_cond_destroy(&f->rcv);
    tqkv_client_destroy(f->cl);
    pthread_rwlock_destroy(&f->lk);
    free(f);
}

tqkv_status_t
tqkv__fwd_rank(tqkv__fwd_t *f, tqkv__fwd_rank_t *r)
{
    r->self = f->self;
    pthread_rwlock_rdlock(&f->lk);
    r->n = tqkv_client_num_targets(f->cl);
    r->ids = calloc(r->n + 1, sizeof *r->ids); /* the peers, then ourselves */
    r->known = calloc(r->n ? r->n : 1, 1);
    if (r->ids == NULL || r->known == NULL) {
        pthread_rwlock_unlock(&f->lk);
        free(r->ids);
        free(r->known);
        return TQKV_ENOMEM;
    }
    for (size_t i = 0; i < r->n; i++) {
        char id[8];
        r->ids[i] = tqkv_client_target_rank_id(f->cl, i);
        r->known[i] = tqkv_client_target_node_id(f->cl, i, id, sizeof id) == 0;
    }
    r->ids[r->n] = r->self;
    pthread_rwlock_unlock(&f->lk);
    return TQKV_OK;
}

void
tqkv__fwd_rank_free(tqkv__fwd_rank_t *r)
{
    free(r->ids);
    free(r->known);
    r->ids = NULL;
    r->known = NULL;
}

int
tqkv__fwd_owned(const tqkv__fwd_rank_t *r, const char *ns, const uint8_t *hash, size_t len)
{
    /* The first of the peers and ourselves (ids[n]), as the clients rank them
     * (tqkv_shard_top: flat up to TQKV_SHARD_FLAT_MAX servers, two-level above). */
    uint32_t top = (uint32_t)r->n;
    tqkv_shard_top(r->ids, sizeof *r->ids, r->n + 1, tqkv_shard_block_key(ns, hash, len), 1, &top);
    /* A peer that has not told its node id (not up yet, an address that does not
     * answer) is nobody's owner: the block stays here rather than go nowhere. */
    return top == r->n || !r->known[top];
}

static void
copy_hash(tqkv_hash_t *h, const uint8_t *p, size_t len)
{
    h->len = (uint8_t)(len > TQKV_HASH_MAX ? TQKV_HASH_MAX : len);
    memcpy(h->bytes, p, h->len);
}

tqkv_status_t
tqkv__fwd_put(tqkv__fwd_t *f, const char *authz, const tqkv__fwd_block_t *blk, int *duplicate,
              char *err, size_t errlen)
{
    tqkv_hash_t h, ph;
    copy_hash(&h, blk->hash, blk->hash_len);
    if (blk->parent)
        copy_hash(&ph, blk->parent, blk->parent_len);
    tqkv_put_t *p = NULL;
    tqkv_client_thread_authz(authz);
    pthread_rwlock_rdlock(&f->lk);
    tqkv_status_t st = tqkv_client_put_begin(f->cl, NULL, &p);
    if (st == TQKV_OK) {
        tqkv_put_block_t b = {.ns = blk->ns,
                              .hash = &h,
                              .parent = blk->parent ? &ph : NULL,
                              .layer = blk->layer,
                              .shape = blk->shape,
                              .page = blk->page,
                              .page_len = blk->len};
        st = tqkv_client_put_block(p, &b);
        tqkv_put_result_t res;
        tqkv_status_t st2 = tqkv_client_put_end(p, &res);
        if (st == TQKV_OK)
            st = st2;
        if (st == TQKV_OK && res.blocks_lost)
            st = TQKV_EUNAVAILABLE;
        *duplicate = res.blocks_duplicate > 0;
    }
    pthread_rwlock_unlock(&f->lk);
    tqkv_client_thread_authz(NULL);
    if (st != TQKV_OK)
        snprintf(err, errlen, "forward to the block's owner: %s",
                 tqkv_client_last_error()->message);
    else
        tqkv_metrics_forwarded(f->srv->metrics, TQKV_METRICS_FWD_PUT, 1);
    return st;
}

/* The wanted hashes as a new array (*out, *nout, and their indexes in *idx), or
 * TQKV_ENOMEM with the reason in err. */
static tqkv_status_t
gather(const uint8_t *const *hashes, const size_t *lens, const uint8_t *want, size_t n,
       tqkv_hash_t **out, size_t **idx, size_t *nout, char *err, size_t errlen)
{
    *nout = 0;
    *out = malloc((n ? n : 1) * sizeof **out);
    *idx = malloc((n ? n : 1) * sizeof **idx);
    if (*out == NULL || *idx == NULL) {
        free(*out);
        free(*idx);
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        if (want[i]) {
            copy_hash(&(*out)[*nout], hashes[i], lens[i]);
            (*idx)[(*nout)++] = i;
        }
    return TQKV_OK;
}

tqkv_status_t
tqkv__fwd_lookup(tqkv__fwd_t *f, const char *authz, const char *ns, const uint8_t *const *hashes,
                 const size_t *lens, const uint8_t *want, size_t n, uint32_t num_layers,
                 uint32_t lease_ms, uint8_t *tiers, char *err, size_t errlen)
{
    tqkv_hash_t *hs;
    size_t *idx, m;
    if (gather(hashes, lens, want, n, &hs, &idx, &m, err, errlen) != TQKV_OK)
        return TQKV_ENOMEM;
    tqkv_status_t st = TQKV_OK;
    uint8_t *t = calloc(m ? m : 1, 1);
    if (m > 0 && t) {
        tqkv_lookup_req_t q = {.ns = ns,
                               .hashes = hs,
                               .num_hashes = m,
                               .num_layers = num_layers,
                               .lease_ms = lease_ms};
        uint32_t prefix = 0;
        tqkv_client_thread_authz(authz);
        pthread_rwlock_rdlock(&f->lk);
        st = tqkv_client_lookup(f->cl, &q, &prefix, t);
        pthread_rwlock_unlock(&f->lk);
        tqkv_client_thread_authz(NULL);
        uint64_t owner = 0, read = 0, found = 0;
        for (size_t k = 0; k < m; k++) {
            int rt = want[idx[k]] == TQKV__FWD_READ;
            owner += !rt;
            read += rt;
            found += rt && st == TQKV_OK && t[k] != 0;
        }
        if (st == TQKV_OK) {
            for (size_t k = 0; k < m; k++)
                tiers[idx[k]] = t[k];
        } else {
            snprintf(err, errlen, "forward to the blocks' owners: %s",
                     tqkv_client_last_error()->message);
        }
        if (owner && st == TQKV_OK)
            tqkv_metrics_forwarded(f->srv->metrics, TQKV_METRICS_FWD_LOOKUP, owner);
        if (read)
            tqkv_metrics_readthru(f->srv->metrics, TQKV_METRICS_FWD_LOOKUP, read, found, 0);
    } else if (t == NULL) {
        st = TQKV_ENOMEM;
        snprintf(err, errlen, "out of memory");
    }
    free(t);
    free(hs);
    free(idx);
    return st;
}

typedef struct fill {
    tqkv_store_t *store;
    const char *ns;
    const tqkv_hash_t *hs;
    const uint8_t *want; /* per request hash: TQKV__FWD_* */
    const size_t *idx;   /* per asked hash: its request index */
    uint64_t copied;
    uint64_t rt_pages, rt_bytes, rt_budget; /* read-through copies; budget 0: none */
    tqkv_store_sync_t sync; /* --disk-sync always: one fdatasync for the whole fill */
} fill_t;

static int
fill_cb(void *arg, const tqkv_get_page_t *pg)
{
    fill_t *x = arg;
    if (!pg->found || pg->page == NULL)
        return 0;
    int rt = x->want[x->idx[pg->hash_index]] == TQKV__FWD_READ;
    if (rt && x->rt_budget && x->rt_bytes + pg->page_len > x->rt_budget)
        return 0; /* past the byte budget: left to the peer (the Get reports it missing) */
    /* The copy is checked whole before it is stored (libtqkv checked the CRC already
     * where crc_checked is 1): a bad one is dropped, never served. */
    tqkv_page_info_t info;
    if (tqkv_page_validate(pg->page, pg->page_len, pg->crc_checked != 1, &info, NULL, 0) != TQKV_OK)
        return 0;
    const tqkv_hash_t *h = &x->hs[pg->hash_index];
    tqkv_block_key_t key = {x->ns, strlen(x->ns), h->bytes, h->len, pg->layer};
    int dup = 0;
    if (tqkv_store_put_nosync(x->store, &key, NULL, 0, pg->page, pg->page_len, info.bf16_bytes,
                              &dup, &x->sync) == TQKV_OK) {
        x->copied++;
        if (rt) {
            x->rt_pages++;
            x->rt_bytes += pg->page_len;
        }
    }
    return 0;
}

tqkv_status_t
tqkv__fwd_fill(tqkv__fwd_t *f, const char *authz, const char *ns, const uint8_t *const *hashes,
               const size_t *lens, const uint8_t *want, size_t n, uint32_t begin, uint32_t end,
               uint64_t *copied, char *err, size_t errlen)
{
    tqkv_hash_t *hs;
    size_t *idx, m;
    *copied = 0;
    if (gather(hashes, lens, want, n, &hs, &idx, &m, err, errlen) != TQKV_OK)
        return TQKV_ENOMEM;
    tqkv_status_t st = TQKV_OK;
    if (m > 0) {
        fill_t x = {.store = f->srv->store,
                    .ns = ns,
                    .hs = hs,
                    .want = want,
                    .idx = idx,
                    .rt_budget = f->srv->cfg.handoff_bytes};
        tqkv_get_req_t q = {.ns = ns,
                            .hashes = hs,
                            .num_hashes = m,
                            .layer_begin = begin,
                            .layer_end = end,
                            .encoding = TQKV_CLIENT_PACKED};
        tqkv_client_thread_authz(authz);
        pthread_rwlock_rdlock(&f->lk);
        st = tqkv_client_get(f->cl, &q, fill_cb, &x);
        pthread_rwlock_unlock(&f->lk);
        tqkv_client_thread_authz(NULL);
        /* The copies are a cache of the owners' pages: their sync failing loses nothing
         * the owners do not keep, so it is logged, not returned. */
        tqkv_status_t sst = tqkv_store_sync(f->srv->store, &x.sync);
        if (sst != TQKV_OK)
            tqkv_log(TQKV_LOG_WARN, "forwarded pages not made durable on disk", "error=\"%s\"",
                     tqkv_strerror(sst));
        *copied = x.copied;
        uint64_t owner = 0, read = 0;
        for (size_t k = 0; k < m; k++) {
            owner += want[idx[k]] != TQKV__FWD_READ;
            read += want[idx[k]] == TQKV__FWD_READ;
        }
        if (owner && st == TQKV_OK)
            tqkv_metrics_forwarded(f->srv->metrics, TQKV_METRICS_FWD_GET, owner);
        if (read)
            tqkv_metrics_readthru(f->srv->metrics, TQKV_METRICS_FWD_GET, read, x.rt_pages,
                                  x.rt_bytes);
        if (st != TQKV_OK)
            snprintf(err, errlen, "forward to the blocks' owners: %s",
                     tqkv_client_last_error()->message);
    }
    free(hs);
    free(idx);
    return st;
}

/* Logs a failed ask of the peers at most once a second (a dead peer under load must not
 * fill the log); the rest are counted into the next line. */
static void
log_ask_failed(const char *what, const char *err)
{
    static _Atomic uint64_t last_ns, skipped;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint64_t prev = atomic_load(&last_ns);
    if (prev && now - prev < 1000000000ull) {
        atomic_fetch_add(&skipped, 1);
        return;
    }
    if (!atomic_compare_exchange_strong(&last_ns, &prev, now)) {
        atomic_fetch_add(&skipped, 1);
        return;
    }
    char q[600];
    tqkv_log_quote(q, sizeof q, err);
    tqkv_log(TQKV_LOG_WARN, what, "error=\"%s\" not_logged_since=%llu", q,
             (unsigned long long)atomic_exchange(&skipped, 0));
}

int
tqkv__fwd_get_copy(tqkv__fwd_t *f, int hop, const char *authz, const char *ns,
                   const uint8_t *const *hashes, const size_t *lens, size_t n, uint32_t begin,
                   uint32_t end)
{
    tqkv__fwd_rank_t rk;
    if (f == NULL || hop == TQKV__HOP_PEER || n == 0 || end <= begin ||
        tqkv__fwd_rank(f, &rk) != TQKV_OK)
        return 0;
    uint8_t *want = calloc(n, 1), *tiers = calloc(n, 1);
    size_t nw = 0, nown = 0;
    uint32_t prefix = 0;
    /* A peer's block: forwarded for a client that did not shard itself; one that did
     * (TQKV__HOP_ROUTED) chose this server, which answers it from its store. */
    uint8_t other = hop == TQKV__HOP_NONE ? TQKV__FWD_OWNER : TQKV__FWD_NO;
    for (size_t i = 0; want && tiers && i < n; i++) {
        int own = tqkv__fwd_owned(&rk, ns, hashes[i], lens[i]);
        want[i] = own ? TQKV__FWD_NO : other;
        nown += (size_t)own;
    }
    /* Owned hashes: which lack a layer here (layers [0, end): a Get rarely starts past 0,
     * and asking for one more hash costs nothing but its bytes on the wire). A store
     * failure here leaves them to the store's own answer. */
    if (want && tiers && nown > 0 && rk.n > 0 &&
        tqkv_store_lookup(f->srv->store, ns, strlen(ns), hashes, lens, n, end, 0, &prefix, tiers) ==
            TQKV_OK)
        for (size_t i = 0; i < n; i++)
            if (want[i] == TQKV__FWD_NO && tiers[i] == TQKV_TIER_NONE &&
                tqkv__fwd_owned(&rk, ns, hashes[i], lens[i]))
                want[i] = TQKV__FWD_READ;
    tqkv__fwd_rank_free(&rk);
    for (size_t i = 0; want && i < n; i++)
        nw += want[i] != TQKV__FWD_NO;
    if (nw > 0) {
        uint64_t copied = 0;
        char err[512];
        if (tqkv__fwd_fill(f, authz, ns, hashes, lens, want, n, begin, end, &copied, err,
                           sizeof err) != TQKV_OK)
            log_ask_failed("get: asking the peers failed", err);
    }
    free(want);
    free(tiers);
    return nw > 0;
}
