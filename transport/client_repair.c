/* client_repair.c - libtqkv's read repair: a page a Get found below its block's
 * primaries (after a scale-out or a restart) is queued (bounded in bytes) and put again,
 * as the packed page, to the block's current primaries by one background thread.
 *
 * Calls down into the put sessions (client_put.c) only; client.c starts and stops the
 * thread (tqkv__repair_start / tqkv__repair_stop). Lock: client_shared_t.mu.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transport/client_internal.h"

/* A page of block (ns, hash, layer) was found at rank position > 0 (its primaries
 * missed it: a scale-out or a restart moved them): queue it to be put again, as the
 * packed page, to the block's current primaries. Copies page; drops it when the queue
 * is full. */
void
tqkv__repair_offer(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t layer,
                   const tqkv_block_shape_t *shape, const void *page, size_t len)
{
    client_shared_t *sh = c->sh;
    if (sh->rq_max == 0)
        return;
    pthread_mutex_lock(&sh->mu);
    if (sh->rq_stop || sh->rq_bytes + len > sh->rq_max) {
        sh->rs.dropped++;
        pthread_mutex_unlock(&sh->mu);
        return;
    }
    sh->rq_bytes += len;
    pthread_mutex_unlock(&sh->mu);
    repair_t *r = malloc(sizeof *r + len);
    char *n = strdup(ns);
    if (r == NULL || n == NULL) {
        free(r);
        free(n);
        pthread_mutex_lock(&sh->mu);
        sh->rq_bytes -= len;
        sh->rs.dropped++;
        pthread_mutex_unlock(&sh->mu);
        return;
    }
    r->next = NULL;
    r->ns = n;
    r->hash = *h;
    r->layer = layer;
    r->shape = *shape;
    r->len = len;
    memcpy(r->page, page, len);
    pthread_mutex_lock(&sh->mu);
    if (sh->rq_tail)
        sh->rq_tail->next = r;
    else
        sh->rq_head = r;
    sh->rq_tail = r;
    sh->rs.queued++;
    pthread_cond_broadcast(&sh->rcv);
    pthread_mutex_unlock(&sh->mu);
}

/* Puts the queued pages again, a batch per put session (routed to each block's
 * primaries in the current table; a primary that has it counts a duplicate). */
static void *
repair_main(void *arg)
{
    client_shared_t *sh = arg;
    pthread_mutex_lock(&sh->mu);
    for (;;) {
        while (!sh->rq_stop && sh->rq_head == NULL)
            pthread_cond_wait(&sh->rcv, &sh->mu);
        if (sh->rq_stop)
            break;
        repair_t *batch = sh->rq_head;
        sh->rq_head = sh->rq_tail = NULL;
        sh->rq_busy = 1;
        pthread_mutex_unlock(&sh->mu);
        uint64_t sent = 0, stored = 0, failed = 0;
        size_t bytes = 0;
        tqkv_put_t *p = NULL;
        tqkv_status_t st = tqkv_client_put_begin(sh->root, NULL, &p);
        for (repair_t *r = batch; r; r = r->next) {
            bytes += r->len;
            tqkv_put_block_t b = {.ns = r->ns,
                                  .hash = &r->hash,
                                  .layer = r->layer,
                                  .shape = r->shape,
                                  .page = r->page,
                                  .page_len = r->len};
            if (st == TQKV_OK && tqkv_client_put_block(p, &b) == TQKV_OK)
                sent++;
            else
                failed++;
        }
        if (p) {
            tqkv_put_result_t res;
            if (tqkv_client_put_end(p, &res) == TQKV_OK) {
                stored = res.blocks_stored;
            } else {
                failed += sent;
                sent = 0;
            }
        }
        for (repair_t *r = batch, *nx; r; r = nx) {
            nx = r->next;
            free(r->ns);
            free(r);
        }
        pthread_mutex_lock(&sh->mu);
        sh->rq_bytes -= bytes;
        sh->rs.repaired += sent;
        sh->rs.stored += stored;
        sh->rs.failed += failed;
        sh->rq_busy = 0;
        pthread_cond_broadcast(&sh->rcv);
    }
    pthread_mutex_unlock(&sh->mu);
    return NULL;
}

/* Starts the repair thread of client c when read repair is on (rq_max > 0). */
tqkv_status_t
tqkv__repair_start(tqkv_client_t *c)
{
    if (c->sh->rq_max > 0) {
        if (pthread_create(&c->sh->rq_thread, NULL, repair_main, c->sh) != 0)
            return tqkv__client_err(TQKV_ENOMEM, 0, "cannot start the read repair thread");
        c->sh->rq_started = 1;
    }
    return TQKV_OK;
}

/* Stops the repair thread (if started) and frees what is still queued. */
void
tqkv__repair_stop(client_shared_t *sh)
{
    if (sh->rq_started) {
        pthread_mutex_lock(&sh->mu);
        sh->rq_stop = 1;
        pthread_cond_broadcast(&sh->rcv);
        pthread_mutex_unlock(&sh->mu);
        pthread_join(sh->rq_thread, NULL);
    }
    for (repair_t *r = sh->rq_head, *nx; r; r = nx) {
        nx = r->next;
        free(r->ns);
        free(r);
    }
}

void
tqkv_client_repair_stats(tqkv_client_t *c, tqkv_client_repair_stats_t *out)
{
    memset(out, 0, sizeof *out);
    if (c == NULL)
        return;
    pthread_mutex_lock(&c->sh->mu);
    *out = c->sh->rs;
    out->pending_bytes = c->sh->rq_bytes;
    pthread_mutex_unlock(&c->sh->mu);
}

int
tqkv_client_repair_wait(tqkv_client_t *c, uint32_t timeout_ms)
{
    if (c == NULL)
        return -1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)(timeout_ms % 1000) * 1000000ull;
    ts.tv_sec += (time_t)(timeout_ms / 1000 + ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    client_shared_t *sh = c->sh;
    int rc = 0;
    pthread_mutex_lock(&sh->mu);
    while ((sh->rq_head || sh->rq_busy) && rc == 0)
        rc = pthread_cond_timedwait(&sh->rcv, &sh->mu, &ts);
    int idle = sh->rq_head == NULL && !sh->rq_busy;
    pthread_mutex_unlock(&sh->mu);
    return idle ? 0 : -1;
}
