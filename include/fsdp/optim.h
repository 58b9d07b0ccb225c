/* SPDX-License-Identifier: MIT */
/*
 * fsdp/optim.h: optimizers (SGD, Adam, AdamW) with parameter groups and named state.
 *
 * An optimizer updates a set of parameter tensors in place from their gradients, following
 * torch.optim of PyTorch 1.13 (single-tensor implementation, maximize = false, no foreach or
 * fused paths): the same formulas in the same order of operations, with hyper-parameter
 * arithmetic in double. Parameters are organised in groups; each group has its own
 * hyper-parameters, and each parameter has a name (unique in the optimizer) under which its
 * state is saved and loaded, so that a checkpoint does not depend on the order in which
 * parameters were added.
 *
 * State. Per-parameter state is created on the first step in which the parameter has a
 * gradient, on the parameter's device, in its dtype, counted under FSDP_MEM_OPTIM:
 *   SGD with momentum != 0: momentum_buffer (a clone of the first update direction, as in
 *                           PyTorch); SGD keeps no step count.
 *   Adam, AdamW:            step (a count), exp_avg, exp_avg_sq, and max_exp_avg_sq when the
 *                           group uses amsgrad.
 *
 * Ownership. fsdp_optim_*_create() returns an optimizer the caller frees with
 * fsdp_optim_destroy(). The optimizer holds a reference to each parameter tensor from
 * fsdp_optim_add_group() until it is destroyed, and copies every name and option struct it is
 * given. Gradients are borrowed when a step runs (fsdp_tensor_grad()).
 *
 * Errors. Every fallible function returns 0 or a negative FSDP_E* code and leaves a message on
 * the optimizer's context (fsdp_ctx_last_error) that names the parameter, key or option
 * involved. Validation happens before anything is modified: a failed add_group, set_options or
 * load_state_dict changes nothing, and a step that fails validation updates no parameter (a
 * device failure or running out of memory in the middle of a step may leave earlier
 * parameters of the step updated).
 *
 * Thread-safety: an optimizer belongs to one context (rank) and is used by that rank's thread
 * only, like the tensors it updates.
 */
#ifndef FSDP_OPTIM_H
#define FSDP_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_optim fsdp_optim_t;

/* The algorithm of an optimizer, and the tag that opens every option struct below (0 is
 * deliberately no kind, so that an option struct not filled by its init function is refused). */
typedef enum fsdp_optim_kind {
    FSDP_OPTIM_SGD = 1,
    FSDP_OPTIM_ADAM = 2,
    FSDP_OPTIM_ADAMW = 3 /* Adam with decoupled weight decay */
} fsdp_optim_kind_t;

/* ---- hyper-parameters ------------------------------------------------------------------------ */

/*
 * torch.optim.SGD. Per step, with g the gradient:
 *   g += weight_decay * p;
 *   if momentum != 0: buf = first step ? g : momentum * buf + (1 - dampening) * g;
 *                     g = nesterov ? g + momentum * buf : buf;
 *   p -= lr * g.
 * Valid: lr >= 0, momentum >= 0, weight_decay >= 0; nesterov needs momentum > 0 and
 * dampening == 0 (as PyTorch). Values must not be NaN.
 */
typedef struct fsdp_sgd_options {
    /* sizeof this struct as the caller was built; set by fsdp_sgd_options_init() */
    size_t size;
    fsdp_optim_kind_t kind; /* FSDP_OPTIM_SGD, set by fsdp_sgd_options_init() */
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
    bool nesterov;
} fsdp_sgd_options_t;

/* lr 1e-3 (PyTorch 1.13 has no default for SGD's lr; later versions use 1e-3), momentum 0,
 * dampening 0, weight_decay 0, nesterov false. */
FSDP_EXTERN void fsdp_sgd_options_init(fsdp_sgd_options_t *opts, size_t size);
#define fsdp_sgd_options_init(opts) (fsdp_sgd_options_init)((opts), sizeof *(opts))

/*
 * torch.optim.Adam and AdamW. Per step t (1-based, counted per parameter):
 *   AdamW: p *= 1 - lr * weight_decay;   Adam: g += weight_decay * p;
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
 *   amsgrad: vmax = max(vmax, v) and vmax replaces v below;
 *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
 * Valid: lr >= 0, eps >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1, weight_decay >= 0, no NaN.
 */
typedef struct fsdp_adam_options {
    /* sizeof this struct as the caller was built; set by fsdp_adam_options_init() */
    size_t size;
    fsdp_optim_kind_t kind; /* FSDP_OPTIM_ADAM or FSDP_OPTIM_ADAMW, set by the init functions */
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    bool amsgrad;
} fsdp_adam_options_t;

/* Adam's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0, amsgrad false;
 * kind FSDP_OPTIM_ADAM. */
FSDP_EXTERN void fsdp_adam_options_init(fsdp_adam_options_t *opts, size_t size);
#define fsdp_adam_options_init(opts) (fsdp_adam_options_init)((opts), sizeof *(opts))
/* AdamW's defaults: the same with weight_decay 1e-2; kind FSDP_OPTIM_ADAMW. */
FSDP_EXTERN void fsdp_adamw_options_init(fsdp_adam_options_t *opts, size_t size);
#define fsdp_adamw_options_init(opts) (fsdp_adamw_options_init)((opts), sizeof *(opts))

/* ---- creation ------------------------------------------------------------------------------- */

/* An SGD optimizer with no parameters yet. defaults (NULL: fsdp_sgd_options_init()) are the
 * hyper-parameters of groups added without overrides; they are copied. FSDP_EINVAL names the
 * bad option ("nesterov momentum requires momentum > 0 and dampening == 0"), FSDP_ENOMEM. */
FSDP_EXTERN int fsdp_optim_sgd_create(fsdp_ctx_t *ctx, const fsdp_sgd_options_t *defaults,
                                      fsdp_optim_t **out);
/* An Adam (decoupled = false) or AdamW (decoupled = true) optimizer. defaults NULL: Adam's or
 * AdamW's defaults. The options' kind may be either FSDP_OPTIM_ADAM or FSDP_OPTIM_ADAMW: it
 * only says the struct is Adam options; `decoupled` alone chooses the algorithm. */
FSDP_EXTERN int fsdp_optim_adam_create(fsdp_ctx_t *ctx, const fsdp_adam_options_t *defaults,
                                       bool decoupled, fsdp_optim_t **out);
/* Destroys the optimizer: frees its state (FSDP_MEM_OPTIM goes back down) and releases its
 * references to the parameters. Gradients are left alone. NULL is accepted. */
FSDP_EXTERN void fsdp_optim_destroy(fsdp_optim_t *opt);

FSDP_EXTERN fsdp_optim_kind_t fsdp_optim_kind(const fsdp_optim_t *opt);
FSDP_EXTERN fsdp_ctx_t *fsdp_optim_ctx(const fsdp_optim_t *opt);

/* ---- parameter groups ------------------------------------------------------------------------ */

/*
 * Adds a group of n parameters (n may be 0). params[i] must be a leaf f32 or f64 tensor of the
 * optimizer's context; it is retained. names[i] is its name for the state dict: copied; names
 * may be NULL, and so may names[i], to use fsdp_tensor_name(params[i]) (a module parameter's
 * fully qualified name). A name must be non-empty and unique in the optimizer (dots are fine:
 * keys are split at their last dot). A tensor may be in only one group, once.
 *
 * overrides: NULL for the optimizer's defaults; otherwise the group's complete
 * hyper-parameters, as a `const fsdp_sgd_options_t *` for an SGD optimizer or a
 * `const fsdp_adam_options_t *` for Adam and AdamW (the struct's kind says which; a
 * mismatch or an uninitialised struct is FSDP_EINVAL). Start from fsdp_optim_get_options(opt,
 * -1, ...) to override only some fields, as a PyTorch param-group dict does.
 *
 * *group (may be NULL) receives the group's index, 0, 1, ... in order of addition. Errors:
 * FSDP_EINVAL naming the parameter (duplicate within or across groups, not a leaf, dtype,
 * other context, duplicate or empty name) or the option; FSDP_ENOMEM. On error nothing is
 * added.
 */
FSDP_EXTERN int fsdp_optim_add_group(fsdp_optim_t *opt, size_t n, fsdp_tensor_t *const *params,
                                     const char *const *names, const void *overrides, int *group);

FSDP_EXTERN int fsdp_optim_num_groups(const fsdp_optim_t *opt);
/* Number of parameters in group (0 for a bad index). */
FSDP_EXTERN size_t fsdp_optim_group_size(const fsdp_optim_t *opt, int group);
/* The i-th parameter of group (borrowed) and its name (borrowed; may be NULL); NULL for bad
 * indices. */
FSDP_EXTERN fsdp_tensor_t *fsdp_optim_group_param(const fsdp_optim_t *opt, int group, size_t i,
                                                  const char **name);

/* Learning rate of a group (what a scheduler changes). set_lr validates lr >= 0. */
FSDP_EXTERN int fsdp_optim_get_lr(const fsdp_optim_t *opt, int group, double *lr);
FSDP_EXTERN int fsdp_optim_set_lr(fsdp_optim_t *opt, int group, double lr);

/* Every hyper-parameter of a group, or of the defaults with group == -1. `opts` points to a
 * fsdp_sgd_options_t (SGD) or a fsdp_adam_options_t (Adam, AdamW): get fills it, kind and size
 * included, as the _init functions do (the macro passes opts_size = sizeof *opts, so opts must
 * have the struct's type, not void *; a size too small for the optimizer's struct is
 * FSDP_EINVAL); set validates it like create (size and kind too) and replaces the group's
 * hyper-parameters (the defaults only affect groups added afterwards). State is kept, as in
 * PyTorch: turning amsgrad on starts max_exp_avg_sq at zero, and turning momentum on for a
 * parameter without a momentum buffer starts one by the first-step rule. */
FSDP_EXTERN int fsdp_optim_get_options(const fsdp_optim_t *opt, int group, void *opts,
                                       size_t opts_size);
#define fsdp_optim_get_options(opt, group, opts)                                                   \
    (fsdp_optim_get_options)((opt), (group), (opts), sizeof *(opts))
FSDP_EXTERN int fsdp_optim_set_options(fsdp_optim_t *opt, int group, const void *opts);

/* ---- stepping -------------------------------------------------------------------------------- */

/*
 * One optimization step over every parameter whose gradient is not NULL; parameters without a
 * gradient are skipped (unchanged, no state created), as in PyTorch. Runs with grad mode off
 * and records nothing. Synchronous for the CPU device.
 *
 * Each updated parameter must be f32 or f64 with allocated storage, and its gradient of the
 * same shape and device, and of the same dtype or a float of lower precision (f16/bf16 for an
 * f32 parameter, f16/bf16/f32 for f64: PyTorch's type promotion, as keep_low_precision_grads
 * produces), which is upcast (exactly) into a temporary of the parameter's dtype for the step.
 * Non-contiguous parameters or gradients are handled by staging contiguous copies
 * (FSDP_MEM_OTHER, freed before the call returns). Errors: FSDP_EINVAL naming
 * the parameter (checked for all parameters before any is updated), FSDP_ENOMEM, and the
 * device's failures.
 */
FSDP_EXTERN int fsdp_optim_step(fsdp_optim_t *opt);

/* zero_grad on every parameter: set_to_none drops each gradient (fsdp_tensor_set_grad(p,
 * NULL)), otherwise gradients are filled with zeros. PyTorch 1.13's default is
 * set_to_none = false. */
FSDP_EXTERN int fsdp_optim_zero_grad(fsdp_optim_t *opt, bool set_to_none);

/*
 * torch.nn.utils.clip_grad_norm_: the norm (norm_type > 0, INFINITY for the max norm) of the
 * gradients of params taken together (parameters without a gradient are skipped); when it
 * exceeds max_norm every gradient is multiplied by max_norm / (norm + 1e-6). *total_norm (may be
 * NULL) receives the norm before clipping. For FSDP units use fsdp_unit_clip_grad_norm (fsdp.h).
 */
FSDP_EXTERN int fsdp_clip_grad_norm(fsdp_ctx_t *ctx, size_t n, fsdp_tensor_t *const *params,
                                    double max_norm, double norm_type, double *total_norm);

/* Bytes of optimizer state held now (what FSDP_MEM_OPTIM counts for this optimizer). */
FSDP_EXTERN size_t fsdp_optim_state_bytes(const fsdp_optim_t *opt);

/* ---- state dict ------------------------------------------------------------------------------ */

/*
 * The optimizer's state as a named list of new tensors:
 *   "group.<g>.<hp>" for every group g (0-based) and each of its hyper-parameters. SGD: lr,
 *     momentum, dampening, weight_decay, nesterov (0 or 1). Adam and AdamW: lr, beta1, beta2,
 *     eps, weight_decay, amsgrad (0 or 1).
 *   "<param name>.<state>" for every parameter that has state, in group order: SGD
 *     momentum_buffer; Adam and AdamW step (the count, as PyTorch's float step), exp_avg,
 *     exp_avg_sq, and max_exp_avg_sq once created (with amsgrad). Buffers are copies in the
 *     parameter's dtype, shape and device; hyper-parameters and step counts are f64 scalars
 *     (0-dimensional) on the context's default device.
 *
 * Ownership: every tensor is a fresh copy counted under FSDP_MEM_OTHER (so FSDP_MEM_OPTIM keeps
 * measuring the live optimizer state); out->owned is true and fsdp_named_list_free(out)
 * releases the tensors and frees the names. out->modules is NULL. On failure *out is empty.
 */
FSDP_EXTERN int fsdp_optim_state_dict(const fsdp_optim_t *opt, fsdp_named_list_t *out);

/*
 * Replaces the optimizer's state and hyper-parameters with those of sd (borrowed; its tensors
 * are copied), matching parameters by name. Strict: sd must hold every "group.<g>.<hp>" key
 * of this optimizer's groups, and for each parameter either no state or all of it (SGD: the
 * momentum buffer; Adam: step, exp_avg, exp_avg_sq, and max_exp_avg_sq when the loaded group
 * has amsgrad, which is also accepted and kept without it); any other key is unexpected.
 * Buffers must have the parameter's shape (any float dtype, converted to the parameter's; on
 * the parameter's device); scalars one element; step counts non-negative integers;
 * hyper-parameters valid. Every problem is reported in one FSDP_EINVAL message
 * listing the missing keys, unexpected keys and bad values by name, and nothing is modified.
 * Parameters absent from sd lose their state, as PyTorch's load_state_dict replaces it.
 */
FSDP_EXTERN int fsdp_optim_load_state_dict(fsdp_optim_t *opt, const fsdp_named_list_t *sd);

FSDP_END_DECLS

#endif /* FSDP_OPTIM_H */
