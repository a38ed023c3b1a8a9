#!/usr/bin/env python3
"""tqkv.lmcache_backend against the installed LMCache and a real tqkv-server: the plug-in
is loaded by LMCache's own configuration (LMCacheEngineConfig with remote_url tqkv://...,
remote_storage_plugins and extra_config module_path/class_name, through LMCache's
CreateConnector), with LMCache's LMCacheMetadata, CacheEngineKey and LocalCPUBackend
memory objects (KV_2LTD BF16 chunks): put, exists, get (full and tail chunks), a miss,
a killed server (a miss, never wrong KV).

Run with the "lmcache" venv (deploy/python-env.sh lmcache). Exits 77 (SKIP) naming what
failed when lmcache cannot be imported.
"""
import asyncio
import os
import sys
import unittest

import numpy as np

try:
    import torch
    import lmcache
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
except Exception as e:  # noqa: BLE001
    print("SKIPPED: lmcache is not importable with %s (%s: %s); run under the venv of "
          "deploy/python-env.sh lmcache" % (sys.executable, type(e).__name__, e))
    sys.exit(77)

from tqkv_testutil import Server, rng  # noqa: E402
from tqkv.lmcache_backend import (HAVE_LMCACHE, TqkvRemoteConnector,  # noqa: E402
                                  chunk_hash)

R = rng(29)
L, H, D, CHUNK = 4, 2, 64, 32
MODEL = "tiny-llama"


def config(url):
    return LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.1,
        "remote_url": url, "remote_serde": "naive",
        "remote_storage_plugins": ["tqkv"],
        "extra_config": {"remote_storage_plugin.tqkv.module_path": "tqkv.lmcache_backend",
                         "remote_storage_plugin.tqkv.class_name": "TqkvConnectorAdapter",
                         "tqkv_deadline_ms": 3000}})


def metadata():
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK)


def key(i):
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0,
                          chunk_hash=int(R.integers(1, 2**62)) + i, dtype=torch.bfloat16)


class Backend(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = Server(capacity="1G")
        cls.loop = asyncio.new_event_loop()
        print("lmcache from %s" % os.path.dirname(lmcache.__file__), file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.loop.close()
        cls.srv.stop()

    def run_(self, coro):
        return self.loop.run_until_complete(coro)

    def connector(self, addr=None):
        cfg = config("tqkv://" + (addr or self.srv.addr))
        md = metadata()
        cpu = LocalCPUBackend(cfg, md)
        conn = CreateConnector(cfg.remote_url, self.loop, cpu, cfg, md)
        return conn, cpu

    def chunk(self, cpu, T, seed):
        obj = cpu.allocate([torch.Size([2, L, T, H * D])], [torch.bfloat16])
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(tuple(obj.tensor.shape), generator=g))
        return obj

    def test_loaded_by_lmcache_config(self):
        self.assertTrue(HAVE_LMCACHE)
        conn, _ = self.connector()
        inner = getattr(conn, "connector", None) or getattr(conn, "_connector", None) or conn
        names = [type(conn).__name__, type(inner).__name__]
        self.assertTrue(any(isinstance(x, TqkvRemoteConnector) for x in (conn, inner))
                        or "TqkvRemoteConnector" in repr(conn) or
                        any("Tqkv" in n for n in names), names)
        self.run_(conn.close())

    def test_put_get_full_and_tail(self):
        a, cpu_a = self.connector()
        b, cpu_b = self.connector()
        keys = [key(i) for i in range(5)]
        sizes = [CHUNK] * 4 + [11]  # the prompt's tail chunk is shorter
        objs = [self.chunk(cpu_a, T, 100 + i) for i, T in enumerate(sizes)]
        for k in keys:
            self.assertFalse(self.run_(a.exists(k)))
        refs = [o.tensor.clone() for o in objs]  # a put hands the object to LMCache
        for k, o in zip(keys, objs):
            self.run_(a.put(k, o))
        for k in keys:
            self.assertTrue(self.run_(b.exists(k)))
            self.assertTrue(b.exists_sync(k))
        import tqkv
        worst = 0.0
        with tqkv.Client([self.srv.addr]) as c:
            for k, o, T in zip(keys, refs, sizes):
                got = self.run_(b.get(k))
                self.assertIsNotNone(got)
                t = got.tensor
                self.assertEqual(tuple(t.shape), (2, L, T, H * D))
                # exactly the server's pages decoded ...
                kk, vv, found = c.get("lmcache/" + MODEL, [chunk_hash(k)], 0, L,
                                      shape=(T, H, D))
                self.assertTrue(found.all())
                self.assertTrue(np.array_equal(
                    kk[:, 0].reshape(L, T, H * D),
                    t[0].contiguous().view(torch.int16).numpy().view(np.uint16)))
                self.assertTrue(np.array_equal(
                    vv[:, 0].reshape(L, T, H * D),
                    t[1].contiguous().view(torch.int16).numpy().view(np.uint16)))
                # ... and close to what was put (default lossy policy)
                e = float((t.float() - o.float()).norm() / o.float().norm())
                worst = max(worst, e)
                got.ref_count_down()
        self.assertLess(worst, 0.3)
        self.assertIsNone(self.run_(b.get(key(99))))  # a miss
        st = self._stats(b)
        self.assertGreaterEqual(st["partial_gets"], 1)
        print("  5 chunks (%d-token and a 11-token tail) x %d layers, max rel err %.3f" %
              (CHUNK, L, worst), file=sys.stderr)
        self.run_(a.close())
        self.run_(b.close())

    def _stats(self, conn):
        for x in (conn, getattr(conn, "connector", None), getattr(conn, "_connector", None),
                  getattr(conn, "inner", None)):
            if isinstance(x, TqkvRemoteConnector):
                return x.stats()
        for v in vars(conn).values():
            if isinstance(v, TqkvRemoteConnector):
                return v.stats()
        raise AssertionError("no TqkvRemoteConnector inside %r" % (conn,))

    def test_server_killed_is_a_miss(self):
        srv = Server(capacity="256M")
        try:
            a, cpu = self.connector(srv.addr)
            k = key(7)
            self.run_(a.put(k, self.chunk(cpu, CHUNK, 7)))
            self.assertTrue(self.run_(a.exists(k)))
            srv.kill()
            self.assertFalse(self.run_(a.exists(k)))
            self.assertIsNone(self.run_(a.get(k)))
            st = self._stats(a)
            self.assertGreaterEqual(st["exists_errors"], 1)
            self.run_(a.close())
        finally:
            srv.stop()

    def test_bad_url(self):
        from tqkv.lmcache_backend import parse_targets
        self.assertEqual(parse_targets("tqkv://a:1,b:2/x"), ["a:1", "b:2"])
        for bad in ("tqkv://", "tqkv://host", "redis://a:1"):
            with self.assertRaises(ValueError):
                parse_targets(bad)


if __name__ == "__main__":
    unittest.main(verbosity=2)
