"""The Triton split-precision attention on the stored formats of the recommended settings, read as stored (8-bit
scale / zero codes decoded in registers, the 8-bit full part's int8 codes times their scales), for head dims 64, 128
and 256 and 1 to 8 KV heads, rotated or not; under TRITON_INTERPRET=1 without CUDA (the setup and helpers of
``test_triton_kernels``). The kernel equals the PyTorch reference within the project's rule (twice the reference's
own error against fp64, plus fp32 summation noise).

Shapes: H_kv key/value heads, D head dim.
"""

from __future__ import annotations

import re

import pytest
import torch

from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import params8
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation, shared_matrices

from .test_exact_head import exact_head_store
from .test_triton_kernels import DEV, _interpret, attention_sdpa, make_store, triton_ops  # noqa: F401

INTERPRET = not torch.cuda.is_available()


def coded_attention(query, store, scaling):
    """The Triton kernel as hf_cocktail.decode.dispatch calls it: codes, 8-bit parameter codes and int8 full part as
    stored."""
    return dispatch._triton_attention(query, store, scaling, query.dtype)


def check(query, store, scaling):
    out = coded_attention(query, store, scaling)
    assert out.dtype == query.dtype and out.shape == query.shape
    truth = attention_sdpa(query, store, scaling, torch.float64)
    low = split_precision_attention_torch(query, store, scaling)
    err = (out.double() - truth).abs().max().item()
    err_low = (low.double() - truth).abs().max().item()
    T = store.full.length + sum(s.num_tokens for s in store.segments)
    floor = torch.finfo(torch.float32).eps * T**0.5 * 8.0
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("H_kv", [1, 2, 8])
def test_8_bit_formats_every_head_dim_and_kv_heads(D, H_kv):
    """8-bit scales and zeros and the 8-bit full part read as stored; n_rep 4 for one KV head (Gemma 3 270M)."""
    store = make_store([5, 3], {4: [9, 16], 2: [12, 7]}, H_kv, D, 8, 32, scale_bits=8, full_part_bits=8, seed=D)
    assert isinstance(store.full, Int8FullPart) and all(
        s.coded_kernel_args()[4].dtype == torch.uint8 for s in store.segments
    )
    n_rep = 4 if H_kv == 1 else 2
    query = (torch.randn(2, H_kv * n_rep, 1, D, generator=torch.Generator().manual_seed(1)) * 2).to(DEV)
    check(query, store, D**-0.5)


@pytest.mark.parametrize("D,G", [(64, 64), (256, 64), (256, 128)])
@pytest.mark.parametrize("full_part_bits", [16, 8])
def test_recommended_value_groups_read_as_stored(D, G, full_part_bits):
    """``recommended()``'s format: INT4 keys and values, 8-bit scale / zero codes, values in groups of 64 channels
    (a compile-time constant of its own; 128 once), a 16- or 8-bit full part; Gemma 3 270M's and SmolLM2's head dims
    (the rotation is applied outside the kernel)."""
    H_kv = 1 if D == 256 else 3
    store = make_store([6, 2], {4: [23, 9]}, H_kv, D, 8, G, scale_bits=8, full_part_bits=full_part_bits, seed=G)
    assert {s.group_size for s in store.segments} == {G}
    query = torch.randn(2, H_kv * (4 if H_kv == 1 else 3), 1, D, generator=torch.Generator().manual_seed(3)) * 2
    query = query.to(DEV)
    check(query, store, D**-0.5)


@pytest.mark.parametrize("scale_bits,full_part_bits", [(8, 16), (16, 8), (16, 16)])
def test_each_format_alone(scale_bits, full_part_bits):
    store = make_store(
        [5, 9],
        {4: [17, 8], 3: [20, 11]},
        2,
        64,
        8,
        32,
        max_value_bits=3,
        scale_bits=scale_bits,
        full_part_bits=full_part_bits,
    )
    query = (torch.randn(2, 6, 2, 64, generator=torch.Generator().manual_seed(1)) * 2).to(DEV)
    check(query, store, 0.125)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("kind", ["hadamard", "hadamard_values"])
def test_rotated_8_bit_store_triton_equals_torch(D, kind):
    """The dispatcher's Triton path on a rotated store with both 8-bit formats equals the PyTorch reference."""
    store = make_store([5, 9], {4: [17, 8], 2: [20, 11]}, 1, D, 8, 32, scale_bits=8, full_part_bits=8)
    store.rotation = Rotation.make(kind, 1, D, seed=1, device=DEV)
    query = (torch.randn(2, 4, 1, D, generator=torch.Generator().manual_seed(2)) * 2).to(DEV)
    ref = split_precision_attention_torch(query, store, D**-0.5)
    out = dispatch.split_precision_attention(query, store, D**-0.5, "triton")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_8_bit_codes_need_blocks_table_and_scales():
    store = make_store([4, 2], {4: [9, 3], 2: [5, 8]}, 2, 64, 8, 32, scale_bits=8, full_part_bits=8)
    full, segs = store.full, [s.coded_kernel_args() for s in store.segments]
    query = torch.randn(2, 4, 1, 64).to(DEV)
    codes = full.split_path_tensors()
    scales = (full.scales.keys, full.scales.values)
    table = params8.scale_table(DEV)
    call = lambda *a, **kw: triton_ops.split_precision_attention(query, *a, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=re.escape("needs k_block and v_block as items 12 and 13, got 11 items")):
        call(*codes, full.start_tensor(), [segs[0][:11]], 0.1, full_scales=scales, scale_table=table)
    with pytest.raises(ValueError, match=re.escape("scale_table must be a float32 (256,) tensor")):
        call(*codes, full.start_tensor(), segs, 0.1, full_scales=scales)
    with pytest.raises(ValueError, match="full_keys are int8 codes"):
        call(*codes, full.start_tensor(), segs, 0.1, scale_table=table)
    with pytest.raises(ValueError, match=re.escape("full_scales[0] must be a float tensor of shape (2, 2, 4, 1)")):
        call(*codes, full.start_tensor(), segs, 0.1, full_scales=(scales[0][:1], scales[1]), scale_table=table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,H_kv,n_rep", [(256, 1, 4), (128, 8, 4), (64, 3, 3)])
def test_8_bit_formats_realistic_gpu(dtype, D, H_kv, n_rep):
    """~4K tokens per sequence with 8-bit scales and zeros and the 8-bit full part, in fp16/bf16: Gemma 3 270M's
    heads (D 256, one KV head, 4 query heads), Llama-3-8B's and SmolLM2's."""
    store = make_store(
        [420, 1300], {4: [1210, 2047], 2: [2466, 700]}, H_kv, D, 32, 32, dtype=dtype, scale_bits=8, full_part_bits=8
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(2, H_kv * n_rep, 1, D, generator=g, device="cuda").to(dtype)
    out = coded_attention(query, store, D**-0.5)
    truth = attention_sdpa(query, store, D**-0.5, torch.float64)
    low = attention_sdpa(query, store, D**-0.5, dtype)
    err, err_low = ((x.double() - truth).abs().max().item() for x in (out, low))
    assert err <= 2 * err_low, f"kernel error {err:.3g}, PyTorch error at {dtype} {err_low:.3g}"


@pytest.mark.parametrize("D,H_kv,L_q", [(64, 3, 1), (256, 1, 1), (128, 2, 3)])
def test_an_8_bit_full_part_with_keys_in_their_own_basis(D, H_kv, L_q):
    """The full part's keys stored times F (the layer's keys unrotated): the kernel scores them with the query of
    their own basis (``full_query``) and equals the reference; without it the scores are those of rotated keys
    against an unrotated query, far off (the argument is read)."""
    basis = shared_matrices(H_kv, D, 0, DEV)
    store = make_store(
        [40, 33], {4: [9, 16], 2: [12, 7]}, H_kv, D, 8, 32, scale_bits=8, full_part_bits=8, full_key_basis=basis
    )
    assert store.full.key_basis is basis
    query = (torch.randn(2, H_kv * 3, L_q, D, generator=torch.Generator().manual_seed(2)) * 2).to(DEV)
    check(query, store, D**-0.5)
    keys, values = store.full.split_path_tensors()
    args = (query, keys, values, store.full.start_tensor(), [dispatch._kernel_segment(s) for s in store.segments])
    kw = dict(full_scales=(store.full.scales.keys, store.full.scales.values), scale_table=params8.scale_table(DEV))
    wrong = triton_ops.split_precision_attention(*args, D**-0.5, **kw)
    right = triton_ops.split_precision_attention(*args, D**-0.5, full_query=store.full.key_query(query), **kw)
    torch.testing.assert_close(right, coded_attention(query, store, D**-0.5))
    assert (wrong - right).abs().max() > 0.05


@pytest.mark.parametrize("kind,basis", [(None, True), ("hadamard", False)])
@pytest.mark.parametrize("L_q", [1, 2])
def test_an_8_bit_full_part_with_an_exact_head(kind, basis, L_q):
    """Each sequence's first 4 tokens read from the exact head (:mod:`hf_cocktail.storage.exact_head`), with and
    without the part's own key basis, sequences starting at different places of the part."""
    store, _, _ = exact_head_store(kind, D=64, basis=basis, device=DEV)
    assert store.full.start[0] != store.full.start[1]
    store.append(torch.randn(2, 2, L_q, 64).to(DEV), torch.randn(2, 2, L_q, 64).to(DEV))
    query = (torch.randn(2, 4, L_q, 64, generator=torch.Generator().manual_seed(5)) * 2).to(DEV)
    check(query, store, 64**-0.5)


def test_the_exact_head_is_read_across_splits():
    """Splits of 16 tokens with a 20-token head starting at different places of them (left padding); without the
    head argument the result differs (the argument is read)."""
    store, _, _ = exact_head_store(None, lengths=(70, 50), S=20, D=64, basis=True, device=DEV)
    full = store.full
    assert full.head.count == 20 and full.start == [3, 0]
    query = (torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(5)) * 4).to(DEV)
    segments = [dispatch._kernel_segment(s) for s in store.segments]
    args = (query, *full.split_path_tensors(), full.start_tensor(), segments, 64**-0.5)
    kw = dict(full_scales=(full.scales.keys, full.scales.values), full_query=full.key_query(query), tokens_per_split=16)
    ref = split_precision_attention_torch(query, store, 64**-0.5)
    right = triton_ops.split_precision_attention(*args, full_head=(full.head.keys, full.head.values), **kw)
    torch.testing.assert_close(right, ref, atol=1e-5, rtol=1e-4)
    assert (triton_ops.split_precision_attention(*args, **kw) - right).abs().max() > 1e-4
