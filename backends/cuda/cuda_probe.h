/* SPDX-License-Identifier: MIT */
/*
 * cuda_probe.h: the first CUDA code of libfsdp: device discovery and a fill kernel.
 *
 * This is the seed of the CUDA device (a later release puts the whole device vtable behind it);
 * it exists so that a --with-cuda build compiles a .cu file through libtool and links the CUDA
 * runtime, and so that make check-gpu has a kernel to check against the CPU.
 */
#ifndef FSDP_CUDA_PROBE_H
#define FSDP_CUDA_PROBE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of visible CUDA devices; 0 when there is none or no driver. With a message in
 * `why` (cap bytes) when the runtime reported an error. */
int fsdp__cuda_device_count(char *why, size_t cap);

/* Fills n floats of host memory `out` with value + index by running a kernel on device `dev`
 * (through device memory). Returns 0 or a negative FSDP_E* code with a message in `why`. */
int fsdp__cuda_fill_iota(int dev, float *out, size_t n, float value, char *why, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_CUDA_PROBE_H */
