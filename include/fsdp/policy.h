/* SPDX-License-Identifier: MIT */
/*
 * fsdp/policy.h: auto-wrap policies and wrap planning (PyTorch's torch.distributed.fsdp.wrap).
 *
 * A policy decides which modules of a tree become FSDP units of their own. It is a first-class,
 * immutable, reference-counted value (fsdp_policy_t) of one of these kinds:
 *
 *   always              every module (always_wrap_policy)
 *   size_based          a module whose not-yet-wrapped parameter numel reaches min_num_params
 *                       (size_based_auto_wrap_policy, with force-leaf and excluded types)
 *   module_types        modules of the listed types (ModuleWrapPolicy)
 *   transformer         the same for transformer layer types (transformer_auto_wrap_policy)
 *   types_individually  the same, PyTorch's _wrap_module_cls_individually
 *   lambda              modules a predicate selects (lambda_auto_wrap_policy)
 *   custom              a function answering no, yes, or yes with per-unit option overrides
 *                       (CustomPolicy)
 *   or                  any of several policies (_or_policy)
 *   callback            a user function (module, recurse, nonwrapped_numel, arg), PyTorch's bare
 *                       callable policy
 *
 * Every policy answers through one entry, fsdp_policy_decide(p, module, recurse,
 * nonwrapped_numel, overrides), so policies compose: an or-policy calls its members through it,
 * and a user callback may call any policy object through it (or fsdp_policy_call).
 *
 * Module kinds are matched by type name (fsdp_module_type). A pattern is a type name
 * ("Linear") or a family tag; the one family is FSDP_TYPE_BATCHNORM ("_BatchNorm", PyTorch's
 * base class), matching BatchNorm1d, BatchNorm2d, BatchNorm3d and SyncBatchNorm.
 *
 * Planning (fsdp_wrap_plan_build) runs a policy over a module tree as PyTorch's _recursive_wrap
 * does, bottom-up, and returns the units to make in post-order (children before parents, the
 * root last) with each unit's option overrides. It communicates nothing and changes nothing;
 * fsdp_wrap() with options.auto_wrap_policy builds, validates and consumes a plan. Two pure validations go with it: no module of the tree may
 * already be a unit (fsdp_wrap_check_no_units), and no planned unit may manage both frozen and
 * trainable parameters (fsdp_wrap_validate_frozen, fsdp_wrap_plan_validate_frozen).
 *
 * Ownership: policy constructors return a new reference in *out (NULL on failure), released
 * with fsdp_policy_release(); an or-policy holds references to its members, so the caller may
 * release its own at once. Type-name lists given to constructors are copied. The `arg` of
 * lambda, custom and callback policies is borrowed: it must outlive the policy. Modules given to
 * planning functions are borrowed; a plan borrows its modules (keep the root alive while the
 * plan is used) and owns its names (fsdp_wrap_plan_free).
 *
 * Errors: FSDP_EINVAL for bad arguments, naming the argument; FSDP_ENOMEM. Functions that take a
 * module report on its context (fsdp_ctx_last_error); policy constructors, which have no context,
 * log the message at error level to stderr (as fsdp_ctx_create does).
 *
 * The manual API (PyTorch's enable_wrap and wrap) is here too: fsdp_enable_wrap opens a wrap
 * scope with default options on the calling thread, and fsdp_wrap_scoped wraps a module inside
 * it (the defaults merged with per-call overrides) and is the identity outside it.
 *
 * Thread-safety: a policy may be shared by the rank threads of a process (its reference count
 * is atomic and it never changes); user functions inside it are called on the calling thread.
 * Planning and validation follow the module rule: one thread per module tree. A wrap scope
 * belongs to the thread that opened it: each rank thread opens its own, and no other thread
 * sees it.
 */
#ifndef FSDP_POLICY_H
#define FSDP_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/fsdp.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_policy fsdp_policy_t;

/* FSDP_TYPE_BATCHNORM, the family tag of the batch-norm kinds, is defined in fsdp/fsdp.h. */

/* Whether a module type name matches a pattern: equal names, or a family tag and a member of
 * the family. NULL on either side never matches. */
FSDP_EXTERN bool fsdp_policy_type_matches(const char *type, const char *pattern);

/* ---- per-unit option overrides ------------------------------------------------------------- */

/*
 * What a custom policy may set for one unit (PyTorch's CustomPolicy kwargs dict). Each value
 * counts only when its has_ flag is set; the rest comes from the root's options. Options that
 * must be the same over a whole tree (use_orig_params, ignored modules, check_exec_order) are
 * not here.
 */
typedef struct fsdp_unit_overrides {
    /* sizeof this struct as the caller was built; set by fsdp_unit_overrides_init() */
    size_t size;
    bool has_pg;
    fsdp_pg_t *pg;                        /* borrowed, as fsdp_options_t.pg */
    bool has_replicate_pg;
    fsdp_pg_t *replicate_pg;
    bool has_strategy;
    fsdp_sharding_strategy_t strategy;
    bool has_cpu_offload;
    bool cpu_offload;
    bool has_device;
    fsdp_device_t *device;
    bool has_backward_prefetch;
    fsdp_backward_prefetch_t backward_prefetch;
    bool has_forward_prefetch;
    bool forward_prefetch;
    bool has_limit_all_gathers;
    int limit_all_gathers;
    bool has_mixed_precision;
    fsdp_mixed_precision_t mixed_precision; /* enabled false: full precision for this unit */
    bool has_sync_module_states;
    bool sync_module_states;
} fsdp_unit_overrides_t;

/* Nothing set. */
FSDP_EXTERN void fsdp_unit_overrides_init(fsdp_unit_overrides_t *ov, size_t size);
#define fsdp_unit_overrides_init(ov) (fsdp_unit_overrides_init)((ov), sizeof *(ov))
/* Whether any has_ flag is set (false, logged, for an ov that fails the size check). */
FSDP_EXTERN bool fsdp_unit_overrides_any(const fsdp_unit_overrides_t *ov);
/* *out = *root with every set override applied (out may equal root). ov may be NULL (a plain
 * copy). Every other field, the auto-wrap fields included, is copied as it is. *out need not be
 * initialised: the macro passes out_size = sizeof *out (out->size = out_size). FSDP_EINVAL for
 * a NULL root or out; a root or ov that fails the size check (docs/design.md, "ABI policy") is
 * refused as every function refuses it. Messages are logged at error level. */
FSDP_EXTERN int fsdp_unit_overrides_apply(const fsdp_options_t *root,
                                          const fsdp_unit_overrides_t *ov, fsdp_options_t *out,
                                          size_t out_size);
#define fsdp_unit_overrides_apply(root, ov, out)                                                   \
    (fsdp_unit_overrides_apply)((root), (ov), (out), sizeof *(out))

/* ---- policies ------------------------------------------------------------------------------- */

/* A custom policy's answer. Any negative value is an FSDP_E* error, passed on to the caller. */
#define FSDP_POLICY_NO 0       /* not a unit */
#define FSDP_POLICY_YES 1      /* a unit with the root's options */
#define FSDP_POLICY_OVERRIDE 2 /* a unit with the root's options and *ov over them; with no
                                  has_ flag set this means no (PyTorch's empty dict) */

/* PyTorch's bare callable policy. With recurse true it says whether to visit m's children
 * (m may still be wrapped afterwards); with recurse false whether m becomes a unit, given
 * nonwrapped_numel, the parameter elements of m's subtree not yet in a planned unit. */
typedef bool (*fsdp_policy_fn)(fsdp_module_t *m, bool recurse, int64_t nonwrapped_numel,
                               void *arg);
/* A lambda policy's predicate: whether m becomes a unit. */
typedef bool (*fsdp_policy_lambda_fn)(fsdp_module_t *m, void *arg);
/* A custom policy's function: FSDP_POLICY_NO, _YES, _OVERRIDE (after filling *ov, which comes
 * initialized to nothing set, with this library's ov->size: a field that size does not cover is
 * not there), or a negative FSDP_E* error. */
typedef int (*fsdp_policy_custom_fn)(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg);

/* Options of the size-based policy. */
typedef struct fsdp_size_policy_options {
    /* sizeof this struct as the caller was built; set by fsdp_size_policy_options_init() */
    size_t size;
    int64_t min_num_params;                   /* >= 0; default 100000000 (1e8) */
    /* Types neither visited nor wrapped (NULL-terminated; NULL: none). Default
     * {"MultiheadAttention"}. */
    const char *const *force_leaf_types;
    /* Types never wrapped themselves, though their children may be (NULL: none). Default
     * {"ModuleList", "ModuleDict"}. */
    const char *const *exclude_wrap_types;
    /* Added to the two lists above (NULL-terminated; default NULL), to extend the defaults. */
    const char *const *extra_force_leaf_types;
    const char *const *extra_exclude_wrap_types;
} fsdp_size_policy_options_t;

/* The defaults listed above. */
FSDP_EXTERN void fsdp_size_policy_options_init(fsdp_size_policy_options_t *o, size_t size);
#define fsdp_size_policy_options_init(o) (fsdp_size_policy_options_init)((o), sizeof *(o))

FSDP_EXTERN int fsdp_policy_always_create(fsdp_policy_t **out);
/* o NULL: the defaults. FSDP_EINVAL for a negative min_num_params. */
FSDP_EXTERN int fsdp_policy_size_based_create(const fsdp_size_policy_options_t *o,
                                              fsdp_policy_t **out);
/* Modules whose type matches one of types (NULL-terminated, at least one entry). Visits every
 * module. The three differ only in name, as in PyTorch. */
FSDP_EXTERN int fsdp_policy_module_types_create(const char *const *types, fsdp_policy_t **out);
FSDP_EXTERN int fsdp_policy_transformer_create(const char *const *layer_types,
                                               fsdp_policy_t **out);
FSDP_EXTERN int fsdp_policy_types_individually_create(const char *const *types,
                                                      fsdp_policy_t **out);
FSDP_EXTERN int fsdp_policy_lambda_create(fsdp_policy_lambda_fn fn, void *arg,
                                          fsdp_policy_t **out);
FSDP_EXTERN int fsdp_policy_custom_create(fsdp_policy_custom_fn fn, void *arg,
                                          fsdp_policy_t **out);
FSDP_EXTERN int fsdp_policy_callback_create(fsdp_policy_fn fn, void *arg, fsdp_policy_t **out);
/* Any of policies[0..n) (n >= 1, none NULL), asked in order; the first that says yes decides,
 * its overrides included. Takes a reference to each member. */
FSDP_EXTERN int fsdp_policy_or_create(fsdp_policy_t *const *policies, size_t n,
                                      fsdp_policy_t **out);

FSDP_EXTERN fsdp_policy_t *fsdp_policy_retain(fsdp_policy_t *p);
/* Drops a reference; the last one frees the policy (and drops its members). NULL ok. */
FSDP_EXTERN void fsdp_policy_release(fsdp_policy_t *p);
/* "always", "size_based", "module_types", "transformer", "types_individually", "lambda",
 * "custom", "or" or "callback" (static strings). */
FSDP_EXTERN const char *fsdp_policy_kind(const fsdp_policy_t *p);

/*
 * The generic entry. recurse true: whether to visit m's children; recurse false: whether m
 * becomes a unit, with *ov (may be NULL) set to its overrides (nothing set unless a custom
 * policy gave some); ov must have been initialised (fsdp_unit_overrides_init), which tells the
 * library its size. Returns 1 (yes), 0 (no) or a negative FSDP_E* code (a custom function's
 * error, or an invalid override, reported on m's context).
 */
FSDP_EXTERN int fsdp_policy_decide(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse,
                                   int64_t nonwrapped_numel, fsdp_unit_overrides_t *ov);
/* The same as a bool, PyTorch's policy(module, recurse, nonwrapped_numel): errors read as
 * false. For user callbacks that delegate to a policy object. */
FSDP_EXTERN bool fsdp_policy_call(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse,
                                  int64_t nonwrapped_numel);

/* ---- planning ------------------------------------------------------------------------------- */

typedef struct fsdp_wrap_plan_options {
    /* sizeof this struct as the caller was built; set by fsdp_wrap_plan_options_init() */
    size_t size;
    /* Subtrees left alone: never units, never visited, their parameters not counted. */
    fsdp_module_t *const *ignored_modules;
    size_t num_ignored_modules;
    /* Further parameters left out of every count and every unit. */
    fsdp_tensor_t *const *ignored_params;
    size_t num_ignored_params;
    /* The root's mixed_precision.enabled. When set, modules of mp_ignored_types become units of
     * their own with mixed precision off (PyTorch's _module_classes_to_ignore), whatever the
     * policy says, and a warning is logged. Default false. */
    bool mixed_precision;
    /* NULL-terminated patterns; default {FSDP_TYPE_BATCHNORM}; NULL: no such override. */
    const char *const *mp_ignored_types;
    /* Frozen-parameter validation: a warning (true) or an error (false). Default false. */
    bool use_orig_params;
} fsdp_wrap_plan_options_t;

/* The defaults listed above. */
FSDP_EXTERN void fsdp_wrap_plan_options_init(fsdp_wrap_plan_options_t *o, size_t size);
#define fsdp_wrap_plan_options_init(o) (fsdp_wrap_plan_options_init)((o), sizeof *(o))

typedef struct fsdp_wrap_plan_entry {
    fsdp_module_t *module;      /* borrowed */
    char *fqn;                  /* relative to the root; "" for the root (owned by the plan) */
    bool is_root;               /* the last entry */
    bool selected;              /* the policy chose it (for the root: would have chosen it) */
    bool mp_override;           /* made a full-precision unit by the mixed-precision rule */
    int64_t managed_numel;      /* parameter elements the unit will flatten */
    fsdp_unit_overrides_t overrides; /* over the root's options; nothing set for the root */
} fsdp_wrap_plan_entry_t;

typedef struct fsdp_wrap_plan {
    size_t n;
    fsdp_wrap_plan_entry_t *entries; /* post-order: children before parents, root last */
} fsdp_wrap_plan_t;

/*
 * Plans the units of root's tree under policy, as PyTorch's _recursive_wrap: at each module
 * (the root first) the policy is asked with recurse true and the unwrapped numel of its subtree;
 * on yes the children are planned in registration order, then the policy is asked with recurse
 * false and what is left unwrapped, and on yes the module becomes a unit that takes every
 * unwrapped parameter of its subtree. Ignored modules and already planned (shared) modules are
 * skipped; shared parameters count once. The root always becomes a unit (the last entry), with no
 * overrides. o may be NULL (defaults). On success *out holds the plan (free it with
 * fsdp_wrap_plan_free); on failure it is empty. Errors: NULL root, policy or out, a NULL ignored
 * module, an ignored root; a policy's error.
 */
FSDP_EXTERN int fsdp_wrap_plan_build(fsdp_module_t *root, const fsdp_policy_t *policy,
                                     const fsdp_wrap_plan_options_t *o, fsdp_wrap_plan_t *out);
/* Frees the plan's entries and names and empties it. NULL ok. */
FSDP_EXTERN void fsdp_wrap_plan_free(fsdp_wrap_plan_t *plan);
/* The entry of module m, or NULL when m is not planned to be a unit. */
FSDP_EXTERN const fsdp_wrap_plan_entry_t *fsdp_wrap_plan_find(const fsdp_wrap_plan_t *plan,
                                                              const fsdp_module_t *m);

/* ---- validation ----------------------------------------------------------------------------- */

/* Whether m is already a unit. */
typedef bool (*fsdp_module_pred_fn)(const fsdp_module_t *m, void *arg);

/*
 * Auto-wrapping needs a tree without units. Walks root's tree in pre-order (root first, each
 * module once) and fails with FSDP_EINVAL at the first module for which is_unit says yes:
 * "FSDP auto wrapping requires modules to not already have FSDP applied but found <fqn> in
 * <root type>" (a root that is a unit is named "the root module"). is_unit NULL:
 * fsdp_unit_of(m) != NULL.
 */
FSDP_EXTERN int fsdp_wrap_check_no_units(fsdp_module_t *root, fsdp_module_pred_fn is_unit,
                                         void *arg);

/*
 * PyTorch's _validate_frozen_params: every module of units[0..n) (modules of root's tree) would
 * manage the parameters of its subtree that no unit below it manages and that are not in
 * ignored_params. Units are examined in post-order (children in registration order), each unit's
 * parameters in breadth-first registration order. When one has both parameters that require
 * grad and frozen ones:
 *   use_orig_params false: FSDP_EINVAL with "<fqn> has both parameters with requires_grad=True
 *     and False. FSDP does not support wrapping such modules when use_orig_params=False. If
 *     possible, wrap the frozen parameters with FSDP separately.\nThe following parameters have
 *     requires_grad=True:\n['a', ...]\nThe following parameters have requires_grad=False:\n[...]"
 *     for the first such unit;
 *   use_orig_params true: the same with " We do not recommend wrapping such modules since the
 *     gradient memory usage will be higher than expected (<all> numel instead of <trainable>
 *     numel before sharding via reduce-scatter). " in the middle, logged at warn level on root's
 *     context for every such unit; returns 0.
 * message (may be NULL) receives a malloc'ed copy of the first such message (NULL when none);
 * the context's last error keeps only its first 511 bytes.
 */
FSDP_EXTERN int fsdp_wrap_validate_frozen(fsdp_module_t *root, fsdp_module_t *const *units,
                                          size_t n, fsdp_tensor_t *const *ignored_params,
                                          size_t num_ignored_params, bool use_orig_params,
                                          char **message);

/* The same over a plan made from root with options o (NULL: defaults): the units are the
 * entries the policy selected or the mixed-precision rule added (the root only when selected),
 * the ignored parameters those of o's ignored modules and ignored_params, the mode
 * o->use_orig_params. */
FSDP_EXTERN int fsdp_wrap_plan_validate_frozen(fsdp_module_t *root, const fsdp_wrap_plan_t *plan,
                                               const fsdp_wrap_plan_options_t *o,
                                               char **message);

/* ---- the manual wrap API -------------------------------------------------------------------- */

/*
 * PyTorch's `with enable_wrap(wrapper_cls=FSDP, **defaults)`: opens a wrap scope on the calling
 * thread with a copy of defaults (NULL: fsdp_options_init's), until fsdp_disable_wrap(). The
 * pointers inside defaults (groups, device, ignored modules, policy) are borrowed until then.
 * Scopes do not nest, as in PyTorch ("already within an autowrap context"): opening a scope
 * while one is open is FSDP_EINVAL and leaves the open scope as it was; closing when none is
 * open is FSDP_EINVAL. These two have no context: errors are logged at error level to stderr.
 * The scope is thread-local: every rank thread opens (and closes) its own.
 */
FSDP_EXTERN int fsdp_enable_wrap(const fsdp_options_t *defaults);
FSDP_EXTERN int fsdp_disable_wrap(void);
/* Whether the calling thread is within a wrap scope. */
FSDP_EXTERN bool fsdp_wrap_enabled(void);

/*
 * PyTorch's wrap(module, **overrides). Within the calling thread's wrap scope: fsdp_wrap(m) with
 * the scope's defaults merged with ov (fsdp_unit_overrides_apply; ov may be NULL), so a unit
 * and its errors are exactly fsdp_wrap's, the defaults' auto-wrap policy included. Outside a
 * scope: the identity, FSDP_OK with *out NULL and m left as it was. FSDP_EINVAL for a NULL m
 * or out.
 */
FSDP_EXTERN int fsdp_wrap_scoped(fsdp_module_t *m, const fsdp_unit_overrides_t *ov,
                                 fsdp_unit_t **out);

FSDP_END_DECLS

#endif /* FSDP_POLICY_H */
