#!/usr/bin/python3
"""test_dc_tls.py - TLS on the TCP data channel of a real tqkv-server (--tls-cert with
--data-listen), driven the way a new user would: Python grpcio over TLS for the control
path, Python's ssl module on a plain socket for the data port (byte formats in
transport/data_frame.h; protocol in proto/DATA_CHANNEL.md).

Checks: OpenChannel over TLS says data_tls; a TLS client that trusts the CA attaches
(TLS 1.3, AES-128-GCM chosen by the server) and its TCP Gets carry pages
byte-identical to PACKED gRPC Gets, reusably; a plaintext hello on the TLS data port
gets no ack and attaches nothing (the channel still attaches over TLS afterwards); a
client trusting another CA or expecting another name fails its handshake; a wrong
secret over TLS is refused (ack 1); with --tls-client-ca a client without a
certificate or with one from another CA gets no ack while one from the client CA is
served; with tokens, a Get on a channel opened under another token is refused
(FAILED_PRECONDITION, as on plain channels); the
server stays up and every block stored stays readable through all of it.
"""
import os
import json
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, pb  # noqa: E402

SC = grpc.StatusCode
SHAPE = dict(tokens=16, heads=2, dim=64)
HELLO = struct.Struct("<4sIQ16s")
ACK = struct.Struct("<4sI")
FRAME = struct.Struct("<4sIIIII")
ACK_OK, ACK_UNKNOWN = 0, 1


def secure_stub(srv, pki, client=None):
    kw = {"root_certificates": H.read(os.path.join(pki, "ca.pem"))}
    if client:
        kw["private_key"] = H.read(os.path.join(pki, client + ".key"))
        kw["certificate_chain"] = H.read(os.path.join(pki, client + ".pem"))
    creds = grpc.ssl_channel_credentials(**kw)
    ch = grpc.secure_channel(srv.addr, creds, options=H.CHANNEL_OPTS)
    return H.pbg.KVCacheStub(ch)


def tls_context(pki, root="ca.pem", client=None):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(os.path.join(pki, root))
    if client:
        ctx.load_cert_chain(os.path.join(pki, client + ".pem"), os.path.join(pki, client + ".key"))
    return ctx


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        b = s.recv(min(n - len(buf), 1 << 20))
        if not b:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += b
    return bytes(buf)


def attach(port, chan, ctx=None, name="127.0.0.1", secret=None):
    """Connects (TLS when ctx), sends the hello; returns (socket, ack status or None)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    s = ctx.wrap_socket(raw, server_hostname=name) if ctx else raw
    s.sendall(HELLO.pack(b"TQKH", 1, chan.channel_id, secret or chan.channel_secret))
    try:
        magic, status = ACK.unpack(recv_exact(s, ACK.size))
        return s, (status if magic == b"TQKA" else None)
    except (EOFError, ConnectionResetError, ssl.SSLError, socket.timeout):
        return s, None


def tcp_get(stub, s, chan, ns, hashes, token=None):
    """A Get over the channel: the pages (None for a miss) and the call's status."""
    it = stub.Get(pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0, layer_end=1,
                                transport=pb.TRANSPORT_TCP, channel_id=chan.channel_id),
                  timeout=30, metadata=H.md(token))
    pages = []
    try:
        msgs = list(it)
    except grpc.RpcError as e:
        return pages, e.code()
    if msgs:
        return pages, "gRPC messages on a TCP Get"
    for _ in hashes:
        magic, idx, layer, flags, tier, plen = FRAME.unpack(recv_exact(s, FRAME.size))
        if magic != b"TQKF":
            return pages, "bad frame"
        pages.append(recv_exact(s, plen) if flags & 1 else None)
    return pages, SC.OK


def packed_pages(stub, ns, hashes, token=None):
    out = []
    for m in stub.Get(pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0, layer_end=1,
                                    encoding=pb.ENCODING_PACKED), timeout=30,
                      metadata=H.md(token)):
        out.append(m.page if m.found else None)
    return out


def put(stub, ns, hashes, token=None):
    H.put_blocks(stub, [H.put_request(ns, h, 0, **SHAPE) for h in hashes], token=token)


def server(pki, *extra):
    return H.Server("--tls-cert", os.path.join(pki, "server.pem"), "--tls-key",
                    os.path.join(pki, "server.key"), "--data-listen", "127.0.0.1:0",
                    "--dram-capacity", "64M", *extra)


def test_tls_channel(r, pki):
    srv = server(pki)
    stub = secure_stub(srv, pki)
    hashes = [H.make_hash(i, b"dctls") for i in range(12)]
    put(stub, "t", hashes[:10])  # the last two are misses
    ref = packed_pages(stub, "t", hashes)
    chan = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
    r.check("OpenChannel over TLS: data_tls is set", chan.data_tls and chan.data_port > 0,
            str(chan))

    # A plaintext hello on the TLS data port: no ack, nothing attached.
    s, st = attach(chan.data_port, chan)
    r.check("plaintext hello on the TLS data port: no ack", st is None, "ack %r" % st)
    s.close()

    ctx = tls_context(pki)
    s, st = attach(chan.data_port, chan, ctx)
    r.check("TLS client trusting the CA: ack OK", st == ACK_OK, "ack %r" % st)
    if st != ACK_OK:
        r.stop(srv)
        return
    version, cipher = s.version(), s.cipher()[0]
    r.check("TLS 1.3 with AES-128-GCM", version == "TLSv1.3" and cipher == "TLS_AES_128_GCM_SHA256",
            "%s %s" % (version, cipher))
    for rnd in range(3):
        pages, code = tcp_get(stub, s, chan, "t", hashes)
        r.check("TCP Get over TLS #%d: OK and byte-identical to PACKED gRPC pages" % rnd,
                code == SC.OK and pages == ref and sum(p is not None for p in pages) == 10,
                "code %s, %d pages" % (code, len(pages)))
    s.close()

    # Name and trust checks are the client's: a rogue root or another name fails.
    chan2 = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
    for label, ctx2, name in (("client trusting another CA", tls_context(pki, "rogue-ca.pem"),
                               "127.0.0.1"),
                              ("client expecting another name", tls_context(pki),
                               "not-the-server.example")):
        try:
            s2, st2 = attach(chan2.data_port, chan2, ctx2, name=name)
            s2.close()
            r.check(label + ": handshake fails", False, "ack %r" % st2)
        except ssl.SSLCertVerificationError:
            r.check(label + ": handshake fails", True)
    s3, st3 = attach(chan2.data_port, chan2, ctx, secret=secrets.token_bytes(16))
    r.check("wrong secret over TLS: refused (ack 1)", st3 == ACK_UNKNOWN, "ack %r" % st3)
    s3.close()
    s4, st4 = attach(chan2.data_port, chan2, ctx)
    r.check("the channel still attaches after the refusals", st4 == ACK_OK, "ack %r" % st4)
    s4.close()
    r.check("every block still readable after the failures", packed_pages(stub, "t", hashes) == ref)
    r.check("server alive", srv.alive(), srv.stderr())
    r.stop(srv)


def test_mtls_channel(r, pki):
    srv = server(pki, "--tls-client-ca", os.path.join(pki, "client-ca.pem"))
    stub = secure_stub(srv, pki, client="client")
    hashes = [H.make_hash(i, b"dcmtls") for i in range(4)]
    put(stub, "m", hashes)
    ref = packed_pages(stub, "m", hashes)
    chan = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
    for label, client in (("no client certificate", None),
                          ("a client certificate from another CA", "rogue-client")):
        try:
            s, st = attach(chan.data_port, chan, tls_context(pki, client=client))
            s.close()
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError, EOFError):
            st = None
        r.check("mTLS data port, %s: no ack" % label, st is None, "ack %r" % st)
    s, st = attach(chan.data_port, chan, tls_context(pki, client="client"))
    r.check("mTLS data port, certificate from the client CA: ack OK", st == ACK_OK, "ack %r" % st)
    if st == ACK_OK:
        pages, code = tcp_get(stub, s, chan, "m", hashes)
        r.check("mTLS TCP Get byte-identical", code == SC.OK and pages == ref, str(code))
    s.close()
    r.stop(srv)


def test_tls_channel_tokens(r, pki):
    p = os.path.join(H.tmpdir(), "dc-tls-tokens")
    with open(p, "w") as f:
        f.write("dc-token-a-00000001 rw a\ndc-token-b-00000001 rw a\n")
    srv = server(pki, "--auth-tokens", p)
    stub = secure_stub(srv, pki)
    hashes = [H.make_hash(i, b"dctok") for i in range(3)]
    put(stub, "a", hashes, token="dc-token-a-00000001")
    ref = packed_pages(stub, "a", hashes, token="dc-token-a-00000001")
    chan = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10,
                            metadata=H.md("dc-token-a-00000001"))
    s, st = attach(chan.data_port, chan, tls_context(pki))
    r.check("TLS + token: ack OK", st == ACK_OK, "ack %r" % st)
    _, code = tcp_get(stub, s, chan, "a", hashes, token="dc-token-b-00000001")
    # As on plain channels: another token's channel is not found for this caller.
    r.check("Get on a channel opened under another token: FAILED_PRECONDITION, no pages",
            code == SC.FAILED_PRECONDITION, str(code))
    pages, code = tcp_get(stub, s, chan, "a", hashes, token="dc-token-a-00000001")
    r.check("Get by the channel's owner: byte-identical", code == SC.OK and pages == ref, str(code))
    s.close()
    r.stop(srv)


def leaf_cert(pki, d, name, cn):
    """A server certificate `name`.pem/.key in d, signed by pki's ca (SAN 127.0.0.1)."""
    run = lambda *a: subprocess.run(["openssl"] + list(a), cwd=d, check=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out", name + ".csr",
        "-subj", "/CN=" + cn)
    with open(os.path.join(d, name + ".ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", name + ".csr", "-CA", os.path.join(pki, "ca.pem"), "-CAkey",
        os.path.join(pki, "ca.key"), "-CAcreateserial", "-out", name + ".pem", "-days", "2",
        "-extfile", name + ".ext")


def peer_cn(s):
    return dict(x[0] for x in s.getpeercert()["subject"]).get("commonName")


def metric(port, name):
    body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return line
    return None


def test_tls_channel_reload_and_metrics(r, pki):
    """A certificate rotated under the server (files replaced, SIGHUP) reaches new data
    channel connections, while an attached channel keeps serving; the metrics say which
    path protects the channels and count refused handshakes."""
    d = H.tmpdir()
    leaf_cert(pki, d, "one", "tqkv-one")
    leaf_cert(pki, d, "two", "tqkv-two")
    cert, key = os.path.join(d, "cur.pem"), os.path.join(d, "cur.key")
    shutil.copy(os.path.join(d, "one.pem"), cert)
    shutil.copy(os.path.join(d, "one.key"), key)
    srv = H.Server("--tls-cert", cert, "--tls-key", key, "--data-listen", "127.0.0.1:0",
                   "--metrics-listen", "127.0.0.1:0", "--dram-capacity", "64M")
    mport = H.metrics_port(srv)
    stub = secure_stub(srv, pki)
    hashes = [H.make_hash(i, b"dcrot") for i in range(3)]
    put(stub, "r", hashes)
    ref = packed_pages(stub, "r", hashes)
    line = metric(mport, "tqkv_data_channel_security_info")
    r.check("metrics: tqkv_data_channel_security_info{path=\"openssl-tls1.3\"} 1",
            line is not None and 'path="openssl-tls1.3"' in line and line.endswith(" 1"),
            str(line))
    chan = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
    s1, st = attach(chan.data_port, chan, tls_context(pki))
    r.check("before the rotation: ack OK, certificate tqkv-one", st == ACK_OK and
            peer_cn(s1) == "tqkv-one", "ack %r, cn %r" % (st, peer_cn(s1) if st == 0 else None))
    raw = socket.create_connection(("127.0.0.1", chan.data_port), timeout=10)
    raw.sendall(b"\x16\x03\x01\x00\x05hello")  # not a TLS ClientHello
    try:
        raw.recv(100)
    except OSError:
        pass
    raw.close()
    shutil.copy(os.path.join(d, "two.pem"), cert + ".new")
    shutil.copy(os.path.join(d, "two.key"), key + ".new")
    os.rename(key + ".new", key)
    os.rename(cert + ".new", cert)
    srv.proc.send_signal(signal.SIGHUP)
    cn2, deadline = None, time.time() + 20
    while time.time() < deadline and cn2 != "tqkv-two":
        chan2 = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
        s2, st2 = attach(chan2.data_port, chan2, tls_context(pki))
        cn2 = peer_cn(s2) if st2 == ACK_OK else None
        s2.close()
        if cn2 != "tqkv-two":
            time.sleep(0.2)
    r.check("after the rotation: a new data channel gets certificate tqkv-two", cn2 == "tqkv-two",
            str(cn2))
    pages, code = tcp_get(stub, s1, chan, "r", hashes)
    r.check("the channel attached before the rotation still serves byte-identical pages",
            code == SC.OK and pages == ref, str(code))
    s1.close()
    line = metric(mport, "tqkv_data_channel_handshake_failures_total")
    r.check("metrics: the refused handshake is counted",
            line is not None and int(float(line.split()[-1])) >= 1, str(line))
    r.stop(srv)


def test_json_log(r, pki):
    """The start-up line of TLS data channels and each channel's record path are valid
    JSON with --log-format json: the values with spaces are quoted, not split into
    bogus keys (the line once had "TLSv1.3" and "(AES-128-GCM" as keys)."""
    srv = server(pki, "--log-level", "info", "--log-format", "json")
    stub = secure_stub(srv, pki)
    chan = stub.OpenChannel(pb.OpenChannelRequest(transport=pb.TRANSPORT_TCP), timeout=10)
    s, st = attach(chan.data_port, chan, tls_context(pki))
    r.check("JSON log server: TLS channel attaches", st == ACK_OK, "ack %r" % st)
    s.close()
    lines, bad = [], []
    deadline = time.time() + 10
    while time.time() < deadline:
        lines, bad = [], []
        for ln in srv.stderr(full=True).splitlines():
            if not ln.startswith("{"):
                continue
            try:
                lines.append(json.loads(ln))
            except ValueError:
                bad.append(ln)
        if any(j.get("msg") == "data channel TLS" for j in lines):
            break
        time.sleep(0.1)
    r.check("every JSON log line parses", not bad, "\n".join(bad[:3]))
    dc = [j for j in lines if j.get("msg") == "TCP data channels"]
    r.check("start-up line of TLS data channels: exactly its keys",
            len(dc) == 1 and set(dc[0]) == {"ts", "level", "msg", "listen", "port", "tls"},
            str(dc))
    r.check("its tls value is whole: protocol, suite and record path",
            len(dc) == 1 and dc[0]["tls"].startswith("TLSv1.3, AES-128-GCM preferred, records: ")
            and ("userspace" in dc[0]["tls"] or "ktls" in dc[0]["tls"]), str(dc))
    ch = [j for j in lines if j.get("msg") == "data channel TLS"]
    r.check("the channel's record path is logged (userspace here, or ktls)",
            len(ch) >= 1 and ch[0].get("path") in ("userspace", "ktls") and
            ch[0].get("cipher") == "TLS_AES_128_GCM_SHA256" and ch[0].get("version") == "TLSv1.3",
            str(ch))
    r.stop(srv)


def main():
    r = H.Runner("test_dc_tls")
    pki = H.make_pki(os.path.join(H.tmpdir(), "pki"))
    r.run(test_tls_channel, pki)
    r.run(test_mtls_channel, pki)
    r.run(test_tls_channel_tokens, pki)
    r.run(test_tls_channel_reload_and_metrics, pki)
    r.run(test_json_log, pki)
    r.finish()


if __name__ == "__main__":
    main()
