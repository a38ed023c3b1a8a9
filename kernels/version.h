/* version.h - what this build of tqkv is: release, git revision, page format, ISA, GPU.
 *
 * Every tool prints tqkv_version_fprint() for --version; libtqkv users call
 * tqkv_version() to check which library they loaded at run time. */
#ifndef TQKV_VERSION_H
#define TQKV_VERSION_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The release ("0.1.0"), from the project() version in CMakeLists.txt. Returns a
 * static string. */
const char *tqkv_version(void);

/* The release as one number: major * 10000 + minor * 100 + patch. */
int tqkv_version_number(void);

/* The git revision the library was built from ("4d3ffc4", "4d3ffc4-dirty"), or
 * "unknown" outside a git checkout. Returns a static string. */
const char *tqkv_version_git(void);

/* Writes the build's description, one fact a line, to f:
 *   PROG 0.1.0 (git 4d3ffc4)
 *   page format: 2
 *   isa: avx512 (pages), avx2 (attention)
 *   cuda: compiled in (13.0) | not compiled in
 *   nccl: compiled in | not compiled in */
void tqkv_version_fprint(FILE *f, const char *prog);

#ifdef __cplusplus
}
#endif

#endif /* TQKV_VERSION_H */
