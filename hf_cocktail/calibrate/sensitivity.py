"""How much each Cocktail layer's code widths add to the KL divergence from FP16 on one prompt.

The prompt is prefilled once at full precision (``DynamicCache(config=model.config)``: sliding-window layers hold
their window as the model's own cache does). Tokens after the prompt are teacher-forced through copies of that
prefill whose full-attention layers' context keys/values are the store's round trip
(:class:`.fake_quant.FakeQuantizer`): first with every probed layer at the base widths, then, for each layer and each
width, with that one layer changed. A delta is the width's mean KL (over the fed positions) minus the base's.

Shapes: keys/values ``(1, H_kv, T, D)``; logits ``(n, V)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from hf_cocktail.cache.layout import is_full_attention
from hf_cocktail.calibrate.divergence import kl_and_top1, teacher_force
from hf_cocktail.calibrate.fake_quant import FakeQuantizer

Pair = tuple[int, int]


def cocktail_layer_indices(model_config) -> list[int]:
    """The model layers a ``CocktailCache`` quantizes (full attention), as :mod:`hf_cocktail.cache.layout` decides."""
    return [i for i, layer in enumerate(DynamicCache(config=model_config).layers) if is_full_attention(layer)]


class LayerProbe:
    """KL divergence from FP16 over caches whose probed layers hold their context at chosen widths.

    ``dyn``: the full-precision prefill; ``span``: ``[start, end)`` of the context tokens; ``tokens_in (1, n)``: the
    tokens fed after the prompt; ``ref_logits (n, V)``: FP16's logits at those positions; ``layers``: the probed
    layers (default every layer; they must be full-attention layers)."""

    def __init__(self, model, dyn, span, fq: FakeQuantizer, tokens_in, ref_logits, layers: Sequence[int] | None = None):
        self.model, self.dyn, self.fq, self.tokens_in, self.ref = model, dyn, fq, tokens_in, ref_logits
        self.layers = list(range(len(dyn.layers))) if layers is None else list(layers)
        self.span = span
        self._memo: dict[tuple[int, str, int], torch.Tensor] = {}

    @property
    def num_layers(self) -> int:
        """How many layers are probed."""
        return len(self.layers)

    def _context(self, layer: int, side: str, bits: int) -> torch.Tensor:
        key = (layer, side, bits)
        if key not in self._memo:
            s, e = self.span
            src = self.dyn.layers[layer]
            x = (src.keys if side == "k" else src.values)[0, :, s:e]
            self._memo[key] = (self.fq.keys if side == "k" else self.fq.values)(x, bits).to(x.dtype)
        return self._memo[key]

    def _cache(self, widths: Sequence[Pair]) -> DynamicCache:
        probed = dict(zip(self.layers, widths))
        cache = DynamicCache(config=self.model.config)
        s, e = self.span
        for i, src in enumerate(self.dyn.layers):
            if i not in probed:
                cache.layers[i] = copy.deepcopy(src)
                continue
            k, v = src.keys.clone(), src.values.clone()
            k[0, :, s:e] = self._context(i, "k", probed[i][0])
            v[0, :, s:e] = self._context(i, "v", probed[i][1])
            cache.update(k, v, i)
        return cache

    def kl(self, widths: Sequence[Pair]) -> float:
        """Mean KL over the fed positions with probed layer ``self.layers[j]``'s context at ``widths[j] = (key_bits,
        value_bits)``."""
        if len(widths) != len(self.layers):
            raise ValueError(f"widths has {len(widths)} pairs but {len(self.layers)} layers are probed")
        kl, _ = kl_and_top1(self.ref, teacher_force(self.model, self._cache(widths), self.tokens_in, False))
        return float(kl.mean())


def measured(base: Sequence[Pair], side: int, width: int, max_step: int | None) -> list[bool]:
    """Per layer, whether ``width`` is measured on ``side`` (0 keys, 1 values): it is not the layer's base width and,
    with ``max_step``, within ``max_step`` bits of it."""
    return [b[side] != width and (max_step is None or abs(b[side] - width) <= max_step) for b in base]


def probe_deltas(
    probe: LayerProbe,
    base: Sequence[Pair],
    key_options: Sequence[int],
    value_options: Sequence[int],
    tick: Callable[[], None] = lambda: None,
    max_step: int | None = None,
) -> dict:
    """``{"base_kl", "key_deltas": {width: [delta or None per probed layer]}, "value_deltas": ...}``: the KL with
    every probed layer at ``base`` and, per layer, the delta of each key width (values at the layer's base, even
    above the keys: the deltas are parts of a sum) and each value width (keys at the base); ``None`` where the width
    is the layer's base or more than ``max_step`` bits from it. ``tick`` runs after every forward."""
    if len(base) != probe.num_layers:
        raise ValueError(f"base has {len(base)} (key_bits, value_bits) pairs but {probe.num_layers} layers are probed")
    base_kl = probe.kl(base)
    tick()

    def deltas(side: int, width: int) -> list[float | None]:
        out: list[float | None] = []
        for j, on in enumerate(measured(base, side, width, max_step)):
            if not on:
                out.append(None)
                continue
            pair = (width, base[j][1]) if side == 0 else (base[j][0], width)
            out.append(probe.kl([pair if i == j else b for i, b in enumerate(base)]) - base_kl)
            tick()
        return out

    return {
        "base_kl": base_kl,
        "key_deltas": {str(b): deltas(0, b) for b in key_options},
        "value_deltas": {str(b): deltas(1, b) for b in value_options},
    }
