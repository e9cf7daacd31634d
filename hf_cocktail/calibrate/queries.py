"""The shared prefill's attention queries, for methods that read the prefill attention (``salient_tokens``).

A branched cache gets its keys and values from the shared ``DynamicCache`` prefill, but not the queries that a
``"cocktail"`` attention would have shown it. :func:`recording_queries` wraps the model's attention function for the
duration of a ``with`` block and keeps, per layer, the queries of the prompt's tokens from ``first`` on (after RoPE,
as the attention function receives them): what ``CocktailCache.load_prefill(..., prefill_queries=...)`` takes.
The attention itself is computed by the model's own function, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

RECORDING = "hf_cocktail_recording_queries"


@contextmanager
def recording_queries(model, first: int) -> Iterator[list[torch.Tensor]]:
    """``with recording_queries(model, first) as queries:`` run one prefill; ``queries[l]`` is then layer ``l``'s
    ``(B, H_q, L - first, D)`` (the last forward with at least ``L - first`` query tokens wins)."""
    old = model.config._attn_implementation
    if old not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"recording the prefill's queries wraps a registered attention function (sdpa, cocktail, ...); this "
            f"model runs attn_implementation={old!r}"
        )
    inner = ALL_ATTENTION_FUNCTIONS[old]
    seen: dict[int, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] > first:
            seen[module.layer_idx] = query[:, :, first:].detach().clone()
        return inner(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(RECORDING, recording)
    AttentionMaskInterface.register(RECORDING, ALL_MASK_ATTENTION_FUNCTIONS.get(old, sdpa_mask))
    queries: list[torch.Tensor] = []
    model.set_attn_implementation(RECORDING)
    try:
        yield queries
    finally:
        model.set_attn_implementation(old)
        queries.extend(seen[i] for i in sorted(seen))
