"""The settings calibration chooses from, each fitted to a byte target.

* **caps** (no chunk search): every context chunk at 4 bits, stored with the rotation (none, keys and values, keys
  only or values only) whose KL divergence is the lowest at the sensitivity's base widths, each Cocktail layer
  capped at the widths the layer solve picks at a mean code-bit budget (:func:`.solve.solve`), for every storage
  variant (the 8-bit full part or not, 0 / 1 / 2% salient tokens); the budget is the largest on a 0.1-bit grid whose
  bytes fit the target.
* **search** (the query-aware chunk search on top of the caps): the caps at a higher budget, chunks planned by
  ``target_bits`` (the ``scorer`` ranks them: the highest keep the caps, the rest ``low_bits``), ``target_bits`` the
  largest whose bytes fit.

The bytes are measured with the real cache (:func:`.validate.bytes_ratio`) on one held-out window. ``layer_bits``
has one entry per model layer; the layers the cache does not quantize (sliding-window layers, which keep the
model's own cache) get ``(4, 4)``, which nothing reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_cocktail.calibrate.solve import solve
from hf_cocktail.presets.config import CocktailConfig

STORAGE = {"rotation": "hadamard", "scale_bits": 8, "chunk_size": 32, "center_keys": True}
VARIANTS = tuple((fp, sal) for fp in (8, 16) for sal in (0.0, 0.01, 0.02))  # (full_part_bits, salient_tokens)
ROTATION_TAGS = {"hadamard": "had", "hadamard_keys": "hadk", "hadamard_values": "hadv"}  # as eval's method ids
BUDGETS = tuple(round(2.0 + 0.1 * i, 1) for i in range(21))  # mean code bits per K/V element, 2.0 .. 4.0


@dataclass
class Candidate:
    """A setting to validate: its name, config and how it was built (``budget``: the caps' mean code bits)."""

    name: str
    config: CocktailConfig
    kind: str  # "caps" | "search" | "baseline"
    budget: float | None = None
    fitted_ratio: float | None = None  # bytes ratio on the fitting window
    info: dict[str, Any] = field(default_factory=dict)


def storage(head_dim: int, rotation: str | None = "hadamard") -> dict[str, Any]:
    """The packed storage every calibrated setting shares (values in groups of 32 channels, or the head dim; the
    rotation calibration picks)."""
    return {**STORAGE, "rotation": rotation, "group_size": 32 if head_dim % 32 == 0 else head_dim}


def full_layer_bits(picks: Sequence[tuple[int, int]], cocktail_layers: Sequence[int], num_layers: int) -> list:
    """One ``(key_bits, value_bits)`` pair per model layer: ``picks`` on the Cocktail layers, ``(4, 4)`` elsewhere."""
    out = [[4, 4] for _ in range(num_layers)]
    for layer, pick in zip(cocktail_layers, picks):
        out[layer] = list(pick)
    return out


class CapsSpace:
    """Configs with the layer solve's caps at a budget, for one model's layers."""

    def __init__(self, deltas, cocktail_layers: Sequence[int], num_layers: int, head_dim: int, rotation: str | None):
        self.deltas, self.cocktail_layers, self.num_layers = deltas, list(cocktail_layers), num_layers
        self.head_dim, self.rotation = head_dim, rotation
        cheapest = sum(min(o[0] + o[1] for o in layer) for layer in deltas) / (2 * len(deltas))
        self.budgets = [b for b in BUDGETS if b >= cheapest - 1e-9]

    def layer_bits(self, budget: float) -> list:
        picks, _ = solve(self.deltas, budget)
        return full_layer_bits(picks, self.cocktail_layers, self.num_layers)

    def config(self, budget: float, full_part_bits: int, salient: float, **search: Any) -> CocktailConfig:
        kw: dict[str, Any] = {"uniform_bits": 4} if not search else {"uniform_bits": None, **search}
        return CocktailConfig(
            **storage(self.head_dim, self.rotation),
            **kw,
            layer_bits=tuple(map(tuple, self.layer_bits(budget))),
            full_part_bits=full_part_bits,
            salient_tokens=salient,
        )


def largest_fitting(values: Sequence[float], ratio_of: Callable[[float], float], target: float):
    """The largest of the sorted ``values`` whose ``ratio_of`` is <= ``target`` (bytes grow with the value), by
    bisection: ``(value, ratio)`` or ``None`` when even the smallest does not fit."""
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = ratio_of(values[mid])
        if r <= target:
            best, lo = (values[mid], r), mid + 1
        else:
            hi = mid - 1
    return best


def rotation_suffix(rotation: str | None) -> str:
    """A candidate name's ending for its storage rotation: ``""`` for none, ``"_had"`` / ``"_hadk"`` / ``"_hadv"``."""
    return "" if rotation is None else f"_{ROTATION_TAGS[rotation]}"


def caps_candidates(space: CapsSpace, ratio_of: Callable[[CocktailConfig], float], target: float) -> list[Candidate]:
    """Per storage variant, the caps at the largest budget that fits ``target`` (variants where none fits are left
    out); a rotated space's names end in its rotation's tag (``caps2.9_f16_sal1_hadv``)."""
    out = []
    suffix = rotation_suffix(space.rotation)
    for fp, sal in VARIANTS:
        found = largest_fitting(space.budgets, lambda b: ratio_of(space.config(b, fp, sal)), target)
        if found is not None:
            b, r = found
            name = f"caps{b:.1f}_f{fp}_sal{round(100 * sal)}{suffix}"
            info = {"full_part_bits": fp, "salient": sal, "rotation": space.rotation}
            out.append(Candidate(name, space.config(b, fp, sal), "caps", b, r, info))
    return out


def search_candidates(
    space: CapsSpace,
    best_caps: Candidate,
    ratio_of: Callable[[CocktailConfig], float],
    target: float,
    scorers: Sequence[str],
    encoder: str | None,
    low_bits: Sequence[int] = (2, 3),
    cap_step: float = 0.5,
) -> list[Candidate]:
    """The chunk search on top of ``best_caps``'s storage variant: the caps ``cap_step`` bits above its budget, chunks
    planned by ``target_bits`` with each scorer and low width, ``target_bits`` fitted to ``target`` (0.02 steps)."""
    assert best_caps.budget is not None
    fp, sal = best_caps.info["full_part_bits"], best_caps.info["salient"]
    cap_budget = min(max(space.budgets), round(best_caps.budget + cap_step, 1))
    out = []
    for scorer in scorers:
        for low in low_bits:
            extra: dict[str, Any] = {"scorer": scorer, "low_bits": low, "beta": 0.0}
            if scorer == "encoder" and encoder:
                extra["encoder"] = encoder
            capped = space.config(cap_budget, fp, sal)  # costs of a chunk at ``low`` / 4 bits under these caps
            lo, hi = capped.packed_bits_per_element(low), capped.packed_bits_per_element(4)
            grid = [lo + 0.02 * i for i in range(int((hi - lo) / 0.02) + 2)]  # from lo exactly: the config's minimum

            def cfg(t: float, extra=extra) -> CocktailConfig:
                return space.config(cap_budget, fp, sal, target_bits=t, **extra)

            found = largest_fitting(grid, lambda t: ratio_of(cfg(t)), target)
            if found is not None:
                t, r = found
                name = f"search_{scorer}_l{low}_caps{cap_budget:.1f}_t{t:.2f}_f{fp}_sal{round(100 * sal)}"
                name += rotation_suffix(space.rotation)
                info = {"full_part_bits": fp, "salient": sal, "scorer": scorer, "low_bits": low, "target_bits": t}
                info["rotation"] = space.rotation
                out.append(Candidate(name, cfg(t), "search", cap_budget, r, info))
    return out


def baselines(head_dim: int) -> list[Candidate]:
    """Uniform INT4 (every chunk, no rotation) and ``CocktailConfig.recommended()`` (with the storage's ``group_size``
    where 64 does not divide the head dim), measured beside the choice."""
    rec = CocktailConfig.recommended(**({} if head_dim % 64 == 0 else {"group_size": storage(head_dim)["group_size"]}))
    return [
        Candidate(
            "uniform INT4", CocktailConfig(uniform_bits=4, group_size=storage(head_dim)["group_size"]), "baseline"
        ),
        Candidate("recommended()", rec, "baseline"),
    ]
