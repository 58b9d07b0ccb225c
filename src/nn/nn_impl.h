/* SPDX-License-Identifier: MIT */
/*
 * nn_impl.h: what a module looks like inside, and the helpers module types share.
 *
 * A module is a reference-counted node of a tree. It keeps, each in registration order:
 * children (references), parameters and buffers (tensor references, each under a local name
 * without dots), and hooks. Local names are unique across the three kinds, as in PyTorch.
 *
 * Invariants:
 *   - The tree is acyclic: fsdp_module_add_child refuses a child that contains the parent.
 *   - A tensor may be registered under several names (a tied parameter); listings decide by
 *     pointer identity what is "the same" parameter.
 *   - Parameter slots are stable: fsdp_module_set_param replaces the tensor in place, so a
 *     module type may find its parameters by index (params[i].t) in its forward.
 *   - Hook handles are unique per module (never reused) and positive.
 *
 * Module types built into the library (layers.c, attention.c, transformer.c, gpt.c) use
 * fsdp__module_new: the core allocates a zeroed impl of the requested size and frees it with
 * free() after ops->destroy (which, when set, only releases what impl holds). Modules made by
 * the public fsdp_module_create keep the public rule: ops->destroy (when set) frees impl.
 * Either way a failed constructor leaves impl with the caller (callees never free arguments).
 */
#ifndef FSDP_NN_IMPL_H
#define FSDP_NN_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include <fsdp/autograd.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

/* A named parameter or buffer. */
struct fsdp__slot {
    char *name;       /* local name (owned) */
    fsdp_tensor_t *t; /* owned reference */
    bool persistent;  /* buffers: listed in the state dict; always true for parameters */
};

struct fsdp__child {
    char *name;       /* local name (owned) */
    fsdp_module_t *m; /* owned reference */
};

enum fsdp__hook_kind {
    FSDP__HOOK_FORWARD_PRE = 0,
    FSDP__HOOK_FORWARD,
    FSDP__HOOK_BACKWARD_PRE,
    FSDP__HOOK_BACKWARD,
    FSDP__HOOK_NKINDS
};

struct fsdp__hook {
    int handle;
    enum fsdp__hook_kind kind;
    union {
        fsdp_forward_pre_hook_fn pre;
        fsdp_forward_hook_fn post;
        fsdp_backward_hook_fn bw;
    } fn;
    void *arg;
};

struct fsdp_module {
    long refs;                    /* one thread per module: not atomic */
    fsdp_ctx_t *ctx;
    const fsdp_module_ops_t *ops;
    void *impl;
    bool impl_core_owned;         /* impl came from fsdp__module_new: the core free()s it */
    bool training;                /* true after creation, like PyTorch */
    struct fsdp__child *children; /* nchildren, registration order */
    size_t nchildren, capchildren;
    struct fsdp__slot *params;    /* nparams, registration order */
    size_t nparams, capparams;
    struct fsdp__slot *buffers;   /* nbuffers, registration order */
    size_t nbuffers, capbuffers;
    struct fsdp__hook *hooks;     /* nhooks, registration order (all kinds mixed) */
    size_t nhooks, caphooks;
    int nhooks_kind[FSDP__HOOK_NKINDS];
    int next_handle;              /* last handle given out */
    bool checkpointed;            /* activation checkpointing: each call is a recompute region */
};

/* A module of a built-in type with a zeroed impl of impl_size bytes (0: impl NULL), freed by
 * the core (see above). *impl_out (may be NULL) receives the impl. */
int fsdp__module_new(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, size_t impl_size,
                     fsdp_module_t **out, void **impl_out);

/* Creates an f32 tensor of the given shape filled with value (category FSDP_MEM_PARAMS),
 * registers it as parameter `name` of m and, when t is non-NULL, stores it there (borrowed: the
 * module holds the reference). */
int fsdp__module_new_param(fsdp_module_t *m, const char *name, int ndim, const int64_t *shape,
                           double value, fsdp_tensor_t **t);
/* Same for a buffer of dtype dt. */
int fsdp__module_new_buffer(fsdp_module_t *m, const char *name, fsdp_dtype_t dt, int ndim,
                            const int64_t *shape, double value, bool persistent,
                            fsdp_tensor_t **t);

/* Grows *arr (elements of size es) so that it holds at least n + 1; FSDP_ENOMEM. */
int fsdp__module_grow(void **arr, size_t *cap, size_t n, size_t es);

/* Error on m's context prefixed with the module's type ("Linear: ..."); returns rc. */
int fsdp__module_err(const fsdp_module_t *m, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* Checks a forward's arity: min_in <= nin <= max_in (max_in < 0: no limit), in[0..min_in)
 * non-NULL, nout == want_out. FSDP_EINVAL naming the module type otherwise. */
int fsdp__module_check_io(const fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int min_in,
                          int max_in, int nout, int want_out);

/* The i-th own parameter / buffer tensor in registration order (borrowed; NULL out of range). */
fsdp_tensor_t *fsdp__module_param_at(const fsdp_module_t *m, size_t i);
fsdp_tensor_t *fsdp__module_buffer_at(const fsdp_module_t *m, size_t i);

/* Listing internals shared by module_list.c and state_dict.c. */
enum fsdp__list_what {
    FSDP__LIST_PARAMS = 0,
    FSDP__LIST_BUFFERS,
    FSDP__LIST_STATE /* each module's parameters, then its persistent buffers (PyTorch order) */
};
/* Builds a tensor listing of m's tree in pre-order. with_aliases: every path and every name;
 * otherwise shared modules and tensors once. Tensors are borrowed (out->owned false). */
int fsdp__module_list(const fsdp_module_t *m, enum fsdp__list_what what, bool with_aliases,
                      fsdp_named_list_t *out);
/* Appends one entry to a listing (name copied; t retained when list->owned). */
int fsdp__list_push(fsdp_named_list_t *list, size_t *cap, const char *name, fsdp_tensor_t *t,
                    fsdp_module_t *m);

#endif /* FSDP_NN_IMPL_H */
