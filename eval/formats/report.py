"""The study's results: means over windows per (format, bits, side) with honest bits per element, written as
``results.json``, ``summary.md`` and one PNG per model (KLD against bits per element, INT4 today as the reference)."""

from __future__ import annotations

import math
import os
import statistics

from ..reporting import pyplot
from .measure import record_key
from .variants import bits_per_element

REFERENCE = ("today", 4)  # the reference line: today's INT4
BUDGET_BITS = 4.0  # 0.25x of FP16's 16 bits per element
SIDE_TITLES = {"k": "keys quantized (values FP16)", "v": "values quantized (keys FP16)", "kv": "keys and values"}
SIDE_ORDER = ("kv", "k", "v")


def aggregate(records: list[dict], settings: dict) -> list[dict]:
    """One row per (format, key bits, value bits, side): mean KLD and top-1 over the windows, mean outlier fractions,
    bits per element (keys and values averaged for side ``"kv"``) and its ratio to FP16."""
    geo = {k: settings[k] for k in ("chunk_size", "group_size", "head_dim", "scale_bits")}
    rows: dict[tuple, dict] = {}
    for rec in records:
        for s in rec["settings"]:
            key = record_key(rec["window"], s)[1:]
            row = rows.setdefault(key, {"kld": [], "top1": [], "k": [], "v": [], "windows": []})
            row["kld"].append(s["kld"])
            row["top1"].append(s["top1"])
            row["windows"].append(rec["window"])
            for one, frac in s["outliers"].items():
                row[one].append(frac)
    out = []
    for (fmt, kbits, vbits, side), r in rows.items():
        width = {"k": kbits, "v": vbits}
        bpe = statistics.fmean(bits_per_element(width[one], one, statistics.fmean(r[one]), **geo) for one in side)
        out.append(
            {
                "format": fmt,
                "bits": kbits,
                "value_bits": vbits,
                "side": side,
                "bits_per_element": bpe,
                "ratio_to_fp16": bpe / 16,
                "outliers": {one: statistics.fmean(r[one]) for one in side},
                "kld": statistics.fmean(r["kld"]),
                "kld_per_window": dict(zip(r["windows"], r["kld"])),
                "top1": statistics.fmean(r["top1"]),
            }
        )
    return out


def uniform(row: dict) -> bool:
    """Keys and values at one width (or one side only)."""
    return row["side"] != "kv" or row["bits"] == row["value_bits"]


def widths(row: dict) -> str:
    """``"4"``, or ``"4/3"`` for keys at 4 bits and values at 3."""
    return str(row["bits"]) if uniform(row) else f"{row['bits']}/{row['value_bits']}"


def reference(rows: list[dict], side: str) -> dict | None:
    """INT4 today's row of ``side``."""
    return next((r for r in rows if (r["format"], r["bits"]) == REFERENCE and r["side"] == side and uniform(r)), None)


def within_budget(rows: list[dict]) -> list[dict]:
    """The ``"kv"`` rows at <= 4.0 bits per element (0.25x FP16) whose KLD is <= INT4 today's, best first."""
    ref = reference(rows, "kv")
    if ref is None:
        return []
    ok = [r for r in rows if r["side"] == "kv" and r["bits_per_element"] <= BUDGET_BITS and r["kld"] <= ref["kld"]]
    return sorted(ok, key=lambda r: r["kld"])


def bits_to_match(rows: list[dict], fmt: str, side: str, target: float) -> float | None:
    """The bits per element at which ``fmt`` reaches KLD ``target`` on ``side``: log(KLD) interpolated linearly in
    bits per element between the measured widths; ``None`` when no measured width reaches it, the fewest measured
    bits when every width does (an upper bound)."""
    pts = sorted(
        (r["bits_per_element"], r["kld"]) for r in rows if r["format"] == fmt and r["side"] == side and uniform(r)
    )
    if not pts or pts[-1][1] > target:
        return None
    if pts[0][1] <= target:
        return pts[0][0]
    for (b0, k0), (b1, k1) in zip(pts, pts[1:]):
        if k0 > target >= k1:
            if k1 <= 0:
                return b1
            t = (math.log(k0) - math.log(target)) / (math.log(k0) - math.log(k1))
            return b0 + t * (b1 - b0)
    return None


def match_lines(rows: list[dict]) -> list[str]:
    """Per side, every format's bits per element at INT4 today's KLD (:func:`bits_to_match`)."""
    lines = ["| format | " + " | ".join(SIDE_TITLES[s] for s in SIDE_ORDER) + " |", "|---" * 4 + "|"]
    for fmt in dict.fromkeys(r["format"] for r in rows):
        cells = []
        for side in SIDE_ORDER:
            ref = reference(rows, side)
            b = bits_to_match(rows, fmt, side, ref["kld"]) if ref else None
            measured = any(r["format"] == fmt and r["side"] == side for r in rows)
            cells.append("-" if not measured else "not reached" if b is None else f"{b:.2f}")
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines


def lower_than_today(rows: list[dict], row: dict) -> str:
    """``"w/n"``: on how many of the n windows both measured ``row``'s KLD is below today's at the same widths."""
    today = next(
        (
            r
            for r in rows
            if r["format"] == "today"
            and (r["bits"], r["value_bits"], r["side"]) == (row["bits"], row["value_bits"], row["side"])
        ),
        None,
    )
    if today is None or row is today:
        return "-"
    both = [w for w in row["kld_per_window"] if w in today["kld_per_window"]]
    wins = sum(row["kld_per_window"][w] < today["kld_per_window"][w] for w in both)
    return f"{wins}/{len(both)}"


def _table(rows: list[dict], side: str) -> list[str]:
    ref = reference(rows, side)
    lines = [
        "| format | bits (keys/values) | bits/element | x FP16 | mean KLD | / INT4 today | < today, windows | top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted((r for r in rows if r["side"] == side), key=lambda r: (r["bits_per_element"], r["format"])):
        rel = f"{r['kld'] / ref['kld']:.2f}" if ref and ref["kld"] > 0 else "-"
        lines.append(
            f"| {r['format']} | {widths(r)} | {r['bits_per_element']:.3f} | {r['ratio_to_fp16']:.3f} | "
            f"{r['kld']:.5f} | {rel} | {lower_than_today(rows, r)} | {r['top1']:.3f} |"
        )
    return lines


def model_section(
    model: str, settings: dict, records: list[dict], rows: list[dict], png: str, runs: list[dict]
) -> list[str]:
    """The summary's section of one model: the setup and checks, the measuring commands, the budget question, the
    PNG, the bits to match INT4 today and one table per side."""
    checks = [r["fp16_copy_kld"] for r in records]
    names = list(dict.fromkeys(r["window"] for r in records))
    tokens = [r["context_tokens"] for r in records]
    rope_err = max(r["rope_round_trip_max_abs_err"] for r in records)
    mags = [r["keys_max_abs"] for r in records if r.get("keys_max_abs") is not None]
    rope_rel = f" (keys up to {max(mags):.3g} in magnitude)" if mags else ""
    lines = [
        f"## {model}",
        "",
        f"{len(names)} windows ({', '.join(names)}), {min(tokens)}-{max(tokens)} context tokens each; quantized "
        f"layers {settings['layers']} (H_kv={settings['num_kv_heads']}, D={settings['head_dim']}); "
        f"C={settings['chunk_size']}, G={settings['group_size']}, "
        f"scale_bits={settings['scale_bits']}. Checks: the unchanged copy's KLD max {max(checks):.2e}; RoPE undone and "
        f"redone without quantization: max |error| {rope_err:.2e}{rope_rel}.",
        "",
        "Measured by:",
        "",
        *(f"- `{r['command']}` (commit {r['commit']}, {r['runtime_s']} s)" for r in runs),
        "",
    ]
    best = within_budget(rows)
    ref = reference(rows, "kv")
    if ref is not None:
        lines.append(
            f"INT4 today (keys and values): {ref['bits_per_element']:.3f} bits/element ({ref['ratio_to_fp16']:.3f}x), "
            f"KLD {ref['kld']:.5f}. At <= {BUDGET_BITS} bits/element ({BUDGET_BITS / 16}x) with KLD <= that: "
            + (
                ", ".join(f"{r['format']} INT{widths(r)} ({r['bits_per_element']:.3f}, {r['kld']:.5f})" for r in best)
                or "none"
            )
            + "."
        )
        lines.append("")
    lines.append(f"![KLD vs bits per element]({os.path.basename(png)})")
    lines += [
        "",
        "Bits per element at which each format reaches INT4 today's KLD (same side; log-KLD interpolated "
        "between the measured widths):",
        "",
        *match_lines(rows),
    ]
    for side in SIDE_ORDER:
        lines += ["", f"### {SIDE_TITLES[side]}", "", *_table(rows, side)]
    return lines + [""]


def plot(model: str, rows: list[dict], path: str) -> None:
    """KLD (log) against bits per element, one panel per side, one line per format (its mixed widths as crosses),
    INT4 today dashed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {f: cycle[i % len(cycle)] for i, f in enumerate(dict.fromkeys(r["format"] for r in rows))}
    for ax, side in zip(axes, SIDE_ORDER):
        mine = [r for r in rows if r["side"] == side]
        for fmt in dict.fromkeys(r["format"] for r in mine):
            pts = sorted((r["bits_per_element"], r["kld"]) for r in mine if r["format"] == fmt and uniform(r))
            color = colors[fmt]
            ax.plot(*zip(*pts), marker="o", label=fmt, color=color)
            for r in (r for r in mine if r["format"] == fmt and not uniform(r)):
                ax.plot(r["bits_per_element"], r["kld"], marker="x", ls="", color=color)
                ax.annotate(widths(r), (r["bits_per_element"], r["kld"]), fontsize=6, color=color)
        ref = reference(rows, side)
        if ref is not None:
            ax.axhline(ref["kld"], color="k", ls="--", lw=1, label="INT4 today")
        ax.axvline(BUDGET_BITS, color="grey", ls=":", lw=1, label="0.25x FP16")
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (codes + params + outliers)")
        ax.set_title(SIDE_TITLES[side])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("mean KL(P_fp16 || P) (nats)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model}: context K/V formats, fake quantization")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
