/* SPDX-License-Identifier: MIT */
/*
 * train_build.c: fsdp-train's model, FSDP units, optimizer and loaders for one rank.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tools/train.h"

/* Reports a failure of rank r, with the context's last error or else the world group's. A
 * peer's failure seen as FSDP_EREMOTE is a consequence: sim
 * ranks leave it to the rank that caused it (its line is in the same output), while a process
 * says once which peer it lost and where, since the peer may have died without a word (killed,
 * out of memory) or on another node. */
int train_fail(const rank_t *k, const char *what, int rc) {
    const char *why = k->ctx ? fsdp_ctx_last_error(k->ctx) : "";
    /* A collective fsdp-train issues itself records its error on the group only. */
    if (!why[0] && k->pg) why = fsdp_pg_last_error(k->pg);
    if (rc != FSDP_EREMOTE)
        fprintf(stderr, TRAIN_PROG ": rank %d: %s failed: %s (%s)\n", k->r, what, fsdp_strerror(rc),
                why);
    else if (k->j->o->backend != TRAIN_BACKEND_SIM)
        fprintf(stderr, TRAIN_PROG ": rank %d: stopped in %s: a peer failed: %s\n", k->r, what,
                why);
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

/* ---- model and optimizer ------------------------------------------------------------------ */

/* The layouts --init takes. libfsdp's names are those of Hugging Face's GPT2Model (the original
 * "gpt2" file), so a name alone does not tell the two apart: the Conv1D weights do. */
typedef enum init_layout { LAYOUT_LIBFSDP, LAYOUT_HF_PREFIXED, LAYOUT_HF_BARE } init_layout_t;

static const char *const layout_desc[] = {
    [LAYOUT_LIBFSDP] = "the libfsdp layout (Linear weights (out, in))",
    [LAYOUT_HF_PREFIXED] = "Hugging Face's GPT2LMHeadModel layout (save_pretrained: "
                           "\"transformer.\" names, Conv1D weights (in, out))",
    [LAYOUT_HF_BARE] = "Hugging Face's GPT2Model layout (the original gpt2 file: no prefix, "
                       "Conv1D weights (in, out))",
};

/* Whether the file's `name` is 2-D with shape (rows, cols). */
static bool has_shape(const fsdp_safetensors_t *st, const char *name, int64_t rows, int64_t cols) {
    fsdp_safetensors_info_t in;
    return fsdp_safetensors_find(st, name, &in) == 0 && in.ndim == 2 && in.shape[0] == rows &&
           in.shape[1] == cols;
}

/* Which layout st is in, by the first of: the "layout" an export of fsdp-train names in its
 * metadata; "transformer." names (save_pretrained); the attn.bias / attn.masked_bias buffers that
 * only Hugging Face writes; and the orientation of a non-square Conv1D weight of block 0 (c_attn
 * is (3d, d) in libfsdp and (d, 3d) in Hugging Face). A file none of these decides (one whose
 * block-0 weights are all square, or with no blocks) is read as libfsdp's, as before. */
static init_layout_t find_layout(const fsdp_safetensors_t *st, const fsdp_gpt_config_t *c) {
    const char *lay = fsdp_safetensors_metadata(st, "layout");
    bool prefixed = false, buffers = false;
    for (size_t i = 0; i < fsdp_safetensors_count(st); i++) {
        fsdp_safetensors_info_t in;
        if (fsdp_safetensors_info(st, i, &in) < 0) continue;
        prefixed = prefixed || strncmp(in.name, "transformer.", 12) == 0;
        const char *dot = strstr(in.name, ".attn.");
        buffers =
            buffers ||
            (dot && (strcmp(dot, ".attn.bias") == 0 || strcmp(dot, ".attn.masked_bias") == 0));
    }
    if (lay && strcmp(lay, TRAIN_LAYOUT_LIBFSDP) == 0) return LAYOUT_LIBFSDP;
    if (prefixed) return LAYOUT_HF_PREFIXED;
    if ((lay && strcmp(lay, TRAIN_LAYOUT_HF) == 0) || buffers) return LAYOUT_HF_BARE;
    int64_t d = c->d_model, ff = c->d_ff > 0 ? c->d_ff : 4 * d;
    if (has_shape(st, "h.0.attn.c_attn.weight", d, 3 * d) ||
        (ff != d && has_shape(st, "h.0.mlp.c_fc.weight", d, ff)))
        return LAYOUT_HF_BARE;
    return LAYOUT_LIBFSDP;
}

/* --init PATH: a safetensors file, or a directory holding model.safetensors (what
 * --export-format hf and save_pretrained write). Shapes are checked before anything is loaded;
 * a mismatch names the tensor, the file's shape and the model's. */
static int load_init(rank_t *k) {
    const char *path = k->j->o->init_path;
    char file[4096];
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        int n = snprintf(file, sizeof file, "%s/model.safetensors", path);
        if (n < 0 || (size_t)n >= sizeof file) {
            fprintf(stderr, TRAIN_PROG ": rank %d: --init: the path is too long\n", k->r);
            return FSDP_EINVAL;
        }
        path = file;
    }
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(k->ctx, path, &st);
    if (rc < 0) return train_fail(k, "opening --init", rc);
    init_layout_t lay = find_layout(st, &k->j->cfg);
    if (lay == LAYOUT_LIBFSDP)
        rc = fsdp_safetensors_load_module(st, k->model, true);
    else
        rc = fsdp_gpt2_hf_load(k->model, st, true);
    fsdp_safetensors_close(st);
    if (rc < 0) return train_fail(k, "loading --init", rc);
    train_say(k, "--init: %s is in %s\n", path, layout_desc[lay]);
    return 0;
}

/* --device cuda: this rank's GPU, the NCCL group's device (LOCAL_RANK under fsdprun). */
static int make_device(rank_t *k) {
    fsdp_device_options_t d;
    fsdp_device_options_init(&d);
    int ord = fsdp_nccl_device(k->pg);
    d.ordinal = ord >= 0 ? ord : 0;
    int rc = fsdp_device_create(k->ctx, FSDP_DEVICE_CUDA, &d, &k->dev);
    return rc < 0 ? train_fail(k, "creating the CUDA device", rc) : 0;
}

void train_mixed_precision(train_precision_t p, fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    if (p == TRAIN_PRECISION_F32) return; /* off: no casts, the f32 run bit for bit */
    fsdp_dtype_t half = p == TRAIN_PRECISION_F16 ? FSDP_DTYPE_F16 : FSDP_DTYPE_BF16;
    mp->enabled = true;
    mp->param_dtype = half;
    mp->buffer_dtype = half;
    mp->reduce_dtype = p == TRAIN_PRECISION_BF16_REDUCE_F32 ? FSDP_DTYPE_F32 : half;
}

/* The model, its units and AdamW follow the library's GPT recipe (fsdp/gpt_recipe.h): the
 * model from stream 0 of the seed, one unit per GPTBlock under the root with use_orig_params,
 * and AdamW whose weight decay falls on matrices only. */
int train_build(rank_t *k) {
    const train_opts_t *o = k->j->o;
    int rc;
    if (o->device == TRAIN_DEVICE_CUDA && (rc = make_device(k)) < 0) return rc;
    /* The model is made (and --init loaded) on the host, where the seeded initialisation is the
     * same as in a CPU run; the wrap moves each unit to the GPU (options.device), or with
     * --cpu-offload keeps its shard on the host and computes on the GPU. */
    if ((rc = fsdp_gpt_recipe_create_model(k->ctx, &k->j->cfg, o->seed, &k->model)) < 0)
        return train_fail(k, "fsdp_gpt_create", rc);
    k->nparams = fsdp_module_num_params(k->model);
    if (o->init_path && (rc = load_init(k)) < 0) return rc;

    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = o->sharding;
    fo.cpu_offload = o->cpu_offload;
    fo.backward_prefetch = o->backward_prefetch;
    fo.forward_prefetch = o->forward_prefetch;
    fo.limit_all_gathers = o->limit_all_gathers;
    fo.device = k->dev;
    train_mixed_precision(o->precision, &fo.mixed_precision);
    if (o->sharding == FSDP_HYBRID_SHARD) {
        /* Shard within groups of consecutive ranks, replicate across the groups. */
        int g = (int)train_shard_group_size(o, k->world);
        if ((rc = fsdp_pg_split(k->pg, k->r / g, k->r, &k->shard_pg)) < 0 ||
            (rc = fsdp_pg_split(k->pg, k->r % g, k->r, &k->rep_pg)) < 0)
            return train_fail(k, "fsdp_pg_split", rc);
        fo.pg = k->shard_pg;
        fo.replicate_pg = k->rep_pg;
    }
    if ((rc = fsdp_gpt_recipe_wrap(k->model, &fo, &k->root)) < 0)
        return train_fail(k, "fsdp_wrap", rc);
    /* After the wrap, so that each block's FSDP hooks run inside its recomputed call. */
    if (o->activation_checkpointing &&
        (rc = fsdp_apply_activation_checkpointing(k->model, "GPTBlock", NULL, NULL, NULL)) < 0)
        return train_fail(k, "fsdp_apply_activation_checkpointing", rc);

    /* AdamW: group 0 decays, group 1 does not. */
    fsdp_adam_options_t a;
    fsdp_gpt_recipe_adamw_options_init(&a);
    a.lr = o->lr;
    a.beta1 = o->beta1;
    a.beta2 = o->beta2;
    a.eps = o->eps;
    a.weight_decay = o->weight_decay;
    if ((rc = fsdp_gpt_recipe_create_adamw(k->model, &a, &k->opt)) < 0)
        return train_fail(k, "creating AdamW", rc);
    k->ngroups = 2;
    /* f16: PyTorch's ShardedGradScaler with its defaults (2^16, doubling after 2000 clean
     * steps, halving on an overflow), the found-inf flag agreed over the whole world. */
    if (o->precision == TRAIN_PRECISION_F16) {
        fsdp_grad_scaler_options_t so;
        fsdp_grad_scaler_options_init(&so);
        so.pg = k->pg;
        if ((rc = fsdp_grad_scaler_create(k->ctx, &so, &k->scaler)) < 0)
            return train_fail(k, "creating the gradient scaler", rc);
    }
    /* From here on autograd, the loss and the batches are made on the compute device. */
    if (k->dev && (rc = fsdp_ctx_set_device(k->ctx, k->dev)) < 0)
        return train_fail(k, "fsdp_ctx_set_device", rc);
    return FSDP_OK;
}

int train_make_loaders(rank_t *k) {
    const train_opts_t *o = k->j->o;
    fsdp_loader_options_t lo;
    fsdp_loader_options_init(&lo);
    lo.batch_size = o->batch_size;
    lo.seq_len = o->seq_len;
    lo.rank = k->r;
    lo.world_size = k->world;
    lo.shuffle = o->shuffle;
    lo.seed = o->seed;
    int rc = fsdp_loader_create(k->ctx, k->j->train, &lo, &k->train_ld);
    if (rc < 0) return train_fail(k, "the training loader", rc);
    lo.shuffle = false;
    if ((rc = fsdp_loader_create(k->ctx, k->j->val, &lo, &k->val_ld)) < 0)
        return train_fail(k, "the validation loader", rc);
    const int64_t shape[2] = {fsdp_loader_rows(k->train_ld), o->seq_len};
    if ((rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->in)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->tg)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->vin)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->vtg)) < 0)
        return train_fail(k, "allocating the batch", rc);
    return 0;
}

void train_teardown(rank_t *k) {
    fsdp_tensor_release(k->in);
    fsdp_tensor_release(k->tg);
    fsdp_tensor_release(k->vin);
    fsdp_tensor_release(k->vtg);
    fsdp_loader_destroy(k->train_ld);
    fsdp_loader_destroy(k->val_ld);
    fsdp_grad_scaler_destroy(k->scaler);
    fsdp_optim_destroy(k->opt);
    fsdp_unit_destroy(k->root);
    fsdp_module_release(k->model);
    fsdp_pg_destroy(k->shard_pg);
    fsdp_pg_destroy(k->rep_pg);
    if (k->dev) {
        fsdp_ctx_set_device(k->ctx, NULL);
        fsdp_device_destroy(k->dev);
    }
    free(k->mem_all);
}
