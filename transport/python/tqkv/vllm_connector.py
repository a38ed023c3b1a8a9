"""TqkvConnector: a vLLM v1 KV connector that offloads the paged KV cache to tqkv.

Load it with vLLM's out-of-tree connector mechanism:

    --kv-transfer-config '{"kv_connector": "TqkvConnector",
        "kv_connector_module_path": "tqkv.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tqkv_targets": ["10.0.0.5:7000", "10.0.0.6:7000"],
                                      "tqkv_replicas": 2}}'

It implements KVConnectorBase_V1 (see tqkv/_vllm_base.py for the vLLM version whose
signatures it matches; the real base class is used when vLLM is installed).

Mapping. One vLLM block (block_size tokens) of one layer is one tqkv block: K and V
[block_size][num_kv_heads][head_size] BF16. The engine's layer tensors are read through
_Layout: vLLM 0.32's per-layer views [num_blocks][num_kv_heads][block_size]
[2 * head_size] in any stride order, split into K and V as the layer's attention
backend does (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: the first head_size channels of
each token are K, the next V; CPU_ATTN: each (block, head) run holds K then V in an
order its ISA's kernel chooses, learned at register time from that kernel; tqkv_kv_split
= "token" for another backend that splits per token), and older vLLM's
[2][num_blocks][T][H][D] (FlashAttention) and [num_blocks][2][T][H][D] (FlashInfer).
Where a block's [T][H][D] is one contiguous run in host memory, Gets decode into it and
Puts read it by address; otherwise (CPU_ATTN, device memory) blocks go through a staging
copy.

Namespace: tqkv_namespace (default: the model name) + "/salt=<cache_salt>" when the
request has one + "/tp<rank>of<size>" with tensor parallelism. Block hashes: a SHA-256 chain over the prompt's token ids, one per full
block (h_i = sha256(h_{i-1} || tokens of block i as int32 LE), h_{-1} a seed over the
block size, the LoRA name and the multimodal feature identifiers), stable across
processes and restarts; with tqkv_hash = "vllm", vLLM's own request.block_hashes
(stable across processes only with PYTHONHASHSEED set).

Flow. Scheduler: get_num_new_matched_tokens Lookups the prompt's full blocks (all
layers) with a lease (tqkv_lease_ms) and offers the hit prefix (never the prompt's last
token); update_state_after_alloc records where those blocks go; build_connector_meta
hands the worker the loads and the full prompt blocks each step computes (saves).
Worker: start_load_kv Gets packed pages in layer groups on a background thread and
decodes them in C straight into the engine's paged blocks; wait_for_layer_load waits
for a layer's group; save_kv_layer Puts a layer's new blocks in BF16 (the server
encodes) on a background thread; wait_for_save waits for them.

Never wrong KV. Any failure - a server down, a timeout, a block missing (evicted after
its lease expired), a bad CRC, a page of another shape - turns the request's blocks
from the first failed one on into a miss: their block ids are reported by
get_block_ids_with_load_errors() so that vLLM recomputes them, and counted in
stats(). Failed saves are counted and otherwise ignored (a later miss).
"""
import hashlib
import logging
import queue
import re
import struct
import threading
import time

import numpy as np

from . import client as _client
from ._engine_config import client_from_extra
from ._vllm_base import HAVE_VLLM, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

logger = logging.getLogger("tqkv.vllm_connector")

__all__ = ["TqkvConnector", "TqkvConnectorMetadata", "KVConnectorRole", "HAVE_VLLM",
           "token_block_hashes"]


def token_block_hashes(token_ids, block_size, num_blocks, seed):
    """The connector's chained block hashes of token_ids' first num_blocks full blocks."""
    toks = np.asarray(list(token_ids[:num_blocks * block_size]), dtype="<i4")
    out = []
    h = seed
    for i in range(num_blocks):
        h = hashlib.sha256(h + toks[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(h)
    return out


class _Load:
    """Blocks of one request to load: hashes[i] -> engine block block_ids[i]."""

    def __init__(self, req_id, ns, hashes, block_ids):
        self.req_id, self.ns, self.hashes, self.block_ids = req_id, ns, hashes, block_ids


class _Save:
    """Blocks of one request to save this step (parent: the hash before hashes[0])."""

    def __init__(self, req_id, ns, hashes, block_ids, parent):
        self.req_id, self.ns, self.hashes, self.block_ids = req_id, ns, hashes, block_ids
        self.parent = parent


class TqkvConnectorMetadata(KVConnectorMetadata):
    def __init__(self):
        self.loads = []
        self.saves = []


class _ReqState:
    def __init__(self, ns, hashes, block_ids, saved):
        self.tokens = None
        self.request = None
        self.ns = ns
        self.hashes = hashes  # of the prompt's full blocks
        self.block_ids = block_ids
        self.saved = saved  # leading blocks already in tqkv


# How a 4-D per-layer KV view [num_blocks][num_kv_heads][block_size][2 * head_size]
# (vLLM 0.32's unified KV cache views, KVCacheLayout) holds K and V, by attention
# backend (read from the installed vLLM's backends): "token" - FLASH_ATTN, TRITON_ATTN,
# FLEX_ATTENTION split each token's 2D channels, K the first D and V the next; "block" -
# CPU_ATTN views each (block, head) run [block_size][2D] as two regions of
# block_size * D values, K then V, in an order its ISA's kernel chooses (with "vec", K
# is stored [D][block_size], V [block_size][D]): cpu_block_maps() learns that order from
# the backend's own write kernel. tqkv_kv_split in the extra config overrides.
KV_SPLIT_BY_BACKEND = {"CPU_ATTN": "block", "FLASH_ATTN": "token", "TRITON_ATTN": "token",
                       "FLEX_ATTENTION": "token"}


def cpu_block_maps(isa, T, H, D):
    """Where vLLM's CPU attention kernel (cpu_attn_reshape_and_cache, ISA isa) puts a
    block's K and V: (map_k, map_v), LongTensors of T * D where map[j] = t * D + d is the
    token and channel stored at position j of a (block, head) region. Learned by writing
    a block whose values are their own indices (BF16 bit patterns, copied as is) with the
    kernel; checked to be a permutation, the same for every head."""
    import torch
    from vllm import _custom_ops as ops
    n = T * D
    if n > 32767:
        raise ValueError("tqkv: a CPU_ATTN block of %d x %d values is too large to map" %
                         (T, D))
    cache = torch.zeros(1, H, T, 2 * D, dtype=torch.bfloat16)
    kc, vc = cache.view(1, H, 2 * T, D).chunk(2, dim=2)
    pat = torch.arange(n, dtype=torch.int16).view(T, 1, D).expand(T, H, D).contiguous()
    ops.cpu_attn_reshape_and_cache(pat.view(torch.bfloat16), pat.view(torch.bfloat16), kc,
                                   vc, torch.arange(T, dtype=torch.long), isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    reg = cache.view(torch.int16).view(H, 2, n).long()
    want = torch.arange(n)
    for h in range(H):
        if not torch.equal(reg[h], reg[0]):
            raise ValueError("tqkv: CPU_ATTN (isa %s) stores heads differently" % isa)
    for m in (reg[0, 0], reg[0, 1]):
        if not torch.equal(torch.sort(m).values, want):
            raise ValueError("tqkv: CPU_ATTN (isa %s) block layout is not a permutation "
                             "of its tokens and channels" % isa)
    return reg[0, 0].clone(), reg[0, 1].clone()


class _Layout:
    """One layer's KV tensor, its blocks read and written as K and V [T][H][D] (a tqkv
    block), whatever the engine's layout:

      5-D [2][B][T][H][D] (FlashAttention, older vLLM) or [B][2][T][H][D] (FlashInfer)
      4-D [B][H][T][2D] in any stride order (vLLM 0.32's views), kv_split "token"
      4-D [B][H][T][2D] with each (block, head) run contiguous, kv_split "block" and
          block_maps (cpu_block_maps) placing K and V inside it

    The strided layouts are a view kv5 [2][B][T][H][D] over the engine's memory. direct:
    a block's K (and V) [T][H][D] is one contiguous run in host memory, so Gets decode
    into it and Puts read it by address (ptrs); otherwise blocks go through a staging
    copy (read(), write())."""

    def __init__(self, t, block_size, kv_split=None, block_maps=None):
        import torch
        if t.dtype != torch.bfloat16:
            raise ValueError("tqkv stores BF16 KV; this layer is %s" % t.dtype)
        self.tensor = t
        self.kv_split = kv_split
        self.block_maps = block_maps
        self.kv5 = self.reg = None
        if t.dim() == 5:
            if t.shape[0] == 2:
                kv5 = t
            elif t.shape[1] == 2:
                kv5 = t.transpose(0, 1)
            else:
                raise ValueError("unsupported KV layout %s (want [2][blocks][T][H][D] or "
                                 "[blocks][2][T][H][D])" % (tuple(t.shape),))
            T, H, D = (int(x) for x in kv5.shape[2:])
        elif t.dim() == 4:
            B, H, T, C = (int(x) for x in t.shape)
            sB, sH, sN, sC = t.stride()
            if C % 2 or sC != 1:
                raise ValueError("unsupported KV layout %s strides %s (want [blocks][heads]"
                                 "[T][2 * head_size], channels contiguous)" %
                                 (tuple(t.shape), t.stride()))
            D = C // 2
            if kv_split == "token":
                kv5 = t.as_strided((2, B, T, H, D), (D, sB, sN, sH, 1), t.storage_offset())
            elif kv_split == "block" and block_maps is not None:
                if sN != C:
                    raise ValueError("KV layout %s strides %s: the block-split layout needs "
                                     "each (block, head) run [T][2D] contiguous" %
                                     (tuple(t.shape), t.stride()))
                kv5 = None
                self.reg = t.as_strided((B, H, 2, T * D), (sB, sH, T * D, 1),
                                        t.storage_offset())
                self.inv_maps = tuple(torch.argsort(m) for m in block_maps)
            else:
                raise ValueError("4-D KV layout %s: where K and V lie in it depends on the "
                                 "attention backend (%r); set tqkv_kv_split to \"token\" "
                                 "in kv_connector_extra_config if it splits each token's "
                                 "channels" % (tuple(t.shape), kv_split))
        else:
            raise ValueError("unsupported KV layout %s" % (tuple(t.shape),))
        if T != block_size:
            raise ValueError("layer blocks of %d tokens, block_size %d" % (T, block_size))
        self.shape = (T, H, D)
        self.on_host = t.device.type == "cpu"
        self.direct = False
        if kv5 is not None:
            st = kv5.stride()
            esz = kv5.element_size()
            self.kv5 = kv5
            self.direct = self.on_host and tuple(st[2:]) == (H * D, D, 1)
            self.base = kv5.data_ptr()
            self.s_kv = st[0] * esz
            self.s_blk = st[1] * esz

    def ptrs(self, block_ids):
        """K and V addresses of blocks (direct layouts only)."""
        b = np.asarray(block_ids, dtype=np.uint64) * np.uint64(self.s_blk) + np.uint64(self.base)
        return b, b + np.uint64(self.s_kv)

    def read(self, block_ids):
        """Copies of blocks' K and V, each [n][T][H][D] on the layer's device."""
        import torch
        dev = self.tensor.device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=dev)
        if self.kv5 is not None:
            return self.kv5[0].index_select(0, idx), self.kv5[1].index_select(0, idx)
        T, H, D = self.shape
        r = self.reg.index_select(0, idx)  # [n][H][2][T * D]
        out = []
        for i in (0, 1):
            x = r[:, :, i, :].index_select(2, self.inv_maps[i].to(dev))  # [n][H][T * D]
            out.append(x.view(-1, H, T, D).permute(0, 2, 1, 3).contiguous())
        return out[0], out[1]

    def write(self, block_ids, k, v):
        """Store K and V [n][T][H][D] into blocks."""
        import torch
        dev = self.tensor.device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=dev)
        k, v = k.to(dev), v.to(dev)
        if self.kv5 is not None:
            self.kv5[0].index_copy_(0, idx, k)
            self.kv5[1].index_copy_(0, idx, v)
            return
        T, H, D = self.shape
        parts = []
        for i, x in enumerate((k, v)):
            x = x.permute(0, 2, 1, 3).reshape(-1, H, T * D)  # [n][H][T * D]
            parts.append(x.index_select(2, self.block_maps[i].to(dev)))
        self.reg.index_copy_(0, idx, torch.stack(parts, dim=2))


class TqkvConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by tqkv-server(s). See the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        self._extra = extra
        self._block_size = int(vllm_config.cache_config.block_size)
        mc = vllm_config.model_config
        pc = getattr(vllm_config, "parallel_config", None)
        n = extra.get("tqkv_num_layers")
        if n is None:
            n = mc.get_num_layers(pc)
        self._num_layers = int(n)
        self._ns_base = str(extra.get("tqkv_namespace") or getattr(mc, "model", "model"))
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER and self._tp_size > 1 and HAVE_VLLM:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self._tp_rank = get_tensor_model_parallel_rank()
        self._lease_ms = int(extra.get("tqkv_lease_ms", 30000))
        self._deadline_ms = int(extra.get("tqkv_deadline_ms", 10000))
        self._layers_per_get = max(1, int(extra.get("tqkv_layers_per_get", 4)))
        self._hash_mode = extra.get("tqkv_hash", "tokens")
        self._key_bits = float(extra.get("tqkv_key_bits", 0))
        self._value_bits = float(extra.get("tqkv_value_bits", 0))
        self._client = client_from_extra(extra, self._deadline_ms)
        self._lock = threading.Lock()
        self._counters = dict(lookups=0, lookup_errors=0, lookup_hit_tokens=0,
                              lookup_query_tokens=0, load_blocks=0, load_failed_blocks=0,
                              load_errors=0, save_blocks=0, save_failed_blocks=0, save_errors=0,
                              saves_emitted=0, resumed=0)
        # tqkv_stats_path: counters written as JSON to <path>.<scheduler|worker>.json
        # after each step (for tests and debugging; off by default).
        self._stats_path = extra.get("tqkv_stats_path")
        self._is_worker = role == KVConnectorRole.WORKER
        # scheduler side
        self._pending = {}  # req_id -> (ns, hashes, hit_blocks, local_tokens)
        self._loads = {}  # req_id -> _Load, for the next build_connector_meta
        self._reqs = {}  # req_id -> _ReqState (saving)
        self._req_objs = {}  # req_id -> vLLM Request
        self._stored = {}  # req_id -> leading prompt blocks tqkv already holds (Lookup)
        # worker side
        self._layers = []  # [(name, _Layout)] in layer order
        self._block_maps = {}  # (isa, T, H, D) -> cpu_block_maps()
        self._layer_index = {}
        self._load_thread = None
        self._layer_done = []
        self._failed_blocks = set()
        self._save_q = None
        self._save_thread = None

    @property
    def requires_kv_delivery(self):
        """False: tqkv is a best-effort cache. A save lost to a preemption (or to a
        server fault) is a later miss, never a request that must be recomputed."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        """NHD: a block's [block_size][num_kv_heads][head_size] contiguous, a tqkv block,
        where the backend offers it (older vLLM's 5-D layouts: no staging copy). vLLM
        0.32 reads it as LBNHC and drops it with a warning where the backend does not
        support it (CPU_ATTN: LBHNC only); the connector maps every layout it gets."""
        return "NHD"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        """True: wait_for_layer_load and save_kv_layer run per layer in Python and must
        not be skipped by a captured full CUDA graph."""
        return True

    # ------------------------------------------------------------------ helpers
    def stats(self):
        """Counters: lookups, lookup_errors, lookup_hit_tokens, lookup_query_tokens,
        load_blocks, load_failed_blocks (recomputed: never wrong KV), load_errors,
        save_blocks, save_failed_blocks, save_errors."""
        with self._lock:
            return dict(self._counters)

    def _count(self, **kw):
        with self._lock:
            for k, v in kw.items():
                self._counters[k] += v

    def _namespace(self, request):
        salt = getattr(request, "cache_salt", None)
        ns = self._ns_base
        if salt:
            ns += "/salt=" + str(salt)
        return ns

    def _worker_ns(self, ns):
        if self._tp_size > 1:
            return "%s/tp%dof%d" % (ns, self._tp_rank, self._tp_size)
        return ns

    def _seed(self, request):
        parts = [b"tqkv-vllm-v1", struct.pack("<I", self._block_size)]
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(b"lora=" + str(getattr(lora, "lora_name", lora)).encode())
        for f in getattr(request, "mm_features", None) or []:
            pos = getattr(f, "mm_position", None)
            parts.append(("mm=%s@%s+%s" % (getattr(f, "identifier", f),
                                           getattr(pos, "offset", ""),
                                           getattr(pos, "length", ""))).encode())
        return hashlib.sha256(b"|".join(parts)).digest()

    def _hashes(self, request, token_ids, n):
        if self._hash_mode == "vllm":
            bh = list(getattr(request, "block_hashes", None) or [])[:n]
            if len(bh) == n and all(isinstance(h, (bytes, bytearray)) and 8 <= len(h) <= 64
                                    for h in bh):
                return [bytes(h) for h in bh]
        return token_block_hashes(token_ids, self._block_size, n, self._seed(request))

    @staticmethod
    def _tokens(request):
        t = getattr(request, "prompt_token_ids", None)
        if t is None:
            t = getattr(request, "all_token_ids", None)
        return list(t) if t is not None else None

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        # The scheduler asks this of every new request: keep it, build_connector_meta
        # hashes and names its saves from it (NewRequestData lacks the cache salt).
        self._req_objs[request.request_id] = request
        tokens = self._tokens(request)
        bs = self._block_size
        if not tokens:
            return 0, False
        n_full = (len(tokens) - 1) // bs  # the last prompt token is always computed
        if n_full * bs <= num_computed_tokens:
            return 0, False
        ns = self._namespace(request)
        hashes = self._hashes(request, tokens, n_full)
        self._count(lookups=1, lookup_query_tokens=n_full * bs - num_computed_tokens)
        try:
            prefix, _ = self._client.lookup(ns, hashes, num_layers=self._num_layers,
                                            lease_ms=self._lease_ms,
                                            deadline_ms=self._deadline_ms)
        except _client.Error as e:
            logger.warning("tqkv lookup failed (a miss): %s", e)
            self._count(lookup_errors=1)
            return 0, False
        hit = prefix * bs
        self._stored[request.request_id] = prefix  # not saved again
        ext = hit - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._pending[request.request_id] = (ns, hashes, prefix, num_computed_tokens)
        self._count(lookup_hit_tokens=ext)
        return ext, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = self._pending.pop(request.request_id, None)
        if num_external_tokens <= 0 or p is None:
            return
        ns, hashes, prefix, local = p
        bs = self._block_size
        lo = local // bs
        hi = (local + num_external_tokens) // bs
        block_ids = list(blocks.get_block_ids()[0])
        if hi > len(block_ids) or hi > len(hashes):
            logger.warning("tqkv: %d blocks allocated for %d to load; not loading",
                           len(block_ids), hi)
            return
        self._loads[request.request_id] = _Load(request.request_id, ns, hashes[lo:hi],
                                                block_ids[lo:hi])
        # What is loaded is not saved again. A request preempted and now resumed keeps
        # its state (tokens, hashes, what it saved before): build_connector_meta gives
        # it its new block table and saves the rest of its prompt from there.
        st = self._reqs.get(request.request_id)
        if st is None:
            self._reqs[request.request_id] = _ReqState(ns, None, None, hi)
        else:
            st.saved = max(st.saved, hi)

    def build_connector_meta(self, scheduler_output):
        meta = TqkvConnectorMetadata()
        meta.loads = list(self._loads.values())
        self._loads.clear()
        nsched = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for nr in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            tokens = getattr(nr, "prompt_token_ids", None)
            if tokens is None:
                continue
            st = self._reqs.get(nr.req_id)
            if st is None:
                st = _ReqState(None, None, None, self._stored.get(nr.req_id, 0))
                self._reqs[nr.req_id] = st
            elif st.tokens is not None:
                self._count(resumed=1)  # resumed, as a new request (model runner v2)
            self._stored.pop(nr.req_id, None)
            req = self._req_objs.get(nr.req_id, nr)
            st.block_ids = list(nr.block_ids[0])
            st.tokens = list(tokens)
            st.request = req
            st.ns = self._namespace(req)
            done = nr.num_computed_tokens + nsched.get(nr.req_id, 0)
            self._emit_saves(meta, nr.req_id, st, done)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None)
            resumed_list = getattr(cached, "resumed_from_preemption", None)
            for i, req_id in enumerate(getattr(cached, "req_ids", []) or []):
                st = self._reqs.get(req_id)
                if st is None or st.block_ids is None:
                    continue
                new_ids = cached.new_block_ids[i] if cached.new_block_ids else None
                was_resumed = (resumed is not None and req_id in resumed) or \
                    (resumed_list is not None and resumed_list[i])
                if was_resumed:
                    self._count(resumed=1)
                    self._stored.pop(req_id, None)
                if new_ids:
                    if was_resumed:
                        st.block_ids = list(new_ids[0])
                    else:
                        st.block_ids.extend(new_ids[0])
                done = cached.num_computed_tokens[i] + nsched.get(req_id, 0)
                self._emit_saves(meta, req_id, st, done)
        self._dump_stats()
        return meta

    def _dump_stats(self):
        if not self._stats_path:
            return
        role = "worker" if self._is_worker else "scheduler"
        import json
        import os
        tmp = "%s.%s.json.tmp" % (self._stats_path, role)
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, "%s.%s.json" % (self._stats_path, role))

    def _emit_saves(self, meta, req_id, st, computed_tokens):
        bs = self._block_size
        n_full = len(st.tokens) // bs
        upto = min(computed_tokens, len(st.tokens)) // bs
        if upto <= st.saved:
            return
        if st.hashes is None or len(st.hashes) < n_full:
            st.hashes = self._hashes(st.request, st.tokens, n_full)
        if upto > len(st.block_ids):
            upto = len(st.block_ids)
        parent = st.hashes[st.saved - 1] if st.saved > 0 else None
        meta.saves.append(_Save(req_id, st.ns, st.hashes[st.saved:upto],
                                st.block_ids[st.saved:upto], parent))
        self._count(saves_emitted=upto - st.saved)
        st.saved = upto

    def request_finished(self, request, block_ids):
        self._reqs.pop(request.request_id, None)
        self._req_objs.pop(request.request_id, None)
        self._stored.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches):
        def layer_no(name, i):
            m = re.findall(r"\d+", name)
            return int(m[-1]) if m else i
        items = list(kv_caches.items())
        nums = [layer_no(n, i) for i, (n, _) in enumerate(items)]
        if len(set(nums)) == len(nums):
            items = [it for _, it in sorted(zip(nums, items), key=lambda x: x[0])]
        self._layers = []
        for name, t in items:
            split, maps = self._kv_split(name, t)
            self._layers.append((name, _Layout(t, self._block_size, split, maps)))
        self._layer_index = {name: i for i, (name, _) in enumerate(self._layers)}
        if len(self._layers) != self._num_layers:
            logger.warning("tqkv: %d KV layers registered, model has %d", len(self._layers),
                           self._num_layers)
            self._num_layers = len(self._layers)

    def _kv_split(self, layer_name, t):
        """(kv_split, block_maps) of layer_name's 4-D KV view: tqkv_kv_split, else by
        the layer's attention backend (KV_SPLIT_BY_BACKEND); for "block", the maps
        learned from the CPU kernel of the layer's ISA (cached per shape and ISA)."""
        split = self._extra.get("tqkv_kv_split")
        layer = None
        try:
            layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
            backend = layer.attn_backend.get_name()
        except Exception:  # noqa: BLE001 - no backend to ask (older vLLM, 5-D layouts)
            backend = None
        if not split:
            if backend is None:
                return None, None
            split = KV_SPLIT_BY_BACKEND.get(backend, "unknown backend %s" % backend)
        if split != "block" or t.dim() != 4:
            return split, None
        if backend not in (None, "CPU_ATTN"):
            raise ValueError("tqkv_kv_split \"block\" is CPU_ATTN's layout; layer %s uses %s"
                             % (layer_name, backend))
        import torch
        T, H, D = self._block_size, int(t.shape[1]), int(t.shape[3]) // 2
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(torch.bfloat16, T, D)
        key = (isa, T, H, D)
        if key not in self._block_maps:
            self._block_maps[key] = cpu_block_maps(isa, T, H, D)
        return split, self._block_maps[key]

    def start_load_kv(self, forward_context, **kwargs):
        self._join_load()
        meta = self._get_connector_metadata()
        loads = [ld for ld in getattr(meta, "loads", []) if ld.hashes]
        if not loads or not self._layers:
            return
        L = len(self._layers)
        self._layer_done = [threading.Event() for _ in range(L)]
        self._load_thread = threading.Thread(target=self._load, args=(loads,), daemon=True,
                                             name="tqkv-load")
        self._load_thread.start()

    def _load(self, loads):
        L = len(self._layers)
        failed_from = {id(ld): len(ld.hashes) for ld in loads}  # first failed block
        try:
            for l0 in range(0, L, self._layers_per_get):
                l1 = min(L, l0 + self._layers_per_get)
                for ld in loads:
                    if failed_from[id(ld)] == 0:
                        continue
                    try:
                        found = self._load_layers(ld, l0, l1)
                    except Exception as e:  # noqa: BLE001 - any failure is a miss
                        logger.warning("tqkv load of %s failed (recompute): %s", ld.req_id, e)
                        self._count(load_errors=1)
                        failed_from[id(ld)] = 0
                        continue
                    if not found.all():
                        first = int(np.argmin(found.reshape(l1 - l0, -1).all(axis=0)))
                        failed_from[id(ld)] = min(failed_from[id(ld)], first)
                for l in range(l0, l1):
                    self._layer_done[l].set()
        finally:
            for ev in self._layer_done:
                ev.set()
            with self._lock:
                for ld in loads:
                    f = failed_from[id(ld)]
                    self._failed_blocks.update(ld.block_ids[f:])
                    self._counters["load_blocks"] += f
                    self._counters["load_failed_blocks"] += len(ld.block_ids) - f

    def _load_layers(self, ld, l0, l1):
        ns = self._worker_ns(ld.ns)
        lay0 = self._layers[l0][1]
        shape = lay0.shape
        if all(self._layers[l][1].direct for l in range(l0, l1)):
            kp, vp = [], []
            for l in range(l0, l1):
                k, v = self._layers[l][1].ptrs(ld.block_ids)
                kp.append(k)
                vp.append(v)
            return self._client.get_into(ns, ld.hashes, l0, l1, shape, np.concatenate(kp),
                                         np.concatenate(vp), "packed", self._deadline_ms)
        # Device memory or a layout whose blocks are not [T][H][D] runs: decode into host
        # staging, then copy the blocks that were found (every layer of them) in.
        import torch
        n = len(ld.hashes)
        kst = torch.empty((l1 - l0, n) + shape, dtype=torch.bfloat16)
        vst = torch.empty_like(kst)
        _, _, found = self._client.get(ns, ld.hashes, l0, l1, keys=kst, values=vst,
                                       deadline_ms=self._deadline_ms)
        ok = [i for i in range(n) if found[:, i].all()]
        if ok:
            for j, l in enumerate(range(l0, l1)):
                self._layers[l][1].write([ld.block_ids[i] for i in ok], kst[j, ok], vst[j, ok])
        return found.reshape(-1)

    def _join_load(self):
        t = self._load_thread
        if t is not None:
            t.join()
            self._load_thread = None

    def wait_for_layer_load(self, layer_name):
        i = self._layer_index.get(layer_name)
        if self._load_thread is None or i is None or i >= len(self._layer_done):
            return
        self._layer_done[i].wait()

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if not self.has_connector_metadata():
            return
        saves = [s for s in getattr(self._get_connector_metadata(), "saves", []) if s.hashes]
        i = self._layer_index.get(layer_name)
        if not saves or i is None:
            return
        lay = self._layers[i][1]
        if kv_layer is not None and (kv_layer.data_ptr() != lay.tensor.data_ptr() or
                                     kv_layer.shape != lay.tensor.shape or
                                     kv_layer.stride() != lay.tensor.stride()):
            lay = _Layout(kv_layer, self._block_size, lay.kv_split, lay.block_maps)
        if not lay.direct:  # stage now: the blocks may change after the forward
            staged = []
            for s in saves:
                k, v = lay.read(s.block_ids)
                staged.append((s, k.to("cpu").contiguous(), v.to("cpu").contiguous()))
            work = ("staged", i, staged)
        else:
            work = ("host", i, [(s,) + lay.ptrs(s.block_ids) for s in saves])
        if self._save_thread is None:
            self._save_q = queue.Queue()
            self._save_thread = threading.Thread(target=self._saver, daemon=True,
                                                 name="tqkv-save")
            self._save_thread.start()
        self._save_q.put(work)

    def _saver(self):
        while True:
            work = self._save_q.get()
            try:
                if work is None:
                    return
                if isinstance(work, threading.Event):
                    work.set()
                    continue
                kind, layer, items = work
                for it in items:
                    s = it[0]
                    ns = self._worker_ns(s.ns)
                    lay = self._layers[layer][1]
                    try:
                        if kind == "host":
                            self._client.put_ptrs(ns, s.hashes, lay.shape, it[1], it[2], layer,
                                                  layer + 1, s.parent, self._num_layers,
                                                  self._key_bits, self._value_bits)
                        else:
                            self._client.put(ns, s.hashes, it[1], it[2], layer, s.parent,
                                             self._num_layers, self._key_bits, self._value_bits)
                        self._count(save_blocks=len(s.hashes))
                    except Exception as e:  # noqa: BLE001 - a failed save is a later miss
                        logger.warning("tqkv save of %s layer %d failed: %s", s.req_id, layer, e)
                        self._count(save_errors=1, save_failed_blocks=len(s.hashes))
            finally:
                self._save_q.task_done()

    def wait_for_save(self):
        if self._save_q is not None:
            self._save_q.join()
        self._join_load()
        self._dump_stats()

    def get_finished(self, finished_req_ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        self._join_load()
        with self._lock:
            out = set(self._failed_blocks)
            self._failed_blocks.clear()
        return out

    def shutdown(self):
        self.wait_for_save()
        if self._save_thread is not None:
            self._save_q.put(None)
            self._save_thread.join()
            self._save_thread = None
        self._client.close()
