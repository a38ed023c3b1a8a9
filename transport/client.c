/* client.c - libtqkv: gRPC C-core client of tqkv.v1.KVCache, with sharding.
 *
 * Every operation owns a completion queue (grpc_completion_queue_create_for_next)
 * on which it starts all its calls (one per target it fans out to) and drives them
 * to completion on the calling thread. Threads share only the channels (thread-safe;
 * read under a per-target rwlock because a reconnect may swap them) and the atomic
 * per-target health (transport/shard.h); per-call state (rpc_t) belongs to one
 * operation. Each rpc_t counts its tags in flight and is
 * freed only when the count is zero (a started batch always comes back).
 *
 * Per call: RECV_STATUS_ON_CLIENT first in its own batch, then SEND_INITIAL_METADATA
 * (+ the request for unary and server-streaming calls), at most one SEND_MESSAGE and
 * one RECV_MESSAGE in flight.
 *
 * Get responses are parsed in place (a hand-written GetResponse reader over one
 * copy of the message into a scratch buffer shifted so that the page lands 64-byte
 * aligned), so a packed page costs one copy between the socket and the callback.
 *
 * This file: create/destroy and the target table; the other concerns are in the
 * client_*.c files listed in transport/client_internal.h.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "kernels/page.h"
#include "transport/client_health.h"
#include "transport/client_internal.h"
#include "transport/dc_tls.h"

/* ---- create / destroy ---- */

static char *
read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        if (n + 1024 >= cap) {
            char *nb = realloc(b, cap * 2);
            if (nb == NULL) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t got = fread(b + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    if (b)
        b[n] = '\0';
    return b;
}

/* ---- targets from the membership (membership.h) ---- */

/* opts.attach: the state of a new server address: its channels. */
static void *
target_attach(void *arg, const char *addr, const char *host)
{
    tqkv_client_t *c = arg;
    target_t *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->name = strdup(addr);
    t->host = host ? strdup(host) : NULL;
    t->ch = calloc(c->nch, sizeof *t->ch);
    if (t->name == NULL || (host && t->host == NULL) || t->ch == NULL)
        goto fail;
    t->cargs = &c->cargs;
    if (c->tls && c->tls_name == NULL && t->host &&
        c->cargs.num_args < sizeof t->own_args / sizeof t->own_args[0]) {
        /* an address resolved from a name: the certificate names the name */
        memcpy(t->own_args, c->cargs.args, c->cargs.num_args * sizeof *t->own_args);
        grpc_arg *a = &t->own_args[c->cargs.num_args];
        a->type = GRPC_ARG_STRING;
        a->key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        a->value.string = t->host;
        t->own_cargs.num_args = c->cargs.num_args + 1;
        t->own_cargs.args = t->own_args;
        t->cargs = &t->own_cargs;
    }
    for (uint32_t k = 0; k < c->nch; k++) {
        if ((t->ch[k] = grpc_channel_create(t->name, c->creds, t->cargs)) == NULL)
            goto fail;
        t->nch++;
    }
    tqkv_shard_health_init(&t->health);
    pthread_rwlock_init(&t->lock, NULL);
    pthread_mutex_init(&t->dc_mu, NULL);
    atomic_init(&t->renewed_ns, 0);
    return t;
fail:
    for (uint32_t k = 0; k < t->nch; k++)
        grpc_channel_destroy(t->ch[k]);
    free(t->ch);
    free(t->name);
    free(t->host);
    free(t);
    return NULL;
}

/* opts.detach: no table lists the target any more and no call uses it: its connections
 * close; the struct (its name) stays on the retired list until the client goes. */
static void
target_detach(void *arg, void *user)
{
    tqkv_client_t *c = arg;
    target_t *t = user;
    for (uint32_t k = 0; k < t->nch; k++)
        grpc_channel_destroy(t->ch[k]);
    t->nch = 0;
    for (dconn_t *d = t->dc_idle, *nx; d; d = nx) {
        nx = d->next;
        SSL_free(d->ssl); /* TLS channels: the session (the merge had lost this free) */
        close(d->fd);     /* the server drops a channel whose connection closes */
        free(d);
    }
    t->dc_idle = NULL;
    pthread_mutex_lock(&c->sh->mu);
    t->retired_next = c->sh->retired;
    c->sh->retired = t;
    pthread_mutex_unlock(&c->sh->mu);
}

/* opts.identify: the server's node id (Stats identity_only). */
static int
target_identify(void *arg, const tqkv_member_t *m, char *node_id, size_t cap)
{
    tqkv_client_t *c = arg;
    target_t *t = m->user;
    char why[256];
    pthread_rwlock_rdlock(&t->lock); /* a reconnect would swap ch[0] */
    int rc = tqkv__node_id_query(t->ch[0], c->has_auth ? &c->auth_md : NULL, c->has_auth ? 1 : 0,
                                 c->identify_ms, node_id, cap, why, sizeof why);
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

static void
target_free(target_t *t)
{
    free(t->ch);
    free(t->name);
    free(t->host);
    pthread_rwlock_destroy(&t->lock);
    pthread_mutex_destroy(&t->dc_mu);
    free(t);
}

/* ---- read repair ---- */

/* A page of block (ns, hash, layer) was found at rank position > 0 (its primaries
 * missed it: a scale-out or a restart moved them): queue it to be put again, as the
 * packed page, to the block's current primaries. Copies page; drops it when the queue
 * is full. */
void
tqkv__repair_offer(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t layer,
                   const tqkv_block_shape_t *shape, const void *page, size_t len)
{
    client_shared_t *sh = c->sh;
    if (sh->rq_max == 0)
        return;
    pthread_mutex_lock(&sh->mu);
    if (sh->rq_stop || sh->rq_bytes + len > sh->rq_max) {
        sh->rs.dropped++;
        pthread_mutex_unlock(&sh->mu);
        return;
    }
    sh->rq_bytes += len;
    pthread_mutex_unlock(&sh->mu);
    repair_t *r = malloc(sizeof *r + len);
    char *n = strdup(ns);
    if (r == NULL || n == NULL) {
        free(r);
        free(n);
        pthread_mutex_lock(&sh->mu);
        sh->rq_bytes -= len;
        sh->rs.dropped++;
        pthread_mutex_unlock(&sh->mu);
        return;
    }
    r->next = NULL;
    r->ns = n;
    r->hash = *h;
    r->layer = layer;
    r->shape = *shape;
    r->len = len;
    memcpy(r->page, page, len);
    pthread_mutex_lock(&sh->mu);
    if (sh->rq_tail)
        sh->rq_tail->next = r;
    else
        sh->rq_head = r;
    sh->rq_tail = r;
    sh->rs.queued++;
    pthread_cond_broadcast(&sh->rcv);
    pthread_mutex_unlock(&sh->mu);
}

/* Puts the queued pages again, a batch per put session (routed to each block's
 * primaries in the current table; a primary that has it counts a duplicate). */
static void *
repair_main(void *arg)
{
    client_shared_t *sh = arg;
    pthread_mutex_lock(&sh->mu);
    for (;;) {
        while (!sh->rq_stop && sh->rq_head == NULL)
            pthread_cond_wait(&sh->rcv, &sh->mu);
        if (sh->rq_stop)
            break;
        repair_t *batch = sh->rq_head;
        sh->rq_head = sh->rq_tail = NULL;
        sh->rq_busy = 1;
        pthread_mutex_unlock(&sh->mu);
        uint64_t sent = 0, stored = 0, failed = 0;
        size_t bytes = 0;
        tqkv_put_t *p = NULL;
        tqkv_status_t st = tqkv_client_put_begin(sh->root, NULL, &p);
        for (repair_t *r = batch; r; r = r->next) {
            bytes += r->len;
            tqkv_put_block_t b = {.ns = r->ns,
                                  .hash = &r->hash,
                                  .layer = r->layer,
                                  .shape = r->shape,
                                  .page = r->page,
                                  .page_len = r->len};
            if (st == TQKV_OK && tqkv_client_put_block(p, &b) == TQKV_OK)
                sent++;
            else
                failed++;
        }
        if (p) {
            tqkv_put_result_t res;
            if (tqkv_client_put_end(p, &res) == TQKV_OK) {
                stored = res.blocks_stored;
            } else {
                failed += sent;
                sent = 0;
            }
        }
        for (repair_t *r = batch, *nx; r; r = nx) {
            nx = r->next;
            free(r->ns);
            free(r);
        }
        pthread_mutex_lock(&sh->mu);
        sh->rq_bytes -= bytes;
        sh->rs.repaired += sent;
        sh->rs.stored += stored;
        sh->rs.failed += failed;
        sh->rq_busy = 0;
        pthread_cond_broadcast(&sh->rcv);
    }
    pthread_mutex_unlock(&sh->mu);
    return NULL;
}

void
tqkv_client_repair_stats(tqkv_client_t *c, tqkv_client_repair_stats_t *out)
{
    memset(out, 0, sizeof *out);
    if (c == NULL)
        return;
    pthread_mutex_lock(&c->sh->mu);
    *out = c->sh->rs;
    out->pending_bytes = c->sh->rq_bytes;
    pthread_mutex_unlock(&c->sh->mu);
}

int
tqkv_client_repair_wait(tqkv_client_t *c, uint32_t timeout_ms)
{
    if (c == NULL)
        return -1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)(timeout_ms % 1000) * 1000000ull;
    ts.tv_sec += (time_t)(timeout_ms / 1000 + ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    client_shared_t *sh = c->sh;
    int rc = 0;
    pthread_mutex_lock(&sh->mu);
    while ((sh->rq_head || sh->rq_busy) && rc == 0)
        rc = pthread_cond_timedwait(&sh->rcv, &sh->mu, &ts);
    int idle = sh->rq_head == NULL && !sh->rq_busy;
    pthread_mutex_unlock(&sh->mu);
    return idle ? 0 : -1;
}

/* A view of client c: a copy whose t/nt/tab are the current table (referenced). */
tqkv_client_t *
tqkv__view_enter(const tqkv_client_t *c, tqkv_client_t *v)
{
    *v = *c;
    v->tab = tqkv_membership_acquire(c->ms);
    v->t = (target_t **)v->tab->users;
    v->nt = v->tab->n;
    v->replicas = c->replicas_opt < v->nt ? c->replicas_opt : (uint32_t)v->nt;
    return v;
}

void
tqkv__view_leave(tqkv_client_t *v)
{
    tqkv_membership_release(v->tab);
}

size_t
tqkv__view_find(const tqkv_client_t *c, const target_t *t)
{
    for (size_t i = 0; i < c->nt; i++)
        if (c->t[i] == t)
            return i;
    return c->nt;
}

tqkv_status_t
tqkv_client_create(const tqkv_client_opts_t *o, tqkv_client_t **out)
{
    tqkv_status_t st = TQKV_OK;
    grpc_channel_credentials *creds = NULL;
    char *ca = NULL, *cert = NULL, *key = NULL;

    if (out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "client_create: out is NULL");
    *out = NULL;
    if (o == NULL || o->num_targets == 0 || o->targets == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "no target");
    tqkv_client_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    grpc_init();
    if ((c->sh = calloc(1, sizeof *c->sh)) == NULL) {
        free(c);
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    }
    pthread_mutex_init(&c->sh->mu, NULL);
    pthread_cond_init(&c->sh->rcv, NULL);
    c->sh->root = c;
    c->sh->rq_max = o->no_read_repair      ? 0
                    : o->read_repair_bytes ? o->read_repair_bytes
                                           : TQKV_CLIENT_DEFAULT_REPAIR_BYTES;
    c->replicas_opt = o->replicas ? o->replicas : 1;
    if (c->replicas_opt > RANK_MAX - 1)
        c->replicas_opt = RANK_MAX - 1;
    c->deadline_ms = o->deadline_ms ? o->deadline_ms : TQKV_CLIENT_DEFAULT_DEADLINE_MS;
    c->backoff_min = o->backoff_min_ms ? o->backoff_min_ms : 200;
    c->backoff_max = o->backoff_max_ms ? o->backoff_max_ms : 5000;
    if (c->backoff_max < c->backoff_min)
        c->backoff_max = c->backoff_min;
    c->wait_for_ready = o->wait_for_ready;

    for (size_t i = 0; i < o->num_targets; i++) {
        if (o->targets[i] == NULL || o->targets[i][0] == '\0') {
            st = tqkv__client_err(TQKV_EINVAL, 0, "empty target");
            goto fail;
        }
        /* A target named twice would rank twice: R replicas of a block could land on
         * one server, and losing it would lose every copy. (Two spellings of one server
         * are merged by its node id.) */
        for (size_t j = 0; j < i; j++)
            if (strcmp(o->targets[i], o->targets[j]) == 0) {
                st =
                    tqkv__client_err(TQKV_EINVAL, 0,
                                     "duplicate target %s (each server once: replicas must land on "
                                     "different servers)",
                                     o->targets[i]);
                goto fail;
            }
    }

    c->tls = o->tls || o->tls_ca_path || o->tls_cert_path;
    if (c->tls) {
        if (o->tls_ca_path && (ca = read_file(o->tls_ca_path)) == NULL) {
            st = tqkv__client_err(TQKV_EINVAL, 0, "cannot read TLS CA %s: %s", o->tls_ca_path,
                                  strerror(errno));
            goto fail;
        }
        if ((o->tls_cert_path == NULL) != (o->tls_key_path == NULL)) {
            st = tqkv__client_err(TQKV_EINVAL, 0, "TLS client cert and key go together");
            goto fail;
        }
        if (o->tls_cert_path) {
            cert = read_file(o->tls_cert_path);
            key = read_file(o->tls_key_path);
            if (cert == NULL || key == NULL) {
                st = tqkv__client_err(TQKV_EINVAL, 0, "cannot read TLS client cert/key");
                goto fail;
            }
        }
        grpc_ssl_pem_key_cert_pair kp = {key, cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &kp : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (creds == NULL) {
        st = tqkv__client_err(TQKV_EINVAL, 0, "cannot create channel credentials");
        goto fail;
    }

    size_t maxmsg = o->max_message_bytes ? o->max_message_bytes : TQKV_CLIENT_DEFAULT_MAX_MESSAGE;
    c->max_msg = maxmsg;
    if (o->transport != TQKV_CLIENT_TRANSPORT_GRPC && o->transport != TQKV_CLIENT_TRANSPORT_TCP) {
        st = tqkv__client_err(TQKV_EINVAL, 0,
                              "transport %d: expected TQKV_CLIENT_TRANSPORT_GRPC or _TCP",
                              o->transport);
        goto fail;
    }
    c->transport = o->transport;
    int maxmsg_i = maxmsg > 0x7fffffff ? 0x7fffffff : (int)maxmsg;
    grpc_arg *args = c->args;
    size_t na = 0;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[na++].value.integer = maxmsg_i;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[na++].value.integer = maxmsg_i;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[na++].value.integer = 1;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_HTTP2_MAX_FRAME_SIZE;
    args[na++].value.integer = (1 << 24) - 1;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_TCP_READ_CHUNK_SIZE;
    args[na++].value.integer = 1 << 20;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
    args[na++].value.integer = 100;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS; /* gRPC uses it as the connect timeout */
    args[na++].value.integer = 5000;
    args[na].type = GRPC_ARG_INTEGER;
    args[na].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
    args[na++].value.integer = 1000;
    if (o->tls_target_name) {
        args[na].type = GRPC_ARG_STRING;
        args[na].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        c->tls_name = strdup(o->tls_target_name);
        if (c->tls_name == NULL) {
            st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        args[na++].value.string = c->tls_name;
    }
    na += tqkv__health_channel_args(o, &args[na], sizeof c->args / sizeof c->args[0] - na);
    c->cargs.num_args = na;
    c->cargs.args = args;
    c->nch = o->channels_per_target ? o->channels_per_target : 1;
    c->creds = creds;
    creds = NULL;
    if (c->transport == TQKV_CLIENT_TRANSPORT_TCP &&
        (o->tls || o->tls_ca_path || o->tls_cert_path)) {
        /* Data channels of a TLS client are TLS with the same roots and certificate. */
        char why[320];
        c->dc_tls = tqkv__dctls_client_ctx(o->tls_ca_path, o->tls_cert_path, o->tls_key_path, why,
                                           sizeof why);
        if (c->dc_tls == NULL) {
            st = tqkv__client_err(TQKV_EINVAL, 0, "data channels: %s", why);
            goto fail;
        }
    }

    if (o->token && o->token[0]) {
        size_t tl = strlen(o->token);
        char *v = malloc(tl + 8);
        if (v == NULL) {
            st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        memcpy(v, "Bearer ", 7);
        memcpy(v + 7, o->token, tl + 1);
        c->auth_md.key = grpc_slice_from_static_string("authorization");
        c->auth_md.value = grpc_slice_from_copied_string(v);
        c->has_auth = 1;
        free(v);
        c->md[0] = c->auth_md;
    }
    c->hop = o->hop;
    c->md[1].key = grpc_slice_from_static_string("tqkv-hop");
    c->md[1].value = grpc_slice_from_static_string("1");
    /* The servers: resolved, identified (node ids) and followed by the membership. */
    c->identify_ms = c->deadline_ms < 3000 ? c->deadline_ms : 3000;
    {
        tqkv_membership_opts_t mo = {.targets = o->targets,
                                     .num_targets = o->num_targets,
                                     .resolve = o->resolve_targets,
                                     .dns_servers = o->dns_servers,
                                     .interval_ms = o->resolve_interval_ms,
                                     .min_kick_ms = c->backoff_min,
                                     .arg = c,
                                     .attach = target_attach,
                                     .detach = target_detach,
                                     .identify = target_identify,
                                     .exclude_node_id = o->exclude_node_id};
        char merr[256];
        if ((st = tqkv_membership_create(&mo, &c->ms, merr, sizeof merr)) != TQKV_OK) {
            tqkv__client_err(st, 0, "%s", merr);
            goto fail;
        }
    }
    if ((st = tqkv__health_start(c, o, &c->sh->health)) != TQKV_OK) {
        tqkv__client_err(st, 0, "cannot start the health prober");
        goto fail;
    }
    if (c->sh->rq_max > 0) {
        if (pthread_create(&c->sh->rq_thread, NULL, repair_main, c->sh) != 0) {
            st = tqkv__client_err(TQKV_ENOMEM, 0, "cannot start the read repair thread");
            goto fail;
        }
        c->sh->rq_started = 1;
    }
    free(ca);
    free(cert);
    free(key);
    *out = c;
    return TQKV_OK;

fail:
    if (creds)
        grpc_channel_credentials_release(creds);
    free(ca);
    free(cert);
    free(key);
    tqkv_client_destroy(c);
    return st;
}

void
tqkv_client_destroy(tqkv_client_t *c)
{
    if (c == NULL)
        return;
    if (c->sh && c->sh->rq_started) {
        pthread_mutex_lock(&c->sh->mu);
        c->sh->rq_stop = 1;
        pthread_cond_broadcast(&c->sh->rcv);
        pthread_mutex_unlock(&c->sh->mu);
        pthread_join(c->sh->rq_thread, NULL);
    }
    if (c->sh)
        for (repair_t *r = c->sh->rq_head, *nx; r; r = nx) {
            nx = r->next;
            free(r->ns);
            free(r);
        }
    if (c->sh)
        tqkv__health_stop(c->sh->health);
    tqkv_membership_destroy(c->ms); /* detaches (retires) every target */
    if (c->sh) {
        for (target_t *t = c->sh->retired, *nx; t; t = nx) {
            nx = t->retired_next;
            target_free(t);
        }
        pthread_mutex_destroy(&c->sh->mu);
        pthread_cond_destroy(&c->sh->rcv);
        free(c->sh);
    }
    SSL_CTX_free(c->dc_tls);
    if (c->has_auth)
        grpc_slice_unref(c->auth_md.value);
    if (c->creds)
        grpc_channel_credentials_release(c->creds);
    free(c->tls_name);
    free(c);
    grpc_shutdown();
}

size_t
tqkv_client_num_targets(const tqkv_client_t *c)
{
    if (c == NULL)
        return 0;
    tqkv_client_t v;
    size_t n = tqkv__view_enter(c, &v)->nt;
    tqkv__view_leave(&v);
    return n;
}

const char *
tqkv_client_target_name(const tqkv_client_t *c, size_t i)
{
    if (c == NULL)
        return NULL;
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    const char *name = i < v.nt ? v.t[i]->name : NULL; /* kept until the client goes */
    tqkv__view_leave(&v);
    return name;
}

int
tqkv_client_target_node_id(const tqkv_client_t *c, size_t i, char *buf, size_t cap)
{
    if (c == NULL || buf == NULL || cap == 0)
        return -1;
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    int rc = -1;
    if (i < v.nt) {
        const char *id = v.tab->s[i].node_id;
        snprintf(buf, cap, "%s", id ? id : "");
        rc = id ? 0 : 1;
    }
    tqkv__view_leave(&v);
    return rc;
}

uint64_t
tqkv_client_target_rank_id(const tqkv_client_t *c, size_t i)
{
    if (c == NULL)
        return 0;
    tqkv_client_t v;
    tqkv__view_enter(c, &v);
    uint64_t id = i < v.nt ? v.tab->s[i].rank_id : 0;
    tqkv__view_leave(&v);
    return id;
}

uint64_t
tqkv_client_refresh(tqkv_client_t *c)
{
    return c ? tqkv_membership_refresh(c->ms) : 0;
}

uint32_t
tqkv__client_replicas(const tqkv_client_t *c)
{
    if (c == NULL)
        return 0;
    tqkv_client_t v; /* as asked, clamped to the targets of the current table */
    uint32_t r = tqkv__view_enter(c, &v)->replicas;
    tqkv__view_leave(&v);
    return r;
}

/* Candidate targets of a block, best first: cand[0..nc), nc <= RANK_MAX (the best
 * RANK_MAX of any number of targets). Ranked by the servers' node ids. */
size_t
tqkv__candidates(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t *cand)
{
    if (c->nt == 1) {
        cand[0] = 0;
        return 1;
    }
    uint64_t key = tqkv_shard_block_key(ns, h->bytes, h->len);
    size_t k = c->nt < RANK_MAX ? c->nt : RANK_MAX;
    return tqkv_shard_top_index(c->tab->rank_index, &c->tab->s[0].rank_id, sizeof c->tab->s[0],
                                c->nt, key, k, cand);
}

/* How many rank positions Get and Lookup ask: the R replicas plus one more, where a
 * Put lands while one of the R was down. */
size_t
tqkv__read_candidates(tqkv_client_t *c)
{
    size_t n = (size_t)c->replicas + 1;
    return n < c->nt ? n : c->nt;
}

int
tqkv__hash_ok(const tqkv_hash_t *h)
{
    return h && h->len >= 8 && h->len <= TQKV_HASH_MAX;
}

tqkv_status_t
tqkv_client_decode_page(const void *page, size_t len, uint16_t *k, uint16_t *v,
                        tqkv_block_shape_t *shape)
{
    tqkv_page_info_t info;
    char err[160];
    tqkv_status_t st = tqkv_page_validate(page, len, 1, &info, err, sizeof err);
    if (st != TQKV_OK)
        return tqkv__client_err(st, 0, "decode: %s", err);
    if (shape)
        *shape = info.shape;
    if (k == NULL && v == NULL)
        return TQKV_OK;
    st = tqkv_page_decode_bf16(page, info.page_bytes, k, v);
    if (st != TQKV_OK)
        return tqkv__client_err(st, 0, "decode: %s", tqkv_strerror(st));
    return TQKV_OK;
}
