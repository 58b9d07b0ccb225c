/* SPDX-License-Identifier: MIT */
/*
 * nccl_map.c: libfsdp dtypes and operators on NCCL (see nccl_map.h).
 */
#include <stdio.h>
#include <string.h>

#include "backends/nccl/nccl_map.h"
#include "internal.h"

static int reduces(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE || k == FSDP_COLL_REDUCE;
}

int fsdp__nccl_plan(fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op, fsdp_nccl_plan_t *plan,
                    char *msg, size_t cap) {
    memset(plan, 0, sizeof *plan);
    switch (dt) {
    case FSDP_DTYPE_F32:
        plan->type = ncclFloat32;
        break;
    case FSDP_DTYPE_F64:
        plan->type = ncclFloat64;
        break;
    case FSDP_DTYPE_F16:
        plan->type = ncclFloat16;
        break;
    case FSDP_DTYPE_BF16:
        plan->type = ncclBfloat16;
        break;
    case FSDP_DTYPE_I32:
        plan->type = ncclInt32;
        break;
    case FSDP_DTYPE_I64:
        plan->type = ncclInt64;
        break;
    case FSDP_DTYPE_U8:
        plan->type = ncclUint8;
        break;
    case FSDP_DTYPE_BOOL:
        plan->type = ncclUint8;
        break; /* one byte, 0 or 1 */
    default:
        snprintf(msg, cap, "nccl: dtype %d has no NCCL type", (int)dt);
        return FSDP_ENOTSUP;
    }
    if (!reduces(kind)) return FSDP_OK;
    switch (op) {
    case FSDP_REDOP_SUM:
        plan->op = ncclSum;
        break;
    case FSDP_REDOP_PROD:
        plan->op = ncclProd;
        break;
    case FSDP_REDOP_MIN:
        plan->op = ncclMin;
        break;
    case FSDP_REDOP_MAX:
        plan->op = ncclMax;
        break;
    case FSDP_REDOP_AVG:
        plan->op = ncclSum;
        plan->divide = 1;
        break;
    default:
        snprintf(msg, cap, "nccl: reduction operator %d has no NCCL operator", (int)op);
        return FSDP_ENOTSUP;
    }
    if (dt == FSDP_DTYPE_BOOL) {
        /* On 0/1 bytes, "or" is the max and "and" the min. */
        if (op == FSDP_REDOP_AVG) {
            snprintf(msg, cap, "nccl: %s: avg is not defined on bool", fsdp_coll_name(kind));
            return FSDP_ENOTSUP;
        }
        plan->op = op == FSDP_REDOP_SUM || op == FSDP_REDOP_MAX ? ncclMax : ncclMin;
    }
    /* 16-bit floats accumulate in f32: min and max are exact in the type itself. */
    if ((dt == FSDP_DTYPE_F16 || dt == FSDP_DTYPE_BF16) && op != FSDP_REDOP_MIN &&
        op != FSDP_REDOP_MAX) {
        plan->widen = 1;
        plan->type = ncclFloat32;
    }
    return FSDP_OK;
}

const char *fsdp__nccl_type_name(ncclDataType_t t) {
    switch (t) {
    case ncclInt8:
        return "ncclInt8";
    case ncclUint8:
        return "ncclUint8";
    case ncclInt32:
        return "ncclInt32";
    case ncclUint32:
        return "ncclUint32";
    case ncclInt64:
        return "ncclInt64";
    case ncclUint64:
        return "ncclUint64";
    case ncclFloat16:
        return "ncclFloat16";
    case ncclFloat32:
        return "ncclFloat32";
    case ncclFloat64:
        return "ncclFloat64";
    case ncclBfloat16:
        return "ncclBfloat16";
    default:
        return "ncclType?";
    }
}

const char *fsdp__nccl_op_name(ncclRedOp_t op) {
    switch (op) {
    case ncclSum:
        return "ncclSum";
    case ncclProd:
        return "ncclProd";
    case ncclMax:
        return "ncclMax";
    case ncclMin:
        return "ncclMin";
    case ncclAvg:
        return "ncclAvg";
    default:
        return "ncclOp?";
    }
}
