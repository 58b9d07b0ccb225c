/* SPDX-License-Identifier: MIT */
/*
 * state_dict.c: FSDP's model state dicts. FULL (PyTorch's FULL_STATE_DICT): a summon of the whole
 * tree without writeback, the module's state dict copied out, buffers that mixed precision cast
 * put back in their dtype from before wrapping; its load, a summon with writeback around the
 * module's load. SHARDED and LOCAL: each rank's pieces of the parameters (or its flat shards)
 * with their place in the global tensors, and the load that takes, from pieces cut at any world
 * size, the ranges a rank holds now, checking every piece before it writes (the helpers
 * optim_state.c shares are declared in fsdp_impl.h).
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

const fsdp__abi_struct_t fsdp__full_sd_options_abi = FSDP__ABI_STRUCT(
    fsdp_full_state_dict_options_t, "fsdp_full_state_dict_options_init", offload_to_cpu);

void(fsdp_full_state_dict_options_init)(fsdp_full_state_dict_options_t *o, size_t size) {
    fsdp_full_state_dict_options_t d;
    memset(&d, 0, sizeof d);
    fsdp__abi_init(o, size, &d, &fsdp__full_sd_options_abi);
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

int fsdp__sd_check_root(fsdp_unit_t *root, const char *fn) {
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
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    if (!out) return fsdp__unit_err(root, FSDP_EINVAL, "%s: out is NULL", fn);
    if ((rc = fsdp__abi_check(root->ctx, fn, "o", o, &fsdp__full_sd_options_abi)) < 0) return rc;
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
    int rc = fsdp__sd_check_root(root, fn);
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

/* ---- shard lists ----------------------------------------------------------------------------- */

/* Appends an entry taking t's reference (released on failure). */
int fsdp__sd_push(fsdp_unit_t *root, fsdp_shard_list_t *l, size_t *cap, char *name,
                  fsdp_tensor_t *t, int ndim, const int64_t *shape, int64_t offset,
                  bool replicated) {
    if (!name || !t) {
        free(name);
        fsdp_tensor_release(t);
        return fsdp__unit_err(root, FSDP_ENOMEM, "state dict: out of memory");
    }
    if (l->n == *cap) {
        size_t nc = *cap ? 2 * *cap : 16;
        fsdp_shard_entry_t *ne = realloc(l->e, nc * sizeof *ne);
        if (!ne) {
            free(name);
            fsdp_tensor_release(t);
            return fsdp__unit_err(root, FSDP_ENOMEM, "state dict: out of memory");
        }
        l->e = ne;
        *cap = nc;
    }
    fsdp_shard_entry_t *e = &l->e[l->n++];
    *e = (fsdp_shard_entry_t){
        .name = name, .t = t, .ndim = ndim, .offset = offset, .replicated = replicated};
    if (ndim > 0) memcpy(e->shape, shape, (size_t)ndim * sizeof *shape); /* scalars: NULL */
    return FSDP_OK;
}

/* Whether t views the flat shard of a unit of units[0..n) (a managed parameter). */
static bool managed(fsdp_unit_t *const *units, size_t n, const fsdp_tensor_t *t) {
    for (size_t i = 0; i < n; i++)
        if (units[i]->flat && fsdp_tensor_same_storage(units[i]->flat, t)) return true;
    return false;
}

/* The replicated entries: every persistent buffer (in its dtype from before mixed precision)
 * and every parameter no unit manages, copied. */
static int add_replicated(fsdp_unit_t *root, fsdp_unit_t *const *units, size_t nu,
                          fsdp_shard_list_t *out, size_t *cap) {
    fsdp_named_list_t msd = {0};
    int rc = fsdp_module_state_dict(root->module, &msd);
    for (size_t i = 0; i < msd.n && rc == 0; i++) {
        fsdp_tensor_t *t = msd.tensors[i], *c = NULL;
        if (managed(units, nu, t)) continue;
        int odt = orig_buffer_dtype(units, nu, t);
        rc = odt >= 0 && (fsdp_dtype_t)odt != t->dt ? fsdp_to_dtype(t, (fsdp_dtype_t)odt, &c)
                                                    : fsdp_tensor_clone(t, FSDP_MEM_OTHER, &c);
        if (rc == 0)
            rc = fsdp__sd_push(root, out, cap, strdup(msd.names[i]), c, t->ndim, t->shape, 0, true);
    }
    fsdp_named_list_free(&msd);
    return rc;
}

/* A copy (or, without copy, a view) of q's part of u's shard from src (the flat shard, or a
 * state tensor laid out like it or like q's original parameter) starting at element off: 1-D,
 * or with q's shape when every rank holds q whole (NO_SHARD: *repl). */
int fsdp__sd_piece(const fsdp_unit_t *u, const struct fsdp__param *q, fsdp_tensor_t *src,
                   int64_t off, bool copy, fsdp_tensor_t **out, bool *repl) {
    fsdp_tensor_t *v = NULL, *c = NULL, *whole = NULL;
    *out = NULL;
    *repl = !fsdp__is_sharded(u->opt.strategy);
    int rc = fsdp__view1d(src, off, q->sh.numel_in_shard, &v);
    if (rc == 0 && copy) {
        rc = fsdp_tensor_clone(v, FSDP_MEM_OTHER, &c);
        fsdp_tensor_release(v);
    } else {
        c = v;
    }
    if (rc == 0 && *repl) {
        rc = fsdp_view(c, q->ndim, q->shape, &whole);
        fsdp_tensor_release(c);
        c = whole;
    }
    if (rc == 0)
        *out = c;
    else
        fsdp_tensor_release(c);
    return rc;
}

/* The SHARDED entries of u's parameters that this rank holds part of. */
static int add_pieces(fsdp_unit_t *root, fsdp_unit_t *u, bool copy, fsdp_shard_list_t *out,
                      size_t *cap) {
    int rc = FSDP_OK;
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        if (!p->sh.in_shard || p->sh.numel_in_shard == 0) continue;
        fsdp_tensor_t *c = NULL;
        bool repl = false;
        rc = fsdp__sd_piece(u, p, u->flat, p->sh.offset_in_shard, copy, &c, &repl);
        if (rc == 0)
            rc = fsdp__sd_push(root, out, cap, fsdp__join_name(u->fqn, p->fqn), c, p->ndim,
                               p->shape, p->sh.intra_start, repl);
    }
    return rc;
}

/* The LOCAL entry of u: its flat shard as it is. */
static int add_local(fsdp_unit_t *root, fsdp_unit_t *u, fsdp_shard_list_t *out, size_t *cap) {
    if (!u->flat) return FSDP_OK;
    fsdp_tensor_t *c = NULL;
    int rc = fsdp_tensor_clone(u->flat, FSDP_MEM_OTHER, &c);
    if (rc < 0) return rc;
    int shard_rank = fsdp__is_sharded(u->opt.strategy) ? u->rank : 0;
    const int64_t shape[1] = {fsdp__is_sharded(u->opt.strategy) ? u->layout.padded_numel
                                                                : u->layout.shard_numel};
    return fsdp__sd_push(root, out, cap, fsdp__join_name(u->fqn, "_flat_param"), c, 1, shape,
                         (int64_t)shard_rank * u->layout.shard_numel, false);
}

static int make_list(fsdp_unit_t *root, bool local, bool copy, fsdp_shard_list_t *out,
                     const char *fn) {
    if (out) *out = (fsdp_shard_list_t){0};
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    if (!out) return fsdp__unit_err(root, FSDP_EINVAL, "%s: out is NULL", fn);
    fsdp_unit_t **units = NULL;
    size_t nu = 0, cap = 0;
    if ((rc = fsdp_units(root, &units, &nu)) < 0) return rc;
    for (size_t i = 0; i < nu && rc == 0; i++)
        rc = local ? add_local(root, units[i], out, &cap)
                   : add_pieces(root, units[i], copy, out, &cap);
    if (rc == 0) rc = add_replicated(root, units, nu, out, &cap);
    free(units);
    if (rc < 0) {
        fsdp__unit_err(root, rc, "%s: %s", fn, fsdp_ctx_last_error(root->ctx));
        fsdp_shard_list_free(out);
    }
    return rc;
}

int fsdp_sharded_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out) {
    return make_list(root, false, true, out, "fsdp_sharded_state_dict");
}

int fsdp__sharded_state_dict_views(fsdp_unit_t *root, fsdp_shard_list_t *out) {
    return make_list(root, false, false, out, "fsdp_sharded_state_dict");
}

int fsdp_local_state_dict(fsdp_unit_t *root, fsdp_shard_list_t *out) {
    return make_list(root, true, true, out, "fsdp_local_state_dict");
}

/* ---- loading pieces -------------------------------------------------------------------------- */

static int cmp_off(const void *a, const void *b) {
    const fsdp_shard_entry_t *x = *(fsdp_shard_entry_t *const *)a,
                             *y = *(fsdp_shard_entry_t *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static bool same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
    if (na != nb) return false;
    for (int i = 0; i < na; i++)
        if (a[i] != b[i]) return false;
    return true;
}

/* Checks the pieces of sd named like t (their shapes, overlaps, coverage of t's range); with
 * write, copies the overlaps into t->dst. */
int fsdp__sd_fill(fsdp_unit_t *root, const fsdp_shard_list_t *sd, struct fsdp__sd_target *t,
                  fsdp_shard_entry_t **tmp, bool write, const char *fn) {
    size_t k = 0;
    for (size_t i = 0; i < sd->n; i++)
        if (strcmp(sd->e[i].name, t->name) == 0) tmp[k++] = &sd->e[i];
    if (k == 0) {
        if (t->numel == 0) return FSDP_OK;
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: no entry for '%s'", fn, t->name);
    }
    t->seen = true;
    qsort(tmp, k, sizeof *tmp, cmp_off);
    int64_t covered = t->lo;
    for (size_t i = 0; i < k; i++) {
        const fsdp_shard_entry_t *e = tmp[i];
        int64_t n = e->t ? fsdp_tensor_numel(e->t) : -1;
        if (!same_shape(e->ndim, e->shape, t->ndim, t->shape))
            return fsdp__unit_err(root, FSDP_EINVAL,
                                  "%s: '%s': an entry's global shape differs from the tensor's "
                                  "(%d dimensions, first %lld; the tensor's %d, first %lld)",
                                  fn, t->name, e->ndim, (long long)(e->ndim ? e->shape[0] : 0),
                                  t->ndim, (long long)(t->ndim ? t->shape[0] : 0));
        if (n < 0 || e->offset < 0 || e->offset + n > t->total)
            return fsdp__unit_err(root, FSDP_EINVAL,
                                  "%s: '%s': a piece of %lld elements at offset %lld runs past "
                                  "the tensor's %lld",
                                  fn, t->name, (long long)n, (long long)e->offset,
                                  (long long)t->total);
        if (e->replicated && (n != t->total || e->offset != 0))
            return fsdp__unit_err(root, FSDP_EINVAL,
                                  "%s: '%s': a replicated entry holds %lld elements at offset "
                                  "%lld, not the whole tensor's %lld",
                                  fn, t->name, (long long)n, (long long)e->offset,
                                  (long long)t->total);
        if (i > 0) {
            int64_t pstart = tmp[i - 1]->offset, pend = pstart + fsdp_tensor_numel(tmp[i - 1]->t);
            /* The same piece twice (replicas of it, from ranks that hold the same part) is
             * taken once; any other overlap is ambiguous. */
            if (e->offset == pstart && e->offset + n == pend) continue;
            if (e->offset < pend)
                return fsdp__unit_err(root, FSDP_EINVAL, "%s: '%s': pieces overlap at element %lld",
                                      fn, t->name, (long long)e->offset);
        }
        int64_t a = e->offset > t->lo ? e->offset : t->lo;
        int64_t b = e->offset + n < t->lo + t->numel ? e->offset + n : t->lo + t->numel;
        if (a >= b) continue;
        if (a > covered) break; /* a gap before this piece */
        covered = b;
        if (!write) continue;
        fsdp_tensor_t *src = NULL, *dst = NULL, *flat_src = NULL;
        int rc = fsdp_contiguous(e->t, &flat_src);
        if (rc == 0) rc = fsdp__view1d(flat_src, a - e->offset, b - a, &src);
        if (rc == 0) rc = fsdp__view1d(t->dst, a - t->lo, b - a, &dst);
        /* a piece that is a view of these very elements (a checkpoint read into the shard where
         * it lies) is already in place */
        bool in_place = rc == 0 && fsdp_tensor_same_storage(src, dst) &&
                        fsdp_tensor_data(src) == fsdp_tensor_data(dst) && src->dt == dst->dt;
        if (rc == 0 && !in_place) rc = fsdp__xcopy(dst, src);
        fsdp_tensor_release(src);
        fsdp_tensor_release(dst);
        fsdp_tensor_release(flat_src);
        if (rc < 0) return rc;
    }
    if (covered < t->lo + t->numel)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: '%s': elements [%lld, %lld) of this rank's part are in no "
                              "piece (rank %d)",
                              fn, t->name, (long long)covered, (long long)(t->lo + t->numel),
                              root->rank);
    return FSDP_OK;
}

static void free_targets(struct fsdp__sd_target *t, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(t[i].name);
        fsdp_tensor_release(t[i].dst);
    }
    free(t);
}

/* The targets of a load: this rank's part of every managed parameter (or, local, every flat
 * shard) and every replicated tensor. */
static int collect_targets(fsdp_unit_t *root, fsdp_unit_t *const *units, size_t nu, bool local,
                           struct fsdp__sd_target **out, size_t *nout, fsdp_named_list_t *msd) {
    size_t cap = 16, n = 0;
    struct fsdp__sd_target *t = calloc(cap, sizeof *t);
    int rc = t ? fsdp_module_state_dict(root->module, msd) : FSDP_ENOMEM;
#define GROW()                                                                                     \
    do {                                                                                           \
        if (n == cap) {                                                                            \
            struct fsdp__sd_target *nt = realloc(t, 2 * cap * sizeof *t);                          \
            if (!nt) {                                                                             \
                rc = FSDP_ENOMEM;                                                                  \
                break;                                                                             \
            }                                                                                      \
            memset(nt + cap, 0, cap * sizeof *t);                                                  \
            t = nt;                                                                                \
            cap *= 2;                                                                              \
        }                                                                                          \
    } while (0)
    for (size_t i = 0; i < nu && rc == 0; i++) {
        fsdp_unit_t *u = units[i];
        if (!u->flat) continue;
        int shard_rank = fsdp__is_sharded(u->opt.strategy) ? u->rank : 0;
        if (local) {
            GROW();
            if (rc < 0) break;
            struct fsdp__sd_target *x = &t[n++];
            x->name = fsdp__join_name(u->fqn, "_flat_param");
            x->ndim = 1;
            x->shape = fsdp__is_sharded(u->opt.strategy) ? &u->layout.padded_numel
                                                         : &u->layout.shard_numel;
            x->total = x->shape[0];
            x->lo = (int64_t)shard_rank * u->layout.shard_numel;
            x->numel = u->layout.shard_numel;
            x->dst = fsdp_tensor_retain(u->flat);
            if (!x->name) rc = FSDP_ENOMEM;
            continue;
        }
        for (int k = 0; k < u->nparams && rc == 0; k++) {
            struct fsdp__param *p = &u->params[k];
            GROW();
            if (rc < 0) break;
            struct fsdp__sd_target *x = &t[n++];
            x->name = fsdp__join_name(u->fqn, p->fqn);
            x->ndim = p->ndim;
            x->shape = p->shape;
            x->total = fsdp_tensor_numel(p->cv);
            x->lo = p->sh.in_shard ? p->sh.intra_start : 0;
            x->numel = p->sh.in_shard ? p->sh.numel_in_shard : 0;
            if (!x->name)
                rc = FSDP_ENOMEM;
            else if (x->numel > 0)
                rc = fsdp__view1d(u->flat, p->sh.offset_in_shard, x->numel, &x->dst);
        }
    }
    for (size_t i = 0; i < msd->n && rc == 0; i++) {
        fsdp_tensor_t *v = msd->tensors[i];
        if (managed(units, nu, v)) continue;
        GROW();
        if (rc < 0) break;
        struct fsdp__sd_target *x = &t[n++];
        x->name = strdup(msd->names[i]);
        x->ndim = v->ndim;
        x->shape = v->shape;
        x->total = fsdp_tensor_numel(v);
        x->lo = 0;
        x->numel = x->total;
        x->replicated = true;
        if (!x->name)
            rc = FSDP_ENOMEM;
        else if (!fsdp_tensor_is_contiguous(v))
            rc = fsdp__unit_err(root, FSDP_EINVAL, "'%s' is not contiguous: it cannot be loaded",
                                x->name);
        if (rc == 0) rc = fsdp__view1d(v, 0, x->total, &x->dst);
    }
#undef GROW
    *out = t;
    *nout = n;
    return rc;
}

static int load_list(fsdp_unit_t *root, const fsdp_shard_list_t *sd, bool local, const char *fn) {
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    if (!sd || (sd->n > 0 && !sd->e))
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: sd is NULL", fn);
    fsdp_unit_t **units = NULL;
    size_t nu = 0, nt = 0;
    struct fsdp__sd_target *t = NULL;
    fsdp_named_list_t msd = {0};
    fsdp_shard_entry_t **tmp = calloc(sd->n + 1, sizeof *tmp);
    if (!tmp) return fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn);
    if ((rc = fsdp_units(root, &units, &nu)) < 0) goto out;
    rc = collect_targets(root, units, nu, local, &t, &nt, &msd);
    if (rc < 0) {
        rc = fsdp__unit_err(root, rc, "%s: listing the model's tensors failed", fn);
        goto out;
    }
    for (size_t i = 0; i < sd->n; i++) {
        bool known = false;
        for (size_t k = 0; k < nt && !known; k++)
            known = strcmp(t[k].name, sd->e[i].name) == 0;
        if (!known) {
            rc = fsdp__unit_err(root, FSDP_EINVAL, "%s: unexpected entry '%s' (no such %s)", fn,
                                sd->e[i].name,
                                local ? "flat parameter or buffer" : "parameter or buffer");
            goto out;
        }
    }
    /* Every check first, then the copies. */
    for (int write = 0; write < 2 && rc == 0; write++)
        for (size_t k = 0; k < nt && rc == 0; k++) {
            if (local && !t[k].replicated && sd->n > 0) {
                for (size_t i = 0; i < sd->n; i++)
                    if (strcmp(sd->e[i].name, t[k].name) == 0 && !sd->e[i].replicated &&
                        (sd->e[i].offset != t[k].lo || fsdp_tensor_numel(sd->e[i].t) != t[k].numel))
                        rc = fsdp__unit_err(
                            root, FSDP_EINVAL,
                            "%s: '%s' holds %lld elements at offset %lld but this rank's shard "
                            "is %lld at %lld: a LOCAL state dict loads only into the wrapping "
                            "and world size that wrote it",
                            fn, t[k].name, (long long)fsdp_tensor_numel(sd->e[i].t),
                            (long long)sd->e[i].offset, (long long)t[k].numel, (long long)t[k].lo);
                if (rc < 0) break;
            }
            rc = fsdp__sd_fill(root, sd, &t[k], tmp, write == 1, fn);
        }
    /* A unit kept unsharded (NO_SHARD with its own full copy, or after a forward) would compute
     * with the old values: it gathers the loaded shard at its next forward. */
    for (size_t i = 0; i < nu && rc == 0; i++)
        if (units[i]->unsharded && fsdp__separate_full(units[i])) rc = fsdp__reshard(units[i]);
out:
    free(tmp);
    free(units);
    free_targets(t, nt);
    fsdp_named_list_free(&msd);
    return rc;
}

int fsdp_load_sharded_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd) {
    return load_list(root, sd, false, "fsdp_load_sharded_state_dict");
}

int fsdp_load_local_state_dict(fsdp_unit_t *root, const fsdp_shard_list_t *sd) {
    return load_list(root, sd, true, "fsdp_load_local_state_dict");
}
