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


@pytest.mark.parametrize("where", ["checkout", "given", "installed"])
def test_the_recommended_setting_comes_from_the_smollm2_preset_when_there_is_one(where, tmp_path, monkeypatch):
    from hf_cocktail import CocktailConfig

    other = tmp_path / "other"
    CocktailConfig(chunk_size=64).save_pretrained(str(other))
    if where == "installed":  # a package installed without the checkout's model_cards/
        monkeypatch.setattr(demo, "SMOLLM2_PRESET", str(tmp_path / "missing"))
    cfg, source = demo.recommended_config(str(other) if where == "given" else None, "enc")
    assert cfg.encoder == "enc"
    if where == "checkout":
        assert cfg == CocktailConfig.from_pretrained(demo.SMOLLM2_PRESET, encoder="enc")
        assert cfg.salient_tokens > 0 and cfg.full_part_bits == 8 and cfg.layer_bits is not None
        assert source.endswith("smollm2-135m-instruct')")
    elif where == "given":
        assert cfg.chunk_size == 64 and str(other) in source
    else:
        assert cfg == CocktailConfig.recommended(encoder="enc") and "no smollm2-135m-instruct preset" in source


def test_gemma_gets_its_own_preset_and_a_completion_prompt(tiny_tokenizer):
    from hf_cocktail import CocktailConfig

    cfg, source = demo.recommended_config(None, "enc", "gemma-3-270m")
    assert cfg == CocktailConfig.from_pretrained(demo.PRESETS["gemma-3-270m"], encoder="enc")
    assert source.endswith("gemma-3-270m')")
    assert tiny_tokenizer.chat_template is None  # like the Gemma 3 270M base GGUF
    prompt = demo.build_prompt(tiny_tokenizer, "the doc", "what ?")
    assert prompt.startswith("Read the document") and prompt.endswith("Question: what ?\nAnswer:")
