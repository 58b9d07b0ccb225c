/* SPDX-License-Identifier: MIT */
/*
 * fsdp_util.h: helpers shared by the FSDP unit tests (t_fsdp.c, t_fsdp_core.c, t_fsdp_hooks.c,
 * t_fsdp_mp.c, t_fsdp_summon.c, t_fsdp_memory.c, t_fsdp_device.c, t_wrap.c, t_state_dict.c,
 * t_reshard.c).
 *
 * Per-rank check lists. A test that checks many properties per rank runs as a fu_job_t: every
 * rank of the sim run records each check with fu_ck() into its own list, all ranks in the same
 * order; fu_run_job() then prints one TAP line per check, passing only when every rank passed
 * it (each failing rank's detail as comments), and a last line saying whether every rank ran to
 * its end without a library error. A library call that fails where it must not is recorded with
 * fu_fatal(), which makes that rank's list diverge and so fails the run visibly; FU_TRY() does
 * that and jumps to the rank function's cleanup label.
 *
 * The rest are small pieces of upstream's harness used by more than one test program:
 * assert_close tolerances, closeness and bitwise comparison of tensors, parameter values as
 * plain arrays, SGD over what FSDP hands the optimizer, the save_model state round trip,
 * the hybrid strategies' shard and replicate groups, RECURSIVE-style hand nesting and the
 * TransformerWithSharedParams wrap and forward, small models and inputs, and the unit states,
 * backward-hook counters and watches of CORE-H01/H03.
 *
 * Ownership as in the library: what a helper returns new (tensors, malloc'ed buffers, jobs)
 * says so; every argument is borrowed. Thread-safety: a job's list for rank r is written only by
 * rank r's thread; fu_run_job() runs on the main thread once the ranks have finished.
 */
#ifndef FSDP_TEST_FSDP_UTIL_H
#define FSDP_TEST_FSDP_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

/* torch.testing.assert_close's default tolerances (spec section 0): |actual - expected| <=
 * atol + rtol |expected|. */
#define FU_F32_RTOL 1.3e-6
#define FU_F32_ATOL 1e-5
#define FU_F16_RTOL 1e-3
#define FU_F16_ATOL 1e-5

/* The seed-000 subtest axes in upstream's order: sharding strategy {FULL_SHARD (upstream's
 * None), SHARD_GRAD_OP, NO_SHARD} and backward prefetch {None, BACKWARD_PRE, BACKWARD_POST}. */
extern const fsdp_sharding_strategy_t fu_strategies[3];
extern const fsdp_backward_prefetch_t fu_bwd_prefetches[3];

/* ---- per-rank check lists -------------------------------------------------------------------- */

#define FU_MAXR 4  /* largest world a job runs at */
#define FU_MAXC 96 /* checks one rank may record in one job */

typedef struct fu_rec {
    char name[200]; /* the TAP description (without the job's prefix) */
    bool ok;
    char why[800]; /* detail, only when the check failed */
} fu_rec_t;

typedef struct fu_res {
    int n;
    fu_rec_t c[FU_MAXC];
} fu_res_t;

/* One sim run of one rank function and its configuration. */
typedef struct fu_job {
    char prefix[160]; /* starts every TAP line of the job; names the test ID */
    int world;        /* 1..FU_MAXR */
    fsdp_sharding_strategy_t strategy;
    fsdp_backward_prefetch_t bp;
    bool fwd_prefetch;
    bool orig;                 /* use_orig_params */
    bool offload;              /* cpu_offload */
    fsdp_mixed_precision_t mp; /* off unless a test sets it */
    uint64_t seed;             /* of every rank's context in the sim run */
    fu_res_t r[FU_MAXR];       /* per rank */
} fu_job_t;

/* Resets every field of *j (a job a test embeds in a larger struct of its own, as the first
 * member, or keeps off the stack) to a job with backward prefetch PRE, no forward prefetch, no
 * offload, no mixed precision and sim seed 5. */
void fu_job_init(fu_job_t *j, const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig);

/* The same as a new job (malloc'ed; free() it). Bails out of the test program when out of
 * memory. */
fu_job_t *fu_job_new(const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig);

/* fsdp_options_t as the job asks, with check_exec_order on (as every test here runs). */
void fu_job_options(const fu_job_t *j, fsdp_options_t *o);

/* The calling rank's list. */
fu_res_t *fu_res_of(fu_job_t *j, fsdp_ctx_t *ctx);

/* Records check `name` on this rank; fmt is the detail shown when it failed. Returns ok. */
bool fu_ck(fu_res_t *r, bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* A library call failed where it must not: recorded as a failed check named `what`, with the
 * error's name, text and the context's last error. Returns rc (FSDP_EINTERNAL if rc >= 0). */
int fu_fatal(fu_res_t *r, fsdp_ctx_t *ctx, const char *what, int rc);

/* rc = call; on failure (rc < 0) records it with fu_fatal() as the check `what` and jumps to
 * `label`. Uses the caller's variables: `rc` (int, receives call's result), `r` (the rank's
 * fu_res_t *) and `ctx` (its fsdp_ctx_t *). */
#define FU_TRY(label, what, call)                                                                  \
    do {                                                                                           \
        rc = (call);                                                                               \
        if (rc < 0) {                                                                              \
            fu_fatal(r, ctx, what, rc);                                                            \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* Records check `name`: rc is FSDP_EINVAL and the context's last error names k1 and, when not
 * NULL, k2. */
void fu_ck_einval(fu_res_t *r, fsdp_ctx_t *ctx, int rc, const char *k1, const char *k2,
                  const char *name);

/* Runs fn on j->world sim ranks (fn gets j as its argument) and prints the job's TAP lines:
 * "<prefix> W=<world>: <check>". */
void fu_run_job(fu_job_t *j, fsdp_sim_fn fn);

/* Prints a finished job's TAP lines (what fu_run_job() does after the run): rc is the run's
 * status, st[r] rank r's. */
void fu_report_job(const fu_job_t *j, int rc, const int *st);

/* fu_run_job() of a new job with fu_job_new()'s defaults, freed afterwards. */
void fu_run(const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig, fsdp_sim_fn fn);

/* Appends to a diagnostic, separated by "; " (what no longer fits is dropped). */
void fu_add_why(char *why, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- host copies of state-dict entries ------------------------------------------------------- */

/* A host copy of a state-dict entry or a piece of one (its global shape and element offset), as
 * the state-dict tests keep what was saved beyond the sim run that made it. */
typedef struct fu_piece {
    char name[160];
    fsdp_dtype_t dt;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t offset; /* of a piece in its global tensor (0 for a whole tensor) */
    int64_t numel;  /* of the piece */
    bool replicated;
    void *data;
} fu_piece_t;

typedef struct fu_store {
    size_t n, cap;
    fu_piece_t *e;
} fu_store_t;

/* Frees the copies; the store is empty afterwards. */
void fu_store_free(fu_store_t *st);
/* Appends a host copy of t (with its piece geometry) to st. */
int fu_store_add(fu_store_t *st, const char *name, const fsdp_tensor_t *t, int ndim,
                 const int64_t *shape, int64_t offset, bool replicated);
/* The stored pieces as a shard list on ctx (new tensors; free with fsdp_shard_list_free). */
int fu_store_to_list(fsdp_ctx_t *ctx, const fu_store_t *st, fsdp_shard_list_t *out);

/* ---- comparing values ------------------------------------------------------------------------ */

/* |actual - expected| / (atol + rtol |expected|): <= 1 is close under assert_close's rule. */
double fu_closeness(double actual, double expected, double rtol, double atol);

/* A float tensor's values (any float dtype, widened exactly) as a malloc'ed f32 array of *n
 * elements; NULL on failure. */
float *fu_host_f32(const fsdp_tensor_t *t, int64_t *n);

/* 1: same dtype, same number of elements and bitwise the same values; 0: not; -1: could not
 * compare. */
int fu_same_bits(const fsdp_tensor_t *a, const fsdp_tensor_t *b);

/* The largest fu_closeness() over the elements (> 1: not close); -1 when the tensors cannot be
 * compared (different sizes, or a read failed). A NaN counts as INFINITY. */
double fu_tensor_closeness(const fsdp_tensor_t *actual, const fsdp_tensor_t *expected, double rtol,
                           double atol);

/* Tensor values as one plain array. */
typedef struct fu_vals {
    double *v; /* malloc'ed, n elements */
    size_t n;
} fu_vals_t;

/* Frees a's array and empties it (a zeroed fu_vals_t is empty). */
void fu_vals_free(fu_vals_t *a);

/* Bitwise equality of two value lists; the first difference into why. */
bool fu_vals_same(const fu_vals_t *a, const fu_vals_t *b, char *why, size_t len);

/* Whether a[i] is close to b[i] (fu_closeness <= 1) for every i < n; the first element that
 * is not, named `what` and its index, into why. */
bool fu_series_close(const double *a, const double *b, size_t n, double rtol, double atol,
                     const char *what, char *why, size_t len);

/* fu_series_close over two value lists, which must be non-empty and of one length. */
bool fu_vals_close(const fu_vals_t *a, const fu_vals_t *b, double rtol, double atol, char *why,
                   size_t len);

/* The elements of every tensor of l (grads: of their gradients, where a missing one gives NaNs,
 * which compare unequal), concatenated in list order, into *out (its old array freed). On
 * failure *out still holds an array to fu_vals_free(). */
int fu_list_values(const fsdp_named_list_t *l, bool grads, fu_vals_t *out);

/* The same over the parameters of m's tree (buffers: its buffers), in named order. */
int fu_module_values(const fsdp_module_t *m, bool buffers, bool grads, fu_vals_t *out);

/* Puts into *v the value for element e of the p-th parameter (k: the element's index over all
 * the parameters in named order); returns 0, or an error that stops fu_store_params(). */
typedef int (*fu_val_fn)(void *arg, size_t p, int64_t e, size_t k, float *v);

/* Writes val's values into every element of the parameters of m's tree (named order; full
 * tensors while summoned). */
int fu_store_params(fsdp_module_t *m, fu_val_fn val, void *arg);

/* ---- harness pieces -------------------------------------------------------------------------- */

/* SGD (lr, momentum) over the tensors of l, one group. */
int fu_make_sgd(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, double lr, double momentum,
                fsdp_optim_t **opt);

/* The same over fsdp_named_params(root): what FSDP hands the optimizer. */
int fu_make_fsdp_sgd(fsdp_ctx_t *ctx, fsdp_unit_t *root, double lr, double momentum,
                     fsdp_optim_t **opt);

/* summon_full_params(recurse=True, writeback=False); end it with fsdp_summon_end(). */
int fu_summon_nowb(fsdp_unit_t *root);

/* PyTorch's save_model step: under summon, clone the full state dict, zero every floating
 * entry (after cloning all of them: tied parameters appear under several names), end the
 * summon; then load the clone back under a second summon. Collective. */
int fu_state_round_trip(fsdp_unit_t *root);

/* Hand nesting as upstream's RECURSIVE init does it: wraps the listed submodules of m
 * (NULL-terminated fully qualified names), deepest first, each with options o; the one named
 * `expert` (may be NULL) over expert_pg instead (MixtureOfExperts' expert unit). Not the root:
 * the caller wraps m itself afterwards. */
int fu_wrap_listed(fsdp_module_t *m, const char *const *units, const fsdp_options_t *o,
                   const char *expert, fsdp_pg_t *expert_pg);

/* fsdp_wrap(m) with options o and a module-types auto-wrap policy over types (NULL-terminated),
 * made for the call and released after it (o's own policy is replaced). */
int fu_wrap_types(fsdp_module_t *m, const fsdp_options_t *o, const char *const *types,
                  fsdp_unit_t **root);

/* TransformerWithSharedParams as upstream's RECURSIVE init wraps it: the encoder and decoder
 * layers, then the root (5 units), with options o (its auto_wrap_policy is replaced, and the
 * batch-norm rule of mixed precision is off, so bn stays in the root's unit) ... */
int fu_wrap_transformer_opts(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **root);
/* ... or with the job's options. */
int fu_wrap_transformer(fsdp_module_t *m, const fu_job_t *j, fsdp_unit_t **root);

/* The common start of the TransformerWithSharedParams tests: the model (deterministic, or with
 * dropout active in training and seeded alike on every rank), wrapped with the job's options
 * (5 units), its units in *u (*n of them; free()) and SGD(lr 0.01, momentum 0.9) over what FSDP
 * hands the optimizer. What was built is returned even on failure, for the caller's cleanup; a
 * failure is recorded with fu_fatal() and returned. */
int fu_transformer_setup(fu_res_t *r, fsdp_ctx_t *ctx, const fu_job_t *j, bool deterministic,
                         fsdp_module_t **m, fsdp_unit_t **root, fsdp_unit_t ***u, size_t *n,
                         fsdp_optim_t **opt);

/* One training step of a TransformerWithSharedParams model on the usual input
 * (fu_transformer_forward), from no gradients: zero_grad (set to none), forward, loss, backward,
 * opt's step; the tape is cleared afterwards. */
int fu_transformer_step(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_optim_t *opt);

/* Releases what fu_transformer_setup() (or a setup like it) built: clears the tape (a recorded
 * graph holds references into the units), then frees the unit list and destroys the optimizer,
 * the root unit and the module. Any argument but ctx may be NULL. */
void fu_teardown(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_unit_t *root, fsdp_unit_t **u,
                 fsdp_optim_t *opt);

/* Sequential(n x Linear(d, d) with bias), built after tm_manual_seed(ctx, 0) so that two builds
 * are equal. *out is NULL on failure. */
int fu_linear_stack(fsdp_ctx_t *ctx, int n, int64_t d, fsdp_module_t **out);

/* A (d0, d1) f32 input (FSDP_MEM_ACTIVATIONS) drawn uniform(-1, 1) after tm_manual_seed(ctx,
 * seed); *x is NULL on failure. */
int fu_rand_input(fsdp_ctx_t *ctx, uint64_t seed, int64_t d0, int64_t d1, fsdp_tensor_t **x);

/* The process groups of the hybrid strategies over ctx's world group (collective over it):
 * shard groups of shard_size consecutive ranks ([0, shard_size), [shard_size, 2 shard_size),
 * ...) and replicate groups across them (the ranks with the same rank % shard_size), so rank r
 * is rank r % shard_size of its shard group and rank r / shard_size of its replicate group.
 * shard_size must divide the world size (FSDP_EINVAL); 1 gives every rank whole parameters and
 * the world as replicas, the world size gives one shard group and replicate groups of one. The
 * caller owns both groups and destroys them (fsdp_pg_destroy) after the units that use them;
 * on failure both are NULL. */
int fu_hybrid_groups(fsdp_ctx_t *ctx, int shard_size, fsdp_pg_t **shard_pg,
                     fsdp_pg_t **replicate_pg);

/* TransformerWithSharedParams' get_input and forward; *tgt_out (may be NULL) receives the
 * target ids for the loss (a new reference). */
int fu_transformer_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out,
                           fsdp_tensor_t **tgt_out);

/* The same under no_grad (grad mode restored afterwards). */
int fu_no_grad_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out);

/* CORE-PI-01's change after init on a wrapped TransformerWithSharedParams m: draws normal(0, 1)
 * values (after tm_manual_seed(ctx, seed), so twins get the same change) into the local shard
 * of root's unit: into the flat parameter, or with use_orig_params into the tied embedding
 * weight's shard view, whose layout is checked first. Records its checks on r. Returns 0 when
 * the shard was changed, 1 when a check failed (the caller stops), or a library error (recorded
 * with fu_fatal). */
int fu_change_root_shard(fu_res_t *r, fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_unit_t *root,
                         bool orig, uint64_t seed);

/* ---- unit state and hooks -------------------------------------------------------------------- */

/* Whether every unit of root's tree is in state st and (un)sharded as asked (a NO_SHARD unit
 * always holds its full parameters, so it passes either way). */
bool fu_tree_in_state(const fsdp_unit_t *root, fsdp_training_state_t st, bool unsharded);

/* fu_tree_in_state(root, FSDP_STATE_IDLE, false): every unit IDLE and resharded. */
bool fu_tree_idle(const fsdp_unit_t *root);

/* Every unit IDLE; otherwise false with the first offender in why. */
bool fu_all_idle(fsdp_unit_t *const *u, size_t n, char *why, size_t len);

/* No unit holds its unsharded parameters (root included); otherwise false with the first
 * offender in why. */
bool fu_none_unsharded(fsdp_unit_t *const *u, size_t n, char *why, size_t len);

/* CORE-H03's registration counters: every unit's n_pre_bwd_registered == k and
 * n_post_bwd_registered == k * post_mult[i]; otherwise false with the offenders in why. */
bool fu_counters_are(fsdp_unit_t *const *u, size_t n, const int *post_mult, uint64_t k, char *why,
                     size_t len);

/* A backward hook on a unit's module, added after wrapping (so it runs after FSDP's): counts
 * the unit's backward passes and how many of them left its parameters unsharded. */
typedef struct fu_bwd_watch {
    fsdp_unit_t *u;
    int calls;
    int unsharded_after;
} fu_bwd_watch_t;

/* Watches each of the n units (w has n entries and must outlive the module's hooks). */
int fu_watch_units(fsdp_unit_t *const *u, size_t n, fu_bwd_watch_t *w);

/* Each watched unit went through backward `calls` times in all and was resharded every time;
 * otherwise false with the offenders in why. */
bool fu_watched(const fu_bwd_watch_t *w, size_t n, int calls, char *why, size_t len);

/* ---- this rank's shards against full reference tensors ------------------------------------- */

/* The full tensor a shard is compared with, by the parameter's name relative to the root. */
typedef fsdp_tensor_t *(*fu_expect_fn)(void *arg, const char *fqn);
/* arg is a reference module: its parameter of that name, or that parameter's gradient. */
fsdp_tensor_t *fu_ref_param(void *arg, const char *fqn);
fsdp_tensor_t *fu_ref_grad(void *arg, const char *fqn);
/* Compares this rank's part of every parameter (grads: of every sharded gradient) of root's
 * units (only: of that unit alone, when not NULL) with the matching elements of the expected
 * full tensors. Returns the worst fu_closeness() (> 1: not close), or INFINITY with the reason
 * in why when something is missing or of another dtype than f32 (sharded parameters and
 * gradients are the parameters' f32). */
double fu_shards_vs(fsdp_unit_t *root, const fsdp_unit_t *only, bool grads, fu_expect_fn expect,
                    void *arg, double rtol, double atol, char *why, size_t len);

#endif /* FSDP_TEST_FSDP_UTIL_H */
