/* server_proc.c - real tqkv-server processes for the suites (see server_proc.h). */
#include "tests/support/server_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double
proc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *
proc_drain(void *arg)
{
    srv_t *s = arg;
    char buf[4096];
    ssize_t n;
    int echo = getenv("TQKV_TEST_SERVER_LOG") != NULL; /* debugging: show server output */
    while ((n = read(s->fd, buf, sizeof buf)) > 0) {
        if (echo)
            fwrite(buf, 1, (size_t)n, stderr);
        if (s->log_fd >= 0 && write(s->log_fd, buf, (size_t)n) != n)
            fprintf(stderr, "server_proc: log copy: short write\n");
    }
    if (s->log_fd >= 0)
        close(s->log_fd);
    s->log_fd = -1;
    return NULL;
}

const char *
srv_path(void)
{
    const char *p = getenv("TQKV_SERVER");
    return p && access(p, X_OK) == 0 ? p : NULL;
}

int
srv_start(srv_t *s, int port, const char *const *extra)
{
    return srv_start_log(s, port, extra, NULL);
}

int
srv_start_log(srv_t *s, int port, const char *const *extra, const char *log_path)
{
    const char *path = srv_path();
    char listen[64];
    const char *argv[40];
    int n = 0, pfd[2];
    memset(s, 0, sizeof *s);
    s->log_fd = -1;
    if (path == NULL || pipe(pfd) != 0)
        return -1;
    if (log_path &&
        (s->log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) < 0) {
        close(pfd[0]);
        close(pfd[1]);
        return -1;
    }
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    argv[n++] = path;
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--drain-seconds";
    argv[n++] = "1";
    for (int i = 0; extra && extra[i] && n < 38; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    s->pid = fork();
    if (s->pid < 0) {
        if (s->log_fd >= 0)
            close(s->log_fd);
        return -1;
    }
    if (s->pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        close(pfd[1]);
        execv(path, (char *const *)argv);
        _exit(127);
    }
    close(pfd[1]);
    s->fd = pfd[0];
    fcntl(s->fd, F_SETFL, O_NONBLOCK);
    char line[8192];
    size_t len = 0;
    double t0 = proc_now();
    while (proc_now() - t0 < 30) {
        ssize_t r = read(s->fd, line + len, sizeof line - 1 - len);
        if (r == 0)
            break;
        if (r < 0) {
            if (errno != EAGAIN)
                break;
            usleep(5000);
            continue;
        }
        if (s->log_fd >= 0 && write(s->log_fd, line + len, (size_t)r) != r)
            fprintf(stderr, "server_proc: log copy: short write\n");
        len += (size_t)r;
        line[len] = '\0';
        char *p = strstr(line, "listening on ");
        if (p && strchr(p, '\n')) {
            p += strlen("listening on ");
            size_t k = strcspn(p, " \t\r\n");
            if (k < sizeof s->addr) {
                memcpy(s->addr, p, k);
                s->addr[k] = '\0';
                char *c = strrchr(s->addr, ':');
                s->port = c ? atoi(c + 1) : 0;
                fcntl(s->fd, F_SETFL, 0);
                s->draining = pthread_create(&s->drain, NULL, proc_drain, s) == 0;
                return 0;
            }
        }
        if (len > sizeof line / 2) {
            char *nl = strrchr(line, '\n');
            size_t keep = nl ? len - (size_t)(nl + 1 - line) : 0;
            memmove(line, line + len - keep, keep);
            len = keep;
        }
    }
    fprintf(stderr, "srv_start: %s did not report listening (port %d)\n", path, port);
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    close(s->fd);
    if (s->log_fd >= 0)
        close(s->log_fd);
    s->log_fd = -1;
    s->pid = 0;
    return -1;
}

int
srv_wait(srv_t *s, double timeout)
{
    double t0 = proc_now();
    while (s->pid > 0) {
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
            s->pid = 0;
            break;
        }
        if (proc_now() - t0 > timeout)
            return -1;
        usleep(10000);
    }
    if (s->draining) {
        pthread_join(s->drain, NULL);
        s->draining = 0;
        close(s->fd);
    }
    return 0;
}

void
srv_kill(srv_t *s, int sig)
{
    if (s->pid > 0)
        kill(s->pid, sig);
}

void
srv_stop(srv_t *s)
{
    if (s->pid <= 0)
        return;
    srv_kill(s, SIGTERM);
    if (srv_wait(s, 10) != 0) {
        srv_kill(s, SIGKILL);
        srv_wait(s, 10);
    }
}
