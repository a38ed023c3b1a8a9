/* disk_format.h - the disk tier's files, byte by byte: superblock, segment header, record.
 *
 * proto/DISK_FORMAT.md is the prose version of this file; where they disagree, this file
 * and its _Static_asserts win. All integers little-endian. Every CRC is CRC32C
 * (Castagnoli, tqkv_crc32c: reflected 0x82F63B78, init and final xor 0xFFFFFFFF).
 *
 *   DIR/tqkv-disk.super       one 4096-byte block: tqkv_disk_super_t, then zeros
 *   DIR/seg-NNNNNNNNNN.tqd    append-only segment NNNNNNNNNN (decimal, 10 digits):
 *     [0, 4096)               tqkv_disk_seg_header_t, then zeros
 *     [4096, ...)             records, each starting at a multiple of TQKV_DISK_ALIGN:
 *       [0, 64)               tqkv_disk_rec_t
 *       [64, 64 + k)          key bytes: namespace, hash, parent hash (k = ns + hash + parent)
 *       [align64(64 + k), +page_len)   the page (opaque bytes; tqkv pages carry their own CRC)
 *       zeros up to record_bytes (a multiple of TQKV_DISK_ALIGN)
 *
 * A record is valid only when its magic, version, header CRC (header with the crc field
 * read as zero, followed by the key bytes), segment id, sizes and page CRC all check:
 * anything else (a torn tail, a flipped byte) is skipped and counted, never served.
 */
#ifndef TQKV_CACHE_DISK_FORMAT_H
#define TQKV_CACHE_DISK_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#define TQKV_DISK_VERSION 1u
#define TQKV_DISK_ALIGN 4096u             /* records start and end on this boundary (O_DIRECT) */
#define TQKV_DISK_SUPER_MAGIC 0x444B5154u /* bytes "TQKD" */
#define TQKV_DISK_SEG_MAGIC 0x534B5154u   /* bytes "TQKS" */
#define TQKV_DISK_REC_MAGIC 0x524B5154u   /* bytes "TQKR" */
#define TQKV_DISK_SUPER_NAME "tqkv-disk.super"
#define TQKV_DISK_SEG_FMT "seg-%010u.tqd"
#define TQKV_DISK_REC_HEADER 64u
#define TQKV_DISK_MAX_KEY (1024u + 64u + 64u) /* namespace + hash + parent hash */

/* Record flags. */
#define TQKV_DISK_REC_TOMBSTONE 0x0001u /* a delete: no page; see layer and hash_len */
/* A tombstone with this layer deletes every layer of (namespace, hash); with hash_len 0,
 * the whole namespace. Tombstones delete records of a lower seq only. */
#define TQKV_DISK_ALL_LAYERS 0xFFFFFFFFu

/* Superblock (first 64 bytes of tqkv-disk.super). */
typedef struct tqkv_disk_super {
    uint32_t magic;         /* 0: TQKV_DISK_SUPER_MAGIC */
    uint16_t version;       /* 4: TQKV_DISK_VERSION (another version: refused) */
    uint16_t header_bytes;  /* 6: 64 */
    uint32_t align;         /* 8: TQKV_DISK_ALIGN */
    uint32_t flags;         /* 12: zero */
    uint64_t segment_bytes; /* 16: largest segment file, a multiple of align */
    uint64_t store_id;      /* 24: random, repeated in every segment header */
    uint64_t created_ns;    /* 32: CLOCK_REALTIME at creation */
    uint8_t reserved[20];   /* 40: zero */
    uint32_t crc32c;        /* 60: CRC32C of bytes [0, 60) */
} tqkv_disk_super_t;

/* Segment header (first 64 bytes of a segment file). */
typedef struct tqkv_disk_seg_header {
    uint32_t magic;        /* 0: TQKV_DISK_SEG_MAGIC */
    uint16_t version;      /* 4: TQKV_DISK_VERSION */
    uint16_t header_bytes; /* 6: 64 */
    uint32_t seg_id;       /* 8: the number in the file name */
    uint32_t align;        /* 12: TQKV_DISK_ALIGN */
    uint64_t store_id;     /* 16: the superblock's store_id */
    uint64_t created_ns;   /* 24: CLOCK_REALTIME when the segment was started */
    uint8_t reserved[28];  /* 32: zero */
    uint32_t crc32c;       /* 60: CRC32C of bytes [0, 60) */
} tqkv_disk_seg_header_t;

/* Record header. */
typedef struct tqkv_disk_rec {
    uint32_t magic;        /* 0: TQKV_DISK_REC_MAGIC */
    uint16_t version;      /* 4: TQKV_DISK_VERSION */
    uint16_t flags;        /* 6: TQKV_DISK_REC_* */
    uint64_t seq;          /* 8: store-wide write sequence (a copy made by the compactor
                              keeps the original's); a higher seq wins */
    uint32_t layer;        /* 16: layer, or TQKV_DISK_ALL_LAYERS in a block tombstone */
    uint32_t page_len;     /* 20: page bytes (0 for a tombstone) */
    uint16_t ns_len;       /* 24: namespace bytes, 0..1024 */
    uint8_t hash_len;      /* 26: 1..64 (0: namespace tombstone) */
    uint8_t parent_len;    /* 27: 0..64 */
    uint32_t page_crc32c;  /* 28: CRC32C of the page bytes (0 when page_len is 0) */
    uint64_t bf16_bytes;   /* 32: BF16 bytes the page stands for (statistics) */
    uint32_t record_bytes; /* 40: whole record, a multiple of TQKV_DISK_ALIGN */
    uint32_t seg_id;       /* 44: the segment the record was written to */
    uint8_t reserved[12];  /* 48: zero */
    uint32_t header_crc;   /* 60: CRC32C of the 64 header bytes with this field zero,
                              continued over the key bytes */
} tqkv_disk_rec_t;

_Static_assert(sizeof(tqkv_disk_super_t) == 64, "superblock is 64 bytes");
_Static_assert(offsetof(tqkv_disk_super_t, segment_bytes) == 16, "super layout");
_Static_assert(offsetof(tqkv_disk_super_t, store_id) == 24, "super layout");
_Static_assert(offsetof(tqkv_disk_super_t, crc32c) == 60, "super layout");
_Static_assert(sizeof(tqkv_disk_seg_header_t) == 64, "segment header is 64 bytes");
_Static_assert(offsetof(tqkv_disk_seg_header_t, store_id) == 16, "segment layout");
_Static_assert(offsetof(tqkv_disk_seg_header_t, crc32c) == 60, "segment layout");
_Static_assert(sizeof(tqkv_disk_rec_t) == TQKV_DISK_REC_HEADER, "record header is 64 bytes");
_Static_assert(offsetof(tqkv_disk_rec_t, seq) == 8, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, layer) == 16, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, page_len) == 20, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, ns_len) == 24, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, hash_len) == 26, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, parent_len) == 27, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, page_crc32c) == 28, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, bf16_bytes) == 32, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, record_bytes) == 40, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, seg_id) == 44, "record layout");
_Static_assert(offsetof(tqkv_disk_rec_t, header_crc) == 60, "record layout");
_Static_assert(TQKV_DISK_ALIGN % 512 == 0, "records align to sectors (O_DIRECT)");

/* Offset of the page within a record with k key bytes. */
static inline uint32_t
tqkv_disk_page_offset(uint32_t key_bytes)
{
    return (TQKV_DISK_REC_HEADER + key_bytes + 63u) & ~63u;
}

/* Whole record size for k key bytes and a page of len bytes. */
static inline uint64_t
tqkv_disk_record_bytes(uint32_t key_bytes, uint64_t len)
{
    uint64_t n = tqkv_disk_page_offset(key_bytes) + len;
    return (n + TQKV_DISK_ALIGN - 1) / TQKV_DISK_ALIGN * TQKV_DISK_ALIGN;
}

#endif
