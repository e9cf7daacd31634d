"""The 8-bit full part (CocktailConfig(full_part_bits=8)): the per-token int8 codec on hand-built and random vectors,
the part (append, crop, rows, bytes), split attention over a store that holds one (PyTorch reference and the fused
CPU kernel), generation, the memory report and the config."""

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage import quant
from hf_cocktail.storage.full_part import FullPart, Int8FullPart, full_part_from_sequences
from hf_cocktail.storage.rotation import Rotation, full_part_key_basis
from hf_cocktail.storage.store import LayerStore

from .conftest import (
    FakeEncoder,
    assert_fused_cpu_kernel_matches_reference,
    generate_split_and_sdpa,
    make_prompt,
    make_tiny_llama,
)


def test_codes_of_a_hand_built_vector():
    """absmax 63.5 -> scale 0.5; -31.75 / 0.5 = -63.5 and 0.25 / 0.5 = 0.5 round half to even."""
    x = torch.tensor([[63.5, -31.75, 0.25, 0.0]])
    codes, scale = quant.quantize_tokens8(x, torch.float16)
    assert codes.dtype == torch.int8 and codes.tolist() == [[127, -64, 0, 0]]
    assert scale.dtype == torch.float16 and scale.tolist() == [[0.5]]
    assert quant.dequantize_tokens8(codes, scale, torch.float32).tolist() == [[63.5, -32.0, 0.0, 0.0]]


def test_a_zero_vector_gets_zero_codes_and_scale():
    codes, scale = quant.quantize_tokens8(torch.zeros(2, 3, 8), torch.float16)
    assert not codes.any() and not scale.any()
    assert not quant.dequantize_tokens8(codes, scale, torch.float32).any()


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_element_lies_within_half_a_step(scale_dtype):
    """|x - dequant| <= scale / 2 (the scale as stored), and the stored scale covers the vector's absmax."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 64, generator=g) * torch.rand(3, 40, 1, generator=g) * 10
    codes, scale = quant.quantize_tokens8(x, scale_dtype)
    err = (quant.dequantize_tokens8(codes, scale, torch.float32) - x).abs()
    s = scale.float()
    assert bool((err <= s / 2 + 1e-6 * x.abs().amax(-1, keepdim=True)).all())
    assert codes.abs().max() <= 127
    clipped = (codes.abs() == 127) & ((x.abs() - 127 * s) > s / 2)
    assert not clipped.any()  # a rounded-down scale loses at most half a step at the extreme


def test_overflow_and_non_finite_states_are_refused():
    with pytest.raises(ValueError, match=r"overflow scale_dtype=torch.float16"):
        quant.quantize_tokens8(torch.full((1, 4), 1e7), torch.float16)
    with pytest.raises(ValueError, match="contain NaN or inf"):
        quant.quantize_tokens8(torch.tensor([[1.0, float("nan")]]), torch.float16)


def _sequences(lengths=(5, 9), H=2, D=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(H, n, D, generator=g) * 3 for n in lengths]
    return ks, [k.flip(1) - 1 for k in ks]


def test_the_part_holds_each_sequence_right_aligned_and_dequantizes_to_the_reference():
    ks, vs = _sequences()
    part = full_part_from_sequences(ks, vs, 8, torch.float16)
    assert isinstance(part, Int8FullPart) and part.start == [4, 0] and part.shape == (2, 2, 9, 16)
    keys, values = part.keys, part.values
    assert keys.dtype == torch.float32 and not keys[0, :, :4].any()  # left padding: zeros
    for b, (k, v) in enumerate(zip(ks, vs)):
        s = part.start[b]
        assert torch.equal(keys[b, :, s:], quant.dequantize_tokens8(*quant.quantize_tokens8(k, torch.float16), k.dtype))
        assert torch.equal(
            values[b, :, s:], quant.dequantize_tokens8(*quant.quantize_tokens8(v, torch.float16), v.dtype)
        )
    assert part.valid_tokens() == 14
    # keys and values (B=2, H=2, R=9, D=16, padding slots included): 1 byte per code, one float16 scale per token
    assert part.nbytes() == part.deployed_bytes() == 2 * (2 * 2 * 9 * 16) + 2 * (2 * 2 * 9) * 2


def test_append_crop_and_rows_equal_quantizing_the_whole_part():
    ks, vs = _sequences()
    g = torch.Generator().manual_seed(2)
    new = [(torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)) for n in (1, 3, 70)]
    part = Int8FullPart.from_sequences(ks, vs, torch.float16)
    for k, v in new:
        part.append(k, v)
    whole_k = [torch.cat([ks[b], *(k[b] for k, _ in new)], dim=1) for b in range(2)]
    whole_v = [torch.cat([vs[b], *(v[b] for _, v in new)], dim=1) for b in range(2)]
    ref = Int8FullPart.from_sequences(whole_k, whole_v, torch.float16)
    assert torch.equal(part.keys, ref.keys) and torch.equal(part.values, ref.values) and part.length == 83
    assert part.reserved_bytes() > 0  # room for the next tokens, outside the counted bytes
    assert part.nbytes() == ref.nbytes()
    part.truncate(70)
    assert part.length == 13 and torch.equal(part.keys, ref.keys[:, :, :13])
    rows = part.select([1, 1, 0])
    assert (
        rows.start == [0, 0, 4]
        and torch.equal(rows.keys[2], part.keys[0])
        and torch.equal(rows.values[0], part.values[1])
    )


def test_sixteen_bits_is_the_model_precision_part_and_other_widths_are_refused():
    ks, vs = _sequences()
    part = full_part_from_sequences(ks, vs, 16, torch.float16)
    assert isinstance(part, FullPart) and torch.equal(part.keys[1], ks[1])
    assert part.deployed_bytes() == 2 * 2 * (2 * 2 * 9 * 16)
    with pytest.raises(ValueError, match=r"full_part_bits must be one of \(16, 8\), got 4"):
        full_part_from_sequences(ks, vs, 4, torch.float16)


def _store(full_part_bits, rotation=None, B=2, T=72, H=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g) + 2, torch.randn(B, H, T, D, generator=g)
    positions = [
        {"full": torch.arange(60 + b, T), 4: torch.arange(0, 20 + b), 2: torch.arange(20 + b, 60 + b)} for b in range(B)
    ]
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    basis = full_part_key_basis(full_part_bits, rot)  # as a cache gives it (unrotated keys beside rotated values)
    store = LayerStore.build(
        k, v, positions, 8, 16, torch.float16, rotation=rot, full_part_bits=full_part_bits, full_key_basis=basis
    )
    return store, positions, (k, v)


@pytest.mark.parametrize("rotation", [None, "hadamard", "hadamard_values"])
def test_split_attention_equals_sdpa_over_the_dequantized_cache(rotation):
    store, positions, (k, _) = _store(8, rotation)
    assert isinstance(store.full, Int8FullPart)
    store.append(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32))
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5))
    out = split_precision_attention_torch(query, store, 32**-0.5)
    keys, values = store.dequantized(positions, 73, 72)
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=32**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    full_k = store.dequantized(positions, 73, 72)[0][0, :, positions[0]["full"]]
    exact = _store(16, rotation)[0].dequantized(positions, 72, 72)[0][0, :, positions[0]["full"]]
    assert 0 < (full_k - exact).abs().max() < 0.05  # 8-bit codes: near, not equal


def test_fused_cpu_kernel_equals_the_reference():
    store, _, _ = _store(8, "hadamard")
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5))
    assert_fused_cpu_kernel_matches_reference(store, query, 32**-0.5)


def test_generate_split_equals_dequantized_sdpa_and_reports_the_bytes(tiny_tokenizer):
    base = dict(chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", full_precision_layers=(1,))
    runs = generate_split_and_sdpa(tiny_tokenizer, CocktailConfig(**base, full_part_bits=8))
    (split, cache), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert isinstance(cache.layers[0].store.full, Int8FullPart)
    assert isinstance(cache.layers[1].store.full, FullPart)  # a full-precision layer stays at the model's precision
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)
    rep8 = cache.memory_report()
    rep16 = generate_split_and_sdpa(tiny_tokenizer, CocktailConfig(**base))["cocktail"][1].memory_report()
    full = cache.layers[0].store.full
    B, H, _, D = full.shape
    R = full.codes._buffers[0].shape[2]  # the tokens and the room for appended ones (the same in both runs)
    saved = 2 * B * H * R * (2 * D - (D + 2))  # keys and values of layer 0: 2 bytes -> 1 byte + a 2-byte scale per D
    assert full.head is not None and full.head.count == 4  # the sink tokens, also at the model's precision
    saved -= full.head.deployed_bytes()
    assert rep16["fp16_equivalent_bytes"] == rep8["fp16_equivalent_bytes"]
    assert rep16["ratio_to_fp16"] * rep16["fp16_equivalent_bytes"] - saved == pytest.approx(
        rep8["ratio_to_fp16"] * rep8["fp16_equivalent_bytes"]
    )


def test_beams_and_crop_keep_the_8_bit_part(tiny_tokenizer):
    """Beam search reorders rows (select) and crops nothing at the end; the result equals the dequantized path."""
    cfg = CocktailConfig(chunk_size=8, group_size=16, uniform_bits=4, rotation="hadamard", full_part_bits=8)
    runs = {}
    prompt, ctx, q = make_prompt(100, needle_at=50)
    for attn in ("cocktail", "sdpa"):
        model = make_tiny_llama(attn=attn, head_dim=32)
        cache = CocktailCache(cfg, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        runs[attn] = model.generate(
            **inputs, **cache_kwargs(model, cache), max_new_tokens=4, num_beams=2, do_sample=False
        )
        full = cache.layers[0].store.full
        n, keys, values = cache.get_seq_length(), full.keys, full.values
        cache.crop(-2)
        assert isinstance(full, Int8FullPart) and cache.get_seq_length() == n - 2
        assert torch.equal(full.keys, keys[:, :, :-2]) and torch.equal(full.values, values[:, :, :-2])
    assert torch.equal(runs["cocktail"], runs["sdpa"])


@pytest.mark.parametrize("bad", [4, 32, "8", 8.0, None])
def test_full_part_bits_is_validated(bad):
    with pytest.raises(ValueError, match=rf"full_part_bits must be one of \(16, 8\), got {bad!r}"):
        CocktailConfig(full_part_bits=bad)


def test_the_config_round_trips():
    cfg = CocktailConfig(full_part_bits=8)
    assert CocktailConfig.from_dict(cfg.to_dict()) == cfg and CocktailConfig().full_part_bits == 16


def test_model_card_says_how_the_full_part_and_salient_tokens_are_stored():
    from hf_cocktail.presets.model_card import make_model_card

    card = make_model_card(CocktailConfig(full_part_bits=8, salient_tokens=0.01))
    assert "the first 4 tokens (attention sinks) stay at full precision." in card
    assert "(`full_part_bits=8`)" in card and '(`salient_tokens=0.01`; needs `attn_implementation="cocktail"`)' in card
    plain = make_model_card(CocktailConfig())
    assert "full_part_bits=8" not in plain and "salient_tokens=" not in plain


def test_the_part_is_dequantized_once_per_layer_and_decode_step(tiny_tokenizer, monkeypatch):
    """On the split path ``update`` hands out the codes; only the attention dequantizes (keys and values once)."""
    calls = []
    real = quant.dequantize_tokens8
    monkeypatch.setattr(quant, "dequantize_tokens8", lambda *a: calls.append(1) or real(*a))
    cfg = CocktailConfig(chunk_size=8, group_size=16, uniform_bits=4, backend="torch", full_part_bits=8)
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    cache = CocktailCache(cfg, encoder=FakeEncoder())
    prompt, ctx, q = make_prompt(100, needle_at=50)
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=5, do_sample=False)
    assert len(calls) == 2 * len(cache.layers) * 4  # 4 decode steps after the prefill


def test_a_bfloat16_part_dequantizes_to_bfloat16_and_attention_matches_sdpa():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 40, 32, generator=g).bfloat16(), torch.randn(1, 2, 40, 32, generator=g).bfloat16()
    positions = [{"full": torch.arange(32, 40), 4: torch.arange(0, 32), 2: torch.arange(0)}]
    store = LayerStore.build(k, v, positions, 8, 16, torch.float16, full_part_bits=8)
    assert store.full.keys.dtype == torch.bfloat16 and store.full.scales.keys.dtype == torch.float16
    query = torch.randn(1, 4, 1, 32, generator=g).bfloat16()
    out = split_precision_attention_torch(query, store, 32**-0.5)
    keys, values = store.dequantized(positions, 40, 40)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), scale=32**-0.5, enable_gqa=True
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # bfloat16 output: 8 mantissa bits


def test_the_budget_counts_the_fp16_tier_at_8_bits(tiny_tokenizer):
    """``target_bits`` and ``plan_bits_per_element`` charge the plan's FP16 tier what the 8-bit part stores."""
    for bits, want in ((16, 16.0), (8, 8.0)):
        cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, full_part_bits=bits), encoder=FakeEncoder())
        prompt, ctx, q = make_prompt(60, needle_at=30)
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        n = cache.plans[0].num_chunks
        cache.set_precisions([[16] * n])
        assert cache.plan_bits_per_element() == [want]
