"""tqkv_ports.py - ports a Python test must name before anything listens on them
(dnsmasq's --port, a server restarted at the same address).

The same rule as tests/support/ports.h: bind() to port 0 and connect() take their ports
from the kernel's ephemeral range (net.ipv4.ip_local_port_range), so a port found that
way can be taken by another process's connection or listener before the test uses it
(run 1210002: dnsmasq's port was free for UDP but held for TCP). free_port picks from
below that range (above it when there is no room below), at random from the OS
(SystemRandom, never the test seed: tests run in parallel with one seed), and checks the
port is free for TCP on every host given, and for UDP on the first when asked.
"""

import random
import socket

_RNG = random.SystemRandom()


def _pick_range():
    lo, hi = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        pass
    if lo - 1024 >= 2048:
        return max(1024, lo - 16384), lo
    if 65535 - hi >= 2048:
        return hi + 1, 65536
    raise RuntimeError("the ephemeral port range %d-%d leaves no room for fixed ports" %
                       (lo, hi))


def _bindable(kind, host, port):
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(hosts=("127.0.0.1",), udp=False):
    """A port free for TCP on every address in hosts (and UDP on hosts[0] when udp), at
    the time of asking, from outside the ephemeral range."""
    a, b = _pick_range()
    for _ in range(1000):
        p = _RNG.randrange(a, b)
        if all(_bindable(socket.SOCK_STREAM, h, p) for h in hosts) and (
                not udp or _bindable(socket.SOCK_DGRAM, hosts[0], p)):
            return p
    raise RuntimeError("no free port in %d-%d on %s" % (a, b - 1, ", ".join(hosts)))
