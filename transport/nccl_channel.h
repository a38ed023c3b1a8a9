/* nccl_channel.h - the NCCL transport (GPU consumers): a 2-rank communicator per
 * channel, the server's page sender (rank 0) and the client's receive side (rank 1).
 *
 * Compiled only with NCCL (transport/nccl*.c, TQKV_HAVE_NCCL); callers guard their
 * uses with #ifdef TQKV_HAVE_NCCL. Nothing here ever blocks without a bound: the
 * communicator is created non-blocking (ncclCommInitRankConfig, blocking = 0) and
 * polled with ncclCommGetAsyncError until success or the timeout, then aborted;
 * every wait on the GPU polls and gives up (ncclCommAbort) after its timeout.
 *
 * Server side: tqkv_nccl_chan_open makes a channel (a fresh ncclUniqueId and an id),
 * registers it, and starts its dedicated thread, which joins the communicator as
 * rank 0 and then sends queued pages in order: cudaMemcpyAsync from the (pinned)
 * page into one of `window` device staging buffers (a ring), then ncclSend from it on
 * the channel's stream; a slot is reused (and its page released) once its send event
 * completed. A channel dies on close, abort, error, timeout, or after
 * TQKV_NCCL_IDLE_MS (default 10 min) without a Get; its thread then calls
 * ncclCommAbort and releases every queued page.
 *
 * Client side: tqkv_nccl_comm_join / _recv / _free (rank 1).
 */
#ifndef TQKV_TRANSPORT_NCCL_CHANNEL_H
#define TQKV_TRANSPORT_NCCL_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/status.h"

#define TQKV_NCCL_UID_BYTES 128     /* NCCL_UNIQUE_ID_BYTES */
#define TQKV_NCCL_WINDOW_DEFAULT 4u /* staging buffers (outstanding pages) per channel */
#define TQKV_NCCL_TIMEOUT_MS_DEFAULT 10000u

/* Number of CUDA devices visible (0 when none or the runtime fails). */
int tqkv_nccl_device_count(void);

/* ---- a communicator (either side) ---- */

typedef struct tqkv_nccl_comm tqkv_nccl_comm_t;

/* Joins the 2-rank communicator of uid as rank on device, non-blocking with a
 * timeout (aborted on timeout: TQKV_ETIMEDOUT). Makes a non-blocking stream. */
tqkv_status_t tqkv_nccl_comm_join(const uint8_t uid[TQKV_NCCL_UID_BYTES], int rank, int device,
                                  uint32_t timeout_ms, tqkv_nccl_comm_t **out, char *err,
                                  size_t errlen);
/* ncclRecv of len bytes from the peer into device memory dev, waited for (polled) up
 * to timeout_ms; on timeout or error the communicator is aborted (then unusable). */
tqkv_status_t tqkv_nccl_comm_recv(tqkv_nccl_comm_t *m, void *dev, size_t len, uint32_t timeout_ms,
                                  char *err, size_t errlen);
/* The communicator's cudaStream_t (as void *). */
void *tqkv_nccl_comm_stream(tqkv_nccl_comm_t *m);
/* Aborts (ncclCommAbort) and frees (NULL is a no-op). */
void tqkv_nccl_comm_free(tqkv_nccl_comm_t *m);

/* ---- server channels ---- */

typedef struct tqkv_nccl_chan tqkv_nccl_chan_t;

/* Creates and registers a channel on device: writes its id and unique id and starts
 * its thread (joins as rank 0 within timeout_ms, 0 = default). */
tqkv_status_t tqkv_nccl_chan_open(int device, uint32_t timeout_ms, unsigned window, uint64_t *id,
                                  uint8_t uid[TQKV_NCCL_UID_BYTES], char *err, size_t errlen);
/* Looks a live channel up and takes a reference (NULL: unknown or dead). */
tqkv_nccl_chan_t *tqkv_nccl_chan_get(uint64_t id);
/* Drops a reference from tqkv_nccl_chan_get. */
void tqkv_nccl_chan_put(tqkv_nccl_chan_t *ch);
/* Marks the channel dead and unregisters it; its thread aborts the communicator. */
void tqkv_nccl_chan_abort(tqkv_nccl_chan_t *ch);
/* Aborts channel id. Returns TQKV_ENOTFOUND when unknown. */
tqkv_status_t tqkv_nccl_chan_close(uint64_t id);

/* Server shutdown: aborts every channel (their pending waits give up at once) and
 * waits up to wait_ms for the channel threads to release their pages and exit.
 * Returns how many are still running (their pages stay pinned: do not free the store
 * then). While that is nonzero, channels opened afterwards die at once. */
unsigned tqkv_nccl_chan_close_all(uint32_t wait_ms);

/* Queues one page (host or device memory, len bytes) for ncclSend. release(arg) is
 * called once the bytes were copied out, or when the channel dies. Returns TQKV_OK
 * (queued), TQKV_EBUSY (window full: nothing queued, try tqkv_nccl_chan_wait_room),
 * or TQKV_ECANCELED when the channel is dead (nothing queued, release not called). */
tqkv_status_t tqkv_nccl_chan_send(tqkv_nccl_chan_t *ch, const void *data, size_t len,
                                  void (*release)(void *), void *arg);
/* Returns 0 when there is room (or the channel is dead) now; else registers
 * wake(warg), called exactly once from the channel's thread when room frees or the
 * channel dies, and returns 1. One waiter at a time. */
int tqkv_nccl_chan_wait_room(tqkv_nccl_chan_t *ch, void (*wake)(void *), void *warg);
/* Claims the channel for one Get (pages of two Gets must not interleave). Returns 1
 * when claimed, 0 when another Get holds it. tqkv_nccl_chan_unclaim ends the claim. */
int tqkv_nccl_chan_claim(tqkv_nccl_chan_t *ch);
void tqkv_nccl_chan_unclaim(tqkv_nccl_chan_t *ch);
/* 1 while the channel is alive. */
int tqkv_nccl_chan_alive(tqkv_nccl_chan_t *ch);

#endif
