/* status.h - the one status enum of tqkv, and tqkv_strerror().
 *
 * Every function that can fail returns a tqkv_status_t; results go out through
 * pointers. The list is an X-macro so the enum and its messages never drift
 * (libuv's UV_ERRNO_MAP). Translation to gRPC status codes lives in service/.
 */
#ifndef TQKV_KERNELS_STATUS_H
#define TQKV_KERNELS_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

#define TQKV_STATUS_MAP(X)                                                                         \
    X(OK, "ok")                                                                                    \
    X(EINVAL, "invalid argument")                                                                  \
    X(ENOMEM, "out of memory")                                                                     \
    X(ENOSPC, "tier or quota full")                                                                \
    X(EBUSY, "resource busy (pinned)")                                                             \
    X(ENOTFOUND, "not found")                                                                      \
    X(ECORRUPT, "corrupt data (bad CRC or layout)")                                                \
    X(EFORMAT, "bad page format (magic, version or size)")                                         \
    X(EUNSUPPORTED, "unsupported parameter")                                                       \
    X(ERANGE, "value out of range (NaN, Inf or overflow)")                                         \
    X(EIO, "I/O error")                                                                            \
    X(ECUDA, "CUDA error")                                                                         \
    X(ENCCL, "NCCL error")                                                                         \
    X(ENODEV, "no device")                                                                         \
    X(EPERM, "permission denied")                                                                  \
    X(EAUTH, "unauthenticated")                                                                    \
    X(ETIMEDOUT, "timed out")                                                                      \
    X(ECANCELED, "canceled")                                                                       \
    X(EUNAVAILABLE, "unavailable")                                                                 \
    X(EINTERNAL, "internal error")

typedef enum tqkv_status {
#define TQKV__STATUS_ENUM(name, msg) TQKV_##name,
    TQKV_STATUS_MAP(TQKV__STATUS_ENUM)
#undef TQKV__STATUS_ENUM
        TQKV_STATUS_COUNT
} tqkv_status_t;

/* Returns a static, human-readable message for st ("unknown status" if out of range). */
const char *tqkv_strerror(tqkv_status_t st);

/* Returns the enum's name without prefix ("EINVAL"), static. */
const char *tqkv_status_name(tqkv_status_t st);

#ifdef __cplusplus
}
#endif

#endif
