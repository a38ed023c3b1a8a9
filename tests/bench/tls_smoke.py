#!/usr/bin/python3
"""tls_smoke.py - tqkv-bench against a TLS tqkv-server it spawns (--tls-cert, data
channels on): every Get page comes over a TLS data channel, nothing fails verification,
and the TLS baselines of the same run are reported (a raw TLS pair with the data
channels' suite, the cipher's speed) next to raw TCP.

Usage: tls_smoke.py TQKV_BENCH TQKV_SERVER
"""
import json
import os
import subprocess
import sys
import tempfile

bench, server = sys.argv[1], sys.argv[2]
d = tempfile.mkdtemp(prefix="tqkv-bench-tls-")
cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                "-out", cert, "-days", "1", "-subj", "/CN=localhost", "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
p = subprocess.run([bench, "--spawn-server", server, "--server-arg", "--tls-cert",
                    "--server-arg", cert, "--server-arg", "--tls-key", "--server-arg", key,
                    "--tls-ca", cert, "--dram-capacity", "64MiB", "--model", "tiny",
                    "--block-tokens", "64", "--duration", "3", "--concurrency", "2",
                    "--phase", "decode", "--json", "-"], capture_output=True, text=True,
                   timeout=300)
out = p.stdout
fails = []
try:
    j = json.loads(out[out.index("{\"bf16_equiv_gbps\""):].splitlines()[0])
except (ValueError, IndexError) as e:
    print(out[-3000:], p.stderr[-3000:])
    sys.exit("tls_smoke: no JSON report (%s), exit %d" % (e, p.returncode))
b = j.get("baselines", {})
checks = [
    ("bench exit 0", p.returncode == 0),
    ("no verify failures", j.get("verify_failures") == 0),
    ("no errors", j.get("errors") == 0),
    ("pages came over TLS data channels", j.get("data_channel_pages", 0) > 0),
    ("raw TLS pair measured", b.get("raw_tls_gbps", 0) > 0),
    ("raw TLS pair used the data channels' suite",
     "TLS_AES_128_GCM_SHA256" in b.get("raw_tls_suite", "")),
    ("cipher speed measured", b.get("aes_128_gcm_gbps", 0) > 0),
    ("raw TCP measured", b.get("raw_tcp_gbps", 0) > 0),
    ("the data channels' record path reported (userspace, or ktls where the kernel has it)",
     b.get("tls", {}).get("path") in ("userspace", "ktls")),
    ("the data channels' cipher reported",
     b.get("tls", {}).get("cipher") == "TLSv1.3 TLS_AES_128_GCM_SHA256"),
    ("in-process AES-128-GCM measured", b.get("tls", {}).get("aes_128_gcm_evp_gbps", 0) > 0),
    ("raw TLS pair with the channels' records measured",
     b.get("tls", {}).get("raw_tls_channel_records_gbps", 0) > 0),
]
for what, ok in checks:
    print("%s  %s" % ("PASS" if ok else "FAIL", what))
print("wire %.3f GB/s, raw TLS %.3f, raw TCP %.3f, AES-128-GCM %.3f, path %s" %
      (j.get("wire_gbps", 0), b.get("raw_tls_gbps", 0), b.get("raw_tcp_gbps", 0),
       b.get("aes_128_gcm_gbps", 0), b.get("tls", {}).get("path")))
bad = [w for w, ok in checks if not ok]
if bad:
    print(p.stderr[-2000:])
print("%d passed, %d failed" % (len(checks) - len(bad), len(bad)))
sys.exit(1 if bad else 0)
