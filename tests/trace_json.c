/* SPDX-License-Identifier: MIT */
/*
 * trace_json.c: reading a trace file back for the tests (see trace_json.h).
 */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/mem.h>

#include "trace_json.h"

static int fail(tj_trace_t *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->err, sizeof t->err, fmt, ap);
    va_end(ap);
    return -1;
}

static void copy_str(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
}

static int64_t to_ns(double us) {
    return (int64_t)llround(us * 1000.0);
}

static int push_span(tj_trace_t *t, size_t *cap, const tj_span_t *s) {
    if (t->nspans == *cap) {
        size_t n = *cap ? *cap * 2 : 256;
        tj_span_t *p = realloc(t->spans, n * sizeof *p);
        if (!p) return fail(t, "out of memory");
        t->spans = p;
        *cap = n;
    }
    t->spans[t->nspans++] = *s;
    return 0;
}

/* An integer field of an event; -1 when it is missing or not an integer. */
static int int_field(json_t *e, const char *key, int *out) {
    json_t *v = json_object_get(e, key);
    if (!json_is_integer(v)) return -1;
    *out = (int)json_integer_value(v);
    return 0;
}

/* The B events still open, per track. */
typedef struct open_b {
    tj_span_t s;
} open_b_t;

int tj_load(const char *path, tj_trace_t *t) {
    memset(t, 0, sizeof *t);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return fail(t, "%s: not valid JSON: %s (line %d, column %d)", path, jerr.text, jerr.line,
                    jerr.column);
    int rc = 0;
    size_t cap = 0, nopen = 0, capopen = 0;
    open_b_t *open = NULL;
    json_t *events = json_object_get(root, "traceEvents");
    if (!json_is_object(root) || !json_is_array(events)) {
        rc = fail(t, "%s: not an object with a traceEvents array", path);
        goto out;
    }
    json_t *other = json_object_get(root, "otherData");
    json_t *dropped = json_object_get(other, "dropped_events");
    if (json_is_integer(dropped)) t->dropped = (uint64_t)json_integer_value(dropped);
    size_t i;
    json_t *e;
    json_array_foreach(events, i, e) {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *name = json_string_value(json_object_get(e, "name"));
        json_t *args = json_object_get(e, "args");
        int pid = 0, tid = 0;
        if (!json_is_object(e) || !ph || !name || int_field(e, "pid", &pid) < 0) {
            rc = fail(t, "event %zu: not an object with ph, name and an integer pid", i);
            goto out;
        }
        if (strcmp(ph, "M") == 0) {
            if (!json_is_object(args)) {
                rc = fail(t, "event %zu: metadata '%s' without args", i, name);
                goto out;
            }
            t->nmeta++;
            if (strcmp(name, "process_name") == 0 && t->npids < 64) t->pids[t->npids++] = pid;
            continue;
        }
        json_t *ts = json_object_get(e, "ts");
        if (!json_is_number(ts)) {
            rc = fail(t, "event %zu (%s '%s'): ts is not a number", i, ph, name);
            goto out;
        }
        if (strcmp(ph, "C") == 0) {
            const char *k;
            json_t *v;
            if (!json_is_object(args) || json_object_size(args) == 0) {
                rc = fail(t, "event %zu: counter '%s' without values", i, name);
                goto out;
            }
            json_object_foreach(args, k, v) {
                if (!json_is_number(v)) {
                    rc = fail(t, "event %zu: counter '%s' value '%s' is not a number", i, name, k);
                    goto out;
                }
            }
            t->ncounters++;
            if (strcmp(name, "memory") == 0) {
                bool all = true;
                for (int c = 0; c < FSDP_MEM_NCAT; c++)
                    all &= json_is_number(json_object_get(args, fsdp_mem_cat_name(c)));
                t->nmem_counters += all;
            }
            continue;
        }
        if (int_field(e, "tid", &tid) < 0) {
            rc = fail(t, "event %zu (%s '%s'): tid is not an integer", i, ph, name);
            goto out;
        }
        tj_span_t s;
        memset(&s, 0, sizeof s);
        s.pid = pid;
        s.tid = tid;
        s.ts = to_ns(json_number_value(ts));
        copy_str(s.name, sizeof s.name, name);
        copy_str(s.cat, sizeof s.cat, json_string_value(json_object_get(e, "cat")));
        if (json_is_object(args)) {
            copy_str(s.unit, sizeof s.unit, json_string_value(json_object_get(args, "unit")));
            copy_str(s.group, sizeof s.group, json_string_value(json_object_get(args, "group")));
            json_t *b = json_object_get(args, "bytes");
            if (b) {
                if (!json_is_integer(b) || json_integer_value(b) < 0) {
                    rc = fail(t, "event %zu ('%s'): bytes is not a non-negative integer", i, name);
                    goto out;
                }
                s.bytes = (uint64_t)json_integer_value(b);
                s.has_bytes = true;
            }
        }
        if (strcmp(ph, "X") == 0) {
            json_t *dur = json_object_get(e, "dur");
            if (!json_is_number(dur) || json_number_value(dur) < 0) {
                rc = fail(t, "event %zu ('%s'): dur is not a number >= 0", i, name);
                goto out;
            }
            s.dur = to_ns(json_number_value(dur));
            if ((rc = push_span(t, &cap, &s)) < 0) goto out;
        } else if (strcmp(ph, "B") == 0) {
            if (nopen == capopen) {
                capopen = capopen ? capopen * 2 : 64;
                open_b_t *p = realloc(open, capopen * sizeof *p);
                if (!p) {
                    rc = fail(t, "out of memory");
                    goto out;
                }
                open = p;
            }
            open[nopen++].s = s;
        } else if (strcmp(ph, "E") == 0) {
            size_t k = nopen;
            while (k > 0 && (open[k - 1].s.pid != pid || open[k - 1].s.tid != tid))
                k--;
            if (k == 0 || (name[0] && strcmp(open[k - 1].s.name, name) != 0)) {
                rc = fail(t, "event %zu: E '%s' on pid %d tid %d closes no open B", i, name, pid,
                          tid);
                goto out;
            }
            tj_span_t b = open[k - 1].s;
            memmove(&open[k - 1], &open[k], (nopen - k) * sizeof *open);
            nopen--;
            if (s.ts < b.ts) {
                rc = fail(t, "event %zu: E '%s' ends before its B", i, name);
                goto out;
            }
            b.dur = s.ts - b.ts;
            if ((rc = push_span(t, &cap, &b)) < 0) goto out;
        } else if (strcmp(ph, "i") != 0 && strcmp(ph, "I") != 0) {
            rc = fail(t, "event %zu: unexpected phase '%s'", i, ph);
            goto out;
        }
    }
    if (nopen > 0)
        rc = fail(t, "B '%s' on pid %d tid %d has no E", open[0].s.name, open[0].s.pid,
                  open[0].s.tid);
out:
    free(open);
    json_decref(root);
    return rc;
}

void tj_free(tj_trace_t *t) {
    free(t->spans);
    t->spans = NULL;
    t->nspans = 0;
}

static int span_cmp(const void *a, const void *b) {
    const tj_span_t *x = *(const tj_span_t *const *)a, *y = *(const tj_span_t *const *)b;
    if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
    if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    if (x->dur != y->dur) return x->dur > y->dur ? -1 : 1;
    return 0;
}

int tj_check_nesting(const tj_trace_t *t, char *err, size_t cap) {
    const tj_span_t **v = malloc((t->nspans ? t->nspans : 1) * sizeof *v);
    const tj_span_t **stack = malloc((t->nspans ? t->nspans : 1) * sizeof *stack);
    int rc = 0;
    if (!v || !stack) {
        snprintf(err, cap, "out of memory");
        rc = -1;
        goto out;
    }
    for (size_t i = 0; i < t->nspans; i++)
        v[i] = &t->spans[i];
    qsort(v, t->nspans, sizeof *v, span_cmp);
    size_t depth = 0;
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *s = v[i];
        if (i > 0 && (v[i - 1]->pid != s->pid || v[i - 1]->tid != s->tid)) depth = 0;
        while (depth > 0 && stack[depth - 1]->ts + stack[depth - 1]->dur <= s->ts)
            depth--;
        if (depth > 0) {
            const tj_span_t *p = stack[depth - 1];
            if (s->ts + s->dur > p->ts + p->dur) {
                snprintf(err, cap,
                         "pid %d tid %d: '%s' [%lld, %lld] ns overlaps '%s' [%lld, %lld] ns "
                         "partially",
                         s->pid, s->tid, s->name, (long long)s->ts, (long long)(s->ts + s->dur),
                         p->name, (long long)p->ts, (long long)(p->ts + p->dur));
                rc = -1;
                goto out;
            }
        }
        stack[depth++] = s;
    }
out:
    free(v);
    free(stack);
    return rc;
}

bool tj_within(const tj_span_t *a, const tj_span_t *b) {
    return a->pid == b->pid && a->tid == b->tid && a->ts >= b->ts &&
           a->ts + a->dur <= b->ts + b->dur;
}

size_t tj_count(const tj_trace_t *t, int pid, int tid, const char *cat, const char *unit) {
    size_t n = 0;
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *s = &t->spans[i];
        if (s->pid != pid || s->tid != tid) continue;
        if (cat && strcmp(s->cat, cat) != 0) continue;
        if (unit && strcmp(s->unit, unit) != 0) continue;
        n++;
    }
    return n;
}

/* ---- intervals ---------------------------------------------------------------------------- */

typedef struct ival {
    int64_t a, b;
} ival_t;

static int ival_cmp(const void *x, const void *y) {
    const ival_t *p = x, *q = y;
    return (p->a > q->a) - (p->a < q->a);
}

/* Sorts and merges v[0..n) in place; returns the number of disjoint intervals. */
static size_t merge(ival_t *v, size_t n) {
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, ival_cmp);
    size_t k = 0;
    for (size_t i = 1; i < n; i++) {
        if (v[i].a <= v[k].b) {
            if (v[i].b > v[k].b) v[k].b = v[i].b;
        } else {
            v[++k] = v[i];
        }
    }
    return k + 1;
}

/* Length of [a, b) covered by the disjoint sorted intervals v[0..n). */
static int64_t covered(const ival_t *v, size_t n, int64_t a, int64_t b) {
    int64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t lo = v[i].a > a ? v[i].a : a, hi = v[i].b < b ? v[i].b : b;
        if (hi > lo) sum += hi - lo;
    }
    return sum;
}

double tj_overlap_fraction(const tj_trace_t *t, int pid, int64_t *comm_ns) {
    return tj_overlap_fraction_of(t, pid, NULL, false, comm_ns);
}

/* Whether a backward pass of pid's compute track contains time ts. */
static bool in_pass(const tj_trace_t *t, int pid, int64_t ts) {
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *s = &t->spans[i];
        if (s->pid == pid && s->tid == 1 && strcmp(s->cat, "autograd") == 0 && s->ts <= ts &&
            ts < s->ts + s->dur)
            return true;
    }
    return false;
}

double tj_overlap_fraction_of(const tj_trace_t *t, int pid, const char *name, bool in_backward,
                              int64_t *comm_ns) {
    size_t n = t->nspans ? t->nspans : 1;
    ival_t *busy = malloc(n * sizeof *busy), *wait = malloc(n * sizeof *wait);
    size_t nb = 0, nw = 0;
    int64_t total = 0, over = 0;
    if (!busy || !wait) goto out;
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *s = &t->spans[i];
        if (s->pid != pid || s->tid != 1) continue;
        ival_t iv = {s->ts, s->ts + s->dur};
        if (strcmp(s->cat, "wait") == 0)
            wait[nw++] = iv;
        else
            busy[nb++] = iv;
    }
    nb = merge(busy, nb);
    nw = merge(wait, nw);
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *s = &t->spans[i];
        if (s->pid != pid || s->tid != 2) continue;
        if (name && strcmp(s->name, name) != 0) continue;
        if (in_backward && !in_pass(t, pid, s->ts)) continue;
        int64_t a = s->ts, b = s->ts + s->dur;
        total += b - a;
        /* Busy and not waiting: covered by busy minus what the waits cover inside busy. */
        int64_t in_busy = covered(busy, nb, a, b);
        int64_t in_wait = 0;
        for (size_t k = 0; k < nw; k++) {
            int64_t lo = wait[k].a > a ? wait[k].a : a, hi = wait[k].b < b ? wait[k].b : b;
            if (hi > lo) in_wait += covered(busy, nb, lo, hi);
        }
        over += in_busy - in_wait;
    }
out:
    free(busy);
    free(wait);
    if (comm_ns) *comm_ns = total;
    return total > 0 ? (double)over / (double)total : 0.0;
}
