/* SPDX-License-Identifier: MIT */
/*
 * cuda_plugin.c: the table of the CUDA plugin (backends/plugin_abi.h): the CUDA device's vtable and,
 * when NCCL is built, the NCCL group's entry points.
 *
 * It is part of the plugin's code (libfsdp_cuda_core.la): libfsdp-cuda.so returns it from its
 * entry point (plugin_entry.c), and programs that link the plugin's code statically reach it
 * through src/launch/plugin.c's weak reference.
 */
#include <config.h>

#include "backends/cuda/cuda_device.h"
#include "backends/plugin_abi.h"
#ifdef FSDP_HAVE_NCCL
#include "backends/nccl/nccl_pg.h"
#endif

const struct fsdp_plugin fsdp__cuda_plugin = {
    .abi = FSDP_PLUGIN_ABI,
    .size = sizeof(struct fsdp_plugin),
    .version = PACKAGE_VERSION,
    .cuda_dev_ops = &fsdp__cuda_dev_ops,
#ifdef FSDP_HAVE_NCCL
    .nccl_create = fsdp__nccl_create,
    .nccl_device = fsdp__nccl_device,
#endif
};
