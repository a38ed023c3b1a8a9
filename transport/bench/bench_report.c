/* bench_report.c - tqkv-bench's reports: the text table on stdout and the --json object.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "kernels/version.h"
#include "transport/bench/tls_pair.h"
#include "transport/bench/tls_report.h"
#include "transport/bench/bench.h"
#include "transport/client.h"

static void
print_pct(FILE *f, const char *name, pct_t p)
{
    fprintf(f, "  %-16s %10zu %10.0f %10.0f %10.0f %10.0f\n", name, p.n, p.p50, p.p95, p.p99,
            p.p999);
}

/* Closes (stdout: flushes) a report file. Returns -1 when any write to it failed. */
int
bench_report_close(FILE *f)
{
    int err = ferror(f);
    if (f == stdout)
        return fflush(f) != 0 || err ? -1 : 0;
    return fclose(f) != 0 || err ? -1 : 0;
}

/* ---- the report ---- */

/* The baselines' rows of the text report. */
static void
print_baselines(FILE *o, const result_t *r)
{
    fprintf(o, "  baselines (same run; raw TCP in %.1f KiB messages, the mean Get message)\n",
            (double)r->wmsg / 1024.0);
    char lbl[64];
    snprintf(lbl, sizeof lbl, "raw TCP loopback GB/s, %d conn%s", C.concurrency,
             C.concurrency == 1 ? "" : "s");
    fprintf(o, "  %-34s %12.3f  (best of 3; one per worker)\n", lbl, r->tcp);
    if (r->wmsg != r->msg)
        fprintf(o, "  %-34s %12.3f\n", "raw TCP, BF16-block messages", r->tcp_block);
    if (r->redis >= 0)
        fprintf(o, "  %-34s %12.3f\n", "Redis GET GB/s", r->redis);
    else
        fprintf(o, "  %-34s %12s\n", "Redis GET GB/s", "n/a");
    if (r->tcp > 0)
        fprintf(o, "  %-34s %12.2f\n", "Get wire / raw TCP", r->wire_gbps / r->tcp);
    if (r->tcp > 0)
        fprintf(o, "  %-34s %12.2f\n", "Get BF16-eq / raw TCP", r->bf16_gbps / r->tcp);
    if (r->redis > 0)
        fprintf(o, "  %-34s %12.2f\n", "Get BF16-eq / Redis", r->bf16_gbps / r->redis);
    if (C.tls_ca) {
        snprintf(lbl, sizeof lbl, "raw TLS loopback GB/s, %d conn%s", C.concurrency,
                 C.concurrency == 1 ? "" : "s");
        fprintf(o, "  %-34s %12.3f  (%s; best of 3)\n", lbl, r->tls,
                r->tls_suite[0] ? r->tls_suite : "TLS pair failed");
        fprintf(o, "  %-34s %12.3f  (openssl speed -evp, 16 KiB, one core)\n",
                "AES-128-GCM cipher GB/s", r->cipher_gbps);
        if (r->tls > 0)
            fprintf(o, "  %-34s %12.2f\n", "Get wire / raw TLS", r->wire_gbps / r->tls);
        if (r->tcp > 0 && r->tls > 0)
            fprintf(o, "  %-34s %12.2f\n", "raw TLS / raw TCP", r->tls / r->tcp);
        tqkv_bench_tls_print(o, r->wire_gbps, r->tls);
    }
}

/* The text report on o (and, on stderr, the targets whose Gets fell back to gRPC). */
void
bench_print_report(FILE *o, tqkv_client_t *cl, const result_t *r)
{
    fprintf(o, "\ntqkv-bench: %zu target(s), %d workers, %.1f s, phase %s, encoding %s\n",
            C.ntargets, C.concurrency, r->elapsed,
            C.phase == PH_PREFILL  ? "prefill"
            : C.phase == PH_DECODE ? "decode"
                                   : "mixed",
            C.encoding == TQKV_CLIENT_PACKED ? "packed" : "bf16");
    fprintf(o,
            "  model: %u layers, %u kv heads, head_dim %u, %u-token blocks (%.2f MiB BF16 "
            "K+V per block-layer), %u blocks/sequence, prefix reuse %.2f\n",
            C.layers, C.heads, C.dim, C.block_tokens, (double)r->msg / 1048576.0, C.seq_blocks,
            C.prefix_reuse);
    fprintf(o, "  %-34s %12s\n", "metric", "value");
    fprintf(o, "  %-34s %12.3f\n", "Get BF16-equivalent GB/s", r->bf16_gbps);
    fprintf(o, "  %-34s %12.3f\n", "Get wire GB/s", r->wire_gbps);
    fprintf(o, "  %-34s %12.0f\n", "Get pages/s", r->pages_s);
    fprintf(o, "  %-34s %12.3f\n", "Put BF16 ingest GB/s", r->put_gbps);
    fprintf(o, "  %-34s %12.3f\n", "Put wire GB/s", r->put_wire_gbps);
    fprintf(o, "  %-34s %12.1f%%\n", "Lookup hit rate", r->hit * 100);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages found", K.get_found);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages missing", K.get_missing);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "CRC checked in libtqkv", K.client_crc);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "pages over TCP data channels", K.dc_pages);
    for (size_t t = 0; C.transport == TQKV_CLIENT_TRANSPORT_TCP && t < C.ntargets; t++) {
        const char *why = tqkv_client_data_channel_status(cl, t);
        if (why[0])
            fprintf(stderr, "tqkv-bench: %s: Gets used gRPC, no TCP data channel: %s\n",
                    C.targets[t], why);
    }
    fprintf(o, "  %-34s %12" PRIu64 "\n", "content checks", K.content_checks);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "verify failures", K.verify_failures);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "errors", K.errors);
    fprintf(o, "  %-34s %12.3f (ended at %.1f s)\n", "longest gap between ops, s", r->max_gap_s,
            r->max_gap_end_s);
    fprintf(o, "  %-34s %12" PRIu64 " (%" PRIu64 " pages from them)\n", "hedged calls",
            r->hs.hedges, r->hs.hedge_pages);
    fprintf(o, "  %-34s %12" PRIu64 "\n", "calls past their size deadline", r->hs.call_timeouts);
    fprintf(o, "  %-34s %12" PRIu64 " (%" PRIu64 " revived)\n", "servers marked down",
            r->health.marked_down, r->health.revived);
    if (r->have_stats)
        fprintf(o, "  %-34s %12.2f\n", "server compression ratio", r->sst.compression_ratio);
    fprintf(o, "  latency (us)     %10s %10s %10s %10s %10s\n", "n", "p50", "p95", "p99", "p99.9");
    print_pct(o, "Put (per block)", r->pp);
    print_pct(o, "Lookup", r->pl);
    print_pct(o, "Get (per call)", r->pgt);
    print_pct(o, "Get first page", r->pf);
    if (C.baselines)
        print_baselines(o, r);
    fflush(o);
}

/* The baselines object of the --json report. */
static void
json_baselines(FILE *j, const result_t *r)
{
    fprintf(j,
            "\"raw_tcp_gbps\": %.6f, \"raw_tcp_msg_bytes\": %zu, "
            "\"raw_tcp_bf16_block_gbps\": %.6f, \"raw_tcp_connections\": %d",
            r->tcp, r->wmsg, r->tcp_block, C.concurrency);
    if (r->redis >= 0)
        fprintf(j, ", \"redis_get_gbps\": %.6f", r->redis);
    fprintf(j, ", \"ratios\": {\"wire_vs_raw_tcp\": %.4f, \"bf16_equiv_vs_raw_tcp\": %.4f",
            r->tcp > 0 ? r->wire_gbps / r->tcp : 0, r->tcp > 0 ? r->bf16_gbps / r->tcp : 0);
    if (r->redis > 0)
        fprintf(j, ", \"bf16_equiv_vs_redis\": %.4f", r->bf16_gbps / r->redis);
    if (C.tls_ca && r->tls > 0)
        fprintf(j, ", \"wire_vs_raw_tls\": %.4f", r->wire_gbps / r->tls);
    fprintf(j, "}");
    if (C.tls_ca)
        fprintf(j,
                ", \"raw_tls_gbps\": %.6f, \"raw_tls_suite\": \"%s\", "
                "\"aes_128_gcm_gbps\": %.6f",
                r->tls, r->tls_suite, r->cipher_gbps);
    if (C.tls_ca)
        tqkv_bench_tls_json(j, r->wire_gbps, r->tls);
}

/* The --json report (a file, or - for stdout). 0, or -1 when it could not be written
 * (said on stderr). */
int
bench_write_json(const result_t *r)
{
    FILE *j = strcmp(C.json, "-") ? fopen(C.json, "w") : stdout;
    if (j == NULL) {
        fprintf(stderr, "tqkv-bench: --json %s: %s\n", C.json, strerror(errno));
        return -1;
    }
    fprintf(j,
            "{\"bf16_equiv_gbps\": %.6f, \"wire_gbps\": %.6f, \"pages_per_s\": %.3f, "
            "\"put_bf16_gbps\": %.6f, \"put_wire_gbps\": %.6f, "
            "\"hit_rate\": %.6f, \"verify_failures\": %" PRIu64 ", \"errors\": %" PRIu64
            ", \"pages_found\": %" PRIu64 ", \"pages_missing\": %" PRIu64
            ", \"content_checks\": %" PRIu64 ", \"client_crc_checked\": %" PRIu64
            ", \"data_channel_pages\": %" PRIu64 ", \"transport\": \"%s\""
            ", \"elapsed_s\": %.3f, \"max_gap_s\": %.3f, \"max_gap_end_s\": %.3f"
            ", \"hedges\": %" PRIu64 ", \"hedge_pages\": %" PRIu64 ", \"call_timeouts\": %" PRIu64
            ", \"marked_down\": %" PRIu64 ", ",
            r->bf16_gbps, r->wire_gbps, r->pages_s, r->put_gbps, r->put_wire_gbps, r->hit,
            K.verify_failures, K.errors, K.get_found, K.get_missing, K.content_checks, K.client_crc,
            K.dc_pages, C.transport == TQKV_CLIENT_TRANSPORT_TCP ? "tcp" : "grpc", r->elapsed,
            r->max_gap_s, r->max_gap_end_s, r->hs.hedges, r->hs.hedge_pages, r->hs.call_timeouts,
            r->health.marked_down);
    fprintf(j, "\"latency_us\": {");
    const char *names[] = {"Put", "Lookup", "Get", "GetFirstPage"};
    pct_t ps[] = {r->pp, r->pl, r->pgt, r->pf};
    for (int i = 0; i < 4; i++)
        fprintf(j,
                "%s\"%s\": {\"p50\": %.0f, \"p95\": %.0f, \"p99\": %.0f, \"p999\": %.0f, "
                "\"n\": %zu}",
                i ? ", " : "", names[i], ps[i].p50, ps[i].p95, ps[i].p99, ps[i].p999, ps[i].n);
    fprintf(j, "}, \"baselines\": {");
    if (C.baselines)
        json_baselines(j, r);
    fprintf(j, "}}\n");
    if (bench_report_close(j) != 0) {
        fprintf(stderr, "tqkv-bench: --json %s: write failed: %s\n", C.json, strerror(errno));
        return -1;
    }
    return 0;
}
