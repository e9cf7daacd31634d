"""A/B of two builds of the ``cpu_ops`` extension (e.g. before / after a kernel change) in one process, alternating,
on random stores of the preset-like formats at one context length: the fused decode attention of one layer, 3 KV
heads x 3 query rows (SmolLM2's), through the decode dispatch.

Builds are named by their extension folder under the torch extensions directory (``hf_cocktail_cpu_ops_<hash>``;
``python -c "import cpu_ops._build as b; print(b.extension().__file__)"`` builds and names the checkout's). Prints,
per format, each build's min ms per call and the median over rounds of the per-round ratio B / A. One process, so a
machine that drifts in speed slows both alike.

    PYTHONPATH=. python -m eval.benchmarks.kernel_ab hf_cocktail_cpu_ops_112ef63a7cffac9b \\
        hf_cocktail_cpu_ops_ce4ef676e39ad2f2 --context 8000 --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch
from torch.utils import cpp_extension
from tqdm import tqdm

import cpu_ops.attention as cpu_attention
from hf_cocktail.decode import dispatch
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

H_KV, N_REP, D = 3, 3, 64


def load_build(name: str):
    """The extension module ``name`` from the torch extensions directory."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = os.path.join(root, name, f"{name}.so")
    if not os.path.exists(path):
        raise SystemExit(f"no build {name}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stores(context: int) -> dict[str, LayerStore]:
    """One layer's store per format: context tokens packed, 96 full-precision tokens after them."""
    g = torch.Generator().manual_seed(0)
    T = context + 96
    k, v = torch.randn(1, H_KV, T, D, generator=g), torch.randn(1, H_KV, T, D, generator=g)
    ctx, cut = torch.arange(context), context * 3 // 8

    def build(bits_of, scale_bits, rotated, full_part_bits):
        positions = [{"full": torch.arange(context, T), **bits_of}]
        rotation = Rotation.make("hadamard", H_KV, D, seed=1) if rotated else None
        return LayerStore.build(
            k, v, positions, 32, 32, torch.float16, rotation=rotation, full_part_bits=full_part_bits,
            scale_bits=scale_bits,
        )  # fmt: skip

    return {
        "int4 s16": build({4: ctx}, 16, False, 16),
        "int3 s8 rot f8": build({3: ctx}, 8, True, 8),
        "int4 s8 rot f8": build({4: ctx}, 8, True, 8),
        "4+2 s8 rot f8": build({4: ctx[:cut], 2: ctx[cut:]}, 8, True, 8),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build_a")
    p.add_argument("build_b")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="calls per timed block")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    builds = {name: load_build(name) for name in (args.build_a, args.build_b)}
    formats = stores(args.context)
    query = torch.randn(1, H_KV * N_REP, 1, D, generator=torch.Generator().manual_seed(1))
    times: dict[tuple[str, str], list[float]] = {(b, f): [] for b in builds for f in formats}
    saved = cpu_attention.extension
    try:
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for name, module in builds.items():
                cpu_attention.extension = lambda m=module: m
                for fmt, store in formats.items():
                    dispatch.split_precision_attention(query, store, D**-0.5, "auto")
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        dispatch.split_precision_attention(query, store, D**-0.5, "auto")
                    times[(name, fmt)].append((time.perf_counter() - t0) / args.calls * 1e3)
    finally:
        cpu_attention.extension = saved
    a, b = builds
    print(f"context {args.context}, {H_KV} KV heads x {N_REP} rows, D={D}; A = {a} ({builds[a].kernel_target()}), "
          f"B = {b} ({builds[b].kernel_target()})")  # fmt: skip
    for fmt in formats:
        ta, tb = times[(a, fmt)], times[(b, fmt)]
        ratio = statistics.median(y / x for x, y in zip(ta, tb))
        print(f"{fmt:16s} A min {min(ta):.3f} ms  B min {min(tb):.3f} ms  B/A median {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
