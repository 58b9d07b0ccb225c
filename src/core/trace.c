/* SPDX-License-Identifier: MIT */
/*
 * trace.c: the trace recorder (fsdp/trace.h) and the library's recording points (core/trace.h).
 *
 * A recorder holds one lane per rank. A lane keeps its events in chunks of fixed size that are
 * only ever appended to (no copy when it grows), a stack of the compute track's open spans, and
 * its own table of the names its events use, so an event is a few words and names live as long
 * as the recorder, whatever happened to the units they came from. The JSON is produced only by
 * fsdp_trace_write().
 *
 * Locks and lifetimes. A recorder is reference-counted: its owner's handle plus one per context
 * recording into it, so a context never records into freed memory. ctx->trace (the lane) is set
 * and cleared under ctx->trace_mu, and every recording takes ctx->trace_mu and reads it again
 * there, so once fsdp_trace_stop() returns nothing touches the lane on behalf of that context.
 * A lane's own mutex orders its recording against fsdp_trace_write(); the recorder's mutex
 * guards the list of lanes, the reference count and the last error. Lock order: ctx->trace_mu,
 * then trace->mu, then lane->mu.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timeutil.h"
#include "core/trace.h"

#define DEFAULT_MAX_EVENTS ((size_t)1 << 20)
#define CHUNK_EVENTS 1024 /* events per chunk */
#define MAX_DEPTH 64      /* open spans tracked per rank; deeper ones are dropped */
#define TID_COMPUTE 1
#define TID_COMM 2

enum ev_kind { EV_SPAN = 0, EV_COLL, EV_MEM };

/* One event of a lane. Times in nanoseconds of CLOCK_MONOTONIC. */
struct ev {
    int64_t ts;
    int64_t dur;    /* spans and collectives */
    uint32_t name;  /* span: its name; collective: its kind; ids in the lane's table */
    uint32_t group; /* collective: its group's name */
    uint8_t kind;   /* enum ev_kind */
    uint8_t cat;    /* span: fsdp__trace_cat_t */
    union {
        struct {
            uint64_t bytes, seq;
            int64_t issued;
        } coll;
        uint64_t mem[FSDP_MEM_NCAT]; /* EV_MEM: bytes per category */
    } u;
};

struct chunk {
    struct chunk *next;
    size_t n;
    struct ev ev[CHUNK_EVENTS];
};

struct open_span {
    int64_t ts;
    uint32_t name;
    uint8_t cat;
};

struct fsdp__trace_lane {
    struct fsdp__trace_lane *next; /* in the recorder's list, by rank */
    fsdp_trace_t *trace;           /* the recorder it belongs to, for life */
    int rank;
    pthread_mutex_t mu; /* guards everything below */
    bool active;        /* a context records into this lane now */
    pthread_t owner;    /* the compute track's thread */
    struct open_span stack[MAX_DEPTH];
    int depth;
    struct chunk *head, *tail;
    size_t nev, dropped;
    int64_t coll_end; /* end of the last collective recorded */
    bool mem_seen;
    uint64_t mem_last[FSDP_MEM_NCAT];
    /* Names: strs[id], found through an open-addressing table of ids + 1 (0: empty slot). */
    char **strs;
    uint32_t nstrs, capstrs;
    uint32_t *slots;
    uint32_t nslots; /* a power of two, at least twice nstrs */
};

struct fsdp_trace {
    pthread_mutex_t mu; /* guards lanes, refs and err */
    int refs;           /* the owner's handle + contexts recording */
    size_t max_events;
    bool memory;
    struct fsdp__trace_lane *lanes;
    char err[FSDP_ERR_LEN];
};

static const char *const cat_names[FSDP__TRACE_NCAT] = {
    "user", "forward", "backward", "recompute", "optimizer", "autograd", "checkpoint", "wait"};
/* What the file's name of a span starts with, before the recorded name. */
static const char *const cat_prefix[FSDP__TRACE_NCAT] = {
    "", "forward ", "backward ", "recompute ", "optimizer ", "", "", "wait "};

/* ---- names ---------------------------------------------------------------------------------- */

static uint32_t hash_str(const char *s) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

static int grow_slots(struct fsdp__trace_lane *l) {
    uint32_t n = l->nslots ? l->nslots * 2 : 64;
    uint32_t *slots = calloc(n, sizeof *slots);
    if (!slots) return FSDP_ENOMEM;
    for (uint32_t id = 0; id < l->nstrs; id++) {
        uint32_t i = hash_str(l->strs[id]) & (n - 1);
        while (slots[i])
            i = (i + 1) & (n - 1);
        slots[i] = id + 1;
    }
    free(l->slots);
    l->slots = slots;
    l->nslots = n;
    return FSDP_OK;
}

/* The id of name in l's table, added when new; UINT32_MAX when out of memory. */
static uint32_t intern(struct fsdp__trace_lane *l, const char *name) {
    if (2 * (l->nstrs + 1) > l->nslots && grow_slots(l) < 0) return UINT32_MAX;
    uint32_t i = hash_str(name) & (l->nslots - 1);
    while (l->slots[i]) {
        if (strcmp(l->strs[l->slots[i] - 1], name) == 0) return l->slots[i] - 1;
        i = (i + 1) & (l->nslots - 1);
    }
    if (l->nstrs == l->capstrs) {
        uint32_t cap = l->capstrs ? l->capstrs * 2 : 64;
        char **strs = realloc(l->strs, cap * sizeof *strs);
        if (!strs) return UINT32_MAX;
        l->strs = strs;
        l->capstrs = cap;
    }
    char *copy = strdup(name);
    if (!copy) return UINT32_MAX;
    l->strs[l->nstrs] = copy;
    l->slots[i] = ++l->nstrs;
    return l->nstrs - 1;
}

/* ---- lanes ---------------------------------------------------------------------------------- */

/* A new slot for an event of l (NULL when the recorder's bound is reached or memory is out: the
 * event is counted as dropped). */
static struct ev *append(fsdp_trace_t *t, struct fsdp__trace_lane *l) {
    if (l->nev >= t->max_events) {
        l->dropped++;
        return NULL;
    }
    if (!l->tail || l->tail->n == CHUNK_EVENTS) {
        struct chunk *c = malloc(sizeof *c);
        if (!c) {
            l->dropped++;
            return NULL;
        }
        c->next = NULL;
        c->n = 0;
        if (l->tail)
            l->tail->next = c;
        else
            l->head = c;
        l->tail = c;
    }
    l->nev++;
    struct ev *e = &l->tail->ev[l->tail->n++];
    memset(e, 0, sizeof *e);
    return e;
}

static void lane_free(struct fsdp__trace_lane *l) {
    for (struct chunk *c = l->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    for (uint32_t i = 0; i < l->nstrs; i++)
        free(l->strs[i]);
    free(l->strs);
    free(l->slots);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

/* Appends a memory sample of ctx at `now` when a counter changed since the last one. */
static void sample_memory(fsdp_trace_t *t, struct fsdp__trace_lane *l, const fsdp_ctx_t *ctx,
                          int64_t now) {
    if (!t->memory) return;
    uint64_t cur[FSDP_MEM_NCAT];
    bool changed = !l->mem_seen;
    for (int c = 0; c < FSDP_MEM_NCAT; c++) {
        cur[c] = atomic_load_explicit(&ctx->mem_current[c], memory_order_relaxed);
        changed |= cur[c] != l->mem_last[c];
    }
    if (!changed) return;
    struct ev *e = append(t, l);
    if (!e) return;
    e->kind = EV_MEM;
    e->ts = now;
    memcpy(e->u.mem, cur, sizeof cur);
    memcpy(l->mem_last, cur, sizeof cur);
    l->mem_seen = true;
}

/* Closes l's open spans from the top down to depth `keep`, ending at `now`. */
static void close_spans(fsdp_trace_t *t, struct fsdp__trace_lane *l, int keep, int64_t now) {
    while (l->depth > keep) {
        struct open_span *o = &l->stack[--l->depth];
        struct ev *e = append(t, l);
        if (!e) continue;
        e->kind = EV_SPAN;
        e->cat = o->cat;
        e->name = o->name;
        e->ts = o->ts;
        e->dur = now - o->ts;
    }
}

/* The lane ctx records into, locked, with ctx->trace_mu held; NULL (nothing held) when ctx does
 * not record or, with `compute`, when the calling thread is not the compute track's. */
static struct fsdp__trace_lane *lock_lane(fsdp_ctx_t *ctx, bool compute) {
    pthread_mutex_lock(&ctx->trace_mu);
    struct fsdp__trace_lane *l = atomic_load_explicit(&ctx->trace, memory_order_relaxed);
    if (l) {
        pthread_mutex_lock(&l->mu);
        if (l->active && (!compute || pthread_equal(l->owner, pthread_self()))) return l;
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_unlock(&ctx->trace_mu);
    return NULL;
}

static void unlock_lane(fsdp_ctx_t *ctx, struct fsdp__trace_lane *l) {
    pthread_mutex_unlock(&l->mu);
    pthread_mutex_unlock(&ctx->trace_mu);
}

/* ---- recording points (core/trace.h) -------------------------------------------------------- */

int64_t fsdp__trace_now(const fsdp_ctx_t *ctx) {
    return ctx && ctx->trace_clock ? ctx->trace_clock(ctx->trace_clock_arg) : fsdp__now_ns();
}

void fsdp__trace_begin(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name) {
    if (!ctx || !name || (int)cat < 0 || cat >= FSDP__TRACE_NCAT) return;
    struct fsdp__trace_lane *l = lock_lane(ctx, true);
    if (!l) return;
    int64_t now = fsdp__trace_now(ctx);
    fsdp_trace_t *t = l->trace;
    sample_memory(t, l, ctx, now);
    uint32_t id = intern(l, name);
    if (l->depth < MAX_DEPTH && id != UINT32_MAX)
        l->stack[l->depth++] = (struct open_span){.ts = now, .name = id, .cat = (uint8_t)cat};
    else
        l->dropped++;
    unlock_lane(ctx, l);
}

void fsdp__trace_end(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name) {
    if (!ctx || !name) return;
    struct fsdp__trace_lane *l = lock_lane(ctx, true);
    if (!l) return;
    int64_t now = fsdp__trace_now(ctx);
    fsdp_trace_t *t = l->trace;
    uint32_t id = intern(l, name);
    for (int d = l->depth; d-- > 0;) {
        if (l->stack[d].cat != cat || l->stack[d].name != id) continue;
        close_spans(t, l, d, now);
        break;
    }
    sample_memory(t, l, ctx, now);
    unlock_lane(ctx, l);
}

/* Appends a collective's span [start, end] to l (locked). */
static void coll_span(struct fsdp__trace_lane *l, const char *kind, const char *group, uint64_t seq,
                      uint64_t bytes, int64_t issued, int64_t start, int64_t end) {
    fsdp_trace_t *t = l->trace;
    uint32_t k = intern(l, kind), g = intern(l, group);
    struct ev *e = k != UINT32_MAX && g != UINT32_MAX ? append(t, l) : NULL;
    if (e) {
        e->kind = EV_COLL;
        e->name = k;
        e->group = g;
        e->ts = start;
        e->dur = end - start;
        e->u.coll.bytes = bytes;
        e->u.coll.seq = seq;
        e->u.coll.issued = issued;
    } else if (k == UINT32_MAX || g == UINT32_MAX) {
        l->dropped++;
    }
    if (end > l->coll_end) l->coll_end = end;
}

void fsdp__trace_coll(fsdp_ctx_t *ctx, const char *kind, const char *group, uint64_t seq,
                      uint64_t bytes, int64_t issued_ns) {
    if (!ctx || !kind || !group) return;
    struct fsdp__trace_lane *l = lock_lane(ctx, false);
    if (!l) return;
    int64_t now = fsdp__now_ns();
    int64_t start = issued_ns > l->coll_end ? issued_ns : l->coll_end;
    if (start > now) start = now;
    coll_span(l, kind, group, seq, bytes, issued_ns, start, now);
    unlock_lane(ctx, l);
}

void fsdp__trace_span_at(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name, int64_t start_ns,
                         int64_t end_ns) {
    if (!ctx || !name || (int)cat < 0 || cat >= FSDP__TRACE_NCAT || end_ns < start_ns) return;
    struct fsdp__trace_lane *l = lock_lane(ctx, true);
    if (!l) return;
    uint32_t id = intern(l, name);
    struct ev *e = id != UINT32_MAX ? append(l->trace, l) : NULL;
    if (e) {
        e->kind = EV_SPAN;
        e->cat = (uint8_t)cat;
        e->name = id;
        e->ts = start_ns;
        e->dur = end_ns - start_ns;
    } else if (id == UINT32_MAX) {
        l->dropped++;
    }
    unlock_lane(ctx, l);
}

void fsdp__trace_coll_at(fsdp_ctx_t *ctx, const char *kind, const char *group, uint64_t seq,
                         uint64_t bytes, int64_t start_ns, int64_t end_ns) {
    if (!ctx || !kind || !group || end_ns < start_ns) return;
    struct fsdp__trace_lane *l = lock_lane(ctx, false);
    if (!l) return;
    coll_span(l, kind, group, seq, bytes, start_ns, start_ns, end_ns);
    unlock_lane(ctx, l);
}

/* ---- the recorder --------------------------------------------------------------------------- */

static const fsdp__abi_struct_t trace_options_abi =
    FSDP__ABI_STRUCT(fsdp_trace_options_t, "fsdp_trace_options_init", memory);

void(fsdp_trace_options_init)(fsdp_trace_options_t *opts, size_t size) {
    fsdp_trace_options_t d;
    memset(&d, 0, sizeof d);
    d.max_events = DEFAULT_MAX_EVENTS;
    d.memory = true;
    fsdp__abi_init(opts, size, &d, &trace_options_abi);
}

int fsdp_trace_create(const fsdp_trace_options_t *opts, fsdp_trace_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    int rc = fsdp__abi_check(NULL, "fsdp_trace_create", "opts", opts, &trace_options_abi);
    if (rc < 0) return rc;
    fsdp_trace_options_t d;
    if (!opts) {
        fsdp_trace_options_init(&d);
        opts = &d;
    }
    fsdp_trace_t *t = calloc(1, sizeof *t);
    if (!t) return FSDP_ENOMEM;
    pthread_mutex_init(&t->mu, NULL);
    t->refs = 1;
    t->max_events = opts->max_events ? opts->max_events : DEFAULT_MAX_EVENTS;
    t->memory = opts->memory;
    *out = t;
    return FSDP_OK;
}

/* Drops one reference; the last one frees the recorder and its lanes. */
static void trace_unref(fsdp_trace_t *t) {
    pthread_mutex_lock(&t->mu);
    bool last = --t->refs == 0;
    pthread_mutex_unlock(&t->mu);
    if (!last) return;
    for (struct fsdp__trace_lane *l = t->lanes, *next; l; l = next) {
        next = l->next;
        lane_free(l);
    }
    pthread_mutex_destroy(&t->mu);
    free(t);
}

void fsdp_trace_destroy(fsdp_trace_t *trace) {
    if (trace) trace_unref(trace);
}

int fsdp_trace_start(fsdp_ctx_t *ctx, fsdp_trace_t *trace) {
    if (!ctx) return FSDP_EINVAL;
    if (!trace) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_trace_start: trace is NULL");
    int rc = FSDP_OK;
    pthread_mutex_lock(&ctx->trace_mu);
    if (atomic_load_explicit(&ctx->trace, memory_order_relaxed)) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "fsdp_trace_start: rank %d records a trace already; "
                           "fsdp_trace_stop() it first",
                           ctx->rank);
        goto out;
    }
    pthread_mutex_lock(&trace->mu);
    struct fsdp__trace_lane **p = &trace->lanes;
    while (*p && (*p)->rank < ctx->rank)
        p = &(*p)->next;
    struct fsdp__trace_lane *l = *p && (*p)->rank == ctx->rank ? *p : NULL;
    if (l) {
        pthread_mutex_lock(&l->mu);
        bool busy = l->active;
        pthread_mutex_unlock(&l->mu);
        if (busy) {
            pthread_mutex_unlock(&trace->mu);
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_trace_start: another context of rank %d records into this "
                               "trace now",
                               ctx->rank);
            goto out;
        }
    } else {
        l = calloc(1, sizeof *l);
        if (!l) {
            pthread_mutex_unlock(&trace->mu);
            rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_trace_start: out of memory");
            goto out;
        }
        l->trace = trace;
        l->rank = ctx->rank;
        pthread_mutex_init(&l->mu, NULL);
        l->next = *p;
        *p = l;
    }
    trace->refs++;
    pthread_mutex_lock(&l->mu);
    l->active = true;
    l->owner = pthread_self();
    l->depth = 0;
    pthread_mutex_unlock(&l->mu);
    pthread_mutex_unlock(&trace->mu);
    atomic_store_explicit(&ctx->trace, l, memory_order_relaxed);
out:
    pthread_mutex_unlock(&ctx->trace_mu);
    return rc;
}

void fsdp_trace_stop(fsdp_ctx_t *ctx) {
    if (!ctx) return;
    int64_t now = fsdp__trace_now(ctx);
    pthread_mutex_lock(&ctx->trace_mu);
    struct fsdp__trace_lane *l = atomic_load_explicit(&ctx->trace, memory_order_relaxed);
    fsdp_trace_t *t = l ? l->trace : NULL;
    if (l) {
        pthread_mutex_lock(&l->mu);
        close_spans(t, l, 0, now);
        sample_memory(t, l, ctx, now);
        l->active = false;
        pthread_mutex_unlock(&l->mu);
        atomic_store_explicit(&ctx->trace, NULL, memory_order_relaxed);
    }
    pthread_mutex_unlock(&ctx->trace_mu);
    if (t) trace_unref(t);
}

bool fsdp_trace_enabled(const fsdp_ctx_t *ctx) {
    return fsdp__tracing(ctx);
}

void fsdp_trace_begin(fsdp_ctx_t *ctx, const char *name) {
    if (fsdp__tracing(ctx) && name) fsdp__trace_begin(ctx, FSDP__TRACE_USER, name);
}

void fsdp_trace_end(fsdp_ctx_t *ctx, const char *name) {
    if (fsdp__tracing(ctx) && name) fsdp__trace_end(ctx, FSDP__TRACE_USER, name);
}

const char *fsdp_trace_last_error(const fsdp_trace_t *trace) {
    return trace ? trace->err : "no trace";
}

static size_t count_events(const fsdp_trace_t *trace, bool dropped) {
    if (!trace) return 0;
    fsdp_trace_t *t = (fsdp_trace_t *)trace; /* locking does not change the recorder */
    size_t n = 0;
    pthread_mutex_lock(&t->mu);
    for (struct fsdp__trace_lane *l = t->lanes; l; l = l->next) {
        pthread_mutex_lock(&l->mu);
        n += dropped ? l->dropped : l->nev;
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

size_t fsdp_trace_num_events(const fsdp_trace_t *trace) {
    return count_events(trace, false);
}

size_t fsdp_trace_dropped_events(const fsdp_trace_t *trace) {
    return count_events(trace, true);
}

/* ---- writing -------------------------------------------------------------------------------- */

/* Writes s as a JSON string: quotes, escapes, and U+FFFD for bytes that are not UTF-8, so the
 * file is valid JSON whatever a module was named. */
static void put_str(FILE *f, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    putc('"', f);
    while (*p) {
        unsigned char c = *p;
        if (c == '"' || c == '\\') {
            putc('\\', f);
            putc(c, f);
            p++;
        } else if (c < 0x20) {
            fprintf(f, "\\u%04x", c);
            p++;
        } else if (c < 0x80) {
            putc(c, f);
            p++;
        } else {
            /* The length of a well-formed sequence starting here, 0 when it is not one. */
            int n = c >= 0xC2 && c <= 0xDF   ? 2
                    : c >= 0xE0 && c <= 0xEF ? 3
                    : c >= 0xF0 && c <= 0xF4 ? 4
                                             : 0;
            for (int i = 1; i < n; i++)
                if ((p[i] & 0xC0) != 0x80) n = 0;
            if (n == 3 && ((c == 0xE0 && p[1] < 0xA0) || (c == 0xED && p[1] > 0x9F))) n = 0;
            if (n == 4 && ((c == 0xF0 && p[1] < 0x90) || (c == 0xF4 && p[1] > 0x8F))) n = 0;
            if (n) {
                fwrite(p, 1, (size_t)n, f);
                p += n;
            } else {
                fputs("\\ufffd", f);
                p++;
            }
        }
    }
    putc('"', f);
}

/* Nanoseconds as microseconds with three decimals, exactly. */
static void put_us(FILE *f, int64_t ns) {
    if (ns < 0) {
        putc('-', f);
        ns = -ns;
    }
    fprintf(f, "%lld.%03lld", (long long)(ns / 1000), (long long)(ns % 1000));
}

/* Order of a lane's events in the file: by time, the longer span first at equal times (so an
 * enclosing span precedes what it contains, as viewers expect). */
static int ev_cmp(const void *a, const void *b) {
    const struct ev *x = *(const struct ev *const *)a, *y = *(const struct ev *const *)b;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    if (x->dur != y->dur) return x->dur > y->dur ? -1 : 1;
    return (x->kind > y->kind) - (x->kind < y->kind);
}

static void put_meta(FILE *f, int pid, int tid, const char *what, const char *key, const char *text,
                     int num, bool *first) {
    fprintf(f, "%s\n{\"ph\":\"M\",\"pid\":%d,", *first ? "" : ",", pid);
    if (tid) fprintf(f, "\"tid\":%d,", tid);
    fprintf(f, "\"name\":\"%s\",\"args\":{\"%s\":", what, key);
    if (text)
        put_str(f, text);
    else
        fprintf(f, "%d", num);
    fputs("}}", f);
    *first = false;
}

static void put_event(FILE *f, const struct fsdp__trace_lane *l, const struct ev *e) {
    int pid = l->rank;
    if (e->kind == EV_MEM) {
        fprintf(f, ",\n{\"ph\":\"C\",\"pid\":%d,\"name\":\"memory\",\"ts\":", pid);
        put_us(f, e->ts);
        fputs(",\"args\":{", f);
        for (int c = 0; c < FSDP_MEM_NCAT; c++)
            fprintf(f, "%s\"%s\":%llu", c ? "," : "", fsdp_mem_cat_name((fsdp_mem_cat_t)c),
                    (unsigned long long)e->u.mem[c]);
        fputs("}}", f);
        return;
    }
    bool coll = e->kind == EV_COLL;
    fprintf(f, ",\n{\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":", pid,
            coll ? TID_COMM : TID_COMPUTE);
    put_us(f, e->ts);
    fputs(",\"dur\":", f);
    put_us(f, e->dur);
    if (coll) {
        fputs(",\"cat\":\"comm\",\"name\":", f);
        put_str(f, l->strs[e->name]);
        fprintf(f, ",\"args\":{\"bytes\":%llu,\"group\":", (unsigned long long)e->u.coll.bytes);
        put_str(f, l->strs[e->group]);
        fprintf(f, ",\"seq\":%llu,\"issued_us\":", (unsigned long long)e->u.coll.seq);
        put_us(f, e->u.coll.issued);
        fputs("}}", f);
        return;
    }
    fprintf(f, ",\"cat\":\"%s\",\"name\":", cat_names[e->cat]);
    const char *name = l->strs[e->name];
    if (cat_prefix[e->cat][0]) {
        size_t a = strlen(cat_prefix[e->cat]), b = strlen(name);
        char *full = malloc(a + b + 1);
        if (full) {
            memcpy(full, cat_prefix[e->cat], a);
            memcpy(full + a, name, b + 1);
            put_str(f, full);
            free(full);
        } else {
            put_str(f, name);
        }
    } else {
        put_str(f, name);
    }
    if (e->cat == FSDP__TRACE_FORWARD || e->cat == FSDP__TRACE_BACKWARD ||
        e->cat == FSDP__TRACE_RECOMPUTE) {
        fputs(",\"args\":{\"unit\":", f);
        put_str(f, name);
        fputs("}", f);
    }
    fputs("}", f);
}

/* Writes lane l (locked by the caller). Returns FSDP_ENOMEM when the sort buffer is out. */
static int put_lane(FILE *f, const struct fsdp__trace_lane *l, bool *first) {
    char text[32];
    snprintf(text, sizeof text, "rank %d", l->rank);
    put_meta(f, l->rank, 0, "process_name", "name", text, 0, first);
    put_meta(f, l->rank, 0, "process_sort_index", "sort_index", NULL, l->rank, first);
    put_meta(f, l->rank, TID_COMPUTE, "thread_name", "name", "compute", 0, first);
    put_meta(f, l->rank, TID_COMPUTE, "thread_sort_index", "sort_index", NULL, 0, first);
    put_meta(f, l->rank, TID_COMM, "thread_name", "name", "communication", 0, first);
    put_meta(f, l->rank, TID_COMM, "thread_sort_index", "sort_index", NULL, 1, first);
    if (l->nev == 0) return FSDP_OK;
    const struct ev **order = malloc(l->nev * sizeof *order);
    if (!order) return FSDP_ENOMEM;
    size_t n = 0;
    for (const struct chunk *c = l->head; c; c = c->next)
        for (size_t i = 0; i < c->n; i++)
            order[n++] = &c->ev[i];
    qsort(order, n, sizeof *order, ev_cmp);
    for (size_t i = 0; i < n; i++)
        put_event(f, l, order[i]);
    free(order);
    return FSDP_OK;
}

static int write_err(fsdp_trace_t *t, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
static int write_err(fsdp_trace_t *t, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&t->mu);
    fsdp__verr(t->err, rc, fmt, ap);
    pthread_mutex_unlock(&t->mu);
    va_end(ap);
    return rc;
}

int fsdp_trace_write(fsdp_trace_t *trace, const char *path) {
    if (!trace) return FSDP_EINVAL;
    if (!path || !path[0])
        return write_err(trace, FSDP_EINVAL, "fsdp_trace_write: the path is %s",
                         path ? "empty" : "NULL");
    /* Written to a temporary file beside path and renamed over it when whole (fsdp__replace):
     * a failed or killed write leaves any earlier file as it was, and a path that is not a
     * regular file (a device, a FIFO, a link) is refused rather than written through. */
    char why[FSDP_ERR_LEN - 64];
    fsdp__replace_t r;
    int rc = fsdp__replace_begin(&r, AT_FDCWD, path, 0666, false, why, sizeof why);
    if (rc < 0) return write_err(trace, FSDP_EINVAL, "fsdp_trace_write: %s", why);
    FILE *f = fdopen(r.fd, "w");
    if (!f) {
        int e = errno;
        fsdp__replace_abort(&r);
        return write_err(trace, FSDP_ENOMEM, "fsdp_trace_write: '%s': fdopen: %s", path,
                         strerror(e));
    }
    r.fd = -1; /* the stream owns the descriptor now */
    setvbuf(f, NULL, _IOFBF, (size_t)1 << 20);
    size_t dropped = 0;
    bool first = true;
    fputs("{\"traceEvents\":[", f);
    pthread_mutex_lock(&trace->mu);
    for (struct fsdp__trace_lane *l = trace->lanes; l && rc == FSDP_OK; l = l->next) {
        pthread_mutex_lock(&l->mu);
        rc = put_lane(f, l, &first);
        dropped += l->dropped;
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_unlock(&trace->mu);
    fprintf(f,
            "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"libfsdp %s\","
            "\"clock\":\"CLOCK_MONOTONIC\",\"dropped_events\":%zu}}\n",
            fsdp_version_string(), dropped);
    int werr = ferror(f) ? errno : 0;
    if (fclose(f) != 0 && !werr) werr = errno ? errno : EIO;
    if (rc == FSDP_OK && werr) {
        fsdp__replace_abort(&r);
        return write_err(trace, FSDP_EINVAL, "fsdp_trace_write: writing '%s' failed: %s", path,
                         strerror(werr));
    }
    if (rc < 0) {
        fsdp__replace_abort(&r);
        return write_err(trace, rc, "fsdp_trace_write: out of memory writing '%s'", path);
    }
    if ((rc = fsdp__replace_commit(&r, why, sizeof why)) < 0)
        return write_err(trace, FSDP_EINVAL, "fsdp_trace_write: %s", why);
    return FSDP_OK;
}
