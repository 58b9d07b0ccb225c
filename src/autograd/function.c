/* SPDX-License-Identifier: MIT */
/*
 * function.c: operations defined by the caller, with their own backward (PyTorch's
 * torch.autograd.Function).
 *
 * fsdp_function_apply runs the function's forward with recording off, so the tape holds one
 * node for the whole operation, which keeps the inputs. When backward reaches the node it calls
 * the function's backward with the kept inputs and the outputs' gradients, checks what came back
 * (a gradient only where one is wanted, each of its input's shape) and hands it to the engine,
 * which accumulates it as any operation's.
 */
#include <stdio.h>
#include <stdlib.h>

#include "autograd/autograd_impl.h"
#include "autograd/tape_impl.h"
#include "tensor/tensor_impl.h"

struct function_node {
    const fsdp_function_t *fn;
    void *arg;
    void (*arg_free)(void *arg);
};

static void function_free(void *p) {
    struct function_node *f = p;
    if (f->arg_free) f->arg_free(f->arg);
    free(f);
}

static const char *fn_name(const fsdp_function_t *fn) {
    return fn && fn->name ? fn->name : "function";
}

static int function_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                             fsdp_tensor_t **gin) {
    struct function_node *f = node->extra;
    fsdp_ctx_t *ctx = fsdp_tensor_ctx(gout[0]);
    int nin = node->nin;
    int rc = f->fn->backward(ctx, f->arg, nin, node->saved, node->needs, node->nout, gout, gin);
    if (rc < 0) {
        for (int i = 0; i < nin; i++) {
            fsdp_tensor_release(gin[i]);
            gin[i] = NULL;
        }
        return rc;
    }
    for (int i = 0; i < nin; i++) {
        if (!gin[i]) continue;
        const fsdp_tensor_t *x = node->saved[i];
        if (!node->needs[i]) { /* not wanted: dropped, as PyTorch ignores it */
            fsdp_tensor_release(gin[i]);
            gin[i] = NULL;
            continue;
        }
        bool same = x && gin[i]->ndim == x->ndim;
        for (int d = 0; same && d < x->ndim; d++)
            same = gin[i]->shape[d] == x->shape[d];
        if (!same) {
            char got[96], want[96];
            fsdp__shape_str(gin[i]->ndim, gin[i]->shape, got, sizeof got);
            fsdp__shape_str(x ? x->ndim : 0, x ? x->shape : NULL, want, sizeof want);
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "%s: backward returned a gradient of shape %s for input %d, which "
                               "has shape %s",
                               fn_name(f->fn), got, i, want);
            break;
        }
    }
    if (rc < 0)
        for (int i = 0; i < nin; i++) {
            fsdp_tensor_release(gin[i]);
            gin[i] = NULL;
        }
    return rc;
}

static const struct fsdp__op_def def_function = {"function", function_backward};

int fsdp_function_apply(fsdp_ctx_t *ctx, const fsdp_function_t *fn, void *arg,
                        void (*arg_free)(void *arg), int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    bool owned = false;
    int rc = FSDP_OK;
    if (out)
        for (int o = 0; o < nout; o++)
            out[o] = NULL;
    if (!ctx || !fn || !fn->forward || !fn->backward || nin < 1 || nout < 1 || !in || !out) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "fsdp_function_apply(%s): a function with forward and backward, at "
                           "least one input and one output are required (nin %d, nout %d)",
                           fn_name(fn), nin, nout);
        goto out;
    }
    if (nin > FSDP__NODE_SAVED) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_function_apply(%s): at most %d inputs (got %d)",
                           fn_name(fn), FSDP__NODE_SAVED, nin);
        goto out;
    }
    for (int i = 0; i < nin; i++)
        if (!in[i]) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_function_apply(%s): input %d is NULL",
                               fn_name(fn), i);
            goto out;
        }
    bool was = fsdp_set_grad_enabled(ctx, false);
    rc = fn->forward(ctx, arg, nin, in, nout, out);
    fsdp_set_grad_enabled(ctx, was);
    for (int o = 0; o < nout && rc == 0; o++)
        if (!out[o])
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_function_apply(%s): forward left output %d "
                               "NULL",
                               fn_name(fn), o);
    if (rc < 0) goto fail;

    struct fsdp__node *node = NULL;
    rc = fsdp__record(&def_function, nin, in, nout, out, &node);
    if (rc < 0) goto fail;
    if (!node) goto out; /* nothing needs a gradient */
    struct function_node *f = malloc(sizeof *f);
    if (!f) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_function_apply(%s): out of memory", fn_name(fn));
        goto fail; /* the node stays on the tape and is freed with it */
    }
    *f = (struct function_node){fn, arg, arg_free};
    owned = true;
    if ((rc = fsdp__node_adopt(node, f, function_free, nin, in)) < 0) goto fail;
    return FSDP_OK;
fail:
    fsdp__drop_outputs(nout, out);
out:
    if (!owned && arg_free) arg_free(arg);
    return rc;
}
