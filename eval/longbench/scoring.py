"""Scores of a LongBench run, recomputed from the stored predictions (as the official ``eval.py`` does, so a metric
fixed after a run reaches its finished examples too): per (task, method), averages over tasks, and each method
paired with fp16 on the same examples."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..stats import mean_or_none, paired_difference
from .metrics import example_score
from .predictions import merge_records


@dataclass
class Summary:
    per_task: list[dict] = field(default_factory=list)  # one row per (task, method) with finished examples
    average: list[dict] = field(default_factory=list)  # one row per method: means over its tasks
    paired_vs_fp16: list[dict] = field(default_factory=list)
    example_scores: dict = field(default_factory=dict)  # (task, method) -> {example id: score in [0, 1]}

    def row(self, task: str, method: str) -> dict | None:
        return next((r for r in self.per_task if r["task"] == task and r["method"] == method), None)

    def as_json(self) -> dict:
        return {"per_task": self.per_task, "average": self.average, "paired_vs_fp16": self.paired_vs_fp16}


def _task_row(task: str, method: str, recs: dict[str, dict], n_expected: int) -> tuple[dict, dict[str, float]]:
    # the record's own "score" is what the metric gave when it was written; it is recomputed here
    by_id = {k: example_score(task, r["pred"], r["answers"], r.get("all_classes")) for k, r in recs.items()}
    n = len(recs)
    row = {
        "task": task,
        "method": method,
        "score": round(100 * sum(by_id.values()) / n, 2),
        "kv_ratio": sum(r["kv_ratio"] for r in recs.values()) / n,
        "prefill_s": sum(r["prefill_s"] for r in recs.values()) / n,
        # examples that stopped after the first token (from the shared prefill) have no decode step
        "decode_ms_per_token": mean_or_none([r["decode_ms_per_token"] for r in recs.values()]),
        "n": n,
        "n_expected": n_expected,
    }
    mix = {"fp16": 0, "int4": 0, "int2": 0}
    for r in recs.values():
        for k, n in (r.get("precision_counts") or {}).items():
            mix[k] = mix.get(k, 0) + n  # "int3" only for low_bits=3 methods
    row["chunks"] = mix
    return row, by_id


def _average_row(method: str, rows: list[dict]) -> dict:
    k = len(rows)
    return {
        "task": "average",
        "method": method,
        "score": round(sum(r["score"] for r in rows) / k, 2),
        "kv_ratio": sum(r["kv_ratio"] for r in rows) / k,
        "prefill_s": sum(r["prefill_s"] for r in rows) / k,
        "decode_ms_per_token": mean_or_none([r["decode_ms_per_token"] for r in rows]),
        "n": sum(r["n"] for r in rows),
        "tasks": k,
    }


def _paired_with_fp16(tasks: list[str], methods: list[str], ex_scores: dict) -> list[dict]:
    if "fp16" not in methods:
        return []
    paired = []
    ref = {t: ex_scores[(t, "fp16")] for t in tasks if (t, "fp16") in ex_scores}
    for method in methods:
        if method == "fp16":
            continue
        res = paired_difference(ref, {t: ex_scores[(t, method)] for t in tasks if (t, method) in ex_scores})
        if res is not None:
            paired.append({"method": method, "reference": "fp16", **res})
    return paired


def score_run(out_dir: str, tasks: list[str], methods: list[str], order: dict[str, list[str]]) -> Summary:
    """Merge the part files and score every (task, method) over its finished examples of ``order[task]``."""
    summary = Summary()
    for task in tasks:
        wanted = set(order[task])
        for method in methods:
            recs = {k: v for k, v in merge_records(out_dir, task, method, order[task]).items() if k in wanted}
            if recs:
                row, by_id = _task_row(task, method, recs, len(order[task]))
                summary.per_task.append(row)
                summary.example_scores[(task, method)] = by_id
    for method in methods:
        rows = [r for r in summary.per_task if r["method"] == method]
        if rows:
            summary.average.append(_average_row(method, rows))
    summary.paired_vs_fp16 = _paired_with_fp16(tasks, methods, summary.example_scores)
    return summary
