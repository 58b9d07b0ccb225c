/* SPDX-License-Identifier: MIT */
/*
 * t_trace.c: the trace recorder (fsdp/trace.h), read back through tests/trace_json.c (jansson,
 * strict RFC 8259, every event's fields checked, spans properly nested on every track).
 *   - the recorder alone: off by default and free of events; argument checks; user spans nest
 *     (an end closes the spans left open inside it, an end that matches nothing is ignored);
 *     spans of another thread than the compute track's are dropped; names with quotes,
 *     backslashes, control characters and bytes that are not UTF-8 still give valid JSON; the
 *     event bound drops and counts; a path that cannot be written fails with the path in the
 *     message and leaves no file; the recorder may be destroyed while a rank records;
 *   - a 2-rank FULL_SHARD GPT run on the sim backend: every unit has forward and backward spans
 *     on both ranks, each unit's backward inside the autograd backward pass, the optimizer step
 *     once per step, collectives on their own track, one after the other, whose bytes per kind
 *     are what the process group's counters say, and memory counters with every category;
 *   - with activation checkpointing: every block's recompute span, once per step, inside the
 *     backward pass and inside the root unit's backward;
 *   - overlap: under a simulated latency per collective (comm_latency_us), the fraction of
 *     communication time during which the compute track computes (inside a span and not waiting
 *     on a collective) is larger with backward prefetch than without any prefetch, by a margin;
 *     both fractions are measured from the trace, never absolute times.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"
#include "trace_json.h"

#define WORLD 2
#define MAXU 16

static char tmpdir[256];

static void path_of(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", tmpdir, name);
}

/* ---- the recorder alone --------------------------------------------------------------------- */

static void *other_thread(void *arg) {
    fsdp_ctx_t *ctx = arg;
    fsdp_trace_begin(ctx, "other thread");
    fsdp_trace_end(ctx, "other thread");
    return NULL;
}

static const tj_span_t *find_span(const tj_trace_t *t, const char *name) {
    for (size_t i = 0; i < t->nspans; i++)
        if (strcmp(t->spans[i].name, name) == 0) return &t->spans[i];
    return NULL;
}

static void test_recorder(void) {
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_OFF);
    fsdp_trace_t *tr = NULL;
    char path[512];

    tap_is_int(fsdp_trace_create(NULL, NULL), FSDP_EINVAL, "create without out: EINVAL");
    tap_is_int(fsdp_trace_create(NULL, &tr), FSDP_OK, "create with the default options");
    if (!tr) tap_bail("no recorder");
    tap_ok(!fsdp_trace_enabled(ctx), "a context does not record by default");
    fsdp_trace_begin(ctx, "off");
    fsdp_trace_end(ctx, "off");
    tap_is_size(fsdp_trace_num_events(tr), 0, "spans while off record nothing");
    tap_is_int(fsdp_trace_start(ctx, NULL), FSDP_EINVAL, "start without a recorder: EINVAL");
    tap_is_int(fsdp_trace_start(NULL, tr), FSDP_EINVAL, "start without a context: EINVAL");

    tap_is_int(fsdp_trace_start(ctx, tr), FSDP_OK, "start");
    tap_ok(fsdp_trace_enabled(ctx), "the context records");
    tap_is_int(fsdp_trace_start(ctx, tr), FSDP_EINVAL, "starting twice: EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "records a trace already", "and the message says why");
    fsdp_trace_begin(ctx, "a");
    fsdp_trace_begin(ctx, "b");
    fsdp_trace_end(ctx, "b");
    fsdp_trace_begin(ctx, "c"); /* left open: a's end closes it */
    pthread_t th;
    pthread_create(&th, NULL, other_thread, ctx);
    pthread_join(th, NULL);
    nanosleep(&(struct timespec){0, 1000000}, NULL);
    fsdp_trace_end(ctx, "a");
    fsdp_trace_end(ctx, "no such span");
    fsdp_trace_begin(ctx, "odd \"name\" \\ with\nnewline \xff\xc3\xa9");
    fsdp_trace_end(ctx, "odd \"name\" \\ with\nnewline \xff\xc3\xa9");
    fsdp_trace_begin(ctx, "open at stop");
    fsdp_trace_stop(ctx);
    tap_ok(!fsdp_trace_enabled(ctx), "stopped");
    fsdp_trace_stop(ctx); /* a no-op */

    path_of(path, sizeof path, "alone.json");
    tap_is_int(fsdp_trace_write(tr, path), FSDP_OK, "write %s", path);
    tj_trace_t t;
    int rc = tj_load(path, &t);
    tap_ok_why(rc == 0, t.err, "the file is valid JSON with well-formed events");
    char err[1024] = "";
    tap_ok_why(rc == 0 && tj_check_nesting(&t, err, sizeof err) == 0, err, "spans nest");
    const tj_span_t *a = find_span(&t, "a"), *b = find_span(&t, "b"), *c = find_span(&t, "c");
    const tj_span_t *o = find_span(&t, "open at stop");
    tap_ok(t.nspans == 5 && a && b && c && o && !find_span(&t, "other thread"),
           "five spans (a, b, c, the odd name, the one open at stop), none from another thread "
           "(%zu)",
           t.nspans);
    tap_ok(a && b && c && tj_within(b, a) && tj_within(c, a) && c->ts + c->dur == a->ts + a->dur &&
               a->pid == 0 && a->tid == 1 && strcmp(a->cat, "user") == 0,
           "b and c inside a, c closed by a's end, on rank 0's compute track, category user");
    tap_ok(find_span(&t, "odd \"name\" \\ with\nnewline \xef\xbf\xbd\xc3\xa9") != NULL,
           "quotes, backslash and newline round-trip; a byte that is not UTF-8 becomes U+FFFD");
    tap_ok(t.npids == 1 && t.pids[0] == 0 && t.nmem_counters >= 1,
           "rank 0 is named, with a memory counter of every category");
    tj_free(&t);

    /* Writing where it cannot. */
    tap_is_int(fsdp_trace_write(tr, "/nonexistent-dir/t.json"), FSDP_EINVAL,
               "a path in a missing directory: EINVAL");
    tap_has_str(fsdp_trace_last_error(tr), "'/nonexistent-dir/t.json'",
                "the message names the path");
    tap_is_int(fsdp_trace_write(tr, tmpdir), FSDP_EINVAL, "a directory: EINVAL");
    tap_is_int(fsdp_trace_write(tr, NULL), FSDP_EINVAL, "a NULL path: EINVAL");
    if (access("/dev/full", W_OK) == 0) {
        /* A device is refused before anything is written through it (core/file.c). */
        tap_is_int(fsdp_trace_write(tr, "/dev/full"), FSDP_EINVAL, "a device: EINVAL");
        tap_has_str(fsdp_trace_last_error(tr), "'/dev/full' is a character device",
                    "the message names the path and what it is");
    } else {
        tap_skip(2, "no /dev/full");
    }

    /* Restarting on the same recorder continues rank 0. */
    tap_is_int(fsdp_trace_start(ctx, tr), FSDP_OK, "restart on the same recorder");
    size_t before = fsdp_trace_num_events(tr);
    fsdp_trace_begin(ctx, "again");
    fsdp_trace_end(ctx, "again");
    tap_ok(fsdp_trace_num_events(tr) > before, "and records again");
    /* The owner lets go while the rank records: the recorder lives until the rank stops. */
    fsdp_trace_destroy(tr);
    fsdp_trace_begin(ctx, "after destroy");
    fsdp_trace_end(ctx, "after destroy");
    fsdp_trace_stop(ctx);
    tap_ok(1, "destroying the recorder while a rank records is safe (ASan would say)");

    /* The bound. */
    fsdp_trace_options_t opt;
    fsdp_trace_options_init(&opt);
    opt.max_events = 3;
    opt.memory = false;
    tr = NULL;
    if (fsdp_trace_create(&opt, &tr) < 0) tap_bail("create");
    fsdp_trace_start(ctx, tr);
    for (int i = 0; i < 5; i++) {
        fsdp_trace_begin(ctx, "s");
        fsdp_trace_end(ctx, "s");
    }
    fsdp_trace_stop(ctx);
    tap_ok(fsdp_trace_num_events(tr) == 3 && fsdp_trace_dropped_events(tr) == 2,
           "max_events 3: three spans kept, two dropped (%zu, %zu)", fsdp_trace_num_events(tr),
           fsdp_trace_dropped_events(tr));
    path_of(path, sizeof path, "bound.json");
    rc = fsdp_trace_write(tr, path) == 0 ? tj_load(path, &t) : -1;
    tap_ok(rc == 0 && t.dropped == 2 && t.nmem_counters == 0,
           "the file says two were dropped, and has no memory counter when it is off");
    tj_free(&t);
    fsdp_trace_destroy(tr);
    fsdp_ctx_destroy(ctx);
}

/* ---- GPT runs on 2 sim ranks ---------------------------------------------------------------- */

typedef struct run_cfg {
    const char *name;
    int warmup, steps; /* untraced, then traced steps */
    bool ac;           /* activation checkpointing of every GPTBlock */
    fsdp_backward_prefetch_t bp;
    int layers, d, seq, batch;
    int64_t latency_us;
} run_cfg_t;

typedef struct rank_out {
    int rc;
    char what[1024];
    fsdp_pg_counters_t counters; /* the world group's, over the traced steps */
    char units[MAXU][64];        /* unit labels as the trace writes them */
    int nunits;
} rank_out_t;

typedef struct run {
    const run_cfg_t *cfg;
    fsdp_trace_t *trace;
    rank_out_t out[WORLD];
} run_t;

#define TRY(call, label)                                                                           \
    do {                                                                                           \
        if ((rc = (call)) < 0) {                                                                   \
            snprintf(o->what, sizeof o->what, "%s: %s: %s", label, fsdp_strerror(rc),              \
                     fsdp_ctx_last_error(ctx));                                                    \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

static int rank_fn(fsdp_ctx_t *ctx, void *arg) {
    run_t *run = arg;
    const run_cfg_t *c = run->cfg;
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    rank_out_t *o = &run->out[rank];
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **units = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *tok = NULL, *tgt = NULL, *loss = NULL;
    size_t nu = 0;

    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 64;
    cfg.max_seq = c->seq;
    cfg.n_layer = c->layers;
    cfg.n_head = 4;
    cfg.d_model = c->d;
    cfg.dropout = 0.0;
    TRY(fsdp_gpt_recipe_create_model(ctx, &cfg, 3, &m), "model");
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = FSDP_FULL_SHARD;
    fo.backward_prefetch = c->bp;
    fo.forward_prefetch = false;
    TRY(fsdp_gpt_recipe_wrap(m, &fo, &root), "wrap");
    if (c->ac) TRY(fsdp_apply_activation_checkpointing(m, "GPTBlock", NULL, NULL, NULL), "ac");
    TRY(fsdp_gpt_recipe_create_adamw(m, NULL, &opt), "AdamW");
    TRY(fsdp_units(root, &units, &nu), "units");
    for (size_t i = 0; i < nu && i < MAXU; i++)
        snprintf(o->units[o->nunits++], sizeof o->units[0], "%s",
                 fsdp_unit_fqn(units[i])[0] ? fsdp_unit_fqn(units[i]) : "<root>");

    int64_t shape[2] = {c->batch, c->seq};
    int64_t *ids = calloc((size_t)(c->batch * c->seq), sizeof *ids);
    int64_t *next = calloc((size_t)(c->batch * c->seq), sizeof *next);
    if (!ids || !next) TRY(FSDP_ENOMEM, "alloc");
    for (int64_t i = 0; i < c->batch * c->seq; i++) {
        ids[i] = (i * 7 + rank * 29 + (i * i) % 5) % cfg.vocab;
        next[i] = (ids[i] * 3 + 1) % cfg.vocab;
    }
    rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, ids, FSDP_MEM_OTHER, &tok);
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, next, FSDP_MEM_OTHER, &tgt);
    free(ids);
    free(next);
    TRY(rc, "batch");
    for (int s = 0; s < c->warmup + c->steps; s++) {
        if (s == c->warmup) {
            fsdp_pg_reset_counters(pg);
            TRY(fsdp_trace_start(ctx, run->trace), "trace start");
        }
        TRY(fsdp_gpt_forward_loss(m, tok, tgt, &loss, NULL), "forward");
        TRY(fsdp_backward(loss, NULL), "backward");
        TRY(fsdp_optim_step(opt), "step");
        TRY(fsdp_optim_zero_grad(opt, true), "zero_grad");
        fsdp_tensor_release(loss);
        loss = NULL;
    }
    fsdp_pg_get_counters(pg, &o->counters);
out:
    fsdp_trace_stop(ctx);
    free(units);
    fsdp_tensor_release(tok), fsdp_tensor_release(tgt), fsdp_tensor_release(loss);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    o->rc = rc;
    return rc;
}

/* Runs c on WORLD sim ranks into a new recorder, writes it to <tmpdir>/<file> and loads it into
 * *t. Returns 0, or -1 (reported as a failed check). */
static int run_gpt(const run_cfg_t *c, run_t *run, const char *file, tj_trace_t *t, bool report) {
    memset(run, 0, sizeof *run);
    memset(t, 0, sizeof *t);
    run->cfg = c;
    if (fsdp_trace_create(NULL, &run->trace) < 0) tap_bail("fsdp_trace_create");
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = WORLD;
    so.seed = 11;
    so.comm_latency_us = c->latency_us;
    int rc = fsdp_sim_run(&so, rank_fn, run, NULL);
    char why[2200];
    snprintf(why, sizeof why, "rank 0: %s\nrank 1: %s", run->out[0].what, run->out[1].what);
    if (report) tap_ok_why(rc == 0, why, "%s: the run succeeds", c->name);
    char path[512];
    path_of(path, sizeof path, file);
    int wrc = fsdp_trace_write(run->trace, path);
    if (report)
        tap_ok_why(wrc == 0, fsdp_trace_last_error(run->trace), "%s: the trace is written",
                   c->name);
    int lrc = wrc == 0 ? tj_load(path, t) : -1;
    if (report)
        tap_ok_why(lrc == 0, t->err, "%s: it is valid JSON with well-formed events", c->name);
    char err[1024] = "";
    int nrc = lrc == 0 ? tj_check_nesting(t, err, sizeof err) : -1;
    if (report) tap_ok_why(nrc == 0, err, "%s: spans nest on every track", c->name);
    if (!report && (rc < 0 || wrc < 0 || lrc < 0 || nrc < 0))
        tap_diag("%s: run %s, write %s, load %s, nesting %s", c->name, why,
                 fsdp_trace_last_error(run->trace), t->err, err);
    return rc == 0 && lrc == 0 && nrc == 0 ? 0 : -1;
}

/* The autograd backward pass containing s, if any. */
static const tj_span_t *enclosing(const tj_trace_t *t, const tj_span_t *s, const char *cat,
                                  const char *unit) {
    for (size_t i = 0; i < t->nspans; i++) {
        const tj_span_t *p = &t->spans[i];
        if (p == s || strcmp(p->cat, cat) != 0) continue;
        if (unit && strcmp(p->unit, unit) != 0) continue;
        if (tj_within(s, p)) return p;
    }
    return NULL;
}

static void test_gpt(void) {
    const run_cfg_t c = {.name = "FULL_SHARD GPT",
                         .warmup = 0,
                         .steps = 2,
                         .bp = FSDP_BACKWARD_PRE,
                         .layers = 3,
                         .d = 32,
                         .seq = 16,
                         .batch = 2};
    static run_t run;
    tj_trace_t t;
    int ok = run_gpt(&c, &run, "gpt.json", &t, true) == 0;
    tap_ok(ok && t.npids == WORLD && t.pids[0] == 0 && t.pids[1] == 1,
           "both ranks are processes of the trace, named");
    tap_ok(ok && run.out[0].nunits == c.layers + 1, "%d units (the root and a unit per block)",
           run.out[0].nunits);

    /* Every unit: forward and backward spans on both ranks, backward inside the pass. */
    char why[2048] = "";
    size_t n = 0;
    for (int r = 0; ok && r < WORLD; r++)
        for (int u = 0; u < run.out[r].nunits; u++) {
            const char *name = run.out[r].units[u];
            size_t f = tj_count(&t, r, 1, "forward", name);
            size_t b = tj_count(&t, r, 1, "backward", name);
            if ((f != (size_t)c.steps || b != (size_t)c.steps) && n < sizeof why)
                n +=
                    (size_t)snprintf(why + n, sizeof why - n,
                                     "rank %d unit %s: %zu forward, %zu backward\n", r, name, f, b);
        }
    tap_ok_why(ok && n == 0, why,
               "every unit has one forward and one backward span per step on "
               "each rank");
    size_t outside = 0, bwd = 0;
    for (size_t i = 0; ok && i < t.nspans; i++) {
        const tj_span_t *s = &t.spans[i];
        if (strcmp(s->cat, "backward") != 0) continue;
        bwd++;
        if (!enclosing(&t, s, "autograd", NULL)) outside++;
        if (strcmp(s->unit, "<root>") != 0 && !enclosing(&t, s, "backward", "<root>")) outside++;
    }
    tap_ok(ok && bwd > 0 && outside == 0,
           "each unit's backward lies inside the autograd backward pass, and each block's inside "
           "the root's (%zu outside)",
           outside);

    /* The optimizer. */
    for (int r = 0; r < WORLD; r++)
        tap_is_size(ok ? tj_count(&t, r, 1, "optimizer", NULL) : 0, (size_t)c.steps,
                    "rank %d: one optimizer span per step", r);

    /* Collectives: on track 2, one after the other, bytes as counted. */
    for (int r = 0; r < WORLD; r++) {
        uint64_t bytes[FSDP_COLL_COUNT] = {0}, calls[FSDP_COLL_COUNT] = {0};
        int64_t last_end = 0;
        size_t overlapping = 0, bad = 0;
        for (size_t i = 0; ok && i < t.nspans; i++) {
            const tj_span_t *s = &t.spans[i];
            if (s->pid != r || s->tid != 2) continue;
            int k = 0;
            while (k < FSDP_COLL_COUNT && strcmp(fsdp_coll_name((fsdp_coll_kind_t)k), s->name))
                k++;
            if (k == FSDP_COLL_COUNT || !s->has_bytes || strcmp(s->cat, "comm") != 0 ||
                strcmp(s->group, "world") != 0) {
                bad++;
                continue;
            }
            bytes[k] += s->bytes;
            calls[k]++;
            if (s->ts < last_end) overlapping++;
            last_end = s->ts + s->dur;
        }
        const fsdp_pg_counters_t *pc = &run.out[r].counters;
        char d[1024];
        size_t m = 0;
        bool same = ok && bad == 0;
        for (int k = 0; k < FSDP_COLL_COUNT; k++) {
            same &= bytes[k] == pc->bytes[k] && calls[k] == pc->calls[k];
            m += (size_t)snprintf(d + m, sizeof d - m,
                                  "%s: trace %llu bytes in %llu, counters "
                                  "%llu in %llu\n",
                                  fsdp_coll_name((fsdp_coll_kind_t)k), (unsigned long long)bytes[k],
                                  (unsigned long long)calls[k], (unsigned long long)pc->bytes[k],
                                  (unsigned long long)pc->calls[k]);
        }
        tap_ok_why(same && calls[FSDP_COLL_ALL_GATHER] > 0 && calls[FSDP_COLL_REDUCE_SCATTER] > 0,
                   d,
                   "rank %d: collective spans carry the bytes and calls the group counted, per "
                   "kind (all-gathers and reduce-scatters among them)",
                   r);
        tap_ok(ok && overlapping == 0, "rank %d: collectives follow each other on their track", r);
    }
    tap_ok(ok && t.nmem_counters >= 2 * WORLD && t.nmem_counters == t.ncounters,
           "memory counters of every category on both ranks (%zu)", t.nmem_counters);
    size_t events = t.nspans + t.ncounters;
    tap_ok(ok && fsdp_trace_num_events(run.trace) == events && t.dropped == 0,
           "the recorder counted the %zu events of the file and dropped none", events);
    tj_free(&t);
    fsdp_trace_destroy(run.trace);
}

static void test_act_ckpt(void) {
    const run_cfg_t c = {.name = "activation checkpointing",
                         .warmup = 1,
                         .steps = 2,
                         .ac = true,
                         .bp = FSDP_BACKWARD_PRE,
                         .layers = 2,
                         .d = 32,
                         .seq = 16,
                         .batch = 2};
    static run_t run;
    tj_trace_t t;
    int ok = run_gpt(&c, &run, "ac.json", &t, true) == 0;
    char why[2048] = "";
    size_t n = 0, recompute = 0;
    for (int r = 0; ok && r < WORLD; r++)
        for (int u = 1; u < run.out[r].nunits; u++) {
            const char *name = run.out[r].units[u];
            size_t k = tj_count(&t, r, 1, "recompute", name);
            recompute += k;
            if (k != (size_t)c.steps && n < sizeof why)
                n += (size_t)snprintf(why + n, sizeof why - n, "rank %d unit %s: %zu recompute\n",
                                      r, name, k);
        }
    tap_ok_why(ok && n == 0 && tj_count(&t, 0, 1, "recompute", "<root>") == 0, why,
               "every block has one recompute span per step on each rank, the root none");
    size_t outside = 0;
    for (size_t i = 0; ok && i < t.nspans; i++) {
        const tj_span_t *s = &t.spans[i];
        if (strcmp(s->cat, "recompute") != 0) continue;
        if (!enclosing(&t, s, "autograd", NULL) || !enclosing(&t, s, "backward", "<root>") ||
            !enclosing(&t, s, "checkpoint", NULL))
            outside++;
    }
    tap_ok(ok && recompute > 0 && outside == 0,
           "each recompute span lies inside the backward pass, the root's backward and a "
           "checkpoint region (%zu of %zu outside)",
           outside, recompute);
    tj_free(&t);
    fsdp_trace_destroy(run.trace);
}

/*
 * Communication time overlapped by compute, with and without backward prefetch (forward
 * prefetch off in both), on a 4-block GPT whose block computes about as long as the simulated
 * latency of 1 ms per collective, so that a prefetched all-gather can hide behind it. Two
 * fractions per run, averaged over the ranks: of all communication time, and of the time of the
 * all-gathers issued during the backward pass (what backward prefetch moves). Measured on a
 * loaded 2-core machine (plain and ASan builds): all communication 5-30% without prefetch and
 * 28-68% with; backward all-gathers 0-13% without and 56-87% with. The checks ask for a lead of
 * 3 points and 20 points. Timing on a shared machine can be disturbed for a moment, so a
 * measurement that misses is repeated, up to 3 times in all; every attempt is printed.
 */
static int measure_overlap(double frac[2], double bag[2]) {
    run_cfg_t c = {
        .warmup = 1, .steps = 4, .layers = 4, .d = 64, .seq = 64, .batch = 8, .latency_us = 1000};
    static run_t run;
    int64_t comm[2] = {0, 0}, bag_ns[2] = {0, 0};
    int ok = 1;
    for (int i = 0; i < 2; i++) {
        c.name = i ? "BACKWARD_PRE prefetch" : "no prefetch";
        c.bp = i ? FSDP_BACKWARD_PRE : FSDP_BACKWARD_PREFETCH_NONE;
        frac[i] = bag[i] = 0;
        tj_trace_t t;
        ok &= run_gpt(&c, &run, i ? "prefetch.json" : "noprefetch.json", &t, false) == 0;
        for (int r = 0; ok && r < WORLD; r++) {
            int64_t ns = 0;
            frac[i] += tj_overlap_fraction(&t, r, &ns) / WORLD;
            comm[i] += ns;
            bag[i] += tj_overlap_fraction_of(&t, r, "all_gather", true, &ns) / WORLD;
            bag_ns[i] += ns;
        }
        tj_free(&t);
        fsdp_trace_destroy(run.trace);
    }
    tap_diag("compute overlaps %.1f%% of %.1f ms of communication without prefetch, %.1f%% of "
             "%.1f ms with BACKWARD_PRE; of the backward all-gathers %.1f%% of %.1f ms without, "
             "%.1f%% of %.1f ms with",
             100 * frac[0], (double)comm[0] / 1e6, 100 * frac[1], (double)comm[1] / 1e6,
             100 * bag[0], (double)bag_ns[0] / 1e6, 100 * bag[1], (double)bag_ns[1] / 1e6);
    return ok;
}

static void test_overlap(void) {
    double frac[2] = {0, 0}, bag[2] = {0, 0};
    int ok = 0, attempts = 0;
    bool good = false;
    while (!good && attempts < 3) {
        attempts++;
        ok = measure_overlap(frac, bag);
        good = ok && frac[1] >= 0.10 && frac[1] > frac[0] + 0.03 && bag[1] >= 0.25 &&
               bag[1] > bag[0] + 0.20;
    }
    tap_ok(ok, "the overlap runs (%d attempt%s) succeed with valid, nested traces", attempts,
           attempts > 1 ? "s" : "");
    tap_ok(ok && frac[1] >= 0.10,
           "with backward prefetch, compute overlaps a measurable share of the communication "
           "time (%.3f)",
           frac[1]);
    tap_ok(ok && frac[1] > frac[0] + 0.03, "and more than without prefetch (%.3f > %.3f + 0.03)",
           frac[1], frac[0]);
    tap_ok(ok && bag[1] >= 0.25 && bag[1] > bag[0] + 0.20,
           "backward all-gathers: %.3f overlapped with prefetch, %.3f without (a lead of 0.20 "
           "asked)",
           bag[1], bag[0]);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "%s/t_trace.XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) tap_bail("mkdtemp");
    setenv("FSDP_NUM_THREADS", "1", 0);
    tap_plan_lazy();
    test_recorder();
    test_gpt();
    test_act_ckpt();
    test_overlap();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) tap_diag("could not remove %s", tmpdir);
    return tap_done();
}
