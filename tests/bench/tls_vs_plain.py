#!/usr/bin/python3
"""tls_vs_plain.py - the TLS data channel against the plaintext one, the bench's raw TLS
pair and the cipher-bound limit, with ratios taken within each round (docs/benchmarks.md,
"TLS data channels").

Starts two tqkv-servers (one with --tls-cert, both with --data-listen), then per round
runs `tqkv-bench --phase decode` against the plaintext server and right after against
the TLS one (its baselines: raw TCP, the raw TLS pair, the cipher's speed); the TLS run
gets the plaintext run's wire GB/s (--plain-wire-gbps) and prints the limit
1/(1/plain + 2/(C x AES)). Reports each round and the best of the rounds.

Usage: tls_vs_plain.py TQKV_BENCH TQKV_SERVER [--rounds 3] [--duration 10] [--hog]
                       [--model llama3-8b] [--concurrency 4] [--working-set 2] [--json OUT]
--hog runs a busy loop on one CPU beside the whole measurement.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_server import ServerProcess  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("bench")
ap.add_argument("server")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--duration", type=int, default=10)
ap.add_argument("--model", default="llama3-8b")
ap.add_argument("--concurrency", type=int, default=4)
ap.add_argument("--dram", default="2G")
ap.add_argument("--hog", action="store_true")
ap.add_argument("--working-set", type=int, default=2,
                help="sequences read back (2: few first-read content checks in the timed part)")
ap.add_argument("--json")
a = ap.parse_args()

d = tempfile.mkdtemp(prefix="tqkv-tls-vs-plain-")
cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start(*extra):
    """A tqkv-server (tests/support's ServerProcess) with data channels; (it, its port)."""
    s = ServerProcess(a.server, ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                                 "--dram-capacity", a.dram, "--log-level", "warn", *extra],
                      start_timeout=60)
    return s, s.port


def bench(port, tls, plain=None):
    cmd = [a.bench, "--target", "127.0.0.1:%d" % port, "--phase", "decode", "--duration",
           str(a.duration), "--model", a.model, "--concurrency", str(a.concurrency), "--working-set", str(a.working_set), "--json", "-"]
    if tls:
        cmd += ["--tls-ca", cert]
        if plain:
            cmd += ["--plain-wire-gbps", "%.6f" % plain]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = p.stdout
    try:
        j = json.loads(out[out.index("{\"bf16_equiv_gbps\""):].splitlines()[0])
    except (ValueError, IndexError):
        print(out[-2000:], p.stderr[-2000:])
        sys.exit("tqkv-bench gave no JSON (exit %d)" % p.returncode)
    if p.returncode != 0 or j.get("verify_failures") or j.get("errors"):
        sys.exit("tqkv-bench failed: exit %d, %s" % (p.returncode, p.stderr[-1000:]))
    return j


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


hog = None
if a.hog:
    hog = subprocess.Popen(["sh", "-c", "while :; do :; done"])
srv_p, port_p = start()
srv_t, port_t = start("--tls-cert", cert, "--tls-key", key)
rounds = []
try:
    for r in range(a.rounds):
        l0 = load()
        jp = bench(port_p, False)
        plain = jp["wire_gbps"]
        jt = bench(port_t, True, plain)
        b = jt["baselines"]
        t = b.get("tls", {})
        aes = t.get("aes_128_gcm_evp_gbps") or b.get("aes_128_gcm_gbps", 0)
        cores = t.get("cores") or os.cpu_count()
        bound = 1 / (1 / plain + 2 / (cores * aes)) if aes > 0 else 0
        row = {"round": r, "load_avg": l0, "plain_wire_gbps": plain,
               "tls_wire_gbps": jt["wire_gbps"], "raw_tls_gbps": b.get("raw_tls_gbps", 0),
               "raw_tcp_gbps": b.get("raw_tcp_gbps", 0), "aes_gbps": aes,
               "openssl_speed_gbps": b.get("aes_128_gcm_gbps", 0), "cores": cores,
               "cipher_bound_gbps": bound, "path": t.get("path", "?"),
               "cipher": t.get("cipher", b.get("raw_tls_suite", "?")),
               "raw_tls_channel_records_gbps": t.get("raw_tls_channel_records_gbps", 0.0),
               "tls_pages": jt.get("data_channel_pages", 0)}
        row["tls_vs_plain"] = row["tls_wire_gbps"] / plain
        row["tls_vs_bound"] = row["tls_wire_gbps"] / bound if bound else 0
        row["tls_vs_raw_tls"] = (row["tls_wire_gbps"] / row["raw_tls_gbps"]
                                 if row["raw_tls_gbps"] else 0)
        rounds.append(row)
        print("round %d (load %.1f): plain %.3f  TLS %.3f (%s, %s)  raw TLS %.3f (channel "
              "records %.3f)  raw TCP %.3f  AES %.3f x %d  bound %.3f  | TLS/plain %.2f  "
              "TLS/bound %.2f  TLS/raw TLS %.2f" %
              (r, l0, plain, row["tls_wire_gbps"], row["path"], row["cipher"],
               row["raw_tls_gbps"], row["raw_tls_channel_records_gbps"], row["raw_tcp_gbps"], aes,
               cores, bound, row["tls_vs_plain"], row["tls_vs_bound"], row["tls_vs_raw_tls"]),
              flush=True)
finally:
    for p in (srv_p, srv_t):
        p.stop(30)
    if hog:
        hog.kill()
        hog.wait()
best = {k: max(x[k] for x in rounds) for k in rounds[0] if isinstance(rounds[0][k], float)}
print("best of %d: plain %.3f  TLS %.3f  raw TLS %.3f  bound %.3f  | TLS/plain %.2f  "
      "TLS/bound %.2f  TLS/raw TLS %.2f (ratios: best round)" %
      (len(rounds), best["plain_wire_gbps"], best["tls_wire_gbps"], best["raw_tls_gbps"],
       best["cipher_bound_gbps"], best["tls_vs_plain"], best["tls_vs_bound"],
       best["tls_vs_raw_tls"]))
if a.json:
    with open(a.json, "w") as f:
        json.dump({"rounds": rounds, "hog": a.hog, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                  f, indent=1)
