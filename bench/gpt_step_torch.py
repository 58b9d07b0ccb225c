#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gpt_step_torch.py: the PyTorch twin of bench_gpt_step.

Times one training step (zero_grad with set_to_none, forward, mean cross-entropy, backward,
AdamW step) of the same GPT-2 style model as libfsdp's fsdp_gpt_create(): pre-LayerNorm blocks,
learned position embeddings, causal self-attention with one (3d, d) product for query, key and
value, a 4d MLP with the tanh GELU, a final LayerNorm and a head tied to the token embedding;
f32, no dropout, the same initialisation rule (normal(0, 0.02), c_proj weights
0.02 / sqrt(2 n_layer), zero biases). The values differ from libfsdp's (another generator), the
shapes, the work and the optimizer do not: AdamW runs in the two parameter groups of libfsdp's
GPT recipe (include/fsdp/gpt_recipe.h), weight decay on the matrices but the position table
wpe.weight, none on vectors (adamw_groups, which the other twins use too).

The batch is the same tokens as bench_gpt_step.c draws (splitmix64 of the seed), the options
have the same names and defaults, and the output has the same format, so bench/gpt_step.sh can
read both. Run with --help for the options.
"""

import argparse
import math
import os
import sys
import time

MASK64 = (1 << 64) - 1


def splitmix64(state):
    """One step of splitmix64: returns (new state, output), as bench_gpt_step.c computes it."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def make_batch(batch, seq, vocab, seed):
    """B sequences of T + 1 tokens; inputs the first T of each, targets the last T."""
    state = seed & MASK64
    inputs, targets = [], []
    for _ in range(batch):
        state, w = splitmix64(state)
        prev = w % vocab
        row_in, row_tg = [], []
        for _ in range(seq):
            state, w = splitmix64(state)
            nxt = w % vocab
            row_in.append(prev)
            row_tg.append(nxt)
            prev = nxt
        inputs.append(row_in)
        targets.append(row_tg)
    return inputs, targets


# libfsdp's GPT recipe (fsdp_gpt_recipe_decays, fsdp_gpt_recipe_create_adamw): AdamW decays the
# parameters of two or more dimensions except the position table; the header lines say so.
DECAY_NOTE = "on matrices but wpe, not on vectors"

# What FSDP1 puts in front of the names of a wrapped module's parameters.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def decays(name, ndim):
    """Whether the recipe's AdamW decays parameter `name` of `ndim` dimensions as registered."""
    return ndim >= 2 and name != "wpe.weight"


def recipe_decay(model):
    """{name: decays} for every parameter of the unwrapped model, decided on the registered
    shapes (FSDP1 flattens them when it wraps)."""
    return {n: decays(n, p.dim()) for n, p in model.named_parameters()}


def adamw_groups(named_params, decay, wd):
    """The recipe's two AdamW parameter groups over named_params, (name, parameter) pairs of the
    model, unwrapped or wrapped (FSDP1's wrapper prefixes are dropped from the names): weight
    decay wd for the names that `decay` (recipe_decay of the unwrapped model) says decay, 0 for
    the rest. A name it does not know is an error, so a wrapper that renames parameters cannot
    silently change the groups."""
    groups = ([], [])
    for name, p in named_params:
        for w in WRAPPER_PREFIXES:
            name = name.replace(w, "")
        if name not in decay:
            raise KeyError("adamw_groups: parameter %r is not one of the model's" % name)
        groups[0 if decay[name] else 1].append(p)
    return [{"params": groups[0], "weight_decay": wd},
            {"params": groups[1], "weight_decay": 0.0}]


def default_threads():
    env = os.environ.get("FSDP_NUM_THREADS", "")
    try:
        v = int(env)
        if 0 < v <= 4096:
            return v
    except ValueError:
        pass
    return os.cpu_count() or 1


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch twin of bench_gpt_step")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 1 warm-up and 2 timed steps (later options override)")
    # --quick sets defaults that explicit options override, whatever their order, as in C
    # (where options after --quick override it).
    if "--quick" in argv:
        p.set_defaults(layers=2, d=64, heads=4, seq=32, batch=2, vocab=256, steps=2, warmup=1)
    a = p.parse_args(argv)
    if a.d % a.heads != 0:
        p.error("--heads %d must divide --d %d" % (a.heads, a.d))
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --threads >= 1")
    return a


def build(torch, a):
    nn = torch.nn
    F = torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)
            self.d, self.h = d, h

        def forward(self, x, mask):
            b, t, d = x.shape
            hd = d // self.h
            qkv = self.c_attn(x).view(b, t, 3, self.h, hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, T, hd) each
            # As libfsdp's fsdp_attention (and PyTorch's MultiheadAttention): q is scaled
            # before the product, the mask is added, softmax, then the product with v.
            att = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-2, -1)) + mask
            y = torch.matmul(F.softmax(att, dim=-1), v)
            y = y.transpose(1, 2).reshape(b, t, d)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self, d, dff):
            super().__init__()
            self.c_fc = nn.Linear(d, dff)
            self.c_proj = nn.Linear(dff, d)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = CausalSelfAttention(d, h)
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = MLP(d, 4 * d)

        def forward(self, x, mask):
            x = x + self.attn(self.ln_1(x), mask)
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.d)
            self.wpe = nn.Embedding(a.seq, a.d)
            self.h = nn.ModuleList([Block(a.d, a.heads) for _ in range(a.layers)])
            self.ln_f = nn.LayerNorm(a.d)
            self.register_buffer("pos", torch.arange(a.seq), persistent=False)
            self.register_buffer(
                "mask", torch.triu(torch.full((a.seq, a.seq), float("-inf")), diagonal=1),
                persistent=False)
            proj_std = 0.02 / math.sqrt(2.0 * a.layers)
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, 0.0, proj_std if name.endswith("c_proj.weight") else 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(self.pos[:t])
            mask = self.mask[:t, :t]
            for blk in self.h:
                x = blk(x, mask)
            return F.linear(self.ln_f(x), self.wte.weight)  # the tied head

    return GPT()


def main(argv):
    a = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpt_step_torch.py: PyTorch is not installed for %s" % sys.executable,
              file=sys.stderr)
        return 3
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = build(torch, a)
    model.train()
    betas = (0.9, 0.95)
    eps, wd = 1e-8, 0.1
    opt = torch.optim.AdamW(adamw_groups(model.named_parameters(), recipe_decay(model), wd),
                            lr=a.lr, betas=betas, eps=eps)
    inputs, targets = make_batch(a.batch, a.seq, a.vocab, a.seed)
    tokens = torch.tensor(inputs, dtype=torch.int64)
    tgt = torch.tensor(targets, dtype=torch.int64)
    nparams = sum(p.numel() for p in model.parameters())

    print("# gpt_step_torch: PyTorch %s, GPT %d layers, d %d, %d heads, seq %d, batch %d, "
          "vocab %d, f32, %d threads" % (torch.__version__, a.layers, a.d, a.heads, a.seq,
                                         a.batch, a.vocab, torch.get_num_threads()))
    print("# params %d" % nparams)
    print("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (%s); seed %d; %d warm-up + %d "
          "timed steps" % (a.lr, betas[0], betas[1], eps, wd, DECAY_NOTE, a.seed, a.warmup,
                           a.steps))
    sys.stdout.flush()

    names = ["zero_grad", "forward+loss", "backward", "optimizer"]
    phases = [[] for _ in names]
    steps = []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, a.vocab), tgt.view(-1), ignore_index=-1)
        lv = loss.item()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        del logits, loss
        timed = s >= a.warmup
        if timed:
            for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[i].append(dt)
            steps.append(t4 - t0)
        print("step %3d%s loss %.6f  ms %.1f" % (s + 1, "        " if timed else " (warmup)", lv,
                                                 (t4 - t0) * 1e3))
        sys.stdout.flush()
        if not math.isfinite(lv):
            print("gpt_step_torch.py: the loss is not finite", file=sys.stderr)
            return 1

    def median(v):
        v = sorted(v)
        n = len(v)
        return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])

    print("phases median ms: " + " ".join("%s %.1f" % (n, median(p) * 1e3)
                                          for n, p in zip(names, phases)))
    med = median(steps)
    print("ms/step median %.2f (min %.2f, max %.2f) over %d steps"
          % (med * 1e3, min(steps) * 1e3, max(steps) * 1e3, a.steps))
    print("tokens/s %.0f" % (a.batch * a.seq / med))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
