"""Summary of a perplexity run: per source (and ``all``) and method, the perplexity of the continuations, the mean
KL divergence from FP16 and the top-1 agreement with their 95% bootstrap intervals (windows resampled within
sources), the KV ratios, and each method paired with a reference (uniform INT4 where it ran); ``summary.md``,
``summary.csv``, ``ppl_vs_bytes.png``."""

from __future__ import annotations

import math
import os
from collections import defaultdict

from ..reporting import (
    METHOD_COLUMNS,
    METHOD_RULE,
    csv_values,
    method_cells,
    plot_name,
    plotted_sources,
    pyplot,
    save_figure,
    write_csv,
)
from ..stats import bootstrap_mean, mean_of_all

CSV_COLUMNS = [
    "source",
    "method",
    "windows",
    "kv_ratio",
    "kv_ratio_global",
    "ppl",
    "ppl_lo",
    "ppl_hi",
    "kld",
    "kld_lo",
    "kld_hi",
    "top1",
]
PAIRED_REFS = ("int4", "fp16")
FOOTNOTE = (
    "ppl: exp of the mean negative log-likelihood of the scored continuation tokens (every window scores the same "
    "number), 95% interval: bootstrap over the windows (2000 resamples, within sources), exponentiated. KLD: mean "
    "over windows of the mean KL(P_fp16 || P_method) in nats at the same positions. top-1: share of positions where "
    "the method's argmax is FP16's. kv_ratio: the method's KV bytes / the model's own FP16 DynamicCache of the same "
    "tokens (sliding-window layers hold their window); kv_ratio global: the full-attention layers alone (what a "
    "CocktailCache quantizes)."
)


def _sources(records: list[dict]) -> list[str]:
    names = list(dict.fromkeys(r["source"] for r in records))
    return names + (["all"] if len(names) > 1 else [])


def summarize(records: list[dict], methods: list[str], n_boot: int = 2000) -> list[dict]:
    """One row per (source, method) present in ``records``."""
    rows = []
    for source in _sources(records):
        recs = [r for r in records if source in ("all", r["source"])]
        for m in methods:
            mine = [r for r in recs if r["method"] == m]
            if not mine:
                continue
            row: dict = {"source": source, "method": m, "windows": len(mine)}
            row["kv_ratio"] = sum(r["kv_ratio"] for r in mine) / len(mine)
            row["kv_ratio_global"] = mean_of_all([r.get("kv_ratio_global") for r in mine])
            for name in ("nll", "kl", "top1"):
                strata: dict[str, list[float]] = defaultdict(list)
                for r in mine:
                    strata[r["source"]].append(r[name])
                row[name], row[f"{name}_lo"], row[f"{name}_hi"] = bootstrap_mean(strata, n_boot)
            row["ppl"], row["ppl_lo"], row["ppl_hi"] = (math.exp(row[k]) for k in ("nll", "nll_lo", "nll_hi"))
            row["kld"], row["kld_lo"], row["kld_hi"] = row["kl"], row["kl_lo"], row["kl_hi"]
            rows.append(row)
    return rows


def paired(records: list[dict], methods: list[str], ref: str, n_boot: int = 2000) -> list[dict]:
    """Each method against ``ref`` on the windows both have, per source: the mean difference of KLD and of the
    mean NLL (method - reference; negative = closer to FP16 / better) with 95% intervals, windows lower / higher
    in KLD."""
    by = {(r["window"], r["method"]): r for r in records}
    out = []
    for source in _sources(records):
        for m in methods:
            if m == ref:
                continue
            pairs = [
                (r, by[(w, ref)])
                for (w, mm), r in by.items()
                if mm == m and (w, ref) in by and source in ("all", r["source"])
            ]
            if not pairs:
                continue
            row = {"source": source, "method": m, "reference": ref, "windows": len(pairs)}
            for name in ("kl", "nll"):
                strata: dict[str, list[float]] = defaultdict(list)
                for a, b in pairs:
                    strata[a["source"]].append(a[name] - b[name])
                row[f"d_{name}"], row[f"d_{name}_lo"], row[f"d_{name}_hi"] = bootstrap_mean(strata, n_boot)
            row["lower"] = sum(a["kl"] < b["kl"] for a, b in pairs)
            row["higher"] = sum(a["kl"] > b["kl"] for a, b in pairs)
            out.append(row)
    return out


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table_head(title: str, columns: str, rule: str) -> list[str]:
    return ["", f"### {title}", "", f"| {columns} |", f"|{rule}|"]


def _summary_line(r: dict) -> str:
    return (
        f"| {method_cells(r['method'])} | {r['windows']} | {r['kv_ratio']:.3f} | {_f(r['kv_ratio_global'], '.3f')} | "
        f"{r['ppl']:.3f} [{r['ppl_lo']:.3f}, {r['ppl_hi']:.3f}] | "
        f"{r['kld']:.4f} [{r['kld_lo']:.4f}, {r['kld_hi']:.4f}] | {r['top1']:.3f} |"
    )


def _paired_line(p: dict) -> str:
    return (
        f"| {p['source']} | {method_cells(p['method'])} | {p['windows']} | {p['d_kl']:+.4f} [{p['d_kl_lo']:+.4f}, "
        f"{p['d_kl_hi']:+.4f}] | {p['lower']} / {p['higher']} | {p['d_nll']:+.4f} [{p['d_nll_lo']:+.4f}, "
        f"{p['d_nll_hi']:+.4f}] |"
    )


SUMMARY_HEAD = f"{METHOD_COLUMNS} | windows | kv_ratio | kv_ratio global | perplexity [95% CI] | KLD [95% CI] | top-1"
PAIRED_HEAD = (
    f"source | {METHOD_COLUMNS} | windows | KLD difference [95% CI] | lower / higher | NLL difference [95% CI]"
)
PAIRED_NOTE = (
    "Differences: mean over the common windows of (method - reference), negative = closer to FP16 (KLD) / more likely "
    "continuation (NLL, nats per token); lower / higher: windows where the method's KLD is below / above the "
    "reference's."
)


def markdown(rows: list[dict], pairs: list[dict], header: str = "") -> str:
    lines = [header] if header else []
    for source in dict.fromkeys(r["source"] for r in rows):
        lines += _table_head(source, SUMMARY_HEAD, f"{METHOD_RULE}|---|---|---|---|---|---")
        lines += [_summary_line(r) for r in rows if r["source"] == source]
    lines += ["", FOOTNOTE]
    for ref in dict.fromkeys(p["reference"] for p in pairs):
        lines += _table_head(f"Paired with `{ref}`", PAIRED_HEAD, f"---|{METHOD_RULE}|---|---|---|---")
        lines += [_paired_line(p) for p in pairs if p["reference"] == ref] + ["", PAIRED_NOTE]
    return "\n".join(lines) + "\n"


def write_summary_csv(path: str, rows: list[dict]) -> None:
    write_csv(path, CSV_COLUMNS, (csv_values(r, CSV_COLUMNS) for r in rows))


def plot(path: str, rows: list[dict]) -> bool:
    """Perplexity (top) and KLD (bottom, log scale, FP16 left out) against the global layers' KV ratio (the whole
    cache's where a method has none), one column per source, 95% intervals. False without matplotlib."""
    plt, sources = pyplot(required=False), plotted_sources(rows)
    if plt is None or not sources:
        return False
    fig, axes = plt.subplots(2, len(sources), figsize=(6.5 * len(sources), 9), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cmap = plt.get_cmap("tab10")
    for col, source in enumerate(sources):
        for r in (r for r in rows if r["source"] == source):
            x = r["kv_ratio_global"] if r["kv_ratio_global"] is not None else r["kv_ratio"]
            c = cmap(methods.index(r["method"]) % 10)
            for ax, (y, lo, hi) in zip(
                axes[:, col], ((r["ppl"], r["ppl_lo"], r["ppl_hi"]), (r["kld"], r["kld_lo"], r["kld_hi"]))
            ):
                if ax is axes[1, col] and y <= 0:
                    continue
                ax.errorbar([x], [y], yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", color=c, capsize=3)
                ax.annotate(plot_name(r["method"]), (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        n = max(r["windows"] for r in rows if r["source"] == source)
        axes[0, col].set_title(f"{source}: {n} windows", fontsize=10)
        axes[0, col].set_ylabel("perplexity of the continuation")
        axes[1, col].set_ylabel("mean KL(P_fp16 || P_method), nats")
        axes[1, col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xlabel("KV bytes / FP16, global (full-attention) layers")
            ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)
    return True


def write_reports(out_dir: str, records: list[dict], methods: list[str], header: str = "") -> str:
    """Write ``summary.csv``, ``summary.md`` and ``ppl_vs_bytes.png``; returns the markdown."""
    rows = summarize(records, methods)
    write_summary_csv(os.path.join(out_dir, "summary.csv"), rows)
    ref = next((r for r in PAIRED_REFS if r in methods), None)  # uniform INT4 where it ran, else FP16
    pairs = paired(records, methods, ref) if ref else []
    md = markdown(rows, pairs, header)
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(md)
    plot(os.path.join(out_dir, "ppl_vs_bytes.png"), rows)
    return md
