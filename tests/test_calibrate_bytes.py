"""hf_cocktail.calibrate: the byte target holds on a prompt of the length users give (``bytes_tokens``), not on
the short calibration windows."""

from __future__ import annotations

import pytest

from hf_cocktail.calibrate import calibrate_model
from hf_cocktail.calibrate.texts import bytes_window

from .conftest import make_tiny_llama, random_text

SMALL = dict(window=200, question_tokens=16, continuation_tokens=8)


def _tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_the_bytes_window_is_the_first_text_that_long_else_the_whole_longest(tiny_tokenizer):
    short, mid, long = (random_text(n, seed=n) for n in (120, 400, 700))
    texts = [("short", short), ("long", long), ("mid", mid)]
    assert _tokens(tiny_tokenizer, long) > _tokens(tiny_tokenizer, mid) >= 350
    w = bytes_window(tiny_tokenizer, texts, 350, 16, 2)
    assert w.name == "long"  # the first long enough, in order
    assert _tokens(tiny_tokenizer, w.context + w.question) + len(w.continuation) in (349, 350, 351)  # decode/re-encode
    assert len(w.continuation) == 2
    n_long = _tokens(tiny_tokenizer, long)
    with pytest.warns(UserWarning, match=f"no text has bytes_window=100000 tokens.*long \\({n_long} tokens\\)"):
        w = bytes_window(tiny_tokenizer, texts, 100_000, 16, 2)
    assert w.name == "long" and w.continuation == tuple(
        tiny_tokenizer(long, add_special_tokens=False)["input_ids"][-2:]
    )
    with pytest.raises(ValueError, match="bytes_window must be at least 82, got 50"):
        bytes_window(tiny_tokenizer, texts, 50, 16, 2)


def test_candidates_fit_the_target_on_the_long_prompt_where_the_full_part_weighs_less(tiny_tokenizer):
    model = make_tiny_llama(layers=2, head_dim=32)
    texts = [(f"t{i}", random_text(260, seed=400 + i)) for i in range(2)] + [("long", random_text(900, seed=9))]
    res = calibrate_model(
        model, tiny_tokenizer, texts, 0.4, calibration_texts=1, validation_texts=1, progress=False,
        rotations=(None,), bytes_tokens=700, **SMALL,
    )  # fmt: skip
    bw = res.settings["bytes_window"]
    assert bw["text"] == "long" and 694 <= bw["tokens"] <= 700  # 700 minus the continuation (re-tokenized prompt)
    for c in res.candidates:
        assert c["fits"] == (c["bytes_ratio"] <= 0.4)
    chosen = res.measured(res.chosen)
    assert chosen["fits"] and chosen["kind"] == "caps"
    # the question and the template stay at full precision: a larger share of a 200-token window than of 700 tokens
    int4 = res.measured("uniform INT4")
    assert int4["bytes_ratio"] < int4["quantized_ratio"]
    # at most the window: the held-out window's bytes, as before
    res_short = calibrate_model(
        model, tiny_tokenizer, texts, 0.4, calibration_texts=1, validation_texts=1, progress=False,
        rotations=(None,), bytes_tokens=0, **SMALL,
    )  # fmt: skip
    assert res_short.settings["bytes_window"]["text"] == "t1"
    assert all(c["bytes_ratio"] == c["quantized_ratio"] for c in res_short.candidates)
