/* server_proc.h - start and stop real tqkv-server processes for the suites that talk
 * to one (client, shard, data channel, NCCL, TLS, namespace policy).
 *
 * The server binary comes from env TQKV_SERVER (CTest passes the built target). A
 * server is started with --listen 127.0.0.1:PORT (0 = any free port) and its
 * "listening on HOST:PORT" line is read from its output; the rest of the output is
 * drained by a thread so the server never blocks on a full pipe (set
 * TQKV_TEST_SERVER_LOG to see it on stderr).
 */
#ifndef TQKV_TESTS_SUPPORT_SERVER_PROC_H
#define TQKV_TESTS_SUPPORT_SERVER_PROC_H

#include <pthread.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A running server. Filled by srv_start; a value, embed it. */
typedef struct srv {
    pid_t pid;     /* 0 when not running */
    int fd;        /* read end of its stdout + stderr */
    int port;      /* the port it listens on */
    char addr[64]; /* "127.0.0.1:PORT", as it reported */
    pthread_t drain;
    int draining;
    int log_fd; /* srv_start_log: the output is also appended here (-1: not) */
} srv_t;

/* Monotonic seconds (for deadlines and timings). */
double proc_now(void);

/* Path of the server under test (env TQKV_SERVER, executable), or NULL. */
const char *srv_path(void);

/* Starts a server on 127.0.0.1:port (0 = a free one) with --drain-seconds 1 and extra
 * args (NULL-ended, may be NULL; at most 33). Returns 0 once it reported "listening
 * on", else -1 (no server left running; the reason on stderr). */
int srv_start(srv_t *s, int port, const char *const *extra);

/* srv_start, with the server's output (after "listening on") also appended to the file
 * log_path (created; NULL = as srv_start), for tests that check its log lines. */
int srv_start_log(srv_t *s, int port, const char *const *extra, const char *log_path);

/* Waits up to timeout seconds for the server to exit. Returns 0 when it did. */
int srv_wait(srv_t *s, double timeout);

/* Sends sig to the server, if running. */
void srv_kill(srv_t *s, int sig);

/* SIGTERM, then SIGKILL after 10 s. No-op when not running. */
void srv_stop(srv_t *s);

#ifdef __cplusplus
}
#endif

#endif
