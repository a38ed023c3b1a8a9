/* fuzz_auth.c - libFuzzer target: the token-file parser and the Bearer check
 * (service/auth.c) on arbitrary bytes.
 *
 * Input: the token file, a 0x00 byte, then the authorization header value (which may
 * itself hold NULs). The file is written to a memfd and loaded by its /proc path.
 * Properties: a rejected file gets "PATH:LINE: why"; a check returns only OK, EAUTH or
 * EPERM; a token that authenticates for a namespace with rw also does for r and w alone.
 */
#define _GNU_SOURCE
#include "tests/fuzz/fuzz_common.h"

#include <sys/mman.h>
#include <unistd.h>

#include "service/auth.h"

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *sep = memchr(data, 0, size);
    size_t flen = sep ? (size_t)(sep - data) : size;
    const char *hdr = sep ? (const char *)sep + 1 : NULL;
    size_t hlen = sep ? size - flen - 1 : 0;

    int fd = memfd_create("tqkv-fuzz-auth", 0);
    if (fd < 0)
        return 0;
    if (write(fd, data, flen) != (ssize_t)flen) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

    tqkv_auth_t *a = NULL;
    char err[512];
    memset(err, 'x', sizeof err);
    tqkv_status_t st = tqkv_auth_load(path, &a, err, sizeof err);
    close(fd);
    if (st != TQKV_OK) {
        FUZZ_REQUIRE(a == NULL);
        FUZZ_REQUIRE(st == TQKV_EINVAL || st == TQKV_ENOMEM);
        FUZZ_REQUIRE(fuzz_err_ok(err, sizeof err));
        FUZZ_REQUIRE(strncmp(err, path, strlen(path)) == 0 && err[strlen(path)] == ':');
        return 0;
    }
    FUZZ_REQUIRE(a != NULL);
    /* Namespaces to try: a few fixed ones and a slice of the header. */
    const char *ns[] = {"a", "team-a", "*", "", NULL};
    size_t nns = sizeof ns / sizeof ns[0];
    for (size_t i = 0; i <= nns; i++) {
        const char *n = i < nns ? ns[i] : hdr;
        size_t nl = i < nns ? (n ? strlen(n) : 0) : (hlen < 16 ? hlen : 16);
        if (i == nns && hdr == NULL)
            break;
        tqkv_status_t r = tqkv_auth_check(a, hdr, hlen, n, nl, TQKV_AUTH_READ);
        tqkv_status_t w = tqkv_auth_check(a, hdr, hlen, n, nl, TQKV_AUTH_WRITE);
        tqkv_status_t rw = tqkv_auth_check(a, hdr, hlen, n, nl, TQKV_AUTH_READ | TQKV_AUTH_WRITE);
        FUZZ_REQUIRE(r == TQKV_OK || r == TQKV_EAUTH || r == TQKV_EPERM);
        FUZZ_REQUIRE(w == TQKV_OK || w == TQKV_EAUTH || w == TQKV_EPERM);
        FUZZ_REQUIRE(rw == TQKV_OK || rw == TQKV_EAUTH || rw == TQKV_EPERM);
        /* Authentication does not depend on the permission asked. */
        FUZZ_REQUIRE((r == TQKV_EAUTH) == (w == TQKV_EAUTH) &&
                     (w == TQKV_EAUTH) == (rw == TQKV_EAUTH));
        if (rw == TQKV_OK)
            FUZZ_REQUIRE(r == TQKV_OK && w == TQKV_OK);
        if (hdr == NULL)
            FUZZ_REQUIRE(r == TQKV_EAUTH);
    }
    tqkv_auth_destroy(a);
    return 0;
}
