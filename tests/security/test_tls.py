#!/usr/bin/python3
"""test_tls.py - TLS and mutual TLS of a real tqkv-server, certificates made with
openssl at test time (a server CA, a server certificate with SAN 127.0.0.1/localhost,
a client CA and client certificate, and an unrelated "rogue" CA and client).

Checks: a TLS client that trusts the CA works (Put, Get round trip); a plaintext
client and a client trusting another CA fail; with --tls-client-ca, a client without
a certificate and one with a certificate from another CA fail while one with a
certificate from the client CA works; TLS and bearer tokens combine; bad PEM paths or
contents stop the server at start-up with the file named.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, pb  # noqa: E402

SC = grpc.StatusCode
SHAPE = dict(tokens=8, heads=2, dim=64)


def stats_code(channel, md=None, timeout=8):
    stub = H.pbg.KVCacheStub(channel)
    try:
        stub.Stats(pb.StatsRequest(namespace="t"), metadata=md, timeout=timeout)
        return SC.OK
    except grpc.RpcError as e:
        return e.code()


def secure(srv, pki, root="ca.pem", client=None, host="localhost"):
    kw = {"root_certificates": H.read(os.path.join(pki, root))}
    if client:
        kw["private_key"] = H.read(os.path.join(pki, client + ".key"))
        kw["certificate_chain"] = H.read(os.path.join(pki, client + ".pem"))
    creds = grpc.ssl_channel_credentials(**kw)
    opts = H.CHANNEL_OPTS + [("grpc.ssl_target_name_override", host)]
    return grpc.secure_channel(srv.addr, creds, options=opts)


def test_tls(r, pki):
    srv = H.Server("--tls-cert", os.path.join(pki, "server.pem"), "--tls-key",
                   os.path.join(pki, "server.key"), "--dram-capacity", "32M")
    ch = secure(srv, pki)
    r.check("TLS client trusting the CA: Stats OK", stats_code(ch) == SC.OK)
    # A real round trip over TLS.
    stub = H.pbg.KVCacheStub(ch)
    h = H.make_hash(1, b"tls")
    resp = stub.Put(iter([H.put_request("t", h, 0, **SHAPE)]), timeout=30)
    got = list(stub.Get(pb.GetRequest(namespace="t", hashes=[h], layer_begin=0, layer_end=1,
                                      encoding=pb.ENCODING_BF16), timeout=30))
    r.check("Put and Get round trip over TLS",
            resp.blocks_stored == 1 and len(got) == 1 and got[0].found and
            H.check_bf16_block("t", got[0], **SHAPE) is None, str(resp))
    # SAN: the server certificate also verifies as 127.0.0.1 (no override).
    creds = grpc.ssl_channel_credentials(root_certificates=H.read(os.path.join(pki, "ca.pem")))
    ch_ip = grpc.secure_channel(srv.addr, creds, options=H.CHANNEL_OPTS)
    r.check("server certificate verifies for 127.0.0.1 (SAN)", stats_code(ch_ip) == SC.OK)
    code = stats_code(grpc.insecure_channel(srv.addr), timeout=5)
    r.check("plaintext client against the TLS server fails", code != SC.OK, str(code))
    code = stats_code(secure(srv, pki, root="rogue-ca.pem"), timeout=5)
    r.check("client trusting another CA fails", code != SC.OK, str(code))
    code = stats_code(secure(srv, pki, host="not-the-server.example"), timeout=5)
    r.check("wrong server name fails verification", code != SC.OK, str(code))
    r.check("TLS server alive after the failed handshakes", srv.alive(), srv.stderr())
    r.stop(srv)


def test_mtls(r, pki):
    srv = H.Server("--tls-cert", os.path.join(pki, "server.pem"), "--tls-key",
                   os.path.join(pki, "server.key"), "--tls-client-ca",
                   os.path.join(pki, "client-ca.pem"), "--dram-capacity", "32M")
    code = stats_code(secure(srv, pki, client="client"))
    r.check("mTLS with a client certificate from the client CA: OK", code == SC.OK, str(code))
    code = stats_code(secure(srv, pki), timeout=5)
    r.check("mTLS without a client certificate fails", code != SC.OK, str(code))
    code = stats_code(secure(srv, pki, client="rogue-client"), timeout=5)
    r.check("mTLS with a certificate from another CA fails", code != SC.OK, str(code))
    code = stats_code(grpc.insecure_channel(srv.addr), timeout=5)
    r.check("plaintext client against the mTLS server fails", code != SC.OK, str(code))
    r.check("mTLS server alive after the failed handshakes", srv.alive(), srv.stderr())
    r.stop(srv)


def test_tls_with_tokens(r, pki):
    p = os.path.join(H.tmpdir(), "tls-tokens")
    with open(p, "w") as f:
        f.write("tls-token-000000001 rw t\n")
    srv = H.Server("--tls-cert", os.path.join(pki, "server.pem"), "--tls-key",
                   os.path.join(pki, "server.key"), "--auth-tokens", p)
    ch = secure(srv, pki)
    r.check("TLS + token: OK", stats_code(ch, H.md("tls-token-000000001")) == SC.OK)
    code = stats_code(ch)
    r.check("TLS without token: UNAUTHENTICATED", code == SC.UNAUTHENTICATED, str(code))
    r.stop(srv)


def test_bad_pem(r, pki):
    d = H.tmpdir()
    junk = os.path.join(d, "junk.pem")
    with open(junk, "w") as f:
        f.write("not a certificate\n")
    missing = os.path.join(d, "missing.pem")
    cert, key = os.path.join(pki, "server.pem"), os.path.join(pki, "server.key")
    for label, args, name in [
        ("missing certificate file", ["--tls-cert", missing, "--tls-key", key], missing),
        ("missing key file", ["--tls-cert", cert, "--tls-key", missing], missing),
        ("certificate that is not PEM", ["--tls-cert", junk, "--tls-key", key], junk),
        ("cert and key swapped", ["--tls-cert", key, "--tls-key", cert], key),
        ("client CA that is not PEM",
         ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", junk], junk),
    ]:
        try:
            H.Server(*args, startup_timeout=20)
            r.check(label + ": refused at start-up", False, "server started")
        except RuntimeError as e:
            r.check(label + ": refused at start-up naming the file", name in str(e),
                    str(e)[-300:])


def main():
    r = H.Runner("test_tls")
    pki = H.make_pki(os.path.join(H.tmpdir(), "pki"))
    r.run(test_tls, pki)
    r.run(test_mtls, pki)
    r.run(test_tls_with_tokens, pki)
    r.run(test_bad_pem, pki)
    r.finish()


if __name__ == "__main__":
    main()
