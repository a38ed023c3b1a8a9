#!/usr/bin/python3
"""Python Get of packed pages decoded to BF16 vs the C client, same server, same run.

Starts a tqkv-server (with a TCP data channel), Puts BLOCKS x LAYERS random BF16 blocks
of [T][H][D], then times, alternating, ROUNDS times:
  C   cb    tqkv_client_get + tqkv_page_decode_bf16 per page in the callback (a C engine)
  C   into  tqkv_client_get_into (the bulk call the Python package makes)
  Py  numpy tqkv.Client.get into preallocated uint16 NumPy arrays [L][N][T][H][D]
  Py  torch tqkv.Client.get into preallocated torch.bfloat16 tensors
each ITERS Gets of the whole grid (the first of each batch, which opens connections, is
dropped), and prints the median decoded BF16 GB/s (K and V bytes written) and the
ratio to C cb. Exits 1 when Py numpy / C cb < --min-ratio.

Usage: bench_get.py [--blocks 64] [--layers 32] [--iters 5] [--rounds 3]
                    [--transport tcp|grpc] [--min-ratio 0]
Environment: TQKV_SERVER, TQKV_BENCH_C (bench_get_decode), TQKV_LIBRARY, PYTHONPATH.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tqkv  # noqa: E402
from tqkv_testutil import Server  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--min-ratio", type=float, default=0.0)
    a = ap.parse_args()
    cbench = os.environ["TQKV_BENCH_C"]
    T, H, D, N, L = a.tokens, a.heads, a.dim, a.blocks, a.layers
    srv = Server(capacity="4G")
    try:
        rng = np.random.default_rng(1)
        c = tqkv.Client([srv.addr], transport=a.transport)
        hashes = [rng.integers(0, 256, 32, dtype=np.uint8).tobytes() for _ in range(N)]
        for l0 in range(0, L, 8):
            l1 = min(L, l0 + 8)
            k = tqkv.bf16_from_float32(rng.standard_normal((l1 - l0, N, T, H, D)))
            v = tqkv.bf16_from_float32(rng.standard_normal((l1 - l0, N, T, H, D)) * 0.5)
            c.put("bench", hashes, k, v, layer_begin=l0, num_layers=L)
        hf = tempfile.NamedTemporaryFile(delete=False)
        hf.write(b"".join(hashes))
        hf.close()
        decoded = N * L * T * H * D * 2 * 2

        def run_c(mode):
            out = subprocess.run([cbench, srv.addr, "bench", hf.name, str(L), str(T), str(H),
                                  str(D), str(a.iters + 1), a.transport, mode],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError("C bench failed: " + out.stderr)
            secs = [float(line.split()[0]) for line in out.stdout.split("\n") if line.strip()]
            return [decoded / s / 1e9 for s in secs[1:]]

        kn = np.zeros((L, N, T, H, D), np.uint16)
        vn = np.zeros_like(kn)

        def run_py(keys, values):
            out = []
            for i in range(a.iters + 1):
                t0 = time.perf_counter()
                _, _, found = c.get("bench", hashes, 0, L, keys=keys, values=values)
                t = time.perf_counter() - t0
                if not found.all():
                    raise RuntimeError("Python Get: %d blocks missing" % (~found).sum())
                if i:
                    out.append(decoded / t / 1e9)
            return out

        kt = vt = None
        try:
            import torch
            kt = torch.zeros((L, N, T, H, D), dtype=torch.bfloat16)
            vt = torch.zeros_like(kt)
        except ImportError:
            pass
        res = {"C   cb   ": [], "C   into ": [], "Py  numpy": [], "Py  torch": []}
        for _ in range(a.rounds):
            res["C   cb   "] += run_c("cb")
            res["Py  numpy"] += run_py(kn, vn)
            res["C   into "] += run_c("into")
            if kt is not None:
                res["Py  torch"] += run_py(kt, vt)
        # Same bytes either way.
        kc, vc, _ = c.get("bench", hashes, 0, L, shape=(T, H, D))
        assert np.array_equal(kc, kn) and np.array_equal(vc, vn)
        base = statistics.median(res["C   cb   "])
        print("tqkv %s, %s transport, %d blocks x %d layers of [%d][%d][%d] BF16 = %.1f MB "
              "decoded per Get, %d Gets per method x %d rounds, median" %
              (tqkv.version(), a.transport, N, L, T, H, D, decoded / 1e6, a.iters, a.rounds))
        print("| method                                   | decoded GB/s | pages/s  | vs C cb |")
        print("|------------------------------------------|--------------|----------|---------|")
        names = {"C   cb   ": "C: tqkv_client_get + decode in callback",
                 "C   into ": "C: tqkv_client_get_into",
                 "Py  numpy": "Python: Client.get -> NumPy uint16",
                 "Py  torch": "Python: Client.get -> torch.bfloat16"}
        for k, v in res.items():
            if not v:
                continue
            m = statistics.median(v)
            print("| %-40s | %12.2f | %8.0f | %6.0f%% |" %
                  (names[k], m, m * 1e9 / decoded * N * L, 100 * m / base))
        ratio = statistics.median(res["Py  numpy"]) / base
        c.close()
        if ratio < a.min_ratio:
            print("FAIL: Python/C %.2f < %.2f" % (ratio, a.min_ratio))
            return 1
        return 0
    finally:
        srv.stop()
        try:
            os.unlink(hf.name)
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main())
