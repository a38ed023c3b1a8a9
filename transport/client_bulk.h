/* client_bulk.h - array-at-a-time Put and Get of libtqkv, for inference engines and
 * language bindings (the Python package calls these: one call per batch, not per page).
 *
 * Blocks are addressed as a grid: num_hashes block hashes (one sequence, in order) by
 * layers [layer_begin, layer_end). Entry (layer, i) of every array below is at index
 * (layer - layer_begin) * num_hashes + i. K and V of a block are BF16 [T][H][D], each
 * T * H * D * 2 bytes, anywhere in memory (a paged KV cache's blocks, one tensor's rows).
 *
 * Installed as <tqkv/client_bulk.h>; it includes client.h from its own directory.
 */
#ifndef TQKV_TRANSPORT_CLIENT_BULK_H
#define TQKV_TRANSPORT_CLIENT_BULK_H

#include "client.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A grid of BF16 blocks to Put. */
typedef struct tqkv_put_many_req {
    const char *ns;
    const tqkv_hash_t *hashes;
    size_t num_hashes;
    const tqkv_hash_t *parent; /* parent of hashes[0] (NULL: a sequence's first block);
                                  hashes[i - 1] is the parent of hashes[i] */
    uint32_t layer_begin, layer_end;
    uint32_t num_layers; /* the model's layers (boundary policy); 0 = unknown */
    tqkv_block_shape_t shape;
    const void *const *keys;   /* [(layer - layer_begin) * num_hashes + i] */
    const void *const *values; /* same indexing */
} tqkv_put_many_req_t;

/* Puts every block of req in one put session (opts as tqkv_client_put_begin; NULL =
 * defaults), block-major within each layer, and writes the totals to *res (may be NULL).
 * Borrows everything. Returns TQKV_EINVAL for a malformed request (NULL pointer, empty
 * grid, zero shape) or the session's first error. */
tqkv_status_t tqkv_client_put_many(tqkv_client_t *c, const tqkv_put_opts_t *opts,
                                   const tqkv_put_many_req_t *req, tqkv_put_result_t *res);

/* Where tqkv_client_get_into writes. */
typedef struct tqkv_get_into {
    tqkv_block_shape_t shape; /* expected; a page of another shape fails the Get */
    void *const *keys;        /* BF16 destinations, [(layer - layer_begin) * num_hashes + i];
                                 NULL (the array or an entry) = K not wanted */
    void *const *values;      /* same for V */
    uint8_t *found;           /* out: 1 per entry that was found and written; may be NULL */
} tqkv_get_into_t;

/* Gets the grid req (hashes x [layer_begin, layer_end)) and writes every found block
 * into its destinations: PACKED pages are validated (the CRC, unless the library
 * already checked it on receipt) and decoded to BF16 here; BF16 responses are copied.
 * Missing blocks leave their destinations untouched and found[] 0. Writes the number
 * of blocks found and the bytes received (either pointer may be NULL).
 * Returns tqkv_client_get's statuses, TQKV_EINVAL for a malformed request, and fails
 * (with the hash index and layer in tqkv_client_last_error()) on a page whose shape is
 * not dst->shape (TQKV_EFORMAT), that lacks a tensor a destination wants (TQKV_EFORMAT)
 * or that does not decode (TQKV_EFORMAT / TQKV_ECORRUPT). After a failure, destinations
 * may hold some blocks and found[] tells which: treat the rest as missing. */
tqkv_status_t tqkv_client_get_into(tqkv_client_t *c, const tqkv_get_req_t *req,
                                   const tqkv_get_into_t *dst, uint64_t *blocks_found,
                                   uint64_t *bytes_received);

#ifdef __cplusplus
}
#endif

#endif
