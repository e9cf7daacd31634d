"""The named methods of the evaluation (``--methods``), and the ``preset`` method made from a saved config."""

from __future__ import annotations

import json
import os

from hf_cocktail import CocktailConfig

from ..cli import UsageError
from ..paths import LAYER_BITS_FILES
from .kinds import (
    BudgetMatchedMethod,
    CocktailMethod,
    DynamicMethod,
    KiviMethod,
    Method,
    QuantizedCacheMethod,
    ShuffledPlanMethod,
)
from .storage_variants import ROTATION_METHODS

METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        DynamicMethod("fp16", "DynamicCache, full precision (bytes counted at FP16)"),
        CocktailMethod("cocktail", "Cocktail: chunk search, FP16/INT4/INT2 context chunks (alpha .6, beta .1)"),
        CocktailMethod("int4", "every context chunk INT4 (CocktailCache uniform_bits=4)", {"uniform_bits": 4}),
        CocktailMethod("int2", "every context chunk INT2 (CocktailCache uniform_bits=2)", {"uniform_bits": 2}),
        ShuffledPlanMethod("nosearch", "ablation: Cocktail's precision counts, random chunk assignment"),
        # beyond the paper (issue 7): same retrieval encoder unless said otherwise
        BudgetMatchedMethod(
            "int4first",
            "budget mode at paper-Cocktail's bits for the example, INT4 first (no FP16 "
            "unless all INT4 fits): target_bits=paper's, beta=0",
            {"beta": 0.0},
        ),
        CocktailMethod("bm25", "paper thresholds, chunks scored by BM25 (no encoder)", {"scorer": "bm25"}),
        BudgetMatchedMethod(
            "bm25_int4first",
            "BM25 scores, budget at paper-Cocktail's bits, INT4 first",
            {"beta": 0.0, "scorer": "bm25"},
        ),
        CocktailMethod(
            "cocktail_nb1",
            "paper Cocktail + the chunks next to each FP16 chunk at FP16 (neighbors=1)",
            {"neighbors": 1},
        ),
        CocktailMethod("cocktail_a02", "paper search with alpha=0.2 (more INT4; more bytes)", {"alpha": 0.2}),
        CocktailMethod(
            "int2_nosink",
            "every context chunk INT2, no attention-sink protection (sink_tokens=0)",
            {"uniform_bits": 2, "sink_tokens": 0},
        ),
        CocktailMethod(
            "cocktail_nosink", "paper Cocktail without attention-sink protection (sink_tokens=0)", {"sink_tokens": 0}
        ),
        KiviMethod("kivi2", "KIVI-like 2-bit, K per-channel / V per-token, FP residual R=128", bits=2, residual=128),
        KiviMethod("kivi4", "KIVI-like 4-bit, K per-channel / V per-token, FP residual R=128", bits=4, residual=128),
        KiviMethod("kivi2_r32", "KIVI-like 2-bit, FP residual R=32", bits=2, residual=32),
        KiviMethod("kivi4_r32", "KIVI-like 4-bit, FP residual R=32", bits=4, residual=32),
        QuantizedCacheMethod("hqq2", "transformers QuantizedCache, hqq backend, 2 bits", bits=2, backend="hqq"),
        QuantizedCacheMethod("hqq4", "transformers QuantizedCache, hqq backend, 4 bits", bits=4, backend="hqq"),
        QuantizedCacheMethod(
            "quanto2", "transformers QuantizedCache, quanto backend, 2 bits", bits=2, backend="quanto"
        ),
        QuantizedCacheMethod(
            "quanto4", "transformers QuantizedCache, quanto backend, 4 bits", bits=4, backend="quanto"
        ),
    ]
}


METHODS.update({m.name: m for m in ROTATION_METHODS})  # beyond the paper's storage (eval.methods.storage_variants)


def layer_methods(path: str, tag: str = "") -> list[Method]:
    """``layers<b><tag>_had_s8``: every chunk planned at 4 bits, each layer capped by the ``layer_bits`` calibrated
    at ``b`` mean code bits (``path``: a ``layer_bits.json`` of eval/results/layer_calibration/; none when it is
    absent). The storage is the calibration's (Hadamard, 8-bit parameters)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        solved = json.load(f)
    storage = {k: solved["config"][k] for k in ("rotation", "scale_bits", "group_size", "chunk_size")}
    if (storage["rotation"], storage["scale_bits"]) != ("hadamard", 8):
        raise ValueError(f"{path}: layers*_had_s8 methods need a hadamard / scale_bits=8 calibration, got {storage}")
    return [
        CocktailMethod(
            f"layers{b}{tag}_had_s8",
            f"4-bit chunks, layer_bits calibrated at {b} mean code bits: {a['layer_bits']}",
            {"uniform_bits": 4, **storage, "layer_bits": a["layer_bits"]},
        )
        for b, a in solved["allocations"].items()
    ]


METHODS.update({m.name: m for tag, path in LAYER_BITS_FILES.items() for m in layer_methods(path, tag)})

# salient tokens (salient_tokens=f): per layer the fraction f of the packed context tokens that the question attends
# to most kept at full precision; ``<method>_sal<percent>``, each the twin of a method above
_SALIENT_TWINS = (
    "int4v3_had_s8",
    "recommended",
    "int3_had",
    "layers2.4_had_s8",
    "layers2.6_had_s8",
    "layers2.8_had_s8",
    "layers3r2_had_s8",
    "layers3.2r2_had_s8",
)


def _twins(names: tuple[str, ...], suffix: str, note: str, fields: dict) -> dict[str, Method]:
    """``<name><suffix>`` for each registered ``name``: its method with ``fields`` on top of its overrides."""
    return {
        f"{name}{suffix}": CocktailMethod(
            f"{name}{suffix}", f"{METHODS[name].description}; {note}", {**METHODS[name].overrides, **fields}
        )
        for name in names
        if name in METHODS  # the layers* methods exist only where their calibration file does
    }


for _pct in (1, 2, 3, 5):
    METHODS.update(
        _twins(_SALIENT_TWINS, f"_sal{_pct}", f"salient_tokens={_pct / 100:g}", {"salient_tokens": _pct / 100})
    )

# the full part (template, question, salient and generated tokens) as 8-bit codes (full_part_bits=8): ``<method>_f8``
_FULL8_TWINS = (
    "int4_had_s8",
    "recommended",
    "int4v3_had_s8_sal1",
    "layers3r2_had_s8",
    "layers2.8_had_s8_sal1",
    "layers3r2_had_s8_sal1",
    "layers3r2_had_s8_sal2",
    "layers3.2r2_had_s8_sal1",
    "layers3.2r2_had_s8_sal2",
)
_F8_NOTE = "full_part_bits=8 (the tokens outside the packed chunks as 8-bit codes)"
METHODS.update(_twins(_FULL8_TWINS, "_f8", _F8_NOTE, {"full_part_bits": 8}))

# the same storage with other random signs of the rotation (rotation_seed=1): how much a comparison moves by chance
_SEED_TWINS = (
    "int4_had_s8",
    "int4v3_had_s8",
    "layers3.2r2_had_s8",
    "layers3.2r2_had_s8_sal2",
    "layers3r2_had_s8_sal1",
    "layers3r2_had_s8_sal1_f8",
)
_SEED_NOTE = "rotation_seed=1 (other random signs of the Hadamard rotation)"
METHODS.update(_twins(_SEED_TWINS, "_seed1", _SEED_NOTE, {"rotation_seed": 1}))


def register_preset(name_or_path: str) -> Method:
    """Add the method ``preset``: a CocktailCache with ``CocktailConfig.from_pretrained(name_or_path)`` (its encoder
    is replaced by the evaluation's)."""
    try:
        cfg = CocktailConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--preset {name_or_path!r}: {e}") from e
    fields = cfg.to_dict()
    fields.pop("format_version", None)
    fields.pop("encoder", None)  # the evaluation's encoder (offline MiniLM unless --encoder)
    METHODS["preset"] = CocktailMethod("preset", f"CocktailConfig.from_pretrained({name_or_path!r})", fields)
    return METHODS["preset"]


def add_method_args(p, default: str) -> None:
    """The ``--methods`` and ``--preset`` arguments every evaluation script takes (``argparse`` parser ``p``)."""
    p.add_argument("--methods", default=default, help="comma-separated methods (eval/methods/registry.py)")
    p.add_argument(
        "--preset",
        default=None,
        help="a cocktail_config.json folder or Hub id (e.g. model_cards/gemma-3-270m): adds the method 'preset' "
        "(its encoder is replaced by --encoder / the offline MiniLM)",
    )


def methods_from_args(args) -> list[Method]:
    """The methods of parsed ``--methods`` / ``--preset`` (:func:`add_method_args`), the preset registered first."""
    if args.preset:
        register_preset(args.preset)
    return parse_methods(args.methods)


def parse_methods(spec: str) -> list[Method]:
    """``--methods``: comma-separated names from :data:`METHODS`, each once."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UsageError("--methods is empty")
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise UsageError(f"unknown method(s) {bad}; known: {sorted(METHODS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods lists a method twice: {names}")
    return [METHODS[n] for n in names]
