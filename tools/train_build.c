/*
 * train_build.c: fsdp-train's model, FSDP units, optimizer and loaders for one rank.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train.h"

/* Reports a failure of rank r; a peer's failure seen as FSDP_EREMOTE is a consequence and is
 * left to the rank that caused it. */
int train_fail(const rank_t *k, const char *what, int rc) {
    if (rc != FSDP_EREMOTE)
        fprintf(stderr, TRAIN_PROG ": rank %d: %s failed: %s (%s)\n", k->r, what, fsdp_strerror(rc),
                k->ctx ? fsdp_ctx_last_error(k->ctx) : "");
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

/* ---- model and optimizer ------------------------------------------------------------------ */

/* The weight-decay rule: AdamW decays matrices (every parameter with two or more dimensions)
 * except the position table wpe.weight; vectors (biases, LayerNorm weights and biases) are not
 * decayed. wte.weight, the token embedding and tied head, is a matrix and is decayed. */
static bool decays(const char *name, int ndim) {
    return ndim >= 2 && strcmp(name, "wpe.weight") != 0;
}

static int load_init(rank_t *k) {
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(k->ctx, k->j->o->init_path, &st);
    if (rc < 0) return train_fail(k, "opening --init", rc);
    fsdp_safetensors_info_t info;
    if (fsdp_safetensors_find(st, "wte.weight", &info) == 0)
        rc = fsdp_safetensors_load_module(st, k->model, true);
    else
        rc = fsdp_gpt2_hf_load(k->model, st, true);
    fsdp_safetensors_close(st);
    return rc < 0 ? train_fail(k, "loading --init", rc) : 0;
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

int train_build(rank_t *k) {
    const train_opts_t *o = k->j->o;
    int rc;
    if (o->device == TRAIN_DEVICE_CUDA && (rc = make_device(k)) < 0) return rc;
    /* The model is made (and --init loaded) on the host, where the seeded initialisation is the
     * same as in a CPU run; the wrap moves each unit to the GPU (options.device), or with
     * --cpu-offload keeps its shard on the host and computes on the GPU. */
    fsdp_rng_init(fsdp_ctx_rng(k->ctx), o->seed, 0);
    if ((rc = fsdp_gpt_create(k->ctx, &k->j->cfg, &k->model)) < 0)
        return train_fail(k, "fsdp_gpt_create", rc);
    fsdp_module_train(k->model, true);
    k->nparams = fsdp_module_num_params(k->model);
    if (o->init_path && (rc = load_init(k)) < 0) return rc;

    /* Which names decay, decided on the unwrapped shapes. */
    fsdp_named_list_t orig = {0};
    if ((rc = fsdp_module_named_params(k->model, false, &orig)) < 0)
        return train_fail(k, "fsdp_module_named_params", rc);
    bool *decay = calloc(orig.n ? orig.n : 1, sizeof *decay);
    if (!decay) {
        fsdp_named_list_free(&orig);
        return train_fail(k, "allocating", FSDP_ENOMEM);
    }
    for (size_t i = 0; i < orig.n; i++)
        decay[i] = decays(orig.names[i], fsdp_tensor_ndim(orig.tensors[i]));

    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = o->sharding;
    fo.cpu_offload = o->cpu_offload;
    fo.backward_prefetch = o->backward_prefetch;
    fo.forward_prefetch = o->forward_prefetch;
    fo.limit_all_gathers = o->limit_all_gathers;
    fo.use_orig_params = true;
    fo.device = k->dev;
    if (o->sharding == FSDP_HYBRID_SHARD) {
        /* Shard within groups of consecutive ranks, replicate across the groups. */
        int g = (int)train_shard_group_size(o, k->world);
        if ((rc = fsdp_pg_split(k->pg, k->r / g, k->r, &k->shard_pg)) < 0 ||
            (rc = fsdp_pg_split(k->pg, k->r % g, k->r, &k->rep_pg)) < 0) {
            free(decay);
            fsdp_named_list_free(&orig);
            return train_fail(k, "fsdp_pg_split", rc);
        }
        fo.pg = k->shard_pg;
        fo.replicate_pg = k->rep_pg;
    }
    static const char *const block_types[] = {"GPTBlock", NULL};
    fsdp_policy_t *blocks = NULL;
    if ((rc = fsdp_policy_module_types_create(block_types, &blocks)) == 0) {
        fo.auto_wrap_policy = blocks;
        rc = fsdp_wrap(k->model, &fo, &k->root);
        fsdp_policy_release(blocks);
    }
    if (rc < 0) {
        free(decay);
        fsdp_named_list_free(&orig);
        return train_fail(k, "fsdp_wrap", rc);
    }

    /* AdamW: group 0 decays, group 1 does not. With use_orig_params the optimizer's tensors
     * are the original parameter objects (now views of this rank's shard), in the same
     * order and under the same names as before wrapping. */
    fsdp_named_list_t params = {0};
    fsdp_tensor_t **g[2] = {NULL, NULL};
    const char **gn[2] = {NULL, NULL};
    size_t gcount[2] = {0, 0};
    if ((rc = fsdp_named_params(k->root, &params)) < 0) {
        train_fail(k, "fsdp_named_params", rc);
        goto out;
    }
    for (int i = 0; i < 2; i++) {
        g[i] = calloc(params.n + 1, sizeof *g[i]);
        gn[i] = calloc(params.n + 1, sizeof *gn[i]);
        if (!g[i] || !gn[i]) {
            rc = train_fail(k, "allocating", FSDP_ENOMEM);
            goto out;
        }
    }
    for (size_t i = 0; i < params.n; i++) {
        bool d = false;
        for (size_t q = 0; q < orig.n; q++)
            if (strcmp(orig.names[q], params.names[i]) == 0) d = decay[q];
        int gi = d ? 0 : 1;
        g[gi][gcount[gi]] = params.tensors[i];
        gn[gi][gcount[gi]++] = params.names[i];
    }
    fsdp_adam_options_t a;
    fsdp_adamw_options_init(&a);
    a.lr = o->lr;
    a.beta1 = o->beta1;
    a.beta2 = o->beta2;
    a.eps = o->eps;
    a.weight_decay = o->weight_decay;
    if ((rc = fsdp_optim_adam_create(k->ctx, &a, true, &k->opt)) < 0) {
        train_fail(k, "creating AdamW", rc);
        goto out;
    }
    fsdp_adam_options_t nd = a;
    nd.weight_decay = 0;
    if ((rc = fsdp_optim_add_group(k->opt, gcount[0], g[0], gn[0], NULL, NULL)) < 0 ||
        (rc = fsdp_optim_add_group(k->opt, gcount[1], g[1], gn[1], &nd, NULL)) < 0) {
        train_fail(k, "fsdp_optim_add_group", rc);
        goto out;
    }
    k->ngroups = 2;
    /* From here on autograd, the loss and the batches are made on the compute device. */
    if (k->dev && (rc = fsdp_ctx_set_device(k->ctx, k->dev)) < 0)
        train_fail(k, "fsdp_ctx_set_device", rc);
out:
    for (int i = 0; i < 2; i++) {
        free(g[i]);
        free(gn[i]);
    }
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&orig);
    free(decay);
    return rc;
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
    fsdp_optim_destroy(k->opt);
    fsdp_destroy(k->root);
    fsdp_module_release(k->model);
    fsdp_pg_destroy(k->shard_pg);
    fsdp_pg_destroy(k->rep_pg);
    if (k->dev) {
        fsdp_ctx_set_device(k->ctx, NULL);
        fsdp_device_destroy(k->dev);
    }
    free(k->mem_all);
}
