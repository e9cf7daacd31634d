"""Gemma 3 270M's shapes on the fused CPU path: head dim 256, one KV head, four query heads, sliding and global
layers. A tiny random Gemma 3 with those attention shapes decodes under ``attn_implementation="cocktail"`` with the
recommended formats (rotated storage, 8-bit scales and zeros, 8-bit full part, salient tokens); every decode step
of every Cocktail layer must run the fused kernel (no fallback warning, the kernel called), and the tokens and
logits equal the PyTorch reference path's (``backend="torch"``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import cpu_ops
import cpu_ops.attention as cpu_attention
from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import FakeEncoder, make_prompt

if not cpu_ops.available():
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)

GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)


def gemma_270m_shaped(seed=0):
    """Gemma 3 270M's attention shapes (D=256, H_kv=1, H_q=4; sliding window and global layers), tiny otherwise."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        pad_token_id=0,
    )
    config._attn_implementation = "cocktail"
    return transformers.Gemma3ForCausalLM(config).eval()


def run(model, tok, backend):
    prompt, ctx, q = make_prompt(90, needle_at=45)
    config = CocktailConfig.recommended(
        chunk_size=8,
        group_size=32,
        scale_bits=8,
        full_part_bits=8,
        salient_tokens=0.05,
        backend=backend,
        rotation="hadamard",
    )
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=q)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return out, cache


def test_gemma3_270m_shapes_decode_on_the_fused_kernel(tiny_tokenizer, monkeypatch):
    model = gemma_270m_shaped()
    calls = []
    real = cpu_attention.split_precision_attention_prepared  # the decode dispatch's entry into the kernel

    def spy(query, *args, **kwargs):
        rotated = all(m.numel() for m in args[3].rotation[:2])  # args[3]: the prepared arguments (query, output)
        calls.append((tuple(query.shape), kwargs.get("full_scales") is not None, rotated))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "split_precision_attention_prepared", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the PyTorch path warns
        fused, cache = run(model, tiny_tokenizer, "auto")
    layers = [layer for layer in cache.layers if isinstance(layer, CocktailLayer)]
    assert len(layers) == 2 and all(layer.store.segments[0].scale_bits == 8 for layer in layers)
    assert len(calls) == (GEN["max_new_tokens"] - 1) * len(layers)  # every decode step of every Cocktail layer
    assert all(shape[1:] == (4, 1, 256) and f8 and rot for shape, f8, rot in calls)
    monkeypatch.undo()
    ref, _ = run(model, tiny_tokenizer, "torch")
    assert torch.equal(fused.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)


def test_eval_branch_of_a_hybrid_shared_prefill_keeps_its_sliding_layers(tiny_tokenizer):
    """The speed benchmarks branch one DynamicCache prefill into every method's cache: a sliding layer (holding only
    its window) stays the model's layer in the Cocktail cache, the global ones are quantized (it raised before:
    the sliding layer's window was taken for the whole prompt), and the branch decodes like a direct prefill."""
    from eval.benchmarks.rounds import SharedPrefill, branch_runner, resolve_method
    from eval.methods.branching import prefill
    from eval.methods.kinds import Request

    model = gemma_270m_shaped()
    prompt, ctx, q = make_prompt(90, needle_at=45)
    ids = tiny_tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 16  # longer than the window of the sliding layers
    with torch.no_grad():
        dyn, logits = prefill(model, ids)
    shared = SharedPrefill(Request(prompt, ctx, q, "t", {}), ids, dyn, logits, 0.0)
    runner = branch_runner(resolve_method("int4"), model, tiny_tokenizer, shared)
    kinds = [isinstance(layer, CocktailLayer) for layer in runner.cache.layers]
    assert kinds == [False, True, False, True]
    runner.decode(model, 3, 0)
    assert runner.ids.shape == (1, ids.shape[1] + 4)
