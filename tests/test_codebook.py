"""Codebooks (CocktailConfig(codebook=...)): the anchored Lloyd-Max levels of INT2 / INT3 in the PyTorch reference
(the spec), split attention over such segments, and the config."""

import pytest
import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import quant
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .conftest import generate_split_and_sdpa


@pytest.mark.parametrize("bits", [2, 3])
def test_lloyd_levels_are_anchored_increasing_and_symmetric(bits):
    levels = quant.codebook_levels("lloyd", bits)
    qmax = (1 << bits) - 1
    assert len(levels) == qmax + 1 and levels[0] == 0.0 and levels[-1] == qmax
    assert all(a < b for a, b in zip(levels, levels[1:]))
    assert all(abs(a + b - qmax) < 1e-9 for a, b in zip(levels, reversed(levels)))
    assert quant.codebook_levels("uniform", bits) is None
    assert quant.codebook_levels("lloyd", 4) is None  # INT4 stays uniform
    with pytest.raises(ValueError, match=r"codebook must be one of \('uniform', 'lloyd'\), got 'nf4'"):
        quant.codebook_levels("nf4", bits)


def test_lloyd_codes_by_hand():
    """One value group of 8 channels, min 0 and max 7 (scale 1, zero 0): u = x; INT3 boundaries are the midpoints
    of (0, 1.29, 2.25, 3.09, 3.91, 4.75, 5.71, 7) = (0.645, 1.77, 2.67, 3.5, 4.33, 5.23, 6.355)."""
    x = torch.tensor([0.0, 0.6, 0.7, 1.8, 3.4, 3.6, 5.4, 7.0]).reshape(1, 1, 8)
    codes, scale, zero = quant.quantize_pack_values(x, 3, 8, torch.float32, codebook="lloyd")
    assert scale.item() == 1.0 and zero.item() == 0.0
    assert quant.unpack_codes(codes, 3).flatten().tolist() == [0, 0, 1, 2, 3, 4, 6, 7]
    uniform = quant.quantize_pack_values(x, 3, 8, torch.float32)[0]
    assert quant.unpack_codes(uniform, 3).flatten().tolist() == [0, 1, 1, 2, 3, 4, 5, 7]
    back = quant.dequantize_values(codes, scale, zero, 3, 8, codebook="lloyd")
    assert back.flatten().tolist() == pytest.approx([0, 0, 1.29, 2.25, 3.09, 3.91, 5.71, 7], abs=1e-6)
    # INT2 levels (0, 1.08, 1.92, 3): boundaries 0.54, 1.5, 2.46; min 0 and max 3
    y = torch.tensor([0.0, 0.5, 0.6, 1.4, 1.6, 2.4, 2.5, 3.0]).reshape(1, 1, 8)
    codes2 = quant.quantize_pack_values(y, 2, 8, torch.float32, codebook="lloyd")[0]
    assert quant.unpack_codes(codes2, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("bits", [2, 3])
def test_lloyd_keeps_extremes_and_bytes_and_lowers_gaussian_error(bits):
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(2, 96, 64, generator=g)
    out = {}
    for codebook in quant.CODEBOOKS:
        kc, ks, kz = quant.quantize_pack_keys(k, bits, 32, torch.float32, codebook=codebook)
        vc, vs, vz = quant.quantize_pack_values(k, bits, 64, torch.float32, codebook=codebook)
        keys = quant.dequantize_keys(kc, ks, kz, bits, 32, codebook=codebook)
        values = quant.dequantize_values(vc, vs, vz, bits, 64, codebook=codebook)
        out[codebook] = (kc.shape, vc.shape, (keys - k).pow(2).mean(), (values - k).pow(2).mean())
        chunks = keys.reshape(2, 3, 32, 64)  # the group's min and max stay exact (fp32 scales)
        ref = k.reshape(2, 3, 32, 64)
        torch.testing.assert_close(chunks.amax(2), ref.amax(2), atol=1e-5, rtol=0)
        torch.testing.assert_close(chunks.amin(2), ref.amin(2), atol=1e-5, rtol=0)
    assert out["lloyd"][:2] == out["uniform"][:2]  # same bytes
    assert out["lloyd"][2] < 0.97 * out["uniform"][2] and out["lloyd"][3] < 0.97 * out["uniform"][3]


def test_int4_segment_records_uniform_and_kernel_args_carry_levels():
    H, T, D = 2, 40, 16
    k, v = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    positions = [{"full": torch.arange(32, T), 4: torch.arange(0, 16), 3: torch.arange(16, 32)}]
    store = LayerStore.build(k, v, positions, 8, 8, torch.float16, codebook="lloyd")
    int4, int3 = store.segments
    assert (int4.bits, int4.codebook, int3.bits, int3.codebook) == (4, "uniform", 3, "lloyd")
    assert len(int4.kernel_args()) == 11
    levels = int3.kernel_args()[11]
    assert levels.dtype == torch.float32 and levels.tolist() == pytest.approx(quant.LLOYD_LEVELS[3])
    assert store.select([0, 0]).segments[1].codebook == "lloyd"


@pytest.mark.parametrize("bits", [2, 3])
def test_split_attention_over_lloyd_rotated_store_equals_sdpa_over_dequantized(bits):
    B, H, T, D, C, G = 2, 2, 70, 32, 8, 16
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    positions = [{"full": torch.arange(64, T), 4: torch.arange(0, 24), bits: torch.arange(24, 64)}] * B
    rot = Rotation.make("hadamard", H, D, seed=1)
    store = LayerStore.build(k, v, positions, C, G, torch.float32, rotation=rot, codebook="lloyd")
    query = torch.randn(B, 2 * H, 1, D, generator=g)
    out = split_precision_attention_torch(query, store, D**-0.5)
    keys, values = store.dequantized(positions, T, T)
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    uniform = LayerStore.build(k, v, positions, C, G, torch.float32, rotation=rot).dequantized(positions, T, T)
    assert not torch.equal(uniform[0], keys)  # the codebook changed the stored levels


@pytest.mark.parametrize("low_bits", [2, 3])
def test_generate_with_lloyd_codebook_split_equals_dequantized_sdpa(tiny_tokenizer, low_bits):
    cfg = CocktailConfig(
        chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", low_bits=low_bits, codebook="lloyd"
    )
    runs = generate_split_and_sdpa(tiny_tokenizer, cfg)
    for _, cache in runs.values():
        assert {16, 4, low_bits} == set(cache.precision_map()[0])
        assert [s.codebook for s in cache.layers[0].store.segments] == ["uniform", "lloyd"]
    (split, _), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)


def test_codebook_config_is_validated_and_serialized():
    with pytest.raises(ValueError, match=r"codebook must be one of \('uniform', 'lloyd'\), got 'Lloyd'"):
        CocktailConfig(codebook="Lloyd")
    cfg = CocktailConfig(codebook="lloyd", rotation="hadamard")
    assert CocktailConfig.from_dict(cfg.to_dict()).codebook == "lloyd"
    assert CocktailConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "codebook"}).codebook == "uniform"


def test_a_kernel_without_level_tables_falls_back_with_one_warning(monkeypatch):
    """A kernel package that does not declare LEVEL_TABLE_BITS for a codebook's bit width: dispatch quantizes and
    attends with the PyTorch reference (one warning each), with the reference's results."""
    cpu_ops = pytest.importorskip("cpu_ops")
    if not cpu_ops.available():
        pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    from hf_cocktail.decode import dispatch

    for op in ("attention", "quantize"):
        monkeypatch.setattr(getattr(cpu_ops, op), "LEVEL_TABLE_BITS", ())
    monkeypatch.setattr(dispatch, "_warned", set())
    dispatch._kernel_formats.cache_clear()
    try:
        H, T, D = 2, 48, 32
        k, v = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
        positions = [{"full": torch.arange(40, T), 4: torch.arange(0, 8), 3: torch.arange(8, 40)}]
        with pytest.warns(RuntimeWarning, match="cpu quantizer does not write 3-bit codes with codebook='lloyd'"):
            store = LayerStore.build(
                k, v, positions, 8, 16, torch.float16, *dispatch.quantizers("cpu", k.device), codebook="lloyd"
            )
        ref = LayerStore.build(k, v, positions, 8, 16, torch.float16, codebook="lloyd")
        assert all(
            torch.equal(a, b) for s, r in zip(store.segments, ref.segments) for a, b in zip(s.tensors(), r.tensors())
        )
        query = torch.randn(1, 2 * H, 1, D)
        with pytest.warns(RuntimeWarning, match=r"cpu kernel does not read these \(bits, codebook\) segments yet"):
            out = dispatch.split_precision_attention(query, store, D**-0.5, "cpu")
        torch.testing.assert_close(out, split_precision_attention_torch(query, store, D**-0.5), atol=0, rtol=0)
    finally:
        dispatch._kernel_formats.cache_clear()
