"""The prediction records of a LongBench run: one JSON line per (task, method, example).

Each process appends to its own part file ``parts/<task>/<method>/rank<i>.jsonl``; the main process merges them
into ``predictions/<task>/<method>.jsonl`` (ordered like the data). Finished records are never rewritten.
"""

from __future__ import annotations

import glob
import json
import os

from ..records import append_jsonl, iter_jsonl
from ..run_info import now
from ..runner import Outcome
from .metrics import example_score
from .prompts import PromptInfo


def parts_dir(out_dir: str, task: str, method: str) -> str:
    return os.path.join(out_dir, "parts", task, method)


def merged_path(out_dir: str, task: str, method: str) -> str:
    return os.path.join(out_dir, "predictions", task, f"{method}.jsonl")


def read_records(out_dir: str, task: str, method: str) -> dict[str, dict]:
    """Finished records of (task, method): the merged file plus any per-process part files (first one wins)."""
    recs: dict[str, dict] = {}
    files = [merged_path(out_dir, task, method)] + sorted(
        glob.glob(os.path.join(parts_dir(out_dir, task, method), "*.jsonl"))
    )
    for f in files:
        if os.path.isfile(f):
            for r in iter_jsonl(f):
                recs.setdefault(r["_id"], r)
    return recs


def merge_records(out_dir: str, task: str, method: str, order: list[str]) -> dict[str, dict]:
    """Merge the part files into ``predictions/<task>/<method>.jsonl`` (ordered like the data), then remove them.
    Existing records are kept as they are."""
    recs = read_records(out_dir, task, method)
    if not recs:
        return recs
    pos = {x: i for i, x in enumerate(order)}
    rows = sorted(recs.values(), key=lambda r: (pos.get(r["_id"], len(pos)), r["_id"]))
    path = merged_path(out_dir, task, method)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    for p in glob.glob(os.path.join(parts_dir(out_dir, task, method), "*.jsonl")):
        os.remove(p)
    for d in (
        parts_dir(out_dir, task, method),
        os.path.dirname(parts_dir(out_dir, task, method)),
        os.path.join(out_dir, "parts"),
    ):
        try:
            os.rmdir(d)  # only when empty
        except OSError:
            pass
    return recs


def prediction_record(task: str, ex: dict, ex_id: str, info: PromptInfo, out: Outcome, process: int) -> dict:
    """The record of one method's prediction on one example."""
    return {
        "_id": ex_id,
        "task": task,
        "method": out.method.name,
        "pred": out.text,
        "answers": ex["answers"],
        "all_classes": ex.get("all_classes"),
        "score": example_score(task, out.text, ex["answers"], ex.get("all_classes")),
        "length": ex.get("length"),
        "prompt_tokens": out.prompt_tokens,
        "raw_prompt_tokens": info.raw_tokens,
        "truncated": info.truncated,
        "chat": info.chat,
        "context_found": bool(info.context),
        "query_source": info.query_source,
        "new_tokens": out.num_new,
        **out.fields(),
        "shared_prefill_s": out.shared_prefill_s,
        "setup_s": out.branch.setup_s,
        "decode_ms_per_token": out.decode_ms_per_token,
        "process": process,
        "written_at": now(),
    }


def append_part(out_dir: str, record: dict, process: int) -> None:
    """Append ``record`` to this process's part file of its (task, method)."""
    pdir = parts_dir(out_dir, record["task"], record["method"])
    os.makedirs(pdir, exist_ok=True)
    append_jsonl(os.path.join(pdir, f"rank{process}.jsonl"), record)
