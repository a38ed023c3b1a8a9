#!/usr/bin/python3
"""Scrapes a real tqkv-server's /metrics with the Prometheus text-format parser.

Usage: metrics_scrape.py TQKV_SERVER_BINARY PROTO_DIR

Starts tqkv-server on loopback with --metrics-listen 127.0.0.1:0 (the server prints the
port it bound), scrapes, runs Put/Lookup/Get/Stats/Health RPCs and a malformed Put with
Python grpcio (stubs generated with protoc at test time), scrapes again and checks that
the counters, the latency histogram, the byte counters, the codec counters and the store
gauges moved by what the RPCs did. Parsing is prometheus_client.parser (Debian
python3-prometheus-client), which rejects malformed exposition text, and `promtool check
metrics` (Debian prometheus), which also lints names, units and types. Also checks the
HTTP surface (content type, 404, 405), that label values with quotes and backslashes
round-trip, the standard process_* families against /proc, and the logs: the server
runs with --log-format json --access-log FILE --slow-request-ms 1, and every line it
writes (stdout, stderr, access log) must be JSON; a failed RPC is logged at warn with
method, code, peer, tenant, duration and the request id the client got in its
x-request-id trailer; SIGHUP reopens a rotated access log.
"""
import json
import re
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

SERVER = None
PROTO_DIR = None
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from tqkv_seed import test_seed  # noqa: E402
from tqkv_server import ServerProcess  # noqa: E402

SEED = test_seed()
RNG = np.random.default_rng(SEED)
TMP = None
pb = None
pbg = None


def gen_stubs():
    global pb, pbg, TMP
    TMP = tempfile.mkdtemp(prefix="tqkv-metrics-")
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.check_call(["protoc", "-I" + PROTO_DIR, "--python_out=" + TMP,
                           "--grpc_python_out=" + TMP, "--plugin=protoc-gen-grpc_python=" + plugin,
                           "tqkv/v1/kvcache.proto"])
    sys.path.insert(0, TMP)
    import tqkv.v1.kvcache_pb2 as m1
    import tqkv.v1.kvcache_pb2_grpc as m2
    pb, pbg = m1, m2


def bf16(a):
    """float32 array -> BF16 bytes (round to nearest even), little-endian."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


class Server(ServerProcess):
    """tqkv-server on 127.0.0.1 with a metrics endpoint, both on port 0; JSON logs (stderr
    to a file, read by the tests), an access log and a 1 ms slow-request threshold."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tqkv-logs-")
        self.access = os.path.join(self.dir, "access.log")
        self.errpath = os.path.join(self.dir, "stderr.log")
        super().__init__(
            SERVER, ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                     "--threads", "2", "--encoder-threads", "2", "--dram-capacity", "64M",
                     "--key-bits", "3.5", "--value-bits", "3", "--log-format", "json",
                     "--access-log", self.access, "--slow-request-ms", "1"],
            start_timeout=60, want_metrics=True, drain_stdout=True, stderr_path=self.errpath)
        # JSON mode: stdout lines are JSON too. What tqkv-bench, the harnesses and
        # quickstart.sh take from the raw line: the address up to the next blank.
        line = next(l for l in self.stdout_lines if "listening on" in l)
        json.loads(line)
        addr = re.search(r"listening on (\S+)", line).group(1)
        if not re.fullmatch(r"127\.0\.0\.1:\d+", addr):
            self.kill()
            raise RuntimeError("the JSON listening line hides its address: %r" % line)
        if self.metrics_port is None:
            self.kill()
            raise RuntimeError("tqkv-server did not print its ports: %s" % self.stderr())

    def stderr(self):
        return self.stderr_text()

    def url(self, path="/metrics"):
        return "http://127.0.0.1:%d%s" % (self.metrics_port, path)

    def stop(self):
        return super().stop(timeout=60)


def json_lines(text, where):
    """Every line of text parsed as a JSON object with ts, level and msg."""
    out = []
    for i, line in enumerate(text.splitlines()):
        try:
            o = json.loads(line)
        except ValueError as e:
            raise AssertionError("%s line %d is not JSON (%s): %r" % (where, i + 1, e, line))
        for k in ("ts", "level", "msg"):
            if k not in o:
                raise AssertionError("%s line %d has no %s: %r" % (where, i + 1, k, line))
        out.append(o)
    return out


def scrape(srv):
    """-> (content type, {(sample name, frozenset(labels)): value}, {family: (type, help)})."""
    with urllib.request.urlopen(srv.url(), timeout=10) as r:
        ctype = r.headers.get("Content-Type", "")
        text = r.read().decode("utf-8")
    samples, families = {}, {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = (fam.type, fam.documentation)
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            if key in samples:
                raise AssertionError("duplicate sample %s %s" % (s.name, s.labels))
            samples[key] = s.value
    return ctype, samples, families


def val(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


class MetricsScrape(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        gen_stubs()
        cls.srv = Server()
        cls.chan = grpc.insecure_channel("127.0.0.1:%d" % cls.srv.port, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(cls.chan).result(timeout=30)
        cls.stub = pbg.KVCacheStub(cls.chan)

    @classmethod
    def tearDownClass(cls):
        cls.chan.close()
        rc = cls.srv.stop()
        shutil.rmtree(TMP, ignore_errors=True)
        try:
            assert rc == 0, "tqkv-server exited with %s after SIGTERM" % rc
            # Every line the server wrote, start to stop, is JSON.
            json_lines("".join(cls.srv.stdout_lines), "stdout")
            lines = json_lines(cls.srv.stderr(), "stderr")
            assert any(o["msg"] == "stopped" for o in lines), "no 'stopped' line"
        finally:
            shutil.rmtree(cls.srv.dir, ignore_errors=True)

    def wait_for(self, pred, what, timeout=5.0):
        """Scrapes until pred(samples) holds (RPC accounting lands when the server
        finishes the call, which can trail the client's view by a moment)."""
        deadline = time.time() + timeout
        while True:
            _, samples, _ = scrape(self.srv)
            if pred(samples):
                return samples
            if time.time() > deadline:
                self.fail("metrics never showed %s" % what)
            time.sleep(0.05)

    def test_http_surface(self):
        ctype, _, families = scrape(self.srv)
        self.assertIn("text/plain", ctype)
        self.assertIn("version=0.0.4", ctype)
        for name in ["tqkv_requests", "tqkv_request_duration_seconds", "tqkv_bytes_received",
                     "tqkv_bytes_sent", "tqkv_bf16_equivalent_bytes_delivered", "tqkv_codec_bytes",
                     "tqkv_codec_seconds", "tqkv_active_streams", "tqkv_tier_capacity_bytes",
                     "tqkv_tier_bytes", "tqkv_tier_pages", "tqkv_tier_hits",
                     "tqkv_tier_evictions", "tqkv_tier_demotions", "tqkv_tier_promotions",
                     "tqkv_store_misses", "tqkv_store_page_bytes", "tqkv_store_bf16_bytes",
                     "tqkv_alloc_failures", "tqkv_build_info", "tqkv_credential_reloads",
                     "tqkv_tenant_page_bytes", "tqkv_tenant_pages", "tqkv_tenant_hits",
                     "tqkv_tenant_misses", "process_start_time_seconds", "process_cpu_seconds",
                     "process_resident_memory_bytes", "process_virtual_memory_bytes",
                     "process_open_fds", "process_max_fds"]:
            self.assertIn(name, families, "family %s missing" % name)
            self.assertNotEqual(families[name][0], "unknown", name)
            self.assertTrue(families[name][1], "family %s has no HELP" % name)
        self.assertEqual(families["tqkv_request_duration_seconds"][0], "histogram")
        # One family per concept, and the tenant label is "tenant".
        for gone in ["tqkv_store_hits", "tqkv_tier_misses", "tqkv_store_evictions",
                     "tqkv_store_pages", "tqkv_compression_ratio", "tqkv_process_start_time_seconds",
                     "tqkv_namespace_hits", "tqkv_namespace_bytes"]:
            self.assertNotIn(gone, families)
        # Kubernetes probes (they cannot speak TLS to the gRPC port): alive and ready.
        for path, body in [("/livez", b"ok\n"), ("/readyz", b"ready\n")]:
            with urllib.request.urlopen(self.srv.url(path), timeout=10) as r:
                self.assertEqual((r.status, r.read()), (200, body), path)
        for path, method, code in [("/", "GET", 404), ("/metricsx", "GET", 404),
                                   ("/metrics", "POST", 405), ("/metrics", "PUT", 405)]:
            req = urllib.request.Request(self.srv.url(path), method=method,
                                         data=b"x" if method in ("POST", "PUT") else None)
            with self.assertRaises(urllib.error.HTTPError) as cm:
                urllib.request.urlopen(req, timeout=10)
            self.assertEqual(cm.exception.code, code, "%s %s" % (method, path))

    def test_promtool_check_metrics(self):
        """Prometheus' own linter accepts the exposition (names, units, types, HELP)."""
        promtool = shutil.which("promtool")
        self.assertIsNotNone(promtool, "promtool not found: install the Debian package "
                             "prometheus (deploy/install-deps.sh)")
        self.stub.Stats(pb.StatsRequest(namespace="promtool"), timeout=30)  # some series
        with urllib.request.urlopen(self.srv.url(), timeout=10) as r:
            body = r.read()
        p = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, "promtool check metrics: %s%s" % (
            p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")))
        # ... and it does fail on a broken one (a counter without _total, a bad line).
        bad = b"# HELP x_bytes b\n# TYPE x_bytes counter\nx_bytes 1\n"
        p = subprocess.run([promtool, "check", "metrics"], input=bad, capture_output=True,
                           timeout=60)
        self.assertNotEqual(p.returncode, 0)

    def test_process_families(self):
        """process_* describe the server process itself (checked against its /proc)."""
        _, s, _ = scrape(self.srv)
        pid = self.srv.proc.pid
        with open("/proc/%d/stat" % pid) as f:
            st = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            btime = int([l for l in f if l.startswith("btime ")][0].split()[1])
        self.assertAlmostEqual(val(s, "process_start_time_seconds"), btime + int(st[19]) / tck,
                               delta=0.02)
        self.assertGreater(val(s, "process_resident_memory_bytes"), 1 << 20)
        self.assertGreaterEqual(val(s, "process_virtual_memory_bytes"),
                                val(s, "process_resident_memory_bytes"))
        nfd = len(os.listdir("/proc/%d/fd" % pid))
        self.assertLessEqual(abs(val(s, "process_open_fds") - nfd), 4)  # connections come/go
        with open("/proc/%d/limits" % pid) as f:
            lim = [l for l in f if l.startswith("Max open files")][0].split()[3]
        self.assertEqual(val(s, "process_max_fds"), float(lim))
        cpu = (int(st[11]) + int(st[12])) / tck  # utime + stime
        self.assertAlmostEqual(val(s, "process_cpu_seconds_total"), cpu, delta=0.1)

    def wait_lines(self, path, pred, what, timeout=10.0, count=1):
        """The lines of path for which pred holds, once there are at least count of them
        (polled: the server appends them as the calls end)."""
        deadline = time.time() + timeout
        while True:
            with open(path) as f:
                lines = json_lines(f.read(), os.path.basename(path))
            hits = [o for o in lines if pred(o)]
            if len(hits) >= count:
                return hits
            if time.time() > deadline:
                self.fail("%s never had %s; it has:\n%s" % (path, what, "\n".join(
                    json.dumps(o) for o in lines[-20:])))
            time.sleep(0.05)

    def test_failed_rpc_logged_with_request_id(self):
        ns = "logs-%d" % (SEED % 1000)
        # Deleting a namespace that holds nothing: NOT_FOUND, after the request named its
        # tenant. The client gets an x-request-id trailer; the log line carries the same id.
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Delete(pb.DeleteRequest(namespace=ns, all=True), timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        rid = dict(cm.exception.trailing_metadata() or ()).get("x-request-id")
        self.assertRegex(rid or "", r"^[0-9a-f]{16}$")
        o = self.wait_lines(self.srv.errpath, lambda o: o.get("request_id") == rid,
                            "a line with request_id %s" % rid)[0]
        self.assertEqual(o["level"], "warn")
        self.assertEqual(o["msg"], "rpc failed")
        self.assertEqual(o["method"], "Delete")
        self.assertEqual(o["code"], "NOT_FOUND")
        self.assertEqual(o["tenant"], ns)
        self.assertTrue(o["peer"].startswith("ipv4:127.0.0.1:"), o["peer"])
        self.assertGreater(float(o["duration_ms"]), 0.0)
        self.assertEqual(o["detail"], cm.exception.details())
        # A malformed Put (rejected before its namespace is trusted: tenant stays empty).
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Put(iter([pb.PutRequest(namespace=ns, hash=RNG.bytes(16), layer=0,
                                              num_tokens=4, num_kv_heads=1, head_dim=128,
                                              key=b"\0" * 10, value=b"\0" * 10)]), timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        pid = dict(cm.exception.trailing_metadata() or ()).get("x-request-id")
        o = self.wait_lines(self.srv.errpath, lambda o: o.get("request_id") == pid,
                            "a line with request_id %s" % pid)[0]
        self.assertEqual((o["level"], o["msg"], o["method"], o["code"]),
                         ("warn", "rpc failed", "Put", "INVALID_ARGUMENT"))
        self.assertEqual(o["detail"], cm.exception.details())
        self.assertIn("key", o["detail"])

        # A client's own well-formed id is kept (logs and trailer); a malformed one is not.
        resp, call = self.stub.Stats.with_call(pb.StatsRequest(namespace=ns), timeout=30,
                                               metadata=[("x-request-id", "client-req.42")])
        self.assertEqual(dict(call.trailing_metadata()).get("x-request-id"), "client-req.42")
        resp, call = self.stub.Stats.with_call(pb.StatsRequest(namespace=ns), timeout=30,
                                               metadata=[("x-request-id", 'bad id "x"')])
        gen = dict(call.trailing_metadata()).get("x-request-id")
        self.assertRegex(gen or "", r"^[0-9a-f]{16}$")
        # Successful calls are not warned about; they are in the access log.
        a = self.wait_lines(self.srv.access, lambda o: o.get("request_id") == "client-req.42",
                            "the Stats call")[0]
        self.assertEqual((a["level"], a["method"], a["code"], a["tenant"]),
                         ("info", "Stats", "OK", ns))
        self.assertTrue(a["peer"].startswith("ipv4:127.0.0.1:"), a["peer"])
        self.wait_lines(self.srv.access, lambda o: o.get("request_id") == rid, "the failed Put")
        self.wait_lines(self.srv.access, lambda o: o.get("request_id") == gen, "generated id")
        with open(self.srv.errpath) as f:
            err = json_lines(f.read(), "stderr")
        self.assertFalse([o for o in err if o.get("request_id") == "client-req.42"
                          and o["msg"] == "rpc failed"])

    def test_slow_requests_logged(self):
        """--slow-request-ms 1: exactly the calls that took more than 1 ms (per the access
        log's duration) have a "slow rpc" warn line."""
        ns = "slow-%d" % (SEED % 1000)
        k = RNG.standard_normal((512, 8, 128), dtype=np.float32)
        for _ in range(3):
            self.stub.Put(iter([pb.PutRequest(namespace=ns, hash=RNG.bytes(16), layer=0,
                                              num_tokens=512, num_kv_heads=8, head_dim=128,
                                              key=bf16(k), value=bf16(k), num_layers=1)]),
                          timeout=30)
            self.stub.Stats(pb.StatsRequest(namespace=ns), timeout=30)
        # All six calls have returned; each one's "slow rpc" line is written before its
        # access line (service/call.c, tqkv__call_log_end), so once the six access lines
        # are there every slow line is too: no time to wait for.
        acc = self.wait_lines(self.srv.access, lambda o: o.get("tenant") == ns,
                              "the six calls", count=6)
        with open(self.srv.errpath) as f:
            slow = {o["request_id"]: o for o in json_lines(f.read(), "stderr")
                    if o["msg"] == "slow rpc" and o.get("tenant") == ns}
        self.assertEqual(len(acc), 6)
        nslow = 0
        for o in acc:
            ms = float(o["duration_ms"])
            if abs(ms - 1.0) <= 0.001:  # printed to 3 decimals: too close to the threshold
                nslow += o["request_id"] in slow
                continue
            if ms > 1.0:
                nslow += 1
                self.assertIn(o["request_id"], slow, "no slow line for %s" % o)
                self.assertEqual(slow[o["request_id"]]["level"], "warn")
                self.assertEqual(slow[o["request_id"]]["threshold_ms"], "1")
            else:
                self.assertNotIn(o["request_id"], slow)
        self.assertEqual(nslow, len(slow))
        self.assertGreater(nslow, 0, "a 512-token x 8-head Put takes more than 1 ms to encode: %s" % acc)

    def test_sighup_reopens_access_log(self):
        rotated = self.srv.access + ".1"
        os.rename(self.srv.access, rotated)
        self.srv.proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 10
        while not os.path.exists(self.srv.access) and time.time() < deadline:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(self.srv.access), "access log not reopened on SIGHUP")
        _, call = self.stub.Stats.with_call(pb.StatsRequest(namespace="rot"), timeout=30,
                                            metadata=[("x-request-id", "after-rotation")])
        self.wait_lines(self.srv.access, lambda o: o.get("request_id") == "after-rotation",
                        "the call after the rotation")
        with open(rotated) as f:
            self.assertNotIn("after-rotation", f.read())

    def test_probe_services(self):
        """The Kubernetes gRPC probes (deploy/k8s/base/statefulset.yaml) ask the health
        service for "" (startup, liveness) and "tqkv.v1.KVCache" (readiness)."""
        _, before, _ = scrape(self.srv)
        check = self.chan.unary_unary("/grpc.health.v1.Health/Check",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        for service in [b"", b"tqkv.v1.KVCache"]:
            req = (b"\x0a" + bytes([len(service)]) + service) if service else b""
            self.assertEqual(check(req, timeout=10), b"\x08\x01", service)  # SERVING
        with self.assertRaises(grpc.RpcError) as cm:
            check(b"\x0a\x07nothere", timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.wait_for(lambda s: val(s, "tqkv_requests_total", method="Health.Check", code="OK")
                      - val(before, "tqkv_requests_total", method="Health.Check", code="OK") == 2
                      and val(s, "tqkv_requests_total", method="Health.Check", code="NOT_FOUND")
                      - val(before, "tqkv_requests_total", method="Health.Check",
                            code="NOT_FOUND") == 1,
                      "2 OK and 1 NOT_FOUND Health.Check")

    def test_rpcs_move_the_counters(self):
        _, before, _ = scrape(self.srv)
        ns = 'metrics"q"\\test-%d' % (SEED % 1000)  # quote and backslash: escaped labels
        tokens, heads, dim = 16 + int(RNG.integers(0, 17)), 2, 128
        nblocks = 3 + int(RNG.integers(0, 4))
        hashes = [RNG.bytes(16) for _ in range(nblocks)]
        missing = RNG.bytes(16)

        def puts():
            for i, h in enumerate(hashes):
                k = RNG.standard_normal((tokens, heads, dim), dtype=np.float32)
                v = RNG.standard_normal((tokens, heads, dim), dtype=np.float32)
                yield pb.PutRequest(namespace=ns, hash=h, parent_hash=hashes[i - 1] if i else b"",
                                    layer=0, num_tokens=tokens, num_kv_heads=heads, head_dim=dim,
                                    key=bf16(k), value=bf16(v), num_layers=1)

        t0 = time.time()
        put = self.stub.Put(puts(), timeout=60)
        self.assertEqual(put.blocks_stored, nblocks)
        bf16_in = nblocks * 2 * tokens * heads * dim * 2
        look = self.stub.Lookup(pb.LookupRequest(namespace=ns, hashes=hashes + [missing],
                                                 num_layers=1), timeout=30)
        self.assertEqual(look.prefix_blocks, nblocks)
        got = list(self.stub.Get(pb.GetRequest(namespace=ns, hashes=hashes + [missing],
                                               layer_begin=0, layer_end=1,
                                               encoding=pb.ENCODING_PACKED), timeout=60))
        found = [r for r in got if r.found]
        self.assertEqual(len(found), nblocks)
        page_bytes = sum(len(r.page) for r in found)
        self.stub.Stats(pb.StatsRequest(namespace=ns), timeout=30)
        # A malformed Put: key shorter than the shape says.
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Put(iter([pb.PutRequest(namespace=ns, hash=RNG.bytes(16), layer=0,
                                              num_tokens=tokens, num_kv_heads=heads,
                                              head_dim=dim, key=b"\0" * 10, value=b"\0" * 10)]),
                          timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        elapsed = time.time() - t0

        def d(s, name, **labels):
            return val(s, name, **labels) - val(before, name, **labels)

        after = self.wait_for(
            lambda s: d(s, "tqkv_requests_total", method="Put", code="INVALID_ARGUMENT") >= 1
            and d(s, "tqkv_requests_total", method="Get", code="OK") >= 1
            and d(s, "tqkv_requests_total", method="Stats", code="OK") >= 1,
            "the Put/Get/Stats requests")
        for method in ["Put", "Lookup", "Get", "Stats"]:
            self.assertEqual(d(after, "tqkv_requests_total", method=method, code="OK"), 1, method)
        self.assertEqual(d(after, "tqkv_requests_total", method="Put", code="INVALID_ARGUMENT"), 1)

        # Histogram: cumulative buckets, +Inf == count, sum within the wall time.
        for method in ["Put", "Lookup", "Get"]:
            les = sorted(((float(dict(k[1])["le"]), v) for k, v in after.items()
                          if k[0] == "tqkv_request_duration_seconds_bucket"
                          and dict(k[1]).get("method") == method), key=lambda x: x[0])
            self.assertGreaterEqual(len(les), 17, method)
            self.assertEqual(les[0][0], 0.0001)
            self.assertEqual(les[-2][0], 10.0)
            self.assertEqual(les[-1][0], float("inf"))
            for (_, a), (_, b) in zip(les, les[1:]):
                self.assertLessEqual(a, b, "buckets of %s not cumulative" % method)
            count = val(after, "tqkv_request_duration_seconds_count", method=method)
            self.assertEqual(les[-1][1], count)
            dsum = d(after, "tqkv_request_duration_seconds_sum", method=method)
            self.assertGreater(dsum, 0.0, method)
            self.assertLess(dsum, elapsed + 1.0, method)
        self.assertGreaterEqual(d(after, "tqkv_request_duration_seconds_count", method="Put"), 2)

        # Bytes: BF16 in, packed pages out, and what those pages stand for in BF16.
        self.assertGreaterEqual(d(after, "tqkv_bytes_received_total"), bf16_in)
        self.assertGreaterEqual(d(after, "tqkv_bytes_sent_total"), page_bytes)
        bf16_out = d(after, "tqkv_bf16_equivalent_bytes_delivered_total")
        self.assertGreaterEqual(bf16_out, bf16_in * 0.99)
        self.assertGreater(bf16_out, 2.0 * d(after, "tqkv_bytes_sent_total") * 0.9)
        self.assertGreaterEqual(d(after, "tqkv_codec_bytes_total", op="encode"), bf16_in)
        self.assertGreater(d(after, "tqkv_codec_seconds_total", op="encode"), 0.0)

        # Store gauges, read from the store at scrape time.
        self.assertEqual(val(after, "tqkv_tier_capacity_bytes", tier="dram"), 64 << 20)
        self.assertGreaterEqual(d(after, "tqkv_tier_pages", tier="dram"), nblocks)
        self.assertGreaterEqual(d(after, "tqkv_tier_bytes", tier="dram"), page_bytes)
        self.assertEqual(val(after, "tqkv_tenant_pages", tenant=ns), nblocks)
        self.assertEqual(val(after, "tqkv_tenant_page_bytes", tenant=ns), page_bytes)
        # Lookup + Get each asked for nblocks present and one missing block.
        self.assertEqual(val(after, "tqkv_tenant_hits_total", tenant=ns), 2 * nblocks)
        self.assertEqual(val(after, "tqkv_tenant_misses_total", tenant=ns), 2)
        self.assertGreaterEqual(d(after, "tqkv_tier_hits_total", tier="dram"), nblocks)
        self.assertGreaterEqual(d(after, "tqkv_store_misses_total"), 1)
        # The compression ratio as the dashboard computes it: a ratio of the two sums.
        ratio = val(after, "tqkv_store_bf16_bytes") / val(after, "tqkv_store_page_bytes")
        # Real compression whatever layers the tests of this server used: boundary layers
        # are 4/4 bits and small test blocks pay per-vector scales and key means, so the
        # store-wide ratio ranges from ~2.9x to ~4.8x; BF16 would be 1x.
        self.assertGreater(ratio, 2.5)
        self.assertLess(ratio, 16.0)
        self.assertEqual(val(after, "tqkv_active_streams"), 0)
        self.assertTrue(any(k[0] == "tqkv_build_info" and v == 1 for k, v in after.items()))


def main():
    global SERVER, PROTO_DIR
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    SERVER, PROTO_DIR = sys.argv[1], sys.argv[2]
    prog = unittest.main(argv=[sys.argv[0], "-v"], exit=False)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
