/* SPDX-License-Identifier: MIT */
/*
 * fsdp/autograd.h: the tape, backward, grad mode, marks and recompute regions.
 *
 * Each context (rank) has one tape. Operations on tensors that require gradients append nodes
 * to it during forward; fsdp_backward() walks it in reverse, computes the gradient of every
 * recorded operation that the loss depends on, accumulates leaf gradients (a tensor used twice
 * gets the sum) and then clears the tape.
 *
 * Marks are entries on the same tape that run a hook when backward passes them. Modules put a
 * mark at their entry and exit, so a hook at the exit mark runs before the module's backward
 * (when the gradients of its outputs are ready) and a hook at the entry mark runs after it (its
 * parameters' gradients are complete): FSDP's pre- and post-backward hooks. Final callbacks run
 * once the whole backward has finished.
 *
 * Recompute regions (activation checkpointing) run a function without recording during
 * forward and run it again, recording, when backward reaches them.
 *
 * Thread-safety: a tape belongs to one context and is used by that rank's thread only; ranks'
 * tapes are independent.
 */
#ifndef FSDP_AUTOGRAD_H
#define FSDP_AUTOGRAD_H

#include <stdbool.h>
#include <stddef.h>

#include <fsdp/export.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

/* Computes gradients of `loss` with respect to every leaf it depends on. grad_output (same shape
 * as loss) may be NULL when loss has one element (then 1). Leaves' gradients accumulate into
 * fsdp_tensor_grad(); the tape is cleared afterwards (a second backward through the same graph
 * is an error). A failing hook or operation stops the backward and returns its status; the tape
 * is cleared either way. */
FSDP_EXTERN int fsdp_backward(fsdp_tensor_t *loss, fsdp_tensor_t *grad_output);

/* Same for several outputs at once (grad_outputs[i] may be NULL for one-element outputs). */
FSDP_EXTERN int fsdp_backward_multi(int n, fsdp_tensor_t *const *outputs,
                                    fsdp_tensor_t *const *grad_outputs);

/* Grad mode. Returns the previous mode, so `bool was = fsdp_set_grad_enabled(ctx, false); ...;
 * fsdp_set_grad_enabled(ctx, was);` is a no-grad region. With grad mode off nothing is
 * recorded and outputs never require gradients. */
FSDP_EXTERN bool fsdp_set_grad_enabled(fsdp_ctx_t *ctx, bool enabled);
FSDP_EXTERN bool fsdp_is_grad_enabled(const fsdp_ctx_t *ctx);
/* Whether a backward is running on this context (hooks may ask). */
FSDP_EXTERN bool fsdp_in_backward(const fsdp_ctx_t *ctx);

/* Entries on the tape (nodes and marks), and whether it is empty. */
FSDP_EXTERN size_t fsdp_tape_size(const fsdp_ctx_t *ctx);
/* Drops everything recorded (as after a backward). */
FSDP_EXTERN void fsdp_tape_clear(fsdp_ctx_t *ctx);

/* A hook run by backward when it passes a mark. has_grad says whether any of the mark's tensors
 * received a gradient (always true for a mark without tensors). A negative return stops the
 * backward with that status. */
typedef int (*fsdp_mark_fn)(fsdp_ctx_t *ctx, void *arg, bool has_grad);

/* Records a mark (only while grad mode is on; otherwise it does nothing and returns 0). The
 * tape keeps a reference to each of the n tensors, to test whether they got a gradient.
 * arg_free (may be NULL) is called on arg when the mark is dropped. */
FSDP_EXTERN int fsdp_tape_mark(fsdp_ctx_t *ctx, const char *label, int n,
                               fsdp_tensor_t *const *tensors, fsdp_mark_fn fn, void *arg,
                               void (*arg_free)(void *arg));

/* Queues fn(ctx, arg) to run after the current backward has processed the whole tape (FSDP's
 * final callback). Only during a backward; callbacks run in the order queued. */
typedef int (*fsdp_callback_fn)(fsdp_ctx_t *ctx, void *arg);
FSDP_EXTERN int fsdp_queue_callback(fsdp_ctx_t *ctx, fsdp_callback_fn fn, void *arg);

/* Gradient hooks on leaves (fsdp_tensor_add_grad_hook) are declared in fsdp/tensor.h with the
 * gradient itself; backward runs them right after accumulating into a leaf's gradient. */

/* A recomputable region: fn maps nin inputs to nout outputs (it must create each output;
 * the caller receives them). During forward fn runs with recording off and only the inputs are
 * kept; backward re-runs fn with recording on (the random stream rewound to where it was, so
 * dropout draws the same mask) and differentiates through it. arg must stay valid until the
 * backward (or fsdp_tape_clear) has happened. */
typedef int (*fsdp_region_fn)(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in,
                              int nout, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_checkpoint(fsdp_ctx_t *ctx, fsdp_region_fn fn, void *arg, int nin,
                                fsdp_tensor_t *const *in, int nout, fsdp_tensor_t **out);

/*
 * Operations of the caller's with their own backward (PyTorch's torch.autograd.Function).
 * forward maps nin inputs to nout outputs (it must create each output) and runs with recording
 * off. backward receives the forward's inputs (kept by the tape until then), which of them want
 * a gradient (needs[i]) and the gradients of the outputs (gout[o]; zeros for an output that got
 * none), and stores a new reference in gin[i] for each input that wants one (NULL: no
 * gradient). It runs with recording off and may use every public operation. A gradient must
 * have its input's shape (anything else fails the backward with FSDP_EINVAL naming the input);
 * one given for an input that wants none is dropped. Both return 0 or a negative FSDP_E* code,
 * which stops the forward or the backward with that status.
 */
typedef struct fsdp_function {
    const char *name; /* for messages */
    int (*forward)(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                   fsdp_tensor_t **out);
    int (*backward)(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in,
                    const bool *needs, int nout, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin);
} fsdp_function_t;

/*
 * Applies fn to nin (1..8) inputs, giving nout (>= 1) outputs in out[] (new references). When
 * grad mode is on and an input requires a gradient, the outputs require one and backward runs
 * fn->backward. fn must stay valid until then; arg is the function's and arg_free(arg) (may be
 * NULL) runs once it is no longer needed: when the tape drops the operation, or before returning
 * when nothing was recorded or the call failed. Errors: FSDP_EINVAL for a NULL or incomplete
 * fn, a NULL input, nin or nout out of range, an output left NULL; forward's status.
 */
FSDP_EXTERN int fsdp_function_apply(fsdp_ctx_t *ctx, const fsdp_function_t *fn, void *arg,
                                    void (*arg_free)(void *arg), int nin, fsdp_tensor_t *const *in,
                                    int nout, fsdp_tensor_t **out);

FSDP_END_DECLS

#endif /* FSDP_AUTOGRAD_H */
