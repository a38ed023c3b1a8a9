#!/usr/bin/python3
"""test_reload.py - token file and TLS certificate reload of a real tqkv-server, without a
restart and without failing calls in flight.

Tokens, under load: threads call the server without pause with the old token and with the
new one while the token file is replaced (atomically, as Kubernetes and `mv` do). Checks:
every call ends OK or UNAUTHENTICATED (nothing dropped, no UNAVAILABLE); old-token calls
that ended before the swap succeeded, and every one that started after the reload was seen
fails; new-token calls that started after the reload all succeed; a Get stream and a Put
stream that were under way across the reload (opened with the old token) complete with
every block, and the blocks are right. A bad new file (a syntax error) is rejected: the
old table stays, the log names the file and the line, tqkv_credential_reloads_total
counts it; SIGHUP reloads too (the same bad file, rejected again, trigger=SIGHUP); a file
rewritten in place is picked up.

TLS: the certificate and key are replaced by another pair from the same CA: new
connections are served the new certificate, a channel connected before keeps working; a
key that does not match the certificate is rejected and the pair in force stays.
"""
import os
import re
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv_harness as H  # noqa: E402
from tqkv_harness import grpc, pb  # noqa: E402

SC = grpc.StatusCode
SHAPE = dict(tokens=16, heads=2, dim=64)
OLD, NEW, NEW2 = "old-token-0123456789", "new-token-9876543210", "newer-token-55555555"
NS = "ns-r"


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def metric(port, series):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for(pred, timeout=15.0, step=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


def stats(stub, token, timeout=10):
    return H.rpc_code(stub.Stats, pb.StatsRequest(namespace=NS), metadata=H.md(token),
                      timeout=timeout)


class Load:
    """Threads calling Lookup/Stats in a loop with one token; each call's (start, end, code)."""

    def __init__(self, addr, token, hashes, nthreads=3):
        self.token, self.hashes, self.stop_ev = token, hashes, threading.Event()
        self.results, self.lock = [], threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(addr, i), daemon=True)
                        for i in range(nthreads)]
        for t in self.threads:
            t.start()

    def run(self, addr, i):
        ch = grpc.insecure_channel(addr, options=H.CHANNEL_OPTS)
        stub = H.pbg.KVCacheStub(ch)
        k = 0
        while not self.stop_ev.is_set():
            t0 = time.monotonic()
            if (i + k) % 2:
                code = H.rpc_code(stub.Lookup, pb.LookupRequest(namespace=NS, hashes=self.hashes,
                                                                num_layers=1),
                                  metadata=H.md(self.token), timeout=30)
            else:
                code = stats(stub, self.token, timeout=30)
            with self.lock:
                self.results.append((t0, time.monotonic(), code))
            k += 1
        ch.close()

    def stop(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join(60)
        return self.results


def test_token_swap_under_load(r):
    d = os.path.join(H.tmpdir(), "reload-tokens")
    os.makedirs(d, exist_ok=True)
    tok = os.path.join(d, "tokens")
    write_atomic(tok, "# reload test\n%s rw %s\n" % (OLD, NS))
    srv = H.Server("--auth-tokens", tok, "--metrics-listen", "127.0.0.1:0", "--log-level",
                   "info", "--threads", "2", "--encoder-threads", "2", "--dram-capacity", "64M")
    mport = H.metrics_port(srv)
    ok_series = 'tqkv_credential_reloads_total{file="tokens",result="ok"}'
    bad_series = 'tqkv_credential_reloads_total{file="tokens",result="rejected"}'
    r.check("the start-up load is counted", metric(mport, ok_series) == 1.0)
    stub = srv.stub()
    hashes = [H.make_hash(i, b"reload") for i in range(8)]
    H.put_blocks(stub, [H.put_request(NS, h, 0, **SHAPE) for h in hashes], token=OLD)
    r.check("old token works before the swap", stats(stub, OLD) == SC.OK)
    r.check("new token refused before the swap", stats(stub, NEW) == SC.UNAUTHENTICATED)

    # In flight across the reload: a Get stream, read slowly, and a Put stream that pauses.
    reps = 48
    get_it = stub.Get(pb.GetRequest(namespace=NS, hashes=hashes * reps, layer_begin=0,
                                    layer_end=1, encoding=pb.ENCODING_BF16),
                      metadata=H.md(OLD), timeout=120)
    first = next(get_it)
    go_on = threading.Event()
    late = [H.make_hash(100 + i, b"reload-put") for i in range(6)]

    def put_msgs():
        for i, h in enumerate(late):
            if i == 3:
                go_on.wait(60)  # the reload happens while this stream is open
            yield H.put_request(NS, h, 0, **SHAPE)

    put_res = {}

    def put_thread():
        try:
            put_res["resp"] = stub.Put(put_msgs(), metadata=H.md(OLD), timeout=120)
            put_res["code"] = SC.OK
        except grpc.RpcError as e:
            put_res["code"] = e.code()
            put_res["detail"] = e.details()

    pt = threading.Thread(target=put_thread, daemon=True)
    pt.start()
    old_load = Load(srv.addr, OLD, hashes)
    new_load = Load(srv.addr, NEW, hashes)
    time.sleep(1.0)  # load running, the two streams started on the server
    # and both loads have finished calls before the swap (bounded by an event, not a
    # sleep: a loaded machine may be slow to start the threads)
    wait_for(lambda: len(old_load.results) >= 10 and len(new_load.results) >= 10, timeout=60)

    t_swap = time.monotonic()
    write_atomic(tok, "# rotated\n%s rw %s\n" % (NEW, NS))
    r.check("new token accepted after the swap (file watcher reloaded)",
            wait_for(lambda: stats(stub, NEW) == SC.OK, timeout=15))
    t_reload = time.monotonic()
    r.check("old token refused after the reload", stats(stub, OLD) == SC.UNAUTHENTICATED)
    # both loads make calls after the reload (event-bound, as above)
    wait_for(lambda: sum(1 for t0, _, _ in list(old_load.results) if t0 > t_reload) >= 10 and
             sum(1 for t0, _, _ in list(new_load.results) if t0 > t_reload) >= 10, timeout=60)
    go_on.set()
    olds, news = old_load.stop(), new_load.stop()
    pt.join(120)
    rest = list(get_it)

    codes = {c for _, _, c in olds + news}
    r.check("every call under load ended OK or UNAUTHENTICATED (none dropped)",
            codes <= {SC.OK, SC.UNAUTHENTICATED}, str(codes))
    before = [c for t0, t1, c in olds if t1 < t_swap]
    after = [c for t0, t1, c in olds if t0 > t_reload]
    r.check("old-token calls before the swap all succeeded (%d)" % len(before),
            before and all(c == SC.OK for c in before))
    r.check("old-token calls started after the reload all failed (%d)" % len(after),
            after and all(c == SC.UNAUTHENTICATED for c in after))
    new_after = [c for t0, t1, c in news if t0 > t_reload]
    r.check("new-token calls started after the reload all succeeded (%d)" % len(new_after),
            new_after and all(c == SC.OK for c in new_after))
    r.check("new-token calls that ended before the swap were refused",
            all(c == SC.UNAUTHENTICATED for t0, t1, c in news if t1 < t_swap))
    got = [first] + rest
    r.check("the Get stream open across the reload delivered every block (%d)" % len(got),
            len(got) == len(hashes) * reps and all(g.found for g in got) and
            all(H.check_bf16_block(NS, g, **SHAPE) is None for g in got[:: len(hashes)]))
    r.check("the Put stream open across the reload stored every block",
            put_res.get("code") == SC.OK and put_res["resp"].blocks_stored == len(late),
            str(put_res))
    g = H.get_all(stub, NS, late, 0, 1, token=NEW)
    r.check("its blocks are there and right",
            len(g) == len(late) and all(x.found and H.check_bf16_block(NS, x, **SHAPE) is None
                                        for x in g))
    r.check("the reload is counted", metric(mport, ok_series) == 2.0)

    # A bad file is rejected; the table in force stays.
    write_atomic(tok, "%s rw %s\nthis-line-is-wrong\n" % (NEW2, NS))
    r.check("a bad token file is rejected (counted)",
            wait_for(lambda: metric(mport, bad_series) == 1.0))
    r.check("after the rejection the new token still works", stats(stub, NEW) == SC.OK)
    r.check("... and the bad file's token does not", stats(stub, NEW2) == SC.UNAUTHENTICATED)
    log = srv.stderr(full=True)
    r.check("the log says why, naming the file and line",
            "reload rejected" in log and (tok + ":2:") in log and "file=tokens" in log,
            log[-800:])
    # SIGHUP reloads too: the same bad file, rejected again.
    srv.proc.send_signal(signal.SIGHUP)
    r.check("SIGHUP reloads (the bad file is rejected again)",
            wait_for(lambda: metric(mport, bad_series) == 2.0))
    r.check("the rejection names the trigger SIGHUP", "trigger=SIGHUP" in srv.stderr(full=True))
    # A file rewritten in place (no rename) is picked up too.
    with open(tok, "w") as f:
        f.write("%s rw %s\n" % (NEW2, NS))
    r.check("a file rewritten in place is reloaded",
            wait_for(lambda: stats(stub, NEW2) == SC.OK))
    r.check("... and the previous token is refused", stats(stub, NEW) == SC.UNAUTHENTICATED)
    r.check("server alive", srv.alive())
    r.stop(srv)


def served_cert(addr, cafile):
    """DER of the certificate the server presents to a new TLS connection."""
    host, port = addr.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as s:
        with ctx.wrap_socket(s) as t:
            return t.getpeercert(binary_form=True)


def der_of(pem_path):
    with open(pem_path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


def test_tls_rotation(r):
    pki = H.make_pki(os.path.join(H.tmpdir(), "reload-pki"))
    # A second server certificate from the same CA (a rotation).
    ext = os.path.join(pki, "server2.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    H._openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server2.key", "-out",
               "server2.csr", "-subj", "/CN=localhost", cwd=pki)
    H._openssl("x509", "-req", "-in", "server2.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
               "-CAcreateserial", "-out", "server2.pem", "-days", "2", "-extfile", ext, cwd=pki)
    live = os.path.join(pki, "live")
    os.makedirs(live, exist_ok=True)
    cert, key = os.path.join(live, "tls.crt"), os.path.join(live, "tls.key")

    def install(c, k):
        """Both files renamed into place back to back (well inside the 250 ms debounce)."""
        for src, dst in ((c, cert), (k, key)):
            with open(os.path.join(pki, src), "rb") as f:
                data = f.read()
            with open(dst + ".tmp", "wb") as f:
                f.write(data)
        os.replace(key + ".tmp", key)
        os.replace(cert + ".tmp", cert)

    install("server.pem", "server.key")
    srv = H.Server("--tls-cert", cert, "--tls-key", key, "--metrics-listen", "127.0.0.1:0",
                   "--dram-capacity", "32M")
    mport = H.metrics_port(srv)
    ca = os.path.join(pki, "ca.pem")
    creds = grpc.ssl_channel_credentials(root_certificates=H.read(ca))
    opts = H.CHANNEL_OPTS + [("grpc.ssl_target_name_override", "localhost")]
    ch_old = grpc.secure_channel(srv.addr, creds, options=opts)
    stub_old = H.pbg.KVCacheStub(ch_old)
    r.check("TLS works before the rotation", stats(stub_old, None) == SC.OK)
    r.check("the first certificate is served", served_cert(srv.addr, ca) == der_of(
        os.path.join(pki, "server.pem")))

    install("server2.pem", "server2.key")
    r.check("new connections get the rotated certificate",
            wait_for(lambda: served_cert(srv.addr, ca) == der_of(os.path.join(pki, "server2.pem")),
                     timeout=15))
    r.check("a channel connected before the rotation keeps working",
            stats(stub_old, None) == SC.OK)
    ch_new = grpc.secure_channel(srv.addr, creds, options=opts)
    r.check("a new channel verifies the rotated certificate",
            stats(H.pbg.KVCacheStub(ch_new), None) == SC.OK)
    r.check("the rotation is counted",
            metric(mport, 'tqkv_credential_reloads_total{file="tls",result="ok"}') == 2.0)

    # A key that does not match the certificate: rejected, the rotated pair stays.
    install("server.pem", "server2.key")
    r.check("a mismatched certificate/key pair is rejected (counted)",
            wait_for(lambda: metric(
                mport, 'tqkv_credential_reloads_total{file="tls",result="rejected"}') >= 1.0))
    r.check("the pair in force is still served",
            served_cert(srv.addr, ca) == der_of(os.path.join(pki, "server2.pem")))
    ch_last = grpc.secure_channel(srv.addr, creds, options=opts)
    r.check("new TLS calls still work", stats(H.pbg.KVCacheStub(ch_last), None) == SC.OK)
    log = srv.stderr(full=True)
    r.check("the log says the key does not match", "does not match the certificate" in log,
            log[-800:])
    # Clients go first: gRPC 1.51 leaks the buffers of a TLS endpoint still open when the
    # server shuts down (tests/security/lsan.supp), which an ASan run would report.
    for ch in (ch_old, ch_new, ch_last):
        ch.close()
    r.stop(srv)


def main():
    r = H.Runner("test_reload")
    r.run(test_token_swap_under_load)
    r.run(test_tls_rotation)
    r.finish()


if __name__ == "__main__":
    main()
