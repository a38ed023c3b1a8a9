/* status_map.c - tqkv_status_t -> grpc_status_code (see status_map.h). */
#include "service/status_map.h"

grpc_status_code
tqkv_status_to_grpc(tqkv_status_t st)
{
    switch (st) {
    case TQKV_OK:
        return GRPC_STATUS_OK;
    case TQKV_EINVAL:
    case TQKV_EFORMAT:
    case TQKV_EUNSUPPORTED:
    case TQKV_ERANGE:
        return GRPC_STATUS_INVALID_ARGUMENT;
    case TQKV_ENOMEM:
    case TQKV_ENOSPC:
    case TQKV_EBUSY:
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case TQKV_ENOTFOUND:
        return GRPC_STATUS_NOT_FOUND;
    case TQKV_ECORRUPT:
        return GRPC_STATUS_DATA_LOSS;
    case TQKV_EPERM:
        return GRPC_STATUS_PERMISSION_DENIED;
    case TQKV_EAUTH:
        return GRPC_STATUS_UNAUTHENTICATED;
    case TQKV_ETIMEDOUT:
        return GRPC_STATUS_DEADLINE_EXCEEDED;
    case TQKV_ECANCELED:
        return GRPC_STATUS_CANCELLED;
    case TQKV_EUNAVAILABLE:
    case TQKV_ENODEV:
        return GRPC_STATUS_UNAVAILABLE;
    case TQKV_EIO:
    case TQKV_ECUDA:
    case TQKV_ENCCL:
    case TQKV_EINTERNAL:
    case TQKV_STATUS_COUNT:
        break;
    }
    return GRPC_STATUS_INTERNAL;
}

grpc_status_code
tqkv_status_to_grpc_input(tqkv_status_t st)
{
    if (st == TQKV_ECORRUPT)
        return GRPC_STATUS_INVALID_ARGUMENT;
    return tqkv_status_to_grpc(st);
}
