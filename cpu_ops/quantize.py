"""Launchers of the fused CPU quantizers: check the inputs, allocate the outputs, then call the C++ kernel.

Same signatures, outputs and errors as ``hf_cocktail.storage.quant.quantize_pack_keys`` / ``quantize_pack_values`` (the
PyTorch reference, whose module docstring specifies the storage format); codes, scales and zeros are bit for bit
the reference's. One pass per group for min / max and the finiteness check, one for the codes and their packing
(``csrc/quantize.cpp``), parallel over chunks (keys) or tokens (values) on ATen's thread pool.
"""

from __future__ import annotations

import torch

from ._build import extension

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_BITS = (2, 3, 4)  # the packed widths of hf_cocktail.storage.quant (INT3: a 2-bit plane, then a 1-bit plane)
_NON_FINITE, _OVERFLOW = 1, 2  # status bits of the C++ quantizers (csrc/quantize.h)


def _check_input(x, name: str, bits) -> tuple[int, int, int]:
    """The reference's bits / head-dim checks (same messages) and the launcher's own type checks; ``(H, N, D)``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_cpu:
        raise ValueError(f"{name} must be on the CPU, got device {x.device}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be of dtype {' or '.join(str(d) for d in FLOAT_DTYPES)}, got {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be of shape (H_kv, N, D), got shape {tuple(x.shape)}")
    H, N, D = x.shape
    per = 8 if bits == 3 else 8 // int(bits)
    if D % per:
        raise ValueError(f"head dim D={D} must be a multiple of {per} to pack {bits}-bit codes into bytes")
    return H, N, D


def _scale_dtype(scale_dtype, x: torch.Tensor) -> torch.dtype:
    scale_dtype = scale_dtype or x.dtype
    if scale_dtype not in FLOAT_DTYPES:
        raise ValueError(f"scale_dtype must be {' or '.join(str(d) for d in FLOAT_DTYPES)}, got {scale_dtype}")
    return scale_dtype


def _raise_for(status: int, x: torch.Tensor, what: str, scale_dtype: torch.dtype) -> None:
    """The reference's errors (``hf_cocktail.storage.quant.check_finite`` first, then the scale overflow), same text."""
    if status & _NON_FINITE:
        raise ValueError(
            f"{what} contain NaN or inf; hf-cocktail refuses to quantize non-finite key/value states "
            "(the model produced them: check its dtype, e.g. use bfloat16 or float32 instead of float16)"
        )
    if status & _OVERFLOW:
        raise ValueError(
            f"quantization scales/zeros overflow scale_dtype={scale_dtype} (key/value magnitudes up to "
            f"{float(x.float().abs().max()):.3g}); use CocktailConfig(scale_dtype='float32')"
        )


def quantize_pack_keys(k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None):
    """Quantize a key segment per channel within each chunk and pack it (fused; see ``hf_cocktail.storage.quant``).

    Args:
        k: ``(H_kv, N, D)`` float32 / bfloat16 / float16 CPU keys of chunk-ordered tokens (chunks of ``chunk_size``
            tokens; the last may be partial: its scales come from its own tokens).
        bits: 4, 3 or 2.
        chunk_size: C >= 1, the group size along tokens.
        scale_dtype: dtype of scales/zeros, float32 / bfloat16 / float16 (default: ``k.dtype``).

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, M, D)``, ``zero (H_kv, M, D)`` with ``M = ceil(N/C)``.

    Raises:
        ValueError: bad arguments; NaN / inf keys; scales or zeros that overflow ``scale_dtype``.
        ImportError: the C++ extension could not be built here (the message says why and how to fix it).
    """
    H, N, D = _check_input(k, "keys", bits)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    scale_dtype = _scale_dtype(scale_dtype, k)
    M = -(-N // chunk_size)
    codes = torch.empty((H, N, D * bits // 8), dtype=torch.uint8)
    scale = torch.empty((H, M, D), dtype=scale_dtype)
    zero = torch.empty((H, M, D), dtype=scale_dtype)
    if N:
        k = k.contiguous()
        status = extension().quantize_keys(k, int(bits), chunk_size, codes, scale, zero)
        _raise_for(status, k, "keys", scale_dtype)
    return codes, scale, zero


def quantize_pack_values(v: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype | None = None):
    """Quantize a value segment per token in groups of ``group_size`` channels and pack it (fused; see
    ``hf_cocktail.storage.quant``).

    Args:
        v: ``(H_kv, N, D)`` float32 / bfloat16 / float16 CPU values; ``group_size`` (G) must divide D.
        bits: 4, 3 or 2.
        scale_dtype: dtype of scales/zeros, float32 / bfloat16 / float16 (default: ``v.dtype``).

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, N, D//G)``, ``zero (H_kv, N, D//G)``.

    Raises:
        ValueError: bad arguments; NaN / inf values; scales or zeros that overflow ``scale_dtype``.
        ImportError: the C++ extension could not be built here (the message says why and how to fix it).
    """
    H, N, D = _check_input(v, "values", bits)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if D % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim D={D}")
    scale_dtype = _scale_dtype(scale_dtype, v)
    codes = torch.empty((H, N, D * bits // 8), dtype=torch.uint8)
    scale = torch.empty((H, N, D // group_size), dtype=scale_dtype)
    zero = torch.empty((H, N, D // group_size), dtype=scale_dtype)
    if N:
        v = v.contiguous()
        status = extension().quantize_values(v, int(bits), group_size, codes, scale, zero)
        _raise_for(status, v, "values", scale_dtype)
    return codes, scale, zero


def decode_params8(
    scale_codes: torch.Tensor,
    zero_codes: torch.Tensor,
    block: torch.Tensor,
    block_of_row: torch.Tensor | None = None,
    *,
    table: torch.Tensor,
):
    """8-bit scales and zeros -> fp32 numbers (fused; bit for bit ``hf_cocktail.storage.params8.decode_params8``, whose
    signature this is, plus its fp32 ``(256,)`` table of scale factors, ``hf_cocktail.storage.params8.scale_table``).

    Args:
        scale_codes, zero_codes: ``uint8 (H, R, K)`` CPU tensors.
        block: ``(H, M, 3)`` ``(s_max, z_lo, z_step)``, float32 / bfloat16 / float16.
        block_of_row: ``None`` (``M == R``) or ``int64 (R,)``, the block of every row.

    Returns:
        ``scale, zero`` fp32 ``(H, R, K)``.
    """
    if block.dtype not in FLOAT_DTYPES:
        raise ValueError(f"block must be of dtype {' or '.join(str(d) for d in FLOAT_DTYPES)}, got {block.dtype}")
    if not (isinstance(table, torch.Tensor) and table.dtype == torch.float32 and table.shape == (256,)):
        raise ValueError("table must be the float32 (256,) table of hf_cocktail.storage.params8.scale_table")
    scale = torch.empty(scale_codes.shape, dtype=torch.float32)
    zero = torch.empty(scale_codes.shape, dtype=torch.float32)
    rows = _NO_ROWS if block_of_row is None else block_of_row.contiguous()
    extension().decode_params8(
        scale_codes.contiguous(), zero_codes.contiguous(), block.contiguous(), rows, table.cpu(), scale, zero
    )
    return scale, zero


_NO_ROWS = torch.empty(0, dtype=torch.long)


def append_tokens8(
    k: torch.Tensor,
    v: torch.Tensor,
    codes: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    pos: int,
    rotation: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Quantize new tokens to 8-bit codes and write them into an 8-bit full part's buffers, in place (fused; bit for
    bit ``hf_cocktail.storage.quant.quantize_tokens8(x, scale_dtype, check=False)`` on finite inputs; a non-finite
    token gets a NaN or inf scale, as there).

    Args:
        k, v: ``(B, H_kv, L, D)`` float32 / bfloat16 / float16 CPU tensors, last dim contiguous.
        codes: the int8 key and value buffers ``(B, H_kv, capacity, D)`` (views are fine), last dim contiguous.
        scales: the key and value scale buffers ``(B, H_kv, capacity, 1)``, float32 / bfloat16 / float16.
        pos: the first token position written; tokens ``[pos, pos + L)`` must fit in ``capacity``.
        rotation: rotated storage, ``(key matrices, value matrices)``, each fp32 ``(H_kv, D, D)`` or None: ``k`` and
            ``v`` are rotated first, as ``hf_cocktail.storage.rotation.Rotation.rotate_pair`` does it (the same ATen
            operations, so the same bits: one matmul of both where they share one matrix tensor).

    Returns:
        the views of the four buffers' first ``pos + L`` tokens, ``[key codes, value codes, key scales, value
        scales]`` (what an 8-bit full part holds after the append; made in C++, cheaper than four ``narrow`` calls).

    Raises:
        ValueError: a wrong shape, dtype, device or stride, or tokens that do not fit (checked in C++: this runs
            once per layer and decode step).
    """
    if rotation is not None and not (isinstance(rotation, (tuple, list)) and len(rotation) == 2):
        raise ValueError(
            f"rotation must be None or a pair (key matrices or None, value matrices or None), got {rotation!r}"
        )
    rot_k, rot_v = (None, None) if rotation is None else rotation
    return extension().append_tokens8(
        k,
        v,
        codes[0],
        codes[1],
        scales[0],
        scales[1],
        pos,
        _NO_MATRIX if rot_k is None else rot_k,
        _NO_MATRIX if rot_v is None else rot_v,
    )


def append_tokens(
    k: torch.Tensor,
    v: torch.Tensor,
    buffers: tuple[torch.Tensor, torch.Tensor],
    pos: int,
    rotation: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Write new tokens into a full part's buffers at the model's precision, in place, rotated first where the storage
    is (fused: bit for bit ``hf_cocktail.storage.rotation.Rotation.rotate_pair`` then ``FullPart.append``'s copies).

    Args:
        k, v: ``(B, H_kv, L, D)`` float32 / bfloat16 / float16 CPU tensors of one dtype, last dim contiguous.
        buffers: the key and value buffers ``(B, H_kv, capacity, D)`` (views are fine), a float dtype, last dim
            contiguous; the tokens are cast to it as ``Tensor.copy_`` does.
        pos: the first token position written; tokens ``[pos, pos + L)`` must fit in ``capacity``.
        rotation: as in :func:`append_tokens8` (the same ATen operations as ``Rotation.rotate_pair``).

    Returns:
        the views of the two buffers' first ``pos + L`` tokens, ``[keys, values]`` (what the part holds after the
        append).

    Raises:
        ValueError: a wrong shape, dtype, device or stride, or tokens that do not fit (checked in C++).
    """
    if rotation is not None and not (isinstance(rotation, (tuple, list)) and len(rotation) == 2):
        raise ValueError(
            f"rotation must be None or a pair (key matrices or None, value matrices or None), got {rotation!r}"
        )
    rot_k, rot_v = (None, None) if rotation is None else rotation
    return extension().append_tokens(
        k,
        v,
        buffers[0],
        buffers[1],
        pos,
        _NO_MATRIX if rot_k is None else rot_k,
        _NO_MATRIX if rot_v is None else rot_v,
    )


_NO_MATRIX = torch.empty(0)
