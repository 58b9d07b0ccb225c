/* SPDX-License-Identifier: MIT */
/*
 * nccl_kernels.h: the GPU work the NCCL backend does around NCCL's calls (nccl_map.h says
 * when): widening f16/bf16 to f32, rounding f32 back once, and dividing by the group size for
 * avg. Each enqueues one kernel on `stream` and returns the CUDA status of the launch (0, or a
 * cudaError_t value).
 */
#ifndef FSDP_NCCL_KERNELS_H
#define FSDP_NCCL_KERNELS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = (float)src[i] for n elements of fsdp dtype `dtype` (F16 or BF16). */
int fsdp__nccl_widen(const void *src, float *dst, size_t n, int dtype, void *stream);

/* dst[i] = src[i] rounded to nearest even in `dtype` (F16 or BF16). */
int fsdp__nccl_narrow(const float *src, void *dst, size_t n, int dtype, void *stream);

/* buf[i] /= divisor for n elements of `dtype` (F32, F64, I32, I64, U8; integer division
 * truncates toward zero). */
int fsdp__nccl_divide(void *buf, size_t n, int dtype, int divisor, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_NCCL_KERNELS_H */
