"""Model coverage and trust (issue 14, items 2-6): copies, prefill checks, chunk texts, MLA models, config checks.

Tiny random models and tokenizers built offline, CPU, fp32.
"""

import copy
import dataclasses
import gc
import random

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, random_text
from .test_core_cache import GEN, cfg, logits

QUANT = dict(alpha=0.3, beta=0.2)
ATTNS = ["cocktail", "sdpa", "eager"]


def generate(model, cache, inputs, **kw):
    return model.generate(**inputs, **cache_kwargs(model, cache), **(GEN | kw))


# ----------------------------------------------------------------------------- item 2: copy.deepcopy
def _shared_prefix():
    """A document prefix shared by two prompts that differ only in the question after it."""
    ctx = random_text(70, seed=31).split()
    ctx.insert(25, "the secret code is w7 w8 w9 .")
    ctx = " ".join(ctx)
    prefix = f"<s> w1 w2 {ctx} w3"
    return prefix, ctx, [f"{prefix} what is the secret code ?", f"{prefix} w5 w6 is what ?"]


def _prefilled(model, tok, prefix, ctx):
    """The transformers recipe "re-use a cache for several prompts": prefill the shared prefix once."""
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tok, prefix, contexts=ctx, queries="what is the secret code ?")
    with torch.no_grad():
        model(**inputs, **cache_kwargs(model, cache))
    return cache


@pytest.mark.parametrize("attn", ATTNS)
def test_deepcopy_of_a_filled_cache_continues_like_the_original(tiny_tokenizer, attn):
    model = make_tiny_llama(attn=attn, seed=4)
    prefix, ctx, prompts = _shared_prefix()
    full = [tiny_tokenizer(p, return_tensors="pt") for p in prompts]
    refs = [generate(model, _prefilled(model, tiny_tokenizer, prefix, ctx), f) for f in full]

    # the original deleted: the copy works alone
    original = _prefilled(model, tiny_tokenizer, prefix, ctx)
    copied = copy.deepcopy(original)
    del original
    gc.collect()
    out = generate(model, copied, full[0])
    assert torch.equal(out.sequences, refs[0].sequences)
    torch.testing.assert_close(logits(out), logits(refs[0]), rtol=1e-5, atol=1e-5)
    assert all(layer.cache is copied for layer in copied.layers)

    # the original reused for another prompt: neither disturbs the other
    original = _prefilled(model, tiny_tokenizer, prefix, ctx)
    first, second = copy.deepcopy(original), copy.deepcopy(original)
    out_first = generate(model, first, full[0])
    out_original = generate(model, original, full[1])
    out_second = generate(model, second, full[0])
    assert torch.equal(out_original.sequences, refs[1].sequences)
    for out in (out_first, out_second):
        assert torch.equal(out.sequences, refs[0].sequences)
        torch.testing.assert_close(logits(out), logits(refs[0]), rtol=1e-5, atol=1e-5)
    assert first.precision_map() == second.precision_map() == original.precision_map()
    assert first.nbytes() == second.nbytes()


def test_deepcopy_shares_the_encoder_and_copies_a_prepared_cache(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(50, needle_at=10)
    encoder = FakeEncoder()
    cache = CocktailCache(cfg(**QUANT), encoder=encoder)
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    copied = copy.deepcopy(cache)
    assert copied._encoder is encoder  # a stateless scorer: shared, never duplicated
    a, b = generate(tiny_llama, cache, inputs), generate(tiny_llama, copied, inputs)
    assert torch.equal(a.sequences, b.sequences) and cache.precision_map() == copied.precision_map()


# ------------------------------------------------------------------------- item 3: the prefill is the prepared prompt
@pytest.mark.parametrize("attn", ["cocktail", "sdpa"])
@pytest.mark.parametrize("other", ["same_length", "longer"])
def test_a_prefill_of_other_input_ids_is_refused(tiny_tokenizer, attn, other):
    model = make_tiny_llama(attn=attn)
    prompt, ctx, q = make_prompt(40, seed=1)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    words = prompt.split()
    if other == "same_length":
        words[-3] = "w77"  # one word of the question changed: same length, same padding, other ids
    else:
        words.insert(5, "w78")
    inputs = tiny_tokenizer(" ".join(words), return_tensors="pt")
    with pytest.raises(ValueError, match="differ from the prompt prepared by prepare_inputs"):
        generate(model, cache, inputs)


def test_a_batch_other_than_the_prepared_one_is_refused(tiny_llama, tiny_tokenizer):
    p1, c1, q1 = make_prompt(40, seed=1)
    p2, c2, q2 = make_prompt(40, seed=2)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    cache.prepare_inputs(tiny_tokenizer, [p1, p2], contexts=[c1, c2], queries=[q1, q2])
    other = CocktailCache(cfg(**QUANT)).prepare_inputs(tiny_tokenizer, [p2, p1], contexts=[c2, c1], queries=[q2, q1])
    with pytest.raises(ValueError, match=r"differ from the prompt prepared by prepare_inputs \(sequence 0"):
        generate(tiny_llama, cache, other)


def test_reset_clears_the_plans(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    generate(tiny_llama, cache, inputs)
    cache.reset()
    assert cache.plans == () and cache.get_seq_length() == 0
    # the next prefill is planned from what it embeds: a searching setting then needs a tokenizer for its query
    with pytest.raises(ValueError, match=r"without prepare_inputs and without a tokenizer.*cache.prepare_inputs"):
        generate(tiny_llama, cache, inputs)


@pytest.mark.parametrize("attn", ["cocktail", "sdpa"])
@pytest.mark.parametrize("config", [cfg(uniform_bits=16), cfg(**QUANT)], ids=["uniform16", "mixed"])
def test_chunked_prefill_applies_the_plan_once_the_prompt_is_complete(tiny_tokenizer, attn, config):
    """generate(prefill_chunk_size=...) gives what one prefill gives: chunks are kept at full precision until the
    prepared prompt is complete, then the plan is applied to the whole prompt at once."""
    p1, c1, q1 = make_prompt(60, seed=3, needle_at=12)
    p2, c2, q2 = make_prompt(33, seed=4, needle_at=4)
    model = make_tiny_llama(attn=attn)
    runs = []
    for chunk in (None, 16):
        cache = CocktailCache(config, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, [p1, p2], contexts=[c1, c2], queries=[q1, q2])
        runs.append((generate(model, cache, inputs, prefill_chunk_size=chunk), cache))
    (whole, wcache), (chunked, ccache) = runs
    assert torch.equal(whole.sequences, chunked.sequences)
    torch.testing.assert_close(logits(whole), logits(chunked), rtol=1e-4, atol=1e-4)
    assert ccache.precision_map() == wcache.precision_map() and ccache.nbytes() == wcache.nbytes()


def test_chunked_prefill_with_the_attention_scorer_is_refused_by_name(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(scorer="attention"))
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        generate(tiny_llama, cache, inputs, prefill_chunk_size=16)


def test_a_prefix_covering_the_context_then_generate_is_allowed(tiny_llama, tiny_tokenizer):
    """A forward over the prompt's first tokens (at least the context), then generate on the whole prompt: the same
    result as one prefill."""
    prompt, ctx, q = make_prompt(50, needle_at=7)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with torch.no_grad():
        tiny_llama(input_ids=inputs["input_ids"][:, : cache.plans[0].ctx_end + 1], **cache_kwargs(tiny_llama, cache))
    out = generate(tiny_llama, cache, inputs)
    ref_cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    ref = generate(tiny_llama, ref_cache, ref_cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q))
    assert torch.equal(out.sequences, ref.sequences) and cache.precision_map() == ref_cache.precision_map()


# ----------------------------------------------------------------------------- item 4: chunk texts are the document's
def _bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style) trained offline on a little CJK/emoji/ASCII text: CJK characters and
    emoji span several byte tokens, so chunk edges fall inside characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tk.train_from_iterator(
        ["東京は日本の首都です。大阪も大きな都市です。", "emoji 😀🎉 fun", "the question is what"], trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def _wordpiece_tokenizer():
    """A BERT-style WordPiece tokenizer (lowercasing, accent stripping, [UNK] for unknown words), built offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "[PAD]",
        "[UNK]",
        "the",
        "secret",
        "code",
        "is",
        "what",
        "?",
        ".",
        ",",
        "cafe",
        "paris",
        "in",
        "a",
        "doc",
        "##s",
        "##ing",
        "question",
        ":",
        "read",
        "open",
        "##ed",
    ]
    tk = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")


def _covered_context(prompt, plan, offsets):
    """The prompt's characters from the first to the last token of the plan's chunked span."""
    return prompt[int(offsets[plan.ctx_start, 0]) : int(offsets[plan.ctx_end - 1, 1])]


@pytest.mark.parametrize("sink, recent", [(0, 0), (4, 3)])
def test_chunk_texts_of_a_byte_level_bpe_document_are_its_characters(sink, recent):
    tok = _bpe_tokenizer()
    pieces = ["東京は", "日本の", "首都です。", "😀", "🎉", "大阪も", "大きな", "都市です。", " the question "]
    rng = random.Random(0)
    ctx = "".join(rng.choice(pieces) for _ in range(60)).strip()  # no whitespace outside the document's tokens
    prompt = f"Doc:\n{ctx}\nQ: what?"
    config = cfg(uniform_bits=4, chunk_size=5, sink_tokens=sink, recent_tokens=recent)
    cache = CocktailCache(config)
    cache.prepare_inputs(tok, prompt, contexts=ctx, queries="what?")
    plan = cache.plans[0]
    offsets = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
    offsets = torch.tensor(offsets)
    decoded = [
        tok.decode(tok(prompt)["input_ids"][a:b]) for a, b in (plan.chunk_range(i, 5) for i in range(plan.num_chunks))
    ]
    assert sum("\ufffd" in t for t in decoded) >= 3  # the decode of a token slice would cut characters here
    assert plan.num_chunks >= 10 and not any("\ufffd" in t for t in plan.chunk_texts)
    assert "".join(plan.chunk_texts) == _covered_context(prompt, plan, offsets)
    if sink == recent == 0:
        assert "".join(plan.chunk_texts) == ctx


def test_chunk_texts_of_a_wordpiece_document_keep_case_accents_and_unknown_words():
    tok = _wordpiece_tokenizer()
    ctx = "The Secret code is in a Café in Paris, Zanzibar docs opened. Reading the Code: what?"
    prompt = f"doc : {ctx} question : what is the secret code ?"
    cache = CocktailCache(cfg(uniform_bits=2, chunk_size=4, sink_tokens=0))
    cache.prepare_inputs(tok, prompt, contexts=ctx, queries="what is the secret code ?")
    plan = cache.plans[0]
    assert "".join(plan.chunk_texts) == ctx
    assert plan.chunk_texts[0] == "The Secret code is"
    assert not any("[UNK]" in t for t in plan.chunk_texts)


# ----------------------------------------------------------------------------- item 5: MLA models
def _tiny_deepseek(version):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    common = dict(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        attn_implementation="cocktail",
    )
    torch.manual_seed(0)
    if version == 2:
        return DeepseekV2ForCausalLM(DeepseekV2Config(**common, n_shared_experts=1)).eval()
    return DeepseekV3ForCausalLM(DeepseekV3Config(**common, n_shared_experts=1, n_group=1, topk_group=1)).eval()


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("attn", ["cocktail", "sdpa"])
def test_mla_models_are_refused_naming_the_model_and_the_head_dims(tiny_tokenizer, version, attn):
    model = _tiny_deepseek(version)
    model.config._attn_implementation = attn
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(uniform_bits=2), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with pytest.raises(ValueError, match=rf"deepseek_v{version}.*keys and values have different head dims: K 64, V 32"):
        generate(model, cache, inputs)
    # load_prefill of such a model's DynamicCache is refused the same way (the model type is then unknown)
    dyn = DynamicCache()
    with torch.no_grad():
        model(**inputs, **cache_kwargs(model, dyn))
    with pytest.raises(ValueError, match="keys and values have different head dims: K 64, V 32"):
        CocktailCache(cfg(uniform_bits=2)).load_prefill(dyn)


# ----------------------------------------------------------------------------- item 6: smaller checks
@pytest.mark.parametrize("value", [4.0, 16.0, 2.0])
def test_uniform_bits_must_be_an_int(value):
    with pytest.raises(ValueError, match=rf"uniform_bits must be one of None, 16, 4, 3, 2, got {value!r}"):
        CocktailConfig(uniform_bits=value)


def test_full_precision_layers_out_of_range_are_refused_at_prefill(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(uniform_bits=2, full_precision_layers=[0, 2]), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with pytest.raises(ValueError, match=r"full_precision_layers \(0, 2\).*the model has 2 layers"):
        generate(tiny_llama, cache, inputs)
    dyn = DynamicCache()
    with torch.no_grad():
        tiny_llama(**inputs, **cache_kwargs(tiny_llama, dyn))
    with pytest.raises(ValueError, match=r"full_precision_layers \(0, 2\).*the model has 2 layers"):
        cache.load_prefill(dyn)


def test_config_fields_are_validated_on_assignment():
    config = CocktailConfig()
    for name, bad in [
        ("chunk_size", 0),
        ("uniform_bits", 5),
        ("low_bits", 4),
        ("uniform_bits", 4.0),
        ("alpha", 2.0),
        ("full_precision_layers", [-1]),
        ("scorer", "tfidf"),
    ]:
        before = getattr(config, name)
        with pytest.raises(ValueError, match=name):
            setattr(config, name, bad)
        assert getattr(config, name) == before  # a refused value is not kept
    config.beta = 0.2
    config.full_precision_layers = [3, 1, 1]
    assert config.beta == 0.2 and config.full_precision_layers == (1, 3)
    assert config == CocktailConfig(beta=0.2, full_precision_layers=(1, 3))
    assert dataclasses.replace(config, alpha=0.5).alpha == 0.5
    with pytest.raises(ValueError, match="alpha \\+ beta"):
        config.alpha = 0.9  # the checks across fields run too
    assert config.alpha == 0.6


def test_a_context_present_twice_is_refused_naming_the_count(tiny_tokenizer):
    ctx = random_text(20, seed=5)
    prompt = f"<s> w1 {ctx} w2 {ctx} what is the code ?"
    with pytest.raises(ValueError, match=r"contexts\[0\] appears 2 times in prompts\[0\]"):
        CocktailCache(cfg()).prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries="what is the code ?")


def test_precision_map_under_beam_search_has_one_row_per_beam(tiny_llama, tiny_tokenizer):
    p1, c1, q1 = make_prompt(50, seed=6, needle_at=10)
    p2, c2, q2 = make_prompt(30, seed=7, needle_at=2)
    cache = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, [p1, p2], contexts=[c1, c2], queries=[q1, q2])
    generate(tiny_llama, cache, inputs, num_beams=3)
    rows = cache.precision_map()
    assert len(rows) == 6 and rows[0] == rows[1] == rows[2] and rows[3] == rows[4] == rows[5]
    alone = CocktailCache(cfg(**QUANT), encoder=FakeEncoder())
    generate(tiny_llama, alone, alone.prepare_inputs(tiny_tokenizer, p2, contexts=c2, queries=q2))
    assert rows[3] == alone.precision_map()[0]
    doc = CocktailCache.precision_map.__doc__
    assert "beam" in doc and "num_return_sequences" in doc
