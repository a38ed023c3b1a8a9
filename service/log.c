/* log.c - structured log lines (text or JSON), one fputs per line so concurrent
 * writers never interleave within a line. Level and format are set once at start-up
 * (before any thread runs) and read without locks afterwards.
 */
#include "service/log.h"

#include <stdarg.h>
#include <string.h>
#include <time.h>

static tqkv_log_level_t g_level = TQKV_LOG_INFO;
static tqkv_log_format_t g_format = TQKV_LOG_TEXT;
static FILE *g_out;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

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

void
tqkv_log(tqkv_log_level_t level, const char *msg, const char *fields, ...)
{
    char f[1024];
    char line[2048];
    if (level < g_level)
        return;
    f[0] = '\0';
    if (fields) {
        va_list ap;
        va_start(ap, fields);
        vsnprintf(f, sizeof f, fields, ap);
        va_end(ap);
    }
    tqkv_log_format_line(line, sizeof line, g_format, level, msg, f);
    FILE *out = g_out ? g_out : stderr;
    fputs(line, out);
    fflush(out);
}
