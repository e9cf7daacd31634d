"""The evaluation's methods beyond the paper's storage, as :data:`ROTATION_METHODS` (each a
:class:`~eval.methods.kinds.CocktailMethod` or a twin kind): rotated storage and budget mode, INT3 as the low
precision, 64-token chunks, values at fewer bits than keys, query-aware 4-bit keys without an FP16 tier (with their
shuffled twins), 8-bit scales and zeros, and ``recommended``. :mod:`eval.methods.registry` adds them to ``METHODS``
after the paper's and the baselines'."""

from __future__ import annotations

from hf_cocktail import CocktailConfig

from .kinds import CocktailMethod, Method, ShuffledPlanMethod


def _recommended_overrides() -> dict:
    """The fields where ``CocktailConfig.recommended()`` differs from the paper's ``CocktailConfig()`` (the encoder
    stays the evaluation's)."""
    rec, paper = CocktailConfig.recommended().to_dict(), CocktailConfig().to_dict()
    return {k: v for k, v in rec.items() if k not in ("encoder", "format_version") and v != paper.get(k)}


HAD = {"rotation": "hadamard"}
# rotated storage and budget mode (issue 11: told apart by the KL divergence of eval/kld); each a CocktailCache
ROTATION_METHODS: list[Method] = [
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
ROTATION_METHODS += [
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
ROTATION_METHODS += [
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
ROTATION_METHODS += [
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


ROTATION_METHODS += [m for b in (3.8, 3.9, 4.0, 4.1) for m in _int4first_v3(b)]
# the same with 64-token chunks (keys' scales and zeros over 64 tokens: half their bytes)
ROTATION_METHODS.append(
    CocktailMethod(
        "int4v3_had_c64_g64",
        "every context chunk 4-bit keys + 3-bit values, Hadamard-rotated, 64-token chunks, value groups of 64",
        {"uniform_bits": 4, "chunk_size": 64, "group_size": 64, **V3, **HAD},
    )
)
ROTATION_METHODS += [
    CocktailMethod(
        f"int4first{b:g}_v3_had_c64_g64",
        f"as int4first*_v3_had_g64 with 64-token chunks, target_bits={b:g}",
        {"target_bits": b, **_INT4FIRST_V3, "chunk_size": 64},
    )
    for b in (3.75, 3.85)
]
# 8-bit scales and zeros (scale_bits=8: codes on three numbers per chunk and head), each the twin of a method above
S8 = {"scale_bits": 8}
ROTATION_METHODS += [
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
ROTATION_METHODS.append(CocktailMethod("recommended", f"CocktailConfig.recommended(): {_RECOMMENDED}", _RECOMMENDED))
