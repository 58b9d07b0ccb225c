/* SPDX-License-Identifier: MIT */
/*
 * fsdp/ddp.h: DistributedDataParallel, the replicated reference that FSDP is compared against.
 *
 * fsdp_ddp_create() wraps a module that every rank of a process group holds in full (the same
 * parameters, in the same registration order, with the same shapes and dtypes). Forward runs
 * the module unchanged; backward computes local gradients as usual, and DDP averages them over
 * the group so that after fsdp_backward() every rank holds the same .grad. The semantics are
 * those of PyTorch 1.13's torch.nn.parallel.DistributedDataParallel with
 * find_unused_parameters=True, gradient_as_bucket_view=False and no comm hook, plus its
 * static_graph and parameters_to_ignore options, with the differences listed under
 * "Differences from PyTorch" below.
 *
 * Ignored parameters and buffers. options.parameters_to_ignore lists fully qualified names
 * (PyTorch's _set_params_and_buffers_to_ignore_for_model, read by DDP as parameters_to_ignore);
 * each must name a parameter or a buffer of the module. A tensor is ignored when every name it
 * is registered under is listed (PyTorch filters names before removing duplicates). An ignored
 * parameter gets no hook, is in no bucket (the bucket assignment below never sees it), is never
 * all-reduced (its .grad stays this rank's own accumulation), is left out of the cross-rank
 * check (its shape may differ across ranks) and of sync_module_states' broadcast. An ignored
 * buffer is left out of the check and of both broadcasts. Every rank must pass the same list.
 *
 * Buckets. The trainable parameters (requires_grad at creation, not ignored; a shared parameter
 * once) are taken in reverse registration order (fsdp_module_named_params() reversed, the order
 * in which backward usually produces their gradients) and packed by PyTorch's rule
 * (_compute_bucket_assignment_by_size): each parameter joins the open bucket of its dtype,
 * opening one when there is none, and the bucket closes as soon as its bytes reach its limit,
 * so a bucket holds at least one parameter and may pass its limit by its last one. The limit is
 * min(first_bucket_bytes, bucket_cap_bytes) for the first bucket of each dtype (1 MiB by
 * default, PyTorch's _DEFAULT_FIRST_BUCKET_BYTES: the gradients backward produces first start
 * communicating early) and bucket_cap_bytes for the others. Buckets are numbered in the order
 * they were opened, which is PyTorch's order (by their first parameter). fsdp_ddp_assign_buckets()
 * computes the same assignment from sizes alone. Each bucket owns a flat buffer (counted under
 * FSDP_MEM_COMM, allocated at creation, only when the group has more than one rank).
 *
 * A synced backward. A grad hook on every bucketed parameter (fsdp_tensor_add_grad_hook) marks
 * it ready when its gradient is complete; the first hook of a backward queues a final callback
 * (fsdp_queue_callback). As soon as bucket 0, 1, ... in turn has all its parameters ready, its
 * gradients are copied into its flat buffer and an asynchronous all-reduce is launched, while
 * the rest of the backward still runs; buckets are always launched in bucket order, whatever
 * order readiness comes in. The final callback launches the buckets not launched yet,
 * all-reduces the per-parameter "used" flags (PyTorch's local_used_map, an i32 sum; one more
 * all-reduce per synced backward), waits for everything and writes the results back into .grad.
 *
 * static_graph (PyTorch's static_graph=True): the caller promises that every synced backward
 * uses the same parameters, each as many times, on each rank. The first synced backward counts
 * each parameter's hooks and launches every bucket from the final callback (PyTorch's
 * delay_all_reduce), used flags included; its all-reduced used map is then kept. Each later
 * synced backward skips the used-flag all-reduce (nbuckets all-reduces instead of nbuckets + 1)
 * and writes back by the kept map; a parameter is ready when its hook has fired as often as in
 * the first backward, and one whose hook never fired then is ready from the start, so a bucket
 * holding parameters this rank does not use still leaves during backward. With an unchanged
 * graph the gradients are bitwise those of the dynamic mode. A rank whose own use differs from
 * its first backward's (a parameter's hook firing more or less often; under no_sync, a
 * different set of used parameters) still issues every collective of the backward, so no peer
 * waits, then fsdp_backward() returns FSDP_EINVAL naming the parameter and both counts. That
 * backward's .grad are what the kept map gives: the average for the parameters used somewhere in
 * the first backward (built from this backward's contributions, so a gradient that arrived
 * after its bucket left is missing), nothing written for the others. Peers whose own use did not
 * change are not told. The first backward's counts stay the reference afterwards.
 *
 * Rounding. Like PyTorch's reducer without a comm hook, each rank multiplies its gradient by
 * 1/world_size while copying it into the bucket (fsdp_scale: the factor rounded to the
 * gradient's compute dtype, f32 for f32, f16 and bf16), and the bucket is then summed over the
 * ranks (in rank order, so bitwise deterministic). The result is
 * sum_r fl(g_r * fl(1/W)), not fl(sum_r g_r / W): the two differ in the last bits when W is not
 * a power of two. Bucketing does not change any result: the reduction is element-wise, so any
 * bucket cap gives bitwise the same gradients.
 *
 * Unused parameters. A parameter "used" on a rank is one that received a gradient in a
 * backward on that rank since the last synced backward (under no_sync too). On each rank a
 * parameter contributes its .grad when used, zeros otherwise (also when it has a stale .grad
 * from an earlier iteration). After the reduction:
 *   - used on at least one rank: .grad = the average, on every rank (created where it was
 *     none);
 *   - used on no rank: .grad is left exactly as it was (none stays none).
 * Under static_graph "used on at least one rank" is decided by the first synced backward.
 *
 * no_sync. fsdp_ddp_set_sync(d, false) is PyTorch's `with ddp.no_sync()`: a forward run while
 * sync is off records no synchronisation, so its backward only accumulates into .grad locally,
 * without any collective. The decision is taken at forward time (as PyTorch does): the backward
 * of a forward run with sync on reduces everything accumulated since the last synced backward.
 *
 * Buffers. broadcast_buffers: before a forward, every buffer of the module tree (persistent or
 * not, any dtype; ignored ones excepted) is broadcast from rank 0, unless the previous forward
 * ran with sync off or with grad mode off (PyTorch's require_forward_param_sync rule; the first
 * forward always broadcasts). sync_module_states: at creation, every parameter (trainable or
 * frozen) and every buffer, ignored ones excepted, is broadcast from rank 0; only values change,
 * the tensors stay the same objects.
 *
 * Dummy mode (PyTorch tests' DummyDDP): forward runs the module, nothing else: no hooks, no
 * buckets, no collective at all, not even at creation; pg may be NULL. The ignore list is copied
 * but not checked against the module.
 *
 * World size 1: no collective is issued, at creation or later, and no flat buffer allocated;
 * the gradients are bitwise the unwrapped module's (x * 1 is exact), with or without ignored
 * parameters and static_graph, and the stats count 0 all-reduces.
 *
 * Collectives. Creation (unless dummy or world size 1) is collective over pg: it checks that
 * every rank has the same parameters and buffers, ignored ones left out (two all-gathers;
 * PyTorch's _verify_param_shape_across_processes; a rank that failed its own checks of the
 * ignore list, hooks or devices says so in the first one, so all ranks fail together), then
 * broadcasts the module states when asked. A synced backward issues nbuckets + 1 all-reduces
 * (nbuckets under static_graph after the first), a forward one broadcast per buffer when
 * buffers are broadcast. All ranks must make the same calls in the same order.
 *
 * Differences from PyTorch:
 *   - Bucket order. PyTorch 1.13 with find_unused_parameters=True packs in registration order
 *     and then reverses the list, so its small first bucket holds the first registered
 *     parameters and is all-reduced last. Packing here is in reverse registration order, as
 *     PyTorch's rebuilt buckets (after the first iteration, for static_graph or
 *     find_unused_parameters=False) and dynamo's DDPOptimizer do, so the small bucket is bucket
 *     0, all-reduced first. Buckets are never rebuilt from the gradient order observed.
 *   - The first limit is min(first_bucket_bytes, bucket_cap_bytes); PyTorch 1.13 applies 1 MiB
 *     even under a smaller cap (PyTorch 2.x uses the cap alone when bucket_cap_mb is given).
 *   - static_graph reports a changed graph on the rank that changed, after joining the
 *     backward's collectives; PyTorch raises from the hook or at the next forward, while the
 *     peers wait in their collectives.
 *   - An unknown name in parameters_to_ignore is an error; PyTorch ignores it.
 *   - No sparse gradients, and a parameter unused on a rank contributes zeros even when it has a
 *     stale .grad.
 *
 * Errors. Every fallible function returns 0 or a negative FSDP_E* code and leaves a message on
 * the module's context (fsdp_ctx_last_error) naming the parameter, rank and sizes involved. A
 * failing collective during backward makes fsdp_backward() return its status (from the hook or
 * the final callback); outstanding all-reduces are waited for before the error is returned, or
 * at the latest at the next forward or at destroy.
 *
 * Ownership. The wrapper holds a reference to the module and to every bucketed parameter until
 * fsdp_ddp_destroy(), which removes its hooks; the module stays usable afterwards. The process
 * group is borrowed and must outlive the wrapper.
 *
 * Thread-safety: a wrapper belongs to one rank (one context) and is used by its thread only.
 */
#ifndef FSDP_DDP_H
#define FSDP_DDP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/pg.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ddp fsdp_ddp_t;

/* PyTorch's bucket_cap_mb = 25. */
#define FSDP_DDP_DEFAULT_BUCKET_CAP_BYTES ((size_t)25 * 1024 * 1024)
/* PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES. */
#define FSDP_DDP_DEFAULT_FIRST_BUCKET_BYTES ((size_t)1024 * 1024)

typedef struct fsdp_ddp_options {
    /* sizeof this struct as the caller was built; set by fsdp_ddp_options_init() */
    size_t size;
    size_t bucket_cap_bytes; /* > 0; default FSDP_DDP_DEFAULT_BUCKET_CAP_BYTES */
    bool broadcast_buffers;  /* default true: rank 0's buffers broadcast before a forward */
    bool sync_module_states; /* default true: rank 0's parameters and buffers at creation */
    bool dummy;              /* default false; true: DummyDDP, no communication at all */
    /* > 0; default FSDP_DDP_DEFAULT_FIRST_BUCKET_BYTES: the first bucket of each dtype closes
     * at min(first_bucket_bytes, bucket_cap_bytes) (see "Buckets" above). */
    size_t first_bucket_bytes;
    /* PyTorch's parameters_to_ignore: fully qualified names of parameters and buffers that DDP
     * leaves alone (see "Ignored parameters and buffers" above); num_parameters_to_ignore of
     * them, read (copied) by fsdp_ddp_create only. Default none. */
    const char *const *parameters_to_ignore;
    size_t num_parameters_to_ignore;
    bool static_graph; /* default false; PyTorch's static_graph=True (see "static_graph") */
} fsdp_ddp_options_t;

/* Fills o with the defaults above. */
FSDP_EXTERN void fsdp_ddp_options_init(fsdp_ddp_options_t *o, size_t size);
#define fsdp_ddp_options_init(o) (fsdp_ddp_options_init)((o), sizeof *(o))

/*
 * Wraps m (retained) for data parallelism over pg (borrowed; NULL: the context's world group,
 * and a world of one when the context has none). o NULL: the defaults. Collective over pg unless
 * dummy or pg has one rank (see the top of this file). *out receives the wrapper, freed with
 * fsdp_ddp_destroy().
 *
 * Errors (FSDP_EINVAL unless stated, with nothing changed): NULL m or out; bucket_cap_bytes or
 * first_bucket_bytes 0; num_parameters_to_ignore > 0 with a NULL list or a NULL entry, or an
 * entry that names neither a parameter nor a buffer of m (the message gives its index and the
 * name); a parameter already bucketed by another live DDP wrapper; ranks whose parameters or
 * buffers differ in number, dtype, shape or requires_grad (the message names the first
 * differing one and both ranks' values; every rank fails the same way); FSDP_ENOMEM; and the
 * failures of the collectives.
 */
FSDP_EXTERN int fsdp_ddp_create(fsdp_module_t *m, fsdp_pg_t *pg, const fsdp_ddp_options_t *o,
                                fsdp_ddp_t **out);

/* Destroys the wrapper: waits for outstanding all-reduces, removes its grad hooks, frees the
 * buckets and releases the module and parameters. NULL is accepted. Gradients are left as they
 * are. */
FSDP_EXTERN void fsdp_ddp_destroy(fsdp_ddp_t *d);

/*
 * Runs the module (fsdp_module_forward) on nin inputs into nout outputs, after broadcasting the
 * buffers when that is due, and arms the next backward for a synced reduction when sync is on
 * and grad mode is on. Outputs are new references, as fsdp_module_forward's. Blocking for the
 * broadcasts. Errors: FSDP_EINVAL for a NULL d, the module's errors, the broadcasts' failures.
 */
FSDP_EXTERN int fsdp_ddp_forward(fsdp_ddp_t *d, int nin, fsdp_tensor_t *const *in, int nout,
                                 fsdp_tensor_t **out);
/* One input, one output. */
FSDP_EXTERN int fsdp_ddp_forward1(fsdp_ddp_t *d, fsdp_tensor_t *x, fsdp_tensor_t **y);

/* The wrapped module (PyTorch's ddp.module), borrowed. */
FSDP_EXTERN fsdp_module_t *fsdp_ddp_module(const fsdp_ddp_t *d);
/* The process group (NULL for a dummy wrapper created without one, or a world of one). */
FSDP_EXTERN fsdp_pg_t *fsdp_ddp_pg(const fsdp_ddp_t *d);

/* no_sync: false makes the following forwards' backwards accumulate locally without any
 * collective; true (the default) goes back to synced backwards. Returns FSDP_EINVAL for a NULL
 * d. */
FSDP_EXTERN int fsdp_ddp_set_sync(fsdp_ddp_t *d, bool sync);
FSDP_EXTERN bool fsdp_ddp_sync(const fsdp_ddp_t *d);

/* Counters, for tests and logs. */
typedef struct fsdp_ddp_stats {
    size_t num_params;         /* trainable parameters in buckets */
    size_t num_buckets;        /* 0 for a dummy wrapper */
    size_t bucket_bytes;       /* sum of the buckets' sizes */
    uint64_t synced_backwards; /* synced backwards whose collectives completed so far */
    /* The last synced backward: */
    /* All-reduces issued: buckets + the used flags; buckets alone under static_graph after the
     * first synced backward; 0 at world size 1. */
    uint64_t last_allreduce_calls;
    uint64_t last_allreduce_bytes; /* their bytes */
    uint64_t last_early_launches;  /* buckets launched from grad hooks, before the callback */
    size_t last_unused_params;     /* parameters used on no rank (their .grad left alone) */
    size_t num_ignored_params;     /* parameters left out by parameters_to_ignore */
    size_t num_ignored_buffers;    /* buffers left out by parameters_to_ignore */
} fsdp_ddp_stats_t;
/* Fills *out; FSDP_EINVAL for NULL arguments. */
FSDP_EXTERN int fsdp_ddp_get_stats(const fsdp_ddp_t *d, fsdp_ddp_stats_t *out);

/* Number of parameters in bucket b (0 for a bad b), and the i-th of them (borrowed) with its
 * fully qualified name (borrowed, may be NULL); NULL for bad indices. Parameters are listed in
 * the order they sit in the bucket's flat buffer. */
FSDP_EXTERN size_t fsdp_ddp_bucket_num_params(const fsdp_ddp_t *d, size_t b);
FSDP_EXTERN fsdp_tensor_t *fsdp_ddp_bucket_param(const fsdp_ddp_t *d, size_t b, size_t i,
                                                 const char **name);
/* Bytes of bucket b (its flat buffer's size at world size > 1); 0 for a bad b. */
FSDP_EXTERN size_t fsdp_ddp_bucket_bytes(const fsdp_ddp_t *d, size_t b);

/*
 * PyTorch's dist._compute_bucket_assignment_by_size as the wrapper applies it (see "Buckets"
 * above), from sizes alone: the n tensors, of nbytes[i] bytes and dtype dtypes[i] (dtypes NULL:
 * all one dtype), are taken in the order given (the wrapper gives its parameters in reverse
 * registration order). Each joins the open bucket of its dtype, opening one when there is none,
 * and that bucket closes as soon as its bytes reach its limit: min(first_bucket_bytes,
 * bucket_cap_bytes) for the first bucket of each dtype, bucket_cap_bytes for the later ones.
 * Buckets are numbered in the order they were opened. bucket_of[i] receives tensor i's bucket
 * and *nbuckets the number of buckets. Pure; ctx (may be NULL) receives the error message.
 * Errors: FSDP_EINVAL for NULL nbuckets, NULL nbytes or bucket_of with n > 0, a zero limit, or a
 * dtype out of range.
 */
FSDP_EXTERN int fsdp_ddp_assign_buckets(fsdp_ctx_t *ctx, size_t n, const size_t *nbytes,
                                        const fsdp_dtype_t *dtypes, size_t first_bucket_bytes,
                                        size_t bucket_cap_bytes, size_t *bucket_of,
                                        size_t *nbuckets);

FSDP_END_DECLS

#endif /* FSDP_DDP_H */
