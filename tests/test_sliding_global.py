"""A Gemma 3-shaped model (sliding-window and global layers, one KV head): the sliding layers of a CocktailCache hold
exactly what the model's own ``DynamicCache(config=...)`` holds there (the last ``window - 1`` tokens and the count
of tokens seen), through ``generate`` and through ``load_prefill``; ``memory_report()`` gives the ratio of the
quantized (global) layers and of the whole cache, checked against hand-computed bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import TINY_GEMMA3_LAYERS, TINY_GEMMA3_WINDOW, FakeEncoder, make_prompt

SLIDING = [i for i, t in enumerate(TINY_GEMMA3_LAYERS) if t == "sliding_attention"]
GLOBAL = [i for i, t in enumerate(TINY_GEMMA3_LAYERS) if t == "full_attention"]
GEN = dict(max_new_tokens=5, do_sample=False)


def _cfg(**kw):
    return CocktailConfig(chunk_size=8, group_size=16, **kw)


def _generate(model, tok, cache):
    prompt, ctx, q = make_prompt(120, needle_at=60)
    if isinstance(cache, CocktailCache):
        inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=q)
    else:
        inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return out, inputs["input_ids"].shape[1]


@pytest.mark.parametrize("bits", [16, 4])
def test_sliding_layers_hold_exactly_the_models_own_window(tiny_gemma3, tiny_tokenizer, bits):
    default = DynamicCache(config=tiny_gemma3.config)
    ref, n_prompt = _generate(tiny_gemma3, tiny_tokenizer, default)
    cache = CocktailCache(_cfg(uniform_bits=bits), encoder=FakeEncoder())
    out, _ = _generate(tiny_gemma3, tiny_tokenizer, cache)
    assert n_prompt > 4 * TINY_GEMMA3_WINDOW
    assert [isinstance(layer, CocktailLayer) for layer in cache.layers] == [i in GLOBAL for i in range(5)]
    for i in SLIDING:
        mine, theirs = cache.layers[i], default.layers[i]
        assert type(mine) is type(theirs)
        assert mine.keys.shape == theirs.keys.shape == (1, 1, TINY_GEMMA3_WINDOW - 1, 64)
        assert mine.get_seq_length() == theirs.get_seq_length() == out.shape[1] - 1
    if bits == 16:  # full precision: the same tokens and the same window contents
        assert torch.equal(out, ref)
        for i in SLIDING:
            torch.testing.assert_close(cache.layers[i].keys, default.layers[i].keys)


@pytest.mark.parametrize("grad", [False, True])
def test_a_branched_prefill_keeps_the_window_and_its_token_count(tiny_gemma3, tiny_tokenizer, grad):
    """``grad``: the shared prefill ran with autograd on (its sliding layers' tensors carry a graph)."""
    prompt, ctx, q = make_prompt(120, needle_at=60)
    shared = DynamicCache(config=tiny_gemma3.config)
    cache = CocktailCache(_cfg(uniform_bits=4), encoder=FakeEncoder(), model_config=tiny_gemma3.config)
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with torch.set_grad_enabled(grad):
        tiny_gemma3(**inputs, **cache_kwargs(tiny_gemma3, shared))
    assert shared.layers[SLIDING[0]].keys.requires_grad == grad
    cache.load_prefill(shared)
    assert not any(cache.layers[i].keys.requires_grad for i in SLIDING)
    L = inputs["input_ids"].shape[1]
    for i in SLIDING:
        assert cache.layers[i] is not shared.layers[i]
        assert cache.layers[i].keys.shape[2] == shared.layers[i].keys.shape[2] == TINY_GEMMA3_WINDOW - 1
        assert cache.layers[i].get_seq_length() == L
    for i in GLOBAL:
        assert cache.layers[i].get_seq_length() == L


def test_memory_report_gives_the_global_layers_ratio_and_the_whole_caches(tiny_gemma3, tiny_tokenizer):
    cache = CocktailCache(_cfg(uniform_bits=4), encoder=FakeEncoder())
    out, _ = _generate(tiny_gemma3, tiny_tokenizer, cache)
    T = out.shape[1] - 1  # the last generated token is never fed back
    rep = cache.memory_report()
    per_token_layer = 1 * 64 * 2 * 2  # one KV head, D=64, keys and values, 2 bytes
    assert rep["quantized_layers_fp16_equivalent_bytes"] == len(GLOBAL) * T * per_token_layer
    assert rep["native_layers_fp16_bytes"] == len(SLIDING) * (TINY_GEMMA3_WINDOW - 1) * per_token_layer
    assert (
        rep["fp16_equivalent_bytes"] == rep["quantized_layers_fp16_equivalent_bytes"] + rep["native_layers_fp16_bytes"]
    )
    quantized = rep["quantized_layers_ratio_to_fp16"] * rep["quantized_layers_fp16_equivalent_bytes"]
    # the global layers' deployed bytes: codes, scales/zeros, the full part and its room at 2 bytes per element (fp32
    # here), the rotation matrices and index tensors as held
    extra = rep["rotation_bytes"] + rep["index_bytes"]
    deployed = (
        rep["codes_bytes"] + rep["scales_zeros_bytes"] + (rep["full_precision_bytes"] + rep["headroom_bytes"]) // 2
    )
    assert quantized == pytest.approx(deployed + extra, rel=1e-12)
    # the whole cache adds the sliding layers, every tensor they hold (floats at 2 bytes per element): the K/V of the
    # window they attend to, plus per layer the one token more their buffer keeps and an int64 token count
    native = rep["ratio_to_fp16"] * rep["fp16_equivalent_bytes"] - quantized
    assert native == pytest.approx(rep["native_layers_fp16_bytes"] + len(SLIDING) * (per_token_layer + 8), rel=1e-12)
    # the whole cache lies nearer 1: its sliding layers stay at full precision
    assert rep["quantized_layers_ratio_to_fp16"] < rep["ratio_to_fp16"] < 1
    full = CocktailCache(_cfg(uniform_bits=16), encoder=FakeEncoder())
    _generate(tiny_gemma3, tiny_tokenizer, full)
    rep16 = full.memory_report()
    # at 16 bits the global layers hold their tokens as FP16 would, plus the part's room and the index tensors
    held16 = rep16["quantized_layers_fp16_equivalent_bytes"] + rep16["headroom_bytes"] // 2 + rep16["index_bytes"]
    assert rep16["quantized_layers_ratio_to_fp16"] == pytest.approx(
        held16 / rep16["quantized_layers_fp16_equivalent_bytes"], rel=1e-12
    )


def test_a_branched_prefill_holds_only_the_window_in_its_sliding_layers(tiny_gemma3, tiny_tokenizer):
    """After a prefill, the model's own sliding layers hold their window as a view of the whole prompt's keys and
    values; the branched cache copies the window alone, so its whole-cache ratio counts the window, as the model's own
    cache does once it decodes."""
    prompt, ctx, q = make_prompt(120, needle_at=60)
    shared = DynamicCache(config=tiny_gemma3.config)
    cache = CocktailCache(_cfg(uniform_bits=4), encoder=FakeEncoder(), model_config=tiny_gemma3.config)
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with torch.no_grad():
        tiny_gemma3(**inputs, **cache_kwargs(tiny_gemma3, shared))
    L = inputs["input_ids"].shape[1]
    window_bytes = (TINY_GEMMA3_WINDOW - 1) * 64 * 4  # one KV head, D=64, fp32
    assert shared.layers[SLIDING[0]].keys.untyped_storage().nbytes() == L * 64 * 4  # the prefill's view
    cache.load_prefill(shared)
    for i in SLIDING:
        for t in (cache.layers[i].keys, cache.layers[i].values):
            assert t.untyped_storage().nbytes() == window_bytes
        torch.testing.assert_close(cache.layers[i].keys, shared.layers[i].keys, rtol=0, atol=0)
    rep = cache.memory_report()
    quantized = rep["quantized_layers_ratio_to_fp16"] * rep["quantized_layers_fp16_equivalent_bytes"]
    native = rep["ratio_to_fp16"] * rep["fp16_equivalent_bytes"] - quantized
    # the window's K/V and per layer an int64 token count (after a decode step the buffer keeps one token more)
    assert native == pytest.approx(rep["native_layers_fp16_bytes"] + len(SLIDING) * 8, rel=1e-12)
