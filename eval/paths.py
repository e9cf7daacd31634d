"""Where things are: the repository root and the evaluation data (``../shared/data``, never copied into the
repository; ``HF_COCKTAIL_DATA`` points elsewhere, e.g. from a second checkout)."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get("HF_COCKTAIL_DATA") or os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))
ESSAY_DIR = os.path.join(DATA_DIR, "paul_graham_essays")
LONGBENCH_DIR = os.path.join(DATA_DIR, "longbench")
GPU_PACKAGES = os.path.join(os.path.dirname(DATA_DIR), "gpu_machine", "packages.txt")  # the GPU machine's python3
# SmolLM2's per-layer width allocations (eval.layers, left at c4e549a): the first round (around 4-bit keys / 3-bit
# values), the second (around the first round's 3.0-bit choice) and the third (around the second's 3.1-bit choice)
LAYER_BITS_FILES = {
    "": os.path.join(REPO_ROOT, "eval", "results", "layer_calibration", "round1", "layer_bits.json"),
    "r2": os.path.join(REPO_ROOT, "eval", "results", "layer_calibration", "round2", "layer_bits.json"),
    "r3": os.path.join(REPO_ROOT, "eval", "results", "layer_calibration", "round3", "layer_bits.json"),
}
