#!/usr/bin/python3
"""tls_cpu_cost.py - CPU cost per byte of the TLS data channel against the plaintext one
and the cipher, measured so that other load on the machine does not enter the ratios
(docs/benchmarks.md, "TLS data channels").

The throughput limit of the issue, 1/(1/plain + 2/(C x AES)), is, for a run that keeps
C cores busy, the same statement about CPU time per byte:

    cost_tls  >=  cost_plain + 2/AES          (core-seconds per GB)

cost_x = (CPU seconds of server + bench) / GB moved over the channel, AES = one core's
AES-128-GCM GB/s per CPU-second. On a shared machine wall-clock GB/s depend on what
else runs; CPU seconds per byte do not (much). Each mode runs tqkv-bench --phase decode
for --duration seconds; the CPU of server and bench (/proc) is sampled at each of the
bench's progress lines (every 5 s of the timed phase) and the bytes of those intervals
come from their pages/s: the untimed Puts and start-up stay out.

Usage: tls_cpu_cost.py TQKV_BENCH TQKV_SERVER [--duration 30] [--rounds 1]
Prints per mode core-ns per byte, and efficiency = (cost_plain + 2/AES) / cost_tls.
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_server import ServerProcess  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("bench")
ap.add_argument("server")
ap.add_argument("--duration", type=int, default=30)
ap.add_argument("--rounds", type=int, default=1)
ap.add_argument("--model", default="llama3-8b")
ap.add_argument("--concurrency", type=int, default=4)
ap.add_argument("--working-set", type=int, default=2)
ap.add_argument("--aes-gbps", type=float, default=0,
                help="one core's AES-128-GCM GB/s per CPU-second (default: openssl speed)")
a = ap.parse_args()
TICK = os.sysconf("SC_CLK_TCK")

d = tempfile.mkdtemp(prefix="tqkv-tls-cost-")
cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start(*extra):
    """A tqkv-server (tests/support's ServerProcess) with data channels; (it, its port)."""
    s = ServerProcess(a.server, ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                                 "--dram-capacity", "2G", "--log-level", "warn", *extra],
                      start_timeout=60)
    return s, s.port


def proc_cpu(pid):
    with open("/proc/%d/stat" % pid) as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / TICK  # utime + stime


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


run_no = [0]


def run(srv, port, tls):
    """One bench run; CPU of server + bench sampled at each progress line (every 5 s of
    the timed phase): returns (CPU seconds, bytes) from the first progress line to the
    last, so the untimed Puts and start-up stay out."""
    run_no[0] += 1
    cmd = [a.bench, "--target", "127.0.0.1:%d" % port, "--phase", "decode", "--duration",
           str(a.duration), "--model", a.model, "--concurrency", str(a.concurrency),
           "--working-set", str(a.working_set), "--namespace", "cost%d" % run_no[0],
           "--no-baselines", "--json", "-"]
    if tls:
        cmd += ["--tls-ca", cert]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []  # (t, pages/s of the interval ending at t, cpu)
    for line in p.stderr:
        m = re.search(r"progress ([\d.]+)s.* ([\d.]+) pages/s", line)
        if m:
            samples.append((float(m.group(1)), float(m.group(2)),
                            proc_cpu(srv.proc.pid) + proc_cpu(p.pid)))
    out = p.stdout.read()
    p.wait()
    j = json.loads(out[out.index("{\"bf16_equiv_gbps\""):].splitlines()[0])
    if p.returncode != 0 or j["verify_failures"] or j["errors"] or j["data_channel_pages"] == 0:
        sys.exit("bench failed: %d" % p.returncode)
    page = j["wire_gbps"] * 1e9 * j["elapsed_s"] / max(1, j["pages_found"])
    gb = sum(ps * (t - samples[i][0]) for i, (t, ps, _) in enumerate(samples[1:])) * page / 1e9
    return samples[-1][2] - samples[0][2], gb


def aes_speed():
    if a.aes_gbps:
        return a.aes_gbps
    o = subprocess.run(["openssl", "speed", "-evp", "aes-128-gcm", "-seconds", "2", "-bytes",
                        "16384"], capture_output=True, text=True).stdout
    for line in o.splitlines():
        m = re.match(r"AES-128-GCM\s+([\d.]+)k", line)
        if m:
            return float(m.group(1)) * 1000 / 1e9
    sys.exit("openssl speed gave nothing")


srv_p, port_p = start()
srv_t, port_t = start("--tls-cert", cert, "--tls-key", key)
try:
    for r in range(a.rounds):
        cost = {}
        for mode, (srv, port, tls) in (("plain", (srv_p, port_p, False)),
                                       ("tls", (srv_t, port_t, True))):
            cpu, gb = run(srv, port, tls)
            cost[mode] = cpu / gb  # core-seconds per GB = core-ns per byte
            print("  %-5s %.2f CPU-s for %.3f GB in the timed phase -> %.3f core-ns/B"
                  % (mode, cpu, gb, cost[mode]), flush=True)
        aes = aes_speed()
        bound = cost["plain"] + 2 / aes
        print("round %d: plain %.3f core-ns/B, TLS %.3f, cipher 2/AES %.3f (AES %.2f GB/s per "
              "core-s): bound %.3f, efficiency bound/TLS %.2f; TLS extra over plain %.3f = "
              "%.2f x the cipher's 2/AES" %
              (r, cost["plain"], cost["tls"], 2 / aes, aes, bound, bound / cost["tls"],
               cost["tls"] - cost["plain"], (cost["tls"] - cost["plain"]) / (2 / aes)),
              flush=True)
finally:
    for p in (srv_p, srv_t):
        p.stop(30)
