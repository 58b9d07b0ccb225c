/* SPDX-License-Identifier: MIT */
/*
 * gpt2_hf.c: libfsdp's GPT in Hugging Face's GPT-2 safetensors layout.
 *
 * The two layouts differ in three ways, all handled here by name:
 *   - names: Hugging Face's GPT2LMHeadModel prefixes every parameter with "transformer."
 *     (GPT2Model files, such as the original "gpt2" checkpoint, have no prefix; both load);
 *   - Conv1D: attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj weights are stored (in, out),
 *     the transpose of libfsdp's Linear (out, in). Saving writes a transposed view (the writer
 *     reads tensors through their strides, so nothing is copied twice); loading copies into a
 *     transposed view of the destination;
 *   - extras: h.<i>.attn.bias and h.<i>.attn.masked_bias (causal-mask buffers) and
 *     lm_head.weight (a copy of the tied wte.weight) are skipped when loading and never written.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io_impl.h"

static const char prefix[] = "transformer.";
#define PREFIX_LEN (sizeof prefix - 1)

/* After "h.<digits>.", or NULL when fqn does not start with a block. */
static const char *block_rest(const char *fqn) {
    if (strncmp(fqn, "h.", 2) != 0 || !isdigit((unsigned char)fqn[2])) return NULL;
    const char *p = fqn + 2;
    while (isdigit((unsigned char)*p))
        p++;
    return *p == '.' ? p + 1 : NULL;
}

bool fsdp_gpt2_hf_is_conv1d(const char *fqn) {
    const char *r = fqn ? block_rest(fqn) : NULL;
    return r && (strcmp(r, "attn.c_attn.weight") == 0 || strcmp(r, "attn.c_proj.weight") == 0 ||
                 strcmp(r, "mlp.c_fc.weight") == 0 || strcmp(r, "mlp.c_proj.weight") == 0);
}

int fsdp_gpt2_hf_name(const char *fqn, char *buf, size_t cap) {
    if (!fqn || !buf) return FSDP_EINVAL;
    int k = snprintf(buf, cap, "%s%s", prefix, fqn);
    if (k < 0 || (size_t)k >= cap) {
        if (cap) buf[0] = 0;
        return FSDP_EINVAL;
    }
    return FSDP_OK;
}

int fsdp_gpt2_name_from_hf(const char *hf, char *buf, size_t cap) {
    if (!hf || !buf || !cap) return FSDP_EINVAL;
    buf[0] = 0;
    if (strcmp(hf, "lm_head.weight") == 0) return 1;
    const char *name = strncmp(hf, prefix, PREFIX_LEN) == 0 ? hf + PREFIX_LEN : hf;
    const char *r = block_rest(name);
    if (r && (strcmp(r, "attn.bias") == 0 || strcmp(r, "attn.masked_bias") == 0)) return 1;
    size_t len = strlen(name);
    if (len >= cap) return FSDP_EINVAL;
    memcpy(buf, name, len + 1);
    return FSDP_OK;
}

static int map_hf(const char *file_name, void *arg, char *out, size_t cap, bool *transpose) {
    (void)arg;
    int r = fsdp_gpt2_name_from_hf(file_name, out, cap);
    *transpose = r == 0 && fsdp_gpt2_hf_is_conv1d(out);
    return r;
}

/* FSDP_EINVAL on m's context unless m is a GPT. */
static int check_gpt(const fsdp_module_t *m, const char *fn) {
    if (!m) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: the module is NULL", fn);
        return FSDP_EINVAL;
    }
    if (fsdp_gpt_get_config(m)) return FSDP_OK;
    return fsdp__ctx_err(fsdp_module_ctx(m), FSDP_EINVAL,
                         "%s: the module is a %s, not a GPT made by fsdp_gpt_create", fn,
                         fsdp_module_type(m));
}

int fsdp_gpt2_hf_save(const fsdp_module_t *m, const char *path, const fsdp_safetensors_kv_t *meta,
                      size_t nmeta) {
    static const char fn[] = "fsdp_gpt2_hf_save";
    int rc = check_gpt(m, fn);
    if (rc < 0) return rc;
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_named_list_t sd;
    rc = fsdp__st_state_dict_unique(m, &sd);
    if (rc < 0) return rc;
    char **names = calloc(sd.n ? sd.n : 1, sizeof *names);
    fsdp_tensor_t **ts = calloc(sd.n ? sd.n : 1, sizeof *ts);
    fsdp_safetensors_kv_t *kv = calloc(nmeta + 1, sizeof *kv);
    if (!names || !ts || !kv) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    for (size_t i = 0; i < sd.n; i++) {
        size_t cap = strlen(sd.names[i]) + PREFIX_LEN + 1;
        names[i] = malloc(cap);
        if (!names[i] || fsdp_gpt2_hf_name(sd.names[i], names[i], cap) < 0) {
            rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
        if (fsdp_gpt2_hf_is_conv1d(sd.names[i])) {
            rc = fsdp_transpose(sd.tensors[i], 0, 1, &ts[i]);
            if (rc < 0) {
                rc = fsdp__ctx_err(ctx, rc, "%s: parameter '%s': %s", fn, sd.names[i],
                                   fsdp_ctx_last_error(ctx));
                goto out;
            }
        } else {
            ts[i] = fsdp_tensor_retain(sd.tensors[i]);
        }
    }
    bool has_format = false;
    for (size_t i = 0; i < nmeta && meta; i++) {
        kv[i] = meta[i];
        has_format = has_format || (meta[i].key && strcmp(meta[i].key, "format") == 0);
    }
    size_t nkv = meta ? nmeta : 0;
    if (!has_format) kv[nkv++] = (fsdp_safetensors_kv_t){"format", "pt"};
    rc = fsdp__st_write(ctx, path, sd.n, names, ts, kv, nkv, fn);
out:
    for (size_t i = 0; i < sd.n; i++) {
        if (names) free(names[i]);
        if (ts) fsdp_tensor_release(ts[i]);
    }
    free(names);
    free(ts);
    free(kv);
    fsdp_named_list_free(&sd);
    return rc;
}

int fsdp_gpt2_hf_load(fsdp_module_t *m, fsdp_safetensors_t *st, bool strict) {
    static const char fn[] = "fsdp_gpt2_hf_load";
    if (!st) return FSDP_EINVAL;
    int rc = check_gpt(m, fn);
    if (rc < 0)
        return fsdp__st_err(st, rc, "%s",
                            m ? fsdp_ctx_last_error(fsdp_module_ctx(m))
                              : "fsdp_gpt2_hf_load: the module is NULL");
    fsdp_named_list_t sd;
    rc = fsdp_module_state_dict(m, &sd);
    if (rc < 0) return fsdp__st_err(st, rc, "%s: %s", fn, fsdp_ctx_last_error(fsdp_module_ctx(m)));
    rc = fsdp__st_load_mapped(st, &sd, strict, map_hf, NULL, fn);
    fsdp_named_list_free(&sd);
    return rc;
}
