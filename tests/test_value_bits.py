"""Values at fewer code bits than keys (CocktailConfig(value_bits=...)): the config and its bytes, the store, split
attention over such segments (PyTorch reference and the fused CPU kernel) and generation."""

import dataclasses

import pytest
import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import quant
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore, PackedSegment

from .conftest import assert_fused_cpu_kernel_matches_reference, generate_split_and_sdpa


@pytest.mark.parametrize("bad", [1, 5, "3", True, 3.0])
def test_value_bits_is_validated(bad):
    with pytest.raises(ValueError, match=rf"value_bits must be one of None, 2, 3, 4, got {bad!r}"):
        CocktailConfig(value_bits=bad)


def test_value_bits_round_trips():
    cfg = CocktailConfig(value_bits=3, low_bits=3, rotation="hadamard")
    assert CocktailConfig.from_dict(cfg.to_dict()) == cfg
    assert CocktailConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "value_bits"}).value_bits is None
    with pytest.raises(ValueError, match="value_bits must be one of"):
        cfg.value_bits = 6
    assert cfg.value_bits == 3  # a refused assignment is not kept


def test_bits_per_element_counts_the_values_at_their_width():
    """C = G = 32, fp16 scales: keys and values pay 1 bit each for scales/zeros; codes average (keys + values) / 2."""
    cfg = CocktailConfig(value_bits=3)
    assert [cfg.chunk_value_bits(b) for b in (4, 3, 2)] == [3, 3, 2]
    assert cfg.packed_bits_per_element(4) == 3.5 + 1.0
    assert cfg.packed_bits_per_element(2) == CocktailConfig().packed_bits_per_element(2) == 3.0
    # target_bits' lower bound is all-low at the low width: INT3 with value_bits=2 costs (3 + 2) / 2 + 1
    assert CocktailConfig(low_bits=3, value_bits=2).packed_bits_per_element(3) == 3.5
    with pytest.raises(ValueError, match=r"target_bits must be None or a number in \[3.5, 16\]"):
        CocktailConfig(low_bits=3, value_bits=2, target_bits=3.4)


def _store(max_value_bits, rotation=None, B=1, T=72, H=2, D=32, C=8, G=16, scale_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    positions = [{"full": torch.arange(64, T), 4: torch.arange(0, 24), 3: torch.arange(24, 64)}] * B
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    store = LayerStore.build(k, v, positions, C, G, scale_dtype, rotation=rot, max_value_bits=max_value_bits)
    return store, positions, (k, v)


def test_store_packs_values_at_their_width_and_keys_at_the_chunks():
    store, positions, (k, v) = _store(max_value_bits=2)
    int4, int3 = store.segments
    assert [(s.bits, s.value_bits, s.code_bits) for s in store.segments] == [(4, 2, (4, 2)), (3, 2, (3, 2))]
    D = k.shape[-1]
    assert int4.k_codes.shape[-1] == D // 2 and int4.v_codes.shape[-1] == D // 4
    assert int3.k_codes.shape[-1] == D * 3 // 8 and int3.v_codes.shape[-1] == D // 4
    assert int4.kernel_args()[0] == (4, 2)
    # the values are the 2-bit reference's, the keys the 4-bit / 3-bit reference's
    vk = v[0].index_select(1, positions[0][4])
    kk = k[0].index_select(1, positions[0][4])
    assert torch.equal(int4.v_codes, quant.quantize_pack_values(vk, 2, 16, torch.float32)[0])
    assert torch.equal(int4.k_codes, quant.quantize_pack_keys(kk, 4, 8, torch.float32)[0])
    assert int4.select([0, 0]).value_bits == 2
    same, _, _ = _store(max_value_bits=4)
    assert [(s.bits, s.value_bits, s.code_bits) for s in same.segments] == [(4, 4, 4), (3, 3, 3)]
    assert store.nbytes() < same.nbytes()


def test_segment_refuses_values_wider_than_keys():
    store, _, _ = _store(max_value_bits=None)
    seg = store.segments[1]
    with pytest.raises(ValueError, match=r"value_bits must be one of \(2, 3\) for 3-bit keys, got 4"):
        dataclasses.replace(seg, value_bits=4)
    with pytest.raises(ValueError, match=r"value_bits must be one of \(2, 3, 4\) for 4-bit keys, got 1"):
        PackedSegment.from_sequences(
            [torch.randn(1, 8, 16)], [torch.randn(1, 8, 16)], 4, 8, 8, torch.float32, value_bits=1
        )


@pytest.mark.parametrize("rotation", [None, "hadamard"])
@pytest.mark.parametrize("max_value_bits", [3, 2])
def test_split_attention_equals_sdpa_over_the_dequantized_cache(rotation, max_value_bits):
    store, positions, _ = _store(max_value_bits, rotation, B=2)
    B, H, T, D = 2, 2, 72, 32
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(5))
    out = split_precision_attention_torch(query, store, D**-0.5)
    keys, values = store.dequantized(positions, T, T)
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    wide_keys, wide_values = _store(None, rotation, B=2)[0].dequantized(positions, T, T)
    assert torch.equal(wide_keys, keys) and not torch.equal(wide_values, values)  # only the values lost bits


@pytest.mark.parametrize("max_value_bits", [3, 2])
def test_fused_cpu_kernel_equals_the_reference(max_value_bits):
    store, _, _ = _store(max_value_bits, "hadamard", B=2, scale_dtype=torch.float16)
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5))
    assert_fused_cpu_kernel_matches_reference(store, query, 32**-0.5)


@pytest.mark.parametrize("low_bits, value_bits", [(3, 3), (2, 2), (3, 2)])
def test_generate_split_equals_dequantized_sdpa(tiny_tokenizer, low_bits, value_bits):
    cfg = CocktailConfig(
        chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", low_bits=low_bits, value_bits=value_bits
    )
    runs = generate_split_and_sdpa(tiny_tokenizer, cfg)
    for _, cache in runs.values():
        assert {16, 4, low_bits} == set(cache.precision_map()[0])
        segments = cache.layers[0].store.segments
        assert [(s.bits, s.value_bits) for s in segments] == [(4, value_bits), (low_bits, min(low_bits, value_bits))]
    (split, _), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)


def test_model_card_says_the_values_width():
    from hf_cocktail.presets.model_card import make_model_card

    card = make_model_card(CocktailConfig(value_bits=3, low_bits=3, rotation="hadamard"))
    assert "Values get at most 3 bits (`value_bits=3`; keys keep their chunk's bits)." in card
    assert "Values get at most" not in make_model_card(CocktailConfig())
