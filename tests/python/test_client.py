#!/usr/bin/python3
"""The tqkv Python package against real tqkv-server processes: BF16 round trips
through packed pages decoded in C (compared byte for byte with the server's own decode
and with tqkv.decode_page of the same pages), NumPy and torch tensors in place, several
targets with replicas surviving a killed server, the TCP data channel and its gRPC
fallback, leases, delete and stats, and errors as tqkv.Error with status and message.
"""
import os
import sys
import tempfile
import unittest

import numpy as np

import tqkv
from tqkv_testutil import Server, rand_hashes, rng

T, H, D = 16, 8, 128
R = rng()


def blocks(layers, n, scale=1.0):
    k = tqkv.bf16_from_float32(R.standard_normal((layers, n, T, H, D)) * scale)
    v = tqkv.bf16_from_float32(R.standard_normal((layers, n, T, H, D)) * 0.5 * scale)
    return k, v


def rel_err(a, b):
    a = tqkv.bf16_to_float32(a).astype(np.float64)
    b = tqkv.bf16_to_float32(b).astype(np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


class OneServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = Server()
        try:
            cls.c = tqkv.Client([cls.srv.addr], transport="tcp")
        except BaseException:
            cls.srv.stop()  # tearDownClass does not run after a failed setUpClass
            raise

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.srv.stop()

    def test_version(self):
        self.assertRegex(tqkv.version(), r"^\d+\.\d+\.\d+$")
        self.assertTrue(os.path.exists(tqkv.library_path) or "libtqkv" in tqkv.library_path)

    def test_round_trip_packed_equals_server_decode(self):
        hs = rand_hashes(R, 6)
        k, v = blocks(3, 6)
        res = self.c.put("rt", hs, k, v, num_layers=3)
        self.assertEqual(res["blocks_stored"], 18)
        prefix, tiers = self.c.lookup("rt", hs + rand_hashes(R, 1), num_layers=3)
        self.assertEqual(prefix, 6)
        self.assertEqual(list(tiers[:6]), [tqkv.TIER_DRAM] * 6)
        self.assertEqual(tiers[6], tqkv.TIER_NONE)
        kp, vp, found = self.c.get("rt", hs, 0, 3, shape=(T, H, D))
        self.assertTrue(found.all())
        kb, vb, found_b = self.c.get("rt", hs, 0, 3, shape=(T, H, D), encoding="bf16")
        self.assertTrue(found_b.all())
        # The client's C decode of the packed pages is the server's decode, exactly.
        self.assertTrue(np.array_equal(kp, kb))
        self.assertTrue(np.array_equal(vp, vb))
        # And the same as decode_page of the raw pages.
        pages = self.c.get_pages("rt", hs, 0, 3)
        self.assertEqual(len(pages), 18)
        for (i, layer), page in pages.items():
            dk, dv = tqkv.decode_page(page)
            self.assertTrue(np.array_equal(dk, kp[layer, i]))
            self.assertTrue(np.array_equal(dv, vp[layer, i]))
        self.assertLess(rel_err(kp, k), 0.3)
        self.assertLess(rel_err(vp, v), 0.3)
        # A sub-range of layers lands at the right place.
        k2, v2, f2 = self.c.get("rt", hs[2:4], 1, 3, shape=(T, H, D))
        self.assertTrue(np.array_equal(k2, kp[1:3, 2:4]))

    def test_missing_blocks_untouched(self):
        hs = rand_hashes(R, 3)
        k, v = blocks(1, 3)
        self.c.put("miss", hs[:2], k[:, :2], v[:, :2])
        ko = np.full((1, 3, T, H, D), 0x1234, np.uint16)
        vo = np.full((1, 3, T, H, D), 0x1234, np.uint16)
        _, _, found = self.c.get("miss", hs, 0, 1, keys=ko, values=vo)
        self.assertEqual(found.tolist(), [[True, True, False]])
        self.assertTrue((ko[0, 2] == 0x1234).all() and (vo[0, 2] == 0x1234).all())
        self.assertFalse((ko[0, 0] == 0x1234).all())

    def test_torch_tensors_in_place(self):
        try:
            import torch
        except ImportError:
            self.skipTest("python3-torch not installed")
        hs = rand_hashes(R, 4)
        kf = torch.randn(2, 4, T, H, D).to(torch.bfloat16)
        vf = torch.randn(2, 4, T, H, D).to(torch.bfloat16)
        self.c.put("torch", hs, kf, vf)
        ko = torch.zeros_like(kf)
        vo = torch.zeros_like(vf)
        ptr = ko.data_ptr()
        k_, v_, found = self.c.get("torch", hs, 0, 2, keys=ko, values=vo)
        self.assertIs(k_, ko)
        self.assertEqual(ko.data_ptr(), ptr)
        self.assertTrue(found.all())
        # Same bits as the NumPy path.
        kn, vn, _ = self.c.get("torch", hs, 0, 2, shape=(T, H, D))
        self.assertTrue(np.array_equal(ko.view(torch.int16).numpy().view(np.uint16), kn))
        err = (ko.float() - kf.float()).norm() / kf.float().norm()
        self.assertLess(float(err), 0.3)
        with self.assertRaises(tqkv.Error) as e:
            self.c.get("torch", hs, 0, 2, keys=ko.transpose(3, 4), values=vo)
        self.assertEqual(e.exception.status, tqkv.EINVAL)

    def test_data_channel_used(self):
        hs = rand_hashes(R, 2)
        k, v = blocks(1, 2)
        self.c.put("dc", hs, k, v)
        self.c.get("dc", hs, 0, 1, shape=(T, H, D))
        self.assertEqual(self.c.data_channel_status(0), "")
        info = {}
        pages = self.c.get_pages("dc", hs, 0, 1, info=info)
        self.assertEqual(info["data_channel"], 2)  # over TCP, not in gRPC messages
        self.assertEqual(info["crc_checked"], 2)
        with tqkv.Client([self.srv.addr], transport="grpc") as g:
            gi = {}
            self.assertEqual(g.get_pages("dc", hs, 0, 1, info=gi), pages)
            self.assertEqual(gi["data_channel"], 0)

    def test_no_data_channel_falls_back(self):
        srv = Server(data_channel=False)
        try:
            with tqkv.Client([srv.addr], transport="tcp") as c:
                hs = rand_hashes(R, 2)
                k, v = blocks(1, 2)
                c.put("nodc", hs, k, v)
                kp, vp, found = c.get("nodc", hs, shape=(T, H, D))
                self.assertTrue(found.all())
                self.assertNotEqual(c.data_channel_status(0), "")  # the reason
        finally:
            srv.stop()

    def test_lease_delete_stats(self):
        hs = rand_hashes(R, 2)
        k, v = blocks(2, 2)
        self.c.put("del", hs, k, v)
        prefix, _ = self.c.lookup("del", hs, num_layers=2, lease_ms=200)
        self.assertEqual(prefix, 2)
        st = self.c.stats("del")
        self.assertEqual(st["pages"], 4)
        self.assertGreater(st["compression_ratio"], 1.0)
        pages, freed = self.c.delete("del", hs[:1])
        self.assertEqual(pages, 2)
        self.assertEqual(self.c.lookup("del", hs, num_layers=2)[0], 0)
        self.assertEqual(self.c.delete("del", all=True)[0], 2)
        self.assertEqual(self.c.health(0), 1)

    def test_errors(self):
        with self.assertRaises(tqkv.Error) as e:
            self.c.lookup("err", [b"short"])
        self.assertEqual(e.exception.status, tqkv.EINVAL)
        self.assertIn("8..64", e.exception.message)
        hs = rand_hashes(R, 1)
        k, v = blocks(1, 1)
        self.c.put("err", hs, k, v)
        # A destination of another shape: EFORMAT naming the hash and layer, never bytes.
        ko = np.zeros((1, 1, T, H, 64), np.uint16)
        with self.assertRaises(tqkv.Error) as e:
            self.c.get("err", hs, 0, 1, keys=ko, values=ko.copy())
        self.assertEqual(e.exception.status_name, "EFORMAT")
        self.assertIn("hash 0 layer 0", e.exception.message)
        with self.assertRaises(tqkv.Error):
            self.c.get("err", hs, 0, 1, keys=np.zeros((1, 1, T, H, D), np.float32),
                       values=np.zeros((1, 1, T, H, D), np.float32))
        # A NULL block address in a grid: EINVAL naming the block, nothing sent after it.
        z = np.zeros((T, H, D), np.uint16)
        ptrs = np.array([z.ctypes.data, 0], np.uintp)
        h2 = rand_hashes(R, 2)
        with self.assertRaises(tqkv.Error) as e:
            self.c.put_ptrs("err", h2, (T, H, D), ptrs, ptrs, 0, 1)
        self.assertEqual(e.exception.status, tqkv.EINVAL)
        self.assertIn("hash 1 layer 0", e.exception.message)
        with self.assertRaises(tqkv.Error):
            self.c.put_ptrs("err", h2, (T, H, D), ptrs[:1], ptrs[:1], 0, 1)
        with self.assertRaises(tqkv.Error) as e:
            tqkv.decode_page(b"\0" * 256)
        self.assertIn(e.exception.status_name, ("EFORMAT", "ECORRUPT"))
        with self.assertRaises(tqkv.Error) as e:
            self.c.put("err", hs, k * 0 + 0x7F80, v)  # +Inf keys: the server refuses them
        self.assertNotEqual(e.exception.message, "")
        with self.assertRaises(tqkv.Error):
            tqkv.Client([], transport="grpc")
        with self.assertRaises(tqkv.Error):
            tqkv.Client(["127.0.0.1:1"], transport="udp")
        c = tqkv.Client([self.srv.addr])
        c.close()
        with self.assertRaises(tqkv.Error):
            c.lookup("err", hs)

    def test_corrupt_page_put_refused(self):
        hs = rand_hashes(R, 1)
        k, v = blocks(1, 1)
        self.c.put("pg", hs, k, v)
        page = self.c.get_pages("pg", hs)[(0, 0)]
        h2 = rand_hashes(R, 1)
        r = self.c.put_pages("pg", [(h2[0], 0, page, None)])
        self.assertEqual(r["blocks_stored"], 1)
        self.assertEqual(self.c.get_pages("pg", h2)[(0, 0)], page)
        bad = bytearray(page)
        bad[len(bad) // 2] ^= 0xFF
        with self.assertRaises(tqkv.Error) as e:
            self.c.put_pages("pg", [(rand_hashes(R, 1)[0], 0, bytes(bad), None)])
        self.assertIn(e.exception.status_name, ("ECORRUPT", "EFORMAT", "EINVAL"))


class Unreachable(unittest.TestCase):
    def test_unavailable(self):
        c = tqkv.Client(["127.0.0.1:1"], wait_for_ready=False, deadline_ms=2000)
        with self.assertRaises(tqkv.Error) as e:
            c.lookup("x", rand_hashes(R, 1))
        self.assertIn(e.exception.status_name, ("EUNAVAILABLE", "ETIMEDOUT"))
        self.assertNotEqual(e.exception.grpc_code, 0)
        c.close()


class Auth(unittest.TestCase):
    def test_token(self):
        with tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False) as f:
            f.write("writer-1 rw ns-a\n")
            path = f.name
        srv = Server("--auth-tokens", path)
        try:
            ok = tqkv.Client([srv.addr], token="writer-1")
            hs = rand_hashes(R, 1)
            k, v = blocks(1, 1)
            ok.put("ns-a", hs, k, v)
            self.assertEqual(ok.lookup("ns-a", hs)[0], 1)
            bad = tqkv.Client([srv.addr], token="nope")
            with self.assertRaises(tqkv.Error) as e:
                bad.lookup("ns-a", hs)
            self.assertEqual(e.exception.status_name, "EAUTH")
            with self.assertRaises(tqkv.Error) as e:
                ok.lookup("ns-b", hs)
            self.assertEqual(e.exception.status_name, "EPERM")
            ok.close()
            bad.close()
        finally:
            srv.stop()
            os.unlink(path)


class Tls(unittest.TestCase):
    def test_tls_with_token(self):
        import subprocess
        d = tempfile.mkdtemp(prefix="tqkv-py-tls-")
        cert, key, toks = (os.path.join(d, n) for n in ("cert.pem", "key.pem", "tokens"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        key, "-out", cert, "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
                       capture_output=True)
        with open(toks, "w") as f:
            f.write("tls-token-1 rw tls\n")
        srv = Server("--tls-cert", cert, "--tls-key", key, "--auth-tokens", toks,
                     data_channel=False)
        try:
            c = tqkv.Client([srv.addr], tls_ca=cert, token="tls-token-1")
            hs = rand_hashes(R, 2)
            k, v = blocks(1, 2)
            c.put("tls", hs, k, v)
            kp, vp, found = c.get("tls", hs, shape=(T, H, D))
            self.assertTrue(found.all())
            self.assertLess(rel_err(kp, k), 0.3)
            c.close()
            # Plaintext against a TLS server: an error, not a hang or a crash.
            plain = tqkv.Client([srv.addr], token="tls-token-1", wait_for_ready=False,
                                deadline_ms=3000)
            with self.assertRaises(tqkv.Error):
                plain.lookup("tls", hs)
            plain.close()
        finally:
            srv.stop()
            for n in (cert, key, toks):
                os.unlink(n)
            os.rmdir(d)


class Sharded(unittest.TestCase):
    def test_replicas_survive_a_killed_target(self):
        srvs = []
        try:
            for i in range(3):
                srvs.append(Server(data_channel=(i != 1)))
            c = tqkv.Client([s.addr for s in srvs], replicas=2, transport="tcp",
                            deadline_ms=5000, wait_for_ready=False)
            hs = rand_hashes(R, 24)
            k, v = blocks(2, 24)
            res = c.put("shard", hs, k, v, num_layers=2)
            self.assertEqual(res["blocks_stored"], 24 * 2 * 2)  # two replicas
            per = [tqkv.Client([s.addr]).stats("shard")["pages"] for s in srvs]
            self.assertEqual(sum(per), 96)
            self.assertTrue(all(p > 0 for p in per), per)
            kp, vp, found = c.get("shard", hs, 0, 2, shape=(T, H, D))
            self.assertTrue(found.all())
            srvs[0].kill()
            self.assertEqual(c.lookup("shard", hs, num_layers=2)[0], 24)
            k2, v2, found2 = c.get("shard", hs, 0, 2, shape=(T, H, D))
            self.assertTrue(found2.all())
            # Replicas hold the same page: the same decode, whichever answered.
            self.assertTrue(np.array_equal(k2, kp) and np.array_equal(v2, vp))
            c.close()
        finally:
            for s in srvs:
                s.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
