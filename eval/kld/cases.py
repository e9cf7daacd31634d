"""The prompts the divergence is measured on: LongBench examples (all of them, or a seeded stratified subset of N
per task) built exactly as ``eval.longbench`` builds them, and needle prompts built as ``eval.needle`` does."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..essays import load_essays
from ..longbench.data import example_ids, load_config, load_task_rows
from ..longbench.prompts import build_prompt as longbench_prompt
from ..methods.kinds import Request
from ..needle.cases import make_case, passcode_request


@dataclass
class KldCase:
    """One prompt: its key in the records (``source/...``), the stratum the bootstrap resamples within (the
    LongBench task, or ``needle``) and the request every method's cache is built for."""

    key: str
    source: str  # "longbench" | "needle"
    stratum: str
    request: Request
    meta: dict = field(default_factory=dict)


def select_rows(n_rows: int, per_task: int | None, seed: int, task: str) -> list[int]:
    """Indices of the rows of ``task`` to run: all of them, or ``per_task`` drawn with a seed of their own per task
    (``random.Random(f"{seed}-{task}")``), in file order."""
    if per_task is None or per_task >= n_rows:
        return list(range(n_rows))
    return sorted(random.Random(f"{seed}-{task}").sample(range(n_rows), per_task))


def longbench_cases(
    tok,
    tasks: list[str],
    data_dir: str,
    config_dir: str,
    window: int,
    per_task: int | None,
    seed: int,
) -> list[KldCase]:
    """The LongBench cases, interleaved across tasks (the first selected example of every task, then the second...)
    so that a run stopped early still covers every task."""
    templates, _ = load_config(config_dir)
    per: list[list[KldCase]] = []
    for task in tasks:
        rows = load_task_rows(task, data_dir)
        ids = example_ids(rows)
        cases = []
        for i in select_rows(len(rows), per_task, seed, task):
            info = longbench_prompt(tok, task, rows[i], templates[task], window)
            cases.append(
                KldCase(
                    f"longbench/{task}/{ids[i]}",
                    "longbench",
                    task,
                    info.request(ids[i]),
                    {"task": task, "row": i, "truncated": info.truncated, "chat": info.chat},
                )
            )
        per.append(cases)
    out = []
    for j in range(max((len(c) for c in per), default=0)):
        out.extend(c[j] for c in per if j < len(c))
    return out


def needle_cases(
    tok, lengths: list[int], depths: list[float], samples: int, seed: int, essay_dir: str | None = None
) -> list[KldCase]:
    """Needle prompts (chat template), one per (length, depth, sample)."""
    if not lengths:
        return []
    essays = load_essays(essay_dir)
    out = []
    for L in lengths:
        for d in depths:
            for s in range(samples):
                case = make_case(tok, essays, L, d, s, seed)
                req = passcode_request(tok, case)
                meta = {"length": L, "depth": d, "sample": s, "code": case["code"]}
                out.append(KldCase(f"needle/{req.example_id}", "needle", "needle", req, meta))
    return out
