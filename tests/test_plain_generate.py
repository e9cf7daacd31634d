"""CocktailCache as a drop-in for plain ``generate``: tokenizer output straight in, no ``prepare_inputs`` (the prompt
is planned from what its prefill embeds), left-padded batches, a second turn on the same cache, beams, assisted
decoding, deepcopy, requery; tiny random Llama, CPU, fp32."""

import copy
import gc
import logging

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache import prefill_watch
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import make_tiny_gemma3, make_tiny_llama, random_text

GEN = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)


def rec(**kw):
    """recommended() at the tiny model's scale: chunks of 8, a residual window of 16 tokens."""
    kw = {"chunk_size": 8, "residual_tokens": 16, "backend": "torch", **kw}
    return CocktailConfig.recommended(**kw)


def prompt_of(n, seed=0):
    return "<s> " + random_text(n - 1, seed)  # the word-level tokenizer: one token per word


def gen(model, inputs, cache, n=6, **kw):
    return model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=n, **GEN, **kw)


def logits(out):
    return torch.stack(out.logits, 1)


def test_plain_generate_plans_the_prompt_from_its_prefill(tiny_llama, tiny_tokenizer):
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    cache = CocktailCache(rec())
    gen(tiny_llama, inputs, cache)
    plan = cache.plans[0]
    # context: after the 4 sink tokens, before the last 16: [4, 45), 5 chunks of 8 and one of 1
    assert (plan.pad, plan.ctx_start, plan.ctx_end, plan.num_chunks) == (0, 4, 45, 6)
    assert cache.precision_map() == [[4] * 6]
    # the prompt's end for crop: what follows the packed context is full precision (assisted decoding crops it)
    assert cache.prompt_len == 45 and torch.equal(cache._input_ids, inputs["input_ids"])
    assert cache.layers[0].store.segments[0].num_tokens == 41
    assert not cache._watch.armed  # disarmed at the prefill: no hook left behind for this cache


def test_plain_generate_equals_the_same_plan_prepared(tiny_llama, tiny_tokenizer):
    """The plan made from the prefill is the plan prepare_inputs makes for the same context span: same logits."""
    prompt = prompt_of(61)
    plain = gen(tiny_llama, tiny_tokenizer(prompt, return_tensors="pt"), cache := CocktailCache(rec()))
    words = prompt.split()
    prepared_cache = CocktailCache(rec())
    inputs = prepared_cache.prepare_inputs(tiny_tokenizer, prompt, contexts=" ".join(words[4:45]))
    prepared = gen(tiny_llama, inputs, prepared_cache)
    assert prepared_cache.plans[0].ctx_end == cache.plans[0].ctx_end == 45
    assert torch.equal(logits(plain), logits(prepared))


@pytest.mark.parametrize("attn", ["cocktail", "sdpa"])
def test_plain_uniform16_equals_dynamic_cache(tiny_tokenizer, attn):
    model = make_tiny_llama(attn=attn)
    inputs = tiny_tokenizer(prompt_of(50), return_tensors="pt")
    ours = gen(model, inputs, CocktailCache(CocktailConfig(uniform_bits=16, backend="torch")), n=8)
    ref = gen(model, inputs, DynamicCache(), n=8)
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(logits(ours), logits(ref), atol=2e-5, rtol=1e-4)


def test_left_padded_batch_rows_equal_each_alone(tiny_llama, tiny_tokenizer):
    prompts = [prompt_of(61, seed=1), prompt_of(37, seed=2)]
    tiny_tokenizer.padding_side = "left"
    try:
        batch = tiny_tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tiny_tokenizer.padding_side = "right"
    fixed = rec(rotation="hadamard")  # "auto" decides each layer's rotation once for the whole batch, from every row
    cache = CocktailCache(fixed)
    out = gen(tiny_llama, batch, cache)
    assert [(p.pad, p.ctx_start, p.ctx_end) for p in cache.plans] == [(0, 4, 45), (24, 28, 45)]
    for b, prompt in enumerate(prompts):
        alone = gen(tiny_llama, tiny_tokenizer(prompt, return_tensors="pt"), CocktailCache(fixed))
        torch.testing.assert_close(logits(out)[b], logits(alone)[0], atol=1e-4, rtol=1e-4)


def test_right_padding_is_refused_naming_the_mask_row(tiny_llama, tiny_tokenizer):
    batch = tiny_tokenizer([prompt_of(30), prompt_of(20)], return_tensors="pt", padding=True)  # right padding
    with pytest.raises(ValueError, match=r"left padding only.*row 1 masks token 20 of 30.*padding_side = 'left'"):
        gen(tiny_llama, batch, CocktailCache(rec()), n=2)


def _second_turn(first, tokenizer, seed=5, n=12):
    ids = torch.cat([first.sequences, tokenizer(random_text(n, seed), return_tensors="pt")["input_ids"]], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("attn", ["cocktail", "sdpa"])
def test_second_turn_on_the_same_cache_equals_dynamic_cache_at_16_bits(tiny_tokenizer, attn):
    model = make_tiny_llama(attn=attn)
    inputs = tiny_tokenizer(prompt_of(40), return_tensors="pt")
    ours, ref = CocktailCache(CocktailConfig(uniform_bits=16, backend="torch")), DynamicCache()
    turn1, ref1 = gen(model, inputs, ours), gen(model, inputs, ref)
    assert torch.equal(turn1.sequences, ref1.sequences)
    turn2 = gen(model, _second_turn(turn1, tiny_tokenizer), ours)
    ref2 = gen(model, _second_turn(ref1, tiny_tokenizer), ref)
    assert torch.equal(turn2.sequences, ref2.sequences)
    assert ours.get_seq_length() == ref.get_seq_length() == turn2.sequences.shape[1] - 1


def test_second_turn_appends_without_a_new_plan(tiny_llama, tiny_tokenizer):
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    cache = CocktailCache(rec())
    turn1 = gen(tiny_llama, inputs, cache)
    plans = cache.plans
    turn2 = gen(tiny_llama, _second_turn(turn1, tiny_tokenizer), cache)
    assert cache.plans == plans and cache.prompt_len == 45  # the new turn is appended, not planned as a prompt
    assert cache.get_seq_length() == turn2.sequences.shape[1] - 1


def test_beams_assisted_decoding_and_deepcopy_on_the_plain_path(tiny_llama, tiny_tokenizer):
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    beams = gen(tiny_llama, inputs, CocktailCache(CocktailConfig(uniform_bits=16, backend="torch")), num_beams=3)
    ref = gen(tiny_llama, inputs, DynamicCache(), num_beams=3)
    assert torch.equal(beams.sequences, ref.sequences)
    assistant = make_tiny_llama(seed=1)
    plain = gen(tiny_llama, inputs, CocktailCache(rec()), n=8)
    assisted = gen(tiny_llama, inputs, CocktailCache(rec()), n=8, assistant_model=assistant)
    assert torch.equal(plain.sequences, assisted.sequences)  # assisted decoding crops rejected candidates
    cache = CocktailCache(rec())
    turn1 = gen(tiny_llama, inputs, cache)
    twin = copy.deepcopy(cache)
    a = gen(tiny_llama, _second_turn(turn1, tiny_tokenizer), cache)
    b = gen(tiny_llama, _second_turn(turn1, tiny_tokenizer), twin)
    assert torch.equal(logits(a), logits(b))


def test_search_without_prepare_inputs_queries_the_prompts_tail_and_says_so(tiny_llama, tiny_tokenizer, caplog):
    prompt = prompt_of(61)
    config = CocktailConfig(scorer="bm25", chunk_size=8, group_size=16, residual_tokens=16, backend="torch")
    cache = CocktailCache(config, tokenizer=tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="hf_cocktail"):
        gen(tiny_llama, tiny_tokenizer(prompt, return_tensors="pt"), cache)
    said = [r.getMessage() for r in caplog.records if "no prepare_inputs" in r.getMessage()]
    assert len(said) == 1 and "last residual_tokens=16 tokens" in said[0] and "prepare_inputs(" in said[0]
    plan = cache.plans[0]
    assert plan.query == " ".join(prompt.split()[45:])  # the tail after the context, its last 16 tokens
    assert plan.chunk_texts[0] == " ".join(prompt.split()[4:12])
    assert len(cache.precision_map()[0]) == 6 and set(cache.precision_map()[0]) <= {16, 4, 2}


def test_attention_scorer_without_prepare_inputs_needs_no_tokenizer(tiny_llama, tiny_tokenizer):
    config = CocktailConfig(scorer="attention", chunk_size=8, group_size=16, residual_tokens=16, backend="torch")
    cache = CocktailCache(config)
    gen(tiny_llama, tiny_tokenizer(prompt_of(61), return_tensors="pt"), cache)
    assert cache.plans[0].query_span == (45, 61) and len(cache.chunk_scores()[0]) == 6


def test_requery_after_a_plain_prefill(tiny_llama, tiny_tokenizer):
    """requery answers a new question about the prompt's context without a new prefill, as after prepare_inputs."""
    prompt = prompt_of(61)
    config = CocktailConfig(
        scorer="bm25", chunk_size=8, group_size=16, residual_tokens=16, backend="torch", keep_context_copy=True
    )
    cache = CocktailCache(config, tokenizer=tiny_tokenizer)
    gen(tiny_llama, tiny_tokenizer(prompt, return_tensors="pt"), cache)
    new_prompt = " ".join(prompt.split()[:45]) + " what is w9 ?"
    inputs = cache.requery(tiny_tokenizer, new_prompt, "w9")
    again = gen(tiny_llama, inputs, cache)
    fresh = CocktailCache(config, tokenizer=tiny_tokenizer)
    fresh_inputs = fresh.prepare_inputs(
        tiny_tokenizer, new_prompt, contexts=" ".join(prompt.split()[4:45]), queries="w9"
    )
    ref = gen(tiny_llama, fresh_inputs, fresh)
    assert cache.precision_map() == fresh.precision_map()
    torch.testing.assert_close(logits(again), logits(ref), atol=1e-4, rtol=1e-4)


def test_the_hooks_go_with_the_last_waiting_cache(tiny_llama, tiny_tokenizer):
    """A cache waits armed for its prefill (from construction); the model-wide hook and the base model's keyword
    hook go once no cache waits."""
    gc.collect()  # caches of earlier tests, gone
    assert not len(prefill_watch._ARMED) and prefill_watch._HANDLE is None
    cache, unused = CocktailCache(rec()), CocktailCache(rec())
    assert cache._watch.armed and prefill_watch._HANDLE is not None
    gen(tiny_llama, tiny_tokenizer(prompt_of(30), return_tensors="pt"), cache, n=2)
    assert not cache._watch.armed and tiny_llama.model._forward_pre_hooks  # the unused cache still waits
    del unused
    gc.collect()
    assert prefill_watch._HANDLE is None and not len(prefill_watch._BASE_HOOKS)
    assert not tiny_llama.model._forward_pre_hooks


@pytest.mark.parametrize("head_dim,group", [(32, 32), (64, 64), (80, 16), (96, 32), (128, 64), (256, 64)])
def test_recommended_runs_on_every_head_dim_with_the_largest_dividing_group(tiny_tokenizer, head_dim, group):
    """recommended()'s groups of up to 64 value channels: the largest power of two dividing D, recorded in the
    segments and their value scales (D // G per token and head), reported; the fused CPU kernel reads them as the
    PyTorch reference does."""
    model = make_tiny_llama(head_dim=head_dim, heads=2, num_kv_heads=1, layers=1)
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    outs = {}
    for backend in ("torch", "auto"):
        cache = CocktailCache(rec(backend=backend))
        outs[backend] = gen(model, inputs, cache, n=3)
        seg = cache.layers[0].store.segments[0]
        assert seg.group_size == group and seg.v_scale.shape == (1, 41, head_dim // group)
        assert seg.v_codes.numel() == 41 * head_dim * 4 // 8  # 4-bit values, whole bytes
        assert cache.memory_report()["value_group_sizes"] == [group]
    torch.testing.assert_close(logits(outs["auto"]), logits(outs["torch"]), atol=1e-4, rtol=1e-4)


def test_group_size_for_names_the_head_dim_it_refuses():
    assert [CocktailConfig(group_size=64).group_size_for(d) for d in (32, 64, 80, 96, 128, 256)] == [
        32,
        64,
        16,
        32,
        64,
        64,
    ]
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1, got 0"):
        CocktailConfig().group_size_for(0)


def test_plain_generate_on_sliding_and_global_layers_equals_dynamic_cache_at_16_bits(tiny_tokenizer):
    """Gemma 3 in miniature: the layout (the model's own sliding layers) comes from the model the prefill runs."""
    model = make_tiny_gemma3()
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    ours = gen(model, inputs, cache := CocktailCache(CocktailConfig(uniform_bits=16, backend="torch")), n=8)
    ref = gen(model, inputs, DynamicCache(config=model.config), n=8)
    assert torch.equal(ours.sequences, ref.sequences)
    assert sum(isinstance(layer, CocktailLayer) for layer in cache.layers) == 2  # the two global layers
    packed = CocktailCache(rec())
    gen(model, inputs, packed)
    assert packed.precision_map() == [[4] * 6]
    assert [layer.store.segments[0].num_tokens for layer in packed.layers if isinstance(layer, CocktailLayer)] == [
        41
    ] * 2


def test_salient_tokens_on_the_plain_path_come_from_the_prompts_tail(tiny_tokenizer):
    model = make_tiny_llama()
    cache = CocktailCache(rec(salient_tokens=0.1))
    gen(model, tiny_tokenizer(prompt_of(61), return_tensors="pt"), cache)
    plan = cache._plans[0]
    salient = {layer: pos.tolist() for layer, pos in plan.layer_salient.items()}
    assert set(salient) == {0, 1} and all(len(pos) == 4 and all(4 <= p < 45 for p in pos) for pos in salient.values())
    full = cache.layers[0].store.full.length
    # sinks, salient tokens, the tail, the 5 tokens appended after the prefill; the rest of the context packed
    assert full == 4 + 4 + 16 + 5 and cache.layers[0].store.segments[0].num_tokens == 41 - 4


def test_second_turn_after_prepare_inputs_needs_no_new_prepare(tiny_tokenizer):
    """The chat habit on a prepared cache: the next turn is appended, as on the plain path (16 bits: DynamicCache)."""
    model = make_tiny_llama()
    prompt = prompt_of(40)
    ours = CocktailCache(CocktailConfig(uniform_bits=16, backend="torch"))
    inputs = ours.prepare_inputs(tiny_tokenizer, prompt, contexts=" ".join(prompt.split()[5:30]))
    turn1, ref1 = gen(model, inputs, ours), gen(model, inputs, ref := DynamicCache())
    turn2 = gen(model, _second_turn(turn1, tiny_tokenizer), ours)
    assert torch.equal(turn2.sequences, gen(model, _second_turn(ref1, tiny_tokenizer), ref).sequences)


def test_a_long_turn_packed_gives_its_room_back(tiny_llama, tiny_tokenizer):
    """A second turn appends its tokens at once (the full part grows room for them); once they are packed, the full
    part keeps no more room than the tokens it holds."""
    inputs = tiny_tokenizer(prompt_of(61), return_tensors="pt")
    cache = CocktailCache(rec())
    turn1 = gen(tiny_llama, inputs, cache, n=4)
    gen(tiny_llama, _second_turn(turn1, tiny_tokenizer, n=150), cache, n=4)
    store, rep = cache.layers[0].store, cache.memory_report()
    assert store.packed_appended >= 150 - 16 - 8  # all but the residual window, in whole chunks
    assert 0 < rep["headroom_bytes"] <= rep["full_precision_bytes"]
