"""`make demo` end to end: the offline demo on its generated document (SmolLM2 + the packaged MiniLM)."""

import pytest

from hf_cocktail import demo

pytestmark = pytest.mark.slow


def test_demo_answers_right_with_the_recommended_setting(smollm2, minilm, tmp_path, capsys):
    """FP16 and the recommended setting find the hidden combination; the demo prints all three caches and draws the
    chunk search."""
    assert demo.main(["--out-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    answers = {line.split(":")[0]: line for line in lines if "correct:" in line}
    assert set(answers) == {"FP16 (DynamicCache)", "Cocktail, paper settings", "Cocktail, recommended setting"}
    assert "correct: True" in answers["FP16 (DynamicCache)"]
    assert "correct: True" in answers["Cocktail, recommended setting"]
    assert "no chunk search" in answers["Cocktail, recommended setting"]
    assert (tmp_path / "chunk_precisions.png").stat().st_size > 1000
