"""tqkv_harness.py - shared helpers of the security and fault tests (real tqkv-server
processes driven through Python grpcio).

Stubs are generated at test time with protoc and Debian's grpc_python_plugin into a
temporary directory. A server is started with --listen 127.0.0.1:0 and its port read
from its "listening on HOST:PORT" line. Blocks carry BF16 K/V drawn from a seed
derived from the block's key, so any returned block can be checked against the data
that was put (decoded blocks are lossy: the check is a correlation that identifies
the block, while a wrong block correlates ~0).

Environment: TQKV_SERVER (path of tqkv-server), TQKV_SOURCE_DIR (repo root),
TQKV_SANITIZED=1 (shorter loops).
"""
import atexit
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TQKV_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
SANITIZED = os.environ.get("TQKV_SANITIZED") == "1"

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
from tqkv_server import ServerProcess  # noqa: E402

if os.environ.get("TQKV_SEC_TMP") and os.path.isdir(os.environ["TQKV_SEC_TMP"]):
    _TMP = os.environ["TQKV_SEC_TMP"]  # a child process: the parent owns and removes it
else:
    _TMP = tempfile.mkdtemp(prefix="tqkv-sec-")
    os.environ["TQKV_SEC_TMP"] = _TMP
    atexit.register(shutil.rmtree, _TMP, True)


def tmpdir():
    return _TMP


def _gen_stubs():
    # Child processes of a test reuse their parent's stubs (TQKV_STUBS_DIR).
    given = os.environ.get("TQKV_STUBS_DIR")
    if given and os.path.isdir(os.path.join(given, "tqkv")):
        sys.path.append(given)
        return
    out = os.path.join(_TMP, "stubs")
    os.environ["TQKV_STUBS_DIR"] = out
    src = os.path.join(_TMP, "proto-src")
    os.makedirs(out, exist_ok=True)
    # health.proto is compiled from a copy under another directory: its module path
    # follows the file path, and a generated "grpc" package would shadow grpcio. The
    # proto package (and so the service name on the wire) stays grpc.health.v1.
    os.makedirs(os.path.join(src, "tqkv_health"), exist_ok=True)
    shutil.copy("/usr/share/grpc-proto/grpc/health/v1/health.proto",
                os.path.join(src, "tqkv_health", "health.proto"))
    protos = [
        ("-I" + os.path.join(ROOT, "proto"), "tqkv/v1/kvcache.proto"),
        ("-I" + src, "tqkv_health/health.proto"),
    ]
    for inc, rel in protos:
        subprocess.run(
            ["protoc", inc, "--python_out=" + out, "--grpc_python_out=" + out,
             "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin", rel],
            check=True)
    for d, _, _ in os.walk(out):
        init = os.path.join(d, "__init__.py")
        if d != out and not os.path.exists(init):
            open(init, "w").close()
    sys.path.append(out)


import grpc  # noqa: E402  (grpcio, before the stubs directory joins sys.path)
_gen_stubs()
from tqkv.v1 import kvcache_pb2 as pb  # noqa: E402
from tqkv.v1 import kvcache_pb2_grpc as pbg  # noqa: E402
from tqkv_health import health_pb2, health_pb2_grpc  # noqa: E402

MAX_MSG = 64 << 20
CHANNEL_OPTS = [("grpc.max_receive_message_length", MAX_MSG),
                ("grpc.max_send_message_length", MAX_MSG)]


def server_binary():
    p = os.environ.get("TQKV_SERVER")
    if p and os.access(p, os.X_OK):
        return p
    for cand in ("build/service/tqkv-server", "build-security/service/tqkv-server"):
        c = os.path.join(ROOT, cand)
        if os.access(c, os.X_OK):
            return c
    raise RuntimeError("tqkv-server not found: set TQKV_SERVER")


class Server(ServerProcess):
    """A tqkv-server child process on a free loopback port (tests/support's fixture), its
    stderr in a file under the harness's temporary folder."""

    def __init__(self, *args, env=None, startup_timeout=60):
        self.args = list(args)
        e = dict(os.environ)
        if env:
            e.update(env)
        supp = "suppressions=" + os.path.join(HERE, "lsan.supp")
        e["LSAN_OPTIONS"] = (e["LSAN_OPTIONS"] + ":" + supp) if e.get("LSAN_OPTIONS") else supp
        if "--tls-cert" in self.args:
            # Full malloc stacks so the suppression can see frames inside libgrpc
            # (the fast unwinder stops at libgpr, built without frame pointers).
            slow = "fast_unwind_on_malloc=0"
            e["ASAN_OPTIONS"] = (e["ASAN_OPTIONS"] + ":" + slow) if e.get("ASAN_OPTIONS") else slow
        self.log_path = os.path.join(_TMP, "server-%d-%d.log" % (os.getpid(), id(self)))
        super().__init__(server_binary(), ["--listen", "127.0.0.1:0", "--log-level", "warn"] +
                         self.args, env=e, start_timeout=startup_timeout, drain_stdout=True,
                         stderr_path=self.log_path)
        _servers.append(self)

    def stderr(self, full=False):
        text = self.stderr_text()
        return text if full else text[-4000:]

    def rss_bytes(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def alive(self):
        return self.proc.poll() is None

    def terminate(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def channel(self, **kw):
        return grpc.insecure_channel(self.addr, options=CHANNEL_OPTS)

    def stub(self):
        return pbg.KVCacheStub(self.channel())


_servers = []


@atexit.register
def _kill_all():
    for s in _servers:
        try:
            s.kill()
        except Exception:
            pass


def md(token):
    return (("authorization", "Bearer " + token),) if token is not None else None


# ---- data ----

def block_seed(ns, h, layer):
    d = hashlib.sha256(ns.encode() + b"/" + h + b"/" + str(layer).encode()).digest()
    return int.from_bytes(d[:8], "little")


def bf16_bytes(x):
    """float32 array -> BF16 little-endian bytes (round to nearest even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def bf16_to_f32(b):
    u = np.frombuffer(b, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32)


def block_data(ns, h, layer, tokens, heads, dim):
    """Deterministic K and V (float32 arrays) of a block key."""
    rng = np.random.default_rng(block_seed(ns, h, layer))
    k = rng.standard_normal((tokens, heads, dim), dtype=np.float32)
    v = rng.standard_normal((tokens, heads, dim), dtype=np.float32)
    return k, v


def make_hash(i, salt=b""):
    return hashlib.sha256(b"tqkv-test" + salt + i.to_bytes(8, "little")).digest()[:16]


def put_request(ns, h, layer, tokens=16, heads=2, dim=64, parent=b""):
    k, v = block_data(ns, h, layer, tokens, heads, dim)
    return pb.PutRequest(namespace=ns, hash=h, parent_hash=parent, layer=layer,
                         num_tokens=tokens, num_kv_heads=heads, head_dim=dim,
                         key=bf16_bytes(k), value=bf16_bytes(v))


def cosine(a, b):
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))


# Decoded TurboQuant blocks at >= 2 bits correlate > 0.9 with the input; another
# block's data correlates ~N(0, 1/sqrt(n)). 0.5 separates them with a huge margin.
MATCH_COS = 0.5


def check_bf16_block(ns, resp, tokens, heads, dim):
    """Returns None when resp (a found GetResponse with BF16 key/value) is the block of
    (ns, resp.hash, resp.layer), else a description of what is wrong."""
    n = tokens * heads * dim
    if (resp.num_tokens, resp.num_kv_heads, resp.head_dim) != (tokens, heads, dim):
        return "shape %s" % ((resp.num_tokens, resp.num_kv_heads, resp.head_dim),)
    if len(resp.key) != 2 * n or len(resp.value) != 2 * n:
        return "sizes %d/%d" % (len(resp.key), len(resp.value))
    k, v = block_data(ns, resp.hash, resp.layer, tokens, heads, dim)
    ck = cosine(bf16_to_f32(resp.key), k)
    cv = cosine(bf16_to_f32(resp.value), v)
    if ck < MATCH_COS or cv < MATCH_COS:
        return "data does not match the block put (cos k %.3f v %.3f)" % (ck, cv)
    return None


def put_blocks(stub, reqs, token=None, timeout=120):
    return stub.Put(iter(reqs), metadata=md(token), timeout=timeout)


def get_all(stub, ns, hashes, layer_begin, layer_end, encoding=None, token=None, timeout=120):
    enc = pb.ENCODING_BF16 if encoding is None else encoding
    req = pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=layer_begin,
                        layer_end=layer_end, encoding=enc)
    return list(stub.Get(req, metadata=md(token), timeout=timeout))


def rpc_code(fn, *a, **kw):
    """Runs fn; returns grpc.StatusCode.OK or the error's code."""
    try:
        r = fn(*a, **kw)
        if hasattr(r, "__iter__") and not isinstance(r, (bytes, str)) and not hasattr(r, "ListFields"):
            list(r)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def metrics_port(srv, timeout=10):
    """The port of --metrics-listen HOST:0, from the server's start-up lines."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in list(srv.stdout_lines):
            m = re.search(r"metrics on port (\d+)", line)
            if m:
                return int(m.group(1))
        time.sleep(0.05)
    raise RuntimeError("no metrics port line")


# ---- certificates ----

def _openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def make_pki(d):
    """Creates in d: ca.pem/ca.key (server CA), server.pem/server.key (SAN 127.0.0.1,
    localhost), client-ca.pem, client.pem/client.key (signed by client-ca),
    rogue-ca.pem and rogue-client.pem/key (signed by an unrelated CA). Returns d."""
    os.makedirs(d, exist_ok=True)

    def ca(name):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key",
                 "-out", name + ".pem", "-days", "2", "-subj", "/CN=tqkv-test-" + name, cwd=d)

    def leaf(name, ca_name, cn, ext):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out",
                 name + ".csr", "-subj", "/CN=" + cn, cwd=d)
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca_name + ".pem", "-CAkey",
                 ca_name + ".key", "-CAcreateserial", "-out", name + ".pem", "-days", "2",
                 "-extfile", name + ".ext", cwd=d)

    ca("ca")
    ca("client-ca")
    ca("rogue-ca")
    leaf("server", "ca", "localhost",
         "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    leaf("client", "client-ca", "tqkv-client", "extendedKeyUsage=clientAuth\n")
    leaf("rogue-client", "rogue-ca", "tqkv-rogue", "extendedKeyUsage=clientAuth\n")
    return d


def read(p):
    with open(p, "rb") as f:
        return f.read()


# ---- a tiny test runner: named checks, a summary, exit status ----

class Runner:
    def __init__(self, name):
        self.name = name
        self.results = []
        self.t0 = time.time()

    def check(self, what, cond, detail=""):
        self.results.append((what, bool(cond), detail))
        print("%s  %s%s" % ("PASS" if cond else "FAIL", what,
                             ("  [" + detail + "]") if (detail and not cond) else ""), flush=True)
        return cond

    def run(self, fn, *args):
        """Runs fn(self, *args); an exception is a failure, not an abort."""
        t = time.time()
        print("== %s" % fn.__name__, flush=True)
        try:
            fn(self, *args)
        except Exception as e:  # report and continue with the next test
            import traceback
            traceback.print_exc()
            self.check(fn.__name__ + " raised", False, repr(e))
        print("  (%s: %.1fs)" % (fn.__name__, time.time() - t), flush=True)

    def stop(self, srv, what="server"):
        """SIGTERMs srv and checks a clean exit (status 0, no sanitizer report)."""
        try:
            rc = srv.terminate(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()
            rc = "timeout"
        self.check("%s exits 0 on SIGTERM" % what, rc == 0, "rc %s: %s" % (rc, srv.stderr()[-1500:]))

    def finish(self):
        for s in _servers:
            log = s.stderr(full=True)
            for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                           "ThreadSanitizer"):
                if marker in log:
                    self.check("no sanitizer report from the server on port %s" % s.port, False,
                               log[log.index(marker):][:1500])
                    break
        bad = [r for r in self.results if not r[1]]
        print("%s: %d checks, %d failed, %.1fs" % (self.name, len(self.results), len(bad),
                                                  time.time() - self.t0), flush=True)
        _kill_all()
        sys.exit(1 if bad else 0)
