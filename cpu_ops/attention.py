"""Launcher of the fused CPU split-precision decode attention: checks the inputs, then calls the C++ kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._build import extension
from .attention_args import (
    EMPTY,
    FLOAT_DTYPES,
    INT8,
    INT32,
    NO_EXTRAS,
    SEGMENT_FIELDS,
    UINT8,
    blocks_args,
    check_tensor,
    extras_args,
    fail,
    full_head_args,
    full_scales_args,
    rotation_args,
    table_arg,
)
from .key_outliers import outlier_item

_ISA_CODES = {"auto": 0, "baseline": 1, "avx2": 2}  # split_attention.cpp's Isa
_ONE_ITEM = 1 << 62  # tokens per work item: one item per (sequence, kv head, source)
SUPPORTED_BITS = (2, 3, 4)
READS_KEY_OUTLIERS = True  # segments with outlier key channels (a last item (n_out, channels)): read


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
    full_head: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        full_head: the full part's exact head (``hf_cocktail.storage.exact_head``), ``(keys, values)`` each ``(B,
            H_kv, S, D)`` of one float dtype: sequence ``b``'s full-part tokens ``[full_start[b], full_start[b] + S)``
            are read from them instead (keys in the layer's basis: scored with ``q . R``, never with
            ``full_key_matrices``); or None.

    Returns:
        ``(B, H_q, L_q, D)`` in ``query.dtype``. A query row that sees no token at all gets zeros.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device, or inconsistent offsets.
        ImportError: the C++ extension could not be built here (the message says why and how to fix it).
    """
    check_tensor("query", query, FLOAT_DTYPES, (None,) * 4)
    B, H_q, L_q, D = query.shape
    if D % 8 or D == 0:
        fail("query's head dim D", "a positive multiple of 8", D)
    if L_q < 1:
        fail("query's L_q", ">= 1", L_q)
    check_tensor("full_keys", full_keys, INT8 if full_scales is not None else FLOAT_DTYPES, (B, None, None, D))
    H_kv = full_keys.shape[1]
    if H_kv == 0 or H_q % H_kv:
        fail("full_keys' H_kv (dim 1)", f"a divisor of the query heads H_q={H_q}", H_kv)
    check_tensor("full_values", full_values, (full_keys.dtype,), full_keys.shape)
    for name, t in (("full_keys", full_keys), ("full_values", full_values)):
        if t.stride(-1) != 1:
            fail(f"{name}' last dim", "contiguous (stride 1)", f"stride {t.stride(-1)}")
    if full_values.stride() != full_keys.stride():
        fail("full_values' strides", f"those of full_keys {full_keys.stride()}", full_values.stride())
    check_tensor("full_start", full_start, INT32, (B,))
    full_scale_args = full_scales_args(full_scales, full_keys.shape[:3])
    prepared = prepare(B, H_kv, D, segments, rotation=rotation, scale_table=scale_table)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        fail("scaling", "a finite float", repr(scaling))
    if tokens_per_item is not None and not (type(tokens_per_item) is int and tokens_per_item >= 1):
        fail("tokens_per_item", "an int >= 1", repr(tokens_per_item))
    if isa not in _ISA_CODES:
        fail("isa", "'auto', 'avx2' or 'baseline'", repr(isa))
    table = scale_table if prepared.needs_table else None
    extras = extras_args(sinks, softcap, H_q)
    args = (full_scale_args, full_head_args(full_head, (B, H_kv, None, D)), table, tokens_per_item, isa, extras)
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
    rotation_list = rotation_args(rotation, H_kv, D)
    if not isinstance(segments, (list, tuple)) or len(segments) > 2:
        fail(
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
        table_arg(scale_table)
    return PreparedArguments(B, H_kv, D, seg_tensors, seg_ints, tokens, rotation_list, needs_table)


def _segment(seg, i: int, B: int, H_kv: int, D: int) -> tuple[list[torch.Tensor], list[int]]:
    """Segment ``i``'s 11 tensors (contiguous) and 5 ints for the kernel, checked."""
    if not isinstance(seg, (list, tuple)) or len(seg) - len(SEGMENT_FIELDS) not in (0, 1, 2):
        fail(
            f"segments[{i}]",
            f"a tuple {SEGMENT_FIELDS} (+ k_block, v_block)",
            f"{len(seg)} items" if isinstance(seg, (list, tuple)) else type(seg).__name__,
        )
    bits, C, G, kc, ks, kz, vc, vs, vz, tok, chk = seg[: len(SEGMENT_FIELDS)]
    bits, vbits = code_widths(bits, f"segments[{i}].bits")
    if not (type(C) is int and C >= 1):
        fail(f"segments[{i}].chunk_size", "an int >= 1", repr(C))
    if not (type(G) is int and G >= 1 and G & (G - 1) == 0 and D % G == 0):
        fail(f"segments[{i}].group_size", f"a power of two dividing D={D}", repr(G))
    N, M = (t.shape[1] if isinstance(t, torch.Tensor) and t.dim() == 3 else None for t in (kc, ks))
    params8 = isinstance(ks, torch.Tensor) and ks.dtype == torch.uint8
    n_out, channels = outlier_item(seg, i, H_kv, D) if len(seg) == len(SEGMENT_FIELDS) + 1 else (0, EMPTY)
    check_tensor((i, "k_codes"), kc, UINT8, (H_kv, N, (D - n_out) * bits // 8 + n_out))
    check_tensor((i, "k_scale"), ks, UINT8 if params8 else FLOAT_DTYPES, (H_kv, M, D))
    check_tensor((i, "k_zero"), kz, (ks.dtype,), ks.shape)
    check_tensor((i, "v_codes"), vc, UINT8, (H_kv, N, D * vbits // 8))
    check_tensor((i, "v_scale"), vs, (ks.dtype,), (H_kv, N, D // G))
    check_tensor((i, "v_zero"), vz, (ks.dtype,), vs.shape)
    check_tensor((i, "tok_off"), tok, INT32, (B + 1,))
    check_tensor((i, "chunk_off"), chk, INT32, (B + 1,))
    tensors = [t.contiguous() for t in (kc, ks, kz, vc, vs, vz, tok, chk)]
    tensors += blocks_args(seg, i, params8, H_kv, M) if params8 else [EMPTY, EMPTY]
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
    full_head: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        check_tensor("query", query, FLOAT_DTYPES, (P.B, None, None, P.D))
        if query.shape[2] < 1:
            fail("query's L_q", ">= 1", query.shape[2])
        fail("query's H_q (dim 1)", f"a positive multiple of the key/value heads H_kv={P.H_kv}", query.shape[1])
    if P.needs_table and not (
        isinstance(scale_table, torch.Tensor) and scale_table.dtype == torch.float32 and scale_table.shape == (256,)
    ):
        table_arg(scale_table)
    full_scale_args = [EMPTY, EMPTY] if full_scales is None else list(full_scales)
    extras = NO_EXTRAS if sinks is None and softcap is None else extras_args(sinks, softcap, query.shape[1])
    head = [EMPTY, EMPTY] if full_head is None else [t.contiguous() for t in full_head]
    args = (full_scale_args, head, scale_table, None, "auto", extras)
    return _launch(query, full_keys, full_values, full_start, P, scaling, *args)


def _launch(
    query,
    full_keys,
    full_values,
    full_start,
    P: PreparedArguments,
    scaling,
    full_scale_args,
    head_args,
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
        *head_args,
        table.contiguous() if P.needs_table else EMPTY,
        *extras,
    )


def code_widths(bits, name: str) -> tuple[int, int]:
    """A segment's ``bits`` item -> ``(key_bits, value_bits)``: an int is both, a pair has ``value_bits <=
    key_bits``."""
    pair = bits if isinstance(bits, (list, tuple)) and len(bits) == 2 else (bits, bits)
    if not all(type(b) is int and b in SUPPORTED_BITS for b in pair) or pair[1] > pair[0]:
        fail(name, f"one of {SUPPORTED_BITS} or a pair (key_bits, value_bits <= key_bits) of them", repr(bits))
    return pair[0], pair[1]


def _default_tokens_per_item(pairs: int, tokens_per_pair: int) -> int:
    """One thread: one work item per (sequence, kv head, source) (nothing to balance; each further item costs its
    set-up and a partial to merge). Else about 4 work items per thread (load balance), each of 256 to 2048 tokens
    (partials stay cheap)."""
    if torch.get_num_threads() == 1:
        return _ONE_ITEM
    want = -(-pairs * tokens_per_pair // (4 * torch.get_num_threads()))
    return min(2048, max(256, -(-want // 64) * 64))
