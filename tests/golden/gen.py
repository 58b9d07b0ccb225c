#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen.py: writes tests/golden/ops.bin, PyTorch's answers for every libfsdp tensor operation.

Usage: python3 tests/golden/gen.py --out tests/golden   (a Python whose `import torch` works;
on the build machine that is Debian's /usr/bin/python3 with python3-torch 1.13, CPU).

Each case is named "<op>/<variant>" and stores, under that prefix:
  <input>            the inputs, seeded by torch.manual_seed(crc32(case name)), float32 unless the
                     variant ends in "_f64"
  p/<param>          the non-tensor arguments (i64 or f64 scalars or vectors), so that the C test
                     repeats the call exactly
  out, out<i>        the forward output(s); extra results such as running_mean_out
  gout, gout<i>      a seeded upstream gradient of each output's shape
  grad/<input>       torch.autograd.grad(sum(out * gout), input) for each differentiable input

The file format is described in README.md next to this script and in tests/golden.h. The output
is deterministic: one thread, fixed seeds, cases in a fixed order, no timestamps.
"""

import argparse
import math
import os
import struct
import sys
import zlib

import torch
import torch.nn.functional as F

MAGIC = b"FSDPGLD1"
DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.bool: 7,
}
# libfsdp's fsdp_reduction_t.
REDUCTION = {"mean": 0, "sum": 1, "none": 2}


class Writer:
    """Collects named records in insertion order and serializes them."""

    def __init__(self):
        self.recs = []
        self.names = set()

    def add(self, name, t):
        if name in self.names:
            raise ValueError("duplicate record " + name)
        t = t.detach().contiguous().cpu()
        if t.dtype not in DTYPES:
            raise ValueError("%s: unsupported dtype %s" % (name, t.dtype))
        if t.dim() > 8:
            raise ValueError("%s: more than 8 dimensions" % name)
        self.names.add(name)
        self.recs.append((name, t))

    def param_i(self, prefix, key, v):
        self.add(prefix + "/p/" + key, torch.tensor(v, dtype=torch.int64))

    def param_f(self, prefix, key, v):
        self.add(prefix + "/p/" + key, torch.tensor(v, dtype=torch.float64))

    def serialize(self):
        parts = [MAGIC, struct.pack("<I", len(self.recs))]
        for name, t in self.recs:
            nb = name.encode("utf-8")
            parts.append(struct.pack("<H", len(nb)))
            parts.append(nb)
            parts.append(struct.pack("<BB", DTYPES[t.dtype], t.dim()))
            parts.append(struct.pack("<%dq" % t.dim(), *t.shape))
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            arr = t.numpy()
            parts.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        return b"".join(parts)


W = Writer()
SUMMARY = []


def seed(name):
    torch.manual_seed(zlib.crc32(name.encode("utf-8")))


def dtype_of(name):
    return torch.float64 if name.endswith("_f64") else torch.float32


def emit(name, inputs, diff, forward, params=None, extra=None):
    """Runs one case and writes its records.

    inputs:  list of (key, tensor) in call order (already seeded by the caller)
    diff:    keys of the differentiable inputs
    forward: function of the inputs dict returning a tensor or a list of tensors
    params:  list of (key, value, "i" or "f")
    extra:   function of the inputs dict (after forward) returning [(key, tensor)] to record
    """
    d = {}
    for k, t in inputs:
        W.add(name + "/" + k, t)
        d[k] = t.detach().clone().requires_grad_(k in diff)
    for k, v, kind in params or []:
        (W.param_i if kind == "i" else W.param_f)(name, k, v)
    res = forward(d)
    outs = res if isinstance(res, (list, tuple)) else [res]
    multi = isinstance(res, (list, tuple))
    gouts = [torch.randn(o.shape, dtype=o.dtype) for o in outs]
    for i, (o, g) in enumerate(zip(outs, gouts)):
        suffix = str(i) if multi else ""
        W.add(name + "/out" + suffix, o)
        W.add(name + "/gout" + suffix, g)
    for k, t in (extra(d) if extra else []):
        W.add(name + "/" + k, t)
    if diff:
        loss = sum((o * g).sum() for o, g in zip(outs, gouts))
        grads = torch.autograd.grad(loss, [d[k] for k in diff])
        for k, g in zip(diff, grads):
            W.add(name + "/grad/" + k, g)
    SUMMARY.append((name, [tuple(o.shape) for o in outs], list(diff)))


# ---- cases ---------------------------------------------------------------------------------

def binary_cases():
    ops = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
    shapes = {"bcast_last": ((2, 3, 4), (4,)), "bcast_mid": ((2, 1, 4), (3, 1)),
              "same_f64": ((3, 4), (3, 4))}
    for op, fn in ops.items():
        for variant, (sa, sb) in shapes.items():
            name = op + "/" + variant
            dt = dtype_of(name)
            seed(name)
            a = torch.randn(sa, dtype=dt)
            if op == "div":
                # Denominators away from zero: magnitude in [0.5, 1.5), random sign.
                mag = torch.rand(sb, dtype=dt) + 0.5
                b = torch.where(torch.rand(sb) < 0.5, -mag, mag)
            else:
                b = torch.randn(sb, dtype=dt)
            emit(name, [("a", a), ("b", b)], ["a", "b"], lambda d, fn=fn: fn(d["a"], d["b"]))


def scalar_cases():
    for name, alpha in (("scale/neg1.5", -1.5), ("scale/0.25_f64", 0.25)):
        seed(name)
        x = torch.randn(3, 4, dtype=dtype_of(name))
        emit(name, [("x", x)], ["x"], lambda d, a=alpha: d["x"] * a, [("alpha", alpha, "f")])
    for name, alpha in (("add_scalar/0.75", 0.75), ("add_scalar/neg2_f64", -2.0)):
        seed(name)
        x = torch.randn(3, 4, dtype=dtype_of(name))
        emit(name, [("x", x)], ["x"], lambda d, a=alpha: d["x"] + a, [("alpha", alpha, "f")])


def unary_cases():
    def relu_input(dt):
        x = torch.randn(3, 5, dtype=dt) * 2
        x[0, 0] = 0.0  # PyTorch: relu'(0) = 0
        x[1, 2] = -0.0
        return x

    cases = [
        ("relu/basic", relu_input, lambda d: F.relu(d["x"]), []),
        ("gelu/erf", lambda dt: torch.randn(3, 5, dtype=dt) * 2,
         lambda d: F.gelu(d["x"]), [("approx", 0, "i")]),
        ("gelu/tanh", lambda dt: torch.randn(3, 5, dtype=dt) * 2,
         lambda d: F.gelu(d["x"], approximate="tanh"), [("approx", 1, "i")]),
        ("gelu/erf_f64", lambda dt: torch.randn(3, 5, dtype=dt) * 2,
         lambda d: F.gelu(d["x"]), [("approx", 0, "i")]),
        ("gelu/tanh_f64", lambda dt: torch.randn(3, 5, dtype=dt) * 2,
         lambda d: F.gelu(d["x"], approximate="tanh"), [("approx", 1, "i")]),
        ("tanh/basic", lambda dt: torch.randn(3, 5, dtype=dt) * 2, lambda d: torch.tanh(d["x"]),
         []),
        ("sigmoid/basic", lambda dt: torch.randn(3, 5, dtype=dt) * 3,
         lambda d: torch.sigmoid(d["x"]), []),
        ("exp/basic", lambda dt: torch.randn(3, 5, dtype=dt), lambda d: torch.exp(d["x"]), []),
        ("log/basic", lambda dt: torch.rand(3, 5, dtype=dt) * 3 + 0.1,
         lambda d: torch.log(d["x"]), []),
        ("tanh/f64", lambda dt: torch.randn(3, 5, dtype=dt) * 2, lambda d: torch.tanh(d["x"]),
         []),
        ("log/f64", lambda dt: torch.rand(3, 5, dtype=dt) * 3 + 0.1,
         lambda d: torch.log(d["x"]), []),
    ]
    for name, make, fwd, params in cases:
        seed(name)
        emit(name, [("x", make(dtype_of(name)))], ["x"], fwd, params)


def reduce_cases():
    variants = [("d1", [1], False), ("d1_keep", [1], True), ("d0_2", [0, 2], False),
                ("d0_2_keep", [0, 2], True), ("dneg1", [-1], False), ("all", [], False),
                ("all_keep", [], True)]
    for op in ("sum", "mean"):
        for variant, dims, keep in variants:
            name = op + "/" + variant
            seed(name)
            x = torch.randn(2, 3, 4)
            # An empty dims list means every dimension (libfsdp's ndims == 0).
            tdims = dims if dims else [0, 1, 2]

            def fwd(d, op=op, tdims=tdims, keep=keep):
                return getattr(torch, op)(d["x"], dim=tdims, keepdim=keep)

            emit(name, [("x", x)], ["x"], fwd, [("dims", dims, "i"), ("keepdim", int(keep), "i")])


def softmax_cases():
    for op, fn in (("softmax", F.softmax), ("log_softmax", F.log_softmax)):
        for variant, shape, dim in (("dneg1", (3, 5), -1), ("d0", (3, 5), 0),
                                    ("d1_3d", (2, 3, 4), 1), ("dneg1_f64", (3, 5), -1)):
            name = op + "/" + variant
            seed(name)
            x = torch.randn(shape, dtype=dtype_of(name)) * 2
            emit(name, [("x", x)], ["x"], lambda d, fn=fn, dim=dim: fn(d["x"], dim=dim),
                 [("dim", dim, "i")])


def matmul_cases():
    for variant, sa, sb in (("2d", (3, 4), (4, 5)), ("3d_2d", (2, 3, 4), (4, 5)),
                            ("batched", (2, 3, 4), (2, 4, 5)), ("2d_f64", (3, 4), (4, 5))):
        name = "matmul/" + variant
        seed(name)
        dt = dtype_of(name)
        a, b = torch.randn(sa, dtype=dt), torch.randn(sb, dtype=dt)
        emit(name, [("a", a), ("b", b)], ["a", "b"], lambda d: torch.matmul(d["a"], d["b"]))


def linear_cases():
    for variant, sx, bias in (("bias", (2, 3, 4), True), ("nobias", (3, 4), False),
                              ("bias_2d_f64", (3, 4), True)):
        name = "linear/" + variant
        seed(name)
        dt = dtype_of(name)
        x = torch.randn(sx, dtype=dt)
        w = torch.randn(5, sx[-1], dtype=dt) * 0.5
        ins = [("x", x), ("w", w)]
        if bias:
            ins.append(("b", torch.randn(5, dtype=dt) * 0.1))
        emit(name, ins, [k for k, _ in ins],
             lambda d: F.linear(d["x"], d["w"], d.get("b")))


def layer_norm_cases():
    for variant, shape, nd, affine in (("last1", (2, 3, 8), 1, True),
                                       ("last2", (2, 3, 4), 2, True),
                                       ("last1_noaffine", (2, 3, 8), 1, False),
                                       ("last1_f64", (2, 3, 8), 1, True)):
        name = "layer_norm/" + variant
        seed(name)
        dt = dtype_of(name)
        x = torch.randn(shape, dtype=dt) * 1.5 + 0.3
        ns = shape[len(shape) - nd:]
        ins = [("x", x)]
        if affine:
            ins += [("w", 1 + 0.1 * torch.randn(ns, dtype=dt)),
                    ("b", 0.1 * torch.randn(ns, dtype=dt))]
        emit(name, ins, [k for k, _ in ins],
             lambda d, ns=ns: F.layer_norm(d["x"], ns, d.get("w"), d.get("b"), eps=1e-5),
             [("norm_ndim", nd, "i"), ("eps", 1e-5, "f")])


def batch_norm_cases():
    for variant, shape, train in (("train_nc", (6, 4), True), ("train_ncl", (4, 3, 5), True),
                                  ("eval_nc", (6, 4), False), ("eval_ncl", (4, 3, 5), False)):
        name = "batch_norm/" + variant
        seed(name)
        c = shape[1]
        x = torch.randn(shape) * 1.5 + 0.5
        w = 1 + 0.1 * torch.randn(c)
        b = 0.1 * torch.randn(c)
        rm = 0.1 * torch.randn(c)
        rv = torch.rand(c) + 0.5
        state = {}

        def fwd(d, train=train, state=state):
            # F.batch_norm updates the running statistics in place: work on copies, keep them.
            state["rm"], state["rv"] = d["running_mean"].clone(), d["running_var"].clone()
            return F.batch_norm(d["x"], state["rm"], state["rv"], d["w"], d["b"],
                                training=train, momentum=0.1, eps=1e-5)

        emit(name, [("x", x), ("w", w), ("b", b), ("running_mean", rm), ("running_var", rv)],
             ["x", "w", "b"], fwd,
             [("train", int(train), "i"), ("momentum", 0.1, "f"), ("eps", 1e-5, "f")],
             lambda d, state=state: [("running_mean_out", state["rm"]),
                                     ("running_var_out", state["rv"])])


def embedding_cases():
    for variant, pad in (("pad2", 2), ("nopad", -1)):
        name = "embedding/" + variant
        seed(name)
        w = torch.randn(6, 4)
        # Repeated indices (gradients accumulate) and the padding row twice.
        idx = torch.tensor([[1, 2, 5, 1], [0, 2, 3, 1]], dtype=torch.int64)
        pidx = pad if pad >= 0 else None
        emit(name, [("idx", idx), ("w", w)], ["w"],
             lambda d, pidx=pidx: F.embedding(d["idx"], d["w"], padding_idx=pidx),
             [("padding_idx", pad, "i")])


def cross_entropy_cases():
    for variant, red, ls in (("mean", "mean", 0.0), ("sum", "sum", 0.0), ("none", "none", 0.0),
                             ("mean_ls0.1", "mean", 0.1), ("sum_ls0.1", "sum", 0.1),
                             ("none_ls0.1", "none", 0.1), ("mean_f64", "mean", 0.0)):
        name = "cross_entropy/" + variant
        seed(name)
        logits = torch.randn(6, 5, dtype=dtype_of(name)) * 2
        target = torch.randint(0, 5, (6,), dtype=torch.int64)
        target[1] = -100
        target[4] = -100
        emit(name, [("logits", logits), ("target", target)], ["logits"],
             lambda d, red=red, ls=ls: F.cross_entropy(d["logits"], d["target"], ignore_index=-100,
                                                       reduction=red, label_smoothing=ls),
             [("ignore_index", -100, "i"), ("reduction", REDUCTION[red], "i"),
              ("label_smoothing", ls, "f")])
    # Unbatched: logits (C), a 0-d target.
    name = "cross_entropy/single_ls0.1"
    seed(name)
    logits = torch.randn(5) * 2
    target = torch.tensor(3, dtype=torch.int64)
    emit(name, [("logits", logits), ("target", target)], ["logits"],
         lambda d: F.cross_entropy(d["logits"], d["target"], label_smoothing=0.1),
         [("ignore_index", -100, "i"), ("reduction", 0, "i"), ("label_smoothing", 0.1, "f")])


def mse_cases():
    for red in ("mean", "sum", "none"):
        name = "mse_loss/" + red
        seed(name)
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        emit(name, [("a", a), ("b", b)], ["a", "b"],
             lambda d, red=red: F.mse_loss(d["a"], d["b"], reduction=red),
             [("reduction", REDUCTION[red], "i")])


def cat_split_cases():
    name = "cat/d1"
    seed(name)
    xs = [("x0", torch.randn(2, 3, 4)), ("x1", torch.randn(2, 1, 4)), ("x2", torch.randn(2, 2, 4))]
    emit(name, xs, ["x0", "x1", "x2"], lambda d: torch.cat([d["x0"], d["x1"], d["x2"]], dim=1),
         [("dim", 1, "i")])
    name = "cat/dneg1"
    seed(name)
    xs = [("x0", torch.randn(2, 3)), ("x1", torch.randn(2, 2))]
    emit(name, xs, ["x0", "x1"], lambda d: torch.cat([d["x0"], d["x1"]], dim=-1),
         [("dim", -1, "i")])
    name = "split/d1"
    seed(name)
    x = torch.randn(2, 6, 3)
    emit(name, [("x", x)], ["x"], lambda d: list(torch.split(d["x"], [1, 2, 3], dim=1)),
         [("sizes", [1, 2, 3], "i"), ("dim", 1, "i")])


def where_mask_cases():
    for variant, cshape in (("same", (3, 4)), ("bcast", (1, 4))):
        name = "where/" + variant
        seed(name)
        cond = torch.rand(cshape) < 0.5
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        emit(name, [("cond", cond), ("a", a), ("b", b)], ["a", "b"],
             lambda d: torch.where(d["cond"], d["a"], d["b"]))
    name = "masked_fill/bcast"
    seed(name)
    x = torch.randn(2, 3, 4)
    mask = torch.rand(3, 4) < 0.4
    emit(name, [("x", x), ("mask", mask)], ["x"],
         lambda d: d["x"].masked_fill(d["mask"], 2.5), [("value", 2.5, "f")])
    name = "masked_fill/neginf"
    seed(name)
    x = torch.randn(3, 3)
    mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)
    emit(name, [("x", x), ("mask", mask)], ["x"],
         lambda d: d["x"].masked_fill(d["mask"], -math.inf), [("value", -math.inf, "f")])


def composite_cases():
    name = "permute_matmul/p102"
    seed(name)
    x, w = torch.randn(2, 3, 4), torch.randn(4, 5)
    emit(name, [("x", x), ("w", w)], ["x", "w"],
         lambda d: torch.matmul(d["x"].permute(1, 0, 2), d["w"]), [("perm", [1, 0, 2], "i")])
    name = "transpose_matmul/t12"
    seed(name)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    emit(name, [("a", a), ("b", b)], ["a", "b"],
         lambda d: torch.matmul(d["a"].transpose(1, 2), d["b"]), [("d0", 1, "i"), ("d1", 2, "i")])
    name = "narrow_mul/d1_s2_l3"
    seed(name)
    x, y = torch.randn(3, 6), torch.randn(3, 3)
    emit(name, [("x", x), ("y", y)], ["x", "y"],
         lambda d: d["x"].narrow(1, 2, 3) * d["y"],
         [("dim", 1, "i"), ("start", 2, "i"), ("len", 3, "i")])
    # softmax(mask(q k^T * scale)) v with a causal mask: transpose, matmul, scale, masked_fill
    # with -inf and softmax together, as attention uses them.
    name = "attention/causal"
    seed(name)
    q, k, v = torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    scale = 1.0 / math.sqrt(3.0)

    def attn(d):
        s = torch.matmul(d["q"], d["k"].transpose(1, 2)) * scale
        s = s.masked_fill(d["mask"], -math.inf)
        return torch.matmul(F.softmax(s, dim=-1), d["v"])

    emit(name, [("q", q), ("k", k), ("v", v), ("mask", mask)], ["q", "k", "v"], attn,
         [("scale", scale, "f")])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory that receives ops.bin")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for fn in (binary_cases, scalar_cases, unary_cases, reduce_cases, softmax_cases,
               matmul_cases, linear_cases, layer_norm_cases, batch_norm_cases, embedding_cases,
               cross_entropy_cases, mse_cases, cat_split_cases, where_mask_cases,
               composite_cases):
        fn()
    blob = W.serialize()
    path = os.path.join(args.out, "ops.bin")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    for name, shapes, diff in SUMMARY:
        print("  %-32s out %-28s grad %s" % (name, " ".join(str(list(s)) for s in shapes),
                                             ",".join(diff) or "-"))
    print("%s: %d cases, %d records, %d bytes, crc32 %08x (torch %s)"
          % (path, len(SUMMARY), len(W.recs), len(blob), zlib.crc32(blob), torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
