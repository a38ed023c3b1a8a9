#!/usr/bin/python3
"""TqkvConnector (tqkv.vllm_connector) between two engine processes (vllm_engine.py)
with a llama3-8b-shaped paged KV cache: 32 layers, 8 KV heads, head_size 128, 16-token
blocks, BF16, FlashAttention's layout. The first engine "prefills" a prompt and saves it
through the connector; the second, with another block table, loads it through the
connector. Every block of the second engine must then hold exactly tqkv-codec's
decode-kv of the same page (loaded) or the original KV (computed or recomputed):
full hits, partial prefix hits, misses, an eviction after the lease expired, a server
killed mid-load and a server down at Lookup - failures are misses, counted.

TQKV_CONNECTOR_TOKENS sets the prompt length (default 645: 40 full blocks).
"""
import json
import os
import subprocess
import sys
import unittest

import numpy as np

from tqkv_testutil import Server, rng

HERE = os.path.dirname(os.path.abspath(__file__))
L, H, D, BS = 32, 8, 128, 16
N = int(os.environ.get("TQKV_CONNECTOR_TOKENS", "645"))
R = rng(17)


def prompt(n, vocab=128000):
    return R.integers(0, vocab, n).tolist()


def engine(**cfg):
    base = dict(layers=L, heads=H, dim=D, block_size=BS, seed=5,
                num_blocks=(len(cfg["tokens"]) + BS - 1) // BS + 8)
    base.update(cfg)
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_engine.py"), json.dumps(base)],
                       capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise AssertionError("engine failed:\n" + p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


class Connector(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = Server(capacity="4G")
        cls.tg = [cls.srv.addr]
        cls.P = prompt(N)
        a = engine(targets=cls.tg, tokens=cls.P, table_seed=1)
        cls.saved = a

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def check_clean(self, r):
        self.assertTrue(r["codec_equal"], r["errors"])
        self.assertTrue(r["original_equal"], r["errors"])

    def test_1_save(self):
        a = self.saved
        self.assertEqual(a["ext_tokens"], 0)  # nothing stored before
        self.assertEqual(a["stats"]["save_blocks"], (N // BS) * L)
        self.assertEqual(a["stats"]["save_failed_blocks"], 0)
        self.assertEqual(a["sched_stats"]["lookups"], 1)

    def test_2_full_hit_other_block_table(self):
        b = engine(targets=self.tg, tokens=self.P, table_seed=2, verify_targets=self.tg)
        self.assertNotEqual(b["table"], self.saved["table"])
        hit = ((N - 1) // BS) * BS
        self.assertEqual(b["ext_tokens"], hit)
        self.assertEqual(b["failed_blocks"], 0)
        self.assertEqual(b["stats"]["load_blocks"], hit // BS)
        self.assertEqual(b["checked_pages"], (hit // BS) * L)
        self.assertLess(b["loaded_rel_err"], 0.3)
        self.check_clean(b)

    def test_3_partial_prefix_hit(self):
        m = 16 * 11 + 7  # diverges inside block 11: blocks 0..10 hit
        p2 = self.P[:m] + prompt(200)
        b = engine(targets=self.tg, tokens=p2, table_seed=3, verify_targets=self.tg)
        self.assertEqual(b["ext_tokens"], 11 * BS)
        self.assertEqual(b["failed_blocks"], 0)
        self.assertEqual(b["stats"]["load_blocks"], 11)
        self.check_clean(b)

    def test_4_miss(self):
        b = engine(targets=self.tg, tokens=prompt(300), table_seed=4, verify_targets=self.tg)
        self.assertEqual(b["ext_tokens"], 0)
        self.assertEqual(b["stats"]["load_blocks"], 0)
        self.assertEqual(b["sched_stats"]["lookup_hit_tokens"], 0)
        self.check_clean(b)

    def test_5_lease_expired_then_evicted(self):
        p3 = prompt(16 * 20 + 3)
        engine(targets=self.tg, tokens=p3, table_seed=5)
        b = engine(targets=self.tg, tokens=p3, table_seed=6, lease_ms=200, expire_then_delete=1)
        self.assertEqual(b["ext_tokens"], 20 * BS)  # offered at Lookup ...
        self.assertEqual(b["failed_blocks"], 20)  # ... gone at load: all recomputed
        self.assertEqual(b["stats"]["load_failed_blocks"], 20)
        self.assertEqual(b["stats"]["load_blocks"], 0)
        self.assertEqual(b["recompute_from"], 0)
        self.check_clean(b)

    def test_6_server_killed_mid_load(self):
        srv = Server(capacity="2G")
        try:
            p4 = prompt(4096 + 1)  # 256 blocks x 32 layers: the load takes a while
            a = engine(targets=[srv.addr], tokens=p4, table_seed=7)
            self.assertEqual(a["stats"]["save_failed_blocks"], 0)
            b = engine(targets=[srv.addr], tokens=p4, table_seed=8, kill_pid=srv.proc.pid,
                       kill_at_layer=0, tqkv_layers_per_get=1, verify=[0, 1, 15, 31])
            self.assertEqual(b["ext_tokens"], 4096)
            self.assertEqual(b["failed_blocks"], 256)  # any layer lost: the whole prefix
            self.assertEqual(b["stats"]["load_failed_blocks"], 256)
            self.assertGreaterEqual(b["stats"]["load_errors"], 1)
            self.check_clean(b)
            # And with the server gone, Lookup is a counted miss.
            c = engine(targets=[srv.addr], tokens=p4, table_seed=9, deadline_ms=1000,
                       verify=[0])
            self.assertEqual(c["ext_tokens"], 0)
            self.assertEqual(c["sched_stats"]["lookup_errors"], 1)
            self.assertGreaterEqual(c["stats"]["save_errors"], 1)  # its saves fail too
            self.check_clean(c)
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
