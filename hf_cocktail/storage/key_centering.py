"""Centred keys (``CocktailConfig(center_keys=True)``): a layer stores every key minus its prompt's mean key.

Per sequence ``b`` and KV head, ``m (B, H_kv, 1, D)`` is the mean of the context's keys per channel (from the
prefill, in ``scale_dtype``, kept with the store). Every key the layer stores, the packed chunks, the full part and
the tokens appended later, is stored as ``k - m`` (before any rotation). Attention does not change: a query's
scores ``q . (k - m) = q . k - q . m`` all move by the same ``q . m``, which a softmax ignores. Quantization does:
a channel's constant offset (Gemma 3's large key channels, nearly constant over thousands of tokens after RoPE's
slowest frequencies) no longer sets the span of a chunk's 8-bit zeros (:mod:`.params8`: the zero codes step through
the block's channel minima) or the per-token scale of the 8-bit full part. Measured at 8K tokens on Gemma 3 270M:
uniform INT4 with an 8-bit full part 0.0019 -> 0.0008 KL divergence from FP16 (4 LongBench windows, a probe with
the centring patched in: commit ``533c4d5``'s message; the uncentred run is ``int4_f8`` in
``eval/results/gemma3_270m/fidelity_8k/``).

Two things are not shift-invariant: logit soft-capping and attention sinks. There the PyTorch path adds ``q . m``
back to every score (:func:`logit_offsets`); the fused kernels never see such a call (the decode dispatch routes
it). Keys handed back at full precision (:meth:`LayerStore.dequantized`, what SDPA or eager attention reads) get
``m`` added back.

Shapes: B sequences, H_q query heads, H_kv KV heads (``H_q = n_rep * H_kv``), L keys, L_q queries, D head dim.
"""

from __future__ import annotations

import torch


def context_key_mean(k: torch.Tensor, spans: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """``(B, H_kv, 1, D)`` in ``dtype``: per sequence ``b`` the mean of ``k (B, H_kv, L, D)`` over its context tokens
    ``spans[b] = [start, end)`` (zeros where a sequence has no context token)."""
    B, H, _, D = k.shape
    if len(spans) != B:
        raise ValueError(f"spans must give one (start, end) per sequence ({B}), got {len(spans)}")
    mean = torch.zeros((B, H, 1, D), dtype=torch.float32, device=k.device)
    for b, (start, end) in enumerate(spans):
        if end > start:
            mean[b] = k[b, :, start:end].float().mean(dim=1, keepdim=True)
    return mean.to(dtype)


def centered(k: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``k (B, H_kv, L, D) - mean (B, H_kv, 1, D)`` computed in fp32, in ``k``'s dtype; ``k`` itself without a mean."""
    return k if mean is None else (k.float() - mean.float()).to(k.dtype)


def uncentered(k: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`centered`: ``k + mean`` in fp32, in ``k``'s dtype."""
    return k if mean is None else (k.float() + mean.float()).to(k.dtype)


def logit_offsets(query: torch.Tensor, mean: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(B, H_q, L_q, 1)`` fp32: ``scaling * q . m`` for ``query (B, H_q, L_q, D)`` and its KV head's mean ``mean
    (B, H_kv, 1, D)`` (query head ``h`` reads KV head ``h // n_rep``): what centring took from each score."""
    B, H_q, L_q, D = query.shape
    H_kv = mean.shape[1]
    q = query.float().reshape(B, H_kv, (H_q // H_kv) * L_q, D)
    return (scaling * q @ mean.float().transpose(-1, -2)).reshape(B, H_q, L_q, 1)


def rows_of(mean: torch.Tensor | None, indices: list[int]) -> torch.Tensor | None:
    """The means of sequences ``indices`` (reordered / repeated), as a store's :meth:`select` keeps them."""
    if mean is None:
        return None
    return mean.index_select(0, torch.tensor(indices, dtype=torch.long, device=mean.device))
