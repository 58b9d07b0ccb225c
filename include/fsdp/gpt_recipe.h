/* SPDX-License-Identifier: MIT */
/*
 * fsdp/gpt_recipe.h: the GPT training recipe that fsdp-train, the benchmarks and the tests share.
 *
 * One way to train fsdp_gpt_create()'s model with FSDP, in three calls that a program may take
 * apart (it may make its device, load weights, or build a DDP baseline instead of wrapping, in
 * between):
 *   1. fsdp_gpt_recipe_create_model: the model, in training mode, with weights that depend on
 *      the seed alone (the context's random stream is reset to stream 0 of the seed first), so
 *      every rank of a job, whatever its rank or world size, makes the same ones;
 *   2. fsdp_gpt_recipe_wrap: FSDP with every GPTBlock a unit of its own under a root that keeps
 *      the embeddings and the final LayerNorm (the tied head reads wte.weight outside the wte
 *      module, so wte must stay in the root), with use_orig_params, so that the optimizer sees
 *      every parameter under its own name;
 *   3. fsdp_gpt_recipe_create_adamw: AdamW in two parameter groups, nanoGPT's rule: group 0
 *      decays the matrices (every parameter of two or more dimensions as registered) except the
 *      position table wpe.weight; group 1, weight decay 0, holds the rest: vectors (biases,
 *      LayerNorm weights and biases) and wpe.weight. wte.weight, the token embedding and tied
 *      head, is a matrix and decays.
 * The benchmarks' PyTorch twins (bench/gpt_step_torch.py and the scripts that import it) build
 * the same two groups.
 */
#ifndef FSDP_GPT_RECIPE_H
#define FSDP_GPT_RECIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/export.h>
#include <fsdp/fsdp.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/transformer.h>

FSDP_BEGIN_DECLS

/* The recipe's AdamW hyper-parameters: lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1
 * (of the decayed group), amsgrad off; kind FSDP_OPTIM_ADAMW. */
FSDP_EXTERN void fsdp_gpt_recipe_adamw_options_init(fsdp_adam_options_t *opts, size_t size);
#define fsdp_gpt_recipe_adamw_options_init(opts)                                                   \
    (fsdp_gpt_recipe_adamw_options_init)((opts), sizeof *(opts))

/* Whether the recipe's AdamW decays the GPT parameter `name`, of `ndim` dimensions as the model
 * registered it (before any wrapping): ndim >= 2 and name is not "wpe.weight". False for a NULL
 * name. */
FSDP_EXTERN bool fsdp_gpt_recipe_decays(const char *name, int ndim);

/*
 * Resets ctx's random stream to (seed, stream 0), makes the GPT of cfg there
 * (fsdp_gpt_create, on ctx's default device) and puts it in training mode. The caller owns *out
 * (NULL on failure). Errors as fsdp_gpt_create's, on ctx.
 */
FSDP_EXTERN int fsdp_gpt_recipe_create_model(fsdp_ctx_t *ctx, const fsdp_gpt_config_t *cfg,
                                             uint64_t seed, fsdp_module_t **out);

/*
 * Wraps the GPT `model` with FSDP (fsdp_wrap): every module of type "GPTBlock" becomes a unit of
 * its own and the model the root unit, which keeps the rest. The options are o's (NULL:
 * fsdp_options_init's), with use_orig_params forced on (as fsdp_fully_shard does) and the
 * auto-wrap policy the recipe's: o->auto_wrap_policy must be NULL. Collective, as fsdp_wrap.
 * *root (may be NULL) receives the root unit, which fsdp_unit_of(model) also finds. Errors
 * (on the model's context): FSDP_EINVAL for a model that is not a GPT or an o that brings its
 * own policy, and fsdp_wrap's.
 */
FSDP_EXTERN int fsdp_gpt_recipe_wrap(fsdp_module_t *model, const fsdp_options_t *o,
                                     fsdp_unit_t **root);

/*
 * The recipe's AdamW over the GPT `model` on the model's context: opts (NULL:
 * fsdp_gpt_recipe_adamw_options_init's) are the defaults and group 0's hyper-parameters, group
 * 1 has the same with weight_decay 0 (see the top of the file for which parameters go where).
 * The parameters are the model's own (fsdp_module_named_params) when it is not wrapped, or, when
 * the model is a root unit wrapped with use_orig_params (fsdp_gpt_recipe_wrap), the unit's
 * (fsdp_named_params: the original parameter objects, now views of this rank's shard), in that
 * order within each group and under the same names; a wrapped parameter's dimensions are those
 * it was registered with (fsdp_unit_param_info). The caller owns *out (NULL on failure) and
 * frees it with fsdp_optim_destroy(). Errors (on the model's context): FSDP_EINVAL for a NULL
 * argument, a model that is a unit but not a root, a unit without use_orig_params (its flat
 * parameters mix matrices and vectors), bad hyper-parameters; FSDP_ENOMEM.
 */
FSDP_EXTERN int fsdp_gpt_recipe_create_adamw(fsdp_module_t *model, const fsdp_adam_options_t *opts,
                                             fsdp_optim_t **out);

FSDP_END_DECLS

#endif /* FSDP_GPT_RECIPE_H */
