/* log.h - structured log lines for tqkv-server (text "key=value" or JSON, one per line).
 *
 * A line is: ts, level, msg, then the caller's fields. Fields are passed as one
 * printf-formatted string of space-separated `key=value` pairs; a value containing
 * spaces must be double-quoted ("path=\"a b\""), and inside the quotes '"' and '\\'
 * are escaped with '\\' (tqkv_log_quote does it: use it for any text a client can
 * choose, or a '"' in it would end the value and forge fields). Thread-safe: one fputs
 * per line.
 */
#ifndef TQKV_SERVICE_LOG_H
#define TQKV_SERVICE_LOG_H

#include <stdio.h>

#include "kernels/status.h"

typedef enum tqkv_log_level {
    TQKV_LOG_DEBUG = 0, /* per-request detail */
    TQKV_LOG_INFO = 1,  /* lifecycle: start, listening, drain, exit */
    TQKV_LOG_WARN = 2,  /* unusual but handled */
    TQKV_LOG_ERROR = 3, /* failures */
} tqkv_log_level_t;

typedef enum tqkv_log_format {
    TQKV_LOG_TEXT = 0, /* ts=... level=... msg="..." k=v */
    TQKV_LOG_JSON = 1, /* {"ts":"...","level":"...","msg":"...","k":"v"} */
} tqkv_log_format_t;

/* Sets the minimum level and format (process-wide); out defaults to stderr. */
void tqkv_log_setup(tqkv_log_level_t level, tqkv_log_format_t format, FILE *out);

/* "debug", "info", "warn", "error" -> level; TQKV_EINVAL otherwise. */
tqkv_status_t tqkv_log_level_parse(const char *s, tqkv_log_level_t *out);
/* "text", "json" -> format; TQKV_EINVAL otherwise. */
tqkv_status_t tqkv_log_format_parse(const char *s, tqkv_log_format_t *out);

/* Non-zero when a line at level would be written. */
int tqkv_log_enabled(tqkv_log_level_t level);

/* Copies s (NULL = "") into dst[0..cap) with '"' and '\\' escaped for a quoted field
 * value; truncates to fit, always NUL-terminates (cap > 0). Returns the length. */
size_t tqkv_log_quote(char *dst, size_t cap, const char *s);

/* Writes one line. fields (may be NULL) is a printf format of "key=value" pairs. */
void tqkv_log(tqkv_log_level_t level, const char *msg, const char *fields, ...)
    __attribute__((format(printf, 3, 4)));

/* Writes one line to out whatever the level (the start-up lines tests and scripts read
 * from stdout: "tqkv-server listening on HOST:PORT"), in the process-wide format. */
void tqkv_log_to(FILE *out, tqkv_log_level_t level, const char *msg, const char *fields, ...)
    __attribute__((format(printf, 4, 5)));

/* The access log (--access-log): one line per finished RPC. path "-" writes the lines to
 * the log stream; any other path is a file opened for appending (created mode 0640).
 * Call before threads start. TQKV_EIO with a line naming the file in err. */
tqkv_status_t tqkv_log_access_open(const char *path, char *err, size_t errlen);
/* Reopens the access log file at its path (SIGHUP after a log rotation moved it); the
 * switch is atomic for concurrent writers. No-op without a file. */
tqkv_status_t tqkv_log_access_reopen(char *err, size_t errlen);
/* Non-zero when an access log is open. */
int tqkv_log_access_enabled(void);
/* Writes one access line (level info; fields as tqkv_log). Thread-safe. */
void tqkv_log_access(const char *msg, const char *fields, ...)
    __attribute__((format(printf, 2, 3)));

/* Routes gRPC core's own log lines (gpr_log) through tqkv_log, so that in JSON mode every
 * line on stderr is JSON. Call once, before grpc_init. */
void tqkv_log_capture_grpc(void);

/* Formats one line into buf (used by tests); returns the length written. */
size_t tqkv_log_format_line(char *buf, size_t cap, tqkv_log_format_t format, tqkv_log_level_t level,
                            const char *msg, const char *fields);

#endif
