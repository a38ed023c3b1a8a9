/* status.c - messages for tqkv_status_t. */
#include "kernels/status.h"

const char *
tqkv_strerror(tqkv_status_t st)
{
    switch (st) {
#define TQKV__STATUS_MSG(name, msg)                                                                \
    case TQKV_##name:                                                                              \
        return msg;
        TQKV_STATUS_MAP(TQKV__STATUS_MSG)
#undef TQKV__STATUS_MSG
    default:
        return "unknown status";
    }
}

const char *
tqkv_status_name(tqkv_status_t st)
{
    switch (st) {
#define TQKV__STATUS_NAME(name, msg)                                                               \
    case TQKV_##name:                                                                              \
        return #name;
        TQKV_STATUS_MAP(TQKV__STATUS_NAME)
#undef TQKV__STATUS_NAME
    default:
        return "UNKNOWN";
    }
}
