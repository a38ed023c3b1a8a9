/* tls_report.h - tqkv-bench's TLS report: which record path and cipher the data
 * channels used, the cipher's one-core speed measured in-process (the record layer's
 * own EVP calls on 16 KiB records), and the cipher-bound limit of a TLS data channel:
 *
 *     limit = 1 / (1/plain + 2/(C x AES))
 *
 * plain: the plaintext data channel's wire GB/s (--plain-wire-gbps, from a plaintext
 * run of the bench beside this one), C: the CPUs this process may use, AES: one
 * core's AES-128-GCM GB/s. Per byte, TLS adds one encryption and one decryption to
 * what the plaintext channel does, each at one core's cipher speed, spread over C
 * cores. */
#ifndef TQKV_BENCH_TLS_REPORT_H
#define TQKV_BENCH_TLS_REPORT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The report's flag: "--plain-wire-gbps G". Returns 1 when a was it (v taken), 0 when
 * not, -1 for a bad value (message printed). */
int tqkv_bench_tls_flag(const char *a, const char *v);

/* "  --plain-wire-gbps G ..." for the usage text. */
extern const char tqkv_bench_tls_usage[];

/* Measures the cipher in-process (about 1 s of CPU), the raw TLS pair again with the
 * channels' own record layer (best of 3; the arguments of tqkv_bench_tls_pair), and
 * reads the data channels' path and cipher. Call after the run, beside the raw pairs. */
void tqkv_bench_tls_measure(size_t total, size_t msg, const uint8_t *src, size_t src_len,
                            int conns);

/* The report lines (text) for a run that moved wire_gbps over TLS data channels, with
 * the raw TLS pair at raw_tls_gbps (<= 0: not measured). */
void tqkv_bench_tls_print(FILE *o, double wire_gbps, double raw_tls_gbps);

/* The same as JSON members: ", \"tls\": {...}" (to go inside an object). */
void tqkv_bench_tls_json(FILE *j, double wire_gbps, double raw_tls_gbps);

/* limit = 1 / (1/plain + 2/(cores x aes)); 0 when an input is <= 0. */
double tqkv_bench_cipher_bound(double plain_gbps, double aes_gbps, int cores);

/* One core's AES-128-GCM GB/s over 16 KiB TLS records (in-process EVP, the record
 * layer's calls) per second of this thread's CPU time (as `openssl speed` divides by
 * user time), best of three bursts of seconds/3. */
double tqkv_bench_aes_gcm_gbps(double seconds);

#endif
