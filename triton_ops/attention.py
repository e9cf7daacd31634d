"""Split-precision decode attention over a layer's full-precision part and packed segments (flash-decoding style).

Shapes: B batch, H_q query heads, H_kv key/value heads (``n_rep = H_q // H_kv``), L_q query tokens, D head dim,
R length of the full-precision part, C chunk size, G value group size.

Kernel 1 runs one program per (sequence, kv head, block of query rows, token split). The splits cover the
full-precision part, then the first packed segment (INT4), then the second (INT2 or INT3; a segment's bit width is
a compile-time constant), each cut into pieces of
``tokens_per_split`` tokens of that sequence; ragged sequences just leave some splits empty. A program loads the
``n_rep * L_q`` query rows of its kv head together (GQA without ``repeat_kv``), unpacks and dequantizes codes in
registers (code ``c`` as ``c * scale + zero``, or ``levels[c] * scale + zero`` for a segment with a codebook's table
of levels) and keeps an fp32 online softmax, and writes its partial (max, sum, unnormalised output). Kernel 2 merges
the partials of a row with a log-sum-exp reduction and writes the output in ``query.dtype``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .checks import check_bits, check_device

SUPPORTED_HEAD_DIMS = (64, 128)
_TILE = 8192  # elements of the (query rows x tokens x D) product held in registers (64 per thread, 4 warps)
_LOG2E = 1.4426950408889634


@triton.jit
def _online_update(acc, m_i, l_i, q, k, v, valid):
    """One block of the online softmax: ``q (BQ, D)`` pre-scaled by ``scaling * log2(e)``, ``k, v (BT, D)`` fp32,
    ``valid (BQ, BT)``. ``m_i``, ``l_i`` are the running max and sum in base 2, ``acc (BQ, D)`` the output sum."""
    s = tl.where(valid, tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: keep exp2 away from inf - inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc, m_new, l_i


@triton.jit
def _load_codes(row_ptr, m2, d, D: tl.constexpr, BITS: tl.constexpr):
    """int32 codes ``(BT, D)`` of the tokens whose packed bytes start at ``row_ptr (BT, 1)`` (rows where ``m2``):
    channel d in byte d // per at bit (d % per) * BITS; INT3 as a 2-bit plane (INT2's layout, ``D // 4`` bytes)
    then a 1-bit plane (channel d in byte D // 4 + d // 8 at bit d % 8)."""
    if BITS == 3:
        lo = tl.load(row_ptr + (d // 4)[None, :], mask=m2, other=0).to(tl.int32)
        hi = tl.load(row_ptr + (D // 4 + d // 8)[None, :], mask=m2, other=0).to(tl.int32)
        q = ((lo >> ((d % 4) * 2)[None, :]) & 3) | (((hi >> (d % 8)[None, :]) & 1) << 2)
    else:
        PER: tl.constexpr = 8 // BITS
        packed = tl.load(row_ptr + (d // PER)[None, :], mask=m2, other=0).to(tl.int32)
        q = (packed >> ((d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    return q


@triton.jit
def _code_values(q, lv_ptr, LEVELS: tl.constexpr):
    """int32 codes ``q (BT, D)`` -> their levels in code units, fp32: ``lv_ptr[q]`` with ``LEVELS``, else ``q``."""
    if LEVELS:
        y = tl.load(lv_ptr + q)
    else:
        y = q.to(tl.float32)
    return y


@triton.jit
def _packed_split(
    acc,
    m_i,
    l_i,
    q,
    rmask,
    b,
    h,
    j,
    TPS,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    tok_ptr,
    chk_ptr,
    lv_ptr,
    N,
    M,
    C,
    D: tl.constexpr,
    BT: tl.constexpr,
    BITS: tl.constexpr,
    VBITS: tl.constexpr,
    G: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """Split ``j`` of sequence ``b`` in a packed segment: its tokens ``[tok_off[b] + j*TPS, ...)``. Key scales are
    per (chunk, channel), chunk = ``chunk_off[b] + (token - tok_off[b]) // C``; value scales per (token, group).
    Keys have ``BITS``-bit codes, values ``VBITS``-bit ones. With ``LEVELS`` (one width), code ``c`` stands for
    ``lv_ptr[c]`` (fp32, ``2**BITS`` levels)."""
    DP: tl.constexpr = D * BITS // 8
    VDP: tl.constexpr = D * VBITS // 8
    NG: tl.constexpr = D // G
    d = tl.arange(0, D)
    grp = d // G
    t0 = tl.load(tok_ptr + b)
    c0 = tl.load(chk_ptr + b)
    lo = t0 + j * TPS
    hi = tl.minimum(lo + TPS, tl.load(tok_ptr + b + 1))
    h64 = h.to(tl.int64)
    kc_ptr += h64 * N * DP
    vc_ptr += h64 * N * VDP
    ks_ptr += h64 * M * D
    kz_ptr += h64 * M * D
    vs_ptr += h64 * N * NG
    vz_ptr += h64 * N * NG
    for a in range(lo, hi, BT):
        t = a + tl.arange(0, BT)
        tm = t < hi
        t64 = t.to(tl.int64)
        m2 = tm[:, None]
        k_off = (c0 + (t - t0) // C).to(tl.int64)[:, None] * D + d[None, :]
        v_off = t64[:, None] * NG + grp[None, :]
        kq = _code_values(_load_codes(kc_ptr + t64[:, None] * DP, m2, d, D, BITS), lv_ptr, LEVELS)
        k = kq * tl.load(ks_ptr + k_off, mask=m2, other=0.0).to(tl.float32) + tl.load(
            kz_ptr + k_off, mask=m2, other=0.0
        ).to(tl.float32)
        vq = _code_values(_load_codes(vc_ptr + t64[:, None] * VDP, m2, d, D, VBITS), lv_ptr, LEVELS)
        v = vq * tl.load(vs_ptr + v_off, mask=m2, other=0.0).to(tl.float32) + tl.load(
            vz_ptr + v_off, mask=m2, other=0.0
        ).to(tl.float32)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, rmask[:, None] & tm[None, :])
    return acc, m_i, l_i


@triton.jit
def _split_attn_kernel(
    q_ptr,
    s_qb,
    s_qh,
    s_ql,
    fk_ptr,
    fv_ptr,
    s_fb,
    s_fh,
    s_ft,
    start_ptr,
    R,
    a_kc,
    a_ks,
    a_kz,
    a_vc,
    a_vs,
    a_vz,
    a_tok,
    a_chk,
    a_lv,
    a_N,
    a_M,
    a_C,
    b_kc,
    b_ks,
    b_kz,
    b_vc,
    b_vs,
    b_vz,
    b_tok,
    b_chk,
    b_lv,
    b_N,
    b_M,
    b_C,
    po_ptr,
    pm_ptr,
    pl_ptr,
    H_kv,
    L_q,
    n_rep,
    n_qb,
    S_full,
    S_a,
    S_total,
    TPS,
    qk_scale,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BT: tl.constexpr,
    BITS_A: tl.constexpr,
    VBITS_A: tl.constexpr,
    G_A: tl.constexpr,
    LV_A: tl.constexpr,
    BITS_B: tl.constexpr,
    VBITS_B: tl.constexpr,
    G_B: tl.constexpr,
    LV_B: tl.constexpr,
):
    """Grid ``(B * H_kv * n_qb, S_total)``: partial attention of one block of query rows over one token split."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    qb = pid % n_qb
    h = (pid // n_qb) % H_kv
    b = pid // (n_qb * H_kv)
    row = qb * BQ + tl.arange(0, BQ)  # row = rep * L_q + i (query head h * n_rep + rep, query token i)
    rmask = row < n_rep * L_q
    i = row % L_q
    d = tl.arange(0, D)
    q_off = b.to(tl.int64) * s_qb + (h * n_rep + row // L_q).to(tl.int64) * s_qh + i * s_ql
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
    acc = tl.zeros([BQ, D], dtype=tl.float32)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], dtype=tl.float32)
    if sp < S_full:
        # full-precision part, right-aligned: sequence b owns [start[b], R); key t is visible to query token i
        # iff t <= R - L_q + i (the last L_q tokens are the queries' own)
        lo = tl.load(start_ptr + b) + sp * TPS
        hi = tl.minimum(lo + TPS, R)
        f_off = b.to(tl.int64) * s_fb + h.to(tl.int64) * s_fh
        for a in range(lo, hi, BT):
            t = a + tl.arange(0, BT)
            tm = t < hi
            off = f_off + t.to(tl.int64)[:, None] * s_ft + d[None, :]
            k = tl.load(fk_ptr + off, mask=tm[:, None], other=0.0).to(tl.float32)
            v = tl.load(fv_ptr + off, mask=tm[:, None], other=0.0).to(tl.float32)
            valid = rmask[:, None] & tm[None, :] & (t[None, :] <= (R - L_q + i)[:, None])
            acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, valid)
    elif sp < S_full + S_a:
        acc, m_i, l_i = _packed_split(
            acc,
            m_i,
            l_i,
            q,
            rmask,
            b,
            h,
            sp - S_full,
            TPS,
            a_kc,
            a_ks,
            a_kz,
            a_vc,
            a_vs,
            a_vz,
            a_tok,
            a_chk,
            a_lv,
            a_N,
            a_M,
            a_C,
            D,
            BT,
            BITS_A,
            VBITS_A,
            G_A,
            LV_A,
        )
    else:
        acc, m_i, l_i = _packed_split(
            acc,
            m_i,
            l_i,
            q,
            rmask,
            b,
            h,
            sp - S_full - S_a,
            TPS,
            b_kc,
            b_ks,
            b_kz,
            b_vc,
            b_vs,
            b_vz,
            b_tok,
            b_chk,
            b_lv,
            b_N,
            b_M,
            b_C,
            D,
            BT,
            BITS_B,
            VBITS_B,
            G_B,
            LV_B,
        )
    r = (pid.to(tl.int64) * S_total + sp) * BQ + tl.arange(0, BQ)
    tl.store(pm_ptr + r, m_i)
    tl.store(pl_ptr + r, l_i)
    tl.store(po_ptr + r[:, None] * D + d[None, :], acc)


@triton.jit
def _merge_kernel(
    po_ptr,
    pm_ptr,
    pl_ptr,
    o_ptr,
    s_ob,
    s_oh,
    s_ol,
    H_kv,
    L_q,
    n_rep,
    n_qb,
    S_total,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BS: tl.constexpr,
):
    """Grid ``(B * H_kv * n_qb,)``: log-sum-exp merge of the ``S_total`` partials of a block of query rows."""
    pid = tl.program_id(0)
    qb = pid % n_qb
    h = (pid // n_qb) % H_kv
    b = pid // (n_qb * H_kv)
    rq = tl.arange(0, BQ)
    d = tl.arange(0, D)
    m_run = tl.full([BQ], float("-inf"), tl.float32)
    l_run = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, D], dtype=tl.float32)
    for s0 in range(0, S_total, BS):
        s = s0 + tl.arange(0, BS)
        sm = s < S_total
        r = (pid.to(tl.int64) * S_total + s)[:, None] * BQ + rq[None, :]  # (BS, BQ)
        m_s = tl.load(pm_ptr + r, mask=sm[:, None], other=float("-inf"))
        l_s = tl.load(pl_ptr + r, mask=sm[:, None], other=0.0)
        o_s = tl.load(po_ptr + r[:, :, None] * D + d[None, None, :], mask=sm[:, None, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(m_s - m_use[None, :])  # (BS, BQ); 0 for empty splits
        l_run = l_run * alpha + tl.sum(l_s * w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(o_s * w[:, :, None], axis=0)
        m_run = m_new
    row = qb * BQ + rq
    rmask = row < n_rep * L_q
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    o_off = b.to(tl.int64) * s_ob + (h * n_rep + row // L_q).to(tl.int64) * s_oh + (row % L_q) * s_ol
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_levels(lv, i: int, bits: int, vbits: int, device: torch.device) -> torch.Tensor:
    """A segment's 12th item: fp32 levels ``(2**bits,)`` on ``device`` (a codebook's), made contiguous."""
    if vbits != bits:
        raise ValueError(f"segments[{i}] levels need keys and values of one width, got bits ({bits}, {vbits})")
    ok = isinstance(lv, torch.Tensor) and lv.dtype == torch.float32 and lv.shape == (1 << bits,)
    if not (ok and lv.device == device):
        got = f"{lv.dtype} {tuple(lv.shape)} on {lv.device}" if isinstance(lv, torch.Tensor) else type(lv).__name__
        raise ValueError(
            f"segments[{i}] levels must be a float32 tensor of shape ({1 << bits},) on {device}, got {got}"
        )
    return lv.contiguous()


def code_widths(bits, i: int) -> tuple[int, int]:
    """A segment's ``bits`` item -> ``(key_bits, value_bits)``: an int is both, a pair has ``value_bits <=
    key_bits``."""
    pair = tuple(bits) if isinstance(bits, (list, tuple)) and len(bits) == 2 else (bits, bits)
    for b in pair:
        check_bits(b)
    if pair[1] > pair[0]:
        raise ValueError(f"segments[{i}] value bits must be <= key bits, got bits {bits!r}")
    return pair


def _check_codes(k_codes, v_codes, bits: tuple[int, int], i: int, H_kv: int, D: int) -> None:
    """Codes as wide as their declared bits: uint8 ``(H_kv, N, D * bits // 8)``, keys and values of one ``N`` (the
    kernel reads by these widths, so a mismatch would read past the buffers)."""
    n = k_codes.shape[1] if isinstance(k_codes, torch.Tensor) and k_codes.dim() == 3 else -1
    for name, codes, b in (("k_codes", k_codes, bits[0]), ("v_codes", v_codes, bits[1])):
        ok = isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and codes.dim() == 3
        if not (ok and tuple(codes.shape) == (H_kv, n, D * b // 8)):
            got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(
                f"segments[{i}].{name} must be uint8 of shape (H_kv={H_kv}, N, D*bits//8={D * b // 8}) for {b}-bit "
                f"codes (keys and values of one N), got {got}"
            )


def _segment_args(seg: tuple | None, i: int, max_tokens: int | None, dummy: torch.Tensor):
    """Kernel arguments of packed segment ``i`` (or of an empty stand-in), its key / value bits and group size,
    whether it has levels, its longest sequence."""
    if seg is None:
        z = dummy
        return [z, z, z, z, z, z, z, z, z, 0, 0, 1], (2, 2), 1, False, 0
    if len(seg) not in (11, 12):
        raise ValueError(f"segments[{i}] must have 11 items, or 12 with levels, got {len(seg)}")
    bits, chunk_size, group_size, *tensors, tok, chk = seg[:11]
    bits = code_widths(bits, i)
    _check_codes(tensors[0], tensors[3], bits, i, dummy.shape[1], dummy.shape[3])
    levels = _check_levels(seg[11], i, *bits, dummy.device) if len(seg) == 12 else None
    tensors = [t.contiguous() for t in tensors]
    if max_tokens is None:
        max_tokens = int((tok[1:] - tok[:-1]).max()) if tok.numel() > 1 else 0
    lv = dummy if levels is None else levels
    args = [*tensors, tok, chk, lv, tensors[0].shape[1], tensors[1].shape[1], chunk_size]
    return args, bits, group_size, levels is not None, max_tokens


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
) -> torch.Tensor:
    """Triton version of ``hf_cocktail.decode.split_attention.split_precision_attention_torch`` (same semantics).

    Args:
        query: ``(B, H_q, L_q, D)``, D of 64 or 128 (:data:`SUPPORTED_HEAD_DIMS`).
        full_keys, full_values: ``(B, H_kv, R, D)``; sequence ``b`` owns ``[full_start[b], R)``.
        full_start: int32 ``(B,)`` on the query's device.
        segments: at most two packed segments, each ``(bits, chunk_size, group_size, k_codes, k_scale, k_zero,
            v_codes, v_scale, v_zero, tok_off, chunk_off[, levels])`` with int32 offsets ``(B+1,)``; ``bits`` is one
            width for keys and values or a pair ``(key_bits, value_bits)`` with ``value_bits <= key_bits``; ``levels``
            (a codebook's): fp32 ``(2**bits,)`` on the query's device, code ``c`` then dequantizes as
            ``levels[c] * scale + zero`` instead of ``c * scale + zero``.
        scaling: softmax scale (usually ``D ** -0.5``).
        max_tokens: per segment, the most tokens one sequence owns; min_full_start: ``min(full_start)``. Computed
            from the tensors when not given (a device sync).
        tokens_per_split: tokens of one sequence per program (default: enough splits to fill the GPU).

    Returns:
        ``(B, H_q, L_q, D)`` in ``query.dtype``.
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
    check_device(query)
    if query.stride(-1) != 1:
        query = query.contiguous()
    fk, fv = full_keys, full_values
    if fk.stride(-1) != 1 or fv.stride() != fk.stride():
        fk, fv = fk.contiguous(), fv.contiguous()
    n_rep = H_q // H_kv
    rows = n_rep * Lq
    BQ = min(triton.next_power_of_2(rows), 8)
    n_qb = triton.cdiv(rows, BQ)
    BT = max(8, min(128, _TILE // (BQ * D)))
    segs = list(segments) + [None] * (2 - len(segments))
    maxes = list(max_tokens) if max_tokens is not None else [None] * len(segments)
    maxes += [None] * (2 - len(maxes))
    (a_args, bits_a, g_a, lv_a, len_a), (b_args, bits_b, g_b, lv_b, len_b) = (
        _segment_args(s, i, m, fk) for i, (s, m) in enumerate(zip(segs, maxes))
    )
    len_full = R - (int(full_start.min()) if min_full_start is None else min_full_start)
    P = B * H_kv * n_qb
    if tokens_per_split is None:
        total = len_full + len_a + len_b
        if query.is_cuda:  # about 4 programs per SM, at least 256 tokens each
            idx = query.device.index if query.device.index is not None else torch.cuda.current_device()
            want = max(1, triton.cdiv(4 * _num_sms(idx), P))
            tokens_per_split = max(256, triton.cdiv(total, want))
        else:  # interpreter: one split per source
            tokens_per_split = max(total, 1)
        tokens_per_split = triton.cdiv(tokens_per_split, BT) * BT
    TPS = int(tokens_per_split)
    if TPS < 1:
        raise ValueError(f"tokens_per_split must be >= 1, got {TPS}")
    S_full, S_a, S_b = (triton.cdiv(n, TPS) for n in (len_full, len_a, len_b))
    S_total = S_full + S_a + S_b
    dev = query.device
    part_o = torch.empty((P, S_total, BQ, D), dtype=torch.float32, device=dev)
    part_m = torch.empty((P, S_total, BQ), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    out = torch.empty((B, H_q, Lq, D), dtype=query.dtype, device=dev)
    with torch.cuda.device(dev) if query.is_cuda else contextlib.nullcontext():
        _split_attn_kernel[(P, S_total)](
            query,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            fk,
            fv,
            fk.stride(0),
            fk.stride(1),
            fk.stride(2),
            full_start,
            R,
            *a_args,
            *b_args,
            part_o,
            part_m,
            part_l,
            H_kv,
            Lq,
            n_rep,
            n_qb,
            S_full,
            S_a,
            S_total,
            TPS,
            float(scaling) * _LOG2E,
            D=D,
            BQ=BQ,
            BT=BT,
            BITS_A=bits_a[0],
            VBITS_A=bits_a[1],
            G_A=g_a,
            LV_A=lv_a,
            BITS_B=bits_b[0],
            VBITS_B=bits_b[1],
            G_B=g_b,
            LV_B=lv_b,
        )
        _merge_kernel[(P,)](
            part_o,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            H_kv,
            Lq,
            n_rep,
            n_qb,
            S_total,
            D=D,
            BQ=BQ,
            BS=min(triton.next_power_of_2(S_total), max(1, _TILE // (BQ * D))),
        )
    return out
