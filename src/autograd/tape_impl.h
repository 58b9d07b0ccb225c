/* SPDX-License-Identifier: MIT */
/*
 * tape_impl.h: the tape inside, shared by the files of src/autograd/ only: tape.c (the tape,
 * grad mode, recording), backward.c (the engine) and checkpoint.c (recompute regions).
 *
 * A context has one root tape (ctx->tape, made on first use). While a recompute region runs its
 * forward again inside a backward, ctx->tape is a child tape whose parent is the tape being
 * differentiated; the child is destroyed when the region's backward is done.
 *
 * Invariants:
 *   - e[0..n) is in recording order, which is a topological order of the graph.
 *   - A non-leaf tensor recorded on t has slot < t->nslots and tape_gen == t->gen (live_slot).
 *     Every reset (after a backward, fsdp_tape_clear) takes a new generation, so tensors of the
 *     old graph are recognised instead of read through a dangling slot.
 *   - An entry's node is NULL once its backward has run; its mark stays until the reset.
 *   - Final callbacks are queued on the root tape only, and only while in_backward.
 */
#ifndef FSDP_AUTOGRAD_TAPE_IMPL_H
#define FSDP_AUTOGRAD_TAPE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

enum entry_kind { ENTRY_NODE = 0, ENTRY_MARK };

/* A mark: fn runs when backward reaches it, told whether any of ts got a gradient. */
struct mark {
    char *label; /* owned */
    int n;
    fsdp_tensor_t **ts; /* owned references */
    fsdp_mark_fn fn;
    void *arg;
    void (*arg_free)(void *arg); /* frees arg when the mark is dropped; may be NULL */
};

struct entry {
    enum entry_kind kind;    /* which of node and mark the entry holds (owned) */
    struct fsdp__node *node; /* NULL once its backward has run */
    struct mark *mark;
};

struct callback {
    fsdp_callback_fn fn;
    void *arg;
};

struct fsdp_tape {
    fsdp_ctx_t *ctx;
    struct fsdp_tape *parent; /* the tape a recompute region was pushed over, else NULL */
    struct entry *e;          /* n entries in recording order, cap allocated */
    size_t n, cap;
    int64_t nslots; /* slots given out since the last reset */
    uint64_t gen;   /* this tape's generation, new at every reset */
    bool grad_enabled;
    bool in_backward;
    int region_depth;     /* recompute regions whose first (unrecorded) run is under way */
    struct callback *cbs; /* final callbacks (root tape only) */
    size_t ncbs, capcbs;
};

/* Frees a node and drops what it holds (saved tensors, leaf references, extra). NULL is fine. */
void fsdp__node_free(struct fsdp__node *n);
/* Drops every entry, newest first, and starts a new generation. */
void fsdp__tape_reset(struct fsdp_tape *t);
/* A new empty tape with grad mode on (NULL when out of memory); parent NULL for a root tape. */
struct fsdp_tape *fsdp__tape_new(fsdp_ctx_t *ctx, struct fsdp_tape *parent);
/* Resets and frees t (NULL is fine). */
void fsdp__tape_destroy(struct fsdp_tape *t);
/* The context's tape, created on first use (NULL only when memory runs out, or ctx is NULL). */
struct fsdp_tape *fsdp__get_tape(fsdp_ctx_t *ctx);
/* Whether t has a live slot on tape. */
bool fsdp__live_slot(const struct fsdp_tape *tape, const fsdp_tensor_t *t);
/* Tells the tensor layer which category new tensors count in: gradients while this rank runs
 * backward (on any tape of the chain), activations otherwise. Called whenever that changes. */
void fsdp__sync_tensor_cat(fsdp_ctx_t *ctx);

#endif /* FSDP_AUTOGRAD_TAPE_IMPL_H */
