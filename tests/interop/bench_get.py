#!/usr/bin/python3
"""Loopback throughput of tqkv-server with the Python grpcio client (a benchmark,
not a test): Put of BF16 blocks, Get of packed pages and of decoded BF16, next to
raw TCP loopback measured in the same run with the same language.

Usage: bench_get.py TQKV_SERVER_BINARY PROTO_DIR [--tokens 256 --heads 8 --dim 128
       --hashes 16 --layers 4 --reps 5 --server-args "..."]
"""
import argparse
import os
import shlex
import socket
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_server as ts  # noqa: E402  (reuses the stub generation and Server helper)


def raw_tcp(total_bytes, chunk=1 << 20):
    """Bytes/s of one Python TCP connection over loopback (sender thread, receiver here)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    buf = b"\0" * chunk

    def sender():
        c = socket.create_connection(("127.0.0.1", port))
        sent = 0
        while sent < total_bytes:
            c.sendall(buf)
            sent += chunk
        c.close()

    t = threading.Thread(target=sender)
    t.start()
    conn, _ = srv.accept()
    rbuf = bytearray(chunk)
    got = 0
    t0 = time.perf_counter()
    while True:
        n = conn.recv_into(rbuf)
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    t.join()
    conn.close()
    srv.close()
    return got / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("proto")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hashes", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--server-args", default="")
    a = ap.parse_args()
    ts.SERVER = os.path.abspath(a.server)
    ts.PROTO_DIR = os.path.abspath(a.proto)
    ts.gen_stubs()
    pb = ts.pb
    srv = ts.Server(*shlex.split(a.server_args), "--dram-capacity", "4G")
    try:
        T, H, D = a.tokens, a.heads, a.dim
        ns = "bench"
        hashes = [ts.rand_hash() for _ in range(a.hashes)]
        k, v = ts.rand_block(T, H, D)
        reqs = [ts.put_req(ns, h, l, T, H, D, k, v, num_layers=a.layers)
                for l in range(a.layers) for h in hashes]
        bf16_in = sum(len(r.key) + len(r.value) for r in reqs)
        t0 = time.perf_counter()
        r = srv.stub.Put(iter(reqs), timeout=600)
        put_s = time.perf_counter() - t0
        rows = [("Put BF16 (encode on server)", bf16_in / put_s, bf16_in / put_s,
                 r.bytes_stored / max(1, r.blocks_stored))]
        for enc, name in ((pb.ENCODING_PACKED, "Get packed pages"),
                          (pb.ENCODING_BF16, "Get BF16 (decode on server)")):
            wire = 0
            equiv = 0
            t0 = time.perf_counter()
            for _ in range(a.reps):
                for g in srv.stub.Get(pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0,
                                                    layer_end=a.layers, encoding=enc),
                                      timeout=600):
                    assert g.found
                    wire += len(g.page) + len(g.key) + len(g.value)
                    equiv += 2 * g.num_tokens * g.num_kv_heads * g.head_dim * 2
            dt = time.perf_counter() - t0
            rows.append((name, wire / dt, equiv / dt, wire / (a.reps * len(reqs))))
        # The same packed Get without protobuf parsing in Python (bytes as received).
        raw = srv.channel.unary_stream("/tqkv.v1.KVCache/Get", **ts.IDENT)
        req = pb.GetRequest(namespace=ns, hashes=hashes, layer_begin=0,
                            layer_end=a.layers).SerializeToString()
        wire = 0
        t0 = time.perf_counter()
        for _ in range(a.reps):
            for m in raw(req, timeout=600):
                wire += len(m)
        dt = time.perf_counter() - t0
        ratio = rows[1][2] / rows[1][1]
        rows.append(("Get packed, unparsed", wire / dt, wire / dt * ratio, wire / (a.reps * len(reqs))))
        tcp = raw_tcp(256 << 20)
        rows.append(("raw TCP loopback (Python)", tcp, tcp, 1 << 20))
        print("shape [%d][%d][%d], %d blocks, %d reps; server %s" %
              (T, H, D, len(reqs), a.reps, a.server_args or "(defaults)"))
        print("%-30s %14s %18s %14s" % ("operation", "wire MB/s", "BF16-equiv MB/s",
                                          "bytes/msg"))
        for name, w, e, m in rows:
            print("%-30s %14.0f %18.0f %14.0f" % (name, w / 1e6, e / 1e6, m))
        for i in (1, 3):
            print("%s / raw TCP: %.0f%% of wire bytes/s, BF16-equivalent %.1fx raw TCP" %
                  (rows[i][0], 100 * rows[i][1] / tcp, rows[i][2] / tcp))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
