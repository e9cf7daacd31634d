"""Outlier key channels at 8 bits: the plain-PyTorch reference of a packed segment whose keys have two widths.

Keys of LLMs have a few channels of much larger magnitude than the rest, fixed per channel (KIVI, KVQuant); with
per-channel quantization inside a chunk those channels' steps are the largest, so their codes lose the most. A segment
with outlier key channels stores, per KV head, ``n_out`` chosen channels with 8-bit codes and the other ``D - n_out``
at the segment's width. Both are quantized per channel within a chunk, asymmetric min-max exactly as
:func:`hf_cocktail.storage.quant.quantize_pack_keys` (the 8-bit codes with ``qmax = 255``); values are unchanged.

Storage of the keys of one segment (``PackedSegment.key_outliers``, an :class:`OutlierChannels` of ``n_out``
channels), H_kv heads, N tokens, M chunks:

* ``key_outliers.channels``: int32 ``(H_kv, D)``, the *stored channel order* of each head: position ``p`` holds channel
  ``key_channels[h, p]``; positions ``[0, D - n_out)`` are the low-width channels in ascending channel order, positions
  ``[D - n_out, D)`` the 8-bit (outlier) channels in ascending channel order.
* ``k_codes``: uint8 ``(H_kv, N, (D - n_out) * bits // 8 + n_out)``: per token the packed low-width codes of the
  stored positions ``[0, D - n_out)`` (:func:`quant.pack_codes`), then one byte per outlier channel.
* ``k_scale``, ``k_zero``: ``(H_kv, M, D)`` in the stored channel order.

So ``q . k = q_rest . k_rest + q_out . k_out`` with the query gathered once per step into the stored order. A store is
rotated before the outlier channels are chosen (they are chosen among the rotated channels, the basis the codes are
in). ``n_out`` keeps ``D - n_out`` a multiple of :func:`quant.channel_multiple` of the width (whole code bytes).

Shapes: H_kv heads, N tokens, M = ceil(N / C) chunks, C chunk size, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_cocktail.storage import quant

OUTLIER_BITS = 8  # the code width of the outlier channels


@dataclass(frozen=True)
class OutlierChannels:
    """A segment's outlier key channels: ``count`` per head (> 0) and the stored channel order ``channels`` int32
    ``(H_kv, D)`` (its last ``count`` positions are the outliers)."""

    count: int
    channels: torch.Tensor

    def __post_init__(self) -> None:
        H, D = self.channels.shape
        if not 0 < self.count < D or self.channels.dtype != torch.int32:
            raise ValueError(f"OutlierChannels needs 0 < count < D={D} and int32 channels, got {self.count}")

    def to(self, device: torch.device | str) -> OutlierChannels:
        return OutlierChannels(self.count, self.channels.to(device))


def segment_keys(seg, a: int, e: int, c0: int, c1: int | None = None, out_dtype=torch.float32, first: int = 0):
    """Keys of tokens ``[a, e)`` of a ``PackedSegment`` dequantized in channel order, ``(H_kv, e - a, D)``: chunk
    ``c0`` is the first of their sequence, ``first`` token ``a``'s offset in it (``[c0, c1)``: the chunks read)."""
    (scale, zero), o, codes = seg.key_params(c0, c1), seg.key_outliers, seg.k_codes[:, a:e]
    if o is None:
        return quant.dequantize_keys(codes, scale, zero, seg.bits, seg.chunk_size, out_dtype, first)
    return dequantize_keys_outliers(codes, scale, zero, seg.bits, seg.chunk_size, o.channels, o.count, out_dtype, first)


def outlier_count(share: float, D: int, bits: int) -> int:
    """The outlier channels of a ``bits``-bit segment of head dim ``D`` for ``share`` of its channels: ``share * D``
    rounded up to a multiple of :func:`quant.channel_multiple` (``bits``), so that the other channels fill whole code
    bytes; 0 for ``share`` 0. Never all channels: at most ``D`` minus one multiple."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    if share == 0.0:
        return 0
    m = quant.channel_multiple(bits)
    return min(math.ceil(share * D / m) * m, D - m)


def channel_scores(keys: list[torch.Tensor], chunk_size: int) -> torch.Tensor:
    """How large each key channel's quantization step is: per head and channel, the mean over chunks of the chunk's
    range (max - min), over all of ``keys`` (``(H_kv, N_b, D)`` per sequence, chunk-ordered): ``(H_kv, D)`` fp32."""
    total, chunks = None, 0
    for k in keys:
        if k.shape[1] == 0:
            continue
        x = quant.whole_chunks(k.float(), chunk_size)  # (H, M, C, D)
        r = (x.amax(dim=2) - x.amin(dim=2)).sum(dim=1)  # (H, D)
        total = r if total is None else total + r
        chunks += x.shape[1]
    if total is None:
        H, D = keys[0].shape[0], keys[0].shape[2]
        return torch.zeros(H, D)
    return total / chunks


def choose_channels(scores: torch.Tensor, n_out: int) -> torch.Tensor:
    """The stored channel order ``(H_kv, D)`` int32 (module docstring) with the ``n_out`` channels of largest
    ``scores`` ``(H_kv, D)`` per head as the outliers (ties: the lower channel)."""
    H, D = scores.shape
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices
    is_out = torch.zeros(H, D, dtype=torch.bool, device=scores.device)
    is_out.scatter_(1, order[:, :n_out], True)
    ch = torch.arange(D, device=scores.device).expand(H, D)
    key = is_out.long() * D + ch  # rest ascending, then outliers ascending
    return ch.gather(1, torch.sort(key, dim=1).indices).to(torch.int32)


def to_stored_order(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``x (H_kv, ..., D)`` with its last dim in the stored channel order of ``channels (H_kv, D)``."""
    idx = channels.long().to(x.device).reshape(channels.shape[0], *([1] * (x.dim() - 2)), channels.shape[1])
    return x.gather(-1, idx.expand(*x.shape))


def from_stored_order(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_stored_order`."""
    idx = channels.long().to(x.device).reshape(channels.shape[0], *([1] * (x.dim() - 2)), channels.shape[1])
    return torch.empty_like(x).scatter_(-1, idx.expand(*x.shape), x)


def quantize_pack_keys_outliers(
    k: torch.Tensor,
    bits: int,
    chunk_size: int,
    scale_dtype: torch.dtype | None,
    channels: torch.Tensor,
    n_out: int,
    quantize_keys: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize keys ``k (H_kv, N, D)`` with ``n_out`` outlier channels (the stored order ``channels``): the other
    channels by ``quantize_keys`` (default :func:`quant.quantize_pack_keys`, or a fast one of its signature) at
    ``bits``, the outliers at 8 bits. Returns ``codes (H_kv, N, (D - n_out) * bits // 8 + n_out)``, ``scale``,
    ``zero`` ``(H_kv, M, D)`` in the stored order (module docstring)."""
    H, N, D, scale_dtype = quant.check_segment(k, bits, scale_dtype)
    D_rest = D - n_out
    quant.check_head_dim(D_rest, bits)
    ks = to_stored_order(k, channels)
    qk = quantize_keys or quant.quantize_pack_keys
    rest_codes, rest_scale, rest_zero = qk(ks[..., :D_rest].contiguous(), bits, chunk_size, scale_dtype)
    if N == 0:
        out_codes = k.new_zeros((H, 0, n_out), dtype=torch.uint8)
        out_scale = out_zero = k.new_zeros((H, 0, n_out), dtype=scale_dtype)
    else:
        x = quant.whole_chunks(ks[..., D_rest:].float(), chunk_size)  # (H, M, C, n_out)
        out_codes, out_scale, out_zero = quant._quantize_groups(x, 2, OUTLIER_BITS, scale_dtype)
        out_codes = out_codes.reshape(H, -1, n_out)[:, :N]
    codes = torch.cat([rest_codes, out_codes], dim=-1)
    return codes, torch.cat([rest_scale, out_scale], dim=-1), torch.cat([rest_zero, out_zero], dim=-1)


def dequantize_keys_outliers(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    chunk_size: int,
    channels: torch.Tensor,
    n_out: int,
    out_dtype: torch.dtype = torch.float32,
    first_token: int = 0,
) -> torch.Tensor:
    """``codes (H_kv, N, Dp)``, ``scale/zero (H_kv, M, D)`` (stored order) -> keys ``(H_kv, N, D)`` in channel order,
    computed in fp32 as ``code * scale + zero``. ``first_token``: as :func:`quant.dequantize_keys`."""
    D = scale.shape[-1]
    Dp_rest = (D - n_out) * bits // 8
    rest = quant.unpack_codes(codes[..., :Dp_rest], bits).float()
    c = torch.cat([rest, codes[..., Dp_rest:].float()], dim=-1)  # (H, N, D) stored order
    idx = (torch.arange(c.shape[1], device=c.device) + first_token) // chunk_size
    k = c * scale.float().index_select(1, idx) + zero.float().index_select(1, idx)
    return from_stored_order(k, channels).to(out_dtype)


def outlier_quantizer(quantize_keys: Callable, outliers: OutlierChannels | None, scale_bits: int = 16) -> Callable:
    """A key quantizer of :func:`quant.quantize_pack_keys`'s signature storing ``outliers`` at 8 bits and the other
    channels with ``quantize_keys`` (``quantize_keys`` itself where ``outliers`` is None). Outlier channels are stored
    with 16-bit scales and zeros only (``scale_bits`` 16)."""
    if outliers is None:
        return quantize_keys
    if scale_bits != 16:
        raise ValueError(f"outlier key channels are stored with scale_bits=16 only, got scale_bits={scale_bits}")
    o = outliers

    def quantize(k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None):
        return quantize_pack_keys_outliers(k, bits, chunk_size, scale_dtype, o.channels, o.count, quantize_keys)

    return quantize


def layer_channel_scores(segments: dict, chunk_size: int, share: float) -> torch.Tensor | None:
    """The per-head channel scores of a layer's packed tokens, ``segments`` mapping each width to ``(keys, values)``
    lists of ``(H_kv, N_b, D)`` per sequence (stored, i.e. rotated, keys): ``(H_kv, D)`` fp32, or None for ``share``
    0 (no outlier channels)."""
    if share == 0.0:
        return None
    keys = [k for ks, _ in segments.values() for k in ks]
    return channel_scores(keys, chunk_size) if keys else None


def segment_outliers(scores: torch.Tensor | None, share: float, bits: int) -> OutlierChannels | None:
    """The outlier channels of a ``bits``-bit segment of a layer with channel ``scores`` ``(H_kv, D)`` (None: none)."""
    n_out = 0 if scores is None else outlier_count(share, scores.shape[1], bits)
    return OutlierChannels(n_out, choose_channels(scores, n_out)) if scores is not None and n_out else None


def channels_of(outliers: OutlierChannels | None) -> torch.Tensor | None:
    """The stored channel order of ``outliers`` (the tensor a segment holds for them), or None."""
    return None if outliers is None else outliers.channels
