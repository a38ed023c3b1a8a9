#!/usr/bin/python3
"""The tqkv Python package follows a changing cluster (live membership, docs/cluster.md):
real tqkv-servers on loopback, found through a real DNS server (dnsmasq, SRV records
_grpc._tcp.svc.test, one per server port), one long-lived tqkv.Client on "svc.test:1".

- it lists the servers by their node ids (--node-id);
- a server added to the SRV set is seen; blocks whose primary it now is are found one
  rank lower and read-repaired to it (a client of that server alone then has them);
- a server stopped (SIGTERM) and removed is dropped; what it alone held is missing,
  nothing found is wrong: every page found is byte-identical to the page read before.
Waits are bounded by events (the client's target table), not by sleeps.
"""
import os
import shutil
import sys
import tempfile
import time
import unittest

import tqkv
from tqkv_testutil import Server, rand_hashes, rng
from tqkv_dns import Dnsmasq, have_dnsmasq  # tests/support, on the path by tqkv_testutil

T, H, D, N, L = 16, 2, 64, 48, 2
R = rng(7)


def wait_for(pred, timeout=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@unittest.skipUnless(have_dnsmasq(), "dnsmasq not installed")
class Membership(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.dns = Dnsmasq(self.tmp, "127.0.0.1 h.test\n")
        self.srv = {}

    def tearDown(self):
        for s in self.srv.values():
            s.stop()
        self.dns.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, name):
        self.srv[name] = Server("--node-id", name, data_channel=False, capacity="64M")

    def publish(self):
        self.dns.start([("_grpc._tcp.svc.test", "h.test", s.port) for s in self.srv.values()])

    def follows(self, c):
        want = {(n, s.port) for n, s in self.srv.items()}
        got = {(n, int(t.rsplit(":", 1)[1])) for n, t in zip(c.node_ids, c.targets) if n}
        return len(c.targets) == len(want) and got == want

    def test_follows_add_and_remove(self):
        self.start("tqkv-a")
        self.start("tqkv-b")
        self.publish()
        c = tqkv.Client("svc.test:1", resolve_targets=True, transport="grpc",
                        dns_servers="127.0.0.1:%d" % self.dns.port, resolve_interval_ms=200)
        try:
            self.assertIsNotNone(wait_for(lambda: self.follows(c)),
                                 "did not list the 2 servers: %s %s" % (c.targets, c.node_ids))
            hs = rand_hashes(R, N)
            k = tqkv.bf16_from_float32(R.standard_normal((L, N, T, H, D)))
            v = tqkv.bf16_from_float32(R.standard_normal((L, N, T, H, D)))
            self.assertEqual(c.put("m", hs, k, v, num_layers=L)["blocks_stored"], N * L)
            ref = c.get_pages("m", hs, 0, L)
            self.assertEqual(len(ref), N * L)

            # Added: the third server is seen, blocks it now owns are repaired to it.
            self.start("tqkv-c")
            self.publish()
            self.assertIsNotNone(wait_for(lambda: self.follows(c)),
                                 "did not see tqkv-c: %s %s" % (c.targets, c.node_ids))
            got = c.get_pages("m", hs, 0, L)
            self.assertEqual(got, ref, "pages after the scale-out differ or are missing")
            self.assertTrue(c.repair_wait(20000), "read repair did not drain")
            rs = c.repair_stats()
            with tqkv.Client(self.srv["tqkv-c"].addr, transport="grpc") as only_c:
                on_c = only_c.get_pages("m", hs, 0, L)
            print("scale-out 2 -> 3: %d pages below their primaries, %d repaired, %d now on "
                  "tqkv-c" % (rs["queued"], rs["stored"], len(on_c)), file=sys.stderr)
            self.assertGreater(rs["stored"], 0, "nothing was read-repaired to tqkv-c: %s" % rs)
            self.assertEqual(len(on_c), rs["stored"])
            for key, page in on_c.items():
                self.assertEqual(page, ref[key], "a repaired page differs")

            # Removed: tqkv-a stops and leaves the set; nothing found is wrong.
            self.srv.pop("tqkv-a").stop()
            self.publish()
            self.assertIsNotNone(wait_for(lambda: self.follows(c)),
                                 "did not drop tqkv-a: %s %s" % (c.targets, c.node_ids))
            after = c.get_pages("m", hs, 0, L)
            for key, page in after.items():
                self.assertEqual(page, ref[key], "a page differs after the scale-in")
            print("scale-in 3 -> 2: %d of %d pages still found, 0 wrong" %
                  (len(after), N * L), file=sys.stderr)
            self.assertGreater(len(after), 0)
        finally:
            c.close()

    def test_bad_dns_servers_is_a_clear_error(self):
        with self.assertRaises(tqkv.Error) as e:
            tqkv.Client("svc.test:1", resolve_targets=True, dns_servers="not an address")
        self.assertIn("dns", str(e.exception).lower())


if __name__ == "__main__":
    unittest.main(verbosity=2)
