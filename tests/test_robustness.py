"""generate features, edge inputs and refusals (issue: robustness). Tiny random models, CPU, fp32."""

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, random_text, two_question_document
from .test_core_cache import GEN, cfg, dynamic, logits, run

QUANT = dict(alpha=0.3, beta=0.2)


def gen(model, tok, prompts, contexts, queries, config, **kw):
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tok, prompts, contexts=contexts, queries=queries)
    out = model.generate(**inputs, **cache_kwargs(model, cache), do_sample=False, max_new_tokens=6, **kw)
    return out, cache, inputs


# ----------------------------------------------------------------------------- generate modes
@pytest.mark.parametrize(
    "kw", [dict(num_beams=3), dict(num_beams=2, num_return_sequences=2), dict(prompt_lookup_num_tokens=3)]
)
def test_generate_modes_uniform16_equal_dynamic_cache(tiny_tokenizer, kw):
    prompt, ctx, q = make_prompt(60, needle_at=10)
    out, _, _ = gen(make_tiny_llama(), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16), **kw)
    ref_model = make_tiny_llama(attn="sdpa")
    ref = ref_model.generate(
        **tiny_tokenizer(prompt, return_tensors="pt"),
        do_sample=False,
        max_new_tokens=6,
        **cache_kwargs(ref_model, DynamicCache()),
        **kw,
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw", [dict(num_beams=3), dict(num_beams=2, num_return_sequences=2)])
def test_beam_search_reorders_packed_rows_like_per_row_reference(tiny_tokenizer, kw):
    """A batch of two different prompts under beam search gives, row by row, what each prompt gives alone: a beam
    reorder that mixed up packed codes, scales or precision maps across rows would change the outputs."""
    model = make_tiny_llama(seed=3)
    p1, c1, q1 = make_prompt(80, seed=4, needle_at=30)
    p2, c2, q2 = make_prompt(41, seed=5, needle_at=3)
    batch, bcache, binp = gen(model, tiny_tokenizer, [p1, p2], [c1, c2], [q1, q2], cfg(**QUANT), **kw)
    r = kw.get("num_return_sequences", 1)
    for i, (p, c, q) in enumerate([(p1, c1, q1), (p2, c2, q2)]):
        alone, acache, ainp = gen(model, tiny_tokenizer, p, c, q, cfg(**QUANT), **kw)
        n = ainp["input_ids"].shape[1]
        got = batch[i * r : (i + 1) * r, binp["input_ids"].shape[1] :]
        assert torch.equal(got, alone[:, n:])
    assert {16, 4, 2} <= set(sum(bcache.precision_map(), []))


def test_prompt_lookup_crop_path_matches_dequantized_reference(tiny_tokenizer):
    """Assisted (prompt-lookup) decoding verifies several tokens at once (L_q > 1) and crops rejected ones."""
    prompt, ctx, q = make_prompt(70, needle_at=20)
    out, _, _ = gen(make_tiny_llama(), tiny_tokenizer, prompt, ctx, q, cfg(**QUANT), prompt_lookup_num_tokens=3)
    ref, _, _ = gen(
        make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt, ctx, q, cfg(**QUANT), prompt_lookup_num_tokens=3
    )
    plain, _, _ = gen(make_tiny_llama(), tiny_tokenizer, prompt, ctx, q, cfg(**QUANT))
    assert torch.equal(out, ref) and torch.equal(out, plain)


def test_crop_refuses_prompt_tokens(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(30)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    cache.crop(-2)
    with pytest.raises(ValueError, match="can only crop tokens added after the prompt"):
        cache.crop(-100)


def test_reuse_with_prepare_inputs_resets(tiny_llama, tiny_tokenizer):
    p1, c1, q1 = make_prompt(50, seed=1)
    p2, c2, q2 = make_prompt(30, seed=2, needle_at=4)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    for p, c, q in [(p1, c1, q1), (p2, c2, q2)]:
        inputs = cache.prepare_inputs(tiny_tokenizer, p, contexts=c, queries=q)
        out = tiny_llama.generate(**inputs, **cache_kwargs(tiny_llama, cache), **GEN)
    fresh, fcache, _ = run(tiny_llama, tiny_tokenizer, p2, c2, q2, cfg(**QUANT))
    assert torch.equal(out.sequences, fresh.sequences)
    assert cache.precision_map() == fcache.precision_map()


def test_generation_past_the_position_window(tiny_tokenizer):
    """max_position_embeddings=64 and a ~100-token prompt + 6 new: same as DynamicCache (RoPE just continues)."""
    prompt, ctx, q = make_prompt(90)
    model = make_tiny_llama()
    model.config.max_position_embeddings = 64
    out, _, _ = run(model, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16))
    ref = dynamic(model, tiny_tokenizer, prompt)
    assert torch.equal(out.sequences, ref.sequences)


# ----------------------------------------------------------------------------- edge inputs
@pytest.mark.parametrize("n_words", [3, 0])
def test_context_shorter_than_a_chunk_or_empty(tiny_llama, tiny_tokenizer, n_words):
    ctx = random_text(n_words)
    prompt = f"<s> w1 {ctx} what is the code ?".replace("  ", " ")
    out, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, "what is the code ?", cfg(**QUANT))
    assert [len(m) for m in cache.precision_map()] == [1 if n_words else 0]
    ref = dynamic(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt)
    if n_words == 0:  # nothing quantized: exactly full precision
        torch.testing.assert_close(logits(out), logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["start", "end"])
def test_context_at_the_very_start_or_end(tiny_tokenizer, where):
    ctx, q = random_text(40, seed=9), "what is the secret code ?"
    prompt = f"{ctx} {q}" if where == "start" else f"{q} {ctx}"
    out, cache, inputs = run(make_tiny_llama(), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    plan = cache.plans[0]
    if where == "start":  # the first sink_tokens (4) stay full precision even though they are context
        assert plan.ctx_start == 4
    else:
        assert plan.ctx_end == inputs["input_ids"].shape[1]
    ref, _, _ = run(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    torch.testing.assert_close(logits(out), logits(ref), rtol=1e-4, atol=1e-4)


def test_empty_query_still_searches(tiny_llama, tiny_tokenizer):
    prompt, ctx, _ = make_prompt(40)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, "", cfg())
    assert len(cache.precision_map()[0]) == 5


def test_group_size_above_the_head_dim_stores_the_largest_dividing_group(tiny_llama, tiny_tokenizer):
    """group_size is the most channels per value group: at D=32, 64 stores groups of 32 (recorded, reported)."""
    prompt, ctx, q = make_prompt(40)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(group_size=64, uniform_bits=2))
    seg = cache.layers[0].store.segments[1]
    assert seg.group_size == 32 and seg.v_scale.shape[-1] == 1  # D=32: one value group per token and head
    assert cache.memory_report()["value_group_sizes"] == [32]


def test_chunk_size_not_dividing_context_keeps_every_token(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(45)  # 45 tokens, C=8: 5 full chunks + one of 5
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=4))
    seg4 = cache.layers[0].store.segments[0]
    assert seg4.num_tokens == 45 and seg4.k_scale.shape[1] == 6


def test_sliding_window_models_get_the_models_own_sliding_layers(tiny_tokenizer):
    """Formerly refused under "cocktail": the sliding layers are now the model's own (window only), under both
    attention implementations, with the same tokens as the model's default cache (more in test_architectures)."""
    from transformers import DynamicCache, MistralConfig, MistralForCausalLM

    conf = MistralConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
        pad_token_id=0,
        attn_implementation="cocktail",
    )
    model = MistralForCausalLM(conf).eval()
    prompt, ctx, q = make_prompt(40)
    ref = model.generate(
        **tiny_tokenizer(prompt, return_tensors="pt"), **cache_kwargs(model, DynamicCache(config=model.config)), **GEN
    )
    for attn in ("cocktail", "sdpa"):
        model.config._attn_implementation = attn
        out, cache, _ = run(model, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16))
        assert torch.equal(out.sequences, ref.sequences)
        assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer" and cache.layers[0].keys.shape[2] <= 16


# ----------------------------------------------------------------------------- beyond-the-paper options
def test_full_precision_layers(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(60)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2, full_precision_layers=[0]))
    assert cache.layers[0].store.segments[1].num_tokens == 0
    assert cache.layers[1].store.segments[1].num_tokens == 60
    out, _, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2, full_precision_layers=[0, 1]))
    ref, _, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16))
    torch.testing.assert_close(logits(out), logits(ref), rtol=1e-5, atol=1e-5)


def test_bm25_scorer_needs_no_encoder(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(120, needle_at=70)
    cache = CocktailCache(cfg(scorer="bm25", encoder="/nonexistent/encoder"))
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    tiny_llama.generate(**inputs, **cache_kwargs(tiny_llama, cache), max_new_tokens=2)
    plan, bits = cache.plans[0], cache.precision_map()[0]
    needle = next(i for i, t in enumerate(plan.chunk_texts) if "secret" in t)
    assert bits[needle] == 16


@pytest.mark.parametrize("target", [5.0, 7.0, 10.0])
def test_budget_mode_meets_target_bits(tiny_llama, tiny_tokenizer, target):
    prompt, ctx, q = make_prompt(200, needle_at=100)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(target_bits=target))  # C=8, G=16: INT2 = 5
    plan, bits = cache.plans[0], cache.precision_map()[0]
    n_ctx = plan.ctx_end - plan.ctx_start
    # measured bits per context element: packed bytes + FP16 context chunks counted at 2 bytes per element
    H, D, layers = 2, 32, 2
    packed = sum(s.nbytes_codes() + s.nbytes_params() for layer in cache.layers for s in layer.store.segments)
    n16 = sum(b - a for i, (a, b) in enumerate(plan.chunk_range(i, 8) for i in range(plan.num_chunks)) if bits[i] == 16)
    measured = (packed + n16 * H * D * 2 * 2 * layers) * 8 / (n_ctx * H * D * 2 * layers)
    assert measured <= target + 1e-6
    assert measured >= target - (16 - 5) * 8 / n_ctx  # within one chunk's worth of the budget
    assert len(set(bits)) >= (2 if target > 5 else 1)


def test_config_budget_and_option_errors():
    with pytest.raises(ValueError, match=r"target_bits must be None or a number in \[3, 16\]"):
        CocktailConfig(target_bits=2.5)
    with pytest.raises(ValueError, match="scorer must be one of"):
        CocktailConfig(scorer="tfidf")
    with pytest.raises(ValueError, match="full_precision_layers"):
        CocktailConfig(full_precision_layers=[-1])
    with pytest.raises(ValueError, match="sink_tokens"):
        CocktailConfig(sink_tokens=-2)


def test_requery_equals_a_fresh_run_on_the_new_question(tiny_llama, tiny_tokenizer):
    ctx, (p1, q1), (p2, q2) = two_question_document()
    config = cfg(keep_context_copy=True, **QUANT)
    cache = CocktailCache(config, encoder=FakeEncoder())
    tiny_llama.generate(
        **cache.prepare_inputs(tiny_tokenizer, p1, contexts=ctx, queries=q1), **cache_kwargs(tiny_llama, cache), **GEN
    )
    first_map = cache.precision_map()
    inputs = cache.requery(tiny_tokenizer, p2, q2)
    assert cache.get_seq_length() == cache.plans[0].ctx_end  # only the prompt up to the context end is kept
    out = tiny_llama.generate(**inputs, **cache_kwargs(tiny_llama, cache), **GEN)
    fresh, fcache, _ = run(tiny_llama, tiny_tokenizer, p2, ctx, q2, cfg(**QUANT))
    assert cache.precision_map() == fcache.precision_map() != first_map
    assert torch.equal(out.sequences, fresh.sequences)
    torch.testing.assert_close(logits(out), logits(fresh), rtol=1e-4, atol=1e-4)


def test_requery_errors(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg())
    with pytest.raises(RuntimeError, match="keep_context_copy=True"):
        cache.requery(tiny_tokenizer, prompt, q)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(keep_context_copy=True))
    with pytest.raises(ValueError, match="must repeat the previous prompt's tokens"):
        cache.requery(tiny_tokenizer, "<s> w9 w9 " + ctx + " w2", q)


def test_attention_scorer_uses_the_prefill_attention_of_the_query_tokens(tiny_tokenizer):
    prompt, ctx, q = make_prompt(60, needle_at=30)
    model = make_tiny_llama()
    out, cache, inputs = gen(model, tiny_tokenizer, prompt, ctx, q, cfg(scorer="attention", **QUANT))
    plan = cache.plans[0]
    # independent reference: eager attention probabilities of the same model
    eager = make_tiny_llama(attn="eager")
    with torch.no_grad():
        att = eager(**inputs, output_attentions=True).attentions  # per layer (B, H_q, L, L)
    qs, qe = plan.query_span
    assert tiny_tokenizer.decode(inputs["input_ids"][0, qs:qe]).replace(" ", "") == q.replace(" ", "")
    ref = sum(a[0, :, qs:qe, plan.ctx_start : plan.ctx_end].sum((0, 1)) for a in att)
    torch.testing.assert_close(plan.attn_mass, ref, rtol=1e-4, atol=1e-5)
    means = [ref[i * 8 : (i + 1) * 8].mean().item() for i in range(plan.num_chunks)]
    assert cache.chunk_scores()[0] == pytest.approx(means, rel=1e-4)
    # decoding then ran on the quantized cache: the same as the dequantizing reference with the same plan
    ref_cache = CocktailCache(cfg(**QUANT))
    ref_inputs = ref_cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    ref_cache.set_precisions(cache.precision_map())
    ref_model = make_tiny_llama(attn="sdpa")
    ref_out = ref_model.generate(**ref_inputs, **cache_kwargs(ref_model, ref_cache), do_sample=False, max_new_tokens=6)
    assert torch.equal(out, ref_out)


def test_attention_scorer_errors(tiny_tokenizer):
    prompt, ctx, q = make_prompt(30)
    with pytest.raises(ValueError, match=r"queries\[0\] must appear verbatim"):
        CocktailCache(cfg(scorer="attention")).prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries="w9 zz")
    with pytest.raises(ValueError, match="but the model uses attn_implementation='sdpa'"):  # before the prefill
        gen(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt, ctx, q, cfg(scorer="attention"))


def test_attention_scorer_under_beam_search_matches_per_row(tiny_tokenizer):
    model = make_tiny_llama(seed=7)
    p1, c1, q1 = make_prompt(50, seed=8, needle_at=10)
    p2, c2, q2 = make_prompt(23, seed=9, needle_at=2)
    config = cfg(scorer="attention", **QUANT)
    batch, _, binp = gen(model, tiny_tokenizer, [p1, p2], [c1, c2], [q1, q2], config, num_beams=2)
    for i, (p, c, q) in enumerate([(p1, c1, q1), (p2, c2, q2)]):
        alone, _, ainp = gen(model, tiny_tokenizer, p, c, q, config, num_beams=2)
        assert torch.equal(batch[i, binp["input_ids"].shape[1] :], alone[0, ainp["input_ids"].shape[1] :])


# ----------------------------------------------------------------------------- regressions found in review
def test_load_prefill_default_is_right_under_any_attention(tiny_tokenizer):
    prompt, ctx, q = make_prompt(50, needle_at=5)
    outs = []
    for attn, split in (("cocktail", None), ("sdpa", None), ("cocktail", False)):
        model = make_tiny_llama(attn=attn)
        cache = CocktailCache(cfg(uniform_bits=2), encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        dyn = DynamicCache()
        with torch.no_grad():
            model(input_ids=inputs["input_ids"][:, :-1], **cache_kwargs(model, dyn))
        cache.load_prefill(dyn, split_attention=split)
        outs.append(model.generate(**inputs, **cache_kwargs(model, cache), **GEN))
    # the same branched cache decoded with split-precision attention and with plain SDPA over its dequantization
    for other in outs[1:]:
        assert torch.equal(outs[0].sequences, other.sequences)
        torch.testing.assert_close(logits(outs[0]), logits(other), rtol=1e-4, atol=1e-4)


def test_prompt_lookup_with_candidates_at_the_first_step(tiny_tokenizer):
    """The prompt ends with words that also occur in the context: the first assisted step already has candidates,
    so the prefill is longer than the prompt and the rejected ones are cropped from it."""
    ctx = random_text(60, seed=12)
    tail = " ".join(ctx.split()[10:14])
    prompt = f"<s> w1 {ctx} w2 {tail}"
    kw = dict(prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=8)
    for config, ref_attn in ((cfg(uniform_bits=16), None), (cfg(**QUANT), "sdpa")):
        cache = CocktailCache(config, encoder=FakeEncoder())
        model = make_tiny_llama()
        out = model.generate(
            **cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=tail),
            **cache_kwargs(model, cache),
            **kw,
        )
        if ref_attn is None:
            ref = make_tiny_llama(attn="sdpa").generate(**tiny_tokenizer(prompt, return_tensors="pt"), **kw)
        else:
            rc = CocktailCache(config, encoder=FakeEncoder())
            ref_model = make_tiny_llama(attn=ref_attn)
            ref = ref_model.generate(
                **rc.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=tail),
                **cache_kwargs(ref_model, rc),
                **kw,
            )
        assert torch.equal(out, ref)


def test_attention_scorer_reports_after_a_prefill_only_generate(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(scorer="attention", **QUANT))
    tiny_llama.generate(
        **cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q),
        **cache_kwargs(tiny_llama, cache),
        max_new_tokens=1,
    )
    assert len(cache.precision_map()[0]) == 5 and cache.nbytes() > 0


def test_attention_scorer_reuse_with_beams(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(scorer="attention", **QUANT))
    outs = [
        tiny_llama.generate(
            **cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q),
            **cache_kwargs(tiny_llama, cache),
            num_beams=2,
            max_new_tokens=3,
            do_sample=False,
        )
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])


def test_attention_scorer_refusals(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    with pytest.raises(ValueError, match="keep_context_copy=True has no effect with scorer='attention'"):
        cfg(scorer="attention", keep_context_copy=True)  # requery() would need the new question's prefill attention
    cache = CocktailCache(cfg(scorer="attention"))
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        tiny_llama.generate(
            **cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q),
            **cache_kwargs(tiny_llama, cache),
            max_new_tokens=2,
            prefill_chunk_size=16,
        )


def test_hybrid_models_keep_their_states_in_the_models_own_layers(tiny_tokenizer):
    """Formerly refused: a hybrid model's conv layers are the model's own cache layers; a state update on a cache
    that cannot know the model's layers is refused naming model_config."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    conf = Lfm2Config(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["conv", "full_attention"],
        pad_token_id=0,
        attn_implementation="cocktail",
    )
    model = Lfm2ForCausalLM(conf).eval()
    prompt, ctx, q = make_prompt(40)
    _, cache, _ = run(model, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer", "CocktailLayer"]
    with pytest.raises(ValueError, match="model_config=model.config"):
        CocktailCache(cfg(uniform_bits=2)).update_conv_state(torch.zeros(1, 64, 3), 0)


def test_batch_select_indices_keeps_the_selected_rows(tiny_llama, tiny_tokenizer):
    p1, c1, q1 = make_prompt(50, seed=21, needle_at=3)
    p2, c2, q2 = make_prompt(31, seed=22, needle_at=9)
    _, bcache, _ = run(tiny_llama, tiny_tokenizer, [p1, p2], [c1, c2], [q1, q2], cfg(**QUANT))
    _, acache, _ = run(tiny_llama, tiny_tokenizer, p2, c2, q2, cfg(**QUANT))
    bcache.batch_select_indices(torch.tensor([False, True]))
    assert bcache.precision_map() == acache.precision_map()
    for lb, la in zip(bcache.layers, acache.layers):
        for sb, sa in zip(lb.store.segments, la.store.segments):
            assert sb.tok_off == sa.tok_off and all(torch.equal(x, y) for x, y in zip(sb.tensors(), sa.tensors()))
        fb, fa = lb.store.full, la.store.full
        torch.testing.assert_close(fb.keys[0, :, fb.start[0] :], fa.keys[0, :, fa.start[0] :], rtol=1e-5, atol=1e-5)


def test_a_dropped_cache_is_freed_without_the_garbage_collector(tiny_llama, tiny_tokenizer):
    import gc
    import weakref

    prompt, ctx, q = make_prompt(40)
    gc.collect()
    gc.disable()
    try:
        _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(**QUANT))
        ref = weakref.ref(cache)
        del cache
        assert ref() is None  # no reference cycle: freed by reference counting alone
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- the low precision (INT2 or INT3)
def test_low_bits_is_validated_and_sets_the_stores_precisions():
    with pytest.raises(ValueError, match=r"low_bits must be one of \(2, 3\), got 4"):
        CocktailConfig(low_bits=4)
    assert CocktailConfig().packed_bits == (4, 2)
    assert CocktailConfig(low_bits=3).packed_bits == (4, 3)
    assert CocktailConfig(uniform_bits=3).packed_bits == (4, 3)  # a uniform INT3 baseline needs the INT3 segment
    # the budget's floor is the all-low cost: INT3 = 3 + 16/32 + 16/32 = 4 bits
    with pytest.raises(ValueError, match=r"target_bits must be None or a number in \[4, 16\] \(all-INT3 costs 4"):
        CocktailConfig(low_bits=3, target_bits=3.5)


def test_set_precisions_accepts_only_the_configured_low_precision(tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    for low, bad in ((2, 3), (3, 2)):
        cache = CocktailCache(cfg(low_bits=low), encoder=FakeEncoder())
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        n = cache.plans[0].num_chunks
        with pytest.raises(ValueError, match=rf"values must be one of \(16, 4, {low}\), got \[{bad}\]"):
            cache.set_precisions([[bad] * n])
        cache.set_precisions([[low] * n])


def test_budget_mode_with_int3_spends_the_budget_on_int4_above_int3(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(200, needle_at=100)
    # C=8, G=16: INT3 costs 3 + 2 + 1 = 6 bits, INT4 7
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(target_bits=6.5, low_bits=3))
    bits = cache.precision_map()[0]
    assert set(bits) <= {16, 4, 3} and 3 in bits and 4 in bits
    assert cache.plan_bits_per_element()[0] <= 6.5 + 1e-9
    seg_bits = [s.bits for s in cache.layers[0].store.segments]
    assert seg_bits == [4, 3]


def test_recommended_is_4bit_keys_and_values_auto_rotated_with_8bit_params_and_takes_overrides():
    rec = CocktailConfig.recommended()
    assert (rec.rotation, rec.uniform_bits, rec.value_bits, rec.group_size, rec.scale_bits) == ("auto", 4, None, 64, 8)
    assert rec.target_bits is None and rec.packed_bits_per_element(4) == 4 + 0.25 + 0.125  # codes, K and V params
    before = CocktailConfig.recommended(rotation="hadamard", value_bits=3, scale_bits=16)  # until 2026-12-07
    assert before.packed_bits_per_element(4) == 3.5 + 0.5 + 0.25
    paper = CocktailConfig()  # the paper setting is unchanged
    assert (paper.uniform_bits, paper.value_bits, paper.rotation, paper.packed_bits) == (None, None, None, (4, 2))
    previous = CocktailConfig.recommended(uniform_bits=None, value_bits=None, low_bits=3, target_bits=3.8)
    assert (previous.packed_bits, previous.target_bits, previous.group_size) == ((4, 3), 3.8, 64)
    assert CocktailConfig.recommended(group_size=32).group_size == 32  # the README's advice for other head dims
    with pytest.raises(ValueError, match=r"all-INT3 costs 4 bits"):  # 3.8 is below all-INT3 with G=32, 16-bit params
        CocktailConfig.recommended(
            uniform_bits=None, value_bits=None, low_bits=3, target_bits=3.8, group_size=32, scale_bits=16
        )
