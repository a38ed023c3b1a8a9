#!/usr/bin/python3
"""test_adversarial.py - a new user, and an attacker, against a real tqkv-server with
Python grpcio (stubs generated at test time by tests/security/tqkv_harness.py).

Inputs: every Get encoding on awkward shapes and every codec override (the BF16 Get is
compared byte for byte with `tqkv-codec decode-kv` of the PACKED page, which checks the
page CRC); the PACKED pages against `tqkv-codec encode-kv` with its defaults (one default
policy); BF16 zeros, -0, denormals, the largest finite values, one-hot vectors; codec
overrides out of range (bits 9, 2.75, NaN, Inf, -1, 4.0000005, unknown modes); a page of
keys only; Gets with duplicate hashes, layer_end at and over the limit, 10k hashes; hash
lengths 7/8/64/65, namespaces of 0/256/257 bytes. Faults: a Put stream cancelled
midway, a Get stream cancelled after its first block, 1 ms deadlines, 200 concurrent
streams on one channel, messages one byte over --max-message-bytes, a block whose Get
response cannot fit in --max-message-bytes, a Lookup whose answer cannot, a page larger
than --ns-quota or than every tier. Afterwards: reference blocks byte-identical, the
server serving, Delete/Stats/Health/reflection answers and the metrics that count the
faults. Flags: every tqkv-server flag and TQKV_* variable with a bad value exits 2
naming it.

Usage: test_adversarial.py (TQKV_SERVER, TQKV_CODEC, TQKV_SOURCE_DIR in the environment;
TQKV_SANITIZED=1 shortens the loops).
"""
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "security"))
import numpy as np  # noqa: E402

import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, health_pb2, health_pb2_grpc, pb  # noqa: E402

SC = grpc.StatusCode
IDENT = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_seed import test_seed  # noqa: E402

SEED = test_seed()
RNG = np.random.default_rng(SEED)


def codec_binary():
    p = os.environ.get("TQKV_CODEC")
    if p and os.access(p, os.X_OK):
        return p
    return os.path.join(os.path.dirname(H.server_binary()), "..", "kernels", "cli", "tqkv-codec")


def call(fn, *a, **kw):
    """(code, result or details): streams are drained into a list."""
    try:
        r = fn(*a, **kw)
        if hasattr(r, "__iter__") and not hasattr(r, "ListFields"):
            r = list(r)
        return SC.OK, r
    except grpc.RpcError as e:
        return e.code(), e.details()


def get(stub, ns, hashes, lb=0, le=1, enc=pb.ENCODING_PACKED, timeout=60):
    return call(stub.Get, pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=lb,
                                        layer_end=le, encoding=enc), timeout=timeout)


def decode_kv(page):
    """(K, V) BF16 bytes of a page by tqkv-codec decode-kv (CRC checked), or None."""
    d = H.tmpdir()
    p, k, v = (os.path.join(d, n) for n in ("adv.tqp", "adv.k", "adv.v"))
    with open(p, "wb") as f:
        f.write(page)
    r = subprocess.run([codec_binary(), "decode-kv", p, k, v], capture_output=True, timeout=60)
    if r.returncode != 0:
        return None
    return H.read(k), H.read(v)


class Ref:
    """Reference blocks of a server: put once, then compared byte for byte."""

    def __init__(self, stub, ns="adv-ref"):
        self.stub, self.ns = stub, ns
        self.hashes = [H.make_hash(i, b"ref") for i in range(4)]
        reqs = [H.put_request(ns, h, layer) for h in self.hashes for layer in range(2)]
        H.put_blocks(stub, reqs)
        code, rs = get(stub, ns, self.hashes, 0, 2)
        assert code == SC.OK and all(r.found for r in rs), (code, rs)
        self.pages = {(r.hash, r.layer): r.page for r in rs}

    def intact(self):
        code, rs = get(self.stub, self.ns, self.hashes, 0, 2)
        return (code == SC.OK and len(rs) == 8 and
                all(r.found and self.pages[(r.hash, r.layer)] == r.page for r in rs))


# ---- round trips ----

def test_shapes_and_codecs(r, srv):
    """Awkward shapes x codec overrides: PACKED pages pass decode-kv (CRC) and decode to
    exactly the BF16 the server returns, which is the block put (correlation)."""
    stub = srv.stub()
    ns = "adv-shapes"
    shapes = [(1, 1, 16), (3, 2, 96), (17, 1, 80), (5, 3, 192), (2, 1, 1024), (7, 3, 100),
              (64, 8, 128)]
    codecs = [(0, 0), (1, 1), (1.5, 2), (2.5, 1), (3.5, 2), (4, 1), (3, 2)]
    if H.SANITIZED:
        codecs = codecs[::2]
    n = bad = 0
    for (t, hh, d) in shapes:
        for bits, mode in codecs:
            h = H.make_hash(n, b"shape")
            layer = n % 5
            n += 1
            req = H.put_request(ns, h, layer, tokens=t, heads=hh, dim=d)
            req.codec.key_bits = req.codec.value_bits = bits
            req.codec.key_mode = req.codec.value_mode = mode
            code, res = call(stub.Put, iter([req]), timeout=60)
            what = "%s bits %s mode %d" % ((t, hh, d), bits, mode)
            if code != SC.OK or res.blocks_stored != 1:
                r.check("Put " + what, False, "%s %s" % (code, res))
                bad += 1
                continue
            cp, pk = get(stub, ns, [h], layer, layer + 1)
            cb, bf = get(stub, ns, [h], layer, layer + 1, pb.ENCODING_BF16)
            if cp != SC.OK or cb != SC.OK or not pk[0].found or not bf[0].found:
                r.check("Get " + what, False, "%s %s" % (cp, cb))
                bad += 1
                continue
            kv = decode_kv(pk[0].page)
            if kv is None or kv != (bf[0].key, bf[0].value):
                r.check("PACKED page of %s decodes (CRC ok) to the BF16 Get" % what, False)
                bad += 1
                continue
            err = H.check_bf16_block(ns, bf[0], t, hh, d)
            if err and bits != 1:  # 1-bit blocks correlate ~0.8 but may dip on tiny shapes
                r.check("BF16 Get of %s is the block put" % what, False, err)
                bad += 1
    r.check("%d shape/codec round trips: PACKED CRC ok, BF16 == decode(PACKED), data matches"
            % n, bad == 0)


def test_cli_defaults_are_server_pages(r, srv):
    """tqkv-codec encode-kv without codec flags writes, byte for byte, the page the
    default server stores for the same block of a middle layer: one default policy
    (kernels/policy.c) for both, norm correction and key centering on."""
    stub = srv.stub()
    ns = "adv-cli-defaults"
    d = H.tmpdir()
    kp, vp, op = (os.path.join(d, n) for n in ("cli.k", "cli.v", "cli.tqp"))
    for n, (t, hh, dim) in enumerate([(64, 2, 64), (100, 3, 128), (33, 1, 96), (256, 4, 128)]):
        h = H.make_hash(n, b"cli-defaults")
        layer = 2 + n  # past the default policy's 2 boundary layers
        req = H.put_request(ns, h, layer, tokens=t, heads=hh, dim=dim)
        code, res = call(stub.Put, iter([req]), timeout=60)
        if not r.check("put %s" % ((t, hh, dim),), code == SC.OK and res.blocks_stored == 1,
                       str(code)):
            continue
        code, rs = get(stub, ns, [h], layer, layer + 1)
        if not r.check("get %s" % ((t, hh, dim),), code == SC.OK and len(rs) == 1 and rs[0].found,
                       str(code)):
            continue
        for p, b in ((kp, req.key), (vp, req.value)):
            with open(p, "wb") as f:
                f.write(b)
        p = subprocess.run([codec_binary(), "encode-kv", "--tokens", str(t), "--heads", str(hh),
                            "--dim", str(dim), kp, vp, op], capture_output=True, timeout=60)
        page = H.read(op) if p.returncode == 0 else b""
        r.check("encode-kv defaults = the server's page for %s" % ((t, hh, dim),),
                p.returncode == 0 and page == rs[0].page,
                "rc %d, %d vs %d bytes: %s" % (p.returncode, len(page), len(rs[0].page),
                                               p.stderr.decode(errors="replace")[-300:]))


def test_special_values(r, srv):
    """Zeros, -0, denormals, the largest finite BF16, one-hot: stored, finite on the way
    back, pages valid."""
    stub = srv.stub()
    ns = "adv-special"
    t, hh, d = 16, 2, 128
    n = t * hh * d
    idx = np.arange(n)
    sign = (RNG.integers(0, 2, n) << 15).astype(np.uint16)
    cases = {
        "zeros": np.zeros(n, np.uint16),
        "negative zeros": np.full(n, 0x8000, np.uint16),
        "denormals": RNG.integers(1, 0x7F, n).astype(np.uint16) | sign,
        "largest finite": np.full(n, 0x7F7F, np.uint16),
        "+-largest finite": np.full(n, 0x7F7F, np.uint16) | sign,
        "smallest normal": np.full(n, 0x0080, np.uint16),
        "one-hot": np.where(idx % d == 0, 0x3F80, 0).astype(np.uint16),
        "one huge among denormals": np.where(idx == 5, 0x7F7F, 0x0001).astype(np.uint16),
    }
    for i, (name, bits) in enumerate(cases.items()):
        h = H.make_hash(i, b"special")
        raw = bits.astype("<u2").tobytes()
        req = pb.PutRequest(namespace=ns, hash=h, layer=3, num_tokens=t, num_kv_heads=hh,
                            head_dim=d, key=raw, value=raw)
        code, res = call(stub.Put, iter([req]))
        if not r.check("Put of %s accepted" % name, code == SC.OK, "%s %s" % (code, res)):
            continue
        cp, pk = get(stub, ns, [h], 3, 4)
        cb, bf = get(stub, ns, [h], 3, 4, pb.ENCODING_BF16)
        ok = cp == SC.OK and cb == SC.OK and pk[0].found and bf[0].found
        kv = decode_kv(pk[0].page) if ok else None
        out = H.bf16_to_f32(bf[0].key) if ok else None
        inp = H.bf16_to_f32(raw)
        r.check("%s: page valid, BF16 Get == decode(page), all finite" % name,
                ok and kv == (bf[0].key, bf[0].value) and np.isfinite(out).all()
                and np.isfinite(H.bf16_to_f32(bf[0].value)).all())
        if ok and np.abs(inp).max() == 0:
            r.check("%s decode to zeros" % name, np.abs(out).max() == 0, str(np.abs(out).max()))
        elif ok:
            r.check("%s: largest decoded magnitude within 2x of the input's" % name,
                    np.abs(out).max() <= 2 * np.abs(inp).max(),
                    "%g vs %g" % (np.abs(out).max(), np.abs(inp).max()))


# ---- malformed requests ----

def test_codec_overrides(r, srv, ref):
    stub = srv.stub()
    ns = "adv-codec"
    IA = SC.INVALID_ARGUMENT
    for bits, shown in [(9, "9"), (2.75, "2.75"), (float("nan"), "nan"), (float("inf"), "inf"),
                        (-1, "-1"), (0.5, "0.5"),
                        (4.0000005, "4.00000048")]:  # was printed "4", the message read
        #                                              "4 is not a supported bit width (..., 4)"
        for field in ("key_bits", "value_bits"):
            req = H.put_request(ns, H.make_hash(0, b"cdc"), 0)
            setattr(req.codec, field, bits)
            code, det = call(stub.Put, iter([req]))
            r.check("codec.%s=%s -> INVALID_ARGUMENT naming the field and the value" % (
                field, shown), code == IA and ("codec." + field) in det and shown in det,
                "%s %s" % (code, det))
    for mode in (4, -1, 1 << 30):  # 3 is MODE_LOSSLESS
        for field in ("key_mode", "value_mode"):
            req = H.put_request(ns, H.make_hash(0, b"cdc"), 0)
            setattr(req.codec, field, mode)
            code, det = call(stub.Put, iter([req]))
            r.check("codec.%s=%d -> INVALID_ARGUMENT" % (field, mode),
                    code == IA and ("codec." + field) in det, "%s %s" % (code, det))
    code, st = call(stub.Stats, pb.StatsRequest(namespace=ns))
    r.check("rejected overrides stored nothing", code == SC.OK and st.pages == 0, str(st))
    r.check("reference blocks intact after bad overrides", ref.intact())


def test_get_requests(r, srv, ref):
    stub = srv.stub()
    ns, hs = ref.ns, ref.hashes
    IA = SC.INVALID_ARGUMENT
    req = [hs[0], hs[0], hs[1], hs[0]]
    code, rs = get(stub, ns, req, 0, 2)
    r.check("duplicate hashes: one answer per (layer, listed hash), layer-major, in order",
            code == SC.OK and [(x.hash, x.layer) for x in rs] ==
            [(h, layer) for layer in (0, 1) for h in req] and all(x.found for x in rs))
    code, rs = get(stub, ns, hs[:1], 1, 1024)
    r.check("layer_end 1024 (the limit): 1023 answers, layer 1 found, the rest missing",
            code == SC.OK and len(rs) == 1023 and rs[0].found and not any(x.found for x in rs[1:]),
            str(code))
    for lb, le, field in ((1, 1025, "layer_end"), (2, 1, "layer_end"), (5, 5, "layer_end"),
                          ((1 << 32) - 2, (1 << 32) - 1, "layer_end")):
        code, det = get(stub, ns, hs[:1], lb, le)
        r.check("Get layers [%d, %d) -> INVALID_ARGUMENT naming %s" % (lb, le, field),
                code == IA and field in det, "%s %s" % (code, det))
    many = [H.make_hash(i, b"many") for i in range(10000)]
    code, rs = get(stub, ns, many + hs, 0, 1)
    r.check("Get of 10004 hashes: 10004 answers, exactly the 4 stored found",
            code == SC.OK and len(rs) == 10004 and sum(x.found for x in rs) == 4
            and all(x.found for x in rs[-4:]), str(code))
    code, lk = call(stub.Lookup, pb.LookupRequest(namespace=ns, hashes=hs + many, num_layers=2))
    r.check("Lookup of 10004 hashes: prefix 4", code == SC.OK and lk.prefix_blocks == 4
            and len(lk.blocks) == 10004, str(code))
    for n, ok in ((7, False), (8, True), (64, True), (65, False)):
        h = bytes([n]) * n
        pc, pdet = call(stub.Put, iter([H.put_request("adv-hash", h, 0)]))
        gc, gdet = get(stub, "adv-hash", [h])
        if ok:
            r.check("%d-byte hash: Put and Get work" % n,
                    pc == SC.OK and gc == SC.OK and gdet[0].found and gdet[0].hash == h)
        else:
            r.check("%d-byte hash: Put and Get -> INVALID_ARGUMENT naming it" % n,
                    pc == IA and gc == IA and "hash" in pdet and "hashes[0]" in gdet,
                    "%s %s / %s %s" % (pc, pdet, gc, gdet))
    for nsx, ok in (("n" * 256, True), ("n" * 257, False), ("", False)):
        pc, pdet = call(stub.Put, iter([H.put_request(nsx, hs[0], 0)]))
        r.check("namespace of %d bytes: %s" % (len(nsx), "accepted" if ok else "refused"),
                (pc == SC.OK) if ok else (pc == IA and "namespace" in pdet), str(pdet))
    r.check("reference blocks intact after odd Gets", ref.intact())


def test_page_put_needs_keys_and_values(r, srv, ref):
    """A page of keys only (what `tqkv-codec encode` writes) was stored as a block,
    counted by Lookup, then refused by decode-kv and attention on the consumer."""
    stub = srv.stub()
    d_ = H.tmpdir()
    vp, pp = os.path.join(d_, "konly.bf16"), os.path.join(d_, "konly.tqp")
    with open(vp, "wb") as f:
        f.write(H.bf16_bytes(RNG.standard_normal((16, 128), dtype=np.float32)))
    subprocess.run([codec_binary(), "encode", "--dim", "128", "--bits", "3", vp, pp],
                   check=True, capture_output=True, timeout=60)
    h = H.make_hash(0, b"konly")
    req = pb.PutRequest(namespace="adv-konly", hash=h, layer=0, num_tokens=16, num_kv_heads=1,
                        head_dim=128, page=H.read(pp))
    code, det = call(stub.Put, iter([req]))
    r.check("Put of a keys-only page -> INVALID_ARGUMENT 'page: holds no values'",
            code == SC.INVALID_ARGUMENT and "page: holds no values" in det, "%s %s" % (code, det))
    lk = stub.Lookup(pb.LookupRequest(namespace="adv-konly", hashes=[h], num_layers=1),
                     timeout=10)
    r.check("the keys-only page was not stored", lk.prefix_blocks == 0, str(lk))
    r.check("reference blocks intact after the keys-only page", ref.intact())


# ---- faults ----

def test_faults(r, srv, ref):
    stub = srv.stub()
    ns = "adv-fault"
    # A Put stream cancelled midway: the blocks sent before stay, nothing half-written.
    go = threading.Event()

    def gen():
        for i in range(5):
            yield H.put_request(ns, H.make_hash(i, b"cx"), 0, tokens=64, heads=8, dim=128)
        go.wait(10)
        for i in range(5, 10):
            yield H.put_request(ns, H.make_hash(i, b"cx"), 0, tokens=64, heads=8, dim=128)

    fut = stub.Put.future(gen(), timeout=60)
    time.sleep(0.5)
    fut.cancel()
    go.set()
    cx = [H.make_hash(i, b"cx") for i in range(10)]
    code, rs = get(stub, ns, cx, 0, 1, pb.ENCODING_BF16)
    bad = [H.check_bf16_block(ns, x, 64, 8, 128) for x in rs if x.found] if code == SC.OK else [1]
    r.check("Put cancelled midway: server up, every stored block is the block sent",
            srv.alive() and code == SC.OK and not any(bad), str(bad))
    r.check("reference blocks intact after a cancelled Put", ref.intact())

    # A Get stream cancelled after its first block.
    big = [H.make_hash(i, b"big") for i in range(24)]
    H.put_blocks(stub, [H.put_request(ns, h, 0, tokens=64, heads=8, dim=128) for h in big])
    it = stub.Get(pb.GetRequest(namespace=ns, hashes=big, layer_begin=0, layer_end=1,
                                encoding=pb.ENCODING_BF16), timeout=60)
    first = next(it)
    it.cancel()
    r.check("Get cancelled after its first block: the block was right",
            first.found and H.check_bf16_block(ns, first, 64, 8, 128) is None)
    r.check("reference blocks intact after a cancelled Get", ref.intact())

    # 1 ms deadlines on every method.
    codes = set()
    for i in range(10):
        codes.add(get(stub, ns, big, 0, 1, pb.ENCODING_BF16, timeout=0.001)[0])
        codes.add(call(stub.Put, iter([H.put_request(ns, H.make_hash(i, b"dl"), 0)]),
                       timeout=0.001)[0])
        codes.add(call(stub.Lookup, pb.LookupRequest(namespace=ns, hashes=big, num_layers=1),
                       timeout=0.001)[0])
    r.check("1 ms deadlines: only OK or DEADLINE_EXCEEDED",
            codes <= {SC.OK, SC.DEADLINE_EXCEEDED}, str(codes))
    r.check("reference blocks intact after 1 ms deadlines", ref.intact())

    # 200 concurrent streams on one channel: every one completes correctly.
    ch = srv.channel()
    s2 = H.pbg.KVCacheStub(ch)
    res = []
    lock = threading.Lock()

    def worker(i):
        try:
            if i % 2:
                enc = pb.ENCODING_BF16 if i % 4 == 1 else pb.ENCODING_PACKED
                rs = list(s2.Get(pb.GetRequest(namespace=ns, hashes=big[:6], layer_begin=0,
                                               layer_end=1, encoding=enc), timeout=120))
                ok = len(rs) == 6 and all(x.found for x in rs) and (
                    enc == pb.ENCODING_PACKED or
                    all(H.check_bf16_block(ns, x, 64, 8, 128) is None for x in rs))
            else:
                rp = s2.Put(iter([H.put_request(ns, H.make_hash(i, b"cc"), 0, tokens=32)]),
                            timeout=120)
                ok = rp.blocks_stored + rp.blocks_duplicate == 1
        except grpc.RpcError as e:
            ok = "%s %s" % (e.code(), e.details())
        with lock:
            res.append(ok)

    nthreads = 100 if H.SANITIZED else 200
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(180)
    r.check("%d concurrent streams on one channel all succeed with the right data" % nthreads,
            len(res) == nthreads and all(x is True for x in res),
            str([x for x in res if x is not True][:3]))
    ch.close()
    r.check("reference blocks intact after 200 streams", ref.intact())

    # Messages one byte under, at and over --max-message-bytes (1 MiB here).
    raw_put = srv.channel().stream_unary("/tqkv.v1.KVCache/Put", **IDENT)
    for extra, want in ((0, SC.INVALID_ARGUMENT), (1, SC.RESOURCE_EXHAUSTED),
                        (4096, SC.RESOURCE_EXHAUSTED)):
        body = (1 << 20) + extra - 4  # field 8 (key): tag, 3-byte length, bytes
        msg = b"\x42" + bytes([0x80 | (body & 0x7F), 0x80 | ((body >> 7) & 0x7F), body >> 14])
        msg += b"\0" * body
        code, det = call(raw_put, iter([msg]), timeout=30)
        r.check("Put message of max%+d bytes -> %s" % (extra, want.name), code == want,
                "%s %s" % (code, det))
    r.check("reference blocks intact after oversize messages", ref.intact())
    r.check("server alive after the faults", srv.alive(), srv.stderr())


def test_response_over_max_message(r):
    """A page whose Get response cannot fit in --max-message-bytes: PACKED (the page Put
    at exactly the limit; the response carries 3 more bytes) and BF16 (decoded, 4x the
    page). Was: gRPC's "Sent message larger than max (N vs. M)" naming neither the block
    nor what to do (and the BF16 block decoded for nothing)."""
    rng = np.random.default_rng(SEED + 1)
    t, hh, d = 1024, 2, 128
    d_ = H.tmpdir()
    kp, vp, pp = (os.path.join(d_, n) for n in ("big.k", "big.v", "big.tqp"))
    with open(kp, "wb") as f:
        f.write(H.bf16_bytes(rng.standard_normal((t, hh, d), dtype=np.float32)))
    with open(vp, "wb") as f:
        f.write(H.bf16_bytes(rng.standard_normal((t, hh, d), dtype=np.float32)))
    subprocess.run([codec_binary(), "encode-kv", "--tokens", str(t), "--heads", str(hh),
                    "--dim", str(d), "--key-bits", "2", "--value-bits", "2", kp, vp, pp],
                   check=True, capture_output=True, timeout=60)
    page = H.read(pp)
    h = H.make_hash(1, b"edge")
    req = pb.PutRequest(namespace="e", hash=h, layer=0, num_tokens=t, num_kv_heads=hh,
                        head_dim=d, page=page)
    limit = req.ByteSize()  # the Put is exactly at the limit
    srv = H.Server("--threads", "2", "--encoder-threads", "2", "--max-message-bytes", str(limit))
    stub = srv.stub()
    small = H.make_hash(2, b"edge")
    code, res = call(stub.Put, iter([req, H.put_request("e", small, 0)]))
    r.check("page Put of exactly --max-message-bytes (%d) accepted" % limit,
            code == SC.OK and res.blocks_stored == 2, "%s %s" % (code, res))
    for enc, name in ((pb.ENCODING_PACKED, "PACKED"), (pb.ENCODING_BF16, "BF16")):
        it = stub.Get(pb.GetRequest(namespace="e", hashes=[small, h, small], layer_begin=0,
                                    layer_end=1, encoding=enc), timeout=30)
        got = []
        try:
            for m in it:
                got.append(m)
            code, det = SC.OK, ""
        except grpc.RpcError as e:
            code, det = e.code(), e.details()
        r.check("%s Get: RESOURCE_EXHAUSTED naming the block, the size and the limit" % name,
                code == SC.RESOURCE_EXHAUSTED and "hashes[1]" in det and name in det
                and "--max-message-bytes %d" % limit in det, "%s %s" % (code, det))
        r.check("%s Get: the block before it was delivered" % name,
                len(got) == 1 and got[0].found and got[0].hash == small, str(len(got)))
        if enc == pb.ENCODING_BF16:
            r.check("BF16 message points to ENCODING_PACKED", "ENCODING_PACKED" in det, det)
    code, rs = get(stub, "e", [small], enc=pb.ENCODING_BF16)
    r.check("server serves after the oversize responses",
            code == SC.OK and rs[0].found and H.check_bf16_block("e", rs[0], 16, 2, 64) is None)
    r.stop(srv, "max-message server")


def test_lookup_response_over_max_message(r):
    """A Lookup answers every hash with its tier, so its response is larger than the
    request: 992 hashes of 64 bytes fit in a 64 KiB request and not in the response
    (was gRPC's bare "Sent message larger than max")."""
    srv = H.Server("--threads", "2", "--encoder-threads", "2", "--max-message-bytes", "64K")
    stub = srv.stub()
    h0 = bytes(64)
    H.put_blocks(stub, [H.put_request("adv-lk", h0, 0)])
    hs = [h0] + [i.to_bytes(64, "little") for i in range(1, 992)]
    req = pb.LookupRequest(namespace="adv-lk", hashes=hs, num_layers=1, lease_ms=60000)
    code, det = call(stub.Lookup, req, timeout=30)
    r.check("Lookup of 992 64-byte hashes (request %d bytes) -> RESOURCE_EXHAUSTED saying so"
            % req.ByteSize(), code == SC.RESOURCE_EXHAUSTED and "send fewer hashes" in det
            and "--max-message-bytes 65536" in det, "%s %s" % (code, det))
    code, lk = call(stub.Lookup, pb.LookupRequest(namespace="adv-lk", hashes=hs[:900],
                                                  num_layers=1), timeout=30)
    r.check("Lookup of 900 such hashes answers", code == SC.OK and lk.prefix_blocks == 1
            and len(lk.blocks) == 900, str(code))
    r.stop(srv, "64K server")


def test_page_larger_than_store(r):
    """A page larger than the namespace quota or than every tier was refused with "nothing
    may be evicted (every candidate is leased by a Lookup, read, or the parent of a kept
    block ...)": nothing was leased, the page can never fit."""
    for args, want in ((["--ns-quota", "4K"], "its quota is 4096 bytes (--ns-quota)"),
                       (["--dram-capacity", "4K"], "larger than every tier (--dram-capacity 4096")):
        srv = H.Server("--threads", "2", "--encoder-threads", "2", *args)
        stub = srv.stub()
        h = H.make_hash(0, b"huge")
        code, det = call(stub.Put, iter([H.put_request("adv-big", h, 0, tokens=64, dim=128)]))
        r.check("%s: a page that can never fit -> RESOURCE_EXHAUSTED saying why" % " ".join(args),
                code == SC.RESOURCE_EXHAUSTED and want in det, "%s %s" % (code, det))
        code, rs = get(stub, "adv-big", [h])
        r.check("%s: nothing stored, server serving" % " ".join(args),
                code == SC.OK and not rs[0].found)
        r.stop(srv, "server %s" % " ".join(args))


# ---- the other methods, reflection, metrics ----

def test_other_methods(r, srv, ref):
    stub = srv.stub()
    ns = "adv-del"
    hs = [H.make_hash(i, b"del") for i in range(3)]
    H.put_blocks(stub, [H.put_request(ns, h, layer) for h in hs for layer in range(2)])
    code, d = call(stub.Delete, pb.DeleteRequest(namespace=ns, hashes=[hs[0], hs[0]]))
    r.check("Delete of a duplicated hash: its 2 layers, once", code == SC.OK and
            d.pages_deleted == 2, str(d))
    code, d = call(stub.Delete, pb.DeleteRequest(namespace=ns, hashes=[hs[0]]))
    r.check("Delete again: OK, 0 pages", code == SC.OK and d.pages_deleted == 0, str(d))
    code, d = call(stub.Delete, pb.DeleteRequest(namespace=ns, hashes=[hs[1], b"short"]))
    r.check("Delete with one bad hash -> INVALID_ARGUMENT, nothing deleted",
            code == SC.INVALID_ARGUMENT and "hashes[1]" in d and
            stub.Lookup(pb.LookupRequest(namespace=ns, hashes=hs[1:], num_layers=2),
                        timeout=10).prefix_blocks == 2, str(d))
    code, d = call(stub.Delete, pb.DeleteRequest(namespace="adv-never", all=True))
    r.check("Delete all of an empty namespace -> NOT_FOUND naming it",
            code == SC.NOT_FOUND and "adv-never" in d, str(d))
    code, d = call(stub.Delete, pb.DeleteRequest(namespace=ns, all=True, hashes=[hs[1]]))
    r.check("Delete all with hashes -> INVALID_ARGUMENT", code == SC.INVALID_ARGUMENT, str(d))
    code, st = call(stub.Stats, pb.StatsRequest(namespace="adv-never"))
    r.check("Stats of an unknown namespace: OK, 0 pages", code == SC.OK and st.pages == 0)
    code, st = call(stub.Stats, pb.StatsRequest(namespace=ns))
    r.check("Stats of the namespace: 4 pages left", code == SC.OK and st.pages == 4, str(st))
    hst = health_pb2_grpc.HealthStub(srv.channel())
    code, hc = call(hst.Check, health_pb2.HealthCheckRequest(service=""), timeout=10)
    r.check("Health.Check('') SERVING", code == SC.OK and hc.status == 1, str(hc))
    code, hc = call(hst.Check, health_pb2.HealthCheckRequest(service="tqkv.v1.KVCache"),
                    timeout=10)
    r.check("Health.Check(tqkv.v1.KVCache) SERVING", code == SC.OK and hc.status == 1)
    code, hc = call(hst.Check, health_pb2.HealthCheckRequest(service="nope" * 1000), timeout=10)
    r.check("Health.Check(unknown) NOT_FOUND", code == SC.NOT_FOUND, str(code))
    # Reflection with raw bytes: list_services (field 7), symbols (field 4), an
    # unsupported kind (all_extension_numbers_of_type, field 6), an empty request, garbage.
    for path in ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                 "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        refl = srv.channel().stream_stream(path, **IDENT)
        code, out = call(refl, iter([b"\x3a\x01*", b"\x22\x0ftqkv.v1.KVCache",
                                     b"\x22\x05nope.", b"\x32\x03abc", b""]), timeout=10)
        ok = code == SC.OK and len(out) == 5
        r.check("%s: 5 answers (services, file, 3 errors)" % path.split("/")[1],
                ok and b"tqkv.v1.KVCache" in out[0] and b"kvcache.proto" in out[1]
                and b"symbol not found" in out[2] and b"not supported" in out[3]
                and b"not supported" in out[4],
                "%s %s" % (code, [o[:40] for o in out] if isinstance(out, list) else out))
        code, det = call(refl, iter([b"\xff\xff\xff"]), timeout=10)
        r.check("reflection garbage -> INVALID_ARGUMENT", code == SC.INVALID_ARGUMENT, str(code))
    r.check("reference blocks intact after Delete/Stats/Health/reflection", ref.intact())


def test_metrics(r, srv):
    port = None
    for line in srv.stdout_lines:
        m = re.search(r"metrics on port (\d+)", line)
        if m:
            port = int(m.group(1))
    if not r.check("metrics port reported", port is not None, str(srv.stdout_lines)):
        return
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()

    def val(series):
        m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    r.check("metrics count the cancelled Puts/Gets",
            (val('tqkv_requests_total{method="Put",code="CANCELLED"}') or 0) >= 1 and
            (val('tqkv_requests_total{method="Get",code="CANCELLED"}') or 0) >= 1)
    r.check("metrics count the INVALID_ARGUMENT Puts and Gets",
            (val('tqkv_requests_total{method="Put",code="INVALID_ARGUMENT"}') or 0) >= 10 and
            (val('tqkv_requests_total{method="Get",code="INVALID_ARGUMENT"}') or 0) >= 4)
    deadline = time.time() + 10
    while val("tqkv_active_streams") not in (0.0,) and time.time() < deadline:
        time.sleep(0.2)
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port,
                                      timeout=10).read().decode()
    r.check("no stream left active after the faults", val("tqkv_active_streams") == 0,
            str(val("tqkv_active_streams")))
    r.check("every line parses as Prometheus text",
            all(re.match(r"^(#.*|[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? [-+0-9.eEInfa]+)$", ln)
                for ln in text.splitlines() if ln), "")


# ---- flags ----

BAD_FLAGS = [
    ("--listen", "127.0.0.1:99999"), ("--listen", "[::1"), ("--listen", "::1:50051"),
    ("--listen", "a b:1"), ("--metrics-listen", "[]:9090"), ("--threads", "0"),
    ("--encoder-threads", "x"),
    ("--dram-capacity", "-1G"), ("--hbm-capacity", "1.5G"), ("--hbm-standin", "=maybe"),
    ("--device", "-2"), ("--max-message-bytes", "3G"), ("--max-streams", "0"),
    ("--key-bits", "2.75"), ("--value-bits", "nan"), ("--key-mode", "PROD"),
    ("--value-mode", "x"), ("--boundary-layers", "513"), ("--boundary-key-bits", "9"),
    ("--boundary-value-bits", "0"), ("--rotation", "none"), ("--norm-correction", "=2"),
    ("--key-centering", "=maybe"), ("--seed", "18446744073709551616"),
    ("--namespace-policy", "nocolon"), ("--eviction", "fifo"), ("--ns-quota", "1Q"),
    ("--verify-crc", "=0x"), ("--metrics-listen", "127.0.0.1:-1"),
    ("--drain-seconds", "3601"), ("--log-level", "trace"), ("--log-format", "xml"),
]


def test_flags(r):
    """Bad values exit 2 naming the flag or variable. Hosts that are not a name, an IPv4
    address or [IPv6] ("[::1", "::1:50051", "a b:1") were accepted and failed later with
    exit 1 "cannot bind (address in use or invalid)"."""
    srv = H.server_binary()
    env0 = {k: v for k, v in os.environ.items() if not k.startswith("TQKV_")}
    for flag, value in BAD_FLAGS:
        args = [flag + value] if value.startswith("=") else [flag, value]
        p = subprocess.run([srv, "--listen", "127.0.0.1:0"] + args, capture_output=True,
                           text=True, timeout=20, env=env0)
        r.check("%s -> exit 2 naming the flag" % " ".join(args),
                p.returncode == 2 and flag in p.stderr, "rc %d: %s" % (p.returncode, p.stderr))
        var = "TQKV_" + flag[2:].upper().replace("-", "_")
        env = dict(env0)
        env[var] = value.lstrip("=")
        p = subprocess.run([srv], capture_output=True, text=True, timeout=20, env=env)
        r.check("%s=%s -> exit 2 naming the variable" % (var, env[var]),
                p.returncode == 2 and var in p.stderr, "rc %d: %s" % (p.returncode, p.stderr))
    # A token file that cannot be read: start-up fails (exit 1) naming the setting and
    # the path (the message named only the path, which may come from TQKV_AUTH_TOKENS).
    missing = os.path.join(H.tmpdir(), "no-such-tokens")
    for args, env in ((["--auth-tokens", missing], env0),
                      ([], dict(env0, TQKV_AUTH_TOKENS=missing))):
        p = subprocess.run([srv, "--listen", "127.0.0.1:0"] + args, capture_output=True,
                           text=True, timeout=20, env=env)
        r.check("unreadable token file (%s) -> exit 1 naming --auth-tokens and the path" %
                ("flag" if args else "variable"), p.returncode == 1 and
                ("--auth-tokens " + missing) in p.stderr, "rc %d: %s" % (p.returncode, p.stderr))
    for flag in ("--listen", "--threads", "--seed"):
        p = subprocess.run([srv, flag], capture_output=True, text=True, timeout=20, env=env0)
        r.check("%s without a value -> exit 2 naming it" % flag,
                p.returncode == 2 and flag in p.stderr, p.stderr)


def main():
    r = H.Runner("test_adversarial")
    srv = H.Server("--threads", "2", "--encoder-threads", "2", "--max-message-bytes", "1M",
                   "--metrics-listen", "127.0.0.1:0")
    ref = Ref(srv.stub())
    r.run(test_flags)
    r.run(test_shapes_and_codecs, srv)
    r.run(test_cli_defaults_are_server_pages, srv)
    r.run(test_special_values, srv)
    r.run(test_codec_overrides, srv, ref)
    r.run(test_get_requests, srv, ref)
    r.run(test_page_put_needs_keys_and_values, srv, ref)
    r.run(test_faults, srv, ref)
    r.run(test_other_methods, srv, ref)
    r.run(test_metrics, srv)
    r.run(test_response_over_max_message)
    r.run(test_page_larger_than_store)
    r.run(test_lookup_response_over_max_message)
    r.check("reference blocks intact at the end", ref.intact())
    r.stop(srv)
    r.finish()


if __name__ == "__main__":
    main()
