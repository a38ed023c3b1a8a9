#!/usr/bin/python3
"""test_auth.py - bearer tokens and namespace isolation against a real tqkv-server.

Checks: health probes need no token; a missing, malformed or unknown token gets
UNAUTHENTICATED on every KV method (and the token is never echoed); a namespace that
is not granted gets PERMISSION_DENIED; read-only tokens cannot Put or Delete,
write-only tokens cannot read; a tenant can never read, delete or learn the existence
of another namespace's blocks through Lookup, Get, Delete or Stats (same answers
whether the block exists or not); the same hash in two namespaces is two blocks; a
malformed token file stops the server at start-up with FILE:LINE. A peer's hello
(tqkv-peer-hello, which starts a re-replication pass) counts only from a token with rw
on every namespace, never for the server's own node id.
"""
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, pb  # noqa: E402
from tqkv_ports import free_port  # noqa: E402  (tests/support, on the path by tqkv_harness)

SC = grpc.StatusCode
ADMIN = "admin-token-000000001"
TA = "tenant-a-token-0000001"
TB = "tenant-b-token-0000002"
RA = "reader-a-token-0000003"
WA = "writer-a-token-0000004"
SHAPE = dict(tokens=16, heads=2, dim=64)
LAYERS = 2


def token_file():
    p = os.path.join(H.tmpdir(), "tokens")
    with open(p, "w") as f:
        f.write("# test tokens\n")
        f.write("%s rw *\n" % ADMIN)
        f.write("%s rw ns-a\n" % TA)
        f.write("%s rw ns-b,ns-shared\n" % TB)
        f.write("%s r ns-a\n" % RA)
        f.write("%s w ns-a\n" % WA)
    return p


def calls(stub, ns, token, hashes):
    """One call of each KV method on ns; returns {method: code}."""
    h = hashes[:1]
    return {
        "Put": H.rpc_code(H.put_blocks, stub, [H.put_request(ns, h[0], 0, **SHAPE)], token),
        "Lookup": H.rpc_code(stub.Lookup, pb.LookupRequest(namespace=ns, hashes=h, num_layers=1),
                             metadata=H.md(token), timeout=30),
        "Get": H.rpc_code(H.get_all, stub, ns, h, 0, 1, token=token),
        "Delete": H.rpc_code(stub.Delete, pb.DeleteRequest(namespace=ns, hashes=[H.make_hash(999)]),
                             metadata=H.md(token), timeout=30),
        "Stats": H.rpc_code(stub.Stats, pb.StatsRequest(namespace=ns), metadata=H.md(token),
                            timeout=30),
    }


def test_health_needs_no_token(r, srv):
    hs = H.health_pb2_grpc.HealthStub(srv.channel())
    resp = hs.Check(H.health_pb2.HealthCheckRequest(service=""), timeout=10)
    r.check("Health.Check without a token is SERVING", resp.status == 1, str(resp))


def test_unauthenticated(r, srv):
    stub = srv.stub()
    hashes = [H.make_hash(1)]
    for label, md in [("no authorization header", None),
                      ("unknown token", (("authorization", "Bearer not-a-valid-token-123"),)),
                      ("Basic scheme", (("authorization", "Basic " + TA),)),
                      ("token without scheme", (("authorization", TA),)),
                      ("empty bearer", (("authorization", "Bearer "),)),
                      ("prefix of a valid token", (("authorization", "Bearer " + TA[:-1]),)),
                      ("valid token plus a byte", (("authorization", "Bearer " + TA + "x"),))]:
        codes = {}
        for name, fn in [
            ("Put", lambda: stub.Put(iter([H.put_request("ns-a", hashes[0], 0, **SHAPE)]),
                                     metadata=md, timeout=30)),
            ("Lookup", lambda: stub.Lookup(pb.LookupRequest(namespace="ns-a", hashes=hashes,
                                                            num_layers=1), metadata=md, timeout=30)),
            ("Get", lambda: list(stub.Get(pb.GetRequest(namespace="ns-a", hashes=hashes,
                                                        layer_begin=0, layer_end=1),
                                          metadata=md, timeout=30))),
            ("Delete", lambda: stub.Delete(pb.DeleteRequest(namespace="ns-a", hashes=hashes),
                                           metadata=md, timeout=30)),
            ("Stats", lambda: stub.Stats(pb.StatsRequest(namespace="ns-a"), metadata=md,
                                         timeout=30)),
        ]:
            try:
                fn()
                codes[name] = SC.OK
            except grpc.RpcError as e:
                codes[name] = e.code()
                if TA[:12] in (e.details() or ""):
                    r.check("%s: %s error does not echo the token" % (label, name), False,
                            e.details())
        r.check("%s -> UNAUTHENTICATED on every method" % label,
                all(c == SC.UNAUTHENTICATED for c in codes.values()), str(codes))
    # "bearer" in any case works.
    ok = H.rpc_code(stub.Stats, pb.StatsRequest(namespace="ns-a"),
                    metadata=(("authorization", "bEaReR " + TA),), timeout=30)
    r.check("scheme is case-insensitive (bEaReR)", ok == SC.OK, str(ok))


def test_permissions(r, srv):
    stub = srv.stub()
    hashes = [H.make_hash(2)]
    c = calls(stub, "ns-a", TA, hashes)
    r.check("rw token on its namespace: every method OK",
            all(v == SC.OK for v in c.values()), str(c))
    c = calls(stub, "ns-b", TA, hashes)
    r.check("rw token on another namespace: PERMISSION_DENIED everywhere",
            all(v == SC.PERMISSION_DENIED for v in c.values()), str(c))
    c = calls(stub, "ns-a", RA, hashes)
    r.check("read-only token: Put and Delete PERMISSION_DENIED",
            c["Put"] == SC.PERMISSION_DENIED and c["Delete"] == SC.PERMISSION_DENIED, str(c))
    r.check("read-only token: Lookup, Get, Stats OK",
            c["Lookup"] == SC.OK and c["Get"] == SC.OK and c["Stats"] == SC.OK, str(c))
    c = calls(stub, "ns-a", WA, hashes)
    r.check("write-only token: Put OK", c["Put"] == SC.OK, str(c))
    r.check("write-only token: Lookup and Get PERMISSION_DENIED",
            c["Lookup"] == SC.PERMISSION_DENIED and c["Get"] == SC.PERMISSION_DENIED, str(c))
    c = calls(stub, "anything-else", ADMIN, hashes)
    r.check("'*' token: every method OK on any namespace",
            all(v == SC.OK for v in c.values()), str(c))
    # Whole-server Stats (empty namespace) needs a '*' grant.
    code_t = H.rpc_code(stub.Stats, pb.StatsRequest(namespace=""), metadata=H.md(TA), timeout=30)
    code_a = H.rpc_code(stub.Stats, pb.StatsRequest(namespace=""), metadata=H.md(ADMIN), timeout=30)
    r.check("whole-server Stats: tenant PERMISSION_DENIED, admin OK",
            code_t == SC.PERMISSION_DENIED and code_a == SC.OK, "%s %s" % (code_t, code_a))


def test_isolation(r, srv):
    stub = srv.stub()
    secret = [H.make_hash(i, b"secret") for i in range(4)]
    absent = [H.make_hash(i, b"absent") for i in range(4)]
    reqs = [H.put_request("ns-a", h, l, **SHAPE) for h in secret for l in range(LAYERS)]
    resp = H.put_blocks(stub, reqs, TA)
    r.check("tenant A stores its blocks", resp.blocks_stored == len(reqs), str(resp))

    # B through its own namespace: nothing of A's is visible.
    lk = stub.Lookup(pb.LookupRequest(namespace="ns-b", hashes=secret, num_layers=LAYERS),
                     metadata=H.md(TB), timeout=30)
    r.check("B's Lookup of A's hashes in ns-b: prefix 0, no tier",
            lk.prefix_blocks == 0 and all(b.tier == pb.TIER_NONE for b in lk.blocks), str(lk))
    got = H.get_all(stub, "ns-b", secret, 0, LAYERS, token=TB)
    r.check("B's Get of A's hashes in ns-b: every block missing, no bytes",
            len(got) == len(secret) * LAYERS and
            all(not g.found and not g.page and not g.key and not g.value for g in got),
            "%d responses" % len(got))
    dl = stub.Delete(pb.DeleteRequest(namespace="ns-b", hashes=secret), metadata=H.md(TB),
                     timeout=30)
    r.check("B's Delete of A's hashes in ns-b deletes nothing", dl.pages_deleted == 0, str(dl))
    st = stub.Stats(pb.StatsRequest(namespace="ns-b"), metadata=H.md(TB), timeout=30)
    r.check("B's Stats of ns-b counts none of A's pages",
            st.pages == 0 and st.page_bytes == 0 and st.bf16_bytes == 0, str(st).replace("\n", " "))

    # B aims at ns-a: denied, with the same answer for existing and absent blocks.
    def answers(hashes):
        out = []
        for fn in [
            lambda: stub.Lookup(pb.LookupRequest(namespace="ns-a", hashes=hashes, num_layers=1),
                                metadata=H.md(TB), timeout=30),
            lambda: list(stub.Get(pb.GetRequest(namespace="ns-a", hashes=hashes, layer_begin=0,
                                                layer_end=1), metadata=H.md(TB), timeout=30)),
            lambda: stub.Delete(pb.DeleteRequest(namespace="ns-a", hashes=hashes),
                                metadata=H.md(TB), timeout=30),
            lambda: stub.Delete(pb.DeleteRequest(namespace="ns-a", all=True),
                                metadata=H.md(TB), timeout=30),
            lambda: stub.Stats(pb.StatsRequest(namespace="ns-a"), metadata=H.md(TB), timeout=30),
        ]:
            try:
                fn()
                out.append(("OK", ""))
            except grpc.RpcError as e:
                out.append((e.code().name, e.details()))
        return out
    a1, a2 = answers(secret), answers(absent)
    r.check("B on ns-a: every method PERMISSION_DENIED",
            all(c == "PERMISSION_DENIED" for c, _ in a1 + a2), str(a1))
    r.check("B on ns-a: identical answers for existing and absent blocks (no oracle)",
            a1 == a2, "%s vs %s" % (a1, a2))

    # Same hash, other namespace: a separate block.
    reqs_b = [H.put_request("ns-b", h, l, **SHAPE) for h in secret[:2] for l in range(LAYERS)]
    resp = H.put_blocks(stub, reqs_b, TB)
    r.check("B stores the same hashes in ns-b as new blocks (not duplicates)",
            resp.blocks_stored == len(reqs_b) and resp.blocks_duplicate == 0, str(resp))
    got_b = H.get_all(stub, "ns-b", secret[:2], 0, LAYERS, token=TB)
    bad = [H.check_bf16_block("ns-b", g, **SHAPE) for g in got_b if g.found]
    r.check("B reads back its own data for the shared hashes",
            sum(g.found for g in got_b) == len(reqs_b) and not any(bad), str(bad))
    dl = stub.Delete(pb.DeleteRequest(namespace="ns-b", all=True), metadata=H.md(TB), timeout=30)
    r.check("B deletes all of ns-b", dl.pages_deleted == len(reqs_b), str(dl))

    # A's blocks are untouched by all of the above.
    got = H.get_all(stub, "ns-a", secret, 0, LAYERS, token=TA)
    bad = [H.check_bf16_block("ns-a", g, **SHAPE) for g in got if g.found]
    r.check("A's blocks all present and intact afterwards",
            len(got) == len(secret) * LAYERS and all(g.found for g in got) and not any(bad),
            str(bad))
    lk = stub.Lookup(pb.LookupRequest(namespace="ns-a", hashes=secret, num_layers=LAYERS),
                     metadata=H.md(TA), timeout=30)
    r.check("A's Lookup sees the whole prefix", lk.prefix_blocks == len(secret), str(lk))


def test_bad_token_files(r):
    d = H.tmpdir()
    cases = [
        ("bad-perm", "good-token-00001 rw ns-a\nbad-token-000002 rx ns-a\n", ":2:"),
        ("missing-ns", "# c\n\ntoken-only-00003 rw\n", ":3:"),
        ("dup", "dup-token-000004 r a\ndup-token-000004 w b\n", ":2:"),
    ]
    for name, text, want in cases:
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write(text)
        try:
            H.Server("--auth-tokens", p, startup_timeout=20)
            r.check("malformed token file %s refused at start-up" % name, False, "server started")
        except RuntimeError as e:
            msg = str(e)
            r.check("malformed token file %s refused with FILE:LINE" % name,
                    (p + want) in msg, msg[-300:])
    missing = os.path.join(d, "no-such-tokens")
    try:
        H.Server("--auth-tokens", missing, startup_timeout=20)
        r.check("missing token file refused", False, "server started")
    except RuntimeError as e:
        r.check("missing token file refused, naming it", missing in str(e), str(e)[-300:])


def test_peer_hello(r):
    """A peer's hello (tqkv-peer-hello on a node-id question, service/forward.h) counts
    only from a token with rw on every namespace (the peer token), never for the server's
    own node id; the question is answered either way."""
    if H.SANITIZED:
        # The server's peers' client dials with TLS from gRPC's event-engine threads, whose
        # OpenSSL per-thread DRBGs are still held at exit (lsan.supp): LeakSanitizer
        # reported them in 5 of 5 sanitized runs without that suppression and in 1 of 13
        # with it (a stack it does not match).
        # The Release stage runs this test.
        print("SKIPPED under sanitizers: test_peer_hello (see lsan.supp)")
        return
    pki = H.make_pki(os.path.join(H.tmpdir(), "hello-pki"))
    ptok = os.path.join(H.tmpdir(), "peer-token")
    with open(ptok, "w") as f:
        f.write(ADMIN + "\n")
    dead = free_port()  # a peer address where nothing listens (tests/support/tqkv_ports.py)
    srv = H.Server("--auth-tokens", token_file(), "--dram-capacity", "32M",
                   "--tls-cert", os.path.join(pki, "server.pem"),
                   "--tls-key", os.path.join(pki, "server.key"),
                   "--peers", "127.0.0.1:%d" % dead, "--peer-ca", os.path.join(pki, "ca.pem"),
                   "--peer-token-file", ptok, "--node-id", "tqkv-h",
                   "--metrics-listen", "127.0.0.1:0", "--log-level", "info")
    try:
        mport = H.metrics_port(srv)
        t0 = time.monotonic()
        while "forwarding to peers" not in srv.stderr(full=True) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        r.check("the peers' client is up", "forwarding to peers" in srv.stderr(full=True),
                srv.stderr()[-600:])
        creds = grpc.ssl_channel_credentials(root_certificates=H.read(os.path.join(pki, "ca.pem")))
        ch = grpc.secure_channel(srv.addr, creds, options=H.CHANNEL_OPTS)
        stub = H.pbg.KVCacheStub(ch)

        def hello(token, who):
            m = (H.md(token) or ()) + (("tqkv-peer-hello", who),)
            try:
                resp = stub.Stats(pb.StatsRequest(identity_only=True), metadata=m, timeout=10)
                return resp.node_id
            except grpc.RpcError as e:
                return e.code()

        def hellos():
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % mport, timeout=10) as f:
                for line in f.read().decode().splitlines():
                    if line.startswith("tqkv_peer_hellos_total "):
                        return float(line.split()[-1])
            return -1.0

        r.check("a tenant token's hello is answered, not counted",
                hello(TA, "tqkv-x") == "tqkv-h" and hellos() == 0.0, str(hellos()))
        r.check("a hello without a token is UNAUTHENTICATED, not counted",
                hello(None, "tqkv-x") == SC.UNAUTHENTICATED and hellos() == 0.0)
        r.check("a hello of the server's own node id is not counted",
                hello(ADMIN, "tqkv-h") == "tqkv-h" and hellos() == 0.0, str(hellos()))
        r.check("the peer token's hello is counted once",
                hello(ADMIN, "tqkv-x") == "tqkv-h" and hellos() == 1.0, str(hellos()))
        ch.close()
    finally:
        r.stop(srv)


def main():
    r = H.Runner("test_auth")
    srv = H.Server("--auth-tokens", token_file(), "--dram-capacity", "64M")
    for t in (test_health_needs_no_token, test_unauthenticated, test_permissions, test_isolation):
        r.run(t, srv)
    r.check("server alive after the auth tests", srv.alive(), srv.stderr())
    r.stop(srv)
    r.run(test_bad_token_files)
    r.run(test_peer_hello)
    r.finish()


if __name__ == "__main__":
    main()
