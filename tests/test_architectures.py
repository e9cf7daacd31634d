"""Model coverage: tiny random models of many architectures, full-attention, sliding-window and hybrid.

For each: ``uniform_bits=16`` reproduces the model's own default cache (``DynamicCache(config=model.config)``, whose
sliding layers keep only their window), and the paper settings (a real FP16/INT4/INT2 mix) under
``attn_implementation="cocktail"`` equal the dequantized reference (the same cache under ``"sdpa"``/``"eager"``,
which attends over the dequantized, original-order keys and values).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache import layout
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import TINY_CONFIG, FakeEncoder, make_prompt

COMMON = dict(TINY_CONFIG, num_hidden_layers=4)
W = 16  # sliding window of the sliding-window models (the prompts are ~100 tokens: the window matters)
ALT = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CAP = 1.0  # soft-cap and scale (query_pre_attn_scalar 1) that bend the tiny models' scores, as 50 does real ones

# name: (config class, model class, config overrides, attention implementations to test)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ("cocktail", "sdpa")),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, ("cocktail", "sdpa")),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": W}, ("cocktail", "sdpa")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ("cocktail", "sdpa")),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 2},
        ("cocktail", "sdpa"),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, ("cocktail", "sdpa")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, ("cocktail", "sdpa")),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}, ("cocktail", "sdpa")),
    # Gemma 2 soft-caps its attention logits: the split-precision kernels soft-cap too (eager prefill)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": W, "attn_logit_softcapping": CAP, "query_pre_attn_scalar": 1},
        ("cocktail", "eager"),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": W, "layer_types": ALT},
        ("cocktail", "sdpa"),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, ("cocktail", "sdpa")),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}, ("cocktail", "sdpa")),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, ("cocktail", "sdpa")),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, ("cocktail", "sdpa")),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, ("cocktail", "sdpa")),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": W}, ("cocktail", "sdpa")),
    "alternating": (
        "Qwen2Config",
        "Qwen2ForCausalLM",  # gpt-oss-style alternating sliding / full layers
        {"use_sliding_window": True, "sliding_window": W, "layer_types": ALT},
        ("cocktail", "sdpa"),
    ),
    # attention sinks (s_aux) on its full layers, sliding layers beside them
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "sliding_window": W, "layer_types": ALT, "num_local_experts": 2, "num_experts_per_tok": 1},
        ("cocktail", "eager"),
    ),
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        {"sliding_window": W, "layer_types": ALT},
        ("cocktail", "eager"),
    ),
    "vaultgemma": (  # soft-capped logits, as Gemma 2
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": W,
            "layer_types": ALT,
            "attn_logit_softcapping": CAP,
            "query_pre_attn_scalar": 1,
        },
        ("cocktail", "eager"),
    ),
    # EXAONE 4 sets module.sliding_window on every layer and passes sliding_window=None to its full-attention ones
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": W, "layer_types": ALT}, ("cocktail", "sdpa")),
    # attention beside Mamba in every layer: Cocktail layers that also hold the Mamba states
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16},
        ("cocktail", "sdpa"),
    ),
    "lfm2_hybrid": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "norm_eps": 1e-5},
        ("cocktail", "sdpa"),
    ),
}
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)


def make_model(name: str, attn: str, seed: int = 0):
    cfg_name, model_name, overrides, _ = ARCHS[name]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    kwargs = {**COMMON, **overrides}
    if name == "lfm2_hybrid":
        kwargs["full_attn_idxs"] = [1, 3]
        kwargs["block_ff_dim"] = kwargs["intermediate_size"]
    torch.manual_seed(seed)
    config = cfg_cls(**kwargs)
    config._attn_implementation = attn
    return model_cls(config).eval()


def generate(model, tok, cache, prompt, ctx, q):
    if isinstance(cache, CocktailCache):
        inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=q)
    else:
        inputs = tok(prompt, return_tensors="pt")
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return out.sequences, torch.stack(out.logits)


CASES = [(name, attn) for name, (*_, attns) in ARCHS.items() for attn in attns]


@pytest.mark.parametrize("name,attn", CASES)
def test_uniform16_equals_the_models_default_cache(tiny_tokenizer, name, attn):
    prompt, ctx, q = make_prompt(90, needle_at=45)
    model = make_model(name, attn)
    ref_seq, ref_logits = generate(model, tiny_tokenizer, DynamicCache(config=model.config), prompt, ctx, q)
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16), encoder=FakeEncoder())
    seq, logits = generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    default = DynamicCache(config=model.config)
    assert [type(layer) for layer in cache.layers if not isinstance(layer, CocktailLayer)] == [
        type(layer) for layer in default.layers if not layout.quantizes(layer)
    ]  # sliding / linear-attention / convolution layers are the model's own


ALL_SLIDING = ("mistral_window", "starcoder2")  # every layer sliding: nothing for Cocktail to quantize


@pytest.mark.parametrize(
    "name", [n for n, (*_, attns) in ARCHS.items() if "cocktail" in attns and n not in ALL_SLIDING]
)
def test_paper_settings_under_cocktail_equal_the_dequantized_reference(tiny_tokenizer, name):
    prompt, ctx, q = make_prompt(90, needle_at=45)
    outs = {}
    reference = ARCHS[name][3][1]  # "sdpa", or "eager" for soft-capped logits and attention sinks
    for attn in ("cocktail", reference):
        cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3), encoder=FakeEncoder())
        outs[attn] = generate(make_model(name, attn), tiny_tokenizer, cache, prompt, ctx, q)
        assert {16, 4, 2} == set(cache.precision_map()[0])
        assert any(isinstance(layer, CocktailLayer) and layer.store.segments[1].num_tokens for layer in cache.layers)
    assert torch.equal(outs["cocktail"][0], outs[reference][0])
    torch.testing.assert_close(outs["cocktail"][1], outs[reference][1], rtol=1e-4, atol=1e-4)


def test_sliding_layers_keep_only_their_window_and_the_report_compares_with_the_default_cache(tiny_tokenizer):
    prompt, ctx, q = make_prompt(200)
    model = make_model("gemma3", "cocktail")
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=2), encoder=FakeEncoder())
    generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    sliding = [layer for layer in cache.layers if not isinstance(layer, CocktailLayer)]
    assert len(sliding) == 2 and all(layer.keys.shape[2] < W + 4 for layer in sliding)
    default = DynamicCache(config=model.config)
    generate(model, tiny_tokenizer, default, prompt, ctx, q)
    default_fp16 = sum(layer.keys.numel() * 2 * 2 for layer in default.layers)
    rep = cache.memory_report()
    assert rep["fp16_equivalent_bytes"] == default_fp16  # what the model's own cache holds, at 2 bytes
    # fp32 model; the storages behind the window views and the layers' other tensors count too (test_memory walks
    # every tensor reachable from the cache)
    window = sum(layer.keys.numel() * 4 * 2 for layer in sliding)
    assert window <= rep["native_layers_bytes"] <= window + 2 * 4 * 2 * sliding[0].keys[0, :, :1].numel() + 64
    assert cache.nbytes() == rep["total_bytes"]
    assert rep["ratio_to_fp16"] < 0.75


@pytest.mark.parametrize("name", ALL_SLIDING)
def test_all_sliding_models_keep_the_default_cache_and_say_so(tiny_tokenizer, name, caplog):
    prompt, ctx, q = make_prompt(60)
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3), encoder=FakeEncoder())
    with caplog.at_level("WARNING"):
        generate(make_model(name, "cocktail"), tiny_tokenizer, cache, prompt, ctx, q)
    assert not any(isinstance(layer, CocktailLayer) for layer in cache.layers)
    assert "no full-attention layer" in caplog.text


def test_a_shared_prefill_of_a_sliding_model_branches_into_a_cocktail_cache(tiny_tokenizer):
    """load_prefill from the model's own DynamicCache keeps the sliding layers as they are (copied) and quantizes
    the full-attention ones: the next step equals a plain generate with a Cocktail cache."""
    prompt, ctx, q = make_prompt(90, needle_at=45)
    model = make_model("gemma3", "cocktail")
    cfg = CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3)
    _, ref_logits = generate(model, tiny_tokenizer, CocktailCache(cfg, encoder=FakeEncoder()), prompt, ctx, q)
    branched = CocktailCache(cfg, encoder=FakeEncoder(), model_config=model.config)
    inputs = branched.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    shared = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(**inputs, **cache_kwargs(model, shared)).logits[:, -1]
        branched.load_prefill(shared)
        step = model(input_ids=first.argmax(-1, keepdim=True), **cache_kwargs(model, branched)).logits[:, -1]
    assert [isinstance(layer, CocktailLayer) for layer in branched.layers] == [False, True, False, True]
    assert branched.layers[0] is not shared.layers[0]
    torch.testing.assert_close(first, ref_logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, ref_logits[1], rtol=1e-4, atol=1e-4)
