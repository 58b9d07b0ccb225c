/* SPDX-License-Identifier: MIT */
/*
 * fsdp/dtype.h: element types and conversions between them.
 *
 * f16 is IEEE 754 binary16 and bf16 is the upper half of a binary32. Conversions from f32 to
 * f16/bf16 round to nearest, ties to even, keep infinities, produce subnormals where the value
 * calls for them, and turn NaN into a quiet NaN of the same sign (the payload's top bits are
 * kept where they fit). Conversions to f32 are exact.
 */
#ifndef FSDP_DTYPE_H
#define FSDP_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef enum fsdp_dtype {
    FSDP_DTYPE_F32 = 0,
    FSDP_DTYPE_F64,
    FSDP_DTYPE_F16,
    FSDP_DTYPE_BF16,
    FSDP_DTYPE_I32,
    FSDP_DTYPE_I64,
    FSDP_DTYPE_U8,
    FSDP_DTYPE_BOOL, /* one byte, 0 or 1 */
    FSDP_DTYPE_COUNT
} fsdp_dtype_t;

/* 1 when `dt` names one of the types above, else 0. */
FSDP_EXTERN int fsdp_dtype_valid(int dt);

/* Size in bytes of one element; 0 for an invalid dtype. */
FSDP_EXTERN size_t fsdp_dtype_size(fsdp_dtype_t dt);

/* Short lower-case name ("f32", "bf16"); "invalid" for an invalid dtype. */
FSDP_EXTERN const char *fsdp_dtype_name(fsdp_dtype_t dt);

/* 1 for f32, f64, f16 and bf16; 0 otherwise. */
FSDP_EXTERN int fsdp_dtype_is_float(fsdp_dtype_t dt);

/* Parses a name as printed by fsdp_dtype_name() (also "float32", "float16", "bfloat16", ...;
 * case-sensitive). Returns FSDP_EINVAL when the name is unknown, leaving *out untouched. */
FSDP_EXTERN int fsdp_dtype_from_name(const char *name, fsdp_dtype_t *out);

/* Scalar conversions (bit patterns of the 16-bit types as uint16_t). */
FSDP_EXTERN uint16_t fsdp_f32_to_f16(float x);
FSDP_EXTERN float fsdp_f16_to_f32(uint16_t h);
FSDP_EXTERN uint16_t fsdp_f32_to_bf16(float x);
FSDP_EXTERN float fsdp_bf16_to_f32(uint16_t h);

/*
 * Converts n elements from `src` (type st) to `dst` (type dt). Conversions to a floating type
 * round to nearest even, once (f64 and i64 to f16/bf16 do not go through f32). Floating to
 * integer conversions truncate toward zero and saturate at the integer type's range; NaN becomes
 * 0. Integer to integer conversions saturate too (i64 to i32, anything to u8). Conversions to
 * bool give 1 for any nonzero value (NaN included); a bool source byte other than 0 reads as 1.
 * dst and src must not overlap unless they are the same pointer and the types have the same
 * size. Returns FSDP_EINVAL for an invalid dtype, a NULL pointer with n > 0, any other overlap,
 * or n so large that the byte count overflows.
 */
FSDP_EXTERN int fsdp_dtype_convert(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st,
                                   size_t n);

FSDP_END_DECLS

#endif /* FSDP_DTYPE_H */
