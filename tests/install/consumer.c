/* consumer.c - a C11 program built against the INSTALLED libtqkv with nothing but
 * `pkg-config --cflags --libs tqkv` (tests/install/run.sh): Put one BF16 block, Lookup
 * it, Get it PACKED and decode it with tqkv_client_decode_page, Get it BF16 (the
 * server's decode of the same page) and compare exactly; check the error paths (a NULL
 * hash array; a put_many shape beyond the server's limits over a 32 KiB buffer is refused
 * before the buffer is read; an options struct from a newer header with a field this
 * library does not know). Options start from TQKV_CLIENT_OPTS_INIT.
 * Usage: consumer HOST:PORT. Exit 0 on success, 1 with a message on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tqkv/client.h>
#include <tqkv/client_bulk.h>
#include <tqkv/kernels/version.h>

#define T 16
#define H 8
#define D 128
#define N (T * H * D)

static uint16_t k_in[N], v_in[N], k_pk[N], v_pk[N], k_bf[N], v_bf[N];
static int got_packed, got_bf16;

static int
fail(const char *what, tqkv_status_t st)
{
    fprintf(stderr, "consumer.c: %s: %s (%s)\n", what, tqkv_strerror(st),
            tqkv_client_last_error()->message);
    return 1;
}

static uint16_t
bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float
f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    (void)arg;
    if (!pg->found)
        return 1;
    if (pg->page) {
        tqkv_block_shape_t s;
        if (tqkv_client_decode_page(pg->page, pg->page_len, k_pk, v_pk, &s) != TQKV_OK ||
            s.num_tokens != T || s.num_kv_heads != H || s.head_dim != D)
            return 1;
        got_packed = 1;
    } else {
        if (pg->key_len != sizeof k_bf || pg->value_len != sizeof v_bf)
            return 1;
        memcpy(k_bf, pg->key, sizeof k_bf);
        memcpy(v_bf, pg->value, sizeof v_bf);
        got_bf16 = 1;
    }
    return 0;
}

int
main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: consumer HOST:PORT\n");
        return 2;
    }
    if (tqkv_version()[0] < '0' || tqkv_version()[0] > '9' || tqkv_version_number() < 100) {
        fprintf(stderr, "consumer.c: tqkv_version() %s\n", tqkv_version());
        return 1;
    }
    srand(7);
    for (int i = 0; i < N; i++) {
        k_in[i] = bf16((float)rand() / RAND_MAX * 2.0f - 1.0f);
        v_in[i] = bf16((float)rand() / RAND_MAX - 0.5f);
    }
    const char *targets[] = {argv[1]};
    tqkv_client_opts_t o = TQKV_CLIENT_OPTS_INIT;
    if (o.struct_size != sizeof o || o.transport != TQKV_CLIENT_TRANSPORT_GRPC) {
        fprintf(stderr, "consumer.c: TQKV_CLIENT_OPTS_INIT\n");
        return 1;
    }
    o.targets = targets;
    o.num_targets = 1;
    o.wait_for_ready = 1;
    tqkv_client_t *c = NULL;
    tqkv_status_t st = tqkv_client_create(&o, &c);
    if (st != TQKV_OK)
        return fail("create", st);

    tqkv_hash_t h = {.len = 16};
    memcpy(h.bytes, "consumer.c-hash!", 16);
    tqkv_put_t *p = NULL;
    tqkv_put_block_t b;
    memset(&b, 0, sizeof b);
    b.ns = "install-c";
    b.hash = &h;
    b.layer = 0;
    b.num_layers = 1;
    b.shape.num_tokens = T;
    b.shape.num_kv_heads = H;
    b.shape.head_dim = D;
    b.key = k_in;
    b.value = v_in;
    tqkv_put_result_t r;
    if ((st = tqkv_client_put_begin(c, NULL, &p)) != TQKV_OK)
        return fail("put_begin", st);
    if ((st = tqkv_client_put_block(p, &b)) != TQKV_OK)
        return fail("put_block", st);
    if ((st = tqkv_client_put_end(p, &r)) != TQKV_OK)
        return fail("put_end", st);

    uint32_t prefix = 0;
    tqkv_lookup_req_t lq = {.ns = "install-c", .hashes = &h, .num_hashes = 1, .num_layers = 1};
    if ((st = tqkv_client_lookup(c, &lq, &prefix, NULL)) != TQKV_OK)
        return fail("lookup", st);
    if (prefix != 1) {
        fprintf(stderr, "consumer.c: lookup prefix %u, want 1\n", prefix);
        return 1;
    }
    tqkv_get_req_t gq = {.ns = "install-c", .hashes = &h, .num_hashes = 1, .layer_end = 1};
    gq.encoding = TQKV_CLIENT_PACKED;
    if ((st = tqkv_client_get(c, &gq, on_page, NULL)) != TQKV_OK || !got_packed)
        return fail("get packed", st);
    gq.encoding = TQKV_CLIENT_BF16;
    if ((st = tqkv_client_get(c, &gq, on_page, NULL)) != TQKV_OK || !got_bf16)
        return fail("get bf16", st);
    if (memcmp(k_pk, k_bf, sizeof k_pk) || memcmp(v_pk, v_bf, sizeof v_pk)) {
        fprintf(stderr, "consumer.c: client decode differs from the server's BF16\n");
        return 1;
    }
    double e = 0, n = 0;
    for (int i = 0; i < N; i++) {
        double d = f32(k_pk[i]) - f32(k_in[i]);
        e += d * d;
        n += (double)f32(k_in[i]) * f32(k_in[i]);
    }
    if (!(e / n < 0.09)) { /* relative L2 error under 0.3 (no libm: not in pkg-config) */
        fprintf(stderr, "consumer.c: decoded K off (rel err^2 %.3f)\n", e / n);
        return 1;
    }
    /* An error reaches the caller as a status and a message. */
    tqkv_lookup_req_t bad = {.ns = "install-c", .hashes = &h, .num_hashes = 1, .num_layers = 1};
    bad.hashes = NULL;
    if (tqkv_client_lookup(c, &bad, &prefix, NULL) != TQKV_EINVAL ||
        tqkv_client_last_error()->message[0] == 0) {
        fprintf(stderr, "consumer.c: a NULL hash array was not EINVAL with a message\n");
        return 1;
    }
    /* A shape the server would refuse, over a 32 KiB buffer: refused before the buffer is
     * read (it used to copy 16 * 8 * 100000 * 2 bytes out of it). */
    static uint16_t small[16 * 1024];
    const void *kv[1] = {small};
    tqkv_put_many_req_t pm = {.ns = "install-c", .hashes = &h, .num_hashes = 1, .layer_end = 1};
    pm.shape.num_tokens = 16;
    pm.shape.num_kv_heads = 8;
    pm.shape.head_dim = 100000;
    pm.keys = kv;
    pm.values = kv;
    st = tqkv_client_put_many(c, NULL, &pm, NULL);
    if ((st != TQKV_EINVAL && st != TQKV_EUNSUPPORTED) ||
        strstr(tqkv_client_last_error()->message, "head_dim") == NULL) {
        fprintf(stderr, "consumer.c: put_many of a 16x8x100000 shape: %s (%s)\n", tqkv_strerror(st),
                tqkv_client_last_error()->message);
        return 1;
    }
    /* The same through a put session: the session stays usable. */
    tqkv_hash_t h2 = {.len = 16};
    memcpy(h2.bytes, "consumer.c-hsh2!", 16);
    tqkv_put_block_t big_block = b;
    big_block.hash = &h2;
    big_block.shape = pm.shape;
    big_block.key = big_block.value = small;
    if ((st = tqkv_client_put_begin(c, NULL, &p)) != TQKV_OK)
        return fail("put_begin", st);
    st = tqkv_client_put_block(p, &big_block);
    if (st != TQKV_EINVAL && st != TQKV_EUNSUPPORTED) {
        fprintf(stderr, "consumer.c: put_block of a 16x8x100000 shape: %s\n", tqkv_strerror(st));
        return 1;
    }
    big_block.shape.head_dim = 128;
    big_block.shape.num_kv_heads = 1; /* 16 x 1 x 128 x 2 = 4 KiB: within the buffer */
    if ((st = tqkv_client_put_block(p, &big_block)) != TQKV_OK ||
        (st = tqkv_client_put_end(p, &r)) != TQKV_OK ||
        r.blocks_stored + r.blocks_duplicate != 1) /* a duplicate on a later run */
        return fail("put of a small block after a refused one", st);
    tqkv_client_destroy(c);
    /* Options from a newer header: a set field past this library's struct is refused; the
     * same struct with that field zero works (read as the default). */
    struct {
        tqkv_client_opts_t o;
        uint64_t newer_field;
    } big;
    memset(&big, 0, sizeof big);
    big.o = o;
    big.o.struct_size = sizeof big;
    big.newer_field = 1;
    if ((st = tqkv_client_create(&big.o, &c)) != TQKV_EUNSUPPORTED || c != NULL) {
        fprintf(stderr, "consumer.c: opts with an unknown field set: %s\n", tqkv_strerror(st));
        return 1;
    }
    big.newer_field = 0;
    if ((st = tqkv_client_create(&big.o, &c)) != TQKV_OK)
        return fail("create with a larger zero-tailed opts", st);
    tqkv_client_destroy(c);
    printf("consumer.c: ok (tqkv %s, rel err^2 K %.4f)\n", tqkv_version(), e / n);
    return 0;
}
