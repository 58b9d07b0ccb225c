/* SPDX-License-Identifier: MIT */
/*
 * t_gpt_recipe.c: the GPT training recipe (include/fsdp/gpt_recipe.h) that fsdp-train, the
 * benchmarks and their PyTorch twins share: which parameters AdamW decays (the rule by name and
 * the two groups it builds, unwrapped and wrapped, where parameters are 1-D shard views), what a
 * step with zero gradients does to each group (only the decay moves a parameter), the seeded
 * model, one FSDP unit per GPTBlock under the root with use_orig_params, and the refusals.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

#define LAYERS 2
#define WORLD 2

/* A small GPT of LAYERS blocks. */
static void tiny_config(fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    cfg->vocab = 64;
    cfg->max_seq = 16;
    cfg->n_layer = LAYERS;
    cfg->n_head = 4;
    cfg->d_model = 16;
    cfg->dropout = 0.0;
}

/* The two groups the rule must give for LAYERS blocks, as "name name ...", in the model's
 * parameter order. */
static void expected_groups(char *decay, char *rest, size_t cap) {
    snprintf(decay, cap, "wte.weight");
    snprintf(rest, cap, "wpe.weight");
    for (int b = 0; b < LAYERS; b++) {
        char d[256], r[256];
        snprintf(d, sizeof d,
                 " h.%d.attn.c_attn.weight h.%d.attn.c_proj.weight h.%d.mlp.c_fc.weight"
                 " h.%d.mlp.c_proj.weight",
                 b, b, b, b);
        snprintf(r, sizeof r,
                 " h.%d.ln_1.weight h.%d.ln_1.bias h.%d.attn.c_attn.bias h.%d.attn.c_proj.bias"
                 " h.%d.ln_2.weight h.%d.ln_2.bias h.%d.mlp.c_fc.bias h.%d.mlp.c_proj.bias",
                 b, b, b, b, b, b, b, b);
        strncat(decay, d, cap - strlen(decay) - 1);
        strncat(rest, r, cap - strlen(rest) - 1);
    }
    strncat(rest, " ln_f.weight ln_f.bias", cap - strlen(rest) - 1);
}

/* The names of an optimizer group as "name name ...". */
static void group_names(const fsdp_optim_t *opt, int g, char *buf, size_t cap) {
    buf[0] = 0;
    for (size_t i = 0; i < fsdp_optim_group_size(opt, g); i++) {
        const char *name = NULL;
        fsdp_optim_group_param(opt, g, i, &name);
        if (i) strncat(buf, " ", cap - strlen(buf) - 1);
        strncat(buf, name ? name : "(null)", cap - strlen(buf) - 1);
    }
}

/* ---- the rule ------------------------------------------------------------------------------- */

static void test_rule(void) {
    static const struct {
        const char *name;
        int ndim;
        bool decays;
    } cases[] = {
        {"wte.weight", 2, true},  /* token embedding and tied head: a matrix */
        {"wpe.weight", 2, false}, /* the position table is the one matrix left alone */
        {"h.0.attn.c_attn.weight", 2, true},
        {"h.11.mlp.c_proj.weight", 2, true},
        {"h.0.attn.c_attn.bias", 1, false},
        {"h.0.ln_1.weight", 1, false},
        {"ln_f.bias", 1, false},
        {"x.scale", 0, false},
        {"h.0.wpe.weight", 2, true}, /* only the model's own position table is exempt */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        tap_ok(fsdp_gpt_recipe_decays(cases[i].name, cases[i].ndim) == cases[i].decays,
               "%s (%d dims) %s", cases[i].name, cases[i].ndim,
               cases[i].decays ? "decays" : "does not decay");
    tap_ok(!fsdp_gpt_recipe_decays(NULL, 2), "a NULL name does not decay");

    fsdp_adam_options_t a;
    fsdp_gpt_recipe_adamw_options_init(&a);
    tap_ok(a.kind == FSDP_OPTIM_ADAMW && a.lr == 1e-3 && a.beta1 == 0.9 && a.beta2 == 0.95 &&
               a.eps == 1e-8 && a.weight_decay == 0.1 && !a.amsgrad,
           "AdamW defaults: lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1");
}

/* ---- unwrapped: the model and the groups ---------------------------------------------------- */

/* Every parameter of m copied to the host, one after the other (f32); *n receives the count. */
static float *params_to_host(const fsdp_named_list_t *l, size_t *n) {
    size_t total = 0;
    for (size_t i = 0; i < l->n; i++)
        total += (size_t)fsdp_tensor_numel(l->tensors[i]);
    float *v = malloc((total ? total : 1) * sizeof *v), *p = v;
    for (size_t i = 0; v && i < l->n; i++) {
        size_t k = (size_t)fsdp_tensor_numel(l->tensors[i]);
        if (fsdp_tensor_to_host(l->tensors[i], p, k * sizeof *p) < 0) tap_bail("to_host");
        p += k;
    }
    *n = total;
    return v;
}

static void test_unwrapped(void) {
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    fsdp_gpt_config_t cfg;
    tiny_config(&cfg);
    fsdp_module_t *m = NULL, *again = NULL;
    tap_is_int(fsdp_gpt_recipe_create_model(ctx, &cfg, 7, &m), FSDP_OK, "create the model");
    if (!m) tap_bail("%s", fsdp_ctx_last_error(ctx));
    tap_ok(fsdp_module_is_training(m), "in training mode");
    fsdp_rng_init(fsdp_ctx_rng(ctx), 99, 3); /* whatever the stream was, the seed decides */
    tap_is_int(fsdp_gpt_recipe_create_model(ctx, &cfg, 7, &again), FSDP_OK, "and again");
    fsdp_named_list_t a = {0}, b = {0};
    fsdp_module_named_params(m, false, &a);
    fsdp_module_named_params(again, false, &b);
    size_t na = 0, nb = 0;
    float *va = params_to_host(&a, &na), *vb = params_to_host(&b, &nb);
    tap_ok(na == nb && memcmp(va, vb, na * sizeof *va) == 0,
           "the same seed gives the same weights, whatever the context's stream was");
    free(va);
    free(vb);
    fsdp_named_list_free(&b);
    fsdp_module_release(again);

    /* The groups. */
    char want0[2048], want1[2048], got[2048];
    expected_groups(want0, want1, sizeof want0);
    fsdp_adam_options_t hp;
    fsdp_gpt_recipe_adamw_options_init(&hp);
    hp.lr = 0.01;
    hp.weight_decay = 0.5;
    fsdp_optim_t *opt = NULL;
    tap_is_int(fsdp_gpt_recipe_create_adamw(m, &hp, &opt), FSDP_OK, "AdamW over the model");
    if (!opt) tap_bail("%s", fsdp_ctx_last_error(ctx));
    tap_is_int(fsdp_optim_num_groups(opt), 2, "two groups");
    tap_is_int(fsdp_optim_kind(opt), FSDP_OPTIM_ADAMW, "decoupled weight decay (AdamW)");
    group_names(opt, 0, got, sizeof got);
    tap_is_str(got, want0, "group 0: wte and the blocks' matrices");
    group_names(opt, 1, got, sizeof got);
    tap_is_str(got, want1, "group 1: wpe, the biases and the LayerNorm parameters");
    fsdp_adam_options_t g0, g1;
    fsdp_optim_get_options(opt, 0, &g0);
    fsdp_optim_get_options(opt, 1, &g1);
    tap_ok(g0.weight_decay == 0.5 && g1.weight_decay == 0.0, "weight decay 0.5 and 0");
    tap_ok(g0.lr == 0.01 && g1.lr == 0.01 && g0.beta2 == 0.95 && g1.beta2 == 0.95 &&
               g1.eps == hp.eps,
           "the other hyper-parameters are the caller's in both groups");

    /* A step with zero gradients: Adam's update is 0, so only the decay moves a parameter. */
    size_t n = 0;
    float *before = params_to_host(&a, &n);
    for (size_t i = 0; i < a.n; i++) {
        fsdp_tensor_t *z = NULL, *p = a.tensors[i];
        if (fsdp_tensor_zeros(ctx, fsdp_tensor_dtype(p), fsdp_tensor_ndim(p), fsdp_tensor_shape(p),
                              FSDP_MEM_GRADS, &z) < 0 ||
            fsdp_tensor_set_grad(p, z) < 0)
            tap_bail("zero gradient");
        fsdp_tensor_release(z);
    }
    tap_is_int(fsdp_optim_step(opt), FSDP_OK, "a step with zero gradients");
    float *after = params_to_host(&a, &n);
    const float keep = (float)(1.0 - hp.lr * hp.weight_decay);
    size_t off = 0, wrong = 0, decayed_moved = 0;
    for (size_t i = 0; i < a.n; i++) {
        size_t k = (size_t)fsdp_tensor_numel(a.tensors[i]);
        bool decays = strstr(want0, a.names[i]) != NULL;
        size_t bad = 0, moved = 0;
        for (size_t e = off; e < off + k; e++) {
            float want = decays ? before[e] * keep : before[e];
            bad += fabsf(after[e] - want) > 1e-7f * fabsf(before[e]);
            moved += after[e] != before[e];
        }
        if (bad) tap_diag("%s: %zu of %zu elements off", a.names[i], bad, k);
        wrong += bad;
        decayed_moved += decays && moved;
        off += k;
    }
    tap_is_size(wrong, 0, "decayed parameters shrank by 1 - lr wd, the others did not move");
    tap_is_size(decayed_moved, 1 + 4 * LAYERS, "every decayed matrix moved");
    free(before);
    free(after);
    fsdp_optim_destroy(opt);
    fsdp_named_list_free(&a);

    /* Refusals. */
    opt = (fsdp_optim_t *)1;
    tap_is_int(fsdp_gpt_recipe_create_adamw(m, NULL, NULL), FSDP_EINVAL, "a NULL out is EINVAL");
    tap_is_int(fsdp_gpt_recipe_create_adamw(NULL, NULL, &opt), FSDP_EINVAL, "so is a NULL model");
    tap_ok(opt == NULL, "and *out is NULL");
    hp.beta1 = 1.5;
    tap_is_int(fsdp_gpt_recipe_create_adamw(m, &hp, &opt), FSDP_EINVAL, "bad betas are refused");
    fsdp_module_t *block = fsdp_module_child(m, "h.0");
    tap_is_int(fsdp_gpt_recipe_wrap(block, NULL, NULL), FSDP_EINVAL, "a GPTBlock is not a GPT");
    tap_has_str(fsdp_ctx_last_error(ctx), "not a GPT", "and the error says so");
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

/* ---- wrapped on sim ranks ------------------------------------------------------------------- */

typedef struct rank_result {
    int rc;
    char what[128]; /* what failed */
    size_t nunits;
    char fqns[256];      /* the units' fqns, "<root> h.0 h.1" */
    int orig_params;     /* units with use_orig_params */
    char group[2][2048]; /* the AdamW groups' names */
    int policy_rc;       /* wrap with a policy of the caller's */
    int flat_rc;         /* AdamW over a root wrapped without use_orig_params */
    int child_rc;        /* AdamW over a non-root unit */
    char flat_err[512];
} rank_result_t;

static rank_result_t results[WORLD];

#define CHECK(call, label)                                                                         \
    do {                                                                                           \
        if ((res->rc = (call)) < 0) {                                                              \
            snprintf(res->what, sizeof res->what, "%s: %s", label, fsdp_ctx_last_error(ctx));      \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

static int wrapped_rank(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    rank_result_t *res = &results[fsdp_ctx_rank(ctx)];
    fsdp_gpt_config_t cfg;
    tiny_config(&cfg);
    fsdp_module_t *m = NULL, *plain = NULL;
    fsdp_unit_t *root = NULL, *plain_root = NULL, **units = NULL;
    fsdp_optim_t *opt = NULL, *bad = NULL;
    fsdp_policy_t *any = NULL;

    CHECK(fsdp_gpt_recipe_create_model(ctx, &cfg, 7, &m), "create_model");
    /* A policy of the caller's is refused before anything is wrapped. */
    CHECK(fsdp_policy_always_create(&any), "a policy");
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.auto_wrap_policy = any;
    res->policy_rc = fsdp_gpt_recipe_wrap(m, &o, &root);
    o.auto_wrap_policy = NULL;
    o.check_exec_order = true;
    CHECK(fsdp_gpt_recipe_wrap(m, &o, &root), "wrap");
    CHECK(fsdp_units(root, &units, &res->nunits), "units");
    for (size_t i = 0; i < res->nunits; i++) {
        const char *f = fsdp_unit_fqn(units[i]);
        size_t len = strlen(res->fqns);
        snprintf(res->fqns + len, sizeof res->fqns - len, "%s%s", i ? " " : "",
                 f[0] ? f : "<root>");
        fsdp_options_t uo;
        if (fsdp_unit_options(units[i], &uo) == FSDP_OK && uo.use_orig_params) res->orig_params++;
    }
    CHECK(fsdp_gpt_recipe_create_adamw(m, NULL, &opt), "create_adamw");
    group_names(opt, 0, res->group[0], sizeof res->group[0]);
    group_names(opt, 1, res->group[1], sizeof res->group[1]);
    res->child_rc = fsdp_gpt_recipe_create_adamw(fsdp_unit_module(units[1]), NULL, &bad);

    /* The same model wrapped without use_orig_params: flat parameters cannot be split. */
    CHECK(fsdp_gpt_recipe_create_model(ctx, &cfg, 7, &plain), "create_model");
    fsdp_options_init(&o);
    CHECK(fsdp_wrap(plain, &o, &plain_root), "plain wrap");
    res->flat_rc = fsdp_gpt_recipe_create_adamw(plain, NULL, &bad);
    snprintf(res->flat_err, sizeof res->flat_err, "%s", fsdp_ctx_last_error(ctx));
out:
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(bad);
    free(units);
    fsdp_policy_release(any);
    fsdp_unit_destroy(plain_root);
    fsdp_module_release(plain);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return res->rc;
}

static void test_wrapped(void) {
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = WORLD;
    int rc = fsdp_sim_run(&so, wrapped_rank, NULL, NULL);
    tap_is_int(rc, FSDP_OK, "%d sim ranks wrap the model and make its AdamW", WORLD);
    char want0[2048], want1[2048];
    expected_groups(want0, want1, sizeof want0);
    for (int r = 0; r < WORLD; r++) {
        const rank_result_t *res = &results[r];
        if (res->rc < 0) tap_diag("rank %d: %s", r, res->what);
        tap_is_int(res->policy_rc, FSDP_EINVAL, "rank %d: a caller's auto-wrap policy is refused",
                   r);
        tap_is_size(res->nunits, 1 + LAYERS, "rank %d: one unit per block and the root", r);
        tap_is_str(res->fqns, "<root> h.0 h.1", "rank %d: the units are the root and h.N", r);
        tap_is_int(res->orig_params, 1 + LAYERS, "rank %d: every unit has use_orig_params", r);
        tap_is_str(res->group[0], want0,
                   "rank %d: group 0 as unwrapped (decided on the registered shapes, not on the "
                   "1-D shard views)",
                   r);
        tap_is_str(res->group[1], want1, "rank %d: group 1 as unwrapped", r);
        tap_is_int(res->child_rc, FSDP_EINVAL, "rank %d: AdamW over a block's unit is refused", r);
        tap_is_int(res->flat_rc, FSDP_EINVAL,
                   "rank %d: AdamW over flat parameters (no use_orig_params) is refused", r);
        tap_has_str(res->flat_err, "use_orig_params", "rank %d: and the error says why", r);
    }
}

int main(void) {
    tap_plan_lazy();
    test_rule();
    test_unwrapped();
    test_wrapped();
    return tap_done();
}
