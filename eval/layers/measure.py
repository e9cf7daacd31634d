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

from hf_cocktail import CocktailCache, CocktailConfig

from ..kld.cases import KldCase
from ..kld.divergence import kl_and_top1, teacher_force
from ..kld.measure import REFERENCE
from ..methods.branching import branch, generate_from_branch, prefill
from ..methods.kinds import Request
from .fake_quant import FakeQuantizer


def context_span(tok, request: Request, config: CocktailConfig) -> tuple[int, int]:
    """``[start, end)`` of the request's context tokens, as ``CocktailCache.prepare_inputs`` locates them."""
    probe = CocktailCache(config)
    probe.prepare_inputs(
        tok, request.prompt, contexts=request.context, queries=request.query, **request.tokenizer_kwargs
    )
    plan = probe.plans[0]
    return plan.ctx_start, plan.ctx_end


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


@torch.no_grad()
def measure_case(
    model,
    tok,
    case: KldCase,
    config: CocktailConfig,
    base: tuple[int, int],
    key_options: list[int],
    value_options: list[int],
    max_answer_tokens: int = 32,
    eos_token_id=None,
    tick: Callable[[], None] = lambda: None,
) -> dict:
    """One record: the base KL and one delta per layer for each key width (values at the base width, even above
    the keys: the deltas are parts of a sum) and each value width (keys at the base); ``tick`` runs after every
    forward."""
    req = case.request
    device = next(model.parameters()).device
    input_ids = tok(req.prompt, return_tensors="pt", **req.tokenizer_kwargs)["input_ids"].to(device)
    span = context_span(tok, req, config)
    dyn, first_logits = prefill(model, input_ids)
    ref_cache = branch(REFERENCE, model, tok, dyn, input_ids, req).cache
    answer = generate_from_branch(model, ref_cache, input_ids, first_logits, max_answer_tokens, eos_token_id)
    answer_in = answer[:, :-1]
    ref = teacher_force(model, branch(REFERENCE, model, tok, dyn, input_ids, req).cache, answer_in, False)
    k0 = dyn.layers[0].keys
    probe = LayerProbe(model, dyn, span, FakeQuantizer(config, k0.shape[1], k0.shape[3], k0.dtype), answer_in, ref)
    L = probe.num_layers
    base_kl = probe.kl([base] * L)
    tick()

    def deltas(option: Callable[[int], tuple[int, int]]) -> list[float]:
        out = []
        for layer in range(L):
            out.append(probe.kl([option(layer) if i == layer else base for i in range(L)]) - base_kl)
            tick()
        return out

    return {
        "case": case.key,
        "prompt_tokens": int(input_ids.shape[1]),
        "context_tokens": span[1] - span[0],
        "answer_tokens": int(answer.shape[1]),
        "base_kl": base_kl,
        "key_deltas": {str(b): deltas(lambda _, b=b: (b, base[1])) for b in key_options},  # values at base
        "value_deltas": {str(b): deltas(lambda _, b=b: (base[0], b)) for b in value_options},
    }
