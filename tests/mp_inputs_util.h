/* SPDX-License-Identifier: MIT */
/*
 * mp_inputs_util.h: what the mixed-precision input tests share (t_mp_inputs.c, t_mp_dp_inputs.c):
 * casting a module's parameters and buffers by hand, recording the dtypes a module's forward
 * receives, the kernels' dtype error, and a MixedPrecision from three dtypes.
 */
#ifndef FSDP_TEST_MP_INPUTS_UTIL_H
#define FSDP_TEST_MP_INPUTS_UTIL_H

#include <stdbool.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "nn/nn_impl.h" /* the reference's buffer casts: there is no public buffer setter */

#define DTYPE_PHRASE "must have the same dtype"
#define MAT_PHRASE "mat1 and mat2 must have the same dtype"

/* PyTorch's gradient pre- and post-divide factors for a world of w ranks
 * (_get_gradient_predivide_factor): pre is the largest power of two with pre * pre < w ... */
static inline void divide_factors(int w, double *pre, double *post) {
    int f = 1;
    while (w % f == 0 && w / f > f)
        f *= 2;
    *pre = f;
    *post = (double)w / f;
}

/* Replaces every parameter of m's tree with a leaf copy in dt that requires grad (tied
 * parameters stay tied): the reference's "parameters in param_dtype". */
static inline int params_to(fsdp_module_t *m, fsdp_dtype_t dt) {
    fsdp_named_list_t ps = {0};
    int rc = fsdp_module_named_params(m, true, &ps);
    /* Under no-grad, so that the copies are new leaves rather than nodes of a graph. */
    bool was = fsdp_set_grad_enabled(fsdp_module_ctx(m), false);
    fsdp_tensor_t **from = calloc(ps.n + 1, sizeof *from), **to = calloc(ps.n + 1, sizeof *to);
    size_t nd = 0;
    if (!from || !to) rc = FSDP_ENOMEM;
    for (size_t i = 0; i < ps.n && rc == 0; i++) {
        fsdp_tensor_t *h = NULL;
        for (size_t k = 0; k < nd; k++)
            if (from[k] == ps.tensors[i]) h = to[k];
        if (!h) {
            if ((rc = fsdp_to_dtype(ps.tensors[i], dt, &h)) < 0) break;
            if ((rc = fsdp_tensor_set_requires_grad(h, true)) < 0) {
                fsdp_tensor_release(h);
                break;
            }
            from[nd] = ps.tensors[i];
            to[nd++] = h;
        }
        rc = fsdp_module_set_param(m, ps.names[i], h, false);
    }
    for (size_t k = 0; k < nd; k++)
        fsdp_tensor_release(to[k]);
    fsdp_set_grad_enabled(fsdp_module_ctx(m), was);
    free(from);
    free(to);
    fsdp_named_list_free(&ps);
    return rc;
}

/* Casts every floating buffer of m's tree to dt, as FSDP's buffer_dtype does (through the
 * module's slots: nn.h has no buffer setter). */
static inline int buffers_to(fsdp_module_t *m, fsdp_dtype_t dt) {
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t, *c = NULL;
        if (!fsdp_dtype_is_float(fsdp_tensor_dtype(b)) || fsdp_tensor_dtype(b) == dt) continue;
        if ((rc = fsdp_to_dtype(b, dt, &c)) < 0) break;
        fsdp_tensor_release(b);
        m->buffers[i].t = c;
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = buffers_to(m->children[i].m, dt);
    return rc;
}

/* Returns the tensor holding the expected full values for parameter `fqn` (fully qualified
 * under the root module), borrowed; NULL when there is none. */

/* The dtypes a module received, recorded by a forward pre-hook. */
typedef struct seen {
    int calls;
    int n;
    fsdp_dtype_t dt[4];
} seen_t;

static inline int record_inputs(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    seen_t *s = arg;
    s->calls++;
    s->n = nin < 4 ? nin : 4;
    for (int i = 0; i < s->n; i++)
        s->dt[i] = in[i] ? fsdp_tensor_dtype(in[i]) : FSDP_DTYPE_COUNT;
    return 0;
}

static inline int watch(fsdp_module_t *m, seen_t *s) {
    memset(s, 0, sizeof *s);
    int h;
    return fsdp_module_add_forward_pre_hook(m, record_inputs, s, &h);
}

static inline const char *dt_name(const seen_t *s, int i) {
    return s->calls == 0 || i >= s->n ? "(not run)" : fsdp_dtype_name(s->dt[i]);
}

static inline bool saw(const seen_t *s, int i, fsdp_dtype_t dt) {
    return s->calls > 0 && i < s->n && s->dt[i] == dt;
}

/* The message says MAT_PHRASE (or, for a bias, DTYPE_PHRASE) and names the linear op. */
static inline bool dtype_error(int rc, const char *msg, bool mat) {
    return rc == FSDP_EINVAL && msg && strstr(msg, mat ? MAT_PHRASE : DTYPE_PHRASE) &&
           strstr(msg, "linear");
}

static inline void mp_init(fsdp_mixed_precision_t *mp, fsdp_dtype_t param, fsdp_dtype_t reduce,
                           fsdp_dtype_t buffer) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
    mp->param_dtype = param;
    mp->reduce_dtype = reduce;
    mp->buffer_dtype = buffer;
}

#endif /* FSDP_TEST_MP_INPUTS_UTIL_H */
