/* shard.c - rendezvous hashing of blocks over targets, and per-target back-off. */
#include "transport/shard.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t
mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t
fnv1a(uint64_t h, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

uint64_t
tqkv_shard_target_id(const char *name)
{
    const uint8_t *p = (const uint8_t *)name;
    size_t n = 0;
    while (p[n])
        n++;
    return mix64(fnv1a(0xcbf29ce484222325ull, p, n));
}

uint64_t
tqkv_shard_block_key(const char *ns, const uint8_t *hash, size_t hash_len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    size_t n = 0;
    while (ns && ns[n])
        n++;
    h = fnv1a(h, (const uint8_t *)ns, n);
    h = fnv1a(h, (const uint8_t *)"\0", 1); /* separates ("ab","c") from ("a","bc") */
    h = fnv1a(h, hash, hash_len);
    return mix64(h);
}

uint64_t
tqkv_shard_score(uint64_t target_id, uint64_t block_key)
{
    return mix64(target_id ^ mix64(block_key));
}

/* ---- flat rendezvous: every target scored (n <= TQKV_SHARD_FLAT_MAX) ---- */

static void
rank_flat(const uint64_t *ids, size_t n, uint64_t block_key, uint32_t *order)
{
    /* Insertion sort by score, best first: n is the number of servers (small). */
    for (size_t i = 0; i < n; i++) {
        uint64_t s = tqkv_shard_score(ids[i], block_key);
        size_t j = i;
        while (j > 0 && tqkv_shard_score(ids[order[j - 1]], block_key) < s) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = (uint32_t)i;
    }
}

#define ID_AT(base, stride, i)                                                                     \
    (*(const uint64_t *)(const void *)((const char *)(base) + (i) * (stride)))

/* Offers target i with score s to the best k so far (best[base..have), descending; ties
 * keep the earlier offer, as tqkv_shard_rank). Returns the new have. */
static inline size_t
offer(uint64_t *best, uint32_t *order, size_t base, size_t have, size_t k, uint64_t s, uint32_t i)
{
    if (have == k && s <= best[k - 1])
        return have;
    size_t j = have < k ? have++ : k - 1;
    while (j > base && best[j - 1] < s) {
        best[j] = best[j - 1];
        order[j] = order[j - 1];
        j--;
    }
    best[j] = s;
    order[j] = i;
    return have;
}

/* k clamped to n and to the 256 scores the callers keep. */
static size_t
clamp_k(size_t k, size_t n)
{
    return k > n ? (n > 256 ? 256 : n) : (k > 256 ? 256 : k);
}

/* The best k of targets i in [0, n) with keep(i), appended to order[have..k), scores in
 * best[]: one score per kept target and a partial insertion. Returns the new have. */
static size_t
top_flat(const uint64_t *ids_base, size_t stride, size_t n, uint64_t mk, size_t k, uint32_t *order,
         uint64_t *best, size_t have, int group)
{
    size_t base = have;
    for (size_t i = 0; i < n; i++) {
        uint64_t id = ID_AT(ids_base, stride, i);
        if (group >= 0 && (int)(id >> (64 - TQKV_SHARD_GROUP_BITS)) != group)
            continue;
        have = offer(best, order, base, have, k, mix64(id ^ mk), (uint32_t)i);
    }
    return have;
}

/* ---- two-level rendezvous (n > TQKV_SHARD_FLAT_MAX) ----
 *
 * A target belongs to group id >> (64 - TQKV_SHARD_GROUP_BITS) (its id's top bits: fixed
 * for life, whatever the cluster size). A block ranks the non-empty groups by weighted
 * rendezvous (score w / -ln(u), w = the group's targets, u uniform in (0, 1) from the
 * block and the group: a group wins with probability w / n, so every target keeps a
 * 1/n share), then the targets of a group by plain rendezvous. One pass counts the
 * groups (cheap: a shift and an increment per target), then only the winning group's
 * targets are scored: O(n) loads + O(G + n / G) hashes instead of O(n) hashes. */

/* -ln(x) for x in (0, 1): x = m * 2^e with m in [sqrt(1/2), sqrt(2)), ln(m) from the
 * series 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172, to t^9 (relative error below
 * 1e-9). Plain IEEE double operations in a fixed order (the build has no FP contraction),
 * so every client computes the same bits, unlike a libm log whose last bit may differ
 * between versions; and several times faster. */
static double
neg_ln(double x)
{
    uint64_t b;
    memcpy(&b, &x, sizeof b);
    int e = (int)((b >> 52) & 0x7ff) - 1022;
    b = (b & 0x000fffffffffffffull) | 0x3fe0000000000000ull; /* m in [0.5, 1) */
    double m;
    memcpy(&m, &b, sizeof m);
    if (m < 0.70710678118654752) {
        m *= 2.0;
        e -= 1;
    }
    double t = (m - 1.0) / (m + 1.0), t2 = t * t;
    double p = 1.0 + t2 * (1.0 / 3 + t2 * (1.0 / 5 + t2 * (1.0 / 7 + t2 * (1.0 / 9))));
    return -((double)e * 0.69314718055994531 + 2.0 * t * p);
}

static uint64_t
group_id(uint32_t g)
{
    return mix64(0x7471b0c9a1e5f3d1ull + g);
}

/* Weighted rendezvous score of group gid (w targets) for a block's mixed key mk. */
static double
group_score(uint64_t gid, uint32_t w, uint64_t mk)
{
    uint64_t u = mix64(gid ^ mk);
    double x = ((double)(u >> 11) + 0.5) * (1.0 / 9007199254740992.0); /* (0, 1) */
    return (double)w / neg_ln(x);
}

/* Groups of n targets in weighted-rendezvous order for mk: writes the non-empty groups,
 * best first, into gorder and returns their number. cnt[g]: targets of group g. */
static size_t
rank_groups(const uint64_t *ids_base, size_t stride, size_t n, uint64_t mk,
            uint32_t cnt[TQKV_SHARD_GROUPS], uint32_t gorder[TQKV_SHARD_GROUPS])
{
    double gs[TQKV_SHARD_GROUPS];
    memset(cnt, 0, TQKV_SHARD_GROUPS * sizeof *cnt);
    for (size_t i = 0; i < n; i++)
        cnt[ID_AT(ids_base, stride, i) >> (64 - TQKV_SHARD_GROUP_BITS)]++;
    size_t ng = 0;
    for (uint32_t g = 0; g < TQKV_SHARD_GROUPS; g++) {
        if (cnt[g] == 0)
            continue;
        double sc = group_score(group_id(g), cnt[g], mk);
        size_t j = ng++;
        while (j > 0 && gs[j - 1] < sc) { /* ties: the lower group first */
            gs[j] = gs[j - 1];
            gorder[j] = gorder[j - 1];
            j--;
        }
        gs[j] = sc;
        gorder[j] = g;
    }
    return ng;
}

static size_t
top_groups(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key, size_t k,
           uint32_t *order, uint64_t *best)
{
    uint32_t cnt[TQKV_SHARD_GROUPS], gorder[TQKV_SHARD_GROUPS];
    uint64_t mk = mix64(block_key);
    size_t ng = rank_groups(ids_base, stride, n, mk, cnt, gorder);
    size_t have = 0;
    for (size_t gi = 0; gi < ng && have < k; gi++)
        have = top_flat(ids_base, stride, n, mk, k, order, best, have, (int)gorder[gi]);
    return have;
}

void
tqkv_shard_rank(const uint64_t *ids, size_t n, uint64_t block_key, uint32_t *order)
{
    if (n <= TQKV_SHARD_FLAT_MAX) {
        rank_flat(ids, n, block_key, order);
        return;
    }
    uint32_t cnt[TQKV_SHARD_GROUPS], gorder[TQKV_SHARD_GROUPS];
    uint64_t mk = mix64(block_key);
    size_t ng = rank_groups(ids, sizeof *ids, n, mk, cnt, gorder);
    size_t have = 0;
    for (size_t gi = 0; gi < ng; gi++) { /* each group's targets by insertion, in place */
        size_t base = have;
        for (size_t i = 0; i < n; i++) {
            if ((ids[i] >> (64 - TQKV_SHARD_GROUP_BITS)) != gorder[gi])
                continue;
            uint64_t s = mix64(ids[i] ^ mk);
            size_t j = have++;
            while (j > base && mix64(ids[order[j - 1]] ^ mk) < s) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = (uint32_t)i;
        }
    }
}

/* tqkv_shard_top (grouped: by groups past TQKV_SHARD_FLAT_MAX ids) and
 * tqkv_shard_top_flat. */
static size_t
top_any(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key, size_t k,
        uint32_t *order, int grouped)
{
    uint64_t best[256];
    k = clamp_k(k, n);
    if (grouped && n > TQKV_SHARD_FLAT_MAX)
        return top_groups(ids_base, stride, n, block_key, k, order, best);
    return top_flat(ids_base, stride, n, mix64(block_key), k, order, best, 0, -1);
}

size_t
tqkv_shard_top(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key, size_t k,
               uint32_t *order)
{
    return top_any(ids_base, stride, n, block_key, k, order, 1);
}

struct tqkv_shard_index {
    size_t n;
    uint32_t start[TQKV_SHARD_GROUPS + 1]; /* group g: member[start[g] .. start[g + 1]) */
    uint64_t gid[TQKV_SHARD_GROUPS];       /* group_id(g) */
    uint32_t member[];                     /* target indices by group, ascending in each */
};

tqkv_shard_index_t *
tqkv_shard_index_create(const uint64_t *ids_base, size_t stride, size_t n)
{
    if (n <= TQKV_SHARD_FLAT_MAX || n > UINT32_MAX)
        return NULL;
    tqkv_shard_index_t *ix = malloc(sizeof *ix + n * sizeof ix->member[0]);
    if (ix == NULL)
        return NULL;
    ix->n = n;
    uint32_t cnt[TQKV_SHARD_GROUPS + 1];
    memset(cnt, 0, sizeof cnt);
    for (size_t i = 0; i < n; i++)
        cnt[(ID_AT(ids_base, stride, i) >> (64 - TQKV_SHARD_GROUP_BITS)) + 1]++;
    for (uint32_t g = 0; g < TQKV_SHARD_GROUPS; g++)
        cnt[g + 1] += cnt[g];
    memcpy(ix->start, cnt, sizeof ix->start);
    for (uint32_t g = 0; g < TQKV_SHARD_GROUPS; g++)
        ix->gid[g] = group_id(g);
    for (size_t i = 0; i < n; i++)
        ix->member[cnt[ID_AT(ids_base, stride, i) >> (64 - TQKV_SHARD_GROUP_BITS)]++] = (uint32_t)i;
    return ix;
}

void
tqkv_shard_index_destroy(tqkv_shard_index_t *ix)
{
    free(ix);
}

size_t
tqkv_shard_top_index(const tqkv_shard_index_t *ix, const uint64_t *ids_base, size_t stride,
                     size_t n, uint64_t block_key, size_t k, uint32_t *order)
{
    if (ix == NULL || ix->n != n)
        return tqkv_shard_top(ids_base, stride, n, block_key, k, order);
    uint64_t best[256];
    k = clamp_k(k, n);
    uint64_t mk = mix64(block_key);
    /* The groups by weighted rendezvous, as rank_groups (from the index's counts), taken
     * best first as needed: mostly one group holds all k (no sort of all G). */
    double gs[TQKV_SHARD_GROUPS];
    for (uint32_t g = 0; g < TQKV_SHARD_GROUPS; g++) {
        uint32_t w = ix->start[g + 1] - ix->start[g];
        gs[g] = w ? group_score(ix->gid[g], w, mk) : -1.0;
    }
    size_t have = 0;
    while (have < k) {
        uint32_t bg = 0;
        for (uint32_t g = 1; g < TQKV_SHARD_GROUPS; g++)
            if (gs[g] > gs[bg]) /* ties: the lower group first */
                bg = g;
        if (gs[bg] < 0)
            break;
        gs[bg] = -1.0;
        size_t base = have;
        for (uint32_t m = ix->start[bg]; m < ix->start[bg + 1]; m++) {
            uint32_t i = ix->member[m];
            have = offer(best, order, base, have, k, mix64(ID_AT(ids_base, stride, i) ^ mk), i);
        }
    }
    return have;
}

size_t
tqkv_shard_top_flat(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key, size_t k,
                    uint32_t *order)
{
    return top_any(ids_base, stride, n, block_key, k, order, 0);
}

void
tqkv_shard_health_init(tqkv_shard_health_t *h)
{
    atomic_init(&h->down_until_ns, 0);
    atomic_init(&h->backoff_ms, 0);
    atomic_init(&h->failures, 0);
}

int
tqkv_shard_health_usable(tqkv_shard_health_t *h, uint64_t now_ns)
{
    uint64_t until = atomic_load_explicit(&h->down_until_ns, memory_order_acquire);
    return until == 0 || now_ns >= until;
}

void
tqkv_shard_health_fail(tqkv_shard_health_t *h, uint64_t now_ns, uint32_t min_ms, uint32_t max_ms)
{
    uint32_t b = atomic_load(&h->backoff_ms);
    if (b < min_ms)
        b = min_ms;
    if (b > max_ms)
        b = max_ms;
    atomic_store(&h->down_until_ns, now_ns + (uint64_t)b * 1000000ull);
    uint32_t next = b > max_ms / 2 ? max_ms : b * 2;
    atomic_store(&h->backoff_ms, next);
    atomic_fetch_add(&h->failures, 1);
}

void
tqkv_shard_health_ok(tqkv_shard_health_t *h, uint32_t min_ms)
{
    if (atomic_load_explicit(&h->down_until_ns, memory_order_relaxed) != 0)
        atomic_store(&h->down_until_ns, 0);
    if (atomic_load_explicit(&h->backoff_ms, memory_order_relaxed) != min_ms)
        atomic_store(&h->backoff_ms, min_ms);
}

#define HEALTH_DOWN UINT64_MAX /* down_until_ns of a target down until it answers */

void
tqkv_shard_health_down(tqkv_shard_health_t *h)
{
    atomic_store(&h->down_until_ns, HEALTH_DOWN);
}

int
tqkv_shard_health_is_down(tqkv_shard_health_t *h)
{
    return atomic_load_explicit(&h->down_until_ns, memory_order_acquire) == HEALTH_DOWN;
}
