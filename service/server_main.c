/* server_main.c - tqkv-server: parse flags, serve until SIGTERM/SIGINT, drain, exit.
 *
 * Signals are blocked in every thread and taken synchronously by main with
 * sigwait, so the graceful stop runs on an ordinary thread. Exit status: 0 after a
 * clean stop, 1 when start-up fails, 2 for bad flags.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "kernels/version.h"
#include "service/config.h"
#include "service/log.h"
#include "service/server.h"

int
main(int argc, char **argv)
{
    tqkv_server_config_t cfg;
    char err[512];
    sigset_t sigs;
    int sig = 0;

    tqkv_config_default(&cfg);
    if (tqkv_config_parse(&cfg, argc, argv, err, sizeof err) != TQKV_OK) {
        fprintf(stderr, "tqkv-server: %s\n", err);
        return 2;
    }
    if (cfg.help) {
        tqkv_config_usage(stdout);
        return 0;
    }
    if (cfg.version) {
        tqkv_version_fprint(stdout, "tqkv-server");
        return 0;
    }
    tqkv_log_setup(cfg.log_level, cfg.log_format, stderr);
    {
        extern char **environ;
        char names[512];
        if (tqkv_config_unknown_env(environ, names, sizeof names) > 0)
            tqkv_log(TQKV_LOG_WARN, "unknown TQKV_* environment variables ignored", "names=\"%s\"",
                     names);
    }

    signal(SIGPIPE, SIG_IGN);
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* inherited by every thread from here */

    if (tqkv_config_listen_is_public(cfg.listen) && !cfg.tls_cert[0] && !cfg.auth_tokens[0])
        tqkv_log(TQKV_LOG_WARN, "listening on a non-loopback address without TLS or auth",
                 "listen=%s", cfg.listen);
    if (cfg.data_listen[0] && !cfg.tls_cert[0] && tqkv_config_listen_is_public(cfg.data_listen))
        tqkv_log(TQKV_LOG_WARN,
                 "TCP data channels on a non-loopback address: page bytes travel unencrypted",
                 "data_listen=%s auth=%s", cfg.data_listen, cfg.auth_tokens[0] ? "on" : "off");

    tqkv_server_t *srv = NULL;
    if (tqkv_server_create(&cfg, &srv, err, sizeof err) != TQKV_OK) {
        char q[1024];
        tqkv_log_quote(q, sizeof q, err);
        tqkv_log(TQKV_LOG_ERROR, "start-up failed", "error=\"%s\"", q);
        fprintf(stderr, "tqkv-server: %s\n", err);
        return 1;
    }
    tqkv_server_start(srv);

    char host[256];
    const char *colon = strrchr(cfg.listen, ':');
    size_t hl = colon ? (size_t)(colon - cfg.listen) : 0;
    if (hl >= sizeof host)
        hl = sizeof host - 1;
    memcpy(host, cfg.listen, hl);
    host[hl] = '\0';
    printf("tqkv-server listening on %s:%d\n", host, tqkv_server_port(srv));
    if (tqkv_server_metrics_port(srv) > 0)
        printf("tqkv-server metrics on port %d\n", tqkv_server_metrics_port(srv));
    printf("tqkv-server node id %s\n", tqkv_server_node_id(srv));
    fflush(stdout);

    while (sigwait(&sigs, &sig) != 0)
        ;
    tqkv_log(TQKV_LOG_INFO, "signal received, stopping", "signal=%s",
             sig == SIGTERM ? "SIGTERM" : "SIGINT");
    if (sig == SIGTERM)
        tqkv_server_handoff(srv); /* the pod's preStop: keep the working set in the cluster */
    tqkv_server_shutdown(srv);
    tqkv_server_destroy(srv);
    return 0;
}
