"""Reports of a RULER-style run (``python -m eval.needle --variant ...``): ``ruler_summary.csv`` (accuracy per variant,
length and method, with ``average`` rows), ``ruler_paired.csv`` (each method minus FP16 on the same cases, with a
95% bootstrap interval), ``ruler_summary.md`` (both as tables, and how often Cocktail kinds kept the asked needles at
FP16) and ``ruler_accuracy.png`` (accuracy per variant per method, one panel per length)."""

from __future__ import annotations

import os

from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells, plot_name, pyplot, save_figure, write_dict_csv
from ..stats import mean_of_all, paired_stats

CSV_COLUMNS = [
    "variant",
    "ruler_task",
    "length",
    "method",
    "accuracy",
    "n",
    "kv_ratio",
    "asked_needles_fp16",
    "kv_ratio_global",
]


PAIRED_REF = "fp16"
PAIRED_COLUMNS = ["variant", "length", "method", "reference", "cases", "diff", "diff_lo", "diff_hi", "higher", "lower"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _fp16_share(rs: list[dict]) -> str:
    """``a/b``: asked needles whose every chunk got FP16 / asked needles located in a chunk (Cocktail kinds)."""
    bits = [b for r in rs for b in r.get("asked_needle_bits") or [] if b]
    return f"{sum(all(x == 16 for x in b) for b in bits)}/{len(bits)}" if bits else "-"


def summarize(rows: list[dict], methods: list[str], variants: list[str], lengths: list[int]) -> list[dict]:
    """One row per (variant, length, method) with records, then ``variant=average`` rows per (length, method) and
    ``length=all`` rows per (variant, method); accuracy in percent (RULER's string_match_all mean x 100)."""
    out = []

    def add(variant, task, length, method, rs):
        if rs:
            out.append(
                {
                    "variant": variant,
                    "ruler_task": task,
                    "length": length,
                    "method": method,
                    "accuracy": round(100 * _mean([r["score"] for r in rs]), 2),
                    "n": len(rs),
                    "kv_ratio": round(_mean([r["kv_ratio"] for r in rs]), 4),
                    "asked_needles_fp16": _fp16_share(rs),
                    "kv_ratio_global": _round(mean_of_all([r.get("kv_ratio_global") for r in rs]), 4),
                }
            )

    for v in variants:
        task = next((r["ruler_task"] for r in rows if r["variant"] == v), "")
        for L in lengths:
            for m in methods:
                add(v, task, L, m, [r for r in rows if r["variant"] == v and r["length"] == L and r["method"] == m])
        for m in methods:
            add(v, task, "all", m, [r for r in rows if r["variant"] == v and r["method"] == m])
    for L in [*lengths, "all"]:
        for m in methods:
            add("average", "", L, m, [r for r in rows if r["method"] == m and (L == "all" or r["length"] == L)])
    return out


def _differences(score: dict, cases: dict, method: str, ref: str, variant: str, length) -> dict:
    """length -> accuracy points of ``method`` minus ``ref`` on each case both have of ``variant`` (every variant
    for ``average``) and ``length`` (every length for ``all``); ``score``: (case, method) -> score, ``cases``: case ->
    one of its records."""
    strata: dict = {}
    for case, r in cases.items():
        if variant in ("average", r["variant"]) and length in ("all", r["length"]):
            if (case, method) in score and (case, ref) in score:
                strata.setdefault(r["length"], []).append(100 * (score[(case, method)] - score[(case, ref)]))
    return strata


def paired(
    rows: list[dict], methods: list[str], variants: list[str], lengths: list, ref: str = PAIRED_REF, n_boot: int = 2000
) -> list[dict]:
    """Each method minus ``ref`` on the cases both have (matched by ``case``), in accuracy points: one row per
    (variant, length) and per variant over every length (``length=all``), each also for ``variant=average`` (every
    variant's cases). The 95% interval resamples the paired cases within each length; ``higher`` / ``lower``:
    cases where the method scored above / below ``ref``. Empty when ``ref`` has no records."""
    score = {(r["case"], r["method"]): r["score"] for r in rows}
    cases = {r["case"]: r for r in rows}
    out = []
    for m, v, L in [(m, v, L) for m in methods if m != ref for v in [*variants, "average"] for L in [*lengths, "all"]]:
        strata = _differences(score, cases, m, ref, v, L)
        if not strata:
            continue
        st = paired_stats(strata, n_boot)
        row = {"variant": v, "length": L, "method": m, "reference": ref, "cases": st["n"]}
        diffs = {k: round(st[k], 2) for k in ("diff", "diff_lo", "diff_hi")}
        out.append({**row, **diffs, "higher": st["higher"], "lower": st["lower"]})
    return out


def paired_markdown(rows: list[dict], variants: list[str]) -> str:
    """One line per (method, length): the difference to the reference per variant, ``diff [lo, hi] (n)``."""
    if not rows:
        return ""
    cell = {(r["method"], r["length"], r["variant"]): r for r in rows}
    keys = list(dict.fromkeys((r["method"], r["length"]) for r in rows))
    cols = [v for v in [*variants, "average"] if any(r["variant"] == v for r in rows)]
    lines = [
        f"| {METHOD_COLUMNS} | length | " + " | ".join(cols) + " |",
        f"|{METHOD_RULE}" + "|---" * (len(cols) + 1) + "|",
    ]
    for m, L in keys:
        vals = []
        for v in cols:
            r = cell.get((m, L, v))
            vals.append(f"{r['diff']:+.1f} [{r['diff_lo']:+.1f}, {r['diff_hi']:+.1f}] ({r['cases']})" if r else "-")
        lines.append(f"| {method_cells(m)} | {L} | " + " | ".join(vals) + " |")
    note = (
        f"Paired with {rows[0]['reference']} on the same cases: method minus {rows[0]['reference']} in accuracy "
        "points, [95% bootstrap interval, cases resampled within each length] (cases both have)."
    )
    return note + "\n\n" + "\n".join(lines) + "\n"


def markdown(summary: list[dict], methods: list[str], variants: list[str], lengths: list[int], samples: int) -> str:
    """Accuracy table per method (rows) x variant and length (columns), then kv_ratio and the FP16 share."""
    cell = {(s["variant"], s["length"], s["method"]): s for s in summary}
    cols = [(v, L) for v in [*variants, "average"] for L in [*lengths, "all"]]
    cols = [c for c in cols if any((c[0], c[1], m) in cell for m in methods)]
    n = {c: max(cell[(*c, m)]["n"] for m in methods if (*c, m) in cell) for c in cols}
    # the global layers' ratio where it differs from the whole cache's (a model with sliding-window layers)
    show_global = any(
        s.get("kv_ratio_global") is not None and abs(s["kv_ratio_global"] - s["kv_ratio"]) > 1e-6 for s in summary
    )
    head = (
        f"| {METHOD_COLUMNS} | "
        + " | ".join(f"{v} {L} (n={n[(v, L)]})" for v, L in cols)
        + " | kv_ratio |"
        + (" kv_ratio global |" if show_global else "")
        + " asked needles at FP16 |"
    )
    lines = [head, f"|{METHOD_RULE}" + "|---" * (len(cols) + 2 + show_global) + "|"]
    for m in methods:
        if not any((c[0], c[1], m) in cell for c in cols):
            continue
        vals = [f"{cell[(v, L, m)]['accuracy']:.1f}" if (v, L, m) in cell else "-" for v, L in cols]
        tot = cell.get(("average", "all", m))
        kvr = f"{tot['kv_ratio']:.3f}" if tot else "-"
        fp = tot["asked_needles_fp16"] if tot else "-"
        glob = ""
        if show_global:
            glob = f" {tot['kv_ratio_global']:.3f} |" if tot and tot.get("kv_ratio_global") is not None else " - |"
        lines.append(f"| {method_cells(m)} | " + " | ".join(vals) + f" | {kvr} |{glob} {fp} |")
    note = (
        f"RULER-style needles (Paul Graham essays), accuracy = RULER's string_match_all x 100 (share of the "
        f"expected values found in the output), {samples} sample(s) per variant and length; column "
        "'<variant> <length> (n=cases)' (length = prompt + 128 tokens to generate, RULER's max_seq_length; "
        "'all': every length); 'average': mean over the cases of every variant. kv_ratio = KV bytes / the model's "
        "own FP16 DynamicCache bytes of the same tokens (kv_ratio global: the full-attention layers alone). "
        "'asked needles at FP16': asked needles whose chunks all got FP16 / asked needles (Cocktail kinds)."
    )
    return note + "\n\n" + "\n".join(lines) + "\n"


def plot(path: str, summary: list[dict], methods: list[str], variants: list[str], lengths: list[int]) -> None:
    """Grouped bars: accuracy per variant (groups) per method (bars), one panel per length and one for all."""
    plt = pyplot()
    cell = {(s["variant"], s["length"], s["method"]): s for s in summary}
    panels = [L for L in [*lengths, "all"] if any(("average", L, m) in cell for m in methods)]
    groups = [*variants, "average"]
    ms = [m for m in methods if any(("average", "all", m) == k for k in cell)]
    legend_h = 0.2 + 0.16 * -(-len(ms) // 3)  # inches: three labels a row above the panels
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(9.0, 1.2 + 0.45 * len(groups) * max(1, len(ms)) * len(panels) / 2.2), 3.2 + legend_h),
        squeeze=False,
        sharey=True,
    )
    width = 0.8 / max(1, len(ms))
    for ax, L in zip(axes[0], panels):
        for j, m in enumerate(ms):
            ys = [cell[(g, L, m)]["accuracy"] if (g, L, m) in cell else 0.0 for g in groups]
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
            kvr = cell[("average", "all", m)]["kv_ratio"]
            ax.bar(xs, ys, width, label=f"{plot_name(m)} ({kvr:.2f}x)" if L == panels[0] else None)
        ax.set_xticks(range(len(groups)), groups, rotation=20, fontsize=8)
        ax.set_title(f"length {L}" if L != "all" else "all lengths", fontsize=9)
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    fig.legend(loc="upper center", ncol=min(len(ms), 3), fontsize=7, bbox_to_anchor=(0.5, 1.0))
    save_figure(fig, path, dpi=110, rect=(0, 0, 1, 1 - legend_h / fig.get_figheight()))


def write_reports(
    out_dir: str, rows: list[dict], methods: list[str], variants: list[str], lengths: list[int], samples: int
) -> str:
    """Write every report of ``rows`` (the records of the requested cases); returns the markdown table."""
    summary = summarize(rows, methods, variants, sorted(set(lengths)))
    write_dict_csv(os.path.join(out_dir, "ruler_summary.csv"), summary, CSV_COLUMNS)
    pairs = paired(rows, methods, variants, sorted(set(lengths)))
    write_dict_csv(os.path.join(out_dir, "ruler_paired.csv"), pairs, PAIRED_COLUMNS)
    table = markdown(summary, methods, variants, sorted(set(lengths)), samples)
    if pairs:
        table += "\n" + paired_markdown(pairs, variants)
    with open(os.path.join(out_dir, "ruler_summary.md"), "w", encoding="utf-8") as f:
        f.write("# RULER-style needles\n\n" + table)
    if rows:
        plot(os.path.join(out_dir, "ruler_accuracy.png"), summary, methods, variants, sorted(set(lengths)))
    return table
