"""One calibration prompt: how much each layer's code widths add to the KL divergence from FP16.

The prompt is prefilled once at full precision; FP16's greedy answer is teacher-forced through ``DynamicCache``s
whose context keys/values are the store's round trip (:class:`.fake_quant.FakeQuantizer`): first with every layer at
the base widths, then, for each layer and each option, with that one layer changed. A delta is the option's mean KL
(over the answer's positions, as ``eval.kld``'s ``answer`` segment) minus the base's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_cocktail import CocktailConfig

from ..kld.cases import KldCase
from ..kld.divergence import kl_and_top1, teacher_force
from ..kld.measure import reference_answer
from ..methods.branching import context_span, prefill
from .fake_quant import FakeQuantizer


class LayerProbe:
    """KL divergence of FP16's answer over caches whose context is quantized layer by layer at chosen widths."""

    def __init__(self, model, dyn: DynamicCache, span: tuple[int, int], fq: FakeQuantizer, answer_in, ref_logits):
        self.model, self.fq, self.answer_in, self.ref = model, fq, answer_in, ref_logits
        self.pairs = [(layer.keys, layer.values) for layer in dyn.layers]
        self.span = span
        self._memo: dict[tuple[int, str, int], torch.Tensor] = {}

    @property
    def num_layers(self) -> int:
        return len(self.pairs)

    def _context(self, layer: int, side: str, bits: int) -> torch.Tensor:
        key = (layer, side, bits)
        if key not in self._memo:
            s, e = self.span
            x = self.pairs[layer][0 if side == "k" else 1][0, :, s:e]
            self._memo[key] = (self.fq.keys if side == "k" else self.fq.values)(x, bits).to(x.dtype)
        return self._memo[key]

    def kl(self, widths: list[tuple[int, int]]) -> float:
        """Mean KL over the answer's positions with layer ``l``'s context at ``widths[l] = (key_bits, value_bits)``."""
        s, e = self.span
        cache = DynamicCache()
        for layer, ((k, v), (kb, vb)) in enumerate(zip(self.pairs, widths)):
            k, v = k.clone(), v.clone()
            k[0, :, s:e] = self._context(layer, "k", kb)
            v[0, :, s:e] = self._context(layer, "v", vb)
            cache.update(k, v, layer)
        kl, _ = kl_and_top1(self.ref, teacher_force(self.model, cache, self.answer_in, False))
        return float(kl.mean())


def measured(base: list[tuple[int, int]], side: int, width: int, max_step: int | None) -> list[bool]:
    """Per layer, whether ``width`` is measured on ``side`` (0 keys, 1 values): it is not the layer's base width and,
    with ``max_step``, within ``max_step`` bits of it."""
    return [b[side] != width and (max_step is None or abs(b[side] - width) <= max_step) for b in base]


@torch.no_grad()
def measure_case(
    model,
    tok,
    case: KldCase,
    config: CocktailConfig,
    base: list[tuple[int, int]],
    key_options: list[int],
    value_options: list[int],
    max_answer_tokens: int = 32,
    eos_token_id=None,
    tick: Callable[[], None] = lambda: None,
    max_step: int | None = None,
) -> dict:
    """One record: the KL with every layer ``l`` at ``base[l]`` (``(key_bits, value_bits)``; one pair for every
    layer if ``base`` has one entry) and, per layer, the delta of each key width (values at the layer's base, even
    above the keys: the deltas are parts of a sum) and each value width (keys at the base); ``None`` where the
    width is the layer's base or more than ``max_step`` bits from it. ``tick`` runs after every forward."""
    req = case.request
    device = next(model.parameters()).device
    input_ids = tok(req.prompt, return_tensors="pt", **req.tokenizer_kwargs)["input_ids"].to(device)
    span = context_span(tok, req)
    dyn, first_logits = prefill(model, input_ids)
    answer, ref = reference_answer(model, tok, dyn, first_logits, input_ids, req, max_answer_tokens, eos_token_id)
    answer_in = answer[:, :-1]
    k0 = dyn.layers[0].keys
    probe = LayerProbe(model, dyn, span, FakeQuantizer(config, k0.shape[1], k0.shape[3], k0.dtype), answer_in, ref)
    L = probe.num_layers
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in base):
        raise ValueError(f"base must be a list of (key_bits, value_bits) pairs, got {base!r}")
    base = list(base) * L if len(base) == 1 else list(base)
    if len(base) != L:
        raise ValueError(f"base has {len(base)} (key_bits, value_bits) pairs but the model has {L} layers")
    base_kl = probe.kl(base)
    tick()

    def deltas(side: int, width: int) -> list[float | None]:
        out: list[float | None] = []
        for layer, on in enumerate(measured(base, side, width, max_step)):
            if not on:
                out.append(None)
                continue
            pair = (width, base[layer][1]) if side == 0 else (base[layer][0], width)
            out.append(probe.kl([pair if i == layer else b for i, b in enumerate(base)]) - base_kl)
            tick()
        return out

    return {
        "case": case.key,
        "prompt_tokens": int(input_ids.shape[1]),
        "context_tokens": span[1] - span[0],
        "answer_tokens": int(answer.shape[1]),
        "base_kl": base_kl,
        "key_deltas": {str(b): deltas(0, b) for b in key_options},
        "value_deltas": {str(b): deltas(1, b) for b in value_options},
    }
