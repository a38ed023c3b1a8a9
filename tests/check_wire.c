/* check_wire.c - the definitions the server and libtqkv share on the wire:
 * the GetResponse field table of transport/wire.h against protobuf-c's descriptor, and
 * the status table of transport/status_grpc.h, every status and code both ways (the
 * server's tqkv_status_to_grpc and the client's reading of a call's code). */
#include <check.h>
#include <string.h>

#include "service/status_map.h"
#include "tests/check_main.h"
#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/status_grpc.h"
#include "transport/wire.h"

static unsigned
wire_type_of(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_BYTES:
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return TQKV_WIRE_LEN;
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return TQKV_WIRE_I64;
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
        return TQKV_WIRE_I32;
    default:
        return TQKV_WIRE_VARINT;
    }
}

START_TEST(test_get_response_fields_match_descriptor)
{
    const ProtobufCMessageDescriptor *d = &tqkv__v1__get_response__descriptor;
    unsigned n = 0;
#define CHECK_FIELD(N, fname, num, wt)                                                             \
    do {                                                                                           \
        const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, num);       \
        ck_assert_msg(f != NULL, "GetResponse has no field %u (%s)", (unsigned)(num), #fname);     \
        ck_assert_str_eq(f->name, #fname);                                                         \
        ck_assert_int_eq(f->label, PROTOBUF_C_LABEL_NONE); /* proto3 singular */                   \
        ck_assert_uint_eq(wire_type_of(f->type), TQKV_WIRE_##wt);                                  \
        ck_assert_uint_eq(TQKV_GET_F_##N, f->id);                                                  \
        ck_assert_uint_eq(TQKV_GET_TAG_##N, (f->id << 3) | wire_type_of(f->type));                 \
        ck_assert_uint_lt(TQKV_GET_TAG_##N, 0x80); /* written as one byte */                       \
        n++;                                                                                       \
    } while (0);
    TQKV_GET_RESPONSE_FIELDS(CHECK_FIELD)
#undef CHECK_FIELD
    /* Every field of the message is in the table. */
    ck_assert_uint_eq(n, d->n_fields);
}
END_TEST

/* The mapping as specified (design: status codes), one row per status / code. */
static const grpc_status_code want_to[TQKV_STATUS_COUNT] = {
    [TQKV_OK] = GRPC_STATUS_OK,
    [TQKV_EINVAL] = GRPC_STATUS_INVALID_ARGUMENT,
    [TQKV_ENOMEM] = GRPC_STATUS_RESOURCE_EXHAUSTED,
    [TQKV_ENOSPC] = GRPC_STATUS_RESOURCE_EXHAUSTED,
    [TQKV_EBUSY] = GRPC_STATUS_RESOURCE_EXHAUSTED,
    [TQKV_ENOTFOUND] = GRPC_STATUS_NOT_FOUND,
    [TQKV_ECORRUPT] = GRPC_STATUS_DATA_LOSS,
    [TQKV_EFORMAT] = GRPC_STATUS_INVALID_ARGUMENT,
    [TQKV_EUNSUPPORTED] = GRPC_STATUS_INVALID_ARGUMENT,
    [TQKV_ERANGE] = GRPC_STATUS_INVALID_ARGUMENT,
    [TQKV_EIO] = GRPC_STATUS_INTERNAL,
    [TQKV_ECUDA] = GRPC_STATUS_INTERNAL,
    [TQKV_ENCCL] = GRPC_STATUS_INTERNAL,
    [TQKV_ENODEV] = GRPC_STATUS_UNAVAILABLE,
    [TQKV_EPERM] = GRPC_STATUS_PERMISSION_DENIED,
    [TQKV_EAUTH] = GRPC_STATUS_UNAUTHENTICATED,
    [TQKV_ETIMEDOUT] = GRPC_STATUS_DEADLINE_EXCEEDED,
    [TQKV_ECANCELED] = GRPC_STATUS_CANCELLED,
    [TQKV_EUNAVAILABLE] = GRPC_STATUS_UNAVAILABLE,
    [TQKV_EINTERNAL] = GRPC_STATUS_INTERNAL,
};

static const tqkv_status_t want_from[GRPC_STATUS_UNAUTHENTICATED + 1] = {
    [GRPC_STATUS_OK] = TQKV_OK,
    [GRPC_STATUS_CANCELLED] = TQKV_ECANCELED,
    [GRPC_STATUS_UNKNOWN] = TQKV_EINTERNAL,
    [GRPC_STATUS_INVALID_ARGUMENT] = TQKV_EINVAL,
    [GRPC_STATUS_DEADLINE_EXCEEDED] = TQKV_ETIMEDOUT,
    [GRPC_STATUS_NOT_FOUND] = TQKV_ENOTFOUND,
    [GRPC_STATUS_ALREADY_EXISTS] = TQKV_EINTERNAL,
    [GRPC_STATUS_PERMISSION_DENIED] = TQKV_EPERM,
    [GRPC_STATUS_RESOURCE_EXHAUSTED] = TQKV_ENOSPC,
    [GRPC_STATUS_FAILED_PRECONDITION] = TQKV_EINVAL,
    [GRPC_STATUS_ABORTED] = TQKV_EINTERNAL,
    [GRPC_STATUS_OUT_OF_RANGE] = TQKV_EINVAL,
    [GRPC_STATUS_UNIMPLEMENTED] = TQKV_EUNSUPPORTED,
    [GRPC_STATUS_INTERNAL] = TQKV_EINTERNAL,
    [GRPC_STATUS_UNAVAILABLE] = TQKV_EUNAVAILABLE,
    [GRPC_STATUS_DATA_LOSS] = TQKV_ECORRUPT,
    [GRPC_STATUS_UNAUTHENTICATED] = TQKV_EAUTH,
};

START_TEST(test_every_status_both_ways)
{
    ck_assert_int_eq(TQKV_STATUS_COUNT, 20); /* a new status needs a row above */
    for (int i = 0; i < TQKV_STATUS_COUNT; i++) {
        tqkv_status_t st = (tqkv_status_t)i;
        grpc_status_code g = tqkv_status_to_grpc(st);
        ck_assert_msg(g == want_to[i], "%s -> gRPC %d, want %d", tqkv_status_name(st), (int)g,
                      (int)want_to[i]);
        ck_assert_int_eq(tqkv__status_to_grpc_code(st), g);
        /* What the client reads back is a status the server sends the same way. */
        tqkv_status_t back = tqkv__status_from_grpc_code(g);
        ck_assert_msg(tqkv_status_to_grpc(back) == g, "%s -> %d -> %s -> %d", tqkv_status_name(st),
                      (int)g, tqkv_status_name(back), (int)tqkv_status_to_grpc(back));
        /* Statuses the server sends on their own code come back unchanged. */
        if (g != GRPC_STATUS_INTERNAL && g != GRPC_STATUS_INVALID_ARGUMENT &&
            g != GRPC_STATUS_RESOURCE_EXHAUSTED && g != GRPC_STATUS_UNAVAILABLE)
            ck_assert_msg(back == st, "%s comes back as %s", tqkv_status_name(st),
                          tqkv_status_name(back));
    }
    for (int c = 0; c <= GRPC_STATUS_UNAUTHENTICATED; c++) {
        tqkv_status_t st = tqkv__status_from_grpc_code((grpc_status_code)c);
        ck_assert_msg(st == want_from[c], "gRPC %d -> %s, want %s", c, tqkv_status_name(st),
                      tqkv_status_name(want_from[c]));
    }
    ck_assert_int_eq(tqkv__status_from_grpc_code((grpc_status_code)99), TQKV_EINTERNAL);
    ck_assert_int_eq(tqkv__status_to_grpc_code(TQKV_STATUS_COUNT), GRPC_STATUS_INTERNAL);
    /* Input validation: a corrupt page from the client is the client's argument. */
    ck_assert_int_eq(tqkv_status_to_grpc_input(TQKV_ECORRUPT), GRPC_STATUS_INVALID_ARGUMENT);
    ck_assert_int_eq(tqkv_status_to_grpc_input(TQKV_ENOSPC), GRPC_STATUS_RESOURCE_EXHAUSTED);
}
END_TEST

static Suite *
wire_suite(void)
{
    Suite *s = suite_create("wire");
    TCase *tc = tcase_create("wire");
    tcase_add_test(tc, test_get_response_fields_match_descriptor);
    tcase_add_test(tc, test_every_status_both_ways);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(wire_suite)
