"""Launcher of the fused CPU split-precision decode attention: checks the inputs, then calls the C++ kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._build import extension
from .key_outliers import outlier_item

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32, UINT8, INT8 = (torch.int32,), (torch.uint8,), (torch.int8,)
_ISA_CODES = {"auto": 0, "baseline": 1, "avx2": 2}  # split_attention.cpp's Isa
_ONE_ITEM = 1 << 62  # tokens per work item: one item per (sequence, kv head, source)
SUPPORTED_BITS = (2, 3, 4)
READS_KEY_OUTLIERS = True  # segments with outlier key channels (a last item (n_out, channels)): read
_SEGMENT_FIELDS = ("bits", "chunk_size", "group_size", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
_SEGMENT_FIELDS += ("tok_off", "chunk_off")


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
    full_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotation: tuple[torch.Tensor | None, ...] | None = None,
    scale_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Fused split-precision decode attention on CPU, straight from the packed codes.

    One softmax over the scores of [full part, segment 0, segment 1], as ``split_precision_attention_torch`` in
    hf_cocktail, with fp32 accumulation. Shapes: B batch, H_q = n_rep * H_kv query heads, L_q query tokens, D head
    dim (a multiple of 8), R full-part length, N / M tokens / chunks of a segment (all sequences end to end).

    Args:
        query: ``(B, H_q, L_q, D)`` float32 / bfloat16 / float16.
        full_keys, full_values: ``(B, H_kv, R, D)``, one of those dtypes (both the same), or int8 codes with
            ``full_scales``; same strides, last dim contiguous (a strided view of a larger buffer is fine).
            Sequence ``b`` owns tokens ``[full_start[b], R)``; the newest ``L_q`` are the queries' own: query token
            ``i`` sees full-part token ``t`` iff ``t <= R - L_q + i``.
        full_start: int32 ``(B,)``, values in ``[0, R]``.
        segments: a list of 0 to 2 tuples ``(bits, chunk_size, group_size, k_codes, k_scale, k_zero, v_codes,
            v_scale, v_zero, tok_off, chunk_off[, k_block, v_block])`` in the storage format of
            ``hf_cocktail.storage.quant``:
            bits 2, 3 or 4 for keys and values (INT3: a 2-bit plane then a 1-bit plane), or a pair
            ``(key_bits, value_bits)`` with ``value_bits <= key_bits``; chunk_size C >= 1; group_size G a power of
            two dividing D; ``k_codes`` uint8 ``(H_kv, N, D * key_bits // 8)``, ``v_codes`` uint8
            ``(H_kv, N, D * value_bits // 8)``; ``k_scale``, ``k_zero``
            ``(H_kv, M, D)`` and ``v_scale``, ``v_zero`` ``(H_kv, N, D // G)``, all four of one dtype (float16 /
            bfloat16 / float32); ``tok_off``, ``chunk_off`` int32 ``(B + 1,)``: sequence ``b`` owns tokens
            ``[tok_off[b], tok_off[b+1])`` and chunks ``[chunk_off[b], chunk_off[b+1])``; the chunk of token ``t``
            is ``chunk_off[b] + (t - tok_off[b]) // C``. 8-bit scales and zeros (``hf_cocktail.storage.params8``):
            ``k_scale`` ... ``v_zero`` are their uint8 codes, ``k_block`` and ``v_block`` ``(H_kv, M, 3)`` float
            ``(s_max, z_lo, z_step)`` per chunk (values: the chunk of the token), decoded in the inner loop as
            ``s_max * scale_table[code]`` and ``z_lo + code * z_step``.
            Outlier key channels (``hf_cocktail.storage.key_outliers``, 16-bit scales only): one more item ``(n_out,
            channels int32 (H_kv, D))``; ``k_codes`` then ``(H_kv, N, (D - n_out) * key_bits // 8 + n_out)`` and
            ``k_scale``, ``k_zero`` in the stored order ``channels``. Non-contiguous segment tensors are copied.
        scaling: softmax scale (usually ``D ** -0.5``).
        tokens_per_item: tokens of one (sequence, kv head, source) per parallel work item (default: chosen from the
            sizes and ``torch.get_num_threads()``).
        isa: ``"auto"`` (the fastest build this CPU runs: AVX-512 VNNI, else AVX2 + FMA + F16C, else the portable
            baseline build), ``"avx2"`` (the AVX2 build where the CPU has it: fp32 arithmetic only) or
            ``"baseline"`` (the baseline build everywhere; for tests). The VNNI build computes P.V of packed
            values in 16-bit integers: each product ``p * value_scale`` is rounded to 16 bits on one scale per
            query row and block of 32 tokens (at most ``2**-16`` of the block's largest; the attention's error
            is below fp16 PyTorch's), the rest is as in the AVX2 build.
        full_scales: with int8 ``full_keys`` / ``full_values`` (an 8-bit full part,
            ``hf_cocktail.storage.quant.quantize_tokens8``): their scales ``(B, H_kv, R, 1)``, one float dtype, the
            strides of each other; token ``t`` of head ``h`` reads ``code * scale``.
        rotation: rotated storage, ``(query_matrices, output_matrices[, full_key_matrices])``, each fp32 ``(H_kv,
            D, D)`` or None: the query rows of kv head ``h`` are multiplied by ``query_matrices[h]`` (``q . R``)
            before attention, the output by ``output_matrices[h]`` transposed (``o . R^T``) after it. With
            ``full_key_matrices`` the full part's keys are stored in a basis of their own (``k . F``,
            ``hf_cocktail.storage.full_part.Int8FullPart.key_basis``): its scores use the query rows times
            ``full_key_matrices[h]`` (``q . F``, from the query as given) instead.
        scale_table: fp32 ``(256,)``, ``hf_cocktail.storage.params8.scale_table``; needed by 8-bit scales and zeros.
        sinks: attention sinks (gpt-oss's ``module.sinks``), ``(H_q,)`` float: query head ``h``'s softmax
            denominator gains ``exp(sinks[h])``, a logit with no value; or None.
        softcap: logit soft-capping (Gemma 2), a positive float: each score ``s = scaling * q.k`` becomes
            ``softcap * tanh(s / softcap)`` before the causal mask; or None.

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
    _check_tensor("full_keys", full_keys, INT8 if full_scales is not None else FLOAT_DTYPES, (B, None, None, D))
    H_kv = full_keys.shape[1]
    if H_kv == 0 or H_q % H_kv:
        _fail("full_keys' H_kv (dim 1)", f"a divisor of the query heads H_q={H_q}", H_kv)
    _check_tensor("full_values", full_values, (full_keys.dtype,), full_keys.shape)
    for name, t in (("full_keys", full_keys), ("full_values", full_values)):
        if t.stride(-1) != 1:
            _fail(f"{name}' last dim", "contiguous (stride 1)", f"stride {t.stride(-1)}")
    if full_values.stride() != full_keys.stride():
        _fail("full_values' strides", f"those of full_keys {full_keys.stride()}", full_values.stride())
    _check_tensor("full_start", full_start, INT32, (B,))
    full_scale_args = _full_scales(full_scales, full_keys.shape[:3])
    prepared = prepare(B, H_kv, D, segments, rotation=rotation, scale_table=scale_table)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        _fail("scaling", "a finite float", repr(scaling))
    if tokens_per_item is not None and not (type(tokens_per_item) is int and tokens_per_item >= 1):
        _fail("tokens_per_item", "an int >= 1", repr(tokens_per_item))
    if isa not in _ISA_CODES:
        _fail("isa", "'auto', 'avx2' or 'baseline'", repr(isa))
    table = scale_table if prepared.needs_table else None
    extras = _extras(sinks, softcap, H_q)
    args = (full_scale_args, table, tokens_per_item, isa, extras)
    return _launch(query, full_keys, full_values, full_start, prepared, scaling, *args)


def kernel_target() -> str:
    """The build :func:`split_precision_attention` runs with ``isa="auto"`` on this CPU: ``"avx512vnni"`` (P.V of
    packed values in 16-bit integers), ``"avx2+fma+f16c"`` or ``"baseline"``."""
    return extension().kernel_target()


@dataclass(frozen=True)
class PreparedArguments:
    """The kernel arguments of :func:`split_precision_attention` that stay the same from one decode step to the next
    of one layer (the packed segments, the rotation, the scale table), checked and laid out once by :func:`prepare`
    for :func:`split_precision_attention_prepared`. ``B`` sequences, ``H_kv`` heads, head dim ``D``."""

    B: int
    H_kv: int
    D: int
    seg_tensors: list  # per segment: k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, offsets, blocks, channels
    seg_ints: list  # per segment: key bits, value bits, chunk_size, group_size, outlier key channels
    tokens: int  # the segments' tokens, all sequences
    rotation: list  # [query, output, full-part key matrices] (H_kv, D, D) fp32, or empty tensors
    needs_table: bool  # 8-bit scales and zeros: every call passes the scale table (not kept here: it is shared)


def prepare(B: int, H_kv: int, D: int, segments, *, rotation=None, scale_table=None) -> PreparedArguments:
    """Check ``segments``, ``rotation`` and ``scale_table`` (as :func:`split_precision_attention` documents them) for
    ``B`` sequences of ``H_kv`` heads of dim ``D``, once; the result serves every later decode step of the same store.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device (the messages of
            :func:`split_precision_attention`).
    """
    rotation_args = _rotation(rotation, H_kv, D)
    if not isinstance(segments, (list, tuple)) or len(segments) > 2:
        _fail(
            "segments",
            "a list of at most 2 segment tuples",
            f"{len(segments)} segments" if isinstance(segments, (list, tuple)) else type(segments).__name__,
        )
    seg_tensors, seg_ints, tokens = [], [], 0
    for i, seg in enumerate(segments):
        tensors, ints = _segment(seg, i, B, H_kv, D)
        seg_tensors += tensors
        seg_ints += ints
        tokens += tensors[0].shape[1]
    needs_table = any(t.numel() for t in seg_tensors[8::11])
    if needs_table:
        _table(scale_table)
    return PreparedArguments(B, H_kv, D, seg_tensors, seg_ints, tokens, rotation_args, needs_table)


def _segment(seg, i: int, B: int, H_kv: int, D: int) -> tuple[list[torch.Tensor], list[int]]:
    """Segment ``i``'s 11 tensors (contiguous) and 5 ints for the kernel, checked."""
    if not isinstance(seg, (list, tuple)) or len(seg) - len(_SEGMENT_FIELDS) not in (0, 1, 2):
        _fail(
            f"segments[{i}]",
            f"a tuple {_SEGMENT_FIELDS} (+ k_block, v_block)",
            f"{len(seg)} items" if isinstance(seg, (list, tuple)) else type(seg).__name__,
        )
    bits, C, G, kc, ks, kz, vc, vs, vz, tok, chk = seg[: len(_SEGMENT_FIELDS)]
    bits, vbits = code_widths(bits, f"segments[{i}].bits")
    if not (type(C) is int and C >= 1):
        _fail(f"segments[{i}].chunk_size", "an int >= 1", repr(C))
    if not (type(G) is int and G >= 1 and G & (G - 1) == 0 and D % G == 0):
        _fail(f"segments[{i}].group_size", f"a power of two dividing D={D}", repr(G))
    N, M = (t.shape[1] if isinstance(t, torch.Tensor) and t.dim() == 3 else None for t in (kc, ks))
    params8 = isinstance(ks, torch.Tensor) and ks.dtype == torch.uint8
    n_out, channels = outlier_item(seg, i, H_kv, D) if len(seg) == len(_SEGMENT_FIELDS) + 1 else (0, _EMPTY)
    _check_tensor((i, "k_codes"), kc, UINT8, (H_kv, N, (D - n_out) * bits // 8 + n_out))
    _check_tensor((i, "k_scale"), ks, UINT8 if params8 else FLOAT_DTYPES, (H_kv, M, D))
    _check_tensor((i, "k_zero"), kz, (ks.dtype,), ks.shape)
    _check_tensor((i, "v_codes"), vc, UINT8, (H_kv, N, D * vbits // 8))
    _check_tensor((i, "v_scale"), vs, (ks.dtype,), (H_kv, N, D // G))
    _check_tensor((i, "v_zero"), vz, (ks.dtype,), vs.shape)
    _check_tensor((i, "tok_off"), tok, INT32, (B + 1,))
    _check_tensor((i, "chunk_off"), chk, INT32, (B + 1,))
    tensors = [t.contiguous() for t in (kc, ks, kz, vc, vs, vz, tok, chk)]
    tensors += _blocks(seg, i, params8, H_kv, M) if params8 else [_EMPTY, _EMPTY]
    return [*tensors, channels], [bits, vbits, C, G, n_out]


def split_precision_attention_prepared(
    query: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    full_start: torch.Tensor,
    prepared: PreparedArguments,
    scaling: float,
    *,
    full_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`split_precision_attention` with the arguments that do not change between decode steps
    (:func:`prepare`) checked once: for the decode dispatch, which calls it once per layer and step. The query is
    checked here (type, dtype, shape against ``prepared``), and ``scale_table`` where the segments need it; the full
    part's tensors are trusted to be a store's (shapes ``(B, H_kv, R, D)``, int8 codes exactly when ``full_scales``
    is given; the C++ kernel checks their strides and ``full_start``'s range). Same result as
    :func:`split_precision_attention` on the same arguments."""
    P = prepared
    if not (
        isinstance(query, torch.Tensor)
        and query.is_cpu
        and query.dtype in FLOAT_DTYPES
        and query.dim() == 4
        and query.shape[0] == P.B
        and query.shape[3] == P.D
        and query.shape[2] >= 1
        and query.shape[1] % P.H_kv == 0
        and query.shape[1] > 0
    ):
        _check_tensor("query", query, FLOAT_DTYPES, (P.B, None, None, P.D))
        if query.shape[2] < 1:
            _fail("query's L_q", ">= 1", query.shape[2])
        _fail("query's H_q (dim 1)", f"a positive multiple of the key/value heads H_kv={P.H_kv}", query.shape[1])
    if P.needs_table and not (
        isinstance(scale_table, torch.Tensor) and scale_table.dtype == torch.float32 and scale_table.shape == (256,)
    ):
        _table(scale_table)
    full_scale_args = [_EMPTY, _EMPTY] if full_scales is None else list(full_scales)
    extras = _NO_EXTRAS if sinks is None and softcap is None else _extras(sinks, softcap, query.shape[1])
    args = (full_scale_args, scale_table, None, "auto", extras)
    return _launch(query, full_keys, full_values, full_start, P, scaling, *args)


def _extras(sinks, softcap, H_q: int) -> tuple[torch.Tensor, float]:
    """``(sinks as contiguous fp32 (H_q,) or empty, softcap or 0.0)`` for the kernel, checked."""
    if sinks is None:
        sinks = _EMPTY
    else:
        _check_tensor("sinks", sinks, FLOAT_DTYPES, (H_q,))
        sinks = sinks.detach().float().contiguous()
    if softcap is None:
        return sinks, 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        _fail("softcap", "a positive finite float or None", repr(softcap))
    return sinks, float(softcap)


def _launch(
    query,
    full_keys,
    full_values,
    full_start,
    P: PreparedArguments,
    scaling,
    full_scale_args,
    table,
    per_item,
    isa,
    extras,
) -> torch.Tensor:
    """The C++ kernel on checked arguments (``table``: the scale table where ``P.needs_table``)."""
    if per_item is None:
        per_item = _default_tokens_per_item(P.B * P.H_kv, full_keys.shape[2] + P.tokens // max(P.B, 1))
    if query.stride(-1) != 1:
        query = query.contiguous()
    return extension().split_attention(
        query,
        full_keys,
        full_values,
        full_start if full_start.is_contiguous() else full_start.contiguous(),
        P.seg_tensors,
        P.seg_ints,
        float(scaling),
        per_item,
        _ISA_CODES[isa],
        *full_scale_args,
        *P.rotation,
        table.contiguous() if P.needs_table else _EMPTY,
        *extras,
    )


def code_widths(bits, name: str) -> tuple[int, int]:
    """A segment's ``bits`` item -> ``(key_bits, value_bits)``: an int is both, a pair has ``value_bits <=
    key_bits``."""
    pair = bits if isinstance(bits, (list, tuple)) and len(bits) == 2 else (bits, bits)
    if not all(type(b) is int and b in SUPPORTED_BITS for b in pair) or pair[1] > pair[0]:
        _fail(name, f"one of {SUPPORTED_BITS} or a pair (key_bits, value_bits <= key_bits) of them", repr(bits))
    return pair[0], pair[1]


_EMPTY = torch.empty(0)
_NO_EXTRAS = (_EMPTY, 0.0)  # no sinks, no soft-capping


def _blocks(seg, i: int, params8: bool, H_kv: int, M: int) -> list[torch.Tensor]:
    """The block numbers ``(H_kv, M, 3)`` of a segment with 8-bit scales and zeros (items 12 and 13), checked."""
    if len(seg) != len(_SEGMENT_FIELDS) + 2:
        _fail(f"segments[{i}]", "a tuple with k_block and v_block (13 items) for uint8 scale and zero codes", len(seg))
    kb, vb = seg[-2:]
    _check_tensor((i, "k_block"), kb, FLOAT_DTYPES, (H_kv, M, 3))
    _check_tensor((i, "v_block"), vb, (kb.dtype,), (H_kv, M, 3))
    return [kb.contiguous(), vb.contiguous()]


def _table(scale_table) -> torch.Tensor:
    if scale_table is None:
        _fail(
            "scale_table", "a float32 (256,) tensor (hf_cocktail.storage.params8.scale_table) with 8-bit scales", None
        )
    _check_tensor("scale_table", scale_table, (torch.float32,), (256,))
    return scale_table.contiguous()


def _full_scales(full_scales, shape: tuple) -> list[torch.Tensor]:
    """``[key scales, value scales]`` of an int8 full part ``(B, H_kv, R, 1)``, checked, or two empty tensors."""
    if full_scales is None:
        return [_EMPTY, _EMPTY]
    if not isinstance(full_scales, (list, tuple)) or len(full_scales) != 2:
        _fail("full_scales", "a pair (key scales, value scales)", type(full_scales).__name__)
    ks, vs = full_scales
    _check_tensor("full_scales[0]", ks, FLOAT_DTYPES, (*shape, 1))
    _check_tensor("full_scales[1]", vs, (ks.dtype,), ks.shape)
    if ks.stride() != vs.stride():
        _fail("full_scales[1]'s strides", f"those of full_scales[0] {ks.stride()}", vs.stride())
    return [ks, vs]


def _rotation(rotation, H_kv: int, D: int) -> list[torch.Tensor]:
    """``[query matrices, output matrices, full-part key matrices]`` ``(H_kv, D, D)`` fp32, checked (an empty tensor
    where None or not given)."""
    if rotation is None:
        return [_EMPTY, _EMPTY, _EMPTY]
    if not isinstance(rotation, (list, tuple)) or len(rotation) not in (2, 3):
        _fail(
            "rotation",
            "a pair (query matrices or None, output matrices or None) or a triple with full-part key matrices",
            type(rotation).__name__ if not isinstance(rotation, (list, tuple)) else f"{len(rotation)} items",
        )
    out = []
    for name, m in zip(("rotation[0]", "rotation[1]", "rotation[2]"), (*rotation, None)[:3]):
        if m is not None:
            _check_tensor(name, m, (torch.float32,), (H_kv, D, D))
        out.append(_EMPTY if m is None else m.contiguous())
    return out


def _default_tokens_per_item(pairs: int, tokens_per_pair: int) -> int:
    """One thread: one work item per (sequence, kv head, source) (nothing to balance; each further item costs its
    set-up and a partial to merge). Else about 4 work items per thread (load balance), each of 256 to 2048 tokens
    (partials stay cheap)."""
    if torch.get_num_threads() == 1:
        return _ONE_ITEM
    want = -(-pairs * tokens_per_pair // (4 * torch.get_num_threads()))
    return min(2048, max(256, -(-want // 64) * 64))
