"""Summary of a KLD run: per source (LongBench, needle) and method, the mean KL divergence with a 95% bootstrap
interval, the top-1 agreement and the mean KV bytes ratio, and each method paired with the paper's Cocktail on the
same examples; ``summary.md``, ``summary.csv``, ``paired.csv`` and ``kld_vs_bytes.png``.

The bootstrap resamples examples with replacement within each source (LongBench, needle; for the ``all`` rows both
keep their sizes). It does not stratify by LongBench task: runs of 1-2 examples per task would leave nothing to
resample."""

from __future__ import annotations

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
from ..stats import bootstrap_mean, mean_of_all, paired_stats

SEGMENTS = ("answer", "tail")
CSV_COLUMNS = [
    "source",
    "method",
    "examples",
    "kv_ratio",
    "kld_answer",
    "kld_answer_lo",
    "kld_answer_hi",
    "top1_answer",
    "positions_answer",
    "kld_tail",
    "kld_tail_lo",
    "kld_tail_hi",
    "top1_tail",
    "positions_tail",
    "kv_ratio_global",
]
FOOTNOTE = (
    "KLD: mean over examples of the mean KL(P_fp16 || P_method) in nats over the example's teacher-forced "
    "positions (float64 log_softmax); 95% CI: bootstrap over the examples (2000 resamples). "
    "answer: FP16's greedy answer fed after the shared full-precision prefill (the positions predicting answer "
    "tokens 2..n). tail: the prompt minus its last k tokens (k <= 16, never inside the context) prefilled and "
    "branched, then the last k prompt tokens and the answer fed. top-1: share of positions where the method's "
    "argmax equals FP16's. kv_ratio: the method's KV bytes / the model's own FP16 DynamicCache of the same "
    "tokens (prompt + answer; sliding-window layers hold their window), full-precision tensors at 2 bytes per "
    "element."
)
FOOTNOTE_GLOBAL = (
    " kv_ratio global: the same for the full-attention (global) layers alone, the layers a CocktailCache "
    "quantizes (memory_report()['quantized_layers_ratio_to_fp16']); on a model with sliding-window layers the whole "
    "cache's kv_ratio also counts those layers' full-precision windows."
)


def summarize(records: list[dict], methods: list[str], n_boot: int = 2000) -> list[dict]:
    """One row per (source, method) present in ``records``, sources in order longbench, needle, then ``all``
    (every case). Means are over examples (each example's mean over its positions), so every example weighs
    the same; ``positions_*`` count the scored positions."""
    rows = []
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_source[r["source"]].append(r)
    sources = [s for s in ("longbench", "needle") if s in by_source] + sorted(set(by_source) - {"longbench", "needle"})
    if len(sources) > 1:
        sources.append("all")
    for source in sources:
        recs = records if source == "all" else by_source[source]
        for m in methods:
            mine = [r for r in recs if r["method"] == m]
            if not mine:
                continue
            row = {
                "source": source,
                "method": m,
                "examples": len(mine),
                "kv_ratio": sum(r["kv_ratio"] for r in mine) / len(mine),
                "kv_ratio_global": mean_of_all([r.get("kv_ratio_global") for r in mine]),
            }
            for seg in SEGMENTS:
                strata: dict[str, list[float]] = defaultdict(list)
                top1 = []
                for r in mine:
                    if r.get(f"kl_{seg}") is not None:
                        strata[r["source"]].append(r[f"kl_{seg}"])
                        top1.append(r[f"top1_{seg}"])
                mean, lo, hi = bootstrap_mean(strata, n_boot)
                row.update(
                    {
                        f"kld_{seg}": mean,
                        f"kld_{seg}_lo": lo,
                        f"kld_{seg}_hi": hi,
                        f"top1_{seg}": sum(top1) / len(top1) if top1 else None,
                        f"positions_{seg}": sum(r[f"n_{seg}"] for r in mine),
                    }
                )
            rows.append(row)
    return rows


PAIRED_REF = "cocktail"
# every reference the report pairs the methods with, where it was run: the paper's setting and uniform INT4
PAIRED_REFS = (PAIRED_REF, "int4")
PAIRED_COLUMNS = ["source", "method", "reference", "examples", "diff", "diff_lo", "diff_hi", "lower", "higher", "ratio"]


def paired(
    records: list[dict], methods: list[str], ref: str = PAIRED_REF, seg: str = "answer", n_boot: int = 2000
) -> list[dict]:
    """Each method against ``ref`` on the examples both have: the mean per-example difference of KLD (method -
    reference; negative = closer to FP16) with a 95% bootstrap interval, how many examples are lower / higher, and
    the ratio of the two means. Per source, like :func:`summarize`."""
    kl = {(r["source"], r["case"], r["method"]): r.get(f"kl_{seg}") for r in records}
    out = []
    sources = [s for s in ("longbench", "needle") if any(k[0] == s for k in kl)]
    for source in sources:
        for m in methods:
            if m == ref:
                continue
            pairs = [
                (kl[(s, c, m)], kl[(s, c, ref)])
                for (s, c, mm) in kl
                if s == source and mm == m and kl.get((s, c, ref)) is not None and kl[(s, c, m)] is not None
            ]
            if not pairs:
                continue
            diffs = paired_stats({source: [a - b for a, b in pairs]}, n_boot)
            ref_mean = sum(b for _, b in pairs) / len(pairs)
            ratio = (sum(a for a, _ in pairs) / len(pairs)) / ref_mean if ref_mean > 0 else None
            row = {"source": source, "method": m, "reference": ref, "examples": diffs.pop("n")}
            out.append({**row, **diffs, "ratio": ratio})
    return out


REF_NAMES = {"cocktail": "the paper", "int4": "uniform INT4"}


def paired_markdown(rows: list[dict]) -> list[str]:
    """One table per reference (in the order the rows come)."""
    if not rows:
        return []
    lines = []
    for ref in dict.fromkeys(r["reference"] for r in rows):
        name = f" ({REF_NAMES[ref]})" if ref in REF_NAMES else ""
        lines += [
            "",
            f"### Paired with `{ref}`{name}, answer segment",
            "",
            f"| source | {METHOD_COLUMNS} | examples | KLD difference [95% CI] | lower / higher | KLD ratio |",
            f"|---|{METHOD_RULE}|---|---|---|---|",
        ]
        for r in (r for r in rows if r["reference"] == ref):
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            lines.append(
                f"| {r['source']} | {method_cells(r['method'])} | {r['examples']} | "
                f"{r['diff']:+.4f} [{r['diff_lo']:+.4f}, {r['diff_hi']:+.4f}] | "
                f"{r['lower']} / {r['higher']} | {ratio} |"
            )
    lines += [
        "",
        "Difference: mean over the common examples of (method's KLD - the reference's KLD), negative = "
        "closer to FP16; interval: bootstrap over the examples; lower / higher: examples where the method's KLD "
        "is below / above the reference's; ratio: the method's mean KLD / the reference's.",
    ]
    return lines


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def write_summary_csv(path: str, rows: list[dict]) -> None:
    write_csv(path, CSV_COLUMNS, (_csv_line(r) for r in rows))


def _csv_line(r: dict) -> list:
    return [
        r["source"],
        r["method"],
        r["examples"],
        f"{r['kv_ratio']:.4f}",
        *[_fmt(r[f"kld_answer{x}"], ".6g") for x in ("", "_lo", "_hi")],
        _fmt(r["top1_answer"], ".4f"),
        r["positions_answer"],
        *[_fmt(r[f"kld_tail{x}"], ".6g") for x in ("", "_lo", "_hi")],
        _fmt(r["top1_tail"], ".4f"),
        r["positions_tail"],
        _fmt(r.get("kv_ratio_global"), ".4f"),
    ]


def _kld_cell(r: dict, seg: str) -> str:
    if r[f"kld_{seg}"] is None:
        return "-"
    return f"{r[f'kld_{seg}']:.4f} [{r[f'kld_{seg}_lo']:.4f}, {r[f'kld_{seg}_hi']:.4f}]"


def markdown(rows: list[dict], header: str = "") -> str:
    lines = [header] if header else []
    # the global layers' ratio: shown where the records carry it and it differs from the whole cache's (a model
    # with sliding-window layers); with every layer global the two are the same number
    show_global = any(
        r.get("kv_ratio_global") is not None and abs(r["kv_ratio_global"] - r["kv_ratio"]) > 1e-9 for r in rows
    )
    glob_head, glob_sep = (" kv_ratio global |", "---|") if show_global else ("", "")
    for source in dict.fromkeys(r["source"] for r in rows):
        mine = [r for r in rows if r["source"] == source]
        lines += [
            "",
            f"### {source} (up to {max(r['examples'] for r in mine)} examples)",
            "",
            f"| {METHOD_COLUMNS} | examples | kv_ratio |{glob_head} KLD answer [95% CI] | top-1 answer | "
            "KLD tail [95% CI] | top-1 tail |",
            f"|{METHOD_RULE}|---|---|{glob_sep}---|---|---|---|",
        ]
        for r in mine:
            glob = f" {_fmt(r.get('kv_ratio_global'), '.3f') or '-'} |" if show_global else ""
            lines.append(
                f"| {method_cells(r['method'])} | {r['examples']} | {r['kv_ratio']:.3f} |{glob} "
                f"{_kld_cell(r, 'answer')} | "
                f"{_fmt(r['top1_answer'], '.3f') or '-'} | {_kld_cell(r, 'tail')} | "
                f"{_fmt(r['top1_tail'], '.3f') or '-'} |"
            )
    lines += ["", FOOTNOTE + (FOOTNOTE_GLOBAL if show_global else ""), ""]
    return "\n".join(lines)


def plot(path: str, rows: list[dict]) -> bool:
    """KLD vs KV bytes ratio (log-scale y), one panel per source, answer segment with its interval (filled) and tail
    segment (hollow), one colour and marker per method; methods with KLD 0 (fp16) cannot be drawn on a log scale
    and are left out. False without matplotlib."""
    plt, sources = pyplot(required=False), plotted_sources(rows)
    if plt is None or not sources:
        return False
    methods = list(dict.fromkeys(r["method"] for r in rows if (r["kld_answer"] or 0) > 0))
    ncol = max(1, -(-len(methods) // 30))  # one legend beside the panels, never over the points, 30 rows a column
    legend_w = ncol * (0.4 + 0.045 * max((len(plot_name(m)) for m in methods), default=0))  # inches at 7 pt
    fig, axes = plt.subplots(1, len(sources), figsize=(6.5 * len(sources) + legend_w, 6.5), squeeze=False)
    cmap, markers = plt.get_cmap("tab20"), "osD^vP*Xph<>"
    style = {m: (cmap(i % 20), markers[i % len(markers)]) for i, m in enumerate(methods)}
    for ax, source in zip(axes[0], sources):
        mine = [r for r in rows if r["source"] == source and (r["kld_answer"] or 0) > 0]
        for r in mine:
            c, mk = style[r["method"]]
            y, lo, hi = r["kld_answer"], r["kld_answer_lo"], r["kld_answer_hi"]
            ax.errorbar(
                [r["kv_ratio"]],
                [y],
                yerr=[[max(y - lo, 0)], [max(hi - y, 0)]],
                fmt=mk,
                color=c,
                capsize=3,
                markersize=7,
            )
            if (r["kld_tail"] or 0) > 0:
                ax.plot([r["kv_ratio"]], [r["kld_tail"]], marker=mk, mfc="none", color=c, linestyle="none")
        ax.set_yscale("log")
        ax.set_xlabel("KV bytes / FP16 DynamicCache")
        ax.set_ylabel("mean KL(P_fp16 || P_method), nats")
        n = max((r["examples"] for r in mine), default=0)
        ax.set_title(
            f"{source}: up to {n} examples\n(filled: answer segment with 95% CI; hollow: tail segment)", fontsize=10
        )
        ax.grid(True, which="both", alpha=0.3)
    handles = [
        plt.Line2D([], [], marker=style[m][1], color=style[m][0], linestyle="none", label=plot_name(m)) for m in methods
    ]
    fig.legend(handles=handles, loc="center right", fontsize=7, ncol=ncol, title="method", title_fontsize=7)
    save_figure(fig, path, rect=(0, 0, 1 - legend_w / fig.get_figwidth(), 1))
    return True


def write_reports(out_dir: str, records: list[dict], methods: list[str], header: str = "") -> str:
    """Write ``summary.csv``, ``paired.csv``, ``summary.md`` and ``kld_vs_bytes.png``; returns the markdown."""
    rows = summarize(records, methods)
    write_summary_csv(os.path.join(out_dir, "summary.csv"), rows)
    pairs = [p for ref in PAIRED_REFS if ref in methods for p in paired(records, methods, ref)]
    write_csv(os.path.join(out_dir, "paired.csv"), PAIRED_COLUMNS, (csv_values(r, PAIRED_COLUMNS) for r in pairs))
    md = markdown(rows, header) + "\n".join(paired_markdown(pairs)) + ("\n" if pairs else "")
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(md)
    plot(os.path.join(out_dir, "kld_vs_bytes.png"), rows)
    return md
