/* check_client_adversarial.c - libtqkv used as a C programmer new to it would (labels
 * "server;fault"): NULL and zero arguments to every public function, duplicate and
 * unresolvable targets, a target that refuses connections among several, one that
 * stalls (SIGSTOP) with a client that gives it time, servers SIGKILLed in the middle of
 * a Get or a Put session and restarted on the same port, callbacks that stop a Get,
 * Gets of many hashes x layers, sessions left open. Each must end with a clear status
 * and message, in time, with the right bytes.
 *
 * Every test starts its own servers (fork/exec, free port) in a checked fixture.
 */
#include <check.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kernels/page.h"
#include "tests/check_main.h"
#include "transport/client.h"

#include "tests/support/kv_data.h"
#include "tests/support/ports.h"
#include "tests/support/server_proc.h"

static srv_t S, S2;
static uint64_t SEED;
/* The block shape (a test may make it larger: each runs in its own process). */
static tqkv_block_shape_t SH = {16, 2, 64};
#define NELMAX ((size_t)256 * 4 * 128)
#define NEL ((size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim)
static uint16_t BK[NELMAX], BV[NELMAX], DK[NELMAX], DV[NELMAX];

static void
setup(void)
{
    SEED = tqkv_test_seed();
    /* test_restart_same_port restarts it on its port: one from outside the ephemeral
     * range, so no connection can take it in between (tests/support/ports.h). */
    int port = tqkv_test_free_port(0);
    ck_assert_int_gt(port, 0);
    ck_assert_msg(srv_start(&S, port, NULL) == 0, "cannot start tqkv-server");
    memset(&S2, 0, sizeof S2);
}

static void
teardown(void)
{
    srv_stop(&S);
    srv_stop(&S2);
}

/* The targets these tests make fail refuse connections or are killed: they fail at
 * once. A live server must not: a connection attempt gets 30 s (not the default 1 s of
 * a client with several targets) and no keepalive pings, so a server or this process
 * stalled for a second on a loaded machine is not judged down (its blocks would go to
 * fewer replicas than a test asserts). Failure detection by time is member_blackhole's. */
static tqkv_client_t *
client_of(const char *const *targets, size_t n, uint32_t replicas, uint32_t deadline_ms, int wfr)
{
    tqkv_client_opts_t o = {.struct_size = sizeof(tqkv_client_opts_t),
                            .targets = targets,
                            .num_targets = n,
                            .replicas = replicas,
                            .deadline_ms = deadline_ms,
                            .wait_for_ready = wfr,
                            .backoff_min_ms = 50,
                            .backoff_max_ms = 200,
                            .connect_timeout_ms = 30000,
                            .keepalive_ms = UINT32_MAX};
    tqkv_client_t *c = NULL;
    tqkv_status_t st = tqkv_client_create(&o, &c);
    ck_assert_msg(st == TQKV_OK, "create: %s", tqkv_client_last_error()->message);
    return c;
}

/* A port on 127.0.0.1 with nothing listening (from outside the ephemeral range, so no
 * other test's server can be listening there: tests/support/ports.h). */
static int
dead_port(void)
{
    int p = tqkv_test_free_port(0);
    ck_assert_int_gt(p, 0);
    return p;
}

/* Data of block (b, l), reproducible from the seed. */
static void
block_data(uint64_t seed, size_t b, uint32_t l, uint16_t *k, uint16_t *v)
{
    uint64_t s = seed * 7919u + b * 131u + l;
    tqkv_test_bf16_fill(&s, k, NEL, SH.head_dim);
    tqkv_test_bf16_fill(&s, v, NEL, SH.head_dim);
}

/* Puts nb blocks x L layers of namespace ns. Returns put_end's status (*res filled). */
static tqkv_status_t
put_all(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nb, uint32_t L,
        tqkv_put_result_t *res)
{
    uint16_t *k = BK, *v = BV;
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
    tqkv_put_t *p;
    ck_assert_int_eq(tqkv_client_put_begin(c, &po, &p), TQKV_OK);
    for (size_t b = 0; b < nb; b++)
        for (uint32_t l = 0; l < L; l++) {
            block_data(SEED, b, l, k, v);
            tqkv_put_block_t pb = {.ns = ns,
                                   .hash = &hs[b],
                                   .parent = b ? &hs[b - 1] : NULL,
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = SH,
                                   .key = k,
                                   .value = v};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            if (st != TQKV_OK) {
                tqkv_client_put_abort(p);
                return st;
            }
        }
    return tqkv_client_put_end(p, res);
}

/* Get callback state: checks every found page against the data put. */
typedef struct chk {
    size_t nh;
    uint32_t L;
    int encoding;
    const size_t *map; /* block put as hashes[i] is block map[i] (NULL: i) */
    size_t found, missing, calls, bad, dup;
    uint8_t *seen;
    double max_err;
    size_t stop_after; /* return non-zero at this call (0: never) */
    srv_t *kill_at;    /* SIGKILL this server at call kill_after */
    size_t kill_after;
} chk_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    chk_t *c = arg;
    c->calls++;
    if (pg->hash_index >= c->nh || pg->layer >= c->L) {
        c->bad++;
        return 0;
    }
    size_t slot = pg->hash_index * c->L + pg->layer;
    if (c->seen[slot]++)
        c->dup++;
    if (pg->found && c->encoding == TQKV_CLIENT_BF16) {
        c->found++;
        block_data(SEED, c->map ? c->map[pg->hash_index] : pg->hash_index, pg->layer, BK, BV);
        if (pg->key_len != NEL * 2 || pg->value_len != NEL * 2)
            c->bad++;
        else
            c->max_err = fmax(c->max_err, fmax(tqkv_test_bf16_rel_err(BK, pg->key, NEL),
                                               tqkv_test_bf16_rel_err(BV, pg->value, NEL)));
    } else if (pg->found) {
        uint16_t *k = BK, *v = BV, *dk = DK, *dv = DV;
        c->found++;
        block_data(SEED, c->map ? c->map[pg->hash_index] : pg->hash_index, pg->layer, k, v);
        tqkv_block_shape_t got;
        if (!pg->crc_checked ||
            tqkv_client_decode_page(pg->page, pg->page_len, dk, dv, &got) != TQKV_OK ||
            got.num_tokens != SH.num_tokens || got.num_kv_heads != SH.num_kv_heads) {
            c->bad++;
        } else {
            double e = fmax(tqkv_test_bf16_rel_err(k, dk, NEL), tqkv_test_bf16_rel_err(v, dv, NEL));
            c->max_err = fmax(c->max_err, e);
        }
    } else {
        c->missing++;
    }
    if (c->kill_at && c->calls == c->kill_after) {
        srv_kill(c->kill_at, SIGKILL);
        srv_wait(c->kill_at, 10);
    }
    return c->stop_after && c->calls >= c->stop_after;
}

static tqkv_status_t
get_all(tqkv_client_t *c, const char *ns, const tqkv_hash_t *hs, size_t nh, uint32_t L, chk_t *ck)
{
    tqkv_get_req_t q = {.ns = ns,
                        .hashes = hs,
                        .num_hashes = nh,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = ck->encoding};
    ck->nh = nh;
    ck->L = L;
    ck->seen = calloc(nh * L, 1);
    ck_assert_ptr_nonnull(ck->seen);
    return tqkv_client_get(c, &q, on_page, ck);
}

static void
chk_free(chk_t *c)
{
    free(c->seen);
    c->seen = NULL;
}

static void
hashes(tqkv_hash_t *hs, size_t n, uint64_t salt)
{
    for (size_t i = 0; i < n; i++)
        tqkv_test_hash(&hs[i], SEED ^ salt, i, (uint8_t)(8 + i % 57));
}

static void
assert_msg_has(const char *what)
{
    const char *m = tqkv_client_last_error()->message;
    ck_assert_msg(strstr(m, what) != NULL, "last error '%s' does not mention '%s'", m, what);
}

/* NULL where a pointer is required, zero counts: TQKV_EINVAL and a message naming the
 * argument, never a crash (every one of these dereferenced NULL). */
START_TEST(test_null_arguments)
{
    const char *t[1] = {S.addr};
    tqkv_client_opts_t o = {.targets = t, .num_targets = 1};
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 1);
    tqkv_put_t *p = (tqkv_put_t *)&o;
    uint32_t prefix = 7;
    uint64_t pd = 7, bf = 7;
    int serving = 7;
    tqkv_hash_t h;
    chk_t ck = {0};
    tqkv_put_result_t res;
    tqkv_client_stats_t sst;
    tqkv_channel_t *ch = NULL;
    tqkv_test_hash(&h, SEED, 1, 16);

    ck_assert_int_eq(tqkv_client_create(&o, NULL), TQKV_EINVAL);
    assert_msg_has("out");
    ck_assert_uint_eq(tqkv_client_num_targets(NULL), 0);
    ck_assert_ptr_null(tqkv_client_target_name(NULL, 0));
    ck_assert_ptr_null(tqkv_client_target_name(c, 1));

    ck_assert_int_eq(tqkv_client_put_begin(NULL, NULL, &p), TQKV_EINVAL);
    ck_assert_ptr_null(p);
    ck_assert_int_eq(tqkv_client_put_begin(c, NULL, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_put_block(NULL, NULL), TQKV_EINVAL);
    assert_msg_has("session");
    memset(&res, 0xff, sizeof res);
    ck_assert_int_eq(tqkv_client_put_end(NULL, &res), TQKV_EINVAL);
    ck_assert_uint_eq(res.blocks_sent, 0);
    tqkv_client_put_abort(NULL);

    tqkv_lookup_req_t lq = {.ns = "n", .hashes = &h, .num_hashes = 1, .num_layers = 1};
    ck_assert_int_eq(tqkv_client_lookup(NULL, &lq, &prefix, NULL), TQKV_EINVAL);
    ck_assert_uint_eq(prefix, 0);
    ck_assert_int_eq(tqkv_client_lookup(c, NULL, &prefix, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, NULL, NULL), TQKV_EINVAL);
    assert_msg_has("prefix_blocks");
    lq.hashes = NULL;
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, NULL), TQKV_EINVAL);
    assert_msg_has("hashes");
    lq.num_hashes = 0; /* nothing asked: nothing found, not an error */
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, NULL), TQKV_OK);
    ck_assert_uint_eq(prefix, 0);

    tqkv_get_req_t q = {.ns = "n", .hashes = NULL, .num_hashes = 3, .layer_end = 1};
    ck_assert_int_eq(tqkv_client_get(NULL, &q, on_page, &ck), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_get(c, NULL, on_page, &ck), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_get(c, &q, on_page, &ck), TQKV_EINVAL);
    assert_msg_has("hashes");
    q.hashes = &h;
    q.num_hashes = 1;
    ck_assert_int_eq(tqkv_client_get(c, &q, NULL, NULL), TQKV_EINVAL);
    assert_msg_has("callback");
    ck_assert_int_eq(tqkv_client_get_nccl(NULL, NULL, &q, NULL, 0, 0, NULL, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_get_nccl(c, NULL, NULL, NULL, 0, 0, NULL, NULL), TQKV_EINVAL);

    ck_assert_int_eq(tqkv_client_delete(NULL, "n", &h, 1, 0, &pd, &bf), TQKV_EINVAL);
    ck_assert_uint_eq(pd, 0);
    ck_assert_uint_eq(bf, 0);
    ck_assert_int_eq(tqkv_client_delete(c, "n", NULL, 2, 0, NULL, NULL), TQKV_EINVAL);
    assert_msg_has("hashes");
    ck_assert_int_eq(tqkv_client_stats(NULL, "", &sst), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_stats(c, "", NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_health(NULL, 0, NULL, &serving), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_health(c, 0, NULL, NULL), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_health(c, 5, NULL, &serving), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_open_channel(NULL, 0, 0, 0, &ch), TQKV_EINVAL);
    ck_assert_int_eq(tqkv_client_open_channel(c, 0, 0, 0, NULL), TQKV_EINVAL);
    tqkv_client_close_channel(c, NULL);

    /* consumer helpers: a status and a message naming the problem */
    ck_assert_int_eq(tqkv_client_decode_page(NULL, 0, NULL, NULL, NULL), TQKV_EFORMAT);
    float qv[128], out[128];
    memset(qv, 0, sizeof qv);
    ck_assert_int_eq(tqkv_client_attend(qv, 2, NULL, NULL, 0, out), TQKV_EINVAL);
    assert_msg_has("no pages");
    ck_assert_int_eq(tqkv_client_attend(NULL, 2, NULL, NULL, 0, out), TQKV_EINVAL);
    assert_msg_has("NULL query");
    ck_assert_int_eq(tqkv_client_get_attend(c, "n", &h, 0, 0, 0, qv, 2, out), TQKV_EINVAL);
    assert_msg_has("no hashes");
    ck_assert_int_eq(tqkv_client_get_attend(c, "n", &h, 1, UINT32_MAX, 0, qv, 2, out), TQKV_EINVAL);
    assert_msg_has("layer");

    /* the client still works after all of that */
    ck_assert_int_eq(tqkv_client_health(c, 0, NULL, &serving), TQKV_OK);
    ck_assert_int_eq(serving, 1);
    tqkv_client_destroy(c);
}
END_TEST

/* The same server named twice: with R = 2 both "replicas" went to one server, so
 * losing it lost every copy while the caller believed it had two. */
START_TEST(test_duplicate_targets)
{
    const char *t[3] = {S.addr, "127.0.0.1:1", S.addr};
    tqkv_client_opts_t o = {.targets = t, .num_targets = 3, .replicas = 2};
    tqkv_client_t *c = (tqkv_client_t *)&o;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    ck_assert_ptr_null(c);
    assert_msg_has("duplicate target");
    assert_msg_has(S.addr);
    /* empty and NULL names, and more than the maximum */
    const char *e[2] = {S.addr, ""};
    o.targets = e;
    o.num_targets = 2;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    assert_msg_has("empty target");
    e[1] = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_EINVAL);
    /* no cap on the number of targets (hundreds of pods behind one name) */
    static char names[100][32];
    const char *many[100];
    for (size_t i = 0; i < 100; i++) {
        snprintf(names[i], sizeof names[i], "127.0.0.1:%zu", 1000 + i);
        many[i] = names[i];
    }
    o.targets = many;
    o.num_targets = 100;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    ck_assert_uint_eq(tqkv_client_num_targets(c), 100);
    tqkv_client_destroy(c);
    /* distinct names are fine, and replicas beyond the targets are clamped */
    c = client_of(t, 2, 5, 5000, 0);
    ck_assert_uint_eq(tqkv_client_num_targets(c), 2);
    tqkv_client_destroy(c);
}
END_TEST

/* A name that does not resolve: calls fail UNAVAILABLE well within their deadline,
 * naming the target; with a live second target the Put lands there. */
START_TEST(test_unresolvable_target)
{
    const char *bad = "tqkv-no-such-host.invalid:50051";
    const char *t1[1] = {bad};
    tqkv_client_t *c = client_of(t1, 1, 1, 3000, 0);
    tqkv_hash_t hs[2];
    hashes(hs, 2, 11);
    chk_t ck = {0};
    uint32_t prefix;
    double t0 = proc_now();
    tqkv_status_t st = get_all(c, "u", hs, 2, 2, &ck);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ETIMEDOUT, "get: %s", tqkv_status_name(st));
    assert_msg_has("tqkv-no-such-host.invalid");
    ck_assert_uint_eq(ck.calls, 0);
    chk_free(&ck);
    tqkv_lookup_req_t lq = {.ns = "u", .hashes = hs, .num_hashes = 2, .num_layers = 1};
    st = tqkv_client_lookup(c, &lq, &prefix, NULL);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ETIMEDOUT, "lookup: %s",
                  tqkv_status_name(st));
    ck_assert_msg(proc_now() - t0 < 8, "took %.1f s", proc_now() - t0);
    tqkv_client_destroy(c);

    const char *t2[2] = {bad, S.addr};
    c = client_of(t2, 2, 1, 3000, 0);
    tqkv_put_result_t r;
    st = put_all(c, "u", hs, 2, 2, &r);
    ck_assert_msg(st == TQKV_OK, "put: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_stored + r.blocks_duplicate, 4);
    memset(&ck, 0, sizeof ck);
    st = get_all(c, "u", hs, 2, 2, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.found, 4);
    ck_assert_uint_eq(ck.bad + ck.dup, 0);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* One of three targets refuses connections: Put with R = 2 stores two copies on the
 * live ones, Get finds every block with the right bytes, each exactly once. */
START_TEST(test_refusing_target_among_several)
{
    char dead[64];
    snprintf(dead, sizeof dead, "127.0.0.1:%d", dead_port());
    ck_assert_int_eq(srv_start(&S2, 0, NULL), 0);
    const char *t[3] = {S.addr, dead, S2.addr};
    tqkv_client_t *c = client_of(t, 3, 2, 5000, 0);
    enum { NB = 24, L = 2 };
    tqkv_hash_t hs[NB];
    hashes(hs, NB, 21);
    tqkv_put_result_t r;
    tqkv_status_t st = put_all(c, "r", hs, NB, L, &r);
    ck_assert_msg(st == TQKV_OK, "put: %s", tqkv_client_last_error()->message);
    tqkv_client_health_stats_t hst;
    ck_assert_int_eq(tqkv_client_health_stats(c, &hst), TQKV_OK);
    ck_assert_msg(r.blocks_stored == 2 * NB * L && r.blocks_lost == 0,
                  "stored %llu of %d (sent %llu, lost %llu; servers marked down %llu): %s",
                  (unsigned long long)r.blocks_stored, 2 * NB * L,
                  (unsigned long long)r.blocks_sent, (unsigned long long)r.blocks_lost,
                  (unsigned long long)hst.marked_down, tqkv_client_last_error()->message);
    chk_t ck = {0};
    st = get_all(c, "r", hs, NB, L, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.found, NB * L);
    ck_assert_uint_eq(ck.bad + ck.dup + ck.missing, 0);
    ck_assert_msg(ck.max_err < 0.2, "max rel err %g", ck.max_err);
    chk_free(&ck);
    /* and with one live server killed too, each block still has a copy */
    srv_kill(&S2, SIGKILL);
    ck_assert_int_eq(srv_wait(&S2, 10), 0);
    memset(&ck, 0, sizeof ck);
    st = get_all(c, "r", hs, NB, L, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.found, NB * L);
    ck_assert_uint_eq(ck.bad + ck.dup, 0);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* SIGCONTs pid after ms milliseconds (a thread: the test thread is inside a Put). */
typedef struct resume {
    pid_t pid;
    unsigned ms;
} resume_t;

static void *
resume_later(void *arg)
{
    resume_t *r = arg;
    usleep(r->ms * 1000u);
    kill(r->pid, SIGCONT);
    return NULL;
}

/* A live server stalls for 1.5 s (SIGSTOP: a loaded machine, a paused pod) while a Put
 * streams to it, with a client that gives servers time (client_of: 30 s to connect, no
 * keepalive pings). The Put waits for it: both copies stored, nobody marked down. With
 * the defaults (1 s to connect, pings after 300 ms unanswered for 700 ms) the same stall
 * marks it down and its copies are lost: what the refusing-target test met once. */
START_TEST(test_stalled_target_waited_for)
{
    ck_assert_int_eq(srv_start(&S2, 0, NULL), 0);
    const char *t[2] = {S.addr, S2.addr};
    tqkv_client_t *c = client_of(t, 2, 2, 20000, 0);
    enum { NB = 24, L = 2 };
    tqkv_hash_t hs[NB];
    hashes(hs, NB, 23);
    resume_t rs = {S2.pid, 1500};
    pthread_t th;
    ck_assert_int_eq(kill(S2.pid, SIGSTOP), 0);
    ck_assert_int_eq(pthread_create(&th, NULL, resume_later, &rs), 0);
    tqkv_put_result_t r;
    tqkv_status_t st = put_all(c, "s", hs, NB, L, &r);
    pthread_join(th, NULL);
    ck_assert_msg(st == TQKV_OK, "put: %s", tqkv_client_last_error()->message);
    tqkv_client_health_stats_t hst;
    ck_assert_int_eq(tqkv_client_health_stats(c, &hst), TQKV_OK);
    ck_assert_msg(r.blocks_stored == 2 * NB * L && r.blocks_lost == 0 && hst.marked_down == 0,
                  "stored %llu of %d (sent %llu, lost %llu; servers marked down %llu)",
                  (unsigned long long)r.blocks_stored, 2 * NB * L,
                  (unsigned long long)r.blocks_sent, (unsigned long long)r.blocks_lost,
                  (unsigned long long)hst.marked_down);
    chk_t ck = {0};
    st = get_all(c, "s", hs, NB, L, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.found, NB * L);
    ck_assert_uint_eq(ck.bad + ck.dup + ck.missing, 0);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* The only server SIGKILLed from inside the Get callback: the Get ends with an error
 * (not success with pages silently missing) in time; what was delivered is right.
 * BF16 blocks of 512 KiB, 80 MiB in all: more than the sockets and HTTP/2 windows hold,
 * so the stream is still running when the server dies. */
START_TEST(test_kill_during_get)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 20000, 0);
    enum { NB = 40, L = 4 };
    tqkv_hash_t hs[NB];
    SH = (tqkv_block_shape_t){256, 4, 128};
    hashes(hs, NB, 31);
    tqkv_put_result_t r;
    ck_assert_int_eq(put_all(c, "k", hs, NB, L, &r), TQKV_OK);
    chk_t ck = {.kill_at = &S, .kill_after = 3, .encoding = TQKV_CLIENT_BF16};
    double t0 = proc_now();
    tqkv_status_t st = get_all(c, "k", hs, NB, L, &ck);
    ck_assert_msg(st != TQKV_OK, "Get returned OK after its server died (%zu found, %zu missing)",
                  ck.found, ck.missing);
    ck_assert_msg(st == TQKV_EUNAVAILABLE || st == TQKV_ECANCELED || st == TQKV_EINTERNAL,
                  "status %s: %s", tqkv_status_name(st), tqkv_client_last_error()->message);
    ck_assert_msg(tqkv_client_last_error()->message[0] != '\0', "no message");
    ck_assert_msg(proc_now() - t0 < 8, "took %.1f s", proc_now() - t0);
    ck_assert_uint_ge(ck.found, 3);
    ck_assert_uint_lt(ck.found, NB * L);
    ck_assert_uint_eq(ck.missing + ck.bad + ck.dup, 0);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* SIGKILL between blocks of a Put session (one target): put_block or put_end reports
 * it, in time; put_abort of a session whose server is gone returns at once. */
START_TEST(test_kill_during_put)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 0);
    uint16_t *k = BK, *v = BV;
    tqkv_hash_t hs[64];
    hashes(hs, 64, 41);
    tqkv_put_t *p, *p2;
    ck_assert_int_eq(tqkv_client_put_begin(c, NULL, &p), TQKV_OK);
    ck_assert_int_eq(tqkv_client_put_begin(c, NULL, &p2), TQKV_OK);
    tqkv_status_t st = TQKV_OK;
    double t0 = proc_now();
    for (size_t b = 0; b < 64 && st == TQKV_OK; b++) {
        block_data(SEED, b, 0, k, v);
        tqkv_put_block_t pb = {.ns = "p", .hash = &hs[b], .shape = SH, .key = k, .value = v};
        st = tqkv_client_put_block(p, &pb);
        if (st == TQKV_OK && b < 2)
            ck_assert_int_eq(tqkv_client_put_block(p2, &pb), TQKV_OK);
        if (b == 8) {
            srv_kill(&S, SIGKILL);
            ck_assert_int_eq(srv_wait(&S, 10), 0);
        }
    }
    tqkv_put_result_t r;
    tqkv_status_t st2 = tqkv_client_put_end(p, &r);
    ck_assert_msg(st != TQKV_OK || st2 != TQKV_OK, "the Put session succeeded without a server");
    ck_assert_int_eq(st2, st != TQKV_OK ? st : st2);
    ck_assert_msg(st2 == TQKV_EUNAVAILABLE || st2 == TQKV_EINTERNAL || st2 == TQKV_ECANCELED,
                  "put_end: %s (%s)", tqkv_status_name(st2), tqkv_client_last_error()->message);
    ck_assert_msg(tqkv_client_last_error()->message[0] != '\0', "no message");
    tqkv_client_put_abort(p2); /* left open over the dead server */
    ck_assert_msg(proc_now() - t0 < 8, "took %.1f s", proc_now() - t0);
    tqkv_client_destroy(c);
}
END_TEST

/* The server restarted on the same port between calls: the client reaches the new
 * one (a call may fail once while the old connection is found dead) and Puts/Gets
 * there with the right bytes. */
START_TEST(test_restart_same_port)
{
    const char *t[1] = {S.addr};
    int port = S.port;
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 0);
    tqkv_hash_t hs[4];
    hashes(hs, 4, 51);
    tqkv_put_result_t r;
    ck_assert_int_eq(put_all(c, "s", hs, 4, 2, &r), TQKV_OK);
    for (int round = 0; round < 2; round++) {
        srv_kill(&S, round ? SIGKILL : SIGTERM);
        ck_assert_int_eq(srv_wait(&S, 10), 0);
        ck_assert_int_eq(srv_start(&S, port, NULL), 0);
        tqkv_status_t st = TQKV_EUNAVAILABLE;
        int fails = 0;
        double t0 = proc_now();
        while (st != TQKV_OK && proc_now() - t0 < 5) {
            st = put_all(c, "s", hs, 4, 2, &r);
            fails += st != TQKV_OK;
        }
        ck_assert_msg(st == TQKV_OK, "no Put to the restarted server: %s",
                      tqkv_client_last_error()->message);
        ck_assert_msg(fails <= 1, "%d failed Puts before the restarted server was reached", fails);
        ck_assert_uint_eq(r.blocks_stored, 8); /* a new, empty server */
        chk_t ck = {0};
        st = get_all(c, "s", hs, 4, 2, &ck);
        ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
        ck_assert_uint_eq(ck.found, 8);
        ck_assert_uint_eq(ck.bad + ck.dup, 0);
        chk_free(&ck);
    }
    tqkv_client_destroy(c);
}
END_TEST

/* A callback that returns non-zero: TQKV_ECANCELED saying so, no call after it, and
 * the client (and the server) fine for the next Get. Also when it stops on a miss. */
START_TEST(test_callback_stops_get)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 0);
    enum { NB = 10, L = 3 };
    tqkv_hash_t hs[NB + 5];
    hashes(hs, NB + 5, 61);
    tqkv_put_result_t r;
    ck_assert_int_eq(put_all(c, "c", hs, NB, L, &r), TQKV_OK);
    size_t stops[] = {1, 7, NB * L, NB * L + 2};
    for (size_t i = 0; i < sizeof stops / sizeof stops[0]; i++) {
        chk_t ck = {.stop_after = stops[i]};
        tqkv_status_t st = get_all(c, "c", hs, NB + 5, L, &ck);
        ck_assert_int_eq(st, TQKV_ECANCELED);
        assert_msg_has("canceled by callback");
        ck_assert_uint_eq(ck.calls, stops[i]);
        ck_assert_uint_eq(ck.bad + ck.dup, 0);
        chk_free(&ck);
    }
    chk_t ck = {0};
    ck_assert_int_eq(get_all(c, "c", hs, NB + 5, L, &ck), TQKV_OK);
    ck_assert_uint_eq(ck.found, NB * L);
    ck_assert_uint_eq(ck.missing, 5 * L);
    ck_assert_uint_eq(ck.bad + ck.dup, 0);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* Many hashes x layers in one Get: every (hash, layer) reported exactly once, found
 * ones with the right bytes; more layers than the server allows is refused with a
 * message naming the limit, not a hang or an allocation failure. */
START_TEST(test_large_get)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 30000, 0);
    enum { NB = 8, L = 4, NH = 3000, LL = 64 };
    tqkv_hash_t *hs = malloc(NH * sizeof *hs);
    ck_assert_ptr_nonnull(hs);
    hashes(hs, NH, 71);
    tqkv_put_result_t r;
    ck_assert_int_eq(put_all(c, "g", hs, NB, L, &r), TQKV_OK);
    chk_t ck = {0};
    tqkv_status_t st = get_all(c, "g", hs, NH, LL, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.calls, (size_t)NH * LL);
    ck_assert_uint_eq(ck.found, NB * L);
    ck_assert_uint_eq(ck.missing, (size_t)NH * LL - NB * L);
    ck_assert_uint_eq(ck.bad + ck.dup, 0);
    chk_free(&ck);
    /* a layer range no model has */
    tqkv_get_req_t q = {.ns = "g", .hashes = hs, .num_hashes = 2, .layer_end = UINT32_MAX};
    memset(&ck, 0, sizeof ck);
    ck.nh = 2;
    ck.L = 1;
    ck.seen = calloc(2, 1);
    st = tqkv_client_get(c, &q, on_page, &ck);
    ck_assert_int_eq(st, TQKV_EINVAL);
    assert_msg_has("layer_end");
    ck_assert_uint_eq(ck.calls, 0);
    chk_free(&ck);
    /* more hashes than the server takes in one request: refused naming the limit, and
     * no callback (a partial answer would read as misses) */
    enum { HUGE = 70000 };
    tqkv_hash_t *big = malloc(HUGE * sizeof *big);
    ck_assert_ptr_nonnull(big);
    for (size_t i = 0; i < HUGE; i++)
        big[i] = hs[i % NH];
    memset(&ck, 0, sizeof ck);
    st = get_all(c, "g", big, HUGE, 1, &ck);
    ck_assert_int_eq(st, TQKV_EINVAL);
    assert_msg_has("65536");
    ck_assert_uint_eq(ck.calls, 0);
    chk_free(&ck);
    free(big);
    free(hs);
    tqkv_client_destroy(c);
}
END_TEST

/* Put sessions left open: aborted with blocks in flight, aborted empty, and ended
 * after a failed block; nothing half-stored is visible as a whole block. */
START_TEST(test_sessions_left_open)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 0);
    uint16_t *k = BK, *v = BV;
    tqkv_hash_t hs[6], shorth = {.len = 3};
    hashes(hs, 6, 81);
    tqkv_put_t *ps[4];
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(tqkv_client_put_begin(c, NULL, &ps[i]), TQKV_OK);
    for (size_t b = 0; b < 6; b++) {
        block_data(SEED, b, 0, k, v);
        tqkv_put_block_t pb = {.ns = "o", .hash = &hs[b], .shape = SH, .key = k, .value = v};
        ck_assert_int_eq(tqkv_client_put_block(ps[b % 2], &pb), TQKV_OK);
    }
    tqkv_client_put_abort(ps[0]); /* blocks 0, 2, 4 in flight */
    tqkv_client_put_abort(ps[2]); /* never used */
    tqkv_put_block_t bad = {.ns = "o", .hash = &shorth, .shape = SH, .key = k, .value = v};
    ck_assert_int_eq(tqkv_client_put_block(ps[3], &bad), TQKV_EINVAL);
    assert_msg_has("8..64");
    tqkv_put_result_t r;
    ck_assert_int_eq(tqkv_client_put_end(ps[3], &r), TQKV_OK); /* a local refusal only */
    ck_assert_uint_eq(r.blocks_sent, 0);
    ck_assert_int_eq(tqkv_client_put_end(ps[1], &r), TQKV_OK);
    ck_assert_uint_eq(r.blocks_stored, 3);
    chk_t ck = {0};
    tqkv_get_req_t q = {.ns = "o", .hashes = hs, .num_hashes = 6, .layer_end = 1};
    ck.nh = 6;
    ck.L = 1;
    ck.seen = calloc(6, 1);
    ck_assert_int_eq(tqkv_client_get(c, &q, on_page, &ck), TQKV_OK);
    ck_assert_uint_eq(ck.calls, 6);
    ck_assert_uint_ge(ck.found, 3); /* 1, 3, 5, and whatever of the aborted ones landed */
    ck_assert_uint_eq(ck.bad + ck.dup, 0);
    for (size_t b = 1; b < 6; b += 2)
        ck_assert_int_eq(ck.seen[b], 1);
    chk_free(&ck);
    tqkv_client_destroy(c);
}
END_TEST

/* The same hash twice in one Get or Lookup (a prompt repeating a block): each index
 * is answered, with the block's bytes, and Lookup counts the prefix through both. */
START_TEST(test_repeated_hashes)
{
    const char *t[1] = {S.addr};
    tqkv_client_t *c = client_of(t, 1, 1, 5000, 0);
    tqkv_hash_t hs[3], rep[5];
    hashes(hs, 3, 91);
    tqkv_put_result_t r;
    ck_assert_int_eq(put_all(c, "d", hs, 3, 2, &r), TQKV_OK);
    rep[0] = hs[0], rep[1] = hs[0], rep[2] = hs[1], rep[3] = hs[0], rep[4] = hs[2];
    static const size_t map[5] = {0, 0, 1, 0, 2};
    chk_t ck = {.map = map};
    tqkv_status_t st = get_all(c, "d", rep, 5, 2, &ck);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(ck.calls, 10);
    ck_assert_uint_eq(ck.dup, 0);
    for (size_t i = 0; i < 10; i++)
        ck_assert_msg(ck.seen[i] == 1, "slot %zu seen %d times", i, ck.seen[i]);
    ck_assert_uint_eq(ck.missing + ck.bad, 0);
    ck_assert_msg(ck.max_err < 0.2, "max rel err %g", ck.max_err);
    chk_free(&ck);
    uint32_t prefix = 0;
    uint8_t tiers[5];
    tqkv_lookup_req_t lq = {.ns = "d", .hashes = rep, .num_hashes = 5, .num_layers = 2};
    ck_assert_int_eq(tqkv_client_lookup(c, &lq, &prefix, tiers), TQKV_OK);
    ck_assert_uint_eq(prefix, 5);
    for (int i = 0; i < 5; i++)
        ck_assert_int_ne(tiers[i], 0);
    tqkv_client_destroy(c);
}
END_TEST

static Suite *
client_adversarial_suite(void)
{
    Suite *s = suite_create("client_adversarial");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_null_arguments);
    tcase_add_test(tc, test_duplicate_targets);
    tcase_add_test(tc, test_unresolvable_target);
    tcase_add_test(tc, test_refusing_target_among_several);
    tcase_add_test(tc, test_stalled_target_waited_for);
    tcase_add_test(tc, test_kill_during_get);
    tcase_add_test(tc, test_kill_during_put);
    tcase_add_test(tc, test_restart_same_port);
    tcase_add_test(tc, test_callback_stops_get);
    tcase_add_test(tc, test_large_get);
    tcase_add_test(tc, test_sessions_left_open);
    tcase_add_test(tc, test_repeated_hashes);
    suite_add_tcase(s, tc);
    return s;
}

static Suite *
suite_or_skip(void)
{
    if (srv_path() == NULL) {
        fprintf(stderr, "TQKV_SERVER not set: skipped\n");
        exit(77);
    }
    return client_adversarial_suite();
}

TQKV_CHECK_MAIN(suite_or_skip)
