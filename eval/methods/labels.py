"""Readable labels for the evaluation's method ids (``layers3r2_had_s8_sal1_f8`` -> "per-layer widths at 3.0 bits
(round 2), rotated, 8-bit scales, 1% salient tokens, 8-bit full part"), the benchmarks' ``NAME:BACKEND`` names and
the candidates of ``hf_cocktail.calibrate`` (``caps2.4_f8_sal1``). The id stays the key of every record and file;
reports (:mod:`eval.reporting`) and generated docs show :func:`label` beside it."""

from __future__ import annotations

import re

NAMED = {
    "fp16": "FP16 (DynamicCache)",
    "cocktail": "paper Cocktail (FP16/INT4/INT2 by relevance)",
    "recommended": "recommended() (4-bit keys and values, rotation auto, 8-bit params, centred keys)",
    "int4_auto_s8_g64": "recommended() without centred keys (its setting until the centring, 2026-12-07)",
    "recommended_f8": "recommended(), 8-bit full part",
    "recommended_r64": "recommended(), 64-token residual window (the same bytes under prepare_inputs)",
    "preset_020": "preset calibrated at --target-bytes 0.20 (eval/results/presets_020/, not shipped)",
    "recommended_k4v3": "recommended() before 2026-12-07 (rotated, 4-bit keys, 3-bit values)",
    "recommended_k4v3_f8": "recommended() before 2026-12-07, 8-bit full part",
    "recommended_k4v3_unpacked": "recommended() before 2026-12-07, generated tokens never packed",
    "recommended_kout16": "recommended() before 2026-12-07, 1/16 of key channels at 8 bits",
    "recommended_kout8": "recommended() before 2026-12-07, 1/8 of key channels at 8 bits",
    "recommended_auto": "recommended() before 2026-12-07 with rotation auto (keys rotated per layer by the queries)",
    "preset": "calibrated preset",
    "nosearch": "paper's precision counts on random chunks",
    "int4first": "budget at paper's bytes, INT4 first",
    "bm25": "paper Cocktail, BM25 scores",
    "bm25_int4first": "BM25 scores, budget at paper's bytes, INT4 first",
}
MODIFIERS = {
    "had": "rotated",
    "hadk": "keys rotated",
    "hadv": "values rotated",
    "auto": "values rotated, keys per layer by the queries",
    "unpacked": "generated tokens never packed",
    "s8": "8-bit scales",
    "f8": "8-bit full part",
    "lloyd": "Lloyd codebook (removed)",  # codebook="lloyd": ids of results measured before its removal
    "nb1": "FP16 neighbours",
    "a02": "alpha 0.2",
    "shuffled": "random chunks",
    "l3": "INT3 low tier",
    "l3v3": "INT3 low tier, 3-bit values",
    "v3": "3-bit values",
}
BACKENDS = {"torch": "PyTorch", "auto": "automatic", "cpu": "fused CPU"}  # eval/benchmarks/rounds.py
_BASES = [
    (r"int(\d)v(\d)", lambda m: f"uniform INT{m[1]}, {m[2]}-bit values"),
    (r"int(\d)", lambda m: f"uniform INT{m[1]}"),
    (r"int4first([\d.]+)", lambda m: f"INT4 first at {m[1]} bits"),
    (r"budget([\d.]+)", lambda m: f"chunk search at {m[1]} bits"),
    (r"layers([\d.]+)(?:r(\d))?", lambda m: f"per-layer widths at {m[1]} bits" + (f" (round {m[2]})" if m[2] else "")),
    (r"kivi(\d)", lambda m: f"KIVI-like {m[1]}-bit"),
    (r"(hqq|quanto)(\d)", lambda m: f"QuantizedCache {m[1]} {m[2]}-bit"),
    (r"caps([\d.]+)", lambda m: f"per-layer caps at {m[1]} bits"),  # hf_cocktail.calibrate's candidates
    (r"search", lambda m: "chunk search"),
]
_SIZED = [
    (r"g(\d+)", lambda m: f"values in groups of {m[1]}"),
    (r"c(\d+)", lambda m: f"{m[1]}-token chunks"),
    (r"sal(\d+)", lambda m: f"{m[1]}% salient tokens"),
    (r"kout(\d+)", lambda m: f"1/{m[1]} of key channels at 8 bits"),
    (r"seed(\d+)", lambda m: f"rotation seed {m[1]}"),
    (r"caps([\d.]+)", lambda m: f"per-layer caps at {m[1]} bits"),
    (r"t([\d.]+)", lambda m: f"target {m[1]} bits"),
    (r"f(\d+)", lambda m: f"{m[1]}-bit full part"),
]


def _match(patterns, token: str) -> str | None:
    for pattern, make in patterns:
        m = re.fullmatch(pattern, token)
        if m:
            return make(m)
    return None


def label(method_id: str) -> str:
    """A reader's name for ``method_id``; an id it cannot read is returned as it is."""
    base, sep, backend = method_id.partition(":")
    if sep:  # a benchmark's Cocktail method on a named backend (eval/benchmarks/rounds.py)
        name = label(base)
        return method_id if name == base else f"{name}, {BACKENDS.get(backend, backend)} backend"
    if method_id in NAMED:
        return NAMED[method_id]
    head, *rest = method_id.split("_")
    parts = [NAMED.get(head) or _match(_BASES, head)]
    parts += [MODIFIERS.get(t) or _match(_SIZED, t) for t in rest]
    return method_id if None in parts else ", ".join(p for p in parts if p)
