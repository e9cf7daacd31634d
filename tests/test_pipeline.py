"""pipeline("cocktail-text-generation"): several questions about one document from one prefill, equal to the
manual path (prepare_inputs + generate per question)."""

import pytest
import torch
from transformers import pipeline

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.integration.pipeline import build_prompt

from .conftest import FakeEncoder, make_prompt, make_tiny_llama

CFG = CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3)
GEN = dict(max_new_tokens=4, do_sample=False)


def manual_answer(model, tok, context, question):
    cache = CocktailCache(CFG, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tok, build_prompt(tok, context, question), contexts=context, queries=question)
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    return tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip(), cache.precision_map()[
        0
    ]


def test_pipeline_answers_several_questions_from_one_prefill_like_the_manual_path(tiny_tokenizer):
    model = make_tiny_llama()
    _, context, q1 = make_prompt(120, needle_at=60)
    questions = [q1, "w5 w6 w7 ?", "where is w9 ?"]
    prompt_tokens = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        prompt_tokens.append(ids.shape[1] if ids is not None else 0)
        return forward(*args, **kwargs)

    model.forward = counting_forward
    pipe = pipeline("cocktail-text-generation", model=model, tokenizer=tiny_tokenizer)
    got = pipe(context, question=questions, config=CFG, encoder=FakeEncoder(), **GEN)
    model.forward = forward
    n_ctx = len(tiny_tokenizer(context)["input_ids"])
    assert sum(n >= n_ctx for n in prompt_tokens) == 1  # the document went through the model once
    assert [r["question"] for r in got] == questions
    for r in got:
        answer, bits = manual_answer(model, tiny_tokenizer, context, r["question"])
        assert r["answer"] == answer and r["precision_map"] == bits
    assert len({tuple(r["precision_map"]) for r in got}) > 1  # the search reran for each question


def test_pipeline_single_question_returns_a_dict_and_checks_its_inputs(tiny_tokenizer):
    pipe = pipeline("cocktail-text-generation", model=make_tiny_llama(), tokenizer=tiny_tokenizer)
    _, context, q = make_prompt(40)
    out = pipe(context, question=q, config=CFG, encoder=FakeEncoder(), **GEN)
    assert set(out) == {"question", "answer", "precision_map"} and out["question"] == q
    with pytest.raises(ValueError, match="question must be a non-empty str"):
        pipe(context, question=[], config=CFG, encoder=FakeEncoder())
    with pytest.raises(ValueError, match="context must be a non-empty str"):
        pipe("", question=q, config=CFG, encoder=FakeEncoder())
    with pytest.raises(TypeError, match="config must be a CocktailConfig"):
        pipe(context, question=q, config={"alpha": 0.3})
    assert torch.is_grad_enabled()


def test_pipeline_on_a_sliding_window_model_prefills_each_question(tiny_tokenizer):
    """Sliding layers cannot be rewound to the end of the document: each question gets its own prefill, and the
    answers still equal the manual path."""
    from .test_architectures import make_model

    model = make_model("gemma3", "cocktail")
    _, context, q1 = make_prompt(80, needle_at=40)
    pipe = pipeline("cocktail-text-generation", model=model, tokenizer=tiny_tokenizer)
    got = pipe(context, question=[q1, "w5 w6 w7 ?"], config=CFG, encoder=FakeEncoder(), **GEN)
    for r in got:
        assert (r["answer"], r["precision_map"]) == manual_answer(model, tiny_tokenizer, context, r["question"])
