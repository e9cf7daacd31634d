"""One layer's decode step at a long context, alone: the backend's attention over a random store and the append of
one new token, for the stored formats of ``recommended()`` and of the 8-bit settings (SmolLM2's heads: H_kv 3, n_rep
3, D 64, by default). Prints the best of ``--repeat`` timings (µs). Run it from two checkouts to compare them on the
same machine at the same moment (A/B in alternation):

    (cd /tmp/before && PYTHONPATH=. python /path/to/this/eval/benchmarks/layer_step.py --label before)
    PYTHONPATH=. python -m eval.benchmarks.layer_step --label after

(the script imports only ``hf_cocktail``, so the checkout on ``PYTHONPATH`` is the one measured).

Store: ``--tokens`` context tokens of one sequence, 100 at full precision (the first 40, the last 60), the rest in
INT4-key chunks of 32 with 3-bit values, Hadamard-rotated; ``recommended``: fp16 scales and zeros in value groups of
64; ``s8_f8``: 8-bit scales and zeros (groups of 32) and the 8-bit full part.
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch

from hf_cocktail.decode import dispatch
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

FORMATS = {
    "recommended": dict(group_size=64, scale_bits=16, full_part_bits=16),
    "s8_f8": dict(group_size=32, scale_bits=8, full_part_bits=8),
}


def build(fmt: str, tokens: int, H: int, D: int) -> LayerStore:
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, H, tokens, D, generator=g) for _ in range(2))
    full = torch.cat([torch.arange(0, 40), torch.arange(tokens - 60, tokens)])
    positions = [{"full": full, 4: torch.arange(40, tokens - 60), 2: torch.arange(0)}]
    f = FORMATS[fmt]
    return LayerStore.build(
        k,
        v,
        positions,
        32,
        f["group_size"],
        torch.float16,
        rotation=Rotation.make("hadamard", H, D, 0),
        max_value_bits=3,
        scale_bits=f["scale_bits"],
        full_part_bits=f["full_part_bits"],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.benchmarks.layer_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="", help="printed before each line (e.g. the checkout)")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--n-rep", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    H, D = args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, H * args.n_rep, 1, D, generator=g)
    kn, vn = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
    for fmt in FORMATS:
        store = build(fmt, args.tokens, H, D)
        attend = lambda: dispatch.split_precision_attention(q, store, D**-0.5, args.backend)  # noqa: E731
        append = lambda: (store.append(kn, vn), store.full.truncate(1))  # noqa: E731
        best = lambda fn, n: min(timeit.repeat(fn, number=n, repeat=args.repeat)) / n * 1e6  # noqa: E731
        print(f"{args.label} {fmt}: attention {best(attend, 20):.0f} us, append {best(append, 200):.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
