"""Shared by the tests under tests/python: real tqkv-server processes on loopback.

Environment (set by tests/python.cmake): TQKV_SERVER (the binary), TQKV_LIBRARY
(libtqkv.so), TQKV_CODEC (tqkv-codec), PYTHONPATH with transport/python.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

SERVER = os.environ.get("TQKV_SERVER", "")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tqkv_seed import test_seed  # noqa: E402

SEED = test_seed()


class Server:
    """A tqkv-server on 127.0.0.1:0 (the port it prints), optionally with a TCP data
    channel port (--data-listen 127.0.0.1:0)."""

    def __init__(self, *extra, data_channel=True, capacity="512M"):
        if not SERVER:
            raise RuntimeError("TQKV_SERVER is not set")
        args = [SERVER, "--listen", "127.0.0.1:0", "--threads", "2", "--encoder-threads", "2",
                "--dram-capacity", capacity]
        if data_channel:
            args += ["--data-listen", "127.0.0.1:0"]
        self.proc = subprocess.Popen(args + list(extra), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.port = None
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "listening on" in line:
                self.port = int(line.strip().rsplit(":", 1)[1])
                break
        if self.port is None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("server did not start: " + self.proc.stderr.read())
        self.addr = "127.0.0.1:%d" % self.port
        self.stderr_lines = []
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()
        self._t2 = threading.Thread(target=self._drain_out, daemon=True)
        self._t2.start()

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _drain_out(self):
        for _ in self.proc.stdout:
            pass

    def kill(self):
        """SIGKILL: the server vanishes mid-whatever."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._t.join(timeout=5)
        self._t2.join(timeout=5)
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


def rng(offset=0):
    return np.random.default_rng(SEED + offset)


def rand_hashes(r, n, length=32):
    return [r.integers(0, 256, length, dtype=np.uint8).tobytes() for _ in range(n)]
