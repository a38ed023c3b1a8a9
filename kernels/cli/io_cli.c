/* io_cli.c - tqkv-codec: output files that appear whole or not at all (see io_cli.h). */
#include "kernels/cli/io_cli.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int
write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

static int
fail_errno(tqkv__cli_out_t *o, int fd, int e)
{
    if (fd >= 0)
        close(fd);
    tqkv__cli_out_abort(o);
    errno = e;
    return -1;
}

int
tqkv__cli_out_write(tqkv__cli_out_t *o, const char *path, const void *buf, size_t len)
{
    struct stat sb;
    int fd = -1;
    memset(o, 0, sizeof *o);
    if ((o->path = strdup(path)) == NULL)
        return fail_errno(o, -1, ENOMEM);
    int exists = lstat(path, &sb) == 0;
    if (exists && S_ISDIR(sb.st_mode))
        return fail_errno(o, -1, EISDIR);
    if (!exists || S_ISREG(sb.st_mode)) {
        size_t n = strlen(path);
        if ((o->tmp = malloc(n + 16)) == NULL)
            return fail_errno(o, -1, ENOMEM);
        snprintf(o->tmp, n + 16, "%s.tmp-XXXXXX", path);
        fd = mkstemp(o->tmp);
        if (fd < 0) {
            int e = errno;
            free(o->tmp);
            o->tmp = NULL;
            if (!exists)
                return fail_errno(o, -1, e); /* no such directory, not writable, ... */
            /* an existing file in a directory we cannot write: in place */
        } else {
            /* the mode a plain creat(2) would give, or the replaced file's */
            mode_t um = umask(0);
            umask(um);
            if (fchmod(fd, exists ? (sb.st_mode & 07777) : (0666 & ~um)) != 0)
                return fail_errno(o, fd, errno);
        }
    }
    if (fd < 0 && (fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666)) < 0)
        return fail_errno(o, -1, errno);
    if (write_all(fd, buf, len) != 0)
        return fail_errno(o, fd, errno);
    if (close(fd) != 0)
        return fail_errno(o, -1, errno);
    return 0;
}

int
tqkv__cli_out_commit(tqkv__cli_out_t *o)
{
    if (o->tmp && rename(o->tmp, o->path) != 0) {
        int e = errno;
        tqkv__cli_out_abort(o);
        errno = e;
        return -1;
    }
    free(o->tmp);
    free(o->path);
    memset(o, 0, sizeof *o);
    return 0;
}

void
tqkv__cli_out_abort(tqkv__cli_out_t *o)
{
    if (o->tmp)
        unlink(o->tmp);
    free(o->tmp);
    free(o->path);
    memset(o, 0, sizeof *o);
}

int
tqkv__cli_write_file(const char *path, const void *buf, size_t len)
{
    tqkv__cli_out_t o;
    if (tqkv__cli_out_write(&o, path, buf, len) != 0)
        return -1;
    return tqkv__cli_out_commit(&o);
}

int
tqkv__cli_same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    if (strcmp(a, b) == 0)
        return 1;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}
