"""Readable labels for the evaluation's method ids."""

from eval.methods.labels import label
from eval.methods.registry import METHODS


def test_every_registered_method_has_a_readable_label():
    unread = [m for m in METHODS if label(m) == m]
    assert not unread, f"no label for {unread}: add its base or modifier to eval/methods/labels.py"


def test_a_code_name_reads_as_its_settings():
    assert label("layers3r2_had_s8_sal1_f8") == (
        "per-layer widths at 3 bits (round 2), rotated, 8-bit scales, 1% salient tokens, 8-bit full part"
    )
    assert label("int4_had") == "uniform INT4, rotated"


def test_an_unknown_id_is_shown_as_it_is():
    assert label("int4_had_mystery") == "int4_had_mystery"
    assert label("someone_elses") == "someone_elses"
