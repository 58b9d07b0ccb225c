/* SPDX-License-Identifier: MIT */
/*
 * bert_util.c: what the BERT tests share (t_bert.c, t_bert_props.c): the golden file of
 * tests/golden/bert.bin and the context, the golden configuration and model with PyTorch's
 * weights, its inputs, and host comparisons. See bert_util.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bert_util.h"

golden_t *G;
fsdp_ctx_t *CTX;

int bert_util_open(char *msg, size_t len) {
    int rc = golden_load_msg(GOLDEN_DIR "/bert.bin", &G, msg, len);
    if (rc < 0) return rc;
    fsdp_ctx_options_t opts;
    fsdp_ctx_options_init(&opts);
    rc = fsdp_ctx_create(&opts, &CTX);
    if (rc < 0) {
        snprintf(msg, len, "fsdp_ctx_create failed: %s", fsdp_strerror(rc));
        golden_free(G);
        G = NULL;
    }
    return rc;
}

void bert_util_close(void) {
    golden_free(G);
    fsdp_ctx_destroy(CTX);
    G = NULL;
    CTX = NULL;
}

const golden_rec_t *rec(const char *key) {
    return golden_findf(G, "bert", key);
}

fsdp_tensor_t *gtensor(const char *key) {
    return golden_tensor(CTX, rec(key));
}

void golden_config(fsdp_bert_config_t *c) {
    fsdp_bert_config_init(c);
    c->vocab_size = (int64_t)golden_value(rec("p/vocab_size"), 0);
    c->hidden_size = (int64_t)golden_value(rec("p/hidden_size"), 0);
    c->num_hidden_layers = (int64_t)golden_value(rec("p/num_hidden_layers"), 0);
    c->num_attention_heads = (int64_t)golden_value(rec("p/num_attention_heads"), 0);
    c->intermediate_size = (int64_t)golden_value(rec("p/intermediate_size"), 0);
    c->max_position_embeddings = (int64_t)golden_value(rec("p/max_position_embeddings"), 0);
    c->type_vocab_size = (int64_t)golden_value(rec("p/type_vocab_size"), 0);
    c->layer_norm_eps = golden_value(rec("p/layer_norm_eps"), 0);
    c->hidden_dropout_prob = golden_value(rec("p/hidden_dropout_prob"), 0);
    c->attention_probs_dropout_prob = golden_value(rec("p/attention_probs_dropout_prob"), 0);
    c->pad_token_id = (int64_t)golden_value(rec("p/pad_token_id"), 0);
    c->initializer_range = golden_value(rec("p/initializer_range"), 0);
    c->add_pooling_layer = true;
}

/* The golden state dict ("bert/init/<key>" records in file order) as an owned list. */
int golden_state_dict(fsdp_named_list_t *sd) {
    const char *prefix = "bert/init/";
    size_t plen = strlen(prefix), cap = 0;
    memset(sd, 0, sizeof *sd);
    sd->owned = true;
    for (int i = 0; i < golden_count(G); i++) {
        const golden_rec_t *r = golden_at(G, i);
        if (strncmp(r->name, prefix, plen) != 0) continue;
        if (sd->n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nn = realloc(sd->names, cap * sizeof *nn);
            if (nn) sd->names = nn;
            fsdp_tensor_t **nt = realloc(sd->tensors, cap * sizeof *nt);
            if (nt) sd->tensors = nt;
            if (!nn || !nt) return FSDP_ENOMEM;
        }
        char *name = strdup(r->name + plen);
        fsdp_tensor_t *t = golden_tensor(CTX, r);
        if (!name || !t) {
            free(name);
            fsdp_tensor_release(t);
            return FSDP_ENOMEM;
        }
        sd->names[sd->n] = name;
        sd->tensors[sd->n] = t;
        sd->n++;
    }
    return FSDP_OK;
}

/* The tiny golden model with PyTorch's weights (strict load unless !strict). */
int build_loaded(const fsdp_bert_config_t *cfg, bool strict, fsdp_module_t **m) {
    fsdp_named_list_t sd = {0};
    int rc = fsdp_bert_create(CTX, cfg, m);
    if (rc == 0) rc = golden_state_dict(&sd);
    if (rc == 0) rc = fsdp_module_load_state_dict(*m, &sd, strict);
    fsdp_named_list_free(&sd);
    if (rc < 0) {
        fsdp_module_release(*m);
        *m = NULL;
    }
    return rc;
}

/* A host copy of t's elements as floats (NULL on failure); *n receives the count. */
float *host_f32(const fsdp_tensor_t *t, size_t *n) {
    *n = t ? (size_t)fsdp_tensor_numel(t) : 0;
    if (!t || fsdp_tensor_dtype(t) != FSDP_DTYPE_F32) return NULL;
    float *h = malloc(*n ? *n * sizeof *h : 1);
    if (h && fsdp_tensor_to_host(t, h, *n * sizeof *h) < 0) {
        free(h);
        h = NULL;
    }
    return h;
}

/* Whether elements [from, to) of a and b are bitwise equal (both f32 of equal numel). */
bool same_range(const fsdp_tensor_t *a, const fsdp_tensor_t *b, size_t from, size_t to) {
    size_t na, nb;
    float *ha = host_f32(a, &na), *hb = host_f32(b, &nb);
    bool same = ha && hb && na == nb && to <= na && from <= to &&
                memcmp(ha + from, hb + from, (to - from) * sizeof *ha) == 0;
    free(ha);
    free(hb);
    return same;
}

bool same_all(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a && b && fsdp_tensor_numel(a) == fsdp_tensor_numel(b) &&
           same_range(a, b, 0, (size_t)fsdp_tensor_numel(a));
}

/* The golden input_ids with element (b, s) set to v. */
fsdp_tensor_t *ids_with(int64_t b, int64_t s, int64_t v) {
    const golden_rec_t *r = rec("input/input_ids");
    int64_t *h = malloc((size_t)r->bytes);
    fsdp_tensor_t *t = NULL;
    if (!h) return NULL;
    memcpy(h, r->data, r->bytes);
    h[b * r->shape[1] + s] = v;
    if (fsdp_tensor_from_host(CTX, FSDP_DTYPE_I64, 2, r->shape, h, FSDP_MEM_OTHER, &t) < 0)
        t = NULL;
    free(h);
    return t;
}

/* The golden attention mask converted to dtype dt. */
fsdp_tensor_t *mask_as(fsdp_dtype_t dt) {
    fsdp_tensor_t *m = gtensor("input/attention_mask"), *out = NULL;
    if (m && fsdp_to_dtype(m, dt, &out) < 0) out = NULL;
    fsdp_tensor_release(m);
    return out;
}

int inputs_load(inputs_t *in) {
    in->ids = gtensor("input/input_ids");
    in->types = gtensor("input/token_type_ids");
    in->mask = gtensor("input/attention_mask");
    in->labels = gtensor("input/labels");
    in->gpooled = gtensor("input/gpooled");
    return in->ids && in->types && in->mask && in->labels && in->gpooled ? 0 : FSDP_EINVAL;
}

void inputs_free(inputs_t *in) {
    fsdp_tensor_release(in->ids);
    fsdp_tensor_release(in->types);
    fsdp_tensor_release(in->mask);
    fsdp_tensor_release(in->labels);
    fsdp_tensor_release(in->gpooled);
    memset(in, 0, sizeof *in);
}
