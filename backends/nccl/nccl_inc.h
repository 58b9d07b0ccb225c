/* SPDX-License-Identifier: MIT */
/*
 * nccl_inc.h: nccl.h, without the warnings its old-style declarations (f() for f(void)) give
 * under -Wstrict-prototypes.
 */
#ifndef FSDP_NCCL_INC_H
#define FSDP_NCCL_INC_H

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#endif /* FSDP_NCCL_INC_H */
