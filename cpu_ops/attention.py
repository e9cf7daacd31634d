"""Launcher of the fused CPU split-precision decode attention: checks the inputs, then calls the C++ kernel."""

from __future__ import annotations

import math

import torch

from ._build import extension

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32, UINT8 = (torch.int32,), (torch.uint8,)
SUPPORTED_BITS = (2, 3, 4)
LEVEL_TABLE_BITS = (2, 3)  # bit widths whose codes may stand for a table of levels (a segment's 12th item)
_SEGMENT_FIELDS = (
    "bits",
    "chunk_size",
    "group_size",
    "k_codes",
    "k_scale",
    "k_zero",
    "v_codes",
    "v_scale",
    "v_zero",
    "tok_off",
    "chunk_off",
)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name} must be {expected}, got {got}")


def _check_tensor(name, t, dtypes, shape: tuple) -> None:
    """``t`` must be a CPU tensor of one of ``dtypes`` and of ``shape`` (``None``: any size). ``name``: a string, or
    a ``(segment index, field)`` pair, formatted only when the check fails (this runs every decode step, for every
    layer: the common case takes the first line)."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and t.shape == shape:
        return  # the fast path, for exact shapes
    if not isinstance(name, str):
        name = f"segments[{name[0]}].{name[1]}"
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if not t.is_cpu:
        _fail(name, "on the CPU", f"device {t.device}")
    if t.dtype not in dtypes:
        _fail(name, f"of dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        _fail(name, f"of shape {want}", f"shape {tuple(t.shape)}")


def split_precision_attention(
    query: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    full_start: torch.Tensor,
    segments,
    scaling: float,
    *,
    tokens_per_item: int | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """Fused split-precision decode attention on CPU, straight from the packed codes.

    One softmax over the scores of [full part, segment 0, segment 1], as ``split_precision_attention_torch`` in
    hf_cocktail, with fp32 accumulation. Shapes: B batch, H_q = n_rep * H_kv query heads, L_q query tokens, D head
    dim (a multiple of 8), R full-part length, N / M tokens / chunks of a segment (all sequences end to end).

    Args:
        query: ``(B, H_q, L_q, D)`` float32 / bfloat16 / float16.
        full_keys, full_values: ``(B, H_kv, R, D)``, one of those dtypes (both the same), same strides, last dim
            contiguous (a strided view of a larger buffer is fine). Sequence ``b`` owns tokens ``[full_start[b], R)``;
            the newest ``L_q`` are the queries' own: query token ``i`` sees full-part token ``t`` iff
            ``t <= R - L_q + i``.
        full_start: int32 ``(B,)``, values in ``[0, R]``.
        segments: a list of 0 to 2 tuples ``(bits, chunk_size, group_size, k_codes, k_scale, k_zero, v_codes,
            v_scale, v_zero, tok_off, chunk_off[, levels])`` in the storage format of ``hf_cocktail.storage.quant``:
            bits 2, 3 or 4 for keys and values (INT3: a 2-bit plane then a 1-bit plane), or a pair
            ``(key_bits, value_bits)`` with ``value_bits <= key_bits``; chunk_size C >= 1; group_size G a power of
            two dividing D; ``k_codes`` uint8 ``(H_kv, N, D * key_bits // 8)``, ``v_codes`` uint8
            ``(H_kv, N, D * value_bits // 8)``; ``k_scale``, ``k_zero``
            ``(H_kv, M, D)`` and ``v_scale``, ``v_zero`` ``(H_kv, N, D // G)``, all four of one dtype (float16 /
            bfloat16 / float32); ``tok_off``, ``chunk_off`` int32 ``(B + 1,)``: sequence ``b`` owns tokens
            ``[tok_off[b], tok_off[b+1])`` and chunks ``[chunk_off[b], chunk_off[b+1])``; the chunk of token ``t``
            is ``chunk_off[b] + (t - tok_off[b]) // C``. ``levels`` (optional, one width of 2 or 3 bits): float32
            ``(2**bits,)``,
            the level each code stands for (a codebook: ``level * scale + zero`` instead of ``code * scale +
            zero``).
            Non-contiguous segment tensors are copied (stored segments are contiguous).
        scaling: softmax scale (usually ``D ** -0.5``).
        tokens_per_item: tokens of one (sequence, kv head, source) per parallel work item (default: chosen from the
            sizes and ``torch.get_num_threads()``).
        isa: ``"auto"`` (the AVX2 + FMA + F16C build where the CPU has them, else the portable baseline build) or
            ``"baseline"`` (the baseline build everywhere; for tests).

    Returns:
        ``(B, H_q, L_q, D)`` in ``query.dtype``. A query row that sees no token at all gets zeros.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device, or inconsistent offsets.
        ImportError: the C++ extension could not be built here (the message says why and how to fix it).
    """
    _check_tensor("query", query, FLOAT_DTYPES, (None,) * 4)
    B, H_q, L_q, D = query.shape
    if D % 8 or D == 0:
        _fail("query's head dim D", "a positive multiple of 8", D)
    if L_q < 1:
        _fail("query's L_q", ">= 1", L_q)
    _check_tensor("full_keys", full_keys, FLOAT_DTYPES, (B, None, None, D))
    H_kv, R = full_keys.shape[1], full_keys.shape[2]
    if H_kv == 0 or H_q % H_kv:
        _fail("full_keys' H_kv (dim 1)", f"a divisor of the query heads H_q={H_q}", H_kv)
    _check_tensor("full_values", full_values, (full_keys.dtype,), full_keys.shape)
    for name, t in (("full_keys", full_keys), ("full_values", full_values)):
        if t.stride(-1) != 1:
            _fail(f"{name}' last dim", "contiguous (stride 1)", f"stride {t.stride(-1)}")
    if full_values.stride() != full_keys.stride():
        _fail("full_values' strides", f"those of full_keys {full_keys.stride()}", full_values.stride())
    _check_tensor("full_start", full_start, INT32, (B,))
    if not isinstance(segments, (list, tuple)) or len(segments) > 2:
        _fail(
            "segments",
            "a list of at most 2 segment tuples",
            f"{len(segments)} segments" if isinstance(segments, (list, tuple)) else type(segments).__name__,
        )
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        _fail("scaling", "a finite float", repr(scaling))

    seg_tensors, seg_ints, tokens = [], [], 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, (list, tuple)) or len(seg) not in (len(_SEGMENT_FIELDS), len(_SEGMENT_FIELDS) + 1):
            _fail(
                f"segments[{i}]",
                f"a tuple {_SEGMENT_FIELDS} (+ levels)",
                f"{len(seg)} items" if isinstance(seg, (list, tuple)) else type(seg).__name__,
            )
        bits, C, G, kc, ks, kz, vc, vs, vz, tok, chk = seg[: len(_SEGMENT_FIELDS)]
        bits, vbits = code_widths(bits, f"segments[{i}].bits")
        if not (type(C) is int and C >= 1):
            _fail(f"segments[{i}].chunk_size", "an int >= 1", repr(C))
        if not (type(G) is int and G >= 1 and G & (G - 1) == 0 and D % G == 0):
            _fail(f"segments[{i}].group_size", f"a power of two dividing D={D}", repr(G))
        N, M = (t.shape[1] if isinstance(t, torch.Tensor) and t.dim() == 3 else None for t in (kc, ks))
        _check_tensor((i, "k_codes"), kc, UINT8, (H_kv, N, D * bits // 8))
        _check_tensor((i, "k_scale"), ks, FLOAT_DTYPES, (H_kv, M, D))
        _check_tensor((i, "k_zero"), kz, (ks.dtype,), ks.shape)
        _check_tensor((i, "v_codes"), vc, UINT8, (H_kv, N, D * vbits // 8))
        _check_tensor((i, "v_scale"), vs, (ks.dtype,), (H_kv, N, D // G))
        _check_tensor((i, "v_zero"), vz, (ks.dtype,), vs.shape)
        _check_tensor((i, "tok_off"), tok, INT32, (B + 1,))
        _check_tensor((i, "chunk_off"), chk, INT32, (B + 1,))
        seg_tensors += [t.contiguous() for t in (kc, ks, kz, vc, vs, vz, tok, chk)] + [_levels(seg, i, bits, vbits)]
        seg_ints += [bits, vbits, C, G]
        tokens += N
    if tokens_per_item is None:
        tokens_per_item = _default_tokens_per_item(B * H_kv, R + tokens // max(B, 1))
    elif not (type(tokens_per_item) is int and tokens_per_item >= 1):
        _fail("tokens_per_item", "an int >= 1", repr(tokens_per_item))
    if isa not in ("auto", "baseline"):
        _fail("isa", "'auto' or 'baseline'", repr(isa))
    if query.stride(-1) != 1:
        query = query.contiguous()
    return extension().split_attention(
        query,
        full_keys,
        full_values,
        full_start.contiguous(),
        seg_tensors,
        seg_ints,
        float(scaling),
        tokens_per_item,
        isa == "baseline",
    )


def code_widths(bits, name: str) -> tuple[int, int]:
    """A segment's ``bits`` item -> ``(key_bits, value_bits)``: an int is both, a pair has ``value_bits <=
    key_bits``."""
    pair = bits if isinstance(bits, (list, tuple)) and len(bits) == 2 else (bits, bits)
    if not all(type(b) is int and b in SUPPORTED_BITS for b in pair) or pair[1] > pair[0]:
        _fail(name, f"one of {SUPPORTED_BITS} or a pair (key_bits, value_bits <= key_bits) of them", repr(bits))
    return pair[0], pair[1]


def _levels(seg, i: int, bits: int, vbits: int) -> torch.Tensor:
    """A segment's optional 12th item, checked: its level table, or an empty tensor for uniform levels."""
    if len(seg) == len(_SEGMENT_FIELDS):
        return _NO_LEVELS
    if bits not in LEVEL_TABLE_BITS or vbits != bits:
        _fail(
            f"segments[{i}].bits", f"one of {LEVEL_TABLE_BITS} (keys and values of one width) with levels", repr(seg[0])
        )
    _check_tensor((i, "levels"), seg[-1], (torch.float32,), (1 << bits,))
    return seg[-1].contiguous()


_NO_LEVELS = torch.empty(0)


def _default_tokens_per_item(pairs: int, tokens_per_pair: int) -> int:
    """About 4 work items per thread (load balance), each of 256 to 2048 tokens (partials stay cheap)."""
    want = -(-pairs * tokens_per_pair // (4 * torch.get_num_threads()))
    return min(2048, max(256, -(-want // 64) * 64))
