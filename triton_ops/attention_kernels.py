"""The Triton kernels of split-precision decode attention (flash-decoding style); launched by
:func:`triton_ops.attention.split_precision_attention`, which checks their arguments.

Shapes: B batch, H_q query heads, H_kv key/value heads (``n_rep = H_q // H_kv``), L_q query tokens, D head dim,
R length of the full-precision part, C chunk size, G value group size.

Kernel 1 (:func:`split_attn_kernel`) runs one program per (sequence, kv head, block of query rows, token split). The
splits cover the full-precision part, then the first packed segment (INT4), then the second (INT2 or INT3; a
segment's bit width is a compile-time constant), each cut into pieces of ``tokens_per_split`` tokens of that
sequence; ragged sequences just leave some splits empty. A program loads a block of the ``n_rep * L_q`` query rows
of its kv head together (GQA without ``repeat_kv``), reads each token's packed bytes as one contiguous row (vector
loads) and unpacks and dequantizes them in registers (code ``c`` as ``c * scale + zero``; 8-bit scales / zeros and
an int8 full part are decoded there too), forms the products as a broadcast or, for blocks of 16 rows (``DOT``), as
``tl.dot`` in fp32, keeps an fp32 online softmax (optionally soft-capped), and writes its partial (max, sum,
unnormalised output). The packed-segment count ``SEGS`` is a compile-time constant: an absent segment compiles no
code; so is a segment's count of outlier key channels at 8 bits (``N_OUT_A`` / ``N_OUT_B``, 0: today's code): its
query rows are gathered once into the keys' stored channel order, then Q.K is unchanged. Kernel 2
(:func:`merge_kernel`) merges the partials of a row with a log-sum-exp reduction (attention sinks join it once) and
writes the output in ``query.dtype``.
"""

import triton
import triton.language as tl

from .attention_tiles import (
    _decode_params,
    _gather_query,
    _load_codes,
    _load_codes_outliers,
    _online_update,
    _per_channel,
)


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
    cap,
    D: tl.constexpr,
    BT: tl.constexpr,
    BITS: tl.constexpr,
    VBITS: tl.constexpr,
    G: tl.constexpr,
    P8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    N_OUT: tl.constexpr,
):
    """Split ``j`` of sequence ``b`` in a packed segment: its tokens ``[tok_off[b] + j*TPS, ...)``. Key scales are
    per (chunk, channel), chunk = ``chunk_off[b] + (token - tok_off[b]) // C``; value scales per (token, group).
    Keys have ``BITS``-bit codes, values ``VBITS``-bit ones. With ``P8`` (8-bit scales and zeros,
    ``hf_cocktail.storage.params8``) the scale / zero pointers hold uint8 codes, decoded in registers with their
    chunk's block ``(s_max, z_lo, z_step)`` (``kb_ptr`` / ``vb_ptr``, ``(H_kv, M, 3)``) as ``s_max * tab_ptr[code]``
    and ``z_lo + code * z_step``. With ``N_OUT`` outlier key channels (``hf_cocktail.storage.key_outliers``) a
    token's key bytes are the ``BITS``-bit codes of ``D - N_OUT`` channels then one byte per outlier channel, all in
    the stored channel order, as are the key scales and zeros; ``q`` is then in that order too."""
    DP: tl.constexpr = (D - N_OUT) * BITS // 8 + N_OUT
    VDP: tl.constexpr = D * VBITS // 8
    NG: tl.constexpr = D // G
    d = tl.arange(0, D)
    g = tl.arange(0, NG)
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
        ks, kz = _decode_params(ks_ptr, kz_ptr, chunk * D + d[None, :], kb_ptr, chunk, tab_ptr, m2, P8)
        vs, vz = _decode_params(vs_ptr, vz_ptr, t64[:, None] * NG + g[None, :], vb_ptr, chunk, tab_ptr, m2, P8)
        if N_OUT == 0:
            kq = _load_codes(kc_ptr + t64[:, None] * DP, m2, D, BT, BITS)
        else:
            kq = _load_codes_outliers(kc_ptr + t64[:, None] * DP, m2, D, BT, BITS, N_OUT)
        k = kq.to(tl.float32) * ks + kz
        v = _load_codes(vc_ptr + t64[:, None] * VDP, m2, D, BT, VBITS).to(tl.float32)
        v = v * _per_channel(vs, BT, NG, G) + _per_channel(vz, BT, NG, G)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, rmask[:, None] & tm[None, :], cap, SOFTCAP, DOT)
    return acc, m_i, l_i


@triton.jit
def split_attn_kernel(
    q_ptr,
    qf_ptr,
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
    fhk_ptr,
    fhv_ptr,
    S_head,
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
    a_ch,
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
    b_ch,
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
    cap,
    tab_ptr,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BT: tl.constexpr,
    SEGS: tl.constexpr,
    BITS_A: tl.constexpr,
    VBITS_A: tl.constexpr,
    G_A: tl.constexpr,
    BITS_B: tl.constexpr,
    VBITS_B: tl.constexpr,
    G_B: tl.constexpr,
    P8_A: tl.constexpr,
    P8_B: tl.constexpr,
    F8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    N_OUT_A: tl.constexpr,
    N_OUT_B: tl.constexpr,
    FQ: tl.constexpr,
    HEAD: tl.constexpr,
):
    """Grid ``(B * H_kv * n_qb, S_total)``: partial attention of one block of query rows over one token split.
    ``SEGS`` packed segments (0, 1 or 2): an absent segment's branch is not compiled (its arguments are unused
    stand-ins). ``qk_scale``: ``scaling * log2(e)``, or ``scaling`` with ``SOFTCAP`` (then ``cap`` is the cap).
    ``N_OUT_A`` / ``N_OUT_B``: a segment's outlier key channels (0: none, no code); its query rows are then gathered
    once into its keys' stored channel order ``a_ch`` / ``b_ch`` (int32 ``(H_kv, D)``). ``FQ``: the full part's keys
    are stored in a basis of their own, scored with the query rows of ``qf_ptr`` (the query's strides) instead.
    ``HEAD``: the full part's exact head, sequence ``b``'s tokens ``[start[b], start[b] + S_head)`` read from
    ``fhk_ptr`` / ``fhv_ptr`` ``(B, H_kv, S_head, D)`` (contiguous, the layer's basis: scored with ``q``)."""
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
        first = tl.load(start_ptr + b)
        lo = first + sp * TPS
        hi = tl.minimum(lo + TPS, R)
        f_off = b.to(tl.int64) * s_fb + h.to(tl.int64) * s_fh
        if HEAD:  # compile-time: the exact head's tokens of this split first, at the model's precision
            h_hi = tl.minimum(hi, first + S_head)
            h_off = (b.to(tl.int64) * H_kv + h) * S_head * D
            for a in range(lo, h_hi, BT):
                t = a + tl.arange(0, BT)
                tm = t < h_hi
                off = h_off + (t - first).to(tl.int64)[:, None] * D + d[None, :]
                k = tl.load(fhk_ptr + off, mask=tm[:, None], other=0.0).to(tl.float32)
                v = tl.load(fhv_ptr + off, mask=tm[:, None], other=0.0).to(tl.float32)
                valid = rmask[:, None] & tm[None, :] & (t[None, :] <= (R - L_q + i)[:, None])
                acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, valid, cap, SOFTCAP, DOT)
            lo = tl.maximum(lo, h_hi)
        if FQ:  # compile-time: the codes' own query rows (their keys' basis)
            q = tl.load(qf_ptr + q_off[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
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
            acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, valid, cap, SOFTCAP, DOT)
    elif SEGS >= 1:  # compile-time: no code for an absent segment
        if sp < S_full + S_a:
            q_a = q
            if N_OUT_A > 0:
                q_a = _gather_query(q_ptr, q_off, rmask, a_ch, h, qk_scale, D)
            acc, m_i, l_i = _packed_split(
                acc,
                m_i,
                l_i,
                q_a,
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
                cap,
                D,
                BT,
                BITS_A,
                VBITS_A,
                G_A,
                P8_A,
                SOFTCAP,
                DOT,
                N_OUT_A,
            )
        elif SEGS == 2:
            q_b = q
            if N_OUT_B > 0:
                q_b = _gather_query(q_ptr, q_off, rmask, b_ch, h, qk_scale, D)
            acc, m_i, l_i = _packed_split(
                acc,
                m_i,
                l_i,
                q_b,
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
                cap,
                D,
                BT,
                BITS_B,
                VBITS_B,
                G_B,
                P8_B,
                SOFTCAP,
                DOT,
                N_OUT_B,
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
    sink_ptr,
    H_kv,
    L_q,
    n_rep,
    n_qb,
    S_total,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Grid ``(B * H_kv * n_qb,)``: log-sum-exp merge of the ``S_total`` partials of a block of query rows. With
    ``SINKS``, the query head's sink logit ``sink_ptr[head]`` joins the denominator once, as a partial of sum 1 and
    output 0."""
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
    if SINKS:
        sink = tl.load(sink_ptr + h * n_rep + row // L_q, mask=rmask, other=float("-inf")) * 1.4426950408889634
        m_new = tl.maximum(m_run, sink)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        l_run = l_run * alpha + tl.exp2(sink - m_use)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    o_off = b.to(tl.int64) * s_ob + (h * n_rep + row // L_q).to(tl.int64) * s_oh + (row % L_q) * s_ol
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
