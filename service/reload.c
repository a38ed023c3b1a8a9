/* reload.c - token file and TLS certificate reload: on SIGHUP (tqkv_server_reload, called by
 * server_main) and on file change (an inotify thread).
 *
 * Tokens: the table in force is s->auth; every call takes a reference to it when it starts
 * (tqkv__auth_acquire) and checks its token against that table for its whole life, so a
 * reload changes the verdict only for calls that start after it and never fails a call in
 * flight. A reload loads the file into a new table and swaps the pointer under auth_lk;
 * the old table goes when its last call ends.
 *
 * TLS: tqkv_tls_reload (tls.c) parks the new configuration for the next handshake.
 *
 * Peers: after a reload that changed something, and at every SIGHUP, the forwarding client
 * is made again with the peer CA, certificate and peer token read anew (tqkv__fwd_reload);
 * the hand-off reads them at SIGTERM.
 *
 * Watching: inotify on the directories holding the files, not on the files, because
 * Kubernetes updates a mounted Secret by renaming a "..data" symlink in the directory, and
 * editors and `mv` replace a file by renaming over it (a watch on the old inode would see
 * nothing). An event whose name is one of the files, or starts with ".." (Kubernetes),
 * arms a 250 ms debounce; the reload runs once the directory has been quiet that long, so
 * a file written in pieces is read whole. A file that is unchanged is skipped silently.
 *
 * Locking: reload_mu serializes reloads (SIGHUP vs. the watcher); auth_lk is a leaf.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <time.h>
#include <unistd.h>

#include "service/dc_server.h"
#include "service/forward.h"
#include "service/log.h"
#include "service/service_internal.h"
#include "service/tls.h"

#define DEBOUNCE_MS 250

tqkv_auth_t *
tqkv__auth_acquire(tqkv_server_t *s)
{
    if (atomic_load_explicit(&s->auth, memory_order_relaxed) == NULL)
        return NULL; /* auth is off for the server's life */
    pthread_rwlock_rdlock(&s->auth_lk);
    tqkv_auth_t *a = tqkv_auth_ref(atomic_load_explicit(&s->auth, memory_order_relaxed));
    pthread_rwlock_unlock(&s->auth_lk);
    return a;
}

/* "rejected" lines are errors: the operator's change did not take effect. */
static void
log_rejected(const char *file, const char *path, const char *trigger, const char *err)
{
    char qp[1100], qe[1100];
    tqkv_log_quote(qp, sizeof qp, path);
    tqkv_log_quote(qe, sizeof qe, err);
    tqkv_log(TQKV_LOG_ERROR, "reload rejected; the previous file stays in force",
             "file=%s path=\"%s\" trigger=%s error=\"%s\"", file, qp, trigger, qe);
}

/* Returns 1 when a new table is in force. */
static int
reload_tokens(tqkv_server_t *s, const char *trigger, int quiet)
{
    char err[1024];
    tqkv_auth_t *n = NULL;
    if (tqkv_auth_load(s->cfg.auth_tokens, &n, err, sizeof err) != TQKV_OK) {
        log_rejected("tokens", s->cfg.auth_tokens, trigger, err);
        tqkv_metrics_reload(s->metrics, 0, 0);
        return 0;
    }
    tqkv_auth_t *cur = tqkv__auth_acquire(s);
    int same = tqkv_auth_same_file(cur, n);
    tqkv_auth_destroy(cur);
    if (same) {
        tqkv_auth_destroy(n);
        tqkv_log(quiet ? TQKV_LOG_DEBUG : TQKV_LOG_INFO, "reload: file unchanged",
                 "file=tokens trigger=%s", trigger);
        return 0;
    }
    size_t count = tqkv_auth_count(n);
    pthread_rwlock_wrlock(&s->auth_lk);
    tqkv_auth_t *old = atomic_exchange_explicit(&s->auth, n, memory_order_relaxed);
    pthread_rwlock_unlock(&s->auth_lk);
    tqkv_auth_destroy(old); /* freed when the last call that started with it ends */
    tqkv_metrics_reload(s->metrics, 0, 1);
    tqkv_log(TQKV_LOG_INFO, "reloaded", "file=tokens tokens=%zu trigger=%s", count, trigger);
    return 1;
}

/* Returns 1 when new certificates are in force. */
static int
reload_tls(tqkv_server_t *s, const char *trigger, int quiet)
{
    char err[1024];
    int changed = 0;
    const char *cert, *key, *ca;
    tqkv_tls_paths(s->tls, &cert, &key, &ca);
    if (tqkv_tls_reload(s->tls, &changed, err, sizeof err) != TQKV_OK) {
        log_rejected("tls", cert, trigger, err);
        tqkv_metrics_reload(s->metrics, 1, 0);
        return 0;
    }
    if (!changed) {
        tqkv_log(quiet ? TQKV_LOG_DEBUG : TQKV_LOG_INFO, "reload: file unchanged",
                 "file=tls trigger=%s", trigger);
        return 0;
    }
    tqkv_metrics_reload(s->metrics, 1, 1);
    if (tqkv__dc_tls_reload(s, err, sizeof err) != TQKV_OK)
        tqkv_log(TQKV_LOG_WARN, "reload: data channels keep the old certificate", "reason=\"%s\"",
                 err);
    time_t na = (time_t)tqkv_tls_not_after(s->tls);
    struct tm tm;
    char when[32] = "?";
    if (gmtime_r(&na, &tm))
        strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    tqkv_log(TQKV_LOG_INFO, "reloaded", "file=tls not_after=%s trigger=%s", when, trigger);
    return 1;
}

static void
do_reload(tqkv_server_t *s, const char *trigger, int quiet)
{
    pthread_mutex_lock(&s->reload_mu);
    int changed = 0;
    if (s->cfg.auth_tokens[0])
        changed |= reload_tokens(s, trigger, quiet);
    if (s->tls)
        changed |= reload_tls(s, trigger, quiet);
    pthread_mutex_unlock(&s->reload_mu);
    /* Peers: the forwarding client reads the peer CA, its certificate and the peer token
     * again (the hand-off reads them at SIGTERM anyway); at SIGHUP always, since the peer
     * CA or token may have changed alone. */
    if (changed || !quiet)
        tqkv__fwd_reload(s);
}

void
tqkv_server_reload(tqkv_server_t *s, const char *trigger)
{
    if (!s->cfg.auth_tokens[0] && !s->tls) {
        tqkv_log(TQKV_LOG_INFO, "reload: no token file or TLS configured", "trigger=%s", trigger);
        return;
    }
    do_reload(s, trigger, 0);
}

/* ---- the inotify watcher ---- */

/* The names the watcher reacts to: the basenames of the configured files. */
typedef struct watched {
    const char *names[5]; /* token file, certificate, key, CA (into cfg), NULL-terminated */
} watched_t;

static const char *
base_of(const char *path)
{
    const char *b = strrchr(path, '/');
    return b ? b + 1 : path;
}

static int
relevant(const watched_t *w, const struct inotify_event *ev)
{
    if (ev->len == 0)
        return 0;
    if (ev->name[0] == '.' && ev->name[1] == '.')
        return 1; /* a Kubernetes volume update ("..data" swapped) */
    for (int i = 0; w->names[i]; i++)
        if (strcmp(ev->name, w->names[i]) == 0)
            return 1;
    return 0;
}

static void *
watch_main(void *arg)
{
    tqkv_server_t *s = arg;
    watched_t w;
    memset(&w, 0, sizeof w);
    int k = 0;
    if (s->cfg.auth_tokens[0])
        w.names[k++] = base_of(s->cfg.auth_tokens);
    if (s->tls) {
        const char *cert, *key, *ca;
        tqkv_tls_paths(s->tls, &cert, &key, &ca);
        w.names[k++] = base_of(cert);
        w.names[k++] = base_of(key);
        if (ca[0])
            w.names[k++] = base_of(ca);
    }
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int armed = 0;
    for (;;) {
        struct pollfd p[2] = {{s->watch_fd, POLLIN, 0}, {s->watch_wake[0], POLLIN, 0}};
        int r = poll(p, 2, armed ? DEBOUNCE_MS : -1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 || (p[1].revents & (POLLIN | POLLHUP)))
            break;
        if (r == 0) { /* quiet for DEBOUNCE_MS after a change */
            armed = 0;
            do_reload(s, "file-change", 1);
            continue;
        }
        ssize_t n = read(s->watch_fd, buf, sizeof buf);
        if (n <= 0)
            continue;
        for (char *q = buf; q < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)q;
            if (relevant(&w, ev))
                armed = 1;
            q += sizeof *ev + ev->len;
        }
    }
    return NULL;
}

void
tqkv__reload_watch_start(tqkv_server_t *s)
{
    const char *paths[4];
    int np = 0;
    if (s->cfg.auth_tokens[0])
        paths[np++] = s->cfg.auth_tokens;
    if (s->tls) {
        const char *cert, *key, *ca;
        tqkv_tls_paths(s->tls, &cert, &key, &ca);
        paths[np++] = cert;
        paths[np++] = key;
        if (ca[0])
            paths[np++] = ca;
    }
    if (np == 0)
        return;
    s->watch_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (s->watch_fd < 0) {
        tqkv_log(TQKV_LOG_WARN, "cannot watch the token/TLS files; reload them with SIGHUP",
                 "error=\"%s\"", strerror(errno));
        return;
    }
    int watched = 0;
    char dirs[4][PATH_MAX];
    int nd = 0;
    for (int i = 0; i < np; i++) {
        const char *b = strrchr(paths[i], '/');
        char d[PATH_MAX];
        if (!b)
            snprintf(d, sizeof d, ".");
        else if (b == paths[i])
            snprintf(d, sizeof d, "/");
        else
            snprintf(d, sizeof d, "%.*s", (int)(b - paths[i]), paths[i]);
        int dup = 0;
        for (int j = 0; j < nd; j++)
            dup |= strcmp(dirs[j], d) == 0;
        if (dup)
            continue;
        memcpy(dirs[nd++], d, sizeof d);
        if (inotify_add_watch(s->watch_fd, d,
                              IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_MODIFY) <
            0) {
            char q[PATH_MAX + 16];
            tqkv_log_quote(q, sizeof q, d);
            tqkv_log(TQKV_LOG_WARN, "cannot watch a directory; reload its files with SIGHUP",
                     "dir=\"%s\" error=\"%s\"", q, strerror(errno));
            continue;
        }
        watched++;
    }
    if (watched == 0 || pipe(s->watch_wake) != 0) {
        close(s->watch_fd);
        s->watch_fd = -1;
        return;
    }
    fcntl(s->watch_wake[0], F_SETFD, FD_CLOEXEC);
    fcntl(s->watch_wake[1], F_SETFD, FD_CLOEXEC);
    if (pthread_create(&s->watch_thread, NULL, watch_main, s) != 0) {
        tqkv_log(TQKV_LOG_WARN, "cannot start the file watcher; reload with SIGHUP", NULL);
        close(s->watch_wake[0]);
        close(s->watch_wake[1]);
        close(s->watch_fd);
        s->watch_fd = s->watch_wake[0] = s->watch_wake[1] = -1;
        return;
    }
    s->watching = 1;
    tqkv_log(TQKV_LOG_INFO, "watching token/TLS files for changes", "dirs=%d", watched);
}

void
tqkv__reload_watch_stop(tqkv_server_t *s)
{
    if (!s->watching)
        return;
    s->watching = 0;
    ssize_t w = write(s->watch_wake[1], "x", 1);
    (void)w;
    pthread_join(s->watch_thread, NULL);
    close(s->watch_wake[0]);
    close(s->watch_wake[1]);
    close(s->watch_fd);
    s->watch_fd = s->watch_wake[0] = s->watch_wake[1] = -1;
}
