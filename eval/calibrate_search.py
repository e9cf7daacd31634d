"""Does the query-aware chunk search, on top of calibrated per-layer caps, beat the best setting without it at the
same bytes? ``hf_cocktail.calibrate`` at several byte targets with the search candidates (``--search``), the layer
sensitivity reused from a preset's own calibration (same model, same texts), every candidate measured on the same
held-out texts.

    python -m eval.calibrate_search --model gemma-3-270m --preset model_cards/gemma-3-270m \\
        --targets 0.20,0.15 --out-dir eval/results/calibrate_search/gemma-3-270m

The texts are the preset's own (read from its ``calibration.json`` command). Outputs: ``results.json`` (every
calibration result), ``summary.md`` (per target: the best setting without and with the search, uniform INT4 and
``recommended()`` beside them), ``kld_vs_bytes.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import torch

from hf_cocktail.calibrate import calibrate_model
from hf_cocktail.calibrate.cli import load_model
from hf_cocktail.calibrate.cli import parser as calibrate_parser
from hf_cocktail.calibrate.run import TargetUnreachable
from hf_cocktail.calibrate.texts import read_texts
from hf_cocktail.planning.scoring import offline_encoder_path

from .cli import parse_float_list
from .reporting import method_heading, pyplot, save_figure


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.calibrate_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--preset", required=True, help="a preset folder written by python -m hf_cocktail.calibrate")
    p.add_argument("--targets", default="0.20,0.15")
    p.add_argument("--search", default="encoder,bm25,attention")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--threads", type=int, default=1)
    return p


def preset_args(preset: str) -> tuple[dict, argparse.Namespace]:
    """The preset's calibration record and the arguments of the command that wrote it."""
    with open(os.path.join(preset, "calibration.json"), encoding="utf-8") as f:
        record = json.load(f)
    argv = shlex.split(record["command"])[3:]  # after "python -m hf_cocktail.calibrate"
    return record, calibrate_parser().parse_args(argv)


def best(cands: list[dict], kind: str) -> dict | None:
    fit = [c for c in cands if c["fits"] and c["kind"] == kind]
    return min(fit, key=lambda c: c["kld"]) if fit else None


def summary(results: dict[str, dict]) -> str:
    lines = [
        "| target | best without search | bytes | KLD | best with search | bytes | KLD | uniform INT4 (bytes, KLD) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target, res in results.items():
        if "error" in res:
            lines.append(f"| {target} | nothing fits: {res['error'][:160]} | | | | | | |")
            continue
        cands = res["candidates"]
        caps, search = best(cands, "caps"), best(cands, "search")
        int4 = next(c for c in cands if c["name"] == "uniform INT4")

        def cell(c):
            if c is None:
                return "none fits | | "
            return f"{method_heading(c['name'])} | {c['quantized_ratio']:.3f}x | {c['kld']:.4f}"

        lines.append(
            f"| {target} | {cell(caps)} | {cell(search)} | {int4['quantized_ratio']:.3f}x, {int4['kld']:.4f} |"
        )
    return "\n".join(lines) + "\n"


KINDS = {  # a candidate's kind: its marker and what the legend calls it
    "caps": ("o", "per-layer caps"),
    "search": ("x", "chunk search on caps"),
    "baseline": ("s", "uniform INT4, recommended()"),
}


def plot(results: dict[str, dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target, res in results.items():
        for kind, (mark, name) in KINDS.items():
            cs = [c for c in res["candidates"] if c["kind"] == kind]
            if cs:
                xs, ys = [c["quantized_ratio"] for c in cs], [c["kld"] for c in cs]
                ax.scatter(xs, ys, marker=mark, label=f"{name}, target {target}")
    if not ax.collections:
        plt.close(fig)
        return
    ax.set_xlabel("quantized layers' KV bytes / FP16")
    ax.set_ylabel("mean KL divergence from FP16 (held-out)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    record, cal = preset_args(args.preset)
    texts = read_texts(cal.texts, cal.text_field)
    model, tok = load_model(args.model, None, torch.float32)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    for target in parse_float_list(args.targets, "--targets"):
        try:
            res = calibrate_model(
                model,
                tok,
                texts,
                target,
                calibration_texts=cal.calibration_texts,
                validation_texts=cal.validation_texts,
                window=cal.window,
                question_tokens=cal.question_tokens,
                continuation_tokens=cal.continuation_tokens,
                search_scorers=[s for s in args.search.split(",") if s],
                encoder=offline_encoder_path(),
                sensitivity_from=record,
            )
        except TargetUnreachable as e:  # nothing fits the target: recorded as such
            results[f"{target:g}"] = {"error": str(e), "candidates": []}
        else:
            results[f"{target:g}"] = res.to_dict()
        with open(os.path.join(args.out_dir, "results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        text = summary(results)
        with open(os.path.join(args.out_dir, "summary.md"), "w", encoding="utf-8") as f:
            f.write(text)
        plot(results, os.path.join(args.out_dir, "kld_vs_bytes.png"))
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
