/* SPDX-License-Identifier: MIT */
/*
 * t_models.c: the structure of the seed test models (tests/models/models.h).
 *
 * For each model: parameter counts, fully qualified names in PyTorch's order, module types, the
 * upstream FSDP unit paths, and a forward giving the expected output shape. Model-specific
 * properties: the tied embedding of TransformerWithSharedParams (once in named parameters, twice
 * with aliases and in the state dict), its int64 buffer and BatchNorm; MixtureOfExperts' expert
 * weights differing between ranks 0 and 1 while the shared ones agree; LoraModel's
 * requires_grad pattern. Values against PyTorch are t_golden_models' job.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/nn.h>
#include <fsdp/sim.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

#include "models/models.h"
#include "tap.h"

static fsdp_ctx_t *new_ctx(int rank, int world, uint64_t seed) {
    fsdp_ctx_options_t o;
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_init(&o);
    o.rank = rank;
    o.world_size = world;
    o.seed = seed;
    if (fsdp_ctx_create(&o, &ctx) < 0)
        tap_bail("fsdp_ctx_create(rank %d of %d) failed", rank, world);
    return ctx;
}

/* Reports whether a constructor succeeded; bails out when it did not (later checks need it). */
static fsdp_module_t *built(fsdp_ctx_t *ctx, int rc, fsdp_module_t *m, const char *what) {
    if (!tap_ok(rc == 0 && m, "%s: built", what))
        tap_bail("%s: %s (%s)", what, fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
    return m;
}

/* The names of a listing against an expected NULL-terminated list, in order. */
static void check_names(const fsdp_named_list_t *l, const char *const *want, const char *what) {
    size_t n = 0;
    while (want[n])
        n++;
    size_t i = 0;
    while (i < l->n && i < n && strcmp(l->names[i], want[i]) == 0)
        i++;
    if (i == n && l->n == n) {
        tap_ok(1, "%s: the %zu names in PyTorch's order", what, n);
        return;
    }
    char d[512];
    snprintf(d, sizeof d, "%zu names, want %zu; first difference at %zu: got \"%s\", want \"%s\"",
             l->n, n, i, i < l->n ? l->names[i] : "(end)", i < n ? want[i] : "(end)");
    tap_ok(0, "%s: the %zu names in PyTorch's order", what, n);
    tap_diag("%s", d);
}

static void check_param_names(const fsdp_module_t *m, bool aliases, const char *const *want,
                              const char *what) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, aliases, &l);
    if (!tap_ok(rc == 0, "%s: named params listed", what)) return;
    check_names(&l, want, what);
    fsdp_named_list_free(&l);
}

/* Shape of t equals want[0..nd). */
static int check_shape(const fsdp_tensor_t *t, int nd, const int64_t *want, const char *what) {
    bool ok = t && fsdp_tensor_ndim(t) == nd;
    for (int d = 0; ok && d < nd; d++)
        ok = fsdp_tensor_size(t, d) == want[d];
    char got[128] = "(none)";
    if (t) fsdp_tensor_describe(t, got, sizeof got);
    int r = tap_ok(ok, "%s: shape", what);
    if (!r) tap_diag("got %s", got);
    return r;
}

/* Every unit path names a module of the tree. */
static void check_units(const fsdp_module_t *m, const char *const *units, size_t want,
                        const char *what) {
    size_t n = 0, found = 0;
    for (; units[n]; n++)
        if (fsdp_module_child(m, units[n])) found++;
    tap_ok(n == want && found == n, "%s: %zu unit paths, all present (%zu found)", what, want,
           found);
}

static bool same_values(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (!a || !b || fsdp_tensor_numel(a) != fsdp_tensor_numel(b)) return false;
    size_t bytes = (size_t)fsdp_tensor_numel(a) * sizeof(float);
    float *x = malloc(bytes), *y = malloc(bytes);
    bool eq = x && y && fsdp_tensor_to_host(a, x, bytes) == 0 &&
              fsdp_tensor_to_host(b, y, bytes) == 0 && memcmp(x, y, bytes) == 0;
    free(x);
    free(y);
    return eq;
}

/* Forward, sum (or given) loss, backward: every trainable parameter gets a gradient. */
static void check_backward(fsdp_module_t *m, fsdp_tensor_t *loss, const char *what) {
    int rc = fsdp_backward(loss, NULL);
    tap_ok(rc == 0, "%s: backward runs", what);
    fsdp_named_list_t l = {0};
    size_t missing = 0;
    if (fsdp_module_named_params(m, false, &l) == 0) {
        for (size_t i = 0; i < l.n; i++)
            if (fsdp_tensor_requires_grad(l.tensors[i]) && !fsdp_tensor_grad(l.tensors[i]))
                missing++;
    }
    tap_is_size(missing, 0, "%s: every trainable parameter has a gradient (%zu params)", what, l.n);
    fsdp_named_list_free(&l);
}

/* ---- the models ------------------------------------------------------------------------------ */

static const char *const nested_names[] = {"module.0.weight",
                                           "module.0.bias",
                                           "module.1.0.weight",
                                           "module.1.0.bias",
                                           "module.1.1.weight",
                                           "module.1.1.bias",
                                           "module.2.weight",
                                           "module.2.bias",
                                           "module.3.weight",
                                           "module.3.bias",
                                           NULL};

static void test_nested(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1, 7);
    fsdp_module_t *m = NULL;
    int rc = tm_nested_wrapped_create(ctx, true, &m);
    built(ctx, rc, m, "NestedWrappedModule");
    tap_is_str(fsdp_module_type(m), "NestedWrappedModule", "NestedWrappedModule: root type");
    tap_is_int(fsdp_module_num_params(m), TM_NESTED_NUM_PARAMS,
               "NestedWrappedModule: 496 parameters");
    check_param_names(m, false, nested_names, "NestedWrappedModule");
    fsdp_named_list_t mods = {0};
    static const char *const mod_names[] = {"",         "module",     "module.0",
                                            "module.1", "module.1.0", "module.1.1",
                                            "module.2", "module.3",   NULL};
    if (tap_ok(fsdp_module_named_modules(m, &mods) == 0, "NestedWrappedModule: named modules"))
        check_names(&mods, mod_names, "NestedWrappedModule (AlwaysWrap units: every module)");
    fsdp_named_list_free(&mods);
    check_units(m, tm_nested_wrapped_units(), 3, "NestedWrappedModule");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "module.1")), "Sequential",
               "NestedWrappedModule: module.1 is a Sequential");

    /* Deterministic: a second build (another context seed, another rank) has the same values. */
    fsdp_ctx_t *ctx2 = new_ctx(1, 2, 99);
    fsdp_module_t *m2 = NULL;
    rc = tm_nested_wrapped_create(ctx2, true, &m2);
    built(ctx2, rc, m2, "NestedWrappedModule (rank 1 of 2)");
    bool same = true;
    for (int i = 0; nested_names[i]; i++)
        same = same && same_values(fsdp_module_param(m, nested_names[i]),
                                   fsdp_module_param(m2, nested_names[i]));
    tap_ok(same, "NestedWrappedModule: deterministic init equal on ranks 0 and 1");

    fsdp_tensor_t *x = NULL, *x2 = NULL, *y = NULL, *loss = NULL;
    rc = tm_nested_wrapped_get_input(ctx, &x);
    tm_nested_wrapped_get_input(ctx2, &x2);
    static const int64_t in_shape[2] = {4, 8};
    check_shape(x, 2, in_shape, "NestedWrappedModule get_input");
    tap_ok(x && x2 && !same_values(x, x2),
           "NestedWrappedModule: inputs differ per rank (seed 1+rank)");
    rc = fsdp_module_forward1(m, x, &y);
    tap_ok(rc == 0, "NestedWrappedModule: forward runs");
    check_shape(y, 2, in_shape, "NestedWrappedModule forward output");
    rc = tm_sum_loss(y, &loss);
    tap_ok(rc == 0 && fsdp_tensor_numel(loss) == 1, "NestedWrappedModule: loss is a scalar");
    check_backward(m, loss, "NestedWrappedModule");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tensor_release(x2);
    fsdp_module_release(m);
    fsdp_module_release(m2);
    fsdp_ctx_destroy(ctx);
    fsdp_ctx_destroy(ctx2);
}

static void test_moe(void) {
    static const char *const shared[] = {"module.0.weight",
                                         "module.0.bias",
                                         "module.1.weight",
                                         "module.1.bias",
                                         "module.3.weight",
                                         "module.3.bias",
                                         NULL};
    fsdp_ctx_t *c0 = new_ctx(0, 2, 0), *c1 = new_ctx(1, 2, 0);
    fsdp_module_t *m0 = NULL, *m1 = NULL;
    int rc = tm_moe_create(c0, true, &m0);
    built(c0, rc, m0, "MixtureOfExperts rank 0");
    rc = tm_moe_create(c1, true, &m1);
    built(c1, rc, m1, "MixtureOfExperts rank 1");
    tap_is_str(fsdp_module_type(m0), "MixtureOfExperts", "MixtureOfExperts: root type");
    tap_is_int(fsdp_module_num_params(m0), 108 + 299 + 288 + 104,
               "MixtureOfExperts: 799 parameters");
    static const char *const names[] = {"module.0.weight", "module.0.bias",   "module.1.weight",
                                        "module.1.bias",   "module.2.weight", "module.2.bias",
                                        "module.3.weight", "module.3.bias",   NULL};
    check_param_names(m0, false, names, "MixtureOfExperts");
    static const int64_t w_expert[2] = {12, 23}, w_shared[2] = {23, 12};
    check_shape(fsdp_module_param(m0, "module.2.weight"), 2, w_expert,
                "MixtureOfExperts expert weight (Linear 23->12)");
    check_shape(fsdp_module_param(m0, "module.1.weight"), 2, w_shared,
                "MixtureOfExperts shared weight (Linear 12->23)");
    bool same = true;
    for (int i = 0; shared[i]; i++)
        same =
            same && same_values(fsdp_module_param(m0, shared[i]), fsdp_module_param(m1, shared[i]));
    tap_ok(same, "MixtureOfExperts: non-expert weights identical on ranks 0 and 1");
    tap_ok(!same_values(fsdp_module_param(m0, "module.2.weight"),
                        fsdp_module_param(m1, "module.2.weight")) &&
               !same_values(fsdp_module_param(m0, "module.2.bias"),
                            fsdp_module_param(m1, "module.2.bias")),
           "MixtureOfExperts: expert weight and bias differ between ranks 0 and 1 (seed 42+rank)");

    /* Expert tags. */
    fsdp_named_list_t l = {0};
    int64_t expert_numel = 0, tagged = 0;
    if (fsdp_module_named_params(m0, false, &l) == 0) {
        for (size_t i = 0; i < l.n; i++) {
            if (tm_moe_is_expert_param(m0, l.tensors[i])) {
                tagged++;
                expert_numel += fsdp_tensor_numel(l.tensors[i]);
            }
        }
    }
    fsdp_named_list_free(&l);
    tap_is_int(tagged, 2, "MixtureOfExperts: 2 parameters tagged expert");
    tap_is_int(expert_numel, TM_MOE_NUM_EXPERT_PARAMS, "MixtureOfExperts: num_expert_params 288");
    tap_ok(tm_moe_is_expert_fqn("module.2.weight") && tm_moe_is_expert_fqn("module.2.bias") &&
               tm_moe_is_expert_fqn("module.2._fsdp_wrapped_module.weight") &&
               tm_moe_is_expert_fqn("_fsdp_wrapped_module.module.2._fsdp_wrapped_module.bias") &&
               !tm_moe_is_expert_fqn("module.1.weight") &&
               !tm_moe_is_expert_fqn("module.2.weightx") && !tm_moe_is_expert_fqn("xmodule.2.bias"),
           "MixtureOfExperts: expert FQN query (wrapper segments ignored)");
    check_units(m0, tm_moe_units(), 2, "MixtureOfExperts");

    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    rc = tm_moe_get_input(c0, &x);
    rc = rc ? rc : fsdp_module_forward1(m0, x, &y);
    tap_ok(rc == 0, "MixtureOfExperts: forward runs");
    static const int64_t out_shape[2] = {4, 8};
    check_shape(y, 2, out_shape, "MixtureOfExperts forward output");
    rc = tm_sum_loss(y, &loss);
    rc = rc ? rc : tm_moe_run_backward(m0, loss, NULL);
    tap_ok(rc == 0 && fsdp_tensor_grad(fsdp_module_param(m0, "module.2.weight")),
           "MixtureOfExperts: run_backward (world of one) gives gradients");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_module_release(m0);
    fsdp_module_release(m1);
    fsdp_ctx_destroy(c0);
    fsdp_ctx_destroy(c1);
}

/* MixtureOfExperts' run_backward over a sim group of 2: each rank records its local gradients
 * (no reduction) and the reduced ones, all parameters flattened in named-parameter order. */
#define MOE_NUMEL 799
typedef struct moe_rank {
    float local[MOE_NUMEL], reduced[MOE_NUMEL];
    bool expert[MOE_NUMEL];
    int rc;
} moe_rank_t;

static int grads_to_host(fsdp_module_t *m, float *dst, bool *expert) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t o = 0;
    for (size_t i = 0; rc == 0 && i < l.n; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(l.tensors[i]);
        size_t n = (size_t)fsdp_tensor_numel(l.tensors[i]);
        if (!g || o + n > MOE_NUMEL) {
            rc = FSDP_EINVAL;
            break;
        }
        rc = fsdp_tensor_to_host(g, dst + o, n * sizeof(float));
        if (expert)
            for (size_t k = 0; k < n; k++)
                expert[o + k] = tm_moe_is_expert_param(m, l.tensors[i]);
        o += n;
    }
    fsdp_named_list_free(&l);
    return rc == 0 && o != MOE_NUMEL ? FSDP_EINVAL : rc;
}

static int moe_rank_fn(fsdp_ctx_t *ctx, void *arg) {
    moe_rank_t *r = (moe_rank_t *)arg + fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    int rc = tm_moe_create(ctx, true, &m);
    for (int pass = 0; rc == 0 && pass < 2; pass++) {
        rc = fsdp_module_zero_grad(m, true);
        rc = rc ? rc : tm_moe_get_input(ctx, &x);
        rc = rc ? rc : fsdp_module_forward1(m, x, &y);
        rc = rc ? rc : tm_sum_loss(y, &loss);
        rc = rc ? rc : tm_moe_run_backward(m, loss, pass ? fsdp_ctx_pg(ctx) : NULL);
        rc = rc ? rc : grads_to_host(m, pass ? r->reduced : r->local, pass ? NULL : r->expert);
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        x = y = loss = NULL;
    }
    fsdp_module_release(m);
    r->rc = rc;
    return rc;
}

static void test_moe_run_backward_sim(void) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 2;
    moe_rank_t *r = calloc(2, sizeof *r);
    if (!r) tap_bail("out of memory");
    int rc = fsdp_sim_run(&o, moe_rank_fn, r, NULL);
    if (!tap_ok(rc == 0, "MixtureOfExperts run_backward over sim(2): ranks succeeded"))
        tap_diag("rank statuses %d %d", r[0].rc, r[1].rc);
    int nexpert = 0, bad_avg = 0, bad_expert = 0, differ = 0;
    for (int i = 0; rc == 0 && i < MOE_NUMEL; i++) {
        if (r[0].expert[i]) {
            nexpert++;
            if (r[0].reduced[i] != r[0].local[i] || r[1].reduced[i] != r[1].local[i]) bad_expert++;
            if (r[0].local[i] != r[1].local[i]) differ++;
        } else {
            float avg = r[0].local[i] / 2 + r[1].local[i] / 2;
            if (fabsf(r[0].reduced[i] - avg) > 1e-6f + 1e-6f * fabsf(avg) ||
                r[0].reduced[i] != r[1].reduced[i])
                bad_avg++;
        }
    }
    tap_is_int(nexpert, TM_MOE_NUM_EXPERT_PARAMS,
               "MixtureOfExperts run_backward: 288 expert elements");
    tap_is_int(bad_avg, 0,
               "MixtureOfExperts run_backward: non-expert gradients are the mean over ranks, "
               "equal on both");
    tap_is_int(bad_expert, 0, "MixtureOfExperts run_backward: expert gradients stay local");
    tap_ok(differ > 0, "MixtureOfExperts run_backward: expert gradients differ between ranks");
    free(r);
}

static void test_transformer(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1, 3);
    fsdp_module_t *m = NULL;
    int rc = tm_transformer_create(ctx, true, true, &m);
    built(ctx, rc, m, "TransformerWithSharedParams");
    tap_is_str(fsdp_module_type(m), "TransformerWithSharedParams",
               "TransformerWithSharedParams: root type");
    tap_ok(!fsdp_module_is_training(m) &&
               !fsdp_module_is_training(fsdp_module_child(m, "transformer.encoder.layers.0")),
           "TransformerWithSharedParams: deterministic build is in eval mode");
    fsdp_tensor_t *emb = fsdp_module_param(m, "embed_tokens.weight");
    fsdp_tensor_t *out_w = fsdp_module_param(m, "output_proj.weight");
    tap_ok(emb && emb == out_w, "TransformerWithSharedParams: output_proj.weight is the embedding");
    tap_is_int(fsdp_module_num_params(m), 8427,
               "TransformerWithSharedParams: 8427 parameters (tied weight counted once)");

    fsdp_named_list_t l = {0}, la = {0}, sd = {0};
    size_t emb_once = 0, emb_aliased = 0, sd_emb = 0;
    bool out_w_listed = false;
    if (fsdp_module_named_params(m, false, &l) == 0)
        for (size_t i = 0; i < l.n; i++) {
            if (l.tensors[i] == emb) emb_once++;
            if (strcmp(l.names[i], "output_proj.weight") == 0) out_w_listed = true;
        }
    if (fsdp_module_named_params(m, true, &la) == 0)
        for (size_t i = 0; i < la.n; i++)
            if (la.tensors[i] == emb) emb_aliased++;
    tap_is_size(l.n, 68, "TransformerWithSharedParams: 68 named parameters");
    tap_ok(emb_once == 1 && !out_w_listed && l.n && strcmp(l.names[0], "embed_tokens.weight") == 0,
           "TransformerWithSharedParams: tied weight listed once, as embed_tokens.weight, first");
    tap_is_size(la.n, 69, "TransformerWithSharedParams: 69 named parameters with aliases");
    tap_is_size(emb_aliased, 2, "TransformerWithSharedParams: tied weight twice with aliases");
    fsdp_named_list_t al = {0};
    rc = fsdp_module_param_aliases(m, emb, &al);
    tap_ok(rc == 0 && al.n == 2 && strcmp(al.names[0], "embed_tokens.weight") == 0 &&
               strcmp(al.names[1], "output_proj.weight") == 0,
           "TransformerWithSharedParams: aliases of the tied weight are embed_tokens.weight and "
           "output_proj.weight");
    fsdp_named_list_free(&al);
    rc = fsdp_module_state_dict(m, &sd);
    bool has_nbt = false;
    for (size_t i = 0; rc == 0 && i < sd.n; i++) {
        if (strcmp(sd.names[i], "embed_tokens.weight") == 0 ||
            strcmp(sd.names[i], "output_proj.weight") == 0)
            sd_emb++;
        if (strcmp(sd.names[i], "bn.num_batches_tracked") == 0) has_nbt = true;
    }
    tap_is_size(sd.n, 74, "TransformerWithSharedParams: state dict has PyTorch's 74 keys");
    tap_is_size(sd_emb, 2, "TransformerWithSharedParams: state dict holds both tied names");
    tap_ok(has_nbt, "TransformerWithSharedParams: state dict has bn.num_batches_tracked");
    fsdp_named_list_free(&l);
    fsdp_named_list_free(&la);
    fsdp_named_list_free(&sd);

    fsdp_tensor_t *lb = fsdp_module_buffer(m, "long_buffer");
    fsdp_tensor_t *vb = fsdp_module_buffer(m, "vocab_bias");
    static const int64_t d16[1] = {16};
    tap_ok(lb && fsdp_tensor_dtype(lb) == FSDP_DTYPE_I64 && fsdp_tensor_ndim(lb) == 1 &&
               fsdp_tensor_size(lb, 0) == 16,
           "TransformerWithSharedParams: long_buffer is an int64 buffer of 16");
    double v0 = 0, v15 = 0;
    tap_ok(vb && fsdp_tensor_dtype(vb) == FSDP_DTYPE_F32 && fsdp_tensor_item(vb, 0, &v0) == 0 &&
               fsdp_tensor_item(vb, 15, &v15) == 0 && v0 == 1.0 && v15 == 1.0,
           "TransformerWithSharedParams: vocab_bias is ones(16)");
    check_shape(vb, 1, d16, "TransformerWithSharedParams vocab_bias");
    fsdp_module_t *bn = fsdp_module_child(m, "bn");
    tap_is_str(bn ? fsdp_module_type(bn) : "(none)", "BatchNorm1d",
               "TransformerWithSharedParams: bn is a BatchNorm1d");
    tap_ok(fsdp_module_buffer(m, "bn.running_mean") && fsdp_module_buffer(m, "bn.running_var") &&
               fsdp_module_param(m, "bn.weight") && fsdp_module_param(m, "bn.bias"),
           "TransformerWithSharedParams: BatchNorm parameters and running statistics present");
    fsdp_tensor_t *bnw = fsdp_module_param(m, "bn.weight");
    tap_is_int(bnw ? fsdp_tensor_size(bnw, 0) : -1, 2,
               "TransformerWithSharedParams: BatchNorm1d over 2 channels (the batch of 2)");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "transformer")), "Transformer",
               "TransformerWithSharedParams: transformer is a Transformer");
    tap_ok(fsdp_module_param(m, "transformer.encoder.layers.1.self_attn.in_proj_weight") &&
               fsdp_module_param(m, "transformer.decoder.layers.1.multihead_attn.out_proj.bias") &&
               fsdp_module_param(m, "transformer.encoder.norm.weight") &&
               fsdp_module_param(m, "transformer.decoder.norm.bias") &&
               !fsdp_module_child(m, "transformer.encoder.layers.2"),
           "TransformerWithSharedParams: 2 encoder and 2 decoder layers with PyTorch's names");
    static const int64_t ff_shape[2] = {8, 16};
    check_shape(fsdp_module_param(m, "transformer.encoder.layers.0.linear1.weight"), 2, ff_shape,
                "TransformerWithSharedParams linear1 (dim_feedforward 8)");
    check_units(m, tm_transformer_units(), 4, "TransformerWithSharedParams");
    const char *const *u = tm_transformer_units();
    tap_ok(strcmp(fsdp_module_type(fsdp_module_child(m, u[0])), "TransformerEncoderLayer") == 0 &&
               strcmp(fsdp_module_type(fsdp_module_child(m, u[3])), "TransformerDecoderLayer") == 0,
           "TransformerWithSharedParams: units are encoder and decoder layers");

    fsdp_tensor_t *src = NULL, *tgt = NULL, *y = NULL, *loss = NULL;
    rc = tm_transformer_get_input(ctx, &src, &tgt);
    double s11 = -1, t7 = -1;
    tap_ok(rc == 0 && fsdp_tensor_dtype(src) == FSDP_DTYPE_I64 && fsdp_tensor_size(src, 0) == 6 &&
               fsdp_tensor_size(src, 1) == 2 && fsdp_tensor_size(tgt, 0) == 4 &&
               fsdp_tensor_item(src, 11, &s11) == 0 && fsdp_tensor_item(tgt, 7, &t7) == 0 &&
               s11 == 11 && t7 == 7,
           "TransformerWithSharedParams: inputs arange(12).view(6, 2), arange(8).view(4, 2)");
    rc = tm_transformer_forward(m, src, tgt, &y);
    if (!tap_ok(rc == 0, "TransformerWithSharedParams: forward runs"))
        tap_diag("%s", fsdp_ctx_last_error(ctx));
    static const int64_t out_shape[3] = {4, 2, 23};
    check_shape(y, 3, out_shape, "TransformerWithSharedParams forward output");
    rc = y ? tm_transformer_loss(tgt, y, &loss) : FSDP_EINVAL;
    double lv = NAN;
    tap_ok(rc == 0 && fsdp_tensor_item(loss, 0, &lv) == 0 && isfinite(lv) && lv > 0,
           "TransformerWithSharedParams: cross-entropy (sum) loss is finite and positive");
    if (loss) check_backward(m, loss, "TransformerWithSharedParams");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    fsdp_module_release(m);

    m = NULL;
    rc = tm_transformer_create(ctx, false, true, &m);
    built(ctx, rc, m, "TransformerWithSharedParams(add_bn=False)");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "bn")), "Identity",
               "TransformerWithSharedParams(add_bn=False): bn is an Identity");
    tap_is_int(fsdp_module_num_params(m), 8427 - 4,
               "TransformerWithSharedParams(add_bn=False): no BatchNorm parameters");
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_writeback(void) {
    static const char *const names[] = {"lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias",
                                        NULL};
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_writeback_create(ctx, &m);
    built(ctx, rc, m, "Model (writeback)");
    tap_is_str(fsdp_module_type(m), "Model", "Model (writeback): root type");
    check_param_names(m, false, names, "Model (writeback)");
    tap_is_int(fsdp_module_num_params(m), 72, "Model (writeback): 72 parameters");
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    rc = tm_writeback_get_input(ctx, &x);
    rc = rc ? rc : fsdp_module_forward1(m, x, &y);
    tap_ok(rc == 0, "Model (writeback): forward runs");
    static const int64_t out_shape[2] = {2, 7};
    check_shape(y, 2, out_shape, "Model (writeback) forward output");
    if (y && tm_sum_loss(y, &loss) == 0) check_backward(m, loss, "Model (writeback)");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_nested_sequential(void) {
    static const char *const names[] = {"0.weight",   "0.bias",     "1.weight",
                                        "1.bias",     "2.0.weight", "2.0.bias",
                                        "2.1.weight", "2.1.bias",   NULL};
    static const char *const mods[] = {"", "0", "1", "2", "2.0", "2.1", NULL};
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_nested_sequential_create(ctx, &m);
    built(ctx, rc, m, "NestedSequentialModel");
    tap_is_str(fsdp_module_type(m), "Sequential", "NestedSequentialModel: root is a Sequential");
    check_param_names(m, false, names, "NestedSequentialModel");
    tap_is_int(fsdp_module_num_params(m), 120, "NestedSequentialModel: 4 Linear x 30 parameters");
    fsdp_named_list_t l = {0};
    if (tap_ok(fsdp_module_named_modules(m, &l) == 0, "NestedSequentialModel: named modules"))
        check_names(&l, mods, "NestedSequentialModel: the 6 modules");
    fsdp_named_list_free(&l);
    static const int64_t shape[2] = {3, 5};
    fsdp_tensor_t *x = NULL, *y = NULL;
    rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, shape, 0.5, FSDP_MEM_OTHER, &x);
    rc = rc ? rc : fsdp_module_forward1(m, x, &y);
    tap_ok(rc == 0, "NestedSequentialModel: forward runs");
    check_shape(y, 2, shape, "NestedSequentialModel forward output");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_lora(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_lora_create(ctx, &m);
    built(ctx, rc, m, "LoraModel");
    tap_is_str(fsdp_module_type(m), "LoraModel", "LoraModel: root type");
    tap_is_int(fsdp_module_num_params(m), 3200 + 4 * (4 * 1024 + 256 + 256 + 2 * 4096 + 128) + 64,
               "LoraModel: 54976 parameters");
    fsdp_named_list_t l = {0};
    size_t bad = 0, trainable = 0;
    const char *first_bad = "";
    rc = fsdp_module_named_params(m, false, &l);
    for (size_t i = 0; rc == 0 && i < l.n; i++) {
        bool lora = strstr(l.names[i], ".lora_A.") || strstr(l.names[i], ".lora_B.");
        bool rg = fsdp_tensor_requires_grad(l.tensors[i]);
        if (rg) trainable++;
        if (rg != lora && !bad++) first_bad = l.names[i];
    }
    tap_is_size(l.n, 1 + 4 * (6 + 2 + 4) + 2, "LoraModel: 51 named parameters");
    if (!tap_is_size(bad, 0, "LoraModel: only lora_A and lora_B require grad"))
        tap_diag("first wrong: %s", first_bad);
    tap_is_size(trainable, 8, "LoraModel: 8 trainable parameters (2 per layer)");
    tap_ok(rc == 0 && l.n > 0 && strcmp(l.names[0], "embed_tokens.weight") == 0 &&
               fsdp_module_param(m, "layers.3.attn.lora_B.weight") &&
               fsdp_module_param(m, "layers.0.mlp.proj2.weight") &&
               fsdp_module_param(m, "layers.2.post_attn_layernorm.bias") &&
               fsdp_module_param(m, "norm.weight") &&
               !fsdp_module_param(m, "layers.0.attn.q_proj.bias"),
           "LoraModel: PyTorch's names (no biases on the projections)");
    fsdp_named_list_free(&l);
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "layers.1")), "LoraDecoder",
               "LoraModel: layers hold LoraDecoder");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "layers.1.attn")), "LoraAttention",
               "LoraModel: LoraDecoder.attn is a LoraAttention");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "layers.1.mlp")), "LoraMLP",
               "LoraModel: LoraDecoder.mlp is a LoraMLP");
    static const int64_t a_shape[2] = {8, 32};
    check_shape(fsdp_module_param(m, "layers.0.attn.lora_A.weight"), 2, a_shape,
                "LoraModel lora_A (Linear 32->8)");
    fsdp_tensor_t *x = NULL, *y = NULL;
    static const int64_t xs[2] = {1, 32};
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 2, xs, FSDP_MEM_OTHER, &x);
    rc = fsdp_module_forward1(m, x, &y);
    tap_is_int(rc, FSDP_ENOTSUP, "LoraModel: no forward (structure only)");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_batchnorm_net(void) {
    static const char *const names[] = {"lin.weight",   "bn1.weight", "bn1.bias", "bn2.weight",
                                        "bn2.bias",     "bn3.weight", "bn3.bias", "sync_bn.weight",
                                        "sync_bn.bias", NULL};
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_batchnorm_net_create(ctx, &m);
    built(ctx, rc, m, "BatchNormNet");
    tap_is_str(fsdp_module_type(m), "BatchNormNet", "BatchNormNet: root type");
    check_param_names(m, false, names, "BatchNormNet");
    tap_is_int(fsdp_module_num_params(m), 100 + 4 * 20, "BatchNormNet: 180 parameters");
    tap_ok(!strcmp(fsdp_module_type(fsdp_module_child(m, "bn1")), "BatchNorm1d") &&
               !strcmp(fsdp_module_type(fsdp_module_child(m, "bn2")), "BatchNorm2d") &&
               !strcmp(fsdp_module_type(fsdp_module_child(m, "bn3")), "BatchNorm3d") &&
               !strcmp(fsdp_module_type(fsdp_module_child(m, "sync_bn")), "BatchNorm1d"),
           "BatchNormNet: bn1/bn2/bn3 are BatchNorm1d/2d/3d, sync_bn a BatchNorm1d stand-in");
    fsdp_tensor_t *nbt = fsdp_module_buffer(m, "bn3.num_batches_tracked");
    tap_ok(fsdp_module_buffer(m, "sync_bn.running_var") && nbt &&
               fsdp_tensor_dtype(nbt) == FSDP_DTYPE_I64,
           "BatchNormNet: running statistics and int64 num_batches_tracked buffers");
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_ignored(void) {
    static const char *const names[] = {
        "l1.weight", "l1.bias", "ignored.l.weight", "ignored.l.bias", "l2.weight", "l2.bias", NULL};
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_ignored_create(ctx, &m);
    built(ctx, rc, m, "ModelWithIgnoredModule");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "ignored")), "IgnoredModule",
               "ModelWithIgnoredModule: ignored is an IgnoredModule");
    check_param_names(m, false, names, "ModelWithIgnoredModule");
    tap_is_int(fsdp_module_num_params(m), 3 * 10100, "ModelWithIgnoredModule: 30300 parameters");
    static const int64_t shape[2] = {3, 100};
    fsdp_tensor_t *x = NULL, *y = NULL;
    rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, shape, 0.1, FSDP_MEM_OTHER, &x);
    rc = rc ? rc : fsdp_module_forward1(m, x, &y);
    tap_ok(rc == 0, "ModelWithIgnoredModule: forward runs");
    check_shape(y, 2, shape, "ModelWithIgnoredModule forward output");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_toy(void) {
    static const char *const names[] = {"net.0.weight", "net.0.bias",   "net.2.weight",
                                        "net.2.bias",   "net.4.weight", "net.4.bias",
                                        "net.6.weight", "net.6.bias",   NULL};
    const int64_t h = 16;
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_module_t *m = NULL;
    int rc = tm_toy_create(ctx, TM_TOY_IN, h, TM_TOY_OUT, &m);
    built(ctx, rc, m, "ToyModel (hidden 16)");
    check_param_names(m, false, names, "ToyModel");
    tap_is_int(fsdp_module_num_params(m),
               (TM_TOY_IN + 1) * h + 2 * (h + 1) * h + (h + 1) * TM_TOY_OUT,
               "ToyModel: parameter count for hidden 16");
    tap_ok(fsdp_module_child(m, "net.7") &&
               !strcmp(fsdp_module_type(fsdp_module_child(m, "net.7")), "ReLU") &&
               !fsdp_module_child(m, "net.8"),
           "ToyModel: 4 Linear+ReLU pairs (net.0 .. net.7)");
    static const int64_t xs[2] = {3, TM_TOY_IN}, ys[2] = {3, TM_TOY_OUT};
    fsdp_tensor_t *x = NULL, *y = NULL;
    rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, xs, 0.3, FSDP_MEM_OTHER, &x);
    rc = rc ? rc : fsdp_module_forward1(m, x, &y);
    tap_ok(rc == 0, "ToyModel: forward runs");
    check_shape(y, 2, ys, "ToyModel forward output");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void test_gpt(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1, 0);
    fsdp_gpt_config_t cfg;
    tm_gpt_tiny_config(&cfg);
    fsdp_module_t *m = NULL;
    int rc = fsdp_gpt_create(ctx, &cfg, &m);
    built(ctx, rc, m, "GPT (tiny)");
    tap_is_int(fsdp_module_num_params(m), 7872, "GPT (tiny): 7872 parameters (as gen_models.py)");
    static const int64_t ts[2] = {2, 8}, ls[3] = {2, 8, 64};
    int64_t tok[16];
    for (int i = 0; i < 16; i++)
        tok[i] = (i * 7) % 64;
    fsdp_tensor_t *t = NULL, *y = NULL;
    rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, ts, tok, FSDP_MEM_OTHER, &t);
    rc = rc ? rc : fsdp_gpt_forward(m, t, &y);
    tap_ok(rc == 0, "GPT (tiny): forward runs");
    check_shape(y, 3, ls, "GPT (tiny) forward output");
    fsdp_tensor_release(t);
    fsdp_tensor_release(y);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_nested();
    test_moe();
    test_moe_run_backward_sim();
    test_transformer();
    test_writeback();
    test_nested_sequential();
    test_lora();
    test_batchnorm_net();
    test_ignored();
    test_toy();
    test_gpt();
    return tap_done();
}
