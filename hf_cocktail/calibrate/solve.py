"""The allocation: per layer one ``(key_bits, value_bits)`` option, the least summed divergence within a bit budget.

Each option's cost is measured alone against the base setting (every layer at the base pair): ``delta[l][(k, v)]``
is the mean KL divergence with layer ``l`` at ``(k, v)`` minus the base's (keys' and values' deltas add up: their
sum over layers matched the all-layer setting on SmolLM2, docs/experiments.md). The total is minimised exactly by
dynamic programming over the layers and the summed code bits.
"""

from __future__ import annotations

import statistics

OPTIONS = tuple((k, v) for k in (4, 3, 2) for v in (4, 3, 2) if v <= k)  # every (key_bits, value_bits) a layer takes


def option_delta(key_delta: dict[int, float], value_delta: dict[int, float], option: tuple[int, int]) -> float:
    """A layer's estimated delta at ``option``: its keys' delta at ``option[0]`` plus its values' at ``option[1]``."""
    return key_delta[option[0]] + value_delta[option[1]]


def solve(deltas: list[dict[tuple[int, int], float]], mean_code_bits: float) -> tuple[list[tuple[int, int]], float]:
    """The options (one per layer, from each layer's keys in ``deltas[l]``) with the least summed delta whose codes
    average at most ``mean_code_bits`` per K/V element (``(k + v) / 2`` per layer, averaged over layers).

    Returns ``(options, summed delta)``; raises ValueError when even the cheapest options exceed the budget."""
    L = len(deltas)
    budget = int(round(2 * L * mean_code_bits * 1e6)) // 10**6  # summed k + v over layers, floored
    best: dict[int, tuple[float, list]] = {0: (0.0, [])}  # summed bits -> (summed delta, options so far)
    for layer in deltas:
        nxt: dict[int, tuple[float, list]] = {}
        for used, (total, picks) in best.items():
            for opt, d in layer.items():
                u = used + opt[0] + opt[1]
                if u <= budget and (u not in nxt or total + d < nxt[u][0]):
                    nxt[u] = (total + d, picks + [opt])
        best = nxt
    if not best:
        cheapest = sum(min(o[0] + o[1] for o in layer) for layer in deltas) / (2 * L)
        raise ValueError(f"mean_code_bits={mean_code_bits!r} is below the cheapest allocation ({cheapest:g} bits)")
    total, picks = min(best.values(), key=lambda t: t[0])
    return picks, total


def mean_deltas(records: list[dict], side: str) -> dict[int, list[float | None]]:
    """``side`` ("key_deltas" / "value_deltas"): per measured width, the per-layer deltas averaged over prompts
    (``None`` where that layer did not measure it)."""
    out = {}
    for w in records[0][side]:
        per_layer = zip(*(r[side][w] for r in records))
        out[int(w)] = [None if layer[0] is None else statistics.fmean(layer) for layer in per_layer]
    return out


def _measured(deltas: dict[int, list[float | None]], layer: int) -> dict[int, float]:
    """``{width: delta}`` of the widths ``layer`` measured."""
    return {b: d for b, per_layer in deltas.items() if (d := per_layer[layer]) is not None}


def layer_deltas(records: list[dict], base: list[tuple[int, ...]]) -> list[dict[tuple[int, int], float]]:
    """Per layer, every option's estimated delta from the measured widths (means over the prompts; the layer's base
    widths cost 0); options needing a width the layer did not measure are left out."""
    keys, values = mean_deltas(records, "key_deltas"), mean_deltas(records, "value_deltas")
    L = len(next(iter(keys.values())))
    base = base * L if len(base) == 1 else base
    out = []
    for layer in range(L):
        kd = {base[layer][0]: 0.0, **_measured(keys, layer)}
        vd = {base[layer][1]: 0.0, **_measured(values, layer)}
        out.append({o: option_delta(kd, vd, o) for o in OPTIONS if o[0] in kd and o[1] in vd})
    return out
