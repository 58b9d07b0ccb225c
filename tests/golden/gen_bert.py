#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_bert.py: writes tests/golden/bert.bin, PyTorch's answers for a tiny BERT masked-LM model.

Usage: python3 tests/golden/gen_bert.py --out tests/golden   (a Python whose `import torch`
works; on the build machine that is Debian's /usr/bin/python3 with python3-torch 1.13, CPU).

There is no `transformers` package on the build machines, so the model is Hugging Face's
BertForMaskedLM (transformers 4.x, modeling_bert.py, eager attention, hidden_act "gelu",
absolute positions) rewritten in plain torch: the same classes, the same children under the
same names (so state_dict() has Hugging Face's keys, the tied decoder weight and decoder bias
included) and the same arithmetic in the same order. One deliberate addition: the BertModel
keeps its pooler (Hugging Face's BertForMaskedLM builds BertModel(add_pooling_layer=False)),
because libfsdp's fsdp_bert_create() is tested with the pooler on.

Records, under "bert/":

  p/<field>              the configuration (i64 or f64 scalars, libfsdp's fsdp_bert_config_t)
  init/<key>             every entry of the state_dict (aliases of tied tensors included)
  input/input_ids        (B, S) int64, with [PAD] (pad_token_id) at padded positions and once
                         inside a sequence (its embedding row gets no gradient there)
  input/token_type_ids   (B, S) int64, segments 0 and 1
  input/attention_mask   (B, S) int64, 1 = attend, 0 = padding (two sequences padded)
  input/labels           (B, S) int64 masked-LM targets, -100 where ignored
  input/gpooled          (B, H) f32, the upstream gradient of the pooled output
  sequence_output        (B, S, H) the encoder's output
  logits, pooled         (B, S, V) and (B, H)
  loss                   masked-LM cross entropy (mean over the labels that are not -100)
  objective              loss + sum(pooled * gpooled): what backward differentiates, so that
                         the pooler gets a gradient too
  grad/<fqn>             the gradient of `objective` for every named_parameters() entry (a tied
                         tensor once, under its first name)

The weights are not Hugging Face's initialisation (normal(0, 0.02), zero biases, LayerNorm ones
and zeros): with weights that small every gradient would be far below the test's atol of 1e-5
and the comparison would prove nothing. They are drawn with larger spreads (matrices and
embeddings normal(0, 0.2), biases normal(0, 0.1), LayerNorm weights normal(1, 0.1)) from a fixed
seed, and the padding row of the word embeddings is zeroed as Hugging Face does. Dropout is 0
(the model is in eval mode). The output is deterministic: one thread, fixed seeds, no
timestamps.
"""

import argparse
import math
import os
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.dont_write_bytecode = True  # no __pycache__ next to the committed files
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen import Writer  # noqa: E402  (the record writer of ops.bin)

CFG = {
    "vocab_size": 50,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 16,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "pad_token_id": 0,
    "initializer_range": 0.02,
}
BATCH, SEQ = 3, 10
IGNORE_INDEX = -100


# ---- Hugging Face's BERT, in plain torch ------------------------------------------------------

class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"],
                                            padding_idx=c["pad_token_id"])
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])
        self.register_buffer("position_ids",
                             torch.arange(c["max_position_embeddings"]).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros((1, c["max_position_embeddings"]),
                                                           dtype=torch.long), persistent=False)

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :seq_length].expand(input_ids.shape[0],
                                                                         seq_length)
        inputs_embeds = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings
        embeddings += self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_attention_heads = c["num_attention_heads"]
        self.attention_head_size = c["hidden_size"] // c["num_attention_heads"]
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(c["hidden_size"], self.all_head_size)
        self.key = nn.Linear(c["hidden_size"], self.all_head_size)
        self.value = nn.Linear(c["hidden_size"], self.all_head_size)
        self.dropout = nn.Dropout(c["attention_probs_dropout_prob"])

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        mixed_query_layer = self.query(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(mixed_query_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class BertSelfOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c)

    def forward(self, hidden_states, attention_mask):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))  # hidden_act "gelu": the exact erf GELU


class BertOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["intermediate_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertOutput(c)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(c) for _ in range(c["num_hidden_layers"])])

    def forward(self, hidden_states, attention_mask):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class BertPooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape)
        embedding_output = self.embeddings(input_ids, token_type_ids)
        dtype = embedding_output.dtype
        extended = attention_mask[:, None, None, :].to(dtype=dtype)
        extended = (1.0 - extended) * torch.finfo(dtype).min
        sequence_output = self.encoder(embedding_output, extended)
        return sequence_output, self.pooler(sequence_output)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, hidden_states):
        return self.LayerNorm(F.gelu(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.decoder = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))
        self.decoder.bias = self.bias

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BertForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.bert = BertModel(c)
        self.cls = BertOnlyMLMHead(c)
        # PreTrainedModel.tie_weights(): the decoder's weight is the word embedding.
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        sequence_output, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.cls(sequence_output)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                                   ignore_index=IGNORE_INDEX)
        return sequence_output, logits, pooled, loss


def init_weights(model, c):
    """Larger than Hugging Face's spreads (see the module docstring), in parameter order."""
    torch.manual_seed(zlib.crc32(b"bert/init"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.2)
            elif "LayerNorm.weight" in name:
                nn.init.normal_(p, 1.0, 0.1)
            else:
                nn.init.normal_(p, 0.0, 0.1)
        model.bert.embeddings.word_embeddings.weight[c["pad_token_id"]].zero_()


def make_inputs(c):
    torch.manual_seed(zlib.crc32(b"bert/input"))
    pad = c["pad_token_id"]
    ids = torch.randint(1, c["vocab_size"], (BATCH, SEQ), dtype=torch.long)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    mask[2, SEQ - 6:] = 0
    ids[mask == 0] = pad
    ids[0, 5] = pad  # a [PAD] token that is attended: its embedding row still gets no gradient
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    types[mask == 0] = 0
    labels = torch.randint(0, c["vocab_size"], (BATCH, SEQ), dtype=torch.long)
    keep = torch.rand(BATCH, SEQ) < 0.5
    keep[0, 0] = True
    labels[~keep | (mask == 0)] = IGNORE_INDEX
    gpooled = torch.randn(BATCH, c["hidden_size"])
    return ids, types, mask, labels, gpooled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory that receives bert.bin")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    W = Writer()
    for k, v in CFG.items():
        (W.param_f if isinstance(v, float) else W.param_i)("bert", k, v)

    model = BertForMaskedLM(CFG)
    init_weights(model, CFG)
    model.eval()
    for k, v in model.state_dict().items():
        W.add("bert/init/" + k, v)
    ids, types, mask, labels, gpooled = make_inputs(CFG)
    for k, t in (("input_ids", ids), ("token_type_ids", types), ("attention_mask", mask),
                 ("labels", labels), ("gpooled", gpooled)):
        W.add("bert/input/" + k, t)

    seq, logits, pooled, loss = model(ids, mask, types, labels)
    objective = loss + (pooled * gpooled).sum()
    model.zero_grad(set_to_none=True)
    objective.backward()
    W.add("bert/sequence_output", seq)
    W.add("bert/logits", logits)
    W.add("bert/pooled", pooled)
    W.add("bert/loss", loss)
    W.add("bert/objective", objective)
    gmin = math.inf
    for k, p in model.named_parameters():
        W.add("bert/grad/" + k, p.grad)
        gmin = min(gmin, float(p.grad.abs().max()))

    blob = W.serialize()
    path = os.path.join(args.out, "bert.bin")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    nparams = sum(1 for _ in model.named_parameters())
    print("  bert: logits %s loss %.6g objective %.6g, state_dict %d, params %d (%d elements), "
          "smallest per-parameter max |grad| %.3g"
          % (list(logits.shape), float(loss), float(objective), len(model.state_dict()), nparams,
             sum(p.numel() for p in model.parameters()), gmin))
    print("%s: %d records, %d bytes, crc32 %08x (torch %s)"
          % (path, len(W.recs), len(blob), zlib.crc32(blob), torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
