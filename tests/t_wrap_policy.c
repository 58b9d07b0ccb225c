/* SPDX-License-Identifier: MIT */
/*
 * t_wrap_policy.c: auto-wrap policies, wrap plans and wrap-time validation (include/fsdp/policy.h)
 * against the construction-only cases of PyTorch's test_wrap.py (spec section 5).
 *
 * Everything here is planning: no process group, no unit. A plan is compared as the exact list
 * of unit FQNs in post-order ("(root)" for the root), and, where the case needs it, each unit's
 * options as merged over the root's. Warnings are captured through the context's log sink;
 * errors of constructors without a context are read from stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>
#include <fsdp/policy.h>

#include "models/models.h"
#include "tap.h"
#include "wrap_util.h"

static fsdp_ctx_t *ctx;

/* ---- log capture ----------------------------------------------------------------------------- */

static struct {
    int nwarn;
    char first[2048];
} logcap;

static void sink(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    (void)user, (void)rank;
    if (level != FSDP_LOG_WARN) return;
    if (logcap.nwarn++ == 0) snprintf(logcap.first, sizeof logcap.first, "%s", msg);
}

static void log_reset(void) {
    logcap.nwarn = 0;
    logcap.first[0] = 0;
}

/* ---- building models ------------------------------------------------------------------------- */

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ < 0) tap_bail("%s failed: %s (%s)", #call, fsdp_err_name(rc_),                    \
                              fsdp_ctx_last_error(ctx));                                           \
    } while (0)

static fsdp_module_t *linear(int64_t in, int64_t out, bool bias) {
    fsdp_module_t *m = NULL;
    CHECK(fsdp_linear_create(ctx, in, out, bias, &m));
    return m;
}

static fsdp_module_t *sequential(void) {
    fsdp_module_t *m = NULL;
    CHECK(fsdp_sequential_create(ctx, &m));
    return m;
}

static fsdp_module_t *modulelist(void) {
    fsdp_module_t *m = NULL;
    CHECK(fsdp_modulelist_create(ctx, &m));
    return m;
}

static const fsdp_module_ops_t mymodel_ops = {"MyModel", NULL, NULL};
static const fsdp_module_ops_t mymodule_ops = {"MyModule", NULL, NULL};

static fsdp_module_t *custom(const fsdp_module_ops_t *ops) {
    fsdp_module_t *m = NULL;
    CHECK(fsdp_module_create(ctx, ops, NULL, &m));
    return m;
}

/* Adds child (the parent takes it over). */
static void add(fsdp_module_t *m, const char *name, fsdp_module_t *child) {
    if (name)
        CHECK(fsdp_module_add_child(m, name, child));
    else
        CHECK(fsdp_module_append(m, child));
    fsdp_module_release(child);
}

static fsdp_module_t *child(fsdp_module_t *m, const char *path) {
    fsdp_module_t *c = fsdp_module_child(m, path);
    if (!c) tap_bail("no child %s", path);
    return c;
}

static fsdp_module_t *nested_sequential(void) {
    fsdp_module_t *m = NULL;
    CHECK(tm_nested_sequential_create(ctx, &m));
    return m;
}

/* ---- plans ----------------------------------------------------------------------------------- */

/* "a|b|(root)" */
static const char *plan_names(const fsdp_wrap_plan_t *p) {
    static char buf[2048];
    size_t o = 0;
    buf[0] = 0;
    for (size_t i = 0; i < p->n && o < sizeof buf; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s", i ? "|" : "",
                              p->entries[i].is_root ? "(root)" : p->entries[i].fqn);
    return buf;
}

static fsdp_wrap_plan_t plan_of(fsdp_module_t *root, const fsdp_policy_t *pol,
                                const fsdp_wrap_plan_options_t *o) {
    fsdp_wrap_plan_t p;
    CHECK(fsdp_wrap_plan_build(root, pol, o, &p));
    return p;
}

static void check_plan(fsdp_module_t *root, const fsdp_policy_t *pol,
                       const fsdp_wrap_plan_options_t *o, const char *want, const char *what) {
    fsdp_wrap_plan_t p = plan_of(root, pol, o);
    tap_is_str(plan_names(&p), want, "%s", what);
    fsdp_wrap_plan_free(&p);
}

static int64_t managed(const fsdp_wrap_plan_t *p, fsdp_module_t *m) {
    const fsdp_wrap_plan_entry_t *e = fsdp_wrap_plan_find(p, m);
    return e ? e->managed_numel : -1;
}

static fsdp_policy_t *size_policy(int64_t min, const char *const *extra_force_leaf) {
    fsdp_size_policy_options_t so;
    fsdp_size_policy_options_init(&so);
    so.min_num_params = min;
    so.extra_force_leaf_types = extra_force_leaf;
    fsdp_policy_t *p = NULL;
    CHECK(fsdp_policy_size_based_create(&so, &p));
    return p;
}

static bool never_fn(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    (void)m, (void)recurse, (void)numel, (void)arg;
    return false;
}

static fsdp_policy_t *never_policy(void) {
    fsdp_policy_t *p = NULL;
    CHECK(fsdp_policy_callback_create(never_fn, NULL, &p));
    return p;
}

static fsdp_policy_t *or2(fsdp_policy_t *a, fsdp_policy_t *b) {
    fsdp_policy_t *ps[2] = {a, b}, *p = NULL;
    CHECK(fsdp_policy_or_create(ps, b ? 2 : 1, &p));
    return p;
}

static const char *const layer_types[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                          NULL};
static const char *const twsp_units =
    "transformer.encoder.layers.0|transformer.encoder.layers.1|transformer.decoder.layers.0|"
    "transformer.decoder.layers.1|(root)";

/* ---- WRAP-TA-04..07 -------------------------------------------------------------------------- */

static void test_always(void) {
    fsdp_module_t *m = nested_sequential();
    fsdp_policy_t *p = NULL;
    CHECK(fsdp_policy_always_create(&p));
    tap_is_str(fsdp_policy_kind(p), "always", "always-wrap policy kind");
    check_plan(m, p, NULL, "0|1|2.0|2.1|2|(root)",
               "WRAP-TA-04: always-wrap makes all 6 modules of NestedSequentialModel units, "
               "children first");
    fsdp_policy_release(p);
    fsdp_module_release(m);
}

/* A user callback that delegates to a policy object through the generic entry. */
static bool delegate_fn(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    return fsdp_policy_call(arg, m, recurse, numel);
}

static void test_layer_policies(void) {
    fsdp_module_t *m = NULL;
    CHECK(tm_transformer_create(ctx, true, false, &m));
    fsdp_policy_t *tp = NULL, *mp = NULL, *cb = NULL;
    CHECK(fsdp_policy_transformer_create(layer_types, &tp));
    CHECK(fsdp_policy_module_types_create(layer_types, &mp));
    check_plan(m, tp, NULL, twsp_units,
               "WRAP-TA-05: transformer policy: root plus the 4 encoder/decoder layers");
    check_plan(m, mp, NULL, twsp_units,
               "WRAP-TA-06: module-types policy (ModuleWrapPolicy): the same 5 units");
    fsdp_policy_t *o1 = or2(mp, NULL);
    fsdp_policy_release(mp); /* the or-policy holds its own reference */
    check_plan(m, o1, NULL, twsp_units,
               "WRAP-TA-07: or-policy over a module-types policy object: the same 5 units");
    CHECK(fsdp_policy_callback_create(delegate_fn, tp, &cb));
    check_plan(m, cb, NULL, twsp_units,
               "WRAP-TA-07: a callback calling a policy object via fsdp_policy_call: same units");
    fsdp_policy_t *never = never_policy(), *o2 = or2(never, o1);
    check_plan(m, o2, NULL, twsp_units,
               "WRAP-TA-07: or(never, or(module types)) nests: the same 5 units");
    fsdp_module_t *enc0 = child(m, "transformer.encoder.layers.0");
    tap_is_int(fsdp_policy_decide(o2, enc0, false, 0, NULL), 1,
               "WRAP-TA-07: generic entry (module, recurse=false, numel) says yes on a layer");
    tap_is_int(fsdp_policy_decide(o2, child(m, "embed_tokens"), false, 0, NULL), 0,
               "WRAP-TA-07: and no on the embedding");
    fsdp_policy_release(never);
    fsdp_policy_release(o2);
    fsdp_policy_release(o1);
    fsdp_policy_release(cb);
    fsdp_policy_release(tp);
    fsdp_module_release(m);
}

/* ---- WRAP-TA-08 and the mixed-precision rule (F41) ------------------------------------------- */

/* "fqn:STRATEGY/PREFETCH/mp" for every entry, with the options merged over root. */
static const char *plan_options(const fsdp_wrap_plan_t *p, const fsdp_options_t *root) {
    static const char *const strat[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID",
                                        "HYBRID_ZERO2"};
    static const char *const pre[] = {"NONE", "PRE", "POST"};
    static char buf[2048];
    size_t o = 0;
    buf[0] = 0;
    for (size_t i = 0; i < p->n && o < sizeof buf; i++) {
        fsdp_options_t u;
        CHECK(fsdp_unit_overrides_apply(root, &p->entries[i].overrides, &u));
        const char *mp = !u.mixed_precision.enabled                        ? "full"
                         : u.mixed_precision.param_dtype == FSDP_DTYPE_F16 ? "f16"
                                                                           : "other";
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s:%s/%s/%s", i ? "|" : "",
                              p->entries[i].is_root ? "(root)" : p->entries[i].fqn,
                              strat[u.strategy], pre[u.backward_prefetch], mp);
    }
    return buf;
}

static void test_custom_policy(void) {
    fsdp_module_t *m = NULL;
    CHECK(tm_transformer_create(ctx, true, false, &m));
    fsdp_options_t root;
    fsdp_options_init(&root);
    root.mixed_precision.enabled = true;
    root.mixed_precision.param_dtype = FSDP_DTYPE_F16;
    fsdp_wrap_plan_options_t po;
    fsdp_wrap_plan_options_init(&po);
    po.mixed_precision = true;
    static const char *const want[2] = {
        "transformer.encoder.layers.0:FULL_SHARD/PRE/f16|"
        "transformer.encoder.layers.1:FULL_SHARD/PRE/f16|"
        "transformer.decoder.layers.0:SHARD_GRAD_OP/POST/f16|"
        "transformer.decoder.layers.1:SHARD_GRAD_OP/POST/f16|"
        "bn:NO_SHARD/PRE/full|(root):FULL_SHARD/PRE/f16",
        "transformer.encoder.layers.0:FULL_SHARD/PRE/f16|"
        "transformer.encoder.layers.1:FULL_SHARD/PRE/f16|"
        "transformer.decoder.layers.0:FULL_SHARD/PRE/f16|"
        "transformer.decoder.layers.1:FULL_SHARD/PRE/f16|"
        "bn:FULL_SHARD/PRE/full|(root):FULL_SHARD/PRE/f16"};
    for (int uniform = 0; uniform < 2; uniform++) {
        struct wu_ta08 arg = {uniform != 0, child(m, "bn")};
        fsdp_policy_t *p = NULL;
        CHECK(fsdp_policy_custom_create(wu_ta08_fn, &arg, &p));
        log_reset();
        fsdp_wrap_plan_t plan = plan_of(m, p, &po);
        tap_is_str(plan_options(&plan, &root), want[uniform],
                   "WRAP-TA-08 (%s): units and merged strategy/prefetch/precision; bn in full "
                   "precision", uniform ? "uniform" : "non-uniform");
        const fsdp_wrap_plan_entry_t *bn = fsdp_wrap_plan_find(&plan, arg.bn);
        tap_ok(bn && bn->selected && bn->mp_override,
               "WRAP-TA-08 (%s): bn chosen by the policy and overridden to full precision",
               uniform ? "uniform" : "non-uniform");
        tap_has_str(logcap.first, "These modules will be wrapped as separate FSDP",
                    "WRAP-TA-08 (%s): the precision override warns (W2)",
                    uniform ? "uniform" : "non-uniform");
        fsdp_wrap_plan_free(&plan);
        fsdp_policy_release(p);
    }
    fsdp_module_release(m);

    /* F41: the batch-norm kinds become full-precision units even under a never-wrap policy. */
    CHECK(tm_batchnorm_net_create(ctx, &m));
    fsdp_policy_t *never = never_policy();
    log_reset();
    fsdp_wrap_plan_t plan = plan_of(m, never, &po);
    tap_is_str(plan_options(&plan, &root),
               "bn1:FULL_SHARD/PRE/full|bn2:FULL_SHARD/PRE/full|bn3:FULL_SHARD/PRE/full|"
               "sync_bn:FULL_SHARD/PRE/full|(root):FULL_SHARD/PRE/f16",
               "F41: under mixed precision a never-wrap policy still wraps each BatchNorm in "
               "full precision; the root keeps f16");
    tap_is_str(logcap.first,
               "Both mixed precision and an auto-wrap policy were specified to FSDP, where the "
               "wrapped module has submodules of type:\n{BatchNorm1d, BatchNorm2d, BatchNorm3d}\n"
               "These modules will be wrapped as separate FSDP instances with mixed precision "
               "disabled.",
               "F41: the warning lists the overridden types once each");
    fsdp_wrap_plan_free(&plan);
    po.mp_ignored_types = NULL;
    check_plan(m, never, &po, "(root)", "F41: an empty override list disables the rule");
    fsdp_wrap_plan_options_init(&po);
    check_plan(m, never, &po, "(root)", "F41: without mixed precision nothing is overridden");
    fsdp_policy_release(never);
    fsdp_module_release(m);
}

/* ---- WRAP-TA-09..13: the size-based policy --------------------------------------------------- */

static void test_size_policy(void) {
    fsdp_module_t *m = nested_sequential();
    fsdp_policy_t *p40 = size_policy(40, NULL);
    fsdp_wrap_plan_t plan = plan_of(m, p40, NULL);
    tap_is_str(plan_names(&plan), "2|(root)",
               "WRAP-TA-09: size 40 on NestedSequentialModel: [2] (60) and the root");
    tap_ok(managed(&plan, child(m, "2")) == 60 && managed(&plan, m) == 60,
           "WRAP-TA-09: [2] manages 60 elements and the root the other 60");
    fsdp_wrap_plan_free(&plan);
    fsdp_module_release(m);

    m = modulelist();
    add(m, NULL, linear(5, 5, true));
    add(m, NULL, linear(5, 5, true));
    plan = plan_of(m, p40, NULL);
    tap_is_str(plan_names(&plan), "(root)",
               "WRAP-TA-10: ModuleList of two Linear(5,5): only the root (30 < 40 each)");
    tap_is_int(managed(&plan, m), 60, "WRAP-TA-10: the root manages all 60");
    fsdp_wrap_plan_free(&plan);
    fsdp_module_release(m);

    m = modulelist();
    add(m, NULL, linear(10, 10, true));
    check_plan(m, p40, NULL, "0|(root)",
               "WRAP-TA-11: ModuleList([Linear(10,10)]): the child of an excluded container is "
               "wrapped");
    fsdp_module_release(m);

    m = sequential();
    add(m, NULL, linear(10, 10, true));
    fsdp_module_t *mha = NULL;
    CHECK(fsdp_mha_create(ctx, 100, 1, 0.0, true, false, &mha));
    add(m, NULL, mha);
    check_plan(m, p40, NULL, "0|(root)",
               "WRAP-TA-12: Sequential(Linear(10,10), MHA(100,1)): [0] wrapped, the MHA not");
    fsdp_module_release(m);

    m = sequential();
    add(m, NULL, linear(10, 10, true));
    fsdp_module_t *l = modulelist();
    add(l, NULL, linear(10, 10, true));
    add(m, NULL, l);
    static const char *const extra[] = {"Linear", NULL};
    fsdp_policy_t *leaf = size_policy(40, extra);
    check_plan(m, leaf, NULL, "(root)",
               "WRAP-TA-13: force-leaf extended with Linear: only the root is a unit");
    check_plan(m, p40, NULL, "0|1.0|(root)",
               "WRAP-TA-13 contrast: with the default force-leaf set both Linears are units");
    fsdp_policy_release(leaf);
    fsdp_module_release(m);
    fsdp_policy_release(p40);
}

/* Records the modules a policy is asked about (it always says no). */
struct seen {
    const fsdp_module_t *m[64];
    int n;
};

static bool record_fn(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    struct seen *s = arg;
    (void)recurse, (void)numel;
    if (s->n < 64) s->m[s->n++] = m;
    return false;
}

static void test_force_leaf_not_entered(void) {
    fsdp_module_t *m = sequential(), *mha = NULL;
    add(m, NULL, linear(10, 10, true));
    CHECK(fsdp_mha_create(ctx, 100, 1, 0.0, true, false, &mha));
    add(m, NULL, mha);
    struct seen s = {{0}, 0};
    fsdp_policy_t *rec = NULL, *p40 = size_policy(40, NULL);
    CHECK(fsdp_policy_callback_create(record_fn, &s, &rec));
    fsdp_policy_t *o = or2(rec, p40);
    fsdp_wrap_plan_t plan = plan_of(m, o, NULL);
    const fsdp_module_t *out_proj = child(m, "1.out_proj");
    bool visited_out_proj = false, asked_mha = false;
    for (int i = 0; i < s.n; i++) {
        visited_out_proj |= s.m[i] == out_proj;
        asked_mha |= s.m[i] == child(m, "1");
    }
    tap_ok(asked_mha && !visited_out_proj && !fsdp_wrap_plan_find(&plan, out_proj),
           "WRAP-TA-12: the force-leaf MHA is asked once and its out_proj never visited");
    fsdp_wrap_plan_free(&plan);
    fsdp_policy_release(o);
    fsdp_policy_release(rec);
    fsdp_policy_release(p40);
    fsdp_module_release(m);
}

/* ---- WRAP-TA-15, 16: ignored modules --------------------------------------------------------- */

static void test_ignored(void) {
    fsdp_module_t *m = nested_sequential();
    fsdp_module_t *ign[2] = {child(m, "1"), child(m, "2.0")};
    fsdp_wrap_plan_options_t po;
    fsdp_wrap_plan_options_init(&po);
    po.ignored_modules = ign;
    po.num_ignored_modules = 2;
    fsdp_policy_t *always = NULL, *p40 = size_policy(40, NULL);
    CHECK(fsdp_policy_always_create(&always));
    check_plan(m, always, &po, "0|2.1|2|(root)",
               "WRAP-TA-15: always-wrap with [1] and [2][0] ignored: [0], [2][1], [2], root");
    fsdp_wrap_plan_t plan = plan_of(m, p40, &po);
    tap_is_str(plan_names(&plan), "(root)",
               "WRAP-TA-16: size 40 with [1] and [2][0] ignored: [2] holds 30, only the root");
    tap_is_int(managed(&plan, m), 60, "WRAP-TA-16: the root manages 60 elements, not 120");
    fsdp_wrap_plan_free(&plan);
    fsdp_module_t *bad[1] = {m};
    po.ignored_modules = bad;
    po.num_ignored_modules = 1;
    tap_is_int(fsdp_wrap_plan_build(m, always, &po, &plan), FSDP_EINVAL,
               "ignoring the root is FSDP_EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "ignored_modules[0] is the root module",
                "  and the message names ignored_modules[0]");
    fsdp_policy_release(always);
    fsdp_policy_release(p40);
    fsdp_module_release(m);
}

/* Records the root's recurse-time numel (the first call) and says yes. */
static bool root_numel_fn(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    int64_t *out = arg;
    (void)m;
    if (recurse && *out < 0) *out = numel;
    return true;
}

/* Tied parameters count once and belong to the first unit (post-order) that holds them. */
static void test_shared_params(void) {
    fsdp_module_t *m = sequential(), *a = linear(5, 5, true), *b = linear(5, 5, true);
    add(m, "a", a);
    add(m, "b", b);
    CHECK(fsdp_module_set_param(b, "weight", fsdp_module_param(a, "weight"), false));
    fsdp_policy_t *always = NULL;
    CHECK(fsdp_policy_always_create(&always));
    fsdp_wrap_plan_t plan = plan_of(m, always, NULL);
    tap_ok(managed(&plan, a) == 30 && managed(&plan, b) == 5 && managed(&plan, m) == 0,
           "a tied weight is managed by the first unit only (30, 5, 0)");
    fsdp_wrap_plan_free(&plan);
    int64_t root_numel = -1;
    fsdp_policy_t *p = NULL;
    CHECK(fsdp_policy_callback_create(root_numel_fn, &root_numel, &p));
    fsdp_wrap_plan_t p2 = plan_of(m, p, NULL);
    fsdp_wrap_plan_free(&p2);
    tap_is_int(root_numel, 35, "the policy sees the tied weight once at the root (25 + 5 + 5)");
    fsdp_policy_release(p);
    fsdp_policy_release(always);
    fsdp_module_release(m);
}

/* ---- WRAP-FW-01..03 -------------------------------------------------------------------------- */

struct marked {
    const fsdp_module_t *m[4];
    int n;
};

static bool is_marked(const fsdp_module_t *m, void *arg) {
    const struct marked *mk = arg;
    for (int i = 0; i < mk->n; i++)
        if (mk->m[i] == m) return true;
    return false;
}

static void test_already_wrapped(void) {
    for (int nested = 0; nested < 2; nested++) {
        fsdp_module_t *m = custom(&mymodel_ops);
        if (nested) {
            fsdp_module_t *s = sequential();
            add(s, NULL, linear(1, 1, false));
            add(s, NULL, linear(1, 1, false));
            add(m, "lin1", s);
        } else {
            add(m, "lin1", linear(1, 1, false));
        }
        add(m, "lin2", linear(1, 1, false));
        add(m, "lin3", linear(1, 1, false));
        struct marked mk = {{child(m, nested ? "lin1.1" : "lin1"), child(m, "lin2"),
                             child(m, "lin3")}, 3};
        char want[256];
        snprintf(want, sizeof want, "FSDP auto wrapping requires modules to not already have "
                 "FSDP applied but found %s in MyModel", nested ? "lin1.1" : "lin1");
        tap_is_int(fsdp_wrap_check_no_units(m, is_marked, &mk), FSDP_EINVAL,
                   "WRAP-FW-01 (nested %d): a tree holding units is refused", nested);
        tap_is_str(fsdp_ctx_last_error(ctx), want,
                   "WRAP-FW-01 (nested %d): the message names the first unit in traversal order",
                   nested);
        tap_is_int(fsdp_wrap_check_no_units(m, NULL, NULL), FSDP_OK,
                   "WRAP-FW-01 (nested %d): with fsdp_unit_of, a plain tree passes", nested);
        fsdp_module_release(m);
    }
}

static bool bnnet_fn(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    (void)numel, (void)arg;
    return recurse || strcmp(fsdp_module_type(m), "BatchNormNet") == 0;
}

static void test_batchnorm_individually(void) {
    static const char *const bn[] = {FSDP_TYPE_BATCHNORM, NULL};
    fsdp_module_t *m = NULL;
    CHECK(tm_batchnorm_net_create(ctx, &m));
    fsdp_policy_t *ind = NULL;
    CHECK(fsdp_policy_types_individually_create(bn, &ind));
    check_plan(m, ind, NULL, "bn1|bn2|bn3|sync_bn|(root)",
               "WRAP-FW-02: BatchNorm family individually: bn1, bn2, bn3, sync_bn; not lin");
    fsdp_policy_t *never = never_policy(), *o = or2(never, ind);
    check_plan(m, o, NULL, "bn1|bn2|bn3|sync_bn|(root)",
               "WRAP-FW-02: or-ed with a never-wrap policy: the same units");
    fsdp_policy_release(o);

    fsdp_module_t *top = custom(&mymodule_ops);
    add(top, "bn_container", m);
    fsdp_policy_t *a = NULL;
    CHECK(fsdp_policy_callback_create(bnnet_fn, NULL, &a));
    o = or2(a, ind);
    check_plan(top, o, NULL,
               "bn_container.bn1|bn_container.bn2|bn_container.bn3|bn_container.sync_bn|"
               "bn_container|(root)",
               "WRAP-FW-03: A or B: every BN inside the container is a unit, before the "
               "container (post-order), the or not stopping recursion");
    check_plan(top, a, NULL, "bn_container|(root)",
               "WRAP-FW-03: A alone: the container is a unit, no BN is");
    tap_ok(fsdp_policy_type_matches("SyncBatchNorm", FSDP_TYPE_BATCHNORM) &&
               fsdp_policy_type_matches("BatchNorm3d", FSDP_TYPE_BATCHNORM) &&
               !fsdp_policy_type_matches("LayerNorm", FSDP_TYPE_BATCHNORM) &&
               fsdp_policy_type_matches("Linear", "Linear"),
           "the _BatchNorm family tag covers BatchNorm1d/2d/3d and SyncBatchNorm only");
    fsdp_policy_release(o);
    fsdp_policy_release(a);
    fsdp_policy_release(never);
    fsdp_policy_release(ind);
    fsdp_module_release(top);
}

/* ---- WRAP-TA-17, WRAP-WU-01: frozen parameters ----------------------------------------------- */

#define FROZEN_HEAD(fqn) fqn " has both parameters with requires_grad=True and False."
#define FROZEN_FLAT " FSDP does not support wrapping such modules when use_orig_params=False. "
#define FROZEN_ORIG(total, on)                                                                     \
    " We do not recommend wrapping such modules since the gradient memory usage will be higher "  \
    "than expected (" total " numel instead of " on " numel before sharding via "                  \
    "reduce-scatter). "
#define FROZEN_TAIL "If possible, wrap the frozen parameters with FSDP separately.\n"

static void test_frozen_policies(void) {
    fsdp_module_t *m = NULL;
    CHECK(tm_lora_create(ctx, &m));
    bool uniform = true, nonuniform = false;
    fsdp_policy_t *pols[3] = {NULL, NULL, NULL};
    CHECK(fsdp_policy_module_types_create(wu_lora_types, &pols[0]));
    CHECK(fsdp_policy_custom_create(wu_lora_fn, &uniform, &pols[1]));
    CHECK(fsdp_policy_custom_create(wu_lora_fn, &nonuniform, &pols[2]));
    static const char *const names[3] = {"ModuleWrapPolicy", "CustomPolicy uniform",
                                         "CustomPolicy non-uniform"};
    fsdp_wrap_plan_options_t po;
    fsdp_wrap_plan_options_init(&po);
    for (int i = 0; i < 3; i++) {
        fsdp_wrap_plan_t plan = plan_of(m, pols[i], &po);
        const fsdp_wrap_plan_entry_t *attn = fsdp_wrap_plan_find(&plan, child(m, "layers.0.attn"));
        if (i == 0)
            tap_is_str(plan_names(&plan),
                       "layers.0.attn|layers.0.mlp|layers.0|layers.1.attn|layers.1.mlp|layers.1|"
                       "layers.2.attn|layers.2.mlp|layers.2|layers.3.attn|layers.3.mlp|layers.3|"
                       "(root)",
                       "WRAP-TA-17: the LoRA plan: attention, MLP and decoder of each layer");
        if (i == 2)
            tap_ok(attn && attn->overrides.has_strategy &&
                       attn->overrides.strategy == FSDP_SHARD_GRAD_OP,
                   "WRAP-TA-17 (%s): the attention units carry SHARD_GRAD_OP", names[i]);
        for (int orig = 0; orig < 2; orig++) {
            po.use_orig_params = orig != 0;
            log_reset();
            char *msg = NULL;
            int rc = fsdp_wrap_plan_validate_frozen(m, &plan, &po, &msg);
            if (orig) {
                const char *want = FROZEN_HEAD("layers.0.attn") " We do not recommend "
                                                                "wrapping such modules";
                tap_ok(rc == FSDP_OK && logcap.nwarn == 4 &&
                           strncmp(logcap.first, want, strlen(want)) == 0,
                       "WRAP-TA-17 (%s, use_orig_params): one warning per attention, the first "
                       "naming layers.0.attn", names[i]);
            } else {
                const char *want = FROZEN_HEAD("layers.0.attn") FROZEN_FLAT;
                tap_ok(rc == FSDP_EINVAL && logcap.nwarn == 0 &&
                           strncmp(fsdp_ctx_last_error(ctx), want, strlen(want)) == 0,
                       "WRAP-TA-17 (%s, flat): FSDP_EINVAL naming layers.0.attn", names[i]);
            }
            free(msg);
        }
        po.use_orig_params = false;
        fsdp_wrap_plan_free(&plan);
    }
    for (int i = 0; i < 3; i++) fsdp_policy_release(pols[i]);
    fsdp_module_release(m);
}

static void test_validate_frozen(void) {
    static const char *const lists =
        "The following parameters have requires_grad=True:\n['layers.0.attn.lora_A.weight']\n"
        "The following parameters have requires_grad=False:\n['layers.0.attn.q_proj.weight', "
        "'layers.0.attn.k_proj.weight', 'layers.0.attn.v_proj.weight', "
        "'layers.0.attn.o_proj.weight']";
    fsdp_module_t *m = NULL;
    CHECK(tm_lora_create(ctx, &m));
    fsdp_module_t *units[16];
    fsdp_tensor_t *ign[4];
    size_t n = 0;
    for (int l = 0; l < 4; l++) {
        char p[64];
        snprintf(p, sizeof p, "layers.%d.attn.lora_A", l);
        units[n++] = child(m, p);
        ign[l] = fsdp_module_param(child(m, p), "weight");
        snprintf(p, sizeof p, "layers.%d.attn.lora_B", l);
        units[n++] = child(m, p);
    }
    for (int orig = 0; orig < 2; orig++) {
        const char *mode = orig ? "use_orig_params" : "flat";
        char *msg = NULL;
        log_reset();
        tap_is_int(fsdp_wrap_validate_frozen(m, units, 8, NULL, 0, orig, &msg), FSDP_OK,
                   "WRAP-WU-01 (%s) step 1: lora_A and lora_B only: OK", mode);
        size_t k = 8;
        for (int l = 0; l < 4; l++) {
            char p[64];
            snprintf(p, sizeof p, "layers.%d.attn", l);
            units[k++] = child(m, p);
        }
        tap_is_int(fsdp_wrap_validate_frozen(m, units, k, NULL, 0, orig, &msg), FSDP_OK,
                   "WRAP-WU-01 (%s) step 2: plus every LoraAttention: OK", mode);
        for (int l = 0; l < 4; l++) {
            char p[64];
            snprintf(p, sizeof p, "layers.%d", l);
            units[k++] = child(m, p);
        }
        tap_ok(fsdp_wrap_validate_frozen(m, units, k, NULL, 0, orig, &msg) == FSDP_OK &&
                   logcap.nwarn == 0 && msg == NULL,
               "WRAP-WU-01 (%s) step 3: plus every LoraDecoder: OK, no warning", mode);
        /* Step 4: stop wrapping lora_A (entries 0, 2, 4, 6). */
        fsdp_module_t *noa[16];
        size_t j = 0;
        for (size_t i = 0; i < k; i++)
            if (i >= 8 || i % 2 == 1) noa[j++] = units[i];
        int rc = fsdp_wrap_validate_frozen(m, noa, j, NULL, 0, orig, &msg);
        char want[1024];
        snprintf(want, sizeof want, "%s%s%s%s", FROZEN_HEAD("layers.0.attn"),
                 orig ? FROZEN_ORIG("4352", "256") : FROZEN_FLAT, FROZEN_TAIL, lists);
        tap_is_int(rc, orig ? FSDP_OK : FSDP_EINVAL,
                   "WRAP-WU-01 (%s) step 4: without lora_A: %s", mode,
                   orig ? "a warning" : "FSDP_EINVAL");
        tap_is_str(msg, want, "WRAP-WU-01 (%s) step 4: the exact message (4352 vs 256 numel)",
                   mode);
        if (orig)
            tap_ok(logcap.nwarn == 4 && strcmp(logcap.first, want) == 0,
                   "WRAP-WU-01 (use_orig_params) step 4: logged at warn through the sink, one "
                   "per layer, the first exact");
        else
            tap_ok(strncmp(fsdp_ctx_last_error(ctx), want, strlen(want)) == 0 &&
                       logcap.nwarn == 0,
                   "WRAP-WU-01 (flat) step 4: the context's last error holds the message");
        free(msg);
        msg = NULL;
        log_reset();
        tap_ok(fsdp_wrap_validate_frozen(m, noa, j, ign, 4, orig, &msg) == FSDP_OK &&
                   logcap.nwarn == 0 && msg == NULL,
               "WRAP-WU-01 (%s) step 5: lora_A's weights ignored: OK again", mode);
    }
    fsdp_module_release(m);
}

/* ---- bad input ------------------------------------------------------------------------------- */

static int bad_custom_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    (void)arg;
    if (strcmp(fsdp_module_type(m), "Linear") != 0) return FSDP_POLICY_NO;
    ov->has_strategy = true;
    ov->strategy = (fsdp_sharding_strategy_t)42;
    return FSDP_POLICY_OVERRIDE;
}

static int empty_custom_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    (void)m, (void)ov, (void)arg;
    return FSDP_POLICY_OVERRIDE;
}

static void test_bad_input(void) {
    fsdp_module_t *m = nested_sequential();
    fsdp_wrap_plan_t plan;
    tap_is_int(fsdp_wrap_plan_build(m, NULL, NULL, &plan), FSDP_EINVAL,
               "plan with a NULL policy is FSDP_EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "policy is NULL", "  and the message names policy");

    char err[1024];
    fsdp_size_policy_options_t so;
    fsdp_size_policy_options_init(&so);
    so.min_num_params = -1;
    fsdp_policy_t *p = (fsdp_policy_t *)1;
    wu_stderr_begin();
    int rc = fsdp_policy_size_based_create(&so, &p);
    wu_stderr_end(err, sizeof err);
    tap_ok(rc == FSDP_EINVAL && p == NULL, "size policy with min_num_params -1 is FSDP_EINVAL");
    tap_has_str(err, "min_num_params -1 must be >= 0", "  and the message names min_num_params");

    wu_stderr_begin();
    rc = fsdp_policy_or_create(NULL, 0, &p);
    int rc2 = fsdp_policy_module_types_create(NULL, &p);
    int rc3 = fsdp_policy_custom_create(NULL, NULL, &p);
    wu_stderr_end(err, sizeof err);
    tap_ok(rc == FSDP_EINVAL && rc2 == FSDP_EINVAL && rc3 == FSDP_EINVAL,
           "or of nothing, types NULL and a NULL custom function are FSDP_EINVAL");
    tap_ok(strstr(err, "policies is NULL") && strstr(err, "types is NULL") &&
               strstr(err, "fn is NULL"),
           "  and each message names its parameter");

    fsdp_policy_t *c = NULL;
    CHECK(fsdp_policy_custom_create(bad_custom_fn, NULL, &c));
    tap_is_int(fsdp_wrap_plan_build(m, c, NULL, &plan), FSDP_EINVAL,
               "a custom override with strategy 42 is FSDP_EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "invalid strategy (42)",
                "  and the message names the field");
    tap_ok(plan.n == 0 && plan.entries == NULL, "  and the plan is left empty");
    fsdp_policy_release(c);
    CHECK(fsdp_policy_custom_create(empty_custom_fn, NULL, &c));
    check_plan(m, c, NULL, "(root)", "an override with nothing set means no (an empty dict)");
    fsdp_policy_release(c);
    fsdp_module_release(m);
}

int main(void) {
    setenv("FSDP_LOG", "warn", 1);
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_WARN;
    if (fsdp_ctx_create(&co, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    fsdp_ctx_set_log_sink(ctx, sink, NULL);
    tap_plan_lazy();
    test_always();
    test_layer_policies();
    test_custom_policy();
    test_size_policy();
    test_force_leaf_not_entered();
    test_ignored();
    test_shared_params();
    test_already_wrapped();
    test_batchnorm_individually();
    test_frozen_policies();
    test_validate_frozen();
    test_bad_input();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
