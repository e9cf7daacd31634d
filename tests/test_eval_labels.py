"""Readable labels for the evaluation's method ids, and every report showing them."""

import json
import re

import matplotlib.figure
import matplotlib.text
import pytest

from eval.methods.labels import label
from eval.methods.registry import METHODS
from eval.reporting import method_heading


def test_every_registered_method_has_a_readable_label():
    unread = [m for m in METHODS if label(m) == m]
    assert not unread, f"no label for {unread}: add its base or modifier to eval/methods/labels.py"


def test_a_code_name_reads_as_its_settings():
    assert label("layers3r2_had_s8_sal1_f8") == (
        "per-layer widths at 3 bits (round 2), rotated, 8-bit scales, 1% salient tokens, 8-bit full part"
    )
    assert label("int4_had") == "uniform INT4, rotated"


def test_an_unknown_id_is_shown_as_it_is():
    assert label("int4_had_mystery") == "int4_had_mystery"
    assert label("someone_elses") == "someone_elses"


# ---------------------------------------------------------------- every report shows the labels
# Each report function below renders a tiny synthetic result of these methods; its markdown tables must name each
# method by its label, with the id only in code style (`int4_had`), and its plots by the label alone.
A, B, REF = "int4_had", "layers3r2_had_s8_sal1_f8", "fp16"
SHOWN = (A, B, REF)


@pytest.fixture
def drawn(monkeypatch):
    """The texts of every figure a report saves (titles, axes, legends, annotations); nothing is written."""
    texts: list[str] = []

    def savefig(fig, *args, **kwargs):
        texts.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return texts


def _bare(method: str, text: str) -> bool:
    """``method``'s id stands in ``text`` outside code style. FP16's id is also a word of prose and headers ("ratio
    vs fp16"), so for it only a whole cell or a text that starts with it counts."""
    if method == REF:
        return text == REF or text.startswith(REF + " ")
    return re.search(rf"(?<![\w`.]){re.escape(method)}(?![\w`.])", text) is not None


def _cells(markdown: str) -> list[str]:
    return [c.strip() for line in markdown.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]


def _check_tables(markdown: str, methods=SHOWN) -> None:
    cells = _cells(markdown)
    assert cells, "no table rendered"
    for m in methods:
        assert any(label(m) in c for c in cells), f"no label of {m} in\n{markdown}"
        assert any(f"`{m}`" in c for c in cells), f"no id of {m} in\n{markdown}"
        assert not [c for c in cells if _bare(m, c)], f"bare id {m} in\n{markdown}"


def _check_plot(texts: list[str], methods=SHOWN) -> None:
    assert texts, "nothing drawn"
    texts = [" ".join(t.split()) for t in texts]  # a title wrapped over lines
    for m in methods:
        assert any(label(m) in t for t in texts), f"no label of {m} in {texts}"
        assert not [t for t in texts if _bare(m, t)], f"bare id {m} in {texts}"


def test_method_heading_keeps_the_id():
    assert method_heading(A) == "uniform INT4, rotated (`int4_had`)"
    assert method_heading("someone_elses") == "`someone_elses`"


def test_kld_report(tmp_path, drawn):
    from eval.kld.report import write_reports

    def rec(m, case, kl, source):
        one = {"case": f"{source}/{case}", "method": m, "source": source, "kv_ratio": 0.3, "kv_ratio_global": 0.2}
        return one | {f"{k}_{s}": v for s in ("answer", "tail") for k, v in (("kl", kl), ("top1", 0.9), ("n", 3))}

    methods = [REF, "cocktail", "int4", A, B]
    records = [
        rec(m, c, 0.0 if m == REF else 0.01 * (i + 1) + 0.001 * c, s)
        for i, m in enumerate(methods)
        for c in range(3)
        for s in ("longbench", "needle")
    ]
    md = write_reports(str(tmp_path), records, methods)
    _check_tables(md)
    _check_tables(md.split("### Paired", 1)[1], (A, B))  # the paired tables too
    _check_plot(drawn, (A, B))  # FP16 (KLD 0) is not drawn on the log scale


def test_ppl_report(tmp_path, drawn):
    from eval.ppl.report import write_reports

    rec = {"top1": 0.9, "kv_ratio": 0.3, "kv_ratio_global": 0.2}
    records = [
        rec | {"method": m, "window": f"w{w}", "source": "essays", "nll": 2.0 + 0.1 * i + 0.01 * w, "kl": 0.01 * i}
        for i, m in enumerate([REF, "int4", A, B])
        for w in range(3)
    ]
    md = write_reports(str(tmp_path), records, [REF, "int4", A, B])
    _check_tables(md)
    _check_tables(md.split("### Paired", 1)[1], (A, B))
    _check_plot(drawn)


def test_needle_report(tmp_path, drawn):
    from eval.needle.report import write_reports

    rows = [
        {"length": 500, "depth": d, "sample": 0, "method": m, "correct": 1, "kv_ratio": 0.3, "code": "1234",
         "pred": "1234", "needle_chunk_bits": [16]}
        for m in SHOWN
        for d in (0.0, 0.5)
    ]  # fmt: skip
    _check_tables(write_reports(str(tmp_path), rows, list(SHOWN), [500], [0.0, 0.5], 1))
    _check_plot(drawn)  # one heatmap per method


def test_ruler_report(tmp_path, drawn):
    from eval.needle.ruler_report import write_reports

    rows = [
        {"case": f"single-{s}", "variant": "single", "ruler_task": "niah_single_1", "length": 1000, "method": m,
         "score": float(s == 0 or m == REF), "kv_ratio": 0.3, "asked_needle_bits": [[16]]}
        for m in SHOWN
        for s in range(2)
    ]  # fmt: skip
    md = write_reports(str(tmp_path), rows, list(SHOWN), ["single"], [1000], 2)
    _check_tables(md)
    _check_tables(md.split("Paired with", 1)[1], (A, B))
    _check_plot(drawn)


def test_longbench_report(tmp_path, drawn):
    from eval.longbench.report import write_reports
    from eval.longbench.scoring import Summary

    row = {"kv_ratio": 0.3, "prefill_s": 1.0, "decode_ms_per_token": 50.0, "n": 2, "n_expected": 2}
    mix = {"fp16": 1, "int4": 2, "int2": 3}
    summary = Summary(
        per_task=[row | {"task": "qasper", "method": m, "score": 10.0, "chunks": mix} for m in SHOWN],
        average=[row | {"task": "average", "method": m, "score": 10.0, "tasks": 1} for m in SHOWN],
        paired_vs_fp16=[
            {"method": m, "reference": REF, "diff": 0.0, "ci95": [-1.0, 1.0], "better": 0, "same": 2, "worse": 0}
            for m in (A, B)
        ],
    )
    write_reports(str(tmp_path), ["qasper"], list(SHOWN), summary)
    md = (tmp_path / "summary.md").read_text()
    _check_tables(md)
    score_head = next(line for line in md.splitlines() if line.startswith("| task |"))
    assert all(method_heading(m) in score_head for m in SHOWN)  # methods as columns: label (`id`)
    _check_plot(drawn)


def _latency_row(m: str) -> dict:
    return {"context_tokens": 1000, "method": m, "dtype": "float32", "prefill_s": 1.0, "decode_ms_per_token": 50.0}


def test_benchmark_tables():
    from eval.benchmarks import bench_latency, bench_memory, bench_prefill, bench_throughput

    latency = [_latency_row(m) for m in SHOWN]
    rounds = {"decode_ms_per_token_min": 49.0, "decode_ratio": 1.0, "decode_ratio_min": 0.9, "decode_ratio_max": 1.1}
    _check_tables(bench_latency.rounds_table([r | rounds | {"setup_s": 0.1, "kv_ratio": 0.3} for r in latency]))
    memory = {"kv_bytes": 2**20, "kv_bytes_in_memory": 2**20, "peak_prefill_bytes": 2**22, "peak_decode_bytes": 2**21}
    _check_tables(bench_memory.memory_table([r | memory for r in latency]))
    parts = {p: 0.01 for p in bench_prefill.PARTS}
    prefill = {"prompt_tokens": 1000, "prefill_s": 1.0, "ratio_vs_fp16": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
               "parts_s": parts, "search_quant_s": 0.02, "search_quant_fraction": 0.02}  # fmt: skip
    _check_tables(bench_prefill.table([prefill | {"method": m} for m in SHOWN]))
    _check_tables(bench_throughput.table([_throughput_row(m) for m in SHOWN]))


def _throughput_row(m: str) -> dict:
    return {"budget_mib": 256, "method": m, "per_sequence_bytes": 2**20, "batch": 4, "batch_kv_bytes": 2**22,
            "batch_kv_bytes_held": 2**22, "tokens_per_s": 10.0, "ratio_vs_fp16": 1.0, "ratio_min": 1.0,
            "ratio_max": 1.0, "ms_per_step": 100.0}  # fmt: skip


def test_benchmark_plots(tmp_path, drawn):
    from eval.benchmarks import bench_throughput, plot_latency

    bench_throughput.plot([_throughput_row(m) for m in SHOWN], str(tmp_path / "throughput.png"))
    _check_plot(drawn)
    drawn.clear()
    ratios = {"decode_ratio": 1.0, "decode_ratio_min": 0.9, "decode_ratio_max": 1.1}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"command": "x", "results": [_latency_row(m) | ratios for m in SHOWN]}))
    plot_latency.plot(plot_latency.load_rows([str(path)]), str(tmp_path / "latency.png"))
    _check_plot(drawn)
