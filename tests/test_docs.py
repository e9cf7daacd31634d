"""The generated reference pages under docs/ match the code (``python -m eval.make_docs`` rewrites them)."""

from __future__ import annotations

import dataclasses

import pytest

from eval import make_docs


def test_committed_pages_are_current():
    assert make_docs.main(["--check"]) == 0, "docs/ is stale: run `python -m eval.make_docs`"


def test_every_config_field_is_documented_once():
    docs = make_docs.field_docs()
    assert list(docs) == [f.name for f in dataclasses.fields(make_docs.CocktailConfig)]
    assert all(text and "``" not in text for text in docs.values())


def test_a_field_without_docstring_entry_is_refused():
    @dataclasses.dataclass
    class Half:
        """A config.

        Args:
            a: documented.
        """

        a: int = 1
        b: int = 2

    with pytest.raises(ValueError, match=r"without a docstring entry \['b'\]"):
        make_docs.field_docs(Half)


def test_an_entry_without_field_is_refused():
    @dataclasses.dataclass
    class Extra:
        """A config.

        Args:
            a: documented.
            gone: a field that was removed.
        """

        a: int = 1

    with pytest.raises(ValueError, match=r"entries without a field \['gone'\]"):
        make_docs.field_docs(Extra)
