"""The speed scripts' machinery (eval/benchmarks): method variants, alternating rounds from one shared prefill,
batched branches, the prefill timers, the throughput table and plot, the run
record (kernel build, commit at start). Tiny random Llama and word-level tokenizer; no timing is asserted."""

from __future__ import annotations

import pytest
import torch

from eval.benchmarks import bench_latency, bench_throughput
from eval.benchmarks.bench_prefill import Timers, instrumented, one_prefill, patching
from eval.benchmarks.rounds import (
    Runner,
    SharedPrefill,
    alternating_rounds,
    branch_runner,
    resolve_method,
    resolve_methods,
    summarize_rounds,
)
from eval.cli import UsageError
from eval.methods.branching import prefill, prefill_for
from eval.methods.kinds import Request
from hf_cocktail import CocktailConfig

from .conftest import make_prompt, make_tiny_llama


def test_method_variants():
    m = resolve_method("cocktail:torch")
    assert m.name == "cocktail:torch" and m.overrides["backend"] == "torch"
    assert m.cocktail_config().backend == "torch"
    assert resolve_method("int2:auto").overrides == {"uniform_bits": 2, "backend": "auto"}
    assert resolve_method("cocktail").cocktail_config().backend == "auto"
    rec = resolve_method("recommended")
    assert rec.cocktail_config() == CocktailConfig.recommended(encoder=rec.cocktail_config().encoder)
    with pytest.raises(UsageError, match="Cocktail methods only"):
        resolve_method("fp16:torch")
    with pytest.raises(UsageError, match="backend suffix"):
        resolve_method("cocktail:gpu")
    with pytest.raises(UsageError, match="twice"):
        resolve_methods("fp16,int2,fp16")
    with pytest.raises(UsageError, match="unknown"):
        resolve_methods("nope")


class _FakeMethod:
    def __init__(self, name):
        self.name = name


def test_summarize_rounds_takes_per_round_ratios():
    base = Runner(_FakeMethod("fp16"), None, torch.zeros(1, 1), 0.0, round_s=[1.0, 2.0, 4.0])
    other = Runner(_FakeMethod("x"), None, torch.zeros(1, 1), 0.5, round_s=[0.5, 1.8, 1.0])
    rows = {r["method"]: r for r in summarize_rounds([base, other], steps=10)}
    assert rows["fp16"]["decode_ratio"] == 1.0
    assert rows["x"]["decode_ratio_rounds"] == [0.5, 0.9, 0.25]
    assert rows["x"]["decode_ratio"] == 0.5  # median of the per-round ratios, not the ratio of medians (1.0/2.0)
    assert rows["x"]["decode_ms_per_token"] == pytest.approx(100.0)
    assert rows["x"]["decode_ms_per_token_min"] == pytest.approx(50.0)


@pytest.fixture
def tiny_shared(tiny_tokenizer):
    model = make_tiny_llama(num_kv_heads=2, heads=4, head_dim=32, layers=2)
    prompt, ctx, q = make_prompt(150, needle_at=40)
    ids = tiny_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        dyn, logits = prefill(model, ids)
    return model, SharedPrefill(Request(prompt, ctx, q, "t", {}), ids, dyn, logits, 0.0)


@pytest.mark.parametrize("name", ["fp16", "int2", "int4:torch"])
def test_batched_branch_decodes_like_batch_one(tiny_tokenizer, tiny_shared, name):
    model, shared = tiny_shared
    method = resolve_method(name)
    one = branch_runner(method, model, tiny_tokenizer, shared)
    three = branch_runner(method, model, tiny_tokenizer, shared, batch=3)
    assert three.batch == 3 and three.cache.get_seq_length() == shared.prompt_tokens
    one.decode(model, 4, 0)
    three.decode(model, 4, 0)
    assert three.ids.shape == (3, shared.prompt_tokens + 5)
    for b in range(3):
        assert torch.equal(three.ids[b], one.ids[0])
    assert shared.dyn.get_seq_length() == shared.prompt_tokens  # the shared prefill is left intact


def test_salient_methods_branch_from_the_shared_prefill_queries(tiny_tokenizer, tiny_shared):
    """A method with ``salient_tokens`` reads the attention queries recorded during the shared prefill
    (``SharedPrefill.queries``, what ``shared_prefill`` records when a method needs them); batches repeat its rows."""
    model, shared = tiny_shared
    method = resolve_method("int4v3_had_s8_sal1")
    assert method.reads_prefill_queries
    with pytest.raises(RuntimeError, match="salient_tokens=0.01 .* saw none"):
        branch_runner(method, model, tiny_tokenizer, shared)  # no queries recorded
    dyn, logits, queries = prefill_for(model, tiny_tokenizer, shared.input_ids, shared.request, [method])
    assert queries is not None and len(queries) == 2
    with_queries = SharedPrefill(shared.request, shared.input_ids, dyn, logits, 0.0, queries)
    one = branch_runner(method, model, tiny_tokenizer, with_queries)
    three = branch_runner(method, model, tiny_tokenizer, with_queries, batch=3)
    one.decode(model, 3, 0)
    three.decode(model, 3, 0)
    for b in range(3):
        assert torch.equal(three.ids[b], one.ids[0])
    assert prefill_for(model, tiny_tokenizer, shared.input_ids, shared.request, [resolve_method("int2")])[2] is None


def test_alternating_rounds_run_every_method_each_round(tiny_tokenizer, tiny_shared):
    model, shared = tiny_shared
    runners = [branch_runner(resolve_method(n), model, tiny_tokenizer, shared) for n in ("fp16", "int2")]
    order = []
    for r in runners:
        real = r.decode

        def decode(model, steps, pad, _real=real, _name=r.method.name):
            order.append(_name)
            return _real(model, steps, pad)

        r.decode = decode
    alternating_rounds(runners, model, rounds=3, steps=2, pad_token_id=0)
    assert order == ["fp16", "int2", "int2", "fp16", "fp16", "int2"]
    rows = summarize_rounds(runners, 2)
    assert [r["rounds"] for r in rows] == [3, 3]
    assert all(r.ids.shape[1] == shared.prompt_tokens + 1 + 6 for r in runners)


def test_patching_restores_every_alias():
    from hf_cocktail.storage import quant, store

    original = quant.quantize_pack_keys
    with patching() as p:
        n = p.function(original, lambda f: lambda *a, **k: f(*a, **k))
        assert n >= 1 and quant.quantize_pack_keys is not original
    assert quant.quantize_pack_keys is original
    assert store.LayerStore.build.__func__ is store.LayerStore.__dict__["build"].__func__


def test_timers_are_exclusive():
    t = Timers()
    with t.part("outer"):
        with t.part("inner"):
            sum(range(20000))
        sum(range(20000))
    assert set(t.totals) == {"outer", "inner"}
    assert t.totals["outer"] > 0 and t.totals["inner"] > 0


def _timed_prefills(tok, *method_names: str) -> list[tuple[float, dict]]:
    """(wall seconds, parts) of one instrumented prefill per method, on one tiny Llama and a 150-token prompt."""
    model = make_tiny_llama(num_kv_heads=2, heads=4, head_dim=32, layers=2)
    request = Request(*make_prompt(150))
    timers = Timers()
    out = []
    with instrumented(timers):
        for name in method_names:
            wall = one_prefill(resolve_method(name), model, tok, request, timers)
            out.append((wall, dict(timers.totals)))
    return out


def test_prefill_parts(tiny_tokenizer):
    (wall, parts), (wall_fp16, fp16_parts) = _timed_prefills(tiny_tokenizer, "int2", "fp16")
    assert sum(parts.values()) == pytest.approx(wall, rel=0.05)
    for p in ("tokenize", "context location", "chunk texts", "quantization", "store build", "positions", "model"):
        assert parts.get(p, 0) > 0, p
    assert "encoder" not in parts  # uniform bits: no search
    assert set(fp16_parts) == {"model", "tokenize"} and sum(fp16_parts.values()) == pytest.approx(wall_fp16, rel=0.05)


def test_prefill_parts_of_recommended_include_its_deferred_build(tiny_tokenizer):
    """rotation="auto" defers a layer's store to the first decode step: the prefill times that build, the choice of
    rotation and the 8-bit-parameter quantizers among its parts."""
    ((wall, parts),) = _timed_prefills(tiny_tokenizer, "recommended")
    assert sum(parts.values()) == pytest.approx(wall, rel=0.05)
    for p in ("quantization", "store build", "rotation", "rotation choice"):
        assert parts.get(p, 0) > 0, p


def test_throughput_table_and_plot(tmp_path):
    rows = []
    for budget in (256, 512):
        for m, per_seq, tps in (("fp16", 94, 10.0), ("cocktail", 20, 30.0)):
            batch = (budget * 2**20) // (per_seq * 2**20)
            rows.append(
                {
                    "budget_mib": budget,
                    "method": m,
                    "per_sequence_bytes": per_seq * 2**20,
                    "batch": batch,
                    "batch_kv_bytes": batch * per_seq * 2**20,
                    "batch_kv_bytes_held": 2 * batch * per_seq * 2**20,
                    "tokens_per_s": tps * budget / 256,
                    "ratio_vs_fp16": tps / 10.0,
                    "ratio_min": 1.0,
                    "ratio_max": 3.0,
                    "ms_per_step": 100.0,
                }
            )
    text = bench_throughput.table(rows)
    assert "| 512 | paper Cocktail (FP16/INT4/INT2 by relevance) | `cocktail` | 20.0 | 25 |" in text
    bench_throughput.plot(rows, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_cli_errors():
    with pytest.raises(UsageError):
        bench_throughput.parse_args(["--budgets-mib", "0"])
    with pytest.raises(UsageError):
        bench_throughput.parse_args(["--methods", "fp16,cocktail:gpu"])
    with pytest.raises(UsageError):
        bench_latency.parse_args(["--rounds", "0"], bench_latency.MODULE, rounds=True)
    with pytest.raises(SystemExit):  # one generate per method (--new-tokens) is bench_memory's measurement
        bench_latency.parse_args(["--new-tokens", "8"], bench_latency.MODULE, rounds=True)
    args = bench_latency.parse_args(
        ["--rounds", "3", "--methods", "cocktail,recommended,cocktail:torch"], bench_latency.MODULE, rounds=True
    )
    assert [m.name for m in args.method_list] == ["fp16", "cocktail", "recommended", "cocktail:torch"]
    assert args.rounds == 3 and args.context_list == [1024, 2048, 4096, 8192]
    quick = bench_latency.parse_args(["--quick"], bench_latency.MODULE, rounds=True)
    assert quick.context_list == [1024, 2048] and [m.name for m in quick.method_list] == ["fp16", "cocktail", "int2"]


def test_plot_latency_draws_every_model_dtype_and_kernel_build(tmp_path):
    """plot_latency groups rows by (model, dtype, kernel build: AVX2 where the file does not say) and writes one PNG;
    a missing ratio field fails."""
    import json

    from eval.benchmarks import plot_latency

    def row(method, ctx, ms, ratio, dtype="float32"):
        return {
            "method": method,
            "context_tokens": ctx,
            "dtype": dtype,
            "decode_ms_per_token": ms,
            "decode_ratio": ratio,
            "decode_ratio_min": ratio * 0.9,
            "decode_ratio_max": ratio * 1.1,
        }

    runs = {
        "a.json": {
            "command": "python -m eval.benchmarks.bench_latency",
            "results": [
                row("fp16", 8000, 100.0, 1.0),
                row("fp16", 16000, 200.0, 1.0),
                row("cocktail", 8000, 50.0, 0.5),
                row("fp16", 8000, 120.0, 1.0, "bfloat16"),
            ],
        },
        "b.json": {
            "command": "python -m eval.benchmarks.bench_latency --model gemma-3-270m",
            "results": [row("fp16", 8000, 30.0, 1.0)],
        },
        "c.json": {
            "command": "python -m eval.benchmarks.bench_latency",
            "hardware": {"cpu_ops": {"extension": "hf_cocktail_cpu_ops_0", "kernel_target": "avx512vnni"}},
            "results": [row("fp16", 8000, 90.0, 1.0)],
        },
    }
    for name, data in runs.items():
        (tmp_path / name).write_text(json.dumps(data))
    paths = [str(tmp_path / n) for n in runs]
    groups = plot_latency.load_rows(paths)
    avx2 = "avx2+fma+f16c"
    assert sorted(groups) == [
        ("SmolLM2-135M", "bfloat16", avx2),
        ("SmolLM2-135M", "float32", avx2),
        ("SmolLM2-135M", "float32", "avx512vnni"),
        ("gemma-3-270m", "float32", avx2),
    ]
    out = tmp_path / "speed.png"
    fig = plot_latency.plot(groups, str(out))
    assert [len(ax.lines) for ax in fig.axes[::2]] == [1, 2, 1, 1]  # ms/token panels: one line per method
    assert plot_latency.main([*paths, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del runs["a.json"]["results"][0]["decode_ratio_min"]
    (tmp_path / "a.json").write_text(json.dumps(runs["a.json"]))
    with pytest.raises(KeyError):
        plot_latency.main([*paths, "--out", str(out)])


def test_run_json_records_the_kernel_build_and_the_start_commit(tmp_path, monkeypatch):
    import json
    import sys

    from eval.benchmarks import harness

    monkeypatch.setattr(harness, "_START", {})
    harness.note_start()
    harness.note_start()  # the first call's commit stays
    out = tmp_path / "run.json"
    harness.write_run_json(str(out), "eval.benchmarks.bench_latency", {"results": []})
    record = json.loads(out.read_text())
    assert record["commit_at_start"] == harness._START["commit"]
    assert "cpu_ops" in record["hardware"]

    class Build:  # a loaded extension: its name (a hash of the kernel sources) is what the run records
        _module = type(sys)("hf_cocktail_cpu_ops_0123456789abcdef")

    monkeypatch.setitem(sys.modules, "cpu_ops._build", Build)
    assert harness.kernel_build() == {"extension": "hf_cocktail_cpu_ops_0123456789abcdef"}
    Build._module.kernel_target = lambda: "avx2"
    assert harness.kernel_build()["kernel_target"] == "avx2"
    monkeypatch.setattr(Build, "_module", None)
    assert harness.kernel_build() is None
