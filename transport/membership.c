/* membership.c - DNS-resolved (c-ares), identified and refcounted tables of servers.
 *
 * One resolution pass (under res_mu, on the background thread or in refresh):
 * resolve every DNS target (SRV "_grpc._tcp.HOST" and A/AAAA at once, SRV wins where it
 * has records), collect the addresses, reuse the member of an address the current table
 * already has, attach new ones, identify the new and the not-yet-identified (and the
 * kicked) in parallel, merge addresses that answer with one node id, sort, and publish
 * the table when it differs from the current one. Publishing swaps cur under cur_mu;
 * acquire takes cur and a reference under the same mutex, so a table is never freed
 * between a reader loading it and counting itself.
 */
#include "transport/membership.h"

#include <arpa/inet.h>
#include <arpa/nameser.h>
#include <ares.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "transport/shard.h"

#define DEFAULT_PORT "50051"

/* A growable set of strings (addresses of one pass), with the host each came from. */
typedef struct addrset {
    char **addr;
    const char **host; /* borrowed from the spec */
    uint32_t *spec;    /* index of the target that listed it first */
    size_t n, cap;
} addrset_t;

/* One target as given. */
typedef struct spec {
    char *text; /* as given */
    char *host; /* DNS name; NULL: a literal address, used as given */
    char port[8];
    char **prev; /* addresses of the last successful resolution */
    size_t nprev;
} spec_t;

struct tqkv_membership {
    tqkv_membership_opts_t o;
    char *exclude;
    spec_t *spec;
    size_t nspec;
    char *dns_servers;
    addrset_t ghost; /* under res_mu: dead old addresses of servers now answering elsewhere */
    char **alias_addr, **alias_id; /* under res_mu: other spellings of kept members */
    size_t nalias;

    pthread_mutex_t res_mu; /* one resolution at a time; owns the c-ares channel */
    ares_channel ares;
    int have_ares;

    pthread_mutex_t cur_mu;
    tqkv_member_table_t *cur;

    pthread_mutex_t mu; /* thread control */
    pthread_cond_t cv;
    int stop, kicked, have_thread;
    uint64_t last_ns;
    pthread_t thread;

    _Atomic uint64_t st_resolutions, st_dns_errors, st_tables, st_identified, st_identify_fails,
        st_kicks, st_idle_checks;
};

/* ---- members and tables ---- */

static void
member_unref(tqkv_member_t *m)
{
    if (m == NULL || atomic_fetch_sub(&m->refs, 1) != 1)
        return;
    tqkv_membership_t *ms = m->owner;
    if (ms->o.detach && m->user)
        ms->o.detach(ms->o.arg, m->user);
    free(m->addr);
    free(m->host);
    free(m);
}

static void
table_free(tqkv_member_table_t *t)
{
    for (size_t i = 0; i < t->n; i++) {
        free(t->s[i].node_id);
        member_unref(t->s[i].m);
    }
    free(t->s);
    free(t->users);
    tqkv_shard_index_destroy(t->rank_index);
    free(t);
}

void
tqkv_membership_release(tqkv_member_table_t *t)
{
    if (t && atomic_fetch_sub(&t->refs, 1) == 1)
        table_free(t);
}

tqkv_member_table_t *
tqkv_membership_acquire(tqkv_membership_t *ms)
{
    pthread_mutex_lock(&ms->cur_mu);
    tqkv_member_table_t *t = ms->cur;
    atomic_fetch_add(&t->refs, 1);
    pthread_mutex_unlock(&ms->cur_mu);
    return t;
}

/* ---- targets ---- */

static int
is_literal(const char *s)
{
    if (strstr(s, "://") || !strncmp(s, "unix:", 5) || !strncmp(s, "ipv4:", 5) ||
        !strncmp(s, "ipv6:", 5) || !strncmp(s, "dns:", 4) || s[0] == '[')
        return 1;
    return 0;
}

/* Splits "HOST[:PORT]" into a DNS name and a port, or leaves host NULL for a literal. */
static int
spec_init(spec_t *sp, const char *text, int resolve)
{
    memset(sp, 0, sizeof *sp);
    if ((sp->text = strdup(text)) == NULL)
        return -1;
    if (!resolve || is_literal(text))
        return 0;
    const char *colon = strrchr(text, ':');
    size_t hl = colon ? (size_t)(colon - text) : strlen(text);
    if (colon && (strchr(text, ':') != colon || colon[1] == '\0' || strlen(colon + 1) >= 6))
        return 0; /* several colons (IPv6 without brackets), or a bad port: as given */
    if (hl == 0)
        return 0;
    char host[256];
    if (hl >= sizeof host)
        return 0;
    memcpy(host, text, hl);
    host[hl] = '\0';
    struct in_addr a4;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return 0; /* an IPv4 literal */
    snprintf(sp->port, sizeof sp->port, "%s", colon ? colon + 1 : DEFAULT_PORT);
    if ((sp->host = strdup(host)) == NULL)
        return -1;
    return 0;
}

static void
strv_free(char **v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

static int
addrset_add_spec(addrset_t *a, const char *addr, const char *host, uint32_t spec)
{
    for (size_t i = 0; i < a->n; i++)
        if (!strcmp(a->addr[i], addr))
            return 0;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        char **na = realloc(a->addr, nc * sizeof *na);
        if (na == NULL)
            return -1;
        a->addr = na;
        const char **nh = realloc(a->host, nc * sizeof *nh);
        if (nh == NULL)
            return -1;
        a->host = nh;
        uint32_t *ns = realloc(a->spec, nc * sizeof *ns);
        if (ns == NULL)
            return -1;
        a->spec = ns;
        a->cap = nc;
    }
    if ((a->addr[a->n] = strdup(addr)) == NULL)
        return -1;
    a->host[a->n] = host;
    a->spec[a->n] = spec;
    a->n++;
    return 0;
}

static int
addrset_add(addrset_t *a, const char *addr, const char *host)
{
    return addrset_add_spec(a, addr, host, 0);
}

static void
addrset_free(addrset_t *a)
{
    strv_free(a->addr, a->n);
    free(a->host);
    free(a->spec);
    memset(a, 0, sizeof *a);
}

static int
addrset_has(const addrset_t *a, const char *addr)
{
    for (size_t i = 0; i < a->n; i++)
        if (!strcmp(a->addr[i], addr))
            return 1;
    return 0;
}

/* Keeps the entries of a that keep(arg, addr) says to keep. */
static void
addrset_filter(addrset_t *a, int (*keep)(const void *, const char *), const void *arg)
{
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (keep(arg, a->addr[i])) {
            a->addr[k] = a->addr[i];
            a->host[k] = a->host[i];
            a->spec[k] = a->spec[i];
            k++;
        } else {
            free(a->addr[i]);
        }
    }
    a->n = k;
}

/* ---- c-ares ---- */

static pthread_once_t ares_once = PTHREAD_ONCE_INIT;
static int ares_lib_rc;

static void
ares_lib_init(void)
{
    ares_lib_rc = ares_library_init(ARES_LIB_INIT_ALL);
}

/* The addresses one query produced. */
typedef struct query {
    addrset_t out;
    int status;   /* ARES_SUCCESS or the error */
    int pending;  /* callbacks not yet run */
    char port[8]; /* for SRV: not used; for addrinfo: the port to write */
    struct ares_srv_reply *srv;
} query_t;

static void
addrinfo_cb(void *arg, int status, int timeouts, struct ares_addrinfo *res)
{
    (void)timeouts;
    query_t *q = arg;
    q->pending--;
    q->status = status;
    if (status != ARES_SUCCESS || res == NULL)
        return;
    for (struct ares_addrinfo_node *n = res->nodes; n; n = n->ai_next) {
        char ip[INET6_ADDRSTRLEN], a[INET6_ADDRSTRLEN + 16];
        if (n->ai_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)n->ai_addr)->sin_addr, ip,
                      sizeof ip);
            snprintf(a, sizeof a, "ipv4:%s:%s", ip, q->port);
        } else if (n->ai_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)(void *)n->ai_addr)->sin6_addr, ip,
                      sizeof ip);
            snprintf(a, sizeof a, "ipv6:[%s]:%s", ip, q->port);
        } else {
            continue;
        }
        if (addrset_add(&q->out, a, NULL) != 0)
            q->status = ARES_ENOMEM;
    }
    ares_freeaddrinfo(res);
}

static void
srv_cb(void *arg, int status, int timeouts, unsigned char *abuf, int alen)
{
    (void)timeouts;
    query_t *q = arg;
    q->pending--;
    q->status = status;
    if (status != ARES_SUCCESS)
        return;
    struct ares_srv_reply *srv = NULL;
    q->status = ares_parse_srv_reply(abuf, alen, &srv);
    if (q->status == ARES_SUCCESS)
        q->srv = srv;
}

int
tqkv_membership_ares_fds(struct ares_channeldata *ch, struct pollfd *pf)
{
    _Static_assert(TQKV_ARES_MAX_FDS == ARES_GETSOCK_MAXNUM, "pollfd array size");
    ares_socket_t socks[ARES_GETSOCK_MAXNUM];
    int bm = ares_getsock(ch, socks, ARES_GETSOCK_MAXNUM);
    int n = 0;
    for (int i = 0; i < ARES_GETSOCK_MAXNUM; i++) {
        short ev = 0;
        /* c-ares' ARES_GETSOCK_* macros shift a signed 1 into bit 31 (undefined
         * behaviour for i = 15): the same bits, unsigned. */
        if ((unsigned)bm & (1u << i))
            ev |= POLLIN;
        if ((unsigned)bm & (1u << (i + ARES_GETSOCK_MAXNUM)))
            ev |= POLLOUT;
        if (!ev)
            continue;
        pf[n].fd = socks[i];
        pf[n].events = ev;
        pf[n].revents = 0;
        n++;
    }
    return n;
}

/* Runs the channel until no query is pending. */
static void
ares_run(ares_channel ch)
{
    for (;;) {
        struct pollfd pf[TQKV_ARES_MAX_FDS];
        int n = tqkv_membership_ares_fds(ch, pf);
        if (n == 0)
            return;
        struct timeval tv, *tvp = ares_timeout(ch, NULL, &tv);
        int ms = tvp ? (int)(tvp->tv_sec * 1000 + tvp->tv_usec / 1000) : 1000;
        int r = poll(pf, (nfds_t)n, ms);
        if (r < 0 && errno != EINTR)
            return;
        if (r <= 0) {
            ares_process_fd(ch, ARES_SOCKET_BAD, ARES_SOCKET_BAD);
            continue;
        }
        for (int i = 0; i < n; i++) {
            if (!pf[i].revents)
                continue;
            ares_socket_t rd =
                (pf[i].revents & (POLLIN | POLLERR | POLLHUP)) ? pf[i].fd : ARES_SOCKET_BAD;
            ares_socket_t wr = (pf[i].revents & POLLOUT) ? pf[i].fd : ARES_SOCKET_BAD;
            ares_process_fd(ch, rd, wr);
        }
    }
}

#define SRV_WINDOW 64 /* SRV hosts resolved at once */

/* Resolves one DNS target into out: 0 when DNS answered with at least one address. */
static int
resolve_spec(tqkv_membership_t *ms, const spec_t *sp, addrset_t *out)
{
    query_t srvq, aq;
    memset(&srvq, 0, sizeof srvq);
    memset(&aq, 0, sizeof aq);
    char srvname[300];
    snprintf(srvname, sizeof srvname, "_grpc._tcp.%s", sp->host);
    struct ares_addrinfo_hints hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(aq.port, sizeof aq.port, "%s", sp->port);
    srvq.pending = aq.pending = 1;
    ares_search(ms->ares, srvname, C_IN, T_SRV, srv_cb, &srvq);
    ares_getaddrinfo(ms->ares, sp->host, NULL, &hints, addrinfo_cb, &aq);
    ares_run(ms->ares);

    int ok = 0;
    if (srvq.status == ARES_SUCCESS && srvq.srv) {
        /* SRV records: resolve every named host at its port. */
        size_t nq = 0;
        for (struct ares_srv_reply *r = srvq.srv; r; r = r->next)
            nq++;
        query_t *qs = calloc(nq, sizeof *qs);
        struct ares_srv_reply **rv = calloc(nq, sizeof *rv);
        if (qs && rv) {
            size_t i = 0;
            for (struct ares_srv_reply *r = srvq.srv; r; r = r->next, i++)
                rv[i] = r;
            /* At most SRV_WINDOW hosts in flight, and one more round for those whose
             * answer was lost (a timeout, not "no such name"): a thousand queries sent at
             * once overflow the DNS server's socket buffer (dnsmasq lost a quarter of
             * them in tqkv-cluster-sim), and a lost host would drop out of the table. */
            for (int pass = 0; pass < 2; pass++) {
                for (size_t b = 0; b < nq; b += SRV_WINDOW) {
                    size_t e = b + SRV_WINDOW < nq ? b + SRV_WINDOW : nq, sent = 0;
                    for (i = b; i < e; i++) {
                        if (pass == 1 && qs[i].status != ARES_ETIMEOUT &&
                            qs[i].status != ARES_ECONNREFUSED && qs[i].status != ARES_ESERVFAIL)
                            continue;
                        snprintf(qs[i].port, sizeof qs[i].port, "%u", (unsigned)rv[i]->port);
                        qs[i].pending = 1;
                        ares_getaddrinfo(ms->ares, rv[i]->host, NULL, &hints, addrinfo_cb, &qs[i]);
                        sent++;
                    }
                    if (sent)
                        ares_run(ms->ares);
                }
            }
            for (i = 0; i < nq; i++) {
                for (size_t j = 0; j < qs[i].out.n; j++)
                    if (addrset_add(out, qs[i].out.addr[j], sp->host) == 0)
                        ok = 1;
                addrset_free(&qs[i].out);
            }
        }
        free(qs);
        free(rv);
    }
    if (srvq.srv)
        ares_free_data(srvq.srv);
    if (!ok && aq.status != ARES_SUCCESS && srvq.status != ARES_ENOTFOUND &&
        srvq.status != ARES_ENODATA) {
        /* The SRV answer was there but unusable (over 64 KiB: truncated even over TCP,
         * ~1,000 pods with long names) and took the A query down with it (both on one TCP
         * connection, which c-ares drops): ask for the A/AAAA records alone. */
        addrset_free(&aq.out);
        memset(&aq.out, 0, sizeof aq.out);
        aq.pending = 1;
        ares_getaddrinfo(ms->ares, sp->host, NULL, &hints, addrinfo_cb, &aq);
        ares_run(ms->ares);
    }
    if (!ok && aq.status == ARES_SUCCESS)
        for (size_t j = 0; j < aq.out.n; j++)
            if (addrset_add(out, aq.out.addr[j], sp->host) == 0)
                ok = 1;
    addrset_free(&srvq.out);
    addrset_free(&aq.out);
    return ok ? 0 : -1;
}

/* ---- identification ---- */

typedef struct ident {
    tqkv_member_t *m;
    char id[TQKV_MEMBERSHIP_NODE_ID_MAX];
    int rc; /* 0 answered, -1 not */
} ident_t;

typedef struct ident_run {
    tqkv_membership_t *ms;
    ident_t *v;
    size_t n;
    _Atomic size_t next;
} ident_run_t;

static void *
ident_worker(void *arg)
{
    ident_run_t *r = arg;
    for (;;) {
        size_t i = atomic_fetch_add(&r->next, 1);
        if (i >= r->n)
            break;
        ident_t *x = &r->v[i];
        x->id[0] = '\0';
        x->rc = r->ms->o.identify(r->ms->o.arg, x->m, x->id, sizeof x->id);
        x->id[sizeof x->id - 1] = '\0';
        atomic_fetch_add(x->rc == 0 ? &r->ms->st_identified : &r->ms->st_identify_fails, 1);
    }
    return NULL;
}

static void
identify_all(tqkv_membership_t *ms, ident_t *v, size_t n)
{
    if (n == 0 || ms->o.identify == NULL) {
        for (size_t i = 0; i < n; i++)
            v[i].rc = -1;
        return;
    }
    ident_run_t r = {.ms = ms, .v = v, .n = n};
    atomic_init(&r.next, 0);
    size_t nt = ms->o.identify_threads ? ms->o.identify_threads : 16;
    if (nt > n)
        nt = n;
    pthread_t th[64];
    if (nt > 64)
        nt = 64;
    size_t started = 0;
    for (size_t i = 1; i < nt; i++)
        if (pthread_create(&th[started], NULL, ident_worker, &r) == 0)
            started++;
    ident_worker(&r);
    for (size_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
}

/* ---- one pass ---- */

#define NEW_ORDER ((size_t)1 << 40)

/* A candidate slot of the table being built. */
typedef struct cand {
    tqkv_member_t *m; /* one reference held */
    char *node_id;    /* owned; NULL unknown */
    int fresh;        /* identified in this pass */
    int isnew;        /* not in the previous table */
    uint32_t spec;    /* the target that listed it first */
    size_t order;     /* position in the previous table, or NEW_ORDER + target order */
    int drop;
} cand_t;

static int
cand_cmp(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->spec != y->spec)
        return x->spec < y->spec ? -1 : 1;
    return strcmp(x->m->addr, y->m->addr);
}

static tqkv_member_t *
member_new(tqkv_membership_t *ms, const char *addr, const char *host)
{
    tqkv_member_t *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    atomic_init(&m->refs, 1);
    m->owner = ms;
    m->addr = strdup(addr);
    m->host = host ? strdup(host) : NULL;
    if (m->addr == NULL || (host && m->host == NULL)) {
        free(m->addr);
        free(m->host);
        free(m);
        return NULL;
    }
    if (ms->o.attach && (m->user = ms->o.attach(ms->o.arg, addr, host)) == NULL) {
        free(m->addr);
        free(m->host);
        free(m);
        return NULL;
    }
    return m;
}

/* Collects this pass's addresses; a DNS target that fails keeps its previous ones. */
static int
collect(tqkv_membership_t *ms, addrset_t *all)
{
    for (size_t i = 0; i < ms->nspec; i++) {
        spec_t *sp = &ms->spec[i];
        uint32_t si = (uint32_t)i;
        if (sp->host == NULL || !ms->have_ares) {
            if (addrset_add_spec(all, sp->text, NULL, si) != 0)
                return -1;
            continue;
        }
        addrset_t got = {0};
        if (resolve_spec(ms, sp, &got) == 0) {
            char **nv = calloc(got.n, sizeof *nv);
            if (nv) {
                size_t k = 0;
                for (; k < got.n && (nv[k] = strdup(got.addr[k])) != NULL; k++)
                    ;
                if (k == got.n) {
                    strv_free(sp->prev, sp->nprev);
                    sp->prev = nv;
                    sp->nprev = got.n;
                } else {
                    strv_free(nv, k);
                }
            }
        } else {
            atomic_fetch_add(&ms->st_dns_errors, 1);
        }
        addrset_free(&got);
        if (sp->nprev == 0) { /* never resolved: let gRPC's resolver try the name */
            if (addrset_add_spec(all, sp->text, NULL, si) != 0)
                return -1;
        }
        for (size_t k = 0; k < sp->nprev; k++)
            if (addrset_add_spec(all, sp->prev[k], sp->host, si) != 0)
                return -1;
    }
    return 0;
}

static int
same_table(const tqkv_member_table_t *a, const cand_t *c, size_t n)
{
    if (a == NULL || a->n != n)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (a->s[i].m != c[i].m)
            return 0;
        const char *x = a->s[i].node_id, *y = c[i].node_id;
        if ((x == NULL) != (y == NULL) || (x && strcmp(x, y)))
            return 0;
    }
    return 1;
}

static void
set_id(cand_t *c, const ident_t *x)
{
    free(c->node_id);
    c->node_id = x->id[0] ? strdup(x->id) : NULL;
    c->fresh = 1;
}

/* 1 when addr is a known alias of a member kept in cv (not dropped, same node id). */
static int
alias_of_kept(const tqkv_membership_t *ms, const cand_t *cv, size_t n, const char *addr)
{
    for (size_t a = 0; a < ms->nalias; a++) {
        if (strcmp(ms->alias_addr[a], addr))
            continue;
        for (size_t i = 0; i < n; i++)
            if (!cv[i].isnew && !cv[i].drop && cv[i].node_id &&
                !strcmp(cv[i].node_id, ms->alias_id[a]))
                return 1;
    }
    return 0;
}

static void
alias_add(tqkv_membership_t *ms, const char *addr, const char *id)
{
    for (size_t a = 0; a < ms->nalias; a++)
        if (!strcmp(ms->alias_addr[a], addr))
            return;
    char **na = realloc(ms->alias_addr, (ms->nalias + 1) * sizeof *na);
    if (na == NULL)
        return;
    ms->alias_addr = na;
    char **ni = realloc(ms->alias_id, (ms->nalias + 1) * sizeof *ni);
    if (ni == NULL)
        return;
    ms->alias_id = ni;
    char *x = strdup(addr), *y = strdup(id);
    if (x == NULL || y == NULL) {
        free(x);
        free(y);
        return;
    }
    ms->alias_addr[ms->nalias] = x;
    ms->alias_id[ms->nalias] = y;
    ms->nalias++;
}

static void
alias_prune(tqkv_membership_t *ms, const addrset_t *all, const cand_t *cv, size_t n)
{
    size_t k = 0;
    for (size_t a = 0; a < ms->nalias; a++) {
        int keep = 0;
        if (addrset_has(all, ms->alias_addr[a]))
            for (size_t i = 0; i < n && !keep; i++)
                keep = !cv[i].drop && cv[i].node_id && !strcmp(cv[i].node_id, ms->alias_id[a]);
        if (keep) {
            ms->alias_addr[k] = ms->alias_addr[a];
            ms->alias_id[k] = ms->alias_id[a];
            k++;
        } else {
            free(ms->alias_addr[a]);
            free(ms->alias_id[a]);
        }
    }
    ms->nalias = k;
}

typedef struct ghost_ctx {
    const addrset_t *all;
    const cand_t *cv;
    size_t n;
} ghost_ctx_t;

static int
keep_ghost(const void *arg, const char *addr)
{
    const ghost_ctx_t *g = arg;
    if (!addrset_has(g->all, addr))
        return 0;
    for (size_t i = 0; i < g->n; i++)
        if (!strcmp(g->cv[i].m->addr, addr) && g->cv[i].fresh && !g->cv[i].drop)
            return 0;
    return 1;
}

/* Merges addresses answering with one node id: asks the stale ones again; the older
 * member that still answers wins, a dead old address of a moved server goes. */
static void
merge_same_id(tqkv_membership_t *ms, cand_t *cv, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (cv[i].drop || cv[i].node_id == NULL)
            continue;
        for (size_t j = i + 1; j < n; j++) {
            if (cv[j].drop || cv[j].node_id == NULL || strcmp(cv[i].node_id, cv[j].node_id))
                continue;
            cand_t *pair[2] = {&cv[i], &cv[j]};
            for (int p = 0; p < 2; p++) {
                if (pair[p]->fresh)
                    continue;
                ident_t x = {.m = pair[p]->m};
                identify_all(ms, &x, 1);
                if (x.rc == 0) {
                    set_id(pair[p], &x);
                } else {
                    pair[p]->drop = 1;
                    addrset_add(&ms->ghost, pair[p]->m->addr, NULL);
                }
            }
            if (!cv[i].drop && !cv[j].drop && cv[i].node_id && cv[j].node_id &&
                !strcmp(cv[i].node_id, cv[j].node_id)) {
                cand_t *d = cv[i].order <= cv[j].order ? &cv[j] : &cv[i];
                d->drop = 1;
                alias_add(ms, d->m->addr, d->node_id);
            }
            if (cv[i].drop || cv[i].node_id == NULL)
                break;
        }
    }
}

/* Runs one pass under res_mu; returns the current version afterwards. */
static uint64_t
pass(tqkv_membership_t *ms)
{
    atomic_fetch_add(&ms->st_resolutions, 1);
    addrset_t all = {0};
    cand_t *cv = NULL;
    ident_t *iv = NULL;
    size_t n = 0;
    tqkv_member_table_t *old = ms->cur ? tqkv_membership_acquire(ms) : NULL;

    if (collect(ms, &all) != 0 || all.n == 0)
        goto out;
    if ((cv = calloc(all.n, sizeof *cv)) == NULL || (iv = calloc(all.n, sizeof *iv)) == NULL)
        goto out;
    /* Reuse members of the previous table; attach new addresses. */
    for (size_t i = 0; i < all.n; i++) {
        cand_t *c = &cv[n];
        c->spec = all.spec[i];
        if (old)
            for (size_t j = 0; j < old->n; j++)
                if (!strcmp(old->s[j].m->addr, all.addr[i])) {
                    c->m = old->s[j].m;
                    atomic_fetch_add(&c->m->refs, 1);
                    c->node_id = old->s[j].node_id ? strdup(old->s[j].node_id) : NULL;
                    c->order = j;
                    break;
                }
        if (c->m == NULL) {
            c->m = member_new(ms, all.addr[i], all.host[i]);
            if (c->m == NULL)
                continue; /* out of memory: this address waits for the next pass */
            c->order = NEW_ORDER + i;
            c->isnew = 1;
        }
        n++;
    }
    /* A known other spelling of a member that stays is not asked again. */
    for (size_t i = 0; i < n; i++)
        if (cv[i].isnew && alias_of_kept(ms, cv, n, cv[i].m->addr))
            cv[i].drop = 1;
    /* Identify new, unknown and suspect members. */
    size_t ni = 0;
    for (size_t i = 0; i < n; i++) {
        int suspect = atomic_exchange(&cv[i].m->suspect, 0);
        if (!cv[i].drop && (cv[i].isnew || cv[i].node_id == NULL || suspect))
            iv[ni++].m = cv[i].m;
    }
    identify_all(ms, iv, ni);
    for (size_t k = 0, i = 0; k < ni; k++) {
        while (cv[i].m != iv[k].m)
            i++;
        if (iv[k].rc == 0)
            set_id(&cv[i], &iv[k]);
        else if (cv[i].isnew && addrset_has(&ms->ghost, cv[i].m->addr))
            cv[i].drop = 1; /* still dead, and its server answers elsewhere */
    }
    merge_same_id(ms, cv, n);
    /* The excluded node id (ourselves) is nobody's peer. */
    for (size_t i = 0; i < n && ms->exclude; i++)
        if (cv[i].node_id && !strcmp(cv[i].node_id, ms->exclude))
            cv[i].drop = 1;
    /* Ghosts leave once DNS stops listing them or they answer; aliases once DNS stops
     * listing them or their member goes. */
    addrset_filter(&ms->ghost, keep_ghost, &(ghost_ctx_t){&all, cv, n});
    alias_prune(ms, &all, cv, n);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (cv[i].drop) {
            free(cv[i].node_id);
            member_unref(cv[i].m);
        } else {
            cv[k++] = cv[i];
        }
    }
    n = k;
    if (n == 0)
        goto out;
    qsort(cv, n, sizeof *cv, cand_cmp);
    if (same_table(old, cv, n))
        goto out;

    tqkv_member_table_t *t = calloc(1, sizeof *t);
    if (t == NULL || (t->s = calloc(n, sizeof *t->s)) == NULL ||
        (t->users = calloc(n, sizeof *t->users)) == NULL) {
        if (t)
            free(t->s);
        free(t);
        goto out;
    }
    atomic_init(&t->refs, 1);
    t->n = n;
    for (size_t i = 0; i < n; i++) {
        t->s[i].m = cv[i].m;
        t->s[i].node_id = cv[i].node_id;
        t->s[i].rank_id = tqkv_shard_target_id(cv[i].node_id ? cv[i].node_id : cv[i].m->addr);
        t->users[i] = cv[i].m->user;
        cv[i].m = NULL;
        cv[i].node_id = NULL;
    }
    /* NULL for small tables (and out of memory: the same order, slower) */
    t->rank_index = tqkv_shard_index_create(&t->s[0].rank_id, sizeof t->s[0], n);
    n = 0;
    pthread_mutex_lock(&ms->cur_mu);
    tqkv_member_table_t *prev = ms->cur;
    t->version = prev ? prev->version + 1 : 1;
    ms->cur = t;
    pthread_mutex_unlock(&ms->cur_mu);
    atomic_store(&ms->st_tables, t->version);
    tqkv_membership_release(prev);
out:
    for (size_t i = 0; i < n; i++) {
        free(cv[i].node_id);
        member_unref(cv[i].m);
    }
    free(cv);
    free(iv);
    addrset_free(&all);
    tqkv_membership_release(old);
    pthread_mutex_lock(&ms->cur_mu);
    uint64_t v = ms->cur ? ms->cur->version : 0;
    pthread_mutex_unlock(&ms->cur_mu);
    return v;
}

uint64_t
tqkv_membership_refresh(tqkv_membership_t *ms)
{
    pthread_mutex_lock(&ms->res_mu);
    uint64_t v = pass(ms);
    pthread_mutex_unlock(&ms->res_mu);
    pthread_mutex_lock(&ms->mu);
    ms->last_ns = tqkv_clock_ns();
    pthread_mutex_unlock(&ms->mu);
    return v;
}

/* ---- thread ---- */

static void *
resolver_main(void *arg)
{
    tqkv_membership_t *ms = arg;
    uint64_t interval_ns = (uint64_t)ms->o.interval_ms * 1000000ull;
    uint64_t min_kick_ns = (uint64_t)ms->o.min_kick_ms * 1000000ull;
    pthread_mutex_lock(&ms->mu);
    while (!ms->stop) {
        uint64_t now = tqkv_clock_ns();
        uint64_t due = ms->o.interval_ms == UINT32_MAX ? UINT64_MAX : ms->last_ns + interval_ns;
        if (ms->kicked && ms->last_ns + min_kick_ns < due)
            due = ms->last_ns + min_kick_ns;
        if (now < due) {
            struct timespec ts;
            atomic_fetch_add(&ms->st_idle_checks, 1);
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t wait = due - now;
            if (wait > 1000000000ull)
                wait = 1000000000ull; /* re-check at least once a second */
            uint64_t ns = (uint64_t)ts.tv_nsec + wait % 1000000000ull;
            ts.tv_sec += (time_t)(wait / 1000000000ull + ns / 1000000000ull);
            ts.tv_nsec = (long)(ns % 1000000000ull);
            pthread_cond_timedwait(&ms->cv, &ms->mu, &ts);
            continue;
        }
        ms->kicked = 0;
        pthread_mutex_unlock(&ms->mu);
        tqkv_membership_refresh(ms);
        pthread_mutex_lock(&ms->mu);
    }
    pthread_mutex_unlock(&ms->mu);
    return NULL;
}

void
tqkv_membership_kick(tqkv_membership_t *ms, const tqkv_member_t *m)
{
    if (ms == NULL)
        return;
    if (m)
        atomic_store(&((tqkv_member_t *)m)->suspect, 1);
    atomic_fetch_add(&ms->st_kicks, 1);
    pthread_mutex_lock(&ms->mu);
    ms->kicked = 1;
    pthread_cond_signal(&ms->cv);
    pthread_mutex_unlock(&ms->mu);
}

void
tqkv_membership_stats(tqkv_membership_t *ms, tqkv_membership_stats_t *out)
{
    out->resolutions = atomic_load(&ms->st_resolutions);
    out->dns_errors = atomic_load(&ms->st_dns_errors);
    out->tables = atomic_load(&ms->st_tables);
    out->identified = atomic_load(&ms->st_identified);
    out->identify_fails = atomic_load(&ms->st_identify_fails);
    out->kicks = atomic_load(&ms->st_kicks);
    out->idle_checks = atomic_load(&ms->st_idle_checks);
}

/* ---- create / destroy ---- */

static void
specs_free(tqkv_membership_t *ms)
{
    for (size_t i = 0; i < ms->nspec; i++) {
        free(ms->spec[i].text);
        free(ms->spec[i].host);
        strv_free(ms->spec[i].prev, ms->spec[i].nprev);
    }
    free(ms->spec);
}

tqkv_status_t
tqkv_membership_create(const tqkv_membership_opts_t *o, tqkv_membership_t **out, char *err,
                       size_t errlen)
{
    tqkv_status_t st = TQKV_ENOMEM;
    *out = NULL;
    if (errlen)
        err[0] = '\0';
    if (o == NULL || o->num_targets == 0 || o->targets == NULL) {
        snprintf(err, errlen, "membership: no target");
        return TQKV_EINVAL;
    }
    tqkv_membership_t *ms = calloc(1, sizeof *ms);
    if (ms == NULL) {
        snprintf(err, errlen, "membership: out of memory");
        return TQKV_ENOMEM;
    }
    ms->o = *o;
    ms->o.targets = NULL;
    ms->o.dns_servers = NULL;
    ms->o.exclude_node_id = NULL;
    if (o->exclude_node_id && (ms->exclude = strdup(o->exclude_node_id)) == NULL)
        goto fail;
    if (ms->o.interval_ms == 0)
        ms->o.interval_ms = TQKV_MEMBERSHIP_DEFAULT_INTERVAL_MS;
    if (ms->o.min_kick_ms == 0)
        ms->o.min_kick_ms = 200;
    pthread_mutex_init(&ms->res_mu, NULL);
    pthread_mutex_init(&ms->cur_mu, NULL);
    pthread_mutex_init(&ms->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ms->cv, &ca);
    pthread_condattr_destroy(&ca);

    if ((ms->spec = calloc(o->num_targets, sizeof *ms->spec)) == NULL)
        goto fail;
    int any_dns = 0;
    for (size_t i = 0; i < o->num_targets; i++) {
        if (o->targets[i] == NULL || o->targets[i][0] == '\0') {
            snprintf(err, errlen, "membership: empty target");
            st = TQKV_EINVAL;
            goto fail;
        }
        if (spec_init(&ms->spec[i], o->targets[i], o->resolve) != 0)
            goto fail;
        ms->nspec++;
        any_dns |= ms->spec[i].host != NULL;
    }
    if (any_dns) {
        pthread_once(&ares_once, ares_lib_init);
        struct ares_options ao;
        memset(&ao, 0, sizeof ao);
        ao.timeout = (int)(o->dns_timeout_ms ? o->dns_timeout_ms : 1000);
        ao.tries = 2;
        int rc = ares_lib_rc == ARES_SUCCESS
                     ? ares_init_options(&ms->ares, &ao, ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES)
                     : ares_lib_rc;
        if (rc != ARES_SUCCESS) {
            snprintf(err, errlen, "membership: c-ares: %s", ares_strerror(rc));
            st = TQKV_EINVAL;
            goto fail;
        }
        ms->have_ares = 1;
        if (o->dns_servers && o->dns_servers[0]) {
            if ((ms->dns_servers = strdup(o->dns_servers)) == NULL)
                goto fail;
            rc = ares_set_servers_ports_csv(ms->ares, ms->dns_servers);
            if (rc != ARES_SUCCESS) {
                snprintf(err, errlen, "membership: DNS servers '%s': %s", ms->dns_servers,
                         ares_strerror(rc));
                st = TQKV_EINVAL;
                goto fail;
            }
        }
    }
    if (tqkv_membership_refresh(ms) == 0) {
        snprintf(err, errlen, "membership: no server (every target excluded, or out of memory)");
        st = TQKV_EUNAVAILABLE;
        goto fail;
    }
    if (any_dns || o->identify) {
        if (pthread_create(&ms->thread, NULL, resolver_main, ms) != 0) {
            snprintf(err, errlen, "membership: cannot start the resolver thread");
            goto fail;
        }
        ms->have_thread = 1;
    }
    *out = ms;
    return TQKV_OK;
fail:
    if (st == TQKV_ENOMEM && err[0] == '\0')
        snprintf(err, errlen, "membership: out of memory");
    tqkv_membership_destroy(ms);
    return st;
}

void
tqkv_membership_destroy(tqkv_membership_t *ms)
{
    if (ms == NULL)
        return;
    if (ms->have_thread) {
        pthread_mutex_lock(&ms->mu);
        ms->stop = 1;
        pthread_cond_signal(&ms->cv);
        pthread_mutex_unlock(&ms->mu);
        pthread_join(ms->thread, NULL);
    }
    tqkv_membership_release(ms->cur);
    if (ms->have_ares)
        ares_destroy(ms->ares);
    specs_free(ms);
    addrset_free(&ms->ghost);
    free(ms->exclude);
    strv_free(ms->alias_addr, ms->nalias);
    strv_free(ms->alias_id, ms->nalias);
    free(ms->dns_servers);
    pthread_mutex_destroy(&ms->res_mu);
    pthread_mutex_destroy(&ms->cur_mu);
    pthread_mutex_destroy(&ms->mu);
    pthread_cond_destroy(&ms->cv);
    free(ms);
}
