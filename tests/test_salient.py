"""Salient tokens (CocktailConfig(salient_tokens=f)): the selection and the position bookkeeping, the attention mass
against eager attention, each layer's store, decode paths that must agree (split attention, the dequantizing path,
a branched prefill), batches, requery and the errors."""

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.planning.salient import move_to_full, salient_positions, tail_attention_mass

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, two_question_document

BASE = dict(chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", low_bits=3)
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)


@pytest.fixture
def recorded_masses(monkeypatch):
    """``masses[layer]``: the salient mass of the first sequence that the last prefill recorded for ``layer`` (a copy
    taken as it is recorded: the cache keeps the chosen positions in its place)."""
    import hf_cocktail.cache.cache as cache_module

    masses: dict[int, torch.Tensor] = {}
    record = cache_module.record_layer_mass

    def spy(plans, query, key, scaling, layer_idx, prompt_end):
        record(plans, query, key, scaling, layer_idx, prompt_end)
        masses[layer_idx] = plans[0].layer_mass[layer_idx].clone()

    monkeypatch.setattr(cache_module, "record_layer_mass", spy)
    return masses


def run(tok, config, attn="cocktail", prompt=None, seed=0, **generate_kwargs):
    prompt, ctx, q = prompt or make_prompt(120, needle_at=60)
    model = make_tiny_llama(attn=attn, head_dim=32, seed=seed)
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=q)
    return model.generate(**inputs, **cache_kwargs(model, cache), **GEN, **generate_kwargs), cache, inputs


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.1", None])
def test_salient_tokens_is_validated(bad):
    with pytest.raises(ValueError, match=rf"salient_tokens must be a number in \[0, 1\].*got {bad!r}"):
        CocktailConfig(salient_tokens=bad)


def test_salient_positions_take_the_top_fraction_of_the_packed_tokens_and_move_them_to_full():
    pos = {"full": torch.tensor([0, 1, 6, 7]), 4: torch.tensor([2, 3]), 2: torch.tensor([4, 5, 8, 9])}
    mass = torch.tensor([9.0, 0.5, 3.0, 0.1, 0.2, 7.0, 0.3, 5.0])  # context tokens 2..9; 2 and 9 are not packed
    top = salient_positions(mass, pos, ctx_start=2, fraction=0.5)  # 3 of the 6 packed tokens
    assert top.tolist() == [2, 4, 9]  # token 2 (9.0), 9 (5.0), then 4 (3.0): in token order
    moved = move_to_full(pos, top)
    assert moved["full"].tolist() == [0, 1, 2, 4, 6, 7, 9]
    assert moved[4].tolist() == [3] and moved[2].tolist() == [5, 8]
    assert salient_positions(mass, pos, 2, 0.05).numel() == 0  # round(0.3) = 0 tokens
    assert move_to_full(pos, top[:0]) is pos
    ties = salient_positions(torch.ones(8), pos, 2, 0.34)  # 2 of 6, all equal: the earliest
    assert ties.tolist() == [2, 3]


def test_layer_mass_is_the_eager_attention_from_the_tokens_after_the_context(tiny_tokenizer, recorded_masses):
    _, cache, inputs = run(tiny_tokenizer, CocktailConfig(**BASE, salient_tokens=0.1))
    plan = cache._plans[0]
    eager = make_tiny_llama(attn="eager", head_dim=32)
    with torch.no_grad():
        att = eager(**inputs, output_attentions=True).attentions  # per layer (B, H_q, L, L)
    for layer in range(2):
        ref = att[layer][0, :, plan.ctx_end :, plan.ctx_start : plan.ctx_end].sum((0, 1))
        torch.testing.assert_close(recorded_masses[layer], ref, rtol=1e-4, atol=1e-5)


def test_the_plans_keep_each_layers_salient_positions_instead_of_its_mass(tiny_tokenizer, recorded_masses):
    _, cache, _ = run(tiny_tokenizer, CocktailConfig(**BASE, salient_tokens=0.1))
    plan = cache._plans[0]
    n_ctx = plan.ctx_end - plan.ctx_start
    n = round(0.1 * sum(p.numel() for part, p in plan.positions.items() if part != "full"))
    assert plan.layer_mass == {} and sorted(plan.layer_salient) == [0, 1]
    for layer, kept in plan.layer_salient.items():
        assert kept.dtype == torch.int32 and kept.numel() == n
        assert torch.equal(kept, salient_positions(recorded_masses[layer], plan.positions, plan.ctx_start, 0.1))
    # the plans' bytes: n int32 positions per layer where there were n_ctx fp32 masses
    plain = cache.memory_report()["index_bytes"]
    plan.layer_mass = dict(recorded_masses)
    assert cache.memory_report()["index_bytes"] - plain == 2 * n_ctx * 4
    # a new mass (a new prefill of the layer) replaces the positions chosen from the old one
    from hf_cocktail.planning.salient import record_layer_mass

    q, k = torch.randn(1, 4, 8, 32), torch.randn(1, 2, plan.ctx_end + 8, 32)
    record_layer_mass([plan], q, k, 0.2, 1, plan.ctx_end + 8)
    assert sorted(plan.layer_salient) == [0]


def test_tail_attention_mass_reads_the_last_queries_and_refuses_too_few():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 20, 8, generator=g), torch.randn(2, 20, 8, generator=g)  # H_q 4, H_kv 2, L 20
    pad, ctx = 2, (5, 14)
    whole = tail_attention_mass(q, k, 0.3, pad, *ctx)
    logits = q.reshape(2, 2, 20, 8) @ k[:, None].transpose(-1, -2) * 0.3  # (H_kv, rep, L, L)
    causal = torch.ones(20, 20).tril().bool() & (torch.arange(20) >= pad)[None, :]
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(whole, p[:, :, 14:, 5:14].sum((0, 1, 2)))
    torch.testing.assert_close(tail_attention_mass(q[:, 14:], k, 0.3, pad, *ctx), whole)  # only the tail's queries
    with pytest.raises(ValueError, match="every token after the context .from token 14 on.*start at token 15"):
        tail_attention_mass(q[:, 15:], k, 0.3, pad, *ctx)
    # rows past the prepared prompt (assisted decoding's candidates in the same forward) are left out
    torch.testing.assert_close(
        tail_attention_mass(q, k, 0.3, pad, *ctx, prompt_end=17), p[:, :, 14:17, 5:14].sum((0, 1, 2))
    )
    torch.testing.assert_close(tail_attention_mass(q, k, 0.3, pad, *ctx, prompt_end=40), whole)


def test_each_layer_keeps_its_own_salient_tokens_at_full_precision(tiny_tokenizer, recorded_masses):
    _, plain, _ = run(tiny_tokenizer, CocktailConfig(**BASE))
    out, cache, _ = run(tiny_tokenizer, CocktailConfig(**BASE, salient_tokens=0.1))
    plan = cache._plans[0]
    assert cache.precision_map() == plain.precision_map()  # the chunk plan is unchanged
    packed = sum(p.numel() for part, p in plan.positions.items() if part != "full")
    n = round(0.1 * packed)
    chosen = []
    for layer, base in zip(cache.layers, plain.layers):
        assert layer.store.full.length == base.store.full.length + n
        assert sum(s.num_tokens for s in layer.store.segments) == sum(s.num_tokens for s in base.store.segments) - n
        top = salient_positions(recorded_masses[layer.layer_idx], plan.positions, plan.ctx_start, 0.1)
        assert cache.layer_positions(layer.layer_idx)[0]["full"].tolist() == sorted(
            plan.positions["full"].tolist() + top.tolist()
        )
        chosen.append(top.tolist())
    assert chosen[0] != chosen[1]  # per layer
    assert plain.nbytes() < cache.nbytes()


def record_queries(model, inputs, last: int):
    """A full-precision prefill of ``inputs`` and, per layer, the attention's queries of the last ``last`` tokens."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = {}

    def recording(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = query[:, :, -last:].detach().clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("test_recording", recording)
    AttentionMaskInterface.register("test_recording", sdpa_mask)
    old = model.config._attn_implementation
    model.set_attn_implementation("test_recording")
    dyn = DynamicCache()
    try:
        with torch.no_grad():
            model(**inputs, **cache_kwargs(model, dyn))
    finally:
        model.set_attn_implementation(old)
    return dyn, [seen[i] for i in range(len(seen))]


def test_a_branched_prefill_with_its_queries_decodes_alike_on_the_split_and_dequantizing_paths(tiny_tokenizer):
    prompt, ctx, q = make_prompt(120, needle_at=60)
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    runs = []
    for split in (True, False):
        cache = CocktailCache(CocktailConfig(**BASE, salient_tokens=0.1), encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        head = {k: v[:, :-1] for k, v in inputs.items()}
        dyn, queries = record_queries(model, head, last=head["input_ids"].shape[1] - cache.plans[0].ctx_end)
        cache.load_prefill(dyn, split_attention=split, prefill_queries=queries)
        runs.append((model.generate(**inputs, **cache_kwargs(model, cache), **GEN), cache))
    (a, ca), (b, cb) = runs
    plan = ca._plans[0]
    n = round(0.1 * sum(p.numel() for part, p in plan.positions.items() if part != "full"))
    assert ca.layers[0].store.full.length == plan.positions["full"].numel() + n + 4  # + the generated tokens
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"one query tensor per layer \(2\), got 1"):
        ca.load_prefill(dyn, prefill_queries=queries[:1])


def test_without_the_prefill_attention_it_says_what_is_needed(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"salient_tokens=0.1 read\(s\) the prefill attention.*'sdpa'"):
        run(tiny_tokenizer, CocktailConfig(**BASE, salient_tokens=0.1), attn="sdpa")
    prompt, ctx, q = make_prompt(60)
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    cache = CocktailCache(CocktailConfig(**BASE, salient_tokens=0.1), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    dyn = DynamicCache()
    with torch.no_grad():
        model(input_ids=inputs["input_ids"][:, :-1], **cache_kwargs(model, dyn))
    cache.load_prefill(dyn)  # no prefill_queries
    with pytest.raises(RuntimeError, match="or pass prefill_queries to load_prefill"):
        model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)


def test_a_batch_decodes_as_each_prompt_alone(tiny_tokenizer):
    p1, c1, q1 = make_prompt(90, seed=3, needle_at=20)
    p2, c2, q2 = make_prompt(40, seed=4, needle_at=5)
    config = CocktailConfig(**BASE, salient_tokens=0.15)
    model = make_tiny_llama(attn="cocktail", head_dim=32)

    def gen(prompts, contexts, queries):
        cache = CocktailCache(config, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompts, contexts=contexts, queries=queries)
        out = model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=5, do_sample=False)
        return out[:, inputs["input_ids"].shape[1] :], cache

    batch, bcache = gen([p1, p2], [c1, c2], [q1, q2])
    for i, (p, c, q) in enumerate([(p1, c1, q1), (p2, c2, q2)]):
        alone, acache = gen(p, c, q)
        assert torch.equal(batch[i], alone[0])
        pad = bcache._plans[i].pad
        for layer in range(2):
            mine = bcache.layer_positions(layer)[i]["full"] - pad
            assert torch.equal(mine[mine >= 0], acache.layer_positions(layer)[0]["full"])


def test_requery_chooses_the_new_questions_salient_tokens(tiny_tokenizer):
    ctx, (p1, q1), (p2, q2) = two_question_document()
    config = CocktailConfig(**BASE, salient_tokens=0.1, keep_context_copy=True)
    out1, cache, _ = run(tiny_tokenizer, config, prompt=(p1, ctx, q1))
    first = cache.layer_positions(0)[0]["full"].tolist()
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    inputs = cache.requery(tiny_tokenizer, p2, q2)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    fresh, fcache, _ = run(tiny_tokenizer, config, prompt=(p2, ctx, q2))
    assert cache.layer_positions(0)[0]["full"].tolist() == fcache.layer_positions(0)[0]["full"].tolist() != first
    assert torch.equal(out.sequences, fresh.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(fresh.logits), rtol=1e-4, atol=1e-4)


def test_a_generation_that_ends_at_the_prefill_still_stores_its_salient_tokens(tiny_tokenizer):
    prompt, ctx, q = make_prompt(120, needle_at=60)
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    cache = CocktailCache(CocktailConfig(**BASE, salient_tokens=0.1), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False)
    assert all(layer.store is None for layer in cache.layers)  # quantization waits for a decode step
    report = cache.memory_report()  # stores what the prefill left
    plan = cache._plans[0]
    n = round(0.1 * sum(p.numel() for part, p in plan.positions.items() if part != "full"))
    assert all(layer.store.full.length == plan.positions["full"].numel() + n for layer in cache.layers)
    assert report["total_bytes"] == cache.nbytes()


@pytest.mark.parametrize("assisted", ["prompt_lookup", "draft_model"])
def test_assisted_decoding_keeps_the_salient_tokens_and_logits_of_plain_greedy(tiny_tokenizer, monkeypatch, assisted):
    """The first assisted forward covers the prompt and the draft's candidates: the salient mass must come from the
    prompt's rows only (before the fix, 4-6 of the 28 kept tokens per layer differed and logits moved by ~5e-3)."""
    import hf_cocktail.cache.cache as cache_module

    masses = {}
    ctx = " ".join(make_prompt(120)[1].split())
    tail = " ".join(ctx.split()[10:14])  # the prompt ends with words of the context: prompt lookup finds candidates
    prompt = (f"<s> w1 {ctx} w2 {tail}", ctx, tail)
    forward_lengths = []
    record = cache_module.record_layer_mass

    def spy(plans, query, key, scaling, layer_idx, prompt_end):
        forward_lengths.append(key.shape[2])
        record(plans, query, key, scaling, layer_idx, prompt_end)
        masses[layer_idx] = plans[0].layer_mass[layer_idx].clone()

    monkeypatch.setattr(cache_module, "record_layer_mass", spy)
    config = CocktailConfig(**BASE, salient_tokens=0.1)
    plain, pcache, _ = run(tiny_tokenizer, config, prompt=prompt)
    plain_masses = dict(masses)
    forward_lengths.clear()
    draft = make_tiny_llama(attn="sdpa", head_dim=32, layers=1, seed=1)
    kw = dict(prompt_lookup_num_tokens=3) if assisted == "prompt_lookup" else dict(assistant_model=draft)
    out, cache, inputs = run(tiny_tokenizer, config, prompt=prompt, **kw)
    assert min(forward_lengths) > inputs["input_ids"].shape[1]  # the first forward did hold candidates
    for layer in range(2):
        assert torch.equal(cache.layer_positions(layer)[0]["full"], pcache.layer_positions(layer)[0]["full"])
        torch.testing.assert_close(masses[layer], plain_masses[layer])
    assert torch.equal(out.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(plain.logits), atol=1e-5, rtol=1e-5)
