/* ports.h - ports a test must name before anything listens on them: dnsmasq's --port,
 * a server restarted at the same address, an address where nothing listens.
 *
 * bind() to port 0 and connect() take their ports from the kernel's ephemeral range
 * (net.ipv4.ip_local_port_range), so a port found that way can be taken by any other
 * process's connection or listener before the test uses it (run 1210002: dnsmasq's port
 * was free for UDP but held for TCP). These come from below that range (above it when
 * there is no room below), at random from getrandom() (never the test seed: tests run in
 * parallel with one seed and must not pick alike), and are checked free for TCP, and
 * for UDP when asked, on 127.0.0.1. tests/support/tqkv_ports.py is the same rule for the
 * Python tests.
 */
#ifndef TQKV_TESTS_SUPPORT_PORTS_H
#define TQKV_TESTS_SUPPORT_PORTS_H

#ifdef __cplusplus
extern "C" {
#endif

/* A port free on 127.0.0.1 for TCP (and UDP when want_udp) at the time of asking, from
 * outside the ephemeral range; -1 when none was found in 1000 tries. */
int tqkv_test_free_port(int want_udp);

#ifdef __cplusplus
}
#endif

#endif
