"""Shared by the tests under tests/python: real tqkv-server processes on loopback.

Environment (set by tests/python.cmake): TQKV_SERVER (the binary), TQKV_LIBRARY
(libtqkv.so), TQKV_CODEC (tqkv-codec), PYTHONPATH with transport/python.
"""
import os
import sys

import numpy as np

SERVER = os.environ.get("TQKV_SERVER", "")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_seed import test_seed  # noqa: E402
from tqkv_server import ServerProcess  # noqa: E402

SEED = test_seed()


class Server(ServerProcess):
    """A tqkv-server on 127.0.0.1:0 (the port it prints), optionally with a TCP data
    channel port (--data-listen 127.0.0.1:0); tests/support/tqkv_server.py."""

    def __init__(self, *extra, data_channel=True, capacity="512M"):
        if not SERVER:
            raise RuntimeError("TQKV_SERVER is not set")
        args = ["--listen", "127.0.0.1:0", "--threads", "2", "--encoder-threads", "2",
                "--dram-capacity", capacity]
        if data_channel:
            args += ["--data-listen", "127.0.0.1:0"]
        super().__init__(SERVER, args + list(extra), start_timeout=60, drain_stdout=True)


def rng(offset=0):
    return np.random.default_rng(SEED + offset)


def rand_hashes(r, n, length=32):
    return [r.integers(0, 256, length, dtype=np.uint8).tobytes() for _ in range(n)]
