/* metrics_text.h - the Prometheus text exposition of tqkv-server's metrics (metrics_text.c):
 * a growing output buffer with escaping and number formats, and the families read at scrape
 * time from the store and from /proc. For service/metrics*.c (tqkv__, not API).
 */
#ifndef TQKV_SERVICE_METRICS_TEXT_H
#define TQKV_SERVICE_METRICS_TEXT_H

#include <stddef.h>

#include "cache/store.h"

/* The text being rendered: p[0..len) (NUL-terminated), cap bytes allocated. After an
 * allocation failure oom is set and nothing more is appended. */
typedef struct tqkv__sbuf {
    char *p;
    size_t len, cap;
    int oom;
} tqkv__sbuf_t;

/* Appends n bytes of s; SB_LIT appends a string literal. */
void tqkv__sb_append(tqkv__sbuf_t *b, const char *s, size_t n);
#define SB_LIT(b, lit) tqkv__sb_append((b), (lit), sizeof(lit) - 1)
void tqkv__sb_reserve(tqkv__sbuf_t *b, size_t extra);
void tqkv__sb_printf(tqkv__sbuf_t *b, const char *fmt, ...);
void tqkv__sb_label_value(tqkv__sbuf_t *b, const char *v, size_t n);
void tqkv__sb_family(tqkv__sbuf_t *b, const char *name, const char *type, const char *help);
void tqkv__sb_double(tqkv__sbuf_t *b, double v);
void tqkv__sb_le(tqkv__sbuf_t *b, double le);
/* Byte order of two namespace names (not NUL-terminated), a prefix first: the order the
 * per-namespace families are rendered in. */
int tqkv__ns_name_cmp(const char *a, size_t alen, const char *b, size_t blen);
void tqkv__render_store(tqkv__sbuf_t *b, tqkv_store_t *store);
void tqkv__render_process(tqkv__sbuf_t *b, double registry_start);

#endif /* TQKV_SERVICE_METRICS_TEXT_H */
