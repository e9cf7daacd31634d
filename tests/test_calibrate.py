"""hf_cocktail.calibrate: the layer solve on a hand-computed case, the command end to end on tiny random models
(a Llama and a Gemma 3 with sliding layers), and bad inputs."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

from eval.methods.labels import label
from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate import calibrate_model, run
from hf_cocktail.calibrate.candidates import largest_fitting, rotation_suffix
from hf_cocktail.calibrate.cli import main
from hf_cocktail.calibrate.recall import insertion_points, recall_window
from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.solve import layer_deltas, solve
from hf_cocktail.calibrate.texts import Window, read_texts, split_windows

from .conftest import make_tiny_llama, random_text
from .test_architectures import make_model

SMALL = dict(window=200, question_tokens=16, continuation_tokens=8)


def test_the_solve_picks_the_hand_computed_optimum():
    """Two layers, options (4,3) 7 bits, (3,3) 6, (2,2) 4; budget 3.0 mean code bits = 12 summed. Fitting pairs:
    (4,3)+(2,2) [11 bits], (2,2)+(4,3) [11], (3,3)+(3,3) [12], (2,2)+(3,3) ...; deltas: layer 0 cheap to cut, layer 1
    not, so the optimum is layer 0 at (2,2), layer 1 at (4,3): 0.05 (vs 0.11 for (3,3)+(3,3))."""
    deltas = [
        {(4, 3): 0.0, (3, 3): 0.01, (2, 2): 0.05},
        {(4, 3): 0.0, (3, 3): 0.10, (2, 2): 0.20},
    ]
    picks, total = solve(deltas, 3.0)
    assert picks == [(2, 2), (4, 3)] and total == pytest.approx(0.05)
    assert solve(deltas, 3.5)[0] == [(4, 3), (4, 3)]  # 14 bits: nothing to cut
    with pytest.raises(ValueError, match="below the cheapest"):
        solve(deltas, 1.9)


def test_option_deltas_add_the_key_and_value_deltas_measured_around_the_base():
    rec = {"key_deltas": {"3": [0.1], "2": [0.5]}, "value_deltas": {"2": [0.2], "4": [-0.05]}}
    (d,) = layer_deltas([rec], [(4, 3)])
    assert d[(4, 3)] == 0.0 and d[(3, 2)] == pytest.approx(0.3) and d[(4, 4)] == pytest.approx(-0.05)
    assert d[(2, 2)] == pytest.approx(0.7) and (3, 4) not in d  # values above keys are not an option


def test_the_score_is_the_mean_of_both_klds_over_uniform_int4s():
    measured = [
        {"name": "uniform INT4", "kld": 0.002, "recall_kld": 0.01, "recall_kld_per_window": [0.01]},
        {"name": "a", "kld": 0.001, "recall_kld": 0.03, "recall_kld_per_window": [0.03]},  # half, three times INT4's
        {"name": "b", "kld": 0.003, "recall_kld": 0.005, "recall_kld_per_window": [0.005]},
    ]
    run.add_scores(measured)
    assert [m["score"] for m in measured] == pytest.approx([1.0, 1.75, 1.0])
    assert [m["recall_ratio"] for m in measured] == pytest.approx([1.0, 3.0, 0.5])
    with pytest.raises(ValueError, match="uniform INT4"):
        run.add_scores(measured[1:])


def test_the_recall_ratio_is_the_geometric_mean_of_the_per_probe_ratios():
    int4 = {"name": "uniform INT4", "recall_kld_per_window": [0.001, 0.001, 0.001, 0.029]}  # one heavy probe
    # a mean below INT4's (0.004 vs 0.008), yet twice INT4's divergence on three probes of four
    worse = {"name": "w", "recall_kld_per_window": [0.002, 0.002, 0.002, 0.010]}
    assert run.recall_ratio(worse, int4) == pytest.approx((2 * 2 * 2 * 10 / 29) ** 0.25)  # 1.53
    assert run.recall_ratio(int4, int4) == 1.0
    exact = {"name": "e", "recall_kld_per_window": [0.0, 0.001, 0.001, 0.029]}  # a KLD of 0 counts as 1e-12
    assert run.recall_ratio(exact, int4) == pytest.approx((1e-12 / 0.001) ** 0.25)
    with pytest.raises(ValueError, match="recall probes differ"):
        run.recall_ratio({"name": "x", "recall_kld_per_window": [0.1]}, int4)


def _ratio(record: dict, int4: dict) -> float:
    """The recall ratio written out: the product of the per-probe ratios, to the power one over their count."""
    prod = 1.0
    for a, b in zip(record["recall_kld_per_window"], int4["recall_kld_per_window"]):
        prod *= max(a, 1e-12) / max(b, 1e-12)
    return prod ** (1 / len(int4["recall_kld_per_window"]))


def _expected_choice(records: list[dict]) -> dict:
    """The rule written out: among the fitting non-baseline records, the lowest KLD of those recalling at least as
    faithfully as uniform INT4 probe by probe (the geometric mean of the ratios at most 1), else the lowest score."""
    int4 = next(c for c in records if c["name"] == "uniform INT4")
    fitting = [c for c in records if c["fits"] and c["kind"] != "baseline"]
    recalling = [c for c in fitting if _ratio(c, int4) <= 1.0 + 1e-12]
    return min(recalling, key=lambda c: c["kld"]) if recalling else min(fitting, key=lambda c: c["score"])


def test_the_choice_is_the_lowest_kld_among_those_recalling_as_well_as_int4_else_the_lowest_score():
    int4 = {"name": "uniform INT4", "kld": 0.002, "recall_kld_per_window": [0.010, 0.010], "score": 1.0}
    a = {"name": "a", "kld": 0.001, "recall_kld_per_window": [0.030, 0.030], "score": 1.75}  # lowest KLD, 3x INT4's
    b = {"name": "b", "kld": 0.004, "recall_kld_per_window": [0.009, 0.009], "score": 1.45}  # recalls better than INT4
    c = {"name": "c", "kld": 0.003, "recall_kld_per_window": [0.005, 0.020], "score": 1.25}  # as well, probe by probe
    assert run.choose([a, b, c], int4) is c
    assert run.choose([a, b], int4) is b
    assert run.choose([a], int4) is a  # none recalls as well: the lowest score
    d = {"name": "d", "kld": 0.001, "recall_kld_per_window": [0.020, 0.020], "score": 1.0}
    assert run.choose([a, d], int4) is d
    # a lower mean recall KLD than INT4's that is worse on most probes does not count as recalling as well
    heavy = {**int4, "recall_kld_per_window": [0.001, 0.001, 0.001, 0.029]}
    e = {"name": "e", "kld": 0.001, "recall_kld_per_window": [0.002, 0.002, 0.002, 0.010], "score": 1.1}
    f = {"name": "f", "kld": 0.002, "recall_kld_per_window": [0.001, 0.001, 0.001, 0.020], "score": 1.2}
    assert run.choose([e, f], heavy) is f and run.choose([e], heavy) is e


class _CharTokenizer:
    """One id per character, except that a word after a space takes the space's id with it (``" is"`` alone and
    after ``"account"`` differ), as word-start markers do; ``decode`` inverts it."""

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text) and text[i + 1] != " ":
                ids.append(1000 + ord(text[i + 1]))
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return {"input_ids": ids if i == 0 or text[0] != " " else [7, *ids]}  # a lone leading space: a marker first

    def decode(self, ids):
        return "".join(" " + chr(i - 1000) if i >= 1000 else chr(i) for i in ids if i != 7)


def test_a_recall_probe_hides_its_needles_in_the_context_and_asks_one():
    tok = _CharTokenizer()
    text = "First sentence. Second one here. Third and last. Fourth one. Fifth. Sixth and the end."
    window = Window("essay.txt", text, " what next", (5, 6))
    probe = recall_window(tok, window, needles=3)
    needle = r"Remember this: the access code of the (\w+) account is (\d{7})\. "
    found = re.findall(needle, probe.context)
    assert len(found) == 3 and re.sub(needle, "", probe.context) == window.context
    # just after the sentence ends nearest the depths 1/6, 1/2 and 5/6 of the 86 characters (14, 43, 72)
    assert re.findall(needle + r"(\w+)", probe.context) == [
        (k, v, w) for (k, v), w in zip(found, ["Second", "Fourth", "Sixth"])
    ]
    asked = re.search(r"code of the (\w+) account\?", probe.question).group(1)
    assert tok.decode(probe.continuation) == f" is {dict(found)[asked]}."
    # the answer's ids as they follow the question, not those of the answer alone (which start with a marker)
    assert probe.continuation[0] != tok(" is", add_special_tokens=False)["input_ids"][0]
    # seeded by the window's name: the same name the same probe, other names other needles
    assert probe == recall_window(tok, window, needles=3)
    others = {recall_window(tok, Window(f"essay {i}", text, " what next", (5, 6)), needles=3).context for i in range(4)}
    assert len(others | {probe.context}) == 5
    with pytest.raises(ValueError, match="needles"):
        recall_window(tok, window, needles=0)


def test_needles_go_to_sentence_ends_near_their_depth_else_to_spaces():
    text = "a" * 40 + ". " + " ".join(["word"] * 40)
    points = insertion_points(text, 4)
    assert points[0] == 42  # the one sentence end lies near the first depth (0.125 of 242 chars)
    assert all(text[p - 1] == " " for p in points[1:]) and len(set(points)) == 4  # the others at spaces near theirs
    assert insertion_points("nospace", 2) == [2, 5]


def test_largest_fitting_bisects_to_the_largest_value_within_the_target():
    seen = []

    def ratio(v):
        seen.append(v)
        return v / 10

    assert largest_fitting([1, 2, 3, 4, 5, 6, 7], ratio, 0.45) == (4, 0.4)
    assert len(seen) <= 3 and largest_fitting([5, 6], lambda v: v / 10, 0.45) is None


def _write_texts(folder, n, words=260):
    paths = []
    for i in range(n):
        p = os.path.join(folder, f"t{i}.txt")
        with open(p, "w") as f:
            f.write(random_text(words, seed=100 + i))
        paths.append(p)
    return paths


def test_the_command_writes_a_preset_whose_widths_are_the_solve_of_its_measured_deltas(tmp_path, tiny_tokenizer):
    model = make_tiny_llama(layers=3, head_dim=32)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    texts = _write_texts(tmp_path, 4)
    out = tmp_path / "preset"
    argv = ["--model", str(tmp_path / "model"), "--texts", *texts, "--target-bytes", "0.3", "--out", str(out)]
    argv += ["--calibration-texts", "2", "--validation-texts", "2", "--window", "200", "--question-tokens", "16"]
    argv += ["--continuation-tokens", "8", "--no-progress"]
    assert main(argv) == 0
    record = json.loads((out / "calibration.json").read_text())
    config = CocktailConfig.from_pretrained(out)
    assert config == CocktailConfig.from_dict(record["config"])
    chosen = next(c for c in record["candidates"] if c["name"] == record["chosen"])
    # the target holds on the bytes prompt (--bytes-window: the longest text here), not on every held-out window
    assert chosen["fits"] and chosen["bytes_ratio"] <= 0.3 and chosen["kind"] == "caps"
    assert chosen is _expected_choice(record["candidates"])
    int4 = next(c for c in record["candidates"] if c["name"] == "uniform INT4")
    ratios = (chosen["kld"] / int4["kld"], chosen["recall_kld"] / int4["recall_kld"])
    assert chosen["score"] == pytest.approx(sum(ratios) / 2)
    # the chosen caps are the solve of the recorded sensitivity at the chosen budget
    picks, _ = solve(layer_deltas(record["sensitivity"], [(4, 3)]), chosen["budget"])
    assert [list(p) for p in config.layer_bits] == [list(p) for p in picks]
    # every candidate was measured on both held-out texts and their recall probes, with the real cache's bytes
    assert all(len(c["kld_per_window"]) == len(c["recall_kld_per_window"]) == 2 for c in record["candidates"])
    assert {c["name"] for c in record["candidates"]} >= {"uniform INT4", "recommended()"}
    # the storage rotation: all four compared on both calibration texts, the lowest mean base KL stored
    choice = record["settings"]["rotation_choice"]
    assert set(choice["base_kl"]) == {"None", "hadamard", "hadamard_keys", "hadamard_values"}
    assert all(len(kls) == 2 for kls in choice["base_kl"].values())
    lowest = min(choice["base_kl"], key=lambda r: sum(choice["base_kl"][r]))
    assert str(choice["rotation"]) == lowest
    # caps built with it and, when it is a rotated one, unrotated too; the held-out texts chose among all of them
    assert choice["caps_rotations"] == ([lowest] if lowest == "None" else [lowest, "None"])
    caps_rotations = {str(c["rotation"]) for c in record["candidates"] if c["kind"] == "caps"}
    assert caps_rotations == set(choice["caps_rotations"]) and str(config.rotation) in caps_rotations
    card = (out / "README.md").read_text()
    assert "python -m hf_cocktail.calibrate" in card and record["chosen"] in card
    assert "Storage rotation: the mean KLD on the calibration texts" in card
    assert "No evaluation results yet" not in card


class _ScriptedProbe:
    """A layer probe whose KL is a hand-made function of the rotation and the widths (3 layers)."""

    BASE_KL = {None: 0.004, "hadamard": 0.003, "hadamard_keys": 0.005, "hadamard_values": 0.001}

    def __init__(self, rotation, seen):
        self.rotation, self.seen, self.num_layers = rotation, seen, 3

    def kl(self, widths):
        self.seen.append(self.rotation)
        return self.BASE_KL[self.rotation] + 0.01 * sum(7 - k - v for k, v in widths)


def test_the_sensitivity_is_measured_under_the_lowest_of_the_four_rotations(monkeypatch):
    """Hand-made base KLs whose minimum is ``hadamard_values`` (hadamard < none, so comparing only those two would
    pick hadamard): the choice and every sensitivity probe use values-only rotation."""
    seen = []
    monkeypatch.setattr(run, "prepare", lambda model, tok, w: SimpleNamespace(window=w))
    monkeypatch.setattr(run, "_probe", lambda model, prep, cocktail, r: _ScriptedProbe(r, seen))
    monkeypatch.setattr(run, "real_base_kl", lambda model, tok, prep, cocktail, r, base: 2 * _ScriptedProbe.BASE_KL[r])
    windows = [SimpleNamespace(name="w0"), SimpleNamespace(name="w1")]
    records, choice = run.sensitivity(None, None, windows, [0, 1, 2], progress=False)
    assert choice["rotation"] == "hadamard_values"
    assert choice["base_kl"] == {str(r): [kl, kl] for r, kl in _ScriptedProbe.BASE_KL.items()}
    assert choice["base_kl_real"] == {str(r): [2 * kl, 2 * kl] for r, kl in _ScriptedProbe.BASE_KL.items()}
    assert seen[:8] == [None, "hadamard", "hadamard_keys", "hadamard_values"] * 2  # the base under each, per window
    assert set(seen[8:]) == {"hadamard_values"} and len(seen[8:]) == 2 * (1 + 3 * 4)
    assert [r["base_kl"] for r in records] == [0.001, 0.001]
    assert records[0]["key_deltas"]["2"] == pytest.approx([0.02] * 3)  # one bit fewer per layer, 0.01 each
    # the comparison of before (hadamard or none) picks hadamard on the same probes
    _, two = run.sensitivity(None, None, windows, [0, 1, 2], progress=False, rotations=("hadamard", None))
    assert two["rotation"] == "hadamard" and set(two["base_kl"]) == {"hadamard", "None"}


def test_the_rotation_choice_needs_every_kind_and_a_reused_one_is_kept():
    kls = {None: [0.2], "hadamard": [0.3], "hadamard_keys": [0.25], "hadamard_values": [0.1, 0.4]}
    assert run.choose_rotation(kls) is None  # means: 0.2, 0.3, 0.25, 0.25
    with pytest.raises(ValueError, match="hadamard_keys"):
        run.choose_rotation({None: [0.2], "hadamard": [0.3], "hadamard_values": [0.1]})
    earlier = {"calibration_windows": ["a"], "cocktail_layers": [0], "sensitivity": [{"window": "a"}]}
    # a record from the two-way comparison: its sensitivity was measured under its rotation, which is kept
    old = {"rotation": "hadamard", "base_kl": {"hadamard": [0.1], "None": [0.2]}}
    assert run.reused_sensitivity({**earlier, "settings": {"rotation_choice": old}}, ["a"], [0])[1] == old
    bad = {"rotation": "hadamard_queries", "base_kl": {}}
    with pytest.raises(ValueError, match=r"rotation must be one of .*'hadamard_queries'"):
        run.reused_sensitivity({**earlier, "settings": {"rotation_choice": bad}}, ["a"], [0])


def test_a_rotated_choice_also_builds_unrotated_caps_whose_bytes_hold_no_matrices():
    kls = {"None": [0.2], "hadamard": [0.3], "hadamard_keys": [0.25], "hadamard_values": [0.1]}
    assert run.caps_rotations({"rotation": "hadamard_values", "base_kl": kls}) == ["hadamard_values", None]
    assert run.caps_rotations({"rotation": None, "base_kl": kls}) == [None]
    assert run.caps_rotations({"rotation": "hadamard", "base_kl": {"hadamard": [0.3]}}) == ["hadamard"]
    # a rotated candidate's name ends in the tag eval's labels read
    assert [label(f"caps2.9_f16_sal1{rotation_suffix(r)}") for r in ("hadamard_values", None)] == [
        "per-layer caps at 2.9 bits, 16-bit full part, 1% salient tokens, values rotated",
        "per-layer caps at 2.9 bits, 16-bit full part, 1% salient tokens",
    ]


def test_the_card_says_which_side_a_partial_rotation_rotates():
    from hf_cocktail.presets.model_card import make_model_card

    assert "Values (not keys) are stored rotated (`hadamard_values`" in make_model_card(
        CocktailConfig(rotation="hadamard_values")
    )
    assert "Keys (not values) are stored rotated (`hadamard_keys`" in make_model_card(
        CocktailConfig(rotation="hadamard_keys")
    )
    assert "Keys and values are stored rotated (`hadamard`" in make_model_card(CocktailConfig(rotation="hadamard"))
    assert "stored rotated" not in make_model_card(CocktailConfig())


def test_sliding_layers_are_not_calibrated_and_keep_a_placeholder_cap(tiny_tokenizer):
    model = make_model("gemma3", "cocktail")
    assert cocktail_layer_indices(model.config) == [1, 3]
    texts = [random_text(260, seed=200 + i) for i in range(2)]
    res = calibrate_model(
        model, tiny_tokenizer, texts, 0.35, calibration_texts=1, validation_texts=1, progress=False, **SMALL
    )
    assert res.cocktail_layers == [1, 3]
    assert all(len(d) == 2 for d in res.sensitivity[0]["key_deltas"].values())  # the 2 full-attention layers only
    bits = res.config.layer_bits
    assert len(bits) == 4 and bits[0] == bits[2] == (4, 4)
    assert res.measured(res.chosen)["bytes_ratio"] <= 0.35  # on the bytes prompt (bytes_tokens: the longest text)


def test_the_chunk_search_builds_on_the_lowest_scoring_caps_and_competes_by_score(tiny_tokenizer):
    model = make_tiny_llama(layers=2, head_dim=32)
    texts = [random_text(260, seed=300 + i) for i in range(2)]
    res = calibrate_model(
        model, tiny_tokenizer, texts, 0.4, calibration_texts=1, validation_texts=1, progress=False,
        search_scorers=("bm25",), rotations=(None,), **SMALL,
    )  # fmt: skip
    caps = [c for c in res.candidates if c["kind"] == "caps"]
    search = [c for c in res.candidates if c["kind"] == "search"]
    assert search, "no search candidate fitted the target"
    int4 = next(c for c in res.candidates if c["name"] == "uniform INT4")
    best = run.choose(caps, int4)
    assert all((c["full_part_bits"], c["salient"]) == (best["full_part_bits"], best["salient"]) for c in search)
    assert res.measured(res.chosen) is _expected_choice(res.candidates)
    assert all(len(c["recall_kld_per_window"]) == 1 for c in res.candidates)


def test_the_bytes_calibration_bounds_are_what_the_caches_report_says(tiny_tokenizer):
    """The target bounds everything the cache holds for its quantized layers, as ``memory_report()`` gives it to a
    user: with salient tokens that includes the prefill attention masses the plans keep, beyond the stores."""
    from hf_cocktail.cache import reports
    from hf_cocktail.calibrate.validate import filled_cache, prepare, quantized_ratio

    model = make_tiny_llama(layers=2, head_dim=32)
    texts = [(f"t{i}", random_text(260, seed=7 + i)) for i in range(2)]
    cal, _ = split_windows(tiny_tokenizer, texts, 1, 1, 200, 16, 8)
    prep = prepare(model, tiny_tokenizer, cal[0])
    cfg = CocktailConfig(uniform_bits=4, scale_bits=8, chunk_size=32, group_size=32, salient_tokens=0.05)
    cache = filled_cache(tiny_tokenizer, prep, cfg)
    ratio = quantized_ratio(cache)
    assert ratio == cache.memory_report()["quantized_layers_ratio_to_fp16"]
    assert ratio > reports.memory_report(cache._stores(), (), ())["ratio_to_fp16"]  # the stores alone


def test_bad_inputs_raise_clear_errors(tmp_path, tiny_tokenizer):
    model = make_tiny_llama(layers=1, head_dim=32)
    with pytest.raises(ValueError, match="no files given"):
        read_texts([])
    with pytest.raises(ValueError, match="non-empty list"):
        calibrate_model(model, tiny_tokenizer, [], progress=False)
    for target in (0, 1.5, "0.25"):
        with pytest.raises(ValueError, match=r"target must be a number in \(0, 1\]"):
            calibrate_model(model, tiny_tokenizer, ["a b"], target, progress=False)
    with pytest.raises(ValueError, match="texts too short"):
        split_windows(tiny_tokenizer, [("a", random_text(50)), ("b", random_text(300))], 1, 1, **SMALL)
    for rotations in ((), ("hadamard_queries",), "hadamard"):
        with pytest.raises(ValueError, match="rotations must be a non-empty list of"):
            calibrate_model(model, tiny_tokenizer, ["a"], rotations=rotations, progress=False)
    with pytest.raises(SystemExit):
        main(["--model", "m", "--texts", "a.txt", "--out", str(tmp_path), "--rotations", "none,hadamard_queries"])
    with pytest.raises(ValueError, match="search_scorers"):
        calibrate_model(model, tiny_tokenizer, ["a"], search_scorers=("random",), progress=False)
    bad = tmp_path / "x.csv"
    bad.write_text("a")
    with pytest.raises(ValueError, match=r"\.txt .*\.jsonl"):
        read_texts([bad])
    rows = tmp_path / "r.jsonl"
    rows.write_text(json.dumps({"context": "one"}) + "\n" + json.dumps("two") + "\n")
    assert [t for _, t in read_texts([rows], "context")] == ["one", "two"]
    with pytest.raises(ValueError, match="'text'"):
        read_texts([rows])


@pytest.mark.parametrize("preset", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_model_presets_are_what_the_calibrate_command_chose(preset):
    """model_cards/<preset> is written by ``python -m hf_cocktail.calibrate`` (no hand-picked widths): its config is
    the chosen candidate of its calibration.json, within the target, by the rule of :func:`run.choose`."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards", preset)
    record = json.loads(open(os.path.join(folder, "calibration.json")).read())
    assert record["command"].startswith("python -m hf_cocktail.calibrate ")
    assert CocktailConfig.from_pretrained(folder) == CocktailConfig.from_dict(record["config"])
    chosen = next(c for c in record["candidates"] if c["name"] == record["chosen"])
    # the target holds on the bytes window (a long prompt) where it was measured, else on the held-out windows
    assert chosen["fits"] and chosen.get("bytes_ratio", chosen["quantized_ratio"]) <= record["target_bytes"]
    assert chosen is _expected_choice(record["candidates"])
