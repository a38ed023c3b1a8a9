#!/usr/bin/env python3
"""thin_grpcio.py - plain grpcio clients, each through one pod, see one cache.

Three tqkv-servers with --peers (found through dnsmasq SRV records). A grpcio client
connected to server 0 Puts blocks; another connected to server 1 Lookups and Gets
them: every block is found (the servers forward to each block's owner, one hop), and
its page is byte-identical to the one a client of server 2 gets. With --no-forward the
second client misses most of them. The servers have a disk tier with --disk-sync always,
so forwarded Puts and a forwarded Get's copies of the owners' pages go through it.

usage: thin_grpcio.py TQKV_SERVER PROTO_DIR
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

SERVER, PROTO_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_dns import Dnsmasq, have_dnsmasq  # noqa: E402


def stubs(tmp):
    out = os.path.join(tmp, "py")
    os.makedirs(out)
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.check_call(["protoc", "-I" + PROTO_DIR, "--python_out=" + out,
                           "--grpc_python_out=" + out, "--plugin=protoc-gen-grpc_python=" + plugin,
                           "tqkv/v1/kvcache.proto"])
    sys.path.insert(0, out)
    import tqkv.v1.kvcache_pb2 as pb
    import tqkv.v1.kvcache_pb2_grpc as pbg
    return pb, pbg


def cluster(tmp, no_forward):
    dns = Dnsmasq(tmp, "127.0.0.1 h.test\n")
    dport = dns.port
    procs, ports = [], []
    for i in range(3):
        args = [SERVER, "--listen", "127.0.0.1:0", "--node-id", "tqkv-%d" % i,
                "--dram-capacity", "256M", "--drain-seconds", "1", "--peers", "svc.test:1",
                "--peers-dns", "127.0.0.1:%d" % dport, "--log-level", "warn",
                # a disk tier with --disk-sync always: forwarded Puts and the copies a
                # forwarded Get makes go through it (one fdatasync per call)
                "--disk-path", os.path.join(tmp, "disk-%d-%d" % (i, no_forward)),
                "--disk-capacity", "64M", "--disk-sync", "always"]
        if no_forward:
            args.append("--no-forward")
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        while True:
            line = p.stdout.readline()
            if "listening on" in line:
                ports.append(int(line.rsplit(":", 1)[1]))
                break
            if not line:
                raise RuntimeError("server did not start")
        procs.append(p)
    try:
        dns.start([("_grpc._tcp.svc.test", "h.test", p) for p in ports])
    except RuntimeError:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return procs, ports, dns


def bf16(rng, n):
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16).tobytes()


def wait_converged(pb, kv, rng, deadline_s=60.0):
    """Waits (by event, bounded) until the servers have found each other through the DNS
    server (re-resolve period 1 s): probe blocks Put through each server in turn are
    found through every server, for one round per server in a row. Returns the seconds
    it took."""
    t0 = time.monotonic()
    n = good = 0
    while time.monotonic() - t0 < deadline_s:
        hashes = [rng.bytes(16) for _ in range(12)]
        msgs = [pb.PutRequest(namespace="probe", hash=h, layer=0, num_layers=1, num_tokens=16,
                              num_kv_heads=2, head_dim=64, key=bf16(rng, 2048),
                              value=bf16(rng, 2048)) for h in hashes]
        try:
            kv[n % len(kv)].Put(iter(msgs), timeout=10)
            ok = all(sum(m.found for m in stub.Get(pb.GetRequest(
                namespace="probe", hashes=hashes, layer_begin=0, layer_end=1), timeout=10))
                == len(hashes) for stub in kv)
        except grpc.RpcError:
            ok = False
        # len(kv) good rounds in a row, one Put through each server: a server whose peers
        # are not resolved yet keeps what it is given, and owners that read through can
        # still find it, so one good round can pass before every server forwards.
        good = good + 1 if ok else 0
        if good >= len(kv):
            return time.monotonic() - t0
        n += 1
        if not ok:
            time.sleep(0.2)
    raise RuntimeError("the servers did not find each other within %.0f s" % deadline_s)


def run(pb, pbg, tmp, no_forward):
    procs, ports, dns = cluster(tmp, no_forward)
    try:
        chans = [grpc.insecure_channel("127.0.0.1:%d" % p) for p in ports]
        kv = [pbg.KVCacheStub(c) for c in chans]
        rng = np.random.default_rng(int(time.time()))
        if not no_forward:
            print("servers found each other in %.1f s" % wait_converged(pb, kv, rng))
        T, H, D, N = 16, 2, 64, 40
        hashes = [rng.bytes(16) for _ in range(N)]

        def msgs():
            for i, h in enumerate(hashes):
                k = rng.standard_normal(T * H * D).astype(np.float32)
                v = rng.standard_normal(T * H * D).astype(np.float32)
                bf = lambda a: (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()
                yield pb.PutRequest(namespace="thin", hash=h,
                                    parent_hash=hashes[i - 1] if i else b"", layer=0,
                                    num_layers=1, num_tokens=T, num_kv_heads=H, head_dim=D,
                                    key=bf(k), value=bf(v))

        r = kv[0].Put(msgs(), timeout=30)
        assert r.blocks_stored + r.blocks_duplicate == N, r
        lk = kv[1].Lookup(pb.LookupRequest(namespace="thin", hashes=hashes, num_layers=1),
                          timeout=30)

        def pages(stub):
            out = {}
            for m in stub.Get(pb.GetRequest(namespace="thin", hashes=hashes, layer_begin=0,
                                            layer_end=1), timeout=30):
                if m.found:
                    out[bytes(m.hash)] = bytes(m.page)
            return out

        p1, p2 = pages(kv[1]), pages(kv[2])
        same = sum(1 for h in p1 if h in p2 and p1[h] == p2[h])
        print("grpcio thin clients (%s): Lookup through pod 1 prefix %d of %d, Get through "
              "pod 1 found %d, through pod 2 %d, identical %d" %
              ("--no-forward" if no_forward else "forwarding", lk.prefix_blocks, N, len(p1),
               len(p2), same))
        return lk.prefix_blocks, len(p1), same, N
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        dns.stop()


def main():
    if not have_dnsmasq():
        print("SKIP: dnsmasq not installed")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        pb, pbg = stubs(tmp)
        prefix, found, same, n = run(pb, pbg, tmp, False)
        if not (prefix == n and found == n and same == n):
            print("FAIL: a thin client through another pod must see every block")
            return 1
        prefix0, found0, _, _ = run(pb, pbg, tmp, True)
        if not found0 < n:
            print("FAIL: --no-forward still found everything through another pod")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
