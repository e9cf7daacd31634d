"""eval.formats.widths, code widths by importance: the round trips equal the package's quantizers, the weights sum
each KV head's query heads, the allocation matches hand-computed cases, and one tiny window runs end to end."""

from __future__ import annotations

import pytest
import torch

from eval.cli import UsageError
from eval.formats.widths import (
    allocate,
    distortions,
    keys_round_trip,
    mean_width,
    mixed_round_trip,
    output_weights,
    query_weights,
    values_round_trip,
)
from eval.formats.widths_cli import (
    Calibration,
    aggregate,
    measure_window,
    parse_args,
    plot,
    rotated_quantizer,
    write_summary,
)
from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.texts import Window
from hf_cocktail.calibrate.validate import prepare
from hf_cocktail.storage import quant
from tests.conftest import make_tiny_gemma3, random_text


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_round_trips_equal_the_package_quantizers_at_fp16_params(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 70, 64) * 3  # a partial last chunk
    x[1, 5, 7] = 50.0
    codes, scale, zero = quant.quantize_pack_keys(x, bits, 32, torch.float16)
    assert torch.equal(keys_round_trip(x, bits, 32), quant.dequantize_keys(codes, scale, zero, bits, 32))
    codes, scale, zero = quant.quantize_pack_values(x, bits, 32, torch.float16)
    assert torch.equal(values_round_trip(x, bits, 32), quant.dequantize_values(codes, scale, zero, bits, 32))


def test_zero_bits_keeps_each_groups_midpoint_and_eight_bits_is_nearly_exact():
    x = torch.tensor([[[1.0, -2.0], [3.0, 6.0]]])  # (H=1, N=2, D=2)
    assert torch.equal(keys_round_trip(x, 0, 32), torch.tensor([[[2.0, 2.0], [2.0, 2.0]]]))
    y = torch.randn(1, 64, 64)
    err8 = (keys_round_trip(y, 8, 32) - y).abs().max()
    err4 = (keys_round_trip(y, 4, 32) - y).abs().max()
    assert err8 < err4 / 8


def test_weights_sum_the_query_heads_of_each_kv_head():
    q = torch.zeros(1, 4, 3, 2)  # H_q=4 over H_kv=2
    q[0, 0, :, 0] = 1.0
    q[0, 1, :, 0] = 2.0
    q[0, 3, :, 1] = torch.tensor([1.0, 1.0, 4.0])
    w = query_weights([q, q], num_kv_heads=2)
    assert torch.allclose(w, torch.tensor([[5.0, 0.0], [0.0, 6.0]]))
    o = torch.zeros(3, 4 * 2)  # hidden 3, H_q*D = 8
    o[:, 0] = 1.0  # head 0 channel 0: |col|^2 = 3
    o[0, 5] = 2.0  # head 2 channel 1: 4
    assert torch.equal(output_weights(o, num_kv_heads=2, head_dim=2), torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
    with pytest.raises(ValueError, match="no queries"):
        query_weights([], 2)


def test_allocate_hand_computed():
    # widths 2 or 4; a unit moved to 4 saves d[2] - d[4]: 99, 1, 4.5
    d = torch.tensor([[100.0, 1.0], [10.0, 9.0], [5.0, 0.5]])
    assert allocate(d, (2, 4), 3.0).tolist() == [1, 0, 0]  # one unit fits (mean 8/3); the dearest
    assert allocate(d, (2, 4), 3.4).tolist() == [1, 0, 1]  # two fit (mean 10/3)
    assert allocate(d, (2, 4), 4.0).tolist() == [1, 1, 1]
    assert allocate(d, (2, 4), 2.0).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="budget"):
        allocate(d, (2, 4), 1.5)
    with pytest.raises(ValueError, match="widths"):
        allocate(d, (4, 2), 3.0)
    assert mean_width(torch.tensor([1, 0, 1]), (2, 4)) == pytest.approx(10 / 3)


def test_the_dear_channel_gets_the_bits():
    torch.manual_seed(0)
    H, N, D = 1, 64, 16
    k, v = torch.randn(H, N, D), torch.randn(H, N, D)
    wq = torch.full((H, D), 0.01)
    wq[0, 3] = 100.0  # the query reads channel 3
    wo = torch.ones(H, D)
    kd, vd = distortions(k, v, wq, wo, (2, 3, 4, 8), 32, 8)
    assert kd.shape == (16, 4) and vd.shape == (2, 4)
    choice = allocate(kd, (2, 3, 4, 8), 2.5)
    assert choice[3] == 3 and mean_width(choice, (2, 3, 4, 8)) <= 2.5
    # one width everywhere is the uniform round trip; mixed widths land on their own channels
    same = torch.zeros(16, dtype=torch.long)
    k_hat, v_hat = mixed_round_trip(k, v, same, torch.zeros(2, dtype=torch.long), (2, 4), 32, 8)
    assert torch.equal(k_hat, keys_round_trip(k, 2, 32)) and torch.equal(v_hat, values_round_trip(v, 2, 8))
    k_hat, v_hat = mixed_round_trip(k, v, choice, torch.tensor([0, 3]), (2, 3, 4, 8), 32, 8)
    assert torch.equal(k_hat[..., 3], keys_round_trip(k, 8, 32)[..., 3])
    assert torch.equal(v_hat[..., :8], values_round_trip(v, 2, 8)[..., :8])
    assert torch.equal(v_hat[..., 8:], values_round_trip(v, 8, 8)[..., 8:])


def test_parse_args_names_the_bad_argument():
    args = parse_args(["--width-sets", "234,0248", "--budgets", "3.5:3.5", "--uniform", "4:3"])
    assert args.width_sets == [(2, 3, 4), (0, 2, 4, 8)] and args.budgets == [(3.5, 3.5)]
    with pytest.raises(UsageError, match="--width-sets"):
        parse_args(["--width-sets", "432"])
    with pytest.raises(UsageError, match="--width-sets"):
        parse_args(["--width-sets", "239"])
    with pytest.raises(UsageError, match="--budgets"):
        parse_args(["--budgets", "4"])
    with pytest.raises(UsageError, match="--uniform"):
        parse_args(["--uniform", "8:4"])


def test_one_tiny_window_end_to_end(tiny_tokenizer, tmp_path):
    model = make_tiny_gemma3()
    calib_w = Window("calib", "<s> " + random_text(150, seed=4), " w1 w2 what is the code ?", tuple(range(10, 26)))
    held_w = Window("held", "<s> " + random_text(150, seed=3), " w1 w2 w3 what is the code ?", tuple(range(10, 26)))
    layers = cocktail_layer_indices(model.config)
    calib = Calibration(model, [prepare(model, tiny_tokenizer, calib_w)], layers, 32, 32)
    args = parse_args(
        ["--width-sets", "234,2348", "--budgets", "4:4,3:3", "--uniform", "4:4,3:3", "--rotation", "hadamard"]
    )
    rotated = rotated_quantizer(model, "hadamard", 32, 32)
    rec = measure_window(model, prepare(model, tiny_tokenizer, held_w), calib, args, rotated)
    by = {s["setting"]: s for s in rec["settings"]}
    assert set(by) == {
        "uniform K4/V4",
        "uniform hadamard K4/V4",
        "uniform K3/V3",
        "uniform hadamard K3/V3",
        *(f"widths {w} K{b}/V{b}" for w in ("234", "2348") for b in (4, 3)),
    }
    assert all(s["kld"] > 0 for s in by.values())
    assert by["uniform K4/V4"]["kld"] < by["uniform K3/V3"]["kld"]
    # at a budget of 4 with widths up to 4, every unit takes 4: the uniform round trip
    assert by["widths 234 K4/V4"]["kld"] == pytest.approx(by["uniform K4/V4"]["kld"], rel=1e-6)
    assert by["widths 2348 K3/V3"]["key_bits"] <= 3.0
    rows = aggregate([rec, {**rec, "window": "other"}])
    by_row = {r["setting"]: r for r in rows}
    assert by_row["uniform K3/V3"]["windows"] == 2
    d = by_row["uniform K3/V3"]["vs_reference"]
    want = by["uniform K3/V3"]["kld"] - by["uniform K4/V4"]["kld"]
    assert d["mean"] == pytest.approx(want) and d["lo"] == pytest.approx(want) and (d["lower"], d["n"]) == (0, 2)
    meta = {"calibration": ["calib"], "texts": ["held"], "layers": layers, "chunk_size": 32, "group_size": 32}
    write_summary(str(tmp_path), "tiny", meta, rows, [{"command": "python -m x", "commit": "abc", "runtime_s": 1}])
    plot(str(tmp_path), "tiny", rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "| widths 2348 K3/V3 |" in summary and "`python -m x` (commit abc" in summary
    assert f"{want:+.5f} [{want:+.5f}, {want:+.5f}], 0/2 lower" in summary
    assert (tmp_path / "widths.png").stat().st_size > 0
