#!/usr/bin/env python3
"""rolling_restart_bench.py - a rolling restart of 3 DRAM-only tqkv-servers (R = 1)
under a steady tqkv-bench, with and without hand-off on drain, in one run.

The servers are found through a real DNS server (dnsmasq, SRV records
_grpc._tcp.svc.test); tqkv-bench --target svc.test:1 follows them. Each server in
turn gets SIGTERM (with --peers it hands its pages off to their next-ranked peers),
leaves the SRV set, and comes back on a new port with the same --node-id. The bench
writes its hit-rate time series (--csv); the hit rate of the last seconds must be at
least 90% of the first seconds' with hand-off, and the run without hand-off is
reported beside it. gnuplot (when installed) draws both series.

usage: rolling_restart_bench.py TQKV_SERVER TQKV_BENCH OUTDIR
"""
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time

SERVER, BENCH, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
HERE = os.path.dirname(os.path.abspath(__file__))
PLOT = os.path.join(HERE, "..", "..", "deploy", "bench", "hit-rate.gp")
sys.path.insert(0, os.path.join(HERE, "..", "support"))
from tqkv_dns import Dnsmasq, have_dnsmasq  # noqa: E402
from tqkv_server import ServerProcess  # noqa: E402


class Server:
    """Server idx of the cluster, restartable: each start() is a new ServerProcess (the
    shared fixture) with the same node id."""

    def __init__(self, idx, dns, handoff_s):
        self.idx, self.dns, self.handoff_s = idx, dns, handoff_s
        self.sp = None
        self.port = 0

    def start(self):
        self.sp = ServerProcess(SERVER, [
            "--listen", "127.0.0.1:0", "--node-id", "tqkv-%d" % self.idx, "--dram-capacity",
            "512M", "--drain-seconds", "2", "--peers", "svc.test:1", "--peers-dns",
            "127.0.0.1:%d" % self.dns.port, "--handoff-seconds", str(self.handoff_s),
            "--log-level", "warn"], drain_stdout=True)
        self.port = self.sp.port

    def stop(self):
        rc = self.sp.stop(timeout=60)
        if isinstance(rc, str):  # hung after SIGTERM (and killed)
            raise RuntimeError("server %d: %s: %s" % (self.idx, rc, self.sp.log_tail()))


def publish(dns, ports):
    """The SRV set _grpc._tcp.svc.test: the servers at ports (dnsmasq restarted)."""
    dns.start([("_grpc._tcp.svc.test", "h.test", p) for p in ports])


def run(handoff_s, tmp):
    dns = Dnsmasq(tmp, "127.0.0.1 h.test\n")
    srv = [Server(i, dns, handoff_s) for i in range(3)]
    for s in srv:
        s.start()
    publish(dns, [s.port for s in srv])
    out = os.path.join(OUT, "rolling-restart-handoff-%s.csv" % handoff_s)
    bench = subprocess.Popen(
        [BENCH, "--target", "svc.test:1", "--dns-server", "127.0.0.1:%d" % dns.port,
         "--resolve-interval-ms", "200", "--model", "tiny", "--phase", "decode",
         "--working-set", "48", "--seq-blocks", "8", "--block-tokens", "16", "--concurrency",
         "2", "--duration", "22", "--transport", "grpc", "--no-baselines", "--csv", out, "--seed", "7"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    for i, s in enumerate(srv):
        time.sleep(max(0, 6 + 5 * i - (time.time() - t0)))
        s.stop()
        publish(dns, [x.port for x in srv if x is not s])
        time.sleep(0.5)
        s.start()
        publish(dns, [x.port for x in srv])
    _, err = bench.communicate(timeout=120)
    for s in srv:
        s.stop()
    dns.stop()
    rows = list(csv.DictReader(open(out)))
    hr = [(float(r["t_s"]), float(r["hit_rate_interval"])) for r in rows]
    before = [h for t, h in hr if 0.5 <= t < 3.5]
    after = [h for t, h in hr if t >= 19]
    b = sum(before) / len(before)
    a = sum(after) / len(after)
    low = min(h for t, h in hr if t >= 1)
    print("rolling restart, hand-off %ss: hit rate before %.1f%%, after %.1f%% (%.0f%% of "
          "before), lowest second %.1f%%; bench exit %d" %
          (handoff_s, 100 * b, 100 * a, 100 * a / b if b else 0, 100 * low, bench.returncode))
    if bench.returncode not in (0, 4):
        print(err[-2000:])
        raise SystemExit("tqkv-bench failed (%d)" % bench.returncode)
    if bench.returncode == 4:
        # A call in flight on a stopping server (cancelled at the end of its drain, or
        # its channel replaced while it waited for a connection) is a transport failure
        # for libtqkv: the block's next-ranked server is asked, no error reaches the caller.
        lines = err.strip().splitlines()[-8:]
        print("  RPC errors during the restarts:")
        for l in lines:
            print("    " + l[:240])
        raise SystemExit("tqkv-bench saw RPC errors during the rolling restart")
    return b, a, out


def main():
    os.makedirs(OUT, exist_ok=True)
    if not have_dnsmasq():
        print("SKIP: dnsmasq not installed")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        b1, a1, csv1 = run(10, tmp)
        b0, a0, csv0 = run(0, tmp)
    if shutil.which("gnuplot"):
        for f, title in ((csv1, "rolling restart with hand-off"),
                         (csv0, "rolling restart without hand-off")):
            svg = f[:-4] + ".svg"
            subprocess.run(["gnuplot", "-e", "csv='%s'; out='%s'; title='%s'" % (f, svg, title),
                            PLOT], check=True)
            assert os.path.getsize(svg) > 1000, svg
            print("plot: " + svg)
    ok = b1 > 0.5 and a1 >= 0.9 * b1
    print("hand-off keeps %.0f%% of the hit rate; without: %.0f%%" %
          (100 * a1 / b1, 100 * a0 / b0 if b0 else 0))
    if not ok:
        print("FAIL: with hand-off the hit rate after the rollout is under 90% of before")
        return 1
    if not a0 < a1:
        print("FAIL: the rollout without hand-off kept as much as with it")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
