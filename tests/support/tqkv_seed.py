"""tqkv_seed.py - the test seed of a Python test, as tests/check_main.h picks it for C.

TQKV_TEST_SEED=N replays a run, TQKV_TEST_SEED=random draws a fresh seed (time and pid),
unset: the fixed default, so CI runs see the same inputs every time. test_seed() returns
it (printing TQKV_TEST_SEED=N to stderr once); a malformed value exits 2.
"""

import os
import re
import sys
import time

_CHECK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "check_main.h")


def _default_seed():
    """TQKV_TEST_DEFAULT_SEED, read from tests/check_main.h (its one place)."""
    with open(_CHECK_MAIN) as f:
        m = re.search(r"^#define TQKV_TEST_DEFAULT_SEED (\d+)u$", f.read(), re.M)
    if not m:
        print("%s: no TQKV_TEST_DEFAULT_SEED line" % _CHECK_MAIN, file=sys.stderr)
        sys.exit(2)
    return int(m.group(1))


_seed = None


def test_seed():
    """The seed of this run (printed once)."""
    global _seed
    if _seed is None:
        env = os.environ.get("TQKV_TEST_SEED", "")
        if not env:
            _seed = _default_seed()
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
