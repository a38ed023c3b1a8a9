#!/usr/bin/env python3
"""readthru.py - owners read through (issue 22 item 1): a pod asked for a block it owns
but does not hold asks the block's next-ranked peers, keeps a copy, and never answers
wrong bytes. Real tqkv-server processes on loopback addresses 127.0.0.1.. (one per
server, one port), found through dnsmasq (A records of svc.test, rewritten + SIGHUP);
the clients are plain grpcio stubs, one per pod: no client-side read repair anywhere.

restart:  3 servers (--handoff-seconds 10); 90 blocks Put through the 2nd; SIGTERM the
          1st (its hand-off line), restart it with the same flags. A Lookup through it
          finds all 90 with at most one Lookup asked of each peer; a Get through each pod
          finds all 90, byte-identical to what the 2nd served before; a second Get
          through the restarted pod asks no peer (the copies are local). Then the 1st is
          SIGKILLed and restarted (empty) and the 3rd SIGKILLed while Gets run through
          the 1st: every call ends OK and quickly, no wrong page, no storm of log lines;
          with the 2nd SIGKILLed too, what the 1st does not hold is missing, at once.
          Then (sharding clients, "tqkv-hop: 1") the 1st is SIGKILLed and restarted
          empty: asks marked as a peer's ("tqkv-hop: 2", or a value it does not know)
          are answered from its store alone (0 found, no read-through); a grpcio Lookup
          marked "1" finds exactly the blocks it owns (read through, none forwarded);
          a sharding client (libtqkv's Python package over the 3 pods, read repair off,
          gRPC and TCP data channel halves; grpcio marked "1" without LIBTQKV_SO) finds
          all 90, decoded alike, after which the 1st holds every block it owns; no pod
          forwarded or read through any of the peers' asks (no loops).
scaleout: 3 servers, 960 blocks, a 4th server joins (published in DNS): Gets through
          the 4th find all 960: half through grpcio, byte-identical; half through a TCP
          data channel (libtqkv's Python package with this one target, read repair off,
          when LIBTQKV_SO is given), decoded alike. A sharding client (the package over
          the 4 pods, read repair off; grpcio marked "1" without LIBTQKV_SO) finds 240
          other blocks, decoded alike, the 4th reading through the ones it owns.
replicate: 3 servers with --replicate-bytes-per-s 100K; 90 blocks Put through the 2nd
          (grpcio: each lands on its owner alone); the 1st unpublished and SIGTERMed
          (hand-off), restarted empty and published again: with no client reading, it
          receives every block it ranks first or second for from its peers (Lookups
          marked "tqkv-hop: 2" show it), within the byte rate, no read-through involved.

usage: readthru.py TQKV_SERVER PROTO_DIR {restart|scaleout|replicate} [LIBTQKV_SO]
"""
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import numpy as np

SERVER, PROTO_DIR, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
LIBTQKV = sys.argv[4] if len(sys.argv) > 4 else ""
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_dns import Dnsmasq, have_dnsmasq  # noqa: E402
from tqkv_ports import free_port  # noqa: E402
T, H, D = 16, 2, 64


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


class Cluster:
    def __init__(self, tmp, pb, pbg):
        self.tmp, self.pb, self.pbg = tmp, pb, pbg
        self.dns = Dnsmasq(tmp)  # its port now, dnsmasq at the first publish
        self.dport = self.dns.port
        # the servers' gRPC, metrics and data ports, the same on each server's address
        hosts = ["127.0.0.%d" % i for i in range(1, 6)]
        ports = []
        while len(ports) < 3:
            p = free_port(hosts=hosts)
            if p not in ports and p != self.dport:
                ports.append(p)
        self.port, self.mport, self.dcport = ports
        self.procs, self.logs, self.published = {}, {}, []
        self.extra = []  # more tqkv-server flags

    def host(self, i):
        return "127.0.0.%d" % (i + 1)

    def publish(self):
        self.dns.set_hosts("".join("%s svc.test\n" % self.host(i) for i in self.published))
        if self.dns.proc is None:
            self.dns.start()

    def start(self, i):
        log = os.path.join(self.tmp, "server-%d.log" % i)
        self.logs[i] = log
        args = [SERVER, "--listen", "%s:%d" % (self.host(i), self.port), "--node-id",
                "tqkv-%d" % i, "--dram-capacity", "256M", "--drain-seconds", "1",
                "--peers", "svc.test:%d" % self.port, "--peers-dns",
                "127.0.0.1:%d" % self.dport, "--handoff-seconds", "10",
                "--metrics-listen", "%s:%d" % (self.host(i), self.mport),
                "--data-listen", "%s:%d" % (self.host(i), self.dcport)] + self.extra
        f = open(log, "a")
        f.write("==== start\n")
        f.flush()
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, text=True)
        self.procs[i] = p
        self.wait_log(i, r"forwarding to peers", 60, since_start=True)
        if i not in self.published:
            self.published.append(i)
            self.publish()

    def log_text(self, i, since_start=True):
        with open(self.logs[i]) as f:
            t = f.read()
        return t[t.rindex("==== start"):] if since_start else t

    def wait_log(self, i, pattern, timeout, since_start=True):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            m = re.search(pattern, self.log_text(i, since_start))
            if m:
                return m
            if self.procs[i].poll() is not None and not since_start:
                pass
            time.sleep(0.05)
        raise RuntimeError("server %d: no log line /%s/ within %d s:\n%s" %
                           (i, pattern, timeout, self.log_text(i)[-3000:]))

    def stop(self, i, sig):
        p = self.procs[i]
        p.send_signal(sig)
        p.wait(timeout=60)

    def stub(self, i):
        return self.pbg.KVCacheStub(grpc.insecure_channel("%s:%d" % (self.host(i), self.port)))

    def metric(self, i, name):
        """Sum of the samples of `name` on server i: a bare name, or name{k="v",...} for the
        samples whose labels include those."""
        want_name, _, want = name.partition("{")
        want = [w for w in want.rstrip("}").split(",") if w]
        url = "http://%s:%d/metrics" % (self.host(i), self.mport)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, val = line.rsplit(" ", 1)
            n, _, labels = key.partition("{")
            if n == want_name and all(w in labels.rstrip("}").split(",") for w in want):
                total += float(val)
        return total

    def close(self):
        """SIGTERM (a clean exit: hand-off, drain; sanitizer builds report here), then
        SIGKILL whatever is left. Returns the exit codes of the servers that were up."""
        up = {i: p for i, p in self.procs.items() if p.poll() is None}
        for p in up.values():
            p.send_signal(signal.SIGTERM)
        codes = {}
        for i, p in up.items():
            try:
                codes[i] = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                codes[i] = p.wait()
        self.dns.stop()
        return codes


def load_client():
    """libtqkv's Python package (LIBTQKV_SO), under another name: "tqkv" is the grpcio
    stubs' package here."""
    if "tqkv_client" in sys.modules:
        return sys.modules["tqkv_client"]
    os.environ["TQKV_LIBRARY"] = LIBTQKV
    pkg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "transport",
                       "python", "tqkv")
    spec = importlib.util.spec_from_file_location(
        "tqkv_client", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    tqkv = importlib.util.module_from_spec(spec)
    sys.modules["tqkv_client"] = tqkv
    spec.loader.exec_module(tqkv)
    return tqkv


def bf16_pages(pb, stub, ns, hashes):
    """hash -> (key, value) BF16 bytes, decoded by the server behind stub."""
    out = {}
    for b in range(0, len(hashes), 120):
        for m in stub.Get(pb.GetRequest(namespace=ns, hashes=hashes[b:b + 120], layer_begin=0,
                                        layer_end=1, encoding=pb.ENCODING_BF16), timeout=60):
            if m.found:
                out[bytes(m.hash)] = (bytes(m.key), bytes(m.value))
    return out


def sharded_get(cl, pod_ids, ns, hashes, ref, ref_kv, routed_pod):
    """A client that shards itself reads hashes: libtqkv's Python package over the pods
    (read repair off; the first half over gRPC, the rest over TCP data channels), or, without
    LIBTQKV_SO, grpcio marked "tqkv-hop: 1" through routed_pod (only what it owns is
    found there). Returns (found, alike, wrong, how)."""
    if LIBTQKV and os.path.exists(LIBTQKV):
        tqkv = load_client()
        targets = ["%s:%d" % (cl.host(i), cl.port) for i in pod_ids]
        found = alike = 0
        half = len(hashes) // 2
        for part, tr in ((hashes[:half], "grpc"), (hashes[half:], "tcp")):
            c = tqkv.Client(targets, transport=tr, read_repair=False)
            try:
                k, v, f = c.get(ns, part, shape=(T, H, D))
                rs = c.repair_stats()
            finally:
                c.close()
            found += int(f.sum())
            for i, h in enumerate(part):
                alike += bool(f[0][i]) and ref_kv[h] == (k[0][i].tobytes(), v[0][i].tobytes())
            assert rs["queued"] == 0 and rs["stored"] == 0, rs  # no client read repair
        return found, alike, found - alike, "libtqkv over %d pods, read repair off" % len(pod_ids)
    got = get_pages(cl.pb, cl.stub(routed_pod), ns, hashes, metadata=[("tqkv-hop", "1")])
    same = sum(1 for h in got if ref[h] == got[h])
    return len(got), same, len(got) - same, "grpcio marked tqkv-hop: 1 through pod %d" % \
        routed_pod


def bf(a):
    return (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def put_blocks(pb, stub, ns, hashes, rng):
    def msgs():
        for h in hashes:
            yield pb.PutRequest(namespace=ns, hash=h, layer=0, num_layers=1, num_tokens=T,
                                num_kv_heads=H, head_dim=D,
                                key=bf(rng.standard_normal(T * H * D).astype(np.float32)),
                                value=bf(rng.standard_normal(T * H * D).astype(np.float32)))
    r = stub.Put(msgs(), timeout=60)
    assert r.blocks_stored + r.blocks_duplicate == len(hashes), r


def get_pages(pb, stub, ns, hashes, timeout=60, batch=120, metadata=None):
    out = {}
    for b in range(0, len(hashes), batch):
        for m in stub.Get(pb.GetRequest(namespace=ns, hashes=hashes[b:b + batch], layer_begin=0,
                                        layer_end=1), timeout=timeout, metadata=metadata):
            if m.found:
                out[bytes(m.hash)] = bytes(m.page)
    return out


def holders(cl, ids, ns, hashes):
    """Per hash, the pods that hold it (Lookups marked "tqkv-hop: 2", a peer's ask:
    answered from the store alone)."""
    out = [set() for _ in hashes]
    for i in ids:
        r = cl.stub(i).Lookup(cl.pb.LookupRequest(namespace=ns, hashes=hashes, num_layers=1),
                              timeout=10, metadata=[("tqkv-hop", "2")])
        for k, b in enumerate(r.blocks):
            if b.tier != 0:
                out[k].add(i)
    return out


def wait_converged(cl, ids, rng, deadline_s=60.0):
    """Bounded by an event: every server ranks blocks over the same members. The same
    probe blocks Put through each server in turn are held by one server each (a server
    that does not know a peer, or ranks differently, keeps a block it thinks its own)."""
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < deadline_s:
        hashes = [rng.bytes(16) for _ in range(24)]
        try:
            ns = "probe-%d" % n  # the same blocks (a block ranks by namespace and hash)
            for e in ids:
                put_blocks(cl.pb, cl.stub(e), ns, hashes, rng)
            ok = all(len(h) == 1 for h in holders(cl, ids, ns, hashes))
        except grpc.RpcError:
            ok = False
        if ok:
            return time.monotonic() - t0
        n += 1
        time.sleep(0.2)
    raise RuntimeError("the servers did not agree on the blocks' owners within %.0f s" %
                       deadline_s)


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    return 0 if cond else 1


def counters(cl, ids):
    """Per pod: forwarded requests and read-through requests (all methods)."""
    return {i: (cl.metric(i, "tqkv_forwarded_requests_total"),
                cl.metric(i, "tqkv_readthru_requests_total")) for i in ids}


def sharded_restart(cl, rng, hashes, ref, ref_kv, owned0):
    """Clients that shard themselves ("tqkv-hop: 1") through pod 0 restarted empty, and
    peers' asks ("tqkv-hop: 2") answered from the store alone."""
    pb = cl.pb
    fails = 0
    cl.stop(0, signal.SIGKILL)
    cl.start(0)  # empty; the hand-off copies of what it owns are on pods 1 and 2
    wait_converged(cl, [0, 1, 2], rng)
    base = counters(cl, (0, 1, 2))
    lk_rt0 = cl.metric(0, 'tqkv_readthru_blocks_total{method="Lookup"}')
    for val in ("2", "x"):  # a peer's ask, and a value the server does not know: the same
        lk = cl.stub(0).Lookup(pb.LookupRequest(namespace="rt", hashes=hashes, num_layers=1),
                               timeout=30, metadata=[("tqkv-hop", val)])
        got = get_pages(pb, cl.stub(0), "rt", hashes, metadata=[("tqkv-hop", val)])
        now = counters(cl, (0,))[0]
        fails += check(sum(1 for b in lk.blocks if b.tier) == 0 and not got and now == base[0],
                       "tqkv-hop: %s through the empty pod 0: Lookup %d, Get %d of 90 found (0: "
                       "its store alone); its forwarded/read-through requests %s -> %s" %
                       (val, sum(1 for b in lk.blocks if b.tier), len(got), base[0], now))
    # grpcio marked as a sharding client: the blocks pod 0 owns read through, none forwarded
    lk = cl.stub(0).Lookup(pb.LookupRequest(namespace="rt", hashes=hashes, num_layers=1),
                           timeout=30, metadata=[("tqkv-hop", "1")])
    found = {h for h, b in zip(hashes, lk.blocks) if b.tier}
    lk_rt = cl.metric(0, 'tqkv_readthru_blocks_total{method="Lookup"}') - lk_rt0
    fails += check(found == owned0 and len(owned0) > 0 and lk_rt == len(owned0),
                   "tqkv-hop: 1 Lookup through pod 0: %d found, = the %d it owns: %s (%d read "
                   "through, the rest not forwarded)" %
                   (len(found), len(owned0), found == owned0, lk_rt))
    rt_get0 = cl.metric(0, 'tqkv_readthru_hits_total{method="Get"}')
    found_n, alike, wrong, how = sharded_get(cl, (0, 1, 2), "rt", hashes, ref, ref_kv, 0)
    want = 90 if "libtqkv" in how else len(owned0)
    fails += check(found_n == want and alike == want and wrong == 0,
                   "sharding client (%s) after pod 0 restarted empty: %d found (want %d), %d "
                   "alike, %d wrong" % (how, found_n, want, alike, wrong))
    held = {h for h, w in zip(hashes, holders(cl, [0], "rt", hashes)) if w}
    rt_get = cl.metric(0, 'tqkv_readthru_hits_total{method="Get"}') - rt_get0
    fails += check(owned0 <= held and rt_get >= len(owned0),
                   "pod 0 now holds %d of the %d blocks it owns (server-side read-through: %d "
                   "pages copied; the client's read repair is off)" %
                   (len(owned0 & held), len(owned0), rt_get))
    now = counters(cl, (0, 1, 2))
    fails += check(now[0][0] == base[0][0] and all(now[i] == base[i] for i in (1, 2)),
                   "no loops: forwarded/read-through requests pod 0 %s -> %s (forwarded "
                   "unchanged), pod 1 %s -> %s, pod 2 %s -> %s (unchanged: the peers' asks are "
                   "answered from their stores)" %
                   (base[0], now[0], base[1], now[1], base[2], now[2]))
    return fails


def restart(cl, rng):
    pb = cl.pb
    fails = 0
    cl.published = [0, 1, 2]
    cl.publish()
    for i in range(3):
        cl.start(i)
    print("servers agree on the owners after %.1f s" % wait_converged(cl, [0, 1, 2], rng))
    hashes = [rng.bytes(16) for _ in range(90)]
    put_blocks(pb, cl.stub(1), "rt", hashes, rng)
    ref = get_pages(pb, cl.stub(1), "rt", hashes)
    fails += check(len(ref) == 90, "before the restart: 90 of 90 found through pod 1 (%d)" %
                   len(ref))
    ref_kv = bf16_pages(pb, cl.stub(1), "rt", hashes)
    owned0 = {h for h, w in zip(hashes, holders(cl, [0], "rt", hashes)) if w}  # its own only

    cl.stop(0, signal.SIGTERM)
    m = re.search(r"hand-off.*?pages=(\d+).*?failed=(\d+)", cl.log_text(0))
    fails += check(m is not None and m.group(2) == "0",
                   "pod 0's hand-off: %s" % (m.group(0) if m else "no line"))
    cl.start(0)

    # Lookup through the restarted pod: every block, at most one Lookup per peer.
    before = [cl.metric(i, 'tqkv_requests_total{method="Lookup"}') for i in (1, 2)]
    t0 = time.monotonic()
    lk = cl.stub(0).Lookup(pb.LookupRequest(namespace="rt", hashes=hashes, num_layers=1),
                           timeout=30)
    took = time.monotonic() - t0
    after = [cl.metric(i, 'tqkv_requests_total{method="Lookup"}') for i in (1, 2)]
    asks = [a - b for a, b in zip(after, before)]
    found = sum(1 for b in lk.blocks if b.tier != 0)
    rt_asked = cl.metric(0, 'tqkv_readthru_blocks_total{method="Lookup"}')
    rt_hits = cl.metric(0, 'tqkv_readthru_hits_total{method="Lookup"}')
    fails += check(found == 90 and lk.prefix_blocks == 90,
                   "Lookup through the restarted pod 0: %d of 90 found, prefix %d (%.3f s)" %
                   (found, lk.prefix_blocks, took))
    fails += check(all(a <= 1 for a in asks),
                   "peer Lookups asked by that Lookup: pod 1 %d, pod 2 %d (<= 1 each)" %
                   (asks[0], asks[1]))
    fails += check(rt_asked > 0 and rt_hits == rt_asked,
                   "pod 0 read through %d owned hashes in the Lookup, %d found" %
                   (rt_asked, rt_hits))

    # Get through every pod: all 90, byte-identical; the restarted pod first.
    for i in (0, 1, 2):
        got = get_pages(pb, cl.stub(i), "rt", hashes)
        same = sum(1 for h in got if ref.get(h) == got[h])
        wrong = sum(1 for h in got if ref.get(h) != got[h])
        fails += check(len(got) == 90 and same == 90 and wrong == 0,
                       "Get through pod %d: %d of 90 found, %d byte-identical, %d wrong" %
                       (i, len(got), same, wrong))
    pages = cl.metric(0, 'tqkv_readthru_hits_total{method="Get"}')
    nbytes = cl.metric(0, "tqkv_readthru_bytes_total")
    reqs = cl.metric(0, 'tqkv_readthru_requests_total{method="Get"}')
    fails += check(pages >= rt_asked and nbytes > 0,
                   "pod 0 copied %d pages (%d bytes) from its peers in %d read-through asks" %
                   (pages, nbytes, reqs))
    got = get_pages(pb, cl.stub(0), "rt", hashes)
    reqs2 = cl.metric(0, 'tqkv_readthru_requests_total{method="Get"}')
    fails += check(len(got) == 90 and all(ref[h] == got[h] for h in got) and reqs2 == reqs,
                   "Get through pod 0 again: %d found, read-through asks %d -> %d (now local)" %
                   (len(got), reqs, reqs2))

    fails += sharded_restart(cl, rng, hashes, ref, ref_kv, owned0)

    # A peer killed during read-through: missing, quickly, never wrong, no error storm.
    cl.stop(0, signal.SIGKILL)
    cl.start(0)  # empty: the hand-off copies are still on pods 1 and 2
    warn0 = cl.log_text(0).count('"warn"') + cl.log_text(0).count("level=warn")
    results, errors, stop = [], [], threading.Event()

    def loop():
        stub = cl.stub(0)
        k = 0
        while not stop.is_set():
            part = hashes[(k * 10) % 90:(k * 10) % 90 + 10]
            k += 1
            t = time.monotonic()
            try:
                got = get_pages(pb, stub, "rt", part, timeout=30)
                results.append((time.monotonic() - t, len(got),
                                sum(1 for h in got if ref[h] != got[h])))
            except grpc.RpcError as e:
                errors.append(str(e.code()))

    th = threading.Thread(target=loop)
    th.start()
    t0 = time.monotonic()
    while len(results) + len(errors) < 5 and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    n_before = len(results)
    cl.stop(2, signal.SIGKILL)
    t0 = time.monotonic()
    while len(results) + len(errors) < n_before + 30 and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    stop.set()
    th.join()
    after = results[n_before:]
    slowest = max(r[0] for r in after) if after else float("inf")
    wrong = sum(r[2] for r in results)
    found = sum(r[1] for r in after)
    text = cl.log_text(0)
    warns = text.count('"warn"') + text.count("level=warn") - warn0
    fails += check(not errors and len(after) >= 30,
                   "pod 2 SIGKILLed during read-through Gets through pod 0: %d calls after the "
                   "kill, %d failed %s" % (len(after), len(errors), sorted(set(errors))))
    fails += check(slowest < 3.0, "slowest call after the kill %.3f s (< 3 s)" % slowest)
    fails += check(wrong == 0, "wrong pages: %d (of %d calls)" % (wrong, len(results)))
    fails += check(warns <= 5, "warnings logged by pod 0 meanwhile: %d (<= 5)" % warns)
    print("found after the kill: %d of %d asked" % (found, 10 * len(after)))

    # Every peer gone: the blocks pod 0 does not hold are missing, at once, no error.
    cl.stop(1, signal.SIGKILL)
    # pod 0's copies of the first half go (a Delete marked tqkv-hop: here only)
    cl.stub(0).Delete(pb.DeleteRequest(namespace="rt", hashes=hashes[:45]), timeout=10,
                      metadata=[("tqkv-hop", "2")])
    local = holders(cl, [0], "rt", hashes)
    held = sum(1 for h in local if h)
    times, got_n, errs = [], 0, []
    for k in range(9):
        part = hashes[k * 10:k * 10 + 10]
        t = time.monotonic()
        try:
            got = get_pages(pb, cl.stub(0), "rt", part, timeout=30)
            got_n += len(got)
            wrong += sum(1 for h in got if ref[h] != got[h])
        except grpc.RpcError as e:
            errs.append(str(e.code()))
        times.append(time.monotonic() - t)
    fails += check(not errs and got_n == held and held <= 45 and wrong == 0 and
                   max(times) < 3.0,
                   "every peer SIGKILLed: Gets through pod 0 found %d of 90 (the %d it holds), "
                   "%d failed, slowest %.3f s, wrong %d" %
                   (got_n, held, len(errs), max(times), wrong))
    return fails


def mix64(z):
    m = (1 << 64) - 1
    z = (z + 0x9e3779b97f4a7c15) & m
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & m
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & m
    return z ^ (z >> 31)


def fnv1a(h, data):
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & ((1 << 64) - 1)
    return h


def rank(node_ids, ns, h):
    """The servers (node ids) in the order clients and servers rank them for block (ns, h):
    flat rendezvous, as transport/shard.c up to TQKV_SHARD_FLAT_MAX servers."""
    off = 0xcbf29ce484222325
    mk = mix64(mix64(fnv1a(fnv1a(fnv1a(off, ns.encode()), b"\0"), h)))
    return sorted(node_ids, key=lambda n: -mix64(mix64(fnv1a(off, n.encode())) ^ mk))


def wait_metric(cl, pods, name, at_least, timeout):
    """Bounded by an event: every pod in pods reports name >= at_least."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(cl.metric(i, name) >= at_least for i in pods):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise RuntimeError("%s < %s on pods %s after %d s" % (name, at_least, pods, timeout))


def pushed_back(cl, how, hashes, top2, ref, passes0, hellos0):
    """Pod 0, restarted empty, gets every block it ranks first or second for from pods 1
    and 2 with no client reading, byte-identical, through passes after its hello."""
    pb = cl.pb
    t0 = time.monotonic()
    have = set()
    while time.monotonic() - t0 < 60 and not top2 <= have:
        have = {h for h, w in zip(hashes, holders(cl, [0], "rp", hashes)) if w}
        time.sleep(0.2)
    took = time.monotonic() - t0
    got = get_pages(pb, cl.stub(0), "rp", sorted(have), metadata=[("tqkv-hop", "2")])
    wrong = sum(1 for h in got if ref[h] != got[h])
    rt = cl.metric(0, "tqkv_readthru_requests_total")
    passes = [cl.metric(i, "tqkv_replicate_passes_total") for i in (1, 2)]
    hellos = [cl.metric(i, "tqkv_peer_hellos_total") for i in (1, 2)]
    return check(top2 <= have and len(got) == len(have) and wrong == 0 and rt == 0 and
                 all(hellos[k] > hellos0[k] for k in (0, 1)),
                 "pod 0 %s: received %d of the %d blocks it ranks first or second for in "
                 "%.1f s, no client reading (read-through requests %d), %d byte-identical, %d "
                 "wrong; hellos at pods 1, 2: %s -> %s, their passes %s -> %s" %
                 (how, len(top2 & have), len(top2), took, rt, len(got) - wrong, wrong,
                  hellos0, hellos, passes0, passes))


def replicate(cl, rng):
    """Background re-replication: a restarted server gets its share back from its peers
    with no client reading."""
    pb = cl.pb
    fails = 0
    rate = 100 * 1024
    cl.extra = ["--replicate-bytes-per-s", str(rate)]
    cl.published = [0, 1, 2]
    cl.publish()
    for i in range(3):
        cl.start(i)
    print("servers agree on the owners after %.1f s" % wait_converged(cl, [0, 1, 2], rng))
    ids = ["tqkv-0", "tqkv-1", "tqkv-2"]
    hashes = [rng.bytes(16) for _ in range(90)]
    put_blocks(pb, cl.stub(1), "rp", hashes, rng)
    ref = get_pages(pb, cl.stub(1), "rp", hashes)
    held = holders(cl, [0, 1, 2], "rp", hashes)
    first = [int(rank(ids, "rp", h)[0][-1]) for h in hashes]
    fails += check(all(first[k] in held[k] for k in range(90)),
                   "each block held by the server that ranks first for it (this test's "
                   "ranking agrees with the servers')")
    top2 = {h for h in hashes if "tqkv-0" in rank(ids, "rp", h)[:2]}
    # Each peer's first pass (2 s after its start) over before pod 0 goes: what pod 0
    # receives after its restart is pushed by passes that reacted to it.
    wait_metric(cl, (1, 2), "tqkv_replicate_passes_total", 1, 60)
    passes0 = [cl.metric(i, "tqkv_replicate_passes_total") for i in (1, 2)]
    hellos0 = [cl.metric(i, "tqkv_peer_hellos_total") for i in (1, 2)]
    cl.published = [1, 2]  # as a terminating pod leaves the Service
    cl.publish()
    cl.stop(0, signal.SIGTERM)
    cl.start(0)  # empty, published again
    fails += pushed_back(cl, "restarted (SIGTERM, out of DNS meanwhile)", hashes, top2, ref,
                         passes0, hellos0)
    # A crash and restart at the same address and node id, never out of DNS (a container
    # restarted in its pod): nothing changes in the peers' tables; pod 0's hello (its
    # node-id questions) is what starts their passes.
    passes0 = [cl.metric(i, "tqkv_replicate_passes_total") for i in (1, 2)]
    hellos0 = [cl.metric(i, "tqkv_peer_hellos_total") for i in (1, 2)]
    cl.stop(0, signal.SIGKILL)
    cl.start(0)
    fails += pushed_back(cl, "SIGKILLed and restarted, never out of DNS", hashes, top2, ref,
                         passes0, hellos0)
    passes = []
    for i in (1, 2):
        for m in re.finditer(r"replicate: pass.*?bytes=(\d+).*?seconds=([\d.]+)",
                             cl.log_text(i, False)):
            passes.append((int(m.group(1)), float(m.group(2))))
    big = [(b, s) for b, s in passes if b >= 2 * rate]
    fails += check(passes and all(b / max(s, 1e-9) <= 1.25 * rate for b, s in big),
                   "passes of pods 1 and 2 (bytes, seconds): %s; those over 2 s of budget at "
                   "<= 1.25 x %d B/s" % (passes, rate))
    return fails


def scaleout(cl, rng):
    pb = cl.pb
    fails = 0
    cl.published = [0, 1, 2]
    cl.publish()
    for i in range(3):
        cl.start(i)
    print("servers agree on the owners after %.1f s" % wait_converged(cl, [0, 1, 2], rng))
    hashes = [rng.bytes(16) for _ in range(960)]
    for b in range(0, 960, 120):
        put_blocks(pb, cl.stub(b // 120 % 3), "so", hashes[b:b + 120], rng)
    ref = get_pages(pb, cl.stub(0), "so", hashes)
    fails += check(len(ref) == 960, "before the scale-out: %d of 960 found through pod 0" %
                   len(ref))
    sh = [rng.bytes(16) for _ in range(240)]
    for b in range(0, 240, 120):
        put_blocks(pb, cl.stub(b // 120 % 3), "sh", sh[b:b + 120], rng)
    sh_ref = get_pages(pb, cl.stub(0), "sh", sh)
    sh_kv = bf16_pages(pb, cl.stub(0), "sh", sh)
    cl.start(3)  # published in DNS once it serves (the others re-resolve every second)
    m = re.search(r"forwarding to peers.*?peers=(\d+)", cl.log_text(3))
    print("pod 3: %s" % m.group(0))
    grpc_half, dc_half = hashes[:480], hashes[480:]
    got = get_pages(pb, cl.stub(3), "so", grpc_half)
    same = sum(1 for h in got if ref.get(h) == got[h])
    rt = cl.metric(3, 'tqkv_readthru_hits_total{method="Get"}')
    fails += check(len(got) == 480 and same == 480,
                   "gRPC Get through the new pod 3: %d of 480 found, %d byte-identical "
                   "(%d read through as its own)" % (len(got), same, rt))
    if LIBTQKV and os.path.exists(LIBTQKV):
        tqkv = load_client()
        c = tqkv.Client(["%s:%d" % (cl.host(3), cl.port)], transport="tcp", read_repair=False)
        try:
            rt0 = cl.metric(3, 'tqkv_readthru_requests_total{method="Get"}')
            k, v, found = c.get("so", dc_half, shape=(T, H, D))
            chans = cl.metric(3, "tqkv_data_channels")
            rt1 = cl.metric(3, 'tqkv_readthru_requests_total{method="Get"}')
        finally:
            c.close()
        # the same blocks decoded by pod 0 (ENCODING_BF16), for comparison
        alike = 0
        for b in range(0, 480, 120):
            for m in cl.stub(0).Get(pb.GetRequest(namespace="so", hashes=dc_half[b:b + 120],
                                                  layer_begin=0, layer_end=1,
                                                  encoding=pb.ENCODING_BF16), timeout=60):
                i = dc_half.index(bytes(m.hash))
                alike += m.found and bytes(m.key) == k[0][i].tobytes() and \
                    bytes(m.value) == v[0][i].tobytes()
        fails += check(int(found.sum()) == 480 and alike == 480 and chans >= 1 and rt1 > rt0,
                       "TCP data channel Get through pod 3 (libtqkv, one target, no read "
                       "repair): %d of 480 found, %d decoded alike, %d channel(s) open, "
                       "read-through asks %d -> %d" % (found.sum(), alike, chans, rt0, rt1))
    else:
        print("the TCP data channel half: SKIPPED (no libtqkv.so given)")
        got2 = get_pages(pb, cl.stub(3), "so", dc_half)
        fails += check(len(got2) == 480, "gRPC Get of the other half: %d of 480" % len(got2))
    fails += check(rt > 0, "pod 3 owns some of them and read them through (%d)" % rt)

    # A client that shards itself over the 4 pods ("tqkv-hop: 1", read repair off): pod 3
    # reads through the blocks it owns; no pod forwards or reads through a peer's ask.
    wait_converged(cl, [0, 1, 2, 3], rng)
    base = counters(cl, (0, 1, 2, 3))
    b0 = cl.metric(3, 'tqkv_readthru_blocks_total{method="Get"}')
    h0 = cl.metric(3, 'tqkv_readthru_hits_total{method="Get"}')
    found_n, alike, wrong, how = sharded_get(cl, (0, 1, 2, 3), "sh", sh, sh_ref, sh_kv, 3)
    asked = cl.metric(3, 'tqkv_readthru_blocks_total{method="Get"}') - b0
    hits = cl.metric(3, 'tqkv_readthru_hits_total{method="Get"}') - h0
    want = 240 if "libtqkv" in how else hits
    held = sum(1 for w in holders(cl, [3], "sh", sh) if w)
    fails += check(found_n == want and alike == want and wrong == 0 and hits > 0 and
                   hits == asked and held >= hits,
                   "sharding client (%s) after the scale-out: %d of 240 found (want %d), %d "
                   "alike, %d wrong; pod 3 read through %d of the %d it owns and lacked, holds "
                   "%d" % (how, found_n, want, alike, wrong, hits, asked, held))
    now = counters(cl, (0, 1, 2, 3))
    fails += check(all(now[i] == base[i] for i in (0, 1, 2)) and now[3][0] == base[3][0],
                   "no loops: forwarded/read-through requests of pods 0-2 unchanged %s, pod 3 "
                   "forwarded none (%s -> %s)" % ([now[i] for i in (0, 1, 2)], base[3], now[3]))
    return fails


def main():
    if not have_dnsmasq():
        print("SKIP: dnsmasq not installed")
        return 77
    s = socket.socket()
    try:
        s.bind(("127.0.0.2", 0))
    except OSError:
        print("SKIP: cannot bind 127.0.0.2 (loopback addresses beyond 127.0.0.1)")
        return 77
    finally:
        s.close()
    with tempfile.TemporaryDirectory() as tmp:
        pb, pbg = stubs(tmp)
        cl = Cluster(tmp, pb, pbg)
        seed = int(os.environ.get("TQKV_TEST_SEED", "22"))
        print("TQKV_TEST_SEED=%d" % seed)
        rng = np.random.default_rng(seed)
        fails, codes = 1, {}
        try:
            fails = {"restart": restart, "scaleout": scaleout, "replicate": replicate}[MODE](cl, rng)
        except Exception:
            for i in cl.logs:
                print("---- server %d log (tail)\n%s" % (i, cl.log_text(i, False)[-2000:]))
            raise
        finally:
            codes = cl.close()
        if any(c != 0 for c in codes.values()):
            print("FAIL servers' exit codes after SIGTERM: %s" % codes)
            fails += 1
        if fails:
            for i in cl.logs:
                print("---- server %d log (tail)\n%s" % (i, cl.log_text(i, False)[-2000:]))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
