/* SPDX-License-Identifier: MIT */
/*
 * layers.c: the basic module types (Linear, Embedding, LayerNorm, BatchNorm, activations,
 * Dropout, Identity) and the containers (Sequential, ModuleList, ModuleDict).
 *
 * Parameters are f32 and initialised as PyTorch 1.13 initialises them, drawing from the
 * context's random stream in PyTorch's order (Linear: weight, then bias), so a model built
 * from the same seed is the same model. Initial values are written before a tensor is
 * registered, so nothing of the initialisation reaches the tape.
 *
 * A forward reads its parameters by slot (fsdp__module_param_at), never by a pointer kept
 * aside, because FSDP swaps parameter tensors with fsdp_module_set_param.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/nn_impl.h"

/* ---- shared ---------------------------------------------------------------------------------- */

static int check_create(fsdp_ctx_t *ctx, fsdp_module_t **m, const char *fn) {
    if (m) *m = NULL;
    if (!ctx) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: ctx is NULL", fn);
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", fn);
    return FSDP_OK;
}

/* A new f32 tensor registered as parameter `name` of m after init() filled it. */
static int add_new_param(fsdp_module_t *m, const char *name, int ndim, const int64_t *shape,
                         int (*init)(fsdp_tensor_t *t, double a, double b), double a, double b) {
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_tensor_empty(fsdp_module_ctx(m), FSDP_DTYPE_F32, ndim, shape, FSDP_MEM_PARAMS,
                               &t);
    if (rc == 0) rc = init(t, a, b);
    if (rc == 0) rc = fsdp_module_add_param(m, name, t);
    fsdp_tensor_release(t);
    return rc;
}

static int check_last_dim(const fsdp_module_t *m, const fsdp_tensor_t *x, int64_t want,
                          const char *what) {
    if (fsdp_tensor_ndim(x) >= 1 && fsdp_tensor_size(x, -1) == want) return FSDP_OK;
    char d[160];
    return fsdp__module_err(m, FSDP_EINVAL, "input %s does not end in %s = %lld",
                            fsdp_tensor_describe(x, d, sizeof d), what, (long long)want);
}

/* ---- Linear ---------------------------------------------------------------------------------- */

struct linear {
    int64_t in, out;
    bool bias;
};

static int linear_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    const struct linear *l = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc == 0) rc = check_last_dim(m, in[0], l->in, "in_features");
    if (rc < 0) return rc;
    return fsdp_linear(in[0], fsdp__module_param_at(m, 0),
                       l->bias ? fsdp__module_param_at(m, 1) : NULL, out);
}

static const fsdp_module_ops_t linear_ops = {"Linear", linear_forward, NULL};

int fsdp_linear_create(fsdp_ctx_t *ctx, int64_t in, int64_t out, bool bias, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_linear_create");
    if (rc < 0) return rc;
    if (in < 0 || out < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_linear_create: in_features %lld and out_features %lld must be "
                             ">= 0",
                             (long long)in, (long long)out);
    struct linear *l;
    fsdp_module_t *mod = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &linear_ops, sizeof *l, &mod, (void **)&l));
    *l = (struct linear){in, out, bias};
    /* kaiming_uniform_(a = sqrt(5)) gives bound 1/sqrt(fan_in) for the weight, and the bias
     * uses the same bound; PyTorch uses 0 when fan_in is 0. */
    double bound = in > 0 ? 1.0 / sqrt((double)in) : 0.0;
    FSDP_TRY(rc, fail, add_new_param(mod, "weight", 2, (int64_t[]){out, in}, fsdp_tensor_uniform_,
                                     -bound, bound));
    if (bias)
        FSDP_TRY(rc, fail, add_new_param(mod, "bias", 1, (int64_t[]){out}, fsdp_tensor_uniform_,
                                         -bound, bound));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

/* ---- Embedding ------------------------------------------------------------------------------- */

struct embedding {
    int64_t num, dim, padding_idx;
};

static int embedding_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct embedding *e = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    return fsdp_embedding(in[0], fsdp__module_param_at(m, 0), e->padding_idx, out);
}

static const fsdp_module_ops_t embedding_ops = {"Embedding", embedding_forward, NULL};

int fsdp_embedding_create(fsdp_ctx_t *ctx, int64_t num, int64_t dim, int64_t padding_idx,
                          fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_embedding_create");
    if (rc < 0) return rc;
    if (num < 0 || dim < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_embedding_create: num_embeddings %lld and embedding_dim %lld "
                             "must be >= 0",
                             (long long)num, (long long)dim);
    if (padding_idx >= num)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_embedding_create: padding_idx %lld is outside [0, %lld)",
                             (long long)padding_idx, (long long)num);
    struct embedding *e;
    fsdp_module_t *mod = NULL;
    fsdp_tensor_t *w = NULL, *row = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &embedding_ops, sizeof *e, &mod, (void **)&e));
    *e = (struct embedding){num, dim, padding_idx < 0 ? -1 : padding_idx};
    FSDP_TRY(rc, fail, fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (int64_t[]){num, dim},
                                         FSDP_MEM_PARAMS, &w));
    FSDP_TRY(rc, fail, fsdp_tensor_normal_(w, 0.0, 1.0));
    if (e->padding_idx >= 0) {
        FSDP_TRY(rc, fail, fsdp_tensor_view_of(w, e->padding_idx * dim, 1, &dim, &row));
        FSDP_TRY(rc, fail, fsdp_tensor_zero_(row));
    }
    FSDP_TRY(rc, fail, fsdp_module_add_param(mod, "weight", w));
    fsdp_tensor_release(row);
    fsdp_tensor_release(w);
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_tensor_release(row);
    fsdp_tensor_release(w);
    fsdp_module_release(mod);
    return rc;
}

/* ---- LayerNorm ------------------------------------------------------------------------------- */

struct layernorm {
    int64_t dim;
    double eps;
    bool affine;
};

static int layernorm_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct layernorm *l = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc == 0) rc = check_last_dim(m, in[0], l->dim, "normalized_shape");
    if (rc < 0) return rc;
    return fsdp_layer_norm(in[0], 1, l->affine ? fsdp__module_param_at(m, 0) : NULL,
                           l->affine ? fsdp__module_param_at(m, 1) : NULL, l->eps, out);
}

static const fsdp_module_ops_t layernorm_ops = {"LayerNorm", layernorm_forward, NULL};

int fsdp_layernorm_create(fsdp_ctx_t *ctx, int64_t dim, double eps, bool affine,
                          fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_layernorm_create");
    if (rc < 0) return rc;
    if (dim <= 0 || !(eps >= 0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_layernorm_create: dim %lld must be > 0 and eps %g >= 0",
                             (long long)dim, eps);
    struct layernorm *l;
    fsdp_module_t *mod = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &layernorm_ops, sizeof *l, &mod, (void **)&l));
    *l = (struct layernorm){dim, eps, affine};
    if (affine) {
        FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "weight", 1, &dim, 1.0, NULL));
        FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "bias", 1, &dim, 0.0, NULL));
    }
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

/* ---- BatchNorm ------------------------------------------------------------------------------- */

struct batchnorm {
    int spatial; /* 1, 2 or 3 */
    int64_t c;
    double eps, momentum;
};

/* Buffer slots, in PyTorch's registration order. */
enum { BN_RUNNING_MEAN = 0, BN_RUNNING_VAR, BN_NUM_BATCHES };

static int batchnorm_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct batchnorm *b = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    fsdp_tensor_t *x = in[0];
    int nd = fsdp_tensor_ndim(x);
    bool rank_ok = b->spatial == 1 ? (nd == 2 || nd == 3) : nd == b->spatial + 2;
    char d[160];
    if (!rank_ok) {
        static const char *const want[] = {"", "(N, C) or (N, C, L)", "(N, C, H, W)",
                                           "(N, C, D, H, W)"};
        return fsdp__module_err(m, FSDP_EINVAL, "expected an input %s, got %s", want[b->spatial],
                                fsdp_tensor_describe(x, d, sizeof d));
    }
    if (fsdp_tensor_size(x, 1) != b->c)
        return fsdp__module_err(m, FSDP_EINVAL, "expected %lld channels (dimension 1), got %s",
                                (long long)b->c, fsdp_tensor_describe(x, d, sizeof d));
    bool train = fsdp_module_is_training(m);
    FSDP_TRY(rc, out, fsdp_batch_norm(x, fsdp__module_param_at(m, 0), fsdp__module_param_at(m, 1),
                                      fsdp__module_buffer_at(m, BN_RUNNING_MEAN),
                                      fsdp__module_buffer_at(m, BN_RUNNING_VAR), train,
                                      b->momentum, b->eps, out));
    if (train) {
        fsdp_tensor_t *nbt = fsdp__module_buffer_at(m, BN_NUM_BATCHES);
        int64_t v = 0;
        rc = fsdp_tensor_to_host(nbt, &v, sizeof v);
        v++;
        if (rc == 0) rc = fsdp_tensor_copy_from_host(nbt, &v, sizeof v);
        if (rc < 0) {
            fsdp_tensor_release(*out);
            *out = NULL;
        }
    }
out:
    return rc;
}

static const fsdp_module_ops_t batchnorm_ops[3] = {
    {"BatchNorm1d", batchnorm_forward, NULL},
    {"BatchNorm2d", batchnorm_forward, NULL},
    {"BatchNorm3d", batchnorm_forward, NULL},
};

int fsdp_batchnorm_create(fsdp_ctx_t *ctx, int spatial_dims, int64_t c, double eps,
                          double momentum, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_batchnorm_create");
    if (rc < 0) return rc;
    if (spatial_dims < 0 || spatial_dims > 3 || c <= 0 || !(eps >= 0) ||
        !(momentum >= 0 && momentum <= 1))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_batchnorm_create: spatial_dims %d must be 0..3, channels %lld "
                             "> 0, eps %g >= 0 and momentum %g in [0, 1]",
                             spatial_dims, (long long)c, eps, momentum);
    int spatial = spatial_dims ? spatial_dims : 1;
    struct batchnorm *b;
    fsdp_module_t *mod = NULL;
    FSDP_TRY(rc, fail,
             fsdp__module_new(ctx, &batchnorm_ops[spatial - 1], sizeof *b, &mod, (void **)&b));
    *b = (struct batchnorm){spatial, c, eps, momentum};
    FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "weight", 1, &c, 1.0, NULL));
    FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "bias", 1, &c, 0.0, NULL));
    FSDP_TRY(rc, fail, fsdp__module_new_buffer(mod, "running_mean", FSDP_DTYPE_F32, 1, &c, 0.0,
                                               true, NULL));
    FSDP_TRY(rc, fail, fsdp__module_new_buffer(mod, "running_var", FSDP_DTYPE_F32, 1, &c, 1.0,
                                               true, NULL));
    FSDP_TRY(rc, fail, fsdp__module_new_buffer(mod, "num_batches_tracked", FSDP_DTYPE_I64, 0,
                                               NULL, 0.0, true, NULL));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

/* ---- activations, Dropout, Identity ---------------------------------------------------------- */

static int relu_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    return rc < 0 ? rc : fsdp_relu(in[0], out);
}

static int tanh_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    return rc < 0 ? rc : fsdp_tanh(in[0], out);
}

static int gelu_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    const fsdp_gelu_approx_t *approx = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    return rc < 0 ? rc : fsdp_gelu(in[0], *approx, out);
}

static int dropout_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    const double *p = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    return rc < 0 ? rc : fsdp_dropout(in[0], *p, fsdp_module_is_training(m), out);
}

static int identity_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = fsdp_tensor_retain(in[0]);
    return FSDP_OK;
}

static const fsdp_module_ops_t relu_ops = {"ReLU", relu_forward, NULL};
static const fsdp_module_ops_t tanh_ops = {"Tanh", tanh_forward, NULL};
static const fsdp_module_ops_t gelu_ops = {"GELU", gelu_forward, NULL};
static const fsdp_module_ops_t dropout_ops = {"Dropout", dropout_forward, NULL};
static const fsdp_module_ops_t identity_ops = {"Identity", identity_forward, NULL};

int fsdp_relu_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_relu_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &relu_ops, 0, m, NULL);
}

int fsdp_tanh_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_tanh_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &tanh_ops, 0, m, NULL);
}

int fsdp_identity_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_identity_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &identity_ops, 0, m, NULL);
}

int fsdp_gelu_create(fsdp_ctx_t *ctx, fsdp_gelu_approx_t approx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_gelu_create");
    if (rc < 0) return rc;
    if (approx != FSDP_GELU_ERF && approx != FSDP_GELU_TANH)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gelu_create: unknown approximation %d",
                             (int)approx);
    fsdp_gelu_approx_t *a;
    FSDP_TRY(rc, out, fsdp__module_new(ctx, &gelu_ops, sizeof *a, m, (void **)&a));
    *a = approx;
out:
    return rc;
}

int fsdp_dropout_create(fsdp_ctx_t *ctx, double p, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_dropout_create");
    if (rc < 0) return rc;
    if (!(p >= 0 && p <= 1))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_dropout_create: p %g is outside [0, 1]", p);
    double *pp;
    FSDP_TRY(rc, out, fsdp__module_new(ctx, &dropout_ops, sizeof *pp, m, (void **)&pp));
    *pp = p;
out:
    return rc;
}

/* ---- containers ------------------------------------------------------------------------------ */

static int sequential_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                              fsdp_tensor_t **out) {
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    fsdp_tensor_t *cur = fsdp_tensor_retain(in[0]);
    for (size_t i = 0; i < fsdp_module_num_children(m); i++) {
        fsdp_tensor_t *next = NULL;
        rc = fsdp_module_forward1(fsdp_module_child_at(m, i, NULL), cur, &next);
        fsdp_tensor_release(cur);
        cur = next;
        if (rc < 0) return rc;
    }
    out[0] = cur;
    return FSDP_OK;
}

static int holder_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin;
    (void)in;
    (void)nout;
    (void)out;
    return fsdp__module_err(m, FSDP_ENOTSUP,
                            "a container without forward: run its children instead");
}

static const fsdp_module_ops_t sequential_ops = {"Sequential", sequential_forward, NULL};
static const fsdp_module_ops_t modulelist_ops = {"ModuleList", holder_forward, NULL};
static const fsdp_module_ops_t moduledict_ops = {"ModuleDict", holder_forward, NULL};

int fsdp_sequential_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_sequential_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &sequential_ops, 0, m, NULL);
}

int fsdp_modulelist_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_modulelist_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &modulelist_ops, 0, m, NULL);
}

int fsdp_moduledict_create(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    int rc = check_create(ctx, m, "fsdp_moduledict_create");
    return rc < 0 ? rc : fsdp__module_new(ctx, &moduledict_ops, 0, m, NULL);
}

int fsdp_module_append(fsdp_module_t *m, fsdp_module_t *child) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_append: module is NULL");
    char name[32];
    snprintf(name, sizeof name, "%zu", fsdp_module_num_children(m));
    return fsdp_module_add_child(m, name, child);
}
