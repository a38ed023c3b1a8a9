/* check_member_cluster.c - a long-lived libtqkv client follows a changing cluster
 * (label shard): real tqkv-servers on loopback found through a real DNS server
 * (dnsmasq: SRV records _grpc._tcp.svc.test, one per server port).
 *
 * Events, R = 1, DRAM-only servers with --node-id tqkv-N:
 *   added    a 4th server joins the SRV set;
 *   removed  a server is stopped (SIGTERM) and leaves the set;
 *   killed   a server is SIGKILLed (still listed), then restarted on a new port with
 *            the same --node-id and the set updated: it keeps its rank.
 * After each event every block put so far is read back: a found page must decode to
 * what was put and be byte-identical to the copy read before (zero wrong pages); the
 * hit rate, the pages lost and the blocks recomputed (re-put) are printed per event.
 * Finally a second client that names the servers by their literal addresses (another
 * spelling, no DNS) finds every block the first one put: both rank by node id.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check_main.h"
#include "tests/dns_test_util.h"
#include "transport/client_server.h"
#include "transport/shard.h"

#include "tests/support/kv_data.h"
#include "tests/support/server_proc.h"

enum { NSRV = 5, L = 2, NB_MAX = 600 };
static const tqkv_block_shape_t SH = {16, 2, 64};
static srv_t S[NSRV];
static int up[NSRV];
static dns_srv_t D;
static uint64_t SEED;

static tqkv_hash_t HS[NB_MAX];
static size_t NB;
/* reference page bytes per (block, layer), from the first read after its last put */
static uint8_t *REF[NB_MAX][L];
static size_t REFLEN[NB_MAX][L];

static void
block_data(const tqkv_hash_t *h, uint32_t layer, uint16_t *k, uint16_t *v)
{
    tqkv_test_block_data(h, layer, SH.num_tokens, SH.num_kv_heads, SH.head_dim, k, v);
}

static const char *HANDOFF_S = "0"; /* --handoff-seconds of the servers started */
static int NO_FORWARD;              /* start servers with --no-forward */

static void
start_server(int i)
{
    char id[32];
    snprintf(id, sizeof id, "tqkv-%d", i);
    const char *extra[] = {"--node-id",
                           id,
                           "--dram-capacity",
                           "256M",
                           "--peers",
                           "svc.test:1",
                           "--peers-dns",
                           D.servers,
                           "--handoff-seconds",
                           HANDOFF_S,
                           NO_FORWARD ? "--no-forward" : NULL,
                           NULL};
    ck_assert_msg(srv_start(&S[i], 0, extra) == 0, "cannot start server %d", i);
    up[i] = 1;
}

/* (Re)starts dnsmasq on its port with one SRV record per server that is up. */
static void
dns_publish(void)
{
    static char recs[NSRV][96];
    const char *extra[NSRV + 1];
    int n = 0;
    for (int i = 0; i < NSRV; i++)
        if (up[i]) {
            snprintf(recs[n], sizeof recs[n], "--srv-host=_grpc._tcp.svc.test,h.test,%d",
                     S[i].port);
            extra[n] = recs[n];
            n++;
        }
    extra[n] = NULL;
    int port = D.port;
    dns_stop(&D);
    int rc = dns_start(&D, port, "127.0.0.1 h.test\n127.0.0.1 svc.test\n", extra);
    ck_assert_msg(rc == 0, "dnsmasq did not start (%d)", rc);
}

/* Waits until the client lists exactly the servers that are up (by node id and port). */
static double
wait_follow(tqkv_client_t *c)
{
    double t0 = proc_now();
    while (proc_now() - t0 < 15) {
        size_t n = tqkv_client_num_targets(c), want = 0, ok = 0;
        for (int i = 0; i < NSRV; i++)
            want += up[i];
        for (size_t t = 0; t < n; t++) {
            char id[64];
            const char *name = tqkv_client_target_name(c, t);
            if (tqkv_client_target_node_id(c, t, id, sizeof id) != 0 || name == NULL)
                continue;
            int k = id[0] ? atoi(id + 5) : -1;
            char port[16];
            snprintf(port, sizeof port, ":%d", k >= 0 && k < NSRV ? S[k].port : -1);
            if (k >= 0 && k < NSRV && up[k] && strlen(name) > strlen(port) &&
                !strcmp(name + strlen(name) - strlen(port), port))
                ok++;
        }
        if (n == want && ok == want)
            return proc_now() - t0;
        usleep(20000);
    }
    ck_abort_msg("the client did not follow the membership within 15 s");
    return -1;
}

static void
put_blocks(tqkv_client_t *c, const size_t *which, size_t n)
{
    size_t e = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    uint16_t *k = malloc(e * 2), *v = malloc(e * 2);
    tqkv_put_t *p;
    tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
    ck_assert_int_eq(tqkv_client_put_begin(c, &po, &p), TQKV_OK);
    for (size_t i = 0; i < n; i++) {
        size_t b = which[i];
        for (uint32_t l = 0; l < L; l++) {
            block_data(&HS[b], l, k, v);
            tqkv_put_block_t pb = {.ns = "m",
                                   .hash = &HS[b],
                                   .layer = l,
                                   .num_layers = L,
                                   .shape = SH,
                                   .key = k,
                                   .value = v};
            tqkv_status_t st = tqkv_client_put_block(p, &pb);
            ck_assert_msg(st == TQKV_OK, "put_block: %s", tqkv_client_last_error()->message);
            free(REF[b][l]);
            REF[b][l] = NULL;
        }
    }
    tqkv_put_result_t r;
    tqkv_status_t st = tqkv_client_put_end(p, &r);
    ck_assert_msg(st == TQKV_OK, "put_end: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(r.blocks_lost, 0);
    free(k);
    free(v);
}

typedef struct tally {
    size_t found, missing, wrong;
    uint8_t *miss; /* per block: a layer missing */
    uint16_t *k, *v, *dk, *dv;
} tally_t;

static int
check_page(void *arg, const tqkv_get_page_t *pg)
{
    tally_t *t = arg;
    size_t b = pg->hash_index, l = pg->layer;
    if (!pg->found) {
        t->missing++;
        t->miss[b] = 1;
        return 0;
    }
    t->found++;
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    block_data(&HS[b], (uint32_t)l, t->k, t->v);
    tqkv_block_shape_t got;
    if (tqkv_client_decode_page(pg->page, pg->page_len, t->dk, t->dv, &got) != TQKV_OK ||
        got.num_tokens != SH.num_tokens || !(tqkv_test_bf16_rel_err(t->k, t->dk, n) < 0.3) ||
        !(tqkv_test_bf16_rel_err(t->v, t->dv, n) < 0.3)) {
        t->wrong++;
        return 0;
    }
    if (REF[b][l] == NULL) {
        REF[b][l] = malloc(pg->page_len);
        memcpy(REF[b][l], pg->page, pg->page_len);
        REFLEN[b][l] = pg->page_len;
    } else if (REFLEN[b][l] != pg->page_len || memcmp(REF[b][l], pg->page, pg->page_len)) {
        t->wrong++;
    }
    return 0;
}

static tally_t
get_all(tqkv_client_t *c)
{
    size_t n = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    tally_t t = {.miss = calloc(NB, 1),
                 .k = malloc(n * 2),
                 .v = malloc(n * 2),
                 .dk = malloc(n * 2),
                 .dv = malloc(n * 2)};
    tqkv_get_req_t q = {
        .ns = "m", .hashes = HS, .num_hashes = NB, .layer_end = L, .encoding = TQKV_CLIENT_PACKED};
    tqkv_status_t st = tqkv_client_get(c, &q, check_page, &t);
    ck_assert_msg(st == TQKV_OK, "get: %s", tqkv_client_last_error()->message);
    ck_assert_uint_eq(t.found + t.missing, NB * L);
    free(t.k);
    free(t.v);
    free(t.dk);
    free(t.dv);
    return t;
}

/* Reads everything, prints the event's line, re-puts (recomputes) what was lost, and
 * checks that everything is then found. Returns the pages lost. */
static size_t
measure(tqkv_client_t *c, const char *event, double follow_s)
{
    tally_t t = get_all(c);
    ck_assert_msg(t.wrong == 0, "%s: %zu wrong pages", event, t.wrong);
    size_t *re = malloc(NB * sizeof *re), nre = 0;
    for (size_t b = 0; b < NB; b++)
        if (t.miss[b])
            re[nre++] = b;
    fprintf(stderr,
            "member event %-8s followed in %.2f s: blocks %zu, hit rate %.1f%%, pages lost %zu, "
            "blocks recomputed %zu, wrong pages %zu\n",
            event, follow_s, NB, 100.0 * (double)t.found / (double)(NB * L), t.missing, nre,
            t.wrong);
    if (nre)
        put_blocks(c, re, nre);
    tally_t t2 = get_all(c);
    ck_assert_msg(t2.wrong == 0 && t2.missing == 0, "%s: after recompute %zu missing, %zu wrong",
                  event, t2.missing, t2.wrong);
    free(re);
    free(t.miss);
    free(t2.miss);
    return t.missing;
}

static void
add_blocks(tqkv_client_t *c, size_t n)
{
    size_t which[NB_MAX];
    for (size_t i = 0; i < n; i++) {
        tqkv_test_hash(&HS[NB], SEED, 1000 + NB, 16);
        which[i] = NB++;
    }
    put_blocks(c, which, n);
}

static uint64_t
rank_of(tqkv_client_t *c, const char *node)
{
    for (size_t t = 0; t < tqkv_client_num_targets(c); t++) {
        char id[64];
        if (tqkv_client_target_node_id(c, t, id, sizeof id) == 0 && !strcmp(id, node))
            return tqkv_client_target_rank_id(c, t);
    }
    return 0;
}

static void
cluster_up(int nsrv)
{
    SEED = tqkv_test_seed();
    memset(&D, 0, sizeof D);
    memset(up, 0, sizeof up);
    NB = 0;
    D.port = tqkv_test_free_port(1);
    snprintf(D.servers, sizeof D.servers, "127.0.0.1:%d", D.port);
    for (int i = 0; i < nsrv; i++)
        start_server(i);
    dns_publish();
}

static void
cluster_down(void)
{
    for (int i = 0; i < NSRV; i++)
        if (up[i])
            srv_stop(&S[i]);
    dns_destroy(&D);
    for (size_t b = 0; b < NB; b++)
        for (int l = 0; l < L; l++) {
            free(REF[b][l]);
            REF[b][l] = NULL;
        }
}

static tqkv_client_t *
follower(void)
{
    const char *tg[] = {"svc.test:1"};
    tqkv_client_opts_t o = {.targets = tg,
                            .num_targets = 1,
                            .resolve_targets = 1,
                            .dns_servers = D.servers,
                            .resolve_interval_ms = 200,
                            .replicas = 1,
                            .deadline_ms = 5000,
                            .backoff_min_ms = 100,
                            .backoff_max_ms = 400};
    tqkv_client_t *c = NULL;
    ck_assert_msg(tqkv_client_create(&o, &c) == TQKV_OK, "create: %s",
                  tqkv_client_last_error()->message);
    wait_follow(c);
    return c;
}

START_TEST(t_client_follows_cluster)
{
    HANDOFF_S = "0";
    NO_FORWARD = 1; /* c3 below asks one server alone */
    cluster_up(3);

    tqkv_client_t *c = follower();
    ck_assert_uint_eq(tqkv_client_num_targets(c), 3);
    add_blocks(c, 240);
    ck_assert_uint_eq(measure(c, "start", 0), 0);

    /* added: a 4th server; its blocks were at rank 1 before, so reads still find them */
    start_server(3);
    dns_publish();
    double f = wait_follow(c);
    measure(c, "added", f);
    /* Read repair: the blocks that now rank the new server first were found at rank 1
     * and put again to it, as their pages. */
    ck_assert_int_eq(tqkv_client_repair_wait(c, 20000), 0);
    tqkv_client_repair_stats_t rs;
    tqkv_client_repair_stats(c, &rs);
    size_t moved = 0;
    {
        size_t nt = tqkv_client_num_targets(c), t3 = nt;
        uint64_t ids[8];
        for (size_t t = 0; t < nt; t++) {
            char id[64];
            ids[t] = tqkv_client_target_rank_id(c, t);
            if (tqkv_client_target_node_id(c, t, id, sizeof id) == 0 && !strcmp(id, "tqkv-3"))
                t3 = t;
        }
        ck_assert_uint_lt(t3, nt);
        for (size_t b = 0; b < NB; b++) {
            uint32_t order[8];
            tqkv_shard_rank(ids, nt, tqkv_shard_block_key("m", HS[b].bytes, HS[b].len), order);
            moved += order[0] == t3;
        }
    }
    fprintf(stderr,
            "member read repair after added: %zu blocks rank the new server first; pages "
            "queued %llu, put again %llu, stored %llu, dropped %llu, failed %llu\n",
            moved, (unsigned long long)rs.queued, (unsigned long long)rs.repaired,
            (unsigned long long)rs.stored, (unsigned long long)rs.dropped,
            (unsigned long long)rs.failed);
    ck_assert_uint_gt(moved, 0);
    ck_assert_uint_ge(rs.queued, moved * L); /* each read before the repair offers again */
    ck_assert_uint_eq(rs.stored, moved * L);
    ck_assert_uint_eq(rs.dropped + rs.failed, 0);
    {
        /* the new server alone holds exactly those blocks now */
        const char *one[] = {S[3].addr};
        tqkv_client_opts_t o3 = {.targets = one, .num_targets = 1, .no_read_repair = 1};
        tqkv_client_t *c3 = NULL;
        ck_assert_int_eq(tqkv_client_create(&o3, &c3), TQKV_OK);
        tally_t t3 = get_all(c3);
        ck_assert_uint_eq(t3.wrong, 0);
        ck_assert_uint_eq(t3.found, moved * L);
        free(t3.miss);
        tqkv_client_destroy(c3);
    }
    /* converged: the next read finds every block at its primary, nothing more queued */
    tally_t tc = get_all(c);
    ck_assert_uint_eq(tc.missing + tc.wrong, 0);
    free(tc.miss);
    ck_assert_int_eq(tqkv_client_repair_wait(c, 20000), 0);
    tqkv_client_repair_stats_t rs2;
    tqkv_client_repair_stats(c, &rs2);
    ck_assert_uint_eq(rs2.queued, rs.queued);
    add_blocks(c, 80); /* some land on the new server */

    /* removed: SIGTERM, and out of the set */
    srv_stop(&S[1]);
    up[1] = 0;
    dns_publish();
    f = wait_follow(c);
    size_t lost = measure(c, "removed", f);
    ck_assert_msg(lost > 0 && lost < NB * L / 2, "removed: %zu pages lost", lost);

    /* killed: SIGKILL while still listed; then back on a new port, same --node-id */
    uint64_t rank2 = rank_of(c, "tqkv-2");
    ck_assert(rank2 == tqkv_shard_target_id("tqkv-2"));
    int old_port = S[2].port;
    srv_kill(&S[2], SIGKILL);
    srv_wait(&S[2], 10);
    tally_t t = get_all(c); /* no error, no wrong page: its blocks read as misses */
    ck_assert_uint_eq(t.wrong, 0);
    fprintf(stderr, "member event killed   (still listed): hit rate %.1f%%, pages lost %zu\n",
            100.0 * (double)t.found / (double)(NB * L), t.missing);
    free(t.miss);
    start_server(2);
    ck_assert_int_ne(S[2].port, old_port);
    dns_publish();
    f = wait_follow(c);
    ck_assert(rank_of(c, "tqkv-2") == rank2); /* the same rank on its new address */
    measure(c, "restart", f);

    /* Another spelling of the same servers (literal addresses, no DNS) ranks alike. */
    const char *lit[NSRV];
    size_t nl = 0;
    for (int i = 0; i < NSRV; i++)
        if (up[i])
            lit[nl++] = S[i].addr;
    tqkv_client_opts_t o2 = {.targets = lit, .num_targets = nl, .replicas = 1};
    tqkv_client_t *c2 = NULL;
    ck_assert_int_eq(tqkv_client_create(&o2, &c2), TQKV_OK);
    tally_t t2 = get_all(c2);
    fprintf(stderr, "member second client (literal addresses): hit rate %.1f%%\n",
            100.0 * (double)t2.found / (double)(NB * L));
    ck_assert_uint_eq(t2.wrong, 0);
    ck_assert_uint_eq(t2.missing, 0);
    free(t2.miss);
    tqkv_client_destroy(c2);

    tqkv_client_destroy(c);
    cluster_down();
    NO_FORWARD = 0;
}
END_TEST

/* A rolling restart of 3 DRAM-only servers at R = 1: each in turn gets SIGTERM, leaves
 * the set, and comes back (same --node-id, new port). With hand-off (--peers) a
 * stopping server puts its pages to their next-ranked peers, and read repair brings
 * them back to it once it returns; without, each restart loses its third. Returns the
 * hit rate after the rollout (before it: 100%). */
static double
rolling_restart(const char *handoff_s)
{
    HANDOFF_S = handoff_s;
    cluster_up(3);
    tqkv_client_t *c = follower();
    add_blocks(c, 300);
    tally_t t = get_all(c);
    ck_assert_uint_eq(t.missing + t.wrong, 0);
    free(t.miss);
    for (int i = 0; i < 3; i++) {
        double t0 = proc_now();
        srv_stop(&S[i]); /* SIGTERM: hand-off, drain, exit */
        double stop_s = proc_now() - t0;
        up[i] = 0;
        dns_publish();
        wait_follow(c);
        tally_t mid = get_all(c); /* while it is away */
        ck_assert_uint_eq(mid.wrong, 0);
        start_server(i);
        dns_publish();
        double f = wait_follow(c);
        tally_t after = get_all(c); /* found at rank 1: read repair moves them back */
        ck_assert_uint_eq(after.wrong, 0);
        ck_assert_int_eq(tqkv_client_repair_wait(c, 30000), 0);
        fprintf(stderr,
                "member rolling restart (hand-off %s s) server %d: stop took %.2f s, hit rate "
                "while away %.1f%%, after return %.1f%% (followed in %.2f s)\n",
                handoff_s, i, stop_s, 100.0 * (double)mid.found / (double)(NB * L),
                100.0 * (double)after.found / (double)(NB * L), f);
        free(mid.miss);
        free(after.miss);
    }
    tally_t end = get_all(c);
    ck_assert_uint_eq(end.wrong, 0);
    double hit = (double)end.found / (double)(NB * L);
    tqkv_client_repair_stats_t rs;
    tqkv_client_repair_stats(c, &rs);
    fprintf(stderr,
            "member rolling restart (hand-off %s s): hit rate after the rollout %.1f%% (before "
            "100.0%%); read repair stored %llu pages\n",
            handoff_s, 100.0 * hit, (unsigned long long)rs.stored);
    free(end.miss);
    tqkv_client_destroy(c);
    cluster_down();
    return hit;
}

/* A client that reaches one pod only (the load-balanced Service) */
static tqkv_client_t *
thin_client(int i)
{
    const char *one[] = {S[i].addr};
    tqkv_client_opts_t o = {.targets = one, .num_targets = 1, .no_read_repair = 1};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

static int
count_found(void *arg, const tqkv_get_page_t *pg)
{
    *(size_t *)arg += pg->found != 0;
    return 0;
}

/* Waits (bounded, 60 s) until the n servers up have found each other through the DNS
 * server: 12 probe blocks (namespace "probe") Put through each thin client in turn are
 * found through every one, for one round per server in a row. Returns the seconds it took. */
static double
wait_peers_converged(tqkv_client_t **thin, size_t n)
{
    size_t e = (size_t)SH.num_tokens * SH.num_kv_heads * SH.head_dim;
    uint16_t *k = calloc(e, 2), *v = calloc(e, 2);
    double t0 = proc_now();
    size_t good = 0;
    for (unsigned round = 0; proc_now() - t0 < 60; round++) {
        tqkv_hash_t ph[12];
        for (size_t i = 0; i < 12; i++)
            tqkv_test_hash(&ph[i], SEED ^ 0x70726f6265ull, round * 12u + i, 16);
        tqkv_put_t *p;
        tqkv_put_opts_t po = {.key_bits = 4, .value_bits = 4};
        int ok = tqkv_client_put_begin(thin[round % n], &po, &p) == TQKV_OK;
        if (ok) {
            for (size_t i = 0; ok && i < 12; i++) {
                tqkv_put_block_t pb = {.ns = "probe",
                                       .hash = &ph[i],
                                       .num_layers = 1,
                                       .shape = SH,
                                       .key = k,
                                       .value = v};
                ok = tqkv_client_put_block(p, &pb) == TQKV_OK;
            }
            ok = tqkv_client_put_end(p, NULL) == TQKV_OK && ok; /* always frees p */
        }
        for (size_t c = 0; ok && c < n; c++) {
            size_t found = 0;
            tqkv_get_req_t q = {.ns = "probe",
                                .hashes = ph,
                                .num_hashes = 12,
                                .layer_end = 1,
                                .encoding = TQKV_CLIENT_PACKED};
            ok = tqkv_client_get(thin[c], &q, count_found, &found) == TQKV_OK && found == 12;
        }
        /* n rounds in a row, one Put through each server: a server whose peers are not
         * resolved yet keeps what it is given, and owners that read through can still
         * find those blocks, so one good round can pass before every server forwards. */
        good = ok ? good + 1 : 0;
        if (good >= n) {
            free(k);
            free(v);
            return proc_now() - t0;
        }
        if (!ok)
            usleep(100000);
    }
    ck_abort_msg("the servers did not find each other within 60 s");
    return -1;
}

/* Thin clients through different pods see one cache: Puts through pod 0 are forwarded
 * to each block's owner, Gets and Lookups through pod 1 and pod 2 ask the owners. A
 * sharded client then finds every block at its primary. With --no-forward the blocks
 * stay on pod 0 and pod 1 misses most of them. */
static double
thin_clients(int no_forward)
{
    HANDOFF_S = "0";
    NO_FORWARD = no_forward;
    cluster_up(3);
    tqkv_client_t *a = thin_client(0), *b = thin_client(1), *c2 = thin_client(2);
    if (!no_forward) {
        tqkv_client_t *all[] = {a, b, c2};
        fprintf(stderr, "member thin clients: the servers found each other in %.1f s\n",
                wait_peers_converged(all, 3));
    }
    add_blocks(a, 120);
    tally_t t = get_all(b);
    ck_assert_uint_eq(t.wrong, 0);
    double hit = (double)t.found / (double)(NB * L);
    uint32_t prefix = 0;
    tqkv_lookup_req_t q = {.ns = "m", .hashes = HS, .num_hashes = NB, .num_layers = L};
    ck_assert_int_eq(tqkv_client_lookup(c2, &q, &prefix, NULL), TQKV_OK);
    tqkv_client_t *full = follower();
    tally_t tf = get_all(full);
    ck_assert_uint_eq(tf.wrong, 0);
    ck_assert_int_eq(tqkv_client_repair_wait(full, 20000), 0);
    tqkv_client_repair_stats_t rs;
    tqkv_client_repair_stats(full, &rs);
    fprintf(stderr,
            "member thin clients (%s): Get through another pod %.1f%% hit, Lookup through a "
            "third pod prefix %u of %zu, sharded client %.1f%% hit with %llu pages below "
            "their primaries\n",
            no_forward ? "--no-forward" : "forwarding", 100.0 * hit, prefix, NB,
            100.0 * (double)tf.found / (double)(NB * L), (unsigned long long)rs.queued);
    if (!no_forward) {
        ck_assert_uint_eq(t.missing, 0);
        ck_assert_uint_eq(prefix, NB);
        ck_assert_uint_eq(tf.missing, 0);
        ck_assert_uint_eq(rs.queued, 0); /* every block is at its owner */
    }
    free(t.miss);
    free(tf.miss);
    tqkv_client_destroy(full);
    tqkv_client_destroy(a);
    tqkv_client_destroy(b);
    tqkv_client_destroy(c2);
    cluster_down();
    NO_FORWARD = 0;
    return hit;
}

START_TEST(t_thin_clients_forwarding)
{
    double with = thin_clients(0);
    double without = thin_clients(1);
    ck_assert(with == 1.0);
    ck_assert_msg(without < 0.6, "--no-forward: %.2f hit through another pod", without);
}
END_TEST

START_TEST(t_rolling_restart_handoff)
{
    double with = rolling_restart("10");
    double without = rolling_restart("0");
    ck_assert_msg(with >= 0.9, "hand-off: hit rate after the rollout %.3f < 90%% of before", with);
    ck_assert_msg(without < with, "without hand-off %.3f, with %.3f", without, with);
}
END_TEST

static Suite *
cluster_suite(void)
{
    Suite *s = suite_create("member_cluster");
    TCase *tc = tcase_create("events");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, t_client_follows_cluster);
    tcase_add_test(tc, t_rolling_restart_handoff);
    tcase_add_test(tc, t_thin_clients_forwarding);
    suite_add_tcase(s, tc);
    return s;
}

int
main(void)
{
    if (dns_dnsmasq_path() == NULL || srv_path() == NULL) {
        fprintf(stderr, "SKIP: needs dnsmasq (apt-get install dnsmasq-base) and TQKV_SERVER\n");
        return 77;
    }
    (void)tqkv_test_seed();
    SRunner *sr = srunner_create(cluster_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf == 0 ? 0 : 1;
}
