#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gpt_gloo_torch.py: the PyTorch DDP twin of bench_gpt_gloo.

Starts --nproc processes (default 2) with torch.multiprocessing.spawn; they meet through a file
in a new temporary directory (init_method file://, no network port, works offline) and train
the GPT model of gpt_step_torch.py with DistributedDataParallel over the gloo backend: every
rank builds the model from the same seed (DDP broadcasts rank 0's weights anyway), trains on
its own fixed batch drawn from splitmix64(seed + rank) as bench_gpt_gloo does, and every step
(zero_grad with set_to_none, forward, mean cross-entropy, backward with DDP's bucketed gradient
all-reduce, AdamW step) starts after a barrier; a step's time is the slowest rank's. AdamW runs
in the two parameter groups of libfsdp's GPT recipe, as bench_gpt_gloo's
(gpt_step_torch.adamw_groups: weight decay on the matrices but wpe.weight, none on vectors).

DDP runs with its defaults (25 MiB buckets, gradients not bucket views) except
broadcast_buffers=False: the model's buffers (positions, causal mask) are constants, and
libfsdp's side does not synchronise buffers either.

Rank 0 prints the same lines as bench_gpt_gloo (losses as the mean over the ranks, phase
medians, median/min/max step time, each rank's peak RSS from VmHWM in /proc/self/status read
after the last step), so bench/gpt_gloo.sh can read both. Run with --help for the options.
"""

import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_step_torch  # noqa: E402  (the model, the batch and the option parser)


def peak_rss_kib():
    """VmHWM of this process in KiB, or -1."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return -1.0


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def worker(rank, a, init_file):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = a.nproc
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=n)
    torch.manual_seed(a.seed)
    model = gpt_step_torch.build(torch, a)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, broadcast_buffers=False)
    betas = (0.9, 0.95)
    eps, wd = 1e-8, 0.1
    # DDP steps the model's own parameter objects, so the groups are taken from the model.
    groups = gpt_step_torch.adamw_groups(model.named_parameters(),
                                         gpt_step_torch.recipe_decay(model), wd)
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=betas, eps=eps)
    inputs, targets = gpt_step_torch.make_batch(a.batch, a.seq, a.vocab, a.seed + rank)
    tokens = torch.tensor(inputs, dtype=torch.int64)
    tgt = torch.tensor(targets, dtype=torch.int64)

    if rank == 0:
        print("# gpt_gloo_torch: PyTorch %s DDP over gloo, world %d (processes), GPT %d layers, "
              "d %d, %d heads, seq %d, batch %d per rank, vocab %d, f32, %d thread(s) per rank"
              % (torch.__version__, n, a.layers, a.d, a.heads, a.seq, a.batch, a.vocab,
                 torch.get_num_threads()))
        print("# params %d; DDP bucket_cap_mb 25, broadcast_buffers False" % nparams)
        print("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (%s); seed %d; %d warm-up + "
              "%d timed steps" % (a.lr, betas[0], betas[1], eps, wd, gpt_step_torch.DECAY_NOTE,
                                  a.seed, a.warmup, a.steps))
        sys.stdout.flush()

    nsteps = a.warmup + a.steps
    times = torch.zeros(nsteps, 5, dtype=torch.float64)  # zero_grad, fwd, bwd, opt, step
    losses = torch.zeros(nsteps, dtype=torch.float64)
    for s in range(nsteps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        logits = ddp(tokens)
        loss = F.cross_entropy(logits.view(-1, a.vocab), tgt.view(-1), ignore_index=-1)
        lv = loss.item()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        del logits, loss
        times[s] = torch.tensor([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0],
                                dtype=torch.float64)
        losses[s] = lv

    rss = torch.tensor([peak_rss_kib()], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    rss_all = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(rss_all, rss)
    dist.destroy_process_group()
    if rank != 0:
        return
    losses /= n
    status = 0
    for s in range(nsteps):
        lv = losses[s].item()
        print("step %3d%s loss %.6f  ms %.1f" % (s + 1, "        " if s >= a.warmup
                                                 else " (warmup)", lv, times[s, 4].item() * 1e3))
        if not math.isfinite(lv):
            status = 1
    timed = times[a.warmup:]
    names = ["zero_grad", "forward+loss", "backward", "optimizer"]
    print("phases median ms: " + " ".join(
        "%s %.1f" % (nm, median(timed[:, i].tolist()) * 1e3) for i, nm in enumerate(names)))
    rs = [r.item() / 1024.0 for r in rss_all]
    print("peak RSS MiB per rank: " + " ".join("%.1f" % r for r in rs))
    print("peak RSS MiB max %.1f" % max(rs))
    steps = timed[:, 4].tolist()
    med = median(steps)
    print("ms/step median %.2f (min %.2f, max %.2f) over %d steps"
          % (med * 1e3, min(steps) * 1e3, max(steps) * 1e3, a.steps))
    print("tokens/s %.0f (all ranks)" % (a.batch * a.seq * n / med))
    sys.stdout.flush()
    if status:
        print("gpt_gloo_torch.py: the loss is not finite", file=sys.stderr)
        raise SystemExit(1)


def main(argv):
    nproc = 2
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--nproc" and i + 1 < len(argv):
            nproc = int(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--nproc="):
            nproc = int(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    if nproc < 1:
        print("gpt_gloo_torch.py: --nproc must be >= 1", file=sys.stderr)
        return 2
    if not any(x == "--threads" or x.startswith("--threads=") for x in rest) and \
            not os.environ.get("FSDP_NUM_THREADS"):
        # As bench_gpt_gloo: the online cores shared by the ranks.
        rest += ["--threads", str(max(1, (os.cpu_count() or 1) // nproc))]
    if "--help" in rest or "-h" in rest:
        print("usage: gpt_gloo_torch.py [--nproc N (default 2)] [options of gpt_step_torch.py]")
    a = gpt_step_torch.parse_args(rest)
    a.nproc = nproc
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("gpt_gloo_torch.py: PyTorch is not installed for %s" % sys.executable,
              file=sys.stderr)
        return 3
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        print("gpt_gloo_torch.py: this PyTorch has no gloo backend", file=sys.stderr)
        return 3
    with tempfile.TemporaryDirectory(prefix="gpt_gloo_torch.") as d:
        try:
            mp.spawn(worker, args=(a, os.path.join(d, "init")), nprocs=nproc, join=True)
        except Exception as e:  # a rank failed: spawn re-raises its exception here
            print("gpt_gloo_torch.py: %s" % e, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
