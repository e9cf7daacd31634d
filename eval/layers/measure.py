"""One calibration prompt: how much each layer's code widths add to the KL divergence from FP16.

The prompt is prefilled once at full precision; FP16's greedy answer is teacher-forced through caches whose context
keys/values are the store's round trip (:mod:`hf_cocktail.calibrate.sensitivity`, the library's probe): first with
every layer at the base widths, then, for each layer and each option, with that one layer changed. A delta is the
option's mean KL (over the answer's positions, as ``eval.kld``'s ``answer`` segment) minus the base's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.sensitivity import LayerProbe, measured, probe_deltas

from ..kld.cases import KldCase
from ..kld.measure import reference_answer
from ..methods.branching import context_span, prefill

__all__ = ["measure_case", "measured"]


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
    k0 = dyn.layers[0].keys
    probe = LayerProbe(model, dyn, span, FakeQuantizer(config, k0.shape[1], k0.shape[3], k0.dtype), answer[:, :-1], ref)
    L = probe.num_layers
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in base):
        raise ValueError(f"base must be a list of (key_bits, value_bits) pairs, got {base!r}")
    base = list(base) * L if len(base) == 1 else list(base)
    if len(base) != L:
        raise ValueError(f"base has {len(base)} (key_bits, value_bits) pairs but the model has {L} layers")
    return {
        "case": case.key,
        "prompt_tokens": int(input_ids.shape[1]),
        "context_tokens": span[1] - span[0],
        "answer_tokens": int(answer.shape[1]),
        **probe_deltas(probe, base, key_options, value_options, tick, max_step),
    }
