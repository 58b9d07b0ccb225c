/*
 * state_dict.c: FSDP's FULL state dict (PyTorch's FULL_STATE_DICT): a summon of the whole tree
 * without writeback, the module's state dict copied out, buffers that mixed precision cast put
 * back in their dtype from before wrapping; and its load, a summon with writeback around the
 * module's load.
 *
 * The buffers' original dtypes are the ones precision.c recorded when it cast them
 * (u->mp_bufs); an entry is matched to a recorded buffer by storage, since the module's state
 * dict holds detached views of its tensors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

void fsdp_full_state_dict_options_init(fsdp_full_state_dict_options_t *o) {
    if (o) *o = (fsdp_full_state_dict_options_t){0};
}

/* The dtype the buffer viewed by t had before a unit of units[0..n) cast it, or -1. */
static int orig_buffer_dtype(fsdp_unit_t *const *units, size_t n, const fsdp_tensor_t *t) {
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < units[i]->nmp_bufs; k++) {
            const struct fsdp__mp_buffer *r = &units[i]->mp_bufs[k];
            if (r->slot < r->m->nbuffers && fsdp_tensor_same_storage(r->m->buffers[r->slot].t, t))
                return (int)r->orig;
        }
    return -1;
}

static int check_root(fsdp_unit_t *root, const char *fn) {
    if (!root) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: root is NULL", fn);
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: '%s' is not a root unit (call it on the root)", fn,
                              fsdp__unit_label(root));
    if (root->state != FSDP_STATE_IDLE || fsdp_in_backward(root->ctx))
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: the tree is in forward, backward or a summon; call it between "
                              "iterations",
                              fn);
    return FSDP_OK;
}

int fsdp_full_state_dict(fsdp_unit_t *root, const fsdp_full_state_dict_options_t *o,
                         fsdp_named_list_t *out) {
    static const char fn[] = "fsdp_full_state_dict";
    if (out) *out = (fsdp_named_list_t){0};
    int rc = check_root(root, fn);
    if (rc < 0) return rc;
    if (!out) return fsdp__unit_err(root, FSDP_EINVAL, "%s: out is NULL", fn);
    fsdp_full_state_dict_options_t def;
    if (!o) {
        fsdp_full_state_dict_options_init(&def);
        o = &def;
    }
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.rank0_only = o->rank0_only;
    so.offload_to_cpu = o->offload_to_cpu;
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    fsdp_named_list_t sd = {0};
    if ((rc = fsdp_units(root, &units, &nu)) < 0) return rc;
    if ((rc = fsdp_summon_begin(root, &so)) < 0) {
        free(units);
        return rc;
    }
    out->owned = true;
    if (!o->rank0_only || root->rank == 0) {
        rc = fsdp_module_state_dict(root->module, &sd);
        size_t n = sd.n;
        if (rc == 0) {
            out->names = calloc(n ? n : 1, sizeof *out->names);
            out->tensors = calloc(n ? n : 1, sizeof *out->tensors);
            if (!out->names || !out->tensors)
                rc = fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn);
        }
        for (size_t i = 0; i < n && rc == 0; i++) {
            fsdp_tensor_t *t = sd.tensors[i], *c = NULL;
            int odt = orig_buffer_dtype(units, nu, t);
            if (odt >= 0 && (fsdp_dtype_t)odt != fsdp_tensor_dtype(t))
                rc = fsdp_to_dtype(t, (fsdp_dtype_t)odt, &c);
            else
                rc = fsdp_tensor_clone(t, FSDP_MEM_OTHER, &c);
            out->names[i] = strdup(sd.names[i]);
            out->tensors[i] = c;
            out->n = i + 1;
            if (rc == 0 && !out->names[i])
                rc = fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn);
            else if (rc < 0)
                rc = fsdp__unit_err(root, rc, "%s: copying '%s' failed: %s", fn, sd.names[i],
                                    fsdp_ctx_last_error(root->ctx));
        }
    }
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    fsdp_named_list_free(&sd);
    free(units);
    if (rc < 0) {
        fsdp_named_list_free(out);
        *out = (fsdp_named_list_t){0};
    }
    return rc;
}

int fsdp_load_full_state_dict(fsdp_unit_t *root, const fsdp_named_list_t *sd, bool strict) {
    static const char fn[] = "fsdp_load_full_state_dict";
    int rc = check_root(root, fn);
    if (rc < 0) return rc;
    if (!sd) return fsdp__unit_err(root, FSDP_EINVAL, "%s: sd is NULL", fn);
    if ((rc = fsdp_summon_begin(root, NULL)) < 0) return rc;
    rc = fsdp_module_load_state_dict(root->module, sd, strict);
    char msg[FSDP_ERR_LEN] = "";
    if (rc < 0) snprintf(msg, sizeof msg, "%s", fsdp_ctx_last_error(root->ctx));
    /* The summon's writeback runs either way: after a failed strict load it writes back the
     * values the shards had. */
    int rc2 = fsdp_summon_end(root);
    if (rc < 0) return fsdp__unit_err(root, rc, "%s: %s", fn, msg);
    return rc2;
}
