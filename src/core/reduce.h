/* SPDX-License-Identifier: MIT */
/*
 * reduce.h: elementwise reductions in input order, shared by every CPU backend.
 *
 * out = in[0] op in[1] op ... op in[nin-1], evaluated left to right for every element, with
 * f16/bf16 accumulated in f32 and rounded once, so any backend that reduces through these
 * functions gets the same bits for the same inputs in the same order.
 */
#ifndef FSDP_REDUCE_H
#define FSDP_REDUCE_H

#include <stddef.h>

#include <fsdp/dtype.h>
#include <fsdp/redop.h>

/* 1 when op is defined on dt (avg is not defined on bool). */
int fsdp__redop_supported(fsdp_dtype_t dt, fsdp_redop_t op);

/*
 * Reduces elements [0, n) of the nin inputs and writes the result to each of the nout outputs.
 * `divisor` is what avg divides the sum by (the group size). A nonzero `prescale` with op sum
 * on a floating dtype multiplies every input by it first, each product rounded to the dtype
 * (the collective descriptor's prescale, pg.h); it is ignored otherwise. Outputs may alias
 * inputs (each block of up to 2048 elements is read completely before it is written), but
 * outputs must not overlap each other. dt and op must be valid and supported (the caller has
 * checked). Returns FSDP_OK, or FSDP_ENOMEM when more than 64 inputs need a pointer list that
 * cannot be allocated.
 */
int fsdp__reduce(void *const *outs, int nout, const void *const *ins, int nin, size_t n,
                 fsdp_dtype_t dt, fsdp_redop_t op, int divisor, double prescale);

#endif /* FSDP_REDUCE_H */
