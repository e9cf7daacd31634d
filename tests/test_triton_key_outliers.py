"""The Triton split-precision attention over segments with outlier key channels at 8 bits
(``hf_cocktail.storage.key_outliers``): the kernel gathers the query into the keys' stored channel order and reads
the low-width codes of the other channels then one byte per outlier channel, for 4-, 3- and 2-bit segments with
1/16 and 1/8 of D=64 as outliers, rotated or not, one or two segments, through the dispatch (no fallback to the
reference); under TRITON_INTERPRET=1 without CUDA (the setup of ``test_triton_kernels``). The kernel's error
against fp64 is at most twice the fp32 PyTorch reference's, plus fp32 summation noise.

Shapes: B batch, H_kv key/value heads, T tokens, D head dim.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch, with_rotation
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .test_triton_kernels import DEV, _interpret, attention_sdpa, triton_ops  # noqa: F401

B, H_KV, D, C, G = 2, 2, 64, 8, 16


def outlier_store(widths: tuple[int, ...], share: float, rotation: str | None, seed: int = 0) -> LayerStore:
    """A store of ``B`` sequences (the second 9 tokens shorter) with one segment per width of ``widths`` (40 and
    30 tokens), then 7 full-precision tokens; keys with two channels 20x larger (channel-fixed outliers)."""
    g = torch.Generator().manual_seed(seed)
    T = 77
    k, v = torch.randn(B, H_KV, T, D, generator=g), torch.randn(B, H_KV, T, D, generator=g)
    k[..., [5, 40]] *= 20
    positions = []
    for b in range(B):
        a = 9 * b  # ragged: sequence 1 starts later
        spans, pos = {}, a
        for w, n in zip(widths, (40, 30)):
            spans[w] = torch.arange(pos, pos + n - a * (w == widths[0]))
            pos += n - a * (w == widths[0])
        spans["full"] = torch.arange(pos, T)
        positions.append(spans)
    rot = None if rotation is None else Rotation.make(rotation, H_KV, D, seed=1)
    store = LayerStore.build(k, v, positions, C, G, torch.float32, rotation=rot, key_outlier_share=share)
    assert [s.bits for s in store.segments] == list(widths)
    assert all(s.key_outliers is not None for s in store.segments)
    return store


def _rotate_fp64(x: torch.Tensor, mats: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``Rotation._apply`` in fp64: ``x (B, H, T, D)``, head ``h`` times matrix ``h // (H // H_kv)``."""
    m = mats.double().transpose(-1, -2) if transpose else mats.double()
    Bx, H, T, Dx = x.shape
    return (x.double().reshape(Bx, m.shape[0], H // m.shape[0] * T, Dx) @ m).reshape(Bx, H, T, Dx)


def attention_fp64(query: torch.Tensor, store: LayerStore, scaling: float) -> torch.Tensor:
    """The attention of ``query`` over the store's dequantized cache in fp64 (rotated into the store's basis and the
    output back, in fp64 too)."""
    rot = store.rotation
    q = query.double() if rot is None else _rotate_fp64(query, rot.keys)
    out = attention_sdpa(q, store, scaling, torch.float64)
    return out if rot is None else _rotate_fp64(out, rot.values, transpose=True)


CASES = {
    # name: (segment widths, outlier share, rotation, L_q)
    "int4_1_16": ((4,), 1 / 16, None, 1),
    "int4_1_8_rotated_Lq2": ((4,), 1 / 8, "hadamard", 2),
    "int3_1_16_rotated": ((3,), 1 / 16, "hadamard", 1),
    "int2_1_8_Lq2": ((2,), 1 / 8, None, 2),
    "int4_int3_1_8": ((4, 3), 1 / 8, None, 1),
    "int4_int2_1_16_rotated_Lq2": ((4, 2), 1 / 16, "hadamard", 2),
    "int4_int3_1_16_Lq2": ((4, 3), 1 / 16, None, 2),
    "int4_int2_1_8_rotated": ((4, 2), 1 / 8, "hadamard", 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_reads_outlier_channels_with_the_triton_kernel(name):
    widths, share, rotation, Lq = CASES[name]
    store = outlier_store(widths, share, rotation)
    query = (torch.randn(B, H_KV * 2, Lq, D, generator=torch.Generator().manual_seed(2)) * 2).to(DEV)  # GQA 2
    scaling = D**-0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
        out = dispatch.split_precision_attention(query, store, scaling, "triton")
    assert store.kernel_cache[("route", "triton", query.device, D)][1] == "triton"
    assert out.dtype == query.dtype and out.shape == query.shape
    truth = attention_fp64(query, store, scaling)
    low = split_precision_attention_torch(query, store, scaling)
    err = (out.double() - truth).abs().max().item()
    err_low = (low.double() - truth).abs().max().item()
    T = 77
    floor = torch.finfo(torch.float32).eps * math.sqrt(T) * 4.0  # |v| of randn stays below 4 here
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"
    # the outlier channels are really read: dropping them (today's format over the same bytes) changes the result
    assert (out - low).abs().max() < 1e-3 < (out - _without_query_gather(query, store, scaling)).abs().max()


def _without_query_gather(query, store, scaling):
    """The kernel fed the stored-order codes but the query in channel order (a kernel that forgot the gather)."""
    segs = [(*dispatch._kernel_segment(s)[:11], (s.key_outliers.count, _identity())) for s in store.segments]
    full = store.full

    def attend(q, st, sc, out_dtype):
        out = triton_ops.split_precision_attention(q, full.keys, full.values, full.start_tensor(), segs, sc)
        return out.to(out_dtype)

    return with_rotation(attend, query, store, scaling)


def _identity():
    return torch.arange(D, dtype=torch.int32, device=DEV).expand(H_KV, D).contiguous()


def _bad_item_cases():
    perm = torch.arange(D, dtype=torch.int32, device=DEV).flip(0).expand(H_KV, D).contiguous()
    not_perm = perm.clone()
    not_perm[1, 0] = 1
    return [
        ((0, perm), r"segments\[0\]'s n_out must be an int in \[1, 64\) with D - n_out a multiple of 2 for 4-bit"),
        ((3, perm), r"n_out must be .*, got 3"),
        ((4, perm.long()), r"segments\[0\]'s outlier channels must be int32 of shape \(2, 64\)"),
        ((4, perm[:1]), r"outlier channels must be int32 of shape \(2, 64\) on .*, got torch.int32 \(1, 64\)"),
        ((4, not_perm), re.escape("segments[0]'s outlier channels must hold a permutation of range(64) per head")),
    ]


@pytest.mark.parametrize("case", range(5))
def test_split_attention_refuses_a_bad_outlier_item(case):
    store = outlier_store((4,), 1 / 16, None)
    item, match = _bad_item_cases()[case]
    seg = (*dispatch._kernel_segment(store.segments[0])[:11], item)
    full = store.full
    with pytest.raises(ValueError, match=match):
        triton_ops.split_precision_attention(
            torch.randn(B, 4, 1, D).to(DEV), full.keys, full.values, full.start_tensor(), [seg], 0.1
        )


def test_split_attention_refuses_outlier_codes_of_the_wrong_width():
    """Codes packed without their outlier bytes (today's width) are refused before the kernel reads past them."""
    store = outlier_store((4,), 1 / 16, None)
    args = dispatch._kernel_segment(store.segments[0])
    seg = (*args[:3], args[3][..., :-4], *args[4:])
    full = store.full
    with pytest.raises(
        ValueError, match=re.escape("k_codes must be uint8 of shape (H_kv=2, N, (D-n_out)*bits//8+n_out=34)")
    ):
        triton_ops.split_precision_attention(
            torch.randn(B, 4, 1, D).to(DEV), full.keys, full.values, full.start_tensor(), [seg], 0.1
        )


def test_a_channel_order_is_checked_once_per_tensor(monkeypatch):
    """The permutation check syncs the device (a sort and a comparison): it runs for a tensor the launcher has not
    seen, not again at every decode step; a new tensor is checked again."""
    from triton_ops import attention_args

    store = outlier_store((4,), 1 / 16, None)
    seg = dispatch._kernel_segment(store.segments[0])
    n_out, channels = seg[11]
    sorts = []
    original = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or original(self, *a, **k))
    attention_args._PERMUTATIONS.clear()
    for _ in range(3):
        attention_args._outlier_item((n_out, channels), 0, 4, channels.shape[0], D, channels.device)
    assert len(sorts) == 1
    attention_args._outlier_item((n_out, channels.clone()), 0, 4, channels.shape[0], D, channels.device)
    assert len(sorts) == 2
