/* SPDX-License-Identifier: MIT */
/*
 * gloo_stub.c: the Gloo API of a libfsdp built without Gloo.
 *
 * The public functions of fsdp/gloo.h exist in every build, so that the exported symbols do not
 * depend on configure; here they report that the backend is missing.
 */
#include <string.h>

#include <fsdp/gloo.h>

#include "backends/gloo/gloo_shm.h"
#include "internal.h"

/* The same record and defaults as gloo_pg.c's. */
static const fsdp__abi_struct_t gloo_options_abi =
    FSDP__ABI_STRUCT(fsdp_gloo_options_t, "fsdp_gloo_options_init", timeout_ms);

void(fsdp_gloo_options_init)(fsdp_gloo_options_t *o, size_t size) {
    fsdp_gloo_options_t d;
    memset(&d, 0, sizeof d);
    fsdp__abi_init(o, size, &d, &gloo_options_abi);
}

int fsdp_gloo_available(void) {
    return 0;
}

int fsdp_pg_create_gloo(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_gloo_options_t *o,
                        fsdp_pg_t **out) {
    (void)store;
    (void)o;
    if (out) *out = NULL;
    return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                         "fsdp_pg_create_gloo: this libfsdp was built without Gloo (configure "
                         "did not find gloo/context.h and -lgloo; install libgloo-dev or pass "
                         "--with-gloo=DIR, then reconfigure)");
}

int fsdp__gloo_pg_shm(const fsdp_pg_t *pg) {
    (void)pg;
    return -1;
}

int fsdp__gloo_pg_spin(const fsdp_pg_t *pg) {
    (void)pg;
    return -1;
}

int fsdp__gloo_pg_cma_price(const fsdp_pg_t *pg, int64_t *read_ns, int64_t *copy_ns) {
    (void)pg;
    *read_ns = *copy_ns = 0;
    return -1;
}
