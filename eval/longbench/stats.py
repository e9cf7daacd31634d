"""Statistics of the LongBench summary: means that skip missing values, and the paired bootstrap comparison."""

from __future__ import annotations

import random


def mean_or_none(values) -> float | None:
    """Mean of the values that are not None (None when there are none)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def paired_difference(
    ref: dict[str, dict[str, float]], other: dict[str, dict[str, float]], n_boot: int = 2000, seed: int = 0
) -> dict | None:
    """Paired comparison of two methods on the examples both finished: the LongBench average (mean over tasks of
    the task's mean score, x100) of ``other`` minus ``ref``, with a 95% bootstrap interval (examples resampled with
    replacement within each task, ``n_boot`` times), and how many examples scored higher / the same / lower.

    ``ref`` / ``other``: task -> {example id: score in [0, 1]}. None when no task has a common example."""
    diffs = {}
    for task in ref:
        common = sorted(set(ref[task]) & set(other.get(task, {})))
        if common:
            diffs[task] = [other[task][x] - ref[task][x] for x in common]
    if not diffs:
        return None

    def avg(per_task):
        return 100 * sum(sum(d) / len(d) for d in per_task.values()) / len(per_task)

    rng = random.Random(seed)
    boots = sorted(avg({t: rng.choices(d, k=len(d)) for t, d in diffs.items()}) for _ in range(n_boot))
    flat = [x for d in diffs.values() for x in d]
    return {
        "diff": round(avg(diffs), 2),
        "ci95": [round(boots[int(0.025 * (n_boot - 1))], 2), round(boots[int(0.975 * (n_boot - 1))], 2)],
        "better": sum(x > 0 for x in flat),
        "same": sum(x == 0 for x in flat),
        "worse": sum(x < 0 for x in flat),
        "examples": len(flat),
        "tasks": len(diffs),
    }
