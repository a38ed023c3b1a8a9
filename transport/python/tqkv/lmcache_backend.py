"""tqkv as an LMCache remote storage back-end, loaded by LMCache's own configuration.

LMCache (0.5.6, read from lmcache/v1/storage_backend/connector/__init__.py) loads remote
connector plug-ins named in remote_storage_plugins, each with a module path and class in
extra_config; the remote_url's scheme picks the adapter. In the LMCache config file:

    remote_url: "tqkv://10.0.0.5:7000,10.0.0.6:7000"
    remote_serde: "naive"
    remote_storage_plugins: ["tqkv"]
    extra_config:
      remote_storage_plugin.tqkv.module_path: tqkv.lmcache_backend
      remote_storage_plugin.tqkv.class_name: TqkvConnectorAdapter
      tqkv_replicas: 1            # optional, as the other tqkv_* keys below
      tqkv_namespace: lmcache     # default: "lmcache/<model name>"

(or LMCACHE_REMOTE_URL / LMCACHE_REMOTE_STORAGE_PLUGINS / LMCACHE_EXTRA_CONFIG).

Mapping. One LMCache chunk (KV_2LTD memory object [2][num_layers][T][H*D], BF16) is one
tqkv block per layer: K = [0][l], V = [1][l] as [T][H][D], so the server stores it
compressed with the namespace's policy and LMCache users get that without changing their
engine. Block hash: SHA-256 of the chunk key's string (model, world size, worker, chunk
hash, dtype). Puts read the memory object by address and full-chunk Gets decode into a
newly allocated one by address (no staging copy); a chunk shorter than the chunk size
(the prompt's tail) is found through its pages' headers and decoded the same way.

Never wrong KV: a chunk is returned only when every layer was found and decoded; any
failure is None (a miss) and is counted (stats()).
"""
import asyncio
import hashlib
import logging
import threading
from urllib.parse import urlparse

import numpy as np

from . import client as _client

logger = logging.getLogger("tqkv.lmcache_backend")

try:
    import torch
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    HAVE_LMCACHE = True
    LMCACHE_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001 - lmcache absent: the module still imports
    HAVE_LMCACHE = False
    LMCACHE_IMPORT_ERROR = "%s: %s" % (type(_e).__name__, _e)
    ConnectorAdapter = RemoteConnector = object
    ConnectorContext = None

__all__ = ["TqkvConnectorAdapter", "TqkvRemoteConnector", "HAVE_LMCACHE", "chunk_hash"]

SCHEME = "tqkv://"


def chunk_hash(key):
    """The tqkv block hash of an LMCache CacheEngineKey."""
    s = key.to_string() if hasattr(key, "to_string") else str(key)
    return hashlib.sha256(s.encode()).digest()


def parse_targets(url):
    """tqkv://host:port[,host:port...][/...] -> ["host:port", ...]."""
    if not url.startswith(SCHEME):
        raise ValueError("not a tqkv URL: %r (want tqkv://host:port[,host:port])" % (url,))
    rest = url[len(SCHEME):].split("/", 1)[0].split("?", 1)[0]
    out = [t.strip() for t in rest.split(",") if t.strip()]
    if not out:
        raise ValueError("tqkv URL %r names no server" % (url,))
    for t in out:
        if urlparse("//" + t).port is None:
            raise ValueError("tqkv URL %r: %r has no port" % (url, t))
    return out


class TqkvRemoteConnector(RemoteConnector):
    """LMCache RemoteConnector over tqkv-server(s). See the module docstring."""

    def __init__(self, url, loop, local_cpu_backend, config, metadata):
        super().__init__(config, metadata)
        if metadata.use_mla or len(self.meta_shapes) != 1:
            raise ValueError("tqkv LMCache back-end: MLA and multi-group KV are not supported")
        if self.meta_dtypes[0] != torch.bfloat16:
            raise ValueError("tqkv stores BF16 KV; LMCache's KV dtype is %s" %
                             (self.meta_dtypes[0],))
        L, _two, _T, H, D = metadata.kv_shape
        # a full chunk: the memory object shape [2][L][chunk_size][H*D] LMCache allocates
        self._L, self._T, self._H, self._D = int(L), int(self.meta_shapes[0][2]), int(H), int(D)
        if tuple(self.meta_shapes[0]) != (2, self._L, self._T, self._H * self._D):
            raise ValueError("tqkv: unsupported LMCache chunk shape %s" %
                             (tuple(self.meta_shapes[0]),))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra = dict(getattr(config, "extra_config", None) or {})
        self.ns = str(extra.get("tqkv_namespace") or ("lmcache/" + str(metadata.model_name)))
        self._deadline_ms = int(extra.get("tqkv_deadline_ms", 10000))
        self._key_bits = float(extra.get("tqkv_key_bits", 0))
        self._value_bits = float(extra.get("tqkv_value_bits", 0))
        token = extra.get("tqkv_token")
        if token is None and extra.get("tqkv_token_file"):
            with open(extra["tqkv_token_file"]) as f:
                token = f.readline().strip() or None
        self._client = _client.Client(
            parse_targets(url), replicas=int(extra.get("tqkv_replicas", 1)), token=token,
            tls_ca=extra.get("tqkv_tls_ca"), tls_target_name=extra.get("tqkv_tls_target_name"),
            transport=extra.get("tqkv_transport", "tcp"), deadline_ms=self._deadline_ms,
            wait_for_ready=False)
        self._lock = threading.Lock()
        self._stats = dict(exists=0, exists_errors=0, gets=0, get_hits=0, get_errors=0,
                           partial_gets=0, puts=0, put_errors=0)

    def _count(self, **kw):
        with self._lock:
            for k, v in kw.items():
                self._stats[k] += v

    def stats(self):
        with self._lock:
            return dict(self._stats)

    # -------------------------------------------------------------- sync bodies
    def exists_sync(self, key):
        self._count(exists=1)
        try:
            prefix, _ = self._client.lookup(self.ns, [chunk_hash(key)], num_layers=self._L,
                                            deadline_ms=self._deadline_ms)
            return prefix == 1
        except Exception as e:  # noqa: BLE001 - a failure is a miss
            logger.warning("tqkv exists failed (a miss): %s", e)
            self._count(exists_errors=1)
            return False

    def _ptrs(self, t):
        """K and V addresses per layer of a KV_2LTD tensor [2][L][T][H*D]."""
        st = t.stride()
        base = t.data_ptr()
        kp = np.array([base + l * st[1] * 2 for l in range(self._L)], np.uint64)
        vp = kp + np.uint64(st[0] * 2)
        return kp, vp

    def _check_obj(self, t):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or t.shape[0] != 2 or \
                t.shape[1] != self._L or t.shape[3] != self._H * self._D or \
                t.stride()[2:] != (self._H * self._D, 1):
            raise ValueError("tqkv: unsupported memory object %s %s strides %s" %
                             (t.dtype, tuple(t.shape), t.stride()))

    def _get_sync(self, key):
        self._count(gets=1)
        h = chunk_hash(key)
        obj = None
        try:
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                  self.meta_fmt)
            if obj is None:
                logger.debug("tqkv get: no local CPU memory for a chunk")
                return None
            t = obj.tensor
            self._check_obj(t)
            kp, vp = self._ptrs(t)
            try:
                found = self._client.get_into(self.ns, [h], 0, self._L,
                                              (self._T, self._H, self._D), kp, vp, "packed",
                                              self._deadline_ms)
            except _client.Error:
                found = np.zeros(self._L, bool)  # e.g. a shorter (tail) chunk's pages
            if found.all():
                self._count(get_hits=1)
                return obj
            obj.ref_count_down()
            obj = None
            return self._get_partial(h)
        except Exception as e:  # noqa: BLE001 - a failure is a miss
            logger.warning("tqkv get failed (a miss): %s", e)
            self._count(get_errors=1)
            if obj is not None:
                obj.ref_count_down()
            return None

    def _get_partial(self, h):
        """A chunk whose pages hold fewer tokens than the chunk size (or a miss)."""
        pages = self._client.get_pages(self.ns, [h], 0, self._L, self._deadline_ms)
        if len(pages) != self._L:
            return None
        k0, _ = _client.decode_page(pages[(0, 0)])
        T = k0.shape[0]
        if T <= 0 or T > self._T or k0.shape[1:] != (self._H, self._D):
            return None
        shape = torch.Size([2, self._L, T, self._H * self._D])
        obj = self.local_cpu_backend.allocate([shape], self.meta_dtypes, self.meta_fmt)
        if obj is None:
            return None
        t = obj.tensor
        try:
            for l in range(self._L):
                _client.decode_page(pages[(0, l)], t[0, l].view(torch.int16).numpy(),
                                    t[1, l].view(torch.int16).numpy())
        except Exception:
            obj.ref_count_down()
            raise
        self._count(get_hits=1, partial_gets=1)
        return obj

    def _put_sync(self, key, memory_obj):
        self._count(puts=1)
        try:
            t = memory_obj.tensor
            self._check_obj(t)
            kp, vp = self._ptrs(t)
            self._client.put_ptrs(self.ns, [chunk_hash(key)], (int(t.shape[2]), self._H,
                                                               self._D), kp, vp, 0, self._L,
                                  None, self._L, self._key_bits, self._value_bits,
                                  self._deadline_ms)
        except Exception as e:  # noqa: BLE001 - a failed save is a later miss
            logger.warning("tqkv put failed: %s", e)
            self._count(put_errors=1)

    # ------------------------------------------------------ RemoteConnector API
    async def exists(self, key):
        return await asyncio.get_running_loop().run_in_executor(None, self.exists_sync, key)

    async def get(self, key):
        return await asyncio.get_running_loop().run_in_executor(None, self._get_sync, key)

    async def put(self, key, memory_obj):
        await asyncio.get_running_loop().run_in_executor(None, self._put_sync, key, memory_obj)

    async def list(self):
        return []  # tqkv does not enumerate a namespace's blocks

    def remove_sync(self, key):
        try:
            n, _ = self._client.delete(self.ns, [chunk_hash(key)])
            return n > 0
        except Exception as e:  # noqa: BLE001
            logger.warning("tqkv remove failed: %s", e)
            return False

    def support_batched_contains(self):
        return True

    def batched_contains(self, keys):
        """How many leading keys are stored (one Lookup)."""
        if not keys:
            return 0
        self._count(exists=len(keys))
        try:
            prefix, _ = self._client.lookup(self.ns, [chunk_hash(k) for k in keys],
                                            num_layers=self._L, deadline_ms=self._deadline_ms)
            return int(prefix)
        except Exception as e:  # noqa: BLE001
            logger.warning("tqkv batched_contains failed (a miss): %s", e)
            self._count(exists_errors=1)
            return 0

    async def close(self):
        self._client.close()


class TqkvConnectorAdapter(ConnectorAdapter):
    """The adapter LMCache's remote_storage_plugins loads: remote_url tqkv://..."""

    def __init__(self):
        super().__init__(SCHEME)

    def can_parse(self, url):
        return url.startswith(SCHEME) or url.startswith("plugin://tqkv")

    def create_connector(self, context):
        return TqkvRemoteConnector(context.url, context.loop, context.local_cpu_backend,
                                   context.config, context.metadata)
