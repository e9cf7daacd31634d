"""LongBench prompts as the official ``pred.py`` builds them: the task's template filled, the tokenized prompt
truncated in the middle to the window, the chat template except for the few-shot / code tasks; plus what the Cocktail
search needs, the context as it survives in the prompt and a query."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..chat import CHAT_TOKENIZER_KWARGS, chat_prompt, has_chat_template
from ..methods.kinds import Request

NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
CODE_TASKS = ("lcc", "repobench-p")
_SENTINEL = "\u2063\u2063CONTEXT\u2063\u2063"


@dataclass
class PromptInfo:
    prompt: str  # the final prompt (chat template applied where the protocol says so)
    context: str  # the context as it appears in ``prompt`` (after middle truncation); '' if it could not be located
    query: str  # what the Cocktail search scores the chunks against
    query_source: str  # "input" | "instruction" | "code_tail"
    chat: bool
    truncated: bool
    raw_tokens: int  # tokens of the untruncated prompt
    tokenizer_kwargs: dict = field(default_factory=dict)

    def request(self, example_id: str) -> Request:
        return Request(self.prompt, self.context, self.query, example_id, self.tokenizer_kwargs)


def _context_after_truncation(tok, prompt: str, prefix: str, suffix: str, context: str, ids, offsets, half: int) -> str:
    """The part of the original context that survives the middle truncation, as it appears in ``prompt``."""
    if prompt.startswith(prefix) and prompt.endswith(suffix) and len(prompt) >= len(prefix) + len(suffix):
        return prompt[len(prefix) : len(prompt) - len(suffix)]
    # the cut is outside the context (in the instruction or the question): locate the context tokens by offsets
    c0, c1 = len(prefix), len(prefix) + len(context)
    n = len(ids)

    def inside(t):
        a, b = offsets[t]
        return b > a and a >= c0 and b <= c1

    first = [t for t in range(half) if inside(t)]
    second = [t for t in range(n - half, n) if inside(t)]
    pieces = []
    if first and second and first[-1] == half - 1 and second[0] == n - half:
        pieces.append(tok.decode(ids[first[0] : first[-1] + 1]) + tok.decode(ids[second[0] : second[-1] + 1]))
    for sel in (first, second):
        if sel:
            pieces.append(tok.decode(ids[sel[0] : sel[-1] + 1]))
    for piece in sorted(pieces, key=len, reverse=True):
        for cand in (piece, piece.strip()):
            if cand and cand in prompt:
                return cand
    return ""


def _search_query(task: str, template: str, inp: str, context: str) -> tuple[str, str]:
    """The task's input; without one, the tail of the code (code tasks) or the template's instruction text."""
    if inp.strip():
        return inp, "input"
    if task in CODE_TASKS:
        lines = [ln for ln in context.split("\n") if ln.strip()]
        return "\n".join(lines[-5:]), "code_tail"
    return " ".join(template.replace("{context}", " ").replace("{input}", " ").split()), "instruction"


def build_prompt(tok, task: str, ex: dict, template: str, window: int) -> PromptInfo:
    """LongBench ``pred.py``: fill the template, middle-truncate the tokenized prompt to ``window`` tokens, apply
    the chat template except for the few-shot / code tasks."""
    context, inp = ex["context"], ex["input"]
    prompt = template.format(context=context, input=inp)
    marked = template.format(context=_SENTINEL, input=inp)
    if marked.count(_SENTINEL) != 1:
        raise ValueError(f"the {task} template must contain {{context}} exactly once")
    prefix, suffix = marked.split(_SENTINEL)
    enc = tok(prompt, truncation=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    raw_tokens = len(ids)
    truncated = raw_tokens > window
    if truncated:
        half = window // 2
        prompt = tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)
        ctx = _context_after_truncation(tok, prompt, prefix, suffix, context, ids, offsets, half)
    else:
        ctx = context
    query, source = _search_query(task, template, inp, ctx)
    chat = task not in NO_CHAT_TASKS and has_chat_template(tok)
    if chat:
        final, kwargs = chat_prompt(tok, prompt), dict(CHAT_TOKENIZER_KWARGS)
    else:  # the protocol's few-shot / code tasks, or a tokenizer without a chat template: the completion form
        final, kwargs = prompt, {}
    if ctx and ctx not in final:
        ctx = ""
    return PromptInfo(final, ctx, query, source, chat, truncated, raw_tokens, kwargs)
