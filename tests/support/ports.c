/* ports.c - free ports from outside the kernel's ephemeral range (ports.h). */
#include "tests/support/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

/* 1 when port can be bound on 127.0.0.1 with socket type type. */
static int
bindable(int type, int port)
{
    int fd = socket(AF_INET, type, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* [*lo, *hi): the ports to pick from; 0 when the ephemeral range leaves no room. */
static int
pick_range(int *lo, int *hi)
{
    int elo = 32768, ehi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f != NULL) {
        if (fscanf(f, "%d %d", &elo, &ehi) != 2)
            elo = 32768, ehi = 60999;
        fclose(f);
    }
    if (elo - 1024 >= 2048) {
        *lo = elo - 16384 > 1024 ? elo - 16384 : 1024;
        *hi = elo;
        return 1;
    }
    if (65535 - ehi >= 2048) {
        *lo = ehi + 1;
        *hi = 65536;
        return 1;
    }
    return 0;
}

int
tqkv_test_free_port(int want_udp)
{
    int lo, hi;
    if (!pick_range(&lo, &hi))
        return -1;
    for (int tries = 0; tries < 1000; tries++) {
        unsigned r = 0;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
            return -1;
        int port = lo + (int)(r % (unsigned)(hi - lo));
        if (bindable(SOCK_STREAM, port) && (!want_udp || bindable(SOCK_DGRAM, port)))
            return port;
    }
    return -1;
}
