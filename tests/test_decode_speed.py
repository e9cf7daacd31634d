"""Long generations stay linear in time: structural checks, not timings (timings are noisy on a shared machine).

The full-precision part of a Cocktail layer (template, question, generated tokens) grows in preallocated buffers.
Appending ``n`` tokens one at a time must reallocate them O(log n) times and copy O(n) elements in all (amortised
O(1) per token), where a ``torch.cat`` per step (what ``DynamicCache`` does) copies O(n^2). Checked on the storage
alone and inside a 2K-token ``generate`` with a tiny random Llama (the fused CPU kernel when it can be built here).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.store import FullPart

from .conftest import FakeEncoder, make_prompt, make_tiny_llama

GROWTH = 1.25  # FullPart grows its capacity by a quarter (at least 64 tokens)


def log_bound(start: int, end: int) -> int:
    """Reallocations a geometric growth by ``GROWTH`` needs from ``start`` to ``end`` tokens, plus slack."""
    return math.ceil(math.log(end / max(start, 1), GROWTH)) + 2


class AppendWatch:
    """Wraps ``FullPart.append``: per part, the buffers it used after each call and the elements copied when it
    reallocated (the valid tokens moved into the new buffer)."""

    def __init__(self, monkeypatch):
        self.buffers: dict[int, list[int]] = {}
        self.copied: dict[int, int] = {}
        self.appended: dict[int, int] = {}
        original = FullPart.append

        def append(part, k, v):
            before = part._buffers[0].data_ptr() if part._buffers is not None else None
            length = part.length
            original(part, k, v)
            ptr = part._buffers[0].data_ptr()
            key = id(part)
            self.buffers.setdefault(key, [])
            if ptr != before:
                self.buffers[key].append(ptr)
                self.copied[key] = self.copied.get(key, 0) + length
            self.appended[key] = self.appended.get(key, 0) + k.shape[2]

        monkeypatch.setattr(FullPart, "append", append)

    def reallocations(self, key: int) -> int:
        return len(self.buffers[key])


def test_full_part_reallocates_log_times_over_2k_tokens(monkeypatch):
    watch = AppendWatch(monkeypatch)
    torch.manual_seed(0)
    H, D, R0, n = 3, 16, 100, 2048
    k0, v0 = torch.randn(H, R0, D), torch.randn(H, R0, D)
    part = FullPart.from_sequences([k0], [v0])
    ks, vs = [k0], [v0]
    for _ in range(n):
        k, v = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
        part.append(k, v)
        ks.append(k[0])
        vs.append(v[0])
    key = id(part)
    assert watch.appended[key] == n
    reallocs = watch.reallocations(key)
    assert 1 <= reallocs <= log_bound(R0, R0 + n), reallocs  # O(log n), not one per step
    assert watch.copied[key] <= 5 * (R0 + n)  # geometric growth: O(n) elements copied in all (a cat per step: ~n^2/2)
    assert part.length == R0 + n
    torch.testing.assert_close(part.keys[0], torch.cat(ks, dim=1), rtol=0, atol=0)
    torch.testing.assert_close(part.values[0], torch.cat(vs, dim=1), rtol=0, atol=0)
    assert part.keys.data_ptr() == part._buffers[0].data_ptr()  # a view of the buffer, no copy handed out


def test_full_part_truncate_reuses_the_buffer(monkeypatch):
    watch = AppendWatch(monkeypatch)
    part = FullPart.from_sequences([torch.zeros(2, 10, 8)], [torch.zeros(2, 10, 8)])
    part.append(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    for _ in range(200):  # assisted decoding: append candidates, crop the rejected ones
        part.append(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8))
        part.truncate(3)
    assert part.length == 10 + 1 + 200
    assert watch.reallocations(id(part)) <= log_bound(10, 10 + 1 + 200 + 4)


@pytest.fixture
def one_thread():
    """One PyTorch thread: a tiny model's steps are all overhead, and extra threads only wait on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_2k_token_generation_appends_in_amortised_constant_time(tiny_tokenizer, monkeypatch, one_thread):
    """A 2048-token greedy generation with a tiny random Llama (one layer: ~5 s of CPU time, most of it the model's
    per-step overhead): the layer's full-precision part is reallocated O(log n) times and copies O(n) elements in
    all; the generation completes with every token stored."""
    watch = AppendWatch(monkeypatch)
    model = make_tiny_llama(num_kv_heads=2, heads=4, head_dim=16, layers=1)
    model.config.max_position_embeddings = 4096
    prompt, ctx, q = make_prompt(200, needle_at=50)
    cache = CocktailCache(CocktailConfig(chunk_size=16, group_size=16), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    L, new = inputs["input_ids"].shape[1], 2048
    with torch.no_grad():
        out = model.generate(
            **inputs,
            **cache_kwargs(model, cache),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == L + new
    assert cache.get_seq_length() == L + new - 1  # the last token is never fed back
    assert len(watch.buffers) == model.config.num_hidden_layers  # one full part per layer, appended to every step
    rep = cache.memory_report()
    assert sum(rep["chunks"].values()) > 0  # context chunks were planned and packed
    for key, appended in watch.appended.items():
        assert appended == new - 1
        layer = next(la for la in cache.layers if id(la.store.full) == key)
        R0 = layer.store.full.length - appended
        assert watch.reallocations(key) <= log_bound(R0, R0 + appended), watch.reallocations(key)
        assert watch.copied[key] <= 5 * (R0 + appended)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_step_hands_the_kernel_a_view_not_a_copy(tiny_tokenizer, monkeypatch, backend):
    """What a decode step gives the attention is a view of the growing buffer (no per-step copy of the full part)."""
    import hf_cocktail.integration.attention as hattn

    seen = []
    original = hattn.split_precision_attention

    def spy(query, store, scaling, be):
        seen.append((store.full.keys.data_ptr(), store.full._buffers[0].data_ptr()))
        return original(query, store, scaling, be)

    monkeypatch.setattr(hattn, "split_precision_attention", spy)
    model = make_tiny_llama(num_kv_heads=2, heads=4, head_dim=16, layers=1)
    prompt, ctx, q = make_prompt(60)
    cache = CocktailCache(CocktailConfig(chunk_size=16, group_size=16, backend=backend), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with torch.no_grad():
        model.generate(
            **inputs,
            **cache_kwargs(model, cache),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    assert len(seen) == 19
    assert all(a == b for a, b in seen)
