/* replay_main.c - runs a fuzz target's LLVMFuzzerTestOneInput over files without
 * libFuzzer, so the seed corpus and every recorded crash (tests/fuzz/regressions/) are
 * replayed by the ordinary test suites, under ASan/UBSan in the sanitizer stage.
 *
 * Usage: fuzz-replay-<target> PATH...   (files, or directories of files; missing
 * directories are skipped). Exits 0 after every input ran; a property violation or a
 * sanitizer report aborts.
 *
 * With TQKV_FUZZ_MUTATIONS=N it also runs N random mutants of every input (bit flips,
 * byte sets, inserts, deletions, truncation, chunk copies; seed TQKV_TEST_SEED or
 * time-based, printed): a small coverage-blind fuzzer for builds without libFuzzer.
 * When a run dies (abort, signal, sanitizer report) the input being run is written to
 * TQKV_FUZZ_LAST (if set).
 */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/fuzz/fuzz_common.h"

static unsigned long g_mutations;
static uint64_t g_rng;
static const char *g_last;

static uint64_t
rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Applies 1..4 random edits to in[0..n) into out (capacity n + 64); returns the length. */
static size_t
mutate(const uint8_t *in, size_t n, uint8_t *out)
{
    static const uint8_t special[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, 0x40, 0x10};
    memcpy(out, in, n);
    size_t len = n;
    int edits = 1 + (int)(rnd() % 4);
    for (int e = 0; e < edits; e++) {
        size_t pos = len ? (size_t)(rnd() % len) : 0;
        switch (rnd() % 7) {
        case 0: /* flip a bit */
            if (len)
                out[pos] ^= (uint8_t)(1u << (rnd() % 8));
            break;
        case 1: /* set a special byte */
            if (len)
                out[pos] = special[rnd() % sizeof special];
            break;
        case 2: /* set a random byte */
            if (len)
                out[pos] = (uint8_t)rnd();
            break;
        case 3: /* insert a byte */
            if (len < n + 64) {
                memmove(out + pos + 1, out + pos, len - pos);
                out[pos] = (uint8_t)rnd();
                len++;
            }
            break;
        case 4: { /* delete a range */
            size_t k = len ? 1 + (size_t)(rnd() % (len - pos < 16 ? len - pos : 16)) : 0;
            memmove(out + pos, out + pos + k, len - pos - k);
            len -= k;
            break;
        }
        case 5: /* truncate */
            len = pos;
            break;
        default: { /* copy a chunk over another place */
            if (len < 2)
                break;
            size_t from = (size_t)(rnd() % len), to = (size_t)(rnd() % len);
            size_t k = 1 + (size_t)(rnd() % 8);
            if (from + k > len)
                k = len - from;
            if (to + k > len)
                k = len - to;
            memmove(out + to, out + from, k);
            break;
        }
        }
    }
    return len;
}

/* The input being run, saved by save_current() when the process dies. */
static const uint8_t *volatile g_cur;
static volatile size_t g_cur_n;

static void
save_current(void)
{
    if (g_last == NULL || g_cur == NULL)
        return;
    int fd = open(g_last, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return;
    size_t off = 0;
    while (off < g_cur_n) {
        ssize_t w = write(fd, (const uint8_t *)g_cur + off, g_cur_n - off);
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    close(fd);
}

static void
on_fatal_signal(int sig)
{
    save_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Provided by the sanitizer runtimes; absent (NULL) in a plain build. */
extern void __sanitizer_set_death_callback(void (*cb)(void)) __attribute__((weak));

static void
run_one(const uint8_t *buf, size_t n)
{
    /* libFuzzer hands the target an exact-size buffer: do the same. */
    uint8_t *exact = malloc(n ? n : 1);
    memcpy(exact, buf, n);
    g_cur = buf;
    g_cur_n = n;
    LLVMFuzzerTestOneInput(exact, n);
    g_cur = NULL;
    free(exact);
}

static int
replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            uint8_t *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf == NULL)
        return -1;
    run_one(buf, n);
    if (g_mutations > 0) {
        uint8_t *m = malloc(n + 64);
        if (m == NULL) {
            free(buf);
            return -1;
        }
        for (unsigned long i = 0; i < g_mutations; i++)
            run_one(m, mutate(buf, n, m));
        free(m);
    }
    free(buf);
    return 0;
}

static int
cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int
main(int argc, char **argv)
{
    int files = 0, bad = 0;
    const char *mu = getenv("TQKV_FUZZ_MUTATIONS");
    g_mutations = mu ? strtoul(mu, NULL, 0) : 0;
    g_last = getenv("TQKV_FUZZ_LAST");
    if (g_last != NULL) {
        signal(SIGABRT, on_fatal_signal);
        signal(SIGSEGV, on_fatal_signal);
        signal(SIGBUS, on_fatal_signal);
        signal(SIGFPE, on_fatal_signal);
        if (__sanitizer_set_death_callback != NULL)
            __sanitizer_set_death_callback(save_current);
    }
    if (g_mutations > 0) {
        const char *e = getenv("TQKV_TEST_SEED");
        g_rng = e ? strtoull(e, NULL, 0) : ((uint64_t)time(NULL) * 2654435761u) ^ (uint64_t)clock();
        fprintf(stderr, "TQKV_TEST_SEED=%" PRIu64 " (%lu mutants per input%s%s)\n", g_rng,
                g_mutations, g_last ? ", a crashing input is saved to " : "", g_last ? g_last : "");
    }
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0)
            continue;
        if (!S_ISDIR(sb.st_mode)) {
            bad |= replay_file(argv[i]) != 0;
            files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (d == NULL) {
            perror(argv[i]);
            return 1;
        }
        char **names = NULL;
        size_t nn = 0;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.')
                continue;
            names = realloc(names, (nn + 1) * sizeof *names);
            names[nn++] = strdup(e->d_name);
        }
        closedir(d);
        qsort(names, nn, sizeof *names, cmp_names);
        for (size_t k = 0; k < nn; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]);
            fprintf(stderr, "replay %s\n", path);
            bad |= replay_file(path) != 0;
            files++;
            free(names[k]);
        }
        free(names);
    }
    fprintf(stderr, "replayed %d inputs (+%lu mutants each)\n", files, g_mutations);
    return bad ? 1 : 0;
}
