/* encoder.c - a fixed pool of threads draining one FIFO of jobs.
 *
 * Locking: `mu` protects the queue and `stopping`; `cv` signals work or
 * stop. Jobs run without the lock.
 */
#include "service/encoder.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct job {
    struct job *next;
    tqkv_encoder_fn fn;
    void *arg;
} job_t;

struct tqkv_encoder {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job_t *head, *tail; /* under mu */
    int stopping;       /* under mu */
    unsigned nthreads;
    pthread_t *threads;
};

static void *
encoder_thread(void *p)
{
    tqkv_encoder_t *e = p;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (e->head == NULL && !e->stopping)
            pthread_cond_wait(&e->cv, &e->mu);
        job_t *j = e->head;
        if (j == NULL)
            break; /* stopping and drained */
        e->head = j->next;
        if (e->head == NULL)
            e->tail = NULL;
        pthread_mutex_unlock(&e->mu);
        j->fn(j->arg);
        free(j);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

tqkv_status_t
tqkv_encoder_create(unsigned nthreads, tqkv_encoder_t **out)
{
    tqkv_encoder_t *e = calloc(1, sizeof *e);
    if (e == NULL)
        return TQKV_ENOMEM;
    if (nthreads == 0)
        nthreads = 1;
    e->threads = calloc(nthreads, sizeof *e->threads);
    if (e->threads == NULL)
        goto fail_threads;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    for (unsigned i = 0; i < nthreads; i++) {
        if (pthread_create(&e->threads[i], NULL, encoder_thread, e) != 0) {
            e->nthreads = i;
            tqkv_encoder_destroy(e);
            return TQKV_ENOMEM;
        }
        e->nthreads = i + 1;
    }
    *out = e;
    return TQKV_OK;
fail_threads:
    free(e);
    return TQKV_ENOMEM;
}

tqkv_status_t
tqkv_encoder_submit(tqkv_encoder_t *e, tqkv_encoder_fn fn, void *arg)
{
    job_t *j = malloc(sizeof *j);
    if (j == NULL)
        return TQKV_ENOMEM;
    j->next = NULL;
    j->fn = fn;
    j->arg = arg;
    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        free(j);
        return TQKV_EUNAVAILABLE;
    }
    if (e->tail)
        e->tail->next = j;
    else
        e->head = j;
    e->tail = j;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return TQKV_OK;
}

void
tqkv_encoder_destroy(tqkv_encoder_t *e)
{
    if (e == NULL)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    for (unsigned i = 0; i < e->nthreads; i++)
        pthread_join(e->threads[i], NULL);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e->threads);
    free(e);
}
