/* disk_io.h - the disk tier's I/O engine: io_uring (liburing) or a thread pool on
 * preadv2/pwritev2, chosen at start-up. A caller blocks only on its own I/O; many
 * callers' I/Os are in flight at once (a ring per thread, or the pool's workers), and
 * one caller can have many in flight (tqkv__io_submit, then tqkv__io_wait).
 */
#ifndef TQKV_CACHE_DISK_IO_H
#define TQKV_CACHE_DISK_IO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "cache/disk.h"
#include "kernels/status.h"

typedef struct tqkv__io tqkv__io_t;

/* Creates an engine of `kind` (AUTO: io_uring when available, else threads). err gets a
 * reason when io_uring was asked for and is unavailable (TQKV_EUNSUPPORTED). */
tqkv_status_t tqkv__io_create(tqkv_disk_io_t kind, int threads, tqkv__io_t **out, char *err,
                              size_t errlen);
void tqkv__io_destroy(tqkv__io_t *io);
/* "io_uring" or "threads" (static). */
const char *tqkv__io_name(const tqkv__io_t *io);
/* Why io_uring was not used with AUTO ("" when it is), static until destroy. */
const char *tqkv__io_fallback_reason(const tqkv__io_t *io);

/* Reads or writes buf[0..len) at off of fd, looping over short transfers. Returns the
 * bytes done (fewer than len only at end of file for reads) or -errno. */
ssize_t tqkv__io_rw(tqkv__io_t *io, int write, int fd, void *buf, size_t len, uint64_t off);

/* An asynchronous transfer: fill the fields, tqkv__io_submit, later tqkv__io_wait.
 * The caller owns the struct (and keeps it alive until the wait returned). */
typedef struct tqkv__io_op {
    int write, fd;
    void *buf;
    size_t len;
    uint64_t off;
    void *priv;  /* thread pool: the engine's request */
    ssize_t res; /* io_uring: the completion's result */
    int state;   /* io_uring: 1 in flight, 2 completed */
} tqkv__io_op_t;

/* Starts op; returns 0 or -errno (then nothing is in flight and wait must not be called).
 * With io_uring, op must be waited for by the thread that submitted it (each thread
 * has its own ring). */
int tqkv__io_submit(tqkv__io_t *io, tqkv__io_op_t *op);
/* Waits for op, finishing short transfers; returns bytes done or -errno (as
 * tqkv__io_rw). */
ssize_t tqkv__io_wait(tqkv__io_t *io, tqkv__io_op_t *op);

/* Blocks until n of the calling thread's submitted transfers have completed (fewer when
 * fewer are in flight), so that a batch costs one sleep and one wake-up rather than one
 * per transfer: each later tqkv__io_wait of those returns at once. io_uring only; with
 * the thread pool it returns at once (tqkv__io_wait waits per transfer). */
void tqkv__io_wait_many(tqkv__io_t *io, size_t n);

/* Test hook: the next n transfers (any engine, any thread) fail with -err (EIO, ...)
 * without reaching the file system. */
void tqkv__io_debug_fail(unsigned n, int err);

#endif
