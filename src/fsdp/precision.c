/*
 * precision.c: mixed precision at run time, every dtype change FSDP makes to a unit's tensors
 * (docs/design.md, "Mixed precision and offload on CUDA"):
 *   - the unit's compute dtype (param_dtype) and reduction dtype (reduce_dtype), set at wrap;
 *   - the shard's copy in the compute dtype that the all-gather sends (unshard.c);
 *   - the floating buffers in buffer_dtype, once, at lazy init;
 *   - forward inputs in param_dtype (cast_forward_inputs; cast_root_forward_inputs at the root),
 *     and the inputs and outputs of a unit that the policy kept in full precision;
 *   - the unsharded gradient in reduce_dtype before its reduction, and the reduced gradient
 *     back in the parameters' dtype (on the host with CPU offload) for the optimizer (grads.c).
 * Only floating tensors are ever cast. Casts of differentiable tensors are recorded (their
 * gradient comes back in the input's dtype); the shard and gradient casts are not.
 */
#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

void fsdp__mp_set_dtypes(fsdp_unit_t *u) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    u->cdt = mp->enabled && mp->param_dtype != FSDP_MP_UNSET ? mp->param_dtype : u->dt;
    u->rdt = mp->enabled && mp->reduce_dtype != FSDP_MP_UNSET ? mp->reduce_dtype : u->cdt;
}

int fsdp__mp_cast_shard(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    return fsdp_tensor_copy_(dst, src);
}

/* Casts the floating buffers of the modules u manages (its subtree outside nested units and
 * ignored modules) to its buffer_dtype, replacing the tensors in the module slots. */
int fsdp__mp_cast_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (!mp->enabled || mp->buffer_dtype == FSDP_MP_UNSET) return FSDP_OK;
    if (!top && (fsdp_unit_of(m) || fsdp__unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t, *c = NULL;
        if (!fsdp_dtype_is_float(b->dt) || b->dt == mp->buffer_dtype) continue;
        rc = fsdp_to_dtype(b, mp->buffer_dtype, &c);
        if (rc == 0) rc = fsdp_tensor_set_name(c, fsdp_tensor_name(b));
        if (rc < 0) {
            fsdp_tensor_release(c);
            break;
        }
        fsdp_tensor_release(b);
        m->buffers[i].t = c;
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = fsdp__mp_cast_buffers(u, m->children[i].m, false);
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
    if (!mp->enabled || mp->param_dtype == FSDP_MP_UNSET) return FSDP_OK;
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

int fsdp__mp_grad_for_param(fsdp_unit_t *u, fsdp_tensor_t **g) {
    fsdp_tensor_t *out = *g;
    if (!u->opt.cpu_offload && out->dt == u->dt) return FSDP_OK;
    fsdp_tensor_t *h = NULL;
    const int64_t n[1] = {fsdp_tensor_numel(out)};
    int rc = fsdp__tensor_new(u->ctx, u->opt.cpu_offload ? u->host_dev : u->dev, u->dt, 1, n,
                              u->opt.cpu_offload ? FSDP_MEM_OFFLOAD : FSDP_MEM_GRADS, &h);
    if (rc == 0) rc = fsdp__xcopy(h, out); /* the D2H copy of an offloaded gradient */
    fsdp_tensor_release(out);
    *g = h;
    return rc;
}
