/* SPDX-License-Identifier: MIT */
/*
 * model_impl.h: what the files of the cluster model (fsdp/cluster.h) share.
 *
 * Every public entry checks its arguments once with these checks, passing its own name so that
 * a message says which call refused which field. The checks never write their inputs.
 */
#ifndef FSDP_MODEL_IMPL_H
#define FSDP_MODEL_IMPL_H

#include <fsdp/cluster.h>

#include "internal.h"

/* The model's errors: on ctx's last error, or logged when ctx is NULL (fsdp/cluster.h). */
#define fsdp__model_err fsdp__ctx_err_or_log

/* The checks of fsdp_net_model_check, fsdp_compute_model_check and fsdp_net_group_check, with
 * the calling function's name `who` at the head of the message. */
int fsdp__net_model_check(fsdp_ctx_t *ctx, const char *who, const fsdp_net_model_t *net);
int fsdp__compute_model_check(fsdp_ctx_t *ctx, const char *who, const fsdp_compute_model_t *m);
int fsdp__net_group_check(fsdp_ctx_t *ctx, const char *who, const fsdp_net_model_t *net,
                          const fsdp_net_group_t *g);

#endif /* FSDP_MODEL_IMPL_H */
