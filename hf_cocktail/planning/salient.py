"""Salient tokens: per layer, the context tokens that the question attends to most stay at full precision.

In one layer a few context tokens take a large share of the attention from the tokens after the context (the
question and the answer prompt); their quantization error reaches the output almost undiluted, while the error of
the many tokens that share the rest of the attention averages out (token saliency, as in ZipCache and MiKV).
``CocktailConfig(salient_tokens=f)`` keeps, per layer and sequence, the fraction ``f`` of the packed context tokens
with the most attention mass from the tokens after the context in that layer's prefill at full precision; the
chunk plan is unchanged, and every other token keeps its chunk's precision.

Shapes: H_q query heads, H_kv key/value heads (``H_q = n_rep * H_kv``), L prompt tokens (padded coordinates),
L_q query tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_cocktail.planning.plans import INDEX_DTYPE, SequencePlan
from hf_cocktail.planning.scoring import attention_mass


def keeps_salient(salient_tokens: float, full_precision_layers: Sequence[int], layer_idx: int) -> bool:
    """True when layer ``layer_idx`` keeps salient tokens (a layer kept entirely at full precision has none)."""
    return salient_tokens > 0 and layer_idx not in full_precision_layers


def check_salient_layers(
    salient_tokens: float, full_precision_layers: Sequence[int], cocktail_layers: Sequence[int]
) -> None:
    """Refuse ``salient_tokens`` where every Cocktail layer (``cocktail_layers``: the model's full-attention layers)
    is in ``full_precision_layers``: no layer has packed tokens to keep."""
    if salient_tokens > 0 and cocktail_layers and set(cocktail_layers) <= set(full_precision_layers):
        raise ValueError(
            f"salient_tokens={salient_tokens!r} has no effect with full_precision_layers={tuple(full_precision_layers)}"
            f": every full-attention layer of this model ({list(cocktail_layers)}) is kept at full precision, so no "
            "layer has packed tokens to keep; set salient_tokens=0 or keep fewer layers at full precision"
        )


def tail_attention_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    pad: int,
    ctx_start: int,
    ctx_end: int,
    prompt_end: int | None = None,
) -> torch.Tensor:
    """Attention mass from the prompt tokens after the context onto each context token, one layer, one sequence.

    Args:
        query: ``(H_q, L_q, D)``, the last ``L_q`` queries of the forward (they must include every token from
            ``ctx_end`` on); key: ``(H_kv, L, D)``, the whole forward.
        prompt_end: the prepared prompt's length (padded coordinates): query rows from it on are not the prompt's
            (assisted decoding's first forward also covers the draft's candidates) and are left out. ``None``: ``L``.

    Returns:
        ``(ctx_end - ctx_start,)`` fp32, summed over heads and the query rows ``[ctx_end, min(L, prompt_end))``.
    """
    L, first = key.shape[1], key.shape[1] - query.shape[1]
    end = L if prompt_end is None else min(L, prompt_end)
    if first > ctx_end:
        raise ValueError(
            f"salient_tokens needs the prefill attention of every token after the context (from token {ctx_end} on) "
            f"in one forward; this forward's queries start at token {first} (chunked prefill is not supported)"
        )
    return attention_mass(query, key, scaling, pad, (ctx_end, end), (ctx_start, ctx_end), first_query=first)


def salient_positions(mass: torch.Tensor, positions: dict, ctx_start: int, fraction: float) -> torch.Tensor:
    """The ``round(fraction * n)`` of the ``n`` packed positions (every part of ``positions`` but ``"full"``) with the
    most ``mass`` (``(ctx_end - ctx_start,)``, indexed from ``ctx_start``), in token order; ties go to the earlier
    token."""
    parts = [p for part, p in positions.items() if part != "full"]
    packed = torch.sort(torch.cat(parts)).values if parts else torch.zeros(0, dtype=INDEX_DTYPE)
    n = int(round(fraction * packed.numel()))
    if n == 0:
        return packed[:0]
    m = mass.float().cpu()[packed - ctx_start]
    order = torch.sort(-m, stable=True).indices[:n]
    return torch.sort(packed[order]).values


def move_to_full(positions: dict, salient: torch.Tensor) -> dict:
    """``positions`` (``"full"`` and the packed parts, each in token order) with the ``salient`` positions taken out
    of the packed parts and merged into ``"full"`` in token order."""
    if salient.numel() == 0:
        return positions
    out = {"full": torch.sort(torch.cat([positions["full"], salient])).values}
    for part, pos in positions.items():
        if part != "full":
            out[part] = pos[~torch.isin(pos, salient)]
    return out


def record_layer_mass(
    plans: Sequence[SequencePlan],
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    layer_idx: int,
    prompt_end: int,
) -> None:
    """Keep layer ``layer_idx``'s :func:`tail_attention_mass` in each sequence's plan, from the prepared prompt's
    query rows only (``prompt_end``: its length). ``query (B, H_q, L_q, D)``, ``key (B, H_kv, L, D)``."""
    for b, plan in enumerate(plans):
        mass = tail_attention_mass(query[b], key[b], scaling, plan.pad, plan.ctx_start, plan.ctx_end, prompt_end)
        # new dicts: beam rows share the old ones; a new mass replaces the layer's salient positions chosen before
        plan.layer_mass = {**plan.layer_mass, layer_idx: mass.cpu()}
        plan.layer_salient = without(plan.layer_salient, layer_idx)


def without(d: dict, key) -> dict:
    """A copy of ``d`` without ``key``."""
    return {k: v for k, v in d.items() if k != key}


def with_salient(positions: dict, plan: SequencePlan, layer_idx: int, fraction: float) -> dict:
    """Layer ``layer_idx``'s ``positions`` of one sequence with its salient tokens moved to ``"full"``.

    The first call for a layer chooses its salient positions from the layer's prefill mass and keeps them in
    ``plan.layer_salient`` in place of the mass (``round(fraction * n)`` int32 positions instead of one fp32 per
    context token: the plans' share of ``memory_report()``); later calls reuse them."""
    salient = plan.layer_salient.get(layer_idx)
    if salient is None:
        mass = plan.layer_mass.get(layer_idx)
        if mass is None:
            raise RuntimeError(
                f"salient_tokens={fraction} keeps the context tokens the question attends to most, read from the "
                f"prefill attention, and layer {layer_idx} saw none: load the model with "
                "attn_implementation='cocktail' (or pass prefill_queries to load_prefill)"
            )
        salient = salient_positions(mass, plan.positions, plan.ctx_start, fraction)
        plan.layer_salient = {**plan.layer_salient, layer_idx: salient}
        plan.layer_mass = without(plan.layer_mass, layer_idx)
    return move_to_full(positions, salient)
