/* nccl_channel.c - NCCL channels (see nccl_channel.h). Compiled only with NCCL.
 *
 * Threading: a server channel's CUDA and NCCL objects belong to its own thread; other
 * threads only queue pages, register a waiter, or mark the channel dead, under the
 * channel's mutex. The registry (id -> channel) has its own mutex and holds one
 * reference; the thread holds one; tqkv_nccl_chan_get takes one.
 */
#include "transport/nccl_channel.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "kernels/clock.h"

_Static_assert(TQKV_NCCL_UID_BYTES == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");

#define POLL_US 50
#define OP_TIMEOUT_MS 30000u /* one page send waiting for the peer's ncclRecv */
/* A channel with no Get for this long dies (a consumer that vanished without
 * CloseChannel must not hold a thread, a communicator and GPU memory forever).
 * Env TQKV_NCCL_IDLE_MS overrides. */
#define IDLE_MS_DEFAULT 600000u

static double
idle_limit_s(void)
{
    const char *e = getenv("TQKV_NCCL_IDLE_MS");
    long v = e ? atol(e) : 0;
    return (v > 0 ? (double)v : (double)IDLE_MS_DEFAULT) * 1e-3;
}

/* Set by tqkv_nccl_chan_close_all: every wait (communicator set-up, sends) gives up
 * at once so the channel threads release their pages and exit. */
static atomic_int g_closing;

int
tqkv_nccl_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/* ---- NCCL, loaded on first use ----
 *
 * libtqkv does not link libnccl: it opens libnccl.so.2 when a channel is first opened
 * or joined. A process that only uses the CPU paths never loads NCCL, and one that
 * loads PyTorch (which brings its own, newer libnccl.so.2) after libtqkv gets torch's
 * copy instead of finding the toolkit's already loaded under the same soname (which
 * made `import tqkv; import torch` fail: undefined symbol ncclCommResume). When torch
 * came first, dlopen returns its copy; NCCL keeps its ABI across 2.x. */
#define NCCL_FNS(X)                                                                                \
    X(CommGetAsyncError)                                                                           \
    X(CommInitRankConfig) X(CommAbort) X(Recv) X(Send) X(GetUniqueId) X(GetErrorString)
static struct {
#define NCCL_FIELD(f) __typeof__(&nccl##f) f;
    NCCL_FNS(NCCL_FIELD)
#undef NCCL_FIELD
} nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_err[256]; /* empty once loaded */

static void
nccl_load_once(void)
{
    const char *name = getenv("TQKV_NCCL_LIBRARY");
    if (name == NULL || !*name)
        name = "libnccl.so.2";
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        snprintf(nccl_err, sizeof nccl_err, "cannot load NCCL (%s): %s", name, dlerror());
        return;
    }
#define NCCL_SYM(f)                                                                                \
    if ((*(void **)&nccl.f = dlsym(h, "nccl" #f)) == NULL) {                                       \
        snprintf(nccl_err, sizeof nccl_err, "NCCL library %s lacks nccl" #f, name);                \
        return;                                                                                    \
    }
    NCCL_FNS(NCCL_SYM)
#undef NCCL_SYM
}

/* 0 when NCCL is usable; else -1 with the reason in err. */
static int
nccl_load(char *err, size_t errlen)
{
    pthread_once(&nccl_once, nccl_load_once);
    if (nccl_err[0] == 0)
        return 0;
    snprintf(err, errlen, "%s", nccl_err);
    return -1;
}

/* ---- communicator ---- */

struct tqkv_nccl_comm {
    ncclComm_t comm; /* NULL once aborted */
    cudaStream_t stream;
    int device;
};

/* Waits for a non-blocking communicator's pending operation. Returns ncclSuccess, the
 * error, or ncclInProgress when the deadline passed. */
static ncclResult_t
comm_wait(ncclComm_t comm, double deadline)
{
    ncclResult_t st = ncclInProgress;
    for (;;) {
        if (nccl.CommGetAsyncError(comm, &st) != ncclSuccess)
            return ncclInternalError;
        if (st != ncclInProgress)
            return st;
        if (tqkv_clock_s() > deadline || atomic_load_explicit(&g_closing, memory_order_relaxed))
            return ncclInProgress;
        usleep(POLL_US * 10);
    }
}

tqkv_status_t
tqkv_nccl_comm_join(const uint8_t uid[TQKV_NCCL_UID_BYTES], int rank, int device,
                    uint32_t timeout_ms, tqkv_nccl_comm_t **out, char *err, size_t errlen)
{
    tqkv_nccl_comm_t *m = calloc(1, sizeof *m);
    ncclUniqueId id;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    double deadline =
        tqkv_clock_s() + (timeout_ms ? timeout_ms : TQKV_NCCL_TIMEOUT_MS_DEFAULT) * 1e-3;
    *out = NULL;
    if (nccl_load(err, errlen) != 0) {
        free(m);
        return TQKV_ENCCL;
    }
    if (m == NULL) {
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    m->device = device;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking) != cudaSuccess) {
        snprintf(err, errlen, "CUDA device %d: %s", device, cudaGetErrorString(cudaGetLastError()));
        free(m);
        return TQKV_ENODEV;
    }
    memcpy(id.internal, uid, sizeof id.internal);
    cfg.blocking = 0;
    ncclResult_t r = nccl.CommInitRankConfig(&m->comm, 2, id, rank, &cfg);
    if (r == ncclSuccess || r == ncclInProgress)
        r = comm_wait(m->comm, deadline);
    if (r != ncclSuccess) {
        if (r == ncclInProgress)
            snprintf(err, errlen, "NCCL communicator: peer did not join within %u ms",
                     timeout_ms ? timeout_ms : TQKV_NCCL_TIMEOUT_MS_DEFAULT);
        else
            snprintf(err, errlen, "ncclCommInitRankConfig: %s", nccl.GetErrorString(r));
        if (m->comm)
            nccl.CommAbort(m->comm);
        cudaStreamDestroy(m->stream);
        free(m);
        return r == ncclInProgress ? TQKV_ETIMEDOUT : TQKV_ENCCL;
    }
    *out = m;
    return TQKV_OK;
}

static void
comm_abort(tqkv_nccl_comm_t *m)
{
    if (m->comm) {
        nccl.CommAbort(m->comm);
        m->comm = NULL;
    }
}

tqkv_status_t
tqkv_nccl_comm_recv(tqkv_nccl_comm_t *m, void *dev, size_t len, uint32_t timeout_ms, char *err,
                    size_t errlen)
{
    double deadline = tqkv_clock_s() + (timeout_ms ? timeout_ms : OP_TIMEOUT_MS) * 1e-3;
    if (m->comm == NULL) {
        snprintf(err, errlen, "NCCL channel aborted");
        return TQKV_ECANCELED;
    }
    cudaSetDevice(m->device);
    ncclResult_t r = nccl.Recv(dev, len, ncclUint8, 0, m->comm, m->stream);
    if (r == ncclInProgress)
        r = comm_wait(m->comm, deadline);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclRecv: %s",
                 r == ncclInProgress ? "timed out" : nccl.GetErrorString(r));
        comm_abort(m);
        return r == ncclInProgress ? TQKV_ETIMEDOUT : TQKV_ENCCL;
    }
    for (;;) {
        cudaError_t ce = cudaStreamQuery(m->stream);
        if (ce == cudaSuccess)
            return TQKV_OK;
        if (ce != cudaErrorNotReady) {
            snprintf(err, errlen, "ncclRecv stream: %s", cudaGetErrorString(ce));
            comm_abort(m);
            return TQKV_ECUDA;
        }
        ncclResult_t as = ncclSuccess;
        nccl.CommGetAsyncError(m->comm, &as);
        if (as != ncclSuccess && as != ncclInProgress) {
            snprintf(err, errlen, "ncclRecv: %s", nccl.GetErrorString(as));
            comm_abort(m);
            return TQKV_ENCCL;
        }
        if (tqkv_clock_s() > deadline) {
            snprintf(err, errlen, "ncclRecv of %zu bytes: timed out", len);
            comm_abort(m);
            return TQKV_ETIMEDOUT;
        }
        usleep(POLL_US);
    }
}

void *
tqkv_nccl_comm_stream(tqkv_nccl_comm_t *m)
{
    return (void *)m->stream;
}

void
tqkv_nccl_comm_free(tqkv_nccl_comm_t *m)
{
    if (m == NULL)
        return;
    cudaSetDevice(m->device);
    comm_abort(m);
    cudaStreamSynchronize(m->stream);
    cudaStreamDestroy(m->stream);
    free(m);
}

/* ---- server channels ---- */

typedef struct item {
    const void *data;
    size_t len;
    void (*release)(void *);
    void *arg;
    struct item *next;
} item_t;

typedef struct slot {
    void *buf;
    size_t cap;
    cudaEvent_t ev;
    item_t *it; /* in flight */
    double t0;
} slot_t;

struct tqkv_nccl_chan {
    uint64_t id;
    int device;
    uint32_t timeout_ms;
    unsigned window;
    uint8_t uid[TQKV_NCCL_UID_BYTES];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    int dead;
    int claimed;
    item_t *head, *tail; /* queued, not yet issued */
    unsigned pending;    /* queued + in flight (bounded by window) */
    void (*wake)(void *);
    void *warg;
    tqkv_nccl_chan_t *next; /* registry */
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reg_cv = PTHREAD_COND_INITIALIZER; /* a channel thread exited */
static tqkv_nccl_chan_t *reg_head;
static unsigned reg_threads; /* channel threads running, under reg_mu */

static void
chan_unref(tqkv_nccl_chan_t *ch)
{
    pthread_mutex_lock(&ch->mu);
    int last = --ch->refs == 0;
    pthread_mutex_unlock(&ch->mu);
    if (last) {
        pthread_mutex_destroy(&ch->mu);
        pthread_cond_destroy(&ch->cv);
        free(ch);
    }
}

/* Removes ch from the registry; returns 1 when it was there (its reference is the
 * caller's to drop). */
static int
reg_remove(tqkv_nccl_chan_t *ch)
{
    int found = 0;
    pthread_mutex_lock(&reg_mu);
    for (tqkv_nccl_chan_t **p = &reg_head; *p; p = &(*p)->next) {
        if (*p == ch) {
            *p = ch->next;
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&reg_mu);
    return found;
}

/* Takes the waiter (under ch->mu); the caller fires it after unlocking. */
static void
take_waiter(tqkv_nccl_chan_t *ch, void (**wake)(void *), void **warg)
{
    *wake = ch->wake;
    *warg = ch->warg;
    ch->wake = NULL;
    ch->warg = NULL;
}

static void
chan_kill(tqkv_nccl_chan_t *ch)
{
    void (*wake)(void *);
    void *warg;
    pthread_mutex_lock(&ch->mu);
    ch->dead = 1;
    take_waiter(ch, &wake, &warg);
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    if (wake)
        wake(warg);
    if (reg_remove(ch))
        chan_unref(ch);
}

/* Issues item it on slot s: stage into device memory, then ncclSend. */
static int
issue(tqkv_nccl_comm_t *m, slot_t *s, item_t *it, double deadline)
{
    if (s->cap < it->len) {
        /* Stream-ordered (no device-wide sync that could wait on a send blocked on
         * the peer); grown to at least twice the old size, in 1 MiB steps. */
        size_t cap = s->cap * 2 > it->len ? s->cap * 2 : it->len;
        cap = (cap + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
        if (s->buf)
            cudaFreeAsync(s->buf, m->stream);
        s->buf = NULL;
        s->cap = 0;
        if (cudaMallocAsync(&s->buf, cap, m->stream) != cudaSuccess)
            return -1;
        s->cap = cap;
    }
    s->it = it;
    s->t0 = tqkv_clock_s();
    if (cudaMemcpyAsync(s->buf, it->data, it->len, cudaMemcpyDefault, m->stream) != cudaSuccess)
        return -1;
    ncclResult_t r = nccl.Send(s->buf, it->len, ncclUint8, 1, m->comm, m->stream);
    if (r == ncclInProgress)
        r = comm_wait(m->comm, deadline);
    if (r != ncclSuccess)
        return -1;
    return cudaEventRecord(s->ev, m->stream) == cudaSuccess ? 0 : -1;
}

static void *
chan_main(void *arg)
{
    tqkv_nccl_chan_t *ch = arg;
    tqkv_nccl_comm_t *m = NULL;
    char err[256];
    slot_t *slots = calloc(ch->window, sizeof *slots);
    unsigned first = 0, inflight = 0, nev = 0;

    if (slots == NULL ||
        tqkv_nccl_comm_join(ch->uid, 0, ch->device, ch->timeout_ms, &m, err, sizeof err) != TQKV_OK)
        goto out;
    for (nev = 0; nev < ch->window; nev++)
        if (cudaEventCreateWithFlags(&slots[nev].ev, cudaEventDisableTiming) != cudaSuccess)
            goto out;
    double idle_limit = idle_limit_s(), last = tqkv_clock_s();
    for (;;) {
        item_t *it = NULL;
        int idle = 0;
        pthread_mutex_lock(&ch->mu);
        while (!ch->dead && ch->head == NULL && inflight == 0) {
            if (ch->claimed)
                last = tqkv_clock_s();
            else if (tqkv_clock_s() - last > idle_limit) {
                idle = 1;
                break;
            }
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&ch->cv, &ch->mu, &ts);
        }
        if (ch->dead || idle) {
            pthread_mutex_unlock(&ch->mu);
            break;
        }
        last = tqkv_clock_s();
        if (ch->head && inflight < ch->window) {
            it = ch->head;
            ch->head = it->next;
            if (ch->head == NULL)
                ch->tail = NULL;
        }
        pthread_mutex_unlock(&ch->mu);
        if (it) {
            slot_t *s = &slots[(first + inflight) % ch->window];
            inflight++;
            if (issue(m, s, it, tqkv_clock_s() + OP_TIMEOUT_MS * 1e-3) != 0) {
                if (s->it == NULL) { /* not attached to the slot: release here */
                    inflight--;
                    it->release(it->arg);
                    free(it);
                }
                break;
            }
            continue;
        }
        /* Oldest send in flight: done, failed, or still waiting for the peer. */
        slot_t *s = &slots[first];
        cudaError_t ce = cudaEventQuery(s->ev);
        if (ce == cudaSuccess) {
            void (*wake)(void *);
            void *warg;
            s->it->release(s->it->arg);
            free(s->it);
            s->it = NULL;
            first = (first + 1) % ch->window;
            inflight--;
            pthread_mutex_lock(&ch->mu);
            ch->pending--;
            take_waiter(ch, &wake, &warg);
            pthread_mutex_unlock(&ch->mu);
            if (wake)
                wake(warg);
            continue;
        }
        if (ce != cudaErrorNotReady)
            break;
        ncclResult_t as = ncclSuccess;
        nccl.CommGetAsyncError(m->comm, &as);
        if ((as != ncclSuccess && as != ncclInProgress) ||
            tqkv_clock_s() - s->t0 > OP_TIMEOUT_MS * 1e-3)
            break;
        pthread_mutex_lock(&ch->mu);
        int dead = ch->dead;
        pthread_mutex_unlock(&ch->mu);
        if (dead) /* closed or aborted while the peer had not received yet */
            break;
        usleep(POLL_US);
    }
out:
    chan_kill(ch); /* no-op when already dead; wakes a waiter */
    if (m)
        tqkv_nccl_comm_free(m); /* abort, then the stream drains */
    for (unsigned i = 0; slots && i < ch->window; i++) {
        if (slots[i].it) {
            slots[i].it->release(slots[i].it->arg);
            free(slots[i].it);
        }
        if (slots[i].buf)
            cudaFree(slots[i].buf);
        if (i < nev)
            cudaEventDestroy(slots[i].ev);
    }
    free(slots);
    pthread_mutex_lock(&ch->mu);
    item_t *q = ch->head;
    ch->head = ch->tail = NULL;
    pthread_mutex_unlock(&ch->mu);
    while (q) {
        item_t *n = q->next;
        q->release(q->arg);
        free(q);
        q = n;
    }
    chan_unref(ch);
    pthread_mutex_lock(&reg_mu);
    reg_threads--;
    pthread_cond_broadcast(&reg_cv);
    pthread_mutex_unlock(&reg_mu);
    return NULL;
}

tqkv_status_t
tqkv_nccl_chan_open(int device, uint32_t timeout_ms, unsigned window, uint64_t *id,
                    uint8_t uid[TQKV_NCCL_UID_BYTES], char *err, size_t errlen)
{
    ncclUniqueId u;
    if (nccl_load(err, errlen) != 0)
        return TQKV_ENCCL;
    ncclResult_t r = nccl.GetUniqueId(&u);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclGetUniqueId: %s", nccl.GetErrorString(r));
        return TQKV_ENCCL;
    }
    tqkv_nccl_chan_t *ch = calloc(1, sizeof *ch);
    if (ch == NULL) {
        snprintf(err, errlen, "out of memory");
        return TQKV_ENOMEM;
    }
    do {
        if (getrandom(&ch->id, sizeof ch->id, 0) != (ssize_t)sizeof ch->id)
            ch->id = ((uint64_t)rand() << 32) ^ (uint64_t)rand() ^ (uint64_t)(uintptr_t)ch;
    } while (ch->id == 0);
    ch->device = device;
    ch->timeout_ms = timeout_ms ? timeout_ms : TQKV_NCCL_TIMEOUT_MS_DEFAULT;
    ch->window = window ? window : TQKV_NCCL_WINDOW_DEFAULT;
    memcpy(ch->uid, u.internal, TQKV_NCCL_UID_BYTES);
    pthread_mutex_init(&ch->mu, NULL);
    pthread_cond_init(&ch->cv, NULL);
    ch->refs = 2; /* registry + thread */
    pthread_mutex_lock(&reg_mu);
    ch->next = reg_head;
    reg_head = ch;
    reg_threads++;
    pthread_mutex_unlock(&reg_mu);
    pthread_t t;
    if (pthread_create(&t, NULL, chan_main, ch) != 0) {
        pthread_mutex_lock(&reg_mu);
        reg_threads--;
        pthread_mutex_unlock(&reg_mu);
        ch->refs--; /* no thread */
        chan_kill(ch);
        snprintf(err, errlen, "cannot start the channel thread");
        return TQKV_ENOMEM;
    }
    pthread_detach(t);
    *id = ch->id;
    memcpy(uid, ch->uid, TQKV_NCCL_UID_BYTES);
    return TQKV_OK;
}

tqkv_nccl_chan_t *
tqkv_nccl_chan_get(uint64_t id)
{
    tqkv_nccl_chan_t *ch;
    pthread_mutex_lock(&reg_mu);
    for (ch = reg_head; ch; ch = ch->next)
        if (ch->id == id)
            break;
    if (ch) {
        pthread_mutex_lock(&ch->mu);
        if (ch->dead)
            ch = (pthread_mutex_unlock(&ch->mu), NULL);
        else {
            ch->refs++;
            pthread_mutex_unlock(&ch->mu);
        }
    }
    pthread_mutex_unlock(&reg_mu);
    return ch;
}

void
tqkv_nccl_chan_put(tqkv_nccl_chan_t *ch)
{
    if (ch)
        chan_unref(ch);
}

void
tqkv_nccl_chan_abort(tqkv_nccl_chan_t *ch)
{
    if (ch)
        chan_kill(ch);
}

tqkv_status_t
tqkv_nccl_chan_close(uint64_t id)
{
    tqkv_nccl_chan_t *ch = tqkv_nccl_chan_get(id);
    if (ch == NULL)
        return TQKV_ENOTFOUND;
    chan_kill(ch);
    chan_unref(ch);
    return TQKV_OK;
}

unsigned
tqkv_nccl_chan_close_all(uint32_t wait_ms)
{
    atomic_store(&g_closing, 1);
    for (;;) {
        pthread_mutex_lock(&reg_mu);
        tqkv_nccl_chan_t *ch = reg_head;
        if (ch != NULL) {
            pthread_mutex_lock(&ch->mu);
            ch->refs++;
            pthread_mutex_unlock(&ch->mu);
        }
        pthread_mutex_unlock(&reg_mu);
        if (ch == NULL)
            break;
        chan_kill(ch); /* unregisters it */
        chan_unref(ch);
    }
    struct timespec until = tqkv_clock_deadline(wait_ms);
    pthread_mutex_lock(&reg_mu);
    while (reg_threads > 0)
        if (pthread_cond_timedwait(&reg_cv, &reg_mu, &until) != 0)
            break;
    unsigned left = reg_threads;
    pthread_mutex_unlock(&reg_mu);
    /* All gone: channels opened from now on (another server in this process) work
     * again. With threads still running the flag stays, so they keep giving up. */
    if (left == 0)
        atomic_store(&g_closing, 0);
    return left;
}

tqkv_status_t
tqkv_nccl_chan_send(tqkv_nccl_chan_t *ch, const void *data, size_t len, void (*release)(void *),
                    void *arg)
{
    item_t *it = malloc(sizeof *it);
    if (it == NULL)
        return TQKV_ENOMEM;
    *it = (item_t){data, len, release, arg, NULL};
    pthread_mutex_lock(&ch->mu);
    if (ch->dead || ch->pending >= ch->window) {
        tqkv_status_t st = ch->dead ? TQKV_ECANCELED : TQKV_EBUSY;
        pthread_mutex_unlock(&ch->mu);
        free(it);
        return st;
    }
    if (ch->tail)
        ch->tail->next = it;
    else
        ch->head = it;
    ch->tail = it;
    ch->pending++;
    pthread_cond_signal(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    return TQKV_OK;
}

int
tqkv_nccl_chan_wait_room(tqkv_nccl_chan_t *ch, void (*wake)(void *), void *warg)
{
    int reg = 0;
    pthread_mutex_lock(&ch->mu);
    if (!ch->dead && ch->pending >= ch->window && ch->wake == NULL) {
        ch->wake = wake;
        ch->warg = warg;
        reg = 1;
    }
    pthread_mutex_unlock(&ch->mu);
    return reg;
}

int
tqkv_nccl_chan_alive(tqkv_nccl_chan_t *ch)
{
    pthread_mutex_lock(&ch->mu);
    int a = !ch->dead;
    pthread_mutex_unlock(&ch->mu);
    return a;
}

int
tqkv_nccl_chan_claim(tqkv_nccl_chan_t *ch)
{
    pthread_mutex_lock(&ch->mu);
    int ok = !ch->claimed;
    ch->claimed = 1;
    pthread_mutex_unlock(&ch->mu);
    return ok;
}

void
tqkv_nccl_chan_unclaim(tqkv_nccl_chan_t *ch)
{
    pthread_mutex_lock(&ch->mu);
    ch->claimed = 0;
    pthread_mutex_unlock(&ch->mu);
}
