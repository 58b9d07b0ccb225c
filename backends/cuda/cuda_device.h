/* SPDX-License-Identifier: MIT */
/*
 * cuda_device.h: the CUDA device's vtable and what the layers above may ask of a CUDA device
 * beyond it (internal to libfsdp; nothing here is exported).
 *
 * A CUDA device (fsdp_device_create(ctx, FSDP_DEVICE_CUDA, opts)) owns one GPU (opts->ordinal)
 * for one rank: a compute stream on which every kernel, and every copy given no stream, runs in
 * issue order (a blocking stream, so that it is ordered with the legacy default stream, where a
 * process group given no stream works); cuBLAS/cuBLASLt handles on that stream; and a caching
 * allocator (cuda_alloc.h) whose blocks belong to the compute stream. Memory that work on another
 * stream (a communication stream) reads or writes must be announced with fsdp__cuda_record_stream()
 * before it is freed, or the allocator may hand it out again while that work still runs.
 *
 * Host memory for CPU offload: fsdp__cuda_host_alloc() gives page-locked (pinned) host memory,
 * counted in the rank's accounting under the category given (FSDP_MEM_OFFLOAD for offloaded
 * parameters and gradients), which copies to and from the device can use asynchronously.
 */
#ifndef FSDP_CUDA_DEVICE_H
#define FSDP_CUDA_DEVICE_H

#include <stdbool.h>
#include <stddef.h>

#include "device/block_cache.h"
#include "device/device_impl.h"

extern const struct fsdp_dev_ops fsdp__cuda_dev_ops;

/* Number of visible CUDA devices (0 without a driver or GPU); `why` (cap bytes, may be NULL)
 * gets the runtime's message when it reported an error. */
int fsdp__cuda_visible_devices(char *why, size_t cap);

/* Pinned host memory of `bytes` (64-byte aligned, bytes == 0 gives NULL) counted under cat on
 * dev's context; FSDP_ENOMEM or FSDP_EBACKEND with a message. Free with fsdp__cuda_host_free
 * (NULL accepted). dev must be a CUDA device. */
int fsdp__cuda_host_alloc(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, void **out);
void fsdp__cuda_host_free(fsdp_device_t *dev, void *ptr);

/* ptr (inside a live allocation of dev) is used by work queued on native stream `stream`
 * (fsdp_stream_native()); its memory is not reused until that work has completed. */
int fsdp__cuda_record_stream(fsdp_device_t *dev, void *ptr, void *stream);

/* The allocator's counters; gives back cached segments (returns the bytes released). */
void fsdp__cuda_alloc_stats(fsdp_device_t *dev, fsdp_bcache_stats_t *out);
size_t fsdp__cuda_empty_cache(fsdp_device_t *dev);

/* f32 matrix products on TF32 tensor cores (off by default: full f32, as the CPU; the
 * FSDP_CUDA_TF32=1 environment variable turns it on at creation). */
void fsdp__cuda_set_tf32(fsdp_device_t *dev, bool on);

/* The compute stream (a cudaStream_t). */
void *fsdp__cuda_compute_stream(fsdp_device_t *dev);

#endif /* FSDP_CUDA_DEVICE_H */
