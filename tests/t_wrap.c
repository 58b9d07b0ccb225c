/*
 * t_wrap.c: fsdp_wrap driven by auto-wrap policies, the manual wrap API (fsdp_enable_wrap,
 * fsdp_wrap_scoped), per-unit options (fsdp_unit_options) and the composable fsdp_fully_shard,
 * all on real units, against PyTorch's test_wrap.py (spec section 5: WRAP-FW-*, WRAP-TA-*).
 * t_wrap_policy.c covers the same cases as plans; here the plans become units.
 *
 * Construction-only cases run on the main thread's context over dummy groups (PyTorch's
 * DummyProcessGroup): pg1 (rank 0 of 1) and pg2 (rank 0 of 2, failing every collective, so a
 * wrap over it proves it did not communicate). Training cases run on sim ranks as fu_jobs:
 * WRAP-FW-04 against DDP, WRAP-TA-14's smoke step, the thread-local scope, and fully_shard
 * against fsdp_wrap. Unit sets are compared as the exact FQN list of fsdp_units() (pre-order,
 * "(root)" for the root); warnings are captured through the context's log sink.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

static fsdp_ctx_t *mctx;     /* the main thread's: no world group */
static fsdp_pg_t *pg1, *pg2; /* dummy (0 of 1), dummy (0 of 2, every collective fails) */

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ < 0)                                                                               \
            tap_bail("%s failed: %s (%s)", #call, fsdp_err_name(rc_), fsdp_ctx_last_error(mctx));  \
    } while (0)

/* ---- log capture ----------------------------------------------------------------------------- */

static struct {
    int nwarn;
    char first[2048];
    bool all_attn; /* every warning starts with "layers.<i>.attn has both" */
} logcap;

static void sink(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    (void)user, (void)rank;
    if (level != FSDP_LOG_WARN) return;
    if (logcap.nwarn++ == 0) snprintf(logcap.first, sizeof logcap.first, "%s", msg);
    int layer = -1, used = 0;
    if (sscanf(msg, "layers.%d.attn has both%n", &layer, &used) < 1 || used == 0)
        logcap.all_attn = false;
}

static void log_reset(void) {
    logcap.nwarn = 0;
    logcap.first[0] = 0;
    logcap.all_attn = true;
}

/* Functions without a context log to stderr: stderr goes into a temporary file from
 * stderr_begin() until stderr_end() returns what was written. */
static FILE *err_file;
static int err_saved = -1;

static void stderr_begin(void) {
    fflush(stderr);
    err_file = tmpfile();
    err_saved = dup(2);
    if (err_file && err_saved >= 0) dup2(fileno(err_file), 2);
}

static const char *stderr_end(void) {
    static char buf[1024];
    buf[0] = 0;
    fflush(stderr);
    if (err_saved >= 0) {
        dup2(err_saved, 2);
        close(err_saved);
        err_saved = -1;
    }
    if (!err_file) return buf;
    rewind(err_file);
    size_t got = fread(buf, 1, sizeof buf - 1, err_file);
    buf[got] = 0;
    fclose(err_file);
    err_file = NULL;
    return buf;
}

/* ---- models and helpers ---------------------------------------------------------------------- */

/* Runs the children in registration order, each on the previous one's output (MyModel and
 * Nested of test_wrap.py). */
static int chain_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    fsdp_tensor_t *x = fsdp_tensor_retain(in[0]);
    for (size_t i = 0; i < fsdp_module_num_children(m); i++) {
        fsdp_tensor_t *y = NULL;
        int rc = fsdp_module_forward1(fsdp_module_child_at(m, i, NULL), x, &y);
        fsdp_tensor_release(x);
        if (rc < 0) return rc;
        x = y;
    }
    out[0] = x;
    return FSDP_OK;
}

static const fsdp_module_ops_t mymodel_ops = {"MyModel", chain_forward, NULL};
static const fsdp_module_ops_t nested_ops = {"Nested", chain_forward, NULL};

/* Adds child under name (the parent takes it over). */
static int adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child) {
    int rc = child ? fsdp_module_add_child(m, name, child) : FSDP_ENOMEM;
    fsdp_module_release(child);
    return rc;
}

static fsdp_module_t *lin11(fsdp_ctx_t *c) {
    fsdp_module_t *l = NULL;
    return fsdp_linear_create(c, 1, 1, false, &l) < 0 ? NULL : l;
}

/* test_wrap.py's MyModel: lin1, lin2, lin3 Linear(1, 1, no bias), lin4 Nested{nested_lin
 * Linear(1, 1, no bias)}; with nested, lin1 is Sequential(Linear, Linear) instead. Seeded 0. */
static int my_model(fsdp_ctx_t *c, bool nested, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *n = NULL, *s = NULL;
    *out = NULL;
    tm_manual_seed(c, 0);
    int rc = fsdp_module_create(c, &mymodel_ops, NULL, &m);
    if (rc < 0) goto fail;
    if (nested) {
        if ((rc = fsdp_sequential_create(c, &s)) < 0) goto fail;
        for (int i = 0; i < 2 && rc == 0; i++) {
            fsdp_module_t *l = lin11(c);
            rc = l ? fsdp_module_append(s, l) : FSDP_ENOMEM;
            fsdp_module_release(l);
        }
        if (rc == 0) rc = fsdp_module_add_child(m, "lin1", s);
        fsdp_module_release(s);
        s = NULL;
    } else {
        rc = adopt(m, "lin1", lin11(c));
    }
    if (rc == 0) rc = adopt(m, "lin2", lin11(c));
    if (rc == 0) rc = adopt(m, "lin3", lin11(c));
    if (rc == 0) rc = fsdp_module_create(c, &nested_ops, NULL, &n);
    if (rc == 0) rc = adopt(n, "nested_lin", lin11(c));
    if (rc == 0) rc = fsdp_module_add_child(m, "lin4", n);
    fsdp_module_release(n);
    if (rc < 0) goto fail;
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(s);
    fsdp_module_release(m);
    return rc;
}

static fsdp_policy_t *size_policy(int64_t min) {
    fsdp_size_policy_options_t so;
    fsdp_size_policy_options_init(&so);
    so.min_num_params = min;
    fsdp_policy_t *p = NULL;
    if (fsdp_policy_size_based_create(&so, &p) < 0) tap_bail("size policy");
    return p;
}

static fsdp_policy_t *always_policy(void) {
    fsdp_policy_t *p = NULL;
    if (fsdp_policy_always_create(&p) < 0) tap_bail("always policy");
    return p;
}

/* The FQNs of root's units in pre-order, "(root)" for the root, '|'-separated (static). */
static const char *unit_names(const fsdp_unit_t *root) {
    static _Thread_local char buf[1024];
    fsdp_unit_t **u = NULL;
    size_t n = 0, o = 0;
    buf[0] = 0;
    if (!root) return "(no unit)";
    if (fsdp_units(root, &u, &n) < 0) return "(fsdp_units failed)";
    for (size_t i = 0; i < n && o < sizeof buf; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s", i ? "|" : "",
                              fsdp_unit_is_root(u[i]) ? "(root)" : fsdp_unit_fqn(u[i]));
    free(u);
    return buf;
}

/* Number of modules of m's tree that are units. */
static size_t units_in_tree(const fsdp_module_t *m) {
    fsdp_named_list_t l = {0};
    size_t n = 0;
    if (fsdp_module_named_modules(m, &l) < 0) return (size_t)-1;
    for (size_t i = 0; i < l.n; i++)
        n += fsdp_unit_of(l.modules[i]) != NULL;
    fsdp_named_list_free(&l);
    return n;
}

/* "STRATEGY/PREFETCH/precision" of a unit's reported options. */
static const char *options_str(const fsdp_unit_t *u) {
    static _Thread_local char buf[128];
    fsdp_options_t o;
    if (fsdp_unit_options(u, &o) < 0) return "(fsdp_unit_options failed)";
    const fsdp_mixed_precision_t *mp = &o.mixed_precision;
    snprintf(buf, sizeof buf, "%s/%s/%s", fsdp_sharding_strategy_name(o.strategy),
             fsdp_backward_prefetch_name(o.backward_prefetch),
             !mp->enabled                        ? "full"
             : mp->param_dtype == FSDP_DTYPE_F16 ? "f16"
                                                 : "other");
    return buf;
}

/* ---- WRAP-FW-01: auto-wrapping a tree that holds units --------------------------------------- */

static void test_fw01(void) {
    for (int nested = 0; nested < 2; nested++) {
        const char *k = nested ? "nested" : "not nested";
        const char *first = nested ? "lin1.1" : "lin1";
        fsdp_module_t *m = NULL;
        CHECK(my_model(mctx, nested, &m));
        fsdp_options_t o;
        fsdp_options_init(&o);
        o.pg = pg1;
        fsdp_unit_t *hand[3] = {NULL, NULL, NULL};
        const char *paths[3] = {first, "lin2", "lin3"};
        for (int i = 0; i < 3; i++)
            CHECK(fsdp_wrap(fsdp_module_child(m, paths[i]), &o, &hand[i]));
        fsdp_policy_t *p = size_policy(100000000);
        fsdp_options_t po = o;
        po.auto_wrap_policy = p;
        fsdp_unit_t *root = NULL;
        int rc = fsdp_wrap(m, &po, &root);
        char want[160];
        snprintf(want, sizeof want,
                 "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                 "%s in MyModel",
                 first);
        tap_is_int(rc, FSDP_EINVAL,
                   "WRAP-FW-01 (%s): a policy over a tree with hand-made units "
                   "is FSDP_EINVAL",
                   k);
        tap_is_str(fsdp_ctx_last_error(mctx), want,
                   "WRAP-FW-01 (%s): the message names the first unit in traversal order (%s)", k,
                   first);
        tap_ok(root == NULL && units_in_tree(m) == 3 && fsdp_unit_is_root(hand[0]) &&
                   fsdp_unit_is_root(hand[1]) && fsdp_unit_is_root(hand[2]),
               "WRAP-FW-01 (%s): nothing was wrapped; the three hand units stay roots", k);
        /* fully_shard with a policy refuses the same way. */
        rc = fsdp_fully_shard(m, &po, NULL);
        tap_ok(rc == FSDP_EINVAL && strcmp(fsdp_ctx_last_error(mctx), want) == 0 &&
                   units_in_tree(m) == 3,
               "WRAP-FW-01 (%s): fsdp_fully_shard with a policy refuses it too", k);
        /* Without a policy the hand units are adopted (hand nesting, F12). */
        rc = fsdp_wrap(m, &o, &root);
        tap_ok(rc == 0 && fsdp_unit_parent(hand[0]) == root && fsdp_unit_parent(hand[1]) == root &&
                   fsdp_unit_parent(hand[2]) == root,
               "WRAP-FW-01 (%s): without a policy the root adopts the hand units (%s)", k,
               rc == 0 ? unit_names(root) : fsdp_ctx_last_error(mctx));
        tap_is_str(unit_names(root), nested ? "(root)|lin1.1|lin2|lin3" : "(root)|lin1|lin2|lin3",
                   "WRAP-FW-01 (%s): the adopted tree's units", k);
        fsdp_destroy(root);
        fsdp_policy_release(p);
        fsdp_module_release(m);
    }
    /* A root that is already a unit is named as such. */
    fsdp_module_t *l = lin11(mctx);
    fsdp_unit_t *u = NULL, *u2 = NULL;
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.pg = pg1;
    if (!l) tap_bail("Linear");
    CHECK(fsdp_wrap(l, &o, &u));
    fsdp_policy_t *p = always_policy();
    o.auto_wrap_policy = p;
    int rc = fsdp_wrap(l, &o, &u2);
    tap_ok(rc == FSDP_EINVAL && u2 == NULL &&
               strcmp(fsdp_ctx_last_error(mctx),
                      "FSDP auto wrapping requires modules to not already have FSDP applied "
                      "but found the root module in Linear") == 0,
           "WRAP-FW-01: a root that is already a unit is reported as the root module (%s)",
           fsdp_ctx_last_error(mctx));
    fsdp_policy_release(p);
    fsdp_destroy(u);
    fsdp_module_release(l);
}

/* ---- WRAP-TA-01..03: the manual API and per-call overrides ---------------------------------- */

static fsdp_module_t *lin55(void) {
    fsdp_module_t *l = NULL;
    CHECK(fsdp_linear_create(mctx, 5, 5, true, &l));
    return l;
}

/* The unit's group: the exact pointer, its rank and size, and the flat layout's world. */
static bool unit_over(const fsdp_unit_t *u, const fsdp_pg_t *pg, int world, char *why, size_t len) {
    fsdp_options_t o;
    fsdp_flat_sizes_t fs;
    if (!u || fsdp_unit_options(u, &o) < 0) {
        snprintf(why, len, "no unit");
        return false;
    }
    fsdp_unit_flat_sizes(u, &fs);
    snprintf(why, len, "pg %p (want %p), rank %d, size %d, flat world %d", (void *)o.pg,
             (const void *)pg, fsdp_pg_rank(o.pg), fsdp_pg_size(o.pg), fs.world);
    return o.pg == pg && fsdp_unit_pg(u) == pg && fsdp_pg_rank(o.pg) == 0 &&
           fsdp_pg_size(o.pg) == world && fs.world == world;
}

/* A module whose "constructor" calls fsdp_wrap_scoped on its child (test_wrap.py's
 * test_wrap_disabled_outside_context). */
static fsdp_module_t *model_wrapping_child(void) {
    fsdp_module_t *m = NULL, *l = lin55();
    CHECK(fsdp_module_create(mctx, &mymodel_ops, NULL, &m));
    fsdp_unit_overrides_t ov;
    fsdp_unit_overrides_init(&ov);
    ov.has_pg = true;
    ov.pg = pg1;
    fsdp_unit_t *u = NULL;
    CHECK(fsdp_wrap_scoped(l, &ov, &u));
    if (u) tap_bail("fsdp_wrap_scoped wrapped outside a scope");
    if (adopt(m, "lin", l) < 0) tap_bail("adding lin");
    return m;
}

static void test_ta01_03(void) {
    char why[200];
    /* WRAP-TA-01: FSDP_CTOR, a size policy (min 1) over a group of one. */
    fsdp_module_t *l = lin55();
    fsdp_policy_t *p1 = size_policy(1);
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.pg = pg1;
    o.auto_wrap_policy = p1;
    fsdp_unit_t *u = NULL;
    CHECK(fsdp_wrap(l, &o, &u));
    tap_ok(unit_over(u, pg1, 1, why, sizeof why),
           "WRAP-TA-01 (FSDP_CTOR): the unit reports rank "
           "0 and world size 1 of its group (%s)",
           why);
    tap_is_int(fsdp_unit_strategy(u), FSDP_NO_SHARD,
               "WRAP-TA-01 (FSDP_CTOR): a group of one clamps the strategy to NO_SHARD");
    fsdp_destroy(u);
    fsdp_module_release(l);
    fsdp_policy_release(p1);

    /* WRAP-TA-01: WRAP_API. */
    fsdp_options_init(&o);
    o.pg = pg1;
    tap_ok(!fsdp_wrap_enabled(), "WRAP-TA-01: no wrap scope is open at first");
    CHECK(fsdp_enable_wrap(&o));
    tap_ok(fsdp_wrap_enabled(), "WRAP-TA-01: fsdp_enable_wrap opens the scope");
    l = lin55();
    u = NULL;
    int rc = fsdp_wrap_scoped(l, NULL, &u);
    tap_ok(rc == 0 && fsdp_unit_of(l) == u && unit_over(u, pg1, 1, why, sizeof why),
           "WRAP-TA-01 (WRAP_API): fsdp_wrap_scoped inside the scope makes a unit over the "
           "default group: rank 0, world size 1 (%s)",
           why);
    fsdp_destroy(u);
    fsdp_module_release(l);

    /* Scopes do not nest: the open scope keeps its defaults. */
    fsdp_options_t o2;
    fsdp_options_init(&o2);
    o2.pg = pg2;
    stderr_begin();
    rc = fsdp_enable_wrap(&o2);
    const char *err = stderr_end();
    tap_has_str(err,
                "fsdp_enable_wrap: this thread is already within a wrap scope; scopes do not "
                "nest",
                "WRAP-TA-01: a nested fsdp_enable_wrap says scopes do not nest");
    l = lin55();
    u = NULL;
    int rc2 = fsdp_wrap_scoped(l, NULL, &u);
    tap_ok(rc == FSDP_EINVAL && fsdp_wrap_enabled() && rc2 == 0 &&
               unit_over(u, pg1, 1, why, sizeof why),
           "WRAP-TA-01: a nested fsdp_enable_wrap is FSDP_EINVAL and leaves the open scope's "
           "defaults (%s)",
           why);
    fsdp_destroy(u);
    fsdp_module_release(l);
    CHECK(fsdp_disable_wrap());
    stderr_begin();
    rc = fsdp_disable_wrap();
    err = stderr_end();
    tap_ok(!fsdp_wrap_enabled() && rc == FSDP_EINVAL &&
               strstr(err, "fsdp_disable_wrap: this thread has no wrap scope open"),
           "WRAP-TA-01: fsdp_disable_wrap closes the scope; closing again is FSDP_EINVAL, saying "
           "so");

    /* WRAP-TA-02: outside a scope fsdp_wrap_scoped is the identity. */
    l = lin55();
    fsdp_tensor_t *w = fsdp_module_param(l, "weight");
    fsdp_unit_overrides_t ov;
    fsdp_unit_overrides_init(&ov);
    ov.has_pg = true;
    ov.pg = pg1;
    u = (fsdp_unit_t *)1;
    rc = fsdp_wrap_scoped(l, &ov, &u);
    tap_ok(rc == 0 && u == NULL && fsdp_unit_of(l) == NULL && fsdp_module_param(l, "weight") == w &&
               fsdp_tensor_ndim(w) == 2 && fsdp_tensor_numel(w) == 25,
           "WRAP-TA-02: outside a scope fsdp_wrap_scoped returns FSDP_OK, no unit, the Linear "
           "unchanged");
    fsdp_module_release(l);
    fsdp_module_t *m = model_wrapping_child();
    fsdp_options_init(&o);
    o.pg = pg1;
    CHECK(fsdp_enable_wrap(&o));
    u = NULL;
    rc = fsdp_wrap_scoped(m, NULL, &u);
    CHECK(fsdp_disable_wrap());
    tap_ok(rc == 0 && u && fsdp_unit_of(fsdp_module_child(m, "lin")) == NULL &&
               strcmp(unit_names(u), "(root)") == 0 && fsdp_unit_num_params(u) == 2,
           "WRAP-TA-02: wrapping the model inside the scope wraps only the root; its lin stays "
           "a plain Linear whose parameters the root manages (%s)",
           unit_names(u));
    fsdp_destroy(u);
    fsdp_module_release(m);
    u = (fsdp_unit_t *)1;
    tap_ok(fsdp_wrap_scoped(NULL, NULL, &u) == FSDP_EINVAL && u == NULL,
           "WRAP-TA-02: fsdp_wrap_scoped of NULL is FSDP_EINVAL, scope or not");

    /* WRAP-TA-03: a per-call group overrides the scope's. pg2 fails every collective. */
    fsdp_options_init(&o);
    o.pg = pg1;
    CHECK(fsdp_enable_wrap(&o));
    l = lin55();
    fsdp_unit_overrides_init(&ov);
    ov.has_pg = true;
    ov.pg = pg2;
    u = NULL;
    rc = fsdp_wrap_scoped(l, &ov, &u);
    CHECK(fsdp_disable_wrap());
    tap_ok(rc == 0 && unit_over(u, pg2, 2, why, sizeof why),
           "WRAP-TA-03: the per-call group wins: the unit holds exactly pg2, rank 0, world size "
           "2 (%s)",
           rc == 0 ? why : fsdp_ctx_last_error(mctx));
    fsdp_flat_sizes_t fs = {0};
    if (u) fsdp_unit_flat_sizes(u, &fs);
    tap_ok(u && fsdp_unit_strategy(u) == FSDP_FULL_SHARD && fs.shard_numel == 15 &&
               fs.padded_numel == 30,
           "WRAP-TA-03: over two ranks it stays FULL_SHARD with half of the 30 elements per shard, "
           "and constructing it did not communicate (pg2 fails every collective)");
    fsdp_destroy(u);
    fsdp_module_release(l);

    fsdp_options_t uo;
    stderr_begin();
    rc = fsdp_unit_options(NULL, &uo);
    stderr_end();
    tap_ok(rc == FSDP_EINVAL, "fsdp_unit_options(NULL) is FSDP_EINVAL");
}

/* ---- every planned unit's options are checked before the first unit is made ----------------- */

static int hybrid_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    (void)arg;
    if (strcmp(fsdp_module_type(m), "Linear") != 0) return FSDP_POLICY_NO;
    ov->has_strategy = true;
    ov->strategy = FSDP_HYBRID_SHARD; /* without a replicate group */
    return FSDP_POLICY_OVERRIDE;
}

static void test_bad_override(void) {
    fsdp_module_t *m = NULL;
    CHECK(tm_nested_sequential_create(mctx, &m));
    fsdp_policy_t *p = NULL;
    CHECK(fsdp_policy_custom_create(hybrid_fn, NULL, &p));
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.pg = pg1;
    o.auto_wrap_policy = p;
    fsdp_unit_t *root = NULL;
    int rc = fsdp_wrap(m, &o, &root);
    const char *msg = fsdp_ctx_last_error(mctx);
    tap_ok(rc == FSDP_EINVAL && strstr(msg, "the unit planned at '0'") &&
               strstr(msg, "replicate_pg") && units_in_tree(m) == 0,
           "an invalid override (HYBRID_SHARD without a replicate group) is refused naming the "
           "first planned unit, before any unit is made (%s)",
           msg);
    fsdp_policy_release(p);
    fsdp_module_release(m);
}

/* ---- WRAP-TA-08: a custom policy's overrides on real units ---------------------------------- */

struct ta08 {
    bool uniform;
    fsdp_module_t *bn;
};

static int ta08_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    struct ta08 *a = arg;
    const char *t = fsdp_module_type(m);
    if (m == a->bn) {
        if (a->uniform) return FSDP_POLICY_YES;
        ov->has_strategy = true;
        ov->strategy = FSDP_NO_SHARD;
        return FSDP_POLICY_OVERRIDE;
    }
    if (strcmp(t, "TransformerEncoderLayer") == 0) return FSDP_POLICY_YES;
    if (strcmp(t, "TransformerDecoderLayer") == 0) {
        if (a->uniform) return FSDP_POLICY_YES;
        ov->has_strategy = true;
        ov->strategy = FSDP_SHARD_GRAD_OP;
        ov->has_backward_prefetch = true;
        ov->backward_prefetch = FSDP_BACKWARD_POST;
        return FSDP_POLICY_OVERRIDE;
    }
    return FSDP_POLICY_NO;
}

/* "fqn:STRATEGY/PREFETCH/precision" of every unit of root's tree, pre-order (static). */
static const char *tree_options(const fsdp_unit_t *root, const fsdp_pg_t *pg, bool *same_pg) {
    static char buf[1024];
    fsdp_unit_t **u = NULL;
    size_t n = 0, o = 0;
    buf[0] = 0;
    *same_pg = true;
    if (!root || fsdp_units(root, &u, &n) < 0) return "(no units)";
    for (size_t i = 0; i < n && o < sizeof buf; i++) {
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s:%s", i ? "|" : "",
                              fsdp_unit_is_root(u[i]) ? "(root)" : fsdp_unit_fqn(u[i]),
                              options_str(u[i]));
        *same_pg &= fsdp_unit_pg(u[i]) == pg;
    }
    free(u);
    return buf;
}

static void test_ta08(void) {
    static const char *const want[2] = {
        /* non-uniform */
        "(root):FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.encoder.layers.0:FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.encoder.layers.1:FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.decoder.layers.0:SHARD_GRAD_OP/BACKWARD_POST/f16|"
        "transformer.decoder.layers.1:SHARD_GRAD_OP/BACKWARD_POST/f16|"
        "bn:NO_SHARD/BACKWARD_PRE/full",
        /* uniform */
        "(root):FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.encoder.layers.0:FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.encoder.layers.1:FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.decoder.layers.0:FULL_SHARD/BACKWARD_PRE/f16|"
        "transformer.decoder.layers.1:FULL_SHARD/BACKWARD_PRE/f16|"
        "bn:FULL_SHARD/BACKWARD_PRE/full"};
    for (int world = 2; world >= 1; world--)
        for (int uniform = 0; uniform < 2; uniform++) {
            const char *k = uniform ? "uniform" : "non-uniform";
            fsdp_module_t *m = NULL;
            CHECK(tm_transformer_create(mctx, true, false, &m));
            struct ta08 arg = {uniform != 0, fsdp_module_child(m, "bn")};
            fsdp_policy_t *p = NULL;
            CHECK(fsdp_policy_custom_create(ta08_fn, &arg, &p));
            fsdp_options_t o;
            fsdp_options_init(&o);
            o.pg = world == 2 ? pg2 : pg1;
            o.mixed_precision.enabled = true;
            o.mixed_precision.param_dtype = FSDP_DTYPE_F16;
            o.auto_wrap_policy = p;
            fsdp_unit_t *root = NULL;
            log_reset();
            int rc = fsdp_wrap(m, &o, &root);
            if (rc < 0) tap_diag("fsdp_wrap: %s", fsdp_ctx_last_error(mctx));
            bool same_pg = false;
            const char *got = tree_options(root, o.pg, &same_pg);
            if (world == 2) {
                tap_is_str(got, want[uniform],
                           "WRAP-TA-08 (%s, world 2): exactly these units, each with the root's "
                           "options and its overrides; bn in full precision",
                           k);
            } else {
                bool all_no_shard = true;
                for (const char *s = strchr(got, ':'); s; s = strchr(s + 1, ':'))
                    all_no_shard &= strncmp(s + 1, "NO_SHARD/", 9) == 0;
                tap_ok(rc == 0 && all_no_shard,
                       "WRAP-TA-08 (%s, world 1): every unit clamps to NO_SHARD (%s)", k, got);
            }
            tap_ok(same_pg, "WRAP-TA-08 (%s, world %d): every unit shards over the root's group", k,
                   world);
            tap_has_str(logcap.first, "These modules will be wrapped as separate FSDP",
                        "WRAP-TA-08 (%s, world %d): the batch-norm override warns (W2)", k, world);
            fsdp_destroy(root);
            fsdp_policy_release(p);
            fsdp_module_release(m);
        }
}

/* ---- WRAP-TA-15/16: ignored modules --------------------------------------------------------- */

/* Whether the parameters of m's subtree are unflattened (their registered 2-D and 1-D shapes),
 * managed by no unit, and in fsdp_named_params(root) under their own names. */
static bool left_alone(const fsdp_unit_t *root, fsdp_module_t *m, const char *path) {
    fsdp_tensor_t *w = fsdp_module_param(m, "weight"), *b = fsdp_module_param(m, "bias");
    if (!w || !b || fsdp_tensor_ndim(w) != 2 || fsdp_tensor_numel(w) != 25 ||
        fsdp_tensor_ndim(b) != 1 || fsdp_tensor_numel(b) != 5)
        return false;
    fsdp_unit_t **u = NULL;
    size_t n = 0;
    bool ok = fsdp_units(root, &u, &n) == 0;
    for (size_t i = 0; ok && i < n; i++)
        for (size_t k = 0; k < fsdp_unit_num_params(u[i]); k++) {
            fsdp_param_info_t pi;
            ok &= fsdp_unit_param_info(u[i], k, &pi) == 0 && pi.param != w && pi.param != b;
        }
    free(u);
    fsdp_named_list_t l = {0};
    ok &= fsdp_named_params(root, &l) == 0;
    char name[64];
    snprintf(name, sizeof name, "%s.weight", path);
    bool listed = false;
    for (size_t i = 0; i < l.n; i++)
        listed |= strcmp(l.names[i], name) == 0 && l.tensors[i] == w;
    fsdp_named_list_free(&l);
    return ok && listed;
}

static void test_ta15_16(void) {
    for (int api = 0; api < 2; api++)
        for (int size40 = 0; size40 < 2; size40++) {
            const char *id = size40 ? "WRAP-TA-16" : "WRAP-TA-15";
            const char *how = api ? "WRAP_API" : "FSDP_CTOR";
            fsdp_module_t *m = NULL;
            CHECK(tm_nested_sequential_create(mctx, &m));
            fsdp_module_t *ign[2] = {fsdp_module_child(m, "1"), fsdp_module_child(m, "2.0")};
            fsdp_policy_t *p = size40 ? size_policy(40) : always_policy();
            fsdp_options_t o;
            fsdp_options_init(&o);
            o.pg = pg1;
            o.auto_wrap_policy = p;
            o.ignored_modules = ign;
            o.num_ignored_modules = 2;
            fsdp_unit_t *root = NULL;
            int rc;
            if (api) {
                CHECK(fsdp_enable_wrap(&o));
                rc = fsdp_wrap_scoped(m, NULL, &root);
                CHECK(fsdp_disable_wrap());
            } else {
                rc = fsdp_wrap(m, &o, &root);
            }
            if (rc < 0) tap_diag("wrap: %s", fsdp_ctx_last_error(mctx));
            tap_is_str(unit_names(root), size40 ? "(root)" : "(root)|0|2|2.1",
                       "%s (%s): the units (ignored [1] and [2][0] never are)", id, how);
            tap_ok(root && left_alone(root, ign[0], "1") && left_alone(root, ign[1], "2.0"),
                   "%s (%s): the ignored modules' parameters stay unflattened, in no unit, and "
                   "go to the optimizer as they are",
                   id, how);
            if (size40) {
                fsdp_flat_sizes_t fs = {0};
                if (root) fsdp_unit_flat_sizes(root, &fs);
                tap_ok(root && fs.unpadded_numel == 60 && fsdp_unit_num_params(root) == 4,
                       "WRAP-TA-16 (%s): the root's flat parameter holds 60 elements, not 120 "
                       "(%lld, %zu parameters)",
                       how, (long long)fs.unpadded_numel, root ? fsdp_unit_num_params(root) : 0);
            }
            fsdp_destroy(root);
            fsdp_policy_release(p);
            fsdp_module_release(m);
        }
}

/* ---- WRAP-TA-17: frozen parameters ---------------------------------------------------------- */

static const char *const lora_types[] = {"LoraAttention", "LoraMLP", "LoraDecoder", NULL};

static int lora_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    bool uniform = arg != NULL;
    const char *t = fsdp_module_type(m);
    if (!uniform && strcmp(t, "LoraAttention") == 0) {
        ov->has_strategy = true;
        ov->strategy = FSDP_SHARD_GRAD_OP;
        return FSDP_POLICY_OVERRIDE;
    }
    for (const char *const *k = lora_types; *k; k++)
        if (strcmp(t, *k) == 0) return FSDP_POLICY_YES;
    return FSDP_POLICY_NO;
}

static void test_ta17(void) {
    static const char *const names[3] = {"ModuleWrapPolicy", "CustomPolicy uniform",
                                         "CustomPolicy non-uniform"};
    for (int orig = 0; orig < 2; orig++)
        for (int k = 0; k < 3; k++) {
            fsdp_module_t *m = NULL;
            CHECK(tm_lora_create(mctx, &m));
            fsdp_policy_t *p = NULL;
            if (k == 0)
                CHECK(fsdp_policy_module_types_create(lora_types, &p));
            else
                CHECK(fsdp_policy_custom_create(lora_fn, k == 1 ? (void *)1 : NULL, &p));
            fsdp_options_t o;
            fsdp_options_init(&o);
            o.pg = pg1;
            o.use_orig_params = orig;
            o.auto_wrap_policy = p;
            fsdp_unit_t *root = NULL;
            log_reset();
            int rc = fsdp_wrap(m, &o, &root);
            static const char *const prefix =
                "layers.0.attn has both parameters with requires_grad=True and False.";
            if (orig) {
                tap_ok(rc == 0 && root && units_in_tree(m) == 13,
                       "WRAP-TA-17 (%s, use_orig_params): the wrap goes on (13 units; %s)",
                       names[k], rc == 0 ? "ok" : fsdp_ctx_last_error(mctx));
                tap_ok(strncmp(logcap.first, prefix, strlen(prefix)) == 0 &&
                           strstr(logcap.first, " We do not recommend wrapping such modules") ==
                               logcap.first + strlen(prefix),
                       "WRAP-TA-17 (%s, use_orig_params): the first warning names layers.0.attn "
                       "and does not recommend it (\"%.120s\")",
                       names[k], logcap.first);
                tap_ok(logcap.nwarn == 4 && logcap.all_attn,
                       "WRAP-TA-17 (%s, use_orig_params): one warning per mixed unit, each an "
                       "attention (%d)",
                       names[k], logcap.nwarn);
            } else {
                const char *msg = fsdp_ctx_last_error(mctx);
                tap_ok(rc == FSDP_EINVAL && strncmp(msg, prefix, strlen(prefix)) == 0 &&
                           strstr(msg, " FSDP does not support wrapping such modules when "
                                       "use_orig_params=False.") == msg + strlen(prefix),
                       "WRAP-TA-17 (%s): FSDP_EINVAL naming layers.0.attn, not supported without "
                       "use_orig_params (\"%.120s\")",
                       names[k], msg);
                tap_ok(root == NULL && units_in_tree(m) == 0 && logcap.nwarn == 0,
                       "WRAP-TA-17 (%s): refused before any unit was made", names[k]);
            }
            fsdp_destroy(root);
            fsdp_policy_release(p);
            fsdp_module_release(m);
        }
}

/* ---- WRAP-FW-04: options propagate, and the units train as DDP does ------------------------- */

#define FW04_STEPS 6

static int ones_input(fsdp_ctx_t *c, fsdp_tensor_t **x) {
    const int64_t shape[2] = {1, 1};
    return fsdp_tensor_full(c, FSDP_DTYPE_F32, 2, shape, 1.0, FSDP_MEM_ACTIVATIONS, x);
}

/* forward, sum, backward, step; *y receives the output (a new reference). */
static int fw04_step(fsdp_module_t *m, fsdp_ddp_t *d, fsdp_optim_t *opt, fsdp_tensor_t *x,
                     fsdp_tensor_t **y) {
    fsdp_tensor_t *loss = NULL;
    int rc = d ? fsdp_ddp_forward1(d, x, y) : fsdp_module_forward1(m, x, y);
    if (rc == 0) rc = tm_sum_loss(*y, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_optim_step(opt); /* no zero_grad: upstream's loop has none */
    fsdp_tensor_release(loss);
    return rc;
}

static int fw04_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_policy_t *p = size_policy(0);
    fsdp_named_list_t rl = {0};
    fsdp_tensor_t *x = NULL, *y = NULL, *yr = NULL;
    size_t n = 0;
    int rc;
    char why[600] = "";
    FU_TRY(done, "building the models", my_model(ctx, false, &m));
    FU_TRY(done, "building the models", my_model(ctx, false, &ref));
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.auto_wrap_policy = p;
    FU_TRY(done, "fsdp_wrap with size policy min 0", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "fsdp_units", fsdp_units(root, &u, &n));
    fu_ck(r, strcmp(unit_names(root), "(root)|lin1|lin2|lin3|lin4|lin4.nested_lin") == 0,
          "min_num_params 0 makes every module a unit", "%s", unit_names(root));
    bool same = true;
    fsdp_options_t ro;
    FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(root, &ro));
    for (size_t i = 0; i < n; i++) {
        fsdp_options_t uo;
        FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(u[i], &uo));
        if (uo.cpu_offload != j->offload || uo.backward_prefetch != j->bp ||
            uo.forward_prefetch != j->fwd_prefetch || uo.cpu_offload != ro.cpu_offload ||
            uo.backward_prefetch != ro.backward_prefetch ||
            uo.forward_prefetch != ro.forward_prefetch || uo.strategy != ro.strategy ||
            uo.pg != ro.pg || uo.limit_all_gathers != ro.limit_all_gathers ||
            uo.use_orig_params != ro.use_orig_params ||
            uo.check_exec_order != ro.check_exec_order || uo.auto_wrap_policy != NULL)
            fu_add_why(why, sizeof why, "%s: offload %d bwd %s fwd %d strategy %s",
                       fsdp_unit_fqn(u[i]), uo.cpu_offload,
                       fsdp_backward_prefetch_name(uo.backward_prefetch), uo.forward_prefetch,
                       fsdp_sharding_strategy_name(uo.strategy)),
                same = false;
    }
    fu_ck(r, same,
          "every unit reports the root's cpu_offload, backward_prefetch and "
          "forward_prefetch (and strategy, group, limit, use_orig_params)",
          "%s", why);
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(ctx, &ms);
    fu_ck(r, (ms.current[FSDP_MEM_OFFLOAD] > 0) == j->offload,
          j->offload ? "with offload the shards live in host memory (FSDP_MEM_OFFLOAD)"
                     : "without offload nothing is in FSDP_MEM_OFFLOAD",
          "%zu bytes", ms.current[FSDP_MEM_OFFLOAD]);
    FU_TRY(done, "DDP reference", fsdp_ddp_create(ref, fsdp_ctx_pg(ctx), NULL, &ddp));
    FU_TRY(done, "optimizers", fu_make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &rl, 0.01, 0.9, &ref_opt));
    double worst = 0;
    bool idle = true;
    why[0] = 0;
    for (int s = 0; s < FW04_STEPS; s++) {
        FU_TRY(done, "the input", ones_input(ctx, &x));
        FU_TRY(done, "FSDP step", fw04_step(m, NULL, opt, x, &y));
        FU_TRY(done, "DDP step", fw04_step(ref, ddp, ref_opt, x, &yr));
        double c = fu_tensor_closeness(y, yr, FU_F32_RTOL, FU_F32_ATOL);
        if (c < 0 || c > 1) fu_add_why(why, sizeof why, "step %d: closeness %.3g", s, c);
        if (c < 0 || c > worst) worst = c < 0 ? INFINITY : c;
        idle &= fu_tree_idle(root);
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(yr);
        x = y = yr = NULL;
    }
    fu_ck(r, worst <= 1,
          "6 SGD(momentum 0.9) steps: each step's output equals DDP's (rtol 1.3e-6, "
          "atol 1e-5)",
          "%s", why);
    fu_ck(r, idle, "every unit idle and resharded after each step", "a unit was left running");
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(yr);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&rl);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_policy_release(p);
    return rc < 0 ? rc : FSDP_OK;
}

static void test_fw04(void) {
    static const fsdp_backward_prefetch_t bps[2] = {FSDP_BACKWARD_POST, FSDP_BACKWARD_PRE};
    for (int off = 0; off < 2; off++)
        for (int b = 0; b < 2; b++)
            for (int f = 0; f < 2; f++) {
                char prefix[160];
                snprintf(prefix, sizeof prefix, "WRAP-FW-04 cpu_offload %d %s forward_prefetch %d",
                         off, fsdp_backward_prefetch_name(bps[b]), f);
                fu_job_t *j = fu_job_new(prefix, 2, FSDP_FULL_SHARD, false);
                j->offload = off;
                j->bp = bps[b];
                j->fwd_prefetch = f;
                fu_run_job(j, fw04_rank);
                free(j);
            }
}

/* ---- WRAP-TA-14: the auto-wrap smoke test ---------------------------------------------------- */

typedef struct ta14_job {
    fu_job_t base; /* first */
    bool device;   /* options.device: a second CPU device of the rank's context */
} ta14_job_t;

static int ta14_rank(fsdp_ctx_t *ctx, void *arg) {
    ta14_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_device_t *A = NULL;
    fsdp_policy_t *p = size_policy(40);
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    int rc;
    FU_TRY(done, "NestedSequentialModel", tm_nested_sequential_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(&j->base, &o);
    o.auto_wrap_policy = p;
    if (j->device) {
        FU_TRY(done, "creating device A", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &A));
        o.device = A;
    }
    FU_TRY(done, "fsdp_wrap with size policy 40", fsdp_wrap(m, &o, &root));
    fu_ck(r, strcmp(unit_names(root), "(root)|2") == 0, "the root and [2] are the units", "%s",
          unit_names(root));
    fsdp_unit_t *u2 = fsdp_unit_of(fsdp_module_child(m, "2"));
    fu_ck(r,
          !j->device ||
              (fsdp_unit_compute_device(root) == A && u2 && fsdp_unit_compute_device(u2) == A),
          "every unit computes on options.device when given", "not on A");
    if (A) FU_TRY(done, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    FU_TRY(done, "the input", fu_rand_input(ctx, 3, 1, 5, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &y));
    FU_TRY(done, "MSE loss", fsdp_mse_loss(x, y, FSDP_REDUCTION_MEAN, &loss));
    FU_TRY(done, "backward", fsdp_backward(loss, NULL));
    double lv = NAN;
    FU_TRY(done, "reading the loss", fsdp_tensor_item(loss, 0, &lv));
    fsdp_tensor_t *g0 = fsdp_tensor_grad(fsdp_unit_flat_param(root));
    fsdp_tensor_t *g2 = u2 ? fsdp_tensor_grad(fsdp_unit_flat_param(u2)) : NULL;
    fu_ck(r, isfinite(lv) && g0 && g2 && fu_tree_idle(root),
          "forward, MSE(input, output), backward: a finite loss, both units' sharded gradients, "
          "every unit idle",
          "loss %g, grads %p %p", lv, (void *)g0, (void *)g2);
done:
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(A);
    fsdp_policy_release(p);
    return rc < 0 ? rc : FSDP_OK;
}

static void test_ta14(void) {
    for (int world = 1; world <= 2; world++)
        for (int off = 0; off < 2; off++)
            for (int dev = 0; dev < 2; dev++) {
                char prefix[160];
                snprintf(prefix, sizeof prefix, "WRAP-TA-14 cpu_offload %d device %d", off, dev);
                ta14_job_t *j = malloc(sizeof *j);
                if (!j) tap_bail("out of memory");
                fu_job_init(&j->base, prefix, world, FSDP_FULL_SHARD, false);
                j->base.offload = off;
                j->device = dev;
                fu_run_job(&j->base, ta14_rank);
                free(j);
            }
}

/* ---- WRAP-TA-02: the scope is per thread ---------------------------------------------------- */

static int scope_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_pg_t *self = NULL, *world = fsdp_ctx_pg(ctx);
    fsdp_module_t *l = NULL;
    fsdp_unit_t *u = NULL;
    bool opened = false;
    FU_TRY(done, "a dummy group of this rank",
           fsdp_pg_create_dummy(ctx, 0, 1, FSDP_DUMMY_NOOP, &self));
    FU_TRY(done, "Linear(5, 5)", fsdp_linear_create(ctx, 5, 5, true, &l));
    if (rank == 0) {
        fsdp_options_t o;
        fsdp_options_init(&o);
        o.pg = self;
        FU_TRY(done, "fsdp_enable_wrap", fsdp_enable_wrap(&o));
        opened = true;
    }
    FU_TRY(done, "barrier", fsdp_pg_barrier(world, NULL)); /* rank 0's scope is open now */
    bool enabled = fsdp_wrap_enabled();
    FU_TRY(done, "fsdp_wrap_scoped", fsdp_wrap_scoped(l, NULL, &u));
    bool want = rank == 0;
    fu_ck(r, enabled == want && (u != NULL) == want && (fsdp_unit_of(l) != NULL) == want,
          "while rank 0's scope is open, rank 0 wraps and rank 1 (no scope of its own) gets the "
          "identity",
          "rank %d: enabled %d, unit %p", rank, enabled, (void *)u);
    FU_TRY(done, "barrier", fsdp_pg_barrier(world, NULL));
done:
    if (opened) fsdp_disable_wrap();
    fsdp_destroy(u);
    fsdp_module_release(l);
    fsdp_pg_destroy(self);
    return rc < 0 ? rc : FSDP_OK;
}

/* ---- fsdp_fully_shard against fsdp_wrap ------------------------------------------------------ */

#define FS_STEPS 3

/* The names of a listing joined by '|' into a malloc'ed string. */
static char *joined(const fsdp_named_list_t *l) {
    size_t len = 1;
    for (size_t i = 0; i < l->n; i++)
        len += strlen(l->names[i]) + 1;
    char *s = malloc(len);
    if (!s) return NULL;
    s[0] = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (i) strcat(s, "|");
        strcat(s, l->names[i]);
    }
    return s;
}

typedef enum { L_PARAMS, L_STATE, L_FSDP } listing_t;

/* Whether two listings have the same names in the same order. */
static bool same_names(const fsdp_module_t *a, const fsdp_unit_t *ua, listing_t how,
                       const fsdp_module_t *b) {
    fsdp_named_list_t la = {0}, lb = {0};
    int rc = how == L_STATE  ? fsdp_module_state_dict(a, &la)
             : how == L_FSDP ? fsdp_named_params(ua, &la)
                             : fsdp_module_named_params(a, false, &la);
    if (rc == 0)
        rc = how == L_STATE ? fsdp_module_state_dict(b, &lb)
                            : fsdp_module_named_params(b, false, &lb);
    char *sa = rc == 0 ? joined(&la) : NULL, *sb = rc == 0 ? joined(&lb) : NULL;
    bool ok = sa && sb && la.n > 0 && strcmp(sa, sb) == 0;
    if (!ok) tap_diag("%s\n  vs %s", sa ? sa : "?", sb ? sb : "?");
    free(sa);
    free(sb);
    fsdp_named_list_free(&la);
    fsdp_named_list_free(&lb);
    return ok;
}

static int fs_loss(fsdp_ctx_t *ctx, fsdp_module_t *m, double *out) {
    fsdp_tensor_t *src = NULL, *tgt = NULL, *y = NULL, *loss = NULL;
    int rc = tm_transformer_get_input(ctx, &src, &tgt);
    if (rc == 0) rc = tm_transformer_forward(m, src, tgt, &y);
    if (rc == 0) rc = tm_transformer_loss(tgt, y, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_tensor_item(loss, 0, out);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    return rc;
}

static int fs_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *ma = NULL, *mb = NULL, *mu = NULL;
    fsdp_unit_t *ra = NULL, *rb = NULL, **u = NULL;
    fsdp_optim_t *oa = NULL, *ob = NULL;
    fsdp_named_list_t la = {0};
    size_t n = 0;
    int rc;
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &ma));
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &mb));
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &mu));
    fsdp_options_t o;
    fu_job_options(j, &o); /* use_orig_params off: fully_shard turns it on */
    for (const char *const *f = tm_transformer_units(); *f; f++)
        FU_TRY(done, "fully_shard on a layer",
               fsdp_fully_shard(fsdp_module_child(ma, *f), &o, NULL));
    FU_TRY(done, "fully_shard on the root", fsdp_fully_shard(ma, &o, &ra));
    fsdp_options_t ob_o = o;
    ob_o.use_orig_params = true;
    FU_TRY(done, "fsdp_wrap with the transformer policy", fu_wrap_transformer_opts(mb, &ob_o, &rb));
    fu_ck(r, ra == fsdp_unit_of(ma) && strcmp(unit_names(ra), unit_names(rb)) == 0,
          "children then the root give the units the policy gives", "%s vs %s", unit_names(ra),
          unit_names(rb));
    FU_TRY(done, "fsdp_units", fsdp_units(ra, &u, &n));
    bool orig = n == 5;
    for (size_t i = 0; i < n; i++) {
        fsdp_options_t uo;
        orig &= fsdp_unit_options(u[i], &uo) == 0 && uo.use_orig_params;
    }
    fu_ck(r, orig, "every fully_shard unit runs with use_orig_params", "%zu units", n);
    fu_ck(r, same_names(ma, NULL, L_PARAMS, mu),
          "the module's parameter FQNs are the unwrapped model's", "see the diagnostics");
    fu_ck(r, same_names(ma, NULL, L_STATE, mu), "its state-dict keys are the unwrapped model's",
          "see the diagnostics");
    fu_ck(r, same_names(ma, ra, L_FSDP, mu),
          "what FSDP hands the optimizer is the module's own parameters", "see the diagnostics");
    /* A optimizes the module's own parameters, as with an unwrapped model. */
    FU_TRY(done, "optimizers", fsdp_module_named_params(ma, false, &la));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &la, 0.01, 0.9, &oa));
    FU_TRY(done, "optimizers", fu_make_fsdp_sgd(ctx, rb, 0.01, 0.9, &ob));
    char why[400] = "";
    bool same = true;
    for (int s = 0; s < FS_STEPS; s++) {
        double a = NAN, b = NAN;
        FU_TRY(done, "fully_shard step", fs_loss(ctx, ma, &a));
        FU_TRY(done, "fully_shard step", fsdp_optim_step(oa));
        FU_TRY(done, "fully_shard step", fsdp_optim_zero_grad(oa, true));
        FU_TRY(done, "fsdp_wrap step", fs_loss(ctx, mb, &b));
        FU_TRY(done, "fsdp_wrap step", fsdp_optim_step(ob));
        FU_TRY(done, "fsdp_wrap step", fsdp_optim_zero_grad(ob, true));
        if (memcmp(&a, &b, sizeof a) != 0) {
            fu_add_why(why, sizeof why, "step %d: %.9g vs %.9g", s, a, b);
            same = false;
        }
    }
    fu_ck(r, same, "3 SGD steps: the losses are bitwise fsdp_wrap's", "%s", why);
done:
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_named_list_free(&la);
    fsdp_optim_destroy(oa);
    fsdp_optim_destroy(ob);
    fsdp_destroy(ra);
    fsdp_destroy(rb);
    fsdp_module_release(ma);
    fsdp_module_release(mb);
    fsdp_module_release(mu);
    return rc < 0 ? rc : FSDP_OK;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    setenv("FSDP_LOG", "warn", 1);
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_WARN;
    if (fsdp_ctx_create(&co, &mctx) < 0) tap_bail("fsdp_ctx_create failed");
    fsdp_ctx_set_log_sink(mctx, sink, NULL);
    CHECK(fsdp_pg_create_dummy(mctx, 0, 1, FSDP_DUMMY_NOOP, &pg1));
    CHECK(fsdp_pg_create_dummy(mctx, 0, 2, FSDP_DUMMY_FAIL, &pg2));
    tap_plan_lazy();
    test_fw01();
    test_ta01_03();
    test_bad_override();
    test_ta08();
    test_ta15_16();
    test_ta17();
    test_fw04();
    test_ta14();
    fu_run("WRAP-TA-02 thread-local scope", 2, FSDP_FULL_SHARD, false, scope_rank);
    fu_run("fully_shard vs fsdp_wrap TransformerWithSharedParams", 2, FSDP_FULL_SHARD, false,
           fs_rank);
    fsdp_pg_destroy(pg2);
    fsdp_pg_destroy(pg1);
    fsdp_ctx_destroy(mctx);
    return tap_done();
}
