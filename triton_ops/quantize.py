"""Fused min-max quantization + bit packing, bit-exact with the PyTorch reference
(``hf_cocktail.storage.quant``, the spec; this package imports nothing from hf_cocktail).

Shapes: H_kv heads, N tokens, D head dim, C chunk size (key group along tokens), G value group size (channels),
M = ceil(N / C) chunks, Dp = D * bits // 8 packed bytes per token (bits 4, 3 or 2; INT3 as a 2-bit plane then a
1-bit plane, the reference's layout).

Bit-exactness with the reference: min/max and all arithmetic in fp32, divisions correctly rounded
(``div_rn``, Triton's ``/`` is approximate on GPU), no FMA contraction (``enable_fp_fusion=False``), and scales /
zeros rounded to the storage dtype to nearest even before they are used, as ``tensor.to(dtype)`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_bits, check_device, check_finite, check_head_dim
from .launch import Launch

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_TILE = 4096  # elements of one (tokens x channels) tile held in registers
# launches cap registers at 128 per thread (maxnreg): uncapped, ptxas spilled 8 B in the fp32 value kernel on sm_80
# at 80 registers (python -m triton_ops.aot)


@triton.jit
def _round_to(x, SD: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in storage dtype ``SD``, returned as fp32 (exactly representable in SD)."""
    if SD == tl.bfloat16:
        # done on the bits: the interpreter's fp32 -> bf16 cast truncates, the GPU's rounds to nearest even
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        y = b.to(tl.float32, bitcast=True)
    elif SD == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _quantize(x, zero, scale, BITS: tl.constexpr):
    """int32 codes of ``u = (x - zero) * (1/scale)`` (``u = 0`` where ``scale == 0``): ``clamp(floor(u + 0.5), 0,
    2**BITS - 1)``."""
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)
    u = (x - zero) * inv
    return tl.minimum(tl.maximum(tl.floor(u + 0.5), 0.0), (1 << BITS) - 1).to(tl.int32)


@triton.jit
def _pack(q, ROWS: tl.constexpr, WIDTH: tl.constexpr, BITS: tl.constexpr):
    """int32 codes ``(ROWS, WIDTH)`` (channel order) -> bytes ``(ROWS, WIDTH * BITS // 8)``: channel d in byte
    d // per at bit (d % per) * BITS, ``per = 8 // BITS`` (BITS of 1, 2 or 4)."""
    PER: tl.constexpr = 8 // BITS
    q = tl.reshape(q, [ROWS, WIDTH // PER, PER])
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(q << shifts[None, None, :], axis=2).to(tl.uint8)


@triton.jit
def _store_packed(row_ptr, q, rmask, ROWS: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 codes ``q (ROWS, WIDTH)`` (channels >= D are padding) and store the ``D * BITS // 8`` bytes of
    row r at ``row_ptr[r]`` (rows where ``rmask``). INT3: the low two bits of every channel packed as INT2
    (``D // 4`` bytes), then the high bit of every channel, 8 channels per byte (``D // 8`` bytes)."""
    if BITS == 3:
        lo = _pack(q & 3, ROWS, WIDTH, 2)
        dl = tl.arange(0, WIDTH // 4)
        tl.store(row_ptr[:, None] + dl[None, :], lo, mask=rmask[:, None] & (dl < D // 4)[None, :])
        hi = _pack(q >> 2, ROWS, WIDTH, 1)
        dh = tl.arange(0, WIDTH // 8)
        tl.store(row_ptr[:, None] + (D // 4 + dh)[None, :], hi, mask=rmask[:, None] & (dh < D // 8)[None, :])
    else:
        PER: tl.constexpr = 8 // BITS
        packed = _pack(q, ROWS, WIDTH, BITS)
        dp = tl.arange(0, WIDTH // PER)
        tl.store(row_ptr[:, None] + dp[None, :], packed, mask=rmask[:, None] & (dp < D // PER)[None, :])


@triton.jit
def _quant_keys_kernel(
    k_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    N,
    C,
    s_kh,
    s_kn,
    M,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    SD: tl.constexpr,
):
    """One program per (head, chunk): per-channel min/max over the chunk's valid tokens, then quantize and pack."""
    h = tl.program_id(0)
    m = tl.program_id(1)
    DP: tl.constexpr = D * BITS // 8
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    t_lo = m * C
    t_hi = tl.minimum(t_lo + C, N)
    k_base = k_ptr + h.to(tl.int64) * s_kh
    mn = tl.full([BLOCK_D], float("inf"), tl.float32)
    mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for a in range(t_lo, t_hi, BLOCK_T):
        t = a + tl.arange(0, BLOCK_T)
        msk = (t < t_hi)[:, None] & dmask[None, :]
        x = tl.load(k_base + t[:, None].to(tl.int64) * s_kn + d[None, :], mask=msk, other=0.0).to(tl.float32)
        mn = tl.minimum(mn, tl.min(tl.where(msk, x, float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(msk, x, float("-inf")), axis=0))
    mn = tl.where(dmask, mn, 0.0)
    mx = tl.where(dmask, mx, 0.0)
    scale = _round_to(tl.math.div_rn(mx - mn, (1 << BITS) - 1), SD)
    zero = _round_to(mn, SD)
    sz_off = (h.to(tl.int64) * M + m) * D + d
    tl.store(scale_ptr + sz_off, scale, mask=dmask)
    tl.store(zero_ptr + sz_off, zero, mask=dmask)
    c_base = codes_ptr + h.to(tl.int64) * N * DP
    for a in range(t_lo, t_hi, BLOCK_T):
        t = a + tl.arange(0, BLOCK_T)
        tmask = t < t_hi
        x = tl.load(
            k_base + t[:, None].to(tl.int64) * s_kn + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        q = _quantize(x, zero[None, :], scale[None, :], BITS)
        _store_packed(c_base + t.to(tl.int64) * DP, q, tmask, BLOCK_T, BLOCK_D, D, BITS)


@triton.jit
def _quant_values_kernel(
    v_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    N,
    s_vh,
    s_vn,
    D: tl.constexpr,
    G: tl.constexpr,
    NG_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    SD: tl.constexpr,
):
    """One program per (head, block of tokens): per-token min/max over groups of G channels."""
    h = tl.program_id(0)
    DP: tl.constexpr = D * BITS // 8
    NG: tl.constexpr = D // G
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, NG_P)
    ch = g[:, None] * G + tl.arange(0, G)[None, :]  # (NG_P, G) channel index
    tmask = t < N
    msk = tmask[:, None, None] & (ch < D)[None, :, :]
    t64 = t.to(tl.int64)
    x = tl.load(v_ptr + h.to(tl.int64) * s_vh + t64[:, None, None] * s_vn + ch[None, :, :], mask=msk, other=0.0).to(
        tl.float32
    )  # (BLOCK_N, NG_P, G)
    gmask = tmask[:, None] & (g < NG)[None, :]
    mn = tl.where(gmask, tl.min(tl.where(msk, x, float("inf")), axis=2), 0.0)
    mx = tl.where(gmask, tl.max(tl.where(msk, x, float("-inf")), axis=2), 0.0)
    scale = _round_to(tl.math.div_rn(mx - mn, (1 << BITS) - 1), SD)
    zero = _round_to(mn, SD)
    sz_off = (h.to(tl.int64) * N + t64[:, None]) * NG + g[None, :]
    tl.store(scale_ptr + sz_off, scale, mask=gmask)
    tl.store(zero_ptr + sz_off, zero, mask=gmask)
    q = tl.reshape(_quantize(x, zero[:, :, None], scale[:, :, None], BITS), [BLOCK_N, NG_P * G])
    _store_packed(codes_ptr + (h.to(tl.int64) * N + t64) * DP, q, tmask, BLOCK_N, NG_P * G, D, BITS)


def _check_input(x: torch.Tensor, what: str, bits: int, scale_dtype) -> torch.dtype:
    if x.dim() != 3:
        raise ValueError(f"{what} must have shape (H_kv, N, D), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating point tensor, got {x.dtype}")
    check_bits(bits)
    scale_dtype = scale_dtype or x.dtype
    if scale_dtype not in _TL_DTYPES:
        raise ValueError(f"scale_dtype must be one of {list(_TL_DTYPES)}, got {scale_dtype}")
    return scale_dtype


def _check_params(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scale_dtype) -> None:
    """The reference's overflow check, with its message."""
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(zero).all())):
        raise ValueError(
            f"quantization scales/zeros overflow scale_dtype={scale_dtype} (key/value magnitudes up to "
            f"{float(x.float().abs().max()):.3g}); use CocktailConfig(scale_dtype='float32')"
        )


def _run_planned(planned: tuple, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a planned quantization ``(launch, codes, scale, zero)`` of ``x`` (its ``name`` for errors): ``x`` checked
    finite, the kernel launched, the parameters checked against the scale dtype; ``(codes, scale, zero)``."""
    launch, codes, scale, zero = planned
    if launch is not None:
        check_finite(x, name)
        launch.run(x.device)
        _check_params(x, scale, zero, scale.dtype)
    return codes, scale, zero


def quantize_pack_keys(k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None):
    """Triton version of :func:`hf_cocktail.storage.quant.quantize_pack_keys` (same arguments, bit-identical results).

    Args:
        k: ``(H_kv, N, D)`` chunk-ordered keys (chunks of ``chunk_size`` = C tokens, the last may be partial).

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, M, D)``, ``zero (H_kv, M, D)`` with ``M = ceil(N/C)``.
    """
    check_device(k)
    return _run_planned(plan_quantize_keys(k, bits, chunk_size, scale_dtype), k, "keys")


def plan_quantize_keys(k: torch.Tensor, bits: int, chunk_size: int, scale_dtype: torch.dtype | None = None):
    """``(launch, codes, scale, zero)`` of :func:`quantize_pack_keys` (its arguments checked, its outputs
    allocated); ``launch`` is None for zero tokens. Run by the launcher, compiled by :mod:`triton_ops.aot`."""
    scale_dtype = _check_input(k, "keys", bits, scale_dtype)
    H, N, D = k.shape
    check_head_dim(D, bits)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    M = -(-N // chunk_size)
    codes = torch.empty((H, N, D * bits // 8), dtype=torch.uint8, device=k.device)
    scale = torch.empty((H, M, D), dtype=scale_dtype, device=k.device)
    zero = torch.empty_like(scale)
    if N == 0:
        return None, codes, scale, zero
    if k.stride(2) != 1:
        k = k.contiguous()
    block_d = triton.next_power_of_2(D)
    block_t = min(triton.next_power_of_2(chunk_size), max(1, _TILE // block_d))
    launch = Launch(
        _quant_keys_kernel,
        (H, M),
        (k, codes, scale, zero, N, chunk_size, k.stride(0), k.stride(1), M),
        dict(D=D, BLOCK_D=block_d, BLOCK_T=block_t, BITS=bits, SD=_TL_DTYPES[scale_dtype]),
        options=dict(enable_fp_fusion=False, maxnreg=128),
    )
    return launch, codes, scale, zero


def quantize_pack_values(v: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype | None = None):
    """Triton version of :func:`hf_cocktail.storage.quant.quantize_pack_values` (same arguments, bit-identical results).

    Args:
        v: ``(H_kv, N, D)``; ``group_size`` (G) must divide D.

    Returns:
        ``codes uint8 (H_kv, N, D*bits//8)``, ``scale (H_kv, N, D//G)``, ``zero (H_kv, N, D//G)``.
    """
    check_device(v)
    return _run_planned(plan_quantize_values(v, bits, group_size, scale_dtype), v, "values")


def plan_quantize_values(v: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype | None = None):
    """``(launch, codes, scale, zero)`` of :func:`quantize_pack_values`; ``launch`` is None for zero tokens."""
    scale_dtype = _check_input(v, "values", bits, scale_dtype)
    H, N, D = v.shape
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    check_head_dim(D, bits, group_size)
    if group_size & (group_size - 1):  # CocktailConfig only allows powers of two; the kernel relies on it
        raise ValueError(f"the Triton quantizer needs a power-of-two group_size, got {group_size}")
    NG = D // group_size
    codes = torch.empty((H, N, D * bits // 8), dtype=torch.uint8, device=v.device)
    scale = torch.empty((H, N, NG), dtype=scale_dtype, device=v.device)
    zero = torch.empty_like(scale)
    if N == 0:
        return None, codes, scale, zero
    if v.stride(2) != 1:
        v = v.contiguous()
    ng_p = triton.next_power_of_2(NG)
    block_n = max(1, _TILE // (ng_p * group_size))
    launch = Launch(
        _quant_values_kernel,
        (H, triton.cdiv(N, block_n)),
        (v, codes, scale, zero, N, v.stride(0), v.stride(1)),
        dict(D=D, G=group_size, NG_P=ng_p, BLOCK_N=block_n, BITS=bits, SD=_TL_DTYPES[scale_dtype]),
        options=dict(enable_fp_fusion=False, maxnreg=128),
    )
    return launch, codes, scale, zero
