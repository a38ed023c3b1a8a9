#!/usr/bin/env python3
"""Put a 64-token sequence (4 blocks x 2 layers) into tqkv, Lookup it, Get it back
decoded, and print how close the decoded KV is. Run against a server:

    tqkv-server --listen 127.0.0.1:7000 --data-listen 127.0.0.1:7001 &
    PYTHONPATH=<prefix>/lib/python3/dist-packages python3 put_get.py 127.0.0.1:7000
"""
import hashlib
import sys

import numpy as np

import tqkv

T, H, D, LAYERS = 16, 8, 128, 2  # 16-token blocks, 8 KV heads, head_dim 128


def main(target):
    tokens = list(range(1000, 1064))  # the sequence: 4 blocks of 16 tokens
    # Chained block hashes: each names the whole prefix up to its block.
    hashes, h = [], b"my-seed"
    for i in range(0, len(tokens), T):
        h = hashlib.sha256(h + np.asarray(tokens[i:i + T], "<i4").tobytes()).digest()
        hashes.append(h)
    rng = np.random.default_rng(0)
    k = tqkv.bf16_from_float32(rng.standard_normal((LAYERS, len(hashes), T, H, D)))
    v = tqkv.bf16_from_float32(rng.standard_normal((LAYERS, len(hashes), T, H, D)))
    with tqkv.Client([target], transport="tcp") as c:
        res = c.put("example-model", hashes, k, v, num_layers=LAYERS)
        prefix, tiers = c.lookup("example-model", hashes, num_layers=LAYERS, lease_ms=5000)
        keys, values, found = c.get("example-model", hashes, 0, LAYERS, shape=(T, H, D))
        kf, k0 = tqkv.bf16_to_float32(keys), tqkv.bf16_to_float32(k)
        err = np.linalg.norm(kf - k0) / np.linalg.norm(k0)
        print("stored %d blocks (%d page bytes for %d BF16 bytes), prefix %d of %d, "
              "all found: %s, K relative error %.3f" %
              (res["blocks_stored"], res["bytes_stored"], k.nbytes + v.nbytes, prefix,
               len(hashes), bool(found.all()), err))
        c.delete("example-model", all=True)
    return 0 if prefix == len(hashes) and found.all() and err < 0.3 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7000"))
