"""Tile helpers of the split-precision attention kernels (:mod:`triton_ops.attention_kernels`): the online
softmax update (with optional logit soft-capping), the unpacking of packed codes and the reading of scales and zeros.

Shapes: BQ query rows of a program, BT tokens of a step, D head dim.
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """fp32 ``tanh(x)`` to a few ulp from ``exp`` alone (libdevice is not available to the interpreter): its Taylor
    series to x**17 where ``|x| < 0.3`` (the next term is below 1e-12 relative), ``1 - 2 / (exp(2|x|) + 1)``
    elsewhere, with the sign of x."""
    a = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(a, 20.0)) + 1.0)
    x2 = x * x
    p = -0.000590027440945586  # tanh(x) = x - x**3 * p(x**2): Taylor coefficients 6404582/10854718875 ... 1/3
    p = p * x2 + 0.0014558343870513183
    p = p * x2 - 0.0035921280365724810
    p = p * x2 + 0.0088632355299021966
    p = p * x2 - 0.0218694885361552028
    p = p * x2 + 0.0539682539682539683
    p = p * x2 - 0.1333333333333333333
    p = p * x2 + 0.3333333333333333333
    small = a - a * x2 * p
    t = tl.where(a < 0.3, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, valid, cap, SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    """Base-2 scores ``(BQ, BT)`` of ``q (BQ, D)`` against ``k (BT, D)``, ``-inf`` where not ``valid``. ``q`` is
    pre-scaled by ``scaling * log2(e)``, or with ``SOFTCAP`` by ``scaling`` alone: then ``cap * tanh(s / cap)``,
    times ``log2(e)``. ``DOT``: one ``tl.dot`` in fp32 (``ieee``: FMA, no TF32), else a broadcast product."""
    if DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    if SOFTCAP:
        s = cap * _tanh(s / cap) * 1.4426950408889634
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _online_update(acc, m_i, l_i, q, k, v, valid, cap, SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    """One block of the online softmax: ``q (BQ, D)`` (see :func:`_scores`), ``k, v (BT, D)`` fp32, ``valid (BQ,
    BT)``. ``m_i``, ``l_i`` are the running max and sum in base 2, ``acc (BQ, D)`` the output sum."""
    s = _scores(q, k, valid, cap, SOFTCAP, DOT)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: keep exp2 away from inf - inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc, m_new, l_i


@triton.jit
def _unpack(packed, BT: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """Bytes ``(BT, NB)`` -> int32 codes ``(BT, NB * 8 // BITS)``: channel ``p * per + j`` at bits ``j * BITS`` of
    byte ``p`` (``per = 8 // BITS``)."""
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    q = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(q, [BT, NB * PER])


@triton.jit
def _load_codes(row_ptr, m2, D: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr):
    """int32 codes ``(BT, D)`` of the tokens whose packed bytes start at ``row_ptr (BT, 1)`` (rows where ``m2``),
    read as whole contiguous rows of bytes (vector loads) and unpacked in registers: channel d in byte d // per at
    bit (d % per) * BITS; INT3 as a 2-bit plane (INT2's layout, ``D // 4`` bytes) then a 1-bit plane (channel d in
    byte D // 4 + d // 8 at bit d % 8)."""
    if BITS == 3:
        lo = tl.load(row_ptr + tl.arange(0, D // 4)[None, :], mask=m2, other=0)
        hi = tl.load(row_ptr + (D // 4 + tl.arange(0, D // 8))[None, :], mask=m2, other=0)
        q = _unpack(lo, BT, D // 4, 2) | (_unpack(hi, BT, D // 8, 1) << 2)
    else:
        packed = tl.load(row_ptr + tl.arange(0, D * BITS // 8)[None, :], mask=m2, other=0)
        q = _unpack(packed, BT, D * BITS // 8, BITS)
    return q


@triton.jit
def _load_codes_outliers(row_ptr, m2, D: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr, N_OUT: tl.constexpr):
    """int32 codes ``(BT, D)`` in the stored channel order of keys with ``N_OUT`` outlier channels: positions
    ``[0, D - N_OUT)`` from the ``BITS``-bit codes packed as :func:`_load_codes` over ``D - N_OUT`` channels (INT3's
    1-bit plane after ``(D - N_OUT) // 4`` bytes), positions ``[D - N_OUT, D)`` one byte each after them. The
    packed part is read at :func:`_load_codes`'s power-of-two widths with the bytes past it masked to 0, so its
    codes at the outlier positions are 0 and the outlier bytes (masked to those positions) are or-ed in."""
    DL: tl.constexpr = D - N_OUT
    LB: tl.constexpr = DL * BITS // 8
    if BITS == 3:
        i4 = tl.arange(0, D // 4)
        i8 = tl.arange(0, D // 8)
        lo = tl.load(row_ptr + i4[None, :], mask=m2 & (i4 < DL // 4)[None, :], other=0)
        hi = tl.load(row_ptr + (DL // 4 + i8)[None, :], mask=m2 & (i8 < DL // 8)[None, :], other=0)
        q = _unpack(lo, BT, D // 4, 2) | (_unpack(hi, BT, D // 8, 1) << 2)
    else:
        ib = tl.arange(0, D * BITS // 8)
        packed = tl.load(row_ptr + ib[None, :], mask=m2 & (ib < LB)[None, :], other=0)
        q = _unpack(packed, BT, D * BITS // 8, BITS)
    d = tl.arange(0, D)
    out = tl.load(row_ptr + LB + tl.maximum(d - DL, 0)[None, :], mask=m2 & (d >= DL)[None, :], other=0)
    return q | out.to(tl.int32)


@triton.jit
def _gather_query(q_ptr, q_off, rmask, ch_ptr, h, qk_scale, D: tl.constexpr):
    """The query rows at ``q_off (BQ,)`` gathered into kv head ``h``'s stored channel order ``ch_ptr`` (int32
    ``(H_kv, D)``: position p holds channel ``ch[h, p]``), fp32 times ``qk_scale``: ``(BQ, D)``."""
    ch = tl.load(ch_ptr + h * D + tl.arange(0, D))
    q = tl.load(q_ptr + q_off[:, None] + ch[None, :], mask=rmask[:, None], other=0.0)
    return q.to(tl.float32) * qk_scale


@triton.jit
def _decode_params(s_ptr, z_ptr, off, blk_ptr, chunk, tab_ptr, m2, P8: tl.constexpr):
    """fp32 scales and zeros at ``off`` (masked by ``m2``): numbers, or with ``P8`` uint8 codes decoded with the
    block of ``chunk`` (broadcastable to ``off``): ``s_max * tab_ptr[sc]`` and ``z_lo + zc * z_step``."""
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
def _per_channel(x, BT: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """``(BT, NG)`` per value group -> ``(BT, NG * G)`` per channel (channel c in group c // G)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [BT, NG, G]), [BT, NG * G])
