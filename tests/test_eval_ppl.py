"""eval/ppl: windows cut from a text (evenly spaced, the context a prefix of the prompt, the continuation the text's
own tokens), the measurement on tiny models (FP16's NLL is the NLL of one forward over the whole text, on a Llama
and on a sliding-window Gemma 3; FP16 against itself 0; 16 bits = FP16; INT2 diverges), the summary (perplexity =
exp of the mean NLL, paired differences), the CLI end to end on a tiny saved model."""

import json
import math

import pytest
import torch

from eval.cli import UsageError

from .conftest import WORDS, make_tiny_llama


def _text(n_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(0, 180, (n_words,), generator=g))


def test_offsets_are_evenly_spaced_and_refuse_too_little_text():
    from eval.ppl.windows import offsets

    assert offsets(1000, 100, 4) == [0, 300, 600, 900]
    assert offsets(1000, 100, 1) == [0]
    with pytest.raises(UsageError, match="need 1100 tokens"):
        offsets(1000, 100, 11)


def test_windows_cut_a_text(tiny_tokenizer):
    from eval.ppl.windows import make_windows

    text = _text(400)
    ids = tiny_tokenizer(text)["input_ids"]
    wins = make_windows(tiny_tokenizer, "wikitext", text, context=60, lead=8, continuation=12, count=3)
    assert [w.offset for w in wins] == [0, 160, 320]
    for w in wins:
        assert w.request.prompt.startswith(w.request.context) and w.request.query.strip()
        assert tiny_tokenizer(w.request.prompt)["input_ids"] == ids[w.offset : w.offset + 68]
        assert w.continuation == ids[w.offset + 68 : w.offset + 80]


def _whole_text_nll(model, tok, window) -> float:
    """The NLL of the scored continuation tokens from one forward over prompt + continuation (no cache games)."""
    from eval.ppl.measure import token_nll

    prompt = tok(window.request.prompt, return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt, torch.tensor([window.continuation])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    L = prompt.shape[1]
    return float(token_nll(logits[L:-1], ids[0, L + 1 :]).mean())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp16_is_the_whole_texts_nll_and_quantization_diverges(tiny_tokenizer, arch):
    from eval.methods.kinds import CocktailMethod
    from eval.methods.registry import METHODS
    from eval.ppl.measure import PplRunner
    from eval.ppl.windows import make_windows

    from .conftest import make_tiny_gemma3

    model = make_tiny_llama() if arch == "llama" else make_tiny_gemma3()
    (win,) = make_windows(tiny_tokenizer, "essays", _text(300, 1), context=120, lead=8, continuation=10, count=1)
    u16 = CocktailMethod("u16", "16 bits", {"uniform_bits": 16})
    recs = {
        r["method"]: r
        for r in PplRunner(model, tiny_tokenizer, "unused").run(win, [METHODS["fp16"], u16, METHODS["int2"]])
    }
    fp = recs["fp16"]
    assert fp["scored_tokens"] == 9 and fp["kl"] == 0.0 and fp["top1"] == 1.0 and fp["nll"] == fp["nll_fp16"]
    assert fp["nll"] == pytest.approx(_whole_text_nll(model, tiny_tokenizer, win), rel=1e-5)
    assert fp["kv_ratio"] == fp["kv_ratio_global"] == 1.0
    assert recs["u16"]["kl"] < 1e-9
    q2 = recs["int2"]
    assert q2["kl"] > 100 * max(recs["u16"]["kl"], 1e-9) and q2["top1"] <= 1 and q2["precision_counts"]["int2"] > 0
    assert q2["kv_ratio_global"] < 1 and (q2["kv_ratio_global"] < q2["kv_ratio"]) == (arch == "gemma3")


def _rec(method, window, nll, kl, source="wikitext"):
    return {
        "method": method,
        "window": window,
        "source": source,
        "nll": nll,
        "kl": kl,
        "top1": 1.0,
        "kv_ratio": 1.0,
        "kv_ratio_global": 1.0,
    }


def test_summary_and_paired():
    from eval.ppl.report import markdown, paired, summarize

    recs = [
        _rec("int4", "a", 2.0, 0.01),
        _rec("int4", "b", 3.0, 0.03),
        _rec("x", "a", 2.2, 0.02),
        _rec("x", "b", 3.0, 0.01),
    ]
    rows = {r["method"]: r for r in summarize(recs, ["int4", "x"])}
    assert rows["int4"]["ppl"] == pytest.approx(math.exp(2.5)) and rows["int4"]["kld"] == pytest.approx(0.02)
    assert rows["int4"]["ppl_lo"] <= rows["int4"]["ppl"] <= rows["int4"]["ppl_hi"]
    (p,) = paired(recs, ["int4", "x"], "int4")
    assert p["d_kl"] == pytest.approx(-0.005) and p["d_nll"] == pytest.approx(0.1)
    assert (p["lower"], p["higher"]) == (1, 1)
    assert "| wikitext | x | `x` | 2 | -0.0050 [" in markdown(list(rows.values()), [p])


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--sources", "wikitext,books"], "--sources must be"),
        (["--windows", "0"], "--windows must be >= 1"),
        (["--continuation", "1"], "--continuation must be >= 2"),
        (["--methods", "fp16,nope"], "unknown method"),
    ],
)
def test_cli_errors(argv, msg):
    from eval.ppl.cli import parse_args

    with pytest.raises(UsageError, match=msg):
        parse_args(["--out-dir", "/tmp/unused", *argv])


def test_cli_end_to_end_on_a_tiny_saved_model(tmp_path, tiny_tokenizer):
    from eval.ppl.cli import main

    model_dir = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "wiki.txt"
    text.write_text(_text(600, 2))
    out = tmp_path / "out"
    argv = [
        "--out-dir",
        str(out),
        "--model",
        str(model_dir),
        "--sources",
        "wikitext",
        "--wikitext-file",
        str(text),
        "--windows",
        "2",
        "--context",
        "100",
        "--lead",
        "8",
        "--continuation",
        "6",
        "--methods",
        "fp16,int4,int2",
        "--threads",
        "1",
        "--no-progress",
        "--encoder",
        "unused",
    ]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and {r["method"] for r in recs} == {"fp16", "int4", "int2"}
    md = (out / "summary.md").read_text()
    assert "### Paired with `int4`" in md and (out / "ppl_vs_bytes.png").stat().st_size > 1000
    assert main(argv) == 0  # resumed: nothing left to run, the same records
    assert len((out / "records.jsonl").read_text().splitlines()) == 6
