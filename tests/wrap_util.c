/* SPDX-License-Identifier: MIT */
/*
 * wrap_util.c: see wrap_util.h.
 */
#include "wrap_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/models.h"
#include "tap.h"

static FILE *err_file;
static int err_saved = -1;

void wu_stderr_begin(void) {
    fflush(stderr);
    err_file = tmpfile();
    err_saved = dup(2);
    if (err_file && err_saved >= 0) dup2(fileno(err_file), 2);
}

void wu_stderr_end(char *buf, size_t n) {
    buf[0] = 0;
    fflush(stderr);
    if (err_saved >= 0) {
        dup2(err_saved, 2);
        close(err_saved);
        err_saved = -1;
    }
    if (!err_file) return;
    rewind(err_file);
    size_t got = fread(buf, 1, n - 1, err_file);
    buf[got] = 0;
    fclose(err_file);
    err_file = NULL;
}

/* Runs the children in registration order, each on the previous one's output. */
static int chain_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    fsdp_tensor_t *x = fsdp_tensor_retain(in[0]);
    for (size_t i = 0; i < fsdp_module_num_children(m); i++) {
        fsdp_tensor_t *y = NULL;
        int rc = fsdp_module_forward1(fsdp_module_child_at(m, i, NULL), x, &y);
        fsdp_tensor_release(x);
        if (rc < 0) return rc;
        x = y;
    }
    out[0] = x;
    return FSDP_OK;
}

const fsdp_module_ops_t wu_mymodel_ops = {"MyModel", chain_forward, NULL};
static const fsdp_module_ops_t nested_ops = {"Nested", chain_forward, NULL};

int wu_adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child) {
    int rc = child ? fsdp_module_add_child(m, name, child) : FSDP_ENOMEM;
    fsdp_module_release(child);
    return rc;
}

fsdp_module_t *wu_lin11(fsdp_ctx_t *c) {
    fsdp_module_t *l = NULL;
    return fsdp_linear_create(c, 1, 1, false, &l) < 0 ? NULL : l;
}

int wu_my_model(fsdp_ctx_t *c, bool nested, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *n = NULL, *s = NULL;
    *out = NULL;
    tm_manual_seed(c, 0);
    int rc = fsdp_module_create(c, &wu_mymodel_ops, NULL, &m);
    if (rc < 0) goto fail;
    if (nested) {
        if ((rc = fsdp_sequential_create(c, &s)) < 0) goto fail;
        for (int i = 0; i < 2 && rc == 0; i++) {
            fsdp_module_t *l = wu_lin11(c);
            rc = l ? fsdp_module_append(s, l) : FSDP_ENOMEM;
            fsdp_module_release(l);
        }
        if (rc == 0) rc = fsdp_module_add_child(m, "lin1", s);
        fsdp_module_release(s);
        s = NULL;
    } else {
        rc = wu_adopt(m, "lin1", wu_lin11(c));
    }
    if (rc == 0) rc = wu_adopt(m, "lin2", wu_lin11(c));
    if (rc == 0) rc = wu_adopt(m, "lin3", wu_lin11(c));
    if (rc == 0) rc = fsdp_module_create(c, &nested_ops, NULL, &n);
    if (rc == 0) rc = wu_adopt(n, "nested_lin", wu_lin11(c));
    if (rc == 0) rc = fsdp_module_add_child(m, "lin4", n);
    fsdp_module_release(n);
    if (rc < 0) goto fail;
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(s);
    fsdp_module_release(m);
    return rc;
}

fsdp_policy_t *wu_size_policy(int64_t min_num_params) {
    fsdp_size_policy_options_t so;
    fsdp_size_policy_options_init(&so);
    so.min_num_params = min_num_params;
    fsdp_policy_t *p = NULL;
    if (fsdp_policy_size_based_create(&so, &p) < 0) tap_bail("size policy");
    return p;
}

fsdp_policy_t *wu_always_policy(void) {
    fsdp_policy_t *p = NULL;
    if (fsdp_policy_always_create(&p) < 0) tap_bail("always policy");
    return p;
}

const char *wu_unit_names(const fsdp_unit_t *root) {
    static _Thread_local char buf[1024];
    fsdp_unit_t **u = NULL;
    size_t n = 0, o = 0;
    buf[0] = 0;
    if (!root) return "(no unit)";
    if (fsdp_units(root, &u, &n) < 0) return "(fsdp_units failed)";
    for (size_t i = 0; i < n && o < sizeof buf; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s", i ? "|" : "",
                              fsdp_unit_is_root(u[i]) ? "(root)" : fsdp_unit_fqn(u[i]));
    free(u);
    return buf;
}

int wu_ta08_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    struct wu_ta08 *a = arg;
    const char *t = fsdp_module_type(m);
    if (m == a->bn) {
        if (a->uniform) return FSDP_POLICY_YES;
        ov->has_strategy = true;
        ov->strategy = FSDP_NO_SHARD;
        return FSDP_POLICY_OVERRIDE;
    }
    if (strcmp(t, "TransformerEncoderLayer") == 0) return FSDP_POLICY_YES;
    if (strcmp(t, "TransformerDecoderLayer") == 0) {
        if (a->uniform) return FSDP_POLICY_YES;
        ov->has_strategy = true;
        ov->strategy = FSDP_SHARD_GRAD_OP;
        ov->has_backward_prefetch = true;
        ov->backward_prefetch = FSDP_BACKWARD_POST;
        return FSDP_POLICY_OVERRIDE;
    }
    return FSDP_POLICY_NO;
}

const char *const wu_lora_types[] = {"LoraAttention", "LoraMLP", "LoraDecoder", NULL};

int wu_lora_fn(fsdp_module_t *m, fsdp_unit_overrides_t *ov, void *arg) {
    bool uniform = *(const bool *)arg;
    const char *t = fsdp_module_type(m);
    if (!uniform && strcmp(t, "LoraAttention") == 0) {
        ov->has_strategy = true;
        ov->strategy = FSDP_SHARD_GRAD_OP;
        return FSDP_POLICY_OVERRIDE;
    }
    for (const char *const *k = wu_lora_types; *k; k++)
        if (strcmp(t, *k) == 0) return FSDP_POLICY_YES;
    return FSDP_POLICY_NO;
}
