/* handlers_channel.c - which transport serves a call: the Get dispatch and the
 * OpenChannel/CloseChannel handlers (TCP data channels and NCCL).
 *
 * Get is registered with tqkv__get_dispatch_handler: a Get whose request asks for
 * TRANSPORT_NCCL switches the call to TQKV__M_GET_NCCL (tqkv__get_nccl_handler,
 * handlers_nccl.c), one asking for TRANSPORT_TCP to TQKV__M_GET_TCP
 * (service/dc_server.c); every other Get runs tqkv__get_handler unchanged.
 * OpenChannel/CloseChannel with transport TCP are answered by dc_server.c, with
 * transport NCCL by the NCCL channels (FAILED_PRECONDITION without NCCL).
 */
#include <grpc/slice.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/page.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/wire.h"

#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif

#define NERR 320
#define OPEN_TIMEOUT_MAX_MS 120000u /* cap on the client's communicator set-up timeout */

/* Reads the unary/server-streaming request into a new buffer; NULL when missing. */
static uint8_t *
request_bytes(tqkv__call_t *c, size_t *len)
{
    *len = 0;
    return c->recv_bb ? tqkv__bb_read(c->recv_bb, len) : NULL;
}

/* ---- Get dispatch ---- */

/* The request's transport (TRANSPORT_GRPC when it does not parse: tqkv__get_handler
 * reports that). */
static int
get_transport(tqkv__call_t *c)
{
    size_t len;
    uint8_t *buf = request_bytes(c, &len);
    if (buf == NULL)
        return TQKV__V1__TRANSPORT__TRANSPORT_GRPC;
    Tqkv__V1__GetRequest *r = tqkv__v1__get_request__unpack(NULL, len, buf);
    free(buf);
    if (r == NULL)
        return TQKV__V1__TRANSPORT__TRANSPORT_GRPC;
    int t = (int)r->transport;
    tqkv__v1__get_request__free_unpacked(r, NULL);
    return t;
}

static void
dispatch_start(tqkv__call_t *c)
{
    int t = get_transport(c);
    if (t == TQKV__V1__TRANSPORT__TRANSPORT_NCCL) {
        c->method = TQKV__M_GET_NCCL; /* every later event goes to tqkv__get_nccl_handler */
        tqkv__get_nccl_handler.on_start(c);
        return;
    }
    if (t == TQKV__V1__TRANSPORT__TRANSPORT_TCP) {
        c->method = TQKV__M_GET_TCP; /* dc_server.c */
        tqkv__get_tcp_handler.on_start(c);
        return;
    }
    tqkv__get_handler.on_start(c);
}

static void
dispatch_send(tqkv__call_t *c, int ok)
{
    tqkv__get_handler.on_send(c, ok);
}

static void
dispatch_wake(tqkv__call_t *c)
{
    tqkv__get_handler.on_wake(c);
}

static void
dispatch_free(tqkv__call_t *c)
{
    tqkv__get_handler.on_free(c);
}

const tqkv__handler_t tqkv__get_dispatch_handler = {
    .path = "/tqkv.v1.KVCache/Get",
    .metric = "Get",
    .payload_on_new = 1,
    .drain = 1,
    .on_start = dispatch_start,
    .on_send = dispatch_send,
    .on_wake = dispatch_wake,
    .on_free = dispatch_free,
};

/* ---- OpenChannel / CloseChannel ---- */

/* With auth on, a channel needs a token the server knows (for any namespace; each Get
 * on it is then checked for its own namespace). */
static int
channel_auth(tqkv__call_t *c)
{
    if (c->auth == NULL)
        return 1;
    tqkv_status_t st = tqkv_auth_check(c->auth, c->authz, c->authz_len, "", 0, TQKV_AUTH_READ);
    if (st == TQKV_OK || st == TQKV_EPERM)
        return 1;
    tqkv__call_finish(c, GRPC_STATUS_UNAUTHENTICATED,
                      "authorization: missing, malformed or unknown bearer token", NULL);
    return 0;
}

static void
open_start(tqkv__call_t *c)
{
    size_t len;
    uint8_t *buf = request_bytes(c, &len);
    Tqkv__V1__OpenChannelRequest *r =
        buf ? tqkv__v1__open_channel_request__unpack(NULL, len, buf) : NULL;
    free(buf);
    if (r == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT, "message: missing or malformed request",
                          NULL);
        return;
    }
    if (!channel_auth(c)) {
        tqkv__v1__open_channel_request__free_unpacked(r, NULL);
        return;
    }
    if (r->transport == TQKV__V1__TRANSPORT__TRANSPORT_TCP) {
        tqkv__v1__open_channel_request__free_unpacked(r, NULL);
        tqkv__dc_open(c);
        return;
    }
#ifdef TQKV_HAVE_NCCL
    char err[NERR];
    uint8_t uid[TQKV_NCCL_UID_BYTES];
    uint64_t id = 0;
    int dev = tqkv__nccl_device();
    if (dev < 0) {
        tqkv__v1__open_channel_request__free_unpacked(r, NULL);
        tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, TQKV__NO_NCCL, NULL);
        return;
    }
    uint32_t tmo = r->timeout_ms > OPEN_TIMEOUT_MAX_MS ? OPEN_TIMEOUT_MAX_MS : r->timeout_ms;
    tqkv_status_t st = tqkv_nccl_chan_open(dev, tmo, 0, &id, uid, err, sizeof err);
    tqkv__v1__open_channel_request__free_unpacked(r, NULL);
    if (st != TQKV_OK) {
        tqkv__call_finish(c, GRPC_STATUS_UNAVAILABLE, err, NULL);
        return;
    }
    Tqkv__V1__OpenChannelResponse m = TQKV__V1__OPEN_CHANNEL_RESPONSE__INIT;
    m.channel_id = id;
    m.nccl_unique_id.data = uid;
    m.nccl_unique_id.len = sizeof uid;
    m.rank = 1;
    tqkv__call_finish_msg(c, &m.base);
#else
    tqkv__v1__open_channel_request__free_unpacked(r, NULL);
    tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, TQKV__NO_NCCL, NULL);
#endif
}

static void
close_start(tqkv__call_t *c)
{
    size_t len;
    uint8_t *buf = request_bytes(c, &len);
    Tqkv__V1__CloseChannelRequest *r =
        buf ? tqkv__v1__close_channel_request__unpack(NULL, len, buf) : NULL;
    free(buf);
    if (r == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT, "message: missing or malformed request",
                          NULL);
        return;
    }
    uint64_t id = r->channel_id;
    tqkv__v1__close_channel_request__free_unpacked(r, NULL);
    if (!channel_auth(c))
        return;
    if (tqkv__dc_close(c, id))
        return;
#ifndef TQKV_HAVE_NCCL
    if (c->srv->dc) {
        char err[NERR];
        snprintf(err, sizeof err, "channel_id %llu: no such open channel", (unsigned long long)id);
        tqkv__call_finish(c, GRPC_STATUS_NOT_FOUND, err, NULL);
        return;
    }
#endif
#ifdef TQKV_HAVE_NCCL
    if (tqkv_nccl_chan_close(id) != TQKV_OK) {
        char err[NERR];
        snprintf(err, sizeof err, "channel_id %llu: no such open NCCL channel",
                 (unsigned long long)id);
        tqkv__call_finish(c, GRPC_STATUS_NOT_FOUND, err, NULL);
        return;
    }
    Tqkv__V1__CloseChannelResponse m = TQKV__V1__CLOSE_CHANNEL_RESPONSE__INIT;
    tqkv__call_finish_msg(c, &m.base);
#else
    (void)id;
    tqkv__call_finish(c, GRPC_STATUS_FAILED_PRECONDITION, TQKV__NO_NCCL, NULL);
#endif
}

const tqkv__handler_t tqkv__open_channel_handler = {
    .path = "/tqkv.v1.KVCache/OpenChannel",
    .metric = "OpenChannel",
    .payload_on_new = 1,
    .on_start = open_start,
};

const tqkv__handler_t tqkv__close_channel_handler = {
    .path = "/tqkv.v1.KVCache/CloseChannel",
    .metric = "CloseChannel",
    .payload_on_new = 1,
    .on_start = close_start,
};
