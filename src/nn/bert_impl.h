/* SPDX-License-Identifier: MIT */
/*
 * bert_impl.h: what the two halves of the BERT model (bert.c, bert_layers.c) share.
 *
 * bert_layers.c builds the modules below the model (embeddings, the encoder layer and its parts,
 * the pooler, the masked-LM head); bert.c validates the configuration and builds the encoder, the
 * BertModel and the BertForMaskedLM root from them, and holds the public entry points. Every
 * constructor here takes a configuration that fsdp_bert_config_check() has accepted, and returns
 * a new reference in *out (NULL on failure, with nothing leaked).
 */
#ifndef FSDP_NN_BERT_IMPL_H
#define FSDP_NN_BERT_IMPL_H

#include "nn/nn_impl.h"
#include <fsdp/bert.h>

/* Registers child under name and drops the caller's reference (the parent keeps one); *slot (may
 * be NULL) borrows the child. The child is consumed on failure too. */
int fsdp__bert_adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child,
                     fsdp_module_t **slot);

/* BertEmbeddings: word, position and token-type embeddings, LayerNorm, and the non-persistent
 * buffers position_ids and token_type_ids. */
int fsdp__bert_embeddings_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg,
                                 fsdp_module_t **out);
/* BertLayer with its BertAttention (BertSelfAttention, BertSelfOutput), BertIntermediate and
 * BertOutput. */
int fsdp__bert_layer_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out);
/* BertPooler. */
int fsdp__bert_pooler_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out);
/* BertOnlyMLMHead whose decoder's weight is word_weight (the word embedding, registered here
 * under a second name) and whose decoder's bias is predictions.bias. */
int fsdp__bert_mlm_head_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg,
                               fsdp_tensor_t *word_weight, fsdp_module_t **out);

/* Checks input_ids (and, when not NULL, a companion (B, S) tensor `other` named other_name):
 * (B, S) int64 or i32 with 1 <= S <= max_position_embeddings; FSDP_EINVAL naming the module,
 * the argument and its shape otherwise. */
int fsdp__bert_check_ids(fsdp_module_t *m, const fsdp_bert_config_t *cfg, fsdp_tensor_t *ids,
                         fsdp_tensor_t *other, const char *other_name, bool other_is_ids);

#endif /* FSDP_NN_BERT_IMPL_H */
