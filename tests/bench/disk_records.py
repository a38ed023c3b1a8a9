#!/usr/bin/python3
"""Where tqkv-disk-get-bench's blocks lie in a disk-tier directory, and fio replay logs
that read the same records in the order the bench's clients Get them.

Usage: disk_records.py DIR COUNT CLIENTS PASSES OUT_PREFIX

Reads the record headers of DIR's segments (the layout of proto/DISK_FORMAT.md: a
64-byte header, then namespace, hash and parent; record_bytes at header offset 44,
4096-aligned) and finds block i of tqkv-disk-get-bench (hash "tqkv-dgb" + i, 64-bit
little-endian; the last record of a key wins, as in the server's scan). Client c of
CLIENTS reads blocks [c*COUNT/CLIENTS, (c+1)*COUNT/CLIENTS) in order, PASSES times: its
fio log OUT_PREFIX.c.log (fio "version 2" iolog) reads each block's whole record
(offset, record_bytes: what the server reads for a disk Get) in that order.
Prints "records=N record_bytes_per_pass=B page_bytes_per_pass=P".
Exit 1 when a block is missing.
"""
import os
import re
import struct
import sys

HDR = struct.Struct("<IHHQIIHBBIQII12xI")


def scan(d):
    found = {}
    for name in sorted(os.listdir(d)):
        m = re.fullmatch(r"seg-(\d{10})\.tqd", name)
        if not m:
            continue
        path = os.path.join(d, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            off = 4096
            while off + 64 <= size:
                f.seek(off)
                b = f.read(4096)
                if len(b) < 64:
                    break
                (magic, _v, flags, seq, layer, page_len, ns_len, hash_len, _pl, _pc, _bf,
                 rec_bytes, _seg, _hc) = HDR.unpack_from(b, 0)
                if magic != 0x524B5154 or rec_bytes == 0 or rec_bytes % 4096:
                    break  # the tail of the active segment
                key = b[64 + ns_len:64 + ns_len + hash_len]
                if key[:8] == b"tqkv-dgb" and hash_len == 16 and layer == 0:
                    i = struct.unpack_from("<Q", key, 8)[0]
                    if flags & 1:
                        found.pop(i, None)
                    else:
                        found[i] = (path, off, rec_bytes, page_len)
                off += rec_bytes
    return found


def main():
    if len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    d, count, clients, passes, prefix = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                         int(sys.argv[4]), sys.argv[5])
    found = scan(d)
    missing = [i for i in range(count) if i not in found]
    if missing:
        print("disk_records: %d of %d blocks not on disk (first %d)" % (
            len(missing), count, missing[0]), file=sys.stderr)
        return 1
    for c in range(clients):
        lo, hi = count * c // clients, count * (c + 1) // clients
        files = sorted({found[i][0] for i in range(lo, hi)})
        with open("%s.%d.log" % (prefix, c), "w") as f:
            f.write("fio version 2 iolog\n")
            for p in files:
                f.write("%s add\n" % p)
            for p in files:
                f.write("%s open\n" % p)
            for _ in range(passes):
                for i in range(lo, hi):
                    p, off, rb, _ = found[i]
                    f.write("%s read %d %d\n" % (p, off, rb))
            for p in files:
                f.write("%s close\n" % p)
    rb = sum(found[i][2] for i in range(count))
    pb = sum(found[i][3] for i in range(count))
    print("records=%d record_bytes_per_pass=%d page_bytes_per_pass=%d" % (count, rb, pb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
