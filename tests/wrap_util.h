/* SPDX-License-Identifier: MIT */
/*
 * wrap_util.h: what the wrap tests share (t_wrap.c, t_wrap_train.c, t_wrap_policy.c): stderr
 * capture for the functions that have no context, test_wrap.py's MyModel, the custom policies
 * of WRAP-TA-08 and WRAP-TA-17, and the unit listing the tests compare.
 */
#ifndef FSDP_TESTS_WRAP_UTIL_H
#define FSDP_TESTS_WRAP_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

/* Redirects stderr into a temporary file until wu_stderr_end(), which restores it and copies
 * what was written (cut to n - 1 bytes) into buf. One capture at a time, main thread only. */
void wu_stderr_begin(void);
void wu_stderr_end(char *buf, size_t n);

/* test_wrap.py's MyModel: lin1, lin2, lin3 Linear(1, 1, no bias), lin4 Nested{nested_lin
 * Linear(1, 1, no bias)}; with nested, lin1 is Sequential(Linear, Linear) instead. Children
 * run in order. Seeded 0. */
int wu_my_model(fsdp_ctx_t *c, bool nested, fsdp_module_t **out);

/* MyModel's module type: runs its children in registration order, each on the previous one's
 * output. */
extern const fsdp_module_ops_t wu_mymodel_ops;
/* Adds child under name; the parent takes the reference over (also on failure; NULL child:
 * FSDP_ENOMEM). */
int wu_adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child);
/* Linear(1, 1, no bias); NULL on failure. */
fsdp_module_t *wu_lin11(fsdp_ctx_t *c);

/* Policies that bail out of the test when they cannot be made. */
fsdp_policy_t *wu_size_policy(int64_t min_num_params);
fsdp_policy_t *wu_always_policy(void);

/* The FQNs of root's units in pre-order, "(root)" for the root, '|'-separated (a thread-local
 * static buffer). */
const char *wu_unit_names(const fsdp_unit_t *root);

/* WRAP-TA-08's custom policy over TransformerWithSharedParams (arg: struct wu_ta08): encoder
 * layers become units; decoder layers become SHARD_GRAD_OP/BACKWARD_POST units and bn a NO_SHARD
 * unit, or plain units when uniform. */
struct wu_ta08 {
    bool uniform;
    fsdp_module_t *bn;
};
int wu_ta08_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg);

/* WRAP-TA-17's LoraModel layer kinds (NULL-terminated) and the custom policy that wraps them
 * (arg: a bool, uniform): LoraAttention gets SHARD_GRAD_OP unless uniform. */
extern const char *const wu_lora_types[];
int wu_lora_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg);

#endif /* FSDP_TESTS_WRAP_UTIL_H */
