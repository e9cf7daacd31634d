"""Why pre-RoPE keys gain or not: per-channel key ranges in C-token chunks before and after RoPE, on one window.

A channel pair ``(i, i + D/2)`` turns by ``C * inv_freq_i`` radians over a chunk; a *fast* pair turns more than 1
rad. Per quantized layer: the mean chunk range after / before RoPE, the fast pairs, their share of the key energy
(mean squared key), and the range ratio on fast and on slow channels.

Usage::

    python -m eval.formats.ranges --model gemma-3-270m --threads 1
"""

from __future__ import annotations

import argparse

import torch

from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.texts import make_window, read_texts
from hf_cocktail.calibrate.validate import prepare
from hf_cocktail.storage.quant import whole_chunks

from ..cli import UsageError, run_cli
from .rope import layer_cos_sin, undo_rope


def chunk_ranges(k: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean over heads and chunks of every channel's max - min in a chunk: ``k (H, N, D)`` -> ``(D,)``."""
    c = whole_chunks(k.float(), chunk_size)
    return (c.amax(2) - c.amin(2)).mean((0, 1))


def fast_channels(cos: torch.Tensor, sin: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """bool ``(D,)``: the channels of pairs turning more than 1 rad over ``chunk_size`` positions (from the angle
    step between the first two positions of ``cos``/``sin (N, D)``, N >= 2)."""
    half = cos.shape[-1] // 2
    step = torch.atan2(sin[1, :half], cos[1, :half]) - torch.atan2(sin[0, :half], cos[0, :half])
    return (chunk_size * torch.remainder(step, 2 * torch.pi) > 1.0).repeat(2)


def layer_line(model, layer: int, k: torch.Tensor, positions: torch.Tensor, chunk_size: int) -> dict:
    """The numbers of one layer (module docstring) for its context keys ``k (H, N, D)`` at ``positions``."""
    cos, sin = layer_cos_sin(model, layer, positions)
    post, pre = chunk_ranges(k, chunk_size), chunk_ranges(undo_rope(k, cos, sin), chunk_size)
    fast = fast_channels(cos, sin, chunk_size)
    energy = (k.float() ** 2).mean((0, 1))
    return {
        "layer": layer,
        "range_ratio": float(post.mean() / pre.mean()),
        "fast_pairs": int(fast.sum()) // 2,
        "pairs": k.shape[-1] // 2,
        "fast_energy_share": float(energy[fast].sum() / energy.sum()),
        "fast_range_ratio": float(post[fast].mean() / pre[fast].mean()) if fast.any() else float("nan"),
        "slow_range_ratio": float(post[~fast].mean() / pre[~fast].mean()) if (~fast).any() else float("nan"),
    }


def main(argv=None) -> int:
    from .cli import held_out_texts, load

    p = argparse.ArgumentParser(prog="python -m eval.formats.ranges", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.chunk_size < 2:
        raise UsageError(f"--chunk-size must be >= 2, got {args.chunk_size}")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    windows = (make_window(tok, name, text, 2048, 64, 32) for name, text in read_texts(held_out_texts()))
    w = next(w for w in windows if w is not None)
    prep = prepare(model, tok, w)
    s, e = prep.span
    print(f"{args.model}, window {w.name}, context tokens {e - s}, C={args.chunk_size}")
    for layer in cocktail_layer_indices(model.config):
        r = layer_line(model, layer, prep.prefill.layers[layer].keys[0, :, s:e], torch.arange(s, e), args.chunk_size)
        print(
            f"layer {layer}: chunk range after/before RoPE {r['range_ratio']:.2f}x; fast pairs {r['fast_pairs']}/"
            f"{r['pairs']} with {r['fast_energy_share']:.3f} of the key energy; range ratio fast "
            f"{r['fast_range_ratio']:.2f}x, slow {r['slow_range_ratio']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    run_cli(main)
