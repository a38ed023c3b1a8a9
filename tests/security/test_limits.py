#!/usr/bin/python3
"""test_limits.py - input limits of a real tqkv-server.

Checks: a message above --max-message-bytes gets RESOURCE_EXHAUSTED and the server
keeps serving; more hashes than the limit (65536) and malformed fields (empty
namespace, short hash, NaN in K, shape/size mismatch, bad layer range) get an error;
--ns-quota caps a namespace's stored bytes (RESOURCE_EXHAUSTED or eviction inside that
namespace) while another namespace's blocks stay intact, and with the namespace's
blocks pinned by a Lookup lease nothing can be evicted so a Put over quota gets
RESOURCE_EXHAUSTED; --max-streams bounds concurrent streams on one connection.
"""
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, pb  # noqa: E402

SC = grpc.StatusCode


def code_of(fn):
    try:
        fn()
        return SC.OK
    except grpc.RpcError as e:
        return e.code()


def test_message_size(r):
    srv = H.Server("--max-message-bytes", "1M", "--dram-capacity", "64M")
    stub = srv.stub()
    big = H.put_request("lim", H.make_hash(1), 0, tokens=256, heads=8, dim=128)  # 1 MiB K+V
    r.check("oversize Put message is over 1 MiB", big.ByteSize() > (1 << 20), str(big.ByteSize()))
    code = code_of(lambda: stub.Put(iter([big]), timeout=30))
    r.check("Put above --max-message-bytes -> RESOURCE_EXHAUSTED",
            code == SC.RESOURCE_EXHAUSTED, str(code))
    # A Lookup above the limit: 70000 hashes of 16 bytes = ~1.3 MB.
    hashes = [H.make_hash(i) for i in range(70000)]
    code = code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="lim", hashes=hashes,
                                                        num_layers=1), timeout=30))
    r.check("Lookup above --max-message-bytes -> RESOURCE_EXHAUSTED",
            code == SC.RESOURCE_EXHAUSTED, str(code))
    small = H.put_request("lim", H.make_hash(2), 0, tokens=16, heads=8, dim=128)
    resp = stub.Put(iter([small]), timeout=30)
    r.check("server still serves after oversize messages", resp.blocks_stored == 1, str(resp))
    r.check("server alive", srv.alive(), srv.stderr())
    r.stop(srv)


def test_malformed_requests(r, srv):
    stub = srv.stub()
    h = H.make_hash(3)
    too_many = [H.make_hash(i, b"many")[:8] for i in range(65537)]
    cases = {
        "Lookup with 65537 hashes": lambda: stub.Lookup(
            pb.LookupRequest(namespace="m", hashes=too_many, num_layers=1), timeout=30),
        "Get with 65537 hashes": lambda: list(stub.Get(
            pb.GetRequest(namespace="m", hashes=too_many, layer_begin=0, layer_end=1),
            timeout=30)),
        "Delete with 65537 hashes": lambda: stub.Delete(
            pb.DeleteRequest(namespace="m", hashes=too_many), timeout=30),
        "Put with an empty namespace": lambda: stub.Put(
            iter([H.put_request("", h, 0)]), timeout=30),
        "Put with a 7-byte hash": lambda: stub.Put(
            iter([H.put_request("m", h[:7], 0)]), timeout=30),
        "Get with layer_end <= layer_begin": lambda: list(stub.Get(
            pb.GetRequest(namespace="m", hashes=[h], layer_begin=3, layer_end=3), timeout=30)),
        "Lookup with a 65-byte hash": lambda: stub.Lookup(
            pb.LookupRequest(namespace="m", hashes=[b"x" * 65], num_layers=1), timeout=30),
    }
    bad = H.put_request("m", h, 0)
    k = np.frombuffer(bad.key, dtype="<u2").copy()
    k[17] = 0x7FC0  # BF16 NaN
    bad.key = k.tobytes()
    cases["Put with NaN in K"] = lambda: stub.Put(iter([bad]), timeout=30)
    short = H.put_request("m", h, 0)
    short.value = short.value[:-2]
    cases["Put with V one element short"] = lambda: stub.Put(iter([short]), timeout=30)
    huge = H.put_request("m", h, 0)
    huge.num_tokens = 1 << 20
    cases["Put with 2^20 tokens"] = lambda: stub.Put(iter([huge]), timeout=30)
    for label, fn in cases.items():
        code = code_of(fn)
        r.check(label + " -> INVALID_ARGUMENT", code == SC.INVALID_ARGUMENT, str(code))
    ok = code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="m", hashes=too_many[:65536],
                                                      num_layers=1), timeout=30))
    r.check("Lookup with exactly 65536 hashes is accepted", ok == SC.OK, str(ok))
    # Nothing of the rejected Puts was stored.
    st = stub.Stats(pb.StatsRequest(namespace="m"), timeout=30)
    r.check("rejected Puts stored nothing", st.pages == 0, str(st).replace("\n", " "))


def ns_pages(stub, ns):
    return stub.Stats(pb.StatsRequest(namespace=ns), timeout=30)


def test_quota(r):
    quota = 256 << 10
    srv = H.Server("--ns-quota", str(quota), "--dram-capacity", "64M")
    stub = srv.stub()
    shape = dict(tokens=16, heads=8, dim=128)
    keep = [H.make_hash(i, b"keep") for i in range(4)]
    resp = H.put_blocks(stub, [H.put_request("ns-b", h, 0, **shape) for h in keep])
    r.check("ns-b stores its 4 blocks", resp.blocks_stored == 4, str(resp))
    page_bytes = resp.bytes_stored // 4
    n = int(3 * quota / max(page_bytes, 1)) + 4
    codes = {}
    for i in range(n):
        h = H.make_hash(i, b"flood")
        c = code_of(lambda: stub.Put(iter([H.put_request("ns-a", h, 0, **shape)]), timeout=30))
        codes[c.name] = codes.get(c.name, 0) + 1
    st = ns_pages(stub, "ns-a")
    r.check("ns-a flooded with %d pages of %d bytes (3x its quota): only OK or "
            "RESOURCE_EXHAUSTED" % (n, page_bytes),
            set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, str(codes))
    r.check("ns-a stays within its quota", 0 < st.page_bytes <= quota,
            "page_bytes %d quota %d" % (st.page_bytes, quota))
    r.check("Stats of ns-a reports its quota", st.quota_bytes == quota,
            "quota_bytes %d" % st.quota_bytes)
    r.check("the flood was refused or evicted within ns-a",
            codes.get("RESOURCE_EXHAUSTED", 0) > 0 or st.pages < codes.get("OK", 0),
            "%s, pages %d" % (codes, st.pages))
    got = H.get_all(stub, "ns-b", keep, 0, 1)
    bad = [H.check_bf16_block("ns-b", g, **shape) for g in got if g.found]
    r.check("ns-b untouched by ns-a's quota pressure",
            len(got) == 4 and all(g.found for g in got) and not any(bad), str(bad))

    # Pin everything ns-a holds (a Lookup lease), then go over quota: nothing may be
    # evicted, so the Put must be refused.
    held = [H.make_hash(i, b"flood") for i in range(n)]
    present = [g.hash for g in H.get_all(stub, "ns-a", held, 0, 1, encoding=pb.ENCODING_PACKED)
               if g.found]
    # Lookup pins the leading present prefix: list the present hashes as one sequence.
    lk = stub.Lookup(pb.LookupRequest(namespace="ns-a", hashes=present, num_layers=1,
                                      lease_ms=60000), timeout=30)
    r.check("Lookup lease pins all %d present ns-a blocks" % len(present),
            lk.prefix_blocks == len(present), str(lk.prefix_blocks))
    extra = []
    for i in range(8):
        h = H.make_hash(i, b"over")
        extra.append(code_of(lambda: stub.Put(iter([H.put_request("ns-a", h, 0, **shape)]),
                                              timeout=30)))
    still = H.get_all(stub, "ns-a", present, 0, 1, encoding=pb.ENCODING_PACKED)
    r.check("pinned blocks survive Puts over quota", all(g.found for g in still),
            "%d of %d" % (sum(g.found for g in still), len(still)))
    r.check("Put over quota with everything pinned -> RESOURCE_EXHAUSTED",
            SC.RESOURCE_EXHAUSTED in extra, str([c.name for c in extra]))
    r.check("ns-a still within its quota", ns_pages(stub, "ns-a").page_bytes <= quota)
    r.stop(srv)


def test_max_streams(r):
    srv = H.Server("--max-streams", "2", "--dram-capacity", "128M")
    shape = dict(tokens=64, heads=8, dim=128)
    hashes = [H.make_hash(i, b"streams") for i in range(8)]
    stub = srv.stub()
    for layer in range(4):
        H.put_blocks(stub, [H.put_request("s", h, layer, **shape) for h in hashes])
    # A private subchannel pool: channels to one target otherwise share a connection.
    ch = grpc.insecure_channel(srv.addr, options=H.CHANNEL_OPTS +
                               [("grpc.use_local_subchannel_pool", 1)])
    s1 = H.pbg.KVCacheStub(ch)
    # The hashes repeated 64 times: 2048 BF16 responses (512 MiB) per stream, far more than
    # HTTP/2 flow control lets the server push ahead of a reader, so neither stream can
    # finish on its own and free its slot while the test runs.
    req = pb.GetRequest(namespace="s", hashes=hashes * 64, layer_begin=0, layer_end=4,
                        encoding=pb.ENCODING_BF16)
    # Two long Get streams, read one message each and then left open.
    g1, g2 = s1.Get(req, timeout=60), s1.Get(req, timeout=60)
    next(g1), next(g2)
    t = time.time()
    third = code_of(lambda: s1.Stats(pb.StatsRequest(namespace="s"), timeout=2))
    other = code_of(lambda: stub.Stats(pb.StatsRequest(namespace="s"), timeout=10))
    r.check("a third stream on the same connection waits (--max-streams 2)",
            third == SC.DEADLINE_EXCEEDED, "%s after %.1fs" % (third, time.time() - t))
    r.check("another connection is served meanwhile", other == SC.OK, str(other))
    g1.cancel()
    g2.cancel()
    after = code_of(lambda: s1.Stats(pb.StatsRequest(namespace="s"), timeout=10))
    r.check("the connection is usable once the streams end", after == SC.OK, str(after))
    r.check("server alive", srv.alive(), srv.stderr())
    r.stop(srv)


def main():
    r = H.Runner("test_limits")
    r.run(test_message_size)
    srv = H.Server("--dram-capacity", "64M")
    r.run(test_malformed_requests, srv)
    r.check("server alive after malformed requests", srv.alive(), srv.stderr())
    r.stop(srv)
    r.run(test_quota)
    r.run(test_max_streams)
    r.finish()


if __name__ == "__main__":
    main()
