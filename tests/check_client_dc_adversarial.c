/* check_client_dc_adversarial.c - libtqkv's TCP data channel client against a broken or
 * malicious server (label server): tests/interop/fake_dc_server.py, one process per
 * scenario, speaks the gRPC side (OpenChannel, Get) and the raw TCP side (hello/ack,
 * frames) and gets one thing wrong on purpose: refused, garbage or missing acks, bad
 * OpenChannel answers, frames with a wrong magic, index, layer, length or flag, pages
 * whose CRC32C or length is wrong, truncated or stalled frames, sockets closed early,
 * statuses that contradict the frames, bytes after the last frame, a gRPC message on a
 * TCP Get's stream.
 *
 * Whatever the server does, a Get must: not crash (ASan/UBSan builds run this too);
 * return within its deadline plus a margin; deliver no page that is not the server's
 * one valid page with crc_checked == 1 (each is also checked with tqkv_page_validate);
 * deliver no (hash, layer) twice; fail with a message naming the problem, or fall back
 * to gRPC (proto/DATA_CHANNEL.md: a target whose channel cannot be set up is served
 * over gRPC, the reason in tqkv_client_data_channel_status). A second Get on the same
 * client must then be clean too.
 *
 * Env: FAKE_DC_SERVER (the script), PYTHON (default /usr/bin/python3).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/page.h"
#include "tests/check_main.h"
#include "transport/client.h"

enum { NH = 3, L = 2, DEADLINE_MS = 3000, MARGIN_MS = 1500 };

static tqkv_hash_t HS[NH];
static int FORMAT_BAD; /* the fake sends pages of an unknown version (with a valid CRC) */
static uint8_t *PAGE;  /* the fake server's one page */
static size_t PAGE_LEN;
static char PAGE_PATH[64];

typedef struct fake {
    pid_t pid;
    char addr[64];
    int out; /* the fake's stdout (non-blocking): its later lines say what it did */
} fake_t;

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Starts the fake server for scenario sc; reads its "listening on" line. */
static void
fake_start(fake_t *f, const char *sc)
{
    if (getenv("TQKV_TEST_VERBOSE"))
        fprintf(stderr, "%s\n", sc);
    const char *script = getenv("FAKE_DC_SERVER");
    const char *py = getenv("PYTHON") ? getenv("PYTHON") : "/usr/bin/python3";
    int pfd[2];
    ck_assert_msg(script && access(script, R_OK) == 0, "FAKE_DC_SERVER not set or unreadable");
    ck_assert_int_eq(pipe(pfd), 0);
    memset(f, 0, sizeof *f);
    f->pid = fork();
    ck_assert_int_ge(f->pid, 0);
    if (f->pid == 0) {
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        execl(py, py, script, sc, PAGE_PATH, (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    char line[256];
    size_t len = 0;
    double t0 = now_s();
    fcntl(pfd[0], F_SETFL, O_NONBLOCK);
    while (now_s() - t0 < 30 && len < sizeof line - 1) {
        ssize_t r = read(pfd[0], line + len, sizeof line - 1 - len);
        if (r == 0)
            break;
        if (r < 0) {
            ck_assert_int_eq(errno, EAGAIN);
            usleep(5000);
            continue;
        }
        len += (size_t)r;
        line[len] = '\0';
        char *p = strstr(line, "listening on ");
        if (p && strchr(p, '\n')) {
            p += strlen("listening on ");
            p[strcspn(p, "\r\n")] = '\0';
            snprintf(f->addr, sizeof f->addr, "%s", p);
            f->out = pfd[0];
            return;
        }
    }
    kill(f->pid, SIGKILL);
    waitpid(f->pid, NULL, 0);
    ck_abort_msg("fake_dc_server.py %s did not start", sc);
}

static void
fake_stop(fake_t *f)
{
    kill(f->pid, SIGKILL);
    waitpid(f->pid, NULL, 0);
    close(f->out);
}

/* Waits (poll on the fake's stdout, up to 30 s) until it prints a line containing
 * needle: the event that it did what the line says. 1 when seen, 0 otherwise. */
static int
fake_said(fake_t *f, const char *needle)
{
    char text[1024];
    size_t len = 0;
    double t0 = now_s();
    while (now_s() - t0 < 30 && len < sizeof text - 1) {
        struct pollfd pf = {.fd = f->out, .events = POLLIN};
        if (poll(&pf, 1, 1000) <= 0)
            continue;
        ssize_t r = read(f->out, text + len, sizeof text - 1 - len);
        if (r == 0)
            return 0;
        if (r < 0)
            continue; /* EAGAIN: poll again */
        len += (size_t)r;
        text[len] = '\0';
        if (strstr(text, needle))
            return 1;
    }
    return 0;
}

/* Every callback, judged. */
typedef struct seen {
    size_t calls, found, via_dc, via_grpc, bad;
    uint8_t got[NH * L];
    char why[200];
} seen_t;

static int
on_page(void *arg, const tqkv_get_page_t *pg)
{
    seen_t *s = arg;
    s->calls++;
    if (pg->hash_index >= NH || pg->layer >= L || s->got[pg->hash_index * L + pg->layer]++) {
        s->bad++;
        snprintf(s->why, sizeof s->why, "hash %zu layer %u out of range or twice", pg->hash_index,
                 pg->layer);
        return 0;
    }
    if (!pg->found)
        return 0;
    s->found++;
    s->via_dc += pg->data_channel == 1;
    s->via_grpc += pg->data_channel == 0;
    char err[160] = "";
    if (FORMAT_BAD) {
        /* delivered as sent (the CRC matches); the consumer's decode refuses it */
        if (pg->crc_checked != 1 || pg->page_len != PAGE_LEN ||
            memcmp((const uint8_t *)pg->page + 16, PAGE + 16, PAGE_LEN - 16) != 0 ||
            tqkv_client_decode_page(pg->page, pg->page_len, NULL, NULL, NULL) != TQKV_EFORMAT) {
            s->bad++;
            snprintf(s->why, sizeof s->why, "hash %zu layer %u: crc_checked %d, not as sent",
                     pg->hash_index, pg->layer, pg->crc_checked);
        }
        return 0;
    }
    if (pg->crc_checked != 1 || pg->page == NULL || pg->page_len != PAGE_LEN ||
        tqkv_page_validate(pg->page, pg->page_len, 1, NULL, err, sizeof err) != TQKV_OK ||
        memcmp(pg->page, PAGE, PAGE_LEN) != 0 || ((uintptr_t)pg->page & 63) != 0) {
        s->bad++;
        snprintf(s->why, sizeof s->why, "hash %zu layer %u: crc_checked %d, %zu bytes, %s",
                 pg->hash_index, pg->layer, pg->crc_checked, pg->page_len, err);
    }
    return 0;
}

static tqkv_client_t *
client(const fake_t *f, size_t max_msg)
{
    const char *t[1] = {f->addr};
    tqkv_client_opts_t o = {.targets = t,
                            .num_targets = 1,
                            .deadline_ms = DEADLINE_MS,
                            .max_message_bytes = max_msg,
                            .wait_for_ready = 1,
                            .transport = TQKV_CLIENT_TRANSPORT_TCP};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    return c;
}

/* One Get of NH hashes x L layers; checks the callbacks and the time taken. */
static tqkv_status_t
get(tqkv_client_t *c, seen_t *s, char *msg, size_t msglen)
{
    tqkv_get_req_t q = {.ns = "adv",
                        .hashes = HS,
                        .num_hashes = NH,
                        .layer_begin = 0,
                        .layer_end = L,
                        .encoding = TQKV_CLIENT_PACKED};
    memset(s, 0, sizeof *s);
    double t0 = now_s();
    tqkv_status_t st = tqkv_client_get(c, &q, on_page, s);
    double dt = now_s() - t0;
    snprintf(msg, msglen, "%s", st == TQKV_OK ? "" : tqkv_client_last_error()->message);
    if (getenv("TQKV_TEST_VERBOSE"))
        fprintf(stderr, "  get: status %d in %.2f s, %zu calls (%zu dc, %zu grpc): %s\n", (int)st,
                dt, s->calls, s->via_dc, s->via_grpc, msg);
    ck_assert_msg(s->bad == 0, "wrong page delivered: %s", s->why);
    ck_assert_msg(dt * 1000 < DEADLINE_MS + MARGIN_MS, "get took %.2f s (deadline %.1f s): %s", dt,
                  DEADLINE_MS / 1000.0, msg);
    if (st == TQKV_OK)
        ck_assert_msg(s->calls == NH * L && s->found == NH * L, "OK with %zu calls, %zu found",
                      s->calls, s->found);
    return st;
}

/* Second Get on the same client, after the scenario's damage: a clean result (every
 * page valid) or an error; never a wrong page (checked in get). */
static void
again(tqkv_client_t *c)
{
    seen_t s;
    char msg[512];
    tqkv_status_t st = get(c, &s, msg, sizeof msg);
    if (st != TQKV_OK)
        ck_assert_msg(msg[0] != '\0', "error %d without a message", (int)st);
}

/* Scenario sc must fail: status want (or any error with want < 0) whose message has
 * needle; pages before the failure (if any) must be valid. */
static void
expect_error(const char *sc, int want, const char *needle, size_t max_msg)
{
    fake_t f;
    fake_start(&f, sc);
    tqkv_client_t *c = client(&f, max_msg);
    seen_t s;
    char msg[512];
    tqkv_status_t st = get(c, &s, msg, sizeof msg);
    ck_assert_msg(st != TQKV_OK, "%s: Get succeeded", sc);
    if (want >= 0)
        ck_assert_msg((int)st == want, "%s: status %d (want %d): %s", sc, (int)st, want, msg);
    ck_assert_msg(strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", sc, msg, needle);
    again(c);
    tqkv_client_destroy(c);
    fake_stop(&f);
}

/* Scenario sc's channel cannot be set up: the Get falls back to gRPC and succeeds; the
 * reason (with needle) is in tqkv_client_data_channel_status. */
static void
expect_fallback(const char *sc, const char *needle)
{
    fake_t f;
    fake_start(&f, sc);
    tqkv_client_t *c = client(&f, 0);
    seen_t s;
    char msg[512];
    tqkv_status_t st = get(c, &s, msg, sizeof msg);
    ck_assert_msg(st == TQKV_OK, "%s: %s", sc, msg);
    ck_assert_uint_eq(s.via_dc, 0);
    ck_assert_uint_eq(s.via_grpc, NH * L);
    const char *why = tqkv_client_data_channel_status(c, 0);
    ck_assert_msg(strstr(why, needle) != NULL, "%s: channel status \"%s\" lacks \"%s\"", sc, why,
                  needle);
    again(c);
    tqkv_client_destroy(c);
    fake_stop(&f);
}

static void
setup(void)
{
    uint64_t seed = tqkv_test_seed();
    for (size_t i = 0; i < NH; i++) {
        HS[i].len = 16;
        for (size_t j = 0; j < 16; j++)
            HS[i].bytes[j] = (uint8_t)((seed >> (j % 8 * 8)) + i * 31 + j);
    }
    tqkv_block_shape_t sh = {16, 2, 64};
    tqkv_block_codec_t cd = {
        .k = {4, TQKV_MODE_MSE, 0}, .v = {4, TQKV_MODE_MSE, 0}, .rotation = 1, .seed = seed | 1};
    ck_assert_int_eq(tqkv_page_size(&sh, &cd, &PAGE_LEN), TQKV_OK);
    size_t n = (size_t)sh.num_tokens * sh.num_kv_heads * sh.head_dim;
    uint16_t *kv = malloc(n * 2);
    for (size_t i = 0; i < n; i++) /* bf16 of small values of both signs */
        kv[i] = (uint16_t)(0x3c00u + (i * 7919u) % 0x300u) | (uint16_t)((i & 1u) << 15);
    PAGE = aligned_alloc(64, (PAGE_LEN + 63) / 64 * 64);
    char err[160];
    ck_assert_msg(tqkv_page_encode_ref(&sh, &cd, kv, kv, PAGE, PAGE_LEN, NULL, err, sizeof err) ==
                      TQKV_OK,
                  "encode: %s", err);
    free(kv);
    snprintf(PAGE_PATH, sizeof PAGE_PATH, "/tmp/tqkv-fakedc-%d.page", (int)getpid());
    FILE *fp = fopen(PAGE_PATH, "wb");
    ck_assert_ptr_nonnull(fp);
    ck_assert_uint_eq(fwrite(PAGE, 1, PAGE_LEN, fp), PAGE_LEN);
    fclose(fp);
}

static void
teardown(void)
{
    unlink(PAGE_PATH);
    free(PAGE);
}

/* The fake server itself: done right, every page comes over the channel. */
START_TEST(dca_fake_server_ok)
{
    fake_t f;
    fake_start(&f, "ok");
    tqkv_client_t *c = client(&f, 0);
    seen_t s;
    char msg[512];
    ck_assert_msg(get(c, &s, msg, sizeof msg) == TQKV_OK, "%s", msg);
    ck_assert_uint_eq(s.via_dc, NH * L);
    ck_assert_str_eq(tqkv_client_data_channel_status(c, 0), "");
    ck_assert_msg(get(c, &s, msg, sizeof msg) == TQKV_OK, "%s", msg);
    ck_assert_uint_eq(s.via_dc, NH * L);
    tqkv_client_destroy(c);
    fake_stop(&f);
}
END_TEST

START_TEST(dca_ack_refused)
{
    expect_fallback("ack_refused", "unknown channel or wrong secret");
}
END_TEST

START_TEST(dca_ack_garbage)
{
    expect_fallback("ack_garbage", "not a tqkv data channel");
}
END_TEST

START_TEST(dca_ack_close)
{
    expect_fallback("ack_close", "connection closed");
}
END_TEST

START_TEST(dca_open_bad_secret)
{
    expect_fallback("open_bad_secret", "malformed answer");
}
END_TEST

/* No ack (or no OpenChannel answer) at all: the set-up may not eat the Get's deadline;
 * the Get still falls back to gRPC in time. */
START_TEST(dca_ack_never)
{
    expect_fallback("ack_never", "hello");
}
END_TEST

START_TEST(dca_open_hang)
{
    expect_fallback("open_hang", "OpenChannel");
}
END_TEST

START_TEST(dca_frame_magic)
{
    expect_error("frame_magic", TQKV_EUNAVAILABLE, "not a frame header", 0);
}
END_TEST

START_TEST(dca_index_order)
{
    expect_error("index_order", TQKV_EUNAVAILABLE, "frame 1 (layer 0, flags 0x1) where frame 0 (",
                 0);
}
END_TEST

START_TEST(dca_index_skip)
{
    expect_error("index_skip", TQKV_EUNAVAILABLE, "frame 2 (layer 0, flags 0x1) where frame 1 (",
                 0);
}
END_TEST

START_TEST(dca_index_huge)
{
    expect_error("zero_hashes_frame", TQKV_EUNAVAILABLE,
                 "frame 4294967295 (layer 0, flags 0x1) where frame 0 (", 0);
}
END_TEST

START_TEST(dca_layer_mismatch)
{
    expect_error("layer_mismatch", TQKV_EUNAVAILABLE,
                 "frame 0 (layer 7, flags 0x1) where frame 0 (layer 0,", 0);
}
END_TEST

START_TEST(dca_page_short)
{
    expect_error("page_short", TQKV_EUNAVAILABLE, "page of 64 bytes (a found page is 128", 0);
}
END_TEST

START_TEST(dca_page_huge)
{
    expect_error("page_huge", TQKV_EUNAVAILABLE, "max_message_bytes", 1u << 20);
}
END_TEST

START_TEST(dca_missing_with_len)
{
    expect_error("missing_with_len", TQKV_EUNAVAILABLE, "missing block", 0);
}
END_TEST

START_TEST(dca_flag_bits)
{
    expect_error("flag_bits", TQKV_EUNAVAILABLE, "flags 0x3", 0);
}
END_TEST

/* A page whose CRC32C (or length) is wrong is never delivered: TQKV_ECORRUPT. */
START_TEST(dca_bad_crc)
{
    expect_error("bad_crc", TQKV_ECORRUPT, "CRC32C", 0);
}
END_TEST

START_TEST(dca_len_longer)
{
    expect_error("len_longer", TQKV_ECORRUPT, "CRC32C", 0);
}
END_TEST

START_TEST(dca_len_shorter)
{
    expect_error("len_shorter", TQKV_ECORRUPT, "CRC32C", 0);
}
END_TEST

START_TEST(dca_truncated_header)
{
    expect_error("truncated_header", TQKV_EUNAVAILABLE, "connection closed by the server", 0);
}
END_TEST

START_TEST(dca_truncated_page)
{
    expect_error("truncated_page", TQKV_EUNAVAILABLE, "reading page 0", 0);
}
END_TEST

START_TEST(dca_close_before_frames)
{
    expect_error("close_before_frames", TQKV_EUNAVAILABLE, "reading frame 0", 0);
}
END_TEST

/* The socket closed and no status: the Get waits for the status (which would say why
 * the server closed it) only until its deadline. */
START_TEST(dca_close_then_hang)
{
    expect_error("close_then_hang", TQKV_ETIMEDOUT, "data channel closed first: reading frame 0",
                 0);
}
END_TEST

/* Status OK with every frame still due and the socket open: the frames could still be
 * in flight, so the client waits, but only until its deadline. */
START_TEST(dca_status_ok_no_frames)
{
    expect_error("status_ok_no_frames", TQKV_ETIMEDOUT, "frames still due", 0);
}
END_TEST

START_TEST(dca_status_error_after_frames)
{
    expect_error("status_error_after_frames", -1, "out of pinned memory", 0);
}
END_TEST

START_TEST(dca_hang)
{
    expect_error("hang", TQKV_ETIMEDOUT, "", 0);
}
END_TEST

START_TEST(dca_trickle)
{
    expect_error("trickle", TQKV_ETIMEDOUT, "reading frame 0", 0);
}
END_TEST

START_TEST(dca_tier_huge)
{
    fake_t f;
    fake_start(&f, "tier_huge");
    tqkv_client_t *c = client(&f, 0);
    seen_t s;
    char msg[512];
    tqkv_status_t st = get(c, &s, msg, sizeof msg);
    (void)st; /* the tier is informational: delivered as is, or refused; never a crash */
    again(c);
    tqkv_client_destroy(c);
    fake_stop(&f);
}
END_TEST

/* Bytes after the last frame: the first Get is whole; the channel must not hand them
 * to the next Get as its frames. settled = 0: the next Gets run at once (the stray bytes
 * may come in during one: it succeeds or fails with a message); settled = 1: they run
 * after the stray bytes are in the client's socket and must all succeed. extra_bytes and
 * extra_frame send them before the Get's status; extra_late says when it has sent them
 * (an event, not a pause: on a loaded machine 300 ms can become more). */
static void
extra(const char *sc, int settled)
{
    fake_t f;
    fake_start(&f, sc);
    tqkv_client_t *c = client(&f, 0);
    seen_t s;
    char msg[512];
    ck_assert_msg(get(c, &s, msg, sizeof msg) == TQKV_OK, "%s: %s", sc, msg);
    ck_assert_uint_eq(s.via_dc, NH * L);
    /* Each Get of extra_late sends its own late bytes: waited for after every Get. */
    int late = settled && !strcmp(sc, "extra_late");
    for (int i = 0; i < 3; i++) {
        if (late)
            ck_assert_msg(fake_said(&f, "late bytes sent"), "%s: late bytes of Get %d never sent",
                          sc, i + 1);
        tqkv_status_t st = get(c, &s, msg, sizeof msg);
        ck_assert_msg(st == TQKV_OK || msg[0], "%s: error %d without a message", sc, (int)st);
        if (settled)
            ck_assert_msg(st == TQKV_OK, "%s: Get %d after the stray bytes arrived: %s", sc, i + 2,
                          msg);
    }
    tqkv_client_destroy(c);
    fake_stop(&f);
}

START_TEST(dca_extra_bytes)
{
    extra("extra_bytes", 0);
    extra("extra_bytes", 1);
}
END_TEST

START_TEST(dca_extra_frame)
{
    extra("extra_frame", 0);
    extra("extra_frame", 1);
}
END_TEST

START_TEST(dca_extra_late)
{
    extra("extra_late", 0);
    extra("extra_late", 1);
}
END_TEST

/* Bytes after a fresh channel's ack are no frame of the first Get. */
START_TEST(dca_ack_plus_garbage)
{
    expect_error("ack_plus_garbage", TQKV_EUNAVAILABLE, "not a frame header", 0);
}
END_TEST

/* A channel reset mid-page, then the Get's status: the status's reason is reported. */
START_TEST(dca_reset_mid_page)
{
    expect_error("reset_mid_page", TQKV_EUNAVAILABLE, "fake: disk died", 0);
}
END_TEST

START_TEST(dca_status_error_no_frames)
{
    expect_error("status_error_no_frames", -1, "fake: no such namespace", 0);
}
END_TEST

/* A page with a valid CRC32C but a header this build cannot read (version 99): the
 * CRC is the transport's check; tqkv_client_decode_page refuses the page cleanly. */
START_TEST(dca_crc_ok_bad_format)
{
    fake_t f;
    fake_start(&f, "crc_ok_bad_format");
    tqkv_client_t *c = client(&f, 0);
    seen_t s;
    char msg[512];
    FORMAT_BAD = 1;
    tqkv_status_t st = get(c, &s, msg, sizeof msg);
    if (st != TQKV_OK)
        ck_assert_msg(msg[0] != '\0', "error %d without a message", (int)st);
    tqkv_client_destroy(c);
    fake_stop(&f);
}
END_TEST

/* Two targets, every block on both (replicas 2): a bad server next to a good one. */
static tqkv_status_t
replicated(const char *bad, char *msg, size_t msglen, seen_t *s)
{
    fake_t f[2];
    fake_start(&f[0], bad);
    fake_start(&f[1], "ok");
    const char *t[2] = {f[0].addr, f[1].addr};
    tqkv_client_opts_t o = {.targets = t,
                            .num_targets = 2,
                            .replicas = 2,
                            .deadline_ms = DEADLINE_MS,
                            .wait_for_ready = 1,
                            .transport = TQKV_CLIENT_TRANSPORT_TCP};
    tqkv_client_t *c = NULL;
    ck_assert_int_eq(tqkv_client_create(&o, &c), TQKV_OK);
    tqkv_status_t st = get(c, s, msg, msglen);
    again(c);
    tqkv_client_destroy(c);
    fake_stop(&f[0]);
    fake_stop(&f[1]);
    return st;
}

/* A page that fails its CRC on one replica comes from the other. */
START_TEST(dca_replica_bad_crc)
{
    seen_t s;
    char msg[512];
    tqkv_status_t st = replicated("bad_crc", msg, sizeof msg, &s);
    ck_assert_msg(st == TQKV_OK, "%s", msg);
    ck_assert_uint_eq(s.found, NH * L);
}
END_TEST

/* A replica whose frames are out of step: never a wrong page, in time. */
START_TEST(dca_replica_frame_magic)
{
    seen_t s;
    char msg[512];
    tqkv_status_t st = replicated("frame_magic", msg, sizeof msg, &s);
    if (getenv("TQKV_TEST_VERBOSE"))
        fprintf(stderr, "replica_frame_magic: status %d, %zu found: %s\n", (int)st, s.found, msg);
}
END_TEST

/* The stream of a TCP Get carries no messages: one that comes is a malformed answer
 * (or, at the least, never a page). */
START_TEST(dca_grpc_msg_on_tcp)
{
    expect_error("grpc_msg_on_tcp", TQKV_EINTERNAL, "malformed", 0);
}
END_TEST

static Suite *
suite(void)
{
    Suite *s = suite_create("client_dc_adversarial");
    TCase *tc = tcase_create("fake server");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, dca_fake_server_ok);
    tcase_add_test(tc, dca_ack_refused);
    tcase_add_test(tc, dca_ack_garbage);
    tcase_add_test(tc, dca_ack_close);
    tcase_add_test(tc, dca_open_bad_secret);
    tcase_add_test(tc, dca_ack_never);
    tcase_add_test(tc, dca_open_hang);
    tcase_add_test(tc, dca_frame_magic);
    tcase_add_test(tc, dca_index_order);
    tcase_add_test(tc, dca_index_skip);
    tcase_add_test(tc, dca_index_huge);
    tcase_add_test(tc, dca_layer_mismatch);
    tcase_add_test(tc, dca_page_short);
    tcase_add_test(tc, dca_page_huge);
    tcase_add_test(tc, dca_missing_with_len);
    tcase_add_test(tc, dca_flag_bits);
    tcase_add_test(tc, dca_bad_crc);
    tcase_add_test(tc, dca_len_longer);
    tcase_add_test(tc, dca_len_shorter);
    tcase_add_test(tc, dca_truncated_header);
    tcase_add_test(tc, dca_truncated_page);
    tcase_add_test(tc, dca_close_before_frames);
    tcase_add_test(tc, dca_close_then_hang);
    tcase_add_test(tc, dca_status_ok_no_frames);
    tcase_add_test(tc, dca_status_error_after_frames);
    tcase_add_test(tc, dca_hang);
    tcase_add_test(tc, dca_trickle);
    tcase_add_test(tc, dca_tier_huge);
    tcase_add_test(tc, dca_extra_bytes);
    tcase_add_test(tc, dca_extra_frame);
    tcase_add_test(tc, dca_extra_late);
    tcase_add_test(tc, dca_grpc_msg_on_tcp);
    tcase_add_test(tc, dca_ack_plus_garbage);
    tcase_add_test(tc, dca_reset_mid_page);
    tcase_add_test(tc, dca_status_error_no_frames);
    tcase_add_test(tc, dca_crc_ok_bad_format);
    tcase_add_test(tc, dca_replica_bad_crc);
    tcase_add_test(tc, dca_replica_frame_magic);
    suite_add_tcase(s, tc);
    return s;
}

TQKV_CHECK_MAIN(suite)
