"""docs/results.md and the README's results table, generated from the files the evaluation scripts wrote under
eval/results/ (no number is typed by hand): each listed report's own tables, with every method id shown as its
readable label (:mod:`eval.methods.labels`), and one headline table of KL divergence from FP16 per model."""

from __future__ import annotations

import csv
import os
import re

from .methods.labels import label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "eval/results"

# (title, the report under eval/results/, what it measures): the sections of docs/results.md, in order
REPORTS = (
    ("SmolLM2-135M-Instruct: KL divergence from FP16, 2K LongBench windows and needles", "kld/summary.md"),
    (
        "SmolLM2-135M-Instruct: the preset as its calibrate command writes it today, same windows",
        "kld_calibrated_v9/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: the choice of the recall-probe score alone (not adopted), same windows",
        "kld_calibrated_v10/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: the preset on 16 essays at a 0.24 target (superseded)",
        "kld_calibrated_v8/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: the preset on 10 essays after the salient positions change (superseded)",
        "kld_calibrated_v7/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: the command's choice before the plans kept salient positions (superseded)",
        "kld_calibrated_v6/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: the command's choice before calibration bounded memory_report()'s bytes (superseded)",
        "kld_calibrated_v5/summary.md",
    ),
    ("SmolLM2-135M-Instruct: the preset before (cf1e14f), nearest 8-bit codes", "kld_calibrated_v3/summary.md"),
    (
        "SmolLM2-135M-Instruct: the same preset before its 8-bit scales and zeros were the nearest codes",
        "kld_calibrated_v2/summary.md",
    ),
    ("SmolLM2-135M-Instruct: a preset recalibrated at 0.225x (not adopted)", "kld_calibrated_v4/summary.md"),
    ("SmolLM2-135M-Instruct: KL divergence on 8K windows", "kld_8k/summary.md"),
    (
        "SmolLM2-135M-Instruct: RULER-style needles, today's preset (128 cases; FP16 and INT4 in the next table)",
        "ruler_calibrated/previous_preset/ruler_summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: RULER-style needles, the recall-probe score's choice (not adopted), the same 128 cases",
        "ruler_calibrated/ruler_summary.md",
    ),
    ("SmolLM2-135M-Instruct: RULER-style needles (38 cases per variant)", "ruler_24/ruler_summary.md"),
    ("SmolLM2-135M-Instruct: RULER multikey (128 cases)", "ruler_multikey/ruler_summary.md"),
    ("SmolLM2-135M-Instruct: LongBench scores (187 examples)", "longbench_full/summary.md"),
    ("Gemma 3 270M: KL divergence from FP16, 2K LongBench windows and needles", "gemma3_270m/kld/summary.md"),
    (
        "Gemma 3 270M: uniform INT4 and the preset as its calibrate command writes it today (recall probes)",
        "gemma3_270m/kld_v5/summary.md",
    ),
    (
        "Gemma 3 270M: a preset calibrated at a 0.30 target (`calibrate_t030/`, not adopted), beside uniform INT4",
        "gemma3_270m/kld_t030/summary.md",
    ),
    (
        "Gemma 3 270M: uniform INT4 and the command's choice before the recall probes (superseded)",
        "gemma3_270m/kld_v4/summary.md",
    ),
    (
        "Gemma 3 270M: uniform INT4 and the command's choice before the plans kept salient positions (superseded)",
        "gemma3_270m/kld_v3/summary.md",
    ),
    (
        "Gemma 3 270M: uniform INT4 and the preset before, 8-bit scales and zeros as the nearest codes",
        "gemma3_270m/kld_nearest/summary.md",
    ),
    ("Gemma 3 270M: RULER-style needles, today's preset (256 cases)", "gemma3_270m/ruler_v4/ruler_summary.md"),
    (
        "Gemma 3 270M: RULER-style needles, the preset calibrated at a 0.30 target (not adopted), the same 256 cases",
        "gemma3_270m/ruler_t030/ruler_summary.md",
    ),
    (
        "Gemma 3 270M: RULER-style needles, the choice before the recall probes (64 cases)",
        "gemma3_270m/ruler_v3/ruler_summary.md",
    ),
    ("Gemma 3 270M: RULER-style needles, the preset before that (64 cases)", "gemma3_270m/ruler_v2/ruler_summary.md"),
    ("Gemma 3 270M: RULER-style needles, an earlier preset (32 cases)", "gemma3_270m/ruler/ruler_summary.md"),
    ("Gemma 3 270M: perplexity over the quantized context", "gemma3_270m/ppl/summary.md"),
    ("Gemma 3 270M: chunk search on calibrated caps, low targets", "calibrate_search/gemma-3-270m/summary.md"),
    (
        "SmolLM2-135M-Instruct: chunk search on calibrated caps, low targets",
        "calibrate_search/smollm2-135m-instruct/summary.md",
    ),
    (
        "Gemma 3 270M: code widths by importance, fake quantization (a format no store holds yet)",
        "formats/widths/gemma-3-270m/summary.md",
    ),
    (
        "SmolLM2-135M-Instruct: code widths by importance, fake quantization (a format no store holds yet)",
        "formats/widths/smollm2-135m-instruct/summary.md",
    ),
    ("Speed: decode vs DynamicCache, fp32 (CPU), the kernel's AVX-512 VNNI build", "bench_latency_speed_fp32_vnni.md"),
    ("Speed: the same, a second run 40 minutes later", "bench_latency_speed_fp32_vnni_run2.md"),
    ("Speed: the same, a third run (next session)", "bench_latency_speed_fp32_vnni_run3.md"),
    ("Speed: 8K, after the fused append at the model's precision (issue 27)", "bench_latency_speed_fp32_vnni_run4.md"),
    (
        "Speed: 8K and 16K, the fused append and the regenerated SmolLM2 preset (one core busy with an evaluation)",
        "bench_latency_speed_fp32_vnni_run5.md",
    ),
    ("Speed: 8K, a sixth run 30 minutes later (one core busy)", "bench_latency_speed_fp32_vnni_run6.md"),
    ("Speed: 8K and 16K, a seventh run (CI running on the other core)", "bench_latency_speed_fp32_vnni_run7.md"),
    (
        "Speed: 8K and 16K on the Intel machine, the SmolLM2 preset regenerated again (one core busy)",
        "bench_latency_speed_fp32_vnni_run8.md",
    ),
    (
        "Speed: 8K and 16K on the Intel machine, the preset on 16 essays at 0.24",
        "bench_latency_speed_fp32_vnni_run9.md",
    ),
    ("Speed: 8K and 16K on the Intel machine, today's SmolLM2 preset", "bench_latency_speed_fp32_vnni_run10.md"),
    ("Speed: 32K on the Intel machine, fp32", "bench_latency_speed_fp32_32k_v2.md"),
    ("Speed: bf16 on the Intel machine", "bench_latency_speed_bf16_v2.md"),
    ("Speed: Gemma 3 270M on the Intel machine, its regenerated preset", "bench_latency_speed_gemma3_v2.md"),
    ("Speed: decode vs DynamicCache, fp32 (CPU), the kernel's AVX2 build", "bench_latency_speed_fp32.md"),
    ("Speed: decode vs DynamicCache at 32K, fp32 (CPU)", "bench_latency_speed_fp32_32k.md"),
    ("Speed: decode vs DynamicCache, bf16 (CPU)", "bench_latency_speed_bf16.md"),
    ("Speed: decode vs DynamicCache, Gemma 3 270M (CPU)", "bench_latency_speed_gemma3.md"),
    (
        "Speed: the decode step's profile, calibrated preset, before the fused append and kernel changes",
        "profile_decode_8k_presets_before.md",
    ),
    ("Speed: the decode step's profile, calibrated preset, after them", "profile_decode_8k_presets_after.md"),
    (
        "Speed: the decode step's profile, calibrated preset, after the glue checked once and the kernel trims",
        "profile_decode_8k_presets_after2.md",
    ),
    (
        "Speed: the decode step's profile, after the fused append at the model's precision (busy machine)",
        "profile_decode_8k_presets_after3.md",
    ),
)

# the README's headline: per model, (KLD report, its method id) for uniform INT4 and the three choices
HEADLINE = (
    (
        "SmolLM2-135M-Instruct",
        (
            ("uniform INT4", "kld_calibrated_v9/summary.csv", "int4"),
            ("`CocktailConfig()` (paper)", "kld/summary.csv", "cocktail"),
            ("`CocktailConfig.recommended()`", "kld/summary.csv", "int4v3_had_g64"),
            ("calibrated preset", "kld_calibrated_v9/summary.csv", "preset"),
        ),
    ),
    (
        "Gemma 3 270M",
        (
            ("uniform INT4", "gemma3_270m/kld_v5/summary.csv", "int4"),
            ("`CocktailConfig()` (paper)", "gemma3_270m/kld/summary.csv", "cocktail"),
            ("`CocktailConfig.recommended()`", "gemma3_270m/kld/summary.csv", "recommended"),
            ("calibrated preset", "gemma3_270m/kld_v5/summary.csv", "preset"),
        ),
    ),
)


def _path(rel: str, root: str) -> str:
    return os.path.join(root, RESULTS, rel)


def _labelled(text: str) -> str:
    """A report's markdown with each table row's first cell, a method id, shown as ``label (`id`)``."""

    def cell(m: re.Match) -> str:
        ident = m.group(1)
        name = label(ident)
        return f"| {name} (`{ident}`) |" if name != ident else m.group(0)

    return re.sub(r"^\| ([A-Za-z][\w.]*) \|", cell, text, flags=re.M)


def _section(title: str, rel: str, root: str) -> list[str]:
    path = _path(rel, root)
    head = [f"## {title}", "", f"From `{RESULTS}/{rel}` (its folder holds the records, settings and plots)."]
    if not os.path.isfile(path):
        return head + ["", "Not measured yet (no report in the repository).", ""]
    body = open(path, encoding="utf-8").read().strip().split("\n")
    body = [re.sub(r"^#+ ", "#### ", line) if line.startswith("#") else line for line in body]
    return head + [""] + _labelled(_images_from_docs("\n".join(body), rel)).split("\n") + [""]


def _images_from_docs(text: str, rel: str) -> str:
    """``text`` with each image a report links beside itself (``![..](name.png)``) linked from ``docs/`` instead."""
    folder = os.path.dirname(rel)
    where = "/".join(p for p in ("..", RESULTS, folder) if p)
    return re.sub(r"!\[([^\]]*)\]\((?!https?:|/|\.\.)([^)]+)\)", rf"![\1]({where}/\2)", text)


def results_md(root: str = ROOT) -> str:
    """The text of docs/results.md."""
    lines = [
        "# Results",
        "",
        "<!-- generated by `python -m eval.make_docs` from eval/results/: rerun the evaluation, then it -->",
        "",
        "Every table below is a report an evaluation script wrote (how to run and read each: `eval/README.md`; the",
        "commands of these runs and what each showed: `docs/experiments.md` and each folder's `run_info.json`); method",
        "ids are shown with a readable label. All on CPU (2 cores, no GPU).",
        "",
    ]
    for title, rel in REPORTS:
        lines += _section(title, rel, root)
    return "\n".join(lines).rstrip("\n") + "\n"


def _row(path: str, method: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row.get("source") == "longbench" and row["method"] == method:
                return row
    return None


def headline_table(root: str = ROOT) -> str:
    """The README's results table: KL divergence from FP16 on 2K LongBench windows (teacher-forced answer), KV
    bytes of the quantized layers vs FP16, per model and setting."""
    out = [
        "| model | setting | KV bytes vs FP16 | KL divergence from FP16 [95% CI] | windows |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model, rows in HEADLINE:
        for name, rel, method in rows:
            row = _row(_path(rel, root), method)
            if row is None:
                out.append(f"| {model} | {name} | not measured | not measured | |")
                continue
            ratio = row.get("kv_ratio_global") or row["kv_ratio"]
            kld = (
                f"{float(row['kld_answer']):.4f} [{float(row['kld_answer_lo']):.4f}, {float(row['kld_answer_hi']):.4f}]"
            )
            out.append(f"| {model} | {name} | {float(ratio):.3f}x | {kld} | {row['examples']} |")
    return "\n".join(out) + "\n"


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def readme_with_table(readme: str, root: str = ROOT) -> str:
    """``readme`` with the text between its results markers replaced by :func:`headline_table`."""
    if README_START not in readme or README_END not in readme:
        raise ValueError(f"README.md has no {README_START} ... {README_END} block")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_START}\n{headline_table(root)}{README_END}{tail}"
