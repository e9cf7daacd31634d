"""Every family the README lists as supported, as a tiny random model (2 layers, hidden 64): a uniform 16-bit
``CocktailCache`` under ``attn_implementation="cocktail"`` gives the greedy tokens and logits of the model's own
cache (``DynamicCache(config=model.config)``) under eager attention. The README's "Supported models" list is
checked against :data:`FAMILIES` (``test_the_readme_lists_every_tested_family``)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.cache.layout import HybridCocktailLayer, hybrid_state_tensors
from hf_cocktail.integration.attention import layer_window
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import TINY_CONFIG, FakeEncoder, make_prompt

COMMON = dict(TINY_CONFIG, num_hidden_layers=2)
W = 16  # sliding window (the prompts are ~90 tokens: the window matters)
SF = ["sliding_attention", "full_attention"]
CAP = 1.0  # soft-cap and scale (query_pre_attn_scalar 1) that bend the tiny models' scores, as 50 does real ones

# README name: (model type, config overrides); the config and model classes come from transformers' auto mappings
FAMILIES: dict[str, tuple[str, dict]] = {
    "Llama": ("llama", {}),
    "Mistral": ("mistral", {"sliding_window": None}),
    "Mixtral": ("mixtral", {"sliding_window": None, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "Qwen2": ("qwen2", {}),
    "Qwen2-MoE": ("qwen2_moe", {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}),
    "Qwen3": ("qwen3", {"head_dim": 16}),
    "Qwen3-MoE": ("qwen3_moe", {"head_dim": 16, "num_experts": 2, "num_experts_per_tok": 1}),
    "Qwen3-Next": (
        "qwen3_next",
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
    "Phi-3": ("phi3", {}),
    "Gemma": ("gemma", {"head_dim": 16}),
    "Gemma 2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": W,
            "layer_types": SF,
            "attn_logit_softcapping": CAP,
            "query_pre_attn_scalar": 1,
        },
    ),
    "Gemma 3": ("gemma3_text", {"head_dim": 16, "sliding_window": W, "layer_types": SF}),
    "VaultGemma": (
        "vaultgemma",
        {
            "head_dim": 16,
            "sliding_window": W,
            "layer_types": SF,
            "attn_logit_softcapping": CAP,
            "query_pre_attn_scalar": 1,
        },
    ),
    "OLMo 2": ("olmo2", {}),
    "OLMo 3": ("olmo3", {"sliding_window": W, "layer_types": SF}),
    "Granite": ("granite", {}),
    "Granite-SWA": ("granite_swa", {"sliding_window": W, "layer_types": SF}),
    "StableLM": ("stablelm", {}),
    "GPT-NeoX": ("gpt_neox", {}),
    "Cohere": ("cohere", {}),
    "Cohere 2": ("cohere2", {"sliding_window": W, "layer_types": SF}),
    "SmolLM3": ("smollm3", {}),
    "GLM-4": ("glm4", {}),
    "StarCoder2": ("starcoder2", {"sliding_window": None}),
    "EXAONE 4": ("exaone4", {"sliding_window": W, "layer_types": SF}),
    "EXAONE-MoE": (
        "exaone_moe",
        {
            "head_dim": 16,
            "sliding_window": W,
            "layer_types": SF,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    ),
    "Kolibri": ("kolibri1", {"head_dim": 16, "sliding_window": W, "layer_types": SF}),
    "Llama 4": (
        "llama4_text",
        {
            "head_dim": 16,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 96,
            "layer_types": ["chunked_attention", "full_attention"],
            "attention_chunk_size": W,
            "no_rope_layers": [1, 0],
        },
    ),
    "gpt-oss": (
        "gpt_oss",
        {"head_dim": 16, "sliding_window": W, "layer_types": SF, "num_local_experts": 2, "num_experts_per_tok": 1},
    ),
    "LFM2": ("lfm2", {"layer_types": ["conv", "full_attention"], "norm_eps": 1e-5}),
    "Falcon-H1": ("falcon_h1", {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16}),
}
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)


def make_model(model_type: str, overrides: dict, attn: str, seed: int = 0):
    """A tiny random model of ``model_type`` (fp32, eval mode)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    config_cls = CONFIG_MAPPING[model_type]
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = attn
    return model_cls(config).eval()


def generate(model, tok, cache, prompt, ctx, q):
    if isinstance(cache, CocktailCache):
        inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=q)
    else:
        inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_uniform16_under_cocktail_equals_the_models_own_cache(tiny_tokenizer, family):
    model_type, overrides = FAMILIES[family]
    prompt, ctx, q = make_prompt(90, needle_at=45)
    model = make_model(model_type, overrides, "eager")
    ref_seq, ref_logits = generate(model, tiny_tokenizer, DynamicCache(config=model.config), prompt, ctx, q)
    model.config._attn_implementation = "cocktail"
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16), encoder=FakeEncoder())
    seq, logits = generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    assert torch.equal(seq, ref_seq)
    # fp32 both ways, other summation orders: at most 3.4e-7 apart over these families; a sink or a soft-cap left
    # out moves the logits of these tiny models by 1.4e-5 or more
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=2e-6)
    assert any(isinstance(layer, CocktailLayer) for layer in cache.layers)  # something is Cocktail's to compress
    assert any(isinstance(layer, CocktailLayer) and layer.path.value == "split" for layer in cache.layers)


def test_the_readme_lists_every_tested_family():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    section = readme.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"under `attn_implementation=\"cocktail\"` on tiny random (.*?) models", section, re.S)
    assert listed, "the README's Supported models section must name the tested families"
    names = [n.strip() for n in re.split(r",\s*|\s+and\s+", " ".join(listed.group(1).split()))]
    assert names == list(FAMILIES)


def test_diffllama_is_refused_under_cocktail_and_exact_under_sdpa(tiny_tokenizer):
    """DiffLlama splits the values across heads after ``cache.update``: the split path, which reads the stored values,
    refuses it; under sdpa the Cocktail cache hands out the dequantized cache and equals the model's own."""
    prompt, ctx, q = make_prompt(60, needle_at=30)
    model = make_model("diffllama", {}, "sdpa")
    ref_seq, ref_logits = generate(model, tiny_tokenizer, DynamicCache(config=model.config), prompt, ctx, q)
    cfg = CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16)
    seq, logits = generate(model, tiny_tokenizer, CocktailCache(cfg, encoder=FakeEncoder()), prompt, ctx, q)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    model.config._attn_implementation = "cocktail"
    with pytest.raises(ValueError, match="DiffLlamaAttention.*transforms the values.*attn_implementation='sdpa'"):
        generate(model, tiny_tokenizer, CocktailCache(cfg, encoder=FakeEncoder()), prompt, ctx, q)


def test_mpt_is_refused_under_cocktail_naming_the_alternative(tiny_tokenizer):
    prompt, ctx, q = make_prompt(30)
    model = make_model("mpt", {"d_model": 64, "n_heads": 4, "n_layers": 2}, "cocktail")
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16), encoder=FakeEncoder())
    with pytest.raises(ValueError, match="does not support MPT.*attn_implementation='eager'"):
        generate(model, tiny_tokenizer, cache, prompt, ctx, q)


def test_the_window_is_what_the_call_uses_not_the_module_attribute():
    """EXAONE 4 sets ``sliding_window`` on every attention module and passes ``sliding_window=None`` to its
    full-attention layers; without the keyword, the config's layer type decides."""

    class Attention(torch.nn.Module):
        def __init__(self, layer_idx, layer_types):
            super().__init__()
            self.layer_idx, self.sliding_window = layer_idx, W
            self.config = type("Config", (), {"layer_types": layer_types})()

    full, sliding = Attention(1, SF), Attention(0, SF)
    assert layer_window(full, {"sliding_window": None}) is None
    assert layer_window(sliding, {"sliding_window": W}) == W
    assert layer_window(full, {}) is None and layer_window(sliding, {}) == W
    assert layer_window(Attention(0, None), {}) == W  # no layer types: the attribute


def test_falcon_h1_attention_is_compressed_beside_its_mamba_states(tiny_tokenizer):
    """Falcon-H1 runs attention beside Mamba in every layer: each becomes a Cocktail layer that also holds the
    Mamba states (counted in the bytes held), and ``recommended()`` compresses its keys and values: ratio to FP16
    below 0.6 with a Mamba state of 16 per channel (the real models' 256 against their far larger per-token keys
    and values: a state of the same small share)."""
    prompt, ctx, q = make_prompt(300, needle_at=150)
    model_type, overrides = FAMILIES["Falcon-H1"]
    model = make_model(model_type, {**overrides, "mamba_d_state": 16}, "cocktail")
    cache = CocktailCache(CocktailConfig.recommended(), encoder=FakeEncoder())
    generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    assert all(isinstance(layer, HybridCocktailLayer) for layer in cache.layers)
    states = hybrid_state_tensors(cache.layers)
    conv_and_ssm = [t for layer in cache.layers for t in (layer.conv_states[0], layer.recurrent_states[0])]
    assert all(layer.has_previous_state[0] for layer in cache.layers)
    assert all(any(t is s for s in states) for t in conv_and_ssm)
    rep = cache.memory_report()
    assert rep["native_layers_bytes"] == sum(t.numel() * t.element_size() for t in states)  # held, so counted
    assert rep["ratio_to_fp16"] < 0.6


def test_head_dim_16_takes_the_default_group_size_at_16_bits(tiny_tokenizer):
    prompt, ctx, q = make_prompt(60)
    model = make_model("qwen3", {"head_dim": 16}, "cocktail")
    ref_seq, ref_logits = generate(model, tiny_tokenizer, DynamicCache(config=model.config), prompt, ctx, q)
    cache = CocktailCache(CocktailConfig(uniform_bits=16), encoder=FakeEncoder())  # default group_size
    seq, logits = generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_cpm_ant_is_refused_saying_why(tiny_tokenizer):
    prompt, ctx, q = make_prompt(30)
    model = make_model(
        "cpmant", {"dim_model": 64, "num_heads": 4, "dim_head": 16, "dim_ff": 96, "num_layers": 2}, "eager"
    )
    cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16), encoder=FakeEncoder())
    with pytest.raises(ValueError, match="does not support CPM-Ant: its forward puts its own prompt tokens"):
        generate(model, tiny_tokenizer, cache, prompt, ctx, q)


def test_rotation_matrices_of_wide_heads_are_built_once_and_shared(tiny_tokenizer):
    """Gemma 4's global layers have head dim 512: their rotation matrices (1 MiB per key/value head in fp32) are
    built once per (heads, head dim, seed, device) in the process and shared by every layer and every cache."""
    prompt, ctx, q = make_prompt(40)
    model = make_model("llama", {"head_dim": 512, "num_attention_heads": 2, "num_key_value_heads": 1}, "cocktail")
    caches = [CocktailCache(CocktailConfig.recommended(), encoder=FakeEncoder()) for _ in range(2)]
    for cache in caches:
        generate(model, tiny_tokenizer, cache, prompt, ctx, q)
    rotations = [layer.store.rotation for cache in caches for layer in cache.layers]
    mats = {id(m) for r in rotations for m in (r.keys, r.values) if m is not None}  # "auto" may leave keys unrotated
    assert len(mats) == 1  # one tensor for 2 layers x 2 caches, keys and values
    assert caches[0].memory_report()["rotation_bytes"] == 512 * 512 * 4  # one head's matrix, counted once per cache


def test_falcon_h1_beam_search_reorders_the_mamba_states_with_the_store(tiny_tokenizer):
    """Beams reorder a HybridCocktailLayer's store and its Mamba states together: the beams and beam scores of the
    model's own cache (equal here; 6e-5 apart where the tiny random Mamba's states are not reordered)."""
    prompt, ctx, q = make_prompt(60, needle_at=30)
    model = make_model(*FAMILIES["Falcon-H1"], "eager")
    beams = dict(
        max_new_tokens=8,
        do_sample=False,
        num_beams=4,
        num_return_sequences=4,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        dyn = cache_kwargs(model, DynamicCache(config=model.config))
        ref = model.generate(**tiny_tokenizer(prompt, return_tensors="pt"), **dyn, **beams)
        model.config._attn_implementation = "cocktail"
        cache = CocktailCache(CocktailConfig(chunk_size=8, group_size=16, uniform_bits=16), encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        out = model.generate(**inputs, **cache_kwargs(model, cache), **beams)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0, atol=1e-6)
