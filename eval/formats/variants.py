"""The formats of the study: what each does to a layer's context keys/values (a quantize-dequantize round trip) and
what it costs in bits per element.

* ``today``: the package's own quantizers (:class:`hf_cocktail.calibrate.fake_quant.FakeQuantizer`): keys min-max
  per channel in each chunk of C tokens, values per token in groups of G channels, scales/zeros as configured
  (8-bit codes per block with ``scale_bits=8``).
* ``pre_rope``: keys quantized the same way before RoPE (:mod:`.rope`: RoPE undone with the layer's own cos/sin,
  quantized, RoPE re-applied); values as today.
* ``sparseP``: dense-and-sparse. In each chunk of C tokens of each head, the ``P`` percent of entries farthest from
  the centre of their quantization group (keys: the median of their channel over the chunk's tokens; values: the
  median of their group of G channels of the token) are kept as 16-bit values with a 16-bit index; the rest is
  quantized by the same min-max codes (the outliers replaced by that median while the ranges are computed, so the
  ranges shrink to the other entries), and the outliers overwrite their dequantized entries.
* ``pre_rope+sparseP``: both (the outliers are chosen and kept before RoPE).

Bits per element (:func:`bits_per_element`): the code width (outlier positions keep their dense codes), plus the
scales/zeros (16-bit: ``32 / C`` for keys, ``32 / G`` for values; 8-bit: ``16 / C`` or ``16 / G`` plus three 16-bit
block numbers per chunk and head, ``48 / (C * D)``), plus ``32`` bits per outlier (value and index).

Shapes: ``(H_kv, N, D)`` for one sequence's context tokens (chunks of C tokens; the last may be partial).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_cocktail.calibrate.fake_quant import FakeQuantizer

from .rope import apply_rope, undo_rope

SIDES = ("k", "v")
OUTLIER_BITS = 32  # a 16-bit value and a 16-bit index (a chunk of one head has C * D <= 65536 entries)


@dataclass(frozen=True)
class Format:
    """A storage format: ``pre_rope`` (keys quantized before RoPE) and ``outliers``, the fraction of each chunk's
    entries kept exact (0: none)."""

    name: str
    pre_rope: bool = False
    outliers: float = 0.0


FORMATS = {
    f.name: f
    for f in (
        Format("today"),
        Format("pre_rope", pre_rope=True),
        Format("sparse0.5", outliers=0.005),
        Format("sparse1", outliers=0.01),
        Format("pre_rope+sparse0.5", pre_rope=True, outliers=0.005),
        Format("pre_rope+sparse1", pre_rope=True, outliers=0.01),
    )
}


def check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")


def group_centres(block: torch.Tensor, side: str, group_size: int) -> torch.Tensor:
    """The median of every entry's quantization group in one chunk ``block (H, c, D)``, broadcast to its shape: keys
    per channel over the chunk's tokens, values per token over groups of ``group_size`` channels."""
    H, c, D = block.shape
    if side == "k":
        return block.median(dim=1, keepdim=True).values.expand_as(block)
    g = block.reshape(H, c, D // group_size, group_size)
    return g.median(dim=3, keepdim=True).values.expand_as(g).reshape(H, c, D)


def split_outliers(
    x: torch.Tensor, fraction: float, side: str, chunk_size: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dense, mask)`` of ``x (H, N, D)``: ``mask`` (bool, ``x``'s shape) marks, in each chunk of ``chunk_size``
    tokens and each head, the ``round(fraction * c * D)`` entries farthest from their group's median (c: the chunk's
    tokens); ``dense`` is ``x`` with those entries replaced by that median (the rest untouched)."""
    check_side(side)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    H, N, D = x.shape
    dense, mask = x.clone(), torch.zeros_like(x, dtype=torch.bool)
    for s in range(0, N, chunk_size):
        block = x[:, s : s + chunk_size]
        k = round(fraction * block.shape[1] * D)
        if k == 0:
            continue
        centre = group_centres(block, side, group_size)
        far = (block - centre).abs().reshape(H, -1).topk(k, dim=1).indices
        m = torch.zeros(H, block.shape[1] * D, dtype=torch.bool, device=x.device).scatter_(1, far, True)
        m = m.reshape(block.shape)
        mask[:, s : s + chunk_size] = m
        dense[:, s : s + chunk_size] = torch.where(m, centre, block)
    return dense, mask


def as_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to fp16 (an outlier's stored value), back in fp32; ValueError if it overflows fp16."""
    y = x.to(torch.float16)
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"outliers overflow float16 (magnitudes up to {float(x.abs().max()):.3g})")
    return y.float()


def round_trip(
    fq: FakeQuantizer,
    x: torch.Tensor,
    bits: int,
    side: str,
    fmt: Format,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """``(x's round trip in fmt at bits (fp32, x's shape), the fraction of entries kept as outliers)``; ``x (H_kv, N,
    D)`` are stored keys (``side="k"``, post-RoPE: ``cos``/``sin (N, D)`` needed when ``fmt.pre_rope``) or values."""
    check_side(side)
    rope = None
    if fmt.pre_rope and side == "k":
        if cos is None or sin is None:
            raise ValueError(f"format {fmt.name!r} quantizes keys before RoPE: pass the layer's cos and sin")
        rope = (cos, sin)
    y = undo_rope(x, *rope) if rope else x.float()
    cfg = fq.config
    dense, mask = split_outliers(y, fmt.outliers, side, cfg.chunk_size, cfg.group_size)
    q = fq.keys(dense, bits) if side == "k" else fq.values(dense, bits)
    q = torch.where(mask, as_fp16(y), q)
    return (apply_rope(q, *rope) if rope else q), float(mask.float().mean())


def param_bits(side: str, chunk_size: int, group_size: int, head_dim: int, scale_bits: int) -> float:
    """Bits per element of the scales and zeros (module docstring)."""
    check_side(side)
    group = chunk_size if side == "k" else group_size
    if scale_bits == 16:
        return 32 / group
    if scale_bits == 8:
        return 16 / group + 48 / (chunk_size * head_dim)
    raise ValueError(f"scale_bits must be 16 or 8, got {scale_bits!r}")


def bits_per_element(
    bits: int, side: str, outlier_fraction: float, chunk_size: int, group_size: int, head_dim: int, scale_bits: int
) -> float:
    """Codes + scales/zeros + outliers (32 bits each) per stored element of one side (module docstring)."""
    return bits + param_bits(side, chunk_size, group_size, head_dim, scale_bits) + OUTLIER_BITS * outlier_fraction
