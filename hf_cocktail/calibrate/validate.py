"""A setting measured with the real cache on held-out windows: its KV bytes and its KL divergence from FP16.

Per window the prompt is prefilled once at full precision (``DynamicCache(config=model.config)``), recording the
attention queries of every prompt token (salient tokens read the question's, ``scorer="attention"`` all of them);
every setting's ``CocktailCache`` is then filled from that prefill with ``load_prefill(..., prefill_queries=...)``
(what a prefill through the cache under ``attn_implementation="cocktail"`` gives: the cache attends at full
precision during its own prefill and quantizes after it; tested in the eval harness) and the continuation is
teacher-forced through it. FP16's logits come from the same prefill.

Bytes: ``quantized_ratio`` is ``memory_report()["quantized_layers_ratio_to_fp16"]``, all the cache holds for its
Cocktail (full-attention) layers over their FP16 bytes (what the target bounds); ``cache_ratio`` is
``memory_report()["ratio_to_fp16"]``, the whole cache (sliding layers included).
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_cocktail.cache.cache import CocktailCache
from hf_cocktail.calibrate.divergence import kl_and_top1, teacher_force
from hf_cocktail.calibrate.queries import recording_queries
from hf_cocktail.calibrate.texts import Window
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.presets.config import CocktailConfig


@dataclass
class Prepared:
    """One window's shared state: prompt ids ``(1, T)``, the context span, the FP16 prefill and queries, the
    continuation ``(1, n)`` and FP16's logits over it ``(n, V)``."""

    window: Window
    input_ids: torch.Tensor
    span: tuple[int, int]
    prefill: DynamicCache
    queries: list[torch.Tensor]
    continuation: torch.Tensor
    ref_logits: torch.Tensor


def context_span(tok, window: Window) -> tuple[torch.Tensor, tuple[int, int]]:
    """The prompt's ids ``(1, T)`` as ``CocktailCache.prepare_inputs`` tokenizes them, and ``[start, end)`` of the
    context tokens in it."""
    probe = CocktailCache(CocktailConfig(uniform_bits=16))
    inputs = probe.prepare_inputs(tok, window.prompt, contexts=window.context, queries=window.question)
    plan = probe.plans[0]
    return inputs["input_ids"], (plan.ctx_start, plan.ctx_end)


@torch.no_grad()
def prepare(model, tok, window: Window) -> Prepared:
    """Prefill ``window`` at full precision and compute FP16's logits over its continuation."""
    device = next(model.parameters()).device
    input_ids, span = context_span(tok, window)
    input_ids = input_ids.to(device)
    dyn = DynamicCache(config=model.config)
    with recording_queries(model, 0) as queries:  # the whole prompt's: scorer='attention' reads them all
        model(input_ids=input_ids, **cache_kwargs(model, dyn), use_cache=True, logits_to_keep=1)
    cont = torch.tensor([window.continuation], device=device)
    ref = teacher_force(model, copy.deepcopy(dyn), cont, False)
    return Prepared(window, input_ids, span, dyn, queries, cont, ref)


def filled_cache(tok, prep: Prepared, config: CocktailConfig, encoder=None) -> CocktailCache:
    """``config``'s cache prepared for the window's prompt and filled from its FP16 prefill."""
    cache = CocktailCache(config, encoder=encoder)
    w = prep.window
    inputs = cache.prepare_inputs(tok, w.prompt, contexts=w.context, queries=w.question)
    if not torch.equal(inputs["input_ids"].to(prep.input_ids.device), prep.input_ids):
        raise RuntimeError(f"{w.name}: the cache tokenized the prompt differently from the shared prefill")
    cache.load_prefill(prep.prefill, prefill_queries=prep.queries)
    return cache


def byte_ratios(cache: CocktailCache) -> tuple[float, float]:
    """``(quantized, whole)`` from one ``memory_report()``: everything the cache holds for its Cocktail layers (codes,
    scales, the full part at FP16 size, rotation and index tensors, the plans' positions and the salient tokens'
    attention masses) over their FP16 bytes, what a user's report says of the preset; and the whole cache's ratio."""
    rep = cache.memory_report()
    return float(rep["quantized_layers_ratio_to_fp16"]), float(rep["ratio_to_fp16"])


def quantized_ratio(cache: CocktailCache) -> float:
    """``memory_report()["quantized_layers_ratio_to_fp16"]`` (see :func:`byte_ratios`)."""
    return byte_ratios(cache)[0]


def bytes_ratio(tok, prep: Prepared, config: CocktailConfig, encoder=None) -> float:
    """:func:`quantized_ratio` of ``config`` on one window (no forward pass)."""
    return quantized_ratio(filled_cache(tok, prep, config, encoder))


@torch.no_grad()
def measure(model, tok, prep: Prepared, config: CocktailConfig, encoder=None) -> dict:
    """``{"kld", "top1", "quantized_ratio", "cache_ratio"}`` of ``config`` on one window."""
    cache = filled_cache(tok, prep, config, encoder)
    q_ratio, c_ratio = byte_ratios(cache)
    kl, agree = kl_and_top1(prep.ref_logits, teacher_force(model, cache, prep.continuation, False))
    return {
        "kld": float(kl.mean()),
        "top1": float(agree.double().mean()),
        "quantized_ratio": q_ratio,
        "cache_ratio": c_ratio,
    }


def summarize(per_window: list[dict]) -> dict:
    """Means over windows of :func:`measure`'s numbers, and the per-window KLDs."""
    out: dict = {
        k: statistics.fmean(r[k] for r in per_window) for k in ("kld", "top1", "quantized_ratio", "cache_ratio")
    }
    out["kld_per_window"] = [r["kld"] for r in per_window]
    return out
