/* reflection.c - server reflection (grpc.reflection.v1 and v1alpha, one handler:
 * the two schemas are identical on the wire) from the API's embedded descriptor
 * set: list_services, file_by_filename, file_containing_symbol; error_response for
 * everything else.
 *
 * The set is split into its files' raw bytes once at start-up (sent as they are)
 * and each file is decoded with protoc-c's descriptor.proto to index its symbols.
 * Read-only after creation: no locks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "kernels/varint.h"
#include "service/log.h"
#include "service/service_internal.h"
#include "transport/wire.h"

extern const unsigned char tqkv_descriptor_set[];
extern const unsigned long tqkv_descriptor_set_len;

typedef struct refl_file {
    const uint8_t *raw; /* borrowed from tqkv_descriptor_set */
    size_t len;
    Google__Protobuf__FileDescriptorProto *fd;
} refl_file_t;

typedef struct refl_symbol {
    char *name; /* fully qualified, no leading dot */
    size_t file;
} refl_symbol_t;

struct tqkv__reflection {
    refl_file_t *files;
    size_t nfiles;
    refl_symbol_t *syms;
    size_t nsyms, capsyms;
    char **services;
    size_t nservices;
};

static int
add_symbol(tqkv__reflection_t *r, const char *pkg, const char *parent, const char *name,
           size_t file)
{
    if (r->nsyms == r->capsyms) {
        size_t cap = r->capsyms ? r->capsyms * 2 : 64;
        refl_symbol_t *n = realloc(r->syms, cap * sizeof *n);
        if (n == NULL)
            return -1;
        r->syms = n;
        r->capsyms = cap;
    }
    const char *pre = parent ? parent : pkg;
    size_t len = strlen(pre) + strlen(name) + 2;
    char *full = malloc(len);
    if (full == NULL)
        return -1;
    snprintf(full, len, "%s%s%s", pre, pre[0] ? "." : "", name);
    r->syms[r->nsyms].name = full;
    r->syms[r->nsyms].file = file;
    r->nsyms++;
    return 0;
}

static int
index_message(tqkv__reflection_t *r, const char *pkg, const char *parent,
              const Google__Protobuf__DescriptorProto *m, size_t file)
{
    if (add_symbol(r, pkg, parent, m->name, file))
        return -1;
    const char *me = r->syms[r->nsyms - 1].name;
    char *self = strdup(me);
    if (self == NULL)
        return -1;
    int rc = 0;
    for (size_t i = 0; i < m->n_nested_type && !rc; i++)
        rc = index_message(r, pkg, self, m->nested_type[i], file);
    for (size_t i = 0; i < m->n_enum_type && !rc; i++)
        rc = add_symbol(r, pkg, self, m->enum_type[i]->name, file);
    for (size_t i = 0; i < m->n_field && !rc; i++)
        rc = add_symbol(r, pkg, self, m->field[i]->name, file);
    free(self);
    return rc;
}

static int
index_file(tqkv__reflection_t *r, size_t fi)
{
    const Google__Protobuf__FileDescriptorProto *f = r->files[fi].fd;
    const char *pkg = f->package ? f->package : "";
    for (size_t i = 0; i < f->n_message_type; i++)
        if (index_message(r, pkg, NULL, f->message_type[i], fi))
            return -1;
    for (size_t i = 0; i < f->n_enum_type; i++)
        if (add_symbol(r, pkg, NULL, f->enum_type[i]->name, fi))
            return -1;
    for (size_t i = 0; i < f->n_service; i++) {
        const Google__Protobuf__ServiceDescriptorProto *sv = f->service[i];
        if (add_symbol(r, pkg, NULL, sv->name, fi))
            return -1;
        char *svc = strdup(r->syms[r->nsyms - 1].name);
        if (svc == NULL)
            return -1;
        char **ns = realloc(r->services, (r->nservices + 1) * sizeof *ns);
        if (ns == NULL) {
            free(svc);
            return -1;
        }
        r->services = ns;
        r->services[r->nservices++] = svc;
        for (size_t j = 0; j < sv->n_method; j++)
            if (add_symbol(r, pkg, svc, sv->method[j]->name, fi))
                return -1;
    }
    return 0;
}

tqkv_status_t
tqkv__reflection_create(tqkv__reflection_t **out, char *err, size_t errlen)
{
    tqkv__reflection_t *r = calloc(1, sizeof *r);
    if (r == NULL)
        return TQKV_ENOMEM;
    /* FileDescriptorSet: repeated FileDescriptorProto file = 1 (tag 0x0a, length). */
    const uint8_t *p = tqkv_descriptor_set, *end = p + tqkv_descriptor_set_len;
    while (p < end) {
        uint64_t tag, len;
        if (tqkv_varint_get(&p, end, &tag) || tag != 0x0a || tqkv_varint_get(&p, end, &len) ||
            len > (uint64_t)(end - p))
            goto bad;
        refl_file_t *nf = realloc(r->files, (r->nfiles + 1) * sizeof *nf);
        if (nf == NULL)
            goto bad;
        r->files = nf;
        refl_file_t *f = &r->files[r->nfiles];
        f->raw = p;
        f->len = (size_t)len;
        f->fd = google__protobuf__file_descriptor_proto__unpack(NULL, f->len, f->raw);
        if (f->fd == NULL)
            goto bad;
        r->nfiles++;
        if (index_file(r, r->nfiles - 1))
            goto bad;
        p += len;
    }
    *out = r;
    return TQKV_OK;
bad:
    snprintf(err, errlen, "reflection: the embedded descriptor set does not decode");
    tqkv__reflection_destroy(r);
    return TQKV_EINTERNAL;
}

void
tqkv__reflection_destroy(tqkv__reflection_t *r)
{
    if (r == NULL)
        return;
    for (size_t i = 0; i < r->nfiles; i++)
        google__protobuf__file_descriptor_proto__free_unpacked(r->files[i].fd, NULL);
    for (size_t i = 0; i < r->nsyms; i++)
        free(r->syms[i].name);
    for (size_t i = 0; i < r->nservices; i++)
        free(r->services[i]);
    free(r->files);
    free(r->syms);
    free(r->services);
    free(r);
}

static long
file_by_name(const tqkv__reflection_t *r, const char *name)
{
    for (size_t i = 0; i < r->nfiles; i++)
        if (strcmp(r->files[i].fd->name, name) == 0)
            return (long)i;
    return -1;
}

static long
file_by_symbol(const tqkv__reflection_t *r, const char *sym)
{
    if (sym[0] == '.')
        sym++;
    for (size_t i = 0; i < r->nsyms; i++)
        if (strcmp(r->syms[i].name, sym) == 0)
            return (long)r->syms[i].file;
    return -1;
}

/* Marks file fi and its dependencies (transitively) in `want`. */
static void
mark_deps(const tqkv__reflection_t *r, size_t fi, int *want)
{
    if (want[fi])
        return;
    want[fi] = 1;
    const Google__Protobuf__FileDescriptorProto *f = r->files[fi].fd;
    for (size_t d = 0; d < f->n_dependency; d++) {
        long j = file_by_name(r, f->dependency[d]);
        if (j >= 0)
            mark_deps(r, (size_t)j, want);
    }
}

/* Builds the response to one request (packed, new byte buffer). */
static grpc_byte_buffer *
answer(const tqkv__reflection_t *r, const Grpc__Reflection__V1alpha__ServerReflectionRequest *q)
{
    Grpc__Reflection__V1alpha__ServerReflectionResponse resp =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__INIT;
    Grpc__Reflection__V1alpha__FileDescriptorResponse fdr =
        GRPC__REFLECTION__V1ALPHA__FILE_DESCRIPTOR_RESPONSE__INIT;
    Grpc__Reflection__V1alpha__ListServiceResponse lsr =
        GRPC__REFLECTION__V1ALPHA__LIST_SERVICE_RESPONSE__INIT;
    Grpc__Reflection__V1alpha__ErrorResponse er = GRPC__REFLECTION__V1ALPHA__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1alpha__ServiceResponse *svc = NULL, **svcp = NULL;
    ProtobufCBinaryData *blobs = NULL;
    int *want = NULL;
    char msg[320];
    long fi = -1;
    grpc_byte_buffer *bb = NULL;

    resp.valid_host = q->host;
    resp.original_request = (Grpc__Reflection__V1alpha__ServerReflectionRequest *)q;
    switch (q->message_request_case) {
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES:
        svc = calloc(r->nservices ? r->nservices : 1, sizeof *svc);
        svcp = calloc(r->nservices ? r->nservices : 1, sizeof *svcp);
        if (svc == NULL || svcp == NULL)
            goto out;
        for (size_t i = 0; i < r->nservices; i++) {
            grpc__reflection__v1alpha__service_response__init(&svc[i]);
            svc[i].name = r->services[i];
            svcp[i] = &svc[i];
        }
        lsr.n_service = r->nservices;
        lsr.service = svcp;
        resp.message_response_case =
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        resp.list_services_response = &lsr;
        break;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        fi = file_by_name(r, q->file_by_filename);
        if (fi < 0)
            snprintf(msg, sizeof msg, "file not found: %.256s", q->file_by_filename);
        break;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL:
        fi = file_by_symbol(r, q->file_containing_symbol);
        if (fi < 0)
            snprintf(msg, sizeof msg, "symbol not found: %.256s", q->file_containing_symbol);
        break;
    default:
        snprintf(msg, sizeof msg, "request kind %d is not supported (no extensions)",
                 (int)q->message_request_case);
        er.error_code = GRPC_STATUS_UNIMPLEMENTED;
        er.error_message = msg;
        resp.message_response_case =
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
        resp.error_response = &er;
        break;
    }
    if (q->message_request_case ==
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME ||
        q->message_request_case ==
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL) {
        if (fi < 0) {
            er.error_code = GRPC_STATUS_NOT_FOUND;
            er.error_message = msg;
            resp.message_response_case =
                GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
            resp.error_response = &er;
        } else {
            want = calloc(r->nfiles, sizeof *want);
            blobs = calloc(r->nfiles, sizeof *blobs);
            if (want == NULL || blobs == NULL)
                goto out;
            mark_deps(r, (size_t)fi, want);
            size_t n = 0;
            blobs[n].data = (uint8_t *)r->files[fi].raw; /* the requested file first */
            blobs[n++].len = r->files[fi].len;
            for (size_t i = 0; i < r->nfiles; i++) {
                if (want[i] && (long)i != fi) {
                    blobs[n].data = (uint8_t *)r->files[i].raw;
                    blobs[n++].len = r->files[i].len;
                }
            }
            fdr.n_file_descriptor_proto = n;
            fdr.file_descriptor_proto = blobs;
            resp.message_response_case =
                GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
            resp.file_descriptor_response = &fdr;
        }
    }
    bb = tqkv_wire_encode(&resp.base);
out:
    free(svc);
    free(svcp);
    free(want);
    free(blobs);
    return bb;
}

static void
refl_start(tqkv__call_t *c)
{
    tqkv__call_recv(c);
}

static void
refl_recv(tqkv__call_t *c, int ok)
{
    if (c->recv_bb == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_OK, NULL, NULL);
        return;
    }
    Grpc__Reflection__V1alpha__ServerReflectionRequest *q =
        (Grpc__Reflection__V1alpha__ServerReflectionRequest *)tqkv_wire_decode(
            &grpc__reflection__v1alpha__server_reflection_request__descriptor, c->recv_bb);
    if (q == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "message: not a valid ServerReflectionRequest", NULL);
        return;
    }
    grpc_byte_buffer *bb = answer(c->srv->refl, q);
    grpc__reflection__v1alpha__server_reflection_request__free_unpacked(q, NULL);
    if (bb == NULL) {
        tqkv__call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        return;
    }
    tqkv__call_send(c, bb);
}

static void
refl_sent(tqkv__call_t *c, int ok)
{
    tqkv__call_recv(c);
}

const tqkv__handler_t tqkv__reflection_handler = {
    .path = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    .metric = "Reflection",
    .payload_on_new = 0,
    .drain = 0,
    .on_start = refl_start,
    .on_recv = refl_recv,
    .on_send = refl_sent,
};
