#!/usr/bin/python3
"""Lossless pages (raw BF16, proto/PAGE_FORMAT.md mode 2) through real tqkv-server
processes, from the Python package (tqkv.Client over libtqkv.so).

Every check compares the BF16 bytes a Get returns with the bytes Put, exactly:
- Put(lossless=True) / Get over gRPC (packed and server-decoded BF16) and over the TCP
  data channel; the pages are raw (mode 2 for K and V, the input bytes in their sections);
  PutResponse totals and Stats count the page bytes and the BF16 bytes they replace.
- Namespace policies: 'NS:lossless' and 'NS:value-mode=lossless' without any request
  option; other namespaces stay lossy.
- Bad combinations get INVALID_ARGUMENT / exit status 2 with a reason (lossless with a
  bit width, per request and per namespace).
- The disk tier: Put, SIGTERM, restart on the same directory, every page read back from
  disk (gRPC and data channel).
- Hand-off: SIGTERM a server started with --peers and --handoff-seconds; its peer serves
  every block.
- tqkv-codec: encode-kv --lossless, decode-kv gives the input files back, info names the
  mode; --key-bits with --key-mode lossless is refused.

Environment (tests/lossless.cmake): TQKV_SERVER, TQKV_LIBRARY, TQKV_CODEC, PYTHONPATH with
transport/python.
"""
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import tqkv  # noqa: E402
import tqkv_testutil as tu  # noqa: E402

T, H, D = 16, 4, 128
L = 2
PAGE = 128 + 2 * ((2 * T * H * D + 63) // 64 * 64)  # header + raw K + raw V sections
BF16 = 2 * T * H * D  # bytes of one tensor


def make_data(r, n):
    """[L][n][T][H][D] BF16 keys and values, with the values that must survive bit for
    bit: -0, a subnormal, the largest finite values."""
    k = tqkv.bf16_from_float32(r.standard_normal((L, n, T, H, D), dtype=np.float32) * 3)
    v = tqkv.bf16_from_float32(r.standard_normal((L, n, T, H, D), dtype=np.float32))
    k[0, 0, 0, 0, :4] = [0x8000, 0x0001, 0x7F7F, 0xFF7F]
    v[-1, -1, -1, -1, -4:] = [0x8000, 0x0001, 0x7F7F, 0xFF7F]
    return k, v


def page_modes(page):
    """(K mode, V mode, K bits_x2, V bits_x2) from a page header."""
    return page[40], page[80], page[41], page[81]


def raw_sections(page):
    """The raw K and V sections of a lossless page (group_offset[0] of each descriptor)."""
    ko = struct.unpack_from("<I", page, 40 + 12)[0]
    vo = struct.unpack_from("<I", page, 80 + 12)[0]
    return page[ko:ko + BF16], page[vo:vo + BF16]


class Lossless(unittest.TestCase):
    def setUp(self):
        self.r = tu.rng(zlib.crc32(self.id().encode()) & 0xFFFF)
        self.servers = []
        self.dirs = []

    def tearDown(self):
        for s in self.servers:
            s.stop()
            if s.proc.returncode not in (0, -9):
                print("".join(s.stderr_lines), file=sys.stderr)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    def server(self, *extra, **kw):
        s = tu.Server(*extra, **kw)
        self.servers.append(s)
        return s

    def assert_all_back(self, c, ns, hashes, k, v, what, encoding="packed"):
        gk, gv, found = c.get(ns, hashes, 0, L, shape=(T, H, D), encoding=encoding)
        self.assertTrue(found.all(), "%s: %d of %d blocks missing" % (what, (~found).sum(),
                                                                       found.size))
        self.assertEqual(gk.tobytes(), k.tobytes(), "%s: keys differ" % what)
        self.assertEqual(gv.tobytes(), v.tobytes(), "%s: values differ" % what)

    def assert_raw_pages(self, c, ns, hashes, k, v, info=None):
        pages = c.get_pages(ns, hashes, 0, L, info=info)
        self.assertEqual(len(pages), L * len(hashes))
        for (i, layer), pg in pages.items():
            self.assertEqual(len(pg), PAGE)
            self.assertEqual(page_modes(pg), (2, 2, 32, 32))
            rk, rv = raw_sections(pg)
            self.assertEqual(rk, k[layer, i].tobytes())
            self.assertEqual(rv, v[layer, i].tobytes())
        return pages

    def test_grpc_and_data_channel(self):
        s = self.server()
        n = 6
        k, v = make_data(self.r, n)
        hs = tu.rand_hashes(self.r, n)
        with tqkv.Client(s.addr, transport="grpc") as c:
            res = c.put("exact", hs, k, v, num_layers=L, lossless=True)
            self.assertEqual(res["blocks_stored"], n * L)
            self.assertEqual(res["bytes_in"], n * L * 2 * BF16)
            self.assertEqual(res["bytes_stored"], n * L * PAGE)
            self.assert_all_back(c, "exact", hs, k, v, "gRPC packed")
            self.assert_all_back(c, "exact", hs, k, v, "gRPC bf16", encoding="bf16")
            self.assert_raw_pages(c, "exact", hs, k, v)
            # one tqkv.decode_page of a page: its input
            pg = c.get_pages("exact", hs[:1], 1, 2)[(0, 1)]
            dk, dv = tqkv.decode_page(pg)
            self.assertEqual(dk.tobytes(), k[1, 0].tobytes())
            self.assertEqual(dv.tobytes(), v[1, 0].tobytes())
            st = c.stats("exact")
            self.assertEqual(st["pages"], n * L)
            self.assertEqual(st["page_bytes"], n * L * PAGE)
            self.assertEqual(st["bf16_bytes"], n * L * 2 * BF16)
            self.assertAlmostEqual(st["compression_ratio"], 2 * BF16 / PAGE, places=6)
        with tqkv.Client(s.addr, transport="tcp") as c:
            self.assertEqual(c.data_channel_status(0), "")
            self.assert_all_back(c, "exact", hs, k, v, "data channel")
            info = {}
            self.assert_raw_pages(c, "exact", hs, k, v, info=info)
            self.assertEqual(info["data_channel"], n * L, "pages not over the data channel")

    def test_per_tensor_and_namespace_policy(self):
        s = self.server("--namespace-policy", "exact*:lossless",
                        "--namespace-policy", "vals:value-mode=lossless")
        n = 3
        k, v = make_data(self.r, n)
        hs = tu.rand_hashes(self.r, n)
        with tqkv.Client(s.addr, transport="grpc") as c:
            for ns in ("exact-a", "vals", "plain"):
                c.put(ns, hs, k, v, num_layers=L)
            self.assert_all_back(c, "exact-a", hs, k, v, "namespace lossless")
            self.assert_raw_pages(c, "exact-a", hs, k, v)
            for (i, layer), pg in c.get_pages("vals", hs, 0, L).items():
                self.assertEqual(page_modes(pg)[0:2], (0, 2))
                dk, dv = tqkv.decode_page(pg)
                self.assertEqual(dv.tobytes(), v[layer, i].tobytes())
                self.assertNotEqual(dk.tobytes(), k[layer, i].tobytes())
            for pg in c.get_pages("plain", hs, 0, L).values():
                self.assertEqual(page_modes(pg)[0:2], (0, 0))
                self.assertLess(len(pg), PAGE // 3)
            # per request: key lossless only, in a lossy namespace; a bit width on the
            # namespace's lossless tensor makes it lossy again
            h2 = tu.rand_hashes(self.r, n)
            c.put("plain", h2, k, v, num_layers=L, lossless="key")
            c.put("exact-b", h2, k, v, num_layers=L, value_bits=4)
            for (i, layer), pg in c.get_pages("plain", h2, 0, L).items():
                self.assertEqual(page_modes(pg)[0:2], (2, 0))
                dk, _ = tqkv.decode_page(pg)
                self.assertEqual(dk.tobytes(), k[layer, i].tobytes())
            for pg in c.get_pages("exact-b", h2, 0, L).values():
                self.assertEqual(page_modes(pg), (2, 0, 32, 8))

    def test_bad_combinations(self):
        s = self.server()
        k, v = make_data(self.r, 1)
        hs = tu.rand_hashes(self.r, 1)
        with tqkv.Client(s.addr, transport="grpc") as c:
            with self.assertRaises(tqkv.Error) as e:
                c.put("x", hs, k, v, key_bits=3, lossless=True)
            self.assertIn("MODE_LOSSLESS", str(e.exception))
            self.assertIn("key_bits", str(e.exception))
            with self.assertRaises(tqkv.Error) as e:
                c.put("x", hs, k, v, value_bits=2.5, lossless="value")
            self.assertIn("value_bits", str(e.exception))
            with self.assertRaises(tqkv.Error):
                c.put("x", hs, k, v, lossless="both")
            self.assertEqual(c.stats("x")["pages"], 0)
        for spec, want in ((["--namespace-policy", "x:lossless,key-bits=3"], "key-bits"),
                           (["--value-mode", "lossless", "--value-bits", "2"], "value-bits"),
                           (["--key-mode", "raw"], "mse, prod or lossless")):
            p = subprocess.run([tu.SERVER, "--listen", "127.0.0.1:0"] + spec,
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 2, "%s: %s" % (spec, p.stderr))
            self.assertIn(want, p.stderr)

    def test_disk_tier_restart(self):
        d = tempfile.mkdtemp(prefix="tqkv-lossless-", dir=os.environ.get("TQKV_TEST_DIR"))
        self.dirs.append(d)
        args = ["--disk-path", d, "--disk-capacity", "64M", "--namespace-policy",
                "exact:lossless"]
        n = 40  # 80 pages of 16.5 KiB: more than the 1 MiB of DRAM, so most live on disk
        k, v = make_data(self.r, n)
        hs = tu.rand_hashes(self.r, n)
        s = self.server(*args, capacity="1M")
        with tqkv.Client(s.addr, transport="grpc") as c:
            c.put("exact", hs, k, v, num_layers=L)
            self.assert_all_back(c, "exact", hs, k, v, "disk tier, before the restart")
        s.stop()
        self.assertEqual(s.proc.returncode, 0)
        s2 = self.server(*args, capacity="1M")
        with tqkv.Client(s2.addr, transport="grpc") as c:
            prefix, tiers = c.lookup("exact", hs, num_layers=L)
            self.assertEqual(prefix, n)
            self.assertGreater(int((tiers == 3).sum()), n // 2, "blocks on disk: %s" % tiers)
            self.assert_all_back(c, "exact", hs, k, v, "disk tier after the restart, gRPC")
            self.assert_raw_pages(c, "exact", hs, k, v)
        with tqkv.Client(s2.addr, transport="tcp") as c:
            self.assert_all_back(c, "exact", hs, k, v, "disk tier after the restart, TCP")

    def test_handoff(self):
        b = self.server("--node-id", "lossless-b")
        a = self.server("--node-id", "lossless-a", "--peers", b.addr, "--no-forward",
                        "--handoff-seconds", "20", "--namespace-policy", "exact:lossless")
        n = 8
        k, v = make_data(self.r, n)
        hs = tu.rand_hashes(self.r, n)
        with tqkv.Client(a.addr, transport="grpc") as c:
            c.put("exact", hs, k, v, num_layers=L)
            self.assertEqual(c.stats("exact")["pages"], n * L)
        t0 = time.time()
        a.stop(timeout=60)
        self.assertEqual(a.proc.returncode, 0)
        with tqkv.Client(b.addr, transport="grpc") as c:
            self.assertEqual(c.stats("exact")["pages"], n * L,
                             "hand-off incomplete after %.1f s" % (time.time() - t0))
            self.assert_all_back(c, "exact", hs, k, v, "after hand-off")
            self.assert_raw_pages(c, "exact", hs, k, v)

    def test_codec_cli(self):
        codec = os.environ.get("TQKV_CODEC", "")
        if not codec:
            self.skipTest("TQKV_CODEC is not set")
        d = tempfile.mkdtemp(prefix="tqkv-lossless-cli-")
        self.dirs.append(d)
        k, v = make_data(self.r, 1)
        f = {n: os.path.join(d, n) for n in ("k", "v", "p", "k2", "v2")}
        for name, a in (("k", k), ("v", v)):
            with open(f[name], "wb") as fh:
                fh.write(a.tobytes())
        shape = ["--tokens", str(L * T), "--heads", str(H), "--dim", str(D)]
        run = lambda *a: subprocess.run([codec, *a], capture_output=True, text=True,
                                           timeout=120)
        p = run("encode-kv", *shape, "--block", str(T), "--lossless", f["k"], f["v"], f["p"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(os.path.getsize(f["p"]), L * PAGE)
        p = run("decode-kv", f["p"], f["k2"], f["v2"])
        self.assertEqual(p.returncode, 0, p.stderr)
        for a, b in (("k", "k2"), ("v", "v2")):
            with open(f[a], "rb") as x, open(f[b], "rb") as y:
                self.assertEqual(x.read(), y.read(), "decode-kv %s differs" % a)
        p = run("info", "--pages", f["p"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("K 16 bits lossless", p.stdout)
        self.assertIn("V 16 bits lossless", p.stdout)
        p = run("encode-kv", *shape, "--key-mode", "lossless", "--key-bits", "3", f["k"], f["v"],
                f["p"])
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("no bit width", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
