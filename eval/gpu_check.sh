#!/usr/bin/env bash
# The GPU check, one prepared run on a lent GPU machine (one H200; about 10 minutes; no package registry there).
#
#   bash eval/gpu_check.sh OUT_DIR     on the GPU machine, from a copy of the repository with eval/gpu_wheels carried
#                                      (device tool: carry ["eval/gpu_wheels"], OUT_DIR "$OUT")
#   bash eval/gpu_check.sh --dry-run   here: checks that everything it imports is on the GPU machine's package list
#                                      (../shared/gpu_machine/packages.txt) or shipped as a wheel, and that nothing
#                                      calls pip without --no-index (python -m eval.gpu_check_dry_run)
#
# It uses the machine's python3 as it is (torch, transformers, triton, accelerate, pytest are there): no venv, no
# download, the project on PYTHONPATH=., the few missing packages installed from eval/gpu_wheels/ (filled here by
# `bash eval/fetch_gpu_wheels.sh`) into a folder under /tmp with `pip install --no-index --no-deps --target`.
# Steps, each under its own timeout and all inside one overall budget (GPU_CHECK_BUDGET_S, default 480 s); a failing
# step does not stop the later ones:
#   1. machine: GPU, driver, versions        3. gpu tests: python3 -m pytest -m gpu tests
#   2. wheels: install the shipped wheels    4. triton_aot: the model-shaped split attention compiled ahead of time
#                                               with the machine's triton for sm_90, 32 compiles (python -m triton_ops.aot
#                                               --preset ci: registers, stack, spills, shared memory, load widths)
#   5. bench_kernels: fused kernel vs FP16 SDPA vs dequantize+SDPA, 4K/32K/128K, batch 1 and 8, % of the HBM peak
#   6. roofline: bench_kernels' times as a fraction of the roofline's prediction (bytes / the GPU's HBM bandwidth,
#      python -m eval.benchmarks.roofline --compare)
#   7. bench_decode_random: end-to-end decode latency per cache on a random Llama-3-8B-shaped model (4K, 32K)
# Outputs (all in OUT_DIR): gpu_check.log (everything printed), steps.csv (step, exit code, seconds),
# gpu_tests.xml (JUnit), triton_aot/report.md and report.json, bench_kernels.csv, roofline_vs_measured.csv,
# bench_decode_random.csv.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--dry-run" ]; then
  DRY_PY=${DRY_PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  exec "$DRY_PY" -m eval.gpu_check_dry_run --script eval/gpu_check.sh --wheels "${GPU_WHEELS_DIR:-eval/gpu_wheels}"
fi

OUT=${1:?usage: bash eval/gpu_check.sh OUT_DIR | --dry-run}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY=${GPU_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-480}))
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=".:$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "step,exit_code,seconds" > "$OUT/steps.csv"

step() {  # step NAME TIMEOUT_S COMMAND...: timed out at min(TIMEOUT_S, what is left of the budget)
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) t0=$SECONDS rc
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "=== $name: skipped (budget spent)" | tee -a "$LOG"
    echo "$name,skipped,0" >> "$OUT/steps.csv"
    return
  fi
  echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  echo "$name,$rc,$((SECONDS - t0))" >> "$OUT/steps.csv"
}

machine_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)"
}

install_wheels() {
  ls eval/gpu_wheels/*.whl || { echo "no wheels in eval/gpu_wheels (carry it; fill it with eval/fetch_gpu_wheels.sh)"; return 1; }
  "$PY" -m pip install --no-index --no-deps --quiet --target "$SITE" eval/gpu_wheels/*.whl
}

export PY SITE
export -f machine_info install_wheels
step machine 30 bash -c machine_info
step wheels 45 bash -c install_wheels
step gpu_tests 100 "$PY" -m pytest -q -ra -m gpu tests -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml"
step triton_aot 60 "$PY" -m triton_ops.aot --preset ci --targets 90 --out "$OUT/triton_aot" --no-progress
step bench_kernels 150 "$PY" -m eval.benchmarks.bench_kernels --out "$OUT/bench_kernels.csv"
step roofline 20 "$PY" -m eval.benchmarks.roofline --compare "$OUT/bench_kernels.csv" --out "$OUT"
step bench_decode_random 120 "$PY" -m eval.benchmarks.bench_decode_random --out "$OUT/bench_decode_random.csv" \
  --time-budget-s 80
echo "=== done in $SECONDS s; outputs: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
