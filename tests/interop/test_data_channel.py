#!/usr/bin/python3
"""Interop and adversarial tests of tqkv-server's TCP data channel, written the way a
new user with Python grpcio and a plain socket would use it (docs/design.md, "TCP data
channel"; byte formats in transport/data_frame.h).

Usage: test_data_channel.py TQKV_SERVER_BINARY PROTO_DIR [unittest args]

Flow under test: OpenChannel(transport=TRANSPORT_TCP) over gRPC; connect a TCP socket
to data_port; send the 32-byte hello ("TQKH", u32 1, u64 channel_id, secret[16]); read
the 8-byte ack ("TQKA", u32 status); a Get with transport=TRANSPORT_TCP + channel_id
sends no gRPC messages: one 24-byte frame header ("TQKF", u32 index, u32 layer, u32
flags, u32 tier, u32 page_len) + page_len page bytes per (layer, hash), layer-major,
then the call's status.

Checks: pages over the channel are byte-identical to a PACKED gRPC Get (same order,
found=0 frames for missing blocks, tier, layer, index), the channel is reusable; every
hello the server must refuse (wrong secret, unknown id, second connection, bad magic,
bad version, short, garbage, none at all, extra bytes after it) gets the right ack or a
close and leaves the server serving; Get errors over TCP (unknown or unattached
channel, BF16, busy, malformed request); a client vanishing mid-Get, a Get deadline, a
CloseChannel during a Get; servers without --data-listen, with --auth-tokens, at the
channel limit, draining on SIGTERM with a stalled channel, in the HBM tier; expiry of
unattached channels; a flood of silent connections; a Delete under a stalled Get; racing
and concurrent Gets; a drained TCP Get on SIGTERM; --data-listen start-up checks (with
unreadable TLS files, bad address, port in use). Stubs are generated at test time with protoc +
grpc_python_plugin, as in test_server.py.
"""
import os
import shutil
import signal
import socket
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
RNG = np.random.default_rng(SEED)
SC = grpc.StatusCode

pb = None  # tqkv.v1.kvcache_pb2
pbg = None  # tqkv.v1.kvcache_pb2_grpc
TMP = None
MAX_MSG = 8 << 20

HELLO = struct.Struct("<4sIQ16s")
ACK = struct.Struct("<4sI")
FRAME = struct.Struct("<4sIIIII")
ACK_OK, ACK_UNKNOWN, ACK_ATTACHED, ACK_BAD = 0, 1, 2, 3
STALL_BYTES = 64 << 20  # far more than loopback socket buffers hold


def gen_stubs():
    global pb, pbg, TMP
    TMP = tempfile.mkdtemp(prefix="tqkv-dch-")
    out = os.path.join(TMP, "py")
    os.makedirs(out)
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    subprocess.check_call(["protoc", "-I" + PROTO_DIR, "--python_out=" + out,
                           "--grpc_python_out=" + out, "--plugin=protoc-gen-grpc_python=" + plugin,
                           "tqkv/v1/kvcache.proto"])
    sys.path.insert(0, out)
    import tqkv.v1.kvcache_pb2 as m1
    import tqkv.v1.kvcache_pb2_grpc as m2
    pb, pbg = m1, m2


class Server(ServerProcess):
    """A tqkv-server process on 127.0.0.1, port 0, with a grpc channel and stub
    (tests/support/tqkv_server.py)."""

    def __init__(self, *extra, env=None):
        super().__init__(SERVER, ["--listen", "127.0.0.1:0", "--threads", "2",
                                  "--encoder-threads", "2", "--max-message-bytes", str(MAX_MSG),
                                  "--dram-capacity", "256M", *extra], env=env)
        opts = [("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel("127.0.0.1:%d" % self.port, options=opts)
        self.stub = pbg.KVCacheStub(self.channel)

    def stop(self, timeout=30):
        self.channel.close()
        return super().stop(timeout)


def bf16(a):
    """float32 array -> BF16 bytes (round to nearest even)."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).tobytes()


def rand_block(t, h, d):
    k = RNG.standard_normal((t, h, d)).astype(np.float32)
    v = RNG.standard_normal((t, h, d)).astype(np.float32) * 0.5
    return bf16(k), bf16(v)


def rand_hash(n=32):
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


def put_req(ns, h, layer, t, hh, d):
    k, v = rand_block(t, hh, d)
    return pb.PutRequest(namespace=ns, hash=h, layer=layer, num_tokens=t, num_kv_heads=hh,
                         head_dim=d, key=k, value=v)


def rpc_error(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except grpc.RpcError as e:
        return e
    raise AssertionError("call succeeded, an error was expected")


def md(token):
    return None if token is None else [("authorization", "Bearer " + token)]


# ---- the data channel, by hand ----

def hello_bytes(chan_id, secret, magic=b"TQKH", version=1):
    return HELLO.pack(magic, version, chan_id, secret)


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(min(n - len(buf), 1 << 20))
        if not b:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += b
    return bytes(buf)


def read_ack(sock):
    """The ack's status, or None when the server closed (or reset) without one."""
    try:
        a = recv_exact(sock, ACK.size)
    except (EOFError, ConnectionResetError):
        return None
    magic, status = ACK.unpack(a)
    assert magic == b"TQKA", "not an ack: %r" % a
    return status


def connect(port, timeout=10):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def sees_eof(sock, within=5.0):
    """True when the peer closes within `within` seconds (data still queued is skipped)."""
    sock.settimeout(within)
    end = time.time() + within
    try:
        while time.time() < end:
            if not sock.recv(1 << 20):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


class Frame:
    __slots__ = ("index", "layer", "flags", "tier", "page")

    def __init__(self, sock):
        hdr = recv_exact(sock, FRAME.size)
        magic, self.index, self.layer, self.flags, self.tier, plen = FRAME.unpack(hdr)
        if magic != b"TQKF":
            raise AssertionError("not a frame header: %r" % hdr)
        self.page = recv_exact(sock, plen) if plen else b""


class DataChannel:
    """An OpenChannel(TCP) and its attached socket."""

    def __init__(self, stub, token=None, attach=True):
        self.stub = stub
        self.token = token
        r = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10,
                             metadata=md(token))
        assert r.data_port > 0, "OpenChannel(TCP) gave no data_port: %s" % r
        assert len(r.channel_secret) == 16, "channel_secret of %d bytes" % len(r.channel_secret)
        self.id, self.secret, self.port = r.channel_id, r.channel_secret, r.data_port
        self.sock = None
        if attach:
            self.sock = connect(self.port)
            self.sock.sendall(hello_bytes(self.id, self.secret))
            st = read_ack(self.sock)
            assert st == ACK_OK, "ack status %r for a fresh channel" % st

    def get_req(self, ns, hashes, lb, le, **kw):
        return pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=lb, layer_end=le,
                             transport=pb.TRANSPORT_TCP, channel_id=self.id, **kw)

    def start_get(self, ns, hashes, lb, le, timeout=60, token=None, **kw):
        return self.stub.Get(self.get_req(ns, hashes, lb, le, **kw), timeout=timeout,
                             metadata=md(token if token is not None else self.token))

    def get(self, ns, hashes, lb, le, timeout=60, **kw):
        """A whole Get over the channel: its frames; the gRPC stream must be empty and OK."""
        it = self.start_get(ns, hashes, lb, le, timeout=timeout, **kw)
        n = len(hashes) * (le - lb)
        frames = []
        self.sock.settimeout(timeout)
        try:
            for _ in range(n):
                frames.append(Frame(self.sock))
        except (socket.timeout, EOFError, ConnectionError) as e:
            try:
                msgs = list(it)
                why = "status OK with %d messages" % len(msgs)
            except grpc.RpcError as re:
                why = "status %s %r" % (re.code(), re.details())
            raise AssertionError("after %d of %d frames: %r; Get %s" % (len(frames), n, e, why))
        msgs = list(it)  # raises on a non-OK status
        assert msgs == [], "%d messages on the gRPC stream of a TCP Get" % len(msgs)
        return frames

    def no_pending_bytes(self, wait=0.2):
        self.sock.settimeout(wait)
        try:
            b = self.sock.recv(1)
        except socket.timeout:
            return True
        return False if b else "EOF"

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def grpc_get(stub, ns, hashes, lb, le, token=None):
    return list(stub.Get(pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=lb,
                                       layer_end=le), timeout=60, metadata=md(token)))


class DataChannelTest(unittest.TestCase):
    """One server with --data-listen shared by the tests of this class."""

    @classmethod
    def setUpClass(cls):
        cls.srv = Server("--data-listen", "127.0.0.1:0")
        cls.stub = cls.srv.stub
        # A small data set: 4 layers; hashes[2] only in layer 1, two block shapes.
        cls.ns = "dch-basic"
        cls.hashes = [rand_hash() for _ in range(4)]
        reqs = []
        for layer in range(4):
            for i, h in enumerate(cls.hashes[:2]):
                reqs.append(put_req(cls.ns, h, layer, 16, 2, 64) if i == 0 else
                            put_req(cls.ns, h, layer, 33, 4, 128))
        reqs.append(put_req(cls.ns, cls.hashes[2], 1, 8, 1, 32))
        r = cls.stub.Put(iter(reqs), timeout=60)
        assert r.blocks_stored == len(reqs), r
        cls.missing = cls.hashes[3]  # never stored
        cls.ref = grpc_get(cls.stub, cls.ns, cls.hashes, 0, 4)
        # One big block for Gets that outlast the socket buffers.
        cls.big_ns = "dch-big"
        cls.big = rand_hash(16)
        cls.stub.Put(iter([put_req(cls.big_ns, cls.big, 0, 128, 8, 128)]), timeout=60)
        cls.big_page = grpc_get(cls.stub, cls.big_ns, [cls.big], 0, 1)[0].page
        cls.big_n = max(200, STALL_BYTES // len(cls.big_page) + 1)

    @classmethod
    def tearDownClass(cls):
        rc = cls.srv.stop()
        assert rc == 0, "server exit status %s\n%s" % (rc, cls.srv.log_tail())

    def assertServing(self):
        """A fresh channel serves the reference data unchanged."""
        ch = DataChannel(self.stub)
        try:
            frames = ch.get(self.ns, self.hashes, 0, 4)
            self.assertEqual([f.page for f in frames], [g.page for g in self.ref])
        finally:
            ch.close()
        again = grpc_get(self.stub, self.ns, self.hashes, 0, 4)
        self.assertEqual([g.page for g in again], [g.page for g in self.ref])

    def assertFramesMatch(self, frames, grpc_msgs, lb, n_hashes):
        self.assertEqual(len(frames), len(grpc_msgs))
        for i, (f, g) in enumerate(zip(frames, grpc_msgs)):
            self.assertEqual(f.index, i)
            self.assertEqual(f.layer, lb + i // n_hashes)
            self.assertEqual(f.layer, g.layer)
            self.assertEqual(f.flags & 1, int(g.found), "frame %d found flag" % i)
            self.assertEqual(f.flags & ~1, 0, "frame %d: unknown flag bits %#x" % (i, f.flags))
            self.assertEqual(f.page, g.page, "frame %d: page bytes differ from gRPC" % i)
            if g.found:
                self.assertEqual(f.tier, g.tier)
                self.assertEqual(f.page[:4], b"TQKP")
            else:
                self.assertEqual(len(f.page), 0)

    # ---- 1. byte-identical pages, order, missing blocks, reuse ----

    def test_pages_match_grpc_and_channel_is_reusable(self):
        ch = DataChannel(self.stub)
        try:
            before = self.stub.Stats(pb.StatsRequest(namespace=self.ns), timeout=10)
            frames = ch.get(self.ns, self.hashes, 0, 4)
            after = self.stub.Stats(pb.StatsRequest(namespace=self.ns), timeout=10)
            self.assertFramesMatch(frames, self.ref, 0, len(self.hashes))
            found = [f.flags & 1 for f in frames]
            # hashes[2] exists in layer 1 only; hashes[3] nowhere
            self.assertEqual(found, [1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0])
            self.assertEqual(after.bytes_out - before.bytes_out, sum(len(f.page) for f in frames),
                             "Stats.bytes_out counts the pages sent over the channel")
            self.assertEqual((after.hits - before.hits, after.misses - before.misses),
                             (sum(found), len(found) - sum(found)), "Stats hits, misses")
            self.assertIs(ch.no_pending_bytes(), True, "bytes after the last frame")
            # Reusable: a second Get, another layer range and order, duplicates.
            hs = [self.missing, self.hashes[1], self.hashes[0], self.hashes[1]]
            ref2 = grpc_get(self.stub, self.ns, hs, 1, 3)
            frames2 = ch.get(self.ns, hs, 1, 3)
            self.assertFramesMatch(frames2, ref2, 1, len(hs))
            # and a Get of nothing stored at all
            fr3 = ch.get("dch-empty-ns", [self.missing], 0, 2)
            self.assertEqual([(f.index, f.layer, f.flags, len(f.page)) for f in fr3],
                             [(0, 0, 0, 0), (1, 1, 0, 0)])
            self.assertIs(ch.no_pending_bytes(), True)
            # Closing a live channel: OK, the socket sees EOF, the id is gone.
            self.stub.CloseChannel(pb.CloseChannelRequest(channel_id=ch.id), timeout=10)
            self.assertTrue(sees_eof(ch.sock), "no EOF on the socket after CloseChannel")
            e = rpc_error(self.stub.CloseChannel, pb.CloseChannelRequest(channel_id=ch.id),
                          timeout=10)
            self.assertEqual(e.code(), SC.NOT_FOUND, e.details())
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1)))
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
        finally:
            ch.close()

    def test_big_get_over_channel(self):
        ch = DataChannel(self.stub)
        try:
            n = 300
            frames = ch.get(self.big_ns, [self.big] * n, 0, 1)
            self.assertEqual(len(frames), n)
            self.assertTrue(all(f.page == self.big_page and f.flags == 1 for f in frames))
            self.assertEqual([f.index for f in frames], list(range(n)))
        finally:
            ch.close()

    # ---- 2. hellos the server must refuse ----

    def test_bad_hellos(self):
        ch = DataChannel(self.stub)
        try:
            bad_secret = bytes([ch.secret[0] ^ 1]) + ch.secret[1:]
            cases = [
                ("wrong secret", hello_bytes(ch.id, bad_secret), {ACK_UNKNOWN}),
                ("unknown channel id", hello_bytes(ch.id ^ (1 << 63), ch.secret), {ACK_UNKNOWN}),
                ("second connection", hello_bytes(ch.id, ch.secret), {ACK_ATTACHED}),
                ("bad magic", hello_bytes(ch.id, ch.secret, magic=b"TQKX"), {ACK_BAD, None}),
                ("version 2", hello_bytes(ch.id, ch.secret, version=2), {ACK_BAD, None}),
                ("version 0", hello_bytes(ch.id, ch.secret, version=0), {ACK_BAD, None}),
                ("31 bytes then EOF", hello_bytes(ch.id, ch.secret)[:31], {ACK_BAD, None}),
                ("nothing then EOF", b"", {ACK_BAD, None}),
                ("HTTP request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64,
                 {ACK_BAD, None}),
                ("64 KiB of garbage", RNG.integers(0, 256, 65536, dtype=np.uint8).tobytes(),
                 {ACK_BAD, None}),
            ]
            for label, data, want in cases:
                s = connect(ch.port)
                try:
                    try:
                        s.sendall(data)
                        if label.endswith("then EOF"):
                            s.shutdown(socket.SHUT_WR)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the server may close before taking all the garbage
                    t0 = time.time()
                    st = read_ack(s)
                    self.assertIn(st, want, "%s: ack %r" % (label, st))
                    self.assertLess(time.time() - t0, 3.0, "%s: ack took too long" % label)
                    if st is not None:
                        self.assertTrue(sees_eof(s), "%s: connection left open" % label)
                finally:
                    s.close()
            # None of that disturbed the attached channel.
            frames = ch.get(self.ns, self.hashes, 0, 4)
            self.assertEqual([f.page for f in frames], [g.page for g in self.ref])
            # After CloseChannel its hello is refused.
            self.stub.CloseChannel(pb.CloseChannelRequest(channel_id=ch.id), timeout=10)
            s = connect(ch.port)
            try:
                s.sendall(hello_bytes(ch.id, ch.secret))
                self.assertEqual(read_ack(s), ACK_UNKNOWN)
            finally:
                s.close()
        finally:
            ch.close()
        self.assertServing()

    def test_hello_never_sent_times_out_without_blocking_others(self):
        ch = DataChannel(self.stub, attach=False)
        s = connect(ch.port, timeout=15)
        try:
            t0 = time.time()
            # While that connection says nothing, another channel attaches and serves.
            self.assertServing()
            st = read_ack(s)
            took = time.time() - t0
            self.assertIn(st, (ACK_BAD, None), "ack %r for a silent connection" % st)
            self.assertGreater(took, 3.0, "silent connection dropped after %.1fs" % took)
            self.assertLess(took, 10.0, "silent connection kept %.1fs" % took)
        finally:
            s.close()
        # The channel itself was not consumed by the silent connection: attach now.
        s = connect(ch.port)
        try:
            s.sendall(hello_bytes(ch.id, ch.secret))
            self.assertEqual(read_ack(s), ACK_OK)
        finally:
            s.close()

    def test_hello_flood_recovers(self):
        """More silent connections than the server has connection threads (320): each is
        answered ack 3 or closed once its 5 s are up, then hellos work again and the
        server holds no more descriptors than before."""
        fds = lambda: len(os.listdir("/proc/%d/fd" % self.srv.proc.pid))
        ch = DataChannel(self.stub, attach=False)
        before = fds()
        silent = []
        try:
            for _ in range(340):
                silent.append(connect(ch.port, timeout=15))
            t0 = time.time()
            for s in silent:
                self.assertIn(read_ack(s), (ACK_BAD, None))
            self.assertLess(time.time() - t0, 12.0)
        finally:
            for s in silent:
                s.close()
        s = connect(ch.port)
        try:
            s.sendall(hello_bytes(ch.id, ch.secret))
            self.assertEqual(read_ack(s), ACK_OK)
        finally:
            s.close()
        deadline = time.time() + 5
        while fds() > before and time.time() < deadline:
            time.sleep(0.1)
        self.assertLessEqual(fds(), before, "descriptors left after the flood")

    def test_hello_split_in_pieces_is_accepted(self):
        ch = DataChannel(self.stub, attach=False)
        s = connect(ch.port)
        try:
            h = hello_bytes(ch.id, ch.secret)
            for i in range(0, 32, 5):
                s.sendall(h[i:i + 5])
                time.sleep(0.05)
            self.assertEqual(read_ack(s), ACK_OK)
            ch.sock = s
            frames = ch.get(self.ns, self.hashes, 0, 4)
            self.assertEqual([f.page for f in frames], [g.page for g in self.ref])
        finally:
            s.close()

    def test_bytes_after_hello_close_the_channel(self):
        ch = DataChannel(self.stub, attach=False)
        s = connect(ch.port)
        try:
            s.sendall(hello_bytes(ch.id, ch.secret) + b"junk")
            self.assertEqual(read_ack(s), ACK_OK)
            self.assertTrue(sees_eof(s), "channel kept open after bytes from the client")
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1)))
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
        finally:
            s.close()
        self.assertServing()

    # ---- 3. Get errors over TCP ----

    def test_get_errors(self):
        ch = DataChannel(self.stub)
        try:
            for bad_id in (ch.id ^ 0x5A5A, 0, (1 << 64) - 1):
                req = pb.GetRequest(namespace=self.ns, hashes=self.hashes, layer_begin=0,
                                    layer_end=1, transport=pb.TRANSPORT_TCP, channel_id=bad_id)
                e = rpc_error(lambda: list(self.stub.Get(req, timeout=10)))
                self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
                self.assertIn(str(bad_id), e.details())
                self.assertIn("channel", e.details())
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1,
                                                    encoding=pb.ENCODING_BF16)))
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertIn("encoding", e.details())
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 2, 2)))
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertIn("layer_end", e.details())
            e = rpc_error(lambda: list(ch.start_get(self.ns, [b"short"], 0, 1)))
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            e = rpc_error(lambda: list(ch.start_get(self.ns, [], 0, 1)))
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            # None of those wrote to the channel, which still works.
            self.assertIs(ch.no_pending_bytes(), True)
            frames = ch.get(self.ns, self.hashes, 0, 4)
            self.assertFramesMatch(frames, self.ref, 0, len(self.hashes))
        finally:
            ch.close()
        # Opened but not connected yet.
        un = DataChannel(self.stub, attach=False)
        e = rpc_error(lambda: list(un.start_get(self.ns, self.hashes, 0, 1)))
        self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
        self.assertIn(str(un.id), e.details())
        self.assertIn("not connected", e.details())
        self.stub.CloseChannel(pb.CloseChannelRequest(channel_id=un.id), timeout=10)

    def test_second_get_while_busy(self):
        ch = DataChannel(self.stub)
        try:
            n = self.big_n
            it = ch.start_get(self.big_ns, [self.big] * n, 0, 1, timeout=120)
            ch.sock.settimeout(30)
            first = Frame(ch.sock)  # the first Get is running; we stop reading here
            self.assertEqual((first.index, first.flags), (0, 1))
            self.assertEqual(first.page, self.big_page)
            time.sleep(0.3)
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1, timeout=10)))
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
            self.assertIn("busy", e.details())
            # The first Get is unharmed: every remaining frame, then OK.
            for i in range(1, n):
                f = Frame(ch.sock)
                if f.index != i or f.page != self.big_page:
                    self.fail("frame %d: index %d, %d bytes" % (i, f.index, len(f.page)))
            self.assertEqual(list(it), [])
            # and the channel is free again
            frames = ch.get(self.ns, self.hashes, 0, 4)
            self.assertFramesMatch(frames, self.ref, 0, len(self.hashes))
        finally:
            ch.close()

    def test_racing_gets_on_one_channel(self):
        """Two Gets started at once on one channel: each either runs whole or is refused
        "busy" with no frames; the frames on the socket are exactly those of the OK ones."""
        ch = DataChannel(self.stub)
        try:
            hs = self.hashes[:2]
            n = len(hs) * 4
            ref = [g.page for g in self.ref if g.hash in hs]
            busy = 0
            for _ in range(15):
                its = [ch.start_get(self.ns, hs, 0, 4, timeout=30) for _ in range(2)]
                ok = 0
                for it in its:
                    try:
                        self.assertEqual(list(it), [])
                        ok += 1
                    except grpc.RpcError as e:
                        self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
                        self.assertIn("busy", e.details())
                        busy += 1
                self.assertGreaterEqual(ok, 1)
                ch.sock.settimeout(10)
                for _ in range(ok):
                    frames = [Frame(ch.sock) for _ in range(n)]
                    self.assertEqual([f.index for f in frames], list(range(n)))
                    self.assertEqual([f.page for f in frames], ref)
                self.assertIs(ch.no_pending_bytes(0.05), True, "frames of a refused Get")
            print("racing Gets: %d of 30 refused busy" % busy, file=sys.stderr)
        finally:
            ch.close()

    def test_concurrent_gets_on_many_channels(self):
        errors = []
        ref = [g.page for g in self.ref]

        def worker(tid):
            try:
                ch = DataChannel(self.stub)
                try:
                    for r in range(5):
                        if (tid + r) % 3 == 0:
                            got = [g.page for g in grpc_get(self.stub, self.ns, self.hashes, 0, 4)]
                        else:
                            got = [f.page for f in ch.get(self.ns, self.hashes, 0, 4)]
                        assert got == ref, "thread %d round %d: pages differ" % (tid, r)
                finally:
                    ch.close()
            except Exception as e:  # reported below with the thread id
                errors.append((tid, repr(e)))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])

    def test_many_missing_blocks(self):
        ch = DataChannel(self.stub)
        try:
            n = 65536  # the server's hash limit
            hs = [i.to_bytes(4, "little") * 4 for i in range(n)]
            frames = ch.get("dch-nothing-here", hs, 3, 4)
            self.assertEqual(len(frames), n)
            self.assertTrue(all(f.index == i and f.layer == 3 and f.flags == 0 and not f.page
                                for i, f in enumerate(frames)))
            e = rpc_error(lambda: list(ch.start_get("dch-nothing-here", hs + [b"x" * 16], 0, 1)))
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertIn("hashes", e.details())
            self.assertIs(ch.no_pending_bytes(), True)
        finally:
            ch.close()

    def test_delete_during_a_stalled_get(self):
        """Pages pinned for frames stay intact while their block is deleted; frames after
        the delete report the block missing."""
        ns = "dch-del"
        h = rand_hash(16)
        self.stub.Put(iter([put_req(ns, h, 0, 128, 8, 128)]), timeout=60)
        page = grpc_get(self.stub, ns, [h], 0, 1)[0].page
        n = max(200, STALL_BYTES // len(page) + 1)
        ch = DataChannel(self.stub)
        try:
            it = ch.start_get(ns, [h] * n, 0, 1, timeout=120)
            ch.sock.settimeout(30)
            self.assertEqual(Frame(ch.sock).page, page)
            time.sleep(0.3)  # the writer is blocked on a full socket, a page pinned
            d = self.stub.Delete(pb.DeleteRequest(namespace=ns, all=True), timeout=10)
            self.assertEqual(d.pages_deleted, 1)
            found = 0
            for i in range(1, n):
                f = Frame(ch.sock)
                self.assertEqual(f.index, i)
                if f.flags & 1:
                    self.assertEqual(f.page, page, "frame %d: a deleted page changed" % i)
                    found += 1
                else:
                    self.assertEqual(f.page, b"")
            self.assertLess(found, n - 1, "every frame found after the Delete")
            self.assertEqual(list(it), [])
        finally:
            ch.close()
        self.assertServing()

    # ---- 5. a client that goes away, deadlines, CloseChannel during a Get ----

    def test_client_disconnects_mid_get(self):
        ch = DataChannel(self.stub)
        it = ch.start_get(self.big_ns, [self.big] * self.big_n, 0, 1, timeout=120)
        ch.sock.settimeout(30)
        Frame(ch.sock)
        # Unread data in the receive buffer: close sends a reset.
        ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ch.close()
        t0 = time.time()
        e = rpc_error(lambda: list(it))
        self.assertNotEqual(e.code(), SC.OK)
        self.assertEqual(e.code(), SC.UNAVAILABLE, e.details())
        self.assertIn(str(ch.id), e.details())
        self.assertLess(time.time() - t0, 30)
        e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1)))
        self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
        self.assertServing()

    def test_close_channel_during_get(self):
        ch = DataChannel(self.stub)
        try:
            it = ch.start_get(self.big_ns, [self.big] * self.big_n, 0, 1, timeout=120)
            ch.sock.settimeout(30)
            Frame(ch.sock)
            time.sleep(0.3)
            self.stub.CloseChannel(pb.CloseChannelRequest(channel_id=ch.id), timeout=10)
            e = rpc_error(lambda: list(it))
            self.assertIn(e.code(), (SC.UNAVAILABLE, SC.CANCELLED), e.details())
            self.assertTrue(sees_eof(ch.sock, 10), "no EOF after CloseChannel")
        finally:
            ch.close()
        self.assertServing()

    def test_deadline_on_a_stalled_channel(self):
        ch = DataChannel(self.stub)
        try:
            it = ch.start_get(self.big_ns, [self.big] * self.big_n, 0, 1, timeout=1.5)
            ch.sock.settimeout(30)
            Frame(ch.sock)
            time.sleep(2.0)
            e = rpc_error(lambda: list(it))
            self.assertEqual(e.code(), SC.DEADLINE_EXCEEDED, e.details())
            # The stalled writer was stopped: the channel closes (after what was queued).
            self.assertTrue(sees_eof(ch.sock, 10), "no EOF after the deadline")
            e = rpc_error(lambda: list(ch.start_get(self.ns, self.hashes, 0, 1)))
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
        finally:
            ch.close()
        self.assertServing()

    def test_cancel_a_stalled_get(self):
        ch = DataChannel(self.stub)
        try:
            it = ch.start_get(self.big_ns, [self.big] * self.big_n, 0, 1, timeout=60)
            ch.sock.settimeout(30)
            Frame(ch.sock)
            it.cancel()
            self.assertTrue(sees_eof(ch.sock, 10), "no EOF after the Get was cancelled")
        finally:
            ch.close()
        self.assertServing()


class ExpiryTest(unittest.TestCase):
    def test_unattached_channel_expires(self):
        """design: a channel nobody connects to expires after 30 s, also when no
        OpenChannel comes after it (the server reaped expired channels only there, so a
        late hello was accepted); an attached channel does not expire."""
        srv = Server("--data-listen", "127.0.0.1:0")
        try:
            h = rand_hash()
            srv.stub.Put(iter([put_req("exp", h, 0, 16, 2, 64)]), timeout=30)
            late = DataChannel(srv.stub, attach=False)
            kept = DataChannel(srv.stub)
            time.sleep(31.5)
            s = connect(late.port)
            try:
                s.sendall(hello_bytes(late.id, late.secret))
                self.assertEqual(read_ack(s), ACK_UNKNOWN, "hello accepted 31 s after OpenChannel")
            finally:
                s.close()
            e = rpc_error(srv.stub.CloseChannel, pb.CloseChannelRequest(channel_id=late.id),
                          timeout=10)
            self.assertEqual(e.code(), SC.NOT_FOUND, e.details())
            self.assertEqual(len(kept.get("exp", [h], 0, 1)), 1)
            kept.close()
        finally:
            self.assertEqual(srv.stop(), 0, srv.log_tail())


class TierTest(unittest.TestCase):
    def test_hbm_tier_in_frames(self):
        srv = Server("--data-listen", "127.0.0.1:0", "--hbm-standin", "--hbm-capacity", "32M")
        try:
            hs = [rand_hash() for _ in range(3)]
            srv.stub.Put(iter([put_req("tier", h, 0, 16, 2, 64) for h in hs[:2]]), timeout=30)
            ref = grpc_get(srv.stub, "tier", hs, 0, 1)
            ch = DataChannel(srv.stub)
            try:
                frames = ch.get("tier", hs, 0, 1)
            finally:
                ch.close()
            self.assertEqual([f.tier for f in frames], [pb.TIER_HBM, pb.TIER_HBM, 0])
            self.assertEqual([f.tier for f in frames[:2]], [g.tier for g in ref[:2]])
            self.assertEqual([f.page for f in frames], [g.page for g in ref])
        finally:
            self.assertEqual(srv.stop(), 0, srv.log_tail())


class ShutdownTest(unittest.TestCase):
    def test_sigterm_drains_a_tcp_get(self):
        """SIGTERM during a Get over an attached channel: the Get finishes whole and OK
        within the drain, new channels cannot attach, the server exits 0."""
        srv = Server("--data-listen", "127.0.0.1:0", "--drain-seconds", "20")
        try:
            h = rand_hash(16)
            srv.stub.Put(iter([put_req("drain", h, 0, 128, 8, 128)]), timeout=30)
            page = grpc_get(srv.stub, "drain", [h], 0, 1)[0].page
            n = max(200, STALL_BYTES // len(page) + 1)
            ch = DataChannel(srv.stub)
            late = DataChannel(srv.stub, attach=False)
            it = ch.start_get("drain", [h] * n, 0, 1, timeout=60)
            ch.sock.settimeout(30)
            self.assertEqual(Frame(ch.sock).page, page)
            srv.proc.send_signal(signal.SIGTERM)
            # The server has begun draining once it logs so (not a guess of how long a
            # signal takes): only then must a new channel be refused.
            deadline = time.time() + 30
            while not any("draining" in l for l in srv.stderr_lines):
                self.assertLess(time.time(), deadline, "no 'draining' line: " + srv.log_tail())
                time.sleep(0.01)
            for i in range(1, n):
                f = Frame(ch.sock)
                if f.index != i or f.page != page:
                    self.fail("frame %d: index %d, %d bytes" % (i, f.index, len(f.page)))
            self.assertEqual(list(it), [])
            try:
                s = connect(late.port, timeout=5)
                s.sendall(hello_bytes(late.id, late.secret))
                st = read_ack(s)
                s.close()
            except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
                st = None
            self.assertIsNone(st, "a channel attached during the drain (ack %r)" % st)
            rc = srv.proc.wait(timeout=30)
            self.assertEqual(rc, 0, srv.log_tail())
            self.assertTrue(sees_eof(ch.sock, 5))
            ch.close()
        finally:
            srv.stop()


class NoDataListenTest(unittest.TestCase):
    def test_open_channel_tcp_needs_data_listen(self):
        srv = Server()
        try:
            e = rpc_error(srv.stub.OpenChannel, pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP),
                          timeout=10)
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
            self.assertIn("--data-listen", e.details())
            req = pb.GetRequest(namespace="x", hashes=[rand_hash()], layer_begin=0, layer_end=1,
                                transport=pb.TRANSPORT_TCP, channel_id=1)
            e = rpc_error(lambda: list(srv.stub.Get(req, timeout=10)))
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
            self.assertIn("--data-listen", e.details())
        finally:
            self.assertEqual(srv.stop(), 0)


class AuthTest(unittest.TestCase):
    A = "dch-token-a-000000001"
    B = "dch-token-b-000000002"
    C = "dch-token-c-000000003"  # another namespace only

    def test_channel_belongs_to_its_token(self):
        path = os.path.join(TMP, "tokens")
        with open(path, "w") as f:
            f.write("# data channel test tokens\n%s rw ns-a\n%s rw ns-a\n%s r ns-c\n"
                    % (self.A, self.B, self.C))
        srv = Server("--data-listen", "127.0.0.1:0", "--auth-tokens", path)
        try:
            stub = srv.stub
            h = rand_hash()
            stub.Put(iter([put_req("ns-a", h, 0, 16, 2, 64)]), timeout=30, metadata=md(self.A))
            ref = grpc_get(stub, "ns-a", [h], 0, 1, token=self.A)
            e = rpc_error(stub.OpenChannel, pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP),
                          timeout=10)
            self.assertEqual(e.code(), SC.UNAUTHENTICATED, e.details())
            e = rpc_error(stub.OpenChannel, pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP),
                          timeout=10, metadata=md("not-a-known-token-123"))
            self.assertEqual(e.code(), SC.UNAUTHENTICATED, e.details())

            ch = DataChannel(stub, token=self.A)
            try:
                frames = ch.get("ns-a", [h], 0, 1)
                self.assertEqual(frames[0].page, ref[0].page)
                # Token B may read ns-a, but the channel is A's.
                e = rpc_error(lambda: list(ch.start_get("ns-a", [h], 0, 1, token=self.B)))
                self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
                self.assertIn(str(ch.id), e.details())
                # No token, and a token for another namespace: the usual auth answers.
                req = ch.get_req("ns-a", [h], 0, 1)
                e = rpc_error(lambda: list(stub.Get(req, timeout=10)))
                self.assertEqual(e.code(), SC.UNAUTHENTICATED, e.details())
                e = rpc_error(lambda: list(ch.start_get("ns-a", [h], 0, 1, token=self.C)))
                self.assertEqual(e.code(), SC.PERMISSION_DENIED, e.details())
                # A's token on a namespace it is not granted, over its own channel.
                e = rpc_error(lambda: list(ch.start_get("ns-c", [h], 0, 1)))
                self.assertEqual(e.code(), SC.PERMISSION_DENIED, e.details())
                # B cannot close A's channel either.
                e = rpc_error(stub.CloseChannel, pb.CloseChannelRequest(channel_id=ch.id),
                              timeout=10, metadata=md(self.B))
                self.assertEqual(e.code(), SC.NOT_FOUND, e.details())
                e = rpc_error(stub.CloseChannel, pb.CloseChannelRequest(channel_id=ch.id),
                              timeout=10)
                self.assertEqual(e.code(), SC.UNAUTHENTICATED, e.details())
                self.assertIs(ch.no_pending_bytes(), True)
                frames = ch.get("ns-a", [h], 0, 1)
                self.assertEqual(frames[0].page, ref[0].page)
                stub.CloseChannel(pb.CloseChannelRequest(channel_id=ch.id), timeout=10,
                                  metadata=md(self.A))
                self.assertTrue(sees_eof(ch.sock))
            finally:
                ch.close()
            # A channel belongs to the token, not to the header's spelling: the same
            # token with another scheme case and extra blanks is the same owner.
            for spelled in ("bearer " + self.A, "BEARER  " + self.A + " "):
                ch = DataChannel(stub, token=self.A)
                try:
                    req = ch.get_req("ns-a", [h], 0, 1)
                    it = stub.Get(req, timeout=10, metadata=[("authorization", spelled)])
                    ch.sock.settimeout(10)
                    f = Frame(ch.sock)
                    self.assertEqual(f.page, ref[0].page)
                    self.assertEqual(list(it), [])
                finally:
                    ch.close()
        finally:
            self.assertEqual(srv.stop(), 0, srv.log_tail())


class LimitsTest(unittest.TestCase):
    def test_channel_limit_and_shutdown_with_stalled_channel(self):
        srv = Server("--data-listen", "127.0.0.1:0", "--drain-seconds", "2")
        try:
            stub = srv.stub
            ids = []
            for _ in range(256):
                r = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP),
                                     timeout=10)
                ids.append(r.channel_id)
            self.assertEqual(len(set(ids)), 256, "channel ids repeat")
            e = rpc_error(stub.OpenChannel, pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP),
                          timeout=10)
            self.assertEqual(e.code(), SC.RESOURCE_EXHAUSTED, e.details())
            self.assertIn("256", e.details())
            for cid in ids[:3]:
                stub.CloseChannel(pb.CloseChannelRequest(channel_id=cid), timeout=10)
            for cid in ids[3:]:
                stub.CloseChannel(pb.CloseChannelRequest(channel_id=cid), timeout=10)

            # SIGTERM while a channel's Get is stalled (client not reading), another
            # channel idles attached and a third connection never says hello.
            h = rand_hash(16)
            stub.Put(iter([put_req("lim", h, 0, 128, 8, 128)]), timeout=30)
            page = grpc_get(stub, "lim", [h], 0, 1)[0].page
            n = max(200, STALL_BYTES // len(page) + 1)
            busy = DataChannel(stub)
            idle = DataChannel(stub)
            silent = connect(busy.port)
            it = busy.start_get("lim", [h] * n, 0, 1, timeout=120)
            busy.sock.settimeout(30)
            Frame(busy.sock)
            t0 = time.time()
            srv.proc.send_signal(signal.SIGTERM)
            e = rpc_error(lambda: list(it))
            self.assertNotEqual(e.code(), SC.OK)
            try:
                rc = srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.fail("server still running 30 s after SIGTERM:\n" + srv.log_tail())
            self.assertEqual(rc, 0, srv.log_tail())
            self.assertLess(time.time() - t0, 20)
            self.assertTrue(sees_eof(idle.sock, 5))
            busy.close()
            idle.close()
            silent.close()
        finally:
            srv.stop()


class StartupTest(unittest.TestCase):
    def run_server(self, *args, env=None):
        return subprocess.run([SERVER, "--listen", "127.0.0.1:0", *args], capture_output=True,
                              text=True, timeout=20, env=env)

    def test_data_listen_with_unreadable_tls_files(self):
        # With --tls-cert, data channels are TLS (tests/security/test_dc_tls.py): a
        # certificate that cannot be read stops the start-up, naming the file.
        cert, key = os.path.join(TMP, "no-cert.pem"), os.path.join(TMP, "no-key.pem")
        for args in (["--data-listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key],
                     ["--tls-cert", cert, "--tls-key", key, "--data-listen", "127.0.0.1:0"]):
            p = self.run_server(*args)
            self.assertNotEqual(p.returncode, 0, (args, p.stderr))
            self.assertIn(cert, p.stderr)
        env = dict(os.environ, TQKV_DATA_LISTEN="127.0.0.1:0")
        p = self.run_server("--tls-cert", cert, "--tls-key", key, env=env)
        self.assertNotEqual(p.returncode, 0, p.stderr)
        self.assertIn(cert, p.stderr)

    def test_bad_data_listen_addresses(self):
        for v in ("nohost", "127.0.0.1:", "127.0.0.1:99999", "256.1.1.1:0", ":x"):
            p = self.run_server("--data-listen", v)
            self.assertNotEqual(p.returncode, 0, v)
            self.assertIn("--data-listen", p.stderr, (v, p.stderr))
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        try:
            p = self.run_server("--data-listen", "127.0.0.1:%d" % busy.getsockname()[1])
            self.assertNotEqual(p.returncode, 0, p.stderr)
            self.assertIn("--data-listen", p.stderr)
        finally:
            busy.close()


class MetricsTest(unittest.TestCase):
    def test_data_channels_gauge(self):
        """/metrics counts open data channels: +1 per OpenChannel, -1 when one closes."""
        import urllib.request
        srv = Server("--data-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0")
        try:
            line = srv.proc.stdout.readline()
            self.assertIn("metrics on port", line)
            mport = int(line.strip().rsplit(" ", 1)[1])

            def gauge():
                with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % mport,
                                            timeout=10) as r:
                    for ln in r.read().decode().splitlines():
                        if ln.startswith("tqkv_data_channels "):
                            return float(ln.split()[1])
                self.fail("no tqkv_data_channels sample")

            self.assertEqual(gauge(), 0)
            a = DataChannel(srv.stub)
            b = DataChannel(srv.stub, attach=False)
            self.assertEqual(gauge(), 2)
            srv.stub.CloseChannel(pb.CloseChannelRequest(channel_id=b.id), timeout=10)
            self.assertEqual(gauge(), 1)
            a.sock.close()  # the server drops a channel whose connection closes
            deadline = time.time() + 10
            while gauge() != 0 and time.time() < deadline:
                time.sleep(0.05)
            self.assertEqual(gauge(), 0)
        finally:
            self.assertEqual(srv.stop(), 0)


if __name__ == "__main__":
    SERVER = os.path.abspath(sys.argv[1])
    PROTO_DIR = os.path.abspath(sys.argv[2])
    gen_stubs()
    try:
        unittest.main(argv=[sys.argv[0], "-v"] + sys.argv[3:])
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
