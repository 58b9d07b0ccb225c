/* SPDX-License-Identifier: MIT */
/*
 * nccl_api.c: the public NCCL API (fsdp/nccl.h) in libfsdp itself, in every build.
 *
 * The group is in the CUDA plugin (backends/nccl/nccl_pg.c, see backends/plugin_abi.h), so that
 * libfsdp.so does not link NCCL: creating a group opens the plugin on first use, which is why
 * these entries sit in the launch layer, above the backends. Without NCCL these functions say
 * that the backend is missing, and the exported symbols do not depend on configure.
 */
#include <config.h>

#include <string.h>

#include <fsdp/nccl.h>

#include "internal.h"
#include "pg/pg_impl.h"
#ifdef FSDP_HAVE_NCCL
#include "launch/plugin.h"
#endif

static const fsdp__abi_struct_t nccl_options_abi =
    FSDP__ABI_STRUCT(fsdp_nccl_options_t, "fsdp_nccl_options_init", timeout_ms);

void(fsdp_nccl_options_init)(fsdp_nccl_options_t *o, size_t size) {
    fsdp_nccl_options_t d;
    memset(&d, 0, sizeof d);
    d.device = -1;
    fsdp__abi_init(o, size, &d, &nccl_options_abi);
}

#ifdef FSDP_HAVE_NCCL

/* The build has the group; whether its plugin loads is for fsdp_pg_create_nccl to say (with the
 * paths it tried), so this opens nothing. */
int fsdp_nccl_available(void) {
    return 1;
}

/* No NCCL group exists before the plugin is loaded, so this never loads it. */
int fsdp_nccl_device(const fsdp_pg_t *pg) {
    const struct fsdp_plugin *p = fsdp__plugin_loaded();
    return p && p->nccl_device ? p->nccl_device(pg) : -1;
}

int fsdp_pg_create_nccl(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_nccl_options_t *o,
                        fsdp_pg_t **out) {
    /* The arguments are checked here, before anything loads the plugin, and the plugin (built
     * with this libfsdp's headers: its version is checked) gets a copy of this layout. */
    int64_t timeout = 0;
    int rc = fsdp__abi_check(ctx, "fsdp_pg_create_nccl", "o", o, &nccl_options_abi);
    if (rc < 0) {
        if (out) *out = NULL;
        return rc;
    }
    rc = fsdp__pg_check_world_args(ctx, "fsdp_pg_create_nccl", store, out, o ? o->timeout_ms : 0,
                                   &timeout);
    if (rc < 0) return rc;
    fsdp_nccl_options_t oc;
    fsdp_nccl_options_init(&oc);
    if (o) fsdp__abi_copy_in(&oc, o, &nccl_options_abi);
    const struct fsdp_plugin *p = NULL;
    rc = fsdp__plugin_get(ctx, "fsdp_pg_create_nccl", &p);
    if (rc < 0) return rc;
    if (!p->nccl_create)
        return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                             "fsdp_pg_create_nccl: the CUDA plugin was built without NCCL");
    return p->nccl_create(ctx, store, &oc, out);
}

#else /* !FSDP_HAVE_NCCL */

int fsdp_nccl_available(void) {
    return 0;
}

int fsdp_nccl_device(const fsdp_pg_t *pg) {
    (void)pg;
    return -1;
}

int fsdp_pg_create_nccl(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_nccl_options_t *o,
                        fsdp_pg_t **out) {
    (void)store;
    (void)o;
    if (out) *out = NULL;
    if (!ctx) return FSDP_ENOTSUP;
    return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                         "fsdp_pg_create_nccl: this libfsdp was built without NCCL (configure "
                         "did not find CUDA and nccl.h with -lnccl; pass --with-cuda=DIR and "
                         "--with-nccl=DIR, then reconfigure)");
}

#endif /* FSDP_HAVE_NCCL */
