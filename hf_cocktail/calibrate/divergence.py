"""The comparison itself: teacher-forcing tokens through a cache, and KL(P_fp16 || P_method) / top-1 agreement per
position.

:func:`teacher_force` feeds tokens through a cache that already holds a prefill and returns the logits at every fed
position (position ``i`` predicts the token after ``tokens[i]``). One forward of all the tokens is exactly what
feeding them one by one gives (up to floating-point rounding) only when the cache treats the new tokens the same
whatever the block size: ``DynamicCache``; ``CocktailCache`` while no appended token would be packed inside the
block (new tokens stay at full precision until they leave its ``residual_tokens`` window; attention over the full part
is causal); ``QuantizedCache`` while its full-precision residual does not fill up inside the block. Every
other cache (the KIVI-like cache, whose residual windows move with every token) is fed token by token
(:func:`needs_steps`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, QuantizedCache

from hf_cocktail.cache.cache import CocktailCache
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.generated import packs_within


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (rows of ``(n, V)`` logits): ``KL(P_ref || P)`` in nats and whether both argmaxes agree.

    Computed in float64 from ``log_softmax``: identical logits give exactly 0."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: reference {tuple(ref_logits.shape)}, method {tuple(logits.shape)}")
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double().to(lp.device), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    agree = ref_logits.argmax(-1) == logits.to(ref_logits.device).argmax(-1)
    return kl, agree


def needs_steps(cache, n_tokens: int) -> bool:
    """True when feeding ``n_tokens`` in one forward would differ from feeding them one by one (see the module
    docstring); unknown caches are fed token by token."""
    if isinstance(cache, CocktailCache):  # exact in one forward unless appended tokens would be packed inside it
        keep, layers = cache.config.residual_tokens, [la for la in cache.layers if isinstance(la, CocktailLayer)]
        for layer in layers:  # a layer waiting for its prefill attention quantizes at its next update anyway
            layer.flush_deferred()
        return any(packs_within(layer.store, keep, n_tokens) for layer in layers)
    if isinstance(cache, QuantizedCache):
        for layer in cache.layers:
            keys = getattr(layer, "keys", None)
            residual = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
            if residual + n_tokens >= layer.residual_length:  # the residual would be re-quantized inside the block
                return True
        return False
    return type(cache) is not DynamicCache


@torch.no_grad()
def teacher_force(model, cache, tokens: torch.Tensor, step_by_step: bool | None = None) -> torch.Tensor:
    """Feed ``tokens (1, n)`` through ``cache`` (which holds the tokens before them) and return the logits
    ``(n, V)`` (float32) at each fed position. ``step_by_step=None``: one forward unless :func:`needs_steps`."""
    n = tokens.shape[1]
    if n == 0:
        return torch.zeros(0, model.config.get_text_config(decoder=True).vocab_size)
    if step_by_step is None:
        step_by_step = needs_steps(cache, n)
    if not step_by_step:
        out = model(input_ids=tokens, **cache_kwargs(model, cache), use_cache=True)
        return out.logits[0].float()
    rows = []
    for i in range(n):
        out = model(input_ids=tokens[:, i : i + 1], **cache_kwargs(model, cache), use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)
