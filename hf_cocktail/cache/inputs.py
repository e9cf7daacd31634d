"""Input preparation: tokenize the prompts with offsets and plan each sequence (context span, chunk texts); or,
without ``prepare_inputs``, plan each sequence from what its prefill embeds (:func:`plans_from_prefill`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from hf_cocktail.cache.prefill_watch import PrefillWatch
from hf_cocktail.planning import plans as planning
from hf_cocktail.planning.plans import SequencePlan
from hf_cocktail.presets.config import CocktailConfig

logger = logging.getLogger(__name__)


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


class Shared:
    """An object the copies of a cache share (``copy.deepcopy`` returns this holder itself): the tokenizer."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __deepcopy__(self, memo: dict) -> Shared:
        return self


def plan_watched_prefill(
    watch: PrefillWatch, B: int, L: int, cfg: CocktailConfig, tokenizer: Any = None
) -> tuple[list[SequencePlan], torch.Tensor | None]:
    """The plans of a prefill of ``B`` rows of ``L`` tokens that came without ``prepare_inputs``, from the ids and
    2D mask ``watch`` saw it pass (:func:`plans_from_prefill`), and those ids (on CPU; None where unseen). Disarms
    the watch; says in one log line when the search takes the prompt's tail as its query."""
    seen = [watch.forward_ids, *reversed(watch.ids)]
    ids = next((i for i in seen if i is not None and tuple(i.shape) == (B, L)), None)
    plans = plans_from_prefill(B, L, ids, watch.forward_mask, cfg, tokenizer)
    watch.disarm()
    if cfg.uniform_bits is None:
        logger.warning(
            "CocktailCache: no prepare_inputs, so the chunk search (scorer=%r) takes the prompt's tail, its last "
            "residual_tokens=%d tokens, as its query; call cache.prepare_inputs(tokenizer, prompt, contexts=..., "
            "queries=...) for an explicit document and question",
            cfg.scorer,
            cfg.residual_tokens,
        )
    return plans, None if ids is None else ids.detach().to("cpu", planning.INDEX_DTYPE, copy=True)


def plans_from_prefill(
    B: int, L: int, ids: torch.Tensor | None, mask: torch.Tensor | None, cfg: CocktailConfig, tokenizer: Any = None
) -> list[SequencePlan]:
    """One plan per row of a prefill of ``B`` rows of ``L`` tokens that no ``prepare_inputs`` prepared: each row's
    real tokens (after its left padding, read from ``mask (B, past + L)``) are context from the ``sink_tokens``-th to
    ``residual_tokens`` before the end (:func:`~hf_cocktail.planning.plans.prompt_context_span`).
    The prompt's tail after the context (its last ``residual_tokens`` at most) is the query (``query_span``): the
    attention scorer and ``salient_tokens`` read its attention; the encoder and BM25 read its text, and the chunks',
    decoded with ``tokenizer`` from ``ids (B, L)``, the ids embedded."""
    pads = left_padding(mask, B, L)
    texts_needed = cfg.uniform_bits is None and cfg.scorer != "attention"
    if texts_needed and (tokenizer is None or ids is None or tuple(ids.shape) != (B, L)):
        missing = "a tokenizer" if tokenizer is None else "the token ids (the prefill passed inputs_embeds)"
        raise ValueError(
            f"CocktailConfig(scorer={cfg.scorer!r}) searches the context's chunks for those relevant to a query, "
            f"and this prefill came without prepare_inputs and without {missing}: pass "
            "CocktailCache(config, tokenizer=tokenizer) and input_ids (the prompt's tail then serves as the query), "
            "call cache.prepare_inputs(tokenizer, prompt, contexts=..., queries=...) for an explicit document and "
            "question, or use a setting without search (CocktailConfig.recommended(), uniform_bits=...)"
        )
    if cfg.uniform_bits is None and cfg.residual_tokens == 0:
        raise ValueError(
            "residual_tokens=0 leaves no prompt tail to serve as the search's query when the prompt comes without "
            "prepare_inputs: set residual_tokens >= 1 or call cache.prepare_inputs(...) with queries="
        )
    plans = []
    for b, pad in enumerate(pads):
        cs, ce = planning.prompt_context_span(pad, L, cfg.sink_tokens, cfg.residual_tokens)
        q0 = max(pad, L - cfg.residual_tokens)
        chunks = range(cs, ce, cfg.chunk_size)
        if texts_needed:
            assert ids is not None  # checked above
            texts = [tokenizer.decode(ids[b, a : a + cfg.chunk_size]) for a in chunks]
            query = tokenizer.decode(ids[b, q0:L])
        else:
            texts, query = [""] * len(chunks), None
        plan = SequencePlan(pad, cs, ce, texts, query, origin=b)
        plan.query_span = (q0, L)  # the tokens whose attention scores the chunks (or picks salient tokens)
        plans.append(plan)
    return plans


def left_padding(mask: torch.Tensor | None, B: int, L: int) -> list[int]:
    """The left padding of each of the ``B`` rows of a prefill of ``L`` tokens from its 2D attention ``mask (B,
    past + L)`` (None, or a mask of another batch: no padding). Padding elsewhere is refused: the cache would keep
    masked tokens among the context and protect the wrong ones."""
    if mask is None or mask.shape[0] != B or mask.shape[1] < L:
        return [0] * B
    real = mask[:, -L:] != 0
    pads = (~real).long().cumprod(1).sum(1)
    bad = (real.sum(1) != L - pads).nonzero().flatten().tolist()
    if bad:
        b = bad[0]
        t = int(pads[b]) + int((~real[b, int(pads[b]) :]).nonzero()[0])
        raise ValueError(
            f"CocktailCache supports left padding only, but attention_mask row {b} masks token {t} of {L}, after "
            f"its first real token {int(pads[b])}: tokenize with tokenizer.padding_side = 'left'"
        )
    return pads.tolist()
