"""How 8-bit scales and zeros (``scale_bits=8``) round, measured: the KL divergence from FP16 when every quantized
layer's context keys/values are stored with fp16 scales and zeros, with 8-bit codes that always cover the group (the
zero code rounded down, the log-scale code up: the encoder before 2026-12-03, ``round_offset=0.0``),
or with the package's default (:func:`hf_cocktail.storage.params8.encode_params8`: both codes the nearest).

Fake quantization through calibrate's :class:`LayerProbe` (every Cocktail layer at one key/value width), on held-out
PG essays cut as the calibration cuts them. Prints one line per window and the means.

Usage::

    python -m eval.formats.params_rounding --model smollm2-135m-instruct --rotation hadamard --threads 1
    python -m eval.formats.params_rounding --model gemma-3-270m --rotation none --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics

import torch

from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.sensitivity import LayerProbe, cocktail_layer_indices
from hf_cocktail.calibrate.texts import make_window, read_texts
from hf_cocktail.calibrate.validate import prepare
from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.storage import params8
from hf_cocktail.storage.rotation import ROTATIONS

from ..cli import UsageError, run_cli
from .cli import held_out_texts, load

STORAGES = ("fp16 numbers", "8-bit covering", "8-bit nearest")
WIDTHS = ((4, 4), (3, 3), (4, 3))


# the encoder before 2026-12-03: the zero code rounded down and the log-scale code up, so that every group's
# [min, max] is covered (same decoding, same bytes)
covering_params8 = functools.partial(params8.encode_params8, round_offset=0.0)


@contextlib.contextmanager
def encoder(storage: str):
    """The 8-bit encoder of ``storage`` in place of the package's while the block runs."""
    nearest = params8.encode_params8
    params8.encode_params8 = covering_params8 if storage == "8-bit covering" else nearest
    try:
        yield
    finally:
        params8.encode_params8 = nearest


def window_kls(model, prep, layers: list[int], rotation: str | None) -> dict[tuple[str, tuple[int, int]], float]:
    """KL from FP16 of one prepared window per (storage, widths)."""
    k = prep.prefill.layers[layers[0]].keys
    out = {}
    for storage in STORAGES:
        cfg = CocktailConfig(chunk_size=32, group_size=32, rotation=rotation, scale_bits=16 if "fp16" in storage else 8)
        fq = FakeQuantizer(cfg, k.shape[1], k.shape[-1], k.dtype)
        probe = LayerProbe(model, prep.prefill, prep.span, fq, prep.continuation, prep.ref_logits, layers)
        with encoder(storage):
            for widths in WIDTHS:
                out[(storage, widths)] = probe.kl([widths] * len(layers))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.formats.params_rounding", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rotation", default="hadamard", help="none or a storage rotation (as the model's preset)")
    p.add_argument("--n-texts", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    rotation = None if args.rotation == "none" else args.rotation
    if rotation not in ROTATIONS:
        raise UsageError(f"--rotation must be none or one of {[r for r in ROTATIONS if r]}, got {args.rotation!r}")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    layers = cocktail_layer_indices(model.config)
    windows = [w for n, t in read_texts(held_out_texts()) if (w := make_window(tok, n, t, 2048, 64, 32))]
    kls: dict = {}
    for w in windows[: args.n_texts]:
        for key, kl in window_kls(model, prepare(model, tok, w), layers, rotation).items():
            kls.setdefault(key, []).append(kl)
        print(w.name, " ".join(f"{s} K{a}/V{b} {v[-1]:.5f};" for (s, (a, b)), v in kls.items()), flush=True)
    for (storage, (a, b)), v in kls.items():
        print(f"{args.model} {storage:15s} K{a}/V{b}: mean KLD {statistics.fmean(v):.5f} over {len(v)} windows")
    return 0


if __name__ == "__main__":
    run_cli(main)
