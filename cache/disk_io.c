/* disk_io.c - the disk tier's I/O engine: io_uring through liburing, or a thread pool.
 *
 * io_uring: a ring per thread (created on the thread's first I/O, freed when it exits),
 * so a caller submits and reaps its own I/Os with no hand-off to another thread: a single
 * transfer is one io_uring_submit_and_wait, a batch (tqkv__io_submit x n, then
 * tqkv__io_wait) is n I/Os in flight for one thread. A ring holds at most RING_DEPTH I/Os
 * in flight; a submitter beyond that first reaps completions (stored into their ops).
 *
 * Threads: `nthreads` workers take requests from a FIFO (`q_lock`, `q_cond`) and run
 * preadv2/pwritev2; the caller waits on the request's semaphore. Both engines transfer
 * what they can; tqkv__io_rw and tqkv__io_wait finish short transfers.
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

static _Atomic unsigned g_fail_n; /* tqkv__io_debug_fail */
static _Atomic int g_fail_err;

void
tqkv__io_debug_fail(unsigned n, int err)
{
    atomic_store(&g_fail_err, err);
    atomic_store(&g_fail_n, n);
}

/* 1 when an injected failure is due (consumes it). */
static int
injected_failure(void)
{
    unsigned n = atomic_load_explicit(&g_fail_n, memory_order_relaxed);
    while (n > 0)
        if (atomic_compare_exchange_weak(&g_fail_n, &n, n - 1))
            return 1;
    return 0;
}

typedef struct req {
    int write, fd;
    void *buf;
    size_t len;
    uint64_t off;
    _Atomic ssize_t res; /* written by the worker, read by the waiter after `done` */
    sem_t done;
    struct req *next;
} req_t;

struct tqkv__io {
    int uring; /* 1: io_uring, 0: threads */
    char why[160];
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

/* ---- io_uring: one ring per thread ---- */

#ifdef TQKV_HAVE_LIBURING
typedef struct tl_ring {
    struct io_uring ring;
    unsigned inflight;
} tl_ring_t;

static pthread_key_t g_ring_key;
static pthread_once_t g_ring_once = PTHREAD_ONCE_INIT;
static int g_ring_key_ok;

static void
tl_free(void *p)
{
    tl_ring_t *r = p;
    io_uring_queue_exit(&r->ring);
    free(r);
}

/* After fork the child must not share the parent's ring (the same kernel object, with
 * the parent's requests in it): it drops its copy and makes its own on first use. */
static void
ring_atfork_child(void)
{
    tl_ring_t *r = pthread_getspecific(g_ring_key);
    if (r != NULL) {
        io_uring_queue_exit(&r->ring); /* the child's mappings and fd only */
        free(r);
        pthread_setspecific(g_ring_key, NULL);
    }
}

static void
ring_key_init(void)
{
    g_ring_key_ok = pthread_key_create(&g_ring_key, tl_free) == 0;
    if (g_ring_key_ok)
        pthread_atfork(NULL, NULL, ring_atfork_child);
}

/* The calling thread's ring, created on first use; NULL (with *err) when that fails. */
static tl_ring_t *
tl_ring(int *err)
{
    pthread_once(&g_ring_once, ring_key_init);
    if (!g_ring_key_ok) {
        *err = -EAGAIN;
        return NULL;
    }
    tl_ring_t *r = pthread_getspecific(g_ring_key);
    if (r != NULL)
        return r;
    r = calloc(1, sizeof(*r));
    if (r == NULL) {
        *err = -ENOMEM;
        return NULL;
    }
    int rc = io_uring_queue_init(RING_DEPTH, &r->ring, 0);
    if (rc < 0) {
        free(r);
        *err = rc;
        return NULL;
    }
    pthread_setspecific(g_ring_key, r);
    return r;
}

/* Reaps one completion of r into its op. */
static int
tl_reap(tl_ring_t *r)
{
    struct io_uring_cqe *cqe;
    int rc;
    do
        rc = io_uring_wait_cqe(&r->ring, &cqe);
    while (rc == -EINTR);
    if (rc < 0)
        return rc;
    tqkv__io_op_t *op = io_uring_cqe_get_data(cqe);
    op->res = cqe->res;
    op->state = 2;
    io_uring_cqe_seen(&r->ring, cqe);
    r->inflight--;
    return 0;
}

/* Starts op on the calling thread's ring; with wait, also waits for it (one syscall). */
static int
uring_submit(tqkv__io_op_t *op, int wait)
{
    int err = 0;
    tl_ring_t *r = tl_ring(&err);
    if (r == NULL)
        return err;
    while (r->inflight >= RING_DEPTH) {
        int rc = tl_reap(r);
        if (rc < 0)
            return rc;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (sqe == NULL)
        return -EBUSY; /* cannot happen: every SQE is submitted at once */
    if (op->write)
        io_uring_prep_write(sqe, op->fd, op->buf, (unsigned)op->len, op->off);
    else
        io_uring_prep_read(sqe, op->fd, op->buf, (unsigned)op->len, op->off);
    io_uring_sqe_set_data(sqe, op);
    op->state = 1;
    int rc = wait ? io_uring_submit_and_wait(&r->ring, 1) : io_uring_submit(&r->ring);
    if (rc < 0 && rc != -EINTR) {
        op->state = 0;
        return rc;
    }
    r->inflight++;
    return 0;
}

/* Waits until n completions of this thread's ring are reaped (at most those in flight):
 * one io_uring_wait_cqe_nr for them all, then every completion that is there. */
static void
uring_wait_many(size_t n)
{
    int err = 0;
    tl_ring_t *r = tl_ring(&err);
    size_t got = 0;
    while (r != NULL && got < n && r->inflight > 0) {
        struct io_uring_cqe *cqe;
        unsigned want = n - got < r->inflight ? (unsigned)(n - got) : r->inflight;
        int rc = io_uring_wait_cqe_nr(&r->ring, &cqe, want);
        if (rc == -EINTR)
            continue;
        if (rc < 0)
            return; /* tqkv__io_wait reports it per transfer */
        while (r->inflight > 0 && io_uring_peek_cqe(&r->ring, &cqe) == 0) {
            tqkv__io_op_t *op = io_uring_cqe_get_data(cqe);
            op->res = cqe->res;
            op->state = 2;
            io_uring_cqe_seen(&r->ring, cqe);
            r->inflight--;
            got++;
        }
    }
}

/* Waits for op (submitted by this thread); returns the raw result. */
static ssize_t
uring_wait(tqkv__io_op_t *op)
{
    int err = 0;
    tl_ring_t *r = tl_ring(&err);
    while (op->state == 1) {
        int rc = r ? tl_reap(r) : err;
        if (rc < 0)
            return rc;
    }
    return op->res;
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
        else {
            int e = 0;
            if (tl_ring(&e) != NULL) /* this thread's ring: the kernel accepts rings */
                io->uring = 1;
            else
                snprintf(io->why, sizeof(io->why), "io_uring_queue_init: %s", strerror(-e));
        }
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
    if (injected_failure())
        return -atomic_load(&g_fail_err);
    sem_init(&r.done, 0, 0);
    while (done < len) {
        ssize_t res;
#ifdef TQKV_HAVE_LIBURING
        if (io->uring) {
            tqkv__io_op_t op = {write, fd, (uint8_t *)buf + done, len - done, off + done, NULL,
                                0,     0};
            int rc = uring_submit(&op, 1);
            res = rc < 0 ? rc : uring_wait(&op);
        } else
#endif
        {
            r.write = write;
            r.fd = fd;
            r.buf = (uint8_t *)buf + done;
            r.len = len - done;
            r.off = off + done;
            atomic_store_explicit(&r.res, 0, memory_order_relaxed);
            pool_submit(io, &r);
            while (sem_wait(&r.done) != 0)
                ;
            res = atomic_load_explicit(&r.res, memory_order_relaxed);
        }
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
    op->priv = NULL;
    op->state = 0;
    op->res = 0;
    if (injected_failure())
        return -atomic_load(&g_fail_err);
#ifdef TQKV_HAVE_LIBURING
    if (io->uring)
        return uring_submit(op, 0);
#endif
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
    pool_submit(io, r);
    op->priv = r;
    return 0;
}

void
tqkv__io_wait_many(tqkv__io_t *io, size_t n)
{
#ifdef TQKV_HAVE_LIBURING
    if (io->uring)
        uring_wait_many(n);
#else
    (void)io;
    (void)n;
#endif
}

ssize_t
tqkv__io_wait(tqkv__io_t *io, tqkv__io_op_t *op)
{
    ssize_t res;
#ifdef TQKV_HAVE_LIBURING
    if (io->uring) {
        res = uring_wait(op);
    } else
#endif
    {
        req_t *r = op->priv;
        while (sem_wait(&r->done) != 0)
            ;
        res = atomic_load_explicit(&r->res, memory_order_relaxed);
        sem_destroy(&r->done);
        free(r);
        op->priv = NULL;
    }
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
