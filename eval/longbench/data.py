"""LongBench data: the prompt templates and max new tokens (``dataset2prompt.json`` / ``dataset2maxlen.json``) and the
examples of a task, from a folder of jsonl files in the LongBench schema (MiniLongBench, or the ``data/`` of
THUDM/LongBench's ``data.zip``)."""

from __future__ import annotations

import json
import os

from ..cli import UsageError


def load_config(config_dir: str) -> tuple[dict, dict]:
    """``(dataset2prompt, dataset2maxlen)`` from ``config_dir``."""
    p = os.path.join(config_dir, "dataset2prompt.json")
    m = os.path.join(config_dir, "dataset2maxlen.json")
    for f in (p, m):
        if not os.path.isfile(f):
            raise UsageError(
                f"LongBench config file {f} not found (set --config-dir to the folder holding "
                "dataset2prompt.json and dataset2maxlen.json from the LongBench repository)"
            )
    with open(p, encoding="utf-8") as f1, open(m, encoding="utf-8") as f2:
        return json.load(f1), json.load(f2)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_task_rows(task: str, data_dir: str) -> list[dict]:
    """Rows of ``task`` in the LongBench schema, from ``data_dir/<task>.jsonl``."""
    path = os.path.join(data_dir, f"{task}.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"no data for task {task!r}: {path} does not exist (--data-dir {data_dir})")
    return read_jsonl(path)


def example_ids(rows: list[dict]) -> list[str]:
    """A unique id per row: its ``_id`` (``#<index>`` appended to a repeated one), else its index."""
    ids, seen = [], set()
    for i, r in enumerate(rows):
        x = str(r.get("_id", i))
        if x in seen:
            x = f"{x}#{i}"
        seen.add(x)
        ids.append(x)
    return ids
