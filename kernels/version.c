/* version.c - the build's description for --version and tqkv_version().
 *
 * TQKV_VERSION_* and TQKV_BUILD_* come from kernels/CMakeLists.txt; the git revision
 * from version_git.h, which the build regenerates on every build (kernels/git_rev.cmake)
 * and rewrites only when the revision changed. */
#include "kernels/version.h"

#include "kernels/attention.h"
#include "kernels/page.h"
#include "kernels/page_format.h"
#include "version_git.h"

#define TQKV_STR_(x) #x
#define TQKV_STR(x) TQKV_STR_(x)

const char *
tqkv_version(void)
{
    return TQKV_STR(TQKV_VERSION_MAJOR) "." TQKV_STR(TQKV_VERSION_MINOR) "." TQKV_STR(
        TQKV_VERSION_PATCH);
}

int
tqkv_version_number(void)
{
    return TQKV_VERSION_MAJOR * 10000 + TQKV_VERSION_MINOR * 100 + TQKV_VERSION_PATCH;
}

const char *
tqkv_version_git(void)
{
    return TQKV_GIT_REV;
}

void
tqkv_version_fprint(FILE *f, const char *prog)
{
    fprintf(f, "%s %s (git %s)\n", prog, tqkv_version(), tqkv_version_git());
    fprintf(f, "page format: %u\n", (unsigned)TQKV_PAGE_VERSION);
    fprintf(f, "isa: %s (pages), %s (attention)\n", tqkv_kernels_isa(), tqkv_attn_isa());
#if TQKV_BUILD_CUDA
    fprintf(f, "cuda: compiled in (%s)\n", TQKV_BUILD_CUDA_VERSION);
#else
    fprintf(f, "cuda: not compiled in\n");
#endif
#if TQKV_BUILD_NCCL
    fprintf(f, "nccl: compiled in\n");
#else
    fprintf(f, "nccl: not compiled in\n");
#endif
}
