"""Per-layer code widths (CocktailConfig(layer_bits=...)): the config and its bytes, the per-layer positions, each
layer's store, generation (split attention == SDPA over the dequantized cache) and the layer-count check."""

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.layer_bits import capped_positions, code_widths, mean_code_bits

from .conftest import FakeEncoder, generate_split_and_sdpa, make_prompt, make_tiny_llama


@pytest.mark.parametrize(
    "bad, says",
    [  # then: values wider than keys, 5 bits, not a pair, a bool, a float, 16 bits (full_precision_layers)
        ("44", "be None or a non-empty list.*got .44."),
        ((), r"be None or a non-empty list.*got \(\)"),
        (((4, 3), (3, 4)), r"hold pairs .* entries \(index, value\) \[\(1, \(3, 4\)\)\] are not"),
        (((4, 3), (5, 2)), r".*\[\(1, \(5, 2\)\)\]"),
        (((4, 3), (4,)), r".*\[\(1, \(4,\)\)\]"),
        (((True, 2),), r".*\[\(0, \(True, 2\)\)\]"),
        (((4.0, 2),), r".*\[\(0, \(4.0, 2\)\)\]"),
        (((16, 16),), r".*\[\(0, \(16, 16\)\)\]"),
    ],
)
def test_layer_bits_is_validated(bad, says):
    with pytest.raises(ValueError, match="layer_bits must " + says):
        CocktailConfig(layer_bits=bad)


def test_layer_bits_round_trips_and_refused_values_are_not_kept():
    cfg = CocktailConfig(layer_bits=[[4, 3], [2, 2]], rotation="hadamard")
    assert cfg.layer_bits == ((4, 3), (2, 2))  # JSON lists become tuples
    assert CocktailConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="layer_bits must hold"):
        cfg.layer_bits = [(4, 5)]
    assert cfg.layer_bits == ((4, 3), (2, 2))


def test_bits_per_element_average_over_layers_under_both_caps():
    """C = G = 32, fp16 parameters: 1 bit of scales/zeros per element; codes averaged over K, V and the layers."""
    cfg = CocktailConfig(layer_bits=((4, 3), (2, 2)))
    assert cfg.packed_bits_per_element(4) == ((4 + 3) + (2 + 2)) / 4 + 1.0
    assert cfg.packed_bits_per_element(2) == CocktailConfig().packed_bits_per_element(2) == 3.0
    assert CocktailConfig(layer_bits=((4, 4),), value_bits=2).packed_bits_per_element(4) == 3.0 + 1.0
    assert code_widths(4, (3, 2), None) == (3, 2) and code_widths(2, (3, 3), None) == (2, 2)
    assert code_widths(4, None, 3) == (4, 3) and code_widths(4, (4, 4), 2) == (4, 2)
    assert mean_code_bits(3, None, None) == 3
    # the budget's floor follows: all-INT2 chunks cost 3 bits whatever the caps
    with pytest.raises(ValueError, match=r"target_bits must be None or a number in \[3, 16\]"):
        CocktailConfig(layer_bits=((4, 3), (2, 2)), target_bits=2.9)


def test_capped_positions_merge_the_parts_above_the_key_width_in_token_order():
    pos = {"full": torch.tensor([0, 1, 9]), 4: torch.tensor([2, 3, 6, 7]), 2: torch.tensor([4, 5, 8])}
    assert capped_positions(pos, None) is pos
    same = capped_positions(pos, 4)
    assert list(same) == ["full", 4, 2] and all(torch.equal(same[p], pos[p]) for p in pos)
    merged = capped_positions(pos, 2)
    assert list(merged) == ["full", 2]
    assert merged[2].tolist() == [2, 3, 4, 5, 6, 7, 8] and torch.equal(merged["full"], pos["full"])
    three = capped_positions(pos, 3)
    assert list(three) == ["full", 3, 2] and three[3].tolist() == [2, 3, 6, 7]


def test_generate_split_equals_dequantized_sdpa_and_each_layer_keeps_its_widths(tiny_tokenizer):
    base = dict(chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", low_bits=3)
    cfg = CocktailConfig(**base, layer_bits=((4, 2), (2, 2)))
    runs = generate_split_and_sdpa(tiny_tokenizer, cfg)
    for _, cache in runs.values():
        assert {16, 4, 3} == set(cache.precision_map()[0])  # one plan for every layer
        first, second = (layer.store.segments for layer in cache.layers)
        assert [(s.bits, s.value_bits) for s in first] == [(4, 2), (3, 2)]
        assert [(s.bits, s.value_bits) for s in second] == [(2, 2)]  # INT4 and INT3 chunks merged into 2 bits
        full = [layer.store.full.length for layer in cache.layers]
        assert full[0] == full[1]  # FP16 chunks stay FP16 in every layer
        assert first[0].num_tokens + first[1].num_tokens == second[0].num_tokens
    (split, c_split), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)
    plain = generate_split_and_sdpa(tiny_tokenizer, CocktailConfig(**base))["cocktail"][1]
    assert c_split.memory_report()["total_bytes"] < plain.memory_report()["total_bytes"]
    # a layer whose caps do not bind is stored exactly as without layer_bits
    loose = generate_split_and_sdpa(tiny_tokenizer, CocktailConfig(**base, layer_bits=((4, 4), (2, 2))))["cocktail"][1]
    a, b = loose.layers[0].store.segments, plain.layers[0].store.segments
    assert all(torch.equal(x.k_codes, y.k_codes) and torch.equal(x.v_codes, y.v_codes) for x, y in zip(a, b))


def test_plan_bits_per_element_counts_the_caps(tiny_tokenizer):
    cfg = CocktailConfig(chunk_size=8, group_size=16, uniform_bits=4, layer_bits=((4, 4), (2, 2)))
    cache = generate_split_and_sdpa(tiny_tokenizer, cfg)["cocktail"][1]
    assert cache.plan_bits_per_element() == [pytest.approx(((4 + 4) + (2 + 2)) / 4 + 16 / 8 + 16 / 16)]


@pytest.mark.parametrize("layer_bits", [((4, 3),), ((4, 3), (4, 3), (4, 3))])
def test_layer_bits_must_name_every_layer(tiny_tokenizer, layer_bits):
    model = make_tiny_llama(attn="cocktail", head_dim=32)  # 2 layers
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, layer_bits=layer_bits), encoder=FakeEncoder())
    prompt, ctx, q = make_prompt(60)
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    n = "1 entry" if len(layer_bits) == 1 else f"{len(layer_bits)} entries"
    with pytest.raises(ValueError, match=rf"layer_bits has {n} .*one \(key_bits, value_bits\)"):
        model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)


def test_model_card_lists_the_layer_caps():
    from hf_cocktail.presets.model_card import make_model_card

    card = make_model_card(CocktailConfig(uniform_bits=4, layer_bits=((4, 3), (2, 2))))
    assert (
        "Each of the 2 layers caps its packed keys / values at its own code widths (`layer_bits`, layer 0 first): "
        "4/3, 2/2." in card
    )
    assert "caps its packed keys" not in make_model_card(CocktailConfig())  # (the JSON lists "layer_bits": null)
