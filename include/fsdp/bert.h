/* SPDX-License-Identifier: MIT */
/*
 * fsdp/bert.h: a BERT encoder with a masked-LM head, under Hugging Face's parameter names.
 *
 * fsdp_bert_create() builds Hugging Face's BertForMaskedLM (transformers 4.x, modeling_bert.py
 * with hidden_act "gelu" and absolute position embeddings): the same module tree, the same
 * children under the same names, so the fully qualified parameter names and the state-dict keys
 * are Hugging Face's and its weights load by name with fsdp_module_load_state_dict(). The tree,
 * with the module types (fsdp_module_type(), for wrapping policies and checkpointing):
 *
 *   ""                                BertForMaskedLM
 *     bert                            BertModel
 *       embeddings                    BertEmbeddings
 *         word_embeddings             Embedding (vocab_size, hidden), padding_idx pad_token_id
 *         position_embeddings         Embedding (max_position_embeddings, hidden)
 *         token_type_embeddings       Embedding (type_vocab_size, hidden)
 *         LayerNorm                   LayerNorm (hidden), eps layer_norm_eps
 *       encoder                       BertEncoder
 *         layer                       ModuleList
 *           <i>                       BertLayer, i = 0 .. num_hidden_layers - 1
 *             attention               BertAttention
 *               self                  BertSelfAttention: query, key, value (Linear hidden->hidden)
 *               output                BertSelfOutput: dense (Linear hidden->hidden), LayerNorm
 *             intermediate            BertIntermediate: dense (Linear hidden->intermediate)
 *             output                  BertOutput: dense (Linear intermediate->hidden), LayerNorm
 *       pooler                        BertPooler: dense (Linear hidden->hidden); only when
 *                                     add_pooling_layer
 *     cls                             BertOnlyMLMHead
 *       predictions                   BertLMPredictionHead: parameter bias (vocab_size)
 *         transform                   BertPredictionHeadTransform: dense (Linear), LayerNorm
 *         decoder                     Linear hidden->vocab_size: weight and bias are tied
 *
 * Tied parameters. cls.predictions.decoder.weight is the tensor of
 * bert.embeddings.word_embeddings.weight and cls.predictions.decoder.bias the tensor of
 * cls.predictions.bias (Hugging Face ties the first by tie_weights() and aliases the second with
 * `self.decoder.bias = self.bias`). Each is one parameter registered under two names (fsdp/nn.h):
 * parameter listings give it once, under bert.embeddings.word_embeddings.weight and
 * cls.predictions.bias (PyTorch's named_parameters() order), and the state dict lists both names
 * as PyTorch's state_dict() does. The decoder's gradient therefore accumulates into the word
 * embedding's, and an FSDP wrapping must keep the embeddings and the head in one unit (the root's,
 * when each BertLayer is a unit of its own).
 *
 * Dropout and the activations are functions of their modules' forwards, not child modules
 * (Hugging Face's `dropout`, `intermediate_act_fn`, `transform_act_fn` and `activation` children
 * hold no parameters or buffers, so names and state dicts are the same). The embeddings hold
 * Hugging Face's two non-persistent int64 buffers position_ids (1, max_position_embeddings) =
 * 0, 1, ... and token_type_ids (1, max_position_embeddings) = 0; they are not in the state dict.
 *
 * The computation (B = batch, S = sequence length, H = hidden_size):
 *   embeddings   LayerNorm(word[input_ids] + token_type[token_type_ids] + position[0..S-1]),
 *                then dropout (hidden_dropout_prob); token_type_ids NULL means zeros
 *   mask         attention_mask (B, S) (1 = attend, 0 = padding; NULL = all ones) becomes the
 *                additive (B, 1, 1, S) mask (1 - mask) * lowest, lowest being the most negative
 *                finite value of the hidden states' dtype (Hugging Face's
 *                get_extended_attention_mask); built once per forward, shared by every layer. A
 *                sequence whose keys are all padding attends uniformly, as in Hugging Face.
 *   BertLayer    a = LN(x + dropout(dense(attention(x)))), where attention is bidirectional
 *                multi-head self-attention softmax(q k^T / sqrt(H / heads) + mask) v with dropout
 *                attention_probs_dropout_prob on the probabilities; then
 *                y = LN(a + dropout(dense(gelu(dense(a))))), gelu being the exact (erf) GELU
 *   pooler       tanh(dense(sequence_output[:, 0]))
 *   MLM head     decoder(LN(gelu(dense(sequence_output)))) = ... word_embeddings^T + bias
 * Dropout is active in training mode only (fsdp_module_train()) and draws its masks from the
 * context's random stream, so a training forward is reproducible from the seed.
 *
 * Module forwards (every one runs through fsdp_module_forward(), and runs its children through
 * it, so hooks see every module run):
 *   BertForMaskedLM  input_ids[, attention_mask[, token_type_ids]] -> logits (B, S, V)
 *                    [, pooled (B, H)] (nout 1 or 2; 2 needs the pooler)
 *   BertModel        the same inputs -> sequence_output (B, S, H)[, pooled (B, H)]
 *   BertEmbeddings   input_ids[, token_type_ids] -> (B, S, H)
 *   BertEncoder, BertLayer, BertAttention, BertSelfAttention
 *                    hidden (B, S, H)[, extended mask (B, 1, 1, S) additive] -> (B, S, H)
 *   BertSelfOutput, BertOutput   hidden, input_tensor -> LN(input_tensor + dropout(dense(hidden)))
 *   BertIntermediate, BertPredictionHeadTransform, BertLMPredictionHead, BertOnlyMLMHead,
 *   BertPooler       one input, one output
 * input_ids and token_type_ids are int64 (or i32) (B, S) with 1 <= S <= max_position_embeddings
 * (ids outside their table are an error naming the first); attention_mask is (B, S) of any dtype
 * (bool, u8, integer or float; compared as 0 / 1).
 *
 * Initialisation: Hugging Face's BertPreTrainedModel._init_weights from the context's random
 * stream, in parameter order: Linear weights and embeddings normal(0, initializer_range), Linear
 * biases and cls.predictions.bias zeros, the padding row of the word embeddings zeroed, LayerNorm
 * weights ones and biases zeros. The values do not match PyTorch's bit for bit (its generator is
 * another one); load a state dict for that (tests/t_bert.c does, from tests/golden/bert.bin).
 *
 * Errors: FSDP_EINVAL for a bad configuration (the message on the context names the field and
 * its value), bad shapes, dtypes or ids (naming the argument and its shape), FSDP_ENOMEM; on
 * failure the outputs are NULL and nothing is leaked.
 * Thread-safety: as modules (one context, one thread).
 */
#ifndef FSDP_BERT_H
#define FSDP_BERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

/* Labels equal to this are ignored by the masked-LM loss (PyTorch's CrossEntropyLoss default,
 * which Hugging Face uses). */
#define FSDP_BERT_IGNORE_INDEX (-100)

/* Hugging Face's BertConfig (the fields this model reads); defaults are bert-base-uncased's. */
typedef struct fsdp_bert_config {
    /* sizeof this struct as the caller was built; set by fsdp_bert_config_init() */
    size_t size;
    int64_t vocab_size;                  /* default 30522 */
    int64_t hidden_size;                 /* H, divisible by num_attention_heads; default 768 */
    int64_t num_hidden_layers;           /* BertLayers, >= 0; default 12 */
    int64_t num_attention_heads;         /* default 12 */
    int64_t intermediate_size;           /* hidden width of the feed-forward block; 3072 */
    int64_t max_position_embeddings;     /* longest sequence; default 512 */
    int64_t type_vocab_size;             /* segment types; default 2 */
    double layer_norm_eps;               /* > 0; default 1e-12 */
    double hidden_dropout_prob;          /* in [0, 1); default 0.1 */
    double attention_probs_dropout_prob; /* in [0, 1); default 0.1 */
    int64_t pad_token_id;                /* padding row of the word embeddings, in [0, vocab_size)
                                            or -1 for none; default 0 */
    double initializer_range;            /* std of the normal initialisation, >= 0; 0.02 */
    bool add_pooling_layer;              /* build bert.pooler (BertModel's default); Hugging
                                            Face's BertForMaskedLM itself has none; default true */
} fsdp_bert_config_t;

/* Fills cfg with the defaults listed above. */
FSDP_EXTERN void fsdp_bert_config_init(fsdp_bert_config_t *cfg, size_t size);
#define fsdp_bert_config_init(cfg) (fsdp_bert_config_init)((cfg), sizeof *(cfg))

/* Checks cfg as fsdp_bert_create does: 0, or FSDP_EINVAL with a message on ctx naming the first
 * bad field and its value (and the field it must agree with). ctx may be NULL (no message). */
FSDP_EXTERN int fsdp_bert_config_check(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg);

/* Builds the model described above on ctx's default device (f32 parameters), initialised from
 * ctx's random stream. *m receives a new reference (NULL on failure). */
FSDP_EXTERN int fsdp_bert_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **m);

/* The configuration m was created with (borrowed; lives as long as m; its size is this
 * library's), for the model root (BertForMaskedLM) or its "bert" child (BertModel); NULL for any
 * other module. */
FSDP_EXTERN const fsdp_bert_config_t *fsdp_bert_get_config(const fsdp_module_t *m);

/* Runs m (the BertForMaskedLM root) through fsdp_module_forward(). attention_mask and
 * token_type_ids may be NULL (all ones, all zeros). *logits receives (B, S, vocab_size); pooled
 * may be NULL (the pooler is then not run), else *pooled receives (B, H) and the model must have
 * the pooler. */
FSDP_EXTERN int fsdp_bert_forward(fsdp_module_t *m, fsdp_tensor_t *input_ids,
                                  fsdp_tensor_t *attention_mask, fsdp_tensor_t *token_type_ids,
                                  fsdp_tensor_t **logits, fsdp_tensor_t **pooled);

/* Masked-LM loss: mean cross entropy of logits (B, S, V) against int64 labels (B, S) over the
 * labels that are not FSDP_BERT_IGNORE_INDEX (NaN when every label is ignored, as in PyTorch). A
 * scalar in *loss. */
FSDP_EXTERN int fsdp_bert_mlm_loss(fsdp_tensor_t *logits, fsdp_tensor_t *labels,
                                   fsdp_tensor_t **loss);

/* Forward and masked-LM loss in one call (Hugging Face's BertForMaskedLM(..., labels=labels)).
 * logits and pooled may be NULL; when given they receive the logits and (pooled needs the
 * pooler) the pooled output too. */
FSDP_EXTERN int fsdp_bert_forward_loss(fsdp_module_t *m, fsdp_tensor_t *input_ids,
                                       fsdp_tensor_t *attention_mask, fsdp_tensor_t *token_type_ids,
                                       fsdp_tensor_t *labels, fsdp_tensor_t **loss,
                                       fsdp_tensor_t **logits, fsdp_tensor_t **pooled);

FSDP_END_DECLS

#endif /* FSDP_BERT_H */
