#!/usr/bin/python3
"""The CLIs as a new user meets them: damaged page files and bad flags.

Usage: test_newuser_cli.py TQKV_CODEC TQKV_BENCH TQKV_SERVER

- tqkv-codec decode-kv wrote K/V from a page with a flipped byte and exited 0 (the
  CRC was opt-in); it must refuse it and name the CRC. A directory as input read as
  "Input/output error" / "Cannot allocate memory"; it must say "Is a directory".
- tqkv-bench took `--concurrency 0`, `--duration -5`, `--prefix-reuse 7`, `--key-bits 5`,
  `--duration 1x` either silently or with the bare usage; each must exit 2 with a line
  naming the flag. A run whose RPCs failed exited 0; it must exit 4. A target with
  nothing listening hung every worker on 60 s wait-for-ready deadlines (a 2 s run took
  minutes); the bench must fail up front naming the target.
"""
import os
import socket
import subprocess
import sys
import tempfile
import unittest

CODEC = BENCH = SERVER = None


def run(*argv, timeout=120):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


class Codec(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="tqkv-newuser-")
        d = cls.tmp.name
        cls.k, cls.v = os.path.join(d, "K.bf16"), os.path.join(d, "V.bf16")
        raw = bytearray(os.urandom(64 * 2 * 64 * 2))
        for i in range(1, len(raw), 2):  # keep every BF16 finite: exponent below all-ones
            raw[i] &= 0x3F
        for p in (cls.k, cls.v):
            with open(p, "wb") as f:
                f.write(raw)
        cls.page = os.path.join(d, "block.tqp")
        r = run(CODEC, "encode-kv", "--tokens", "64", "--heads", "2", "--dim", "64", "--key-bits", "3", "--value-bits", "3", cls.k, cls.v,
                cls.page)
        assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def out(self, name):
        return os.path.join(self.tmp.name, name)

    def test_decode_kv_intact(self):
        r = run(CODEC, "decode-kv", self.page, self.out("k1"), self.out("v1"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.path.getsize(self.out("k1")), os.path.getsize(self.k))

    def test_decode_kv_refuses_flipped_byte(self):
        with open(self.page, "rb") as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 0x40
        bad = self.out("flipped.tqp")
        with open(bad, "wb") as f:
            f.write(data)
        for extra in ([], ["--check-crc"]):
            r = run(CODEC, "decode-kv", *extra, bad, self.out("k2"), self.out("v2"))
            self.assertNotEqual(r.returncode, 0, "decoded a damaged page: %s" % r.stdout)
            self.assertIn("CRC32C mismatch", r.stderr)
        q = self.out("q.f32")
        with open(q, "wb") as f:
            f.write(bytes(4 * 2 * 64))
        r = run(CODEC, "attend", "--query", q, "--query-heads", "2", self.out("o.f32"), bad)
        self.assertNotEqual(r.returncode, 0, "attended over a damaged page")
        self.assertIn("CRC32C mismatch", r.stderr)

    def test_directory_input(self):
        for argv in (["info", self.tmp.name], ["decode", self.tmp.name, self.out("x")],
                     ["decode-kv", self.tmp.name, self.out("a"), self.out("b")]):
            r = run(CODEC, *argv)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("Is a directory", r.stderr, argv)


class Bench(unittest.TestCase):
    def test_bad_flags_name_the_flag(self):
        cases = {
            ("--concurrency", "0"): "--concurrency",
            ("--duration", "-5"): "--duration",
            ("--duration", "1x"): "--duration",
            ("--prefix-reuse", "7"): "--prefix-reuse",
            ("--key-bits", "5"): "--key-bits",
            ("--layers", "abc"): "--layers",
            ("--head-dim", "7"): "--head-dim",
            ("--model", "gpt5"): "--model",
            ("--verify-every", "-1"): "--verify-every",
            ("--duration", "0"): "--ops",
        }
        for (flag, val), named in cases.items():
            r = run(BENCH, "--target", "127.0.0.1:1", "--no-baselines", flag, val)
            self.assertEqual(r.returncode, 2, (flag, val, r.stdout, r.stderr))
            first = r.stderr.splitlines()[0] if r.stderr else ""
            self.assertIn(named, first, (flag, val))
            self.assertNotIn("tqkv-bench: 1 target(s)", r.stdout)

    def test_unreachable_target_fails_up_front(self):
        with socket.socket() as s:  # bound, never listening: connections are refused
            s.bind(("127.0.0.1", 0))
            target = "127.0.0.1:%d" % s.getsockname()[1]
            r = run(BENCH, "--target", target, "--model", "tiny", "--duration", "2",
                    "--no-baselines", timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr[-500:])
        self.assertIn(target + ": not reachable", r.stderr)
        self.assertNotIn("tqkv-bench: 1 target(s)", r.stdout)

    def test_rpc_errors_exit_4(self):
        # Every Put is larger than the server's 4 KiB message limit: all RPCs fail.
        r = run(BENCH, "--spawn-server", SERVER, "--server-arg", "--max-message-bytes",
                "--server-arg", "4K", "--model", "tiny", "--duration", "1", "--concurrency", "1",
                "--no-baselines", "--json", "-")
        self.assertIn('"errors": ', r.stdout)
        self.assertNotIn('"errors": 0,', r.stdout)
        self.assertEqual(r.returncode, 4, r.stderr[-500:])


if __name__ == "__main__":
    CODEC, BENCH, SERVER = sys.argv[1:4]
    del sys.argv[1:4]
    unittest.main(verbosity=2)
