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

void fsdp_gloo_options_init(fsdp_gloo_options_t *o) {
    if (o) memset(o, 0, sizeof *o);
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
