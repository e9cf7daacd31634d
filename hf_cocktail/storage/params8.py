"""8-bit scales and zeros (``CocktailConfig(scale_bits=8)``): the codec and the quantizers that store with it, in plain
PyTorch (the spec; the fused CPU decoder ``cpu_ops.decode_params8`` is tested bit for bit against it).

The min-max scale and zero of every group of a *block* (keys: the D channels of one chunk of one head; values: the
groups of the C tokens of one chunk of one head) are stored as 8-bit codes on three ``scale_dtype`` numbers per block,
``(s_max, z_lo, z_step)``: ``zero = z_lo + zc * z_step`` with ``zc = floor((min - z_lo) / z_step + 1/2)`` (``z_step =
(max(min) - min(min)) / 255``) and ``scale = s_max * 2 ** (-sc / 16)`` with ``sc = floor(-16 * log2(need / s_max) +
1/2)``, ``need = (max - zero) / (2**bits - 1)``, ``s_max`` the block's largest ``need``: both codes the nearest (a zero
within half a ``z_step`` of the group's min, a scale within a factor ``2 ** (1/32)`` of what it needs; the group's
extremes may clip to code 0 or ``2**bits - 1`` by that much). Nearest codes, not codes that always cover the group (the
zero rounded down, the scale up, as before 2026-12-03), measured 18-28% lower KL divergence from FP16 at equal bytes on
SmolLM2 and Gemma 3 (``docs/experiments.md``). The quantizers then refine each group's pair (:func:`refine_codes`): of
the nearest codes and their neighbours (each code -1, 0 or +1), the pair whose decoded numbers reconstruct the group's
own values with the least squared error. On real keys and values (SmolLM2, Gemma 3; ``docs/experiments.md``) that error
falls 10-13% below the nearest codes', and below min-max parameters stored at 16 bits. Both are decoded to fp32
(:func:`decode_params8`) and the codes computed from those numbers exactly as above. Key parameters then cost ``16 / C``
bits per element instead of ``32 / C``, value parameters ``16 / G`` instead of ``32 / G`` (plus 48 bits per block).
Quantized by this reference on every backend; the fused kernels (``cpu_ops``, ``triton_ops``) read the codes and blocks
as stored and decode them as they go (the same product and sum), the PyTorch path decodes one block at a time; the fp32
numbers are never stored (``cpu_ops.decode_params8``, bit for bit :func:`decode_params8`, decodes whole tensors where
asked).

Shapes: H heads (``H_kv``), N tokens, M chunks (C tokens each), D head dim, G value group size, K groups per row.
"""

from __future__ import annotations

import functools

import torch

from hf_cocktail.storage.quant import (
    check_finite,
    check_params_finite,
    check_segment,
    dequantize_keys,
    group_codes,
    pack_codes,
    quantize_pack_keys,
    whole_chunks,
)

SCALE_LOG_STEPS = 16  # an 8-bit scale code c stands for s_max * 2 ** (-c / SCALE_LOG_STEPS)
# the code steps refine_codes tries around the nearest codes, (0, 0) first so that a tie keeps them
REFINE_STEPS = tuple((dz, ds) for dz in (0, -1, 1) for ds in (0, -1, 1))
REFINE_SLICE_ELEMENTS = 1 << 16  # elements of x refined at once (their 9 candidates in fp32: ~2.4 MB, in cache)


@functools.cache
def _scale_table(device: torch.device) -> torch.Tensor:
    c = torch.arange(256, dtype=torch.float64)
    return torch.exp2(-c / SCALE_LOG_STEPS).float().to(device)


def scale_table(device: torch.device | str) -> torch.Tensor:
    """fp32 ``(256,)``: ``2 ** (-c / SCALE_LOG_STEPS)`` for every 8-bit scale code ``c`` (computed in fp64, cached);
    the fused decoder takes it as ``table=``."""
    return _scale_table(torch.device(device))


def encode_params8(mn: torch.Tensor, mx: torch.Tensor, bits: int, scale_dtype: torch.dtype, round_offset: float = 0.5):
    """8-bit codes of the min-max scales and zeros of ``bits``-bit groups (the module docstring).

    Args:
        mn, mx: ``(..., K)`` fp32 minima and maxima of K groups; the leading dims index the blocks.
        round_offset: added before both codes are floored: 0.5, the nearest codes; 0.0, codes that cover every group
            (the zero rounded down, the scale up: the encoder before 2026-12-03; the lab log's "Nearest codes").

    Returns:
        ``scale_codes uint8 (..., K)``, ``zero_codes uint8 (..., K)``, ``block (..., 3)`` in ``scale_dtype``:
        ``(s_max, z_lo, z_step)``.
    """
    qmax = (1 << bits) - 1
    lowest = mn.amin(-1, keepdim=True)
    z_lo = lowest.to(scale_dtype)
    z_step = ((mn.amax(-1, keepdim=True) - lowest) / 255).to(scale_dtype)
    zs = z_step.float()
    zc = torch.where(zs > 0, torch.floor((mn - z_lo.float()) / zs + round_offset), torch.zeros_like(mn)).clamp_(0, 255)
    zero = z_lo.float() + zc * zs  # as decode_params8 computes it
    need = ((mx - zero) / qmax).clamp_min(0)
    s_max = need.amax(-1, keepdim=True).to(scale_dtype)
    check_params_finite([z_lo, z_step, s_max], scale_dtype, mx)
    sm = s_max.float()
    ratio = need / torch.where(sm > 0, sm, torch.ones_like(sm))
    steps = torch.floor(-SCALE_LOG_STEPS * torch.log2(ratio) + round_offset).nan_to_num_(
        255.0, 255.0, 255.0
    )  # log2(0): -inf
    sc = torch.where(sm > 0, steps, torch.zeros_like(steps)).clamp_(0, 255)
    return sc.to(torch.uint8), zc.to(torch.uint8), torch.cat([s_max, z_lo, z_step], dim=-1)


def decode_params8(
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    block: torch.Tensor,
    block_of_row: torch.Tensor | None = None,
):
    """Inverse of :func:`encode_params8`: codes and block numbers -> fp32 ``scale, zero``: ``s_max * table[sc]`` and
    ``z_lo + zc * z_step`` (a product, then a sum: never fused), with :func:`scale_table`.

    Args:
        scale_codes, zero_codes: ``uint8 (H, R, K)``.
        block: ``(H, M, 3)``: ``(s_max, z_lo, z_step)``.
        block_of_row: ``None`` (``M == R``: row ``r`` is in block ``r``) or ``int64 (R,)``, the block of every row.

    Returns:
        ``scale, zero`` fp32 ``(H, R, K)``.
    """
    if block_of_row is not None:
        block = block.index_select(1, block_of_row)
    b = block.float()
    scale = b[..., 0:1] * _scale_table(scale_codes.device)[scale_codes.long()]
    zero = b[..., 1:2] + zero_codes.float() * b[..., 2:3]
    return scale, zero


def refine_codes(
    x: torch.Tensor,
    group_dim: int,
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    block: torch.Tensor,
    bits: int,
    block_of_row: torch.Tensor | None = None,
):
    """Per group, the pair of codes among the nearest (``scale_codes``, ``zero_codes``) and their neighbours
    (:data:`REFINE_STEPS`: each code -1, 0 or +1, within 0..255) whose decoded scale and zero give back the group's
    values ``x`` with the least squared error; a tie keeps the nearest codes. The block's numbers do not change. Rows
    (dim 1) go a slice of :data:`REFINE_SLICE_ELEMENTS` elements at a time, the 9 candidates of a slice at once (one
    appended chunk: a handful of operations, not 9 times as many).

    Args:
        x: fp32 values, the groups' elements along ``group_dim`` (keys ``(H, M, C, D)``, dim 2; values ``(H, N, K,
            G)``, dim 3).
        scale_codes, zero_codes: ``uint8``, ``x``'s shape without ``group_dim``. ``block``, ``block_of_row``: as
            :func:`decode_params8` takes them.

    Returns:
        ``scale_codes, zero_codes`` uint8, the shapes given, and the values' codes under them (``group_codes``, uint8,
        ``x``'s shape).
    """
    step = max(1, REFINE_SLICE_ELEMENTS // max(1, x[:, :1].numel()))
    parts = []
    for r in range(0, x.shape[1], step):
        rows = slice(r, r + step)
        blk, of_row = (block[:, rows], None) if block_of_row is None else (block, block_of_row[rows])
        parts.append(_refine_rows(x[:, rows], group_dim, scale_codes[:, rows], zero_codes[:, rows], blk, bits, of_row))
    if not parts:
        return scale_codes, zero_codes, x.to(torch.uint8)
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(3))


def _refine_rows(x, group_dim, scale_codes, zero_codes, block, bits, block_of_row):
    """:func:`refine_codes` on a slice of rows, the candidates stacked along a new leading dim (S = 9)."""
    steps = torch.tensor(REFINE_STEPS, dtype=torch.int16, device=x.device)
    steps = steps.view(len(REFINE_STEPS), 2, *([1] * scale_codes.dim()))
    zc = (zero_codes.to(torch.int16) + steps[:, 0]).clamp_(0, 255).to(torch.uint8)  # (S, *codes)
    sc = (scale_codes.to(torch.int16) + steps[:, 1]).clamp_(0, 255).to(torch.uint8)
    scale, zero = (t.unsqueeze(group_dim + 1) for t in decode_params8(sc, zc, block, block_of_row))
    codes = group_codes(x, scale, zero, bits)  # (S, *x)
    err = (codes.float() * scale + zero - x).square_().sum(group_dim + 1)
    best = err.argmin(0, keepdim=True)  # the first of equal minima: the nearest codes on a tie
    best_codes = codes.gather(0, best.unsqueeze(group_dim + 1).expand(1, *x.shape)).squeeze(0)
    return sc.gather(0, best).squeeze(0), zc.gather(0, best).squeeze(0), best_codes


def quantize_pack_keys8(
    k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None, *, refine: bool = True
):
    """:func:`hf_cocktail.storage.quant.quantize_pack_keys` with 8-bit scales and zeros, one block per chunk and head
    (module docstring); ``refine=False`` keeps the nearest codes (:func:`refine_codes` not run: what the store
    keeps differs, a cheaper estimate of its error).

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale_codes uint8 (H_kv, M, D)``, ``zero_codes uint8 (H_kv, M, D)``,
        ``block (H_kv, M, 3)`` in ``scale_dtype``.
    """
    H, N, D, scale_dtype = check_segment(k, bits, scale_dtype)
    if N == 0:
        empty = k.new_zeros((H, 0, D), dtype=torch.uint8)
        return empty[..., : D * bits // 8], empty, empty, k.new_zeros((H, 0, 3), dtype=scale_dtype)
    check_finite(k, "keys")
    x = whole_chunks(k.float(), chunk_size)  # (H, M, C, D)
    sc, zc, block = encode_params8(x.amin(2), x.amax(2), bits, scale_dtype)
    if refine:
        sc, zc, codes = refine_codes(x, 2, sc, zc, block, bits)
    else:
        scale, zero = decode_params8(sc, zc, block)
        codes = group_codes(x, scale.unsqueeze(2), zero.unsqueeze(2), bits)
    return pack_codes(codes.reshape(H, -1, D)[:, :N], bits), sc, zc, block


def quantize_pack_values8(
    v: torch.Tensor,
    bits: int,
    group_size: int,
    scale_dtype: torch.dtype | None = None,
    *,
    chunk_size: int,
):
    """:func:`hf_cocktail.storage.quant.quantize_pack_values` with 8-bit scales and zeros, one block per chunk of
    ``chunk_size`` tokens and head (module docstring); ``v (H_kv, N, D)`` holds whole chunks of one sequence, the last
    one may be partial.

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale_codes uint8 (H_kv, N, D//G)``, ``zero_codes uint8 (H_kv, N,
        D//G)``, ``block (H_kv, M, 3)`` in ``scale_dtype``.
    """
    H, N, D, scale_dtype = check_segment(v, bits, scale_dtype, group_size)
    if N == 0:
        empty = v.new_zeros((H, 0, D), dtype=torch.uint8)
        return (
            empty[..., : D * bits // 8],
            empty[..., : D // group_size],
            empty[..., : D // group_size],
            v.new_zeros((H, 0, 3), dtype=scale_dtype),
        )
    check_finite(v, "values")
    x = v.float().reshape(H, N, D // group_size, group_size)
    mn, mx = (whole_chunks(t, chunk_size).flatten(2) for t in (x.amin(3), x.amax(3)))  # (H, M, C * D//G)
    sc, zc, block = encode_params8(mn, mx, bits, scale_dtype)
    sc, zc = (t.reshape(H, -1, D // group_size)[:, :N] for t in (sc, zc))
    rows = torch.arange(N, device=v.device) // chunk_size
    sc, zc, codes = refine_codes(x, 3, sc, zc, block, bits, rows)
    return pack_codes(codes.reshape(H, N, D), bits), sc, zc, block


def round_trip_keys(
    y: torch.Tensor, bits: int, chunk_size: int, scale_bits: int, scale_dtype: torch.dtype, *, refine: bool = True
):
    """Keys ``y (H_kv, N, D)`` as a ``bits``-bit segment with ``scale_bits`` scales and zeros gives them back, fp32
    (quantized per channel within each chunk by the reference quantizers, then dequantized); ``refine``: as
    :func:`quantize_pack_keys8` takes it (8-bit parameters only)."""
    if scale_bits == 8:
        codes, sc, zc, block = quantize_pack_keys8(y, bits, chunk_size, scale_dtype, refine=refine)
        scale, zero = decode_params8(sc, zc, block)
    else:
        codes, scale, zero = quantize_pack_keys(y, bits, chunk_size, scale_dtype)
    return dequantize_keys(codes, scale, zero, bits, chunk_size)
