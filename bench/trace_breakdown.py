#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""trace_breakdown.py: where a training step's time goes, from fsdp-train --trace timelines.

    bench/trace_breakdown.py [--skip N] LABEL=run.json [LABEL=run.json ...]

Reads each trace (Chrome trace event format, as fsdp-train --trace writes it: rank 0's compute
track with "step N" spans, forward/backward/optimizer spans and "wait <collective>" spans, and
its communication track with one span per collective) and prints, per trace, the median over
the steps after the first --skip (default 2) of:

  step        the "step N" span;
  forward     the forward spans of the root units, less the waits inside them;
  backward    autograd's backward span, less the waits inside it (the unit hooks' work, such
              as zeroing and dividing gradients, is in it);
  optimizer   the optimizer step span;
  between steps  from the end of one "step N" span to the start of the next: what the program
              does outside its steps (rank 0 writes the metrics and the progress line there);
  other       the rest of the step: the batch, the loss and the step-time all-reduces, clipping;
  waits       the compute track waiting for a collective (exposed communication), by kind;
  comm busy   the communication track's spans (the CPU time the collectives take: copies,
              reductions, barriers), by kind, and how much of it ran while compute ran.

The first trace is the baseline: each row also prints its difference from it, so a one-rank
trace beside a two-rank one shows what distribution adds, phase by phase. Standard library only.
"""
import json
import statistics
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    return [e for e in ev if e.get("ph") == "X" and e.get("pid", 0) == 0]


def inside(e, lo, hi):
    return e["ts"] >= lo and e["ts"] + e["dur"] <= hi + 1e-3


def overlap(a0, a1, spans):
    """Time of [a0, a1) covered by the (sorted, disjoint) spans."""
    t = 0.0
    for s0, s1 in spans:
        lo, hi = max(a0, s0), min(a1, s1)
        if hi > lo:
            t += hi - lo
    return t


def breakdown(ev, skip):
    steps = sorted((e for e in ev if e.get("cat") == "user" and e["name"].startswith("step ")),
                   key=lambda e: e["ts"])[skip:]
    rows = []
    for i, st in enumerate(steps):
        lo, hi = st["ts"], st["ts"] + st["dur"]
        mine = [e for e in ev if inside(e, lo, hi)]
        waits = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][5:]) for e in mine
                        if e.get("cat") == "wait"))
        wspans = [(a, b) for a, b, _ in waits]

        def net(cat, pred=lambda e: True):
            t = 0.0
            for e in mine:
                if e.get("cat") == cat and pred(e):
                    t += e["dur"] - overlap(e["ts"], e["ts"] + e["dur"], wspans)
            return t

        r = {"step": st["dur"]}
        if i + 1 < len(steps):
            r["between steps"] = steps[i + 1]["ts"] - hi
        r["forward"] = net("forward", lambda e: e.get("args", {}).get("unit") == "<root>")
        r["backward"] = net("autograd")
        r["optimizer"] = net("optimizer")
        wait_total = sum(b - a for a, b in wspans)
        r["other"] = r["step"] - r["forward"] - r["backward"] - r["optimizer"] - wait_total
        r["waits"] = wait_total
        for a, b, kind in waits:
            r["wait " + kind] = r.get("wait " + kind, 0.0) + (b - a)
        comm = [e for e in mine if e.get("cat") == "comm"]
        busy = sum(e["dur"] for e in comm)
        r["comm busy"] = busy
        r["comm busy beside compute"] = busy - sum(
            overlap(e["ts"], e["ts"] + e["dur"], wspans) for e in comm)
        for e in comm:
            r["busy " + e["name"]] = r.get("busy " + e["name"], 0.0) + e["dur"]
            r["MB " + e["name"]] = r.get("MB " + e["name"], 0.0) + e.get("args", {}).get(
                "bytes", 0) / 1e6
        rows.append(r)
    if not rows:
        raise SystemExit("trace_breakdown.py: no 'step N' spans after --skip")
    keys = sorted({k for r in rows for k in r} - {"between steps"})
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    # the last step has no next one: its gap is left out, not counted as a zero
    gaps = [r["between steps"] for r in rows if "between steps" in r]
    med["between steps"] = statistics.median(gaps) if gaps else 0.0
    return med, len(rows)


def main(argv):
    skip = 2
    runs = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__)
            return 0
        if a == "--skip":
            skip = int(argv[i + 1])
            i += 2
            continue
        label, _, path = a.partition("=")
        if not path:
            label, path = a, a
        runs.append((label, path))
        i += 1
    if not runs:
        print("usage: trace_breakdown.py [--skip N] LABEL=run.json ...", file=sys.stderr)
        return 2
    res = [(label,) + breakdown(load(path), skip) for label, path in runs]
    order = ["step", "between steps", "forward", "backward", "optimizer", "other", "waits"]
    keys = order + sorted({k for _, b, _ in res for k in b if k.startswith("wait ")}) + \
        ["comm busy", "comm busy beside compute"] + \
        sorted({k for _, b, _ in res for k in b if k.startswith("busy ")}) + \
        sorted({k for _, b, _ in res for k in b if k.startswith("MB ")})
    head = "| ms a step (median) | " + " | ".join(
        f"{label} ({n} steps)" + ("" if j == 0 else f" | vs {res[0][0]}")
        for j, (label, _, n) in enumerate(res)) + " |"
    print(head)
    print("|---" * (1 + 2 * len(res) - 1) + "|")
    for k in keys:
        cells = []
        base = res[0][1].get(k, 0.0)
        for j, (_, b, _) in enumerate(res):
            v = b.get(k, 0.0)
            scale = 1.0 if k.startswith("MB ") else 1e-3
            cells.append(f"{v * scale:.1f}")
            if j:
                cells.append(f"{(v - base) * scale:+.1f}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
