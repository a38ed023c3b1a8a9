#!/usr/bin/python3
"""An independent reader of a tqkv disk-tier directory, written from proto/DISK_FORMAT.md
only (no tqkv code, no header): it parses the superblock, every segment header and every
record, and checks every CRC the document defines.

Usage: disk_format_reader.py DIR [--json]
Exit 0 when the superblock, every segment header and every record check; 1 otherwise,
naming the first failure of each kind. A clean shutdown leaves no torn tail, so every
block of a segment after its header belongs to a record.

Used by tests/interop/test_disk_tier.py (test_format_document_reader) on a directory
written by a real tqkv-server.
"""
import json
import os
import re
import struct
import sys

ALIGN = 4096


def _table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_T = _table()


def crc32c(data, crc=0):
    """CRC32C (Castagnoli, reflected 0x82F63B78, init and final xor 0xFFFFFFFF)."""
    c = crc ^ 0xFFFFFFFF
    t = _T
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283  # the check value DISK_FORMAT.md gives


def align64(n):
    return (n + 63) & ~63


def align4096(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def read_super(path):
    b = open(path, "rb").read()
    if len(b) < 64:
        return None, "superblock shorter than 64 bytes"
    magic, version, header_bytes, align, flags, seg_bytes, store_id, created = struct.unpack_from(
        "<IHHIIQQQ", b, 0)
    (crc,) = struct.unpack_from("<I", b, 60)
    if magic != 0x444B5154:
        return None, "superblock magic %#x" % magic
    if crc != crc32c(b[0:60]):
        return None, "superblock crc %#x != %#x" % (crc, crc32c(b[0:60]))
    if version != 1 or header_bytes != 64 or align != ALIGN or seg_bytes % align:
        return None, "superblock fields: version %d header %d align %d segment_bytes %d" % (
            version, header_bytes, align, seg_bytes)
    return {"store_id": store_id, "segment_bytes": seg_bytes}, None


def read_segment(path, seg_id, store_id, out):
    b = open(path, "rb").read()
    if len(b) < 64:
        return "segment %s shorter than its header" % path
    magic, version, header_bytes, sid, align, st_id, created = struct.unpack_from("<IHHIIQQ", b, 0)
    (crc,) = struct.unpack_from("<I", b, 60)
    if magic != 0x534B5154 or version != 1 or header_bytes != 64 or align != ALIGN:
        return "segment %s header fields" % path
    if crc != crc32c(b[0:60]):
        return "segment %s header crc" % path
    if sid != seg_id or st_id != store_id:
        return "segment %s: seg_id %d / store_id %#x do not match" % (path, sid, st_id)
    off = ALIGN
    while off < len(b):
        if len(b) - off < 64:
            return "segment %s: %d trailing bytes at %d" % (path, len(b) - off, off)
        (magic, version, flags, seq, layer, page_len, ns_len, hash_len, parent_len, page_crc,
         bf16_bytes, record_bytes, rec_seg, hcrc) = struct.unpack_from(
             "<IHHQIIHBBIQII12xI", b, off)
        if magic != 0x524B5154 or version != 1:
            return "segment %s offset %d: record magic %#x version %d" % (path, off, magic, version)
        k = ns_len + hash_len + parent_len
        key = b[off + 64:off + 64 + k]
        # header_crc: the 64 header bytes with bytes [60, 64) zero, then the key bytes.
        want = crc32c(key, crc32c(b[off:off + 60] + b"\0\0\0\0"))
        if hcrc != want:
            out["header_crc_bad"] += 1
            return "segment %s offset %d: header_crc %#x, document's rule gives %#x" % (
                path, off, hcrc, want)
        if rec_seg != seg_id:
            return "segment %s offset %d: record says segment %d" % (path, off, rec_seg)
        po = align64(64 + k)
        if record_bytes != align4096(po + page_len) or off + record_bytes > len(b):
            return "segment %s offset %d: record_bytes %d" % (path, off, record_bytes)
        tomb = flags & 1
        if flags & ~1:
            return "segment %s offset %d: flags %#x" % (path, off, flags)
        page = b[off + po:off + po + page_len]
        if tomb:
            if page_len != 0 or page_crc != 0:
                return "segment %s offset %d: tombstone with a page" % (path, off)
            out["tombstones"] += 1
        else:
            if hash_len < 1 or hash_len > 64 or parent_len > 64 or ns_len > 1024:
                return "segment %s offset %d: key lengths" % (path, off)
            if crc32c(page) != page_crc:
                return "segment %s offset %d: page_crc32c" % (path, off)
            out["records"] += 1
            out["page_bytes"] += page_len
            out["keys"].append((key[:ns_len].decode("utf-8", "replace"),
                                key[ns_len:ns_len + hash_len].hex(), layer, seq, page_crc))
        if any(b[off + po + page_len:off + record_bytes]):
            return "segment %s offset %d: padding not zero" % (path, off)
        off += record_bytes
    return None


def read_dir(d):
    out = {"segments": 0, "records": 0, "tombstones": 0, "page_bytes": 0, "header_crc_bad": 0,
           "keys": [], "errors": []}
    sb, err = read_super(os.path.join(d, "tqkv-disk.super"))
    if err:
        out["errors"].append(err)
        return out
    for name in sorted(os.listdir(d)):
        m = re.fullmatch(r"seg-(\d{10})\.tqd", name)
        if not m:
            continue
        out["segments"] += 1
        err = read_segment(os.path.join(d, name), int(m.group(1)), sb["store_id"], out)
        if err:
            out["errors"].append(err)
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = read_dir(sys.argv[1])
    if "--json" in sys.argv[2:]:
        print(json.dumps(out))
    else:
        print("%d segments, %d records (%d page bytes), %d tombstones, %d errors" % (
            out["segments"], out["records"], out["page_bytes"], out["tombstones"],
            len(out["errors"])))
        for e in out["errors"]:
            print("  " + e)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
