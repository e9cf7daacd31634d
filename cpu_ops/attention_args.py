"""Argument checks of the fused CPU split-precision attention (:mod:`cpu_ops.attention`): each names the argument,
what it must be and what it got (ValueError), and returns what the C++ kernel takes.

Shapes: B batch, H_q query heads, H_kv key/value heads, R full-part length, S exact-head tokens, D head dim, M chunks.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32, UINT8, INT8 = (torch.int32,), (torch.uint8,), (torch.int8,)
SEGMENT_FIELDS = ("bits", "chunk_size", "group_size", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
SEGMENT_FIELDS += ("tok_off", "chunk_off")


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name} must be {expected}, got {got}")


def check_tensor(name, t, dtypes, shape: tuple) -> None:
    """``t`` must be a CPU tensor of one of ``dtypes`` and of ``shape`` (``None``: any size). ``name``: a string, or
    a ``(segment index, field)`` pair, formatted only when the check fails (this runs every decode step, for every
    layer: the common case takes the first line)."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and t.shape == shape:
        return  # the fast path, for exact shapes
    if not isinstance(name, str):
        name = f"segments[{name[0]}].{name[1]}"
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if not t.is_cpu:
        fail(name, "on the CPU", f"device {t.device}")
    if t.dtype not in dtypes:
        fail(name, f"of dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        fail(name, f"of shape {want}", f"shape {tuple(t.shape)}")


def extras_args(sinks, softcap, H_q: int) -> tuple[torch.Tensor, float]:
    """``(sinks as contiguous fp32 (H_q,) or empty, softcap or 0.0)`` for the kernel, checked."""
    if sinks is None:
        sinks = EMPTY
    else:
        check_tensor("sinks", sinks, FLOAT_DTYPES, (H_q,))
        sinks = sinks.detach().float().contiguous()
    if softcap is None:
        return sinks, 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        fail("softcap", "a positive finite float or None", repr(softcap))
    return sinks, float(softcap)


EMPTY = torch.empty(0)
NO_EXTRAS = (EMPTY, 0.0)  # no sinks, no soft-capping


def blocks_args(seg, i: int, params8: bool, H_kv: int, M: int) -> list[torch.Tensor]:
    """The block numbers ``(H_kv, M, 3)`` of a segment with 8-bit scales and zeros (items 12 and 13), checked."""
    if len(seg) != len(SEGMENT_FIELDS) + 2:
        fail(f"segments[{i}]", "a tuple with k_block and v_block (13 items) for uint8 scale and zero codes", len(seg))
    kb, vb = seg[-2:]
    check_tensor((i, "k_block"), kb, FLOAT_DTYPES, (H_kv, M, 3))
    check_tensor((i, "v_block"), vb, (kb.dtype,), (H_kv, M, 3))
    return [kb.contiguous(), vb.contiguous()]


def table_arg(scale_table) -> torch.Tensor:
    if scale_table is None:
        fail("scale_table", "a float32 (256,) tensor (hf_cocktail.storage.params8.scale_table) with 8-bit scales", None)
    check_tensor("scale_table", scale_table, (torch.float32,), (256,))
    return scale_table.contiguous()


def key_value_pair(name: str, pair, what: str, shape: tuple) -> list[torch.Tensor]:
    """``[keys' tensor, values' tensor]`` of ``pair`` (``what``: how the message names its two items), both of one
    float dtype and ``shape`` (``None``: any size), checked; two empty tensors for None."""
    if pair is None:
        return [EMPTY, EMPTY]
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        fail(name, f"a pair ({what})", type(pair).__name__)
    k, v = pair
    check_tensor(f"{name}[0]", k, FLOAT_DTYPES, shape)
    check_tensor(f"{name}[1]", v, (k.dtype,), k.shape)
    return [k, v]


def full_scales_args(full_scales, shape: tuple) -> list[torch.Tensor]:
    """``[key scales, value scales]`` of an int8 full part ``(B, H_kv, R, 1)``, checked (the same strides), or two
    empty tensors."""
    ks, vs = key_value_pair("full_scales", full_scales, "key scales, value scales", (*shape, 1))
    if ks.stride() != vs.stride():
        fail("full_scales[1]'s strides", f"those of full_scales[0] {ks.stride()}", vs.stride())
    return [ks, vs]


def full_head_args(full_head, shape: tuple) -> list[torch.Tensor]:
    """``[head keys, head values]`` ``(B, H_kv, S, D)`` (contiguous), checked, or two empty tensors."""
    return [t.contiguous() for t in key_value_pair("full_head", full_head, "head keys, head values", shape)]


def rotation_args(rotation, H_kv: int, D: int) -> list[torch.Tensor]:
    """``[query matrices, output matrices, full-part key matrices]`` ``(H_kv, D, D)`` fp32, checked (an empty tensor
    where None or not given)."""
    if rotation is None:
        return [EMPTY, EMPTY, EMPTY]
    if not isinstance(rotation, (list, tuple)) or len(rotation) not in (2, 3):
        fail(
            "rotation",
            "a pair (query matrices or None, output matrices or None) or a triple with full-part key matrices",
            type(rotation).__name__ if not isinstance(rotation, (list, tuple)) else f"{len(rotation)} items",
        )
    out = []
    for name, m in zip(("rotation[0]", "rotation[1]", "rotation[2]"), (*rotation, None)[:3]):
        if m is not None:
            check_tensor(name, m, (torch.float32,), (H_kv, D, D))
        out.append(EMPTY if m is None else m.contiguous())
    return out
