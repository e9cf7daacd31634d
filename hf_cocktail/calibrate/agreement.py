"""The fake quantization the layer sensitivity is measured with, against the real store: the KL divergence from FP16
of the base widths (4-bit keys, 3-bit values in every Cocktail layer) under each rotation, measured both ways on the
same calibration window. The sensitivity and the layer solve trust the fake numbers; this records how far the real
cache (sink tokens at full precision, the store's chunking, its attention) lands from them."""

from __future__ import annotations

from typing import Any

import torch

from hf_cocktail.calibrate.candidates import full_layer_bits, storage
from hf_cocktail.calibrate.validate import Prepared, measure
from hf_cocktail.presets.config import CocktailConfig


def base_config(prep: Prepared, cocktail: list[int], rotation: str | None, base, **fields: Any) -> CocktailConfig:
    """The real cache's config of the sensitivity's base: ``base`` ``(key_bits, value_bits)`` in every Cocktail layer,
    the calibrated storage (:func:`.candidates.storage`) with ``rotation``; ``fields`` override (e.g.
    ``sink_tokens=0``: every context token packed, as the fake quantizer packs them)."""
    k = prep.prefill.layers[cocktail[0]].keys
    widths = full_layer_bits([tuple(base)] * len(cocktail), cocktail, len(prep.prefill.layers))
    return CocktailConfig(
        **storage(k.shape[-1], rotation), uniform_bits=4, layer_bits=tuple(map(tuple, widths)), **fields
    )


@torch.no_grad()
def real_base_kl(model, tok, prep: Prepared, cocktail: list[int], rotation: str | None, base, **fields: Any) -> float:
    """The real cache's mean KL over the window's continuation at the base widths (:func:`base_config`)."""
    return measure(model, tok, prep, base_config(prep, cocktail, rotation, base, **fields))["kld"]
