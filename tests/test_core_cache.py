"""The CocktailCache contract and its equivalences on tiny random Llama models (CPU, fp32 unless stated)."""

import logging

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.store import FullPart, LayerStore, PackedSegment

from .conftest import ConstEncoder, FakeEncoder, make_prompt, make_tiny_llama

GEN = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)


def cfg(**kw):
    kw.setdefault("chunk_size", 8)
    kw.setdefault("group_size", 16)
    kw.setdefault("backend", "torch")
    return CocktailConfig(**kw)


def run(model, tok, prompts, contexts, queries, config, encoder=None):
    cache = CocktailCache(config, encoder=encoder or FakeEncoder())
    inputs = cache.prepare_inputs(tok, prompts, contexts=contexts, queries=queries)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return out, cache, inputs


def dynamic(model, tok, prompt):
    inputs = tok(prompt, return_tensors="pt")
    return model.generate(**inputs, **cache_kwargs(model, DynamicCache()), **GEN)


def logits(out):
    return torch.stack(out.logits, 1)


# ----------------------------------------------------------------------------- contract
def test_prepare_inputs_locates_context_and_chunks(tiny_tokenizer):
    prompt, ctx, q = make_prompt(45)
    cache = CocktailCache(cfg())
    enc = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    plan = cache.plans[0]
    ids = enc["input_ids"][0]
    assert tiny_tokenizer.decode(ids[plan.ctx_start : plan.ctx_end]) == ctx
    assert plan.num_chunks == 6 and plan.chunk_texts[0] == " ".join(ctx.split()[:8])
    assert plan.query == q


def test_prepare_inputs_errors(tiny_tokenizer):
    prompt, ctx, q = make_prompt(20)
    cache = CocktailCache(cfg())
    with pytest.raises(ValueError, match=r"contexts\[0\] was not found in prompts\[0\]"):
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts="w999 not there", queries=q)
    with pytest.raises(ValueError, match="contexts must be a str or a list of 2"):
        cache.prepare_inputs(tiny_tokenizer, [prompt, prompt], contexts=[ctx], queries=q)
    with pytest.raises(ValueError, match=r"queries\[0\] is None"):
        cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=None)
    with pytest.raises(TypeError, match="config must be a CocktailConfig"):
        CocktailCache({"chunk_size": 8})


def test_searching_without_prepare_inputs_or_tokenizer_is_a_clear_error(tiny_llama, tiny_tokenizer):
    inputs = tiny_tokenizer("w1 w2 w3", return_tensors="pt")
    with pytest.raises(ValueError, match=r"scorer='encoder'\) searches.*tokenizer=tokenizer.*prepare_inputs"):
        tiny_llama.generate(**inputs, **cache_kwargs(tiny_llama, CocktailCache(cfg())), max_new_tokens=2)


def test_precision_map_memory_report_and_nbytes_match_theory(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(120, needle_at=50)
    out, cache, inputs = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(alpha=0.3, beta=0.3))
    pmap = cache.precision_map()
    assert len(pmap) == 1 and len(pmap[0]) == cache.plans[0].num_chunks
    assert set(pmap[0]) <= {16, 4, 2} and len(set(pmap[0])) == 3  # a real mix
    # the chunk holding the needle shares words with the query: it gets the top precision
    scores = cache.chunk_scores()[0]
    assert pmap[0][max(range(len(scores)), key=scores.__getitem__)] == 16

    # theoretical bytes from the precision map: codes + scales/zeros + full-precision tokens
    L, n_new = inputs["input_ids"].shape[1], GEN["max_new_tokens"] - 1
    H, D, C, G, layers = 2, 32, 8, 16, 2
    plan = cache.plans[0]
    theory = 0
    full_tokens = L + n_new - (plan.ctx_end - plan.ctx_start)
    for i, bits in enumerate(pmap[0]):
        a, b = plan.chunk_range(i, C)
        n = b - a
        if bits == 16:
            full_tokens += n
        else:
            theory += 2 * H * n * D * bits // 8  # K and V codes
            theory += 2 * H * D * 2  # key scale+zero per channel for the chunk (fp16)
            theory += 2 * H * n * (D // G) * 2  # value scale+zero per token group (fp16)
    theory += 2 * H * full_tokens * D * 4  # fp32 model
    theory *= layers
    rep = cache.memory_report()
    held = rep["total_bytes"] - rep["headroom_bytes"] - rep["index_bytes"]  # the tokens' own bytes
    assert abs(held - theory) / theory < 0.05
    assert rep["total_bytes"] == cache.nbytes()
    assert rep["chunks"] == {"fp16": pmap[0].count(16), "int4": pmap[0].count(4), "int2": pmap[0].count(2)}
    assert rep["fp16_equivalent_bytes"] == layers * 2 * H * D * 2 * (L + n_new)
    assert 0 < rep["ratio_to_fp16"] < 1  # full-precision part counted at 2 bytes, as deployed


# ----------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_uniform16_equals_dynamic_cache_sdpa(tiny_tokenizer, kv_heads):
    model = make_tiny_llama(num_kv_heads=kv_heads)
    ref_model = make_tiny_llama(num_kv_heads=kv_heads, attn="sdpa")
    prompt, ctx, q = make_prompt(70)
    out, cache, _ = run(model, tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16))
    ref = dynamic(ref_model, tiny_tokenizer, prompt)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(logits(out), logits(ref), rtol=1e-5, atol=1e-5)
    assert cache.precision_map() == [[16] * cache.plans[0].num_chunks]


@pytest.mark.parametrize(
    "config",
    [
        cfg(uniform_bits=2),
        cfg(uniform_bits=3),
        cfg(uniform_bits=4),
        cfg(alpha=0.3, beta=0.2),
        cfg(alpha=0.3, beta=0.2, low_bits=3),
    ],
)
def test_split_precision_decode_equals_attention_over_dequantized_cache(tiny_tokenizer, config):
    """attn 'cocktail' reads packed codes per segment; attn 'sdpa' on the same cache dequantizes everything and
    runs plain SDPA in the original token order: both must agree."""
    prompt, ctx, q = make_prompt(90, needle_at=30)
    out, cache, _ = run(make_tiny_llama(), tiny_tokenizer, prompt, ctx, q, config)
    ref, ref_cache, _ = run(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt, ctx, q, config)
    assert cache.precision_map() == ref_cache.precision_map()
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(logits(out), logits(ref), rtol=1e-4, atol=1e-4)
    # and quantization really changed something compared with full precision
    full = dynamic(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt)
    assert not torch.allclose(logits(out)[:, 1:], logits(full)[:, 1:], atol=1e-4)


def test_sdpa_fallback_warns_once(tiny_tokenizer, caplog):
    prompt, ctx, q = make_prompt(40)
    with caplog.at_level(logging.WARNING, logger="hf_cocktail.cache.cache"):
        run(make_tiny_llama(attn="sdpa"), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    assert sum("dequantizes the whole cache" in r.message for r in caplog.records) == 1


def test_batch_of_two_different_lengths_equals_each_alone(tiny_llama, tiny_tokenizer):
    p1, c1, q1 = make_prompt(100, seed=1, needle_at=20)
    p2, c2, q2 = make_prompt(37, seed=2, needle_at=5)
    config = cfg(alpha=0.4, beta=0.2)
    batch, bcache, _ = run(tiny_llama, tiny_tokenizer, [p1, p2], [c1, c2], [q1, q2], config)
    for i, (p, c, q) in enumerate([(p1, c1, q1), (p2, c2, q2)]):
        alone, acache, ainp = run(tiny_llama, tiny_tokenizer, p, c, q, config)
        assert bcache.precision_map()[i] == acache.precision_map()[0]
        n = ainp["input_ids"].shape[1]
        assert torch.equal(batch.sequences[i, -GEN["max_new_tokens"] :], alone.sequences[0, n:])
        torch.testing.assert_close(logits(batch)[i], logits(alone)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_uniform16_match_dynamic_cache(tiny_tokenizer, dtype):
    prompt, ctx, q = make_prompt(50)
    out, _, _ = run(make_tiny_llama(dtype=dtype), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=16))
    ref = dynamic(make_tiny_llama(dtype=dtype, attn="sdpa"), tiny_tokenizer, prompt)
    assert out.sequences.shape == ref.sequences.shape
    # decode attention runs in fp32 here, SDPA in `dtype`: agree within the dtype's resolution
    tol = 8 * torch.finfo(dtype).eps * logits(ref).abs().max().item()
    torch.testing.assert_close(logits(out).float(), logits(ref).float(), rtol=0, atol=tol)
    out2, cache2, _ = run(make_tiny_llama(dtype=dtype), tiny_tokenizer, prompt, ctx, q, cfg(uniform_bits=2))
    assert cache2.layers[0].store.segments[1].k_scale.dtype == torch.float16
    assert torch.isfinite(logits(out2)).all()


def test_all_equal_scores_run_end_to_end(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    _, cache, _ = run(tiny_llama, tiny_tokenizer, prompt, ctx, q, cfg(), encoder=ConstEncoder())
    assert set(cache.precision_map()[0]) == {2}


# ----------------------------------------------------------------------------- attention unit
def _random_store(lengths_full, lengths4, lengths2, H=2, D=32, C=8, G=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randn(H, n, D, generator=g)  # noqa: E731
    full = FullPart.from_sequences([rnd(n) for n in lengths_full], [rnd(n) for n in lengths_full])
    segs = [
        PackedSegment.from_sequences([rnd(n) for n in ls], [rnd(n) for n in ls], bits, C, G, torch.float16)
        for bits, ls in ((4, lengths4), (2, lengths2))
    ]
    return LayerStore(full, segs)


@pytest.mark.parametrize("Lq", [1, 3])
def test_split_attention_equals_sdpa_over_dequantized_segments(Lq):
    store = _random_store([10, 6], [19, 0], [8, 33])
    B, H_kv, n_rep, D = 2, 2, 3, 32
    q = torch.randn(B, H_kv * n_rep, Lq, D, generator=torch.Generator().manual_seed(5))
    out = split_precision_attention_torch(q, store, 0.2)
    for b in range(B):
        s = store.full.start[b]
        ks = [store.full.keys[b, :, s:]] + [seg.sequence(b)[0] for seg in store.segments]
        vs = [store.full.values[b, :, s:]] + [seg.sequence(b)[1] for seg in store.segments]
        # order: packed first, then the full part, so the newest Lq tokens are last (causal among themselves)
        K = torch.cat(ks[1:] + ks[:1], 1).repeat_interleave(n_rep, 0)
        V = torch.cat(vs[1:] + vs[:1], 1).repeat_interleave(n_rep, 0)
        T = K.shape[1]
        mask = torch.ones(Lq, T, dtype=torch.bool).tril(T - Lq)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b], K, V, attn_mask=mask, scale=0.2)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
