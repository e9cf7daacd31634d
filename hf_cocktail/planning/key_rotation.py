"""Which layers store their keys rotated, from the prompt's own queries (``CocktailConfig(rotation="auto")``).

A rotation spreads the keys' outlier channels over every channel. Keys are quantized per channel within a chunk, so
each channel's step already follows its own range; whether rotating helps depends on where the queries look. Over
the prompt's queries after the context (the question, or the prompt's last ``residual_tokens``: they stand for the
queries to come) and the context's keys, the mean square of the logit error ``q . (k_hat - k)`` is, per KV head,
``trace(Q E)``: ``Q`` the sum of ``q q^T`` over those queries of the head's query heads, ``E`` the sum of ``e e^T``
over the keys' quantization errors ``e``. A layer keeps its keys rotated where that is no larger rotated than not
(values are rotated in every layer): on Gemma 3 270M the unrotated keys' error is 6x smaller, on SmolLM2 some layers
go each way.

Shapes: B sequences, H_q query heads, H_kv KV heads, L_q query rows, L keys of the forward, N context keys, D head dim.
"""

from __future__ import annotations

import functools
import logging

import torch

from hf_cocktail.storage import params8
from hf_cocktail.storage.rotation import shared_matrices

logger = logging.getLogger(__name__)

ROTATED, VALUES_ONLY = "hadamard", "hadamard_values"


def tail_query_moment(query: torch.Tensor, key_len: int, rows: list[tuple[int, int]], num_kv_heads: int):
    """``Q (H_kv, D, D)`` fp32: ``sum q q^T`` over each sequence's query rows at prompt positions ``rows[b] = [start,
    end)`` and over the query heads of each KV head. ``query (B, H_q, L_q, D)``: the forward's last ``L_q`` tokens of
    ``key_len``; rows before them are refused (a chunked prefill)."""
    B, H_q, L_q, D = query.shape
    first = key_len - L_q
    out = query.new_zeros((num_kv_heads, D, D), dtype=torch.float32)
    for b, (start, end) in enumerate(rows):
        if start < first:
            raise ValueError(
                f"rotation='auto' reads the queries of every prompt token after the context (from token {start} on) in "
                f"one forward; this forward's queries start at token {first} (chunked prefill is not supported)"
            )
        q = query[b, :, start - first : end - first].float()  # (H_q, n, D)
        q = q.reshape(num_kv_heads, -1, D)  # the query heads of a KV head are consecutive
        out += q.transpose(1, 2) @ q
    return out


def key_error_moment(keys: torch.Tensor, bits: int, chunk_size: int, scale_bits: int, scale_dtype, matrices=None):
    """``E (H_kv, D, D)`` fp32: ``sum e e^T`` over ``keys (H_kv, N, D)``'s quantization errors at ``bits`` (chunks of
    ``chunk_size``, ``scale_bits`` parameters), stored rotated by ``matrices (H_kv, D, D)`` or as they are (None),
    the errors in the keys' own basis. 8-bit parameters are taken at their nearest codes, not refined
    (:func:`params8.refine_codes`, which the store runs once, on the basis chosen): refining would make this choice
    quantize the keys twice more at 9 candidate pairs per group, the largest part of the setup after an 8K prefill."""
    k = keys.float()
    y = k if matrices is None else k @ matrices
    back = params8.round_trip_keys(y, bits, chunk_size, scale_bits, scale_dtype, refine=False)
    e = back - y if matrices is None else (back - y) @ matrices.transpose(-1, -2)
    return e.transpose(1, 2) @ e


def key_rotation(keys: list[torch.Tensor], moment: torch.Tensor, matrices: torch.Tensor, **quantizer) -> str:
    """``"hadamard"`` (keys and values rotated) where the logit error ``sum_h trace(Q_h E_h)`` of the context keys
    (``keys``: ``(H_kv, N_b, D)`` per sequence) stored rotated by ``matrices`` is no larger than unrotated, else
    ``"hadamard_values"`` (values only); ``moment``: :func:`tail_query_moment`; ``quantizer``: ``bits``,
    ``chunk_size``, ``scale_bits``, ``scale_dtype``."""

    def error(mats) -> torch.Tensor:
        return sum((moment * key_error_moment(k, matrices=mats, **quantizer)).sum() for k in keys if k.shape[1])

    return ROTATED if error(matrices) <= error(None) else VALUES_ONLY


def layer_rotation(k: torch.Tensor, plans: list, moment: torch.Tensor | None, key_bits: int, config) -> str:
    """The rotation a layer of ``config`` (``rotation="auto"``) stores with: :func:`key_rotation` of its prefill keys
    ``k (B, H_kv, L, D)`` over each plan's context ``[ctx_start, ctx_end)`` at ``key_bits``, under ``moment`` (the
    prompt's queries after the context; None where the attention never showed them: ``"hadamard"``, with a log
    warning once)."""
    if moment is None:
        _warn_no_queries()
        return ROTATED
    mats = shared_matrices(k.shape[1], k.shape[3], config.rotation_seed, k.device)
    keys = [k[b, :, p.ctx_start : p.ctx_end] for b, p in enumerate(plans)]
    quantizer = dict(bits=key_bits, chunk_size=config.chunk_size, scale_bits=config.scale_bits)
    return key_rotation(keys, moment, mats, scale_dtype=config.torch_scale_dtype(k.dtype), **quantizer)


@functools.cache
def _warn_no_queries() -> None:
    logger.warning(
        "rotation='auto' chooses each layer's key rotation from the prompt's queries, which only "
        "attn_implementation='cocktail' (or load_prefill(..., prefill_queries=...)) shows the cache: keys are stored "
        "rotated in every layer ('hadamard')"
    )
