/* tls_report.c - tqkv-bench's TLS report (tls_report.h). */
#define _GNU_SOURCE
#include "transport/bench/tls_report.h"

#include <openssl/evp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "transport/bench/tls_pair.h"
#include "transport/dc_tls.h"

const char tqkv_bench_tls_usage[] =
    "  --plain-wire-gbps G (a TLS run: the plaintext data channel's wire GB/s of a run\n"
    "               beside it; the report then prints the cipher-bound limit)\n";

static struct {
    double plain, aes, pair_ch;
    int cores, measured;
    char path[48], cipher[64];
} R;

int
tqkv_bench_tls_flag(const char *a, const char *v)
{
    if (strcmp(a, "--plain-wire-gbps") != 0)
        return 0;
    char *end;
    double g = v ? strtod(v, &end) : 0;
    if (v == NULL || end == v || *end || !(g > 0)) {
        fprintf(stderr, "tqkv-bench: --plain-wire-gbps: a positive GB/s, not %s\n",
                v ? v : "nothing");
        return -1;
    }
    R.plain = g;
    return 1;
}

/* This thread's CPU time: the cipher's speed per core-second, as `openssl speed`
 * reports it (user time), whatever else the machine runs. */
static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double
tqkv_bench_aes_gcm_gbps(double seconds)
{
    enum { REC = 16384 };
    uint8_t key[16] = {1}, iv[12] = {2}, hdr[5] = {23, 3, 3, 0x40, 0x11}, tag[16], type = 23;
    uint8_t *in = calloc(1, REC), *out = malloc(REC + 1);
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    double best = 0;
    if (in == NULL || out == NULL || c == NULL ||
        EVP_EncryptInit_ex(c, EVP_aes_128_gcm(), NULL, key, NULL) != 1)
        goto out;
    for (int burst = 0; burst < 3; burst++) {
        double t0 = now_s(), t = t0;
        uint64_t bytes = 0;
        int l;
        while (t - t0 < seconds / 3) {
            for (int i = 0; i < 64; i++) {
                iv[11]++;
                if (EVP_EncryptInit_ex(c, NULL, NULL, NULL, iv) != 1 ||
                    EVP_EncryptUpdate(c, NULL, &l, hdr, 5) != 1 ||
                    EVP_EncryptUpdate(c, out, &l, in, REC) != 1 ||
                    EVP_EncryptUpdate(c, out + REC, &l, &type, 1) != 1 ||
                    EVP_EncryptFinal_ex(c, out + REC + 1, &l) != 1 ||
                    EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, 16, tag) != 1)
                    goto out;
                bytes += REC;
            }
            t = now_s();
        }
        double g = (double)bytes / (t - t0) / 1e9;
        if (g > best)
            best = g;
    }
out:
    EVP_CIPHER_CTX_free(c);
    free(in);
    free(out);
    return best;
}

double
tqkv_bench_cipher_bound(double plain_gbps, double aes_gbps, int cores)
{
    if (plain_gbps <= 0 || aes_gbps <= 0 || cores <= 0)
        return 0;
    return 1.0 / (1.0 / plain_gbps + 2.0 / ((double)cores * aes_gbps));
}

void
tqkv_bench_tls_measure(size_t total, size_t msg, const uint8_t *src, size_t src_len, int conns)
{
    for (int rep = 0; rep < 3; rep++) { /* best of 3, as the other pairs */
        char suite[64];
        double g =
            tqkv_bench_tls_pair_channel_layer(total, msg, src, src_len, conns, suite, sizeof suite);
        if (g > R.pair_ch)
            R.pair_ch = g;
    }
    cpu_set_t cs;
    R.cores = sched_getaffinity(0, sizeof cs, &cs) == 0 ? CPU_COUNT(&cs)
                                                        : (int)sysconf(_SC_NPROCESSORS_ONLN);
    R.aes = tqkv_bench_aes_gcm_gbps(1.0);
    tqkv__dctls_client_last(R.path, sizeof R.path, R.cipher, sizeof R.cipher);
    R.measured = 1;
}

void
tqkv_bench_tls_print(FILE *o, double wire_gbps, double raw_tls_gbps)
{
    if (!R.measured)
        return;
    fprintf(o, "  %-34s %12s  (%s)\n", "data channel TLS path", R.path[0] ? R.path : "none",
            R.cipher[0] ? R.cipher : "no TLS data channel was opened");
    fprintf(o, "  %-34s %12.3f  (best of 3; the channels' record layer)\n",
            "raw TLS pair, channel records", R.pair_ch);
    fprintf(o, "  %-34s %12.3f  (in-process EVP, 16 KiB records, per CPU-second)\n",
            "AES-128-GCM GB/s, one core", R.aes);
    double lim = tqkv_bench_cipher_bound(R.plain, R.aes, R.cores);
    if (lim > 0) {
        fprintf(o, "  %-34s %12.3f  (1/(1/plain + 2/(%d x AES)), plain %.3f)\n",
                "cipher-bound limit GB/s", lim, R.cores, R.plain);
        fprintf(o, "  %-34s %12.2f\n", "Get wire / cipher-bound limit", wire_gbps / lim);
        fprintf(o, "  %-34s %12.2f\n", "Get wire / plaintext channel", wire_gbps / R.plain);
    } else {
        fprintf(o, "  %-34s %12s  (give --plain-wire-gbps from a plaintext run)\n",
                "cipher-bound limit GB/s", "n/a");
    }
    if (raw_tls_gbps > 0)
        fprintf(o, "  %-34s %12.2f\n", "Get wire / raw TLS pair", wire_gbps / raw_tls_gbps);
    if (R.pair_ch > 0)
        fprintf(o, "  %-34s %12.2f\n", "Get wire / pair, channel records", wire_gbps / R.pair_ch);
}

void
tqkv_bench_tls_json(FILE *j, double wire_gbps, double raw_tls_gbps)
{
    if (!R.measured)
        return;
    double lim = tqkv_bench_cipher_bound(R.plain, R.aes, R.cores);
    fprintf(j,
            ", \"tls\": {\"path\": \"%s\", \"cipher\": \"%s\", \"aes_128_gcm_evp_gbps\": %.6f, "
            "\"cores\": %d, \"plain_wire_gbps\": %.6f, \"cipher_bound_gbps\": %.6f, "
            "\"wire_vs_cipher_bound\": %.4f, \"wire_vs_raw_tls\": %.4f, "
            "\"raw_tls_channel_records_gbps\": %.6f}",
            R.path, R.cipher, R.aes, R.cores, R.plain, lim, lim > 0 ? wire_gbps / lim : 0,
            raw_tls_gbps > 0 ? wire_gbps / raw_tls_gbps : 0, R.pair_ch);
}
