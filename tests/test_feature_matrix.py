"""The smaller items of issue 29: recent_tokens longer than the context, salient_tokens refused under sdpa/eager before
the prefill does any work and when every full-attention layer is at full precision, layer_bits per full-attention
layer on models with sliding layers, and the messages' grammar."""

import re

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.layer_bits import check_layer_count

from .conftest import FakeEncoder, make_prompt, make_tiny_llama
from .test_architectures import make_model

BASE = dict(chunk_size=8, group_size=16, alpha=0.3, beta=0.3)


def test_recent_tokens_covering_the_context_is_a_clear_error(tiny_tokenizer):
    prompt, ctx, q = make_prompt(30)  # 30 context tokens, none of them sinks (the prompt starts with 4 others)
    cache = CocktailCache(CocktailConfig(**BASE, recent_tokens=29), encoder=FakeEncoder())
    assert cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q) is not None
    assert cache.plans[0].ctx_end - cache.plans[0].ctx_start == 1
    cache = CocktailCache(CocktailConfig(**BASE, recent_tokens=30), encoder=FakeEncoder())
    with pytest.raises(ValueError, match=r"recent_tokens=30 .* contexts\[0\] has only 30 token\(s\) after the sink"):
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)


class CountingForward:
    """Counts the decoder layers that ran (a forward pre-hook on each)."""

    def __init__(self, model):
        self.calls = 0
        for layer in model.model.layers:
            layer.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("field", ["salient_tokens", "scorer"])
def test_prefill_attention_readers_are_refused_under_sdpa_and_eager_before_the_prefill(tiny_tokenizer, attn, field):
    extra = {"salient_tokens": 0.1} if field == "salient_tokens" else {"scorer": "attention"}
    model = make_tiny_llama(attn=attn, head_dim=32)
    layers = CountingForward(model)
    prompt, ctx, q = make_prompt(60)
    cache = CocktailCache(CocktailConfig(**BASE, **extra), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with pytest.raises(ValueError, match=rf"read\(s\) the prefill attention.*attn_implementation='{attn}'"):
        model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=3, do_sample=False)
    assert layers.calls == 1 and all(layer.store is None and layer.deferred is None for layer in cache.layers)
    # known from the cache's model_config: refused at prepare_inputs already
    cache = CocktailCache(CocktailConfig(**BASE, **extra), encoder=FakeEncoder(), model_config=model.config)
    with pytest.raises(ValueError, match="read\\(s\\) the prefill attention"):
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)


def test_salient_tokens_with_every_full_attention_layer_at_full_precision_is_refused(tiny_tokenizer):
    prompt, ctx, q = make_prompt(60)
    cases = [(make_tiny_llama(head_dim=32), (0, 1)), (make_model("gemma3", "cocktail"), (1, 3))]  # gemma3: 1, 3 full
    for model, layers in cases:
        cache = CocktailCache(CocktailConfig(**BASE, salient_tokens=0.1, full_precision_layers=layers))
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        with pytest.raises(
            ValueError, match=re.escape(f"salient_tokens=0.1 has no effect with full_precision_layers={layers}")
        ):
            model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)
    model = make_model("gemma3", "cocktail")  # one full-attention layer left with packed tokens: fine
    cache = CocktailCache(CocktailConfig(**BASE, salient_tokens=0.1, full_precision_layers=(1,)), FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)
    packed = [sum(s.num_tokens for s in cache.layers[i].store.segments) for i in (1, 3)]
    assert packed[0] == 0 < packed[1]


def test_layer_bits_per_full_attention_layer_on_a_model_with_sliding_layers(tiny_tokenizer):
    """gemma3 here: layers 0 and 2 sliding, 1 and 3 full attention. Two pairs (one per full-attention layer) give the
    same cache as four (one per layer, the sliding layers' entries unused)."""
    prompt, ctx, q = make_prompt(90, needle_at=40)
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    runs = []
    for layer_bits in (((4, 4), (4, 3), (4, 4), (2, 2)), ((4, 3), (2, 2))):
        model = make_model("gemma3", "cocktail")
        cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=4, layer_bits=layer_bits))
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        runs.append((model.generate(**inputs, **cache_kwargs(model, cache), **gen), cache))
    (a, ca), (b, cb) = runs
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=0, atol=0)
    assert [s.bits for s in cb.layers[3].store.segments][:1] == [2]  # layer 3 takes the second pair: INT2 keys
    assert cb.layers[1].store.segments[0].value_bits == 3
    model = make_model("gemma3", "cocktail")
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=4, layer_bits=((4, 3),) * 3))
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    msg = r"3 entries but the model has 4 layers, 2 of them full-attention .* per layer \(4\) or one per full-attention"
    with pytest.raises(ValueError, match=msg):
        model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)


def test_layer_count_messages_say_entry_or_entries():
    with pytest.raises(ValueError, match=r"layer_bits has 1 entry but the model has 2 layers"):
        check_layer_count(((4, 4),), 2)
    with pytest.raises(ValueError, match=r"layer_bits has 3 entries but the model has 2 layers"):
        check_layer_count(((4, 4),) * 3, 2)
    check_layer_count(((4, 4),) * 2, 4, [1, 3])
