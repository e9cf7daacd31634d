"""One rule for moot combinations (hf_cocktail.presets.moot): every pair of CocktailConfig fields, each set to a value
other than its default, is accepted, or refused with a message naming both fields and their values exactly where the
table below (written here, independently of the library's) says that one makes the other ineffective."""

import dataclasses
import itertools

import pytest

from hf_cocktail import CocktailConfig

# per field, values other than its default that are valid alone (rotation_seed aside: moot without a rotation)
SAMPLES: dict = {
    "chunk_size": [16],
    "alpha": [0.3],
    "beta": [0.3],
    "encoder": ["org/enc"],
    "group_size": [16],
    "uniform_bits": [16, 4, 3, 2],
    "low_bits": [3],
    "backend": ["torch"],
    "scale_dtype": ["float32"],
    "encoder_batch_size": [8],
    "encoder_device": ["cpu"],
    "scorer": ["bm25", "attention"],
    "target_bits": [6.0],
    "sink_tokens": [0],
    "recent_tokens": [8],
    "full_precision_layers": [(0,)],
    "keep_context_copy": [True],
    "neighbors": [1],
    "rotation": ["hadamard", "hadamard_keys"],
    "rotation_seed": [1],
    "value_bits": [2, 3, 4],
    "scale_bits": [8],
    "layer_bits": [((4, 3), (3, 2))],
    "salient_tokens": [0.1],
    "full_part_bits": [8],
    "residual_tokens": [64],
    "key_outlier_share": [0.125],
    "center_keys": [True],
}
ANY = None
ALL_UNIFORM = {16, 4, 3, 2}
# (field made moot, its values (ANY: every sample), the field that makes it so, the values that do)
MOOT = [
    *[(f, ANY, "uniform_bits", ALL_UNIFORM) for f in ("target_bits", "alpha", "beta", "neighbors", "scorer")],
    ("low_bits", ANY, "uniform_bits", ALL_UNIFORM),
    *[
        (f, ANY, "uniform_bits", {16})
        for f in ("value_bits", "scale_bits", "salient_tokens", "sink_tokens", "recent_tokens", "residual_tokens")
    ],
    ("key_outlier_share", ANY, "uniform_bits", {16}),
    ("rotation", ANY, "uniform_bits", {16}),  # with full_part_bits at its default 16
    ("scale_dtype", ANY, "uniform_bits", {16}),  # the same
    ("center_keys", ANY, "uniform_bits", {16}),  # the same
    ("layer_bits", ANY, "uniform_bits", {16, 2}),
    ("value_bits", {3, 4}, "uniform_bits", {3}),
    ("value_bits", {2, 3, 4}, "uniform_bits", {2}),
    ("alpha", ANY, "target_bits", ANY),
    ("neighbors", ANY, "target_bits", ANY),
    ("keep_context_copy", ANY, "scorer", {"attention"}),
]


def moot_by(field, value, other, other_value) -> bool:
    return any(
        (f, c) == (field, other) and (vs is ANY or value in vs) and (cs is ANY or other_value in cs)
        for f, vs, c, cs in MOOT
    )


def expected_refusal(a, va, b, vb) -> tuple[str, str] | None:
    """``(the field expected to be named as moot, the one named as its cause)`` for the pair, or None when the pair
    is valid."""
    if moot_by(a, va, b, vb):
        return a, b
    if moot_by(b, vb, a, va):
        return b, a
    if "rotation_seed" in (a, b) and "rotation" not in (a, b):
        return "rotation_seed", "rotation"  # rotation at its default (None)
    return None


def test_the_samples_cover_every_field():
    assert set(SAMPLES) == {f.name for f in dataclasses.fields(CocktailConfig)}


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_each_sample_alone(field):
    for value in SAMPLES[field]:
        if field == "rotation_seed":
            with pytest.raises(ValueError, match=r"rotation_seed=1 has no effect with rotation=None"):
                CocktailConfig(rotation_seed=value)
        else:
            assert getattr(CocktailConfig(**{field: value}), field) == value


@pytest.mark.parametrize("a,b", list(itertools.combinations(sorted(SAMPLES), 2)))
def test_every_pair_of_fields(a, b):
    for va, vb in itertools.product(SAMPLES[a], SAMPLES[b]):
        expected, values = expected_refusal(a, va, b, vb), {"rotation": None, a: va, b: vb}
        if {a, b} == {"key_outlier_share", "scale_bits"}:  # not moot: incompatible (8-bit scales have no outliers)
            with pytest.raises(ValueError, match=r"key_outlier_share=0.125 needs scale_bits=16"):
                CocktailConfig(**{a: va, b: vb})
        elif expected is None:
            CocktailConfig(**{a: va, b: vb})
        else:
            moot, cause = expected
            with pytest.raises(ValueError) as e:
                CocktailConfig(**{a: va, b: vb})
            msg = str(e.value)
            assert f"{moot}={values[moot]!r} has no effect with {cause}={values[cause]!r} (" in msg, (a, va, b, vb)


def test_the_issue_cases_and_the_conditions_on_a_third_field():
    with pytest.raises(ValueError, match=r"target_bits=3.0 has no effect with uniform_bits=4 \(no chunk search"):
        CocktailConfig(target_bits=3.0, uniform_bits=4)
    with pytest.raises(ValueError, match=r"neighbors=1 has no effect with target_bits=4.0"):
        CocktailConfig(neighbors=1, target_bits=4.0)
    # with the full part at 8 bits, uniform_bits=16 still quantizes: its rotation and scale dtype matter
    CocktailConfig(uniform_bits=16, full_part_bits=8, rotation="hadamard", scale_dtype="float32")
    # the attention scorer's ban on a context copy lapses where uniform_bits makes the scorer itself moot ... which
    # the scorer's own row refuses first
    with pytest.raises(ValueError, match="scorer='attention' has no effect with uniform_bits=4"):
        CocktailConfig(uniform_bits=4, scorer="attention", keep_context_copy=True)
    assert CocktailConfig.recommended().uniform_bits == 4  # uniform_bits with every other field at its default


def test_an_assignment_that_makes_a_field_moot_is_refused_and_not_kept():
    config = CocktailConfig(alpha=0.3)
    with pytest.raises(ValueError, match=r"alpha=0.3 has no effect with uniform_bits=4"):
        config.uniform_bits = 4
    assert config.uniform_bits is None
    assert dataclasses.replace(config, alpha=0.6, uniform_bits=4).uniform_bits == 4
