"""Code widths by importance (issue 26): each key channel and each value channel group of a layer gets its own width,
chosen to minimize an importance-weighted error at a fixed average width (fake quantization only).

Today every element of a segment gets one width. But a key channel's error reaches the logits through the query
(``q . (k_hat - k)``), so its cost is ``E[q_j^2]`` times its squared error; a value channel's error reaches the
output through ``o_proj``, so its cost is the squared norm of its ``o_proj`` columns times its squared error. When
those weights span orders of magnitude, moving bits from cheap channels to dear ones (reverse water-filling) buys
the same divergence with fewer bits.

* Quantizer: min-max codes of any width 0..8 (0: the group's midpoint, only the parameters), scales and zeros in
  fp16, computed exactly as :mod:`hf_cocktail.storage.quant` does (:func:`~hf_cocktail.storage.quant.group_codes`;
  at 2, 3 and 4 bits it equals the package's ``scale_bits=16`` round trip). Keys per channel over chunks of C
  tokens; values per token in groups of G channels.
* Weights: :func:`query_weights` (keys, from calibration prompts' queries) and :func:`output_weights` (values, from
  the layer's ``o_proj``).
* Allocation: :func:`allocate`, a Lagrangian choice per unit (key channel: all of its tokens; value group: its G
  channels of all tokens) with the multiplier bisected so the mean width is at most the budget.

Shapes: keys/values ``(H_kv, N, D)`` of one sequence's context; queries ``(B, H_q, T, D)``; ``o_proj`` weight
``(hidden, H_q * D)``; weights ``(H_kv, D)``; distortions ``(U, W)`` for U units and W candidate widths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_cocktail.storage.quant import group_codes, whole_chunks

MAX_WIDTH = 8
PARAM_DTYPE = torch.float16


def check_widths(widths: Sequence[int]) -> None:
    if not widths or any(not 0 <= w <= MAX_WIDTH for w in widths) or list(widths) != sorted(set(widths)):
        raise ValueError(f"widths must be distinct, increasing and in 0..{MAX_WIDTH}, got {list(widths)!r}")


def minmax_round_trip(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """``x`` (fp32) min-max quantized at ``bits`` with groups reduced over ``dim`` and dequantized; ``bits=0`` keeps
    only each group's midpoint. Scales and zeros in fp16, as the package stores them with ``scale_bits=16``."""
    mn, mx = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if bits == 0:
        return ((mn.to(PARAM_DTYPE).float() + mx.to(PARAM_DTYPE).float()) / 2).expand_as(x)
    scale = ((mx - mn) / ((1 << bits) - 1)).to(PARAM_DTYPE)
    zero = mn.to(PARAM_DTYPE)
    return group_codes(x, scale, zero, bits).float() * scale.float() + zero.float()


def keys_round_trip(k: torch.Tensor, bits: int, chunk_size: int) -> torch.Tensor:
    """``k (H_kv, N, D)``: per channel over each chunk of ``chunk_size`` tokens (the last may be partial)."""
    H, N, D = k.shape
    x = whole_chunks(k.float(), chunk_size)  # (H, M, C, D)
    return minmax_round_trip(x, 2, bits).reshape(H, -1, D)[:, :N]


def values_round_trip(v: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``v (H_kv, N, D)``: per token in groups of ``group_size`` channels."""
    H, N, D = v.shape
    return minmax_round_trip(v.float().reshape(H, N, D // group_size, group_size), 3, bits).reshape(H, N, D)


def query_weights(queries: Sequence[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """``(H_kv, D)``: the mean of ``q_j^2`` over the tokens of ``queries`` (each ``(B, H_q, T, D)``, post-RoPE as
    attention sees them), summed over the query heads that read each KV head."""
    total = None
    for q in queries:
        B, Hq, T, D = q.shape
        m = q.float().pow(2).mean(dim=(0, 2)).reshape(num_kv_heads, Hq // num_kv_heads, D).sum(1)
        total = m if total is None else total + m
    if total is None:
        raise ValueError("query_weights: no queries given")
    return total / len(queries)


def output_weights(o_proj_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``(H_kv, D)``: the squared norm of each value channel's ``o_proj`` columns, summed over the query heads that
    read each KV head (the output error a unit error on that channel causes, attention weights aside)."""
    cols = o_proj_weight.float().pow(2).sum(0)  # (H_q * D,)
    Hq = cols.numel() // head_dim
    return cols.reshape(num_kv_heads, Hq // num_kv_heads, head_dim).sum(1)


def distortions(
    k: torch.Tensor,
    v: torch.Tensor,
    wq: torch.Tensor,
    wo: torch.Tensor,
    widths: Sequence[int],
    chunk_size: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted squared error of every unit at every width: keys ``(H_kv * D, W)`` (unit: one channel of one head),
    values ``(H_kv * D / G, W)`` (unit: one group of G channels of one head)."""
    check_widths(widths)
    H, N, D = k.shape
    kd, vd = [], []
    for b in widths:
        ek = (keys_round_trip(k, b, chunk_size) - k.float()).pow(2).sum(1) * wq  # (H, D)
        ev = (values_round_trip(v, b, group_size) - v.float()).pow(2).sum(1) * wo
        kd.append(ek.reshape(-1))
        vd.append(ev.reshape(H, D // group_size, group_size).sum(-1).reshape(-1))
    return torch.stack(kd, 1), torch.stack(vd, 1)


def allocate(dist: torch.Tensor, widths: Sequence[int], budget: float, iterations: int = 60) -> torch.Tensor:
    """The index into ``widths`` of each unit's width (``(U,)``, int64): the Lagrangian choice
    ``argmin_w dist[u, w] + lam * widths[w]`` with the smallest ``lam`` found (bisection) whose mean width is at
    most ``budget``. Units are equal in size; ``budget`` below the narrowest width is an error."""
    check_widths(widths)
    if budget < widths[0]:
        raise ValueError(f"budget must be at least the narrowest width {widths[0]}, got {budget!r}")
    w = torch.tensor(widths, dtype=torch.float64)
    d = dist.double()

    def pick(lam: float) -> torch.Tensor:
        return (d + lam * w).argmin(1)

    def mean_width(lam: float) -> float:
        return float(w[pick(lam)].mean())

    lo, hi = 0.0, 1.0
    while mean_width(hi) > budget:
        lo, hi = hi, hi * 4
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_width(mid) > budget else (lo, mid)
    return pick(hi)


def mixed_round_trip(
    k: torch.Tensor,
    v: torch.Tensor,
    key_choice: torch.Tensor,
    value_choice: torch.Tensor,
    widths: Sequence[int],
    chunk_size: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with each unit at its chosen width (``key_choice (H_kv * D,)``, ``value_choice
    (H_kv * D / G,)``: indices into ``widths``): ``(k_hat, v_hat)``, fp32, the inputs' shapes."""
    H, N, D = k.shape
    kc = key_choice.reshape(H, 1, D)
    vc = value_choice.reshape(H, D // group_size).repeat_interleave(group_size, 1).reshape(H, 1, D)
    k_hat, v_hat = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for i, b in enumerate(widths):
        if bool((kc == i).any()):
            k_hat = torch.where(kc == i, keys_round_trip(k, b, chunk_size), k_hat)
        if bool((vc == i).any()):
            v_hat = torch.where(vc == i, values_round_trip(v, b, group_size), v_hat)
    return k_hat, v_hat


def mean_width(choice: torch.Tensor, widths: Sequence[int]) -> float:
    """The mean code width of a choice (indices into ``widths``)."""
    return float(torch.tensor(widths, dtype=torch.float64)[choice].mean())
