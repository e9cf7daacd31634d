"""One shared full-precision prefill, branched into every method's cache.

:func:`prefill` runs the model once over the whole prompt into a ``DynamicCache`` and keeps the last token's logits;
:func:`branch` turns that prefill into a method's cache; :func:`generate_from_branch` takes the first new token from
the shared logits and lets the method's cache generate the rest (greedy). This is exactly what a plain
``model.generate`` with the method's cache does, because every cache here attends at full precision during its own
prefill and quantizes only what later steps read (tested in ``tests/test_eval_methods.py``). Branching the prefill of
all tokens but the last and running the last prompt token as a decode step would NOT be equivalent for the quantized
caches: that token's keys, values and the first new token would then come from attention over the quantized context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.calibrate.queries import recording_queries
from hf_cocktail.integration.compat import cache_kwargs

from .kinds import Method, Request, build_cache, prefill_items

# ``generate``'s greedy search, whatever the model's generation_config says
GREEDY = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "num_beams": 1}


def context_span(tok, request: Request) -> tuple[int, int]:
    """``[start, end)`` of the request's context tokens in its prompt, as ``CocktailCache.prepare_inputs`` locates
    them (the request must have a context)."""
    probe = CocktailCache(CocktailConfig(uniform_bits=16))
    probe.prepare_inputs(
        tok, request.prompt, contexts=request.context, queries=request.query, **request.tokenizer_kwargs
    )
    span = probe.plans[0].ctx_start, probe.plans[0].ctx_end
    probe.reset()
    return span


def context_end(tok, request: Request) -> int:
    """Token index where the request's context ends in its prompt (the prompt's length when there is no context)."""
    if not request.context:
        return len(tok(request.prompt, **request.tokenizer_kwargs)["input_ids"])
    return context_span(tok, request)[1]


def prefill_for(
    model, tok, input_ids: torch.Tensor, request: Request, methods: list[Method], ctx_end: int | None = None
) -> tuple[DynamicCache, torch.Tensor, list[torch.Tensor] | None]:
    """:func:`prefill`, and the attention queries of the tokens after the request's context (:mod:`.queries`) when
    one of ``methods`` reads them (else ``None``); ``ctx_end``: the context's end when the caller knows it."""
    if not any(m.reads_prefill_queries for m in methods):
        return (*prefill(model, input_ids), None)
    with recording_queries(model, context_end(tok, request) if ctx_end is None else ctx_end) as queries:
        dyn, logits = prefill(model, input_ids)
    return dyn, logits, queries


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Run the model over the whole prompt into a ``DynamicCache`` (the shared full-precision prefill).

    Returns the cache and the logits of the last prompt token ``(1, vocab)``: the first new token comes from them
    for every method, as in a plain ``generate``."""
    if input_ids.shape[1] < 1:
        raise ValueError("the prompt is empty")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].float()


@dataclass
class Branch:
    cache: Cache
    setup_s: float  # time to build this cache from the shared prefill (search + quantization)
    precision_counts: dict | None = None  # {"fp16": n, "int4": n, "int2": n} context chunks (cocktail kinds)
    precision_map: list | None = None


def precision_counts(bits: list[int]) -> dict[str, int]:
    counts = {"fp16": sum(b == 16 for b in bits), "int4": sum(b == 4 for b in bits), "int2": sum(b == 2 for b in bits)}
    if any(b == 3 for b in bits):
        counts["int3"] = sum(b == 3 for b in bits)
    return counts


def branch(
    method: Method,
    model,
    tokenizer,
    dyn: DynamicCache,
    input_ids: torch.Tensor,
    request: Request,
    encoder: str | None = None,
    prefill_queries: list[torch.Tensor] | None = None,
) -> Branch:
    """Build ``method``'s cache holding the shared prefill ``dyn`` (all prompt tokens); ``prefill_queries``
    (:mod:`.queries`) for the methods that read them.

    ``input_ids`` (1, L) must be ``tokenizer(request.prompt, **request.tokenizer_kwargs)``; ``request.context``
    must appear verbatim in the prompt (the Cocktail kinds search over its chunks with ``request.query``)."""
    t0 = time.perf_counter()
    L = input_ids.shape[1]
    if dyn.get_seq_length() != L:
        raise ValueError(f"the prefill holds {dyn.get_seq_length()} tokens, expected the {L} prompt tokens")
    cache = filled_cache(method, model, tokenizer, prefill_items(dyn), input_ids, request, encoder, prefill_queries)
    bits = method.precision_map(cache)
    counts = None if bits is None else precision_counts(bits)
    return Branch(cache, time.perf_counter() - t0, counts, bits)


def filled_cache(
    method: Method,
    model,
    tokenizer,
    pairs: list,
    input_ids: torch.Tensor,
    request: Request,
    encoder: str | None = None,
    prefill_queries: list[torch.Tensor] | None = None,
) -> Cache:
    """``method``'s cache prepared for the whole prompt ``input_ids`` (1, L) and filled with the full-precision
    prefill ``pairs`` (:func:`prefill_items`) of its first tokens, all of them or fewer."""
    cache, inputs = build_cache(method, model, tokenizer, request, encoder)
    if inputs is not None and not torch.equal(inputs["input_ids"].to(input_ids.device), input_ids):
        raise RuntimeError(
            f"{method.name}: the cache's preparation tokenized the prompt differently from the shared prefill"
        )
    method.load_prefill(cache, pairs, True, prefill_queries if method.reads_prefill_queries else None)
    return cache


@torch.no_grad()
def generate_from_branch(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    first_logits: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: list[int] | None = None,
    min_new_tokens: int = 0,
) -> torch.Tensor:
    """Greedy generation continuing a cache that holds the whole prompt: the first new token is the argmax of the
    prefill's ``first_logits`` (stop tokens masked when ``min_new_tokens`` >= 1), the rest comes from
    ``model.generate`` on the method's cache. Returns the new tokens ``(1, n)``."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    eos = list(eos_token_id or [])
    logits = first_logits.clone()
    if min_new_tokens >= 1 and eos:
        logits[:, eos] = float("-inf")
    first = logits.argmax(-1, keepdim=True).to(input_ids.device)  # (1, 1)
    if max_new_tokens == 1 or int(first) in eos:
        return first
    ids = torch.cat([input_ids, first], dim=1)
    kwargs: dict[str, Any] = {}
    if eos:
        kwargs["eos_token_id"] = eos
        kwargs["pad_token_id"] = eos[0]
    if min_new_tokens > 1:
        kwargs["min_new_tokens"] = min_new_tokens - 1
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(model, cache),
        max_new_tokens=max_new_tokens - 1,
        **GREEDY,
        **kwargs,
    )
    return out[:, input_ids.shape[1] :]
