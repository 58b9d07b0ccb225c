/* SPDX-License-Identifier: MIT */
/*
 * optim_impl.h: internals of the optimizers shared across src/optim and with FSDP.
 *
 * Two parts. The optimizer object itself (struct fsdp_optim, its groups and per-parameter
 * state), shared by optim.c (creation, groups, stepping) and optim_state.c (the state dict).
 * And the gradient-norm helpers shared by fsdp_clip_grad_norm (plain parameters) and FSDP's clip
 * over shards, so that both compute the same local quantities the same way.
 *
 * Invariants of struct fsdp_optim:
 *   - params[] holds every parameter once, groups in order: group g owns
 *     params[groups[g].begin .. groups[g].begin + groups[g].count).
 *   - State buffers are contiguous, in their parameter's dtype, shape and device, counted under
 *     FSDP_MEM_OPTIM; NULL means "not created". A parameter has state iff its momentum buffer
 *     (SGD) or its exp_avg (Adam, AdamW) exists; Adam's step is 0 without state.
 *   - `fresh` flags are only set inside fsdp_optim_step(): a buffer created by the running step
 *     whose kernel has not run yet. Whatever is still fresh when a step fails is dropped, so a
 *     failed step never leaves half-initialised state behind.
 */
#ifndef FSDP_OPTIM_IMPL_H
#define FSDP_OPTIM_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/autograd.h>
#include <fsdp/optim.h>
#include <fsdp/tensor.h>

#include "internal.h"

/* The size record of fsdp_adam_options_t (docs/design.md, "ABI policy"), for the GPT recipe's
 * _init and its optimizer. */
extern const fsdp__abi_struct_t fsdp__adam_options_abi;

/* ---- the optimizer object ---- */

/* State entries of a parameter; the first FSDP__OPTIM_NBUF are buffers, FSDP__OPTIM_STEP is
 * Adam's count. */
enum {
    FSDP__OPTIM_MOMENTUM = 0,
    FSDP__OPTIM_EXP_AVG,
    FSDP__OPTIM_EXP_AVG_SQ,
    FSDP__OPTIM_MAX_EXP_AVG_SQ,
    FSDP__OPTIM_NBUF
};
enum { FSDP__OPTIM_STEP = FSDP__OPTIM_NBUF, FSDP__OPTIM_NSLOT };

/* Hyper-parameters of every algorithm in one struct; each kind reads its own fields. */
struct fsdp__hparams {
    double lr, momentum, dampening, beta1, beta2, eps, weight_decay;
    bool nesterov, amsgrad;
};

struct fsdp__oparam {
    fsdp_tensor_t *t; /* retained */
    char *name;       /* owned */
    int group;
    int64_t step;                         /* Adam steps taken */
    fsdp_tensor_t *buf[FSDP__OPTIM_NBUF]; /* owned state buffers, NULL when absent */
    bool fresh[FSDP__OPTIM_NBUF];         /* see the invariants above */
};

struct fsdp__ogroup {
    struct fsdp__hparams hp;
    size_t begin, count;
};

struct fsdp_optim {
    fsdp_ctx_t *ctx;
    fsdp_optim_kind_t kind;
    struct fsdp__hparams defaults;
    struct fsdp__ogroup *groups;
    int ngroups;
    struct fsdp__oparam *params;
    size_t nparams;
};

/* fsdp_optim_state_dict; without copy, the state buffers in out are the live ones (references),
 * for a caller that only reads them before the next step (a checkpoint writer). */
int fsdp__optim_state_dict(const fsdp_optim_t *opt, bool copy, fsdp_named_list_t *out);

/* fsdp_optim_load_state_dict; with adopt, a buffer entry that is already a contiguous tensor of
 * its parameter's dtype, device and shape becomes the optimizer's buffer as it is (no copy): for
 * a caller that built the list for this load and drops it afterwards (an FSDP state-dict load). */
int fsdp__optim_load_state_dict(fsdp_optim_t *opt, const fsdp_named_list_t *sd, bool adopt);

/* Checks h for an optimizer of `kind` as PyTorch's constructors do; on failure writes the
 * reason into why (len bytes) and returns false. NaN fails every comparison, so it is refused
 * too. */
bool fsdp__optim_hp_valid(fsdp_optim_kind_t kind, const struct fsdp__hparams *h, char *why,
                          size_t len);

/* Whether a and b have the same shape (dtypes aside). */
bool fsdp__optim_same_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b);

/* Releases every state buffer of p and resets its step: p has no state afterwards. */
void fsdp__optim_drop_buffers(struct fsdp__oparam *p);

/* ---- gradient norms ---- */

/* The local part of a p-norm of g: sum of |g_i|^p for finite p, max |g_i| for p = +inf (0 for
 * an empty tensor), computed on g's device in g's compute dtype. */
int fsdp__grad_norm_part(fsdp_tensor_t *g, double p, double *out);

/* Combines parts: the norm from an accumulated sum (finite p) or max (inf). */
double fsdp__grad_norm_finish(double acc, double p);

/* The clip coefficient PyTorch uses: max_norm / (total + 1e-6), clamped to at most 1. */
double fsdp__clip_coef(double max_norm, double total);

/* g *= coef in place. */
int fsdp__grad_scale(fsdp_tensor_t *g, double coef);

#endif /* FSDP_OPTIM_IMPL_H */
