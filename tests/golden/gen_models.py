#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_models.py: writes tests/golden/models.bin, PyTorch's answers for whole test models.

Usage: python3 tests/golden/gen_models.py --out tests/golden   (a Python whose `import torch`
works; on the build machine that is Debian's /usr/bin/python3 with python3-torch 1.13, CPU).

For each model (the seed test models of tests/models/models.h, built here exactly as PyTorch's
common_fsdp.py and the FSDP tests build them, plus a tiny GPT with libfsdp's parameter names and
math) the file holds, under the model's name:

  <m>/init/<key>          every entry of the initial state_dict (parameters, buffers, and both
                          names of a tied weight)
  <m>/input/<name>        the input(s) of the forward
  <m>/out, <m>/loss       the forward output and the loss
  <m>/grad/<fqn>          the gradient of every parameter (named_parameters(), a tied weight once)
  <m>/sgd/loss<k>         for k = 1..3: the loss of step k of SGD(lr 0.01, momentum 0.9), started
  <m>/sgd/step<k>/<fqn>   from the initial weights, and every parameter after that step
  <m>/adamw/loss<k>       the same for AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8,
  <m>/adamw/step<k>/<fqn> weight_decay 0.01)
  <m>/adamw/gradclass<k>/<fqn>  u8, for parameters whose step-k gradient has elements that are
                          exactly 0 (1) or tiny (2: record_grad_classes), else 0
  sgd/p/<hp>, adamw/p/<hp>  the optimizer hyper-parameters (f64 scalars)

Each step is zero_grad(), forward on the same input, loss, backward, step(). The models run in
eval mode where upstream's deterministic mode does (TransformerWithSharedParams), so dropout is
off. The format is the one of ops.bin (README.md, tests/golden.h). The output is deterministic:
one thread, fixed seeds, a fixed order, no timestamps.
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

W = Writer()
SUMMARY = []

SGD_HP = {"lr": 0.01, "momentum": 0.9}
ADAMW_HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
STEPS = 3
GRAD_TINY = 1e-7


# ---- the models (copies of upstream's, without the process group) ---------------------------

class NestedWrappedModule(nn.Module):
    """common_fsdp.NestedWrappedModule, unwrapped, deterministic (rank 0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def forward(self, x):
        return self.module(x)


class MixtureOfExperts(NestedWrappedModule):
    """common_fsdp.MixtureOfExperts, unwrapped, deterministic, rank 0 (expert seeded 42)."""

    def __init__(self, rank=0):
        super().__init__()
        torch.manual_seed(42 + rank)
        d_expert, d_shared, d_input = 23, 12, 8
        expert = nn.Linear(d_expert, d_shared)
        for p in expert.parameters():
            p.expert = True
        torch.manual_seed(0)
        shared = nn.Linear(d_shared, d_expert)
        self.module = nn.Sequential(nn.Linear(d_input, d_shared), shared, expert,
                                    nn.Linear(d_shared, d_input))


class TransformerWithSharedParams(nn.Module):
    """common_fsdp.TransformerWithSharedParams(add_bn=True, deterministic=True)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        d_vocab, d_model = 23, 16
        self.embed_tokens = nn.Embedding(d_vocab, d_model)
        self.transformer = nn.Transformer(d_model=d_model, num_encoder_layers=2,
                                          num_decoder_layers=2, dim_feedforward=8, dropout=0.1)
        self.output_proj = nn.Linear(d_model, d_vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((d_model,)))
        self.register_buffer("long_buffer", torch.zeros_like(self.vocab_bias, dtype=torch.long))
        self.bs = 2
        self.bn = nn.BatchNorm1d(self.bs)
        self.eval()

    def forward(self, src_ids, tgt_ids):
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.embed_tokens(tgt_ids)
        tgt = self.bn(tgt)
        x = self.transformer(src, tgt)
        return self.output_proj(x)


class WritebackModel(nn.Module):
    """test_fsdp_use_orig_params.TestFSDPUseOrigParamsWriteback.Model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, bias=True)
        self.lin2 = nn.Linear(5, 7, bias=True)

    def forward(self, x):
        return self.lin2(F.relu(self.lin1(x)))


# A GPT with the parameter names and the math of libfsdp's fsdp_gpt_create (src/nn/gpt.c):
# pre-norm blocks, learned positions, causal attention with q scaled by 1/sqrt(head dim), the
# tanh GELU, logits = ln_f(x) wte^T, mean cross-entropy ignoring targets equal to -1.
GPT_CFG = {"vocab": 64, "max_seq": 16, "n_layer": 2, "n_head": 4, "d_model": 16, "d_ff": 64,
           "eps": 1e-5, "init_std": 0.02}


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, hd).transpose(1, 2)
        k = k.view(b, t, self.n_head, hd).transpose(1, 2)
        v = v.view(b, t, self.n_head, hd).transpose(1, 2)
        att = torch.matmul(q / math.sqrt(hd), k.transpose(-2, -1))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = F.softmax(att.masked_fill(mask, -math.inf), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.c_fc = nn.Linear(d, d_ff)
        self.c_proj = nn.Linear(d_ff, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.ln_1 = nn.LayerNorm(d, eps=cfg["eps"])
        self.attn = CausalSelfAttention(d, cfg["n_head"])
        self.ln_2 = nn.LayerNorm(d, eps=cfg["eps"])
        self.mlp = MLP(d, cfg["d_ff"])

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.wte = nn.Embedding(cfg["vocab"], d)
        self.wpe = nn.Embedding(cfg["max_seq"], d)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layer"])])
        self.ln_f = nn.LayerNorm(d, eps=cfg["eps"])
        torch.manual_seed(zlib.crc32(b"gpt/init"))
        std = cfg["init_std"]
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * cfg["n_layer"]))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            elif "ln" in name and name.endswith("weight"):
                # libfsdp initialises LayerNorm weights to ones and biases to zeros; perturbing
                # them (and the biases below) makes a swapped or ignored parameter visible.
                nn.init.normal_(p, 1.0, 0.05)
            else:
                nn.init.normal_(p, 0.0, 0.05)

    def forward(self, idx):
        b, t = idx.shape
        pos = torch.arange(t, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)


# ---- running ---------------------------------------------------------------------------------

def record_case(name, build, make_inputs, run, loss_fn):
    """build() -> model; make_inputs(model) -> [(key, tensor)]; run(model, inputs) -> output;
    loss_fn(inputs, output) -> scalar."""
    model = build()
    inputs = make_inputs(model)
    init_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in init_sd.items():
        W.add(name + "/init/" + k, v)
    for k, t in inputs:
        W.add(name + "/input/" + k, t)
    ins = [t for _, t in inputs]
    out = run(model, ins)
    loss = loss_fn(ins, out)
    model.zero_grad(set_to_none=True)
    loss.backward()
    W.add(name + "/out", out)
    W.add(name + "/loss", loss)
    nparams = 0
    for k, p in model.named_parameters():
        W.add(name + "/grad/" + k, p.grad)
        nparams += 1
    for opt_name, make_opt in (
            ("sgd", lambda ps: torch.optim.SGD(ps, lr=SGD_HP["lr"], momentum=SGD_HP["momentum"])),
            ("adamw", lambda ps: torch.optim.AdamW(
                ps, lr=ADAMW_HP["lr"], betas=(ADAMW_HP["beta1"], ADAMW_HP["beta2"]),
                eps=ADAMW_HP["eps"], weight_decay=ADAMW_HP["weight_decay"]))):
        m = build()
        m.load_state_dict(init_sd)
        opt = make_opt(m.parameters())
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss = loss_fn(ins, run(m, ins))
            loss.backward()
            if opt_name == "adamw":
                record_grad_classes(name, step, m)
            opt.step()
            W.add("%s/%s/loss%d" % (name, opt_name, step), loss)
            for k, p in m.named_parameters():
                W.add("%s/%s/step%d/%s" % (name, opt_name, step, k), p.detach().clone())
    SUMMARY.append((name, tuple(out.shape), float(loss), len(init_sd), nparams,
                    sum(p.numel() for p in model.parameters())))


def record_grad_classes(name, step, model):
    """For AdamW: which gradient elements of this step are an exact 0 (1) or tiny but not 0 (2),
    else 0; u8, only for parameters with such elements. Tiny: below GRAD_TINY in magnitude and
    below GRAD_TINY times the largest magnitude in the parameter's gradient (rounding noise of a
    sum is relative to its terms, so an analytic 0 comes out ~1e-8 of its neighbours).

    Adam turns a tiny gradient into an update of about lr whatever its size, so where the exact
    gradient is 0 (the key part of an attention's input bias) the two libraries' rounding noise
    decides the update; t_golden_models compares those elements loosely (see ADAM_NOISE there)."""
    for k, p in model.named_parameters():
        g = p.grad
        a = g.abs()
        tiny = (a < GRAD_TINY) & (a < GRAD_TINY * a.max())
        cls = torch.where(g == 0, 1, torch.where(tiny, 2, 0)).to(torch.uint8)
        if bool(cls.any()):
            W.add("%s/adamw/gradclass%d/%s" % (name, step, k), cls)


def sum_loss(ins, out):
    return out.sum()


def forward1(model, ins):
    return model(ins[0])


def nested_input(model):
    torch.manual_seed(1)  # get_input: 1 + rank, rank 0
    return [("x", torch.rand(4, 8))]


def transformer_input(model):
    torch.manual_seed(1)
    return [("src", torch.arange(12).view(6, 2)), ("tgt", torch.arange(8).view(4, 2))]


def transformer_loss(ins, out):
    return F.cross_entropy(out.view(-1, out.size(-1)), ins[1].view(-1), reduction="sum")


def writeback_input(model):
    # Upstream draws the input right after building the model (seeded 42), without reseeding.
    torch.manual_seed(42)
    WritebackModel()
    return [("x", torch.randn((2, 5)))]


def gpt_input(model):
    torch.manual_seed(zlib.crc32(b"gpt/input"))
    tokens = torch.randint(0, GPT_CFG["vocab"], (2, 8), dtype=torch.long)
    targets = torch.randint(0, GPT_CFG["vocab"], (2, 8), dtype=torch.long)
    targets[0, 3] = -1
    targets[1, 7] = -1
    return [("tokens", tokens), ("targets", targets)]


def gpt_loss(ins, out):
    return F.cross_entropy(out.view(-1, out.size(-1)), ins[1].view(-1), ignore_index=-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory that receives models.bin")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for k, v in SGD_HP.items():
        W.param_f("sgd", k, v)
    for k, v in ADAMW_HP.items():
        W.param_f("adamw", k, v)
    for k, v in GPT_CFG.items():
        (W.param_f if isinstance(v, float) else W.param_i)("gpt", k, v)
    record_case("nested", NestedWrappedModule, nested_input, forward1, sum_loss)
    record_case("moe", MixtureOfExperts, nested_input, forward1, sum_loss)
    record_case("transformer", TransformerWithSharedParams, transformer_input,
                lambda m, ins: m(ins[0], ins[1]), transformer_loss)
    record_case("writeback", WritebackModel, writeback_input, forward1, sum_loss)
    record_case("gpt", lambda: GPT(GPT_CFG), gpt_input, forward1, gpt_loss)
    blob = W.serialize()
    path = os.path.join(args.out, "models.bin")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    for name, shape, loss, nsd, np_, numel in SUMMARY:
        print("  %-12s out %-14s loss %-12.6g state_dict %3d  params %3d (%d elements)"
              % (name, list(shape), loss, nsd, np_, numel))
    print("%s: %d records, %d bytes, crc32 %08x (torch %s)"
          % (path, len(W.recs), len(blob), zlib.crc32(blob), torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
