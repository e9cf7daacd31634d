"""docs/results.md and the README's results table, generated from the files the evaluation scripts wrote under
eval/results/ (no number is typed by hand): per question of :data:`eval.questions.QUESTIONS`, its reports' tables
(the sections and method rows it names), with every method id shown as its readable label
(:mod:`eval.methods.labels`), its plots, and one headline table of KL divergence from FP16 per model."""

from __future__ import annotations

import csv
import json
import os
import re

from .methods.labels import label
from .questions import QUESTIONS, RESULTS, Question, Report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the README's headline: per model, (KLD report, its method id) for uniform INT4 and the three choices
HEADLINE = (
    (
        "SmolLM2-135M-Instruct",
        (
            ("uniform INT4", "kld_calibrated/summary.csv", "int4"),
            ("`CocktailConfig()` (paper)", "kld/summary.csv", "cocktail"),
            ("`CocktailConfig.recommended()`", "kld/summary.csv", "recommended"),
            ("calibrated preset", "kld_calibrated/summary.csv", "preset"),
        ),
    ),
    (
        "Gemma 3 270M",
        (
            ("uniform INT4", "gemma3_270m/kld_calibrated/summary.csv", "int4"),
            ("`CocktailConfig()` (paper)", "gemma3_270m/kld/summary.csv", "cocktail"),
            ("`CocktailConfig.recommended()`", "gemma3_270m/kld/summary.csv", "recommended"),
            ("calibrated preset", "gemma3_270m/kld_calibrated/summary.csv", "preset"),
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


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """A report as ``(heading, lines)`` blocks: the text before its first section (heading ``""``, the title line
    dropped), then one block per ``#`` heading."""
    blocks: list[tuple[str, list[str]]] = [("", [])]
    for i, line in enumerate(text.strip().split("\n")):
        if line.startswith("#") and i == 0:
            continue
        if line.startswith("#"):
            blocks.append((line.lstrip("#").strip(), ["#### " + line.lstrip("#").strip()]))
        else:
            blocks[-1][1].append(line)
    return blocks


def _without_first_paragraph(lines: list[str]) -> list[str]:
    """``lines`` without their first paragraph (up to the first blank line after text), unless it is a table."""
    start = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    if start == len(lines) or lines[start].startswith("|"):
        return lines
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[end:]


def _without_notes(lines: list[str], keep_first: bool) -> list[str]:
    """``lines`` without the paragraphs that are neither a heading, a table, an image nor a table's caption (the
    paragraph just before a table); the first paragraph stays when ``keep_first``."""
    chunks = "\n".join(lines).split("\n\n")
    first = next((i for i, c in enumerate(chunks) if c.strip()), None) if keep_first else None

    def shown(i: int, chunk: str) -> bool:
        text = chunk.strip()
        nxt = next((c.strip() for c in chunks[i + 1 :] if c.strip()), "")
        return i == first or text.startswith(("|", "#", "![")) or nxt.startswith("|") or not text

    return "\n\n".join(c for i, c in enumerate(chunks) if shown(i, c)).split("\n")


def _rows_of(lines: list[str], report: Report) -> list[str]:
    """``lines`` with each markdown table cut to the rows of ``report.methods`` (by its ``id`` column, else
    ``method``) and of ``report.where`` (per column the values shown); a condition whose column a table lacks does not
    apply to it."""
    conditions = [("id|method", set(report.methods))] if report.methods else []
    conditions += [(column, set(values)) for column, values in report.where]
    out: list[str] = []
    columns: dict[str, int] | None = None
    for line in lines:
        if not line.startswith("|"):
            columns = None
            out.append(line)
            continue
        cells = [c.strip().strip("`*") for c in line.strip().strip("|").split("|")]
        if set(line) <= set("|-: "):
            out.append(line)
        elif columns is None:
            columns = {c: i for i, c in enumerate(cells)}
            if "id" in columns or "method" in columns:
                columns["id|method"] = columns.get("id", columns.get("method", -1))
            out.append(line)
        elif all(cells[columns[c]] in allowed for c, allowed in conditions if c in columns):
            out.append(line)
    return out


def _tables_of(text: str, tables: tuple[int, ...]) -> str:
    """``text`` without the markdown tables whose index is not in ``tables`` (nor the paragraph just before each,
    its caption); everything when ``tables`` is empty."""
    if not tables:
        return text
    chunks = text.split("\n\n")
    is_table = [c.startswith("|") for c in chunks]
    index = [sum(is_table[:i]) for i in range(len(chunks))]  # the table index of a table chunk
    dropped = [t and index[i] not in tables for i, t in enumerate(is_table)]
    kept = [c for i, c in enumerate(chunks) if not dropped[i] and not (i + 1 < len(chunks) and dropped[i + 1])]
    return "\n\n".join(kept)


def report_text(report: Report, folder: str, root: str) -> list[str]:
    """The lines of ``report`` shown in docs/results.md (its chosen sections and rows, labels, images linked); a
    section's heading is left out where it is the only one shown, the reading notes unless ``report.notes``."""
    path = os.path.join(root, RESULTS, folder, report.file)
    if not os.path.isfile(path):
        return [f"`{report.file}`: not measured yet (no report in the repository).", ""]
    lines = []
    blocks = [
        (heading, block)
        for heading, block in _blocks(open(path, encoding="utf-8").read())
        if not heading or not report.headings or heading.startswith(report.headings)
    ]
    for heading, block in blocks:
        if not heading and not report.preamble:
            block = _without_first_paragraph(block)
        if heading and len(blocks) == 2:  # the one section shown: the question's title says what it is
            block = block[1:]
        block = block if report.notes else _without_notes(block, keep_first=not heading and report.preamble)
        lines += _rows_of(block, report)
    text = re.sub(r"\n{3,}", "\n\n", _tables_of("\n".join(lines).strip(), report.tables))
    text = re.sub(r"^(#### .*)\n\n\|", r"\1\n|", text, flags=re.M)
    rel = os.path.join(folder, report.file)
    return _labelled(_images_from_docs(text, rel)).split("\n") + [""]


def _commit(folder: str, report: Report | None, root: str) -> str:
    """The commit that ran a report: its sibling ``.json``'s ``commit`` (the speed scripts), else the folder's
    ``run_info.json`` (the last invocation's); ``""`` when neither records one."""
    base = os.path.join(root, RESULTS, folder)
    paths = [os.path.join(base, os.path.splitext(report.file)[0] + ".json")] if report else []
    for path in [*paths, os.path.join(base, "run_info.json")]:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                commit = json.load(f).get("commit")
            if isinstance(commit, str) and commit:
                return f"`{commit[:7]}`" + (" with uncommitted edits" if commit.endswith("+dirty") else "")
    return ""


def _section(q: Question, root: str) -> list[str]:
    commit = _commit(q.folder, q.reports[0] if len(q.reports) == 1 else None, root)
    run = f" Run at {commit}." if commit else ""
    lines = [f"## {q.title}", "", f"`{RESULTS}/{q.folder}/`: {q.about}{run}", ""]
    for report in q.reports:
        if len(q.reports) > 1:
            commit = _commit(q.folder, report, root)
            lines += [f"### `{report.file}`" + (f" (run at {commit})" if commit else ""), ""]
        lines += report_text(report, q.folder, root)
    for image in q.images:
        lines += [f"![{image}](../{RESULTS}/{q.folder}/{image})", ""]
    return lines


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
        "<!-- generated by `python -m eval.make_docs` from eval/results/ and eval/questions.py: rerun the evaluation,",
        "then it -->",
        "",
        "The current run of each question, selected rows of what its script reported (the folder has every method,",
        "the records and `run_info.json` with command and commit). How to run and read each script:",
        "[eval/README.md](../eval/README.md); what was tried before: [experiments.md](experiments.md). KLD:",
        "KL(P_fp16 || P_method) of the next token in nats over the teacher-forced FP16 answer (`answer`) or over",
        "positions computed over the quantized cache (`tail`); kv_ratio: KV bytes over the model's own FP16",
        "`DynamicCache`; intervals: 95% bootstrap over the examples; RULER-style accuracy: `string_match_all` x 100,",
        "paired: minus FP16 in points. Speed: ratios to `DynamicCache` in the same run, on a shared 2-core CPU unless",
        "a GPU is named.",
        "",
    ]
    for q in QUESTIONS:
        lines += _section(q, root)
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
