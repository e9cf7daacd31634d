"""eval.formats, the format study: RoPE undone and redone exactly with the cos/sin the model applies to each layer,
the dense-and-sparse split, the round trips of every format, the bytes per element and one tiny end-to-end window."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import DynamicCache

from eval.formats.cli import write_report
from eval.formats.measure import Setting, WindowProbe, measure_window, settings
from eval.formats.ranges import chunk_ranges, fast_channels, layer_line
from eval.formats.report import aggregate, bits_to_match, within_budget
from eval.formats.rope import apply_rope, layer_cos_sin, undo_rope
from eval.formats.variants import FORMATS, Format, bits_per_element, round_trip, split_outliers
from eval.records import append_jsonl
from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.texts import Window
from hf_cocktail.calibrate.validate import prepare
from hf_cocktail.integration.compat import cache_kwargs
from tests.conftest import make_tiny_gemma3, make_tiny_llama, random_text


def applied_cos_sin(model, layer: int, input_ids: torch.Tensor):
    """The ``position_embeddings`` the model passes to layer ``layer``'s attention in a forward of ``input_ids``."""
    seen = {}

    def grab(module, args, kwargs):
        seen["cs"] = kwargs["position_embeddings"]

    h = model.model.layers[layer].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        h.remove()
    return seen["cs"]


@pytest.mark.parametrize("make", [make_tiny_gemma3, make_tiny_llama])
def test_layer_cos_sin_is_what_each_layer_applies(make):
    model = make()
    T = 40
    ids = torch.randint(3, 100, (1, T))
    for layer in range(model.config.num_hidden_layers):
        cos, sin = applied_cos_sin(model, layer, ids)
        mine = layer_cos_sin(model, layer, torch.arange(T))
        assert torch.equal(mine[0], cos[0].float()) and torch.equal(mine[1], sin[0].float())


def test_gemma3_global_and_sliding_layers_have_their_own_rope_theta():
    model = make_tiny_gemma3()
    pos = torch.arange(50)
    types = model.config.layer_types
    for layer in (types.index("full_attention"), types.index("sliding_attention")):
        theta = model.config.rope_parameters[types[layer]]["rope_theta"]
        D = model.config.head_dim
        inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = pos[:, None].double() * inv
        cos, _ = layer_cos_sin(model, layer, pos)
        torch.testing.assert_close(cos.double(), torch.cat([ang, ang], -1).cos(), atol=1e-5, rtol=0)
    g, s = (layer_cos_sin(model, types.index(t), pos)[0] for t in ("full_attention", "sliding_attention"))
    assert not torch.allclose(g, s)


def test_undo_rope_then_apply_is_exact_on_a_models_stored_keys():
    model = make_tiny_gemma3()
    T = 64
    ids = torch.randint(3, 100, (1, T))
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, dyn), use_cache=True)
    for layer in cocktail_layer_indices(model.config):
        k = dyn.layers[layer].keys[0]  # (H_kv, T, D)
        cos, sin = layer_cos_sin(model, layer, torch.arange(T))
        pre = undo_rope(k, cos, sin)
        assert (apply_rope(pre, cos, sin) - k).abs().max() <= 4 * torch.finfo(torch.float32).eps * k.abs().max()
        # the pre-RoPE keys are what RoPE was applied to: rotating them by transformers' formula gives k back
        assert not torch.allclose(pre, k)


def test_apply_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = make_tiny_llama()
    k = torch.randn(1, 2, 30, model.config.head_dim)
    cos, sin = layer_cos_sin(model, 0, torch.arange(30))
    _, ref = apply_rotary_pos_emb(k, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rope(k[0], cos, sin), ref[0], atol=0, rtol=0)


def test_split_outliers_keeps_the_planted_spikes_and_leaves_the_rest():
    torch.manual_seed(0)
    H, N, D, C, G = 2, 70, 64, 32, 32
    x = torch.randn(H, N, D)
    spikes = [(0, 3, 5), (1, 40, 17), (0, 69, 63)]
    for h, t, d in spikes:
        x[h, t, d] = 50.0
    for side in ("k", "v"):
        dense, mask = split_outliers(x, 0.01, side, C, G)
        for s in range(0, N, C):  # round(0.01 * c * D) per chunk and head: 20, 20, round(3.84) = 4
            c = min(C, N - s)
            assert mask[:, s : s + c].sum(dim=(1, 2)).tolist() == [round(0.01 * c * D)] * H
        assert all(mask[h, t, d] for h, t, d in spikes)
        assert torch.equal(dense[~mask], x[~mask])
        assert dense.abs().max() < 50.0
    dense, mask = split_outliers(x, 0.0, "k", C, G)
    assert not mask.any() and torch.equal(dense, x)
    with pytest.raises(ValueError, match="fraction"):
        split_outliers(x, 1.5, "k", C, G)
    with pytest.raises(ValueError, match="side"):
        split_outliers(x, 0.01, "q", C, G)


def quantizer(D=64):
    return FakeQuantizer(CocktailConfig(scale_bits=8), 2, D, torch.float32)


def test_round_trips():
    torch.manual_seed(1)
    fq = quantizer()
    N, D = 96, 64
    x = torch.randn(2, N, D)
    x[0, 10, 3] = 40.0
    # today: the package's own quantizers, unchanged
    assert torch.equal(round_trip(fq, x, 4, "k", FORMATS["today"])[0], fq.keys(x, 4))
    assert torch.equal(round_trip(fq, x, 2, "v", FORMATS["today"])[0], fq.values(x, 2))
    # outliers come back as their fp16 values; the budget is as asked
    for side in ("k", "v"):
        y, frac = round_trip(fq, x, 2, side, FORMATS["sparse1"])
        _, mask = split_outliers(x, 0.01, side, 32, 32)
        assert torch.equal(y[mask], x[mask].half().float())
        assert frac == pytest.approx(float(mask.float().mean()))
    # spikes widen the min-max range: dense-and-sparse has less error
    err = {f: (round_trip(fq, x, 3, "k", FORMATS[f])[0] - x).abs().mean() for f in ("today", "sparse1")}
    assert err["sparse1"] < err["today"]
    with pytest.raises(ValueError, match="cos and sin"):
        round_trip(fq, x, 4, "k", FORMATS["pre_rope"])


def test_pre_rope_quantizes_keys_whose_channels_rope_spreads():
    """Keys constant per channel before RoPE: RoPE spreads each channel over a chunk; pre-RoPE there is no spread."""
    N, D = 64, 64
    pre = torch.randn(1, 1, D).expand(1, N, D).contiguous() * 3
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    ang = torch.arange(N)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    k = apply_rope(pre, cos, sin)
    fq = FakeQuantizer(CocktailConfig(scale_bits=16, scale_dtype="float32"), 1, D, torch.float32)
    post_err = (round_trip(fq, k, 2, "k", FORMATS["today"])[0] - k).abs().max()
    pre_err = (round_trip(fq, k, 2, "k", FORMATS["pre_rope"], cos, sin)[0] - k).abs().max()
    assert pre_err < 1e-5 < post_err
    # values are untouched by pre_rope
    v = torch.randn(1, N, D)
    assert torch.equal(round_trip(fq, v, 2, "v", FORMATS["pre_rope"], cos, sin)[0], fq.values(v, 2))


def test_bits_per_element_hand_computed():
    # keys, INT3, 8-bit params on C=32 tokens of D=256 channels, 1% outliers:
    # 3 + (8 + 8) / 32 + 3 * 16 / (32 * 256) + 0.01 * (16 + 16) = 3 + 0.5 + 0.005859375 + 0.32
    assert bits_per_element(3, "k", 0.01, 32, 32, 256, 8) == pytest.approx(3.825859375)
    # values, INT4, 16-bit scale and zero per group of G=32 channels: 4 + 32 / 32
    assert bits_per_element(4, "v", 0.0, 32, 32, 256, 16) == 5.0
    # values, INT2, 8-bit params per group of 32 with blocks per chunk of C=64 tokens, D=128: 2 + 0.5 + 48 / 8192
    assert bits_per_element(2, "v", 0.0, 64, 32, 128, 8) == pytest.approx(2.505859375)
    with pytest.raises(ValueError, match="scale_bits"):
        bits_per_element(2, "v", 0.0, 32, 32, 64, 4)


def test_settings_grid():
    fmts = [FORMATS["today"], FORMATS["pre_rope"]]
    grid = settings(fmts, [2, 4], pairs=[(4, 3)])
    assert ("pre_rope", "v") not in {(st.fmt.name, st.side) for st in grid}
    assert len(grid) == 2 * 2 + 1 * 2 + 2 * 2 + 2
    assert grid[-1].key == ("pre_rope", 4, 3, "kv")
    assert Setting(FORMATS["today"], 2, "k").key == ("today", 2, 2, "k")


def test_one_tiny_window_end_to_end(tiny_tokenizer, tmp_path):
    model = make_tiny_gemma3()
    w = Window("tiny", "<s> " + random_text(150, seed=3), " w1 w2 w3 what is the code ?", tuple(range(10, 26)))
    prep = prepare(model, tiny_tokenizer, w)
    layers = cocktail_layer_indices(model.config)
    probe = WindowProbe(model, prep, layers, quantizer())
    grid = settings([FORMATS["today"], Format("pre_rope+sparse1", True, 0.01)], [2, 4], pairs=[(4, 2)])
    rec = measure_window(probe, grid)
    assert rec["fp16_copy_kld"] < 1e-9
    assert rec["rope_round_trip_max_abs_err"] <= 1e-6 * rec["keys_max_abs"]
    by = {(s["format"], s["bits"], s["value_bits"], s["side"]): s for s in rec["settings"]}
    assert all(s["kld"] > 0 for s in by.values())
    assert by[("today", 4, 4, "kv")]["kld"] < by[("today", 4, 2, "kv")]["kld"] < by[("today", 2, 2, "kv")]["kld"]
    assert by[("pre_rope+sparse1", 2, 2, "kv")]["outliers"]["k"] > 0
    meta = {"chunk_size": 32, "group_size": 32, "head_dim": 64, "scale_bits": 8}
    other = {**rec, "window": "other"}
    rows = aggregate([rec, other], meta)
    row = {(r["format"], r["bits"], r["value_bits"], r["side"]): r for r in rows}
    assert row[("today", 4, 4, "kv")]["bits_per_element"] == pytest.approx(4 + 0.5 + 48 / (32 * 64))
    assert row[("today", 4, 2, "kv")]["bits_per_element"] == pytest.approx(3 + 0.5 + 48 / (32 * 64))
    assert row[("today", 4, 4, "kv")]["kld"] == pytest.approx(by[("today", 4, 4, "kv")]["kld"])
    assert list(row[("today", 4, 4, "kv")]["kld_per_window"]) == ["tiny", "other"]
    assert all(r["bits_per_element"] <= 4.0 for r in within_budget(rows))
    # the report of a results folder: summary.md, results.json, the PNG
    folder = tmp_path / "tiny-gemma3"
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps({**meta, "layers": layers, "num_kv_heads": 1}))
    append_jsonl(str(folder / "records.jsonl"), rec)
    append_jsonl(str(folder / "runs.jsonl"), {"command": "python -m eval.formats ...", "commit": "abc", "runtime_s": 1})
    write_report(str(tmp_path))
    summary = (tmp_path / "summary.md").read_text()
    assert "## tiny-gemma3" in summary and "`python -m eval.formats ...` (commit abc" in summary
    assert "| today | 4/2 |" in summary
    assert (tmp_path / "formats_tiny-gemma3.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["models"]["tiny-gemma3"]["rows"]


def test_bits_to_match_interpolates_log_kld():
    rows = [
        {"format": "f", "side": "kv", "bits": w, "value_bits": w, "bits_per_element": b, "kld": k}
        for w, b, k in ((2, 2.5, 1e-2), (3, 3.5, 1e-3), (4, 4.5, 1e-4))
    ]
    rows.append({"format": "f", "side": "kv", "bits": 4, "value_bits": 2, "bits_per_element": 3.5, "kld": 1e-9})
    assert bits_to_match(rows, "f", "kv", 1e-3) == pytest.approx(3.5)  # the 4/2 row is not on the uniform curve
    assert bits_to_match(rows, "f", "kv", 1e-6) is None
    assert bits_to_match(rows, "f", "kv", 10**-3.5) == pytest.approx(4.0)
    assert bits_to_match(rows, "f", "kv", 1e-5) is None
    assert bits_to_match(rows, "f", "kv", 1.0) == 2.5  # every width reaches it: the fewest bits measured
    assert bits_to_match(rows, "f", "k", 1e-3) is None


def test_ranges_diagnostic_on_keys_constant_before_rope():
    """Keys constant per channel before RoPE: no range before; after, the fast pairs' channels spread."""
    model = make_tiny_llama()
    N, D = 64, model.config.head_dim
    pos = torch.arange(N)
    cos, sin = layer_cos_sin(model, 0, pos)
    k = apply_rope(torch.randn(2, 1, D).expand(2, N, D), cos, sin)
    fast = fast_channels(cos, sin, 32)
    inv = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2) / D)
    assert torch.equal(fast, (32 * inv > 1.0).repeat(2))
    assert chunk_ranges(undo_rope(k, cos, sin), 32).max() < 1e-5
    r = layer_line(model, 0, k, pos, 32)
    assert r["fast_pairs"] == int((32 * inv > 1.0).sum()) and r["range_ratio"] > 100


def test_held_out_texts_skip_every_calibration_text():
    from eval.formats.cli import calibration_texts, held_out_texts
    from eval.paths import ESSAY_DIR

    used = calibration_texts()
    assert {"unions.txt", "worked.txt"} <= used  # model_cards/*/calibration.json read these
    if not os.path.isdir(ESSAY_DIR):
        pytest.skip("no ../shared/data")
    held = [os.path.basename(p) for p in held_out_texts()]
    assert held and not used & set(held) and held == sorted(held)


def test_params_rounding_covering_encoder_covers_and_the_package_rounds_nearer():
    """The study's 'covering' 8-bit encoder (the one before the nearest codes) covers every group; the package's
    nearest codes sit closer to each group's min and needed scale on average."""
    from eval.formats.params_rounding import covering_params8
    from hf_cocktail.storage import params8

    g = torch.Generator().manual_seed(0)
    mn = torch.randn(30, 64, generator=g) * 3
    mx = mn + torch.rand(30, 64, generator=g) * 4 + 0.01
    s_cov, z_cov = params8.decode_params8(*covering_params8(mn, mx, 3, torch.float32))
    s_near, z_near = params8.decode_params8(*params8.encode_params8(mn, mx, 3, torch.float32))
    assert bool((z_cov <= mn + 1e-6).all()) and bool((s_cov * 7 + z_cov >= mx - 1e-5).all())
    assert float((z_near - mn).abs().mean()) < float((z_cov - mn).abs().mean())
    need_cov, need_near = (mx - z_cov) / 7, (mx - z_near) / 7
    ok = (need_near > 1e-3) & (need_cov > 1e-3)  # (a group whose max is below its rounded zero needs no scale)
    err_near, err_cov = torch.log2(s_near / need_near)[ok], torch.log2(s_cov / need_cov)[ok]
    assert float(err_near.abs().mean()) < float(err_cov.abs().mean())
