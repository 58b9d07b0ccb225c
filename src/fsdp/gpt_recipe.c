/* SPDX-License-Identifier: MIT */
/*
 * gpt_recipe.c: the GPT training recipe (fsdp/gpt_recipe.h): the seeded model, one FSDP unit
 * per GPTBlock under the root, and AdamW whose weight decay falls on matrices only.
 *
 * It sits in the fsdp layer because it ties nn (the GPT), optim (AdamW) and the units together,
 * and it uses only their public APIs (and the size records of the options structs it copies,
 * docs/design.md "ABI policy"). Which parameter decays is decided on the shapes the model
 * registered: after wrapping with use_orig_params a parameter object is a 1-D view of this
 * rank's shard, so a wrapped parameter's dimensions come from its unit's record of it
 * (fsdp_unit_param_info).
 */
#include <stdlib.h>
#include <string.h>

#include <fsdp/gpt_recipe.h>
#include <fsdp/policy.h>
#include <fsdp/rng.h>

#include "fsdp/fsdp_impl.h"
#include "internal.h"
#include "optim/optim_impl.h"

void(fsdp_gpt_recipe_adamw_options_init)(fsdp_adam_options_t *opts, size_t size) {
    fsdp_adam_options_t d;
    fsdp_adamw_options_init(&d);
    d.lr = 1e-3;
    d.beta1 = 0.9;
    d.beta2 = 0.95;
    d.eps = 1e-8;
    d.weight_decay = 0.1;
    fsdp__abi_init(opts, size, &d, &fsdp__adam_options_abi);
}

bool fsdp_gpt_recipe_decays(const char *name, int ndim) {
    return name && ndim >= 2 && strcmp(name, "wpe.weight") != 0;
}

int fsdp_gpt_recipe_create_model(fsdp_ctx_t *ctx, const fsdp_gpt_config_t *cfg, uint64_t seed,
                                 fsdp_module_t **out) {
    if (out) *out = NULL;
    if (!ctx || !cfg || !out)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_gpt_recipe_create_model: ctx, cfg or out is NULL");
    fsdp_rng_init(fsdp_ctx_rng(ctx), seed, 0);
    int rc = fsdp_gpt_create(ctx, cfg, out);
    if (rc == FSDP_OK) fsdp_module_train(*out, true);
    return rc;
}

int fsdp_gpt_recipe_wrap(fsdp_module_t *model, const fsdp_options_t *o, fsdp_unit_t **root) {
    static const char *const block_types[] = {"GPTBlock", NULL};
    fsdp_ctx_t *ctx = fsdp_module_ctx(model);
    if (root) *root = NULL;
    if (!model || !fsdp_gpt_get_config(model))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_gpt_recipe_wrap: the model is %s",
                                    model ? "not a GPT (fsdp_gpt_create)" : "NULL");
    int rc = fsdp__abi_check(ctx, "fsdp_gpt_recipe_wrap", "o", o, &fsdp__options_abi);
    if (rc < 0) return rc;
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    if (o) fsdp__abi_copy_in(&fo, o, &fsdp__options_abi);
    if (fo.auto_wrap_policy)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_gpt_recipe_wrap: options.auto_wrap_policy is set; the recipe "
                             "chooses the units (one per GPTBlock) and needs it NULL");
    fsdp_policy_t *blocks = NULL;
    rc = fsdp_policy_module_types_create(block_types, &blocks);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc, "fsdp_gpt_recipe_wrap: the GPTBlock policy: %s",
                             fsdp_strerror(rc));
    fo.auto_wrap_policy = blocks;
    fo.use_orig_params = true;
    fsdp_unit_t *u = NULL;
    rc = fsdp_wrap(model, &fo, &u);
    fsdp_policy_release(blocks);
    if (rc == FSDP_OK && root) *root = u;
    return rc;
}

/* The dimensions `t` was registered with: its unit's record when a unit of `units` manages it,
 * else its own (a parameter no unit manages keeps its shape). */
static int registered_ndim(fsdp_unit_t *const *units, size_t nunits, const fsdp_tensor_t *t) {
    for (size_t u = 0; u < nunits; u++) {
        size_t n = fsdp_unit_num_params(units[u]);
        for (size_t i = 0; i < n; i++) {
            fsdp_param_info_t info;
            if (fsdp_unit_param_info(units[u], i, &info) == FSDP_OK && info.param == t)
                return info.ndim;
        }
    }
    return fsdp_tensor_ndim(t);
}

/* The model's parameters the optimizer steps over, and their registered dimensions (*ndim is
 * malloc'ed, one per parameter). */
static int recipe_params(fsdp_module_t *model, fsdp_named_list_t *params, int **ndim) {
    static const char fn[] = "fsdp_gpt_recipe_create_adamw";
    fsdp_ctx_t *ctx = fsdp_module_ctx(model);
    const fsdp_unit_t *unit = fsdp_unit_of(model);
    fsdp_unit_t **units = NULL;
    size_t nunits = 0;
    int rc;
    if (unit) {
        fsdp_options_t uo;
        if (!fsdp_unit_is_root(unit))
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: the model is a unit below another ('%s'); pass the root", fn,
                                 fsdp_unit_fqn(unit));
        if ((rc = fsdp_unit_options(unit, &uo)) < 0) return rc;
        if (!uo.use_orig_params)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: the model was wrapped without use_orig_params: its flat "
                                 "parameters mix matrices and vectors, so weight decay cannot "
                                 "be chosen per parameter (wrap it with fsdp_gpt_recipe_wrap)",
                                 fn);
        if ((rc = fsdp_named_params(unit, params)) < 0) return rc;
        if ((rc = fsdp_units(unit, &units, &nunits)) < 0) goto fail;
    } else if ((rc = fsdp_module_named_params(model, false, params)) < 0) {
        return rc;
    }
    *ndim = calloc(params->n ? params->n : 1, sizeof **ndim);
    if (!*ndim) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto fail;
    }
    for (size_t i = 0; i < params->n; i++)
        (*ndim)[i] = registered_ndim(units, nunits, params->tensors[i]);
    free(units);
    return FSDP_OK;
fail:
    free(units);
    fsdp_named_list_free(params);
    return rc;
}

int fsdp_gpt_recipe_create_adamw(fsdp_module_t *model, const fsdp_adam_options_t *opts,
                                 fsdp_optim_t **out) {
    static const char fn[] = "fsdp_gpt_recipe_create_adamw";
    fsdp_ctx_t *ctx = fsdp_module_ctx(model);
    if (out) *out = NULL;
    if (!model || !out)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: model or out is NULL", fn);
    int rc = fsdp__abi_check(ctx, fn, "opts", opts, &fsdp__adam_options_abi);
    if (rc < 0) return rc;
    fsdp_adam_options_t a;
    fsdp_gpt_recipe_adamw_options_init(&a);
    if (opts) fsdp__abi_copy_in(&a, opts, &fsdp__adam_options_abi);
    fsdp_named_list_t params = {0};
    int *ndim = NULL;
    rc = recipe_params(model, &params, &ndim);
    if (rc < 0) return rc;

    /* Group 0 decays, group 1 does not; each keeps the parameters' order. */
    fsdp_tensor_t **g[2] = {NULL, NULL};
    const char **gn[2] = {NULL, NULL};
    size_t gcount[2] = {0, 0};
    fsdp_optim_t *opt = NULL;
    for (int k = 0; k < 2; k++) {
        g[k] = calloc(params.n + 1, sizeof *g[k]);
        gn[k] = calloc(params.n + 1, sizeof *gn[k]);
        if (!g[k] || !gn[k]) {
            rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
    }
    for (size_t i = 0; i < params.n; i++) {
        int k = fsdp_gpt_recipe_decays(params.names[i], ndim[i]) ? 0 : 1;
        g[k][gcount[k]] = params.tensors[i];
        gn[k][gcount[k]++] = params.names[i];
    }
    fsdp_adam_options_t none = a;
    none.weight_decay = 0;
    FSDP_TRY(rc, out, fsdp_optim_adam_create(ctx, &a, true, &opt));
    FSDP_TRY(rc, out, fsdp_optim_add_group(opt, gcount[0], g[0], gn[0], NULL, NULL));
    FSDP_TRY(rc, out, fsdp_optim_add_group(opt, gcount[1], g[1], gn[1], &none, NULL));
    *out = opt;
    opt = NULL;
out:
    fsdp_optim_destroy(opt);
    for (int k = 0; k < 2; k++) {
        free(g[k]);
        free(gn[k]);
    }
    free(ndim);
    fsdp_named_list_free(&params);
    return rc;
}
