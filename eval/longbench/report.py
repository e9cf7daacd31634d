"""Reports of a scored LongBench run: ``scores.json``, ``summary.csv``, ``summary.md`` and two plots."""

from __future__ import annotations

import os

from ..records import write_json
from ..reporting import (
    METHOD_COLUMNS,
    METHOD_RULE,
    method_cells,
    method_heading,
    plot_name,
    pyplot,
    save_figure,
    write_csv,
)
from .scoring import Summary

CSV_COLUMNS = ["task", "method", "score", "kv_ratio", "prefill_s", "decode_ms_per_token", "n"]
FOOTNOTE = (
    "kv_ratio: KV bytes of the method / bytes of an FP16 DynamicCache holding the same tokens (prompt + "
    "generated), measured at the end of generation; full-precision parts count 2 bytes per element. "
    "prefill_s: shared full-precision prefill + the method's own setup (search, quantization). "
    "decode ms/token: wall time of the greedy decode divided by its steps (new tokens - 1: the first "
    "token comes from the shared prefill)."
)


def write_reports(out_dir: str, tasks: list[str], methods: list[str], summary: Summary) -> None:
    write_json(os.path.join(out_dir, "scores.json"), summary.as_json())
    # one row per (task, method), then task=average rows (means over tasks)
    write_csv(os.path.join(out_dir, "summary.csv"), CSV_COLUMNS, map(_csv_line, summary.per_task + summary.average))
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown(tasks, methods, summary))
    plot_score_vs_kv(os.path.join(out_dir, "score_vs_kv.png"), summary)
    plot_precision_mix(os.path.join(out_dir, "precision_mix.png"), tasks, methods, summary)


def _csv_line(r: dict) -> list:
    dec = "" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f}"
    return [r["task"], r["method"], f"{r['score']:.2f}", f"{r['kv_ratio']:.4f}", f"{r['prefill_s']:.3f}", dec, r["n"]]


def _score_table(tasks: list[str], present: list[str], summary: Summary) -> list[str]:
    lines = ["| task | n | " + " | ".join(map(method_heading, present)) + " |", "|---|---|" + "---|" * len(present)]
    for task in tasks:
        rows = {m: summary.row(task, m) for m in present}
        if not any(rows.values()):
            continue
        ns = {r["n"] for r in rows.values() if r}
        cells = [f"{r['score']:.2f}" if r else "-" for r in rows.values()]
        lines.append(f"| {task} | {'/'.join(str(n) for n in sorted(ns))} | " + " | ".join(cells) + " |")
    avg = {a["method"]: a for a in summary.average}
    lines.append("| **average** | | " + " | ".join(f"**{avg[m]['score']:.2f}**" for m in present) + " |")
    return lines


def _method_table(present: list[str], summary: Summary) -> list[str]:
    avg = {a["method"]: a for a in summary.average}
    lines = [
        f"| {METHOD_COLUMNS} | avg score | kv_ratio | prefill_s | decode ms/token | examples | tasks |",
        f"|{METHOD_RULE}|---|---|---|---|---|---|",
    ]
    for m in present:
        a = avg[m]
        dec = "-" if a["decode_ms_per_token"] is None else f"{a['decode_ms_per_token']:.0f}"
        lines.append(
            f"| {method_cells(m)} | {a['score']:.2f} | {a['kv_ratio']:.3f} | {a['prefill_s']:.2f} | {dec} | "
            f"{a['n']} | {a['tasks']} |"
        )
    return lines


def _paired_table(paired: list[dict]) -> list[str]:
    lines = [
        "Paired with fp16 on the same examples: difference of the LongBench average (points), 95% "
        "bootstrap interval (examples resampled within tasks), examples scoring higher / the same / lower.",
        "",
        f"| {METHOD_COLUMNS} | avg - fp16 | 95% interval | higher / same / lower |",
        f"|{METHOD_RULE}|---|---|---|",
    ]
    for p in paired:
        lines.append(
            f"| {method_cells(p['method'])} | {p['diff']:+.2f} | [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}] | "
            f"{p['better']} / {p['same']} / {p['worse']} |"
        )
    return lines


def markdown(tasks: list[str], methods: list[str], summary: Summary) -> str:
    """``summary.md``: scores per task and method, the per-method table, the paired comparison with fp16."""
    present = [m for m in methods if any(r["method"] == m for r in summary.per_task)]
    lines = [
        "# LongBench results",
        "",
        "Score (LongBench metric x100, see eval/README.md), per task and method; `n` examples per task.",
        "",
    ]
    lines += _score_table(tasks, present, summary) + [""] + _method_table(present, summary)
    if summary.paired_vs_fp16:
        lines += [""] + _paired_table(summary.paired_vs_fp16)
    incomplete = [r for r in summary.per_task if r["n"] < r["n_expected"]]
    if incomplete:
        lines += [
            "",
            "Incomplete (task, method) pairs (run still going or interrupted): "
            + ", ".join(f"{r['task']}/{r['method']} {r['n']}/{r['n_expected']}" for r in incomplete),
        ]
    lines += ["", FOOTNOTE]
    return "\n".join(lines) + "\n"


def plot_score_vs_kv(path: str, summary: Summary) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 5))
    for a in summary.average:
        ax.scatter(a["kv_ratio"], a["score"], s=60, zorder=3)
        ax.annotate(
            plot_name(a["method"]), (a["kv_ratio"], a["score"]), textcoords="offset points", xytext=(5, 5), fontsize=7
        )
    ax.set_xlabel("KV bytes / FP16 KV bytes (mean over tasks)")
    ax.set_ylabel("LongBench average score")
    ax.set_title("Score vs KV-cache size")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def _mix_method(tasks: list[str], methods: list[str], summary: Summary) -> str | None:
    """The method whose precision mix is plotted: cocktail when it has chunks, else the first method with some."""

    def has_chunks(row: dict | None) -> bool:
        return row is not None and sum(row["chunks"].values()) > 0

    with_chunks = [m for m in methods if any(has_chunks(summary.row(t, m)) for t in tasks)]
    chosen = [m for m in with_chunks if m in ("cocktail",)] or with_chunks[:1]
    return chosen[0] if chosen else None


def plot_precision_mix(path: str, tasks: list[str], methods: list[str], summary: Summary) -> None:
    """Stacked bars: the FP16 / INT4 / INT2 shares of the context chunks per task (one Cocktail-kind method)."""
    m = _mix_method(tasks, methods, summary)
    if m is None:
        return
    ts = [t for t in tasks if summary.row(t, m)]
    fr = {k: [] for k in ("fp16", "int4", "int3", "int2")}
    for t in ts:
        c = summary.row(t, m)["chunks"]
        tot = max(1, sum(c.values()))
        for k in fr:
            fr[k].append(c.get(k, 0) / tot)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(ts) + 1.2), 4.5))
    bottom = [0.0] * len(ts)
    for k, color in (("fp16", "#2b8cbe"), ("int4", "#7bccc4"), ("int3", "#bae4bc"), ("int2", "#f0f9e8")):
        if k == "int3" and not any(fr[k]):
            continue
        ax.bar(ts, fr[k], bottom=bottom, label=k.upper(), color=color, edgecolor="black", linewidth=0.5)
        bottom = [b + v for b, v in zip(bottom, fr[k])]
    ax.set_ylabel("fraction of context chunks")
    ax.set_title(f"Precision mix per task ({plot_name(m)})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    save_figure(fig, path)
