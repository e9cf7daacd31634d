"""Reports of a needle run: ``needle.csv``, ``needle_accuracy.md`` (accuracy and kv_ratio per method, and how often
the search put the needle's chunk at FP16) and one ``heatmap_<method>.png`` per method (lengths x depths)."""

from __future__ import annotations

import os
import textwrap

import numpy as np

from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells, plot_name, pyplot, save_figure, write_csv

CSV_COLUMNS = ["length", "depth", "sample", "method", "correct", "kv_ratio", "code", "pred", "needle_chunk_bits"]


def write_reports(
    out_dir: str, rows: list[dict], methods: list[str], lengths: list[int], depths: list[float], samples: int
) -> str:
    """Write every report of ``rows`` (the records of the requested cases); returns the accuracy table."""
    write_case_csv(os.path.join(out_dir, "needle.csv"), rows)
    table = accuracy_table(rows, methods, depths, samples)
    with open(os.path.join(out_dir, "needle_accuracy.md"), "w", encoding="utf-8") as f:
        f.write("# Needle accuracy\n\n" + table)
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        if rs:
            plot_heatmap(os.path.join(out_dir, f"heatmap_{m}.png"), m, rs, sorted(set(lengths)), sorted(set(depths)))
    return table


def write_case_csv(path: str, rows: list[dict]) -> None:
    write_csv(
        path,
        CSV_COLUMNS,
        (
            [*(r[c] for c in CSV_COLUMNS[:5]), f"{r['kv_ratio']:.4f}", r["code"], r["pred"], r.get("needle_chunk_bits")]
            for r in rows
        ),
    )


def _correct_among(rs: list[dict], chunks_holding_needle) -> str:
    """``correct/cases`` among the cases whose needle lies in a number of chunks accepted by the predicate."""
    sel = [r for r in rs if r.get("needle_chunk_bits") and chunks_holding_needle(len(r["needle_chunk_bits"]))]
    return f"{sum(r['correct'] for r in sel)}/{len(sel)}" if sel else "-"


def _method_line(m: str, rs: list[dict]) -> str:
    acc = sum(r["correct"] for r in rs) / len(rs)
    kvr = sum(r["kv_ratio"] for r in rs) / len(rs)
    nb = [r.get("needle_chunk_bits") for r in rs if r.get("needle_chunk_bits")]
    fp = f"{sum(16 in b for b in nb)}/{len(nb)}" if nb else "-"
    return (
        f"| {method_cells(m)} | {100 * acc:.1f}% | {sum(r['correct'] for r in rs)}/{len(rs)} | {kvr:.3f} | {fp} | "
        f"{_correct_among(rs, lambda n: n == 1)} | {_correct_among(rs, lambda n: n > 1)} |"
    )


def accuracy_table(rows: list[dict], methods: list[str], depths: list[float], samples: int) -> str:
    lines = [
        f"| {METHOD_COLUMNS} | accuracy | correct / cases | kv_ratio | needle chunk at FP16 | acc. needle in 1 chunk | "
        "acc. needle split over 2 chunks |",
        f"|{METHOD_RULE}|---|---|---|---|---|---|",
    ]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        if rs:
            lines.append(_method_line(m, rs))
    lens = sorted({r["length"] for r in rows})
    header = (
        f"Needle in a haystack (Paul Graham essays), lengths {lens} tokens, depths {sorted(set(depths))}, "
        f"{samples} sample(s) per cell; kv_ratio = KV bytes / FP16 DynamicCache bytes of the same tokens. "
        "'needle chunk at FP16': cases where a chunk holding the needle sentence got FP16 (CocktailCache kinds); "
        "the last two columns split the cases by whether the needle sentence lies in one chunk or straddles "
        "two."
    )
    return header + "\n\n" + "\n".join(lines) + "\n"


def accuracy_grid(rs: list[dict], lengths: list[int], depths: list[float]) -> np.ndarray:
    """Accuracy per (length, depth) cell; NaN where no case ran."""
    grid = np.full((len(lengths), len(depths)), np.nan)
    for i, L in enumerate(lengths):
        for j, d in enumerate(depths):
            cell = [r["correct"] for r in rs if r["length"] == L and abs(r["depth"] - d) < 1e-9]
            if cell:
                grid[i, j] = sum(cell) / len(cell)
    return grid


def plot_heatmap(path: str, method: str, rs: list[dict], lengths: list[int], depths: list[float]) -> None:
    plt = pyplot()
    grid = accuracy_grid(rs, lengths, depths)
    kvr = sum(r["kv_ratio"] for r in rs) / len(rs)
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(depths), 1.2 + 0.55 * len(lengths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context tokens")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(
        f"{textwrap.fill(plot_name(method), 45)}:\naccuracy {100 * np.nanmean(grid):.0f}%, kv_ratio {kvr:.2f}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, fraction=0.046)
    save_figure(fig, path, dpi=110)
