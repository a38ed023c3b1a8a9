/* fuzz_validate.c - libFuzzer targets: the decode-and-validate path of each request
 * handler (service/validate.h) on arbitrary bytes. Compiled once per request type with
 * FUZZ_KIND = 1 (Put), 2 (Lookup), 3 (Get), 4 (Delete), 5 (Stats).
 *
 * Properties checked besides memory safety and leaks: a rejection returns an input
 * status (EINVAL, ERANGE, EUNSUPPORTED, or the page statuses for Put), writes a one-line
 * reason and leaves *out unset; an accepted message re-packs to bytes that are accepted
 * again (validation depends on the message, not on its encoding); and whatever tight
 * limits accept, the default limits accept too.
 */
#include "tests/fuzz/fuzz_common.h"

#include "service/validate.h"

#if FUZZ_KIND == 1
typedef Tqkv__V1__PutRequest msg_t;
#define VALIDATE tqkv_validate_put
#elif FUZZ_KIND == 2
typedef Tqkv__V1__LookupRequest msg_t;
#define VALIDATE tqkv_validate_lookup
#elif FUZZ_KIND == 3
typedef Tqkv__V1__GetRequest msg_t;
#define VALIDATE tqkv_validate_get
#elif FUZZ_KIND == 4
typedef Tqkv__V1__DeleteRequest msg_t;
#define VALIDATE tqkv_validate_delete
#elif FUZZ_KIND == 5
typedef Tqkv__V1__StatsRequest msg_t;
#define VALIDATE tqkv_validate_stats
#else
#error "FUZZ_KIND must be 1..5"
#endif

static tqkv_status_t
run(const uint8_t *buf, size_t len, const tqkv_limits_t *lim, msg_t **out)
{
    char err[256];
    memset(err, 'x', sizeof err);
    *out = NULL;
    tqkv_status_t st = VALIDATE(buf, len, lim, out, err, sizeof err);
    if (st == TQKV_OK) {
        FUZZ_REQUIRE(*out != NULL);
        return st;
    }
    FUZZ_REQUIRE(*out == NULL);
    FUZZ_REQUIRE(fuzz_err_ok(err, sizeof err));
    FUZZ_REQUIRE(st == TQKV_EINVAL || st == TQKV_ERANGE || st == TQKV_EUNSUPPORTED ||
                 (FUZZ_KIND == 1 && (st == TQKV_EFORMAT || st == TQKV_ECORRUPT)));
    return st;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* Copy to an exact-size buffer so ASan sees reads past the message. */
    uint8_t *buf = malloc(size ? size : 1);
    if (buf == NULL)
        return 0;
    memcpy(buf, data, size);

    tqkv_limits_t def, tight;
    tqkv_limits_default(&def);
    tight.max_message_bytes = 4096;
    tight.max_hashes = 3;
    tight.max_layers = 4;
    tight.max_tokens = 16;
    tight.max_namespace_bytes = 8;

    msg_t *m = NULL, *m2 = NULL;
    tqkv_status_t st_def = run(buf, size, &def, &m);
    tqkv_status_t st_tight = run(buf, size, &tight, &m2);
    if (st_tight == TQKV_OK)
        FUZZ_REQUIRE(st_def == TQKV_OK);
    if (m2 != NULL)
        protobuf_c_message_free_unpacked(&m2->base, NULL);

    if (m != NULL) {
        /* Re-pack the known fields only: protobuf-c keeps unknown fields verbatim,
         * including ones it would not parse canonically encoded (field number 0 written
         * as an overlong varint), which says nothing about the validator. */
        unsigned n_unknown = m->base.n_unknown_fields;
        m->base.n_unknown_fields = 0;
#if FUZZ_KIND == 1
        unsigned n_unknown_codec = m->codec ? m->codec->base.n_unknown_fields : 0;
        if (m->codec)
            m->codec->base.n_unknown_fields = 0;
#endif
        size_t n = protobuf_c_message_get_packed_size(&m->base);
        uint8_t *re = malloc(n ? n : 1);
        FUZZ_REQUIRE(re != NULL);
        FUZZ_REQUIRE(protobuf_c_message_pack(&m->base, re) == n);
        m->base.n_unknown_fields = n_unknown;
#if FUZZ_KIND == 1
        if (m->codec)
            m->codec->base.n_unknown_fields = n_unknown_codec;
#endif
        msg_t *m3 = NULL;
        FUZZ_REQUIRE(run(re, n, &def, &m3) == TQKV_OK);
        /* The fields that handlers act on survive the round trip. */
        FUZZ_REQUIRE(
            strcmp(m->namespace_ ? m->namespace_ : "", m3->namespace_ ? m3->namespace_ : "") == 0);
#if FUZZ_KIND >= 2 && FUZZ_KIND <= 4
        FUZZ_REQUIRE(m->n_hashes == m3->n_hashes);
        for (size_t i = 0; i < m->n_hashes; i++)
            FUZZ_REQUIRE(m->hashes[i].len == m3->hashes[i].len &&
                         memcmp(m->hashes[i].data, m3->hashes[i].data, m->hashes[i].len) == 0);
#endif
        protobuf_c_message_free_unpacked(&m3->base, NULL);
        free(re);
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    free(buf);
    return 0;
}
