"""The text windows the perplexity is measured on: WikiText-2 (test split) and the Paul Graham essays, cut into
windows of ``context + lead + continuation`` tokens at evenly spaced offsets.

A window's prompt is its first ``context`` tokens (the *context*: what the Cocktail kinds quantize) followed by
``lead`` tokens (the text just before the continuation: it stays at full precision like a question would, and is the
search query of the query-aware kinds); the next ``continuation`` tokens are teacher-forced through each method's
cache and scored."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..cli import UsageError
from ..essays import load_essays
from ..methods.kinds import Request
from ..paths import DATA_DIR

WIKITEXT_FILE = os.path.join(DATA_DIR, "wikitext2", "wiki.test.raw")
SOURCES = ("wikitext", "essays")


@dataclass
class Window:
    key: str  # "<source>/<offset>"
    source: str
    offset: int  # the window's first token in the source's token stream
    request: Request  # prompt = context + lead; context = its first part
    continuation: list[int]  # token ids after the prompt


def source_text(source: str, essay_dir: str | None = None, wikitext_file: str | None = None) -> str:
    """The whole text of ``source`` (``wikitext`` or ``essays``)."""
    if source == "essays":
        return "\n\n".join(load_essays(essay_dir))
    if source == "wikitext":
        path = wikitext_file or WIKITEXT_FILE
        if not os.path.isfile(path):
            raise UsageError(f"WikiText-2 not found at {path} (--wikitext-file; the data lives in ../shared/data)")
        with open(path, encoding="utf-8") as f:
            return f.read()
    raise UsageError(f"--sources must name {SOURCES}, got {source!r}")


def offsets(n_tokens: int, span: int, count: int) -> list[int]:
    """``count`` evenly spaced, non-overlapping window starts in a stream of ``n_tokens`` tokens (``span`` tokens
    each); a UsageError when they do not fit."""
    if count * span > n_tokens:
        raise UsageError(f"{count} windows of {span} tokens need {count * span} tokens; the text has {n_tokens}")
    step = (n_tokens - span) // max(1, count - 1) if count > 1 else 0
    return [i * step for i in range(count)]


def make_windows(tok, source: str, text: str, context: int, lead: int, continuation: int, count: int) -> list[Window]:
    """``count`` windows of ``source``'s ``text`` (see the module docstring). The prompt is the decoded text of the
    context and lead tokens (the tokenizer adds its special tokens, e.g. Gemma's BOS, when it is tokenized); the
    continuation keeps the source's own token ids."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    span = context + lead + continuation
    out = []
    for start in offsets(len(ids), span, count):
        prompt = tok.decode(ids[start : start + context + lead])
        ctx = tok.decode(ids[start : start + context])
        if not prompt.startswith(ctx):  # a decoder that cleans up at the cut: the context's text without it
            ctx = ctx.rstrip()
            if not prompt.startswith(ctx):
                raise RuntimeError(f"{source} window at token {start}: the context does not decode as a prefix")
        cont = ids[start + context + lead : start + span]
        request = Request(prompt, ctx, prompt[len(ctx) :], f"{source}-{start}")
        out.append(Window(f"{source}/{start}", source, start, request, cont))
    return out
