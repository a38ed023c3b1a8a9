/* shard.c - rendezvous hashing of blocks over targets, and per-target back-off. */
#include "transport/shard.h"

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

void
tqkv_shard_rank(const uint64_t *ids, size_t n, uint64_t block_key, uint32_t *order)
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

size_t
tqkv_shard_top(const uint64_t *ids_base, size_t stride, size_t n, uint64_t block_key, size_t k,
               uint32_t *order)
{
    uint64_t best[256];
    if (k > n)
        k = n;
    if (k > sizeof best / sizeof best[0])
        k = sizeof best / sizeof best[0];
    size_t have = 0;
    uint64_t mk = mix64(block_key);
    for (size_t i = 0; i < n; i++) {
        uint64_t id = *(const uint64_t *)(const void *)((const char *)ids_base + i * stride);
        uint64_t s = mix64(id ^ mk);
        if (have == k && s <= best[k - 1])
            continue; /* ties keep the lower index, as tqkv_shard_rank */
        size_t j = have < k ? have++ : k - 1;
        while (j > 0 && best[j - 1] < s) {
            best[j] = best[j - 1];
            order[j] = order[j - 1];
            j--;
        }
        best[j] = s;
        order[j] = (uint32_t)i;
    }
    return have;
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

uint64_t
tqkv_shard_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
