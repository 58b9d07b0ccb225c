/* SPDX-License-Identifier: MIT */
/*
 * fsdp/fsdp.h: Fully Sharded Data Parallel units.
 *
 * fsdp_wrap() makes a module an FSDP unit over a process group. The unit takes every parameter
 * of the module's subtree that no nested unit owns and is not ignored, flattens them into one
 * flat parameter (shared parameters once), pads it to a multiple of the group size and keeps
 * this rank's contiguous 1/N shard. The module tree itself is not changed: the unit attaches
 * forward and backward hooks to the module, so the module is run as before
 * (fsdp_module_forward) and every fully qualified name stays the module's own, with no wrapper
 * prefix.
 *
 * Runtime, per unit and iteration (sharding strategy FULL_SHARD):
 *   forward   all-gather the shard into the unsharded flat parameter (or wait for the prefetched
 *             one), point the module's parameter slots at views into it, run, point the slots
 *             back, free the unsharded flat parameter unless the unit is the root;
 *   backward  when backward reaches the unit's outputs (the exit mark on the tape): all-gather
 *             again, maybe prefetch the next unit; the gradients accumulate straight into an
 *             unsharded flat gradient; when backward has passed the unit's first invocation
 *             (its entry mark): free the parameters and reduce-scatter the gradient (pre- and
 *             post-divided as PyTorch does) into the sharded gradient, asynchronously;
 *   end       a final callback waits for every reduction and stores each unit's sharded
 *             gradient in the flat parameter's .grad (and, with use_orig_params, per-parameter
 *             gradient views).
 * The optimizer then steps over fsdp_named_params() of the root: the flat parameters, or with
 * use_orig_params the original parameters, which are views into the local shard.
 *
 * Parameters outside forward and backward. Every original parameter tensor stays the object the
 * module registered; the unit re-points it at its part of the local shard as a 1-D view
 * (numel_in_shard elements, possibly 0). Writing into it (or into the flat parameter) changes
 * what the next forward gathers.
 *
 * Nesting. Either give the root an auto-wrap policy (options.auto_wrap_policy, fsdp/policy.h),
 * which makes the units below it in one call, or wrap inner modules by hand first (fsdp_wrap,
 * fsdp_fully_shard, or fsdp_wrap_scoped inside an fsdp_enable_wrap scope), then the root without
 * a policy: a unit wrapped over a subtree that contains units adopts them. The two do not mix:
 * a policy refuses a tree that already holds a unit, as PyTorch does. The root (the unit without
 * a parent) owns its descendants: fsdp_unit_destroy() on it frees them all.
 *
 * Collectives. Every unit operation that communicates is collective over the unit's process
 * group: all ranks must run the same units in the same order. With check_exec_order (on by
 * default in tests) a rank that runs another unit than rank 0 at the same point gets an error
 * naming both units and ranks instead of a hang or a wrong result.
 *
 * Thread-safety: units belong to one rank (one context) and are used by its thread only.
 */
#ifndef FSDP_FSDP_H
#define FSDP_FSDP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/checkpoint.h>
#include <fsdp/context.h>
#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/pg.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_unit fsdp_unit_t;
/* An auto-wrap policy: made and described in fsdp/policy.h. */
typedef struct fsdp_policy fsdp_policy_t;

/* PyTorch's ShardingStrategy. */
typedef enum fsdp_sharding_strategy {
    FSDP_FULL_SHARD = 0,      /* ZeRO-3: params, grads, optimizer state sharded; params freed
                                 after forward (except the root's) */
    FSDP_SHARD_GRAD_OP,       /* ZeRO-2: params kept unsharded from forward to backward */
    FSDP_NO_SHARD,            /* DDP-like: everything replicated, gradients all-reduced */
    FSDP_HYBRID_SHARD,        /* FULL_SHARD inside the group, all-reduce across groups */
    FSDP_HYBRID_SHARD_ZERO2,  /* SHARD_GRAD_OP inside the group, all-reduce across groups */
    FSDP_SHARDING_COUNT
} fsdp_sharding_strategy_t;

FSDP_EXTERN const char *fsdp_sharding_strategy_name(fsdp_sharding_strategy_t s);

/* PyTorch's BackwardPrefetch. */
typedef enum fsdp_backward_prefetch {
    FSDP_BACKWARD_PREFETCH_NONE = 0,
    FSDP_BACKWARD_PRE,  /* prefetch the next unit before the current unit's gradient computation */
    FSDP_BACKWARD_POST, /* prefetch it after the current unit's gradients are computed */
    FSDP_BACKWARD_PREFETCH_COUNT
} fsdp_backward_prefetch_t;

FSDP_EXTERN const char *fsdp_backward_prefetch_name(fsdp_backward_prefetch_t p);

/* PyTorch's MixedPrecision. A dtype left at FSDP_MP_UNSET means "as the parameters". */
#define FSDP_MP_UNSET ((fsdp_dtype_t)-1)
typedef struct fsdp_mixed_precision {
    /* sizeof this struct as the caller was built; set by fsdp_mixed_precision_init() */
    size_t size;
    bool enabled;              /* false (the default): no casts at all */
    fsdp_dtype_t param_dtype;  /* compute dtype: the shard is cast to it and all-gathered in it;
                                  the full-precision shard stays for the optimizer */
    fsdp_dtype_t reduce_dtype; /* gradients are reduced in it (unset: param_dtype) and then
                                  stored in the parameters' dtype */
    fsdp_dtype_t buffer_dtype; /* the root casts every floating buffer of the tree to it once */
    bool cast_root_forward_inputs; /* the root casts floating inputs to param_dtype (default
                                      true) */
    bool cast_forward_inputs;      /* every unit does (default false) */
    /* PyTorch's keep_low_precision_grads: the sharded gradient the optimizer sees stays in
     * param_dtype (reduced in reduce_dtype, then cast to param_dtype instead of the parameters'
     * dtype), on the host with cpu_offload, and gradients accumulated over iterations without
     * zeroing are added in it. Not while full precision is forced (use_full_prec_in_eval in
     * eval, summons). Default false. */
    bool keep_low_precision_grads;
    /* PyTorch's _module_classes_to_ignore: with an auto-wrap policy and mixed precision
     * enabled, every module whose type matches one of these patterns (fsdp_policy_type_matches,
     * NULL-terminated) becomes a unit of its own with mixed precision off, whatever the policy
     * says, and a warning is logged. Default {FSDP_TYPE_BATCHNORM}; NULL: no such rule. */
    const char *const *module_classes_to_ignore;
} fsdp_mixed_precision_t;

/* The family tag of the batch-norm kinds (PyTorch's torch.nn.modules.batchnorm._BatchNorm):
 * matches BatchNorm1d, BatchNorm2d, BatchNorm3d and SyncBatchNorm (fsdp/policy.h). */
#define FSDP_TYPE_BATCHNORM "_BatchNorm"

/* enabled false, dtypes unset, cast_root_forward_inputs true, module_classes_to_ignore
 * {FSDP_TYPE_BATCHNORM}. */
FSDP_EXTERN void fsdp_mixed_precision_init(fsdp_mixed_precision_t *mp, size_t size);
#define fsdp_mixed_precision_init(mp) (fsdp_mixed_precision_init)((mp), sizeof *(mp))

typedef struct fsdp_options {
    /* sizeof this struct as the caller was built; set by fsdp_options_init() */
    size_t size;
    /* The group the unit shards over (for the hybrid strategies: the shard group). NULL: the
     * context's world group. */
    fsdp_pg_t *pg;
    /* Hybrid strategies only: the replicate group (same local shard on every rank of it). */
    fsdp_pg_t *replicate_pg;
    fsdp_sharding_strategy_t strategy;          /* default FULL_SHARD */
    /* PyTorch's CPUOffload(offload_params=True): the local shard and the sharded gradient live in
     * host memory (category FSDP_MEM_OFFLOAD) and the optimizer steps there; the shard is copied
     * to the device before each all-gather, the reduced gradient back after each reduction.
     * The module's parameters must be in host memory when it is wrapped. Default false. */
    bool cpu_offload;
    /* PyTorch's device_id: the compute device (a device of the module's context). NULL (the
     * default): the device the unit's parameters are on. Without cpu_offload, parameters (and
     * the buffers of the modules the unit manages) on another device are moved there at wrap:
     * each parameter object keeps its identity and gets new storage on `device`, as
     * `module.to(device)` does, and the module computes there. With cpu_offload the parameters
     * must be on a host (CPU) device at wrap; the flat shard and its gradient stay on that device
     * (FSDP_MEM_OFFLOAD), the unsharded parameters, the compute views and the gradient
     * reduction live on `device`, and only the buffers move. The root moves forward inputs that
     * are on another device and need no gradient to `device` (PyTorch moves CPU inputs to the
     * compute device). A unit adopted by a later wrap (nested by hand) with this option unset
     * takes the adopting unit's device, and moves as above; policy-made units get it with the
     * other options. After wrapping, parameters must stay where the unit put them: the root's
     * first forward refuses (FSDP_EINVAL naming the parameter and its device) a parameter that
     * was moved, notably an offloaded one moved off the host (PyTorch's "An FSDP-managed module
     * with parameter CPU offloading enabled has parameters on cuda"). The caller keeps the
     * device alive until the unit is destroyed. During forward and backward the context's
     * default device (fsdp_ctx_set_device) should be the compute device: autograd creates the
     * loss gradient there. */
    fsdp_device_t *device;
    fsdp_backward_prefetch_t backward_prefetch; /* default BACKWARD_PRE */
    bool forward_prefetch;                      /* default false */
    /* At most this many all-gathers issued and not yet consumed (PyTorch's limit_all_gathers
     * with its limit of 2); 0 = no limit. Default 2. On a device with a compute stream (CUDA)
     * the host also waits, before issuing an all-gather, until the device has passed the
     * reshard this many reshards ago, as PyTorch's limiter does: the host then never runs
     * further ahead, and the buffers released once the device is done with them do not pile
     * up. */
    int limit_all_gathers;
    bool use_orig_params;                       /* default false */
    fsdp_mixed_precision_t mixed_precision;     /* default off */
    /* PyTorch's FSDP_USE_FULL_PREC_IN_EVAL, read from the root of a tree (this field, or the
     * environment variable FSDP_USE_FULL_PREC_IN_EVAL equal to "1" when the root is wrapped):
     * in a forward where a unit's module is in eval mode (fsdp_module_train(m, false)), a unit
     * with mixed precision runs in full precision: its parameters are gathered and used in the
     * parameters' own dtype, no forward input is cast, the floating buffers of the modules it
     * manages are back in their dtype from before wrapping, and a backward of that forward
     * reduces in the parameters' dtype. The next forward in train mode casts the buffers to
     * buffer_dtype again. Switching needs the unit idle: the root's forward refuses
     * (FSDP_EINVAL) a switch while the graph of an earlier forward is still to be
     * differentiated. Default false. */
    bool use_full_prec_in_eval;
    /* Broadcast rank 0's parameters and buffers of the subtree at wrap time. Default false. */
    bool sync_module_states;
    /* Check that every rank runs the units in the same order (one small all-gather per unit
     * invocation while the order is being recorded). Default false; tests turn it on. */
    bool check_exec_order;
    /* Modules whose subtrees the unit leaves alone (not flattened, not sharded). */
    fsdp_module_t *const *ignored_modules;
    size_t num_ignored_modules;
    /* Auto-wrap (fsdp/policy.h): the policy that chooses which modules below m become units of
     * their own, or NULL (the default) for none. Borrowed for the length of the fsdp_wrap call;
     * no unit keeps it. The units it makes get these options (the policy's per-unit overrides
     * over them, the policy itself cleared). */
    const fsdp_policy_t *auto_wrap_policy;
    /* Fault injection for tests (PyTorch's ModuleWithDelay and MixtureOfExperts delays): sleep
     * this many milliseconds before starting each gradient reduction, and before freeing the
     * unsharded parameters. 0 (the default) for none. */
    int delay_before_reduce_ms;
    int delay_before_free_ms;
} fsdp_options_t;

/* Defaults as listed above. */
FSDP_EXTERN void fsdp_options_init(fsdp_options_t *o, size_t size);
#define fsdp_options_init(o) (fsdp_options_init)((o), sizeof *(o))

/*
 * Makes m an FSDP unit, and with options.auto_wrap_policy the modules below m that the policy
 * chooses. Collective over the groups involved (it may broadcast, and every rank must flatten
 * the same parameters). On success *out is the unit of m; m's parameters are now sharded.
 *
 * Without a policy, units already in m's subtree (wrapped earlier by hand) are adopted as m's
 * children. With a policy, in this order, nothing being wrapped before the first three pass:
 *   1. no module of m's tree may be a unit already: FSDP_EINVAL "FSDP auto wrapping requires
 *      modules to not already have FSDP applied but found <fqn> in <type of m>" naming the
 *      first in pre-order (fsdp_wrap_check_no_units);
 *   2. the plan (fsdp_wrap_plan_build) over o's ignored modules, with the mixed-precision rule
 *      when o->mixed_precision.enabled (batch-norm kinds become full-precision units) and
 *      o->use_orig_params;
 *   3. frozen parameters: a planned unit (other than m) that would manage both trainable and
 *      frozen parameters is FSDP_EINVAL without use_orig_params, a warning on m's context with
 *      it (fsdp_wrap_plan_validate_frozen, with the messages it documents);
 *   4. every planned unit below m is wrapped in post-order with o merged with its overrides
 *      (fsdp_unit_overrides_apply; auto_wrap_policy cleared), then m itself with o.
 * Errors name the parameter, the module and the sizes: parameters of mixed dtypes or a
 * non-float dtype, a parameter that another unit already manages, a module that is already a
 * unit. (A parameter shared with a module outside every unit's subtree cannot be detected here:
 * modules have no parent pointers; such a module fails at its forward, when it meets the
 * sharded view.) options.device must be a device of m's context. When step 4 fails, the units
 * it made before the failure stay units (roots, found with fsdp_unit_of on their modules);
 * fsdp_unit_destroy() each of them.
 */
FSDP_EXTERN int fsdp_wrap(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **out);

/*
 * PyTorch's composable fully_shard(module, ...): shards m in place, as fsdp_wrap(m, o, out) does
 * (units attach by hooks in both APIs, so there is no wrapper object either way), with
 * use_orig_params forced on, as upstream's fully_shard does; every other option is o's, the
 * auto-wrap policy included. The module then looks like the unwrapped model: its own parameter
 * objects under their own names (fsdp_module_named_params, fsdp_module_state_dict), which are
 * what the optimizer steps over (each a 1-D view of this rank's part of the shard, with its
 * gradient after backward). Apply it to the chosen children first, then to the root, which
 * adopts them; or to the root alone with a policy. out may be NULL: the unit stays reachable
 * through fsdp_unit_of(m). Errors as fsdp_wrap.
 */
FSDP_EXTERN int fsdp_fully_shard(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **out);

/* Frees a root unit and every unit below it, removing their hooks. The module must not be run
 * again afterwards (its parameters are left as views of freed shards); release it. A non-root
 * unit is an error (destroy its root). NULL is accepted. */
FSDP_EXTERN int fsdp_unit_destroy(fsdp_unit_t *root);

/* ---- navigation ------------------------------------------------------------------------------ */

FSDP_EXTERN fsdp_module_t *fsdp_unit_module(const fsdp_unit_t *u);
/* The unit of module m, or NULL when m is not a unit. */
FSDP_EXTERN fsdp_unit_t *fsdp_unit_of(const fsdp_module_t *m);
FSDP_EXTERN fsdp_unit_t *fsdp_unit_parent(const fsdp_unit_t *u);
FSDP_EXTERN bool fsdp_unit_is_root(const fsdp_unit_t *u);
/* Fully qualified name of the unit's module under the root's module ("" for the root). */
FSDP_EXTERN const char *fsdp_unit_fqn(const fsdp_unit_t *u);
/* Every unit of root's tree in pre-order (root first). *units is malloc'ed; free() it. */
FSDP_EXTERN int fsdp_units(const fsdp_unit_t *root, fsdp_unit_t ***units, size_t *n);
/* The strategy in effect (NO_SHARD for a unit over a group of one). */
FSDP_EXTERN fsdp_sharding_strategy_t fsdp_unit_strategy(const fsdp_unit_t *u);
/* The group the unit shards (or, for NO_SHARD, reduces) over. */
FSDP_EXTERN fsdp_pg_t *fsdp_unit_pg(const fsdp_unit_t *u);
/* The device the unit computes on: where its unsharded flat parameter, compute views and
 * gradient reduction live (options.device, or the parameters' device). With cpu_offload the
 * flat parameter (fsdp_unit_flat_param) is on the host device instead. */
FSDP_EXTERN fsdp_device_t *fsdp_unit_compute_device(const fsdp_unit_t *u);

/*
 * The options in effect for unit u (PyTorch's per-instance sharding_strategy, cpu_offload,
 * backward_prefetch, forward_prefetch, mixed_precision, process_group, ...): what it was wrapped
 * with (a unit a policy made: the root's options with the policy's overrides; a unit adopted
 * by a wrap with options.device: that device when it had none), except
 *   strategy          the one in effect (NO_SHARD over a group of one, as fsdp_unit_strategy);
 *   pg                the group it shards over, never NULL (fsdp_unit_pg);
 *   replicate_pg      NULL unless the strategy is hybrid;
 *   device            the compute device, never NULL (fsdp_unit_compute_device);
 *   ignored_modules   u's own copy of the list (valid while u lives);
 *   auto_wrap_policy  NULL (a unit does not keep the policy it was made by).
 * *out need not be initialised: the macro passes out_size = sizeof *out, and out is filled as
 * fsdp_options_init() fills it (out->size = out_size). FSDP_EINVAL when u or out is NULL.
 */
FSDP_EXTERN int fsdp_unit_options(const fsdp_unit_t *u, fsdp_options_t *out, size_t out_size);
#define fsdp_unit_options(u, out) (fsdp_unit_options)((u), (out), sizeof *(out))

/* ---- parameters -------------------------------------------------------------------------------- */

/* The flat parameter: a 1-D leaf over the local shard (padded; shard_numel elements). NULL for
 * a unit that manages no parameters. Its .grad is the sharded gradient after backward. */
FSDP_EXTERN fsdp_tensor_t *fsdp_unit_flat_param(const fsdp_unit_t *u);
/* The unsharded flat parameter (padded_numel elements); its storage has bytes only while the
 * unit is unsharded. NULL for a unit without parameters. */
FSDP_EXTERN fsdp_tensor_t *fsdp_unit_full_param(const fsdp_unit_t *u);
FSDP_EXTERN bool fsdp_unit_is_unsharded(const fsdp_unit_t *u);

/* One managed parameter of a unit and its place in the flat layout (PyTorch's
 * _ShardParamInfo). */
typedef struct fsdp_param_info {
    const char *fqn;          /* under the unit's module */
    fsdp_tensor_t *param;     /* the original parameter object (borrowed) */
    int ndim;
    const int64_t *shape;     /* its shape as registered */
    int64_t numel;
    int64_t offset;           /* first element in the unsharded flat parameter */
    bool in_shard;            /* whether any of it is in this rank's shard */
    int64_t offset_in_shard;  /* where that part starts in the shard */
    int64_t numel_in_shard;
    int64_t intra_start;      /* first element of the parameter that the shard holds */
} fsdp_param_info_t;

FSDP_EXTERN size_t fsdp_unit_num_params(const fsdp_unit_t *u);
FSDP_EXTERN int fsdp_unit_param_info(const fsdp_unit_t *u, size_t i, fsdp_param_info_t *out);

/* Sizes of the flat layout in elements. */
typedef struct fsdp_flat_sizes {
    int64_t unpadded_numel; /* parameters plus alignment padding */
    int64_t padded_numel;   /* rounded up to shard_numel * group size */
    int64_t shard_numel;
    int world;              /* the group size the unit shards over */
} fsdp_flat_sizes_t;
FSDP_EXTERN void fsdp_unit_flat_sizes(const fsdp_unit_t *u, fsdp_flat_sizes_t *out);

/*
 * What an optimizer steps over, as (name, tensor) in pre-order: without use_orig_params the
 * flat parameter of every unit, named "<unit fqn>._flat_param" ("_flat_param" for the root),
 * plus any parameter no unit manages (ignored modules); with use_orig_params the original
 * parameters under their own names (1-D views into the local shard, possibly empty). The list
 * holds references (owned).
 */
FSDP_EXTERN int fsdp_named_params(const fsdp_unit_t *root, fsdp_named_list_t *out);

/* ---- running outside forward ----------------------------------------------------------------- */

/* PyTorch's summon_full_params arguments. */
typedef struct fsdp_summon_options {
    /* sizeof this struct as the caller was built; set by fsdp_summon_options_init() */
    size_t size;
    bool recurse;        /* also every unit below (default true) */
    bool writeback;      /* changes persist: this rank's part is copied back into its shard at
                            the end (default true) */
    bool rank0_only;     /* only rank 0's modules show the full parameters (others gather, then
                            free at once); not with writeback */
    bool offload_to_cpu; /* the full parameters shown are a copy in host memory
                            (FSDP_MEM_OFFLOAD), the device copy is freed */
    bool with_grads;     /* also gather the gradients (zeros where a rank has none), shown as
                            the parameters' .grad; needs use_orig_params, not with
                            offload_to_cpu */
} fsdp_summon_options_t;

/* recurse and writeback on, the rest off. */
FSDP_EXTERN void fsdp_summon_options_init(fsdp_summon_options_t *o, size_t size);
#define fsdp_summon_options_init(o) (fsdp_summon_options_init)((o), sizeof *(o))

/*
 * Gathers the full parameters of u (and, with recurse, of every unit below it) and points the
 * modules' parameter slots at them, so fsdp_module_named_params() / fsdp_module_state_dict()
 * of the module show full tensors until fsdp_summon_end(). Collective over each unit's group.
 * Not allowed during forward or backward, and forward is refused while summoned. o may be NULL
 * (defaults). Errors: rank0_only with writeback, with_grads without use_orig_params or with
 * offload_to_cpu, a unit already summoned or running.
 */
FSDP_EXTERN int fsdp_summon_begin(fsdp_unit_t *u, const fsdp_summon_options_t *o);
FSDP_EXTERN int fsdp_summon_end(fsdp_unit_t *u);

/* ---- the FULL state dict --------------------------------------------------------------------- */

/* PyTorch's FullStateDictConfig. */
typedef struct fsdp_full_state_dict_options {
    /* sizeof this struct as the caller was built; set by fsdp_full_state_dict_options_init() */
    size_t size;
    bool rank0_only;     /* only rank 0 receives the entries (the others an empty list); every
                            rank must still call (default false) */
    bool offload_to_cpu; /* the parameters are gathered into host memory (summon's
                            offload_to_cpu); buffers are copied from where they are (default
                            false) */
} fsdp_full_state_dict_options_t;

/* rank0_only and offload_to_cpu off. */
FSDP_EXTERN void fsdp_full_state_dict_options_init(fsdp_full_state_dict_options_t *o, size_t size);
#define fsdp_full_state_dict_options_init(o) (fsdp_full_state_dict_options_init)((o), sizeof *(o))

/*
 * PyTorch's FULL_STATE_DICT: the whole model's state dict, as the module's own
 * (fsdp_module_state_dict: parameters then persistent buffers, in PyTorch's order, clean
 * fully qualified names), gathered from the shards. Every entry is a copy the caller owns
 * (out->owned). Under mixed precision, parameters are in their own (full) precision and every
 * buffer a unit cast to buffer_dtype is in the dtype it had before wrapping (the live buffers
 * stay in buffer_dtype). Collective over every unit's group; root must be a root unit, idle
 * (not in forward, backward or a summon). o may be NULL (defaults). On failure *out is empty.
 */
FSDP_EXTERN int fsdp_full_state_dict(fsdp_unit_t *root, const fsdp_full_state_dict_options_t *o,
                                     fsdp_named_list_t *out);
/*
 * Loads a FULL state dict (every rank passes the same entries) into root's tree: each rank keeps
 * its part of every parameter (a summon with writeback, then fsdp_module_load_state_dict with
 * `strict`); values are converted to the live tensors' dtypes (an f64 buffer entry into a
 * buffer_dtype buffer). Collective. Errors as fsdp_module_load_state_dict's; with strict,
 * nothing is modified when an entry is missing, unexpected or of another shape.
 */
FSDP_EXTERN int fsdp_load_full_state_dict(fsdp_unit_t *root, const fsdp_named_list_t *sd,
                                          bool strict);

/* ---- the SHARDED and LOCAL state dicts -------------------------------------------------------- */

/* The entries of the SHARDED and LOCAL state dicts are pieces of global tensors
 * (fsdp_shard_entry_t, fsdp_shard_list_t and fsdp_shard_list_free, in fsdp/checkpoint.h): any set
 * of pieces that covers a rank's part loads at any world size or wrapping. */

/*
 * PyTorch's SHARDED_STATE_DICT, without communication: for every parameter a unit of root's
 * tree manages, this rank's part of it (a copy of the shard's elements, in the parameters'
 * dtype), under the parameter's fully qualified name (a tied parameter under its first name);
 * and, replicated, every persistent buffer (in its dtype from before mixed precision cast it),
 * every parameter no unit manages and every parameter of a NO_SHARD unit. Ranks that hold the
 * same part (replicas: NO_SHARD, the hybrid strategies) give equal entries; a writer keeps one
 * (a loader takes a piece given twice once). Ranks that hold nothing of a parameter (a small
 * parameter at a large world size) have no entry for it. On failure *out is empty.
 */
FSDP_EXTERN int fsdp_sharded_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out);
/*
 * Loads pieces into root's tree: each rank copies, for every parameter it holds part of, the
 * overlap of the pieces of that name with its part, and every replicated entry into its buffer
 * or unmanaged parameter (converting dtypes). The pieces may come from any world size or
 * wrapping (several pieces per name, in any order), but must cover this rank's part exactly
 * once (a piece given twice, same offset and size, is taken once; a replicated entry covers
 * every rank's part). Everything is checked before anything is written: an unknown name, a
 * global shape other than the parameter's, pieces that overlap otherwise, leave part of this
 * rank's range uncovered or run past the tensor's end, and a parameter or buffer with no entry
 * are FSDP_EINVAL naming the tensor and the range. Not collective.
 */
FSDP_EXTERN int fsdp_load_sharded_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd);
/*
 * PyTorch's LOCAL_STATE_DICT: every unit's flat shard as it is (padding included), under
 * "<unit fqn>._flat_param" ("_flat_param" for the root), as the piece [rank * shard numel, ...)
 * of the global padded flat parameter; replicated entries as in the SHARDED one. It loads only
 * into the same wrapping at the same world size (fsdp_load_local_state_dict checks every size).
 */
FSDP_EXTERN int fsdp_local_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out);
FSDP_EXTERN int fsdp_load_local_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd);

/*
 * PyTorch's sharded optim_state_dict, keyed by parameter name: opt's state over root's tree as
 * pieces like fsdp_sharded_state_dict's, whatever opt steps over (flat parameters, original
 * parameters with use_orig_params, or parameters no unit manages):
 *   "<fqn>.<state>"  this rank's piece of each per-parameter state (momentum_buffer, exp_avg,
 *                    exp_avg_sq, max_exp_avg_sq), with the parameter's global shape;
 *   "<fqn>.step"     the step count (replicated f64 scalar);
 *   "<fqn>.group"    the index of the parameter group that holds the parameter (replicated);
 *   "group.<g>.<hp>" every group's hyper-parameters (replicated), as fsdp_optim_state_dict.
 * Not collective.
 */
FSDP_EXTERN int fsdp_sharded_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt,
                                              fsdp_shard_list_t *out);
/*
 * Loads such pieces into opt, an optimizer over root's tree of any wrapping, strategy or world
 * size (PyTorch's optim_state_dict_to_load): every parameter's state is assembled from the
 * pieces covering this rank's part, each parameter must sit in the group the state dict names,
 * and the result goes through fsdp_optim_load_state_dict, so nothing changes unless everything
 * checks out (errors name the parameter and the state). Entries of parameters opt does not hold
 * are ignored, so a model with two optimizers loads each from one list. Not collective.
 * With flat parameters (use_orig_params off) a state must have an entry, possibly an empty
 * piece, for every parameter the flat parameter covers, also those this rank holds nothing of:
 * pass every rank's pieces (a checkpoint directory gives them), not this rank's alone.
 */
FSDP_EXTERN int fsdp_load_sharded_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                                   const fsdp_shard_list_t *sd);

/* ---- the state-dict type of a model ------------------------------------------------------------ */

/* PyTorch's StateDictType. */
typedef enum fsdp_state_dict_type {
    FSDP_STATE_DICT_FULL = 0, /* the default */
    FSDP_STATE_DICT_SHARDED,
    FSDP_STATE_DICT_LOCAL
} fsdp_state_dict_type_t;

/*
 * PyTorch's FSDP.set_state_dict_type: the type fsdp_unit_state_dict and the loads below use for
 * root's tree from now on, and, for FULL, its options (o may be NULL: defaults). Not collective;
 * every rank should set the same. FSDP_EINVAL for a unit that is not a root or an unknown type.
 */
FSDP_EXTERN int fsdp_set_state_dict_type(fsdp_unit_t *root, fsdp_state_dict_type_t type,
                                         const fsdp_full_state_dict_options_t *o);
/* The type set on root's tree (FULL for a NULL or non-root unit). */
FSDP_EXTERN fsdp_state_dict_type_t fsdp_get_state_dict_type(const fsdp_unit_t *root);
/*
 * The model's state dict of the type set: FULL gives every entry whole, as a replicated piece
 * (under rank0_only, the other ranks an empty list); SHARDED and LOCAL as
 * fsdp_sharded_state_dict and fsdp_local_state_dict. Collective for FULL.
 */
FSDP_EXTERN int fsdp_unit_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out);
/* Loads a state dict of the type set (FULL: every rank passes whole entries; strict applies
 * to FULL only, the other types always check every entry). */
FSDP_EXTERN int fsdp_unit_load_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd,
                                          bool strict);
/* The optimizer's state dict keyed by parameter name, of the type set: FULL gathered as
 * fsdp_full_optim_state_dict (whole entries, replicated pieces), SHARDED and LOCAL as
 * fsdp_sharded_optim_state_dict (PyTorch's LOCAL optimizer state is the sharded one).
 * Collective for FULL. */
FSDP_EXTERN int fsdp_unit_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt,
                                           fsdp_shard_list_t *out);
/* Loads such an optimizer state dict into opt (any wrapping, strategy or world size). */
FSDP_EXTERN int fsdp_unit_load_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                                const fsdp_shard_list_t *sd);

/* ---- checkpoints that reshard ------------------------------------------------------------------ */

/*
 * Writes root's SHARDED state dict (names "model.<fqn>") and, when opt is not NULL, opt's
 * SHARDED state dict keyed by parameter name ("optim.<key>", fsdp_sharded_optim_state_dict) as
 * the checkpoint directory dir (fsdp/checkpoint.h): every rank writes its own file in parallel,
 * rank 0 writes the index with the nmeta metadata strings (which every rank also copies into its
 * own file, so meta must be the same on every rank), and dir appears complete or not at
 * all (an existing dir is replaced atomically). Collective over the context's world group: every
 * rank fails or succeeds together; a rank whose own step failed returns its error, the others
 * FSDP_EREMOTE naming the rank that failed.
 * Replicated entries and pieces that replicas hold are indexed once.
 */
FSDP_EXTERN int fsdp_checkpoint_save(fsdp_unit_t *root, const fsdp_optim_t *opt, const char *dir,
                                     const fsdp_safetensors_kv_t *meta, size_t nmeta);
/*
 * Loads an open checkpoint (fsdp_ckpt_open; its metadata can be read first) into root's tree and,
 * when opt is not NULL, opt: at any world size, wrapping or strategy, each rank reads only the
 * byte ranges of its part of every parameter and of its optimizer state, then loads them with
 * fsdp_load_sharded_optim_state_dict and fsdp_load_sharded_state_dict, which check everything
 * before they change anything (the optimizer is loaded first). Errors name the tensor and the
 * file. Not collective.
 */
FSDP_EXTERN int fsdp_checkpoint_load(fsdp_unit_t *root, fsdp_optim_t *opt, fsdp_ckpt_t *ck);

/*
 * PyTorch's optim_state_dict under FULL_STATE_DICT (FullStateDictConfig): the keys of
 * fsdp_sharded_optim_state_dict, each per-parameter state ("<fqn>.<state>") gathered into one
 * whole tensor of the parameter's shape and dtype; "<fqn>.step", "<fqn>.group" (f64 scalars) and
 * "group.<g>.<hp>" as there. Entries come in the optimizer's parameter order (its groups in
 * order), and for a flat parameter its parameters in the flat layout's order. The gather is
 * bitwise (each unit all-gathers its states over its shard group, fsdp_unit_pg: no reduction,
 * so -0.0 and NaN payloads come back unchanged; replicas of the hybrid strategies and NO_SHARD
 * are never combined) for any strategy, with or without use_orig_params, for parameters no unit
 * manages (taken from this rank) and for ranks that hold no part of a parameter.
 * Collective over every unit's shard group: every rank of root's tree calls it.
 * o (may be NULL: defaults): rank0_only gives the entries to the world's rank 0 only
 * (fsdp_ctx_rank; the others get an empty list, also under the hybrid strategies);
 * offload_to_cpu puts them in host memory, else a gathered state is on the unit's compute
 * device and the rest where the optimizer keeps it. Every tensor is a copy the caller owns
 * (out->owned). Errors: FSDP_EINVAL when root is not an idle root unit or when the ranks
 * disagree on a parameter's state (one holds a state in another dtype, or none, or another step
 * count), naming the parameter, the ranks and the sizes; the group's failures. On failure *out
 * is empty.
 */
FSDP_EXTERN int fsdp_full_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt,
                                           const fsdp_full_state_dict_options_t *o,
                                           fsdp_named_list_t *out);
/*
 * Loads a FULL optimizer state dict (every rank passes the whole of it, as
 * fsdp_full_optim_state_dict gave it at any world size, wrapping or strategy) into opt, an
 * optimizer over root's tree: each rank keeps its part of every state, as
 * fsdp_load_sharded_optim_state_dict does with the entries taken as whole pieces, and nothing
 * changes unless everything checks out. First every entry is checked on every rank alike: a
 * name that is neither "group.<g>.<hp>" nor "<parameter>.<state|step|group>" of a parameter of
 * the model, a state of another shape than its parameter's, or a step or group that is not a
 * scalar, is FSDP_EINVAL naming the entry; then, as in the sharded load, a missing state, a
 * parameter in another group or an unknown group's hyper-parameters. Entries of model
 * parameters opt does not hold are ignored (a model with two optimizers loads both from one
 * dict). Needs no communication, but every rank must call it to keep its part.
 */
FSDP_EXTERN int fsdp_load_full_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                                const fsdp_named_list_t *sd);

/*
 * Unshards one unit outside forward (collective over its group), so a submodule of it can be
 * run directly, e.g. a head used only for evaluation: the module's parameter slots hold full
 * parameters until fsdp_unit_reshard(), which writes this rank's part back into the shard.
 * Running the unit's own module (which would unshard it again) is refused in between.
 */
FSDP_EXTERN int fsdp_unit_unshard(fsdp_unit_t *u);
FSDP_EXTERN int fsdp_unit_reshard(fsdp_unit_t *u);

/* ---- gradients ------------------------------------------------------------------------------ */

/*
 * PyTorch's FSDP.clip_grad_norm_ on a root: the norm (norm_type > 0, or INFINITY) of every
 * gradient of the tree as if the parameters were unsharded, then every gradient times
 * max_norm / (norm + 1e-6) when that is below 1. Sharded units contribute their shards (summed,
 * or for INFINITY maxed, over the root's group); NO_SHARD units and parameters no unit manages
 * are counted once, locally. Collective over the root's group; call it on every rank after
 * backward. *total_norm (may be NULL) receives the norm before clipping.
 */
FSDP_EXTERN int fsdp_unit_clip_grad_norm(fsdp_unit_t *root, double max_norm, double norm_type,
                                         double *total_norm);

/*
 * Gradient accumulation without communication, as PyTorch's no_sync(). Between
 * fsdp_no_sync_begin and fsdp_no_sync_end on a root, the backward of every unit of its tree
 * reduces nothing: each rank adds its gradient into the unit's local gradient, a full-size
 * (unsharded, padded) flat gradient in the compute dtype that the unit keeps. The first backward
 * after fsdp_no_sync_end adds its gradient to the same buffer and reduces the sum, so k
 * micro-batches cost one reduce-scatter per unit instead of k; sharded gradients (.grad of the
 * flat or original parameters) change only then. The price is memory: while accumulating,
 * every unit holds an unsharded gradient, as in PyTorch.
 *
 * Both calls are local (no collective) but every rank must make them at the same point. They
 * are refused (FSDP_EINVAL) on a unit that is not a root, when no_sync is already on (begin) or
 * off (end), and during a backward (between forward and backward is fine: what counts is
 * whether no_sync is on when a unit's backward ends). Clearing gradients (an optimizer's
 * zero_grad) leaves the local gradients alone: they belong to the backward that will reduce
 * them. fsdp_unit_local_grad returns a unit's local gradient (borrowed; padded_numel elements
 * of the compute dtype), or NULL when nothing is accumulated.
 */
FSDP_EXTERN int fsdp_no_sync_begin(fsdp_unit_t *root);
FSDP_EXTERN int fsdp_no_sync_end(fsdp_unit_t *root);
FSDP_EXTERN bool fsdp_in_no_sync(const fsdp_unit_t *u);
FSDP_EXTERN fsdp_tensor_t *fsdp_unit_local_grad(const fsdp_unit_t *u);

/* ---- introspection for tests ----------------------------------------------------------------- */

typedef enum fsdp_training_state {
    FSDP_STATE_IDLE = 0,
    FSDP_STATE_FORWARD,
    FSDP_STATE_BACKWARD_PRE,
    FSDP_STATE_BACKWARD_POST,
    FSDP_STATE_SUMMON
} fsdp_training_state_t;
FSDP_EXTERN fsdp_training_state_t fsdp_unit_state(const fsdp_unit_t *u);

typedef struct fsdp_unit_stats {
    uint64_t all_gathers;      /* all-gathers this unit issued (prefetched ones included) */
    uint64_t prefetches;       /* of which issued as prefetch */
    uint64_t reduce_scatters;  /* gradient reduce-scatters */
    uint64_t all_reduces;      /* gradient all-reduces (NO_SHARD, hybrid) */
    uint64_t pre_backward_hooks;  /* pre-backward hooks run */
    uint64_t post_backward_hooks; /* post-backward reductions run */
    /* Hooks registered: once per forward that records for backward, on the unit's first
     * invocation in an iteration (the post-backward one only when it has a gradient). */
    uint64_t n_pre_bwd_registered;
    uint64_t n_post_bwd_registered;
} fsdp_unit_stats_t;
FSDP_EXTERN void fsdp_unit_get_stats(const fsdp_unit_t *u, fsdp_unit_stats_t *out);

/* ---- use_orig_params: changing original parameters (writeback) ------------------------------ */

/*
 * With use_orig_params an original parameter is, outside forward, a 1-D view of its part of
 * the local shard, and after backward its gradient a view of its part of the sharded gradient
 * (none for a parameter of which this rank holds no element, as PyTorch's None).
 * Writing into them in place changes the shard directly. Replacing them is detected and
 * written back (PyTorch's _writeback_orig_params) before a unit next gathers its parameters:
 * at its forward, at its first pre-backward hook in a backward, and at fsdp_summon_begin and
 * fsdp_unit_unshard:
 *   - a parameter object replaced in its module slot (fsdp_module_set_param) is adopted as the
 *     original parameter, its values copied into the shard; so is a parameter whose data was
 *     replaced (fsdp_tensor_set_data); either then views the shard again;
 *   - a gradient set to none has its part of the sharded gradient zeroed (when every gradient
 *     of the unit is none, the sharded gradient is dropped instead), so the next backward does
 *     not add to what the user dropped; a gradient replaced by another tensor (or data) is
 *     copied into the sharded gradient (made, zeroed, when there was none) and becomes its view
 *     again, so the next backward accumulates onto it.
 * The new values must have the part's shape, [numel_in_shard] (fsdp_param_info_t), and the
 * parameters' dtype: otherwise FSDP_EINVAL "Cannot writeback when the parameter shape changes"
 * (or "gradient shape") with the parameter's name, the rank and both shapes. Under SHARD_GRAD_OP
 * and HYBRID_SHARD_ZERO2 a parameter changed between a forward and its backward is FSDP_EINVAL
 * "FSDP does not support changing the parameters between forward and backward" (the unit
 * computes with the parameters it kept from the forward). These errors are local to the rank
 * that made the change and come before any collective: a change made on some ranks only leaves
 * the others waiting in the unshard's collective, so make changes on every rank alike. Setting
 * FSDP_SKIP_WRITEBACK_CHECK=1 in the environment before wrapping turns the check off for the
 * units wrapped then (PyTorch's variable of that name): replacements are then ignored.
 */

FSDP_END_DECLS

#endif /* FSDP_FSDP_H */
