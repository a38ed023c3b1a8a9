#!/usr/bin/python3
"""fake_dc_server.py - a malicious/broken tqkv server for libtqkv's TCP data channel
client (tests/check_client_dc_adversarial.c).

    fake_dc_server.py SCENARIO PAGE_FILE

Serves tqkv.v1.KVCache OpenChannel and Get (and grpc.health.v1.Health Check) over
insecure gRPC on 127.0.0.1 (any free port) plus its own raw TCP data listener, and
prints "listening on 127.0.0.1:PORT" once both are up. Every found block is the one
valid packed page read from PAGE_FILE (written by the C suite). SCENARIO names what it
does wrong (see SCENARIOS below); "ok" follows proto/DATA_CHANNEL.md exactly. A Get
without transport TCP (the client's fallback) is answered correctly over gRPC.

No stubs are generated: the handlers take and return raw bytes, and the few messages
involved are encoded and decoded here (proto/tqkv/v1/kvcache.proto field numbers).
The process exits when its parent does.
"""
import os
import socket
import struct
import sys
import threading
import time
from concurrent import futures

import grpc

SCENARIOS = {
    "ok": "all frames as specified, status OK",
    "ack_refused": "ack status 1 (unknown channel)",
    "ack_garbage": "8 bytes that are not an ack",
    "ack_never": "reads the hello, never answers",
    "ack_close": "closes the connection after the hello",
    "open_bad_secret": "OpenChannel answers a 5-byte secret",
    "open_hang": "OpenChannel never answers (until the client gives up)",
    "frame_magic": "first frame header starts 'XXXX'",
    "index_order": "frame 1 before frame 0",
    "index_skip": "frame 0, then frame 2",
    "layer_mismatch": "frame 0 says layer 7",
    "page_short": "found page of 64 bytes (< 128-byte header)",
    "page_huge": "found page of 2^31 bytes (> max_message_bytes)",
    "missing_with_len": "found = 0 with page_len 128",
    "flag_bits": "flags 0x3 (unknown bit 1)",
    "bad_crc": "page 0 has one byte of its body flipped",
    "len_longer": "page_len = page + 64 (64 zero bytes appended)",
    "len_shorter": "page_len = page - 64 (the page cut)",
    "truncated_header": "12 bytes of a frame header, then close",
    "truncated_page": "a header and half its page, then close",
    "close_before_frames": "closes the data socket, status OK",
    "close_then_hang": "closes the data socket, sends no status (the deadline ends it)",
    "status_ok_no_frames": "status OK, no frames, socket left open",
    "status_error_after_frames": "2 frames, then RESOURCE_EXHAUSTED",
    "hang": "no frames, no status (the client's deadline ends it)",
    "trickle": "frame header one byte per 400 ms",
    "extra_bytes": "all frames, then 40 garbage bytes, status OK",
    "extra_frame": "all frames, then a valid-looking frame 0, status OK",
    "extra_late": "all frames, status OK, 300 ms later 24 garbage bytes",
    "ack_plus_garbage": "a good ack followed at once by 24 garbage bytes",
    "reset_mid_page": "a header and half its page, RST, then UNAVAILABLE 'fake: disk died'",
    "status_error_no_frames": "NOT_FOUND 'fake: no such namespace' before any frame",
    "crc_ok_bad_format": "every page's version is 99, its CRC32C recomputed (valid)",
    "grpc_msg_on_tcp": "a GetResponse on the TCP Get's stream, then the frames",
    "tier_huge": "frames with tier 0xffffffff",
    "zero_hashes_frame": "frame index 0xffffffff",
}


# ---- protobuf, by hand ----

def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_varint(num, v):
    return varint(num << 3) + varint(v) if v else b""


def f_bytes(num, b):
    return varint(num << 3 | 2) + varint(len(b)) + b


def parse(buf):
    """{field: [values]} of a message (varints as int, length-delimited as bytes)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            v, i = bytes(buf[i:i + n]), i + n
        elif wt == 1:
            v, i = struct.unpack_from("<Q", buf, i)[0], i + 8
        elif wt == 5:
            v, i = struct.unpack_from("<I", buf, i)[0], i + 4
        else:
            raise ValueError("wire type %d" % wt)
        out.setdefault(num, []).append(v)
    return out


def read_varint(buf, i):
    v, s = 0, 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << s
        s += 7
        if not b & 0x80:
            return v, i


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc = CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    CRC_TABLE.append(_c)


def reformat(page):
    """The page with header version 99 and a CRC32C that matches (crc field as zero)."""
    p = bytearray(page)
    struct.pack_into("<H", p, 4, 99)
    struct.pack_into("<I", p, 12, 0)
    struct.pack_into("<I", p, 12, crc32c(bytes(p)))
    return bytes(p)


# ---- the server ----

class Fake:
    def __init__(self, scenario, page):
        self.sc = scenario
        self.page = page
        self.hdr = struct.unpack_from("<IHHII Q IHH", page, 0)
        self.mu = threading.Condition()
        self.chans = {}  # id -> secret
        self.socks = {}  # id -> connected, acked socket
        self.next_id = 1000
        self.dl = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.dl.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.dl.bind(("127.0.0.1", 0))
        self.dl.listen(64)
        self.keep = []  # sockets never closed (ack_never)
        threading.Thread(target=self.accept_loop, daemon=True).start()

    # raw listener: hello, ack
    def accept_loop(self):
        while True:
            s, _ = self.dl.accept()
            threading.Thread(target=self.hello, args=(s,), daemon=True).start()

    def hello(self, s):
        buf = b""
        while len(buf) < 32:
            d = s.recv(32 - len(buf))
            if not d:
                s.close()
                return
            buf += d
        magic, ver, cid = struct.unpack_from("<4sIQ", buf, 0)
        secret = buf[16:32]
        sc = self.sc
        if sc == "ack_never":
            self.keep.append(s)
            return
        if sc == "ack_close":
            s.close()
            return
        if sc == "ack_refused":
            s.sendall(b"TQKA" + struct.pack("<I", 1))
            s.close()
            return
        if sc == "ack_garbage":
            s.sendall(b"HTTP/1.1")
            s.close()
            return
        with self.mu:
            ok = magic == b"TQKH" and ver == 1 and self.chans.get(cid) == secret
            s.sendall(b"TQKA" + struct.pack("<I", 0 if ok else 1) +
                      (b"\x33" * 24 if ok and sc == "ack_plus_garbage" else b""))
            if not ok:
                s.close()
                return
            self.socks[cid] = s
            self.mu.notify_all()

    # gRPC
    def open_channel(self, req, ctx):
        if self.sc == "open_hang":
            time.sleep(max(0.0, min(ctx.time_remaining() or 10.0, 10.0)) + 0.2)
            ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "hung")
        with self.mu:
            cid = self.next_id
            self.next_id += 1
            secret = os.urandom(16)
            self.chans[cid] = secret
        if self.sc == "open_bad_secret":
            secret = secret[:5]
        return (f_varint(1, cid) + f_varint(4, self.dl.getsockname()[1]) +
                f_bytes(5, secret))

    def health(self, req, ctx):
        return f_varint(1, 1)  # SERVING

    def frame(self, index, layer, flags, tier, page_len, magic=b"TQKF"):
        return magic + struct.pack("<IIIII", index, layer, flags, tier, page_len)

    def get(self, req, ctx):
        m = parse(req)
        ns = m.get(1, [b""])[0].decode()
        hashes = m.get(2, [])
        lb = m.get(3, [0])[0]
        le = m.get(4, [0])[0]
        transport = m.get(6, [0])[0]
        cid = m.get(7, [0])[0]
        n = len(hashes)
        nt, nh, hd = self.hdr[6], self.hdr[7], self.hdr[8]
        if transport != 2:
            # the fallback: a correct PACKED gRPC Get, every block found
            for layer in range(lb, le):
                for h in hashes:
                    yield (f_bytes(1, h) + f_varint(2, layer) + f_varint(3, 1) +
                           f_bytes(4, self.page) + f_varint(7, nt) + f_varint(8, nh) +
                           f_varint(9, hd) + f_varint(10, 2))
            return
        with self.mu:
            self.mu.wait_for(lambda: cid in self.socks, timeout=3)
            s = self.socks.get(cid)
        if s is None:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown channel %d" % cid)
        sc, P = self.sc, self.page
        if sc == "crc_ok_bad_format":
            P, sc = reformat(P), "ok"
        total = n * (le - lb)

        def good(i, tier=2):
            return self.frame(i, lb + i // n, 1, tier, len(P)) + P

        if sc == "grpc_msg_on_tcp":
            yield (f_bytes(1, hashes[0]) + f_varint(2, lb) + f_varint(3, 1) + f_bytes(4, P) +
                   f_varint(7, nt) + f_varint(8, nh) + f_varint(9, hd))
        out = b""
        if sc in ("ok", "ack_plus_garbage", "extra_bytes", "extra_frame", "extra_late", "grpc_msg_on_tcp"):
            out = b"".join(good(i) for i in range(total))
            if sc == "extra_bytes":
                out += b"\xa5" * 40
            elif sc == "extra_frame":
                out += good(0)
        elif sc == "tier_huge":
            out = b"".join(good(i, 0xFFFFFFFF) for i in range(total))
        elif sc == "frame_magic":
            out = self.frame(0, lb, 1, 2, len(P), magic=b"XXXX") + P
        elif sc == "index_order":
            out = good(1) + good(0)
        elif sc == "index_skip":
            out = good(0) + good(2)
        elif sc == "zero_hashes_frame":
            out = self.frame(0xFFFFFFFF, lb, 1, 2, len(P)) + P
        elif sc == "layer_mismatch":
            out = self.frame(0, 7, 1, 2, len(P)) + P
        elif sc == "page_short":
            out = self.frame(0, lb, 1, 2, 64) + P[:64]
        elif sc == "page_huge":
            out = self.frame(0, lb, 1, 2, 1 << 31) + P
        elif sc == "missing_with_len":
            out = self.frame(0, lb, 0, 0, 128) + P[:128]
        elif sc == "flag_bits":
            out = self.frame(0, lb, 3, 2, len(P)) + P
        elif sc == "bad_crc":
            bad = bytearray(P)
            bad[len(P) // 2] ^= 0x10
            out = self.frame(0, lb, 1, 2, len(P)) + bytes(bad)
            out += b"".join(good(i) for i in range(1, total))
        elif sc == "len_longer":
            out = self.frame(0, lb, 1, 2, len(P) + 64) + P + b"\0" * 64
            out += b"".join(good(i) for i in range(1, total))
        elif sc == "len_shorter":
            out = self.frame(0, lb, 1, 2, len(P) - 64) + P[:-64]
            out += b"".join(good(i) for i in range(1, total))
        elif sc == "status_error_after_frames":
            s.sendall(good(0) + good(1))
            time.sleep(0.1)
            s.close()
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake: out of pinned memory")
        if sc == "status_error_no_frames":
            ctx.abort(grpc.StatusCode.NOT_FOUND, "fake: no such namespace")
        if sc == "reset_mid_page":
            s.sendall(self.frame(0, lb, 1, 2, len(P)) + P[:len(P) // 2])
            time.sleep(0.05)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            time.sleep(0.1)
            ctx.abort(grpc.StatusCode.UNAVAILABLE, "fake: disk died")
        if sc == "truncated_header":
            s.sendall(self.frame(0, lb, 1, 2, len(P))[:12])
            s.close()
        elif sc == "truncated_page":
            s.sendall(self.frame(0, lb, 1, 2, len(P)) + P[:len(P) // 2])
            s.close()
        elif sc in ("close_before_frames", "close_then_hang"):
            s.close()
            if sc == "close_then_hang":
                time.sleep(max(0.0, min(ctx.time_remaining() or 10.0, 10.0)) + 0.5)
        elif sc == "hang":
            time.sleep(max(0.0, min(ctx.time_remaining() or 10.0, 10.0)) + 0.5)
            return
        elif sc == "trickle":
            hdr = good(0)
            for i in range(len(hdr)):
                if not ctx.is_active():
                    return
                try:
                    s.sendall(hdr[i:i + 1])
                except OSError:
                    return
                time.sleep(0.4)
        elif out:
            try:
                s.sendall(out)
            except OSError:
                pass
        if sc == "extra_late":
            def late():
                time.sleep(0.3)
                try:
                    s.sendall(b"\x5a" * 24)
                    # the test waits for this line (the bytes are in its socket now)
                    sys.stdout.write("late bytes sent\n")
                    sys.stdout.flush()
                except OSError:
                    pass
            threading.Thread(target=late, daemon=True).start()
        # status OK after the last frame (or instead of frames, for the broken ones)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in SCENARIOS:
        sys.stderr.write("usage: fake_dc_server.py SCENARIO PAGE_FILE\nscenarios:\n")
        for k, v in SCENARIOS.items():
            sys.stderr.write("  %-26s %s\n" % (k, v))
        return 2
    with open(sys.argv[2], "rb") as f:
        page = f.read()
    fake = Fake(sys.argv[1], page)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("tqkv.v1.KVCache", {
            "OpenChannel": grpc.unary_unary_rpc_method_handler(fake.open_channel),
            "Get": grpc.unary_stream_rpc_method_handler(fake.get),
        }),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(fake.health),
        }),
    ))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sys.stdout.write("listening on 127.0.0.1:%d\n" % port)
    sys.stdout.flush()
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
