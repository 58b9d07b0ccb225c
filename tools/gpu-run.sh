#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# gpu-run.sh (run.sh in the GPU bundle that tools/gpu-bundle.sh makes): libfsdp's GPU run in one
# command, on a bare CUDA machine, within a time budget.
#
#   run.sh [--budget S] [--only STEPS] [--tests NAMES] [--sanitize NAME] [--bench-steps N]
#          [--bench-runs N]
#
# Steps, in order (--only takes a comma-separated subset of probe,tests,train,bench,sanitize,
# profile):
#   probe     nvidia-smi (20 s at most), and where libcudart, libcublas, libcublasLt and libnccl
#             were found, with their versions. They are looked for in FSDP_GPU_LIBDIRS, the CUDA
#             toolkits (/usr/local/cuda*), then the pip packages of the Python environments
#             (/opt/torch/.venv first); the first directory holding one wins, and goes on
#             LD_LIBRARY_PATH.
#   tests     make check-gpu's programs, plus t_plugin and t_cuda_host, each with its own
#             timeout; each log is TAP. Without a GPU they skip themselves.
#   train     fsdp-train, 50 steps of the default model at world size 1: on the CPU (the sim
#             backend) and with --backend nccl on the GPU; the GPU run must compute on the GPU,
#             its loss must fall, and its losses must stay within 1% of the CPU's.
#   bench     bench/gpt2_gpu.sh, GPT-2 124M at sequence 1024 against PyTorch FSDP on this GPU:
#             bf16 mixed precision first, then f32 while the budget lasts (--bench-steps timed
#             steps each, default 10; --bench-runs alternating runs of the two programs for the
#             bf16 comparison, whose ratio is then the median, default 1).
#   sanitize  only with --sanitize NAME: tests/NAME under compute-sanitizer (memcheck).
#   profile   only when --only names it: one warm-up and one timed bf16 step of the benchmark
#             under Nsight Compute, each kernel's GPU time (gpu__time_duration, clocks left
#             alone); ncu.csv (one row per launch) and the kernels that took the most time.
# --tests limits the tests step to the named programs (comma-separated, e.g. t_cuda_device).
# --budget is the whole run's time in seconds (default 450): each step's timeout is cut to
# what is left, keeping time for the steps after it, and a step with no time left is reported
# as not run.
#
# Output: a line per check, then one summary line, "SUMMARY ...", last. Logs go to $OUT (the
# device tool's folder; default out/ beside this script): summary.txt and logs.tar.gz (every
# log; remade after each step, so a run stopped half-way still leaves what it did).
#
# Exit status: 0 when nothing failed (skips are not failures), 1 when something failed, 2 for
# bad usage.

set -u
bundle=$(cd "$(dirname "$0")" && pwd)
. "$bundle/env.sh"
start=$(date +%s)
budget=450
only=probe,tests,train,bench
sel_tests=
sanitize=
bench_steps=10
bench_runs=1

usage() { echo "run.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
    --budget | --only | --tests | --sanitize | --bench-steps | --bench-runs)
        [ $# -ge 2 ] || usage "$1 needs a value"
        case $1 in
        --budget) budget=$2 ;;
        --only) only=$2 ;;
        --tests) sel_tests=$2 ;;
        --sanitize) sanitize=$2; only="$only,sanitize" ;;
        --bench-steps) bench_steps=$2 ;;
        --bench-runs) bench_runs=$2 ;;
        esac
        shift 2 ;;
    --help | -h)
        awk 'NR == 1 || /SPDX-License-Identifier/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
        exit 0 ;;
    *) usage "unknown option '$1' (see --help)" ;;
    esac
done
for v in "$budget" "$bench_steps" "$bench_runs"; do
    case $v in '' | *[!0-9]* | 0) usage "--budget, --bench-steps and --bench-runs need positive integers" ;; esac
done
for s in ${only//,/ }; do
    case $s in probe | tests | train | bench | sanitize | profile) ;; *) usage "--only: unknown step '$s'" ;; esac
done
want() { case ",$only," in *",$1,"*) return 0 ;; esac; return 1; }

OUT=${OUT:-$bundle/out}
mkdir -p "$OUT"
logs=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-gpu-run.XXXXXX")
trap 'rm -rf "$logs"' EXIT
summary=
failed=0
note() { summary="$summary${summary:+; }$*"; }
pack() { (cd "$logs" && tar czf "$OUT/logs.tar.gz" .) 2>/dev/null; }
elapsed() { echo $(($(date +%s) - start)); }
# limit WANT RESERVE: WANT seconds, cut to what the budget leaves after RESERVE more seconds.
limit() {
    local left=$((budget - $(elapsed) - $2))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

# --- probe -----------------------------------------------------------------------------------
gpu=none
have_gpu=0
# find_lib NAME: the first directory holding NAME.
lib_dirs() {
    local d
    for d in ${FSDP_GPU_LIBDIRS:-}; do echo "$d"; done
    for d in /usr/local/cuda /usr/local/cuda-*; do
        [ -d "$d" ] && echo "$d/lib64" && echo "$d/targets/x86_64-linux/lib"
    done
    for d in /opt/torch/.venv /opt/*/.venv /usr/local/lib /usr/lib; do
        [ -d "$d" ] || continue
        find "$d" -maxdepth 7 -type d -path '*/nvidia/*' -name lib 2>/dev/null | sort
    done
}
find_lib() {
    local d
    while read -r d; do
        [ -e "$d/$1" ] && { echo "$d"; return 0; }
    done < "$logs/libdirs"
    return 1
}
lib_version() { # the version in the real file's name, or the soname
    local r
    r=$(readlink -f "$1")
    echo "${r##*/}"
}
lib_dirs > "$logs/libdirs" 2>/dev/null
libpath=
for n in libcudart.so.13 libcublasLt.so.13 libcublas.so.13 libnccl.so.2; do
    if d=$(find_lib "$n"); then
        echo "lib $n: $d ($(lib_version "$d/$n"))"
        case ":$libpath:" in *":$d:"*) ;; *) libpath="$libpath${libpath:+:}$d" ;; esac
    else
        echo "lib $n: not found (set FSDP_GPU_LIBDIRS)"
        note "$n not found"
    fi
done > "$logs/libs.log"
cat "$logs/libs.log"
[ -n "$libpath" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$libpath"

if want probe; then
    echo "== probe"
    if command -v nvidia-smi > /dev/null 2>&1; then
        timeout 20 nvidia-smi > "$logs/nvidia-smi.log" 2>&1
        q=$(timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv,noheader 2>/dev/null | head -1)
        if [ -n "$q" ]; then
            gpu=$q
            have_gpu=1
        fi
    else
        echo "nvidia-smi: not found" > "$logs/nvidia-smi.log"
    fi
    command -v nvcc > /dev/null 2>&1 && echo "nvcc: $(nvcc --version | tail -1)"
    echo "driver library: $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / { print $NF; exit }')"
    echo "gpu: $gpu"
    grep -m1 '^source:' "$bundle/MANIFEST" 2>/dev/null
    note "gpu $gpu"
else
    timeout 10 nvidia-smi -L > /dev/null 2>&1 && have_gpu=1
fi
pack

# --- tests -----------------------------------------------------------------------------------
# TAP counts of a log: "planned ok notok skip".
tap_counts() {
    awk '/^1\.\.[0-9]+/ { sub(/^1\.\./, ""); plan = $1 + 0; planned = 1 }
         /^ok / { ok++; if ($0 ~ /# *SKIP/) skip++ }
         /^not ok / { if ($0 ~ /# *TODO/) ok++; else bad++ }
         END { printf "%d %d %d %d %d\n", planned ? plan : -1, ok, bad, skip, planned }' "$1"
}
# run_tap NAME TIMEOUT [WRAPPER...]: runs tests/NAME, prints one line, adds to the summary.
tp=0 tf=0 ts=0 tfailed=
run_tap() {
    local name=$1 t=$2 log="$logs/$1.log" rc planned ok bad skip hasplan verdict
    shift 2
    if [ "$t" -lt 5 ]; then
        echo "$name: NOT RUN (no time left in the budget)"
        tf=$((tf + 1)); tfailed="$tfailed $name(not run)"
        return
    fi
    local t0=$(date +%s)
    timeout -k 5 "$t" "$@" "$bundle/tests/$name.tap" > "$log" 2>&1
    rc=$?
    read -r planned ok bad skip hasplan < <(tap_counts "$log")
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        verdict="TIMEOUT after ${t}s"
    elif [ "$hasplan" = 1 ] && [ "$planned" = 0 ]; then
        verdict="SKIP ($(sed -n 's/^1\.\.0 *# *SKIP *//p' "$log" | head -1))"
    elif [ "$rc" = 0 ] && [ "$bad" = 0 ] && [ "$planned" = $((ok)) ]; then
        verdict="PASS"
    else
        verdict="FAIL (exit $rc)"
    fi
    echo "$name: $verdict: $ok ok ($skip skipped), $bad not ok, plan $planned, $(($(date +%s) - t0)) s"
    case $verdict in
    PASS) tp=$((tp + 1)) ;;
    SKIP*) ts=$((ts + 1)) ;;
    *)
        tf=$((tf + 1)); tfailed="$tfailed $name"
        grep -E '^(not ok|Bail out)' "$log" | head -15 | sed 's/^/    /'
        tail -8 "$log" | sed 's/^/    | /' ;;
    esac
}

tests_all="t_cuda_probe t_plugin t_cuda_host t_cuda_device t_sim_cuda t_nccl_coll t_fsdp_cuda t_nccl_fsdp"
# Seconds each may take at most (the sum stays inside the default budget with the other steps).
tmax() {
    case $1 in
    t_cuda_probe | t_plugin | t_cuda_host) echo 30 ;;
    t_cuda_device | t_sim_cuda | t_nccl_coll) echo 60 ;;
    *) echo 90 ;;
    esac
}
if want tests; then
    echo "== tests"
    for n in $tests_all; do
        if [ -n "$sel_tests" ]; then
            case ",$sel_tests," in *",$n,"*) ;; *) continue ;; esac
        fi
        reserve=0
        want train && reserve=$((reserve + 40))
        want bench && reserve=$((reserve + 120))
        run_tap "$n" "$(limit "$(tmax "$n")" "$reserve")"
        pack
    done
    note "tests: $tp pass, $ts skip, $tf fail${tfailed:+ (${tfailed# })}"
    [ "$tf" = 0 ] || failed=1
fi

# --- train -----------------------------------------------------------------------------------
# losses FILE: the train losses of a metrics file, one per line.
losses() { sed -n 's/.*"type":"train","step":[0-9]*,"loss":\([-0-9.eE+naif]*\).*/\1/p' "$1"; }
if want train; then
    echo "== train"
    # Not --quiet: the first lines name the device the ranks compute on ("on cuda:0").
    tr_args=(--steps 50 --val-every 50 --val-steps 4 --sample-tokens 0 --log-every 10
        --data "$bundle/data/corpus.txt")
    reserve=0
    want bench && reserve=120
    t=$(limit 60 "$reserve")
    timeout -k 5 "$t" "$bundle/bin/fsdp-train" "${tr_args[@]}" --backend sim --world-size 1 \
        --metrics "$logs/train-cpu.jsonl" > "$logs/train-cpu.log" 2>&1
    rc_cpu=$?
    t=$(limit 60 "$reserve")
    timeout -k 5 "$t" "$bundle/bin/fsdp-train" "${tr_args[@]}" --backend nccl \
        --metrics "$logs/train-gpu.jsonl" > "$logs/train-gpu.log" 2>&1
    rc_gpu=$?
    cpu=($(losses "$logs/train-cpu.jsonl" 2>/dev/null))
    gpul=($(losses "$logs/train-gpu.jsonl" 2>/dev/null))
    cfirst=$(printf '%.4f' "${cpu[0]:-0}") clast=$(printf '%.4f' "${cpu[${#cpu[@]}-1]:-0}")
    echo "fsdp-train sim (CPU): exit $rc_cpu, ${#cpu[@]} steps, loss $cfirst -> $clast"
    if [ "$rc_cpu" != 0 ]; then
        tail -5 "$logs/train-cpu.log" | sed 's/^/    | /'
    fi
    if [ "$rc_gpu" = 2 ] && grep -q 'no CUDA device is visible' "$logs/train-gpu.log"; then
        echo "fsdp-train nccl: SKIP (no CUDA device is visible)"
        note "train: cpu $cfirst -> $clast, gpu skipped (no GPU)"
        [ "$rc_cpu" = 0 ] || failed=1
    else
        # Every step's GPU loss within 1% of the CPU's, and the last one at least 0.5 lower
        # than the first.
        verdict=$(awk -v c="${cpu[*]:-}" -v g="${gpul[*]:-}" 'BEGIN {
            nc = split(c, C, " "); ng = split(g, G, " ")
            if (ng != 50 || nc != 50) { printf "FAIL (%d GPU, %d CPU steps)", ng, nc; exit }
            worst = 0; at = 0
            for (i = 1; i <= ng; i++) {
                d = G[i] - C[i]; if (d < 0) d = -d; d /= (C[i] < 0 ? -C[i] : C[i])
                if (d > worst || d != d) { worst = d; at = i }
            }
            fall = G[1] - G[ng]
            ok = (worst <= 0.01 && fall >= 0.5)
            printf "%s (loss %.4f -> %.4f; largest GPU/CPU difference %.2e at step %d)",
                ok ? "PASS" : "FAIL", G[1], G[ng], worst, at }')
        grep -q 'on cuda' "$logs/train-gpu.log" || verdict="FAIL (not on cuda; ${verdict#* })"
        echo "fsdp-train nccl (GPU): exit $rc_gpu, $verdict"
        note "train: nccl $verdict"
        case $verdict in PASS*) [ "$rc_gpu" = 0 ] && [ "$rc_cpu" = 0 ] || failed=1 ;; *) failed=1 ;; esac
        [ "$rc_gpu" = 0 ] || tail -8 "$logs/train-gpu.log" | sed 's/^/    | /'
    fi
    pack
fi

# --- bench -----------------------------------------------------------------------------------
if want bench; then
    echo "== bench"
    py=python3
    [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
    export PYTHON=${PYTHON:-$py} BENCH_GPT_GPU="$bundle/bench/bench_gpt_gpu"
    export FSDPRUN="$bundle/bin/fsdprun" PYTHONUNBUFFERED=1
    if [ "$have_gpu" != 1 ]; then
        echo "bench: SKIP (no GPU)"
        note "bench: skipped (no GPU)"
    else
        for prec in bf16 f32; do
            reserve=0
            want sanitize && reserve=240
            want profile && reserve=$((reserve + 60))
            runs=1
            [ "$prec" = bf16 ] && runs=$bench_runs
            t=$(limit $((150 * runs)) "$reserve")
            if [ "$t" -lt 30 ]; then
                echo "bench $prec: NOT RUN (no time left in the budget)"
                note "bench $prec: not run"
                continue
            fi
            flag=
            [ "$prec" = bf16 ] && flag=--bf16
            timeout -k 5 "$t" "$bundle/bench/gpt2_gpu.sh" --runs "$runs" $flag --steps "$bench_steps" \
                --warmup 3 > "$logs/bench-$prec.log" 2>&1
            rc=$?
            # The two programs' lines, in order: libfsdp's first, PyTorch's second.
            mfu=($(sed -n 's/^MFU \([0-9.]*\)%.*/\1/p' "$logs/bench-$prec.log"))
            tok=($(sed -n 's/^tokens\/s \([0-9.]*\).*/\1/p' "$logs/bench-$prec.log"))
            mem=($(sed -n 's/^memory ([^)]*): \([0-9.]*\) MiB.*/\1/p' "$logs/bench-$prec.log"))
            peak=$(sed -n 's/^peak bf16 GEMM.*: \([0-9.]*\) TFLOP\/s.*/\1/p' "$logs/bench-$prec.log" | head -1)
            # The median over the runs (one run: its own ratio).
            ratio=$(sed -n 's/^summary over .* medians of libfsdp\/PyTorch: tokens\/s \([0-9.n\/a]*\).*/\1/p' "$logs/bench-$prec.log")
            allr=$(sed -n 's/^run [0-9]*: libfsdp\/PyTorch tokens\/s \([0-9.n\/a]*\).*/\1/p' "$logs/bench-$prec.log" | paste -sd/)
            line="bench $prec: exit $rc, tokens/s libfsdp ${tok[0]:-?} PyTorch ${tok[1]:-?} (ratio ${ratio:-?}${allr:+, runs $allr}, target >= 1.0), MFU ${mfu[0]:-?}% / ${mfu[1]:-?}% of ${peak:-?} TFLOP/s, peak MiB ${mem[0]:-?} / ${mem[1]:-?}"
            echo "$line"
            note "${line#bench }"
            if [ "$rc" != 0 ]; then
                failed=1
                grep -v '^step ' "$logs/bench-$prec.log" | tail -12 | sed 's/^/    | /'
            fi
            pack
        done
    fi
fi

# --- sanitize --------------------------------------------------------------------------------
if want sanitize && [ -n "$sanitize" ]; then
    echo "== sanitize $sanitize"
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if [ -z "$cs" ]; then
        echo "compute-sanitizer: not found"
        note "sanitize: no compute-sanitizer"
    elif [ ! -x "$bundle/tests/$sanitize.tap" ]; then
        usage "--sanitize: no tests/$sanitize.tap in the bundle"
    else
        run_tap "$sanitize" "$(limit 240 0)" "$cs" --tool memcheck --error-exitcode 99
        note "sanitize $sanitize: $(tail -1 "$logs/$sanitize.log" | cut -c1-120)"
    fi
    pack
fi

# --- profile ---------------------------------------------------------------------------------
if want profile; then
    echo "== profile"
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    py=python3
    [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
    if [ "$have_gpu" != 1 ] || [ -z "$ncu" ]; then
        echo "profile: SKIP (${ncu:+no GPU}${ncu:-no ncu})"
        note "profile: skipped"
    else
        t=$(limit 300 0)
        timeout -k 5 "$t" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
            --page raw "$bundle/bench/bench_gpt_gpu" --bf16 --warmup 1 --steps 1 --peak-iters 1 \
            --peak-n 1024 > "$logs/ncu.out" 2> "$logs/ncu.err"
        rc=$?
        grep '^"' "$logs/ncu.out" > "$OUT/ncu.csv"
        # Per kernel name: launches, total ms, share; the first 25 by time.
        "$py" - "$OUT/ncu.csv" > "$logs/profile.txt" 2>&1 <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3: sys.exit("no kernel rows")
h = rows[0]; u = rows[1]
ki = h.index("Kernel Name"); ti = h.index("gpu__time_duration.sum")
scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(u[ti], 1e-6)
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[2:]:
    try: v = float(r[ti].replace(",", "")) * scale
    except ValueError: continue
    name = r[ki][:110]; tot[name] += v; cnt[name] += 1
all_ms = sum(tot.values())
print("kernels: %d launches, %.1f ms of GPU time (warm-up and timed step, with the peak GEMM)" % (sum(cnt.values()), all_ms))
for name, ms in sorted(tot.items(), key=lambda x: -x[1])[:25]:
    print("%8.2f ms %5.1f%% %6d  %s" % (ms, 100 * ms / all_ms, cnt[name], name))
PY
        cat "$logs/profile.txt"
        echo "profile: ncu exit $rc, $(wc -l < "$OUT/ncu.csv") csv lines"
        note "profile: ncu exit $rc, $(head -1 "$logs/profile.txt")"
    fi
    pack
fi

line="SUMMARY ${failed/1/FAILED}"
[ "$failed" = 0 ] && line="SUMMARY ok"
line="$line in $(elapsed) s: $summary"
echo "$line" | tee "$OUT/summary.txt"
pack
exit "$failed"
