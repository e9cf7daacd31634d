"""8-bit scales and zeros (CocktailConfig(scale_bits=8)): the code -> number spec on a hand-built block, its bounds
on random groups, the store (bytes, select, dequantization), split attention over such segments (PyTorch reference
and the fused CPU kernel), generation, the config and its bytes."""

import dataclasses

import pytest
import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import params8, quant
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore, PackedSegment

from .conftest import assert_fused_cpu_kernel_matches_reference, cpu_kernel_low_precision, generate_split_and_sdpa


def test_params8_of_a_hand_built_block():
    """Two 2-bit groups: minima 0 and 255 (z_step = 1), needed scales 1 and 0.5 (codes 0 and 16 = one octave)."""
    mn, mx = torch.tensor([[0.0, 255.0]]), torch.tensor([[3.0, 256.5]])
    sc, zc, block = params8.encode_params8(mn, mx, 2, torch.float32)
    assert sc.tolist() == [[0, 16]] and zc.tolist() == [[0, 255]]
    assert block.tolist() == [[1.0, 0.0, 1.0]]  # s_max, z_lo, z_step
    scale, zero = params8.decode_params8(sc, zc, block)
    assert scale.tolist() == [[1.0, 0.5]] and zero.tolist() == [[0.0, 255.0]]


def test_params8_of_a_constant_block_are_zero_scales():
    sc, zc, block = params8.encode_params8(torch.full((2, 3), 1.5), torch.full((2, 3), 1.5), 4, torch.float16)
    scale, zero = params8.decode_params8(sc, zc, block)
    assert torch.equal(scale, torch.zeros_like(scale)) and torch.equal(zero, torch.full_like(zero, 1.5))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_params8_are_the_nearest_codes(bits):
    """Decoded zeros lie within half a z_step of the group's min, decoded scales within a factor 2 ** (1 / 32) of
    what the group's max needs from that zero (fp32 storage: no rounding of the block's numbers), and both are the
    nearest: the neighbouring codes are farther."""
    g = torch.Generator().manual_seed(bits)
    mn = torch.randn(40, 64, generator=g) * 3
    mx = mn + torch.rand(40, 64, generator=g) * 4 + 0.01
    sc, zc, block = params8.encode_params8(mn, mx, bits, torch.float32)
    scale, zero = params8.decode_params8(sc, zc, block)
    z_step = block[:, 2:3]
    assert bool(((zero - mn).abs() <= z_step / 2 + 1e-5).all())
    qmax = (1 << bits) - 1
    need = (mx - zero) / qmax  # a group whose max lies below its rounded zero needs none: code 255, the least scale
    coded = need > block[:, :1] * 2**-15  # the groups whose need the table's 256 codes reach
    assert bool((scale[~coded] <= block[:, :1].expand_as(scale)[~coded] * 2**-15).all())
    log_err = torch.log2(scale[coded] / need[coded])
    assert bool((log_err.abs() <= 1 / 32 + 1e-5).all())
    assert float((zero - mn).abs().mean()) < float(z_step.mean()) / 3  # not all rounded one way (floor: ~1/2)
    assert -0.005 < float(log_err.mean()) < 0.005  # as many scales rounded down as up (rounding up: ~+1/32)


def _nearest_and_refined_keys(bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 16, 32, generator=g) * torch.rand(1, 1, 1, 32, generator=g) * 4  # (H, M, C, D)
    sc, zc, block = params8.encode_params8(x.amin(2), x.amax(2), bits, torch.float16)
    rsc, rzc, _ = params8.refine_codes(x, 2, sc, zc, block, bits)
    return x, (sc, zc), (rsc, rzc), block


def _group_errors(x, codes, block, bits):
    scale, zero = (t.unsqueeze(2) for t in params8.decode_params8(*codes, block))
    return (quant.group_codes(x, scale, zero, bits).float() * scale + zero - x).square().sum(2)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_refined_codes_are_the_best_neighbours(bits):
    """Every group's refined pair lies within one code of the nearest pair, reconstructs the group with no more
    squared error, and with the least error of the nine candidates (checked one candidate at a time); most groups
    gain, and the segment's error falls."""
    x, nearest, refined, block = _nearest_and_refined_keys(bits, seed=bits)
    for near, ref in zip(nearest, refined):
        assert int((near.int() - ref.int()).abs().max()) <= 1
    err_near, err_ref = _group_errors(x, nearest, block, bits), _group_errors(x, refined, block, bits)
    assert bool((err_ref <= err_near).all())
    for dz, ds in params8.REFINE_STEPS:
        sc = (nearest[0].int() + ds).clamp(0, 255).to(torch.uint8)
        zc = (nearest[1].int() + dz).clamp(0, 255).to(torch.uint8)
        assert bool((err_ref <= _group_errors(x, (sc, zc), block, bits)).all())
    assert float((err_ref < err_near).float().mean()) > 0.3
    assert float(err_ref.sum()) < 0.95 * float(err_near.sum())


def test_refining_a_slice_at_a_time_gives_the_codes_of_one_slice(monkeypatch):
    """Keys and values (whose blocks are read by row) refined in slices of a few rows give the codes of one slice."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 70, 32, generator=g) * 3, torch.randn(2, 70, 32, generator=g)
    whole = (
        params8.quantize_pack_keys8(k, 3, 8, torch.float16),
        params8.quantize_pack_values8(v, 2, 16, torch.float16, chunk_size=8),
    )
    monkeypatch.setattr(params8, "REFINE_SLICE_ELEMENTS", 100)  # 1 chunk of keys, 3 tokens of values a slice
    sliced = (
        params8.quantize_pack_keys8(k, 3, 8, torch.float16),
        params8.quantize_pack_values8(v, 2, 16, torch.float16, chunk_size=8),
    )
    for a, b in zip(whole, sliced):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_refining_keeps_the_nearest_codes_on_a_tie():
    """A block of constant groups is given back exactly by all nine candidates (z_step is 0, every code 0): the
    nearest codes stay."""
    x = torch.full((2, 3, 8, 4), 1.5)
    sc, zc, block = params8.encode_params8(x.amin(2), x.amax(2), 4, torch.float16)
    for dz, ds in params8.REFINE_STEPS:
        near = (sc.int() + ds).clamp(0, 255).to(torch.uint8), (zc.int() + dz).clamp(0, 255).to(torch.uint8)
        assert float(_group_errors(x, near, block, 4).max()) == 0.0
    rsc, rzc, _ = params8.refine_codes(x, 2, sc, zc, block, 4)
    assert torch.equal(rsc, sc) and torch.equal(rzc, zc)


def _store(scale_bits, rotation=None, B=2, T=72, H=2, D=32, C=8, G=16, scale_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g) + 2, torch.randn(B, H, T, D, generator=g)
    positions = [
        {"full": torch.arange(60 + b, T), 4: torch.arange(0, 20 + b), 3: torch.arange(20 + b, 60 + b)} for b in range(B)
    ]
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    store = LayerStore.build(k, v, positions, C, G, scale_dtype, rotation=rot, max_value_bits=3, scale_bits=scale_bits)
    return store, positions, (k, v)


def test_store_keeps_codes_and_blocks_and_halves_the_parameter_bytes():
    s8, positions, (k, v) = _store(8)
    s16, _, _ = _store(16)
    H, D, C, G = 2, 32, 8, 16
    for seg8, seg16 in zip(s8.segments, s16.segments):
        assert seg8.scale_bits == 8 and seg16.scale_bits == 16
        M, N = seg8.chunk_off[-1], seg8.num_tokens
        assert seg8.k_scale.dtype == torch.uint8 and seg8.k_block.shape == (H, M, 3)
        assert seg8.v_block.shape == (H, M, 3) and seg8.v_scale.shape == (H, N, D // G)
        assert seg8.nbytes_params() == 2 * H * M * D + 2 * H * N * (D // G) + 2 * (2 * H * M * 3)
        assert seg16.nbytes_params() == 2 * 2 * H * M * D + 2 * 2 * H * N * (D // G)
    # the INT4 keys of sequence 1 are the 8-bit-parameter reference's for its own tokens
    kk = k[1].index_select(1, positions[1][4])
    codes, sc, zc, block = params8.quantize_pack_keys8(kk, 4, C, torch.float16)
    ref = quant.dequantize_keys(codes, *params8.decode_params8(sc, zc, block), 4, C)
    assert torch.equal(s8.segments[0].sequence(1)[0], ref)


def test_select_and_dequantize_agree_with_the_sequences():
    store, positions, (k, v) = _store(8)
    keys, values = store.dequantized(positions, 72, 72)
    picked = store.select([1, 0, 1])
    keys2, values2 = picked.dequantized([positions[1], positions[0], positions[1]], 72, 72)
    assert torch.equal(keys2[0], keys[1]) and torch.equal(values2[2], values[1]) and torch.equal(keys2[1], keys[0])
    fp16_keys, fp16_values = _store(16)[0].dequantized(positions, 72, 72)
    for x8, x16, x in ((keys, fp16_keys, k), (values, fp16_values, v)):  # about the error of fp16 parameters
        err8, err16 = (x8 - x).abs().mean(), (x16 - x).abs().mean()
        assert 0.8 * err16 < err8 < 1.25 * err16, (err8, err16)


@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_split_attention_equals_sdpa_over_the_dequantized_cache(rotation):
    store, positions, _ = _store(8, rotation)
    B, H, T, D = 2, 2, 72, 32
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(5))
    out = split_precision_attention_torch(query, store, D**-0.5)
    keys, values = store.dequantized(positions, T, T)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, keys.float(), values.float(), scale=D**-0.5, enable_gqa=True
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_fused_cpu_kernel_equals_the_reference():
    store, _, _ = _store(8, "hadamard")
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5))
    assert_fused_cpu_kernel_matches_reference(store, query, 32**-0.5)


def test_an_empty_segment_gives_empty_fp32_numbers_to_the_kernels():
    """A uniform setting leaves the low segment empty at every decode step: nothing is decoded, the kernels get empty
    fp32 numbers, and attention over the store still equals the reference."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    positions = [{"full": torch.arange(32, 40), 4: torch.arange(0, 32), 2: torch.arange(0)}]
    store = LayerStore.build(k, v, positions, 8, 16, torch.float16, scale_bits=8)
    empty = store.segments[1]
    assert empty.num_tokens == 0
    assert [(t.dtype, tuple(t.shape)) for t in empty.tensors()[1:3]] == [(torch.float32, (2, 0, 32))] * 2
    query = torch.randn(1, 4, 1, 32, generator=g)
    ref = split_precision_attention_torch(query, store, 32**-0.5)
    keys, values = store.dequantized(positions, 40, 40)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=32**-0.5, enable_gqa=True)
    torch.testing.assert_close(ref, sdpa, atol=2e-5, rtol=1e-4)
    cpu_ops = pytest.importorskip("cpu_ops")
    if cpu_ops.available():
        out = dispatch.split_precision_attention(query, store, 32**-0.5, "cpu")
        sdpa16 = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            query.half(), keys.half(), values.half(), scale=32**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(out, ref, atol=2e-6 + cpu_kernel_low_precision(ref.double(), sdpa16), rtol=1e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_cpu_decoder_equals_the_reference(scale_dtype):
    """cpu_ops.decode_params8 gives the reference's fp32 numbers bit for bit, for key blocks (one per row) and value
    blocks (a row -> block map over two sequences, the first ending in a partial chunk)."""
    cpu_ops = pytest.importorskip("cpu_ops")
    if not cpu_ops.available():
        pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(2, n, 32, generator=g) * 4 + 1 for n in (45, 24)]
    seg = PackedSegment.from_sequences(ks, [x.flip(1) for x in ks], 4, 8, 16, scale_dtype, value_bits=3, scale_bits=8)
    table = params8.scale_table("cpu")
    fused = seg.tensors(lambda *a: cpu_ops.decode_params8(*a, table=table))
    for got, want in zip(fused, seg.tensors()):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert fused[1].dtype == torch.float32
    with pytest.raises(ValueError, match="table must be the float32"):
        cpu_ops.decode_params8(seg.k_scale, seg.k_zero, seg.k_block, table=table.double())
    rows = seg._token_chunks().clone()
    rows[3] = seg.v_block.shape[1]  # one past the last block: refused, never read
    with pytest.raises(IndexError, match=r"block_of_row holds \d+, not in \[0, \d+\)"):
        cpu_ops.decode_params8(seg.v_scale, seg.v_zero, seg.v_block, rows, table=table)


def test_generate_split_equals_dequantized_sdpa(tiny_tokenizer):
    cfg = CocktailConfig(
        chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", low_bits=3, value_bits=3, scale_bits=8
    )
    runs = generate_split_and_sdpa(tiny_tokenizer, cfg)
    for _, cache in runs.values():
        assert [s.scale_bits for s in cache.layers[0].store.segments] == [8, 8]
    (split, _), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [4, 32, "8", 8.0, None])
def test_scale_bits_is_validated(bad):
    with pytest.raises(ValueError, match=rf"scale_bits must be one of \(16, 8\), got {bad!r}"):
        CocktailConfig(scale_bits=bad)


def test_bits_per_element_counts_8_bit_parameters():
    """C = 32, G = 64: fp16 parameters cost 16/32 + 16/64 bits per element on average, 8-bit ones half that."""
    cfg = CocktailConfig(uniform_bits=4, value_bits=3, group_size=64)
    assert cfg.packed_bits_per_element(4) == 3.5 + 0.75
    cfg8 = CocktailConfig(uniform_bits=4, value_bits=3, group_size=64, scale_bits=8)
    assert cfg8.packed_bits_per_element(4) == 3.5 + 0.375
    assert CocktailConfig.from_dict(cfg8.to_dict()) == cfg8


def test_segment_refuses_half_8_bit_parameters():
    seg = _store(8)[0].segments[0]
    with pytest.raises(ValueError, match="k_block and v_block come together"):
        dataclasses.replace(seg, v_block=None)


def test_segment_refuses_other_parameter_widths():
    with pytest.raises(ValueError, match=r"scale_bits must be one of \(16, 8\), got 4"):
        PackedSegment.from_sequences(
            [torch.randn(1, 8, 16)], [torch.randn(1, 8, 16)], 4, 8, 8, torch.float32, scale_bits=4
        )


def test_model_card_says_the_parameters_width():
    from hf_cocktail.presets.model_card import make_model_card

    assert "(`scale_bits=8`)" in make_model_card(CocktailConfig(scale_bits=8))
    assert "8-bit codes on three numbers" not in make_model_card(CocktailConfig())


def test_unrefined_keys_keep_the_nearest_codes_and_refining_lowers_their_error():
    """``refine=False`` (the rotation choice's estimate): the nearest scale and zero codes, every key coded under
    them; the refined store's squared error is no larger."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 40, 16, generator=g) * torch.linspace(0.5, 4, 16)
    C, bits = 8, 3
    codes, sc, zc, block = params8.quantize_pack_keys8(k, bits, C, torch.float16, refine=False)
    x = k.reshape(2, 5, C, 16)
    sc0, zc0, block0 = params8.encode_params8(x.amin(2), x.amax(2), bits, torch.float16)
    assert torch.equal(sc, sc0) and torch.equal(zc, zc0) and torch.equal(block, block0)
    scale, zero = params8.decode_params8(sc0, zc0, block0)
    want = quant.group_codes(x, scale.unsqueeze(2), zero.unsqueeze(2), bits).reshape(2, 40, 16)
    assert torch.equal(codes, quant.pack_codes(want, bits))
    nearest = params8.round_trip_keys(k, bits, C, 8, torch.float16, refine=False)
    refined = params8.round_trip_keys(k, bits, C, 8, torch.float16)
    assert float((refined - k).square().sum()) < float((nearest - k).square().sum())
