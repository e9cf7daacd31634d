"""The calibration's probe and solver (hf_cocktail.calibrate, which ``python -m hf_cocktail.calibrate`` and the
committed per-layer widths rest on): the fake quantization it scores gives back exactly what a CocktailCache stores,
and the width solver finds the least summed delta within the budget (checked against brute force)."""

import itertools

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.solve import OPTIONS, solve
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import FakeEncoder, make_prompt, make_tiny_llama

STORAGE = dict(chunk_size=8, group_size=16, rotation="hadamard", uniform_bits=4)


@pytest.mark.parametrize("scale_bits", [16, 8])
def test_fake_quantizer_gives_back_what_the_store_holds(tiny_tokenizer, scale_bits):
    cfg = CocktailConfig(**STORAGE, scale_bits=scale_bits, layer_bits=((4, 3), (2, 2)))
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    prompt, ctx, q = make_prompt(90)
    cache = CocktailCache(cfg, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
    with torch.no_grad():
        model(**inputs, **cache_kwargs(model, cache), use_cache=True)
        plain = model(input_ids=inputs["input_ids"], use_cache=True).past_key_values
    s, e = cache.plans[0].ctx_start, cache.plans[0].ctx_end
    assert e - s > 3 * cfg.chunk_size
    for layer, (kb, vb) in zip(cache.layers, cfg.layer_bits):
        keys, values = layer.dequantized()
        k, v = plain.layers[layer.layer_idx].keys, plain.layers[layer.layer_idx].values
        fq = FakeQuantizer(cfg, k.shape[1], k.shape[3], k.dtype)
        torch.testing.assert_close(keys[0, :, s:e], fq.keys(k[0, :, s:e], kb), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[0, :, s:e], fq.values(v[0, :, s:e], vb), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(keys[0, :, s:e], k[0, :, s:e], atol=1e-3)  # they are quantized


def _brute_force(deltas, budget):
    best = None
    for picks in itertools.product(*[list(d) for d in deltas]):
        if sum(k + v for k, v in picks) <= 2 * len(deltas) * budget + 1e-9:
            total = sum(d[p] for d, p in zip(deltas, picks))
            best = total if best is None or total < best else best
    return best


def test_solver_finds_the_least_summed_delta_within_the_budget():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        deltas = [
            {o: float(torch.rand(1, generator=g)) * (8 - o[0] - o[1]) for o in OPTIONS} for _ in range(4)
        ]  # fewer bits cost more
        for budget in (2.0, 2.5, 2.75, 3.0, 3.6, 4.0):
            picks, total = solve(deltas, budget)
            assert sum(k + v for k, v in picks) <= 8 * budget + 1e-9
            assert total == pytest.approx(sum(d[p] for d, p in zip(deltas, picks)))
            assert total == pytest.approx(_brute_force(deltas, budget))
    with pytest.raises(ValueError, match=r"mean_code_bits=1.9 is below the cheapest allocation \(2 bits\)"):
        solve(deltas, 1.9)
