/*
 * nccl_stub.c: the NCCL API of a libfsdp built without NCCL.
 *
 * The public functions of fsdp/nccl.h exist in every build, so that the exported symbols do not
 * depend on configure; here they report that the backend is missing.
 */
#include <string.h>

#include "internal.h"

void fsdp_nccl_options_init(fsdp_nccl_options_t *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->device = -1;
}

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
