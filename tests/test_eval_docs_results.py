"""docs/results.md's selection of a report (eval/docs_results.py): the sections, method rows and tables a
``Report`` names, the images linked from docs/, the commit that ran it; on a synthetic results folder."""

from __future__ import annotations

import json

from eval.docs_results import report_text, results_md
from eval.questions import Question, Report

REPORT = """# KL divergence from FP16 (smollm2, float32)

LongBench: 2 examples.

### longbench (up to 2 examples)

| method | id | examples | KLD answer |
|---|---|---|---|
| FP16 (DynamicCache) | `fp16` | 2 | 0.0000 |
| uniform INT4 | `int4` | 2 | 0.0038 |
| calibrated preset | `preset` | 2 | 0.0029 |

### needle (up to 1 examples)

| method | id | examples | KLD answer |
|---|---|---|---|
| uniform INT4 | `int4` | 1 | 0.0047 |

Paired with int4: the caption of the second table.

| method | avg - int4 |
|---|---|
| preset | -0.0010 |

![plot](kld_vs_bytes.png)
"""


def _folder(tmp_path, name="kld_x"):
    folder = tmp_path / "eval" / "results" / name
    folder.mkdir(parents=True)
    (folder / "summary.md").write_text(REPORT)
    return folder


def test_a_report_shows_the_sections_and_method_rows_it_names(tmp_path):
    _folder(tmp_path)
    text = "\n".join(report_text(Report("summary.md", ("longbench",), ("int4", "preset")), "kld_x", str(tmp_path)))
    assert "#### longbench" not in text and text.startswith("| method |")  # the one section shown: no heading
    assert "| uniform INT4 | `int4` | 2 | 0.0038 |" in text and "`preset` | 2 | 0.0029" in text
    assert "`fp16`" not in text and "needle" not in text and "LongBench: 2 examples." not in text  # no preamble


def test_a_report_keeps_its_preamble_tables_by_index_and_links_images_from_docs(tmp_path):
    _folder(tmp_path)
    text = "\n".join(report_text(Report("summary.md", preamble=True, tables=(0, 2)), "kld_x", str(tmp_path)))
    assert text.startswith("LongBench: 2 examples.")
    assert "`fp16`" in text and "0.0047" not in text  # table 1 (needle) dropped with its heading
    assert "the caption of the second table" in text
    assert "| calibrated preset (`preset`) | -0.0010 |" in text  # a first-column id shown with its label
    assert "![plot](../eval/results/kld_x/kld_vs_bytes.png)" in text


def test_headings_stay_where_several_sections_show_and_reading_notes_only_when_asked(tmp_path):
    folder = _folder(tmp_path)
    (folder / "summary.md").write_text(REPORT + "\nA reading note after the last table.\n")
    text = "\n".join(report_text(Report("summary.md", ("longbench", "needle")), "kld_x", str(tmp_path)))
    assert "#### longbench (up to 2 examples)\n| method |" in text and "#### needle (up to 1 examples)" in text
    assert "the caption of the second table" in text and "reading note" not in text
    text = "\n".join(report_text(Report("summary.md", ("needle",), notes=True), "kld_x", str(tmp_path)))
    assert "A reading note after the last table." in text


def test_a_missing_report_says_so_and_the_page_names_each_folder_and_its_commit(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    (folder / "run_info.json").write_text(json.dumps({"commit": "abcdef0123456789+dirty"}))
    questions = (
        Question("kld_x", "A question", "what ran.", (Report("summary.md", ("needle",)),)),
        Question("kld_x", "Another", "nothing yet.", (Report("absent.md"),)),
    )
    monkeypatch.setattr("eval.docs_results.QUESTIONS", questions)
    page = results_md(str(tmp_path))
    assert "## A question\n\n`eval/results/kld_x/`: what ran. Run at `abcdef0` with uncommitted edits." in page
    assert "`absent.md`: not measured yet" in page
