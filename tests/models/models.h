/* SPDX-License-Identifier: MIT */
/*
 * models.h: the seed test models (spec section 2.4), built unwrapped from libfsdp modules.
 *
 * Each constructor builds the module tree of the PyTorch model it ports, with the same child
 * names in the same registration order, so fully qualified parameter names and state-dict keys
 * equal PyTorch's ("module.1.0.weight", "transformer.encoder.layers.0.self_attn.in_proj_weight")
 * and PyTorch weights load with fsdp_module_load_state_dict(). The models are not wrapped: the
 * FSDP tests wrap them; the *_units() lists say which submodules upstream makes FSDP units.
 *
 * Seeding. PyTorch's `torch.manual_seed(s)` becomes tm_manual_seed(ctx, s): the context's random
 * stream is reset to (seed s, stream 0), so a deterministic model has the same values on every
 * rank, whatever the rank's default stream. Like PyTorch's global generator the stream is left
 * where construction leaves it. The values differ from PyTorch's (another generator); tests that
 * compare with PyTorch load PyTorch's weights (tests/golden/models.bin).
 *
 * Ownership: constructors return a new module reference in *out (release with
 * fsdp_module_release()); input and loss helpers return new tensor references. Errors are the
 * library's FSDP_E* codes with the message on the context; on failure *out is NULL.
 * Thread-safety: as modules (one context, one thread); the static name lists are read-only.
 */
#ifndef FSDP_TEST_MODELS_H
#define FSDP_TEST_MODELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/nn.h>
#include <fsdp/pg.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

/* torch.manual_seed(seed) on ctx's random stream (stream 0, offset 0). */
void tm_manual_seed(fsdp_ctx_t *ctx, uint64_t seed);

/* loss = sum of every element of out (a scalar). */
int tm_sum_loss(fsdp_tensor_t *out, fsdp_tensor_t **loss);

/* ---- NestedWrappedModule, AlwaysWrapNestedWrappedModule -------------------------------------- */

/*
 * common_fsdp.NestedWrappedModule, unwrapped (type "NestedWrappedModule"): one child "module",
 *   Sequential(Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)), Linear(16, 4),
 *              Linear(4, 8))
 * 496 parameters. deterministic: seeded 0 first (upstream's deterministic=True). Forward: x (N,
 * 8) -> module(x) (N, 8). AlwaysWrapNestedWrappedModule is the same tree (only its wrapping
 * differs), so there is no separate constructor.
 */
#define TM_NESTED_NUM_PARAMS 496
int tm_nested_wrapped_create(fsdp_ctx_t *ctx, bool deterministic, fsdp_module_t **out);
/* get_input: rand(4, 8) drawn after tm_manual_seed(ctx, 1 + rank). */
int tm_nested_wrapped_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x);
/* Upstream's FSDP units under RECURSIVE (the root excluded: the harness adds it), NULL-terminated:
 * "module.1", "module.1.0", "module.2". */
const char *const *tm_nested_wrapped_units(void);

/* ---- MixtureOfExperts ------------------------------------------------------------------------ */

/*
 * common_fsdp.MixtureOfExperts, unwrapped (type "MixtureOfExperts"): child "module",
 *   Sequential(Linear(8, 12), shared = Linear(12, 23), expert = Linear(23, 12), Linear(12, 8))
 * deterministic: as upstream, a NestedWrappedModule is first built (seed 0) and dropped, the
 * expert is drawn after tm_manual_seed(42 + rank), everything after it after tm_manual_seed(0);
 * so the expert differs per rank and the rest does not. Forward: x (N, 8) -> (N, 8).
 */
int tm_moe_create(fsdp_ctx_t *ctx, bool deterministic, fsdp_module_t **out);
/* get_input: as NestedWrappedModule's. */
int tm_moe_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x);
/* Whether a parameter is tagged expert (upstream's `p.expert = True`): by tensor, for the
 * unwrapped model m ... */
bool tm_moe_is_expert_param(const fsdp_module_t *m, const fsdp_tensor_t *p);
/* ... and by fully qualified name ("module.2.weight", "module.2.bias"; wrapper segments
 * "_fsdp_wrapped_module." and "_checkpoint_wrapped_module." anywhere in fqn are ignored). */
bool tm_moe_is_expert_fqn(const char *fqn);
/* Number of expert parameter elements (upstream's num_expert_params): 23 * 12 + 12. */
#define TM_MOE_NUM_EXPERT_PARAMS 288
/* FSDP units under RECURSIVE: "module.1" (shared, over the global group) and "module.2" (the
 * expert, over a group of this rank alone). NULL-terminated. */
const char *const *tm_moe_units(void);
/* run_backward of the unwrapped model: backward, then every non-expert gradient divided by the
 * world size and all-reduced (sum) over pg; expert gradients are left alone. pg may be NULL for a
 * world of one (then only the backward runs). */
int tm_moe_run_backward(fsdp_module_t *m, fsdp_tensor_t *loss, fsdp_pg_t *pg);

/* ---- TransformerWithSharedParams ------------------------------------------------------------- */

#define TM_TRANSFORMER_VOCAB 23
#define TM_TRANSFORMER_D_MODEL 16

/*
 * common_fsdp.TransformerWithSharedParams (type "TransformerWithSharedParams"):
 *   embed_tokens  Embedding(23, 16)
 *   transformer   Transformer(d_model 16, nhead 8 (PyTorch's default: upstream passes none),
 *                 2 encoder and 2 decoder layers, dim_feedforward 8, dropout 0.1)
 *   output_proj   Linear(16, 23) whose weight IS embed_tokens.weight (tied: one tensor)
 *   buffers       vocab_bias f32 ones (16), long_buffer i64 zeros (16), on the root
 *   bn            BatchNorm1d(2) when add_bn, else Identity
 * deterministic: seeded 0 first and put in eval mode (dropout off), as upstream.
 * Forward (src_ids (S, 2), tgt_ids (T, 2) int64, sequence first) -> logits (T, 2, 23):
 *   src = embed(src_ids) + vocab_bias + long_buffer.type_as(src); tgt = bn(embed(tgt_ids));
 *   output_proj(transformer(src, tgt)).
 */
int tm_transformer_create(fsdp_ctx_t *ctx, bool add_bn, bool deterministic, fsdp_module_t **out);
/* get_input: src = arange(12).view(6, 2), tgt = arange(8).view(4, 2), int64 (same on every rank;
 * upstream seeds 1 + rank first, which this does too). */
int tm_transformer_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **src, fsdp_tensor_t **tgt);
/* Runs the model (two inputs) through fsdp_module_forward(). */
int tm_transformer_forward(fsdp_module_t *m, fsdp_tensor_t *src, fsdp_tensor_t *tgt,
                           fsdp_tensor_t **out);
/* get_loss: cross_entropy(out.view(-1, 23), tgt.view(-1), reduction sum). */
int tm_transformer_loss(fsdp_tensor_t *tgt, fsdp_tensor_t *out, fsdp_tensor_t **loss);
/* Units under RECURSIVE (transformer_auto_wrap_policy on the encoder and decoder layers; the
 * root is a unit too, giving 5): "transformer.encoder.layers.0", "...layers.1",
 * "transformer.decoder.layers.0", "...layers.1". NULL-terminated; the root is not listed. */
const char *const *tm_transformer_units(void);

/* ---- TestFSDPUseOrigParamsWriteback.Model ---------------------------------------------------- */

/* Type "Model": lin1 Linear(5, 5), relu, lin2 Linear(5, 7); seeded 42. Forward x (N, 5) ->
 * (N, 7). */
int tm_writeback_create(fsdp_ctx_t *ctx, fsdp_module_t **out);
/* get_input: randn(2, 5) from the context's stream as it is (upstream does not reseed). */
int tm_writeback_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x);

/* ---- structure-only and small models --------------------------------------------------------- */

/* NestedSequentialModel (test_fsdp_wrap), a plain Sequential:
 *   Sequential(Linear(5, 5), Linear(5, 5), Sequential(Linear(5, 5), Linear(5, 5)))
 * seeded 0. 6 modules, 4 Linear of 30 parameters. */
int tm_nested_sequential_create(fsdp_ctx_t *ctx, fsdp_module_t **out);

/*
 * LoraModel (type "LoraModel"), structure and requires_grad only (its forward is an error):
 *   embed_tokens Embedding(100, 32) frozen; layers ModuleList of 4 LoraDecoder; norm LayerNorm(32)
 *   frozen.
 * LoraDecoder: attn (LoraAttention), mlp (LoraMLP), inp_layernorm and post_attn_layernorm
 *   (LayerNorm(32), frozen).
 * LoraAttention: q_proj, lora_A Linear(32, 8), lora_B Linear(8, 32), k_proj, v_proj, o_proj
 *   (Linear(32, 32)); all without bias; only lora_A and lora_B trainable.
 * LoraMLP: proj1 Linear(32, 128), proj2 Linear(128, 32), no bias, frozen.
 * Seeded 0.
 */
int tm_lora_create(fsdp_ctx_t *ctx, fsdp_module_t **out);

/* BatchNormNet (type "BatchNormNet"), structure only: lin Linear(10, 10, no bias), bn1
 * BatchNorm1d(10), bn2 BatchNorm2d(10), bn3 BatchNorm3d(10), sync_bn a plain BatchNorm1d(10)
 * standing in for SyncBatchNorm(10) (libfsdp has no SyncBatchNorm; its parameters and buffers are
 * the same). Seeded 0. */
int tm_batchnorm_net_create(fsdp_ctx_t *ctx, fsdp_module_t **out);

/* ModelWithIgnoredModule (type "ModelWithIgnoredModule"): l1 Linear(100, 100), ignored
 * (IgnoredModule: child l = Linear(100, 100)), l2 Linear(100, 100); forward l2(ignored(l1(x))).
 * Seeded 0. */
int tm_ignored_create(fsdp_ctx_t *ctx, fsdp_module_t **out);

/* The dynamo tests' ToyModel (type "ToyModel"): net = Sequential(Linear(in, hidden), ReLU,
 * Linear(hidden, hidden), ReLU, Linear(hidden, hidden), ReLU, Linear(hidden, out), ReLU).
 * Upstream: in 10, hidden 5000, out 5 (TM_TOY_* below; about 50M parameters, so tests pass a
 * smaller hidden). Seeded 0. */
#define TM_TOY_IN 10
#define TM_TOY_HIDDEN 5000
#define TM_TOY_OUT 5
int tm_toy_create(fsdp_ctx_t *ctx, int64_t in, int64_t hidden, int64_t out_features,
                  fsdp_module_t **out);

/* ---- mixed-precision models (seed 003, test_fsdp_mixed_precision.py) ------------------------ */

/*
 * SaveForwardInputsModel (common_distributed; type "SaveForwardInputsModel"): children c1 and c2,
 * each a SaveForwardInputsModule (type "SaveForwardInputsModule") with one child l =
 * Linear(100, 100). Forward: the model returns c2(c1(x)); a module, when cast_forward_inputs,
 * first casts x to the dtype its l.weight has at that moment (the compute dtype inside an FSDP
 * unit), then returns l(x). Upstream also records each forward's input; here the tests do that
 * with forward pre-hooks. Seeded 0.
 */
int tm_save_inputs_create(fsdp_ctx_t *ctx, bool cast_forward_inputs, fsdp_module_t **out);

/*
 * MP-DP-06's ToyModel (type "ToyModelWithExternalInputs"): l1 Linear(100, 100), l2 a ToyModule
 * (type "ToyModule", child l = Linear(100, 100), two inputs: forward(x, y) = l(x)). Forward(x):
 * y = ones(N, 100) f32 made inside the forward (an input no parent cast), then l2(l1(x), y).
 * Seeded 0.
 */
int tm_external_inputs_create(fsdp_ctx_t *ctx, fsdp_module_t **out);

/*
 * MP-TE-01's TransformerWithEMA, reduced (type "ModelWithEMA"): module = Sequential(Linear(d, h),
 * ReLU, Linear(h, d)), and ema_module, the same structure holding a copy of module's initial
 * values (AveragedModel deep-copies). Forward(x): module(x) in training mode, ema_module(x) in
 * eval mode. Updating the EMA is the test's business. Seeded 0.
 */
int tm_ema_create(fsdp_ctx_t *ctx, int64_t d, int64_t h, fsdp_module_t **out);

/* ---- GPT ------------------------------------------------------------------------------------- */

/* The tiny GPT of the golden file (tests/golden/gen_models.py's GPT_CFG): vocab 64, max_seq 16,
 * 2 layers, 4 heads, d_model 16, d_ff 64, dropout 0, eps 1e-5, init_std 0.02. */
void tm_gpt_tiny_config(fsdp_gpt_config_t *cfg);

#endif /* FSDP_TEST_MODELS_H */
