#!/usr/bin/env python3
"""tqkv.sglang_backend.TqkvHiCacheStorage against the installed sglang's HiCache storage
interface and a real tqkv-server: created through sglang's own StorageBackendFactory
("dynamic" back-end, extra_config as a user writes it), called as sglang's cache
controller calls the v1 interface (batch_exists with HiCacheStorageExtraInfo,
batch_set_v1 / batch_get_v1 with host indices into the host KV pool).

Run with the "sglang" venv (deploy/python-env.sh sglang). Exits 77 (SKIP) naming what
failed when sglang cannot be imported.
"""
import os
import sys
import unittest

import numpy as np

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                      HiCacheStorageExtraInfo)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    import sglang
except Exception as e:  # noqa: BLE001
    print("SKIPPED: sglang is not importable with %s (%s: %s); run under the venv of "
          "deploy/python-env.sh sglang" % (sys.executable, type(e).__name__, e))
    sys.exit(77)

from tqkv_testutil import Server, rng  # noqa: E402
from tqkv.sglang_backend import HAVE_SGLANG, TqkvHiCacheStorage, key_hash  # noqa: E402

R = rng(23)
L, H, D, PS, PAGES = 4, 2, 64, 16, 64  # host pool: 64 pages of 16 tokens


class HostPool:
    """The host KV pool attributes the v1 interface reads, laid out as sglang's
    MHATokenToKVPoolHost lays them out: "layer_first" k_buffer [L][size][H][D] with
    k_data_refs[l] = k_buffer[l]; "page_first" k_buffer [size][L][H][D] with
    k_data_refs[l] = k_buffer.transpose(0, 1)[l] (mem_cache/pool_host/mha.py)."""

    def __init__(self, layout):
        self.layout, self.page_size, self.dtype = layout, PS, torch.bfloat16
        self.head_num, self.head_dim, self.v_head_dim, self.layer_num = H, D, D, L
        self.size = PAGES * PS
        if layout == "layer_first":
            self.k_buffer = torch.zeros((L, self.size, H, D), dtype=torch.bfloat16)
            self.v_buffer = torch.zeros_like(self.k_buffer)
            self.k_data_refs = [self.k_buffer[i] for i in range(L)]
            self.v_data_refs = [self.v_buffer[i] for i in range(L)]
        else:
            self.k_buffer = torch.zeros((self.size, L, H, D), dtype=torch.bfloat16)
            self.v_buffer = torch.zeros_like(self.k_buffer)
            self.k_data_refs = [self.k_buffer.transpose(0, 1)[i] for i in range(L)]
            self.v_data_refs = [self.v_buffer.transpose(0, 1)[i] for i in range(L)]

    def fill(self, pages, seed):
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            for l in range(L):
                self.k_data_refs[l][p * PS:(p + 1) * PS] = torch.randn((PS, H, D), generator=g)
                self.v_data_refs[l][p * PS:(p + 1) * PS] = torch.randn((PS, H, D), generator=g)

    def page(self, p):
        return (torch.stack([self.k_data_refs[l][p * PS:(p + 1) * PS] for l in range(L)]),
                torch.stack([self.v_data_refs[l][p * PS:(p + 1) * PS] for l in range(L)]))


def indices(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in pages])


def keys(n, salt=b""):
    # sglang's page keys: a hex SHA-256 chain over the page tokens
    import hashlib
    out, h = [], b""
    for i in range(n):
        h = hashlib.sha256(h + salt + bytes([i])).digest()
        out.append(h.hex())
    return out


class Backend(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = Server(capacity="1G")
        print("sglang %s from %s" % (sglang.__version__, os.path.dirname(sglang.__file__)),
              file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def make(self, layout, targets=None, ns="tiny-llama", **extra):
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=layout != "layer_first", model_name=ns,
            extra_config=dict({"backend_name": "tqkv", "module_path": "tqkv.sglang_backend",
                               "class_name": "TqkvHiCacheStorage", "interface_v1": 1,
                               "tqkv_targets": targets or [self.srv.addr],
                               "tqkv_deadline_ms": 3000}, **extra))
        pool = HostPool(layout)
        b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        b.register_mem_pool_host(pool)  # what HiCacheController.attach_storage_backend does
        return b, pool

    def test_real_interface(self):
        self.assertTrue(HAVE_SGLANG)
        self.assertTrue(issubclass(TqkvHiCacheStorage, HiCacheStorage))
        self.assertEqual(TqkvHiCacheStorage.__abstractmethods__, frozenset())

    def roundtrip(self, layout, ns):
        a, pa = self.make(layout, ns=ns)
        self.assertEqual(a._direct, layout == "layer_first")
        k = keys(12, ns.encode())
        src = [3, 9, 1, 40, 41, 42, 7, 8, 20, 21, 22, 23]
        pa.fill(src, 5)
        self.assertEqual(a.batch_exists(k, HiCacheStorageExtraInfo()), 0)
        # two backups, the second continuing the first's chain
        self.assertEqual(a.batch_set_v1(k[:5], indices(src[:5]), HiCacheStorageExtraInfo()),
                         [True] * 5)
        self.assertEqual(a.batch_set_v1(k[5:], indices(src[5:]),
                                        HiCacheStorageExtraInfo(prefix_keys=k[:5])), [True] * 7)
        self.assertEqual(a.batch_exists(k), 12)
        self.assertEqual(a.batch_exists(k[:3] + keys(2, b"other")), 3)
        # another engine (fresh pool) prefetches them into other host pages
        b, pb = self.make(layout, ns=ns)
        dst = [50, 2, 33, 4, 5, 6, 60, 61, 62, 63, 10, 11]
        self.assertEqual(b.batch_get_v1(k, indices(dst)), [True] * 12)
        errs = []
        for s, d in zip(src, dst):
            ka, va = pa.page(s)
            kb, vb = pb.page(d)
            e = float(((kb.float() - ka.float()).norm() / ka.float().norm()))
            errs.append(e)
        self.assertLess(max(errs), 0.3)  # default lossy policy
        # the pages decoded are exactly the server's pages decoded
        import tqkv
        with tqkv.Client([self.srv.addr]) as c:
            kk, vv, found = c.get(a.ns, [key_hash(x) for x in k], 0, L, shape=(PS, H, D))
        self.assertTrue(found.all())
        for i, d in enumerate(dst):
            kb, vb = pb.page(d)
            self.assertTrue(np.array_equal(kk[:, i], kb.view(torch.int16).numpy().view(np.uint16)))
            self.assertTrue(np.array_equal(vv[:, i], vb.view(torch.int16).numpy().view(np.uint16)))
        # pages not asked for are untouched
        self.assertEqual(float(pb.page(0)[0].float().abs().sum()), 0.0)
        # a missing page in the middle: False for it, the others found
        mixed = k[:2] + keys(1, b"absent") + k[3:5]
        self.assertEqual(b.batch_get_v1(mixed, indices([12, 13, 14, 15, 16])),
                         [True, True, False, True, True])
        print("  %s: 12 pages x %d layers, max rel err %.3f, stats %s" %
              (layout, L, max(errs), b.get_stats()), file=sys.stderr)
        a.close()
        b.close()

    def test_layer_first_zero_copy(self):
        self.roundtrip("layer_first", "ns-layer-first")

    def test_page_first_staged(self):
        self.roundtrip("page_first", "ns-page-first")

    def test_server_down_is_a_miss(self):
        srv = Server(capacity="256M")
        try:
            a, pa = self.make("layer_first", targets=[srv.addr], ns="down")
            k = keys(4, b"down")
            pa.fill([0, 1, 2, 3], 9)
            self.assertEqual(a.batch_set_v1(k, indices([0, 1, 2, 3])), [True] * 4)
            srv.kill()
            before = [t.clone() for t in pa.k_data_refs]
            self.assertEqual(a.batch_exists(k), 0)
            self.assertEqual(a.batch_get_v1(k, indices([8, 9, 10, 11])), [False] * 4)
            self.assertEqual(a.batch_set_v1(k, indices([0, 1, 2, 3])), [False] * 4)
            st = a.get_stats()
            self.assertGreaterEqual(st["get_errors"], 1)
            self.assertGreaterEqual(st["exists_errors"], 1)
            for t0, t1 in zip(before, pa.k_data_refs):
                self.assertTrue(torch.equal(t0, t1))  # nothing written on failure
            a.close()
        finally:
            srv.stop()

    def test_requires_interface_v1(self):
        with self.assertRaises(Exception) as cm:
            self.make("layer_first", interface_v1=0)
        self.assertIn("interface_v1", str(cm.exception))

    def test_real_host_pool_class(self):
        """sglang's own MHATokenToKVPoolHost where it can be built on this machine."""
        try:
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
        except Exception as e:  # noqa: BLE001
            self.skipTest("sglang's MHATokenToKVPoolHost does not import here (%s: %s); the "
                          "host pool above copies its per-layer views" % (type(e).__name__, e))


if __name__ == "__main__":
    unittest.main(verbosity=2)
