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
 * This file: create/destroy and the targets; the other concerns are in the
 * client_*.c files listed in transport/client_internal.h.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
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
    int rc = tqkv__node_id_query(t->ch[0], c->n_id_md ? c->id_md : NULL, c->n_id_md, c->identify_ms,
                                 node_id, cap, why, sizeof why);
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

/* Every target named, none twice. */
static tqkv_status_t
check_targets(const tqkv_client_opts_t *o)
{
    for (size_t i = 0; i < o->num_targets; i++) {
        if (o->targets[i] == NULL || o->targets[i][0] == '\0')
            return tqkv__client_err(TQKV_EINVAL, 0, "empty target");
        /* A target named twice would rank twice: R replicas of a block could land on
         * one server, and losing it would lose every copy. (Two spellings of one server
         * are merged by its node id.) */
        for (size_t j = 0; j < i; j++)
            if (strcmp(o->targets[i], o->targets[j]) == 0)
                return tqkv__client_err(TQKV_EINVAL, 0,
                                        "duplicate target %s (each server once: replicas must "
                                        "land on different servers)",
                                        o->targets[i]);
    }
    return TQKV_OK;
}

/* The channel credentials of the options (TLS files read here) into c->creds. */
static tqkv_status_t
make_credentials(tqkv_client_t *c, const tqkv_client_opts_t *o)
{
    tqkv_status_t st = TQKV_OK;
    grpc_channel_credentials *creds = NULL;
    char *ca = NULL, *cert = NULL, *key = NULL;
    c->tls = o->tls || o->tls_ca_path || o->tls_cert_path;
    if (c->tls) {
        if (o->tls_ca_path && (ca = read_file(o->tls_ca_path)) == NULL) {
            st = tqkv__client_err(TQKV_EINVAL, 0, "cannot read TLS CA %s: %s", o->tls_ca_path,
                                  strerror(errno));
            goto out;
        }
        if ((o->tls_cert_path == NULL) != (o->tls_key_path == NULL)) {
            st = tqkv__client_err(TQKV_EINVAL, 0, "TLS client cert and key go together");
            goto out;
        }
        if (o->tls_cert_path) {
            cert = read_file(o->tls_cert_path);
            key = read_file(o->tls_key_path);
            if (cert == NULL || key == NULL) {
                st = tqkv__client_err(TQKV_EINVAL, 0, "cannot read TLS client cert/key");
                goto out;
            }
        }
        grpc_ssl_pem_key_cert_pair kp = {key, cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &kp : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (creds == NULL)
        st = tqkv__client_err(TQKV_EINVAL, 0, "cannot create channel credentials");
    c->creds = creds;
out:
    free(ca);
    free(cert);
    free(key);
    return st;
}

static void
arg_int(grpc_arg *a, char *key, int value)
{
    a->type = GRPC_ARG_INTEGER;
    a->key = key;
    a->value.integer = value;
}

/* The gRPC channel arguments every target's channels get (c->cargs). */
static tqkv_status_t
set_channel_args(tqkv_client_t *c, const tqkv_client_opts_t *o)
{
    size_t maxmsg = o->max_message_bytes ? o->max_message_bytes : TQKV_CLIENT_DEFAULT_MAX_MESSAGE;
    c->max_msg = maxmsg;
    int maxmsg_i = maxmsg > 0x7fffffff ? 0x7fffffff : (int)maxmsg;
    grpc_arg *args = c->args;
    size_t na = 0;
    arg_int(&args[na++], GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, maxmsg_i);
    arg_int(&args[na++], GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, maxmsg_i);
    arg_int(&args[na++], GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    arg_int(&args[na++], GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
    arg_int(&args[na++], GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
    arg_int(&args[na++], GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    /* gRPC uses the min reconnect backoff as the connect timeout */
    arg_int(&args[na++], GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, (int)tqkv__health_connect_ms(o));
    arg_int(&args[na++], GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    if (o->tls_target_name) {
        args[na].type = GRPC_ARG_STRING;
        args[na].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        c->tls_name = strdup(o->tls_target_name);
        if (c->tls_name == NULL)
            return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        args[na++].value.string = c->tls_name;
    }
    na += tqkv__health_channel_args(o, &args[na], sizeof c->args / sizeof c->args[0] - na);
    c->cargs.num_args = na;
    c->cargs.args = args;
    return TQKV_OK;
}

/* The metadata calls carry: the bearer token, and "tqkv-hop": "2" for a server's
 * peers' client (hop 2), "1" otherwise (sent with several targets: client_call.c). */
static tqkv_status_t
set_call_metadata(tqkv_client_t *c, const tqkv_client_opts_t *o, const char *hello)
{
    if (o->token && o->token[0]) {
        size_t tl = strlen(o->token);
        char *v = malloc(tl + 8);
        if (v == NULL)
            return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
        memcpy(v, "Bearer ", 7);
        memcpy(v + 7, o->token, tl + 1);
        c->auth_md.key = grpc_slice_from_static_string("authorization");
        c->auth_md.value = grpc_slice_from_copied_string(v);
        c->has_auth = 1;
        free(v);
        c->md[0] = c->auth_md;
    }
    c->md[1].key = grpc_slice_from_static_string("tqkv-hop");
    c->md[1].value = grpc_slice_from_static_string(c->hop == 2 ? "2" : "1");
    if (c->has_auth)
        c->id_md[c->n_id_md++] = c->auth_md;
    if (hello && hello[0]) {
        c->id_md[c->n_id_md].key = grpc_slice_from_static_string("tqkv-peer-hello");
        c->id_md[c->n_id_md++].value = grpc_slice_from_copied_string(hello);
    }
    return TQKV_OK;
}

/* The servers: resolved, identified (node ids) and followed by the membership. */
static tqkv_status_t
start_membership(tqkv_client_t *c, const tqkv_client_opts_t *o, const char *exclude_node_id)
{
    c->identify_ms = c->deadline_ms < 3000 ? c->deadline_ms : 3000;
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
                                 .exclude_node_id = exclude_node_id};
    char merr[256];
    tqkv_status_t st = tqkv_membership_create(&mo, &c->ms, merr, sizeof merr);
    if (st != TQKV_OK)
        tqkv__client_err(st, 0, "%s", merr);
    return st;
}

/* The 1.0 options: what struct_size 0 stands for, and the least a caller may pass.
 * Fixed for good: later fields go after no_read_repair (client.h, growth rule). */
#define OPTS_SIZE_1_0 (offsetof(tqkv_client_opts_t, no_read_repair) + sizeof(int))

/* The caller's options (struct_size bytes of them) into *o, fields it does not know
 * zero. Returns TQKV_EINVAL for a struct_size below the 1.0 layout, TQKV_EUNSUPPORTED
 * for non-zero fields this library does not know. */
static tqkv_status_t
read_opts(const tqkv_client_opts_t *in, tqkv_client_opts_t *o)
{
    size_t n = in->struct_size ? in->struct_size : OPTS_SIZE_1_0;
    if (n > 4096) /* not a size: options that did not start from TQKV_CLIENT_OPTS_INIT */
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "client_create: opts struct_size %zu is not a struct size: start "
                                "from TQKV_CLIENT_OPTS_INIT",
                                n);
    if (n < OPTS_SIZE_1_0)
        return tqkv__client_err(TQKV_EINVAL, 0,
                                "client_create: opts struct_size %zu is below the 1.0 options "
                                "(%zu): start from TQKV_CLIENT_OPTS_INIT",
                                n, (size_t)OPTS_SIZE_1_0);
    for (size_t i = sizeof *o; i < n; i++)
        if (((const unsigned char *)in)[i] != 0)
            return tqkv__client_err(TQKV_EUNSUPPORTED, 0,
                                    "client_create: opts byte %zu of %zu set, but libtqkv %s "
                                    "knows %zu bytes of options (a newer header's field)",
                                    i, n, tqkv_version(), sizeof *o);
    memset(o, 0, sizeof *o);
    memcpy(o, in, n < sizeof *o ? n : sizeof *o);
    o->struct_size = sizeof *o;
    return TQKV_OK;
}

tqkv_status_t
tqkv_client_create(const tqkv_client_opts_t *o, tqkv_client_t **out)
{
    return tqkv_client_create_peer(o, NULL, out);
}

tqkv_status_t
tqkv_client_create_peer(const tqkv_client_opts_t *in, const tqkv_client_peer_opts_t *peer,
                        tqkv_client_t **out)
{
    tqkv_status_t st = TQKV_OK;
    tqkv_client_opts_t opts, *o = &opts;

    if (out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "client_create: out is NULL");
    *out = NULL;
    if (in == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "no target");
    if ((st = read_opts(in, o)) != TQKV_OK)
        return st;
    if (o->num_targets == 0 || o->targets == NULL)
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

    if ((st = check_targets(o)) != TQKV_OK || (st = make_credentials(c, o)) != TQKV_OK)
        goto fail;
    if (o->transport != TQKV_CLIENT_TRANSPORT_GRPC && o->transport != TQKV_CLIENT_TRANSPORT_TCP) {
        st = tqkv__client_err(TQKV_EINVAL, 0,
                              "transport %d: expected TQKV_CLIENT_TRANSPORT_GRPC (0) or _TCP (2)",
                              o->transport);
        goto fail;
    }
    c->transport = o->transport;
    if ((st = set_channel_args(c, o)) != TQKV_OK)
        goto fail;
    c->nch = o->channels_per_target ? o->channels_per_target : 1;
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
    c->hop = peer ? peer->hop : 0;
    if ((st = set_call_metadata(c, o, peer ? peer->hello_node_id : NULL)) != TQKV_OK ||
        (st = start_membership(c, o, peer ? peer->exclude_node_id : NULL)) != TQKV_OK ||
        (st = tqkv__repair_start(c)) != TQKV_OK)
        goto fail;
    if ((st = tqkv__health_start(c, o, &c->sh->health)) != TQKV_OK) {
        tqkv__client_err(st, 0, "cannot start the health prober");
        goto fail;
    }
    *out = c;
    return TQKV_OK;

fail:
    tqkv_client_destroy(c);
    return st;
}

void
tqkv_client_destroy(tqkv_client_t *c)
{
    if (c == NULL)
        return;
    if (c->sh)
        tqkv__repair_stop(c->sh);
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
    if (c->n_id_md > (size_t)c->has_auth) /* the hello, last */
        grpc_slice_unref(c->id_md[c->n_id_md - 1].value);
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
