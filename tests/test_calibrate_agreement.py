"""hf_cocktail.calibrate.agreement: the fake quantization the layer sensitivity trusts gives the real store's KL
divergence, and calibration records both."""

from __future__ import annotations

import pytest

from hf_cocktail.calibrate import calibrate_model, run
from hf_cocktail.calibrate.agreement import real_base_kl
from hf_cocktail.calibrate.texts import split_windows
from hf_cocktail.calibrate.validate import prepare

from .conftest import make_tiny_llama, random_text


@pytest.mark.parametrize("rotation", [None, "hadamard", "hadamard_values"])
def test_the_fake_quantizer_gives_the_real_stores_divergence(tiny_tokenizer, rotation):
    model = make_tiny_llama(layers=2, head_dim=32)
    texts = [(f"t{i}", random_text(300, seed=30 + i)) for i in range(2)]
    cal, _ = split_windows(tiny_tokenizer, texts, 1, 1, 232, 16, 8)
    prep = prepare(model, tiny_tokenizer, cal[0])
    fake = run._probe(model, prep, [0, 1], rotation).kl([run.BASE] * 2)
    real = real_base_kl(model, tiny_tokenizer, prep, [0, 1], rotation, run.BASE)
    assert fake > 1e-6 and real == pytest.approx(fake, rel=1e-3)
    # packing the 4 sink tokens too moves every chunk: another store, a divergence the agreement's tolerance tells apart
    shifted = real_base_kl(model, tiny_tokenizer, prep, [0, 1], rotation, run.BASE, sink_tokens=0)
    assert shifted != pytest.approx(fake, rel=1e-3)


def test_calibration_records_the_real_stores_base_divergence_beside_the_fake_one(tiny_tokenizer):
    model = make_tiny_llama(layers=2, head_dim=32)
    texts = [(f"t{i}", random_text(260, seed=500 + i)) for i in range(3)]
    res = calibrate_model(
        model, tiny_tokenizer, texts, 0.4, calibration_texts=2, validation_texts=1, progress=False,
        rotations=(None, "hadamard"), bytes_tokens=0, window=200, question_tokens=16, continuation_tokens=8,
    )  # fmt: skip
    choice = res.settings["rotation_choice"]
    assert set(choice["base_kl_real"]) == set(choice["base_kl"]) == {"None", "hadamard"}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in choice["base_kl_real"].values())
