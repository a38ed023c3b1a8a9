/* status_grpc.h - tqkv_status_t <-> grpc_status_code: the one table behind the server's
 * translation (service/status_map.c) and libtqkv's reading of a call's status
 * (transport/client_call.c). Header-only, so the client does not depend on service/.
 *
 * X(tqkv status, gRPC code, direction): TO rows are read tqkv -> gRPC only, FROM rows
 * gRPC -> tqkv only, BOTH rows both ways. A tqkv status without a TO/BOTH row is
 * INTERNAL on the wire; a gRPC code without a FROM/BOTH row reads as TQKV_EINTERNAL.
 * The compiler rejects a status or code given two rows in one direction (duplicate
 * case); check_wire maps every status and code both ways.
 */
#ifndef TQKV_TRANSPORT_STATUS_GRPC_H
#define TQKV_TRANSPORT_STATUS_GRPC_H

#include <grpc/status.h>

#include "kernels/status.h"

#define TQKV_GRPC_STATUS_MAP(X)                                                                    \
    X(OK, OK, BOTH)                                                                                \
    X(EINVAL, INVALID_ARGUMENT, BOTH)                                                              \
    X(EFORMAT, INVALID_ARGUMENT, TO)                                                               \
    X(EUNSUPPORTED, INVALID_ARGUMENT, TO)                                                          \
    X(ERANGE, INVALID_ARGUMENT, TO)                                                                \
    X(EINVAL, OUT_OF_RANGE, FROM)                                                                  \
    X(EINVAL, FAILED_PRECONDITION, FROM)                                                           \
    X(ENOMEM, RESOURCE_EXHAUSTED, TO)                                                              \
    X(ENOSPC, RESOURCE_EXHAUSTED, BOTH)                                                            \
    X(EBUSY, RESOURCE_EXHAUSTED, TO)                                                               \
    X(ENOTFOUND, NOT_FOUND, BOTH)                                                                  \
    X(ECORRUPT, DATA_LOSS, BOTH)                                                                   \
    X(EPERM, PERMISSION_DENIED, BOTH)                                                              \
    X(EAUTH, UNAUTHENTICATED, BOTH)                                                                \
    X(ETIMEDOUT, DEADLINE_EXCEEDED, BOTH)                                                          \
    X(ECANCELED, CANCELLED, BOTH)                                                                  \
    X(EUNAVAILABLE, UNAVAILABLE, BOTH)                                                             \
    X(ENODEV, UNAVAILABLE, TO)                                                                     \
    X(EUNSUPPORTED, UNIMPLEMENTED, FROM)

#define TQKV__SG_TO_BOTH(x) x
#define TQKV__SG_TO_TO(x) x
#define TQKV__SG_TO_FROM(x)
#define TQKV__SG_FROM_BOTH(x) x
#define TQKV__SG_FROM_FROM(x) x
#define TQKV__SG_FROM_TO(x)

/* The gRPC code that carries st (INTERNAL for statuses without a row). */
static inline grpc_status_code
tqkv__status_to_grpc_code(tqkv_status_t st)
{
    switch (st) {
#define TQKV__SG_CASE(s, g, dir) TQKV__SG_TO_##dir(case TQKV_##s : return GRPC_STATUS_##g;)
        TQKV_GRPC_STATUS_MAP(TQKV__SG_CASE)
#undef TQKV__SG_CASE
    default:
        break;
    }
    return GRPC_STATUS_INTERNAL;
}

/* The tqkv status a client reads from a call's gRPC code (TQKV_EINTERNAL for codes
 * without a row). */
static inline tqkv_status_t
tqkv__status_from_grpc_code(grpc_status_code code)
{
    switch (code) {
#define TQKV__SG_CASE(s, g, dir) TQKV__SG_FROM_##dir(case GRPC_STATUS_##g : return TQKV_##s;)
        TQKV_GRPC_STATUS_MAP(TQKV__SG_CASE)
#undef TQKV__SG_CASE
    default:
        break;
    }
    return TQKV_EINTERNAL;
}

#endif
