/* SPDX-License-Identifier: MIT */
/*
 * precision.c: mixed precision at run time, every dtype change FSDP makes to a unit's tensors
 * (docs/design.md, "Mixed precision and offload on CUDA"):
 *   - the unit's compute dtype (param_dtype) and reduction dtype (reduce_dtype), set at wrap,
 *     and full precision forced in eval (use_full_prec_in_eval): the unsharded parameter and
 *     the compute views change dtype, the reduction runs in the parameters' dtype;
 *   - the shard's copy in the compute dtype that the all-gather sends (unshard.c);
 *   - the floating buffers in buffer_dtype at lazy init, back in their own dtype in a
 *     full-precision eval forward, and in buffer_dtype again in the next train forward;
 *   - forward inputs in param_dtype (cast_forward_inputs; cast_root_forward_inputs at the root),
 *     and the inputs and outputs of a unit that the policy kept in full precision;
 *   - the unsharded gradient in reduce_dtype before its reduction, and the reduced gradient
 *     in the sharded gradient's dtype (the parameters', or param_dtype with
 *     keep_low_precision_grads; on the host with CPU offload) for the optimizer (grads.c).
 * Only floating tensors are ever cast. Casts of differentiable tensors are recorded (their
 * gradient comes back in the input's dtype); the shard and gradient casts are not.
 */
#include <stdlib.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

void fsdp__mp_set_dtypes(fsdp_unit_t *u) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    u->mp_cdt = mp->enabled && mp->param_dtype != FSDP_MP_UNSET ? mp->param_dtype : u->dt;
    u->mp_rdt = mp->enabled && mp->reduce_dtype != FSDP_MP_UNSET ? mp->reduce_dtype : u->mp_cdt;
    u->cdt = u->mp_cdt;
    u->rdt = u->mp_rdt;
    u->full_prec = false;
}

bool fsdp__mp_full_prec_in_eval(const fsdp_options_t *o) {
    return o->use_full_prec_in_eval || fsdp__env_is("FSDP_USE_FULL_PREC_IN_EVAL", "1");
}

void fsdp__mp_free(fsdp_unit_t *u) {
    free(u->mp_bufs);
    u->mp_bufs = NULL;
    u->nmp_bufs = 0;
}

int fsdp__mp_cast_shard(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    return fsdp_tensor_copy_(dst, src);
}

/* Casts the buffer in slot i of m to dt (a new tensor in the slot, named as the old one). */
static int cast_buffer(fsdp_module_t *m, size_t i, fsdp_dtype_t dt) {
    fsdp_tensor_t *b = m->buffers[i].t, *c = NULL;
    if (b->dt == dt) return FSDP_OK;
    int rc = fsdp_to_dtype(b, dt, &c);
    if (rc == 0) rc = fsdp_tensor_set_name(c, fsdp_tensor_name(b));
    if (rc < 0) {
        fsdp_tensor_release(c);
        return rc;
    }
    fsdp_tensor_release(b);
    m->buffers[i].t = c;
    return FSDP_OK;
}

/* Casts the floating buffers of the modules u manages (its subtree outside nested units and
 * ignored modules) to its buffer_dtype, replacing the tensors in the module slots, and records
 * each with its dtype from before. */
int fsdp__mp_cast_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (!mp->enabled || mp->buffer_dtype == FSDP_MP_UNSET) return FSDP_OK;
    if (!top && (fsdp_unit_of(m) || fsdp__unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t;
        if (!fsdp_dtype_is_float(b->dt)) continue;
        bool known = false;
        for (size_t k = 0; k < u->nmp_bufs && !known; k++)
            known = u->mp_bufs[k].m == m && u->mp_bufs[k].slot == i;
        if (!known) {
            struct fsdp__mp_buffer *nb = realloc(u->mp_bufs, (u->nmp_bufs + 1) * sizeof *nb);
            if (!nb) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
            u->mp_bufs = nb;
            u->mp_bufs[u->nmp_bufs++] = (struct fsdp__mp_buffer){m, i, b->dt};
        }
        rc = cast_buffer(m, i, mp->buffer_dtype);
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = fsdp__mp_cast_buffers(u, m->children[i].m, false);
    return rc;
}

/* The recorded buffers of u in their own dtype (full) or in buffer_dtype. */
static int buffers_to(fsdp_unit_t *u, bool full) {
    int rc = FSDP_OK;
    for (size_t k = 0; k < u->nmp_bufs && rc == 0; k++) {
        struct fsdp__mp_buffer *r = &u->mp_bufs[k];
        if (r->slot >= r->m->nbuffers) continue; /* the module dropped it */
        rc = cast_buffer(r->m, r->slot, full ? r->orig : u->opt.mixed_precision.buffer_dtype);
    }
    if (rc < 0)
        return fsdp__unit_err(u, rc, "casting buffers to %s failed: %s",
                              full ? "their own dtype (full precision in eval)" : "buffer_dtype",
                              fsdp_ctx_last_error(u->ctx));
    return FSDP_OK;
}

/* Gives u's unsharded flat parameter and its compute views the dtype dt, each tensor object
 * kept (the unit is sharded: full has no bytes). */
static int retype_full(fsdp_unit_t *u, fsdp_dtype_t dt) {
    const int64_t n[1] = {u->layout.padded_numel};
    fsdp_tensor_t *nf = NULL, *v = NULL;
    int rc = fsdp__tensor_new(u->ctx, u->dev, dt, 1, n, FSDP_MEM_PARAMS, &nf);
    if (rc == 0) rc = fsdp_tensor_storage_resize(nf, 0);
    if (rc == 0) {
        u->full->dt = dt;
        rc = fsdp__tensor_set_data(u->full, nf);
    }
    fsdp_tensor_release(nf);
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        rc = fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL, &v);
        if (rc < 0) break;
        fsdp__contiguous_strides(p->ndim, p->shape, v->stride);
        fsdp_tensor_release(p->cv->grad);
        p->cv->grad = NULL;
        p->cv->dt = dt;
        rc = fsdp__tensor_set_data(p->cv, v);
        fsdp_tensor_release(v);
        v = NULL;
    }
    return rc;
}

/* u in full precision (full) or in its configured precision. */
static int set_full_prec(fsdp_unit_t *u, bool full) {
    if (u->full_prec == full) return FSDP_OK;
    if (u->needs_pre_backward || u->full_grad || u->rs_in)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "cannot switch to %s precision for this %s forward: the graph of an "
                              "earlier forward of the unit has not been differentiated yet (run "
                              "its backward, or drop it, first)",
                              full ? "full" : "mixed", full ? "eval" : "train");
    int rc = FSDP_OK;
    fsdp_dtype_t cdt = full ? u->dt : u->mp_cdt;
    if (u->nparams > 0 && cdt != u->cdt) {
        rc = fsdp__reshard(u);
        if (rc == 0) rc = retype_full(u, cdt);
        if (rc < 0)
            return fsdp__unit_err(u, rc, "switching the unsharded parameter to %s failed: %s",
                                  fsdp_dtype_name(cdt), fsdp_ctx_last_error(u->ctx));
        u->cdt = cdt;
    }
    if (u->nparams > 0) u->rdt = full ? u->dt : u->mp_rdt;
    if ((rc = buffers_to(u, full)) < 0) return rc;
    u->full_prec = full;
    return FSDP_OK;
}

int fsdp__mp_select(fsdp_unit_t *root) {
    int rc = FSDP_OK;
    for (size_t i = 0; i < root->nall && rc == 0; i++) {
        fsdp_unit_t *u = root->all[i];
        bool want = root->full_prec_in_eval && u->opt.mixed_precision.enabled &&
                    !fsdp_module_is_training(u->module);
        rc = set_full_prec(u, want);
    }
    return rc;
}

/* Casts the floating tensors of t[0..n) that are not of dtype dt to dt (differentiably),
 * replacing them; what names them in messages. */
static int cast_floats(fsdp_unit_t *u, int n, fsdp_tensor_t **t, int dt, const char *what) {
    for (int i = 0; i < n; i++) {
        if (!t[i] || !fsdp_dtype_is_float(t[i]->dt) || (int)t[i]->dt == dt) continue;
        fsdp_tensor_t *c = NULL;
        int rc = fsdp_to_dtype(t[i], (fsdp_dtype_t)dt, &c);
        if (rc < 0)
            return fsdp__unit_err(u, rc, "casting forward %s %d from %s to %s failed: %s", what, i,
                                  fsdp_dtype_name(t[i]->dt), fsdp_dtype_name((fsdp_dtype_t)dt),
                                  fsdp_ctx_last_error(u->ctx));
        fsdp_tensor_release(t[i]);
        t[i] = c;
    }
    return FSDP_OK;
}

/* A unit the mixed-precision rule made full-precision (batch norm under a low-precision model):
 * remembers the dtype of its last floating input, then runs the module in the parameters' dtype
 * (upstream's _override_module_mixed_precision hooks). */
int fsdp__mp_cast_io_inputs(fsdp_unit_t *u, int nin, fsdp_tensor_t **in) {
    u->io_dt = -1;
    for (int i = 0; i < nin; i++)
        if (in[i] && fsdp_dtype_is_float(in[i]->dt)) u->io_dt = (int)in[i]->dt;
    return cast_floats(u, nin, in, (int)u->dt, "input");
}

int fsdp__mp_cast_io_outputs(fsdp_unit_t *u, int nout, fsdp_tensor_t **out) {
    if (!u->cast_io || u->io_dt < 0) return FSDP_OK;
    return cast_floats(u, nout, out, u->io_dt, "output");
}

int fsdp__mp_cast_forward_inputs(fsdp_unit_t *u, bool is_root, int nin, fsdp_tensor_t **in) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (!mp->enabled || mp->param_dtype == FSDP_MP_UNSET || u->full_prec) return FSDP_OK;
    if (!((is_root && mp->cast_root_forward_inputs) || mp->cast_forward_inputs)) return FSDP_OK;
    return cast_floats(u, nin, in, (int)mp->param_dtype, "input");
}

int fsdp__mp_grad_for_reduce(fsdp_unit_t *u, fsdp_tensor_t **g) {
    if ((*g)->dt == u->rdt) return FSDP_OK;
    fsdp_tensor_t *c = NULL;
    int rc = fsdp_to_dtype(*g, u->rdt, &c);
    fsdp_tensor_release(*g);
    *g = c;
    return rc;
}

fsdp_dtype_t fsdp__mp_grad_dtype(const fsdp_unit_t *u) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    return mp->enabled && mp->keep_low_precision_grads ? u->cdt : u->dt;
}

int fsdp__mp_grad_for_param(fsdp_unit_t *u, fsdp_tensor_t **g) {
    fsdp_tensor_t *out = *g;
    fsdp_dtype_t gdt = fsdp__mp_grad_dtype(u);
    if (!u->opt.cpu_offload && out->dt == gdt) return FSDP_OK;
    fsdp_tensor_t *h = NULL;
    const int64_t n[1] = {fsdp_tensor_numel(out)};
    int rc = fsdp__tensor_new(u->ctx, u->opt.cpu_offload ? u->host_dev : u->dev, gdt, 1, n,
                              u->opt.cpu_offload ? FSDP_MEM_OFFLOAD : FSDP_MEM_GRADS, &h);
    if (rc == 0) rc = fsdp__xcopy(h, out); /* the D2H copy of an offloaded gradient */
    fsdp_tensor_release(out);
    *g = h;
    return rc;
}
