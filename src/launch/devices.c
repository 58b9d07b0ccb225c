/* SPDX-License-Identifier: MIT */
/*
 * devices.c: fsdp_device_create, the device backends by kind.
 *
 * The device layer (src/device/) builds a device over whichever vtable it is given
 * (fsdp__device_create); this table says which vtable serves each kind: the CPU device and the
 * shape-only device (backends/vsim/), linked in, and the CUDA device, from the CUDA plugin (launch/plugin.h) opened on its first creation.
 * A kind without an entry, or CUDA in a build without it, is FSDP_ENOTSUP. Adding a device
 * adds an entry here and touches no lower layer.
 */
#include <config.h>

#include <stddef.h>

#include <fsdp/device.h>

#include "backends/vsim/vsim_impl.h"
#include "device/device_impl.h"
#include "internal.h"
#ifdef FSDP_HAVE_CUDA
#include "launch/plugin.h"
#endif

/* Sets *ops to the vtable of a kind (NULL: not built in); a negative code when finding it
 * failed (the message is on ctx). */
typedef int (*resolve_fn)(fsdp_ctx_t *ctx, const struct fsdp_dev_ops **ops);

static int resolve_cpu(fsdp_ctx_t *ctx, const struct fsdp_dev_ops **ops) {
    (void)ctx;
    *ops = &fsdp__cpu_dev_ops;
    return FSDP_OK;
}

static int resolve_meta(fsdp_ctx_t *ctx, const struct fsdp_dev_ops **ops) {
    (void)ctx;
    *ops = &fsdp__meta_dev_ops;
    return FSDP_OK;
}

#ifdef FSDP_HAVE_CUDA
static int resolve_cuda(fsdp_ctx_t *ctx, const struct fsdp_dev_ops **ops) {
    const struct fsdp_plugin *plugin = NULL;
    int rc = fsdp__plugin_get(ctx, "fsdp_device_create", &plugin);
    if (rc < 0) return rc;
    *ops = plugin->cuda_dev_ops;
    return FSDP_OK;
}
#endif

static const resolve_fn resolvers[FSDP_DEVICE_KIND_COUNT] = {
    [FSDP_DEVICE_CPU] = resolve_cpu,
    [FSDP_DEVICE_META] = resolve_meta,
#ifdef FSDP_HAVE_CUDA
    [FSDP_DEVICE_CUDA] = resolve_cuda,
#endif
};

int fsdp_device_create(fsdp_ctx_t *ctx, fsdp_device_kind_t kind, const fsdp_device_options_t *opts,
                       fsdp_device_t **out) {
    const struct fsdp_dev_ops *ops = NULL;
    /* Bad arguments are the device layer's to report; a kind is resolved only for a call that
     * could succeed, so that a NULL out never loads the plugin. */
    if (ctx && out && (int)kind >= 0 && kind < FSDP_DEVICE_KIND_COUNT && resolvers[kind]) {
        int rc = resolvers[kind](ctx, &ops);
        if (rc < 0) {
            *out = NULL;
            return rc;
        }
    }
    return fsdp__device_create(ctx, kind, ops, opts, out);
}
