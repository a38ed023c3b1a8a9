#!/usr/bin/python3
"""tqkv-codec and tqkv-bench as a new user meets them, with faults: outputs that cannot
be written (a full device, a file size limit), the same file twice, pipes as input,
report paths that do not exist, flags that conflict.

Environment: TQKV_CODEC, TQKV_BENCH, TQKV_SERVER (CTest passes the built targets).

What broke before the fixes this checks:
- tqkv-codec encode/decode, on a failed write, removed the output path: given a device
  (/dev/full, as root) it deleted the device node itself; given an existing file, the
  old file was gone too. decode-kv / encode-kv / attend left a truncated output file
  (exit 1) and decode-kv with K.out == V.out kept only V and exited 0.
- encode-kv, decode-kv and attend read a pipe or process substitution as
  "Input/output error".
- tqkv-bench with --json or --csv in a directory that does not exist ran the whole
  benchmark and exited 0 with no report; --json and --csv naming one file clobbered
  each other; a failed write of the report (disk full) exited 0.
"""
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import unittest

CODEC = os.environ.get("TQKV_CODEC")
BENCH = os.environ.get("TQKV_BENCH")
SERVER = os.environ.get("TQKV_SERVER")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_server import ServerProcess  # noqa: E402


def run(*argv, timeout=120, fsize=None, **kw):
    def limit():
        if fsize is not None:
            # a write past the limit fails with EFBIG instead of killing the process
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, **kw)


def bf16_bytes(n, seed):
    """n finite BF16 values (bytes), reproducible."""
    import random
    r = random.Random(seed)
    out = bytearray()
    for _ in range(n):
        out += (0x3C00 + r.randrange(0, 0x700)).to_bytes(2, "little")
    return bytes(out)


class Codec(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="tqkv-tools-adv-")
        d = cls.d = cls.tmp.name
        cls.k, cls.v = os.path.join(d, "K.bf16"), os.path.join(d, "V.bf16")
        with open(cls.k, "wb") as f:
            f.write(bf16_bytes(64 * 2 * 64, 1))
        with open(cls.v, "wb") as f:
            f.write(bf16_bytes(64 * 2 * 64, 2))
        cls.page = os.path.join(d, "kv.tqp")
        r = run(CODEC, "encode-kv", "--tokens", 64, "--heads", 2, "--dim", 64, "--key-bits", 4,
                "--value-bits", 3, cls.k, cls.v, cls.page)
        assert r.returncode == 0, r.stderr
        cls.vec = os.path.join(d, "vec.bf16")  # 512 vectors of d = 128: 128 KiB
        with open(cls.vec, "wb") as f:
            f.write(bf16_bytes(512 * 128, 3))
        cls.q = os.path.join(d, "q.f32")
        with open(cls.q, "wb") as f:
            f.write(b"".join(int(0x3DCCCCCD + i).to_bytes(4, "little") for i in range(4 * 64)))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def p(self, name):
        return os.path.join(self.d, name)

    def leftovers(self):
        return [f for f in os.listdir(self.d) if ".tmp-" in f]

    def assert_names(self, r, *words):
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        for w in words:
            self.assertIn(w, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()) >= 1, True)

    def test_failed_write_keeps_a_device_link(self):
        # encode to a symbolic link to /dev/full: the write fails (ENOSPC); the link
        # must survive (the old code removed the path: the link here, /dev/full itself
        # when given directly as root)
        link = self.p("full-link")
        os.symlink("/dev/full", link)
        try:
            for argv in (("encode", "--dim", 128, "--bits", 3, self.vec, link),
                         ("decode", self.page, link),
                         ("decode-kv", self.page, link, self.p("v-unused")),
                         ("encode-kv", "--tokens", 64, "--heads", 2, "--dim", 64, "--key-bits",
                          4, "--value-bits", 3, self.k, self.v, link)):
                r = run(CODEC, *argv)
                if argv[0] == "decode":  # a KV page decodes with decode-kv, not decode
                    self.assertNotEqual(r.returncode, 0)
                else:
                    self.assert_names(r, "full-link", "No space left on device")
                self.assertTrue(os.path.islink(link), "%s removed the output link" % argv[0])
                self.assertFalse(os.path.exists(self.p("v-unused")),
                                 "decode-kv left V though K failed")
        finally:
            os.unlink(link)
        self.assertTrue(os.path.exists("/dev/full"))

    def test_failed_write_keeps_previous_file(self):
        # a file size limit below the output: exit 1 naming the file, the previous
        # content intact, no temporary file left
        out = self.p("prev.tqp")
        with open(out, "wb") as f:
            f.write(b"previous")
        r = run(CODEC, "encode", "--dim", 128, "--bits", 4, self.vec, out, fsize=8192)
        self.assert_names(r, "prev.tqp", "File too large")
        with open(out, "rb") as f:
            self.assertEqual(f.read(), b"previous")
        self.assertEqual(self.leftovers(), [])
        # and without the limit it is replaced, with the mode of a new file
        r = run(CODEC, "encode", "--dim", 128, "--bits", 4, self.vec, out)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run(CODEC, "info", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("512 x dim 128", r.stdout)
        self.assertEqual(self.leftovers(), [])

    def test_decode_kv_no_partial_outputs(self):
        ko, vo = self.p("Kp.out"), self.p("Vp.out")
        r = run(CODEC, "decode-kv", self.page, ko, vo, fsize=4096)  # K and V are 16 KiB
        self.assert_names(r, "Kp.out", "File too large")
        self.assertFalse(os.path.exists(ko), "a truncated K.out was left")
        self.assertFalse(os.path.exists(vo))
        self.assertEqual(self.leftovers(), [])
        r = run(CODEC, "decode-kv", self.page, ko, vo)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.path.getsize(ko), 64 * 2 * 64 * 2)
        self.assertEqual(os.path.getsize(vo), 64 * 2 * 64 * 2)

    def test_attend_no_partial_output(self):
        out = self.p("att.f32")
        r = run(CODEC, "attend", "--query", self.q, "--query-heads", 4, out, self.page,
                fsize=512)  # the output is 1 KiB
        self.assert_names(r, "att.f32", "File too large")
        self.assertFalse(os.path.exists(out))
        self.assertEqual(self.leftovers(), [])

    def test_decode_kv_same_output_twice(self):
        same = self.p("same.out")
        r = run(CODEC, "decode-kv", self.page, same, same)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("same file", r.stderr)
        self.assertFalse(os.path.exists(same))
        # via another spelling of the path, once it exists
        with open(same, "wb") as f:
            f.write(b"x")
        r = run(CODEC, "decode-kv", self.page, same, os.path.join(self.d, ".", "same.out"))
        self.assertEqual(r.returncode, 2, r.stderr)
        # a device for both is fine (check only)
        r = run(CODEC, "decode-kv", self.page, "/dev/null", "/dev/null")
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_same_file_in_and_out(self):
        # the input is read whole before the output is written: in place works
        f = self.p("inplace.bf16")
        with open(self.vec, "rb") as s, open(f, "wb") as d:
            d.write(s.read())
        r = run(CODEC, "encode", "--dim", 128, "--bits", 3, f, f)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run(CODEC, "info", f)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("512 x dim 128", r.stdout)

    def test_pipes_as_input(self):
        with open(self.page, "rb") as f:
            page = f.read()
        with open(self.q, "rb") as f:
            q = f.read()
        ko, vo = self.p("Kpipe"), self.p("Vpipe")
        r = run(CODEC, "decode-kv", "/dev/stdin", ko, vo, input=None,
                stdin=open(self.page, "rb"))
        self.assertEqual(r.returncode, 0, r.stderr)
        r2 = run(CODEC, "decode-kv", self.page, self.p("Kfile"), self.p("Vfile"))
        self.assertEqual(r2.returncode, 0, r2.stderr)
        for a, b in ((ko, "Kfile"), (vo, "Vfile")):
            with open(a, "rb") as x, open(self.p(b), "rb") as y:
                self.assertEqual(x.read(), y.read())
        # through a real pipe (not a redirected file)
        rfd, wfd = os.pipe()
        p = subprocess.Popen([CODEC, "attend", "--query", "/dev/stdin", "--query-heads", "4",
                              self.p("att-pipe"), self.page], stdin=rfd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.close(rfd)
        os.write(wfd, q)
        os.close(wfd)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        r = run(CODEC, "attend", "--query", self.q, "--query-heads", 4, self.p("att-file"),
                self.page)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.p("att-pipe"), "rb") as x, open(self.p("att-file"), "rb") as y:
            self.assertEqual(x.read(), y.read())
        del page

    def test_bad_inputs_name_the_problem(self):
        empty, odd = self.p("empty"), self.p("odd")
        open(empty, "wb").close()
        with open(odd, "wb") as f:
            f.write(b"\x01" * 255)
        cases = [
            (("encode", "--dim", 128, "--bits", 3, empty, self.p("o1")), 1, "size 0 bytes"),
            (("encode", "--dim", 128, "--bits", 3, odd, self.p("o2")), 1, "not a positive multiple"),
            (("encode", "--dim", 100, "--bits", 3, self.vec, self.p("o3")), 1, "multiple of 200"),
            (("encode", "--dim", 128, "--bits", 5, self.vec, self.p("o4")), 1, "bit width"),
            (("info", odd), 1, "not a tqkv page"),
            (("info", empty), 1, "empty file"),
            (("info", self.vec), 1, "not a tqkv page"),
            (("decode-kv", self.vec, self.p("o5"), self.p("o6")), 1, "not a tqkv page"),
            (("attend", "--query", self.q, "--query-heads", 8, self.p("o7"), self.page), 1,
             "8 query heads"),
            (("attend", "--query", self.q, "--query-heads", 3, self.p("o8"), self.page), 1,
             "not a multiple"),
            (("attend", "--query", self.k, "--query-heads", 4, self.p("o9"), self.page), 1,
             "need 1024"),
            (("encode-kv", "--tokens", 65, "--heads", 2, "--dim", 64, "--key-bits", 4,
              "--value-bits", 3, self.k, self.v, self.p("o10")), 1, "needs 16640"),
            (("frobnicate",), 2, "unknown command"),
            (("encode", "--dim", 128, "--bits", 3, self.vec, "/nonexistent-dir/o.tqp"), 1,
             "No such file or directory"),
            (("encode", "--dim", 128, "--bits", 3, self.vec, self.d), 1, "Is a directory"),
        ]
        for argv, rc, word in cases:
            r = run(CODEC, *argv)
            self.assertEqual(r.returncode, rc, "%s: %s" % (argv, r.stderr))
            self.assertIn(word, r.stderr, argv)
        for i in range(1, 11):
            self.assertFalse(os.path.exists(self.p("o%d" % i)), "o%d" % i)
        self.assertEqual(self.leftovers(), [])


class Bench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="tqkv-bench-adv-")
        cls.d = cls.tmp.name

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def bench(self, *args, timeout=120):
        return run(BENCH, "--spawn-server", SERVER, "--model", "tiny", "--block-tokens", 16,
                   "--no-baselines", "--concurrency", 1, *args, timeout=timeout)

    def test_report_paths_checked_before_the_run(self):
        for flag in ("--json", "--csv"):
            r = self.bench("--duration", 30, flag, "/nonexistent-dir/report", timeout=20)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("%s /nonexistent-dir/report" % flag, r.stderr)
            self.assertIn("No such file or directory", r.stderr)
        r = self.bench("--duration", 30, "--json", self.d, timeout=20)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("Is a directory", r.stderr)
        same = os.path.join(self.d, "r.txt")
        r = self.bench("--duration", 30, "--json", same, "--csv", same, timeout=20)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("same file", r.stderr)
        self.assertFalse(os.path.exists(same))

    def test_reports_written(self):
        j, c = os.path.join(self.d, "ok.json"), os.path.join(self.d, "ok.csv")
        r = self.bench("--duration", 0, "--ops", 20, "--json", j, "--csv", c)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(j) as f:
            rep = json.load(f)
        self.assertEqual(rep["verify_failures"], 0)
        self.assertEqual(rep["errors"], 0)
        with open(c) as f:
            lines = f.read().splitlines()
        self.assertTrue(lines[0].startswith("t_s,"))
        self.assertGreaterEqual(len(lines), 2)

    def test_report_write_failure_is_an_error(self):
        r = self.bench("--duration", 0, "--ops", 10, "--json", "/dev/full")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("--json /dev/full: write failed", r.stderr)

    def test_flags(self):
        cases = [
            (("--concurrency", 0), "--concurrency"),
            (("--concurrency", 10000), "1..1024"),
            (("--model", "Tiny"), "unknown model 'Tiny'"),
            (("--model", "LLAMA3-8B"), "llama3-8b"),
            (("--duration", 0), "needs --ops"),
            (("--ops", -1), "--ops"),
            (("--duration", "nan"), "--duration"),
        ]
        for args, word in cases:
            r = run(BENCH, "--spawn-server", SERVER, *args, timeout=20)
            self.assertEqual(r.returncode, 2, "%s: %s" % (args, r.stderr))
            self.assertIn(word, r.stderr, args)
        many = []
        for i in range(33):
            many += ["--server-arg", "--log-level=info"]
        r = run(BENCH, "--spawn-server", SERVER, *many, timeout=20)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--server-arg", r.stderr)

    def test_tls_server_without_ca(self):
        # a TLS server seen in plaintext: exit 1 within the probe's 15 s, naming the
        # target and suggesting --tls-ca
        d = self.d
        def ossl(*a):
            subprocess.run(["openssl"] + list(a), cwd=d, check=True, capture_output=True)
        try:
            ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
                 "ca.pem", "-days", "2", "-subj", "/CN=tqkv-adv-ca")
            ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
                 "-subj", "/CN=localhost")
            with open(os.path.join(d, "ext"), "w") as f:
                f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
            ossl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "srv.pem", "-days", "2", "-extfile", "ext")
        except (OSError, subprocess.CalledProcessError) as e:
            self.skipTest("openssl: %s" % e)
        srv = ServerProcess(SERVER, ["--listen", "127.0.0.1:0", "--tls-cert",
                                     os.path.join(d, "srv.pem"), "--tls-key",
                                     os.path.join(d, "srv.key")])
        try:
            target = srv.addr
            r = run(BENCH, "--target", target, "--model", "tiny", "--duration", 1,
                    "--no-baselines", timeout=40)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn(target, r.stderr)
            self.assertIn("--tls-ca", r.stderr)
            # gRPC 1.51's TLS endpoint leaks a slice array at exit under LSan (see
            # tests/client.cmake): suppressed by its frame for this TLS run only
            supp = os.path.join(d, "lsan.supp")
            with open(supp, "w") as f:
                f.write("leak:gpr_realloc\n")
            env = dict(os.environ, LSAN_OPTIONS="suppressions=" + supp)
            r = run(BENCH, "--target", target, "--tls-ca", os.path.join(d, "ca.pem"), "--model",
                    "tiny", "--block-tokens", 16, "--duration", 0, "--ops", 10,
                    "--no-baselines", "--concurrency", 1, timeout=60, env=env)
            self.assertEqual(r.returncode, 0, r.stderr)
        finally:
            srv.stop(timeout=10)


if __name__ == "__main__":
    missing = [n for n, v in (("TQKV_CODEC", CODEC), ("TQKV_BENCH", BENCH),
                              ("TQKV_SERVER", SERVER)) if not v or not os.access(v, os.X_OK)]
    if missing:
        print("skipped: %s not set" % ", ".join(missing))
        sys.exit(77)
    unittest.main(verbosity=2)
