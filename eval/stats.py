"""Bootstrap statistics shared by the KLD and RULER reports: a mean with a 95% percentile interval, cases
resampled with replacement within strata (sources, prompt lengths) whose sizes are kept."""

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
