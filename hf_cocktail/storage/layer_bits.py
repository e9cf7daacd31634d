"""Per-layer code widths (``CocktailConfig.layer_bits``): the most bits each layer's packed keys and values keep.

Layers of one model differ a lot in how much low-bit noise they tolerate (on SmolLM2-135M a few of 30 layers carry
most of the KL divergence; ``python -m hf_cocktail.calibrate`` measures it). ``layer_bits`` gives layer ``l`` a pair
``(key_bits, value_bits)``: a chunk the plan puts at ``b < 16`` bits stores its keys at ``min(b, key_bits)`` and its
values at ``min(b, value_bits)`` (and at most ``CocktailConfig.value_bits``) in that layer. FP16 chunks stay FP16 in
every layer, so the query-relevant chunks the search finds keep full precision. One plan serves every layer: a
layer merges the plan's parts above its key width into that width (:func:`capped_positions`).

Plain data here: no model, no kernels. Shapes: positions are 1-D LongTensors of prompt positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_cocktail.storage.quant import SUPPORTED_BITS

Pairs = tuple[tuple[int, int], ...]


def _pair_ok(p: Any) -> bool:
    return (
        isinstance(p, (list, tuple))
        and len(p) == 2
        and all(type(b) is int and b in SUPPORTED_BITS for b in p)
        and p[1] <= p[0]
    )


def check_layer_bits(layer_bits: Any) -> Pairs | None:
    """Validate ``layer_bits`` (``None`` or one ``(key_bits, value_bits)`` pair per layer) and return it as a tuple of
    int pairs (JSON gives lists)."""
    if layer_bits is None:
        return None
    allowed = f"pairs (key_bits, value_bits) with both in {SUPPORTED_BITS} and value_bits <= key_bits"
    if not isinstance(layer_bits, (list, tuple)) or not layer_bits:
        raise ValueError(f"layer_bits must be None or a non-empty list of {allowed}, one per layer; got {layer_bits!r}")
    bad = [(i, p) for i, p in enumerate(layer_bits) if not _pair_ok(p)]
    if bad:
        raise ValueError(f"layer_bits must hold {allowed}; entries (index, value) {bad[:4]} are not")
    return tuple((int(k), int(v)) for k, v in layer_bits)


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def check_layer_count(layer_bits: Pairs | None, num_layers: int, cocktail_layers: Sequence[int] | None = None) -> None:
    """``layer_bits`` must name exactly the model's layers, or exactly its full-attention (Cocktail) layers
    ``cocktail_layers`` (indices; ``None``: every layer is one)."""
    if layer_bits is None:
        return
    n_cocktail = num_layers if cocktail_layers is None else len(cocktail_layers)
    if len(layer_bits) in (num_layers, n_cocktail):
        return
    if n_cocktail == num_layers:
        raise ValueError(
            f"layer_bits has {_entries(len(layer_bits))} but the model has {num_layers} layers: give one "
            f"(key_bits, value_bits) pair per layer"
        )
    raise ValueError(
        f"layer_bits has {_entries(len(layer_bits))} but the model has {num_layers} layers, {n_cocktail} of them "
        f"full-attention (Cocktail) layers: give one (key_bits, value_bits) pair per layer ({num_layers}) or one per "
        f"full-attention layer ({n_cocktail}, in layer order)"
    )


def layer_pair(
    layer_bits: Pairs | None, layer_idx: int, num_layers: int | None = None, cocktail_rank: int | None = None
) -> tuple[int, int] | None:
    """Layer ``layer_idx``'s ``(key_bits, value_bits)`` cap (``None`` without ``layer_bits``). ``layer_bits`` has one
    entry per model layer, or, when its length is not the model's ``num_layers``, one per full-attention (Cocktail)
    layer: then the layer takes the entry of its ``cocktail_rank`` (its index among the Cocktail layers)."""
    if layer_bits is None:
        return None
    i = layer_idx if num_layers is None or len(layer_bits) == num_layers or cocktail_rank is None else cocktail_rank
    if i >= len(layer_bits):
        raise ValueError(
            f"layer_bits has {_entries(len(layer_bits))} (layers 0..{len(layer_bits) - 1}) but the model has a layer "
            f"{layer_idx}: give one (key_bits, value_bits) pair per layer"
        )
    return layer_bits[i]


def code_widths(bits: int, pair: tuple[int, int] | None, value_bits: int | None) -> tuple[int, int]:
    """``(key, value)`` code widths of a ``bits``-bit chunk in a layer with cap ``pair`` (``None``: no cap) under the
    config's ``value_bits`` cap."""
    k, v = (bits, bits) if pair is None else (min(bits, pair[0]), min(bits, pair[1]))
    return k, v if value_bits is None else min(v, value_bits)


def mean_code_bits(bits: int, layer_bits: Pairs | None, value_bits: int | None) -> float:
    """Code bits per K/V element of a ``bits``-bit chunk, averaged over keys and values and over the layers."""
    pairs: Sequence = layer_bits or (None,)
    return sum(sum(code_widths(bits, p, value_bits)) for p in pairs) / (2 * len(pairs))


def capped_positions(positions: dict, key_cap: int | None) -> dict:
    """A plan's positions (``"full"`` and one part per packed width) for a layer whose keys keep at most ``key_cap``
    bits: parts above the cap merge into it in token order (whole chunks stay contiguous)."""
    if key_cap is None:
        return positions
    out: dict = {"full": positions["full"]}
    for bits, pos in positions.items():
        if bits != "full":
            out.setdefault(min(bits, key_cap), []).append(pos)
    for part, pieces in list(out.items()):
        if part != "full":
            out[part] = torch.sort(torch.cat(pieces)).values if len(pieces) > 1 else pieces[0]
    return out
