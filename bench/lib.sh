# SPDX-License-Identifier: MIT
# lib.sh: what the benchmark scripts (gpt_step.sh, gpt_gloo.sh, gpt2_gpu.sh) share. Sourced
# after the script has set `here` (its own directory):   . "$here/lib.sh"

# bench_help: prints the running script's opening comment (after the #! line, without the
# SPDX line) as its --help, and exits 0.
bench_help() {
    awk 'NR == 1 || /SPDX-License-Identifier/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit 0
}

# bench_args NAME OURS FLAGS ARGS...: parses a script's command line. OURS lists the
# options with a value that the script keeps (e.g. "--runs --nproc"; --runs N sets runs=N,
# --nproc N sets nproc=N); FLAGS lists the flags it keeps out of the programs' arguments (the
# script looks for them with bench_has). --help prints the script's opening comment (after
# the #! line) and exits 0. Everything else is appended to $args, quoted for eval, to go to the programs unchanged.
# runs and nproc must then be positive integers (exit 2 otherwise).
bench_args() {
    _name=$1 _ours=$2 _flags=$3
    shift 3
    args=
    while [ $# -gt 0 ]; do
        case " $_ours " in
        *" $1 "*)
            [ $# -ge 2 ] || { echo "$_name: $1 needs a value" >&2; exit 2; }
            eval "${1#--}=\$2"
            shift 2
            continue ;;
        esac
        case " $_flags " in *" $1 "*) shift; continue ;; esac
        case $1 in
        --help|-h)
            bench_help ;;
        esac
        args="$args '$(printf '%s' "$1" | sed "s/'/'\\\\''/g")'"
        shift
    done
    for _o in $_ours; do
        eval "_v=\${${_o#--}}"
        case $_v in ''|*[!0-9]*|0) echo "$_name: $_o needs a positive integer" >&2; exit 2 ;; esac
    done
}

# bench_has OPTION ARGS...: whether OPTION is one of ARGS.
bench_has() {
    _want=$1
    shift
    for _a in "$@"; do [ "$_a" = "$_want" ] && return 0; done
    return 1
}

# bench_value_of OPTION ARGS...: prints the value after the last OPTION in ARGS (nothing when
# it is not there).
bench_value_of() {
    _want=$1 _next=0 _val=
    shift
    for _a in "$@"; do
        [ "$_next" = 1 ] && _val=$_a
        _next=0
        [ "$_a" = "$_want" ] && _next=1
    done
    printf '%s' "$_val"
}

# bench_threads DEFAULT: sets threads to --threads's value when $args has it, else
# FSDP_NUM_THREADS, else DEFAULT, appending --threads to $args when it was not given, and
# exports the count to both sides' thread pools (FSDP_NUM_THREADS, OMP_NUM_THREADS,
# OPENBLAS_NUM_THREADS).
bench_threads() {
    threads=$(eval "bench_value_of --threads $args")
    if [ -z "$threads" ]; then
        threads=${FSDP_NUM_THREADS:-$1}
        [ "$threads" -ge 1 ] 2>/dev/null || threads=1
        args="$args --threads $threads"
    fi
    export FSDP_NUM_THREADS="$threads" OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
}

# bench_median [EMPTY] [FORMAT]: the median of the numbers on standard input, one a line; the
# mean of the two middle ones (printed with FORMAT, default %.2f) when their count is even, and
# EMPTY (default nothing) when there are none.
bench_median() {
    sort -g | awk -v e="${1-}" -v f="${2:-%.2f}" '{ v[NR] = $1 } END {
        if (NR == 0) print e; else if (NR % 2) print v[(NR + 1) / 2]
        else printf f "\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# bench_step_median FILE: the median step every "ms/step median X" line of a benchmark's output
# in FILE gives (bench_gpt_step, bench_gpt_gloo, the PyTorch scripts), one a line.
bench_step_median() { sed -n 's/^ms\/step median \([0-9.]*\).*/\1/p' "$1"; }

# bench_cores: the online cores.
bench_cores() { nproc 2>/dev/null || getconf _NPROCESSORS_ONLN; }

# bench_find_prog VALUE PATH: VALUE when set (an environment override), else the first
# executable of ./PATH, the script's directory and the build tree above it.
bench_find_prog() {
    if [ -n "$1" ]; then echo "$1"; return; fi
    for _c in "./$2" "$here/$(basename "$2")" "$here/../$2"; do
        [ -x "$_c" ] && { echo "$_c"; return; }
    done
}

# bench_torch NAME [MODULES]: sets py to the interpreter with torch (PYTHON, else
# /usr/bin/python3 when it imports torch, else python3) and have_torch to 1 when it imports
# MODULES (default torch), else to 0 after saying on stderr that libfsdp's numbers come alone.
bench_torch() {
    _mods=${2:-torch}
    py=${PYTHON:-}
    if [ -z "$py" ]; then
        if /usr/bin/python3 -c "import $_mods" >/dev/null 2>&1; then py=/usr/bin/python3; else py=python3; fi
    fi
    have_torch=1
    if ! "$py" -c "import $_mods" >/dev/null 2>&1; then
        have_torch=0
        echo "$1: no PyTorch ($_mods) for $py (set PYTHON); printing libfsdp's numbers only" >&2
    fi
}

# find_tool NAME ENV_VALUE: prints the program NAME, from the environment (ENV_VALUE, when set)
# or the build tree (./tools/NAME, ./NAME, or tools/ beside $here); nothing when not found.
find_tool() {
    if [ -n "$2" ]; then echo "$2"; return; fi
    for _c in "./tools/$1" "./$1" "$here/../tools/$1" "$here/../_build/tools/$1"; do
        if [ -x "$_c" ]; then echo "$_c"; return; fi
    done
}
