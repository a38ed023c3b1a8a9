/* server_main.c - tqkv-server: parse flags, serve until SIGTERM/SIGINT, drain, exit.
 *
 * OpenSSL is initialised without its atexit cleanup (tqkv_tls_process_init): gRPC's threads
 * may still be ending as the process exits.
 *
 * Signals are blocked in every thread and taken synchronously by main with
 * sigwait, so the graceful stop runs on an ordinary thread. SIGHUP reloads the token
 * file and the TLS certificate (tqkv_server_reload) and reopens the access log file. Exit status: 0
 * after a clean stop, 1 when start-up fails, 2 for bad flags.
 *
 * In JSON log mode every line the server writes is JSON, the start-up lines on stdout
 * too ("tqkv-server listening on HOST:PORT" is their msg, which scripts search for).
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "kernels/version.h"
#include "service/config.h"
#include "service/log.h"
#include "service/server.h"
#include "service/tls.h"

int
main(int argc, char **argv)
{
    tqkv_server_config_t cfg;
    char err[512];
    sigset_t sigs;
    int sig = 0;

    /* First, before gRPC or the token check touch OpenSSL (tls.h says why). */
    if (tqkv_tls_process_init() != TQKV_OK) {
        fprintf(stderr, "tqkv-server: OpenSSL initialisation failed\n");
        return 1;
    }
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
    tqkv_log_capture_grpc();
    if (cfg.access_log[0] && tqkv_log_access_open(cfg.access_log, err, sizeof err) != TQKV_OK) {
        char q[1024];
        tqkv_log_quote(q, sizeof q, err);
        tqkv_log(TQKV_LOG_ERROR, "start-up failed", "error=\"%s\"", q);
        if (cfg.log_format == TQKV_LOG_TEXT)
            fprintf(stderr, "tqkv-server: %s\n", err);
        return 1;
    }
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
    sigaddset(&sigs, SIGHUP);
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
        if (cfg.log_format == TQKV_LOG_TEXT) /* JSON mode: the JSON line says it */
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
    if (cfg.log_format == TQKV_LOG_JSON) {
        char msg[320];
        /* The address is followed by a blank inside the JSON string too, so the scripts and
         * tools that take "listening on ADDR" up to the next blank read the same ADDR
         * from a JSON line as from a text one. */
        snprintf(msg, sizeof msg, "tqkv-server listening on %s:%d (gRPC)", host,
                 tqkv_server_port(srv));
        tqkv_log_to(stdout, TQKV_LOG_INFO, msg, "addr=%s:%d port=%d", host, tqkv_server_port(srv),
                    tqkv_server_port(srv));
        if (tqkv_server_metrics_port(srv) > 0) {
            snprintf(msg, sizeof msg, "tqkv-server metrics on port %d",
                     tqkv_server_metrics_port(srv));
            tqkv_log_to(stdout, TQKV_LOG_INFO, msg, "port=%d", tqkv_server_metrics_port(srv));
        }
        snprintf(msg, sizeof msg, "tqkv-server node id %s", tqkv_server_node_id(srv));
        tqkv_log_to(stdout, TQKV_LOG_INFO, msg, "node_id=%s", tqkv_server_node_id(srv));
    } else {
        printf("tqkv-server listening on %s:%d\n", host, tqkv_server_port(srv));
        if (tqkv_server_metrics_port(srv) > 0)
            printf("tqkv-server metrics on port %d\n", tqkv_server_metrics_port(srv));
        printf("tqkv-server node id %s\n", tqkv_server_node_id(srv));
        fflush(stdout);
    }

    for (;;) {
        while (sigwait(&sigs, &sig) != 0)
            ;
        if (sig != SIGHUP)
            break;
        tqkv_log(TQKV_LOG_INFO, "SIGHUP: reloading", NULL);
        tqkv_server_reload(srv, "SIGHUP");
        if (tqkv_log_access_reopen(err, sizeof err) != TQKV_OK) {
            char q[1024];
            tqkv_log_quote(q, sizeof q, err);
            tqkv_log(TQKV_LOG_ERROR, "access log not reopened; writing to the old file",
                     "error=\"%s\"", q);
        }
    }
    tqkv_log(TQKV_LOG_INFO, "signal received, stopping", "signal=%s",
             sig == SIGTERM ? "SIGTERM" : "SIGINT");
    if (sig == SIGTERM)
        tqkv_server_handoff(srv); /* the pod's preStop: keep the working set in the cluster */
    tqkv_server_shutdown(srv);
    tqkv_server_destroy(srv);
    return 0;
}
