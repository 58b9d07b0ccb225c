/* SPDX-License-Identifier: MIT */
/*
 * nccl_map.h: how a libfsdp collective's dtype and operator run on NCCL.
 *
 * One table decides, for a (kind, dtype, op), NCCL's data type and operator and the work done
 * around the NCCL call on the GPU: widening 16-bit floats to f32 (so that they accumulate in f32
 * and round once, as fsdp/pg.h requires) and dividing the sum by the group size (avg). The
 * table needs nccl.h only, so it is tested on hosts without a GPU.
 */
#ifndef FSDP_NCCL_MAP_H
#define FSDP_NCCL_MAP_H

#include <stddef.h>

#include "backends/nccl/nccl_inc.h"

#include <fsdp/dtype.h>
#include <fsdp/pg.h>

typedef struct fsdp_nccl_plan {
    ncclDataType_t type; /* NCCL's type of the elements it moves (f32 when widened) */
    ncclRedOp_t op;      /* reductions only */
    int widen;           /* f16/bf16: convert to f32 before, round back after */
    int divide;          /* avg: divide the (widened) sum by the group size after */
} fsdp_nccl_plan_t;

/*
 * Fills *plan for a collective of `kind` on `dt` with `op` (ignored unless kind reduces).
 * Returns FSDP_OK, or FSDP_ENOTSUP with a message in msg (cap bytes) for a combination NCCL
 * cannot run (avg on bool; a dtype or op this table does not know).
 */
int fsdp__nccl_plan(fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op, fsdp_nccl_plan_t *plan,
                    char *msg, size_t cap);

/* NCCL's name of a data type or operator ("ncclFloat32", "ncclSum"), for messages and tests. */
const char *fsdp__nccl_type_name(ncclDataType_t t);
const char *fsdp__nccl_op_name(ncclRedOp_t op);

#endif /* FSDP_NCCL_MAP_H */
