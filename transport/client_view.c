/* client_view.c - libtqkv's views of the target table and block placement over them:
 * every entry point runs on a view (a copy of the client whose t/nt/tab are the
 * membership table the call started with); candidates rank a block's targets.
 *
 * Calls nothing in the other client files (membership.h and shard.h only).
 */
#include <string.h>

#include "transport/client_internal.h"

/* A view of client c: a copy whose t/nt/tab are the current table (referenced). */
tqkv_client_t *
tqkv__view_enter(const tqkv_client_t *c, tqkv_client_t *v)
{
    *v = *c;
    v->tab = tqkv_membership_acquire(c->ms);
    v->t = (target_t **)v->tab->users;
    v->nt = v->tab->n;
    v->replicas = c->replicas_opt < v->nt ? c->replicas_opt : (uint32_t)v->nt;
    return v;
}

void
tqkv__view_leave(tqkv_client_t *v)
{
    tqkv_membership_release(v->tab);
}

size_t
tqkv__view_find(const tqkv_client_t *c, const target_t *t)
{
    for (size_t i = 0; i < c->nt; i++)
        if (c->t[i] == t)
            return i;
    return c->nt;
}

uint32_t
tqkv__client_replicas(const tqkv_client_t *c)
{
    if (c == NULL)
        return 0;
    tqkv_client_t v; /* as asked, clamped to the targets of the current table */
    uint32_t r = tqkv__view_enter(c, &v)->replicas;
    tqkv__view_leave(&v);
    return r;
}

/* Candidate targets of a block, best first: cand[0..nc), nc <= RANK_MAX (the best
 * RANK_MAX of any number of targets). Ranked by the servers' node ids. */
size_t
tqkv__candidates(tqkv_client_t *c, const char *ns, const tqkv_hash_t *h, uint32_t *cand)
{
    if (c->nt == 1) {
        cand[0] = 0;
        return 1;
    }
    uint64_t key = tqkv_shard_block_key(ns, h->bytes, h->len);
    size_t k = c->nt < RANK_MAX ? c->nt : RANK_MAX;
    return tqkv_shard_top_index(c->tab->rank_index, &c->tab->s[0].rank_id, sizeof c->tab->s[0],
                                c->nt, key, k, cand);
}

/* How many rank positions Get and Lookup ask: the R replicas plus one more, where a
 * Put lands while one of the R was down. */
size_t
tqkv__read_candidates(tqkv_client_t *c)
{
    size_t n = (size_t)c->replicas + 1;
    return n < c->nt ? n : c->nt;
}

int
tqkv__hash_ok(const tqkv_hash_t *h)
{
    return h && h->len >= 8 && h->len <= TQKV_HASH_MAX;
}
