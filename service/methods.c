/* methods.c - the method table: the handler of every method the server serves and the
 * paths it registers. server.c reaches handlers only through it, and the handlers (which
 * use call.c) never name server.c, so the dependencies run one way: server.c -> methods.c
 * -> handlers -> call.c.
 */
#include "service/server.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/version.h"
#include "grpc/health/v1/health.pb-c.h"

#include "service/forward.h"
#include "service/log.h"
#include "service/gpu_encode.h"
#include "service/service_internal.h"
#ifdef TQKV_HAVE_NCCL
#include "transport/nccl_channel.h"
#endif
#include "service/status_map.h"
#include "service/tls.h"
#include "transport/wire.h"

const tqkv__handler_t *
tqkv__method_handler(tqkv__method_t m)
{
    switch (m) {
    case TQKV__M_PUT:
        return &tqkv__put_handler;
    case TQKV__M_LOOKUP:
        return &tqkv__lookup_handler;
    case TQKV__M_GET:
        return &tqkv__get_dispatch_handler; /* tqkv__get_handler unless transport NCCL */
    case TQKV__M_GET_NCCL:
        return &tqkv__get_nccl_handler;
    case TQKV__M_GET_TCP:
        return &tqkv__get_tcp_handler;
    case TQKV__M_OPEN_CHANNEL:
        return &tqkv__open_channel_handler;
    case TQKV__M_CLOSE_CHANNEL:
        return &tqkv__close_channel_handler;
    case TQKV__M_DELETE:
        return &tqkv__delete_handler;
    case TQKV__M_STATS:
        return &tqkv__stats_handler;
    case TQKV__M_HEALTH_CHECK:
        return &tqkv__health_check_handler;
    case TQKV__M_HEALTH_WATCH:
        return &tqkv__health_watch_handler;
    case TQKV__M_REFLECT_V1:
    case TQKV__M_REFLECT_V1A:
        return &tqkv__reflection_handler;
    default:
        return NULL;
    }
}

const char *const tqkv__method_paths[TQKV__M_COUNT] = {
    "/tqkv.v1.KVCache/Put",
    "/tqkv.v1.KVCache/Lookup",
    "/tqkv.v1.KVCache/Get",
    "/tqkv.v1.KVCache/Delete",
    "/tqkv.v1.KVCache/Stats",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/tqkv.v1.KVCache/OpenChannel",
    "/tqkv.v1.KVCache/CloseChannel",
};
