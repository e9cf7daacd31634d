"""Draw ``bench_latency`` results: decode ms/token and the ratio to ``DynamicCache`` (``fp16``, same run) against the
context length, one panel pair per (model, dtype, CPU kernel build) found in the JSON files (files written before
the runs recorded the build, ``hardware.cpu_ops``, ran the AVX2 one: the only build there was).

    python -m eval.benchmarks.plot_latency eval/results/decode_latency/smollm2_fp32_8k_16k.json \\
        eval/results/decode_latency/{smollm2_fp32_32k,smollm2_bf16,gemma3_fp32}.json \\
        --out eval/results/decode_latency/latency.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from ..reporting import plot_name, pyplot, save_figure


def load_rows(paths: list[str]) -> dict[tuple[str, str, str], list[dict]]:
    """``(model label, dtype, kernel build) -> result rows`` of every ``bench_latency`` JSON in ``paths``."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        model = "gemma-3-270m" if "gemma" in data.get("command", "") else "SmolLM2-135M"
        build = ((data.get("hardware") or {}).get("cpu_ops") or {}).get("kernel_target", "avx2+fma+f16c")
        for row in data["results"]:
            groups[(model, row["dtype"], build)].append(row)
    return groups


def plot(groups: dict[tuple[str, str, str], list[dict]], out: str):
    """One row of two panels per group, written to ``out``; returns the figure."""
    keys = sorted(groups)
    fig, axes = pyplot().subplots(len(keys), 2, figsize=(11, 3.6 * len(keys)), squeeze=False)
    for (model, dtype, build), (ax_ms, ax_ratio) in zip(keys, axes):
        by_method: dict[str, list[dict]] = defaultdict(list)
        for row in groups[(model, dtype, build)]:
            by_method[row["method"]].append(row)
        for method, rows in by_method.items():
            rows.sort(key=lambda r: r["context_tokens"])
            ctx = [r["context_tokens"] for r in rows]
            ax_ms.plot(ctx, [r["decode_ms_per_token"] for r in rows], marker="o", label=plot_name(method))
            ax_ratio.errorbar(
                ctx,
                [r["decode_ratio"] for r in rows],
                yerr=[
                    [r["decode_ratio"] - r["decode_ratio_min"] for r in rows],
                    [r["decode_ratio_max"] - r["decode_ratio"] for r in rows],
                ],
                marker="o",
                capsize=3,
                label=plot_name(method),
            )
        ax_ms.set(title=f"{model}, {dtype}, {build}: ms/token (median)", xlabel="context tokens")
        ax_ratio.set(title="ratio to DynamicCache (same run; bars: range of rounds)", xlabel="context tokens")
        ax_ratio.axhline(1.0, color="grey", lw=0.8)
        for ax in (ax_ms, ax_ratio):
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        ax_ms.legend(fontsize=7)
    save_figure(fig, out, dpi=110)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.benchmarks.plot_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_latency JSON files")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    plot(load_rows(args.results), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
