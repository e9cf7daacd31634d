#!/usr/bin/env bash
# One prepared script for a lent GPU session (at most ~10 minutes on an H200):
#   the tests marked `gpu` (kernels at realistic sizes, layers split between CPU and GPU), then the kernel benchmark.
# Usage (device tool, from the repo root):  bash eval/gpu_check.sh "$OUT"
set -uo pipefail
OUT=${1:-gpu_out}
mkdir -p "$OUT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/pip install -q -e ".[triton,dev]" && .venv/bin/pip install -q hqq
fi
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
.venv/bin/python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 .venv/bin/python -m pytest -q -ra -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 420 .venv/bin/python eval/bench_kernels.py --out "$OUT/bench_kernels.csv" 2>&1 | tee "$OUT/bench_kernels.txt"
