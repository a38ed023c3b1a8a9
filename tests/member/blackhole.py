#!/usr/bin/env python3
"""blackhole.py - a silent server costs at most --max-gap seconds of progress (issue 22).

Three tqkv-servers on loopback (DRAM, --node-id tqkv-0..2), each behind a TCP proxy
this script runs (a thread per direction of every connection). The clients dial the
proxies. After --before seconds the proxy of server 0 turns into a black hole for
--window seconds: every byte either side sends is read and dropped, nothing is
forwarded, no connection is closed (no RST, no FIN; new connections are accepted and
treated the same) - what a dropped-packets fault looks like to a client, and without
root (the nemesis, tests/member/nemesis.py, does the same with tc in network
namespaces). When the window ends, the connections it swallowed are closed (their
bytes are lost, as after a long outage) and the proxy forwards again.

Clients, at the same time, all with R = 2 over the three proxies:
  * tqkv-bench --phase decode --transport grpc (libtqkv): its errors, verify failures
    and the longest time without an operation completing (max_gap_s in --json);
  * the tqkv Python package (libtqkv through cffi) in a child process: Puts, then Gets
    of 4 blocks compared with what was Put (a wrong page: decoded values not within the
    codec's error), every call's end logged; its longest time without a call ending.

Times are CLOCK_MONOTONIC (time.monotonic(), one clock for every process of the host):
the wall clock of a shared VM may be stepped during a run.

Must hold (asserted): both clients 0 errors and 0 wrong pages, each longest gap
<= --max-gap (2 s) over the whole run, and the fault was felt (libtqkv hedged calls
or marked the server down), so the bound is not met by a fault nobody saw.

usage: blackhole.py TQKV_SERVER TQKV_BENCH OUTDIR [--window S] [--before S] [--after S]
                    [--max-gap S] [--bench-arg=ARG]... [--no-hedge] [--no-assert]
       needs build/transport/libtqkv.so (or TQKV_LIBRARY) and numpy for the Python
       client; exits 77 (skipped) without them.
"""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
SKIP = 77
sys.path.insert(0, os.path.join(HERE, "..", "support"))
from tqkv_ports import free_port  # noqa: E402


class Proxy:
    """127.0.0.1:port -> 127.0.0.1:to; hole(True) drops everything without closing."""

    def __init__(self, to):
        self.to = to
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(128)
        self.port = self.ls.getsockname()[1]
        self.lock = threading.Lock()
        self.holed = False
        self.conns = []  # [client sock, server sock or None, swallowed?]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                holed = self.holed
            s = None
            if not holed:
                try:
                    s = socket.create_connection(("127.0.0.1", self.to))
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    c.close()
                    continue
            e = [c, s, holed]
            with self.lock:
                self.conns.append(e)
            threading.Thread(target=self.pump, args=(e, 0), daemon=True).start()
            if s is not None:
                threading.Thread(target=self.pump, args=(e, 1), daemon=True).start()

    def pump(self, e, d):
        src = e[d]
        while True:
            try:
                b = src.recv(1 << 18)
            except OSError:
                b = b""
            if not b:
                break
            with self.lock:
                drop = self.holed or e[2]
                if self.holed:
                    e[2] = True  # swallowed bytes: this connection is broken for good
            if drop:
                continue
            try:
                e[1 - d].sendall(b)
            except (OSError, AttributeError):
                break
        for sk in e[:2]:
            if sk is not None:
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def hole(self, on):
        with self.lock:
            self.holed = on
            if on:
                return
            broken = [e for e in self.conns if e[2]]
            self.conns = [e for e in self.conns if not e[2]]
        for e in broken:  # as after a long outage: these connections are gone
            for sk in e[:2]:
                if sk is not None:
                    try:
                        sk.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        sk.close()
                    except OSError:
                        pass


def start_server(binary, i, logdir):
    port = free_port()
    log = open(os.path.join(logdir, "server-%d.log" % i), "w")
    p = subprocess.Popen([binary, "--listen", "127.0.0.1:%d" % port, "--node-id",
                          "tqkv-%d" % i, "--dram-capacity", "256M", "--log-level", "warn"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("server %d did not start (see %s)" % (i, log.name))
        if "listening on" in line:
            break
    threading.Thread(target=p.stdout.read, daemon=True).start()
    return p, port


def py_child(targets, out, duration, seed, hedge):
    """The Python client: Puts, then Gets of 4 blocks compared with what was Put."""
    import numpy as np
    import tqkv
    T, H, D = 16, 2, 64
    c = tqkv.Client(targets, replicas=2, transport="grpc", wait_for_ready=False, hedge=hedge)
    rng = random.Random(seed)
    logf = open(out, "w")
    blocks = []

    def data(h):
        r = np.random.default_rng(int.from_bytes(h[:8], "little"))
        f = r.standard_normal((2, T, H, D)).astype(np.float32)
        return f[0], f[1]

    def put(hs):
        ks = np.stack([tqkv.bf16_from_float32(data(h)[0]) for h in hs])
        vs = np.stack([tqkv.bf16_from_float32(data(h)[1]) for h in hs])
        c.put("py", hs, ks, vs)
        blocks.extend(hs)

    put([rng.randbytes(16) for _ in range(48)])
    logf.write(json.dumps(dict(op="ready", t1=time.monotonic())) + "\n")
    logf.flush()
    stop = time.monotonic() + duration
    n = 0
    while time.monotonic() < stop:
        n += 1
        t0 = time.monotonic()
        op = "put" if n % 10 == 0 else "get"
        try:
            if op == "put":
                put([rng.randbytes(16)])
                logf.write(json.dumps(dict(op=op, t0=t0, t1=time.monotonic(), ok=True)) + "\n")
            else:
                hs = rng.sample(blocks, 4)
                k, v, found = c.get("py", hs, shape=(T, H, D))
                wrong = 0
                for j, h in enumerate(hs):
                    if not found[0][j]:
                        continue
                    wk, wv = data(h)
                    ek = np.linalg.norm(tqkv.bf16_to_float32(k[0][j]) - wk) / np.linalg.norm(wk)
                    ev = np.linalg.norm(tqkv.bf16_to_float32(v[0][j]) - wv) / np.linalg.norm(wv)
                    wrong += not (ek < 0.3 and ev < 0.3)
                logf.write(json.dumps(dict(op=op, t0=t0, t1=time.monotonic(), ok=True, asked=4,
                                           found=int(found.sum()), wrong=wrong)) + "\n")
        except tqkv.Error as e:
            logf.write(json.dumps(dict(op=op, t0=t0, t1=time.monotonic(), ok=False,
                                       err=str(e))) + "\n")
        logf.flush()
    logf.close()
    os._exit(0)


def longest_gap(ends, a, b):
    """Longest time inside [a, b] without an end (ends sorted)."""
    pts = [a] + [t for t in ends if a < t < b] + [b]
    best, at = 0.0, a
    for x, y in zip(pts, pts[1:]):
        if y - x > best:
            best, at = y - x, y
    return best, at


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("bench")
    ap.add_argument("outdir")
    ap.add_argument("--before", type=float, default=6)
    ap.add_argument("--window", type=float, default=10)
    ap.add_argument("--after", type=float, default=5)
    ap.add_argument("--max-gap", type=float, default=2.0)
    ap.add_argument("--bench-arg", action="append", default=[])
    ap.add_argument("--no-assert", action="store_true")
    ap.add_argument("--no-hedge", action="store_true",
                    help="both clients without hedging (keepalive alone), to compare")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--py-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.py_child:
        py_child(a.py_child[0].split(","), a.py_child[1], float(a.py_child[2]), a.seed,
                 not a.no_hedge)
        return 0

    lib = os.environ.get("TQKV_LIBRARY") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(a.bench))), "libtqkv.so")
    if not os.path.exists(lib):
        print("SKIPPED: no libtqkv.so at %s (set TQKV_LIBRARY): the Python client cannot run"
              % lib)
        return SKIP
    if subprocess.run([PY, "-c", "import numpy, cffi"]).returncode != 0:
        print("SKIPPED: %s has no numpy or cffi (the Python client needs them)" % PY)
        return SKIP
    os.makedirs(a.outdir, exist_ok=True)
    servers, proxies, procs = [], [], []
    try:
        for i in range(3):
            p, port = start_server(a.server, i, a.outdir)
            servers.append(p)
            proxies.append(Proxy(port))
        targets = ["127.0.0.1:%d" % px.port for px in proxies]
        total = a.before + a.window + a.after
        bench_json = os.path.join(a.outdir, "bench.json")
        cmd = [a.bench] + sum((["--target", t] for t in targets), []) + [
            "--replicas", "2", "--phase", "decode", "--transport", "grpc", "--model", "tiny",
            "--block-tokens", "16", "--seq-blocks", "4", "--concurrency", "2",
            "--duration", str(total), "--no-baselines", "--json", bench_json,
            "--seed", str(a.seed)] + (["--no-hedge"] if a.no_hedge else []) + a.bench_arg
        print("bench:", " ".join(cmd))
        bench = subprocess.Popen(cmd, stdout=open(os.path.join(a.outdir, "bench.out"), "w"),
                                 stderr=open(os.path.join(a.outdir, "bench.err"), "w"))
        procs.append(bench)
        py_log = os.path.join(a.outdir, "py.jsonl")
        for stale in (py_log, bench_json):  # of an earlier run into the same folder
            if os.path.exists(stale):
                os.unlink(stale)
        env = dict(os.environ, TQKV_LIBRARY=lib,
                   PYTHONPATH=os.path.join(HERE, "..", "..", "transport", "python"))
        py = subprocess.Popen([PY, os.path.abspath(__file__), a.server, a.bench, a.outdir,
                               "--seed", str(a.seed), "--py-child", ",".join(targets), py_log,
                               str(total)] + (["--no-hedge"] if a.no_hedge else []),
                              stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(a.outdir, "py.err"), "w"), env=env)
        procs.append(py)
        # the fault, --before seconds after the Python client is ready
        t_ready = None
        deadline = time.monotonic() + 60
        while t_ready is None and time.monotonic() < deadline:
            time.sleep(0.1)
            if os.path.exists(py_log):
                with open(py_log) as f:
                    for line in f:
                        if '"ready"' in line:
                            t_ready = json.loads(line)["t1"]
            if py.poll() is not None:
                break
        if t_ready is None:
            print("FAIL: the Python client did not get ready (see %s)"
                  % os.path.join(a.outdir, "py.err"))
            return 1
        time.sleep(max(0.0, t_ready + a.before - time.monotonic()))
        h0 = time.monotonic()
        proxies[0].hole(True)
        print("black hole on server 0 from %.1f s" % (h0 - t_ready))
        time.sleep(a.window)
        h1 = time.monotonic()
        proxies[0].hole(False)
        print("black hole off after %.1f s" % (h1 - h0))
        bench.wait(timeout=total + 120)
        py.wait(timeout=total + 120)
    finally:
        for p in procs + servers:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

    fails = []
    try:
        with open(bench_json) as f:
            bj = json.load(f)
    except (OSError, ValueError) as e:
        print("FAIL: no bench report (%s); bench exit %s, see %s" % (e, bench.returncode,
                                                                     a.outdir))
        return 1
    print("tqkv-bench: exit %d, %d errors, %d verify failures, hit rate %.3f, longest gap "
          "%.3f s (ended %.1f s into the run), hedged calls %d (%d pages), calls past their "
          "size deadline %d, marked down %d"
          % (bench.returncode, bj["errors"], bj["verify_failures"], bj["hit_rate"],
             bj["max_gap_s"], bj["max_gap_end_s"], bj["hedges"], bj["hedge_pages"],
             bj["call_timeouts"], bj["marked_down"]))
    if bj["errors"] or bj["verify_failures"] or bench.returncode != 0:
        fails.append("tqkv-bench: errors or verify failures (exit %d)" % bench.returncode)
    if bj["max_gap_s"] > a.max_gap:
        fails.append("tqkv-bench: %.3f s without an operation completing (> %.1f s)"
                     % (bj["max_gap_s"], a.max_gap))
    if bj["hedges"] == 0 and bj["marked_down"] == 0:
        fails.append("tqkv-bench: no hedge and no server marked down: the fault was not felt")

    calls = []
    with open(py_log) as f:
        for line in f:
            r = json.loads(line)
            if r["op"] != "ready":
                calls.append(r)
    ends = sorted(r["t1"] for r in calls)
    failed = [r for r in calls if not r["ok"]]
    wrong = sum(r.get("wrong", 0) for r in calls)
    found = sum(r.get("found", 0) for r in calls)
    asked = sum(r.get("asked", 0) for r in calls)
    in_win = [r for r in calls if h0 <= r["t1"] <= h1]
    gap, gap_at = longest_gap(ends, t_ready, max(ends) if ends else t_ready)
    wgap, wgap_at = longest_gap(ends, h0, h1 + 1)
    print("Python client: %d calls (%d ended in the window), %d failed, %d wrong pages, "
          "%d of %d blocks found; longest time without a call ending %.3f s over the run, "
          "%.3f s in [hole start, hole end + 1 s] (ended %.1f s after the hole started)"
          % (len(calls), len(in_win), len(failed), wrong, found, asked, gap, wgap,
             wgap_at - h0))
    for r in failed[:5]:
        print("  failed:", r.get("err"))
    if failed or wrong:
        fails.append("Python client: %d failed calls, %d wrong pages" % (len(failed), wrong))
    if gap > a.max_gap:
        fails.append("Python client: %.3f s without a call ending (> %.1f s), ended %.1f s "
                     "after the hole started" % (gap, a.max_gap, gap_at - h0))
    if not in_win:
        fails.append("Python client: no call ended during the black hole")
    with open(os.path.join(a.outdir, "result.json"), "w") as f:
        json.dump(dict(bench=bj, py=dict(calls=len(calls), failed=len(failed), wrong=wrong,
                                         max_gap_s=gap, window_gap_s=wgap)), f)
    if fails and not a.no_assert:
        for m in fails:
            print("FAIL:", m)
        return 1
    print("OK" if not fails else "measured (not asserted): " + "; ".join(fails))
    return 0


if __name__ == "__main__":
    sys.exit(main())
