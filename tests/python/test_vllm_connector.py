#!/usr/bin/python3
"""TqkvConnector (tqkv.vllm_connector) between two engine processes (vllm_engine.py)
with a llama3-8b-shaped paged KV cache: 32 layers, 8 KV heads, head_size 128, 16-token
blocks, BF16, FlashAttention's layout. The first engine "prefills" a prompt and saves it
through the connector; the second, with another block table, loads it through the
connector. Every block of the second engine must then hold exactly tqkv-codec's
decode-kv of the same page (loaded) or the original KV (computed or recomputed):
full hits, partial prefix hits, misses, an eviction after the lease expired, a server
killed mid-load and a server down at Lookup - failures are misses, counted.

TQKV_CONNECTOR_TOKENS sets the prompt length (default 645: 40 full blocks; the 32K
benchmark: TQKV_CONNECTOR_TOKENS=32769 TQKV_CONNECTOR_VERIFY=0,15,31 ... Connector.test_2*),
TQKV_CONNECTOR_VERIFY the layers compared with tqkv-codec (default all).
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
# Layers whose loaded blocks are compared with tqkv-codec (default all).
VERIFY = [int(x) for x in os.environ.get("TQKV_CONNECTOR_VERIFY", "").split(",") if x] or \
    list(range(L))
R = rng(17)


def prompt(n, vocab=128000):
    return R.integers(0, vocab, n).tolist()


def engine(**cfg):
    base = dict(layers=L, heads=H, dim=D, block_size=BS, seed=5,
                num_blocks=(len(cfg["tokens"]) + BS - 1) // BS + 8)
    base.update(cfg)
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_engine.py")],
                       input=json.dumps(base), capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise AssertionError("engine failed:\n" + p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


class Connector(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = Server(capacity="4G")
        try:
            cls.tg = [cls.srv.addr]
            cls.P = prompt(N)
            cls.saved = engine(targets=cls.tg, tokens=cls.P, table_seed=1)
        except BaseException:
            cls.srv.stop()  # tearDownClass does not run after a failed setUpClass
            raise

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
        b = engine(targets=self.tg, tokens=self.P, table_seed=2, verify_targets=self.tg,
                   verify=VERIFY)
        print("\n  save: %d tokens, forward with saves %.2f s; load: lookup %.3f s, forward "
              "with loads %.2f s (%.0f tokens/s, %.2f GB/s BF16 into the paged cache)" %
              (N, self.saved["t_forward"], b["t_lookup"], b["t_forward"],
               b["ext_tokens"] / b["t_forward"],
               b["ext_tokens"] * L * H * D * 4 / b["t_forward"] / 1e9), file=sys.stderr)
        self.assertNotEqual(b["table"], self.saved["table"])
        hit = ((N - 1) // BS) * BS
        self.assertEqual(b["ext_tokens"], hit)
        self.assertEqual(b["failed_blocks"], 0)
        self.assertEqual(b["stats"]["load_blocks"], hit // BS)
        self.assertEqual(b["checked_pages"], (hit // BS) * len(VERIFY))
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


class RealBase(unittest.TestCase):
    """The connector against the installed vLLM's KVConnectorBase_V1 (run under the venv
    of deploy/python-env.sh vllm; TQKV_REQUIRE_VLLM=1 makes its absence a failure)."""

    def setUp(self):
        from tqkv._vllm_base import HAVE_VLLM, VLLM_IMPORT_ERROR
        if not HAVE_VLLM:
            if os.environ.get("TQKV_REQUIRE_VLLM") == "1":
                self.fail("vLLM not importable: %s" % VLLM_IMPORT_ERROR)
            self.skipTest("vLLM not importable here (%s): the stand-in base is in use" %
                          VLLM_IMPORT_ERROR)

    def test_real_classes(self):
        import vllm
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
        from tqkv.vllm_connector import TqkvConnector, TqkvConnectorMetadata
        from tqkv import vllm_connector as vc
        print("\n  vLLM %s from %s" % (vllm.__version__, os.path.dirname(vllm.__file__)),
              file=sys.stderr)
        self.assertIs(vc.KVConnectorBase_V1, KVConnectorBase_V1)
        self.assertIs(vc.KVConnectorRole, KVConnectorRole)
        self.assertTrue(issubclass(TqkvConnector, KVConnectorBase_V1))
        self.assertTrue(issubclass(TqkvConnectorMetadata, KVConnectorMetadata))
        self.assertEqual(TqkvConnector.__abstractmethods__, frozenset())
        # What the connector overrides of the real base: every abstract method and the
        # optional ones a best-effort offload cache needs.
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "start_load_kv",
                     "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "register_kv_caches", "get_finished", "get_block_ids_with_load_errors",
                     "shutdown", "requires_kv_delivery", "get_required_kvcache_layout",
                     "requires_piecewise_for_cudagraph"):
            self.assertIn(name, TqkvConnector.__dict__, name)
        from types import SimpleNamespace as NS
        ktc = KVTransferConfig(kv_connector="TqkvConnector", kv_role="kv_both",
                               kv_connector_module_path="tqkv.vllm_connector",
                               kv_connector_extra_config={"tqkv_targets": ["127.0.0.1:9"],
                                                          "tqkv_num_layers": 2})
        cfg = NS(kv_transfer_config=ktc, cache_config=NS(block_size=BS),
                 model_config=NS(model="m"), parallel_config=NS(tensor_parallel_size=1))
        c = TqkvConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=None)
        self.assertTrue(ktc.is_kv_producer)  # the base would say True ...
        self.assertIs(c.requires_kv_delivery, False)  # ... a best-effort cache says False
        self.assertEqual(c.role, KVConnectorRole.SCHEDULER)
        c.shutdown()


class RealLayout(unittest.TestCase):
    """The connector's _Layout against the installed vLLM's own KV cache: the per-layer
    views its CPU backend gets (create_kv_cache_views over FullAttentionSpec, in each of
    CPUAttentionBackend.supported_kv_cache_layouts()), written by the backend's own
    kernel (cpu_attn_reshape_and_cache); then a worker-side TqkvConnector saves blocks of
    that cache to a lossless tqkv namespace and loads them into other blocks: the bytes
    are the kernel's. Also the "token" split of FLASH_ATTN/TRITON_ATTN (their
    kv_cache.transpose(1, 2).split(head_size, dim=-1)) in both stride orders."""

    T, H, D, NB = 32, 2, 64, 12

    def setUp(self):
        RealBase.setUp(self)

    def views(self, layout, nl=2):
        import torch
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor,
                                                compute_layer_kv_cache_shape_bytes,
                                                create_kv_cache_views)
        spec = FullAttentionSpec(block_size=self.T, num_kv_heads=self.H, head_size=self.D,
                                 dtype=torch.bfloat16)
        page = spec.page_size_bytes
        kt = KVCacheTensor(size=page * self.NB * nl, layers=["model.layers.%d.attn" % i
                                                             for i in range(nl)],
                           layer_stride=page * self.NB, block_stride=page)
        raw = torch.zeros(page * self.NB * nl, dtype=torch.int8)
        views = create_kv_cache_views(raw, spec, self.NB, layout, kt)
        want = compute_layer_kv_cache_shape_bytes(spec, self.NB)
        for v in views:
            self.assertEqual(tuple(v.shape), want[:3] + (want[3] // 2,))
        return raw, dict(zip(kt.layers, views))

    def cpu_fill(self, view, slots, seed, kv=None):
        """K and V [n][H][D] (random, or kv) written into slots by vLLM's CPU kernel."""
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        g = torch.Generator().manual_seed(seed)
        n = len(slots)
        k = torch.randn(n, self.H, self.D, generator=g).to(torch.bfloat16)
        v = torch.randn(n, self.H, self.D, generator=g).to(torch.bfloat16)
        if kv is not None:
            k, v = kv
        nb, nh, bs, _ = view.size()
        kc, vc = view.view((nb, nh, bs * 2, -1)).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.tensor(slots, dtype=torch.long),
                                       _get_attn_isa(torch.bfloat16, self.T, self.D),
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return k, v

    def test_cpu_attn_layout(self):
        import torch
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
        from tqkv.vllm_connector import KV_SPLIT_BY_BACKEND, _Layout, cpu_block_maps
        self.assertEqual(KV_SPLIT_BY_BACKEND[CPUAttentionBackend.get_name()], "block")
        T = self.T
        isa = _get_attn_isa(torch.bfloat16, T, self.D)
        maps = cpu_block_maps(isa, T, self.H, self.D)
        print("\n  CPU_ATTN isa %s: K %s, V %s" % (
            isa, "[T][D]" if torch.equal(maps[0], torch.arange(T * self.D)) else "permuted",
            "[T][D]" if torch.equal(maps[1], torch.arange(T * self.D)) else "permuted"),
            file=sys.stderr)
        for layout in CPUAttentionBackend.supported_kv_cache_layouts():
            _, views = self.views(layout)
            view = list(views.values())[1]
            blocks = [7, 2, 10]
            slots = [b * T + t for b in blocks for t in range(T)]
            k, v = self.cpu_fill(view, slots, 1)
            lay = _Layout(view, T, "block", maps)
            self.assertEqual(lay.shape, (T, self.H, self.D))
            self.assertFalse(lay.direct)  # [H][T][D] blocks: staged
            rk, rv = lay.read(blocks)
            self.assertTrue(torch.equal(rk, k.view(3, T, self.H, self.D)), layout)
            self.assertTrue(torch.equal(rv, v.view(3, T, self.H, self.D)), layout)
            # write(): the same bytes as the kernel writes for the same tokens
            lay.write([4], rk[:1], rv[:1])
            self.cpu_fill(view, [5 * T + t for t in range(T)], 0, (k[:T], v[:T]))
            self.assertTrue(torch.equal(view[4], view[7]))
            self.assertTrue(torch.equal(view[5], view[7]))
            for split in (None, "block"):  # no backend named, no maps: refused
                with self.assertRaisesRegex(ValueError, "tqkv_kv_split"):
                    _Layout(view, T, split)

    def test_token_split_layouts(self):
        import torch
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from tqkv.vllm_connector import _Layout
        T, H, D = self.T, self.H, self.D
        g = torch.Generator().manual_seed(3)
        for layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
            _, views = self.views(layout)
            view = list(views.values())[0]
            key_cache, value_cache = view.transpose(1, 2).split(D, dim=-1)  # FLASH_ATTN's
            k = torch.randn(2, T, H, D, generator=g).to(torch.bfloat16)
            v = torch.randn(2, T, H, D, generator=g).to(torch.bfloat16)
            key_cache[[3, 9]] = k
            value_cache[[3, 9]] = v
            lay = _Layout(view, T, "token")
            rk, rv = lay.read([3, 9])
            self.assertTrue(torch.equal(rk, k) and torch.equal(rv, v), layout)
            lay.write([0], k[1:], v[1:])
            self.assertTrue(torch.equal(key_cache[0], k[1]) and
                            torch.equal(value_cache[0], v[1]), layout)

    def test_connector_round_trip_cpu_layout(self):
        """Save blocks of the CPU backend's cache through the connector, load them into
        other blocks (a lossless namespace): byte-identical, every layer."""
        import torch
        from types import SimpleNamespace as NS
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from tqkv.vllm_connector import (KVConnectorRole, TqkvConnector,
                                         TqkvConnectorMetadata, _Load, _Save)
        T = self.T
        layout = CPUAttentionBackend.supported_kv_cache_layouts()[0]
        _, views = self.views(layout)
        src = [1, 6, 3]
        for i, view in enumerate(views.values()):
            self.cpu_fill(view, [b * T + t for b in src for t in range(T)], 10 + i)
        srv = Server("--namespace-policy", "m:lossless=1")
        try:
            ctx = {name: NS(attn_backend=CPUAttentionBackend) for name in views}
            cfg = NS(kv_transfer_config=NS(kv_connector_extra_config={
                         "tqkv_targets": [srv.addr], "tqkv_num_layers": len(views),
                         "tqkv_namespace": "m", "tqkv_layers_per_get": 1}),
                     cache_config=NS(block_size=T), model_config=NS(model="m"),
                     parallel_config=NS(tensor_parallel_size=1),
                     compilation_config=NS(static_forward_context=ctx))
            c = TqkvConnector(cfg, KVConnectorRole.WORKER)
            c.register_kv_caches(views)
            hashes = [bytes([9, i]) * 16 for i in range(len(src))]
            meta = TqkvConnectorMetadata()
            meta.saves = [_Save("r", "m", hashes, src, None)]
            c.bind_connector_metadata(meta)
            for name, view in views.items():
                c.save_kv_layer(name, view, None)
            c.wait_for_save()
            c.clear_connector_metadata()
            self.assertEqual(c.stats()["save_blocks"], len(src) * len(views))
            dst = [11, 0, 8]
            meta = TqkvConnectorMetadata()
            meta.loads = [_Load("r2", "m", hashes, dst)]
            c.bind_connector_metadata(meta)
            c.start_load_kv(None)
            for name in views:
                c.wait_for_layer_load(name)
            self.assertEqual(c.get_block_ids_with_load_errors(), set())
            c.clear_connector_metadata()
            st = c.stats()
            self.assertEqual((st["load_blocks"], st["load_failed_blocks"]), (len(src), 0))
            for name, view in views.items():
                for a, b in zip(src, dst):
                    self.assertTrue(torch.equal(view[a], view[b]), (name, a, b))
            c.shutdown()
        finally:
            srv.stop()


class Blocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks, as the connector reads it."""

    def __init__(self, ids):
        self._ids = list(ids)

    def get_block_ids(self):
        return (list(self._ids),)


class SchedulerSide(unittest.TestCase):
    """The scheduler-side bookkeeping in-process: chunked prefill saves every full prompt
    block exactly once with its parent, resumed requests take their new block table,
    the cache salt goes into the namespace, tqkv_hash = "vllm" uses request.block_hashes."""

    @classmethod
    def setUpClass(cls):
        from types import SimpleNamespace as NS
        cls.NS = NS
        cls.srv = Server(data_channel=False)

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def connector(self, **extra):
        from tqkv.vllm_connector import KVConnectorRole, TqkvConnector
        NS = self.NS
        ex = {"tqkv_targets": [self.srv.addr], "tqkv_num_layers": 2}
        ex.update(extra)
        cfg = NS(kv_transfer_config=NS(kv_connector_extra_config=ex),
                 cache_config=NS(block_size=BS), model_config=NS(model="m"),
                 parallel_config=NS(tensor_parallel_size=1))
        return TqkvConnector(cfg, KVConnectorRole.SCHEDULER)

    def step(self, new=(), cached=None, sched=None):
        NS = self.NS
        return NS(scheduled_new_reqs=list(new),
                  scheduled_cached_reqs=cached or NS(req_ids=[], new_block_ids=[],
                                                     num_computed_tokens=[],
                                                     resumed_req_ids=set()),
                  num_scheduled_tokens=sched or {})

    def test_chunked_prefill_and_resume(self):
        from tqkv.vllm_connector import token_block_hashes
        NS = self.NS
        c = self.connector()
        toks = prompt(100)  # 6 full blocks
        req = NS(request_id="r", prompt_token_ids=toks, cache_salt="s1", lora_request=None,
                 mm_features=[])
        self.assertEqual(c.get_num_new_matched_tokens(req, 0), (0, False))
        c.update_state_after_alloc(req, None, 0)
        m1 = c.build_connector_meta(self.step(
            [NS(req_id="r", prompt_token_ids=toks, block_ids=([7, 3, 9],),
                num_computed_tokens=0)], sched={"r": 40}))
        self.assertEqual(len(m1.saves), 1)
        s1 = m1.saves[0]
        self.assertEqual((s1.ns, s1.block_ids, s1.parent), ("m/salt=s1", [7, 3], None))
        want = token_block_hashes(toks, BS, 6, c._seed(req))
        self.assertEqual(s1.hashes, want[:2])
        cached = NS(req_ids=["r"], new_block_ids=[([4, 5],)], num_computed_tokens=[40],
                    resumed_req_ids=set())
        m2 = c.build_connector_meta(self.step(cached=cached, sched={"r": 40}))
        s2 = m2.saves[0]
        self.assertEqual((s2.block_ids, s2.hashes, s2.parent), ([9, 4, 5], want[2:5], want[1]))
        # Preempted and resumed with a whole new table: the last block goes to its new home.
        cached = NS(req_ids=["r"], new_block_ids=[([11, 12, 13, 14, 15, 16, 17],)],
                    num_computed_tokens=[80], resumed_req_ids={"r"})
        m3 = c.build_connector_meta(self.step(cached=cached, sched={"r": 20}))
        s3 = m3.saves[0]
        self.assertEqual((s3.block_ids, s3.hashes, s3.parent), ([16], want[5:6], want[4]))
        # Decode steps save nothing more.
        cached = NS(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[100],
                    resumed_req_ids=set())
        self.assertEqual(c.build_connector_meta(self.step(cached=cached, sched={"r": 1})).saves,
                         [])
        self.assertEqual(c.request_finished(req, []), (False, None))
        c.shutdown()

    def _preempt_resume(self, as_new_request):
        """A 32-block prompt: 16 blocks prefilled (and stored), the request preempted,
        then resumed with a tqkv hit on those 16 blocks, as vLLM's scheduler does it:
        get_num_new_matched_tokens and update_state_after_alloc again, then the request
        in scheduled_cached_reqs with resumed_req_ids and its whole new table (model
        runner v1) or again in scheduled_new_reqs (model runner v2). All 32 blocks must
        be saved, each once, the last 16 from the new table with their parent."""
        import tqkv
        from tqkv.vllm_connector import token_block_hashes
        NS = self.NS
        c = self.connector()
        toks = prompt(32 * BS + 5)
        rid = "pr-%d" % as_new_request
        req = NS(request_id=rid, prompt_token_ids=toks, cache_salt=None, lora_request=None,
                 mm_features=[])
        want = token_block_hashes(toks, BS, 32, c._seed(req))
        self.assertEqual(c.get_num_new_matched_tokens(req, 0), (0, False))
        c.update_state_after_alloc(req, Blocks(range(100, 134)), 0)
        m1 = c.build_connector_meta(self.step(
            [NS(req_id=rid, prompt_token_ids=toks, block_ids=(list(range(100, 134)),),
                num_computed_tokens=0)], sched={rid: 16 * BS}))
        saved = [(h, b) for s in m1.saves for h, b in zip(s.hashes, s.block_ids)]
        self.assertEqual(saved, list(zip(want[:16], range(100, 116))))
        # The worker stored them (what a worker's save_kv_layer does, for 2 layers).
        z = np.zeros((2, 16, BS, 8, 128), np.uint16)
        with tqkv.Client([self.srv.addr]) as cl:
            cl.put("m", want[:16], z, z, num_layers=2)
        # Preempted (blocks freed, num_computed_tokens = 0), then scheduled again.
        self.assertEqual(c.get_num_new_matched_tokens(req, 0), (16 * BS, False))
        table = list(range(200, 234))
        c.update_state_after_alloc(req, Blocks(table), 16 * BS)
        rest = len(toks) - 16 * BS
        if as_new_request:
            m2 = c.build_connector_meta(self.step(
                [NS(req_id=rid, prompt_token_ids=toks, block_ids=(table,),
                    num_computed_tokens=16 * BS)], sched={rid: rest}))
        else:
            cached = NS(req_ids=[rid], new_block_ids=[(table,)],
                        num_computed_tokens=[16 * BS], resumed_req_ids={rid})
            m2 = c.build_connector_meta(self.step(cached=cached, sched={rid: rest}))
        self.assertEqual([(ld.hashes, ld.block_ids) for ld in m2.loads],
                         [(want[:16], table[:16])])
        saved2 = [(h, b) for s in m2.saves for h, b in zip(s.hashes, s.block_ids)]
        self.assertEqual(len(saved) + len(saved2), 32, "blocks saved of 32")
        self.assertEqual(saved2, list(zip(want[16:], table[16:32])))
        self.assertEqual(m2.saves[0].parent, want[15])
        self.assertEqual(c.request_finished(req, table), (False, None))
        c.shutdown()

    def test_preempt_resume_with_hit_cached(self):
        self._preempt_resume(False)

    def test_preempt_resume_with_hit_new(self):
        self._preempt_resume(True)

    def test_best_effort(self):
        """A best-effort cache: a save lost to a preemption is a later miss, so vLLM
        must not treat a pending save as a hand-off to deliver."""
        c = self.connector()
        self.assertIs(c.requires_kv_delivery, False)
        c.shutdown()

    def test_local_prefix_hit_not_saved_again(self):
        import tqkv
        from tqkv.vllm_connector import token_block_hashes
        NS = self.NS
        c = self.connector()
        toks = prompt(100)
        req = NS(request_id="p", prompt_token_ids=toks, cache_salt=None, lora_request=None,
                 mm_features=[])
        want = token_block_hashes(toks, BS, 6, c._seed(req))
        z = np.zeros((2, 3, BS, 8, 128), np.uint16)
        with tqkv.Client([self.srv.addr]) as cl:
            cl.put("m", want[:3], z, z, num_layers=2)
        # vLLM's own prefix cache holds the same 3 blocks: nothing to load, nor to save.
        self.assertEqual(c.get_num_new_matched_tokens(req, 48), (0, False))
        c.update_state_after_alloc(req, None, 0)
        m = c.build_connector_meta(self.step(
            [NS(req_id="p", prompt_token_ids=toks, block_ids=(list(range(7)),),
                num_computed_tokens=48)], sched={"p": 52}))
        self.assertEqual(m.loads, [])
        self.assertEqual((m.saves[0].block_ids, m.saves[0].parent), ([3, 4, 5], want[2]))
        c.shutdown()

    def test_vllm_block_hashes(self):
        NS = self.NS
        c = self.connector(tqkv_hash="vllm")
        toks = prompt(50)
        bh = [bytes([i]) * 32 for i in range(3)]
        req = NS(request_id="v", prompt_token_ids=toks, cache_salt=None, lora_request=None,
                 mm_features=[], block_hashes=bh)
        c.get_num_new_matched_tokens(req, 0)
        m = c.build_connector_meta(self.step(
            [NS(req_id="v", prompt_token_ids=toks, block_ids=([1, 2, 3, 4],),
                num_computed_tokens=0)], sched={"v": 50}))
        self.assertEqual(m.saves[0].hashes, bh)
        self.assertEqual(m.saves[0].ns, "m")
        self.assertEqual(type(c).get_required_kvcache_layout(None), "NHD")
        self.assertTrue(type(c).requires_piecewise_for_cudagraph({}))
        c.shutdown()

    def test_token_file_with_auth(self):
        """tqkv_token_file (a mounted Secret): its token authenticates the connector's
        calls; a token the server does not know makes Lookups fail, counted (a miss)."""
        import tempfile
        import tqkv
        from tqkv.vllm_connector import token_block_hashes
        NS = self.NS
        with tempfile.TemporaryDirectory() as d:
            tokens, good, bad = (os.path.join(d, n) for n in ("tokens", "good", "bad"))
            with open(tokens, "w") as f:
                f.write("connector-token-1 rw m\n")
            with open(good, "w") as f:
                f.write("connector-token-1\n")
            with open(bad, "w") as f:
                f.write("someone-elses-token\n")
            srv = Server("--auth-tokens", tokens, data_channel=False)
            try:
                toks = prompt(40)
                req = NS(request_id="a", prompt_token_ids=toks, cache_salt=None,
                         lora_request=None, mm_features=[])
                c = self.connector(tqkv_targets=[srv.addr], tqkv_token_file=good)
                want = token_block_hashes(toks, BS, 2, c._seed(req))
                z = np.zeros((2, 2, BS, 8, 128), np.uint16)
                with tqkv.Client([srv.addr], token="connector-token-1") as cl:
                    cl.put("m", want, z, z, num_layers=2)
                self.assertEqual(c.get_num_new_matched_tokens(req, 0), (32, False))
                self.assertEqual(c._counters["lookup_errors"], 0)
                c.shutdown()
                c = self.connector(tqkv_targets=[srv.addr], tqkv_token_file=bad)
                self.assertEqual(c.get_num_new_matched_tokens(req, 0), (0, False))
                self.assertEqual(c._counters["lookup_errors"], 1)
                c.shutdown()
            finally:
                srv.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
