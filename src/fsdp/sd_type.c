/* SPDX-License-Identifier: MIT */
/*
 * sd_type.c: the state-dict type of a model (PyTorch's FSDP.set_state_dict_type): the root unit
 * remembers FULL, SHARDED or LOCAL (and FULL's options), and one pair of calls gets and loads the
 * model's state dict, and one pair the optimizer's, of that type. Every type comes as a list of
 * pieces (fsdp_shard_list_t): a FULL entry is a whole tensor, a replicated piece at offset 0, so
 * the caller handles one kind of list whatever the type. The work is done by the functions of
 * each type (state_dict.c, optim_state.c, optim_full.c); this file only chooses and converts.
 */
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "tensor/tensor_impl.h"

static int check_root(fsdp_unit_t *root, const char *fn) {
    if (!root) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: root is NULL", fn);
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: '%s' is not a root unit", fn,
                              fsdp__unit_label(root));
    return FSDP_OK;
}

int fsdp_set_state_dict_type(fsdp_unit_t *root, fsdp_state_dict_type_t type,
                             const fsdp_full_state_dict_options_t *o) {
    static const char fn[] = "fsdp_set_state_dict_type";
    int rc = check_root(root, fn);
    if (rc < 0) return rc;
    if ((int)type < 0 || type > FSDP_STATE_DICT_LOCAL)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: type %d is not FSDP_STATE_DICT_FULL, _SHARDED or _LOCAL", fn,
                              (int)type);
    if ((rc = fsdp__abi_check(root->ctx, fn, "o", o, &fsdp__full_sd_options_abi)) < 0) return rc;
    root->sd_type = type;
    fsdp_full_state_dict_options_init(&root->sd_full);
    if (o) fsdp__abi_copy_in(&root->sd_full, o, &fsdp__full_sd_options_abi);
    return FSDP_OK;
}

fsdp_state_dict_type_t fsdp_get_state_dict_type(const fsdp_unit_t *root) {
    return root && !root->parent ? root->sd_type : FSDP_STATE_DICT_FULL;
}

/* A named list of whole tensors as replicated pieces (references). */
static int whole_pieces(fsdp_unit_t *root, const fsdp_named_list_t *nl, fsdp_shard_list_t *out) {
    *out = (fsdp_shard_list_t){0};
    out->e = calloc(nl->n + 1, sizeof *out->e);
    if (!out->e) return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
    for (size_t i = 0; i < nl->n; i++) {
        fsdp_shard_entry_t *e = &out->e[out->n];
        const fsdp_tensor_t *t = nl->tensors[i];
        *e =
            (fsdp_shard_entry_t){.name = strdup(nl->names[i]), .ndim = t->ndim, .replicated = true};
        if (!e->name) {
            fsdp_shard_list_free(out);
            return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
        }
        memcpy(e->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        e->t = fsdp_tensor_retain(nl->tensors[i]);
        out->n++;
    }
    return FSDP_OK;
}

/* The whole tensors of a FULL list (borrowed into a named list), or FSDP_EINVAL naming an entry
 * that is a piece. */
static int whole_list(fsdp_unit_t *root, const fsdp_shard_list_t *sd, fsdp_named_list_t *nl,
                      const char *fn) {
    *nl = (fsdp_named_list_t){0};
    if (!sd) return fsdp__unit_err(root, FSDP_EINVAL, "%s: the state dict is NULL", fn);
    for (size_t i = 0; i < sd->n; i++) {
        const fsdp_shard_entry_t *e = &sd->e[i];
        bool whole = e->t && e->offset == 0 && e->ndim == e->t->ndim &&
                     memcmp(e->shape, e->t->shape, sizeof(int64_t) * (size_t)e->ndim) == 0;
        if (!whole)
            return fsdp__unit_err(root, FSDP_EINVAL,
                                  "%s: the state-dict type is FULL, whose entries are whole "
                                  "tensors, but '%s' is a piece (offset %lld) or has no tensor",
                                  fn, e->name ? e->name : "(null)", (long long)e->offset);
    }
    nl->names = calloc(sd->n + 1, sizeof *nl->names);
    nl->tensors = calloc(sd->n + 1, sizeof *nl->tensors);
    if (!nl->names || !nl->tensors) {
        free(nl->names);
        free(nl->tensors);
        return fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn);
    }
    for (size_t i = 0; i < sd->n; i++) {
        nl->names[i] = sd->e[i].name;
        nl->tensors[i] = sd->e[i].t;
    }
    nl->n = sd->n;
    return FSDP_OK;
}

int fsdp_unit_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out) {
    int rc = check_root(root, "fsdp_unit_state_dict");
    if (rc < 0) return rc;
    switch (root->sd_type) {
    case FSDP_STATE_DICT_SHARDED:
        return fsdp_sharded_state_dict(root, out);
    case FSDP_STATE_DICT_LOCAL:
        return fsdp_local_state_dict(root, out);
    default:
        break;
    }
    fsdp_named_list_t nl = {0};
    if ((rc = fsdp_full_state_dict(root, &root->sd_full, &nl)) == 0)
        rc = whole_pieces(root, &nl, out);
    fsdp_named_list_free(&nl);
    return rc;
}

int fsdp_unit_load_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd, bool strict) {
    static const char fn[] = "fsdp_unit_load_state_dict";
    int rc = check_root(root, fn);
    if (rc < 0) return rc;
    switch (root->sd_type) {
    case FSDP_STATE_DICT_SHARDED:
        return fsdp_load_sharded_state_dict(root, sd);
    case FSDP_STATE_DICT_LOCAL:
        return fsdp_load_local_state_dict(root, sd);
    default:
        break;
    }
    fsdp_named_list_t nl;
    if ((rc = whole_list(root, sd, &nl, fn)) < 0) return rc;
    rc = fsdp_load_full_state_dict(root, &nl, strict);
    free(nl.names); /* borrowed entries */
    free(nl.tensors);
    return rc;
}

int fsdp_unit_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt, fsdp_shard_list_t *out) {
    int rc = check_root(root, "fsdp_unit_optim_state_dict");
    if (rc < 0) return rc;
    if (root->sd_type != FSDP_STATE_DICT_FULL) return fsdp_sharded_optim_state_dict(root, opt, out);
    fsdp_named_list_t nl = {0};
    if ((rc = fsdp_full_optim_state_dict(root, opt, &root->sd_full, &nl)) == 0)
        rc = whole_pieces(root, &nl, out);
    fsdp_named_list_free(&nl);
    return rc;
}

int fsdp_unit_load_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                    const fsdp_shard_list_t *sd) {
    static const char fn[] = "fsdp_unit_load_optim_state_dict";
    int rc = check_root(root, fn);
    if (rc < 0) return rc;
    if (root->sd_type != FSDP_STATE_DICT_FULL)
        return fsdp_load_sharded_optim_state_dict(root, opt, sd);
    fsdp_named_list_t nl;
    if ((rc = whole_list(root, sd, &nl, fn)) < 0) return rc;
    rc = fsdp_load_full_optim_state_dict(root, opt, &nl);
    free(nl.names);
    free(nl.tensors);
    return rc;
}
