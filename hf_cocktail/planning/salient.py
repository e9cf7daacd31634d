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

from hf_cocktail.planning.plans import SequencePlan
from hf_cocktail.planning.scoring import attention_mass


def keeps_salient(salient_tokens: float, full_precision_layers: Sequence[int], layer_idx: int) -> bool:
    """True when layer ``layer_idx`` keeps salient tokens (a layer kept entirely at full precision has none)."""
    return salient_tokens > 0 and layer_idx not in full_precision_layers


def tail_attention_mass(
    query: torch.Tensor, key: torch.Tensor, scaling: float, pad: int, ctx_start: int, ctx_end: int
) -> torch.Tensor:
    """Attention mass from the prompt tokens after the context onto each context token, one layer, one sequence.

    Args:
        query: ``(H_q, L_q, D)``, the last ``L_q`` prompt tokens' queries (they must include every token from
            ``ctx_end`` on); key: ``(H_kv, L, D)``, the whole prompt.

    Returns:
        ``(ctx_end - ctx_start,)`` fp32, summed over heads and query tokens.
    """
    L, first = key.shape[1], key.shape[1] - query.shape[1]
    if first > ctx_end:
        raise ValueError(
            f"salient_tokens needs the prefill attention of every token after the context (from token {ctx_end} on) "
            f"in one forward; this forward's queries start at token {first} (chunked prefill is not supported)"
        )
    return attention_mass(query, key, scaling, pad, (ctx_end, L), (ctx_start, ctx_end), first_query=first)


def salient_positions(mass: torch.Tensor, positions: dict, ctx_start: int, fraction: float) -> torch.Tensor:
    """The ``round(fraction * n)`` of the ``n`` packed positions (every part of ``positions`` but ``"full"``) with the
    most ``mass`` (``(ctx_end - ctx_start,)``, indexed from ``ctx_start``), in token order; ties go to the earlier
    token."""
    parts = [p for part, p in positions.items() if part != "full"]
    packed = torch.sort(torch.cat(parts)).values if parts else torch.zeros(0, dtype=torch.long)
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
    plans: Sequence[SequencePlan], query: torch.Tensor, key: torch.Tensor, scaling: float, layer_idx: int
) -> None:
    """Keep layer ``layer_idx``'s :func:`tail_attention_mass` in each sequence's plan. ``query (B, H_q, L_q, D)``,
    ``key (B, H_kv, L, D)``."""
    for b, plan in enumerate(plans):
        mass = tail_attention_mass(query[b], key[b], scaling, plan.pad, plan.ctx_start, plan.ctx_end)
        plan.layer_mass = {**plan.layer_mass, layer_idx: mass.cpu()}  # a new dict: beam rows share the old one


def with_salient(positions: dict, plan: SequencePlan, layer_idx: int, fraction: float) -> dict:
    """Layer ``layer_idx``'s ``positions`` of one sequence with its salient tokens moved to ``"full"``."""
    mass = plan.layer_mass.get(layer_idx)
    if mass is None:
        raise RuntimeError(
            f"salient_tokens={fraction} keeps the context tokens the question attends to most, read from the "
            f"prefill attention, and layer {layer_idx} saw none: load the model with attn_implementation='cocktail' "
            "(or pass prefill_queries to load_prefill)"
        )
    return move_to_full(positions, salient_positions(mass, plan.positions, plan.ctx_start, fraction))
