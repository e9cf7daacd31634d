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


def _recommended_overrides() -> dict:
    """The fields where ``CocktailConfig.recommended()`` differs from the paper's ``CocktailConfig()`` (the encoder
    stays the evaluation's)."""
    rec, paper = CocktailConfig.recommended().to_dict(), CocktailConfig().to_dict()
    return {k: v for k, v in rec.items() if k not in ("encoder", "format_version") and v != paper.get(k)}


HAD = {"rotation": "hadamard"}
# rotated storage and budget mode (issue 11: told apart by the KL divergence of eval/kld); each a CocktailCache
_ROTATION_METHODS: list[Method] = [
    CocktailMethod(
        "int4_had", "every context chunk INT4, Hadamard-rotated keys and values", {"uniform_bits": 4, **HAD}
    ),
    CocktailMethod(
        "int2_had", "every context chunk INT2, Hadamard-rotated keys and values", {"uniform_bits": 2, **HAD}
    ),
    CocktailMethod("cocktail_had", "paper Cocktail, Hadamard-rotated keys and values", dict(HAD)),
    CocktailMethod("cocktail_hadk", "paper Cocktail, Hadamard-rotated keys only", {"rotation": "hadamard_keys"}),
    CocktailMethod("cocktail_hadv", "paper Cocktail, Hadamard-rotated values only", {"rotation": "hadamard_values"}),
    *[
        CocktailMethod(
            f"budget{b:g}_had",
            f"budget mode target_bits={b:g} (FP16 above T_high, then INT4 by rank, the rest INT2), Hadamard-rotated",
            {"target_bits": b, **HAD},
        )
        for b in (3.3, 3.6, 3.8)
    ],
    CocktailMethod(
        "int2_had_g64",
        "every context chunk INT2, Hadamard-rotated, values in groups of 64 channels (half the value scales/zeros)",
        {"uniform_bits": 2, "group_size": 64, **HAD},
    ),
    CocktailMethod(
        "int4_had_g64",
        "every context chunk INT4, Hadamard-rotated, values in groups of 64 channels",
        {"uniform_bits": 4, "group_size": 64, **HAD},
    ),
    *[
        CocktailMethod(
            f"budget{b:g}_had_g64",
            f"budget mode target_bits={b:g}, Hadamard-rotated, values in groups of "
            "64 channels (the saved scale bits buy INT4 chunks)",
            {"target_bits": b, "group_size": 64, **HAD},
        )
        for b in (3.3, 3.6)
    ],
]
L3 = {"low_bits": 3, **HAD}
# INT3 as the low precision (2-bit + 1-bit planes): uniform, the paper's thresholds, and budgets
_ROTATION_METHODS += [
    CocktailMethod("int3", "every context chunk INT3 (uniform_bits=3)", {"uniform_bits": 3}),
    CocktailMethod("int3_had", "every context chunk INT3, Hadamard-rotated", {"uniform_bits": 3, **HAD}),
    CocktailMethod(
        "int3_had_g64",
        "every context chunk INT3, Hadamard-rotated, values in groups of 64 channels",
        {"uniform_bits": 3, "group_size": 64, **HAD},
    ),
    CocktailMethod("cocktail_l3_had", "paper thresholds with INT3 for INT2 (low_bits=3), Hadamard-rotated", L3),
    *[
        CocktailMethod(
            f"budget{b:g}_l3_had_g64",
            f"budget mode target_bits={b:g}: FP16 above T_high, then INT4 by rank, the rest INT3; "
            "Hadamard-rotated, values in groups of 64 channels",
            {"target_bits": b, "group_size": 64, **L3},
        )
        for b in (3.8, 4.0)
    ],
    CocktailMethod(
        "budget4.2_l3_had",
        "budget mode target_bits=4.2, the rest INT3, Hadamard-rotated",
        {"target_bits": 4.2, **L3},
    ),
]
C64 = {"chunk_size": 64, "group_size": 64, **L3}
# chunks of 64 tokens (the key group along tokens: half the key scales/zeros; INT3 then costs 3.5 bits per element)
_ROTATION_METHODS += [
    CocktailMethod(
        "int3_had_c64_g64",
        "every context chunk INT3, Hadamard-rotated, chunks of 64 tokens, value groups of 64",
        {"uniform_bits": 3, "chunk_size": 64, "group_size": 64, **HAD},
    ),
    *[
        CocktailMethod(
            f"budget{b:g}_l3_had_c64_g64",
            f"budget mode target_bits={b:g}, the rest INT3; Hadamard-rotated, chunks of 64 tokens, value groups of 64",
            {"target_bits": b, **C64},
        )
        for b in (3.6, 3.7, 3.8)
    ],
]
V3 = {"value_bits": 3}
# values at fewer code bits than keys (value_bits): keys decide which tokens attention reads and need the bits more
_ROTATION_METHODS += [
    CocktailMethod(
        "int4v3_had",
        "every context chunk INT4 keys + INT3 values (value_bits=3), Hadamard-rotated",
        {"uniform_bits": 4, **V3, **HAD},
    ),
    CocktailMethod(
        "int4v3_had_g64",
        "every context chunk INT4 keys + INT3 values, Hadamard-rotated, values in groups of 64 channels",
        {"uniform_bits": 4, "group_size": 64, **V3, **HAD},
    ),
    CocktailMethod(
        "int4v2_had",
        "every context chunk INT4 keys + INT2 values (value_bits=2), Hadamard-rotated",
        {"uniform_bits": 4, "value_bits": 2, **HAD},
    ),
    CocktailMethod(
        "cocktail_l3v3_had",
        "paper thresholds: FP16 / INT4 keys + INT3 values / INT3, Hadamard-rotated",
        {**L3, **V3},
    ),
    *[
        CocktailMethod(
            f"budget{b:g}_l3v3_had",
            f"budget mode target_bits={b:g}: FP16 above T_high, then INT4 keys + INT3 values by rank, the rest "
            "INT3; Hadamard-rotated",
            {"target_bits": b, **L3, **V3},
        )
        for b in (4.2, 4.4, 4.6)
    ],
    CocktailMethod(
        "budget4_l3v3_had_g64",
        "budget mode target_bits=4: FP16 above T_high, then INT4 keys + INT3 values by rank, the rest INT3; "
        "Hadamard-rotated, values in groups of 64 channels",
        {"target_bits": 4.0, "group_size": 64, **L3, **V3},
    ),
]
# query-aware 4-bit keys without an FP16 tier (beta=0: T_high = s_max, no chunk above it): the budget buys 4-bit keys
# for the best-ranked chunks, the rest get 3-bit keys; values 3 bits everywhere. Each with its shuffled twin (the same
# precision counts on random chunks), which tells whether the search itself helps.
_INT4FIRST_V3 = {"beta": 0.0, "group_size": 64, **L3, **V3}


def _int4first_v3(budget: float) -> list[Method]:
    """``int4first{budget}_v3_had_g64`` and its ``_shuffled`` twin."""
    name, fields = f"int4first{budget:g}_v3_had_g64", {"target_bits": budget, **_INT4FIRST_V3}
    return [
        CocktailMethod(
            name,
            f"budget mode target_bits={budget:g} with beta=0 (no FP16 chunk): 4-bit keys for the best-ranked chunks, "
            "the rest 3-bit keys; 3-bit values, Hadamard-rotated, value groups of 64",
            fields,
        ),
        ShuffledPlanMethod(f"{name}_shuffled", f"ablation of {name}: its precision counts on random chunks", fields),
    ]


_ROTATION_METHODS += [m for b in (3.8, 3.9, 4.0, 4.1) for m in _int4first_v3(b)]
# the same with 64-token chunks (keys' scales and zeros over 64 tokens: half their bytes)
_ROTATION_METHODS.append(
    CocktailMethod(
        "int4v3_had_c64_g64",
        "every context chunk 4-bit keys + 3-bit values, Hadamard-rotated, 64-token chunks, value groups of 64",
        {"uniform_bits": 4, "chunk_size": 64, "group_size": 64, **V3, **HAD},
    )
)
_ROTATION_METHODS += [
    CocktailMethod(
        f"int4first{b:g}_v3_had_c64_g64",
        f"as int4first*_v3_had_g64 with 64-token chunks, target_bits={b:g}",
        {"target_bits": b, **_INT4FIRST_V3, "chunk_size": 64},
    )
    for b in (3.75, 3.85)
]
# 8-bit scales and zeros (scale_bits=8: codes on three numbers per chunk and head), each the twin of a method above
S8 = {"scale_bits": 8}
_ROTATION_METHODS += [
    CocktailMethod(
        "int4_had_s8", "uniform INT4, Hadamard-rotated, 8-bit scales and zeros", {"uniform_bits": 4, **HAD, **S8}
    ),
    CocktailMethod("int4v3_had_s8", "int4v3_had with 8-bit scales and zeros", {"uniform_bits": 4, **V3, **HAD, **S8}),
    CocktailMethod(
        "int4v3_had_g64_s8",
        "the recommended setting (int4v3_had_g64) with 8-bit scales and zeros",
        {"uniform_bits": 4, "group_size": 64, **V3, **HAD, **S8},
    ),
    CocktailMethod(
        "int4v3_had_c64_g64_s8",
        "int4v3_had_c64_g64 with 8-bit scales and zeros",
        {"uniform_bits": 4, "chunk_size": 64, "group_size": 64, **V3, **HAD, **S8},
    ),
    CocktailMethod(
        "int4first4_v3_had_g64_s8",
        "int4first4_v3_had_g64 with 8-bit scales and zeros (the budget counts 8-bit parameters)",
        {"target_bits": 4.0, **_INT4FIRST_V3, **S8},
    ),
]
_RECOMMENDED = _recommended_overrides()
_ROTATION_METHODS.append(CocktailMethod("recommended", f"CocktailConfig.recommended(): {_RECOMMENDED}", _RECOMMENDED))
METHODS.update({m.name: m for m in _ROTATION_METHODS})


def layer_methods(path: str, tag: str = "") -> list[Method]:
    """``layers<b><tag>_had_s8``: every chunk planned at 4 bits, each layer capped by the ``layer_bits`` that
    ``eval.layers`` chose at ``b`` mean code bits (``path``: its ``layer_bits.json``; none when it is absent). The
    storage is the calibration's (Hadamard, 8-bit parameters); rerunning the calibration into that folder changes
    these methods, so their old records must then be deleted."""
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
            f"4-bit chunks, layer_bits of eval.layers at {b} mean code bits: {a['layer_bits']}",
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
