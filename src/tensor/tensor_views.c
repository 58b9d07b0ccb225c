/* SPDX-License-Identifier: MIT */
/*
 * tensor_views.c: operations that give another view of the same storage (reshape, transpose,
 * permute, narrow, squeeze, expand), and their gradients.
 *
 * A view never copies; fsdp_reshape and fsdp_contiguous copy only when the strides make a view
 * impossible. Every view of a tensor that requires grad is recorded, so gradients flow back to
 * the base whatever the view.
 */
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

static int check_out(fsdp_tensor_t *t, fsdp_tensor_t **out, const char *op) {
    if (!out) return fsdp__ctx_err(t ? t->ctx : NULL, FSDP_EINVAL, "%s: out is NULL", op);
    *out = NULL;
    if (!t) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: tensor is NULL", op);
    return FSDP_OK;
}

/* Records v as a view of t with the given backward; releases v on failure. */
static int record_view(const struct fsdp__op_def *def, fsdp_tensor_t *t, fsdp_tensor_t **v,
                       struct fsdp__node **node) {
    struct fsdp__node *n = NULL;
    int rc = fsdp__record(def, 1, &t, 1, v, &n);
    if (rc < 0) {
        fsdp_tensor_release(*v);
        *v = NULL;
        return rc;
    }
    if (node) *node = n;
    return FSDP_OK;
}

/* ---- reshape ------------------------------------------------------------------------------- */

static int reshape_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                            fsdp_tensor_t **gin) {
    return fsdp_reshape(gout[0], node->in_ndim[0], node->in_shape[0], &gin[0]);
}

static const struct fsdp__op_def def_reshape = {"reshape", reshape_backward};

/* Resolves a -1 in shape against numel; checks the total. */
static int infer_shape(fsdp_tensor_t *t, const char *op, int ndim, const int64_t *shape,
                       int64_t *res) {
    if (ndim < 0 || ndim > FSDP_MAX_DIMS || (ndim > 0 && !shape))
        return fsdp__op_err(t, FSDP_EINVAL, op, "ndim %d is outside [0, %d]", ndim,
                            FSDP_MAX_DIMS);
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == -1) {
            if (infer >= 0)
                return fsdp__op_err(t, FSDP_EINVAL, op, "more than one size is -1");
            infer = i;
        } else if (shape[i] < 0) {
            return fsdp__op_err(t, FSDP_EINVAL, op, "size %lld of dimension %d is negative",
                                (long long)shape[i], i);
        } else {
            known *= shape[i];
        }
        res[i] = shape[i];
    }
    int64_t n = fsdp_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || n % known != 0) goto bad;
        res[infer] = n / known;
        known *= res[infer];
    }
    if (known != n) goto bad;
    return FSDP_OK;
bad:;
    char a[160], b[160];
    return fsdp__op_err(t, FSDP_EINVAL, op, "shape %s is invalid for %s (%lld elements)",
                        fsdp__shape_str(ndim, shape, b, sizeof b),
                        fsdp__shape_str(t->ndim, t->shape, a, sizeof a), (long long)n);
}

int fsdp_view(fsdp_tensor_t *t, int ndim, const int64_t *shape, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_view");
    if (rc < 0) return rc;
    int64_t res[FSDP_MAX_DIMS];
    rc = infer_shape(t, "fsdp_view", ndim, shape, res);
    if (rc < 0) return rc;
    if (!fsdp_tensor_is_contiguous(t)) {
        char a[200];
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_view",
                            "%s is not contiguous; use fsdp_reshape() or fsdp_contiguous()",
                            fsdp_tensor_describe(t, a, sizeof a));
    }
    rc = fsdp__tensor_view(t, t->offset, ndim, res, NULL, out);
    if (rc < 0) return rc;
    return record_view(&def_reshape, t, out, NULL);
}

int fsdp_reshape(fsdp_tensor_t *t, int ndim, const int64_t *shape, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_reshape");
    if (rc < 0) return rc;
    if (fsdp_tensor_is_contiguous(t)) return fsdp_view(t, ndim, shape, out);
    int64_t res[FSDP_MAX_DIMS];
    rc = infer_shape(t, "fsdp_reshape", ndim, shape, res);
    if (rc < 0) return rc;
    fsdp_tensor_t *c = NULL;
    rc = fsdp_contiguous(t, &c);
    if (rc < 0) return rc;
    rc = fsdp_view(c, ndim, res, out);
    fsdp_tensor_release(c);
    return rc;
}

/* ---- transpose and permute ---------------------------------------------------------------- */

static int permute_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                            fsdp_tensor_t **gin) {
    /* node->i holds the forward permutation; the gradient goes through its inverse. */
    int inv[FSDP_MAX_DIMS];
    for (int d = 0; d < node->in_ndim[0]; d++) inv[node->i[d]] = d;
    return fsdp_permute(gout[0], inv, &gin[0]);
}

static const struct fsdp__op_def def_permute = {"permute", permute_backward};

int fsdp_permute(fsdp_tensor_t *t, const int *dims, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_permute");
    if (rc < 0) return rc;
    if (t->ndim > 0 && !dims) return fsdp__op_err(t, FSDP_EINVAL, "fsdp_permute", "dims is NULL");
    bool seen[FSDP_MAX_DIMS] = {false};
    int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) {
        int d = dims[i] < 0 ? dims[i] + t->ndim : dims[i];
        if (d < 0 || d >= t->ndim || seen[d])
            return fsdp__op_err(t, FSDP_EINVAL, "fsdp_permute",
                                "dims is not a permutation of 0..%d (entry %d is %d)",
                                t->ndim - 1, i, dims[i]);
        seen[d] = true;
        shape[i] = t->shape[d];
        stride[i] = t->stride[d];
    }
    rc = fsdp__tensor_view(t, t->offset, t->ndim, shape, stride, out);
    if (rc < 0) return rc;
    struct fsdp__node *node = NULL;
    rc = record_view(&def_permute, t, out, &node);
    if (rc < 0) return rc;
    if (node)
        for (int i = 0; i < t->ndim; i++) node->i[i] = dims[i] < 0 ? dims[i] + t->ndim : dims[i];
    return FSDP_OK;
}

int fsdp_transpose(fsdp_tensor_t *t, int d0, int d1, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_transpose");
    if (rc < 0) return rc;
    int a, b;
    if ((rc = fsdp__norm_dim(t, d0, t->ndim, "fsdp_transpose", &a)) < 0) return rc;
    if ((rc = fsdp__norm_dim(t, d1, t->ndim, "fsdp_transpose", &b)) < 0) return rc;
    int perm[FSDP_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return fsdp_permute(t, perm, out);
}

/* ---- narrow and slice ------------------------------------------------------------------------ */

static int narrow_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    fsdp_tensor_t *g = NULL, *win = NULL;
    fsdp_ctx_t *ctx = fsdp_tensor_ctx(gout[0]);
    int rc = fsdp__tensor_new(ctx, fsdp_tensor_device(gout[0]), node->in_dt[0],
                              node->in_ndim[0], node->in_shape[0], fsdp__op_cat(ctx), &g);
    if (rc < 0) return rc;
    FSDP_TRY(rc, fail, fsdp_tensor_zero_(g));
    FSDP_TRY(rc, fail, fsdp_narrow(g, (int)node->i[0], node->i[1], node->i[2], &win));
    FSDP_TRY(rc, fail, fsdp_tensor_copy_(win, gout[0]));
    fsdp_tensor_release(win);
    gin[0] = g;
    return FSDP_OK;
fail:
    fsdp_tensor_release(win);
    fsdp_tensor_release(g);
    return rc;
}

static const struct fsdp__op_def def_narrow = {"narrow", narrow_backward};

int fsdp_narrow(fsdp_tensor_t *t, int dim, int64_t start, int64_t len, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_narrow");
    if (rc < 0) return rc;
    int d;
    if ((rc = fsdp__norm_dim(t, dim, t->ndim, "fsdp_narrow", &d)) < 0) return rc;
    if (start < 0 || len < 0 || start + len > t->shape[d]) {
        char a[200];
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_narrow",
                            "[%lld, %lld) is outside dimension %d of %s", (long long)start,
                            (long long)(start + len), d, fsdp_tensor_describe(t, a, sizeof a));
    }
    int64_t shape[FSDP_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = len;
    rc = fsdp__tensor_view(t, t->offset + start * t->stride[d], t->ndim, shape, t->stride, out);
    if (rc < 0) return rc;
    struct fsdp__node *node = NULL;
    rc = record_view(&def_narrow, t, out, &node);
    if (rc < 0) return rc;
    if (node) {
        node->i[0] = d;
        node->i[1] = start;
        node->i[2] = len;
    }
    return FSDP_OK;
}

int fsdp_slice(fsdp_tensor_t *t, int64_t start, int64_t end, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_slice");
    if (rc < 0) return rc;
    if (t->ndim == 0)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_slice", "a scalar has no dimension 0");
    if (end < start)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_slice", "end %lld is before start %lld",
                            (long long)end, (long long)start);
    return fsdp_narrow(t, 0, start, end - start, out);
}

/* ---- squeeze, unsqueeze, expand ----------------------------------------------------------- */

int fsdp_unsqueeze(fsdp_tensor_t *t, int dim, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_unsqueeze");
    if (rc < 0) return rc;
    int d;
    if ((rc = fsdp__norm_dim(t, dim, t->ndim + 1, "fsdp_unsqueeze", &d)) < 0) return rc;
    if (t->ndim >= FSDP_MAX_DIMS)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_unsqueeze", "already %d dimensions",
                            FSDP_MAX_DIMS);
    int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    for (int i = 0, j = 0; i <= t->ndim; i++) {
        if (i == d) {
            shape[i] = 1;
            stride[i] = j < t->ndim ? t->stride[j] * t->shape[j] : 1;
        } else {
            shape[i] = t->shape[j];
            stride[i] = t->stride[j];
            j++;
        }
    }
    rc = fsdp__tensor_view(t, t->offset, t->ndim + 1, shape, stride, out);
    if (rc < 0) return rc;
    return record_view(&def_reshape, t, out, NULL);
}

int fsdp_squeeze(fsdp_tensor_t *t, int dim, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_squeeze");
    if (rc < 0) return rc;
    int d;
    if ((rc = fsdp__norm_dim(t, dim, t->ndim, "fsdp_squeeze", &d)) < 0) return rc;
    if (t->shape[d] != 1) {
        char a[200];
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_squeeze", "dimension %d of %s is not 1", d,
                            fsdp_tensor_describe(t, a, sizeof a));
    }
    int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    for (int i = 0, j = 0; i < t->ndim; i++) {
        if (i == d) continue;
        shape[j] = t->shape[i];
        stride[j] = t->stride[i];
        j++;
    }
    rc = fsdp__tensor_view(t, t->offset, t->ndim - 1, shape, stride, out);
    if (rc < 0) return rc;
    return record_view(&def_reshape, t, out, NULL);
}

static int expand_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    return fsdp__sum_to_shape(gout[0], node->in_ndim[0], node->in_shape[0], &gin[0]);
}

static const struct fsdp__op_def def_expand = {"expand", expand_backward};

int fsdp_expand(fsdp_tensor_t *t, int ndim, const int64_t *shape, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_expand");
    if (rc < 0) return rc;
    if (ndim < t->ndim || ndim > FSDP_MAX_DIMS || !shape) {
        char a[200];
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_expand", "cannot expand %s to %d dimensions",
                            fsdp_tensor_describe(t, a, sizeof a), ndim);
    }
    int64_t res[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        int it = t->ndim - ndim + i;
        int64_t have = it >= 0 ? t->shape[it] : 1;
        res[i] = shape[i] == -1 ? have : shape[i];
        if (have != res[i] && have != 1) {
            char a[200], b[160];
            return fsdp__op_err(t, FSDP_EINVAL, "fsdp_expand", "cannot expand %s to %s",
                                fsdp_tensor_describe(t, a, sizeof a),
                                fsdp__shape_str(ndim, shape, b, sizeof b));
        }
        stride[i] = (it < 0 || have != res[i]) ? 0 : t->stride[it];
    }
    rc = fsdp__tensor_view(t, t->offset, ndim, res, stride, out);
    if (rc < 0) return rc;
    return record_view(&def_expand, t, out, NULL);
}

/* ---- contiguous, detach, raw views ------------------------------------------------------- */

static int identity_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                             fsdp_tensor_t **gin) {
    (void)node;
    gin[0] = fsdp_tensor_retain(gout[0]);
    return FSDP_OK;
}

static const struct fsdp__op_def def_contiguous = {"contiguous", identity_backward};

int fsdp_contiguous(fsdp_tensor_t *t, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_contiguous");
    if (rc < 0) return rc;
    if (fsdp_tensor_is_contiguous(t)) {
        *out = fsdp_tensor_retain(t);
        return FSDP_OK;
    }
    rc = fsdp__as_contig(t, t->dt, out);
    if (rc < 0) return rc;
    return record_view(&def_contiguous, t, out, NULL);
}

int fsdp_detach(fsdp_tensor_t *t, fsdp_tensor_t **out) {
    int rc = check_out(t, out, "fsdp_detach");
    if (rc < 0) return rc;
    return fsdp__tensor_view(t, t->offset, t->ndim, t->shape, t->stride, out);
}

int fsdp_tensor_view_of(fsdp_tensor_t *base, int64_t offset, int ndim, const int64_t *shape,
                        fsdp_tensor_t **out) {
    int rc = check_out(base, out, "fsdp_tensor_view_of");
    if (rc < 0) return rc;
    if (ndim < 0 || ndim > FSDP_MAX_DIMS || (ndim > 0 && !shape))
        return fsdp__op_err(base, FSDP_EINVAL, "fsdp_tensor_view_of", "bad ndim %d", ndim);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return fsdp__op_err(base, FSDP_EINVAL, "fsdp_tensor_view_of",
                                "size %lld of dimension %d is negative", (long long)shape[i], i);
        n *= shape[i];
    }
    size_t es = fsdp_dtype_size(base->dt);
    int64_t cap = (int64_t)(base->st->full_bytes / es);
    int64_t first = base->offset + offset;
    if (offset < 0 || first + n > cap) {
        char s[160];
        return fsdp__op_err(base, FSDP_EINVAL, "fsdp_tensor_view_of",
                            "a view of shape %s at offset %lld does not fit in a storage of %lld "
                            "elements",
                            fsdp__shape_str(ndim, shape, s, sizeof s), (long long)first,
                            (long long)cap);
    }
    return fsdp__tensor_view(base, first, ndim, shape, NULL, out);
}
