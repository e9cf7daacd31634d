"""The README's Python code blocks run as written (so that they cannot rot)."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(path: str = os.path.join(ROOT, "README.md")) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", open(path, encoding="utf-8").read(), flags=re.S | re.M)


def test_the_readme_has_a_python_example():
    assert python_blocks(), "README.md has no ```python block"


@pytest.mark.slow
def test_the_readme_example_answers_from_the_document(smollm2, minilm, monkeypatch):
    import hf_cocktail

    # the block loads SmolLM2 by name: serve the session's copy instead of a second load
    monkeypatch.setattr(hf_cocktail.offline_models, "load_offline_model", lambda name, **kw: smollm2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in python_blocks():
            exec(compile(block, "README.md", "exec"), {})
    printed = out.getvalue()
    assert "4417" in printed, printed
    ratio = float(printed.split()[-1])
    assert 0.1 < ratio < 0.5, printed
