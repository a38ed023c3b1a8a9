#!/usr/bin/env python3
"""nemesis.py - many tqkv-servers, each in its own network namespace, under random faults.

The test builds its own network: a hub namespace holding a Linux bridge, one namespace
per server (tqkv-server --listen 0.0.0.0:50051 --node-id tqkv-<i>, 10.88.0.<10+i>) and
one for the clients and the DNS server (10.88.0.2), each joined to the bridge by a veth
pair. dnsmasq in the client namespace serves the Service name svc.test: one A record per
ready server (the Endpoints of a headless Service), rewritten and reloaded (SIGHUP) as
servers come and go; the servers find their peers through it (--peers svc.test:50051,
forwarding and hand-off on).

Clients, in the client namespace:
  * tqkv-bench --target svc.test:50051 --replicas 2 --phase decode (libtqkv follows the
    DNS name), its hit rate, errors and verify failures per second (--csv);
  * the tqkv Python package (libtqkv through cffi, build/transport/libtqkv.so next to
    the bench's folder, or TQKV_LIBRARY) following svc.test, R = 2, Gets compared with
    what was Put; the longest time without a call ending is its stall;
  * thin grpcio clients (a separate process), each call through one ready pod chosen at
    random (as the load-balanced Service would): Put a block, Get blocks Put earlier as
    BF16 and compare with what was Put (a wrong page is one whose decoded values are not
    within the codec's error of the block's own values); every call is logged with its
    start and end times.

A scheduler applies faults one at a time, with quiet time between them:
  kill       SIGKILL a server, drop its DNS record 1 s later, restart it (same node id,
             same address) after 3 s and publish it again
  rollout    SIGTERM two servers in turn (hand-off to peers, drain), each restarted
  blackhole  drop every packet a server sends from port 50051 (tc: htb + u32 into a
             blackhole qdisc; no RST), for 8 s; it stays in DNS
  partition  a server's namespace cut off from the bridge (its veth's both directions
             into a blackhole qdisc) for 8 s; it stays in DNS
  join       a new server starts and is published
  leave      a server is SIGTERMed (hand-off) and unpublished for good

Must hold (asserted): 0 wrong pages (bench verify failures, thin clients' checks); 0
client-visible errors outside the fault windows (a bench second counts as inside when
it overlaps [start, end + 1 s] of a fault; a thin client call when it started or ended
inside [start, end]); the bench's hit rate back to >= 90% of its level in the 5 s
before a fault within 10 s after the fault ends. The bench's longest stall (consecutive
seconds under 10% of its pages/s before the fault) and the Python client's (the longest
time without a call ending) are reported per fault; with --expect-stall-s S neither may
exceed S. Thin calls that time out in a forwarding cycle (two pods forwarding Puts to
each other, a known gap in docs/cluster.md) are reported apart, not asserted. gnuplot
draws the hit rate with the fault windows shaded.

usage: nemesis.py TQKV_SERVER TQKV_BENCH PROTO_DIR OUTDIR [--servers N] [--duration S]
                  [--faults kill,rollout,...] [--seed N] [--expect-stall-s S]
                  [--replicate-bytes-per-s BYTES]
       exits 77 (skipped) when it cannot make network namespaces (needs root, iproute2,
       tc with htb/u32/blackhole, dnsmasq).
"""
import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PLOT = os.path.join(HERE, "..", "..", "deploy", "bench", "hit-rate.gp")
DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
PORT = 50051
DATA_LISTEN = False
REPLICATE = "0"
NET = "10.88.0."
CLIENT_IP = NET + "2"


def sh(*args, check=True):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(args), r.stderr.strip()))
    return r


class Net:
    """The namespaces, the bridge and the veth pairs; remove() undoes all of it."""

    def __init__(self, tag):
        self.tag = tag
        self.hub = tag + "h"
        self.client = tag + "c"
        self.made = []

    def ns(self, name):
        sh(IP, "netns", "add", name)
        self.made.append(name)
        sh(IP, "-n", name, "link", "set", "lo", "up")

    def setup(self):
        self.ns(self.hub)
        sh(IP, "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh(IP, "-n", self.hub, "link", "set", "br0", "up")
        self.ns(self.client)
        self.attach(self.client, "c", CLIENT_IP)

    def attach(self, name, short, addr):
        hv = "h" + short
        sh(IP, "-n", self.hub, "link", "add", hv, "type", "veth", "peer", "name", "eth0",
           "netns", name)
        sh(IP, "-n", self.hub, "link", "set", hv, "master", "br0", "up")
        sh(IP, "-n", name, "addr", "add", addr + "/24", "dev", "eth0")
        sh(IP, "-n", name, "link", "set", "eth0", "up")

    def server_ns(self, i):
        return "%ss%d" % (self.tag, i)

    def add_server(self, i):
        name = self.server_ns(i)
        if name not in self.made:
            self.ns(name)
            self.attach(name, "s%d" % i, NET + str(10 + i))

    def blackhole_port(self, i, on):
        """Drops what server i sends from PORT (answers and SYN-ACKs vanish, no RST)."""
        ns = self.server_ns(i)
        if on:
            sh(IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", "eth0", "root", "handle",
               "1:", "htb", "default", "10")
            sh(IP, "netns", "exec", ns, TC, "class", "add", "dev", "eth0", "parent", "1:",
               "classid", "1:10", "htb", "rate", "100gbit")
            sh(IP, "netns", "exec", ns, TC, "class", "add", "dev", "eth0", "parent", "1:",
               "classid", "1:30", "htb", "rate", "100gbit")
            sh(IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", "eth0", "parent", "1:30",
               "handle", "30:", "blackhole")
            for port in (PORT, PORT + 1) if DATA_LISTEN else (PORT,):  # and the data port
                sh(IP, "netns", "exec", ns, TC, "filter", "add", "dev", "eth0", "parent", "1:",
                   "protocol", "ip", "prio", "1", "u32", "match", "ip", "sport", str(port),
                   "0xffff", "flowid", "1:30")
        else:
            sh(IP, "netns", "exec", ns, TC, "qdisc", "del", "dev", "eth0", "root")

    def partition(self, i, on):
        """Cuts server i's namespace off: both directions of its veth pair drop all."""
        ns = self.server_ns(i)
        op = "add" if on else "del"
        extra = ["blackhole"] if on else []
        sh(IP, "netns", "exec", ns, TC, "qdisc", op, "dev", "eth0", "root", *extra)
        sh(IP, "netns", "exec", self.hub, TC, "qdisc", op, "dev", "hs%d" % i, "root", *extra)

    def remove(self):
        for name in reversed(self.made):
            sh(IP, "netns", "del", name, check=False)
        self.made = []


def remove_stale():
    """Namespaces of an earlier run that was killed (tqn<pid>...) whose pid is gone."""
    r = sh(IP, "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith("tqn"):
            continue
        pid = ""
        for ch in name[3:]:
            if not ch.isdigit():
                break
            pid += ch
        if pid and not os.path.exists("/proc/%s" % pid):
            sh(IP, "netns", "del", name, check=False)


def can_netns():
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, tc)"
    for tool in (IP, TC, DNSMASQ):
        if not os.path.exists(tool):
            return "%s is not installed" % tool
    probe = "tqkvprobe%d" % os.getpid()
    r = sh(IP, "netns", "add", probe, check=False)
    if r.returncode != 0:
        return "cannot create a network namespace: " + r.stderr.strip()
    try:
        r = sh(IP, "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
               check=False)
        if r.returncode != 0:
            return "cannot create a veth pair: " + r.stderr.strip()
        for q in (["htb", "default", "10"], ["blackhole"]):
            r = sh(IP, "netns", "exec", probe, TC, "qdisc", "add", "dev", "v0", "root", *q,
                   check=False)
            if r.returncode != 0:
                return "tc qdisc %s unavailable: %s" % (q[0], r.stderr.strip())
            sh(IP, "netns", "exec", probe, TC, "qdisc", "del", "dev", "v0", "root", check=False)
    finally:
        sh(IP, "netns", "del", probe, check=False)
    return None


class Dns:
    """dnsmasq in the client namespace: svc.test has one A record per published server."""

    def __init__(self, net, tmp):
        self.net = net
        self.hosts = os.path.join(tmp, "hosts")
        self.members = set()
        self.lock = threading.Lock()
        self.write()
        self.proc = subprocess.Popen(
            [IP, "netns", "exec", net.client, DNSMASQ, "--keep-in-foreground",
             "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
             "--listen-address=" + CLIENT_IP, "--bind-interfaces", "--pid-file=",
             "--cache-size=0", "--local-ttl=0", "--user=root", "--port=53",
             "--addn-hosts=" + self.hosts], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self.endpoints = os.path.join(tmp, "endpoints")

    def write(self):
        tmp = self.hosts + ".tmp"
        with open(tmp, "w") as f:
            f.write("%s dns.test\n" % CLIENT_IP)
            for i in sorted(self.members):
                f.write("%s%d svc.test\n" % (NET, 10 + i))
        os.rename(tmp, self.hosts)
        ep = os.path.join(os.path.dirname(self.hosts), "endpoints")
        with open(ep + ".tmp", "w") as f:
            f.write(" ".join("%s%d" % (NET, 10 + i) for i in sorted(self.members)))
        os.rename(ep + ".tmp", ep)

    def publish(self, i, on):
        with self.lock:
            (self.members.add if on else self.members.discard)(i)
            self.write()
            if getattr(self, "proc", None):
                self.proc.send_signal(signal.SIGHUP)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class Server:
    def __init__(self, net, dns, i, logdir):
        self.net, self.dns, self.i = net, dns, i
        self.proc = None
        self.log = os.path.join(logdir, "server-%d.log" % i)

    def start(self):
        self.net.add_server(self.i)
        args = [IP, "netns", "exec", self.net.server_ns(self.i), SERVER_BIN, "--listen",
                "0.0.0.0:%d" % PORT, "--node-id", "tqkv-%d" % self.i, "--dram-capacity",
                "256M", "--drain-seconds", "2", "--peers", "svc.test:%d" % PORT, "--peers-dns",
                CLIENT_IP + ":53", "--handoff-seconds", "5", "--log-level", "warn"]
        if DATA_LISTEN:
            args += ["--data-listen", "0.0.0.0:50052"]
        if REPLICATE != "0":
            args += ["--replicate-bytes-per-s", REPLICATE]
        err = open(self.log, "a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server %d did not start (see %s)" % (self.i, self.log))
            if "listening on" in line:
                break
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def term(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None


# ---------------------------------------------------------------- thin grpcio clients

def thin_main(proto_dir, endpoints, out, duration, seed):
    """Runs in the client namespace: 2 threads of Put-then-Get through random pods."""
    import grpc
    import numpy as np
    tmp = tempfile.mkdtemp()
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.check_call(["protoc", "-I" + proto_dir, "--python_out=" + tmp,
                           "--grpc_python_out=" + tmp,
                           "--plugin=protoc-gen-grpc_python=" + plugin,
                           "tqkv/v1/kvcache.proto"])
    sys.path.insert(0, tmp)
    import tqkv.v1.kvcache_pb2 as pb
    import tqkv.v1.kvcache_pb2_grpc as pbg
    T, H, D = 16, 2, 64
    stubs = {}
    lock = threading.Lock()
    logf = open(out, "w")
    stop = time.time() + duration

    def stub(ip):
        with lock:
            if ip not in stubs:
                # as a client behind a Service would: reconnect soon after a pod is back
                # (gRPC's default back-off reaches 2 minutes), wait for the connection
                stubs[ip] = pbg.KVCacheStub(grpc.insecure_channel("%s:%d" % (ip, PORT), options=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 500)]))
            return stubs[ip]

    def pods():
        try:
            with open(endpoints) as f:
                return f.read().split()
        except OSError:
            return []

    def block(h):
        r = np.random.default_rng(int.from_bytes(h[:8], "little"))
        k = r.standard_normal(T * H * D).astype(np.float32)
        v = r.standard_normal(T * H * D).astype(np.float32)
        return k, v

    def bf(a):
        return (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()

    def unbf(b):
        return (np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

    def log(**kw):
        with lock:
            logf.write(json.dumps(kw) + "\n")
            logf.flush()

    def worker(w):
        rng = random.Random(seed * 100 + w)
        mine = []
        while time.time() < stop:
            ps = pods()
            if not ps:
                time.sleep(0.1)
                continue
            ip = rng.choice(ps)
            if not mine or rng.random() < 0.3:
                h = rng.randbytes(16)
                k, v = block(h)
                t0 = time.time()
                try:
                    r = stub(ip).Put(iter([pb.PutRequest(
                        namespace="thin", hash=h, layer=0, num_layers=1, num_tokens=T,
                        num_kv_heads=H, head_dim=D, key=bf(k), value=bf(v))]), timeout=30,
                        wait_for_ready=True)
                    ok = r.blocks_stored + r.blocks_duplicate == 1
                    log(op="put", t0=t0, t1=time.time(), pod=ip, ok=ok,
                        err="" if ok else "stored 0")
                    if ok:
                        mine.append(h)
                except grpc.RpcError as e:
                    log(op="put", t0=t0, t1=time.time(), pod=ip, ok=False,
                        err="%s %s" % (e.code(), e.details()))
            else:
                hs = rng.sample(mine, min(4, len(mine)))
                t0 = time.time()
                try:
                    found = wrong = 0
                    for m in stub(ip).Get(pb.GetRequest(namespace="thin", hashes=hs,
                                                        layer_begin=0, layer_end=1,
                                                        encoding=pb.ENCODING_BF16), timeout=30,
                                              wait_for_ready=True):
                        if not m.found:
                            continue
                        found += 1
                        k, v = block(bytes(m.hash))
                        gk, gv = unbf(m.key), unbf(m.value)
                        bad = gk.shape != k.shape or gv.shape != v.shape
                        if not bad:
                            ek = np.linalg.norm(gk - k) / np.linalg.norm(k)
                            ev = np.linalg.norm(gv - v) / np.linalg.norm(v)
                            bad = not (ek < 0.3 and ev < 0.3)
                        wrong += bad
                    log(op="get", t0=t0, t1=time.time(), pod=ip, ok=True, asked=len(hs),
                        found=found, wrong=wrong)
                except grpc.RpcError as e:
                    log(op="get", t0=t0, t1=time.time(), pod=ip, ok=False,
                        err="%s %s" % (e.code(), e.details()))
            time.sleep(0.02)

    ths = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    logf.close()
    os._exit(0)  # grpc's threads


# ---------------------------------------------------------------- a libtqkv Python client

def py_main(out, duration, seed):
    """Runs in the client namespace: the tqkv package (libtqkv) following svc.test, R = 2:
    Puts blocks, then Gets 4 at a time and compares the decoded values with what was Put;
    every call logged (its progress is what a stall is measured on)."""
    import numpy as np
    import tqkv
    T, H, D = 16, 2, 64
    c = tqkv.Client("svc.test:%d" % PORT, replicas=2, resolve_targets=True,
                    dns_servers=CLIENT_IP + ":53", resolve_interval_ms=1000, transport="grpc",
                    wait_for_ready=False)
    rng = random.Random(seed * 7 + 3)
    logf = open(out, "w")
    blocks = {}

    def data(h):
        r = np.random.default_rng(int.from_bytes(h[:8], "little"))
        f = r.standard_normal((2, T, H, D)).astype(np.float32)
        return f[0], f[1]

    def put(hs):
        ks = np.stack([tqkv.bf16_from_float32(data(h)[0]) for h in hs])
        vs = np.stack([tqkv.bf16_from_float32(data(h)[1]) for h in hs])
        c.put("py", hs, ks, vs)
        for h in hs:
            blocks[h] = True

    put([rng.randbytes(16) for _ in range(32)])
    stop = time.time() + duration
    n = 0
    while time.time() < stop:
        n += 1
        t0 = time.time()
        try:
            if n % 10 == 0:
                put([rng.randbytes(16)])
                logf.write(json.dumps(dict(op="put", t0=t0, t1=time.time(), ok=True)) + "\n")
                continue
            hs = rng.sample(list(blocks), 4)
            k, v, found = c.get("py", hs, shape=(T, H, D))
            wrong = 0
            for j, h in enumerate(hs):
                if not found[0][j]:
                    continue
                wk, wv = data(h)
                gk = tqkv.bf16_to_float32(k[0][j])
                gv = tqkv.bf16_to_float32(v[0][j])
                ek = np.linalg.norm(gk - wk) / np.linalg.norm(wk)
                ev = np.linalg.norm(gv - wv) / np.linalg.norm(wv)
                wrong += not (ek < 0.3 and ev < 0.3)
            logf.write(json.dumps(dict(op="get", t0=t0, t1=time.time(), ok=True, asked=4,
                                       found=int(found.sum()), wrong=wrong)) + "\n")
        except tqkv.Error as e:
            logf.write(json.dumps(dict(op="get", t0=t0, t1=time.time(), ok=False,
                                       err=str(e))) + "\n")
        logf.flush()
    logf.close()
    os._exit(0)


# ---------------------------------------------------------------- the run

def main():
    global SERVER_BIN, DATA_LISTEN, REPLICATE
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("bench")
    ap.add_argument("proto")
    ap.add_argument("outdir")
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--duration", type=float, default=150)
    ap.add_argument("--faults", default="kill,blackhole,partition,rollout,join,leave")
    ap.add_argument("--random", action="store_true",
                    help="draw faults at random from --faults until --duration")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--quiet-s", type=float, default=12)
    ap.add_argument("--expect-stall-s", type=float, default=0)
    ap.add_argument("--bench-transport", default="grpc", choices=("grpc", "tcp"),
                    help="tqkv-bench --transport (tcp: servers get --data-listen)")
    ap.add_argument("--replicate-bytes-per-s", default="0",
                    help="the servers' --replicate-bytes-per-s (0: off)")
    ap.add_argument("--thin-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--py-child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    SERVER_BIN = a.server
    DATA_LISTEN = a.bench_transport == "tcp"
    REPLICATE = a.replicate_bytes_per_s
    if a.py_child:
        py_main(a.py_child[0], float(a.py_child[1]), a.seed)
        return 0
    if a.thin_child:
        thin_main(a.proto, a.thin_child[0], a.thin_child[1], float(a.thin_child[2]), a.seed)
        return 0
    # SIGTERM (ctest, a user): clean up as on any exit (servers, namespaces)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    remove_stale()
    why = can_netns()
    if why:
        print("SKIPPED: " + why)
        return 77
    os.makedirs(a.outdir, exist_ok=True)
    rng = random.Random(a.seed)
    print("nemesis: %d servers, R = 2, %.0f s, seed %d" % (a.servers, a.duration, a.seed))
    net = Net("tqn%d" % os.getpid())
    tmp = tempfile.mkdtemp(prefix="tqkv-nemesis-")
    procs = []
    servers = {}
    try:
        net.setup()
        dns = Dns(net, tmp)
        for i in range(a.servers):
            servers[i] = Server(net, dns, i, a.outdir)
            servers[i].start()
            dns.publish(i, True)
        csv_path = os.path.join(a.outdir, "nemesis.csv")
        thin_log = os.path.join(a.outdir, "thin.jsonl")
        if os.path.exists(csv_path):
            os.unlink(csv_path)
        bench = subprocess.Popen(
            [IP, "netns", "exec", net.client, a.bench, "--target", "svc.test:%d" % PORT,
             "--dns-server", CLIENT_IP + ":53", "--resolve-interval-ms", "1000", "--replicas",
             "2", "--model", "tiny", "--phase", "decode", "--working-set", "64",
             "--seq-blocks", "8", "--block-tokens", "16", "--concurrency", "2", "--duration",
             str(a.duration), "--transport", a.bench_transport, "--no-baselines", "--csv",
             csv_path,
             "--seed", str(a.seed)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(a.outdir, "bench.err"), "w"))
        procs.append(bench)
        # The bench's clock: t_s of its first row against this clock.
        t_bench0 = None
        for _ in range(600):
            try:
                rows = open(csv_path).read().splitlines()
                if len(rows) >= 2:
                    t_bench0 = time.time() - float(rows[1].split(",")[0])
                    break
            except OSError:
                pass
            if bench.poll() is not None:
                raise RuntimeError("tqkv-bench exited (%d) before its first second: %s" % (
                    bench.returncode, open(os.path.join(a.outdir, "bench.err")).read()[-800:]))
            time.sleep(0.1)
        if t_bench0 is None:
            raise RuntimeError("tqkv-bench did not start its timed run")
        thin = subprocess.Popen(
            [IP, "netns", "exec", net.client, PY, os.path.abspath(__file__), a.server, a.bench,
             a.proto, a.outdir, "--seed", str(a.seed), "--thin-child", dns.endpoints, thin_log,
             str(a.duration - 2)], stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(a.outdir, "thin.err"), "w"))
        procs.append(thin)
        py_log = os.path.join(a.outdir, "py.jsonl")
        py = None
        lib = os.environ.get("TQKV_LIBRARY") or os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(a.bench))), "libtqkv.so")
        if os.path.exists(lib):
            env = dict(os.environ, TQKV_LIBRARY=lib, PYTHONPATH=os.path.join(
                HERE, "..", "..", "transport", "python"))
            py = subprocess.Popen(
                [IP, "netns", "exec", net.client, PY, os.path.abspath(__file__), a.server,
                 a.bench, a.proto, a.outdir, "--seed", str(a.seed), "--py-child", py_log,
                 str(a.duration - 4)], stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(a.outdir, "py.err"), "w"), env=env)
            procs.append(py)
        else:
            print("no libtqkv.so at %s (TQKV_LIBRARY): the Python client does not run" % lib)

        windows = []  # (name, start, end) in bench seconds
        next_id = [a.servers]

        def bt():
            return time.time() - t_bench0

        def pick():
            live = [i for i, s in servers.items() if s.alive()]
            return rng.choice(live)

        def fault(kind):
            t0 = bt()
            if kind == "kill":
                i = pick()
                servers[i].kill()
                time.sleep(1)
                dns.publish(i, False)
                time.sleep(2)
                servers[i].start()
                dns.publish(i, True)
                what = "kill tqkv-%d" % i
            elif kind == "rollout":
                ids = rng.sample([i for i, s in servers.items() if s.alive()], 2)
                for i in ids:
                    dns.publish(i, False)
                    servers[i].term()
                    servers[i].start()
                    dns.publish(i, True)
                    time.sleep(1)
                what = "rollout tqkv-%s" % ",".join(map(str, ids))
            elif kind == "blackhole":
                i = pick()
                net.blackhole_port(i, True)
                time.sleep(8)
                net.blackhole_port(i, False)
                what = "blackhole tqkv-%d" % i
            elif kind == "partition":
                i = pick()
                net.partition(i, True)
                time.sleep(8)
                net.partition(i, False)
                what = "partition tqkv-%d" % i
            elif kind == "join":
                i = next_id[0]
                next_id[0] += 1
                servers[i] = Server(net, dns, i, a.outdir)
                servers[i].start()
                dns.publish(i, True)
                what = "join tqkv-%d" % i
            elif kind == "leave":
                i = pick()
                dns.publish(i, False)
                servers[i].term()
                what = "leave tqkv-%d" % i
            else:
                raise ValueError(kind)
            windows.append((what, t0, bt()))
            print("  %6.1f-%6.1f s  %s" % (t0, bt(), what), flush=True)

        kinds = a.faults.split(",")
        time.sleep(max(0, 8 - bt()))
        k = 0
        while bt() < a.duration - a.quiet_s - 12:
            if a.random:
                kind = rng.choice(kinds)
            elif k < len(kinds):
                kind = kinds[k]
            else:
                break
            if kind == "leave" and sum(s.alive() for s in servers.values()) <= 4:
                kind = "join"
            fault(kind)
            k += 1
            time.sleep(a.quiet_s)
        bench.wait(timeout=a.duration + 120)
        thin.wait(timeout=120)
        if py:
            py.wait(timeout=120)
        return report(a, csv_path, thin_log, windows, bench.returncode, t_bench0,
                      py_log if py else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in servers.values():
            if s.alive():
                s.kill()
        try:
            dns.stop()
        except NameError:
            pass
        net.remove()
        shutil.rmtree(tmp, ignore_errors=True)


def load_calls(path, t_bench0):
    calls = []
    if path and os.path.exists(path):
        for line in open(path):
            c = json.loads(line)
            c["t0"] -= t_bench0
            c["t1"] -= t_bench0
            calls.append(c)
    return calls


def report(a, csv_path, thin_log, windows, bench_rc, t_bench0, py_log=None):
    rows = list(csv.DictReader(open(csv_path)))
    series = [(float(r["t_s"]), float(r["hit_rate_interval"]), float(r["pages_per_s"]),
               int(r["errors"]), int(r["verify_failures"])) for r in rows]
    fails = []

    def in_window(t0, t1, grace):
        return any(t0 <= e + grace and t1 >= s for _, s, e in windows)

    # tqkv-bench: errors per second (the counter is cumulative), verify failures.
    out_err = 0
    prev_e, prev_t = 0, 0.0
    for t, hr, pps, e, vf in series:
        if e > prev_e and not in_window(prev_t, t, 1.0):
            out_err += e - prev_e
        prev_e, prev_t = e, t
    total_err = series[-1][3] if series else 0
    verify = series[-1][4] if series else 0
    # Thin clients (wall clock, made bench seconds).
    calls = load_calls(thin_log, t_bench0)
    pyc = load_calls(py_log, t_bench0)
    thin_err = [c for c in calls if not c["ok"]]
    thin_err_out = [c for c in thin_err if not in_window(c["t0"], c["t1"], 0)]
    # A known product gap (docs/cluster.md, Limits): two pods forwarding Puts to each
    # other at once wait on each other's encode jobs until the 10 s forward deadline.
    # Reported, counted apart, not asserted.
    cycle = [c for c in thin_err_out if "forward to the block's owner" in (c.get("err") or "")
             and "DEADLINE_EXCEEDED" in (c.get("err") or "")]
    thin_err_out = [c for c in thin_err_out if c not in cycle]
    thin_wrong = sum(c.get("wrong", 0) for c in calls)
    thin_found = sum(c.get("found", 0) for c in calls)
    thin_asked = sum(c.get("asked", 0) for c in calls)
    print("tqkv-bench: exit %d, %d errors (%d outside fault windows), %d verify failures" %
          (bench_rc, total_err, out_err, verify))
    print("thin grpcio clients: %d calls, %d failed (%d outside fault windows), Gets found "
          "%d of %d blocks asked, %d wrong pages" %
          (len(calls), len(thin_err), len(thin_err_out), thin_found, thin_asked, thin_wrong))
    if cycle:
        print("  known gap: %d thin calls outside fault windows timed out in a forwarding "
              "cycle (two pods forwarding Puts to each other): %s" %
              (len(cycle), "; ".join("%.1f s via %s" % (c["t0"], c["pod"]) for c in cycle[:4])))
    for c in thin_err_out[:5]:
        print("  outside a window: %s at %.1f-%.1f s via %s: %s" %
              (c["op"], c["t0"], c["t1"], c["pod"], c.get("err")))
    if py_log:
        py_err = [c for c in pyc if not c["ok"]]
        py_err_out = [c for c in py_err if not in_window(c["t0"], c["t1"], 0)]
        py_wrong = sum(c.get("wrong", 0) for c in pyc)
        print("Python libtqkv client: %d calls, %d failed (%d outside fault windows), Gets "
              "found %d of %d, %d wrong pages" %
              (len(pyc), len(py_err), len(py_err_out), sum(c.get("found", 0) for c in pyc),
               sum(c.get("asked", 0) for c in pyc), py_wrong))
        for c in py_err_out[:3]:
            print("  outside a window: %s at %.1f s: %s" % (c["op"], c["t0"], c.get("err")))
        if py_wrong:
            fails.append("%d wrong pages in the Python client" % py_wrong)
        if py_err_out:
            fails.append("%d Python client errors outside fault windows" % len(py_err_out))
        if not pyc:
            fails.append("the Python client logged no call")
    if verify:
        fails.append("%d wrong pages in tqkv-bench" % verify)
    if thin_wrong:
        fails.append("%d wrong pages in the thin clients" % thin_wrong)
    if out_err:
        fails.append("%d tqkv-bench errors outside fault windows" % out_err)
    if thin_err_out:
        fails.append("%d thin-client errors outside fault windows" % len(thin_err_out))
    if bench_rc not in (0, 4):
        fails.append("tqkv-bench exited %d" % bench_rc)
    if not calls:
        fails.append("the thin clients logged no call")

    # Hit rate: back to >= 90% of the 5 s before each fault within 10 s of its end;
    # the longest stall (seconds in a row without a page) from its start to 10 s after.
    print("%-26s %8s %8s %9s %10s %8s %9s" % ("fault", "start s", "end s", "before %",
                                              "back in s", "stall s", "py gap s"))
    worst_stall = 0.0
    for what, s, e in windows:
        pre = [hr for t, hr, pps, _, _ in series if s - 5 <= t < s]
        before = sum(pre) / len(pre) if pre else 0
        back = None
        for t, hr, pps, _, _ in series:
            if t >= e and hr >= 0.9 * before:
                back = max(0.0, t - e)
                break
        # a stalled second: under 10% of the median pages/s of the 5 s before
        rates = sorted(pps for t, hr, pps, _, _ in series if s - 5 <= t < s)
        floor = 0.1 * rates[len(rates) // 2] if rates else 0.0
        stall = run = 0.0
        last_t = None
        for t, hr, pps, _, _ in series:
            if t < s - 1 or t > e + 10:
                continue
            dt = t - last_t if last_t is not None else 1.0
            last_t = t
            run = run + dt if pps <= floor else 0.0
            stall = max(stall, run)
        # the Python client: the longest time without a call ending, s-1 .. e+10
        ends = sorted(c["t1"] for c in pyc if s - 1 <= c["t1"] <= e + 10)
        py_stall = max((b - a_ for a_, b in zip([s - 1] + ends, ends + [e + 10])), default=0)
        worst_stall = max(worst_stall, stall)
        print("%-26s %8.1f %8.1f %9.1f %10s %8.0f %9s" %
              (what, s, e, 100 * before, "%.1f" % back if back is not None else "never",
               stall, "%.1f" % py_stall if py_log else "-"))
        if back is None or back > 10:
            fails.append("%s: hit rate not back to 90%% of %.1f%% within 10 s" %
                         (what, 100 * before))
        if a.expect_stall_s and stall > a.expect_stall_s:
            fails.append("%s: %.0f s without progress (expected <= %.0f s)" %
                         (what, stall, a.expect_stall_s))
        if a.expect_stall_s and py_log and py_stall > a.expect_stall_s:
            fails.append("%s: the Python client went %.1f s without a call ending (expected "
                         "<= %.0f s)" % (what, py_stall, a.expect_stall_s))
    print("longest stall: %.0f s" % worst_stall)

    # The plot: the hit-rate series with each fault window shaded.
    if shutil.which("gnuplot"):
        gp = os.path.join(a.outdir, "windows.gp")
        with open(gp, "w") as f:
            for n, (what, s, e) in enumerate(windows):
                f.write("set object %d rect from %.2f, graph 0 to %.2f, graph 1 fc rgb "
                        "'#f4b0b0' fs solid 0.35 noborder behind\n" % (n + 1, s, max(e, s + 0.5)))
                f.write("set label %d '%s' at %.2f, graph 0.97 rotate by 90 right font ',8'\n"
                        % (n + 1, what, s + 0.3))
        svg = os.path.join(a.outdir, "nemesis.svg")
        subprocess.run(["gnuplot", "-e", "csv='%s'; out='%s'; title='nemesis: %d servers, "
                        "R = 2, faults shaded'" % (csv_path, svg, a.servers), gp, PLOT],
                       check=True)
        print("plot: " + svg)
    for f in fails:
        print("FAIL: " + f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
