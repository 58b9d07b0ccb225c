/* SPDX-License-Identifier: MIT */
/*
 * fsdp/grad_scaler.h: dynamic loss scaling for f16 training with FSDP (PyTorch's
 * torch.distributed.fsdp.ShardedGradScaler, itself torch.amp.GradScaler aware of sharding).
 *
 * f16 gradients underflow where f32 ones would not. The scaler multiplies the loss by a large
 * factor before backward, so every gradient comes out scaled by the same factor, then divides
 * the gradients by it again before the optimizer steps. When a scaled gradient overflowed (an
 * inf or a NaN on any rank), the step is skipped on every rank and the factor is reduced; after
 * growth_interval clean steps in a row it is increased. Per iteration:
 *
 *     fsdp_grad_scaler_scale(s, loss, &scaled);   backward from `scaled`
 *     fsdp_grad_scaler_unscale(s, opt);           optional: to clip or inspect the gradients
 *     fsdp_grad_scaler_step(s, opt, &stepped);    unscales unless done, steps unless inf/NaN
 *     fsdp_grad_scaler_update(s);                 backoff or growth; ends the iteration
 *
 * Sharding. Each rank sees only its shard of each gradient, so the found-inf flag of every rank
 * is all-reduced (max) over the scaler's group before a step is taken or skipped: all ranks
 * agree, and the replicas of a parameter never diverge. unscale() and step() are therefore
 * collective over that group (every rank calls them, in the same order relative to its other
 * collectives on it); the other functions are local.
 *
 * Arithmetic follows PyTorch exactly. The scale is a float (f32) value, as PyTorch's scale
 * tensor: init_scale, update_to's value and a loaded scale are rounded to f32, and the updates
 * are (float)(scale * factor) in double. unscale() multiplies each gradient by
 * inv = (float)(1.0 / (double)scale) in the gradient's compute type (f32 for f32, f16 and bf16
 * gradients, rounded back to the 16-bit type once; f64 for f64), after checking it for
 * infs/NaNs; growth never takes the scale to inf (such a growth is not applied, as PyTorch's
 * kernel does). Gradients of any float dtype on any device are handled through the device's
 * kernels.
 *
 * One departure from PyTorch in the API only: PyTorch creates its scale tensor lazily in the
 * first scale() call and asserts ("Attempted unscale_ but _scale is None") when unscale, step or
 * update come first; here the same misuse is FSDP_EINVAL with that message.
 *
 * Errors: every fallible function returns 0 or a negative FSDP_E* code and leaves a message on
 * the scaler's context (fsdp_ctx_last_error) naming the function, the rank and the value or
 * parameter involved. A NULL scaler is FSDP_EINVAL without a message.
 *
 * Thread-safety: a scaler belongs to one rank (context) and is used by that rank's thread only.
 */
#ifndef FSDP_GRAD_SCALER_H
#define FSDP_GRAD_SCALER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/optim.h>
#include <fsdp/pg.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_grad_scaler fsdp_grad_scaler_t;

typedef struct fsdp_grad_scaler_options {
    /* sizeof this struct as the caller was built; set by fsdp_grad_scaler_options_init() */
    size_t size;
    double init_scale;       /* 65536.0 (2^16); > 0 and finite once rounded to f32 */
    double growth_factor;    /* 2.0, must be > 1 (and finite) */
    double backoff_factor;   /* 0.5, must be in (0, 1) */
    int64_t growth_interval; /* 2000, must be > 0: clean iterations before a growth */
    /* true; false: every call is a pass-through (scale returns the loss, step just steps), and
     * the other fields are not checked, as in PyTorch. */
    bool enabled;
    /* The group the found-inf flag is all-reduced over (max); borrowed, must outlive the
     * scaler. NULL: the context's world group (fsdp_ctx_pg), or none at world size 1. */
    fsdp_pg_t *pg;
} fsdp_grad_scaler_options_t;

/* PyTorch's state_dict keys (_growth_tracker: the clean iterations since the last growth or
 * backoff). A disabled scaler's state is all zero, PyTorch's empty dict. */
typedef struct fsdp_grad_scaler_state {
    double scale, growth_factor, backoff_factor;
    int64_t growth_interval, growth_tracker;
} fsdp_grad_scaler_state_t;

/* PyTorch's defaults: init_scale 2^16, growth_factor 2, backoff_factor 0.5, growth_interval
 * 2000, enabled, pg NULL. */
FSDP_EXTERN void fsdp_grad_scaler_options_init(fsdp_grad_scaler_options_t *o, size_t size);
#define fsdp_grad_scaler_options_init(o) (fsdp_grad_scaler_options_init)((o), sizeof *(o))

/* A scaler on ctx's rank with options o (NULL: the defaults; copied). Errors: FSDP_EINVAL
 * naming the bad field and its value, or "no process group" when o->pg is NULL, the context
 * has no world group and the world size is above 1; FSDP_ENOMEM. *out is NULL on failure. */
FSDP_EXTERN int fsdp_grad_scaler_create(fsdp_ctx_t *ctx, const fsdp_grad_scaler_options_t *o,
                                        fsdp_grad_scaler_t **out);
/* Frees the scaler; NULL ok. The group and the optimizers it saw are left alone. */
FSDP_EXTERN void fsdp_grad_scaler_destroy(fsdp_grad_scaler_t *s);

/* *out = loss * scale, differentiable, in loss's dtype (a new reference; the product of a
 * 16-bit loss is computed in f32 and rounded once, as PyTorch's scaled_output.type(dtype)).
 * loss is any float tensor. Disabled: a new reference to loss. Local. */
FSDP_EXTERN int fsdp_grad_scaler_scale(fsdp_grad_scaler_t *s, fsdp_tensor_t *loss,
                                       fsdp_tensor_t **out);

/*
 * Unscales every gradient of the optimizer's parameters (grad *= 1/scale, the inverse computed
 * in double then rounded to f32 as PyTorch does, applied in the gradient's own dtype; f16/bf16
 * grads allowed; parameters without a gradient are skipped), records whether any was inf/NaN
 * (checked before unscaling), and all-reduces that flag (max) over the group so every rank
 * agrees. Collective. Once per optimizer per iteration: a second call before update() is
 * FSDP_EINVAL ("unscale() has already been called on this optimizer since the last update()"),
 * and so is a call after step() ("unscale() is being called after step()"). A gradient that is
 * not a float tensor is FSDP_EINVAL naming the parameter, before any gradient is changed. A
 * rank whose gradients fail still joins the all-reduce with its flag set (its peers neither
 * hang nor step) and returns its error. Disabled: does nothing.
 */
FSDP_EXTERN int fsdp_grad_scaler_unscale(fsdp_grad_scaler_t *s, fsdp_optim_t *opt);

/* Unscales if not done yet for opt in this iteration (collective, as unscale), then runs
 * fsdp_optim_step unless any rank found an inf/NaN; *stepped (may be NULL) says which. A second
 * step before update() is FSDP_EINVAL ("step() has already been called since the last
 * update()"). A failing fsdp_optim_step is returned as it is (the iteration then stays
 * unscaled). Disabled: fsdp_optim_step, *stepped true on success. */
FSDP_EXTERN int fsdp_grad_scaler_step(fsdp_grad_scaler_t *s, fsdp_optim_t *opt, bool *stepped);

/* Growth and backoff: after a skipped step (an inf/NaN in any optimizer's unscale of this
 * iteration) scale *= backoff_factor and the tracker resets; otherwise the tracker counts, and
 * at growth_interval scale *= growth_factor and it resets. Resets the per-iteration state.
 * FSDP_EINVAL when no optimizer was unscaled since the last update ("No inf checks were
 * recorded prior to update()"). Disabled: does nothing. */
FSDP_EXTERN int fsdp_grad_scaler_update(fsdp_grad_scaler_t *s);
/* update() with an explicit new scale (> 0 and finite once rounded to f32), as PyTorch's
 * update(new_scale): the tracker is left alone, the per-iteration state reset. */
FSDP_EXTERN int fsdp_grad_scaler_update_to(fsdp_grad_scaler_t *s, double new_scale);

/* The current scale (an f32 value); 1.0 when disabled (or s is NULL). */
FSDP_EXTERN double fsdp_grad_scaler_get_scale(const fsdp_grad_scaler_t *s);
/* Whether an unscale of the current iteration found an inf/NaN on any rank (after the
 * all-reduce); false after update() and when disabled. */
FSDP_EXTERN bool fsdp_grad_scaler_found_inf(const fsdp_grad_scaler_t *s);

/* The state to checkpoint (after update(), as PyTorch advises). */
FSDP_EXTERN int fsdp_grad_scaler_state_dict(const fsdp_grad_scaler_t *s,
                                            fsdp_grad_scaler_state_t *st);
/* Loads a state, validated like the options (and 0 <= growth_tracker < growth_interval); an
 * all-zero state is refused as PyTorch refuses an empty dict ("The source state dict is empty,
 * possibly because it was saved from a disabled instance of GradScaler"); nothing changes on
 * error. Disabled: does nothing. */
FSDP_EXTERN int fsdp_grad_scaler_load_state_dict(fsdp_grad_scaler_t *s,
                                                 const fsdp_grad_scaler_state_t *st);

FSDP_END_DECLS

#endif /* FSDP_GRAD_SCALER_H */
