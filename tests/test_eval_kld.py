"""eval/kld: the KL divergence and top-1 agreement on hand-built logits (identical -> exactly 0; a known perturbation
-> its analytic KL), teacher forcing on a fake model (positions, one forward = token by token), the two segments on a
tiny Llama (FP16 against itself is exactly 0, its teacher-forced argmax is its own greedy answer; a quantized cache
gives the same logits in one forward as token by token), the summary and its bootstrap, the CLI errors."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from eval.cli import UsageError
from eval.paths import REPO_ROOT

from .conftest import make_prompt


# ---------------------------------------------------------------- the divergence
def test_identical_logits_give_exactly_zero():
    from hf_cocktail.calibrate.divergence import kl_and_top1

    torch.manual_seed(0)
    ref = torch.randn(7, 301) * 5
    kl, agree = kl_and_top1(ref, ref.clone())
    assert kl.dtype == torch.float64
    assert torch.equal(kl, torch.zeros(7, dtype=torch.float64))
    assert agree.all()


def test_known_perturbation_gives_its_kl():
    from hf_cocktail.calibrate.divergence import kl_and_top1

    # two outcomes: P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    kl, agree = kl_and_top1(ref, q)
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-12)
    # one logit raised by c: KL(P || Q) = log(1 - p_j + p_j e^c) - c p_j
    torch.manual_seed(1)
    z = torch.randn(5, 1000, dtype=torch.float64)
    j, c = 17, 2.5
    p_j = torch.softmax(z, -1)[:, j]
    pert = z.clone()
    pert[:, j] += c
    kl, agree = kl_and_top1(z, pert)
    expected = torch.log(1 - p_j + p_j * math.exp(c)) - c * p_j
    assert torch.allclose(kl, expected, rtol=1e-9, atol=1e-12)
    assert (kl > 0).all()
    # top-1: a shift that moves the argmax of one row only
    shifted = z.clone()
    shifted[2, (z[2].argmax() + 1) % 1000] = z[2].max() + 1
    _, agree = kl_and_top1(z, shifted)
    assert agree.tolist() == [True, True, False, True, True]
    with pytest.raises(ValueError, match="shapes differ"):
        kl_and_top1(z, z[:3])


# ---------------------------------------------------------------- teacher forcing on a fake model
class PositionModel(torch.nn.Module):
    """A fake causal LM: the logits at a fed token put their mass on (absolute position + 1) mod V, plus a little on
    the fed token itself; it stores one key per token in the cache it is given and records its forward sizes."""

    V = 50

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(get_text_config=lambda decoder=True: SimpleNamespace(vocab_size=self.V))
        self.calls = []

    def forward(self, input_ids, cache=None, past_key_values=None, use_cache=True):
        cache = cache if cache is not None else past_key_values
        past, n = cache.get_seq_length(), input_ids.shape[1]
        cache.update(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), 0)
        self.calls.append(n)
        logits = torch.zeros(1, n, self.V)
        for i in range(n):
            logits[0, i, (past + i + 1) % self.V] = 10.0
            logits[0, i, int(input_ids[0, i]) % self.V] += 1.0
        return SimpleNamespace(logits=logits)


def _filled_cache(n):
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), 0)
    return cache


def test_teacher_forcing_positions_line_up():
    from hf_cocktail.calibrate.divergence import teacher_force

    model = PositionModel()
    tokens = torch.tensor([[3, 30, 4, 21, 40]])
    logits = teacher_force(model, _filled_cache(7), tokens)
    assert model.calls == [5]  # DynamicCache: one forward
    assert logits.shape == (5, PositionModel.V)
    # row i belongs to absolute position 7 + i (the cache held 7 tokens) and to the token fed there
    assert logits.argmax(-1).tolist() == [8, 9, 10, 11, 12]
    assert [int(logits[i, t]) for i, t in enumerate(tokens[0].tolist())] == [1, 1, 1, 1, 1]
    model.calls.clear()
    steps = teacher_force(model, _filled_cache(7), tokens, step_by_step=True)
    assert model.calls == [1] * 5
    assert torch.equal(steps, logits)
    assert teacher_force(model, _filled_cache(7), tokens[:, :0]).shape == (0, PositionModel.V)


def test_which_caches_are_fed_token_by_token():
    from transformers import LlamaConfig

    from eval.methods.kivi import KiviCache
    from hf_cocktail import CocktailCache
    from hf_cocktail.calibrate.divergence import needs_steps

    assert not needs_steps(DynamicCache(), 40)
    assert not needs_steps(CocktailCache(), 40)
    assert needs_steps(KiviCache(num_layers=1), 2)  # its residual windows move with every token
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=10,
    )
    try:
        from transformers import QuantizedCache

        qc = QuantizedCache(backend="hqq", config=cfg, nbits=4)
    except Exception as e:  # hqq missing
        pytest.skip(f"QuantizedCache(hqq) unavailable: {e}")
    qc.update(torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32), 0)  # prefill: quantized, residual empty
    assert not needs_steps(qc, 127) and needs_steps(qc, 128)  # 128 would re-quantize inside the block


# ---------------------------------------------------------------- the two segments on a tiny Llama
def _tiny_runner(tiny_llama, tiny_tokenizer):
    from eval.kld.measure import KldRunner

    runner = KldRunner(tiny_llama, tiny_tokenizer, encoder="unused", max_answer_tokens=9, tail_tokens=4)
    runner.eos = []  # the tiny vocabulary has no stop token: always 9 answer tokens
    return runner


def test_segments_on_a_tiny_model(tiny_llama, tiny_tokenizer):
    from eval.kld.cases import KldCase
    from eval.methods.kinds import Request
    from eval.methods.registry import METHODS

    prompt, ctx, query = make_prompt(150, seed=5)
    case = KldCase("t/1", "test", "s", Request(prompt, ctx, query, "1"))
    recs = {
        r["method"]: r
        for r in _tiny_runner(tiny_llama, tiny_tokenizer).run(
            case, [METHODS["fp16"], METHODS["int2"], METHODS["int2_had"]]
        )
    }
    fp = recs["fp16"]
    # FP16 against itself: exactly 0 and full agreement, in both segments
    assert fp["kl_answer"] == 0.0 and fp["top1_answer"] == 1.0 and fp["kl_tail"] == 0.0 and fp["top1_tail"] == 1.0
    assert fp["kv_ratio"] == 1.0
    # positions: answer tokens 2..9 (8), then the tail: the prompt's last 4 tokens (the question follows the
    # context: "w4 w5 what is the secret code ?") + the same 8
    assert fp["answer_tokens"] == 9 and fp["n_answer"] == 8
    assert fp["tail_tokens"] == 4 and fp["n_tail"] == 12
    # the teacher-forced FP16 logits predict FP16's own greedy answer at every position
    assert fp["ref_top1_is_answer"] == 1.0
    for name in ("int2", "int2_had"):
        r = recs[name]
        assert r["kl_answer"] > 0 and r["kl_tail"] > 0 and r["kv_ratio"] < 1
        assert len(r["kl_answer_pos"]) == 8 and len(r["kl_tail_pos"]) == 12
        assert r["answer_ids"] == fp["answer_ids"] and r["precision_counts"]["int2"] > 0


def test_segments_on_a_sliding_window_model(tiny_gemma3, tiny_tokenizer):
    """Gemma 3-shaped (sliding + global layers): the FP16 reference keeps each sliding layer's window and token count
    (its teacher-forced argmax is its own greedy answer), a Cocktail cache at 16 bits gives FP16's logits in both
    segments (the tail's prefix has a prefill of its own, the whole prompt's windows no longer hold it), and the
    global layers' ratio is reported beside the whole cache's."""
    from eval.kld.cases import KldCase
    from eval.kld.report import markdown, summarize
    from eval.methods.kinds import CocktailMethod, Request
    from eval.methods.registry import METHODS

    prompt, ctx, query = make_prompt(150, seed=5)
    case = KldCase("t/1", "test", "s", Request(prompt, ctx, query, "1"))
    u16 = CocktailMethod("u16", "every chunk at 16 bits", {"uniform_bits": 16})
    runner = _tiny_runner(tiny_gemma3, tiny_tokenizer)
    recs = {r["method"]: r for r in runner.run(case, [METHODS["fp16"], u16, METHODS["int4"]])}
    fp = recs["fp16"]
    assert fp["ref_top1_is_answer"] == 1.0 and fp["tail_tokens"] == 4
    assert fp["kl_answer"] == 0.0 and fp["kl_tail"] == 0.0
    assert fp["kv_ratio"] == 1.0 and fp["kv_ratio_global"] == 1.0
    assert recs["u16"]["kl_answer"] < 1e-9 and recs["u16"]["kl_tail"] < 1e-9
    assert recs["u16"]["top1_answer"] == recs["u16"]["top1_tail"] == 1.0
    q4 = recs["int4"]
    assert q4["kl_answer"] > 0 and q4["kv_ratio_global"] < q4["kv_ratio"] < 1
    md = markdown(summarize(list(recs.values()), ["fp16", "u16", "int4"]))
    assert (
        "| kv_ratio | kv_ratio global |" in md
        and f"| uniform INT4 | `int4` | 1 | {q4['kv_ratio']:.3f} | {q4['kv_ratio_global']:.3f} |" in md
    )
    with pytest.raises(ValueError, match="kivi2.*does not support sliding-window"):
        list(runner.run(case, [METHODS["kivi2"]]))


def test_tail_never_reaches_into_the_context(tiny_llama, tiny_tokenizer):
    from eval.kld.cases import KldCase
    from eval.kld.measure import context_end
    from eval.methods.kinds import Request
    from eval.methods.registry import METHODS

    prompt, ctx, query = make_prompt(120, seed=6)
    short = prompt[: prompt.index(ctx) + len(ctx)] + " ?"  # one token after the context
    req = Request(short, ctx, query, "2")
    ids = tiny_tokenizer(short)["input_ids"]
    assert context_end(tiny_tokenizer, req) == len(ids) - 1
    rec = next(_tiny_runner(tiny_llama, tiny_tokenizer).run(KldCase("t/2", "test", "s", req), [METHODS["int2"]]))
    assert rec["tail_tokens"] == 1 and rec["n_tail"] == 1 + rec["n_answer"]


def test_one_forward_equals_token_by_token_for_cocktail(tiny_llama, tiny_tokenizer):
    from eval.methods.branching import branch, prefill
    from eval.methods.kinds import Request
    from eval.methods.registry import METHODS
    from hf_cocktail.calibrate.divergence import teacher_force

    prompt, ctx, query = make_prompt(150, seed=7)
    req = Request(prompt, ctx, query, "3")
    ids = tiny_tokenizer(prompt, return_tensors="pt")["input_ids"]
    dyn, _ = prefill(tiny_llama, ids)
    feed = ids[:, 10:22]
    for name in ("int2", "int2_had"):
        one = teacher_force(tiny_llama, branch(METHODS[name], tiny_llama, tiny_tokenizer, dyn, ids, req).cache, feed)
        steps = teacher_force(
            tiny_llama, branch(METHODS[name], tiny_llama, tiny_tokenizer, dyn, ids, req).cache, feed, step_by_step=True
        )
        assert torch.allclose(one, steps, atol=1e-4, rtol=1e-4), name


# ---------------------------------------------------------------- the summary
def _rec(method, stratum, kl, top1=1.0, kv=0.5, source="longbench"):
    return {
        "case": f"{source}/{stratum}",
        "method": method,
        "source": source,
        "stratum": stratum,
        "kv_ratio": kv,
        "kl_answer": kl,
        "top1_answer": top1,
        "n_answer": 3,
        "kl_tail": kl,
        "top1_tail": top1,
        "n_tail": 5,
    }


def test_summary_and_bootstrap(tmp_path):
    from eval.kld.report import bootstrap_mean, summarize, write_reports

    mean, lo, hi = bootstrap_mean({"a": [1.0, 1.0], "b": [1.0]})
    assert (mean, lo, hi) == (1.0, 1.0, 1.0)
    mean, lo, hi = bootstrap_mean({"a": [0.0, 1.0, 2.0, 3.0], "b": [10.0, 11.0]})
    assert mean == pytest.approx(27 / 6) and lo < mean < hi
    assert bootstrap_mean({}) == (None, None, None)
    recs = [
        _rec("fp16", "t1", 0.0, kv=1.0),
        _rec("fp16", "t2", 0.0, kv=1.0),
        _rec("int2", "t1", 0.2, 0.5, 0.25),
        _rec("int2", "t2", 0.4, 1.0, 0.27),
        _rec("int2", "needle", 0.1, 1.0, 0.2, source="needle"),
    ]
    recs.append({**_rec("int2", "t3", None, kv=0.26), "kl_answer": None, "top1_answer": None, "n_answer": 0})
    rows = summarize(recs, ["fp16", "int2"])
    by = {(r["source"], r["method"]): r for r in rows}
    assert set(by) == {
        ("longbench", "fp16"),
        ("longbench", "int2"),
        ("needle", "int2"),
        ("all", "fp16"),
        ("all", "int2"),
    }
    lb = by[("longbench", "int2")]
    assert lb["examples"] == 3 and lb["kv_ratio"] == pytest.approx(0.26)
    assert lb["kld_answer"] == pytest.approx(0.3)  # the record without answer positions
    assert lb["top1_answer"] == 0.75 and lb["positions_answer"] == 6
    assert by[("longbench", "fp16")]["kld_answer"] == 0.0
    md = write_reports(str(tmp_path), recs, ["fp16", "int2"], "# header")
    assert md.startswith("# header") and "| uniform INT2 | `int2` | 3 | 0.260 | 0.3000 [" in md
    assert (tmp_path / "summary.csv").read_text().splitlines()[0].startswith("source,method,examples,kv_ratio")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "kld_vs_bytes.png").stat().st_size > 1000


def test_paired_with_the_paper():
    from eval.kld.report import paired, paired_markdown

    recs = [
        _rec("cocktail", "t1", 0.2),
        _rec("cocktail", "t2", 0.4),
        _rec("cocktail", "t3", 0.1),
        _rec("had", "t1", 0.1),
        _rec("had", "t2", 0.2),
        _rec("had", "t3", 0.15),
        _rec("had", "t4", 9.0),
    ]
    (row,) = paired(recs, ["cocktail", "had"])
    assert row["examples"] == 3  # t4 has no cocktail record
    assert row["diff"] == pytest.approx((-0.1 - 0.2 + 0.05) / 3)
    assert row["diff_lo"] <= row["diff"] <= row["diff_hi"]
    assert (row["lower"], row["higher"]) == (2, 1) and row["ratio"] == pytest.approx(0.45 / 0.7)
    assert "| longbench | had | `had` | 3 | -0.0833 [" in "\n".join(paired_markdown([row]))
    assert paired(recs, ["had"], ref="cocktail") == paired(recs, ["had"])


# ---------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--per-task", "0"], "--per-task must be >= 1"),
        (["--tasks", "qasper,dureader"], "unknown or unsupported task"),
        (["--tasks", "none"], "nothing to run"),
        (["--methods", "fp16,nope"], "unknown method"),
        (["--methods", "fp16,fp16"], "lists a method twice"),
        (["--max-answer-tokens", "1"], "--max-answer-tokens must be >= 2"),
        (["--tail-tokens", "-1"], "--tail-tokens must be >= 0"),
        (["--tasks", "none", "--needle-lengths", "2000", "--needle-depths", "0.5,1.5"], "--needle-depths must lie"),
        (["--tasks", "none", "--needle-lengths", "32"], "--needle-lengths must be >= 64"),
        (["--needle-lengths", "2000,x"], "comma-separated list of integers"),
        (["--stop-after-minutes", "0"], "--stop-after-minutes must be > 0"),
        (["--data-dir", "/nonexistent/lb"], "does not exist"),
    ],
)
def test_cli_errors(argv, msg):
    from eval.kld.cli import parse_args

    with pytest.raises(UsageError, match=msg):
        parse_args(["--out-dir", "/tmp/unused", *argv])


def test_cli_refuses_other_settings(tmp_path):
    from eval.kld.cli import main

    out = tmp_path / "run"
    out.mkdir()
    old = {
        "model": "smollm2",
        "dtype": "float32",
        "window": 2048,
        "chat": True,
        "encoder": "x",
        "max_answer_tokens": 32,
        "tail_tokens": 16,
        "seed": 0,
    }
    (out / "settings.json").write_text(json.dumps(old))
    with pytest.raises(UsageError, match="other settings"):
        main(["--out-dir", str(out), "--tasks", "none", "--needle-lengths", "100", "--tail-tokens", "8"])


def test_cli_exit_status():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "eval.kld", "--out-dir", "/tmp/unused", "--methods", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: unknown method") and "Traceback" not in res.stderr


@pytest.mark.slow  # two runs of spawned processes: ~1-3 min on a small shared CPU
@pytest.mark.skipif(
    not os.path.isdir(os.path.join(REPO_ROOT, "..", "shared", "data", "paul_graham_essays")),
    reason="needs the essays in ../shared/data",
)
def test_two_workers_give_the_records_of_one(tmp_path, tiny_tokenizer):
    """--workers 2 (spawned processes, a tiny Llama saved as a local model) writes the same records as one process,
    and a rerun of the same command has nothing left to do."""
    from .conftest import make_tiny_llama

    model_dir = tmp_path / "tiny"
    model = make_tiny_llama()
    model.generation_config.eos_token_id = 0  # <pad>: a stop token the tiny vocabulary lacks
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    common = [
        "--model",
        str(model_dir),
        "--tasks",
        "none",
        "--needle-lengths",
        "300",
        "--needle-depths",
        "0.2,0.7",
        "--methods",
        "fp16,int2",
        "--max-answer-tokens",
        "4",
        "--threads",
        "1",
        "--no-progress",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def run(out, *extra):
        res = subprocess.run(
            [sys.executable, "-m", "eval.kld", "--out-dir", str(out), *common, *extra],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        return {(r["case"], r["method"]): r for r in recs}, res

    one, _ = run(tmp_path / "one")
    two, _ = run(tmp_path / "two", "--workers", "2")
    assert len(one) == 4 and set(one) == set(two)
    for k in one:
        for f in ("answer_ids", "kl_answer", "kl_tail", "top1_answer", "kv_ratio", "tail_tokens"):
            assert one[k][f] == two[k][f], (k, f)
    again, _ = run(tmp_path / "two", "--workers", "2")
    assert again == two
    info = json.loads((tmp_path / "two" / "run_info.json").read_text())
    assert [x["cases_processed"] for x in info["invocations"]] == [2, 0]


def test_a_report_names_the_methods_it_leaves_out():
    from eval.records import left_out_note

    done = {("c1", "fp16"): {}, ("c1", "int4"): {}, ("c2", "layers3_had_s8"): {}, ("c2", "int4"): {}}
    assert left_out_note(done, ["fp16", "int4", "layers3_had_s8"]) is None
    note = left_out_note(done, ["fp16"])
    assert note.startswith(
        "note: the reports cover --methods only; records.jsonl also holds ['int4', 'layers3_had_s8']"
    )
