"""Group quantization and bit packing: the plain-PyTorch reference (the spec of the storage format).

Storage format of one precision segment (INT4 or INT2) of one layer, tokens of one or more sequences laid end to end:

* codes: ``uint8`` of shape ``(H_kv, N, D * bits // 8)``. INT4 / INT2: channel ``d`` of a token is stored in byte
  ``d // per`` (``per = 8 // bits``) at bit offset ``(d % per) * bits`` (little end first). INT3 is stored as two bit
  planes: the low two bits of every channel packed exactly as INT2 (``D // 4`` bytes), then the high bit of every
  channel, 8 channels per byte (channel ``d`` in byte ``D // 4 + d // 8`` at bit ``d % 8``): ``D * 3 // 8`` bytes,
  ``D`` a multiple of 8.
* keys are quantized **per channel within a chunk**: the chunk of C tokens is the group along tokens, so key scales
  and zeros have shape ``(H_kv, M, D)`` with ``M = ceil(N / C)`` chunks. A segment may end with one partial chunk.
* values are quantized **per token** in groups of G channels: scales and zeros have shape ``(H_kv, N, D // G)``.
* a segment's values may have fewer code bits than its keys (``CocktailConfig.value_bits``): each is packed at its
  own width by the same functions (``v_codes`` then has ``D * value_bits // 8`` bytes per token).
* asymmetric min-max: ``scale = (max - min) / (2**bits - 1)`` and ``zero = min``, both rounded to the storage dtype
  first; then ``code = clamp(floor((x - zero) * (1 / scale) + 0.5), 0, 2**bits - 1)`` in fp32 (a group whose
  ``scale`` is 0 gets code 0). Dequantization is ``code * scale + zero`` in fp32.
* 8-bit scales and zeros (``CocktailConfig(scale_bits=8)``): :mod:`hf_cocktail.storage.params8`.
* the 8-bit full part (``CocktailConfig(full_part_bits=8)``, :mod:`hf_cocktail.storage.full_part`): every token and head
  symmetric absmax over its ``D`` channels: ``scale = absmax / 127`` rounded to the storage dtype, then
  ``code = clamp(round_half_even(x * (1 / scale)), -127, 127)`` as ``int8`` in fp32 (a vector whose ``scale`` is 0
  gets code 0); dequantization is ``code * scale`` in fp32 (:func:`quantize_tokens8`).

The Triton kernels in ``triton_ops`` and the fused CPU kernels in ``cpu_ops`` implement the same functions with the
same signatures and are tested against these, integers bit for bit.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4)  # packed code widths
LOW_BITS = (2, 3)  # the choices for Cocktail's lowest precision (CocktailConfig.low_bits)
PACKED_BITS = (4, 2)  # the packed segments of a layer with the default low precision, in storage order
FULL_BITS = 16  # a chunk kept at full precision
CHUNK_BITS = (FULL_BITS, 4, 3, 2)  # every precision a context chunk can get
FULL_PART_BITS = (16, 8)  # the full part: the model's precision, or 8-bit codes per token and head
SCALE_BITS = (16, 8)  # storage of scales and zeros: scale_dtype numbers, or 8-bit codes per block (params8)


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def channel_multiple(bits: int) -> int:
    """The head dim must be a multiple of this to pack ``bits``-bit codes into whole bytes."""
    return 8 if bits == 3 else 8 // bits


def check_head_dim(D: int, bits: int, group_size: int | None = None) -> None:
    per = channel_multiple(bits)
    if D % per:
        raise ValueError(f"head dim D={D} must be a multiple of {per} to pack {bits}-bit codes into bytes")
    if group_size is not None and D % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim D={D}")


def _pack_plane(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits`` in 1, 2, 4 (``8 // bits`` codes per byte, low bits first): ``(..., D)`` -> ``uint8 (..., D*bits//8)``"""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack_plane(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last dim: ``(..., D)`` -> ``uint8 (..., D * bits // 8)``
    (the layout in the module docstring; INT3 as a 2-bit plane then a 1-bit plane)."""
    check_bits(bits)
    D = codes.shape[-1]
    check_head_dim(D, bits)
    if bits == 3:
        c = codes.to(torch.int32)
        return torch.cat([_pack_plane(c & 3, 2), _pack_plane(c >> 2, 1)], dim=-1)
    return _pack_plane(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 (..., Dp)`` -> ``uint8 (..., Dp * 8 // bits)``."""
    check_bits(bits)
    if bits == 3:
        D = packed.shape[-1] * 8 // 3
        return _unpack_plane(packed[..., : D // 4], 2) | (_unpack_plane(packed[..., D // 4 :], 1) << 2)
    return _unpack_plane(packed, bits)


def check_params_finite(params: list[torch.Tensor], scale_dtype: torch.dtype, x: torch.Tensor) -> None:
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise ValueError(
            f"quantization scales/zeros overflow scale_dtype={scale_dtype} (key/value magnitudes up to "
            f"{float(x.abs().max()):.3g}); use CocktailConfig(scale_dtype='float32')"
        )


def _quantize_groups(x: torch.Tensor, dim: int, bits: int, scale_dtype: torch.dtype):
    """Min-max quantize ``x`` (fp32) with groups reduced over ``dim``. Returns (codes uint8, scale, zero)."""
    qmax = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    scale = ((mx - mn) / qmax).to(scale_dtype)
    zero = mn.to(scale_dtype)
    check_params_finite([scale, zero], scale_dtype, x)
    return group_codes(x, scale, zero, bits), scale.squeeze(dim), zero.squeeze(dim)


def group_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` (fp32) against ``scale``/``zero`` (broadcast over each group): uint8, ``x``'s shape."""
    qmax = (1 << bits) - 1
    s32, z32 = scale.float(), zero.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    return torch.floor((x - z32) * inv + 0.5).clamp_(0, qmax).to(torch.uint8)


def check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{what} contain NaN or inf; hf-cocktail refuses to quantize non-finite key/value states "
            "(the model produced them: check its dtype, e.g. use bfloat16 or float32 instead of float16)"
        )


def check_segment(
    x: torch.Tensor, bits: int, scale_dtype: torch.dtype | None, group_size: int | None = None
) -> tuple[int, int, int, torch.dtype]:
    """The checks every quantizer of a ``(H_kv, N, D)`` segment runs first; returns ``(H, N, D, scale_dtype)`` with
    ``scale_dtype`` defaulting to ``x.dtype``."""
    check_bits(bits)
    H, N, D = x.shape
    check_head_dim(D, bits, group_size)
    return H, N, D, scale_dtype or x.dtype


def quantize_pack_keys(k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None):
    """Quantize a key segment per channel within each chunk and pack it.

    Args:
        k: ``(H_kv, N, D)`` keys of chunk-ordered tokens (chunks of ``chunk_size`` tokens; the last may be partial).
        bits: 4, 3 or 2.
        chunk_size: C, the group size along tokens.
        scale_dtype: dtype of scales/zeros (default: ``k.dtype``).

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, M, D)``, ``zero (H_kv, M, D)`` with ``M = ceil(N/C)``.
    """
    H, N, D, scale_dtype = check_segment(k, bits, scale_dtype)
    if N == 0:
        return (
            k.new_zeros((H, 0, D * bits // 8), dtype=torch.uint8),
            k.new_zeros((H, 0, D), dtype=scale_dtype),
            k.new_zeros((H, 0, D), dtype=scale_dtype),
        )
    check_finite(k, "keys")
    x = whole_chunks(k.float(), chunk_size)
    codes, scale, zero = _quantize_groups(x, 2, bits, scale_dtype)
    return pack_codes(codes.reshape(H, -1, D)[:, :N], bits), scale, zero


def whole_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``(H, N, ...)`` -> ``(H, M, C, ...)``, ``M = ceil(N / C)``, the last chunk padded with copies of the last token
    (min and max of the partial chunk are unchanged)."""
    H, N = x.shape[:2]
    M = -(-N // chunk_size)
    pad = M * chunk_size - N
    if pad:
        x = torch.cat([x, x[:, -1:].expand(H, pad, *x.shape[2:])], dim=1)
    return x.reshape(H, M, chunk_size, *x.shape[2:])


def quantize_pack_values(v: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype | None = None):
    """Quantize a value segment per token in groups of ``group_size`` channels and pack it.

    Args:
        v: ``(H_kv, N, D)``; ``group_size`` (G) must divide D. ``bits``, ``scale_dtype``: as for
            :func:`quantize_pack_keys`.

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, N, D//G)``, ``zero (H_kv, N, D//G)``.
    """
    H, N, D, scale_dtype = check_segment(v, bits, scale_dtype, group_size)
    if N:
        check_finite(v, "values")
    x = v.float().reshape(H, N, D // group_size, group_size)
    codes, scale, zero = _quantize_groups(x, 3, bits, scale_dtype)
    return pack_codes(codes.reshape(H, N, D), bits), scale, zero


def dequantize_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    chunk_size: int,
    out_dtype: torch.dtype = torch.float32,
    first_token: int = 0,
) -> torch.Tensor:
    """``codes (H_kv, N, Dp)``, ``scale/zero (H_kv, M, D)`` -> keys ``(H_kv, N, D)``. ``first_token``: index of the
    first code's token counted from the start of chunk 0 of ``scale`` (for a block that starts mid-sequence)."""
    c = unpack_codes(codes, bits).float()
    N = c.shape[1]
    idx = (torch.arange(N, device=c.device) + first_token) // chunk_size
    s = scale.float().index_select(1, idx)
    z = zero.float().index_select(1, idx)
    return (c * s + z).to(out_dtype)


def dequantize_values(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``codes (H_kv, N, Dp)``, ``scale/zero (H_kv, N, D//G)`` -> values ``(H_kv, N, D)``."""
    c = unpack_codes(codes, bits).float()
    H, N, D = c.shape
    c = c.reshape(H, N, D // group_size, group_size)
    out = c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return out.reshape(H, N, D).to(out_dtype)


def quantize_tokens8(
    x: torch.Tensor, scale_dtype: torch.dtype, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit symmetric codes of every vector along the last axis (one token of one head).

    Args:
        x: ``(..., D)``, e.g. ``(B, H_kv, R, D)``.
        scale_dtype: the storage dtype of the scales.
        check: refuse non-finite ``x`` and scales that overflow ``scale_dtype`` (each check syncs a GPU once).

    Returns:
        ``codes`` int8 ``(..., D)`` in ``[-127, 127]`` and ``scale`` ``(..., 1)`` in ``scale_dtype``.
    """
    if check:
        check_finite(x, "key/value states")
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / 127.0).to(scale_dtype)
    if check:
        check_params_finite([scale], scale_dtype, x32)
    s32 = scale.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    return torch.round(x32 * inv).clamp_(-127, 127).to(torch.int8), scale


def dequantize_tokens8(codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``codes`` int8 ``(..., D)``, ``scale`` ``(..., 1)`` -> ``(..., D)`` in ``out_dtype`` (computed in fp32)."""
    return (codes.float() * scale.float()).to(out_dtype)
