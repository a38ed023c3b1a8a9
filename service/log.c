/* log.c - structured log lines (text or JSON), one fputs per line so concurrent
 * writers never interleave within a line. Level and format are set once at start-up
 * (before any thread runs) and read without locks afterwards.
 *
 * The access log file is written with one write(2) per line on an O_APPEND descriptor;
 * a reopen (log rotation) dup2()s the new file onto the same descriptor number, which
 * swaps files atomically under concurrent writers, so no lock is needed.
 */
#include "service/log.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/support/log.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static tqkv_log_level_t g_level = TQKV_LOG_INFO;
static tqkv_log_format_t g_format = TQKV_LOG_TEXT;
static FILE *g_out;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

static int g_access_on;      /* an access log is open */
static int g_access_fd = -1; /* its file, or -1: the log stream */
static char g_access_path[1024];

void
tqkv_log_setup(tqkv_log_level_t level, tqkv_log_format_t format, FILE *out)
{
    g_level = level;
    g_format = format;
    g_out = out;
}

tqkv_status_t
tqkv_log_level_parse(const char *s, tqkv_log_level_t *out)
{
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (tqkv_log_level_t)i;
            return TQKV_OK;
        }
    }
    if (strcmp(s, "warning") == 0) {
        *out = TQKV_LOG_WARN;
        return TQKV_OK;
    }
    return TQKV_EINVAL;
}

tqkv_status_t
tqkv_log_format_parse(const char *s, tqkv_log_format_t *out)
{
    if (strcmp(s, "text") == 0)
        *out = TQKV_LOG_TEXT;
    else if (strcmp(s, "json") == 0)
        *out = TQKV_LOG_JSON;
    else
        return TQKV_EINVAL;
    return TQKV_OK;
}

int
tqkv_log_enabled(tqkv_log_level_t level)
{
    return level >= g_level;
}

/* Appends s[0..n) to buf at *pos, escaped for a JSON string or a quoted text value. */
static void
put_escaped(char *buf, size_t cap, size_t *pos, const char *s, size_t n)
{
    for (size_t i = 0; i < n && *pos + 7 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            buf[(*pos)++] = '\\';
            buf[(*pos)++] = (char)c;
        } else if (c == '\n') {
            buf[(*pos)++] = '\\';
            buf[(*pos)++] = 'n';
        } else if (c < 0x20) {
            *pos += (size_t)snprintf(buf + *pos, cap - *pos, "\\u%04x", c);
        } else {
            buf[(*pos)++] = (char)c;
        }
    }
}

/* put_escaped of a field value; in a quoted one (written by tqkv_log_quote) "\\x"
 * stands for x. */
static void
put_value(char *buf, size_t cap, size_t *pos, const char *v, size_t vl, int quoted)
{
    for (size_t i = 0; i < vl; i++) {
        if (quoted && v[i] == '\\' && i + 1 < vl)
            i++;
        put_escaped(buf, cap, pos, v + i, 1);
    }
}

size_t
tqkv_log_quote(char *dst, size_t cap, const char *s)
{
    size_t n = 0;
    if (cap == 0)
        return 0;
    for (; s && *s && n + 3 <= cap; s++) {
        if (*s == '"' || *s == '\\')
            dst[n++] = '\\';
        dst[n++] = *s;
    }
    dst[n] = '\0';
    return n;
}

static void
put_raw(char *buf, size_t cap, size_t *pos, const char *s)
{
    size_t n = strlen(s);
    if (*pos + n >= cap)
        n = cap - *pos - 1;
    memcpy(buf + *pos, s, n);
    *pos += n;
}

size_t
tqkv_log_format_line(char *buf, size_t cap, tqkv_log_format_t format, tqkv_log_level_t level,
                     const char *msg, const char *fields)
{
    char ts[40];
    struct timespec now;
    struct tm tm;
    size_t pos = 0;

    if (cap < 64)
        return 0;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    size_t tl = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + tl, sizeof ts - tl, ".%03ldZ", now.tv_nsec / 1000000);
    const char *lv = level_names[(int)level & 3];
    cap -= 2; /* room for "\n\0" */

    if (format == TQKV_LOG_JSON) {
        pos += (size_t)snprintf(buf, cap, "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"", ts, lv);
        put_escaped(buf, cap, &pos, msg, strlen(msg));
        put_raw(buf, cap, &pos, "\"");
    } else {
        pos += (size_t)snprintf(buf, cap, "ts=%s level=%s msg=\"", ts, lv);
        put_escaped(buf, cap, &pos, msg, strlen(msg));
        put_raw(buf, cap, &pos, "\"");
    }
    /* Fields: key=value or key="quoted value", separated by spaces. */
    const char *p = fields ? fields : "";
    while (*p && pos + 8 < cap) {
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        const char *k = p;
        while (*p && *p != '=' && *p != ' ')
            p++;
        size_t kl = (size_t)(p - k);
        const char *v = "";
        size_t vl = 0;
        int quoted = 0;
        if (*p == '=') {
            p++;
            if (*p == '"') {
                quoted = 1;
                v = ++p;
                while (*p && *p != '"') {
                    if (*p == '\\' && p[1])
                        p++; /* an escaped '"' or '\\' */
                    p++;
                }
                vl = (size_t)(p - v);
                if (*p == '"')
                    p++;
            } else {
                v = p;
                while (*p && *p != ' ')
                    p++;
                vl = (size_t)(p - v);
            }
        }
        if (format == TQKV_LOG_JSON) {
            put_raw(buf, cap, &pos, ",\"");
            put_escaped(buf, cap, &pos, k, kl);
            put_raw(buf, cap, &pos, "\":\"");
            put_value(buf, cap, &pos, v, vl, quoted);
            put_raw(buf, cap, &pos, "\"");
        } else {
            put_raw(buf, cap, &pos, " ");
            put_escaped(buf, cap, &pos, k, kl);
            put_raw(buf, cap, &pos, "=");
            int quote = memchr(v, ' ', vl) != NULL || memchr(v, '"', vl) != NULL || vl == 0;
            if (quote)
                put_raw(buf, cap, &pos, "\"");
            put_value(buf, cap, &pos, v, vl, quoted);
            if (quote)
                put_raw(buf, cap, &pos, "\"");
        }
    }
    if (format == TQKV_LOG_JSON)
        put_raw(buf, cap + 2, &pos, "}");
    buf[pos++] = '\n';
    buf[pos] = '\0';
    return pos;
}

/* Formats the fields (fields a printf format for ap, or NULL) and the line into
 * line[LINE_BYTES]; returns the line's length. */
#define LINE_BYTES 2048
static size_t
vformat(char *line, tqkv_log_level_t level, const char *msg, const char *fields, va_list ap)
{
    char f[1024];
    f[0] = '\0';
    if (fields)
        vsnprintf(f, sizeof f, fields, ap);
    return tqkv_log_format_line(line, LINE_BYTES, g_format, level, msg, f);
}

void
tqkv_log(tqkv_log_level_t level, const char *msg, const char *fields, ...)
{
    char line[LINE_BYTES];
    if (level < g_level)
        return;
    va_list ap;
    va_start(ap, fields);
    vformat(line, level, msg, fields, ap);
    va_end(ap);
    FILE *out = g_out ? g_out : stderr;
    fputs(line, out);
    fflush(out);
}

void
tqkv_log_to(FILE *out, tqkv_log_level_t level, const char *msg, const char *fields, ...)
{
    char line[LINE_BYTES];
    va_list ap;
    va_start(ap, fields);
    vformat(line, level, msg, fields, ap);
    va_end(ap);
    fputs(line, out);
    fflush(out);
}

static int
open_access(const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0)
        snprintf(err, errlen, "--access-log %s: cannot open for appending: %s", path,
                 strerror(errno));
    return fd;
}

tqkv_status_t
tqkv_log_access_open(const char *path, char *err, size_t errlen)
{
    if (strcmp(path, "-") == 0) {
        g_access_on = 1;
        return TQKV_OK;
    }
    if (strlen(path) >= sizeof g_access_path) {
        snprintf(err, errlen, "--access-log: path too long");
        return TQKV_EINVAL;
    }
    int fd = open_access(path, err, errlen);
    if (fd < 0)
        return TQKV_EIO;
    if (g_access_fd >= 0)
        close(g_access_fd);
    g_access_fd = fd;
    memcpy(g_access_path, path, strlen(path) + 1);
    g_access_on = 1;
    return TQKV_OK;
}

tqkv_status_t
tqkv_log_access_reopen(char *err, size_t errlen)
{
    if (g_access_fd < 0)
        return TQKV_OK;
    int fd = open_access(g_access_path, err, errlen);
    if (fd < 0)
        return TQKV_EIO;
    int rc = dup2(fd, g_access_fd);
    int e = errno;
    close(fd);
    if (rc < 0) {
        snprintf(err, errlen, "--access-log %s: reopen failed: %s", g_access_path, strerror(e));
        return TQKV_EIO;
    }
    return TQKV_OK;
}

int
tqkv_log_access_enabled(void)
{
    return g_access_on;
}

void
tqkv_log_access(const char *msg, const char *fields, ...)
{
    char line[LINE_BYTES];
    if (!g_access_on)
        return;
    va_list ap;
    va_start(ap, fields);
    size_t n = vformat(line, TQKV_LOG_INFO, msg, fields, ap);
    va_end(ap);
    if (g_access_fd < 0) {
        FILE *out = g_out ? g_out : stderr;
        fputs(line, out);
        fflush(out);
        return;
    }
    /* One write per line (O_APPEND); a short write of a log line is not retried. */
    ssize_t w = write(g_access_fd, line, n);
    (void)w;
}

static void
grpc_log_sink(gpr_log_func_args *a)
{
    tqkv_log_level_t lv = a->severity == GPR_LOG_SEVERITY_ERROR  ? TQKV_LOG_ERROR
                          : a->severity == GPR_LOG_SEVERITY_INFO ? TQKV_LOG_INFO
                                                                 : TQKV_LOG_DEBUG;
    if (!tqkv_log_enabled(lv))
        return;
    char q[1024], file[256];
    tqkv_log_quote(q, sizeof q, a->message);
    tqkv_log_quote(file, sizeof file, a->file);
    tqkv_log(lv, "grpc", "component=grpc source=\"%s:%d\" detail=\"%s\"", file, a->line, q);
}

void
tqkv_log_capture_grpc(void)
{
    gpr_set_log_function(grpc_log_sink);
}
