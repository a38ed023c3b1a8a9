/* io_cli.h - tqkv-codec: output files that appear whole or not at all.
 *
 * A regular file (or a new path) is written to a temporary file beside it and renamed
 * over the path once every byte is out, so a failed write (disk full, a file size
 * limit) leaves neither a truncated output nor a destroyed previous file. Anything
 * else that exists at the path (a device such as /dev/stdout or /dev/null, a FIFO, a
 * symbolic link) is written in place and never removed: deleting it on failure would
 * delete the device node, which the tool must not do even when run as root.
 */
#ifndef TQKV_KERNELS_IO_CLI_H
#define TQKV_KERNELS_IO_CLI_H

#include <stddef.h>

/* One output being written. Zero-initialise. */
typedef struct tqkv__cli_out {
    char *path; /* owned copy of the destination */
    char *tmp;  /* owned: the temporary file (NULL when written in place) */
} tqkv__cli_out_t;

/* Writes buf[0..len) for path: to a temporary file (committed later) or in place.
 * Returns 0, or -1 with errno set (nothing of a temporary file is left). */
int tqkv__cli_out_write(tqkv__cli_out_t *o, const char *path, const void *buf, size_t len);

/* Renames the temporary file over the path. Returns 0, or -1 with errno (the temporary
 * file removed). Frees o's strings either way. */
int tqkv__cli_out_commit(tqkv__cli_out_t *o);

/* Removes an uncommitted temporary file and frees o's strings (a no-op when empty). */
void tqkv__cli_out_abort(tqkv__cli_out_t *o);

/* write + commit. Returns 0, or -1 with errno. */
int tqkv__cli_write_file(const char *path, const void *buf, size_t len);

/* 1 when a and b name the same existing file (same device and inode) or the same
 * string, else 0. */
int tqkv__cli_same_file(const char *a, const char *b);

#endif
