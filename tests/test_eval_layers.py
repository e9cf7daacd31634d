"""eval/layers (the layer_bits calibration): the store round trip it scores equals what a CocktailCache stores, the
per-layer deltas of one prompt on a tiny Llama, the exact solver (checked against brute force) and the reports."""

import itertools
import json
import os

import pytest
import torch

from eval.cli import UsageError
from eval.kld.cases import KldCase
from eval.layers import cli
from eval.layers.measure import measure_case
from eval.methods.branching import context_span
from eval.methods.kinds import Request
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
    s, e = context_span(tiny_tokenizer, Request(prompt, ctx, q))
    assert (s, e) == (cache.plans[0].ctx_start, cache.plans[0].ctx_end) and e - s > 3 * cfg.chunk_size
    for layer, (kb, vb) in zip(cache.layers, cfg.layer_bits):
        keys, values = layer.dequantized()
        k, v = plain.layers[layer.layer_idx].keys, plain.layers[layer.layer_idx].values
        fq = FakeQuantizer(cfg, k.shape[1], k.shape[3], k.dtype)
        torch.testing.assert_close(keys[0, :, s:e], fq.keys(k[0, :, s:e], kb), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[0, :, s:e], fq.values(v[0, :, s:e], vb), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(keys[0, :, s:e], k[0, :, s:e], atol=1e-3)  # they are quantized


def test_measure_case_on_a_tiny_llama(tiny_tokenizer):
    model = make_tiny_llama(attn="sdpa", head_dim=32)
    prompt, ctx, q = make_prompt(90)
    case = KldCase("tiny/0", "longbench", "tiny", Request(prompt, ctx, q))
    cfg = CocktailConfig(**STORAGE)
    ticks = []
    rec = measure_case(model, tiny_tokenizer, case, cfg, [(4, 3)], [2], [2, 4], 6, None, lambda: ticks.append(1))
    assert len(ticks) == 1 + 2 * 3  # the base, then 2 layers x 3 options
    assert rec["base_kl"] > 0 and set(rec["key_deltas"]) == {"2"} and set(rec["value_deltas"]) == {"2", "4"}
    assert all(len(d) == 2 for d in [*rec["key_deltas"].values(), *rec["value_deltas"].values()])
    assert sum(rec["key_deltas"]["2"]) > 0  # 2-bit keys in one layer add divergence on this model
    again = measure_case(model, tiny_tokenizer, case, cfg, [(4, 3), (4, 3)], [2], [2, 4], 6)
    assert again == rec  # deterministic; one pair stands for every layer
    # a per-layer base, measured one bit around it
    ticks.clear()
    near = measure_case(
        model, tiny_tokenizer, case, cfg, [(4, 3), (3, 2)], [2, 3, 4], [2, 3, 4], 6, None, lambda: ticks.append(1), 1
    )
    assert near["key_deltas"]["2"][0] is None and near["key_deltas"]["3"][0] is not None  # 4 -> 2 is two steps
    assert near["key_deltas"]["3"][1] is None and near["value_deltas"]["2"][1] is None  # the layer's own base
    assert [near["value_deltas"][w][1] is None for w in ("3", "4")] == [False, True]
    assert len(ticks) == 1 + sum(d is not None for side in ("key_deltas", "value_deltas") for d in _all(near[side]))
    with pytest.raises(ValueError, match="base must be a list of"):
        measure_case(model, tiny_tokenizer, case, cfg, (4, 3), [2], [2], 6)


def _all(side: dict) -> list:
    return [d for widths in side.values() for d in widths]


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


def _record(case, base_kl, k3, k2, v2, v4):
    return {"case": case, "base_kl": base_kl, "key_deltas": {"3": k3, "2": k2}, "value_deltas": {"2": v2, "4": v4}}


def test_reports_average_the_prompts_and_solve_each_budget(tmp_path):
    records = [
        _record("a", 0.01, [0.0, 0.01], [0.001, 0.05], [0.0, 0.002], [0.0, -0.001]),
        _record("b", 0.03, [0.0, 0.03], [0.003, 0.07], [0.0, 0.004], [0.0, -0.003]),
    ]
    args = cli.parse_args(["--out-dir", str(tmp_path), "--budgets", "2,2.5,3.5", "--config", '{"group_size": 32}'])
    text = cli.write_reports(str(tmp_path), records, args)
    solved = json.load(open(tmp_path / "layer_bits.json"))
    assert solved["base_kl"] == pytest.approx(0.02) and solved["prompts"] == 2
    a = solved["allocations"]
    assert a["2"]["layer_bits"] == [[2, 2], [2, 2]]
    assert a["2.5"]["layer_bits"] == [[2, 2], [4, 2]]  # layer 1's keys matter, its values little
    assert a["2.5"]["estimated_kl"] == pytest.approx(0.02 + 0.002 + 0.0 + 0.003)
    assert a["3.5"]["layer_bits"][1] == [4, 4] and a["3.5"]["estimated_kl"] == pytest.approx(0.02 - 0.002)
    assert "| 1 | +200.0 | +600.0 | +30.0 | -20.0 |" in text
    assert os.path.getsize(tmp_path / "sensitivity.png") > 1000


def test_a_second_round_starts_from_an_earlier_allocation(tmp_path):
    records = [_record("a", 0.01, [0.0, 0.01], [0.001, 0.05], [0.0, 0.002], [0.0, -0.001])]
    first = cli.parse_args(["--out-dir", str(tmp_path), "--budgets", "2.5"])
    cli.write_reports(str(tmp_path), records, first)
    args = cli.parse_args(["--out-dir", str(tmp_path), "--base", f"{tmp_path}/layer_bits.json:2.5", "--max-step", "1"])
    assert args.base_pairs == [(2, 2), (4, 2)]
    assert cli.settings_of(args)["base"] == [[2, 2], [4, 2]] and cli.settings_of(first)["base"] == [4, 3]
    with pytest.raises(UsageError, match=r"no allocation '9' readable"):
        cli.parse_args(["--out-dir", str(tmp_path), "--base", f"{tmp_path}/layer_bits.json:9"])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--base", "3,4"], r"--base must be 'key_bits,value_bits' \(or FILE:BUDGET\) with value_bits <= key_bits"),
        (["--max-step", "0"], "--max-step must be >= 1"),
        (["--key-bits", "3,1"], "every width in 2, 3, 4"),
        (["--config", '{"group_size": 3}'], "group_size must be a power of two"),
        (["--per-task", "0"], "--per-task >= 1"),
    ],
)
def test_cli_refuses_bad_arguments(tmp_path, argv, says):
    with pytest.raises(UsageError, match=says):
        cli.parse_args(["--out-dir", str(tmp_path), *argv])


def test_layer_methods_come_from_the_calibration_file(tmp_path):
    from eval.methods.registry import layer_methods

    assert layer_methods(str(tmp_path / "missing.json")) == []
    records = [_record("a", 0.01, [0.0, 0.01], [0.001, 0.05], [0.0, 0.002], [0.0, -0.001])]
    args = cli.parse_args(["--out-dir", str(tmp_path), "--budgets", "2,2.5"])
    cli.write_reports(str(tmp_path), records, args)
    methods = layer_methods(str(tmp_path / "layer_bits.json"))
    assert [m.name for m in methods] == ["layers2_had_s8", "layers2.5_had_s8"]
    cfg = CocktailConfig(**methods[1].overrides)
    assert cfg.layer_bits == ((2, 2), (4, 2)) and cfg.uniform_bits == 4 and cfg.scale_bits == 8
    assert cfg.rotation == "hadamard" and cfg.group_size == 32
    args = cli.parse_args(["--out-dir", str(tmp_path), "--budgets", "2", "--config", '{"rotation": null}'])
    cli.write_reports(str(tmp_path), records, args)
    with pytest.raises(ValueError, match="need a hadamard / scale_bits=8 calibration"):
        layer_methods(str(tmp_path / "layer_bits.json"))
