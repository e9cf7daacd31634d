"""Tokens appended after the prefill (generated tokens, later turns) packed into the layer's segment of their width as
they leave the residual window (``CocktailConfig.residual_tokens``, :mod:`hf_cocktail.storage.generated`): the
segment surgery against quantizing the spliced sequences, what the layer packs against quantizing the same tokens,
attention over the grown store against attention on its dequantized keys, crop / beams / deepcopy, and the bytes of
a long generation (issue 44: 512-token prompt + 1,536 generated under ``recommended()`` at most 0.40x FP16)."""

import copy
import os

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode.dispatch import split_precision_attention
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.generated import CHUNK_FIELDS, TOKEN_FIELDS, insert_chunks, split_before_tails
from hf_cocktail.storage.store import PackedSegment

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, random_text, two_question_document
from .test_memory import reachable_bytes

SMALL = dict(chunk_size=8, group_size=16, residual_tokens=8)  # packs every 8 tokens past 16 appended


@pytest.fixture(autouse=True)
def one_thread():
    """Many small decode steps: one thread (several threads on a shared, busy CPU spin far longer than they work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small(**kw) -> CocktailConfig:
    return CocktailConfig.recommended(**{**SMALL, **kw})


def _fields_equal(a: PackedSegment, b: PackedSegment) -> None:
    assert a.tok_off == b.tok_off and a.chunk_off == b.chunk_off
    for name in TOKEN_FIELDS + CHUNK_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name


@pytest.mark.parametrize("scale_bits", [16, 8])
@pytest.mark.parametrize("bits,value_bits", [(4, 3), (3, 3), (2, 2)])
def test_insert_chunks_equals_quantizing_the_spliced_sequences(scale_bits, bits, value_bits):
    """Appended chunks go before each sequence's partial last chunk (its tail): every code, scale, zero and block
    is what quantizing [whole prompt chunks, appended chunks, tail] at once gives; taking them out gives both back."""
    torch.manual_seed(0)
    H, D, C, G = 2, 32, 8, 16
    prompt = [torch.randn(H, n, D) for n in (21, 16, 0)]  # tails 5, 0, and a sequence with no prompt tokens
    new = [torch.randn(H, 16, D) for _ in prompt]
    args = (bits, C, G, torch.float16, None, None, value_bits, scale_bits)
    seg = PackedSegment.from_sequences(prompt, [p * 0.5 for p in prompt], *args)
    block = PackedSegment.from_sequences(new, [n * 0.5 for n in new], *args)
    spliced = [torch.cat([p[:, : p.shape[1] // C * C], n, p[:, p.shape[1] // C * C :]], 1) for p, n in zip(prompt, new)]
    expected = PackedSegment.from_sequences(spliced, [s * 0.5 for s in spliced], *args)
    grown = insert_chunks(seg, block)
    _fields_equal(grown, expected)
    rest, taken = split_before_tails(grown, 16)
    _fields_equal(rest, seg)
    _fields_equal(taken, block)
    with pytest.raises(ValueError, match="whole chunks"):
        split_before_tails(grown, 12)


@torch.no_grad()
def _forward(model, cache, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    return out.logits


def teacher_forced(model, tok, config, prompts, tokens: torch.Tensor, block: int = 1):
    """Prefill ``prompts`` (list of (prompt, context, query)), then feed ``tokens (B, T)`` ``block`` at a time as
    decode steps; the logits of every fed token ``(B, T, V)`` and the cache."""
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(
        tok, [p for p, _, _ in prompts], contexts=[c for _, c, _ in prompts], queries=[q for _, _, q in prompts]
    )
    mask = inputs["attention_mask"]
    _forward(model, cache, inputs["input_ids"], mask)
    logits = []
    for i in range(0, tokens.shape[1], block):
        piece = tokens[:, i : i + block]
        mask = torch.cat([mask, torch.ones_like(piece)], dim=1)
        logits.append(_forward(model, cache, piece, mask))
    return torch.cat(logits, dim=1), cache


def _prompts():
    return [make_prompt(70, seed=1, needle_at=10), make_prompt(37, seed=2)]


def _tokens(tok, n: int, rows: int = 2) -> torch.Tensor:
    ids = tok(random_text(n + 20, seed=9), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :n]
    return ids.repeat(rows, 1)


@pytest.mark.parametrize("overrides", [{}, dict(scale_bits=8, full_part_bits=8), dict(uniform_bits=3, value_bits=None)])
def test_layer_packs_the_tokens_it_would_have_held(tiny_tokenizer, overrides):
    """Layer 0's keys and values do not depend on the cache, so the packed segment after 29 teacher-forced tokens is
    exactly the prefill's segment with those tokens (as an unpacking cache holds them) inserted, quantized by the
    layer's quantizers at its widths; the residual window is exactly the unpacking cache's newest tokens."""
    model = make_tiny_llama(head_dim=32)
    tokens = _tokens(tiny_tokenizer, 29)
    _, packed = teacher_forced(model, tiny_tokenizer, small(**overrides), _prompts(), tokens)
    _, held = teacher_forced(model, tiny_tokenizer, small(residual_tokens=10**6, **overrides), _prompts(), tokens)
    a, b = packed.layers[0].store, held.layers[0].store
    assert a.packed_appended == 16 and b.packed_appended == 0  # 28 appended before the last step: 16 packed, 12 kept
    assert a.full.length - a.appended_from == 13
    i, p = a.packing.segment, a.packing
    k, v = b.full.tokens(b.appended_from, 16)
    seg = b.segments[i]
    block = PackedSegment.from_sequences(
        [t.contiguous() for t in k],
        [t.contiguous() for t in v],
        seg.bits,
        seg.chunk_size,
        seg.group_size,
        p.scale_dtype,
        p.quantize_keys,
        p.quantize_values,
        seg.value_width,
        p.scale_bits,
    )
    _fields_equal(a.segments[i], insert_chunks(seg, block))
    assert torch.equal(a.full.tokens(a.appended_from, 13)[0], b.full.tokens(b.appended_from + 16, 13)[0])


def _reference_attention(layer, query: torch.Tensor, scaling: float, pads: list[int]) -> torch.Tensor:
    """Causal softmax attention of ``query (B, H_q, L_q, D)`` (the newest L_q tokens' queries) over the layer's
    dequantized cache in fp32, left padding masked."""
    keys, values = layer.dequantized()
    B, H_kv, T, D = keys.shape
    n_rep, Lq = query.shape[1] // H_kv, query.shape[2]
    k, v = keys.float().repeat_interleave(n_rep, 1), values.float().repeat_interleave(n_rep, 1)
    scores = (query.float() * scaling) @ k.transpose(-1, -2)
    j = torch.arange(T)
    for b, pad in enumerate(pads):
        hidden = (j[None, :] < pad) | (j[None, :] > T - Lq + torch.arange(Lq)[:, None])
        scores[b] = scores[b].masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("overrides", [{}, dict(scale_bits=8, full_part_bits=8), dict(uniform_bits=None, alpha=0.3)])
def test_attention_over_grown_store_equals_attention_on_its_dequantized_keys(tiny_tokenizer, backend, overrides):
    """After packing (two sequences, left padding, a partial last context chunk), decode attention over the store
    (the PyTorch reference and the fused CPU kernel, one query and a 3-token append) equals softmax attention over
    the store's dequantized keys and values in original order."""
    model = make_tiny_llama(head_dim=32)
    _, cache = teacher_forced(
        model, tiny_tokenizer, small(backend=backend, **overrides), _prompts(), _tokens(tiny_tokenizer, 31), block=3
    )
    pads = [plan.pad for plan in cache._plans]
    torch.manual_seed(1)
    for layer in cache.layers:
        store = layer.store
        assert store.packed_appended == 16  # 30 appended before the last block: 16 packed, 14 kept
        for Lq in (1, 3):
            query = torch.randn(2, 4, Lq, 32)
            got = split_precision_attention(query, store, 32**-0.5, backend)
            ref = _reference_attention(layer, query, 32**-0.5, pads)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_uniform16_never_packs_and_equals_dynamic_cache(tiny_tokenizer):
    prompt, ctx, q = make_prompt(60, needle_at=10)
    cache = CocktailCache(CocktailConfig(uniform_bits=16, chunk_size=8), encoder=FakeEncoder())  # residual 128
    model = make_tiny_llama()
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    gen = dict(do_sample=False, max_new_tokens=180, min_new_tokens=180)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **gen)
    ref_model = make_tiny_llama(attn="sdpa")
    ref = ref_model.generate(**inputs, **cache_kwargs(ref_model, DynamicCache()), **gen)
    assert torch.equal(out, ref)
    assert all(layer.store.packed_appended == 0 and layer.store.packing is None for layer in cache.layers)


def _generate(model, tok, config, prompts, **kw):
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(
        tok, [p for p, _, _ in prompts], contexts=[c for _, c, _ in prompts], queries=[q for _, _, q in prompts]
    )
    out = model.generate(**inputs, **cache_kwargs(model, cache), do_sample=False, **kw)
    return out[:, inputs["input_ids"].shape[1] :], cache


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_new_tokens=30),
        dict(max_new_tokens=30, prompt_lookup_num_tokens=3),
        dict(max_new_tokens=24, num_beams=2),
    ],
)
@pytest.mark.parametrize("residual", [0, 8])
def test_split_path_equals_dequantized_path_with_packed_tokens(tiny_tokenizer, kw, residual):
    """The fused kernel reading the grown store and the sdpa fallback reading its dequantized copy give the same
    greedy tokens (fp32), for plain decoding, prompt-lookup decoding (multi-token verification, then crops: with
    ``residual_tokens=0`` into packed chunks) and beam search (rows reordered with their packed appended tokens)."""
    # a fixed rotation: under sdpa the cache never sees the queries that rotation="auto" chooses by
    config = small(residual_tokens=residual, rotation="hadamard")
    prompts = _prompts()[: 1 if "prompt_lookup_num_tokens" in kw else 2]  # assisted decoding takes one sequence
    out, cache = _generate(make_tiny_llama(), tiny_tokenizer, config, prompts, **kw)
    ref, _ = _generate(make_tiny_llama(attn="sdpa"), tiny_tokenizer, config, prompts, **kw)
    assert torch.equal(out, ref)
    assert cache.memory_report()["appended_packed_tokens"] >= 8
    widths = [layer.appended_chunk_bits() for layer in cache.layers]
    assert widths[0] == widths[1] == [4] * (cache.layers[0].store.packed_appended // 8)
    assert all(row[len(row) - len(widths[0]) :] == widths[0] for row in cache.precision_map())  # after the context


def test_beam_rows_match_each_prompt_alone_with_packed_tokens(tiny_tokenizer):
    """Two prompts under beam search give row by row what each gives alone once generated tokens are packed: a beam
    reorder that left the packed appended tokens behind (``select(same_packed=True)``) would change them."""
    model = make_tiny_llama(seed=3)
    p1, p2 = _prompts()
    batch, cache = _generate(model, tiny_tokenizer, small(), [p1, p2], max_new_tokens=30, num_beams=2)
    for i, p in enumerate((p1, p2)):
        alone, _ = _generate(model, tiny_tokenizer, small(), [p], max_new_tokens=30, num_beams=2)
        assert torch.equal(batch[i : i + 1], alone)
    assert cache.layers[0].store.packed_appended >= 8


@pytest.mark.parametrize("n", [3, 13, 22])
def test_crop_into_packed_tokens_keeps_what_attention_read(tiny_tokenizer, n):
    """``crop(-n)`` with ``residual_tokens=0``: the unpacked tokens go, then the newest packed chunks, whose tokens
    that stay return to the full part as their dequantized values: the dequantized cache is the old one cut (fp32:
    exactly), and decoding goes on (packing them again)."""
    model = make_tiny_llama()
    tokens = _tokens(tiny_tokenizer, 36)
    _, cache = teacher_forced(model, tiny_tokenizer, small(residual_tokens=0), _prompts(), tokens[:, :32])
    before = [layer.dequantized() for layer in cache.layers]
    store = cache.layers[0].store
    packed, unpacked = store.packed_appended, store.full.length - store.appended_from
    cache.crop(-n)
    for layer, (k, v) in zip(cache.layers, before):
        k2, v2 = layer.dequantized()
        assert torch.equal(k2, k[:, :, :-n]) and torch.equal(v2, v[:, :, :-n])
    taken = -(-max(n - unpacked, 0) // 8) * 8  # whole chunks
    assert cache.layers[0].store.packed_appended == packed - taken
    length = cache.get_seq_length()
    mask = torch.ones(2, length + 4, dtype=torch.long)
    for b, plan in enumerate(cache._plans):
        mask[b, : plan.pad] = 0
    for i in range(4):
        _forward(model, cache, tokens[:, 32 + i : 33 + i], mask[:, : length + i + 1])
    assert cache.get_seq_length() == length + 4


def test_deepcopy_of_a_cache_with_packed_tokens_is_independent(tiny_tokenizer):
    """A copy made after packing decodes on (packing more) without touching the original, which then gives what
    the copy gave and what one uninterrupted run gives."""
    model = make_tiny_llama()
    tokens = _tokens(tiny_tokenizer, 42)
    _, cache = teacher_forced(model, tiny_tokenizer, small(), _prompts(), tokens[:, :30])
    twin = copy.deepcopy(cache)
    L = cache.get_seq_length()
    mask = torch.ones(2, L + 12, dtype=torch.long)
    for b, plan in enumerate(cache._plans):
        mask[b, : plan.pad] = 0
    steps = [_forward(model, twin, tokens[:, 30 + i : 31 + i], mask[:, : L + i + 1]) for i in range(12)]
    assert twin.layers[0].store.packed_appended > cache.layers[0].store.packed_appended
    again = [_forward(model, cache, tokens[:, 30 + i : 31 + i], mask[:, : L + i + 1]) for i in range(12)]
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(again, 1), atol=0, rtol=0)
    full, _ = teacher_forced(model, tiny_tokenizer, small(), _prompts(), tokens)
    torch.testing.assert_close(torch.cat(again, 1), full[:, 30:], atol=0, rtol=0)


def test_long_generation_bytes_stay_below_the_issue_bar(tiny_tokenizer):
    """Issue 44: a tiny random Llama in bf16 (head dim 64), a 512-token prompt and 1,536 generated tokens under
    ``recommended()``: at most 0.40x FP16 with every byte counted (the full part's room included). Unpacked (what the
    cache did before) it was 1.11x (``python -m eval.generated_bytes``)."""
    model = make_tiny_llama(dtype=torch.bfloat16, head_dim=64)
    prompt, ctx, q = make_prompt(500, seed=1)
    cache = CocktailCache(CocktailConfig.recommended())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    assert inputs["input_ids"].shape[1] == 512
    gen = dict(do_sample=False, max_new_tokens=1536, min_new_tokens=1536)
    assert model.generate(**inputs, **cache_kwargs(model, cache), **gen).shape[1] == 2048
    rep = cache.memory_report()
    assert rep["total_bytes"] == reachable_bytes(cache)
    assert rep["appended_packed_tokens"] == 1536 - 160  # the rest in the residual window (128 to 159 tokens)
    assert rep["ratio_to_fp16"] <= 0.40, rep["ratio_to_fp16"]


def test_requery_after_packing_equals_a_fresh_run(tiny_tokenizer):
    """``requery`` drops the store with its packed generated tokens and re-packs the document from the CPU copy:
    the next generation (packing again) gives what a fresh cache gives on the new question."""
    model = make_tiny_llama()
    ctx, (p1, q1), (p2, q2) = two_question_document()
    config = small(keep_context_copy=True)
    cache = CocktailCache(config, encoder=FakeEncoder())
    gen = dict(do_sample=False, max_new_tokens=40, min_new_tokens=40)
    model.generate(
        **cache.prepare_inputs(tiny_tokenizer, p1, contexts=ctx, queries=q1), **cache_kwargs(model, cache), **gen
    )
    assert cache.layers[0].store.packed_appended > 0
    inputs = cache.requery(tiny_tokenizer, p2, q2)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **gen)
    fresh, fcache = _generate(model, tiny_tokenizer, small(), [(p2, ctx, q2)], max_new_tokens=40, min_new_tokens=40)
    assert torch.equal(out[:, inputs["input_ids"].shape[1] :], fresh)
    assert cache.layers[0].store.packed_appended == fcache.layers[0].store.packed_appended > 0


def test_triton_reads_the_grown_segments(tiny_tokenizer):
    """The Triton kernel (interpreted on CPU: conftest sets TRITON_INTERPRET=1) over a store grown by packing equals
    attention on its dequantized keys (head dim 64, the smallest it takes; 8-bit scales and full part; layer 0, to
    keep the interpreter short; 16-bit scales checked the same way when this was written)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model = make_tiny_llama(head_dim=64)
    _, cache = teacher_forced(
        model,
        tiny_tokenizer,
        small(backend="torch", scale_bits=8, full_part_bits=8),
        _prompts(),
        _tokens(tiny_tokenizer, 31),
        block=3,
    )
    layer = cache.layers[0]
    assert layer.store.packed_appended == 16
    torch.manual_seed(1)
    for Lq in (1, 3):
        query = torch.randn(2, 4, Lq, 64)
        got = split_precision_attention(query, layer.store, 64**-0.5, "triton")
        ref = _reference_attention(layer, query, 64**-0.5, [plan.pad for plan in cache._plans])
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_teacher_forcing_steps_where_a_block_would_hide_packing(tiny_tokenizer):
    """eval.kld and calibrate teacher-force answers in one forward unless that differs from one forward a token
    (``needs_steps``): with generated-token packing a block longer than what the residual window can still take
    must go step by step, and a block that packs nothing inside equals the steps."""
    from hf_cocktail.calibrate.divergence import needs_steps, teacher_force

    model = make_tiny_llama(dtype=torch.float32)
    ids = tiny_tokenizer(make_prompt(60)[0], return_tensors="pt")["input_ids"]
    tokens = tiny_tokenizer(random_text(40, seed=3), return_tensors="pt")["input_ids"][:, :30]

    def prefilled():
        cache = CocktailCache(small())
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(model, cache))
        return cache

    cache = prefilled()  # the prompt's last 8 tokens are unpacked appended tokens: 8 + n - 1 >= 8 + 8 packs
    assert not needs_steps(cache, 1) and not needs_steps(cache, 8)
    assert needs_steps(cache, 9) and needs_steps(cache, 30)
    block = teacher_force(model, prefilled(), tokens[:, :8], step_by_step=False)
    steps = teacher_force(model, prefilled(), tokens[:, :8], step_by_step=True)
    torch.testing.assert_close(block, steps, rtol=1e-4, atol=1e-5)
    block = teacher_force(model, prefilled(), tokens, step_by_step=False)  # packing hidden inside the block
    steps = teacher_force(model, prefilled(), tokens, step_by_step=True)
    assert not torch.allclose(block, steps, rtol=1e-4, atol=1e-5)
