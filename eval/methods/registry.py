"""The named methods of the evaluation (``--methods``), and the ``preset`` method made from a saved config.

The registry holds the methods the documentation shows and its commands name: the paper's Cocktail and its
baselines, rotated uniform storage, ``recommended()`` and the settings that led to it, the per-layer widths of
eval/results/layer_calibration/. The many variants the studies measured left it (issue 47; the lab log gives their
conclusions and the commit); their configs stay in the ``run_info.json`` of the folders that measured them, their
records in ``records.jsonl``, and ``--report-only`` reads any id recorded there."""

from __future__ import annotations

import json
import os
import re

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


def _recommended_overrides() -> dict:
    """The fields where ``CocktailConfig.recommended()`` differs from the paper's ``CocktailConfig()`` (the encoder
    stays the evaluation's)."""
    rec, paper = CocktailConfig.recommended().to_dict(), CocktailConfig().to_dict()
    return {k: v for k, v in rec.items() if k not in ("encoder", "format_version") and v != paper.get(k)}


HAD = {"rotation": "hadamard"}
# beta=0 (no FP16 chunk): the budget buys 4-bit keys for the best-ranked chunks, 3-bit keys for the rest
INT4FIRST_V3 = {"target_bits": 4.0, "beta": 0.0, "group_size": 64, "low_bits": 3, "value_bits": 3, **HAD}
REC = _recommended_overrides()
REC_K4V3 = {"uniform_bits": 4, "value_bits": 3, "group_size": 64, **HAD}  # the records' "recommended" until 2026-12-07
METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        DynamicMethod("fp16", "DynamicCache, full precision (bytes counted at FP16)"),
        CocktailMethod("cocktail", "Cocktail: chunk search, FP16/INT4/INT2 context chunks (alpha .6, beta .1)"),
        CocktailMethod("int4", "every context chunk INT4 (CocktailCache uniform_bits=4)", {"uniform_bits": 4}),
        CocktailMethod("int2", "every context chunk INT2 (CocktailCache uniform_bits=2)", {"uniform_bits": 2}),
        ShuffledPlanMethod("nosearch", "ablation: Cocktail's precision counts, random chunk assignment"),
        BudgetMatchedMethod(
            "int4first",
            "budget mode at paper-Cocktail's bits for the example, INT4 first (no FP16 "
            "unless all INT4 fits): target_bits=paper's, beta=0",
            {"beta": 0.0},
        ),
        CocktailMethod("bm25", "paper thresholds, chunks scored by BM25 (no encoder)", {"scorer": "bm25"}),
        KiviMethod("kivi2", "KIVI-like 2-bit, K per-channel / V per-token, FP residual R=128", bits=2, residual=128),
        QuantizedCacheMethod("hqq2", "transformers QuantizedCache, hqq backend, 2 bits", bits=2, backend="hqq"),
        QuantizedCacheMethod("hqq4", "transformers QuantizedCache, hqq backend, 4 bits", bits=4, backend="hqq"),
        QuantizedCacheMethod(
            "quanto2", "transformers QuantizedCache, quanto backend, 2 bits", bits=2, backend="quanto"
        ),
        QuantizedCacheMethod(
            "quanto4", "transformers QuantizedCache, quanto backend, 4 bits", bits=4, backend="quanto"
        ),
        CocktailMethod("int4_had", "every context chunk INT4, Hadamard-rotated", {"uniform_bits": 4, **HAD}),
        CocktailMethod("int2_had", "every context chunk INT2, Hadamard-rotated", {"uniform_bits": 2, **HAD}),
        CocktailMethod(
            "int4v3_had_g64",
            "every context chunk INT4 keys + INT3 values, Hadamard-rotated, values in groups of 64 channels",
            {"uniform_bits": 4, "value_bits": 3, "group_size": 64, **HAD},
        ),
        CocktailMethod(
            "int4v3_had_c64_g64",
            "every context chunk 4-bit keys + 3-bit values, Hadamard-rotated, 64-token chunks, value groups of 64",
            {"uniform_bits": 4, "value_bits": 3, "chunk_size": 64, "group_size": 64, **HAD},
        ),
        CocktailMethod(
            "int4v3_had_s8",
            "every context chunk INT4 keys + INT3 values, Hadamard-rotated, 8-bit scales and zeros",
            {"uniform_bits": 4, "value_bits": 3, "scale_bits": 8, **HAD},
        ),
        CocktailMethod(
            "int4first4_v3_had_g64",
            "budget mode target_bits=4 with beta=0 (no FP16 chunk): 4-bit keys for the best-ranked chunks, the rest "
            "3-bit keys; 3-bit values, Hadamard-rotated, value groups of 64",
            INT4FIRST_V3,
        ),
        ShuffledPlanMethod(
            "int4first4_v3_had_g64_shuffled",
            "ablation of int4first4_v3_had_g64: its precision counts on random chunks",
            INT4FIRST_V3,
        ),
        CocktailMethod("recommended", f"CocktailConfig.recommended(): {REC}", REC),
        CocktailMethod(
            "recommended_k4v3",
            "CocktailConfig.recommended() before 2026-12-07: rotated, 4-bit keys, 3-bit values, value groups of 64",
            REC_K4V3,
        ),
    ]
}


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


def _twin(name: str, suffix: str, note: str, fields: dict) -> dict[str, Method]:
    """``<name><suffix>``: the registered ``name``'s method with ``fields`` on top of its overrides (none where
    ``name`` is absent: the layers* methods exist only where their calibration file does)."""
    if name not in METHODS:
        return {}
    base = METHODS[name]
    return {name + suffix: CocktailMethod(name + suffix, f"{base.description}; {note}", {**base.overrides, **fields})}


# salient tokens (salient_tokens=f: per layer the fraction f of the packed context tokens that the question attends
# to most, kept at full precision) and the full part as 8-bit codes (full_part_bits=8); the first SmolLM2 preset is
# layers3r2_had_s8_sal1_f8
for _name, _pct in (("int4v3_had_s8", 1), ("int4v3_had_s8", 3), ("layers3r2_had_s8", 1)):
    METHODS.update(_twin(_name, f"_sal{_pct}", f"salient_tokens={_pct / 100:g}", {"salient_tokens": _pct / 100}))
METHODS.update(_twin("layers3r2_had_s8_sal1", "_f8", "full_part_bits=8 (the tokens outside the packed chunks as "
                     "8-bit codes)", {"full_part_bits": 8}))  # fmt: skip

# outlier key channels at 8 bits (key_outlier_share, issue 46): 1/16 and 1/8 of each head's key channels, chosen per
# layer and head from the prefill's own rotated keys
for _share in (16, 8):
    _id = f"recommended_kout{_share}"
    METHODS[_id] = CocktailMethod(_id, f"recommended_k4v3 with 1/{_share} of key channels at 8 bits",
                                  {**REC_K4V3, "key_outlier_share": 1 / _share})  # fmt: skip
# the same storage unrotated, without and with outlier channels (chosen in the model's own basis, as KIVI / KVQuant)
_INT4V3_G64 = {"uniform_bits": 4, "value_bits": 3, "group_size": 64}
METHODS["int4v3_g64"] = CocktailMethod("int4v3_g64", "uniform INT4, 3-bit values, groups of 64, unrotated", _INT4V3_G64)
METHODS.update(_twin("int4v3_g64", "_kout8", "1/8 of key channels at 8 bits", {"key_outlier_share": 1 / 8}))

# 4-bit keys and values with 8-bit scales/zeros, value groups of 64 and an 8-bit full part (issue 46: a
# no-calibration setting at <= 0.28x of FP16's bytes at 8K tokens), per storage rotation
_INT4_S8_F8 = {"uniform_bits": 4, "scale_bits": 8, "group_size": 64, "full_part_bits": 8}
for _rot, _tag in ((None, ""), ("hadamard", "_had"), ("hadamard_values", "_hadv")):
    _id = f"int4{_tag}_s8_g64_f8"
    METHODS[_id] = CocktailMethod(_id, f"4-bit keys/values, rotation {_rot}, 8-bit params, G=64, 8-bit full part",
                                  {**_INT4_S8_F8, "rotation": _rot})  # fmt: skip
# ... and uniform INT4 with one of those changes at a time (which of them costs fidelity)
for _suffix, _fields in (("_s8", {"scale_bits": 8}), ("_g64", {"group_size": 64}), ("_f8", {"full_part_bits": 8})):
    METHODS.update(_twin("int4", _suffix, str(_fields), _fields))
METHODS.update(_twin("int4_had", "_s8_g64", "8-bit params, G=64", {"scale_bits": 8, "group_size": 64}))
# rotation="auto": each layer's keys rotated or not by the prompt's own queries (planning/key_rotation.py)
METHODS["recommended_auto"] = CocktailMethod("recommended_auto", "recommended_k4v3 with rotation='auto'",
                                             {**REC_K4V3, "rotation": "auto"})  # fmt: skip
METHODS["int4_auto_s8_g64"] = CocktailMethod(
    "int4_auto_s8_g64",
    "4-bit keys/values, rotation auto (keys rotated per layer by the prompt's queries), 8-bit params, G=64",
    {**_INT4_S8_F8, "full_part_bits": 16, "rotation": "auto"},
)

# recommended() with the full part (template, question, sink tokens) as 8-bit codes (issue 46: <= 0.28x at 8K). A
# 64-token residual window instead (recommended_r64, recorded in fidelity_8k/) changed nothing there: under
# prepare_inputs the question is the full part whatever the window
METHODS.update(_twin("recommended", "_f8", str({"full_part_bits": 8}), {"full_part_bits": 8}))


def _preset_id_and_path(spec: str) -> tuple[str, str]:
    """``[ID=]FOLDER_OR_HUB_ID`` -> ``(ID, FOLDER_OR_HUB_ID)``, ``ID`` ``preset`` when none is given."""
    name, sep, name_or_path = spec.partition("=")
    if not sep:
        return "preset", spec
    if not re.fullmatch(r"preset\w*", name):
        raise UsageError(
            f"--preset {spec!r}: the id before '=' must start with 'preset' (e.g. preset_020), got {name!r}"
        )
    return name, name_or_path


def register_preset(spec: str) -> Method:
    """Add a preset method from ``spec``, ``[ID=]FOLDER_OR_HUB_ID``: a CocktailCache with
    ``CocktailConfig.from_pretrained(FOLDER_OR_HUB_ID)`` (its encoder replaced by the evaluation's), named ``ID``
    (``preset`` when none is given; an id must start with ``preset``, e.g. ``preset_020``, so it never replaces a
    method of the registry)."""
    name, name_or_path = _preset_id_and_path(spec)
    try:
        cfg = CocktailConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--preset {spec!r}: {e}") from e
    fields = cfg.to_dict()
    fields.pop("format_version", None)
    fields.pop("encoder", None)  # the evaluation's encoder (offline MiniLM unless --encoder)
    METHODS[name] = CocktailMethod(name, f"CocktailConfig.from_pretrained({name_or_path!r})", fields)
    return METHODS[name]


PRESET_HELP = (
    "[ID=]FOLDER: a cocktail_config.json folder or Hub id (e.g. model_cards/gemma-3-270m), added as the method ID "
    "('preset' when no ID is given; an ID starts with 'preset', e.g. preset_020=eval/results/presets_020/gemma-3-270m; "
    "its encoder is replaced by --encoder / the offline MiniLM); may be given more than once"
)


def add_method_args(p, default: str) -> None:
    """The ``--methods`` and ``--preset`` arguments every evaluation script takes (``argparse`` parser ``p``)."""
    p.add_argument("--methods", default=default, help="comma-separated methods (eval/methods/registry.py)")
    p.add_argument("--preset", action="append", default=None, help=PRESET_HELP)


def register_presets(specs: list[str] | None) -> None:
    """Register every ``--preset`` (:func:`register_preset`); an id given twice is refused."""
    names = [_preset_id_and_path(spec)[0] for spec in specs or []]
    if len(set(names)) != len(names):
        raise UsageError(f"--preset gives a method id twice: {names}")
    for spec in specs or []:
        register_preset(spec)


def methods_from_args(args) -> list[Method]:
    """The methods of parsed ``--methods`` / ``--preset`` (:func:`add_method_args`), the presets registered first;
    with ``--report-only`` an id no longer registered stands for the records it left in the results folder."""
    register_presets(args.preset)
    return parse_methods(args.methods, recorded=getattr(args, "report_only", False))


def parse_methods(spec: str, recorded: bool = False) -> list[Method]:
    """``--methods``: comma-separated names from :data:`METHODS`, each once; ``recorded``: other names too, as
    methods that only name records (they make no cache)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UsageError("--methods is empty")
    bad = [n for n in names if n not in METHODS]
    if bad and not recorded:
        raise UsageError(f"unknown method(s) {bad}; known: {sorted(METHODS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods lists a method twice: {names}")
    return [METHODS.get(n) or Method(n, "a method of earlier runs, read from their records") for n in names]
