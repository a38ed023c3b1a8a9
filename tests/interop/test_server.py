#!/usr/bin/python3
"""Interop tests of tqkv-server against Python grpcio (Debian python3-grpcio).

Usage: test_server.py TQKV_SERVER_BINARY PROTO_DIR

Starts the real server on a free loopback port and checks Put/Lookup/Get in both
encodings, Stats, Delete, health Check/Watch, reflection, UNIMPLEMENTED for an
unknown method, the status code and message of every malformed input (with the
server still serving and stored data intact afterwards), and a graceful SIGTERM.
Stubs are generated at test time with protoc + grpc_python_plugin.
"""
import os
import queue
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

SERVER = None
PROTO_DIR = None
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_seed import test_seed  # noqa: E402
from tqkv_server import ServerProcess  # noqa: E402

SEED = test_seed()
SANITIZED = os.environ.get("TQKV_SANITIZED") == "1"
RNG = np.random.default_rng(SEED)

pb = None  # tqkv.v1.kvcache_pb2
pbg = None  # tqkv.v1.kvcache_pb2_grpc
refl = None  # reflection_pb2 (v1alpha schema; v1 is identical on the wire)
TMP = None
IDENT = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
MAX_MSG = 8 << 20


def gen_stubs():
    global pb, pbg, refl, TMP
    TMP = tempfile.mkdtemp(prefix="tqkv-interop-")
    src = os.path.join(TMP, "src")
    os.makedirs(os.path.join(src, "tqkvtest_refl"))
    shutil.copy("/usr/share/grpc-proto/grpc/reflection/v1alpha/reflection.proto",
                os.path.join(src, "tqkvtest_refl", "reflection.proto"))
    out = os.path.join(TMP, "py")
    os.makedirs(out)
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.check_call(["protoc", "-I" + PROTO_DIR, "-I" + src, "--python_out=" + out,
                           "--grpc_python_out=" + out, "--plugin=protoc-gen-grpc_python=" + plugin,
                           "tqkv/v1/kvcache.proto", "tqkvtest_refl/reflection.proto"])
    sys.path.insert(0, out)
    import tqkv.v1.kvcache_pb2 as m1
    import tqkv.v1.kvcache_pb2_grpc as m2
    import tqkvtest_refl.reflection_pb2 as m3
    pb, pbg, refl = m1, m2, m3


class Server(ServerProcess):
    """A tqkv-server process on 127.0.0.1, port 0, with a grpc channel and stub
    (tests/support/tqkv_server.py)."""

    def __init__(self, *extra, target=None, creds=None, env=None):
        super().__init__(SERVER, ["--listen", "127.0.0.1:0", "--threads", "2",
                                  "--encoder-threads", "2", "--max-message-bytes", str(MAX_MSG),
                                  "--dram-capacity", "256M", *extra],
                         env=env, want_metrics="--metrics-listen" in extra)
        opts = [("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20)]
        addr = "%s:%d" % (target or "127.0.0.1", self.port)
        if creds is not None:
            self.channel = grpc.secure_channel(addr, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(addr, options=opts)
        self.stub = pbg.KVCacheStub(self.channel)

    def stop(self, timeout=30):
        self.channel.close()
        return super().stop(timeout)


def bf16(a):
    """float32 array -> BF16 bytes (round to nearest even)."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).tobytes()


def from_bf16(b):
    u = np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16
    return u.view(np.float32)


def rand_block(t, h, d):
    k = RNG.standard_normal((t, h, d)).astype(np.float32)
    v = RNG.standard_normal((t, h, d)).astype(np.float32) * 0.5
    return bf16(k), bf16(v)


def rand_hash(n=32):
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


_CRC_TABLE = None


def crc32c(data):
    global _CRC_TABLE
    if _CRC_TABLE is None:
        tab = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            tab.append(c)
        _CRC_TABLE = tab
    tab = _CRC_TABLE
    c = 0xFFFFFFFF
    for b in data:
        c = tab[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def put_req(ns, h, layer, t, hh, d, k=None, v=None, **kw):
    if k is None:
        k, v = rand_block(t, hh, d)
    return pb.PutRequest(namespace=ns, hash=h, layer=layer, num_tokens=t, num_kv_heads=hh,
                         head_dim=d, key=k, value=v, **kw)


def rpc_error(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except grpc.RpcError as e:
        return e
    raise AssertionError("call succeeded, an error was expected")


class KVTest(unittest.TestCase):
    srv = None

    @classmethod
    def setUpClass(cls):
        cls.srv = Server()
        cls.stub = cls.srv.stub
        cls.ch = cls.srv.channel

    @classmethod
    def tearDownClass(cls):
        rc = cls.srv.stop()
        assert rc == 0, "server exit status %d" % rc

    # ---- happy paths ----

    def test_put_lookup_get_both_encodings(self):
        ns = "it-basic"
        T, H, D = 17, 3, 128  # awkward token and head counts
        hashes = [rand_hash() for _ in range(3)]
        blocks = {}
        reqs = []
        for layer in range(2):
            for i, h in enumerate(hashes):
                k, v = rand_block(T, H, D)
                blocks[(h, layer)] = (k, v)
                reqs.append(put_req(ns, h, layer, T, H, D, k, v, num_layers=2,
                                    parent_hash=hashes[i - 1] if i else b""))
        r = self.stub.Put(iter(reqs), timeout=30)
        self.assertEqual(r.blocks_stored, 6)
        self.assertEqual(r.blocks_duplicate, 0)
        self.assertEqual(r.bytes_in, 6 * 2 * T * H * D * 2)
        self.assertGreater(r.bytes_stored, 0)
        self.assertLess(r.bytes_stored, r.bytes_in)
        # A second Put of the same key is an idempotent duplicate.
        r2 = self.stub.Put(iter(reqs[:1]), timeout=30)
        self.assertEqual((r2.blocks_stored, r2.blocks_duplicate), (0, 1))

        missing = rand_hash()
        lk = self.stub.Lookup(pb.LookupRequest(namespace=ns, hashes=hashes + [missing],
                                               num_layers=2), timeout=10)
        self.assertEqual(lk.prefix_blocks, 3)
        self.assertEqual([b.hash for b in lk.blocks], hashes + [missing])
        self.assertEqual([b.tier for b in lk.blocks][:3], [pb.TIER_DRAM] * 3)
        self.assertEqual(lk.blocks[3].tier, pb.TIER_NONE)
        lk3 = self.stub.Lookup(pb.LookupRequest(namespace=ns, hashes=hashes, num_layers=3),
                               timeout=10)
        self.assertEqual(lk3.prefix_blocks, 0)

        # PACKED: layer-major order, magic, CRC, shape.
        got = list(self.stub.Get(pb.GetRequest(namespace=ns, hashes=hashes + [missing],
                                               layer_begin=0, layer_end=2), timeout=30))
        self.assertEqual(len(got), 8)
        order = [(g.layer, g.hash) for g in got]
        self.assertEqual(order, [(l, h) for l in range(2) for h in hashes + [missing]])
        for g in got:
            if g.hash == missing:
                self.assertFalse(g.found)
                self.assertEqual(len(g.page), 0)
                continue
            self.assertTrue(g.found)
            self.assertEqual((g.num_tokens, g.num_kv_heads, g.head_dim), (T, H, D))
            self.assertEqual(g.tier, pb.TIER_DRAM)
            self.assertEqual(g.page[:4], b"TQKP")
            page_bytes = struct.unpack_from("<I", g.page, 8)[0]
            self.assertEqual(page_bytes, len(g.page))
            crc = struct.unpack_from("<I", g.page, 12)[0]
            zeroed = g.page[:12] + b"\0\0\0\0" + g.page[16:]
            self.assertEqual(crc32c(zeroed), crc, "page CRC32C")
        self.__class__.packed_ref = (ns, hashes[0], got[0].page)

        # BF16: same order with the missing block in place, decoded values close to what
        # was sent (the server decodes ahead on its pool but must keep the order).
        mixed = [hashes[0], missing, hashes[1], hashes[2], missing]
        got = list(self.stub.Get(pb.GetRequest(namespace=ns, hashes=mixed, layer_begin=0,
                                               layer_end=2, encoding=pb.ENCODING_BF16),
                                 timeout=30))
        self.assertEqual([(g.layer, g.hash) for g in got],
                         [(l, h) for l in range(2) for h in mixed])
        self.assertEqual([g.found for g in got], [h != missing for h in mixed] * 2)
        got = [g for g in got if g.found]
        self.assertEqual(len(got), 6)
        for g in got:
            self.assertEqual((g.num_tokens, g.num_kv_heads, g.head_dim), (T, H, D))
            k, v = blocks[(g.hash, g.layer)]
            self.assertEqual(len(g.key), len(k))
            self.assertEqual(len(g.value), len(v))
            for sent, back in ((k, g.key), (v, g.value)):
                x, y = from_bf16(sent), from_bf16(back)
                rel = np.linalg.norm(x - y) / np.linalg.norm(x)
                self.assertLess(rel, 0.25, "relative error %.3f" % rel)
                self.assertGreater(rel, 0.0)  # it really went through the codec

    def test_page_put_roundtrip_and_stats(self):
        ns = "it-page"
        T, H, D = 16, 2, 64
        h = rand_hash(8)
        self.stub.Put(iter([put_req(ns, h, 0, T, H, D)]), timeout=30)
        page = next(iter(self.stub.Get(pb.GetRequest(namespace=ns, hashes=[h], layer_begin=0,
                                                     layer_end=1), timeout=10))).page
        h2 = rand_hash(64)
        r = self.stub.Put(iter([pb.PutRequest(namespace=ns, hash=h2, layer=0, num_tokens=T,
                                              num_kv_heads=H, head_dim=D, page=page)]),
                          timeout=10)
        self.assertEqual(r.blocks_stored, 1)
        self.assertEqual(r.bytes_stored, len(page))
        back = next(iter(self.stub.Get(pb.GetRequest(namespace=ns, hashes=[h2], layer_begin=0,
                                                     layer_end=1), timeout=10)))
        self.assertEqual(back.page, page)

        st = self.stub.Stats(pb.StatsRequest(namespace=ns), timeout=10)
        self.assertEqual(st.pages, 2)
        self.assertEqual(st.page_bytes, 2 * len(page))
        self.assertEqual(st.bf16_bytes, 2 * 2 * T * H * D * 2)
        self.assertGreater(st.compression_ratio, 2.0)
        self.assertTrue(any(t.tier == pb.TIER_DRAM and t.pages == 2 for t in st.tiers))
        whole = self.stub.Stats(pb.StatsRequest(), timeout=10)
        self.assertGreaterEqual(whole.pages, st.pages)
        self.assertTrue(any(t.tier == pb.TIER_DRAM and t.capacity_bytes == 256 << 20
                            for t in whole.tiers))

        d = self.stub.Delete(pb.DeleteRequest(namespace=ns, hashes=[h]), timeout=10)
        self.assertEqual(d.pages_deleted, 1)
        d = self.stub.Delete(pb.DeleteRequest(namespace=ns, all=True), timeout=10)
        self.assertEqual(d.pages_deleted, 1)
        e = rpc_error(self.stub.Delete, pb.DeleteRequest(namespace=ns, all=True), timeout=10)
        self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("namespace", e.details())
        g = next(iter(self.stub.Get(pb.GetRequest(namespace=ns, hashes=[h2], layer_begin=0,
                                                  layer_end=1), timeout=10)))
        self.assertFalse(g.found)

    # ---- health, reflection, unknown methods ----

    def test_health(self):
        check = self.ch.unary_unary("/grpc.health.v1.Health/Check", **IDENT)
        self.assertEqual(check(b"", timeout=5), b"\x08\x01")  # SERVING
        svc = b"tqkv.v1.KVCache"
        self.assertEqual(check(b"\x0a" + bytes([len(svc)]) + svc, timeout=5), b"\x08\x01")
        e = rpc_error(check, b"\x0a\x04nope", timeout=5)
        self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND)
        watch = self.ch.unary_stream("/grpc.health.v1.Health/Watch", **IDENT)
        it = watch(b"", timeout=10)
        self.assertEqual(next(it), b"\x08\x01")
        it.cancel()
        it = watch(b"\x0a\x04nope", timeout=10)
        self.assertEqual(next(it), b"\x08\x03")  # SERVICE_UNKNOWN
        # ...and the stream stays open: after another call has gone through the server, the
        # reader's next() ends only by our cancel (CANCELLED), never by the server (end of
        # stream or another status). No sleep: the evidence is the status of the end.
        q = queue.Queue()

        def reader():
            try:
                q.put(("message", next(it, None)))
            except grpc.RpcError as e:
                q.put(("status", e.code()))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        self.assertEqual(check(b"", timeout=5), b"\x08\x01")
        it.cancel()
        t.join(timeout=10)
        self.assertEqual(q.get(timeout=10), ("status", grpc.StatusCode.CANCELLED))

    def test_reflection(self):
        for path in ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                     "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"):
            call = self.ch.stream_stream(
                path, request_serializer=refl.ServerReflectionRequest.SerializeToString,
                response_deserializer=refl.ServerReflectionResponse.FromString)
            reqs = [refl.ServerReflectionRequest(list_services=""),
                    refl.ServerReflectionRequest(file_containing_symbol="tqkv.v1.KVCache"),
                    refl.ServerReflectionRequest(file_by_filename="grpc/health/v1/health.proto"),
                    refl.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"),
                    refl.ServerReflectionRequest(all_extension_numbers_of_type="tqkv.v1.Codec")]
            out = list(call(iter(reqs), timeout=10))
            self.assertEqual(len(out), 5)
            names = {s.name for s in out[0].list_services_response.service}
            self.assertIn("tqkv.v1.KVCache", names)
            self.assertIn("grpc.health.v1.Health", names)
            self.assertIn("grpc.reflection.v1alpha.ServerReflection", names)
            from google.protobuf import descriptor_pb2
            fd = descriptor_pb2.FileDescriptorProto.FromString(
                out[1].file_descriptor_response.file_descriptor_proto[0])
            self.assertEqual(fd.name, "tqkv/v1/kvcache.proto")
            self.assertIn("Get", [m.name for m in fd.service[0].method])
            fd = descriptor_pb2.FileDescriptorProto.FromString(
                out[2].file_descriptor_response.file_descriptor_proto[0])
            self.assertEqual(fd.package, "grpc.health.v1")
            self.assertEqual(out[3].error_response.error_code, grpc.StatusCode.NOT_FOUND.value[0])
            self.assertEqual(out[4].error_response.error_code,
                             grpc.StatusCode.UNIMPLEMENTED.value[0])

    def test_unregistered_method_is_unimplemented_quickly(self):
        for path in ("/tqkv.v1.KVCache/Nope", "/no.Such/Method"):
            t0 = time.time()
            e = rpc_error(self.ch.unary_unary(path, **IDENT), b"abc", timeout=10)
            self.assertEqual(e.code(), grpc.StatusCode.UNIMPLEMENTED)
            self.assertLess(time.time() - t0, 2.0)

    # ---- malformed input ----

    def test_malformed_inputs(self):
        ns = "it-bad"
        T, H, D = 8, 2, 32
        keep = rand_hash()
        self.stub.Put(iter([put_req(ns, keep, 0, T, H, D)]), timeout=30)
        get_keep = pb.GetRequest(namespace=ns, hashes=[keep], layer_begin=0, layer_end=1)
        before = next(iter(self.stub.Get(get_keep, timeout=10))).page

        def put_fails(req, code, field):
            e = rpc_error(self.stub.Put, iter([req]), timeout=30)
            self.assertEqual(e.code(), code, "%s: %s" % (field, e.details()))
            self.assertIn(field, e.details())

        k, v = rand_block(T, H, D)
        good = dict(namespace=ns, hash=rand_hash(), layer=0, num_tokens=T, num_kv_heads=H,
                    head_dim=D, key=k, value=v)

        def bad(**over):
            d = dict(good)
            d.update(over)
            return pb.PutRequest(**d)

        IA = grpc.StatusCode.INVALID_ARGUMENT
        put_fails(bad(key=k[:-2]), IA, "key")
        put_fails(bad(value=v + b"\0\0"), IA, "value")
        put_fails(bad(num_tokens=T + 1), IA, "key")
        put_fails(bad(num_tokens=0), IA, "num_tokens")
        put_fails(bad(head_dim=7), IA, "head_dim")
        put_fails(bad(num_kv_heads=0), IA, "num_kv_heads")
        nan = bytearray(k)
        nan[10:12] = b"\xc0\x7f"  # BF16 NaN
        put_fails(bad(key=bytes(nan)), IA, "key")
        inf = bytearray(v)
        inf[2:4] = b"\x80\x7f"  # BF16 +Inf
        put_fails(bad(value=bytes(inf)), IA, "value")
        put_fails(bad(codec=pb.Codec(key_bits=2.7)), IA, "codec.key_bits")
        put_fails(bad(codec=pb.Codec(value_bits=9)), IA, "codec.value_bits")
        put_fails(bad(hash=b""), IA, "hash")
        put_fails(bad(hash=b"x" * 65), IA, "hash")
        put_fails(bad(hash=b"x" * 7), IA, "hash")
        put_fails(bad(parent_hash=b"p" * 3), IA, "parent_hash")
        put_fails(bad(namespace=""), IA, "namespace")
        put_fails(bad(namespace="a b"), IA, "namespace")
        put_fails(bad(key=b"", value=b""), IA, "key")
        put_fails(bad(layer=5, num_layers=4), IA, "layer")
        # pages: garbage, wrong magic, flipped byte (CRC), shape mismatch, both page and key
        put_fails(bad(key=b"", value=b"", page=rand_hash(64) * 4), IA, "page")
        flipped = bytearray(before)
        flipped[len(flipped) // 2] ^= 0x40
        put_fails(bad(key=b"", value=b"", page=bytes(flipped)), IA, "page")
        put_fails(bad(key=b"", value=b"", page=b"XXXX" + before[4:]), IA, "page")
        put_fails(bad(key=b"", value=b"", page=before[:-64]), IA, "page")
        put_fails(bad(key=b"", value=b"", num_tokens=T + 1, page=before), IA, "page")
        put_fails(bad(page=before), IA, "page")

        # garbage bytes through raw calls with identity serializers
        garbage = b"\xff\xff\xff\xff\x0f\x12\x99"
        raw_put = self.ch.stream_unary("/tqkv.v1.KVCache/Put", **IDENT)
        e = rpc_error(raw_put, iter([garbage]), timeout=10)
        self.assertEqual(e.code(), IA)
        self.assertIn("message", e.details())
        for m in ("Lookup", "Delete", "Stats"):
            e = rpc_error(self.ch.unary_unary("/tqkv.v1.KVCache/" + m, **IDENT), garbage,
                          timeout=10)
            self.assertEqual(e.code(), IA, m)
            self.assertIn("message", e.details())
        e = rpc_error(lambda: list(self.ch.unary_stream("/tqkv.v1.KVCache/Get", **IDENT)(
            garbage, timeout=10)))
        self.assertEqual(e.code(), IA)

        # request fields of the other methods
        def fails(fn, req, code, field):
            e = rpc_error(lambda: list(fn(req, timeout=10)) if fn is self.stub.Get
                          else fn(req, timeout=10))
            self.assertEqual(e.code(), code, "%s: %s" % (field, e.details()))
            self.assertIn(field, e.details())

        fails(self.stub.Get, pb.GetRequest(namespace=ns, hashes=[keep], layer_begin=3,
                                           layer_end=3), IA, "layer_end")
        fails(self.stub.Get, pb.GetRequest(namespace=ns, hashes=[keep], layer_begin=3,
                                           layer_end=2), IA, "layer_end")
        fails(self.stub.Get, pb.GetRequest(namespace=ns, hashes=[b""], layer_begin=0,
                                           layer_end=1), IA, "hashes[0]")
        fails(self.stub.Get, pb.GetRequest(namespace=ns, hashes=[keep, b"y" * 65],
                                           layer_begin=0, layer_end=1), IA, "hashes[1]")
        fails(self.stub.Get, pb.GetRequest(namespace=ns, layer_begin=0, layer_end=1), IA,
              "hashes")
        fails(self.stub.Get, pb.GetRequest(namespace=ns, hashes=[keep], layer_begin=0,
                                           layer_end=1, encoding=7), IA, "encoding")
        fails(self.stub.Lookup, pb.LookupRequest(namespace=ns, hashes=[keep]), IA, "num_layers")
        fails(self.stub.Lookup, pb.LookupRequest(namespace="", hashes=[keep], num_layers=1), IA,
              "namespace")
        fails(self.stub.Delete, pb.DeleteRequest(namespace=ns), IA, "hashes")
        fails(self.stub.Delete, pb.DeleteRequest(namespace=ns, hashes=[b"z"]), IA, "hashes[0]")
        fails(self.stub.Stats, pb.StatsRequest(namespace="x" * 300), IA, "namespace")

        # a message over --max-message-bytes
        big = MAX_MSG // 2 + 1024
        e = rpc_error(raw_put, iter([b"\x42" + b"\0" * (2 * big)]), timeout=30)
        self.assertEqual(e.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)

        # A bad message after a good one: the call fails, the good block stays stored.
        h_ok = rand_hash()
        e = rpc_error(self.stub.Put, iter([put_req(ns, h_ok, 0, T, H, D), bad(key=k[:-2])]),
                      timeout=30)
        self.assertEqual(e.code(), IA)
        lk = self.stub.Lookup(pb.LookupRequest(namespace=ns, hashes=[h_ok], num_layers=1),
                              timeout=10)
        self.assertEqual(lk.prefix_blocks, 1)

        # The server still serves and the stored block reads back identical.
        after = next(iter(self.stub.Get(get_keep, timeout=10))).page
        self.assertEqual(after, before)

    def dram_bytes(self):
        """Bytes in use in the server's DRAM pool (whole-server Stats). A page's bytes go
        back to the pool only when its last pin is released, even after a Delete."""
        st = self.stub.Stats(pb.StatsRequest(), timeout=10)
        return next(t.bytes_used for t in st.tiers if t.tier == pb.TIER_DRAM)

    def settled_dram_bytes(self, want=None, wait=10.0):
        """dram_bytes() once it stops changing (or equals want), within wait seconds."""
        deadline = time.time() + wait
        last = self.dram_bytes()
        while time.time() < deadline:
            time.sleep(0.1)
            now = self.dram_bytes()
            if (want is None and now == last) or now == want:
                return now
            last = now
        return last

    def test_cancelled_get_frees_the_call(self):
        ns = "it-cancel"
        T, H, D = 64, 4, 128
        h = rand_hash()
        base = self.settled_dram_bytes()
        self.stub.Put(iter([put_req(ns, h, 0, T, H, D)]), timeout=30)
        self.assertGreater(self.dram_bytes(), base)
        it = self.stub.Get(pb.GetRequest(namespace=ns, hashes=[h] * 2000, layer_begin=0,
                                         layer_end=1), timeout=30)
        self.assertTrue(next(it).found)
        it.cancel()
        # The server keeps serving; a Delete unlinks the page even while pinned:
        d = self.stub.Delete(pb.DeleteRequest(namespace=ns, all=True), timeout=10)
        self.assertEqual(d.pages_deleted, 1)
        # ... so only the pool's bytes show that the cancelled stream released its pins.
        left = self.settled_dram_bytes(want=base)
        self.assertEqual(left, base, "DRAM pool holds %d bytes more than before the Put: the "
                         "cancelled Get kept its pins" % (left - base))

    def test_concurrent_mixed_streams(self):
        """Threads putting, reading (both encodings, some cancelled), looking up and deleting
        at once on a shared namespace: no call fails unexpectedly and the server survives."""
        ns = "it-mixed"
        T, H, D = 16, 2, 64
        rounds = 4 if SANITIZED else 12
        errors = []

        def worker(tid):
            rng = np.random.default_rng(SEED + tid)
            try:
                for r in range(rounds):
                    hs = [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(3)]
                    self.stub.Put(iter([put_req(ns, h, l, T, H, D) for l in range(2) for h in hs]),
                                  timeout=60)
                    enc = pb.ENCODING_BF16 if r % 2 else pb.ENCODING_PACKED
                    it = self.stub.Get(pb.GetRequest(namespace=ns, hashes=hs, layer_begin=0,
                                                     layer_end=2, encoding=enc), timeout=60)
                    if r % 3 == 2:
                        next(it)
                        it.cancel()
                    else:
                        got = list(it)
                        assert len(got) == 6 and all(g.found for g in got)
                    lk = self.stub.Lookup(pb.LookupRequest(namespace=ns, hashes=hs, num_layers=2,
                                                           lease_ms=50), timeout=60)
                    assert lk.prefix_blocks == 3
                    d = self.stub.Delete(pb.DeleteRequest(namespace=ns, hashes=hs[:1]), timeout=60)
                    assert d.pages_deleted == 2
            except Exception as e:  # reported below with the thread id
                errors.append((tid, repr(e)))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])
        st = self.stub.Stats(pb.StatsRequest(namespace=ns), timeout=10)
        self.assertEqual(st.pages, 8 * rounds * 2 * 2)

    def test_deadline_on_a_stalled_get(self):
        ns = "it-deadline"
        T, H, D = 128, 8, 128
        h = rand_hash()
        self.stub.Put(iter([put_req(ns, h, 0, T, H, D)]), timeout=30)
        it = self.stub.Get(pb.GetRequest(namespace=ns, hashes=[h] * 3000, layer_begin=0,
                                         layer_end=1), timeout=1.5)
        self.assertTrue(next(it).found)
        time.sleep(2.0)
        e = rpc_error(lambda: list(it))
        self.assertEqual(e.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        d = self.stub.Delete(pb.DeleteRequest(namespace=ns, all=True), timeout=10)
        self.assertEqual(d.pages_deleted, 1)

    def test_bf16_get_on_many_blocks_in_parallel(self):
        ns = "it-par"
        T, H, D = 32, 4, 64
        hashes = [rand_hash() for _ in range(8)]
        blocks = {}
        reqs = []
        for h in hashes:
            k, v = rand_block(T, H, D)
            blocks[h] = (k, v)
            reqs.append(put_req(ns, h, 0, T, H, D, k, v))
        self.assertEqual(self.stub.Put(iter(reqs), timeout=30).blocks_stored, 8)
        results = []

        def reader():
            got = list(self.stub.Get(pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0,
                                                   layer_end=1, encoding=pb.ENCODING_BF16),
                                     timeout=30))
            results.append(got)

        ts = [threading.Thread(target=reader) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(len(results), 4)
        for got in results:
            self.assertEqual([g.hash for g in got], hashes)
            self.assertEqual([g.key for g in got], [g.key for g in results[0]])
            for g in got:
                x = from_bf16(blocks[g.hash][0])
                rel = np.linalg.norm(x - from_bf16(g.key)) / np.linalg.norm(x)
                self.assertLess(rel, 0.25)


class SecurityTest(unittest.TestCase):
    def test_auth_tokens_and_metrics(self):
        path = os.path.join(TMP, "tokens")
        with open(path, "w") as f:
            f.write("# test tokens\nwriter-token-1 rw ns-a\nreader-token-1 r ns-a\nadmin-token-1 r *\n")
        srv = Server("--auth-tokens", path, "--metrics-listen", "127.0.0.1:0")
        try:
            stub = srv.stub
            T, H, D = 8, 2, 32
            h = rand_hash()
            md = lambda tok: [("authorization", "Bearer " + tok)]
            e = rpc_error(stub.Put, iter([put_req("ns-a", h, 0, T, H, D)]), timeout=10)
            self.assertEqual(e.code(), grpc.StatusCode.UNAUTHENTICATED)
            self.assertIn("authorization", e.details())
            e = rpc_error(stub.Put, iter([put_req("ns-a", h, 0, T, H, D)]), timeout=10,
                          metadata=md("nope-nope-nope"))
            self.assertEqual(e.code(), grpc.StatusCode.UNAUTHENTICATED)
            e = rpc_error(stub.Put, iter([put_req("ns-a", h, 0, T, H, D)]), timeout=10,
                          metadata=md("reader-token-1"))
            self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED)
            e = rpc_error(stub.Put, iter([put_req("ns-b", h, 0, T, H, D)]), timeout=10,
                          metadata=md("writer-token-1"))
            self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED)
            r = stub.Put(iter([put_req("ns-a", h, 0, T, H, D)]), timeout=10, metadata=md("writer-token-1"))
            self.assertEqual(r.blocks_stored, 1)
            g = list(stub.Get(pb.GetRequest(namespace="ns-a", hashes=[h], layer_begin=0,
                                            layer_end=1), timeout=10, metadata=md("reader-token-1")))
            self.assertTrue(g[0].found)
            e = rpc_error(lambda: list(stub.Get(pb.GetRequest(
                namespace="ns-a", hashes=[h], layer_begin=0, layer_end=1), timeout=10)))
            self.assertEqual(e.code(), grpc.StatusCode.UNAUTHENTICATED)
            e = rpc_error(stub.Delete, pb.DeleteRequest(namespace="ns-a", all=True), timeout=10,
                          metadata=md("reader-token-1"))
            self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED)
            self.assertEqual(stub.Stats(pb.StatsRequest(namespace="ns-a"), timeout=10,
                                        metadata=md("reader-token-1")).pages, 1)
            e = rpc_error(stub.Stats, pb.StatsRequest(), timeout=10, metadata=md("reader-token-1"))
            self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED)
            self.assertEqual(stub.Stats(pb.StatsRequest(), timeout=10, metadata=md("admin-token-1")).pages,
                             1)
            check = srv.channel.unary_unary("/grpc.health.v1.Health/Check", **IDENT)
            self.assertEqual(check(b"", timeout=5), b"\x08\x01")  # no token needed

            self.assertIsNotNone(srv.metrics_port)
            import urllib.request
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % srv.metrics_port,
                                          timeout=10).read().decode()
            self.assertIn("tqkv_tier_pages{tier=\"dram\"} 1", text)
            self.assertIn("Put", text)
        finally:
            self.assertEqual(srv.stop(), 0)

    def test_tls(self):
        if shutil.which("openssl") is None:
            self.skipTest("openssl not installed")
        key = os.path.join(TMP, "key.pem")
        cert = os.path.join(TMP, "cert.pem")
        subprocess.check_call(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                               "-keyout", key, "-out", cert, "-days", "1", "-subj",
                               "/CN=localhost", "-addext",
                               "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(cert, "rb") as f:
            root = f.read()
        # gRPC 1.51's secure endpoint leaks one slice-buffer block (576 bytes, allocated
        # in grpc_slice_buffer_trim_end under gpr_realloc) per TLS connection at shutdown;
        # LeakSanitizer (sanitized runs) is told to ignore allocations made by libgpr
        # for this server only.
        supp = os.path.join(TMP, "lsan-grpc-tls.supp")
        with open(supp, "w") as f:
            f.write("leak:libgpr.so\n")
        env = dict(os.environ, LSAN_OPTIONS="suppressions=" + supp)
        srv = Server("--tls-cert", cert, "--tls-key", key, target="localhost",
                     creds=grpc.ssl_channel_credentials(root_certificates=root), env=env)
        try:
            check = srv.channel.unary_unary("/grpc.health.v1.Health/Check", **IDENT)
            self.assertEqual(check(b"", timeout=10), b"\x08\x01")
            plain = grpc.insecure_channel("127.0.0.1:%d" % srv.port)
            e = rpc_error(plain.unary_unary("/grpc.health.v1.Health/Check", **IDENT), b"",
                          timeout=3)
            self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE)
            plain.close()
        finally:
            rc = srv.stop()
            self.assertEqual(rc, 0, "".join(srv.stderr_lines[-30:]))

    def test_store_full_is_resource_exhausted(self):
        srv = Server("--dram-capacity", "64K")
        try:
            T, H, D = 256, 8, 128  # one page is far larger than the whole tier
            e = rpc_error(srv.stub.Put, iter([put_req("full", rand_hash(), 0, T, H, D)]),
                          timeout=30)
            self.assertEqual(e.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, e.details())
            self.assertIn("store", e.details())
            check = srv.channel.unary_unary("/grpc.health.v1.Health/Check", **IDENT)
            self.assertEqual(check(b"", timeout=5), b"\x08\x01")
        finally:
            self.assertEqual(srv.stop(), 0)


class TierTest(unittest.TestCase):
    def test_hbm_standin_tier_reported(self):
        srv = Server("--hbm-standin", "--hbm-capacity", "32M", "--eviction", "lru")
        try:
            T, H, D = 16, 2, 64
            h = rand_hash()
            srv.stub.Put(iter([put_req("tier", h, 0, T, H, D)]), timeout=30)
            lk = srv.stub.Lookup(pb.LookupRequest(namespace="tier", hashes=[h], num_layers=1),
                                 timeout=10)
            self.assertEqual(lk.prefix_blocks, 1)
            self.assertEqual(lk.blocks[0].tier, pb.TIER_HBM)
            g = next(iter(srv.stub.Get(pb.GetRequest(namespace="tier", hashes=[h],
                                                     layer_begin=0, layer_end=1), timeout=10)))
            self.assertEqual(g.tier, pb.TIER_HBM)
            st = srv.stub.Stats(pb.StatsRequest(), timeout=10)
            tiers = {t.tier: t for t in st.tiers}
            self.assertEqual(tiers[pb.TIER_HBM].capacity_bytes, 32 << 20)
            self.assertEqual(tiers[pb.TIER_HBM].pages, 1)
            self.assertEqual(tiers[pb.TIER_DRAM].pages, 0)
        finally:
            self.assertEqual(srv.stop(), 0)


class ShutdownTest(unittest.TestCase):
    def test_sigterm_drains_get_and_health_goes_not_serving(self):
        srv = Server("--drain-seconds", "20")
        try:
            ns = "it-term"
            T, H, D = 128, 8, 128
            h = rand_hash()
            srv.stub.Put(iter([put_req(ns, h, 0, T, H, D)]), timeout=30)
            watch = srv.channel.unary_stream("/grpc.health.v1.Health/Watch", **IDENT)
            w = watch(b"", timeout=60)
            self.assertEqual(next(w), b"\x08\x01")
            n = 300 if not SANITIZED else 100
            it = srv.stub.Get(pb.GetRequest(namespace=ns, hashes=[h] * n, layer_begin=0,
                                            layer_end=1), timeout=60)
            first = next(it)
            self.assertTrue(first.found)
            srv.proc.send_signal(signal.SIGTERM)
            self.assertEqual(next(w), b"\x08\x02")  # NOT_SERVING
            time.sleep(0.2)
            rest = list(it)  # the in-flight stream completes
            self.assertEqual(len(rest) + 1, n)
            self.assertTrue(all(r.page == first.page for r in rest))
            rc = srv.proc.wait(timeout=30)
            self.assertEqual(rc, 0, "".join(srv.stderr_lines))
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()
            srv.channel.close()
            srv.close()


class StartupTest(unittest.TestCase):
    def test_bad_flags_exit_2_with_one_line(self):
        for args in (["--threads", "0"], ["--key-bits", "5"], ["--listen", "nohost"],
                     ["--dram-capacity", "12Q"], ["--bogus"], ["--eviction", "fifo"]):
            p = subprocess.run([SERVER, *args], capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 2, args)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
            self.assertIn(args[0], p.stderr)

    def test_help_lists_every_flag(self):
        p = subprocess.run([SERVER, "--help"], capture_output=True, text=True, timeout=10)
        self.assertEqual(p.returncode, 0)
        for f in ("--listen", "--threads", "--encoder-threads", "--dram-capacity",
                  "--hbm-capacity", "--hbm-standin", "--device", "--max-message-bytes",
                  "--max-streams", "--key-bits", "--value-bits", "--key-mode", "--value-mode",
                  "--boundary-layers", "--boundary-key-bits", "--boundary-value-bits",
                  "--rotation", "--norm-correction", "--key-centering", "--seed", "--eviction",
                  "--ns-quota", "--verify-crc", "--metrics-listen", "--auth-tokens",
                  "--tls-cert", "--tls-key", "--tls-client-ca", "--drain-seconds",
                  "--log-level", "--log-format"):
            self.assertIn(f, p.stdout)

    def test_env_var_and_flag_precedence(self):
        env = dict(os.environ, TQKV_THREADS="0")
        p = subprocess.run([SERVER, "--help"], capture_output=True, text=True, timeout=10,
                           env=env)
        self.assertEqual(p.returncode, 2)
        self.assertIn("TQKV_THREADS", p.stderr)
        env = dict(os.environ, TQKV_LISTEN="bad")
        p = ServerProcess(SERVER, ["--listen", "127.0.0.1:0"], env=env)  # the flag wins
        self.assertTrue(p.listen_addr.startswith("127.0.0.1:"), p.listen_addr)
        self.assertEqual(p.stop(), 0)


if __name__ == "__main__":
    SERVER = os.path.abspath(sys.argv[1])
    PROTO_DIR = os.path.abspath(sys.argv[2])
    gen_stubs()
    try:
        unittest.main(argv=[sys.argv[0], "-v"] + sys.argv[3:])
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
