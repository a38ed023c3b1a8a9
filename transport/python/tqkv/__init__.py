"""tqkv: Python client of the tqkv KV-cache offload service, over libtqkv.so.

    import numpy as np, tqkv
    c = tqkv.Client(["127.0.0.1:7000"], transport="tcp")
    k = tqkv.bf16_from_float32(np.random.randn(2, 4, 16, 8, 128))   # [L][N][T][H][D]
    hashes = [bytes([i]) * 32 for i in range(4)]
    c.put("my-model", hashes, k, k)
    prefix, tiers = c.lookup("my-model", hashes, num_layers=2)
    keys, values, found = c.get("my-model", hashes, 0, 2, shape=(16, 8, 128))

See docs/integration.md. The vLLM KV connector is tqkv.vllm_connector.
"""
from typing import List

from ._ffi import library_path
from ._version import __version__
from .client import (BF16, MODE_DEFAULT, MODE_MSE, MODE_PROD, PACKED, STATUS, TIER_DISK,
                     TIER_DRAM, TIER_HBM, TIER_NONE, Client, Error, bf16_from_float32,
                     bf16_to_float32, buffer_address, decode_page, version)

globals().update(STATUS)  # tqkv.EINVAL, tqkv.ENOTFOUND, ...

library_path: str
__all__: List[str] = ["__version__", "Client", "Error", "decode_page", "bf16_from_float32",
                      "bf16_to_float32", "buffer_address", "version", "library_path", "PACKED",
                      "BF16", "TIER_NONE", "TIER_HBM", "TIER_DRAM", "TIER_DISK",
                      "MODE_DEFAULT", "MODE_MSE", "MODE_PROD", "STATUS"] + list(STATUS)
