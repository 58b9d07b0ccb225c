/* SPDX-License-Identifier: MIT */
/*
 * plugin.h: libfsdp's loader of the CUDA plugin (plugin.c), for the launch layer's entries that
 * reach CUDA or NCCL (fsdp_device_create for CUDA devices, fsdp_pg_create_nccl). The interface
 * between libfsdp and the plugin is backends/plugin_abi.h.
 */
#ifndef FSDP_LAUNCH_PLUGIN_H
#define FSDP_LAUNCH_PLUGIN_H

#include "backends/plugin_abi.h"

/* The plugin's table, loading the plugin on first use (thread-safe; a failed load is retried
 * by the next call). On failure returns FSDP_ENOTSUP with a message on ctx (may be NULL) that
 * starts with `who` and names the paths tried with dlerror()'s text. */
int fsdp__plugin_get(fsdp_ctx_t *ctx, const char *who, const struct fsdp_plugin **out);

/* The plugin's table when it is already loaded, else NULL; never loads anything. */
const struct fsdp_plugin *fsdp__plugin_loaded(void);

#endif /* FSDP_LAUNCH_PLUGIN_H */
