#!/usr/bin/env bash
# The GPU check in one command: everything the GPU issue lists, on a GPU machine with no package
# registry, within GPU_CHECK_BUDGET_S (560 s), every table and log written into OUTDIR.
#
#   bash scripts/gpu_check.sh [--quick] [OUTDIR]     # OUTDIR: $OUT if set, else ./gpu-check-out
#
# On the GPU machine (device tool, carry [".whl"] from `bash scripts/gpu_wheels.sh`):
#   bash scripts/gpu_check.sh "$OUT"
# It installs .whl/*.whl there first (python3 -m pip install --no-index --no-deps --target
# /tmp/site), and runs elastic_nb from this tree (PYTHONPATH, no pip install: that would need the
# build backend and node).
#
# Steps, most wanted first (scripts/gpu_check.py, STEPS), each with a time limit of its own; a
# step that fails does not stop the next, and one that would start with too little of the budget
# left is recorded as not run:
#   machine        nvidia-smi, torch, CUDA and NCCL versions
#   env            the wheels installed; every pin, Requires-Dist and floor met; the imports
#   oom-hang       issue item 1: benchmarks/gpu_oom_hang.py --device cuda (NCCL, 2 ranks)
#   nccl-timeout   item 2: tests/test_cuda.py's NCCL collective timeout, --async-error-handling 0-3
#   cuda-tests     items 3-4: every other test marked cuda; keeps the --memory-history snapshot
#   p2-failure, p6-throughput, p1-launch   item 5: the benchmarks with --device cuda, beside torchrun
# Where torch sees no CUDA device (the CPU rehearsal) the benchmarks run their CPU stand-ins,
# short, and the cuda tests report skipped; the summary says which steps need CUDA.
#
# OUTDIR gets at most four files: summary.md (rewritten after every step: the machine, a table of
# the steps with status and seconds, each step's tables and each test's outcome), logs.tar.gz
# (every log, the junit reports, the jobs' run directories' logs), and where the memory-history
# test ran, memory_snapshot.pickle (torch's snapshot of a real OOM, for tests/data/) with the
# cell it names, memory_snapshot_cell.py.
#
# GPU_CHECK_QUICK=1 (or --quick): one run of each benchmark, shorter ones. GPU_CHECK_ONLY="step
# ...": run only these (machine and env always run). GPU_CHECK_BUDGET_S: the whole budget.
# PYTHON: the interpreter (python3). GPU_CHECK_SITE: where the wheels go (/tmp/site);
# GPU_CHECK_INSTALL=0|1: never / always install them (by default: when there are wheels and this
# is the CPython 3.12 they are for). Exit 0 when every step is as good as the machine allows
# (on a GPU: every step passed).
set -uo pipefail
# All of it in one group, read whole before it runs: an edit of this file mid-run cannot change it.
{
cd "$(dirname "$0")/.."
ROOT=$PWD

QUICK=${GPU_CHECK_QUICK:-0}
OUTDIR=""
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) OUTDIR=$arg ;;
  esac
done
OUTDIR=${OUTDIR:-${OUT:-$ROOT/gpu-check-out}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-560}
SITE=${GPU_CHECK_SITE:-/tmp/site}
T0=$(date +%s)
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
LOGS=$WORK/logs
mkdir -p "$LOGS" "$WORK/snapshots"
# Every process a step starts carries this in its environment: what a step leaves running is
# found by it (and only it) and ended before the next step starts.
NONCE=$(basename "$WORK")
rm -f "$OUTDIR/summary.md" "$OUTDIR/logs.tar.gz" "$OUTDIR"/memory_snapshot*
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check] $*" | tee -a "$LOGS/check.log"; }

# The processes carrying this run's marker (this shell and its subshells do not).
marked() {
  grep -lzx "GPU_CHECK_RUN=$NONCE" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}

# After a step: give what it started 10 s to end by itself, then end the rest (TERM, then KILL).
# Prints how many were left.
sweep() {
  local left=() i
  for i in $(seq 50); do
    mapfile -t left < <(marked)
    (( ${#left[@]} == 0 )) && { echo 0; return; }
    sleep 0.2
  done
  ps -o pid,ppid,etime,args -p "$(IFS=,; echo "${left[*]}")" >> "$LOGS/check.log" 2>&1
  kill -TERM "${left[@]}" 2>/dev/null
  sleep 3
  local still=()
  mapfile -t still < <(marked)
  (( ${#still[@]} )) && kill -KILL "${still[@]}" 2>/dev/null
  echo "${#left[@]}"
}

gpu_after() {
  [[ $CUDA == 1 ]] && command -v nvidia-smi >/dev/null || return 0
  local used apps
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | paste -sd+)
  apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c '[0-9]')
  echo "${used} MiB used, ${apps} processes"
}

# The summary and the logs' archive, rewritten after every step.
publish() {
  "$PYTHON" scripts/gpu_check.py report "$WORK" "$OUTDIR" >/dev/null 2>>"$LOGS/check.log"
  local runs=()
  [[ -d $WORK/runs ]] && runs=(runs)
  tar -czf "$OUTDIR/logs.tar.gz.tmp" -C "$WORK" logs "${runs[@]}" 2>/dev/null &&
    mv "$OUTDIR/logs.tar.gz.tmp" "$OUTDIR/logs.tar.gz"
}

record() {  # NAME KIND RC SECONDS LIMIT LEFT GPU NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$WORK/steps.tsv"
  publish
}

# step NAME KIND LIMIT CMD...: KIND is plain, gpu (a GPU check that exits non-zero when one of
# its checks fails; a stand-in on the CPU), bench (figures beside torchrun; a stand-in on the CPU)
# or pytest (writes $LOGS/NAME.xml).
step() {
  local name=$1 kind=$2 limit=$3
  shift 3
  if [[ -n ${GPU_CHECK_ONLY:-} && $name != machine && $name != env &&
        " $GPU_CHECK_ONLY " != *" $name "* ]]; then
    record "$name" "$kind" notselected "" "" "" "" "not in GPU_CHECK_ONLY"
    return
  fi
  # A step ends within the budget, its kill (10 s) and sweep (13 s) included.
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < 45 )); then
    say "$name: not run, ${left} s of the ${BUDGET} s budget left"
    record "$name" "$kind" notrun "" "" "" "" "out of time: ${left} s of the ${BUDGET} s budget left"
    return
  fi
  (( limit > left - 25 )) && limit=$(( left - 25 ))
  local log=$LOGS/$name.log
  say "=== $name (limit ${limit} s): $*"
  echo "\$ $*" > "$log"
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" env GPU_CHECK_RUN="$NONCE" "$@" > >(tee -a "$log") 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local leftover
  leftover=$(sweep)
  local seconds
  seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  say "=== $name: exit $rc after $seconds s; processes left behind: $leftover"
  record "$name" "$kind" "$rc" "$seconds" "$limit" "$leftover" "$(gpu_after)" ""
}

# ---- machine --------------------------------------------------------------------------------
say "out: $OUTDIR; work: $WORK; budget ${BUDGET} s; quick=$QUICK"
CUDA=0
step machine plain 60 "$PYTHON" scripts/gpu_check.py machine "$WORK"
if [[ -f $WORK/machine.json ]] &&
   "$PYTHON" -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["cuda_devices"] < 1)' \
     "$WORK/machine.json"; then
  CUDA=1
fi
if [[ $CUDA == 1 ]]; then
  DEVICE=cuda
  say "CUDA: the real checks"
else
  DEVICE=cpu
  say "no CUDA device: the CPU rehearsal (stand-ins; the cuda tests skip)"
fi

# ---- env: the wheels, then what Python finds ---------------------------------------------------
INSTALL=${GPU_CHECK_INSTALL:-auto}
WHEELS=(.whl/*.whl)
[[ -e ${WHEELS[0]} ]] || WHEELS=()
if [[ $INSTALL == auto ]]; then
  INSTALL=0
  if (( ${#WHEELS[@]} )) &&
     "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    INSTALL=1
  fi
fi
if [[ $INSTALL == 1 ]]; then
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  ENV_CMD="$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
--target '$SITE' .whl/*.whl && echo 'installed ${#WHEELS[@]} wheels into $SITE' && "
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  ENV_CMD="echo 'wheels: not installed (${#WHEELS[@]} in .whl/, for CPython 3.12; \
GPU_CHECK_INSTALL=$INSTALL): the packages of this Python' && "
fi
ENV_CMD+="$PYTHON scripts/gpu_wheels_check.py --installed && $PYTHON -c 'import elastic_nb, \
elastic_nb.kernel.magic, elastic_nb.kernel.dashboard.widget, elastic_nb.supervisor.nodes.channel, \
ipykernel, jupyter_client, IPython, ipywidgets, anywidget, zmq, torch, tests.kernel; \
print(\"imports: ok; elastic_nb from\", elastic_nb.__file__)'"
step env plain 120 bash -c "$ENV_CMD"

# ---- the checks ------------------------------------------------------------------------------
if [[ $QUICK == 1 || $CUDA == 0 ]]; then
  RUNS=1 STEPS=200
else
  RUNS=3 STEPS=1500
fi
# The cuda tests in parallel (pytest-xdist, --dist load over pyproject's loadscope: a module's
# tests spread over the workers, each with a kernel of its own): the NCCL timeout's four modes
# mostly wait out their 20 s side by side, on a GPU with room for all of them. Where they skip,
# -n 0 (xdist's flag, no workers to start).
if [[ $CUDA == 1 ]]; then
  NCCL_WORKERS=4 CUDA_WORKERS=3
else
  NCCL_WORKERS=0 CUDA_WORKERS=0
fi
# --basetemp: the tests' run directories stay in WORK, and their logs go into the archive.
pytest_step() {  # NAME LIMIT PYTEST-ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name" pytest "$limit" "$PYTHON" -m pytest -p no:cacheprovider -v -rA --dist load \
    --timeout=150 --basetemp="$WORK/pytest-$name" --junitxml="$LOGS/$name.xml" "$@"
  keep_runs "$WORK/pytest-$name" "$name"
}
# The jobs' logs (rank output, events, summaries: text, 2 MB at most each) into WORK/runs/NAME.
keep_runs() {
  [[ -d $1 ]] || return 0
  (cd "$1" && find . -type f \( -name '*.out' -o -name '*.err' -o -name 'events.jsonl' \
    -o -name 'summary.json' -o -name 'spec.json' -o -name '*.stacks' -o -name 'cell.py' \
    -o -name '*.failure.json' \) -size -2M -print0 |
    tar -cf - --null -T - 2>/dev/null) | (mkdir -p "$WORK/runs/$2" && tar -xf - -C "$WORK/runs/$2")
  publish
}
CUDA_FILES=()
mapfile -t CUDA_FILES < <(grep -l 'pytest.mark.cuda' tests/test_*.py)

step oom-hang gpu 150 "$PYTHON" benchmarks/gpu_oom_hang.py --device "$DEVICE" --runs "$RUNS" \
  --collective-timeout 30
pytest_step nccl-timeout 180 -n "$NCCL_WORKERS" tests/test_cuda.py -m cuda -k collective_timeout
GPU_CHECK_SNAPSHOTS=$WORK/snapshots pytest_step cuda-tests 180 -n "$CUDA_WORKERS" \
  "${CUDA_FILES[@]}" -m cuda -k "not collective_timeout"
for f in "$WORK"/snapshots/*; do
  [[ -f $f ]] || continue
  if (( $(stat -c %s "$f") > 15 * 1024 * 1024 )); then
    gzip -c "$f" > "$OUTDIR/$(basename "$f").gz"
  else
    cp "$f" "$OUTDIR/"
  fi
done
step p2-failure bench 90 "$PYTHON" benchmarks/failure.py --device "$DEVICE" --runs "$RUNS"
step p6-throughput bench 100 "$PYTHON" benchmarks/throughput.py --device "$DEVICE" --runs "$RUNS" \
  --steps "$STEPS"
step p1-launch bench 90 "$PYTHON" benchmarks/launch.py --device "$DEVICE" --runs "$RUNS" --warm-only

# ---- the end ----------------------------------------------------------------------------------
"$PYTHON" scripts/gpu_check.py report "$WORK" "$OUTDIR"
verdict=$?
publish
say "took $(( $(date +%s) - T0 )) s; summary: $OUTDIR/summary.md"
echo
sed -n '1,/^Verdict/p' "$OUTDIR/summary.md"
rm -rf "$WORK"
exit $verdict
}
