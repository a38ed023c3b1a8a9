#!/usr/bin/python3
"""The disk tier (--disk-path) against real tqkv-server processes, from Python grpcio.

Usage: test_disk_tier.py TQKV_SERVER_BINARY PROTO_DIR [unittest args]
Environment: TQKV_DISK_KILL_ROUNDS (default 3): kill -9 rounds per crash test;
             TQKV_TEST_DIR (default /tmp): where the disk directories go.

Reference pages come from a separate server without a disk tier (BF16 Put, PACKED Get),
so every comparison is against bytes the disk tier never touched.

- Small DRAM + disk: Put more than DRAM holds; every page comes back byte-identical over
  gRPC and over the TCP data channel, some from TIER_DISK; Lookup reports TIER_DISK;
  Stats and /metrics count the disk tier.
- Restart on the same directory: Lookup and Get still served, byte-identical.
- kill -9 during a mixed load (Puts, Gets checked on the fly, Deletes; DRAM evictions
  demoting to disk), --disk-sync batch, restart: every page served is byte-identical.
- --disk-sync always: kill -9 during Puts, N rounds: every acknowledged Put is served.
- --ns-quota: records dropped for the quota stay dropped after a restart (tombstones).
- A Lookup lease holds disk-only pages through disk capacity eviction.
- A slow disk (the test-only read gate) slows only the Get that reads it, over gRPC and
  the data channel; other calls' DRAM Gets go on (one RPC thread).
- Default eviction: Gets of 8 large pages read each disk record once (<= 1.05x).
- proto/DISK_FORMAT.md: an independent reader (disk_format_reader.py) checks every CRC of
  the segments a real server wrote, and finds the pages Put under their keys.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_data_channel as dc  # noqa: E402  (Server, DataChannel, stubs)
import disk_format_reader as fmt  # noqa: E402  (independent reader of DISK_FORMAT.md)

READER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_format_reader.py")

ROUNDS = int(os.environ.get("TQKV_DISK_KILL_ROUNDS", "3"))
T, H, D = 16, 4, 128
NREF = 48
REF = []  # reference pages (bytes), PACKED Gets from a server without a disk tier


def make_refs():
    srv = dc.Server()
    try:
        hs = [dc.rand_hash() for _ in range(NREF)]
        srv.stub.Put(iter([dc.put_req("ref", h, 0, T, H, D) for h in hs]), timeout=60)
        got = list(srv.stub.Get(dc.pb.GetRequest(namespace="ref", hashes=hs, layer_begin=0,
                                                 layer_end=1), timeout=60))
        assert all(g.found for g in got)
        REF.extend(g.page for g in got)
    finally:
        srv.stop()


def page_put(ns, h, layer, ref):
    return dc.pb.PutRequest(namespace=ns, hash=h, layer=layer, num_tokens=T, num_kv_heads=H,
                            head_dim=D, page=REF[ref], num_layers=2)


def ref_of(h):
    return h[0] % NREF


def disk_server(path, *extra, dram="1M", metrics=False, disk="512M"):
    args = ["--dram-capacity", dram, "--disk-path", path, "--disk-capacity", disk, *extra]
    if metrics:
        args += ["--metrics-listen", "127.0.0.1:0"]
    srv = dc.Server(*args)
    srv.metrics_port = None
    if metrics:
        line = srv.proc.stdout.readline()
        if "metrics on port" in line:
            srv.metrics_port = int(line.split()[-1])
    return srv


def disk_log(srv, timeout=10):
    """The server's stderr once its disk start-up line is in."""
    end = time.time() + timeout
    while time.time() < end:
        log = "".join(srv.stderr_lines)
        if "records skipped" in log:
            return log
        time.sleep(0.05)
    return "".join(srv.stderr_lines)


def grpc_pages(stub, ns, hashes, layers):
    got = list(stub.Get(dc.pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0,
                                         layer_end=layers), timeout=120))
    return got


class DiskTierTest(unittest.TestCase):
    def setUp(self):
        base = os.environ.get("TQKV_TEST_DIR", "/tmp")
        self.dir = tempfile.mkdtemp(prefix="tqkv-disk-it-", dir=base)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def check_all(self, stub, ns, hashes, layers=2, want_disk=True):
        got = grpc_pages(stub, ns, hashes, layers)
        self.assertEqual(len(got), len(hashes) * layers)
        tiers = set()
        for g in got:
            self.assertTrue(g.found, "layer %d of a hash missing" % g.layer)
            self.assertEqual(g.page, REF[ref_of(g.hash)], "wrong bytes")
            tiers.add(g.tier)
        if want_disk:
            self.assertIn(dc.pb.TIER_DISK, tiers)
        return tiers

    def test_tiering_restart_and_data_channel(self):
        ns = "disk-it"
        hashes = [dc.rand_hash() for _ in range(300)]  # 600 pages, ~7 MB; DRAM 1 MB
        srv = disk_server(self.dir, "--data-listen", "127.0.0.1:0", metrics=False)
        try:
            for i in range(0, len(hashes), 20):
                reqs = [page_put(ns, h, l, ref_of(h)) for h in hashes[i:i + 20] for l in (0, 1)]
                r = srv.stub.Put(iter(reqs), timeout=60)
                self.assertEqual(r.blocks_stored, len(reqs))
            st = srv.stub.Stats(dc.pb.StatsRequest(), timeout=10)
            disk = [t for t in st.tiers if t.tier == dc.pb.TIER_DISK]
            self.assertEqual(len(disk), 1, "no disk tier in Stats: %s" % st)
            self.assertEqual(disk[0].pages, 600)
            self.assertEqual(disk[0].capacity_bytes, 512 << 20)
            dram = [t for t in st.tiers if t.tier == dc.pb.TIER_DRAM][0]
            self.assertLessEqual(dram.bytes_used, 1 << 20)
            self.assertGreater(dram.demotions, 0)
            lk = srv.stub.Lookup(dc.pb.LookupRequest(namespace=ns, hashes=hashes, num_layers=2),
                                 timeout=30)
            self.assertEqual(lk.prefix_blocks, len(hashes))
            self.assertIn(dc.pb.TIER_DISK, [b.tier for b in lk.blocks])
            self.check_all(srv.stub, ns, hashes)
            # The TCP data channel: the same bytes, frames with tier 3 for disk pages.
            def disk_tier():
                st = srv.stub.Stats(dc.pb.StatsRequest(), timeout=10)
                return [t for t in st.tiers if t.tier == dc.pb.TIER_DISK][0]
            # (the oldest pages are on disk only, unless the eviction order kept them)
            before = disk_tier()
            ch = dc.DataChannel(srv.stub)
            try:
                cold = hashes[:40]
                frames = ch.get(ns, cold, 0, 2)
                self.assertEqual(len(frames), 80)
                for i, f in enumerate(frames):  # layer-major, index = position
                    self.assertEqual(f.page, REF[ref_of(cold[i % len(cold)])])
            finally:
                ch.close()
            after = disk_tier()
            # Read from disk: served straight from it (TIER_DISK frames) or prefetched in
            # one parallel round and promoted into DRAM first.
            from_disk = sum(f.tier == dc.pb.TIER_DISK for f in frames)
            self.assertEqual(after.hits - before.hits, from_disk)
            self.assertGreater(after.promotions - before.promotions + from_disk, 0)
            st = srv.stub.Stats(dc.pb.StatsRequest(), timeout=10)
            disk = [t for t in st.tiers if t.tier == dc.pb.TIER_DISK][0]
            self.assertGreater(disk.hits, 0)
        finally:
            self.assertEqual(srv.stop(), 0)
        # Restart on the same directory: warm.
        srv = disk_server(self.dir, metrics=True)
        try:
            log = disk_log(srv)
            self.assertIn("600 pages", log)
            lk = srv.stub.Lookup(dc.pb.LookupRequest(namespace=ns, hashes=hashes, num_layers=2),
                                 timeout=30)
            self.assertEqual(lk.prefix_blocks, len(hashes))
            self.assertEqual(set(b.tier for b in lk.blocks), {dc.pb.TIER_DISK})
            st = srv.stub.Stats(dc.pb.StatsRequest(namespace=ns), timeout=10)
            disk = [t for t in st.tiers if t.tier == dc.pb.TIER_DISK][0]
            self.assertEqual(disk.pages, 600)  # the namespace's usage, restored
            self.check_all(srv.stub, ns, hashes)
            if srv.metrics_port:
                text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % srv.metrics_port,
                                              timeout=10).read().decode()
                for fam in ("tqkv_tier_pages", "tqkv_tier_hits_total", "tqkv_tier_reads_total",
                            "tqkv_tier_writes_total", "tqkv_tier_io_errors_total",
                            "tqkv_tier_relocations_total", "tqkv_tier_lease_skips_total",
                            "tqkv_tier_refused_writes_total", "tqkv_tier_quota_drops_total",
                            "tqkv_tier_leases"):
                    self.assertRegex(text, r'\n%s\{tier="disk"\} \d+' % fam)
            self.assertIsNotNone(srv.metrics_port)
        finally:
            self.assertEqual(srv.stop(), 0)

    def ns_disk(self, srv, ns):
        st = srv.stub.Stats(dc.pb.StatsRequest(namespace=ns), timeout=10)
        return [t for t in st.tiers if t.tier == dc.pb.TIER_DISK][0]

    def put_all(self, srv, ns, hashes, step=10):
        for i in range(0, len(hashes), step):
            reqs = [page_put(ns, h, l, ref_of(h)) for h in hashes[i:i + step] for l in (0, 1)]
            r = srv.stub.Put(iter(reqs), timeout=60)
            self.assertEqual(r.blocks_stored + r.blocks_duplicate, len(reqs))

    def test_format_document_reader(self):
        """proto/DISK_FORMAT.md read by an independent reader (disk_format_reader.py,
        written from the document only): every CRC of a segment written by a real server
        checks, and the records hold the pages that were Put under their keys."""
        ns = "fmt-doc"
        hashes = [dc.rand_hash() for _ in range(24)]
        srv = disk_server(self.dir, "--disk-sync", "always")
        try:
            srv.stub.Put(iter([page_put(ns, h, l, ref_of(h)) for h in hashes for l in (0, 1)]),
                         timeout=60)
            srv.stub.Delete(dc.pb.DeleteRequest(namespace=ns, hashes=hashes[:2]), timeout=30)
        finally:
            self.assertEqual(srv.stop(), 0, srv.log_tail())
        out = subprocess.run([sys.executable, READER, self.dir, "--json"], capture_output=True,
                             text=True, timeout=300)
        got = json.loads(out.stdout)
        self.assertEqual(got["errors"], [], "reader following DISK_FORMAT.md: %s" % got["errors"])
        self.assertEqual(out.returncode, 0)
        self.assertGreaterEqual(got["segments"], 1)
        self.assertGreaterEqual(got["tombstones"], 1)
        self.assertEqual(got["records"], 2 * len(hashes))
        crcs = {(k[1], k[2]): k[4] for k in got["keys"] if k[0] == ns}
        for h in hashes:
            for layer in (0, 1):
                self.assertEqual(crcs.get((h.hex(), layer)), fmt.crc32c(REF[ref_of(h)]),
                                 "record of layer %d does not hold the page Put" % layer)

    def test_page_larger_than_disk_record_says_so(self):
        """--disk-capacity 1M: a segment is 256 KiB, so a larger page cannot be written
        through; the refusal names the disk tier's limit, not leases (issue 23)."""
        srv = disk_server(self.dir, "--disk-sync", "always", dram="64M", disk="1M")
        try:
            # 512 tokens x 8 heads x 128: a 2 MiB BF16 block, a page of several 100 KiB
            err = dc.rpc_error(srv.stub.Put, iter([dc.put_req("big", dc.rand_hash(), 0, 512, 8,
                                                              128)]), timeout=60)
            self.assertIsNotNone(err, "a page larger than a disk segment was accepted")
            self.assertEqual(err.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, err.details())
            self.assertIn("larger than the disk tier's largest record", err.details())
            self.assertIn("--disk-capacity", err.details())
            self.assertNotIn("leased", err.details())
            # a page that fits is still stored
            srv.stub.Put(iter([page_put("big", dc.rand_hash(), 0, 0)]), timeout=60)
        finally:
            srv.stop()

    def test_slow_disk_blocks_only_its_own_call(self):
        """A disk read in flight (held by the test-only TQKV_TEST_DISK_READ_GATE hook:
        every record read waits until the gate file exists) makes its own Get wait, and no
        other call: with one RPC thread, DRAM Gets keep completing while the disk Get, over
        gRPC and then over the TCP data channel, is held. Asserted by events (the hook's
        .waiting file, completed Gets, the held Get still running), not by timing."""
        gate = os.path.join(self.dir, "gate")
        env = dict(os.environ, TQKV_TEST_DISK_READ_GATE=gate)
        open(gate, "w").close()  # open while the pages are Put
        srv = dc.Server("--threads", "1", "--dram-capacity", "1M", "--disk-path", self.dir,
                        "--disk-capacity", "512M", "--data-listen", "127.0.0.1:0", env=env)
        try:
            ns = "slow"
            cold = [dc.rand_hash() for _ in range(200)]  # 400 pages, ~5 MB: DRAM is 1 MB
            for i in range(0, len(cold), 50):
                srv.stub.Put(iter([page_put(ns, h, l, ref_of(h)) for h in cold[i:i + 50]
                                   for l in (0, 1)]), timeout=60)
            hot = [dc.rand_hash() for _ in range(4)]
            srv.stub.Put(iter([page_put("hot", h, 0, ref_of(h)) for h in hot]), timeout=60)
            got = grpc_pages(srv.stub, "hot", hot, 1)
            self.assertEqual([g.tier for g in got], [dc.pb.TIER_DRAM] * len(hot))
            lk = srv.stub.Lookup(dc.pb.LookupRequest(namespace=ns, hashes=cold[:40],
                                                     num_layers=1), timeout=30)
            self.assertEqual(set(b.tier for b in lk.blocks), {dc.pb.TIER_DISK})
            ch = dc.DataChannel(srv.stub)
            for name, held in (("gRPC", cold[:20]), ("data channel", cold[20:40])):
                os.unlink(gate)  # every disk read waits from now on
                if os.path.exists(gate + ".waiting"):
                    os.unlink(gate + ".waiting")
                result = {}

                def slow_get():
                    try:
                        if name == "gRPC":
                            result["pages"] = [g.page for g in grpc_pages(srv.stub, ns, held, 1)]
                        else:
                            result["pages"] = [f.page for f in ch.get(ns, held, 0, 1,
                                                                      timeout=120)]
                    except Exception as e:  # noqa: BLE001 (reported below)
                        result["error"] = e
                t = threading.Thread(target=slow_get, daemon=True)
                t.start()
                end = time.time() + 60
                while not os.path.exists(gate + ".waiting") and time.time() < end:
                    time.sleep(0.01)
                self.assertTrue(os.path.exists(gate + ".waiting"),
                                "%s: the held Get never reached a disk read" % name)
                # The disk read is held: DRAM Gets on other calls still complete.
                for _ in range(20):
                    got = grpc_pages(srv.stub, "hot", hot, 1)
                    self.assertEqual([g.page for g in got], [REF[ref_of(h)] for h in hot])
                    self.assertEqual([g.tier for g in got], [dc.pb.TIER_DRAM] * len(hot))
                self.assertTrue(t.is_alive(), "%s: the held Get finished: %r" % (name, result))
                self.assertNotIn("pages", result)
                open(gate, "w").close()  # the disk is back
                t.join(timeout=120)
                self.assertFalse(t.is_alive(), "%s: the Get did not finish" % name)
                self.assertNotIn("error", result, "%s: %r" % (name, result.get("error")))
                self.assertEqual(result["pages"], [REF[ref_of(h)] for h in held])
            ch.close()
            # BF16 Gets read ahead (decode jobs) and meet disk-only blocks mid-window: the
            # same tensors as a second Get of the same blocks, now in DRAM, in order.
            cold2 = cold[60:72]
            def bf16(hs):
                return [(g.hash, g.layer, g.found, g.key, g.value) for g in srv.stub.Get(
                    dc.pb.GetRequest(namespace=ns, hashes=hs, layer_begin=0, layer_end=2,
                                     encoding=dc.pb.ENCODING_BF16), timeout=120)]
            first, again = bf16(cold2), bf16(cold2)
            self.assertEqual(len(first), 2 * len(cold2))
            self.assertTrue(all(f[2] for f in first))
            self.assertEqual([f[0] for f in first], cold2 + cold2)
            self.assertEqual(first, again)
        finally:
            if not os.path.exists(gate):
                open(gate, "w").close()
            self.assertEqual(srv.stop(), 0, srv.log_tail())

    def test_prefetched_pages_are_read_once(self):
        """Default eviction (S3-FIFO): Gets of 8 large pages each (~20% of DRAM) over a
        working set twice the DRAM read each disk-only page once: the disk bytes read are
        <= 1.05x the bytes served of the pages that were on disk only before their Get
        (issue 23: 1.63x, the prefetched pages evicted by the Get's own promotions and
        read again)."""
        srv = disk_server(self.dir, "--data-listen", "127.0.0.1:0", dram="11M", metrics=True)
        try:
            ns = "once"
            hs = [dc.rand_hash() for _ in range(80)]
            for i in range(0, len(hs), 8):
                srv.stub.Put(iter([dc.put_req(ns, h, 0, 256, 8, 128) for h in hs[i:i + 8]]),
                             timeout=120)

            def read_bytes():
                text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % srv.metrics_port,
                                              timeout=10).read().decode()
                m = re.search(r'\ntqkv_tier_read_bytes_total\{tier="disk"\} (\d+)', text)
                return int(m.group(1))
            rng = random.Random(23)
            ch = dc.DataChannel(srv.stub)
            for name in ("gRPC", "data channel"):
                rd, served, pages = 0, 0, 0
                for _ in range(12):
                    want = rng.sample(hs, 8)
                    lk = srv.stub.Lookup(dc.pb.LookupRequest(namespace=ns, hashes=want,
                                                             num_layers=1), timeout=30)
                    cold = [b.tier == dc.pb.TIER_DISK for b in lk.blocks]
                    before = read_bytes()
                    if name == "gRPC":
                        got = [g.page for g in grpc_pages(srv.stub, ns, want, 1)]
                    else:
                        got = [f.page for f in ch.get(ns, want, 0, 1, timeout=120)]
                    rd += read_bytes() - before
                    self.assertEqual(len(got), 8)
                    for page, c in zip(got, cold):
                        self.assertGreater(len(page), 0)
                        if c:
                            served += len(page)
                            pages += 1
                ratio = rd / max(served, 1)
                sys.stderr.write("%s: %d disk-only pages (%d bytes) served, %d bytes read from "
                                 "disk: %.3fx\n" % (name, pages, served, rd, ratio))
                self.assertGreater(pages, 20, "%s: too few disk-only pages" % name)
                self.assertLessEqual(ratio, 1.05, "%s: disk bytes read / bytes served" % name)
            ch.close()
        finally:
            self.assertEqual(srv.stop(), 0)

    def test_quota_drops_stay_gone_after_restart(self):
        """--ns-quota over the disk bytes: the records a Put over the quota drops are
        tombstoned, so a restarted server finds the namespace within its quota and serves
        only what was kept (before, the rebuild brought every dropped record back)."""
        ns, q = "quota-it", 256 << 10
        hashes = [dc.rand_hash() for _ in range(100)]  # 200 pages, ~2.4 MB of records
        srv = disk_server(self.dir, "--ns-quota", str(q), dram="8M")
        try:
            self.put_all(srv, ns, hashes)
            before = self.ns_disk(srv, ns)
            self.assertLessEqual(before.bytes_used, q)
            self.assertLess(before.pages, 100)
        finally:
            self.assertEqual(srv.stop(), 0)
        srv = disk_server(self.dir, "--ns-quota", str(q), dram="8M")
        try:
            after = self.ns_disk(srv, ns)
            self.assertEqual((after.pages, after.bytes_used), (before.pages, before.bytes_used))
            got = grpc_pages(srv.stub, ns, hashes, 2)
            found = [g for g in got if g.found]
            self.assertEqual(len(found), before.pages)
            for g in found:
                self.assertEqual(g.page, REF[ref_of(g.hash)], "wrong bytes")
            self.assertFalse(any(g.found for g in got if g.hash == hashes[0]))
            self.assertTrue(all(g.found for g in got if g.hash == hashes[-1]))
        finally:
            self.assertEqual(srv.stop(), 0)

    def test_lookup_lease_holds_disk_pages(self):
        """A Lookup lease on blocks whose pages are on disk only holds them while the disk
        tier (4 MB) is cycled twice over by later Puts; unleased blocks of their time go."""
        ns = "lease-it"
        hashes = [dc.rand_hash() for _ in range(400)]
        srv = disk_server(self.dir, dram="1M", disk="4M")
        try:
            self.put_all(srv, ns, hashes[:60])  # the first ones leave the 1 MB DRAM
            lk = srv.stub.Lookup(dc.pb.LookupRequest(namespace=ns, hashes=hashes[:10],
                                                     num_layers=2, lease_ms=60000), timeout=30)
            self.assertEqual(lk.prefix_blocks, 10)
            self.assertIn(dc.pb.TIER_DISK, [b.tier for b in lk.blocks])
            self.put_all(srv, ns, hashes[60:])  # ~8 MB of records
            st = srv.stub.Stats(dc.pb.StatsRequest(), timeout=10)
            disk = [t for t in st.tiers if t.tier == dc.pb.TIER_DISK][0]
            self.assertGreater(disk.evictions, 0)
            got = grpc_pages(srv.stub, ns, hashes[:10], 2)
            self.assertEqual(len(got), 20)
            for g in got:
                self.assertTrue(g.found, "a leased page went")
                self.assertEqual(g.page, REF[ref_of(g.hash)], "wrong bytes")
            later = grpc_pages(srv.stub, ns, hashes[10:60], 2)
            self.assertGreater(sum(not g.found for g in later), 0)
            for g in later:
                if g.found:
                    self.assertEqual(g.page, REF[ref_of(g.hash)], "wrong bytes")
        finally:
            self.assertEqual(srv.stop(), 0)

    def kill_rounds(self, sync, rounds):
        """Puts from two threads, kill -9 at a random moment, restart, verify what this
        round sent (and, after the last round, everything). Returns the acknowledged pages
        lost (must be 0 with sync always) and the acknowledged blocks. The disk is large
        enough that nothing is evicted for capacity (which would drop old pages)."""
        ns = "crash"
        acked = []  # hashes whose Put returned OK
        sent_all = []
        deleted = set()  # hashes deleted by the mixed load: present or not, never wrong
        lost_total, torn_total, served_total = 0, 0, 0
        rnd = random.Random(dc.SEED ^ 0x5eed)
        for rnd_i in range(rounds):
            srv = disk_server(self.dir, "--disk-sync", sync, dram="4M", disk="8G")
            stop = threading.Event()
            acked_before = len(acked)
            sent = []  # every hash a Put was started for

            def putter():
                while not stop.is_set():
                    batch = [os.urandom(32) for _ in range(4)]
                    sent.extend(batch)
                    reqs = [page_put(ns, h, l, ref_of(h)) for h in batch for l in (0, 1)]
                    try:
                        r = srv.stub.Put(iter(reqs), timeout=30)
                    except grpc.RpcError:
                        return
                    if r.blocks_stored + r.blocks_duplicate == len(reqs):
                        acked.extend(batch)

            wrong = []

            def reader():
                # Mixed load: Gets of acknowledged pages (from DRAM or disk, being demoted
                # and promoted meanwhile), checked on the fly, and a few Deletes.
                rr = random.Random(len(acked))
                while not stop.is_set():
                    have = acked[-200:]
                    if not have:
                        time.sleep(0.01)
                        continue
                    hs = [rr.choice(have) for _ in range(8)]
                    try:
                        if rr.random() < 0.05:
                            deleted.update(hs[:1])  # before: the kill may cut the reply
                            srv.stub.Delete(dc.pb.DeleteRequest(namespace=ns, hashes=hs[:1]),
                                            timeout=30)
                            continue
                        for g in grpc_pages(srv.stub, ns, hs, 2):
                            if g.found and g.page != REF[ref_of(g.hash)]:
                                wrong.append(g.hash)
                    except grpc.RpcError:
                        return

            th = [threading.Thread(target=putter) for _ in range(2)]
            th.append(threading.Thread(target=reader))
            for t in th:
                t.start()
            time.sleep(rnd.uniform(0.3, 1.2))
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait()
            stop.set()
            for t in th:
                t.join(timeout=30)
            srv.channel.close()
            srv.close()
            self.assertEqual(wrong, [], "wrong bytes served during the load")
            # Restart and verify everything ever sent: served pages byte-identical,
            # acknowledged ones present when the sync mode promises it.
            srv = disk_server(self.dir, "--disk-sync", sync, dram="4M", disk="8G")
            sent_all.extend(sent)
            try:
                log = disk_log(srv)
                m = re.search(r"(\d+) corrupt and (\d+) torn records skipped", log)
                self.assertIsNotNone(m, "no disk start-up line in: %s" % log)
                torn_total += int(m.group(2))
                self.assertEqual(int(m.group(1)), 0, "corrupt records after kill -9")
                last = rnd_i == rounds - 1
                everything = list(dict.fromkeys(sent_all if last else sent))
                ack_set = set(acked if last else acked[acked_before:]) - deleted
                for i in range(0, len(everything), 64):
                    chunk = everything[i:i + 64]
                    for g in grpc_pages(srv.stub, ns, chunk, 2):
                        if g.found:
                            served_total += 1
                            self.assertEqual(g.page, REF[ref_of(g.hash)],
                                             "round %d: wrong bytes after kill -9" % rnd_i)
                        elif g.hash in ack_set:
                            lost_total += 1
                            if sync == "always":
                                print("round %d: acknowledged page lost (layer %d)" % (rnd_i, g.layer),
                                      file=sys.stderr)
            finally:
                self.assertEqual(srv.stop(), 0)
        print("disk-sync %s: %d kill -9 rounds, %d acknowledged blocks, %d pages served, "
              "%d acknowledged pages lost, %d torn records skipped"
              % (sync, rounds, len(set(acked)), served_total, lost_total, torn_total),
              file=sys.stderr)
        return lost_total, len(set(acked))

    def test_kill9_batch_every_page_served_is_right(self):
        lost, acked = self.kill_rounds("batch", ROUNDS)
        self.assertGreater(acked, 0)

    def test_kill9_always_loses_nothing_acknowledged(self):
        lost, acked = self.kill_rounds("always", ROUNDS)
        self.assertGreater(acked, 0)
        self.assertEqual(lost, 0)


if __name__ == "__main__":
    dc.SERVER = os.path.abspath(sys.argv[1])
    dc.PROTO_DIR = os.path.abspath(sys.argv[2])
    dc.gen_stubs()
    try:
        make_refs()
        unittest.main(argv=[sys.argv[0], "-v"] + sys.argv[3:])
    finally:
        shutil.rmtree(dc.TMP, ignore_errors=True)
