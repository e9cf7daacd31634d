"""Input preparation: tokenize the prompts with offsets and plan each sequence (context span, chunk texts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_cocktail.planning import plans as planning
from hf_cocktail.planning.plans import SequencePlan
from hf_cocktail.presets.config import CocktailConfig


def prepare_plans(
    tokenizer: Any, prompts: Any, contexts: Any, queries: Any, config: CocktailConfig, tokenizer_kwargs: dict
) -> tuple[Any, list[SequencePlan]]:
    """Tokenize ``prompts`` (left padding for batches) and plan each sequence: its context's token span (protected
    sink/recent tokens excluded), the chunks' texts (the prompt's own characters) and, for scorer="attention",
    the query's span. Returns the tokenizer's ``BatchEncoding`` (without offsets) and one plan per prompt."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError(
            f"prompts must be a non-empty str or list of str, got "
            f"{[type(p).__name__ for p in prompts] or 'an empty list'}"
        )
    B = len(prompts)
    contexts = _per_sequence("contexts", contexts, B)
    queries = _per_sequence("queries", queries, B)
    if config.uniform_bits is None:
        for b, (c, q) in enumerate(zip(contexts, queries)):
            if c and q is None:
                raise ValueError(f"queries[{b}] is None but the search needs a query (or set uniform_bits)")
    enc = _tokenize(tokenizer, prompts, tokenizer_kwargs)
    offsets = enc.pop("offset_mapping")
    plans = [_plan_row(enc, offsets[b], b, prompts[b], contexts[b], queries[b], config) for b in range(B)]
    return enc, plans


def _plan_row(
    enc: Any, offsets: Any, b: int, prompt: str, context: str | None, query: str | None, cfg: CocktailConfig
) -> SequencePlan:
    ids, mask = enc["input_ids"][b], enc["attention_mask"][b]
    L = ids.shape[0]
    pad = int(L - mask.sum())
    cs, ce = planning.context_span(prompt, context, offsets, mask, pad, cfg.sink_tokens, cfg.recent_tokens, b)
    texts = planning.chunk_texts(prompt, offsets, cs, ce, cfg.chunk_size)
    plan = SequencePlan(pad, cs, ce, texts, query, origin=b)
    if cfg.scorer == "attention" and cfg.uniform_bits is None and ce > cs:
        plan.query_span = planning.query_span(prompt, query or "", offsets, mask, pad, ce, f"queries[{b}]")
    return plan


def _per_sequence(name: str, value: Any, B: int) -> list:
    if value is None or isinstance(value, str):
        return [value] * B
    value = list(value)
    if len(value) != B:
        raise ValueError(f"{name} must be a str or a list of {B} (one per prompt), got a list of {len(value)}")
    for v in value:
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} must hold str or None, got {type(v).__name__}")
    return value


def _tokenize(tokenizer, prompts: Sequence[str], tokenizer_kwargs: dict):
    """Left-padded fast tokenization with offsets (a pad token borrowed from EOS for a batch if none is set)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "prepare_inputs needs a fast tokenizer (offset mapping), got a slow one: "
            "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    B = len(prompts)
    old_side, old_pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if B > 1 and old_pad is None:  # left padding is masked and never stored: any token id will do
        if tokenizer.eos_token is None:
            raise ValueError("a batch of prompts needs padding: set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    try:
        return tokenizer(
            list(prompts), return_tensors="pt", padding=B > 1, return_offsets_mapping=True, **tokenizer_kwargs
        )
    finally:
        tokenizer.padding_side = old_side
        if B > 1 and old_pad is None:
            tokenizer.pad_token = old_pad
