/* SPDX-License-Identifier: MIT */
/*
 * ddp_build.c: what fsdp_ddp_create does before the first forward (see fsdp/ddp.h): the
 * parameters_to_ignore list, the cross-rank model check, the module-state broadcasts, PyTorch's
 * bucket assignment (fsdp_ddp_assign_buckets) and the flat buffers. The rounds are in ddp.c.
 *
 * Listings. Parameters and buffers are listed with their aliases and filtered by name before
 * duplicates are removed, as PyTorch's _build_params_for_reducer does: a shared tensor is
 * ignored only when every name it has is listed, and otherwise sits where its first name that
 * is not listed sits. The filtered listings borrow the module's names and tensors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/ddp.h>

#include "fsdp/ddp_impl.h"
#include "internal.h"
#include "tensor/tensor_impl.h"

/* A filtered listing: n borrowed names and tensors. */
struct ddp_list {
    size_t n;
    const char **names;
    fsdp_tensor_t **tensors;
};

static void list_free(struct ddp_list *l) {
    free(l->names);
    free(l->tensors);
    memset(l, 0, sizeof *l);
}

static int oom(fsdp_ddp_t *d) {
    return fsdp__ctx_err(d->ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
}

/* ---- parameters_to_ignore -------------------------------------------------------------------- */

int fsdp__ddp_copy_ignore(fsdp_ddp_t *d, const fsdp_ddp_options_t *o) {
    size_t n = o ? o->num_parameters_to_ignore : 0;
    d->opt.parameters_to_ignore = NULL;
    d->opt.num_parameters_to_ignore = 0;
    if (n == 0) return FSDP_OK;
    if (!o->parameters_to_ignore)
        return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                             "fsdp_ddp_create: parameters_to_ignore is NULL but "
                             "num_parameters_to_ignore is %zu",
                             n);
    for (size_t i = 0; i < n; i++)
        if (!o->parameters_to_ignore[i])
            return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                 "fsdp_ddp_create: parameters_to_ignore[%zu] is NULL", i);
    d->ign = calloc(n, sizeof *d->ign);
    if (!d->ign) return oom(d);
    for (size_t i = 0; i < n; i++) {
        d->ign[i] = strdup(o->parameters_to_ignore[i]);
        if (!d->ign[i]) return oom(d); /* fsdp__ddp_free_build frees the copies made */
        d->nign++;
    }
    d->opt.parameters_to_ignore = (const char *const *)d->ign;
    d->opt.num_parameters_to_ignore = n;
    return FSDP_OK;
}

static bool listed(const fsdp_ddp_t *d, const char *name) {
    for (size_t i = 0; i < d->nign; i++)
        if (strcmp(d->ign[i], name) == 0) return true;
    return false;
}

static bool has_name(const fsdp_named_list_t *l, const char *name) {
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->names[i], name) == 0) return true;
    return false;
}

/* Every listed name must be a parameter's or a buffer's (PyTorch ignores unknown names; a
 * misspelt name would silently all-reduce the parameter meant). */
static int check_ignore_names(fsdp_ddp_t *d, const fsdp_named_list_t *ps,
                              const fsdp_named_list_t *bs) {
    for (size_t i = 0; i < d->nign; i++)
        if (!has_name(ps, d->ign[i]) && !has_name(bs, d->ign[i]))
            return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                 "fsdp_ddp_create (rank %d): parameters_to_ignore[%zu] '%s' is "
                                 "neither a parameter nor a buffer of the module",
                                 d->rank, i, d->ign[i]);
    return FSDP_OK;
}

struct ent {
    uintptr_t p; /* the tensor */
    size_t i;    /* its position in the listing */
};

static int ent_cmp(const void *a, const void *b) {
    const struct ent *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* The tensors of `all` (listed with aliases, in pre-order) that keep a name not ignored, once
 * each, at the position and under the name of the first such name (see the top of the file).
 * *dropped receives the number of tensors left out. */
static int keep_list(fsdp_ddp_t *d, const fsdp_named_list_t *all, struct ddp_list *out,
                     size_t *dropped) {
    size_t n = all->n, distinct = 0, kept = 0;
    struct ent *e = malloc(sizeof *e * (n ? n : 1));
    bool *keep = calloc(n ? n : 1, sizeof *keep);
    memset(out, 0, sizeof *out);
    out->names = malloc(sizeof *out->names * (n ? n : 1));
    out->tensors = malloc(sizeof *out->tensors * (n ? n : 1));
    if (!e || !keep || !out->names || !out->tensors) {
        free(e);
        free(keep);
        list_free(out);
        return oom(d);
    }
    for (size_t i = 0; i < n; i++)
        e[i] = (struct ent){(uintptr_t)all->tensors[i], i};
    qsort(e, n, sizeof *e, ent_cmp);
    for (size_t a = 0; a < n;) {
        size_t b = a;
        while (b < n && e[b].p == e[a].p)
            b++;
        distinct++;
        for (size_t k = a; k < b; k++) { /* by position within one tensor */
            if (listed(d, all->names[e[k].i])) continue;
            keep[e[k].i] = true;
            kept++;
            break;
        }
        a = b;
    }
    for (size_t i = 0; i < n; i++) {
        if (!keep[i]) continue;
        out->names[out->n] = all->names[i];
        out->tensors[out->n++] = all->tensors[i];
    }
    *dropped = distinct - kept;
    free(e);
    free(keep);
    return FSDP_OK;
}

/* ---- collectives on host data ---------------------------------------------------------------- */

/* Blocking all-gather of n int64 per rank through device tensors (NCCL needs device memory):
 * out receives world * n values. */
static int gather_i64(fsdp_ddp_t *d, const int64_t *in, size_t n, int64_t *out) {
    fsdp_tensor_t *s = NULL, *r = NULL;
    int rc;
    int64_t ns = (int64_t)n, nr = (int64_t)n * d->world;
    FSDP_TRY(rc, out, fsdp_tensor_from_host(d->ctx, FSDP_DTYPE_I64, 1, &ns, in, FSDP_MEM_COMM, &s));
    FSDP_TRY(rc, out, fsdp_tensor_empty(d->ctx, FSDP_DTYPE_I64, 1, &nr, FSDP_MEM_COMM, &r));
    rc = fsdp_pg_all_gather(d->pg, fsdp_tensor_data(s), fsdp_tensor_data(r), n, FSDP_DTYPE_I64,
                            NULL);
    if (rc < 0) {
        fsdp__ctx_err(d->ctx, rc,
                      "fsdp_ddp_create (rank %d): all-gather of the model description failed: %s",
                      d->rank, fsdp_pg_last_error(d->pg));
        goto out;
    }
    rc = fsdp_tensor_to_host(r, out, (size_t)nr * sizeof(int64_t));
out:
    fsdp_tensor_release(s);
    fsdp_tensor_release(r);
    return rc;
}

/* Broadcasts t's values from rank 0 in place (through a contiguous copy when t is not
 * contiguous). what ("parameter", "buffer") and the name go into the error message. */
static int bcast_tensor(fsdp_ddp_t *d, fsdp_tensor_t *t, const char *what, const char *name) {
    fsdp_tensor_t *c = NULL;
    int64_t n = fsdp_tensor_numel(t);
    int rc = FSDP_OK;
    char desc[160];
    if (n == 0) return FSDP_OK;
    if (fsdp_tensor_is_contiguous(t) && fsdp_tensor_data(t)) {
        rc = fsdp_pg_broadcast(d->pg, fsdp_tensor_data(t), fsdp_tensor_data(t), (size_t)n,
                               fsdp_tensor_dtype(t), 0, NULL);
    } else {
        FSDP_TRY(rc, fail, fsdp_tensor_clone(t, FSDP_MEM_COMM, &c));
        rc = fsdp_pg_broadcast(d->pg, fsdp_tensor_data(c), fsdp_tensor_data(c), (size_t)n,
                               fsdp_tensor_dtype(c), 0, NULL);
        if (rc == 0) rc = fsdp_tensor_copy_(t, c);
    }
    if (rc < 0) goto fail;
    fsdp_tensor_release(c);
    return FSDP_OK;
fail:
    fsdp_tensor_release(c);
    return fsdp__ctx_err(
        d->ctx, rc, "DDP (rank %d): broadcast of %s '%s' %s from rank 0 failed: %s", d->rank, what,
        name, fsdp_tensor_describe(t, desc, sizeof desc), d->pg ? fsdp_pg_last_error(d->pg) : "");
}

static int bcast_list(fsdp_ddp_t *d, const struct ddp_list *l, const char *what) {
    for (size_t i = 0; i < l->n; i++) {
        int rc = bcast_tensor(d, l->tensors[i], what, l->names[i]);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

int fsdp__ddp_bcast_buffers(fsdp_ddp_t *d) {
    fsdp_named_list_t all = {0};
    struct ddp_list bs = {0};
    size_t dropped = 0;
    int rc = fsdp_module_named_buffers(d->m, d->nign > 0, &all);
    if (rc == 0) rc = keep_list(d, &all, &bs, &dropped);
    if (rc == 0) rc = bcast_list(d, &bs, "buffer");
    list_free(&bs);
    fsdp_named_list_free(&all);
    return rc;
}

/* ---- the cross-rank check -------------------------------------------------------------------- */

/* Per tensor: kind, requires_grad, dtype, ndim, name hash, shape[FSDP_MAX_DIMS]. */
#define META_LEN (5 + FSDP_MAX_DIMS)

static int64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; s && *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

static void describe_meta(const int64_t *m, char *buf, size_t len) {
    char shape[160];
    snprintf(buf, len, "%s%s (requires_grad %d)", fsdp_dtype_name((fsdp_dtype_t)m[2]),
             fsdp__shape_str((int)m[3], m + 5, shape, sizeof shape), (int)m[1]);
}

/* PyTorch's _verify_param_shape_across_processes: every rank must hold the same parameters and
 * buffers (count, dtype, shape, requires_grad, name), ignored ones left out. Each rank compares
 * every rank with rank 0 on the same gathered data, so all ranks fail alike, with the same
 * message. local_rc is this rank's verdict on its own checks (the ignore list, hooks, devices):
 * it travels with the counts, so a rank that failed them does not leave its peers waiting in
 * the next collective; it returns local_rc (its message stays) and the others name it. */
static int verify_model(fsdp_ddp_t *d, const struct ddp_list *ps, const struct ddp_list *bs,
                        int local_rc) {
    int64_t cnt[3] = {(int64_t)ps->n, (int64_t)bs->n, local_rc < 0};
    int64_t *all = NULL, *meta = NULL, *gathered = NULL;
    size_t n = ps->n + bs->n;
    int rc;
    all = malloc(sizeof(int64_t) * 3 * (size_t)d->world);
    if (!all) goto nomem;
    FSDP_TRY(rc, out, gather_i64(d, cnt, 3, all));
    if (local_rc < 0) {
        rc = local_rc;
        goto out;
    }
    for (int r = 0; r < d->world; r++) {
        if (all[3 * r + 2]) {
            rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                               "fsdp_ddp_create (rank %d): rank %d failed its own checks (its "
                               "error names the cause), so every rank fails",
                               d->rank, r);
            goto out;
        }
    }
    for (int r = 1; r < d->world; r++) {
        if (all[3 * r] != all[0] || all[3 * r + 1] != all[1]) {
            rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                               "fsdp_ddp_create (rank %d): rank %d has %lld parameters and %lld "
                               "buffers, rank 0 has %lld and %lld; DDP needs the same model on "
                               "every rank",
                               d->rank, r, (long long)all[3 * r], (long long)all[3 * r + 1],
                               (long long)all[0], (long long)all[1]);
            goto out;
        }
    }
    if (n == 0) {
        rc = FSDP_OK;
        goto out;
    }
    meta = calloc(n * META_LEN, sizeof *meta);
    gathered = malloc(sizeof *gathered * n * META_LEN * (size_t)d->world);
    if (!meta || !gathered) goto nomem;
    for (size_t i = 0; i < n; i++) {
        bool is_param = i < ps->n;
        fsdp_tensor_t *t = is_param ? ps->tensors[i] : bs->tensors[i - ps->n];
        const char *nm = is_param ? ps->names[i] : bs->names[i - ps->n];
        int64_t *m = meta + i * META_LEN;
        m[0] = is_param;
        m[1] = fsdp_tensor_requires_grad(t);
        m[2] = fsdp_tensor_dtype(t);
        m[3] = fsdp_tensor_ndim(t);
        m[4] = name_hash(nm);
        memcpy(m + 5, fsdp_tensor_shape(t), sizeof(int64_t) * (size_t)m[3]);
    }
    FSDP_TRY(rc, out, gather_i64(d, meta, n * META_LEN, gathered));
    for (int r = 1; r < d->world; r++) {
        for (size_t i = 0; i < n; i++) {
            const int64_t *m0 = gathered + i * META_LEN;
            const int64_t *mr = gathered + ((size_t)r * n + i) * META_LEN;
            if (memcmp(m0, mr, sizeof(int64_t) * META_LEN) == 0) continue;
            bool is_param = i < ps->n;
            const char *nm = is_param ? ps->names[i] : bs->names[i - ps->n];
            const char *what = is_param ? "parameter" : "buffer";
            if (m0[4] != mr[4]) {
                rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                   "fsdp_ddp_create (rank %d): %s %zu is named differently on "
                                   "rank %d and rank 0 (this rank calls it '%s'); DDP needs the "
                                   "same model on every rank",
                                   d->rank, what, is_param ? i : i - ps->n, r, nm);
            } else {
                char a[200], b[200];
                describe_meta(m0, a, sizeof a);
                describe_meta(mr, b, sizeof b);
                rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                   "fsdp_ddp_create (rank %d): %s '%s' differs across ranks: "
                                   "rank 0 has %s, rank %d has %s; DDP needs the same model on "
                                   "every rank",
                                   d->rank, what, nm, a, r, b);
            }
            goto out;
        }
    }
    rc = FSDP_OK;
out:
    free(all);
    free(meta);
    free(gathered);
    return rc;
nomem:
    rc = oom(d);
    goto out;
}

/* ---- buckets --------------------------------------------------------------------------------- */

int fsdp_ddp_assign_buckets(fsdp_ctx_t *ctx, size_t n, const size_t *nbytes,
                            const fsdp_dtype_t *dtypes, size_t first_bucket_bytes,
                            size_t bucket_cap_bytes, size_t *bucket_of, size_t *nbuckets) {
    size_t open[FSDP_DTYPE_COUNT], fill[FSDP_DTYPE_COUNT], nb = 0;
    bool later[FSDP_DTYPE_COUNT]; /* the dtype's first bucket is closed */
    if (nbuckets) *nbuckets = 0;
    if (!nbuckets || (n > 0 && (!nbytes || !bucket_of)))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_assign_buckets: %s is NULL",
                             !nbuckets ? "nbuckets"
                             : !nbytes ? "nbytes"
                                       : "bucket_of");
    if (first_bucket_bytes == 0 || bucket_cap_bytes == 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_assign_buckets: %s must be > 0",
                             first_bucket_bytes == 0 ? "first_bucket_bytes" : "bucket_cap_bytes");
    for (size_t i = 0; i < n; i++)
        if (dtypes && ((int)dtypes[i] < 0 || (int)dtypes[i] >= FSDP_DTYPE_COUNT))
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "fsdp_ddp_assign_buckets: dtypes[%zu] is not a dtype (%d)", i,
                                 (int)dtypes[i]);
    size_t first = first_bucket_bytes < bucket_cap_bytes ? first_bucket_bytes : bucket_cap_bytes;
    for (int k = 0; k < FSDP_DTYPE_COUNT; k++) {
        open[k] = SIZE_MAX;
        fill[k] = 0;
        later[k] = false;
    }
    for (size_t i = 0; i < n; i++) {
        int k = dtypes ? (int)dtypes[i] : 0;
        if (open[k] == SIZE_MAX) {
            open[k] = nb++;
            fill[k] = 0;
        }
        bucket_of[i] = open[k];
        fill[k] += nbytes[i];
        /* The reducer's rule: add, then close once the bucket has reached its limit. */
        if (fill[k] >= (later[k] ? bucket_cap_bytes : first)) {
            open[k] = SIZE_MAX;
            later[k] = true;
        }
    }
    *nbuckets = nb;
    return FSDP_OK;
}

static int bucket_append(fsdp_ddp_t *d, size_t b, size_t i) {
    struct ddp_bucket *bk = &d->buckets[b];
    size_t *ni = realloc(bk->idx, sizeof *ni * (bk->n + 1));
    if (!ni) return oom(d);
    bk->idx = ni;
    bk->idx[bk->n++] = i;
    struct ddp_param *p = &d->params[i];
    int64_t numel = fsdp_tensor_numel(p->t);
    p->bucket = b;
    p->offset = bk->numel;
    bk->numel += numel;
    bk->bytes += (size_t)numel * fsdp_dtype_size(bk->dt);
    return FSDP_OK;
}

/* fsdp_ddp_assign_buckets over params[] (reverse registration order). */
static int build_buckets(fsdp_ddp_t *d) {
    size_t n = d->nparams, nb = 0;
    size_t *bytes = malloc(sizeof *bytes * (n ? n : 1));
    size_t *of = malloc(sizeof *of * (n ? n : 1));
    fsdp_dtype_t *dts = malloc(sizeof *dts * (n ? n : 1));
    int rc = FSDP_OK;
    if (!bytes || !of || !dts) {
        rc = oom(d);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        dts[i] = fsdp_tensor_dtype(d->params[i].t);
        bytes[i] = (size_t)fsdp_tensor_numel(d->params[i].t) * fsdp_dtype_size(dts[i]);
    }
    FSDP_TRY(rc, out,
             fsdp_ddp_assign_buckets(d->ctx, n, bytes, dts, d->opt.first_bucket_bytes,
                                     d->opt.bucket_cap_bytes, of, &nb));
    d->buckets = calloc(nb ? nb : 1, sizeof *d->buckets);
    if (!d->buckets) {
        rc = oom(d);
        goto out;
    }
    d->nbuckets = nb;
    for (size_t i = 0; i < n && rc == 0; i++) {
        d->buckets[of[i]].dt = dts[i];
        rc = bucket_append(d, of[i], i);
    }
out:
    free(bytes);
    free(of);
    free(dts);
    return rc;
}

/* Flat buffers on the parameters' device, one view per parameter, and the used flags. */
static int alloc_buffers(fsdp_ddp_t *d) {
    fsdp_device_t *dev = fsdp_tensor_device(d->params[0].t);
    int rc;
    for (size_t b = 0; b < d->nbuckets; b++) {
        struct ddp_bucket *bk = &d->buckets[b];
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(d->ctx, dev, bk->dt, 1, &bk->numel, FSDP_MEM_COMM, &bk->flat));
        for (size_t j = 0; j < bk->n; j++) {
            struct ddp_param *p = &d->params[bk->idx[j]];
            FSDP_TRY(rc, fail,
                     fsdp_tensor_view_of(bk->flat, p->offset, fsdp_tensor_ndim(p->t),
                                         fsdp_tensor_shape(p->t), &p->view));
        }
    }
    int64_t n = (int64_t)d->nparams;
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(d->ctx, dev, FSDP_DTYPE_I32, 1, &n, FSDP_MEM_COMM, &d->used_flags));
    d->used_host = calloc(d->nparams, sizeof *d->used_host);
    if (!d->used_host) rc = oom(d);
fail:
    return rc;
}

/* ---- creation -------------------------------------------------------------------------------- */

int fsdp__ddp_build(fsdp_ddp_t *d, fsdp_grad_hook_fn hook) {
    fsdp_named_list_t psa = {0}, bsa = {0};
    struct ddp_list ps = {0}, bs = {0};
    size_t ign_p = 0, ign_b = 0, ntrain = 0;
    int rc;
    FSDP_TRY(rc, out, fsdp_module_named_params(d->m, true, &psa));
    FSDP_TRY(rc, out, fsdp_module_named_buffers(d->m, true, &bsa));
    FSDP_TRY(rc, out, keep_list(d, &psa, &ps, &ign_p));
    FSDP_TRY(rc, out, keep_list(d, &bsa, &bs, &ign_b));
    /* This rank's own checks; their verdict joins the cross-rank check. */
    int local = check_ignore_names(d, &psa, &bsa);
    for (size_t i = 0; i < ps.n && local == 0; i++) {
        fsdp_tensor_t *t = ps.tensors[i];
        if (!fsdp_tensor_requires_grad(t)) continue;
        if (fsdp_tensor_has_grad_hook(t, hook))
            local = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                  "fsdp_ddp_create (rank %d): parameter '%s' is already bucketed "
                                  "by another DDP wrapper; destroy that one first",
                                  d->rank, ps.names[i]);
        else if (fsdp_tensor_device(t) != fsdp_tensor_device(ps.tensors[0]))
            local = fsdp__ctx_err(
                d->ctx, FSDP_EINVAL,
                "fsdp_ddp_create (rank %d): parameter '%s' is on %s but '%s' is on %s; DDP needs "
                "every parameter on one device",
                d->rank, ps.names[i], fsdp_device_name(fsdp_tensor_device(t)), ps.names[0],
                fsdp_device_name(fsdp_tensor_device(ps.tensors[0])));
        ntrain++;
    }
    rc = local;
    if (d->world > 1) {
        FSDP_TRY(rc, out, verify_model(d, &ps, &bs, local));
        if (d->opt.sync_module_states) {
            FSDP_TRY(rc, out, bcast_list(d, &ps, "parameter"));
            FSDP_TRY(rc, out, bcast_list(d, &bs, "buffer"));
        }
    }
    if (rc < 0) goto out;
    d->params = calloc(ntrain > 0 ? ntrain : 1, sizeof *d->params);
    if (!d->params) {
        rc = oom(d);
        goto out;
    }
    for (size_t i = ps.n; i-- > 0;) {
        fsdp_tensor_t *t = ps.tensors[i];
        if (!fsdp_tensor_requires_grad(t)) continue;
        struct ddp_param *p = &d->params[d->nparams++];
        p->d = d;
        p->t = fsdp_tensor_retain(t);
        p->name = strdup(ps.names[i]);
        if (!p->name) {
            rc = oom(d);
            goto out;
        }
    }
    FSDP_TRY(rc, out, build_buckets(d));
    if (d->world > 1 && d->nparams > 0) FSDP_TRY(rc, out, alloc_buffers(d));
    for (size_t b = 0; b < d->nbuckets; b++)
        d->stats.bucket_bytes += d->buckets[b].bytes;
    d->stats.num_ignored_params = ign_p;
    d->stats.num_ignored_buffers = ign_b;
out:
    list_free(&ps);
    list_free(&bs);
    fsdp_named_list_free(&psa);
    fsdp_named_list_free(&bsa);
    return rc;
}

void fsdp__ddp_free_build(fsdp_ddp_t *d) {
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        fsdp_tensor_release(p->view);
        fsdp_tensor_release(p->t);
        free(p->name);
    }
    free(d->params);
    d->params = NULL;
    d->nparams = 0;
    for (size_t b = 0; b < d->nbuckets; b++) {
        fsdp_tensor_release(d->buckets[b].flat);
        free(d->buckets[b].idx);
    }
    free(d->buckets);
    d->buckets = NULL;
    d->nbuckets = 0;
    fsdp_tensor_release(d->used_flags);
    d->used_flags = NULL;
    free(d->used_host);
    d->used_host = NULL;
    for (size_t i = 0; i < d->nign; i++)
        free(d->ign[i]);
    free(d->ign);
    d->ign = NULL;
    d->nign = 0;
    d->opt.parameters_to_ignore = NULL;
    d->opt.num_parameters_to_ignore = 0;
}
