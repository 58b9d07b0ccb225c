/* SPDX-License-Identifier: MIT */
/*
 * strbuf.c: the growable message buffer and the byte-order helper that several layers use to
 * build error texts and to read and write little-endian files (internal.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

void fsdp__sb_add(fsdp__sbuf_t *b, const char *fmt, ...) {
    if (b->oom) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
        b->oom = true;
        return;
    }
    if (b->n + (size_t)k + 1 > b->cap) {
        size_t nc = (b->n + (size_t)k + 1) * 2;
        char *p = realloc(b->s, nc);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p;
        b->cap = nc;
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
}

const char *fsdp__sb_str(const fsdp__sbuf_t *b) {
    return b->s && !b->oom ? b->s : "";
}

void fsdp__sb_free(fsdp__sbuf_t *b) {
    free(b->s);
    *b = (fsdp__sbuf_t){0};
}

static bool host_is_le(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

void fsdp__swap_le(void *buf, size_t n, size_t es) {
    if (host_is_le() || es == 1) return;
    unsigned char *p = buf;
    for (size_t i = 0; i < n; i++, p += es)
        for (size_t a = 0, z = es - 1; a < z; a++, z--) {
            unsigned char t = p[a];
            p[a] = p[z];
            p[z] = t;
        }
}
