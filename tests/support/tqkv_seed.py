"""tqkv_seed.py - the test seed of a Python test, as tests/check_main.h picks it for C.

TQKV_TEST_SEED=N replays a run, TQKV_TEST_SEED=random draws a fresh seed (time and pid),
unset: the fixed default, so CI runs see the same inputs every time. test_seed() returns
it (printing TQKV_TEST_SEED=N to stderr once); a malformed value exits 2.
"""

import os
import sys
import time

DEFAULT_SEED = 20261201  # the same as TQKV_TEST_DEFAULT_SEED in tests/check_main.h

_seed = None


def test_seed():
    """The seed of this run (printed once)."""
    global _seed
    if _seed is None:
        env = os.environ.get("TQKV_TEST_SEED", "")
        if not env:
            _seed = DEFAULT_SEED
        elif env == "random":
            _seed = (time.time_ns() ^ (os.getpid() << 32)) & 0xFFFFFFFFFFFFFFFF
        else:
            try:
                _seed = int(env, 0)
            except ValueError:
                print('TQKV_TEST_SEED=%s: not a number or "random"' % env, file=sys.stderr)
                sys.exit(2)
        print("TQKV_TEST_SEED=%d" % _seed, file=sys.stderr, flush=True)
    return _seed
