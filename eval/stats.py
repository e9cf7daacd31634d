"""Statistics shared by the reports: a mean with a 95% bootstrap interval (cases resampled with replacement within
strata: sources, prompt lengths, tasks, whose sizes are kept), paired differences, means of incomplete values."""

from __future__ import annotations

import random


def bootstrap_mean(values_by_stratum: dict, n_boot: int = 2000, seed: int = 0) -> tuple:
    """Mean over all values and a 95% percentile interval, values resampled with replacement within each stratum
    (the stratum sizes are kept), ``n_boot`` times; ``(None, None, None)`` when there are no values."""
    flat = [v for vs in values_by_stratum.values() for v in vs]
    if not flat:
        return None, None, None
    mean = sum(flat) / len(flat)
    rng = random.Random(seed)
    groups = [vs for vs in values_by_stratum.values() if vs]
    boots = sorted(sum(sum(rng.choices(vs, k=len(vs))) for vs in groups) / len(flat) for _ in range(n_boot))
    return mean, boots[int(0.025 * (n_boot - 1))], boots[int(0.975 * (n_boot - 1))]


def paired_stats(diffs_by_stratum: dict, n_boot: int = 2000) -> dict:
    """Paired differences (method - reference, per case, by stratum): their mean ``diff`` with its interval
    ``diff_lo`` / ``diff_hi`` (:func:`bootstrap_mean`), how many there are (``n``), below 0 (``lower``) and above 0
    (``higher``)."""
    flat = [d for ds in diffs_by_stratum.values() for d in ds]
    diff, lo, hi = bootstrap_mean(diffs_by_stratum, n_boot)
    lower, higher = sum(d < 0 for d in flat), sum(d > 0 for d in flat)
    return {"n": len(flat), "diff": diff, "diff_lo": lo, "diff_hi": hi, "lower": lower, "higher": higher}


def mean_of_all(xs: list) -> float | None:
    """The mean, or None when there is no value or one is missing (records written before the field existed)."""
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


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
