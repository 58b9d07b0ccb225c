/* SPDX-License-Identifier: MIT */
/*
 * ddp_impl.h: the DDP wrapper inside, shared by ddp.c (rounds: hooks, launches, the final
 * callback, the public calls) and ddp_build.c (creation: the ignore list, the cross-rank check,
 * module-state broadcasts, bucket assignment and buffers). The semantics are in fsdp/ddp.h.
 *
 * Invariants:
 *   - params[] holds the bucketed parameters (trainable, not ignored, each once) in reverse
 *     registration order, the bucketing order; each bucket's idx[] is increasing, so a flat
 *     buffer holds its parameters in that order.
 *   - ign[] holds copies of the option's names (nign of them); opt.parameters_to_ignore points
 *     at it, never at the caller's array.
 *   - Under static_graph, `frozen` is set once the first synced backward has completed: from
 *     then on used_host holds that backward's all-reduced used map and is never rewritten, and
 *     each parameter's first_hooks/first_used hold what this rank saw in it.
 */
#ifndef FSDP_DDP_IMPL_H
#define FSDP_DDP_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/ddp.h>

struct ddp_param {
    fsdp_ddp_t *d;
    fsdp_tensor_t *t; /* retained */
    char *name;       /* fully qualified name */
    size_t bucket;
    int64_t offset;      /* first element in the bucket's flat buffer */
    fsdp_tensor_t *view; /* of the flat buffer, shaped like t; NULL at world size 1 */
    bool hooked;
    bool ready; /* complete for this round (static_graph: also when it had no hook in round 1) */
    bool used;  /* it got a gradient since the last synced backward */
    uint32_t hooks;       /* its hook fired this many times in this synced backward */
    uint32_t first_hooks; /* static_graph: hooks in the first synced backward */
    bool first_used;      /* static_graph: `used` at the end of the first synced backward */
};

struct ddp_bucket {
    fsdp_dtype_t dt;
    size_t n;
    size_t *idx; /* n indices into params, increasing */
    int64_t numel;
    size_t bytes;
    size_t nready;
    fsdp_tensor_t *flat; /* numel elements, FSDP_MEM_COMM; NULL at world size 1 */
    fsdp_work_t *work;   /* outstanding all-reduce, or NULL */
};

struct fsdp_ddp {
    int refs;
    bool alive;
    fsdp_ctx_t *ctx;
    fsdp_module_t *m;
    fsdp_pg_t *pg; /* NULL for a world of one without a group */
    int rank, world;
    fsdp_ddp_options_t opt;
    char **ign; /* nign copied names of parameters_to_ignore */
    size_t nign;
    bool sync;
    bool require_forward_param_sync; /* PyTorch's flag: broadcast buffers before the forward */
    bool armed;
    bool cb_queued;
    bool frozen; /* static_graph: the first synced backward is done (see the top) */
    size_t nparams;
    struct ddp_param *params;
    size_t nbuckets;
    struct ddp_bucket *buckets;
    size_t next_launch;
    fsdp_tensor_t *used_flags; /* i32 (nparams) on the parameters' device; world > 1 */
    int32_t *used_host;        /* nparams */
    fsdp_work_t *used_work;
    /* static_graph: the first parameter whose hook fired in this synced backward more often
     * than in the first one (SIZE_MAX: none); its count then. */
    size_t extra_hook;
    uint32_t extra_count;
    /* This round's counts, and the totals reported by fsdp_ddp_get_stats. */
    uint64_t calls, bytes, early;
    fsdp_ddp_stats_t stats;
};

/* ddp_build.c. Each returns 0 or a negative status with the message on d->ctx. */

/* Copies o's ignore list into d (names checked later, against the module). */
int fsdp__ddp_copy_ignore(fsdp_ddp_t *d, const fsdp_ddp_options_t *o);

/* Everything fsdp_ddp_create does once the options are checked and d->pg, rank and world are
 * set: lists the module, checks the ignore list, verifies the model across ranks, broadcasts
 * the module states when asked, fills params[] and the buckets, allocates the flat buffers and
 * fills the static parts of d->stats. `hook` is the wrapper's grad hook: a parameter that has it
 * already belongs to another wrapper. Hooks are added by the caller. On failure the caller frees
 * what was built (fsdp__ddp_free_build). */
int fsdp__ddp_build(fsdp_ddp_t *d, fsdp_grad_hook_fn hook);

/* Frees what fsdp__ddp_build and fsdp__ddp_copy_ignore made (params, buckets, buffers, names);
 * the caller has removed the hooks and waited for outstanding works. */
void fsdp__ddp_free_build(fsdp_ddp_t *d);

/* Broadcasts from rank 0 every buffer of the module that is not ignored (blocking). */
int fsdp__ddp_bcast_buffers(fsdp_ddp_t *d);

#endif /* FSDP_DDP_IMPL_H */
