/* SPDX-License-Identifier: MIT */
/*
 * module_hooks.c: module hooks and fsdp_module_forward, the one way a module runs.
 *
 * Forward hooks run around ops->forward, each kind in registration order, over a snapshot of
 * the hooks, so that a hook may add or remove hooks. Backward hooks ride on tape marks: an
 * entry mark before the module's operations (backward reaches it after them: post-hooks) and
 * an exit mark after (backward reaches it first: pre-hooks). A mark holds a reference to the
 * module, so a module dropped by its owner stays valid until the tape lets go of the mark.
 * Marks are recorded only for modules that have hooks of the matching kind, so an unhooked
 * model puts nothing extra on the tape.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "nn/nn_impl.h"

/* ---- hooks ------------------------------------------------------------------------------- */

static int add_hook(fsdp_module_t *m, enum fsdp__hook_kind kind, struct fsdp__hook h, bool fn_set,
                    int *handle, const char *fn) {
    if (handle) *handle = 0;
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: module is NULL", fn);
    if (!fn_set) return fsdp__module_err(m, FSDP_EINVAL, "%s: hook function is NULL", fn);
    if (fsdp__module_grow((void **)&m->hooks, &m->caphooks, m->nhooks, sizeof *m->hooks))
        return fsdp__module_err(m, FSDP_ENOMEM, "%s: out of memory", fn);
    h.kind = kind;
    h.handle = ++m->next_handle;
    m->hooks[m->nhooks++] = h;
    m->nhooks_kind[kind]++;
    if (handle) *handle = h.handle;
    return FSDP_OK;
}

int fsdp_module_add_forward_pre_hook(fsdp_module_t *m, fsdp_forward_pre_hook_fn fn, void *arg,
                                     int *handle) {
    struct fsdp__hook h = {0};
    h.fn.pre = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_FORWARD_PRE, h, fn != NULL, handle,
                    "fsdp_module_add_forward_pre_hook");
}

int fsdp_module_add_forward_hook(fsdp_module_t *m, fsdp_forward_hook_fn fn, void *arg,
                                 int *handle) {
    struct fsdp__hook h = {0};
    h.fn.post = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_FORWARD, h, fn != NULL, handle, "fsdp_module_add_forward_hook");
}

int fsdp_module_add_backward_pre_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn, void *arg,
                                      int *handle) {
    struct fsdp__hook h = {0};
    h.fn.bw = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_BACKWARD_PRE, h, fn != NULL, handle,
                    "fsdp_module_add_backward_pre_hook");
}

int fsdp_module_add_backward_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn, void *arg,
                                  int *handle) {
    struct fsdp__hook h = {0};
    h.fn.bw = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_BACKWARD, h, fn != NULL, handle, "fsdp_module_add_backward_hook");
}

int fsdp_module_remove_hook(fsdp_module_t *m, int handle) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_remove_hook: module is NULL");
    for (size_t i = 0; i < m->nhooks; i++) {
        if (m->hooks[i].handle != handle) continue;
        m->nhooks_kind[m->hooks[i].kind]--;
        memmove(&m->hooks[i], &m->hooks[i + 1], (m->nhooks - i - 1) * sizeof *m->hooks);
        m->nhooks--;
        return FSDP_OK;
    }
    return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_remove_hook: no hook with handle %d",
                            handle);
}

/* The hooks of one kind at this moment, so that a hook may add or remove hooks while they run.
 * *out is freed by the caller. */
static int snapshot_hooks(fsdp_module_t *m, enum fsdp__hook_kind kind, struct fsdp__hook **out,
                          size_t *n) {
    *out = NULL;
    *n = 0;
    if (m->nhooks_kind[kind] == 0) return FSDP_OK;
    struct fsdp__hook *s = malloc((size_t)m->nhooks_kind[kind] * sizeof *s);
    if (!s) return fsdp__module_err(m, FSDP_ENOMEM, "running hooks: out of memory");
    for (size_t i = 0; i < m->nhooks; i++)
        if (m->hooks[i].kind == kind) s[(*n)++] = m->hooks[i];
    *out = s;
    return FSDP_OK;
}

/* Rewrites the context's error after a failing hook so that it says which hook failed. */
static int hook_failed(fsdp_module_t *m, const char *what, int handle, int rc) {
    char prev[FSDP_ERR_LEN];
    snprintf(prev, sizeof prev, "%s", fsdp_ctx_last_error(m->ctx));
    return fsdp__module_err(m, rc, "%s %d failed (%s): %s", what, handle, fsdp_err_name(rc), prev);
}

static int run_backward_hooks(fsdp_module_t *m, enum fsdp__hook_kind kind, bool has_grad) {
    struct fsdp__hook *hs;
    size_t n;
    int rc = snapshot_hooks(m, kind, &hs, &n);
    for (size_t i = 0; i < n && rc == 0; i++) {
        int r = hs[i].fn.bw(m, hs[i].arg, has_grad);
        if (r < 0)
            rc = hook_failed(m, kind == FSDP__HOOK_BACKWARD ? "backward hook" : "backward pre-hook",
                             hs[i].handle, r);
    }
    free(hs);
    return rc;
}

static int mark_backward_post(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    (void)ctx;
    return run_backward_hooks(arg, FSDP__HOOK_BACKWARD, has_grad);
}

static int mark_backward_pre(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    (void)ctx;
    return run_backward_hooks(arg, FSDP__HOOK_BACKWARD_PRE, has_grad);
}

static void mark_release(void *arg) {
    fsdp_module_release(arg);
}

/* ---- forward ---------------------------------------------------------------------------- */

/* One call of m: pre-hooks, entry mark, forward, exit mark, post-hooks (arguments checked). */
static int run_module(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                      fsdp_tensor_t **out) {
    int rc = FSDP_OK;
    struct fsdp__hook *hs = NULL;
    size_t nh = 0;
    char label[96];
    fsdp_tensor_t **ins = calloc((size_t)(nin > 0 ? nin : 1), sizeof *ins);
    fsdp_tensor_t **outs = calloc((size_t)(nout > 0 ? nout : 1), sizeof *outs);
    /* Hooks may drop the last outside reference to m; keep it alive until the end. */
    fsdp_module_retain(m);
    if (!ins || !outs) {
        rc = fsdp__module_err(m, FSDP_ENOMEM, "fsdp_module_forward: out of memory");
        goto fail;
    }
    /* Inputs are copied before out[] is cleared, so in and out may be the same array. */
    for (int i = 0; i < nin; i++)
        ins[i] = fsdp_tensor_retain(in[i]);
    for (int o = 0; o < nout; o++)
        out[o] = NULL;

    FSDP_TRY(rc, fail, snapshot_hooks(m, FSDP__HOOK_FORWARD_PRE, &hs, &nh));
    for (size_t i = 0; i < nh; i++) {
        rc = hs[i].fn.pre(m, hs[i].arg, nin, ins);
        if (rc < 0) {
            rc = hook_failed(m, "forward pre-hook", hs[i].handle, rc);
            goto fail;
        }
    }
    free(hs);
    hs = NULL;

    if (m->nhooks_kind[FSDP__HOOK_BACKWARD] > 0) {
        snprintf(label, sizeof label, "%s entry", fsdp_module_type(m));
        FSDP_TRY(rc, fail,
                 fsdp_tape_mark(m->ctx, label, nin, ins, mark_backward_post, fsdp_module_retain(m),
                                mark_release));
    }
    if (!m->ops->forward) {
        rc = fsdp__module_err(m, FSDP_ENOTSUP, "this module type has no forward");
        goto fail;
    }
    FSDP_TRY(rc, fail, m->ops->forward(m, nin, ins, nout, outs));
    for (int o = 0; o < nout; o++) {
        if (!outs[o]) {
            rc =
                fsdp__module_err(m, FSDP_EINTERNAL, "forward succeeded but left output %d NULL", o);
            goto fail;
        }
    }
    if (m->nhooks_kind[FSDP__HOOK_BACKWARD_PRE] > 0) {
        snprintf(label, sizeof label, "%s exit", fsdp_module_type(m));
        FSDP_TRY(rc, fail,
                 fsdp_tape_mark(m->ctx, label, nout, outs, mark_backward_pre, fsdp_module_retain(m),
                                mark_release));
    }

    FSDP_TRY(rc, fail, snapshot_hooks(m, FSDP__HOOK_FORWARD, &hs, &nh));
    for (size_t i = 0; i < nh; i++) {
        rc = hs[i].fn.post(m, hs[i].arg, nin, ins, nout, outs);
        if (rc < 0) {
            rc = hook_failed(m, "forward hook", hs[i].handle, rc);
            goto fail;
        }
        for (int o = 0; o < nout; o++) {
            if (!outs[o]) {
                rc = fsdp__module_err(m, FSDP_EINVAL, "forward hook %d left output %d NULL",
                                      hs[i].handle, o);
                goto fail;
            }
        }
    }
    free(hs);
    for (int o = 0; o < nout; o++)
        out[o] = outs[o];
    for (int i = 0; i < nin; i++)
        fsdp_tensor_release(ins[i]);
    free(ins);
    free(outs);
    fsdp_module_release(m);
    return FSDP_OK;

fail:
    for (int o = 0; o < nout; o++)
        out[o] = NULL;
    free(hs);
    if (ins)
        for (int i = 0; i < nin; i++)
            fsdp_tensor_release(ins[i]);
    if (outs)
        for (int o = 0; o < nout; o++)
            fsdp_tensor_release(outs[o]);
    free(ins);
    free(outs);
    fsdp_module_release(m);
    return rc;
}

/* ---- activation checkpointing -----------------------------------------------------------------
 */

static int region_run_module(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in,
                             int nout, fsdp_tensor_t **out) {
    (void)ctx;
    return run_module(arg, nin, in, nout, out);
}

static void region_release_module(void *arg) {
    fsdp_module_release(arg);
}

int fsdp_module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    if (!m || nin < 0 || nout < 0 || (nin > 0 && !in) || (nout > 0 && !out)) {
        if (out && nout > 0)
            for (int i = 0; i < nout; i++)
                out[i] = NULL;
        if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_forward: module is NULL");
        return fsdp__module_err(m, FSDP_EINVAL,
                                "fsdp_module_forward: bad arguments (nin %d, in %s, nout %d, "
                                "out %s)",
                                nin, in ? "set" : "NULL", nout, out ? "set" : "NULL");
    }
    if (!m->checkpointed || !fsdp_is_grad_enabled(m->ctx) || nout == 0)
        return run_module(m, nin, in, nout, out);
    /* The whole call, hooks included, is one recompute region (PyTorch's checkpoint_wrapper
     * around the module). The region clears out[] first, so in[] is copied (they may be the
     * same array). */
    if (nin > FSDP__NODE_SAVED) {
        for (int o = 0; o < nout; o++)
            out[o] = NULL;
        return fsdp__module_err(m, FSDP_EINVAL,
                                "activation checkpointing keeps at most %d inputs of a module; "
                                "this call has %d",
                                FSDP__NODE_SAVED, nin);
    }
    fsdp_tensor_t *ins[FSDP__NODE_SAVED + 1];
    for (int i = 0; i < nin; i++)
        ins[i] = fsdp_tensor_retain(in[i]);
    int rc = fsdp__checkpoint_owned(m->ctx, region_run_module, fsdp_module_retain(m),
                                    region_release_module, nin, ins, nout, out);
    for (int i = 0; i < nin; i++)
        fsdp_tensor_release(ins[i]);
    return rc;
}

int fsdp_module_set_activation_checkpointing(fsdp_module_t *m, bool on) {
    if (!m)
        return fsdp__ctx_err(NULL, FSDP_EINVAL,
                             "fsdp_module_set_activation_checkpointing: module is NULL");
    m->checkpointed = on;
    return FSDP_OK;
}

bool fsdp_module_activation_checkpointing(const fsdp_module_t *m) {
    return m && m->checkpointed;
}

struct apply_ac {
    const fsdp_module_t *root;
    const char *type;
    fsdp_module_check_fn check;
    void *arg;
    size_t n;
};

static int apply_ac_visit(fsdp_module_t *m, const char *fqn, void *arg) {
    struct apply_ac *a = arg;
    if (m == a->root) return 0;
    if (a->type && strcmp(fsdp_module_type(m), a->type) != 0) return 0;
    if (a->check && !a->check(m, fqn, a->arg)) return 0;
    if (!m->checkpointed) a->n++;
    m->checkpointed = true;
    return 0;
}

int fsdp_apply_activation_checkpointing(fsdp_module_t *root, const char *type,
                                        fsdp_module_check_fn check, void *arg, size_t *count) {
    if (count) *count = 0;
    if (!root)
        return fsdp__ctx_err(NULL, FSDP_EINVAL,
                             "fsdp_apply_activation_checkpointing: root is NULL");
    if (!type && !check)
        return fsdp__module_err(root, FSDP_EINVAL,
                                "fsdp_apply_activation_checkpointing: give a module type, a check "
                                "function or both (selecting every module would nest a region "
                                "in each of its children)");
    struct apply_ac a = {root, type, check, arg, 0};
    int rc = fsdp_module_visit(root, apply_ac_visit, &a);
    if (count) *count = a.n;
    return rc;
}

int fsdp_module_forward1(fsdp_module_t *m, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    if (!y) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_forward1: y is NULL");
    return fsdp_module_forward(m, 1, &x, 1, y);
}
