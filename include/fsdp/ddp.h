/*
 * fsdp/ddp.h: DistributedDataParallel, the replicated reference that FSDP is compared against.
 *
 * fsdp_ddp_create() wraps a module that every rank of a process group holds in full (the same
 * parameters, in the same registration order, with the same shapes and dtypes). Forward runs
 * the module unchanged; backward computes local gradients as usual, and DDP averages them over
 * the group so that after fsdp_backward() every rank holds the same .grad. The semantics are
 * those of PyTorch 1.13's torch.nn.parallel.DistributedDataParallel with
 * find_unused_parameters=True, gradient_as_bucket_view=False and no comm hook, with the
 * differences listed under "Differences from PyTorch" below.
 *
 * Buckets. The trainable parameters (requires_grad at creation; a shared parameter once) are
 * taken in reverse registration order (fsdp_module_named_params() reversed, the order in which
 * backward usually produces their gradients) and packed greedily into buckets of at most
 * bucket_cap_bytes: a parameter that does not fit in the open bucket closes it and opens the
 * next one, and a parameter larger than the cap gets a bucket of its own. Each bucket holds
 * one dtype: every dtype has its own open bucket, and buckets are ordered by the position of
 * their first parameter in the reverse order (PyTorch's rule). Each bucket owns a flat buffer
 * (counted under FSDP_MEM_COMM, allocated at creation, only when the group has more than one
 * rank).
 *
 * A synced backward. A grad hook on every trainable parameter (fsdp_tensor_add_grad_hook)
 * marks it ready when its gradient is complete; the first hook of a backward queues a final
 * callback (fsdp_queue_callback). As soon as bucket 0, 1, ... in turn has all its parameters
 * ready, its gradients are copied into its flat buffer and an asynchronous all-reduce is
 * launched, so communication overlaps the rest of the backward; buckets are always launched in
 * bucket order, whatever order readiness comes in. The final callback launches the buckets not
 * launched yet, all-reduces the per-parameter "used" flags (PyTorch's local_used_map, an i32
 * sum; one more all-reduce per synced backward), waits for everything and writes the results
 * back into .grad.
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
 *
 * no_sync. fsdp_ddp_set_sync(d, false) is PyTorch's `with ddp.no_sync()`: a forward run while
 * sync is off records no synchronisation, so its backward only accumulates into .grad locally,
 * without any collective. The decision is taken at forward time (as PyTorch does): the backward
 * of a forward run with sync on reduces everything accumulated since the last synced backward.
 *
 * Buffers. broadcast_buffers: before a forward, every buffer of the module tree (persistent or
 * not, any dtype) is broadcast from rank 0, unless the previous forward ran with sync off or
 * with grad mode off (PyTorch's require_forward_param_sync rule; the first forward always
 * broadcasts). sync_module_states: at creation, every parameter (trainable or frozen) and every
 * buffer is broadcast from rank 0; only values change, the tensors stay the same objects.
 *
 * Dummy mode (PyTorch tests' DummyDDP): forward runs the module, nothing else: no hooks, no
 * buckets, no collective at all, not even at creation; pg may be NULL.
 *
 * World size 1: no collective is issued and no flat buffer allocated; the gradients are what
 * the general path would give (x * 1 is exact).
 *
 * Collectives. Creation (unless dummy or world size 1) is collective over pg: it checks that
 * every rank has the same trainable parameters (two all-gathers; PyTorch's
 * _verify_param_shape_across_processes), then broadcasts the module states when asked. A
 * synced backward issues nbuckets + 1 all-reduces, a forward one broadcast per buffer when
 * buffers are broadcast. All ranks must make the same calls in the same order.
 *
 * Differences from PyTorch: no 1 MiB first bucket, no bucket rebuild after the first
 * iteration (the assignment above is fixed at creation), no static_graph, no sparse gradients,
 * and a parameter unused on a rank contributes zeros even when it has a stale .grad.
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
FSDP_EXTERN void fsdp_ddp_options_init(fsdp_ddp_options_t *o);

/*
 * Wraps m (retained) for data parallelism over pg (borrowed; NULL: the context's world group,
 * and a world of one when the context has none). o NULL: the defaults. Collective over pg unless
 * dummy or pg has one rank (see the top of this file). *out receives the wrapper, freed with
 * fsdp_ddp_destroy().
 *
 * Errors (FSDP_EINVAL unless stated, with nothing changed): NULL m or out; bucket_cap_bytes 0;
 * a parameter already bucketed by another live DDP wrapper; ranks whose trainable parameters
 * differ in number, dtype, shape or requires_grad (the message names the first differing
 * parameter and both ranks' values; every rank fails the same way); FSDP_ENOMEM; and the
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
