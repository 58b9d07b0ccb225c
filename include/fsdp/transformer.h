/* SPDX-License-Identifier: MIT */
/*
 * fsdp/transformer.h: attention, PyTorch 1.13's transformer modules, and a GPT-2 style language
 * model.
 *
 * The modules mirror torch.nn.MultiheadAttention, TransformerEncoderLayer,
 * TransformerDecoderLayer, TransformerEncoder, TransformerDecoder and Transformer: the same
 * children under the same names, so the fully qualified parameter names equal the keys of
 * PyTorch's state_dict ("encoder.layers.0.self_attn.in_proj_weight",
 * "decoder.layers.1.multihead_attn.out_proj.bias", "encoder.norm.weight") and PyTorch weights load
 * by name with fsdp_module_load_state_dict(). Parameters are created in f32 on the context's
 * default device and initialised in PyTorch's order from the context's random stream (the values
 * differ from PyTorch's, whose generator is another one).
 *
 * Module type names (fsdp_module_type(), for wrapping policies): "MultiheadAttention",
 * "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
 * "TransformerDecoder", "Transformer"; the language model is "GPT" with blocks "GPTBlock", each
 * holding a "CausalSelfAttention" and an "MLP".
 *
 * Every forward goes through fsdp_module_forward() (the function forms below build the input
 * array and call it), and a module runs its children through fsdp_module_forward() too, so
 * hooks (FSDP's among them) see every module run. Dropout is active in training mode only
 * (fsdp_module_train()).
 *
 * Masks, as in PyTorch 1.13:
 *   - attn_mask: (L, S), or (N * num_heads, L, S) for per-head masks. A float mask is added to
 *     the attention scores (use -inf to forbid a position); a bool or u8 mask forbids the
 *     positions where it is set (true = not allowed to attend).
 *   - key_padding_mask: (N, S) bool or u8, true = this key is padding and is ignored; a float
 *     mask of that shape is added to the scores.
 *   A query row whose keys are all forbidden gets NaN weights, as in PyTorch.
 *
 * Errors: FSDP_EINVAL for bad sizes, shapes or masks (the message on the context names the
 * module, the argument and the shapes), FSDP_ENOMEM; nothing is recorded on failure.
 * Thread-safety: as modules (one context, one thread).
 */
#ifndef FSDP_TRANSFORMER_H
#define FSDP_TRANSFORMER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

/* ---- attention ------------------------------------------------------------------------------- */

/*
 * Scaled dot-product attention: out = dropout(softmax(q' k^T + bias, masked by ignore)) v with
 * q' = q / sqrt(E), where E = q's last size (q is scaled before the product, as PyTorch's
 * MultiheadAttention does).
 *
 * q (..., L, E), k (..., S, E), v (..., S, Ev) with equal leading (batch) dimensions; out is
 * (..., L, Ev), a new contiguous tensor. bias (float, broadcastable to (..., L, S); converted
 * to q's dtype when it differs) and ignore (bool or u8, broadcastable to (..., L, S); set =
 * the score becomes -inf) may be NULL. Dropout with probability dropout_p is applied to the
 * attention weights when train. Differentiable in q, k, v and a float bias.
 */
FSDP_EXTERN int fsdp_attention(fsdp_tensor_t *q, fsdp_tensor_t *k, fsdp_tensor_t *v,
                               fsdp_tensor_t *bias, fsdp_tensor_t *ignore, double dropout_p,
                               bool train, fsdp_tensor_t **out);

/* ---- multi-head attention -------------------------------------------------------------------- */

/*
 * torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first=batch_first)
 * with equal query, key and value sizes (kdim = vdim = embed_dim), no add_bias_kv and no
 * add_zero_attn. num_heads must divide embed_dim; 0 <= dropout < 1.
 *
 * Parameters: in_proj_weight (3E, E), in_proj_bias (3E), out_proj.weight (E, E) and
 * out_proj.bias (E) of the Linear child "out_proj" (the biases only when bias). Initialisation
 * in PyTorch's order: out_proj as a Linear (weight, then bias), then in_proj_weight
 * xavier-uniform; in_proj_bias and out_proj.bias are zeros.
 *
 * Module forward: inputs query, key, value[, key_padding_mask[, attn_mask]] (the optional ones
 * may be NULL), one output. Shapes are (L, N, E) for the query and (S, N, E) for key and value,
 * or (N, L, E) and (N, S, E) when batch_first; unbatched (L, E) and (S, E) inputs (with a (S)
 * key padding mask) give an (L, E) output. Query, key and value that are the same tensor are
 * projected with one product (self-attention), as are key and value that are the same tensor.
 * Only the attention output is computed (PyTorch's need_weights=False).
 */
FSDP_EXTERN int fsdp_mha_create(fsdp_ctx_t *ctx, int64_t embed_dim, int64_t num_heads,
                                double dropout, bool bias, bool batch_first, fsdp_module_t **m);
/* Runs m (a MultiheadAttention) through fsdp_module_forward(). key_padding_mask and attn_mask
 * may be NULL. *out receives a new reference. */
FSDP_EXTERN int fsdp_mha_forward(fsdp_module_t *m, fsdp_tensor_t *query, fsdp_tensor_t *key,
                                 fsdp_tensor_t *value, fsdp_tensor_t *key_padding_mask,
                                 fsdp_tensor_t *attn_mask, fsdp_tensor_t **out);

/* ---- encoder-decoder transformer ------------------------------------------------------------- */

typedef enum fsdp_activation {
    FSDP_ACTIVATION_RELU = 0, /* PyTorch's activation="relu" */
    FSDP_ACTIVATION_GELU      /* activation="gelu": the exact (erf) GELU */
} fsdp_activation_t;

/* The arguments of torch.nn.Transformer (and of its layers). */
typedef struct fsdp_transformer_config {
    /* sizeof this struct as the caller was built; set by fsdp_transformer_config_init() */
    size_t size;
    int64_t d_model;              /* model width; default 512 */
    int64_t nhead;                /* attention heads, divides d_model; default 8 */
    int64_t num_encoder_layers;   /* default 6 (Transformer only) */
    int64_t num_decoder_layers;   /* default 6 (Transformer only) */
    int64_t dim_feedforward;      /* hidden width of the feed-forward block; default 2048 */
    double dropout;               /* in [0, 1); default 0.1 */
    fsdp_activation_t activation; /* default relu */
    double layer_norm_eps;        /* default 1e-5 */
    bool batch_first;             /* (N, L, E) inputs instead of (L, N, E); default false */
    bool norm_first;              /* pre-norm layers; default false (post-norm) */
} fsdp_transformer_config_t;

/* Fills cfg with PyTorch's defaults (listed above). */
FSDP_EXTERN void fsdp_transformer_config_init(fsdp_transformer_config_t *cfg, size_t size);
#define fsdp_transformer_config_init(cfg) (fsdp_transformer_config_init)((cfg), sizeof *(cfg))

/*
 * TransformerEncoderLayer: children self_attn, linear1, dropout, linear2, norm1, norm2,
 * dropout1, dropout2 (PyTorch's registration order). Module forward: src[, src_mask[,
 * src_key_padding_mask]] -> one output of src's shape.
 *   post-norm: x = norm1(x + sa(x)); x = norm2(x + ff(x))
 *   pre-norm:  x = x + sa(norm1(x)); x = x + ff(norm2(x))
 * with sa = dropout1(self_attn(x, x, x)) and ff = dropout2(linear2(dropout(act(linear1(x))))).
 */
FSDP_EXTERN int fsdp_transformer_encoder_layer_create(fsdp_ctx_t *ctx,
                                                      const fsdp_transformer_config_t *cfg,
                                                      fsdp_module_t **m);
FSDP_EXTERN int fsdp_transformer_encoder_layer_forward(fsdp_module_t *m, fsdp_tensor_t *src,
                                                       fsdp_tensor_t *src_mask,
                                                       fsdp_tensor_t *src_key_padding_mask,
                                                       fsdp_tensor_t **out);

/*
 * TransformerDecoderLayer: children self_attn, multihead_attn, linear1, dropout, linear2,
 * norm1, norm2, norm3, dropout1, dropout2, dropout3. Module forward: tgt, memory[, tgt_mask[,
 * memory_mask[, tgt_key_padding_mask[, memory_key_padding_mask]]]] -> one output of tgt's
 * shape. Self-attention on tgt, then attention from tgt to memory, then the feed-forward block,
 * each with its residual and norm (before the block when norm_first, after it otherwise).
 */
FSDP_EXTERN int fsdp_transformer_decoder_layer_create(fsdp_ctx_t *ctx,
                                                      const fsdp_transformer_config_t *cfg,
                                                      fsdp_module_t **m);
FSDP_EXTERN int
fsdp_transformer_decoder_layer_forward(fsdp_module_t *m, fsdp_tensor_t *tgt, fsdp_tensor_t *memory,
                                       fsdp_tensor_t *tgt_mask, fsdp_tensor_t *memory_mask,
                                       fsdp_tensor_t *tgt_key_padding_mask,
                                       fsdp_tensor_t *memory_key_padding_mask, fsdp_tensor_t **out);

/*
 * TransformerEncoder / TransformerDecoder: num_layers copies of a layer built from cfg under
 * "layers.0", "layers.1", ... (a ModuleList), and a final LayerNorm "norm" when final_norm.
 * Like PyTorch's _get_clones, every layer starts with the same values: the random stream is
 * rewound for each copy and left where one layer's initialisation leaves it. The forwards
 * take the inputs of their layer type and run the layers in order, then the norm.
 */
FSDP_EXTERN int fsdp_transformer_encoder_create(fsdp_ctx_t *ctx,
                                                const fsdp_transformer_config_t *cfg,
                                                int64_t num_layers, bool final_norm,
                                                fsdp_module_t **m);
FSDP_EXTERN int fsdp_transformer_decoder_create(fsdp_ctx_t *ctx,
                                                const fsdp_transformer_config_t *cfg,
                                                int64_t num_layers, bool final_norm,
                                                fsdp_module_t **m);
FSDP_EXTERN int fsdp_transformer_encoder_forward(fsdp_module_t *m, fsdp_tensor_t *src,
                                                 fsdp_tensor_t *mask,
                                                 fsdp_tensor_t *src_key_padding_mask,
                                                 fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_transformer_decoder_forward(fsdp_module_t *m, fsdp_tensor_t *tgt,
                                                 fsdp_tensor_t *memory, fsdp_tensor_t *tgt_mask,
                                                 fsdp_tensor_t *memory_mask,
                                                 fsdp_tensor_t *tgt_key_padding_mask,
                                                 fsdp_tensor_t *memory_key_padding_mask,
                                                 fsdp_tensor_t **out);

/*
 * torch.nn.Transformer: children "encoder" (num_encoder_layers layers and a final norm) and
 * "decoder" (num_decoder_layers layers and a final norm); then, as PyTorch's
 * _reset_parameters, every parameter with more than one dimension is redrawn xavier-uniform in
 * parameter order. Module forward: src, tgt[, src_mask[, tgt_mask[, memory_mask[,
 * src_key_padding_mask[, tgt_key_padding_mask[, memory_key_padding_mask]]]]]] (PyTorch's
 * order; NULL for an absent mask) -> one output of tgt's shape. src and tgt must have the same
 * batch size and d_model features. fsdp_causal_mask() builds a tgt_mask.
 */
FSDP_EXTERN int fsdp_transformer_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                                        fsdp_module_t **m);
FSDP_EXTERN int fsdp_transformer_forward(fsdp_module_t *m, fsdp_tensor_t *src, fsdp_tensor_t *tgt,
                                         fsdp_tensor_t *src_mask, fsdp_tensor_t *tgt_mask,
                                         fsdp_tensor_t *memory_mask,
                                         fsdp_tensor_t *src_key_padding_mask,
                                         fsdp_tensor_t *tgt_key_padding_mask,
                                         fsdp_tensor_t *memory_key_padding_mask,
                                         fsdp_tensor_t **out);

/* ---- GPT-2 style language model -------------------------------------------------------------- */

/* The size of a GPT model. */
typedef struct fsdp_gpt_config {
    /* sizeof this struct as the caller was built; set by fsdp_gpt_config_init() */
    size_t size;
    int64_t vocab;         /* vocabulary size; default 50257 */
    int64_t max_seq;       /* longest sequence (rows of the position embedding); default 1024 */
    int64_t n_layer;       /* blocks; default 12 */
    int64_t n_head;        /* attention heads, divides d_model; default 12 */
    int64_t d_model;       /* width; default 768 */
    int64_t d_ff;          /* hidden width of the MLP, 0 for 4 * d_model; default 0 */
    double dropout;        /* embedding, attention and residual dropout in [0, 1); default 0 */
    double layer_norm_eps; /* default 1e-5 */
    double init_std;       /* std of the normal initialisation; default 0.02 */
} fsdp_gpt_config_t;

/* Fills cfg with GPT-2 small (124M parameters) and nanoGPT's dropout 0. */
FSDP_EXTERN void fsdp_gpt_config_init(fsdp_gpt_config_t *cfg, size_t size);
#define fsdp_gpt_config_init(cfg) (fsdp_gpt_config_init)((cfg), sizeof *(cfg))

/*
 * A decoder-only transformer in GPT-2's layout (pre-norm blocks, learned positions, tied
 * output head). Parameters, in order:
 *   wte.weight (vocab, d)                 token embedding, also the output head
 *   wpe.weight (max_seq, d)               position embedding
 *   h.<i>.ln_1.{weight,bias} (d)
 *   h.<i>.attn.c_attn.{weight (3d, d), bias (3d)}    query, key, value in one product
 *   h.<i>.attn.c_proj.{weight (d, d), bias (d)}
 *   h.<i>.ln_2.{weight,bias} (d)
 *   h.<i>.mlp.c_fc.{weight (d_ff, d), bias (d_ff)}
 *   h.<i>.mlp.c_proj.{weight (d, d_ff), bias (d)}
 *   ln_f.{weight,bias} (d)
 * Linear weights are stored (out, in) as torch.nn.Linear's (not as GPT-2's Conv1D). There is
 * no separate head weight: logits = ln_f(x) wte^T, so wte's gradient is the sum of the
 * embedding's and the head's. Initialisation: every matrix and embedding normal(0, init_std),
 * the c_proj weights normal(0, init_std / sqrt(2 n_layer)), biases zeros, LayerNorm weights
 * ones.
 *
 * Module forward: tokens (B, T) int64 (or i32) with 1 <= T <= max_seq and every token in
 * [0, vocab) -> logits (B, T, vocab). A block computes x += attn(ln_1(x)) with causal
 * self-attention, then x += mlp(ln_2(x)) with the tanh GELU. The causal mask is built once per
 * sequence length and dtype and shared by every block.
 *
 * The head reads wte.weight outside the wte module's forward, so an FSDP wrapping must keep
 * wte in the root's unit (as with tied weights in PyTorch's FSDP).
 */
FSDP_EXTERN int fsdp_gpt_create(fsdp_ctx_t *ctx, const fsdp_gpt_config_t *cfg, fsdp_module_t **m);
/* The configuration m was created with (borrowed; its size is this library's), or NULL when m
 * is not a GPT. */
FSDP_EXTERN const fsdp_gpt_config_t *fsdp_gpt_get_config(const fsdp_module_t *m);
/* Runs m through fsdp_module_forward(): tokens (B, T) -> logits (B, T, vocab). */
FSDP_EXTERN int fsdp_gpt_forward(fsdp_module_t *m, fsdp_tensor_t *tokens, fsdp_tensor_t **logits);
/* Mean cross-entropy of logits (B, T, V) against int64 targets (B, T); targets equal to -1 are
 * ignored (nanoGPT's convention). A scalar in *loss. */
FSDP_EXTERN int fsdp_gpt_loss(fsdp_tensor_t *logits, fsdp_tensor_t *targets, fsdp_tensor_t **loss);
/* Forward and loss in one call; *logits (may be NULL) receives the logits too. */
FSDP_EXTERN int fsdp_gpt_forward_loss(fsdp_module_t *m, fsdp_tensor_t *tokens,
                                      fsdp_tensor_t *targets, fsdp_tensor_t **loss,
                                      fsdp_tensor_t **logits);

FSDP_END_DECLS

#endif /* FSDP_TRANSFORMER_H */
