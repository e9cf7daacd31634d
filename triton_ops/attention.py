"""Split-precision decode attention over a layer's full-precision part and packed segments (flash-decoding style):
the launcher. The kernels are in :mod:`triton_ops.attention_kernels`, the checks of their arguments in
:mod:`triton_ops.attention_args`.

Shapes: B batch, H_q query heads, H_kv key/value heads (``n_rep = H_q // H_kv``), L_q query tokens, D head dim,
R length of the full-precision part, C chunk size, G value group size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton

from .attention_args import (
    code_widths,
    full_head_args,
    full_scales_args,
    scale_table_arg,
    segment_args,
    sinks_arg,
    softcap_arg,
)
from .attention_kernels import merge_kernel, split_attn_kernel
from .checks import check_device
from .launch import Launch

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_LOG2E = 1.4426950408889634

__all__ = ["SUPPORTED_HEAD_DIMS", "code_widths", "plan_split_attention", "split_precision_attention"]


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(D: int, rows: int) -> tuple[int, int, int, int, bool]:
    """``(BQ, BT, num_warps, num_stages, dot)`` of :func:`split_attn_kernel` for head dim ``D`` and ``rows = n_rep *
    L_q`` query rows per kv head: BQ query rows per program, BT tokens per step, ``dot``: the products as ``tl.dot``.

    Chosen from the ahead-of-time compile report (``python -m triton_ops.aot``; no spills, <= 128 registers per
    thread in the model-shaped cases on sm_80 / sm_90): more than 8 rows go through ``tl.dot`` (fp32, ``ieee``) in
    blocks of 16 rows and 16 tokens with D / 16 warps (4 warps spilled 80 B at head dim 128 with the 8-bit formats
    on sm_80, 8 needed 183 registers at 256); fewer rows through a broadcast product of BQ x BT x D elements held
    at 8 per thread by 8 warps, 16 where BQ x D >= 512 (8 warps spilled 4-16 B there at 2-4 tokens a step:
    Qwen2.5-7B with the 8-bit formats on sm_80, an INT3-only segment at head dim 128 on sm_90). At 16 elements per
    thread ptxas spilled 4-40 B in some 8-bit-format and head-dim-256 cases, and capping registers
    (``maxnreg=128``) made it spill elsewhere. One stage: Triton does not pipeline the loads that feed the
    broadcast products, and two stages on the ``tl.dot`` path spilled (Qwen2.5-7B shape, sm_90: 255 registers,
    640 B).
    """
    if rows > 8:
        return 16, 16, D // 16, 1, True
    BQ = triton.next_power_of_2(rows)
    warps = 16 if BQ * D >= 512 else 8
    return BQ, max(2, min(64, 8 * 32 * warps // (BQ * D))), warps, 1, False


def split_precision_attention(
    query: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    full_start: torch.Tensor,
    segments: Sequence[tuple],
    scaling: float,
    *,
    max_tokens: Sequence[int] | None = None,
    min_full_start: int | None = None,
    tokens_per_split: int | None = None,
    full_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    full_query: torch.Tensor | None = None,
    full_head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton version of ``hf_cocktail.decode.split_attention.split_precision_attention_torch`` (same semantics).

    Arguments as :func:`plan_split_attention` (which documents them). Returns ``(B, H_q, L_q, D)`` in
    ``query.dtype``.
    """
    check_device(query)
    attn, merge, out = plan_split_attention(
        query,
        full_keys,
        full_values,
        full_start,
        segments,
        scaling,
        max_tokens=max_tokens,
        min_full_start=min_full_start,
        tokens_per_split=tokens_per_split,
        full_scales=full_scales,
        scale_table=scale_table,
        sinks=sinks,
        softcap=softcap,
        full_query=full_query,
        full_head=full_head,
    )
    attn.run(query.device)
    merge.run(query.device)
    return out


def plan_split_attention(
    query: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    full_start: torch.Tensor,
    segments: Sequence[tuple],
    scaling: float,
    *,
    max_tokens: Sequence[int] | None = None,
    min_full_start: int | None = None,
    tokens_per_split: int | None = None,
    full_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    num_sms: int | None = None,
    full_query: torch.Tensor | None = None,
    full_head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[Launch, Launch, torch.Tensor]:
    """The two launches of split-precision attention (:func:`split_attn_kernel` then :func:`merge_kernel`) and the
    output tensor they fill; :func:`split_precision_attention` runs them, :mod:`triton_ops.aot` compiles them.

    Args:
        query: ``(B, H_q, L_q, D)``, D of 64, 128 or 256 (:data:`SUPPORTED_HEAD_DIMS`).
        full_keys, full_values: ``(B, H_kv, R, D)``; sequence ``b`` owns ``[full_start[b], R)``. With
            ``full_scales`` (an 8-bit full part): int8 codes, read as ``code * scale`` of their token.
        full_start: int32 ``(B,)`` on the query's device.
        segments: at most two packed segments, each ``(bits, chunk_size, group_size, k_codes, k_scale, k_zero,
            v_codes, v_scale, v_zero, tok_off, chunk_off)`` with int32 offsets ``(B+1,)``; ``bits`` is one width for
            keys and values or a pair ``(key_bits, value_bits)`` with ``value_bits <= key_bits``. 8-bit scales and
            zeros (``hf_cocktail.storage.params8``): ``k_scale`` ... ``v_zero`` uint8 codes, then ``k_block`` and
            ``v_block`` ``(H_kv, M, 3)`` as items 12 and 13; decoded in registers with ``scale_table``. Outlier key
            channels (``hf_cocktail.storage.key_outliers``, 16-bit scales only): a 12th item ``(n_out, channels)``,
            ``channels`` int32 ``(H_kv, D)`` on the query's device (the stored channel order); ``k_codes`` then
            ``(H_kv, N, (D - n_out) * key_bits // 8 + n_out)``, ``k_scale`` and ``k_zero`` in the stored order.
        scaling: softmax scale (usually ``D ** -0.5``).
        max_tokens: per segment, the most tokens one sequence owns; min_full_start: ``min(full_start)``. Computed
            from the tensors when not given (a device sync).
        tokens_per_split: tokens of one sequence per program (default: enough splits to fill the GPU).
        full_scales: the int8 full part's key and value scales ``(B, H_kv, R, 1)`` (strides of each other).
        scale_table: fp32 ``(256,)`` (``hf_cocktail.storage.params8.scale_table``), needed by 8-bit scales and zeros.
        sinks: attention sinks, float ``(H_q,)``: one extra logit per query head in the softmax's denominator that
            contributes no value (gpt-oss's ``sinks``); counted once, in the merge of the splits.
        softcap: logit soft-capping: scores ``s = scaling * q.k`` become ``softcap * tanh(s / softcap)`` before the
            causal mask (Gemma 2's ``attn_logit_softcapping``).
        num_sms: streaming multiprocessors to fill when choosing ``tokens_per_split`` (default: the query's GPU's;
            on CPU, without it, one split per source, as the interpreter wants).
        full_query: the query the full part's keys are scored with where they are stored in a basis of their own
            (``hf_cocktail.storage.full_part.Int8FullPart.key_query``), ``query``'s shape; None: ``query``.
        full_head: the full part's exact head (``hf_cocktail.storage.exact_head``), ``(keys, values)`` each ``(B,
            H_kv, S, D)``: sequence ``b``'s tokens ``[full_start[b], full_start[b] + S)`` are read from them
            (keys in the layer's basis, scored with ``query``); or None.
    """
    if query.dim() != 4:
        raise ValueError(f"query must have shape (B, H_q, L_q, D), got {tuple(query.shape)}")
    B, H_q, Lq, D = query.shape
    H_kv, R = full_keys.shape[1], full_keys.shape[2]
    if H_q % H_kv:
        raise ValueError(f"query heads H_q={H_q} must be a multiple of key/value heads H_kv={H_kv}")
    if full_keys.shape[0] != B or full_keys.shape[3] != D:
        raise ValueError(f"query {tuple(query.shape)} does not match the full part {tuple(full_keys.shape)}")
    if len(segments) > 2:
        raise ValueError(f"the Triton kernel handles at most 2 packed segments, got {len(segments)}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if full_query is not None and full_query.shape != query.shape:
        raise ValueError(f"full_query must have the query's shape {tuple(query.shape)}, got {tuple(full_query.shape)}")
    if full_query is not None:  # the kernel reads both with the query's strides
        query, full_query = query.contiguous(), full_query.contiguous()
    elif query.stride(-1) != 1:
        query = query.contiguous()
    fk, fv = full_keys, full_values
    if fk.stride(-1) != 1 or fv.stride() != fk.stride():
        fk, fv = fk.contiguous(), fv.contiguous()
    n_rep = H_q // H_kv
    BQ, BT, warps, stages, dot = tiles(D, n_rep * Lq)
    n_qb = triton.cdiv(n_rep * Lq, BQ)
    segs = list(segments) + [None] * (2 - len(segments))
    maxes: list[int | None] = list(max_tokens) if max_tokens is not None else [None] * len(segments)
    maxes += [None] * (2 - len(maxes))
    (a_args, bits_a, g_a, p8_a, len_a, out_a), (b_args, bits_b, g_b, p8_b, len_b, out_b) = (
        segment_args(s, i, m, fk) for i, (s, m) in enumerate(zip(segs, maxes))
    )
    fks, fvs = full_scales_args(full_scales, fk)
    fhk, fhv, S_head = full_head_args(full_head, fk)
    table = scale_table_arg(scale_table, query.device) if p8_a or p8_b else fk
    sink = sinks_arg(sinks, H_q, query.device) if sinks is not None else fk
    cap = softcap_arg(softcap) if softcap is not None else 1.0
    len_full = R - (int(full_start.min()) if min_full_start is None else min_full_start)
    P = B * H_kv * n_qb
    TPS = _tokens_per_split(tokens_per_split, len_full + len_a + len_b, P, BT, query, num_sms)
    S_full, S_a, S_b = (triton.cdiv(n, TPS) for n in (len_full, len_a, len_b))
    S_total = S_full + S_a + S_b
    dev = query.device
    part_o = torch.empty((P, S_total, BQ, D), dtype=torch.float32, device=dev)
    part_m = torch.empty((P, S_total, BQ), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    out = torch.empty((B, H_q, Lq, D), dtype=query.dtype, device=dev)
    q_strides = (query.stride(0), query.stride(1), query.stride(2))
    full_args = (fk, fv, *fk.stride()[:3], fks, fvs, *fks.stride()[:3], full_start, R, fhk, fhv, S_head)
    softmax = (float(scaling) * (_LOG2E if softcap is None else 1.0), cap)
    grid_args = (H_kv, Lq, n_rep, n_qb, S_full, S_a, S_total, TPS)
    attn = Launch(
        split_attn_kernel,
        (P, S_total),
        (
            query,
            full_query if full_query is not None else query,
            *q_strides,
            *full_args,
            *a_args,
            *b_args,
            part_o,
            part_m,
            part_l,
            *grid_args,
            *softmax,
            table,
        ),
        dict(
            D=D,
            BQ=BQ,
            BT=BT,
            SEGS=len(segments),
            BITS_A=bits_a[0],
            VBITS_A=bits_a[1],
            G_A=g_a,
            BITS_B=bits_b[0],
            VBITS_B=bits_b[1],
            G_B=g_b,
            P8_A=p8_a,
            P8_B=p8_b,
            F8=full_scales is not None,
            FQ=full_query is not None,
            HEAD=full_head is not None,
            SOFTCAP=softcap is not None,
            DOT=dot,
            N_OUT_A=out_a,
            N_OUT_B=out_b,
        ),
        warps,
        stages,
    )
    merge = Launch(
        merge_kernel,
        (P,),
        (part_o, part_m, part_l, out, *out.stride()[:3], sink, H_kv, Lq, n_rep, n_qb, S_total),
        dict(D=D, BQ=BQ, BS=min(triton.next_power_of_2(S_total), max(1, 8192 // (BQ * D))), SINKS=sinks is not None),
    )
    return attn, merge, out


def _tokens_per_split(tps: int | None, total: int, programs: int, BT: int, query: torch.Tensor, num_sms) -> int:
    """Tokens of one sequence per split program: given, or about 4 programs per SM with at least 256 tokens each
    on a GPU, or one split per source without a GPU (the interpreter); a multiple of BT."""
    if tps is None:
        if num_sms is None and query.is_cuda:
            idx = query.device.index if query.device.index is not None else torch.cuda.current_device()
            num_sms = _num_sms(idx)
        if num_sms is not None:
            want = max(1, triton.cdiv(4 * num_sms, programs))
            tps = max(256, triton.cdiv(total, want))
        else:
            tps = max(total, 1)
        tps = triton.cdiv(tps, BT) * BT
    if int(tps) < 1:
        raise ValueError(f"tokens_per_split must be >= 1, got {tps}")
    return int(tps)
