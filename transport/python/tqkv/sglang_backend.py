"""TqkvHiCacheStorage: an SGLang HiCache storage back-end (the v1 zero-copy interface)
over tqkv.

Load it with SGLang's dynamic storage back-end (sglang 0.5.23, read from its
mem_cache/storage/backend_factory.py and managers/cache_controller.py):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tqkv",
        "module_path": "tqkv.sglang_backend", "class_name": "TqkvHiCacheStorage",
        "interface_v1": 1, "tqkv_targets": ["10.0.0.5:7000"], "tqkv_replicas": 1}'

interface_v1 = 1 makes the cache controller call batch_exists / batch_get_v1 /
batch_set_v1 with host indices into the host KV pool (required: the back-end refuses to
start without it, naming the key).

Mapping. One HiCache page (page_size tokens) of one layer is one tqkv block: K and V
[page_size][head_num][head_dim] BF16. The page's key (SGLang's hex SHA-256 chain of the
page's tokens) is the tqkv block hash (its bytes; a key that is not 8-64 bytes of hex is
hashed with SHA-256). Namespace: tqkv_namespace (default the model name) +
"/tp<rank>of<size>" with tensor parallelism (+ "/pp<rank>of<size>" with pipeline
parallelism), as each rank holds its own heads / layers. parent: the key before the
batch's first page (HiCacheStorageExtraInfo.prefix_keys), so tqkv's prefix chains match.

Zero copy. With the host pool's "layer_first" layout a page's K (and V) of one layer is
one contiguous [page_size][H][D] run in host memory: Puts read it and Gets decode into it
in C, by address, with no staging copy. "page_first" layouts interleave layers per
token, so a page goes through a staging tensor (one copy each way).

Never wrong KV. A page is reported found only when every layer of it was found and
decoded; batch_exists counts the leading pages whose every layer the server holds. Any
failure (server down, timeout, evicted page, CRC) is a miss (False), never an exception
into the cache controller; failures are counted in get_stats().
"""
import hashlib
import logging
import threading

import numpy as np

from ._engine_config import client_from_extra

logger = logging.getLogger("tqkv.sglang_backend")

try:  # the real interface
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    HAVE_SGLANG = True
    SGLANG_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001 - sglang absent: the module still imports
    HAVE_SGLANG = False
    SGLANG_IMPORT_ERROR = "%s: %s" % (type(_e).__name__, _e)

    class HiCacheStorage:  # noqa: D101 - stand-in so the module imports without sglang
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

__all__ = ["TqkvHiCacheStorage", "HAVE_SGLANG", "key_hash"]


def key_hash(key):
    """The tqkv block hash of a HiCache page key (hex of 8-64 bytes: those bytes)."""
    if isinstance(key, (bytes, bytearray)):
        b = bytes(key)
        return b if 8 <= len(b) <= 64 else hashlib.sha256(b).digest()
    s = str(key)
    if 16 <= len(s) <= 128 and len(s) % 2 == 0:
        try:
            return bytes.fromhex(s)
        except ValueError:
            pass
    return hashlib.sha256(s.encode()).digest()


class TqkvHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over tqkv-server(s). See the module docstring."""

    def __init__(self, storage_config, kwargs=None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if not int(extra.get("interface_v1", 0) or 0):
            raise ValueError("tqkv HiCache back-end: set \"interface_v1\": 1 in "
                             "--hicache-storage-backend-extra-config (tqkv serves the v1 "
                             "zero-copy interface: batch_get_v1/batch_set_v1)")
        self._cfg = storage_config
        ns = str(extra.get("tqkv_namespace") or getattr(storage_config, "model_name", None)
                 or "model")
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        mla = bool(getattr(storage_config, "is_mla_model", False))
        if tp_size > 1 and not mla:  # MLA ranks hold the same latent cache
            ns += "/tp%dof%d" % (int(storage_config.tp_rank), tp_size)
        if pp_size > 1:
            ns += "/pp%dof%d" % (int(storage_config.pp_rank), pp_size)
        self.ns = ns
        self._writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._deadline_ms = int(extra.get("tqkv_deadline_ms", 10000))
        self._key_bits = float(extra.get("tqkv_key_bits", 0))
        self._value_bits = float(extra.get("tqkv_value_bits", 0))
        self._client = client_from_extra(extra, self._deadline_ms)
        self._lock = threading.Lock()
        self._stats = dict(exists_calls=0, exists_errors=0, get_pages=0, get_found=0,
                           get_errors=0, set_pages=0, set_errors=0, staged=0)
        self.mem_pool_host = None

    # ---------------------------------------------------------------- host pool
    def register_mem_pool_host(self, mem_pool_host):
        import torch
        super().register_mem_pool_host(mem_pool_host)
        h = mem_pool_host
        if getattr(h, "dtype", None) != torch.bfloat16:
            raise ValueError("tqkv stores BF16 KV; the host pool is %s" % (h.dtype,))
        hd, vhd = int(h.head_dim), int(getattr(h, "v_head_dim", h.head_dim))
        if hd != vhd:
            raise ValueError("tqkv blocks need K and V of one head_dim (%d != %d)" % (hd, vhd))
        k_refs, v_refs = list(h.k_data_refs), list(h.v_data_refs)
        if not k_refs or len(k_refs) != len(v_refs):
            raise ValueError("host pool layout %r has no per-layer K/V views" % (h.layout,))
        self._ps = int(h.page_size)
        self._L = len(k_refs)
        self._shape = (self._ps, int(h.head_num), hd)
        tok = int(h.head_num) * hd
        self._k_refs, self._v_refs = k_refs, v_refs
        # Zero copy when every layer view keeps a token's [H][D] right after the last.
        self._direct = all(t.device.type == "cpu" and t.dim() >= 2 and t.stride(0) == tok
                           and t.is_contiguous() for t in k_refs + v_refs)
        self._tok_bytes = tok * 2
        logger.info("tqkv HiCache back-end: ns=%s layers=%d page=%s layout=%s zero-copy=%s",
                    self.ns, self._L, self._shape, getattr(h, "layout", "?"), self._direct)

    def _count(self, **kw):
        with self._lock:
            for k, v in kw.items():
                self._stats[k] += v

    def _starts(self, n, host_indices):
        idx = host_indices.reshape(-1)
        if idx.numel() < n * self._ps:
            raise ValueError("%d host indices for %d pages of %d" % (idx.numel(), n, self._ps))
        return [int(x) for x in idx[::self._ps][:n].tolist()]

    def _ptrs(self, starts):
        """Addresses [(layer) * N + i] of each page's K and V in the host pool."""
        kp = np.empty(self._L * len(starts), np.uint64)
        vp = np.empty_like(kp)
        off = np.asarray(starts, dtype=np.uint64) * np.uint64(self._tok_bytes)
        n = len(starts)
        for l in range(self._L):
            kp[l * n:(l + 1) * n] = np.uint64(self._k_refs[l].data_ptr()) + off
            vp[l * n:(l + 1) * n] = np.uint64(self._v_refs[l].data_ptr()) + off
        return kp, vp

    @staticmethod
    def _parent(extra_info):
        pk = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return key_hash(pk[-1]) if pk else None

    # ------------------------------------------------------------- v1 interface
    def batch_exists(self, keys, extra_info=None):
        if not keys:
            return 0
        self._count(exists_calls=1)
        try:
            prefix, _ = self._client.lookup(self.ns, [key_hash(k) for k in keys],
                                            num_layers=self._L, deadline_ms=self._deadline_ms)
            return int(prefix)
        except Exception as e:  # noqa: BLE001 - a failure is a miss
            logger.warning("tqkv batch_exists failed (a miss): %s", e)
            self._count(exists_errors=1)
            return 0

    def exists(self, key):
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        n = len(keys)
        if n == 0:
            return []
        self._count(get_pages=n)
        hashes = [key_hash(k) for k in keys]
        try:
            starts = self._starts(n, host_indices)
            if self._direct:
                kp, vp = self._ptrs(starts)
                found = self._client.get_into(self.ns, hashes, 0, self._L, self._shape, kp, vp,
                                              "packed", self._deadline_ms)
                found = found.reshape(self._L, n).all(axis=0)
            else:
                found = self._get_staged(hashes, starts)
        except Exception as e:  # noqa: BLE001 - a failure is a miss
            logger.warning("tqkv batch_get_v1 failed (a miss): %s", e)
            self._count(get_errors=1)
            return [False] * n
        out = [bool(x) for x in found]
        self._count(get_found=sum(out))
        return out

    def _get_staged(self, hashes, starts):
        import torch
        n = len(hashes)
        kst = torch.empty((self._L, n) + self._shape, dtype=torch.bfloat16)
        vst = torch.empty_like(kst)
        _, _, found = self._client.get(self.ns, hashes, 0, self._L, keys=kst, values=vst,
                                       deadline_ms=self._deadline_ms)
        ok = found.all(axis=0)
        ps = self._ps
        for i in range(n):
            if not ok[i]:
                continue
            s = starts[i]
            for l in range(self._L):
                self._k_refs[l][s:s + ps].copy_(kst[l, i].reshape(self._k_refs[l][s:s + ps].shape))
                self._v_refs[l][s:s + ps].copy_(vst[l, i].reshape(self._v_refs[l][s:s + ps].shape))
        self._count(staged=n)
        return ok

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        n = len(keys)
        if n == 0:
            return []
        if not self._writer:  # another rank writes this shard
            return [True] * n
        hashes = [key_hash(k) for k in keys]
        parent = self._parent(extra_info)
        try:
            starts = self._starts(n, host_indices)
            if self._direct:
                kp, vp = self._ptrs(starts)
                self._client.put_ptrs(self.ns, hashes, self._shape, kp, vp, 0, self._L, parent,
                                      self._L, self._key_bits, self._value_bits,
                                      self._deadline_ms)
            else:
                import torch
                ps = self._ps
                k = torch.stack([torch.stack([self._k_refs[l][s:s + ps].reshape(self._shape)
                                              for s in starts]) for l in range(self._L)])
                v = torch.stack([torch.stack([self._v_refs[l][s:s + ps].reshape(self._shape)
                                              for s in starts]) for l in range(self._L)])
                self._client.put(self.ns, hashes, k, v, 0, parent, self._L, self._key_bits,
                                 self._value_bits, self._deadline_ms)
                self._count(staged=n)
        except Exception as e:  # noqa: BLE001 - a failed save is a later miss
            logger.warning("tqkv batch_set_v1 failed: %s", e)
            self._count(set_errors=1)
            return [False] * n
        self._count(set_pages=n)
        return [True] * n

    # -------------------------------------- the pre-v1 interface (not served)
    def _v1_only(self, what):
        raise NotImplementedError("tqkv HiCache back-end serves interface_v1 only (%s)" % what)

    def get(self, key, target_location=None, target_sizes=None):
        self._v1_only("get")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._v1_only("batch_get")

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self._v1_only("set")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        self._v1_only("batch_set")

    def clear(self):
        try:
            self._client.delete(self.ns, all=True)
        except Exception as e:  # noqa: BLE001
            logger.warning("tqkv clear failed: %s", e)

    def get_stats(self):
        with self._lock:
            return dict(self._stats)

    def close(self):
        self._client.close()
