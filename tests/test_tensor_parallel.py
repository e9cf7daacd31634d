"""Tensor parallelism as transformers users run it (``tp_plan="auto"`` under ``torchrun``): 2 CPU processes over
gloo, a tiny random Llama saved to a folder; each rank's greedy tokens equal one process's, uniform 16-bit and
recommended() (plain generate). About 20 s: two processes importing transformers.

A rank caches its half of the key/value heads and rotates head ``h`` of its half with the matrix of head ``h``
(:mod:`hf_cocktail.storage.rotation` seeds the matrices by the cache's head index): the same attention in exact
arithmetic, other rounding than one process's. A random model's greedy margins (~0.01) are below that rounding's
effect, so the model's attention outputs are scaled by 0.3: its tokens then no longer hinge on the rounding, and a
rank that cached or read the wrong heads still changes them."""

import json
import os
import socket
import subprocess
import sys

import torch

from .conftest import make_tiny_llama
from .tensor_parallel_worker import greedy, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "tensor_parallel_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_tensor_parallel_ranks_generate_what_one_process_does(tmp_path):
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    model = make_tiny_llama(num_kv_heads=2, heads=4, head_dim=32, layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
    model.save_pretrained(model_dir)
    one = {name: greedy(model, config) for name, config in settings().items()}
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd = [*torchrun, "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), WORKER, model_dir, out_dir]
    run = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        got = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert got["world_size"] == 2
        for name, (tokens, kv_heads, packed) in one.items():
            rank_tokens, rank_kv_heads, rank_packed = got["runs"][name]
            assert rank_tokens == tokens, (rank, name)
            assert kv_heads == 2 and rank_kv_heads == 1  # each rank caches its half of the heads
            # recommended(): the prompt's [4, 80) packed, then one chunk of 8 of its tail and the generated tokens
            assert rank_packed == packed == (0 if name == "uniform16" else 76 + 8)
