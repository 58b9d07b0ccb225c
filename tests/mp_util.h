/* SPDX-License-Identifier: MIT */
/*
 * mp_util.h: what the mixed-precision test programs (t_mp_e2e.c, t_mp_eval.c) share: upstream's
 * LinearMixedPrecision models (Linear(D, D) with an f64 buffer, simple or nested), a reference
 * that applies FSDP's casts by hand, and small value checks.
 */
#ifndef FSDP_TEST_MP_UTIL_H
#define FSDP_TEST_MP_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

#define D 10    /* Linear(D, D) */
#define BATCH 3 /* rand(BATCH, D) inputs */
#define NLIN_MAX 2

/* The weights' names in the simple ([0]) and nested ([1]) models. */
extern const char *const mpt_WNAME[2][NLIN_MAX];

/* The reference's state: the masters (per Linear, D*D doubles) of one model. */
typedef struct mpt_ref {
    int nlin;
    double w[NLIN_MAX][D * D];
} mpt_ref_t;

/* "<phase>: <what>" in buf (a check's name). */
const char *mpt_nm(char *buf, size_t len, const char *ph, const char *what);
/* A check's name "<phase>: <what>" from the caller's `name` buffer and `ph`. */
#define NM(what) mpt_nm(name, sizeof name, ph, what)

/* Parameter `name` of m replaced by a copy in dt (a leaf that requires a gradient). */
int mpt_param_to(fsdp_module_t *m, const char *name, fsdp_dtype_t dt);

/* Linear(D, D, no bias) with its weight in dt and an f64 buffer "buffer" (1, 2), as upstream's
 * LinearMixedPrecision; drawn after tm_manual_seed(ctx, seed). */
int mpt_lmp_create(fsdp_ctx_t *ctx, uint64_t seed, fsdp_dtype_t dt, fsdp_module_t **out);

/* The simple model (one Linear) or the nested one (Sequential of two). */
int mpt_model_create(fsdp_ctx_t *ctx, bool nested, fsdp_dtype_t dt, fsdp_module_t **out);

/* max |a - e| / (rel * max |e| + abs) over n values (> 1: not close). */
double mpt_scaled_err(const double *a, const double *e, int64_t n, double rel, double abs_);

/* t's elements as doubles (n of them; t must have exactly n). */
int mpt_read_vals(const fsdp_tensor_t *t, double *v, int64_t n);

/* x in dt (a new reference; the same tensor when it already is). */
int mpt_cast_to(fsdp_tensor_t *x, fsdp_dtype_t dt, fsdp_tensor_t **out);

/* Whether every buffer of m has dtype dt; else the first offender in why. */
bool mpt_buffers_are(fsdp_module_t *m, fsdp_dtype_t dt, char *why, size_t len);

/* Whether no unit of root's tree holds unsharded parameter bytes. */
bool mpt_none_unsharded_bytes(fsdp_unit_t *root, char *why, size_t len);

/* Sum over root's units of their padded flat numel. */
int64_t mpt_total_padded(fsdp_unit_t *root);

/* Summons root with its gradients (use_orig_params) and compares every gradient of m with
 * `times` x the twin's under the same name (the twin is a local model); *worst receives the
 * largest mpt_scaled_err(rel, abs_) (INFINITY when a gradient is missing, named in why). Returns a
 * library error, else 0. */
int mpt_grads_vs_twin(fsdp_unit_t *root, fsdp_module_t *m, fsdp_module_t *twin, double times,
                      double rel, double abs_, double *worst, char *why, size_t len);

/* The end of an iteration: its tensors released (those given; the pointers cleared) and the
 * graph dropped. */
void mpt_drop_iteration(fsdp_ctx_t *ctx, fsdp_tensor_t **x, fsdp_tensor_t **out,
                        fsdp_tensor_t **loss);

/*
 * Gradients of sum(model(x)) for the weights w with the same casts as FSDP: weights (and x,
 * when the root casts it) in cdt, the gradient then cast to rdt; g[k] receives them in double.
 * `local` is an unwrapped model whose weights this replaces.
 */
int mpt_ref_grads(fsdp_ctx_t *ctx, fsdp_module_t *local, const mpt_ref_t *r, bool nested,
                  fsdp_dtype_t mdt, fsdp_dtype_t cdt, fsdp_dtype_t rdt, bool cast_in,
                  fsdp_tensor_t *x, double g[NLIN_MAX][D * D], double *loss, double *l1);

/* Rank q's input of iteration it, in dt. */
int mpt_rank_input(fsdp_ctx_t *ctx, int it, int q, fsdp_dtype_t dt, fsdp_tensor_t **x);

#endif /* FSDP_TEST_MP_UTIL_H */
