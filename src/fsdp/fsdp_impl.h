/* SPDX-License-Identifier: MIT */
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
 * build) and every copy between the two goes through unshard.c's cross-device copy.
 *
 * Files, along a unit's life: flat_param.c (the flat layout); policy.c and plan.c (auto-wrap
 * policies, wrap plans, wrap-time validation); wrap.c (options, collecting, fsdp_wrap with its
 * policy-driven and manual forms, fsdp_fully_shard, fsdp_unit_options); flatten.c (the flat
 * parameter, sync_module_states, moves to options.device);
 * hooks.c (the runtime the module hooks drive: lazy init, the execution order, prefetch, the
 * final callback); unshard.c (cross-device copies, staging the shard, all-gather, reshard,
 * module slots); grads.c (the unsharded gradient, reduction, no_sync, clip_grad_norm);
 * precision.c (every dtype change of mixed precision); streams.c (the copy and side streams,
 * stream-ordered waits, deferred releases); state_dict.c, optim_state.c and optim_full.c (the
 * state dicts);
 * summon.c (navigation and listings, summons,
 * explicit unshard); writeback.c (changed original parameters back into the shard); unit.c
 * (the per-rank registry, trees of units, destroy). Functions one of them defines and another
 * uses are declared below, grouped by the defining file.
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

/* ---- the flat layout (flat_param.c) -----------------------------------------------------------
 */

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

/* ---- units ----------------------------------------------------------------------------------- */

struct fsdp__param {
    char *fqn;           /* under the unit's module */
    fsdp_tensor_t *orig; /* the user's object (reference) */
    fsdp_tensor_t *cv;   /* compute view into full (reference) */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    fsdp__shard_info_t sh;
};

/* A module slot that holds a managed parameter. */
struct fsdp__slotref {
    fsdp_module_t *m; /* borrowed: the tree holds it */
    size_t slot;
    int param; /* index into params */
};

struct fsdp_unit {
    fsdp_ctx_t *ctx;
    fsdp_module_t *module;   /* reference */
    char *fqn;               /* under the root's module ("" for the root) */
    fsdp_options_t opt;      /* copied; ignored_modules points at `ignored`, no policy */
    fsdp_pg_t *pg;           /* borrowed */
    fsdp_pg_t *replicate_pg; /* hybrid strategies: borrowed; else NULL */
    fsdp_device_t *dev;      /* compute device (borrowed) */
    int rank, world;
    fsdp_state_dict_type_t sd_type;         /* root: fsdp_set_state_dict_type's (FULL) */
    fsdp_full_state_dict_options_t sd_full; /* root: the FULL type's options (initialised) */
    struct fsdp_unit *parent;               /* NULL for the root */
    struct fsdp_unit **children;            /* direct child units, in pre-order */
    size_t nchildren, capchildren;
    int hook_handles[4];     /* forward pre, forward, backward pre, backward */
    fsdp_module_t **ignored; /* ignored modules (borrowed: inside the tree) */
    size_t nignored;

    /* flat parameter (absent when nparams == 0) */
    int nparams;
    struct fsdp__param *params;
    struct fsdp__slotref *slots;
    size_t nslots;
    fsdp__layout_t layout;
    fsdp_dtype_t dt;  /* the parameters' (and the flat shard's) dtype */
    fsdp_dtype_t cdt; /* compute dtype: of full, the compute views and their grads */
    fsdp_dtype_t rdt; /* reduction dtype */
    /* Mixed precision as configured; cdt and rdt are these except while full precision is
     * forced (full_prec: use_full_prec_in_eval in eval), when both are dt. */
    fsdp_dtype_t mp_cdt, mp_rdt;
    bool full_prec;
    /* FSDP_SKIP_WRITEBACK_CHECK=1 at wrap: original parameters are not checked for changes. */
    bool skip_writeback_check;
    /* The floating buffers the unit cast to buffer_dtype at lazy init, with their dtype from
     * before (what full precision in eval restores). */
    struct fsdp__mp_buffer {
        fsdp_module_t *m; /* borrowed: in the tree */
        size_t slot;
        fsdp_dtype_t orig;
    } * mp_bufs;
    size_t nmp_bufs;
    /* Made full-precision by the mixed-precision rule (module_classes_to_ignore): floating
     * inputs are cast to dt before the module runs and its floating outputs back to the dtype
     * of the last floating input (io_dt, -1 when none) after it, as upstream's hooks do. */
    bool cast_io;
    int io_dt;
    fsdp_tensor_t *flat;       /* local shard leaf */
    fsdp_tensor_t *full;       /* unsharded flat parameter */
    fsdp_tensor_t *full_grad;  /* unsharded flat gradient while backward runs, else NULL */
    bool full_grad_fresh;      /* full_grad is new and unzeroed: fsdp__settle_grads zeroes
                                * what backward did not write */
    fsdp_tensor_t *local_grad; /* no_sync: the unsharded gradient accumulated, not reduced */
    bool unsharded;
    fsdp_work_t *ag_work;    /* outstanding all-gather into full */
    fsdp_device_t *host_dev; /* CPU offload: where flat and its gradient live (borrowed) */
    /* CPU offload from the compute device's host memory: the H2D copies of the shard run on
     * copy_stream (of copy_dev, created at the first one); ev[0] orders it after the compute
     * stream's earlier work (reused memory), ev[1] the compute stream after the copy. */
    fsdp_device_t *copy_dev;
    fsdp_stream_t *copy_stream;
    fsdp_event_t *copy_ev[2];
    bool prefetched;

    /* runtime state */
    fsdp_training_state_t state;
    bool is_root;
    bool slots_swapped;      /* module slots hold the compute views */
    int fwd_invocations;     /* forward invocations recorded on the tape this iteration */
    int bwd_pending;         /* entry marks still to come in this backward */
    bool needs_pre_backward; /* ran forward with grad; pre-backward not yet done */
    bool needs_recompute;    /* ran in a recompute region's first run; not re-run yet */
    bool post_backward_done;
    fsdp_summon_options_t summon; /* of the summon in progress */
    bool was_unsharded;           /* before the summon */
    bool summon_this_call;        /* summoned by the fsdp_summon_begin running now */
    fsdp_tensor_t *summon_host;   /* offload_to_cpu: host copy of the full parameters */
    fsdp_tensor_t **summon_views; /* per parameter, views the slots hold (offload_to_cpu) */
    /* outstanding gradient reduction */
    fsdp_work_t *rs_work;
    fsdp_tensor_t *rs_in;  /* what the reduction reads (the padded flat gradient) */
    fsdp_tensor_t *rs_out; /* where it writes (the new shard) */
    fsdp_work_t *ar_work;  /* all-reduce (NO_SHARD, or across replicas) */
    double post_divide;
    /* Stream-ordered waits (a compute device with a compute stream; docs/design.md): buffers a
     * collective read (the reduction's input), each released once an
     * event recorded on the compute stream after the collective's stream wait has completed;
     * oldest first. stream_waited: a collective of u was waited on the stream since the last
     * end of backward, which then synchronizes u's groups to report a late failure. */
    struct fsdp__deferred {
        fsdp_tensor_t *t;
        fsdp_event_t *ev;
    } * deferred;
    size_t ndeferred, capdeferred;
    bool stream_waited;
    /* The stream u's collectives are issued on (of side_dev, created at the first one; see
     * streams.c's fsdp__side_stream) and the event that orders it after the compute stream. */
    fsdp_device_t *side_dev;
    fsdp_stream_t *side;
    fsdp_event_t *side_ev;
    bool full_on_ag; /* full's memory came from the root's all-gather stream pool */

    /* root only */
    bool initialized;       /* lazy init done */
    bool full_prec_in_eval; /* options.use_full_prec_in_eval or the environment, at wrap */
    struct fsdp_unit **all; /* every unit of the tree, pre-order */
    size_t nall, capall;
    struct fsdp_unit **fwd_order; /* pre-forward order of the first iteration */
    size_t nfwd, capfwd;
    bool fwd_order_done;
    size_t fwd_pos; /* units pre-forwarded in this iteration */
    bool order_warned;
    struct fsdp_unit **post_order; /* post-forward order of this iteration */
    size_t npost, cappost;
    bool cb_queued;              /* final callback queued in this backward */
    bool no_sync;                /* between fsdp_no_sync_begin and _end */
    struct fsdp_unit **ag_queue; /* units with an outstanding all-gather, oldest first */
    size_t nag, capag;
    /* Root only, on devices with a compute stream: an event recorded on the compute stream at
     * each reshard of a unit of the tree, oldest first (PyTorch's free-event queue); the rate
     * limiter makes the host wait for the oldest before issuing an all-gather beyond the limit
     * (fsdp__unshard_issue), so the host never runs more than that many reshards ahead of the
     * device. */
    struct fsdp_event **free_ev;
    size_t nfree_ev, capfree_ev;
    /* Root only, on a device with stream pools (streams.c, "the all-gather stream"): the stream
     * the tree's all-gathers of a forward and backward are staged and issued on, into unsharded
     * parameters from its own pool (of ag_dev), ordered after the compute stream once per
     * iteration at the root's pre-forward (ag_ev), as PyTorch's unshard stream is. ag_ordered:
     * from that point to the end of the iteration; at other times all-gathers go through the
     * side stream. */
    fsdp_device_t *ag_dev;
    fsdp_stream_t *ag_stream;
    fsdp_event_t *ag_ev;
    bool ag_ordered;
    struct fsdp_unit **red_queue; /* units with a gradient reduction in flight, oldest first */
    size_t nred, capred;

    fsdp_unit_stats_t stats;
};

/* Per-rank FSDP state hung on the context: units by module, the root's iteration state. */
struct fsdp__rank {
    struct fsdp__entry {
        fsdp_module_t *m;
        fsdp_unit_t *u;
    } * units;
    size_t n, cap;
};

/* ---- defined in unit.c ----------------------------------------------------------------------- */

/* Whether strategy s shards the parameters (every strategy but NO_SHARD). */
bool fsdp__is_sharded(fsdp_sharding_strategy_t s);
/* Whether u's unsharded flat parameter has storage of its own (gathered, then freed). */
bool fsdp__separate_full(const fsdp_unit_t *u);
/* Sets the context's error to fmt, prefixed with u's name and rank; returns rc. */
int fsdp__unit_err(const fsdp_unit_t *u, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
/* Adds u to its context's per-rank registry under u->module (fsdp_unit_of finds it). */
int fsdp__registry_add(fsdp_unit_t *u);
/* The unit that manages t as an original parameter (its index in *index), or NULL. */
fsdp_unit_t *fsdp__owner_of_param(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, int *index);
/* The root of u's tree. */
fsdp_unit_t *fsdp__root_of(fsdp_unit_t *u);
/* A 1-D view of n elements of base starting at element off (relative to base's offset). */
int fsdp__view1d(fsdp_tensor_t *base, int64_t off, int64_t n, fsdp_tensor_t **out);
/* A zeroed contiguous 1-D tensor of n elements of dt on dev, in memory category cat. */
int fsdp__zeros_on(fsdp_unit_t *u, fsdp_device_t *dev, fsdp_dtype_t dt, int64_t n,
                   fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* Appends u to the growing array *arr (*n used, *cap allocated); FSDP_ENOMEM when it cannot. */
int fsdp__push_unit(fsdp_unit_t ***arr, size_t *n, size_t *cap, fsdp_unit_t *u);
/* Appends u and the units below it, in pre-order, to the growing array *arr (*n used, *cap). */
int fsdp__collect_units(fsdp_unit_t *u, fsdp_unit_t ***arr, size_t *n, size_t *cap);
/* Whether m is one of the modules u was told to ignore. */
bool fsdp__unit_ignores(const fsdp_unit_t *u, const fsdp_module_t *m);
/* u's name in messages: its FQN, or "<root>". */
const char *fsdp__unit_label(const fsdp_unit_t *u);
/* Frees u without communicating: slots restored, hooks removed, out of the registry. */
void fsdp__unit_free(fsdp_unit_t *u);

/* ---- defined in unshard.c -------------------------------------------------------------------- */

/* dst = src where the two may be on different devices: the one cross-device copy of FSDP. */
int fsdp__xcopy(fsdp_tensor_t *dst, const fsdp_tensor_t *src);
/* Points u's module slots at the compute views (to_cv) or back at the original objects. */
void fsdp__swap_slots(fsdp_unit_t *u, bool to_cv);
/* Starts gathering u's parameters (asynchronously; prefetch counts it as a prefetch); a no-op
 * when they are unsharded or on their way. Respects the limit on outstanding all-gathers. */
int fsdp__unshard_issue(fsdp_unit_t *u, bool prefetch);
/* Makes u's unsharded flat parameter available (all-gather, then wait); a no-op if it is. */
int fsdp__unshard(fsdp_unit_t *u);
/* Waits for u's all-gather, then frees full when it has storage of its own; no-op if sharded. */
int fsdp__reshard(fsdp_unit_t *u);

/* ---- defined in grads.c ---------------------------------------------------------------------- */

/* Whether u's flat parameter requires a gradient (some parameter of u does). */
bool fsdp__any_requires_grad(const fsdp_unit_t *u);
/* Before u's backward: the unsharded flat gradient (zeroed, or the one kept under no_sync), and
 * each compute view's .grad a view into it. */
int fsdp__prepare_grads(fsdp_unit_t *u);
/* Drops the .grad of u's compute views. */
void fsdp__drop_cv_grads(fsdp_unit_t *u);
/* After u's backward, before its unsharded gradient is read: zeroes what backward did not write
 * in a new one (full_grad_fresh), then drops the compute views' .grad. */
int fsdp__settle_grads(fsdp_unit_t *u);
/* Starts the reduction of u's unsharded gradient (asynchronous). */
int fsdp__reduce_grad(fsdp_unit_t *u);
/* Lists u's reduction (just started) on its root and finishes the oldest beyond the bound. */
int fsdp__track_reduction(fsdp_unit_t *u);
/* Waits for u's reduction and adds the result into the flat parameter's gradient. */
int fsdp__finish_reduction(fsdp_unit_t *u);
/* With use_orig_params: drops the flat gradient when every original gradient was set to none. */
void fsdp__drop_cleared_flat_grad(fsdp_unit_t *u);

/* ---- defined in precision.c ------------------------------------------------------------------ */

/* Sets u's compute dtype (cdt: param_dtype, else the parameters') and reduction dtype (rdt:
 * reduce_dtype, else cdt) from its mixed-precision options. */
void fsdp__mp_set_dtypes(fsdp_unit_t *u);
/* dst = src in dst's dtype, on one device: the shard's copy in the compute dtype. */
int fsdp__mp_cast_shard(fsdp_tensor_t *dst, const fsdp_tensor_t *src);
/* Casts the floating buffers of the modules u manages (m and below, outside nested units and
 * ignored modules; top: m is u's own module) to buffer_dtype, replacing them in their slots. */
int fsdp__mp_cast_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top);
/* A unit kept in full precision (u->cast_io): remembers the dtype of its last floating input,
 * then casts the floating inputs to the parameters' dtype. */
int fsdp__mp_cast_io_inputs(fsdp_unit_t *u, int nin, fsdp_tensor_t **in);
/* A unit kept in full precision: its floating outputs back to its inputs' dtype. */
int fsdp__mp_cast_io_outputs(fsdp_unit_t *u, int nout, fsdp_tensor_t **out);
/* Forward inputs to param_dtype (cast_forward_inputs; cast_root_forward_inputs at the root). */
int fsdp__mp_cast_forward_inputs(fsdp_unit_t *u, bool is_root, int nin, fsdp_tensor_t **in);
/* Before a forward of u's tree (the root's pre-forward): each unit with mixed precision runs
 * in full precision when the root's full_prec_in_eval is on and its module is in eval mode, in
 * its configured precision otherwise; a unit that changes is resharded and its unsharded
 * parameter and compute views change dtype, and its buffers change dtype with it. */
int fsdp__mp_select(fsdp_unit_t *root);
/* Whether the root's option or FSDP_USE_FULL_PREC_IN_EVAL asks for full precision in eval. */
bool fsdp__mp_full_prec_in_eval(const fsdp_options_t *o);
/* Frees what precision.c keeps on u. */
void fsdp__mp_free(fsdp_unit_t *u);
/* The unsharded gradient *g in the reduction dtype (*g replaced, the old one released). */
int fsdp__mp_grad_for_reduce(fsdp_unit_t *u, fsdp_tensor_t **g);
/* The sharded gradient's dtype: the parameters', or with keep_low_precision_grads the current
 * compute dtype (the parameters' too while full precision is forced). */
fsdp_dtype_t fsdp__mp_grad_dtype(const fsdp_unit_t *u);
/* The reduced gradient *g in the sharded gradient's dtype (the parameters', or param_dtype with
 * keep_low_precision_grads), where the optimizer runs (the host with CPU offload); *g is
 * replaced (the old one released), and NULL on failure. */
int fsdp__mp_grad_for_param(fsdp_unit_t *u, fsdp_tensor_t **g);

/* ---- defined in streams.c -------------------------------------------------------------------- */

/* The unit's copy stream and its two events, made (or remade after a move) on u->dev. */
int fsdp__copy_stream_ready(fsdp_unit_t *u);
/* Waits for one of u's collectives: on the compute stream when u's device has one, else on the
 * host. A buffer the collective read is then released only through fsdp__release_after. */
int fsdp__unit_wait(fsdp_unit_t *u, fsdp_work_t *w);
/* Releases u's deferred buffers whose event has completed (wait: waiting for each). */
int fsdp__reap_deferred(fsdp_unit_t *u, bool wait);
/* Non-blocking: releases what the compute stream has finished with in u's whole tree. */
void fsdp__reap_tree(fsdp_unit_t *u);
/* Releases t (may be NULL) once the compute stream has passed this point. */
int fsdp__release_after(fsdp_unit_t *u, fsdp_tensor_t *t);
/* The stream u's next collective is issued on (its descriptor's stream): u's side stream,
 * ordered after the compute stream's work so far; NULL without a compute stream. */
int fsdp__side_stream(fsdp_unit_t *u, void **stream);
/* The all-gather stream (streams.c): at the root's pre-forward, orders it after the compute
 * stream's work so far, creating it on first use (a no-op on a device without stream pools, or
 * with FSDP_AG_STREAM=0 in the environment); and again wherever the shard is written inside an
 * iteration (a writeback of replaced parameters). */
int fsdp__ag_stream_begin(fsdp_unit_t *root);
/* Ends the iteration's ordering: later all-gathers go through the side stream. */
void fsdp__ag_stream_end(fsdp_unit_t *root);
/* The stream u's next all-gather is staged and issued on, with full allocated from its pool, or
 * NULL: the side stream, with full from the compute stream's pool. */
fsdp_stream_t *fsdp__ag_stream(fsdp_unit_t *u);
/* unshard.c: at teardown, frees an unsharded parameter from the all-gather stream's pool after
 * marking its use by the compute stream. */
void fsdp__unshard_free(fsdp_unit_t *u);
/* The message of a failed wait for w: its own failure, or a late failure of its group. */
const char *fsdp__wait_error(fsdp_pg_t *pg, fsdp_work_t *w);
/* Frees u's streams, events and deferred buffers (waiting for the device first). */
void fsdp__unit_streams_free(fsdp_unit_t *u);

/* ---- defined in hooks.c ---------------------------------------------------------------------- */

/* The unit's forward pre-hook (arg is the unit): unshard, slots to the compute views. */
int fsdp__forward_pre_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in);
/* The unit's forward hook: slots back to the original objects, reshard unless kept. */
int fsdp__forward_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out);
/* The unit's backward pre-hook (exit mark): unshard, prefetch, the unsharded gradient. */
int fsdp__backward_pre_hook(fsdp_module_t *m, void *arg, bool has_grad);
/* The unit's backward hook (entry mark): reshard, prefetch, start the gradient reduction. */
int fsdp__backward_hook(fsdp_module_t *m, void *arg, bool has_grad);

/* ---- defined in flatten.c -------------------------------------------------------------------- */

/* sync_module_states: rank 0's values of every managed parameter and every buffer of m's subtree
 * (outside nested units and ignored modules; top: m is u's own module). */
int fsdp__sync_states(fsdp_unit_t *u, fsdp_module_t *m, bool top);
/* Moves the buffers of the modules u manages (m and below) to dev, keeping each object. */
int fsdp__move_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top, fsdp_device_t *dev);
/* Builds the flat parameter and its views from the collected parameters. */
int fsdp__flatten(fsdp_unit_t *u);
/* A unit adopted by a wrap with options.device takes that device unless its own option is set,
 * and so do the units below it. */
int fsdp__inherit_device(fsdp_unit_t *c, fsdp_device_t *dev);
/* Points t (keeping the object) at src's elements, src's device included (t keeps its own on
 * failure). */
int fsdp__repoint(fsdp_tensor_t *t, fsdp_tensor_t *src);
/* The flat parameter requires a gradient when one of u's original parameters does. */
void fsdp__flat_requires_grad(fsdp_unit_t *u);
/* Moves t's elements to dev keeping the tensor object (PyTorch's `t.data = t.data.to(dev)`):
 * new storage on dev in t's memory category, a copy, t re-pointed at it; t's gradient moves
 * too. Storage t shared with other tensors stays where it was for them. A no-op when t is on
 * dev already; FSDP_EINVAL for a device of another context. fsdp_wrap uses it for
 * options.device; tests use it to move a parameter after wrapping (PyTorch's `.cuda()` after
 * FSDP(...), which the public API has no counterpart of). */
int fsdp__tensor_move(fsdp_tensor_t *t, fsdp_device_t *dev);

/* ---- defined in wrap.c ----------------------------------------------------------------------- */

/* prefix.name, or name when prefix is empty; malloc'd (NULL when out of memory). */
char *fsdp__join_name(const char *prefix, const char *name);

/* The size records of the options structs more than one file reads (docs/design.md, "ABI
 * policy"). */
extern const fsdp__abi_struct_t fsdp__mixed_precision_abi;
extern const fsdp__abi_struct_t fsdp__options_abi;
/* The size check of a caller's fsdp_options_t and of the mixed precision inside it
 * (fsdp__abi_check; o NULL passes). */
int fsdp__check_options(fsdp_ctx_t *ctx, const char *fn, const char *arg, const fsdp_options_t *o);

/* ---- defined in policy.c --------------------------------------------------------------------- */

/* Whether m's type matches one of the NULL-terminated patterns (fsdp_policy_type_matches). */
bool fsdp__type_in(const fsdp_module_t *m, const char *const *patterns);

extern const fsdp__abi_struct_t fsdp__unit_overrides_abi;
/* The size check of a caller's overrides (fsdp/policy.h), and of their mixed precision when it
 * is set (ov NULL passes). */
struct fsdp_unit_overrides;
int fsdp__check_overrides(fsdp_ctx_t *ctx, const char *fn, const char *arg,
                          const struct fsdp_unit_overrides *ov);

/* ---- defined in writeback.c ------------------------------------------------------------------ */

/* With use_orig_params: writes original parameters (and gradients) the user replaced back into
 * u's shard, before u gathers its parameters. from_hook: called by a forward or backward hook,
 * where a unit that keeps its unsharded parameters for backward refuses a change. */
int fsdp__writeback_orig_params(fsdp_unit_t *u, bool from_hook);
/* Whether FSDP_SKIP_WRITEBACK_CHECK is "1" in the environment. */
bool fsdp__skip_writeback_env(void);

/* ---- defined in summon.c --------------------------------------------------------------------- */

/* Where host copies of u's tensors go (summon's and the state dicts' offload_to_cpu): the
 * offload host, else the compute device when it is a host device, else the context's own CPU
 * device, made on first use (NULL only when it cannot be made). */
fsdp_device_t *fsdp__host_device(const fsdp_unit_t *u);
/* Drops the views a summon pointed u's module slots at (u->summon_views). */
void fsdp__drop_summon_views(fsdp_unit_t *u);

/* ---- defined in state_dict.c ----------------------------------------------------------------- */

extern const fsdp__abi_struct_t fsdp__full_sd_options_abi;

/* FSDP_EINVAL (message naming fn) unless root is a root unit, idle. */
int fsdp__sd_check_root(fsdp_unit_t *root, const char *fn);
/* Appends an entry to l (*cap allocated), taking name and t (both freed on failure). */
int fsdp__sd_push(fsdp_unit_t *root, fsdp_shard_list_t *l, size_t *cap, char *name,
                  fsdp_tensor_t *t, int ndim, const int64_t *shape, int64_t offset,
                  bool replicated);
/* A copy of q's part of u's shard read from src at element off: 1-D, or with q's shape when
 * every rank holds q whole (NO_SHARD: *repl). */
int fsdp__sd_piece(const fsdp_unit_t *u, const struct fsdp__param *q, fsdp_tensor_t *src,
                   int64_t off, bool copy, fsdp_tensor_t **out, bool *repl);
/* fsdp_sharded_state_dict with views of the shards instead of copies (read them before the next
 * step: a checkpoint writer). */
int fsdp__sharded_state_dict_views(fsdp_unit_t *root, fsdp_shard_list_t *out);
/* fsdp_sharded_optim_state_dict; without copy, the pieces view the live optimizer state. */
int fsdp__sharded_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt, bool copy,
                                   fsdp_shard_list_t *out);
/* Where a rank's part of one global tensor lives: numel elements of dst (a 1-D view) hold the
 * global elements [lo, lo + numel). */
struct fsdp__sd_target {
    char *name;
    int ndim;
    const int64_t *shape;
    int64_t total; /* elements of the global tensor */
    int64_t lo, numel;
    fsdp_tensor_t *dst; /* a 1-D view (owned) */
    bool replicated;
    bool seen;
};
/* Checks the pieces of sd named like t (shapes, overlaps, coverage of t's range) and, with
 * write, copies their overlaps into t->dst; tmp has room for sd->n pointers. */
int fsdp__sd_fill(fsdp_unit_t *root, const fsdp_shard_list_t *sd, struct fsdp__sd_target *t,
                  fsdp_shard_entry_t **tmp, bool write, const char *fn);

/* ---- defined in optim_state.c ---------------------------------------------------------------- */

/* The per-parameter states an optimizer may hold (fsdp/optim.h), "step" (a scalar) last. */
#define FSDP__N_OPT_STATES 5
extern const char *const fsdp__opt_states[FSDP__N_OPT_STATES];
/* How one optimizer parameter maps onto the model's parameters: the unit whose flat parameter
 * it is (index -1) or whose original parameter `index` it is, or neither (u NULL: a parameter
 * no unit manages). */
struct fsdp__opt_param {
    fsdp_tensor_t *t;
    const char *name; /* the optimizer's name (borrowed from it) */
    int group;
    fsdp_unit_t *u;
    int index; /* original parameter of u, or -1 for u's flat parameter */
};
/* Every parameter of opt, in group order, classified against units[0..nu) (*out malloc'ed,
 * *n of them). */
int fsdp__opt_params(fsdp_unit_t *root, fsdp_unit_t *const *units, size_t nu,
                     const fsdp_optim_t *opt, struct fsdp__opt_param **out, size_t *n);

#endif /* FSDP_FSDP_IMPL_H */
