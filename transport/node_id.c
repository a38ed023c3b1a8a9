/* node_id.c - one unary Stats(identity_only) call on a private completion queue. */
#include "transport/node_id.h"

#include <stdio.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "tqkv/v1/kvcache.pb-c.h"
#include "transport/wire.h"

int
tqkv__node_id_query(grpc_channel *ch, const grpc_metadata *md, size_t nmd, uint32_t timeout_ms,
                    char *out, size_t cap, char *why, size_t whylen)
{
    int rc = -1;
    if (cap)
        out[0] = '\0';
    Tqkv__V1__StatsRequest req = TQKV__V1__STATS_REQUEST__INIT;
    req.identity_only = 1;
    grpc_byte_buffer *send = tqkv_wire_encode(&req.base);
    if (send == NULL) {
        snprintf(why, whylen, "out of memory");
        return -1;
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec dl =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_call *call = grpc_channel_create_call(
        ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
        grpc_slice_from_static_string("/tqkv.v1.KVCache/Stats"), NULL, dl, NULL);
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_byte_buffer *recv = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    if (call == NULL) {
        snprintf(why, whylen, "cannot create the call");
        goto out;
    }
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = nmd;
    ops[0].data.send_initial_metadata.metadata = (grpc_metadata *)md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    static const int tag;
    if (grpc_call_start_batch(call, ops, 6, (void *)&tag, NULL) != GRPC_CALL_OK) {
        snprintf(why, whylen, "cannot start the call");
        grpc_call_cancel(call, NULL);
        goto out;
    }
    grpc_event ev =
        grpc_completion_queue_pluck(cq, (void *)&tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type != GRPC_OP_COMPLETE || status != GRPC_STATUS_OK) {
        char *d = grpc_slice_to_c_string(details);
        snprintf(why, whylen, "Stats: status %d: %s", (int)status, d ? d : "");
        gpr_free(d);
        goto out;
    }
    Tqkv__V1__StatsResponse *r = recv ? (Tqkv__V1__StatsResponse *)tqkv_wire_decode(
                                            &tqkv__v1__stats_response__descriptor, recv)
                                      : NULL;
    if (r == NULL) {
        snprintf(why, whylen, "Stats: malformed response");
        goto out;
    }
    if (r->node_id && strlen(r->node_id) < cap) {
        memcpy(out, r->node_id, strlen(r->node_id) + 1);
        rc = 0;
    } else if (r->node_id) {
        snprintf(why, whylen, "node id longer than %zu bytes", cap ? cap - 1 : 0);
    } else {
        rc = 0;
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
out:
    if (recv)
        grpc_byte_buffer_destroy(recv);
    grpc_byte_buffer_destroy(send);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    if (call)
        grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    return rc;
}
