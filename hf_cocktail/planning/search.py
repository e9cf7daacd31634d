"""The chunk search: score every context chunk of a plan (encoder, BM25 or prefill attention) and assign its
precision (the paper's thresholds, or a bits budget)."""

from __future__ import annotations

import torch

from hf_cocktail.planning import plans as planning
from hf_cocktail.planning.plans import SequencePlan
from hf_cocktail.planning.scoring import TextEncoder, attention_mass, bm25_scores, get_encoder, score_chunks
from hf_cocktail.presets.config import CocktailConfig


def search_plan(plan: SequencePlan, cfg: CocktailConfig, encoder: TextEncoder | None = None) -> None:
    """Set ``plan.scores`` (None with ``uniform_bits``) and ``plan.bits`` (16, 4 or ``cfg.low_bits`` per chunk)."""
    if cfg.uniform_bits is not None:
        plan.scores, plan.bits = None, [cfg.uniform_bits] * plan.num_chunks
        return
    scores = chunk_scores(plan, cfg, encoder)
    if cfg.target_bits is None:
        bits = planning.assign_precisions(scores, cfg.alpha, cfg.beta, cfg.low_bits)
        bits = planning.promote_neighbors(bits, cfg.neighbors)
    else:
        cost = planning.bits_cost(cfg.packed_bits_per_element, cfg.full_part_bits)
        sizes = plan.chunk_sizes(cfg.chunk_size)
        bits = planning.assign_budget(scores, sizes, cfg.target_bits, cfg.beta, cost, cfg.low_bits)
    plan.scores, plan.bits = scores.tolist(), bits


def chunk_scores(plan: SequencePlan, cfg: CocktailConfig, encoder: TextEncoder | None = None) -> torch.Tensor:
    """``(num_chunks,)`` scores of the plan's chunks by ``cfg.scorer`` (``encoder`` overrides ``cfg.encoder``)."""
    if cfg.scorer == "bm25":
        return bm25_scores(plan.query or "", plan.chunk_texts)
    if cfg.scorer == "attention":
        if plan.attn_mass is None:
            raise RuntimeError(
                "scorer='attention' takes its scores from the prefill attention: load the model "
                "with attn_implementation='cocktail' (and do not use load_prefill)"
            )
        mass = plan.attn_mass.cpu()
        spans = [plan.chunk_range(i, cfg.chunk_size) for i in range(plan.num_chunks)]
        if not spans:
            return torch.zeros(0)
        return torch.stack([mass[a - plan.ctx_start : e - plan.ctx_start].mean() for a, e in spans])
    encoder = encoder or get_encoder(cfg.encoder, cfg.encoder_device, cfg.encoder_batch_size)
    return score_chunks(encoder, plan.query or "", plan.chunk_texts)


def add_query_attention(plans: list[SequencePlan], query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
    """scorer="attention": add one layer's prefill attention mass from each plan's query tokens to its context
    tokens (``plan.attn_mass``). ``query (B, H_q, L, D)``, ``key (B, H_kv, L, D)``: the whole prompt."""
    if query.shape[2] != key.shape[2] or any(p.query_span[1] > key.shape[2] for p in plans):
        raise ValueError(
            "scorer='attention' needs the whole prompt in one prefill forward; generation's "
            "prefill_chunk_size (chunked prefill) is not supported with it"
        )
    for b, plan in enumerate(plans):
        mass = attention_mass(query[b], key[b], scaling, plan.pad, plan.query_span, (plan.ctx_start, plan.ctx_end))
        plan.attn_mass = mass if plan.attn_mass is None else plan.attn_mass + mass.to(plan.attn_mass.device)
