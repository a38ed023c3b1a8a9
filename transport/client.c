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

static int
add_target(tqkv_client_t *c, size_t *cap, const char *name)
{
    if (c->nt == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        target_t *nt = realloc(c->t, nc * sizeof *nt);
        if (nt == NULL)
            return -1;
        c->t = nt;
        *cap = nc;
    }
    target_t *t = &c->t[c->nt];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (t->name == NULL)
        return -1;
    t->id = tqkv_shard_target_id(name);
    tqkv_shard_health_init(&t->health);
    pthread_rwlock_init(&t->lock, NULL);
    pthread_mutex_init(&t->dc_mu, NULL);
    atomic_init(&t->renewed_ns, 0);
    c->nt++;
    return 0;
}

/* Adds name, expanded to one target per address when it is "host:port" with a DNS
 * host that resolves to several addresses. */
static int
add_resolved(tqkv_client_t *c, size_t *cap, const char *name)
{
    const char *colon = strrchr(name, ':');
    if (strstr(name, "://") || strchr(name, '[') || colon == NULL || colon == name)
        return add_target(c, cap, name);
    char host[256];
    size_t hl = (size_t)(colon - name);
    if (hl >= sizeof host)
        return add_target(c, cap, name);
    memcpy(host, name, hl);
    host[hl] = '\0';
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0 || res == NULL)
        return add_target(c, cap, name);
    size_t before = c->nt;
    char seen[64][96];
    size_t nseen = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        char ip[64], t[96];
        if (a->ai_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
            snprintf(t, sizeof t, "ipv4:%s:%s", ip, colon + 1);
        } else if (a->ai_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
            snprintf(t, sizeof t, "ipv6:[%s]:%s", ip, colon + 1);
        } else {
            continue;
        }
        int dup = 0;
        for (size_t i = 0; i < nseen; i++)
            dup |= strcmp(seen[i], t) == 0;
        if (dup || nseen == 64)
            continue;
        snprintf(seen[nseen++], sizeof seen[0], "%s", t);
    }
    freeaddrinfo(res);
    if (nseen <= 1)
        return add_target(c, cap, name);
    for (size_t i = 0; i < nseen; i++)
        if (add_target(c, cap, seen[i]) != 0)
            return -1;
    return c->nt > before ? 0 : -1;
}

tqkv_status_t
tqkv_client_create(const tqkv_client_opts_t *o, tqkv_client_t **out)
{
    tqkv_status_t st = TQKV_OK;
    grpc_channel_credentials *creds = NULL;
    char *ca = NULL, *cert = NULL, *key = NULL;
    size_t cap = 0;

    if (out == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "client_create: out is NULL");
    *out = NULL;
    if (o == NULL || o->num_targets == 0 || o->targets == NULL)
        return tqkv__client_err(TQKV_EINVAL, 0, "no target");
    tqkv_client_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
    grpc_init();
    c->replicas = o->replicas ? o->replicas : 1;
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
        if ((o->resolve_targets ? add_resolved(c, &cap, o->targets[i])
                                : add_target(c, &cap, o->targets[i])) != 0) {
            st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
    }
    if (c->nt > TQKV_CLIENT_MAX_TARGETS) {
        st = tqkv__client_err(TQKV_EINVAL, 0, "%zu targets: at most %u", c->nt,
                              TQKV_CLIENT_MAX_TARGETS);
        goto fail;
    }
    /* A target named twice would rank twice: R replicas of a block could land on one
     * server, and losing it would lose every copy. */
    for (size_t i = 0; i < c->nt; i++)
        for (size_t j = 0; j < i; j++)
            if (strcmp(c->t[i].name, c->t[j].name) == 0) {
                st =
                    tqkv__client_err(TQKV_EINVAL, 0,
                                     "duplicate target %s (each server once: replicas must land on "
                                     "different servers)",
                                     c->t[i].name);
                goto fail;
            }
    if (c->replicas > c->nt)
        c->replicas = (uint32_t)c->nt;

    if (o->tls || o->tls_ca_path || o->tls_cert_path) {
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
    c->cargs.num_args = na;
    c->cargs.args = args;
    uint32_t nch = o->channels_per_target ? o->channels_per_target : 1;
    for (size_t i = 0; i < c->nt; i++) {
        target_t *t = &c->t[i];
        t->ch = calloc(nch, sizeof *t->ch);
        if (t->ch == NULL) {
            st = tqkv__client_err(TQKV_ENOMEM, 0, "out of memory");
            goto fail;
        }
        for (uint32_t k = 0; k < nch; k++) {
            t->ch[k] = grpc_channel_create(t->name, creds, &c->cargs);
            if (t->ch[k] == NULL) {
                st = tqkv__client_err(TQKV_EINVAL, 0, "cannot create a channel to %s", t->name);
                goto fail;
            }
            t->nch++;
        }
    }
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
    for (size_t i = 0; i < c->nt; i++) {
        for (uint32_t k = 0; k < c->t[i].nch; k++)
            grpc_channel_destroy(c->t[i].ch[k]);
        free(c->t[i].ch);
        free(c->t[i].name);
        pthread_rwlock_destroy(&c->t[i].lock);
        for (dconn_t *d = c->t[i].dc_idle, *nx; d; d = nx) {
            nx = d->next;
            SSL_free(d->ssl);
            close(d->fd); /* the server drops a channel whose connection closes */
            free(d);
        }
        pthread_mutex_destroy(&c->t[i].dc_mu);
    }
    free(c->t);
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
    return c ? c->nt : 0;
}

const char *
tqkv_client_target_name(const tqkv_client_t *c, size_t i)
{
    return c && i < c->nt ? c->t[i].name : NULL;
}

uint32_t
tqkv__client_replicas(const tqkv_client_t *c)
{
    return c ? c->replicas : 0;
}

/* Candidate targets of a block, best first: cand[0..nc). */
size_t
tqkv__candidates(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t *cand)
{
    if (c->nt == 1) {
        cand[0] = 0;
        return 1;
    }
    uint64_t ids[64];
    size_t n = c->nt < 64 ? c->nt : 64;
    for (size_t i = 0; i < n; i++)
        ids[i] = c->t[i].id;
    tqkv_shard_rank(ids, n, tqkv_shard_block_key(ns, h->bytes, h->len), cand);
    return n;
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
