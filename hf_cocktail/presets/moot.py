"""Moot combinations of :class:`~hf_cocktail.CocktailConfig` fields: one rule, one table.

A field set to a value other than its default while another field makes it ineffective is refused, with a message
naming both fields and their values (``CocktailConfig(target_bits=3.0, uniform_bits=4)`` would otherwise plan every
chunk INT4, well over the 3.0-bit budget asked for, and say nothing). Each row of :data:`MOOT` is one such pair: the
field made moot, the field that makes it so, the condition on the config under which it does, and why.

Not in the table: where the scorer runs (``encoder``, ``encoder_batch_size``, ``encoder_device``) and the decode
``backend``. They choose resources, not what the cache stores, and one evaluation passes the same encoder to every
method (a uniform baseline included). ``group_size`` with ``uniform_bits=16``: the (empty) packed segments still
check it against the head dim, so a value that does not divide it is an error there, not moot. ``salient_tokens``
when every layer is in ``full_precision_layers`` depends on the model's layer count, so the cache refuses it at the
first prefill instead (``CocktailCache._check_layer_count``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Moot:
    """``field`` has no effect when ``when(config)`` holds (``cause`` names the field that makes it so).
    ``is_set(config)``: the field is set to something that would matter otherwise (default: not its default)."""

    field: str
    cause: str
    when: Callable[[Any], bool]
    why: str
    is_set: Callable[[Any], bool] | None = None


def _uniform(c: Any) -> bool:
    return c.uniform_bits is not None


def _all_full(c: Any) -> bool:
    return c.uniform_bits == 16


def _all_full_stored_full(c: Any) -> bool:
    return c.uniform_bits == 16 and c.full_part_bits == 16


_NO_SEARCH = "no chunk search runs: every context chunk gets uniform_bits"
_NOTHING_PACKED = "every context chunk stays at full precision, so nothing is packed"
_NOTHING_QUANTIZED = "every context chunk stays at full precision and full_part_bits=16 keeps the rest so"

MOOT: tuple[Moot, ...] = (
    *(Moot(f, "uniform_bits", _uniform, _NO_SEARCH) for f in ("target_bits", "alpha", "beta", "neighbors", "scorer")),
    Moot(
        "low_bits", "uniform_bits", _uniform, "no chunk is planned at the low precision: every chunk gets uniform_bits"
    ),
    *(
        Moot(f, "uniform_bits", _all_full, _NOTHING_PACKED)
        for f in ("value_bits", "scale_bits", "layer_bits", "salient_tokens", "sink_tokens")
    ),
    *(
        Moot(f, "uniform_bits", _all_full, _NOTHING_PACKED)
        for f in ("recent_tokens", "residual_tokens", "key_outlier_share")
    ),
    Moot("rotation", "uniform_bits", _all_full_stored_full, _NOTHING_QUANTIZED),
    Moot("scale_dtype", "uniform_bits", _all_full_stored_full, _NOTHING_QUANTIZED),
    Moot("center_keys", "uniform_bits", _all_full_stored_full, _NOTHING_QUANTIZED),
    Moot(
        "value_bits",
        "uniform_bits",
        lambda c: c.uniform_bits in (2, 3),
        "values never get more bits than their chunk, and every chunk has uniform_bits",
        is_set=lambda c: c.value_bits is not None and c.value_bits >= c.uniform_bits,
    ),
    Moot(
        "layer_bits",
        "uniform_bits",
        lambda c: c.uniform_bits == 2,
        "every chunk is INT2, below any layer's cap",
    ),
    Moot("alpha", "target_bits", lambda c: c.target_bits is not None, "the budget, not T_low, decides the low chunks"),
    Moot(
        "neighbors",
        "target_bits",
        lambda c: c.target_bits is not None,
        "neighbors applies to the alpha/beta mode; the budget decides every chunk",
    ),
    Moot("rotation_seed", "rotation", lambda c: c.rotation is None, "there is no rotation to seed"),
    Moot(
        "keep_context_copy",
        "scorer",
        lambda c: c.scorer == "attention" and c.uniform_bits is None,
        "requery() needs the new question's prefill attention over the old context, which scorer='attention' "
        "cannot have",
    ),
)


def check_moot(config: Any, table: tuple[Moot, ...] = MOOT) -> None:
    """Raise ``ValueError`` for the first row of ``table`` whose field is set while its cause makes it moot."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for row in table:
        value = getattr(config, row.field)
        if not row.when(config):
            continue
        if row.is_set(config) if row.is_set is not None else value != defaults[row.field]:
            raise ValueError(
                f"{row.field}={value!r} has no effect with {row.cause}={getattr(config, row.cause)!r} ({row.why}); "
                f"leave {row.field} at its default ({defaults[row.field]!r}) or change {row.cause}"
            )
