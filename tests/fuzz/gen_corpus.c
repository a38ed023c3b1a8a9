/* gen_corpus.c - writes the seed corpora of the fuzz targets: valid pages from
 * tqkv_page_encode over many shapes and codecs (fuzz_page), valid requests of every
 * kind (fuzz_validate_*), and token files with headers (fuzz_auth). The page seeds
 * also seed fuzz_attention (same input format); GetResponses seed fuzz_client_get.
 *
 * Usage: tqkv-fuzz-corpus OUTDIR   (creates OUTDIR/<target>/seed-NNN)
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/page.h"
#include "kernels/tq_math.h"
#include "tqkv/v1/kvcache.pb-c.h"

static const char *g_out;

static int
write_seed(const char *target, int n, const void *a, size_t alen, const void *b, size_t blen)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", g_out, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        return -1;
    }
    snprintf(path, sizeof path, "%s/%s/seed-%03d", g_out, target, n);
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        perror(path);
        return -1;
    }
    int ok = fwrite(a, 1, alen, f) == alen && (blen == 0 || fwrite(b, 1, blen, f) == blen);
    ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}

static int
write_msg(const char *target, int n, const ProtobufCMessage *m)
{
    size_t len = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL)
        return -1;
    protobuf_c_message_pack(m, buf);
    int rc = write_seed(target, n, buf, len, NULL, 0);
    free(buf);
    return rc;
}

static void
fill_bf16(uint16_t *x, size_t n, uint64_t *rng, int structured)
{
    for (size_t i = 0; i < n; i++) {
        /* Gaussian-ish values with occasional outlier channels. */
        double u = 0;
        for (int k = 0; k < 4; k++)
            u += (double)(tqkv_splitmix64(rng) >> 11) / 9007199254740992.0 - 0.5;
        if (structured && i % 17 == 0)
            u *= 40.0;
        x[i] = tqkv_f32_to_bf16((float)u);
    }
}

typedef struct shape3 {
    uint32_t t, h, d;
} shape3_t;

int
main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    g_out = argv[1];
    if (mkdir(g_out, 0755) != 0 && errno != EEXIST) {
        perror(g_out);
        return 1;
    }
    uint64_t rng = 0x7a11ed5eedull;
    static const shape3_t shapes[] = {{1, 1, 16}, {3, 2, 32}, {2, 1, 128}, {5, 3, 48},
                                      {1, 2, 64}, {4, 1, 24}, {2, 2, 256}};
    static const uint8_t bits[] = {2, 3, 4, 5, 6, 7, 8};
    int npage = 0, nput = 0;
    uint8_t *page = NULL;
    size_t page_cap = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        for (size_t bi = 0; bi < sizeof bits / sizeof bits[0]; bi++) {
            tqkv_block_shape_t sh = {shapes[si].t, shapes[si].h, shapes[si].d};
            tqkv_block_codec_t c;
            memset(&c, 0, sizeof c);
            unsigned variant = (unsigned)(si * 7 + bi);
            c.k.bits_x2 = bits[bi];
            c.k.mode = (variant & 1) && bits[bi] >= 4 ? TQKV_MODE_PROD : TQKV_MODE_MSE;
            c.k.norm_correction = (variant >> 1) & 1;
            c.v.bits_x2 = variant % 5 == 4 ? 0 : bits[(bi + 3) % 7];
            c.v.mode = TQKV_MODE_MSE;
            c.rotation = (variant >> 2) & 1 ? TQKV_ROT_DENSE : TQKV_ROT_HADAMARD;
            c.key_centering = (variant % 3) == 0;
            c.seed = tqkv_splitmix64(&rng);
            if (tqkv_page_check_params(&sh, &c, NULL, 0) != TQKV_OK)
                continue;
            size_t psz = 0;
            if (tqkv_page_size(&sh, &c, &psz) != TQKV_OK)
                continue;
            size_t elems = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
            uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
            if (psz > page_cap) {
                free(page);
                page = malloc(psz);
                page_cap = psz;
            }
            if (k == NULL || v == NULL || page == NULL)
                return 1;
            fill_bf16(k, elems, &rng, 1);
            fill_bf16(v, elems, &rng, 0);
            size_t written = 0;
            char err[256];
            tqkv_status_t st = tqkv_page_encode(&sh, &c, k, c.v.bits_x2 ? v : NULL, page, psz,
                                                &written, err, sizeof err);
            if (st != TQKV_OK) {
                fprintf(stderr, "encode [%u][%u][%u] bits_x2 %u: %s\n", sh.num_tokens,
                        sh.num_kv_heads, sh.head_dim, bits[bi], err);
                free(k);
                free(v);
                continue;
            }
            /* fuzz_page input: control byte then the page (0: as is, 1: CRC rewritten). */
            uint8_t ctl = (uint8_t)(npage & 1);
            if (write_seed("page", npage, &ctl, 1, page, written) != 0 ||
                write_seed("attention", npage, &ctl, 1, page, written) != 0)
                return 1;
            npage++;
            /* A Put carrying the page, and (small shapes) one carrying BF16 K/V. */
            uint8_t hash[32], parent[32];
            for (int i = 0; i < 32; i++) {
                hash[i] = (uint8_t)tqkv_splitmix64(&rng);
                parent[i] = (uint8_t)tqkv_splitmix64(&rng);
            }
            Tqkv__V1__PutRequest put = TQKV__V1__PUT_REQUEST__INIT;
            put.namespace_ = (char *)"team-a/llama";
            put.hash.data = hash;
            put.hash.len = 8 + variant % 25;
            put.parent_hash.data = parent;
            put.parent_hash.len = variant % 2 ? 32 : 0;
            put.layer = variant % 4;
            put.num_layers = variant % 3 ? 32 : 0;
            put.num_tokens = sh.num_tokens;
            put.num_kv_heads = sh.num_kv_heads;
            put.head_dim = sh.head_dim;
            if (variant % 2 == 0) {
                put.page.data = page;
                put.page.len = written;
            } else if (elems <= 2048) {
                put.key.data = (uint8_t *)k;
                put.key.len = elems * 2;
                put.value.data = (uint8_t *)v;
                put.value.len = elems * 2;
                Tqkv__V1__Codec codec = TQKV__V1__CODEC__INIT;
                codec.key_bits = 3.5f;
                codec.value_bits = 2.0f;
                codec.key_mode = TQKV__V1__MODE__MODE_PROD;
                if (variant % 4 == 1)
                    put.codec = &codec;
                if (write_msg("validate_put", nput++, &put.base) != 0)
                    return 1;
                put.codec = NULL;
                free(k);
                free(v);
                continue;
            }
            if (write_msg("validate_put", nput++, &put.base) != 0)
                return 1;
            free(k);
            free(v);
        }
    }
    /* Lossless (raw BF16, mode 2) pages: K and V raw, K raw + V lossy, K lossy + V raw;
     * as page/attention seeds and in Puts, with a per-request MODE_LOSSLESS codec (and one
     * with a bit width beside it, which validation refuses). */
    for (int li = 0; li < 6; li++) {
        tqkv_block_shape_t sh = {shapes[li].t, shapes[li].h, shapes[li].d};
        tqkv_block_codec_t c;
        memset(&c, 0, sizeof c);
        c.k.bits_x2 = c.v.bits_x2 = 6;
        c.k.norm_correction = c.v.norm_correction = 1;
        c.key_centering = 1;
        c.seed = tqkv_splitmix64(&rng);
        if (li % 3 != 2)
            c.k.bits_x2 = TQKV_RAW_BITS_X2, c.k.mode = TQKV_MODE_RAW, c.k.norm_correction = 0;
        if (li % 3 != 1)
            c.v.bits_x2 = TQKV_RAW_BITS_X2, c.v.mode = TQKV_MODE_RAW, c.v.norm_correction = 0;
        size_t psz = 0, written = 0, elems = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
        if (tqkv_page_size(&sh, &c, &psz) != TQKV_OK)
            return 1;
        uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
        uint8_t *pg = malloc(psz);
        if (k == NULL || v == NULL || pg == NULL)
            return 1;
        fill_bf16(k, elems, &rng, 1);
        fill_bf16(v, elems, &rng, 0);
        char err[256];
        if (tqkv_page_encode(&sh, &c, k, v, pg, psz, &written, err, sizeof err) != TQKV_OK) {
            fprintf(stderr, "lossless encode: %s\n", err);
            return 1;
        }
        uint8_t ctl = (uint8_t)(li & 1);
        if (write_seed("page", npage, &ctl, 1, pg, written) != 0 ||
            write_seed("attention", npage, &ctl, 1, pg, written) != 0)
            return 1;
        npage++;
        uint8_t hash[16];
        for (int i = 0; i < 16; i++)
            hash[i] = (uint8_t)tqkv_splitmix64(&rng);
        Tqkv__V1__PutRequest put = TQKV__V1__PUT_REQUEST__INIT;
        Tqkv__V1__Codec codec = TQKV__V1__CODEC__INIT;
        put.namespace_ = (char *)"exact";
        put.hash.data = hash;
        put.hash.len = sizeof hash;
        put.num_tokens = sh.num_tokens;
        put.num_kv_heads = sh.num_kv_heads;
        put.head_dim = sh.head_dim;
        put.page.data = pg;
        put.page.len = written;
        if (write_msg("validate_put", nput++, &put.base) != 0)
            return 1;
        put.page.len = 0;
        put.key.data = (uint8_t *)k;
        put.key.len = elems * 2;
        put.value.data = (uint8_t *)v;
        put.value.len = elems * 2;
        codec.key_mode = li % 3 != 2 ? TQKV__V1__MODE__MODE_LOSSLESS : TQKV__V1__MODE__MODE_MSE;
        codec.value_mode =
            li % 3 != 1 ? TQKV__V1__MODE__MODE_LOSSLESS : TQKV__V1__MODE__MODE_DEFAULT;
        codec.key_bits = li == 3 ? 3.0f : 0.0f; /* li 3: lossless with bits, refused */
        put.codec = &codec;
        if (write_msg("validate_put", nput++, &put.base) != 0)
            return 1;
        free(k);
        free(v);
        free(pg);
    }
    free(page);

    /* Lookup, Get, Delete, Stats. */
    uint8_t hb[8][40];
    ProtobufCBinaryData hs[8];
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 40; j++)
            hb[i][j] = (uint8_t)tqkv_splitmix64(&rng);
        hs[i].data = hb[i];
        hs[i].len = (size_t)(8 + i * 4);
    }
    int n = 0;
    for (int i = 1; i <= 8; i += 3) {
        Tqkv__V1__LookupRequest lk = TQKV__V1__LOOKUP_REQUEST__INIT;
        lk.namespace_ = (char *)"team-a";
        lk.n_hashes = (size_t)i;
        lk.hashes = hs;
        lk.num_layers = (uint32_t)(i * 4);
        lk.lease_ms = i > 1 ? 5000 : 0;
        if (write_msg("validate_lookup", n++, &lk.base) != 0)
            return 1;
    }
    n = 0;
    for (int i = 1; i <= 8; i += 3) {
        Tqkv__V1__GetRequest g = TQKV__V1__GET_REQUEST__INIT;
        g.namespace_ = (char *)"ns-b";
        g.n_hashes = (size_t)i;
        g.hashes = hs;
        g.layer_begin = (uint32_t)(i - 1);
        g.layer_end = (uint32_t)(i + 2);
        g.encoding =
            i % 2 ? TQKV__V1__ENCODING__ENCODING_BF16 : TQKV__V1__ENCODING__ENCODING_PACKED;
        if (write_msg("validate_get", n++, &g.base) != 0)
            return 1;
    }
    n = 0;
    {
        Tqkv__V1__DeleteRequest d = TQKV__V1__DELETE_REQUEST__INIT;
        d.namespace_ = (char *)"ns-c";
        d.n_hashes = 3;
        d.hashes = hs;
        if (write_msg("validate_delete", n++, &d.base) != 0)
            return 1;
        d.n_hashes = 0;
        d.hashes = NULL;
        d.all = 1;
        if (write_msg("validate_delete", n++, &d.base) != 0)
            return 1;
    }
    n = 0;
    {
        Tqkv__V1__StatsRequest s = TQKV__V1__STATS_REQUEST__INIT;
        if (write_msg("validate_stats", n++, &s.base) != 0)
            return 1;
        s.namespace_ = (char *)"team-a/llama";
        if (write_msg("validate_stats", n++, &s.base) != 0)
            return 1;
    }

    /* GetResponses as a server sends them (fuzz_client_get). */
    n = 0;
    {
        uint8_t page_bytes[256], kv[64];
        for (size_t i = 0; i < sizeof page_bytes; i++)
            page_bytes[i] = (uint8_t)tqkv_splitmix64(&rng);
        for (size_t i = 0; i < sizeof kv; i++)
            kv[i] = (uint8_t)tqkv_splitmix64(&rng);
        Tqkv__V1__GetResponse g = TQKV__V1__GET_RESPONSE__INIT;
        g.hash = hs[2];
        g.layer = 3;
        if (write_msg("client_get", n++, &g.base) != 0) /* a miss */
            return 1;
        g.found = 1;
        g.tier = TQKV__V1__TIER__TIER_DRAM;
        g.page.data = page_bytes;
        g.page.len = sizeof page_bytes;
        g.num_tokens = 16;
        g.num_kv_heads = 8;
        g.head_dim = 128;
        if (write_msg("client_get", n++, &g.base) != 0)
            return 1;
        g.page.data = NULL;
        g.page.len = 0;
        g.key.data = kv;
        g.key.len = 32;
        g.value.data = kv + 32;
        g.value.len = 32;
        g.tier = TQKV__V1__TIER__TIER_HBM;
        if (write_msg("client_get", n++, &g.base) != 0)
            return 1;
    }

    /* Token files: FILE, NUL, authorization header. */
    static const char *files[] = {
        "# tokens\nadmin-token-0001 rw *\nreader-token-0002 r team-a,team-b\n",
        "writer-token-0003\tw\tteam-a\r\n\n  # c\nx-token-00000004 rw a\n",
        "bad line\n",
        "tok-aaaaaaaa rx ns\n",
    };
    static const char *hdrs[] = {"Bearer admin-token-0001", "bearer reader-token-0002",
                                 "BEARER  writer-token-0003 ", "Basic abc",
                                 "Bearer x-token-00000004"};
    n = 0;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        for (size_t j = 0; j < sizeof hdrs / sizeof hdrs[0]; j += 2) {
            size_t fl = strlen(files[i]);
            char *buf = malloc(fl + 1 + strlen(hdrs[j]));
            memcpy(buf, files[i], fl);
            buf[fl] = '\0';
            memcpy(buf + fl + 1, hdrs[j], strlen(hdrs[j]));
            int rc = write_seed("auth", n++, buf, fl + 1 + strlen(hdrs[j]), NULL, 0);
            free(buf);
            if (rc != 0)
                return 1;
        }
    }
    printf("seed corpus in %s: %d pages, %d puts\n", g_out, npage, nput);
    return npage > 0 ? 0 : 1;
}
