/* SPDX-License-Identifier: MIT */
/*
 * nccl_kernels.cu: widening, rounding and division kernels of the NCCL backend
 * (nccl_kernels.h). Grid-stride loops over size_t indices, so any n fits one launch.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <fsdp/dtype.h>

#include "backends/nccl/nccl_kernels.h"

namespace {

const int kThreads = 256;

unsigned blocks_for(size_t n) {
    size_t b = (n + kThreads - 1) / kThreads;
    return (unsigned)(b > 65535 ? 65535 : (b == 0 ? 1 : b));
}

__global__ void widen_f16(const __half *src, float *dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __half2float(src[i]);
}

__global__ void widen_bf16(const __nv_bfloat16 *src, float *dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

__global__ void narrow_f16(const float *src, __half *dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2half_rn(src[i]);
}

__global__ void narrow_bf16(const float *src, __nv_bfloat16 *dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

template <typename T> __global__ void divide(T *buf, size_t n, T d) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        buf[i] = buf[i] / d;
}

} // namespace

extern "C" int fsdp__nccl_widen(const void *src, float *dst, size_t n, int dtype, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0) return 0;
    if (dtype == FSDP_DTYPE_F16)
        widen_f16<<<blocks_for(n), kThreads, 0, s>>>((const __half *)src, dst, n);
    else if (dtype == FSDP_DTYPE_BF16)
        widen_bf16<<<blocks_for(n), kThreads, 0, s>>>((const __nv_bfloat16 *)src, dst, n);
    else
        return (int)cudaErrorInvalidValue;
    return (int)cudaGetLastError();
}

extern "C" int fsdp__nccl_narrow(const float *src, void *dst, size_t n, int dtype, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0) return 0;
    if (dtype == FSDP_DTYPE_F16)
        narrow_f16<<<blocks_for(n), kThreads, 0, s>>>(src, (__half *)dst, n);
    else if (dtype == FSDP_DTYPE_BF16)
        narrow_bf16<<<blocks_for(n), kThreads, 0, s>>>(src, (__nv_bfloat16 *)dst, n);
    else
        return (int)cudaErrorInvalidValue;
    return (int)cudaGetLastError();
}

extern "C" int fsdp__nccl_divide(void *buf, size_t n, int dtype, int divisor, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0) return 0;
    switch (dtype) {
    case FSDP_DTYPE_F32:
        divide<float><<<blocks_for(n), kThreads, 0, s>>>((float *)buf, n, (float)divisor);
        break;
    case FSDP_DTYPE_F64:
        divide<double><<<blocks_for(n), kThreads, 0, s>>>((double *)buf, n, (double)divisor);
        break;
    case FSDP_DTYPE_I32:
        divide<int32_t><<<blocks_for(n), kThreads, 0, s>>>((int32_t *)buf, n, (int32_t)divisor);
        break;
    case FSDP_DTYPE_I64:
        divide<int64_t><<<blocks_for(n), kThreads, 0, s>>>((int64_t *)buf, n, (int64_t)divisor);
        break;
    case FSDP_DTYPE_U8:
        divide<uint8_t><<<blocks_for(n), kThreads, 0, s>>>((uint8_t *)buf, n, (uint8_t)divisor);
        break;
    default:
        return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
