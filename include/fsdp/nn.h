/* SPDX-License-Identifier: MIT */
/*
 * fsdp/nn.h: modules: a named tree of layers holding parameters and buffers.
 *
 * A module has a type, a forward function, named parameters (leaf tensors that require grad
 * unless frozen), named buffers (tensors without gradient: running statistics, masks), and
 * named children. Fully qualified names join the path with dots, as in PyTorch
 * ("layers.0.attn.in_proj_weight"). A tensor registered under two names (a tied embedding) is
 * one parameter: listings give it once, under the first name in pre-order, and
 * fsdp_module_named_params(..., with_aliases = true) lists every name.
 *
 * Modules are reference counted: a child added to two parents (a shared submodule) is one
 * module; the tree holds references and fsdp_module_release() of the root frees what nobody
 * else holds.
 *
 * fsdp_module_forward() is how every module runs, including children called from a parent's
 * forward: it runs forward pre-hooks, records an entry mark, runs the module's forward, records
 * an exit mark and runs post-hooks. Backward hooks registered on a module run when backward
 * passes those marks (pre: the gradients of its outputs are ready; post: its own backward is
 * done). FSDP builds its runtime on these hooks.
 *
 * Thread-safety: a module belongs to one context (rank) and one thread.
 */
#ifndef FSDP_NN_H
#define FSDP_NN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_module fsdp_module_t;

/* What a module type provides. forward receives the (borrowed) inputs and must store a new
 * reference in each of out[0..nout). destroy (may be NULL) frees impl; parameters, buffers
 * and children are released by the core. */
typedef struct fsdp_module_ops {
    const char *type; /* "Linear", "Sequential", ... */
    int (*forward)(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                   fsdp_tensor_t **out);
    void (*destroy)(void *impl);
} fsdp_module_ops_t;

/* ---- the tree --------------------------------------------------------------------------------- */

/* A module of a user-defined type: ops must outlive the module; impl is owned by the module
 * (ops->destroy frees it). On failure impl stays with the caller. */
FSDP_EXTERN int fsdp_module_create(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, void *impl,
                                   fsdp_module_t **out);
FSDP_EXTERN fsdp_module_t *fsdp_module_retain(fsdp_module_t *m);
/* Drops a reference; the last one releases children, parameters and buffers. NULL ok. */
FSDP_EXTERN void fsdp_module_release(fsdp_module_t *m);

FSDP_EXTERN fsdp_ctx_t *fsdp_module_ctx(const fsdp_module_t *m);
FSDP_EXTERN const char *fsdp_module_type(const fsdp_module_t *m);
FSDP_EXTERN void *fsdp_module_impl(const fsdp_module_t *m);
FSDP_EXTERN const fsdp_module_ops_t *fsdp_module_ops(const fsdp_module_t *m);

/* Registers child under name (no dots; unique among the module's children, parameters and
 * buffers); the module takes a reference. */
FSDP_EXTERN int fsdp_module_add_child(fsdp_module_t *m, const char *name, fsdp_module_t *child);
/* Registers a parameter (the module takes a reference). The tensor must be a float leaf; it is
 * marked requires_grad and named with its local name until a parent gives it a longer one. A
 * tensor already registered elsewhere in the tree becomes a shared (tied) parameter. */
FSDP_EXTERN int fsdp_module_add_param(fsdp_module_t *m, const char *name, fsdp_tensor_t *t);
/* Replaces the tensor of an existing parameter (FSDP swaps in views); name may be a dotted
 * path; shapes must match unless allow_reshape. The new tensor's requires_grad is left as it is
 * (a view of a flat parameter is not a leaf, and gets its gradient through the view). The
 * module releases the old tensor. */
FSDP_EXTERN int fsdp_module_set_param(fsdp_module_t *m, const char *name, fsdp_tensor_t *t,
                                      bool allow_reshape);
/* Registers a buffer; persistent buffers appear in the state dict. */
FSDP_EXTERN int fsdp_module_add_buffer(fsdp_module_t *m, const char *name, fsdp_tensor_t *t,
                                       bool persistent);

/* Lookups by local name or dotted path from m ("encoder.layers.0"); NULL when absent.
 * Borrowed. */
FSDP_EXTERN fsdp_module_t *fsdp_module_child(const fsdp_module_t *m, const char *path);
FSDP_EXTERN fsdp_tensor_t *fsdp_module_param(const fsdp_module_t *m, const char *path);
FSDP_EXTERN fsdp_tensor_t *fsdp_module_buffer(const fsdp_module_t *m, const char *path);
FSDP_EXTERN size_t fsdp_module_num_children(const fsdp_module_t *m);
/* The i-th child in registration order and its local name (borrowed). */
FSDP_EXTERN fsdp_module_t *fsdp_module_child_at(const fsdp_module_t *m, size_t i,
                                                const char **name);

/* A listing: parallel arrays of n fully qualified names and tensors (or modules). Module
 * listings borrow their tensors and modules (owned false); state dicts (fsdp_module_state_dict,
 * fsdp_state_dict_load) hold a reference to each tensor (owned true), which
 * fsdp_named_list_free releases. A list built by the caller (for load_state_dict) may leave
 * owned false and modules NULL. */
typedef struct fsdp_named_list {
    size_t n;
    char **names;
    fsdp_tensor_t **tensors;  /* NULL for module listings */
    fsdp_module_t **modules;  /* the module that registered the entry (or the module itself) */
    bool owned;               /* true: the list holds a reference to each tensor */
} fsdp_named_list_t;
FSDP_EXTERN void fsdp_named_list_free(fsdp_named_list_t *list);

/* Parameters in pre-order (a module's own before its children's, in registration order).
 * Shared tensors appear once unless with_aliases. */
FSDP_EXTERN int fsdp_module_named_params(const fsdp_module_t *m, bool with_aliases,
                                         fsdp_named_list_t *out);
FSDP_EXTERN int fsdp_module_named_buffers(const fsdp_module_t *m, bool with_aliases,
                                          fsdp_named_list_t *out);
/* Modules in pre-order, m itself first with name ""; a shared module appears once. */
FSDP_EXTERN int fsdp_module_named_modules(const fsdp_module_t *m, fsdp_named_list_t *out);
/* Number of parameter elements (shared tensors counted once). */
FSDP_EXTERN int64_t fsdp_module_num_params(const fsdp_module_t *m);
/* Every fully qualified name under which t is registered in m's tree (count in out->n; names in
 * a list that the caller frees with fsdp_named_list_free). */
FSDP_EXTERN int fsdp_module_param_aliases(const fsdp_module_t *m, const fsdp_tensor_t *t,
                                          fsdp_named_list_t *out);

/* Calls fn on each module of the tree in pre-order with its fully qualified name; a non-zero
 * return stops the walk and is returned. */
typedef int (*fsdp_module_visit_fn)(fsdp_module_t *m, const char *fqn, void *arg);
FSDP_EXTERN int fsdp_module_visit(fsdp_module_t *m, fsdp_module_visit_fn fn, void *arg);

/* Training mode, recursively (dropout and batch norm read it). */
FSDP_EXTERN void fsdp_module_train(fsdp_module_t *m, bool train);
FSDP_EXTERN bool fsdp_module_is_training(const fsdp_module_t *m);
/* Sets requires_grad on every parameter of the tree (freezing or unfreezing). */
FSDP_EXTERN int fsdp_module_requires_grad_(fsdp_module_t *m, bool requires_grad);
/* zero_grad on every parameter. */
FSDP_EXTERN int fsdp_module_zero_grad(fsdp_module_t *m, bool set_to_none);

/* ---- running --------------------------------------------------------------------------------- */

FSDP_EXTERN int fsdp_module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in,
                                    int nout, fsdp_tensor_t **out);
/* One input, one output. */
FSDP_EXTERN int fsdp_module_forward1(fsdp_module_t *m, fsdp_tensor_t *x, fsdp_tensor_t **y);

/* A pre-hook sees the inputs and may replace any of them (release the old reference, store a
 * new one). A post-hook sees inputs and outputs and may replace outputs likewise. */
typedef int (*fsdp_forward_pre_hook_fn)(fsdp_module_t *m, void *arg, int nin,
                                        fsdp_tensor_t **in);
typedef int (*fsdp_forward_hook_fn)(fsdp_module_t *m, void *arg, int nin,
                                    fsdp_tensor_t *const *in, int nout, fsdp_tensor_t **out);
/* Backward hooks: has_grad says whether gradient reached the module's outputs (pre) or
 * inputs (post). */
typedef int (*fsdp_backward_hook_fn)(fsdp_module_t *m, void *arg, bool has_grad);

/* Hooks run in registration order. Each returns a handle for fsdp_module_remove_hook. */
FSDP_EXTERN int fsdp_module_add_forward_pre_hook(fsdp_module_t *m, fsdp_forward_pre_hook_fn fn,
                                                 void *arg, int *handle);
FSDP_EXTERN int fsdp_module_add_forward_hook(fsdp_module_t *m, fsdp_forward_hook_fn fn,
                                             void *arg, int *handle);
FSDP_EXTERN int fsdp_module_add_backward_pre_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn,
                                                  void *arg, int *handle);
FSDP_EXTERN int fsdp_module_add_backward_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn,
                                              void *arg, int *handle);
FSDP_EXTERN int fsdp_module_remove_hook(fsdp_module_t *m, int handle);

/* ---- activation checkpointing ---------------------------------------------------------------- */
/*
 * A module with activation checkpointing on (PyTorch's checkpoint_wrapper, non-reentrant) runs
 * each call under grad mode as one recompute region (fsdp_checkpoint in fsdp/autograd.h): the
 * whole call, its forward hooks and its children's included, runs once with recording off and
 * keeps only the call's inputs; when backward reaches it the call runs again, recording (the
 * random stream rewound, so dropout draws the same masks), and is differentiated there. Outputs
 * and gradients are bitwise those of a plain run; what a call saved for backward is held only
 * while its backward runs. The module's hooks (FSDP's among them) run on both runs, as they do
 * inside PyTorch's wrapper. Nothing is added to the tree: parameter names, state dicts and wrap
 * policies see the module as it was.
 *
 * A call keeps at most 8 inputs (more is FSDP_EINVAL naming the module). With grad mode off a
 * call runs as usual. Turning it on or off takes effect at the next call.
 */
FSDP_EXTERN int fsdp_module_set_activation_checkpointing(fsdp_module_t *m, bool on);
FSDP_EXTERN bool fsdp_module_activation_checkpointing(const fsdp_module_t *m);

/* Selects modules for fsdp_apply_activation_checkpointing: true checkpoints m. */
typedef bool (*fsdp_module_check_fn)(fsdp_module_t *m, const char *fqn, void *arg);
/*
 * PyTorch's apply_activation_checkpointing: turns activation checkpointing on for every module
 * below root (root itself excluded) whose type is `type` (NULL: any) and for which check (NULL:
 * none) returns true; typically one call per transformer block: type "GPTBlock". *count (may be
 * NULL) receives how many modules were turned on that were off. Errors: FSDP_EINVAL for a NULL
 * root, or for type and check both NULL (that would checkpoint every module inside every
 * other).
 */
FSDP_EXTERN int fsdp_apply_activation_checkpointing(fsdp_module_t *root, const char *type,
                                                    fsdp_module_check_fn check, void *arg,
                                                    size_t *count);

/* ---- state dict ------------------------------------------------------------------------------ */

/* Fully qualified name -> tensor: parameters then persistent buffers, each tree order, every
 * alias of a shared tensor included (as PyTorch does). Tensors are detached views of the
 * module's own (not copies). The order is PyTorch's: in pre-order, each module's parameters
 * then its persistent buffers. The list owns its tensors (out->owned). */
FSDP_EXTERN int fsdp_module_state_dict(const fsdp_module_t *m, fsdp_named_list_t *out);
/* Copies values from sd into the module's parameters and persistent buffers. strict: every
 * problem is an error listing all missing keys, unexpected keys and shape mismatches by name,
 * and nothing is modified. Not strict: matching entries are loaded, the rest reported in
 * fsdp_ctx_last_error but not an error (shape mismatches are always errors). */
FSDP_EXTERN int fsdp_module_load_state_dict(fsdp_module_t *m, const fsdp_named_list_t *sd,
                                            bool strict);
/* A state dict in a file (simple binary: names, dtypes, shapes, data). Loading creates CPU
 * tensors on ctx's default device. Saving writes a temporary file beside path and renames it
 * over path, which must be absent or a regular file (a FIFO, device, directory or link is
 * refused); on failure path is untouched. Loading refuses a path that is not a regular file
 * without blocking on it. */
FSDP_EXTERN int fsdp_state_dict_save(const fsdp_named_list_t *sd, const char *path);
FSDP_EXTERN int fsdp_state_dict_load(fsdp_ctx_t *ctx, const char *path, fsdp_named_list_t *out);

/* ---- layers ---------------------------------------------------------------------------------- */
/* Parameters are created in f32 and initialised as PyTorch 1.13 does, from the context's random
 * stream, in the order PyTorch initialises them. */

/* Linear: weight (out, in), bias (out); init U(-1/sqrt(in), 1/sqrt(in)) for both. */
FSDP_EXTERN int fsdp_linear_create(fsdp_ctx_t *ctx, int64_t in, int64_t out, bool bias,
                                   fsdp_module_t **m);
/* Embedding: weight (num, dim) ~ N(0, 1), the padding row zeroed (padding_idx < 0: none). */
FSDP_EXTERN int fsdp_embedding_create(fsdp_ctx_t *ctx, int64_t num, int64_t dim,
                                      int64_t padding_idx, fsdp_module_t **m);
/* LayerNorm over the last dimension of size dim: weight ones, bias zeros (affine). */
FSDP_EXTERN int fsdp_layernorm_create(fsdp_ctx_t *ctx, int64_t dim, double eps, bool affine,
                                      fsdp_module_t **m);
/* BatchNorm1d/2d/3d (spatial_dims 0 or 1, 2, 3): weight ones, bias zeros, running_mean zeros,
 * running_var ones, num_batches_tracked (i64 scalar) buffers. Input (N, C, ...). */
FSDP_EXTERN int fsdp_batchnorm_create(fsdp_ctx_t *ctx, int spatial_dims, int64_t c, double eps,
                                      double momentum, fsdp_module_t **m);
FSDP_EXTERN int fsdp_relu_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
FSDP_EXTERN int fsdp_gelu_create(fsdp_ctx_t *ctx, fsdp_gelu_approx_t approx, fsdp_module_t **m);
FSDP_EXTERN int fsdp_tanh_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
FSDP_EXTERN int fsdp_dropout_create(fsdp_ctx_t *ctx, double p, fsdp_module_t **m);
FSDP_EXTERN int fsdp_identity_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
/* Sequential runs its children in order (one input, one output each); ModuleList and
 * ModuleDict only hold children (their forward is an error). Children are added with
 * fsdp_module_add_child (Sequential and ModuleList name them "0", "1", ... via
 * fsdp_module_append). */
FSDP_EXTERN int fsdp_sequential_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
FSDP_EXTERN int fsdp_modulelist_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
FSDP_EXTERN int fsdp_moduledict_create(fsdp_ctx_t *ctx, fsdp_module_t **m);
/* Adds child under the next index name ("0", "1", ...). */
FSDP_EXTERN int fsdp_module_append(fsdp_module_t *m, fsdp_module_t *child);

FSDP_END_DECLS

#endif /* FSDP_NN_H */
