"""tqkv_dns.py - a real DNS server for the Python tests: dnsmasq on 127.0.0.1.

Dnsmasq(tmp) picks its port once (tqkv_ports.free_port, free for UDP and TCP), so the
servers under test can be given `--peers-dns 127.0.0.1:PORT` before it starts and it can
be restarted on the same port. Records: A records from a hosts file in tmp ("IP NAME"
lines; set_hosts rewrites it and, while running, reloads it with SIGHUP) and SRV records
given at start (start(srv=[(name, target, port), ...]); start again to change them).
start returns once dnsmasq answers on TCP, or raises with its stderr when it exits
first; the wait is bounded (10 s) and ends on that event, not on a sleep. The C tests'
counterpart is tests/dns_test_util.h.
"""

import os
import shutil
import signal
import socket
import subprocess
import time

from tqkv_ports import free_port

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


def have_dnsmasq():
    return os.access(DNSMASQ, os.X_OK)


class Dnsmasq:
    def __init__(self, tmp, hosts_text=""):
        self.port = free_port(udp=True)
        self.hosts = os.path.join(tmp, "dns-hosts")
        self.log = os.path.join(tmp, "dnsmasq.log")
        self.proc = None
        self.set_hosts(hosts_text)

    def set_hosts(self, text):
        with open(self.hosts + ".tmp", "w") as f:
            f.write(text)
        os.rename(self.hosts + ".tmp", self.hosts)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def start(self, srv=()):
        """(Re)starts dnsmasq with SRV records srv: (name, target, port) triples."""
        self.stop()
        args = [DNSMASQ, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", "--no-poll", "--listen-address=127.0.0.1", "--bind-interfaces",
                "--pid-file=", "--cache-size=0", "--local-ttl=0", "--user=root",
                "--port=%d" % self.port, "--addn-hosts=" + self.hosts]
        args += ["--srv-host=%s,%s,%d" % r for r in srv]
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log) as f:
                    why = f.read().strip()
                self.proc = None
                raise RuntimeError("dnsmasq on port %d exited: %s" % (self.port, why))
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError("dnsmasq on port %d did not answer in 10 s" % self.port)

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None
