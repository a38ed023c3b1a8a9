/* openssl_exit.c - a thread that ends while the process exits keeps its OpenSSL state
 * freed once tqkv-server's start-up (tqkv_tls_process_init) has run.
 *
 * The failure it guards against (docs/testing.md, Findings): OpenSSL registers an atexit
 * cleanup that deletes its per-thread keys. A gRPC thread still ending at that moment (an
 * executor thread joined by gRPC's detached clean-up thread) then skips OpenSSL's
 * destructor, and its error state (allocated by ERR_clear_error before each TLS step) is
 * reported by LeakSanitizer: tqkv-server exited with a leak report in 1 of ~30 ASan runs.
 *
 * Each case runs in a fresh process (this program with --child), so OpenSSL is first
 * initialised there: a thread calls ERR_clear_error and waits; main registers an atexit
 * handler before OpenSSL does (so it runs after OpenSSL's cleanup) that lets the thread
 * end and joins it; LeakSanitizer checks last.
 *   bare: no tqkv_tls_process_init - must be reported (the detector sees the case);
 *   init: tqkv_tls_process_init first, as tqkv-server's main - must exit 0, no report.
 * Exits 77 (skipped) in a build without LeakSanitizer.
 */
#include <openssl/err.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "service/tls.h"

#if defined(__SANITIZE_ADDRESS__)
#define HAVE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HAVE_LSAN 1
#endif
#endif

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_ready, g_go;
static pthread_t g_thread;

static void *
thread_main(void *arg)
{
    (void)arg;
    ERR_clear_error(); /* what gRPC's TLS code does first on each of its threads */
    pthread_mutex_lock(&g_mu);
    g_ready = 1;
    pthread_cond_broadcast(&g_cv);
    while (!g_go)
        pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

/* Registered before OpenSSL's own handler, so it runs after it. */
static void
end_thread(void)
{
    pthread_mutex_lock(&g_mu);
    g_go = 1;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    pthread_join(g_thread, NULL);
}

static int
child(int init)
{
    if (init && tqkv_tls_process_init() != TQKV_OK) {
        fprintf(stderr, "tqkv_tls_process_init failed\n");
        return 3;
    }
    atexit(end_thread);
    if (pthread_create(&g_thread, NULL, thread_main, NULL) != 0)
        return 4;
    pthread_mutex_lock(&g_mu);
    while (!g_ready)
        pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    return 0; /* exit: OpenSSL's atexit (bare only), end_thread, then the leak check */
}

#ifdef HAVE_LSAN
/* Runs `self --child mode`; *status is its wait status, its stderr goes to out. */
static int
run_child(const char *self, const char *mode, int *status, char *out, size_t cap)
{
    int fd[2];
    if (pipe(fd) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        close(fd[1]);
        /* Full malloc stacks: the fast unwinder stops in libcrypto (no frame pointers). */
        const char *o = getenv("ASAN_OPTIONS");
        char opts[1024];
        snprintf(opts, sizeof opts, "%s%sfast_unwind_on_malloc=0", o ? o : "", o && *o ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
        unsetenv("LSAN_OPTIONS"); /* no suppressions: nothing may hide the case */
        execl(self, self, "--child", mode, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    size_t n = 0;
    ssize_t r;
    char sink[4096];
    /* Keep what fits, drain the rest so the child never blocks on a full pipe. */
    for (;;) {
        int room = n < cap - 1;
        r = room ? read(fd[0], out + n, cap - 1 - n) : read(fd[0], sink, sizeof sink);
        if (r <= 0)
            break;
        if (room)
            n += (size_t)r;
    }
    out[n] = '\0';
    close(fd[0]);
    return waitpid(pid, status, 0) == pid ? 0 : -1;
}
#endif

int
main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--child") == 0)
        return child(strcmp(argv[2], "init") == 0);
#ifndef HAVE_LSAN
    printf("SKIPPED: openssl_exit needs LeakSanitizer (the ASan build)\n");
    return 77;
#else
    static char out[1 << 16];
    int status, failed = 0;

    if (run_child("/proc/self/exe", "bare", &status, out, sizeof out) != 0)
        return 2;
    int reported = strstr(out, "LeakSanitizer") != NULL && strstr(out, "ERR_clear_error") != NULL;
    int ok_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("%s  without tqkv_tls_process_init: the thread's OpenSSL error state is reported "
           "(exit %s)\n",
           reported && !ok_exit ? "PASS" : "FAIL", ok_exit ? "0" : "non-zero");
    if (!(reported && !ok_exit)) {
        failed = 1;
        fprintf(stderr, "child stderr:\n%s\n", out);
    }

    if (run_child("/proc/self/exe", "init", &status, out, sizeof out) != 0)
        return 2;
    reported = strstr(out, "LeakSanitizer") != NULL;
    ok_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("%s  with tqkv_tls_process_init first: exit 0, no leak report\n",
           ok_exit && !reported ? "PASS" : "FAIL");
    if (!(ok_exit && !reported)) {
        failed = 1;
        fprintf(stderr, "child stderr:\n%s\n", out);
    }
    return failed;
#endif
}
