/* disk_io.c - the disk tier's I/O engine: io_uring through liburing, or a thread pool.
 *
 * io_uring: one ring shared by every caller. Submitters fill SQEs under `sq_lock` and
 * submit; one completion thread reaps CQEs and posts each request's semaphore. A
 * counting semaphore (`slots`) bounds the I/Os in flight to the ring's depth, so the
 * completion queue never overflows. Shutdown: a NOP with no request stops the thread.
 *
 * Threads: `nthreads` workers take requests from a FIFO (`q_lock`, `q_cond`) and run
 * preadv2/pwritev2. Both engines transfer what they can; tqkv__io_rw loops over short
 * transfers and EINTR/EAGAIN.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifdef TQKV_HAVE_LIBURING
#include <liburing.h>
#endif

#include "cache/disk_io.h"

#define RING_DEPTH 256u

typedef struct req {
    int write, fd;
    void *buf;
    size_t len;
    uint64_t off;
    /* Written by the worker or the completion thread, read by the waiter after `done`;
     * atomic because the io_uring path hands the request over through the kernel, which
     * race detectors cannot see. */
    _Atomic ssize_t res;
    sem_t done;
    struct req *next;
} req_t;

struct tqkv__io {
    int uring; /* 1: io_uring, 0: threads */
    char why[160];
#ifdef TQKV_HAVE_LIBURING
    struct io_uring ring;
    pthread_mutex_t sq_lock;  /* the submission queue */
    sem_t slots;              /* free in-flight slots */
    _Atomic uint64_t handoff; /* release by submitters, acquire by the completion thread:
                                 the happens-before the kernel gives, made visible to
                                 race detectors */
    pthread_t reaper;
#endif
    pthread_mutex_t q_lock; /* protects q_head, q_tail, stop */
    pthread_cond_t q_cond;
    req_t *q_head, *q_tail;
    int stop, nthreads;
    pthread_t *threads;
};

/* ---- thread pool ---- */

static void
do_one(req_t *r)
{
    struct iovec iov = {r->buf, r->len};
    ssize_t n = r->write ? pwritev2(r->fd, &iov, 1, (off_t)r->off, 0)
                         : preadv2(r->fd, &iov, 1, (off_t)r->off, 0);
    atomic_store_explicit(&r->res, n < 0 ? -errno : n, memory_order_relaxed);
}

static void *
worker_main(void *arg)
{
    tqkv__io_t *io = arg;
    for (;;) {
        pthread_mutex_lock(&io->q_lock);
        while (io->q_head == NULL && !io->stop)
            pthread_cond_wait(&io->q_cond, &io->q_lock);
        req_t *r = io->q_head;
        if (r == NULL) {
            pthread_mutex_unlock(&io->q_lock);
            return NULL;
        }
        io->q_head = r->next;
        if (io->q_head == NULL)
            io->q_tail = NULL;
        pthread_mutex_unlock(&io->q_lock);
        do_one(r);
        sem_post(&r->done);
    }
}

static void
pool_submit(tqkv__io_t *io, req_t *r)
{
    r->next = NULL;
    pthread_mutex_lock(&io->q_lock);
    if (io->q_tail)
        io->q_tail->next = r;
    else
        io->q_head = r;
    io->q_tail = r;
    pthread_cond_signal(&io->q_cond);
    pthread_mutex_unlock(&io->q_lock);
}

/* ---- io_uring ---- */

#ifdef TQKV_HAVE_LIBURING
static void *
reaper_main(void *arg)
{
    tqkv__io_t *io = arg;
    for (;;) {
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&io->ring, &cqe);
        if (rc == -EINTR)
            continue;
        if (rc < 0) {
            /* Should not happen; keep the callers from hanging: nothing to post to. */
            fprintf(stderr, "tqkv disk: io_uring_wait_cqe: %s\n", strerror(-rc));
            continue;
        }
        (void)atomic_load_explicit(&io->handoff, memory_order_acquire);
        req_t *r = io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&io->ring, cqe);
        if (r == NULL)
            return NULL;
        atomic_store_explicit(&r->res, res, memory_order_relaxed);
        sem_post(&io->slots);
        sem_post(&r->done);
    }
}

static int
uring_submit(tqkv__io_t *io, req_t *r)
{
    while (sem_wait(&io->slots) != 0)
        ;
    pthread_mutex_lock(&io->sq_lock);
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    while (sqe == NULL) {
        io_uring_submit(&io->ring);
        sqe = io_uring_get_sqe(&io->ring);
    }
    if (r->write)
        io_uring_prep_write(sqe, r->fd, r->buf, (unsigned)r->len, r->off);
    else
        io_uring_prep_read(sqe, r->fd, r->buf, (unsigned)r->len, r->off);
    io_uring_sqe_set_data(sqe, r);
    atomic_fetch_add_explicit(&io->handoff, 1, memory_order_release);
    int rc = io_uring_submit(&io->ring);
    pthread_mutex_unlock(&io->sq_lock);
    if (rc < 0) {
        sem_post(&io->slots);
        return rc;
    }
    return 0;
}

static int
uring_init(tqkv__io_t *io)
{
    int rc = io_uring_queue_init(RING_DEPTH, &io->ring, 0);
    if (rc < 0) {
        snprintf(io->why, sizeof(io->why), "io_uring_queue_init: %s", strerror(-rc));
        return rc;
    }
    /* A probe read of nothing: kernels that create rings but refuse ops fail here. */
    pthread_mutex_init(&io->sq_lock, NULL);
    sem_init(&io->slots, 0, RING_DEPTH);
    if (pthread_create(&io->reaper, NULL, reaper_main, io) != 0) {
        io_uring_queue_exit(&io->ring);
        snprintf(io->why, sizeof(io->why), "cannot start the completion thread");
        return -EAGAIN;
    }
    io->uring = 1;
    return 0;
}

static void
uring_fini(tqkv__io_t *io)
{
    pthread_mutex_lock(&io->sq_lock);
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    while (sqe == NULL) {
        io_uring_submit(&io->ring);
        sqe = io_uring_get_sqe(&io->ring);
    }
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data(sqe, NULL);
    io_uring_submit(&io->ring);
    pthread_mutex_unlock(&io->sq_lock);
    pthread_join(io->reaper, NULL);
    io_uring_queue_exit(&io->ring);
    sem_destroy(&io->slots);
    pthread_mutex_destroy(&io->sq_lock);
}
#endif

/* ---- public ---- */

tqkv_status_t
tqkv__io_create(tqkv_disk_io_t kind, int threads, tqkv__io_t **out, char *err, size_t errlen)
{
    tqkv__io_t *io = calloc(1, sizeof(*io));
    if (io == NULL)
        return TQKV_ENOMEM;
    pthread_mutex_init(&io->q_lock, NULL);
    pthread_cond_init(&io->q_cond, NULL);
    if (kind != TQKV_DISK_IO_THREADS) {
#ifdef TQKV_HAVE_LIBURING
        FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
        int disabled = 0;
        if (f != NULL) {
            if (fscanf(f, "%d", &disabled) != 1)
                disabled = 0;
            fclose(f);
        }
        if (disabled == 2)
            snprintf(io->why, sizeof(io->why), "kernel.io_uring_disabled = 2");
        else
            (void)uring_init(io);
#else
        snprintf(io->why, sizeof(io->why), "built without liburing (apt-get install liburing-dev)");
#endif
        if (!io->uring && kind == TQKV_DISK_IO_URING) {
            if (err)
                snprintf(err, errlen, "io_uring unavailable: %s", io->why);
            free(io);
            return TQKV_EUNSUPPORTED;
        }
    } else {
        snprintf(io->why, sizeof(io->why), "thread pool asked for");
    }
    if (!io->uring) {
        io->nthreads = threads > 0 ? threads : 4;
        io->threads = calloc((size_t)io->nthreads, sizeof(*io->threads));
        if (io->threads == NULL) {
            free(io);
            return TQKV_ENOMEM;
        }
        for (int i = 0; i < io->nthreads; i++)
            if (pthread_create(&io->threads[i], NULL, worker_main, io) != 0) {
                io->nthreads = i;
                tqkv__io_destroy(io);
                if (err)
                    snprintf(err, errlen, "cannot start I/O threads");
                return TQKV_ENOMEM;
            }
    }
    *out = io;
    return TQKV_OK;
}

void
tqkv__io_destroy(tqkv__io_t *io)
{
    if (io == NULL)
        return;
#ifdef TQKV_HAVE_LIBURING
    if (io->uring)
        uring_fini(io);
#endif
    pthread_mutex_lock(&io->q_lock);
    io->stop = 1;
    pthread_cond_broadcast(&io->q_cond);
    pthread_mutex_unlock(&io->q_lock);
    for (int i = 0; i < io->nthreads; i++)
        pthread_join(io->threads[i], NULL);
    free(io->threads);
    pthread_cond_destroy(&io->q_cond);
    pthread_mutex_destroy(&io->q_lock);
    free(io);
}

const char *
tqkv__io_name(const tqkv__io_t *io)
{
    return io->uring ? "io_uring" : "threads";
}

const char *
tqkv__io_fallback_reason(const tqkv__io_t *io)
{
    return io->uring ? "" : io->why;
}

ssize_t
tqkv__io_rw(tqkv__io_t *io, int write, int fd, void *buf, size_t len, uint64_t off)
{
    req_t r;
    size_t done = 0;
    sem_init(&r.done, 0, 0);
    while (done < len) {
        r.write = write;
        r.fd = fd;
        r.buf = (uint8_t *)buf + done;
        r.len = len - done;
        r.off = off + done;
        atomic_store_explicit(&r.res, 0, memory_order_relaxed);
#ifdef TQKV_HAVE_LIBURING
        if (io->uring) {
            int rc = uring_submit(io, &r);
            if (rc < 0) {
                sem_destroy(&r.done);
                return rc;
            }
        } else
#endif
            pool_submit(io, &r);
        while (sem_wait(&r.done) != 0)
            ;
        ssize_t res = atomic_load_explicit(&r.res, memory_order_relaxed);
        if (res == -EINTR || res == -EAGAIN)
            continue;
        if (res < 0) {
            sem_destroy(&r.done);
            return res;
        }
        if (res == 0)
            break; /* end of file (reads), or a write that makes no progress */
        done += (size_t)res;
    }
    sem_destroy(&r.done);
    if (write && done < len)
        return -ENOSPC;
    return (ssize_t)done;
}

int
tqkv__io_submit(tqkv__io_t *io, tqkv__io_op_t *op)
{
    req_t *r = malloc(sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    sem_init(&r->done, 0, 0);
    r->write = op->write;
    r->fd = op->fd;
    r->buf = op->buf;
    r->len = op->len;
    r->off = op->off;
    atomic_store_explicit(&r->res, 0, memory_order_relaxed);
#ifdef TQKV_HAVE_LIBURING
    if (io->uring) {
        int rc = uring_submit(io, r);
        if (rc < 0) {
            sem_destroy(&r->done);
            free(r);
            return rc;
        }
    } else
#endif
        pool_submit(io, r);
    op->priv = r;
    return 0;
}

ssize_t
tqkv__io_wait(tqkv__io_t *io, tqkv__io_op_t *op)
{
    req_t *r = op->priv;
    while (sem_wait(&r->done) != 0)
        ;
    ssize_t res = atomic_load_explicit(&r->res, memory_order_relaxed);
    sem_destroy(&r->done);
    free(r);
    op->priv = NULL;
    if (res < 0 && res != -EINTR && res != -EAGAIN)
        return res;
    size_t done = res > 0 ? (size_t)res : 0;
    if (done < op->len && (res != 0 || op->write)) {
        /* A short transfer (or a retryable error): finish synchronously. */
        ssize_t n = tqkv__io_rw(io, op->write, op->fd, (uint8_t *)op->buf + done, op->len - done,
                                op->off + done);
        if (n < 0)
            return n;
        done += (size_t)n;
    }
    return (ssize_t)done;
}
