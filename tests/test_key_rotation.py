"""rotation="auto" (hf_cocktail.planning.key_rotation): each layer's keys rotated or not by the prompt's own queries."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.planning.key_rotation import key_rotation, tail_query_moment
from hf_cocktail.storage import params8
from hf_cocktail.storage.rotation import shared_matrices

from .conftest import make_tiny_llama, random_text

Q = dict(bits=4, chunk_size=32, scale_bits=16, scale_dtype=torch.float16)


def _logit_error(q, k, mats):
    """Brute force: the sum over query rows and keys of (q . (k_hat - k))^2, keys stored rotated by ``mats``."""
    y = k if mats is None else k @ mats
    back = params8.round_trip_keys(y, 4, 32, 16, torch.float16)
    k_hat = back if mats is None else back @ mats.transpose(-1, -2)
    g = q.shape[0] // k.shape[0]
    return (torch.einsum("htd,hnd->htn", q, (k_hat - k).repeat_interleave(g, 0)) ** 2).sum()


def test_the_query_moment_sums_q_qT_over_the_rows_after_the_context_per_kv_head():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8)  # B=2, H_q=4 (2 per KV head), the forward's last 6 of 10 tokens
    m = tail_query_moment(q, 10, [(7, 10), (5, 9)], 2)
    rows = [q[0, :, 3:6], q[1, :, 1:5]]  # positions 7..9 and 5..8 of the forward
    want = torch.stack([sum(r[h].T @ r[h] for r in rows for h in (2 * j, 2 * j + 1)) for j in range(2)])
    torch.testing.assert_close(m, want)
    with pytest.raises(ValueError, match="from token 3 on.*queries start at token 4"):
        tail_query_moment(q, 10, [(3, 10)], 2)


@pytest.mark.parametrize("seed", range(4))
def test_the_choice_is_the_lower_logit_error_of_the_two_bases(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 96, 16, generator=g)
    k[:, :, 3] *= 1 + 20 * seed  # an outlier channel, stronger with the seed
    q = torch.randn(4, 5, 16, generator=g) * torch.rand(16, generator=g) ** 2
    mats = shared_matrices(2, 16, 0, "cpu")
    moment = tail_query_moment(q.unsqueeze(0), 5, [(0, 5)], 2)
    want = "hadamard" if _logit_error(q, k, mats) <= _logit_error(q, k, None) else "hadamard_values"
    assert key_rotation([k], moment, mats, **Q) == want


def test_queries_that_ignore_an_outlier_channel_keep_the_keys_unrotated():
    """Per-channel steps follow each channel's range: unrotated, the outlier channel's large error meets no query;
    rotated, it spreads into every channel the queries read."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 128, 16, generator=g)
    k[:, :, 0] = 50 * torch.randn(1, 128, generator=g)
    q = torch.randn(1, 8, 16, generator=g)
    q[..., 0] = 0
    mats = shared_matrices(1, 16, 0, "cpu")
    assert key_rotation([k], tail_query_moment(q.unsqueeze(0), 8, [(0, 8)], 1), mats, **Q) == "hadamard_values"
    q[..., 1:] = 0  # ... and queries reading only that channel: rotating spreads its error away from them
    q[..., 0] = 1
    assert key_rotation([k], tail_query_moment(q.unsqueeze(0), 8, [(0, 8)], 1), mats, **Q) == "hadamard"


def test_each_layer_stores_with_its_choice_and_without_the_queries_keys_are_rotated(tiny_tokenizer, caplog):
    ids = tiny_tokenizer(random_text(300, seed=1), return_tensors="pt")
    kinds = {}
    for attn in ("cocktail", "sdpa"):
        model = make_tiny_llama(layers=3, head_dim=32, attn=attn, seed=3)
        cache = CocktailCache(CocktailConfig(uniform_bits=4, rotation="auto", residual_tokens=32))
        with caplog.at_level(logging.WARNING):
            model.generate(**ids, **cache_kwargs(model, cache), max_new_tokens=3, do_sample=False)
        kinds[attn] = [layer.store.rotation.kind for layer in cache.layers]
        assert all(layer.query_moment is None for layer in cache.layers)  # used once, then dropped
    assert set(kinds["cocktail"]) <= {"hadamard", "hadamard_values"}
    assert kinds["sdpa"] == ["hadamard"] * 3 and "rotation='auto' chooses each layer's key rotation" in caplog.text


def test_auto_matches_what_the_layers_queries_say(tiny_tokenizer):
    """The stored choice is key_rotation's on the layer's own prefill keys and the queries after the context."""
    from transformers import DynamicCache

    from hf_cocktail.calibrate.queries import recording_queries

    model = make_tiny_llama(layers=2, head_dim=32, seed=5)
    ids = tiny_tokenizer(random_text(300, seed=2), return_tensors="pt")["input_ids"]
    dyn = DynamicCache(config=model.config)
    with recording_queries(model, 0) as queries:
        model(input_ids=ids, **cache_kwargs(model, dyn), use_cache=True)
    cfg = CocktailConfig(uniform_bits=4, rotation="auto", residual_tokens=64, sink_tokens=4)
    cache = CocktailCache(cfg)
    cache.load_prefill(dyn, prefill_queries=queries)
    for layer in cache.layers:
        layer.flush_deferred()
    L = ids.shape[1]
    for i, layer in enumerate(cache.layers):
        k = dyn.layers[i].keys
        plan = cache.plans[0]
        moment = tail_query_moment(queries[i], L, [(plan.ctx_end, L)], k.shape[1])
        mats = shared_matrices(k.shape[1], 32, 0, "cpu")
        want = key_rotation([k[0, :, plan.ctx_start : plan.ctx_end]], moment, mats, **Q)
        assert layer.store.rotation.kind == want


def test_with_8bit_parameters_the_choice_reads_the_nearest_codes_error(monkeypatch):
    """The choice estimates each basis's error with the nearest 8-bit codes (the store refines once, on the basis
    chosen): the moment it sums is the unrefined round trip's."""
    from hf_cocktail.planning.key_rotation import key_error_moment

    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 64, 16, generator=g) * torch.linspace(0.5, 6, 16)
    quantizer = dict(bits=4, chunk_size=32, scale_bits=8, scale_dtype=torch.float16)
    e = params8.round_trip_keys(k, 4, 32, 8, torch.float16, refine=False) - k
    torch.testing.assert_close(key_error_moment(k, **quantizer), e.transpose(1, 2) @ e)
    calls = []
    monkeypatch.setattr(params8, "refine_codes", lambda *a, **kw: calls.append(1))
    key_error_moment(k, matrices=shared_matrices(2, 16, 0, "cpu"), **quantizer)
    assert calls == []
