/* SPDX-License-Identifier: MIT */
/*
 * sim_run.c: fsdp-sim's model presets and one simulated configuration.
 *
 * For each world size asked for, one representative rank runs real training steps of a GPT
 * preset (fsdp/gpt_recipe.h's model, wrap and AdamW; the options of fsdp-train) on a simulator
 * (fsdp/vsim.h): the library's own FSDP runtime on a shape-only device, with kernels and
 * collectives charged by the cluster's cost models. The first step warms up (lazy
 * initialisation, optimizer state); the next is measured: step time, model and hardware TFLOPS
 * per GPU, MFU, communication time and how much of it the compute stream waited for, and the
 * rank's peak memory by category, exact from the accounting. fsdp-sim.c prints them.
 *
 * Model FLOPs are those of one training step without recomputation: 6 per parameter of the
 * blocks and the head per token, plus the attention products (12 n_layer d_model seq per token,
 * halved for the causal mask as the kernels charge it); hardware FLOPs are every FLOP the
 * simulated kernels ran, recomputation included. MFU is model FLOPs over the step time and the
 * GPU's peak matrix rate of the compute dtype.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

#include "tools/sim.h"

/* ---- model presets -------------------------------------------------------------------------- */

static const sim_model_t models[] = {
    /* name,        layers, d_model, heads, d_ff, vocab, seq, summary */
    {"tiny", 4, 128, 4, 0, 256, 64, "fsdp-train's default model (byte vocabulary)"},
    {"gpt2", 12, 768, 12, 0, 50257, 1024, "GPT-2 small, 124M"},
    {"gpt2-medium", 24, 1024, 16, 0, 50257, 1024, "GPT-2 medium, 355M"},
    {"gpt2-large", 36, 1280, 20, 0, 50257, 1024, "GPT-2 large, 774M"},
    {"gpt2-xl", 48, 1600, 25, 0, 50257, 1024, "GPT-2 XL, 1.6B"},
    {"gpt3-1.3b", 24, 2048, 16, 0, 50257, 2048, "GPT-3 XL, 1.3B"},
    {"gpt3-2.7b", 32, 2560, 32, 0, 50257, 2048, "GPT-3 2.7B"},
    {"gpt3-6.7b", 32, 4096, 32, 0, 50257, 2048, "GPT-3 6.7B"},
    {"gpt3-13b", 40, 5120, 40, 0, 50257, 2048, "GPT-3 13B"},
    {"gpt3-175b", 96, 12288, 96, 0, 50257, 2048, "GPT-3 175B"},
    /* T5-11B's width and depth (24 encoder and 24 decoder blocks of d_model 1024, 128 heads of
     * 128) as 48 GPT blocks: heads of 128 over d_model 1024 give 8 heads, so the attention
     * projections are 16 times smaller than T5's, and d_ff grows from 65536 to 106496 to keep
     * the parameters (11B) and the FLOPs per token. docs/simulation.md says what this keeps. */
    {"t5-11b-proxy", 48, 1024, 8, 106496, 32128, 512, "T5-11B's size and depth, as GPT blocks"},
};

size_t sim_model_count(void) {
    return sizeof models / sizeof models[0];
}

const sim_model_t *sim_model_at(size_t i) {
    return i < sim_model_count() ? &models[i] : NULL;
}

const sim_model_t *sim_model_find(const char *name) {
    for (size_t i = 0; i < sim_model_count(); i++)
        if (strcmp(models[i].name, name) == 0) return &models[i];
    return NULL;
}

/* Parameters of the preset: the GPT's, counted from its shapes (fsdp/transformer.h). */
/* Parameters of one GPT block: two layer norms, the attention's projections, the MLP. */
static double block_params(const sim_model_t *m) {
    double d = (double)m->d_model, f = m->d_ff ? (double)m->d_ff : 4.0 * d;
    return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (f * d + f) + (d * f + d);
}

double sim_model_params(const sim_model_t *m) {
    double d = (double)m->d_model;
    return (double)m->vocab * d + (double)m->seq * d + (double)m->n_layer * block_params(m) + 2 * d;
}

/* Model FLOPs of one training step of `tokens` tokens (see the top of the file). */
double sim_model_flops(const sim_model_t *m, double tokens) {
    double d = (double)m->d_model;
    double dense = sim_model_params(m) - (double)m->seq * d;     /* positions are looked up */
    double attn = 6.0 * (double)m->n_layer * d * (double)m->seq; /* QK^T and PV, causal half */
    return tokens * (6.0 * dense + attn);
}

/* ---- one simulated configuration ------------------------------------------------------------ */

static int fail(sim_result_t *r, fsdp_ctx_t *ctx, const char *what, int rc) {
    snprintf(r->error, sizeof r->error, "%s: %s (%s)", what,
             ctx ? fsdp_ctx_last_error(ctx) : "out of memory", fsdp_err_name(rc));
    return rc;
}

static void fill_mp(const sim_config_t *c, fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    if (c->dtype == FSDP_DTYPE_F32) return;
    mp->enabled = true;
    mp->param_dtype = c->dtype;
    mp->reduce_dtype = c->dtype;
    mp->buffer_dtype = c->dtype;
}

/*
 * How much slower a rank computes when every rank of a world of sim threads computes at once
 * than when it runs alone: ranks that together have more threads than the machine has cores
 * share them (and their caches), and ranks that do not still share the memory system. After a
 * barrier every rank runs MIX_ROUNDS rounds of products and element-wise maps of fsdp-train's
 * sizes, with a barrier after about every SYNC_S of rounds, as the collectives of a step
 * synchronise its ranks between units; the slowdown is the time from the first rank's start to
 * the last rank's end over the time of the same rounds on the calling thread alone, with a
 * device of the same thread count. (Rank by rank times would miss the sharing: the scheduler may
 * run one rank's rounds through before the next starts.) The barriers charge what sharing
 * costs at each synchronisation: when more ranks than cores take turns, the last to arrive
 * runs while the others wait, and a core may stand idle; fsdp-train at world 4 on 2 cores
 * keeps them 87% busy.
 */
#define MIX_ROUNDS 150
#define SYNC_S 1e-3

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int mix_rounds(fsdp_ctx_t *ctx, int rounds, double *seconds) {
    fsdp_tensor_t *a = NULL, *b = NULL;
    int rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){256, 128}, 0.01,
                              FSDP_MEM_OTHER, &a);
    if (rc == FSDP_OK)
        rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){128, 512}, 0.01,
                              FSDP_MEM_OTHER, &b);
    double t0 = now_s();
    for (int i = 0; i < rounds && rc == FSDP_OK; i++) {
        fsdp_tensor_t *h = NULL, *g = NULL, *y = NULL;
        rc = fsdp_matmul(a, b, &h);
        if (rc == FSDP_OK) rc = fsdp_gelu(h, FSDP_GELU_TANH, &g);
        if (rc == FSDP_OK) rc = fsdp_add(g, h, &y);
        fsdp_tensor_release(g);
        g = NULL;
        if (rc == FSDP_OK) rc = fsdp_softmax(y, 1, &g);
        fsdp_tensor_release(h);
        fsdp_tensor_release(g);
        fsdp_tensor_release(y);
    }
    *seconds = now_s() - t0;
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    return rc;
}

struct mix_arg {
    double *span;   /* each rank's start and end times at span[2 rank] and span[2 rank + 1] */
    int sync_every; /* rounds between barriers */
};

static int mix_rank(fsdp_ctx_t *ctx, void *arg) {
    const struct mix_arg *a = arg;
    double warm, took;
    int r = fsdp_ctx_rank(ctx);
    int rc = mix_rounds(ctx, 4, &warm);
    if (rc == FSDP_OK) rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL);
    a->span[2 * r] = now_s();
    for (int done = 0; done < MIX_ROUNDS && rc == FSDP_OK; done += a->sync_every) {
        int n = MIX_ROUNDS - done < a->sync_every ? MIX_ROUNDS - done : a->sync_every;
        rc = mix_rounds(ctx, n, &took);
        if (rc == FSDP_OK) rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL);
    }
    a->span[2 * r + 1] = now_s();
    return rc;
}

static int shared_slowdown(fsdp_ctx_t *ctx, int world, double *slowdown) {
    *slowdown = 1.0;
    if (world < 2) return FSDP_OK;
    double alone = 0, warm, *span = calloc(2 * (size_t)world, sizeof *span);
    if (!span) return FSDP_ENOMEM;
    int rc = mix_rounds(ctx, 4, &warm);
    if (rc == FSDP_OK) rc = mix_rounds(ctx, MIX_ROUNDS, &alone);
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = world;
    /* A barrier after about every SYNC_S of a rank's rounds alone, as a step's collectives
     * synchronise its ranks between units. */
    int every = alone > 0 ? (int)(SYNC_S / (alone / MIX_ROUNDS) + 0.5) : MIX_ROUNDS;
    struct mix_arg ma = {span, every < 1 ? 1 : every > MIX_ROUNDS ? MIX_ROUNDS : every};
    if (rc == FSDP_OK) rc = fsdp_sim_run(&so, mix_rank, &ma, NULL);
    double first = span[0], last = span[1];
    for (int r = 1; r < world; r++) {
        if (span[2 * r] < first) first = span[2 * r];
        if (span[2 * r + 1] > last) last = span[2 * r + 1];
    }
    free(span);
    if (rc == FSDP_OK && alone > 0 && last - first > alone) *slowdown = (last - first) / alone;
    return rc;
}

/* The calibration's options for c: its world's collectives, at a block's all-gather. */
static void calibrate_opts(const sim_config_t *c, fsdp_calibrate_options_t *co) {
    fsdp_calibrate_options_init(co);
    co->ranks = c->gpus >= 2 ? c->gpus : 0;
    co->backend = c->backend;
    co->pg = c->pg;
    /* The network is timed at the size of a block's all-gather, FSDP's usual message. */
    co->coll_bytes = (size_t)block_params(c->model) * fsdp_dtype_size(c->dtype);
}

int sim_calibrate_peer(fsdp_ctx_t *ctx, const sim_config_t *c, char *err, size_t cap) {
    fsdp_calibrate_options_t co;
    fsdp_cluster_t cl;
    calibrate_opts(c, &co);
    int rc = fsdp_cluster_calibrate_cpu(ctx, &co, &cl);
    if (rc < 0) snprintf(err, cap, "%s", fsdp_ctx_last_error(ctx));
    return rc;
}

/*
 * "This CPU" as a cluster of one node of `world` ranks (sim threads, as fsdp-train runs them, or
 * c->pg's processes): fsdp_cluster_calibrate_cpu measured with the CPU device a rank of that
 * world gets (cores / world threads), and each rank's compute rates and memory bandwidth divided
 * by the slowdown of ranks computing at once (shared_slowdown), which *slowdown_out receives.
 */
static int cpu_cluster(fsdp_ctx_t *ctx, const sim_config_t *c, fsdp_cluster_t *cl,
                       double *slowdown_out) {
    int world = c->gpus;
    fsdp_calibrate_options_t co;
    calibrate_opts(c, &co);
    int rc = fsdp_cluster_calibrate_cpu(ctx, &co, cl);
    if (rc < 0) return rc;
    double slowdown;
    if ((rc = shared_slowdown(ctx, world, &slowdown)) < 0) return rc;
    *slowdown_out = slowdown;
    /* Ranks that fill every core leave none for their collectives' copies and reductions: a
     * kernel waits for a collective it overlaps, as a compute stream's work would wait for the
     * CPU time the transport takes (docs/simulation.md). */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = fsdp_device_num_threads(fsdp_ctx_device(ctx));
    if (world >= 2 && (long)world * threads >= cores) {
        cl->compute.sms = 1;
        cl->net.intra_channels = cl->net.inter_channels = 1;
    }
    double share = 1.0 / slowdown;
    if (share < 1.0) {
        for (int d = 0; d < FSDP_DTYPE_COUNT; d++)
            cl->compute.matmul_flops[d] *= share;
        cl->compute.vector_flops *= share;
        cl->compute.mem_bw *= share;
    }
    return FSDP_OK;
}

int sim_run(const sim_config_t *c, sim_result_t *r) {
    memset(r, 0, sizeof *r);
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = c->rank;
    co.world_size = c->gpus;
    co.log_level = FSDP_LOG_ERROR;
    fsdp_ctx_t *ctx = NULL, *mctx = NULL;
    fsdp_vsim_t *vs = NULL;
    fsdp_module_t *model = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *in = NULL, *tg = NULL;
    fsdp_trace_t *trace = NULL;
    fsdp_cluster_t cl;
    int rc;
    double t0 = now_s();
    if ((rc = fsdp_ctx_create(&co, &ctx)) < 0) return fail(r, NULL, "fsdp_ctx_create", rc);
    int nodes = (c->gpus + c->gpus_per_node - 1) / c->gpus_per_node;
    double slowdown = 1.0;
    if (strcmp(c->cluster, "cpu") == 0) {
        if ((rc = cpu_cluster(ctx, c, &cl, &slowdown)) < 0) {
            fail(r, ctx, "calibrating --cluster cpu", rc);
            goto out;
        }
    } else if ((rc = fsdp_cluster_preset(ctx, c->cluster, nodes, &cl)) < 0) {
        fail(r, ctx, "--cluster", rc);
        goto out;
    } else {
        cl.net.gpus_per_node = c->gpus_per_node;
    }
    cl.compute.lowp_kernels = c->lowp_kernels;
    if (c->no_contention) cl.compute.sms = 0;
    if ((rc = fsdp_vsim_create(ctx, &cl, &vs)) < 0) {
        fail(r, ctx, "fsdp_vsim_create", rc);
        goto out;
    }
    if (c->kernel_times == SIM_KERNELS_MEASURED) {
        /* A rank's CPU device (cores / world threads, as ctx's), in a context of its own so that
         * the measurements leave nothing in ctx. */
        if ((rc = fsdp_ctx_create(&co, &mctx)) < 0 ||
            (rc = fsdp_vsim_measure_kernels(vs, fsdp_ctx_device(mctx), slowdown)) < 0) {
            fail(r, ctx, "measuring kernels", rc);
            goto out;
        }
    }
    fsdp_device_t *dev = fsdp_vsim_device(vs);
    fsdp_ctx_set_device(ctx, dev);

    const sim_model_t *m = c->model;
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = m->vocab;
    cfg.max_seq = m->seq;
    cfg.n_layer = m->n_layer;
    cfg.n_head = m->n_head;
    cfg.d_model = m->d_model;
    cfg.d_ff = m->d_ff;
    if ((rc = fsdp_gpt_recipe_create_model(ctx, &cfg, 1, &model)) < 0) {
        fail(r, ctx, "creating the model", rc);
        goto out;
    }
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = c->strategy;
    fo.backward_prefetch = c->prefetch;
    fo.forward_prefetch = c->forward_prefetch;
    fo.limit_all_gathers = c->limit;
    fill_mp(c, &fo.mixed_precision);
    if (c->strategy == FSDP_HYBRID_SHARD || c->strategy == FSDP_HYBRID_SHARD_ZERO2) {
        int g = c->shard_group > 0 ? c->shard_group : c->gpus_per_node;
        if (g > c->gpus) g = c->gpus;
        if ((rc = fsdp_vsim_group(vs, g, 1, &fo.pg)) < 0 ||
            (rc = fsdp_vsim_group(vs, c->gpus / g, g, &fo.replicate_pg)) < 0) {
            fail(r, ctx, "the hybrid groups", rc);
            goto out;
        }
    }
    if ((rc = fsdp_gpt_recipe_wrap(model, &fo, &root)) < 0) {
        fail(r, ctx, "fsdp_wrap", rc);
        goto out;
    }
    if (c->act_ckpt &&
        (rc = fsdp_apply_activation_checkpointing(model, "GPTBlock", NULL, NULL, NULL)) < 0) {
        fail(r, ctx, "activation checkpointing", rc);
        goto out;
    }
    if ((rc = fsdp_gpt_recipe_create_adamw(model, NULL, &opt)) < 0) {
        fail(r, ctx, "AdamW", rc);
        goto out;
    }
    int64_t shape[2] = {c->batch, m->seq};
    if ((rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &in)) < 0 ||
        (rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &tg)) < 0) {
        fail(r, ctx, "the batch", rc);
        goto out;
    }
    for (int s = 0; s < 2; s++) {
        /* The measured step starts with the warm-up's memory released and its peak forgotten. */
        if (s == 1) {
            fsdp_vsim_reset_stats(vs);
            fsdp_mem_reset_peaks(ctx);
            if (c->trace && ((rc = fsdp_trace_create(NULL, &trace)) < 0 ||
                             (rc = fsdp_trace_start(ctx, trace)) < 0)) {
                fail(r, ctx, "--trace", rc);
                goto out;
            }
        }
        fsdp_tensor_t *loss = NULL;
        if ((rc = fsdp_optim_zero_grad(opt, true)) < 0 ||
            (rc = fsdp_gpt_forward_loss(model, in, tg, &loss, NULL)) < 0 ||
            (rc = fsdp_backward(loss, NULL)) < 0) {
            fsdp_tensor_release(loss);
            fail(r, ctx, "the step", rc);
            goto out;
        }
        fsdp_tensor_release(loss);
        double norm = 0;
        if (c->grad_clip > 0 &&
            (rc = fsdp_unit_clip_grad_norm(root, c->grad_clip, 2.0, &norm)) < 0) {
            fail(r, ctx, "clip_grad_norm", rc);
            goto out;
        }
        if ((rc = fsdp_optim_step(opt)) < 0) {
            fail(r, ctx, "the optimizer step", rc);
            goto out;
        }
        fsdp_vsim_sync(vs);
    }
    if (trace) {
        fsdp_trace_stop(ctx);
        if ((rc = fsdp_trace_write(trace, c->trace)) < 0) {
            snprintf(r->error, sizeof r->error, "--trace %s: %s", c->trace,
                     fsdp_trace_last_error(trace));
            goto out;
        }
    }
    fsdp_vsim_stats_t st;
    fsdp_vsim_stats(vs, &st);
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(ctx, &ms);
    r->step = st.now - st.start;
    r->compute = st.compute_busy;
    r->comm = st.comm_busy;
    r->exposed = st.compute_idle;
    r->contention = st.contention;
    r->hw_flops = st.flops;
    r->model_flops = sim_model_flops(m, (double)c->batch * (double)m->seq);
    r->params = sim_model_params(m);
    double peak = cl.compute.matmul_flops[c->dtype];
    if (c->dtype == FSDP_DTYPE_F32 && cl.compute.allow_tf32) peak = cl.compute.tf32_flops;
    r->peak_flops = peak;
    r->tflops = r->model_flops / r->step / 1e12;
    r->hw_tflops = r->hw_flops / r->step / 1e12;
    r->mfu = peak > 0 ? r->model_flops / r->step / peak : 0;
    r->mem = ms;
    r->mem_capacity = cl.compute.mem_bytes;
    r->gpus_per_node = cl.net.gpus_per_node;
    for (int k = 0; k < FSDP_KERNEL_CLASS_COUNT; k++)
        r->class_time[k] = st.class_time[k];
    r->kernels = st.kernels;
    r->measured_calls = fsdp_vsim_measured_calls(vs);
    r->slowdown = slowdown;
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        r->coll_bytes[k] = st.coll_bytes[k], r->coll_time[k] = st.coll_time[k];
out:
    if (trace) fsdp_trace_stop(ctx);
    fsdp_trace_destroy(trace);
    fsdp_tensor_release(in);
    fsdp_tensor_release(tg);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(model);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(mctx);
    fsdp_ctx_destroy(ctx);
    r->wall = now_s() - t0;
    return rc < 0 ? rc : 0;
}
