"""The Triton kernels of split-precision decode attention (flash-decoding style); launched by
:func:`triton_ops.attention.split_precision_attention`, which checks their arguments.

Shapes: B batch, H_q query heads, H_kv key/value heads (``n_rep = H_q // H_kv``), L_q query tokens, D head dim,
R length of the full-precision part, C chunk size, G value group size.

Kernel 1 (:func:`split_attn_kernel`) runs one program per (sequence, kv head, block of query rows, token split). The
splits cover the full-precision part, then the first packed segment (INT4), then the second (INT2 or INT3; a
segment's bit width is a compile-time constant), each cut into pieces of ``tokens_per_split`` tokens of that
sequence; ragged sequences just leave some splits empty. A program loads the ``n_rep * L_q`` query rows of its kv
head together (GQA without ``repeat_kv``), unpacks and dequantizes codes in registers (code ``c`` as ``c * scale +
zero``; 8-bit scales / zeros and an int8 full part are decoded there too) and keeps an fp32 online softmax, and
writes its partial (max, sum, unnormalised output). Kernel 2 (:func:`merge_kernel`) merges the partials of a row
with a log-sum-exp reduction and writes the output in ``query.dtype``.
"""

import triton
import triton.language as tl


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
def _params(s_ptr, z_ptr, off, blk_ptr, chunk, tab_ptr, m2, P8: tl.constexpr):
    """fp32 scales and zeros at ``off`` (masked by ``m2``): numbers, or with ``P8`` uint8 codes decoded with the
    block of ``chunk`` (``(BT, 1)``): ``s_max * tab_ptr[sc]`` and ``z_lo + zc * z_step``."""
    if P8:
        sc = tl.load(s_ptr + off, mask=m2, other=0).to(tl.int32)
        zc = tl.load(z_ptr + off, mask=m2, other=0).to(tl.float32)
        s_max = tl.load(blk_ptr + chunk * 3, mask=m2, other=0.0).to(tl.float32)
        z_lo = tl.load(blk_ptr + chunk * 3 + 1, mask=m2, other=0.0).to(tl.float32)
        z_step = tl.load(blk_ptr + chunk * 3 + 2, mask=m2, other=0.0).to(tl.float32)
        scale = s_max * tl.load(tab_ptr + sc)
        zero = z_lo + zc * z_step
    else:
        scale = tl.load(s_ptr + off, mask=m2, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + off, mask=m2, other=0.0).to(tl.float32)
    return scale, zero


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
    kb_ptr,
    vb_ptr,
    tab_ptr,
    N,
    M,
    C,
    D: tl.constexpr,
    BT: tl.constexpr,
    BITS: tl.constexpr,
    VBITS: tl.constexpr,
    G: tl.constexpr,
    P8: tl.constexpr,
):
    """Split ``j`` of sequence ``b`` in a packed segment: its tokens ``[tok_off[b] + j*TPS, ...)``. Key scales are
    per (chunk, channel), chunk = ``chunk_off[b] + (token - tok_off[b]) // C``; value scales per (token, group).
    Keys have ``BITS``-bit codes, values ``VBITS``-bit ones. With ``P8`` (8-bit scales and zeros,
    ``hf_cocktail.storage.params8``) the scale / zero pointers hold uint8 codes, decoded in registers with their
    chunk's block ``(s_max, z_lo, z_step)`` (``kb_ptr`` / ``vb_ptr``, ``(H_kv, M, 3)``) as ``s_max * tab_ptr[code]``
    and ``z_lo + code * z_step``."""
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
    kb_ptr += h64 * M * 3
    vb_ptr += h64 * M * 3
    for a in range(lo, hi, BT):
        t = a + tl.arange(0, BT)
        tm = t < hi
        t64 = t.to(tl.int64)
        m2 = tm[:, None]
        chunk = (c0 + (t - t0) // C).to(tl.int64)[:, None]
        k_off = chunk * D + d[None, :]
        v_off = t64[:, None] * NG + grp[None, :]
        ks, kz = _params(ks_ptr, kz_ptr, k_off, kb_ptr, chunk, tab_ptr, m2, P8)
        vs, vz = _params(vs_ptr, vz_ptr, v_off, vb_ptr, chunk, tab_ptr, m2, P8)
        k = _load_codes(kc_ptr + t64[:, None] * DP, m2, d, D, BITS).to(tl.float32) * ks + kz
        v = _load_codes(vc_ptr + t64[:, None] * VDP, m2, d, D, VBITS).to(tl.float32) * vs + vz
        acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, rmask[:, None] & tm[None, :])
    return acc, m_i, l_i


@triton.jit
def split_attn_kernel(
    q_ptr,
    s_qb,
    s_qh,
    s_ql,
    fk_ptr,
    fv_ptr,
    s_fb,
    s_fh,
    s_ft,
    fks_ptr,
    fvs_ptr,
    s_sb,
    s_sh,
    s_st,
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
    a_kb,
    a_vb,
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
    b_kb,
    b_vb,
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
    tab_ptr,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BT: tl.constexpr,
    BITS_A: tl.constexpr,
    VBITS_A: tl.constexpr,
    G_A: tl.constexpr,
    BITS_B: tl.constexpr,
    VBITS_B: tl.constexpr,
    G_B: tl.constexpr,
    P8_A: tl.constexpr,
    P8_B: tl.constexpr,
    F8: tl.constexpr,
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
            if F8:  # an 8-bit full part: int8 codes times their token's scale (quant.dequantize_tokens8)
                s_off = b.to(tl.int64) * s_sb + h.to(tl.int64) * s_sh + t.to(tl.int64)[:, None] * s_st
                k = k * tl.load(fks_ptr + s_off, mask=tm[:, None], other=0.0).to(tl.float32)
                v = v * tl.load(fvs_ptr + s_off, mask=tm[:, None], other=0.0).to(tl.float32)
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
            a_kb,
            a_vb,
            tab_ptr,
            a_N,
            a_M,
            a_C,
            D,
            BT,
            BITS_A,
            VBITS_A,
            G_A,
            P8_A,
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
            b_kb,
            b_vb,
            tab_ptr,
            b_N,
            b_M,
            b_C,
            D,
            BT,
            BITS_B,
            VBITS_B,
            G_B,
            P8_B,
        )
    r = (pid.to(tl.int64) * S_total + sp) * BQ + tl.arange(0, BQ)
    tl.store(pm_ptr + r, m_i)
    tl.store(pl_ptr + r, l_i)
    tl.store(po_ptr + r[:, None] * D + d[None, :], acc)


@triton.jit
def merge_kernel(
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
