"""tqkv.Client: Put, Lookup, Get, Delete and Stats against tqkv-server(s) through libtqkv.

Blocks are BF16 K and V tensors of shape [T][H][D] (tokens, KV heads, head dim). In
Python they are NumPy arrays of 2-byte elements holding BF16 bits (uint16; see
tqkv.bf16_from_float32 / bf16_to_float32) or CPU torch tensors (torch.bfloat16), used
in place: the library reads and writes their memory directly, nothing is copied on the
Python side. A batch is a grid: N hashes (one sequence, in order) by L layers, stored
layer-major as one array [L][N][T][H][D] (or [N][T][H][D] for one layer), or given as
arrays of per-block addresses (put_ptrs / get_into) for caches with their own layout.

Everything that can fail raises tqkv.Error (.status, .status_name, .grpc_code,
.message). The calls release the GIL while they run.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._ffi import ffi, lib

# The C API's numbers (client.h), read from the declarations the library is checked
# against (tests/python/test_cdef_layout.py): one numbering, the proto's.
TRANSPORT_GRPC: int = lib.TQKV_CLIENT_TRANSPORT_GRPC
TRANSPORT_TCP: int = lib.TQKV_CLIENT_TRANSPORT_TCP
PACKED: int = lib.TQKV_CLIENT_PACKED
BF16: int = lib.TQKV_CLIENT_BF16
TIER_NONE: int = lib.TQKV_CLIENT_TIER_NONE
TIER_HBM: int = lib.TQKV_CLIENT_TIER_HBM
TIER_DRAM: int = lib.TQKV_CLIENT_TIER_DRAM
TIER_DISK: int = lib.TQKV_CLIENT_TIER_DISK
MODE_DEFAULT: int = lib.TQKV_CLIENT_MODE_DEFAULT
MODE_MSE: int = lib.TQKV_CLIENT_MODE_MSE
MODE_PROD: int = lib.TQKV_CLIENT_MODE_PROD
MODE_LOSSLESS: int = lib.TQKV_CLIENT_MODE_LOSSLESS

Hash = Union[bytes, bytearray, memoryview]
Shape = Tuple[int, int, int]
# A BF16 block array: a NumPy uint16 array or a CPU torch.bfloat16 tensor.
Array = Any

# Status codes (kernels/status.h), as module constants: tqkv.EINVAL, ...
STATUS: Dict[str, int] = {}
for _st in range(64):
    _name = ffi.string(lib.tqkv_status_name(_st)).decode()
    if not _name or _name.lower().startswith("unknown"):
        break
    STATUS[_name] = _st
del _st, _name


class Error(Exception):
    """A failed tqkv call: .status (int, kernels/status.h), .status_name ("ENOTFOUND"),
    .grpc_code (0 when the failure was local) and .message (the reason)."""

    def __init__(self, status: int, message: str, grpc_code: int = 0) -> None:
        self.status = int(status)
        self.status_name = ffi.string(lib.tqkv_status_name(self.status)).decode()
        self.grpc_code = int(grpc_code)
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message))


def _check(st: int, what: str) -> None:
    if st != 0:
        e = lib.tqkv_client_last_error()
        msg = ffi.string(e.message).decode(errors="replace") if e != ffi.NULL else ""
        grpc_code = e.grpc_code if e != ffi.NULL and e.status == st else 0
        if not msg or (e != ffi.NULL and e.status != st):
            msg = ffi.string(lib.tqkv_strerror(st)).decode()
        raise Error(st, "%s: %s" % (what, msg), grpc_code)


def _einval(msg: str) -> Error:
    return Error(STATUS.get("EINVAL", 1), msg)


def version() -> str:
    """libtqkv's release ("0.1.0")."""
    return ffi.string(lib.tqkv_version()).decode()


def _cstr(s):
    if s is None:
        return ffi.NULL
    if isinstance(s, str):
        s = s.encode()
    return ffi.new("char[]", s)


def _hashes(hashes):
    """A tqkv_hash_t array (cffi pointer, numpy owner) from a sequence of bytes."""
    hashes = [bytes(h) for h in hashes]
    n = len(hashes)
    if n == 0:
        raise _einval("no hashes")
    buf = np.zeros((n, 65), np.uint8)
    lens = {len(h) for h in hashes}
    if len(lens) == 1:
        ln = lens.pop()
        if not 8 <= ln <= 64:
            raise _einval("a block hash is 8..64 bytes, not %d" % ln)
        buf[:, 0] = ln
        buf[:, 1:1 + ln] = np.frombuffer(b"".join(hashes), np.uint8).reshape(n, ln)
    else:
        for i, h in enumerate(hashes):
            if not 8 <= len(h) <= 64:
                raise _einval("hash %d: a block hash is 8..64 bytes, not %d" % (i, len(h)))
            buf[i, 0] = len(h)
            buf[i, 1:1 + len(h)] = np.frombuffer(h, np.uint8)
    return ffi.cast("tqkv_hash_t *", buf.ctypes.data), buf


def _one_hash(h):
    p, buf = _hashes([h])
    return p, buf


def buffer_address(x: Any, writable: bool) -> Tuple[int, int]:
    """(address, nbytes) of x's memory: a C-contiguous NumPy array or CPU torch tensor
    of 2-byte elements (BF16 bits), or (read-only) any object with the buffer protocol.
    Never copies."""
    if hasattr(x, "data_ptr") and hasattr(x, "element_size"):  # torch.Tensor
        if x.device.type != "cpu":
            raise _einval("tensor on %s: tqkv reads and writes host memory" % x.device)
        if not x.is_contiguous():
            raise _einval("tensor is not contiguous")
        if x.element_size() != 2:
            raise _einval("tensor of %d-byte elements: BF16 blocks have 2" % x.element_size())
        return x.data_ptr(), x.numel() * 2
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise _einval("array is not C-contiguous")
        if writable and not x.flags.writeable:
            raise _einval("array is read-only")
        if x.dtype.itemsize != 2:
            raise _einval("array of dtype %s: BF16 blocks are 2-byte elements (uint16)" % x.dtype)
        return x.ctypes.data, x.nbytes
    if writable:
        raise _einval("output must be a NumPy array or a torch tensor")
    mv = memoryview(x)
    if not mv.c_contiguous:
        raise _einval("buffer is not contiguous")
    return int(ffi.cast("uintptr_t", ffi.from_buffer(mv))), mv.nbytes


def _grid(x, n, writable, what):
    """Shape (T, H, D), number of layers and base address of a [L][N][T][H][D] or
    [N][T][H][D] array x."""
    shp = tuple(x.shape)
    if len(shp) == 4:
        shp = (1,) + shp
    if len(shp) != 5 or shp[1] != n:
        raise _einval("%s: shape %s, want [layers][%d][T][H][D] or [%d][T][H][D]" %
                      (what, tuple(x.shape), n, n))
    addr, nbytes = buffer_address(x, writable)
    return shp[2:], shp[0], addr


def _ptr_grid(base, cells, tensor_bytes):
    return (base + np.arange(cells, dtype=np.uint64) * np.uint64(tensor_bytes)).astype(np.uintp)


def _ptrs(a):
    """A void** from a NumPy array of addresses (kept alive by the caller)."""
    a = np.ascontiguousarray(a, dtype=np.uintp)
    return ffi.cast("void **", a.ctypes.data), a


def _lossless_modes(lossless: Union[bool, str, None]) -> Tuple[int, int]:
    """(key_mode, value_mode) of put's lossless argument."""
    if lossless is True:
        return MODE_LOSSLESS, MODE_LOSSLESS
    if lossless is False or lossless is None:
        return 0, 0
    if lossless == "key":
        return MODE_LOSSLESS, 0
    if lossless == "value":
        return 0, MODE_LOSSLESS
    raise _einval("lossless: %r is not True, False, 'key' or 'value'" % (lossless,))


class Client:
    """A libtqkv client of one or several tqkv-servers.

    targets: "host:port" strings (several: rendezvous placement with `replicas` copies).
    transport: "tcp" (packed pages over TCP data channels where servers offer them,
    else gRPC) or "grpc". token: bearer token. tls_ca / tls_cert / tls_key /
    tls_target_name: TLS (tls_ca implies TLS; tls=True alone uses the system roots).
    deadline_ms: per call (0 = 30 s). The client is thread-safe.

    Live membership (docs/cluster.md): resolve_targets=True makes a DNS name stand for
    the servers it resolves to (a headless Service: SRV _grpc._tcp.NAME, else A/AAAA),
    re-resolved every resolve_interval_ms (0 = 10 s) and at once when a server fails;
    dns_servers ("IP:PORT,...") replaces the system's resolvers. read_repair (default
    on) puts a page found below its block's primaries back to them in the background,
    queueing at most read_repair_bytes (0 = 64 MiB).

    Failure handling with several servers (docs/cluster.md, "A silent server"): a Get or
    Lookup call without progress for its server's hedge delay (p95 of recent answers,
    hedge_min_ms..hedge_max_ms: 20..500 ms) is also asked of the next-ranked server
    (hedge=False: never); each call's own deadline is call_base_ms (5 s) plus its bytes
    at call_floor_mb_s (20 MB/s); connect_timeout_ms (1 s) bounds a connection attempt.
    0 = libtqkv's defaults.
    """

    def __init__(self, targets: Union[str, Sequence[str]], replicas: int = 1,
                 token: Optional[str] = None, tls: bool = False, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_target_name: Optional[str] = None, transport: str = "tcp",
                 deadline_ms: int = 0, channels_per_target: int = 0, wait_for_ready: bool = True,
                 resolve_targets: bool = False, max_message_bytes: int = 0,
                 backoff_min_ms: int = 0, backoff_max_ms: int = 0,
                 dns_servers: Optional[str] = None, resolve_interval_ms: int = 0,
                 read_repair: bool = True, read_repair_bytes: int = 0,
                 hedge: bool = True, hedge_min_ms: int = 0, hedge_max_ms: int = 0,
                 connect_timeout_ms: int = 0, call_base_ms: int = 0,
                 call_floor_mb_s: int = 0) -> None:
        if isinstance(targets, str):
            targets = [targets]
        if transport not in ("tcp", "grpc"):
            raise _einval("transport must be 'tcp' or 'grpc', not %r" % (transport,))
        self._c = ffi.NULL
        keep = [_cstr(t) for t in targets]
        arr = ffi.new("const char *[]", keep) if keep else ffi.NULL
        o = ffi.new("tqkv_client_opts_t *")
        o.struct_size = ffi.sizeof("tqkv_client_opts_t")  # TQKV_CLIENT_OPTS_INIT
        o.targets = arr
        o.num_targets = len(keep)
        o.resolve_targets = int(bool(resolve_targets))
        o.tls = int(bool(tls or tls_ca))
        strs = [_cstr(tls_ca), _cstr(tls_cert), _cstr(tls_key), _cstr(tls_target_name),
                _cstr(token), _cstr(dns_servers)]
        (o.tls_ca_path, o.tls_cert_path, o.tls_key_path, o.tls_target_name, o.token,
         o.dns_servers) = strs
        o.resolve_interval_ms = resolve_interval_ms
        o.no_read_repair = int(not read_repair)
        o.read_repair_bytes = read_repair_bytes
        o.deadline_ms = deadline_ms
        o.max_message_bytes = max_message_bytes
        o.replicas = replicas
        o.channels_per_target = channels_per_target
        o.wait_for_ready = int(bool(wait_for_ready))
        o.backoff_min_ms = backoff_min_ms
        o.backoff_max_ms = backoff_max_ms
        o.no_hedge = int(not hedge)
        o.hedge_min_ms, o.hedge_max_ms = hedge_min_ms, hedge_max_ms
        o.connect_timeout_ms = connect_timeout_ms
        o.call_base_ms, o.call_floor_mb_s = call_base_ms, call_floor_mb_s
        o.transport = TRANSPORT_TCP if transport == "tcp" else TRANSPORT_GRPC
        out = ffi.new("tqkv_client_t **")
        _check(lib.tqkv_client_create(o, out), "create")
        self._c = out[0]

    # -- lifetime --
    def close(self) -> None:
        """Destroys the client (no call may be running). Idempotent."""
        if self._c != ffi.NULL:
            lib.tqkv_client_destroy(self._c)
            self._c = ffi.NULL

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _h(self):
        if self._c == ffi.NULL:
            raise _einval("client is closed")
        return self._c

    @property
    def targets(self) -> List[str]:
        c = self._h()
        return [ffi.string(lib.tqkv_client_target_name(c, i)).decode()
                for i in range(lib.tqkv_client_num_targets(c))]

    @property
    def node_ids(self) -> List[Optional[str]]:
        """The node id each target reported (--node-id), None where none is known yet;
        in the order of `targets`."""
        c = self._h()
        buf = ffi.new("char[]", 256)
        out = []
        for i in range(lib.tqkv_client_num_targets(c)):
            rc = lib.tqkv_client_target_node_id(c, i, buf, 256)
            out.append(ffi.string(buf).decode() if rc == 0 else None)
        return out

    def refresh(self) -> int:
        """Resolves and identifies the targets now (a background thread does it every
        resolve_interval_ms). Returns the target table's version (+1 per change)."""
        return int(lib.tqkv_client_refresh(self._h()))

    def repair_stats(self) -> Dict[str, int]:
        """Read repair counters since the client was created: a dict of queued, repaired,
        stored, dropped, failed (pages) and pending_bytes."""
        st = ffi.new("tqkv_client_repair_stats_t *")
        lib.tqkv_client_repair_stats(self._h(), st)
        return {f: int(getattr(st, f)) for f in
                ("queued", "repaired", "stored", "dropped", "failed", "pending_bytes")}

    def repair_wait(self, timeout_ms: int = 10000) -> bool:
        """Waits until every page read repair queued has been put again (or failed) and
        nothing is pending: True, or False on timeout. Polls repair_stats (libtqkv has no
        waiting call in its API: tests and tools use this)."""
        end = time.monotonic() + timeout_ms / 1000.0
        while True:
            s = self.repair_stats()
            if s["pending_bytes"] == 0 and s["repaired"] + s["failed"] >= s["queued"]:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    # -- Put --
    def put(self, ns: str, hashes: Sequence[Hash], keys: Array, values: Array,
            layer_begin: int = 0, parent: Optional[Hash] = None, num_layers: int = 0,
            key_bits: float = 0, value_bits: float = 0, deadline_ms: int = 0,
            lossless: Union[bool, str] = False) -> Dict[str, int]:
        """Puts BF16 blocks: keys and values are [L][N][T][H][D] (or [N][T][H][D]) arrays
        for hashes[0..N) at layers layer_begin.. (the server encodes them). parent: the
        hash before hashes[0] (None for a sequence's first block). lossless: True stores K
        and V as BF16 as they came (Get returns these bytes), "key" or "value" only that
        tensor; its bits must stay 0. Returns a dict of the session's totals
        (blocks_stored, blocks_duplicate, bytes_in, bytes_stored, ...)."""
        n = len(hashes)
        shape, layers, kaddr = _grid(keys, n, False, "keys")
        vshape, vlayers, vaddr = _grid(values, n, False, "values")
        if (vshape, vlayers) != (shape, layers):
            raise _einval("keys and values differ in shape")
        tb = int(np.prod(shape)) * 2
        kp = _ptr_grid(kaddr, layers * n, tb)
        vp = _ptr_grid(vaddr, layers * n, tb)
        return self.put_ptrs(ns, hashes, shape, kp, vp, layer_begin, layer_begin + layers,
                             parent, num_layers, key_bits, value_bits, deadline_ms, lossless)

    def put_ptrs(self, ns: str, hashes: Sequence[Hash], shape: Shape, key_ptrs: Any,
                 value_ptrs: Any, layer_begin: int, layer_end: int,
                 parent: Optional[Hash] = None, num_layers: int = 0, key_bits: float = 0,
                 value_bits: float = 0, deadline_ms: int = 0,
                 lossless: Union[bool, str] = False) -> Dict[str, int]:
        """Puts BF16 blocks given by address: key_ptrs[(l - layer_begin) * N + i] is the
        [T][H][D] BF16 K of hashes[i] at layer l (NumPy array of addresses; the memory
        must stay valid during the call)."""
        c = self._h()
        hp, hbuf = _hashes(hashes)
        cells = len(hashes) * (layer_end - layer_begin)
        if len(key_ptrs) != cells or len(value_ptrs) != cells:
            raise _einval("%d key / %d value addresses for %d blocks" %
                          (len(key_ptrs), len(value_ptrs), cells))
        kp, ka = _ptrs(key_ptrs)
        vp, va = _ptrs(value_ptrs)
        nsb = _cstr(ns)
        r = ffi.new("tqkv_put_many_req_t *")
        r.ns = nsb
        r.hashes = hp
        r.num_hashes = len(hashes)
        pp = pbuf = None
        if parent is not None:
            pp, pbuf = _one_hash(parent)
            r.parent = pp
        r.layer_begin, r.layer_end, r.num_layers = layer_begin, layer_end, num_layers
        r.shape.num_tokens, r.shape.num_kv_heads, r.shape.head_dim = shape
        r.keys = kp
        r.values = vp
        o = ffi.new("tqkv_put_opts_t *")
        o.key_bits, o.value_bits, o.deadline_ms = key_bits, value_bits, deadline_ms
        o.key_mode, o.value_mode = _lossless_modes(lossless)
        res = ffi.new("tqkv_put_result_t *")
        _check(lib.tqkv_client_put_many(c, o, r, res), "put")
        return {f: getattr(res, f) for f in ("blocks_sent", "blocks_stored", "blocks_duplicate",
                                             "bytes_in", "bytes_stored", "blocks_lost")}

    def put_pages(self, ns: str, blocks: Iterable[Tuple[Hash, int, Any, Optional[Hash]]],
                  num_layers: int = 0, deadline_ms: int = 0) -> Dict[str, int]:
        """Puts encoded pages: blocks is a sequence of (hash, layer, page bytes, parent or
        None). Each page is validated (CRC included) first. Returns the totals as put()."""
        c = self._h()
        o = ffi.new("tqkv_put_opts_t *")
        o.deadline_ms = deadline_ms
        pp = ffi.new("tqkv_put_t **")
        _check(lib.tqkv_client_put_begin(c, o, pp), "put")
        p = pp[0]
        nsb = _cstr(ns)
        b = ffi.new("tqkv_put_block_t *")
        try:
            for h, layer, page, parent in blocks:
                hp, hb = _one_hash(h)
                b.ns, b.hash, b.layer, b.num_layers = nsb, hp, layer, num_layers
                par = parb = None
                if parent is not None:
                    par, parb = _one_hash(parent)
                b.parent = par if par is not None else ffi.NULL
                pg = ffi.from_buffer(page)
                b.page, b.page_len = pg, len(pg)
                # The page's shape rides along in the message; reading it validates the
                # page (CRC included) before anything is sent.
                _check(lib.tqkv_client_decode_page(pg, len(pg), ffi.NULL, ffi.NULL,
                                                   ffi.addressof(b, "shape")), "put")
                st = lib.tqkv_client_put_block(p, b)
                if st != 0:
                    raise_later = st
                    lib.tqkv_client_put_end(p, ffi.NULL)
                    p = None
                    _check(raise_later, "put")
        except BaseException:
            if p is not None:
                lib.tqkv_client_put_abort(p)
            raise
        res = ffi.new("tqkv_put_result_t *")
        _check(lib.tqkv_client_put_end(p, res), "put")
        return {f: getattr(res, f) for f in ("blocks_sent", "blocks_stored", "blocks_duplicate",
                                             "bytes_in", "bytes_stored", "blocks_lost")}

    # -- Lookup --
    def lookup(self, ns: str, hashes: Sequence[Hash], num_layers: int = 1, lease_ms: int = 0,
               deadline_ms: int = 0) -> Tuple[int, np.ndarray]:
        """Returns (prefix_blocks, tiers): how many leading hashes have all layers
        [0, num_layers) stored, and each hash's tier (TIER_NONE when absent). lease_ms > 0
        pins the found blocks that long."""
        c = self._h()
        hp, hbuf = _hashes(hashes)
        nsb = _cstr(ns)
        r = ffi.new("tqkv_lookup_req_t *")
        r.ns, r.hashes, r.num_hashes = nsb, hp, len(hashes)
        r.num_layers, r.lease_ms, r.deadline_ms = num_layers, lease_ms, deadline_ms
        prefix = ffi.new("uint32_t *")
        tiers = np.zeros(len(hashes), np.uint8)
        _check(lib.tqkv_client_lookup(c, r, prefix, ffi.cast("uint8_t *", tiers.ctypes.data)),
               "lookup")
        return int(prefix[0]), tiers

    # -- Get --
    def get(self, ns: str, hashes: Sequence[Hash], layer_begin: int = 0,
            layer_end: Optional[int] = None, keys: Optional[Array] = None,
            values: Optional[Array] = None, shape: Optional[Shape] = None,
            encoding: Union[str, int] = "packed",
            deadline_ms: int = 0) -> Tuple[Array, Array, np.ndarray]:
        """Gets hashes x layers [layer_begin, layer_end) decoded to BF16 into keys and
        values ([L][N][T][H][D] arrays, written in place; allocated as uint16 NumPy arrays
        when None, which needs shape=(T, H, D)). encoding "packed": pages travel packed
        and are decoded in C; "bf16": the server decodes. Returns (keys, values, found)
        with found a bool array [L][N]; missing blocks are left untouched."""
        n = len(hashes)
        if layer_end is None:
            layer_end = layer_begin + 1
        layers = layer_end - layer_begin
        if layers <= 0:
            raise _einval("layer_end must be > layer_begin")
        if keys is None or values is None:
            if shape is None:
                shape = tuple((keys if keys is not None else values).shape[-3:]) \
                    if (keys is not None or values is not None) else None
            if shape is None:
                raise _einval("get: give keys/values arrays or shape=(T, H, D)")
            if keys is None:
                keys = np.empty((layers, n) + tuple(shape), np.uint16)
            if values is None:
                values = np.empty((layers, n) + tuple(shape), np.uint16)
        kshape, kl, kaddr = _grid(keys, n, True, "keys")
        vshape, vl, vaddr = _grid(values, n, True, "values")
        if kl != layers or vl != layers or kshape != vshape:
            raise _einval("get: keys/values must be [%d][%d][T][H][D]" % (layers, n))
        tb = int(np.prod(kshape)) * 2
        found = self.get_into(ns, hashes, layer_begin, layer_end, kshape,
                              _ptr_grid(kaddr, layers * n, tb), _ptr_grid(vaddr, layers * n, tb),
                              encoding, deadline_ms)
        return keys, values, found.reshape(layers, n)

    def get_into(self, ns: str, hashes: Sequence[Hash], layer_begin: int, layer_end: int,
                 shape: Shape, key_ptrs: Any, value_ptrs: Any,
                 encoding: Union[str, int] = "packed", deadline_ms: int = 0) -> np.ndarray:
        """Gets a grid into BF16 destinations given by address (key_ptrs[(l - layer_begin)
        * N + i], value_ptrs likewise; 0 = not wanted). Returns found, a bool array of
        the same indexing."""
        c = self._h()
        hp, hbuf = _hashes(hashes)
        cells = len(hashes) * (layer_end - layer_begin)
        if key_ptrs is not None and len(key_ptrs) != cells:
            raise _einval("%d key addresses for %d blocks" % (len(key_ptrs), cells))
        if value_ptrs is not None and len(value_ptrs) != cells:
            raise _einval("%d value addresses for %d blocks" % (len(value_ptrs), cells))
        kp, ka = _ptrs(key_ptrs) if key_ptrs is not None else (ffi.NULL, None)
        vp, va = _ptrs(value_ptrs) if value_ptrs is not None else (ffi.NULL, None)
        nsb = _cstr(ns)
        r = ffi.new("tqkv_get_req_t *")
        r.ns, r.hashes, r.num_hashes = nsb, hp, len(hashes)
        r.layer_begin, r.layer_end = layer_begin, layer_end
        r.encoding = self._encoding(encoding)
        r.deadline_ms = deadline_ms
        d = ffi.new("tqkv_get_into_t *")
        d.shape.num_tokens, d.shape.num_kv_heads, d.shape.head_dim = shape
        d.keys, d.values = kp, vp
        found = np.zeros(cells, np.uint8)
        d.found = ffi.cast("uint8_t *", found.ctypes.data)
        _check(lib.tqkv_client_get_into(c, r, d, ffi.NULL, ffi.NULL), "get")
        return found.astype(bool)

    @staticmethod
    def _encoding(e: Union[str, int]) -> int:
        if e in ("packed", PACKED):
            return PACKED
        if e in ("bf16", BF16):
            return BF16
        raise _einval("encoding must be 'packed' or 'bf16', not %r" % (e,))

    def get_pages(self, ns: str, hashes: Sequence[Hash], layer_begin: int = 0,
                  layer_end: Optional[int] = None, deadline_ms: int = 0,
                  info: Optional[Dict[str, Any]] = None) -> Dict[Tuple[int, int], bytes]:
        """The packed pages themselves: {(hash index, layer): bytes} for the blocks found
        (CRC checked by the library). For tools and tests; get() is the fast path. A dict
        passed as info gets per-page facts: "data_channel" (pages that came over a TCP
        data channel), "crc_checked", "targets" (hash index, layer) -> target index."""
        c = self._h()
        if layer_end is None:
            layer_end = layer_begin + 1
        hp, hbuf = _hashes(hashes)
        nsb = _cstr(ns)
        r = ffi.new("tqkv_get_req_t *")
        r.ns, r.hashes, r.num_hashes = nsb, hp, len(hashes)
        r.layer_begin, r.layer_end, r.encoding, r.deadline_ms = layer_begin, layer_end, PACKED, \
            deadline_ms
        pages = {}
        if info is not None:
            info.update(data_channel=0, crc_checked=0, targets={})

        @ffi.callback("int(void *, const tqkv_get_page_t *)")
        def cb(arg, pg):
            if pg.found:
                pages[(pg.hash_index, pg.layer)] = bytes(ffi.buffer(pg.page, pg.page_len))
                if info is not None:
                    info["data_channel"] += pg.data_channel
                    info["crc_checked"] += pg.crc_checked
                    info["targets"][(pg.hash_index, pg.layer)] = pg.target
            return 0

        _check(lib.tqkv_client_get(c, r, cb, ffi.NULL), "get")
        return pages

    # -- Delete, Stats, Health --
    def delete(self, ns: str, hashes: Optional[Sequence[Hash]] = None,
               all: bool = False) -> Tuple[int, int]:
        """Deletes every layer of hashes (or the whole namespace with all=True). Returns
        (pages_deleted, bytes_freed)."""
        c = self._h()
        nsb = _cstr(ns)
        pages = ffi.new("uint64_t *")
        freed = ffi.new("uint64_t *")
        if all:
            hp, n, hbuf = ffi.NULL, 0, None
        else:
            hp, hbuf = _hashes(hashes or [])
            n = len(hashes)
        _check(lib.tqkv_client_delete(c, nsb, hp, n, int(bool(all)), pages, freed), "delete")
        return int(pages[0]), int(freed[0])

    def stats(self, ns: str = "") -> Dict[str, Any]:
        """Stats of a namespace ("" = the whole server), summed over the live targets."""
        c = self._h()
        s = ffi.new("tqkv_client_stats_t *")
        _check(lib.tqkv_client_stats(c, _cstr(ns), s), "stats")
        keys = ("hits", "misses", "evictions", "bytes_in", "bytes_out", "pages", "page_bytes",
                "bf16_bytes", "compression_ratio")
        out = {k: getattr(s, k) for k in keys}
        tk = ("tier", "capacity_bytes", "bytes_used", "pages", "hits", "misses", "evictions",
              "demotions", "promotions")
        out["tiers"] = [{k: getattr(s.tiers[i], k) for k in tk} for i in range(s.num_tiers)]
        return out

    def health(self, target: int = 0, service: str = "") -> int:
        """grpc.health.v1 serving status of target (1 = SERVING)."""
        c = self._h()
        out = ffi.new("int *")
        _check(lib.tqkv_client_health(c, target, _cstr(service), out), "health")
        return int(out[0])

    def data_channel_status(self, target: int = 0) -> str:
        """"" while target's TCP data channels work, else why Gets fall back to gRPC."""
        return ffi.string(lib.tqkv_client_data_channel_status(self._h(), target)).decode()


def decode_page(page: Any, keys: Optional[Array] = None,
                values: Optional[Array] = None) -> Tuple[Array, Array]:
    """Validates (with CRC) and decodes one packed page into BF16 keys/values [T][H][D]
    (allocated as uint16 arrays when None). Returns (keys, values)."""
    pg = ffi.from_buffer(page)
    shp = ffi.new("tqkv_block_shape_t *")
    _check(lib.tqkv_client_decode_page(pg, len(pg), ffi.NULL, ffi.NULL, shp), "decode")
    shape = (shp.num_tokens, shp.num_kv_heads, shp.head_dim)
    if keys is None:
        keys = np.empty(shape, np.uint16)
    if values is None:
        values = np.empty(shape, np.uint16)
    need = int(np.prod(shape)) * 2
    ka, kn = buffer_address(keys, True)
    va, vn = buffer_address(values, True)
    if kn != need or vn != need:
        raise _einval("decode: outputs of %d/%d bytes for a %s page" % (kn, vn, shape))
    _check(lib.tqkv_client_decode_page(pg, len(pg), ffi.cast("uint16_t *", ka),
                                       ffi.cast("uint16_t *", va), ffi.NULL), "decode")
    return keys, values


def bf16_from_float32(a: Any) -> np.ndarray:
    """float32 -> BF16 bits (uint16), rounding to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    if nan.any():
        r[nan] = 0x7FC0
    return r


def bf16_to_float32(h: Any) -> np.ndarray:
    """BF16 bits (uint16) -> float32, exact."""
    return (np.ascontiguousarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(
        np.float32)
