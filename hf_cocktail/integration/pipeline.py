"""The one-call habit: a transformers pipeline task that answers questions about a document with a Cocktail cache.

    pipe = pipeline("cocktail-text-generation", model=model, tokenizer=tokenizer)
    pipe(document, question=["Who?", "When?"], config=CocktailConfig(...), max_new_tokens=32)

The prompt is built with the tokenizer's chat template (a plain ``document / Question: / Answer:`` prompt when the
tokenizer has none); the document is prefilled once and every further question is answered from that prefill
(:meth:`CocktailCache.requery`: the search reruns for each question, only the question's tokens are computed) —
except on models with sliding-window or hybrid layers, whose state cannot be rewound: there each question gets its
own prefill.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from hf_cocktail.cache.cache import CocktailCache
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.presets.config import CocktailConfig

TASK = "cocktail-text-generation"


def build_prompt(tokenizer: Any, context: str, question: str) -> str:
    """The prompt for one question: the chat template around ``context`` then ``question`` (context first, so
    every question shares the document's tokens)."""
    content = f"{context}\n\nAnswer the question using the document above.\nQuestion: {question}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{content}\nAnswer:"


def _questions(question: Any) -> tuple[list[str], bool]:
    single = isinstance(question, str)
    questions = [question] if single else list(question) if question is not None else []
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise ValueError(f"question must be a non-empty str or a non-empty list of str, got {question!r}")
    return questions, single


class CocktailTextGenerationPipeline(Pipeline):
    """``pipe(context, question=str | list[str], config=CocktailConfig(...), **generate_kwargs)`` -> for each
    question ``{"question", "answer", "precision_map"}`` (a dict for one question, a list for several)."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, question=None, config=None, encoder=None, **generate_kwargs):
        if config is not None and not isinstance(config, CocktailConfig):
            raise TypeError(f"config must be a CocktailConfig, got {type(config).__name__}")
        preprocess = {} if question is None else {"question": question}
        forward = {"config": config, "encoder": encoder, "generate_kwargs": generate_kwargs}
        return preprocess, forward, {}

    def preprocess(self, context, question=None):
        if not isinstance(context, str) or not context.strip():
            raise ValueError(f"context must be a non-empty str (the document), got {type(context).__name__}")
        questions, single = _questions(question)
        return {"context": context, "questions": questions, "single": single}

    def _forward(self, model_inputs, config=None, encoder=None, generate_kwargs=None):
        context, questions = model_inputs["context"], model_inputs["questions"]
        config = dataclasses.replace(config or CocktailConfig(), keep_context_copy=True)
        cache = CocktailCache(config, encoder=encoder)
        results = []
        for i, question in enumerate(questions):
            prompt = build_prompt(self.tokenizer, context, question)
            if i == 0 or not cache.can_requery():  # sliding / hybrid models: a new prefill per question
                inputs = cache.prepare_inputs(
                    self.tokenizer, prompt, contexts=context, queries=question, device=self.model.device
                )
            else:
                inputs = cache.requery(self.tokenizer, prompt, question, device=self.model.device)
            out = self.model.generate(**inputs, **cache_kwargs(self.model, cache), **(generate_kwargs or {}))
            results.append((question, out[0, inputs["input_ids"].shape[1] :], cache.precision_map()[0]))
        return {"results": results, "single": model_inputs["single"]}

    def postprocess(self, model_outputs):
        answers = [
            {
                "question": q,
                "answer": self.tokenizer.decode(ids, skip_special_tokens=True).strip(),
                "precision_map": bits,
            }
            for q, ids, bits in model_outputs["results"]
        ]
        return answers[0] if model_outputs["single"] else answers


def register_pipeline() -> None:
    """Register ``"cocktail-text-generation"`` with transformers' pipeline registry (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.supported_tasks:
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=CocktailTextGenerationPipeline, pt_model=AutoModelForCausalLM, type="text"
        )
