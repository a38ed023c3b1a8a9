/* kv_codec_cli.c - tqkv-codec encode-kv, decode-kv and attend (kv_cli.c has the
 * conventions: files, exit codes). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kernels/attention.h"
#include "kernels/cli/io_cli.h"
#include "kernels/cli/kv_cli.h"
#include "kernels/cli/kv_synth.h"
#include "kernels/kivi.h"
#include "kernels/page.h"
#include "kernels/policy.h"
#include "kernels/tq_math.h"

/* ---- encode-kv ---- */

static const char encode_kv_usage[] =
    "usage: tqkv-codec encode-kv --tokens T --heads H --dim D [--key-bits KB] [--value-bits VB]\n"
    "         [--key-mode mse|prod|lossless] [--value-mode mse|prod|lossless] [--lossless]\n"
    "         [--seed S] [--no-norm-correction] [--no-key-centering] [--rotation dense|hadamard]\n"
    "         [--block N] K.bf16 V.bf16 OUT.tqp\n"
    "  K, V: raw little-endian BF16 [T][H][D]. Bits: 1, 1.5, 2, 2.5, 3, 3.5, 4.\n"
    "  lossless (--lossless: K and V): BF16 kept as is, decode-kv returns the input bytes;\n"
    "  takes no bits.\n"
    "  Defaults: the server's default policy for a middle layer (pages a default tqkv-server\n"
    "  stores); --no-norm-correction and --no-key-centering turn those off (--help lists them).\n"
    "  --block N splits the tokens into pages of N tokens (default: one page, T <= 65536).\n";

/* The usage, then the default policy's values (kernels/policy.c: tqkv_policy_default). */
static void
encode_kv_help(FILE *f)
{
    tqkv_block_codec_t c;
    tqkv_policy_default_codec(&c);
    fputs(encode_kv_usage, f);
    fprintf(f,
            "  Default codec: keys %g bits %s%s, values %g bits %s%s, key centering %s, %s "
            "rotation, seed %llu.\n",
            c.k.bits_x2 / 2.0, c.k.mode == TQKV_MODE_PROD ? "prod" : "mse",
            c.k.norm_correction ? " norm-corrected" : "", c.v.bits_x2 / 2.0,
            c.v.mode == TQKV_MODE_PROD ? "prod" : "mse",
            c.v.norm_correction ? " norm-corrected" : "", c.key_centering ? "on" : "off",
            c.rotation == TQKV_ROT_DENSE ? "dense" : "hadamard", (unsigned long long)c.seed);
}

/* Encodes k and v ([T][H][D] BF16) in pages of `block` tokens into *outp (returns new,
 * the pages concatenated, *totalp bytes). Returns 0, or 1 after saying why. */
static int
encode_pages(const tqkv_block_codec_t *codec, const uint16_t *k, const uint16_t *v, uint32_t T,
             uint32_t H, uint32_t D, uint32_t block, uint8_t **outp, size_t *totalp)
{
    uint8_t *out = NULL;
    size_t total = 0, cap = 0;
    for (uint32_t t = 0; t < T; t += block) {
        tqkv_block_shape_t sh = {T - t < block ? T - t : block, H, D};
        size_t sz, wr;
        char why[200] = "";
        tqkv_status_t st = tqkv_page_size(&sh, codec, &sz);
        if (st == TQKV_OK && total + sz > cap) {
            size_t ncap = cap ? cap * 2 : sz * ((T + block - 1) / block);
            uint8_t *n2;
            while (ncap < total + sz)
                ncap *= 2;
            if (!(n2 = realloc(out, ncap))) {
                tqkv__cli_fail("out of memory");
                goto fail;
            }
            out = n2;
            cap = ncap;
        }
        if (st == TQKV_OK)
            st = tqkv_page_encode(&sh, codec, k + (size_t)t * H * D, v + (size_t)t * H * D,
                                  out + total, cap - total, &wr, why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("encode: %s", why[0] ? why : tqkv_strerror(st));
            goto fail;
        }
        total += wr;
    }
    *outp = out;
    *totalp = total;
    return 0;
fail:
    free(out);
    return 1;
}

int
tqkv_cli_encode_kv(int argc, char **argv)
{
    const char *pos[3], *missing = NULL;
    int npos = 0, rc = 1;
    uint32_t T = 0, H = 0, D = 0, block = 0;
    tqkv_block_codec_t codec;
    uint16_t *k = NULL, *v = NULL;
    uint8_t *out = NULL;
    size_t klen, vlen, total = 0;
    int kb_given = 0, vb_given = 0;

    if (tqkv__cli_is_help(argc, argv)) {
        encode_kv_help(stdout);
        return 0;
    }
    tqkv_policy_default_codec(&codec);
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--tokens")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, UINT32_MAX, &T))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --tokens '%s'", argv[i]);
        } else if (OPT_VALUE("--heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_HEADS, &H))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --heads '%s'", argv[i]);
        } else if (OPT_VALUE("--dim")) {
            if (tqkv__cli_parse_u32(argv[++i], TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM, &D))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --dim '%s' (%u..%u)", argv[i],
                                           TQKV_PAGE_MIN_DIM, TQKV_PAGE_MAX_DIM);
        } else if (OPT_VALUE("--key-bits")) {
            if (tqkv_bits_parse(argv[++i], &codec.k.bits_x2) != TQKV_OK)
                return tqkv__cli_usage_err(encode_kv_usage, "bad --key-bits '%s'", argv[i]);
            kb_given = 1;
        } else if (OPT_VALUE("--value-bits")) {
            if (tqkv_bits_parse(argv[++i], &codec.v.bits_x2) != TQKV_OK)
                return tqkv__cli_usage_err(encode_kv_usage, "bad --value-bits '%s'", argv[i]);
            vb_given = 1;
        } else if (OPT_VALUE("--key-mode")) {
            if (tqkv__cli_parse_mode(argv[++i], &codec.k.mode))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --key-mode '%s'", argv[i]);
        } else if (OPT_VALUE("--value-mode")) {
            if (tqkv__cli_parse_mode(argv[++i], &codec.v.mode))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --value-mode '%s'", argv[i]);
        } else if (OPT_VALUE("--seed")) {
            if (tqkv__cli_parse_u64(argv[++i], 0, UINT64_MAX, &codec.seed))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --seed '%s'", argv[i]);
        } else if (OPT_VALUE("--rotation")) {
            i++;
            if (!strcmp(argv[i], "dense"))
                codec.rotation = TQKV_ROT_DENSE;
            else if (!strcmp(argv[i], "hadamard"))
                codec.rotation = TQKV_ROT_HADAMARD;
            else
                return tqkv__cli_usage_err(encode_kv_usage, "bad --rotation '%s'", argv[i]);
        } else if (OPT_VALUE("--block")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, TQKV_PAGE_MAX_TOKENS, &block))
                return tqkv__cli_usage_err(encode_kv_usage, "bad --block '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--lossless")) {
            codec.k.mode = codec.v.mode = TQKV_MODE_RAW;
        } else if (!strcmp(argv[i], "--norm-correction")) {
            codec.k.norm_correction = codec.v.norm_correction = 1;
        } else if (!strcmp(argv[i], "--no-norm-correction")) {
            codec.k.norm_correction = codec.v.norm_correction = 0;
        } else if (!strcmp(argv[i], "--key-centering")) {
            codec.key_centering = 1;
        } else if (!strcmp(argv[i], "--no-key-centering")) {
            codec.key_centering = 0;
        } else if (missing) {
            return tqkv__cli_usage_err(encode_kv_usage, "%s needs a value", missing);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return tqkv__cli_usage_err(encode_kv_usage, "unknown option '%s'", argv[i]);
        } else if (npos < 3) {
            pos[npos++] = argv[i];
        } else {
            return tqkv__cli_usage_err(encode_kv_usage, "too many arguments");
        }
    }
    if (missing)
        return tqkv__cli_usage_err(encode_kv_usage, "%s needs a value", missing);
    if (!T || !H || !D || npos != 3)
        return tqkv__cli_usage_err(encode_kv_usage,
                                   "--tokens, --heads, --dim and 3 files are required");
    if ((codec.k.mode == TQKV_MODE_RAW && kb_given) || (codec.v.mode == TQKV_MODE_RAW && vb_given))
        return tqkv__cli_usage_err(
            encode_kv_usage,
            "--%s-bits with a lossless %s: lossless tensors are stored as BF16 and "
            "take no bit width",
            codec.k.mode == TQKV_MODE_RAW && kb_given ? "key" : "value",
            codec.k.mode == TQKV_MODE_RAW && kb_given ? "key" : "value");
    if (codec.k.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&codec.k);
    if (codec.v.mode == TQKV_MODE_RAW)
        tqkv_tensor_codec_lossless(&codec.v);
    if (!block)
        block = T;
    if (block > TQKV_PAGE_MAX_TOKENS)
        return tqkv__cli_usage_err(encode_kv_usage, "%u tokens exceed one page (%u): use --block",
                                   T, TQKV_PAGE_MAX_TOKENS);

    if (!(k = tqkv__cli_read_file(pos[0], &klen)))
        return tqkv__cli_fail("%s: %s", pos[0], strerror(errno));
    if (!(v = tqkv__cli_read_file(pos[1], &vlen))) {
        tqkv__cli_fail("%s: %s", pos[1], strerror(errno));
        goto done;
    }
    {
        uint64_t want = (uint64_t)T * H * D * 2;
        if (klen != want || vlen != want) {
            tqkv__cli_fail(
                "%s is %zu bytes and %s is %zu bytes; the shape %u x %u x %u BF16 needs %" PRIu64,
                pos[0], klen, pos[1], vlen, T, H, D, want);
            goto done;
        }
    }
    if (encode_pages(&codec, k, v, T, H, D, block, &out, &total) != 0)
        goto done;
    if (tqkv__cli_write_file(pos[2], out, total) != 0) {
        tqkv__cli_fail("%s: %s", pos[2], strerror(errno));
        goto done;
    }
    fprintf(stderr, "%u tokens x %u heads x %u dims -> %zu bytes (%.2fx vs BF16 K+V)\n", T, H, D,
            total, (double)T * H * D * 4 / (double)total);
    rc = 0;
done:
    free(k);
    free(v);
    free(out);
    return rc;
}

/* ---- decode-kv ---- */

static const char decode_kv_usage[] =
    "usage: tqkv-codec decode-kv [--format bf16|f32] [--no-check-crc] IN.tqp K.out V.out\n"
    "  Decodes every page of IN.tqp (K and V [T][H][D], pages concatenated along tokens).\n"
    "  Every page's CRC32C is checked unless --no-check-crc (--check-crc: the default).\n";

int
tqkv_cli_decode_kv(int argc, char **argv)
{
    const char *pos[3], *missing = NULL;
    int npos = 0, f32 = 0, check_crc = 1, rc = 1;
    uint8_t *buf = NULL;
    size_t len;
    tqkv__page_list_t pl;
    void *k = NULL, *v = NULL;
    if (tqkv__cli_is_help(argc, argv)) {
        fputs(decode_kv_usage, stdout);
        return 0;
    }
    memset(&pl, 0, sizeof pl);
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--format")) {
            i++;
            if (!strcmp(argv[i], "f32"))
                f32 = 1;
            else if (!strcmp(argv[i], "bf16"))
                f32 = 0;
            else
                return tqkv__cli_usage_err(decode_kv_usage, "bad --format '%s'", argv[i]);
        } else if (!strcmp(argv[i], "--check-crc")) {
            check_crc = 1;
        } else if (!strcmp(argv[i], "--no-check-crc")) {
            check_crc = 0;
        } else if (missing) {
            return tqkv__cli_usage_err(decode_kv_usage, "%s needs a value", missing);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return tqkv__cli_usage_err(decode_kv_usage, "unknown option '%s'", argv[i]);
        } else if (npos < 3) {
            pos[npos++] = argv[i];
        } else {
            return tqkv__cli_usage_err(decode_kv_usage, "too many arguments");
        }
    }
    if (missing)
        return tqkv__cli_usage_err(decode_kv_usage, "%s needs a value", missing);
    if (npos != 3)
        return tqkv__cli_usage_err(decode_kv_usage, "IN.tqp, K.out and V.out are required");
    {
        /* one path for both would silently keep only V (a device such as /dev/null is fine) */
        struct stat sb;
        if (tqkv__cli_same_file(pos[1], pos[2]) &&
            !(stat(pos[1], &sb) == 0 && !S_ISREG(sb.st_mode)))
            return tqkv__cli_usage_err(decode_kv_usage, "K.out and V.out are the same file '%s'",
                                       pos[2]);
    }
    if (!(buf = tqkv__cli_read_file(pos[0], &len)))
        return tqkv__cli_fail("%s: %s", pos[0], strerror(errno));
    if (tqkv__page_list_add(&pl, pos[0], buf, len, check_crc) != 0)
        goto done;
    {
        uint32_t H, D;
        uint64_t T, off = 0;
        size_t esz = f32 ? 4 : 2, total;
        char why[200] = "";
        tqkv_status_t st =
            tqkv_attn_check_pages(pl.pages, pl.lens, pl.n, 0, &H, &D, &T, why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("%s: %s", pos[0], why);
            goto done;
        }
        total = (size_t)T * H * D * esz;
        k = malloc(total);
        v = malloc(total);
        if (!k || !v) {
            tqkv__cli_fail("out of memory");
            goto done;
        }
        for (size_t p = 0; p < pl.n; p++) {
            uint32_t pt = ((const tqkv_page_header_t *)pl.pages[p])->num_tokens;
            size_t o = (size_t)off * H * D * esz;
            st = f32 ? tqkv_page_decode_f32(pl.pages[p], pl.lens[p], (float *)((char *)k + o),
                                            (float *)((char *)v + o))
                     : tqkv_page_decode_bf16(pl.pages[p], pl.lens[p], (uint16_t *)((char *)k + o),
                                             (uint16_t *)((char *)v + o));
            if (st != TQKV_OK) {
                tqkv__cli_fail("%s: page %zu: %s", pos[0], p, tqkv_strerror(st));
                goto done;
            }
            off += pt;
        }
        /* both files or neither: K is renamed into place only once V is written too */
        tqkv__cli_out_t ko, vo;
        if (tqkv__cli_out_write(&ko, pos[1], k, total) != 0) {
            tqkv__cli_fail("%s: %s", pos[1], strerror(errno));
            goto done;
        }
        if (tqkv__cli_out_write(&vo, pos[2], v, total) != 0) {
            tqkv__cli_fail("%s: %s", pos[2], strerror(errno));
            tqkv__cli_out_abort(&ko);
            goto done;
        }
        if (tqkv__cli_out_commit(&ko) != 0) {
            tqkv__cli_fail("%s: %s", pos[1], strerror(errno));
            tqkv__cli_out_abort(&vo);
            goto done;
        }
        if (tqkv__cli_out_commit(&vo) != 0) {
            tqkv__cli_fail("%s: %s", pos[2], strerror(errno));
            goto done;
        }
        fprintf(stderr, "%zu page%s: %" PRIu64 " tokens x %u heads x %u dims\n", pl.n,
                pl.n == 1 ? "" : "s", T, H, D);
    }
    rc = 0;
done:
    tqkv__page_list_free(&pl);
    free(buf);
    free(k);
    free(v);
    return rc;
}

/* ---- attend ---- */

static const char attend_usage[] =
    "usage: tqkv-codec attend --query Q.f32 --query-heads HQ [--split-tokens N] [--threads N]\n"
    "         [--check-crc | --no-check-crc] OUT.f32 IN.tqp [IN2.tqp ...]\n"
    "  Fused decode attention of one query token (float32 [HQ][D]) over the pages of the\n"
    "  files, in order; writes float32 [HQ][D]. The files' page CRC32Cs are checked on\n"
    "  load unless --no-check-crc; --check-crc also has the kernel check them.\n";

int
tqkv_cli_attend(int argc, char **argv)
{
    const char *qpath = NULL, *missing = NULL, *outp = NULL;
    const char **inputs = calloc((size_t)argc, sizeof(char *));
    uint8_t **bufs = calloc((size_t)argc, sizeof(uint8_t *));
    int nin = 0, rc = 1, file_crc = 1;
    uint32_t HQ = 0;
    tqkv_attn_opts_t opts;
    tqkv__page_list_t pl;
    float *q = NULL, *out = NULL;
    size_t qlen;
    memset(&pl, 0, sizeof pl);
    tqkv_attn_opts_default(&opts);
    if (!inputs || !bufs) {
        rc = tqkv__cli_fail("out of memory");
        goto done;
    }
    if (tqkv__cli_is_help(argc, argv)) {
        fputs(attend_usage, stdout);
        rc = 0;
        goto done;
    }
    for (int i = 1; i < argc; i++) {
        if (OPT_VALUE("--query")) {
            qpath = argv[++i];
        } else if (OPT_VALUE("--query-heads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1u << 20, &HQ)) {
                rc = tqkv__cli_usage_err(attend_usage, "bad --query-heads '%s'", argv[i]);
                goto done;
            }
        } else if (OPT_VALUE("--split-tokens")) {
            if (tqkv__cli_parse_u32(argv[++i], 0, UINT32_MAX, &opts.split_tokens)) {
                rc = tqkv__cli_usage_err(attend_usage, "bad --split-tokens '%s'", argv[i]);
                goto done;
            }
        } else if (OPT_VALUE("--threads")) {
            if (tqkv__cli_parse_u32(argv[++i], 1, 1024, &opts.num_threads)) {
                rc = tqkv__cli_usage_err(attend_usage, "bad --threads '%s'", argv[i]);
                goto done;
            }
        } else if (!strcmp(argv[i], "--check-crc")) {
            opts.check_crc = 1;
        } else if (!strcmp(argv[i], "--no-check-crc")) {
            opts.check_crc = 0;
            file_crc = 0;
        } else if (missing) {
            break;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            rc = tqkv__cli_usage_err(attend_usage, "unknown option '%s'", argv[i]);
            goto done;
        } else if (!outp) {
            outp = argv[i];
        } else {
            inputs[nin++] = argv[i];
        }
    }
    if (missing) {
        rc = tqkv__cli_usage_err(attend_usage, "%s needs a value", missing);
        goto done;
    }
    if (!qpath || !HQ || !outp || nin == 0) {
        rc = tqkv__cli_usage_err(attend_usage,
                                 "--query, --query-heads, OUT.f32 and at least one IN.tqp "
                                 "are required");
        goto done;
    }
    for (int i = 0; i < nin; i++) {
        size_t len;
        if (!(bufs[i] = tqkv__cli_read_file(inputs[i], &len))) {
            tqkv__cli_fail("%s: %s", inputs[i], strerror(errno));
            goto done;
        }
        if (tqkv__page_list_add(&pl, inputs[i], bufs[i], len, file_crc) != 0)
            goto done;
    }
    {
        uint32_t H, D;
        uint64_t T;
        char why[240] = "";
        tqkv_status_t st;
        st = tqkv_attn_check_pages(pl.pages, pl.lens, pl.n, 0, &H, &D, &T, why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("%s", why);
            goto done;
        }
        if (HQ % H != 0) {
            tqkv__cli_fail("--query-heads %u is not a multiple of the pages' %u KV heads", HQ, H);
            goto done;
        }
        if (!(q = tqkv__cli_read_file(qpath, &qlen))) {
            tqkv__cli_fail("%s: %s", qpath, strerror(errno));
            goto done;
        }
        if (qlen != (size_t)HQ * D * 4) {
            tqkv__cli_fail("%s is %zu bytes; %u query heads x head_dim %u float32 need %zu", qpath,
                           qlen, HQ, D, (size_t)HQ * D * 4);
            goto done;
        }
        for (size_t i = 0; i < (size_t)HQ * D; i++)
            if (!isfinite(q[i])) {
                tqkv__cli_fail("%s: element %zu is not finite", qpath, i);
                goto done;
            }
        out = malloc(sizeof(float) * HQ * D);
        if (!out) {
            tqkv__cli_fail("out of memory");
            goto done;
        }
        st = tqkv_attn_decode_ex(q, HQ, pl.pages, pl.lens, pl.n, &opts, out, why, sizeof why);
        if (st != TQKV_OK) {
            tqkv__cli_fail("attention: %s", why[0] ? why : tqkv_strerror(st));
            goto done;
        }
        if (tqkv__cli_write_file(outp, out, sizeof(float) * HQ * D) != 0) {
            tqkv__cli_fail("%s: %s", outp, strerror(errno));
            goto done;
        }
        fprintf(stderr, "%zu pages, %" PRIu64 " tokens, %u KV heads, %u query heads, d=%u (%s)\n",
                pl.n, T, H, HQ, D, tqkv_attn_isa());
    }
    rc = 0;
done:
    if (bufs)
        for (int i = 0; i < nin; i++)
            free(bufs[i]);
    free(bufs);
    free(inputs);
    tqkv__page_list_free(&pl);
    free(q);
    free(out);
    return rc;
}
