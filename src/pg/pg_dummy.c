/* SPDX-License-Identifier: MIT */
/*
 * pg_dummy.c: a process group that only knows its rank and size.
 *
 * For construction-only code and tests, like PyTorch's DummyProcessGroup: collectives either
 * complete at once without touching their buffers, or fail, as chosen at creation.
 */
#include <stdlib.h>

#include "pg/pg_impl.h"

typedef struct dummy_pg {
    fsdp_pg_t base;
    fsdp_dummy_mode_t mode;
} dummy_pg_t;

static int dummy_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    dummy_pg_t *d = (dummy_pg_t *)pg;
    if (d->mode == FSDP_DUMMY_FAIL)
        fsdp__work_complete(w, FSDP_ENOTSUP,
                            "%s on the dummy process group '%s' (rank %d of %d): the group was "
                            "created with FSDP_DUMMY_FAIL and runs no collective",
                            fsdp_coll_name(w->coll.kind), pg->name, pg->rank, pg->size);
    else
        fsdp__work_complete(w, FSDP_OK, NULL);
    return FSDP_OK;
}

static void dummy_destroy(fsdp_pg_t *pg) {
    fsdp__pg_fini(pg);
    free(pg);
}

static const struct fsdp_pg_ops dummy_ops = {
    .name = "dummy",
    .post = dummy_post,
    .create_subgroup = NULL,
    .destroy = dummy_destroy,
};

int fsdp_pg_create_dummy(fsdp_ctx_t *ctx, int rank, int size, fsdp_dummy_mode_t mode,
                         fsdp_pg_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    if (size < 1 || rank < 0 || rank >= size)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_pg_create_dummy: rank %d and size %d (need 0 <= rank < size)",
                             rank, size);
    if (mode != FSDP_DUMMY_NOOP && mode != FSDP_DUMMY_FAIL)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_pg_create_dummy: mode %d is invalid",
                             (int)mode);
    dummy_pg_t *d = calloc(1, sizeof *d);
    if (!d) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_pg_create_dummy: out of memory");
    d->mode = mode;
    int rc = fsdp__pg_init(&d->base, &dummy_ops, ctx, rank, size, NULL, "dummy");
    if (rc < 0) {
        free(d);
        return fsdp__ctx_err(ctx, rc, "fsdp_pg_create_dummy: out of memory");
    }
    *out = &d->base;
    return FSDP_OK;
}
