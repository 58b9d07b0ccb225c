/* SPDX-License-Identifier: MIT */
/*
 * t_nn.c: modules: fully qualified names of nested trees, tied parameters and shared modules,
 * state dicts (to a file and back, strict and non-strict loading, damaged files), forward and
 * backward hooks (order, replacement, removal), train/eval, BatchNorm running statistics,
 * Linear initialisation, freezing, and argument errors.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

static fsdp_ctx_t *new_ctx(uint64_t seed) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = seed;
    fsdp_ctx_t *c = NULL;
    if (fsdp_ctx_create(&o, &c) < 0) tap_bail("fsdp_ctx_create failed");
    return c;
}

static fsdp_module_t *linear(fsdp_ctx_t *c, int64_t in, int64_t out, bool bias) {
    fsdp_module_t *m = NULL;
    if (fsdp_linear_create(c, in, out, bias, &m) < 0)
        tap_bail("fsdp_linear_create: %s", fsdp_ctx_last_error(c));
    return m;
}

/* Appends child to m and drops the caller's reference. */
static void push(fsdp_module_t *m, fsdp_module_t *child) {
    if (fsdp_module_append(m, child) < 0) tap_bail("append: %s", fsdp_ctx_last_error(NULL));
    fsdp_module_release(child);
}

static fsdp_tensor_t *tensor(fsdp_ctx_t *c, int ndim, const int64_t *shape, const float *v) {
    fsdp_tensor_t *t = NULL;
    if (fsdp_tensor_from_host(c, FSDP_DTYPE_F32, ndim, shape, v, FSDP_MEM_OTHER, &t) < 0)
        tap_bail("from_host: %s", fsdp_ctx_last_error(c));
    return t;
}

static double at(const fsdp_tensor_t *t, int64_t i) {
    double x = NAN;
    fsdp_tensor_item(t, i, &x);
    return x;
}

static bool same_values(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (!a || !b || fsdp_tensor_numel(a) != fsdp_tensor_numel(b)) return false;
    for (int64_t i = 0; i < fsdp_tensor_numel(a); i++)
        if (at(a, i) != at(b, i)) return false;
    return true;
}

/* The names of a listing joined with spaces. */
static const char *joined(const fsdp_named_list_t *l) {
    static char buf[1024];
    buf[0] = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (i) strncat(buf, " ", sizeof buf - strlen(buf) - 1);
        strncat(buf, l->names[i][0] ? l->names[i] : "<root>", sizeof buf - strlen(buf) - 1);
    }
    return buf;
}

/* ---- names ---------------------------------------------------------------------------------- */

/* Sequential(Linear(3, 4), Sequential(Linear(4, 2), ReLU), LayerNorm(2)). */
static fsdp_module_t *nested(fsdp_ctx_t *c) {
    fsdp_module_t *root = NULL, *inner = NULL, *relu = NULL, *ln = NULL;
    fsdp_sequential_create(c, &root);
    fsdp_sequential_create(c, &inner);
    fsdp_relu_create(c, &relu);
    fsdp_layernorm_create(c, 2, 1e-5, true, &ln);
    push(inner, linear(c, 4, 2, true));
    push(inner, relu);
    push(root, linear(c, 3, 4, true));
    push(root, inner);
    push(root, ln);
    return root;
}

static void test_names(fsdp_ctx_t *c) {
    fsdp_module_t *root = nested(c);
    fsdp_named_list_t l;
    tap_is_int(fsdp_module_named_params(root, false, &l), 0, "named_params");
    tap_is_str(joined(&l), "0.weight 0.bias 1.0.weight 1.0.bias 2.weight 2.bias",
               "parameter FQNs in pre-order");
    tap_ok(l.tensors[2] == fsdp_module_param(root, "1.0.weight") &&
               l.modules[2] == fsdp_module_child(root, "1.0"),
           "listing gives the tensor and the module that registered it");
    fsdp_named_list_free(&l);
    tap_is_int(fsdp_module_named_modules(root, &l), 0, "named_modules");
    tap_is_str(joined(&l), "<root> 0 1 1.0 1.1 2", "module FQNs, the root first as \"\"");
    tap_ok(l.tensors == NULL && l.modules[0] == root, "module listing holds modules only");
    fsdp_named_list_free(&l);
    tap_is_str(fsdp_module_type(fsdp_module_child(root, "1.1")), "ReLU", "child by path");
    tap_ok(fsdp_module_child(root, "") == root, "the empty path is the module itself");
    tap_ok(!fsdp_module_child(root, "1.2") && !fsdp_module_child(root, "1.") &&
               !fsdp_module_param(root, "1.0.nope") && !fsdp_module_param(root, "3.weight"),
           "absent paths give NULL");
    tap_is_str(fsdp_tensor_name(fsdp_module_param(root, "1.0.weight")), "weight",
               "a parameter is named with its local name");
    tap_is_int(fsdp_module_num_params(root), 3 * 4 + 4 + 4 * 2 + 2 + 2 + 2, "num_params");
    const char *nm = NULL;
    tap_ok(fsdp_module_num_children(root) == 3 && fsdp_module_child_at(root, 1, &nm) &&
               strcmp(nm, "1") == 0 && !fsdp_module_child_at(root, 3, &nm) && !nm,
           "children by index");
    fsdp_module_release(root);
}

/* ---- tied parameters and shared modules ---------------------------------------------------- */

static void test_tied(fsdp_ctx_t *c) {
    fsdp_module_t *root = NULL, *emb = NULL, *head = linear(c, 4, 10, false);
    fsdp_moduledict_create(c, &root);
    fsdp_embedding_create(c, 10, 4, -1, &emb);
    fsdp_module_add_child(root, "emb", emb);
    fsdp_module_add_child(root, "head", head);
    fsdp_tensor_t *w = fsdp_module_param(emb, "weight");
    tap_is_int(fsdp_module_set_param(head, "weight", w, false), 0, "tie head.weight to emb.weight");
    fsdp_named_list_t l;
    fsdp_module_named_params(root, false, &l);
    tap_is_str(joined(&l), "emb.weight", "a tied parameter is listed once, under its first name");
    fsdp_named_list_free(&l);
    fsdp_module_named_params(root, true, &l);
    tap_is_str(joined(&l), "emb.weight head.weight", "with_aliases lists every name");
    fsdp_named_list_free(&l);
    tap_is_int(fsdp_module_param_aliases(root, w, &l), 0, "param_aliases");
    tap_is_str(joined(&l), "emb.weight head.weight", "aliases of the tied weight");
    fsdp_named_list_free(&l);
    tap_is_int(fsdp_module_num_params(root), 40, "a tied parameter is counted once");
    fsdp_module_state_dict(root, &l);
    tap_is_str(joined(&l), "emb.weight head.weight", "the state dict has both names");
    tap_ok(l.owned && l.tensors[0] != w && fsdp_tensor_same_storage(l.tensors[0], w) &&
               !fsdp_tensor_requires_grad(l.tensors[0]),
           "state dict entries are detached views of the parameter");
    fsdp_named_list_free(&l);

    /* A shared child: one Linear appended twice. */
    fsdp_module_t *seq = NULL, *lin = linear(c, 3, 3, true);
    fsdp_sequential_create(c, &seq);
    fsdp_module_append(seq, lin);
    fsdp_module_append(seq, lin);
    fsdp_module_named_params(seq, false, &l);
    tap_is_str(joined(&l), "0.weight 0.bias", "a shared module's parameters are listed once");
    fsdp_named_list_free(&l);
    fsdp_module_named_params(seq, true, &l);
    tap_is_str(joined(&l), "0.weight 0.bias 1.weight 1.bias", "with aliases under both paths");
    fsdp_named_list_free(&l);
    fsdp_module_named_modules(seq, &l);
    tap_is_str(joined(&l), "<root> 0", "a shared module is listed once");
    fsdp_named_list_free(&l);
    float xv[3] = {1, 2, 3};
    fsdp_tensor_t *x = tensor(c, 1, (int64_t[]){3}, xv), *y = NULL;
    tap_is_int(fsdp_module_forward1(seq, x, &y), 0, "a shared module runs twice in forward");
    fsdp_module_release(lin);
    fsdp_module_release(seq); /* the shared child goes with the last holder */
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_module_release(emb);
    fsdp_module_release(head);
    fsdp_module_release(root);
    fsdp_tape_clear(c);
}

/* ---- state dicts ----------------------------------------------------------------------------- */

/* Sequential(Linear(3, 2), BatchNorm1d(2)). */
static fsdp_module_t *small(fsdp_ctx_t *c) {
    fsdp_module_t *root = NULL, *bn = NULL;
    fsdp_sequential_create(c, &root);
    fsdp_batchnorm_create(c, 1, 2, 1e-5, 0.1, &bn);
    push(root, linear(c, 3, 2, true));
    push(root, bn);
    return root;
}

static const char *tmp_path(const char *tag) {
    static char buf[256];
    char name[64];
    snprintf(name, sizeof name, "t_nn_%ld_%s.sd", (long)getpid(), tag);
    tap_tmppath(buf, sizeof buf, name);
    return buf;
}

static void test_state_dict_file(void) {
    fsdp_ctx_t *c1 = new_ctx(1), *c2 = new_ctx(2);
    fsdp_module_t *a = small(c1), *b = small(c2);
    fsdp_tensor_fill_(fsdp_module_buffer(a, "1.running_mean"), 0.25);
    fsdp_tensor_fill_(fsdp_module_buffer(a, "1.num_batches_tracked"), 7);
    fsdp_named_list_t sd, back;
    tap_is_int(fsdp_module_state_dict(a, &sd), 0, "state_dict");
    tap_is_str(joined(&sd),
               "0.weight 0.bias 1.weight 1.bias 1.running_mean 1.running_var "
               "1.num_batches_tracked",
               "state dict keys in PyTorch's order");
    char path[256];
    snprintf(path, sizeof path, "%s", tmp_path("rt"));
    tap_is_int(fsdp_state_dict_save(&sd, path), 0, "save to a file");
    tap_is_int(fsdp_state_dict_load(c2, path, &back), 0, "load the file");
    tap_is_str(joined(&back), joined(&sd), "same keys after the round trip");
    bool same = back.n == sd.n;
    for (size_t i = 0; same && i < sd.n; i++)
        same = fsdp_tensor_dtype(back.tensors[i]) == fsdp_tensor_dtype(sd.tensors[i]) &&
               same_values(back.tensors[i], sd.tensors[i]);
    tap_ok(same, "same dtypes and values after the round trip");
    tap_ok(!same_values(fsdp_module_param(a, "0.weight"), fsdp_module_param(b, "0.weight")),
           "models from two seeds differ");
    tap_is_int(fsdp_module_load_state_dict(b, &back, true), 0, "strict load into another model");
    tap_ok(same_values(fsdp_module_param(a, "0.weight"), fsdp_module_param(b, "0.weight")) &&
               same_values(fsdp_module_param(a, "0.bias"), fsdp_module_param(b, "0.bias")) &&
               at(fsdp_module_buffer(b, "1.running_mean"), 1) == 0.25 &&
               at(fsdp_module_buffer(b, "1.num_batches_tracked"), 0) == 7,
           "parameters and buffers (i64 included) loaded");
    fsdp_named_list_free(&back);

    /* Every truncation of the file is refused cleanly. */
    FILE *f = fopen(path, "rb");
    char *bytes = malloc(4096);
    size_t len = f ? fread(bytes, 1, 4096, f) : 0;
    if (f) fclose(f);
    char cut[256];
    snprintf(cut, sizeof cut, "%s", tmp_path("cut"));
    int bad = 0;
    for (size_t n = 0; n < len; n++) {
        f = fopen(cut, "wb");
        fwrite(bytes, 1, n, f);
        fclose(f);
        int rc = fsdp_state_dict_load(c2, cut, &back);
        if (rc != FSDP_EINVAL || back.n != 0) bad++;
    }
    tap_is_int(bad, 0, "all %zu truncations of the file are FSDP_EINVAL", len);
    fsdp_state_dict_load(c2, cut, &back);
    tap_has_str(fsdp_ctx_last_error(c2), "truncated", "the message says truncated");
    f = fopen(cut, "wb");
    fwrite(bytes, 1, len, f);
    fwrite("x", 1, 1, f);
    fclose(f);
    tap_is_int(fsdp_state_dict_load(c2, cut, &back), FSDP_EINVAL, "trailing bytes are refused");
    bytes[3] = 'X';
    f = fopen(cut, "wb");
    fwrite(bytes, 1, len, f);
    fclose(f);
    tap_is_int(fsdp_state_dict_load(c2, cut, &back), FSDP_EINVAL, "a bad magic is refused");
    tap_has_str(fsdp_ctx_last_error(c2), "FSDPSD01", "naming the magic");
    tap_is_int(fsdp_state_dict_load(c2, "/nonexistent/dir/x.sd", &back), FSDP_EINVAL,
               "a missing file is FSDP_EINVAL");
    remove(cut);
    remove(path);
    free(bytes);
    fsdp_named_list_free(&sd);
    fsdp_module_release(a);
    fsdp_module_release(b);
    fsdp_ctx_destroy(c1);
    fsdp_ctx_destroy(c2);
}

static void test_load_errors(fsdp_ctx_t *c) {
    fsdp_module_t *m = small(c);
    fsdp_named_list_t sd;
    fsdp_module_state_dict(m, &sd);
    /* A hand-made dict: drop "0.bias", add "extra", give "1.weight" a wrong shape, and change
     * every value so that a partial load would show. */
    float v[6] = {9, 9, 9, 9, 9, 9};
    fsdp_tensor_t *w0 = tensor(c, 2, (int64_t[]){2, 3}, v);
    fsdp_tensor_t *extra = tensor(c, 1, (int64_t[]){1}, v);
    fsdp_tensor_t *badw = tensor(c, 1, (int64_t[]){3}, v), *b1 = tensor(c, 1, (int64_t[]){2}, v);
    char *names[] = {"0.weight", "extra", "1.weight", "1.bias"};
    fsdp_tensor_t *ts[] = {w0, extra, badw, b1};
    fsdp_named_list_t mine = {4, names, ts, NULL, false};
    double before = at(fsdp_module_param(m, "0.weight"), 0);
    tap_is_int(fsdp_module_load_state_dict(m, &mine, true), FSDP_EINVAL, "strict load fails");
    const char *e = fsdp_ctx_last_error(c);
    tap_has_str(e, "\"0.bias\"", "naming the missing key");
    tap_has_str(e, "\"1.running_mean\"", "and the other missing keys");
    tap_has_str(e, "\"extra\"", "naming the unexpected key");
    tap_has_str(e, "\"1.weight\" (module f32[2], state dict f32[3])", "naming the mismatch");
    tap_ok(at(fsdp_module_param(m, "0.weight"), 0) == before &&
               at(fsdp_module_param(m, "1.bias"), 0) == 0,
           "nothing was modified");
    tap_is_int(fsdp_module_load_state_dict(m, &mine, false), FSDP_EINVAL,
               "a shape mismatch fails a non-strict load too");
    tap_ok(at(fsdp_module_param(m, "0.weight"), 0) == before, "still nothing modified");
    ts[2] = b1; /* now the right shape */
    tap_is_int(fsdp_module_load_state_dict(m, &mine, false), 0, "non-strict load succeeds");
    tap_ok(at(fsdp_module_param(m, "0.weight"), 5) == 9 &&
               at(fsdp_module_param(m, "1.weight"), 1) == 9 &&
               at(fsdp_module_param(m, "1.bias"), 0) == 9,
           "matching entries were loaded");
    tap_has_str(fsdp_ctx_last_error(c), "\"extra\"", "the report names the unexpected key");
    tap_has_str(fsdp_ctx_last_error(c), "\"0.bias\"", "and the missing one");
    tap_ok(same_values(sd.tensors[0], fsdp_module_param(m, "0.weight")),
           "state dict views see the new values");
    fsdp_tensor_release(w0);
    fsdp_tensor_release(extra);
    fsdp_tensor_release(badw);
    fsdp_tensor_release(b1);
    fsdp_named_list_free(&sd);
    fsdp_module_release(m);
}

/* ---- hooks ----------------------------------------------------------------------------------- */

static char hook_log[512];

static void log_add(const char *s) {
    if (hook_log[0]) strncat(hook_log, " ", sizeof hook_log - strlen(hook_log) - 1);
    strncat(hook_log, s, sizeof hook_log - strlen(hook_log) - 1);
}

/* Replaces the input by zeros: a Linear then gives its bias. */
static int pre_zero(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    log_add(arg);
    fsdp_tensor_t *z = NULL;
    int rc = fsdp_tensor_zeros(fsdp_tensor_ctx(in[0]), FSDP_DTYPE_F32, fsdp_tensor_ndim(in[0]),
                               fsdp_tensor_shape(in[0]), FSDP_MEM_OTHER, &z);
    if (rc < 0) return rc;
    fsdp_tensor_release(in[0]);
    in[0] = z;
    return nin == 1 ? 0 : -1;
}

static int pre_log(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    (void)nin;
    (void)in;
    log_add(arg);
    return 0;
}

/* Replaces the output by output * 2. */
static int post_double(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)m;
    (void)nin;
    (void)in;
    (void)nout;
    log_add(arg);
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_scale(out[0], 2.0, &y);
    if (rc < 0) return rc;
    fsdp_tensor_release(out[0]);
    out[0] = y;
    return 0;
}

static int post_fail(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                     fsdp_tensor_t **out) {
    (void)m;
    (void)arg;
    (void)nin;
    (void)in;
    (void)nout;
    (void)out;
    return FSDP_EREMOTE;
}

static int bw_log(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m;
    char s[64];
    snprintf(s, sizeof s, "%s%s", (const char *)arg, has_grad ? "" : "(no grad)");
    log_add(s);
    return 0;
}

static void test_forward_hooks(fsdp_ctx_t *c) {
    fsdp_module_t *l = linear(c, 2, 2, true);
    float xv[2] = {1, -1};
    fsdp_tensor_t *x = tensor(c, 1, (int64_t[]){2}, xv), *y = NULL, *y0 = NULL;
    fsdp_module_forward1(l, x, &y0);
    fsdp_tensor_t *arr[1] = {x};
    tap_is_int(fsdp_module_forward(l, 1, arr, 1, arr), 0, "in and out may be one array");
    tap_ok(arr[0] != x && same_values(arr[0], y0), "giving the output there");
    fsdp_tensor_release(arr[0]);
    int h1 = 0, h2 = 0, h3 = 0, h4 = 0;
    hook_log[0] = 0;
    tap_is_int(fsdp_module_add_forward_pre_hook(l, pre_log, "pre1", &h1), 0, "add pre-hook");
    fsdp_module_add_forward_pre_hook(l, pre_zero, "pre2", &h2);
    fsdp_module_add_forward_hook(l, post_double, "post1", &h3);
    fsdp_module_add_forward_hook(l, post_double, "post2", &h4);
    tap_ok(h1 > 0 && h2 != h1 && h3 != h2 && h4 != h3 && h4 != h1, "handles are distinct");
    tap_is_int(fsdp_module_forward1(l, x, &y), 0, "forward with hooks");
    tap_is_str(hook_log, "pre1 pre2 post1 post2", "hooks ran in registration order");
    fsdp_tensor_t *bias = fsdp_module_param(l, "bias");
    tap_ok(at(y, 0) == 4 * at(bias, 0) && at(y, 1) == 4 * at(bias, 1),
           "pre-hook replaced the input, post-hooks replaced the output (4 * bias)");
    tap_ok(at(x, 0) == 1, "the caller's input is untouched");
    fsdp_tensor_release(y);
    tap_is_int(fsdp_module_remove_hook(l, h2), 0, "remove the input hook");
    tap_is_int(fsdp_module_remove_hook(l, h3), 0, "remove a forward hook");
    tap_is_int(fsdp_module_remove_hook(l, h3), FSDP_EINVAL, "a removed handle is unknown");
    hook_log[0] = 0;
    fsdp_module_forward1(l, x, &y);
    tap_is_str(hook_log, "pre1 post2", "removed hooks no longer run");
    tap_ok(at(y, 0) == 2 * at(y0, 0), "output is the plain output doubled once");
    fsdp_tensor_release(y);
    int h5 = 0;
    fsdp_module_add_forward_hook(l, post_fail, NULL, &h5);
    y = x; /* must be reset to NULL by the failing forward */
    tap_is_int(fsdp_module_forward1(l, x, &y), FSDP_EREMOTE, "a failing hook fails forward");
    tap_ok(y == NULL, "leaving the output NULL");
    tap_has_str(fsdp_ctx_last_error(c), "forward hook", "and saying which hook failed");
    fsdp_tensor_release(y0);
    fsdp_tensor_release(x);
    fsdp_module_release(l);
    fsdp_tape_clear(c);
}

static void test_backward_hooks(fsdp_ctx_t *c) {
    fsdp_module_t *seq = NULL, *l1 = linear(c, 3, 4, true), *l2 = linear(c, 4, 2, true);
    fsdp_sequential_create(c, &seq);
    fsdp_module_append(seq, l1);
    fsdp_module_append(seq, l2);
    fsdp_module_add_backward_pre_hook(seq, bw_log, "pre:seq", NULL);
    fsdp_module_add_backward_pre_hook(l1, bw_log, "pre:l1", NULL);
    fsdp_module_add_backward_pre_hook(l2, bw_log, "pre:l2", NULL);
    fsdp_module_add_backward_hook(seq, bw_log, "post:seq", NULL);
    fsdp_module_add_backward_hook(l1, bw_log, "post:l1", NULL);
    int h = 0;
    fsdp_module_add_backward_hook(l2, bw_log, "post:l2", &h);
    fsdp_module_add_backward_hook(l2, bw_log, "post:l2b", NULL);
    float xv[6] = {1, 2, 3, -1, 0, 2};
    fsdp_tensor_t *x = tensor(c, 2, (int64_t[]){2, 3}, xv), *y = NULL, *loss = NULL;
    hook_log[0] = 0;
    tap_is_int(fsdp_module_forward1(seq, x, &y), 0, "forward");
    tap_is_str(hook_log, "", "no backward hook runs in forward");
    fsdp_sum(y, 0, NULL, false, &loss);
    /* The tree may go away before backward: the marks keep the modules alive. */
    fsdp_module_release(l1);
    fsdp_module_release(l2);
    fsdp_module_release(seq);
    tap_is_int(fsdp_backward(loss, NULL), 0, "backward");
    tap_is_str(hook_log,
               "pre:seq pre:l2 post:l2 post:l2b pre:l1 post:l1(no grad) post:seq(no grad)",
               "backward hooks in order (pre from the outside in, post inside out)");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);

    /* Removal of a backward hook, and a model without backward hooks records no marks. */
    fsdp_module_t *a = linear(c, 3, 2, true);
    fsdp_module_add_backward_hook(a, bw_log, "post:a", &h);
    tap_is_int(fsdp_module_remove_hook(a, h), 0, "remove a backward hook");
    fsdp_module_forward1(a, x, &y);
    tap_is_size(fsdp_tape_size(c), 1, "an unhooked Linear puts one node on the tape");
    fsdp_sum(y, 0, NULL, false, &loss);
    hook_log[0] = 0;
    fsdp_backward(loss, NULL);
    tap_is_str(hook_log, "", "the removed hook did not run");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_module_release(a);
}

/* ---- modes, BatchNorm, init, freezing ----------------------------------------------------- */

static void test_modes(fsdp_ctx_t *c) {
    fsdp_module_t *root = nested(c);
    tap_ok(fsdp_module_is_training(root), "modules start in training mode");
    fsdp_module_train(root, false);
    fsdp_named_list_t l;
    fsdp_module_named_modules(root, &l);
    bool all = true;
    for (size_t i = 0; i < l.n; i++) all = all && !fsdp_module_is_training(l.modules[i]);
    tap_ok(all, "eval reaches every module");
    fsdp_module_train(fsdp_module_child(root, "1"), true);
    tap_ok(fsdp_module_is_training(fsdp_module_child(root, "1.0")) &&
               !fsdp_module_is_training(root) &&
               !fsdp_module_is_training(fsdp_module_child(root, "2")),
           "train on a subtree changes only the subtree");
    fsdp_named_list_free(&l);
    fsdp_module_release(root);
}

static void test_batchnorm(fsdp_ctx_t *c) {
    fsdp_module_t *bn = NULL;
    tap_is_int(fsdp_batchnorm_create(c, 1, 2, 1e-5, 0.1, &bn), 0, "BatchNorm1d(2)");
    tap_is_str(fsdp_module_type(bn), "BatchNorm1d", "its type");
    /* Channel 0: 1, 2, 3, 6 (mean 3, unbiased var 14/3); channel 1: all 4 (var 0). */
    float xv[8] = {1, 4, 2, 4, 3, 4, 6, 4};
    fsdp_tensor_t *x = tensor(c, 2, (int64_t[]){4, 2}, xv), *y = NULL;
    tap_is_int(fsdp_module_forward1(bn, x, &y), 0, "training forward");
    fsdp_tensor_t *rm = fsdp_module_buffer(bn, "running_mean");
    fsdp_tensor_t *rv = fsdp_module_buffer(bn, "running_var");
    fsdp_tensor_t *nbt = fsdp_module_buffer(bn, "num_batches_tracked");
    tap_is_near(at(rm, 0), 0.3, 1e-6, 0, "running_mean[0] = 0.1 * 3");
    tap_is_near(at(rm, 1), 0.4, 1e-6, 0, "running_mean[1] = 0.1 * 4");
    tap_is_near(at(rv, 0), 0.9 + 0.1 * 14.0 / 3.0, 1e-6, 0, "running_var[0] uses unbiased var");
    tap_is_near(at(rv, 1), 0.9, 1e-6, 0, "running_var[1]");
    tap_ok(fsdp_tensor_dtype(nbt) == FSDP_DTYPE_I64 && fsdp_tensor_ndim(nbt) == 0 &&
               at(nbt, 0) == 1,
           "num_batches_tracked is an i64 scalar at 1");
    tap_is_near(at(y, 0), (1 - 3) / sqrt(3.5 + 1e-5), 1e-5, 0, "output uses the biased batch var");
    fsdp_tensor_release(y);
    fsdp_module_forward1(bn, x, &y);
    fsdp_tensor_release(y);
    tap_ok(at(nbt, 0) == 2, "a second training forward counts 2");
    fsdp_module_train(bn, false);
    double m0 = at(rm, 0);
    fsdp_module_forward1(bn, x, &y);
    tap_ok(at(nbt, 0) == 2 && at(rm, 0) == m0, "eval forward leaves the statistics alone");
    tap_is_near(at(y, 0), (1 - m0) / sqrt(at(rv, 0) + 1e-5), 1e-5, 0,
                "eval output uses the running statistics");
    fsdp_tensor_release(y);
    fsdp_tensor_t *x3 = tensor(c, 3, (int64_t[]){2, 2, 2}, xv);
    tap_is_int(fsdp_module_forward1(bn, x3, &y), 0, "BatchNorm1d accepts (N, C, L)");
    fsdp_tensor_release(y);
    fsdp_tensor_t *x1 = tensor(c, 1, (int64_t[]){2}, xv);
    tap_is_int(fsdp_module_forward1(bn, x1, &y), FSDP_EINVAL, "and refuses a 1-d input");
    tap_has_str(fsdp_ctx_last_error(c), "f32[2]", "naming the shape");
    fsdp_tensor_t *xc = tensor(c, 2, (int64_t[]){2, 4}, xv);
    tap_is_int(fsdp_module_forward1(bn, xc, &y), FSDP_EINVAL, "wrong channel count");
    tap_has_str(fsdp_ctx_last_error(c), "2 channels", "is named");
    fsdp_module_release(bn);
    fsdp_batchnorm_create(c, 2, 2, 1e-5, 0.1, &bn);
    tap_is_int(fsdp_module_forward1(bn, x3, &y), FSDP_EINVAL, "BatchNorm2d refuses a 3-d input");
    tap_has_str(fsdp_ctx_last_error(c),
                "BatchNorm2d: expected an input (N, C, H, W), got f32[2, 2, 2]",
                "with a message naming type and shape");
    fsdp_module_release(bn);
    fsdp_tensor_release(xc);
    fsdp_tensor_release(x1);
    fsdp_tensor_release(x3);
    fsdp_tensor_release(x);
    fsdp_tape_clear(c);
}

static void test_init(void) {
    fsdp_ctx_t *a = new_ctx(7), *b = new_ctx(7), *d = new_ctx(8), *r = new_ctx(7);
    fsdp_module_t *la = linear(a, 16, 8, true), *lb = linear(b, 16, 8, true);
    fsdp_module_t *ld = linear(d, 16, 8, true);
    fsdp_tensor_t *w = fsdp_module_param(la, "weight"), *bias = fsdp_module_param(la, "bias");
    tap_ok(fsdp_tensor_ndim(w) == 2 && fsdp_tensor_size(w, 0) == 8 && fsdp_tensor_size(w, 1) == 16,
           "weight is (out, in)");
    double lo = 1, hi = -1;
    for (int64_t i = 0; i < 128; i++) {
        lo = fmin(lo, at(w, i));
        hi = fmax(hi, at(w, i));
    }
    for (int64_t i = 0; i < 8; i++) {
        lo = fmin(lo, at(bias, i));
        hi = fmax(hi, at(bias, i));
    }
    tap_ok(lo >= -0.25 && hi <= 0.25 && hi - lo > 0.3, "values within +-1/sqrt(16), spread out "
                                                        "(got [%g, %g])", lo, hi);
    tap_ok(same_values(w, fsdp_module_param(lb, "weight")) &&
               same_values(bias, fsdp_module_param(lb, "bias")),
           "same seed, same parameters");
    tap_ok(!same_values(w, fsdp_module_param(ld, "weight")), "another seed, other parameters");
    /* The same draws by hand: weight first, then bias, U(-0.25, 0.25). */
    fsdp_tensor_t *rw = NULL, *rb = NULL;
    fsdp_tensor_empty(r, FSDP_DTYPE_F32, 2, (int64_t[]){8, 16}, FSDP_MEM_OTHER, &rw);
    fsdp_tensor_empty(r, FSDP_DTYPE_F32, 1, (int64_t[]){8}, FSDP_MEM_OTHER, &rb);
    fsdp_tensor_uniform_(rw, -0.25, 0.25);
    fsdp_tensor_uniform_(rb, -0.25, 0.25);
    tap_ok(same_values(w, rw) && same_values(bias, rb), "drawn weight first, then bias");
    tap_ok(fsdp_tensor_requires_grad(w) && fsdp_tensor_is_leaf(w),
           "parameters are leaves with grad");

    fsdp_module_t *e = NULL;
    fsdp_embedding_create(a, 5, 3, 2, &e);
    fsdp_tensor_t *ew = fsdp_module_param(e, "weight");
    tap_ok(at(ew, 6) == 0 && at(ew, 7) == 0 && at(ew, 8) == 0 && at(ew, 0) != 0,
           "embedding padding row zeroed");
    fsdp_module_t *ln = NULL;
    fsdp_layernorm_create(a, 3, 1e-5, true, &ln);
    tap_ok(at(fsdp_module_param(ln, "weight"), 2) == 1 && at(fsdp_module_param(ln, "bias"), 2) == 0,
           "LayerNorm weight ones, bias zeros");
    tap_is_size(fsdp_tape_size(a), 0, "initialisation records nothing");
    fsdp_tensor_release(rw);
    fsdp_tensor_release(rb);
    fsdp_module_release(e);
    fsdp_module_release(ln);
    fsdp_module_release(la);
    fsdp_module_release(lb);
    fsdp_module_release(ld);
    fsdp_ctx_destroy(a);
    fsdp_ctx_destroy(b);
    fsdp_ctx_destroy(d);
    fsdp_ctx_destroy(r);
}

static void test_freeze(fsdp_ctx_t *c) {
    fsdp_module_t *seq = NULL, *gelu = NULL, *drop = NULL;
    fsdp_sequential_create(c, &seq);
    fsdp_gelu_create(c, FSDP_GELU_TANH, &gelu);
    fsdp_dropout_create(c, 0.5, &drop);
    push(seq, linear(c, 3, 4, true));
    push(seq, gelu);
    push(seq, drop);
    push(seq, linear(c, 4, 1, true));
    fsdp_module_train(seq, false); /* dropout off */
    tap_is_int(fsdp_module_requires_grad_(fsdp_module_child(seq, "0"), false), 0, "freeze 0");
    float xv[3] = {1, 2, 3};
    fsdp_tensor_t *x = tensor(c, 2, (int64_t[]){1, 3}, xv), *y = NULL, *loss = NULL;
    fsdp_module_forward1(seq, x, &y);
    fsdp_sum(y, 0, NULL, false, &loss);
    tap_is_int(fsdp_backward(loss, NULL), 0, "backward");
    tap_ok(!fsdp_tensor_grad(fsdp_module_param(seq, "0.weight")) &&
               !fsdp_tensor_grad(fsdp_module_param(seq, "0.bias")),
           "frozen parameters get no gradient");
    tap_ok(fsdp_tensor_grad(fsdp_module_param(seq, "3.weight")) != NULL, "others do");
    tap_is_int(fsdp_module_zero_grad(seq, true), 0, "zero_grad(set_to_none)");
    tap_ok(!fsdp_tensor_grad(fsdp_module_param(seq, "3.weight")), "gradient dropped");
    fsdp_module_requires_grad_(seq, true);
    tap_ok(fsdp_tensor_requires_grad(fsdp_module_param(seq, "0.weight")), "unfrozen");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_module_release(seq);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static int nop_visit(fsdp_module_t *m, const char *fqn, void *arg) {
    (void)m;
    (void)fqn;
    ++*(int *)arg;
    return *(int *)arg == 3 ? 42 : 0;
}

static void test_errors(fsdp_ctx_t *c) {
    fsdp_module_t *seq = NULL, *list = NULL, *l = linear(c, 2, 2, true);
    fsdp_sequential_create(c, &seq);
    fsdp_modulelist_create(c, &list);
    fsdp_module_add_child(seq, "a", l);
    tap_is_int(fsdp_module_add_child(seq, "a", l), FSDP_EINVAL, "duplicate child name");
    tap_has_str(fsdp_ctx_last_error(c), "Sequential: cannot add child module 'a'",
                "message names the type and the name");
    tap_has_str(fsdp_ctx_last_error(c), "already taken by a child module", "and the clash");
    fsdp_tensor_t *t = NULL;
    fsdp_tensor_zeros(c, FSDP_DTYPE_F32, 1, (int64_t[]){2}, FSDP_MEM_PARAMS, &t);
    tap_is_int(fsdp_module_add_param(seq, "a", t), FSDP_EINVAL, "a parameter clashing a child");
    tap_has_str(fsdp_ctx_last_error(c), "parameter 'a'", "named");
    tap_is_int(fsdp_module_add_buffer(l, "weight", t, true), FSDP_EINVAL,
               "a buffer clashing a parameter");
    tap_has_str(fsdp_ctx_last_error(c), "Linear: cannot add buffer 'weight': the name is already "
                                        "taken by a parameter",
                "named");
    tap_is_int(fsdp_module_add_param(seq, "x.y", t), FSDP_EINVAL, "a dotted name");
    tap_is_int(fsdp_module_add_param(seq, NULL, t), FSDP_EINVAL, "a NULL name");
    tap_is_int(fsdp_module_add_param(seq, "", t), FSDP_EINVAL, "an empty name");
    tap_is_int(fsdp_module_add_param(seq, "p", NULL), FSDP_EINVAL, "a NULL tensor");
    tap_is_int(fsdp_module_add_param(NULL, "p", t), FSDP_EINVAL, "a NULL module");
    tap_is_int(fsdp_module_add_child(seq, "b", NULL), FSDP_EINVAL, "a NULL child");
    tap_is_int(fsdp_module_add_child(l, "loop", seq), FSDP_EINVAL, "a cycle");
    tap_has_str(fsdp_ctx_last_error(c), "contain itself", "is refused as such");
    tap_is_int(fsdp_module_add_child(seq, "self", seq), FSDP_EINVAL, "a module in itself");
    fsdp_tensor_t *ti = NULL;
    fsdp_tensor_zeros(c, FSDP_DTYPE_I64, 1, (int64_t[]){2}, FSDP_MEM_OTHER, &ti);
    tap_is_int(fsdp_module_add_param(seq, "i", ti), FSDP_EINVAL, "an integer parameter");
    tap_is_int(fsdp_module_add_buffer(seq, "i", ti, false), 0, "is fine as a buffer");
    fsdp_named_list_t nl;
    fsdp_module_named_buffers(seq, false, &nl);
    tap_is_str(joined(&nl), "i", "buffers listed (non-persistent too)");
    fsdp_named_list_free(&nl);
    fsdp_module_state_dict(seq, &nl);
    tap_is_str(joined(&nl), "a.weight a.bias", "a non-persistent buffer is not in the state dict");
    fsdp_named_list_free(&nl);
    tap_is_int(fsdp_module_set_param(l, "weight", t, false), FSDP_EINVAL,
               "set_param with another shape");
    tap_has_str(fsdp_ctx_last_error(c), "f32[2, 2]", "names the shapes");
    tap_is_int(fsdp_module_set_param(seq, "a.nope", t, false), FSDP_EINVAL, "unknown parameter");
    tap_is_int(fsdp_module_set_param(seq, "a.bias", t, false), 0, "set_param by dotted path");
    tap_ok(fsdp_module_param(l, "bias") == t, "replaced");
    fsdp_tensor_t *y = NULL;
    tap_is_int(fsdp_module_forward1(seq, NULL, &y), FSDP_EINVAL, "forward with a NULL input");
    tap_is_int(fsdp_module_forward(seq, 1, NULL, 1, &y), FSDP_EINVAL, "forward with NULL in[]");
    tap_is_int(fsdp_module_forward1(list, t, &y), FSDP_ENOTSUP, "ModuleList has no forward");
    tap_has_str(fsdp_ctx_last_error(c), "ModuleList", "says so");
    tap_is_int(fsdp_module_forward1(NULL, t, &y), FSDP_EINVAL, "forward of NULL");
    tap_is_int(fsdp_module_remove_hook(seq, 12345), FSDP_EINVAL, "unknown hook handle");
    tap_is_int(fsdp_module_add_forward_hook(seq, NULL, NULL, NULL), FSDP_EINVAL, "NULL hook");
    fsdp_tensor_t *x3 = NULL;
    fsdp_tensor_zeros(c, FSDP_DTYPE_F32, 2, (int64_t[]){1, 3}, FSDP_MEM_OTHER, &x3);
    tap_is_int(fsdp_module_forward1(l, x3, &y), FSDP_EINVAL, "Linear with the wrong width");
    tap_has_str(fsdp_ctx_last_error(c), "Linear: input f32[1, 3] does not end in in_features = 2",
                "named");
    fsdp_module_t *none = l;
    tap_is_int(fsdp_linear_create(c, -1, 2, true, &none), FSDP_EINVAL, "negative in_features");
    tap_ok(none == NULL, "leaves the output NULL");
    fsdp_module_add_child(seq, "list", list);
    int count = 0;
    tap_is_int(fsdp_module_visit(seq, nop_visit, &count), 42, "visit stops on a non-zero return");
    tap_is_int(fsdp_module_named_params(NULL, false, &nl), FSDP_EINVAL, "listing of NULL");
    fsdp_tensor_release(x3);
    fsdp_tensor_release(ti);
    fsdp_tensor_release(t);
    fsdp_module_release(l);
    fsdp_module_release(list);
    fsdp_module_release(seq);
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_t *c = new_ctx(0);
    test_names(c);
    test_tied(c);
    test_state_dict_file();
    test_load_errors(c);
    test_forward_hooks(c);
    test_backward_hooks(c);
    test_modes(c);
    test_batchnorm(c);
    test_init();
    test_freeze(c);
    test_errors(c);
    fsdp_ctx_destroy(c);
    return tap_done();
}
