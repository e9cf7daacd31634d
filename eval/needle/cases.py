"""The needle cases: a needle sentence with a random 7-digit passcode inserted at a sentence boundary at a depth of a
haystack cut from the essays, the prompt that asks for it, and which chunk(s) the needle landed in."""

from __future__ import annotations

import random

from hf_cocktail import CocktailCache

from ..chat import CHAT_TOKENIZER_KWARGS, chat_prompt, has_chat_template
from ..cli import UsageError
from ..methods.kinds import Request

NEEDLE = "The secret passcode for the vault is {code}."
QUESTION = "What is the secret passcode for the vault?"
INSTRUCTION = "Read the essays below and answer the question that follows them.\n\n"
ASK = "\n\nQuestion: {question} Answer with the passcode only.\nAnswer:"


def case_key(length, depth, sample) -> str:
    return f"L{length}-d{depth:g}-s{sample}"


def make_case(tok, essays: list[str], length: int, depth: float, sample: int, seed: int = 0) -> dict:
    """Haystack of ``length`` tokens (needle included) starting at essay ``sample*7 % n``, needle at ``depth``."""
    rng = random.Random(f"{seed}-{length}-{depth}-{sample}")
    code = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(code=code)
    k = (sample * 7) % len(essays)
    text = "\n\n".join(essays[k:] + essays[:k])
    n_needle = len(tok(" " + needle, add_special_tokens=False)["input_ids"])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise UsageError(f"the haystack has only {len(ids)} tokens, fewer than --lengths {length}")
    hay = tok.decode(ids[: max(1, length - n_needle)])
    pos = len(tok.decode(ids[: int(round(depth * max(0, length - n_needle)))]))
    if pos >= len(hay):
        cut = len(hay)
    else:  # back off to the end of the previous sentence
        cut = max(hay.rfind(". ", 0, pos), hay.rfind(".\n", 0, pos))
        cut = 0 if cut < 0 else cut + 1
    context = (hay[:cut].rstrip() + " " + needle + " " + hay[cut:].lstrip()).strip()
    return {"length": length, "depth": depth, "sample": sample, "code": code, "context": context, "needle_char": cut}


def build_prompt(tok, context: str) -> tuple[str, dict]:
    """The chat prompt (the completion form for a tokenizer without a chat template, :mod:`eval.chat`)."""
    content = INSTRUCTION + context + ASK.format(question=QUESTION)
    if has_chat_template(tok):
        return chat_prompt(tok, content), dict(CHAT_TOKENIZER_KWARGS)
    return content, {}  # the completion form (eval.chat)


def passcode_request(tok, case: dict) -> Request:
    """What every method's cache is built for on the passcode case ``case`` (:func:`make_case`)."""
    prompt, kw = build_prompt(tok, case["context"])
    return Request(prompt, case["context"], QUESTION, case_key(case["length"], case["depth"], case["sample"]), kw)


def span_chunk_bits(tok, request: Request, text: str, cache) -> list[int] | None:
    """Precision of the context chunk(s) holding ``text`` (a needle) in ``request.prompt`` (``cache``: a CocktailCache
    holding the prompt; other caches: None), to see whether the search found it."""
    if not isinstance(cache, CocktailCache):
        return None
    c0 = request.prompt.find(text)
    if c0 < 0:
        return None
    plan = cache.plans[0]
    enc = tok(request.prompt, return_offsets_mapping=True, **request.tokenizer_kwargs)
    toks = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < c0 + len(text) and b > c0]
    C = cache.config.chunk_size
    chunks = sorted({(t - plan.ctx_start) // C for t in toks if plan.ctx_start <= t < plan.ctx_end})
    return [plan.bits[i] for i in chunks]
