"""Argument checks of the split-precision attention launcher (:mod:`triton_ops.attention`): the packed segments'
tuples, the 8-bit full part's scales, the 8-bit scales' table. Messages name the argument, what it must be and what
it got.

Shapes: B batch, H_kv key/value heads, R length of the full-precision part, N tokens of a segment, M its chunks,
D head dim.
"""

from __future__ import annotations

import weakref

import torch

from .checks import check_bits

# channel orders already found to be permutations: the check sorts and compares on the device (a host sync), so it runs
# once per tensor (a store's segment keeps its tensor for its life), not at every decode step
_PERMUTATIONS: dict[int, weakref.ref] = {}


def _checked_permutation(channels: torch.Tensor) -> bool:
    ref = _PERMUTATIONS.get(id(channels))
    return ref is not None and ref() is channels


def _remember_permutation(channels: torch.Tensor) -> None:
    key = id(channels)
    _PERMUTATIONS[key] = weakref.ref(channels, lambda _ref: _PERMUTATIONS.pop(key, None))


def full_head_args(full_head, fk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The full part's exact head ``(keys, values)`` ``(B, H_kv, S, D)`` (checked against the full part ``fk``'s
    ``B, H_kv, D``, made contiguous) and ``S``; or ``fk`` twice as an unused stand-in and 0 (no head code compiled)."""
    if full_head is None:
        return fk, fk, 0
    if not isinstance(full_head, (list, tuple)) or len(full_head) != 2:
        raise ValueError(f"full_head must be a pair (head keys, head values), got {type(full_head).__name__}")
    hk, hv = full_head
    B, H, D = fk.shape[0], fk.shape[1], fk.shape[3]
    for name, t in (("full_head[0]", hk), ("full_head[1]", hv)):
        ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 4
        if not (ok and (t.shape[0], t.shape[1], t.shape[3]) == (B, H, D) and t.shape == hk.shape):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float tensor of shape ({B}, {H}, S, {D}) like full_head[0], got {got}")
    return hk.contiguous(), hv.contiguous(), hk.shape[2]


def full_scales_args(full_scales, fk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 full part's scales ``(B, H_kv, R, 1)`` (checked), or ``fk`` twice as an unused stand-in."""
    if full_scales is None:
        if fk.dtype == torch.int8:
            raise ValueError("full_keys are int8 codes (an 8-bit full part): pass their full_scales")
        return fk, fk
    if fk.dtype != torch.int8:
        raise ValueError(f"full_scales come with int8 full_keys / full_values (an 8-bit full part), got {fk.dtype}")
    want = (*fk.shape[:3], 1)
    for name, t in zip(("full_scales[0]", "full_scales[1]"), full_scales):
        if not (
            isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == want and t.device == fk.device
        ):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float tensor of shape {want} on {fk.device}, got {got}")
    ks, vs = full_scales
    if ks.stride() != vs.stride():
        raise ValueError(f"full_scales[1] must have the strides of full_scales[0] {ks.stride()}, got {vs.stride()}")
    return ks, vs


def scale_table_arg(table, device: torch.device) -> torch.Tensor:
    ok = isinstance(table, torch.Tensor) and table.dtype == torch.float32 and tuple(table.shape) == (256,)
    if not (ok and table.device == device):
        raise ValueError(
            f"scale_table must be a float32 (256,) tensor on {device} (8-bit scales and zeros), got {table!r:.80}"
        )
    return table.contiguous()


def sinks_arg(sinks, H_q: int, device: torch.device) -> torch.Tensor:
    """Attention sinks: one logit per query head, float ``(H_q,)`` on the query's device (read as fp32)."""
    ok = isinstance(sinks, torch.Tensor) and sinks.is_floating_point() and tuple(sinks.shape) == (H_q,)
    if not (ok and sinks.device == device):
        got = f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor) else sinks
        raise ValueError(f"sinks must be a float tensor of shape (H_q={H_q},) on {device}, got {got}")
    return sinks.float().contiguous()


def softcap_arg(softcap) -> float:
    """Logit soft-capping: a finite float > 0 (scores become ``softcap * tanh(scores / softcap)``)."""
    ok = isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
    if not (ok and 0 < float(softcap) < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    return float(softcap)


def code_widths(bits, i: int) -> tuple[int, int]:
    """A segment's ``bits`` item -> ``(key_bits, value_bits)``: an int is both, a pair has ``value_bits <=
    key_bits``."""
    pair = tuple(bits) if isinstance(bits, (list, tuple)) and len(bits) == 2 else (bits, bits)
    for b in pair:
        check_bits(b)
    if pair[1] > pair[0]:
        raise ValueError(f"segments[{i}] value bits must be <= key bits, got bits {bits!r}")
    return pair


def _check_codes(k_codes, v_codes, bits: tuple[int, int], i: int, H_kv: int, D: int, n_out: int = 0) -> None:
    """Codes as wide as their declared bits: uint8 ``(H_kv, N, D * bits // 8)``, keys and values of one ``N`` (the
    kernel reads by these widths, so a mismatch would read past the buffers); keys with ``n_out`` outlier channels
    ``(H_kv, N, (D - n_out) * bits // 8 + n_out)``."""
    n = k_codes.shape[1] if isinstance(k_codes, torch.Tensor) and k_codes.dim() == 3 else -1
    for name, codes, b, o in (("k_codes", k_codes, bits[0], n_out), ("v_codes", v_codes, bits[1], 0)):
        ok = isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and codes.dim() == 3
        width = (D - o) * b // 8 + o
        if not (ok and tuple(codes.shape) == (H_kv, n, width)):
            got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
            want = f"D*bits//8={width}" if o == 0 else f"(D-n_out)*bits//8+n_out={width}"
            raise ValueError(
                f"segments[{i}].{name} must be uint8 of shape (H_kv={H_kv}, N, {want}) for {b}-bit "
                f"codes (keys and values of one N), got {got}"
            )


def _outlier_item(item, i: int, bits: int, H_kv: int, D: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """A segment's outlier key channels ``(n_out, channels)`` (``hf_cocktail.storage.key_outliers``), checked:
    ``n_out`` an int in ``[1, D)`` leaving whole code bytes (``(D - n_out) * bits`` a multiple of 8, of 8 channels
    for INT3's planes), ``channels`` int32 ``(H_kv, D)`` on ``device``, each row a permutation of ``range(D)`` (the
    stored channel order; the kernel gathers the query by it)."""
    if not (isinstance(item, (list, tuple)) and len(item) == 2):
        raise ValueError(f"segments[{i}]'s outlier key channels must be a pair (n_out, channels), got {item!r:.80}")
    n_out, channels = item
    whole = 8 if bits == 3 else 8 // bits
    if not (type(n_out) is int and 0 < n_out < D and (D - n_out) % whole == 0):
        raise ValueError(
            f"segments[{i}]'s n_out must be an int in [1, {D}) with D - n_out a multiple of {whole} for {bits}-bit "
            f"codes, got {n_out!r}"
        )
    ok = isinstance(channels, torch.Tensor) and channels.dtype == torch.int32 and channels.device == device
    if not (ok and tuple(channels.shape) == (H_kv, D)):
        got = (
            f"{channels.dtype} {tuple(channels.shape)} on {channels.device}"
            if isinstance(channels, torch.Tensor)
            else channels
        )
        raise ValueError(
            f"segments[{i}]'s outlier channels must be int32 of shape ({H_kv}, {D}) on {device}, got {got}"
        )
    if not _checked_permutation(channels):
        want = torch.arange(D, dtype=torch.int32, device=device).expand(H_kv, D)
        if not torch.equal(channels.sort(dim=1).values, want):
            raise ValueError(f"segments[{i}]'s outlier channels must hold a permutation of range({D}) per head")
        _remember_permutation(channels)
    return n_out, channels.contiguous()


def _check_blocks(seg: tuple, i: int, H_kv: int, M: int, device: torch.device) -> list[torch.Tensor]:
    """The block numbers ``(H_kv, M, 3)`` of a segment with 8-bit scales and zeros (items 12 and 13)."""
    if len(seg) != 13:
        raise ValueError(
            f"segments[{i}] has uint8 scale and zero codes (8-bit scales and zeros) and needs k_block and v_block as "
            f"items 12 and 13, got {len(seg)} items"
        )
    for name, blk in (("k_block", seg[11]), ("v_block", seg[12])):
        ok = isinstance(blk, torch.Tensor) and blk.is_floating_point() and blk.device == device
        if not (ok and tuple(blk.shape) == (H_kv, M, 3)):
            got = f"{blk.dtype} {tuple(blk.shape)} on {blk.device}" if isinstance(blk, torch.Tensor) else blk
            raise ValueError(
                f"segments[{i}].{name} must be a float tensor (H_kv={H_kv}, M={M}, 3) on {device}, got {got}"
            )
    return [seg[11].contiguous(), seg[12].contiguous()]


def segment_args(seg: tuple | None, i: int, max_tokens: int | None, dummy: torch.Tensor):
    """Kernel arguments of packed segment ``i`` (or of an absent one's stand-ins, never read: the kernel's segment
    count is a compile-time constant, so a missing segment compiles no code; its stand-ins are still typed as the
    real ones, uint8 codes, fp32 parameters, int32 offsets), its key / value bits and group size, whether its scales
    and zeros are 8-bit codes, its longest sequence, its outlier key channels' count (0: none; the channel order is
    an argument, the offsets standing in for it where there are none)."""
    if seg is None:
        codes = torch.zeros(1, dtype=torch.uint8, device=dummy.device)
        params = torch.zeros(1, dtype=torch.float32, device=dummy.device)
        offsets = torch.zeros(2, dtype=torch.int32, device=dummy.device)
        tensors = [codes, params, params, codes, params, params, offsets, offsets, params, params, offsets]
        return [*tensors, 0, 0, 1], (2, 2), 1, False, 0, 0
    if len(seg) not in (11, 12, 13):
        raise ValueError(
            f"segments[{i}] must have 11 items, 12 with outlier key channels (n_out, channels) or 13 with the blocks "
            f"of 8-bit scales and zeros, got {len(seg)}"
        )
    bits, chunk_size, group_size, *tensors, tok, chk = seg[:11]
    bits = code_widths(bits, i)
    H_kv, D = dummy.shape[1], dummy.shape[3]
    n_out, channels = _outlier_item(seg[11], i, bits[0], H_kv, D, dummy.device) if len(seg) == 12 else (0, tok)
    _check_codes(tensors[0], tensors[3], bits, i, H_kv, D, n_out)
    p8 = isinstance(tensors[1], torch.Tensor) and tensors[1].dtype == torch.uint8
    if n_out and p8:
        raise ValueError(f"segments[{i}] has outlier key channels, which are stored with 16-bit scales only")
    tensors = [t.contiguous() for t in tensors]
    blocks = _check_blocks(seg, i, H_kv, tensors[1].shape[1], dummy.device) if p8 else [dummy, dummy]
    if max_tokens is None:
        max_tokens = int((tok[1:] - tok[:-1]).max()) if tok.numel() > 1 else 0
    args = [*tensors, tok, chk, *blocks, channels, tensors[0].shape[1], tensors[1].shape[1], chunk_size]
    return args, bits, group_size, p8, max_tokens, n_out
