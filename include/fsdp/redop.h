/* SPDX-License-Identifier: MIT */
/*
 * fsdp/redop.h: reduction operators, the element-wise combinations that collectives and the
 * devices' reduction kernels apply (sum, average, min, max, product).
 *
 * The type lives with the core rather than with the process group because the layers below the
 * group reduce too: the core's reduction kernels and the devices' collective kernels.
 */
#ifndef FSDP_REDOP_H
#define FSDP_REDOP_H

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef enum fsdp_redop {
    FSDP_REDOP_SUM = 0,
    FSDP_REDOP_AVG,
    FSDP_REDOP_MIN,
    FSDP_REDOP_MAX,
    FSDP_REDOP_PROD,
    FSDP_REDOP_COUNT
} fsdp_redop_t;

/* "sum", "avg", ...; "invalid" otherwise. */
FSDP_EXTERN const char *fsdp_redop_name(fsdp_redop_t op);

FSDP_END_DECLS

#endif /* FSDP_REDOP_H */
