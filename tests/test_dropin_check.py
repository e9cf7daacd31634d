"""eval/dropin_check.py's mechanics at a small size (the full run's bars are for its default sizes): plain generate on
a fresh tiny Llama, uniform 16-bit equal to DynamicCache, a second turn on the same cache, the files it writes."""

import json

from eval import dropin_check


def test_dropin_check_runs_small_and_writes_its_report(tmp_path):
    sizes = ["--prompt", "160", "--generated", "64", "--turn2-user", "40", "--turn2-generated", "8"]
    code = dropin_check.main(["--out-dir", str(tmp_path), *sizes])
    result = json.loads((tmp_path / "dropin.json").read_text())
    assert result["dynamic_equality"]["tokens_equal"] and result["dynamic_equality"]["max_logit_diff"] < 1e-4
    long = result["long_generation"]
    assert long["prompt_context"] == [4, 160 - 128]  # recommended(): sinks 4, residual_tokens 128
    assert long["turn1"]["tokens"] == 160 + 64 - 1 and long["turn2"]["tokens"] == 160 + 64 + 40 + 8 - 1
    assert long["turn2"]["turn_tokens"] == 48 and long["turn1"]["value_group_sizes"] == [64]
    assert [p["turn"] for p in result["ratio_points"]] == ["turn 1", "turn 2"]  # every 64 and every 8 steps
    ratios = (long["turn1"]["ratio_to_fp16"], long["turn2"]["ratio_to_fp16"])
    assert code == int(not (ratios[0] <= 0.40 and ratios[1] <= 0.45))
    report = (tmp_path / "report.md").read_text()
    assert "| uniform 16-bit vs DynamicCache" in report and (tmp_path / "ratio.png").stat().st_size > 1000
