/* SPDX-License-Identifier: MIT */
/*
 * t_wrap.c: fsdp_wrap driven by auto-wrap policies, the manual wrap API (fsdp_enable_wrap,
 * fsdp_wrap_scoped), per-unit options (fsdp_unit_options) and the composable fsdp_fully_shard,
 * all on real units, against PyTorch's test_wrap.py (spec section 5: WRAP-FW-*, WRAP-TA-*).
 * t_wrap_policy.c covers the same cases as plans; here the plans become units. This file holds
 * the construction-only cases; t_wrap_train.c trains the units.
 *
 * The cases run on the main thread's context over dummy groups (PyTorch's DummyProcessGroup):
 * pg1 (rank 0 of 1) and pg2 (rank 0 of 2, failing every collective, so a wrap over it proves it
 * did not communicate). Unit sets are compared as the exact FQN list of fsdp_units() (pre-order,
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
#include "wrap_util.h"

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

/* ---- models and helpers ---------------------------------------------------------------------- */

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
        CHECK(wu_my_model(mctx, nested, &m));
        fsdp_options_t o;
        fsdp_options_init(&o);
        o.pg = pg1;
        fsdp_unit_t *hand[3] = {NULL, NULL, NULL};
        const char *paths[3] = {first, "lin2", "lin3"};
        for (int i = 0; i < 3; i++)
            CHECK(fsdp_wrap(fsdp_module_child(m, paths[i]), &o, &hand[i]));
        fsdp_policy_t *p = wu_size_policy(100000000);
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
               rc == 0 ? wu_unit_names(root) : fsdp_ctx_last_error(mctx));
        tap_is_str(wu_unit_names(root), nested ? "(root)|lin1.1|lin2|lin3" : "(root)|lin1|lin2|lin3",
                   "WRAP-FW-01 (%s): the adopted tree's units", k);
        fsdp_unit_destroy(root);
        fsdp_policy_release(p);
        fsdp_module_release(m);
    }
    /* A root that is already a unit is named as such. */
    fsdp_module_t *l = wu_lin11(mctx);
    fsdp_unit_t *u = NULL, *u2 = NULL;
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.pg = pg1;
    if (!l) tap_bail("Linear");
    CHECK(fsdp_wrap(l, &o, &u));
    fsdp_policy_t *p = wu_always_policy();
    o.auto_wrap_policy = p;
    int rc = fsdp_wrap(l, &o, &u2);
    tap_ok(rc == FSDP_EINVAL && u2 == NULL &&
               strcmp(fsdp_ctx_last_error(mctx),
                      "FSDP auto wrapping requires modules to not already have FSDP applied "
                      "but found the root module in Linear") == 0,
           "WRAP-FW-01: a root that is already a unit is reported as the root module (%s)",
           fsdp_ctx_last_error(mctx));
    fsdp_policy_release(p);
    fsdp_unit_destroy(u);
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
    CHECK(fsdp_module_create(mctx, &wu_mymodel_ops, NULL, &m));
    fsdp_unit_overrides_t ov;
    fsdp_unit_overrides_init(&ov);
    ov.has_pg = true;
    ov.pg = pg1;
    fsdp_unit_t *u = NULL;
    CHECK(fsdp_wrap_scoped(l, &ov, &u));
    if (u) tap_bail("fsdp_wrap_scoped wrapped outside a scope");
    if (wu_adopt(m, "lin", l) < 0) tap_bail("adding lin");
    return m;
}

static void test_ta01_03(void) {
    char why[200];
    /* WRAP-TA-01: FSDP_CTOR, a size policy (min 1) over a group of one. */
    fsdp_module_t *l = lin55();
    fsdp_policy_t *p1 = wu_size_policy(1);
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
    fsdp_unit_destroy(u);
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
    fsdp_unit_destroy(u);
    fsdp_module_release(l);

    /* Scopes do not nest: the open scope keeps its defaults. */
    fsdp_options_t o2;
    fsdp_options_init(&o2);
    o2.pg = pg2;
    char err[1024];
    wu_stderr_begin();
    rc = fsdp_enable_wrap(&o2);
    wu_stderr_end(err, sizeof err);
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
    fsdp_unit_destroy(u);
    fsdp_module_release(l);
    CHECK(fsdp_disable_wrap());
    wu_stderr_begin();
    rc = fsdp_disable_wrap();
    wu_stderr_end(err, sizeof err);
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
               strcmp(wu_unit_names(u), "(root)") == 0 && fsdp_unit_num_params(u) == 2,
           "WRAP-TA-02: wrapping the model inside the scope wraps only the root; its lin stays "
           "a plain Linear whose parameters the root manages (%s)",
           wu_unit_names(u));
    fsdp_unit_destroy(u);
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
    fsdp_unit_destroy(u);
    fsdp_module_release(l);

    fsdp_options_t uo;
    wu_stderr_begin();
    rc = fsdp_unit_options(NULL, &uo);
    wu_stderr_end(err, sizeof err);
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
            struct wu_ta08 arg = {uniform != 0, fsdp_module_child(m, "bn")};
            fsdp_policy_t *p = NULL;
            CHECK(fsdp_policy_custom_create(wu_ta08_fn, &arg, &p));
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
            fsdp_unit_destroy(root);
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
            fsdp_policy_t *p = size40 ? wu_size_policy(40) : wu_always_policy();
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
            tap_is_str(wu_unit_names(root), size40 ? "(root)" : "(root)|0|2|2.1",
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
            fsdp_unit_destroy(root);
            fsdp_policy_release(p);
            fsdp_module_release(m);
        }
}

/* ---- WRAP-TA-17: frozen parameters ---------------------------------------------------------- */

static void test_ta17(void) {
    static bool yes = true, no = false;
    static const char *const names[3] = {"ModuleWrapPolicy", "CustomPolicy uniform",
                                         "CustomPolicy non-uniform"};
    for (int orig = 0; orig < 2; orig++)
        for (int k = 0; k < 3; k++) {
            fsdp_module_t *m = NULL;
            CHECK(tm_lora_create(mctx, &m));
            fsdp_policy_t *p = NULL;
            if (k == 0)
                CHECK(fsdp_policy_module_types_create(wu_lora_types, &p));
            else
                CHECK(fsdp_policy_custom_create(wu_lora_fn, k == 1 ? &yes : &no, &p));
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
            fsdp_unit_destroy(root);
            fsdp_policy_release(p);
            fsdp_module_release(m);
        }
}

/* ---- MP-S11..S13, construction: fully_shard with a policy and mixed precision -------------- */

/* Whether u reports mixed precision equal to want (dtypes, the cast flags). */
static bool same_mp(const fsdp_unit_t *u, const fsdp_mixed_precision_t *want) {
    fsdp_options_t uo;
    if (fsdp_unit_options(u, &uo) < 0) return false;
    const fsdp_mixed_precision_t *mp = &uo.mixed_precision;
    if (!want->enabled) return !mp->enabled;
    return mp->enabled && mp->param_dtype == want->param_dtype &&
           mp->reduce_dtype == want->reduce_dtype && mp->buffer_dtype == want->buffer_dtype &&
           mp->cast_forward_inputs == want->cast_forward_inputs &&
           mp->cast_root_forward_inputs == want->cast_root_forward_inputs && uo.use_orig_params;
}

/* The composable calls of test_full_precision_in_eval*: fully_shard(TransformerWithSharedParams,
 * policy=ModuleWrapPolicy(layers), mixed_precision=...), with the default batch-norm rule
 * (S11: f16 x3, cast_forward_inputs) or without it (S13: param f32, reduce f16, buffer f32,
 * _module_classes_to_ignore=[]), and S12's hand nesting of the simple nested model. */
static void test_mp_s11_s13(void) {
    static const char *const layers[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                         NULL};
    static const char *const none[] = {NULL};
    for (int s13 = 0; s13 < 2; s13++) {
        const char *id = s13 ? "MP-S13" : "MP-S11";
        fsdp_module_t *m = NULL;
        fsdp_policy_t *p = NULL;
        CHECK(tm_transformer_create(mctx, true, false, &m));
        CHECK(fsdp_policy_module_types_create(layers, &p));
        fsdp_options_t o;
        fsdp_options_init(&o);
        o.pg = pg1;
        o.auto_wrap_policy = p;
        fsdp_mixed_precision_t *mp = &o.mixed_precision;
        mp->enabled = true;
        mp->cast_forward_inputs = true;
        if (s13) {
            mp->param_dtype = mp->buffer_dtype = FSDP_DTYPE_F32;
            mp->reduce_dtype = FSDP_DTYPE_F16;
            mp->module_classes_to_ignore = none;
        } else {
            mp->param_dtype = mp->reduce_dtype = mp->buffer_dtype = FSDP_DTYPE_F16;
        }
        uint64_t w0 = fsdp_ctx_warnings(mctx, NULL, 0);
        fsdp_unit_t *root = NULL;
        int rc = fsdp_fully_shard(m, &o, &root);
        char warn[1024];
        uint64_t nw = fsdp_ctx_warnings(mctx, warn, sizeof warn) - w0;
        tap_is_str(rc == 0 ? wu_unit_names(root) : fsdp_ctx_last_error(mctx),
                   s13 ? "(root)|transformer.encoder.layers.0|transformer.encoder.layers.1|"
                         "transformer.decoder.layers.0|transformer.decoder.layers.1"
                       : "(root)|transformer.encoder.layers.0|transformer.encoder.layers.1|"
                         "transformer.decoder.layers.0|transformer.decoder.layers.1|bn",
                   "%s: fully_shard(policy=layers, mixed precision) makes the layer units%s", id,
                   s13 ? "; with no classes to ignore bn stays in the root's" : " and a bn unit");
        fsdp_unit_t **u = NULL;
        size_t n = 0;
        bool ok = rc == 0 && fsdp_units(root, &u, &n) == 0 && n > 0;
        fsdp_mixed_precision_t off;
        fsdp_mixed_precision_init(&off);
        for (size_t i = 0; ok && i < n; i++) {
            bool is_bn = !fsdp_unit_is_root(u[i]) && strcmp(fsdp_unit_fqn(u[i]), "bn") == 0;
            ok = same_mp(u[i], is_bn ? &off : mp);
        }
        free(u);
        tap_ok(ok,
               "%s: every unit runs with use_orig_params and the given mixed precision%s", id,
               s13 ? " (f32 params, f16 reduction)" : ", except bn, which has none");
        tap_ok(s13 ? nw == 0 : nw == 1 && strstr(warn, "{BatchNorm1d}"),
               "%s: %s", id,
               s13 ? "no warning" : "one warning (fsdp_ctx_warnings) names BatchNorm1d");
        fsdp_unit_destroy(root);
        fsdp_module_release(m);
        fsdp_policy_release(p);
    }

    /* S12: _get_simple_nested_model's shape by hand, fully_shard on the child, then the root. */
    fsdp_module_t *seq = NULL, *inner = NULL;
    CHECK(fsdp_sequential_create(mctx, &seq));
    CHECK(fsdp_linear_create(mctx, 8, 4, true, &inner));
    CHECK(fsdp_module_append(seq, inner));
    fsdp_module_release(inner);
    CHECK(fsdp_linear_create(mctx, 4, 8, true, &inner));
    CHECK(fsdp_module_append(seq, inner));
    fsdp_module_release(inner);
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.pg = pg1;
    o.mixed_precision.enabled = true;
    o.mixed_precision.param_dtype = o.mixed_precision.reduce_dtype =
        o.mixed_precision.buffer_dtype = FSDP_DTYPE_F16;
    o.mixed_precision.cast_forward_inputs = true;
    fsdp_unit_t *child = NULL, *root = NULL;
    CHECK(fsdp_fully_shard(fsdp_module_child(seq, "0"), &o, &child));
    CHECK(fsdp_fully_shard(seq, &o, &root));
    tap_ok(strcmp(wu_unit_names(root), "(root)|0") == 0 && same_mp(child, &o.mixed_precision) &&
               same_mp(root, &o.mixed_precision),
           "MP-S12: fully_shard on [0] then the root: two units, both with the mixed precision "
           "given (%s)",
           wu_unit_names(root));
    fsdp_unit_destroy(root);
    fsdp_module_release(seq);
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
    test_mp_s11_s13();
    fsdp_pg_destroy(pg2);
    fsdp_pg_destroy(pg1);
    fsdp_ctx_destroy(mctx);
    return tap_done();
}
