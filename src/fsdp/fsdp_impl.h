/*
 * fsdp_impl.h: FSDP units inside: the flat layout and the unit structure.
 *
 * Objects of one unit:
 *   flat   1-D leaf over the local shard storage (shard_numel elements, padded); the optimizer's
 *          tensor without use_orig_params; .grad is the sharded gradient.
 *   full   1-D tensor over the unsharded storage (padded_numel elements); the storage is freed
 *          (resized to 0) while the unit is sharded. For NO_SHARD without CPU offload, full and
 *          flat share the storage and nothing is ever gathered. With CPU offload, flat and its
 *          gradient are in host memory (FSDP_MEM_OFFLOAD) and full is always separate.
 *   cv[i]  compute views: leaves with the original shapes at their offsets in full. The
 *          module's parameter slots point at them while the unit runs, so autograd saves and
 *          differentiates them; their .grad are views into the unsharded flat gradient.
 *   orig   the user's parameter objects, re-pointed at 1-D views of their part of the shard.
 *
 * Devices: full, the compute views, the unsharded gradient and the reduction buffers are on
 * `dev` (the compute device: options.device, or where the parameters were). flat and orig are
 * on `dev` too, except with CPU offload, where they stay on `host_dev` (the host device the
 * parameters were on at wrap; it may be another device object than `dev` even on a CPU-only
 * build) and every copy between the two goes through fsdp.c's cross-device copy.
 *
 * Invariants: a module slot holds cv[i] exactly while the unit is in forward (or summoned),
 * orig[i] otherwise; full has bytes iff `unsharded`; an outstanding all-gather (`ag_work`)
 * writes into full, so full is not read before it completed.
 */
#ifndef FSDP_FSDP_IMPL_H
#define FSDP_FSDP_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include <fsdp/fsdp.h>

/* ---- the flat layout (flat_param.c) ----------------------------------------------------------- */

typedef struct fsdp__layout {
    int n;                  /* parameters */
    int64_t *numel;         /* per parameter */
    int64_t *offset;        /* first element in the unsharded flat parameter */
    int64_t unpadded_numel; /* with alignment padding (and, aligned, the world padding) */
    int64_t padded_numel;   /* shard_numel * world */
    int64_t shard_numel;    /* ceil(unpadded_numel / world) */
    int world;
} fsdp__layout_t;

/* PyTorch's flat layout: parameters in order; with align_numel > 1 each parameter starts at a
 * multiple of align_numel and the total is padded to a multiple of world. Returns FSDP_ENOMEM
 * or FSDP_OK; free with fsdp__layout_free. */
int fsdp__layout_build(int n, const int64_t *numel, int align_numel, int world,
                       fsdp__layout_t *out);
void fsdp__layout_free(fsdp__layout_t *l);

/* The part of parameter i that rank holds (PyTorch's _ShardParamInfo). */
typedef struct fsdp__shard_info {
    bool in_shard;
    int64_t offset_in_shard;
    int64_t numel_in_shard;
    int64_t intra_start;
} fsdp__shard_info_t;
void fsdp__layout_shard_info(const fsdp__layout_t *l, int i, int rank, fsdp__shard_info_t *out);

/* PyTorch's split of the world size into gradient pre- and post-divide factors. */
void fsdp__divide_factors(int world, double *pre, double *post);

/* ---- units (fsdp.c) --------------------------------------------------------------------------- */

struct fsdp__param {
    char *fqn;             /* under the unit's module */
    fsdp_tensor_t *orig;   /* the user's object (reference) */
    fsdp_tensor_t *cv;     /* compute view into full (reference) */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    fsdp__shard_info_t sh;
};

/* A module slot that holds a managed parameter. */
struct fsdp__slotref {
    fsdp_module_t *m; /* borrowed: the tree holds it */
    size_t slot;
    int param;        /* index into params */
};

struct fsdp_unit {
    fsdp_ctx_t *ctx;
    fsdp_module_t *module;       /* reference */
    char *fqn;                   /* under the root's module ("" for the root) */
    fsdp_options_t opt;          /* copied (ignored list and wrap types not kept) */
    fsdp_pg_t *pg;               /* borrowed */
    fsdp_pg_t *replicate_pg;     /* hybrid strategies: borrowed; else NULL */
    fsdp_device_t *dev;          /* compute device (borrowed) */
    int rank, world;
    struct fsdp_unit *parent;    /* NULL for the root */
    struct fsdp_unit **children; /* direct child units, in pre-order */
    size_t nchildren, capchildren;
    int hook_handles[4];         /* forward pre, forward, backward pre, backward */
    fsdp_module_t **ignored;     /* ignored modules (borrowed: inside the tree) */
    size_t nignored;

    /* flat parameter (absent when nparams == 0) */
    int nparams;
    struct fsdp__param *params;
    struct fsdp__slotref *slots;
    size_t nslots;
    fsdp__layout_t layout;
    fsdp_dtype_t dt;             /* the parameters' (and the flat shard's) dtype */
    fsdp_dtype_t cdt;            /* compute dtype: of full, the compute views and their grads */
    fsdp_dtype_t rdt;            /* reduction dtype */
    fsdp_tensor_t *flat;         /* local shard leaf */
    fsdp_tensor_t *full;         /* unsharded flat parameter */
    fsdp_tensor_t *full_grad;    /* unsharded flat gradient while backward runs, else NULL */
    bool unsharded;
    fsdp_work_t *ag_work;        /* outstanding all-gather into full */
    fsdp_tensor_t *staging;      /* CPU offload: the shard on the device while it is gathered */
    fsdp_device_t *host_dev;     /* CPU offload: where flat and its gradient live (borrowed) */
    bool prefetched;

    /* runtime state */
    fsdp_training_state_t state;
    bool is_root;
    bool slots_swapped;          /* module slots hold the compute views */
    int fwd_invocations;         /* forward invocations recorded on the tape this iteration */
    int bwd_pending;             /* entry marks still to come in this backward */
    bool needs_pre_backward;     /* ran forward with grad; pre-backward not yet done */
    bool post_backward_done;
    fsdp_summon_options_t summon; /* of the summon in progress */
    bool was_unsharded;          /* before the summon */
    bool summon_this_call;       /* summoned by the fsdp_summon_begin running now */
    fsdp_tensor_t *summon_host;  /* offload_to_cpu: host copy of the full parameters */
    fsdp_tensor_t **summon_views; /* per parameter, views the slots hold (offload_to_cpu) */
    /* outstanding gradient reduction */
    fsdp_work_t *rs_work;
    fsdp_tensor_t *rs_in;        /* what the reduction reads (the padded flat gradient) */
    fsdp_tensor_t *rs_out;       /* where it writes (the new shard) */
    fsdp_work_t *ar_work;        /* all-reduce (NO_SHARD, or across replicas) */
    double post_divide;

    /* root only */
    bool initialized;            /* lazy init done */
    struct fsdp_unit **all;      /* every unit of the tree, pre-order */
    size_t nall, capall;
    struct fsdp_unit **fwd_order; /* pre-forward order of the first iteration */
    size_t nfwd, capfwd;
    bool fwd_order_done;
    size_t fwd_pos;              /* units pre-forwarded in this iteration */
    bool order_warned;
    struct fsdp_unit **post_order; /* post-forward order of this iteration */
    size_t npost, cappost;
    bool cb_queued;              /* final callback queued in this backward */
    struct fsdp_unit **ag_queue; /* units with an outstanding all-gather, oldest first */
    size_t nag, capag;
    struct fsdp_unit **red_queue; /* units with a gradient reduction in flight, oldest first */
    size_t nred, capred;

    fsdp_unit_stats_t stats;
};

/* Moves t's elements to dev keeping the tensor object (PyTorch's `t.data = t.data.to(dev)`):
 * new storage on dev in t's memory category, a copy, t re-pointed at it; t's gradient moves
 * too. Storage t shared with other tensors stays where it was for them. A no-op when t is on
 * dev already; FSDP_EINVAL for a device of another context. fsdp_wrap uses it for
 * options.device; tests use it to move a parameter after wrapping (PyTorch's `.cuda()` after
 * FSDP(...), which the public API has no counterpart of). */
int fsdp__tensor_move(fsdp_tensor_t *t, fsdp_device_t *dev);

/* Per-rank FSDP state hung on the context: units by module, the root's iteration state. */
struct fsdp__rank {
    struct fsdp__entry {
        fsdp_module_t *m;
        fsdp_unit_t *u;
    } *units;
    size_t n, cap;
};

#endif /* FSDP_FSDP_IMPL_H */
