/* SPDX-License-Identifier: MIT */
/*
 * nccl_pg.h: the NCCL group's entry points, which the CUDA plugin's table (cuda_plugin.c) hands
 * to nccl_api.c; they behave as fsdp_pg_create_nccl() and fsdp_nccl_device() of fsdp/nccl.h.
 */
#ifndef FSDP_NCCL_PG_H
#define FSDP_NCCL_PG_H

#include <fsdp/nccl.h>

int fsdp__nccl_create(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_nccl_options_t *o,
                      fsdp_pg_t **out);
int fsdp__nccl_device(const fsdp_pg_t *pg);

#endif /* FSDP_NCCL_PG_H */
