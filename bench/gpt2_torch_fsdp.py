#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gpt2_torch_fsdp.py: the PyTorch FSDP twin of bench_gpt_gpu.

The GPT model of gpt_step_torch.py (the same layers as libfsdp's GPT: explicit attention with
an additive causal mask, tanh GELU, tied head) at GPT-2 small's shape unless told otherwise,
sharded with FSDP2 (torch.distributed.fsdp.fully_shard, PyTorch 2.6 and later): every Block a
unit, then the root, resharded after forward (FULL_SHARD), over the NCCL backend. Where
fully_shard is missing, or with FSDP_TORCH_API=fsdp1, it uses FSDP1's FullyShardedDataParallel
instead: FULL_SHARD, every Block a unit (ModuleWrapPolicy), BACKWARD_PRE, limit_all_gathers,
use_orig_params, device_id the rank's GPU. The header line says which one ran. AdamW (lr 1e-3,
betas 0.9/0.95, eps 1e-8) in the two parameter groups of libfsdp's GPT recipe, as
bench_gpt_gpu's: weight decay 0.1 on the matrices but the position table wpe.weight, none on
vectors (gpt_step_torch.adamw_groups, decided on the shapes before sharding). Each rank trains
on its own fixed batch from splitmix64(seed + rank), the tokens
bench_gpt_gpu draws. --bf16: bf16 parameters for compute, f32 gradient reduction and the causal
mask buffer in bf16, as bench_gpt_gpu's --bf16 (FSDP2: MixedPrecisionPolicy, which casts no
buffers, so the mask is cast once before sharding; FSDP1: MixedPrecision with buffer_dtype). f32 matrix products use TF32 only when FSDP_CUDA_TF32=1, as libfsdp's.

Alone it is a world of one on GPU 0 (a file rendezvous in a temporary directory, no network);
under torchrun it takes RANK, WORLD_SIZE and LOCAL_RANK. Rank 0 prints the lines bench_gpt_gpu
prints (bench/gpt2_gpu.sh reads both): the peak of a bf16 GEMM measured here with
torch.matmul, the losses, the median step time, tokens/s, MFU against that peak, the caching
allocator's peak (torch.cuda.max_memory_allocated) and the GPU's used memory
(torch.cuda.mem_get_info, total - free), both of the largest rank.
"""

import argparse
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_step_torch  # noqa: E402  (the model and the batch)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="gpt2_torch_fsdp.py",
        description="PyTorch FSDP training steps of GPT-2 small on CUDA over NCCL "
                    "(the twin of bench_gpt_gpu; same options).")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true",
                   help="MixedPrecision(param_dtype=bf16, reduce_dtype=f32)")
    p.add_argument("--peak-n", type=int, default=8192, help="size of the peak GEMM (8192)")
    p.add_argument("--peak-iters", type=int, default=20, help="GEMMs timed for the peak (20)")
    p.add_argument("--quick", action="store_true",
                   help="small model (2 blocks, d 64, 4 heads, T 32, B 2, vocab 256), 1 + 2 "
                        "steps, peak GEMM 2048")
    a = p.parse_args(argv)
    if a.quick:
        # As bench_gpt_gpu: --quick sets the small shape; options given explicitly still win.
        given = {x.split("=", 1)[0] for x in argv if x.startswith("--")}
        for k, v in dict(layers=2, d=64, heads=4, seq=32, batch=2, vocab=256, steps=2,
                         warmup=1, peak_n=2048).items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    if a.d % a.heads:
        p.error("--heads %d must divide --d %d" % (a.heads, a.d))
    return a


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def measure_peak(torch, n, iters):
    """Best FLOP/s of n^3 bf16 matrix products (f32 accumulation) on the current GPU."""
    g = torch.Generator(device="cuda").manual_seed(42)
    a = torch.rand(n, n, device="cuda", dtype=torch.float32, generator=g).mul_(2).sub_(1)
    a = a.to(torch.bfloat16)
    b = a.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for i in range(-3, iters):
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        if i >= 0:
            best = min(best, start.elapsed_time(end) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / best


def flops_per_token(a):
    """6 N + 12 L T d, N without the position table (as bench_gpt_gpu)."""
    n = a.vocab * a.d + a.layers * (12 * a.d * a.d + 13 * a.d) + 2 * a.d
    return 6.0 * n + 12.0 * a.layers * a.seq * a.d


def main(argv):
    a = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        import torch.distributed.fsdp as tfsdp
    except ImportError as e:
        print("gpt2_torch_fsdp.py: PyTorch with torch.distributed.fsdp is not installed for %s "
              "(%s)" % (sys.executable, e), file=sys.stderr)
        return 3
    api = os.environ.get("FSDP_TORCH_API", "auto")
    if api not in ("auto", "fsdp1", "fsdp2"):
        print("gpt2_torch_fsdp.py: FSDP_TORCH_API=%s is not auto, fsdp1 or fsdp2" % api,
              file=sys.stderr)
        return 2
    if api == "auto":
        api = "fsdp2" if hasattr(tfsdp, "fully_shard") else "fsdp1"
    if api == "fsdp2" and not hasattr(tfsdp, "fully_shard"):
        print("gpt2_torch_fsdp.py: FSDP_TORCH_API=fsdp2, but PyTorch %s has no "
              "torch.distributed.fsdp.fully_shard" % torch.__version__, file=sys.stderr)
        return 3
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print("gpt2_torch_fsdp.py: no CUDA device is visible", file=sys.stderr)
        return 1
    if not dist.is_nccl_available():
        print("gpt2_torch_fsdp.py: this PyTorch has no NCCL backend", file=sys.stderr)
        return 1

    # f32 products as libfsdp's CUDA device makes them: strict f32 unless FSDP_CUDA_TF32=1.
    tf32 = os.environ.get("FSDP_CUDA_TF32") == "1"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    peak = measure_peak(torch, a.peak_n, a.peak_iters)
    tmp = None
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=dev)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="gpt2_torch_fsdp.")
        dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp.name, "init"),
                                rank=0, world_size=1, device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(a.seed)
    model = gpt_step_torch.build(torch, a)  # on the host, as bench_gpt_gpu
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    decay = gpt_step_torch.recipe_decay(model)  # before sharding changes the shapes
    # The additive causal mask goes to bf16 with the parameters, so that the masked scores stay
    # bf16 and meet v in the same dtype (the integer positions are not cast).
    if api == "fsdp2":
        if a.bf16:
            model.mask.data = model.mask.data.to(torch.bfloat16)
            mp = tfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)
        else:
            mp = tfsdp.MixedPrecisionPolicy()
        model.to(dev)
        for blk in model.h:
            tfsdp.fully_shard(blk, reshard_after_forward=True, mp_policy=mp)
        fsdp = tfsdp.fully_shard(model, reshard_after_forward=True, mp_policy=mp)
        wrap_desc = "fully_shard per Block and the root, reshard_after_forward"
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = tfsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  buffer_dtype=torch.bfloat16) if a.bf16 else None
        fsdp = tfsdp.FullyShardedDataParallel(
            model, sharding_strategy=tfsdp.ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({type(model.h[0])}),
            backward_prefetch=tfsdp.BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True,
            use_orig_params=True, device_id=dev, mixed_precision=mp)
        wrap_desc = "BACKWARD_PRE, limit_all_gathers, use_orig_params"
    betas, eps, wd = (0.9, 0.95), 1e-8, 0.1
    opt = torch.optim.AdamW(gpt_step_torch.adamw_groups(fsdp.named_parameters(), decay, wd),
                            lr=a.lr, betas=betas, eps=eps)
    inputs, targets = gpt_step_torch.make_batch(a.batch, a.seq, a.vocab, a.seed + rank)
    tokens = torch.tensor(inputs, dtype=torch.int64, device=dev)
    tgt = torch.tensor(targets, dtype=torch.int64, device=dev)

    if rank == 0:
        print("# gpt2_torch_fsdp: PyTorch %s %s FULL_SHARD over nccl, world %d, %s, GPT %d "
              "layers, d %d, %d heads, seq %d, batch %d per rank, vocab %d, %s"
              % (torch.__version__, api.upper(), world, torch.cuda.get_device_name(dev),
                 a.layers, a.d,
                 a.heads, a.seq, a.batch, a.vocab,
                 "bf16 mixed precision (bf16 parameters, f32 reduction)" if a.bf16 else "f32"))
        print("# params %d; %s" % (nparams, wrap_desc))
        print("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (%s); seed %d; %d warm-up + "
              "%d timed steps" % (a.lr, betas[0], betas[1], eps, wd, gpt_step_torch.DECAY_NOTE,
                                  a.seed, a.warmup, a.steps))
        print("peak bf16 GEMM %d^3 (torch.matmul, best of %d): %.1f TFLOP/s"
              % (a.peak_n, a.peak_iters, peak * 1e-12))
        sys.stdout.flush()

    nsteps = a.warmup + a.steps
    times = torch.zeros(nsteps, dtype=torch.float64)
    losses = torch.zeros(nsteps, dtype=torch.float64)
    for s in range(nsteps):
        if s == a.warmup:
            torch.cuda.reset_peak_memory_stats(dev)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = fsdp(tokens)
        loss = F.cross_entropy(logits.view(-1, a.vocab).float(), tgt.view(-1), ignore_index=-1)
        lv = loss.item()
        loss.backward()
        opt.step()
        torch.cuda.synchronize(dev)
        times[s] = time.perf_counter() - t0
        losses[s] = lv
        del logits, loss

    free_b, total_b = torch.cuda.mem_get_info(dev)
    mem = torch.tensor([float(torch.cuda.max_memory_allocated(dev)), float(total_b - free_b)],
                       dtype=torch.float64, device=dev)
    times_d, losses_d = times.to(dev), losses.to(dev)
    dist.all_reduce(times_d, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses_d, op=dist.ReduceOp.SUM)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    times, losses, mem = times_d.cpu(), losses_d.cpu() / world, mem.cpu()
    dist.destroy_process_group()
    if tmp:
        tmp.cleanup()
    if rank != 0:
        return 0
    status = 0
    for s in range(nsteps):
        lv = losses[s].item()
        print("step %3d%s loss %.6f  ms %.1f" % (s + 1, "        " if s >= a.warmup
                                                 else " (warmup)", lv, times[s].item() * 1e3))
        if not math.isfinite(lv):
            status = 1
    med = median(times[a.warmup:].tolist())
    tok_s = a.batch * a.seq * world / med
    print("memory (torch.cuda.max_memory_allocated of the largest rank after the warm-up): "
          "%.1f MiB" % (mem[0].item() / 1048576.0))
    print("GPU used memory (cudaMemGetInfo, largest rank): %.1f MiB" % (mem[1].item() / 1048576.0))
    print("ms/step median %.2f over %d steps" % (med * 1e3, a.steps))
    print("model FLOPs per token %.4g" % flops_per_token(a))
    print("tokens/s %.0f (all ranks)" % tok_s)
    print("MFU %.2f%% (against the measured bf16 GEMM peak)"
          % (100.0 * tok_s / world * flops_per_token(a) / peak))
    sys.stdout.flush()
    if status:
        print("gpt2_torch_fsdp.py: the loss is not finite", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
