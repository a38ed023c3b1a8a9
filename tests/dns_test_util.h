/* dns_test_util.h - a real DNS server for tests: dnsmasq on 127.0.0.1 at a free port.
 *
 * Records come from a hosts file in a temporary directory ("IP NAME" lines, one A
 * record each; several lines with one name make a set) that a test rewrites and
 * reloads with SIGHUP, plus fixed command-line records (--srv-host=..., --host-record)
 * given at start. Nothing outside the temporary directory is touched (never
 * /etc/hosts). Tests skip (exit 77) where dnsmasq is not installed.
 */
#ifndef TQKV_TESTS_DNS_TEST_UTIL_H
#define TQKV_TESTS_DNS_TEST_UTIL_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/support/ports.h"

typedef struct dns_srv {
    pid_t pid;
    int port;
    char dir[64];
    char hosts[128];
    char servers[64]; /* "127.0.0.1:PORT" for tqkv_membership_opts_t.dns_servers */
} dns_srv_t;

static const char *
dns_dnsmasq_path(void)
{
    static const char *const cand[] = {"/usr/sbin/dnsmasq", "/sbin/dnsmasq", "/usr/bin/dnsmasq"};
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++)
        if (access(cand[i], X_OK) == 0)
            return cand[i];
    return NULL;
}

/* Writes the hosts file ("IP NAME\n" lines) and, when running, reloads it. */
static int
dns_set_hosts(dns_srv_t *d, const char *text)
{
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", d->hosts);
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return -1;
    fputs(text, f);
    fclose(f);
    if (rename(tmp, d->hosts) != 0)
        return -1;
    if (d->pid > 0)
        kill(d->pid, SIGHUP);
    return 0;
}

static int
dns_tcp_up(int port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    int ok = s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    if (s >= 0)
        close(s);
    return ok;
}

/* Starts dnsmasq serving hosts_text and extra args (NULL-ended; e.g. "--srv-host=...").
 * port 0 picks a free one (reuse d->port to restart on the same port). 0 when it
 * answers, -1 on failure, 77 when dnsmasq is not installed. */
static int
dns_start(dns_srv_t *d, int port, const char *hosts_text, const char *const *extra)
{
    const char *path = dns_dnsmasq_path();
    if (path == NULL)
        return 77;
    if (d->dir[0] == '\0') {
        snprintf(d->dir, sizeof d->dir, "/tmp/tqkv-dns-XXXXXX");
        if (mkdtemp(d->dir) == NULL)
            return -1;
        chmod(d->dir, 0755);
        snprintf(d->hosts, sizeof d->hosts, "%s/hosts", d->dir);
    }
    d->pid = 0;
    if (dns_set_hosts(d, hosts_text) != 0)
        return -1;
    chmod(d->hosts, 0644);
    d->port = port ? port : tqkv_test_free_port(1); /* free for UDP and TCP */
    if (d->port <= 0)
        return -1;
    snprintf(d->servers, sizeof d->servers, "127.0.0.1:%d", d->port);
    char portarg[32], hostsarg[160];
    snprintf(portarg, sizeof portarg, "--port=%d", d->port);
    snprintf(hostsarg, sizeof hostsarg, "--addn-hosts=%s", d->hosts);
    const char *argv[48];
    int n = 0;
    argv[n++] = path;
    argv[n++] = "--keep-in-foreground";
    argv[n++] = "--conf-file=/dev/null";
    argv[n++] = "--no-resolv";
    argv[n++] = "--no-hosts";
    argv[n++] = "--no-poll";
    argv[n++] = "--listen-address=127.0.0.1";
    argv[n++] = "--bind-interfaces";
    argv[n++] = "--pid-file=";
    argv[n++] = "--cache-size=0";
    argv[n++] = "--local-ttl=0";
    argv[n++] = "--user=root";
    argv[n++] = portarg;
    argv[n++] = hostsarg;
    for (int i = 0; extra && extra[i] && n < 46; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        FILE *nul = freopen("/dev/null", "w", stdout);
        (void)nul;
        execv(path, (char *const *)argv);
        _exit(127);
    }
    d->pid = pid;
    for (int i = 0; i < 500; i++) { /* up to 5 s */
        int stt;
        if (waitpid(pid, &stt, WNOHANG) == pid) {
            d->pid = 0;
            return -1;
        }
        if (dns_tcp_up(d->port))
            return 0;
        usleep(10000);
    }
    return -1;
}

/* Stops dnsmasq (the directory stays for a restart). */
static void
dns_stop(dns_srv_t *d)
{
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        waitpid(d->pid, NULL, 0);
        d->pid = 0;
    }
}

/* Stops it and removes the directory. */
static void
dns_destroy(dns_srv_t *d)
{
    dns_stop(d);
    if (d->dir[0]) {
        char p[160];
        snprintf(p, sizeof p, "%s.tmp", d->hosts);
        unlink(p);
        unlink(d->hosts);
        rmdir(d->dir);
        d->dir[0] = '\0';
    }
}

#endif
