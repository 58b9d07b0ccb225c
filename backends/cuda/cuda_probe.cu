/* SPDX-License-Identifier: MIT */
/*
 * cuda_probe.cu: device discovery and a fill kernel (see cuda_probe.h).
 *
 * Every CUDA error is translated here, into an FSDP_E* code and a message; nothing throws or
 * aborts.
 */
#include <stdio.h>

#include <cuda_runtime.h>

#include <fsdp/errno.h>

#include "backends/cuda/cuda_probe.h"

static int cuda_fail(cudaError_t e, const char *what, char *why, size_t cap) {
    if (why && cap) snprintf(why, cap, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return FSDP_EBACKEND;
}

__global__ static void fill_iota(float *out, size_t n, float value) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) out[i] = value + (float)i;
}

extern "C" int fsdp__cuda_device_count(char *why, size_t cap) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cuda_fail(e, "cudaGetDeviceCount", why, cap);
        return 0;
    }
    return count;
}

extern "C" int fsdp__cuda_fill_iota(int dev, float *out, size_t n, float value, char *why,
                                    size_t cap) {
    float *d = NULL;
    int rc = FSDP_OK;
    cudaError_t e;
    if ((e = cudaSetDevice(dev)) != cudaSuccess) return cuda_fail(e, "cudaSetDevice", why, cap);
    if (n == 0) return FSDP_OK;
    if ((e = cudaMalloc((void **)&d, n * sizeof *d)) != cudaSuccess)
        return cuda_fail(e, "cudaMalloc", why, cap);
    {
        unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
        fill_iota<<<blocks, 256>>>(d, n, value);
        if ((e = cudaGetLastError()) != cudaSuccess) {
            rc = cuda_fail(e, "fill_iota launch", why, cap);
        } else if ((e = cudaMemcpy(out, d, n * sizeof *d, cudaMemcpyDeviceToHost)) !=
                   cudaSuccess) {
            rc = cuda_fail(e, "cudaMemcpy", why, cap);
        }
    }
    cudaFree(d);
    return rc;
}
