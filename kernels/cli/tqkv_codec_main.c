/* tqkv_codec_main.c - tqkv-codec: offline encode/decode/eval/bench over raw BF16 files.
 *
 * Subcommands live in *_cli.c files: codec_cli.c (vector codec) and kv_cli.c
 * (KV blocks and attention). This file only dispatches.
 */
#include <stdio.h>
#include <string.h>

#include "kernels/version.h"

int tqkv_cli_encode(int argc, char **argv);
int tqkv_cli_decode(int argc, char **argv);
int tqkv_cli_info(int argc, char **argv);
int tqkv_cli_eval(int argc, char **argv);
int tqkv_cli_bench(int argc, char **argv);
int tqkv_cli_encode_kv(int argc, char **argv);
int tqkv_cli_decode_kv(int argc, char **argv);
int tqkv_cli_attend(int argc, char **argv);
int tqkv_cli_attn_eval(int argc, char **argv);
int tqkv_cli_attn_bench(int argc, char **argv);

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"encode", tqkv_cli_encode, "encode raw BF16 vectors [n][D] into pages"},
    {"decode", tqkv_cli_decode, "decode a page file back to raw BF16"},
    {"info", tqkv_cli_info, "describe the pages of a page file"},
    {"eval", tqkv_cli_eval, "measured distortion and inner-product bias next to theory"},
    {"bench", tqkv_cli_bench, "encode/decode GB/s next to memcpy and zstd -1"},
    {"encode-kv", tqkv_cli_encode_kv, "encode one KV block (K, V BF16 [T][H][D]) into a page"},
    {"decode-kv", tqkv_cli_decode_kv, "decode a KV page back to K and V"},
    {"attend", tqkv_cli_attend, "fused decode attention of a query over KV pages"},
    {"attn-eval", tqkv_cli_attn_eval, "attention quality of KV policies vs a KIVI-style baseline"},
    {"attn-bench", tqkv_cli_attn_bench, "fused attention on packed pages vs BF16 attention"},
};

static void
usage(FILE *f)
{
    fprintf(f, "usage: tqkv-codec COMMAND [options]   (tqkv-codec COMMAND --help)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
    fprintf(f, "  %-10s %s\n", "--version", "print the version and build (ISA, CUDA, NCCL)");
}

int
main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        tqkv_version_fprint(stdout, "tqkv-codec");
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(argv[1], cmds[i].name))
            return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "tqkv-codec: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
